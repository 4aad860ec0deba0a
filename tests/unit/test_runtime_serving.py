"""The serving engine on a tiny random model: batch invariance, preemption, leaks, prefix cache,
stop strings, seeds, logprobs, the async and thread-safe front ends, metrics and ``mgx-run bench``."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from mgx.formats.artifact import write_artifact
from mgx.runtime import LLM, AsyncEngine, Engine, EngineConfig, SamplingParams
from mgx.runtime.cli import main
from mgx.runtime.errors import EngineError
from mgx.runtime.request import StopStrings

from _tiny_graph import tiny_contents

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def contents():
    return tiny_contents()


@pytest.fixture(scope="module")
def workload() -> list[tuple[list[int], int]]:
    """32 requests of mixed prompt (3-60 tokens) and output (1-20 tokens) lengths."""
    rng = random.Random(0)
    return [
        ([rng.randrange(2, 300) for _ in range(rng.randint(3, 60))], rng.randint(1, 20)) for _ in range(32)
    ]


@pytest.fixture(scope="module")
def solo(contents, workload) -> list[list[int]]:
    """Each request's greedy tokens when it runs alone."""
    engine = Engine.from_contents(contents, config=EngineConfig(prefix_caching=False))
    return [engine.generate(p, max_tokens=n, **GREEDY).token_ids for p, n in workload]


def drive(engine: Engine, workload, stagger: random.Random | None = None, abort: set[int] = frozenset(),
          finished: list | None = None):  # fmt: skip
    """Submit every request (all at once, or a few per step), step to the end; tokens per request.
    ``finished``: gets each request's last output."""
    ids: dict[str, int] = {}
    got: dict[int, list[int]] = {i: [] for i in range(len(workload))}
    todo = list(enumerate(workload))
    while todo or engine.has_unfinished():
        for _ in range(len(todo) if stagger is None else stagger.randint(0, 3)):
            if todo:
                i, (prompt, n) = todo.pop(0)
                ids[engine.add_request(prompt, SamplingParams(max_tokens=n, **GREEDY))] = i
        for out in engine.step():
            got[ids[out.request_id]] += out.token_ids
            if out.finished and finished is not None:
                finished.append(out)
        for rid, i in ids.items():
            if i in abort and len(got[i]) >= 2:
                engine.abort(rid)
    return got


def assert_no_leaks(engine: Engine) -> None:
    b = engine.blocks
    assert not engine.has_unfinished() and not engine.scheduler.running and not engine.scheduler.waiting
    assert b.num_used_blocks == 0 and b.num_free_blocks == b.num_blocks  # free or evictable
    assert all(r == 0 for r in b.blocks.ref_count)
    engine.reset_prefix_cache()
    assert b.num_cached_blocks == 0 and b.num_evictable_blocks == 0


def test_batch_invariance_all_at_once(contents, workload, solo) -> None:
    engine = Engine.from_contents(contents, config=EngineConfig(max_num_seqs=32, max_tokens_per_step=256))
    got = drive(engine, workload)
    assert [got[i] for i in range(32)] == solo
    assert engine.metrics.counters.steps < sum(n for _, n in workload)  # really batched
    assert_no_leaks(engine)


def test_batch_invariance_staggered_with_chunked_prefill(contents, workload, solo) -> None:
    engine = Engine.from_contents(contents, config=EngineConfig(max_num_seqs=8, max_tokens_per_step=24))
    got = drive(engine, workload, stagger=random.Random(1))
    assert [got[i] for i in range(32)] == solo
    assert_no_leaks(engine)


def test_a_kv_budget_too_small_preempts_but_completes_everything(contents, workload, solo) -> None:
    engine = Engine.from_contents(
        contents, config=EngineConfig(kv_memory=8 * 16 * 256, max_num_seqs=16, max_tokens_per_step=64)
    )
    assert engine.cache_plan.num_blocks == 8  # 128 tokens for 32 requests of up to 80
    finished: list = []
    got = drive(engine, workload, stagger=random.Random(2), finished=finished)
    assert [got[i] for i in range(32)] == solo
    assert engine.metrics.counters.preemptions > 0
    # Each request's own count: together, every preemption the engine counted.
    assert len(finished) == 32
    assert sum(out.metrics.preemptions for out in finished) == engine.metrics.counters.preemptions
    assert_no_leaks(engine)


