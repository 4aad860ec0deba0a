"""Trace a Hugging Face causal LM with torch.export and lower the traced graph into the MGX IR.

Lowering is a symbolic walk over the exported ATen graph. Each node gets an abstract value:

- ``_Act``: an IR activation (a ``[tokens, features]`` value), with the view the model currently
  holds it in (``flat`` [B,S,F], ``bshd`` [B,S,H,D], ``bhsd`` [B,H,S,D], ``rep`` after GQA repeat);
- ``_Param``: a weight tensor;
- ``_Aux``: position, mask and rotary-table plumbing that the runtime derives itself (tagged
  ``cos``/``sin`` where it carries the rotary tables);
- a partial-pattern value (``_Partial``) while a block is being recognised: the steps of an
  RMSNorm, of rotate-half RoPE, of SiLU gating.

Each ATen op has a rule keyed on the kinds of its operands; an op with no rule stops the
compilation with a message naming the op, the module it came from and the model type.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from mgx.formats import ir

__all__ = ["LoweringError", "SUPPORTED_MODEL_TYPES", "lower_model", "trace_model"]

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class LoweringError(Exception):
    """The traced model holds something the IR cannot express; the message says what and where."""


@dataclass(slots=True)
class _Act:
    name: str  # IR value name
    layout: str  # flat | bshd | bhsd | bh1sd | bhnsd | rep
    roped: bool = False


@dataclass(slots=True)
class _Param:
    tensor: str  # source parameter name (fully qualified)


@dataclass(slots=True)
class _Aux:
    tag: str = ""  # "cos" / "sin" for rotary tables, "" for other plumbing


@dataclass(slots=True)
class _Partial:
    step: str  # sq | meansq | meansq_eps | invrms | costerm | half_lo | half_hi | neghalf | rothalf | sinterm | silu
    act: _Act
    info: dict[str, Any] = field(default_factory=dict)


_IDENTITY_OPS = {
    "aten.to.dtype",
    "aten.to.dtype_layout",
    "aten.to.device",
    "aten._to_copy.default",
    "aten.contiguous.default",
    "aten.clone.default",
    "aten.alias.default",
    "aten.dropout.default",
    "aten.detach.default",
    "aten.lift_fresh_copy.default",
}
_ASSERT_OPS = {"aten._assert_tensor_metadata.default", "aten._assert_scalar.default", "aten.sym_constrain_range_for_size.default"}


def trace_model(model: torch.nn.Module, seq_len: int = 8) -> torch.export.ExportedProgram:
    """Export ``model`` on a short dummy prompt (no KV cache) with torch.export."""
    vocab = int(model.config.vocab_size)
    ids = torch.arange(seq_len, dtype=torch.long).remainder(vocab).unsqueeze(0)
    with torch.no_grad():
        return torch.export.export(model, (), {"input_ids": ids, "use_cache": False}, strict=False)


def _target_name(node: torch.fx.Node) -> str:
    return str(node.target)


def _module_of(node: torch.fx.Node) -> tuple[str, str]:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "<top>", ""
    path, cls = list(stack.values())[-1]
    cls_name = cls if isinstance(cls, str) else getattr(cls, "__name__", str(cls))
    return path.removeprefix("L['self'].").removeprefix("L__self__."), cls_name.rsplit(".", 1)[-1]


def _shape(node: Any) -> tuple[int, ...] | None:
    if not isinstance(node, torch.fx.Node):
        return None
    val = node.meta.get("val")
    return tuple(int(d) for d in val.shape) if hasattr(val, "shape") else None


class _Lowering:
    """One walk over an exported program; builds the op list and collects the used weights."""

    def __init__(self, model: torch.nn.Module, program: torch.export.ExportedProgram):
        self.model = model
        self.config = model.config
        self.model_type = str(getattr(self.config, "model_type", "?"))
        self.program = program
        self.modules = dict(model.named_modules())
        self.ops: list[ir.Op] = []
        self.values: dict[torch.fx.Node, Any] = {}
        self.used_params: dict[str, str] = {}  # source param name -> IR tensor name
        self.counter = 0
        self.widths: dict[str, int] = {}  # IR value -> feature width
        self.hidden = int(self.config.hidden_size)
        self.lm_head_path = self._output_embeddings_path()
        self.rope: tuple[np.ndarray, float] | None = None  # (inv_freq, attention_scaling) once seen

    # -- helpers ---------------------------------------------------------------------------------

    def _output_embeddings_path(self) -> str:
        head = self.model.get_output_embeddings()
        for name, mod in self.modules.items():
            if mod is head:
                return name
        return "lm_head"

    def fail(self, node: torch.fx.Node, why: str) -> LoweringError:
        path, cls = _module_of(node)
        return LoweringError(
            f"cannot lower {_target_name(node)} (node {node.name}) in module {path or '<top>'}"
            f"{f' ({cls})' if cls else ''} of model type {self.model_type!r}: {why}"
        )

    def new_value(self, hint: str) -> str:
        self.counter += 1
        return f"{hint}.{self.counter}" if hint else f"v{self.counter}"

    def emit(self, node: torch.fx.Node, kind: str, inputs: list[str], weights: dict[str, str] | None = None,
             attrs: dict[str, Any] | None = None, n_out: int = 1) -> list[str]:
        path, _ = _module_of(node)
        outs = [self.new_value(path.removeprefix("model.") or kind) for _ in range(n_out)]
        op = ir.Op(kind, list(inputs), outs, dict(weights or {}), dict(attrs or {}), path)
        self.ops.append(op)
        for name, width in zip(outs, _output_widths(op, [self.widths.get(i, 0) for i in inputs], self.hidden)):
            self.widths[name] = width
        return outs

    def layer_index(self, path: str) -> int:
        """The decoder layer an attention module belongs to, from its module path."""
        idx = next((int(p) for p in reversed(path.split(".")) if p.isdigit()), None)
        if idx is None:
            raise LoweringError(f"model type {self.model_type!r}: cannot tell the layer of attention module {path}")
        return idx

    def rope_attrs(self, head_dim: int, num_heads: int, num_kv: int) -> dict[str, Any]:
        """RoPE attributes; the frequencies come from the model's rotary module (scaling applied)."""
        if self.rope is None:
            rotary = [m for m in self.modules.values() if isinstance(getattr(m, "inv_freq", None), torch.Tensor)]
            if len(rotary) != 1:
                raise LoweringError(
                    f"model type {self.model_type!r}: expected one rotary embedding module, found {len(rotary)}"
                )
            inv_freq = rotary[0].inv_freq.detach().to(torch.float32).cpu().numpy().copy()
            self.rope = (inv_freq, float(getattr(rotary[0], "attention_scaling", 1.0)))
        inv_freq, scaling = self.rope
        return {
            "head_dim": head_dim,
            "rotary_dim": 2 * len(inv_freq),
            "num_heads": num_heads,
            "num_kv_heads": num_kv,
            "attention_scaling": scaling,
        }

    def sliding_window(self, module: torch.nn.Module | None, layer: int) -> int:
        """The layer's attention window (0 = full), as the source model masks it."""
        if module is not None and hasattr(module, "sliding_window"):
            window = module.sliding_window
        else:
            layer_types = getattr(self.config, "layer_types", None)
            window = getattr(self.config, "sliding_window", None)
            if layer_types is not None and layer_types[layer] != "sliding_attention":
                window = None
        return int(window or 0)

    def param(self, av: _Param) -> str:
        self.used_params.setdefault(av.tensor, av.tensor)
        return av.tensor

    # -- the walk ------------------------------------------------------------------------------

    def run(self) -> list[str]:
        sig = self.program.graph_signature
        params = dict(sig.inputs_to_parameters)
        buffers = dict(sig.inputs_to_buffers)
        user_inputs = set(sig.user_inputs)
        outputs: list[str] = []
        for node in self.program.graph.nodes:
            if node.op == "placeholder":
                if node.name in params:
                    self.values[node] = _Param(params[node.name])
                elif node.name in buffers:
                    self.values[node] = _Aux("buffer")
                elif node.name == "input_ids" or (node.name in user_inputs and _shape(node) and len(_shape(node)) == 2):
                    self.values[node] = _Aux("tokens")
                else:
                    self.values[node] = _Aux()
            elif node.op == "call_function":
                self.values[node] = self.lower_node(node)
            elif node.op == "output":
                results = node.args[0]
                first = results[0] if isinstance(results, (tuple, list)) else results
                av = self.values.get(first)
                if not isinstance(av, _Act):
                    raise LoweringError(f"model type {self.model_type!r}: the traced output is not a lowered activation")
                outputs.append(av.name)
            elif node.op == "get_attr":
                self.values[node] = _Aux()
            else:
                raise self.fail(node, f"unexpected node kind {node.op}")
        return outputs

    def av(self, arg: Any) -> Any:
        if isinstance(arg, torch.fx.Node):
            return self.values[arg]
        return arg  # a Python constant

    def lower_node(self, node: torch.fx.Node) -> Any:
        target = _target_name(node)
        args = [self.av(a) for a in node.args]
        if target == "aten.cat.default":
            args[0] = [self.av(a) for a in node.args[0]]
        if target in _ASSERT_OPS:
            return _Aux()
        acts = [a for a in _flat(args) if isinstance(a, (_Act, _Partial))]
        if not acts:
            return self.lower_aux(node, target, args)
        handler = _RULES.get(target)
        if handler is None:
            raise self.fail(node, "no lowering rule for this op on activations")
        result = handler(self, node, args)
        if result is None:
            raise self.fail(node, "operands do not match any known block pattern")
        return result

    def lower_aux(self, node: torch.fx.Node, target: str, args: list[Any]) -> Any:
        """Ops on positions, masks, rotary tables and weights alone: the runtime derives these."""
        if target == "aten.embedding.default":
            weight, ids = args[0], args[1]
            if isinstance(weight, _Param) and isinstance(ids, _Aux) and ids.tag == "tokens":
                (out,) = self.emit(node, "embedding", ["tokens"], {"weight": self.param(weight)})
                return _Act(out, "flat")
            raise self.fail(node, "embedding of something other than the input token ids")
        if any(isinstance(a, _Param) for a in _flat(args)):
            raise self.fail(node, "a weight is transformed before use; the IR expects weights used as stored")
        if target == "aten.cos.default":
            return _Aux("cos")
        if target == "aten.sin.default":
            return _Aux("sin")
        tags = [a.tag for a in _flat(args) if isinstance(a, _Aux) and a.tag in ("cos", "sin")]
        return _Aux(tags[0] if tags else "")


