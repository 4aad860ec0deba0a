"""Encoders and decoders of the weight schemes, exactly as formats/README.md ("Weight schemes and
layouts") defines them. The passes encode with these; the compiler decodes with ``dense_weight`` to
hand the effective weights back to the source model; the runtime has its own decoders
(``mgx.kernels.reference.quant``), and tests hold the two to the same bits.

Every decoder computes in float32 in the same order as the reference kernels (``(q - z) * s``), so
the values the compiler writes back are bit-identical to those the runtime multiplies by.
"""

from __future__ import annotations

import collections
import itertools
import os
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mgx.formats import ir, layouts

from ._base import PassError
from ._common import WeightSite, fmt_bytes, replace_tensors, tensor_users, to_f32, to_storage
from ._gptq import ColumnQuantizer

__all__ = [
    "Encoded",
    "COMPANION_ROLES",
    "encode_w8a16",
    "are_f16",
    "f16_scales",
    "int4_fit",
    "int4_codes",
    "int4_decode",
    "encode_int4",
    "sparse24_mask",
    "encode_sparse24",
    "encode_sparse24_int4",
    "sparse24_kept",
    "sparse24_expand",
    "pack_nibbles",
    "unpack_nibbles",
    "decode",
    "dense_weight",
    "check_scheme",
    "apply",
    "site_arrays",
    "rewrite_sites",
    "int4_column_quantizer",
    "describe_rewrite",
]

COMPANION_ROLES = ("scales", "zeros", "meta")  # weight roles that belong to the weight's scheme


@dataclass(slots=True)
class Encoded:
    """One weight in a scheme: the stored arrays by role and the scheme's parameters."""

    scheme: str
    weight: np.ndarray
    companions: dict[str, np.ndarray] = field(default_factory=dict)  # role -> array
    params: dict[str, Any] = field(default_factory=dict)


# -- int8 -----------------------------------------------------------------------------------------------


def encode_w8a16(w: np.ndarray) -> Encoded:
    """Symmetric int8, one scale per output channel: ``W[n, k] = q[n, k] * scales[n]``.

    (The array steps run in place where they can: on an 8B model the encodings are most of the
    compile, and numpy's temporaries cost more than the arithmetic.)"""
    amax = _abs_max(w, axis=1)
    scales = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)  # [N]
    q = w / scales[:, None]  # float32
    np.rint(q, out=q)
    np.clip(q, -127, 127, out=q)
    return Encoded("w8a16", q.astype(np.int8), {"scales": scales})


def _abs_max(a: np.ndarray, axis: int) -> np.ndarray:
    """max |a| along ``axis`` without an |a| temporary (the same values as ``np.abs(a).max(axis)``)."""
    return np.maximum(a.max(axis=axis), -a.min(axis=axis))


# -- int4 -----------------------------------------------------------------------------------------------


