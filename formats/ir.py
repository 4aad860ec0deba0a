"""The MGX intermediate representation: a flat program of typed ops over named values.

Every activation value is a 2-D array ``[tokens, features]``: the tokens of one engine step
(one or many sequences, packed one after another). Only the feature width is part of the IR;
the token count changes from step to step. Weights are named tensors held in ``Graph.tensors``.

The op table ``OP_SPECS`` is the contract between compiler, passes and runtime: it names each op's
inputs, outputs, weight roles and attributes. ``verify`` checks a graph against it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = [
    "DType",
    "Tensor",
    "Op",
    "StateSpec",
    "ArchConfig",
    "Graph",
    "OpSpec",
    "OP_SPECS",
    "IRError",
    "verify",
    "numpy_dtype",
]


class IRError(ValueError):
    """A graph breaks the IR's rules; the message names the op and the rule."""


class DType(str, enum.Enum):
    """Element types of tensors. bf16 is held in numpy as uint16 bit patterns."""

    F32 = "f32"
    F16 = "f16"
    BF16 = "bf16"
    I8 = "i8"
    U8 = "u8"
    I32 = "i32"
    I64 = "i64"

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]


_ITEMSIZE = {
    DType.F32: 4,
    DType.F16: 2,
    DType.BF16: 2,
    DType.I8: 1,
    DType.U8: 1,
    DType.I32: 4,
    DType.I64: 8,
}

_NUMPY = {
    DType.F32: np.dtype("<f4"),
    DType.F16: np.dtype("<f2"),
    DType.BF16: np.dtype("<u2"),
    DType.I8: np.dtype("i1"),
    DType.U8: np.dtype("u1"),
    DType.I32: np.dtype("<i4"),
    DType.I64: np.dtype("<i8"),
}


def numpy_dtype(dtype: DType) -> np.dtype:
    """The numpy dtype that holds ``dtype``'s bytes (uint16 for bf16)."""
    return _NUMPY[dtype]


@dataclass(slots=True)
class Tensor:
    """A named weight tensor and how its bytes are to be read."""

    name: str  # unique key in Graph.tensors, e.g. "layers.0.self_attn.q_proj.weight"
    dtype: DType  # element type of the stored bytes
    shape: tuple[int, ...]  # logical shape of the stored array
    data: np.ndarray | None = None  # host array at compile time; a zero-copy view at run time
    scheme: str = "none"  # quantization scheme ("none" for plain weights; passes add others)
    scheme_params: dict[str, Any] = field(default_factory=dict)  # group size, symmetry, ...
    layout: str = "row_major"  # byte layout tag written by reorder_weights

    def __post_init__(self) -> None:
        self.dtype = DType(self.dtype)
        self.shape = tuple(int(d) for d in self.shape)
        if self.data is not None:
            if self.data.dtype != numpy_dtype(self.dtype):
                raise IRError(
                    f"tensor {self.name}: data is {self.data.dtype}, expected {numpy_dtype(self.dtype)} for {self.dtype.value}"
                )
            if tuple(self.data.shape) != self.shape:
                raise IRError(f"tensor {self.name}: data shape {self.data.shape} != declared {self.shape}")

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for d in self.shape:
            n *= d
        return n


@dataclass(slots=True)
class Op:
    """One step of the program.

    ``inputs``/``outputs`` name activation values; ``weights`` maps a role ("weight", "bias", ...)
    to a tensor name; ``attrs`` holds scalars and lists of scalars; ``source`` names the module of
    the original model it came from (for error messages and the pass log).
    """

    kind: str
    inputs: list[str]
    outputs: list[str]
    weights: dict[str, str] = field(default_factory=dict)
    attrs: dict[str, Any] = field(default_factory=dict)
    source: str = ""


@dataclass(slots=True)
class StateSpec:
    """The per-sequence state one layer keeps between steps."""

    layer: int  # index of the layer that owns the state
    kind: str  # "kv": paged K/V blocks (attention); "recurrent": a fixed-size state (linear attention)
    num_kv_heads: int = 0  # kv: heads stored per token
    head_dim: int = 0  # kv: width of one head
    shape: tuple[int, ...] = ()  # recurrent: shape of the fixed-size state per sequence


@dataclass(slots=True)
class ArchConfig:
    """The architecture and its hyper-parameters, as the source model declares them."""

    model_type: str  # Hugging Face model_type: "llama", "qwen2", "qwen3", "mistral"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_position: int  # context length the model was trained for
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    bos_token_id: int = -1  # -1 when the model has none
    eos_token_ids: list[int] = field(default_factory=list)
    pad_token_id: int = -1
    extra: dict[str, Any] = field(default_factory=dict)  # any other scalar hyper-parameters (rope_scaling, ...)