def _output_widths(op: ir.Op, ins: list[int], hidden: int) -> list[int]:
    if op.kind in ("linear", "lm_head"):
        return [int(op.attrs["out_features"])]
    if op.kind == "embedding":
        return [hidden]
    if op.kind == "attention":
        return [int(op.attrs["num_heads"]) * int(op.attrs["head_dim"])]
    if op.kind == "rope":
        return ins[:2]
    return ins[:1]


def _flat(args: Any) -> list[Any]:
    out: list[Any] = []
    for a in args:
        if isinstance(a, (list, tuple)):
            out.extend(_flat(a))
        else:
            out.append(a)
    return out


# -- rules for ops that touch activations ------------------------------------------------------------


def _rule_identity(low: _Lowering, node: torch.fx.Node, args: list[Any]) -> Any:
    a = args[0]
    return a if isinstance(a, (_Act, _Partial)) else None


def _rule_view(low: _Lowering, node: torch.fx.Node, args: list[Any]) -> Any:
    a = args[0]
    if not isinstance(a, _Act):
        return None
    src, dst = _shape(node.args[0]), _shape(node)
    if src is None or dst is None:
        return None
    if src == dst:
        return a
    if a.layout == "flat" and len(src) == 3 and len(dst) == 4 and dst[:2] == src[:2] and dst[2] * dst[3] == src[2]:
        return _Act(a.name, "bshd", a.roped)
    if a.layout == "bshd" and len(dst) == 3 and dst[:2] == src[:2] and dst[2] == src[2] * src[3]:
        return _Act(a.name, "flat", a.roped)
    if a.layout == "bhnsd" and len(dst) == 4 and dst[1] == src[1] * src[2] and dst[2:] == src[3:]:
        return _Act(a.name, "rep", a.roped)
    return None


