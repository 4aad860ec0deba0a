"""examples/bench_gpu_model.py's reading of nvidia-smi: what it says of the GPU while a graph replays
(clocks, temperature, power, throttle reasons), so that a slow run can be told from a clocked-down GPU.
The GPU parts run on the H200 only; this checks the parsing, which is plain text."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
from _examples import load_example


@pytest.fixture(scope="module")
def bench():  # noqa: ANN201
    return load_example("bench_gpu_model")  # the script reads --smoke from argv on import


def test_gpu_state_takes_median_clocks_peak_heat_and_every_reason_seen(bench) -> None:  # noqa: ANN001
    text = ("1980, 3201, 45, 612.35, 0x0000000000000000\n"
            "1755, 3201, 47, 700.10, 0x0000000000000004\n"
            "not, a, sample, at, all\n"
            "1965, 2619, 46, 650.00, 0x0000000000000020\n")  # fmt: skip
    state = bench.summarize_gpu_state(text)
    assert state == {"samples": 3, "sm_mhz": 1965.0, "mem_mhz": 3201.0, "max_temp_c": 47.0, "max_power_w": 700.1,
                     "clock_event_reasons": "0x24"}  # fmt: skip


def test_gpu_state_is_none_when_nvidia_smi_printed_no_sample(bench) -> None:  # noqa: ANN001
    # An nvidia-smi that does not know a queried field prints an error line instead of samples.
    assert bench.summarize_gpu_state('Field "clocks_event_reasons.active" is not a valid field to query.\n') is None
    assert bench.summarize_gpu_state("") is None


def test_other_kernels_flip_times_the_graph_on_the_rebuilt_kernels_and_puts_the_stored_ones_back(bench, monkeypatch) -> None:  # noqa: ANN001
    """``--nvcc-flip``: the graph is recaptured on kernels built with the flag (and the artifact's own
    flags; same arch and device, launched overlapped as the stored ones are), then the stored kernels
    return, also after a failure."""
    from types import SimpleNamespace

    from mgx.kernels.cuda import build, rmsnorm

    class Kernels:
        def __init__(self, arch: str, device: int, overlap: bool) -> None:
            self.arch, self.device, self.overlap = arch, device, overlap

        def allow_overlap(self, sm: int) -> bool:
            return sm >= 90

    stored = Kernels("sm_90a", 3, True)
    graph = SimpleNamespace(tensors={"w": SimpleNamespace(layout="cuda_tile16")}, ops=[])  # the imma GEMVs' tiles
    backend = SimpleNamespace(cuda_kernels=stored, _sm=90, _decode_graphs={(1, True): "graph"}, graph=graph)
    engine = SimpleNamespace(runner=SimpleNamespace(backend=backend))
    built, seen = [], []
    monkeypatch.setattr(bench, "DEVICE", "cuda")
    monkeypatch.setattr(build, "find_nvcc", lambda: "/usr/bin/nvcc")
    monkeypatch.setattr(build, "build_cuda_kernels", lambda arch, extra_flags=(): built.append((arch, extra_flags)) or b"cubin")
    monkeypatch.setattr(rmsnorm, "load_cuda_kernels", lambda cubin, arch, device: Kernels(arch, device, False))

    def recaptured(engine, prompt):  # noqa: ANN001, ANN202
        seen.append(backend.cuda_kernels)
        return 1.25

    monkeypatch.setattr(bench, "graph_ms_recaptured", recaptured)
    assert bench.graph_ms_other_kernels(engine, "-DMGX_IMMA_UNROLL=2", [1, 2]) == 1.25
    assert built == [("sm_90a", ("-DMGX_IMMA_TILE16=1", "-DMGX_IMMA_UNROLL=2"))]  # as the artifact's, and the flag
    (other,) = seen
    assert other is not stored and (other.arch, other.device, other.overlap) == ("sm_90a", 3, True)
    assert backend.cuda_kernels is stored and (1, True) not in backend._decode_graphs

    def fails(engine, prompt):  # noqa: ANN001, ANN202
        raise RuntimeError("capture failed")

    monkeypatch.setattr(bench, "graph_ms_recaptured", fails)
    with pytest.raises(RuntimeError):
        bench.graph_ms_other_kernels(engine, "-DX=1", [1])
    assert backend.cuda_kernels is stored
    backend.cuda_kernels = None
    assert bench.graph_ms_other_kernels(engine, "-DX=1", [1]) is None  # no native kernels: nothing to flip


def test_serve_cold_runs_mgx_run_bench_in_new_processes_without_and_with_warm_up(bench, monkeypatch, tmp_path) -> None:  # noqa: ANN001
    """``--serve-cold``: one ``mgx-run bench`` process each way, Triton's cache its own and empty, the
    --serve workload at the given rate; a row each with the warm-up's seconds read from its stderr
    line and the report's figures, or the failure's stderr."""
    import json
    from types import SimpleNamespace

    calls, rows = [], []
    report = {"requests_per_s": 7.8, "ttft_ms": {"p99": 9.5}, "tpot_ms": {"p50": 1.2}, "step_ms": {"max": 30.0},
              "graphs": {"captures": {"decode": 2}}}  # fmt: skip

    failing = []

    def run(cmd, capture_output, text, env, timeout):  # noqa: ANN001, ANN202
        calls.append((cmd, env["TRITON_CACHE_DIR"]))
        warm = "--warm-up" in cmd
        if failing:
            return SimpleNamespace(returncode=1, stderr="Traceback ...\nEngineError: out of memory")
        Path(cmd[cmd.index("--json") + 1]).write_text(json.dumps(report))
        return SimpleNamespace(returncode=0, stderr="warm-up: 8 batch sizes in 11.0 s\n" if warm else "")

    monkeypatch.setattr("subprocess.run", run)
    monkeypatch.setattr(bench, "add_row", rows.append)
    args = SimpleNamespace(serve_prompts=160, serve_cold=8.0, kv_memory="16GiB")
    bench.bench_serve_cold(Path("m.mgx"), "bf16", args, tmp_path)
    (plain, plain_cache), (warm, warm_cache) = calls
    assert plain_cache != warm_cache and "--warm-up" not in plain and warm[-1] == "--warm-up"
    for flag, value in (("--request-rate", "8"), ("--num-prompts", "160"), ("--max-num-seqs", "64"),
                        ("--backend", "cuda"), ("--kv-memory", "16GiB")):  # fmt: skip
        assert plain[plain.index(flag) + 1] == value
    assert rows[0] == {"engine": "mgx bf16 serving cold", "request_rate": 8.0, "warm_up": False,
                       "process_s": rows[0]["process_s"], **report}  # fmt: skip
    assert rows[1] == rows[0] | {"warm_up": True, "process_s": rows[1]["process_s"], "warm_up_sizes": 8, "warm_up_s": 11.0}
    failing.append(True)
    bench.bench_serve_cold(Path("m.mgx"), "bf16", args, tmp_path)
    assert [r["warm_up"] for r in rows[2:]] == [False, True] and all("out of memory" in r["error"] for r in rows[2:])


def test_step_phases_times_each_phase_of_the_decode_steps_and_puts_the_methods_back(bench, monkeypatch) -> None:  # noqa: ANN001
    """``--phases``: each phase of Engine.step timed over the decode steps only (after every request's
    first token), the rest of the step as ``other``, and the timed methods restored afterwards."""
    from mgx.runtime import Engine, EngineConfig

    from _tiny_graph import tiny_contents

    monkeypatch.setattr(bench, "DEVICE", "cpu")  # no device to synchronize
    engine = Engine.from_contents(tiny_contents(), config=EngineConfig(max_num_seqs=4))
    holders = {"LaunchedStep": bench_module_class("mgx.runtime.model_runner", "LaunchedStep"),
               "Request": bench_module_class("mgx.runtime.request", "Request"), "engine": type(engine),
               "scheduler": type(engine.scheduler), "runner": type(engine.runner)}  # fmt: skip
    before = {(h, m): holders[h].__dict__[m] for _, h, m in bench.STEP_PHASES}
    phases = bench.step_phases(engine, [[5 + i, 6, 7] for i in range(4)], 6)
    labels = [label for label, _, _ in bench.STEP_PHASES]
    assert set(phases) == {*labels, "step", "other", "steps"}
    assert phases["steps"] == 5  # the prefill step gives each request its first token; 5 decode steps follow
    # the reference backend neither overlaps steps (nothing launched ahead or adopted) nor skips the others
    assert phases["launch_ahead"] == phases["adopt"] == 0
    assert all(phases[k] > 0 for k in ("schedule", "launch", "picks", "accept", "account", "step"))
    assert sum(phases[k] for k in labels) + phases["other"] == pytest.approx(phases["step"])
    assert sum(phases[k] for k in labels) < phases["step"]
    assert {(h, m): holders[h].__dict__[m] for _, h, m in bench.STEP_PHASES} == before
    assert not engine.has_unfinished()


def bench_module_class(module: str, name: str) -> type:
    return getattr(importlib.import_module(module), name)


def test_replay_spans_are_the_mean_replay_and_the_mean_gap_between_replays(bench) -> None:  # noqa: ANN001
    """``--phases`` on CUDA: events around each graph replay give the device's time per replay and
    from one replay's end to the next one's start (events stood in by timestamps in ms)."""

    class Stamp:
        def __init__(self, ms: float) -> None:
            self.ms = ms

        def elapsed_time(self, later: Stamp) -> float:
            return later.ms - self.ms

    replays = [(Stamp(0.0), Stamp(1.5)), (Stamp(1.7), Stamp(3.3)), (Stamp(3.4), Stamp(5.1))]
    spans = bench.replay_spans(replays)
    assert spans["graph"] == pytest.approx(1e3 * (1.5 + 1.6 + 1.7) / 3)
    assert spans["between_graphs"] == pytest.approx(1e3 * (0.2 + 0.1) / 2)
    assert spans["replays"] == 3
    assert bench.replay_spans(replays[:1]) == {}  # one replay has no gap to measure


def test_device_gaps_are_measured_from_the_latest_end_and_ranked(bench, monkeypatch) -> None:  # noqa: ANN001
    """``--profile``: the device's idle time between activities, overlapping ones merged (a gap ends
    at a start after the latest end so far), the longest first with the activities around them."""
    from types import SimpleNamespace

    import torch

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def act(name: str, start: float, end: float, device=cuda):  # noqa: ANN001, ANN202
        return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end))

    events = [act("graph_a", 0, 100), act("inner", 10, 20), act("host", 100, 400, cpu), act("Memcpy HtoD", 130, 135),
              act("graph_b", 140, 240), act("Memcpy DtoH", 300, 302)]  # fmt: skip
    lines: list[str] = []
    monkeypatch.setattr(bench, "log", lines.append)
    bench.log_device_gaps(events, steps=2)
    assert lines[0].startswith("device idle 47.5 us a step over 2 steps (3 gaps)")
    assert [line.split()[:4] for line in lines[1:]] == [
        ["60.0", "graph_b", "->", "Memcpy"], ["30.0", "graph_a", "->", "Memcpy"], ["5.0", "Memcpy", "HtoD", "->"]]


def test_whole_steps_run_turns_subset_launches_off_for_its_run_only(bench, monkeypatch) -> None:  # noqa: ANN001
    """The batch A/B: the same requests with steps launched ahead only of the same sequences (every
    step in which a request ends waits, as it did before), then the switch back on."""
    from mgx.runtime import Engine, EngineConfig

    from _tiny_graph import tiny_contents

    monkeypatch.setattr(bench, "DEVICE", "cpu")
    engine = Engine.from_contents(tiny_contents(), backend="cpu", config=EngineConfig(max_num_seqs=4, max_tokens_per_step=6))
    engine.runner.backend.overlaps_steps = True  # the CPU backend stands in for one that overlaps
    seen: list[bool] = []
    step = engine.step
    engine.step = lambda: seen.append(engine.ahead_subsets) or step()
    plain: list[int] = []
    launch = engine.runner.launch_greedy_packed
    engine.runner.launch_greedy_packed = lambda *a: plain.append(len(a[0])) or launch(*a)
    prompts = [[5 + i, 6, 7, 8, 9] for i in range(4)]  # prefilled over 4 steps: they end in 4 waves
    tok_s = bench.whole_steps_tok_s(engine, prompts, 8)
    assert tok_s > 0 and seen and not any(seen) and engine.ahead_subsets
    whole = len(plain)
    plain.clear()
    bench.run_steps(engine, prompts, 8)
    assert len(plain) < whole  # with subsets, the steps where a wave ends were launched ahead too


def test_serving_plan_adds_the_whole_steps_pass_where_steps_are_launched_ahead(bench) -> None:  # noqa: ANN001
    inf = float("inf")
    plan = bench.serving_plan([4.0, inf], overlaps=True)
    assert plan[:2] == [("warm-up", True, 4.0, True), ("warm-up", False, 4.0, True)]
    assert plan[2:6] == [("4 req/s", False, 4.0, True), ("4 req/s", True, 4.0, True),
                         ("inf req/s", False, inf, True), ("inf req/s", True, inf, True)]  # fmt: skip
    assert plan[6:] == [("4 req/s", True, 4.0, False), ("inf req/s", True, inf, False)]
    assert bench.serving_plan([8.0], overlaps=False) == [
        ("warm-up", True, 8.0, True), ("warm-up", False, 8.0, True), ("8 req/s", False, 8.0, True), ("8 req/s", True, 8.0, True)]


def test_summary_gives_each_engines_batch_1_figures_and_the_schemes_ratios_to_bf16(bench) -> None:  # noqa: ANN001
    rows = [{"engine": "mgx int4", "decode_b1_tok_s": 540.0, "decode_b1_bw_frac": 0.52, "graph_b1_ms": 1.8},
            {"engine": "mgx bf16", "decode_b1_tok_s": 240.0, "decode_b1_bw_frac": 0.86, "graph_b1_ms": 4.14},
            {"engine": "mgx w8a16 serving", "error": "RuntimeError: x"},
            {"engine": "transformers static", "decode_b1_tok_s": 130.0, "decode_b1_bw_frac": 0.457}]  # fmt: skip
    assert bench.summary_lines(rows) == [
        "summary mgx int4: batch 1 540.0 tok/s (52.0% of copy bandwidth), graph 1.800 ms, 2.250x bf16 (graphs 2.300x)",
        "summary mgx bf16: batch 1 240.0 tok/s (86.0% of copy bandwidth), graph 4.140 ms",
        "summary transformers static: batch 1 130.0 tok/s (45.7% of copy bandwidth)",
    ]
    no_bf16 = "summary mgx int4: batch 1 540.0 tok/s (52.0% of copy bandwidth), graph 1.800 ms"
    assert bench.summary_lines(rows[:1]) == [no_bf16]  # no bf16 in the run: no ratio


def test_autotune_log_names_every_tuned_shape_of_every_group_and_keeps_them_for_the_json(bench, monkeypatch, capsys) -> None:  # noqa: ANN001
    """The model run's log and JSON carry the elementwise kinds (embedding lookup, argmax merge,
    dequantize, SiLU product) beside the linear and attention ones: the only record of what autotune
    chose for them at the model's shapes. Their entries come from the pass itself (its format)."""
    import torch

    from mgx.kernels.triton.attention import MERGE_CONFIGS
    from mgx.passes import autotune as ap

    fake_us = {4: 3.0, 1: 5.0, 2: 2.0, 8: 4.0, 16: 6.0}  # by warps; 2 warps wins
    monkeypatch.setattr(ap, "_time", lambda fn, repeats, weights=None, graph=False: fake_us[fn.__defaults__[0].num_warps] * 1e-6)
    attention, elementwise = {}, {}
    opts = ap.AutotuneOptions()
    for kernel, measured in (("decode_merge", attention), ("argmax_merge", elementwise)):
        ap._tune_by_output(kernel, "S=7,M=1", MERGE_CONFIGS, lambda c: torch.ones(3), opts, {}, measured, [])
    linear = {"linear N=8,K=4,M=1": {"chosen": "imma", "us": 1.5, "weight_gb_s": 900.0, "triton_us": 2.5,
                                     "triton_config": "BM=1", "fused": "after_norm", "native_us": {"imma": 1.5}}}  # fmt: skip
    monkeypatch.setattr(bench, "TIMES", {})
    bench.log_autotune("int4", "sm_90: 3 shapes tuned", {"timings": linear, "attention_timings": attention,
                                                          "elementwise_timings": elementwise}, 12.0)  # fmt: skip
    err = capsys.readouterr().err
    assert "int4: autotune 12.0s: sm_90: 3 shapes tuned" in err
    assert "linear N=8,K=4,M=1: imma 1.5 us (900 GB/s of weights; best Triton 2.5 us, BM=1, after its norm); imma 1.5" in err
    for kernel in ("decode_merge", "argmax_merge"):
        assert f"{kernel} S=7,M=1: {{'num_warps': 2}} 2.0 us (default 3.0 us)" in err
    assert bench.TIMES == {"autotune_int4_s": 12.0, "autotune_int4_shapes": linear, "autotune_int4_attention": attention,
                           "autotune_int4_elementwise": elementwise}  # fmt: skip
