"""Whole-model GPU benchmark: MGX's CUDA backend against Hugging Face transformers, in one run.

    python examples/bench_gpu_model.py --shape llama-1b --schemes bf16,w8a16,int4 --json out.json

A random-weight Llama with the shapes of Llama-3.2-1B (``llama-1b``) or Llama-3.1-8B (``llama-8b``)
is built in bf16, traced and lowered by the MGX compiler, run through the passes of each scheme
(``fuse_qkv``, ``fuse_gate_up``, the scheme's quantizer, ``reorder_weights`` for target ``cuda``),
written as a ``.mgx`` file and loaded by ``Engine(path, backend="cuda")``. Measured:

- load: artifact open plus weight upload (GB/s through the pinned staging buffers);
- decode at batch 1: a 512-token prompt, 256 new greedy tokens; tokens/s over the decode steps
  and the fraction of the measured copy bandwidth that the weight bytes read per token make;
- aggregate decode at batch 32, 64, 128 (128-token prompts, 64 decode steps timed once every
  sequence decodes);
- prefill of a 2,048-token prompt: tokens/s and model FLOPs as a fraction of the measured bf16
  matrix rate;
- with ``--serve 8,16,32,inf``: a serving load (``mgx-run bench``'s Poisson workload) at each rate,
  steps of several sequences replayed as mixed graphs and launched op by op: requests/s, time to
  first token and per output token, graph steps and captures; with ``--serve-cold RATE``, also
  ``mgx-run bench`` at RATE in new processes with Triton's cache empty, without and with
  ``--warm-up``: process wall time, the warm-up's seconds, and the load's TTFT tail and slowest step.

``--autotune 1,32,...`` runs the autotune pass on the build GPU for those row counts and stores its
choices (its time is reported); ``--cold-start`` then times ``mgx-run generate`` from process start to
its first token, for the first scheme with and without the stored tunings, each with Triton's kernel
cache cold and warm. Each batch-1 row also reports the GPU time of one replayed decode graph, which
separates the GPU's share of a step from the host's. ``--tune`` runs ``mgx-run tune``'s in-graph
tuning on each engine before it is measured (its choices and time in the row).

The same model in transformers runs eager and with a static cache under ``torch.compile``
(``--hf eager,compile``) on the same prompts. ``--smoke`` runs a tiny shape on the CPU under
TRITON_INTERPRET=1 to check the script.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("MGX_CUDA_DEVICE", "cpu")

import numpy as np  # noqa: E402
import torch  # noqa: E402

SHAPES = {
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True),
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512, tie_word_embeddings=True),
}  # fmt: skip
SCHEME_PASSES = {
    "bf16": [],
    "w8a16": [("quantize_w8a16", {})],
    "int4": [("quantize_int4", {"group_size": 128})],
}
DEVICE = "cpu" if SMOKE else "cuda"
ROWS: list[dict] = []
RESULT: dict = {}  # what --json holds, rewritten after every row (a run cut short keeps its rows)
TIMES: dict[str, object] = {}  # compile-side timings (autotune: its time, and what each tuned shape measured)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def add_row(row: dict) -> None:
    log(json.dumps(row))
    ROWS.append(row)
    if RESULT.get("path"):
        Path(RESULT["path"]).write_text(json.dumps({**RESULT["head"], "rows": ROWS, "compile": TIMES}, indent=1) + "\n")


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth() -> float:
    """Bytes read plus written per second by a large device-to-device copy (best of 10)."""
    n = (1 << 30) if DEVICE == "cuda" else (1 << 22)
    a, b = torch.empty(n, dtype=torch.uint8, device=DEVICE), torch.empty(n, dtype=torch.uint8, device=DEVICE)
    best = float("inf")
    for _ in range(10):
        sync()
        t0 = time.perf_counter()
        b.copy_(a)
        sync()
        best = min(best, time.perf_counter() - t0)
    return 2 * n / best


def matmul_rate() -> float:
    """bf16 FLOP/s of a large square matmul (best of 10)."""
    n = 8192 if DEVICE == "cuda" else 256
    a = torch.randn(n, n, dtype=torch.bfloat16, device=DEVICE)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=DEVICE)
    best = float("inf")
    for _ in range(10):
        sync()
        t0 = time.perf_counter()
        a @ b
        sync()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def build_hf(shape: str, max_pos: int):  # noqa: ANN201
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**SHAPES[shape], max_position_embeddings=max_pos, rope_theta=500000.0,
                      bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16")  # fmt: skip
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    return model.eval()


def tokenizer_json(vocab: int) -> str:
    """A word-level vocabulary behind a byte-level decoder, the decoder Llama 3's tokenizer has:
    a token's text does not depend on the tokens before it, so streaming decodes no windows
    (``Tokenizer.context_free``) as it does not for the real model. (Before 2026-12-02 the runs had
    no decoder, which joins tokens with spaces: one window decode per streamed token.)"""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.ByteLevel()
    return tok.to_str()


def lower_once(model):  # noqa: ANN001, ANN201
    """The model traced and lowered once, its tensors in bf16: every scheme's passes start from a copy."""
    from mgx.compiler.lower import lower_model, trace_model
    from mgx.compiler.pipeline import convert_tensors
    from mgx.formats import ir

    cpu_model = copy.deepcopy(model).to("cpu") if DEVICE == "cuda" else model
    t0 = time.perf_counter()
    base, _ = lower_model(cpu_model, trace_model(cpu_model))
    del cpu_model
    convert_tensors(base, ir.DType.BF16)
    log(f"traced and lowered in {time.perf_counter() - t0:.1f}s")
    return base


