"""Tiny random Llama-style models as ``ir.Graph``s with numpy weights, for runtime and kernel tests.

``build_tiny_graph`` returns the graph and the same weights as plain float32 arrays under their
Hugging Face names, unfused, so an independent (torch) reference can run the model without
reading the graph. Options cover what the IR allows: GQA, q/k norms, biases, partial rotary,
sliding windows, fused QKV / gate-up projections with ``split``, tied embeddings, bf16/f16 weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mgx.formats import ir


@dataclass(slots=True)
class TinyConfig:
    """Hyper-parameters of a tiny model; the defaults are deliberately uneven."""

    vocab_size: int = 61
    hidden_size: int = 40  # != num_heads * head_dim on purpose
    num_layers: int = 2
    num_heads: int = 6
    num_kv_heads: int = 2  # GQA groups of 3
    head_dim: int = 8
    intermediate_size: int = 36
    max_position: int = 96
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rotary_dim: int | None = None  # None: the whole head
    attention_scaling: float = 1.0
    sliding_window: int = 0
    qk_norm: bool = False
    attention_bias: bool = False
    fused: bool = False  # one qkv and one gate_up projection per layer
    tie_word_embeddings: bool = False
    dtype: ir.DType = ir.DType.F32  # storage type of matrices and norms
    bos_token_id: int = -1
    eos_token_ids: list[int] = field(default_factory=list)
    seed: int = 0


def _store(name: str, values: np.ndarray, dtype: ir.DType) -> tuple[ir.Tensor, np.ndarray]:
    """The tensor as stored in ``dtype`` and the float32 values it holds (after rounding)."""
    values = values.astype(np.float32)
    if dtype is ir.DType.F32:
        data = values
    elif dtype is ir.DType.F16:
        data = values.astype(np.float16)
    elif dtype is ir.DType.BF16:
        bits = values.view(np.uint32)
        data = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # round to nearest even
    else:
        raise ValueError(dtype)
    exact = (data.astype(np.uint32) << 16).view(np.float32) if dtype is ir.DType.BF16 else data.astype(np.float32)
    return ir.Tensor(name, dtype, values.shape, data), exact


def build_tiny_graph(cfg: TinyConfig | None = None, **overrides: Any) -> tuple[ir.Graph, dict[str, np.ndarray]]:
    """A verified random graph and its float32 weights by HF name (unfused)."""
    cfg = cfg or TinyConfig()
    for key, value in overrides.items():
        setattr(cfg, key, value)
    rng = np.random.default_rng(cfg.seed)
    h, d, hq, hk, f = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    rot = cfg.rotary_dim or d
    tensors: dict[str, ir.Tensor] = {}
    ref: dict[str, np.ndarray] = {}

    def mat(*shape: int, std: float = 0.15) -> np.ndarray:
        return rng.normal(0.0, std, shape).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.normal(size=n)).astype(np.float32)

    def put(name: str, values: np.ndarray, dtype: ir.DType | None = None) -> str:
        tensors[name], ref[name] = _store(name, values, dtype or cfg.dtype)
        return name

    def put_ref(name: str, values: np.ndarray) -> np.ndarray:
        """A weight that is only stored fused: record its rounded float32 values under its HF name."""
        ref[name] = _store(name, values, cfg.dtype)[1]
        return values

    put("embed_tokens.weight", mat(cfg.vocab_size, h, std=1.0))
    inv_freq = 1.0 / cfg.rope_theta ** (np.arange(0, rot, 2, dtype=np.float32) / rot)
    put("rope.inv_freq", inv_freq, ir.DType.F32)
    ops: list[ir.Op] = [ir.Op("embedding", ["tokens"], ["h0"], {"weight": "embed_tokens.weight"}, source="embed_tokens")]
    x = "h0"
    for i in range(cfg.num_layers):
        p = f"layers.{i}"

        def op(kind: str, inputs: list[str], outputs: list[str], weights=None, attrs=None, src: str = "") -> None:
            ops.append(ir.Op(kind, inputs, outputs, dict(weights or {}), dict(attrs or {}), f"{p}.{src}"))

        def linear(name: str, inp: str, out: str, n_in: int, n_out: int, bias: bool = False) -> None:
            weights = {"weight": put(f"{p}.{name}.weight", mat(n_out, n_in))}
            if bias:
                weights["bias"] = put(f"{p}.{name}.bias", mat(n_out, std=0.1))
            op("linear", [inp], [out], weights, {"in_features": n_in, "out_features": n_out}, name)

        op("rms_norm", [x], [f"{p}.ln1"], {"weight": put(f"{p}.input_layernorm.weight", norm(h))},
           {"eps": cfg.rms_norm_eps, "group": h}, "input_layernorm")
        sizes = (hq * d, hk * d, hk * d)
        if cfg.fused:
            names = ("q_proj", "k_proj", "v_proj")
            w = np.concatenate([put_ref(f"{p}.self_attn.{n}.weight", mat(s, h)) for n, s in zip(names, sizes)])
            weights = {"weight": put(f"{p}.self_attn.qkv_proj.weight", w)}
            if cfg.attention_bias:
                b = np.concatenate([put_ref(f"{p}.self_attn.{n}.bias", mat(s, std=0.1)) for n, s in zip(names, sizes)])
                weights["bias"] = put(f"{p}.self_attn.qkv_proj.bias", b)
            op("linear", [f"{p}.ln1"], [f"{p}.qkv"], weights, {"in_features": h, "out_features": sum(sizes)},
               "self_attn.qkv_proj")
            op("split", [f"{p}.qkv"], [f"{p}.q", f"{p}.k", f"{p}.v"], attrs={"sizes": list(sizes)}, src="self_attn")
        else:
            for n, s in zip("qkv", sizes):
                linear(f"self_attn.{n}_proj", f"{p}.ln1", f"{p}.{n}", h, s, cfg.attention_bias)
        q, k = f"{p}.q", f"{p}.k"
        if cfg.qk_norm:
            for n in ("q", "k"):
                op("rms_norm", [f"{p}.{n}"], [f"{p}.{n}n"], {"weight": put(f"{p}.self_attn.{n}_norm.weight", norm(d))},
                   {"eps": cfg.rms_norm_eps, "group": d}, f"self_attn.{n}_norm")
            q, k = f"{p}.qn", f"{p}.kn"
        op("rope", [q, k], [f"{p}.qr", f"{p}.kr"], {"inv_freq": "rope.inv_freq"},
           {"head_dim": d, "rotary_dim": rot, "num_heads": hq, "num_kv_heads": hk,
            "attention_scaling": cfg.attention_scaling}, "self_attn.rotary")
        op("attention", [f"{p}.qr", f"{p}.kr", f"{p}.v"], [f"{p}.attn"], attrs={
            "layer": i, "num_heads": hq, "num_kv_heads": hk, "head_dim": d, "scale": d**-0.5,
            "sliding_window": cfg.sliding_window}, src="self_attn")
        linear("self_attn.o_proj", f"{p}.attn", f"{p}.o", hq * d, h)
        op("add", [x, f"{p}.o"], [f"{p}.h1"], src="residual")
        op("rms_norm", [f"{p}.h1"], [f"{p}.ln2"], {"weight": put(f"{p}.post_attention_layernorm.weight", norm(h))},
           {"eps": cfg.rms_norm_eps, "group": h}, "post_attention_layernorm")
        if cfg.fused:
            w = np.concatenate([put_ref(f"{p}.mlp.{n}.weight", mat(f, h)) for n in ("gate_proj", "up_proj")])
            op("linear", [f"{p}.ln2"], [f"{p}.gu"], {"weight": put(f"{p}.mlp.gate_up_proj.weight", w)},
               {"in_features": h, "out_features": 2 * f}, "mlp.gate_up_proj")
            op("silu_mul", [f"{p}.gu"], [f"{p}.act"], src="mlp")
        else:
            linear("mlp.gate_proj", f"{p}.ln2", f"{p}.gate", h, f)
            linear("mlp.up_proj", f"{p}.ln2", f"{p}.up", h, f)
            op("silu_mul", [f"{p}.gate", f"{p}.up"], [f"{p}.act"], src="mlp")
        linear("mlp.down_proj", f"{p}.act", f"{p}.mlp", f, h)
        op("add", [f"{p}.h1", f"{p}.mlp"], [f"{p}.out"], src="residual")
        x = f"{p}.out"
    ops.append(ir.Op("rms_norm", [x], ["final"], {"weight": put("norm.weight", norm(h))},
                     {"eps": cfg.rms_norm_eps, "group": h}, "norm"))
    head = "embed_tokens.weight" if cfg.tie_word_embeddings else put("lm_head.weight", mat(cfg.vocab_size, h))
    ref["lm_head.weight"] = ref[head]
    ops.append(ir.Op("lm_head", ["final"], ["logits"], {"weight": head},
                     {"in_features": h, "out_features": cfg.vocab_size}, "lm_head"))
    arch = ir.ArchConfig(
        model_type="llama",
        vocab_size=cfg.vocab_size,
        hidden_size=h,
        num_layers=cfg.num_layers,
        num_heads=hq,
        num_kv_heads=hk,
        head_dim=d,
        intermediate_size=f,
        max_position=cfg.max_position,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=cfg.bos_token_id,
        eos_token_ids=list(cfg.eos_token_ids),
    )
    states = [ir.StateSpec(i, "kv", hk, d) for i in range(cfg.num_layers)]
    graph = ir.Graph(arch, ops, tensors, states)
    ir.verify(graph)
    return graph, ref


# -- tokenizers and artifact contents for engine tests ------------------------------------------------

CORPUS = [
    "the cat sat on the mat",
    "the dog ate the bone",
    "héllo wörld, ça va? naïve café",
    "日本語のテキスト 🙂 emoji 🚀",
]


def byte_level_bpe_json(vocab_size: int = 300) -> str:
    """A byte-level BPE tokenizer.json with <s>, </s> (ids 0, 1) and a BOS-adding post-processor.

    Its merges are few, so multi-byte characters span several tokens (what streaming must handle).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return tok.to_str()


def word_level_json(words: list[str]) -> str:
    """A whitespace word-level tokenizer.json: <unk>=0, <s>=1, </s>=2, then ``words``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return tok.to_str()


CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def tiny_contents(chat_template: str | None = CHAT_TEMPLATE, **graph_overrides: Any) -> Any:
    """Artifact contents of a tiny model over the byte-level BPE tokenizer (vocab 300, BOS 0, EOS 1)."""
    from mgx.formats.artifact import ArtifactContents, Fingerprint, GenerationDefaults

    overrides = {"vocab_size": 300, "bos_token_id": 0, "eos_token_ids": [1], "max_position": 128}
    overrides.update(graph_overrides)
    graph, _ = build_tiny_graph(**overrides)
    return ArtifactContents(
        graph=graph,
        tokenizer_json=byte_level_bpe_json(graph.arch.vocab_size),
        fingerprint=Fingerprint("test", "test", graph.tensors["embed_tokens.weight"].dtype.value, "none", "cpu"),
        chat_template=chat_template,
        generation=GenerationDefaults(max_new_tokens=16),
    )
