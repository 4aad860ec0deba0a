"""The engine launching the next greedy decode step before it reads this step's picks.

On the GPU a greedy graph launch returns at once and the next step is fed the picks on the device;
here the CPU backend stands in (``overlaps_steps`` forced on: a step launched ahead runs at once,
fed the picks it would get on the device). Every run is checked against the same requests on an
engine that launches nothing ahead: same tokens, same finish reasons, same blocks left in use.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from mgx.runtime import Engine, EngineConfig
from mgx.runtime.sampler import SamplingParams

from _tiny_graph import tiny_contents

PROMPTS = [[5, 9, 2, 7], [3, 3, 8], [11, 4, 6, 2, 9, 1], [7]]


def _engine(ahead: bool, config: EngineConfig | None = None) -> Engine:
    engine = Engine.from_contents(tiny_contents(), backend="cpu", config=config)
    engine.runner.backend.overlaps_steps = ahead
    return engine


def _drive(engine: Engine, script: Callable[[Engine, int], None]) -> dict[str, tuple[list[int], str | None]]:
    """Step to the end, calling ``script(engine, step)`` before each step; every request's output."""
    tokens: dict[str, list[int]] = {}
    finish: dict[str, str | None] = {}
    step = 0
    script(engine, step)
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
            if out.finished:
                finish[out.request_id] = out.finish_reason
        step += 1
        script(engine, step)
    return {r: (t, finish.get(r)) for r, t in tokens.items()}


def _compare(script: Callable[[Engine, int], None], config: EngineConfig | None = None) -> tuple[int, int]:
    """The script on both engines: equal outputs and blocks; (steps adopted, steps dropped) with ahead."""
    want_engine, got_engine = _engine(False, config), _engine(True, config)
    want = _drive(want_engine, script)
    adopted, dropped = [], []
    adopt = got_engine._adopt

    def spy(*args):  # noqa: ANN002, ANN202
        out = adopt(*args)
        (adopted if out is not None else dropped).append(1)
        return out

    got_engine._adopt = spy
    got = _drive(got_engine, script)
    assert got == want
    assert got_engine.blocks.num_free_blocks == want_engine.blocks.num_free_blocks
    assert want_engine._ahead is None  # never launched without overlaps_steps
    return len(adopted), len(dropped)


def _greedy(max_tokens: int, **kw) -> SamplingParams:  # noqa: ANN003
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def test_a_batch_decodes_the_same_with_steps_launched_ahead() -> None:
    """Requests of different lengths: every decode step but those after a prefill or before a
    request's last token is the one launched ahead."""

    def script(engine: Engine, step: int) -> None:
        if step == 0:
            for p, n in zip(PROMPTS, (9, 5, 12, 1)):
                engine.add_request(p, _greedy(n))

    adopted, dropped = _compare(script)
    assert adopted >= 5 and dropped == 0


def test_a_request_taking_its_last_token_is_left_out_of_the_step_launched_ahead() -> None:
    """Requests ending on max_tokens at different steps: the step launched ahead leaves out the one
    that ends (its picks gathered for the others), so after the first step no step waits for the
    host to learn the picks, and the tokens are those of an engine launching nothing ahead."""

    def script(engine: Engine, step: int) -> None:
        if step == 0:
            for p, n in zip(PROMPTS, (9, 5, 12, 1)):
                engine.add_request(p, _greedy(n))

    want = _drive(_engine(False), script)
    engine = _engine(True)
    plain = _plain_launches(engine)
    assert _drive(engine, script) == want
    assert len(plain) == 1 and len(plain[0]) == 4  # the prompts' step only
    assert engine.blocks.num_used_blocks == 0


def test_requests_waiting_for_a_full_batch_do_not_stop_launching_ahead() -> None:
    """With the batch at max_num_seqs a waiting request cannot join before one finishes, so steps
    are still launched ahead (and dropped when one finishes and the next is admitted)."""

    def script(engine: Engine, step: int) -> None:
        if step == 0:
            for p, n in zip(PROMPTS, (6, 9, 5, 7)):
                engine.add_request(p, _greedy(n))

    adopted, dropped = _compare(script, EngineConfig(max_num_seqs=2))
    # a request finishes on its last token and a waiting one takes its place: nothing was launched after it
    assert adopted >= 10 and dropped == 0