@dataclass(slots=True)
class Graph:
    """A whole model: architecture, program, weights and per-layer state."""

    arch: ArchConfig
    ops: list[Op]
    tensors: dict[str, Tensor]
    states: list[StateSpec]
    inputs: list[str] = field(default_factory=lambda: ["tokens"])  # step inputs (token ids)
    outputs: list[str] = field(default_factory=lambda: ["logits"])

    def tensor(self, name: str) -> Tensor:
        try:
            return self.tensors[name]
        except KeyError:
            raise IRError(f"no tensor named {name!r}") from None

    def weight_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


@dataclass(frozen=True, slots=True)
class OpSpec:
    """What an op kind takes and gives. Widths are checked by ``verify``."""

    inputs: tuple[int, int]  # (min, max) number of inputs
    outputs: int
    weights: tuple[str, ...]  # required weight roles
    optional_weights: tuple[str, ...] = ()
    attrs: tuple[str, ...] = ()  # required attributes
    doc: str = ""


# The op table. Runtime semantics, all activations [T, F] in the compute dtype:
OP_SPECS: dict[str, OpSpec] = {
    "embedding": OpSpec(
        (1, 1),
        1,
        ("weight",),
        ("scales", "zeros", "meta"),
        doc="tokens[T] (int) -> weight[tokens]: [T, H]; weight [V, H], read through its scheme (a table "
        "tied to the LM head is quantized with it)",
    ),
    "rms_norm": OpSpec(
        (1, 1),
        1,
        (),
        ("weight",),
        ("eps", "group"),
        doc="x[T, F]: each contiguous group of `group` features is scaled by rsqrt(mean(x^2)+eps), then "
        "multiplied by weight[group] when present (group = F for hidden norms, head_dim for q/k norms)",
    ),
    "linear": OpSpec(
        (1, 1),
        1,
        ("weight",),
        ("bias", "scales", "zeros", "meta"),
        ("in_features", "out_features"),
        doc="x[T, K] @ weight[N, K]^T + bias[N] -> [T, N]; the weight's scheme says how to read it",
    ),
    "split": OpSpec(
        (1, 1), -1, (), (), ("sizes",), doc="x[T, sum(sizes)] -> one output per size, in order"
    ),
    "rope": OpSpec(
        (2, 2),
        2,
        ("inv_freq",),
        (),
        ("head_dim", "rotary_dim", "num_heads", "num_kv_heads", "attention_scaling"),
        doc="q[T, Hq*D], k[T, Hk*D] rotated at each token's position (rotate-half style): angle = "
        "pos * inv_freq[rotary_dim/2]; cos and sin are multiplied by attention_scaling",
    ),
    "attention": OpSpec(
        (3, 3),
        1,
        (),
        (),
        ("layer", "num_heads", "num_kv_heads", "head_dim", "scale", "sliding_window"),
        doc="causal GQA attention of q[T, Hq*D] over this sequence's cached K/V plus k, v [T, Hk*D]; "
        "appends k, v to the layer's state; sliding_window 0 means none -> [T, Hq*D]",
    ),
    "silu_mul": OpSpec(
        (1, 2),
        1,
        (),
        doc="silu(gate) * up; with one input [T, 2F] the first half is gate, the second up -> [T, F]",
    ),
    "add": OpSpec((2, 2), 1, (), doc="a + b, same width"),
    "lm_head": OpSpec(
        (1, 1),
        1,
        ("weight",),
        ("bias", "scales", "zeros", "meta"),
        ("in_features", "out_features"),
        doc="like linear, but only on the rows the runtime samples from -> logits [R, V]",
    ),
}


def verify(graph: Graph) -> dict[str, int | None]:
    """Check ops against ``OP_SPECS``, dataflow order, weight references and feature widths.

    Raises ``IRError`` naming the first op (by index, kind and source) that breaks a rule. Returns
    each activation's feature width, by name (None where the graph leaves it open, as at its inputs).
    """
    widths: dict[str, int | None] = {name: None for name in graph.inputs}
    for index, op in enumerate(graph.ops):
        where = f"op {index} ({op.kind} from {op.source or '?'})"
        spec = OP_SPECS.get(op.kind)
        if spec is None:
            raise IRError(f"{where}: unknown op kind; known: {', '.join(sorted(OP_SPECS))}")
        lo, hi = spec.inputs
        if not lo <= len(op.inputs) <= hi:
            raise IRError(f"{where}: takes {lo}..{hi} inputs, got {len(op.inputs)}")
        n_out = len(op.attrs.get("sizes", [])) if spec.outputs == -1 else spec.outputs
        if len(op.outputs) != n_out:
            raise IRError(f"{where}: gives {n_out} outputs, got {len(op.outputs)}")
        for name in op.inputs:
            if name not in widths:
                raise IRError(f"{where}: input {name!r} is used before it is defined")
        for role in spec.weights:
            if role not in op.weights:
                raise IRError(f"{where}: missing weight role {role!r}")
        for role, tname in op.weights.items():
            if role not in spec.weights and role not in spec.optional_weights:
                raise IRError(f"{where}: unexpected weight role {role!r}")
            if tname not in graph.tensors:
                raise IRError(f"{where}: weight {role!r} names missing tensor {tname!r}")
        for attr in spec.attrs:
            if attr not in op.attrs:
                raise IRError(f"{where}: missing attribute {attr!r}")
        out_widths = _infer_widths(graph, op, [widths[i] for i in op.inputs], where)
        for name, w in zip(op.outputs, out_widths):
            if name in widths:
                raise IRError(f"{where}: output {name!r} is defined twice")
            widths[name] = w
    for name in graph.outputs:
        if name not in widths:
            raise IRError(f"graph output {name!r} is never produced")
    layers = {s.layer for s in graph.states}
    for op in graph.ops:
        if op.kind == "attention" and op.attrs["layer"] not in layers:
            raise IRError(f"attention from {op.source}: layer {op.attrs['layer']} declares no state")
    return widths


