"""fuse_gate_up: the MLP's gate and up projections become one linear feeding ``silu_mul`` directly.

Found by structure: a two-input ``silu_mul`` whose gate and up values come from linear ops reading
the same value and used nowhere else. The fused weight is [Wgate; Wup]; ``silu_mul`` then takes the
one fused value, whose first half is the gate and second half the up projection.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mgx.formats import ir

from ._base import PassContext, PassError, PassResult
from ._common import (
    Skip,
    consumers,
    count_reasons,
    fuse_linears,
    fusion_skip_reason,
    options_dict,
    parse_options,
    producers,
    shared_tensors,
)

__all__ = ["FuseGateUpOptions", "run"]


@dataclass(frozen=True, slots=True)
class FuseGateUpOptions:
    """model.yaml options of fuse_gate_up."""

    skip: Skip = field(default_factory=Skip)  # MLPs to leave unfused (layers, names)


def _gate_up(act: ir.Op, made_by: dict[str, ir.Op], readers: dict[str, list[ir.Op]]) -> list[ir.Op] | None:
    """The gate and up linear ops of a two-input ``silu_mul``, or None when the pattern does not hold."""
    if len(act.inputs) != 2 or act.inputs[0] == act.inputs[1]:
        return None
    parts = [made_by.get(v) for v in act.inputs]
    if any(p is None or p.kind != "linear" or "fused_sources" in p.attrs for p in parts):
        return None
    if parts[0].inputs != parts[1].inputs or any(readers[v] != [act] for v in act.inputs):
        return None
    if parts[0].attrs["out_features"] != parts[1].attrs["out_features"]:
        return None
    return parts


def run(graph: ir.Graph, options: dict[str, Any], context: PassContext) -> PassResult:
    """Fuse every MLP's gate/up projections; see the module docstring."""
    opts = parse_options(FuseGateUpOptions, options, "fuse_gate_up")
    made_by, readers = producers(graph), consumers(graph)
    shared = shared_tensors(graph)
    groups, skipped = [], {}
    for op in graph.ops:
        if op.kind != "silu_mul":
            continue
        parts = _gate_up(op, made_by, readers)
        if parts is None:
            continue
        reason = fusion_skip_reason(graph, parts, opts.skip, shared, f"MLP {op.source}: gate/up", "fuse_gate_up")
        if reason:
            skipped[op.source] = reason
        else:
            groups.append((op, parts))
    before = len(graph.ops)
    for act, parts in groups:
        fused, _ = fuse_linears(graph, parts, "gate_up_proj")
        act.inputs = [fused.outputs[0]]
    if len(graph.ops) != before - len(groups):
        raise PassError(f"fuse_gate_up: expected {before - len(groups)} ops after fusing, got {len(graph.ops)}")
    note = f"; left {len(skipped)} ({count_reasons(skipped)})" if skipped else ""
    return PassResult(f"fused {len(groups)} gate/up pairs into one linear each{note}",
                      {"fused": len(groups), "skipped": skipped}, options_dict(opts))
