"""``mgx-run`` end to end on tiny artifacts written to disk, through click's CliRunner."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from mgx.formats.artifact import GoldenCase, GoldenSet, write_artifact
from mgx.runtime import Engine
from mgx.runtime.cli import main

from _tiny_graph import tiny_contents


def with_golden(contents, prompts: list[tuple[str, bool]], n: int = 6):
    """``contents`` with a golden set recorded from its own greedy outputs."""
    engine = Engine.from_contents(contents)
    cases = []
    for prompt, chat in prompts:
        ids = engine.encode_prompt(prompt, chat=chat)
        cases.append(GoldenCase(prompt, chat, ids, *engine.greedy_with_logits(ids, n)))
    contents.golden = GoldenSet(cases, logit_atol=1e-4)
    return contents


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("mgx") / "tiny.mgx"
    write_artifact(path, with_golden(tiny_contents(), [("the cat", False), ("héllo", True)]))
    return path


def run(*args: str | Path):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_help_names_the_commands() -> None:
    result = run("--help")
    assert result.exit_code == 0
    assert "generate" in result.output and "check" in result.output and "mgx-run generate" in result.output


def test_engine_maps_the_artifact(artifact: Path) -> None:
    engine = Engine(artifact, verify=True)
    assert engine.load_seconds > 0
    weight = engine.graph.tensors["layers.0.self_attn.q_proj.weight"].data
    assert not weight.flags.writeable and not weight.flags.owndata  # a view of the mapped file


def test_generate_streams_text_and_reports_speed(artifact: Path) -> None:
    result = run("generate", artifact, "--prompt", "the cat", "--max-tokens", "5", "--temperature", "0")
    assert result.exit_code == 0, result.output
    expected = Engine(artifact).generate("the cat", max_tokens=5, temperature=0)
    assert result.stdout == expected.text + "\n"
    assert "load" in result.stderr and "prompt 4 tokens" in result.stderr and "decode" in result.stderr


def test_generate_samples_reproducibly(artifact: Path) -> None:
    args = ("generate", artifact, "-p", "the", "-n", "8", "-t", "1.0", "--top-k", "50", "--top-p", "0.9")
    assert run(*args, "--seed", "5").stdout == run(*args, "--seed", "5").stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("generate", "missing.mgx", "-p", "hi"), "error: no such model file: missing.mgx"),
        (("generate", "{artifact}", "-p", "the cat " * 40), "error: the prompt has"),
        (("generate", "{artifact}", "-p", "hi", "-n", "200"), "> the model's context of 128 tokens"),
        (("check", "missing.mgx"), "error: no such model file"),
    ],
)
def test_bad_input_is_one_error_line(artifact: Path, args: tuple[str, ...], message: str) -> None:
    result = run(*(a.format(artifact=artifact) for a in args))
    assert result.exit_code == 1
    assert message in result.stderr and result.stderr.count("\n") == 1
    assert "Traceback" not in result.output


def test_chat_needs_a_template(tmp_path: Path) -> None:
    path = tmp_path / "plain.mgx"
    write_artifact(path, tiny_contents(chat_template=None))
    result = run("generate", path, "-p", "hi", "--chat")
    assert result.exit_code == 1 and "error: this model has no chat template" in result.stderr


def test_check_passes_on_a_good_artifact(artifact: Path) -> None:
    result = run("check", artifact)
    assert result.exit_code == 0, result.output
    assert "case 0 'the cat': ok (6 tokens" in result.stdout and "case 1 'héllo': ok" in result.stdout
    assert "all 2 golden cases match" in result.stdout


def test_check_reports_the_first_diverging_token(tmp_path: Path) -> None:
    contents = with_golden(tiny_contents(), [("the cat", False), ("the dog", False)])
    case = contents.golden.cases[1]
    real = case.expected_ids[2]
    case.expected_ids[2] = (real + 1) % 300
    path = tmp_path / "drift.mgx"
    write_artifact(path, contents)
    result = run("check", path)
    assert result.exit_code == 1
    assert "case 0 'the cat': ok" in result.stdout
    assert f"case 1 'the dog': MISMATCH at position 2: expected token {(real + 1) % 300}" in result.stdout
    assert f"got {real} " in result.stdout and "error: 1 of 2 golden cases differ" in result.stderr


def test_check_without_golden_set(tmp_path: Path) -> None:
    path = tmp_path / "nogolden.mgx"
    write_artifact(path, tiny_contents())
    result = run("check", path)
    assert result.exit_code == 1 and "no golden set" in result.stderr


def test_damaged_artifacts_exit_2(artifact: Path, tmp_path: Path) -> None:
    data = bytearray(artifact.read_bytes())
    data[-5000] ^= 0xFF  # inside the data segment: only full verification sees it
    damaged = tmp_path / "damaged.mgx"
    damaged.write_bytes(bytes(data))
    result = run("check", damaged)
    assert result.exit_code == 2 and result.stderr.startswith("error: ") and "Traceback" not in result.output
    truncated = tmp_path / "truncated.mgx"
    truncated.write_bytes(bytes(data[:100]))
    result = run("generate", truncated, "-p", "hi")
    assert result.exit_code == 2 and result.stderr.startswith("error: ")


def test_streamed_text_is_the_decoded_output(artifact: Path) -> None:
    engine = Engine(artifact)
    for seed in range(20):  # random models emit arbitrary byte tokens: broken UTF-8 included
        *deltas, result = engine.generate("日本", max_tokens=12, temperature=1.0, seed=seed, stream=True)
        ids = result.token_ids[:-1] if result.finish_reason == "stop" else result.token_ids
        assert "".join(d.text for d in deltas) == result.text == engine.tokenizer.decode(ids)
    assert engine.blocks.num_used_blocks == 0


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"MGX_NUM_THREADS": "four"}, "error: MGX_NUM_THREADS='four' is not a thread count"),
        ({"MGX_CPU_ISA": "avx9000"}, "error: MGX_CPU_ISA='avx9000' is not a kernel path of this host"),
    ],
)
@pytest.mark.parametrize("backend", ["auto", "cpu"])
def test_a_bad_cpu_setting_is_one_error_line(artifact: Path, env: dict[str, str], message: str, backend: str) -> None:
    """The CPU kernels read these at import, so the process is a fresh one."""
    pytest.importorskip("mgx.kernels.cpu")
    cmd = [sys.executable, "-c", "from mgx.runtime.cli import main; main()", "generate", str(artifact), "-p", "hi",
           "-n", "2", "--backend", backend]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env}, timeout=120)
    assert result.returncode == 1
    assert result.stderr.startswith(message) and result.stderr.count("\n") == 1, result.stderr
