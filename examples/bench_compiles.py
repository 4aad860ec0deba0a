"""Which Triton kernels compile while a server takes a load, and on which arguments their variants
differ: each compile mid-load stalls every request in flight (0.3-1 s on the H200's host).

A random-weight model of a ``bench_gpu_model.py`` shape is built in bf16 and loaded on the CUDA
backend; then passes of ``mgx-run bench``'s Poisson workload run one after another on the same
engine (each with its own seed), steps of several sequences launched op by op (``eager``) or as
mixed graphs (``graphs``). For each pass: the compiles, their host seconds, the TTFT and step-time
tails and the graph captures; at the end, for each kernel compiled more than once, the arguments
whose specialization differed between its variants (a count of 1, a multiple of 16 or another; a
pointer 16-byte aligned or not; constexprs):

    python examples/bench_compiles.py --passes eager,eager,graphs --rate 8 --prompts 160
    python examples/bench_compiles.py --warm-up --passes graphs   # what a warmed-up server still compiles

It hooks Triton's JIT (``JITFunction._do_compile`` and ``compute_cache_key``, Triton 3.x internals):
a diagnostic, not part of the product. Point ``TRITON_CACHE_DIR`` at an empty folder to count real
compiles rather than loads from the disk cache (both go through the hook).
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Compile:
    """One kernel variant compiled (or loaded from Triton's disk cache)."""

    kernel: str
    args: tuple[str, ...]  # the kernel's parameter names
    spec: tuple[str, ...]  # each parameter's specialization, as Triton keyed it
    seconds: float


def varying_args(compiles: list[Compile]) -> dict[str, tuple[int, float, dict[str, list[str]]]]:
    """kernel -> (variants, seconds, {parameter: the specializations seen}) for the parameters whose
    specialization differed between a kernel's variants; kernels by most variants first."""
    by: dict[str, list[Compile]] = collections.defaultdict(list)
    for c in compiles:
        by[c.kernel].append(c)
    out = {}
    for kernel, items in sorted(by.items(), key=lambda kv: -len(kv[1])):
        names, width = items[0].args, max(len(c.spec) for c in items)
        diff = {}
        for j in range(width):
            seen = sorted({c.spec[j] if j < len(c.spec) else "-" for c in items})
            if len(seen) > 1:
                diff[names[j] if j < len(names) else str(j)] = seen
        out[kernel] = (len(items), sum(c.seconds for c in items), diff)
    return out


def summary(compiles: list[Compile]) -> str:
    """'N compiles, S s, {kernel: count}' of a stretch of the log, kernels by most compiles first."""
    kernels = dict(collections.Counter(c.kernel for c in compiles).most_common())
    return f"{len(compiles)} compiles, {sum(c.seconds for c in compiles):.1f} s, {kernels}"


def hook_triton(log: list[Compile]) -> None:
    """Record every compile of a Triton JIT kernel into ``log``, with the specialization it was keyed by."""
    import triton.runtime.jit as jit

    last = threading.local()
    key, compile_ = getattr(jit, "compute_cache_key", None), jit.JITFunction._do_compile
    if key is not None:

        def keyed(cache, specialization, options):  # noqa: ANN001, ANN202
            last.spec = specialization
            return key(cache, specialization, options)

        jit.compute_cache_key = keyed

    def compiled(self, *a, **k):  # noqa: ANN001, ANN202
        t0 = time.perf_counter()
        kernel = compile_(self, *a, **k)
        log.append(Compile(self.fn.__name__, tuple(getattr(self, "arg_names", ())),
                           tuple(map(str, getattr(last, "spec", ()))), time.perf_counter() - t0))  # fmt: skip
        return kernel

    jit.JITFunction._do_compile = compiled


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama-1b", help="a bench_gpu_model.py shape")
    ap.add_argument("--passes", default="eager,eager,graphs", help="comma-separated: eager or graphs (mixed steps)")
    ap.add_argument("--rate", type=float, default=8.0, help="requests per second (Poisson)")
    ap.add_argument("--prompts", type=int, default=160, help="requests a pass")
    ap.add_argument("--warm-up", action="store_true", help="run Engine.warm_up() (mgx-run serve --warm-up) first")
    args = ap.parse_args(argv)
    passes = args.passes.split(",")
    if bad := [p for p in passes if p not in ("eager", "graphs")]:
        ap.error(f"--passes: {', '.join(bad)} not eager or graphs")
    if not args.rate > 0 or args.prompts < 1:
        ap.error("--rate must be > 0 and --prompts >= 1")
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench_compiles needs an NVIDIA GPU")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_gpu_model as bgm

    if args.shape not in bgm.SHAPES:
        ap.error(f"--shape {args.shape!r} not one of {', '.join(bgm.SHAPES)}")
    from mgx.runtime import Engine, EngineConfig
    from mgx.runtime.bench import Workload, run_bench

    log: list[Compile] = []
    hook_triton(log)
    with tempfile.TemporaryDirectory() as tmp:
        model = bgm.build_hf(args.shape, 2200)
        path = bgm.build_artifact(bgm.lower_once(model), "bf16", Path(tmp), [], False)["bf16"]
        del model
        engine = Engine(path, backend="cuda", config=EngineConfig(max_num_seqs=64, max_tokens_per_step=512,
                                                                  kv_memory="16GiB"))  # fmt: skip
        backend = engine.runner.backend
        if args.warm_up:
            n0 = len(log)
            sizes, seconds = engine.warm_up()
            print(f"warm-up: {sizes} batch sizes in {seconds:.1f} s; {summary(log[n0:])}", flush=True)
        for seed, mode in enumerate(passes):
            backend.mixed_graphs = mode == "graphs" and backend.use_graphs
            n0 = len(log)
            r = run_bench(engine, Workload(num_prompts=args.prompts, prompt_len=(32, 1024), output_len=(32, 256),
                                           request_rate=args.rate, seed=seed))  # fmt: skip
            print(f"pass {seed} ({mode}): {summary(log[n0:])}; "
                  f"TTFT ms {({k: round(v) for k, v in r['ttft_ms'].items()})}; "
                  f"step ms {({k: round(v, 1) for k, v in r['step_ms'].items()})}; graphs {r['graphs']}", flush=True)  # fmt: skip
    for kernel, (n, seconds, diff) in varying_args(log).items():
        print(f"{kernel}: {n} variants, {seconds:.1f} s; differing: {diff or 'nothing (one variant)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
