"""In-graph tuning (``mgx-run tune``, ``mgx.runtime.tune``) without a GPU.

The GPU-only pieces are replaced: the step timer (a fake that prices the kernels the backend would
launch, so the best choice is known), the native GEMV (the reference product) and the test of which
native kinds apply. Everything else is real: the stored autotune entries, the CUDA backend (under
TRITON_INTERPRET=1) that takes each new choice, the artifact written back and read by a new engine,
whose greedy tokens must stay the reference's.
"""

from __future__ import annotations

import pytest

from mgx.formats.artifact import load_artifact, write_artifact
from mgx.passes import PASSES, PassContext
from mgx.passes import autotune as autotune_pass
from mgx.runtime import Engine, backend_cuda
from mgx.runtime.backend_cuda import CUDABackend
from mgx.runtime.errors import EngineError
from mgx.runtime.tune import PASS_NAME, tune_in_graph, write_tunings

from _tiny_graph import tiny_contents

NATIVE = ("gemv", "imma")  # the kinds that "apply" here (the greedy LM head: imma only, as on a GPU)
# ms of one projection on each kernel: gate/up (the SiLU product) fastest on imma, the rest on gemv;
# the greedy LM head faster on imma
COST = {"linear_silu_mul": {"triton": 3.0, "gemv": 2.0, "imma": 1.0}, "linear": {"triton": 2.0, "gemv": 1.0, "imma": 1.5},
        "lm_head_argmax": {"triton": 2.0, "imma": 1.0}}  # fmt: skip


def _tuned(path, monkeypatch, quantize: tuple[str, dict]):  # noqa: ANN001, ANN202
    """The tiny model fused, quantized by ``quantize`` (a pass and its options) and autotuned for the
    interpreter (every timing alike, so Triton everywhere), written to ``path``."""
    import torch

    monkeypatch.setattr(autotune_pass, "_device", lambda: (torch.device("cpu"), "interpreter"))
    monkeypatch.setattr(autotune_pass, "_time", lambda fn, repeats, weights=None, graph=False: 1.0)
    monkeypatch.setattr(autotune_pass, "_native_kernels", lambda graph: None)
    contents = tiny_contents()
    for name, options in (("fuse_qkv", {}), ("fuse_gate_up", {}), quantize):
        PASSES[name](contents.graph, options, PassContext(target="cuda"))
    result = PASSES["autotune"](contents.graph, {"rows": [1, 4], "dtype": "f32"}, PassContext(target="cuda"))
    contents.autotune = result.stats["autotune"]
    write_artifact(path, contents)
    return path


@pytest.fixture
def tuned_artifact(tmp_path, monkeypatch):  # noqa: ANN001, ANN201
    """A tiny W8A16 model whose stored tunings (for the interpreter) chose Triton everywhere."""
    return _tuned(tmp_path / "tiny.mgx", monkeypatch, ("quantize_w8a16", {}))


KERNELS = object()  # the "loaded native code"
LAUNCHED: list[str] = []  # the native kinds the stand-in GEMV ran
WRONG: set[str] = set()  # the native kinds whose stand-in is 10% off


