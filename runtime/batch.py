"""What one model step runs on: several sequences' new tokens, packed one after another.

Plain data, no policy: the engine (later the scheduler) decides which sequences and how many
tokens each; the runner and backends read row ranges from here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["SeqChunk", "StepBatch"]


@dataclass(slots=True)
class SeqChunk:
    """One sequence's share of a step: the tokens it adds and where they sit."""

    seq_id: int  # the sequence's key in the KV cache
    token_ids: np.ndarray  # [n] int64, the new tokens (a whole prompt for prefill, 1 for decode)
    positions: np.ndarray | None = None  # [n] int64; None: continue after the cached tokens
    all_logits: bool = False  # return logits for every new token, not only the last

    def __post_init__(self) -> None:
        self.token_ids = np.asarray(self.token_ids, dtype=np.int64).reshape(-1)
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
        positions = [
            c.positions if c.positions is not None else np.arange(s, s + c.token_ids.size, dtype=np.int64)
            for c, s in zip(chunks, start_positions, strict=True)
        ]
        rows = [
            np.arange(cu[i], cu[i + 1]) if c.all_logits else cu[i + 1 : i + 2] - 1
            for i, c in enumerate(chunks)
        ]
        n_rows = np.array([r.size for r in rows], dtype=np.int64)
        cu_rows = np.zeros(len(chunks) + 1, dtype=np.int64)
        np.cumsum(n_rows, out=cu_rows[1:])
        return cls(
            seq_ids=seq_ids,
            token_ids=np.concatenate([c.token_ids for c in chunks]),
            positions=np.concatenate(positions),
            cu_seqlens=cu,
            sample_rows=np.concatenate(rows).astype(np.int64),
            cu_sample_rows=cu_rows,
        )

    @property
    def num_tokens(self) -> int:
        return int(self.cu_seqlens[-1])

    def rows(self, i: int) -> slice:
        """The rows of sequence ``i`` (its index in this batch, not its id)."""
        return slice(int(self.cu_seqlens[i]), int(self.cu_seqlens[i + 1]))

    def sampled(self, i: int) -> slice:
        """Sequence ``i``'s rows in the lm_head output."""
        return slice(int(self.cu_sample_rows[i]), int(self.cu_sample_rows[i + 1]))
