"""Record golden outputs: greedy continuations of the spec's prompts by Hugging Face transformers.

The reference runs the source model on the weights as stored in the artifact (rounded to its dtype)
and computes in fp32, which is what the runtime's reference path does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mgx.formats.artifact import GoldenCase, GoldenSet

from .spec import GoldenSpec

__all__ = ["encode_prompt", "greedy_reference", "record_golden", "write_golden_json"]


def encode_prompt(tokenizer: Any, text: str, chat: bool) -> list[int]:
    """Token ids of a prompt as the runtime builds them (chat: template, then no extra specials)."""
    if chat:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                 tokenize=False)
        return list(tokenizer(rendered, add_special_tokens=False).input_ids)
    return list(tokenizer(text).input_ids)


def hf_cache_keyword(model: Any) -> str:
    """The keyword by which a transformers model's ``forward`` takes its KV cache: ``cache`` since
    transformers renamed ``past_key_values`` (which it then deprecated), else ``past_key_values``."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def greedy_reference(model: Any, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy ids and each step's top-1 logit from the HF model, with its KV cache, ignoring EOS."""
    import torch

    cache_kw = hf_cache_keyword(model)
    ids: list[int] = []
    top1: list[float] = []
    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt_ids], dtype=torch.long), use_cache=True)
        for _ in range(max_new_tokens):
            logits = out.logits[0, -1].to(torch.float32)
            token = int(torch.argmax(logits))
            ids.append(token)
            top1.append(float(logits[token]))
            if len(ids) == max_new_tokens:
                break
            out = model(input_ids=torch.tensor([[token]]), use_cache=True, **{cache_kw: out.past_key_values})
    return ids, top1


def record_golden(model: Any, tokenizer: Any, spec: GoldenSpec) -> GoldenSet | None:
    """Run every golden prompt through the reference model."""
    if not spec.prompts:
        return None
    cases = []
    for prompt in spec.prompts:
        prompt_ids = encode_prompt(tokenizer, prompt.text, prompt.chat)
        ids, top1 = greedy_reference(model, prompt_ids, spec.max_new_tokens)
        cases.append(GoldenCase(prompt.text, prompt.chat, prompt_ids, ids, top1))
    return GoldenSet(cases, spec.logit_atol)


def write_golden_json(path: Path, model_name: str, fingerprint: dict[str, Any], golden: GoldenSet) -> None:
    """The golden set as reviewable JSON (``golden/<model>.json``)."""
    doc = {
        "model": model_name,
        "fingerprint": fingerprint,
        "logit_atol": golden.logit_atol,
        "cases": [
            {
                "prompt": c.prompt,
                "chat": c.chat,
                "prompt_ids": list(c.prompt_ids),
                "expected_ids": list(c.expected_ids),
                "expected_top1_logits": [round(float(x), 6) for x in c.expected_top1_logits],
            }
            for c in golden.cases
        ],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
