"""The official ``openai`` client against a real ``mgx-run serve`` server on a free loopback port.

Every answer is compared with the engine's offline output for the same request (same artifact, same
sampling parameters), so the HTTP layer can neither lose, reorder nor alter tokens.
"""

from __future__ import annotations

from pathlib import Path

import httpx2
import openai
import pytest
from _server_testing import MODEL, running_server

from mgx.formats.artifact import write_artifact
from mgx.runtime import Engine

from _tiny_graph import tiny_contents

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "the cat sat"}]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("serve") / "tiny.mgx"
    write_artifact(path, tiny_contents())
    return path


@pytest.fixture(scope="module")
def server(artifact: Path):
    with running_server(artifact) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def offline(artifact: Path) -> Engine:
    return Engine(artifact)


def chat_ids(engine: Engine, messages: list[dict]) -> list[int]:
    tok = engine.tokenizer
    return tok.encode(tok.render_chat(messages), add_special_tokens=False)


def clean_stop(text: str) -> str:
    """A two-character piece of ``text`` past its start, made of whole characters, to use as a stop."""
    for i in range(1, len(text) - 1):
        piece = text[i : i + 2]
        if "\ufffd" not in piece and piece.strip():
            return piece
    pytest.skip("no clean two-character piece in this random model's output")


def test_models_and_health(client, server) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert httpx2.get(f"{server.url}/health").json() == {"status": "ok"}


def test_completion_equals_offline(client, offline) -> None:
    want = offline.generate("the cat", max_tokens=8, temperature=0.0)
    got = client.completions.create(model=MODEL, prompt="the cat", max_tokens=8, temperature=0)
    assert got.object == "text_completion" and got.model == MODEL and len(got.choices) == 1
    assert got.choices[0].text == want.text and got.choices[0].finish_reason == want.finish_reason
    assert got.usage.prompt_tokens == want.prompt_tokens == len(offline.encode_prompt("the cat"))
    assert got.usage.completion_tokens == len(want.token_ids)
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens


def test_completion_stream_equals_offline(client, offline) -> None:
    want = offline.generate("the dog", max_tokens=10, temperature=0.0)
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="the dog", max_tokens=10, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    *body, last = chunks
    assert "".join(c.choices[0].text for c in body) == want.text
    assert [c.choices[0].finish_reason for c in body][-1] == want.finish_reason
    assert all(c.choices[0].finish_reason is None for c in body[:-1]) and all(c.usage is None for c in body)
    assert last.choices == [] and last.usage.completion_tokens == len(want.token_ids)
    assert last.usage.prompt_tokens == want.prompt_tokens
    assert len({c.id for c in chunks}) == 1


def test_batched_prompts_and_token_id_prompts(client, offline) -> None:
    prompts = ["the cat", "héllo wörld", "日本"]
    got = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0, n=2)
    assert [c.index for c in got.choices] == list(range(6))
    for i, p in enumerate(prompts):
        want = offline.generate(p, max_tokens=6, temperature=0.0).text
        assert got.choices[2 * i].text == got.choices[2 * i + 1].text == want
    ids = offline.encode_prompt("the mat")
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == offline.generate(ids, max_tokens=6, temperature=0.0).text


def test_chat_equals_offline_with_the_artifacts_template(client, offline) -> None:
    ids = chat_ids(offline, MESSAGES)
    assert offline.tokenizer.decode(ids, skip_special_tokens=False).startswith(
        "<s><|system|>You are terse.</s>"
    )
    want = offline.generate(ids, max_tokens=9, temperature=0.0)
    got = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=9, temperature=0)
    assert got.object == "chat.completion"
    msg = got.choices[0].message
    assert msg.role == "assistant" and msg.content == want.text
    assert got.choices[0].finish_reason == want.finish_reason
    assert got.usage.prompt_tokens == len(ids) and got.usage.completion_tokens == len(want.token_ids)
    # max_completion_tokens (what newer clients send) means the same
    again = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_completion_tokens=9, temperature=0
    )
    assert again.choices[0].message.content == want.text


def test_chat_stream_equals_offline(client, offline) -> None:
    messages = [{"role": "user", "content": "héllo wörld"}]
    ids = chat_ids(offline, messages)
    assert ids == offline.encode_prompt("héllo wörld", chat=True)
    want = offline.generate(ids, max_tokens=12, temperature=0.0)
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=12, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].object == "chat.completion.chunk"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == want.finish_reason
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


@pytest.mark.parametrize("stream", [False, True])
def test_stop_sequences(client, offline, stream: bool) -> None:
    full = offline.generate("the cat", max_tokens=24, temperature=0.0)
    stop = clean_stop(full.text)
    want = offline.generate("the cat", max_tokens=24, temperature=0.0, stop=[stop, "zzzz"])
    assert want.finish_reason == "stop" and stop not in want.text
    got = client.completions.create(
        model=MODEL, prompt="the cat", max_tokens=24, temperature=0, stop=[stop, "zzzz"], stream=stream
    )
    if stream:
        chunks = list(got)
        text, reason = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
    else:
        text, reason = got.choices[0].text, got.choices[0].finish_reason
    assert (text, reason) == (want.text, "stop")
    chat_want = offline.generate(chat_ids(offline, MESSAGES), max_tokens=24, temperature=0.0)
    chat_stop = clean_stop(chat_want.text)
    cut = offline.generate(chat_ids(offline, MESSAGES), max_tokens=24, temperature=0.0, stop=chat_stop)
    got = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0, stop=chat_stop
    )
    assert got.choices[0].message.content == cut.text and got.choices[0].finish_reason == "stop"


