"""In-graph tuning (``mgx-run tune``): each one-row projection's kernel (and the greedy LM head's)
chosen by the time of the whole decode step on the GPU that will serve the model, the choices stored
back into the artifact.

The autotune pass (``mgxc compile``) times every candidate kernel of a shape on its own: launches of
the same kernel back to back (QKV and gate/up each after its norm, option ``after_norm``, which since
the forty-seventh session gives the 8B INT4 model the kinds this chooses). Inside the decode step a
kernel starts while the one before it finishes (overlapped launches) and hands over to a different
one, and that ranks the candidates otherwise. On the H200 (nineteenth session, the 8B W8A16 model,
its batch-1 step 2.75 ms): the down projection on kind ``imma_w16`` took the step to 2.575 ms against
2.750 on autotune's ``imma``, and gate/up on ``imma`` to 2.641 against 2.749 on autotune's
``imma_persistent_w4``.

So this takes the artifact's stored tunings for the GPU's architecture and, shape by shape (one
coordinate at a time, ``rounds`` passes over them), tries every kernel that can run the shape at
one row -- the native GEMV kinds the artifact's code holds (for the LM head, the imma kinds' greedy
entries, which must pick the Triton head's token), and the stored Triton configuration --
in the real step: the engine's batch-1 decode graph, captured anew for each trial and timed over
``replays`` replays. A candidate replaces the current choice only when it makes the step at least
``min_gain`` shorter (replays of one graph spread by about 0.5%). Then the switches of the step the
same way (``SWITCHES``): the decode attention's tile width (32 or 64 tokens; a ``decode_attention``
entry: in the 8B W8A16 step 32-token tiles were 0.04-0.14 ms faster, in the bf16 one mostly
slower), the add + RMSNorm in the prologue of the native GEMV that reads it (``norm_prologue``,
MGX_CUDA_NORM_GEMV's switch) and that add + RMSNorm staging x once for the imma GEMV's staged twin
(``staged_x``, MGX_CUDA_STAGED_X's: on by default for INT4 weights only; the 8B INT4 step gained 3%
on the H200 and the W8A16 layer lost 2%, so tune tries it for the model at hand), and then the int4 MLP
in one launch where x is staged (``fused_mlp``, MGX_CUDA_FUSED_MLP's: on by default; offered only for
models with int4 MLPs it can run). Nothing here tunes
at start-up: the
runtime reads what this wrote, as it reads autotune's entries.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mgx.formats.artifact import AutotuneEntry
from mgx.kernels.triton.tuning import (
    DECODE_ATTENTION,
    DECODE_BLOCK_NS,
    FUSED_MLP,
    NORM_PROLOGUE,
    STAGED_X,
    Tunings,
)

from .errors import EngineError

__all__ = ["TRITON", "Trial", "TuneReport", "decode_step_ms", "no_gpu_reason", "tune_in_graph", "write_tunings"]

TRITON = "triton"  # the stored Triton configuration, as reports name it (a native kind of "")
PASS_NAME = "tune_in_graph"  # its record in the artifact's pass log


@dataclass(frozen=True, slots=True)
class Trial:
    """One shape's candidates and the step time each gave (ms); ``chosen`` was kept."""

    kernel: str
    shape_key: str
    before: str
    chosen: str
    ms: dict[str, float]


@dataclass(slots=True)
class TuneReport:
    """What ``tune_in_graph`` measured and chose for one GPU architecture."""

    arch: str
    baseline_ms: float  # the step with the stored choices
    final_ms: float  # with the chosen ones (the last measurement that kept them)
    trials: list[Trial] = field(default_factory=list)
    entries: list[Any] = field(default_factory=list)  # the architecture's entries, tuned
    rejected: list[str] = field(default_factory=list)  # native kinds whose results were wrong, never tried

    @property
    def changed(self) -> list[Trial]:
        return [t for t in self.trials if t.chosen != t.before]

    def summary(self) -> str:
        moved = ", ".join(f"{t.kernel} {_short(t.shape_key)} {t.before} -> {t.chosen}" for t in self.changed)
        wrong = f"; rejected (wrong results): {', '.join(self.rejected)}" if self.rejected else ""
        return (f"{self.arch}: batch-1 decode step {self.baseline_ms:.3f} -> {self.final_ms:.3f} ms over "
                f"{sum(len(t.ms) for t in self.trials)} trials; " + (f"changed {moved}" if moved else "no change")
                + wrong)  # fmt: skip

    def lines(self) -> list[str]:
        """One line per shape: each candidate's step time, the chosen one marked."""
        out = []
        for t in self.trials:
            ranked = sorted(t.ms.items(), key=lambda kv: kv[1])
            cells = " ".join(f"{k}{'*' if k == t.chosen else ''} {ms:.3f}" for k, ms in ranked)
            out.append(f"{t.kernel} {_short(t.shape_key)} (was {t.before}): {cells}")
        return out