def _rule_transpose(low: _Lowering, node: torch.fx.Node, args: list[Any]) -> Any:
    a = args[0]
    dims = sorted(int(d) % 4 for d in args[1:3])
    if isinstance(a, _Act) and dims == [1, 2] and a.layout in ("bshd", "bhsd"):
        return _Act(a.name, "bhsd" if a.layout == "bshd" else "bshd", a.roped)
    return None


def _rule_unsqueeze(low: _Lowering, node: torch.fx.Node, args: list[Any]) -> Any:
    a = args[0]
    if isinstance(a, _Act) and a.layout == "bhsd" and int(args[1]) == 2:
        return _Act(a.name, "bh1sd", a.roped)
    return None


def _rule_expand(low: _Lowering, node: torch.fx.Node, args: list[Any]) -> Any:
    a = args[0]
    if isinstance(a, _Act) and a.layout == "bh1sd":
        return _Act(a.name, "bhnsd", a.roped)
    return None


def _rule_slice(low: _Lowering, node: torch.fx.Node, args: list[Any]) -> Any:
    a = args[0]
    if not isinstance(a, _Act):
        return None
    src = _shape(node.args[0])
    dim = int(args[1]) if len(args) > 1 else 0
    start = int(args[2]) if len(args) > 2 and args[2] is not None else 0
    end = int(args[3]) if len(args) > 3 and args[3] is not None else (1 << 62)
    if src is None:
        return None
    dim %= len(src)
    if start == 0 and end >= src[dim]:
        return a  # a full slice (logits_to_keep=0, say)
    if a.layout == "bhsd" and dim == 3:
        half = src[3] // 2
        if start == 0 and end == half:
            return _Partial("half_lo", a)
        if start == half and end >= src[3]:
            return _Partial("half_hi", a)
    return None


