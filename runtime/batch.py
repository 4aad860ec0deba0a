"""What one model step runs on: several sequences' new tokens, packed one after another.

Plain data, no policy: the scheduler decides which sequences and how many tokens each; the runner
packs them into a ``StepBatch`` and attaches a ``PagedStep`` (where each sequence's K/V lives), and
every backend reads the same arrays from there.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["BlockTableCache", "PagedStep", "SeqChunk", "StepBatch", "block_table_array"]


@dataclass(slots=True)
class SeqChunk:
    """One sequence's share of a step: the tokens it adds and where they sit."""

    seq_id: int  # the sequence's key in the KV cache
    token_ids: np.ndarray  # [n] int64, the new tokens (a whole prompt for prefill, 1 for decode)
    positions: np.ndarray | None = None  # [n] int64; None: continue after the cached tokens
    all_logits: bool = False  # return logits for every new token, not only the last
    sample: bool = True  # False: no logits at all (a prefill chunk that does not end the prompt)

    def __post_init__(self) -> None:
        t = self.token_ids
        # An int64 vector is kept as is: a decode step makes one chunk per sequence.
        if not (type(t) is np.ndarray and t.ndim == 1 and t.dtype == np.int64):
            self.token_ids = np.asarray(t, dtype=np.int64).reshape(-1)
        if self.token_ids.size == 0:
            raise ValueError(f"sequence {self.seq_id}: a step needs at least one token")
        if self.positions is not None:
            self.positions = np.asarray(self.positions, dtype=np.int64).reshape(-1)
            if self.positions.shape != self.token_ids.shape:
                raise ValueError(
                    f"sequence {self.seq_id}: {self.positions.size} positions for {self.token_ids.size} tokens"
                )


