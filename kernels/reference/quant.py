"""Reference dequantizers of the quantized weight schemes (formats/README.md, "Weight schemes and
layouts"): the oracle for every backend's quantized linear kernels.

Each takes the row-major weight tensor and its companions by role and returns the float32 matrix
[N, K] the op multiplies by, computing ``(q - z) * s`` in float32 so that every implementation of
the contract agrees to the bit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from mgx.formats.ir import Tensor

from .dtypes import to_f32

__all__ = ["QUANT_SCHEMES", "QuantFormatError", "dequant_w8a16", "dequant_int4", "dequant_sparse24",
           "dequant_sparse24_int4"]


class QuantFormatError(ValueError):
    """A quantized weight or companion does not have the shape or dtype its scheme prescribes."""


def _get(weight: Tensor, aux: Mapping[str, Tensor], role: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """The array of companion ``role`` (or the weight itself), checked against the contract."""
    t = weight if role == "weight" else aux.get(role)
    if t is None or t.data is None:
        raise QuantFormatError(f"tensor {weight.name} (scheme {weight.scheme}) has no {role!r} data")
    data = t.data
    if (dtype and data.dtype != np.dtype(dtype)) or tuple(data.shape) != shape:
        raise QuantFormatError(
            f"tensor {weight.name} (scheme {weight.scheme}): {role} is {data.dtype}{list(data.shape)}, "
            f"expected {np.dtype(dtype) if dtype else 'float'}{list(shape)}"
        )
    return data


def _cols(weight: Tensor) -> int:
    return int(weight.scheme_params.get("cols", weight.shape[1] if len(weight.shape) == 2 else 0))


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """[N, K/2] u8 -> [N, K] codes: column 2b is the low nibble of byte b, 2b+1 the high one."""
    return np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(packed.shape[0], -1)


def _int4(weight: Tensor, aux: Mapping[str, Tensor], n: int, k: int) -> np.ndarray:
    """The int4 codes of ``weight`` over ``k`` columns, dequantized: [N, k] float32."""
    group = int(weight.scheme_params["group_size"])
    symmetric = bool(weight.scheme_params["symmetric"])
    groups = -(-k // group)  # the last group may be shorter
    q = _nibbles(_get(weight, aux, "weight", "u1", (n, k // 2)))
    scales = _get(weight, aux, "scales", "<f4", (n, groups))
    s = np.repeat(scales, group, axis=1)[:, :k]  # [N, k]
    if symmetric:
        return (q.astype(np.float32) - np.float32(8)) * s
    z = np.repeat(_get(weight, aux, "zeros", "u1", (n, groups)), group, axis=1)[:, :k]
    return (q.astype(np.float32) - z.astype(np.float32)) * s


def _expand_2_4(values: np.ndarray, meta: np.ndarray, k: int) -> np.ndarray:
    """Kept values [N, K/2] to dense [N, K]: meta[n, j] bits 0-1 and 2-3 place group j's two values."""
    n = values.shape[0]
    dense = np.zeros((n, k // 4, 4), np.float32)
    rows = np.arange(n)[:, None]
    cols = np.arange(k // 4)[None, :]
    pairs = values.reshape(n, k // 4, 2)
    dense[rows, cols, meta & 3] = pairs[..., 0]
    dense[rows, cols, (meta >> 2) & 3] = pairs[..., 1]
    return dense.reshape(n, k)


def dequant_w8a16(weight: Tensor, aux: Mapping[str, Tensor]) -> np.ndarray:
    """``W[n, k] = q[n, k] * scales[n]``."""
    n, k = weight.shape
    q = _get(weight, aux, "weight", "i1", (n, k))
    return q.astype(np.float32) * _get(weight, aux, "scales", "<f4", (n,))[:, None]


def dequant_int4(weight: Tensor, aux: Mapping[str, Tensor]) -> np.ndarray:
    """``W = (q - z) * s`` per group of ``group_size`` columns; z = 8 when symmetric."""
    return _int4(weight, aux, weight.shape[0], _cols(weight))


def dequant_sparse24(weight: Tensor, aux: Mapping[str, Tensor]) -> np.ndarray:
    """Two kept values per four columns, placed by ``meta``."""
    n, k = weight.shape[0], _cols(weight)
    values = to_f32(_get(weight, aux, "weight", "", (n, k // 2)), weight.dtype)
    return _expand_2_4(values, _get(weight, aux, "meta", "u1", (n, k // 4)), k)


def dequant_sparse24_int4(weight: Tensor, aux: Mapping[str, Tensor]) -> np.ndarray:
    """2:4 sparsity whose kept values are int4 (grouped along the kept values)."""
    n, k = weight.shape[0], _cols(weight)
    values = _int4(weight, aux, n, k // 2)
    return _expand_2_4(values, _get(weight, aux, "meta", "u1", (n, k // 4)), k)


QUANT_SCHEMES: dict[str, Callable[[Tensor, Mapping[str, Tensor]], np.ndarray]] = {
    "w8a16": dequant_w8a16,
    "int4": dequant_int4,
    "sparse24": dequant_sparse24,
    "sparse24_int4": dequant_sparse24_int4,
}
