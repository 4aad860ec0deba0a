"""The autotune pass and the stored tunings, end to end without a GPU.

The pass's two GPU-only pieces are replaced: the device (the CPU, architecture "interpreter") and
the timer (a fake that ranks configurations by a formula, so the winner is known). Everything else
is real: the shapes the pass finds in the graph, the kernels it assigns (the fused gate/up and the
greedy LM head included), the entries' round trip through the artifact, and the CUDA backend (run
under TRITON_INTERPRET=1) launching the stored configurations with the tokens unchanged.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import numpy as np
import pytest

from mgx.formats import ir
from mgx.formats.artifact import load_artifact, write_artifact
from mgx.kernels.triton import rmsnorm
from mgx.kernels.triton.attention import (
    DECODE_CONFIGS,
    MERGE_CONFIGS,
    PREFILL_CONFIGS,
    DecodeConfig,
    MergeConfig,
    PrefillConfig,
    decode_splits,
)
from mgx.kernels.triton.linear import DequantizeConfig, LinearConfig, SiluMulConfig, dequantize_candidates
from mgx.kernels.triton.lm_head import ArgmaxMergeConfig, merge_candidates
from mgx.kernels.triton.rmsnorm import RMSNormConfig
from mgx.kernels.triton.rmsnorm import candidates as candidates_of_norm
from mgx.kernels.triton.rope import RopeConfig
from mgx.kernels.triton.tuning import candidates, weight_signature
from mgx.passes import PASSES, PassContext, PassError
from mgx.passes import autotune as autotune_pass
from mgx.runtime import backend_cuda
from mgx.runtime.backend_cuda import CUDABackend
from mgx.runtime.batch import SeqChunk
from mgx.runtime.model_runner import ModelRunner

from _backend_testing import compiled
from _tiny_graph import tiny_contents


class _StandIn:
    """Native kernels for the tests that replace what reads them: a build with no marker entries (no
    cuda_tile16 codes, no fp16 scale pairs)."""

    def has(self, name: str) -> bool:
        return False


def fake_seconds(config: Any) -> float:
    """The fake timer's ranking. Linear: narrowest N tile, then the deepest K tile, wins. Attention:
    not the default: decode the narrow tiles on 8 warps, prefill the tallest query tiles, then the
    most stages (the first of equals wins, as in the pass). RMSNorm: the most warps, then the tallest
    row tiles. RoPE: the fewest warps. Dequantize: the tallest tiles, then the most warps. SiLU product:
    the narrowest tiles, then the fewest warps. Argmax merge: the most warps, then the widest tiles. Decode merge: the most warps."""
    if isinstance(config, RMSNormConfig):
        return 1e3 - config.num_warps - config.block_m / 100
    if isinstance(config, MergeConfig):
        return 1e3 - config.num_warps  # the most warps
    if isinstance(config, ArgmaxMergeConfig):
        return 1e3 - config.num_warps - config.block_t / 1e6  # the most warps, then the widest tiles
    if isinstance(config, RopeConfig):
        return 1e3 + config.num_warps  # the fewest warps
    if isinstance(config, DequantizeConfig):
        return 1e3 - config.block_n - config.num_warps / 100  # the tallest tiles, then the most warps
    if isinstance(config, SiluMulConfig):
        return 1e3 + config.block / 1e4 + config.num_warps / 1e6  # the narrowest tiles, then the fewest warps
    if isinstance(config, DecodeConfig):
        return 1e3 - config.num_warps - 1 / config.block_n
    if isinstance(config, PrefillConfig):
        return 1e3 - config.block_m - config.num_stages / 10
    return config.block_n - config.block_k / 1e4


def torch_device_cpu():  # noqa: ANN201
    import torch

    return torch.device("cpu")


def attention_key(graph: ir.Graph) -> str:
    """The shape key (before ``,M=``) of the graph's first attention op, written out here."""
    a = next(o for o in graph.ops if o.kind == "attention").attrs
    return f"Hq={a['num_heads']},Hk={a['num_kv_heads']},D={a['head_dim']}"


def reference_gemv(scale: float = 1.0, calls: list | None = None):  # noqa: ANN201
    """A stand-in for the native GEMV without a GPU: the reference product (times ``scale``); each
    call's (scheme, kind) goes to ``calls``."""
    from mgx.kernels.triton.linear import linear_ref, linear_silu_mul_ref
    from mgx.kernels.triton.rmsnorm import rms_norm_ref

    def gemv(x, w, bias=None, *, kernels, silu_mul=False, out=None, kind="gemv", norm=None):  # noqa: ANN001, ANN202
        if calls is not None:
            calls.append((w.scheme, kind) if norm is None else (w.scheme, kind, "norm"))
        if norm is not None:  # the prologue: x is the residual
            if norm.delta is None:
                x = rms_norm_ref(x, norm.weight, norm.eps)
            else:
                x, total = rms_norm_ref(x, norm.weight, norm.eps, residual=norm.delta)
                norm.total.copy_(total)
        return (scale * (linear_silu_mul_ref if silu_mul else linear_ref)(x, w, bias)).to(x.dtype)

    return gemv


@pytest.fixture
def no_gpu_needed(monkeypatch):  # noqa: ANN001, ANN201
    import torch

    monkeypatch.setattr(autotune_pass, "_device", lambda: (torch.device("cpu"), "interpreter"))
    seen = []

    def timer(fn, repeats, weights=None, graph=False):  # noqa: ANN001, ANN202
        config = fn.__defaults__[0]  # the candidate bound into the timed lambda
        seen.append(config)
        return fake_seconds(config)

    monkeypatch.setattr(autotune_pass, "_time", timer)
    return seen


