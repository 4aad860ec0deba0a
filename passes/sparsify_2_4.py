"""sparsify_2_4: keep 2 of every 4 weights along K, stored compactly (scheme ``sparse24``).

``method: magnitude`` keeps the two largest magnitudes of each group of four. ``method: sparsegpt``
(needs a calibration text, like GPTQ) picks the two by saliency w^2 / [H^-1]_kk^2 while walking the
columns and updates the weights not yet visited to make up for what was pruned. The kept values
stay in the weight's float dtype; ``meta`` holds their 2-bit positions. Run ``quantize_int4``
afterwards for ``sparse24_int4``. By default embedding tables and the LM head stay dense.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from mgx.formats import ir

from ._base import PassContext, PassError, PassResult
from ._common import LINEAR_KINDS, Skip, WeightSite, count_reasons, options_dict, parse_options, weight_sites
from ._gptq import obs_solve
from ._schemes import (
    Encoded,
    decode,
    describe_rewrite,
    encode_sparse24,
    rewrite_sites,
    site_arrays,
    sparse24_mask,
)

__all__ = ["Sparse24Options", "run"]


@dataclass(frozen=True, slots=True)
class Sparse24Options:
    """model.yaml options of sparsify_2_4."""

    method: Literal["magnitude", "sparsegpt"] = "magnitude"  # how the kept pair is chosen
    damp: float = 0.01  # sparsegpt: added to the Hessian's diagonal, as a fraction of its mean
    skip: Skip = field(default_factory=lambda: Skip(embedding=True, lm_head=True))  # weights to keep dense

    def __post_init__(self) -> None:
        if not 0 < self.damp < 1:
            raise PassError(f"sparsify_2_4.damp: must be in (0, 1), got {self.damp}")


def run(graph: ir.Graph, options: dict[str, Any], context: PassContext) -> PassResult:
    """2:4-sparsify every selected dense weight; see the module docstring."""
    opts = parse_options(Sparse24Options, options, "sparsify_2_4")
    calibrated = opts.method == "sparsegpt"
    if calibrated and context.hessians is None:
        raise PassError("sparsify_2_4: method sparsegpt needs calibration statistics; add "
                        "`calibration: {text_file: ..., tokens: 512}` to its options")
    if not calibrated and context.hessians is not None:
        raise PassError("sparsify_2_4: a calibration text is only used by method: sparsegpt")
    sites, skipped = weight_sites(graph, opts.skip, LINEAR_KINDS)
    todo = []
    for site in sites:
        t = graph.tensor(site.name)
        if t.scheme != "none" or t.layout != "row_major":
            raise PassError(f"sparsify_2_4: {t.name} is {t.scheme}/{t.layout}; run sparsify_2_4 on dense "
                            "weights, before quantize_int4 and reorder_weights")
        if t.shape[1] % 4:
            skipped[site.name] = "K not a multiple of 4"
        else:
            todo.append(site)
    masks: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # site -> (updated values, keep mask)
    if calibrated:
        groups: dict[str, list[WeightSite]] = {}
        for site in todo:
            groups.setdefault(site.stats_key, []).append(site)
        for key, members in groups.items():
            if key not in context.hessians:
                raise PassError(f"sparsify_2_4: no calibration statistics for value {key!r}")
            dense = [decode(*site_arrays(graph, s)) for s in members]
            out, keep, _ = obs_solve(np.concatenate(dense), context.hessians[key], prune_2_4=True, damp=opts.damp)
            row = 0
            for site, d in zip(members, dense):
                masks[site.name] = out[row:row + len(d)], keep[row:row + len(d)]
                row += len(d)

    def encode(site: WeightSite, dense: np.ndarray) -> Encoded:
        values, keep = masks.pop(site.name, None) or (dense, sparse24_mask(dense))
        return encode_sparse24(values, keep, graph.tensor(site.name).dtype)

    stats = rewrite_sites(graph, todo, encode)
    note = f"; kept {len(skipped)} dense ({count_reasons(skipped)})" if skipped else ""
    return PassResult(describe_rewrite(stats, len(todo), f"2:4-sparsified ({opts.method})") + note,
                      {**stats, "sparsified": len(todo), "skipped": skipped}, options_dict(opts))
