"""fuse_qkv and fuse_gate_up on tiny random graphs: exact up to fp32 rounding, structure as promised."""

from __future__ import annotations

import numpy as np
import pytest

from mgx.formats import ir
from mgx.passes import PassError

from _pass_testing import after, logits
from _tiny_graph import build_tiny_graph

# Graph variants that change what fusion meets: GQA, biases, q/k norms, tied head, bf16, partial rotary.
VARIANTS = {
    "gqa": {},
    "bias_qknorm": {"attention_bias": True, "qk_norm": True},
    "tied_bf16": {"tie_word_embeddings": True, "dtype": ir.DType.BF16},
    "mha_partial_rotary": {"num_kv_heads": 6, "rotary_dim": 4, "sliding_window": 5},
}
ATOL = 2e-5  # fusion only regroups the same products: fp32 summation order at most


def _kinds(graph: ir.Graph) -> list[str]:
    return [op.kind for op in graph.ops]


@pytest.mark.parametrize("variant", VARIANTS)
def test_fuse_qkv_is_exact(variant: str) -> None:
    graph, _ = build_tiny_graph(**VARIANTS[variant])
    fused, (res,) = after(graph, "fuse_qkv")
    layers = graph.arch.num_layers
    assert res.stats["fused"] == layers
    assert _kinds(fused).count("linear") == _kinds(graph).count("linear") - 2 * layers
    assert _kinds(fused).count("split") == layers
    np.testing.assert_allclose(logits(fused), logits(graph), atol=ATOL, rtol=0)

    qkv = next(op for op in fused.ops if "fused_sources" in op.attrs)
    p = "layers.0.self_attn"
    assert qkv.attrs["fused_sources"] == [f"{p}.q_proj", f"{p}.k_proj", f"{p}.v_proj"]
    d = graph.arch.head_dim
    assert qkv.attrs["fused_sizes"] == [graph.arch.num_heads * d, graph.arch.num_kv_heads * d,
                                        graph.arch.num_kv_heads * d]
    split = fused.ops[fused.ops.index(qkv) + 1]
    assert split.kind == "split" and split.inputs == qkv.outputs
    assert ("bias" in qkv.weights) == VARIANTS[variant].get("attention_bias", False)
    assert f"{p}.q_proj.weight" not in fused.tensors and f"{p}.qkv_proj.weight" in fused.tensors


@pytest.mark.parametrize("variant", VARIANTS)
def test_fuse_gate_up_is_exact(variant: str) -> None:
    graph, _ = build_tiny_graph(**VARIANTS[variant])
    fused, (res,) = after(graph, "fuse_gate_up")
    assert res.stats["fused"] == graph.arch.num_layers
    acts = [op for op in fused.ops if op.kind == "silu_mul"]
    assert all(len(op.inputs) == 1 for op in acts)
    gate_up = next(op for op in fused.ops if op.outputs == acts[0].inputs)
    assert gate_up.attrs["fused_sizes"] == [graph.arch.intermediate_size] * 2
    np.testing.assert_allclose(logits(fused), logits(graph), atol=ATOL, rtol=0)


def test_both_fusions_together_and_again_change_nothing_more() -> None:
    graph, _ = build_tiny_graph(qk_norm=True)
    fused, _ = after(graph, "fuse_qkv", "fuse_gate_up")
    again, results = after(fused, "fuse_qkv", "fuse_gate_up")
    assert [r.stats["fused"] for r in results] == [0, 0]
    assert _kinds(again) == _kinds(fused)
    np.testing.assert_allclose(logits(fused), logits(graph), atol=ATOL, rtol=0)


def test_graphs_fused_by_the_builder_are_left_alone() -> None:
    graph, _ = build_tiny_graph(fused=True)
    _, results = after(graph, "fuse_qkv", "fuse_gate_up")
    assert [r.stats["fused"] for r in results] == [0, 0]


@pytest.mark.parametrize("skip, fused_layers", [
    ({"first_layers": 1}, [1, 2]),
    ({"last_layers": 2}, [0]),
    ({"names": ["layers.1.*"]}, [0, 2]),
])
def test_fusion_skips_what_it_is_told(skip: dict, fused_layers: list[int]) -> None:
    graph, _ = build_tiny_graph(num_layers=3)
    for name in ("fuse_qkv", "fuse_gate_up"):
        fused, (res,) = after(graph, (name, {"skip": skip}))
        layers = sorted(int(op.source.split(".")[1]) for op in fused.ops if "fused_sources" in op.attrs)
        assert layers == fused_layers, name
        assert len(res.stats["skipped"]) == 3 - len(fused_layers)
        assert "left" in res.summary


def test_fusion_refuses_quantized_weights_and_unknown_options() -> None:
    graph, _ = build_tiny_graph()
    quantized, _ = after(graph, "quantize_w8a16")
    with pytest.raises(PassError, match="before the quantization passes"):
        after(quantized, "fuse_qkv")
    with pytest.raises(PassError, match=r"unknown option 'layers'; allowed: skip"):
        after(graph, ("fuse_gate_up", {"layers": 1}))
    with pytest.raises(PassError, match=r"fuse_qkv.skip.first_layers: expected int"):
        after(graph, ("fuse_qkv", {"skip": {"first_layers": "1"}}))