def test_a_stop_token_keeps_the_step_launched_ahead_and_a_late_request_drops_it() -> None:
    """A request that stops on a token (unknown when the next step was launched): the step launched
    ahead is taken for the other request, its row unread. One added mid-run changes the schedule:
    the step launched ahead is dropped. The tokens are unchanged."""
    baseline = _engine(False).generate(PROMPTS[0], max_tokens=8, temperature=0.0, ignore_eos=True).token_ids
    stop = baseline[4]
    first = baseline.index(stop)  # the request stops after this many + 1 tokens

    def script(engine: Engine, step: int) -> None:
        if step == 0:
            engine.add_request(PROMPTS[0], _greedy(8, stop_token_ids=(stop,)), request_id="stops")
            engine.add_request(PROMPTS[1], _greedy(10), request_id="runs")
        if step == 4:
            engine.add_request(PROMPTS[2], _greedy(6), request_id="late")

    adopted, dropped = _compare(script)
    assert dropped == 1 and adopted >= 6  # dropped: the late request's prefill
    assert first < 7  # the stop came before max_tokens, so it was a surprise to the launch


def test_requests_stopping_one_after_another_keep_every_step_launched_ahead() -> None:
    """Six requests stop on tokens at different steps: each step launched ahead is taken without the
    rows of those that stopped since, and the next one is launched from those rows' picks (rows
    within rows): nothing is dropped, one step is launched plainly, the outputs are unchanged."""
    prompts = [[5 + i, 9, 2 + i, 7] for i in range(6)]
    base = _engine(False)
    stops = []
    for i, p in enumerate(prompts):
        ids = base.generate(p, max_tokens=12, temperature=0.0, ignore_eos=True).token_ids
        stops.append(ids[min(2 + i, len(ids) - 1)])

    def script(engine: Engine, step: int) -> None:
        if step == 0:
            for i, (p, stop) in enumerate(zip(prompts, stops)):
                engine.add_request(p, _greedy(12, stop_token_ids=(stop,)), request_id=f"r{i}")

    want = _drive(_engine(False), script)
    assert len({len(t) for t, _ in want.values()}) >= 3  # they stop at several steps
    for subsets in (True, False):
        engine = _engine(True)
        engine.ahead_subsets = subsets  # off: each stop drops the step launched ahead, as before
        plain = _plain_launches(engine)
        assert _drive(engine, script) == want
        assert engine.blocks.num_used_blocks == 0
        if subsets:
            assert [len(seqs) for seqs in plain] == [6]
        else:
            assert len(plain[0]) == 6 and len(plain) >= 4


def test_an_adopted_step_without_some_rows_picks_and_feeds_only_the_others() -> None:
    """``adopt`` with rows: the step as taken holds those sequences, its picks are theirs, and the
    step launched after it is fed their picks; the same tokens as full forwards."""
    runner = _engine(True).runner
    p0, p2 = PROMPTS[0], PROMPTS[2]
    first = runner.launch_greedy_packed([0, 1, 2], [*p0, *PROMPTS[1], *p2], [4, 3, 6], [True] * 3)
    ahead = runner.launch_ahead(first)
    assert ahead is not None
    picked = first.picks()[0].tolist()
    taken = runner.adopt(ahead, [picked[0], picked[2]], rows=[0, 2])  # sequence 1 ended after the launch
    assert taken.batch.seq_ids == [0, 2] and taken.starts == [len(p0), len(p2)] and taken.rows == [0, 2]
    all_rows = ahead.picks()[0].tolist()
    assert taken.picks()[0].tolist() == [all_rows[0], all_rows[2]]
    assert runner.length(0) == len(p0) + 1 and runner.length(1) == 3  # sequence 1: nothing committed
    last = runner.launch_ahead(taken, [1])  # sequence 2 alone, fed row 2 of ``ahead``
    assert last is not None and last.batch.seq_ids == [2] and last.starts == [len(p2) + 1]
    runner.adopt(last, [all_rows[2]])
    ids, _ = _engine(False).runner.step_greedy_packed([9], [*p2, picked[2], all_rows[2]], [len(p2) + 2], [True])
    assert last.picks()[0].tolist() == ids.tolist()


def _plain_launches(engine: Engine) -> list[list[int]]:
    """Filled as the engine runs: the sequences of each step it launches after the host has the
    picks (not launched ahead)."""
    plain: list[list[int]] = []
    launch = engine.runner.launch_greedy_packed
    engine.runner.launch_greedy_packed = lambda *a: plain.append(list(a[0])) or launch(*a)
    return plain


