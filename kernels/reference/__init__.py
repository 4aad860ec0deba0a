"""The numpy reference kernels: the oracle every other backend is tested against."""

from .dtypes import bf16_to_f32, f32_to_bf16, to_f32
from .ops import add, attention, embedding, linear, rms_norm, rope, silu_mul, split
from .paged import gather_kv, paged_attention, write_kv
from .weights import SCHEMES, UnsupportedWeightError, dequantize

__all__ = [
    "SCHEMES",
    "UnsupportedWeightError",
    "add",
    "attention",
    "bf16_to_f32",
    "dequantize",
    "embedding",
    "f32_to_bf16",
    "gather_kv",
    "linear",
    "paged_attention",
    "rms_norm",
    "rope",
    "silu_mul",
    "split",
    "to_f32",
    "write_kv",
]
