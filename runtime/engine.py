"""The engine: one request at a time, prefill in one step then one token per step.

``Engine.generate`` is the whole user-facing loop; the model runner does the tensor work and the
sampler picks tokens. A batched engine (scheduler + block manager) will drive the same runner with
several sequences per step.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from mgx.formats.artifact import ArtifactContents, LoadedArtifact, load_artifact, verify_artifact

from .backend import Backend
from .batch import SeqChunk
from .errors import EngineError, PromptError
from .model_runner import ModelRunner
from .sampler import Sampler, SamplingParams
from .tokenizer import Tokenizer

__all__ = ["Engine", "GenerationResult", "TextDelta", "Timings"]

FinishReason = Literal["stop", "length"]


@dataclass(slots=True)
class Timings:
    """Where a request's time went, in seconds (engine time only: a slow stream reader is not counted)."""

    load_s: float = 0.0  # mapping the artifact (once per engine)
    prefill_s: float = 0.0  # the prompt step and the first token's sampling
    decode_s: float = 0.0  # every later step
    prompt_tokens: int = 0
    decode_steps: int = 0  # steps after prefill (one per generated token after the first)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Decode speed: generated tokens per second after the first one."""
        return self.decode_steps / self.decode_s if self.decode_s > 0 else 0.0


@dataclass(slots=True)
class GenerationResult:
    """A finished request."""

    text: str  # the generated text (stop token excluded)
    token_ids: list[int]  # generated ids, the stop token included when there was one
    finish_reason: FinishReason  # "stop": a stop token came; "length": max_tokens reached
    prompt_tokens: int
    timings: Timings = field(default_factory=Timings)


@dataclass(frozen=True, slots=True)
class TextDelta:
    """A streamed piece of text; one per generated token ("" while a character is incomplete)."""

    text: str
    token_id: int | None  # the token that completed it; None for the final flush


