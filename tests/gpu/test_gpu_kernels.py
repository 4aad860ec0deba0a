"""The GPU kernels compiled for a real GPU, on model-sized shapes: the native CUDA RMSNorm built with
nvcc and loaded through the driver API (and its fallback), CUDA graph capture, and the Triton
kernels at Llama-3.1-8B shapes against torch references. Skipped without CUDA."""

from __future__ import annotations

import dataclasses
import os
import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

pytestmark = pytest.mark.gpu

from mgx.kernels.cuda import build, driver  # noqa: E402
from mgx.kernels.cuda import rmsnorm as crms  # noqa: E402
from mgx.kernels.triton import attention as att  # noqa: E402
from mgx.kernels.triton import linear as lin  # noqa: E402
from mgx.kernels.triton import lm_head, rope  # noqa: E402
from mgx.kernels.triton import rmsnorm as trms  # noqa: E402
from mgx.kernels.triton.testing import make_weight, paged_batch  # noqa: E402


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    assert not torch.isnan(got).any(), "NaN in output"
    return float((got - want).norm() / want.norm())


def device_arch() -> str:
    return build.arch_for(*torch.cuda.get_device_capability())


@pytest.fixture(scope="module")
def native():
    if build.find_nvcc() is None:
        pytest.skip("needs nvcc")
    arch = device_arch()
    kernels = crms.load_cuda_kernels(build.build_cuda_kernels(arch), arch)
    assert kernels is not None
    return kernels


GEMV_WEIGHTS = [
    ("int4", {"group_size": 128, "symmetric": True}),
    ("int4", {"group_size": 32, "symmetric": False}),
    ("int4", {"group_size": 8, "symmetric": False}),
    ("w8a16", {}),
    ("none", {}),
]


GEMV_CASES = [(scheme, kw, "gemv") for scheme, kw in GEMV_WEIGHTS] + [
    ("int4", {"group_size": 128, "symmetric": True}, "mma"),
    ("int4", {"group_size": 128, "symmetric": False}, "mma"),
    ("int4", {"group_size": 128, "symmetric": True}, "mma_pipelined"),
    ("int4", {"group_size": 128, "symmetric": False}, "mma_pipelined"),
    ("w8a16", {}, "mma"),
    ("w8a16", {}, "mma_pipelined"),
    ("w8a16", {}, "imma"),
    ("w8a16", {}, "imma_persistent"),
    ("int4", {"group_size": 128, "symmetric": True}, "imma"),
    ("int4", {"group_size": 128, "symmetric": False}, "imma"),
    ("int4", {"group_size": 128, "symmetric": False}, "imma_persistent"),
    ("w8a16", {}, "imma_w4"),
    ("w8a16", {}, "imma_w16"),
    ("int4", {"group_size": 128, "symmetric": False}, "imma_w4"),
    ("int4", {"group_size": 128, "symmetric": True}, "imma_w16"),
    ("w8a16", {}, "imma_persistent_w4"),
    ("int4", {"group_size": 128, "symmetric": False}, "imma_persistent_w4"),
]


@pytest.mark.parametrize(("scheme", "kw", "kind"), GEMV_CASES)
@pytest.mark.parametrize(("n", "k"), [(4096, 4096), (4096, 14336), (28672, 4096), (4098, 2176), (6, 256)])
@pytest.mark.parametrize("silu", [False, True])
def test_native_gemv_matches_the_reference(native, scheme: str, kw: dict, kind: str, n: int, k: int, silu: bool) -> None:
    """The native GEMVs (one bf16 row; int4, W8A16 or dense bf16 weights on the CUDA cores, int4 with
    groups of 128 and W8A16 on the tensor cores) against the fp32 reference: within one bf16
    rounding of the output (relative error < 4e-3 over the row), with and without bias, and fused
    with the SiLU-gated product (2049 outputs for 4098 rows). Rows past the last block's end and K not
    a multiple of the threads' stride are covered by 4098 x 2176 and 6 x 256."""
    from mgx.kernels.cuda import gemv as cg

    gen = torch.Generator(device="cuda").manual_seed(n + k)
    w = make_weight(scheme, n, k, device="cuda", generator=gen, **kw)
    x = torch.randn(1, k, device="cuda", generator=gen).to(torch.bfloat16)
    for bias in (None, torch.randn(n, device="cuda", generator=gen).to(torch.bfloat16)):
        assert cg.gemv_applies(native, x, w, bias, kind=kind)
        got = cg.gemv(x, w, bias, kernels=native, silu_mul=silu, kind=kind)
        want = lin.linear_silu_mul_ref(x, w, bias) if silu else lin.linear_ref(x, w, bias)
        assert got.shape == want.shape and got.dtype == torch.bfloat16
        assert rel_err(got, want) < 4e-3


@pytest.mark.parametrize(("scheme", "kw", "kind"), GEMV_CASES)
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4098, 2176), (6, 256)])
@pytest.mark.parametrize("silu", [False, True])
def test_native_gemv_with_the_rmsnorm_prologue(native, scheme: str, kw: dict, kind: str, n: int, k: int, silu: bool) -> None:
    """The ``_norm`` entries: the row is rms_norm(res + delta) * g, computed by every block. The sum
    they write is bf16(res + delta) to the bit; the output is within one bf16 rounding of the fp32
    reference on the torch RMSNorm's row (rel. error < 4e-3), and of the native RMSNorm then GEMV
    (< 4e-3: 1/rms may differ in its last bit, the sums of squares running in another order). Also
    without delta (a first layer's norm) and without a weight (a folded norm)."""
    from mgx.kernels.cuda import gemv as cg

    gen = torch.Generator(device="cuda").manual_seed(n + k + 1)
    w = make_weight(scheme, n, k, device="cuda", generator=gen, **kw)
    res = (3 * torch.randn(1, k, device="cuda", generator=gen)).to(torch.bfloat16)
    delta = torch.randn(1, k, device="cuda", generator=gen).to(torch.bfloat16)
    g = (1 + 0.2 * torch.randn(k, device="cuda", generator=gen)).to(torch.bfloat16)
    ref = lin.linear_silu_mul_ref if silu else lin.linear_ref
    for d, weight in ((delta, g), (None, g), (delta, None)):
        total = None if d is None else torch.full_like(res, float("nan"))
        norm = cg.NormPrologue(d, weight, 1e-5, total)
        assert cg.gemv_applies(native, res, w, kind=kind, norm=norm)
        got = cg.gemv(res, w, kernels=native, silu_mul=silu, kind=kind, norm=norm)
        if d is None:
            normed = trms.rms_norm_ref(res, weight, 1e-5)
            apart = crms.rms_norm(res, weight, 1e-5, kernels=native)
        else:
            normed, want_total = trms.rms_norm_ref(res, weight, 1e-5, residual=d)
            assert torch.equal(total, want_total)
            apart, _ = crms.rms_norm(res, weight, 1e-5, residual=d, kernels=native)
        assert rel_err(got, ref(normed, w)) < 4e-3
        assert rel_err(got, cg.gemv(apart, w, kernels=native, silu_mul=silu, kind=kind)) < 4e-3