def build_artifact(graph, scheme: str, out_dir: Path, autotune_rows: list[int],
                   untuned_twin: bool) -> dict[str, Path]:  # noqa: ANN001
    """``scheme``'s artifact (target cuda) from ``graph`` (a lowered model, consumed). With
    ``autotune_rows`` the autotune pass runs last and its choices are stored; ``untuned_twin`` also
    writes it without them (``<scheme>-untuned``) for the cold-start comparison."""
    from mgx.compiler.pipeline import collect_pass_stats
    from mgx.formats import ir
    from mgx.formats.artifact import ArtifactContents, Fingerprint, PassRecord, write_artifact
    from mgx.kernels.cuda.build import find_nvcc
    from mgx.passes import PASSES, PassContext

    t0 = time.perf_counter()
    records, tunings, images = [], {}, {}
    # "<scheme>-fused": the same passes, autotune timing the norm across projections as they run (fused:
    # true); bench_mgx runs it with norm across for dense readers (MGX_CUDA_NORM_ACROSS_DENSE's switch).
    base, fused = scheme.removesuffix("-fused"), scheme.endswith("-fused")
    steps = [("fuse_qkv", {}), ("fuse_gate_up", {}), *SCHEME_PASSES[base], ("reorder_weights", {})]
    if DEVICE == "cuda" and find_nvcc() is not None:
        steps.append(("cuda_kernels", {}))  # the native RMSNorm and GEMVs, as `mgxc compile` builds them
    if autotune_rows:
        # The Triton RMSNorm is not tuned: the native one runs here (rms_norm: its fallback's tuning).
        steps.append(("autotune", {"rows": autotune_rows, "rms_norm": False, **({"fused": True} if fused else {})}))
    for name, opts in steps:
        t1 = time.perf_counter()
        result = PASSES[name](graph, dict(opts), PassContext(target="cuda"))
        ir.verify(graph)
        records.append(PassRecord(name, dict(opts), result.summary))
        collect_pass_stats(result.stats, tunings, images)
        if name == "autotune":
            log_autotune(scheme, result.summary, result.stats, time.perf_counter() - t1)
    fp = Fingerprint("random", "wordlevel", "bf16", base, "cuda")
    variants = [(scheme, tunings)]
    if untuned_twin and tunings:
        variants.append((f"{scheme}-untuned", {}))
    paths = {}
    for label, stored in variants:
        path = out_dir / f"{label}.mgx"
        write_artifact(path, ArtifactContents(graph=graph, tokenizer_json=tokenizer_json(graph.arch.vocab_size),
                                              fingerprint=fp, passes=records, autotune=stored,
                                              cuda_kernels=images))  # fmt: skip
        paths[label] = path
    log(f"{scheme}: passes and write {time.perf_counter() - t0:.1f}s, {path.stat().st_size / 1e9:.2f} GB")
    return paths


def log_autotune(scheme: str, summary: str, stats: dict, seconds: float) -> None:
    """Log what the autotune pass chose for ``scheme`` and keep it for the JSON (TIMES): each linear
    and LM head shape (its kind, time, and the best Triton configuration beside it), then each
    attention, RoPE, merge, dequantize, SiLU product and embedding lookup shape against the default's
    time, so that one model run shows every tuned kind at the model's shapes."""
    log(f"{scheme}: autotune {seconds:.1f}s: {summary}")
    TIMES[f"autotune_{scheme}_s"] = seconds
    TIMES[f"autotune_{scheme}_shapes"] = stats["timings"]
    how = {"after_norm": ", after its norm", "norm": ", norm in its loads", "add": ", add in its epilogue"}
    for shape, t in stats["timings"].items():
        log(f"  {shape}: {t['chosen']} {t['us']:.1f} us ({t['weight_gb_s']:.0f} GB/s of weights; "
            f"best Triton {t['triton_us']:.1f} us, {t['triton_config']}{how.get(t['fused'], '')})"
            + "".join(f"; {kind} {us:.1f}" for kind, us in t.get("native_us", {}).items()))
    for group in ("attention", "elementwise"):
        timings = stats.get(f"{group}_timings", {})
        TIMES[f"autotune_{scheme}_{group}"] = timings
        for shape, t in timings.items():
            default = f"{t['default_us']:.1f}" if t.get("default_us") is not None else "-"
            log(f"  {shape}: {t['chosen']} {t['us']:.1f} us (default {default} us)")


def weight_bytes_per_token(engine) -> int:  # noqa: ANN001
    """Bytes of every weight a decode step reads in full (the embedding table only if the LM head reads it)."""
    graph = engine.graph
    names = set()
    for op in graph.ops:
        if op.kind != "embedding":
            names.update(op.weights.values())
    return sum(graph.tensors[n].nbytes for n in names)


def run_steps(engine, prompts: list[list[int]], new: int) -> tuple[float, float, int]:  # noqa: ANN001
    """Add the requests, step to the end; (prefill seconds, decode seconds, decode tokens) where the
    decode clock starts once every sequence has its first token."""
    from mgx.runtime.sampler import SamplingParams

    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    counts: dict[str, int] = {}
    sync()
    t0 = time.perf_counter()
    t_first = None
    decoded_after = 0
    while engine.has_unfinished():
        outs = engine.step()
        for o in outs:
            counts[o.request_id] = counts.get(o.request_id, 0) + len(o.token_ids)
        if t_first is None and len(counts) == len(prompts) and all(v >= 1 for v in counts.values()):
            sync()
            t_first = time.perf_counter()
            decoded_after = sum(counts.values())
    sync()
    t_end = time.perf_counter()
    return t_first - t0, t_end - t_first, sum(counts.values()) - decoded_after


# Where Engine.step spends a decode step's host time (``--phases``): (label, class holder, method).
# The holders are read off the engine (its scheduler's and runner's classes) or named here.
STEP_PHASES = (
    ("schedule", "scheduler", "schedule"),
    ("launch", "runner", "launch_greedy_packed"),
    ("adopt", "runner", "adopt"),
    ("launch_ahead", "runner", "launch_ahead"),
    ("picks", "LaunchedStep", "picks"),  # waiting for the device, then the picks to numpy
    ("accept", "Request", "accept"),  # tokens appended, detokenized, stop checks
    ("account", "engine", "_account"),
)