@pytest.mark.interpreted
def test_autotune_stores_the_fastest_configuration_and_the_backend_uses_it(no_gpu_needed, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    contents = tiny_contents()
    graph = contents.graph
    for name in ("fuse_qkv", "fuse_gate_up", "quantize_w8a16"):
        PASSES[name](graph, {}, PassContext(target="cuda"))
    result = PASSES["autotune"](graph, {"rows": [1, 4], "dtype": "f32", "decode_attention": True, "decode_context": 40}, PassContext(target="cuda"))
    (arch,) = result.stats["autotune"]
    every = result.stats["autotune"][arch]
    assert arch == "interpreter" and no_gpu_needed
    assert {e.kernel for e in every} == {"linear", "linear_silu_mul", "lm_head_argmax", "paged_attention_decode", "rms_norm",
                                         "rope_and_write_kv", "argmax_merge", "embedding_rows"}  # fmt: skip
    # Decode attention for each row count (no prefill chunk of 16+ rows among them), the fake timer's pick.
    attention = [e for e in every if e.kernel == "paged_attention_decode"]
    sig = attention_key(graph)
    assert sorted(e.shape_key for e in attention) == [f"{sig},M=1", f"{sig},M=4"]
    assert all(DecodeConfig(**e.config) == DecodeConfig(32, 8) == min(DECODE_CONFIGS, key=fake_seconds) for e in attention)
    # The RoPE + K/V write before it: the fake timer's pick (the fewest warps), for each row count.
    rope = {e.shape_key: RopeConfig(**e.config) for e in every if e.kernel == "rope_and_write_kv"}
    assert rope == {f"{sig},M=1": RopeConfig(1), f"{sig},M=4": RopeConfig(1)}
    assert sorted(result.stats["attention_timings"]) == sorted(
        [f"{e.kernel} {e.shape_key}" for e in attention] + [f"rope_and_write_kv {k}" for k in rope])
    # The Triton RMSNorm for each norm shape (the first layer's after the embedding, the others with the
    # add before them as a residual) and row count: the fake timer's pick of rmsnorm.candidates.
    norms = {e.shape_key: RMSNormConfig(**e.config) for e in every if e.kernel == "rms_norm"}
    assert norms == {f"F=40,group=40,residual={r},M={m}": min(candidates_of_norm(m, 40, 4), key=fake_seconds)
                     for r in (0, 1) for m in (1, 4)}  # fmt: skip
    assert norms["F=40,group=40,residual=1,M=4"] == RMSNormConfig(4, 8) != candidates_of_norm(4, 40, 4)[0]
    # The greedy head's argmax merge, for the tiles of the head chosen at each row count (no native kind).
    heads = {e.shape_key.rsplit("M=", 1)[1]: LinearConfig(**e.config) for e in every if e.kernel == "lm_head_argmax"}
    merges = {e.shape_key: ArgmaxMergeConfig(**e.config) for e in every if e.kernel == "argmax_merge"}
    tiles = {m: -(-300 // heads[m].block_n) for m in ("1", "4")}
    assert merges == {f"T={tiles[m]},M={m}": min(merge_candidates(tiles[m]), key=fake_seconds) for m in ("1", "4")}
    assert merges[f"T={tiles['1']},M=1"] != ArgmaxMergeConfig()
    # The quantized embedding's row lookup at each row count: the fake timer's pick of its candidates.
    table = CUDABackend(graph, device="cpu", dtype="f32")._weights[id(graph.ops[0])]
    assert graph.ops[0].kind == "embedding" and table.scheme == "w8a16"
    lookups = {e.shape_key: DequantizeConfig(**e.config) for e in every if e.kernel == "embedding_rows"}
    assert lookups == {f"{weight_signature(table)},M={m}": min(dequantize_candidates(table, rows=m), key=fake_seconds)
                       for m in (1, 4)}  # fmt: skip
    assert all(c != dequantize_candidates(table, rows=int(k[-1]))[0] for k, c in lookups.items())  # not the default
    assert sorted(result.stats["elementwise_timings"]) == sorted(
        [f"rms_norm {k}" for k in norms] + [f"argmax_merge {k}" for k in merges] + [f"embedding_rows {k}" for k in lookups])
    entries = [e for e in every if e not in attention
               and e.kernel not in ("rms_norm", "rope_and_write_kv", "argmax_merge", "embedding_rows")]
    # The LM head of sampling steps (a linear entry of the head's weight, N = 300): split K off, as it runs.
    sampling = {e.shape_key.rsplit("M=", 1)[1]: LinearConfig(**e.config) for e in entries
                if e.kernel == "linear" and ",N=300," in e.shape_key}  # fmt: skip
    assert sampling == {str(m): min({dataclasses.replace(c, split_k=1) for c in candidates(m)}, key=fake_seconds)
                        for m in (1, 4)}  # fmt: skip
    assert all(c.split_k == 1 for c in sampling.values())
    entries = [e for e in entries if not (e.kernel == "linear" and ",N=300," in e.shape_key)]
    for e in entries:  # the fastest of the candidates for its row count
        m = int(e.shape_key.rsplit("M=", 1)[1])
        assert m in (1, 4)
        assert LinearConfig(**e.config) == min(candidates(m), key=fake_seconds), e
    # Each distinct (kernel, weight shape) once per row count: q/k/v fused, o, down, gate/up, LM head.
    signatures = {(e.kernel, e.shape_key.rsplit(",M=", 1)[0]) for e in entries}
    assert len(entries) == 2 * len(signatures)
    # The build log's timings: one a stored entry, the winner's (here Triton's) time.
    timings = result.stats["timings"]
    head = [k for k in timings if k.startswith("linear ") and ",N=300," in k]  # the sampling head's two
    assert len(head) == 2 and sorted(timings) == sorted([f"{e.kernel} {e.shape_key}" for e in entries] + head)
    for e in entries:
        t = timings[f"{e.kernel} {e.shape_key}"]
        assert t["chosen"] == "triton"
        assert t["us"] == t["triton_us"] == pytest.approx(fake_seconds(LinearConfig(**e.config)) * 1e6)
        assert t["weight_gb_s"] > 0
        c = LinearConfig(**e.config)
        assert t["triton_config"].startswith(f"{c.block_m}x{c.block_n}x{c.block_k} w{c.num_warps} ")

    contents.autotune = result.stats["autotune"]
    path = tmp_path / "tuned.mgx"
    write_artifact(path, contents)
    stored = load_artifact(path).contents
    assert {a: [(e.kernel, e.shape_key, e.config) for e in es] for a, es in stored.autotune.items()} == {
        arch: [(e.kernel, e.shape_key, e.config) for e in every]
    }

    backend = CUDABackend(stored.graph, device="cpu", dtype="f32")
    assert backend.use_tunings(stored.autotune) == f"{len(every)} stored launch configurations for interpreter"
    used = []
    real_decode = backend_cuda.paged_attention_decode
    monkeypatch.setattr(backend_cuda, "paged_attention_decode", lambda *a, **k: used.append(
        ("decode", (k["block_n"], k["num_warps"]))) or real_decode(*a, **k))  # fmt: skip
    real_rope = backend_cuda.rope_and_write_kv  # prefill: RoPE and the K/V write (decode: in the decode kernel)
    monkeypatch.setattr(backend_cuda, "rope_and_write_kv", lambda *a, **k: used.append(
        ("rope", (a[0].shape[0], k.get("config")))) or real_rope(*a, **k))  # fmt: skip
    real_norm = rmsnorm.rms_norm  # where the native RMSNorm cannot run (none here), the tuned Triton one
    monkeypatch.setattr(rmsnorm, "rms_norm", lambda x, *a, **k: used.append(
        ("rms_norm", (x.shape[0], k.get("residual") is not None, k.get("config")))) or real_norm(x, *a, **k))  # fmt: skip
    for name in ("linear", "linear_silu_mul", "lm_head_argmax"):
        real = getattr(backend_cuda, name)
        monkeypatch.setattr(
            backend_cuda, name, lambda *a, _real=real, _n=name, **k: used.append((_n, k.get("config"))) or _real(*a, **k)
        )
    real_dequantize = backend_cuda.dequantize  # the embedding's row lookup
    monkeypatch.setattr(backend_cuda, "dequantize", lambda w, dtype, **k: used.append(
        ("lookup", (k["rows"].shape[0], k.get("config")))) or real_dequantize(w, dtype, **k))  # fmt: skip
    real_head = backend_cuda.lm_head_argmax
    monkeypatch.setattr(backend_cuda, "lm_head_argmax", lambda *a, **k: used.append(("merge", k.get("merge"))) or real_head(*a, **k))
    runner = ModelRunner(stored.graph, backend)
    want = ModelRunner(stored.graph, "reference")
    prompt = np.array([5, 6, 7, 8, 9])
    got_ids = [runner.step_greedy([SeqChunk(0, prompt)])[0][0][-1]]
    want_ids = [int(np.argmax(want.step([SeqChunk(0, prompt)])[0][-1]))]
    for _ in range(2):  # decode: one row
        got_ids.append(runner.step_greedy([SeqChunk(0, got_ids[-1:])])[0][0][-1])
        want_ids.append(int(np.argmax(want.step([SeqChunk(0, want_ids[-1:])])[0][-1])))
    assert [int(i) for i in got_ids] == want_ids
    greedy_used = len(used)
    # A sampling step (logits, not the greedy head): the LM head on its stored linear entry.
    logits = runner.step([SeqChunk(0, got_ids[-1:])])[0][-1]
    assert int(np.argmax(logits)) == int(np.argmax(want.step([SeqChunk(0, got_ids[-1:])])[0][-1]))
    assert ("linear", sampling["1"]) in used[greedy_used:]
    assert {n for n, _ in used} == {"linear", "linear_silu_mul", "lm_head_argmax", "decode", "rms_norm", "rope", "merge",
                                    "lookup"}  # fmt: skip
    rows = weight_signature(table)  # the prompt's 5 tokens on M=4's entry (the largest), each later token on M=1's
    assert [c for n, c in used if n == "lookup"] == [(5, lookups[f"{rows},M=4"])] + [(1, lookups[f"{rows},M=1"])] * 3
    assert {c for n, c in used if n == "merge"} == {merges[f"T={tiles['1']},M=1"]}  # one row a step's head
    assert {c for n, c in used if n == "rope"} == {(5, RopeConfig(1))}  # the prompt's 5 tokens: M=4's entry
    assert {c for n, c in used if n == "decode"} == {(32, 8)}  # the stored decode attention configuration
    # Each norm launch took its shape's entry of the nearest tuned row count (the prompt's 5 rows: M=4's).
    assert {c for n, c in used if n == "rms_norm"} == {
        (t, r, norms[f"F=40,group=40,residual={int(r)},M={min(t, 4)}"]) for t in (5, 1) for r in (False, True)}
    assert all(c is not None for _, c in used)  # every launch took a stored configuration
    assert {c.block_m for n, c in used if n == "linear"} == {1, 16}  # GEMV for decode, tiles for 5 rows


def test_autotune_refuses_other_targets_and_hosts_without_a_gpu() -> None:
    graph = compiled("gqa", "dense")
    with pytest.raises(PassError, match="set target: cuda"):
        PASSES["autotune"](graph, {}, PassContext(target="cpu"))
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(PassError, match="no CUDA device"):
            PASSES["autotune"](graph, {}, PassContext(target="cuda"))
    with pytest.raises(PassError, match="rows"):
        PASSES["autotune"](graph, {"rows": [0]}, PassContext(target="cuda"))
    from mgx.passes.autotune import AutotuneOptions

    assert AutotuneOptions(rows=(16, 1, 16, 4)).rows == (1, 4, 16)  # each row count once, ascending


def test_tunings_pick_the_nearest_row_count_of_the_same_regime() -> None:
    from mgx.formats.artifact import AutotuneEntry
    from mgx.kernels.triton.testing import make_weight
    from mgx.kernels.triton.tuning import Tunings, config_dict, shape_key

    w = make_weight("none", 64, 32)
    gemv, small, big = LinearConfig(1, 8, 256, 4, 1), LinearConfig(16, 64, 128, 4, 4), LinearConfig(64, 64, 64, 4, 4)
    t = Tunings([AutotuneEntry("linear", shape_key(w, m), config_dict(c)) for m, c in ((1, gemv), (8, small), (64, big))])
    assert t.config("linear", w, 1) == gemv
    assert t.config("linear", w, 2) == small and t.config("linear", w, 8) == small
    assert t.config("linear", w, 9) == big and t.config("linear", w, 5000) == big
    assert t.config("linear_silu_mul", w, 1) is None
    assert t.config("linear", make_weight("none", 64, 48), 1) is None


def test_tunings_take_attention_entries_checked_and_by_the_nearest_row_count() -> None:
    from mgx.formats.artifact import AutotuneEntry
    from mgx.kernels.triton.tuning import Tunings

    sig = "Hq=4,Hk=2,D=16"
    t = Tunings([AutotuneEntry("paged_attention_decode", f"{sig},M=1", {"block_n": 32, "num_warps": 8}),
                 AutotuneEntry("paged_attention_decode", f"{sig},M=8", {"block_n": 64, "num_warps": 4}),
                 AutotuneEntry("paged_attention_prefill", f"{sig},M=2048",
                               {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 3})])  # fmt: skip
    assert len(t) == 3
    assert t.lookup("paged_attention_decode", sig, 1) == DecodeConfig(32, 8)
    assert t.lookup("paged_attention_decode", sig, 2) == DecodeConfig(64, 4) == t.lookup("paged_attention_decode", sig, 300)
    assert t.lookup("paged_attention_prefill", sig, 17) == PrefillConfig(128, 64, 8, 3)
    assert t.lookup("paged_attention_decode", "Hq=4,Hk=4,D=16", 1) is None
    with pytest.raises(ValueError, match="'linear' 'N=4,M=1': .*unexpected keyword"):
        Tunings([AutotuneEntry("linear", "N=4,M=1", {"block_m": 1, "tile": 8})])
    newer = Tunings([AutotuneEntry("some_future_kernel", f"{sig},M=1", {"x": 1}),
                     AutotuneEntry("paged_attention_decode", f"{sig},M=1", {"block_n": 32, "num_warps": 8})])  # fmt: skip
    assert newer.unknown == ["some_future_kernel"] and len(newer) == 1
    for config, says in (({"block_n": 48, "num_warps": 4}, "block_n 48 is not one of"),
                         ({"block_n": 64, "warps": 4}, "unexpected keyword"),
                         ({"block_n": 64, "num_warps": 6}, "powers of two"),
                         ({"block_n": 64, "num_warps": "4"}, "positive integers")):  # fmt: skip
        with pytest.raises(ValueError, match=says):
            Tunings([AutotuneEntry("paged_attention_decode", f"{sig},M=1", config)])


def test_tunings_take_rms_norm_entries_checked_and_by_the_nearest_row_count() -> None:
    from mgx.formats.artifact import AutotuneEntry
    from mgx.kernels.triton.tuning import Tunings

    sig = "F=4096,group=4096,residual=1"
    t = Tunings([AutotuneEntry("rms_norm", f"{sig},M=1", {"block_m": 1, "num_warps": 4, "per_sm": 0}),
                 AutotuneEntry("rms_norm", f"{sig},M=2048", {"block_m": 2, "num_warps": 2, "per_sm": 4}),
                 AutotuneEntry("rms_norm", "F=1024,group=128,residual=0,M=1", {"block_m": 8, "num_warps": 1})])  # fmt: skip
    assert len(t) == 3
    assert t.rms_norm(4096, 4096, True, 1) == RMSNormConfig(1, 4)
    assert t.rms_norm(4096, 4096, True, 2) == RMSNormConfig(2, 2, 4) == t.rms_norm(4096, 4096, True, 9000)
    assert t.rms_norm(1024, 128, False, 7) == RMSNormConfig(8, 1)
    assert t.rms_norm(4096, 4096, False, 1) is None and t.rms_norm(1024, 1024, False, 1) is None
    assert Tunings().rms_norm(4096, 4096, True, 1) is None
    for key, config, says in (("F=4096,group=4096,M=1", {"block_m": 1, "num_warps": 4}, "is not F=<width>"),
                              ("F=4096,group=4096,residual=2,M=1", {"block_m": 1, "num_warps": 4}, "is not F=<width>"),
                              ("F=x,group=4096,residual=1,M=1", {"block_m": 1, "num_warps": 4}, "is not F=<width>"),
                              (f"{sig},M=1", {"block_m": 3, "num_warps": 4}, "powers of two"),
                              (f"{sig},M=1", {"block_m": 1, "num_warps": 4, "per_sm": -1}, "positive integers"),
                              (f"{sig},M=1", {"block_m": 1, "num_warps": True}, "positive integers"),
                              (f"{sig},M=1", {"block_m": 1, "warps": 4}, "unexpected keyword")):  # fmt: skip
        with pytest.raises(ValueError, match=says):
            Tunings([AutotuneEntry("rms_norm", key, config)])


@pytest.mark.interpreted
def test_autotune_checks_rope_candidates_on_fresh_copies_and_rejects_a_wrong_one(no_gpu_needed, monkeypatch) -> None:  # noqa: ANN001
    """The timed RoPE launches rotate q and k in place; each candidate is checked on fresh copies and
    zeroed caches, so a right one agrees after the default's timed launches have run, and one that
    leaves the last token's V out of the cache is reported, never stored."""
    from mgx.kernels.triton import rope

    real = rope.rope_and_write_kv

    def loses_a_token_on_8_warps(q, k, v, *a, config=None, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        v = v.clone()
        if config is not None and config.num_warps == 8:
            v[-1] = 0  # the last token's V reaches the cache as zeros
        return real(q, k, v, *a, config=config, **kw)

    monkeypatch.setattr(rope, "rope_and_write_kv", loses_a_token_on_8_warps)

    def runs_them(fn, repeats, weights=None, graph=False):  # noqa: ANN001, ANN202
        for _ in range(3):  # as a real timer does: the launches change q and k in place
            fn()
        return fake_seconds(fn.__defaults__[0])

    monkeypatch.setattr(autotune_pass, "_time", runs_them)
    options = {"rows": [1, 16], "dtype": "f32", "prefill_attention": False, "rms_norm": False}
    graph = tiny_contents().graph
    result = PASSES["autotune"](graph, options, PassContext(target="cuda"))
    rope_entries = {e.shape_key: RopeConfig(**e.config) for e in result.stats["autotune"]["interpreter"]
                    if e.kernel == "rope_and_write_kv"}  # fmt: skip
    sig = attention_key(graph)
    assert rope_entries == {f"{sig},M=1": RopeConfig(1), f"{sig},M=16": RopeConfig(1)}
    assert "2 configurations could not run" in result.summary
    # M=1 and M=16 (one "2x" where their errors happen to be equal)
    wrong = re.findall(r"(\d+)x rope_and_write_kv RopeConfig\(num_warps=8\) gave other results", result.summary)
    assert sum(map(int, wrong)) == 2, result.summary
    timings = result.stats["attention_timings"]
    assert sorted(timings) == [f"rope_and_write_kv {sig},M=1", f"rope_and_write_kv {sig},M=16"]


def test_tunings_take_rope_entries_by_the_nearest_row_count() -> None:
    from mgx.formats.artifact import AutotuneEntry
    from mgx.kernels.triton.tuning import ROPE_KV, Tunings

    sig = "Hq=32,Hk=8,D=128"
    t = Tunings([AutotuneEntry(ROPE_KV, f"{sig},M=16", {"num_warps": 2}),
                 AutotuneEntry(ROPE_KV, f"{sig},M=2048", {"num_warps": 8})])  # fmt: skip
    assert t.lookup(ROPE_KV, sig, 1) == RopeConfig(2) and t.lookup(ROPE_KV, sig, 17) == RopeConfig(8)
    assert t.lookup(ROPE_KV, "Hq=32,Hk=4,D=128", 16) is None
    for config, says in (({"num_warps": 3}, "powers of two"), ({"num_warps": 0}, "positive integers"),
                         ({"warps": 2}, "unexpected keyword")):  # fmt: skip
        with pytest.raises(ValueError, match=says):
            Tunings([AutotuneEntry(ROPE_KV, f"{sig},M=16", config)])


@pytest.mark.interpreted
def test_autotune_tunes_the_silu_product_after_dense_gate_up_products_and_the_backend_uses_it(
        no_gpu_needed, monkeypatch) -> None:  # noqa: ANN001
    """Dense weights run several rows on cuBLAS: no Triton GEMM entry for them, but the SiLU product after
    the fused gate/up gets one per row count, and a prompt's step launches it."""
    from mgx.kernels.triton.linear import silu_mul_candidates

    contents = tiny_contents(fused=True)
    result = PASSES["autotune"](contents.graph, {"rows": [1, 4], "dtype": "f32", "prefill_attention": False},
                                PassContext(target="cuda"))  # fmt: skip
    every = result.stats["autotune"]["interpreter"]
    assert not [e for e in every if e.kernel.startswith("linear") and e.shape_key.endswith(",M=4")]
    silu = {e.shape_key: SiluMulConfig(**e.config) for e in every if e.kernel == "silu_mul"}
    assert silu == {"F=36,M=4": min(silu_mul_candidates(36), key=fake_seconds)} and silu["F=36,M=4"] == SiluMulConfig(64, 1)
    assert "silu_mul F=36,M=4" in result.stats["elementwise_timings"]
    backend = CUDABackend(contents.graph, device="cpu", dtype="f32")
    backend.use_tunings(result.stats["autotune"])
    used = []
    real = backend_cuda.silu_mul
    monkeypatch.setattr(backend_cuda, "silu_mul", lambda x, **k: used.append((x.shape[0], k.get("config"))) or real(x, **k))
    runner, want = ModelRunner(contents.graph, backend), ModelRunner(contents.graph, "reference")
    prompt = np.array([5, 6, 7, 8, 9])
    assert int(runner.step_greedy([SeqChunk(0, prompt)])[0][0][-1]) == int(np.argmax(want.step([SeqChunk(0, prompt)])[0][-1]))
    assert set(used) == {(5, SiluMulConfig(64, 1))}  # both layers' gate/up, 5 rows: the M=4 entry


@pytest.mark.interpreted
def test_autotune_tunes_dequantize_once_per_weight_where_quantized_products_go_dense(no_gpu_needed, monkeypatch) -> None:  # noqa: ANN001
    """From DEQUANTIZE_MIN_M rows a quantized weight is dequantized for cuBLAS: autotune times no Triton
    GEMM there, tunes dequantize once per weight (and the SiLU product at that row count), and the
    backend's dense product dequantizes with the stored configuration, giving the reference's product."""
    import torch

    from mgx.kernels.triton.linear import DEQUANTIZE_MIN_M, dequantize_candidates, linear_ref
    from mgx.kernels.triton.tuning import weight_signature

    contents = tiny_contents(fused=True)
    PASSES["quantize_w8a16"](contents.graph, {}, PassContext(target="cuda"))
    rows = [1, DEQUANTIZE_MIN_M, 2 * DEQUANTIZE_MIN_M]
    result = PASSES["autotune"](contents.graph, {"rows": rows, "dtype": "f32", "prefill_attention": False,
                                                 "rms_norm": False, "rope": False}, PassContext(target="cuda"))  # fmt: skip
    every = result.stats["autotune"]["interpreter"]
    # (The LM head, N = 300, keeps its entries: quantized, it never goes to cuBLAS.)
    assert not [e for e in every if e.kernel.startswith("linear") and not e.shape_key.endswith(",M=1")
                and ",N=300," not in e.shape_key]  # fmt: skip
    backend = CUDABackend(contents.graph, device="cpu", dtype="f32")
    quantized = {weight_signature(backend._weights[id(op)]): backend._weights[id(op)] for op in contents.graph.ops
                 if op.kind == "linear"}  # fmt: skip
    deq = {e.shape_key.rpartition(",M=")[0]: DequantizeConfig(**e.config) for e in every if e.kernel == "dequantize"}
    assert {e.shape_key.rpartition(",M=")[2] for e in every if e.kernel == "dequantize"} == {str(DEQUANTIZE_MIN_M)}
    assert deq == {sig: min(dequantize_candidates(w), key=fake_seconds) for sig, w in quantized.items()}
    assert all(c != dequantize_candidates(quantized[sig])[0] for sig, c in deq.items())
    assert {e.shape_key for e in every if e.kernel == "silu_mul"} == {f"F=36,M={m}" for m in rows[1:]}
    backend.use_tunings(result.stats["autotune"])
    used = []
    real = backend_cuda.dequantize
    monkeypatch.setattr(backend_cuda, "dequantize", lambda w, d, **k: used.append(k.get("config")) or real(w, d, **k))
    op = next(o for o in contents.graph.ops if o.kind == "linear" and o.outputs[0].endswith("o_proj"))
    w = backend._weights[id(op)]
    x = torch.randn(DEQUANTIZE_MIN_M + 3, w.k)
    got = backend.linear(op, x)
    assert used == [deq[weight_signature(w)]]
    torch.testing.assert_close(got, linear_ref(x, w), rtol=1e-4, atol=1e-4)


def test_a_stored_dequantize_tile_that_splits_the_weights_groups_is_refused_at_load() -> None:
    """A dequantize or embedding_rows entry whose K tile would split a quantized weight's int4 groups (an edited or
    foreign artifact) is refused when the backend takes the tunings, naming the weight, not in the
    first long prefill; whole groups are taken."""
    from mgx.formats.artifact import AutotuneEntry
    from mgx.kernels.triton.tuning import weight_signature
    from mgx.runtime.errors import UnsupportedModelError

    contents = tiny_contents(hidden_size=64, intermediate_size=64, num_heads=4, head_dim=16)
    PASSES["quantize_int4"](contents.graph, {"group_size": 32}, PassContext(target="cuda"))
    backend = CUDABackend(contents.graph, device="cpu", dtype="f32")
    w = next(w for w in backend._weights.values() if w.scheme == "int4")
    key = f"{weight_signature(w)},M=256"
    assert "1 stored" in backend.use_tunings({"interpreter": [AutotuneEntry("dequantize", key, {"block_n": 8, "block_k": 32})]})
    with pytest.raises(UnsupportedModelError, match=r"stored tunings for interpreter: dequantize of scheme=int4.*K tiles of 16, "
                                                     r"which split its groups of 32"):  # fmt: skip
        backend.use_tunings({"interpreter": [AutotuneEntry("dequantize", key, {"block_n": 8, "block_k": 16})]})
    table = backend._weights[id(contents.graph.ops[0])]  # the embedding's row lookup likewise
    assert table.scheme == "int4"
    key = f"{weight_signature(table)},M=4"
    assert "1 stored" in backend.use_tunings({"interpreter": [AutotuneEntry("embedding_rows", key, {"block_n": 4, "block_k": 32})]})
    with pytest.raises(UnsupportedModelError, match=r"embedding_rows of scheme=int4.*K tiles of 16, which split"):
        backend.use_tunings({"interpreter": [AutotuneEntry("embedding_rows", key, {"block_n": 4, "block_k": 16})]})


def test_a_norm_candidate_wrong_in_one_row_of_thousands_is_told_apart() -> None:
    """The RMSNorm check compares element by element: one wrong row of 4,096 is within the attention
    check's tolerance of the whole, not within the norm check's; bf16 rounding of the same values
    (what another reduction order gives) is within both."""
    import torch

    want = torch.randn(4096, 64, generator=torch.Generator().manual_seed(0))
    wrong = want.clone()
    wrong[-1] = 0
    assert autotune_pass.relative_error(wrong, want) <= autotune_pass.ATTENTION_TOLERANCE
    assert autotune_pass.elementwise_error(wrong, want) > autotune_pass.ELEMENTWISE_TOLERANCE
    rounded = want.bfloat16().float()
    assert autotune_pass.elementwise_error(rounded, want) <= autotune_pass.ELEMENTWISE_TOLERANCE
    assert autotune_pass.relative_error(rounded, want) <= autotune_pass.ATTENTION_TOLERANCE
    assert not autotune_pass.elementwise_error(want * float("nan"), want) <= autotune_pass.ELEMENTWISE_TOLERANCE  # NaN: refused


@pytest.mark.interpreted
def test_autotune_tunes_grouped_norms_and_never_stores_a_norm_configuration_that_gives_other_results(
        no_gpu_needed, monkeypatch) -> None:  # noqa: ANN001
    """q/k norms (groups of head_dim over the heads' width) are tuned at their own signature, with the
    kernel rows of all their heads; a candidate whose output differs from the default's is reported and
    never stored."""
    from mgx.kernels.triton._common import num_sms

    real = rmsnorm.rms_norm

    def wrong_on_2_warps(*a, **k):  # noqa: ANN002, ANN003, ANN202
        out = real(*a, **k)
        if k["config"] is None or k["config"].num_warps != 2:
            return out
        return (out[0] * 0, out[1]) if isinstance(out, tuple) else out * 0

    monkeypatch.setattr(rmsnorm, "rms_norm", wrong_on_2_warps)
    graph = tiny_contents(qk_norm=True).graph
    result = PASSES["autotune"](graph, {"rows": [2], "dtype": "f32", "prefill_attention": False}, PassContext(target="cuda"))
    norms = {e.shape_key: RMSNormConfig(**e.config) for e in result.stats["autotune"]["interpreter"] if e.kernel == "rms_norm"}
    q, k = 6 * 8, 2 * 8  # the query and key widths: 6 and 2 heads of 8
    assert sorted(norms) == sorted(f"F={f},group={g},residual={r},M=2" for f, g, r in
                                   ((40, 40, 0), (40, 40, 1), (q, 8, 0), (k, 8, 0)))  # fmt: skip
    rejected = 0
    for f, g, r in ((40, 40, 0), (40, 40, 1), (q, 8, 0), (k, 8, 0)):
        found = candidates_of_norm(2 * (f // g), g, num_sms(torch_device_cpu()))
        assert found[0].num_warps != 2  # the default, which the others must agree with
        agree = [c for c in found if c.num_warps != 2]
        assert norms[f"F={f},group={g},residual={r},M=2"] == min(agree, key=fake_seconds)
        rejected += len(found) - len(agree)
    assert rejected and f"{rejected} configurations could not run" in result.summary
    assert "rms_norm RMSNormConfig(block_m=" in result.summary and "num_warps=2, per_sm=0) gave other results" in result.summary


@pytest.mark.interpreted
def test_autotune_tunes_prefill_attention_and_the_backend_runs_a_continued_prompt_with_it(no_gpu_needed, monkeypatch) -> None:  # noqa: ANN001
    """By default chunks of 16+ rows get a prefill entry, decode none; the backend's paged prefill (a prompt continued after
    its first chunk: cached tokens before the new ones) launches the entry of the nearest tuned row
    count at or above the chunk's, and the tokens are the reference's."""
    contents = tiny_contents()
    result = PASSES["autotune"](contents.graph, {"rows": [1, 16, 32], "dtype": "f32"},
                                PassContext(target="cuda"))  # fmt: skip
    entries = result.stats["autotune"]["interpreter"]
    prefill = {e.shape_key.rsplit(",M=", 1)[1]: PrefillConfig(**e.config) for e in entries if e.kernel == "paged_attention_prefill"}
    best = min(PREFILL_CONFIGS, key=fake_seconds)
    assert prefill == {"16": best, "32": best} and best != PREFILL_CONFIGS[0]
    assert not [e for e in entries if e.kernel == "paged_attention_decode"]  # decode_attention is off by default
    timings = result.stats["attention_timings"]
    assert all(t["chosen"] == dataclasses.asdict(best) and t["us"] < t["default_us"]
               for k, t in timings.items() if k.startswith("paged_attention_prefill"))  # fmt: skip

    backend = CUDABackend(contents.graph, device="cpu", dtype="f32")
    backend.use_tunings(result.stats["autotune"])
    backend._sdpa_modes = []  # fresh prompts through the paged kernel too, as where SDPA refuses them
    used = []
    real = backend_cuda.paged_attention_prefill
    monkeypatch.setattr(backend_cuda, "paged_attention_prefill", lambda *a, **k: used.append(
        (k["max_query_len"], k.get("block_m"), k.get("num_stages"))) or real(*a, **k))  # fmt: skip
    runner, want = ModelRunner(contents.graph, backend), ModelRunner(contents.graph, "reference")
    prompt = np.arange(5, 45)
    got = [runner.step_greedy([SeqChunk(0, prompt[:20])])[0][0][-1], runner.step_greedy([SeqChunk(0, prompt[20:])])[0][0][-1]]
    logits = [want.step([SeqChunk(0, prompt[:20])])[0][-1], want.step([SeqChunk(0, prompt[20:])])[0][-1]]
    assert [int(i) for i in got] == [int(np.argmax(x)) for x in logits]
    assert used and {(bm, st) for _, bm, st in used} == {(best.block_m, best.num_stages)}
    assert {m for m, _, _ in used} == {20}  # both chunks' 20 rows: the M=32 entry


@pytest.mark.interpreted
def test_autotune_never_stores_an_attention_configuration_that_gives_other_results(no_gpu_needed, monkeypatch) -> None:  # noqa: ANN001
    from mgx.kernels.triton import attention

    real = attention.paged_attention_decode

    def wrong_on_8_warps(*a, **k):  # noqa: ANN002, ANN003, ANN202
        out = real(*a, **k)
        return out * 0 if k.get("num_warps") == 8 else out

    monkeypatch.setattr(attention, "paged_attention_decode", wrong_on_8_warps)
    result = PASSES["autotune"](tiny_contents().graph, {"rows": [1], "dtype": "f32", "decode_attention": True, "decode_context": 24},
                                PassContext(target="cuda"))  # fmt: skip
    (decode,) = [e for e in result.stats["autotune"]["interpreter"] if e.kernel == "paged_attention_decode"]
    assert DecodeConfig(**decode.config) == DecodeConfig(32, 4)  # the fake timer's best of those that agree
    assert "2 configurations could not run" in result.summary
    for n in (64, 32):
        assert f"paged_attention_decode DecodeConfig(block_n={n}, num_warps=8) gave other results" in result.summary


@pytest.mark.interpreted
def test_autotune_checks_prefill_candidates_with_the_layers_sliding_window(no_gpu_needed, monkeypatch) -> None:  # noqa: ANN001
    """A prefill configuration that computes wrong only with a sliding window (as 32-row tiles once did
    on the H200) is rejected for a model whose layers have one."""
    from mgx.kernels.triton import attention

    real = attention.paged_attention_prefill

    def wrong_with_a_window(*a, **k):  # noqa: ANN002, ANN003, ANN202
        out = real(*a, **k)
        return out * 0 if k.get("sliding_window") and k.get("block_m") == 128 else out

    monkeypatch.setattr(attention, "paged_attention_prefill", wrong_with_a_window)
    for window, rejected in ((0, 0), (8, 3)):  # three of PREFILL_CONFIGS have 128-row tiles
        result = PASSES["autotune"](tiny_contents(sliding_window=window).graph, {"rows": [16], "dtype": "f32"},
                                    PassContext(target="cuda"))  # fmt: skip
        (prefill,) = [e for e in result.stats["autotune"]["interpreter"] if e.kernel == "paged_attention_prefill"]
        got = PrefillConfig(**prefill.config)
        assert got == min((c for c in PREFILL_CONFIGS if window == 0 or c.block_m != 128), key=fake_seconds), window
        assert result.summary.count("gave other results") == rejected


@pytest.mark.interpreted
def test_autotune_stores_no_attention_entry_where_the_default_configuration_cannot_run(no_gpu_needed, monkeypatch) -> None:  # noqa: ANN001
    from mgx.kernels.triton import attention

    def out_of_memory(*a, **k):  # noqa: ANN002, ANN003, ANN202
        raise RuntimeError("out of resource: shared memory\nmore detail")

    monkeypatch.setattr(attention, "paged_attention_prefill", out_of_memory)
    result = PASSES["autotune"](tiny_contents().graph, {"rows": [16], "dtype": "f32"}, PassContext(target="cuda"))
    assert not [e for e in result.stats["autotune"]["interpreter"] if e.kernel.startswith("paged_attention")]
    assert "paged_attention_prefill default PrefillConfig(block_m=64" in result.summary
    assert "RuntimeError: out of resource: shared memory)" in result.summary and "more detail" not in result.summary


def test_decode_tile_width_pinned_by_the_environment_overrides_a_stored_one(monkeypatch) -> None:  # noqa: ANN001
    from mgx.formats.artifact import AutotuneEntry

    graph = tiny_contents().graph
    sig = attention_key(graph)
    stored = {"interpreter": [AutotuneEntry("paged_attention_decode", f"{sig},M=4", {"block_n": 32, "num_warps": 8})]}
    for env, want in (("", DecodeConfig(32, 8)), ("0", DecodeConfig(64, 8)), ("1", DecodeConfig(32, 8))):
        monkeypatch.setenv("MGX_CUDA_DECODE_NARROW", env)
        backend = CUDABackend(graph, device="cpu", dtype="f32")
        assert backend._decode_config(4) == DecodeConfig(32 if env == "1" else 64, 4)  # untuned: the defaults but a pin
        backend.use_tunings(stored)
        assert backend._decode_config(2) == want and backend._decode_config(64) == want, env
    newer = {"interpreter": [*stored["interpreter"], AutotuneEntry("some_future_kernel", "M=1", {})]}
    assert CUDABackend(graph, device="cpu", dtype="f32").use_tunings(newer) == (
        "1 stored launch configurations for interpreter; 1 entries of kernels this runtime does not know skipped "
        "(some_future_kernel)")


@pytest.mark.interpreted
def test_autotune_times_the_native_gemv_and_the_backend_follows_its_choice(no_gpu_needed, monkeypatch) -> None:  # noqa: ANN001
    """With native kernels at hand the pass also times the native GEMV at one row and marks the entry
    ``native`` where it wins (keeping the best Triton configuration as the fallback); the backend then
    runs the native GEMV exactly for those entries. Here the fake timer lets it win the plain linears
    and lose the fused gate/up; the native GEMV is stood in for by the reference product (no GPU)."""
    from mgx.kernels.cuda import gemv as cg

    kernels = _StandIn()
    monkeypatch.setattr(autotune_pass, "_native_kernels", lambda graph: kernels)
    # Only the CUDA-core kind applies here (the tensor-core one needs groups of 128).
    monkeypatch.setattr(cg, "gemv_applies", lambda k, x, w, bias=None, kind="gemv", norm=None, argmax=False: k is kernels
                        and x.shape[0] == 1 and kind == "gemv" and not argmax)  # fmt: skip
    monkeypatch.setattr(cg, "gemv", reference_gemv())
    timer = autotune_pass._time

    def native_wins_unfused(fn, repeats, weights=None, graph=False):  # noqa: ANN001, ANN202
        config = fn.__defaults__[0]
        if config.native:
            silu = fn.__defaults__[3]
            return -1.0 if not silu else 1e9
        return timer(fn, repeats, weights)

    monkeypatch.setattr(autotune_pass, "_time", native_wins_unfused)
    contents = tiny_contents()
    graph = contents.graph
    for name in ("fuse_qkv", "fuse_gate_up", "quantize_w8a16"):
        PASSES[name](graph, {}, PassContext(target="cuda"))
    result = PASSES["autotune"](graph, {"rows": [1, 4], "prefill_attention": False, "sampling_head": False, "argmax_merge": False, "dtype": "f32"}, PassContext(target="cuda"))
    entries = next(iter(result.stats["autotune"].values()))
    natives = {(e.kernel, e.shape_key.rsplit("M=", 1)[1], e.config["native"]) for e in entries if e.config.get("native")}
    assert natives == {("linear", "1", "gemv")}
    for e in entries:  # the Triton fallback is the fastest Triton configuration either way
        m = int(e.shape_key.rsplit("M=", 1)[1])
        fallback = LinearConfig(**{**e.config, "native": ""})
        assert fallback == min(candidates(m), key=fake_seconds)
    timings = result.stats["timings"]  # a native winner's time, beside the best Triton one it beat
    for e in entries:
        t = timings[f"{e.kernel} {e.shape_key}"]
        assert t["chosen"] == (e.config["native"] or "triton")
        assert t["triton_us"] == pytest.approx(fake_seconds(LinearConfig(**{**e.config, "native": ""})) * 1e6)
        assert t["us"] == (-1e6 if e.config["native"] else pytest.approx(t["triton_us"]))
    chosen = [f"{e.config['native']} for {e.kernel} {e.shape_key}" for e in entries if e.config["native"]]
    assert f"native GEMV chosen for {len(chosen)} ({', '.join(chosen)})" in result.summary

    monkeypatch.setenv("MGX_CUDA_NORM_GEMV", "1")  # and the add + RMSNorm in the prologue where it runs
    backend = CUDABackend(graph, device="cpu", dtype="f32")
    backend.use_tunings(result.stats["autotune"])
    backend.cuda_kernels = kernels
    ran: list[tuple[str, int]] = []
    monkeypatch.setattr(backend_cuda, "gemv_applies", cg.gemv_applies)
    monkeypatch.setattr(backend_cuda, "gemv", lambda x, w, *a, **k: ran.append(("native" if k.get("norm") is None else "native+norm", w.n))
                        or cg.gemv(x, w, *a, **k))  # fmt: skip
    real = backend_cuda.linear_silu_mul
    monkeypatch.setattr(backend_cuda, "linear_silu_mul", lambda x, w, *a, **k: ran.append(("triton silu", w.n)) or real(x, w, *a, **k))
    runner, want = ModelRunner(graph, backend), ModelRunner(graph, "reference")
    prompt = np.array([5, 6, 7, 8, 9])
    got_ids = [runner.step_greedy([SeqChunk(0, prompt)])[0][0][-1]]
    want_ids = [int(np.argmax(want.step([SeqChunk(0, prompt)])[0][-1]))]
    assert ran and all(k == "triton silu" for k, _ in ran)  # five rows: Triton tiles, never the GEMV
    ran.clear()
    got_ids.append(runner.step_greedy([SeqChunk(0, got_ids[-1:])])[0][0][-1])
    want_ids.append(int(np.argmax(want.step([SeqChunk(0, want_ids[-1:])])[0][-1])))
    assert [int(i) for i in got_ids] == want_ids
    layers = sum(op.kind == "attention" for op in graph.ops)
    assert sum(k.startswith("native") for k, _ in ran) == 3 * layers  # the decode row: qkv, o and down of each layer
    # The qkv projections after a residual add (all but the first layer's) with the add + norm in the prologue.
    assert sum(k == "native+norm" for k, _ in ran) == layers - 1
    assert sum(k == "triton silu" for k, _ in ran) == layers  # the fused gate/up stays on Triton


@pytest.mark.interpreted
@pytest.mark.parametrize("wrong", [False, True])
def test_autotune_times_the_native_greedy_lm_head_and_the_backend_follows_it(no_gpu_needed, monkeypatch, wrong: bool) -> None:  # noqa: ANN001
    """At one row the LM head's native kinds (``gemv_argmax``: the imma kinds' greedy entries) are
    checked and timed like the projections': one that picks the Triton kernel's token with its logit
    and wins the (fake) timer is stored, and the backend's greedy head runs it, the tokens staying the
    reference's. One that picks another token is rejected and named however fast it is. (The native
    kernel is stood in for by the fp32 reference; no GPU.)"""
    from mgx.kernels.cuda import gemv as cg
    from mgx.kernels.triton.lm_head import lm_head_argmax_ref

    kernels = _StandIn()
    monkeypatch.setattr(autotune_pass, "_native_kernels", lambda graph: kernels)
    monkeypatch.setattr(cg, "gemv_applies", lambda k, x, w, bias=None, kind="gemv", norm=None, argmax=False: k is kernels
                        and x.shape[0] == 1 and argmax and kind == "imma_w4")  # fmt: skip
    ran: list[str] = []

    merged: list[ArgmaxMergeConfig | None] = []

    def greedy(x, w, bias=None, *, kernels, kind, merge=None):  # noqa: ANN001, ANN202
        ran.append(kind)
        merged.append(merge)
        ids, vals = lm_head_argmax_ref(x, w, bias)
        return (ids + 1 if wrong else ids), vals

    monkeypatch.setattr(cg, "gemv_argmax", greedy)
    timer = autotune_pass._time
    monkeypatch.setattr(autotune_pass, "_time", lambda fn, r, ws=None, graph=False: -1.0 if getattr(
        fn.__defaults__[0], "native", "") else timer(fn, r, ws, graph))  # fmt: skip
    graph = tiny_contents().graph
    for name in ("fuse_qkv", "fuse_gate_up"):
        PASSES[name](graph, {}, PassContext(target="cuda"))
    result = PASSES["autotune"](graph, {"rows": [1, 4], "prefill_attention": False, "dtype": "f32"}, PassContext(target="cuda"))
    entries = next(iter(result.stats["autotune"].values()))
    natives = {(e.kernel, e.shape_key.rsplit("M=", 1)[1], e.config["native"]) for e in entries if e.config.get("native")}
    assert natives == (set() if wrong else {("lm_head_argmax", "1", "imma_w4")})
    assert ("native GEMV rejected (wrong results) for imma_w4 " in result.summary) == wrong
    assert ("(another token than the Triton head's)" in result.summary) == wrong
    assert ran == ["imma_w4"]  # its check against the Triton head (the fake timer runs nothing)
    # The merge tuned for the tiles the chosen head leaves: the native kind's groups of 16 rows.
    merges = {e.shape_key: ArgmaxMergeConfig(**e.config) for e in entries if e.kernel == "argmax_merge"}
    assert (f"T={-(-300 // 16)},M=1" in merges) != wrong and len(merges) == 2, merges

    backend = CUDABackend(graph, device="cpu", dtype="f32")
    backend.use_tunings(result.stats["autotune"])
    backend.cuda_kernels = kernels
    monkeypatch.setattr(backend_cuda, "gemv_applies", cg.gemv_applies)
    monkeypatch.setattr(backend_cuda, "gemv_argmax", greedy)
    ran.clear()
    runner, want = ModelRunner(graph, backend), ModelRunner(graph, "reference")
    prompt = np.array([5, 6, 7, 8, 9])
    got_ids = [runner.step_greedy([SeqChunk(0, prompt)])[0][0][-1]]
    want_ids = [int(np.argmax(want.step([SeqChunk(0, prompt)])[0][-1]))]
    got_ids.append(runner.step_greedy([SeqChunk(0, got_ids[-1:])])[0][0][-1])
    want_ids.append(int(np.argmax(want.step([SeqChunk(0, want_ids[-1:])])[0][-1])))
    assert [int(i) for i in got_ids] == want_ids
    assert ran == ([] if wrong else ["imma_w4"] * 2)  # the prompt's last row and the decode row
    assert merged[1:] == ([] if wrong else [merges["T=19,M=1"]] * 2)


@pytest.mark.interpreted
@pytest.mark.parametrize("norm_gemv", ["0", "1"])
def test_untuned_one_row_linears_take_the_native_gemv_for_quantized_weights_only(monkeypatch, norm_gemv: str) -> None:
    """Without stored tunings the backend runs the native GEMV for int4/W8A16 rows (faster at the
    model level on the H200) and the Triton GEMV for dense weights (not measured faster); with
    MGX_CUDA_NORM_GEMV=1 the W8A16 projections after a residual add take the add + norm in their
    prologue (the reference stand-in computes it, and the greedy steps still run)."""
    calls: list[tuple[str, ...]] = []
    monkeypatch.setenv("MGX_CUDA_NORM_GEMV", norm_gemv)
    monkeypatch.setattr(backend_cuda, "gemv_applies", lambda k, x, w, bias=None, kind="gemv", norm=None, argmax=False: x.shape[0] == 1 and not argmax)
    monkeypatch.setattr(backend_cuda, "gemv", reference_gemv(calls=calls))
    fused = {("w8a16", "gemv", "norm")} if norm_gemv == "1" else set()
    for pipeline, want in (("dense", set()), ("w8a16-tiled", {("w8a16", "gemv")} | fused)):
        calls.clear()
        graph = compiled("gqa", pipeline, target="cuda")
        backend = CUDABackend(graph, device="cpu", dtype="f32")
        runner = ModelRunner(graph, backend)
        first = runner.step_greedy([SeqChunk(0, np.array([5, 6, 7]))])[0][0][-1]
        runner.step_greedy([SeqChunk(0, np.array([first]))])
        assert set(calls) == want


@pytest.mark.interpreted
def test_autotune_never_chooses_a_native_gemv_that_gives_other_results(no_gpu_needed, monkeypatch) -> None:  # noqa: ANN001
    """A native GEMV whose output disagrees with the Triton kernel's (here: off by 10%) is rejected and
    named in the summary, however fast the timer says it is."""
    from mgx.kernels.cuda import gemv as cg

    kernels = _StandIn()
    monkeypatch.setattr(autotune_pass, "_native_kernels", lambda graph: kernels)
    monkeypatch.setattr(cg, "gemv_applies", lambda k, x, w, bias=None, kind="gemv", norm=None, argmax=False: x.shape[0] == 1 and not argmax)
    monkeypatch.setattr(cg, "gemv", reference_gemv(scale=1.1))
    timer = autotune_pass._time
    monkeypatch.setattr(autotune_pass, "_time", lambda fn, r, ws=None, graph=False: -1.0 if getattr(
        fn.__defaults__[0], "native", "") else timer(fn, r, ws, graph))  # fmt: skip
    graph = tiny_contents().graph
    for name in ("fuse_qkv", "fuse_gate_up", "quantize_int4"):
        PASSES[name](graph, {"group_size": 32} if name == "quantize_int4" else {}, PassContext(target="cuda"))
    result = PASSES["autotune"](graph, {"rows": [1], "prefill_attention": False, "sampling_head": False, "argmax_merge": False, "dtype": "f32"}, PassContext(target="cuda"))
    entries = next(iter(result.stats["autotune"].values()))
    assert not any(e.config.get("native") for e in entries)
    assert "native GEMV chosen for 0; native GEMV rejected (wrong results) for " in result.summary
    # Each kind, each one-row shape of a linear or fused gate/up.
    assert result.summary.count("relative error 1.0e-01") == len(cg.KINDS) * sum(e.kernel in ("linear", "linear_silu_mul") for e in entries)


def test_graph_timing_takes_enough_weight_copies_to_miss_the_l2() -> None:
    l2 = 50 << 20  # the H200's
    assert autotune_pass.copies_for(235 << 20, l2) == 2  # the 8B gate/up: two copies, read in turn
    assert autotune_pass.copies_for(32 << 20, l2) == 7  # the 8B o_proj: 224 MiB of copies
    assert autotune_pass.copies_for(1 << 20, l2) == 16  # tiny weights: capped
    assert autotune_pass.copies_for(0, l2) == 16


@pytest.mark.gpu
def test_autotune_times_the_decode_regime_in_a_graph_over_weight_copies() -> None:
    """``_time`` with weight copies: every copy is launched (inside a captured graph, no fallback
    warning) and one launch's time is plausible for an 8 MiB GEMV."""
    import warnings

    import torch

    ws = [torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    x = torch.randn(2048, device="cuda", dtype=torch.bfloat16)
    seen = []

    def fn(w=ws[0]):  # noqa: ANN001, ANN202
        seen.append(w.data_ptr())
        return torch.mv(w, x)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        seconds = autotune_pass._time(fn, 5, ws)
    assert set(seen) == {w.data_ptr() for w in ws}
    assert 0 < seconds < 1e-3


def test_autotune_says_how_many_candidates_could_not_run_and_why(no_gpu_needed, monkeypatch) -> None:  # noqa: ANN001
    """A candidate that raises is skipped, and the summary counts it with its reason."""
    timer = autotune_pass._time

    def some_fail(fn, repeats, weights=None, graph=False):  # noqa: ANN001, ANN202
        if getattr(fn.__defaults__[0], "block_n", None) == 8:
            raise RuntimeError("out of shared memory\nmore detail")
        return timer(fn, repeats, weights)

    monkeypatch.setattr(autotune_pass, "_time", some_fail)
    graph = tiny_contents().graph
    result = PASSES["autotune"](graph, {"rows": [1], "prefill_attention": False, "rms_norm": False, "rope": False, "dtype": "f32", "native": False},
                                PassContext(target="cuda"))  # fmt: skip
    assert "configurations could not run (" in result.summary
    assert "x RuntimeError: out of shared memory)" in result.summary and "more detail" not in result.summary


def test_autotune_counts_candidates_too_large_for_the_gpu_as_skipped_not_broken(no_gpu_needed, monkeypatch) -> None:  # noqa: ANN001
    """A candidate whose launch asks for more shared memory than the GPU has (Triton's OutOfResources,
    as f32 tiles on an H200 did) is skipped and counted apart from the candidates that broke; the
    graph timer raises it at once instead of warning and timing it alone, which fails the same way."""
    import warnings

    from triton.runtime.errors import OutOfResources

    timer = autotune_pass._time

    def some_too_large(fn, repeats, weights=None, graph=False):  # noqa: ANN001, ANN202
        if getattr(fn.__defaults__[0], "block_n", None) == 8:
            raise OutOfResources(262144, 232448, "shared memory")
        return timer(fn, repeats, weights)

    monkeypatch.setattr(autotune_pass, "_time", some_too_large)
    graph = tiny_contents().graph
    result = PASSES["autotune"](graph, {"rows": [1], "prefill_attention": False, "rms_norm": False, "rope": False, "dtype": "f32", "native": False},
                                PassContext(target="cuda"))  # fmt: skip
    assert "could not run" not in result.summary, result.summary
    skipped = int(result.summary.split(" configurations skipped (more than this GPU's shared memory")[0].rsplit(" ", 1)[1])
    assert skipped > 0 and result.stats["autotune"]["interpreter"]

    def too_large(launches, repeats):  # noqa: ANN001, ANN202
        raise OutOfResources(262144, 232448, "shared memory")

    def launch(w=None):  # noqa: ANN001, ANN202
        raise AssertionError("timed alone after the graph said it does not fit")

    monkeypatch.undo()  # the real timer again
    monkeypatch.setattr(autotune_pass, "_time_in_graph", too_large)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "graph timing failed ... timing alone"
        with pytest.raises(OutOfResources):
            autotune_pass._time(launch, 5, [object(), object()])


@pytest.mark.interpreted
def test_autotune_tunes_split_decodes_merge_where_long_contexts_need_it_and_the_backend_uses_it(
        no_gpu_needed, monkeypatch) -> None:  # noqa: ANN001
    """The merge kernel of split decode attention is tuned for the batch buckets whose splits at the
    model's longest context do not merge themselves (more than SELF_MERGE_MAX_SPLITS), and a decode
    step that runs it launches the stored configuration, with the reference's tokens."""
    from mgx.kernels.triton import _common

    monkeypatch.setattr(_common, "num_sms", lambda device: 132)  # an H200's
    graph = tiny_contents(max_position=8192).graph
    result = PASSES["autotune"](graph, {"rows": [1, 4, 64], "dtype": "f32", "prefill_attention": False, "rms_norm": False,
                                        "rope": False, "native": False}, PassContext(target="cuda"))  # fmt: skip
    every = result.stats["autotune"]["interpreter"]
    sig = attention_key(graph)
    merges = {e.shape_key: MergeConfig(**e.config) for e in every if e.kernel == "decode_merge"}
    # 8,192 tokens in 64-token pieces over 2 KV heads: 128 splits at batch 1, 33 at 4, 3 at 64 (those merge themselves)
    assert merges == {f"{sig},M={m}": min(MERGE_CONFIGS, key=fake_seconds) for m in (1, 4)}
    assert merges[f"{sig},M=1"] == MergeConfig(16) != MERGE_CONFIGS[0]
    assert sorted(result.stats["attention_timings"]) == sorted(f"decode_merge {k}" for k in merges)

    backend = CUDABackend(graph, device="cpu", dtype="f32")
    backend.use_tunings(result.stats["autotune"])
    monkeypatch.setattr(backend_cuda, "num_sms", lambda device: 132)
    monkeypatch.setattr(backend_cuda, "SELF_MERGE_MAX_SPLITS", 1)  # the merge kernel from two splits on
    used = []
    real = backend_cuda.paged_attention_decode
    monkeypatch.setattr(backend_cuda, "paged_attention_decode", lambda *a, **k: used.append(
        (k["num_splits"], k["counters"], k.get("merge"))) or real(*a, **k))  # fmt: skip
    runner, want = ModelRunner(graph, backend), ModelRunner(graph, "reference")
    prompt = np.arange(5, 75)  # 70 tokens: two 64-token pieces
    got = [runner.step_greedy([SeqChunk(0, prompt)])[0][0][-1]]
    ref = [int(np.argmax(want.step([SeqChunk(0, prompt)])[0][-1]))]
    for _ in range(2):
        got.append(runner.step_greedy([SeqChunk(0, got[-1:])])[0][0][-1])
        ref.append(int(np.argmax(want.step([SeqChunk(0, ref[-1:])])[0][-1])))
    assert [int(i) for i in got] == ref
    assert used and all(splits == 2 and counters is None for splits, counters, _ in used)
    assert {merge for _, _, merge in used} == {merges[f"{sig},M=1"]}


@pytest.mark.interpreted
def test_autotune_tunes_decodes_merge_for_the_splits_of_the_tile_width_it_chose(no_gpu_needed, monkeypatch) -> None:  # noqa: ANN001
    """With decode attention tuned in the same build, the merge is tuned for the splits of the tile
    width stored for that bucket, which the backend cuts its contexts into: at 1,024 tokens over
    2 KV heads, 64-token pieces are 16 (they merge themselves), the chosen 32-token ones 32."""
    from mgx.kernels.triton import _common, attention

    monkeypatch.setattr(_common, "num_sms", lambda device: 132)  # an H200's
    merged = []
    real = attention.merge_splits
    monkeypatch.setattr(attention, "merge_splits", lambda o, *a, **k: merged.append(o.shape[2]) or real(o, *a, **k))
    graph = tiny_contents(max_position=1024).graph
    result = PASSES["autotune"](graph, {"rows": [1], "dtype": "f32", "prefill_attention": False, "decode_attention": True,
                                        "rms_norm": False, "rope": False, "native": False}, PassContext(target="cuda"))  # fmt: skip
    every = result.stats["autotune"]["interpreter"]
    sig = attention_key(graph)
    decode = {e.shape_key: DecodeConfig(**e.config) for e in every if e.kernel == "paged_attention_decode"}
    assert decode == {f"{sig},M=1": DecodeConfig(32, 8)}  # the fake timer's narrow tiles
    assert [e.shape_key for e in every if e.kernel == "decode_merge"] == [f"{sig},M=1"]
    backend = CUDABackend(graph, device="cpu", dtype="f32")
    backend.use_tunings(result.stats["autotune"])
    config = backend._decode_config(1)
    assert config.block_n == 32
    splits = decode_splits(1, 2, 1024, 132, config.block_n, backend._decode_min_tiles)
    assert merged and set(merged) == {splits} and splits == 32


@pytest.mark.interpreted
def test_autotune_times_the_microsecond_kernels_in_graphs_and_the_rest_as_before(no_gpu_needed, monkeypatch) -> None:  # noqa: ANN001
    """RMSNorm, RoPE and SiLU product candidates (a few microseconds each) are timed in graphs of
    launches (``_time``'s ``graph``); attention (whose caches would sit in L2 across a graph's
    launches) and the linear kinds' Triton candidates without weight copies are not."""
    how: dict[str, set[bool]] = {}

    def timer(fn, repeats, weights=None, graph=False):  # noqa: ANN001, ANN202
        config = fn.__defaults__[0]
        how.setdefault(type(config).__name__, set()).add(graph)
        return fake_seconds(config)

    monkeypatch.setattr(autotune_pass, "_time", timer)
    PASSES["autotune"](tiny_contents(fused=True).graph, {"rows": [1, 16], "dtype": "f32", "native": False, "decode_attention": True},
                       PassContext(target="cuda"))  # fmt: skip
    assert how["RMSNormConfig"] == how["RopeConfig"] == how["SiluMulConfig"] == {True}, how
    assert how["DecodeConfig"] == how["PrefillConfig"] == how["LinearConfig"] == {False}, how


@pytest.mark.interpreted
def test_fused_timing_times_the_norm_across_projections_as_the_backend_runs_them(monkeypatch) -> None:  # noqa: ANN001
    """``fused: true`` (an A/B switch, off by default): the dense one-row projections of norm across
    chains are timed as the CUDA backend runs them. o_proj and down (each read only by an add whose
    RMSNorm one linear reads) through ``linear_add_squares`` with a residual; QKV and gate/up through
    the GEMV with the norm in its loads (``NormIn``: the norm's weight and eps, one partial square a
    producer tile). Each such candidate call runs here once under the interpreter; the timings say
    which role each shape was timed in, and those shapes get no native kind."""
    import torch

    from mgx.kernels.triton.linear import NormIn

    monkeypatch.setattr(autotune_pass, "_device", lambda: (torch.device("cpu"), "interpreter"))
    monkeypatch.setattr(autotune_pass, "_native_kernels", lambda graph: _StandIn())  # natives offered everywhere...
    from mgx.kernels.cuda import gemv as cg

    monkeypatch.setattr(cg, "gemv_applies", lambda *a, argmax=False, **k: not argmax)
    monkeypatch.setattr(cg, "gemv", reference_gemv())
    seen: dict[int, list[tuple]] = {}  # id(the NormIn) or 0 -> the defaults of each timed call
    ran_add: list = []  # what the first producer call returned: (sum, its squares)

    def timer(fn, repeats, weights=None, graph=False):  # noqa: ANN001, ANN202
        config = fn.__defaults__[0]
        if config.native:
            return 1e9  # ...and never faster, so the Triton entries are what is checked below
        last = fn.__defaults__[-1]
        calls = seen.setdefault(id(last) if isinstance(last, NormIn) else 0, [])
        calls.append(fn.__defaults__)
        residual = len(fn.__defaults__) == 4 and isinstance(fn.__defaults__[3], torch.Tensor)
        if len(calls) == 1 or (residual and not ran_add):
            out = fn()  # the call as timed must run
            if residual:
                ran_add.append(out)
        return fake_seconds(config)

    monkeypatch.setattr(autotune_pass, "_time", timer)
    contents = tiny_contents(num_layers=3)
    graph = contents.graph
    for name in ("fuse_qkv", "fuse_gate_up"):
        PASSES[name](graph, {}, PassContext(target="cuda"))
    roles = autotune_pass._fused_roles(graph)
    hidden = graph.arch.hidden_size
    by_kernel = {(k, n): role for (k, n, _), (role, _, _) in roles.items()}
    qkv = graph.tensor(next(op for op in graph.ops if op.kind == "linear").weights["weight"]).shape[0]
    assert by_kernel == {("linear", qkv): "norm", ("linear", hidden): "add",
                         ("linear_silu_mul", 2 * graph.arch.intermediate_size): "norm"}  # fmt: skip
    result = PASSES["autotune"](graph, {"rows": [1], "prefill_attention": False, "sampling_head": False, "dtype": "f32", "fused": True}, PassContext(target="cuda"))
    timings = result.stats["timings"]
    fused = {key.split(" ")[0] + ("/o" if f",N={hidden}," in key else ""): t["fused"] for key, t in timings.items()}
    assert fused == {"linear": "norm", "linear/o": "add", "linear_silu_mul": "norm", "lm_head_argmax": ""}
    assert all(t["chosen"] == "triton" for t in timings.values())
    norm_calls = [d for k, calls in seen.items() if k for d in calls]
    assert norm_calls and {type(d[-1]) for d in norm_calls} == {NormIn}  # QKV and gate/up with the norm in loads
    adds = [d for d in seen[0] if len(d) == 4 and isinstance(d[3], torch.Tensor) and d[3].shape == (1, hidden)]
    assert adds  # o_proj and down with a residual
    total, squares = ran_add[0]
    assert total.shape == (1, hidden) and squares.sq.shape == (1, squares.tiles)
    plain = PASSES["autotune"](graph, {"rows": [1], "prefill_attention": False, "sampling_head": False, "argmax_merge": False, "dtype": "f32"}, PassContext(target="cuda"))
    fused = {key.split(" ")[0] + ("/o" if f",N={hidden}," in key else ""): t["fused"] for key, t in plain.stats["timings"].items()}
    assert fused == {"linear": "after_norm", "linear/o": "", "linear_silu_mul": "after_norm", "lm_head_argmax": ""}


@pytest.mark.interpreted
@pytest.mark.parametrize("scheme", ["int4", "w8a16"])
def test_after_norm_timing_times_the_norm_fed_projections_after_their_norm(monkeypatch, scheme: str) -> None:  # noqa: ANN001
    """``after_norm`` (on by default): the one-row projections that one add + RMSNorm feeds (QKV and
    gate/up) are timed after that norm. On int4 weights, which the CUDA backend stages x for, a native
    kind with a staged twin runs ``norm_stage`` and the twin on its record; every other candidate
    (Triton configurations, kinds without a twin, and every W8A16 one) reads the plain add +
    RMSNorm's row; o, down and the LM head are timed alone. The kernels are stood in for (no GPU):
    each kind of call runs once here, and gives the reference product of the normalized row."""
    import torch

    from mgx.kernels.cuda import gemv as cg
    from mgx.kernels.cuda import rmsnorm as crms
    from mgx.kernels.triton.linear import linear_ref, linear_silu_mul_ref
    from mgx.kernels.triton.rmsnorm import rms_norm_ref

    monkeypatch.setattr(autotune_pass, "_device", lambda: (torch.device("cpu"), "interpreter"))
    monkeypatch.setattr(autotune_pass, "_native_kernels", lambda graph: _StandIn())
    monkeypatch.setattr(cg, "gemv_applies", lambda k, x, w, bias=None, kind="gemv", norm=None, argmax=False:
                        x.shape[0] == 1 and not argmax and kind in ("imma", "imma_w16"))  # fmt: skip
    monkeypatch.setattr(cg, "gemv", reference_gemv())
    monkeypatch.setattr(cg, "norm_stage_applies", lambda k, x, norm, scheme: norm.delta is not None)
    monkeypatch.setattr(cg, "staged_applies", lambda k, x, w, kind, bias=None: kind == "imma")  # imma_w16: no twin
    ran: list[tuple] = []
    rows: list = []

    def norm_stage(x, norm, scheme, *, kernels, out=None, rec=None, blocks=None):  # noqa: ANN001, ANN202
        normed, total = rms_norm_ref(x, norm.weight, norm.eps, residual=norm.delta)
        norm.total.copy_(total)
        out.copy_(normed)
        rows.append(normed)
        ran.append(("norm_stage", scheme))
        return out, torch.zeros(cg.staged_bytes(x.shape[1]), dtype=torch.uint8)

    def gemv_staged(rec, w, bias=None, *, kernels, kind, silu_mul=False, out=None):  # noqa: ANN001, ANN202
        ran.append(("staged", kind, w.n))
        return (linear_silu_mul_ref if silu_mul else linear_ref)(rows[-1], w, bias).to(rows[-1].dtype)

    real_norm = crms.rms_norm

    def rms_norm(x, weight, eps, *, kernels, residual=None, out=None, **kw):  # noqa: ANN001, ANN202
        ran.append(("rms_norm", residual is not None))
        return real_norm(x, weight, eps, kernels=kernels, residual=residual, out=out, **kw)

    monkeypatch.setattr(cg, "norm_stage", norm_stage)
    monkeypatch.setattr(cg, "gemv_staged", gemv_staged)
    monkeypatch.setattr(crms, "rms_norm", rms_norm)
    called: set[tuple[int, str]] = set()  # (N, what): each kind of timed call runs once

    def timer(fn, repeats, weights=None, graph=False):  # noqa: ANN001, ANN202
        config = fn.__defaults__[0]
        w = next(d for d in fn.__defaults__ if hasattr(d, "scheme"))  # the weight
        what = config.native or "triton"
        if (w.n, what) not in called:
            called.add((w.n, what))
            before = len(ran)
            out = fn()
            assert out.shape[0] == 1 and torch.isfinite(out.float()).all()
            seen.append((w.n, what, ran[before:]))
        return {"imma": 1.0, "imma_w16": 2.0}.get(config.native, 3.0 + fake_seconds(config) * 1e-3)

    seen: list[tuple] = []
    monkeypatch.setattr(autotune_pass, "_time", timer)
    graph = tiny_contents(hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, head_dim=32,
                          dtype=ir.DType.BF16).graph  # fmt: skip
    for name in ("fuse_qkv", "fuse_gate_up", f"quantize_{scheme}"):
        PASSES[name](graph, {"group_size": 128} if name == "quantize_int4" else {}, PassContext(target="cuda"))
    readers = autotune_pass._norm_readers(graph)
    qkv = int(next(op for op in graph.ops if op.kind == "linear").attrs["out_features"])
    inter = graph.arch.intermediate_size
    assert set(readers) == {("linear", qkv, 128), ("linear_silu_mul", 2 * inter, 128)}
    assert all(n.kind == "rms_norm" for n in readers.values())

    result = PASSES["autotune"](graph, {"rows": [1], "prefill_attention": False, "sampling_head": False, "dtype": "bf16"}, PassContext(target="cuda"))
    timings = result.stats["timings"]
    how = {key.split(",N=")[1].split(",")[0]: (t["fused"], t["chosen"]) for key, t in timings.items()
           if not key.startswith("lm_head")}  # fmt: skip
    assert how == {str(qkv): ("after_norm", "imma"), str(2 * inter): ("after_norm", "imma"), "128": ("", "imma")}
    assert all(t["native_us"] == {"imma": 1e6, "imma_w16": 2e6} for key, t in timings.items() if not key.startswith("lm_head"))
    calls = {(n, what): tuple(c[0] for c in run) for n, what, run in seen}
    for n in (qkv, 2 * inter):  # after the norm: int4's twin after norm_stage, the rest after the plain norm
        assert calls[n, "imma"] == (("norm_stage", "staged") if scheme == "int4" else ("rms_norm",))
        assert calls[n, "imma_w16"] == ("rms_norm",) and calls[n, "triton"] == ("rms_norm",)
    assert all(c[1] is True for n, _, run in seen for c in run if c[0] == "rms_norm")  # with the residual
    assert calls[128, "imma"] == () and calls[128, "triton"] == ()  # o and down: alone

    seen.clear()
    called.clear()
    plain = PASSES["autotune"](graph, {"rows": [1], "prefill_attention": False, "sampling_head": False, "dtype": "bf16", "after_norm": False}, PassContext(target="cuda"))
    assert {t["fused"] for t in plain.stats["timings"].values()} == {""}
    assert not [c for _, _, run in seen for c in run]


@pytest.mark.parametrize(("arch", "option", "want"), [("sm_90", True, True), ("sm_80", True, False), ("sm_90", False, False)])
def test_autotune_times_candidates_launched_as_the_backend_launches_them(monkeypatch, arch: str, option: bool,
                                                                         want: bool) -> None:  # noqa: ANN001
    """On sm_90 and newer the CUDA backend launches its decode kernels overlapped (programmatic
    dependent launches), so the pass times every candidate so, with the native image told to allow
    it; on older GPUs, or with ``overlapped: false``, one after the other."""
    import contextlib

    import torch

    from mgx.kernels.cuda import gemv as cg
    from mgx.kernels.triton import _common

    class Kernels(_StandIn):
        overlap = False

        def allow_overlap(self, sm: int) -> bool:
            self.overlap = sm >= 90
            return self.overlap

    kernels, inside, during = Kernels(), [False], []

    @contextlib.contextmanager
    def overlapped(on: bool):  # noqa: ANN202
        inside[0] = on
        try:
            yield
        finally:
            inside[0] = False

    def timer(fn, repeats, weights=None, graph=False):  # noqa: ANN001, ANN202
        during.append((inside[0], kernels.overlap))
        return fake_seconds(fn.__defaults__[0])

    monkeypatch.setattr(autotune_pass, "_device", lambda: (torch.device("cpu"), arch))
    monkeypatch.setattr(autotune_pass, "_native_kernels", lambda graph: kernels)
    monkeypatch.setattr(autotune_pass, "_time", timer)
    monkeypatch.setattr(_common, "overlapped_launches", overlapped)
    monkeypatch.setattr(cg, "gemv_applies", lambda *a, **k: False)
    graph = tiny_contents().graph
    PASSES["autotune"](graph, {"rows": [1], "prefill_attention": False, "dtype": "f32", "overlapped": option}, PassContext(target="cuda"))
    assert during and set(during) == {(want, want)}
    assert not inside[0]  # and back to plain launches after the pass
