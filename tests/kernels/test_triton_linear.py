"""Weight-only quantized and 2:4-sparse linear kernels (GEMV and GEMM paths), the fused gate/up
SiLU-mul, and the GPU weight layout; weights are checked against formats/README's definitions."""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from mgx.formats import layouts  # noqa: E402
from mgx.formats.ir import DType, Tensor  # noqa: E402
from mgx.kernels import reference as ref  # noqa: E402
from mgx.kernels.triton import linear as lin  # noqa: E402
from mgx.kernels.triton.testing import make_weight  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

WEIGHTS = {
    "dense": ("none", {}),
    "w8a16": ("w8a16", {}),
    "int4-g32": ("int4", {"group_size": 32}),
    "int4-g64-sym": ("int4", {"group_size": 64, "symmetric": True}),
    "sparse24": ("sparse24", {}),
    "sparse24-nibble": ("sparse24", {"layout": "sparse24_nibble_meta"}),
    "sparse24-int4-g32": ("sparse24_int4", {"group_size": 32}),
    "sparse24-int4-nibble-sym": ("sparse24_int4", {"group_size": 64, "symmetric": True, "layout": "sparse24_nibble_meta"}),
}


def oracle_dequantize(w: lin.GpuWeight) -> np.ndarray:
    """The numpy oracle (``reference.dequantize``) on the same bytes, as IR tensors in the row_major layout."""

    def arr(t: torch.Tensor) -> np.ndarray:
        if t.dtype == torch.bfloat16:
            return t.cpu().view(torch.int16).numpy().view(np.uint16)
        return t.cpu().numpy()

    dtypes = {torch.float32: DType.F32, torch.bfloat16: DType.BF16, torch.float16: DType.F16, torch.int8: DType.I8,
              torch.uint8: DType.U8}  # fmt: skip
    params = {"cols": w.k}
    if w.scheme in ("int4", "sparse24_int4"):
        params.update(group_size=w.group_size, symmetric=w.symmetric)
    roles = {"scales": w.scales, "zeros": w.zeros, "meta": w.meta}
    arrays = {role: arr(t) for role, t in roles.items() if t is not None}
    if w.layout == "sparse24_nibble_meta":
        arrays = layouts.unpack_sparse24_nibble_meta(arrays, params)

    def tensor(name: str, t: torch.Tensor, a: np.ndarray) -> Tensor:
        return Tensor(name, dtypes[t.dtype], a.shape, a, w.scheme, params)

    aux = {role: tensor(role, roles[role], a) for role, a in arrays.items()}
    return ref.dequantize(tensor("w", w.weight, arr(w.weight)), aux)


@pytest.mark.parametrize("name", sorted(WEIGHTS))
def test_dequantize_ref_matches_the_numpy_oracle(name: str) -> None:
    scheme, kw = WEIGHTS[name]
    w = make_weight(scheme, 6, 256, dtype=torch.float32, generator=torch.Generator().manual_seed(1), **kw)
    np.testing.assert_array_equal(lin.dequantize_ref(w).cpu().numpy(), oracle_dequantize(w))