def step_phases(engine, prompts: list[list[int]], new: int) -> dict[str, float]:  # noqa: ANN001
    """Mean microseconds per decode step in each of ``STEP_PHASES`` (and ``step``: the whole of
    ``Engine.step``; ``other``: what no phase holds) over the steps after every request of ``prompts``
    has its first token, each method timed by a wrapper on its class (restored afterwards). The
    GPU's share hides in ``picks``: with steps launched ahead, a host faster than the device waits
    there, a slower one does not. On CUDA, also ``replay_spans`` of the graph replays in that window:
    how long the device ran each, and how long it went from one to the next."""
    from mgx.runtime.model_runner import LaunchedStep
    from mgx.runtime.request import Request
    from mgx.runtime.sampler import SamplingParams

    named = {"LaunchedStep": LaunchedStep, "Request": Request, "engine": type(engine),
             "scheduler": type(engine.scheduler), "runner": type(engine.runner)}  # fmt: skip
    spent = dict.fromkeys([label for label, _, _ in STEP_PHASES], 0.0)
    on = [False]

    def timed(label: str, fn):  # noqa: ANN001, ANN202
        def run(*a, **k):  # noqa: ANN002, ANN003, ANN202
            if not on[0]:
                return fn(*a, **k)
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[label] += time.perf_counter() - t0

        return run

    installs = [(named[holder], method, timed(label, named[holder].__dict__[method]))
                for label, holder, method in STEP_PHASES]  # fmt: skip
    replays: list[tuple[Any, Any]] = []  # (start, end) events around each graph replay in the window
    if DEVICE == "cuda":  # the device's side: each replay's span, and the gaps between them
        replay = torch.cuda.CUDAGraph.__dict__["replay"]

        def timed_replay(graph, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
            if not on[0]:
                return replay(graph, *a, **k)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                return replay(graph, *a, **k)
            finally:
                end.record()
                replays.append((start, end))

        installs.append((torch.cuda.CUDAGraph, "replay", timed_replay))
    originals = [(cls, method, cls.__dict__[method]) for cls, method, _ in installs]
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    steps, total = 0, 0.0
    try:
        for cls, method, wrapper in installs:
            setattr(cls, method, wrapper)
        started = {engine.add_request(p, params) for p in prompts}
        while started:
            started -= {o.request_id for o in engine.step()}
        sync()
        on[0] = True
        while engine.has_unfinished():
            t0 = time.perf_counter()
            engine.step()
            total += time.perf_counter() - t0
            steps += 1
        sync()
    finally:
        on[0] = False
        for cls, method, fn in originals:
            setattr(cls, method, fn)
    per = 1e6 / max(steps, 1)
    out = {label: t * per for label, t in spent.items()}
    out |= {"step": total * per, "other": (total - sum(spent.values())) * per, "steps": steps}
    return out | replay_spans(replays)


def whole_steps_tok_s(engine, prompts: list[list[int]], new: int) -> float:  # noqa: ANN001
    """Decode tokens/s of ``prompts`` with steps launched ahead only of the same sequences (as before
    17a4d91: a step in which a request ends by length, and one after a stop, wait for the host): the
    A/B of ``Engine.ahead_subsets``, which is on again afterwards."""
    engine.ahead_subsets = False
    try:
        _, dt, n = run_steps(engine, prompts, new)
    finally:
        engine.ahead_subsets = True
    return n / dt


def replay_spans(replays: list[tuple[Any, Any]]) -> dict[str, float]:
    """From (start, end) events around consecutive graph replays (``elapsed_time`` in ms, as CUDA
    events; synchronized): mean microseconds a replay ran on the device (``graph``) and the device's
    mean time from one replay's end to the next one's start (``between_graphs``: the step's copies,
    and any wait for the host's next launch). Empty without two replays."""
    if len(replays) < 2:
        return {}
    runs = [start.elapsed_time(end) for start, end in replays]
    gaps = [end.elapsed_time(nxt) for (_, end), (nxt, _) in zip(replays, replays[1:])]
    return {"graph": 1e3 * sum(runs) / len(runs), "between_graphs": 1e3 * sum(gaps) / len(gaps), "replays": len(replays)}


def upload_again(backend, threads: int) -> float:  # noqa: ANN001
    """GB/s of a second upload of ``backend``'s weights (the same tensors, a fresh mapping's pages
    already faulted in by the first) with ``threads`` staging fill threads; the copy is dropped."""
    # the tensors the first upload moved: the device views' names
    views, stats = backend._upload({n: backend.graph.tensors[n] for n in backend._dev}, threads)
    del views
    print(f"  upload again with {threads} fill thread(s): {stats.gb_per_s:.2f} GB/s ({stats.bytes / 1e9:.2f} GB)")
    return stats.gb_per_s


def bench_mgx(path: Path, scheme: str, args, bw: float, flops: float, n_params: int) -> None:  # noqa: ANN001
    from mgx.runtime import Engine, EngineConfig

    rng = np.random.default_rng(0)
    vocab_hi = 500 if SMOKE else 100000
    biggest = max(args.batches, default=1)
    sync()
    t0 = time.perf_counter()
    engine = Engine(path, backend="cuda", config=EngineConfig(max_num_seqs=biggest, max_tokens_per_step=args.prefill,
                                                              kv_memory=args.kv_memory))  # fmt: skip
    sync()
    load_s = time.perf_counter() - t0
    if scheme.endswith("-fused"):  # its configurations were timed as norm across runs dense readers
        engine.runner.backend.norm_across_dense = True
    up = engine.runner.backend.upload_stats
    row = {"engine": f"mgx {scheme}", "load_s": load_s, "upload_gb_s": up.gb_per_s, "weight_bytes": up.bytes}
    row["tunings"], row["kernels"] = engine.tuning_note, engine.kernels_note
    for threads in args.upload_threads:  # the weights uploaded again with this many fill threads
        row[f"upload_gb_s_threads_{threads}"] = upload_again(engine.runner.backend, threads)
    # Warm up: compile the kernels and capture every decode graph the runs below replay (outside
    # the clocks; a capture inside a timed run costs seconds).
    # A batch's run is warmed by the same workload: its requests reach decode at different steps and
    # finish in waves, and every batch bucket met on the way has its graph captured there.
    for b in args.batches:
        log(f"  warm-up at batch {b}")
        run_steps(engine, [rng.integers(3, vocab_hi, args.batch_prompt).tolist() for _ in range(b)], args.batch_new)
    run_steps(engine, [rng.integers(3, vocab_hi, args.prompt).tolist()], 4)
    if args.tune and DEVICE == "cuda":  # mgx-run tune on this engine: what runs below is its choice
        from mgx.runtime.tune import decode_step_ms, tune_in_graph

        t0 = time.perf_counter()
        prompt = rng.integers(3, vocab_hi, args.prompt).tolist()
        try:
            report = tune_in_graph(engine, lambda e=engine: decode_step_ms(e, prompt), progress=log)
        except Exception as e:  # noqa: BLE001 - e.g. no native kind applies: measure as stored
            log(f"  tune: {type(e).__name__}: {e}")
            row["tune"] = f"{type(e).__name__}: {e}"
        else:
            row["tune"], row["tune_trials"] = report.summary(), report.lines()
            row["tune_s"] = time.perf_counter() - t0
            log(f"  tune {row['tune_s']:.1f}s: {report.summary()}")
    per_token = weight_bytes_per_token(engine)
    _, dt, n = run_steps(engine, [rng.integers(3, vocab_hi, args.prompt).tolist()], args.new)
    row["decode_b1_tok_s"] = n / dt
    row["decode_b1_bw_frac"] = per_token * n / dt / bw
    backend = engine.runner.backend
    if getattr(backend, "overlaps_steps", False):  # A/B: the same run waiting for every step's picks
        backend.overlaps_steps = False
        try:
            _, dt_wait, n_wait = run_steps(engine, [rng.integers(3, vocab_hi, args.prompt).tolist()], args.new)
            row["decode_b1_tok_s_not_ahead"] = n_wait / dt_wait
            for b in args.batches[-1:]:
                _, dt_wait, n_wait = run_steps(engine, [rng.integers(3, vocab_hi, args.batch_prompt).tolist() for _ in range(b)],
                                               args.batch_new)  # fmt: skip
                row[f"decode_b{b}_tok_s_not_ahead"] = n_wait / dt_wait
        finally:
            backend.overlaps_steps = True
    gpu_ms = replay_ms(engine, 1)
    if gpu_ms is not None:  # the step's GPU time alone: the rest of a step's wall time is the host's
        row["graph_b1_ms"] = gpu_ms
        row["gpu_state_b1"] = gpu_state_during(functools.partial(replay_ms, engine, 1, 400))
        row["graph_b1_bw_frac"] = per_token / (gpu_ms / 1e3) / bw
        row["step_b1_ms"] = dt / n * 1e3
        log(f"  batch 1: {row['decode_b1_tok_s']:.1f} tok/s ({row['decode_b1_bw_frac']:.1%} of copy bandwidth), "
            f"graph {gpu_ms:.3f} ms ({row['graph_b1_bw_frac']:.1%})")
    for b in args.batches:
        _, dt, n = run_steps(engine, [rng.integers(3, vocab_hi, args.batch_prompt).tolist() for _ in range(b)], args.batch_new)
        row[f"decode_b{b}_tok_s"] = n / dt
        row[f"step_b{b}_ms"] = dt / (n / b) * 1e3
        gpu_ms = replay_ms(engine, b)
        if gpu_ms is not None:
            row[f"graph_b{b}_ms"] = gpu_ms
    for b in args.batches[-1:] if getattr(backend, "overlaps_steps", False) else ():
        prompts = [rng.integers(3, vocab_hi, args.batch_prompt).tolist() for _ in range(b)]
        row[f"decode_b{b}_tok_s_whole_steps"] = whole_steps_tok_s(engine, prompts, args.batch_new)
    if args.profile:
        profile_steps(engine, args.profile, [rng.integers(3, vocab_hi, args.batch_prompt).tolist()
                                             for _ in range(args.profile)])  # fmt: skip
    for b in args.batches[-1:] if args.phases else ():
        phases = step_phases(engine, [rng.integers(3, vocab_hi, args.batch_prompt).tolist() for _ in range(b)],
                             args.batch_new)  # fmt: skip
        row[f"phases_b{b}_us"] = phases
        log(f"  batch {b}, us a decode step: " + ", ".join(f"{k} {v:.1f}" for k, v in phases.items() if k not in ("steps", "replays")))
    for _ in range(2):  # warm the prefill shapes (a prefill graph is captured at its bucket's second prompt)
        run_steps(engine, [rng.integers(3, vocab_hi, args.prefill).tolist()], 1)
    def prefills(e) -> list[float]:  # noqa: ANN001
        """Five fresh prompts' prefill seconds on ``e``, sorted: single prefills of one build spread
        by up to 1.3x on the H200, so the median counts."""
        return sorted(run_steps(e, [rng.integers(3, vocab_hi, args.prefill).tolist()], 1)[0] for _ in range(5))

    runs = prefills(engine)
    pf = runs[len(runs) // 2]
    row["prefill_s_min_median_max"] = [runs[0], pf, runs[-1]]
    if args.profile_prefill:
        profile_prefill(engine, rng.integers(3, vocab_hi, args.prefill).tolist())
    row["prefill_tok_s"] = args.prefill / pf
    row["prefill_flops_frac"] = 2 * n_params * args.prefill / pf / flops
    backend = engine.runner.backend
    if getattr(backend, "prefill_graphs", False):  # A/B: the same prompts launched op by op
        backend.prefill_graphs = False
        try:
            eager = prefills(engine)[2]
        finally:
            backend.prefill_graphs = True
        row["prefill_eager_tok_s"] = args.prefill / eager
        row["prefill_eager_flops_frac"] = 2 * n_params * args.prefill / eager / flops
    if args.flips:
        ab_flips(engine, row, args, rng.integers(3, vocab_hi, args.prompt).tolist())
    add_row(row)
    del engine
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def bench_serving(path: Path, scheme: str, args) -> None:  # noqa: ANN001
    """``--serve``: a server's load through ``run_bench`` (``mgx-run bench``'s workload) on one engine,
    its steps of several sequences replayed as mixed graphs or launched op by op, at each rate: random
    prompts of 32-1,024 tokens, 32-256 output tokens, max 64 sequences and 512 tokens a step. Each
    side first runs a warm-up pass at the highest rate (kernels compiled, graphs captured)."""
    from mgx.runtime import Engine, EngineConfig
    from mgx.runtime.bench import Workload, format_report, run_bench

    engine = Engine(path, backend="cuda", config=EngineConfig(max_num_seqs=64, max_tokens_per_step=512,
                                                              kv_memory=args.kv_memory))  # fmt: skip
    backend = engine.runner.backend
    prompt, output = ((8, 40), (2, 4)) if SMOKE else ((32, 1024), (32, 256))

    def workload(rate: float) -> Workload:
        return Workload(num_prompts=args.serve_prompts, prompt_len=prompt, output_len=output, request_rate=rate)

    for label, mixed, rate, subsets in serving_plan(args.serve, getattr(backend, "overlaps_steps", False)):
        backend.mixed_graphs = mixed and backend.use_graphs
        engine.ahead_subsets = subsets
        r = run_bench(engine, workload(rate))
        how = "" if subsets else ", steps launched ahead only of the same sequences"
        log(f"  serving {label}, mixed steps {'as graphs' if mixed else 'op by op'}{how}:\n{format_report(r)}")
        if label != "warm-up":
            add_row({"engine": f"mgx {scheme} serving", "request_rate": rate, "mixed_graphs": mixed,
                     "ahead_subsets": subsets, "requests_per_s": r["requests_per_s"],
                     "output_tok_s": r["output_tokens_per_s"], "ttft_ms": r["ttft_ms"], "tpot_ms": r["tpot_ms"],
                     "step_ms": r["step_ms"], "graphs": r["graphs"]})  # fmt: skip
    del engine
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def serving_plan(rates: list[float], overlaps: bool) -> list[tuple[str, bool, float, bool]]:
    """``--serve``'s passes, (label, mixed steps as graphs, rate, ``Engine.ahead_subsets``): a warm-up
    each way at the highest finite rate, then each rate op by op and as graphs, and on a backend that
    launches steps ahead, as graphs again with steps launched ahead only of the same sequences (the
    A/B of 17a4d91 and 7796e8a: its requests end by length, each at its own step)."""
    finite = [r for r in rates if r != float("inf")]
    plan = [("warm-up", mixed, max(finite, default=32.0), True) for mixed in (True, False)]
    plan += [(f"{rate:g} req/s", mixed, rate, True) for rate in rates for mixed in (False, True)]
    return plan + [(f"{rate:g} req/s", True, rate, False) for rate in rates if overlaps]


def bench_serve_cold(path: Path, scheme: str, args, work: Path) -> None:  # noqa: ANN001
    """``--serve-cold``: ``mgx-run bench`` at one rate in a new process, Triton's cache empty, without
    and with ``--warm-up``, so that the load pays (or not) for the decode graphs' captures and their
    kernels' compiles: process wall time, the warm-up's seconds, TTFT and step time tails."""
    import re
    import subprocess

    prompt, output = ("8-40", "2-4") if SMOKE else ("32-1024", "32-256")
    for warm in (False, True):
        report = work / f"serve-cold-{warm}.json"
        env = dict(os.environ, TRITON_CACHE_DIR=str(work / f"triton-cache-serve-{warm}"), PYTHONUNBUFFERED="1")
        cmd = [sys.executable, "-c", "from mgx.runtime.cli import main; main()", "bench", str(path),
               "--backend", "cuda", "--num-prompts", str(args.serve_prompts), "--prompt-len", prompt,
               "--output-len", output, "--request-rate", f"{args.serve_cold:g}", "--max-num-seqs", "64",
               "--max-tokens-per-step", "512", "--kv-memory", args.kv_memory, "--json", str(report)]  # fmt: skip
        t0 = time.perf_counter()
        proc = subprocess.run(cmd + (["--warm-up"] if warm else []), capture_output=True, text=True, env=env,
                              timeout=900)  # fmt: skip
        wall = time.perf_counter() - t0
        row = {"engine": f"mgx {scheme} serving cold", "request_rate": args.serve_cold, "warm_up": warm,
               "process_s": wall}  # fmt: skip
        if proc.returncode != 0:
            add_row(row | {"error": f"mgx-run bench failed ({proc.returncode}): {proc.stderr[-1500:]}"})
            continue
        took = re.search(r"warm-up: (\d+) batch sizes in ([\d.]+) s", proc.stderr)
        if took:
            row |= {"warm_up_sizes": int(took.group(1)), "warm_up_s": float(took.group(2))}
        r = json.loads(report.read_text())
        row |= {k: r.get(k) for k in ("requests_per_s", "ttft_ms", "tpot_ms", "step_ms", "graphs")}
        log(f"  serving cold at {args.serve_cold:g} req/s, warm-up {warm}: {wall:.1f} s in all, "
            f"{row.get('warm_up_s', 0):.1f} s warm-up, TTFT {r.get('ttft_ms')}, step ms {r.get('step_ms')}")  # fmt: skip
        add_row(row)


def ab_flips(engine, row: dict, args, prompt: list[int]) -> None:  # noqa: ANN001
    """A/B of the batch-1 graph with each decode fusion switched the other way (the same weights,
    recaptured), then on native kernels built with each ``--nvcc-flip`` flag, then the default
    recaptured (how far two captures of one graph spread): ``row``'s ``graph_b1_ms_*`` entries."""
    backend = engine.runner.backend
    for obj, attr, on, off in ((backend, "_norm_gemv", "norm_apart", "norm_in_gemv"),
                               (backend, "_decode_fusion", "attention_apart", "attention_fused"),
                               (backend, "overlap_launches", "not_overlapped", "overlapped"),
                               (backend, "tuned_gemvs", "triton_gemvs", "tuned_gemvs"),
                               (backend, "norm_across", "norm_kernels", "norm_across"),
                               (backend, "norm_across_w8a16", "w8a16_norm_kernels", "w8a16_norm_across"),
                               (backend, "norm_across_dense", "dense_norm_kernels", "dense_norm_across"),
                               (backend, "narrow_decode_tiles", "decode_tiles_64", "decode_tiles_32"),
                               (backend, "one_tile_pieces", "decode_pieces_2_tiles", "decode_pieces_1_tile"),
                               (backend, "staged_x", "unstaged_x", "staged_x"),
                               (backend, "fused_mlp", "mlp_apart", "mlp_fused")):  # fmt: skip
        if args.flip_only and attr.lstrip("_") not in args.flip_only.split(","):
            continue
        flipped = graph_ms_flipped(engine, obj, attr, prompt)
        if flipped is not None:
            row[f"graph_b1_ms_{on if getattr(obj, attr) else off}"] = flipped
    # The native kernels built with each --nvcc-flip flag instead of the stored ones (same weights, recaptured).
    for flag in args.nvcc_flip:
        flipped = graph_ms_other_kernels(engine, flag, prompt)
        if flipped is not None:
            row[f"graph_b1_ms_nvcc{flag}"] = flipped
    # The default once more, captured anew like the flips: how far two captures of one graph spread.
    if DEVICE == "cuda":
        row["graph_b1_ms_default_recaptured"] = graph_ms_recaptured(engine, prompt)


def profile_steps(engine, batch: int, prompts: list[list[int]]) -> None:  # noqa: ANN001
    """torch.profiler over 5 decode steps at ``batch``: where the GPU and the host spend a step."""
    from torch.profiler import ProfilerActivity, profile

    from mgx.runtime.sampler import SamplingParams

    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    seen: set[str] = set()
    while len(seen) < len(prompts):
        seen.update(o.request_id for o in engine.step())
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            engine.step()
        sync()
    # The device's timeline alone (the host's profiler slows the host, which shows as device idle)
    with profile(activities=[ProfilerActivity.CUDA]) as device_only:
        for _ in range(5):
            engine.step()
        sync()
    while engine.has_unfinished():
        engine.step()
    log(f"profile of 5 decode steps at batch {batch}:")
    log(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=14, max_name_column_width=60))
    log(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10, max_name_column_width=60))
    log_kernel_positions(prof, engine.graph.arch.num_layers, steps=5)
    log_device_gaps(device_only.events(), steps=5)


