"""Runs the graph for one step over a batch of sequences packed along tokens, K/V in paged blocks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np

from mgx.formats.ir import Graph, IRError, verify

from .backend import Array, Backend, StepResult, create_backend, value_plan
from .batch import BlockTableCache, PagedStep, SeqChunk, StepBatch
from .block_manager import BlockManager, StepBlocks
from .errors import UnsupportedModelError
from .kv_cache import KVCacheError

__all__ = ["LaunchedStep", "ModelRunner"]

# Room a runner made without a block manager gets: this many full-context sequences.
_STANDALONE_SEQUENCES = 4


@dataclass(slots=True)
class LaunchedStep:
    """A greedy step on its way (``ModelRunner.launch_greedy_packed``, ``ModelRunner.launch_ahead``)."""

    batch: StepBatch
    out: StepResult
    starts: list[int]  # each sequence's first position in this step
    # The rows of ``out`` that are this step's sequences (None: all of them): a step launched ahead
    # with sequences that ended before the schedule took it (``ModelRunner.adopt``).
    rows: list[int] | None = None

    def picks(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids [R] int64, their logits [R] float32) of the R sampling sequences; waits for the device."""
        ids, top = ModelRunner._greedy(self.batch, self.out.result())
        return (ids, top) if self.rows is None else (ids[self.rows], top[self.rows])


