"""Calibration statistics for the passes that need activations (GPTQ, SparseGPT).

A pass's options may name a calibration text (model.yaml)::

    - quantize_int4: {method: gptq, calibration: {text_file: calibration.txt, tokens: 512}}

The pipeline then hands the source model the weights the graph holds at that point
(``write_back``), runs the text through it in fp32, and collects for every activation value that
feeds a linear or lm_head op the mean of x x^T over the tokens, via forward pre-hooks on the source
modules the ops came from. The pass receives them in ``PassContext.hessians``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mgx.formats import ir

__all__ = ["CalibrationError", "CalibrationSpec", "parse_calibration", "collect_hessians"]

_KEYS = ("text_file", "tokens", "seq_len")


class CalibrationError(ValueError):
    """A bad calibration option or text; the message names the option."""


@dataclass(frozen=True, slots=True)
class CalibrationSpec:
    """The calibration text of one pass."""

    text_file: Path  # UTF-8 text, resolved against the model.yaml folder
    tokens: int = 512  # tokens used from the start of the text (fewer if the text is shorter)
    seq_len: int = 512  # the tokens are run as independent sequences of at most this many

    def __post_init__(self) -> None:
        if self.tokens < 1 or self.seq_len < 1:
            raise CalibrationError("calibration.tokens and calibration.seq_len must be >= 1")

    def record(self) -> dict[str, Any]:
        """What the artifact's pass record says about it (the text by name and hash)."""
        digest = hashlib.sha256(self.text_file.read_bytes()).hexdigest()
        return {"text_file": self.text_file.name, "sha256": digest, "tokens": self.tokens, "seq_len": self.seq_len}


def parse_calibration(raw: Any, base: Path, where: str) -> CalibrationSpec:
    """Validate a ``calibration`` mapping of pass options."""
    if not isinstance(raw, dict):
        raise CalibrationError(f"{where}: expected a mapping with keys {', '.join(_KEYS)}")
    unknown = [k for k in raw if k not in _KEYS]
    if unknown:
        raise CalibrationError(f"{where}: unknown key {unknown[0]!r}; allowed: {', '.join(_KEYS)}")
    if not isinstance(raw.get("text_file"), str):
        raise CalibrationError(f"{where}.text_file: expected a file path")
    path = (base / raw["text_file"]).resolve()
    if not path.is_file():
        raise CalibrationError(f"{where}.text_file: no such file {path}")
    for key in ("tokens", "seq_len"):
        if key in raw and (not isinstance(raw[key], int) or isinstance(raw[key], bool)):
            raise CalibrationError(f"{where}.{key}: expected an integer, got {raw[key]!r}")
    return CalibrationSpec(path, **{k: raw[k] for k in ("tokens", "seq_len") if k in raw})


def collect_hessians(graph: ir.Graph, model: Any, tokenizer: Any, spec: CalibrationSpec,
                     ) -> tuple[dict[str, np.ndarray], int]:
    """Mean x x^T [K, K] (float64) of every value read by a linear or lm_head op, and the token count.

    ``model`` must already hold the graph's weights (``write_back``), so that the inputs of its
    modules are the graph's values.
    """
    import torch

    ids = list(tokenizer(spec.text_file.read_text(encoding="utf-8"), add_special_tokens=False).input_ids)
    ids = ids[: spec.tokens]
    if not ids:
        raise CalibrationError(f"calibration text {spec.text_file} has no tokens")
    modules = {name.removeprefix("model."): m for name, m in model.named_modules()}
    sums: dict[str, torch.Tensor] = {}
    hooks = []

    def hook_for(value: str):  # noqa: ANN202 - a torch hook
        def hook(module: Any, args: tuple[Any, ...]) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1]).to(torch.float32)  # [tokens, K]
            # One sequence's products in float32 (as fast as the forward), summed across them in float64.
            sums[value] += (x.T @ x).to(torch.float64)

        return hook

    for op in graph.ops:
        value = op.inputs[0] if op.inputs else ""
        if op.kind not in ("linear", "lm_head") or value in sums:
            continue
        source = (op.attrs.get("fused_sources") or [op.source])[0]
        if source not in modules:
            raise CalibrationError(f"{op.kind} from {op.source}: no module {source!r} in the source model")
        k = int(op.attrs["in_features"])
        sums[value] = torch.zeros(k, k, dtype=torch.float64)
        hooks.append(modules[source].register_forward_pre_hook(hook_for(value)))
    try:
        with torch.no_grad():
            for start in range(0, len(ids), spec.seq_len):
                model(input_ids=torch.tensor([ids[start:start + spec.seq_len]]), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return {value: (s / len(ids)).numpy() for value, s in sums.items()}, len(ids)