def test_requests_that_can_never_fit_are_refused_up_front(contents) -> None:
    engine = Engine.from_contents(contents, config=EngineConfig(kv_memory=2 * 16 * 256))
    with pytest.raises(ValueError, match="more than the KV cache holds"):
        engine.add_request(list(range(2, 30)), SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="holds no block"):
        Engine.from_contents(contents, config=EngineConfig(kv_memory=100))


def test_no_leaks_after_aborts_mid_flight_and_in_the_queue(contents, workload) -> None:
    engine = Engine.from_contents(contents, config=EngineConfig(max_num_seqs=4, max_tokens_per_step=32))
    drive(engine, workload[:12], abort={1, 5, 6})
    queued = engine.add_request([5, 6, 7], SamplingParams(max_tokens=3))
    out = engine.abort(queued)
    assert out.finished and out.finish_reason == "abort"
    running = engine.add_request(list(range(2, 50)), SamplingParams(max_tokens=3))
    engine.step()
    assert engine.blocks.num_used_blocks == 2  # 32 of its 48 prompt tokens ran (the step's budget)
    engine.abort(running)
    assert engine.blocks.num_used_blocks == 0  # at once, not at the next step
    assert engine.metrics.counters.requests_aborted >= 3
    assert_no_leaks(engine)


def test_prefix_cache_computes_only_the_new_tokens(contents) -> None:
    rng = random.Random(3)
    system = [rng.randrange(2, 300) for _ in range(40)]  # 2 full blocks of 16 + 8
    first, second = system + [11, 12, 13], system + [21, 22, 23, 24]
    cold = Engine.from_contents(contents, config=EngineConfig(prefix_caching=False))
    want = cold.generate(second, max_tokens=5, **GREEDY)
    engine = Engine.from_contents(contents)
    engine.generate(first, max_tokens=5, **GREEDY)
    before = engine.metrics.counters.computed_tokens
    result = engine.generate(second, max_tokens=5, **GREEDY)
    assert result.metrics.cached_tokens == 32
    assert engine.metrics.counters.computed_tokens - before == len(second) - 32 + 4  # + 4 decode steps
    assert result.token_ids == want.token_ids
    assert engine.metrics.counters.cached_prompt_tokens == 32
    assert engine.metrics.prefix_hit_rate == pytest.approx(32 / (len(first) + len(second)))


# -- sampling and output ------------------------------------------------------------------------------


def test_stop_strings_never_leak_even_split_across_tokens() -> None:
    stops = StopStrings(["o w", "xyz"])
    assert stops.push("hel") == ("hel", None)
    assert stops.push("lo") == ("l", None)  # "o" could start "o w": held
    assert stops.push(" ") == ("", None)
    assert stops.push("wor") == ("", "o w")
    stops = StopStrings(["ab"])
    assert stops.push("xa") == ("x", None) and stops.push("c") == ("ac", None) and stops.flush() == ""


def split_point(tok, ids: list[int], text: str) -> tuple[int, int]:  # noqa: ANN001
    """A token k whose text starts at offset b of ``text``, with clean characters on both sides."""
    for k in range(2, len(ids) - 1):
        before, through = tok.decode(ids[:k]), tok.decode(ids[: k + 1])
        b = len(before)
        clean = text.startswith(through) and len(through) > b and "\ufffd" not in text[b - 1 : b + 1]
        if clean and text.find(text[b - 1 : b + 1]) == b - 1:
            return k, b
    pytest.skip("no clean token boundary in this random model's output")


def test_stop_string_through_the_engine(contents) -> None:
    engine = Engine.from_contents(contents)
    tok = engine.tokenizer
    full = engine.generate("the cat", max_tokens=24, **GREEDY)
    ids, text = full.token_ids, full.text
    k, b = split_point(tok, ids, text)
    stop = text[b - 1 : b + 1]  # the last character of token k-1 and the first of token k
    events = list(engine.generate("the cat", max_tokens=24, stop=[stop], stream=True, **GREEDY))
    *deltas, result = events
    assert result.finish_reason == "stop" and result.stop_reason == stop
    assert result.text == text[: b - 1] == "".join(d.text for d in deltas)
    assert result.token_ids == ids[: k + 1]  # generation ended on the token that completed the stop
    assert_no_leaks(engine)


