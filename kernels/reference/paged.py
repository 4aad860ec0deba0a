"""Paged attention, the numpy oracle for every backend's paged kernel.

Layout (the runtime's contract, ``mgx.runtime.batch.PagedStep``): per attention layer a K cache and a
V cache ``[num_blocks, block_size, num_kv_heads, head_dim]``; the token at position ``p`` of sequence
``i`` lives in block ``block_tables[i, p // block_size]`` at row ``p % block_size``. Sequence ``i``'s
new tokens are rows ``query_start_loc[i]:query_start_loc[i+1]`` of q, k, v and positions.
"""

from __future__ import annotations

import numpy as np

from .ops import attention

__all__ = ["write_kv", "gather_kv", "paged_attention"]


def write_kv(
    k: np.ndarray,
    v: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    positions: np.ndarray,
    block_tables: np.ndarray,
    query_start_loc: np.ndarray,
) -> None:
    """In place: store k, v [T, Hk*D] of each new token in its slot of k_cache, v_cache."""
    num_blocks, block_size, hk, d = k_cache.shape
    lengths = np.diff(query_start_loc)
    seq_of_row = np.repeat(np.arange(lengths.size), lengths)  # [T]
    blocks = block_tables[seq_of_row, positions // block_size]  # [T]
    if blocks.size and (blocks.min() < 0 or blocks.max() >= num_blocks):
        raise IndexError(f"a block table points outside the cache of {num_blocks} blocks: {blocks.tolist()}")
    rows = positions % block_size
    k_cache[blocks, rows] = k.reshape(-1, hk, d)
    v_cache[blocks, rows] = v.reshape(-1, hk, d)


def gather_kv(cache: np.ndarray, table: np.ndarray, length: int) -> np.ndarray:
    """The first ``length`` tokens of one sequence from a paged cache -> [length, Hk*D] (a copy)."""
    block_size = cache.shape[1]
    n_blocks = -(-length // block_size)
    blocks = table[:n_blocks]
    if n_blocks and blocks.min() < 0:
        raise IndexError(
            f"the block table has {int((blocks >= 0).sum())} blocks; {length} tokens need {n_blocks}"
        )
    return cache[blocks].reshape(n_blocks * block_size, -1)[:length]


def paged_attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    positions: np.ndarray,
    block_tables: np.ndarray,
    context_lens: np.ndarray,
    query_start_loc: np.ndarray,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    scale: float,
    sliding_window: int = 0,
) -> np.ndarray:
    """Write this step's k, v [T, Hk*D] to the caches, then causal GQA attention of q [T, Hq*D] -> [T, Hq*D].

    A query at position p of sequence i sees keys j <= p of that sequence (and p - j < sliding_window
    when the window is > 0); ``context_lens[i]`` is the sequence's length once this step is written.
    """
    write_kv(k, v, k_cache, v_cache, positions, block_tables, query_start_loc)
    out = np.empty((q.shape[0], num_heads * head_dim), dtype=np.float32)
    for i in range(context_lens.size):
        rows = slice(int(query_start_loc[i]), int(query_start_loc[i + 1]))
        if rows.start == rows.stop:
            continue
        n = int(context_lens[i])
        keys = gather_kv(k_cache, block_tables[i], n)  # [S, Hk*D], key j at position j
        values = gather_kv(v_cache, block_tables[i], n)
        out[rows] = attention(
            q[rows],
            keys,
            values,
            positions[rows],
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            scale=scale,
            sliding_window=sliding_window,
        )
    return out
