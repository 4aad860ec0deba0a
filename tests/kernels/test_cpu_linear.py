"""The C++ linear, LM-head argmax and embedding kernels against the numpy reference, on every scheme,
both layouts (row_major, cpu_tile16) and every ISA path this host runs.

Shapes are awkward on purpose: N not a multiple of the 16-channel tile (a narrow last tile), K not a
multiple of a register (8 or 16 floats), odd where the scheme allows it, int4 groups cut short, one
output channel, and batches
of 1 to 5 rows (the streaming path), 8 and 33 (the panel path).

Tolerance: float32 summation in another order, |y - y_ref| <= 2e-6 * sum_k |x_k W_nk| + 1e-7 (the
error bound of reordered float32 sums scales with that sum; 2e-6 is ~30 ulps).
"""

from __future__ import annotations

import numpy as np
import pytest
from _cpu_testing import ISAS, SCHEMES, random_weight, tiled

from mgx.kernels import cpu
from mgx.kernels import reference as ref

SHAPES = [(1, 8), (19, 37), (17, 36), (40, 100), (70, 200), (33, 600)]  # (N, K); K rounded per scheme
ROWS = [1, 2, 3, 4, 5, 8, 33]


def _check(y: np.ndarray, x: np.ndarray, dense: np.ndarray, bias: np.ndarray | None) -> None:
    want = x @ dense.T + (0 if bias is None else bias)
    bound = 2e-6 * (np.abs(x) @ np.abs(dense).T) + 1e-7
    err = np.abs(y - want)
    assert (err <= bound).all(), f"max error {err.max():.3g} (bound {bound[err > bound].min():.3g})"


def _weight(name: str, n: int, k: int, layout: str, bias: bool) -> tuple[cpu.LinearWeight, np.ndarray, np.ndarray | None]:
    scheme = SCHEMES[name][0]
    k -= k % {"none": 1, "w8a16": 1, "int4": 2}.get(scheme, 4)  # int4: two columns a byte; 2:4: groups of 4
    w, aux = random_weight(name, n, k)
    dense = ref.dequantize(w, aux)
    if layout == "cpu_tile16":
        w, aux = tiled(w, aux)
    b = np.random.default_rng(1).normal(size=n).astype(np.float32) if bias else None
    return cpu.LinearWeight(w, aux, b), dense, b


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("layout", ["row_major", "cpu_tile16"])
@pytest.mark.parametrize("name", list(SCHEMES))
def test_linear_matches_reference(name: str, layout: str, isa: str) -> None:
    rng = np.random.default_rng(2)
    with cpu.use_isa(isa):
        for n, k in SHAPES:
            w, dense, bias = _weight(name, n, k, layout, bias=n % 2 == 1)
            for m in ROWS:
                x = rng.normal(size=(m, w.in_features)).astype(np.float32)
                _check(cpu.linear(x, w), x, dense, bias)


@pytest.mark.parametrize("isa", ISAS)
def test_linear_reads_strided_rows_and_writes_into_out(isa: str) -> None:
    w, dense, _ = _weight("int4-g32", 40, 64, "cpu_tile16", bias=False)
    both = np.random.default_rng(3).normal(size=(6, 100)).astype(np.float32)
    x = both[:, 10:74]  # a column view, as `split` returns
    out = np.full((6, 50), np.nan, np.float32)
    with cpu.use_isa(isa):
        got = cpu.linear(x, w, out=out[:, 5:45])
    _check(got, np.ascontiguousarray(x), dense, None)
    assert np.isnan(out[:, :5]).all() and np.isnan(out[:, 45:]).all()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("layout", ["row_major", "cpu_tile16"])
@pytest.mark.parametrize("name", ["bf16", "w8a16", "int4-g32"])
def test_lm_head_argmax_matches_argmax_of_logits(name: str, layout: str, isa: str) -> None:
    w, dense, _ = _weight(name, 3000, 72, layout, bias=False)  # several threads' worth of tiles
    x = np.random.default_rng(4).normal(size=(33, 72)).astype(np.float32)
    with cpu.use_isa(isa):
        index, value = cpu.lm_head_argmax(x, w)
        logits = cpu.linear(x, w)
    np.testing.assert_array_equal(index, logits.argmax(axis=1))
    np.testing.assert_array_equal(value, logits.max(axis=1))
    np.testing.assert_array_equal(index, (x @ dense.T).argmax(axis=1))


