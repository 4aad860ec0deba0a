"""Helpers for pass tests: run a pass with the IR verifier after it, compare logits through the
runtime's reference path, and collect calibration statistics the way the compiler does."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np

from mgx.formats import ir
from mgx.passes import PASSES, PassContext, PassResult

# A prompt that reaches every vocabulary row of _tiny_graph's default vocab (61) or more.
PROMPT = np.array([3, 14, 15, 9, 26, 5, 35, 8, 9, 7, 9, 3, 2, 38, 4, 6, 43, 38, 32, 7, 9, 50, 28, 8])


def run_pass(graph: ir.Graph, name: str, options: dict[str, Any] | None = None,
             context: PassContext | None = None) -> PassResult:
    """Run pass ``name`` on ``graph`` in place, then the IR verifier."""
    result = PASSES[name](graph, dict(options or {}), context or PassContext())
    ir.verify(graph)
    return result


def after(graph: ir.Graph, *passes: str | tuple[str, dict[str, Any]], context: PassContext | None = None,
          ) -> tuple[ir.Graph, list[PassResult]]:
    """A copy of ``graph`` after ``passes`` (names, or (name, options) pairs)."""
    graph = copy.deepcopy(graph)
    results = []
    for p in passes:
        name, options = (p, {}) if isinstance(p, str) else p
        results.append(run_pass(graph, name, options, context))
    return graph, results


def logits(graph: ir.Graph, ids: np.ndarray = PROMPT) -> np.ndarray:
    """Logits of every prompt position [T, V], through the runtime's reference backend."""
    from mgx.runtime.batch import SeqChunk
    from mgx.runtime.model_runner import ModelRunner

    (out,) = ModelRunner(graph).step([SeqChunk(0, ids, all_logits=True)])
    return out


def rel_error(got: np.ndarray, want: np.ndarray) -> float:
    """||got - want|| / ||want||."""
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def hessians(graph: ir.Graph, n_tokens: int = 96, seed: int = 1) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Calibration statistics of ``graph`` on random tokens, as ``PassContext.hessians`` holds them
    (mean x x^T per value read by a linear or lm_head), and the activations themselves ([T, K] per value)."""
    from mgx.runtime.backend import ReferenceBackend
    from mgx.runtime.batch import SeqChunk
    from mgx.runtime.model_runner import ModelRunner

    seen: dict[str, np.ndarray] = {}

    class Recording(ReferenceBackend):
        def linear(self, op: ir.Op, x: np.ndarray) -> np.ndarray:
            seen.setdefault(op.inputs[0], x.copy())
            return super().linear(op, x)

        def lm_head(self, op: ir.Op, x: np.ndarray, rows: np.ndarray) -> np.ndarray:
            seen.setdefault(op.inputs[0], x.copy())
            return super().lm_head(op, x, rows)

    ids = np.random.default_rng(seed).integers(0, graph.arch.vocab_size, n_tokens)
    ModelRunner(graph, Recording(graph)).step([SeqChunk(0, ids)])
    stats = {v: (x.astype(np.float64).T @ x.astype(np.float64)) / len(x) for v, x in seen.items()}
    return stats, seen


def contract_dense(graph: ir.Graph, op: ir.Op) -> np.ndarray:
    """The dense [N, K] weight of ``op``, decoded element by element as formats/README.md words it
    ("Weight schemes and layouts"), independently of the passes' and the kernels' decoders."""
    t = graph.tensors[op.weights["weight"]]
    aux = {r: graph.tensors[op.weights[r]].data for r in ("scales", "zeros", "meta") if r in op.weights}
    return plain_dequant(t.scheme, t.data, aux, t.scheme_params, t.dtype)


def _floats(data: np.ndarray, dtype: ir.DType) -> np.ndarray:
    if dtype == ir.DType.BF16:
        return (data.astype(np.uint32) << 16).view(np.float32)
    return data.astype(np.float32)


def plain_dequant(scheme: str, w: np.ndarray, aux: dict[str, np.ndarray], params: dict[str, Any],
                  dtype: ir.DType = ir.DType.F32) -> np.ndarray:
    """Contract decoder on plain arrays, written as loops for clarity (fine for tiny shapes)."""
    if scheme == "none":
        return _floats(w, dtype)
    if scheme == "w8a16":
        return w.astype(np.float32) * aux["scales"][:, None]

    def int4(packed: np.ndarray, k: int) -> np.ndarray:
        g, sym = int(params["group_size"]), bool(params["symmetric"])
        out = np.zeros((packed.shape[0], k), np.float32)
        for n in range(packed.shape[0]):
            for col in range(k):
                byte = int(packed[n, col // 2])
                q = (byte >> 4) if col % 2 else (byte & 0x0F)  # low nibble first
                z = 8 if sym else int(aux["zeros"][n, col // g])
                out[n, col] = np.float32(q - z) * aux["scales"][n, col // g]
        return out

    def expand(values: np.ndarray, k: int) -> np.ndarray:
        out = np.zeros((values.shape[0], k), np.float32)
        for n in range(values.shape[0]):
            for j in range(k // 4):
                m = int(aux["meta"][n, j])
                first, second = m & 3, (m >> 2) & 3
                assert first < second, "meta holds the smaller index in bits 0-1"
                out[n, 4 * j + first] = values[n, 2 * j]
                out[n, 4 * j + second] = values[n, 2 * j + 1]
        return out

    k = int(params["cols"])
    if scheme == "int4":
        return int4(w, k)
    if scheme == "sparse24":
        return expand(_floats(w, dtype), k)
    if scheme == "sparse24_int4":
        return expand(int4(w, k // 2), k)
    raise ValueError(scheme)
