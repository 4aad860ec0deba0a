"""quantize_int4: 4-bit weights in groups along K, two per byte, round-to-nearest or GPTQ.

Per group of ``group_size`` input columns: a scale and (asymmetric) a zero point, ``W = (q - z) * s``
with ``q`` in 0..15 (formats/README.md, scheme ``int4``). A weight that ``sparsify_2_4`` left as
``sparse24`` becomes ``sparse24_int4``: its kept values are quantized, grouped along the kept values.

``method: gptq`` rounds column by column and spreads each column's error over the columns not yet
rounded, weighted by the inverse Hessian of the layer's inputs on a calibration text (model.yaml:
``calibration: {text_file: ..., tokens: 512}``; the pipeline computes the statistics). Weights
whose input has no statistics (an untied embedding table) are rounded to nearest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from mgx.formats import ir

from ._base import PassContext, PassError, PassResult
from ._common import Skip, WeightSite, count_reasons, options_dict, parse_options, to_f32, weight_sites
from ._gptq import obs_solve
from ._schemes import (
    Encoded,
    decode,
    describe_rewrite,
    encode_int4,
    encode_sparse24_int4,
    int4_column_quantizer,
    rewrite_sites,
    site_arrays,
    sparse24_expand,
)

__all__ = ["Int4Options", "run"]


@dataclass(frozen=True, slots=True)
class Int4Options:
    """model.yaml options of quantize_int4."""

    group_size: Literal[32, 64, 128] = 128  # input columns (kept values, for sparse24) per scale
    symmetric: bool = False  # True: zero point fixed at 8 and no zeros tensor
    method: Literal["rtn", "gptq"] = "rtn"  # round to nearest, or GPTQ (needs a calibration text)
    damp: float = 0.01  # gptq: added to the Hessian's diagonal, as a fraction of its mean
    act_order: bool = True  # gptq: visit columns by decreasing input energy (dense weights only)
    # scales raised to fp16 values where fp16 holds them as normal numbers (_schemes.f16_scales): the GPU's
    # int4 imma kernels then read scales and zeros as fp16 pairs, 4 bytes a row and group instead of 5
    f16_scales: bool = True
    skip: Skip = field(default_factory=Skip)  # weights to keep as they are

    def __post_init__(self) -> None:
        if not 0 < self.damp < 1:
            raise PassError(f"quantize_int4.damp: must be in (0, 1), got {self.damp}")


def _rtn(graph: ir.Graph, site: WeightSite, dense: np.ndarray, opts: Int4Options) -> Encoded:
    t, companions = site_arrays(graph, site)
    g, sym, f16 = opts.group_size, opts.symmetric, opts.f16_scales
    if t.scheme == "sparse24":
        return encode_sparse24_int4(to_f32(t), companions["meta"].data, int(t.scheme_params["cols"]), g, sym, f16=f16)
    return encode_int4(dense, g, sym, f16=f16)


def _gptq(graph: ir.Graph, sites: list[WeightSite], hessian: np.ndarray, opts: Int4Options) -> list[Encoded]:
    """GPTQ of sites that read the same input and share a scheme, solved as one stacked matrix."""
    g, sym = opts.group_size, opts.symmetric
    sparse = graph.tensor(sites[0].name).scheme == "sparse24"
    dense = [decode(*site_arrays(graph, s)) for s in sites]
    w = np.concatenate(dense)
    keep = None
    if sparse:  # the kept positions, from meta (a kept value may be an exact zero)
        k = w.shape[1]
        metas = [site_arrays(graph, s)[1]["meta"].data for s in sites]
        keep = np.concatenate([sparse24_expand(np.ones((m.shape[0], k // 2), np.float32), m, k) != 0
                               for m in metas])
    quantizer = int4_column_quantizer(2 * g if sparse else g, sym, opts.f16_scales)
    out, _, params = obs_solve(w, hessian, quantizer=quantizer, keep=keep, damp=opts.damp,
                               act_order=opts.act_order and not sparse)
    scales = np.stack([p[0] for p in params], axis=1).astype(np.float32)
    zeros = None if sym else np.stack([p[1] for p in params], axis=1).astype(np.uint8)
    encoded, row = [], 0
    for s, d in zip(sites, dense):
        rows = slice(row, row + d.shape[0])
        row += d.shape[0]
        z = None if zeros is None else zeros[rows]
        if sparse:
            k = d.shape[1]
            values = out[rows][keep[rows]].reshape(d.shape[0], k // 2)
            meta = site_arrays(graph, s)[1]["meta"].data
            encoded.append(encode_sparse24_int4(values, meta, k, g, sym, scales[rows], z))
        else:
            encoded.append(encode_int4(out[rows], g, sym, scales[rows], z))
    return encoded


def run(graph: ir.Graph, options: dict[str, Any], context: PassContext) -> PassResult:
    """Quantize every selected dense or sparse24 weight to int4; see the module docstring."""
    opts = parse_options(Int4Options, options, "quantize_int4")
    if opts.method == "gptq" and context.hessians is None:
        raise PassError("quantize_int4: method gptq needs calibration statistics; add "
                        "`calibration: {text_file: ..., tokens: 512}` to its options")
    if opts.method == "rtn" and context.hessians is not None:
        raise PassError("quantize_int4: a calibration text is only used by method: gptq")
    sites, skipped = weight_sites(graph, opts.skip)
    todo = []
    for site in sites:
        t = graph.tensor(site.name)
        if t.layout != "row_major":
            raise PassError(f"quantize_int4: {t.name} has layout {t.layout!r}; run reorder_weights last")
        if t.scheme not in ("none", "sparse24"):
            skipped[site.name] = f"already {t.scheme}"
        elif t.scheme == "none" and t.shape[1] % 2:
            raise PassError(f"quantize_int4: {t.name} has an odd number of columns ({t.shape[1]})")
        else:
            todo.append(site)
    encoded: dict[str, Encoded] = {}
    rtn_fallback = 0
    if opts.method == "gptq":
        groups: dict[tuple[str, str], list[WeightSite]] = {}
        for site in todo:
            if site.stats_key is None:
                rtn_fallback += 1
                continue
            groups.setdefault((site.stats_key, graph.tensor(site.name).scheme), []).append(site)
        for (key, _), members in groups.items():
            if key not in context.hessians:
                raise PassError(f"quantize_int4: no calibration statistics for value {key!r} "
                                f"(input of {members[0].ops[-1].source})")
            for site, enc in zip(members, _gptq(graph, members, context.hessians[key], opts)):
                encoded[site.name] = enc

    def encode(site: WeightSite, dense: np.ndarray) -> Encoded:
        return encoded.pop(site.name, None) or _rtn(graph, site, dense, opts)

    stats = rewrite_sites(graph, todo, encode)
    what = f"int4 g{opts.group_size} {'sym' if opts.symmetric else 'asym'} {opts.method}-quantized"
    note = f"; {rtn_fallback} without statistics rounded to nearest" if rtn_fallback else ""
    note += f"; kept {len(skipped)} ({count_reasons(skipped)})" if skipped else ""
    return PassResult(describe_rewrite(stats, len(todo), what) + note,
                      {**stats, "quantized": len(todo), "skipped": skipped}, options_dict(opts))
