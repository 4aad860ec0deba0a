"""Sampling policy: greedy, temperature, top-k, top-p, repetition penalty, seeds, stop ids."""

from __future__ import annotations

import numpy as np
import pytest

from mgx.runtime.sampler import (
    Sampler,
    SamplingParams,
    apply_penalties,
    apply_repetition_penalty,
    probabilities,
)

LOGITS = np.log(np.array([0.05, 0.4, 0.1, 0.3, 0.15], np.float32))


def draws(params: SamplingParams, n: int = 2000, logits: np.ndarray = LOGITS) -> np.ndarray:
    sampler = Sampler(params)
    return np.array([sampler.sample(logits) for _ in range(n)])


def test_greedy_is_argmax_and_leaves_logits_alone() -> None:
    logits = LOGITS.copy()
    assert Sampler(SamplingParams(temperature=0)).sample(logits) == 1
    np.testing.assert_array_equal(logits, LOGITS)


def test_greedy_ties_take_the_first() -> None:
    assert Sampler(SamplingParams(temperature=0)).sample(np.array([1.0, 3.0, 3.0])) == 1


def test_same_seed_same_tokens_other_seed_other_tokens() -> None:
    a = draws(SamplingParams(seed=7), 50)
    assert (a == draws(SamplingParams(seed=7), 50)).all()
    assert (a != draws(SamplingParams(seed=8), 50)).any()


def test_temperature_one_follows_the_softmax() -> None:
    freq = np.bincount(draws(SamplingParams(seed=0), 20000), minlength=5) / 20000
    np.testing.assert_allclose(freq, np.exp(LOGITS), atol=0.015)


def test_low_temperature_sharpens_high_flattens() -> None:
    cold = np.bincount(draws(SamplingParams(temperature=0.1, seed=0)), minlength=5)
    hot = np.bincount(draws(SamplingParams(temperature=10.0, seed=0)), minlength=5)
    assert cold[1] > 0.9 * cold.sum()
    assert hot.min() > 0.12 * hot.sum()


def test_top_k_keeps_only_the_k_best() -> None:
    assert set(draws(SamplingParams(top_k=2, seed=0)).tolist()) == {1, 3}
    np.testing.assert_allclose(probabilities(LOGITS.astype(np.float64), top_k=1), [0, 1, 0, 0, 0])


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    # Ranked: 0.4, 0.3, 0.15, ... -> 0.4 + 0.3 = 0.7 reaches 0.65; 0.7 does not reach 0.75.
    assert set(draws(SamplingParams(top_p=0.65, seed=0)).tolist()) == {1, 3}
    assert set(draws(SamplingParams(top_p=0.75, seed=0)).tolist()) == {1, 3, 4}
    np.testing.assert_allclose(probabilities(LOGITS.astype(np.float64), top_p=0.01), [0, 1, 0, 0, 0])


def test_top_k_then_top_p() -> None:
    probs = probabilities(
        LOGITS.astype(np.float64), top_k=3, top_p=0.5
    )  # top-3 renormalised: 0.47, 0.35, ...
    np.testing.assert_allclose(probs, [0, 0.4 / 0.7, 0, 0.3 / 0.7, 0], atol=1e-6)


def test_repetition_penalty_hf_rule() -> None:
    x = np.array([2.0, -2.0, 1.0])
    apply_repetition_penalty(x, [0, 1, 1], 2.0)
    np.testing.assert_array_equal(x, [1.0, -4.0, 1.0])
    greedy = Sampler(SamplingParams(temperature=0, repetition_penalty=10.0))
    assert greedy.sample(LOGITS, previous=[1]) == 3


def test_min_p_drops_tokens_far_below_the_best() -> None:
    # probs 0.05, 0.4, 0.1, 0.3, 0.15; min_p 0.3 keeps p >= 0.12: tokens 1, 3, 4.
    assert set(draws(SamplingParams(min_p=0.3, seed=0)).tolist()) == {1, 3, 4}
    np.testing.assert_allclose(
        probabilities(LOGITS.astype(np.float64), min_p=0.5), [0, 0.4 / 0.7, 0, 0.3 / 0.7, 0], atol=1e-6
    )


def test_presence_and_frequency_penalties_openai_rule() -> None:
    x = np.zeros(4)
    apply_penalties(x, [2, 2, 2, 0], presence=0.5, frequency=0.25)
    np.testing.assert_allclose(x, [-0.75, 0, -1.25, 0])
    greedy = Sampler(SamplingParams(temperature=0, presence_penalty=2.0))
    assert greedy.sample(LOGITS, output=[1]) == 3  # token 1 was generated: penalised below token 3
    assert greedy.sample(LOGITS, previous=[1]) == 1  # the prompt does not count


def test_logprobs_are_log_softmax_of_the_raw_logits() -> None:
    sampler = Sampler(SamplingParams(temperature=2.0, top_k=1, logprobs=2))
    lp = sampler.logprobs(LOGITS, 4)
    assert lp.token_id == 4 and lp.logprob == pytest.approx(np.log(0.15))
    assert [t for t, _ in lp.top] == [1, 3]
    assert [v for _, v in lp.top] == pytest.approx([np.log(0.4), np.log(0.3)])
    assert Sampler(SamplingParams(logprobs=0)).logprobs(LOGITS, 1).top == ()


def test_stop_tokens() -> None:
    sampler = Sampler(SamplingParams(stop_token_ids=(2, 9)))
    assert sampler.is_stop(9) and not sampler.is_stop(3)


@pytest.mark.parametrize(
    "bad",
    [
        {"temperature": -1},
        {"top_p": 0},
        {"top_p": 1.5},
        {"top_k": -1},
        {"max_tokens": 0},
        {"repetition_penalty": 0},
        {"min_p": 1.5},
        {"presence_penalty": 3},
        {"frequency_penalty": -3},
        {"logprobs": -1},
        {"stop": ("",)},
    ],
)
def test_invalid_params_are_refused(bad: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(bad)).replace("stop", "stop strings")):
        SamplingParams(**bad)


def test_a_single_stop_string_is_a_tuple_of_one() -> None:
    assert SamplingParams(stop="###").stop == ("###",)


def test_out_of_range_seed_is_refused_when_the_request_is_made() -> None:
    import pytest

    from mgx.runtime.sampler import SamplingParams

    with pytest.raises(ValueError, match="seed must be in"):
        SamplingParams(seed=-1)
    SamplingParams(seed=2**64 - 1)
