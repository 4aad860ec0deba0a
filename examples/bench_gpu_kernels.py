"""Benchmark MGX's GPU kernels against the GPU's measured ceilings and against PyTorch, in one run.

    python examples/bench_gpu_kernels.py [--only rmsnorm,gemv,native,embedding,decode,prefill,lm_head] [--json out.json]
        [--own-sweep]

Measures first the copy bandwidth (a large device-to-device copy, bytes read plus bytes written)
and the bf16 matrix rate, then times each kernel with ``triton.testing.do_bench`` (median; it
flushes the L2 cache before every call) and reports bytes moved per second as a fraction of the
measured copy bandwidth:

- RMSNorm (native CUDA, Triton) against the Hugging Face-style eager RMSNorm and
  ``torch.nn.functional.rms_norm`` on (1, 4096), (32, 4096), (4096, 4096), (16384, 8192) bf16;
- GEMV at batch 1 on Llama-3.1-8B shapes for bf16 (cuBLAS and Triton), W8A16, INT4 (g128) and 2:4;
- ``native``: the native CUDA GEMV kinds alone on the 8B decode products, W8A16 and INT4 (g128),
  with ``--nvcc-flag`` for gemv.cu's compile-time settings (an A/B in about a minute);
- ``embedding``: a decode step's lookup in a quantized 128,256 x 4,096 table, one Triton kernel against
  torch's gathers and the reference dequantization;
- paged decode attention (Llama-3.1-8B heads) over long contexts, and prefill attention;
- the LM head fused with argmax against cuBLAS + torch.argmax.

Each Triton kernel is timed over a small set of launch configurations (what the autotune pass
would do) and the best is reported with its configuration. ``--smoke`` runs tiny shapes on the
CPU under TRITON_INTERPRET=1, to check the script itself.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable

SMOKE = "--smoke" in sys.argv
WARM = "--warm" in sys.argv  # only compile every kernel and configuration (fills Triton's disk cache)
OWN_SWEEP = "--own-sweep" in sys.argv  # every Triton RMSNorm configuration's own duration (own_sweep)
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() and not SMOKE else "cpu"
RESULTS: list[dict] = []


def bench(fn: Callable[[], object], rep: int = 100) -> float:
    """Median milliseconds of ``fn``, each call on a cold L2 (one timed call under --smoke).

    ``fn`` is captured once in a CUDA graph and replayed, so Python's launch overhead (large for a
    ctypes launch) never shows as GPU idle time inside the timed region; before each replay the L2
    is flushed by writing a 256 MiB buffer. Functions that cannot be captured fall back to
    ``triton.testing.do_bench`` (which flushes too, but times eager launches).
    """
    if WARM:
        fn()
        return 1.0
    if DEVICE == "cpu":
        fn()
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    try:
        return _bench_graph(fn, rep)
    except Exception as e:  # noqa: BLE001 - not capturable: time eager launches instead
        print(f"    (no CUDA graph: {type(e).__name__}: {str(e).splitlines()[0][:100]}; timing eagerly)", flush=True)
        import triton.testing

        torch.cuda.synchronize()
        return float(triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median"))


_FLUSH: list[torch.Tensor] = []


def _flush_buffer() -> torch.Tensor:
    """The 256 MiB buffer whose writing flushes the L2 before a timed call (made once)."""
    if not _FLUSH:
        _FLUSH.append(torch.empty(256 << 20, dtype=torch.int8, device=DEVICE))
    return _FLUSH[0]


def _bench_graph(fn: Callable[[], object], rep: float) -> float:
    flush = _flush_buffer()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()

    def run(n: int) -> list[float]:
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        for a, b in zip(starts, ends):
            flush.zero_()
            a.record()
            graph.replay()
            b.record()
        torch.cuda.synchronize()
        return [a.elapsed_time(b) for a, b in zip(starts, ends)]

    estimate = statistics.median(run(5))
    return statistics.median(run(max(10, min(1000, int(rep / max(estimate, 1e-3))))))


def kernel_ms(fn: Callable[[], object], rep: int = 20) -> float | None:
    """Median milliseconds a call of ``fn`` spends in its own kernels on the GPU, by the profiler's
    kernel records (CUPTI): the kernels' durations alone, where ``bench`` times a graph replay between
    two events (the launch, the gaps around the kernels and their ramp all count there). Each call on
    a cold L2 as in ``bench``; the flush's kernels are known by name from a profile of it alone. None
    on the CPU, under --warm, or where the calls do not launch the same number of kernels."""
    if DEVICE != "cuda" or WARM:
        return None
    from torch.profiler import ProfilerActivity, profile

    def device_events(prof) -> list:  # noqa: ANN001
        return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]

    flush = _flush_buffer()
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as alone:
        flush.zero_()
        torch.cuda.synchronize()
    flush_names = {e.name for e in device_events(alone)}
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(rep):
            flush.zero_()
            fn()
            torch.cuda.synchronize()
    own = sorted((e for e in device_events(prof) if e.name not in flush_names), key=lambda e: e.time_range.start)
    per = len(own) // rep
    if per == 0 or len(own) % rep:
        return None
    calls = [own[i * per:(i + 1) * per] for i in range(rep)]
    return statistics.median(sum(e.time_range.end - e.time_range.start for e in c) for c in calls) / 1e3


def record(section: str, case: str, variant: str, ms: float, nbytes: float = 0.0, flops: float = 0.0, **extra) -> dict:
    row = {"section": section, "case": case, "variant": variant, "ms": ms, "us": ms * 1e3,
           "GB/s": nbytes / ms / 1e6 if nbytes else None, "TFLOP/s": flops / ms / 1e9 if flops else None, **extra}  # fmt: skip
    RESULTS.append(row)
    gbs = f"{row['GB/s']:8.0f} GB/s" if nbytes else ""
    tf = f"{row['TFLOP/s']:7.1f} TFLOP/s" if flops else ""
    print(f"  {section:8s} {case:22s} {variant:34s} {ms * 1e3:10.1f} us {gbs} {tf} {extra or ''}", flush=True)
    return row


def best_of(configs, run: Callable[[object], Callable[[], object]], rep: int = 40) -> tuple[float, object]:
    """The fastest configuration: (ms, config). Configurations that fail to compile or run are skipped."""
    best = (math.inf, None)
    for cfg in configs:
        try:
            fn = run(cfg)
            fn()
            ms = bench(fn, rep)
        except Exception as e:  # noqa: BLE001 - a config the compiler rejects is just not a candidate
            print(f"    skipped {cfg}: {type(e).__name__}: {str(e).splitlines()[0][:120]}", flush=True)
            continue
        best = min(best, (ms, cfg), key=lambda t: t[0])
    return best


# --- ceilings ---------------------------------------------------------------------------------------


def ceilings() -> dict:
    return {"copy_GBps": _copy_bandwidth(), "bf16_TFLOPs": _matmul_rate()}


def _copy_bandwidth() -> float:
    n = (1 << 30) // 2 if DEVICE == "cuda" else 1 << 16  # 1 GiB of bf16
    src = torch.randn(n, device=DEVICE).to(torch.bfloat16)
    dst = torch.empty_like(src)
    if DEVICE == "cuda" and not WARM:
        import triton.testing

        # Eager, not graph-timed: a captured copy_ becomes a copy-engine memcpy node (2.7 TB/s here),
        # while eager copy_ runs as an SM kernel, the ceiling the kernels are compared with.
        ms = float(triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=100, return_mode="median"))
    else:
        ms = bench(lambda: dst.copy_(src))
    row = record("ceiling", f"copy {src.nbytes / 2**30:.0f} GiB", "torch copy_ (read+write)", ms, 2 * src.nbytes)
    own = kernel_ms(lambda: dst.copy_(src), rep=5)
    if own is not None:  # at this size the launch is a rounding error: the two should agree
        row["own_GB/s"] = 2 * src.nbytes / own / 1e6
        print(f"      its kernel's own duration (profiler) {own * 1e3:.1f} us: {row['own_GB/s']:.0f} GB/s", flush=True)
    return row["GB/s"]


def _matmul_rate() -> float:
    m = 8192 if DEVICE == "cuda" else 64
    a = torch.randn(m, m, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(m, m, device=DEVICE, dtype=torch.bfloat16)
    ms = bench(lambda: a @ b)
    return record("ceiling", f"matmul {m}^3 bf16", "torch (cuBLAS)", ms, flops=2 * m**3)["TFLOP/s"]


# --- RMSNorm ----------------------------------------------------------------------------------------


def hf_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm.forward, verbatim in effect."""
    dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return w * h.to(dtype)


