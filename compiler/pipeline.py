"""The compile driver: source -> trace -> lower -> storage dtype -> passes -> golden -> artifact.

The pipeline is a visible, named list of steps; each pass named in model.yaml runs in order, is
logged with its effect, and is followed by the IR verifier. Passes see the weights as they will be
stored (already in the storage dtype). When passes ran, the golden outputs come from a copy of the
source model that holds the graph's effective weights (dequantized, folded, pruned: ``write_back``),
so they are what transformers computes with the weights as stored.
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mgx.formats import ir
from mgx.formats.artifact import (
    FORMAT_MAJOR,
    FORMAT_MINOR,
    ArtifactContents,
    Fingerprint,
    GenerationDefaults,
    GoldenSet,
    PassRecord,
    write_artifact,
)
from mgx.passes import PassContext, get_pass, to_storage

from ._progress import Progress
from .calibrate import CalibrationError, collect_hessians, parse_calibration
from .spec import ModelSpec
from .writeback import WriteBackError, write_back

__all__ = ["CompileError", "CompileResult", "collect_pass_stats", "compile_model", "run_passes", "to_storage", "STORAGE_DTYPES"]

STORAGE_DTYPES = {"fp32": ir.DType.F32, "bf16": ir.DType.BF16, "fp16": ir.DType.F16}
# Tensors kept in fp32 whatever the storage dtype: tiny, and precision matters.
_KEEP_FP32 = ("rope.inv_freq",)


class CompileError(Exception):
    """Compilation stopped; the message names the step and the cause."""


@dataclass(slots=True)
class CompileResult:
    """What a compile produced."""

    output: Path
    golden_json: Path | None
    graph: ir.Graph
    golden: GoldenSet | None
    timings: dict[str, float] = field(default_factory=dict)
    file_size: int = 0


def _round_model_weights(model: Any, dtype: str) -> None:
    """Round the source model's weights to the storage dtype, so the reference sees stored values."""
    import torch

    if dtype == "fp32":
        return
    target = torch.bfloat16 if dtype == "bf16" else torch.float16
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(target).to(torch.float32))


def convert_tensors(graph: ir.Graph, dtype: ir.DType) -> None:
    """Store every plain fp32 weight in ``dtype``."""
    for name, t in graph.tensors.items():
        if name in _KEEP_FP32 or t.dtype != ir.DType.F32 or t.scheme != "none" or dtype == ir.DType.F32:
            continue
        graph.tensors[name] = ir.Tensor(name, dtype, t.shape, to_storage(t.data, dtype), t.scheme, t.scheme_params,
                                        t.layout)


def collect_pass_stats(stats: dict[str, Any], tunings: dict[str, list[Any]] | None,
                       cuda_kernels: dict[str, bytes] | None) -> None:
    """Add what a pass produced for the artifact (``stats["autotune"]``: {GPU arch: entries},
    ``stats["cuda_kernels"]``: {GPU arch: cubin}) to ``tunings`` and ``cuda_kernels`` (None: ignored)."""
    if tunings is not None:
        for arch, entries in stats.get("autotune", {}).items():
            tunings.setdefault(arch, []).extend(entries)
    if cuda_kernels is not None:
        cuda_kernels.update(stats.get("cuda_kernels", {}))


def run_passes(graph: ir.Graph, spec: ModelSpec, progress: Progress, model: Any = None,
               tokenizer: Any = None, tunings: dict[str, list[Any]] | None = None,
               cuda_kernels: dict[str, bytes] | None = None) -> list[PassRecord]:
    """Run the spec's passes in order, verifying the IR after each.

    Launch configurations a pass chose (``autotune``: ``stats["autotune"]``, {GPU arch: entries}) are
    added to ``tunings``, and native kernel images a pass built (``cuda_kernels``:
    ``stats["cuda_kernels"]``, {GPU arch: cubin}) to ``cuda_kernels``; the artifact stores both.

    ``model`` and ``tokenizer`` (the source model, which this may overwrite with the graph's weights)
    are needed only by passes whose options name a calibration text.
    """
    base = spec.spec_path.parent if spec.spec_path is not None else Path.cwd()
    records = []
    for p in spec.passes:
        try:
            fn = get_pass(p.name)
        except KeyError as exc:
            raise CompileError(f"passes: {exc.args[0]}") from None
        options = dict(p.options)
        context = PassContext(target=spec.target)
        calibration = None
        if "calibration" in options:
            try:
                calibration = parse_calibration(options.pop("calibration"), base, f"passes.{p.name}.calibration")
                if model is None:
                    raise CalibrationError(f"pass {p.name!r}: a calibration text needs the source model")
                with progress.step(f"calibrate {p.name} ({calibration.text_file.name})"):
                    write_back(graph, model)
                    context.hessians, context.calibration_tokens = collect_hessians(graph, model, tokenizer,
                                                                                    calibration)
            except (CalibrationError, WriteBackError) as exc:
                raise CompileError(str(exc)) from None
        with progress.step(f"pass {p.name}"):
            try:
                result = fn(graph, options, context)
                ir.verify(graph)
            except (ValueError, ir.IRError) as exc:
                raise CompileError(f"pass {p.name!r} failed: {exc}") from None
        progress._write(f"    {p.name}: {result.summary}\n")
        collect_pass_stats(result.stats, tunings, cuda_kernels)
        recorded = dict(result.options if result.options is not None else options)
        if calibration is not None:
            recorded["calibration"] = calibration.record()
        records.append(PassRecord(p.name, recorded, result.summary))
    return records


