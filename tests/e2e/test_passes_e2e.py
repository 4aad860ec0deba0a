"""Tiny Hugging Face models of every family compiled with pass lists: the artifact records the
passes, the runtime replays the golden set recorded by transformers on the weights as stored
(``mgx-run check``), and logits stay where the pass says (exact for fusion and folding, bounded for
quantization) against the same model compiled without passes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mgx.compiler._progress import Progress
from mgx.compiler.pipeline import CompileError, compile_model
from mgx.compiler.spec import load_spec
from mgx.formats.artifact import load_artifact

from _tiny_hf import CORPUS, FAMILIES, write_spec

FUSE_FOLD = ["fuse_qkv", "fuse_gate_up", "fold_norm"]
INT4 = [*FUSE_FOLD, {"quantize_int4": {"group_size": 32}}]
IDS = [5, 17, 33, 2, 90, 41, 7, 7, 120, 64, 3, 250, 18, 99, 45, 61]
# ||logits' - logits|| / ||logits|| against the build without passes (fp32 tiny models whose random
# weights make int4 g32 move logits by 20-35%; a real model moves far less, see examples/perplexity.py).
FUSE_FOLD_TOL = 1e-5
INT4_TOL = 0.5


PROMPTS = ["Hello world", "The quick brown fox jumps", {"text": "hello there", "chat": True}, "Caf\u00e9"]


def _compile(built, tmp_path: Path, passes: list, tag: str, calibration: bool = False):  # noqa: ANN001, ANN202
    """Compile ``built``'s model folder with ``passes`` (fp32, 16 golden tokens per prompt)."""
    if calibration:
        (tmp_path / "calibration.txt").write_text(CORPUS)
    extra = "passes: " + json.dumps(passes) + "\n"
    spec_path = write_spec(built.folder, built.family, "fp32", PROMPTS, 16, extra)
    target = tmp_path / f"{built.family}-{tag}.yaml"
    target.write_text(spec_path.read_text().replace("calibration.txt", str(tmp_path / "calibration.txt")))
    return compile_model(load_spec(target), tmp_path / f"{built.family}-{tag}.mgx", tmp_path / "golden",
                         Progress(enabled=False), source=built.source)


def _logits(artifact: Path) -> np.ndarray:
    from mgx.runtime import Engine
    from mgx.runtime.batch import SeqChunk

    engine = Engine(artifact)
    ids = np.array(IDS) % engine.graph.arch.vocab_size
    (out,) = engine.runner.step([SeqChunk(0, ids, all_logits=True)])
    return out


def _golden_ok(artifact: Path) -> list[float]:
    from mgx.runtime import Engine
    from mgx.runtime.golden import check_golden

    engine = Engine(artifact)
    report = check_golden(engine, engine.contents.golden)
    failure = report.first_failure
    assert failure is None, f"{artifact.name}: case {failure.index}: {failure.divergence.describe()}"
    return [c.max_logit_error for c in report.cases]


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("family", FAMILIES)
def test_fusion_and_folding_are_exact(tiny_models, tmp_path: Path, family: str) -> None:  # noqa: ANN001
    built = tiny_models[family]
    result = _compile(built, tmp_path, FUSE_FOLD, "fused")
    kinds = [op.kind for op in result.graph.ops]
    assert kinds.count("split") == result.graph.arch.num_layers
    assert _rel(_logits(result.output), _logits(built.artifact)) < FUSE_FOLD_TOL
    _golden_ok(result.output)


@pytest.mark.parametrize("family", FAMILIES)
def test_int4_build_passes_check_and_stays_close(tiny_models, tmp_path: Path, family: str) -> None:  # noqa: ANN001
    built = tiny_models[family]
    result = _compile(built, tmp_path, INT4, "int4")
    contents = load_artifact(result.output).contents
    assert [p.name for p in contents.passes] == [*FUSE_FOLD, "quantize_int4"]
    assert contents.passes[-1].options["group_size"] == 32  # recorded with its defaults filled in
    assert contents.passes[-1].options["skip"]["lm_head"] is False
    assert contents.fingerprint.quantization == "int4"
    assert result.graph.weight_bytes() < 0.3 * built.result.graph.weight_bytes()
    errors = _golden_ok(result.output)
    assert max(errors) < 1e-4  # the golden set ran on the dequantized weights: only fp32 rounding is left
    rel = _rel(_logits(result.output), _logits(built.artifact))
    print(f"{family}: int4 g32 relative logits error {rel:.3f}")
    assert rel < INT4_TOL


@pytest.mark.parametrize("passes, scheme", [
    (["quantize_w8a16"], "w8a16"),
    ([*FUSE_FOLD, {"sparsify_2_4": {"method": "sparsegpt", "calibration": {"text_file": "calibration.txt",
                                                                            "tokens": 256, "seq_len": 64}}},
      {"quantize_int4": {"group_size": 32, "method": "gptq", "calibration": {"text_file": "calibration.txt"}}},
      "reorder_weights"], "sparse24_int4"),
], ids=["w8a16", "sparse24_int4_calibrated"])
def test_other_schemes_pass_mgx_run_check(tiny_models, tmp_path: Path, passes: list, scheme: str) -> None:  # noqa: ANN001
    built = tiny_models["qwen2"]
    result = _compile(built, tmp_path, passes, scheme, calibration=True)
    assert scheme in result.graph.tensors["layers.0.mlp.down_proj.weight"].scheme
    for p in load_artifact(result.output).contents.passes:
        if "calibration" in p.options:
            cal = p.options["calibration"]
            assert cal["text_file"] == "calibration.txt" and len(cal["sha256"]) == 64
    check = subprocess.run([sys.executable, "-c", "from mgx.runtime.cli import main; main()", "check",
                            str(result.output)], capture_output=True, text=True, timeout=600)
    assert check.returncode == 0, check.stdout + check.stderr
    assert "all 4 golden cases match" in check.stdout


def test_bad_pass_options_stop_the_compile_by_name(tiny_models, tmp_path: Path) -> None:  # noqa: ANN001
    built = tiny_models["llama"]
    with pytest.raises(CompileError, match=r"pass 'quantize_int4' failed: quantize_int4: unknown option 'bits'"):
        _compile(built, tmp_path, [{"quantize_int4": {"bits": 3}}], "bad")
    with pytest.raises(CompileError, match=r"calibration.text_file: no such file"):
        _compile(built, tmp_path, [{"quantize_int4": {"method": "gptq", "calibration": {"text_file": "nope.txt"}}}],
                 "bad")
    with pytest.raises(CompileError, match=r"method gptq needs calibration statistics"):
        _compile(built, tmp_path, [{"quantize_int4": {"method": "gptq"}}], "bad")