def test_sampling_and_aborted_requests_next_to_steps_launched_ahead() -> None:
    """A sampling request (no fused argmax: nothing is launched ahead while it runs) and a request
    aborted between steps (the step launched ahead is taken for the other one): outputs as without
    launching ahead."""

    def script(engine: Engine, step: int) -> None:
        if step == 0:
            engine.add_request(PROMPTS[0], _greedy(12), request_id="greedy")
            engine.add_request(PROMPTS[3], _greedy(12), request_id="aborted")
        if step == 3:
            engine.abort("aborted")
        if step == 6:
            engine.add_request(PROMPTS[1], SamplingParams(max_tokens=3, temperature=1.0, seed=5), request_id="sampled")

    adopted, dropped = _compare(script)
    assert adopted >= 7 and dropped == 0


def test_a_step_launched_ahead_is_fed_the_picks_and_commits_nothing_until_adopted() -> None:
    """``launch_ahead`` alone: the step's tokens are the previous step's picks; the block manager
    counts them only once ``adopt`` says the schedule took the step."""
    engine = _engine(True)
    runner = engine.runner
    prompt = PROMPTS[2]
    first = runner.launch_greedy_packed([0], prompt, [len(prompt)], [True])
    ahead = runner.launch_ahead(first)
    assert ahead is not None and ahead.starts == [len(prompt)]
    (pick,) = first.picks()[0].tolist()
    assert ahead.batch.token_ids.tolist() == [pick]
    assert runner.length(0) == len(prompt)  # not committed yet
    runner.adopt(ahead, [pick])
    assert runner.length(0) == len(prompt) + 1
    ids, _ = engine.runner.step_greedy_packed([1], [*prompt, pick], [len(prompt) + 1], [True])
    assert ahead.picks()[0].tolist() == ids.tolist()  # what a full forward of the same tokens picks


@pytest.mark.parametrize("samples", [[True, False], [False, True]])
def test_nothing_is_launched_ahead_of_a_step_in_which_a_sequence_does_not_pick(samples: list[bool]) -> None:
    runner = _engine(True).runner
    first = runner.launch_greedy_packed([0, 1], [*PROMPTS[0], *PROMPTS[1]], [4, 3], samples)
    assert runner.launch_ahead(first) is None


def test_preemption_stop_strings_and_aborts_with_steps_launched_ahead() -> None:
    """A KV cache too small for the batch (preemptions), staggered arrivals, chunked prefill, stop
    strings and stop ids, aborts: the streamed outputs (text, tokens, finish and stop reasons) equal
    those of the same engine launching nothing ahead, and every block is free at the end."""
    import random

    rng = random.Random(0)
    jobs = []
    for i in range(24):
        prompt = [rng.randrange(2, 300) for _ in range(rng.randint(3, 40))]
        stop = ["e"] if i % 4 == 0 else []
        jobs.append((prompt, SamplingParams(max_tokens=rng.randint(1, 18), temperature=0.0, stop=stop,
                                            stop_token_ids=(prompt[0],))))  # fmt: skip

    def run(ahead: bool) -> tuple[list, Engine]:
        probe = Engine.from_contents(tiny_contents(), backend="cpu")
        block = probe.runner.backend.kv_bytes_per_block(16)
        config = EngineConfig(kv_memory=8 * block, max_num_seqs=12, max_tokens_per_step=48)
        engine = Engine.from_contents(tiny_contents(), backend="cpu", config=config)
        engine.runner.backend.overlaps_steps = ahead
        adopt = engine._adopt
        engine._adopt = lambda *a: adopted.append(taken := adopt(*a)) or taken
        stagger, todo, rids, got = random.Random(3), list(jobs), [], {}
        while todo or engine.has_unfinished():
            for _ in range(stagger.randint(0, 3)):
                if todo:
                    rids.append(engine.add_request(*todo.pop(0)))
            for out in engine.step():
                got.setdefault(out.request_id, []).append((out.text, out.token_ids, out.finish_reason, out.stop_reason))
            for rid in rids[5::7]:
                if len(got.get(rid, ())) >= 3:
                    engine.abort(rid)
        b = engine.blocks
        assert b.num_used_blocks == 0 and all(r == 0 for r in b.blocks.ref_count)
        return [got.get(r) for r in rids], engine

    adopted: list[object] = []
    want, _ = run(False)
    assert not adopted
    got, engine = run(True)
    assert got == want
    assert engine.metrics.counters.preemptions > 0
    # Requests wait for blocks most of the run (nothing is launched ahead then); the tail runs ahead.
    assert sum(a is not None for a in adopted) >= 3 and any(a is None for a in adopted)
    assert {s[-1][2] for s in want if s} >= {"stop", "length"}
