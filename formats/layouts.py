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


# -- cpu_tile16: what the C++ CPU kernels (mgx.kernels.cpu) stream ----------------------------------

CPU_TILE = 16  # output channels per tile
_PER_CHANNEL_ROLES = ("weight", "scales", "zeros", "meta")  # arrays [N, ...] with one row per output channel


def _tile_channels(a: np.ndarray) -> np.ndarray:
    """[N, ...] -> same shape and dtype; each block of 16 channel rows stored transposed, [U][16] (U = the
    row's elements), the last block [U][N % 16]. One k step of 16 outputs is then one contiguous load."""
    n = a.shape[0]
    rows = np.ascontiguousarray(a).reshape(n, -1)  # [N, U]
    full = n - n % CPU_TILE
    head = rows[:full].reshape(-1, CPU_TILE, rows.shape[1]).transpose(0, 2, 1)  # [N/16, U, 16]
    return np.concatenate([head.ravel(), rows[full:].T.ravel()]).reshape(a.shape)


def _untile_channels(a: np.ndarray) -> np.ndarray:
    """The inverse of ``_tile_channels``."""
    n = a.shape[0]
    units = a.size // n if n else 0
    flat = np.ascontiguousarray(a).reshape(-1)
    full = n - n % CPU_TILE
    head = flat[: full * units].reshape(-1, units, CPU_TILE).transpose(0, 2, 1).reshape(full, units)
    tail = flat[full * units :].reshape(units, n - full).T
    return np.concatenate([head, tail]).reshape(a.shape)


def _map_channels(fn: Callable[[np.ndarray], np.ndarray]) -> Callable[[Arrays, dict[str, Any]], Arrays]:
    def apply(arrays: Arrays, params: dict[str, Any]) -> Arrays:
        return {role: fn(a) if role in _PER_CHANNEL_ROLES else a for role, a in arrays.items()}

    return apply


register_layout(
    Layout(
        "cpu_tile16",
        ("none", "w8a16", "int4", "sparse24", "sparse24_int4"),
        ("cpu",),
        _map_channels(_tile_channels),
        _map_channels(_untile_channels),
        "the weight and its per-channel companions (scales, zeros, meta) in tiles of 16 output channels, "
        "each tile transposed to [row elements][16] (the last tile [row elements][N % 16]); shapes, dtypes "
        "and bytes per tensor unchanged. Bias stays as it is.",
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