def test_seeds_reproduce_and_match_offline(client, offline) -> None:
    # top_k is not in OpenAI's API: the client sends it as an extra field, as for vLLM
    kw = dict(
        model=MODEL, prompt="the cat", max_tokens=12, temperature=1.0, top_p=0.95, extra_body={"top_k": 50}
    )

    def text(**extra) -> list[str]:
        return [c.text for c in client.completions.create(**kw, **extra).choices]

    first, second = text(seed=7), text(seed=7)
    assert first == second
    want = offline.generate("the cat", max_tokens=12, temperature=1.0, top_p=0.95, top_k=50, seed=7)
    assert first == [want.text]
    assert text(seed=8) != first
    # OpenAI takes negative seeds; they wrap to unsigned 64-bit ones
    wrapped = offline.generate(
        "the cat", max_tokens=12, temperature=1.0, top_p=0.95, top_k=50, seed=2**64 - 5
    )
    assert text(seed=-5) == [wrapped.text]
    # n choices of one seeded request use seed, seed+1, ...: distinct, and each reproducible offline
    two = client.completions.create(**kw, seed=7, n=2)
    assert [c.text for c in two.choices] == [
        want.text, offline.generate("the cat", max_tokens=12, temperature=1.0, top_p=0.95, top_k=50, seed=8).text,
    ]  # fmt: skip
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0.9, seed=3
    )
    chat_want = offline.generate(chat_ids(offline, MESSAGES), max_tokens=10, temperature=0.9, seed=3)
    assert chat.choices[0].message.content == chat_want.text


def test_penalties_match_offline(client, offline) -> None:
    prompt = [5, 6, 7]  # the random model repeats itself after these ids
    opts = dict(max_tokens=16, temperature=0.0, presence_penalty=2.0, frequency_penalty=1.0)
    want = offline.generate(prompt, **opts)
    got = client.completions.create(model=MODEL, prompt=prompt, **opts)
    assert got.choices[0].text == want.text
    assert want.token_ids != offline.generate(prompt, max_tokens=16, temperature=0.0).token_ids


def test_completion_logprobs_equal_offline(client, offline) -> None:
    want = offline.generate("the cat", max_tokens=5, temperature=0.0, logprobs=3)
    for stream in (False, True):
        got = client.completions.create(
            model=MODEL, prompt="the cat", max_tokens=5, temperature=0, logprobs=3, stream=stream
        )
        if stream:
            parts = [c.choices[0].logprobs for c in got if c.choices[0].logprobs is not None]
            token_logprobs = [x for p in parts for x in p.token_logprobs]
            top = [x for p in parts for x in p.top_logprobs]
        else:
            lp = got.choices[0].logprobs
            token_logprobs, top = lp.token_logprobs, lp.top_logprobs
            assert lp.tokens == [
                offline.tokenizer.decode([t], skip_special_tokens=False) for t in want.token_ids
            ]
            assert lp.text_offset[0] == 0
        assert token_logprobs == pytest.approx([x.logprob for x in want.logprobs], abs=1e-9)
        for entry, x in zip(top, want.logprobs):
            # token text -> logprob: the top 3 and the chosen token (tokens that decode alike share a key)
            expected = {offline.tokenizer.decode([t], skip_special_tokens=False): v for t, v in x.top}
            expected[offline.tokenizer.decode([x.token_id], skip_special_tokens=False)] = x.logprob
            assert entry == pytest.approx(expected, abs=1e-9)


def test_chat_logprobs_equal_offline(client, offline) -> None:
    ids = chat_ids(offline, MESSAGES)
    want = offline.generate(ids, max_tokens=6, temperature=0.0, logprobs=2)
    got = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    )
    content = got.choices[0].logprobs.content
    assert len(content) == len(want.logprobs)
    decode = offline.tokenizer.decode
    for entry, x in zip(content, want.logprobs):
        assert entry.token == decode([x.token_id], skip_special_tokens=False)
        assert entry.logprob == pytest.approx(x.logprob, abs=1e-9)
        assert entry.bytes == list(entry.token.encode())
        assert [(t.token, t.logprob) for t in entry.top_logprobs] == [
            (decode([t], skip_special_tokens=False), pytest.approx(v, abs=1e-9)) for t, v in x.top
        ]
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0)
    assert plain.choices[0].logprobs is None
    streamed = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, stream=True
    )
    entries = [
        e for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    assert [e.logprob for e in entries] == pytest.approx([x.logprob for x in want.logprobs], abs=1e-9)
    assert all(e.top_logprobs == [] for e in entries)


def test_stream_with_n_choices(client, offline) -> None:
    want = offline.generate("the cat", max_tokens=7, temperature=0.0)
    texts = {0: "", 1: ""}
    finishes = {}
    for chunk in client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "the cat"}], n=2, max_tokens=7, temperature=0,
        stream=True,
    ):  # fmt: skip
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    chat_want = offline.generate("the cat", max_tokens=7, temperature=0.0, chat=True)
    assert texts == {0: chat_want.text, 1: chat_want.text} and set(finishes) == {0, 1}
    assert want.text  # the plain completion is a different prompt; just a sanity anchor
