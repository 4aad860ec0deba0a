"""KV budgets: parsing sizes and fractions, and what a budget buys."""

from __future__ import annotations

import pytest

from mgx.runtime.config import EngineConfig, parse_memory, plan_cache


@pytest.mark.parametrize(
    ("text", "value"),
    [("512MiB", 512 << 20), ("2GB", 2 * 10**9), ("1.5 GiB", 3 << 29), ("4096", 4096), (1 << 20, 1 << 20),
     ("0.3", 0.3), ("30%", 0.3), (0.25, 0.25), ("64kib", 64 << 10)],
)  # fmt: skip
def test_parse_memory(text, value) -> None:  # noqa: ANN001
    assert parse_memory(text) == pytest.approx(value)


@pytest.mark.parametrize("text", ["lots", "12 parsecs", "-1GB", "0", ""])
def test_parse_memory_refuses_nonsense(text: str) -> None:
    with pytest.raises(ValueError):
        parse_memory(text)


def test_a_budget_buys_whole_blocks_after_the_state_slots() -> None:
    plan = plan_cache(
        EngineConfig(kv_memory="1MiB", max_num_seqs=4, max_tokens_per_step=64),
        bytes_per_block=10_000,
        bytes_per_state_slot=1_000,
        memory_available=10**12,
        max_position=4096,
    )
    assert (plan.num_state_slots, plan.num_blocks) == (4, (2**20 - 4000) // 10_000)
    assert plan.num_tokens == plan.num_blocks * 16 and plan.nbytes <= 2**20
    assert "tokens fit" in plan.describe() and "4 recurrent-state slots" in plan.describe()


def test_fractions_and_the_default() -> None:
    kw = dict(bytes_per_block=1000, bytes_per_state_slot=0, memory_available=10**6, max_position=64)
    assert plan_cache(EngineConfig(kv_memory=0.5), **kw).num_blocks == 500
    # The default (25%) is capped at what max_num_seqs full-context sequences could use: 2 x 4 blocks.
    assert plan_cache(EngineConfig(max_num_seqs=2, max_tokens_per_step=8), **kw).num_blocks == 8


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="max_tokens_per_step"):
        EngineConfig(max_num_seqs=64, max_tokens_per_step=32)
    with pytest.raises(ValueError, match="not a memory size"):
        EngineConfig(kv_memory="big")