def log_device_gaps(events, steps: int, top: int = 8) -> None:  # noqa: ANN001
    """Where the device sat idle over ``steps`` profiled steps: the ``top`` longest gaps between its
    activities (kernels, copies, sets), each with the activity before and after, and the idle time
    per step. A gap ends at the next activity's start, measured from the latest end so far."""
    acts = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA),
                  key=lambda e: e.time_range.start)  # fmt: skip
    if len(acts) < 2:
        return
    gaps, end, before = [], acts[0].time_range.end, acts[0].name
    for e in acts[1:]:
        if e.time_range.start > end:
            gaps.append((e.time_range.start - end, before, e.name))
        if e.time_range.end >= end:
            end, before = e.time_range.end, e.name
    idle = sum(g for g, _, _ in gaps)
    log(f"device idle {idle / steps:.1f} us a step over {steps} steps ({len(gaps)} gaps); the longest (us, after, before):")
    for gap, after, nxt in sorted(gaps, reverse=True)[:top]:
        log(f"  {gap:8.1f}  {after[:60]}  ->  {nxt[:60]}")


def log_kernel_positions(prof, layers: int, steps: int) -> None:  # noqa: ANN001
    """The profiled kernels by their place in a layer: a kernel met n times per layer is told apart by
    its occurrence number modulo n (o_proj from gate/up, say); mean microseconds of each, and the idle
    time between kernels per step."""
    from collections import Counter, defaultdict

    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                      and not e.name.startswith("Memcpy") and not e.name.startswith("Memset")),
                     key=lambda e: e.time_range.start)  # fmt: skip
    if not kernels:
        return
    totals = Counter(e.name for e in kernels)
    seen: Counter[str] = Counter()
    times: dict[str, list[float]] = defaultdict(list)
    for e in kernels:
        per_layer = totals[e.name] // (steps * layers) if totals[e.name] % (steps * layers) == 0 else 0
        label = f"{e.name}[{seen[e.name] % per_layer}]" if per_layer > 1 else e.name
        seen[e.name] += 1
        times[label].append(e.time_range.end - e.time_range.start)
    busy = sum(e.time_range.end - e.time_range.start for e in kernels)
    span = kernels[-1].time_range.end - kernels[0].time_range.start
    log(f"kernels by place in the layer (mean us, count); per step {busy / steps:.1f} us busy, "
        f"{(span - busy) / steps:.1f} us between kernels (first to last kernel of {steps} steps)")
    for label, ts in times.items():
        log(f"  {label[:70]:70s} {sum(ts) / len(ts):9.2f} {len(ts):6d}")


