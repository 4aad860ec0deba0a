"""Runs the graph for one step over a batch of sequences packed along tokens."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from mgx.formats.ir import Graph, IRError, verify

from .backend import Backend, create_backend
from .batch import SeqChunk, StepBatch
from .errors import UnsupportedModelError

__all__ = ["ModelRunner"]


class ModelRunner:
    """Executes ``graph`` op by op on a backend and keeps the sequences' K/V between steps.

    The runner knows no policy: callers say which sequences run and with which tokens
    (``SeqChunk``); it returns each sequence's logits and never samples.
    """

    def __init__(self, graph: Graph, backend: Backend | str = "reference") -> None:
        try:
            verify(graph)
        except IRError as e:
            raise UnsupportedModelError(f"the model's graph is invalid: {e}") from None
        if len(graph.inputs) != 1 or len(graph.outputs) != 1:
            raise UnsupportedModelError(
                f"expected one input (token ids) and one output (logits), got {graph.inputs} -> {graph.outputs}"
            )
        other_states = sorted({s.kind for s in graph.states} - {"kv"})
        if other_states:
            raise UnsupportedModelError(f"state kinds {other_states} are not supported yet (only 'kv')")
        self.graph = graph
        self.backend = create_backend(backend, graph) if isinstance(backend, str) else backend
        for op in graph.ops:
            if op.kind not in self.backend.supported_ops:
                raise UnsupportedModelError(
                    f"backend {self.backend.name!r} cannot run op {op.kind!r} (from {op.source or '?'})"
                )
        self.kv = self.backend.new_kv_cache()
        self._dead_after = _last_uses(graph)

    def step(self, chunks: Sequence[SeqChunk]) -> list[np.ndarray]:
        """Run one step; returns, per chunk, its logits [R_i, V] (R_i = 1 unless ``all_logits``)."""
        batch = StepBatch.pack(chunks, [self.kv.length(c.seq_id) for c in chunks])
        self._check_positions(batch)
        values = {self.graph.inputs[0]: batch.token_ids}
        for op, dead in zip(self.graph.ops, self._dead_after, strict=True):
            outs = self.backend.run_op(op, [values[name] for name in op.inputs], batch, self.kv)
            values.update(zip(op.outputs, outs, strict=True))
            for name in dead:
                del values[name]
        logits = values[self.graph.outputs[0]]  # [R, V]
        return [logits[batch.sampled(i)] for i in range(len(chunks))]

    def length(self, seq_id: int) -> int:
        """Tokens cached for ``seq_id``."""
        return self.kv.length(seq_id)

    def free(self, seq_id: int) -> None:
        """Drop a finished sequence's state."""
        self.kv.free(seq_id)

    def _check_positions(self, batch: StepBatch) -> None:
        # Checked before any op runs, so a bad step leaves every cache as it was.
        vocab = self.graph.arch.vocab_size
        ids = batch.token_ids
        if ids.size and (ids.min() < 0 or ids.max() >= vocab):
            raise ValueError(f"token ids must be in [0, {vocab}), got {int(ids.min())}..{int(ids.max())}")
        for i, seq_id in enumerate(batch.seq_ids):
            pos = batch.positions[batch.rows(i)]
            start = self.kv.length(seq_id)
            if pos[0] != start or np.any(np.diff(pos) != 1):
                raise ValueError(
                    f"sequence {seq_id}: new tokens must take positions {start}, {start + 1}, ...; "
                    f"got {pos[:4].tolist()}..."
                )


def _last_uses(graph: Graph) -> list[list[str]]:
    """For each op, the values no later op reads, so a step frees activations as it goes."""
    last: dict[str, int] = {}
    for i, op in enumerate(graph.ops):
        for name in op.inputs:
            last[name] = i
        for name in op.outputs:
            last.setdefault(name, i)  # produced but never read: free right away
    dead: list[list[str]] = [[] for _ in graph.ops]
    keep = set(graph.outputs)
    for name, i in last.items():
        if name not in keep:
            dead[i].append(name)
    return dead
