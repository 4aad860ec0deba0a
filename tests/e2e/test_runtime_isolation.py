"""The runtime never pulls in the compiler side: checked in a fresh interpreter that loads and generates."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = r"""
import json, sys
import mgx.runtime
from mgx.runtime import Engine
engine = Engine(sys.argv[1])
result = engine.generate("Hello world", max_tokens=4, temperature=0.0)
banned = ["mgx.compiler", "mgx.passes", "transformers", "onnx", "gguf", "torch", "triton"]
print(json.dumps({"loaded": sorted(m for m in banned if m in sys.modules), "tokens": len(result.token_ids)}))
"""


def test_runtime_imports_no_compiler_side(tiny_models) -> None:  # noqa: ANN001
    artifact = tiny_models["qwen3"].artifact
    res = subprocess.run([sys.executable, "-c", SCRIPT, str(artifact)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout.strip().splitlines()[-1])
    assert doc["tokens"] == 4
    assert doc["loaded"] == [], f"the runtime imported {doc['loaded']}"
