"""Which KV blocks and state slots each sequence owns, and the prefix cache over full blocks.

Plain Python, no tensors (the backend owns the memory, see ``kv_cache.py``). One pool per layer kind:

- ``BlockPool``: fixed-size K/V blocks shared by every attention layer. A block is in use (ref count
  > 0), empty, or *evictable*: free but still holding a cached prefix that a later request may reuse.
  New blocks come from the empty ones first, then from the least recently used evictable ones.
- ``SlotPool``: one fixed-size recurrent state per sequence, for linear-attention layers.

Prefix cache: a full block is keyed by a chained hash of its tokens and its predecessor's key, rooted
in the artifact's fingerprint, so equal keys mean equal K/V. A request whose prompt starts with cached
blocks shares them (ref counts) and computes only the rest.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["BlockManager", "BlockPool", "SlotPool", "StepBlocks", "block_hash"]


def block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The prefix-cache key of a full block: its tokens chained to its predecessor's key."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", tokens).tobytes())
    return h.digest()


class BlockPool:
    """K/V blocks with reference counts, an LRU of evictable cached blocks, and the hash index."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_count = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self._empty: list[int] = list(range(num_blocks - 1, -1, -1))  # a stack: block 0 comes out first
        self._evictable: OrderedDict[int, None] = OrderedDict()  # free but cached, oldest first
        self._index: dict[bytes, int] = {}  # hash -> block holding that prefix

    @property
    def num_free(self) -> int:
        return len(self._empty) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Blocks registered in the prefix cache (in use or evictable)."""
        return len(self._index)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def allocate(self, n: int) -> list[int] | None:
        """``n`` fresh blocks (ref count 1), evicting cached ones if needed; None if there are not enough."""
        if n > self.num_free:
            return None
        out = []
        for _ in range(n):
            if self._empty:
                block = self._empty.pop()
            else:
                block, _ = self._evictable.popitem(last=False)
                del self._index[self.hash_of[block]]  # type: ignore[arg-type]
                self.hash_of[block] = None
            self.ref_count[block] = 1
            out.append(block)
        return out

    def lookup(self, key: bytes) -> int | None:
        return self._index.get(key)

    def acquire(self, block: int) -> None:
        """Take a reference on a cached block (a prefix hit)."""
        if self.ref_count[block] == 0:
            del self._evictable[block]
        self.ref_count[block] += 1

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference on each block; a block nobody uses becomes empty, or evictable if cached."""
        for block in blocks:
            self.ref_count[block] -= 1
            if self.ref_count[block] < 0:
                raise AssertionError(f"block {block} released more often than acquired")
            if self.ref_count[block] == 0:
                if self.hash_of[block] is None:
                    self._empty.append(block)
                else:
                    self._evictable[block] = None  # most recently used end

    def register(self, block: int, key: bytes) -> None:
        """Record that ``block`` (full, computed) holds the prefix ``key``; the first block with a key wins."""
        if key in self._index or self.hash_of[block] is not None:
            return
        self._index[key] = block
        self.hash_of[block] = key

    def evict_all(self) -> int:
        """Forget every cached block nobody uses; returns how many were dropped."""
        n = len(self._evictable)
        for block in self._evictable:
            del self._index[self.hash_of[block]]  # type: ignore[arg-type]
            self.hash_of[block] = None
            self._empty.append(block)
        self._evictable.clear()
        return n