def _rule_pow(low: _Lowering, node: torch.fx.Node, args: list[Any]) -> Any:
    a = args[0]
    if isinstance(a, _Act) and args[1] == 2:
        return _Partial("sq", a)
    return None


def _rule_mean(low: _Lowering, node: torch.fx.Node, args: list[Any]) -> Any:
    a = args[0]
    dims = [int(d) for d in args[1]] if len(args) > 1 else []
    keep = bool(args[2]) if len(args) > 2 else bool(node.kwargs.get("keepdim", False))
    if isinstance(a, _Partial) and a.step == "sq" and dims == [-1] and keep:
        return _Partial("meansq", a.act, {"group": _shape(node.args[0])[-1]})
    return None


def _rule_rsqrt(low: _Lowering, node: torch.fx.Node, args: list[Any]) -> Any:
    a = args[0]
    if isinstance(a, _Partial) and a.step == "meansq_eps":
        return _Partial("invrms", a.act, a.info)
    return None


def _rule_neg(low: _Lowering, node: torch.fx.Node, args: list[Any]) -> Any:
    a = args[0]
    if isinstance(a, _Partial) and a.step == "half_hi":
        return _Partial("neghalf", a.act)
    return None


def _rule_cat(low: _Lowering, node: torch.fx.Node, args: list[Any]) -> Any:
    parts = args[0]
    dim = int(args[1]) if len(args) > 1 else 0
    if (
        len(parts) == 2
        and dim in (-1, 3)
        and isinstance(parts[0], _Partial)
        and isinstance(parts[1], _Partial)
        and parts[0].step == "neghalf"
        and parts[1].step == "half_lo"
        and parts[0].act == parts[1].act
    ):
        return _Partial("rothalf", parts[0].act)
    return None


def _rule_silu(low: _Lowering, node: torch.fx.Node, args: list[Any]) -> Any:
    a = args[0]
    if isinstance(a, _Act) and a.layout == "flat":
        return _Partial("silu", a)
    return None


def _rule_add(low: _Lowering, node: torch.fx.Node, args: list[Any]) -> Any:
    a, b = args[0], args[1]
    if isinstance(a, _Partial) and a.step == "meansq" and isinstance(b, (int, float)):
        return _Partial("meansq_eps", a.act, {**a.info, "eps": float(b)})
    if isinstance(a, _Partial) and isinstance(b, _Partial) and {a.step, b.step} == {"costerm", "sinterm"}:
        if a.act == b.act:
            return _Act(a.act.name, a.act.layout, roped=True)
        return None
    if isinstance(a, _Act) and isinstance(b, _Act) and a.layout == b.layout == "flat":
        (out,) = low.emit(node, "add", [a.name, b.name])
        return _Act(out, "flat")
    return None