@dataclass(slots=True)
class StepBatch:
    """The packed form of a list of chunks; sequence i owns rows ``cu_seqlens[i]:cu_seqlens[i+1]``."""

    seq_ids: list[int]  # one per sequence, in packing order
    token_ids: np.ndarray  # [T] int64, every sequence's new tokens
    positions: np.ndarray  # [T] int64, each token's position in its sequence
    cu_seqlens: np.ndarray  # [B+1] int64 row offsets (cumulative lengths, as in varlen attention)
    sample_rows: np.ndarray  # [R] int64 rows lm_head runs on, grouped by sequence
    cu_sample_rows: np.ndarray  # [B+1] int64 offsets into sample_rows per sequence
    paged: PagedStep | None = None  # where the K/V of each sequence lives; set by the runner
    greedy: bool = False  # the lm_head gives each sampled row's argmax and its logit, not the logits

    @classmethod
    def pack(cls, chunks: Sequence[SeqChunk], start_positions: Sequence[int]) -> StepBatch:
        """Pack ``chunks``; a chunk without positions starts at its ``start_positions`` entry."""
        if not chunks:
            raise ValueError("a step needs at least one sequence")
        seq_ids = [c.seq_id for c in chunks]
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"a sequence appears twice in one step: {seq_ids}")
        lengths = np.array([c.token_ids.size for c in chunks], dtype=np.int64)
        cu = np.zeros(len(chunks) + 1, dtype=np.int64)
        np.cumsum(lengths, out=cu[1:])
        starts = np.asarray(start_positions, dtype=np.int64)
        if len(starts) != len(chunks):
            raise ValueError(f"{len(starts)} start positions for {len(chunks)} chunks")
        # Each row's position continues its sequence: start + (row - first row of the sequence).
        positions = np.repeat(starts - cu[:-1], lengths) + np.arange(cu[-1], dtype=np.int64)
        for i, c in enumerate(chunks):
            if c.positions is not None:
                positions[cu[i] : cu[i + 1]] = c.positions
        if any(c.all_logits for c in chunks):
            rows = np.concatenate([
                np.arange(cu[i], cu[i + 1]) if c.all_logits else (cu[i + 1 : i + 2] - 1 if c.sample else cu[:0])
                for i, c in enumerate(chunks)
            ]).astype(np.int64)  # fmt: skip
            n_rows = np.diff(np.searchsorted(rows, cu, side="left"))
        else:  # the common step: each sampling sequence's last row
            samples = np.fromiter((c.sample for c in chunks), dtype=bool, count=len(chunks))
            rows = cu[1:][samples] - 1
            n_rows = samples.astype(np.int64)
        cu_rows = np.zeros(len(chunks) + 1, dtype=np.int64)
        np.cumsum(n_rows, out=cu_rows[1:])
        return cls(
            seq_ids=seq_ids,
            token_ids=np.concatenate([c.token_ids for c in chunks]),
            positions=positions,
            cu_seqlens=cu,
            sample_rows=rows,
            cu_sample_rows=cu_rows,
        )

    @classmethod
    def packed(
        cls,
        seq_ids: list[int],
        token_ids: np.ndarray,
        num_new: Sequence[int],
        start_positions: Sequence[int],
        samples: Sequence[bool],
    ) -> StepBatch:
        """A batch from tokens already packed: sequence i has the next ``num_new[i]`` of ``token_ids``
        from position ``start_positions[i]``, and its last row is sampled when ``samples[i]``.

        What ``pack`` makes of the same chunks, without an object or an array per sequence.
        """
        b = len(seq_ids)
        if b == 0:
            raise ValueError("a step needs at least one sequence")
        if len(num_new) != b or len(start_positions) != b or len(samples) != b:
            raise ValueError(
                f"{b} sequences but {len(num_new)} token counts, {len(start_positions)} start positions "
                f"and {len(samples)} sample flags"
            )
        if min(num_new) < 1:
            raise ValueError(f"sequence {seq_ids[list(num_new).index(min(num_new))]}: a step needs at least one token")
        total = sum(num_new)
        if total != token_ids.size:
            raise ValueError(f"{token_ids.size} token ids for {total} new tokens")
        starts = np.array(start_positions, dtype=np.int64)
        if total == b:  # a decode step: one token each
            cu = np.arange(b + 1, dtype=np.int64)
            positions = starts
        else:
            lengths = np.array(num_new, dtype=np.int64)
            cu = np.zeros(b + 1, dtype=np.int64)
            np.cumsum(lengths, out=cu[1:])
            positions = np.repeat(starts - cu[:-1], lengths) + np.arange(total, dtype=np.int64)
        sample = np.array(samples, dtype=bool)
        cu_rows = np.zeros(b + 1, dtype=np.int64)
        np.cumsum(sample, out=cu_rows[1:])
        return cls(
            seq_ids=seq_ids,
            token_ids=token_ids,
            positions=positions,
            cu_seqlens=cu,
            sample_rows=cu[1:][sample] - 1,
            cu_sample_rows=cu_rows,
        )

    @property
    def num_tokens(self) -> int:
        return int(self.cu_seqlens[-1])

    def rows(self, i: int) -> slice:
        """The rows of sequence ``i`` (its index in this batch, not its id)."""
        return slice(int(self.cu_seqlens[i]), int(self.cu_seqlens[i + 1]))

    def sampled_slices(self) -> list[slice]:
        """Each sequence's rows in the lm_head output, in packing order."""
        cu = self.cu_sample_rows.tolist()
        return [slice(a, b) for a, b in zip(cu, cu[1:])]


