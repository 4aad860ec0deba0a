"""quantize_w8a16: int8 weights with one fp32 scale per output channel; activations stay float.

``W[n, k] = q[n, k] * scales[n]`` with ``scales[n] = max_k |W[n, k]| / 127`` (symmetric,
round to nearest). Applies to the weights of linear, lm_head and embedding ops (an embedding
table's rows are its channels), unless skipped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mgx.formats import ir

from ._base import PassContext, PassError, PassResult
from ._common import Skip, count_reasons, options_dict, parse_options, weight_sites
from ._schemes import describe_rewrite, encode_w8a16, rewrite_sites

__all__ = ["W8A16Options", "run"]


@dataclass(frozen=True, slots=True)
class W8A16Options:
    """model.yaml options of quantize_w8a16."""

    skip: Skip = field(default_factory=Skip)  # weights to keep in the storage dtype


def run(graph: ir.Graph, options: dict[str, Any], context: PassContext) -> PassResult:
    """Quantize every selected dense weight to w8a16; see the module docstring."""
    opts = parse_options(W8A16Options, options, "quantize_w8a16")
    sites, skipped = weight_sites(graph, opts.skip)
    todo = []
    for site in sites:
        t = graph.tensor(site.name)
        if t.layout != "row_major":
            raise PassError(f"quantize_w8a16: {t.name} has layout {t.layout!r}; run reorder_weights last")
        if t.scheme == "none":
            todo.append(site)
        else:
            skipped[site.name] = f"already {t.scheme}"
    stats = rewrite_sites(graph, todo, lambda site, dense: encode_w8a16(dense))
    note = f"; kept {len(skipped)} ({count_reasons(skipped)})" if skipped else ""
    return PassResult(describe_rewrite(stats, len(todo), "w8a16-quantized") + note,
                      {**stats, "quantized": len(todo), "skipped": skipped}, options_dict(opts))
