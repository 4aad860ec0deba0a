"""The HTTP layer: a Starlette app over one ``EngineLoop``, served by uvicorn.

Each HTTP request becomes one engine request per choice (``n`` times each prompt). Their outputs
arrive on one asyncio queue; a streaming response turns them into server-sent events as they come,
a plain one collects them. Whatever way a response ends (done, client gone, shutdown), its
unfinished engine requests are aborted before it returns, so their KV blocks are free at once.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import signal
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from importlib import resources
from typing import Any

import anyio
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from ..async_engine import EngineLoop
from ..engine import Engine
from ..request import RequestOutput
from . import prometheus
from .protocol import APIError, GenerationPlan, TokenText, parse_chat, parse_completion, usage

__all__ = ["Server", "ServerConfig", "serve"]

log = logging.getLogger("mgx.server")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """How the HTTP layer admits and answers requests."""

    model_names: tuple[str, ...]  # ids /v1/models lists and requests may name; the first is the default
    api_key: str | None = None  # when set, every endpoint but /health needs "Authorization: Bearer <key>"
    max_pending: int = 256  # engine requests (choices) held at once, running or queued; more get 429
    retry_after_s: int = 1  # the Retry-After a 429/503 suggests
    max_body_bytes: int = 8 * 1024 * 1024  # larger request bodies get 413

    def __post_init__(self) -> None:
        if not self.model_names:
            raise ValueError("model_names must name at least one model")
        if self.max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {self.max_pending}")
        if self.api_key == "":
            raise ValueError("api_key must not be empty")


class Server:
    """The OpenAI-compatible app over one engine (``server.app`` is the ASGI app)."""

    def __init__(self, engine: Engine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.loop = EngineLoop(engine)
        self.metrics = prometheus.ServerMetrics()
        self.token_text = TokenText(engine)
        self.pending = 0  # engine requests admitted and not yet finished (event-loop thread only)
        self.draining = False  # set on SIGTERM: new requests get 503
        self.started = time.time()
        self._closed = False
        routes = [
            self._route("POST", "/v1/completions", self.completions),
            self._route("POST", "/v1/chat/completions", self.chat_completions),
            self._route("GET", "/v1/models", self.models),
            self._route("GET", "/v1/models/{model:path}", self.model),
            self._route("GET", "/health", self.health, auth=False),  # load balancers probe it without a key
            self._route("GET", "/metrics", self.prometheus),
            self._route("GET", "/dashboard", self.dashboard, query_key=True),
            self._route("GET", "/dashboard/data", self.dashboard_data),
        ]
        self.app = Starlette(
            routes=routes,
            exception_handlers={HTTPException: self._http_error},
            lifespan=self._lifespan,
        )

    def close(self) -> None:
        """Stop the engine thread; unfinished requests are aborted. Safe to call twice."""
        if not self._closed:
            self._closed = True
            self.loop.close()

    # -- endpoints ------------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        body = await self._json(request)
        models = self.config.model_names
        plan = await anyio.to_thread.run_sync(parse_completion, self.engine, body, models)
        return await self._respond(request, plan)

    async def chat_completions(self, request: Request) -> Response:
        body = await self._json(request)
        models = self.config.model_names
        plan = await anyio.to_thread.run_sync(parse_chat, self.engine, body, models)
        return await self._respond(request, plan)

    async def models(self, request: Request) -> Response:
        return JSONResponse(
            {"object": "list", "data": [self._model_card(m) for m in self.config.model_names]}
        )

    async def model(self, request: Request) -> Response:
        name = request.path_params["model"]
        if name not in self.config.model_names:
            raise APIError(404, f"The model '{name}' does not exist.", param="model", code="model_not_found")
        return JSONResponse(self._model_card(name))

    async def health(self, request: Request) -> Response:
        failure = self.loop.failure
        if failure is not None:  # the engine thread is gone: a load balancer must stop sending here
            detail = f"{type(failure).__name__}: {failure}"
            return JSONResponse({"status": "failed", "error": detail}, status_code=503)
        if self.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def prometheus(self, request: Request) -> Response:
        snap, graphs = await anyio.to_thread.run_sync(lambda: (self.loop.metrics(), self.loop.graph_stats()))
        text = prometheus.render(self.metrics, snap, self._extra(snap), graphs)
        return Response(text, media_type=prometheus.CONTENT_TYPE)

    async def dashboard(self, request: Request) -> Response:
        page = resources.files(__package__).joinpath("dashboard.html").read_text("utf-8")
        return HTMLResponse(page, headers={"Cache-Control": "no-store"})

    async def dashboard_data(self, request: Request) -> Response:
        snap = await anyio.to_thread.run_sync(self.loop.metrics)
        cfg = self.engine.config
        data = {
            "time": time.time(),
            "uptime_s": time.time() - self.started,
            "model": self.config.model_names[0],
            "max_num_seqs": cfg.max_num_seqs,
            "max_pending": self.config.max_pending,
            "http_requests_total": sum(self.metrics.responses.values()),
            "requests_rejected_total": self.metrics.rejected,
            "requests_cancelled_total": self.metrics.cancelled,
            **self._extra(snap),
            **snap,
        }
        # JSON has no NaN: a percentile over no requests yet is null
        data = {k: (None if isinstance(v, float) and v != v else v) for k, v in data.items()}
        return JSONResponse(data, headers={"Cache-Control": "no-store"})

    # -- generation -----------------------------------------------------------------------------

    async def _respond(self, request: Request, plan: GenerationPlan) -> Response:
        n = len(plan.choices)
        if self.draining:
            self.metrics.rejected += 1
            raise APIError(503, "The server is shutting down; retry on another replica.", type="server_error",
                           code="shutting_down", headers={"Retry-After": str(self.config.retry_after_s)})  # fmt: skip
        if n > self.config.max_pending:
            raise APIError(400, f"This request asks for {n} choices; the server holds at most "
                           f"{self.config.max_pending} at once.", param="n")  # fmt: skip
        if self.pending + n > self.config.max_pending:
            self.metrics.rejected += 1
            raise APIError(
                429, f"The server is at capacity ({self.pending} requests in flight, at most "
                f"{self.config.max_pending}); retry after {self.config.retry_after_s} s.",
                type="rate_limit_error", code="queue_full",
                headers={"Retry-After": str(self.config.retry_after_s)},
            )  # fmt: skip
        run = _Run(self, plan)
        await run.start()
        if plan.stream:
            return _EventStream(
                self._stream(run), on_close=run.close,
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )  # fmt: skip
        result: dict[str, Any] | None = None
        try:
            async with anyio.create_task_group() as tg:

                async def collect() -> None:
                    nonlocal result
                    result = await self._collect(run)
                    tg.cancel_scope.cancel()

                tg.start_soon(collect)
                await _disconnected(request.receive)
                tg.cancel_scope.cancel()  # the client left: stop collecting, abort below
        finally:
            await run.close()
        if result is None:
            return Response(status_code=499)  # nobody is listening; uvicorn drops it
        return JSONResponse(result)

    async def _collect(self, run: _Run) -> dict[str, Any]:
        plan = run.plan
        texts: dict[int, list[str]] = {c.index: [] for c in plan.choices}
        lps: dict[int, list[Any]] = {c.index: [] for c in plan.choices}
        tokens: dict[int, int] = dict.fromkeys(texts, 0)
        reasons: dict[int, str] = {}
        async for j, out in run.outputs():
            texts[j].append(out.text)
            lps[j].extend(out.logprobs or [])
            tokens[j] += len(out.token_ids)
            if out.finished:
                reasons[j] = _finish_reason(out)
        choices = []
        for c in plan.choices:
            j = c.index
            text = "".join(texts[j])
            if plan.kind == "chat":
                lp = (
                    {"content": self.token_text.chat_logprobs(lps[j]), "refusal": None}
                    if plan.logprobs
                    else None
                )
                message = {"role": "assistant", "content": text, "refusal": None}
                choices.append({"index": j, "message": message, "logprobs": lp, "finish_reason": reasons[j]})
            else:
                lp = self.token_text.completion_logprobs(lps[j]) if plan.logprobs else None
                choices.append({"index": j, "text": text, "logprobs": lp, "finish_reason": reasons[j]})
        return {
            **_header(plan, chunk=False),
            "choices": choices,
            "usage": usage(plan.prompt_tokens, sum(tokens.values())),
        }

    async def _stream(self, run: _Run) -> AsyncIterator[str]:
        plan, chat = run.plan, run.plan.kind == "chat"
        header = _header(plan, chunk=True)
        extra = {"usage": None} if plan.include_usage else {}
        offsets = {c.index: 0 for c in plan.choices}
        completion_tokens = 0

        def event(choice: dict[str, Any]) -> str:
            return _sse({**header, "choices": [choice], **extra})

        try:
            if chat:
                for c in plan.choices:
                    delta = {"role": "assistant", "content": ""}
                    yield event({"index": c.index, "delta": delta, "logprobs": None, "finish_reason": None})
            async for j, out in run.outputs():
                completion_tokens += len(out.token_ids)
                lp = None
                if plan.logprobs and out.logprobs:
                    if chat:
                        lp = {"content": self.token_text.chat_logprobs(out.logprobs), "refusal": None}
                    else:
                        lp = self.token_text.completion_logprobs(out.logprobs, offsets[j])
                        offsets[j] += sum(len(t) for t in lp["tokens"])
                if out.text or lp is not None:
                    if chat:
                        yield event(
                            {
                                "index": j,
                                "delta": {"content": out.text},
                                "logprobs": lp,
                                "finish_reason": None,
                            }
                        )
                    else:
                        yield event({"index": j, "text": out.text, "logprobs": lp, "finish_reason": None})
                if out.finished:
                    reason = _finish_reason(out)
                    if chat:
                        yield event({"index": j, "delta": {}, "logprobs": None, "finish_reason": reason})
                    else:
                        yield event({"index": j, "text": "", "logprobs": None, "finish_reason": reason})
            if plan.include_usage:
                yield _sse({**header, "choices": [], "usage": usage(plan.prompt_tokens, completion_tokens)})
        except _EngineFailed as e:
            yield _sse(APIError(500, str(e), type="server_error", code="engine_error").body())
        yield "data: [DONE]\n\n"

    # -- plumbing -------------------------------------------------------------------------------

    def _route(
        self,
        method: str,
        path: str,
        fn: Callable[[Request], Awaitable[Response]],
        *,
        auth: bool = True,
        query_key: bool = False,
    ) -> Route:
        """A route whose handler checks the API key, answers errors in OpenAI's shape and is counted."""

        async def handler(request: Request) -> Response:
            try:
                if auth:
                    self._authorize(request, query_key)
                response = await fn(request)
            except APIError as e:
                response = _error(e)
            except Exception:  # a bug: log it, answer in the API's shape
                log.exception("error while serving %s", request.url.path)
                response = _error(APIError(500, "The server had an error while processing your request.",
                                           type="server_error"))  # fmt: skip
            self.metrics.count_response(path, response.status_code)
            return response

        return Route(path, handler, methods=[method])

    def _authorize(self, request: Request, query_key: bool) -> None:
        key = self.config.api_key
        if key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = token.strip() if scheme.lower() == "bearer" else None
        if given is None and query_key:  # a browser cannot send a header when it opens the dashboard
            given = request.query_params.get("api_key")
        if given is None or not hmac.compare_digest(given.encode(), key.encode()):
            raise APIError(
                401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'." if given is None
                else "Incorrect API key provided.", code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )  # fmt: skip

    async def _json(self, request: Request) -> Any:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.config.max_body_bytes:
            raise APIError(413, f"The request body is larger than {self.config.max_body_bytes} bytes.")
        raw = await request.body()
        if len(raw) > self.config.max_body_bytes:
            raise APIError(413, f"The request body is larger than {self.config.max_body_bytes} bytes.")
        try:
            return json.loads(raw)
        except ValueError as e:
            raise APIError(
                400,
                f"We could not parse the JSON body of your request ({e}). The body must be valid JSON.",
                code="invalid_json",
            ) from None

    async def _http_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        self.metrics.count_response("other", exc.status_code)
        message = "Method not allowed." if exc.status_code == 405 else f"Unknown path: {request.url.path}"
        return _error(
            APIError(exc.status_code, message, code="not_found" if exc.status_code == 404 else None)
        )

    def _model_card(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": int(self.started), "owned_by": "mgx",
                "max_model_len": self.engine.max_position}  # fmt: skip

    def _extra(self, snap: dict[str, float]) -> dict[str, float]:
        total = snap.get("kv_blocks_total", 0.0)
        return {
            "kv_cache_usage_ratio": snap.get("kv_blocks_used", 0.0) / total if total else 0.0,
            "batch_occupancy_now": snap.get("running", 0.0) / self.engine.config.max_num_seqs,
            "pending_requests": float(self.pending),
            "max_pending_requests": float(self.config.max_pending),
        }

    def _lifespan(self, app: Starlette) -> Any:
        server = self

        class Lifespan:
            async def __aenter__(self) -> None:
                return None

            async def __aexit__(self, *exc: Any) -> None:
                await anyio.to_thread.run_sync(server.close)

        return Lifespan()


