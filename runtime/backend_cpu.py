"""The CPU backend: the C++ kernels of ``mgx.kernels.cpu``, numpy for glue, nothing else (no torch).

Weights are read where the artifact maps them (``row_major`` or ``cpu_tile16``; see
``mgx.formats.layouts``): building the backend wraps each weight in a kernel handle and converts only
the small float vectors (norm weights, biases, ``inv_freq``) to float32. A weight in a layout written
for another target (``cuda_tile16``, ``sparse24_nibble_meta``: an artifact built for CUDA) is unpacked
to ``row_major`` in memory once, so that such an artifact runs here too. K/V live in a
``PagedKVCache`` of float32 (``MGX_CPU_KV_DTYPE=bf16`` or ``f16`` halves it); the attention kernel
writes each step's keys and values into their slots itself.

A step runs as a program built once from the graph: one closure per op that reads its inputs from
and writes its outputs to a list of value slots, calls the kernel's entry point directly (shapes
were checked when the program was built; the C side still checks memory safety), and drops the
values no later op reads. An ``add`` followed by the ``rms_norm`` of its output is one kernel
writing both values (results as if run one by one). The per-step metadata (positions, block
tables, the RoPE cos/sin table) is converted once per step for all layers. A decode step of SmolLM2 runs ~360 ops, so this Python layer is kept
to a few microseconds an op.

Threads: ``MGX_NUM_THREADS`` (``mgx-run --threads``) or ``mgx.kernels.cpu.set_num_threads``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import numpy as np

from mgx.formats import layouts
from mgx.formats.ir import Graph, Op, Tensor
from mgx.kernels import cpu
from mgx.kernels.reference.dtypes import to_f32

from .backend import Array, AttentionAttrs, Backend, value_plan
from .batch import StepBatch
from .errors import UnsupportedModelError
from .kv_cache import KVCache, PagedKVCache

__all__ = ["CPUBackend"]

_AUX_ROLES = ("scales", "zeros", "meta")
_CPU_LAYOUTS = ("row_major", "cpu_tile16")  # what the C++ kernels read in place


def _row_major(weight: Tensor, aux: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
    """A weight (and its companions) in another target's layout, unpacked to row_major copies."""
    roles = {"weight": weight, **aux}
    arrays = layouts.unpack(weight.layout, {r: t.data for r, t in roles.items()}, weight.scheme, weight.scheme_params)
    out = {r: replace(t, shape=arrays[r].shape, data=np.ascontiguousarray(arrays[r]), layout="row_major")
           for r, t in roles.items()}  # fmt: skip
    return out.pop("weight"), out


# MGX_CPU_KV_DTYPE -> (numpy storage dtype, stored as bf16 bit patterns)
_KV_DTYPES = {"f32": (np.float32, False), "bf16": (np.uint16, True), "f16": (np.float16, False)}


@dataclass(slots=True)
class _Norm:
    weight: np.ndarray | None  # float32 [group]
    eps: float
    group: int


@dataclass(slots=True)
class _Rope:
    inv_freq: np.ndarray  # float32 [rotary_dim / 2]
    head_dim: int
    rotary_dim: int
    scaling: float