def bench_rmsnorm(copy_gbps: float, cuda_kernels) -> None:  # noqa: ANN001
    shapes = [(1, 4096), (32, 4096), (4096, 4096), (16384, 8192)] if DEVICE == "cuda" else [(1, 64), (8, 128)]
    for rows, cols in shapes:
        _rmsnorm_case(rows, cols, copy_gbps, cuda_kernels)


def _rmsnorm_case(rows: int, cols: int, copy_gbps: float, cuda_kernels) -> None:  # noqa: ANN001
    from mgx.kernels.cuda import rmsnorm as crms
    from mgx.kernels.triton import rmsnorm as trms

    eps = 1e-5
    x = torch.randn(rows, cols, device=DEVICE).to(torch.bfloat16)
    r = torch.randn(rows, cols, device=DEVICE).to(torch.bfloat16)
    w = torch.randn(cols, device=DEVICE).to(torch.bfloat16)
    case = f"({rows}, {cols})"
    nbytes = 2 * x.nbytes + w.nbytes  # read x, write out
    want = trms.rms_norm_ref(x, w, eps).float()

    def check(got: torch.Tensor, name: str) -> None:
        err = float((got.float() - want).norm() / want.norm())
        if not err < 1e-2:
            print(f"    WRONG {name}: relative error {err:.2e}", flush=True)

    y = torch.empty_like(x)
    same = record("rmsnorm", case, "torch copy_ of the same bytes (graph)", bench(lambda: y.copy_(x)), 2 * x.nbytes)
    same_own = own_duration(same, lambda: y.copy_(x), 2 * x.nbytes, copy_gbps)  # eager: an SM kernel, not a memcpy node
    eager = record("rmsnorm", case, "HF eager (LlamaRMSNorm)", bench(lambda: hf_rms_norm(x, w, eps)), nbytes)
    record("rmsnorm", case, "torch.nn.functional.rms_norm",
           bench(lambda: torch.nn.functional.rms_norm(x, (cols,), w, eps)), nbytes)  # fmt: skip

    def speed(row: dict, baseline: dict, fn: Callable[[], object] | None = None, moved: int = nbytes) -> None:
        row["x_eager"] = baseline["ms"] / row["ms"]
        row["frac_copy_bw"] = row["GB/s"] / copy_gbps
        row["frac_same_size_copy"] = row["GB/s"] / same["GB/s"]
        print(f"      -> {row['x_eager']:.2f}x eager, {100 * row['frac_copy_bw']:.1f}% of copy bandwidth "
              f"({100 * row['frac_same_size_copy']:.0f}% of a copy of the same size)", flush=True)  # fmt: skip
        if fn is not None:
            own_duration(row, fn, moved, copy_gbps, same_own)

    check(trms.rms_norm(x, w, eps), "triton")
    speed(record("rmsnorm", case, "MGX Triton (default config)", bench(lambda: trms.rms_norm(x, w, eps)), nbytes), eager,
          lambda: trms.rms_norm(x, w, eps))  # fmt: skip
    configs = [c for c in trms.CONFIGS + trms.LOOP_CONFIGS
               if c.block_m <= max(1, rows) and c.block_m * cols <= 16384 and c.num_warps >= 2]  # fmt: skip
    for looping in (False, True):  # a program a block of rows; programs looping over the blocks
        ms, cfg = best_of([c for c in configs if (c.per_sm > 0) == looping], lambda c: lambda: trms.rms_norm(x, w, eps, config=c))
        if cfg is not None:
            speed(record("rmsnorm", case, f"MGX Triton (best: {_rms_config_name(cfg)})", ms, nbytes), eager,
                  lambda cfg=cfg: trms.rms_norm(x, w, eps, config=cfg))  # fmt: skip
    if OWN_SWEEP and (rows >= 4096 or SMOKE):  # in --smoke only the code path: no own durations on the CPU
        own_sweep(case, configs, lambda c: lambda: trms.rms_norm(x, w, eps, config=c), nbytes, copy_gbps)
    if cuda_kernels is not None:
        check(crms.rms_norm(x, w, eps, kernels=cuda_kernels), "cuda")
        ms, vpt = best_of([4, 2, 1], lambda v: lambda: crms.rms_norm(x, w, eps, kernels=cuda_kernels, vecs_per_thread=v))
        speed(record("rmsnorm", case, f"MGX CUDA (best: {vpt} vec/thread)", ms, nbytes), eager,
              lambda: crms.rms_norm(x, w, eps, kernels=cuda_kernels, vecs_per_thread=vpt))  # fmt: skip
    # The fused residual form moves twice the bytes: read x and residual, write out and the sum.
    nb2 = 4 * x.nbytes + w.nbytes
    eager_res = record("rmsnorm", case, "HF eager add + RMSNorm", bench(lambda: hf_rms_norm(x + r, w, eps)), nb2)
    speed(record("rmsnorm", case, "MGX Triton + residual", bench(lambda: trms.rms_norm(x, w, eps, residual=r)), nb2),
          eager_res, lambda: trms.rms_norm(x, w, eps, residual=r), nb2)  # fmt: skip
    if cuda_kernels is not None:
        speed(record("rmsnorm", case, "MGX CUDA + residual",
                     bench(lambda: crms.rms_norm(x, w, eps, kernels=cuda_kernels, residual=r)), nb2), eager_res,
              lambda: crms.rms_norm(x, w, eps, kernels=cuda_kernels, residual=r), nb2)  # fmt: skip