def no_gpu_reason() -> str:
    """Why tuning cannot run on this host ("" where it can): it times decode steps on a CUDA GPU."""
    import torch

    return "" if torch.cuda.is_available() else "tune times decode steps on a CUDA GPU, and torch sees none on this host"


def _short(shape_key: str) -> str:
    """``scheme=int4,...,N=4096,K=4096,M=1`` -> ``int4 4096x4096`` (other keys as they are)."""
    if "scheme=" not in shape_key:
        return shape_key
    parts = dict(p.split("=", 1) for p in shape_key.split(",") if "=" in p)
    return f"{parts.get('scheme', '?')} {parts.get('N', '?')}x{parts.get('K', '?')}"


def _kind(entry: Any) -> str:
    return entry.config.get("native") or TRITON


def _with_kind(entry: Any, kind: str) -> Any:
    return dataclasses.replace(entry, config={**entry.config, "native": "" if kind == TRITON else kind})


@dataclass(frozen=True, slots=True)
class _Switch:
    """A switch of the CUDA backend's decode step that tune chooses as it chooses kernels, stored as
    one entry (``kernel``, shape key ``M=1``, ``{key: value}``) that the backend takes at start-up
    unless the environment pins the switch (``pinned``: the backend's attribute saying so)."""

    kernel: str
    key: str
    options: tuple[str, ...]  # as reports name them
    pinned: str
    read: Callable[[Any], str]  # the backend's current option
    write: Callable[[Any, str], None]
    value: Callable[[str], Any]  # an option as the entry stores it


SWITCHES = (
    _Switch(DECODE_ATTENTION, "block_n", tuple(str(n) for n in reversed(DECODE_BLOCK_NS)), "decode_tiles_pinned",
            lambda b: "32" if b.narrow_decode_tiles else "64", lambda b, o: setattr(b, "narrow_decode_tiles", o == "32"),
            int),
    _Switch(NORM_PROLOGUE, "on", ("off", "on"), "norm_gemv_pinned",
            lambda b: "on" if b._norm_gemv else "off", lambda b, o: setattr(b, "_norm_gemv", o == "on"),
            lambda o: o == "on"),
    _Switch(STAGED_X, "on", ("off", "on"), "staged_x_pinned",
            lambda b: "on" if b.stages_x() else "off", lambda b, o: b.set_staged_x(o == "on"), lambda o: o == "on"),
    # after staged_x, which it needs: the int4 MLP in one launch (offered where the model has such MLPs)
    _Switch(FUSED_MLP, "on", ("off", "on"), "fused_mlp_pinned",
            lambda b: "on" if b.fused_mlp else "off", lambda b, o: setattr(b, "fused_mlp", o == "on"), lambda o: o == "on"),
)  # fmt: skip


