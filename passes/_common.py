"""Helpers shared by the passes: options, layer selection, graph queries, float storage, fusion."""

from __future__ import annotations

import dataclasses
import fnmatch
import re
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import numpy as np

from mgx.formats import ir

from ._base import PassError

__all__ = [
    "Skip",
    "parse_options",
    "options_dict",
    "consumers",
    "producers",
    "tensor_users",
    "layer_of",
    "to_f32",
    "to_storage",
    "float_tensor",
    "replace_tensors",
    "fuse_linears",
    "unique_value",
    "shared_tensors",
    "fmt_bytes",
    "WeightSite",
    "weight_sites",
    "count_reasons",
    "LINEAR_KINDS",
    "WEIGHT_KINDS",
]

T = TypeVar("T")

LINEAR_KINDS = ("linear", "lm_head")  # ops that multiply by a weight matrix [N, K]
WEIGHT_KINDS = ("embedding", "linear", "lm_head")  # ops whose "weight" is a matrix a pass may rewrite

# -- options -----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Skip:
    """Which weights a pass leaves alone (model.yaml: ``skip: {lm_head: true, first_layers: 1, ...}``)."""

    embedding: bool = False  # embedding tables (and an LM head tied to one)
    lm_head: bool = False  # the LM head (and the embedding table tied to it)
    first_layers: int = 0  # this many decoder layers from the bottom
    last_layers: int = 0  # this many decoder layers from the top
    names: tuple[str, ...] = ()  # fnmatch patterns on the op's source module, e.g. "layers.*.mlp.down_proj"

    def __post_init__(self) -> None:
        if self.first_layers < 0 or self.last_layers < 0:
            raise PassError("skip.first_layers and skip.last_layers must be >= 0")

    def reason(self, op: ir.Op, num_layers: int) -> str | None:
        """Why ``op`` is skipped (a short phrase), or None when the pass may rewrite it."""
        if op.kind == "embedding" and self.embedding:
            return "skip.embedding"
        if op.kind == "lm_head" and self.lm_head:
            return "skip.lm_head"
        layer = layer_of(op.source)
        if layer is not None and layer < self.first_layers:
            return "skip.first_layers"
        if layer is not None and layer >= num_layers - self.last_layers:
            return "skip.last_layers"
        sources = [op.source, *op.attrs.get("fused_sources", [])]
        for pattern in self.names:
            if any(fnmatch.fnmatchcase(s, pattern) for s in sources):
                return f"skip.names {pattern!r}"
        return None