def test_seeds_give_the_same_tokens_alone_and_in_a_batch(contents, workload) -> None:
    params = SamplingParams(max_tokens=12, temperature=1.3, top_k=40, top_p=0.95, min_p=0.01, seed=42)
    engine = Engine.from_contents(contents)
    alone = engine.generate(
        [5, 6, 7], max_tokens=12, temperature=1.3, top_k=40, top_p=0.95, min_p=0.01, seed=42
    )
    rid = engine.add_request([5, 6, 7], params)
    for p, n in workload[:10]:
        engine.add_request(p, SamplingParams(max_tokens=n, temperature=1.0, seed=len(p)))
    got = []
    while engine.has_unfinished():
        got += [t for o in engine.step() if o.request_id == rid for t in o.token_ids]
    assert got == alone.token_ids
    other = engine.generate([5, 6, 7], max_tokens=12, temperature=1.3, top_k=40, top_p=0.95, seed=43)
    assert other.token_ids != alone.token_ids


def test_penalties_change_greedy_choices(contents) -> None:
    engine = Engine.from_contents(contents)
    plain = engine.generate([5, 6, 7], max_tokens=16, **GREEDY).token_ids
    assert len(set(plain)) < len(plain)  # a random tiny model repeats itself
    for option in ({"presence_penalty": 2.0}, {"frequency_penalty": 2.0}, {"repetition_penalty": 5.0}):
        assert engine.generate([5, 6, 7], max_tokens=16, **GREEDY, **option).token_ids != plain


def test_logprobs_are_the_model_distribution(contents) -> None:
    engine = Engine.from_contents(contents)
    prompt = [5, 6, 7, 8]
    result = engine.generate(prompt, max_tokens=4, logprobs=3, **GREEDY)
    assert len(result.logprobs) == 4
    (logits,) = engine.runner.step(
        [
            __import__("mgx.runtime.batch", fromlist=["SeqChunk"]).SeqChunk(
                -7, prompt + result.token_ids[:-1], all_logits=True
            )
        ]
    )
    engine.runner.free(-7)
    for lp, row, token in zip(result.logprobs, logits[len(prompt) - 1 :], result.token_ids):
        logp = row.astype(np.float64) - np.log(np.exp(row.astype(np.float64) - row.max()).sum()) - row.max()
        assert lp.token_id == token and lp.logprob == pytest.approx(logp[token], abs=1e-5)
        assert [t for t, _ in lp.top] == list(np.argsort(-logp)[:3]) and lp.top[0][
            0
        ] == token  # greedy: top-1
        assert [v for _, v in lp.top] == pytest.approx(sorted(logp, reverse=True)[:3], abs=1e-5)


# -- front ends -----------------------------------------------------------------------------------------


def test_async_engine_streams_and_abort_frees_blocks(contents, workload, solo) -> None:
    engine = AsyncEngine(Engine.from_contents(contents, config=EngineConfig(max_num_seqs=8)))

    async def one(i: int) -> list[int]:
        await asyncio.sleep(0.002 * (i % 5))  # staggered arrivals
        prompt, n = workload[i]
        tokens, finished = [], None
        async for out in engine.generate(prompt, SamplingParams(max_tokens=n, **GREEDY)):
            tokens += out.token_ids
            finished = out
        assert finished.finished and finished.finish_reason == "length"
        return tokens

    async def aborted() -> None:
        async for out in engine.generate([3, 4, 5], SamplingParams(max_tokens=120, **GREEDY), request_id="x"):
            assert out.request_id == "x"
            break  # leaving early aborts it
        gen = engine.generate([3, 4, 5], SamplingParams(max_tokens=120, **GREEDY), request_id="y")
        await gen.__anext__()
        assert await engine.abort("y")
        assert [o.finish_reason async for o in gen][-1] == "abort"  # after what was already on its way

    async def main() -> list[list[int]]:
        results = await asyncio.gather(*(one(i) for i in range(16)), aborted())
        return results[:16]

    try:
        assert asyncio.run(main()) == solo[:16]
        assert engine.metrics()["requests_aborted_total"] == 2
        assert_no_leaks(engine.engine)
    finally:
        engine.close()


