"""Tiny random Hugging Face models of every supported family, saved as HF folders for the compiler."""

from __future__ import annotations

import json
from pathlib import Path

CORPUS = (
    "The quick brown fox jumps over the lazy dog. MGX compiles language models ahead of time. "
    "A paged cache keeps keys and values in blocks. Hello world, hello there! 0123456789 "
    "Caf\u00e9 na\u00efve \u00fcber \u65e5\u672c\u8a9e emoji \U0001F600 tabs\tand\nnewlines. "
) * 4

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

FAMILIES = ("llama", "llama3_rope", "qwen2", "qwen3", "mistral")


def build_tokenizer(folder: Path, vocab_size: int = 320) -> int:
    """A byte-level BPE trained on a small corpus, with the files AutoTokenizer reads; returns its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS], trainer=trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE,
    }))
    return tok.get_vocab_size()


def make_config(family: str, vocab_size: int = 256):
    """A small config of ``family`` (llama3_rope: Llama with Llama-3 RoPE scaling)."""
    import transformers as tf

    common = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
        initializer_range=0.15, bos_token_id=None, eos_token_id=2, pad_token_id=0,
    )
    if family == "llama":
        return tf.LlamaConfig(**common, tie_word_embeddings=False)
    if family == "llama3_rope":
        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32, "rope_theta": 500000.0}
        return tf.LlamaConfig(**common, tie_word_embeddings=True, rope_parameters=rope)
    if family == "qwen2":
        return tf.Qwen2Config(**common, tie_word_embeddings=False)
    if family == "qwen3":
        return tf.Qwen3Config(**{**common, "num_hidden_layers": 3}, head_dim=32, tie_word_embeddings=True)
    if family == "mistral":
        return tf.MistralConfig(**common, sliding_window=12, tie_word_embeddings=False)
    raise ValueError(family)


def build_model_dir(folder: Path, family: str, seed: int = 0) -> Path:
    """Save a random ``family`` model with a tokenizer into ``folder``; returns the folder."""
    import torch
    from transformers import AutoModelForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    vocab_size = build_tokenizer(folder)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_config(family, vocab_size))
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def write_spec(folder: Path, family: str, dtype: str = "fp32", prompts: list | None = None,
               max_new_tokens: int = 64, extra: str = "") -> Path:
    """A model.yaml for a tiny model folder."""
    prompts = prompts or ["Hello world", "The quick brown fox", {"text": "hello there", "chat": True}]
    lines = [f"name: tiny-{family}", "source:", f"  hf_dir: {folder}", f"dtype: {dtype}", "golden:",
             f"  max_new_tokens: {max_new_tokens}", "  logit_atol: 0.0001", "  prompts:"]
    for p in prompts:
        lines.append(f"    - {json.dumps(p)}")
    path = folder.parent / f"tiny-{family}.yaml"
    path.write_text("\n".join(lines) + "\n" + extra)
    return path
