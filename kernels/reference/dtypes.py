"""Element-type helpers for the reference kernels: everything computes in float32."""

from __future__ import annotations

import numpy as np

from mgx.formats.ir import DType

__all__ = ["bf16_to_f32", "f32_to_bf16", "to_f32"]


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32, exactly: bf16 is the top half of an f32."""
    if bits.dtype != np.uint16:
        raise TypeError(f"bf16 data must be uint16 bit patterns, got {bits.dtype}")
    return (bits.astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounding to nearest even like torch; NaN stays NaN."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    # Adding 0x7FFF plus the lowest kept bit rounds half to even; finite values never overflow.
    rounded = ((u + (np.uint32(0x7FFF) + ((u >> 16) & 1))) >> 16).astype(np.uint16)
    quiet_nan = ((u >> 16) | 0x0040).astype(np.uint16)
    return np.where(np.isnan(x), quiet_nan, rounded)


def to_f32(data: np.ndarray, dtype: DType) -> np.ndarray:
    """The float32 values of ``data`` stored as ``dtype``; f32 data is returned as is (no copy)."""
    dtype = DType(dtype)
    if dtype is DType.F32:
        return data
    if dtype is DType.BF16:
        return bf16_to_f32(data)
    if dtype is DType.F16:
        return data.astype(np.float32)
    raise TypeError(f"{dtype.value} is not a floating-point dtype")