def parse_options(cls: type[T], raw: Mapping[str, Any], where: str, defaults: T | None = None) -> T:
    """Build the options dataclass ``cls`` from a model.yaml mapping, checking every key and type.

    Unknown keys are errors that name the allowed ones. A nested dataclass field (``skip``) takes a
    mapping whose keys override that field's default.
    """
    defaults = defaults if defaults is not None else cls()
    if not isinstance(raw, Mapping):
        raise PassError(f"{where}: options must be a mapping, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    allowed = [f.name for f in dataclasses.fields(cls)]
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in allowed:
            raise PassError(f"{where}: unknown option {key!r}; allowed: {', '.join(allowed)}")
        kwargs[key] = _convert(f"{where}.{key}", value, hints[key], getattr(defaults, key))
    try:
        return dataclasses.replace(defaults, **kwargs)
    except (TypeError, ValueError) as exc:
        raise PassError(f"{where}: {exc}") from None


def _convert(where: str, value: Any, hint: Any, default: Any) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return parse_options(hint, value, where, default)
    if origin is Literal:
        if value not in args:
            raise PassError(f"{where}: {value!r} is not allowed; allowed: {', '.join(map(str, args))}")
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _convert(where, value, inner, default)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise PassError(f"{where}: expected a list, got {type(value).__name__} {value!r}")
        return tuple(_convert(f"{where}[{i}]", v, args[0], None) for i, v in enumerate(value))
    kinds = {bool: (bool,), int: (int,), float: (int, float), str: (str,)}[hint]
    if not isinstance(value, kinds) or (hint is not bool and isinstance(value, bool)):
        raise PassError(f"{where}: expected {hint.__name__}, got {type(value).__name__} {value!r}")
    return float(value) if hint is float else value


def options_dict(options: Any) -> dict[str, Any]:
    """Options as a JSON-able dict (tuples become lists), for the artifact's pass record."""

    def plain(v: Any) -> Any:
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v

    return plain(dataclasses.asdict(options))


# -- graph queries -------------------------------------------------------------------------------------


def consumers(graph: ir.Graph) -> dict[str, list[ir.Op]]:
    """Value name -> the ops that read it, in program order."""
    out: dict[str, list[ir.Op]] = {}
    for op in graph.ops:
        for name in op.inputs:
            out.setdefault(name, []).append(op)
    return out


def producers(graph: ir.Graph) -> dict[str, ir.Op]:
    """Value name -> the op that writes it."""
    return {name: op for op in graph.ops for name in op.outputs}


def tensor_users(graph: ir.Graph) -> dict[str, list[tuple[ir.Op, str]]]:
    """Tensor name -> every (op, role) that references it (a tied embedding has two)."""
    out: dict[str, list[tuple[ir.Op, str]]] = {}
    for op in graph.ops:
        for role, name in op.weights.items():
            out.setdefault(name, []).append((op, role))
    return out


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def layer_of(source: str) -> int | None:
    """The decoder layer a module path belongs to ("layers.3.mlp.up_proj" -> 3), None outside layers."""
    m = _LAYER.search(source)
    return int(m.group(1)) if m else None


def unique_value(graph: ir.Graph, hint: str) -> str:
    """A value name not yet used in ``graph``, ``hint`` if free."""
    used = {name for op in graph.ops for name in (*op.inputs, *op.outputs)} | set(graph.inputs)
    name, i = hint, 1
    while name in used:
        name, i = f"{hint}.{i}", i + 1
    return name


# -- float storage ------------------------------------------------------------------------------------


def to_f32(t: ir.Tensor) -> np.ndarray:
    """The float32 values of a plain float tensor (bf16 bits widened exactly)."""
    if t.data is None:
        raise PassError(f"tensor {t.name} has no data")
    if t.dtype == ir.DType.F32:
        return t.data
    if t.dtype == ir.DType.BF16:
        wide = t.data.astype(np.uint32)
        wide <<= 16  # in place: one array where the shift would make a second
        return wide.view(np.float32)
    if t.dtype == ir.DType.F16:
        return t.data.astype(np.float32)
    raise PassError(f"tensor {t.name}: {t.dtype.value} is not a float dtype")


def to_storage(array: np.ndarray, dtype: ir.DType) -> np.ndarray:
    """An fp32 array in the storage dtype (bf16 as uint16 bits, rounded to nearest even)."""
    array = np.ascontiguousarray(array, dtype=np.float32)
    if dtype == ir.DType.F32:
        return array
    if dtype == ir.DType.F16:
        return array.astype(np.float16)
    if dtype != ir.DType.BF16:
        raise PassError(f"{dtype.value} is not a float storage dtype")
    bits = array.view(np.uint32)
    out = ((bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)
    nan = np.isnan(array)
    if nan.any():
        out[nan] = 0x7FC0
    return out


def float_tensor(name: str, values: np.ndarray, dtype: ir.DType) -> ir.Tensor:
    """A plain tensor holding fp32 ``values`` stored as ``dtype``."""
    return ir.Tensor(name, dtype, values.shape, to_storage(values, dtype))


def replace_tensors(graph: ir.Graph, old: Iterable[str], new: Iterable[ir.Tensor]) -> None:
    """Drop tensors ``old`` and put ``new`` where the first of them was, keeping the artifact's order."""
    gone = {n for n in old if n in graph.tensors}
    new = list(new)
    clash = [t.name for t in new if t.name in graph.tensors and t.name not in gone]
    if clash:
        raise PassError(f"tensor {clash[0]!r} already exists")
    out: dict[str, ir.Tensor] = {}
    for name, t in graph.tensors.items():
        if name not in gone:
            out[name] = t
        elif new:
            out.update((n.name, n) for n in new)
            new = []
    out.update((n.name, n) for n in new)
    graph.tensors = out


def fmt_bytes(n: float) -> str:
    """A byte count for a log line: "12.3 MB"."""
    for unit in ("B", "kB", "MB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.2f} GB"


# -- fusion -------------------------------------------------------------------------------------------


def fuse_linears(graph: ir.Graph, ops: list[ir.Op], label: str) -> tuple[ir.Op, int]:
    """Replace linear ``ops`` (same input, dense weights) by one whose output stacks theirs.

    The fused op's weight is the parts' weights stacked along N (biases too; a part without a bias
    gets zeros when another has one). It records where it came from in ``attrs``:
    ``fused_sources`` (each part's source module) and ``fused_sizes`` (each part's width), so the
    compiler can map the weights back to the source model. The fused op takes the place of the
    first part; its output is a new value. Returns the op and its index.
    """
    x = ops[0].inputs[0]
    weights = [graph.tensor(op.weights["weight"]) for op in ops]
    dtype = weights[0].dtype
    for op, w in zip(ops, weights):
        if op.inputs != [x] or w.scheme != "none" or w.layout != "row_major" or w.dtype != dtype:
            raise PassError(f"cannot fuse {op.source}: parts must read one input and hold dense row-major "
                            f"{dtype.value} weights (run fusion before quantization and reordering)")
    parent = ops[0].source.rsplit(".", 1)[0]
    stem = f"{parent}.{label}"
    sizes = [int(op.attrs["out_features"]) for op in ops]
    # Stacking the stored arrays is exact: no value is converted.
    fused_w = ir.Tensor(f"{stem}.weight", dtype, (sum(sizes), weights[0].shape[1]),
                        np.concatenate([w.data for w in weights]))
    new_tensors = [fused_w]
    roles = {"weight": fused_w.name}
    if any("bias" in op.weights for op in ops):
        biases = [graph.tensor(op.weights["bias"]) if "bias" in op.weights else None for op in ops]
        b_dtype = next(b.dtype for b in biases if b is not None)
        if any(b is not None and b.dtype != b_dtype for b in biases):
            raise PassError(f"cannot fuse {ops[0].source}: its parts' biases have different dtypes")
        # A part without a bias adds zeros (all-zero bits in every float dtype).
        parts = [b.data if b is not None else np.zeros(n, ir.numpy_dtype(b_dtype)) for b, n in zip(biases, sizes)]
        new_tensors.append(ir.Tensor(f"{stem}.bias", b_dtype, (sum(sizes),), np.concatenate(parts)))
        roles["bias"] = new_tensors[-1].name
    attrs = {
        "in_features": int(ops[0].attrs["in_features"]),
        "out_features": sum(sizes),
        "fused_sources": [op.source for op in ops],
        "fused_sizes": sizes,
    }
    fused = ir.Op("linear", [x], [unique_value(graph, stem)], roles, attrs, parent)
    replace_tensors(graph, [n for op in ops for n in op.weights.values()], new_tensors)
    index = min(graph.ops.index(op) for op in ops)
    gone = {id(op) for op in ops}
    graph.ops[index] = fused
    graph.ops[:] = [op for op in graph.ops if id(op) not in gone]
    return fused, graph.ops.index(fused)


def shared_tensors(graph: ir.Graph) -> set[str]:
    """Tensors referenced by more than one op (tied embeddings): passes that rewrite one op's
    weight in place must leave these alone."""
    return {name for name, users in tensor_users(graph).items() if len(users) > 1}



# -- which weights a pass rewrites -----------------------------------------------------------------------


@dataclass(slots=True)
class WeightSite:
    """A weight matrix a pass may rewrite, with every op that reads it."""

    name: str  # tensor name
    ops: list[ir.Op]  # the ops that read it as their "weight" (two for a tied embedding / LM head)
    stats_key: str | None  # the input value of a linear or lm_head reading it (calibration statistics)


def weight_sites(graph: ir.Graph, skip: Skip, kinds: tuple[str, ...] = WEIGHT_KINDS,
                 ) -> tuple[list[WeightSite], dict[str, str]]:
    """The weights read only as the "weight" of ops of ``kinds``, split into those the pass may
    rewrite (in tensor order) and those ``skip`` excludes (name -> reason).

    A tensor shared by several ops (a tied embedding) is rewritten only if none of them is skipped.
    """
    users = tensor_users(graph)
    sites: list[WeightSite] = []
    skipped: dict[str, str] = {}
    for name in graph.tensors:
        refs = users.get(name, [])
        if not refs or any(role != "weight" or op.kind not in WEIGHT_KINDS for op, role in refs):
            continue
        ops = [op for op, _ in refs]
        if any(op.kind not in kinds for op in ops):
            skipped[name] = "read by " + ", ".join(sorted({op.kind for op in ops if op.kind not in kinds}))
            continue
        reasons = [r for r in (skip.reason(op, graph.arch.num_layers) for op in ops) if r]
        if reasons:
            skipped[name] = reasons[0]
            continue
        linear = [op for op in ops if op.kind in LINEAR_KINDS]
        sites.append(WeightSite(name, ops, linear[-1].inputs[0] if linear else None))
    return sites, skipped


def count_reasons(skipped: Mapping[str, str]) -> str:
    """"3 skip.lm_head, 2 skip.first_layers" for a summary line ("" when nothing was skipped)."""
    counts: dict[str, int] = {}
    for reason in skipped.values():
        counts[reason] = counts.get(reason, 0) + 1
    return ", ".join(f"{n} {r}" for r, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def fusion_skip_reason(graph: ir.Graph, parts: Sequence[ir.Op], skip: Skip, shared: set[str], what: str,
                       pass_name: str) -> str | None:
    """Why the linears ``parts`` stay unfused (a skip rule, or a weight another op shares), or None.

    Raises PassError when they are already quantized (fusion runs before the quantization passes);
    ``what`` names the group in that message, e.g. "attention layers.0.self_attn q/k/v".
    """
    reason = next((r for r in (skip.reason(p, graph.arch.num_layers) for p in parts) if r), None)
    if reason is None and any(graph.tensor(p.weights["weight"]).scheme != "none" for p in parts):
        raise PassError(f"{what} weights are already quantized; run {pass_name} before the quantization passes")
    if reason is None and any(t in shared for p in parts for t in p.weights.values()):
        reason = "shared weight"
    return reason
