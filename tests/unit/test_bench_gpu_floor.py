"""examples/bench_gpu_floor.py: the bytes its readers stand in for, its arguments and its refusal
without a GPU (the chains run on an NVIDIA GPU only: tests/gpu/test_gpu_floor_bench.py)."""

from __future__ import annotations

import pytest
from _examples import load_example


@pytest.fixture(scope="module")
def bench():  # noqa: ANN201
    return load_example("bench_gpu_floor")


def test_readers_read_what_each_int4_projection_reads_of_its_weight(bench) -> None:  # noqa: ANN001
    torch = pytest.importorskip("torch")
    from dataclasses import replace

    from mgx.kernels.cuda.gemv import scale_pairs
    from mgx.kernels.triton.testing import make_weight

    size = bench.projection_bytes()
    assert size["qkv"] == 6144 * 4096 // 2 + 6144 * 32 * 4 and size["down"] == 4096 * 14336 // 2 + 4096 * 112 * 4
    w = make_weight("int4", 48, 512, group_size=128)  # the layer bench's weights, at a small shape
    assert not w.symmetric and w.scales.dtype == torch.float32
    assert w.gemv_nbytes == w.nbytes == 48 * 512 // 2 + 48 * 4 * 5  # fp32 scales, u8 zeros
    paired = scale_pairs(replace(w, scales=w.scales.half().float()), False)
    assert paired.gemv_nbytes == 48 * 512 // 2 + 48 * 4 * 4 and paired.nbytes == w.nbytes  # as the floor reads
    plans = bench.floor_plans()
    assert plans["layer (4 projections)"][:4] == [size[p] for p in ("qkv", "o", "gate_up", "down")]
    assert len(plans["layer (4 projections)"]) == 4 * 32 and plans["gate_up"] == [size["gate_up"]] * 32
    assert plans["one kernel, all of it"] == [32 * sum(size.values())]


def test_bad_arguments_are_named_and_no_gpu_is_refused(bench, capsys, monkeypatch) -> None:  # noqa: ANN001
    for argv, says in ((["--parts", "floor,lm_head"], "lm_head not one of"),
                       (["--blocks-per-sm", "2,x"], "comma-separated numbers"),
                       (["--phase-mb", "0"], "must be positive"),
                       (["--barriers", "one,tree"], "tree not one of"),
                       (["--phases", "1000", "--phase-mb", "28"], "more than the floor's buffer")):  # fmt: skip
        with pytest.raises(SystemExit) as stop:
            bench.main(argv)
        assert stop.value.code == 2 and says in capsys.readouterr().err
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for argv in ([], ["--parts", "boundaries", "--phase-mb", "1"]):
        with pytest.raises(SystemExit, match="needs an NVIDIA GPU"):
            bench.main(argv)