@pytest.fixture
def native_stand_in(monkeypatch):  # noqa: ANN001, ANN201
    """Native kinds ``NATIVE`` apply to one row (the greedy LM head: ``imma``); the native GEMV is the
    reference product, the native head the reference argmax."""
    from mgx.kernels.cuda import gemv as cg
    from mgx.kernels.triton.linear import linear_ref, linear_silu_mul_ref
    from mgx.kernels.triton.lm_head import lm_head_argmax_ref

    def applies(kernels, x, w, bias=None, *, kind="gemv", norm=None, argmax=False):  # noqa: ANN001, ANN202
        return kernels is KERNELS and x.shape[0] == 1 and kind in NATIVE and norm is None and (kind == "imma" or not argmax)

    def head(x, w, bias=None, *, kernels, kind, merge=None):  # noqa: ANN001, ANN202
        LAUNCHED.append(f"{kind} head")
        ids, logits = lm_head_argmax_ref(x, w, bias)
        return (ids + 1 if kind in WRONG else ids), logits

    def gemv(x, w, bias=None, *, kernels, silu_mul=False, out=None, kind="gemv", norm=None):  # noqa: ANN001, ANN202
        LAUNCHED.append(kind)
        y = (linear_silu_mul_ref if silu_mul else linear_ref)(x, w, bias)
        return (y * (1.1 if kind in WRONG else 1.0)).to(x.dtype)

    monkeypatch.setattr(cg, "gemv_applies", applies)
    monkeypatch.setattr(cg, "gemv", gemv)
    monkeypatch.setattr(backend_cuda, "gemv_applies", applies)
    monkeypatch.setattr(backend_cuda, "gemv", gemv)
    monkeypatch.setattr(cg, "gemv_argmax", head)
    monkeypatch.setattr(backend_cuda, "gemv_argmax", head)

    # x staged by the norm for the imma kind's staged twin: the Triton norm and the reference product
    def norm_stage(x, norm, scheme, *, kernels):  # noqa: ANN001, ANN202
        from mgx.kernels.triton.rmsnorm import rms_norm

        normed, total = rms_norm(x, norm.weight, norm.eps, residual=norm.delta)
        norm.total.copy_(total)
        return normed, normed

    def gemv_staged(rec, w, bias=None, *, kernels, kind, silu_mul=False):  # noqa: ANN001, ANN202
        LAUNCHED.append(f"{kind} staged")
        return (linear_silu_mul_ref if silu_mul else linear_ref)(rec, w, bias).to(rec.dtype)

    monkeypatch.setattr(backend_cuda, "staged_applies",
                        lambda kernels, x, w, kind, bias=None: kernels is KERNELS and x.shape[0] == 1 and kind == "imma")  # fmt: skip
    monkeypatch.setattr(backend_cuda, "norm_stage_applies", lambda kernels, x, norm, scheme: kernels is KERNELS)
    monkeypatch.setattr(backend_cuda, "norm_stage", norm_stage)
    monkeypatch.setattr(backend_cuda, "gemv_staged", gemv_staged)
    LAUNCHED.clear()
    WRONG.clear()


def engine_on_cpu(path) -> Engine:  # noqa: ANN001
    loaded = load_artifact(path)
    backend = CUDABackend(loaded.contents.graph, device="cpu", dtype="f32")
    engine = Engine(loaded, backend=backend)
    backend.cuda_kernels = KERNELS
    return engine


def step_price(engine: Engine) -> float:
    """The fake step time: each one-row projection priced by the kernel the backend's tunings give it,
    each layer's decode attention by its tile width (32 cheaper) and its norms by where they run (in
    the GEMV prologues cheaper; staging x for the imma twin, where the prologue does not take them,
    a little cheaper)."""
    backend = engine.runner.backend
    layers = sum(op.kind == "attention" for op in engine.graph.ops)
    norms = 0.25 if backend._norm_gemv else (0.375 if backend.stages_x() else 0.5)
    total = layers * ((0.5 if backend.narrow_decode_tiles else 1.0) + norms)
    for kernel, w, _ in backend.one_row_linears():
        config = backend.tunings.config(kernel, w, 1)
        total += COST[kernel][(config.native if config is not None else "") or "triton"]
    return total


def greedy(engine: Engine, prompt: list[int], n: int) -> list[int]:
    return engine.greedy_with_logits(prompt, n)[0]