def _rms_config_name(c) -> str:  # noqa: ANN001 - an RMSNormConfig
    """How the rows name a Triton RMSNorm configuration: rows and warps of a program, and its loop."""
    return f"m{c.block_m} w{c.num_warps}" + (f" loop {c.per_sm}/SM" if c.per_sm else "")


def own_duration(row: dict, fn: Callable[[], object], moved: int, copy_gbps: float,
                 same: float | None = None) -> float | None:  # fmt: skip
    """``kernel_ms`` of ``fn`` into ``row`` (``own_us``, ``own_frac_copy_bw``) and printed beside it, with
    the fraction of the same-size copy's own rate where ``same`` (its ``own_frac_copy_bw``) is given."""
    ms = kernel_ms(fn)
    if ms is None:
        return None
    row["own_us"], row["own_frac_copy_bw"] = ms * 1e3, moved / ms / 1e6 / copy_gbps
    than = f" ({100 * row['own_frac_copy_bw'] / same:.0f}% of the same-size copy's)" if same else ""
    print(f"      kernels' own duration (profiler) {ms * 1e3:.1f} us: {100 * row['own_frac_copy_bw']:.1f}% of copy "
          f"bandwidth{than}", flush=True)  # fmt: skip
    return row["own_frac_copy_bw"]


def own_sweep(case: str, configs: list, run: Callable[[object], Callable[[], object]], moved: int,
              copy_gbps: float, rounds: int = 3) -> None:  # fmt: skip
    """Every configuration's own duration (``kernel_ms``), fastest first, ``rounds`` times: the best
    by replay time (``best_of``) need not be the best by the kernels' own duration, and the spread
    between rounds says which differences are real. Rows ``own sweep <config>``: ``ms`` the median of
    the rounds' own durations, ``pct_copy_bw`` each round's percentage of copy bandwidth."""
    times: dict[str, list[float]] = {}
    for _ in range(rounds):
        for c in configs:
            ms = kernel_ms(run(c))
            if ms is not None:
                times.setdefault(_rms_config_name(c), []).append(ms)
    for name, ms in sorted(times.items(), key=lambda kv: statistics.median(kv[1])):
        record("rmsnorm", case, f"own sweep {name}", statistics.median(ms), moved,
               pct_copy_bw=[round(100 * moved / t / 1e6 / copy_gbps, 1) for t in ms])  # fmt: skip


# --- GEMV -------------------------------------------------------------------------------------------

GEMV_SCHEMES = [
    ("w8a16", "w8a16", {}),
    ("int4 g128", "int4", {"group_size": 128}),
    ("int4 g128 sym", "int4", {"group_size": 128, "symmetric": True}),
    ("2:4 bf16", "sparse24", {}),
    ("2:4 bf16 nibble-meta", "sparse24", {"layout": "sparse24_nibble_meta"}),
    ("2:4 int4 g128 nibble-meta", "sparse24_int4", {"group_size": 128, "layout": "sparse24_nibble_meta"}),
]


