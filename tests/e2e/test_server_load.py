"""Load on a real server: 64 concurrent streaming clients, 384 requests, one in eight cancelled
mid-stream. No server error, every completed stream well-formed and equal to the engine's offline
output, and every KV block free afterwards."""

from __future__ import annotations

import asyncio
import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path

import httpx2 as httpx
import pytest
from _server_testing import MODEL, running_server

from mgx.formats.artifact import write_artifact
from mgx.runtime import LLM, Engine

from _tiny_graph import tiny_contents

CLIENTS, REQUESTS, CANCEL_EVERY = 64, 384, 8
WORDS = "the cat sat on mat dog ate bone héllo wörld ça va naïve café 日本語 emoji".split()
SYSTEM = "the cat sat on the mat and the dog ate the bone"  # a shared prefix: the prefix cache gets hits


@dataclass
class Job:
    index: int
    chat: bool
    text: str
    max_tokens: int
    temperature: float
    seed: int | None
    include_usage: bool
    cancel: bool

    def body(self) -> dict:
        body = {
            "model": MODEL,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "stream": True,
        }
        if self.seed is not None:
            body["seed"] = self.seed
        if self.include_usage:
            body["stream_options"] = {"include_usage": True}
        if self.chat:
            body["messages"] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": self.text}]
        else:
            body["prompt"] = f"{SYSTEM} {self.text}"
        return body


def make_jobs() -> list[Job]:
    rng = random.Random(0)
    jobs = []
    for i in range(REQUESTS):
        sampled = rng.random() < 0.5
        jobs.append(Job(
            index=i, chat=rng.random() < 0.5, text=" ".join(rng.choices(WORDS, k=rng.randint(1, 12))),
            max_tokens=rng.randint(2, 12), temperature=0.8 if sampled else 0.0, seed=i if sampled else None,
            include_usage=rng.random() < 0.5, cancel=i % CANCEL_EVERY == 3,
        ))  # fmt: skip
    return jobs


def offline_results(artifact: Path, jobs: list[Job]) -> list:
    engine = Engine(artifact)
    tok = engine.tokenizer
    prompts, params = [], []
    for job in jobs:
        if job.chat:
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": job.text}]
            prompts.append(tok.encode(tok.render_chat(messages), add_special_tokens=False))
        else:
            prompts.append(engine.encode_prompt(f"{SYSTEM} {job.text}"))
        params.append(
            engine.sampling_params(max_tokens=job.max_tokens, temperature=job.temperature, seed=job.seed)
        )
    with LLM(engine) as llm:
        return llm.generate(prompts, params)


@dataclass
class Stream:
    text: str
    finish_reason: str | None
    usage: dict | None
    completed: bool


async def run_job(client, job: Job) -> Stream:  # noqa: ANN001
    path = "/v1/chat/completions" if job.chat else "/v1/completions"
    async with client.stream("POST", path, json=job.body()) as r:
        assert r.status_code == 200, await r.aread()
        assert r.headers["content-type"].startswith("text/event-stream")
        events, buffer = [], ""
        async for chunk in r.aiter_text():
            buffer += chunk
            while "\n\n" in buffer:
                event, buffer = buffer.split("\n\n", 1)
                assert event.startswith("data: ") and "\n" not in event, f"malformed event {event!r}"
                events.append(event[6:])
            if job.cancel and len(events) >= 2:
                return Stream("", None, None, completed=False)  # leaving the block closes the connection
        assert buffer == "", f"trailing bytes {buffer!r}"
    return check_stream(job, events)


def check_stream(job: Job, events: list[str]) -> Stream:
    assert events and events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    chunks = [json.loads(e) for e in events[:-1]]
    assert len({c["id"] for c in chunks}) == 1 and {c["model"] for c in chunks} == {MODEL}
    assert {c["object"] for c in chunks} == {"chat.completion.chunk" if job.chat else "text_completion"}
    usage = None
    if job.include_usage:
        *chunks, last = chunks
        assert last["choices"] == [] and set(last["usage"]) == {
            "prompt_tokens",
            "completion_tokens",
            "total_tokens",
        }
        assert all(c["usage"] is None for c in chunks)
        usage = last["usage"]
    else:
        assert all("usage" not in c for c in chunks)
    choices = [c["choices"][0] for c in chunks]
    assert all(len(c["choices"]) == 1 and c["choices"][0]["index"] == 0 for c in chunks)
    reasons = [c["finish_reason"] for c in choices]
    assert all(r is None for r in reasons[:-1]) and reasons[-1] in ("stop", "length")
    if job.chat:
        assert choices[0]["delta"] == {"role": "assistant", "content": ""}
        text = "".join(c["delta"].get("content", "") for c in choices)
    else:
        text = "".join(c["text"] for c in choices)
    return Stream(text, reasons[-1], usage, completed=True)


async def load(url: str, jobs: list[Job]) -> list[Stream]:
    todo: asyncio.Queue[Job] = asyncio.Queue()
    for job in jobs:
        todo.put_nowait(job)
    results: dict[int, Stream] = {}
    limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=CLIENTS)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:

        async def worker() -> None:
            while not todo.empty():
                job = todo.get_nowait()
                results[job.index] = await run_job(client, job)

        await asyncio.wait_for(asyncio.gather(*(worker() for _ in range(CLIENTS))), timeout=300)
    return [results[i] for i in range(len(jobs))]


def test_64_concurrent_streaming_clients(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    artifact = tmp_path / "tiny.mgx"
    write_artifact(artifact, tiny_contents())
    jobs = make_jobs()
    want = offline_results(artifact, jobs)
    caplog.set_level(logging.WARNING)
    with running_server(artifact) as s:
        streams = asyncio.run(load(s.url, jobs))
        engine, server = s.engine, s.server
        completed = [(j, st) for j, st in zip(jobs, streams) if st.completed]
        assert len(completed) == REQUESTS - REQUESTS // CANCEL_EVERY
        for job, st in completed:
            w = want[job.index]
            assert (st.text, st.finish_reason) == (w.text, w.finish_reason), job
            if st.usage is not None:
                assert st.usage["completion_tokens"] == len(w.token_ids)
                assert st.usage["prompt_tokens"] == w.prompt_tokens
        # every cancelled request is gone and every block free (at most cached for reuse)
        assert not engine.has_unfinished() and server.pending == 0
        b = engine.blocks
        assert b.num_used_blocks == 0 and b.num_free_blocks == b.num_blocks
        assert all(r == 0 for r in b.blocks.ref_count)
        assert engine.metrics.counters.prompt_tokens > 0 and engine.metrics.prefix_hit_rate > 0
        statuses = {status for (_, status) in server.metrics.responses}
        assert statuses == {200}, server.metrics.responses
        aborted = engine.metrics.counters.requests_aborted
        assert aborted <= REQUESTS // CANCEL_EVERY  # a cancel can come after a 2-token request finished
        assert engine.metrics.counters.requests_finished + aborted == REQUESTS
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]
