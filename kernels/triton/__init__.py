"""Triton kernels for NVIDIA GPUs: one entry point per op, each beside its launch wrapper.

Importing this package loads nothing (no torch, no triton); the first use of an entry point imports
the module that holds it. On a host without a GPU the kernels still run under ``TRITON_INTERPRET=1``
on torch CPU tensors, which is how CI tests them.

| entry point | module | what it computes |
|---|---|---|
| ``rms_norm`` | ``rmsnorm`` | RMSNorm of [T, F] in groups, optionally fused with the residual add before it |
| ``rope_`` / ``rope_and_write_kv`` | ``rope`` | rotate-half RoPE of q and k in place; optionally storing k, v in the paged cache |
| ``write_kv`` | ``attention`` | scatter k, v [T, Hk*D] into the paged K/V cache |
| ``paged_attention_decode`` | ``attention`` | one query per sequence over its paged context, split over the context |
| ``paged_attention_prefill`` | ``attention`` | flash-style causal attention of packed query rows over the paged cache |
| ``linear`` / ``linear_silu_mul`` | ``linear`` | x @ W^T for dense, w8a16, int4 and 2:4-sparse weights; gate/up with SiLU-mul |
| ``silu_mul`` | ``linear`` | silu(gate) * up on a [T, 2F] activation |
| ``lm_head_argmax`` | ``lm_head`` | greedy token ids and their logits without writing [R, V] logits |
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "GpuWeight",
    "linear",
    "linear_silu_mul",
    "lm_head_argmax",
    "paged_attention_decode",
    "paged_attention_prefill",
    "rms_norm",
    "rope_",
    "rope_and_write_kv",
    "silu_mul",
    "write_kv",
]

_WHERE = {
    "rms_norm": "rmsnorm",
    "rope_": "rope",
    "rope_and_write_kv": "rope",
    "write_kv": "attention",
    "paged_attention_decode": "attention",
    "paged_attention_prefill": "attention",
    "GpuWeight": "linear",
    "linear": "linear",
    "linear_silu_mul": "linear",
    "silu_mul": "linear",
    "lm_head_argmax": "lm_head",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
