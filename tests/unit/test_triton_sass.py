"""examples/triton_sass.py: the static SASS count of the one-row GEMV (compiled for sm_90 on the CPU),
and with ``--native`` the native kernels' registers and loops (built with nvcc where there is one)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mgx.kernels.cuda.build import find_nvcc

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "triton_sass.py"


def _run(*args: str, interpret: bool = False) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=600)


def test_w8a16_gemv_loop_is_counted_with_and_without_the_norm() -> None:
    """One loop line per variant; the codes reach fp32 through byte permutes (no I2F), one FFMA per
    weight element, and the RMSNorm in the loads costs instructions."""
    done = _run("--scheme", "w8a16", "--block-n", "8", "--block-k", "512", "--warps", "4")
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert [("norm in loads False" in x, "norm in loads True" in x) for x in lines] == [(True, False), (False, True)]
    per = [float(re.search(r"([\d.]+) per weight element", x).group(1)) for x in lines]
    ffma = [int(re.search(r"FFMA (\d+)", x).group(1)) for x in lines]
    assert ffma == [32, 32]  # 8 x 512 codes over 128 threads: 32 each
    assert "PRMT" in lines[0] and "I2F" not in done.stdout
    assert 2.0 < per[0] < per[1] < 20.0


def test_refuses_to_count_interpreted_kernels() -> None:
    done = _run("--scheme", "none", interpret=True)
    assert done.returncode != 0 and "unset TRITON_INTERPRET" in done.stderr


@pytest.mark.skipif(find_nvcc() is None, reason="needs nvcc")
def test_native_tensor_core_gemvs_fit_two_blocks_an_sm_without_spilling() -> None:
    """``--native``: the tensor-core GEMV entries built for sm_90a, their registers and loops. Every
    entry keeps everything in registers (no stack), the pipelined ones and ``imma`` within 128
    registers a thread (two blocks of 256 threads an SM, which their design counts on; ``imma_multi``,
    kind ``imma_persistent``'s entries, and ``imma4`` and ``imma16``, those of 4 and 16 warps a block,
    are counted with ``imma``, and so are the greedy LM head's ``_argmax`` entries), and each has a
    main loop with its weight loads inside: int4 64 MMAs (4 steps of 16), W8A16 48 (2 steps of 24: four
    MMAs for each 8 columns' codes and two for the sum of x), ``imma`` 8 integer MMAs (two passes of
    one step, four a step: two 64-column halves, int4: low and high nibbles, for each of the two sets of 8 rows).
    The staged twins of ``imma``, ``imma4`` and ``imma16`` are counted with them, within 64 registers,
    and the stage kernels (a step a warp) have no loop."""
    done = _run("--native", "sm_90a", "--match", "mma")
    assert done.returncode == 0, done.stderr[-2000:]
    found = {}
    for line in done.stdout.strip().splitlines():
        m = re.match(r"(\w+): (\d+) registers, (\d+) bytes of stack; loops (.*)", line)
        assert m, line
        found[m.group(1)] = (int(m.group(2)), int(m.group(3)), m.group(4))
    assert {re.sub(r"_v\d+$", "", name) for name in found} == {
        f"mgx_gemv_{scheme}_{kind}_bf16{norm}" for scheme in ("int4", "w8a16") for kind in ("mma", "mma_pipe")
        for norm in ("", "_norm")} | {f"mgx_gemv_{scheme}_{kind}_bf16{norm}" for scheme in ("int4", "w8a16")
                                       for kind in ("imma", "imma_multi", "imma4", "imma16", "imma4_multi")
                                       for norm in ("", "_norm")} | {
        f"mgx_gemv_{scheme}_{kind}_argmax" for scheme in ("int4", "w8a16")
        for kind in ("imma", "imma_multi", "imma4", "imma16", "imma4_multi")} | {
        f"mgx_gemv_{scheme}_{kind}_staged_bf16" for scheme in ("int4", "w8a16") for kind in ("imma", "imma4", "imma16")} | {
        f"mgx_imma_stage_{scheme}" for scheme in ("int4", "w8a16")}  # fmt: skip
    for name, (regs, stack, loops) in found.items():
        assert stack == 0, name
        if name.startswith("mgx_imma_stage_"):  # a step a warp: no loop
            assert loops == "none", name
            continue
        assert regs <= (128 if "_pipe_" in name or "_imma" in name else 255), name
        assert "_staged_" not in name or regs <= 64, name  # the kinds' own occupancy (their launch bounds)
        if "_imma" in name:
            assert re.search(r"\d+ \(IMMA 8, LDG \d+\)", loops), name
            continue
        mmas = 64 if "_int4_" in name else 48
        assert re.search(rf"\d+ \(HMMA {mmas}, LDG \d+\)", loops), name


def test_native_mode_names_a_missing_entry() -> None:
    if find_nvcc() is None:
        done = _run("--native", "sm_90a")
        assert done.returncode != 0 and "nvcc not found" in done.stderr
    else:
        done = _run("--native", "sm_90a", "--match", "no_such_entry")
        assert done.returncode == 1 and "no entry point holds 'no_such_entry'" in done.stdout