def _candidates(backend: Any, entries: list[Any], rejected: list[str] | None = None) -> dict[int, list[str]]:
    """Index of each one-row linear entry that some op of the model runs (the greedy LM head's
    included) -> the kernels that can run it: ``triton`` and every native kind that applies to its
    weight with the loaded code and gives the Triton kernel's result on a random row (the LM head:
    its token; as the autotune pass checks; the others go to ``rejected``, named with their error)."""
    import torch

    from mgx.kernels.cuda import gemv as cg
    from mgx.kernels.triton import linear as tl
    from mgx.kernels.triton.lm_head import lm_head_argmax
    from mgx.kernels.triton.tuning import shape_key

    by_key: dict[tuple[str, str], tuple[Any, Any]] = {}
    for kernel, w, bias in backend.one_row_linears():
        by_key.setdefault((kernel, shape_key(w, 1)), (w, bias))
    found: dict[int, list[str]] = {}
    generator = torch.Generator(device=backend.device).manual_seed(0)
    for i, e in enumerate(entries):
        if (e.kernel, e.shape_key) not in by_key:
            continue
        w, bias = by_key[(e.kernel, e.shape_key)]
        x = torch.randn(1, w.k, generator=generator, device=backend.device).to(backend.dtype)
        head = e.kernel == "lm_head_argmax"  # the greedy LM head: the imma kinds' argmax entries
        kinds = [k for k in cg.KINDS if cg.gemv_applies(backend.cuda_kernels, x, w, bias, kind=k, argmax=head)]
        if not kinds:
            continue  # nothing to choose
        silu = e.kernel == "linear_silu_mul"
        triton = tl.LinearConfig(**{**e.config, "native": ""})
        if head:
            want = lm_head_argmax(x, w, bias, config=triton)
        else:
            want = (tl.linear_silu_mul if silu else tl.linear)(x, w, bias, config=triton)
        ok = []
        for kind in kinds:
            err = cg.native_error(x, w, bias, kernels=backend.cuda_kernels, kind=kind, want=want, silu_mul=silu,
                                  argmax=head)  # fmt: skip
            if err <= cg.NATIVE_TOLERANCE:
                ok.append(kind)
            elif rejected is not None:
                rejected.append(f"{kind} for {e.kernel} {_short(e.shape_key)} ({cg.native_error_text(err, head)})")
        found[i] = [TRITON, *ok]
    return found


def tune_in_graph(engine: Any, measure: Callable[[], float], *, rounds: int = 1, min_gain: float = 0.005,
                  progress: Callable[[str], None] | None = None) -> TuneReport:  # fmt: skip
    """Choose the kernel of each one-row linear shape of ``engine``'s model by ``measure()`` (ms of
    the decode step as the backend runs it after a change: ``decode_step_ms`` on a GPU); see the
    module docstring. The backend keeps the chosen tunings; the report holds them for writing."""
    if rounds < 1 or not 0 <= min_gain < 1:
        raise EngineError(f"tune: rounds must be >= 1 and min_gain in [0, 1), got {rounds} and {min_gain}")
    backend = engine.runner.backend
    if not hasattr(backend, "one_row_linears"):
        raise EngineError(f"tune: the {backend.name!r} backend has no tunable kernels (use backend 'cuda')")
    arch = backend.arch
    stored = engine.contents.autotune.get(arch)
    if not stored:
        have = ", ".join(sorted(engine.contents.autotune)) or "none"
        raise EngineError(f"tune: the artifact holds no tunings for {arch} (it has: {have}); compile it with "
                          "the autotune pass on this kind of GPU first")  # fmt: skip
    entries = list(stored)
    rejected: list[str] = []
    slots = _candidates(backend, entries, rejected)
    switches = [sw for sw in SWITCHES if not getattr(backend, sw.pinned, True)]
    if not slots and not switches:
        raise EngineError(f"tune: nothing to choose on {arch}: no one-row projection of this model has a native "
                          "kernel (the artifact holds no native code for it, or none applies), and the "
                          "environment pins the decode step's switches (MGX_CUDA_DECODE_NARROW, "
                          "MGX_CUDA_NORM_GEMV, MGX_CUDA_STAGED_X, MGX_CUDA_FUSED_MLP)")  # fmt: skip

    def use() -> None:
        backend.tunings = Tunings(entries)
        backend.drop_graphs()

    # What each trial starts from, for the report (``before``) whatever the rounds do.
    start = {(entries[i].kernel, entries[i].shape_key): _kind(entries[i]) for i in slots}
    start.update({(sw.kernel, "M=1"): sw.read(backend) for sw in switches})
    use()
    measure()  # unclocked: compiles the kernels, first capture, the GPU's clocks up
    baseline = best = measure()
    report = TuneReport(arch, baseline, baseline, rejected=rejected)
    say = progress or (lambda _line: None)
    say(f"stored choices: {baseline:.3f} ms a step")
    for _ in range(rounds):
        trials = []
        for i, kinds in slots.items():
            before = _kind(entries[i])
            times = {before: best}
            for kind in kinds:
                if kind in times:
                    continue
                entries[i] = _with_kind(entries[i], kind)
                use()
                times[kind] = measure()
            winner = _keep(times, before, best, min_gain)
            best = times[winner]
            entries[i] = _with_kind(entries[i], winner)
            trials.append(Trial(entries[i].kernel, entries[i].shape_key, before, winner, times))
            say(trials[-1].kernel + " " + _short(trials[-1].shape_key) + f": {winner} ({times[winner]:.3f} ms)")
        for sw in switches:
            trials.append(trial := _switch_trial(sw, backend, measure, best, min_gain))
            best = trial.ms[trial.chosen]
            entry = AutotuneEntry(sw.kernel, "M=1", {sw.key: sw.value(trial.chosen)})
            at = next((j for j, e in enumerate(entries) if e.kernel == sw.kernel), None)
            if at is None:
                entries.append(entry)
            else:  # in place: ``slots`` index the others
                entries[at] = entry
            say(f"{sw.kernel}: {trial.chosen} ({best:.3f} ms)")
        report.trials = trials
        if not any(t.chosen != t.before for t in trials):
            break
    use()
    report.final_ms, report.entries = best, entries
    report.trials = [dataclasses.replace(t, before=start[(t.kernel, t.shape_key)]) for t in report.trials]
    return report


