"""Where K/V and recurrent state live: fixed-size blocks shared by all sequences.

The layout every backend and kernel uses (the paged-attention contract, ``batch.PagedStep``):

- per attention layer ``k[layer]`` and ``v[layer]`` are ``[num_blocks, block_size, num_kv_heads, head_dim]``
  (float32 on the reference backend). Keys are stored after RoPE.
- per recurrent (linear-attention) layer ``state[layer]`` is ``[num_state_slots, *shape]``, one slot per
  running sequence.

Which block or slot belongs to which sequence is the block manager's business (plain Python); a
backend only owns the memory. ``PagedKVCache`` is the host (numpy) implementation; a device backend
returns its own ``KVCache`` from ``Backend.new_kv_cache``.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any

import numpy as np

from mgx.formats.ir import StateSpec

__all__ = ["KVCache", "KVCacheError", "PagedKVCache", "kv_bytes_per_block", "state_bytes_per_slot"]


class KVCacheError(RuntimeError):
    """The cache was used against its contract (a caller bug, not a user error)."""


def kv_bytes_per_block(states: list[StateSpec], block_size: int, itemsize: int) -> int:
    """Bytes one block takes over all attention layers (K and V)."""
    return sum(2 * block_size * s.num_kv_heads * s.head_dim * itemsize for s in states if s.kind == "kv")


def state_bytes_per_slot(states: list[StateSpec], itemsize: int) -> int:
    """Bytes one sequence's recurrent state takes over all recurrent layers."""
    return sum(math.prod(s.shape) * itemsize for s in states if s.kind == "recurrent")


class KVCache(ABC):
    """The paged memory of one model: K/V blocks per attention layer, state slots per recurrent layer."""

    def __init__(self, num_blocks: int, block_size: int, num_state_slots: int = 0) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_state_slots = num_state_slots
        self.k: dict[int, Any] = {}  # layer -> [num_blocks, block_size, Hk, D]
        self.v: dict[int, Any] = {}  # layer -> [num_blocks, block_size, Hk, D]
        self.state: dict[int, Any] = {}  # layer -> [num_state_slots, *shape]

    @abstractmethod
    def nbytes(self) -> int:
        """Bytes reserved for K/V and state (all of it: the pool is allocated up front)."""


class PagedKVCache(KVCache):
    """Host numpy arrays. They are zero-filled lazily by the OS, so untouched blocks cost no RAM."""

    def __init__(
        self,
        states: list[StateSpec],
        num_blocks: int,
        block_size: int,
        num_state_slots: int = 0,
        dtype: np.dtype | type = np.float32,
    ) -> None:
        super().__init__(num_blocks, block_size, num_state_slots)
        for s in states:
            if s.kind == "kv":
                shape = (num_blocks, block_size, s.num_kv_heads, s.head_dim)
                self.k[s.layer] = np.zeros(shape, dtype)
                self.v[s.layer] = np.zeros(shape, dtype)
            elif s.kind == "recurrent":
                self.state[s.layer] = np.zeros((num_state_slots, *s.shape), dtype)
            else:
                raise KVCacheError(f"layer {s.layer}: unknown state kind {s.kind!r}")

    def nbytes(self) -> int:
        arrays = [*self.k.values(), *self.v.values(), *self.state.values()]
        return sum(a.nbytes for a in arrays)