class Engine:
    """Loads an artifact and generates text from it."""

    def __init__(
        self,
        source: str | os.PathLike[str] | LoadedArtifact | ArtifactContents,
        *,
        verify: bool = False,
        backend: Backend | str = "reference",
    ) -> None:
        """Map ``source`` (a path; or an artifact already loaded, or in-memory contents).

        ``verify`` checks every checksum of a file first (it reads the whole file once).
        """
        self.load_seconds = 0.0  # time to map the artifact; 0 for contents built in this process
        self._artifact: LoadedArtifact | None = None  # keeps the mapping alive while weights are in use
        if isinstance(source, (str, os.PathLike)):
            if not os.path.isfile(source):
                raise EngineError(f"no such model file: {os.fspath(source)}")
            if verify:
                verify_artifact(source)
            source = load_artifact(source)
        if isinstance(source, LoadedArtifact):
            self._artifact, self.load_seconds = source, float(source.load_seconds)
            source = source.contents
        self.contents = source
        self.graph = source.graph
        arch = self.graph.arch
        self.tokenizer = Tokenizer(
            source.tokenizer_json,
            source.chat_template,
            bos_token_id=arch.bos_token_id,
            eos_token_ids=arch.eos_token_ids,
        )
        self.defaults = source.generation
        self.runner = ModelRunner(self.graph, backend)
        self._seq_ids = itertools.count()

    @classmethod
    def from_contents(cls, contents: ArtifactContents, *, backend: Backend | str = "reference") -> Engine:
        """An engine over in-memory contents (tests, or an artifact built in this process)."""
        return cls(contents, backend=backend)

    @property
    def max_position(self) -> int:
        return self.graph.arch.max_position

    # -- requests -------------------------------------------------------------------------------

    def sampling_params(
        self,
        *,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        repetition_penalty: float | None = None,
        seed: int | None = None,
    ) -> SamplingParams:
        """Request parameters: the given ones, the artifact's defaults for the rest."""
        d = self.defaults
        # The artifact's stop ids are extra ones: EOS always stops too.
        stop = tuple(dict.fromkeys([*self.graph.arch.eos_token_ids, *d.stop_token_ids]))
        try:
            return SamplingParams(
                max_tokens=d.max_new_tokens if max_tokens is None else max_tokens,
                temperature=d.temperature if temperature is None else temperature,
                top_p=d.top_p if top_p is None else top_p,
                top_k=d.top_k if top_k is None else top_k,
                repetition_penalty=d.repetition_penalty if repetition_penalty is None else repetition_penalty,
                seed=seed,
                stop_token_ids=stop,
            )
        except ValueError as e:
            raise EngineError(str(e)) from None

    def encode_prompt(self, prompt: str | Sequence[int], *, chat: bool = False) -> list[int]:
        """Token ids of a prompt: text is encoded (through the chat template with ``chat``), ids kept."""
        if isinstance(prompt, str):
            ids = self.tokenizer.encode_prompt(prompt, chat=chat)
        else:
            if chat:
                raise PromptError("chat formatting needs a text prompt, not token ids")
            ids = [int(t) for t in prompt]
        if not ids:
            raise PromptError("the prompt is empty (no tokens to start from)")
        vocab = self.graph.arch.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise PromptError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        return ids

    def generate(
        self,
        prompt: str | Sequence[int],
        *,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        repetition_penalty: float | None = None,
        seed: int | None = None,
        chat: bool = False,
        stream: bool = False,
    ) -> GenerationResult | Iterator[TextDelta | GenerationResult]:
        """Generate a continuation of ``prompt`` (text or token ids); unset options use the artifact's defaults.

        With ``stream`` it returns an iterator of ``TextDelta``s that ends with the ``GenerationResult``.
        """
        params = self.sampling_params(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            repetition_penalty=repetition_penalty,
            seed=seed,
        )
        prompt_ids = self.encode_prompt(prompt, chat=chat)
        self._check_fits(len(prompt_ids), params.max_tokens)
        events = self._events(prompt_ids, params)
        if stream:
            return events
        for event in events:
            if isinstance(event, GenerationResult):
                return event
        raise AssertionError("the event stream ended without a result")  # pragma: no cover

    def greedy_with_logits(self, prompt_ids: Sequence[int], n: int) -> tuple[list[int], list[float]]:
        """Exactly ``n`` greedy tokens (stop tokens do not stop it) and the top-1 logit at each step."""
        prompt_ids = self.encode_prompt(prompt_ids)
        self._check_fits(len(prompt_ids), n)
        ids: list[int] = []
        top1: list[float] = []
        with closing(self._steps(prompt_ids, n, lambda logits: int(np.argmax(logits)), Timings())) as steps:
            for token, logits in steps:
                ids.append(token)
                top1.append(float(logits[token]))
        return ids, top1

    # -- the loop -------------------------------------------------------------------------------

    def _events(
        self, prompt_ids: list[int], params: SamplingParams
    ) -> Iterator[TextDelta | GenerationResult]:
        sampler = Sampler(params)
        history = list(prompt_ids)  # prompt + output, for the repetition penalty
        timings = Timings(load_s=self.load_seconds, prompt_tokens=len(prompt_ids))
        detok = self.tokenizer.detokenizer(context=prompt_ids)
        pieces: list[str] = []
        finish: FinishReason = "length"
        with closing(
            self._steps(prompt_ids, params.max_tokens, lambda x: sampler.sample(x, history), timings)
        ) as steps:
            for token, _ in steps:
                history.append(token)
                if sampler.is_stop(token):
                    finish = "stop"
                    break
                text = detok.push(token)
                pieces.append(text)
                yield TextDelta(text, token)
        rest = detok.flush()
        if rest:
            pieces.append(rest)
            yield TextDelta(rest, None)
        yield GenerationResult(
            text="".join(pieces),
            token_ids=history[len(prompt_ids) :],
            finish_reason=finish,
            prompt_tokens=len(prompt_ids),
            timings=timings,
        )

    def _steps(
        self, prompt_ids: list[int], n: int, choose: Callable[[np.ndarray], int], timings: Timings
    ) -> Iterator[tuple[int, np.ndarray]]:
        """Up to ``n`` (token, logits [V]) pairs of one sequence; its state is freed when this closes."""
        seq_id = next(self._seq_ids)
        try:
            chunk = prompt_ids
            for i in range(n):
                start = time.perf_counter()
                (logits,) = self.runner.step([SeqChunk(seq_id, chunk)])
                token = choose(logits[-1])
                spent = time.perf_counter() - start
                if i == 0:
                    timings.prefill_s += spent
                else:
                    timings.decode_s += spent
                    timings.decode_steps += 1
                yield token, logits[-1]
                chunk = [token]
        finally:
            self.runner.free(seq_id)

    def _check_fits(self, prompt_tokens: int, max_tokens: int) -> None:
        if prompt_tokens + max_tokens > self.max_position:
            raise PromptError(
                f"the prompt has {prompt_tokens} tokens; with max_tokens {max_tokens} that is "
                f"{prompt_tokens + max_tokens} > the model's context of {self.max_position} tokens; "
                "shorten the prompt or lower max_tokens"
            )
