"""fuse_qkv: the q, k and v projections of each attention become one linear, split after the matmul.

Found by structure, not by name: an attention op's v input, and the inputs of the rope op that
feeds its q and k (each possibly through a q/k RMSNorm), must come from linear ops that read the
same value. The fused weight is [Wq; Wk; Wv] (biases likewise) and a ``split`` op gives back the
original q, k and v values, so everything downstream is untouched.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mgx.formats import ir

from ._base import PassContext, PassError, PassResult
from ._common import (
    Skip,
    count_reasons,
    fuse_linears,
    fusion_skip_reason,
    options_dict,
    parse_options,
    producers,
    shared_tensors,
)

__all__ = ["FuseQKVOptions", "run"]


@dataclass(frozen=True, slots=True)
class FuseQKVOptions:
    """model.yaml options of fuse_qkv."""

    skip: Skip = field(default_factory=Skip)  # attention blocks to leave unfused (layers, names)


def _qkv(graph: ir.Graph, attention: ir.Op, made_by: dict[str, ir.Op]) -> list[ir.Op] | None:
    """The q, k, v linear ops feeding ``attention``, or None when the pattern does not hold."""
    rope = made_by.get(attention.inputs[0])
    if rope is None or rope.kind != "rope" or rope.outputs != attention.inputs[:2]:
        return None
    parts = []
    for value, normed in ((rope.inputs[0], True), (rope.inputs[1], True), (attention.inputs[2], False)):
        op = made_by.get(value)
        if normed and op is not None and op.kind == "rms_norm":
            op = made_by.get(op.inputs[0])  # the q/k norm of Qwen3
        if op is None or op.kind != "linear" or "fused_sources" in op.attrs:
            return None
        parts.append(op)
    if len({op.inputs[0] for op in parts}) != 1 or len({id(op) for op in parts}) != 3:
        return None
    return parts


def run(graph: ir.Graph, options: dict[str, Any], context: PassContext) -> PassResult:
    """Fuse every attention's q/k/v projections; see the module docstring."""
    opts = parse_options(FuseQKVOptions, options, "fuse_qkv")
    made_by = producers(graph)
    shared = shared_tensors(graph)
    groups, skipped = [], {}
    for op in graph.ops:
        if op.kind != "attention":
            continue
        parts = _qkv(graph, op, made_by)
        if parts is None:
            continue
        reason = fusion_skip_reason(graph, parts, opts.skip, shared, f"attention {op.source}: q/k/v", "fuse_qkv")
        if reason:
            skipped[op.source] = reason
        else:
            groups.append(parts)
    before = len(graph.ops)
    for parts in groups:
        fused, index = fuse_linears(graph, parts, "qkv_proj")
        x = fused.outputs[0]
        sizes = fused.attrs["fused_sizes"]
        graph.ops.insert(index + 1, ir.Op("split", [x], [p.outputs[0] for p in parts], {}, {"sizes": sizes},
                                          fused.source))
    # Postcondition: three linears became one linear and one split per fused attention.
    if len(graph.ops) != before - len(groups):
        raise PassError(f"fuse_qkv: expected {before - len(groups)} ops after fusing, got {len(graph.ops)}")
    note = f"; left {len(skipped)} ({count_reasons(skipped)})" if skipped else ""
    return PassResult(f"fused {len(groups)} q/k/v triples into one linear + split each{note}",
                      {"fused": len(groups), "skipped": skipped}, options_dict(opts))
