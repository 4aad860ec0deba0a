"""Choosing the next token from logits, and what a request asks of it.

Order of processing: repetition penalty (prompt + output, Hugging Face rule), presence and frequency
penalties (output only, OpenAI rule), temperature, then top-k, top-p and min-p filtering. Greedy
(temperature 0) takes the argmax of the penalised logits. Logprobs are those of the model's own
distribution (log-softmax of the raw logits), as OpenAI's API reports them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "SamplingParams",
    "Sampler",
    "TokenLogprobs",
    "apply_penalties",
    "apply_repetition_penalty",
    "probabilities",
]


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request picks its tokens and when it stops."""

    max_tokens: int = 256  # most tokens to generate (the stop token counts)
    temperature: float = 1.0  # 0 = greedy (argmax); otherwise logits are divided by it
    top_p: float = 1.0  # keep the most likely tokens whose probabilities first reach top_p; 1 = all
    top_k: int = 0  # keep only the k most likely tokens (ties kept); 0 = all
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one; 0 = off
    repetition_penalty: float = 1.0  # >1 discourages tokens already in prompt or output (HF/CTRL rule)
    presence_penalty: float = 0.0  # subtracted once from the logit of every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence from the logit of generated tokens
    seed: int | None = None  # same seed, same output (whatever else is in the batch); None: fresh entropy
    stop_token_ids: tuple[int, ...] = ()  # generation ends after emitting one of these
    stop: tuple[str, ...] = ()  # generation ends when the text contains one; the text ends before it
    ignore_eos: bool = False  # do not add the model's end-of-sequence ids to the stop ids
    logprobs: int | None = None  # report the chosen token's logprob and this many top alternatives

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs}")
        if self.seed is not None and not 0 <= self.seed < 2**64:
            raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not s for s in stop):
            raise ValueError("stop strings must not be empty")
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """The chosen token's log-probability and the most likely alternatives at that step."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first


class Sampler:
    """Samples one request's tokens; owns the request's random generator."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.rng = np.random.default_rng(params.seed)
        self.stop_ids = frozenset(params.stop_token_ids)  # tokens that end the request

    def sample(self, logits: np.ndarray, previous: Sequence[int] = (), output: Sequence[int] = ()) -> int:
        """The next token from logits [V].

        ``previous`` (prompt + output) feeds the repetition penalty, ``output`` the presence and
        frequency penalties.
        """
        p = self.params
        x = logits.astype(np.float64)  # a copy: the caller's logits stay as they were
        if p.repetition_penalty != 1.0 and len(previous):
            apply_repetition_penalty(x, previous, p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and len(output):
            apply_penalties(x, output, p.presence_penalty, p.frequency_penalty)
        if p.greedy:
            return int(np.argmax(x))
        probs = probabilities(x / p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p)
        cdf = np.cumsum(probs)
        # Inverse CDF; searching "right" never lands on a zero-probability token.
        index = int(np.searchsorted(cdf, self.rng.random() * cdf[-1], side="right"))
        return min(index, probs.size - 1)

    def logprobs(self, logits: np.ndarray, token_id: int) -> TokenLogprobs:
        """Log-softmax of the raw logits [V]: the chosen token's value and the top ``params.logprobs``."""
        x = logits.astype(np.float64)
        m = x.max()
        logp = x - (m + np.log(np.exp(x - m).sum()))
        n = min(self.params.logprobs or 0, x.size)
        top: tuple[tuple[int, float], ...] = ()
        if n:
            best = np.argpartition(-logp, n - 1)[:n]
            best = best[np.lexsort((best, -logp[best]))]  # most likely first, ties by id
            top = tuple((int(i), float(logp[i])) for i in best)
        return TokenLogprobs(int(token_id), float(logp[token_id]), top)

    def is_stop(self, token_id: int) -> bool:
        return token_id in self.stop_ids


def apply_repetition_penalty(x: np.ndarray, previous: Sequence[int], penalty: float) -> None:
    """In place: divide positive logits of seen tokens by ``penalty``, multiply negative ones."""
    seen = np.unique(np.asarray(previous, dtype=np.int64))
    x[seen] = np.where(x[seen] > 0, x[seen] / penalty, x[seen] * penalty)


def apply_penalties(x: np.ndarray, output: Sequence[int], presence: float, frequency: float) -> None:
    """In place: ``x[t] -= presence * (count[t] > 0) + frequency * count[t]`` over generated tokens."""
    tokens, counts = np.unique(np.asarray(output, dtype=np.int64), return_counts=True)
    x[tokens] -= presence + frequency * counts


def probabilities(x: np.ndarray, *, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> np.ndarray:
    """Softmax of logits [V] after top-k, top-p then min-p filtering (filtered tokens get probability 0)."""
    if 0 < top_k < x.size:
        kth = np.partition(x, -top_k)[-top_k]
        x = np.where(x < kth, -np.inf, x)
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    if top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        ranked = probs[order]
        # Keep a token while the tokens ranked above it hold less than top_p; the first always stays.
        drop = order[np.cumsum(ranked) - ranked >= top_p]
        probs[drop] = 0.0
        probs /= probs.sum()
    if min_p > 0.0:
        probs[probs < min_p * probs.max()] = 0.0
        probs /= probs.sum()
    return probs
