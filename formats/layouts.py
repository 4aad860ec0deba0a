"""Weight layouts: how a scheme's bytes are arranged for the kernels that read them.

A layout is a named, invertible rearrangement of a linear op's weight tensors (the ``weight`` and its
companions, by role). ``reorder_weights`` packs with ``pack``; reference kernels and tests go back to
``row_major`` with ``unpack``. Backends read the tag and refuse tags they do not know.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Layout", "LAYOUTS", "register_layout", "layout_for", "pack", "unpack", "LayoutError"]

Arrays = dict[str, np.ndarray]  # role ("weight", "scales", "zeros", "meta") -> array


class LayoutError(ValueError):
    """An unknown layout tag, or one that does not apply to the scheme."""


@dataclass(frozen=True, slots=True)
class Layout:
    """A named layout: which schemes it applies to and its pack/unpack pair (inverse of each other)."""

    name: str
    schemes: tuple[str, ...]  # schemes this layout can hold
    targets: tuple[str, ...]  # build targets whose kernels prefer it ("cpu", "cuda")
    pack: Callable[[Arrays, dict[str, Any]], Arrays]  # row_major arrays -> this layout
    unpack: Callable[[Arrays, dict[str, Any]], Arrays]  # this layout -> row_major arrays
    doc: str = ""


LAYOUTS: dict[str, Layout] = {}


def register_layout(layout: Layout) -> Layout:
    """Add a layout to the registry (names are unique)."""
    if layout.name in LAYOUTS:
        raise LayoutError(f"layout {layout.name!r} is registered twice")
    LAYOUTS[layout.name] = layout
    return layout


def _identity(arrays: Arrays, params: dict[str, Any]) -> Arrays:
    return dict(arrays)


register_layout(
    Layout(
        "row_major",
        ("none", "w8a16", "int4", "sparse24", "sparse24_int4"),
        (),
        _identity,
        _identity,
        "the scheme's plain layout, as formats/README.md tabulates it",
    )
)


def _get(name: str, scheme: str) -> Layout:
    layout = LAYOUTS.get(name)
    if layout is None:
        raise LayoutError(f"unknown weight layout {name!r}; known: {', '.join(sorted(LAYOUTS))}")
    if scheme not in layout.schemes:
        raise LayoutError(f"layout {name!r} does not hold scheme {scheme!r} (it holds {', '.join(layout.schemes)})")
    return layout


def layout_for(target: str, scheme: str) -> str:
    """The layout the kernels of ``target`` read fastest for ``scheme`` (``row_major`` if none is better)."""
    for layout in LAYOUTS.values():
        if target in layout.targets and scheme in layout.schemes:
            return layout.name
    return "row_major"


def pack(name: str, arrays: Arrays, scheme: str, params: dict[str, Any]) -> Arrays:
    """Row-major ``arrays`` of ``scheme`` rewritten into layout ``name``."""
    return _get(name, scheme).pack(arrays, params)


def unpack(name: str, arrays: Arrays, scheme: str, params: dict[str, Any]) -> Arrays:
    """Arrays in layout ``name`` back to row-major."""
    return _get(name, scheme).unpack(arrays, params)
