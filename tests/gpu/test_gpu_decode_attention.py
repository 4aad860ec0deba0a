"""The native paged decode attention (``kernels/cuda/attention.cu``) on a GPU: against the torch
reference after ``rope_and_write_kv``, and against the Triton decode kernel, with RoPE and this
step's K/V write fused, sliding windows, GQA groups of 1 to 8, pieces from 1 to 16 (clusters past the
portable 8), several tiles a piece, a batch of sequences, in a CUDA graph launched overlapped.
Skipped without CUDA, nvcc or sm_90."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

pytestmark = pytest.mark.gpu

from mgx.kernels.cuda import attention as natt  # noqa: E402
from mgx.kernels.cuda import build  # noqa: E402
from mgx.kernels.cuda import rmsnorm as crms  # noqa: E402
from mgx.kernels.triton import attention as att  # noqa: E402
from mgx.kernels.triton._common import overlapped_launches  # noqa: E402
from mgx.kernels.triton.rope import rope_and_write_kv  # noqa: E402
from mgx.kernels.triton.testing import paged_batch  # noqa: E402

D = 128


@pytest.fixture(scope="module")
def native():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("thread-block clusters need sm_90")
    if build.find_nvcc() is None:
        pytest.skip("needs nvcc")
    arch = build.arch_for(*torch.cuda.get_device_capability())
    kernels = crms.load_cuda_kernels(build.build_cuda_kernels(arch), arch)
    assert kernels is not None
    kernels.allow_overlap(torch.cuda.get_device_capability()[0] * 10)
    return kernels


def _case(contexts, hq, hk, page=16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    b = paged_batch(contexts, [1] * len(contexts), num_heads=hq, num_kv_heads=hk, head_dim=D, block_size=page,
                    dtype=torch.bfloat16, device="cuda", generator=g)  # fmt: skip
    return b


def _inv(rot: int) -> torch.Tensor:
    return (1.0 / 500000.0 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot)).cuda()


def _reference(b, inv, rot, window, scale):
    """rope_and_write_kv into copies of the caches, then the torch reference (fp32) on them."""
    kc, vc = b.k_cache.clone(), b.v_cache.clone()
    q, k = b.q.clone(), b.k.clone()
    rope_and_write_kv(q, k, b.v, b.positions, inv, kc, vc, b.block_table, b.query_start_loc, head_dim=D,
                      rotary_dim=rot, attention_scaling=0.9)  # fmt: skip
    want = att.paged_attention_ref(q, kc, vc, b.block_table, b.context_lens, b.query_start_loc, b.positions,
                                   scale=scale, sliding_window=window)  # fmt: skip
    return want, q, kc, vc


CASES = [
    # contexts, Hq, Hk, pieces, window, rotary dim
    ([768], 32, 8, 8, 0, None),  # the 8B bench's shape: one tile a piece
    ([768], 32, 8, 16, 0, None),  # 16-block clusters (non-portable)
    ([1, 13, 200], 32, 8, 4, 0, None),  # a batch; pieces with no keys
    ([3000], 28, 4, 8, 0, 64),  # G = 7, several tiles a piece, partial rotation
    ([3000], 28, 4, 1, 0, None),  # one piece: every tile in one block
    ([900, 37], 8, 8, 3, 100, None),  # G = 1, a sliding window
    ([2050], 64, 8, 5, 700, None),  # G = 8, a window across pieces
]


@pytest.mark.parametrize(("contexts", "hq", "hk", "pieces", "window", "rot"), CASES)
def test_native_decode_equals_the_reference(native, contexts, hq, hk, pieces, window, rot) -> None:
    b = _case(contexts, hq, hk, seed=len(contexts) + hq + pieces)
    inv = _inv(rot or D)
    scale = D**-0.5
    want, q_rot, kc_want, vc_want = _reference(b, inv, rot, window, scale)
    kc, vc = b.k_cache.clone(), b.v_cache.clone()
    q, k, v = b.q.clone(), b.k.clone(), b.v.clone()
    assert natt.decode_attention_applies(native, q, kc, vc)
    got = natt.decode_attention(q, kc, vc, b.block_table, b.context_lens, kernels=native, scale=scale, pieces=pieces,
                                sliding_window=window, rope=att.DecodeRope(k, v, inv, rot, attention_scaling=0.9))  # fmt: skip
    torch.cuda.synchronize()
    assert torch.equal(q, b.q) and torch.equal(k, b.k) and torch.equal(v, b.v)  # inputs untouched
    assert torch.equal(vc, vc_want)  # v written into its slot as it is
    # k rotated with transformers' roundings: the same bits as rope_and_write_kv's, but for cos/sin
    # of the native libm and Triton's differing by an ulp before their bf16 rounding.
    assert (kc.float() - kc_want.float()).abs().max().item() <= 2e-2
    assert (kc != kc_want).sum().item() <= hk * D // 16
    # bf16 inputs, fp32 sums, one bf16 rounding: within a bf16 ulp or two of the fp32 reference.
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)
    triton_out = att.paged_attention_decode(q_rot, kc_want, vc_want, b.block_table, b.context_lens, scale=scale,
                                            sliding_window=window)  # fmt: skip
    torch.testing.assert_close(got.float(), triton_out.float(), atol=2e-2, rtol=2e-2)


def test_native_decode_without_rope_reads_the_cache_as_it_is(native) -> None:
    b = _case([500, 64], 32, 8, seed=3)
    scale = 0.1
    att.write_kv(b.k, b.v, b.positions, b.k_cache, b.v_cache, b.block_table, b.query_start_loc)
    kc, vc = b.k_cache.clone(), b.v_cache.clone()
    got = natt.decode_attention(b.q, kc, vc, b.block_table, b.context_lens, kernels=native, scale=scale, pieces=8)
    want = att.paged_attention_ref(b.q, b.k_cache, b.v_cache, b.block_table, b.context_lens, b.query_start_loc,
                                   b.positions, scale=scale)  # fmt: skip
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)
    assert torch.equal(kc, b.k_cache) and torch.equal(vc, b.v_cache)


def test_native_decode_in_an_overlapped_graph_follows_the_kernel_before_it(native) -> None:
    """Captured with programmatic dependent launches after a kernel that writes q: the replay reads
    the q of that replay (the kernel waits for its predecessor), step after step."""
    b = _case([700], 32, 8, seed=5)
    inv = _inv(D)
    base = b.q.clone()
    q = torch.empty_like(base)
    out = torch.empty_like(base)
    kc, vc = b.k_cache.clone(), b.v_cache.clone()
    rope = att.DecodeRope(b.k, b.v, inv, None, attention_scaling=0.9)
    shift = torch.zeros(1, device="cuda", dtype=torch.bfloat16)

    def step() -> None:
        torch.add(base, shift, out=q)
        natt.decode_attention(q, kc, vc, b.block_table, b.context_lens, kernels=native, scale=D**-0.5, pieces=8,
                              rope=rope, out=out)  # fmt: skip

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), overlapped_launches(True):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with overlapped_launches(True), torch.cuda.graph(graph):
        step()
    for value in (0.0, 0.5, -1.0):
        shift.fill_(value)
        graph.replay()
        torch.cuda.synchronize()
        want, *_ = _reference(dataclasses.replace(b, q=base + shift), inv, None, 0, D**-0.5)
        torch.testing.assert_close(out.float(), want.float(), atol=1e-2, rtol=1e-2)


def test_native_decode_applies_only_where_it_can(native) -> None:
    b = _case([40], 32, 8)
    assert natt.decode_attention_applies(native, b.q, b.k_cache, b.v_cache)
    assert not natt.decode_attention_applies(None, b.q, b.k_cache, b.v_cache)
    assert not natt.decode_attention_applies(native, b.q.float(), b.k_cache.float(), b.v_cache.float())
    wide = _case([40], 128, 8)  # 16 query heads a kv head
    assert not natt.decode_attention_applies(native, wide.q, wide.k_cache, wide.v_cache)
    g = torch.Generator(device="cuda").manual_seed(1)
    small = paged_batch([40], [1], num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.bfloat16,
                        device="cuda", generator=g)  # fmt: skip
    assert not natt.decode_attention_applies(native, small.q, small.k_cache, small.v_cache)
    with pytest.raises(ValueError, match="pieces"):
        natt.decode_attention(b.q, b.k_cache, b.v_cache, b.block_table, b.context_lens, kernels=native, scale=1.0,
                              pieces=17)  # fmt: skip