def bench_gemv(copy_gbps: float, kernels=None) -> None:  # noqa: ANN001
    from mgx.kernels.triton import linear as lin
    from mgx.kernels.triton.testing import make_weight

    shapes = [(4096, 4096), (14336, 4096), (4096, 14336)] if DEVICE == "cuda" else [(64, 256)]
    configs = lin.GEMV_CONFIGS if DEVICE == "cuda" else lin.GEMV_CONFIGS[:2]
    for n, k in shapes:
        x = torch.randn(1, k, device=DEVICE).to(torch.bfloat16)
        cublas_ms = _cublas_case(x, make_weight("none", n, k, device=DEVICE), configs, copy_gbps)
        for label, scheme, kw in GEMV_SCHEMES:
            _gemv_case(x, make_weight(scheme, n, k, device=DEVICE, **kw), label, cublas_ms, configs, copy_gbps, kernels)
    # The fused gate/up + SiLU-mul of Llama-3.1-8B at batch 1: W [2 x 14336, 4096].
    n, k = (2 * 14336, 4096) if DEVICE == "cuda" else (64, 256)
    x = torch.randn(1, k, device=DEVICE).to(torch.bfloat16)
    for label, scheme, kw in [("bf16", "none", {})] + GEMV_SCHEMES[:2]:
        _gate_up_case(x, make_weight(scheme, n, k, device=DEVICE, **kw), label, configs, copy_gbps, kernels)