@pytest.mark.interpreted
def test_tune_keeps_the_kernel_that_makes_the_step_shortest_and_the_written_model_runs_it(
    tuned_artifact, native_stand_in, tmp_path
) -> None:  # noqa: ANN001
    engine = engine_on_cpu(tuned_artifact)
    prompt = [5, 6, 7, 8, 9]
    before = greedy(engine, prompt, 3)
    assert not LAUNCHED  # stored: Triton
    LAUNCHED.clear()  # (tune's check of each kind's result launches them once)
    priced: list[float] = []
    report = tune_in_graph(engine, lambda: priced.append(step_price(engine)) or priced[-1])
    layers = sum(op.kind == "attention" for op in engine.graph.ops)
    # Stored: Triton everywhere (3 + 2 + 2 + 2 a layer, the LM head 2), 64-token tiles (1), norm
    # kernels (0.5); chosen: imma for gate/up and the LM head, gemv for the rest, 32-token tiles, norms
    # in the prologues.
    assert report.baseline_ms == pytest.approx(layers * 10.5 + 2)
    assert report.final_ms == pytest.approx(layers * 4.75 + 1)
    chosen = {(t.kernel, t.chosen) for t in report.trials}
    assert chosen == {("linear_silu_mul", "imma"), ("linear", "gemv"), ("lm_head_argmax", "imma"), ("decode_attention", "32"),
                      ("norm_prologue", "on"), ("staged_x", "off")}  # fmt: skip
    linears = [t for t in report.trials if t.kernel.startswith("linear")]
    assert all(t.before == "triton" and set(t.ms) == {"triton", *NATIVE} for t in linears)
    (head,) = [t for t in report.trials if t.kernel == "lm_head_argmax"]
    assert head.before == "triton" and set(head.ms) == {"triton", "imma"}  # the head's kinds only
    assert engine.runner.backend.narrow_decode_tiles and engine.runner.backend._norm_gemv
    assert "changed" in report.summary() and len(report.lines()) == len(report.trials)
    assert step_price(engine) == pytest.approx(report.final_ms)  # the backend keeps the choices
    assert greedy(engine, prompt, 3) == before

    assert not report.rejected and "rejected" not in report.summary()
    out = tmp_path / "tuned.mgx"
    write_tunings(tuned_artifact, out, report, {"prompt_len": 5})
    again = engine_on_cpu(out)
    assert step_price(again) == pytest.approx(report.final_ms)  # the switches too
    assert again.contents.passes[-1].name == PASS_NAME and again.contents.passes[-1].summary == report.summary()
    assert len(again.contents.autotune["interpreter"]) == len(engine.contents.autotune["interpreter"]) + 3
    # The other entries (several rows) are as stored.
    many = [e for e in again.contents.autotune["interpreter"]
            if e.kernel.startswith(("linear", "lm_head")) and not e.shape_key.endswith(",M=1")]  # fmt: skip
    stored = {(e.kernel, e.shape_key): e.config for e in engine.contents.autotune["interpreter"]}
    assert many and all(stored[(e.kernel, e.shape_key)] == e.config for e in many)
    LAUNCHED.clear()
    assert greedy(again, prompt, 3) == before
    assert set(LAUNCHED) == {"imma", "gemv", "imma head"}  # the decode rows ran the chosen native kernels
    ref = Engine(load_artifact(out), backend="reference")
    assert greedy(ref, prompt, 3) == before


@pytest.mark.interpreted
@pytest.mark.parametrize("pinned", ["0", "1"])
@pytest.mark.parametrize(("variable", "switch", "state"), [("MGX_CUDA_DECODE_NARROW", "decode_attention", "narrow_decode_tiles"),
                                                           ("MGX_CUDA_NORM_GEMV", "norm_prologue", "_norm_gemv")])  # fmt: skip
def test_the_environment_pins_a_switch_over_a_stored_tuning(tuned_artifact, native_stand_in, monkeypatch, pinned: str,
                                                            variable: str, switch: str, state: str) -> None:  # noqa: ANN001
    """A switch's variable set: the backend keeps it whatever the artifact stores, and tune leaves
    the switch alone; unset, the stored choice holds (both "on" here: 32-token tiles, norms in the
    prologues)."""
    engine = engine_on_cpu(tuned_artifact)
    report = tune_in_graph(engine, lambda: step_price(engine))
    write_tunings(tuned_artifact, tuned_artifact, report, {})
    assert getattr(engine_on_cpu(tuned_artifact).runner.backend, state)
    monkeypatch.setenv(variable, pinned)
    engine = engine_on_cpu(tuned_artifact)
    assert getattr(engine.runner.backend, state) == (pinned == "1")
    report = tune_in_graph(engine, lambda: step_price(engine))
    assert [t.kernel for t in report.trials if not t.kernel.startswith(("linear", "lm_head"))] == [
        k for k in ("decode_attention", "norm_prologue", "staged_x") if k != switch]


