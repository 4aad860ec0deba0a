"""The model runner on tiny random graphs: incremental = full, batched = alone, and = a torch Llama."""

from __future__ import annotations

import numpy as np
import pytest

from mgx.formats import ir
from mgx.runtime.batch import SeqChunk
from mgx.runtime.block_manager import BlockManager
from mgx.runtime.errors import UnsupportedModelError
from mgx.runtime.kv_cache import KVCacheError, PagedKVCache
from mgx.runtime.model_runner import ModelRunner

from _tiny_graph import TinyConfig, build_tiny_graph

VARIANTS = {
    "plain": {},
    "fused-qknorm-bias-partial-rope": {
        "fused": True,
        "qk_norm": True,
        "attention_bias": True,
        "rotary_dim": 4,
    },
    "window-tied-bf16": {"sliding_window": 4, "tie_word_embeddings": True, "dtype": ir.DType.BF16},
    "mqa-f16-scaled": {"num_kv_heads": 1, "dtype": ir.DType.F16, "attention_scaling": 1.2},
}
PROMPT = np.array([3, 17, 5, 5, 60, 0, 42, 8, 9, 11, 30], dtype=np.int64)


def full_logits(graph: ir.Graph, ids: np.ndarray) -> np.ndarray:
    (logits,) = ModelRunner(graph).step([SeqChunk(0, ids, all_logits=True)])
    return logits


@pytest.mark.parametrize("variant", VARIANTS)
def test_incremental_decoding_matches_one_full_forward(variant: str) -> None:
    graph, _ = build_tiny_graph(**VARIANTS[variant])
    want = full_logits(graph, PROMPT)  # [S, V]
    runner = ModelRunner(graph)
    got = [runner.step([SeqChunk(1, PROMPT[:4], all_logits=True)])[0]]
    got += [runner.step([SeqChunk(1, PROMPT[4:7], all_logits=True)])[0]]  # a chunk after a prefill
    got += [runner.step([SeqChunk(1, [tok])])[0] for tok in PROMPT[7:]]
    np.testing.assert_allclose(np.concatenate(got), want, atol=1e-5)
    assert runner.length(1) == PROMPT.size


@pytest.mark.parametrize("variant", ["plain", "window-tied-bf16"])
def test_batch_of_three_matches_each_alone(variant: str) -> None:
    graph, _ = build_tiny_graph(**VARIANTS[variant])
    prompts = [PROMPT, PROMPT[2:5], np.array([7])]
    alone = [full_logits(graph, p) for p in prompts]
    runner = ModelRunner(graph)
    # Step 1: sequences 10 and 11 prefill; step 2: 10 decodes while 12 prefills and 11 adds two tokens.
    a, b = runner.step([SeqChunk(10, PROMPT[:-1], all_logits=True), SeqChunk(11, prompts[1][:1])])
    np.testing.assert_allclose(a, alone[0][:-1], atol=1e-5)
    np.testing.assert_allclose(b, alone[1][:1], atol=1e-5)
    a, c, b = runner.step([SeqChunk(10, PROMPT[-1:]), SeqChunk(12, prompts[2]), SeqChunk(11, prompts[1][1:])])
    np.testing.assert_allclose(a, alone[0][-1:], atol=1e-5)
    np.testing.assert_allclose(b, alone[1][-1:], atol=1e-5)
    np.testing.assert_allclose(c, alone[2][-1:], atol=1e-5)
    runner.free(11)
    assert runner.length(11) == 0 and runner.length(10) == PROMPT.size