def bench_native(copy_gbps: float, kernels=None) -> None:  # noqa: ANN001
    """The native GEMV kinds alone on Llama-3.1-8B's one-row decode products (qkv, o_proj, gate/up
    with the SiLU product fused, down) for W8A16 and int4 g128: an A/B of gemv.cu in about a minute
    (``--nvcc-flag`` builds it with other compile-time settings), without ``gemv``'s Triton sweeps."""
    from mgx.kernels.triton.testing import make_weight

    if DEVICE == "cuda":
        shapes = [(6144, 4096, False), (4096, 4096, False), (28672, 4096, True), (4096, 14336, False)]
    else:
        shapes = [(64, 256, False), (64, 256, True)]
    for label, scheme, kw in GEMV_SCHEMES[:2]:
        for n, k, silu in shapes:
            x = torch.randn(1, k, device=DEVICE).to(torch.bfloat16)
            w = make_weight(scheme, n, k, device=DEVICE, **kw)
            case = f"gate_up+silu N={n} K={k}" if silu else f"N={n} K={k} M=1"
            nbytes = w.nbytes + x.nbytes + 2 * (n // 2 if silu else n)
            _native_gemv_row(x, w, label, case, nbytes, copy_gbps, kernels, silu_mul=silu)


def _cublas_case(x, dense, configs, copy_gbps: float) -> float:  # noqa: ANN001
    """Times cuBLAS and MGX on a dense bf16 weight; returns the cuBLAS time."""
    nbytes = dense.nbytes + x.nbytes + 2 * dense.n
    ms = bench(lambda: torch.nn.functional.linear(x, dense.weight))
    row = record("gemv", f"N={dense.n} K={dense.k} M=1", "bf16 torch F.linear (cuBLAS)", ms, nbytes)
    row["frac_copy_bw"] = row["GB/s"] / copy_gbps
    _gemv_case(x, dense, "bf16", ms, configs, copy_gbps)
    return ms


def _gemv_case(x, w, label: str, cublas_ms: float, configs, copy_gbps: float, kernels=None) -> None:  # noqa: ANN001
    from mgx.kernels.triton import linear as lin

    nbytes = w.nbytes + x.nbytes + 2 * w.n
    err = float((lin.linear(x, w).float() - lin.linear_ref(x, w).float()).norm() / lin.linear_ref(x, w).float().norm())
    ms, cfg = best_of(configs, lambda c: lambda: lin.linear(x, w, config=c))
    row = record("gemv", f"N={w.n} K={w.k} M=1", f"MGX {label}", ms, nbytes, config=str(cfg), rel_err=f"{err:.1e}")
    row["frac_copy_bw"] = row["GB/s"] / copy_gbps
    row["x_vs_cublas_bf16"] = cublas_ms / ms
    print(f"      -> {100 * row['frac_copy_bw']:.1f}% of copy bandwidth, {row['x_vs_cublas_bf16']:.2f}x cuBLAS bf16",
          flush=True)  # fmt: skip
    _native_gemv_row(x, w, label, f"N={w.n} K={w.k} M=1", nbytes, copy_gbps, kernels, cublas_ms=cublas_ms)


def _native_gemv_row(x, w, label: str, case: str, nbytes: int, copy_gbps: float, kernels,  # noqa: ANN001
                     silu_mul: bool = False, cublas_ms: float | None = None) -> None:  # fmt: skip
    """The native CUDA GEMVs (gemv.cu: CUDA cores, and tensor cores for int4) on the same product,
    where the built kernels take it."""
    from mgx.kernels.cuda import gemv as cg
    from mgx.kernels.triton import linear as lin
    from mgx.kernels.triton.testing import as_read_by

    w = as_read_by(w, kernels, silu_mul)  # tiled codes (and scale pairs) as the build reads them
    for kind in cg.KINDS:
        if kernels is None or not cg.gemv_applies(kernels, x, w, kind=kind):
            continue
        want = (lin.linear_silu_mul_ref if silu_mul else lin.linear_ref)(x, w).float()
        got = cg.gemv(x, w, kernels=kernels, silu_mul=silu_mul, kind=kind).float()
        err = float((got - want).norm() / want.norm())
        ms = bench(lambda k=kind: cg.gemv(x, w, kernels=kernels, silu_mul=silu_mul, kind=k))
        name = f"native CUDA {kind} {label}" + (" fused" if silu_mul else "")
        row = record("gemv", case, name, ms, nbytes, rel_err=f"{err:.1e}")
        row["frac_copy_bw"] = row["GB/s"] / copy_gbps
        if cublas_ms is not None:
            row["x_vs_cublas_bf16"] = cublas_ms / ms
        print(f"      -> {100 * row['frac_copy_bw']:.1f}% of copy bandwidth", flush=True)
        if cg.staged_applies(kernels, x, w, kind):
            _staged_rows(x, w, kind, name, case, nbytes, copy_gbps, kernels, silu_mul, got)


def _staged_rows(x, w, kind: str, name: str, case: str, nbytes: int, copy_gbps: float, kernels,  # noqa: ANN001
                 silu_mul: bool, want: torch.Tensor) -> None:  # fmt: skip
    """``kind``'s staged twin (x staged once for every block, ``cg.stage_x``): the stage kernel and the
    GEMV in one graph, and the GEMV alone on a staged record (what a producer that stages its output
    would leave); each checked to give the kind's bits."""
    from mgx.kernels.cuda import gemv as cg

    rec = cg.stage_x(x, w.scheme, kernels=kernels)
    same = torch.equal(cg.gemv_staged(rec, w, kernels=kernels, silu_mul=silu_mul, kind=kind).float(), want)
    both = bench(lambda: cg.gemv_staged(cg.stage_x(x, w.scheme, kernels=kernels, out=rec), w, kernels=kernels,
                                        silu_mul=silu_mul, kind=kind))  # fmt: skip
    alone = bench(lambda: cg.gemv_staged(rec, w, kernels=kernels, silu_mul=silu_mul, kind=kind))
    for variant, ms in (("stage + staged GEMV", both), ("staged GEMV alone", alone)):
        row = record("gemv", case, f"{name} {variant}", ms, nbytes, same_bits=same)
        row["frac_copy_bw"] = row["GB/s"] / copy_gbps


def _gate_up_case(x, w, label: str, configs, copy_gbps: float, kernels=None) -> None:  # noqa: ANN001
    from mgx.kernels.triton import linear as lin

    nbytes = w.nbytes + x.nbytes + w.n
    ms, cfg = best_of(configs, lambda c: lambda: lin.linear_silu_mul(x, w, config=c))
    row = record("gemv", f"gate_up+silu N={w.n} K={w.k}", f"MGX {label} fused", ms, nbytes, config=str(cfg))
    row["frac_copy_bw"] = row["GB/s"] / copy_gbps
    _native_gemv_row(x, w, label, f"gate_up+silu N={w.n} K={w.k}", nbytes, copy_gbps, kernels, silu_mul=True)


def bench_batch(copy_gbps: float) -> None:
    """Decode-batch linears (M rows) of Llama-3.2-1B and -3.1-8B shapes: cuBLAS, MGX's default
    configuration, and the best configuration without and with split K."""
    from mgx.kernels.triton import linear as lin
    from mgx.kernels.triton.testing import make_weight

    shapes = [(3072, 2048), (2048, 2048), (2048, 8192), (4096, 4096), (4096, 14336)] if DEVICE == "cuda" else [(64, 256)]
    rows = (1, 8, 32, 128) if DEVICE == "cuda" else (1, 4)
    for n, k in shapes:
        w = make_weight("none", n, k, device=DEVICE)
        for m in rows:
            x = torch.randn(m, k, device=DEVICE).to(torch.bfloat16)
            case, nbytes = f"N={n} K={k} M={m}", w.nbytes + x.nbytes + 2 * n * m
            record("batch", case, "bf16 torch F.linear (cuBLAS)",
                   bench(lambda x=x, w=w: torch.nn.functional.linear(x, w.weight)), nbytes)  # fmt: skip
            cfg = lin.default_config(m, n, k)
            record("batch", case, "MGX default", bench(lambda x=x, w=w: lin.linear(x, w)), nbytes, config=str(cfg))
            configs = lin.GEMV_CONFIGS if m <= lin.GEMV_MAX_M else lin.GEMM_CONFIGS
            if DEVICE != "cuda":
                configs = configs[:1] + [c for c in configs if c.split_k > 1][:1]
            for label, pick in (("best unsplit", [c for c in configs if c.split_k == 1]),
                                ("best split-K", [c for c in configs if c.split_k > 1])):  # fmt: skip
                ms, best = best_of(pick, lambda c, x=x, w=w: lambda: lin.linear(x, w, config=c))
                if best is not None:
                    row = record("batch", case, f"MGX {label}", ms, nbytes, config=str(best))
                    row["frac_copy_bw"] = row["GB/s"] / copy_gbps


def bench_swap(copy_gbps: float) -> None:
    """Few-row linears of Llama-3.2-1B and -3.1-8B shapes, bf16 activations: the CUDA-core GEMV (one
    row) or ``tl.dot`` tiles (more rows) against the transposed tensor-core path (``swap``)."""
    from mgx.kernels.triton import linear as lin
    from mgx.kernels.triton.testing import make_weight

    cuda = DEVICE == "cuda"
    shapes = [(3072, 2048), (16384, 2048), (6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)] if cuda else [(64, 256)]
    schemes = [("bf16", "none", {})] + GEMV_SCHEMES[:3]
    swaps = lin.SWAP_CONFIGS if cuda else lin.SWAP_CONFIGS[:2]
    for n, k in shapes:
        for label, scheme, kw in schemes:
            w = make_weight(scheme, n, k, device=DEVICE, **kw)
            for m in (1, 16) if cuda else (1, 3):
                x = torch.randn(m, k, device=DEVICE).to(torch.bfloat16)
                case, nbytes = f"N={n} K={k} M={m}", w.nbytes + x.nbytes + 2 * n * m
                want = lin.linear_ref(x, w).float()
                rows = [("default", [None])]
                if cuda and m <= lin.GEMV_MAX_M:
                    rows.append(("best plain", lin.GEMV_CONFIGS))
                rows.append(("best swap", swaps))
                for variant, configs in rows:
                    ms, cfg = best_of(configs, lambda c, x=x, w=w: lambda: lin.linear(x, w, config=c))
                    if math.isinf(ms):
                        continue
                    got = lin.linear(x, w, config=cfg).float()
                    err = float((got - want).norm() / want.norm())
                    row = record("swap", case, f"{label} {variant}", ms, nbytes, config=str(cfg), rel_err=f"{err:.1e}")
                    row["frac_copy_bw"] = row["GB/s"] / copy_gbps


def bench_dequant(tflops: float) -> None:
    """Prefill-sized products on quantized weights: ``tl.dot`` tiles that dequantize in registers
    against ``dequantize`` into a bf16 buffer followed by cuBLAS (what the CUDA backend runs from
    ``DEQUANTIZE_MIN_M`` rows on)."""
    from mgx.kernels.triton import linear as lin
    from mgx.kernels.triton.testing import make_weight

    cuda = DEVICE == "cuda"
    shapes = [(6144, 4096), (28672, 4096), (4096, 14336)] if cuda else [(64, 256)]
    for n, k in shapes:
        buf = torch.empty(n * k, dtype=torch.bfloat16, device=DEVICE)
        for label, scheme, kw in GEMV_SCHEMES[:3]:
            w = make_weight(scheme, n, k, device=DEVICE, **kw)
            record("dequant", f"N={n} K={k}", f"{label} dequantize only",
                   bench(lambda w=w, buf=buf: lin.dequantize(w, torch.bfloat16, out=buf)), w.nbytes + 2 * n * k)  # fmt: skip
            for m in (64, 128, 256, 512, 2048) if cuda else (32,):
                x = torch.randn(m, k, device=DEVICE).to(torch.bfloat16)
                case, flops = f"N={n} K={k} M={m}", 2.0 * m * n * k
                for variant, fn in (
                    ("tl.dot tiles (default)", lambda x=x, w=w: lin.linear(x, w)),
                    ("dequantize + cuBLAS", lambda x=x, w=w, buf=buf: torch.nn.functional.linear(
                        x, lin.dequantize(w, torch.bfloat16, out=buf))),
                ):  # fmt: skip
                    row = record("dequant", case, f"{label} {variant}", bench(fn), flops=flops)
                    row["frac_matmul_rate"] = row["TFLOP/s"] / tflops


def bench_embedding(copy_gbps: float) -> None:
    """The embedding lookup of a decode step's tokens in a quantized 128,256 x 4,096 table (Llama-3.1-8B):
    ``dequantize(rows=)``, one kernel (what the CUDA backend runs), against torch's gathers of the rows'
    codes, scales and zeros and the reference dequantization (what it ran before), both to bf16, with
    the kernels each launches."""
    from mgx.kernels.triton import linear as lin
    from mgx.kernels.triton.testing import make_weight, tile16

    cuda = DEVICE == "cuda"
    n, k = (128256, 4096) if cuda else (64, 256)
    for label, scheme, kw in GEMV_SCHEMES[:2]:
        for tiled in (False, True):
            w = make_weight(scheme, n, k, device=DEVICE, **kw)
            w = tile16(w) if tiled else w
            for tokens in (1, 8):
                ids = torch.randint(0, n, (tokens,), device=DEVICE)
                variants = (("dequantize(rows=)", lambda w=w, ids=ids: lin.dequantize(w, torch.bfloat16, rows=ids)),
                            ("gather + reference", lambda w=w, ids=ids: lin.dequantize_ref(
                                lin.take_rows(w, ids)).to(torch.bfloat16)))  # fmt: skip
                assert torch.equal(variants[0][1](), variants[1][1]())
                case = f"{label}{' tile16' if tiled else ''} T={tokens}"
                nbytes = w.nbytes / n * tokens + 2 * k * tokens
                for variant, fn in variants:
                    row = record("embed", case, variant, bench(fn), nbytes, kernels=_kernels_launched(fn))
                    row["frac_copy_bw"] = row["GB/s"] / copy_gbps


def _kernels_launched(fn: Callable[[], object]) -> int | None:
    """How many kernels one call of ``fn`` launches (None without a GPU)."""
    if DEVICE != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


# --- attention --------------------------------------------------------------------------------------

HEADS = {"num_heads": 32, "num_kv_heads": 8, "head_dim": 128, "block_size": 16}  # Llama-3.1-8B, 16-token blocks


def bench_decode(copy_gbps: float) -> None:
    cases = [(1, 640), (1, 8192), (1, 32768), (1, 131072), (8, 32768), (32, 4096), (64, 8192)] if DEVICE == "cuda" else [(2, 40)]
    for batch, ctx in cases:
        _decode_case(batch, ctx, copy_gbps)


def _decode_case(batch: int, ctx: int, copy_gbps: float) -> None:
    from mgx.kernels.triton import attention as att
    from mgx.kernels.triton.testing import paged_batch

    b = paged_batch([ctx] * batch, [1] * batch, **HEADS, dtype=torch.bfloat16, device=DEVICE, spare_blocks=0)
    hq, hk, d = HEADS["num_heads"], HEADS["num_kv_heads"], HEADS["head_dim"]
    nbytes = b.k_cache.nbytes + b.v_cache.nbytes + 2 * b.q.nbytes
    case = f"B={batch} ctx={ctx}"
    scale = d**-0.5
    want = att.paged_attention_ref(b.q[:1], b.k_cache, b.v_cache, b.block_table[:1], b.context_lens[:1],
                                   b.query_start_loc[:2], b.positions[:1], scale=scale).float()  # fmt: skip
    got = att.paged_attention_decode(b.q, b.k_cache, b.v_cache, b.block_table, b.context_lens, scale=scale,
                                     max_context_len=ctx)[:1].float()  # fmt: skip
    err = float((got - want).norm() / want.norm())
    configs = [(bn, w, s) for bn in (32, 64, 128) for w in (4, 8) for s in (2, 3)] if DEVICE == "cuda" else [(16, 4, 1)]

    def run(c):  # noqa: ANN001, ANN202
        bn, w, s = c
        return lambda: att.paged_attention_decode(b.q, b.k_cache, b.v_cache, b.block_table, b.context_lens,
                                                  scale=scale, max_context_len=ctx, block_n=bn, num_warps=w,
                                                  num_stages=s)  # fmt: skip

    ms, cfg = best_of(configs, run)
    sms = torch.cuda.get_device_properties(0).multi_processor_count if DEVICE == "cuda" else 4
    splits = att.decode_splits(batch, hk, ctx, sms, cfg[0] if cfg else 64)
    row = record("decode", case, "MGX paged decode (split-KV)", ms, nbytes,
                 config=f"block_n,warps,stages={cfg} splits={splits}", rel_err=f"{err:.1e}")  # fmt: skip
    row["frac_copy_bw"] = row["GB/s"] / copy_gbps
    print(f"      -> {100 * row['frac_copy_bw']:.1f}% of copy bandwidth", flush=True)
    if cfg is not None:
        # The decode layer as the backend ran it (RoPE + K/V write, decode, merge: three launches)
        # against one launch doing all three (RoPE in the prologue, splits merging themselves).
        from mgx.kernels.triton.rope import rope_and_write_kv

        counters = att.new_decode_counters(DEVICE, batch, hk)
        inv = 1.0 / 500000.0 ** (torch.arange(0, d, 2, device=DEVICE, dtype=torch.float32) / d)
        qq, kk = b.q.clone(), b.k.clone()
        bn, w, s = cfg
        kw = dict(scale=scale, max_context_len=ctx, block_n=bn, num_warps=w, num_stages=s)

        def apart() -> None:
            rope_and_write_kv(qq, kk, b.v, b.positions, inv, b.k_cache, b.v_cache, b.block_table, b.query_start_loc,
                              head_dim=d)  # fmt: skip
            att.paged_attention_decode(qq, b.k_cache, b.v_cache, b.block_table, b.context_lens, **kw)

        rope = att.DecodeRope(b.k, b.v, inv)
        record("decode", case, "RoPE + K/V write, decode, merge (3 launches)", bench(apart), nbytes, config=f"{cfg}")
        ms = bench(lambda: att.paged_attention_decode(b.q, b.k_cache, b.v_cache, b.block_table, b.context_lens,
                                                      counters=counters, rope=rope, **kw))  # fmt: skip
        record("decode", case, "the same in one launch (RoPE prologue, splits merge)", ms, nbytes, config=f"{cfg}")
    if DEVICE == "cuda" and batch * ctx <= 8 * 32768:
        # Orientation: torch SDPA over contiguous K/V (no paging), the same bytes.
        kk = torch.randn(batch, hk, ctx, d, device=DEVICE, dtype=torch.bfloat16)
        vv = torch.randn_like(kk)
        qq = b.q.reshape(batch, hq, 1, d)
        try:
            ms = bench(lambda: torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, scale=scale, enable_gqa=True))
            record("decode", case, "torch SDPA, contiguous K/V", ms, nbytes)
        except Exception as e:  # noqa: BLE001
            print(f"    torch SDPA failed: {e}", flush=True)


