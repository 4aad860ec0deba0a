"""Replaying an artifact's golden set: the same greedy tokens, top-1 logits within tolerance."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from mgx.formats.artifact import GoldenSet

    from .engine import Engine

__all__ = ["Divergence", "CaseReport", "GoldenReport", "check_golden"]


@dataclass(frozen=True, slots=True)
class Divergence:
    """The first place a case's replay differs from what was recorded."""

    position: int  # index in the generated tokens (in the prompt ids for kind "prompt")
    kind: Literal["prompt", "token", "logit"]  # prompt ids differ / another token / top-1 logit off
    expected_id: int | None
    got_id: int | None
    expected_text: str
    got_text: str
    expected_logit: float | None = None
    got_logit: float | None = None

    def describe(self) -> str:
        """One line, e.g. ``position 7: expected token 1234 ' cat', got 99 ' dog'``."""
        if self.kind == "prompt":
            return (
                f"prompt id {self.position}: recorded {self.expected_id} {self.expected_text!r}, the "
                f"tokenizer gives {self.got_id} {self.got_text!r} (tokenizer or chat template drift)"
            )
        if self.kind == "logit":
            return (
                f"position {self.position}: top-1 logit of token {self.got_id} {self.got_text!r} "
                f"expected {self.expected_logit:.6g}, got {self.got_logit:.6g}"
            )
        return (
            f"position {self.position}: expected token {self.expected_id} {self.expected_text!r}, "
            f"got {self.got_id} {self.got_text!r}"
        )


@dataclass(frozen=True, slots=True)
class CaseReport:
    """One golden case's outcome."""

    index: int
    prompt: str  # the case's prompt text ("" when it only has ids)
    tokens: int  # tokens expected
    max_logit_error: float  # largest |got - expected| top-1 logit over the matching tokens
    divergence: Divergence | None  # None when the case matches

    @property
    def ok(self) -> bool:
        return self.divergence is None


@dataclass(frozen=True, slots=True)
class GoldenReport:
    """Every case's outcome."""

    cases: list[CaseReport]
    logit_atol: float

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.cases)

    @property
    def first_failure(self) -> CaseReport | None:
        return next((c for c in self.cases if not c.ok), None)


def check_golden(engine: Engine, golden: GoldenSet) -> GoldenReport:
    """Replay each case greedily from its prompt ids and compare ids exactly, top-1 logits within atol.

    When a case has its prompt text, the engine's tokenizer (and chat template) must also reproduce
    the recorded prompt ids, so tokenizer drift is caught as well as model drift.
    """
    atol = float(golden.logit_atol)
    return GoldenReport([_check_case(engine, i, case, atol) for i, case in enumerate(golden.cases)], atol)


def _check_case(engine: Engine, index: int, case: Any, atol: float) -> CaseReport:
    prompt = case.prompt or ""
    expected = [int(t) for t in case.expected_ids]
    prompt_ids = [int(t) for t in case.prompt_ids]

    def report(max_err: float, divergence: Divergence | None) -> CaseReport:
        return CaseReport(index, prompt, len(expected), max_err, divergence)

    if case.prompt:
        encoded = engine.encode_prompt(case.prompt, chat=bool(case.chat))
        if encoded != prompt_ids:
            pos = _first_difference(encoded, prompt_ids)
            want, got = _at(prompt_ids, pos), _at(encoded, pos)
            return report(0.0, Divergence(pos, "prompt", want, got, _text(engine, want), _text(engine, got)))

    got_ids, got_logits = engine.greedy_with_logits(prompt_ids, len(expected))
    want_logits = list(case.expected_top1_logits or [])  # a case may record ids only
    max_err = 0.0
    for pos, (want, got) in enumerate(zip(expected, got_ids, strict=True)):
        if want != got:
            div = Divergence(pos, "token", want, got, _text(engine, want), _text(engine, got))
            return report(max_err, div)
        if pos >= len(want_logits):
            continue
        want_logit, got_logit = float(want_logits[pos]), got_logits[pos]
        err = abs(got_logit - want_logit)
        max_err = max(max_err, err)
        if not err <= atol:
            text = _text(engine, got)
            return report(max_err, Divergence(pos, "logit", want, got, text, text, want_logit, got_logit))
    return report(max_err, None)


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _at(ids: list[int], pos: int) -> int | None:
    return ids[pos] if pos < len(ids) else None


def _text(engine: Engine, token_id: int | None) -> str:
    if token_id is None:
        return "<end>"
    return engine.tokenizer.decode([token_id], skip_special_tokens=False)
