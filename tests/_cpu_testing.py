"""Helpers of the CPU kernel tests: random weights of every scheme (formats/README.md, "Weight schemes
and layouts") and their ``cpu_tile16`` form, built directly from the contract, not by the passes."""

from __future__ import annotations

from typing import Any

import numpy as np

from mgx.formats import ir, layouts
from mgx.kernels import cpu

ISAS = cpu.supported_isas()  # every path this host runs: each kernel test runs on each

SCHEMES = {  # name -> (scheme, value dtype, params)
    "f32": ("none", ir.DType.F32, {}),
    "bf16": ("none", ir.DType.BF16, {}),
    "f16": ("none", ir.DType.F16, {}),
    "w8a16": ("w8a16", ir.DType.I8, {}),
    "int4-g32": ("int4", ir.DType.U8, {"group_size": 32, "symmetric": False}),
    "int4-g64-sym": ("int4", ir.DType.U8, {"group_size": 64, "symmetric": True}),
    "sparse24-bf16": ("sparse24", ir.DType.BF16, {}),
    "sparse24-int4-g32": ("sparse24_int4", ir.DType.U8, {"group_size": 32, "symmetric": False}),
}


def _floats(values: np.ndarray, dtype: ir.DType) -> np.ndarray:
    if dtype is ir.DType.F32:
        return values.astype(np.float32)
    if dtype is ir.DType.F16:
        return values.astype(np.float16)
    bits = values.astype(np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def _int4(rng: np.random.Generator, n: int, cols: int, params: dict[str, Any]) -> dict[str, np.ndarray]:
    """Packed codes [N, cols/2] and scales (and zeros) [N, ceil(cols/g)] over ``cols`` columns."""
    groups = -(-cols // params["group_size"])
    arrays = {
        "weight": rng.integers(0, 256, (n, cols // 2), dtype=np.uint8),
        "scales": rng.uniform(0.005, 0.02, (n, groups)).astype(np.float32),
    }
    if not params["symmetric"]:
        arrays["zeros"] = rng.integers(0, 16, (n, groups), dtype=np.uint8)
    return arrays


def random_weight(name: str, n: int, k: int, seed: int = 0) -> tuple[ir.Tensor, dict[str, ir.Tensor]]:
    """A row-major weight [N, K] of scheme ``SCHEMES[name]`` and its companions by role."""
    scheme, dtype, params = SCHEMES[name]
    rng = np.random.default_rng(seed)
    params = dict(params, cols=k) if scheme != "none" else {}
    if scheme == "none":
        arrays = {"weight": _floats(rng.normal(0, 0.1, (n, k)), dtype)}
    elif scheme == "w8a16":
        arrays = {
            "weight": rng.integers(-127, 128, (n, k), dtype=np.int8),
            "scales": rng.uniform(0.0005, 0.002, n).astype(np.float32),
        }
    else:  # the 2:4 schemes: two kept columns of every four, indices in order
        first = rng.integers(0, 3, (n, k // 4))
        second = first + 1 + rng.integers(0, 3 - first)
        arrays = {"meta": (first | (second << 2)).astype(np.uint8)}
        if scheme == "sparse24":
            arrays["weight"] = _floats(rng.normal(0, 0.1, (n, k // 2)), dtype)
        else:
            arrays.update(_int4(rng, n, k // 2, params))
    if scheme == "int4":
        arrays = _int4(rng, n, k, params)
    tensors = {
        role: ir.Tensor(f"w.{role}", _dtype_of(a, dtype if role == "weight" else None), a.shape, a, scheme, params)
        for role, a in arrays.items()
    }
    return tensors.pop("weight"), tensors


def _dtype_of(a: np.ndarray, declared: ir.DType | None) -> ir.DType:
    if declared is not None:
        return declared
    return {np.dtype(np.float32): ir.DType.F32, np.dtype(np.uint8): ir.DType.U8}[a.dtype]


def tiled(weight: ir.Tensor, aux: dict[str, ir.Tensor]) -> tuple[ir.Tensor, dict[str, ir.Tensor]]:
    """The same weight in the ``cpu_tile16`` layout, packed as reorder_weights packs it."""
    arrays = {"weight": weight.data, **{role: t.data for role, t in aux.items()}}
    packed = layouts.pack("cpu_tile16", arrays, weight.scheme, weight.scheme_params)

    def retag(t: ir.Tensor, data: np.ndarray) -> ir.Tensor:
        return ir.Tensor(t.name, t.dtype, t.shape, data, t.scheme, t.scheme_params, "cpu_tile16")

    return retag(weight, packed["weight"]), {role: retag(t, packed[role]) for role, t in aux.items()}
