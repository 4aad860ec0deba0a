"""Tokenizer wrapper: encode/decode, streaming detokenization, chat templates."""

from __future__ import annotations

import random

import pytest

from mgx.runtime.errors import ChatTemplateError
from mgx.runtime.tokenizer import Tokenizer

from _tiny_graph import CHAT_TEMPLATE, byte_level_bpe_json, word_level_json

TEXTS = ["héllo wörld, ça va?", "日本語のテキスト 🙂 emoji 🚀!", "the cat sat", "🙂🙂 a", "x"]


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    return Tokenizer(byte_level_bpe_json(), CHAT_TEMPLATE, bos_token_id=0, eos_token_ids=[1])


def test_encode_adds_bos_and_decode_round_trips(bpe: Tokenizer) -> None:
    for text in TEXTS:
        ids = bpe.encode(text)
        assert ids[0] == 0 and bpe.encode(text, add_special_tokens=False) == ids[1:]
        assert bpe.decode(ids) == text
    assert bpe.decode([0, 1], skip_special_tokens=False) == "<s></s>"


@pytest.mark.parametrize("text", TEXTS)
def test_streaming_never_emits_broken_characters(bpe: Tokenizer, text: str) -> None:
    ids = bpe.encode(text, add_special_tokens=False)
    singles = [bpe.decode([i]) for i in ids]
    detok = bpe.detokenizer(context=[0])
    deltas = [detok.push(i) for i in ids]
    deltas.append(detok.flush())
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)
    if any("\ufffd" in s for s in singles):  # multi-byte characters really were split across tokens
        assert "" in deltas[:-1]


def test_streaming_emits_text_as_soon_as_it_is_stable(bpe: Tokenizer) -> None:
    ids = bpe.encode("a 🙂 b", add_special_tokens=False)
    detok = bpe.detokenizer()
    out = [detok.push(i) for i in ids]
    assert out[0] == "a"  # an ASCII token comes out at once
    assert "🙂" in "".join(out)  # the emoji comes out once its last byte arrives, before the flush
    assert detok.flush() == ""


def test_streaming_flushes_a_dangling_character(bpe: Tokenizer) -> None:
    ids = bpe.encode("🙂", add_special_tokens=False)
    detok = bpe.detokenizer()
    assert all(detok.push(i) == "" for i in ids[:-1])
    assert detok.flush() == "\ufffd"


class _TwoDecodeDetokenizer:
    """The streaming rule decoded the plain way, both windows on every push (the reference)."""

    def __init__(self, tok: Tokenizer, context: list[int]) -> None:
        self.tok, self.ids = tok, list(context)[-6:]
        self.prefix, self.read = 0, len(self.ids)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.pending()
        if not text or text.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text

    def flush(self) -> str:
        text = self.pending()
        self.prefix = self.read = len(self.ids)
        return text

    def pending(self) -> str:
        before = self.tok.decode(self.ids[self.prefix : self.read])
        after = self.tok.decode(self.ids[self.prefix :])
        return after[len(before) :] if len(after) > len(before) else ""


@pytest.mark.parametrize("seed", range(8))
def test_streaming_equals_decoding_both_windows_every_time(bpe: Tokenizer, seed: int) -> None:
    # Random ids of a byte-level vocabulary split characters anywhere, leave invalid UTF-8 and
    # special tokens; neither the cached one-token texts nor the byte-level shortcut (a token's own
    # text when nothing is held back) may change anything, push by push, across a flush, after a
    # context that ends inside a character.
    rng = random.Random(seed)
    emoji = bpe.encode("🙂", add_special_tokens=False)
    stream = [rng.randrange(bpe.vocab_size) for _ in range(300)]
    stream[50:53] = emoji[:3]
    stream += bpe.encode("plain words, then ünïcödé 日本 🚀", add_special_tokens=False)
    # Characters cut short and followed by a whole character, an ASCII token, or their own rest.
    stream += emoji[:2] + bpe.encode("A", add_special_tokens=False) + emoji[:1] + emoji + emoji[1:] + emoji[:3]
    context = [rng.randrange(bpe.vocab_size) for _ in range(seed * 3)]
    if seed % 2:
        context += emoji[:2]  # the prompt ends inside a character
    assert bpe.context_free
    fast, ref = bpe.detokenizer(context), _TwoDecodeDetokenizer(bpe, context)
    for i in stream:
        assert fast.push(i) == ref.push(i)
    assert fast.flush() == ref.flush()
    for i in stream[:40]:
        assert fast.push(i) == ref.push(i)
    assert fast.flush() == ref.flush()


def test_streaming_with_a_metaspace_decoder_decodes_windows() -> None:
    """Sentencepiece's Metaspace decoder drops the space of a text's first token, so a token's text
    depends on what precedes it: no shortcut there, and the stream equals the two-window rule."""
    import json

    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "▁the": 1, "▁cat": 2, "s": 3, "▁": 4, "at": 5}
    hf = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    hf.pre_tokenizer = pre_tokenizers.Metaspace()
    hf.decoder = decoders.Metaspace()
    tok = Tokenizer(json.dumps(json.loads(hf.to_str())))
    assert not tok.context_free
    stream = [1, 2, 3, 4, 5, 1, 2]
    for context in ([], [2]):
        fast, ref = tok.detokenizer(context), _TwoDecodeDetokenizer(tok, context)
        assert [fast.push(i) for i in stream] == [ref.push(i) for i in stream]
        assert fast.flush() == ref.flush()
    detok = tok.detokenizer()
    assert "".join(detok.push(i) for i in stream) == "the cats at the cat" == tok.decode(stream)


def test_word_level_streaming_keeps_spaces() -> None:
    tok = Tokenizer(word_level_json(["the", "cat", "sat"]))
    ids = tok.encode("the cat sat")
    detok = tok.detokenizer(context=ids[:1])
    assert "".join(detok.push(i) for i in ids[1:]) + detok.flush() == tok.decode(ids)[len("the") :]


def test_chat_template_renders_a_user_turn(bpe: Tokenizer) -> None:
    text = bpe.render_chat([{"role": "user", "content": "hi"}])
    assert text == "<s><|user|>hi</s><|assistant|>"
    ids = bpe.encode_prompt("hi", chat=True)
    assert (
        ids == bpe.encode(text, add_special_tokens=False) and ids.count(0) == 1
    )  # one BOS, from the template


def test_chat_template_errors_are_clear() -> None:
    no_template = Tokenizer(byte_level_bpe_json())
    with pytest.raises(ChatTemplateError, match="no chat template"):
        no_template.encode_prompt("hi", chat=True)
    strict = Tokenizer(byte_level_bpe_json(), "{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        strict.render_chat([{"role": "user", "content": "hi"}])
    broken = Tokenizer(byte_level_bpe_json(), "{% for %}")
    with pytest.raises(ChatTemplateError, match="does not compile"):
        broken.render_chat([])


def test_chat_template_is_sandboxed() -> None:
    evil = Tokenizer(byte_level_bpe_json(), "{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError):
        evil.render_chat([])
