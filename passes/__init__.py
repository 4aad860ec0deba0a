"""Compiler passes: one per file, each an ``(ir.Graph, options, PassContext) -> PassResult`` rewrite
that checks its precondition, rewrites the graph in place and checks its postcondition.

``PASSES`` is the registry the pipeline looks names up in; model.yaml lists names from it, in order.
``dense_weight`` gives the float32 value of any weight as the runtime reads it, whatever its scheme
and layout (the compiler uses it to hand the effective weights back to the source model).
"""

from __future__ import annotations

from . import (
    autotune,
    cuda_kernels,
    fold_norm,
    fuse_gate_up,
    fuse_qkv,
    quantize_int4,
    quantize_w8a16,
    reorder_weights,
    sparsify_2_4,
)
from ._base import PassContext, PassError, PassFn, PassResult
from ._common import to_f32, to_storage
from ._schemes import dense_weight

__all__ = [
    "PassResult",
    "PassContext",
    "PassError",
    "PassFn",
    "PASSES",
    "get_pass",
    "dense_weight",
    "to_f32",
    "to_storage",
]

# name -> pass function, in the order a pipeline would usually run them.
PASSES: dict[str, PassFn] = {
    "fuse_qkv": fuse_qkv.run,
    "fuse_gate_up": fuse_gate_up.run,
    "fold_norm": fold_norm.run,
    "sparsify_2_4": sparsify_2_4.run,
    "quantize_w8a16": quantize_w8a16.run,
    "quantize_int4": quantize_int4.run,
    "reorder_weights": reorder_weights.run,
    "autotune": autotune.run,
    "cuda_kernels": cuda_kernels.run,
}


def get_pass(name: str) -> PassFn:
    """The pass called ``name``; a ``KeyError`` naming the known passes otherwise."""
    try:
        return PASSES[name]
    except KeyError:
        known = ", ".join(sorted(PASSES)) or "(none yet)"
        raise KeyError(f"unknown pass {name!r}; known passes: {known}") from None
