"""Perplexity of compiled MGX models on a fixed English text, evaluated through the MGX runtime.

The text is CPython's language reference as the standard library ships it for ``help()``
(``pydoc_data.topics``): the topics ``execmodel``, ``import`` and ``customization``, in that order,
joined by blank lines, tokenized with the model's own tokenizer; the first ``--tokens`` tokens
(default 4096) are scored. They are cut into windows of ``--context`` tokens, each run from an empty
cache with its prompt prefilled in chunks of ``--chunk`` tokens (``SeqChunk(all_logits=True)``); every
token of a window but the first is predicted from the ones before it. The text's sha256 and the
Python version are printed with the results, since another Python may ship another text.

    # compile each model.yaml (one source load shared by all), then evaluate each artifact:
    python examples/perplexity.py examples/smollm2-135m.yaml examples/smollm2-135m-w8a16.yaml \
        --out-dir build/ppl --json build/ppl/results.json
    # or evaluate artifacts that exist already:
    python examples/perplexity.py smollm2-135m.mgx smollm2-135m-int4.mgx
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

TOPICS = ("execmodel", "import", "customization")


@dataclass
class Row:
    """One evaluated build."""

    name: str
    passes: str  # the pass list, as the artifact records it
    weight_bytes: int  # bytes of all tensors
    file_bytes: int  # bytes of the .mgx file
    compile_s: float | None  # compile time without loading the source (None for a given artifact)
    tokens: int  # tokens scored
    perplexity: float
    eval_s: float


def eval_text() -> str:
    """The fixed evaluation text."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[t] for t in TOPICS)


def perplexity(engine, ids: list[int], context: int, chunk: int) -> tuple[float, int]:  # noqa: ANN001
    """exp(mean NLL) of ``ids`` in windows of ``context`` tokens; returns it and the tokens scored."""
    from mgx.runtime.batch import SeqChunk

    runner = engine.runner
    nll, scored = 0.0, 0
    for w, start in enumerate(range(0, len(ids), context)):
        window = np.asarray(ids[start:start + context], dtype=np.int64)
        if window.size < 2:
            break
        rows = []
        try:
            for c in range(0, window.size, chunk):
                (logits,) = runner.step([SeqChunk(w, window[c:c + chunk], all_logits=True)])
                rows.append(logits)
        finally:
            runner.free(w)
        logits = np.concatenate(rows)[:-1].astype(np.float64)  # [L-1, V]: row i predicts token i+1
        top = logits.max(axis=1, keepdims=True)
        logz = top[:, 0] + np.log(np.exp(logits - top).sum(axis=1))
        nll += float(np.sum(logz - logits[np.arange(window.size - 1), window[1:]]))
        scored += window.size - 1
    return math.exp(nll / scored), scored


def compile_specs(paths: list[Path], out_dir: Path) -> list[tuple[Path, float]]:
    """Compile each model.yaml into ``out_dir``; sources are loaded once per (source, dtype)."""
    from mgx.compiler._progress import Progress
    from mgx.compiler.pipeline import compile_model
    from mgx.compiler.sources import load_source
    from mgx.compiler.spec import load_spec

    loaded: dict[tuple[str, str], object] = {}
    built = []
    for path in paths:
        spec = load_spec(path)
        key = (str(spec.source.path), spec.dtype)
        if key not in loaded:
            t0 = time.perf_counter()
            loaded[key] = load_source(spec.source)
            print(f"loaded {spec.source.description} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
        progress = Progress()
        result = compile_model(spec, out_dir / f"{spec.name}.mgx", out_dir / "golden", progress, source=loaded[key])
        built.append((result.output, sum(result.timings.values())))
    return built


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", type=Path, help="model.yaml files to compile, or .mgx artifacts")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens of the text to score")
    parser.add_argument("--context", type=int, default=1024, help="tokens per window")
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk size")
    parser.add_argument("--out-dir", type=Path, default=Path("build/perplexity"), help="where compiled artifacts go")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    parser.add_argument("--backend", default="reference", help="runtime backend: reference (numpy) or cpu")
    args = parser.parse_args()

    from mgx.runtime import Engine

    specs = [p for p in args.models if p.suffix in (".yaml", ".yml")]
    compiled = dict(compile_specs(specs, args.out_dir)) if specs else {}
    artifacts = [(p, None) for p in args.models if p.suffix == ".mgx"] + list(compiled.items())
    text = eval_text()
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]
    rows = []
    for path, compile_s in artifacts:
        engine = Engine(path, backend=args.backend)
        ids = engine.tokenizer.encode(text, add_special_tokens=False)[: args.tokens]
        t0 = time.perf_counter()
        ppl, scored = perplexity(engine, ids, args.context, args.chunk)
        passes = " → ".join(p.name for p in engine.contents.passes) or "(none)"
        row = Row(str(engine.contents.metadata.get("name", path.stem)), passes, engine.graph.weight_bytes(),
                  path.stat().st_size, compile_s, scored, ppl, time.perf_counter() - t0)
        rows.append(row)
        print(f"{row.name}: perplexity {ppl:.4f} over {scored} tokens ({row.eval_s:.0f}s)", file=sys.stderr)
    base = rows[0]
    print(f"\ntext: pydoc_data.topics {', '.join(TOPICS)} (Python {platform.python_version()}, sha256 {digest}...), "
          f"first {args.tokens} tokens, windows of {args.context}, {args.backend} backend\n")
    print("| build | passes | weight bytes | vs first | file bytes | compile s | perplexity | vs first |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        cs = f"{r.compile_s:.1f}" if r.compile_s is not None else "-"
        print(f"| {r.name} | {r.passes} | {r.weight_bytes / 1e6:.1f} MB | {r.weight_bytes / base.weight_bytes:.3f}x "
              f"| {r.file_bytes / 1e6:.1f} MB | {cs} | {r.perplexity:.3f} | "
              f"{100 * (r.perplexity / base.perplexity - 1):+.2f}% |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"text_sha256": digest, "python": platform.python_version(),
                                         "rows": [asdict(r) for r in rows]}, indent=1) + "\n")


if __name__ == "__main__":
    main()
