"""Server metrics and their Prometheus text exposition (format 0.0.4), with no client library."""

from __future__ import annotations

import bisect
import math
import threading
from collections import Counter
from collections.abc import Sequence

__all__ = ["Histogram", "ServerMetrics", "render"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

# The engine's snapshot keys (``EngineMetrics.snapshot``) -> (exported name, type, help).
# Keys not listed are exported as mgx_<key> gauges, so a new engine metric still shows up.
ENGINE_METRICS: dict[str, tuple[str, str, str]] = {
    "requests_added_total": ("mgx_engine_requests_added_total", "counter", "Requests added to the engine."),
    "requests_finished_total": ("mgx_engine_requests_finished_total", "counter",
                                "Requests that stopped or reached max_tokens."),
    "requests_aborted_total": ("mgx_engine_requests_aborted_total", "counter",
                               "Requests aborted (client gone, shutdown)."),
    "prompt_tokens_total": ("mgx_prompt_tokens_total", "counter", "Prompt tokens of admitted requests."),
    "cached_prompt_tokens_total": ("mgx_prefix_cache_hit_tokens_total", "counter",
                                   "Prompt tokens served from the prefix cache."),
    "computed_tokens_total": ("mgx_computed_tokens_total", "counter", "Tokens run through the model."),
    "generated_tokens_total": ("mgx_generation_tokens_total", "counter", "Tokens generated."),
    "preemptions_total": ("mgx_preemptions_total", "counter", "Sequences preempted for KV space."),
    "steps_total": ("mgx_engine_steps_total", "counter", "Engine steps run."),
    "running": ("mgx_requests_running", "gauge", "Sequences in the running batch."),
    "waiting": ("mgx_requests_waiting", "gauge", "Sequences waiting for a batch slot or KV space."),
    "kv_blocks_total": ("mgx_kv_blocks_total", "gauge", "KV cache blocks in the pool."),
    "kv_blocks_used": ("mgx_kv_blocks_used", "gauge", "KV cache blocks held by requests."),
    "kv_blocks_free": ("mgx_kv_blocks_free", "gauge", "KV cache blocks free or evictable."),
    "kv_blocks_cached": ("mgx_kv_blocks_cached", "gauge", "KV cache blocks in the prefix cache."),
    "kv_blocks_peak_used": ("mgx_kv_blocks_peak_used", "gauge", "Most KV blocks ever used at once."),
    "prefix_cache_hit_rate": ("mgx_prefix_cache_hit_rate", "gauge",
                              "Share of admitted prompt tokens served from the prefix cache."),
    "generation_tokens_per_s": ("mgx_generation_tokens_per_second", "gauge",
                                "Generated tokens per second over the last 10 s."),
    "batch_token_occupancy": ("mgx_batch_token_occupancy", "gauge",
                              "Mean share of the step token budget used (recent steps)."),
    "batch_seq_occupancy": ("mgx_batch_seq_occupancy", "gauge",
                            "Mean share of max_num_seqs in a step (recent steps)."),
}  # fmt: skip


class Histogram:
    """A cumulative Prometheus histogram over fixed bucket bounds."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, cumulative = [], 0
        for bound, n in zip((*self.bounds, math.inf), self.counts):
            cumulative += n
            out.append(f'{name}_bucket{{le="{_num(bound)}"}} {cumulative}')
        out += [f"{name}_sum {_num(self.sum)}", f"{name}_count {self.count}"]
        return out


class ServerMetrics:
    """What the HTTP layer counts: responses by endpoint and status, latency histograms, rejections."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.responses: Counter[tuple[str, int]] = Counter()
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)
        self.rejected = 0  # 429 / 503: queue full or shutting down
        self.cancelled = 0  # requests whose client left before they finished

    def count_response(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.responses[(endpoint, status)] += 1

    def observe_request(self, ttft: float | None, tpot: float | None, e2e: float | None) -> None:
        with self._lock:
            for hist, value in ((self.ttft, ttft), (self.tpot, tpot), (self.e2e, e2e)):
                if value is not None:
                    hist.observe(value)


# The backend's graph_stats parts: (family, label, help); the CUDA backend's, empty elsewhere.
GRAPH_FAMILIES = {
    "steps": ("mgx_backend_steps_total", "path",
              "Steps by how they ran: replayed decode, prefill or mixed CUDA graph, or eager (op by op)."),
    "captures": ("mgx_cuda_graph_captures_total", "kind", "CUDA graphs captured (again when a block table outgrew one)."),
    "capture_s": ("mgx_cuda_graph_capture_seconds_total", "kind", "Host seconds spent capturing CUDA graphs."),
}  # fmt: skip


def render(server: ServerMetrics, engine: dict[str, float], extra: dict[str, float],
           graphs: dict[str, dict[str, float]] | None = None) -> str:  # fmt: skip
    """The Prometheus text page: server counters and histograms, every engine metric, then the
    backend's steps by path and graph captures (``graphs``: ``Backend.graph_stats()``)."""
    lines: list[str] = []

    def family(name: str, kind: str, help_: str, samples: list[str]) -> None:
        lines.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}", *samples])

    with server._lock:
        family("mgx_http_requests_total", "counter", "HTTP responses by endpoint and status code.",
               [f'mgx_http_requests_total{{endpoint="{e}",status="{s}"}} {n}'
                for (e, s), n in sorted(server.responses.items())])  # fmt: skip
        family("mgx_requests_rejected_total", "counter", "Requests refused with 429/503 (queue full, draining).",
               [f"mgx_requests_rejected_total {server.rejected}"])  # fmt: skip
        family("mgx_requests_cancelled_total", "counter", "Requests whose client disconnected before the end.",
               [f"mgx_requests_cancelled_total {server.cancelled}"])  # fmt: skip
        for name, hist, help_ in (
            ("mgx_time_to_first_token_seconds", server.ttft, "Time from arrival to the first token."),
            ("mgx_time_per_output_token_seconds", server.tpot, "Mean time per output token after the first."),
            ("mgx_e2e_request_latency_seconds", server.e2e, "Time from arrival to the last token."),
        ):
            family(name, "histogram", help_, hist.lines(name))
    for key, value in extra.items():
        family(
            f"mgx_{key}", "gauge", _EXTRA_HELP.get(key, key.replace("_", " ")), [f"mgx_{key} {_num(value)}"]
        )
    for key, value in engine.items():
        name, kind, help_ = ENGINE_METRICS.get(key, (f"mgx_{key}", "gauge", _help(key)))
        family(name, kind, help_, [f"{name} {_num(value)}"])
    for part, counts in (graphs or {}).items():
        if part in GRAPH_FAMILIES and counts:
            name, label, help_ = GRAPH_FAMILIES[part]
            family(name, "counter", help_, [f'{name}{{{label}="{k}"}} {_num(v)}' for k, v in sorted(counts.items())])
    return "\n".join(lines) + "\n"


_EXTRA_HELP = {
    "kv_cache_usage_ratio": "Share of KV cache blocks held by requests.",
    "pending_requests": "Requests this server holds (running or queued).",
    "max_pending_requests": "Bound of the request queue; past it requests get 429.",
}


def _help(key: str) -> str:
    if "_seconds_p" in key:
        what, q = key.split("_seconds_p")
        return f"P{q} of {what.replace('_', ' ')} over the recent finished requests (seconds)."
    return key.replace("_", " ")


def _num(x: float) -> str:
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    return repr(float(x)) if isinstance(x, float) and not x.is_integer() else str(int(x))
