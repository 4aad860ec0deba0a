"""Text <-> token ids, streaming detokenization and chat templates, from what the artifact ships."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from .errors import ChatTemplateError

__all__ = ["Tokenizer", "IncrementalDetokenizer"]


class Tokenizer:
    """The model's tokenizer (a Hugging Face tokenizer.json) and its chat template."""

    def __init__(
        self,
        tokenizer_json: str,
        chat_template: str | None = None,
        *,
        bos_token_id: int = -1,
        eos_token_ids: Sequence[int] = (),
    ) -> None:
        self._tok = HFTokenizer.from_str(tokenizer_json)
        self._singles: dict[int, str] = {}  # decode([id]) by id: streaming decodes one token alone per step
        # A byte-level decoder turns each token into its bytes wherever it stands, so a token whose
        # own text has no U+FFFD adds exactly that text (no spaces added or stripped by position, as
        # sentencepiece's Metaspace does): streaming can skip the window (IncrementalDetokenizer.push).
        self.context_free = type(self._tok.decoder).__name__ == "ByteLevel"
        self.chat_template = chat_template
        self.bos_token = self._token_str(bos_token_id)
        self.eos_token = self._token_str(eos_token_ids[0]) if eos_token_ids else ""
        self._template: Any = None  # compiled on first use: most runs never format a chat

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` applies the tokenizer's post-processor (BOS...)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def _decode_window(self, ids: list[int]) -> str:
        """``decode(ids)``, with one-token windows served from a cache (decoding is a pure function)."""
        if len(ids) != 1:
            return self._tok.decode(ids)
        text = self._singles.get(ids[0])
        if text is None:
            text = self._singles[ids[0]] = self._tok.decode(ids)
        return text

    def encode_prompt(self, prompt: str, *, chat: bool = False) -> list[int]:
        """Ids of a user prompt: as a single user turn of the chat template with ``chat``, else as is.

        A rendered template already holds its special tokens, so it is encoded without adding any
        (as ``transformers``' ``apply_chat_template(tokenize=True)`` does).
        """
        if chat:
            return self.encode(
                self.render_chat([{"role": "user", "content": prompt}]), add_special_tokens=False
            )
        return self.encode(prompt)

    def render_chat(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True) -> str:
        """The chat template applied to ``messages``, ending with the assistant's turn opening."""
        if self.chat_template is None:
            raise ChatTemplateError("this model has no chat template; run without --chat (plain completion)")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except Exception as e:  # jinja2's errors, raise_exception() from the template, bad filters...
            raise ChatTemplateError(f"the chat template failed: {e}") from e

    def detokenizer(self, context: Sequence[int] = ()) -> IncrementalDetokenizer:
        """A streaming decoder; ``context`` (the prompt's last ids) fixes spacing of the first tokens."""
        return IncrementalDetokenizer(self, context)

    def _token_str(self, token_id: int) -> str:
        if token_id < 0:
            return ""
        return self._tok.id_to_token(token_id) or ""


class IncrementalDetokenizer:
    """Turns ids into text as they come, emitting text only once it is stable.

    Decoding a token alone is wrong in two ways: a UTF-8 character may span several byte tokens,
    and some decoders change a token's text depending on what precedes it (leading spaces). So each
    push decodes a short window ``ids[prefix:]`` and emits what it adds to ``ids[prefix:read]``,
    unless it ends in U+FFFD (an incomplete character); then it waits for the next token.

    The text of ``ids[prefix:read]`` only changes when text is emitted, so it is kept between
    pushes; in steady state it is one token, whose text the tokenizer caches. A push then costs one
    decode, not two; on a byte-level decoder (``Tokenizer.context_free``), when nothing is held back
    and the token's own text is complete, none: the token's cached text is what the window adds.
    """

    def __init__(self, tokenizer: Tokenizer, context: Sequence[int] = ()) -> None:
        self._tok = tokenizer
        self._ids: list[int] = list(context)[-6:]
        self._prefix = 0  # start of the window decoded for context
        self._read = len(self._ids)  # ids before this are already emitted
        self._before: str | None = None  # the text of ids[prefix:read]; None until decoded

    def push(self, token_id: int) -> str:
        """Add one id; returns the new stable text ("" while a character is incomplete)."""
        ids = self._ids
        ids.append(int(token_id))
        tok = self._tok
        # Called for every token of every running request: the one-token cache is read inline.
        text = tok._singles.get(ids[-1])
        if text is None:
            text = tok._decode_window(ids[-1:])
        n, read = len(ids), self._read
        if read == n - 1:
            if tok.context_free and "\ufffd" not in text:
                # Nothing is held back. On a byte-level decoder a token whose own bytes are whole
                # characters (no U+FFFD) adds exactly its own text after the window, even after
                # bytes that end inside a character (those decode to U+FFFD either way).
                if text:
                    self._prefix, self._read, self._before = read, n, text
                return text
        text = self._pending()
        if not text or text.endswith("\ufffd"):
            return ""
        # The next window starts at this token: its text (the new "before") is the token's own,
        # which the one-token cache holds when only this token was read.
        self._prefix, self._read = read, n
        self._before = tok._singles.get(ids[-1]) if read == n - 1 else None
        return text

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character comes out as U+FFFD)."""
        text = self._pending()
        self._prefix = self._read = len(self._ids)
        self._before = None
        return text

    def _pending(self) -> str:
        ids, prefix = self._ids, self._prefix
        before = self._before
        if before is None:
            before = self._before = self._tok._decode_window(ids[prefix : self._read])
        after = self._tok._decode_window(ids[prefix:])
        return after[len(before) :] if len(after) > len(before) else ""


def _compile_template(source: str) -> Any:
    """Compile a Hugging Face chat template the way ``transformers`` does: sandboxed, same helpers."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ChatTemplateError(message)

    def tojson(
        x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False
    ) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except Exception as e:
        raise ChatTemplateError(f"the chat template does not compile: {e}") from e