def _logical_in_out(graph: Graph, op: Op) -> tuple[int, int]:
    return int(op.attrs["in_features"]), int(op.attrs["out_features"])


def _expect(cond: bool, where: str, message: str) -> None:
    if not cond:
        raise IRError(f"{where}: {message}")


def _infer_widths(graph: Graph, op: Op, ins: list[int | None], where: str) -> list[int | None]:
    """Feature widths of an op's outputs; checks the widths of its inputs where they are known."""
    k = op.kind
    if k == "embedding":
        w = graph.tensors[op.weights["weight"]]
        return [w.shape[1] if w.scheme == "none" else int(w.scheme_params.get("cols", w.shape[-1]))]
    if k == "rms_norm":
        group = int(op.attrs["group"])
        _expect(ins[0] is None or ins[0] % group == 0, where, f"width {ins[0]} not a multiple of group {group}")
        if "weight" in op.weights:
            shape = graph.tensors[op.weights["weight"]].shape
            _expect(shape == (group,), where, f"weight shape {shape} != ({group},)")
        return [ins[0]]
    if k in ("linear", "lm_head"):
        n_in, n_out = _logical_in_out(graph, op)
        _expect(ins[0] is None or ins[0] == n_in, where, f"input width {ins[0]} != in_features {n_in}")
        w = graph.tensors[op.weights["weight"]]
        if w.scheme == "none":
            _expect(w.shape == (n_out, n_in), where, f"weight shape {w.shape} != ({n_out}, {n_in})")
        if "bias" in op.weights:
            b = graph.tensors[op.weights["bias"]]
            _expect(b.shape == (n_out,), where, f"bias shape {b.shape} != ({n_out},)")
        return [n_out]
    if k == "split":
        sizes = [int(s) for s in op.attrs["sizes"]]
        _expect(ins[0] is None or ins[0] == sum(sizes), where, f"width {ins[0]} != sum of sizes {sum(sizes)}")
        return list(sizes)
    if k == "rope":
        d = int(op.attrs["head_dim"])
        hq, hk = int(op.attrs["num_heads"]), int(op.attrs["num_kv_heads"])
        _expect(ins[0] is None or ins[0] == hq * d, where, f"q width {ins[0]} != {hq}*{d}")
        _expect(ins[1] is None or ins[1] == hk * d, where, f"k width {ins[1]} != {hk}*{d}")
        rot = int(op.attrs["rotary_dim"])
        _expect(0 < rot <= d and rot % 2 == 0, where, f"rotary_dim {rot} must be even and in (0, {d}]")
        inv = graph.tensors[op.weights["inv_freq"]]
        _expect(inv.shape == (rot // 2,), where, f"inv_freq shape {inv.shape} != ({rot // 2},)")
        return [ins[0], ins[1]]
    if k == "attention":
        d = int(op.attrs["head_dim"])
        hq, hk = int(op.attrs["num_heads"]), int(op.attrs["num_kv_heads"])
        _expect(hq % hk == 0, where, f"num_heads {hq} not a multiple of num_kv_heads {hk}")
        for name, w, h in zip("qkv", ins, (hq, hk, hk)):
            _expect(w is None or w == h * d, where, f"{name} width {w} != {h}*{d}")
        return [hq * d]
    if k == "silu_mul":
        if len(ins) == 1:
            _expect(ins[0] is None or ins[0] % 2 == 0, where, f"fused width {ins[0]} is odd")
            return [None if ins[0] is None else ins[0] // 2]
        _expect(ins[0] is None or ins[1] is None or ins[0] == ins[1], where, f"widths {ins[0]} != {ins[1]}")
        return [ins[0]]
    if k == "add":
        _expect(ins[0] is None or ins[1] is None or ins[0] == ins[1], where, f"widths {ins[0]} != {ins[1]}")
        return [ins[0]]
    raise IRError(f"{where}: no width rule")  # pragma: no cover - OP_SPECS and this function agree