def test_int4_with_a_short_last_group() -> None:
    g = torch.Generator().manual_seed(8)
    n, k, group = 5, 96, 64  # two groups: 64 columns, then 32
    w = lin.GpuWeight("int4", n, k, torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8).to(DEVICE),
                      scales=torch.rand(n, 2, generator=g).to(DEVICE),
                      zeros=torch.randint(0, 16, (n, 2), generator=g, dtype=torch.uint8).to(DEVICE),
                      group_size=group, symmetric=False)  # fmt: skip
    np.testing.assert_array_equal(lin.dequantize_ref(w).cpu().numpy(), oracle_dequantize(w))
    x = torch.randn(2, k, generator=g).to(DEVICE)
    torch.testing.assert_close(lin.linear(x, w), lin.linear_ref(x, w), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", sorted(WEIGHTS))
@pytest.mark.parametrize("m", [1, 3, 20])
def test_linear_fp32(name: str, m: int) -> None:
    scheme, kw = WEIGHTS[name]
    g = torch.Generator().manual_seed(m)
    w = make_weight(scheme, 40, 256, dtype=torch.float32, device=DEVICE, generator=g, **kw)
    x = torch.randn(m, 256, generator=g).to(DEVICE)
    bias = torch.randn(40, generator=g).to(DEVICE)
    got = lin.linear(x, w, bias)
    want = lin.linear_ref(x, w, bias)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    oracle = ref.linear(x.cpu().numpy(), lin.dequantize_ref(w).cpu().numpy(), bias.cpu().numpy())
    np.testing.assert_allclose(got.cpu().numpy(), oracle, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["dense", "w8a16", "int4-g32", "sparse24-nibble", "sparse24-int4-g32"])
@pytest.mark.parametrize("m", [1, 17])
def test_linear_bf16(name: str, m: int) -> None:
    scheme, kw = WEIGHTS[name]
    g = torch.Generator().manual_seed(3)
    w = make_weight(scheme, 64, 128, dtype=torch.bfloat16, device=DEVICE, generator=g, **kw)
    x = torch.randn(m, 128, generator=g).to(torch.bfloat16).to(DEVICE)
    got = lin.linear(x, w).float()
    want = lin.linear_ref(x, w).float()
    assert ((got - want).norm() / want.norm()) < 1e-2


@pytest.mark.parametrize("name", ["dense", "int4-g64-sym", "sparse24"])
@pytest.mark.parametrize("m", [2, 24])
def test_linear_silu_mul(name: str, m: int) -> None:
    scheme, kw = WEIGHTS[name]
    g = torch.Generator().manual_seed(4)
    w = make_weight(scheme, 2 * 24, 128, dtype=torch.float32, device=DEVICE, generator=g, **kw)
    x = torch.randn(m, 128, generator=g).to(DEVICE)
    got = lin.linear_silu_mul(x, w)
    torch.testing.assert_close(got, lin.linear_silu_mul_ref(x, w), atol=1e-5, rtol=1e-5)
    y = ref.linear(x.cpu().numpy(), lin.dequantize_ref(w).cpu().numpy())
    np.testing.assert_allclose(got.cpu().numpy(), ref.silu_mul(y), atol=1e-5, rtol=1e-5)


def test_silu_mul() -> None:
    x = torch.randn(3, 2 * 40, generator=torch.Generator().manual_seed(5)).to(DEVICE) * 4
    got = lin.silu_mul(x)
    torch.testing.assert_close(got, lin.silu_mul_ref(x), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(got.cpu().numpy(), ref.silu_mul(x.cpu().numpy()), atol=1e-5, rtol=1e-5)
    found = lin.silu_mul_candidates(40)  # tiles of up to 64 columns: the default, 64 x 1 and 2 warps
    assert found == [lin.SiluMulConfig(64, 4), lin.SiluMulConfig(64, 1), lin.SiluMulConfig(64, 2)]
    assert all(torch.equal(lin.silu_mul(x, config=c), got) for c in found)
    wide = torch.randn(2, 2 * 3000, generator=torch.Generator().manual_seed(6)).to(DEVICE)  # tiles that split rows
    assert torch.equal(lin.silu_mul(wide, config=lin.SiluMulConfig(256, 2)), lin.silu_mul(wide))
    assert len(lin.silu_mul_candidates(14336)) > 10 and lin.silu_mul_candidates(14336)[0] == lin.SiluMulConfig(1024, 4)


def test_explicit_configs_agree() -> None:
    g = torch.Generator().manual_seed(6)
    w = make_weight("int4", 64, 256, dtype=torch.float32, device=DEVICE, generator=g, group_size=64)
    x = torch.randn(1, 256, generator=g).to(DEVICE)
    want = lin.linear_ref(x, w)
    for cfg in (lin.LinearConfig(1, 8, 128, 4, 2), lin.LinearConfig(1, 32, 64, 4, 2), lin.LinearConfig(16, 16, 64, 4, 2)):
        torch.testing.assert_close(lin.linear(x, w, config=cfg), want, atol=1e-5, rtol=1e-5)


def test_nibble_meta_layout_round_trips() -> None:
    rng = np.random.default_rng(0)
    first = rng.integers(0, 3, (5, 16))
    second = first + 1 + rng.integers(0, 3 - first)
    meta = (first | (second << 2)).astype(np.uint8)
    vals = rng.standard_normal((5, 32)).astype(np.float32)
    packed = layouts.pack_sparse24_nibble_meta({"weight": vals, "meta": meta}, {"cols": 64})
    assert packed["meta"].shape == (5, 8) and packed["weight"] is vals
    back = layouts.unpack_sparse24_nibble_meta(packed, {"cols": 64})
    np.testing.assert_array_equal(back["meta"], meta)
    with pytest.raises(ValueError, match="above bit 3"):
        layouts.pack_sparse24_nibble_meta({"meta": meta | 0x80}, {})


def test_weight_validation_names_the_problem() -> None:
    with pytest.raises(ValueError, match="scheme 'int8'"):
        lin.GpuWeight("int8", 4, 4, torch.zeros(4, 4))
    with pytest.raises(ValueError, match="scales shape"):
        lin.GpuWeight("w8a16", 4, 8, torch.zeros(4, 8, dtype=torch.int8), scales=torch.zeros(3))
    with pytest.raises(ValueError, match="group_size"):
        lin.GpuWeight("int4", 4, 64, torch.zeros(4, 32, dtype=torch.uint8), scales=torch.zeros(4, 2), group_size=48)


@pytest.mark.parametrize("name", sorted(WEIGHTS))
@pytest.mark.parametrize("m, split", [(1, 3), (5, 4)])
def test_split_k_sums_every_share(name: str, m: int, split: int) -> None:
    """K split over programs that add into the fp32 workspace: same result, workspace left zeroed.

    Split 3 over 4 K tiles leaves the last share empty; it must still count towards the tile."""
    scheme, kw = WEIGHTS[name]
    g = torch.Generator().manual_seed(10 + m)
    w = make_weight(scheme, 40, 512, dtype=torch.float32, device=DEVICE, generator=g, **kw)
    x = torch.randn(m, 512, generator=g).to(DEVICE)
    bias = torch.randn(40, generator=g).to(DEVICE)
    block_k = max(128, lin.min_block_k(w))
    cfg = lin.LinearConfig(1, 8, block_k, 4, 1, split) if m == 1 else lin.LinearConfig(16, 16, block_k, 4, 2, split)
    want = lin.linear_ref(x, w, bias)
    for _ in range(2):  # the second launch reuses the workspace the first one left
        torch.testing.assert_close(lin.linear(x, w, bias, config=cfg), want, atol=1e-5, rtol=1e-5)
    ws, cnt = lin.split_workspace(x.device, 0, 0)
    assert ws.numel() >= m * 40 and not ws.any() and not cnt.any()


@pytest.mark.parametrize("name", ["dense", "int4-g64-sym"])
def test_split_k_silu_mul(name: str) -> None:
    scheme, kw = WEIGHTS[name]
    g = torch.Generator().manual_seed(12)
    w = make_weight(scheme, 2 * 24, 512, dtype=torch.float32, device=DEVICE, generator=g, **kw)
    x = torch.randn(3, 512, generator=g).to(DEVICE)
    bias = torch.randn(48, generator=g).to(DEVICE)
    want = lin.linear_silu_mul_ref(x, w, bias)
    for cfg in (lin.LinearConfig(1, 8, 128, 4, 1, 4), lin.LinearConfig(16, 16, 128, 4, 2, 2)):
        torch.testing.assert_close(lin.linear_silu_mul(x, w, bias, config=cfg), want, atol=1e-5, rtol=1e-5)
    ws, cnt = lin.split_workspace(x.device, 0, 0)
    assert not ws.any() and not cnt.any()


def test_default_config_splits_narrow_decode_shapes() -> None:
    assert lin.default_config(1, 4096, 4096).split_k == 1  # the GEMV: one row per program
    assert lin.default_config(1, 4096, 14336, "int4").split_k == 8  # int4 GEMVs split K (H200 sweep)
    assert lin.default_config(1, 28672, 4096, "int4").split_k == 4
    assert lin.default_config(1, 4096, 4096, "w8a16").split_k == 1
    assert lin.default_config(8, 64, 4096).split_k == 16  # one output tile, 32 K tiles: 16 shares of 2
    assert lin.default_config(32, 28672, 4096).split_k == 1  # 448 tiles already fill the GPU
    assert lin.default_config(512, 64, 4096).split_k == 1  # prefill: no split
    assert lin.default_config(128, 2048, 8192).split_k == 4  # 64 tiles of 64 x 64
    assert lin.LinearConfig(16, 64, 128, 4).split_k == 1


def test_split_k_uses_the_given_workspace_and_refuses_a_small_one() -> None:
    g = torch.Generator().manual_seed(13)
    w = make_weight("w8a16", 24, 512, dtype=torch.float32, device=DEVICE, generator=g)
    x = torch.randn(3, 512, generator=g).to(DEVICE)
    cfg = lin.LinearConfig(16, 16, 128, 4, 2, 4)
    ws = lin.new_split_workspace(DEVICE, 3 * 24, 2)
    torch.testing.assert_close(lin.linear(x, w, config=cfg, workspace=ws), lin.linear_ref(x, w), atol=1e-5, rtol=1e-5)
    assert not ws[0].any() and not ws[1].any()
    with pytest.raises(ValueError, match="needs 72 float32 and 2 int32"):
        lin.linear(x, w, config=cfg, workspace=lin.new_split_workspace(DEVICE, 10, 2))


def test_shared_workspace_is_never_zeroed_inside_a_graph_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    """Zeros written while capturing land only at the first replay: growing must fail loudly then."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(lin, "_workspaces", {})
    with pytest.raises(RuntimeError, match="while a CUDA graph is being captured"):
        lin.split_workspace(torch.device("cuda", 0), 10, 1)


@pytest.mark.parametrize("name", ["dense", "w8a16", "int4-g32", "int4-g64-sym"])
@pytest.mark.parametrize("m, split, silu", [(1, 1, False), (5, 3, False), (16, 1, True), (20, 2, True)])
def test_swapped_tensor_core_path(name: str, m: int, split: int, silu: bool) -> None:
    """``LinearConfig.swap`` (W^T x^T, codes entering the dot as 128 + nibble, offsets removed through
    sums of x) against the fp32 reference, on bf16 activations. N and K are not multiples of the
    tile, so the masked loads run too; int8 codes include both extremes (-128 and 127)."""
    scheme, kw = WEIGHTS[name]
    g = torch.Generator().manual_seed(20 + m)
    n, k = 2 * 40 if silu else 72, 320
    w = make_weight(scheme, n, k, dtype=torch.bfloat16, device=DEVICE, generator=g, **kw)
    if scheme == "w8a16":
        w.weight[:, 0], w.weight[:, 1] = -128, 127
    assert lin.swap_applies(w, torch.bfloat16)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16).to(DEVICE)
    bias = torch.randn(n, generator=g).to(torch.bfloat16).to(DEVICE)
    cfg = lin.LinearConfig(16, 32, 128, 4, 2, split, swap=True)
    got = (lin.linear_silu_mul if silu else lin.linear)(x, w, bias, config=cfg).float()
    # The fused SiLU rounds gate, up and silu(gate) to bf16 as transformers does: its reference takes
    # bf16 inputs so that it rounds at the same points.
    want = (lin.linear_silu_mul_ref(x, w, bias) if silu else lin.linear_ref(x.float(), w, bias.float())).float()
    err = (got - want).abs()
    # fp32 sums in another order, then one bf16 rounding of the output: within one bf16 step (2^-7
    # relative), as Triton's interpreter truncates to bf16 where the GPU rounds to nearest.
    assert (err <= 2**-7 * want.abs() + 1e-3 * want.abs().max()).all(), err.max()
    ws, cnt = lin.split_workspace(x.device, 0, 0)
    assert not ws.any() and not cnt.any()


def test_swap_falls_back_where_it_does_not_apply() -> None:
    """fp32 activations, 2:4 weights and int4 groups of 16 run a swap configuration as a plain tile."""
    g = torch.Generator().manual_seed(30)
    cfg = lin.LinearConfig(16, 16, 64, 4, 2, swap=True)
    for scheme, kw, dtype in (("none", {}, torch.float32), ("sparse24", {}, torch.bfloat16),
                              ("int4", {"group_size": 16}, torch.bfloat16)):  # fmt: skip
        w = make_weight(scheme, 32, 128, dtype=dtype, device=DEVICE, generator=g, **kw)
        assert not lin.swap_applies(w, dtype)
        x = torch.randn(3, 128, generator=g).to(dtype).to(DEVICE)
        got, want = lin.linear(x, w, config=cfg).float(), lin.linear_ref(x.float(), w).float()
        assert ((got - want).norm() / want.norm()) < 1e-2


@pytest.mark.parametrize("name", sorted(WEIGHTS))
def test_dequantize_kernel_matches_the_reference(name: str) -> None:
    """The Triton dequantization (long prefills: dequantize, then a dense product) equals
    ``dequantize_ref`` rounded once (fp32, and bf16 to nearest even in the interpreter too); a shared
    buffer larger than W serves too, a wrong one is refused."""
    scheme, kw = WEIGHTS[name]
    w = make_weight(scheme, 40, 384, dtype=torch.float32, device=DEVICE, generator=torch.Generator().manual_seed(31), **kw)
    want = lin.dequantize_ref(w)
    torch.testing.assert_close(lin.dequantize(w, torch.float32), want, atol=0, rtol=0)
    assert torch.equal(lin.dequantize(w, torch.bfloat16), want.to(torch.bfloat16))  # rounded to nearest even
    buf = torch.full((50 * 384,), float("nan"), dtype=torch.float32, device=DEVICE)
    got = lin.dequantize(w, torch.float32, out=buf)
    assert got.data_ptr() == buf.data_ptr()
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    with pytest.raises(ValueError, match="dequantize buffer"):
        lin.dequantize(w, torch.float32, out=buf[: 40 * 383])
    # Every candidate the autotune pass may store writes the same bits (tiles of 8-64 rows, K tiles of
    # whole groups, 2-8 warps); a K tile that splits a group is refused.
    candidates = lin.dequantize_candidates(w)
    assert candidates[0] == lin.DequantizeConfig(32, max(128, lin.min_block_k(w)))
    for c in candidates[1::5]:
        assert torch.equal(lin.dequantize(w, torch.float32, config=c), want), c
    if lin.min_block_k(w) > 128:
        with pytest.raises(ValueError, match="not a multiple"):
            lin.dequantize(w, torch.float32, config=lin.DequantizeConfig(32, 128))


@pytest.mark.parametrize("name", sorted(WEIGHTS))
@pytest.mark.parametrize("tiled", [False, True])
def test_dequantize_rows_is_the_embedding_lookup(name: str, tiled: bool) -> None:
    """``dequantize(rows=)`` (the CUDA backend's embedding lookup in one kernel) equals the gather of
    dequantized rows (``dequantize_ref(take_rows(w, rows))`` rounded once) to the bit, in fp32 and bf16,
    int32 and int64 ids, repeated ids, one row and none, on row-major and cuda_tile16 codes; ids that are
    not a 1-D integer tensor are refused."""
    from mgx.kernels.triton.testing import tile16

    scheme, kw = WEIGHTS[name]
    w = make_weight(scheme, 48, 384, dtype=torch.float32, device=DEVICE, generator=torch.Generator().manual_seed(32), **kw)
    if tiled:
        if scheme not in ("int4", "w8a16"):
            pytest.skip("cuda_tile16 holds int4 and W8A16 codes")
        w = tile16(w)
    for ids, dtype in ((torch.tensor([47, 0, 5, 5, 31], dtype=torch.int64), torch.float32),
                       (torch.tensor([16], dtype=torch.int32), torch.bfloat16),
                       (torch.tensor([3, 40, 17], dtype=torch.int32), torch.bfloat16),
                       (torch.tensor([], dtype=torch.int64), torch.float32)):  # fmt: skip
        ids = ids.to(DEVICE)
        want = lin.dequantize_ref(lin.take_rows(w, ids.long())).to(dtype)
        got = lin.dequantize(w, dtype, rows=ids)
        assert got.shape == (ids.shape[0], 384) and got.dtype == dtype
        assert torch.equal(got, want)
        # Every candidate the autotune pass times for a lookup of that many rows (row tiles capped at
        # them) writes the same bits.
        candidates = lin.dequantize_candidates(w, rows=ids.shape[0])
        assert candidates[0] == lin.DequantizeConfig(min(32, lin.next_pow2(ids.shape[0])), max(128, lin.min_block_k(w)))
        assert all(c.block_n <= max(1, lin.next_pow2(ids.shape[0])) for c in candidates)
        for c in candidates[1::3]:
            assert torch.equal(lin.dequantize(w, dtype, rows=ids, config=c), want), c
    with pytest.raises(ValueError, match="dequantize rows"):
        lin.dequantize(w, torch.float32, rows=torch.tensor([[1, 2]], device=DEVICE))
    with pytest.raises(ValueError, match="dequantize rows"):
        lin.dequantize(w, torch.float32, rows=torch.tensor([1.0], device=DEVICE))


def test_autotune_candidates_include_the_swapped_path_where_it_applies() -> None:
    from mgx.kernels.triton.tuning import candidates

    q = make_weight("w8a16", 32, 128, device=DEVICE)
    assert set(lin.SWAP_CONFIGS) <= set(candidates(1, q, torch.bfloat16))
    assert set(lin.SWAP_CONFIGS) <= set(candidates(16, q, torch.bfloat16))
    assert not set(lin.SWAP_CONFIGS) & set(candidates(1, q, torch.float32))  # fp32 activations
    assert not set(lin.SWAP_CONFIGS) & set(candidates(17, q, torch.bfloat16))
    assert candidates(1) == lin.GEMV_CONFIGS and candidates(4) == lin.GEMM_CONFIGS


@pytest.mark.parametrize(("consumer", "split", "dtype"), [
    ("dense", 1, torch.float32), ("dense", 2, torch.bfloat16), ("w8a16", 1, torch.bfloat16),
    ("int4-g32", 2, torch.float32), ("int4-g32", 1, torch.bfloat16), ("sparse24", 1, torch.float32)])  # fmt: skip
def test_norm_across_the_gemv_boundary(consumer: str, split: int, dtype: torch.dtype) -> None:
    """The add and the RMSNorm between two projections without kernels of their own: the first
    (``linear_add_squares``) adds the residual in its epilogue and leaves its rows' squares, the next
    (``linear(norm=)``) normalizes x as it loads it. Against the unfused kernels: the sum bit for bit,
    the squares to fp32 rounding, the product within 1e-5 (fp32) or 1e-3 (bf16; the sum of squares
    in another order may flip a rounding; without the norm's two bf16 roundings it is 3-5e-3)."""
    from mgx.kernels.triton.rmsnorm import rms_norm_ref

    g = torch.Generator().manual_seed(7 + split)
    k_p, hidden, eps = 96, 128, 1e-6
    wp = make_weight("none", hidden, k_p, dtype=dtype, device=DEVICE, generator=g)
    scheme, kw = WEIGHTS[consumer]
    wc = make_weight(scheme, 48, hidden, dtype=dtype, device=DEVICE, generator=g, **kw)
    bias = torch.randn(hidden, generator=g).to(dtype).to(DEVICE)
    nw = (1 + 0.2 * torch.randn(hidden, generator=g)).to(dtype).to(DEVICE)
    cfg = lin.LinearConfig(1, 16, 32, 4, 1, split)
    for m in (1, 3):
        x = torch.randn(m, k_p, generator=g).to(dtype).to(DEVICE)
        res = (3 * torch.randn(m, hidden, generator=g)).to(dtype).to(DEVICE)
        total, squares = lin.linear_add_squares(x, wp, bias, res, config=cfg)
        want_total = (lin.linear(x, wp, bias, config=cfg).float() + res.float()).to(dtype)
        assert torch.equal(total, want_total)
        assert squares.tiles == hidden // 16 and tuple(squares.sq.shape) == (m, hidden // 16)
        torch.testing.assert_close(squares.sq.sum(1), total.float().pow(2).sum(1), rtol=1e-5, atol=0)
        for weight in (nw, None):
            got = lin.linear(total, wc, norm=lin.NormIn(squares, weight, eps), config=cfg).float()
            want = lin.linear(rms_norm_ref(total, weight, eps), wc, config=cfg).float()
            if dtype == torch.float32:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            else:
                assert float((got - want).norm() / want.norm()) < 1e-3, (m, weight is None)
        w_gu = make_weight(scheme, 2 * 24, hidden, dtype=dtype, device=DEVICE, generator=g, **kw)
        got = lin.linear_silu_mul(total, w_gu, norm=lin.NormIn(squares, nw, eps), config=cfg).float()
        want = lin.linear_silu_mul(rms_norm_ref(total, nw, eps), w_gu, config=cfg).float()
        tol = 1e-5 if dtype == torch.float32 else 1e-3
        assert float((got - want).norm() / want.norm()) < tol


def test_norm_across_refuses_what_it_cannot_run() -> None:
    g = torch.Generator().manual_seed(1)
    w = make_weight("none", 32, 64, dtype=torch.float32, device=DEVICE, generator=g)
    x = torch.randn(2, 64, generator=g).to(DEVICE)
    with pytest.raises(ValueError, match="residual must be"):
        lin.linear_add_squares(x, w, None, torch.zeros(2, 16, device=DEVICE))
    total, squares = lin.linear_add_squares(x, w, None, torch.zeros(2, 32, device=DEVICE),
                                            config=lin.LinearConfig(1, 8, 32, 4))  # fmt: skip
    w2 = make_weight("none", 16, 32, dtype=torch.float32, device=DEVICE, generator=g)
    with pytest.raises(ValueError, match="one-row GEMV"):
        lin.linear(total, w2, norm=lin.NormIn(squares, None, 1e-6), config=lin.LinearConfig(16, 16, 32, 4))
    with pytest.raises(ValueError, match="norm weight shape"):
        lin.linear(total, w2, norm=lin.NormIn(squares, torch.ones(5, device=DEVICE), 1e-6),
                   config=lin.LinearConfig(1, 8, 32, 4))  # fmt: skip


@pytest.mark.parametrize("scheme, kw", [("int4", {"group_size": 128}), ("int4", {"group_size": 32, "symmetric": True}),
                                        ("int4", {"group_size": 256}), ("w8a16", {})])  # fmt: skip
def test_every_reader_takes_the_tile16_layout_to_the_bit(scheme: str, kw: dict) -> None:
    """Weights in the cuda_tile16 layout (the integer tensor-core GEMVs' tiles; ``testing.tile16``)
    give, in every Triton reader, exactly the row-major weight's results: the one-row GEMV (even and
    masked), the tiles of the GEMM and of the swapped tensor-core path (fused SiLU too), split K,
    dequantize and the greedy LM head; the layout only moves bytes. N = 48, K = 512: three tiles of
    16 rows, four steps."""
    from mgx.kernels.triton.lm_head import lm_head_argmax
    from mgx.kernels.triton.testing import tile16

    g = torch.Generator().manual_seed(41)
    w = make_weight(scheme, 48, 512, dtype=torch.bfloat16, device=DEVICE, generator=g, **kw)
    t = tile16(w)
    assert t.layout == "cuda_tile16" and not torch.equal(t.weight, w.weight)
    assert torch.equal(lin.row_major_codes(t), w.weight)
    rows = torch.tensor([0, 47, 17, 16, 15, 17, 31], device=DEVICE)  # an embedding's gather: repeats, tile edges
    assert torch.equal(lin.code_rows(t, rows), w.weight[rows]) and torch.equal(lin.code_rows(w, rows), w.weight[rows])
    bias = torch.randn(48, generator=g).to(torch.bfloat16).to(DEVICE)
    configs = [None, lin.LinearConfig(1, 16, 256, 4, 1), lin.LinearConfig(1, 32, 128, 4, 1, 2),
               lin.LinearConfig(16, 32, 128, 4, 2, 1, swap=True), lin.LinearConfig(16, 16, 256, 4, 2)]  # fmt: skip
    for m in (1, 5):
        x = torch.randn(m, 512, generator=g).to(torch.bfloat16).to(DEVICE)
        for cfg in configs:
            for run in (lin.linear, lin.linear_silu_mul):
                assert torch.equal(run(x, t, bias, config=cfg), run(x, w, bias, config=cfg)), (m, cfg, run.__name__)
        ids, top = lm_head_argmax(x, t, bias)
        want_ids, want_top = lm_head_argmax(x, w, bias)
        assert torch.equal(ids, want_ids) and torch.equal(top, want_top)
    assert torch.equal(lin.dequantize(t, torch.float32), lin.dequantize(w, torch.float32))
    assert torch.equal(lin.dequantize_ref(t), lin.dequantize_ref(w))
    with pytest.raises(ValueError, match="N % 16 == 0 and K % 128 == 0"):
        make_weight(scheme, 40, 512, device=DEVICE, layout="cuda_tile16", **kw)
