"""examples/bench_compiles.py on a GPU: a warm-up and the passes run on the tiny shape and each reports its compiles
and tails, then the kernels' differing arguments. Skipped without CUDA."""

from __future__ import annotations

import pytest
from _examples import load_example

pytest.importorskip("torch")
pytest.importorskip("triton")

pytestmark = pytest.mark.gpu


def test_gpu_passes_report_their_compiles(capsys) -> None:  # noqa: ANN001
    bench = load_example("bench_compiles", register=True)
    assert bench.main(["--shape", "tiny", "--warm-up", "--passes", "eager,graphs", "--prompts", "6", "--rate", "50"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("warm-up: ") and " batch sizes in " in out[0]
    assert out[1].startswith("pass 0 (eager): ") and out[2].startswith("pass 1 (graphs): ")
    assert " compiles, " in out[1] and any(" variants, " in line for line in out[3:])
