"""Request and engine metrics as plain Python objects, easy to export (``EngineMetrics.snapshot``).

Times are ``time.perf_counter()`` seconds. Percentiles are over the last ``window`` finished requests;
tokens/s over the last ``rate_window_s`` seconds of steps.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

__all__ = ["Counters", "EngineMetrics", "Gauges", "PERCENTILES", "RequestMetrics", "percentile"]

PERCENTILES = (50, 90, 99)


def percentile(values: Iterable[float], q: float) -> float:
    """The ``q``-th percentile (0..100), interpolating linearly between ranks; nan when empty."""
    xs = sorted(values)
    if not xs:
        return math.nan
    rank = (len(xs) - 1) * q / 100
    lo, hi = math.floor(rank), math.ceil(rank)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


@dataclass(slots=True)
class RequestMetrics:
    """One request's timeline and token counts."""

    arrival_time: float  # when the request was added
    prompt_tokens: int
    first_scheduled_time: float | None = None  # first step that ran any of its tokens
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    output_tokens: int = 0
    preemptions: int = 0
    prefill_seconds: float = 0.0  # engine step time spent on it up to its first token
    decode_seconds: float = 0.0  # engine step time spent on it after that

    @property
    def queue_time(self) -> float | None:
        """Arrival to first scheduled step."""
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        """Time to first token, from arrival."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.output_tokens < 2 or self.first_token_time is None or self.last_token_time is None:
            return None
        return (self.last_token_time - self.first_token_time) / (self.output_tokens - 1)

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass(slots=True)
class Counters:
    requests_added: int = 0
    requests_finished: int = 0  # stopped or reached max_tokens
    requests_aborted: int = 0
    prompt_tokens: int = 0  # of admitted requests (first admission)
    cached_prompt_tokens: int = 0  # of those, served from the prefix cache
    computed_tokens: int = 0  # tokens run through the model (prefill chunks, recomputes, decodes)
    generated_tokens: int = 0
    preemptions: int = 0
    steps: int = 0


@dataclass(slots=True)
class Gauges:
    """Read from the engine at snapshot time."""

    running: int = 0
    waiting: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    kv_blocks_free: int = 0
    kv_blocks_cached: int = 0


class EngineMetrics:
    """Counters, gauges and windows of one engine. The engine feeds it; anyone may read it."""

    def __init__(
        self,
        *,
        max_num_seqs: int,
        max_tokens_per_step: int,
        gauges: Callable[[], Gauges] | None = None,
        window: int = 1000,
        rate_window_s: float = 10.0,
    ) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_tokens_per_step = max_tokens_per_step
        self.counters = Counters()
        self.peak_kv_blocks_used = 0
        self.started = time.perf_counter()
        self._gauges = gauges or Gauges
        self._requests: deque[RequestMetrics] = deque(maxlen=window)
        self._steps: deque[tuple[float, int, int, int, float]] = deque(
            maxlen=window
        )  # (end, tokens, seqs, generated, host wall seconds)
        self.slowest_step_s = 0.0  # since the last reset: a capture or a compile shows up here
        self._rate_window_s = rate_window_s

    # -- fed by the engine -----------------------------------------------------------------------

    def on_added(self) -> None:
        self.counters.requests_added += 1

    def on_admitted(self, prompt_tokens: int, cached_tokens: int) -> None:
        self.counters.prompt_tokens += prompt_tokens
        self.counters.cached_prompt_tokens += cached_tokens

    def on_step(
        self,
        end: float,
        num_tokens: int,
        num_seqs: int,
        generated: int,
        preempted: int,
        kv_used: int,
        seconds: float = 0.0,
    ) -> None:
        c = self.counters
        self.slowest_step_s = max(self.slowest_step_s, seconds)
        c.steps += 1
        c.computed_tokens += num_tokens
        c.generated_tokens += generated
        c.preemptions += preempted
        self.peak_kv_blocks_used = max(self.peak_kv_blocks_used, kv_used)
        self._steps.append((end, num_tokens, num_seqs, generated, seconds))

    def on_finished(self, metrics: RequestMetrics, aborted: bool = False) -> None:
        if aborted:
            self.counters.requests_aborted += 1
        else:
            self.counters.requests_finished += 1
            self._requests.append(metrics)

    def reset(self) -> None:
        """Forget counters and windows (e.g. after a warm-up)."""
        self.counters = Counters()
        self.peak_kv_blocks_used = 0
        self.started = time.perf_counter()
        self._requests.clear()
        self._steps.clear()
        self.slowest_step_s = 0.0

    # -- read ------------------------------------------------------------------------------------

    @property
    def prefix_hit_rate(self) -> float:
        """Share of admitted prompt tokens served from the prefix cache."""
        c = self.counters
        return c.cached_prompt_tokens / c.prompt_tokens if c.prompt_tokens else 0.0

    @property
    def finished_requests(self) -> list[RequestMetrics]:
        """The window of finished requests, oldest first."""
        return list(self._requests)

    def tokens_per_s(self, now: float | None = None) -> float:
        """Generated tokens per second over the last ``rate_window_s`` seconds of steps."""
        now = time.perf_counter() if now is None else now
        since = max(now - self._rate_window_s, self.started)
        generated = sum(s[3] for s in self._steps if s[0] >= since)
        return generated / max(now - since, 1e-9)

    def latency_percentiles(self) -> dict[str, dict[int, float]]:
        """P50/P90/P99 (seconds) of queue time, TTFT, TPOT and end-to-end latency over the window
        of finished requests, and of the steps' host wall time over the window of steps."""
        out = {}
        for name in ("queue_time", "ttft", "tpot", "e2e_latency"):
            values = [v for r in self._requests if (v := getattr(r, name)) is not None]
            out[name] = {q: percentile(values, q) for q in PERCENTILES}
        out["step"] = {q: percentile([st[4] for st in self._steps], q) for q in PERCENTILES}
        return out

    def snapshot(self) -> dict[str, float]:
        """Every metric as a flat ``name -> number`` dict (names fit Prometheus)."""
        g = self._gauges()
        c = self.counters
        out: dict[str, float] = {f"{k}_total": float(v) for k, v in _fields(c).items()}
        out.update({k: float(v) for k, v in _fields(g).items()})
        out["kv_blocks_peak_used"] = float(self.peak_kv_blocks_used)
        out["prefix_cache_hit_rate"] = self.prefix_hit_rate
        out["generation_tokens_per_s"] = self.tokens_per_s()
        out["slowest_step_seconds"] = self.slowest_step_s
        steps = list(self._steps)
        out["batch_token_occupancy"] = (
            sum(s[1] for s in steps) / (len(steps) * self.max_tokens_per_step) if steps else 0.0
        )
        out["batch_seq_occupancy"] = (
            sum(s[2] for s in steps) / (len(steps) * self.max_num_seqs) if steps else 0.0
        )
        for name, qs in self.latency_percentiles().items():
            for q, v in qs.items():
                out[f"{name}_seconds_p{q}"] = v
        return out


def _fields(obj: object) -> dict[str, int]:
    return {name: getattr(obj, name) for name in obj.__dataclass_fields__}  # type: ignore[attr-defined]
