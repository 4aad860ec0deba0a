"""GPU weight layouts: pack/unpack pairs for ``mgx.formats.layouts`` (numpy only, so formats can hold them).

``sparse24_nibble_meta`` (scheme ``sparse24``): the values stay [N, K/2]; the metadata keeps each
group's two 2-bit indices in a nibble (bits 0-1 the first kept column, bits 2-3 the second, as in
``row_major``) and packs two groups per byte, low nibble first: meta [N, K/8] u8 instead of
[N, K/4]. The row-major format leaves the high nibble of every meta byte empty; packing it cuts a
bf16 2:4 weight's bytes from 1.25 to 1.125 per dense column, which a bandwidth-bound GEMV turns into
time. Needs K % 8 == 0. The Triton linear kernels read both layouts.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["SPARSE24_NIBBLE_META", "pack_sparse24_nibble_meta", "unpack_sparse24_nibble_meta"]

SPARSE24_NIBBLE_META = "sparse24_nibble_meta"

Arrays = dict[str, np.ndarray]  # role ("weight", "meta", ...) -> array


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
