"""Compiler passes: one per file, each an ``ir.Graph -> PassResult`` rewrite with a contract.

``PASSES`` is the registry the pipeline looks names up in; model.yaml lists names from it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mgx.formats import ir

__all__ = ["PassResult", "PassFn", "PASSES", "get_pass"]


@dataclass(slots=True)
class PassResult:
    """What a pass did, for the log and the artifact's pass record."""

    summary: str  # one line: ops fused, bytes before and after, ...
    stats: dict[str, Any] = field(default_factory=dict)


PassFn = Callable[[ir.Graph, dict[str, Any]], PassResult]

# name -> pass function; passes register here as they land.
PASSES: dict[str, PassFn] = {}


def get_pass(name: str) -> PassFn:
    """The pass called ``name``; a ``KeyError`` naming the known passes otherwise."""
    try:
        return PASSES[name]
    except KeyError:
        known = ", ".join(sorted(PASSES)) or "(none yet)"
        raise KeyError(f"unknown pass {name!r}; known passes: {known}") from None