def test_llm_wrapper_is_thread_safe(contents, workload, solo) -> None:
    with LLM(Engine.from_contents(contents)) as llm:
        results: dict[int, list[int]] = {}

        def worker(k: int) -> None:
            chunk = list(range(k, 16, 4))
            outs = llm.generate(
                [workload[i][0] for i in chunk],
                [SamplingParams(max_tokens=workload[i][1], **GREEDY) for i in chunk],
            )
            results.update({i: o.token_ids for i, o in zip(chunk, outs)})

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [results[i] for i in range(16)] == solo[:16]
        # Closing the stream early aborts the request. It must still be running when the stream
        # closes, however the threads are scheduled: after the first token the loop's step waits
        # until the abort waits for the loop's lock, which the loop then hands it before its next
        # step; the request (as many tokens as the context holds) is far from done then.
        step, loop = llm.engine.step, llm._loop
        produced = threading.Event()

        def gated_step():  # noqa: ANN202
            if produced.is_set():
                _until_a_caller_waits(loop)  # the stream's close
            outs = step()
            if outs:
                produced.set()
            return outs

        llm.engine.step = gated_step
        prompt = [5, 6, 7]
        stream = llm.stream(prompt, SamplingParams(max_tokens=128 - len(prompt), **GREEDY))
        first = next(stream)
        assert first.token_ids
        stream.close()
        assert llm.metrics()["requests_aborted_total"] == 1
        assert_no_leaks(llm.engine)


def test_metrics_snapshot(contents, workload) -> None:
    engine = Engine.from_contents(contents, config=EngineConfig(max_num_seqs=8, max_tokens_per_step=64))
    drive(engine, workload[:10])
    snap = engine.metrics.snapshot()
    assert snap["requests_finished_total"] == 10 and snap["running"] == snap["waiting"] == 0
    assert snap["generated_tokens_total"] == sum(n for _, n in workload[:10])
    assert snap["prompt_tokens_total"] == sum(len(p) for p, _ in workload[:10])
    assert 0 < snap["batch_token_occupancy"] <= 1 and 0 < snap["batch_seq_occupancy"] <= 1
    assert 0 < snap["kv_blocks_peak_used"] <= snap["kv_blocks_total"] == engine.blocks.num_blocks
    assert snap["ttft_seconds_p50"] <= snap["ttft_seconds_p90"] <= snap["ttft_seconds_p99"]
    assert snap["tpot_seconds_p50"] > 0 and snap["generation_tokens_per_s"] > 0
    assert 0 < snap["step_seconds_p50"] <= snap["step_seconds_p99"] <= snap["slowest_step_seconds"]
    m = engine.metrics.finished_requests[0]
    assert m.queue_time >= 0 and m.ttft >= m.queue_time and m.e2e_latency >= m.ttft
    assert all(isinstance(v, float) for v in snap.values())


def test_mgx_run_bench(contents, tmp_path: Path) -> None:
    path = tmp_path / "tiny.mgx"
    write_artifact(path, contents)
    args = ["bench", str(path), "--num-prompts", "12", "--prompt-len", "40-64", "--output-len", "2-6",
            "--shared-prefix", "0.5", "--kv-memory", "256KiB", "--max-num-seqs", "4", "--json", str(tmp_path / "b.json"),
            "--warm-up"]  # fmt: skip
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert "tokens fit" in result.stderr and "req/s" in result.stdout and "ttft ms" in result.stdout
    assert "warm-up: 0 batch sizes" in result.stderr and "graphs captured" not in result.stderr  # the CPU backend records no steps
    report = json.loads((tmp_path / "b.json").read_text())
    assert report["requests"] == 12 and report["output_tokens"] >= 24
    assert report["prefix_hit_rate"] > 0 and 0 < report["peak_kv_use"] <= 1
    assert set(report["ttft_ms"]) == {"p50", "p90", "p99", "mean"}
    assert 0 < report["step_ms"]["p50"] <= report["step_ms"]["p99"] <= report["step_ms"]["max"]
    assert "step ms" in result.stdout
    assert report["graphs"] == {} and "graphs" not in result.stdout  # the CPU backend replays none
    bad = CliRunner().invoke(main, ["bench", str(path), "--kv-memory", "lots"])
    assert bad.exit_code == 1 and "not a memory size" in bad.stderr


