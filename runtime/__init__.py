"""The MGX runtime: load a compiled artifact (.mgx) and generate text from it.

    from mgx.runtime import LLM, Engine, SamplingParams
    engine = Engine("model.mgx")
    print(engine.generate("Once upon a time", max_tokens=32).text)

    with LLM("model.mgx") as llm:  # many prompts batched together; thread-safe
        for r in llm.generate(["Hello", "Once upon a time"], SamplingParams(max_tokens=16, temperature=0)):
            print(r.text)

``AsyncEngine.generate`` streams ``RequestOutput``s to asyncio code.

Importing this package is cheap: the engine and its dependencies load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .async_engine import LLM, AsyncEngine
    from .config import EngineConfig
    from .engine import Engine, GenerationResult, RequestOutput, TextDelta, Timings
    from .errors import ChatTemplateError, EngineError, PromptError, UnsupportedModelError
    from .golden import GoldenReport, check_golden
    from .metrics import EngineMetrics, RequestMetrics
    from .sampler import SamplingParams, TokenLogprobs

__all__ = [
    "AsyncEngine",
    "ChatTemplateError",
    "Engine",
    "EngineConfig",
    "EngineError",
    "EngineMetrics",
    "GenerationResult",
    "GoldenReport",
    "LLM",
    "PromptError",
    "RequestMetrics",
    "RequestOutput",
    "SamplingParams",
    "TextDelta",
    "Timings",
    "TokenLogprobs",
    "UnsupportedModelError",
    "check_golden",
]

_HOMES = {
    "AsyncEngine": "async_engine",
    "LLM": "async_engine",
    "EngineConfig": "config",
    "Engine": "engine",
    "GenerationResult": "request",
    "RequestOutput": "request",
    "TextDelta": "request",
    "Timings": "request",
    "EngineMetrics": "metrics",
    "RequestMetrics": "metrics",
    "TokenLogprobs": "sampler",
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
