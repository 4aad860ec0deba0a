"""Errors the runtime raises for things a user can fix; the CLI prints them as one line."""

from __future__ import annotations

__all__ = ["EngineError", "PromptError", "ChatTemplateError", "UnsupportedModelError"]


class EngineError(ValueError):
    """A request or a model the engine cannot serve; the message says why and what to do."""


class PromptError(EngineError):
    """The prompt is empty, has bad token ids, or does not fit the model's context."""


class ChatTemplateError(EngineError):
    """Chat formatting was asked for but the artifact has no usable chat template."""


class UnsupportedModelError(EngineError):
    """The graph uses an op, state kind or weight scheme this backend cannot run."""