def test_bench_reports_the_graph_steps_and_captures_of_its_run_only(contents, monkeypatch) -> None:  # noqa: ANN001
    """``run_bench`` reports what a replaying backend's ``graph_stats`` counted during the run
    (after the warm-up), and the table names it."""
    from mgx.runtime.bench import Workload, format_report, run_bench

    engine = Engine.from_contents(contents)
    calls = iter([{"steps": {"eager": 2, "prefill": 1}, "captures": {"prefill": 1}, "capture_s": {"prefill": 0.5}},
                  {"steps": {"eager": 10, "decode": 5, "prefill": 1}, "captures": {"decode": 1, "prefill": 1},
                   "capture_s": {"decode": 0.75, "prefill": 0.5}}])  # fmt: skip
    monkeypatch.setattr(engine.runner.backend, "graph_stats", lambda: next(calls))
    report = run_bench(engine, Workload(num_prompts=2, prompt_len=(8, 8), output_len=(2, 2)))
    assert report["graphs"] == {"steps": {"eager": 8, "decode": 5, "prefill": 0},
                                "captures": {"decode": 1, "prefill": 0}, "capture_s": {"decode": 0.75, "prefill": 0.0}}
    line = next(x for x in format_report(report).splitlines() if x.startswith("graphs"))
    assert line.split(None, 1)[1] == "steps decode 5, eager 8, prefill 0; captured decode 1 in 0.75 s"


def test_warm_up_runs_each_batch_size_and_prompt_length_the_backend_records_and_leaves_the_engine_as_new(contents, monkeypatch) -> None:  # noqa: ANN001, E501
    engine = Engine.from_contents(contents, config=EngineConfig(max_num_seqs=8, block_size=16, max_tokens_per_step=32))
    backend = engine.runner.backend
    assert backend.warm_batch_sizes(8) == [] and backend.warm_prompt_lengths(32) == []  # the reference backend records none
    assert engine.warm_up()[0] == 0
    monkeypatch.setattr(backend, "warm_batch_sizes", lambda n: [1, 3, n])
    assert engine.max_position == 128
    monkeypatch.setattr(backend, "warm_prompt_lengths", lambda n: [8, n, 100])  # 100 whole: 102 tokens fit, 132 not
    seen: list[tuple[str, int, int]] = []
    runner = engine.runner

    def spy(name: str):  # noqa: ANN202
        real = getattr(runner, name)

        def run(seq_ids, token_ids, *a):  # noqa: ANN001, ANN202
            seen.append((name, len(seq_ids), len(token_ids)))
            return real(seq_ids, token_ids, *a)

        return run

    for name in ("launch_greedy_packed", "step_packed"):  # the greedy path (fused argmax) and the sampling one
        monkeypatch.setattr(runner, name, spy(name))
    monkeypatch.setattr(backend, "drop_graphs", lambda kinds: seen.append(("drop_graphs", *kinds)))
    sizes, seconds = engine.warm_up()
    assert sizes == 3 and seconds >= 0
    # each prompt length twice, alone: whole, then as the chunk after a full step of 32 (nothing taken
    # from the prefix cache: the second copy runs whole again), each copy's last chunk followed by its
    # decode step at that context; then the decode graphs dropped (the batch-1 ones are as wide as
    # those contexts); then each size's one-token prompts in one step, then its decode step. Greedy,
    # then sampling (graphs of their own), whose chunks that sample nothing take the greedy path
    # (False: not the prompt's last chunk).
    decode = (1, 1, True)
    prompts = [[(1, 8, True)], [(1, 32, False), (1, 8, True)], [(1, 32, True)], [(1, 32, False), (1, 32, True)],
               [(1, 32, False), (1, 32, False), (1, 32, False), (1, 4, True)]]  # fmt: skip
    prompt_steps = [step for chunks in prompts for step in [*chunks, decode] * 2]
    size_steps = [(1, 1, True), (1, 1, True), (3, 3, True), (3, 3, True), (8, 8, True), (8, 8, True)]

    def path(sampling: bool, n: int, t: int, last: bool) -> tuple[str, int, int]:
        return ("step_packed" if sampling and last else "launch_greedy_packed", n, t)

    assert seen == [*[path(sampling, *s) for sampling in (False, True) for s in prompt_steps], ("drop_graphs", "decode"),
                    *[path(sampling, *s) for sampling in (False, True) for s in size_steps]]  # fmt: skip
    assert_no_leaks(engine)
    assert engine.metrics.counters.steps == 0 and engine.metrics.snapshot()["requests_finished_total"] == 0
    engine.add_request([5, 6], SamplingParams(max_tokens=1))
    with pytest.raises(EngineError, match="idle engine"):
        engine.warm_up()


