"""What an artifact holds besides the IR: the dataclasses ``mgx.formats.artifact`` re-exports."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

from . import ir

FORMAT_MAJOR: int = 1  # bumped by a change an older reader would misread
FORMAT_MINOR: int = 1  # bumped when a table grows a field; older readers skip it
FORMAT_VERSION = f"{FORMAT_MAJOR}.{FORMAT_MINOR}"


class ArtifactError(Exception):
    """An artifact cannot be written, read or trusted; the message is one line naming the file and problem."""


@dataclass(slots=True)
class GenerationDefaults:
    """Sampling defaults, used when a request does not say otherwise."""

    temperature: float = 0.0  # softmax temperature; 0 means greedy (argmax)
    top_p: float = 1.0  # nucleus sampling mass in (0, 1]; 1 disables it
    top_k: int = 0  # keep only the k most likely tokens; 0 disables it
    max_new_tokens: int = 256  # cap on generated tokens per request
    repetition_penalty: float = 1.0  # penalises tokens already seen, as Hugging Face does; 1 disables it
    stop_token_ids: list[int] = field(default_factory=list)  # extra ids that end generation, besides EOS

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be > 0, got {self.max_new_tokens}")
        if not self.repetition_penalty > 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")


@dataclass(slots=True)
class PassRecord:
    """One compiler pass that ran, in pipeline order."""

    name: str  # pass name as model.yaml spells it, e.g. "fuse_qkv"
    options: dict[str, Any]  # the pass's options (JSON-serialisable)
    summary: str  # one line on its effect, e.g. "fused 30 q/k/v triples"


@dataclass(slots=True)
class Fingerprint:
    """What the artifact was built from and for; equal fingerprints mean interchangeable artifacts."""

    source_hash: str  # hash of the source weights, as the frontend computed it
    tokenizer_hash: str  # hash of tokenizer.json
    dtype: str  # compute/storage dtype chosen at compile time, e.g. "bf16"
    quantization: str  # quantization summary, e.g. "none", "w8a16", "int4-g128"
    target: str  # target compiled for, e.g. "cpu", "cuda-sm90"
    format_version: str = FORMAT_VERSION  # "MAJOR.MINOR" of the format that wrote it

    def digest(self) -> str:
        """A 16-hex-digit id of the whole fingerprint (blake2b-64 of its fields as sorted JSON)."""
        canonical = json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.blake2b(canonical, digest_size=8).hexdigest()


@dataclass(slots=True)
class GoldenCase:
    """One reference generation the runtime must reproduce (``mgx-run check``)."""

    prompt: str  # the prompt text as given
    chat: bool  # True when the prompt went through the chat template
    prompt_ids: list[int]  # token ids fed to the model
    expected_ids: list[int]  # greedily generated token ids, one per step
    expected_top1_logits: list[float]  # the winning logit at each step

    def __post_init__(self) -> None:
        if len(self.expected_top1_logits) != len(self.expected_ids):
            raise ValueError(
                f"golden case {self.prompt[:30]!r}: {len(self.expected_ids)} expected ids but "
                f"{len(self.expected_top1_logits)} expected logits"
            )


@dataclass(slots=True)
class GoldenSet:
    """Reference outputs and how close the runtime's logits must come to them."""

    cases: list[GoldenCase]  # replayed in this order
    logit_atol: float  # absolute tolerance on expected_top1_logits


@dataclass(slots=True)
class AutotuneEntry:
    """One tuned kernel configuration."""

    kernel: str  # kernel entry point name
    shape_key: str  # the problem shape it was tuned for, e.g. "M=1,N=576,K=576"
    config: dict[str, Any]  # the winning configuration (block sizes, warps, ...), JSON-serialisable


def _default_producer() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"mgx {version('mgx')}"
    except PackageNotFoundError:  # running from a source tree that is not installed
        return "mgx"


@dataclass(slots=True)
class ArtifactContents:
    """Everything a .mgx file holds. Tensor data lives in ``graph.tensors[...].data``.

    Dataclass equality does not work once tensors hold numpy arrays; compare tensors with numpy.
    """

    graph: ir.Graph  # architecture, program, tensors (with data) and per-layer state
    tokenizer_json: str  # tokenizer.json (Hugging Face tokenizers format)
    fingerprint: Fingerprint  # compatibility fingerprint
    chat_template: str | None = None  # Jinja chat template; None when the model has none
    generation: GenerationDefaults = field(default_factory=GenerationDefaults)  # sampling defaults
    passes: list[PassRecord] = field(default_factory=list)  # pass log, in the order the passes ran
    golden: GoldenSet | None = None  # reference outputs; None when none were recorded
    metadata: dict[str, str] = field(default_factory=dict)  # free-form key/values (license, source, ...)
    autotune: dict[str, list[AutotuneEntry]] = field(default_factory=dict)  # GPU arch ("sm_90") -> configs
    cuda_kernels: dict[str, bytes] = field(default_factory=dict)  # GPU arch ("sm_90a") -> cubin
    producer: str = field(default_factory=_default_producer)  # what wrote the file, e.g. "mgx 0.1.0"