def _groups(k: int, group: int) -> int:
    return -(-k // group)


def _blocks(a: np.ndarray, group: int) -> np.ndarray:
    """[N, K] -> [N, G, group], the last group zero-padded (a view when K is a multiple of group)."""
    n, k = a.shape
    g = _groups(k, group)
    if g * group != k:
        a = np.concatenate([a, np.zeros((n, g * group - k), a.dtype)], axis=1)
    return a.reshape(n, g, group)


def f16_scales(scales: np.ndarray) -> np.ndarray:
    """``scales`` (f32) each raised to the nearest fp16 value at or above it where that is a normal fp16
    number (2^-14 .. 65504), others kept: a larger step never clips a code that fitted before, and the
    GPU's imma kernels can read such scales as fp16 pairs (``gemv.scale_pairs``) with no change of value."""
    s = np.asarray(scales, np.float32)
    with np.errstate(over="ignore"):  # past fp16's range: kept below
        h = s.astype(np.float16)
        h = np.where(h.astype(np.float32) < s, np.nextafter(h, np.float16(np.inf)), h).astype(np.float32)
    return np.where((s >= 2.0**-14) & (h <= 65504.0), h, s).astype(np.float32)


def are_f16(scales: np.ndarray) -> bool:
    """Whether every value of ``scales`` is an fp16 value (what ``f16_scales`` writes where it can)."""
    s = np.asarray(scales, np.float32)
    with np.errstate(over="ignore"):
        return bool(np.array_equal(s.astype(np.float16).astype(np.float32), s))


def int4_fit(w: np.ndarray, group: int, symmetric: bool, f16: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
    """Scales [N, G] f32 and zero points [N, G] u8 (None when symmetric) of ``w`` [N, K], groups along K.

    Asymmetric: each group's range is widened to hold 0, then split into 15 steps. Symmetric: the
    zero point is 8 and the scale maps the largest magnitude to 7 (nothing is clipped). ``f16``: the
    scales raised to fp16 values (``f16_scales``) before the zero points are fitted to them.
    """
    blocks = _blocks(np.asarray(w, np.float32), group)  # zero padding sits inside [min(.,0), max(.,0)] anyway
    if symmetric:
        amax = _abs_max(blocks, axis=2)
        scales = np.where(amax > 0, amax / 7.0, 1.0).astype(np.float32)
        return (f16_scales(scales) if f16 else scales), None
    lo = np.minimum(blocks.min(axis=2), 0.0)
    hi = np.maximum(blocks.max(axis=2), 0.0)
    scales = np.where(hi > lo, (hi - lo) / 15.0, 1.0).astype(np.float32)
    if f16:
        scales = f16_scales(scales)
    zeros = np.clip(np.rint(-lo / scales), 0, 15).astype(np.uint8)
    return scales, zeros


def int4_codes(w: np.ndarray, scales: np.ndarray, zeros: np.ndarray | None, group: int) -> np.ndarray:
    """Round-to-nearest codes [N, K] u8 (0..15) of ``w`` under the given scales and zero points."""
    n, k = w.shape
    q = _blocks(np.asarray(w, np.float32), group) / scales[:, :, None]  # [N, G, group]
    q += np.float32(8) if zeros is None else zeros[:, :, None].astype(np.float32)
    np.rint(q, out=q)
    np.clip(q, 0, 15, out=q)
    return q.astype(np.uint8).reshape(n, -1)[:, :k]


def int4_decode(q: np.ndarray, scales: np.ndarray, zeros: np.ndarray | None, group: int) -> np.ndarray:
    """``(q - z) * s`` in float32, [N, K]."""
    n, k = q.shape
    out = _blocks(q, group).astype(np.float32)
    out -= np.float32(8) if zeros is None else zeros[:, :, None].astype(np.float32)
    out *= scales[:, :, None]
    return out.reshape(n, -1)[:, :k]


def pack_nibbles(q: np.ndarray) -> np.ndarray:
    """Codes [N, K] (K even) -> bytes [N, K/2]: column 2b in the low nibble of byte b, 2b+1 in the high."""
    if q.shape[1] % 2:
        raise PassError(f"int4 packing needs an even number of columns, got {q.shape[1]}")
    return (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)


def unpack_nibbles(b: np.ndarray) -> np.ndarray:
    """Bytes [N, K/2] -> codes [N, K]."""
    q = np.empty((b.shape[0], b.shape[1] * 2), np.uint8)
    q[:, 0::2] = b & 0x0F
    q[:, 1::2] = b >> 4
    return q


def encode_int4(w: np.ndarray, group: int, symmetric: bool, scales: np.ndarray | None = None,
                zeros: np.ndarray | None = None, f16: bool = False) -> Encoded:
    """int4 of ``w`` [N, K]; round-to-nearest unless ``scales``/``zeros`` were chosen already (GPTQ);
    ``f16``: as ``int4_fit``'s."""
    if scales is None:
        scales, zeros = int4_fit(w, group, symmetric, f16)
    q = int4_codes(w, scales, zeros, group)
    companions = {"scales": scales} if symmetric else {"scales": scales, "zeros": zeros}
    return Encoded("int4", pack_nibbles(q), companions,
                   {"group_size": group, "symmetric": symmetric, "cols": int(w.shape[1])})


# -- 2:4 sparsity ---------------------------------------------------------------------------------------


def sparse24_mask(w: np.ndarray) -> np.ndarray:
    """Keep mask [N, K]: the two largest magnitudes of every 4 columns (ties: the lower column)."""
    n, k = w.shape
    if k % 4:
        raise PassError(f"2:4 sparsity needs K divisible by 4, got {k}")
    groups = np.abs(w).reshape(n, k // 4, 4)
    order = np.argsort(-groups, axis=2, kind="stable")[:, :, :2]  # [N, K/4, 2]
    mask = np.zeros_like(groups, dtype=bool)
    np.put_along_axis(mask, order, True, axis=2)
    return mask.reshape(n, k)


def sparse24_kept(w: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The kept values [N, K/2] (in column order) and their metadata [N, K/4] u8."""
    n, k = w.shape
    groups = mask.reshape(n, k // 4, 4)
    if not np.all(groups.sum(axis=2) == 2):
        raise PassError("a 2:4 mask must keep exactly 2 of every 4 columns")
    idx = np.nonzero(groups)[2].reshape(n, k // 4, 2)  # ascending within each group
    meta = (idx[..., 0] | (idx[..., 1] << 2)).astype(np.uint8)
    values = w[mask].reshape(n, k // 2)
    return values, meta


def sparse24_expand(values: np.ndarray, meta: np.ndarray, k: int) -> np.ndarray:
    """Kept values [N, K/2] and metadata [N, K/4] -> the dense [N, K] matrix (zeros elsewhere)."""
    n = values.shape[0]
    idx = np.stack([meta & 3, (meta >> 2) & 3], axis=-1).astype(np.int64)  # [N, K/4, 2]
    out = np.zeros((n, k // 4, 4), np.float32)
    np.put_along_axis(out, idx, values.reshape(n, k // 4, 2).astype(np.float32), axis=2)
    return out.reshape(n, k)


def encode_sparse24(w: np.ndarray, mask: np.ndarray, dtype: ir.DType) -> Encoded:
    """2:4 sparse: kept values in ``dtype`` (the dense weight's) plus their positions."""
    values, meta = sparse24_kept(w, mask)
    return Encoded("sparse24", to_storage(values, dtype), {"meta": meta}, {"cols": int(w.shape[1])})


def encode_sparse24_int4(values: np.ndarray, meta: np.ndarray, k: int, group: int, symmetric: bool,
                         scales: np.ndarray | None = None, zeros: np.ndarray | None = None,
                         f16: bool = False) -> Encoded:  # fmt: skip
    """int4 of the kept values [N, K/2] of a 2:4 sparse weight (groups run along the kept values)."""
    inner = encode_int4(values, group, symmetric, scales, zeros, f16)
    return Encoded("sparse24_int4", inner.weight, {**inner.companions, "meta": meta},
                   {"group_size": group, "symmetric": symmetric, "cols": k})


# -- decoding -------------------------------------------------------------------------------------------


def _arr(arrays: Mapping[str, np.ndarray], role: str, name: str) -> np.ndarray:
    if role not in arrays:
        raise PassError(f"tensor {name}: its scheme needs a {role!r} tensor")
    return arrays[role]


def decode(t: ir.Tensor, companions: Mapping[str, ir.Tensor]) -> np.ndarray:
    """The dense float32 [N, K] value of weight ``t`` in any scheme and layout."""
    if t.scheme == "none" and t.layout == "row_major":
        return to_f32(t)
    arrays = {"weight": t.data, **{role: c.data for role, c in companions.items()}}
    if t.layout != "row_major":
        arrays = layouts.unpack(t.layout, arrays, t.scheme, t.scheme_params)
    p = t.scheme_params
    w = arrays["weight"]
    if t.scheme == "none":
        return to_f32(ir.Tensor(t.name, t.dtype, w.shape, w))
    if t.scheme == "w8a16":
        out = w.astype(np.float32)
        out *= _arr(arrays, "scales", t.name)[:, None]
        return out
    if t.scheme in ("int4", "sparse24_int4"):
        group, sym = int(p["group_size"]), bool(p["symmetric"])
        zeros = None if sym else _arr(arrays, "zeros", t.name)
        values = int4_decode(unpack_nibbles(w), _arr(arrays, "scales", t.name), zeros, group)
        if t.scheme == "int4":
            return values
        return sparse24_expand(values, _arr(arrays, "meta", t.name), int(p["cols"]))
    if t.scheme == "sparse24":
        values = to_f32(ir.Tensor(t.name, t.dtype, w.shape, w))
        return sparse24_expand(values, _arr(arrays, "meta", t.name), int(p["cols"]))
    raise PassError(f"tensor {t.name}: unknown weight scheme {t.scheme!r}")


def dense_weight(graph: ir.Graph, op: ir.Op, role: str = "weight") -> np.ndarray | None:
    """The float32 value of ``op``'s ``role`` tensor as the runtime reads it (None if the op has none)."""
    name = op.weights.get(role)
    if name is None:
        return None
    if role != "weight":
        return to_f32(graph.tensor(name))
    companions = {r: graph.tensor(op.weights[r]) for r in COMPANION_ROLES if r in op.weights}
    return decode(graph.tensor(name), companions)


# -- the contract's shapes ---------------------------------------------------------------------------------


def _expected_shapes(scheme: str, n: int, k: int, p: Mapping[str, Any]) -> dict[str, tuple[tuple[int, ...], str]]:
    """role -> (shape, numpy dtype char) that formats/README.md prescribes."""
    if scheme == "w8a16":
        return {"weight": ((n, k), "i1"), "scales": ((n,), "f4")}
    if scheme == "sparse24":
        return {"weight": ((n, k // 2), ""), "meta": ((n, k // 4), "u1")}
    g = int(p["group_size"])
    kept = k if scheme == "int4" else k // 2
    shapes = {"weight": ((n, kept // 2), "u1"), "scales": ((n, _groups(kept, g)), "f4")}
    if not p["symmetric"]:
        shapes["zeros"] = ((n, _groups(kept, g)), "u1")
    if scheme == "sparse24_int4":
        shapes["meta"] = ((n, k // 4), "u1")
    return shapes


def check_scheme(graph: ir.Graph, op: ir.Op) -> None:
    """Postcondition: ``op``'s weight and companions have the shapes and dtypes of their scheme."""
    t = graph.tensor(op.weights["weight"])
    if t.scheme == "none" or t.layout != "row_major":
        return
    n = int(t.shape[0])
    k = int(t.scheme_params.get("cols", t.shape[1]))
    for role, (shape, char) in _expected_shapes(t.scheme, n, k, t.scheme_params).items():
        if role not in op.weights:
            raise PassError(f"{op.kind} from {op.source}: scheme {t.scheme} needs a {role!r} tensor")
        c = graph.tensor(op.weights[role])
        if c.shape != shape or (char and c.data is not None and c.data.dtype.str[1:] != char):
            raise PassError(f"{op.kind} from {op.source}: {role} {c.name} is {c.dtype.value}{list(c.shape)}, "
                            f"scheme {t.scheme} needs {char}{list(shape)}")


def apply(graph: ir.Graph, name: str, enc: Encoded) -> None:
    """Store ``enc`` as weight ``name`` (companions named after it) and point every op using it there."""
    dtypes = {np.dtype("i1"): ir.DType.I8, np.dtype("u1"): ir.DType.U8, np.dtype("<f4"): ir.DType.F32,
              np.dtype("<u2"): ir.DType.BF16, np.dtype("<f2"): ir.DType.F16}
    old = graph.tensor(name)
    users = tensor_users(graph)[name]
    stem = name.removesuffix(".weight")
    weight_dtype = old.dtype if enc.weight.dtype == ir.numpy_dtype(old.dtype) else dtypes[enc.weight.dtype]
    new = [ir.Tensor(name, weight_dtype, enc.weight.shape, enc.weight, enc.scheme, dict(enc.params))]
    stale = [old.name]
    for op, _ in users:
        stale += [op.weights.pop(r) for r in COMPANION_ROLES if r in op.weights]
    for role, arr in enc.companions.items():
        new.append(ir.Tensor(f"{stem}.{role}", dtypes[arr.dtype], arr.shape, np.ascontiguousarray(arr)))
    replace_tensors(graph, dict.fromkeys(stale), new)
    for op, _ in users:
        op.weights.update({role: f"{stem}.{role}" for role in enc.companions})


def int4_column_quantizer(group_cols: int, symmetric: bool, f16: bool = False) -> ColumnQuantizer:
    """int4 rounding for ``obs_solve``: parameters fitted per ``group_cols`` columns like ``int4_fit``."""

    def fit(span: np.ndarray) -> tuple[np.ndarray, ...]:
        scales, zeros = int4_fit(span, span.shape[1], symmetric, f16)
        return (scales[:, 0],) if zeros is None else (scales[:, 0], zeros[:, 0])

    def round_(col: np.ndarray, params: tuple[np.ndarray, ...], index: int) -> np.ndarray:
        s = params[0]
        z = params[1].astype(np.float32) if len(params) > 1 else np.float32(8.0)
        q = np.clip(np.rint(col / s + z), 0, 15)
        return (q.astype(np.float32) - z) * s

    return ColumnQuantizer(group_cols, fit, round_)


# -- rewriting the weights a pass selected --------------------------------------------------------------


def site_arrays(graph: ir.Graph, site: WeightSite) -> tuple[ir.Tensor, dict[str, ir.Tensor]]:
    """A site's weight tensor and its companions by role."""
    op = site.ops[0]
    return graph.tensor(site.name), {r: graph.tensor(op.weights[r]) for r in COMPANION_ROLES if r in op.weights}


def _site_bytes(graph: ir.Graph, site: WeightSite) -> int:
    t, companions = site_arrays(graph, site)
    return t.nbytes + sum(c.nbytes for c in companions.values())


def rewrite_workers() -> int:
    """Weights encoded at once by ``rewrite_sites``: numpy releases the GIL in its array loops, so
    threads scale; one a core, at most 8, each holding a weight's float32 copy and its encoding
    (``MGX_COMPILE_THREADS`` overrides)."""
    env = os.environ.get("MGX_COMPILE_THREADS")
    return max(1, int(env) if env and env.isdigit() else min(8, os.cpu_count() or 1))


def rewrite_sites(graph: ir.Graph, sites: list[WeightSite], encode: Callable[[WeightSite, np.ndarray], Encoded],
                  ) -> dict[str, float]:
    """Encode each site (``encode(site, dense float32 value)``), store it, check it against the contract.

    Returns bytes before and after (weights and companions) and the mean relative error
    ||W' - W|| / ||W|| of the dense values. Sites are encoded ``rewrite_workers()`` at a time on
    threads, a new one starting as soon as the oldest is stored (not in batches, which waited for
    each batch's largest weight), and stored in their order by this thread, so the result does not
    depend on the thread count. The workers only read the graph: each its own site's tensors, which
    no other store touches, through ``graph.tensors``, which a store replaces whole.
    """
    before = sum(_site_bytes(graph, s) for s in sites)
    errors: list[float] = []

    def prepare(site: WeightSite) -> tuple[np.ndarray, Encoded]:
        dense = decode(*site_arrays(graph, site))
        return dense, encode(site, dense)

    def rel_error(site: WeightSite, dense: np.ndarray) -> float:
        norm = float(np.linalg.norm(dense))
        return float(np.linalg.norm(decode(*site_arrays(graph, site)) - dense)) / norm if norm > 0 else 0.0

    workers = rewrite_workers()
    with ThreadPoolExecutor(workers) as pool:
        todo = iter(sites)
        running = collections.deque((site, pool.submit(prepare, site)) for site in itertools.islice(todo, workers))
        measured = collections.deque()
        while running:
            site, job = running.popleft()
            dense, enc = job.result()
            apply(graph, site.name, enc)
            for op in site.ops:
                check_scheme(graph, op)
            measured.append(pool.submit(rel_error, site, dense))
            del dense, enc, job
            # At most `workers` weights' dense copies held at once, being encoded or measured.
            while measured and (measured[0].done() or len(measured) + len(running) >= workers):
                errors.append(measured.popleft().result())
            following = next(todo, None)
            if following is not None:
                running.append((following, pool.submit(prepare, following)))
        errors.extend(m.result() for m in measured)
    after = sum(_site_bytes(graph, s) for s in sites)
    return {"bytes_before": before, "bytes_after": after, "rel_error": float(np.mean(errors)) if errors else 0.0}


def describe_rewrite(stats: Mapping[str, float], count: int, what: str) -> str:
    """"int4-quantized 211 weights: 230.1 MB -> 62.3 MB (0.27x), mean rel. error 4.1%"."""
    b0, b1 = stats["bytes_before"], stats["bytes_after"]
    ratio = f" ({b1 / b0:.3f}x)" if b0 else ""
    return (f"{what} {count} weights: {fmt_bytes(b0)} -> {fmt_bytes(b1)}{ratio}, "
            f"mean rel. error {100 * stats['rel_error']:.2f}%")