class _EngineFailed(Exception):
    pass


class _Run:
    """The engine requests of one HTTP request: submitted together, outputs on one queue, aborted together."""

    def __init__(self, server: Server, plan: GenerationPlan) -> None:
        self.server = server
        self.plan = plan
        self.queue: asyncio.Queue[tuple[int, RequestOutput | BaseException]] = asyncio.Queue()
        self.request_ids: dict[int, str] = {}  # choice index -> engine request id, once submitted
        self.finished: set[int] = set()
        self.closed = False
        server.pending += len(plan.choices)

    async def start(self) -> None:
        aloop = asyncio.get_running_loop()
        loop, queue = self.server.loop, self.queue

        def sink(j: int) -> Callable[[RequestOutput | BaseException], None]:
            return lambda out: aloop.call_soon_threadsafe(queue.put_nowait, (j, out))

        def submit() -> None:  # in a thread: submitting waits for the engine step in flight
            for c in self.plan.choices:
                rid = f"{self.plan.id}-{c.index}"
                loop.submit(c.prompt_ids, c.params, sink(c.index), request_id=rid)
                self.request_ids[c.index] = rid

        try:
            await anyio.to_thread.run_sync(submit)  # not cancellable: request_ids is complete after it
        except Exception as e:
            await self.close()
            raise APIError(503, f"The engine cannot take requests: {e}", type="server_error",
                           code="engine_unavailable") from None  # fmt: skip

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, output) as they come, until every choice finished."""
        while len(self.finished) < len(self.plan.choices):
            j, out = await self.queue.get()
            if j in self.finished:
                continue  # an abort's final output after the request already finished
            if isinstance(out, BaseException):
                raise _EngineFailed(f"the engine failed: {out!r}")
            if out.finished:
                self.finished.add(j)
                m = out.metrics
                if m is not None and out.finish_reason != "abort":
                    self.server.metrics.observe_request(m.ttft, m.tpot, m.e2e_latency)
            yield j, out

    async def close(self) -> None:
        """Abort what is unfinished (its blocks are free when this returns); release the admission."""
        if self.closed:
            return
        self.closed = True
        server = self.server
        server.pending -= len(self.plan.choices)
        unfinished = [rid for j, rid in self.request_ids.items() if j not in self.finished]
        if unfinished:
            server.metrics.cancelled += len(unfinished)
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(lambda: [server.loop.abort(r) for r in unfinished])


class _EventStream(StreamingResponse):
    """Server-sent events that stop (and clean up) as soon as the client disconnects.

    Starlette watches for the disconnect only under some ASGI versions; this always does, and runs
    ``on_close`` however the stream ends, even if it never started.
    """

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], *, on_close: Callable[[], Awaitable[None]], **kw: Any):
        super().__init__(content, **kw)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:  # the client went away while we wrote
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await _disconnected(receive)
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self._on_close()


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _header(plan: GenerationPlan, *, chunk: bool) -> dict[str, Any]:
    if plan.kind == "chat":
        return {"id": f"chatcmpl-{plan.id}", "object": "chat.completion.chunk" if chunk else "chat.completion",
                "created": plan.created, "model": plan.model, "system_fingerprint": None}  # fmt: skip
    return {"id": f"cmpl-{plan.id}", "object": "text_completion", "created": plan.created, "model": plan.model,
            "system_fingerprint": None}  # fmt: skip


def _finish_reason(out: RequestOutput) -> str:
    # "abort" only reaches a client when the server stopped the request (shutdown timeout)
    return out.finish_reason or "abort"


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


# -- running it -------------------------------------------------------------------------------------


class _Uvicorn(uvicorn.Server):
    """uvicorn, but SIGTERM first turns new requests away (503) and the process then exits 0.

    Stock uvicorn re-raises the signal after its graceful shutdown, which ends the process with
    status 143; a supervisor reads that as a crash.
    """

    def __init__(self, config: uvicorn.Config, on_signal: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_signal = on_signal

    def handle_exit(self, sig: int, frame: Any) -> None:
        self._on_signal()
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C: stop waiting
        else:
            self.should_exit = True


def uvicorn_server(
    server: Server, *, host: str = "127.0.0.1", port: int = 8000, shutdown_timeout: float = 30.0,
    log_level: str = "info", access_log: bool = False,
) -> uvicorn.Server:  # fmt: skip
    """A uvicorn server for ``server.app``; SIGTERM drains for up to ``shutdown_timeout`` seconds."""

    def drain() -> None:
        server.draining = True

    config = uvicorn.Config(
        server.app, host=host, port=port, log_level=log_level, access_log=access_log,
        timeout_graceful_shutdown=shutdown_timeout, lifespan="on", loop="asyncio", http="h11",
    )  # fmt: skip
    return _Uvicorn(config, drain)


def serve(
    engine: Engine,
    config: ServerConfig,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    shutdown_timeout: float = 30.0,
    log_level: str = "info",
    access_log: bool = False,
    sock: socket.socket | None = None,
) -> None:
    """Serve until SIGTERM/SIGINT; returns after a graceful shutdown."""
    server = Server(engine, config)
    try:
        uv = uvicorn_server(server, host=host, port=port, shutdown_timeout=shutdown_timeout,
                            log_level=log_level, access_log=access_log)  # fmt: skip
        uv.run(sockets=[sock] if sock is not None else None)
    finally:
        server.close()