def compile_model(spec: ModelSpec, output: Path | None = None, golden_dir: Path | None = None,
                  progress: Progress | None = None, source: Any = None) -> CompileResult:
    """Compile ``spec`` into a .mgx file; returns where it went and what it holds.

    ``source`` may pass an already loaded ``LoadedSource`` for ``spec.source`` (its weights are
    rounded to the storage dtype in place).
    """
    from .golden import record_golden, write_golden_json
    from .lower import LoweringError, lower_model, trace_model
    from .sources import SourceError, load_source

    progress = progress or Progress()
    out_path = Path(output or spec.output or Path.cwd() / f"{spec.name}.mgx")
    with progress.step(f"load {spec.source.description}"):
        try:
            src = source or load_source(spec.source)
        except SourceError as exc:
            raise CompileError(str(exc)) from None
        _round_model_weights(src.model, spec.dtype)
    with progress.step("trace (torch.export)"):
        try:
            program = trace_model(src.model)
        except Exception as exc:  # torch.export raises many types; name the step and the cause
            raise CompileError(f"tracing {src.model_type} model failed: {type(exc).__name__}: {_line(exc)}") from None
    with progress.step("lower to IR"):
        try:
            graph, _ = lower_model(src.model, program)
        except (LoweringError, ir.IRError) as exc:
            raise CompileError(str(exc)) from None
    convert_tensors(graph, STORAGE_DTYPES[spec.dtype])
    ir.verify(graph)
    # With passes, the reference model is a copy that takes the graph's effective weights.
    reference = copy.deepcopy(src.model) if spec.passes else src.model
    tunings: dict[str, list[Any]] = {}
    cuda_kernels: dict[str, bytes] = {}
    passes = run_passes(graph, spec, progress, reference, src.tokenizer, tunings, cuda_kernels)
    if spec.passes and spec.golden.prompts:
        with progress.step("write effective weights back to the reference model"):
            try:
                write_back(graph, reference)
            except WriteBackError as exc:
                raise CompileError(str(exc)) from None
    with progress.step(f"golden outputs ({len(spec.golden.prompts)} prompts x {spec.golden.max_new_tokens} tokens)"):
        golden = record_golden(reference, src.tokenizer, spec.golden)
    tokenizer_hash = hashlib.sha256(
        (src.tokenizer_json + "\0" + (src.chat_template or "")).encode("utf-8")
    ).hexdigest()
    fingerprint = Fingerprint(
        source_hash=src.source_hash,
        tokenizer_hash=tokenizer_hash,
        dtype=spec.dtype,
        quantization=_quantization(graph),
        target=spec.target,
        format_version=f"{FORMAT_MAJOR}.{FORMAT_MINOR}",
    )
    g = spec.generation
    eos = list(graph.arch.eos_token_ids)
    contents = ArtifactContents(
        graph=graph,
        tokenizer_json=src.tokenizer_json,
        chat_template=src.chat_template,
        generation=GenerationDefaults(
            temperature=g.temperature,
            top_p=g.top_p,
            top_k=g.top_k,
            max_new_tokens=g.max_new_tokens,
            repetition_penalty=g.repetition_penalty,
            stop_token_ids=eos,
        ),
        passes=passes,
        fingerprint=fingerprint,
        golden=golden,
        metadata={"name": spec.name, "source": spec.source.description, "producer": "mgxc"},
        autotune=tunings,
        cuda_kernels=cuda_kernels,
    )
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with progress.step(f"write {out_path.name}"):
        write_artifact(out_path, contents, progress=progress.bar("writing"))
    golden_json = None
    if golden is not None and golden_dir is not None:
        golden_json = golden_dir / f"{spec.name}.json"
        write_golden_json(golden_json, spec.name, _fingerprint_dict(fingerprint), golden)
    return CompileResult(out_path, golden_json, graph, golden, dict(progress.timings), out_path.stat().st_size)


def _quantization(graph: ir.Graph) -> str:
    schemes = sorted({t.scheme for t in graph.tensors.values() if t.scheme != "none"})
    return "+".join(schemes) or "none"


def _fingerprint_dict(fp: Fingerprint) -> dict[str, str]:
    return {k: getattr(fp, k) for k in ("source_hash", "tokenizer_hash", "dtype", "quantization", "target",
                                          "format_version")}


def _line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""