@dataclass(slots=True)
class PagedStep:
    """The paged-attention contract of one step: what every attention kernel reads.

    K and V of an attention layer are ``[num_blocks, block_size, num_kv_heads, head_dim]`` arrays
    (see ``kv_cache.py``). The token at position ``p`` of sequence ``i`` lives in block
    ``block_tables[i, p // block_size]``, row ``p % block_size``. The attention op first writes this
    step's k/v rows to their slots, then lets each query at position ``p`` see the keys at positions
    ``j <= p`` (and ``j > p - sliding_window`` when the window is > 0), with query head ``h`` reading
    kv head ``h // (Hq / Hk)``.
    """

    block_size: int  # tokens per block
    block_tables: np.ndarray  # [B, max_blocks] int32 block ids; -1 past a sequence's last block
    context_lens: np.ndarray  # [B] int32 tokens cached for each sequence once this step's are written
    query_start_loc: np.ndarray  # [B+1] int32: sequence i's rows (q, k, v, positions) are [qsl[i], qsl[i+1])
    slot_mapping: np.ndarray  # [T] int64 flat slot of each new token: block * block_size + p % block_size
    state_slots: np.ndarray  # [B] int32 recurrent-state slot of each sequence; -1 when it has none

    @classmethod
    def build(
        cls,
        batch: StepBatch,
        tables: Sequence[Sequence[int]],
        block_size: int,
        state_slots: Sequence[int | None] | None = None,
        block_tables: np.ndarray | None = None,
    ) -> PagedStep:
        """The paged view of ``batch`` given each sequence's block table (block ids in position order).

        ``block_tables``: ``block_table_array(tables)`` when the caller has it already.
        """
        b = len(tables)
        block_tables = block_table_array(tables) if block_tables is None else block_tables
        lengths = np.diff(batch.cu_seqlens)
        context_lens = (batch.positions[batch.cu_seqlens[1:] - 1] + 1).astype(np.int32)  # chunks are never empty
        seq_of_row = np.repeat(np.arange(b), lengths)
        pos = batch.positions
        slot_mapping = (
            block_tables[seq_of_row, pos // block_size].astype(np.int64) * block_size + pos % block_size
        )
        if state_slots is None or state_slots.count(None) == len(state_slots):  # no recurrent state
            slots = np.full(b, -1, dtype=np.int32)
        else:
            slots = np.array([-1 if s is None else s for s in state_slots], dtype=np.int32)
        return cls(
            block_size=block_size,
            block_tables=block_tables,
            context_lens=context_lens,
            query_start_loc=batch.cu_seqlens.astype(np.int32),
            slot_mapping=slot_mapping,
            state_slots=slots,
        )


def block_table_array(tables: Sequence[Sequence[int]]) -> np.ndarray:
    """[B, max(1, longest)] int32: row i holds ``tables[i]``, then -1."""
    b = len(tables)
    widths = np.fromiter(map(len, tables), dtype=np.int64, count=b)
    width = max(int(widths.max()) if b else 0, 1)
    out = np.full((b, width), -1, dtype=np.int32)
    # Row i's first widths[i] entries, in row-major order: the tables one after another.
    out[np.arange(width) < widths[:, None]] = np.fromiter(
        itertools.chain.from_iterable(tables), dtype=np.int32, count=int(widths.sum())
    )
    return out


class BlockTableCache:
    """``block_table_array`` of consecutive steps, redoing only the rows whose table grew.

    The tables are the block manager's own lists, which only grow while their sequence lives (a
    sequence admitted again gets a new list). So when a step has the same list objects as the one
    before, as decode steps do, each row is its old row plus the blocks appended since; in a decode
    step that is one sequence in ``block_size`` at most.
    """

    def __init__(self) -> None:
        self._tables: list[Sequence[int]] = []  # the last step's lists (kept alive, so identity is safe)
        self._widths = np.zeros(0, dtype=np.int64)
        self._array = np.full((0, 1), -1, dtype=np.int32)

    def __call__(self, tables: Sequence[Sequence[int]]) -> np.ndarray:
        """A new array each call (a backend may keep the previous one)."""
        widths = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
        old, old_widths = self._tables, self._widths
        if len(old) == len(tables) and all(map(operator.is_, tables, old)) and not np.any(widths < old_widths):
            width = max(int(widths.max()) if len(tables) else 0, 1)
            out = self._array
            if width > out.shape[1]:
                out = np.pad(out, ((0, 0), (0, width - out.shape[1])), constant_values=-1)
            else:
                out = out.copy()
            for i in np.flatnonzero(widths != old_widths).tolist():
                w, table = int(old_widths[i]), tables[i]
                out[i, w : len(table)] = table[w:]
        else:
            out = block_table_array(tables)
        self._tables, self._widths, self._array = list(tables), widths, out
        return out