@pytest.mark.interpreted
def test_tune_stages_x_for_a_w8a16_model_where_it_gains_and_the_environment_pins_it(
    tuned_artifact, native_stand_in, monkeypatch, tmp_path
) -> None:  # noqa: ANN001
    """Off by default for W8A16 weights (``STAGED_SCHEMES``: INT4 only); with the norms kept out of
    the GEMV prologues (pinned), staging x for the imma twin makes the priced step shorter, so tune
    turns it on; the written model stages x (gate/up, on imma) and decodes the same tokens.
    MGX_CUDA_STAGED_X set pins it over the stored choice, and tune leaves it alone."""
    monkeypatch.setenv("MGX_CUDA_NORM_GEMV", "0")
    engine = engine_on_cpu(tuned_artifact)
    prompt = [5, 6, 7, 8, 9]
    before = greedy(engine, prompt, 3)
    assert not engine.runner.backend.stages_x() and not any("staged" in k for k in LAUNCHED)
    report = tune_in_graph(engine, lambda: step_price(engine))
    (trial,) = [t for t in report.trials if t.kernel == "staged_x"]
    assert (trial.before, trial.chosen) == ("off", "on") and "norm_prologue" not in {t.kernel for t in report.trials}
    out = tmp_path / "staged.mgx"
    write_tunings(tuned_artifact, out, report, {})
    again = engine_on_cpu(out)
    assert again.runner.backend.stages_x() and again.runner.backend.staged_schemes is None
    LAUNCHED.clear()
    assert greedy(again, prompt, 3) == before
    assert "imma staged" in LAUNCHED and "gemv staged" not in LAUNCHED  # only imma kinds have twins
    monkeypatch.setenv("MGX_CUDA_STAGED_X", "0")
    pinned = engine_on_cpu(out)
    assert not pinned.runner.backend.stages_x()
    assert "staged_x" not in {t.kernel for t in tune_in_graph(pinned, lambda: step_price(pinned)).trials}


@pytest.mark.interpreted
def test_tune_never_tries_a_native_kind_whose_result_is_wrong(tuned_artifact, native_stand_in) -> None:  # noqa: ANN001
    """A kind 10% off the Triton kernel's product (the price would choose it), or picking another
    token for the greedy LM head, is rejected before any trial, and the report names it."""
    engine = engine_on_cpu(tuned_artifact)
    WRONG.add("imma")
    report = tune_in_graph(engine, lambda: step_price(engine))
    assert all("imma" not in t.ms for t in report.trials)
    assert {(t.kernel, t.chosen) for t in report.trials if t.kernel == "linear_silu_mul"} == {("linear_silu_mul", "gemv")}
    assert report.rejected and all(r.startswith("imma for ") for r in report.rejected)
    assert all("relative error 1.0e-01" in r for r in report.rejected if "lm_head" not in r)
    assert [r for r in report.rejected if "lm_head" in r] == ["imma for lm_head_argmax w8a16 300x40 (another token than the Triton head's)"]
    assert "; rejected (wrong results): imma for " in report.summary() and "imma for linear_silu_mul" in report.summary()


@pytest.mark.interpreted
def test_tune_keeps_the_stored_kernel_unless_the_step_gains_min_gain(tuned_artifact, native_stand_in) -> None:  # noqa: ANN001
    """A candidate only 0.1% faster (below min_gain's 0.5%) leaves the stored choice; written over
    the source in place, the file is whole and records the tuning."""
    engine = engine_on_cpu(tuned_artifact)
    base = step_price(engine)
    report = tune_in_graph(engine, lambda: base * (0.999 if step_price(engine) < base else 1.0))
    assert not report.changed and "no change" in report.summary()
    assert report.final_ms == report.baseline_ms == base
    write_tunings(tuned_artifact, tuned_artifact, report, {})
    assert load_artifact(tuned_artifact).contents.passes[-1].name == PASS_NAME


