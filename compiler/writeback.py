"""Hand the weights an artifact stores back to the source model, so that golden outputs and
calibration statistics come from Hugging Face transformers running exactly those weights.

Each IR op that holds weights names the module it came from (``op.source``, the module path without
the leading ``model.``); a fused linear also lists its parts (``fused_sources``) and their widths
(``fused_sizes``). Weights are decoded to float32 whatever their scheme and layout
(``mgx.passes.dense_weight``), so quantized, folded, pruned or fused weights all come back as the
dense values the runtime multiplies by. A norm whose weight was folded away gets a weight of ones.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mgx.formats import ir
from mgx.passes import dense_weight

__all__ = ["WriteBackError", "write_back"]


class WriteBackError(ValueError):
    """An IR weight has no place in the source model; the message names the op and the module."""


def _modules(model: Any) -> dict[str, Any]:
    """Module path as the IR names it -> module."""
    return {name.removeprefix("model."): m for name, m in model.named_modules()}


def _set(module: Any, name: str, values: np.ndarray | None, where: str) -> int:
    """Copy ``values`` into ``module.<name>``; returns the number of values written."""
    import torch

    param = getattr(module, name, None)
    if param is None:
        if values is None or not np.any(values):
            return 0  # the model has no bias and the IR's is all zeros (a fused part without one)
        raise WriteBackError(f"{where}: the source module has no {name!r} to hold it")
    if values is None:
        return 0
    if tuple(param.shape) != values.shape:
        raise WriteBackError(f"{where}: {name} is {tuple(param.shape)} in the source model, {values.shape} in the IR")
    with torch.no_grad():
        param.copy_(torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)))
    return int(values.size)


def write_back(graph: ir.Graph, model: Any) -> int:
    """Set the parameters of ``model`` (a transformers model) to the effective weights of ``graph``.

    Returns the number of values written.
    """
    modules = _modules(model)
    written = 0
    decoded: dict[str, np.ndarray] = {}  # a tied table is read by two ops: decode it once

    def weight(op: ir.Op) -> np.ndarray:
        name = op.weights["weight"]
        if name not in decoded:
            decoded[name] = dense_weight(graph, op, "weight")
        return decoded[name]

    for op in graph.ops:
        if op.kind not in ("embedding", "rms_norm", "linear", "lm_head"):
            continue
        sources = op.attrs.get("fused_sources") or [op.source]
        sizes = op.attrs.get("fused_sizes") or [None]
        missing = [s for s in sources if s not in modules]
        if missing:
            raise WriteBackError(f"{op.kind} from {op.source}: no module {missing[0]!r} in the source model")
        if op.kind == "rms_norm":
            gamma = dense_weight(graph, op, "weight")
            if gamma is None:  # folded away (or never there): the norm multiplies by one
                gamma = np.ones(int(op.attrs["group"]), np.float32)
            written += _set(modules[op.source], "weight", gamma, f"rms_norm from {op.source}")
            continue
        w, bias = weight(op), dense_weight(graph, op, "bias")
        bounds = np.cumsum([0, *sizes]) if sizes[0] is not None else np.array([0, w.shape[0]])
        for source, lo, hi in zip(sources, bounds[:-1], bounds[1:]):
            where = f"{op.kind} from {source}"
            written += _set(modules[source], "weight", w[lo:hi], where)
            if op.kind != "embedding":
                written += _set(modules[source], "bias", None if bias is None else bias[lo:hi], where)
    return written
