"""The native CUDA kernels: built by the ``cuda_kernels`` pass, stored in the artifact, loaded by the backend.

Without a GPU, nvcc is replaced by a fake builder and the CUDA backend runs on CPU tensors under
``TRITON_INTERPRET=1``: the pass, its errors, the images' trip through the pipeline and the artifact,
and a backend that holds images but runs on the CPU (Triton kernels, no driver call). On a GPU (tests
marked ``gpu``) a tiny Qwen3 model is compiled with the pass by the real nvcc: the backend
loads the image for its GPU and gives the tokens of the Triton kernels, and an image built for
another GPU falls back with exactly one warning.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mgx.compiler._progress import Progress
from mgx.compiler.pipeline import run_passes
from mgx.compiler.spec import ModelSpec, PassSpec, SourceSpec
from mgx.formats import ir
from mgx.formats.artifact import describe_artifact, load_artifact, write_artifact
from mgx.kernels.cuda import build
from mgx.kernels.cuda import rmsnorm as crms
from mgx.passes import PASSES, PassContext, PassError
from mgx.passes import cuda_kernels as cuda_kernels_pass

from _backend_testing import compiled
from _tiny_graph import tiny_contents


def fake_cubin(arch: str) -> bytes:
    return b"\x7fELF fake cubin for " + arch.encode()


@pytest.fixture
def fake_nvcc(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """nvcc replaced: each build returns a recognisable image; the archs built are listed."""
    built: list[str] = []
    monkeypatch.setattr(cuda_kernels_pass, "_build", lambda arch, flags=(): built.append(arch) or fake_cubin(arch))
    return built


def _snapshot(graph: ir.Graph) -> tuple:
    return (graph.ops, list(graph.tensors), [t.data.tobytes() for t in graph.tensors.values()])


def test_pass_builds_each_arch_and_leaves_the_graph_alone(fake_nvcc: list[str]) -> None:
    graph = compiled("gqa", "dense", target="cuda")
    before = _snapshot(graph)
    result = PASSES["cuda_kernels"](graph, {"archs": ["sm_90a", "sm_80"]}, PassContext(target="cuda"))
    assert fake_nvcc == ["sm_90a", "sm_80"]
    assert result.stats["cuda_kernels"] == {"sm_90a": fake_cubin("sm_90a"), "sm_80": fake_cubin("sm_80")}
    assert result.options == {"archs": ["sm_90a", "sm_80"]}
    assert "rmsnorm.cu" in result.summary and "sm_90a" in result.summary and "sm_80" in result.summary
    assert _snapshot(graph) == before


def test_default_arch_is_the_build_gpus(fake_nvcc: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    graph = compiled("gqa", "dense")
    monkeypatch.setattr(cuda_kernels_pass, "_device_arch", lambda: "sm_90a")
    result = PASSES["cuda_kernels"](graph, {}, PassContext(target="cuda"))
    assert list(result.stats["cuda_kernels"]) == ["sm_90a"] and result.options == {"archs": ["sm_90a"]}
    monkeypatch.setattr(cuda_kernels_pass, "_device_arch", lambda: None)
    with pytest.raises(PassError, match=r"no CUDA device .*archs: \[sm_90a\].*or drop the pass"):
        PASSES["cuda_kernels"](graph, {}, PassContext(target="cuda"))


def test_pipeline_stores_the_images_and_they_survive_the_artifact(
    fake_nvcc: list[str], tmp_path: Path
) -> None:
    contents = tiny_contents()
    spec = ModelSpec(
        name="tiny",
        source=SourceSpec("hf_dir", tmp_path, "test"),
        target="cuda",
        passes=(PassSpec("fuse_qkv"), PassSpec("cuda_kernels", {"archs": ["sm_90a", "sm_86"]})),
    )
    images: dict[str, bytes] = {}
    records = run_passes(contents.graph, spec, Progress(enabled=False), cuda_kernels=images)
    assert images == {"sm_90a": fake_cubin("sm_90a"), "sm_86": fake_cubin("sm_86")}
    assert records[-1].name == "cuda_kernels" and records[-1].options == {"archs": ["sm_90a", "sm_86"]}
    contents.cuda_kernels, contents.passes = images, records
    write_artifact(tmp_path / "m.mgx", contents)
    with load_artifact(tmp_path / "m.mgx") as loaded:
        assert loaded.contents.cuda_kernels == images
        assert describe_artifact(loaded)["cuda_kernel_bytes"] == {a: len(c) for a, c in images.items()}


def test_missing_nvcc_is_a_pass_error_that_says_how_to_fix_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(build, "find_nvcc", lambda: None)  # the real builder runs, and finds no nvcc
    with pytest.raises(
        PassError, match=r"sm_90a: nvcc not found \(set NVCC or CUDA_HOME.*\); or drop the pass"
    ):
        PASSES["cuda_kernels"](compiled("gqa", "dense"), {"archs": ["sm_90a"]}, PassContext(target="cuda"))


@pytest.mark.parametrize(
    ("target", "options", "message"),
    [
        ("cpu", {"archs": ["sm_90a"]}, "build target is 'cpu' \\(set target: cuda\\)"),
        ("cuda", {"archs": ["hopper"]}, "'hopper' is not of the form sm_<number>"),
        ("cuda", {"archs": ["sm_80", "sm_80"]}, "lists an architecture twice"),
        ("cuda", {"archs": "sm_80"}, "archs: expected a list"),
        ("cuda", {"arch": ["sm_80"]}, "unknown option 'arch'; allowed: archs"),
    ],
)
def test_bad_target_or_options_are_pass_errors(
    fake_nvcc: list[str], target: str, options: dict, message: str
) -> None:
    with pytest.raises(PassError, match=message):
        PASSES["cuda_kernels"](compiled("gqa", "dense"), options, PassContext(target=target))
    assert not fake_nvcc


@pytest.mark.interpreted
def test_interpreted_backend_with_images_runs_triton_and_never_calls_the_driver(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from mgx.kernels.cuda import driver
    from mgx.runtime import Engine, backend_cuda
    from mgx.runtime.backend_cuda import CUDABackend

    def no_driver(*_: object) -> None:
        raise AssertionError("the CUDA driver was called on a CPU device")

    monkeypatch.setattr(driver, "_driver", no_driver)
    monkeypatch.setattr(backend_cuda, "load_cuda_kernels", no_driver)
    contents = tiny_contents()
    contents.cuda_kernels = {"sm_90a": fake_cubin("sm_90a")}
    reference = Engine.from_contents(contents)
    assert reference.kernels_note is None  # backends without native GPU code say nothing
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning either: nothing was tried
        engine = Engine.from_contents(
            contents, backend=CUDABackend(contents.graph, device="cpu", dtype="f32")
        )
    assert engine.kernels_note == "native CUDA kernels are not used on this device (Triton RMSNorm)"
    assert engine.runner.backend.cuda_kernels is None
    prompt = list(np.random.default_rng(3).integers(2, contents.graph.arch.vocab_size, 9))
    assert engine.greedy_with_logits(prompt, 4)[0] == reference.greedy_with_logits(prompt, 4)[0]


# -- on a GPU ---------------------------------------------------------------------------------------


@dataclass
class Native:
    here: str  # this GPU's architecture
    other: str  # another GPU's
    artifacts: dict[str, Any]  # CompileResult: kernels for "here", for "other", and "none"


@pytest.fixture(scope="module")
def native(tmp_path_factory: pytest.TempPathFactory) -> Native:
    """A tiny qwen3 compiled for target cuda three times: kernels for this GPU, for another GPU, none."""
    if build.find_nvcc() is None:
        pytest.skip("needs nvcc (set NVCC or CUDA_HOME)")
    import torch

    from _tiny_hf import build_model_dir

    major, minor = torch.cuda.get_device_capability()
    here = build.arch_for(major, minor)  # the pass's default
    other = "sm_80" if major != 8 else "sm_90a"
    base = tmp_path_factory.mktemp("native")
    folder = build_model_dir(base / "qwen3", "qwen3")  # q/k norms: grouped rows too
    artifacts = {}
    for name, passes in (
        ("here", ["cuda_kernels"]),
        ("other", [f"cuda_kernels: {{archs: [{other}]}}"]),
        ("none", []),
    ):
        artifacts[name] = _compile_tiny(folder, "qwen3", passes, base / f"{name}.mgx")
    return Native(here, other, artifacts)


def _compile_tiny(folder: Path, family: str, passes: list[str], output: Path) -> Any:
    """A tiny model folder compiled for target cuda with ``passes`` (model.yaml list items), fp32
    weights, golden tokens for two prompts."""
    from mgx.compiler.pipeline import compile_model
    from mgx.compiler.spec import load_spec

    from _tiny_hf import write_spec

    extra = "target: cuda\n" + ("passes:\n" + "".join(f"  - {p}\n" for p in passes) if passes else "")
    spec_path = write_spec(folder, family, "fp32", ["Hello world", "The quick brown fox"], 24, extra=extra)
    return compile_model(load_spec(spec_path), output, None, Progress(enabled=False))


def _tokens(engine: Any, result: Any) -> list[list[int]]:
    return [
        engine.greedy_with_logits(list(c.prompt_ids), len(c.expected_ids))[0] for c in result.golden.cases
    ]


def _golden(result: Any) -> list[list[int]]:
    return [list(c.expected_ids) for c in result.golden.cases]


@pytest.mark.gpu
def test_gpu_native_rmsnorm_is_loaded_and_gives_the_triton_tokens(
    native: Native, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mgx.kernels.cuda import gemv as cgemv
    from mgx.kernels.cuda import rmsnorm as crms
    from mgx.runtime import Engine

    monkeypatch.setenv("MGX_CUDA_DTYPE", "f32")
    built, plain = native.artifacts["here"], native.artifacts["none"]
    assert set(load_artifact(built.output).contents.cuda_kernels) == {native.here}
    engine = Engine(built.output, backend="cuda")
    kernels = engine.runner.backend.cuda_kernels
    assert kernels is not None and kernels.arch == native.here
    listed = ", ".join(["RMSNorm", *cgemv.LABELS.values(), cgemv.ARGMAX_LABEL])  # every entry the image holds
    overlapped = ", launched overlapped" if engine.runner.backend.overlap_launches else ""  # sm_90+ by default
    assert engine.kernels_note == f"native CUDA kernels for {native.here} ({listed}){overlapped}"
    launches: list[str] = []
    launch = kernels.module.launch
    monkeypatch.setattr(
        kernels.module, "launch", lambda name, *a, **k: launches.append(name) or launch(name, *a, **k)
    )
    tokens = _tokens(engine, built)
    assert launches and set(launches) == {f"mgx_rms_norm_f32_v{crms.KERNEL_ABI}"}  # the native kernel ran
    crms.reset_fallback_warning()
    with warnings.catch_warnings(record=True):  # "the artifact holds no native CUDA kernels"
        warnings.simplefilter("always")
        triton_engine = Engine(plain.output, backend="cuda")
    assert triton_engine.runner.backend.cuda_kernels is None
    assert tokens == _tokens(triton_engine, plain) == _golden(plain) == _golden(built)


@pytest.mark.gpu
def test_gpu_image_for_another_gpu_falls_back_with_one_warning(
    native: Native, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mgx.kernels.cuda import rmsnorm as crms
    from mgx.runtime import Engine

    monkeypatch.setenv("MGX_CUDA_DTYPE", "f32")
    built = native.artifacts["other"]
    assert set(load_artifact(built.output).contents.cuda_kernels) == {native.other}
    crms.reset_fallback_warning()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        engine = Engine(built.output, backend="cuda")
        again = Engine(built.output, backend="cuda")  # a second load says nothing more
        tokens = _tokens(engine, built)
    messages = [
        str(w.message)
        for w in seen
        if issubclass(w.category, RuntimeWarning) and "Triton RMSNorm" in str(w.message)
    ]
    assert len(messages) == 1 and native.other in messages[0], messages
    assert engine.runner.backend.cuda_kernels is None and again.runner.backend.cuda_kernels is None
    assert (
        engine.kernels_note.startswith("no native CUDA kernels for sm_")
        and native.other in engine.kernels_note
    )
    assert tokens == _golden(built)


@pytest.fixture(scope="module")
def fused_native(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A tiny llama with fused QKV and gate/up projections, W8A16, and this GPU's kernels: every input
    norm after a residual add feeds one projection, which the GEMV's RMSNorm prologue can take (untuned,
    the backend runs the native GEMV for quantized weights)."""
    if build.find_nvcc() is None:
        pytest.skip("needs nvcc (set NVCC or CUDA_HOME)")
    from _tiny_hf import build_model_dir

    base = tmp_path_factory.mktemp("fused")
    folder = build_model_dir(base / "llama", "llama")
    passes = ["fuse_qkv", "fuse_gate_up", "quantize_w8a16", "cuda_kernels"]
    return _compile_tiny(folder, "llama", passes, base / "fused.mgx")


