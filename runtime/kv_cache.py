"""Per-sequence, per-layer key/value storage for attention.

``KVCache`` is the interface the runner and backends use; ``ContiguousKVCache`` keeps one growing
host array per (sequence, layer). A paged cache (blocks handed out by a block manager) implements
the same interface, and a device backend returns its own from ``Backend.new_kv_cache``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from mgx.formats.ir import StateSpec

__all__ = ["KVCache", "KVCacheError", "ContiguousKVCache"]


class KVCacheError(RuntimeError):
    """The cache was used against its contract (a caller bug, not a user error)."""


class KVCache(ABC):
    """K/V of every attention layer, for every live sequence. Keys are stored after RoPE."""

    def __init__(self, states: list[StateSpec]) -> None:
        kv = [s for s in states if s.kind == "kv"]
        self.widths: dict[int, int] = {s.layer: s.num_kv_heads * s.head_dim for s in kv}  # layer -> Hk*D
        self.first_layer: int | None = min(self.widths) if self.widths else None

    @abstractmethod
    def append(self, seq_id: int, layer: int, k: np.ndarray, v: np.ndarray, positions: np.ndarray) -> None:
        """Store k, v [n, Hk*D] of ``layer`` for the tokens at ``positions`` [n] of ``seq_id``."""

    @abstractmethod
    def read(self, seq_id: int, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """All cached k, v [S, Hk*D] of ``layer``, key j being at position j."""

    @abstractmethod
    def length(self, seq_id: int) -> int:
        """Tokens cached for ``seq_id`` (0 for a sequence the cache has not seen)."""

    @abstractmethod
    def free(self, seq_id: int) -> None:
        """Forget ``seq_id`` and release its memory; unknown ids are ignored."""

    @abstractmethod
    def nbytes(self) -> int:
        """Bytes held for K/V now."""


@dataclass(slots=True)
class _LayerKV:
    k: np.ndarray  # [capacity, Hk*D] float32
    v: np.ndarray  # [capacity, Hk*D] float32
    n: int = 0  # rows in use


class ContiguousKVCache(KVCache):
    """One float32 array per (sequence, layer), grown by doubling; appends are amortised O(1)."""

    def __init__(self, states: list[StateSpec], initial_capacity: int = 64) -> None:
        super().__init__(states)
        self._initial = initial_capacity
        self._seqs: dict[int, dict[int, _LayerKV]] = {}

    def append(self, seq_id: int, layer: int, k: np.ndarray, v: np.ndarray, positions: np.ndarray) -> None:
        width = self.widths.get(layer)
        if width is None:
            raise KVCacheError(f"layer {layer} declares no kv state")
        layers = self._seqs.setdefault(seq_id, {})
        buf = layers.get(layer)
        n = k.shape[0]
        if buf is None:
            cap = max(self._initial, n)
            buf = layers[layer] = _LayerKV(
                np.empty((cap, width), np.float32), np.empty((cap, width), np.float32)
            )
        # A contiguous cache can only extend a sequence at its end.
        if n and (positions[0] != buf.n or positions[-1] != buf.n + n - 1):
            raise KVCacheError(
                f"sequence {seq_id} layer {layer}: positions {positions[0]}..{positions[-1]} do not "
                f"continue the {buf.n} cached tokens"
            )
        if buf.n + n > buf.k.shape[0]:
            cap = max(2 * buf.k.shape[0], buf.n + n)
            for name in ("k", "v"):
                grown = np.empty((cap, width), np.float32)
                grown[: buf.n] = getattr(buf, name)[: buf.n]
                setattr(buf, name, grown)
        buf.k[buf.n : buf.n + n] = k
        buf.v[buf.n : buf.n + n] = v
        buf.n += n

    def read(self, seq_id: int, layer: int) -> tuple[np.ndarray, np.ndarray]:
        try:
            buf = self._seqs[seq_id][layer]
        except KeyError:
            raise KVCacheError(f"sequence {seq_id} has nothing cached for layer {layer}") from None
        return buf.k[: buf.n], buf.v[: buf.n]

    def length(self, seq_id: int) -> int:
        layers = self._seqs.get(seq_id)
        if not layers or self.first_layer not in layers:
            return 0
        return layers[self.first_layer].n

    def free(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)

    def nbytes(self) -> int:
        return sum(b.k.nbytes + b.v.nbytes for layers in self._seqs.values() for b in layers.values())
