"""examples/bench_gpu_layer.py: its arguments and its refusal without a GPU (the chains themselves run on
an NVIDIA GPU only: tests/gpu/test_gpu_layer_bench.py)."""

from __future__ import annotations

import pytest
from _examples import load_example


@pytest.fixture(scope="module")
def bench():  # noqa: ANN201
    return load_example("bench_gpu_layer")


def test_kinds_name_each_projection_once(bench) -> None:  # noqa: ANN001
    assert bench.parse_kinds("qkv=imma,o=imma_w16,gate_up=imma_w4,down=triton") == {
        "qkv": "imma", "o": "imma_w16", "gate_up": "imma_w4", "down": "triton"}  # fmt: skip
    for scheme, text in bench.DEFAULT_KINDS.items():
        assert set(bench.parse_kinds(text)) == {"qkv", "o", "gate_up", "down"}, scheme
    for bad, says in (("qkv=imma,o=imma,gate_up=imma", "no kind for down"), ("qkv=imma,qkv=imma", "'qkv=imma'"),
                      ("lm_head=imma", "'lm_head=imma'"), ("qkv", "'qkv'"), ("qkv=", "'qkv='")):  # fmt: skip
        with pytest.raises(ValueError, match=says):
            bench.parse_kinds(bad)


def test_bad_arguments_are_named_and_no_gpu_is_refused(bench, capsys, monkeypatch) -> None:  # noqa: ANN001
    for argv, says in ((["--parts", "all,lm_head"], "lm_head not one of"),
                       (["--kinds", "qkv=imma"], "no kind for down, gate_up, o"),
                       (["--context", "1100"], "not within the table's 1024 tokens"),
                       (["--self-merge-max", "16,all"], "'16,all' is not a comma-separated list"),
                       (["--attention-block-n", "64,48"], "[48] not a power of two from 16 to 256"),
                       (["--staged", "qkv,lm_head"], "lm_head not a projection on one of"),
                       (["--kinds", "qkv=triton,o=imma,gate_up=imma_w4,down=imma_w16", "--staged", "qkv,o"],
                        "--staged: qkv not a projection on one of imma, imma_w4, imma_w16")):  # fmt: skip
        with pytest.raises(SystemExit) as stop:
            bench.main(argv)
        assert stop.value.code == 2 and says in capsys.readouterr().err
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    # A flag's leading dash goes after "=" (argparse would take "-D..." alone for an option).
    for argv in ([], ["--nvcc-flag=-DMGX_IMMA_UNROLL=2"], ["--staged", "qkv,gate_up"],
                 ["--context", "3000", "--table-blocks", "256", "--self-merge-max", "16,64"]):  # fmt: skip
        with pytest.raises(SystemExit, match="needs an NVIDIA GPU"):
            bench.main(argv)


def test_a_projection_reads_its_codes_scales_and_zeros_unless_symmetric(bench) -> None:  # noqa: ANN001
    pytest.importorskip("torch")
    from mgx.kernels.triton.testing import make_weight

    assert set(bench.PROJECTIONS) <= set(bench.PARTS)
    # a projection's GB/s counts GpuWeight.nbytes
    asym = make_weight("int4", 48, 512, group_size=128, symmetric=False)
    assert asym.nbytes == 48 * 256 + 48 * 4 * 4 + 48 * 4  # codes, fp32 scales, u8 zeros
    sym = make_weight("int4", 48, 512, group_size=128, symmetric=True)
    assert sym.nbytes == 48 * 256 + 48 * 4 * 4
    w8 = make_weight("w8a16", 48, 512)
    assert w8.nbytes == 48 * 512 + w8.scales.numel() * w8.scales.element_size()
