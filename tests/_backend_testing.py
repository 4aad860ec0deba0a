"""Tiny graphs in every weight pipeline and a batched greedy run: what the backend tests compare."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np

from mgx.formats import ir
from mgx.passes import PASSES, PassContext
from mgx.runtime.batch import SeqChunk
from mgx.runtime.model_runner import ModelRunner

from _tiny_graph import build_tiny_graph

MODELS: dict[str, dict[str, Any]] = {
    "gqa": {},
    "qk-norm-bias-fused": {"qk_norm": True, "attention_bias": True, "fused": True},
    "window-partial-rotary": {"sliding_window": 6, "rotary_dim": 4, "num_kv_heads": 3},
    "tied-bf16": {"tie_word_embeddings": True, "dtype": ir.DType.BF16},
    # Widths of multiples of 128 (and rows of 16): the shapes the cuda_tile16 layout and the imma GEMVs take.
    "wide-fused": {"hidden_size": 128, "num_heads": 4, "num_kv_heads": 2, "head_dim": 32, "intermediate_size": 256,
                   "vocab_size": 96, "fused": True},
}
PIPELINES: dict[str, list[Any]] = {
    "dense": [],
    "dense-tiled": ["reorder_weights"],
    "dense-fused": ["fuse_qkv", "fuse_gate_up"],
    "w8a16-tiled": ["fuse_qkv", "fuse_gate_up", "quantize_w8a16", "reorder_weights"],
    "w8a16-tied-tiled": ["quantize_w8a16", ("reorder_weights", {"skip": {"embedding": False}})],
    "int4-rowmajor": [("quantize_int4", {"group_size": 32, "symmetric": True})],
    "int4-tiled": [("quantize_int4", {"group_size": 32}), "reorder_weights"],
    "int4-g128-tiled": ["fuse_qkv", "fuse_gate_up", ("quantize_int4", {"group_size": 128}), "reorder_weights"],
    "sparse24-tiled": ["sparsify_2_4", "reorder_weights"],
    "sparse24-int4-tiled": ["sparsify_2_4", ("quantize_int4", {"group_size": 32}), "reorder_weights"],
}


def compiled(model: str, pipeline: str, target: str = "cpu") -> ir.Graph:
    """The tiny graph ``model`` after the passes of ``pipeline`` (built for ``target``)."""
    graph, _ = build_tiny_graph(**MODELS[model])
    graph = copy.deepcopy(graph)
    for p in PIPELINES[pipeline]:
        name, options = (p, {}) if isinstance(p, str) else p
        PASSES[name](graph, dict(options), PassContext(target=target))
        ir.verify(graph)
    return graph


def greedy_run(runner: ModelRunner, prompts: list[np.ndarray], steps: int) -> tuple[list[list[int]], list[np.ndarray]]:
    """Prefill the first prompt whole and the second in two chunks (its second chunk rides with the
    first sequence's first decode), then decode both together; greedy on the runner's own logits."""
    a, b = prompts
    tokens: list[list[int]] = [[], []]
    logits: list[np.ndarray] = []
    (la, _) = runner.step([SeqChunk(0, a), SeqChunk(1, b[:5], sample=False)])
    tokens[0].append(int(np.argmax(la[-1])))
    (la, lb) = runner.step([SeqChunk(0, tokens[0][-1:]), SeqChunk(1, b[5:], all_logits=True)])
    logits += [la, lb]
    tokens[0].append(int(np.argmax(la[-1])))
    tokens[1].append(int(np.argmax(lb[-1])))
    for _ in range(steps):
        (la, lb) = runner.step([SeqChunk(0, tokens[0][-1:]), SeqChunk(1, tokens[1][-1:])])
        logits += [la, lb]
        tokens[0].append(int(np.argmax(la[-1])))
        tokens[1].append(int(np.argmax(lb[-1])))
    return tokens, logits
