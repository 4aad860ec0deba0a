"""Load a model source (Hugging Face directory, GGUF file) into a transformers model and tokenizer.

Nothing here touches the network: the hub libraries are switched to offline mode before import.
"""

from __future__ import annotations

import hashlib
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .spec import SourceSpec

for _var, _value in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("HF_HUB_DISABLE_TELEMETRY", "1"),
                     ("HF_DATASETS_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false")):
    os.environ.setdefault(_var, _value)

__all__ = ["SourceError", "LoadedSource", "load_source", "hash_files"]


class SourceError(Exception):
    """The source cannot be loaded; the message says which file and why."""


@dataclass(slots=True)
class LoadedSource:
    """A source model ready to trace."""

    model: Any  # transformers PreTrainedModel, fp32, eval mode
    tokenizer: Any  # transformers fast tokenizer
    tokenizer_json: str  # the tokenizers-library JSON the runtime loads
    chat_template: str | None
    source_hash: str  # sha256 over the weight files
    model_type: str


def hash_files(paths: list[Path]) -> str:
    """sha256 over the files' bytes, in the given order (names excluded, so a copy hashes the same)."""
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as fh:
            while chunk := fh.read(1 << 22):
                digest.update(chunk)
    return digest.hexdigest()


def _weight_files(source: SourceSpec) -> list[Path]:
    if source.kind != "hf_dir":
        return [source.path]
    files = sorted(source.path.glob("*.safetensors")) or sorted(source.path.glob("*.bin"))
    if not files:
        raise SourceError(f"{source.path}: no *.safetensors (or *.bin) weight files")
    return files


def _check_kernels_package() -> None:
    """transformers 5 imports the Hugging Face ``kernels`` package where it is installed. Started with
    this project's folder on its path (``python -c`` or ``python -m`` run from the repository root,
    which is the ``mgx`` package's own folder), Python finds the project's ``kernels/`` under that
    name instead and the model's import fails deep inside transformers: say so before."""
    import importlib.metadata
    import importlib.util

    try:
        importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        return  # transformers does not import it
    spec = importlib.util.find_spec("kernels")  # an imported module's own spec, else the path's
    origin = spec.origin if spec is not None else None
    ours = Path(__file__).resolve().parents[1]
    if origin and ours in Path(origin).resolve().parents:
        raise SourceError(f"the 'kernels' package that transformers imports resolves to this project's own folder "
                          f"({Path(origin).parent}): Python was started with {ours} on its path (python -c or -m "
                          "run there put it first); run from another folder, or use the installed mgxc command")


def load_source(source: SourceSpec) -> LoadedSource:
    """Load weights, config and tokenizer for ``source`` in fp32 on the CPU."""
    _check_kernels_package()
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    transformers.logging.set_verbosity_error()
    if source.kind == "hf_dir":
        folder, kwargs = str(source.path), {}
    else:
        folder, kwargs = str(source.path.parent), {"gguf_file": source.path.name}
    try:
        config = AutoConfig.from_pretrained(folder, **kwargs)
    except (ValueError, KeyError, OSError, struct.error) as exc:
        _check_gguf(source)
        raise SourceError(f"{source.description}: cannot read the model config: {_first_line(exc)}") from None
    from .lower import SUPPORTED_MODEL_TYPES

    model_type = str(getattr(config, "model_type", "?"))
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise SourceError(
            f"{source.description}: model type {model_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    config._attn_implementation = "sdpa"
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, config=config, dtype=torch.float32, **kwargs)
    except (ValueError, KeyError, OSError, RuntimeError, struct.error) as exc:
        _check_gguf(source)
        raise SourceError(f"{source.description}: cannot load the weights: {_first_line(exc)}") from None
    model.eval()
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
    except (ValueError, KeyError, OSError, struct.error) as exc:
        _check_gguf(source)
        raise SourceError(f"{source.description}: cannot load the tokenizer: {_first_line(exc)}") from None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise SourceError(f"{source.description}: the tokenizer has no fast (tokenizers) form to store")
    return LoadedSource(
        model=model,
        tokenizer=tokenizer,
        tokenizer_json=backend.to_str(),
        chat_template=getattr(tokenizer, "chat_template", None) or None,
        source_hash=hash_files(_weight_files(source)),
        model_type=model_type,
    )


def _check_gguf(source: SourceSpec) -> None:
    """After transformers failed to read a GGUF source: its header and tensor table read whole (the
    gguf package maps the file and views every tensor; 2.3 s for SmolLM2's, hence only then), so that
    a foreign or cut-short file says so instead of the error from inside transformers' reader."""
    if source.kind == "hf_dir":
        return
    from gguf import GGUFReader

    try:
        GGUFReader(source.path)
    except (ValueError, KeyError, IndexError, struct.error, OSError) as exc:
        size = source.path.stat().st_size
        raise SourceError(
            f"{source.description}: not a readable GGUF file ({_first_line(exc)}); "
            f"it holds {size:,} bytes: a copy cut short fails this way"
        ) from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
