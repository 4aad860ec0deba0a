"""examples/bench_gpu_floor.py on a GPU with nvcc: its readers and the persistent kernel run and report.
Skipped without CUDA."""

from __future__ import annotations

import pytest
from _examples import load_example

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu


def test_gpu_floor_and_boundaries_report_a_time_for_each_chain(capsys) -> None:  # noqa: ANN001
    from mgx.kernels.cuda import build

    if build.find_nvcc() is None or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs nvcc and sm_90")
    bench = load_example("bench_gpu_floor")
    assert bench.main(["--blocks-per-sm", "2", "--phases", "8", "--phase-mb", "1", "--reps", "2"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  ")]
    floor = [line for line in lines if line.startswith("  floor")]
    assert len(floor) == len(bench.floor_plans()) and all(float(x.split("GB/s")[0].split(", ")[-1]) > 0 for x in floor)
    (barrier,) = [line for line in lines if line.startswith("  boundaries")]
    assert "us a boundary" in barrier and barrier.count("us a barrier") == 2 * len(bench.BARRIERS)
    assert all(f"persistent ({name})" in barrier for name in bench.BARRIERS)
