"""Turning a stored weight tensor into the float32 matrix the reference kernels multiply by.

Each quantization scheme has one dequantizer in ``SCHEMES``; a pass that adds a scheme adds its
reference dequantizer here, and every backend's linear kernel is tested against it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from mgx.formats import layouts
from mgx.formats.ir import DType, Tensor, numpy_dtype

from .dtypes import to_f32
from .quant import QUANT_SCHEMES, QuantFormatError

__all__ = ["SCHEMES", "UnsupportedWeightError", "dequantize"]


class UnsupportedWeightError(ValueError):
    """A weight's scheme or layout has no reference kernel."""


def _plain(weight: Tensor, aux: Mapping[str, Tensor]) -> np.ndarray:
    """scheme "none": the stored floats themselves."""
    return to_f32(_data(weight), weight.dtype)


# scheme name -> dequantizer(weight, aux tensors by role: "scales", "zeros", "meta") -> f32 [N, K]
SCHEMES: dict[str, Callable[[Tensor, Mapping[str, Tensor]], np.ndarray]] = {
    "none": _plain,
    **QUANT_SCHEMES,
}


def dequantize(weight: Tensor, aux: Mapping[str, Tensor] | None = None) -> np.ndarray:
    """The float32 values of ``weight`` (a view when it is stored as plain f32).

    A weight in another layout than ``row_major`` is first unpacked with ``mgx.formats.layouts``.
    """
    aux = aux or {}
    fn = SCHEMES.get(weight.scheme)
    if fn is None:
        raise UnsupportedWeightError(
            f"tensor {weight.name}: quantization scheme {weight.scheme!r} (layout {weight.layout!r}) has no "
            f"reference kernel; known: {', '.join(sorted(SCHEMES))}"
        )
    if weight.layout != "row_major":
        weight, aux = _row_major(weight, aux)
    try:
        return fn(weight, aux)
    except QuantFormatError as exc:
        raise UnsupportedWeightError(str(exc)) from None


def _row_major(weight: Tensor, aux: Mapping[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
    """``weight`` and its companions unpacked from their layout into row-major tensors."""
    arrays = {"weight": _data(weight), **{role: _data(t) for role, t in aux.items()}}
    try:
        plain = layouts.unpack(weight.layout, arrays, weight.scheme, weight.scheme_params)
    except layouts.LayoutError as exc:
        raise UnsupportedWeightError(f"tensor {weight.name} (scheme {weight.scheme!r}): {exc}") from None
    tensors = {role: _retagged(weight if role == "weight" else aux[role], a) for role, a in plain.items()}
    return tensors.pop("weight"), tensors


def _retagged(t: Tensor, data: np.ndarray) -> Tensor:
    dtype = t.dtype if data.dtype == numpy_dtype(t.dtype) else _DTYPES[data.dtype]
    return Tensor(t.name, dtype, data.shape, data, t.scheme, t.scheme_params, "row_major")


# numpy dtype -> IR dtype of an unpacked array whose element type differs from its tensor's.
_DTYPES = {numpy_dtype(d): d for d in DType if d != DType.BF16}


def _data(t: Tensor) -> np.ndarray:
    if t.data is None:
        raise UnsupportedWeightError(f"tensor {t.name} has no data")
    return t.data