def profile_prefill(engine, prompt: list[int]) -> None:  # noqa: ANN001
    """torch.profiler over one prefill step of ``prompt``: which kernels a long prompt spends on."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run_steps(engine, [prompt], 1)
    log(f"profile of one prefill step of {len(prompt)} tokens:")
    log(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=16, max_name_column_width=60))


def replay_ms(engine, bucket: int, replays: int = 50) -> float | None:  # noqa: ANN001
    """Milliseconds per replay of the captured greedy decode graph of ``bucket`` (back to back)."""
    backend = engine.runner.backend
    return backend.replay_ms(bucket, replays) if DEVICE == "cuda" and hasattr(backend, "replay_ms") else None


def graph_ms_flipped(engine, obj, attr: str, prompt: list[int]) -> float | None:  # noqa: ANN001
    """``replay_ms`` of the batch-1 graph captured with the backend's switch ``obj.attr`` the other way
    (None without one, or where it cannot be flipped here); the graph is dropped after, to be captured
    anew when next needed."""
    backend = engine.runner.backend
    if not hasattr(obj, attr) or DEVICE != "cuda":
        return None
    was = getattr(obj, attr)
    setattr(obj, attr, not was)
    if getattr(obj, attr) == was:  # e.g. overlapped launches below sm_90
        return None
    try:
        return graph_ms_recaptured(engine, prompt)
    finally:
        setattr(obj, attr, was)
        backend._decode_graphs.pop((1, True), None)


def graph_ms_other_kernels(engine, flag: str, prompt: list[int]) -> float | None:  # noqa: ANN001
    """``replay_ms`` of the batch-1 graph captured with the native kernels built anew with the nvcc
    ``flag`` (e.g. -DMGX_IMMA_UNROLL=2) in place of the artifact's; None without native kernels or
    nvcc. The stored kernels are back and the graph dropped after."""
    from mgx.kernels.cuda.build import build_cuda_kernels, find_nvcc
    from mgx.kernels.cuda.rmsnorm import load_cuda_kernels

    backend = engine.runner.backend
    stored = getattr(backend, "cuda_kernels", None)
    if stored is None or DEVICE != "cuda" or find_nvcc() is None:
        return None
    from mgx.passes.cuda_kernels import kernel_flags

    flags = (*kernel_flags(backend.graph), flag)  # as the artifact's were built (cuda_tile16 weights), and the flag
    other = load_cuda_kernels(build_cuda_kernels(stored.arch, extra_flags=flags), stored.arch, stored.device)
    if other is None:
        return None
    other.overlap = stored.overlap and other.allow_overlap(backend._sm)
    backend.cuda_kernels = other
    try:
        return graph_ms_recaptured(engine, prompt)
    finally:
        backend.cuda_kernels = stored
        backend._decode_graphs.pop((1, True), None)


def graph_ms_recaptured(engine, prompt: list[int]) -> float | None:  # noqa: ANN001
    """``replay_ms`` of the batch-1 graph captured anew (8 decode steps after ``prompt``)."""
    engine.runner.backend._decode_graphs.pop((1, True), None)
    run_steps(engine, [prompt], 8)
    return replay_ms(engine, 1)


GPU_STATE_FIELDS = ("clocks.sm", "clocks.mem", "temperature.gpu", "power.draw", "clocks_event_reasons.active")


def gpu_state_during(work) -> dict | None:  # noqa: ANN001
    """The GPU's clocks (MHz), temperature (C), power (W) and active clock-event (throttle) reasons
    while ``work`` runs, sampled by ``nvidia-smi`` every 50 ms: the median clocks, the highest
    temperature and power, the reasons' bits seen. None without nvidia-smi. A run whose graph is
    slower than another's can then be told apart from one whose GPU clocked down."""
    import shutil
    import subprocess

    smi = shutil.which("nvidia-smi")
    if smi is None or DEVICE != "cuda":
        return None
    cmd = [smi, f"--query-gpu={','.join(GPU_STATE_FIELDS)}", "--format=csv,noheader,nounits", "-lms", "50",
           f"--id={torch.cuda.current_device()}"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        time.sleep(0.3)  # nvidia-smi's start, so that its samples fall inside the work
        work()
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    return summarize_gpu_state(out)


def summarize_gpu_state(text: str) -> dict | None:
    """``gpu_state_during``'s summary of nvidia-smi's CSV lines (GPU_STATE_FIELDS, no units); None
    when no line parsed (an nvidia-smi that does not know a field prints an error instead)."""
    samples = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != len(GPU_STATE_FIELDS):
            continue
        try:
            sm, mem, temp, power = (float(c) for c in cells[:4])
            reasons = int(cells[4], 16)
        except ValueError:
            continue
        samples.append((sm, mem, temp, power, reasons))
    if not samples:
        return None
    mid = len(samples) // 2
    reasons = 0
    for s in samples:
        reasons |= s[4]
    return {"samples": len(samples), "sm_mhz": sorted(s[0] for s in samples)[mid],
            "mem_mhz": sorted(s[1] for s in samples)[mid], "max_temp_c": max(s[2] for s in samples),
            "max_power_w": max(s[3] for s in samples), "clock_event_reasons": hex(reasons)}  # fmt: skip


def cold_start(path: Path, cache_dir: Path) -> float:
    """Seconds from starting ``mgx-run generate`` to its first output byte (one token), in a new process."""
    import subprocess

    env = dict(os.environ, TRITON_CACHE_DIR=str(cache_dir), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-c", "from mgx.runtime.cli import main; main()", "generate", str(path), "--backend", "cuda", "--prompt",
           "t5 t6 t7 t8", "--max-tokens", "1", "--kv-memory", "1GiB"]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    first = proc.stdout.read(1)
    took = time.perf_counter() - t0
    _, err = proc.communicate(timeout=600)
    if not first or proc.returncode != 0:
        raise RuntimeError(f"mgx-run generate failed ({proc.returncode}): {err.decode()[-2000:]}")
    return took


def bench_cold_start(paths: dict[str, Path], scheme: str, work: Path) -> None:
    """Process start to first token, with and without stored tunings, Triton's cache cold and warm."""
    row = {"engine": f"mgx {scheme} cold start"}
    for label in (scheme, f"{scheme}-untuned"):
        if label not in paths:
            continue
        cache = work / f"triton-cache-{label}"
        kind = "tuned" if label == scheme and f"{scheme}-untuned" in paths else "untuned"
        row[f"{kind}_cold_cache_s"] = cold_start(paths[label], cache)
        row[f"{kind}_warm_cache_s"] = cold_start(paths[label], cache)
    add_row(row)


def hf_decode(model, batch: int, prompt: int, new: int, rng) -> float:  # noqa: ANN001
    """Decode tokens/s of ``model.generate`` at ``batch``: (new - 1) * batch tokens over the time
    the run takes beyond a 1-token run (the prefill)."""
    vocab_hi = 500 if SMOKE else 100000
    ids = torch.tensor(rng.integers(3, vocab_hi, (batch, prompt)), device=DEVICE)

    def gen(n: int) -> float:
        sync()
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=0)  # fmt: skip
        sync()
        return time.perf_counter() - t0

    # A static cache is sized by the request, so each length compiles (and captures) its own graph:
    # both lengths run once before the clocks.
    gen(new)
    gen(1)
    one = min(gen(1) for _ in range(2))
    full = gen(new)
    return (new - 1) * batch / (full - one)


