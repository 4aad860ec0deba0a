"""Concurrent front ends over one engine: ``AsyncEngine`` (asyncio) and ``LLM`` (threads, scripts).

Both hand requests to an ``EngineLoop``: a background thread that owns the engine, adds queued
requests, runs steps while anything is unfinished and delivers each output to its request's sink.
Callers never touch the engine between steps except through the loop's lock (aborts), so requests
can come and go from any thread while the batch keeps running.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

from mgx.formats.artifact import ArtifactContents, LoadedArtifact

from .backend import Backend
from .config import EngineConfig
from .engine import Engine
from .errors import EngineError
from .request import GenerationResult, RequestOutput, Timings
from .sampler import SamplingParams

__all__ = ["AsyncEngine", "EngineLoop", "LLM"]

Prompt = str | Sequence[int]
Sink = Callable[[RequestOutput | BaseException], None]
Source = str | os.PathLike[str] | LoadedArtifact | ArtifactContents | Engine


class EngineLoop:
    """A background thread that steps an engine while requests are unfinished."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._lock = threading.Lock()  # held while the engine steps or changes
        self._wake = threading.Condition(self._lock)
        self._callers = 0  # other threads waiting for the lock (``_between_steps``)
        self._callers_lock = threading.Lock()
        self._inbox: list[tuple[str, list[int], SamplingParams]] = []  # added, not yet in the engine
        self._sinks: dict[str, Sink] = {}
        self._ids = itertools.count()
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="mgx-engine", daemon=True)
        self._thread.start()

    def submit(
        self,
        prompt: Prompt,
        params: SamplingParams | None,
        sink: Sink,
        *,
        request_id: str | None = None,
        chat: bool = False,
    ) -> str:
        """Validate a request here (errors raise in the caller), queue it, and return its id."""
        prompt_ids, params = self.engine.prepare(prompt, params, chat=chat)
        with self._between_steps():
            if self._closed or self._error is not None:
                raise EngineError(f"the engine is not running ({self._error or 'closed'})")
            request_id = f"async-{next(self._ids)}" if request_id is None else request_id
            if request_id in self._sinks:
                raise EngineError(f"request id {request_id!r} is already in use")
            self._sinks[request_id] = sink
            self._inbox.append((request_id, prompt_ids, params))
            self._wake.notify()
        return request_id

    def abort(self, request_id: str) -> bool:
        """Abort now (waiting at most for the step in flight); its blocks are free when this returns."""
        with self._between_steps():
            sink = self._sinks.pop(request_id, None)
            queued = [r for r in self._inbox if r[0] == request_id]
            for r in queued:
                self._inbox.remove(r)
            out = self.engine.abort(request_id)
        if sink is not None:
            sink(out or RequestOutput(request_id, "", [], None, True, "abort"))
        return sink is not None

    def metrics(self) -> dict[str, float]:
        with self._between_steps():
            return self.engine.metrics.snapshot()

    def graph_stats(self) -> dict[str, dict[str, float]]:
        """The backend's steps by path and graph captures (``Backend.graph_stats``), between steps."""
        with self._between_steps():
            return self.engine.runner.backend.graph_stats()

    @property
    def failure(self) -> BaseException | None:
        """What stopped the loop, when an engine step raised (every request then fails at once)."""
        return self._error

    def close(self) -> None:
        """Stop the thread; unfinished requests are aborted."""
        with self._between_steps():
            self._closed = True
            self._wake.notify()
        self._thread.join()
        for request_id in list(self._sinks):
            try:
                self.abort(request_id)
            except Exception:  # a caller that is gone cannot be told
                pass

    @contextlib.contextmanager
    def _between_steps(self) -> Iterator[None]:
        """The loop's lock, for a thread other than the loop's: the loop lets it in before its next
        step. A lock alone is no queue: the loop thread takes it again right after each step, and
        under load it won it step after step (an abort waited out a request of 124 steps)."""
        with self._callers_lock:
            self._callers += 1
        try:
            self._lock.acquire()
        finally:
            with self._callers_lock:
                self._callers -= 1
        try:
            yield
        finally:
            self._lock.release()

    def _let_callers_in(self) -> None:
        """Before a step: wait (at most 50 ms) until the threads waiting for the lock have taken it."""
        deadline = time.monotonic() + 0.05
        while self._callers and time.monotonic() < deadline:
            time.sleep(0.0002)

    def _run(self) -> None:
        while True:
            if self._callers:
                self._let_callers_in()
            with self._wake:
                while not self._closed and not self._inbox and not self.engine.has_unfinished():
                    self._wake.wait()
                if self._closed:
                    return
                try:
                    for request_id, prompt_ids, params in self._inbox:
                        self.engine.add_request(prompt_ids, params, request_id=request_id)
                    self._inbox.clear()
                    outputs = self.engine.step()
                except BaseException as e:  # a bug: fail every request rather than hang them
                    self._error = e
                    sinks, self._sinks = list(self._sinks.values()), {}
                    for sink in sinks:
                        sink(e)
                    return
                deliveries = [(self._sinks.get(o.request_id), o) for o in outputs]
                for o in outputs:
                    if o.finished:
                        self._sinks.pop(o.request_id, None)
            for sink, out in deliveries:
                if sink is None:
                    continue
                try:
                    sink(out)
                except Exception:  # its caller is gone (say, its event loop closed): stop the request
                    with self._lock:
                        self._sinks.pop(out.request_id, None)
                        self.engine.abort(out.request_id)