def bench_prefill(tflops: float) -> None:
    cases = [(1, 2048), (4, 2048), (1, 8192)] if DEVICE == "cuda" else [(1, 40)]
    for batch, t in cases:
        _prefill_case(batch, t, tflops)


def _prefill_case(batch: int, t: int, tflops: float) -> None:
    from mgx.kernels.triton import attention as att
    from mgx.kernels.triton.testing import paged_batch

    b = paged_batch([t] * batch, [t] * batch, **HEADS, dtype=torch.bfloat16, device=DEVICE, spare_blocks=0)
    hq, hk, d = HEADS["num_heads"], HEADS["num_kv_heads"], HEADS["head_dim"]
    flops = batch * 4 * hq * d * t * (t + 1) / 2  # causal: QK^T and PV over the visible half
    case = f"B={batch} T={t}"
    scale = d**-0.5
    configs = [(c.block_m, c.block_n, c.num_warps, c.num_stages) for c in att.PREFILL_CONFIGS]  # autotune's candidates
    configs = configs if DEVICE == "cuda" else [(16, 16, 4, 1)]

    def run(c):  # noqa: ANN001, ANN202
        bm, bn, w, s = c
        return lambda: att.paged_attention_prefill(b.q, b.k_cache, b.v_cache, b.block_table, b.context_lens,
                                                   b.query_start_loc, b.positions, scale=scale, max_query_len=t,
                                                   block_m=bm, block_n=bn, num_warps=w, num_stages=s)  # fmt: skip

    ms, cfg = best_of(configs, run)
    row = record("prefill", case, "MGX paged prefill (causal)", ms, flops=flops, config=f"bm,bn,warps,stages={cfg}")
    row["frac_matmul_rate"] = row["TFLOP/s"] / tflops
    if DEVICE == "cuda":
        qq = b.q.reshape(batch, t, hq, d).transpose(1, 2)
        kk = torch.randn(batch, hk, t, d, device=DEVICE, dtype=torch.bfloat16)
        vv = torch.randn_like(kk)
        sdpa = torch.nn.functional.scaled_dot_product_attention
        try:
            ms = bench(lambda: sdpa(qq, kk, vv, is_causal=True, scale=scale, enable_gqa=True))
            record("prefill", case, "torch SDPA causal, contiguous", ms, flops=flops)
        except Exception as e:  # noqa: BLE001
            print(f"    torch SDPA failed: {e}", flush=True)


