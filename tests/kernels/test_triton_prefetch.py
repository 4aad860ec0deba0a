"""Weight prefetch of the overlapped one-row linear kernels: the switch, the lines each program asks
L2 for (interpreted, against numpy), the launch options, results unchanged, and the code Triton makes
for sm_90 (the prefetches before the wait; compiled, not run: the GPU tests launch it)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from mgx.kernels.triton import _common  # noqa: E402
from mgx.kernels.triton import linear as lin  # noqa: E402
from mgx.kernels.triton.testing import make_weight  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_prefetch_bytes_follow_the_switch_and_never_reach_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _common.prefetch_bytes() == 0
    monkeypatch.setattr(_common, "_INTERPRETING", False)
    with _common.overlapped_launches(True, 16384):
        assert _common.prefetch_bytes() == 16384
        with _common.overlapped_launches(False, 16384):
            assert _common.prefetch_bytes() == 0  # not overlapped: nothing to hide behind a wait
        assert _common.prefetch_bytes() == 16384
    assert _common.prefetch_bytes() == 0
    monkeypatch.setattr(_common, "_INTERPRETING", True)
    with _common.overlapped_launches(True, 16384):
        assert _common.prefetch_bytes() == 0
    for bad in (-128, 3000):
        with pytest.raises(ValueError, match="power of two"):
            with _common.overlapped_launches(True, bad):
                pass
    assert _common.prefetch_bytes() == 0


@triton.jit
def _lines_kernel(offs_ptr, mask_ptr, stride_w, N, K, row0, SCHEME: tl.constexpr, SPLIT_K: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PF_LINES: tl.constexpr, PF_STEP: tl.constexpr):  # fmt: skip
    offs, mask = lin._weight_lines(stride_w, N, K, row0, SCHEME, SPLIT_K, BLOCK_N, BLOCK_K, PF_LINES, PF_STEP)
    i = (tl.program_id(1) * tl.num_programs(2) + tl.program_id(2)) * BLOCK_N * PF_LINES
    j = tl.arange(0, BLOCK_N)[:, None] * PF_LINES + tl.arange(0, PF_LINES)[None, :]
    tl.store(offs_ptr + i + j, offs)
    tl.store(mask_ptr + i + j, mask.to(tl.int32))


def _expected_lines(stride_w: int, n: int, k: int, row0: int, scheme: int, split_k: int, block_n: int,
                    block_k: int, lines: int, step: int) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """What each program (along N, then its K share) should prefetch: [programs, block_n, lines]."""
    offs, mask = [], []
    tiles = -(-k // block_k)
    span = -(-tiles // split_k) * block_k
    for pn in range(-(-n // block_n)):
        for pk in range(split_k):
            lo, hi = (pk * span, min(k, pk * span + span)) if split_k > 1 else (0, k)
            if scheme == 2:
                lo, hi = lo // 2, hi // 2
            rows = pn * block_n + np.arange(block_n)
            cols = lo + np.arange(lines) * step
            offs.append((rows[:, None] + row0) * stride_w + cols[None, :])
            mask.append((rows < n)[:, None] & (cols < hi)[None, :])
    return np.array(offs), np.array(mask)


@pytest.mark.parametrize(
    ("scheme", "n", "k", "row0", "split_k", "block_n", "block_k", "lines", "step"),
    [
        (0, 24, 256, 0, 1, 16, 64, 8, 64),  # bf16, a ragged last row block, lines past K masked
        (1, 24, 512, 24, 1, 16, 128, 2, 128),  # int8, the up rows of a gate/up weight
        (1, 16, 1024, 0, 3, 8, 128, 4, 128),  # split K: each share starts its own lines
        (2, 12, 512, 0, 2, 8, 128, 1, 128),  # int4: K / 2 bytes a row
    ],
)
def test_weight_lines_are_the_start_of_each_programs_share(scheme, n, k, row0, split_k, block_n, block_k, lines, step):  # noqa: ANN001
    stride_w = (k // 2 if scheme == 2 else k) + 16  # a padded row stride, so rows are told apart from columns
    programs = -(-n // block_n) * split_k
    offs = torch.full((programs * block_n * lines,), -1, dtype=torch.int64, device=DEVICE)
    mask = torch.full((programs * block_n * lines,), -1, dtype=torch.int32, device=DEVICE)
    _lines_kernel[(1, -(-n // block_n), split_k)](offs, mask, stride_w, n, k, row0, SCHEME=scheme, SPLIT_K=split_k,
                                                  BLOCK_N=block_n, BLOCK_K=block_k, PF_LINES=lines, PF_STEP=step)  # fmt: skip
    want_offs, want_mask = _expected_lines(stride_w, n, k, row0, scheme, split_k, block_n, block_k, lines, step)
    np.testing.assert_array_equal(offs.cpu().numpy().reshape(want_offs.shape), want_offs)
    np.testing.assert_array_equal(mask.cpu().numpy().reshape(want_mask.shape).astype(bool), want_mask)
    assert want_mask.any() and not want_mask.all()  # each case has lines both in and out of bounds


def test_prefetch_options_spread_the_bytes_over_the_programs_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    dense, w8, int4 = (make_weight(s, 64, 512, device="cpu", **kw) for s, kw in
                       (("none", {}), ("w8a16", {}), ("int4", {"group_size": 128})))  # fmt: skip
    sparse = make_weight("sparse24", 64, 512, device="cpu")
    off = {"PF_LINES": 0, "PF_STEP": 1}
    assert lin._prefetch_options(dense, False, False, 16) == off  # the switch is off
    monkeypatch.setattr(_common, "_PREFETCH", _common.contextvars.ContextVar("t", default=16384))
    assert lin._prefetch_options(dense, False, False, 16) == {"PF_LINES": 8, "PF_STEP": 64}  # 16 rows x 8 x 128 B
    assert lin._prefetch_options(w8, True, False, 16) == {"PF_LINES": 4, "PF_STEP": 128}  # gate and up rows
    assert lin._prefetch_options(int4, False, False, 256) == {"PF_LINES": 1, "PF_STEP": 128}  # at least a line a row
    assert lin._prefetch_options(dense, False, True, 16) == off  # the tile GEMM
    assert lin._prefetch_options(sparse, False, False, 16) == off


@pytest.mark.parametrize("name", ["none", "w8a16", "int4"])
@pytest.mark.parametrize("silu_mul", [False, True])
def test_prefetching_launches_give_the_same_bits(name: str, silu_mul: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """One-row launches with the prefetch on (its lines computed; the L2 request itself only compiled)
    give the bits of launches without it, with the default and a split-K configuration."""
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    kw = {"group_size": 64} if name == "int4" else {}
    w = make_weight(name, 64 if silu_mul else 48, 256, dtype=dtype, device=DEVICE, generator=gen, **kw)
    x = torch.randn(1, 256, device=DEVICE, generator=gen).to(dtype)
    run = lin.linear_silu_mul if silu_mul else lin.linear
    configs = [None, lin.LinearConfig(block_m=1, block_n=16, block_k=64, num_warps=4, num_stages=1, split_k=2)]
    want = [run(x, w, config=c) for c in configs]
    monkeypatch.setattr(_common, "_PREFETCH", _common.contextvars.ContextVar("t", default=4096))
    assert lin._prefetch_options(w, silu_mul, False, 16)["PF_LINES"] > 0
    got = [run(x, w, config=c) for c in configs]
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_linear_kernel_compiled_for_sm90_prefetches_before_it_waits() -> None:
    """The one-row W8A16 GEMV compiled for sm_90 (in a process without the interpreter), overlapped:
    with PF_LINES its PTX asks L2 for lines (prefetch.global.L2) before griddepcontrol.wait, and
    its SASS holds a prefetch (CCTL.E.PF2) before the wait (ACQBULK); without, no prefetch."""
    code = textwrap.dedent("""
        import os, sys
        os.environ.pop("TRITON_INTERPRET", None)
        sys.path.insert(0, "examples")
        import triton_sass
        for lines in (0, 2):
            sass = triton_sass.compile_sass("w8a16", 16, 1024, 8, 1, False, 90, OVERLAP=True, PF_LINES=lines,
                                            PF_STEP=128)
            ops = [m.group(1) for m in triton_sass._OPCODE.finditer(sass)]
            pf = ops.index("CCTL") if "CCTL" in ops else -1
            print(lines, pf, ops.index("ACQBULK"))
    """)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (off, on) = [tuple(int(v) for v in line.split()) for line in proc.stdout.split("\n") if line]
    assert off[1] == -1 and off[2] >= 0
    assert 0 <= on[1] < on[2]
