"""examples/bench_gpu_model.py's reading of nvidia-smi: what it says of the GPU while a graph replays
(clocks, temperature, power, throttle reasons), so that a slow run can be told from a clocked-down GPU.
The GPU parts run on the H200 only; this checks the parsing, which is plain text."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "bench_gpu_model.py"


@pytest.fixture(scope="module")
def bench():  # noqa: ANN201
    spec = importlib.util.spec_from_file_location("bench_gpu_model", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    argv, sys.argv = sys.argv, [str(SCRIPT)]  # the script reads --smoke from argv on import
    try:
        spec.loader.exec_module(module)
    finally:
        sys.argv = argv
    return module


def test_gpu_state_takes_median_clocks_peak_heat_and_every_reason_seen(bench) -> None:  # noqa: ANN001
    text = ("1980, 3201, 45, 612.35, 0x0000000000000000\n"
            "1755, 3201, 47, 700.10, 0x0000000000000004\n"
            "not, a, sample, at, all\n"
            "1965, 2619, 46, 650.00, 0x0000000000000020\n")  # fmt: skip
    state = bench.summarize_gpu_state(text)
    assert state == {"samples": 3, "sm_mhz": 1965.0, "mem_mhz": 3201.0, "max_temp_c": 47.0, "max_power_w": 700.1,
                     "clock_event_reasons": "0x24"}  # fmt: skip


def test_gpu_state_is_none_when_nvidia_smi_printed_no_sample(bench) -> None:  # noqa: ANN001
    # An nvidia-smi that does not know a queried field prints an error line instead of samples.
    assert bench.summarize_gpu_state('Field "clocks_event_reasons.active" is not a valid field to query.\n') is None
    assert bench.summarize_gpu_state("") is None
