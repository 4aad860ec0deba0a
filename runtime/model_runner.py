"""Runs the graph for one step over a batch of sequences packed along tokens, K/V in paged blocks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NoReturn

import numpy as np

from mgx.formats.ir import Graph, IRError, verify

from .backend import Array, Backend, create_backend, value_plan
from .batch import PagedStep, SeqChunk, StepBatch
from .block_manager import BlockManager
from .errors import UnsupportedModelError
from .kv_cache import KVCacheError

__all__ = ["ModelRunner"]

# Room a runner made without a block manager gets: this many full-context sequences.
_STANDALONE_SEQUENCES = 4


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
        if batch.greedy:
            ids, top = out
        else:
            ids = np.argmax(out, axis=1)
            top = out[np.arange(ids.size), ids]
        ids, top = np.asarray(ids, dtype=np.int64), np.asarray(top, dtype=np.float32)
        return [(ids[rows], top[rows]) for rows in batch.sampled_slices()]

    def _run(self, chunks: Sequence[SeqChunk], greedy: bool) -> tuple[StepBatch, Any]:
        blocks = self.blocks
        seq_ids = [c.seq_id for c in chunks]
        starts = [blocks.num_computed(s) for s in seq_ids]
        batch = StepBatch.pack(chunks, starts)
        batch.greedy = greedy
        self._check_positions(batch, starts)
        sizes = np.diff(batch.cu_seqlens).tolist()
        room = blocks.prepare_step(seq_ids, sizes)  # allocates only what the scheduler did not
        if room is None:
            self._raise_out_of_blocks(seq_ids, starts, sizes)
        batch.paged = PagedStep.build(batch, room.tables, blocks.block_size, room.state_slots)
        out = self.execute(batch)
        ids, cu = batch.token_ids.tolist(), batch.cu_seqlens.tolist()
        for i, seq_id in enumerate(seq_ids):
            blocks.commit(seq_id, ids[cu[i] : cu[i + 1]])
        return batch, out

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

    def _check_positions(self, batch: StepBatch, starts: list[int]) -> None:
        # Checked before any op runs or block is taken, so a bad step leaves every cache as it was.
        vocab = self.graph.arch.vocab_size
        ids = batch.token_ids
        if ids.size and (ids.min() < 0 or ids.max() >= vocab):
            raise ValueError(f"token ids must be in [0, {vocab}), got {int(ids.min())}..{int(ids.max())}")
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