def _rule_mul(low: _Lowering, node: torch.fx.Node, args: list[Any]) -> Any:
    a, b = args[0], args[1]
    for x, y in ((a, b), (b, a)):
        # RMSNorm: x * rsqrt(mean(x^2) + eps)
        if isinstance(x, _Act) and isinstance(y, _Partial) and y.step == "invrms" and y.act.name == x.name:
            (out,) = low.emit(node, "rms_norm", [x.name], attrs={"eps": y.info["eps"], "group": int(y.info["group"])})
            return _Act(out, x.layout)
        # RMSNorm weight: w * normalized
        if isinstance(x, _Param) and isinstance(y, _Act):
            op = low.ops[-1] if low.ops else None
            if op is not None and op.kind == "rms_norm" and op.outputs == [y.name] and "weight" not in op.weights:
                weight = low.model.get_parameter(x.tensor)
                if tuple(weight.shape) == (int(op.attrs["group"]),):
                    op.weights["weight"] = low.param(x)
                    return y
            return None
        # RoPE: q * cos, rotate_half(q) * sin
        if isinstance(x, _Act) and isinstance(y, _Aux) and y.tag == "cos" and x.layout == "bhsd":
            return _Partial("costerm", x)
        if isinstance(x, _Partial) and x.step == "rothalf" and isinstance(y, _Aux) and y.tag == "sin":
            return _Partial("sinterm", x.act)
        # SiLU gating: silu(gate) * up
        if isinstance(x, _Partial) and x.step == "silu" and isinstance(y, _Act) and y.layout == "flat":
            (out,) = low.emit(node, "silu_mul", [x.act.name, y.name])
            return _Act(out, "flat")
    return None


def _rule_linear(low: _Lowering, node: torch.fx.Node, args: list[Any]) -> Any:
    x, w = args[0], args[1]
    b = args[2] if len(args) > 2 else None
    if not (isinstance(x, _Act) and x.layout == "flat" and isinstance(w, _Param)):
        return None
    if b is not None and not isinstance(b, _Param):
        return None
    weight = low.model.get_parameter(w.tensor)
    n_out, n_in = (int(d) for d in weight.shape)
    weights = {"weight": low.param(w)}
    if b is not None:
        weights["bias"] = low.param(b)
    path, _ = _module_of(node)
    kind = "lm_head" if path == low.lm_head_path else "linear"
    (out,) = low.emit(node, kind, [x.name], weights, {"in_features": n_in, "out_features": n_out})
    return _Act(out, "flat")


def _rule_sdpa(low: _Lowering, node: torch.fx.Node, args: list[Any]) -> Any:
    q, k, v = args[0], args[1], args[2]
    if not (isinstance(q, _Act) and isinstance(k, _Act) and isinstance(v, _Act)):
        return None
    if not (q.roped and k.roped and not v.roped):
        raise low.fail(node, "attention without rotary position embedding on q and k")
    if q.layout != "bhsd" or k.layout not in ("bhsd", "rep") or v.layout not in ("bhsd", "rep"):
        return None
    kw = dict(node.kwargs)
    if len(node.args) > 4 and float(node.args[4]) != 0.0 or float(kw.get("dropout_p", 0.0)) != 0.0:
        raise low.fail(node, "attention dropout is not supported")
    q_shape = _shape(node.args[0])
    num_heads, head_dim = q_shape[1], q_shape[3]
    num_kv = low.widths[k.name] // head_dim
    scale = float(kw["scale"]) if kw.get("scale") is not None else 1.0 / math.sqrt(head_dim)
    path, _ = _module_of(node)
    layer = low.layer_index(path)
    attn_module = low.modules.get(path)
    rope_attrs = low.rope_attrs(head_dim, num_heads, num_kv)
    q_r, k_r = low.emit(node, "rope", [q.name, k.name], {"inv_freq": "rope.inv_freq"}, rope_attrs, n_out=2)
    (out,) = low.emit(
        node,
        "attention",
        [q_r, k_r, v.name],
        attrs={
            "layer": layer,
            "num_heads": num_heads,
            "num_kv_heads": num_kv,
            "head_dim": head_dim,
            "scale": scale,
            "sliding_window": low.sliding_window(attn_module, layer),
        },
    )
    return _Act(out, "bhsd")


_RULES = {
    "aten.linear.default": _rule_linear,
    "aten.view.default": _rule_view,
    "aten.reshape.default": _rule_view,
    "aten._unsafe_view.default": _rule_view,
    "aten.transpose.int": _rule_transpose,
    "aten.unsqueeze.default": _rule_unsqueeze,
    "aten.expand.default": _rule_expand,
    "aten.slice.Tensor": _rule_slice,
    "aten.pow.Tensor_Scalar": _rule_pow,
    "aten.mean.dim": _rule_mean,
    "aten.add.Tensor": _rule_add,
    "aten.rsqrt.default": _rule_rsqrt,
    "aten.mul.Tensor": _rule_mul,
    "aten.neg.default": _rule_neg,
    "aten.cat.default": _rule_cat,
    "aten.silu.default": _rule_silu,
    "aten.scaled_dot_product_attention.default": _rule_sdpa,
    **{name: _rule_identity for name in _IDENTITY_OPS},
}


