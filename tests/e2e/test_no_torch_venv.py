"""A deployment host: a fresh virtual environment without torch, ``pip install .`` (no extras, which
builds the C++ kernels), then ``mgx-run generate`` and the CPU backend on a tiny artifact.

The artifact is built here, in the test's environment, from a tiny random graph and the formats
writer. The venv's pip reaches the package index for numpy and the other runtime dependencies.
Takes a few minutes: most of it compiles the kernels.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from _tiny_graph import tiny_contents

ROOT = Path(__file__).resolve().parents[2]
# What a source checkout holds that a build must not see (build outputs, caches, other venvs).
_NOT_SOURCE = shutil.ignore_patterns(".git", "build", "dist", "*.egg-info", "__pycache__", "*.so", ".venv*",
                                     ".pytest_cache", ".ruff_cache", "*.mgx", "out", "test-artifacts")

GENERATE = """
import sys
from mgx.kernels import cpu
from mgx.runtime import Engine
engine = Engine(sys.argv[1], backend="cpu")
result = engine.generate("the cat sat", max_tokens=12, temperature=0)
loaded = sorted(m for m in ("torch", "transformers", "mgx.compiler") if m in sys.modules)
print(repr(result.text), cpu.isa(), loaded)
"""


def _run(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{args[:3]} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("no_torch")
    src = base / "src"
    shutil.copytree(ROOT, src, ignore=_NOT_SOURCE)
    env = base / "venv"
    _run([sys.executable, "-m", "venv", env])
    _run([env / "bin" / "python", "-m", "pip", "install", "--quiet", src], timeout=1800)
    return env


def test_pip_install_has_no_torch_and_builds_the_kernels(venv: Path) -> None:
    probe = "import importlib.util as u; print(u.find_spec('torch') is None, u.find_spec('mgx.kernels.cpu._mgx_cpu') is not None)"
    assert _run([venv / "bin" / "python", "-c", probe]).stdout.split() == ["True", "True"]


def test_generate_without_torch(venv: Path, tmp_path: Path) -> None:
    from mgx.formats.artifact import write_artifact
    from mgx.runtime import Engine

    artifact = tmp_path / "tiny.mgx"
    write_artifact(artifact, tiny_contents())
    want = Engine(artifact).generate("the cat sat", max_tokens=12, temperature=0).text  # the reference backend

    out = _run([venv / "bin" / "python", "-c", GENERATE, artifact]).stdout.strip()
    assert out.endswith("[]"), f"torch or the compiler was imported: {out}"
    assert out.startswith(repr(want)), out

    cli = _run([venv / "bin" / "mgx-run", "generate", artifact, "--prompt", "the cat sat", "-n", "12",
                "--temperature", "0", "--threads", "2"])
    assert cli.stdout.rstrip("\n") == want
