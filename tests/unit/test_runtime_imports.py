"""The runtime stays light: no torch, transformers or compiler, and a cheap package import."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ["torch", "transformers", "triton", "mgx.compiler", "mgx.passes"]
ALLOWED = {"numpy", "tokenizers", "jinja2", "click", "zstandard", "flatbuffers", "mgx", "starlette", "uvicorn", "anyio"}


def loaded_after(code: str) -> set[str]:
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    return set(json.loads(out.splitlines()[-1]))


def test_the_whole_runtime_never_loads_torch_or_the_compiler() -> None:
    modules = loaded_after(
        "from mgx.runtime import Engine, check_golden\nimport mgx.runtime.cli\nimport mgx.kernels.reference"
    )
    assert "mgx.runtime.engine" in modules
    assert not [m for m in HEAVY if m in modules]


def test_importing_the_package_loads_nothing_heavy() -> None:
    modules = loaded_after("import mgx.runtime")
    assert not {"mgx.runtime.engine", "tokenizers", "jinja2", "numpy"} & modules


@pytest.mark.parametrize("package", ["runtime", "kernels"])
def test_sources_import_only_allowed_packages(package: str) -> None:
    stdlib = set(sys.stdlib_module_names)
    # GPU kernels, the CUDA backend and in-graph tuning (mgx-run tune) import torch/triton by design;
    # the CPU path never imports them (checked above: backends are imported only when chosen, and
    # the tune command imports its module when it runs).
    gpu_only = {ROOT / "kernels" / "triton", ROOT / "kernels" / "cuda"}
    gpu_modules = {ROOT / "runtime" / "backend_cuda.py", ROOT / "runtime" / "tune.py"}
    for path in (ROOT / package).rglob("*.py"):
        if any(parent in gpu_only for parent in path.parents) or path in gpu_modules:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                assert top in stdlib or top in ALLOWED, f"{path.relative_to(ROOT)} imports {name}"
                assert not name.startswith(("mgx.compiler", "mgx.passes")), (
                    f"{path.relative_to(ROOT)} imports {name}"
                )
