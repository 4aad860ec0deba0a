"""``mgx-run bench``: an offline workload through the engine, reported as a table and JSON.

Prompts are random token ids (so any artifact works without a data set); a shared-prefix ratio makes
every prompt start with the same tokens, which the prefix cache can reuse. Requests arrive all at once
or as a Poisson process at ``request_rate``; generation ignores EOS so output lengths are as asked.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import asdict, dataclass

from .engine import Engine
from .metrics import PERCENTILES, RequestMetrics, percentile
from .sampler import SamplingParams

__all__ = ["Workload", "parse_range", "run_bench", "format_report"]


def parse_range(text: str | int) -> tuple[int, int]:
    """``"32"`` -> (32, 32); ``"8-40"`` -> (8, 40) (uniform, inclusive)."""
    lo, _, hi = str(text).partition("-")
    try:
        a, b = int(lo), int(hi or lo)
    except ValueError:
        raise ValueError(f"not a length or range: {text!r} (examples: 32, 8-40)") from None
    if not 1 <= a <= b:
        raise ValueError(f"a length range needs 1 <= low <= high, got {text!r}")
    return a, b


@dataclass(frozen=True, slots=True)
class Workload:
    """What to send."""

    num_prompts: int = 32
    prompt_len: tuple[int, int] = (32, 32)  # tokens, uniform in [low, high]
    output_len: tuple[int, int] = (16, 16)  # generated tokens, uniform in [low, high]
    shared_prefix: float = 0.0  # share of each prompt that is a prefix common to all prompts
    request_rate: float = math.inf  # requests per second (Poisson); inf: all at once
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {self.num_prompts}")
        if not 0 <= self.shared_prefix <= 1:
            raise ValueError(f"shared_prefix must be in [0, 1], got {self.shared_prefix}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0, got {self.request_rate}")

    def requests(self, vocab_size: int, avoid: set[int]) -> list[tuple[float, list[int], int]]:
        """(arrival offset in s, prompt ids, output tokens) per request, in arrival order."""
        rng = random.Random(self.seed)
        ids = [t for t in range(vocab_size) if t not in avoid]
        common = [rng.choice(ids) for _ in range(self.prompt_len[1])]
        out, t = [], 0.0
        for _ in range(self.num_prompts):
            n = rng.randint(*self.prompt_len)
            shared = round(self.shared_prefix * n)
            prompt = common[:shared] + [rng.choice(ids) for _ in range(n - shared)]
            out.append((t, prompt, rng.randint(*self.output_len)))
            if math.isfinite(self.request_rate):
                t += rng.expovariate(self.request_rate)
        return out


def run_bench(engine: Engine, workload: Workload, *, warmup: bool = True) -> dict:
    """Run ``workload`` on ``engine`` (which must be idle) and return the report as a dict."""
    arch = engine.graph.arch
    avoid = {*arch.eos_token_ids, arch.bos_token_id, arch.pad_token_id}
    todo = workload.requests(arch.vocab_size, avoid)
    if warmup:  # first use of each weight may upcast it; keep that out of the numbers
        engine.generate(todo[0][1][:8], max_tokens=2, temperature=0.0, ignore_eos=True)
    engine.reset_prefix_cache()
    engine.metrics.reset()
    graphs_before = engine.runner.backend.graph_stats()
    finished: list[RequestMetrics] = []
    start = time.perf_counter()
    pending = list(todo)
    while pending or engine.has_unfinished():
        now = time.perf_counter() - start
        while pending and pending[0][0] <= now:
            _, prompt, n = pending.pop(0)
            engine.add_request(prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        if not engine.has_unfinished():
            time.sleep(max(pending[0][0] - now, 0.0))
            continue
        finished += [o.metrics for o in engine.step() if o.finished and o.metrics is not None]
    elapsed = time.perf_counter() - start
    counters = engine.metrics.counters
    out_tokens = sum(m.output_tokens for m in finished)
    in_tokens = sum(m.prompt_tokens for m in finished)

    def pct(name: str) -> dict[str, float]:
        values = [v for m in finished if (v := getattr(m, name)) is not None]
        return {f"p{q}": percentile(values, q) * 1e3 for q in PERCENTILES} | {
            "mean": sum(values) / len(values) * 1e3 if values else math.nan
        }

    plan = engine.cache_plan
    graphs = {
        part: {k: v - graphs_before.get(part, {}).get(k, 0) for k, v in counts.items()}
        for part, counts in engine.runner.backend.graph_stats().items()
    }
    return {
        "workload": asdict(workload)
        | {"request_rate": workload.request_rate if math.isfinite(workload.request_rate) else "inf"},
        "engine": {
            "backend": engine.runner.backend.name,
            "block_size": plan.block_size,
            "kv_blocks": plan.num_blocks,
            "kv_tokens": plan.num_tokens,
            "kv_bytes": plan.nbytes,
            "max_num_seqs": engine.config.max_num_seqs,
            "max_tokens_per_step": engine.config.max_tokens_per_step,
            "prefix_caching": engine.blocks.prefix_caching,
        },
        "duration_s": elapsed,
        "requests": len(finished),
        "requests_per_s": len(finished) / elapsed,
        "prompt_tokens": in_tokens,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / elapsed,
        "total_tokens_per_s": (in_tokens + out_tokens) / elapsed,
        "ttft_ms": pct("ttft"),
        "tpot_ms": pct("tpot"),
        "e2e_ms": pct("e2e_latency"),
        # host wall time of a step, over the engine's window of steps (the last 1,000), and the slowest
        # of the run: a graph capture or a kernel compile shows up there
        "step_ms": {f"p{q}": v * 1e3 for q, v in engine.metrics.latency_percentiles()["step"].items()}
        | {"max": engine.metrics.slowest_step_s * 1e3},
        "peak_kv_blocks": engine.metrics.peak_kv_blocks_used,
        "peak_kv_use": engine.metrics.peak_kv_blocks_used / plan.num_blocks,
        "prefix_hit_rate": engine.metrics.prefix_hit_rate,
        "cached_prompt_tokens": counters.cached_prompt_tokens,
        "preemptions": counters.preemptions,
        "steps": counters.steps,
        "graphs": graphs,  # steps by path and captures by kind during the run (CUDA backend)
    }


def format_report(r: dict) -> str:
    """The report as an aligned text table."""
    w = r["workload"]
    rows = [
        ("requests", f"{r['requests']} in {r['duration_s']:.2f} s"),
        ("workload", f"prompt {_span(w['prompt_len'])}, output {_span(w['output_len'])} tokens, "
                     f"shared prefix {w['shared_prefix']:.0%}, rate {w['request_rate']} req/s"),
        ("throughput", f"{r['requests_per_s']:.2f} req/s, {r['output_tokens_per_s']:.1f} output tok/s, "
                       f"{r['total_tokens_per_s']:.1f} total tok/s"),
    ]  # fmt: skip
    for name in ("ttft", "tpot", "e2e", "step"):
        p = r[f"{name}_ms"]
        rows.append((f"{name} ms", "  ".join(f"{k} {v:.1f}" for k, v in p.items())))
    e = r["engine"]
    rows += [
        ("peak KV use", f"{r['peak_kv_blocks']} of {e['kv_blocks']} blocks ({r['peak_kv_use']:.1%})"),
        ("prefix cache", f"hit rate {r['prefix_hit_rate']:.1%} ({r['cached_prompt_tokens']} prompt tokens reused)"),
        ("scheduler", f"{r['steps']} steps, {r['preemptions']} preemptions, max {e['max_num_seqs']} seqs, "
                      f"{e['max_tokens_per_step']} tokens/step"),
    ]  # fmt: skip
    if r.get("graphs"):
        steps, caps = r["graphs"]["steps"], r["graphs"]["captures"]
        took = r["graphs"].get("capture_s", {})
        captured = ", ".join(f"{k} {v} in {took.get(k, 0.0):.2f} s" for k, v in sorted(caps.items()) if v) or "none"
        rows.append(("graphs", "steps " + ", ".join(f"{k} {v}" for k, v in sorted(steps.items())) + "; captured " + captured))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _span(r: tuple[int, int] | list[int]) -> str:
    return str(r[0]) if r[0] == r[1] else f"{r[0]}-{r[1]}"