class SlotPool:
    """Fixed-size recurrent-state slots, one per sequence (linear-attention layers)."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int | None:
        return self._free.pop() if self._free else None

    def release(self, slot: int) -> None:
        self._free.append(slot)


@dataclass(slots=True)
class StepBlocks:
    """Where the sequences of one step stand (``BlockManager.prepare_step``), one entry per sequence."""

    starts: list[int]  # tokens already cached: the position of the first new token
    tables: list[list[int]]  # block tables (the manager's own lists: do not modify)
    state_slots: list[int | None]  # recurrent-state slots


@dataclass(slots=True)
class _SeqBlocks:
    table: list[int] = field(default_factory=list)  # block ids in position order
    tokens: list[int] = field(default_factory=list)  # tokens whose K/V is written (position order)
    keys: list[bytes] = field(default_factory=list)  # prefix-cache keys of the full computed blocks
    slot: int | None = None  # recurrent-state slot


class BlockManager:
    """Blocks and state slots per sequence; the scheduler asks, the model runner commits what it wrote."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        *,
        num_state_slots: int = 0,
        prefix_caching: bool = True,
        cache_salt: bytes = b"",
    ) -> None:
        """``cache_salt`` roots the prefix hashes (the artifact's fingerprint: other weights, other keys).

        Prefix caching is off when the model has recurrent state: that state is not per block.
        """
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.blocks = BlockPool(num_blocks)
        self.slots = SlotPool(num_state_slots) if num_state_slots else None
        self.prefix_caching = prefix_caching and self.slots is None
        self._root = hashlib.blake2b(cache_salt + b"|%d" % block_size, digest_size=16).digest()
        self._seqs: dict[int, _SeqBlocks] = {}

    # -- capacity --------------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.blocks.num_blocks

    @property
    def num_state_slots(self) -> int:
        return self.slots.num_slots if self.slots else 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation can take (empty plus evictable cached ones)."""
        return self.blocks.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.blocks.num_blocks - self.blocks.num_free

    @property
    def num_cached_blocks(self) -> int:
        return self.blocks.num_cached

    @property
    def num_evictable_blocks(self) -> int:
        return self.blocks.num_evictable

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def fits(self, num_tokens: int) -> bool:
        """Whether one sequence of ``num_tokens`` fits the whole pool (else it could never run)."""
        return self.blocks_for(num_tokens) <= self.num_blocks

    # -- per sequence ----------------------------------------------------------------------------

    def admit(self, seq_id: int, token_ids: Sequence[int]) -> int:
        """Start ``seq_id`` on the longest cached prefix of ``token_ids``; returns the tokens it covers.

        At least the last token is left to compute, since its logits are needed.
        """
        if seq_id in self._seqs:
            raise AssertionError(f"sequence {seq_id} is already admitted")
        seq = self._seqs[seq_id] = _SeqBlocks()
        if not self.prefix_caching:
            return 0
        bs = self.block_size
        parent = self._root
        for i in range((len(token_ids) - 1) // bs):
            tokens = token_ids[i * bs : (i + 1) * bs]
            key = block_hash(parent, tokens)
            block = self.blocks.lookup(key)
            if block is None:
                break
            self.blocks.acquire(block)
            seq.table.append(block)
            seq.tokens.extend(tokens)
            seq.keys.append(key)
            parent = key
        return len(seq.tokens)

    def allocate(self, seq_id: int, num_tokens: int) -> bool:
        """Make room for ``num_tokens`` tokens in all (all or nothing); False when blocks or slots run out."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            seq = self._seqs[seq_id] = _SeqBlocks()
        elif len(seq.table) * self.block_size >= num_tokens and (seq.slot is not None or self.slots is None):
            return True  # the common decode step: the last block has room
        need = self.blocks_for(num_tokens) - len(seq.table)
        take_slot = self.slots is not None and seq.slot is None
        if take_slot and self.slots.num_free == 0:  # type: ignore[union-attr]
            return False
        if need > 0:
            new = self.blocks.allocate(need)
            if new is None:
                return False
            seq.table.extend(new)
        if take_slot:
            seq.slot = self.slots.allocate()  # type: ignore[union-attr]
        return True

    def prepare_step(self, seq_ids: Sequence[int], num_new: Sequence[int]) -> StepBlocks | None:
        """Room for each sequence's ``num_new`` next tokens, and where its K/V lives, in one pass.

        What the scheduler already allocated costs ``allocate``'s first check only. None when a
        sequence cannot get its blocks; the sequences before it keep what they got.
        """
        seqs, bs, no_slots = self._seqs, self.block_size, self.slots is None
        starts: list[int] = []
        tables: list[list[int]] = []
        slots: list[int | None] = []
        for seq_id, n in zip(seq_ids, num_new, strict=True):
            seq = seqs.get(seq_id)
            start = len(seq.tokens) if seq is not None else 0
            # allocate's first check inline (a decode step of a large batch passes it for nearly all)
            if seq is None or len(seq.table) * bs < start + n or (seq.slot is None and not no_slots):
                if not self.allocate(seq_id, start + n):
                    return None
                seq = seqs[seq_id]
            starts.append(start)
            tables.append(seq.table)
            slots.append(seq.slot)
        return StepBlocks(starts, tables, slots)

    def commit(self, seq_id: int, token_ids: Sequence[int]) -> None:
        """Record that the K/V of ``token_ids`` (the next tokens of ``seq_id``) is written; cache full blocks."""
        seq = self._seqs[seq_id]
        seq.tokens.extend(token_ids)
        self._committed(seq_id, seq)

    def commit_step(self, seq_ids: Sequence[int], token_ids: Sequence[int], num_new: Sequence[int]) -> None:
        """``commit`` for a whole step: sequence i wrote the next ``num_new[i]`` of ``token_ids`` (packed in order)."""
        seqs, limit = self._seqs, self.block_size
        if len(token_ids) == len(seq_ids):  # a decode step: one token each
            for seq_id, token in zip(seq_ids, token_ids):
                seq = seqs[seq_id]
                tokens = seq.tokens
                tokens.append(token)
                # Only a token that fills a block (or one past the table) needs a closer look.
                n = len(tokens)
                if not n % limit or n > len(seq.table) * limit:
                    self._committed(seq_id, seq)
            return
        end = 0
        for seq_id, n in zip(seq_ids, num_new, strict=True):
            seq = seqs[seq_id]
            seq.tokens.extend(token_ids[end : end + n])
            end += n
            self._committed(seq_id, seq)

    def _committed(self, seq_id: int, seq: _SeqBlocks) -> None:
        if len(seq.tokens) > len(seq.table) * self.block_size:
            raise AssertionError(f"sequence {seq_id}: {len(seq.tokens)} tokens written past its blocks")
        if not self.prefix_caching:
            return
        bs = self.block_size
        while len(seq.keys) < len(seq.tokens) // bs:
            i = len(seq.keys)
            key = block_hash(seq.keys[-1] if seq.keys else self._root, seq.tokens[i * bs : (i + 1) * bs])
            seq.keys.append(key)
            self.blocks.register(seq.table[i], key)

    def num_computed(self, seq_id: int) -> int:
        """Tokens of ``seq_id`` whose K/V is in the cache (0 for an unknown sequence)."""
        seq = self._seqs.get(seq_id)
        return len(seq.tokens) if seq else 0

    def num_computed_many(self, seq_ids: Sequence[int]) -> list[int]:
        """``num_computed`` of each of ``seq_ids``."""
        seqs = self._seqs
        return [len(seq.tokens) if (seq := seqs.get(i)) is not None else 0 for i in seq_ids]

    def extents(self, seq_ids: Sequence[int]) -> tuple[list[int], list[int]]:
        """Per sequence: tokens computed, and tokens its blocks hold (two lists), so that growing to
        ``n`` tokens needs ``allocate`` only when ``n`` exceeds the second (which is 0 while a state
        slot is missing)."""
        seqs, bs = self._seqs, self.block_size
        try:
            known = [seqs[i] for i in seq_ids]
        except KeyError:
            known = None
        if known is not None and self.slots is None:  # the common case, two passes
            return [len(s.tokens) for s in known], [len(s.table) * bs for s in known]
        starts, rooms = [], []
        for seq_id in seq_ids:
            seq = seqs.get(seq_id)
            starts.append(len(seq.tokens) if seq is not None else 0)
            if seq is None or (self.slots is not None and seq.slot is None):
                rooms.append(0)
            else:
                rooms.append(len(seq.table) * bs)
        return starts, rooms

    def table(self, seq_id: int) -> list[int]:
        """The block table of ``seq_id`` (do not modify)."""
        return self._seqs[seq_id].table

    def state_slot(self, seq_id: int) -> int | None:
        seq = self._seqs.get(seq_id)
        return seq.slot if seq else None

    def free(self, seq_id: int) -> None:
        """Release everything ``seq_id`` holds; cached blocks stay reusable until evicted. Unknown ids are ignored."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return
        # Tail blocks first, so the LRU evicts a prefix's last blocks before its first ones.
        self.blocks.release(seq.table[::-1])
        if seq.slot is not None:
            self.slots.release(seq.slot)  # type: ignore[union-attr]

    def has(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def reset_prefix_cache(self) -> int:
        """Drop every cached block nobody uses; returns how many."""
        return self.blocks.evict_all()
