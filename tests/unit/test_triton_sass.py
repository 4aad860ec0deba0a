"""examples/triton_sass.py: the static SASS count of the one-row GEMV (compiled for sm_90 on the CPU)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

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
