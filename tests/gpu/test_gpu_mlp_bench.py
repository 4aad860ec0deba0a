"""examples/bench_gpu_mlp.py on a GPU of sm_90 or newer with nvcc: the fused int4 MLP gives the two
GEMVs' row within bf16 rounding on the 8B shape, and its chains and timeline report. Skipped without
CUDA."""

from __future__ import annotations

import pytest
from _examples import load_example

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def bench():  # noqa: ANN201
    from mgx.kernels.cuda import build

    if not torch.cuda.is_available() or build.find_nvcc() is None or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs nvcc and sm_90")
    return load_example("bench_gpu_mlp")


def test_gpu_fused_mlp_gives_the_two_gemvs_row_within_bf16_rounding(bench) -> None:  # noqa: ANN001
    from mgx.kernels.triton.testing import as_read_by, make_weight

    fused = bench.Fused()
    w = {"gate_up": make_weight("int4", 2 * 14336, 4096, device="cuda", group_size=128),
         "down": make_weight("int4", 4096, 14336, device="cuda", group_size=128)}  # fmt: skip
    w = {name: as_read_by(v, fused.kernels, name == "gate_up") for name, v in w.items()}
    for entry in bench.ENTRIES:
        for err, err_bf16, spread in bench.check(fused, entry, w):
            # The reference row is bf16 (half an ulp: 2^-9 relative at most); the fused one fp32 whose
            # gate/up sums run in another order (a SiLU output may round to the next bf16 value).
            assert err < 4e-3 and err_bf16 < 2e-3, (entry, err, err_bf16)
            # fp32 sums: the reductions' order, fp32 rounding only; fixed point: exact in any order
            assert spread == 0.0 if bench.fixed(entry) else spread < 1e-4, (entry, spread)


def test_gpu_chains_and_timeline_report(bench, capsys) -> None:  # noqa: ANN001
    assert bench.main(["--entries", "w16_u4_d4_b1", "--parts", "chains,timeline", "--replays", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    times = [line for line in out if " ms (" in line]
    assert len(times) == 6 + len(bench.MODES) and all(float(line.split(": ")[-1].split(" ms")[0]) > 0 for line in times)
    assert sum(line.strip().startswith("layer ") for line in out) == 3 and any("gap to layer" in line for line in out)


def test_gpu_leave_out_times_the_layer_without_each_projection(bench, capsys) -> None:  # noqa: ANN001
    assert bench.main(["--entries", "w16_u2_d4_b1_x", "--parts", "leave_out", "--replays", "2"]) == 0
    times = [line for line in capsys.readouterr().out.splitlines() if "decode layer, fused, without" in line]
    assert len(times) == 2 * len(bench.LEAVE_OUT) and all(float(line.split(": ")[-1].split(" ms")[0]) > 0 for line in times)
    assert sum("without o and qkv" in line or "without qkv and o" in line for line in times) == 2


def test_gpu_product_fused_mlp_is_deterministic_and_norm_stage_fx_reads_its_row(bench) -> None:  # noqa: ANN001
    """gemv.fused_mlp (the product's entry, fixed point): within bf16 rounding of the two GEMVs, the same
    bits on a second run; norm_stage_fx on its row gives norm_stage's output and record on the row
    fixed_to rounds to bf16, to the bit; an Inf in x sets the row's flag and the normalized row is NaN."""
    from mgx.kernels.cuda import gemv as cg
    from mgx.kernels.triton.testing import as_read_by, make_weight

    kernels = bench.Fused().kernels
    assert cg.reads_tile16(kernels, "int4") and cg.reads_half_scales(kernels)
    w = {"gate_up": make_weight("int4", 2 * 1024, 512, device="cuda", group_size=128),
         "down": make_weight("int4", 512, 1024, device="cuda", group_size=128)}  # fmt: skip
    w = {name: as_read_by(v, kernels, name == "gate_up") for name, v in w.items()}
    gen = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(1, 512, device="cuda", generator=gen).to(torch.bfloat16)
    assert cg.fused_mlp_applies(kernels, x, w["gate_up"], w["down"])
    rec = cg.stage_x(x, "int4", kernels=kernels)
    want = cg.gemv(cg.gemv_staged(rec, w["gate_up"], kernels=kernels, kind="imma_w4", silu_mul=True), w["down"],
                   kernels=kernels, kind="imma_w16").float()  # fmt: skip
    rows = [cg.fused_mlp(rec, w["gate_up"], w["down"], kernels=kernels, out=cg.fixed_rows(512, "cuda")[0]) for _ in range(2)]
    assert torch.equal(rows[0], rows[1]) and int(rows[0][512]) == 0
    got = cg.fixed_to(rows[0].view(1, -1), torch.float32)
    assert float((got - want).norm() / want.norm()) < 4e-3
    res = torch.randn(1, 512, device="cuda", generator=gen).to(torch.bfloat16)
    g = (torch.rand(512, device="cuda", generator=gen) + 0.5).to(torch.bfloat16)
    total_fx = torch.empty_like(res)
    out_fx, rec_fx = cg.norm_stage_fx(res, rows[0], g, 1e-5, total_fx, kernels=kernels)
    delta = cg.fixed_to(rows[0].view(1, -1), torch.bfloat16)
    total = torch.empty_like(res)
    out, rec_bf = cg.norm_stage(res, cg.NormPrologue(delta, g, 1e-5, total), "int4", kernels=kernels)
    assert torch.equal(out_fx, out) and torch.equal(total_fx, total) and torch.equal(rec_fx, rec_bf)
    x[0, 7] = float("inf")
    bad = cg.fused_mlp(cg.stage_x(x, "int4", kernels=kernels), w["gate_up"], w["down"], kernels=kernels,
                       out=cg.fixed_rows(512, "cuda")[0])  # fmt: skip
    assert int(bad[512]) != 0 and bool(cg.fixed_to(bad.view(1, -1), torch.float32).isnan().all())
    out_bad, _ = cg.norm_stage_fx(res, bad, g, 1e-5, torch.empty_like(res), kernels=kernels)
    assert bool(out_bad.isnan().all())