def _engine(source: Source, backend: Backend | str, config: EngineConfig | None) -> Engine:
    return source if isinstance(source, Engine) else Engine(source, backend=backend, config=config)


class AsyncEngine:
    """asyncio front end: ``async for out in engine.generate(prompt, params): ...``."""

    def __init__(
        self, source: Source, *, backend: Backend | str = "reference", config: EngineConfig | None = None
    ) -> None:
        self.engine = _engine(source, backend, config)
        self._loop = EngineLoop(self.engine)

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        chat: bool = False,
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as they come (text and token deltas); the last has ``finished``.

        Leaving the loop early (break, cancellation) aborts the request and frees its blocks.
        """
        aloop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        rid = self._loop.submit(
            prompt,
            params,
            lambda out: aloop.call_soon_threadsafe(outputs.put_nowait, out),
            request_id=request_id,
            chat=chat,
        )
        finished = False
        try:
            while not finished:
                out = await outputs.get()
                if isinstance(out, BaseException):
                    raise EngineError(f"the engine failed: {out!r}") from out
                finished = out.finished
                yield out
        finally:
            if not finished:
                await asyncio.to_thread(self._loop.abort, rid)

    async def abort(self, request_id: str) -> bool:
        """Abort a request; its blocks are free when this returns. False if it was not running."""
        return await asyncio.to_thread(self._loop.abort, request_id)

    def metrics(self) -> dict[str, float]:
        """A snapshot of the engine's metrics (see ``EngineMetrics.snapshot``)."""
        return self._loop.metrics()

    def close(self) -> None:
        self._loop.close()


class LLM:
    """Synchronous, thread-safe front end for scripts; requests from all threads share the batch."""

    def __init__(
        self, source: Source, *, backend: Backend | str = "reference", config: EngineConfig | None = None
    ) -> None:
        self.engine = _engine(source, backend, config)
        self._loop = EngineLoop(self.engine)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        chat: bool = False,
    ) -> list[GenerationResult]:
        """Run all prompts as one batch (a prompt is text or a list of ids); results in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):  # type: ignore[index]
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        per = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(per) != len(prompts):
            raise EngineError(f"{len(prompts)} prompts but {len(per)} sampling params")
        prepared = [self.engine.prepare(p, sp, chat=chat) for p, sp in zip(prompts, per)]  # all valid first
        streams = [self._submit(ids, sp, False) for ids, sp in prepared]
        results: list[GenerationResult] = []
        try:
            for rid, q in streams:
                results.append(self._collect(rid, q))
            return results
        finally:
            for rid, _ in streams[len(results) :]:
                self._loop.abort(rid)  # collecting failed (say, Ctrl-C): free the rest now

    def stream(
        self, prompt: Prompt, params: SamplingParams | None = None, *, chat: bool = False
    ) -> Iterator[RequestOutput]:
        """One request's outputs as they come; closing the iterator early aborts it."""
        rid, q = self._submit(prompt, params, chat)
        finished = False
        try:
            while not finished:
                out = _get(q)
                finished = out.finished
                yield out
        finally:
            if not finished:
                self._loop.abort(rid)

    def abort(self, request_id: str) -> bool:
        return self._loop.abort(request_id)

    def metrics(self) -> dict[str, float]:
        return self._loop.metrics()

    def close(self) -> None:
        self._loop.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _submit(
        self, prompt: Prompt, params: SamplingParams | None, chat: bool
    ) -> tuple[str, queue.SimpleQueue]:
        q: queue.SimpleQueue = queue.SimpleQueue()
        return self._loop.submit(prompt, params, q.put, chat=chat), q

    def _collect(self, request_id: str, q: queue.SimpleQueue) -> GenerationResult:
        text, ids, logprobs = [], [], []
        while True:
            out = _get(q)
            text.append(out.text)
            ids.extend(out.token_ids)
            logprobs.extend(out.logprobs or [])
            if out.finished:
                break
        m = out.metrics
        timings = Timings(self.engine.load_seconds)
        if m is not None:
            timings = Timings(
                self.engine.load_seconds,
                m.prefill_seconds,
                m.decode_seconds,
                m.prompt_tokens,
                max(len(ids) - 1, 0),
            )
        return GenerationResult(
            text="".join(text),
            token_ids=ids,
            finish_reason=out.finish_reason or "abort",
            prompt_tokens=m.prompt_tokens if m else 0,
            timings=timings,
            stop_reason=out.stop_reason,
            logprobs=logprobs or None,
            metrics=m,
            request_id=request_id,
        )


def _get(q: queue.SimpleQueue) -> RequestOutput:
    out = q.get()
    if isinstance(out, BaseException):
        raise EngineError(f"the engine failed: {out!r}") from out
    return out
