"""Engine configuration and KV capacity planning from a memory budget."""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["EngineConfig", "CachePlan", "parse_memory", "plan_cache", "format_bytes"]

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}  # fmt: skip
DEFAULT_KV_FRACTION = 0.25  # of available memory, when no budget is given


def parse_memory(text: str | int | float) -> int | float:
    """``"512MiB"``, ``"2GB"``, ``"1e9"`` -> bytes (int); ``"0.3"`` or ``"30%"`` -> a fraction (float < 1)."""
    if isinstance(text, bool):
        raise ValueError(f"not a memory size: {text!r}")
    if isinstance(text, int):
        value, unit = float(text), ""
    elif isinstance(text, float):
        value, unit = text, ""
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z%]*)\s*", text)
        if not m or m.group(2).lower() not in {*_UNITS, "%"}:
            raise ValueError(
                f"not a memory size: {text!r} (examples: 512MiB, 2GB, 1073741824, or a fraction 0.3 / 30%)"
            )
        value, unit = float(m.group(1)), m.group(2).lower()
    if unit == "%":
        value, unit = value / 100, ""
    if unit == "" and 0 < value < 1:
        return value
    if value < 1:
        raise ValueError(f"a memory size must be positive, got {text!r}")
    return int(value * _UNITS[unit])


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """How the engine batches requests and how much memory its KV cache gets."""

    block_size: int = 16  # tokens per KV block
    kv_memory: int | float | str | None = (
        None  # KV budget: bytes / "512MiB" / a fraction of available memory; None: 25%
    )
    max_num_seqs: int = 64  # most sequences in one step
    max_tokens_per_step: int = 512  # token budget of one step: decodes (1 each) plus prefill chunks
    prefix_caching: bool = True  # reuse K/V of full blocks whose tokens (and all before them) match
    metrics_window: int = 1000  # finished requests (and steps) kept for percentiles

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_tokens_per_step < self.max_num_seqs:
            raise ValueError(
                f"max_tokens_per_step ({self.max_tokens_per_step}) must be >= max_num_seqs "
                f"({self.max_num_seqs}): every running sequence needs room for its next token"
            )
        if self.kv_memory is not None:
            parse_memory(self.kv_memory)
        if self.metrics_window < 1:
            raise ValueError(f"metrics_window must be >= 1, got {self.metrics_window}")


@dataclass(frozen=True, slots=True)
class CachePlan:
    """What the KV budget buys."""

    budget_bytes: int  # the budget after resolving a fraction
    block_size: int
    num_blocks: int  # K/V blocks in the pool
    bytes_per_block: int  # over all attention layers
    num_state_slots: int  # recurrent-state slots (0 without linear-attention layers)
    bytes_per_state_slot: int

    @property
    def num_tokens(self) -> int:
        """Tokens that fit in the K/V pool."""
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.bytes_per_block + self.num_state_slots * self.bytes_per_state_slot

    def describe(self) -> str:
        per_token = self.bytes_per_block / self.block_size
        line = (
            f"KV cache: {format_bytes(self.nbytes)} -> {self.num_tokens:,} tokens fit "
            f"({self.num_blocks:,} blocks of {self.block_size}, {format_bytes(per_token)}/token)"
        )
        if self.num_state_slots:
            line += f", {self.num_state_slots} recurrent-state slots"
        return line


def plan_cache(
    config: EngineConfig,
    *,
    bytes_per_block: int,
    bytes_per_state_slot: int,
    memory_available: int,
    max_position: int,
) -> CachePlan:
    """Size the pools from the budget: state slots for every running sequence first, K/V blocks after.

    With no explicit budget the default fraction is capped at what ``max_num_seqs`` full-context
    sequences could ever use.
    """
    budget = parse_memory(config.kv_memory) if config.kv_memory is not None else DEFAULT_KV_FRACTION
    if isinstance(budget, float):
        budget = int(budget * memory_available)
    slots = config.max_num_seqs if bytes_per_state_slot else 0
    state_bytes = slots * bytes_per_state_slot
    bs = config.block_size
    if bytes_per_block == 0:  # no attention layer: one token of room keeps the bookkeeping uniform
        return CachePlan(budget, bs, 1, 0, slots, bytes_per_state_slot)
    num_blocks = (budget - state_bytes) // bytes_per_block
    if config.kv_memory is None:
        num_blocks = min(num_blocks, config.max_num_seqs * -(-max_position // bs))
    if num_blocks < 1:
        raise ValueError(
            f"a KV budget of {format_bytes(budget)} holds no block (one block of {bs} tokens takes "
            f"{format_bytes(bytes_per_block)}"
            + (f", plus {format_bytes(state_bytes)} of recurrent state" if state_bytes else "")
            + "); raise --kv-memory"
        )
    return CachePlan(budget, bs, num_blocks, bytes_per_block, slots, bytes_per_state_slot)
