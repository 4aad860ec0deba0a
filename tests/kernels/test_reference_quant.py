"""Reference dequantizers against a plain, loop-by-loop reading of the contract in formats/README.md,
on random codes; and against the compiler's decoders on what the passes encode (same bits)."""

from __future__ import annotations

import numpy as np
import pytest

from mgx.formats import ir
from mgx.kernels import reference as ref

from _pass_testing import plain_dequant

RNG = np.random.default_rng(7)
N = 5


def _t(name: str, data: np.ndarray, dtype: ir.DType, scheme: str = "none", params: dict | None = None) -> ir.Tensor:
    return ir.Tensor(name, dtype, data.shape, data, scheme, params or {})


def _meta(n: int, k: int) -> np.ndarray:
    """Random valid 2:4 metadata: two distinct ascending indices per group of four."""
    pairs = [(a, b) for a in range(4) for b in range(a + 1, 4)]
    idx = RNG.integers(0, len(pairs), (n, k // 4))
    return np.array([[pairs[i][0] | (pairs[i][1] << 2) for i in row] for row in idx], np.uint8)


def _int4_arrays(n: int, k: int, group: int, symmetric: bool) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    groups = -(-k // group)
    aux = {"scales": RNG.uniform(0.01, 0.2, (n, groups)).astype(np.float32)}
    if not symmetric:
        aux["zeros"] = RNG.integers(0, 16, (n, groups)).astype(np.uint8)
    return RNG.integers(0, 256, (n, k // 2)).astype(np.uint8), aux


def _check(scheme: str, w: ir.Tensor, aux: dict[str, np.ndarray]) -> None:
    tensors = {role: _t(f"w.{role}", a, {"<f4": ir.DType.F32, "|u1": ir.DType.U8}[a.dtype.str])
               for role, a in aux.items()}
    got = ref.dequantize(w, tensors)
    want = plain_dequant(scheme, w.data, aux, w.scheme_params, w.dtype)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, want)


def test_w8a16() -> None:
    q = RNG.integers(-127, 128, (N, 24)).astype(np.int8)
    aux = {"scales": RNG.uniform(0.01, 0.1, N).astype(np.float32)}
    _check("w8a16", _t("w", q, ir.DType.I8, "w8a16"), aux)


@pytest.mark.parametrize("k, group", [(128, 32), (96, 64), (40, 128), (576, 128)])  # full and short last groups
@pytest.mark.parametrize("symmetric", [False, True], ids=["asym", "sym"])
def test_int4(k: int, group: int, symmetric: bool) -> None:
    w, aux = _int4_arrays(N, k, group, symmetric)
    params = {"group_size": group, "symmetric": symmetric, "cols": k}
    _check("int4", _t("w", w, ir.DType.U8, "int4", params), aux)


@pytest.mark.parametrize("dtype", [ir.DType.F32, ir.DType.BF16, ir.DType.F16])
def test_sparse24(dtype: ir.DType) -> None:
    k = 48
    values = RNG.normal(size=(N, k // 2)).astype(np.float32)
    data = {ir.DType.F32: values, ir.DType.F16: values.astype(np.float16),
            ir.DType.BF16: (values.view(np.uint32) >> 16).astype(np.uint16)}[dtype]
    _check("sparse24", _t("w", data, dtype, "sparse24", {"cols": k}), {"meta": _meta(N, k)})


@pytest.mark.parametrize("symmetric", [False, True], ids=["asym", "sym"])
def test_sparse24_int4(symmetric: bool) -> None:
    k, group = 192, 64  # 96 kept values: one full group and a short one
    w, aux = _int4_arrays(N, k // 2, group, symmetric)
    aux["meta"] = _meta(N, k)
    params = {"group_size": group, "symmetric": symmetric, "cols": k}
    _check("sparse24_int4", _t("w", w, ir.DType.U8, "sparse24_int4", params), aux)


def test_passes_and_kernels_decode_to_the_same_bits() -> None:
    from mgx.passes import dense_weight

    from _pass_testing import after
    from _tiny_graph import build_tiny_graph

    graph, _ = build_tiny_graph(dtype=ir.DType.BF16, tie_word_embeddings=True)
    for passes in (["quantize_w8a16"], [("quantize_int4", {"group_size": 32})],
                   [("quantize_int4", {"group_size": 64, "symmetric": True})], ["sparsify_2_4"],
                   ["sparsify_2_4", ("quantize_int4", {"group_size": 32})]):
        q, _ = after(graph, *passes)
        for op in q.ops:
            if op.kind in ("embedding", "linear", "lm_head"):
                aux = {r: q.tensors[op.weights[r]] for r in ("scales", "zeros", "meta") if r in op.weights}
                np.testing.assert_array_equal(ref.dequantize(q.tensors[op.weights["weight"]], aux),
                                              dense_weight(q, op), err_msg=f"{passes} {op.source}")


def test_errors_name_the_scheme_the_layout_and_the_role() -> None:
    w, aux = _int4_arrays(N, 64, 32, False)
    params = {"group_size": 32, "symmetric": False, "cols": 64}
    scales = _t("w.scales", aux["scales"], ir.DType.F32)
    with pytest.raises(ref.UnsupportedWeightError, match=r"has no 'zeros' data"):
        ref.dequantize(_t("w", w, ir.DType.U8, "int4", params), {"scales": scales})
    short = _t("w.scales", aux["scales"][:, :1].copy(), ir.DType.F32)
    with pytest.raises(ref.UnsupportedWeightError, match=r"scales is float32\[5, 1\], expected float32\[5, 2\]"):
        ref.dequantize(_t("w", w, ir.DType.U8, "int4", params), {"scales": short, "zeros": scales})
    with pytest.raises(ref.UnsupportedWeightError, match=r"scheme 'int3' \(layout 'row_major'\)"):
        ref.dequantize(_t("w", w, ir.DType.U8, "int3", params))
    bad = ir.Tensor("w", ir.DType.U8, w.shape, w, "int4", params, "tiles")
    with pytest.raises(ref.UnsupportedWeightError, match=r"unknown weight layout 'tiles'"):
        ref.dequantize(bad, {"scales": scales})