class ModelRunner:
    """Executes ``graph`` op by op on a backend, over K/V blocks that ``blocks`` hands out.

    The runner knows no policy: callers say which sequences run and with which tokens
    (``SeqChunk``); it returns each sequence's logits and never samples. ``step`` makes sure each
    sequence has blocks for its new tokens (a no-op when the scheduler already allocated them) and,
    once the step ran, commits the tokens to the block manager (which caches full blocks).
    """

    def __init__(
        self, graph: Graph, backend: Backend | str = "reference", *, blocks: BlockManager | None = None
    ) -> None:
        """Without ``blocks`` the runner makes its own manager, with room for a few full-context sequences."""
        try:
            verify(graph)
        except IRError as e:
            raise UnsupportedModelError(f"the model's graph is invalid: {e}") from None
        if len(graph.inputs) != 1 or len(graph.outputs) != 1:
            raise UnsupportedModelError(
                f"expected one input (token ids) and one output (logits), got {graph.inputs} -> {graph.outputs}"
            )
        other_states = sorted({s.kind for s in graph.states} - {"kv"})
        if other_states:
            raise UnsupportedModelError(f"state kinds {other_states} are not supported yet (only 'kv')")
        self.graph = graph
        self.backend = create_backend(backend, graph) if isinstance(backend, str) else backend
        for op in graph.ops:
            if op.kind not in self.backend.supported_ops:
                raise UnsupportedModelError(
                    f"backend {self.backend.name!r} cannot run op {op.kind!r} (from {op.source or '?'})"
                )
        if blocks is None:
            block_size = 16
            blocks = BlockManager(
                _STANDALONE_SEQUENCES * -(-graph.arch.max_position // block_size), block_size
            )
        self.blocks = blocks
        self.kv = self.backend.new_kv_cache(blocks.num_blocks, blocks.block_size, blocks.num_state_slots)
        self._plan, self._num_slots, self._output_slot = value_plan(graph)
        self._block_tables = BlockTableCache()

    def step(self, chunks: Sequence[SeqChunk]) -> list[np.ndarray]:
        """Run one step; returns, per chunk, its logits [R_i, V] (R_i = 1, all rows, or 0 if not sampled)."""
        batch, logits = self._run(chunks, greedy=False)
        return [logits[rows] for rows in batch.sampled_slices()]

    def step_greedy(self, chunks: Sequence[SeqChunk]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Run one step for greedy decoding; per chunk (argmax ids [R_i] int64, their logits [R_i] float32).

        A backend with a fused LM head + argmax (``Backend.greedy_head``) never materializes the
        [R, V] logits; otherwise the argmax (first of equal maxima) is taken here from the logits.
        """
        batch, out = self._run(chunks, greedy=self.backend.has_greedy_head)
        ids, top = self._greedy(batch, out)
        return [(ids[rows], top[rows]) for rows in batch.sampled_slices()]

    def step_packed(
        self, seq_ids: list[int], token_ids: Sequence[int], num_new: Sequence[int], samples: Sequence[bool]
    ) -> np.ndarray:
        """``step`` on tokens already packed: sequence ``seq_ids[i]`` adds the next ``num_new[i]`` of
        ``token_ids``, and its last one picks its next token when ``samples[i]``.

        Returns the logits [R, V] of the R sampling sequences, in order: what ``step`` returns for
        the same chunks (without ``all_logits`` or positions), stacked, with no object per sequence.
        """
        _, logits = self._run_packed(seq_ids, token_ids, num_new, samples, greedy=False)
        return logits

    def step_greedy_packed(
        self, seq_ids: list[int], token_ids: Sequence[int], num_new: Sequence[int], samples: Sequence[bool]
    ) -> tuple[np.ndarray, np.ndarray]:
        """``step_greedy`` on tokens already packed (see ``step_packed``): (ids [R] int64, their logits
        [R] float32) of the R sampling sequences, in order."""
        return self.launch_greedy_packed(seq_ids, token_ids, num_new, samples).picks()

    def launch_greedy_packed(
        self, seq_ids: list[int], token_ids: Sequence[int], num_new: Sequence[int], samples: Sequence[bool]
    ) -> LaunchedStep:
        """``step_greedy_packed`` up to the launch: its tokens are committed, its picks come with
        ``picks()`` (on a backend that overlaps steps, while the device still runs it)."""
        batch, starts = self._packed_batch(seq_ids, token_ids, num_new, samples)
        out = self._launch(batch, starts, num_new, self.backend.has_greedy_head)
        assert out is not None  # _launch raises when blocks run out
        return LaunchedStep(batch, out, starts)

    def launch_ahead(self, prev: LaunchedStep, rows: list[int] | None = None) -> LaunchedStep | None:
        """Launch the decode step after ``prev`` before its picks reach the host: each sequence of
        ``prev`` (those at ``rows``, in order, when given) adds the token ``prev`` picks for it,
        which goes to the step on the device.

        Nothing is committed until ``adopt`` (the host learns the tokens only then). None where it
        cannot be: ``prev`` not a greedy step in which every sequence picks, or no free block."""
        b = prev.batch
        if not b.greedy or b.sample_rows.size != len(b.seq_ids):
            return None
        seq_ids = b.seq_ids if rows is None else [b.seq_ids[i] for i in rows]
        s = len(seq_ids)
        ones = [1] * s
        room = self.blocks.prepare_step(seq_ids, ones)  # (also where each sequence stands)
        if room is None:
            return None
        if prev.rows is not None:  # where those sequences' picks are in ``prev.out``
            rows = [prev.rows[i] for i in (range(s) if rows is None else rows)]
        batch = StepBatch.packed(seq_ids, np.zeros(s, dtype=np.int64), ones, room.starts, [True] * s)
        out = self._launch(batch, room.starts, ones, True, tokens_from=prev.out, room=room, rows=rows)
        return None if out is None else LaunchedStep(batch, out, room.starts)

    def adopt(self, ahead: LaunchedStep, token_ids: list[int], rows: list[int] | None = None) -> LaunchedStep:
        """The schedule took ``ahead`` (``launch_ahead``) with these token ids: commit them. With
        ``rows``, it took the sequences at those rows only (the others ended after the launch; their
        outputs are never read): returns the step as taken, whose picks are those rows'."""
        assert ahead.rows is None, "a step launched ahead is adopted once"
        if rows is not None:
            seq_ids, starts = [ahead.batch.seq_ids[i] for i in rows], [ahead.starts[i] for i in rows]
            s = len(seq_ids)
            batch = StepBatch.packed(seq_ids, np.asarray(token_ids, dtype=np.int64), [1] * s, starts, [True] * s)
            batch.greedy = True
            ahead = LaunchedStep(batch, ahead.out, starts, rows)
        else:
            ahead.batch.token_ids = np.asarray(token_ids, dtype=np.int64)
        self.blocks.commit_step(ahead.batch.seq_ids, token_ids, [1] * len(token_ids))
        return ahead

    @staticmethod
    def _greedy(batch: StepBatch, out: Any) -> tuple[np.ndarray, np.ndarray]:
        if batch.greedy:
            ids, top = out
        else:
            ids = np.argmax(out, axis=1)
            top = out[np.arange(ids.size), ids]
        return np.asarray(ids, dtype=np.int64), np.asarray(top, dtype=np.float32)

    def _run(self, chunks: Sequence[SeqChunk], greedy: bool) -> tuple[StepBatch, Any]:
        seq_ids = [c.seq_id for c in chunks]
        starts = self.blocks.num_computed_many(seq_ids)
        batch = StepBatch.pack(chunks, starts)
        self._check_tokens(batch)
        self._check_positions(batch, starts)
        return batch, self._execute_step(batch, starts, np.diff(batch.cu_seqlens).tolist(), greedy)

    def _run_packed(
        self,
        seq_ids: list[int],
        token_ids: Sequence[int],
        num_new: Sequence[int],
        samples: Sequence[bool],
        greedy: bool,
    ) -> tuple[StepBatch, Any]:
        batch, starts = self._packed_batch(seq_ids, token_ids, num_new, samples)
        return batch, self._execute_step(batch, starts, num_new, greedy)

    def _packed_batch(
        self, seq_ids: list[int], token_ids: Sequence[int], num_new: Sequence[int], samples: Sequence[bool]
    ) -> tuple[StepBatch, list[int]]:
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"a sequence appears twice in one step: {seq_ids}")
        starts = self.blocks.num_computed_many(seq_ids)
        # Positions continue each sequence's cached tokens, so there is nothing to check there.
        batch = StepBatch.packed(seq_ids, np.asarray(token_ids, dtype=np.int64), num_new, starts, samples)
        self._check_tokens(batch)
        return batch, starts

    def _execute_step(self, batch: StepBatch, starts: list[int], sizes: Sequence[int], greedy: bool) -> Any:
        """Blocks for the checked ``batch``, the forward, then the commit of its tokens."""
        out = self._launch(batch, starts, sizes, greedy)
        assert out is not None  # _launch raises when blocks run out
        return out.result()

    def _launch(
        self,
        batch: StepBatch,
        starts: list[int],
        sizes: Sequence[int],
        greedy: bool,
        tokens_from: StepResult | None = None,
        room: StepBlocks | None = None,
        rows: list[int] | None = None,
    ) -> StepResult | None:
        """Blocks for ``batch`` (``room``: ``prepare_step``'s answer when the caller has it), the
        launch, then the commit of its tokens (none with ``tokens_from``, whose picks at ``rows``
        are the tokens: the host does not know them yet). Out of blocks: raises, or None with
        ``tokens_from``."""
        blocks, seq_ids = self.blocks, batch.seq_ids
        batch.greedy = greedy
        if room is None:
            room = blocks.prepare_step(seq_ids, sizes)  # allocates only what the scheduler did not
        if room is None:
            if tokens_from is not None:
                return None
            self._raise_out_of_blocks(seq_ids, starts, sizes)
        tables = self._block_tables(room.tables)
        batch.paged = PagedStep.build(batch, room.tables, blocks.block_size, room.state_slots, tables)
        if tokens_from is not None:
            return self.backend.launch(self.run_ops, batch, self.kv, tokens_from, rows)
        if self.backend.overlaps_steps:
            out = self.backend.launch(self.run_ops, batch, self.kv)
        else:
            out = StepResult(self.execute(batch))  # (``execute`` is where tests and benches hook in)
        blocks.commit_step(seq_ids, batch.token_ids.tolist(), sizes)
        return out

    def _raise_out_of_blocks(self, seq_ids: list[int], starts: list[int], sizes: list[int]) -> NoReturn:
        for seq_id, start, n in zip(seq_ids, starts, sizes, strict=True):
            if not self.blocks.allocate(seq_id, start + n):  # a no-op for those that got their blocks
                raise KVCacheError(
                    f"sequence {seq_id}: no free KV block for {n} more tokens "
                    f"({self.blocks.num_free_blocks} of {self.blocks.num_blocks} blocks free)"
                )
        raise AssertionError("prepare_step failed but every sequence has its blocks")  # pragma: no cover

    def execute(self, batch: StepBatch) -> Any:
        """Run the graph on a packed batch whose paged view is set -> host logits [R, V], or with
        ``batch.greedy`` the pair (ids [R], their logits [R]).

        The backend decides how (op by op, or replaying a captured CUDA graph of the op loop).
        """
        return self.backend.execute(self.run_ops, batch, self.kv)

    def run_ops(self, batch: StepBatch) -> Array:
        """The graph's ops one after another on ``batch`` -> the backend's logits value [R, V].

        Values live in a list indexed by slot numbers fixed at construction (``_plan``), and each
        is dropped after its last reader: a decode step runs hundreds of small ops, so the loop
        itself is kept to list indexing.
        """
        values: list[Any] = [None] * self._num_slots
        values[0] = batch.token_ids
        run, kv = self.backend.run_op, self.kv
        for op, inputs, outputs, dead in self._plan:
            outs = run(op, [values[i] for i in inputs], batch, kv)
            for i, value in zip(outputs, outs):
                values[i] = value
            for i in dead:
                values[i] = None
        return values[self._output_slot]  # [R, V]

    def length(self, seq_id: int) -> int:
        """Tokens cached for ``seq_id``."""
        return self.blocks.num_computed(seq_id)

    def free(self, seq_id: int) -> None:
        """Drop a finished sequence's blocks (full ones stay in the prefix cache until evicted)."""
        self.blocks.free(seq_id)

    def _check_tokens(self, batch: StepBatch) -> None:
        # Checked before any op runs or block is taken, so a bad step leaves every cache as it was.
        vocab = self.graph.arch.vocab_size
        ids = batch.token_ids
        if ids.size and (ids.min() < 0 or ids.max() >= vocab):
            raise ValueError(f"token ids must be in [0, {vocab}), got {int(ids.min())}..{int(ids.max())}")

    def _check_positions(self, batch: StepBatch, starts: list[int]) -> None:
        ids = batch.token_ids
        # Row r of sequence i must sit at position starts[i] + (r - cu[i]): one vectorized check.
        cu = batch.cu_seqlens
        expected = np.repeat(np.asarray(starts, dtype=np.int64) - cu[:-1], np.diff(cu)) + np.arange(ids.size)
        if np.array_equal(batch.positions, expected):
            return
        for i, (seq_id, start) in enumerate(zip(batch.seq_ids, starts, strict=True)):
            pos = batch.positions[batch.rows(i)]
            if pos[0] != start or np.any(np.diff(pos) != 1):
                raise ValueError(
                    f"sequence {seq_id}: new tokens must take positions {start}, {start + 1}, ...; "
                    f"got {pos[:4].tolist()}..."
                )
