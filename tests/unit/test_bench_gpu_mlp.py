"""examples/bench_gpu_mlp.py (the 43rd session's fused int4 MLP experiment): its arguments, its refusal
without a GPU, what its timeline says, and that its kernels build beside the product's where nvcc is
here (they run on an NVIDIA GPU only: tests/gpu/test_gpu_mlp_bench.py)."""

from __future__ import annotations

import pytest
from _examples import load_example


@pytest.fixture(scope="module")
def bench():  # noqa: ANN201
    return load_example("bench_gpu_mlp")


def test_bad_arguments_are_named_and_no_gpu_is_refused(bench, capsys, monkeypatch) -> None:  # noqa: ANN001
    for argv, says in ((["--entries", "w16_u4_d4_b1,w8_u1"], "w8_u1 not one of"),
                       (["--parts", "check,floor"], "floor not one of"),
                       (["--replays", "0"], "must be positive")):  # fmt: skip
        with pytest.raises(SystemExit) as stop:
            bench.main(argv)
        assert stop.value.code == 2 and says in capsys.readouterr().err
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs an NVIDIA GPU of sm_90"):
        bench.main(["--parts", "check"])


def test_the_record_fits_in_shared_memory_as_the_kernel_copies_it(bench) -> None:  # noqa: ANN001
    assert bench.record_bytes(4096) == (32 * 32 + 16) * 16  # 32 steps of B words, 32 float2 in 16 words
    assert bench.record_bytes(384) == (3 * 32 + 2) * 16  # an odd count of float2 rounds up to a word
    assert [bench.warps(e) for e in bench.ENTRIES] == [32, 16, 16, 32, 16]
    assert [bench.fixed(e) for e in bench.ENTRIES] == [False, False, False, True, True]


def test_fixed_point_rows_read_back_as_multiples_of_two_to_the_minus_32(bench) -> None:  # noqa: ANN001
    torch = pytest.importorskip("torch")
    row = torch.tensor([[3 << 31, -(1 << 32), 1, 0]], dtype=torch.int64)
    assert bench.as_float("w32_u2_d2_b0_x", row).tolist() == [[1.5, -1.0, 2.0**-32, 0.0]]
    same = torch.tensor([[0.25, -3.0]])
    assert bench.as_float("w32_u2_d2_b0", same) is same


def test_the_timeline_gives_quantiles_over_blocks_and_the_gap_between_layers(bench) -> None:  # noqa: ANN001
    # 3 layers of 10 blocks: block i starts at 1000 i ns after its layer's base, phase 1 takes 5,000 + 100 i
    # ns and phase 2 3,000 ns; layer l's base is 100,000 l; SM i % 4.
    stamps = [[[1e5 * layer + 1000 * i, 1e5 * layer + 1000 * i + 5000 + 100 * i,
                1e5 * layer + 1000 * i + 8000 + 100 * i, i % 4] for i in range(10)] for layer in range(3)]  # fmt: skip
    lines = bench.timeline_lines(stamps)
    assert [line.split(" (")[0] for line in lines if not line.startswith("  ")] == ["layer 1", "layer 2"]
    first = lines[0]
    assert "phase 1 ends 5.00 6.10 9.95 14.90 14.90" in first  # 1100 i + 5000 at i = 0, 1, 4.5 (median), 9, 9
    assert "phase 2 3.00 3.00 3.00 3.00 3.00" in first and first.endswith("4 SMs")
    (gap,) = [line for line in lines if line.startswith("  gap")]
    assert gap == "  gap to layer 2's first block: 82.10 us"  # 200,000 - (100,000 + 9,000 + 8,900)


def test_the_kernels_build_beside_the_products_where_nvcc_is_here(bench) -> None:  # noqa: ANN001
    pytest.importorskip("torch")
    from mgx.kernels.cuda import build

    if build.find_nvcc() is None:
        pytest.skip("needs nvcc")
    image = bench.build_image("sm_90a")
    for entry in bench.ENTRIES:
        assert bench.entry_name(entry).encode() in image
    assert b"mgx_gemv_int4_imma4_staged_bf16" in image  # the product's kernels are in the same unit
