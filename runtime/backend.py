"""Backends execute IR ops for the model runner; they own weights, memory and kernels.

A backend implements one method per op kind. ``Backend.run_op`` is the dispatch table from op kind
to method, so the runner stays free of tensor code. Backends are registered by name in ``BACKENDS``
and imported only when chosen, so a host without a GPU never imports GPU libraries.

``ReferenceBackend`` runs the numpy reference kernels. Weight prep, reference backend only:
bf16/f16 weights stay as the artifact's mapped bytes until an op first needs them; they are then
upcast to float32 once and cached for the life of the backend (so it holds an f32 copy of every
weight it has used; f32 weights are used in place, without copying).
"""

from __future__ import annotations

import importlib
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from mgx.formats.ir import Graph, Op, Tensor
from mgx.formats.layouts import LAYOUTS
from mgx.kernels import reference as ref

from .batch import StepBatch
from .errors import UnsupportedModelError
from .kv_cache import KVCache, PagedKVCache, kv_bytes_per_block, state_bytes_per_slot

# The kinds of recorded steps a backend may keep (the CUDA backend's graphs): one sequence's prefill
# alone, decode steps, and steps of several sequences mixing both.
GRAPH_KINDS = ("decode", "prefill", "mixed")

__all__ = [
    "Array",
    "AttentionAttrs",
    "Backend",
    "ReferenceBackend",
    "StepResult",
    "BACKENDS",
    "create_backend",
    "host_memory_available",
    "value_plan",
]

# An activation value [T, F] as the backend holds it: numpy float32 for the reference backend,
# a device tensor for GPU backends. The runner never looks inside.
Array = Any

# The quantization-aware roles of linear-like ops, handed to the weight's dequantizer.
_AUX_ROLES = ("scales", "zeros", "meta")


@dataclass(frozen=True, slots=True)
class AttentionAttrs:
    """An ``attention`` op's attributes, typed once when a backend prepares the op."""

    layer: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    window: int  # sliding window; 0 = none

    @classmethod
    def of(cls, op: Op) -> AttentionAttrs:
        a = op.attrs
        return cls(
            int(a["layer"]),
            int(a["num_heads"]),
            int(a["num_kv_heads"]),
            int(a["head_dim"]),
            float(a["scale"]),
            int(a["sliding_window"]),
        )


class StepResult:
    """A launched step's output: ``result()`` is what ``Backend.execute`` returns for it.

    This one holds host arrays already. A backend that overlaps steps returns its own kind, whose
    ``result()`` waits for the device and whose ``device_ids()`` are the greedy picks still on it.
    """

    __slots__ = ("_out",)

    def __init__(self, out: Any) -> None:
        self._out = out

    def result(self) -> Any:
        return self._out

    def device_ids(self) -> Any:
        """The greedy ids [R] on the device (valid until the backend's next launch), or None."""
        return None

    def discard(self) -> None:
        """Nobody will read this output (a step launched ahead that the schedule did not take)."""


def picked(step: StepResult, rows: list[int] | None) -> np.ndarray:
    """The greedy ids of ``step`` on the host (int64; waits for it), all or those at ``rows``."""
    ids = np.asarray(step.result()[0], dtype=np.int64)
    return ids if rows is None else ids[rows]


