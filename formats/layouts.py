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

__all__ = [
    "Layout",
    "LAYOUTS",
    "register_layout",
    "layout_for",
    "pack",
    "unpack",
    "LayoutError",
    "pack_sparse24_nibble_meta",
    "unpack_sparse24_nibble_meta",
    "tile16_axes",
    "tile16_holds",
]

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


# -- sparse24_nibble_meta: what the Triton GPU linear kernels read fastest for 2:4 weights -------------
#
# The kept values stay [N, K/2]; the metadata keeps each group's two 2-bit indices in a nibble (bits
# 0-1 the first kept column, bits 2-3 the second, as in row_major) and packs two groups per byte, low
# nibble first: meta [N, K/8] u8 instead of [N, K/4]. Row-major leaves the high nibble of every meta
# byte empty; packing it cuts a bf16 2:4 weight from 1.25 to 1.125 bytes per dense column, which a
# bandwidth-bound GEMV turns into time. Needs K % 8 == 0.


def pack_sparse24_nibble_meta(arrays: Arrays, params: dict[str, Any]) -> Arrays:
    """row_major sparse24 arrays -> meta [N, K/8] with two groups a byte; other roles unchanged."""
    meta = np.asarray(arrays["meta"])
    if meta.dtype != np.uint8 or meta.ndim != 2 or meta.shape[1] % 2:
        raise ValueError(f"sparse24 meta must be u8 [N, K/4] with K % 8 == 0, got {meta.dtype} {meta.shape}")
    if (meta & 0xF0).any():
        raise ValueError("sparse24 meta has bits set above bit 3; row_major uses only the low nibble")
    out = dict(arrays)
    out["meta"] = np.ascontiguousarray(meta[:, 0::2] | (meta[:, 1::2] << 4))
    return out


def unpack_sparse24_nibble_meta(arrays: Arrays, params: dict[str, Any]) -> Arrays:
    """meta [N, K/8] back to the row_major [N, K/4] (one group a byte)."""
    packed = np.asarray(arrays["meta"])
    if packed.dtype != np.uint8 or packed.ndim != 2:
        raise ValueError(f"packed sparse24 meta must be u8 [N, K/8], got {packed.dtype} {packed.shape}")
    meta = np.empty((packed.shape[0], packed.shape[1] * 2), np.uint8)
    meta[:, 0::2] = packed & 0xF
    meta[:, 1::2] = packed >> 4
    out = dict(arrays)
    out["meta"] = meta
    return out


register_layout(
    Layout(
        "sparse24_nibble_meta",
        ("sparse24", "sparse24_int4"),
        ("cuda",),
        pack_sparse24_nibble_meta,
        unpack_sparse24_nibble_meta,
        "2:4 weights with two groups' 2-bit index pairs per meta byte (low nibble first): meta [N, K/8] "
        "instead of [N, K/4]; values, scales and zeros as in row_major. Needs K % 8 == 0.",
    )
)


# -- cuda_tile16: what the integer tensor-core GEMVs (kernels/cuda/gemv.cu, the imma kinds) read ----------
#
# The codes of 16 rows and one 128-column step are 1,024 (int4) or 2,048 (W8A16) contiguous bytes, so
# that a warp's load of 8 rows' step is 512 contiguous bytes instead of 64 bytes of 8 rows. For row r
# and byte b of its row (U = 1 unit of 64 bytes a step for int4, 2 for W8A16; S = K / 128 steps):
#
#   ((r // 16) S + b // (64 U)) 1024 U + ((b // 64) % U) 1024 + (r % 16) 64 + b % 64
#
# i.e. per tile and step, for each of its U 64-byte units, that unit of the 16 rows (``tile16_axes``).
# Shapes, dtypes, scales, zeros and bias as in row_major. Needs N % 16 == 0 and K % 128 == 0. On the
# H200 (83rd run) the 8B layer chain took W8A16 2.308 -> 2.260 ms and INT4 1.728 -> 1.707 ms.

TILE_ROWS, TILE_COLUMNS = 16, 128  # rows and columns of a cuda_tile16 tile
TILE16_UNITS = {"int4": 1, "w8a16": 2}  # 64-byte units of a row's 128-column step


def tile16_holds(n: int, k: int) -> bool:
    """Whether cuda_tile16 holds a weight of ``n`` rows and ``k`` columns (whole tiles only)."""
    return n % TILE_ROWS == 0 and k % TILE_COLUMNS == 0


def tile16_axes(scheme: str, n: int, row_bytes: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """How cuda_tile16 moves a row-major ``scheme`` weight's codes [N, row bytes]: viewed as [N/16, 16,
    S, U, 64], its bytes are stored in the axis order returned ([N/16, S, U, 16, 64]); the same for
    numpy (``pack``) and torch (``testing.tile16``, ``linear.row_major_codes``). ValueError where the
    layout cannot hold the shape."""
    units = TILE16_UNITS[scheme]
    k = row_bytes * 2 // units
    if not tile16_holds(n, k):
        raise ValueError(f"cuda_tile16 needs N % 16 == 0 rows and K % 128 == 0 columns, got N={n}, K={k}")
    return (n // TILE_ROWS, TILE_ROWS, k // TILE_COLUMNS, units, 64), (0, 2, 3, 1, 4)


def _tile16_view(w: np.ndarray) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``tile16_axes`` of a row-major weight array (int4 codes u8 [N, K/2] or W8A16 int8 [N, K])."""
    scheme = {np.dtype(np.uint8): "int4", np.dtype(np.int8): "w8a16"}.get(w.dtype)
    if scheme is None or w.ndim != 2:
        raise ValueError(f"cuda_tile16 holds int4 codes (u8) and W8A16 codes (i8) [N, row bytes], got {w.dtype} {w.shape}")
    return tile16_axes(scheme, *w.shape)


def _pack_tile16(arrays: Arrays, params: dict[str, Any]) -> Arrays:
    w = np.asarray(arrays["weight"])
    shape, order = _tile16_view(w)
    out = dict(arrays)
    out["weight"] = np.ascontiguousarray(w.reshape(shape).transpose(order)).reshape(w.shape)
    return out


def _unpack_tile16(arrays: Arrays, params: dict[str, Any]) -> Arrays:
    w = np.asarray(arrays["weight"])
    shape, order = _tile16_view(w)
    out = dict(arrays)
    out["weight"] = np.ascontiguousarray(w.reshape([shape[i] for i in order]).transpose(np.argsort(order))).reshape(w.shape)
    return out


register_layout(
    Layout(
        "cuda_tile16",
        ("int4", "w8a16"),
        ("cuda",),
        _pack_tile16,
        _unpack_tile16,
        "int4 and W8A16 codes in tiles of 16 rows x one 128-column step, for the integer tensor-core GEMVs "
        "(tile16_axes); scales, zeros and bias as in row_major. Needs N % 16 == 0 and K % 128 == 0.",
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