@pytest.mark.interpreted
def test_tune_says_what_is_missing(tuned_artifact, native_stand_in, tmp_path) -> None:  # noqa: ANN001
    with pytest.raises(EngineError, match="backend 'cuda'"):
        tune_in_graph(Engine(load_artifact(tuned_artifact), backend="reference"), lambda: 1.0)
    loaded = load_artifact(tuned_artifact)
    contents = loaded.contents
    contents.autotune = {"sm_90": contents.autotune["interpreter"]}
    bare = tmp_path / "other-gpu.mgx"
    write_artifact(bare, contents)
    with pytest.raises(EngineError, match=r"no tunings for interpreter \(it has: sm_90\).*autotune"):
        tune_in_graph(engine_on_cpu(bare), lambda: 1.0)
    engine = engine_on_cpu(tuned_artifact)
    engine.runner.backend.cuda_kernels = None  # no native code: the step's switches alone
    assert [t.kernel for t in tune_in_graph(engine, lambda: 1.0).trials] == ["decode_attention", "norm_prologue", "staged_x"]
    backend = engine.runner.backend
    backend.decode_tiles_pinned = backend.norm_gemv_pinned = backend.staged_x_pinned = True  # those pinned: nothing
    with pytest.raises(EngineError, match="nothing to choose on interpreter: no one-row projection"):
        tune_in_graph(engine, lambda: 1.0)
    with pytest.raises(EngineError, match="rounds"):
        tune_in_graph(engine, lambda: 1.0, rounds=0)


def test_tune_command_needs_a_gpu(tuned_artifact) -> None:  # noqa: ANN001
    import torch
    from click.testing import CliRunner

    from mgx.runtime.cli import main

    if torch.cuda.is_available():
        pytest.skip("this host has a GPU")
    result = CliRunner().invoke(main, ["tune", str(tuned_artifact)])
    assert result.exit_code == 1 and "CUDA GPU" in result.output and "Traceback" not in result.output
    result = CliRunner().invoke(main, ["tune", str(tuned_artifact) + ".missing"])
    assert result.exit_code == 1 and "no such model file" in result.output


@pytest.mark.interpreted
def test_a_stored_decode_tile_width_is_checked(tuned_artifact, tmp_path) -> None:  # noqa: ANN001
    """The decode attention entry holds one of the widths the kernel takes; another is a clear error
    naming it when an engine opens the file."""
    from mgx.formats.artifact import AutotuneEntry
    from mgx.kernels.triton.tuning import Tunings

    assert Tunings([AutotuneEntry("decode_attention", "M=1", {"block_n": 32})]).decode_block_n == 32
    assert Tunings([AutotuneEntry("norm_prologue", "M=1", {"on": False})]).norm_prologue is False
    assert Tunings([AutotuneEntry("staged_x", "M=1", {"on": True})]).staged_x is True
    assert Tunings([AutotuneEntry("fused_mlp", "M=1", {"on": True})]).fused_mlp is True
    assert len(Tunings([AutotuneEntry("fused_mlp", "M=1", {"on": False})])) == 1
    for switch in ("norm_prologue", "staged_x", "fused_mlp"):
        with pytest.raises(ValueError, match=f"entry '{switch}': 'on' must be true or false, got 'yes'"):
            Tunings([AutotuneEntry(switch, "M=1", {"on": "yes"})])
    contents = load_artifact(tuned_artifact).contents
    contents.autotune = {"interpreter": [*contents.autotune["interpreter"], AutotuneEntry("decode_attention", "M=1", {"block_n": 48})]}
    bad = tmp_path / "bad.mgx"
    write_artifact(bad, contents)
    with pytest.raises(EngineError, match=r"stored tunings for interpreter: .*block_n 48 is not one of \(32, 64\)"):
        engine_on_cpu(bad)


@pytest.mark.interpreted
def test_tune_over_two_rounds_with_a_stored_tile_entry_first(tuned_artifact, native_stand_in, tmp_path) -> None:  # noqa: ANN001
    """A second round starts from the first one's choices and keeps every entry in its place (the
    stored decode attention entry first in the list here)."""
    from mgx.formats.artifact import AutotuneEntry

    contents = load_artifact(tuned_artifact).contents
    contents.autotune = {"interpreter": [AutotuneEntry("decode_attention", "M=1", {"block_n": 64}),
                                         *contents.autotune["interpreter"]]}  # fmt: skip
    first = tmp_path / "tile-first.mgx"
    write_artifact(first, contents)
    engine = engine_on_cpu(first)
    report = tune_in_graph(engine, lambda: step_price(engine), rounds=2)
    layers = sum(op.kind == "attention" for op in engine.graph.ops)
    assert report.final_ms == pytest.approx(layers * 4.75 + 1) == step_price(engine)
    assert {(t.kernel, t.before, t.chosen) for t in report.trials} == {
        ("linear_silu_mul", "triton", "imma"), ("linear", "triton", "gemv"), ("lm_head_argmax", "triton", "imma"),
        ("decode_attention", "64", "32"), ("norm_prologue", "off", "on"), ("staged_x", "off", "off")}
    kinds = [e.kernel for e in report.entries]
    assert kinds.count("decode_attention") == 1 and kinds[0] == "decode_attention"