class Backend(ABC):
    """Runs ops of one graph. Subclasses implement the per-kind methods below."""

    name: ClassVar[str]
    # Op kinds this backend runs; the runner refuses graphs with others before the first step.
    supported_ops: ClassVar[frozenset[str]] = frozenset(
        {"embedding", "rms_norm", "linear", "split", "rope", "attention", "silu_mul", "add", "lm_head"}
    )

    # True when greedy_head is implemented (an LM head fused with the argmax).
    has_greedy_head: ClassVar[bool] = False

    # True when ``launch`` returns before the step's output reaches the host, so that the engine
    # gains by launching the next greedy decode step before it reads this one's picks.
    overlaps_steps: bool = False

    # Bytes per element of cached K/V and recurrent state (the reference backend keeps float32).
    kv_itemsize: ClassVar[int] = 4

    def __init__(self, graph: Graph) -> None:
        self.graph = graph

    def use_tunings(self, autotune: dict[str, list[Any]]) -> str | None:
        """Take the artifact's stored kernel configurations (GPU arch -> entries); returns a line for
        the log, or None when this backend has nothing to tune."""
        return None

    def use_cuda_kernels(self, images: dict[str, bytes]) -> str | None:
        """Take the artifact's native GPU code (GPU arch -> cubin); returns a line for the log, or None
        when this backend runs no native GPU code."""
        return None

    def warm_batch_sizes(self, max_num_seqs: int) -> list[int]:
        """Batch sizes whose decode steps this backend records on first use (``Engine.warm_up`` runs
        them before serving); none here."""
        return []

    def warm_prompt_lengths(self, max_tokens_per_step: int) -> list[int]:
        """Prompt lengths whose prefill steps this backend records on first use (``Engine.warm_up``
        runs each twice before serving); none here."""
        return []

    def graph_stats(self) -> dict[str, dict[str, float]]:
        """Steps launched by path, graphs captured by kind and their host seconds, for backends that
        replay recorded steps (the CUDA backend's graphs); empty here."""
        return {}

    def drop_graphs(self, kinds: Iterable[str] = GRAPH_KINDS) -> None:
        """Forget the recorded steps of ``kinds`` (of ``GRAPH_KINDS``), to be recorded anew when next
        needed; never while a launched step is in flight. Nothing is recorded here."""
        return None

    def kv_bytes_per_block(self, block_size: int) -> int:
        """Bytes one KV block takes over all attention layers, in this backend's cache dtype."""
        return kv_bytes_per_block(self.graph.states, block_size, self.kv_itemsize)

    def state_bytes_per_slot(self) -> int:
        """Bytes one sequence's recurrent state takes over all recurrent layers."""
        return state_bytes_per_slot(self.graph.states, self.kv_itemsize)

    def memory_available(self) -> int:
        """Bytes this backend could still give the KV cache (host RAM here; device memory on a GPU)."""
        return host_memory_available()

    @abstractmethod
    def new_kv_cache(self, num_blocks: int, block_size: int, num_state_slots: int = 0) -> KVCache:
        """The paged K/V (and recurrent state) memory of this graph, in this backend's memory."""

    def execute(self, run_ops: Callable[[StepBatch], Array], batch: StepBatch, kv: KVCache) -> np.ndarray:
        """One step: ``run_ops`` runs the graph's ops in order through ``run_op`` and returns the
        logits value; a backend may prepare the step first or replay a recorded run instead.
        Returns host float32 logits [R, V]."""
        return run_ops(batch)

    def launch(
        self,
        run_ops: Callable[[StepBatch], Array],
        batch: StepBatch,
        kv: KVCache,
        tokens_from: StepResult | None = None,
        rows: list[int] | None = None,
    ) -> StepResult:
        """``execute``, returning before the output reaches the host where the backend can.

        ``tokens_from``: the greedy step launched just before this one, whose picks (one per
        sequence, in order; those at ``rows`` when given) are this step's token ids;
        ``batch.token_ids`` is a placeholder then. Here the step runs now, so those picks are read
        first."""
        if tokens_from is not None:
            batch.token_ids = picked(tokens_from, rows)
        return StepResult(self.execute(run_ops, batch, kv))

    def run_op(self, op: Op, args: list[Array], batch: StepBatch, kv: KVCache) -> list[Array]:
        """Run ``op`` on its input values; returns its output values in order."""
        match op.kind:
            case "embedding":
                return [self.embedding(op, args[0])]
            case "rms_norm":
                return [self.rms_norm(op, args[0])]
            case "linear":
                return [self.linear(op, args[0])]
            case "split":
                return self.split(op, args[0])
            case "rope":
                return list(self.rope(op, args[0], args[1], batch.positions))
            case "attention":
                return [self.attention(op, args[0], args[1], args[2], batch, kv)]
            case "silu_mul":
                return [self.silu_mul(op, args[0], args[1] if len(args) > 1 else None)]
            case "add":
                return [self.add(op, args[0], args[1])]
            case "lm_head":
                if batch.greedy:
                    return [self.greedy_head(op, args[0], batch.sample_rows)]
                return [self.lm_head(op, args[0], batch.sample_rows)]
        raise UnsupportedModelError(f"backend {self.name!r} has no kernel for op kind {op.kind!r}")

    @abstractmethod
    def embedding(self, op: Op, tokens: np.ndarray) -> Array:
        """tokens [T] int64 -> [T, H]."""

    @abstractmethod
    def rms_norm(self, op: Op, x: Array) -> Array:
        """x [T, F] -> [T, F]."""

    @abstractmethod
    def linear(self, op: Op, x: Array) -> Array:
        """x [T, K] -> [T, N], reading the weight according to its scheme."""

    @abstractmethod
    def split(self, op: Op, x: Array) -> list[Array]:
        """x [T, sum(sizes)] -> [T, size] per size."""

    @abstractmethod
    def rope(self, op: Op, q: Array, k: Array, positions: np.ndarray) -> tuple[Array, Array]:
        """q [T, Hq*D], k [T, Hk*D] rotated at positions [T]."""

    @abstractmethod
    def attention(self, op: Op, q: Array, k: Array, v: Array, batch: StepBatch, kv: KVCache) -> Array:
        """Write k, v [T, Hk*D] to their slots, attend q [T, Hq*D] over each sequence's cache -> [T, Hq*D].

        Block tables, context lengths and slots come from ``batch.paged`` (the contract is documented
        on ``PagedStep``); the layer's caches are ``kv.k[layer]`` and ``kv.v[layer]``.
        """

    @abstractmethod
    def silu_mul(self, op: Op, gate: Array, up: Array | None) -> Array:
        """silu(gate) * up -> [T, F]."""

    @abstractmethod
    def add(self, op: Op, a: Array, b: Array) -> Array:
        """a + b."""

    @abstractmethod
    def lm_head(self, op: Op, x: Array, rows: np.ndarray) -> np.ndarray:
        """Logits for ``rows`` [R] of x [T, H] only -> host float32 [R, V]."""

    def greedy_head(self, op: Op, x: Array, rows: np.ndarray) -> tuple[Array, Array]:
        """The LM head fused with the argmax for ``rows`` [R]: (ids [R], their logits [R]), first id
        of equal maxima; only called when ``has_greedy_head``."""
        raise NotImplementedError(f"backend {self.name!r} has no fused greedy LM head")


