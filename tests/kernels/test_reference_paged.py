"""The reference paged attention against the contiguous reference, on shuffled block tables."""

from __future__ import annotations

import numpy as np
import pytest

from mgx.kernels import reference as ref


@pytest.mark.parametrize(
    ("hq", "hk", "d", "block_size", "window"),
    [(4, 4, 8, 16, 0), (6, 2, 8, 4, 0), (4, 1, 5, 3, 0), (4, 2, 8, 4, 5)],
)
def test_paged_attention_matches_contiguous(hq: int, hk: int, d: int, block_size: int, window: int) -> None:
    rng = np.random.default_rng(0)
    # (tokens already cached, new tokens this step) per sequence: prefill, decode, a chunk after a cache.
    seqs = [(0, 7), (9, 1), (5, 6), (block_size, 1), (0, 1)]
    num_blocks = sum(-(-(c + n) // block_size) for c, n in seqs) + 3
    k_cache = rng.standard_normal((num_blocks, block_size, hk, d)).astype(np.float32)  # garbage in free slots
    v_cache = rng.standard_normal((num_blocks, block_size, hk, d)).astype(np.float32)
    free = list(rng.permutation(num_blocks))
    width = max(-(-(c + n) // block_size) for c, n in seqs)
    tables = np.full((len(seqs), width), -1, np.int32)
    full_k, full_v = [], []
    for i, (cached, new) in enumerate(seqs):
        n_blocks = -(-(cached + new) // block_size)
        tables[i, :n_blocks] = [free.pop() for _ in range(n_blocks)]
        keys = rng.standard_normal((cached + new, hk * d)).astype(np.float32)
        values = rng.standard_normal((cached + new, hk * d)).astype(np.float32)
        for p in range(cached):  # what earlier steps wrote
            k_cache[tables[i, p // block_size], p % block_size] = keys[p].reshape(hk, d)
            v_cache[tables[i, p // block_size], p % block_size] = values[p].reshape(hk, d)
        full_k.append(keys)
        full_v.append(values)
    lengths = [n for _, n in seqs]
    qsl = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    positions = np.concatenate([np.arange(c, c + n) for c, n in seqs])
    q = rng.standard_normal((qsl[-1], hq * d)).astype(np.float32)
    k = np.concatenate([fk[c:] for fk, (c, _) in zip(full_k, seqs)])
    v = np.concatenate([fv[c:] for fv, (c, _) in zip(full_v, seqs)])
    context = np.array([c + n for c, n in seqs], np.int32)
    args = dict(num_heads=hq, num_kv_heads=hk, head_dim=d, scale=d**-0.5, sliding_window=window)
    got = ref.paged_attention(q, k, v, k_cache, v_cache, positions, tables, context, qsl, **args)
    for i, (cached, new) in enumerate(seqs):
        rows = slice(qsl[i], qsl[i + 1])
        want = ref.attention(q[rows], full_k[i], full_v[i], positions[rows], **args)
        np.testing.assert_allclose(got[rows], want, atol=1e-6)
        np.testing.assert_array_equal(ref.gather_kv(k_cache, tables[i], cached + new), full_k[i])
        np.testing.assert_array_equal(ref.gather_kv(v_cache, tables[i], cached + new), full_v[i])


def test_write_kv_rejects_tables_outside_the_cache() -> None:
    cache = np.zeros((2, 4, 1, 2), np.float32)
    with pytest.raises(IndexError, match="outside the cache"):
        ref.write_kv(
            np.ones((1, 2), np.float32),
            np.ones((1, 2), np.float32),
            cache,
            cache.copy(),
            np.array([0]),
            np.array([[5]], np.int32),
            np.array([0, 1], np.int32),
        )
