"""Turning a stored weight tensor into the float32 matrix the reference kernels multiply by.

Each quantization scheme has one dequantizer in ``SCHEMES``; a pass that adds a scheme adds its
reference dequantizer here, and every backend's linear kernel is tested against it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from mgx.formats.ir import Tensor

from .dtypes import to_f32

__all__ = ["SCHEMES", "UnsupportedWeightError", "dequantize"]


class UnsupportedWeightError(ValueError):
    """A weight's scheme or layout has no reference kernel."""


def _plain(weight: Tensor, aux: Mapping[str, Tensor]) -> np.ndarray:
    """scheme "none": the stored floats themselves."""
    return to_f32(_data(weight), weight.dtype)


# scheme name -> dequantizer(weight, aux tensors by role: "scales", "zeros", "meta") -> f32 [N, K]
SCHEMES: dict[str, Callable[[Tensor, Mapping[str, Tensor]], np.ndarray]] = {
    "none": _plain,
}


def dequantize(weight: Tensor, aux: Mapping[str, Tensor] | None = None) -> np.ndarray:
    """The float32 values of ``weight`` (a view when it is stored as plain f32)."""
    if weight.layout != "row_major":
        raise UnsupportedWeightError(
            f"tensor {weight.name}: layout {weight.layout!r} has no reference kernel (only 'row_major')"
        )
    fn = SCHEMES.get(weight.scheme)
    if fn is None:
        raise UnsupportedWeightError(
            f"tensor {weight.name}: quantization scheme {weight.scheme!r} has no reference kernel; "
            f"known: {', '.join(sorted(SCHEMES))}"
        )
    return fn(weight, aux or {})


def _data(t: Tensor) -> np.ndarray:
    if t.data is None:
        raise UnsupportedWeightError(f"tensor {t.name} has no data")
    return t.data