# -- the entry point ----------------------------------------------------------------------------------


def lower_model(model: torch.nn.Module, program: torch.export.ExportedProgram | None = None) -> tuple[ir.Graph, dict[str, str]]:
    """Lower a traced HF causal LM into an ``ir.Graph`` whose tensors hold fp32 numpy copies.

    Returns the graph and the mapping from IR tensor names to the source parameter names.
    """
    config = model.config
    model_type = str(getattr(config, "model_type", "?"))
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise LoweringError(
            f"model type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if program is None:
        program = trace_model(model)
    low = _Lowering(model, program)
    outputs = low.run()
    if not any(op.kind == "lm_head" for op in low.ops):
        raise LoweringError(f"model type {model_type!r}: no LM head found in the traced graph")

    # Tensors: one per distinct storage, so tied embeddings are stored once, under the
    # embedding's name.
    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(_storage_key(p), []).append(name)
    tensors: dict[str, ir.Tensor] = {}
    rename: dict[str, str] = {}
    for src in low.used_params:
        p = model.get_parameter(src).detach()
        names = sorted(aliases.get(_storage_key(p), [src]), key=lambda n: (n.startswith(low.lm_head_path), n))
        name = names[0].removeprefix("model.")
        rename[src] = name
        if name not in tensors:
            arr = p.to(torch.float32).contiguous().numpy().copy()
            tensors[name] = ir.Tensor(name, ir.DType.F32, arr.shape, arr)
    if low.rope is not None:
        inv_freq, _ = low.rope
        tensors["rope.inv_freq"] = ir.Tensor("rope.inv_freq", ir.DType.F32, inv_freq.shape, inv_freq.astype(np.float32))
    for op in low.ops:
        op.weights = {role: rename.get(t, t) for role, t in op.weights.items()}
        op.source = op.source.removeprefix("model.") if op.source != "lm_head" else op.source

    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    attn_ops = [op for op in low.ops if op.kind == "attention"]
    states = [
        ir.StateSpec(int(op.attrs["layer"]), "kv", int(op.attrs["num_kv_heads"]), int(op.attrs["head_dim"]))
        for op in attn_ops
    ]
    graph = ir.Graph(
        arch=_arch_config(config, head_dim),
        ops=low.ops,
        tensors=tensors,
        states=states,
        inputs=["tokens"],
        outputs=outputs,
    )
    # Name the final output "logits" so every artifact reads the same.
    final = graph.ops[-1]
    if final.kind == "lm_head" and final.outputs == outputs:
        final.outputs = ["logits"]
        graph.outputs = ["logits"]
    ir.verify(graph)
    return graph, rename


def _storage_key(p: torch.Tensor) -> int:
    return p.untyped_storage().data_ptr() + p.storage_offset() * p.element_size()


def _arch_config(config: Any, head_dim: int) -> ir.ArchConfig:
    eos = getattr(config, "eos_token_id", None)
    eos_ids = [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if e is not None]
    extra: dict[str, Any] = {}
    for key in ("rope_scaling", "rope_parameters", "sliding_window", "layer_types", "attention_bias", "hidden_act"):
        value = getattr(config, key, None)
        if value is not None:
            extra[key] = value
    bos = getattr(config, "bos_token_id", None)
    pad = getattr(config, "pad_token_id", None)
    rope_theta = getattr(config, "rope_theta", None)
    if rope_theta is None:
        params = getattr(config, "rope_parameters", None) or {}
        rope_theta = params.get("rope_theta", 10000.0) if isinstance(params, dict) else 10000.0
    return ir.ArchConfig(
        model_type=str(config.model_type),
        vocab_size=int(config.vocab_size),
        hidden_size=int(config.hidden_size),
        num_layers=int(config.num_hidden_layers),
        num_heads=int(config.num_attention_heads),
        num_kv_heads=int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads),
        head_dim=head_dim,
        intermediate_size=int(config.intermediate_size),
        max_position=int(config.max_position_embeddings),
        rms_norm_eps=float(config.rms_norm_eps),
        rope_theta=float(rope_theta),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        bos_token_id=int(bos) if bos is not None else -1,
        eos_token_ids=eos_ids,
        pad_token_id=int(pad) if pad is not None else -1,
        extra=_jsonable(extra),
    )


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    return str(value)