# --- LM head + argmax -------------------------------------------------------------------------------


def bench_lm_head(copy_gbps: float) -> None:
    from mgx.kernels.triton.testing import make_weight

    v, h = (128256, 4096) if DEVICE == "cuda" else (300, 64)
    for scheme, label in [("none", "bf16"), ("int4", "int4 g128")]:
        w = make_weight(scheme, v, h, device=DEVICE, group_size=128 if DEVICE == "cuda" else 32)
        for rows in (1, 8, 32) if DEVICE == "cuda" else (1,):
            _lm_head_case(w, rows, label, copy_gbps)


def _lm_head_case(w, rows: int, label: str, copy_gbps: float) -> None:  # noqa: ANN001
    from mgx.kernels.triton import linear as lin
    from mgx.kernels.triton import lm_head

    x = torch.randn(rows, w.k, device=DEVICE).to(torch.bfloat16)
    case = f"V={w.n} H={w.k} R={rows}"
    nbytes = w.nbytes + x.nbytes
    ids, _ = lm_head.lm_head_argmax(x, w)
    want, _ = lm_head.lm_head_argmax_ref(x, w)
    agree = float((ids == want).float().mean())
    if w.scheme == "none":
        record("lm_head", case, "torch F.linear + argmax",
               bench(lambda: torch.nn.functional.linear(x, w.weight).argmax(-1)), nbytes)  # fmt: skip
    configs = lin.GEMV_CONFIGS[::2] if rows <= lin.GEMV_MAX_M else lin.GEMM_CONFIGS[:4]
    configs = configs if DEVICE == "cuda" else configs[:1]
    ms, cfg = best_of(configs, lambda c: lambda: lm_head.lm_head_argmax(x, w, config=c))
    row = record("lm_head", case, f"MGX fused lm_head+argmax {label}", ms, nbytes, config=str(cfg), ids_agree=agree)
    row["frac_copy_bw"] = row["GB/s"] / copy_gbps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="rmsnorm,gemv,batch,decode,prefill,lm_head")
    parser.add_argument("--json", default=None, help="write every row here")
    parser.add_argument("--cubin", default=None, help="a prebuilt cubin for the CUDA RMSNorm (default: build now)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU interpreter")
    parser.add_argument("--warm", action="store_true", help="compile everything, time nothing")
    parser.add_argument("--own-sweep", action="store_true",
                        help="also every Triton RMSNorm configuration's own duration at the large shapes, three rounds")  # fmt: skip
    parser.add_argument("--nvcc-flag", action="append", default=[],
                        help="an extra nvcc flag for the native kernels, e.g. -DMGX_IMMA_UNROLL=2 (repeatable; a "
                             "flag that changes a launch's shape needs gemv.py's constant to match)")  # fmt: skip
    args = parser.parse_args()
    only = set(args.only.split(","))
    if DEVICE == "cuda":
        p = torch.cuda.get_device_properties(0)
        print(f"# {p.name}, {p.multi_processor_count} SMs, torch {torch.__version__}", flush=True)
    ceil = ceilings()
    print(f"# copy bandwidth {ceil['copy_GBps']:.0f} GB/s, bf16 matmul {ceil['bf16_TFLOPs']:.0f} TFLOP/s", flush=True)
    kernels = None
    if DEVICE == "cuda" and only & {"rmsnorm", "gemv", "native"}:
        from mgx.kernels.cuda.build import arch_for, build_cuda_kernels
        from mgx.kernels.cuda.rmsnorm import load_cuda_kernels

        major, minor = torch.cuda.get_device_capability()
        arch = arch_for(major, minor)
        image = open(args.cubin, "rb").read() if args.cubin else build_cuda_kernels(arch, extra_flags=tuple(args.nvcc_flag))
        kernels = load_cuda_kernels(image, arch)
    sections = [
        ("rmsnorm", lambda: bench_rmsnorm(ceil["copy_GBps"], kernels)),
        ("gemv", lambda: bench_gemv(ceil["copy_GBps"], kernels)),
        ("native", lambda: bench_native(ceil["copy_GBps"], kernels)),
        ("batch", lambda: bench_batch(ceil["copy_GBps"])),
        ("swap", lambda: bench_swap(ceil["copy_GBps"])),
        ("dequant", lambda: bench_dequant(ceil["bf16_TFLOPs"])),
        ("embedding", lambda: bench_embedding(ceil["copy_GBps"])),
        ("decode", lambda: bench_decode(ceil["copy_GBps"])),
        ("prefill", lambda: bench_prefill(ceil["bf16_TFLOPs"])),
        ("lm_head", lambda: bench_lm_head(ceil["copy_GBps"])),
    ]
    for name, fn in sections:
        if name in only:
            print(f"## {name}", flush=True)
            start = time.perf_counter()
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - report and go on to the next section
                import traceback

                traceback.print_exc()
                print(f"## {name} FAILED: {e}", flush=True)
            print(f"## {name} took {time.perf_counter() - start:.0f} s", flush=True)
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ceilings": ceil, "rows": RESULTS}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
