"""Whole models on the CPU backend against the reference backend: greedy tokens identical, logits close.

- tiny random graphs (GQA, q/k norms with biases, sliding window and partial rotary, tied bf16
  embeddings) in every weight scheme, row-major and in the CPU layout, several sequences batched per
  step with prefill, chunked prefill and decode rows mixed, on every ISA path this host runs;
- the compiled tiny Hugging Face models of every family (fp32), on their golden prompts;
- SmolLM2-135M-Instruct (slow): fp32 against the golden tokens from transformers, and W8A16 in the
  CPU layout against the reference backend on the same artifact.

Tolerance: max |logit difference| 1e-4 on the tiny models (logits of order 1..10), 2e-3 on SmolLM2.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
from _cpu_testing import ISAS

from mgx.kernels import cpu
from mgx.passes import PASSES, PassContext
from mgx.runtime.batch import SeqChunk
from mgx.runtime.model_runner import ModelRunner

from _backend_testing import MODELS, PIPELINES, compiled, greedy_run

TINY_ATOL = 1e-4
SMOLLM2_ATOL = 2e-3

@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("pipeline", list(PIPELINES))
@pytest.mark.parametrize("model", list(MODELS))
def test_tiny_graphs_match_the_reference_backend(model: str, pipeline: str, isa: str) -> None:
    graph = compiled(model, pipeline)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, graph.arch.vocab_size, 23), rng.integers(0, graph.arch.vocab_size, 12)]
    want_tokens, want_logits = greedy_run(ModelRunner(graph, "reference"), prompts, 12)
    with cpu.use_isa(isa):
        got_tokens, got_logits = greedy_run(ModelRunner(graph, "cpu"), prompts, 12)
    assert got_tokens == want_tokens
    for got, want in zip(got_logits, want_logits, strict=True):
        np.testing.assert_allclose(got, want, atol=TINY_ATOL, rtol=0)


def test_cpu_backend_reads_the_cpu_layout_without_copies() -> None:
    graph = compiled("gqa", "w8a16-tiled")
    runner = ModelRunner(graph, "cpu")
    linear_weights = [graph.tensors[op.weights["weight"]] for op in graph.ops if op.kind == "linear"]
    assert linear_weights and all(t.layout == "cpu_tile16" for t in linear_weights)
    backend = runner.backend
    for op in graph.ops:
        if op.kind == "linear":  # the handle points at the graph's own array
            assert backend._linear[id(op)].name == op.weights["weight"]


@pytest.mark.parametrize(("model", "pipeline", "layout"), [("wide-fused", "w8a16-tiled", "cuda_tile16"),
                                                       ("wide-fused", "int4-g128-tiled", "cuda_tile16"),
                                                       ("gqa", "sparse24-tiled", "sparse24_nibble_meta")])  # fmt: skip
def test_a_graph_built_for_cuda_runs_here_unpacked(model: str, pipeline: str, layout: str) -> None:
    """Weights in a layout written for the GPU kernels are unpacked to row_major copies once, and the
    model gives the reference backend's tokens (the artifact is not tied to the GPU)."""
    graph = compiled(model, pipeline, target="cuda")
    ops = [op for op in graph.ops if op.kind in ("linear", "lm_head")]
    assert any(graph.tensors[op.weights["weight"]].layout == layout for op in ops)
    before = {id(op): graph.tensors[op.weights["weight"]].data for op in ops}
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, graph.arch.vocab_size, 23), rng.integers(0, graph.arch.vocab_size, 12)]
    want_tokens, want_logits = greedy_run(ModelRunner(graph, "reference"), prompts, 6)
    got_tokens, got_logits = greedy_run(ModelRunner(graph, "cpu"), prompts, 6)
    assert got_tokens == want_tokens
    for got, want in zip(got_logits, want_logits, strict=True):
        np.testing.assert_allclose(got, want, atol=TINY_ATOL, rtol=0)
    assert all(graph.tensors[op.weights["weight"]].data is before[id(op)] for op in ops)  # the graph untouched