@pytest.mark.gpu
def test_gpu_add_and_norm_run_in_the_gemv_prologue_at_batch_1(fused_native: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 at batch 1: the native ``_norm`` GEMVs take every add + RMSNorm before a projection (one
    launch each instead of two); MGX_CUDA_NORM_GEMV=0 runs them apart. Same greedy tokens, top-1
    logits within 2% (1/rms may differ in its last bit between the two)."""
    from mgx.kernels.cuda import gemv as cg
    from mgx.runtime import Engine

    monkeypatch.setenv("MGX_CUDA_DTYPE", "bf16")
    results = {}
    for switch in ("1", "0"):
        monkeypatch.setenv("MGX_CUDA_NORM_GEMV", switch)
        engine = Engine(fused_native.output, backend="cuda")
        kernels = engine.runner.backend.cuda_kernels
        assert kernels is not None
        launches: list[str] = []
        launch = kernels.module.launch
        monkeypatch.setattr(kernels.module, "launch", lambda name, *a, _l=launch, _s=launches, **k: _s.append(name) or _l(name, *a, **k))
        runs = [engine.greedy_with_logits(list(c.prompt_ids), 24) for c in fused_native.golden.cases]
        results[switch] = (runs, {n for n in launches if n in cg.NORM_ENTRIES.values()})
    (fused, used), (apart, unused) = results["1"], results["0"]
    assert used == {cg.NORM_ENTRIES["gemv", "w8a16"]} and not unused
    for (ids, top1), (ids0, top10) in zip(fused, apart, strict=True):
        assert ids == ids0
        np.testing.assert_allclose(top1, top10, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_gpu_overlapped_launches_give_the_same_tokens(
    fused_native: Any, native: Native, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MGX_CUDA_PDL=1 launches the decode-path kernels overlapped (sm_90 and newer): the same kernels,
    so the same greedy tokens and top-1 logits to the bit as ordinary launches, in bf16. Two models:
    W8A16 with native GEMVs (the kernel note says they are overlapped), and one without native
    kernels (the Triton GEMVs, decode attention and LM head alone)."""
    import torch

    from mgx.runtime import Engine

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("overlapped launches need sm_90")
    monkeypatch.setenv("MGX_CUDA_DTYPE", "bf16")
    for built, kernels in ((fused_native, True), (native.artifacts["none"], False)):
        results = {}
        for switch in ("1", "0"):
            monkeypatch.setenv("MGX_CUDA_PDL", switch)
            crms.reset_fallback_warning()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "the artifact holds no native CUDA kernels"
                engine = Engine(built.output, backend="cuda")
            backend = engine.runner.backend
            assert backend.overlap_launches is (switch == "1")
            assert (backend.cuda_kernels is not None) is kernels
            if kernels:
                assert backend.cuda_kernels.overlap is (switch == "1")
                assert engine.kernels_note.endswith(", launched overlapped") is (switch == "1")
            results[switch] = [engine.greedy_with_logits(list(c.prompt_ids), 24) for c in built.golden.cases]
        assert results["1"] == results["0"]


@pytest.mark.gpu
def test_gpu_tune_times_the_decode_step_and_the_written_model_runs_its_choices(tmp_path: Path) -> None:
    """``mgx.runtime.tune`` on a real GPU: a tiny W8A16 qwen3 with native code and stored tunings
    for this GPU; every trial's step time is real (positive), the chosen kernels are the ones a new
    engine on the written file takes, and ``mgx-run tune --dry-run`` runs the same from the CLI."""
    if build.find_nvcc() is None:
        pytest.skip("needs nvcc (set NVCC or CUDA_HOME)")
    from click.testing import CliRunner

    from mgx.compiler.pipeline import compile_model
    from mgx.compiler.spec import load_spec
    from mgx.formats.artifact import load_artifact
    from mgx.kernels.triton.tuning import shape_key
    from mgx.runtime import Engine
    from mgx.runtime.cli import main
    from mgx.runtime.tune import PASS_NAME, TRITON, decode_step_ms, tune_in_graph, write_tunings

    from _tiny_hf import build_model_dir, write_spec

    folder = build_model_dir(tmp_path / "qwen3", "qwen3")
    passes = ["fuse_qkv", "fuse_gate_up", "quantize_w8a16", "reorder_weights", "cuda_kernels", "autotune: {rows: [1]}"]
    extra = "target: cuda\npasses:\n" + "".join(f"  - {p}\n" for p in passes)
    spec = write_spec(folder, "qwen3", "bf16", ["Hello world"], 8, extra=extra)
    path = tmp_path / "w8a16.mgx"
    compile_model(load_spec(spec), path, None, Progress(enabled=False))
    engine = Engine(path, backend="cuda")
    prompt = list(range(3, 67))
    report = tune_in_graph(engine, lambda: decode_step_ms(engine, prompt, replays=10))
    assert report.trials and report.baseline_ms > 0 and 0 < report.final_ms <= report.baseline_ms
    assert all(ms > 0 for t in report.trials for ms in t.ms.values())
    out = tmp_path / "tuned.mgx"
    write_tunings(path, out, report, {})
    assert load_artifact(out).contents.passes[-1].name == PASS_NAME
    tuned = Engine(out, backend="cuda")
    backend, chosen = tuned.runner.backend, {(t.kernel, t.shape_key): t.chosen for t in report.trials}
    for kernel, w, _ in backend.one_row_linears():
        if (kernel, shape_key(w, 1)) in chosen:
            native = backend.tunings.config(kernel, w, 1).native
            assert (native or TRITON) == chosen[(kernel, shape_key(w, 1))]
    assert len(tuned.greedy_with_logits(prompt, 4)[0]) == 4
    result = CliRunner().invoke(main, ["tune", str(out), "--prompt-len", "64", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "batch-1 decode step" in result.output


@pytest.mark.gpu
def test_gpu_autotune_times_the_norm_fed_projections_after_their_norm() -> None:
    """On a real GPU, an int4 model in cuda_tile16 with fp16 scale pairs (the 8B INT4 model's build):
    autotune times QKV and gate/up after their norm (``after_norm``: ``norm_stage`` and a kind's
    staged twin, or the plain add + RMSNorm before the rest), o and down alone; every time is real,
    and each native choice is one of the kinds the build holds."""
    if build.find_nvcc() is None:
        pytest.skip("needs nvcc (set NVCC or CUDA_HOME)")
    from mgx.kernels.cuda.gemv import KINDS

    graph = tiny_contents(hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4, head_dim=64,
                          num_kv_heads=2, dtype=ir.DType.BF16).graph  # fmt: skip
    for name, options in (("fuse_qkv", {}), ("fuse_gate_up", {}), ("quantize_int4", {"group_size": 128}),
                          ("reorder_weights", {})):  # fmt: skip
        PASSES[name](graph, options, PassContext(target="cuda"))
    timed = {}
    for after in (True, False):
        result = PASSES["autotune"](graph, {"rows": [1], "after_norm": after, "repeats": 5, "sampling_head": False}, PassContext(target="cuda"))
        timed[after] = {key.split(",N=")[1].split(",")[0] + ("/" + key.split(",K=")[1].split(",")[0]): t
                         for key, t in result.stats["timings"].items() if not key.startswith("lm_head")}  # fmt: skip
    qkv = str(256 + 2 * 2 * 64)
    assert {key: t["fused"] for key, t in timed[True].items()} == {
        f"{qkv}/256": "after_norm", "1024/256": "after_norm", "256/256": "", "256/512": ""}
    assert {t["fused"] for t in timed[False].values()} == {""}
    for t in (*timed[True].values(), *timed[False].values()):
        assert t["us"] > 0 and t["triton_us"] > 0 and t["chosen"] in ("triton", *KINDS)
    # After the norm a projection takes at least as long as the norm and itself alone, in the same build.
    assert timed[True][f"{qkv}/256"]["triton_us"] > timed[False][f"{qkv}/256"]["triton_us"]


@pytest.mark.gpu
def test_gpu_autotune_tunes_attention_rope_and_rms_norm_and_the_backend_decodes_the_reference_tokens_with_them() -> None:
    """On a real GPU: autotune times every prefill and decode attention candidate (decode_attention on),
    every RoPE + K/V write, Triton RMSNorm and greedy-head merge candidate for a 4-head model, stores one entry per row
    count with a real time, and a backend taking those entries (no native kernels loaded: the Triton RMSNorm runs)
    greedy-decodes a prompt continued in a second chunk (the paged prefill) as the reference does."""
    import torch

    from mgx.kernels.triton import rmsnorm
    from mgx.kernels.triton.attention import DECODE_CONFIGS, PREFILL_CONFIGS
    from mgx.runtime.backend_cuda import CUDABackend
    from mgx.runtime.batch import SeqChunk
    from mgx.runtime.model_runner import ModelRunner

    contents = tiny_contents(num_heads=4, head_dim=64, num_kv_heads=2, hidden_size=256, max_position=512)
    result = PASSES["autotune"](contents.graph, {"rows": [1, 4, 16, 64], "dtype": "f32", "decode_attention": True,
                                                 "decode_context": 300, "native": False, "repeats": 5},
                                PassContext(target="cuda"))  # fmt: skip
    (arch,) = result.stats["autotune"]
    entries = {(e.kernel, e.shape_key.rsplit(",M=", 1)[1]): e.config for e in result.stats["autotune"][arch]
               if e.kernel.startswith("paged_attention")}  # fmt: skip
    assert sorted(entries) == [("paged_attention_decode", m) for m in ("1", "16", "4", "64")] + [
        ("paged_attention_prefill", m) for m in ("16", "64")]
    timings = result.stats["attention_timings"]
    assert all(t["us"] > 0 and t["us"] <= t["default_us"] for t in timings.values())
    assert "could not run" not in result.summary, result.summary
    assert {tuple(c.values()) for k, c in entries.items() if k[0].endswith("decode")} <= {
        (c.block_n, c.num_warps) for c in DECODE_CONFIGS}
    assert {tuple(c.values()) for k, c in entries.items() if k[0].endswith("prefill")} <= {
        (c.block_m, c.block_n, c.num_warps, c.num_stages) for c in PREFILL_CONFIGS}
    rope = [e.shape_key.rsplit(",M=", 1)[1] for e in result.stats["autotune"][arch] if e.kernel == "rope_and_write_kv"]
    assert sorted(rope, key=int) == ["1", "4", "16", "64"]
    norms = {e.shape_key: rmsnorm.RMSNormConfig(**e.config) for e in result.stats["autotune"][arch] if e.kernel == "rms_norm"}
    assert sorted(norms) == sorted(f"F=256,group=256,residual={r},M={m}" for r in (0, 1) for m in (1, 4, 16, 64))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert all(c in rmsnorm.candidates(int(k.rsplit("M=", 1)[1]), 256, sms) for k, c in norms.items())
    elementwise_timings = result.stats["elementwise_timings"]
    assert sorted(k for k in elementwise_timings if k.startswith("rms_norm ")) == sorted(f"rms_norm {k}" for k in norms)
    merges = [e.shape_key.rsplit(",M=", 1)[1] for e in result.stats["autotune"][arch] if e.kernel == "argmax_merge"]
    assert sorted(merges, key=int) == ["1", "4", "16", "64"]  # the greedy head's merge at each row count
    assert len(elementwise_timings) == len(norms) + len(merges)
    assert all(0 < t["us"] <= t["default_us"] for t in elementwise_timings.values())
    backend = CUDABackend(contents.graph, device="cuda", dtype="f32")
    backend.use_tunings(result.stats["autotune"])
    assert backend.cuda_kernels is None
    backend._sdpa_modes = []  # the first chunk through the paged kernel too
    runner, want = ModelRunner(contents.graph, backend), ModelRunner(contents.graph, "reference")
    prompt = np.arange(5, 85)
    got = [runner.step_greedy([SeqChunk(0, prompt[:40])])[0][0][-1], runner.step_greedy([SeqChunk(0, prompt[40:])])[0][0][-1]]
    ref = [int(np.argmax(want.step([SeqChunk(0, prompt[:40])])[0][-1])), int(np.argmax(want.step([SeqChunk(0, prompt[40:])])[0][-1]))]
    for _ in range(4):
        got.append(runner.step_greedy([SeqChunk(0, got[-1:])])[0][0][-1])
        ref.append(int(np.argmax(want.step([SeqChunk(0, ref[-1:])])[0][-1])))
    assert [int(i) for i in got] == ref


def test_kernel_flags_ask_for_the_layouts_the_weights_are_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """``kernel_flags``: nothing for row-major weights; MGX_IMMA_TILE16 once reorder_weights tiled them;
    with it MGX_IMMA_HALF_SCALES where every int4 weight has groups of 128 and fp16 scales (quantize_int4's
    default), not with ``f16_scales: false``, groups of 64, or W8A16 weights; the pass's summary says
    when int4 weights go without it, and names the option."""
    import copy

    from mgx.passes.cuda_kernels import kernel_flags

    from _tiny_graph import build_tiny_graph

    base, _ = build_tiny_graph(hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2, head_dim=64,
                               fused=True, dtype=ir.DType.BF16)  # fmt: skip

    def flags(quantize: tuple[str, dict], reorder: bool = True) -> tuple[str, ...]:
        graph = copy.deepcopy(base)
        for name, options in (quantize, ("reorder_weights", {})) if reorder else (quantize,):
            PASSES[name](graph, dict(options), PassContext(target="cuda"))
        return kernel_flags(graph)

    tile16, half = "-DMGX_IMMA_TILE16=1", "-DMGX_IMMA_HALF_SCALES=1"
    for f16, says in ((True, False), (False, True)):  # the pass's summary says when the pairs are off, and why
        graph = copy.deepcopy(base)
        for name, options in (("quantize_int4", {"group_size": 128, "f16_scales": f16}), ("reorder_weights", {})):
            PASSES[name](graph, dict(options), PassContext(target="cuda"))
        monkeypatch.setattr(cuda_kernels_pass, "_build", lambda arch, flags=(): fake_cubin(arch))
        summary = PASSES["cuda_kernels"](graph, {"archs": ["sm_90a"]}, PassContext(target="cuda")).summary
        assert ("int4 scales read as fp32" in summary and "f16_scales" in summary) == says, summary
    assert flags(("quantize_int4", {"group_size": 128})) == (tile16, half)
    assert flags(("quantize_int4", {"group_size": 128, "symmetric": True})) == (tile16, half)
    assert flags(("quantize_int4", {"group_size": 128}), reorder=False) == ()
    assert flags(("quantize_int4", {"group_size": 128, "f16_scales": False})) == (tile16,)
    assert flags(("quantize_int4", {"group_size": 64})) == (tile16,)
    assert flags(("quantize_w8a16", {})) == (tile16,)