@pytest.mark.interpreted
def test_decode_step_ms_decodes_a_request_then_times_the_captured_step(tuned_artifact, native_stand_in) -> None:  # noqa: ANN001
    """The step timer's host side: one greedy request of the prompt runs to its end (which captures
    the batch-1 graph on a GPU), then the median of the replay timings; without a captured graph (no
    graphs on the CPU) a clear error."""
    from mgx.runtime.tune import decode_step_ms

    engine = engine_on_cpu(tuned_artifact)
    backend = engine.runner.backend
    calls = []
    backend.replay_ms = lambda bucket, replays: calls.append((bucket, replays)) or [3.0, 1.0, 2.0][len(calls) - 1]
    assert decode_step_ms(engine, [5, 6, 7], steps=2, replays=7) == 2.0
    assert calls == [(1, 7)] * 3 and not engine.has_unfinished()
    backend.replay_ms = lambda bucket, replays: None
    with pytest.raises(EngineError, match="no batch-1 decode graph was captured"):
        decode_step_ms(engine, [5, 6, 7], steps=1)


@pytest.mark.interpreted
def test_tune_command_reports_and_writes_the_choices(tuned_artifact, native_stand_in, monkeypatch, tmp_path) -> None:  # noqa: ANN001
    """``mgx-run tune`` end to end on the CPU (the CUDA backend interpreted, the step priced): one
    line per shape with the chosen kernel marked, the summary, the file written (or not, with
    ``--dry-run``)."""
    from click.testing import CliRunner

    from mgx.runtime import tune
    from mgx.runtime.cli import main

    monkeypatch.setenv("MGX_CUDA_DEVICE", "cpu")
    monkeypatch.setenv("MGX_CUDA_DTYPE", "f32")
    monkeypatch.setattr(tune, "no_gpu_reason", lambda: "")
    monkeypatch.setattr(tune, "decode_step_ms", lambda engine, prompt: step_price(engine))

    def with_kernels(self, images):  # noqa: ANN001, ANN202
        self.cuda_kernels = KERNELS
        return "native stand-ins"

    monkeypatch.setattr(CUDABackend, "use_cuda_kernels", with_kernels)
    out = tmp_path / "tuned.mgx"
    dry = CliRunner().invoke(main, ["tune", str(tuned_artifact), "-o", str(out), "--prompt-len", "8", "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert "batch-1 decode step" in dry.output and not out.exists()
    result = CliRunner().invoke(main, ["tune", str(tuned_artifact), "-o", str(out), "--prompt-len", "8"])
    assert result.exit_code == 0, result.output
    assert "imma* " in result.output and "gemv* " in result.output and "(was triton)" in result.output
    assert f"wrote {out}" in result.output
    assert load_artifact(out).contents.passes[-1].options == {"prompt_len": 8, "rounds": 1, "min_gain": 0.005}
    too_long = CliRunner().invoke(main, ["tune", str(tuned_artifact), "--prompt-len", "1000"])
    assert too_long.exit_code == 1 and "exceed the model's 128 positions" in too_long.output


@pytest.fixture
def int4_artifact(tmp_path, monkeypatch):  # noqa: ANN001, ANN201
    """The tiny model of ``tuned_artifact`` with int4 weights (groups of 32), Triton everywhere stored."""
    return _tuned(tmp_path / "tiny-int4.mgx", monkeypatch, ("quantize_int4", {"group_size": 32}))


@pytest.fixture
def fused_stand_in(monkeypatch):  # noqa: ANN001, ANN201
    """The fused MLP where the "loaded code" is ``KERNELS``: the reference products into the fixed-point
    row, and the norm after it through ``fixed_to`` and the Triton norm."""
    import torch

    from mgx.kernels.cuda.gemv import FIXED_ONE, fixed_to
    from mgx.kernels.triton.linear import linear_ref, linear_silu_mul_ref
    from mgx.kernels.triton.rmsnorm import rms_norm

    def fused_mlp(rec, gate_up, down, *, kernels, out):  # noqa: ANN001, ANN202
        LAUNCHED.append("fused mlp")
        y = linear_ref(linear_silu_mul_ref(rec, gate_up).to(rec.dtype), down)[0].double()
        out[: down.n] = torch.round(y * FIXED_ONE).to(torch.int64)
        return out

    def norm_stage_fx(x, rows, weight, eps, total, *, kernels):  # noqa: ANN001, ANN202
        normed, summed = rms_norm(x, weight, eps, residual=fixed_to(rows.view(1, -1), x.dtype))
        total.copy_(summed)
        return normed, normed

    monkeypatch.setattr(backend_cuda, "fused_mlp_applies", lambda kernels, x, gate_up, down: kernels is KERNELS)
    monkeypatch.setattr(backend_cuda, "fused_mlp", fused_mlp)
    monkeypatch.setattr(backend_cuda, "norm_stage_fx", norm_stage_fx)


@pytest.mark.interpreted
def test_tune_runs_the_int4_mlp_in_one_launch_where_it_gains_and_the_environment_pins_it(
    int4_artifact, native_stand_in, fused_stand_in, monkeypatch, tmp_path
) -> None:  # noqa: ANN001
    """On an int4 model whose gate/up x is staged (norms kept out of the GEMV prologues: pinned), the
    fused MLP switch (on by default) is offered; priced dearer, tune turns it off and the written model
    runs the two GEMVs; priced cheaper, tune keeps it and the written model runs it (every layer's MLP
    but the last, whose norm feeds the LM head), decoding the same tokens. MGX_CUDA_FUSED_MLP set pins
    it over the stored choice, and tune leaves it alone."""
    monkeypatch.setenv("MGX_CUDA_NORM_GEMV", "0")

    def priced(engine: Engine, per_fused: float):  # noqa: ANN202
        def price() -> float:
            backend = engine.runner.backend
            fused = len(backend._mlp_row_of) if backend.fused_mlp and backend._mlp_rows is not None else 0
            return step_price(engine) + per_fused * fused

        return price

    def opened(path) -> Engine:  # noqa: ANN001
        engine = engine_on_cpu(path)
        backend = engine.runner.backend
        backend.fused_mlp = backend.fused_mlp  # its rows, now that "code" is loaded
        return engine

    engine = opened(int4_artifact)
    backend = engine.runner.backend
    layers = sum(op.kind == "attention" for op in engine.graph.ops)
    assert backend.fused_mlp and not backend.fused_mlp_pinned and backend.stages_x()
    prompt = [5, 6, 7, 8, 9]
    before = greedy(engine, prompt, 3)
    written = {}
    for per_fused, chosen, other in ((0.25, "off", "on"), (-0.25, "on", "off")):
        engine = opened(int4_artifact)
        report = tune_in_graph(engine, priced(engine, per_fused))
        (trial,) = [t for t in report.trials if t.kernel == "fused_mlp"]
        assert (trial.before, trial.chosen) == ("on", chosen) and trial.ms[chosen] < trial.ms[other]
        assert [t.kernel for t in report.trials][-2:] == ["staged_x", "fused_mlp"]  # after the staging it needs
        written[chosen] = tmp_path / f"fused-{chosen}.mgx"
        write_tunings(int4_artifact, written[chosen], report, {})
        again = opened(written[chosen])
        assert again.runner.backend.fused_mlp == (chosen == "on")
        assert len(again.runner.backend._mlp_row_of) == (layers - 1 if chosen == "on" else 0)
        LAUNCHED.clear()
        assert greedy(again, prompt, 3) == before
        assert LAUNCHED.count("fused mlp") == ((layers - 1) * 2 if chosen == "on" else 0)  # the two steps after the prompt's
    monkeypatch.setenv("MGX_CUDA_FUSED_MLP", "1")
    pinned = opened(written["off"])
    assert pinned.runner.backend.fused_mlp and pinned.runner.backend.fused_mlp_pinned
    assert "fused_mlp" not in {t.kernel for t in tune_in_graph(pinned, priced(pinned, 0.25)).trials}