def _keep(times: dict[str, float], before: str, best: float, min_gain: float) -> str:
    """The choice after a trial: the fastest candidate where it makes the step at least ``min_gain``
    shorter than ``best`` (the current choice's time), else the current choice ``before``."""
    winner = min(times, key=times.__getitem__)
    return winner if times[winner] < best * (1 - min_gain) else before


def _switch_trial(sw: _Switch, backend: Any, measure: Callable[[], float], best: float, min_gain: float) -> Trial:
    """``sw``'s options by the step's time, as the linear kernels: another option replaces the
    current one only for ``min_gain``."""
    before = sw.read(backend)
    times = {before: best}
    for option in sw.options:
        if option not in times:
            sw.write(backend, option)
            backend.drop_graphs()
            times[option] = measure()
    winner = _keep(times, before, best, min_gain)
    sw.write(backend, winner)
    backend.drop_graphs()
    return Trial(sw.kernel, "M=1", before, winner, times)


DECODE_STEPS = 8  # decode steps of the request that captures the timed graph (decode_step_ms)


def decode_step_ms(engine: Any, prompt: list[int], *, steps: int = DECODE_STEPS, replays: int = 50,
                   repeats: int = 3) -> float:  # fmt: skip
    """The batch-1 greedy decode step's GPU time (ms; median of ``repeats`` timings of ``replays``
    replays): one request of ``prompt`` decodes ``steps`` tokens, which captures the step's graph."""
    from .sampler import SamplingParams

    backend = engine.runner.backend
    engine.add_request(list(prompt), SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    times = sorted(t for t in (backend.replay_ms(1, replays) for _ in range(repeats)) if t is not None)
    if not times:
        raise EngineError("tune: no batch-1 decode graph was captured (the CUDA backend needs graphs on: MGX_CUDA_GRAPHS=1)")
    return times[len(times) // 2]


def write_tunings(source: Path, out: Path, report: TuneReport, options: dict[str, Any]) -> None:
    """``source`` again at ``out`` (which may be ``source``: written aside, then renamed over it) with
    ``report``'s entries for its architecture, and a record of this tuning in the pass log."""
    from mgx.formats.artifact import PassRecord, load_artifact, write_artifact

    loaded = load_artifact(source)
    try:
        contents = loaded.contents
        passes = [*contents.passes, PassRecord(PASS_NAME, dict(options), report.summary())]
        tuned = dataclasses.replace(contents, autotune={**contents.autotune, report.arch: list(report.entries)},
                                    passes=passes)  # fmt: skip
        write_artifact(out, tuned)
    finally:
        loaded.close()