class ReferenceBackend(Backend):
    """The numpy oracle: float32 compute on the host, paged attention one sequence at a time."""

    name = "reference"

    def __init__(self, graph: Graph) -> None:
        super().__init__(graph)
        self._f32: dict[str, np.ndarray] = {}  # tensor name -> float32 values, filled on first use
        for op in graph.ops:
            for role, tname in op.weights.items():
                if role not in _AUX_ROLES:
                    self._check_weight(op, graph.tensors[tname])

    def new_kv_cache(self, num_blocks: int, block_size: int, num_state_slots: int = 0) -> KVCache:
        return PagedKVCache(self.graph.states, num_blocks, block_size, num_state_slots, np.float32)

    # -- weights ------------------------------------------------------------------------------

    def _check_weight(self, op: Op, t: Tensor) -> None:
        # Any registered layout that holds the scheme is read by unpacking it to row-major first.
        layout = LAYOUTS.get(t.layout)
        if t.scheme not in ref.SCHEMES or layout is None or t.scheme not in layout.schemes:
            raise UnsupportedModelError(
                f"{op.kind} from {op.source or '?'}: weight {t.name} uses scheme {t.scheme!r}, layout "
                f"{t.layout!r}; the reference backend knows schemes {', '.join(sorted(ref.SCHEMES))} "
                f"in layouts {', '.join(sorted(LAYOUTS))} (each for the schemes it holds)"
            )

    def _weight(self, op: Op, role: str) -> np.ndarray | None:
        """Float32 values of the op's ``role`` weight (None when it has none), upcast once and cached."""
        name = op.weights.get(role)
        if name is None:
            return None
        values = self._f32.get(name)
        if values is None:
            tensors = self.graph.tensors
            aux = {r: tensors[op.weights[r]] for r in _AUX_ROLES if r in op.weights}
            values = self._f32[name] = ref.dequantize(tensors[name], aux)
        return values

    # -- ops ----------------------------------------------------------------------------------

    def embedding(self, op: Op, tokens: np.ndarray) -> np.ndarray:
        return ref.embedding(tokens, self._weight(op, "weight"))

    def rms_norm(self, op: Op, x: np.ndarray) -> np.ndarray:
        return ref.rms_norm(
            x, self._weight(op, "weight"), eps=float(op.attrs["eps"]), group=int(op.attrs["group"])
        )

    def linear(self, op: Op, x: np.ndarray) -> np.ndarray:
        return ref.linear(x, self._weight(op, "weight"), self._weight(op, "bias"))

    def split(self, op: Op, x: np.ndarray) -> list[np.ndarray]:
        return ref.split(x, [int(s) for s in op.attrs["sizes"]])

    def rope(
        self, op: Op, q: np.ndarray, k: np.ndarray, positions: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        a = op.attrs
        return ref.rope(
            q,
            k,
            positions,
            self._weight(op, "inv_freq"),
            head_dim=int(a["head_dim"]),
            rotary_dim=int(a["rotary_dim"]),
            attention_scaling=float(a["attention_scaling"]),
        )

    def attention(
        self, op: Op, q: np.ndarray, k: np.ndarray, v: np.ndarray, batch: StepBatch, kv: KVCache
    ) -> np.ndarray:
        a = op.attrs
        layer = int(a["layer"])
        paged = batch.paged
        assert paged is not None, "the runner attaches the paged view before running ops"
        return ref.paged_attention(
            q,
            k,
            v,
            kv.k[layer],
            kv.v[layer],
            batch.positions,
            paged.block_tables,
            paged.context_lens,
            paged.query_start_loc,
            num_heads=int(a["num_heads"]),
            num_kv_heads=int(a["num_kv_heads"]),
            head_dim=int(a["head_dim"]),
            scale=float(a["scale"]),
            sliding_window=int(a["sliding_window"]),
        )

    def silu_mul(self, op: Op, gate: np.ndarray, up: np.ndarray | None) -> np.ndarray:
        return ref.silu_mul(gate, up)

    def add(self, op: Op, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return ref.add(a, b)

    def lm_head(self, op: Op, x: np.ndarray, rows: np.ndarray) -> np.ndarray:
        return ref.linear(x[rows], self._weight(op, "weight"), self._weight(op, "bias"))


def host_memory_available() -> int:
    """Bytes of host RAM available now (MemAvailable on Linux; free pages elsewhere)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


# Backend name -> "module:Class", imported on first use.
BACKENDS: dict[str, str] = {
    "reference": "mgx.runtime.backend:ReferenceBackend",
    "cpu": "mgx.runtime.backend_cpu:CPUBackend",
    "cuda": "mgx.runtime.backend_cuda:CUDABackend",
}


def create_backend(name: str, graph: Graph) -> Backend:
    """Import the backend registered as ``name`` and build it for ``graph``."""
    target = BACKENDS.get(name)
    if target is None:
        raise UnsupportedModelError(f"unknown backend {name!r}; known: {', '.join(sorted(BACKENDS))}")
    module, _, cls_name = target.partition(":")
    try:
        cls = getattr(importlib.import_module(module), cls_name)
    except ImportError as e:
        raise UnsupportedModelError(
            f"backend {name!r} cannot load on this host: {e} (the cuda backend needs torch and triton; "
            f"the cpu backend needs the package built with its C++ kernels)"
        ) from None
    return cls(graph)


def value_plan(graph: Graph) -> tuple[list[tuple[Op, tuple[int, ...], tuple[int, ...], tuple[int, ...]]], int, int]:
    """The op loop's bookkeeping: each op with its input, output and freed value slots; the slot count and the output's slot.

    Slot 0 is the graph's input. A value is freed right after the op that reads it last (or that
    produces it, when nothing reads it), except the graph's output.
    """
    slots = {graph.inputs[0]: 0}
    for op in graph.ops:
        for name in op.outputs:
            slots.setdefault(name, len(slots))
    last: dict[str, int] = {}
    for i, op in enumerate(graph.ops):
        for name in op.inputs:
            last[name] = i
        for name in op.outputs:
            last.setdefault(name, i)  # produced but never read: free right away
    dead: list[list[int]] = [[] for _ in graph.ops]
    keep = set(graph.outputs)
    for name, i in last.items():
        if name not in keep:
            dead[i].append(slots[name])
    plan = [
        (op, tuple(slots[n] for n in op.inputs), tuple(slots[n] for n in op.outputs), tuple(d))
        for op, d in zip(graph.ops, dead, strict=True)
    ]
    return plan, len(slots), slots[graph.outputs[0]]
