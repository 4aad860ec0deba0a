"""The serving engine on the real SmolLM2-135M (fp32): batched greedy tokens equal solo ones, and the
prefix cache skips a shared system prompt without changing the output. Kept small: the numpy
reference backend decodes this model at about 10 tokens/s alone."""

from __future__ import annotations

import random

import pytest

from mgx.runtime import Engine, EngineConfig, SamplingParams

pytestmark = pytest.mark.slow

TEXT = (
    "The history of computing is a story of machines that learned to remember. Early calculators held "
    "a handful of digits; today a language model keeps the keys and values of every token it has read "
    "in a cache, so that each new word costs only one step. Serving many users at once means sharing "
    "that cache fairly: blocks are handed out as sequences grow, and when memory runs short the newest "
    "request waits its turn. Paris is the capital of France, and the Seine flows through it."
)
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine_and_workload(smollm2):  # noqa: ANN001
    engine = Engine(smollm2.artifact, config=EngineConfig(prefix_caching=False))
    ids = engine.tokenizer.encode(TEXT, add_special_tokens=False)
    rng = random.Random(0)
    workload = []
    for _ in range(32):
        n = rng.randint(8, 40)
        start = rng.randrange(0, len(ids) - n)
        workload.append((ids[start : start + n], rng.randint(4, 16)))
    solo = [engine.generate(p, max_tokens=n, **GREEDY).token_ids for p, n in workload]
    return smollm2.artifact, workload, solo


def drive(engine: Engine, workload, stagger: random.Random | None = None) -> list[list[int]]:
    ids: dict[str, int] = {}
    got: dict[int, list[int]] = {i: [] for i in range(len(workload))}
    todo = list(enumerate(workload))
    while todo or engine.has_unfinished():
        for _ in range(len(todo) if stagger is None else stagger.randint(0, 4)):
            if todo:
                i, (prompt, n) = todo.pop(0)
                ids[engine.add_request(prompt, SamplingParams(max_tokens=n, **GREEDY))] = i
        for out in engine.step():
            got[ids[out.request_id]] += out.token_ids
    assert engine.blocks.num_used_blocks == 0
    return [got[i] for i in range(len(workload))]


def test_smollm2_batch_invariance_all_at_once(engine_and_workload) -> None:  # noqa: ANN001
    artifact, workload, solo = engine_and_workload
    engine = Engine(artifact, config=EngineConfig(max_num_seqs=32, max_tokens_per_step=1024))
    assert drive(engine, workload) == solo


def test_smollm2_batch_invariance_staggered_chunked_and_preempted(engine_and_workload) -> None:  # noqa: ANN001
    artifact, workload, solo = engine_and_workload
    # 32 blocks of 16 = 512 tokens for 16 running sequences of up to 56: chunked prefill (96 tokens a
    # step) and preemption. 46080 bytes/token: 30 layers x K and V x 3 kv heads x 64 x float32.
    config = EngineConfig(kv_memory=32 * 16 * 46080, max_num_seqs=16, max_tokens_per_step=96)
    engine = Engine(artifact, config=config)
    assert engine.cache_plan.num_blocks == 32
    assert drive(engine, workload, stagger=random.Random(1)) == solo
    assert engine.metrics.counters.preemptions > 0


def test_smollm2_prefix_cache_skips_the_system_prompt(engine_and_workload) -> None:  # noqa: ANN001
    artifact, _, _ = engine_and_workload
    engine = Engine(artifact)
    system = {"role": "system", "content": "You are a terse assistant. " + TEXT[:200]}

    def prompt(question: str) -> list[int]:
        text = engine.tokenizer.render_chat([system, {"role": "user", "content": question}])
        return engine.tokenizer.encode(text, add_special_tokens=False)

    first, second = prompt("What is the capital of France?"), prompt("Name a river.")
    shared = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
    engine.generate(first, max_tokens=4, **GREEDY)
    before = engine.metrics.counters.computed_tokens
    result = engine.generate(second, max_tokens=6, **GREEDY)
    cached = shared // 16 * 16
    assert cached >= 32 and result.metrics.cached_tokens == cached
    assert engine.metrics.counters.computed_tokens - before == len(second) - cached + 5
    cold = Engine(artifact, config=EngineConfig(prefix_caching=False))
    assert result.token_ids == cold.generate(second, max_tokens=6, **GREEDY).token_ids
