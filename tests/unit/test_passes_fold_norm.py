"""fold_norm on tiny random graphs: exact in fp32, bounded by one rounding in bf16, and only where legal."""

from __future__ import annotations

import numpy as np
import pytest

from mgx.formats import ir
from mgx.passes import PassError

from _pass_testing import after, logits, rel_error
from _tiny_graph import build_tiny_graph


def _weighted_norms(graph: ir.Graph) -> list[str]:
    return [op.source for op in graph.ops if op.kind == "rms_norm" and "weight" in op.weights]


@pytest.mark.parametrize("overrides", [{}, {"attention_bias": True}, {"fused": True}], ids=["plain", "bias", "fused"])
def test_folding_is_exact_in_fp32(overrides: dict) -> None:
    graph, _ = build_tiny_graph(**overrides)
    folded, (res,) = after(graph, "fold_norm")
    layers = graph.arch.num_layers
    assert res.stats["folded"] == 2 * layers + 1  # both norms of each layer and the final one (untied head)
    assert _weighted_norms(folded) == []
    assert "input_layernorm.weight" not in " ".join(folded.tensors)
    np.testing.assert_allclose(logits(folded), logits(graph), atol=2e-5, rtol=0)


def test_qk_norms_and_a_tied_head_keep_their_weights() -> None:
    graph, _ = build_tiny_graph(qk_norm=True, tie_word_embeddings=True)
    folded, (res,) = after(graph, "fold_norm")
    kept = res.stats["kept"]
    assert {s for s, why in kept.items() if why == "feeds rope"} == {
        f"layers.{i}.self_attn.{n}" for i in range(graph.arch.num_layers) for n in ("q_norm", "k_norm")}
    assert kept["norm"] == "tied weight"  # the LM head is the embedding table: scaling it breaks the embedding
    assert sorted(_weighted_norms(folded)) == sorted(kept)
    np.testing.assert_allclose(logits(folded), logits(graph), atol=2e-5, rtol=0)


def test_folding_after_fusion_scales_the_fused_weights() -> None:
    graph, _ = build_tiny_graph(qk_norm=True)
    fused, _ = after(graph, "fuse_qkv", "fuse_gate_up")
    folded, (res,) = after(fused, "fold_norm")
    assert res.stats["linears"] == res.stats["folded"]  # one fused reader per layer norm, plus the head
    np.testing.assert_allclose(logits(folded), logits(graph), atol=2e-5, rtol=0)


def test_bf16_folding_is_bounded_by_one_rounding() -> None:
    graph, _ = build_tiny_graph(dtype=ir.DType.BF16)
    folded, _ = after(graph, "fold_norm")
    assert all(folded.tensors[n].dtype == ir.DType.BF16 for n in folded.tensors if n.endswith("proj.weight"))
    assert rel_error(logits(folded), logits(graph)) < 1e-2  # bf16 keeps 8 bits: W*g rounds by <= 2^-9


def test_skip_keeps_the_norms_that_feed_skipped_linears() -> None:
    graph, _ = build_tiny_graph(num_layers=3)
    folded, (res,) = after(graph, ("fold_norm", {"skip": {"lm_head": True, "first_layers": 1}}))
    assert sorted(_weighted_norms(folded)) == ["layers.0.input_layernorm", "layers.0.post_attention_layernorm",
                                               "norm"]
    assert res.stats["kept"]["norm"] == "skip.lm_head"


def test_folding_refuses_quantized_readers() -> None:
    graph, _ = build_tiny_graph()
    quantized, _ = after(graph, ("quantize_int4", {"group_size": 32}))
    with pytest.raises(PassError, match="run fold_norm before quantization"):
        after(quantized, "fold_norm")
