"""One request's life after sampling: stop ids and strings, streamed text, logprobs, its result.

The scheduler sees a request as a ``Sequence`` (tokens and status); everything about turning its
tokens into output lives here.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Literal

from .metrics import RequestMetrics
from .sampler import Sampler, SamplingParams, TokenLogprobs
from .scheduler import Sequence
from .tokenizer import IncrementalDetokenizer

__all__ = [
    "FinishReason",
    "GenerationResult",
    "Request",
    "RequestOutput",
    "StopStrings",
    "TextDelta",
    "Timings",
]

# "stop": a stop token or stop string came; "length": max_tokens reached; "abort": the caller gave up.
FinishReason = Literal["stop", "length", "abort"]


@dataclass(slots=True)
class Timings:
    """Where a request's time went, in seconds (engine time only: a slow stream reader is not counted)."""

    load_s: float = 0.0  # mapping the artifact (once per engine)
    prefill_s: float = 0.0  # the steps that ran its prompt, up to and including its first token
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

    text: str  # the generated text (stop token and stop string excluded)
    token_ids: list[int]  # generated ids, the stop token included when there was one
    finish_reason: FinishReason
    prompt_tokens: int
    timings: Timings = field(default_factory=Timings)
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[TokenLogprobs] | None = None  # one per generated token, when asked for
    metrics: RequestMetrics | None = None
    request_id: str = ""


@dataclass(frozen=True, slots=True)
class TextDelta:
    """A streamed piece of text; one per generated token ("" while a character is incomplete)."""

    text: str
    token_id: int | None  # the token that completed it; None for the final flush


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ is ~5x slower (2.3 vs 0.4 us here),
class RequestOutput:  # and a decode step makes one per running request
    """What one step added to a request (``AsyncEngine.generate`` yields these; do not modify)."""

    request_id: str
    text: str  # new text since the last output (may be "": incomplete character, or held for a stop string)
    token_ids: list[int]  # new token ids
    logprobs: list[TokenLogprobs] | None  # one per new token, when asked for
    finished: bool
    finish_reason: FinishReason | None = None  # set once finished
    stop_reason: int | str | None = None
    metrics: RequestMetrics | None = None


class StopStrings:
    """Holds back text that could be the start of a stop string, so none leaks past one."""

    def __init__(self, stops: Seq[str]) -> None:
        self.stops = tuple(stops)
        self._held = ""

    def push(self, text: str) -> tuple[str, str | None]:
        """Add text; returns what is safe to emit and the stop string found (None if none)."""
        if not self.stops:
            return text, None
        held = self._held + text
        hits = [(i, s) for s in self.stops if (i := held.find(s)) >= 0]
        if hits:
            i, stop = min(hits)
            self._held = ""
            return held[:i], stop
        keep = next(
            (k for k in range(min(len(held), max(map(len, self.stops)) - 1), 0, -1)
             if any(s.startswith(held[-k:]) for s in self.stops)),
            0,
        )  # fmt: skip
        self._held = held[len(held) - keep :]
        return held[: len(held) - keep], None

    def flush(self) -> str:
        out, self._held = self._held, ""
        return out


class Request:
    """A request the engine is serving: its sequence, sampler, detokenizer and output so far."""

    def __init__(
        self,
        request_id: str,
        seq: Sequence,
        params: SamplingParams,
        detokenizer: IncrementalDetokenizer,
        metrics: RequestMetrics,
    ) -> None:
        self.request_id = request_id
        self.seq = seq
        self.params = params
        self.sampler = Sampler(params)
        # Greedy with nothing that needs the whole logits row (penalties, log-probabilities): the
        # backend's LM head fused with the argmax can pick its tokens.
        self.plain_greedy = (
            params.greedy
            and params.repetition_penalty == 1.0
            and not params.presence_penalty
            and not params.frequency_penalty
            and params.logprobs is None
        )
        self.detok = detokenizer
        self.stops = StopStrings(params.stop)
        # Read on every token: kept here rather than looked up through params and the sampler.
        self._stop_ids = self.sampler.stop_ids
        self._stop_strings = bool(self.stops.stops)
        self.tokens_left = params.max_tokens  # tokens it may still generate before ``max_tokens``
        self.metrics = metrics
        self.output_ids: list[int] = []
        self.text_parts: list[str] = []
        self.logprobs: list[TokenLogprobs] | None = [] if params.logprobs is not None else None
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None

    @property
    def prompt_ids(self) -> list[int]:
        return self.seq.token_ids[: self.seq.num_prompt_tokens]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def accept(self, token: int, logprobs: TokenLogprobs | None, now: float) -> RequestOutput:
        """Append a sampled token; returns this step's output (finished when the request stops)."""
        self.seq.token_ids.append(token)
        self.output_ids.append(token)
        self.tokens_left -= 1
        m = self.metrics
        m.output_tokens += 1
        m.last_token_time = now
        if m.first_token_time is None:
            m.first_token_time = now
        if logprobs is not None and self.logprobs is not None:
            self.logprobs.append(logprobs)
        text = ""
        if token in self._stop_ids:
            self.finish_reason, self.stop_reason = "stop", token
        elif self._stop_strings:
            text, hit = self.stops.push(self.detok.push(token))
            if hit is not None:
                self.finish_reason, self.stop_reason = "stop", hit
            elif self.tokens_left <= 0:
                self.finish_reason = "length"
        else:  # nothing to hold back: StopStrings.push would pass the text through
            text = self.detok.push(token)
            if self.tokens_left <= 0:
                self.finish_reason = "length"
        if self.finish_reason is None:
            self.text_parts.append(text)
            lp = [logprobs] if logprobs is not None and self.logprobs is not None else None
            return RequestOutput(self.request_id, text, [token], lp, False, None, None, m)
        if not isinstance(self.stop_reason, str):
            tail, hit = self.stops.push(self.detok.flush())  # an incomplete character comes out as U+FFFD
            if hit is not None:
                self.finish_reason, self.stop_reason = "stop", hit
            text += tail if hit is not None else tail + self.stops.flush()
        self.text_parts.append(text)
        return RequestOutput(
            self.request_id,
            text,
            [token],
            [logprobs] if self.logprobs is not None and logprobs is not None else None,
            True,
            self.finish_reason,
            self.stop_reason,
            m,
        )

    def abort(self) -> RequestOutput:
        self.finish_reason = "abort"
        return RequestOutput(self.request_id, "", [], None, True, "abort", None, self.metrics)

    def result(self, load_s: float = 0.0) -> GenerationResult:
        m = self.metrics
        timings = Timings(
            load_s=load_s,
            prefill_s=m.prefill_seconds,
            decode_s=m.decode_seconds,
            prompt_tokens=self.seq.num_prompt_tokens,
            decode_steps=max(m.output_tokens - 1, 0),
        )
        return GenerationResult(
            text="".join(self.text_parts),
            token_ids=list(self.output_ids),
            finish_reason=self.finish_reason or "abort",
            prompt_tokens=self.seq.num_prompt_tokens,
            timings=timings,
            stop_reason=self.stop_reason,
            logprobs=self.logprobs,
            metrics=m,
            request_id=self.request_id,
        )
