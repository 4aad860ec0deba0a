"""Lowering: the IR it produces, and the message when an op cannot be lowered."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


def _model(family: str, **overrides):  # noqa: ANN202
    from transformers import AutoModelForCausalLM

    from _tiny_hf import make_config

    config = make_config(family, 64)
    for k, v in overrides.items():
        setattr(config, k, v)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def test_unlowerable_op_names_op_module_and_model_type() -> None:
    from mgx.compiler.lower import LoweringError, lower_model

    model = _model("llama", hidden_act="gelu")
    with pytest.raises(LoweringError) as info:
        lower_model(model)
    msg = str(info.value)
    assert "aten.gelu" in msg
    assert "layers.0.mlp.act_fn" in msg
    assert "model type 'llama'" in msg


def test_graph_structure_per_family() -> None:
    from mgx.compiler.lower import lower_model
    from mgx.formats import ir

    for family, norms_per_layer, has_bias in (("llama", 2, False), ("qwen2", 2, True), ("qwen3", 4, False)):
        model = _model(family)
        graph, _ = lower_model(model)
        ir.verify(graph)
        layers = graph.arch.num_layers
        kinds = [op.kind for op in graph.ops]
        assert kinds.count("attention") == layers and kinds.count("rope") == layers
        assert kinds.count("rms_norm") == layers * norms_per_layer + 1
        assert kinds.count("silu_mul") == layers and kinds.count("add") == 2 * layers
        assert kinds[0] == "embedding" and kinds[-1] == "lm_head"
        assert any("bias" in op.weights for op in graph.ops) == has_bias
        assert [s.layer for s in graph.states] == list(range(layers))
        assert all(s.kind == "kv" for s in graph.states)
        tied = graph.arch.tie_word_embeddings
        head = graph.ops[-1].weights["weight"]
        assert (head == graph.ops[0].weights["weight"]) == tied
        # inv_freq comes from the model's own rotary module (its scaling applied)
        inv = graph.tensors["rope.inv_freq"].data
        assert inv.dtype.name == "float32" and inv.shape[0] * 2 == graph.arch.head_dim


def test_llama3_rope_scaling_is_recorded() -> None:
    from mgx.compiler.lower import lower_model

    plain, _ = lower_model(_model("llama"))
    scaled_model = _model("llama3_rope")
    scaled, _ = lower_model(scaled_model)
    inv_plain = plain.tensors["rope.inv_freq"].data
    inv_scaled = scaled.tensors["rope.inv_freq"].data
    assert not (inv_plain == inv_scaled).all()
    assert (inv_scaled == scaled_model.model.rotary_emb.inv_freq.numpy()).all()
