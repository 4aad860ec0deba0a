"""The runtime's greedy outputs and logits against Hugging Face transformers on the same weights (fp32).

Rules: greedy token ids identical for 64 new tokens; max |logit difference| over every vocabulary
entry at every step (teacher-forced on the reference's tokens) at most 1e-4 on the tiny models and
1e-2 on SmolLM2-135M-Instruct.
"""

from __future__ import annotations

import numpy as np
import pytest

from _tiny_hf import FAMILIES

TINY_ATOL = 1e-4
SMOLLM2_ATOL = 1e-2


def _hf_logits(model, ids: list[int]) -> np.ndarray:  # noqa: ANN001
    import torch

    with torch.no_grad():
        return model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float().numpy()


def _runtime_logits(engine, prompt_ids: list[int], continuation: list[int]) -> np.ndarray:  # noqa: ANN001
    """Logits after the prompt and after each continuation token but the last: [len(continuation), V].

    Fed the reference's tokens; where the argmax of every row equals the reference's next token this
    is exactly the runtime's own greedy run.
    """
    from mgx.runtime.batch import SeqChunk

    runner = engine.runner
    seq = 10_000
    rows = []
    try:
        (logits,) = runner.step([SeqChunk(seq, prompt_ids)])
        rows.append(logits[-1])
        for token in continuation[:-1]:
            (logits,) = runner.step([SeqChunk(seq, [token])])
            rows.append(logits[-1])
    finally:
        runner.free(seq)
    return np.stack(rows)


def _check_model(built, atol: float) -> list[float]:  # noqa: ANN001
    from mgx.runtime import Engine

    engine = Engine(built.artifact)
    golden = built.result.golden
    errors = []
    for case in golden.cases:
        assert engine.encode_prompt(case.prompt, chat=case.chat) == list(case.prompt_ids), case.prompt
        ours = _runtime_logits(engine, list(case.prompt_ids), list(case.expected_ids))
        ids = [int(i) for i in np.argmax(ours, axis=-1)]
        assert ids == list(case.expected_ids), f"{built.family} {case.prompt!r}: greedy tokens differ"
        full = _hf_logits(built.source.model, list(case.prompt_ids) + list(case.expected_ids[:-1]))
        ref = full[len(case.prompt_ids) - 1 :]
        assert ours.shape == ref.shape
        err = float(np.max(np.abs(ours - ref)))
        errors.append(err)
        assert err <= atol, f"{built.family} {case.prompt!r}: max |logit diff| {err:.3g} > {atol}"
    return errors


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_model_matches_transformers(tiny_models, family: str) -> None:  # noqa: ANN001
    built = tiny_models[family]
    assert len(built.result.golden.cases) == 4
    assert all(len(c.expected_ids) == 64 for c in built.result.golden.cases)
    errors = _check_model(built, TINY_ATOL)
    print(f"{family}: max |logit diff| {max(errors):.2e}")


@pytest.mark.slow
def test_smollm2_matches_transformers(smollm2) -> None:  # noqa: ANN001
    assert len(smollm2.result.golden.cases) == 5
    errors = _check_model(smollm2, SMOLLM2_ATOL)
    print(f"smollm2: max |logit diff| {max(errors):.2e}")