def test_lm_head_argmax_takes_the_first_of_equal_logits() -> None:
    w, aux = random_weight("f32", 50, 8)
    w.data[:] = 0.0
    w.data[[7, 30, 49], 0] = 1.0  # three tied maxima
    index, value = cpu.lm_head_argmax(np.ones((1, 8), np.float32), cpu.LinearWeight(w, aux))
    assert index.tolist() == [7] and value.tolist() == [1.0]


def test_lm_head_argmax_counts_nan_as_minus_infinity() -> None:
    """As the GPU heads: a NaN logit is never picked over a number, even as the first logit (row 0),
    and a row of NaN gives id 0 with -inf, never an id outside the vocabulary; 3,000 outputs span
    several threads' tiles."""
    w, aux = random_weight("f32", 3000, 8)
    w.data[0] = np.nan  # logit 0 is NaN in every row
    w.data[2100] = np.nan
    x = np.random.default_rng(5).normal(size=(2, 8)).astype(np.float32)
    x[1, 3] = np.nan  # every logit of row 1 NaN
    index, value = cpu.lm_head_argmax(x, cpu.LinearWeight(w, aux))
    logits = x[0] @ w.data.T
    best = int(np.nanargmax(logits))
    assert index.tolist() == [best, 0]
    assert value[0] == pytest.approx(logits[best], rel=1e-5) and value[1] == -np.inf


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("layout", ["row_major", "cpu_tile16"])
@pytest.mark.parametrize("name", list(SCHEMES))
def test_embedding_gathers_dequantized_rows(name: str, layout: str, isa: str) -> None:
    w, dense, _ = _weight(name, 37, 64, layout, bias=False)
    tokens = np.array([0, 36, 5, 5, 16, 31])
    with cpu.use_isa(isa):
        np.testing.assert_array_equal(cpu.embedding(tokens, w), dense[tokens])


def test_embedding_refuses_tokens_outside_the_table() -> None:
    w, aux = random_weight("f32", 10, 8)
    with pytest.raises(IndexError, match="outside"):
        cpu.embedding(np.array([3, 10]), cpu.LinearWeight(w, aux))


def test_results_do_not_depend_on_the_thread_count() -> None:
    w, _, bias = _weight("w8a16", 300, 200, "cpu_tile16", bias=True)
    x = np.random.default_rng(5).normal(size=(9, 200)).astype(np.float32)
    before = cpu.num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            cpu.set_num_threads(threads)
            results.append(cpu.linear(x, w))
    finally:
        cpu.set_num_threads(before)
    np.testing.assert_array_equal(results[0], results[1])
    np.testing.assert_array_equal(results[0], results[2])


def test_wrappers_check_dtypes_shapes_and_schemes() -> None:
    w, aux = random_weight("f32", 16, 8)
    lw = cpu.LinearWeight(w, aux)
    with pytest.raises(TypeError, match="float32"):
        cpu.linear(np.ones((2, 8)), lw)
    with pytest.raises(ValueError, match="features"):
        cpu.linear(np.ones((2, 9), np.float32), lw)
    with pytest.raises(ValueError, match="contiguous rows"):
        cpu.linear(np.ones((8, 2), np.float32).T, lw)
    odd, odd_aux = random_weight("f32", 16, 8)
    odd.layout = "tiles_9x9"
    with pytest.raises(cpu.CPUWeightError, match="layout 'tiles_9x9'"):
        cpu.LinearWeight(odd, odd_aux)
    q, q_aux = random_weight("w8a16", 16, 8)
    del q_aux["scales"]
    with pytest.raises(cpu.CPUWeightError, match="needs scales"):
        cpu.LinearWeight(q, q_aux)


def test_isa_selection() -> None:
    assert ISAS[-1] == "scalar" and cpu.isa() == ISAS[0]
    with cpu.use_isa("scalar"):
        assert cpu.isa() == "scalar"
    assert cpu.isa() == ISAS[0]
    missing = {"avx512", "avx2"} - set(ISAS)
    for name in missing:
        with pytest.raises(ValueError, match="not available"):
            cpu.set_isa(name)
    features = cpu.features()
    assert ("avx2" in ISAS) == (features["avx2"] and features["fma"] and features["f16c"])
