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
    exact = (
        (data.astype(np.uint32) << 16).view(np.float32) if dtype is ir.DType.BF16 else data.astype(np.float32)
    )
    return ir.Tensor(name, dtype, values.shape, data), exact


def build_tiny_graph(
    cfg: TinyConfig | None = None, **overrides: Any
) -> tuple[ir.Graph, dict[str, np.ndarray]]:
    """A verified random graph and its float32 weights by HF name (unfused)."""
    cfg = cfg or TinyConfig()
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return _Builder(cfg).build()


class _Builder:
    """Emits ops and random weights layer by layer, in the order the compiler's lowering does."""

    def __init__(self, cfg: TinyConfig) -> None:
        self.cfg = cfg
        self.rng = np.random.default_rng(cfg.seed)
        self.ops: list[ir.Op] = []
        self.tensors: dict[str, ir.Tensor] = {}
        self.ref: dict[str, np.ndarray] = {}  # HF name -> float32 values as stored (after rounding)

    # -- weights -----------------------------------------------------------------------------------

    def mat(self, *shape: int, std: float = 0.15) -> np.ndarray:
        return self.rng.normal(0.0, std, shape).astype(np.float32)

    def norm(self, n: int) -> np.ndarray:
        return (1.0 + 0.1 * self.rng.normal(size=n)).astype(np.float32)

    def put(self, name: str, values: np.ndarray, dtype: ir.DType | None = None) -> str:
        """Store a tensor in the graph; returns its name."""
        self.tensors[name], self.ref[name] = _store(name, values, dtype or self.cfg.dtype)
        return name

    def put_ref(self, name: str, values: np.ndarray) -> np.ndarray:
        """A weight stored only fused: record its rounded float32 values under its HF name."""
        self.ref[name] = _store(name, values, self.cfg.dtype)[1]
        return values

    # -- ops ---------------------------------------------------------------------------------------

    def op(
        self, kind: str, inputs: list[str], outputs: list[str], source: str, weights=None, attrs=None
    ) -> str:
        self.ops.append(ir.Op(kind, inputs, outputs, dict(weights or {}), dict(attrs or {}), source))
        return outputs[0]

    def linear(self, name: str, x: str, n_in: int, n_out: int, *, bias: bool = False) -> str:
        weights = {"weight": self.put(f"{name}.weight", self.mat(n_out, n_in))}
        if bias:
            weights["bias"] = self.put(f"{name}.bias", self.mat(n_out, std=0.1))
        return self.op("linear", [x], [name], name, weights, {"in_features": n_in, "out_features": n_out})

    def fused_linear(self, name: str, parts: dict[str, int], x: str, n_in: int, *, bias: bool = False) -> str:
        """One projection for several HF ones (``parts``: HF module name -> width), stacked in order."""
        w = [self.put_ref(f"{p}.weight", self.mat(n, n_in)) for p, n in parts.items()]
        weights = {"weight": self.put(f"{name}.weight", np.concatenate(w))}
        if bias:
            b = [self.put_ref(f"{p}.bias", self.mat(n, std=0.1)) for p, n in parts.items()]
            weights["bias"] = self.put(f"{name}.bias", np.concatenate(b))
        attrs = {"in_features": n_in, "out_features": sum(parts.values())}
        return self.op("linear", [x], [name], name, weights, attrs)

    def rms_norm(self, name: str, x: str, group: int, out: str) -> str:
        weights = {"weight": self.put(f"{name}.weight", self.norm(group))}
        return self.op("rms_norm", [x], [out], name, weights, {"eps": self.cfg.rms_norm_eps, "group": group})

    def attention(self, p: str, layer: int, x: str) -> str:
        cfg = self.cfg
        h, d, hq, hk = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        bias = cfg.attention_bias
        if cfg.fused:
            parts = {f"{p}.q_proj": hq * d, f"{p}.k_proj": hk * d, f"{p}.v_proj": hk * d}
            qkv = self.fused_linear(f"{p}.qkv_proj", parts, x, h, bias=bias)
            sizes = list(parts.values())
            self.op("split", [qkv], [f"{p}.q", f"{p}.k", f"{p}.v"], p, attrs={"sizes": sizes})
            q, k, v = f"{p}.q", f"{p}.k", f"{p}.v"
        else:
            q = self.linear(f"{p}.q_proj", x, h, hq * d, bias=bias)
            k = self.linear(f"{p}.k_proj", x, h, hk * d, bias=bias)
            v = self.linear(f"{p}.v_proj", x, h, hk * d, bias=bias)
        if cfg.qk_norm:
            q = self.rms_norm(f"{p}.q_norm", q, d, f"{p}.qn")
            k = self.rms_norm(f"{p}.k_norm", k, d, f"{p}.kn")
        rope_attrs = {
            "head_dim": d,
            "rotary_dim": cfg.rotary_dim or d,
            "num_heads": hq,
            "num_kv_heads": hk,
            "attention_scaling": cfg.attention_scaling,
        }
        self.op(
            "rope", [q, k], [f"{p}.qr", f"{p}.kr"], f"{p}.rotary", {"inv_freq": "rope.inv_freq"}, rope_attrs
        )
        attn_attrs = {
            "layer": layer,
            "num_heads": hq,
            "num_kv_heads": hk,
            "head_dim": d,
            "scale": d**-0.5,
            "sliding_window": cfg.sliding_window,
        }
        a = self.op("attention", [f"{p}.qr", f"{p}.kr", v], [f"{p}.attn"], p, attrs=attn_attrs)
        return self.linear(f"{p}.o_proj", a, hq * d, h)

    def mlp(self, p: str, x: str) -> str:
        h, f = self.cfg.hidden_size, self.cfg.intermediate_size
        if self.cfg.fused:
            gu = self.fused_linear(f"{p}.gate_up_proj", {f"{p}.gate_proj": f, f"{p}.up_proj": f}, x, h)
            act = self.op("silu_mul", [gu], [f"{p}.act"], p)
        else:
            gate, up = self.linear(f"{p}.gate_proj", x, h, f), self.linear(f"{p}.up_proj", x, h, f)
            act = self.op("silu_mul", [gate, up], [f"{p}.act"], p)
        return self.linear(f"{p}.down_proj", act, f, h)

    # -- the model ---------------------------------------------------------------------------------

    def build(self) -> tuple[ir.Graph, dict[str, np.ndarray]]:
        cfg = self.cfg
        h, v = cfg.hidden_size, cfg.vocab_size
        rot = cfg.rotary_dim or cfg.head_dim
        self.put("embed_tokens.weight", self.mat(v, h, std=1.0))
        self.put(
            "rope.inv_freq",
            1.0 / cfg.rope_theta ** (np.arange(0, rot, 2, dtype=np.float32) / rot),
            ir.DType.F32,
        )
        x = self.op("embedding", ["tokens"], ["h0"], "embed_tokens", {"weight": "embed_tokens.weight"})
        for i in range(cfg.num_layers):
            p = f"layers.{i}"
            attn = self.attention(
                f"{p}.self_attn", i, self.rms_norm(f"{p}.input_layernorm", x, h, f"{p}.ln1")
            )
            x = self.op("add", [x, attn], [f"{p}.h1"], p)
            mlp = self.mlp(f"{p}.mlp", self.rms_norm(f"{p}.post_attention_layernorm", x, h, f"{p}.ln2"))
            x = self.op("add", [x, mlp], [f"{p}.out"], p)
        x = self.rms_norm("norm", x, h, "final")
        head = (
            "embed_tokens.weight" if cfg.tie_word_embeddings else self.put("lm_head.weight", self.mat(v, h))
        )
        self.ref["lm_head.weight"] = self.ref[head]
        self.op(
            "lm_head", [x], ["logits"], "lm_head", {"weight": head}, {"in_features": h, "out_features": v}
        )
        arch = ir.ArchConfig(
            model_type="llama",
            vocab_size=v,
            hidden_size=h,
            num_layers=cfg.num_layers,
            num_heads=cfg.num_heads,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            intermediate_size=cfg.intermediate_size,
            max_position=cfg.max_position,
            rms_norm_eps=cfg.rms_norm_eps,
            rope_theta=cfg.rope_theta,
            tie_word_embeddings=cfg.tie_word_embeddings,
            bos_token_id=cfg.bos_token_id,
            eos_token_ids=list(cfg.eos_token_ids),
        )
        states = [ir.StateSpec(i, "kv", cfg.num_kv_heads, cfg.head_dim) for i in range(cfg.num_layers)]
        graph = ir.Graph(arch, self.ops, self.tensors, states)
        ir.verify(graph)
        return graph, self.ref


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
        fingerprint=Fingerprint(
            "test", "test", graph.tensors["embed_tokens.weight"].dtype.value, "none", "cpu"
        ),
        chat_template=chat_template,
        generation=GenerationDefaults(max_new_tokens=16),
    )
