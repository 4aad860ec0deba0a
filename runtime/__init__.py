"""The MGX runtime: load a compiled artifact (.mgx) and generate text from it.

    from mgx.runtime import Engine
    engine = Engine("model.mgx")
    print(engine.generate("Once upon a time", max_tokens=32).text)

Importing this package is cheap: the engine and its dependencies load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .engine import Engine, GenerationResult, TextDelta, Timings
    from .errors import ChatTemplateError, EngineError, PromptError, UnsupportedModelError
    from .golden import GoldenReport, check_golden
    from .sampler import SamplingParams

__all__ = [
    "ChatTemplateError",
    "Engine",
    "EngineError",
    "GenerationResult",
    "GoldenReport",
    "PromptError",
    "SamplingParams",
    "TextDelta",
    "Timings",
    "UnsupportedModelError",
    "check_golden",
]

_HOMES = {
    "Engine": "engine",
    "GenerationResult": "engine",
    "TextDelta": "engine",
    "Timings": "engine",
    "ChatTemplateError": "errors",
    "EngineError": "errors",
    "PromptError": "errors",
    "UnsupportedModelError": "errors",
    "GoldenReport": "golden",
    "check_golden": "golden",
    "SamplingParams": "sampler",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{home}", __name__), name)
