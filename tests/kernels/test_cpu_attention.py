"""The C++ paged attention (write k/v to their slots, then causal GQA attention) against the numpy
reference ``paged_attention`` on every ISA path this host runs: prefill, decode and chunked-prefill
rows mixed in one step, shuffled block tables, block sizes that are not 16, head widths that are not
a multiple of a register, sliding windows, and float32 / float16 / bf16 caches.

Tolerance: atol 3e-6 on outputs of order 1 (float32, online softmax in another order). With 16-bit
caches the reference attends over the same rounded keys and values, so the tolerance is unchanged.
"""

from __future__ import annotations

import numpy as np
import pytest
from _cpu_testing import ISAS

from mgx.kernels import cpu
from mgx.kernels import reference as ref
from mgx.kernels.reference.dtypes import bf16_to_f32, f32_to_bf16

CASES = [  # hq, hk, head_dim, block_size, window
    (9, 3, 64, 16, 0),  # SmolLM2's heads
    (6, 2, 12, 5, 0),
    (4, 1, 5, 3, 0),
    (4, 2, 8, 4, 5),
    (4, 4, 16, 16, 20),
]
# (tokens already cached, new tokens) per sequence: prefill, decode, chunked prefill, 33-row prefill.
SEQS = [(0, 7), (9, 1), (5, 6), (16, 1), (0, 1), (0, 33), (40, 1)]


def _step(hq: int, hk: int, d: int, block_size: int, cache_dtype: str, seed: int = 0):
    """A step's inputs, with earlier tokens already in the caches (garbage in the free slots)."""
    rng = np.random.default_rng(seed)
    num_blocks = sum(-(-(c + n) // block_size) for c, n in SEQS) + 3
    shape = (num_blocks, block_size, hk, d)
    k_cache = rng.standard_normal(shape).astype(np.float32)
    v_cache = rng.standard_normal(shape).astype(np.float32)
    free = list(rng.permutation(num_blocks))
    tables = np.full((len(SEQS), max(-(-(c + n) // block_size) for c, n in SEQS)), -1, np.int32)
    ks, vs = [], []
    for i, (cached, new) in enumerate(SEQS):
        tables[i, : -(-(cached + new) // block_size)] = [free.pop() for _ in range(-(-(cached + new) // block_size))]
        keys = rng.standard_normal((cached + new, hk * d)).astype(np.float32)
        values = rng.standard_normal((cached + new, hk * d)).astype(np.float32)
        for p in range(cached):
            k_cache[tables[i, p // block_size], p % block_size] = keys[p].reshape(hk, d)
            v_cache[tables[i, p // block_size], p % block_size] = values[p].reshape(hk, d)
        ks.append(keys[cached:])
        vs.append(values[cached:])
    qsl = np.concatenate([[0], np.cumsum([n for _, n in SEQS])]).astype(np.int32)
    positions = np.concatenate([np.arange(c, c + n) for c, n in SEQS])
    q = rng.standard_normal((qsl[-1], hq * d)).astype(np.float32)
    k, v = np.concatenate(ks), np.concatenate(vs)
    context = np.array([c + n for c, n in SEQS], np.int32)
    if cache_dtype == "f16":  # what the reference sees: the same rounded values
        k, v = k.astype(np.float16).astype(np.float32), v.astype(np.float16).astype(np.float32)
        stored = k_cache.astype(np.float16), v_cache.astype(np.float16)
        k_cache, v_cache = stored[0].astype(np.float32), stored[1].astype(np.float32)
    elif cache_dtype == "bf16":
        k, v = bf16_to_f32(f32_to_bf16(k)), bf16_to_f32(f32_to_bf16(v))
        stored = f32_to_bf16(k_cache), f32_to_bf16(v_cache)
        k_cache, v_cache = bf16_to_f32(stored[0]), bf16_to_f32(stored[1])
    else:
        stored = k_cache.copy(), v_cache.copy()
    return q, k, v, k_cache, v_cache, stored, positions, tables, context, qsl


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("cache_dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize(("hq", "hk", "d", "block_size", "window"), CASES)
def test_paged_attention_matches_reference(
    isa: str, cache_dtype: str, hq: int, hk: int, d: int, block_size: int, window: int
) -> None:
    q, k, v, k_cache, v_cache, (kc, vc), positions, tables, context, qsl = _step(hq, hk, d, block_size, cache_dtype)
    args = dict(num_heads=hq, num_kv_heads=hk, head_dim=d, scale=d**-0.5, sliding_window=window)
    want = ref.paged_attention(q, k, v, k_cache, v_cache, positions, tables, context, qsl, **args)
    with cpu.use_isa(isa):
        got = cpu.paged_attention(
            q, k, v, kc, vc, positions, tables, context, qsl, **args, bf16_cache=cache_dtype == "bf16"
        )
    np.testing.assert_allclose(got, want, atol=3e-6, rtol=0)
    as_f32 = bf16_to_f32 if cache_dtype == "bf16" else (lambda a: a.astype(np.float32))
    np.testing.assert_array_equal(as_f32(kc), k_cache)  # the step's keys landed in their slots
    np.testing.assert_array_equal(as_f32(vc), v_cache)


def test_paged_attention_reads_strided_inputs() -> None:
    q, k, v, k_cache, v_cache, (kc, vc), positions, tables, context, qsl = _step(6, 2, 12, 5, "f32")
    qkv = np.concatenate([q, k, v], axis=1)  # one fused projection, split into column views
    views = np.split(qkv, [q.shape[1], q.shape[1] + k.shape[1]], axis=1)
    args = dict(num_heads=6, num_kv_heads=2, head_dim=12, scale=0.3)
    want = ref.paged_attention(q, k, v, k_cache, v_cache, positions, tables, context, qsl, **args)
    got = cpu.paged_attention(*views, kc, vc, positions, tables, context, qsl, **args)
    np.testing.assert_allclose(got, want, atol=3e-6, rtol=0)


def test_paged_attention_refuses_tables_outside_the_cache() -> None:
    q, k, v, _, _, (kc, vc), positions, tables, context, qsl = _step(4, 2, 8, 4, "f32")
    tables[0, 0] = kc.shape[0]
    with pytest.raises(ValueError, match="block id outside the cache"):
        cpu.paged_attention(q, k, v, kc, vc, positions, tables, context, qsl, num_heads=4, num_kv_heads=2,
                            head_dim=8, scale=0.3)