def test_generate_prints_the_kv_capacity(contents, tmp_path: Path) -> None:
    path = tmp_path / "tiny.mgx"
    write_artifact(path, contents)
    result = CliRunner().invoke(main, ["generate", str(path), "-p", "the", "-n", "3", "--kv-memory", "1MiB"])
    assert result.exit_code == 0, result.output
    assert "KV cache: 1.0 MiB -> 4,096 tokens fit (256 blocks of 16, 256 B/token)" in result.stderr


def test_streamed_outputs_in_a_batch_equal_each_alone(contents, workload) -> None:
    """Text, finish and stop reasons (not only ids) through the batched step: mixed lengths, stop ids
    and stop strings, chunked prefill, preemption, requests finishing mid-batch."""
    tok = Engine.from_contents(contents).tokenizer
    jobs = []
    for i, (prompt, n) in enumerate(workload):
        stop = [tok.decode([prompt[-1]])[-1:]] if i % 3 == 0 else []  # a character that may well recur
        jobs.append((prompt, SamplingParams(max_tokens=n, temperature=0.0, stop=stop, stop_token_ids=(prompt[0],))))

    def streams(engine: Engine, todo: list, stagger: random.Random | None) -> list[tuple]:
        got: dict[str, list] = {}
        rids = []
        while todo or engine.has_unfinished():
            for _ in range(len(todo) if stagger is None else stagger.randint(0, 3)):
                if todo:
                    rids.append(engine.add_request(*todo.pop(0)))
            for out in engine.step():
                got.setdefault(out.request_id, []).append(
                    (out.text, out.token_ids, out.finished, out.finish_reason, out.stop_reason)
                )
        return [tuple(map(tuple, got[r])) for r in rids]

    alone = []
    for prompt, params in jobs:
        engine = Engine.from_contents(contents, config=EngineConfig(prefix_caching=False))
        alone += streams(engine, [(prompt, params)], None)
    small = EngineConfig(kv_memory=8 * 16 * 256, max_num_seqs=16, max_tokens_per_step=64)
    engine = Engine.from_contents(contents, config=small)
    assert streams(engine, list(jobs), random.Random(3)) == alone
    assert engine.metrics.counters.preemptions > 0
    assert {s[-1][3] for s in alone} == {"stop", "length"}
    assert_no_leaks(engine)


def test_the_warm_up_line_counts_the_graphs_it_captured_by_kind() -> None:
    from mgx.runtime.cli import warm_up_line

    before = {"decode": 2, "prefill": 0, "mixed": 1}
    after = {"decode": 22, "prefill": 28, "mixed": 1}
    assert warm_up_line(8, 23.24, before, after) == "warm-up: 8 batch sizes in 23.2 s; graphs captured: decode 20, prefill 28"
    assert warm_up_line(0, 0.01, {}, {}) == "warm-up: 0 batch sizes in 0.0 s"


def test_a_caller_waiting_for_the_engine_loop_gets_in_before_its_next_step(contents) -> None:  # noqa: ANN001
    """``EngineLoop`` hands its lock to a thread waiting for it (an abort, a submission, metrics)
    before its next step: a lock alone is no queue, and under load the loop thread, taking it again
    right after each step, kept it for a whole request's steps while an abort waited."""
    from mgx.runtime.async_engine import EngineLoop

    engine = Engine.from_contents(contents)
    loop = EngineLoop(engine)
    events: list[str] = []
    step = engine.step
    waiting = threading.Event()

    def gated_step():  # noqa: ANN202
        events.append("step")
        if len(events) == 3:  # hold this step until the caller waits for the lock
            waiting.set()
            _until_a_caller_waits(loop)
        return step()

    engine.step = gated_step
    done = threading.Event()
    loop.submit([5, 6, 7], SamplingParams(max_tokens=40, **GREEDY), lambda out: out.finished and done.set())
    assert waiting.wait(60)
    with loop._between_steps():  # as abort() and metrics() take the lock: it waits while step 3 runs
        events.append("caller")
    assert done.wait(60)
    loop.close()
    assert events[:4] == ["step", "step", "step", "caller"], events[:6]


def _until_a_caller_waits(loop) -> None:  # noqa: ANN001
    """Inside an engine step (the loop's lock held): until another thread waits for that lock."""
    deadline = time.monotonic() + 60
    while not loop._callers:
        assert time.monotonic() < deadline, "no caller came"
        time.sleep(0.001)
