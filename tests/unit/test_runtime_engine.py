"""The engine on tiny in-memory models: generation, streaming, defaults, limits and golden checks."""

from __future__ import annotations

import numpy as np
import pytest

from mgx.formats.artifact import GenerationDefaults, GoldenCase, GoldenSet
from mgx.runtime import Engine, GenerationResult, TextDelta, check_golden
from mgx.runtime.batch import SeqChunk
from mgx.runtime.errors import ChatTemplateError, PromptError

from _tiny_graph import tiny_contents


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.from_contents(tiny_contents())


def full_forward_argmax(engine: Engine, ids: list[int]) -> tuple[int, float]:
    """The next greedy token and its logit, from one forward over all of ``ids`` (a fresh sequence)."""
    (logits,) = engine.runner.step([SeqChunk(-1, ids)])
    engine.runner.free(-1)
    return int(np.argmax(logits[-1])), float(logits[-1].max())


def test_greedy_generation_is_argmax_of_full_forwards(engine: Engine) -> None:
    result = engine.generate("the cat", max_tokens=6, temperature=0)
    assert isinstance(result, GenerationResult)
    prompt = engine.tokenizer.encode("the cat")
    assert result.prompt_tokens == len(prompt) and len(result.token_ids) == 6
    ids = list(prompt)
    for token in result.token_ids:
        assert token == full_forward_argmax(engine, ids)[0]
        ids.append(token)
    assert result.finish_reason == "length"
    assert result.text == engine.tokenizer.decode(result.token_ids)
    t = result.timings
    assert t.prefill_s > 0 and t.decode_s > 0 and t.decode_steps == 5 and t.tokens_per_s > 0


def test_greedy_with_logits(engine: Engine) -> None:
    prompt = engine.tokenizer.encode("the dog")
    ids, top1 = engine.greedy_with_logits(prompt, 4)
    assert len(ids) == len(top1) == 4
    assert (ids[0], top1[0]) == pytest.approx(full_forward_argmax(engine, prompt))
    assert ids == engine.generate(prompt, max_tokens=4, temperature=0).token_ids


def test_streaming_yields_deltas_then_the_result(engine: Engine) -> None:
    events = list(engine.generate("the", max_tokens=5, temperature=1.0, seed=1, stream=True))
    *deltas, result = events
    assert all(isinstance(e, TextDelta) for e in deltas) and isinstance(result, GenerationResult)
    assert "".join(d.text for d in deltas) == result.text
    assert [d.token_id for d in deltas if d.token_id is not None] == result.token_ids


def test_seeds_make_sampling_reproducible(engine: Engine) -> None:
    run = lambda seed: engine.generate("the", max_tokens=8, temperature=1.5, seed=seed).token_ids  # noqa: E731
    assert run(3) == run(3)
    assert run(3) != run(4)


def test_stop_tokens_end_generation(engine: Engine) -> None:
    first = engine.generate("the cat", max_tokens=3, temperature=0).token_ids
    contents = tiny_contents()
    contents.generation = GenerationDefaults(stop_token_ids=[first[1]])
    result = Engine.from_contents(contents).generate("the cat", max_tokens=3, temperature=0)
    assert result.finish_reason == "stop" and result.token_ids == first[:2]  # the stop token is kept
    assert result.text == engine.tokenizer.decode(first[:1])  # but not printed


def test_defaults_come_from_the_artifact() -> None:
    contents = tiny_contents()
    contents.generation = GenerationDefaults(max_new_tokens=3, temperature=0.0)
    engine = Engine.from_contents(contents)
    assert len(engine.generate("the").token_ids) == 3
    params = engine.sampling_params(top_k=5)
    assert (params.max_tokens, params.temperature, params.top_k, params.stop_token_ids) == (3, 0.0, 5, (1,))


def test_chat_prompts_go_through_the_template(engine: Engine) -> None:
    chat = engine.generate("hi", max_tokens=1, chat=True)
    assert chat.prompt_tokens == len(
        engine.tokenizer.encode("<s><|user|>hi</s><|assistant|>", add_special_tokens=False)
    )
    no_template = Engine.from_contents(tiny_contents(chat_template=None))
    with pytest.raises(ChatTemplateError, match="no chat template"):
        no_template.generate("hi", chat=True)


def test_bad_prompts_are_refused(engine: Engine) -> None:
    with pytest.raises(PromptError, match="context of 128 tokens"):
        engine.generate("the cat " * 30, max_tokens=100)
    with pytest.raises(PromptError, match="empty"):
        engine.generate([])
    with pytest.raises(PromptError, match="outside the vocabulary"):
        engine.generate([5, 300])
    with pytest.raises(ValueError, match="top_p"):
        engine.generate("the", top_p=2.0)


def test_sequences_are_freed(engine: Engine) -> None:
    engine.generate("the", max_tokens=2)
    stream = engine.generate("the", max_tokens=5, stream=True)
    next(stream)
    stream.close()  # a reader that stops early
    assert engine.blocks.num_used_blocks == 0 and not engine.has_unfinished()


def golden_for(engine: Engine, prompts: list[str], n: int = 5, atol: float = 1e-4):
    cases = []
    for prompt in prompts:
        ids = engine.tokenizer.encode(prompt)
        expected, logits = engine.greedy_with_logits(ids, n)
        cases.append(GoldenCase(prompt, False, ids, expected, logits))
    return GoldenSet(cases, atol)


def test_golden_check_passes_on_its_own_outputs(engine: Engine) -> None:
    report = check_golden(engine, golden_for(engine, ["the cat", "héllo"]))
    assert report.ok and [c.tokens for c in report.cases] == [5, 5]
    assert all(c.max_logit_error <= 1e-6 for c in report.cases)


def test_golden_check_reports_the_first_divergence(engine: Engine) -> None:
    golden = golden_for(engine, ["the cat", "the dog", "ça va"])
    real = golden.cases[1].expected_ids[3]
    golden.cases[1].expected_ids[3] = (real + 1) % 300
    golden.cases[2].expected_top1_logits[2] += 0.1
    report = check_golden(engine, golden)
    assert not report.ok and report.cases[0].ok
    token = report.cases[1].divergence
    assert (token.kind, token.position, token.got_id) == ("token", 3, real)
    assert report.first_failure is report.cases[1]
    logit = report.cases[2].divergence
    assert (logit.kind, logit.position) == ("logit", 2) and "expected" in logit.describe()


def test_golden_check_catches_tokenizer_drift(engine: Engine) -> None:
    golden = golden_for(engine, ["the cat"])
    golden.cases[0].prompt_ids = golden.cases[0].prompt_ids[1:]  # recorded without BOS
    div = check_golden(engine, golden).cases[0].divergence
    assert div.kind == "prompt" and div.position == 0 and div.got_id == 0
