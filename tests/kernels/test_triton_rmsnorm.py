"""Triton RMSNorm (plain, grouped, with the residual add) and the CUDA RMSNorm's build, load and fallback.

Without a GPU the Triton kernels run in Triton's interpreter on CPU tensors. The interpreter rounds
fp32 -> bf16 by truncation (the GPU rounds to nearest), so bf16 checks allow two bf16 steps.
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from mgx.kernels import reference as ref  # noqa: E402
from mgx.kernels.cuda import build, driver  # noqa: E402
from mgx.kernels.cuda import gemv as cuda_gemv  # noqa: E402
from mgx.kernels.cuda import rmsnorm as cuda_rmsnorm  # noqa: E402
from mgx.kernels.triton import rmsnorm  # noqa: E402
from mgx.kernels.triton._common import num_sms  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# dtype -> (atol, rtol) for outputs of about unit size
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rand(g: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=g).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("rows", "cols", "group"), [(1, 64, None), (7, 96, None), (5, 64, 16), (3, 40, 8)])
def test_rms_norm_matches_torch_and_numpy(dtype: torch.dtype, rows: int, cols: int, group: int | None) -> None:
    g = gen(rows * cols)
    x = rand(g, rows, cols, dtype=dtype) * 3
    w = rand(g, group or cols, dtype=dtype)
    out = torch.full_like(x, float("nan"))  # every element must be written
    got = rmsnorm.rms_norm(x, w, 1e-5, group=group, out=out)
    want = rmsnorm.rms_norm_ref(x, w, 1e-5, group=group)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=atol * 3, rtol=rtol)
    oracle = ref.rms_norm(x.float().cpu().numpy(), w.float().cpu().numpy(), eps=1e-5, group=group or cols)
    np.testing.assert_allclose(got.float().cpu().numpy(), oracle, atol=atol * 3, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cfg", [rmsnorm.RMSNormConfig(1, 2, 2), rmsnorm.RMSNormConfig(2, 4, 3), rmsnorm.RMSNormConfig(4, 2, 64)])
def test_looping_programs_give_the_one_program_a_block_bits(dtype: torch.dtype, cfg) -> None:  # noqa: ANN001
    """``per_sm`` > 0: fewer programs looping over the row blocks (``per_sm`` an SM; on the CPU,
    ``num_sms``' stand-in), each block's rows loaded a block ahead: the same bits as a program a block, plain
    and with the residual add, on three blocks a program and then some (a ragged last block at block_m
    > 1), and with more programs than blocks."""
    g = gen(7)
    rows = 3 * cfg.per_sm * cfg.block_m * num_sms(torch.device(DEVICE)) + 5 if cfg.per_sm < 64 else 11
    x, r, w = rand(g, rows, 96, dtype=dtype) * 2, rand(g, rows, 96, dtype=dtype), rand(g, 96, dtype=dtype)
    plain = rmsnorm.RMSNormConfig(cfg.block_m, cfg.num_warps)
    out = torch.full_like(x, float("nan"))
    got = rmsnorm.rms_norm(x, w, 1e-5, out=out, config=cfg)
    assert torch.equal(got, rmsnorm.rms_norm(x, w, 1e-5, config=plain))
    got_out, got_sum = rmsnorm.rms_norm(x, w, 1e-5, residual=r, config=cfg)
    want_out, want_sum = rmsnorm.rms_norm(x, w, 1e-5, residual=r, config=plain)
    assert torch.equal(got_out, want_out) and torch.equal(got_sum, want_sum)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.float(), rmsnorm.rms_norm_ref(x, w, 1e-5).float(), atol=atol * 3, rtol=rtol)


def test_grouped_rms_norm_of_rows_split_off_a_wider_tensor() -> None:
    """Per-head RMSNorm (qk-norm) of q split off a fused QKV output, whose rows are not back to back:
    the same as of a contiguous copy (the CUDA backend's fallback when no native kernel loads)."""
    g = torch.Generator().manual_seed(4)
    qkv = rand(g, 6, 96)
    q, _ = torch.split(qkv, [64, 32], dim=1)
    w = rand(g, 16)
    assert q.stride(0) == 96
    want = rmsnorm.rms_norm_ref(q.contiguous(), w, 1e-6, group=16)
    torch.testing.assert_close(rmsnorm.rms_norm(q, w, 1e-6, group=16), want, atol=1e-5, rtol=1e-5)
    res = rand(g, 6, 96)[:, :64]
    out, total = rmsnorm.rms_norm(q, w, 1e-6, group=16, residual=res)
    torch.testing.assert_close(total, q + res)
    torch.testing.assert_close(out, rmsnorm.rms_norm_ref(q + res, w, 1e-6, group=16), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_residual_add(dtype: torch.dtype) -> None:
    g = gen(1)
    x, r, w = rand(g, 6, 128, dtype=dtype), rand(g, 6, 128, dtype=dtype), rand(g, 128, dtype=dtype)
    out, summed = rmsnorm.rms_norm(x, w, 1e-6, residual=r)
    want_out, want_sum = rmsnorm.rms_norm_ref(x, w, 1e-6, residual=r)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(summed.float(), want_sum.float(), atol=atol * 4, rtol=rtol)
    torch.testing.assert_close(out.float(), want_out.float(), atol=atol * 3, rtol=rtol)


def test_no_weight_and_strided_rows() -> None:
    g = gen(2)
    big = rand(g, 4, 80)
    x = big[:, :48]  # rows 80 apart
    got = rmsnorm.rms_norm(x, None, 1e-6)
    torch.testing.assert_close(got, rmsnorm.rms_norm_ref(x, None, 1e-6), atol=1e-5, rtol=1e-5)


def test_rejects_bad_shapes() -> None:
    x = torch.zeros(2, 12, device=DEVICE)
    with pytest.raises(ValueError, match="multiple of group"):
        rmsnorm.rms_norm(x, None, 1e-6, group=5)
    with pytest.raises(ValueError, match="weight shape"):
        rmsnorm.rms_norm(x, torch.ones(11, device=DEVICE), 1e-6)


# --- the native CUDA RMSNorm: build, arch checks, fallback ---------------------------------------


def test_arch_matching_rules() -> None:
    assert cuda_rmsnorm.arch_runs_on("sm_90a", 90)
    assert not cuda_rmsnorm.arch_runs_on("sm_90a", 100)
    assert cuda_rmsnorm.arch_runs_on("sm_80", 86)
    assert not cuda_rmsnorm.arch_runs_on("sm_86", 80)
    assert not cuda_rmsnorm.arch_runs_on("sm_80", 90)
    assert not cuda_rmsnorm.arch_runs_on("bogus", 90)
    assert build.gencode("sm_90a") == "-gencode=arch=compute_90a,code=sm_90a"
    with pytest.raises(build.CudaBuildError):
        build.gencode("hopper")
    # what the pass, the benchmarks and the GPU tests build for a GPU: the "a" target on sm_90 only,
    # and each runs on the GPU it names
    assert [build.arch_for(*cc) for cc in ((9, 0), (8, 0), (8, 6), (10, 0), (12, 0))] == [
        "sm_90a", "sm_80", "sm_86", "sm_100", "sm_120"]  # fmt: skip
    assert all(cuda_rmsnorm.arch_runs_on(build.arch_for(major, minor), 10 * major + minor)
               for major, minor in ((9, 0), (8, 0), (8, 6), (10, 0)))  # fmt: skip


@pytest.mark.skipif(build.find_nvcc() is None, reason="needs nvcc")
@pytest.mark.parametrize(("arch", "sm"), [("sm_90a", 90), ("sm_80", 80)])
def test_build_gives_a_cubin_for_the_arch(arch: str, sm: int) -> None:
    image = build.build_cuda_kernels(arch)
    assert image[:4] == b"\x7fELF"
    assert driver.cubin_sm(image) == sm
    for name in [*cuda_rmsnorm._ENTRY.values(), *cuda_gemv.ENTRIES.values(), *cuda_gemv.ARGMAX_ENTRIES.values(),
                 *cuda_gemv.STAGED_ENTRIES.values(), *cuda_gemv.STAGE_ENTRIES.values(),
                 *cuda_gemv.NORM_STAGE_ENTRIES.values()]:  # fmt: skip
        assert name.endswith(f"_v{cuda_rmsnorm.KERNEL_ABI}") and name.encode() in image


def test_without_native_kernels_falls_back_to_triton_and_warns_once() -> None:
    g = gen(3)
    x, w = rand(g, 3, 64, dtype=torch.bfloat16), rand(g, 64, dtype=torch.bfloat16)
    cuda_rmsnorm.reset_fallback_warning()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        if torch.cuda.is_available():
            assert cuda_rmsnorm.load_cuda_kernels(None, None) is None
            assert cuda_rmsnorm.load_cuda_kernels(b"\x7fELF-not-really", "sm_10a") is None
        else:
            cuda_rmsnorm._fallback("no GPU")
            cuda_rmsnorm._fallback("no GPU")
    assert len([w_ for w_ in seen if "Triton RMSNorm" in str(w_.message)]) == 1
    got = cuda_rmsnorm.rms_norm(x, w, 1e-6, kernels=None)
    torch.testing.assert_close(got, rmsnorm.rms_norm(x, w, 1e-6))


def test_the_fallback_launches_the_configuration_it_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without native kernels the wrapper hands its ``config`` (a stored tuning) to the Triton kernel,
    and the result is the reference's."""
    g = gen(4)
    x, r, w = rand(g, 6, 64), rand(g, 6, 64), rand(g, 64)
    seen = []
    real = rmsnorm.rms_norm
    monkeypatch.setattr(rmsnorm, "rms_norm", lambda *a, **k: seen.append(k.get("config")) or real(*a, **k))
    cfg = rmsnorm.RMSNormConfig(2, 1)
    got, total = cuda_rmsnorm.rms_norm(x, w, 1e-6, kernels=None, residual=r, config=cfg)
    want, want_total = rmsnorm.rms_norm_ref(x, w, 1e-6, residual=r)
    assert seen == [cfg]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(total, want_total)


def test_autotune_candidates_start_with_the_default_and_fit_the_shape() -> None:
    """The pass's candidates: the default first, once; no row tile beyond the rows (rounded up to a
    power of two); 1 to MAX_PER_THREAD elements a thread; looping ones only where some program would
    take more than one block."""
    for rows, cols, sms in ((1, 4096, 132), (32, 4096, 132), (4096, 4096, 132), (2048, 128, 132), (3, 40, 4)):
        found = rmsnorm.candidates(rows, cols, sms)
        block_n = 1 << (cols - 1).bit_length()
        assert found[0] == rmsnorm.default_config(rows, cols) and len(set(found)) == len(found)
        for c in found[1:]:
            assert c in rmsnorm.CONFIGS + rmsnorm.LOOP_CONFIGS
            assert c.block_m <= 1 << (rows - 1).bit_length()
            assert 1 <= c.block_m * block_n // (32 * c.num_warps) <= rmsnorm.MAX_PER_THREAD
            assert c.per_sm == 0 or -(-rows // c.block_m) > c.per_sm * sms
    assert [c.num_warps for c in rmsnorm.candidates(1, 4096, 132)] == [8, 1, 2, 4, 16]  # one row: every width
    assert not [c for c in rmsnorm.candidates(512, 4096, 132) if c.per_sm]  # 512 blocks fill 132 SMs x 4 at once
    assert {c.per_sm for c in rmsnorm.candidates(4096, 4096, 132)} == {0, 4, 8, 16}