@pytest.mark.parametrize(("n", "k"), [(28672, 4096), (4096, 14336), (6144, 4096), (8192, 8192), (4096, 2176)])
@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("kind", ["mma_persistent", "mma_pipelined"])
@pytest.mark.parametrize("scheme", ["int4", "w8a16"])
def test_native_mma_gemv_kinds_give_the_same_bits(native, n: int, k: int, silu: bool, kind: str, scheme: str) -> None:  # noqa: ANN001
    """Kind ``mma_persistent`` (the tensor-core GEMV on two blocks per SM, each taking every grid-th
    group of outputs and prefetching ahead) and kind ``mma_pipelined`` (its own entry, loading a
    warp's next steps while it computes the current ones) give the one-block-per-group ``mma``
    launch's output to the bit, int4 and W8A16 (the same sums in the same order), eagerly and
    replayed from a CUDA graph. K = 2176 is 17 steps: the warps' last passes are partial. n / 16 groups: on an H200 (264 blocks) those of 28672, 8192 and 6144 rows loop over several groups, 4096 rows
    not; K = 8192 takes each warp through its steps twice (the second from L2 prefetches)."""
    from mgx.kernels.cuda import gemv as cg

    gen = torch.Generator(device="cuda").manual_seed(n + k + 7)
    kw = {"group_size": 128, "symmetric": False} if scheme == "int4" else {}
    w = make_weight(scheme, n, k, device="cuda", generator=gen, **kw)
    x = torch.randn(1, k, device="cuda", generator=gen).to(torch.bfloat16)
    want = cg.gemv(x, w, kernels=native, silu_mul=silu, kind="mma")
    assert cg.gemv_applies(native, x, w, kind=kind)
    assert torch.equal(cg.gemv(x, w, kernels=native, silu_mul=silu, kind=kind), want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cg.gemv(x, w, kernels=native, silu_mul=silu, kind=kind)
    out.fill_(float("nan"))
    graph.replay()
    assert torch.equal(out, want)


@pytest.mark.parametrize(("n", "k"), [(28672, 4096), (4096, 14336), (6144, 4096), (4098, 2176), (40, 256)])
@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("kind", ["imma", "imma_persistent", "imma_w4", "imma_w16", "imma_persistent_w4"])
@pytest.mark.parametrize("scheme", ["w8a16", "int4"])
def test_native_imma_gemv_on_outliers_replays_and_propagates_nan(native, n: int, k: int, silu: bool, kind: str, scheme: str) -> None:  # noqa: ANN001
    """Kinds ``imma`` and ``imma_persistent`` (W8A16 codes, or int4 nibbles with zeros, in integer MMAs, x made integer per 128-column step against its
    largest |x|) on rows with large outliers (|x| up to 2000 among N(0, 1)): within one bf16 rounding
    of the fp32 reference (rel. error < 4e-3), replayed from a CUDA graph to the bit of the eager
    launch, and a NaN in x makes every output NaN, as the reference's. The persistent launch gives the
    one-block-per-group launch's bits (the same sums in the same order, and from its blocks' second
    group on the x staged in their first: 28672 x 4096 has 1,792 groups); K = 256 leaves six of eight
    warps without a step (``imma_w16``: 14 of 16; its and ``imma_w4``'s sums run in another order, and
    ``imma_persistent_w4`` gives ``imma_w4``'s bits)."""
    from mgx.kernels.cuda import gemv as cg

    gen = torch.Generator(device="cuda").manual_seed(n + k + 11)
    kw = {"group_size": 128, "symmetric": False} if scheme == "int4" else {}
    w = make_weight(scheme, n, k, device="cuda", generator=gen, **kw)
    x = torch.randn(1, k, device="cuda", generator=gen)
    x[0, torch.randint(0, k, (6,), device="cuda", generator=gen)] = torch.tensor([2000.0, -700.0, 90.0, -3.5e2, 1e3, 64.0],
                                                                                device="cuda")  # fmt: skip
    x = x.to(torch.bfloat16)
    ref = lin.linear_silu_mul_ref if silu else lin.linear_ref
    assert cg.gemv_applies(native, x, w, kind=kind)
    want = cg.gemv(x, w, kernels=native, silu_mul=silu, kind=kind)
    assert rel_err(want, ref(x, w)) < 4e-3
    if kind in ("imma_persistent", "imma_persistent_w4"):  # the one-block-per-group launch of its kernel
        alone = "imma" if kind == "imma_persistent" else "imma_w4"
        assert torch.equal(want, cg.gemv(x, w, kernels=native, silu_mul=silu, kind=alone))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cg.gemv(x, w, kernels=native, silu_mul=silu, kind=kind)
    out.fill_(0.0)
    graph.replay()
    assert torch.equal(out, want)
    x[0, k // 3] = float("nan")
    assert torch.isnan(cg.gemv(x, w, kernels=native, silu_mul=silu, kind=kind)).all()


@pytest.mark.parametrize(("n", "k"), [(128256, 4096), (32003, 1024), (40, 256)])
@pytest.mark.parametrize("kind", ["imma", "imma_persistent", "imma_w4", "imma_w16", "imma_persistent_w4"])
@pytest.mark.parametrize("scheme", ["w8a16", "int4"])
def test_native_greedy_lm_head_picks_the_reference_token(native, n: int, k: int, kind: str, scheme: str) -> None:  # noqa: ANN001
    """``gemv_argmax`` (the imma kinds' greedy entries: each block keeps its 16 logits' best, a second
    kernel merges them) against the fp32 reference logits: with and without bias, the reference's
    token wherever its lead over the runner-up exceeds 1e-4 of the largest |logit| (else a token within
    that of the top), its logit within 1e-4 of the reference's (relative); ties (the top row copied
    into rows 0 and 1, in another block) go to the smallest id; replayed from a CUDA graph to the bit;
    a NaN in x (every logit NaN) gives token 0 with logit -inf, as the Triton head.
    The 8B vocabulary, a ragged one (32,003: the last block holds 3 rows) and a single block's worth."""
    from mgx.kernels.cuda import gemv as cg

    gen = torch.Generator(device="cuda").manual_seed(n + k + 23)
    kw = {"group_size": 128, "symmetric": False} if scheme == "int4" else {}
    w = make_weight(scheme, n, k, device="cuda", generator=gen, **kw)
    x = torch.randn(1, k, device="cuda", generator=gen).to(torch.bfloat16)
    for bias in (None, torch.randn(n, device="cuda", generator=gen).to(torch.bfloat16)):
        assert cg.gemv_applies(native, x, w, bias, kind=kind, argmax=True)
        ids, vals = cg.gemv_argmax(x, w, bias, kernels=native, kind=kind)
        logits = x.float() @ lin.dequantize_ref(w).T + (0.0 if bias is None else bias.float())
        top2 = logits[0].topk(2).values
        tol = 1e-4 * float(logits.abs().max())
        assert ids.shape == (1,) and ids.dtype == torch.int32 and vals.dtype == torch.float32
        if float(top2[0] - top2[1]) > tol:
            assert int(ids[0]) == int(logits[0].argmax())
        assert float(logits[0, int(ids[0])]) >= float(top2[0]) - tol
        assert abs(float(vals[0]) - float(logits[0, int(ids[0])])) <= tol
    top = int(cg.gemv_argmax(x, w, kernels=native, kind=kind)[0][0])
    if n > 32 and top > 1:
        for t in (w.weight, w.scales, w.zeros):  # rows 0 and 1 become copies of the top row
            if t is not None:
                t[0:2] = t[top]
        ids, _ = cg.gemv_argmax(x, w, kernels=native, kind=kind)
        assert int(ids[0]) == 0
    want = cg.gemv_argmax(x, w, kernels=native, kind=kind)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = cg.gemv_argmax(x, w, kernels=native, kind=kind)
    got[0].fill_(-1)
    graph.replay()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert not cg.gemv_applies(native, x, w, kind="mma", argmax=True)
    x[0, k // 3] = float("nan")  # every logit NaN, which counts as -inf: the smallest id, never one past V
    ids, vals = cg.gemv_argmax(x, w, kernels=native, kind=kind)
    assert ids.tolist() == [0] and vals.tolist() == [float("-inf")]


@pytest.mark.parametrize(("n", "k"), [(28672, 4096), (4096, 14336), (6144, 4096), (4098, 2176), (40, 256)])
@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("kind", ["imma", "imma_w4", "imma_w16"])
@pytest.mark.parametrize("scheme", ["w8a16", "int4"])
def test_native_staged_imma_gives_the_kinds_bits(native, n: int, k: int, silu: bool, kind: str, scheme: str) -> None:  # noqa: ANN001
    """x staged once (``stage_x``) and the kind's staged twin (``gemv_staged``) give the kind's own
    result to the bit (the same staging code, then the same sums), on rows with outliers; captured
    together in a CUDA graph they follow a new x on replay; a NaN in x makes every output NaN. K = 2176
    and 256: a stage block with fewer steps than warps."""
    from mgx.kernels.cuda import gemv as cg

    gen = torch.Generator(device="cuda").manual_seed(n + k + 5)
    kw = {"group_size": 128, "symmetric": False} if scheme == "int4" else {}
    w = make_weight(scheme, n, k, device="cuda", generator=gen, **kw)
    x = torch.randn(1, k, device="cuda", generator=gen)
    x[0, torch.randint(0, k, (4,), device="cuda", generator=gen)] = torch.tensor([900.0, -300.0, 40.0, -2e3], device="cuda")
    x = x.to(torch.bfloat16)
    assert cg.staged_applies(native, x, w, kind)
    rec = cg.stage_x(x, scheme, kernels=native)
    assert rec.numel() == cg.staged_bytes(k)
    assert torch.equal(cg.gemv_staged(rec, w, kernels=native, silu_mul=silu, kind=kind),
                       cg.gemv(x, w, kernels=native, silu_mul=silu, kind=kind))  # fmt: skip
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cg.gemv_staged(cg.stage_x(x, scheme, kernels=native, out=rec), w, kernels=native, silu_mul=silu, kind=kind)
    x.copy_(torch.randn(1, k, device="cuda", generator=gen).to(torch.bfloat16))
    graph.replay()
    assert torch.equal(out, cg.gemv(x, w, kernels=native, silu_mul=silu, kind=kind))
    x[0, k // 3] = float("nan")
    assert torch.isnan(cg.gemv_staged(cg.stage_x(x, scheme, kernels=native), w, kernels=native, silu_mul=silu,
                                      kind=kind)).all()  # fmt: skip


IMMA_KINDS = ("imma", "imma_w4", "imma_w16", "imma_persistent", "imma_persistent_w4")


def same_imma_bits(native, w, other, wo, x: torch.Tensor, silu: bool) -> int:  # noqa: ANN001
    """Assert that build ``other`` on weight ``wo`` gives the default build ``native``'s bits on ``w`` for
    every imma kind: plain, staged, with the RMSNorm prologue (where the default build takes it) and, when
    not ``silu``, as the greedy LM head. Returns how many launches were compared."""
    from mgx.kernels.cuda import gemv as cg

    k = w.k
    gen = torch.Generator(device="cuda").manual_seed(k)
    g = (1 + 0.2 * torch.randn(k, device="cuda", generator=gen)).to(torch.bfloat16)
    norm = cg.NormPrologue(None, g, 1e-5)
    rec = cg.stage_x(x, w.scheme, kernels=native)
    runs = 0
    for kind in IMMA_KINDS:
        pairs = [lambda kk, ww, kind=kind: cg.gemv(x, ww, kernels=kk, kind=kind, silu_mul=silu)]
        if kind in cg.STAGED_KINDS:
            pairs.append(lambda kk, ww, kind=kind: cg.gemv_staged(rec, ww, kernels=kk, kind=kind, silu_mul=silu))
        if cg.gemv_applies(native, x, w, kind=kind, norm=norm):
            pairs.append(lambda kk, ww, kind=kind: cg.gemv(x, ww, kernels=kk, kind=kind, silu_mul=silu, norm=norm))
        if not silu:
            pairs.append(lambda kk, ww, kind=kind: torch.cat([t.float() for t in cg.gemv_argmax(x, ww, kernels=kk,
                                                                                                 kind=kind)]))  # fmt: skip
        for i, run in enumerate(pairs):
            got, want = run(other, wo), run(native, w)
            assert torch.equal(got, want), (kind, i, float((got.float() - want.float()).abs().max()))
            runs += 1
    return runs


@pytest.fixture(scope="module")
def tiled():
    """The native kernels built with MGX_IMMA_TILE16=1 (the imma kinds read int4 and W8A16 codes in the
    cuda_tile16 layout), and an experiment's flags from MGX_TEST_TILED_FLAGS (e.g. -DMGX_IMMA_CLAMP=1)."""
    if build.find_nvcc() is None:
        pytest.skip("needs nvcc")
    arch = device_arch()
    flags = ("-DMGX_IMMA_TILE16=1", *os.environ.get("MGX_TEST_TILED_FLAGS", "").split())
    kernels = crms.load_cuda_kernels(build.build_cuda_kernels(arch, extra_flags=flags), arch)
    assert kernels is not None
    return kernels


@pytest.mark.parametrize(("scheme", "n", "k", "silu", "group", "symmetric"),
                         [("int4", 28672, 4096, True, 128, False), ("int4", 4096, 14336, False, 128, True),
                          ("int4", 6144, 4096, False, 256, False), ("int4", 2 * 1000, 1024, True, 128, True),
                          ("int4", 48, 512, False, 128, False), ("w8a16", 28672, 4096, True, 0, True),
                          ("w8a16", 4096, 14336, False, 0, True), ("w8a16", 2 * 1000, 512, True, 0, True),
                          ("w8a16", 48, 512, False, 0, True)])  # fmt: skip
def test_native_imma_on_tile16_weights_gives_the_row_major_bits(native, tiled, scheme: str, n: int, k: int, silu: bool,
                                                                group: int, symmetric: bool) -> None:  # noqa: ANN001
    """A MGX_IMMA_TILE16 build on weights in the cuda_tile16 layout gives the default build's bits on the
    row-major weights, for every imma kind, plain, staged, with the RMSNorm prologue and as the greedy
    LM head, on SiLU-fused shapes (F = 1000: up rows from the middle of a tile) and group-256 ones;
    each build refuses the other's layout, and no other kind takes tiled weights."""
    from mgx.kernels.cuda import gemv as cg
    from mgx.kernels.triton.testing import tile16

    assert tiled.has(cg.TILE16_MARKER) and not native.has(cg.TILE16_MARKER)
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    kw = {"group_size": group, "symmetric": symmetric} if scheme == "int4" else {}
    w = make_weight(scheme, n, k, device="cuda", generator=gen, **kw)
    wt = tile16(w)
    x = torch.randn(1, k, device="cuda", generator=gen)
    x[0, 3] = 700.0
    x = x.to(torch.bfloat16)
    for kind in IMMA_KINDS:
        assert cg.gemv_applies(native, x, w, kind=kind) and cg.gemv_applies(tiled, x, wt, kind=kind)
        assert not cg.gemv_applies(native, x, wt, kind=kind) and not cg.gemv_applies(tiled, x, w, kind=kind)
    assert same_imma_bits(native, w, tiled, wt, x, silu) >= 12
    for kind in ("gemv", "mma", "mma_pipelined"):
        assert not cg.gemv_applies(tiled, x, wt, kind=kind)


@pytest.fixture(scope="module")
def half():
    """The native kernels as the cuda_kernels pass builds them for int4 weights in cuda_tile16 with fp16
    scales: MGX_IMMA_TILE16=1 and MGX_IMMA_HALF_SCALES=1 (int4 scales and zeros from GpuWeight.pairs), and
    an experiment's flags from MGX_TEST_HALF_FLAGS (e.g. -DMGX_PRELOAD=3)."""
    if build.find_nvcc() is None:
        pytest.skip("needs nvcc")
    arch = device_arch()
    flags = ("-DMGX_IMMA_TILE16=1", "-DMGX_IMMA_HALF_SCALES=1", *os.environ.get("MGX_TEST_HALF_FLAGS", "").split())
    kernels = crms.load_cuda_kernels(build.build_cuda_kernels(arch, extra_flags=flags), arch)
    assert kernels is not None
    return kernels


@pytest.mark.parametrize(("n", "k", "silu", "group", "symmetric"),
                         [(28672, 4096, True, 128, False), (4096, 14336, False, 128, True),
                          (6144, 4096, False, 256, False), (2 * 1000, 1024, True, 128, True),
                          (48, 512, False, 128, False), (128256 // 16 * 16, 4096, False, 128, False)])  # fmt: skip
def test_native_imma_on_scale_pairs_gives_the_fp32_scale_bits(native, half, n: int, k: int, silu: bool, group: int,
                                                               symmetric: bool) -> None:  # noqa: ANN001
    """A MGX_IMMA_HALF_SCALES build (int4 scales and zeros as the fp16 pairs of ``scale_pairs``) on
    cuda_tile16 weights whose scales are fp16 values gives the default build's bits on the row-major
    weights with the same scales in fp32, for every imma kind: plain, staged, with the RMSNorm prologue
    and as the greedy LM head; it refuses int4 weights without pairs, and pairs in the other order."""
    from mgx.kernels.cuda import gemv as cg
    from mgx.kernels.triton.testing import tile16

    assert cg.reads_half_scales(half) and not cg.reads_half_scales(native)
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    w0 = make_weight("int4", n, k, device="cuda", generator=gen, group_size=group, symmetric=symmetric)
    w = dataclasses.replace(w0, scales=w0.scales.half().float())  # fp16 values, as quantize_int4 writes them
    assert cg.half_scales_hold(w) and not cg.half_scales_hold(w0)
    with pytest.raises(ValueError, match="fp16 values"):
        cg.scale_pairs(w0, silu)
    wt = cg.scale_pairs(tile16(w), silu)
    x = torch.randn(1, k, device="cuda", generator=gen)
    x[0, 3] = 700.0
    x = x.to(torch.bfloat16)
    assert not cg.gemv_applies(half, x, tile16(w), kind="imma")  # no pairs: the Triton GEMV runs it
    with pytest.raises(ValueError, match="other order"):
        cg.gemv(x, cg.scale_pairs(tile16(w), not silu), kernels=half, kind="imma", silu_mul=silu)
    assert all(cg.gemv_applies(half, x, wt, kind=kind) for kind in IMMA_KINDS)
    assert same_imma_bits(native, w, half, wt, x, silu) >= 12


@pytest.mark.parametrize("scheme", ["w8a16", "int4"])
@pytest.mark.parametrize(("k", "with_delta"), [(4096, True), (4096, False), (2176, True), (256, True), (8192, True)])
def test_native_norm_stage_writes_the_norm_and_the_record_stage_x_would(native, scheme: str, k: int, with_delta: bool) -> None:  # noqa: ANN001
    """``norm_stage``: one kernel for the RMSNorm (of res + delta, which it also writes) and the record
    of its output: the row within one bf16 rounding of the reference, res + delta exact, the record
    ``stage_x`` of the row to the bit, and the staged GEMV on it the kind's result on the row; on 1, 3
    or more blocks than steps as on the default grid (a step a warp), to the bit."""
    from mgx.kernels.cuda import gemv as cg

    gen = torch.Generator(device="cuda").manual_seed(k + 17)
    res = (3 * torch.randn(1, k, device="cuda", generator=gen)).to(torch.bfloat16)
    res[0, 7] = 500.0
    delta = torch.randn(1, k, device="cuda", generator=gen).to(torch.bfloat16)
    g = (1 + 0.2 * torch.randn(k, device="cuda", generator=gen)).to(torch.bfloat16)
    total = torch.empty_like(res)
    norm = cg.NormPrologue(delta, g, 1e-5, total) if with_delta else cg.NormPrologue(None, g, 1e-5)
    assert cg.norm_stage_applies(native, res, norm, scheme)
    out, rec = cg.norm_stage(res, norm, scheme, kernels=native)
    summed = (res.float() + delta.float()).to(torch.bfloat16) if with_delta else res
    if with_delta:
        assert torch.equal(total, summed)
    assert rel_err(out, trms.rms_norm_ref(summed, g, 1e-5)) < 4e-3
    assert torch.equal(rec, cg.stage_x(out, scheme, kernels=native))
    kw = {"group_size": 128, "symmetric": False} if scheme == "int4" else {}
    w = make_weight(scheme, 6144, k, device="cuda", generator=gen, **kw)
    assert torch.equal(cg.gemv_staged(rec, w, kernels=native, kind="imma_w4"), cg.gemv(out, w, kernels=native, kind="imma_w4"))
    # Any number of blocks (each normalizes the whole row and stages its share of the steps): the same bits.
    for blocks in (1, 3, k // 128 + 5):
        total_b = torch.full_like(res, float("nan"))
        norm_b = cg.NormPrologue(delta, g, 1e-5, total_b) if with_delta else cg.NormPrologue(None, g, 1e-5)
        out_b, rec_b = cg.norm_stage(res, norm_b, scheme, kernels=native, blocks=blocks)
        assert torch.equal(out_b, out) and torch.equal(rec_b, rec), blocks
        assert not with_delta or torch.equal(total_b, total), blocks


@pytest.mark.parametrize("kind", ["imma", "imma_w4", "imma_w16"])
@pytest.mark.parametrize("scheme", ["w8a16", "int4"])
@pytest.mark.parametrize("k", [4096, 8192])
def test_native_imma_norm_blocks_reuse_their_staged_x_to_the_bit(native, scheme: str, k: int, kind: str) -> None:  # noqa: ANN001
    """With the RMSNorm prologue an ``imma`` block takes groups b, b + grid, ...; from its second group
    on a warp reads back the x it staged for its first kImmaCache / warps steps in the first (gemv.cu's
    ImmaCache: 32 steps a block, whatever its warps; K = 8192 keeps half of them). The outputs of the groups computed so (a launch of 1100
    groups on ``norm_most`` blocks, two each) equal, to the bit, those of the same rows
    launched alone, where every block has one group and stages all of x itself; and the whole row is
    within one bf16 rounding of the fp32 reference."""
    from dataclasses import replace

    from mgx.kernels.cuda import gemv as cg

    gen = torch.Generator(device="cuda").manual_seed(k + 3)
    kw = {"group_size": 128, "symmetric": False} if scheme == "int4" else {}
    grid = cg.norm_most(native, kind, scheme, k, torch.device("cuda"))
    n = 16 * (grid + grid // 2)  # on 3/4 of grid blocks (equal_shares), groups from grid on are second ones
    w = make_weight(scheme, n, k, device="cuda", generator=gen, **kw)
    res = (3 * torch.randn(1, k, device="cuda", generator=gen)).to(torch.bfloat16)
    g = (1 + 0.2 * torch.randn(k, device="cuda", generator=gen)).to(torch.bfloat16)
    norm = cg.NormPrologue(None, g, 1e-5)
    assert cg.gemv_applies(native, res, w, kind=kind, norm=norm)
    full = cg.gemv(res, w, kernels=native, kind=kind, norm=norm)
    assert rel_err(full, lin.linear_ref(trms.rms_norm_ref(res, g, 1e-5), w)) < 4e-3
    rows = slice(16 * grid, n)  # second groups of their blocks
    part = replace(w, n=n - 16 * grid, weight=w.weight[rows], scales=w.scales[rows],
                   zeros=None if w.zeros is None else w.zeros[rows])  # fmt: skip
    alone = cg.gemv(res, part, kernels=native, kind=kind, norm=norm)
    assert torch.equal(full[:, rows], alone)


def test_native_gemv_rmsnorm_prologue_declines_what_it_cannot_take(native) -> None:
    from mgx.kernels.cuda import gemv as cg

    w = make_weight("none", 64, 1024, device="cuda")
    res, delta = (torch.randn(1, 1024, device="cuda").to(torch.bfloat16) for _ in range(2))
    total = torch.empty_like(res)
    assert cg.gemv_applies(native, res, w, norm=cg.NormPrologue(delta, None, 1e-6, total))
    assert not cg.gemv_applies(native, res, w, norm=cg.NormPrologue(delta, None, 1e-6, None))  # nowhere for the sum
    assert not cg.gemv_applies(native, res, w, norm=cg.NormPrologue(delta, None, 1e-6, res))  # the sum over its input
    assert not cg.gemv_applies(native, res, w, norm=cg.NormPrologue(delta.float(), None, 1e-6, total))
    assert not cg.gemv_applies(native, res, w, norm=cg.NormPrologue(delta, torch.ones(512, device="cuda"), 1e-6, total))
    wide = torch.randn(1, cg.MAX_NORM_K + 8, device="cuda").to(torch.bfloat16)
    assert not cg.gemv_applies(native, wide, make_weight("none", 64, cg.MAX_NORM_K + 8, device="cuda"),
                               norm=cg.NormPrologue(None, None, 1e-6))  # fmt: skip


@pytest.mark.parametrize("graphed", [False, True])
def test_overlapped_launches_give_the_same_results(native, graphed: bool) -> None:
    """A decoder layer's native chain (add + RMSNorm, GEMV, add + RMSNorm, gate/up GEMV, down GEMV,
    add + RMSNorm) launched overlapped (each kernel may start before the one before it ends, and
    waits for it before reading its output) gives the results of ordinary launches to the bit,
    eagerly and replayed from a CUDA graph."""
    from mgx.kernels.cuda import gemv as cg

    major, minor = torch.cuda.get_device_capability()
    if major < 9 or not native.module.supports_overlap:
        pytest.skip("overlapped launches need sm_90 and cuLaunchKernelEx")
    gen = torch.Generator(device="cuda").manual_seed(5)
    h, f = 2048, 8192
    qkv = make_weight("none", 3072, h, device="cuda", generator=gen)
    gate_up = make_weight("int4", 2 * f, h, device="cuda", generator=gen, group_size=128, symmetric=True)
    down = make_weight("w8a16", h, f, device="cuda", generator=gen)
    g = (1 + 0.1 * torch.randn(h, device="cuda", generator=gen)).to(torch.bfloat16)
    res = torch.randn(1, h, device="cuda", generator=gen).to(torch.bfloat16)
    delta = torch.randn(1, h, device="cuda", generator=gen).to(torch.bfloat16)

    def chain() -> list[torch.Tensor]:
        x, r = crms.rms_norm(res, g, 1e-5, residual=delta, kernels=native)
        a = cg.gemv(x, qkv, kernels=native)
        x2, r2 = crms.rms_norm(r, g, 1e-5, residual=a[:, :h].contiguous(), kernels=native)
        up = cg.gemv(x2, gate_up, kernels=native, silu_mul=True, kind="mma")
        d = cg.gemv(up, down, kernels=native)
        x3, r3 = crms.rms_norm(r2, g, 1e-5, residual=d, kernels=native)
        return [x, r, a, x2, r2, up, d, x3, r3]

    native.overlap = False
    want = chain()
    try:
        assert native.allow_overlap(10 * major + minor)
        if graphed:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                outs = chain()
            for t in outs:
                t.fill_(float("nan"))
            graph.replay()
            got = outs
        else:
            got = chain()
    finally:
        native.overlap = False
    torch.cuda.synchronize()
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_native_gemv_replays_in_a_cuda_graph_and_declines_what_it_cannot_take(native) -> None:
    from mgx.kernels.cuda import gemv as cg

    w = make_weight("int4", 512, 1024, device="cuda", group_size=64)
    x = torch.randn(1, 1024, device="cuda").to(torch.bfloat16)
    out = torch.empty(1, 512, device="cuda", dtype=torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cg.gemv(x, w, kernels=native, out=out)
    x.copy_(torch.randn(1, 1024, device="cuda"))
    graph.replay()
    assert rel_err(out, lin.linear_ref(x, w)) < 4e-3
    assert not cg.gemv_applies(native, x.expand(2, -1), w)  # one row only
    assert not cg.gemv_applies(native, x.float(), w)  # bf16 activations only
    assert not cg.gemv_applies(native, x, make_weight("none", 512, 1024, device="cuda", dtype=torch.float32))
    assert not cg.gemv_applies(native, x[:, 4:1020], make_weight("int4", 512, 1016, device="cuda", group_size=8))
    assert not cg.gemv_applies(None, x, w)
    # W8A16 on the tensor cores takes whole 128-column steps only; the CUDA-core GEMV any K % 8 == 0.
    x2 = torch.randn(1, 1032, device="cuda").to(torch.bfloat16)
    odd = make_weight("w8a16", 512, 1032, device="cuda")
    assert cg.gemv_applies(native, x2, odd) and not cg.gemv_applies(native, x2, odd, kind="mma")
    assert not cg.gemv_applies(native, x2, odd, kind="mma_pipelined")
    assert cg.gemv_applies(native, x, make_weight("w8a16", 512, 1024, device="cuda"), kind="mma_pipelined")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    ("rows", "cols", "group"), [(1, 4096, None), (37, 4096, None), (8, 8192, None), (300, 1024, None), (5, 4096, 128)]
)
@pytest.mark.parametrize("with_residual", [False, True])
def test_native_rmsnorm(native, dtype, rows, cols, group, with_residual) -> None:
    g = torch.Generator(device="cuda").manual_seed(rows + cols)
    x = torch.randn(rows, cols, device="cuda", generator=g).to(dtype) * 2
    r = torch.randn(rows, cols, device="cuda", generator=g).to(dtype)
    w = torch.randn(group or cols, device="cuda", generator=g).to(dtype)
    out = torch.full_like(x, float("nan"))
    res = r if with_residual else None
    got = crms.rms_norm(x, w, 1e-6, kernels=native, group=group, residual=res, out=out)
    want = trms.rms_norm_ref(x, w, 1e-6, group=group, residual=res)
    if with_residual:
        torch.testing.assert_close(got[1], want[1], atol=0, rtol=0)  # the same rounding of the same sum
        got, want = got[0], want[0]
    tol = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 5e-3}[dtype]
    assert rel_err(got, want) < tol
    # Same inputs through Triton: both round fp32 results to nearest, so they agree closely.
    tri = trms.rms_norm(x, w, 1e-6, group=group, residual=res)
    tri = tri[0] if with_residual else tri
    assert rel_err(got, tri) < tol


def test_native_rmsnorm_falls_back_on_odd_shapes(native) -> None:
    x = torch.randn(3, 100, device="cuda", dtype=torch.bfloat16)  # 100 * 2 bytes is no multiple of 16
    w = torch.randn(100, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(crms.rms_norm(x, w, 1e-6, kernels=native), trms.rms_norm(x, w, 1e-6))


def test_code_for_another_gpu_falls_back_and_warns_once() -> None:
    if build.find_nvcc() is None:
        pytest.skip("needs nvcc")
    other = "sm_80" if torch.cuda.get_device_capability()[0] != 8 else "sm_90a"
    image = build.build_cuda_kernels(other)
    crms.reset_fallback_warning()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert crms.load_cuda_kernels(image, other) is None  # the recorded arch says no
        assert crms.load_cuda_kernels(image, None) is None  # the cubin's own header says no
    messages = [str(w.message) for w in seen if "Triton RMSNorm" in str(w.message)]
    assert len(messages) == 1 and other in messages[0]


def test_code_of_another_kernel_abi_falls_back_and_warns_once() -> None:
    """A cubin whose entry points carry another ABI suffix (a build with other kernel parameters) is
    never launched: the loader finds no entry of its own version and the Triton kernel runs."""
    if build.find_nvcc() is None:
        pytest.skip("needs nvcc")
    image = build.build_cuda_kernels(device_arch(), extra_flags=(f"-DMGX_KERNEL_ABI={crms.KERNEL_ABI + 1}",))
    crms.reset_fallback_warning()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert crms.load_cuda_kernels(image, device_arch()) is None
        assert crms.load_cuda_kernels(image, device_arch()) is None
    messages = [str(w.message) for w in seen if "Triton RMSNorm" in str(w.message)]
    assert len(messages) == 1 and "kernel ABI" in messages[0], messages
    assert crms.load_cuda_kernels(build.build_cuda_kernels(device_arch()), device_arch()) is not None


def test_driver_reads_the_cubin_arch() -> None:
    if build.find_nvcc() is None:
        pytest.skip("needs nvcc")
    major, minor = torch.cuda.get_device_capability()
    image = build.build_cuda_kernels(device_arch())
    assert driver.cubin_sm(image) == 10 * major + minor
    assert driver.device_sm(torch.cuda.current_device()) == 10 * major + minor


@pytest.mark.parametrize("merge", ["kernel", "last split"])
def test_decode_step_replays_in_a_cuda_graph(native, merge: str) -> None:
    """Native RMSNorm, RoPE + cache write and split decode attention captured once, replayed on new
    data; the splits merged by a second kernel or by the last split (counters made before capture)."""
    hq, hk, d, page = 32, 8, 128, 16
    b = paged_batch([3000, 70, 1, 513], [1, 1, 1, 1], num_heads=hq, num_kv_heads=hk, head_dim=d, block_size=page,
                    dtype=torch.bfloat16, device="cuda")  # fmt: skip
    hidden = torch.randn(4, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    inv = 1.0 / 500000.0 ** (torch.arange(0, d, 2, device="cuda").float() / d)
    q, k, v = b.q.clone(), b.k.clone(), b.v.clone()
    counters = att.new_decode_counters("cuda", 4, hk) if merge == "last split" else None

    def step():
        normed = crms.rms_norm(hidden, w, 1e-5, kernels=native)
        rope.rope_and_write_kv(q, k, v, b.positions, inv, b.k_cache, b.v_cache, b.block_table, b.query_start_loc,
                               head_dim=d)  # fmt: skip
        return normed, att.paged_attention_decode(q, b.k_cache, b.v_cache, b.block_table, b.context_lens,
                                                  scale=d**-0.5, num_splits=8, counters=counters)  # fmt: skip

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        normed, out = step()
    for _ in range(2):
        hidden.copy_(torch.randn_like(hidden))
        q.copy_(torch.randn_like(q))
        k.copy_(torch.randn_like(k))
        v.copy_(torch.randn_like(v))
        q0, k0 = q.clone(), k.clone()
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(normed, trms.rms_norm_ref(hidden, w, 1e-5)) < 5e-3
        want_q, _ = rope.rope_ref(q0, k0, b.positions, inv, head_dim=d)
        want = att.paged_attention_ref(want_q, b.k_cache, b.v_cache, b.block_table, b.context_lens,
                                       b.query_start_loc, b.positions, scale=d**-0.5)  # fmt: skip
        assert rel_err(out, want) < 1e-2
        assert counters is None or not counters.any()


@pytest.mark.parametrize("scheme", ["none", "w8a16", "int4", "int4-sym", "sparse24", "sparse24-nibble", "sparse24_int4"])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 4096, 4096), (1, 4096, 14336), (4, 1024, 4096), (64, 2048, 4096), (300, 1024, 2048)])
def test_linear_llama_shapes(scheme: str, m: int, n: int, k: int) -> None:
    kw = {"int4": {"group_size": 128}, "int4-sym": {"group_size": 128, "symmetric": True},
          "sparse24-nibble": {"layout": "sparse24_nibble_meta"}, "sparse24_int4": {"group_size": 128}}.get(scheme, {})  # fmt: skip
    w = make_weight(scheme.split("-")[0], n, k, device="cuda", **kw)
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    assert rel_err(lin.linear(x, w), lin.linear_ref(x, w)) < 1e-2


@pytest.mark.parametrize("m", [1, 48])
def test_gate_up_silu_llama(m: int) -> None:
    w = make_weight("int4", 2 * 14336, 4096, device="cuda", group_size=128)
    x = torch.randn(m, 4096, device="cuda").to(torch.bfloat16)
    assert rel_err(lin.linear_silu_mul(x, w), lin.linear_silu_mul_ref(x, w)) < 1e-2


@pytest.mark.parametrize(("contexts", "queries", "window"), [([2048], [2048], 0), ([700, 1500, 33], [700, 10, 33], 0),
                                                            ([4000, 300], [64, 300], 256)])  # fmt: skip
def test_prefill_long(contexts, queries, window) -> None:
    b = paged_batch(contexts, queries, num_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
                    dtype=torch.bfloat16, device="cuda")  # fmt: skip
    out = att.paged_attention(b.q, b.k, b.v, b.k_cache, b.v_cache, b.block_table, b.context_lens, b.query_start_loc,
                              b.positions, scale=128**-0.5, sliding_window=window)  # fmt: skip
    want = att.paged_attention_ref(b.q, b.k_cache, b.v_cache, b.block_table, b.context_lens, b.query_start_loc,
                                   b.positions, scale=128**-0.5, sliding_window=window)  # fmt: skip
    assert rel_err(out, want) < 1e-2


@pytest.mark.parametrize("block_m", [16, 32, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_window_tile_sizes(block_m: int, dtype: torch.dtype) -> None:
    """32-row tiles with a sliding window returned zeros on an H200 (Triton 3.6); the wrapper avoids them."""
    g = torch.Generator().manual_seed(14)
    b = paged_batch([12, 20], [5, 20], num_heads=4, num_kv_heads=1, head_dim=16, block_size=8, dtype=dtype,
                    device="cuda", generator=g)  # fmt: skip
    att.write_kv(b.k, b.v, b.positions, b.k_cache, b.v_cache, b.block_table, b.query_start_loc)
    out = att.paged_attention_prefill(b.q, b.k_cache, b.v_cache, b.block_table, b.context_lens, b.query_start_loc,
                                      b.positions, scale=0.25, sliding_window=6, block_m=block_m)  # fmt: skip
    want = att.paged_attention_ref(b.q, b.k_cache, b.v_cache, b.block_table, b.context_lens, b.query_start_loc,
                                   b.positions, scale=0.25, sliding_window=6)  # fmt: skip
    assert rel_err(out, want) < (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("splits", [None, 1, 64])
@pytest.mark.parametrize("merge", ["kernel", "last split"])
def test_decode_long_context(splits, merge: str) -> None:
    b = paged_batch([32768, 5, 9000], [1, 1, 1], num_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
                    dtype=torch.bfloat16, device="cuda")  # fmt: skip
    counters = att.new_decode_counters("cuda", 3, 8) if merge == "last split" else None
    out = att.paged_attention_decode(b.q, b.k_cache, b.v_cache, b.block_table, b.context_lens, scale=0.09,
                                     num_splits=splits, counters=counters)  # fmt: skip
    assert counters is None or not counters.any()
    want = att.paged_attention_ref(b.q, b.k_cache, b.v_cache, b.block_table, b.context_lens, b.query_start_loc,
                                   b.positions, scale=0.09)  # fmt: skip
    assert rel_err(out, want) < 1e-2


@pytest.mark.parametrize("scheme", ["none", "w8a16", "int4"])
@pytest.mark.parametrize("m", [1, 8, 32, 64, 128])
def test_decode_batch_linears_llama_1b(scheme: str, m: int) -> None:
    """The decode-batch shapes of Llama-3.2-1B (split K below SPLIT_MAX_M), all three kernels."""
    kw = {"group_size": 128} if scheme == "int4" else {}
    for n, k in [(3072, 2048), (2048, 8192)]:
        w = make_weight(scheme, n, k, device="cuda", **kw)
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        assert rel_err(lin.linear(x, w), lin.linear_ref(x, w)) < 1e-2, (n, k)
    w = make_weight(scheme, 2 * 8192, 2048, device="cuda", **kw)
    x = torch.randn(m, 2048, device="cuda").to(torch.bfloat16)
    assert rel_err(lin.linear_silu_mul(x, w), lin.linear_silu_mul_ref(x, w)) < 1e-2
    w = make_weight(scheme, 128256, 2048, device="cuda", **kw)
    ids, vals = lm_head.lm_head_argmax(x, w)
    want_ids, want_vals = lm_head.lm_head_argmax_ref(x, w)
    assert int(ids.max()) < 128256 and not torch.isnan(vals).any()
    torch.testing.assert_close(vals, want_vals, atol=2e-2, rtol=1e-2)


def test_split_k_linears_replay_in_cuda_graphs_in_any_order() -> None:
    """Graphs sharing one split-K workspace, replayed in another order than captured: each replay
    must find it zeroed (a workspace first zeroed inside a capture failed this)."""
    w = make_weight("int4", 2048, 8192, device="cuda", group_size=128)
    xs = [torch.randn(m, 8192, device="cuda").to(torch.bfloat16) for m in (8, 32)]
    ws = lin.new_split_workspace("cuda", 32 * 2048, 32 * 2048 // 4)
    cfg = lin.LinearConfig(16, 64, 128, 4, 4, 4)
    graphs, outs = [], []
    for x in xs:
        lin.linear(x, w, config=cfg, workspace=ws)  # compiles the kernel outside the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            outs.append(lin.linear(x, w, config=cfg, workspace=ws))
        graphs.append(g)
    for g in [*reversed(graphs), *graphs]:
        g.replay()
    torch.cuda.synchronize()
    for x, out in zip(xs, outs, strict=True):
        assert rel_err(out, lin.linear_ref(x, w)) < 1e-2
    assert not ws[0].any() and not ws[1].any()


@pytest.mark.parametrize("rows", [1, 7, 32])
def test_lm_head_argmax_llama_vocab(rows: int) -> None:
    w = make_weight("none", 128256, 4096, device="cuda")
    x = torch.randn(rows, 4096, device="cuda").to(torch.bfloat16)
    ids, vals = lm_head.lm_head_argmax(x, w)
    logits = torch.nn.functional.linear(x, w.weight).float()
    want = logits.argmax(-1)
    # cuBLAS sums in another order, so near-ties may round apart: the chosen logit must be a top one.
    top = logits.max(-1).values
    chosen = logits.gather(1, ids.long()[:, None])[:, 0]
    assert bool(((ids.long() == want) | (chosen >= top - 1e-2 * top.abs())).all())
    torch.testing.assert_close(vals, top, atol=2e-2, rtol=1e-2)