def test_tiny_hf_models_match_the_reference_backend(tiny_models) -> None:  # noqa: ANN001
    from mgx.runtime import Engine

    for family, built in tiny_models.items():
        ours, ref = Engine(built.artifact, backend="cpu"), Engine(built.artifact, backend="reference")
        for case in built.result.golden.cases:
            got_ids, got_top = ours.greedy_with_logits(list(case.prompt_ids), len(case.expected_ids))
            want_ids, want_top = ref.greedy_with_logits(list(case.prompt_ids), len(case.expected_ids))
            assert got_ids == want_ids == list(case.expected_ids), f"{family} {case.prompt!r}"
            np.testing.assert_allclose(got_top, want_top, atol=TINY_ATOL, rtol=0)


@pytest.mark.slow
def test_smollm2_fp32_matches_the_golden_tokens(smollm2) -> None:  # noqa: ANN001
    from mgx.runtime import Engine

    engine = Engine(smollm2.artifact, backend="cpu")
    for case in smollm2.result.golden.cases:
        ids, _ = engine.greedy_with_logits(list(case.prompt_ids), len(case.expected_ids))
        assert ids == list(case.expected_ids), case.prompt


@pytest.mark.slow
def test_smollm2_w8a16_tiled_matches_the_reference_backend(smollm2) -> None:  # noqa: ANN001
    graph = copy.deepcopy(smollm2.result.graph)
    for name in ("fuse_qkv", "fuse_gate_up", "quantize_w8a16", "reorder_weights"):
        PASSES[name](graph, {}, PassContext(target="cpu"))
    prompt = np.array(smollm2.result.golden.cases[0].prompt_ids)
    results = []
    for backend in ("reference", "cpu"):
        runner = ModelRunner(graph, backend)
        tokens, logits = [], []
        chunk = prompt
        for _ in range(24):
            (out,) = runner.step([SeqChunk(0, chunk)])
            logits.append(out[-1])
            tokens.append(int(np.argmax(out[-1])))
            chunk = np.array(tokens[-1:])
        results.append((tokens, np.stack(logits)))
    (want_tokens, want_logits), (got_tokens, got_logits) = results
    assert got_tokens == want_tokens
    np.testing.assert_allclose(got_logits, want_logits, atol=SMOLLM2_ATOL, rtol=0)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_step_greedy_is_the_argmax_of_the_logits(backend: str) -> None:
    """The fused LM head + argmax (CPU) and the runner's own argmax (reference) pick what the logits say."""
    graph = compiled("tied-bf16", "w8a16-tiled")
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, graph.arch.vocab_size, n) for n in (9, 4)]
    full, fused = ModelRunner(graph, backend), ModelRunner(graph, backend)
    chunks = [SeqChunk(0, prompts[0], all_logits=True), SeqChunk(1, prompts[1])]
    logits = full.step(chunks)
    picked = fused.step_greedy(chunks)
    for rows, (ids, top) in zip(logits, picked, strict=True):
        assert ids.tolist() == np.argmax(rows, axis=1).tolist()
        np.testing.assert_allclose(top, rows.max(axis=1), atol=TINY_ATOL, rtol=0)


@pytest.mark.parametrize("greedy", [True, False])
def test_a_step_in_which_no_sequence_samples_runs_on_the_cpu_backend(greedy: bool) -> None:
    """A prompt longer than the step's token budget: its first chunks sample nothing, so the LM head
    (fused with the argmax, or plain) gets no rows. numpy gives those an empty array with strides 0,
    which the kernels' row check refused until the twenty-ninth session: every greedy or sampled
    prompt past ``max_tokens_per_step`` (512 by default) failed on the CPU backend. Tokens as the
    reference backend's."""
    from mgx.runtime import Engine, EngineConfig

    from _tiny_graph import tiny_contents

    prompt = list(range(2, 40))  # 38 tokens: chunks of 16, 16 and 6
    tokens = []
    for backend in ("reference", "cpu"):
        engine = Engine.from_contents(tiny_contents(), backend=backend, config=EngineConfig(max_num_seqs=2, max_tokens_per_step=16))
        out = engine.generate(prompt, max_tokens=5, temperature=0.0 if greedy else 1.0, seed=7, ignore_eos=True)
        tokens.append(out.token_ids)
    assert len(tokens[1]) == 5
    if greedy:
        assert tokens[1] == tokens[0]
