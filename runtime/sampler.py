"""Choosing the next token from logits: greedy, temperature, top-k, top-p, repetition penalty."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["SamplingParams", "Sampler", "apply_repetition_penalty", "probabilities"]


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request picks its tokens and when it stops."""

    max_tokens: int = 256  # most tokens to generate (the stop token counts)
    temperature: float = 1.0  # 0 = greedy (argmax); otherwise logits are divided by it
    top_p: float = 1.0  # keep the most likely tokens whose probabilities first reach top_p; 1 = all
    top_k: int = 0  # keep only the k most likely tokens (ties kept); 0 = all
    repetition_penalty: float = 1.0  # >1 discourages tokens already in prompt or output (HF/CTRL rule)
    seed: int | None = None  # same seed, same output; None draws fresh entropy
    stop_token_ids: tuple[int, ...] = ()  # generation ends after emitting one of these

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Sampler:
    """Samples one request's tokens; owns the request's random generator."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.rng = np.random.default_rng(params.seed)
        self._stop = frozenset(params.stop_token_ids)

    def sample(self, logits: np.ndarray, previous: Sequence[int] = ()) -> int:
        """The next token from logits [V]; ``previous`` (prompt + output) feeds the repetition penalty."""
        p = self.params
        x = logits.astype(np.float64)  # a copy: the caller's logits stay as they were
        if p.repetition_penalty != 1.0 and len(previous):
            apply_repetition_penalty(x, previous, p.repetition_penalty)
        if p.greedy:
            return int(np.argmax(x))
        probs = probabilities(x / p.temperature, top_k=p.top_k, top_p=p.top_p)
        cdf = np.cumsum(probs)
        # Inverse CDF; searching "right" never lands on a zero-probability token.
        index = int(np.searchsorted(cdf, self.rng.random() * cdf[-1], side="right"))
        return min(index, probs.size - 1)

    def is_stop(self, token_id: int) -> bool:
        return token_id in self._stop


def apply_repetition_penalty(x: np.ndarray, previous: Sequence[int], penalty: float) -> None:
    """In place: divide positive logits of seen tokens by ``penalty``, multiply negative ones."""
    seen = np.unique(np.asarray(previous, dtype=np.int64))
    x[seen] = np.where(x[seen] > 0, x[seen] / penalty, x[seen] * penalty)


def probabilities(x: np.ndarray, *, top_k: int = 0, top_p: float = 1.0) -> np.ndarray:
    """Softmax of logits [V] after top-k then top-p filtering (filtered tokens get probability 0)."""
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
    return probs