class CPUBackend(Backend):
    """Runs a graph with the C++ CPU kernels (AVX-512, AVX2+FMA or scalar, chosen from CPUID)."""

    name: ClassVar[str] = "cpu"
    has_greedy_head: ClassVar[bool] = True

    def __init__(self, graph: Graph) -> None:
        super().__init__(graph)
        kv_name = os.environ.get("MGX_CPU_KV_DTYPE", "f32")
        if kv_name not in _KV_DTYPES:
            raise UnsupportedModelError(f"MGX_CPU_KV_DTYPE={kv_name!r}: expected one of {', '.join(_KV_DTYPES)}")
        self._kv_dtype, self._kv_bf16 = _KV_DTYPES[kv_name]
        self.kv_itemsize = np.dtype(self._kv_dtype).itemsize
        # Per op (by identity), what its kernel needs, prepared once.
        self._linear: dict[int, cpu.LinearWeight] = {}
        self._norm: dict[int, _Norm] = {}
        self._rope: dict[int, _Rope] = {}
        self._attention: dict[int, AttentionAttrs] = {}
        self._vectors: dict[str, np.ndarray] = {}  # tensor name -> float32 copy (norm weights, biases, inv_freq)
        handles: dict[tuple[str, str | None], cpu.LinearWeight] = {}  # a tied embedding / LM head shares one
        for op in graph.ops:
            if op.kind in ("linear", "lm_head", "embedding"):
                key = (op.weights["weight"], op.weights.get("bias"))
                if key not in handles:
                    handles[key] = self._weight_handle(op)
                self._linear[id(op)] = handles[key]
            elif op.kind == "rms_norm":
                w = op.weights.get("weight")
                self._norm[id(op)] = _Norm(
                    None if w is None else self._f32(w), float(op.attrs["eps"]), int(op.attrs["group"])
                )
            elif op.kind == "rope":
                a = op.attrs
                self._rope[id(op)] = _Rope(
                    self._f32(op.weights["inv_freq"]),
                    int(a["head_dim"]),
                    int(a["rotary_dim"]),
                    float(a["attention_scaling"]),
                )
            elif op.kind == "attention":
                self._attention[id(op)] = AttentionAttrs.of(op)
        self._fused_norm = _fusible_add_norms(graph)  # id(add op) -> the rms_norm op it computes too
        self._program, self._num_slots, self._output_slot = self._build_program()

    # -- the step program ---------------------------------------------------------------------------

    def execute(self, run_ops: Callable[[StepBatch], Array], batch: StepBatch, kv: KVCache) -> Any:
        values: list[Any] = [None] * self._num_slots
        values[0] = batch.token_ids
        step = _StepMeta(batch)
        for run in self._program:
            run(values, step, kv)
        return values[self._output_slot]

    def _build_program(self) -> tuple[list[Callable[[list[Any], _StepMeta, KVCache], None]], int, int]:
        plan, num_slots, output_slot = value_plan(self.graph)
        fused_into = {id(norm) for norm in self._fused_norm.values()}
        dead_of = {id(op): dead for op, _, _, dead in plan}
        out_of = {id(op): outs for op, _, outs, _ in plan}
        program = []
        for op, ins, outs, dead in plan:
            if id(op) in fused_into:
                continue  # computed by the add before it
            if op.kind == "add" and id(op) in self._fused_norm:
                norm = self._fused_norm[id(op)]
                program.append(self._add_norm_step(ins, outs[0], out_of[id(norm)][0], dead + dead_of[id(norm)], norm))
            else:
                program.append(self._op_step(op, ins, outs, dead))
        return program, num_slots, output_slot

    def _op_step(self, op: Op, ins: tuple[int, ...], outs: tuple[int, ...], dead: tuple[int, ...]) -> Callable:
        raw, f32, empty = cpu.raw, np.float32, np.empty
        o = outs[0]
        match op.kind:
            case "linear":
                (x_slot,) = ins
                w = self._linear[id(op)]
                h, n = w._handle, w.out_features

                def run(v: list[Any], step: _StepMeta, kv: KVCache) -> None:
                    x = v[x_slot]
                    out = v[o] = empty((x.shape[0], n), f32)
                    raw.linear(h, x, out)
                    for i in dead:
                        v[i] = None
            case "rms_norm":
                (x_slot,) = ins
                nm = self._norm[id(op)]
                weight, group, eps = nm.weight, nm.group, nm.eps

                def run(v: list[Any], step: _StepMeta, kv: KVCache) -> None:
                    x = v[x_slot]
                    out = v[o] = empty(x.shape, f32)
                    raw.rms_norm(x, None, weight, group, eps, None, out)
                    for i in dead:
                        v[i] = None
            case "split":
                (x_slot,) = ins
                bounds = list(zip(outs, np.cumsum([0, *op.attrs["sizes"]]).tolist(), np.cumsum(op.attrs["sizes"]).tolist()))

                def run(v: list[Any], step: _StepMeta, kv: KVCache) -> None:
                    x = v[x_slot]
                    for slot, a, b in bounds:
                        v[slot] = x[:, a:b]
                    for i in dead:
                        v[i] = None
            case "rope":
                q_slot, k_slot = ins
                ko = outs[1]
                r = self._rope[id(op)]
                d, rot = r.head_dim, r.rotary_dim

                def run(v: list[Any], step: _StepMeta, kv: KVCache) -> None:
                    cos, sin = step.rope_table(r)
                    for src, dst in ((q_slot, o), (k_slot, ko)):
                        x = v[src]
                        out = v[dst] = empty(x.shape, f32)
                        raw.rope(x, x.shape[1] // d, d, rot, cos, sin, out)
                    for i in dead:
                        v[i] = None
            case "attention":
                q_slot, k_slot, v_slot = ins
                a = self._attention[id(op)]
                cache_type = 1 if self._kv_bf16 else (2 if self._kv_dtype is np.float16 else 0)
                width = a.num_heads * a.head_dim

                def run(v: list[Any], step: _StepMeta, kv: KVCache) -> None:
                    q = v[q_slot]
                    out = v[o] = empty((q.shape[0], width), f32)
                    raw.attention(q, v[k_slot], v[v_slot], out, step.positions, step.query_start_loc,
                                  step.context_lens, step.block_tables, kv.k[a.layer], kv.v[a.layer], cache_type,
                                  a.num_heads, a.num_kv_heads, a.head_dim, a.scale, a.window)  # fmt: skip
                    for i in dead:
                        v[i] = None
            case "silu_mul" if len(ins) == 1:
                (x_slot,) = ins

                def run(v: list[Any], step: _StepMeta, kv: KVCache) -> None:
                    x = v[x_slot]
                    half = x.shape[1] // 2
                    out = v[o] = empty((x.shape[0], half), f32)
                    raw.silu_mul(x[:, :half], x[:, half:], out)
                    for i in dead:
                        v[i] = None
            case _:  # the rest (embedding, lm_head, add, two-input silu_mul): one call a step, or few

                def run(v: list[Any], step: _StepMeta, kv: KVCache) -> None:
                    for slot, value in zip(outs, self.run_op(op, [v[i] for i in ins], step.batch, kv)):
                        v[slot] = value
                    for i in dead:
                        v[i] = None
        return run

    def _add_norm_step(
        self, ins: tuple[int, ...], total_slot: int, norm_slot: int, dead: tuple[int, ...], norm: Op
    ) -> Callable:
        """An add and the rms_norm of its output in one kernel."""
        raw, f32, empty = cpu.raw, np.float32, np.empty
        a_slot, b_slot = ins
        nm = self._norm[id(norm)]
        weight, group, eps = nm.weight, nm.group, nm.eps

        def run(v: list[Any], step: _StepMeta, kv: KVCache) -> None:
            a = v[a_slot]
            total = v[total_slot] = empty(a.shape, f32)
            out = v[norm_slot] = empty(a.shape, f32)
            raw.rms_norm(a, v[b_slot], weight, group, eps, total, out)
            for i in dead:
                v[i] = None

        return run

    def new_kv_cache(self, num_blocks: int, block_size: int, num_state_slots: int = 0) -> KVCache:
        return PagedKVCache(self.graph.states, num_blocks, block_size, num_state_slots, self._kv_dtype)

    # -- weights --------------------------------------------------------------------------------

    def _weight_handle(self, op: Op) -> cpu.LinearWeight:
        tensors = self.graph.tensors
        weight = tensors[op.weights["weight"]]
        aux = {r: tensors[op.weights[r]] for r in _AUX_ROLES if r in op.weights}
        bias = self._f32(op.weights["bias"]) if "bias" in op.weights else None
        try:
            if weight.layout not in _CPU_LAYOUTS and weight.layout in layouts.LAYOUTS:
                weight, aux = _row_major(weight, aux)
            return cpu.LinearWeight(weight, aux, bias)
        except (cpu.CPUWeightError, ValueError) as exc:  # LayoutError is a ValueError
            raise UnsupportedModelError(f"{op.kind} from {op.source or '?'}: {exc}") from None

    def _f32(self, name: str) -> np.ndarray:
        """A small float tensor as contiguous float32 [n], converted once per tensor."""
        values = self._vectors.get(name)
        if values is None:
            t: Tensor = self.graph.tensors[name]
            if t.data is None:
                raise UnsupportedModelError(f"tensor {name} has no data")
            values = self._vectors[name] = np.ascontiguousarray(to_f32(t.data, t.dtype), dtype=np.float32).reshape(-1)
        return values

    # -- ops, one at a time (the step program fuses; these serve its generic case and run_op) ----

    def embedding(self, op: Op, tokens: np.ndarray) -> np.ndarray:
        return cpu.embedding(tokens, self._linear[id(op)])

    def rms_norm(self, op: Op, x: np.ndarray) -> np.ndarray:
        n = self._norm[id(op)]
        return cpu.rms_norm(x, n.weight, eps=n.eps, group=n.group)

    def linear(self, op: Op, x: np.ndarray) -> np.ndarray:
        return cpu.linear(x, self._linear[id(op)])

    def split(self, op: Op, x: np.ndarray) -> list[np.ndarray]:
        # Column views: the kernels read strided rows, so nothing is copied.
        out, start = [], 0
        for size in op.attrs["sizes"]:
            out.append(x[:, start : start + int(size)])
            start += int(size)
        return out

    def rope(self, op: Op, q: np.ndarray, k: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        r = self._rope[id(op)]
        cos, sin = cpu.rope_table(positions, r.inv_freq, r.scaling)
        return (
            cpu.rope(q, cos, sin, head_dim=r.head_dim, rotary_dim=r.rotary_dim),
            cpu.rope(k, cos, sin, head_dim=r.head_dim, rotary_dim=r.rotary_dim),
        )

    def attention(self, op: Op, q: np.ndarray, k: np.ndarray, v: np.ndarray, batch: StepBatch, kv: KVCache) -> np.ndarray:
        a = self._attention[id(op)]
        paged = batch.paged
        assert paged is not None, "the runner attaches the paged view before running ops"
        return cpu.paged_attention(
            q,
            k,
            v,
            kv.k[a.layer],
            kv.v[a.layer],
            batch.positions,
            paged.block_tables,
            paged.context_lens,
            paged.query_start_loc,
            num_heads=a.num_heads,
            num_kv_heads=a.num_kv_heads,
            head_dim=a.head_dim,
            scale=a.scale,
            sliding_window=a.window,
            bf16_cache=self._kv_bf16,
        )

    def silu_mul(self, op: Op, gate: np.ndarray, up: np.ndarray | None) -> np.ndarray:
        return cpu.silu_mul(gate, up)

    def add(self, op: Op, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return a + b

    def lm_head(self, op: Op, x: np.ndarray, rows: np.ndarray) -> np.ndarray:
        return cpu.linear(x[rows], self._linear[id(op)])

    def greedy_head(self, op: Op, x: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The LM head with a fused argmax: greedy token ids [R] and their logits [R], never the [R, V] logits."""
        return cpu.lm_head_argmax(x[rows], self._linear[id(op)])


class _StepMeta:
    """One step's metadata in the dtypes the kernels take, converted once for every layer."""

    __slots__ = ("batch", "positions", "query_start_loc", "context_lens", "block_tables", "_rope")

    def __init__(self, batch: StepBatch) -> None:
        paged = batch.paged
        assert paged is not None, "the runner attaches the paged view before running ops"
        self.batch = batch
        self.positions = np.ascontiguousarray(batch.positions, dtype=np.int64)
        self.query_start_loc = np.ascontiguousarray(paged.query_start_loc, dtype=np.int32)
        self.context_lens = np.ascontiguousarray(paged.context_lens, dtype=np.int32)
        self.block_tables = np.ascontiguousarray(paged.block_tables, dtype=np.int32)
        self._rope: dict[tuple[int, float], tuple[np.ndarray, np.ndarray]] = {}

    def rope_table(self, r: _Rope) -> tuple[np.ndarray, np.ndarray]:
        """cos/sin of this step's positions for ``r``'s frequencies, computed for the first layer only."""
        key = (id(r.inv_freq), r.scaling)
        table = self._rope.get(key)
        if table is None:
            table = self._rope[key] = cpu.rope_table(self.positions, r.inv_freq, r.scaling)
        return table


def _fusible_add_norms(graph: Graph) -> dict[int, Op]:
    """id(add) -> the rms_norm right after it that reads its output (it then runs in the add's kernel)."""
    fused = {}
    for op, nxt in zip(graph.ops, graph.ops[1:]):
        if op.kind == "add" and nxt.kind == "rms_norm" and nxt.inputs == op.outputs:
            fused[id(op)] = nxt
    return fused