def torch_llama(cfg: TinyConfig, w: dict[str, np.ndarray], ids: np.ndarray):
    """A tiny HF-Llama-style forward in torch (float64) over the same weights, written independently."""
    import torch

    F = torch.nn.functional
    W = {k: torch.from_numpy(v).double() for k, v in w.items()}
    s, d, hq, hk = ids.size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    rot = cfg.rotary_dim or d

    def norm(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * weight

    def proj(x, name, bias=False):
        return F.linear(x, W[f"{name}.weight"], W[f"{name}.bias"] if bias else None)

    freqs = torch.arange(s).double()[:, None] * W["rope.inv_freq"][None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos() * cfg.attention_scaling, emb.sin() * cfg.attention_scaling  # [S, R]

    def rope(x):  # [H, S, D]
        xr, xp = x[..., :rot], x[..., rot:]
        rotated = torch.cat([-xr[..., rot // 2 :], xr[..., : rot // 2]], dim=-1)
        return torch.cat([xr * cos + rotated * sin, xp], dim=-1)

    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    mask = (j <= i) & ((j > i - cfg.sliding_window) if cfg.sliding_window else True)
    x = W["embed_tokens.weight"][torch.from_numpy(ids)]
    for layer in range(cfg.num_layers):
        p = f"layers.{layer}"
        h = norm(x, W[f"{p}.input_layernorm.weight"])
        q = proj(h, f"{p}.self_attn.q_proj", cfg.attention_bias).view(s, hq, d).transpose(0, 1)
        k = proj(h, f"{p}.self_attn.k_proj", cfg.attention_bias).view(s, hk, d).transpose(0, 1)
        v = proj(h, f"{p}.self_attn.v_proj", cfg.attention_bias).view(s, hk, d).transpose(0, 1)
        if cfg.qk_norm:
            q, k = norm(q, W[f"{p}.self_attn.q_norm.weight"]), norm(k, W[f"{p}.self_attn.k_norm.weight"])
        q, k = rope(q), rope(k)
        k, v = k.repeat_interleave(hq // hk, 0), v.repeat_interleave(hq // hk, 0)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=d**-0.5)
        x = x + proj(a.transpose(0, 1).reshape(s, hq * d), f"{p}.self_attn.o_proj")
        h = norm(x, W[f"{p}.post_attention_layernorm.weight"])
        x = x + proj(
            F.silu(proj(h, f"{p}.mlp.gate_proj")) * proj(h, f"{p}.mlp.up_proj"), f"{p}.mlp.down_proj"
        )
    return proj(norm(x, W["norm.weight"]), "lm_head").numpy()


@pytest.mark.parametrize("variant", VARIANTS)
def test_runner_matches_a_torch_llama(variant: str) -> None:
    pytest.importorskip("torch")
    cfg = TinyConfig(**VARIANTS[variant])
    graph, weights = build_tiny_graph(cfg)
    np.testing.assert_allclose(full_logits(graph, PROMPT), torch_llama(cfg, weights, PROMPT), atol=1e-4)


def test_weights_are_upcast_once_on_first_use() -> None:
    graph, _ = build_tiny_graph(dtype=ir.DType.BF16)
    runner = ModelRunner(graph)
    cache = runner.backend._f32
    assert cache == {}  # nothing upcast at load
    runner.step([SeqChunk(0, [1, 2])])
    first = dict(cache)
    assert "layers.0.self_attn.q_proj.weight" in first
    runner.step([SeqChunk(0, [3])])
    assert all(cache[name] is arr for name, arr in first.items())


def test_steps_must_continue_each_sequence() -> None:
    runner = ModelRunner(build_tiny_graph()[0])
    runner.step([SeqChunk(0, [1, 2, 3])])
    with pytest.raises(ValueError, match="positions 3, 4"):
        runner.step([SeqChunk(0, [4], positions=[5])])
    with pytest.raises(ValueError, match="token ids must be in"):
        runner.step([SeqChunk(1, [2]), SeqChunk(0, [99])])
    assert runner.length(0) == 3 and runner.length(1) == 0  # a refused step changes nothing
    with pytest.raises(ValueError, match="appears twice"):
        runner.step([SeqChunk(0, [1]), SeqChunk(0, [2])])


def test_unsupported_graphs_are_refused_at_load() -> None:
    graph, _ = build_tiny_graph()
    graph.states.append(ir.StateSpec(5, "recurrent", shape=(4, 4)))
    with pytest.raises(UnsupportedModelError, match="recurrent"):
        ModelRunner(graph)
    graph, _ = build_tiny_graph()
    w = graph.tensors["layers.0.mlp.up_proj.weight"]
    w.scheme = "int4_g128"
    with pytest.raises(UnsupportedModelError, match=r"layers.0.mlp.up_proj.weight uses scheme 'int4_g128'"):
        ModelRunner(graph)
    with pytest.raises(UnsupportedModelError, match="unknown backend 'tpu'"):
        ModelRunner(build_tiny_graph()[0], backend="tpu")


def test_paged_kv_cache_layout_and_budget() -> None:
    states = [ir.StateSpec(0, "kv", 2, 3), ir.StateSpec(1, "kv", 2, 3), ir.StateSpec(2, "recurrent", shape=(4, 5))]
    cache = PagedKVCache(states, num_blocks=7, block_size=4, num_state_slots=2)
    assert cache.k[0].shape == cache.v[1].shape == (7, 4, 2, 3) and cache.state[2].shape == (2, 4, 5)
    assert cache.k[0].dtype == np.float32
    assert cache.nbytes() == 4 * (2 * 2 * 7 * 4 * 2 * 3 + 2 * 4 * 5)


def test_runner_writes_kv_into_its_blocks_and_frees_them() -> None:
    graph, _ = build_tiny_graph()
    blocks = BlockManager(num_blocks=6, block_size=4)
    runner = ModelRunner(graph, blocks=blocks)
    want = full_logits(graph, PROMPT)
    (got,) = runner.step([SeqChunk(3, PROMPT, all_logits=True)])
    np.testing.assert_allclose(got, want, atol=1e-5)
    table = blocks.table(3)
    assert len(table) == 3 and runner.length(3) == PROMPT.size  # 11 tokens in blocks of 4
    assert np.any(runner.kv.k[0][table[2], 2] != 0) and not np.any(runner.kv.k[0][table[2], 3])
    with pytest.raises(KVCacheError, match="no free KV block"):
        runner.step([SeqChunk(4, np.arange(13))])
    runner.free(3)
    runner.free(4)
    assert blocks.num_free_blocks == 6 and runner.length(3) == 0


def test_intermediate_prefill_chunks_skip_the_lm_head() -> None:
    runner = ModelRunner(build_tiny_graph()[0])
    a, b = runner.step([SeqChunk(0, PROMPT[:5], sample=False), SeqChunk(1, PROMPT[:2])])
    assert a.shape == (0, 61) and b.shape == (1, 61)


@pytest.mark.parametrize("greedy", [False, True])
def test_packed_steps_equal_chunk_steps(greedy: bool) -> None:
    """The engine's flat path (``step_packed``/``step_greedy_packed``) = the per-chunk path, step by step:
    a mixed prefill + decode batch with a chunk that does not sample, then decodes, then a new sequence."""
    graph, _ = build_tiny_graph()
    by_chunks, packed = ModelRunner(graph), ModelRunner(graph)
    steps = [
        [(10, PROMPT[:6], True), (11, PROMPT[2:5], True), (12, PROMPT[:4], False)],
        [(10, [7], True), (12, PROMPT[4:], True), (11, [9], True)],
        [(11, [4], True), (10, [2], True), (12, [5], True)],
        [(12, [6], True), (13, PROMPT[:3], True), (10, [1], True)],
    ]
    for step in steps:
        chunks = [SeqChunk(s, ids, sample=sample) for s, ids, sample in step]
        flat = (
            [s for s, _, _ in step],
            [int(t) for _, ids, _ in step for t in ids],
            [len(ids) for _, ids, _ in step],
            [sample for _, _, sample in step],
        )
        if greedy:
            want = [pair for pair in by_chunks.step_greedy(chunks) if pair[0].size]
            ids, top = packed.step_greedy_packed(*flat)
            np.testing.assert_array_equal(ids, np.concatenate([i for i, _ in want]))
            np.testing.assert_array_equal(top, np.concatenate([t for _, t in want]))
        else:
            want = [rows for rows in by_chunks.step(chunks) if rows.shape[0]]
            np.testing.assert_array_equal(packed.step_packed(*flat), np.concatenate(want))
        for s, _, _ in step:
            assert packed.length(s) == by_chunks.length(s)
            assert packed.blocks.table(s) == by_chunks.blocks.table(s)


def test_packed_steps_check_their_input_before_taking_blocks() -> None:
    graph, _ = build_tiny_graph()
    runner = ModelRunner(graph)
    free = runner.blocks.num_free_blocks
    with pytest.raises(ValueError, match="outside|must be in"):
        runner.step_packed([0, 1], [3, 10_000], [1, 1], [True, True])
    with pytest.raises(ValueError, match="appears twice"):
        runner.step_packed([0, 0], [3, 4], [1, 1], [True, True])
    with pytest.raises(ValueError, match="at least one token"):
        runner.step_packed([0, 1], [3, 4], [2, 0], [True, True])
    with pytest.raises(ValueError, match="token ids for"):
        runner.step_packed([0, 1], [3, 4, 5], [1, 1], [True, True])
    assert runner.blocks.num_free_blocks == free and runner.length(0) == 0
