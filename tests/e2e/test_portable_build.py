"""The portable build: what a host without x86 vector paths (aarch64) compiles, built here with
``MGX_PORTABLE_ONLY=1``. It must offer only the scalar path and compute what the numpy reference does."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = r"""
import importlib.util, sys
import numpy as np
spec = importlib.util.spec_from_file_location("mgx.kernels.cpu._mgx_cpu", sys.argv[1])
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
sys.modules["mgx.kernels.cpu._mgx_cpu"] = mod
import mgx.kernels.cpu as cpu
from mgx.formats import ir
assert cpu.raw is mod, "the probe must run the portable build"
print(" ".join(cpu.supported_isas()))
rng = np.random.default_rng(0)
w = rng.normal(0, 0.1, (37, 45)).astype(np.float32)
x = rng.normal(0, 1, (3, 45)).astype(np.float32)
handle = cpu.LinearWeight(ir.Tensor("w", ir.DType.F32, w.shape, w))
np.testing.assert_allclose(cpu.linear(x, handle), x @ w.T, rtol=1e-5, atol=1e-5)
g = rng.normal(0, 1, (2, 45)).astype(np.float32)
want = g / np.sqrt((g * g).mean(1, keepdims=True) + 1e-6)
np.testing.assert_allclose(cpu.rms_norm(g, None, eps=1e-6, group=45), want, rtol=1e-5, atol=1e-5)
print("ok")
"""


def test_portable_only_build_runs_the_scalar_path(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(ROOT / "setup.py", src)
    shutil.copytree(ROOT / "kernels" / "cpu" / "csrc", src / "kernels" / "cpu" / "csrc")
    env = {**os.environ, "MGX_PORTABLE_ONLY": "1"}
    build = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(tmp_path / "lib"), "--build-temp",
         str(tmp_path / "tmp")],
        cwd=src, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr[-3000:]
    (built,) = (tmp_path / "lib").rglob("_mgx_cpu*.so")
    probe = subprocess.run([sys.executable, "-c", PROBE, str(built)], capture_output=True, text=True, timeout=300)
    assert probe.returncode == 0, probe.stderr[-3000:]
    assert probe.stdout.split() == ["scalar", "ok"]