def bench_hf(model, args, bw: float, n_params: int, mode: str) -> None:  # noqa: ANN001
    rng = np.random.default_rng(0)
    row = {"engine": f"transformers {mode}"}
    if mode == "compile":
        # A static cache makes generate() compile the forward itself (its CompileConfig; wrapping
        # forward in torch.compile by hand breaks on CUDA-graph outputs reused across steps).
        model.generation_config.cache_implementation = "static"
        row["compile_config"] = repr(model.generation_config.compile_config)
    t0 = time.perf_counter()
    for b in args.hf_batches:
        if b == 1:
            row["decode_b1_tok_s"] = hf_decode(model, 1, args.prompt, args.new, rng)
            row["decode_b1_bw_frac"] = row["decode_b1_tok_s"] * 2 * n_params / bw
        else:
            row[f"decode_b{b}_tok_s"] = hf_decode(model, b, args.batch_prompt, args.batch_new, rng)
        log(f"  {mode} batch {b}: {time.perf_counter() - t0:.0f}s so far")
    row["seconds"] = time.perf_counter() - t0
    add_row(row)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="llama-1b", choices=list(SHAPES))
    parser.add_argument("--schemes", default="bf16,w8a16,int4",
                        help="of bf16, w8a16, int4; '<scheme>-fused': autotune with fused: true (an A/B)")
    parser.add_argument("--hf", default="eager,compile", help="transformers modes to compare ('' for none)")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--batches", default="32,64,128")
    parser.add_argument("--hf-batches", default="1,128", help="batch sizes for transformers (1: the 512-token case)")
    parser.add_argument("--batch-prompt", type=int, default=128)
    parser.add_argument("--batch-new", type=int, default=64)
    parser.add_argument("--prefill", type=int, default=2048)
    parser.add_argument("--kv-memory", default="16GiB")
    parser.add_argument("--autotune", default="", help="row counts to tune for, e.g. 1,32,64,128,2048 ('' none)")
    parser.add_argument("--tune", action="store_true", help="mgx-run tune's in-graph choices before measuring")
    parser.add_argument("--cold-start", action="store_true", help="also time process start to first token")
    parser.add_argument("--profile", type=int, default=0, help="profile 5 decode steps at this batch (0: no)")
    parser.add_argument("--profile-prefill", action="store_true", help="profile one prefill step (kernel table)")
    parser.add_argument("--phases", action="store_true",
                        help="time Engine.step's phases (host and waiting) at the largest --batches batch")
    parser.add_argument("--nvcc-flip", action="append", default=[],
                        help="also time the batch-1 graph on native kernels built with this nvcc flag "
                             "(repeatable; with =: --nvcc-flip=-DMGX_IMMA_UNROLL=2)")  # fmt: skip
    parser.add_argument("--no-flips", dest="flips", action="store_false",
                        help="skip the batch-1 graph's A/B flips and --nvcc-flip rebuilds (a shorter run)")
    parser.add_argument("--flip-only", default="", help="only these flips, by the backend's switch, e.g. "
                                                        "staged_x,norm_across (and the default recaptured)")  # fmt: skip
    parser.add_argument("--serve", default="", help="request rates (req/s; inf: all at once) of a serving load, "
                                                    "mixed steps as graphs and op by op, e.g. 8,16,32,inf ('' none)")
    parser.add_argument("--serve-prompts", type=int, default=160, help="requests of each --serve pass")
    parser.add_argument("--serve-cold", type=float, default=0.0,
                        help="also run mgx-run bench at this rate in new processes, Triton's cache empty, "
                             "without and with --warm-up (0: no)")  # fmt: skip
    parser.add_argument("--upload-threads", type=lambda v: [int(n) for n in v.split(",") if n], default=[],
                        help="after loading, upload the weights again with these fill-thread counts, e.g. 1,8")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    args.batches = [int(b) for b in args.batches.split(",") if b]
    args.hf_batches = [int(b) for b in args.hf_batches.split(",") if b]
    args.autotune = [int(r) for r in args.autotune.split(",") if r]
    args.serve = [float(r) for r in args.serve.split(",") if r]
    if SMOKE:
        args.shape, args.prompt, args.new, args.batches, args.hf_batches = "tiny", 16, 4, [2], [1, 2]
        args.batch_new, args.prefill, args.kv_memory, args.batch_prompt = 3, 32, "64MiB", 16
    bw, flops = copy_bandwidth(), matmul_rate()
    log(f"copy bandwidth {bw / 1e9:.0f} GB/s, bf16 matmul {flops / 1e12:.0f} TFLOP/s")
    if args.json:
        RESULT["path"] = args.json
        RESULT["head"] = {"shape": args.shape, "copy_gb_s": bw / 1e9, "bf16_tflops": flops / 1e12,
                          "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"}  # fmt: skip
    model = build_hf(args.shape, max(args.prompt + args.new, args.prefill) + 64)
    n_params = sum(p.numel() for p in model.model.layers.parameters()) + model.lm_head.weight.numel()
    with tempfile.TemporaryDirectory() as tmp:
        schemes = args.schemes.split(",")
        base = lower_once(model)
        cold: dict[str, Path] = {}  # the first scheme's artifacts, kept for the cold start
        # Each scheme is measured as soon as it is built (a time limit cuts the run after whole
        # schemes), and its artifact removed after (an 8B one is 16 GB), but the cold start's.
        for i, scheme in enumerate(schemes):
            graph = base if i == len(schemes) - 1 else copy.deepcopy(base)
            built = build_artifact(graph, scheme, Path(tmp), args.autotune, args.cold_start and i == 0)
            del graph
            try:
                bench_mgx(built[scheme], scheme, args, bw, flops, n_params)
            except Exception as e:  # noqa: BLE001 - report it and measure the other schemes
                import traceback

                traceback.print_exc()
                add_row({"engine": f"mgx {scheme}", "error": f"{type(e).__name__}: {e}"})
            if args.serve:
                try:
                    bench_serving(built[scheme], scheme, args)
                except Exception as e:  # noqa: BLE001 - as above
                    import traceback

                    traceback.print_exc()
                    add_row({"engine": f"mgx {scheme} serving", "error": f"{type(e).__name__}: {e}"})
            if args.serve_cold:
                try:
                    bench_serve_cold(built[scheme], scheme, args, Path(tmp))
                except Exception as e:  # noqa: BLE001 - as above
                    add_row({"engine": f"mgx {scheme} serving cold", "error": f"{type(e).__name__}: {e}"})
            if args.cold_start and i == 0:
                cold = built
            else:
                for path in built.values():
                    path.unlink()
        del base
        if args.cold_start:
            bench_cold_start(cold, schemes[0], Path(tmp))
    for mode in [m for m in args.hf.split(",") if m]:
        try:
            bench_hf(model, args, bw, n_params, mode)
        except Exception as e:  # noqa: BLE001 - keep the rows measured so far
            import traceback

            traceback.print_exc()
            add_row({"engine": f"transformers {mode}", "error": f"{type(e).__name__}: {e}"})
    out = {"shape": args.shape, "copy_gb_s": bw / 1e9, "bf16_tflops": flops / 1e12, "rows": ROWS, "compile": TIMES,
           "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"}  # fmt: skip
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    for line in summary_lines(ROWS):  # last, so that the end of a long run's output holds them
        log(line)


def summary_lines(rows: list[dict]) -> list[str]:
    """The batch-1 decode figures of each engine, and each MGX scheme's tokens/s against MGX bf16's in
    the same run (the targets' ratios)."""
    ref = next((r for r in rows if r.get("engine") == "mgx bf16"), {})
    bf16, graph_bf16 = ref.get("decode_b1_tok_s"), ref.get("graph_b1_ms")
    lines = []
    for r in rows:
        if "decode_b1_tok_s" not in r:
            continue
        line = f"summary {r['engine']}: batch 1 {r['decode_b1_tok_s']:.1f} tok/s ({r['decode_b1_bw_frac']:.1%} of copy bandwidth)"
        if "graph_b1_ms" in r:
            line += f", graph {r['graph_b1_ms']:.3f} ms"
        if bf16 and r["engine"].startswith("mgx ") and r["engine"] != "mgx bf16":
            line += f", {r['decode_b1_tok_s'] / bf16:.3f}x bf16"
            if graph_bf16 and "graph_b1_ms" in r:
                line += f" (graphs {graph_bf16 / r['graph_b1_ms']:.3f}x)"
        lines.append(line)
    return lines


if __name__ == "__main__":
    main()
