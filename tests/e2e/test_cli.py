"""The command lines end to end on a tiny model: compile, inspect, verify, generate, check, bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from _tiny_hf import build_model_dir, write_spec


def _run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _MAIN, *args], capture_output=True, text=True, cwd=cwd, timeout=600)


# Run the console scripts' entry points in a fresh interpreter (same as the installed commands).
_MAIN = (
    "import sys; tool = sys.argv.pop(1); "
    "from importlib import import_module; "
    "mod = import_module('mgx.compiler.cli' if tool == 'mgxc' else 'mgx.runtime.cli'); "
    "sys.argv[0] = tool; mod.main()"
)


def test_mgxc_compile_inspect_verify(tmp_path: Path) -> None:
    folder = build_model_dir(tmp_path / "qwen2", "qwen2", seed=3)
    spec = write_spec(folder, "qwen2", "bf16", ["Hello world"], 8)
    out = tmp_path / "q.mgx"
    res = _run("mgxc", "compile", str(spec), "-o", str(out), "--golden-dir", str(tmp_path / "golden"))
    assert res.returncode == 0, res.stderr
    assert "trace (torch.export)" in res.stderr and "lower to IR" in res.stderr
    assert out.is_file() and "wrote" in res.stdout
    golden = json.loads((tmp_path / "golden" / "tiny-qwen2.json").read_text())
    assert golden["fingerprint"]["dtype"] == "bf16" and len(golden["cases"][0]["expected_ids"]) == 8

    info = _run("mgxc", "inspect", str(out), "--json")
    assert info.returncode == 0, info.stderr
    doc = json.loads(info.stdout)
    assert doc["architecture"]["model_type"] == "qwen2"
    assert doc["tensor_count"] > 10 and "bf16" in doc["bytes_by_dtype"]
    assert doc["fingerprint"]["dtype"] == "bf16"
    text = _run("mgxc", "inspect", str(out)).stdout
    for word in ("architecture", "tensor_count", "bytes_by_dtype", "bytes_by_scheme", "passes", "fingerprint"):
        assert word in text

    ok = _run("mgxc", "verify", str(out))
    assert ok.returncode == 0 and ok.stdout.startswith("ok:")

    # bf16 weights, fp32 compute: the runtime replays the golden set recorded by transformers.
    check = _run("mgx-run", "check", str(out))
    assert check.returncode == 0, check.stdout + check.stderr

    gen = _run("mgx-run", "generate", str(out), "--prompt", "Hello", "--max-tokens", "5")
    assert gen.returncode == 0, gen.stderr
    assert "load" in gen.stderr and "tok/s" in gen.stderr
    # The default backend (auto: the C++ CPU kernels) and the numpy reference agree; every backend
    # replays the golden set.
    ref = _run("mgx-run", "generate", str(out), "--prompt", "Hello", "--max-tokens", "5", "--backend", "reference")
    assert ref.returncode == 0 and ref.stdout == gen.stdout, ref.stderr
    for backend in ("cpu", "reference"):
        res = _run("mgx-run", "check", str(out), "--backend", backend, "--threads", "1")
        assert res.returncode == 0, res.stdout + res.stderr
    import torch

    if not torch.cuda.is_available():  # a clear error, not a traceback
        res = _run("mgx-run", "generate", str(out), "--prompt", "Hello", "--backend", "cuda")
        assert res.returncode != 0 and "Traceback" not in res.stderr
        assert "cuda" in res.stderr and "no CUDA device" in res.stderr, res.stderr

    data = bytearray(out.read_bytes())
    data[len(data) // 2] ^= 0x01
    bad = tmp_path / "bad.mgx"
    bad.write_bytes(bytes(data))
    res = _run("mgxc", "verify", str(bad))
    assert res.returncode != 0
    assert res.stderr.startswith("error: ") and len(res.stderr.strip().splitlines()) == 1
    assert "Traceback" not in res.stderr
    res = _run("mgx-run", "check", str(bad))
    assert res.returncode == 2 and "Traceback" not in res.stderr


def test_check_reports_first_divergence(tiny_models, tmp_path: Path) -> None:  # noqa: ANN001
    from mgx.formats.artifact import load_artifact, write_artifact

    built = tiny_models["llama"]
    loaded = load_artifact(built.artifact)
    contents = loaded.contents
    case = contents.golden.cases[1]
    wrong = list(case.expected_ids)
    wrong[5] = (wrong[5] + 1) % contents.graph.arch.vocab_size
    cases = list(contents.golden.cases)
    cases[1] = replace(case, expected_ids=wrong)
    tampered = tmp_path / "tampered.mgx"
    write_artifact(tampered, replace(contents, golden=replace(contents.golden, cases=cases)))
    loaded.close()
    res = _run("mgx-run", "check", str(tampered))
    assert res.returncode == 1
    out = res.stdout + res.stderr
    assert "position 5" in out, out
    assert "Traceback" not in out


@pytest.mark.parametrize(
    ("yaml_text", "needle"),
    [
        ("name: x\nsource: {hf_dir: .}\nbogus: 1\n", "unknown key 'bogus'"),
        ("name: x\n  source: : [\n", "malformed YAML"),
    ],
)
def test_mgxc_compile_rejects_bad_yaml(tmp_path: Path, yaml_text: str, needle: str) -> None:
    (tmp_path / "config.json").write_text("{}")
    spec = tmp_path / "m.yaml"
    spec.write_text(yaml_text)
    res = _run("mgxc", "compile", str(spec))
    assert res.returncode == 2
    assert needle in res.stderr and "Traceback" not in res.stderr


def test_mgxc_compile_rejects_unknown_model_type(tmp_path: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).save_pretrained(folder)
    spec = tmp_path / "m.yaml"
    spec.write_text(f"name: g\nsource: {{hf_dir: {folder}}}\n")
    res = _run("mgxc", "compile", str(spec), "-o", str(tmp_path / "g.mgx"))
    assert res.returncode == 1
    assert "model type 'gpt2' is not supported; supported: llama, mistral, qwen2, qwen3" in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize("tool", ["mgxc", "mgx-run"])
def test_missing_and_foreign_files(tmp_path: Path, tool: str) -> None:
    foreign = tmp_path / "model.mgx"
    foreign.write_bytes(b"GGUF" + bytes(5000))
    cmd = ("inspect",) if tool == "mgxc" else ("generate", "--prompt", "hi")
    for path in (foreign, tmp_path / "absent.mgx"):
        args = [tool, cmd[0], str(path), *cmd[1:]]
        res = _run(*args)
        assert res.returncode != 0
        assert res.stderr.startswith("error: "), res.stderr
        assert "Traceback" not in res.stderr


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        # a header cut short inside its first key: transformers' reader fails on a struct unpack
        (b"GGUF" + (3).to_bytes(4, "little") + (1).to_bytes(8, "little") + (5).to_bytes(8, "little")
         + (20).to_bytes(8, "little") + b"general.arch", "it holds 44 bytes"),
        (b"not a gguf file", "GGUF magic invalid"),
    ],
)
def test_mgxc_compile_names_a_gguf_file_it_cannot_read(tmp_path: Path, data: bytes, needle: str) -> None:
    (tmp_path / "m.gguf").write_bytes(data)
    spec = tmp_path / "m.yaml"
    spec.write_text("name: g\nsource: {gguf: m.gguf}\n")
    res = _run("mgxc", "compile", str(spec), "-o", str(tmp_path / "g.mgx"))
    assert res.returncode == 1
    assert "m.gguf: not a readable GGUF file (" in res.stderr and needle in res.stderr, res.stderr
    assert "Traceback" not in res.stderr
