"""The scheduler on its own, with a fake model that commits tokens and 'samples' a fixed token."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from mgx.runtime.block_manager import BlockManager
from mgx.runtime.scheduler import Scheduler, SchedulerConfig, SeqStatus, Sequence, StepPlan

ROOT = Path(__file__).resolve().parents[2]


def make(num_blocks: int = 64, block_size: int = 4, max_seqs: int = 8, budget: int = 16) -> Scheduler:
    return Scheduler(SchedulerConfig(max_seqs, budget), BlockManager(num_blocks, block_size))


def seq(seq_id: int, prompt_len: int) -> Sequence:
    return Sequence(seq_id, list(range(100 * seq_id, 100 * seq_id + prompt_len)), prompt_len)


def run(s: Scheduler) -> StepPlan:
    """One step: commit every chunk, append a token to sequences whose chunk reached their end."""
    plan = s.schedule()
    for c in plan.chunks:
        s.blocks.commit(c.seq.seq_id, c.token_ids)
        if c.samples:
            c.seq.token_ids.append(7)
    return plan


def shape(plan: StepPlan) -> list[tuple[int, int, int]]:
    return [(c.seq.seq_id, c.start, c.num_tokens) for c in plan.chunks]


def test_long_prompts_are_chunked_under_the_budget_and_decodes_go_first() -> None:
    s = make(budget=8)
    s.add(seq(0, 3))
    s.add(seq(1, 20))
    assert shape(run(s)) == [(0, 0, 3), (1, 0, 5)]
    assert shape(run(s)) == [(0, 3, 1), (1, 5, 7)]  # seq 0 decodes first, seq 1's prefill takes the rest
    assert shape(run(s)) == [(0, 4, 1), (1, 12, 7)]
    assert shape(run(s)) == [(0, 5, 1), (1, 19, 1)]
    assert len(s.running[1].token_ids) == 21  # its last prompt chunk sampled a token


def test_limits_on_running_sequences() -> None:
    s = make(max_seqs=2, budget=64)
    for i in range(3):
        s.add(seq(i, 2))
    assert [c.seq.seq_id for c in run(s).chunks] == [0, 1]
    assert len(s.waiting) == 1
    s.finish(s.running[0])
    assert [c.seq.seq_id for c in run(s).chunks] == [1, 2]


def test_first_come_first_served_even_when_a_later_one_would_fit() -> None:
    s = make(num_blocks=4, block_size=4, budget=64)
    s.add(seq(0, 8))
    s.add(seq(1, 12))  # needs 3 blocks, 2 left
    s.add(seq(2, 1))  # would fit, but waits its turn
    assert [c.seq.seq_id for c in run(s).chunks] == [0]
    assert [q.seq_id for q in s.waiting] == [1, 2]


def test_out_of_blocks_preempts_the_newest_and_recomputes_it_later() -> None:
    s = make(num_blocks=4, block_size=2, budget=64)
    s.add(seq(0, 3))
    s.add(seq(1, 3))
    run(s)
    run(s)  # 4 tokens each in 2 blocks each: the pool is full
    plan = run(s)  # both need a third block; seq 0 goes first and takes seq 1's
    assert [q.seq_id for q in plan.preempted] == [1] and shape(plan) == [(0, 4, 1)]
    victim = s.waiting[0]
    assert victim.seq_id == 1 and victim.status is SeqStatus.WAITING and victim.num_preemptions == 1
    assert victim.token_ids[3:] == [7, 7]  # its generated tokens are kept, to be recomputed
    s.finish(s.running[0])
    # Re-admitted on its cached first block (its tail block was evicted for seq 0): recompute the rest.
    assert shape(run(s)) == [(1, 2, 3)]


def test_a_sequence_alone_that_cannot_grow_preempts_itself() -> None:
    s = make(num_blocks=2, block_size=2, budget=64)
    s.add(seq(0, 4))
    run(s)
    plan = run(s)
    assert [q.seq_id for q in plan.preempted] == [0] and plan.chunks == []
    assert not s.running and s.waiting[0].seq_id == 0


def test_abort_frees_blocks_at_once() -> None:
    s = make()
    s.add(seq(0, 9))
    s.add(seq(1, 2))
    run(s)
    s.abort(s.running[0])
    assert s.blocks.num_used_blocks == 1
    s.add(seq(2, 2))
    s.abort(s.waiting[0])
    assert not s.waiting and s.running[0].seq_id == 1


@pytest.mark.parametrize("module", ["block_manager", "scheduler", "metrics", "config"])
def test_policy_code_is_plain_python(module: str) -> None:
    tree = ast.parse((ROOT / "runtime" / f"{module}.py").read_text())
    imported = {
        (n.module or "") if isinstance(n, ast.ImportFrom) else a.name
        for n in ast.walk(tree)
        if isinstance(n, (ast.Import, ast.ImportFrom))
        for a in getattr(n, "names", [])
    }
    assert not {m for m in imported if m.split(".")[0] in {"numpy", "torch", "triton"}}
    assert not {m for m in imported if m.endswith(("backend", "model_runner", "kv_cache"))}


@pytest.mark.parametrize("seed", range(6))
def test_the_all_decode_plan_is_the_general_plan(seed: int, monkeypatch) -> None:
    """``Scheduler._decode_all`` (every running sequence decodes, nothing to admit) makes the plan
    the general path makes, step after step: blocks taken at block boundaries, preemptions when the
    pool runs dry, prompts and admissions in between. Two schedulers run the same random workload,
    one with the shortcut off; plans, preemptions and block tables must agree."""
    import random

    rng = random.Random(seed)
    both = [make(num_blocks=rng.randint(6, 24), block_size=rng.choice([2, 4]), max_seqs=rng.randint(2, 6),
                 budget=rng.randint(4, 16)) for _ in range(2)]  # fmt: skip
    both[1] = make(both[0].blocks.num_blocks, both[0].blocks.block_size, both[0].config.max_num_seqs,
                   both[0].config.max_tokens_per_step)  # fmt: skip
    monkeypatch.setattr(both[1], "_decode_all", lambda *extents: None)
    took = []
    shortcut = both[0]._decode_all
    monkeypatch.setattr(both[0], "_decode_all", lambda *extents: took.append(shortcut(*extents)) or took[-1])
    for step in range(80):
        if rng.random() < 0.15:
            n = rng.randint(1, 9)
            for s in both:
                s.add(seq(step, n))
        if rng.random() < 0.05 and both[0].running:
            i = rng.randrange(len(both[0].running))
            for s in both:
                s.finish(s.running[i])
        fast, general = run(both[0]), run(both[1])
        assert shape(fast) == shape(general), step
        assert [q.seq_id for q in fast.preempted] == [q.seq_id for q in general.preempted]
        assert [both[0].blocks.table(q.seq_id) for q in both[0].running] == [
            both[1].blocks.table(q.seq_id) for q in both[1].running
        ]
    assert sum(p is not None for p in took) >= 5  # the shortcut planned steps
