"""examples/bench_gpu_kernels.py: its sweep of the Triton RMSNorm configurations by their kernels' own
durations (the durations come from the profiler on an NVIDIA GPU; here a stand-in gives them)."""

from __future__ import annotations

import pytest
from _examples import load_example


@pytest.fixture
def bench():  # noqa: ANN201
    module = load_example("bench_gpu_kernels")
    yield module
    module.RESULTS.clear()


def test_own_sweep_ranks_configurations_by_their_median_own_duration(bench, monkeypatch) -> None:  # noqa: ANN001
    pytest.importorskip("torch")
    from mgx.kernels.triton.rmsnorm import RMSNormConfig

    fast, slow, spread = RMSNormConfig(2, 4, 4), RMSNormConfig(1, 4), RMSNormConfig(2, 2, 4)
    # Per round, in ms; the spread one is fastest in one round and slowest by its median.
    own = {fast: iter([0.018, 0.019, 0.018]), slow: iter([0.020, 0.020, 0.021]), spread: iter([0.017, 0.022, 0.023])}
    monkeypatch.setattr(bench, "kernel_ms", lambda fn: fn())
    moved, copy_gbps = 64 << 20, 4000.0
    bench.own_sweep("(4096, 4096)", [slow, spread, fast], lambda c: lambda: next(own[c]), moved, copy_gbps)
    rows = bench.RESULTS
    assert [r["variant"] for r in rows] == ["own sweep m2 w4 loop 4/SM", "own sweep m1 w4", "own sweep m2 w2 loop 4/SM"]
    assert [r["ms"] for r in rows] == [0.018, 0.020, 0.022]
    assert rows[0]["pct_copy_bw"] == [round(100 * moved / t / 1e6 / copy_gbps, 1) for t in (0.018, 0.019, 0.018)]
    assert all(r["section"] == "rmsnorm" and r["case"] == "(4096, 4096)" for r in rows)


def test_own_sweep_records_nothing_where_no_own_duration_is_known(bench) -> None:  # noqa: ANN001
    pytest.importorskip("torch")
    from mgx.kernels.triton.rmsnorm import RMSNormConfig

    assert bench.DEVICE == "cpu" or pytest.skip("kernel_ms measures on a GPU")
    bench.own_sweep("(8, 128)", [RMSNormConfig(1, 4)], lambda c: lambda: None, 1 << 20, 4000.0)
    assert bench.RESULTS == []
