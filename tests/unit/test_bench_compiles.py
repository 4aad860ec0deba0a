"""examples/bench_compiles.py: how it tells which arguments made a kernel's variants, and its
argument checks (the load itself runs on an NVIDIA GPU only)."""

from __future__ import annotations

import pytest
from _examples import load_example


@pytest.fixture(scope="module")
def bench():  # noqa: ANN201
    return load_example("bench_compiles", register=True)  # its dataclass looks its module up


def test_varying_args_names_the_parameters_whose_specialization_differed(bench) -> None:  # noqa: ANN001
    c = bench.Compile
    args = ("bt_ptr", "num_seqs", "BLOCK_S")
    log = [c("rope", args, ("('*i32', 'D')", "('i32', 'D')", "('constexpr', 16)"), 0.5),
           c("decode", ("ctx_ptr",), ("('*i32', 'D')",), 0.25),
           c("rope", args, ("('*i32', '')", "('constexpr', 1)", "('constexpr', 16)"), 0.75),
           c("rope", args, ("('*i32', 'D')", "('i32', '')", "('constexpr', 32)"), 1.0)]  # fmt: skip
    got = bench.varying_args(log)
    assert list(got) == ["rope", "decode"]  # most variants first
    n, seconds, diff = got["rope"]
    assert (n, seconds) == (3, 2.25)
    assert diff == {"bt_ptr": ["('*i32', '')", "('*i32', 'D')"],
                    "num_seqs": ["('constexpr', 1)", "('i32', '')", "('i32', 'D')"],
                    "BLOCK_S": ["('constexpr', 16)", "('constexpr', 32)"]}  # fmt: skip
    assert got["decode"] == (1, 0.25, {})


def test_summary_counts_a_stretch_of_compiles_by_kernel(bench) -> None:  # noqa: ANN001
    c = bench.Compile
    log = [c("rope", (), (), 0.5), c("decode", (), (), 0.25), c("rope", (), (), 1.0)]
    assert bench.summary(log) == "3 compiles, 1.8 s, {'rope': 2, 'decode': 1}"
    assert bench.summary([]) == "0 compiles, 0.0 s, {}"


def test_bad_arguments_are_named_and_no_gpu_is_refused(bench, capsys, monkeypatch) -> None:  # noqa: ANN001
    for argv, says in ((["--passes", "eager,warm"], "warm not eager or graphs"),
                       (["--rate", "0"], "--rate must be > 0")):  # fmt: skip
        with pytest.raises(SystemExit) as stop:
            bench.main(argv)
        assert stop.value.code == 2 and says in capsys.readouterr().err
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs an NVIDIA GPU"):
        bench.main([])
