"""fold_norm: an RMSNorm's weight g moves into the linear ops it feeds, leaving a weightless norm.

``linear(rms_norm(x) * g) == linear'(rms_norm(x))`` with ``W'[:, k] = W[:, k] * g[k]``: exact up to
the rounding of the products to the storage dtype. A norm is folded only when every reader of its
output is a linear or lm_head with a dense, unshared weight (a tied LM head also serves as the
embedding table; the q/k norms of Qwen3 feed rope), and none of those readers is skipped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mgx.formats import ir

from ._base import PassContext, PassError, PassResult
from ._common import (
    LINEAR_KINDS,
    Skip,
    consumers,
    count_reasons,
    float_tensor,
    options_dict,
    parse_options,
    shared_tensors,
    to_f32,
)

__all__ = ["FoldNormOptions", "run"]


@dataclass(frozen=True, slots=True)
class FoldNormOptions:
    """model.yaml options of fold_norm."""

    skip: Skip = field(default_factory=Skip)  # linears not to fold into (a norm feeding one stays as is)


def _why_not(graph: ir.Graph, norm: ir.Op, readers: list[ir.Op], shared: set[str], skip: Skip) -> str | None:
    """Why ``norm`` cannot be folded into ``readers`` (None when it can)."""
    if not readers:
        return "unused"
    if any(op.kind not in LINEAR_KINDS for op in readers):
        return "feeds " + ", ".join(sorted({op.kind for op in readers if op.kind not in LINEAR_KINDS}))
    if norm.weights["weight"] in shared:
        return "shared norm weight"
    if any(int(op.attrs["in_features"]) != int(norm.attrs["group"]) for op in readers):
        return "grouped norm"
    for op in readers:
        w = graph.tensor(op.weights["weight"])
        if w.scheme != "none" or w.layout != "row_major":
            raise PassError(f"{op.kind} from {op.source}: weight {w.name} is {w.scheme}/{w.layout}; run "
                            "fold_norm before quantization and reordering")
        if w.name in shared:
            return "tied weight"
        reason = skip.reason(op, graph.arch.num_layers)
        if reason:
            return reason
    return None


def run(graph: ir.Graph, options: dict[str, Any], context: PassContext) -> PassResult:
    """Fold every foldable RMSNorm weight into its readers; see the module docstring."""
    opts = parse_options(FoldNormOptions, options, "fold_norm")
    readers_of = consumers(graph)
    shared = shared_tensors(graph)
    folded, kept, touched = 0, {}, []
    for norm in graph.ops:
        if norm.kind != "rms_norm" or "weight" not in norm.weights:
            continue
        readers = readers_of.get(norm.outputs[0], [])
        why = _why_not(graph, norm, readers, shared, opts.skip)
        if why:
            kept[norm.source] = why
            continue
        g = to_f32(graph.tensor(norm.weights["weight"]))  # [K]
        for op in readers:
            w = graph.tensor(op.weights["weight"])
            graph.tensors[w.name] = float_tensor(w.name, to_f32(w) * g[None, :], w.dtype)
            touched.append(w.name)
        del graph.tensors[norm.weights.pop("weight")]
        folded += 1
    # Postcondition: the rewritten weights are still finite.
    for name in touched:
        if not np.all(np.isfinite(to_f32(graph.tensors[name]))):
            raise PassError(f"fold_norm: {name} has non-finite values after folding")
    note = f"; kept {len(kept)} ({count_reasons(kept)})" if kept else ""
    return PassResult(f"folded {folded} norms into {len(touched)} linears{note}",
                      {"folded": folded, "linears": len(touched), "kept": kept}, options_dict(opts))
