"""IR weights on the device: the ``GpuWeight`` a linear kernel reads, from an IR tensor's metadata and
its bytes (already on the device, or uploaded here), in a layout the kernels read."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from mgx.formats import layouts as layout_registry
from mgx.formats.ir import DType, Tensor

from .linear import LAYOUTS, GpuWeight

__all__ = ["TORCH_DTYPES", "gpu_arrays", "gpu_weight"]

TORCH_DTYPES = {
    DType.F32: torch.float32,
    DType.F16: torch.float16,
    DType.BF16: torch.bfloat16,
    DType.I8: torch.int8,
    DType.U8: torch.uint8,
    DType.I32: torch.int32,
    DType.I64: torch.int64,
}


def gpu_arrays(t: Tensor, aux: Mapping[str, Tensor], device: torch.device | str) -> dict[str, torch.Tensor]:
    """``t`` and its companions by role as device tensors, unpacked to row_major first when their layout
    is not one the GPU kernels read (``cpu_tile16``). Raises ``LayoutError`` for unknown layouts."""
    arrays = {"weight": t.data, **{role: a.data for role, a in aux.items()}}
    if t.layout not in LAYOUTS:
        arrays = layout_registry.unpack(t.layout, arrays, t.scheme, t.scheme_params)
    out = {r: torch.from_numpy(np.ascontiguousarray(a)).to(device) for r, a in arrays.items()}
    out["weight"] = out["weight"].view(TORCH_DTYPES[t.dtype])
    return out


def gpu_weight(t: Tensor, arrays: Mapping[str, torch.Tensor], dtype: torch.dtype) -> GpuWeight:
    """The ``GpuWeight`` of IR tensor ``t`` over ``arrays`` (role -> device tensor, in a GPU layout);
    dense and 2:4 values are converted to the compute ``dtype``. Raises ``ValueError`` on a mismatch."""
    w = arrays["weight"]
    if t.scheme in ("none", "sparse24") and w.dtype != dtype:
        w = w.to(dtype)
    p = t.scheme_params
    return GpuWeight(
        t.scheme, t.shape[0], int(p.get("cols", t.shape[1])), w,
        scales=arrays.get("scales"), zeros=arrays.get("zeros"), meta=arrays.get("meta"),
        group_size=int(p.get("group_size", 0)), symmetric=bool(p.get("symmetric", True)),
        layout=t.layout if t.layout in LAYOUTS else "row_major",
    )  # fmt: skip
