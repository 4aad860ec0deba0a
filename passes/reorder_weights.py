"""reorder_weights: rewrite each weight into the layout the target's kernels read fastest.

The layout comes from ``mgx.formats.layouts.layout_for(target, scheme)``; its ``pack`` rewrites
the weight and its companions, and every tensor of the op is tagged with the layout, which is how
backends know how to read them (they ``unpack`` or read the layout directly). Weights with no
faster layout for the target stay ``row_major``. Run it last: the other weight passes refuse
weights that are no longer row-major.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mgx.formats import ir, layouts

from ._base import PassContext, PassError, PassResult
from ._common import Skip, count_reasons, options_dict, parse_options, weight_sites
from ._schemes import COMPANION_ROLES

__all__ = ["ReorderOptions", "run"]

# numpy dtype -> IR dtype for packed arrays whose element type differs from the tensor's (uint16 is bf16's).
_DTYPES = {ir.numpy_dtype(d): d for d in ir.DType if d != ir.DType.BF16}


@dataclass(frozen=True, slots=True)
class ReorderOptions:
    """model.yaml options of reorder_weights."""

    # Weights to keep row-major; embedding tables by default, since embedding reads rows by token id.
    skip: Skip = field(default_factory=lambda: Skip(embedding=True))


def _retag(t: ir.Tensor, array: np.ndarray, layout: str) -> ir.Tensor:
    dtype = t.dtype if array.dtype == ir.numpy_dtype(t.dtype) else _DTYPES[array.dtype]
    return ir.Tensor(t.name, dtype, array.shape, np.ascontiguousarray(array), t.scheme, t.scheme_params, layout)


def run(graph: ir.Graph, options: dict[str, Any], context: PassContext) -> PassResult:
    """Pack every selected weight into ``layout_for(context.target, scheme)``; see the module docstring."""
    opts = parse_options(ReorderOptions, options, "reorder_weights")
    sites, skipped = weight_sites(graph, opts.skip)
    moved: dict[str, int] = {}
    stay = 0
    for site in sites:
        op = site.ops[0]
        t = graph.tensor(site.name)
        if t.layout != "row_major":
            skipped[site.name] = f"already {t.layout}"
            continue
        name = layouts.layout_for(context.target, t.scheme)
        if name == "row_major":
            stay += 1
            continue
        roles = {"weight": site.name, **{r: op.weights[r] for r in COMPANION_ROLES if r in op.weights}}
        arrays = {role: graph.tensor(n).data for role, n in roles.items()}
        try:
            packed = layouts.pack(name, arrays, t.scheme, t.scheme_params)
        except ValueError as e:  # a shape the layout cannot hold (say, K not a multiple of 8)
            skipped[site.name] = f"{name} cannot hold its shape ({e})"
            continue
        # Postcondition: the layout gives back exactly what it was given.
        back = layouts.unpack(name, packed, t.scheme, t.scheme_params)
        if set(back) != set(arrays) or any(not np.array_equal(back[r], arrays[r]) for r in arrays):
            raise PassError(f"reorder_weights: layout {name!r} does not unpack {site.name} to what it packed")
        for role, tname in roles.items():
            graph.tensors[tname] = _retag(graph.tensor(tname), packed[role], name)
        moved[name] = moved.get(name, 0) + 1
    done = ", ".join(f"{n} to {layout}" for layout, n in sorted(moved.items())) or "none moved"
    note = f"; kept {len(skipped)} ({count_reasons(skipped)})" if skipped else ""
    return PassResult(f"target {context.target}: {done}; {stay} stay row_major (no faster layout){note}",
                      {"moved": moved, "skipped": skipped}, options_dict(opts))
