"""``mgx-run serve`` over raw HTTP: bad requests in OpenAI's error shape, the API key, overload,
client disconnects freeing KV blocks at once, /metrics and the dashboard's data."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx2 as httpx
import openai
import pytest
from _server_testing import MODEL, running_server

from mgx.formats.artifact import write_artifact

from _tiny_graph import tiny_contents

KEY = "sk-test-123"
LONG = "the cat sat on the mat " * 30  # > 128 tokens: longer than the tiny model's context


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("serve") / "tiny.mgx"
    write_artifact(path, tiny_contents())
    return path


@pytest.fixture(scope="module")
def server(artifact: Path):
    with running_server(artifact, max_pending=4) as running:
        yield running


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


@pytest.fixture
def slow(server):
    """Each engine step takes 10 ms more, so a request stays in flight long enough to act on it."""
    runner = server.engine.runner
    execute = runner.execute

    def slow_execute(batch):  # noqa: ANN001
        time.sleep(0.01)
        return execute(batch)

    runner.execute = slow_execute
    yield
    del runner.execute


def assert_error(r, status: int, param: str | None, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    err = body["error"]
    assert err["param"] == param and isinstance(err["message"], str) and err["message"]
    if code is not None:
        assert err["code"] == code
    if param is not None and not param.startswith("messages["):
        assert param.split(".")[0] in err["message"] or param in ("prompt", "messages", "max_tokens")
    return err


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
COMP = {"model": MODEL, "prompt": "the cat", "max_tokens": 4}


@pytest.mark.parametrize(
    ("path", "body", "param", "code"),
    [
        ("/v1/completions", {**COMP, "temperature": "hot"}, "temperature", "invalid_type"),
        ("/v1/completions", {**COMP, "max_tokens": "5"}, "max_tokens", "invalid_type"),
        ("/v1/completions", {**COMP, "max_tokens": 0}, "max_tokens", "invalid_value"),
        ("/v1/completions", {**COMP, "n": 1.5}, "n", "invalid_type"),
        ("/v1/completions", {**COMP, "stream": "yes"}, "stream", "invalid_type"),
        ("/v1/completions", {**COMP, "stop": 5}, "stop", "invalid_type"),
        ("/v1/completions", {**COMP, "seed": True}, "seed", "invalid_type"),
        ("/v1/completions", {**COMP, "top_p": 0}, "top_p", "invalid_value"),
        ("/v1/completions", {**COMP, "temperature": 3}, "temperature", "invalid_value"),
        ("/v1/completions", {**COMP, "presence_penalty": -2.5}, "presence_penalty", "invalid_value"),
        ("/v1/completions", {**COMP, "logprobs": True}, "logprobs", "invalid_type"),
        ("/v1/completions", {**COMP, "prompt": {"text": "x"}}, "prompt", "invalid_type"),
        ("/v1/completions", {**COMP, "prompt": [1, 2, 99999]}, "prompt", None),  # outside the vocabulary
        ("/v1/completions", {"model": MODEL}, "prompt", "missing_required_parameter"),
        ("/v1/completions", {**COMP, "echo": True}, "echo", "unsupported_parameter"),
        ("/v1/completions", {**COMP, "logit_bias": {"5": 10}}, "logit_bias", "unsupported_parameter"),
        ("/v1/completions", {**COMP, "best_of": 3}, "best_of", "unsupported_parameter"),
        ("/v1/completions", {**COMP, "frobnicate": 1}, "frobnicate", "unknown_parameter"),
        ("/v1/completions", {**COMP, "stream_options": {"include_usage": True}}, "stream_options", None),
        ("/v1/completions", {**COMP, "prompt": LONG}, "prompt", "context_length_exceeded"),
        ("/v1/completions", {**COMP, "max_tokens": 500}, "max_tokens", "context_length_exceeded"),
        ("/v1/chat/completions", {**CHAT, "messages": "hi"}, "messages", "invalid_type"),
        ("/v1/chat/completions", {**CHAT, "messages": []}, "messages", "invalid_value"),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", None),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": 5}]}, "messages[0].content", None),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         "messages[0].content[0]", "unsupported_content"),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": LONG}]}, "messages",
         "context_length_exceeded"),
        ("/v1/chat/completions", {**CHAT, "max_tokens": 200}, "max_tokens", "context_length_exceeded"),
        ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 200}, "max_tokens", "context_length_exceeded"),
        ("/v1/chat/completions", {**CHAT, "logprobs": 3}, "logprobs", "invalid_type"),
        ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, "top_logprobs", None),
        ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, "tools", "unsupported_parameter"),
        ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_object"}}, "response_format", None),
        ("/v1/chat/completions", {**CHAT, "n": 5}, "n", None),  # more than the server holds at once (4)
    ],
)  # fmt: skip
def test_bad_requests_name_the_field(http, path: str, body: dict, param: str, code: str | None) -> None:
    assert_error(http.post(path, json=body), 400, param, code)


def test_unknown_model_is_404(http) -> None:
    for path, body in (("/v1/completions", COMP), ("/v1/chat/completions", CHAT)):
        err = assert_error(http.post(path, json={**body, "model": "gpt-4"}), 404, "model", "model_not_found")
        assert "gpt-4" in err["message"]
    assert_error(http.get("/v1/models/gpt-4"), 404, "model", "model_not_found")


def test_malformed_json_and_wrong_body(http) -> None:
    err = assert_error(http.post("/v1/completions", content=b'{"prompt": "x",'), 400, None, "invalid_json")
    assert "JSON" in err["message"]
    assert_error(http.post("/v1/chat/completions", content=b"[1, 2]"), 400, None, "invalid_body")
    assert_error(http.get("/v1/nothing"), 404, None, "not_found")
    assert http.get("/v1/completions").status_code == 405


def test_ignored_fields_change_nothing(http) -> None:
    plain = http.post("/v1/completions", json={**COMP, "temperature": 0}).json()["choices"][0]["text"]
    extra = {"user": "u1", "echo": False, "suffix": None, "logit_bias": {}, "best_of": 1, "top_k": -1}
    assert (
        http.post("/v1/completions", json={**COMP, "temperature": 0, **extra}).json()["choices"][0]["text"]
        == plain
    )
    r = http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 3, "store": False, "metadata": {"a": "b"},
                                                "tool_choice": "none", "response_format": {"type": "text"}})  # fmt: skip
    assert r.status_code == 200, r.text


def test_the_openai_client_sees_typed_errors(server) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=LONG, max_tokens=4)
    assert e.value.code == "context_length_exceeded" and e.value.param == "prompt"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=CHAT["messages"])


def test_api_key(artifact: Path) -> None:
    with running_server(artifact, api_key=KEY) as s, httpx.Client(base_url=s.url) as http:
        for method, path in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
                             ("GET", "/metrics"), ("GET", "/dashboard"), ("GET", "/dashboard/data")):  # fmt: skip
            body = COMP if path == "/v1/completions" else CHAT
            kw = {"json": body} if method == "POST" else {}
            assert_error(http.request(method, path, **kw), 401, None, "invalid_api_key")
            r = http.request(method, path, headers={"Authorization": "Bearer wrong"}, **kw)
            assert_error(r, 401, None, "invalid_api_key")
            assert r.headers["www-authenticate"] == "Bearer"
            assert (
                http.request(method, path, headers={"Authorization": f"Bearer {KEY}"}, **kw).status_code
                == 200
            )
        assert http.get("/health").status_code == 200  # for load balancers, no key
        assert http.get(f"/dashboard?api_key={KEY}").status_code == 200  # a browser cannot send a header
        assert http.get(f"/dashboard/data?api_key={KEY}").status_code == 401  # only the page takes it
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{s.url}/v1", api_key="wrong", max_retries=0).models.list()
        ok = openai.OpenAI(base_url=f"{s.url}/v1", api_key=KEY, max_retries=0)
        assert (
            ok.completions.create(model=MODEL, prompt="the", max_tokens=2).choices[0].finish_reason
            == "length"
        )


def first_event(lines) -> dict:  # noqa: ANN001
    for line in lines:
        if line.startswith("data: "):
            return json.loads(line[6:])
    raise AssertionError("the stream ended without an event")


def wait_for(condition, timeout: float = 5.0) -> float:  # noqa: ANN001
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            raise AssertionError("timed out waiting")
        time.sleep(0.005)
    return time.monotonic() - start


def test_disconnect_mid_stream_aborts_and_frees_blocks_at_once(server, http, slow) -> None:
    engine = server.engine
    before = engine.metrics.counters.requests_aborted
    body = {**COMP, "max_tokens": 120, "stream": True, "temperature": 0, "ignore_eos": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        first_event(lines)
        first_event(lines)  # two tokens in: the request holds KV blocks
        assert engine.blocks.num_used_blocks > 0
    # the connection is closed here, ~1 s before the request would have finished
    took = wait_for(lambda: engine.blocks.num_used_blocks == 0 and not engine.has_unfinished())
    assert took < 1.0  # "at once": the request had ~1 s of generation left
    assert engine.metrics.counters.requests_aborted == before + 1
    assert engine.metrics.counters.generated_tokens < engine.metrics.counters.prompt_tokens + 120
    assert server.server.pending == 0


def test_disconnect_while_waiting_for_a_plain_response(server, slow) -> None:
    engine = server.engine
    before = engine.metrics.counters.requests_aborted
    body = {**COMP, "max_tokens": 120, "temperature": 0, "ignore_eos": True}

    def call() -> None:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.url}/v1/completions", json=body, timeout=0.3)  # gives up mid-generation

    call()
    wait_for(lambda: engine.metrics.counters.requests_aborted == before + 1 and not engine.has_unfinished())
    assert engine.blocks.num_used_blocks == 0 and server.server.pending == 0


def test_overload_gets_429_with_retry_after(server, http, slow) -> None:
    body = {**COMP, "max_tokens": 100, "stream": True, "n": 4, "ignore_eos": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()  # keep it: dropping the iterator closes the connection (and aborts)
        first_event(lines)  # 4 requests in flight: the server is full
        assert server.server.pending == 4
        for path, b in (("/v1/completions", COMP), ("/v1/chat/completions", CHAT)):
            rejected = http.post(path, json=b)
            assert_error(rejected, 429, None, "queue_full")
            assert rejected.headers["retry-after"] == "1"
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model=MODEL, prompt="x", max_tokens=2)
        assert sum(1 for line in lines if line == "data: [DONE]") == 1  # the full stream still comes
    wait_for(lambda: server.server.pending == 0)
    assert http.post("/v1/completions", json=COMP).status_code == 200  # room again
    assert server.server.metrics.rejected >= 3


def test_draining_server_answers_503(server, http) -> None:
    server.server.draining = True
    try:
        r = http.post("/v1/completions", json=COMP)
        assert_error(r, 503, None, "shutting_down")
        assert r.headers["retry-after"] == "1"
        assert http.get("/health").status_code == 503
    finally:
        server.server.draining = False


def parse_prometheus(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_prometheus_metrics(server, http) -> None:
    http.post("/v1/completions", json={**COMP, "temperature": 0})
    http.post("/v1/completions", json={**COMP, "temperature": "x"})
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    text = r.text
    m = parse_prometheus(text)
    assert m['mgx_http_requests_total{endpoint="/v1/completions",status="200"}'] >= 1
    assert m['mgx_http_requests_total{endpoint="/v1/completions",status="400"}'] >= 1
    for hist in ("mgx_time_to_first_token_seconds", "mgx_time_per_output_token_seconds"):
        assert f"# TYPE {hist} histogram" in text
        assert m[f'{hist}_bucket{{le="+Inf"}}'] == m[f"{hist}_count"] >= 1
        buckets = [v for k, v in m.items() if k.startswith(f"{hist}_bucket")]
        assert buckets == sorted(buckets)  # cumulative
    for name in ("mgx_requests_running", "mgx_requests_waiting", "mgx_kv_cache_usage_ratio",
                 "mgx_prefix_cache_hit_rate", "mgx_generation_tokens_per_second", "mgx_kv_blocks_used",
                 "mgx_engine_requests_finished_total", "mgx_ttft_seconds_p99", "mgx_pending_requests"):  # fmt: skip
        assert name in m, name
    assert m["mgx_requests_running"] == m["mgx_requests_waiting"] == 0 and m["mgx_kv_cache_usage_ratio"] == 0
    assert "# TYPE mgx_engine_requests_finished_total counter" in text
    for line in text.splitlines():  # every sample line is "name{labels} value"
        assert line.startswith("#") or len(line.rsplit(" ", 1)) == 2
    assert "mgx_backend_steps_total" not in text  # this backend replays no graphs


def test_prometheus_metrics_carry_the_backends_graph_steps_and_captures(server, http, monkeypatch) -> None:  # noqa: ANN001
    """A replaying backend's ``graph_stats`` (the CUDA backend's) become labelled counters."""
    stats = {"steps": {"decode": 40, "mixed": 3, "eager": 2}, "captures": {"decode": 1, "mixed": 2},
             "capture_s": {"decode": 0.25, "mixed": 0.125}}  # fmt: skip
    monkeypatch.setattr(server.engine.runner.backend, "graph_stats", lambda: stats)
    text = http.get("/metrics").text
    m = parse_prometheus(text)
    assert m['mgx_backend_steps_total{path="decode"}'] == 40 and m['mgx_backend_steps_total{path="eager"}'] == 2
    assert m['mgx_cuda_graph_captures_total{kind="mixed"}'] == 2
    assert m['mgx_cuda_graph_capture_seconds_total{kind="decode"}'] == 0.25
    for name in ("mgx_backend_steps_total", "mgx_cuda_graph_captures_total", "mgx_cuda_graph_capture_seconds_total"):
        assert f"# TYPE {name} counter" in text and text.count(f"# TYPE {name} ") == 1


def test_dashboard_page_and_data(http) -> None:
    page = http.get("/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "<canvas" in page.text or "canvas" in page.text
    assert "http://" not in page.text and "https://" not in page.text  # nothing from the network
    data = http.get("/dashboard/data").json()
    for key in ("generation_tokens_per_s", "ttft_seconds_p50", "tpot_seconds_p90", "batch_occupancy_now",
                "kv_cache_usage_ratio", "prefix_cache_hit_rate", "running", "waiting"):  # fmt: skip
        assert key in data


def test_health_reports_a_failed_engine(artifact: Path) -> None:
    """When an engine step raises, requests fail at once and /health turns 503 with the cause."""
    with running_server(artifact) as running, httpx.Client(base_url=running.url, timeout=30) as c:
        assert c.get("/health").json() == {"status": "ok"}

        def broken(batch):  # noqa: ANN001, ANN202
            raise RuntimeError("simulated kernel fault")

        running.engine.runner.execute = broken
        r = c.post("/v1/completions", json={**COMP, "max_tokens": 3})
        assert r.status_code >= 500 and "Traceback" not in r.text
        health = c.get("/health")
        assert health.status_code == 503
        assert health.json() == {"status": "failed", "error": "RuntimeError: simulated kernel fault"}
