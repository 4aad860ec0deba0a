"""examples/bench_gpu_layer.py on a GPU with nvcc: the chains are captured, replayed and reported.
Skipped without CUDA."""

from __future__ import annotations

import pytest
from _examples import load_example

pytest.importorskip("torch")
pytest.importorskip("triton")

pytestmark = pytest.mark.gpu


def test_gpu_chains_run_and_print_a_time_for_each_part(capsys) -> None:  # noqa: ANN001
    """On a GPU with nvcc: every part's chain is captured, replayed and reported, also on kernels
    built with a flag (two replays each: this checks the script, not the times)."""
    from mgx.kernels.cuda import build

    if build.find_nvcc() is None:
        pytest.skip("needs nvcc")
    bench = load_example("bench_gpu_layer")
    assert bench.main(["--scheme", "w8a16", "--replays", "2", "--nvcc-flag=-DMGX_IMMA_UNROLL=2"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  ")]
    assert len(lines) == 2 * len(bench.PARTS)
    for line, part in zip(lines, [*bench.PARTS, *bench.PARTS]):
        assert f": {part} " in line and float(line.split(f": {part} ")[1].split(" ms")[0]) > 0


def test_gpu_long_context_chain_times_each_merge_limit(capsys) -> None:  # noqa: ANN001
    """A 2,048-token table (32 pieces): with limit 8 the merge kernel runs, with 64 the last piece
    merges; both chains are captured, replayed and reported."""
    from mgx.kernels.cuda import build

    if build.find_nvcc() is None:
        pytest.skip("needs nvcc")
    bench = load_example("bench_gpu_layer")
    argv = ["--context", "1500", "--table-blocks", "128", "--parts", "attention", "--self-merge-max", "8,64", "--replays", "2"]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    assert "32 attention pieces" in out
    lines = [line for line in out.splitlines() if line.startswith("  ")]
    assert len(lines) == 2 and "[merge kernel, limit 8]: attention" in lines[0] and "[self-merge, limit 64]: attention" in lines[1]


def test_gpu_staged_chains_run_in_the_graph_and_before_it(capsys) -> None:  # noqa: ANN001
    """``--staged qkv,gate_up``: the plain chains, then with those projections' x staged in the graph,
    staged before it, and staged by the norms before them; each captured, replayed and reported."""
    from mgx.kernels.cuda import build

    if build.find_nvcc() is None:
        pytest.skip("needs nvcc")
    bench = load_example("bench_gpu_layer")
    assert bench.main(["--scheme", "int4", "--parts", "all,gemvs", "--staged", "qkv,gate_up", "--replays", "2"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  ")]
    assert len(lines) == 8
    assert sum("[qkv+gate_up staged]" in line for line in lines) == 2
    assert sum("[qkv+gate_up staged before the graph]" in line for line in lines) == 2
    assert sum("[qkv+gate_up staged, qkv/gate_up by their norms]" in line for line in lines) == 2
