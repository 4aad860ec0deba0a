"""C++ CPU kernels behind thin numpy wrappers: one entry point per IR op.

The extension ``_mgx_cpu`` (kernels/cpu/csrc, built by ``pip install``) holds every kernel three
times: AVX-512, AVX2+FMA and portable scalar. At import the best path the CPU reports is chosen;
``MGX_CPU_ISA=avx512|avx2|scalar`` or ``set_isa`` forces one (tests run each path the host has).
Kernels are multi-threaded over output channels, rows or attention heads; ``MGX_NUM_THREADS`` or
``set_num_threads`` sets the thread count (default: the CPUs this process may run on).

Every wrapper checks dtypes and shapes, allocates its output and calls the extension once.
Activations are float32 ``[T, F]``; rows may be strided (the views ``split`` returns) but the
elements of a row must be contiguous. Weights are read where the artifact maps them: scheme and
layout (``row_major`` or ``cpu_tile16``, see ``mgx.formats.layouts``) say how, nothing is repacked.
Accuracy: float32 accumulation throughout; results differ from the numpy reference only by
summation order (relative error around 1e-6 for K in the thousands).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import numpy as np

from mgx.formats.ir import DType, Tensor

try:
    from . import _mgx_cpu as _C
except ImportError as exc:  # pragma: no cover - a source tree that was never built
    raise ImportError(
        "the MGX CPU kernels are not built (mgx.kernels.cpu._mgx_cpu is missing); reinstall the package "
        "with a C++17 compiler available: pip install ."
    ) from exc

__all__ = [
    "CPUSettingError",
    "CPUWeightError",
    "LinearWeight",
    "embedding",
    "features",
    "isa",
    "linear",
    "lm_head_argmax",
    "num_threads",
    "paged_attention",
    "rms_norm",
    "rope",
    "rope_table",
    "set_isa",
    "set_num_threads",
    "silu_mul",
    "supported_isas",
    "use_isa",
]

_SCHEMES = {"none": 0, "w8a16": 1, "int4": 2, "sparse24": 3, "sparse24_int4": 4}
_LAYOUTS = {"row_major": 0, "cpu_tile16": 1}
_FLOATS = {DType.F32: 0, DType.BF16: 1, DType.F16: 2}
# The stored dtype of the weight role, per scheme (float schemes take any of _FLOATS).
_INT_DTYPE = {"w8a16": DType.I8, "int4": DType.U8, "sparse24_int4": DType.U8}


class CPUWeightError(ValueError):
    """A weight the CPU kernels cannot read; the message names the tensor, its scheme and its layout."""


# -- configuration ------------------------------------------------------------------------------------


# The extension's entry points without this module's Python-side argument checks (the C side still
# checks what memory safety needs): for callers that validated shapes once and run many small ops,
# like the CPU backend's step program. Everyone else uses the functions below.
raw = _C


def supported_isas() -> list[str]:
    """The kernel paths this host can run, best first ("scalar" is always last)."""
    return list(_C.supported_isas())


def isa() -> str:
    """The kernel path in use."""
    return _C.get_isa()


def set_isa(name: str) -> None:
    """Use the ``name`` path ("avx512", "avx2" or "scalar"); ValueError if this host cannot run it."""
    _C.set_isa(name)


@contextmanager
def use_isa(name: str) -> Iterator[None]:
    """Run a block on the ``name`` path, then go back to the previous one."""
    previous = isa()
    set_isa(name)
    try:
        yield
    finally:
        set_isa(previous)


def features() -> dict[str, bool]:
    """What the CPU reports (avx2, fma, f16c, avx512f/bw/vl/dq, avx512_vnni, avx512_bf16, avx_vnni)."""
    return dict(_C.features())


def num_threads() -> int:
    """Threads each kernel call uses."""
    return int(_C.get_num_threads())


def set_num_threads(n: int) -> None:
    """Use ``n`` threads per kernel call."""
    _C.set_num_threads(int(n))


def _default_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class CPUSettingError(ValueError):
    """An ``MGX_NUM_THREADS`` or ``MGX_CPU_ISA`` value the kernels cannot use; the message names it."""


def _apply_env() -> None:
    """The threads and path ``MGX_NUM_THREADS`` and ``MGX_CPU_ISA`` ask for (unset or empty: all cores,
    the best path); CPUSettingError names a value that is not a thread count or a path of this host."""
    threads = os.environ.get("MGX_NUM_THREADS", "").strip()
    try:
        n = int(threads) if threads else _default_threads()
    except ValueError:
        n = 0
    if n < 1:
        raise CPUSettingError(f"MGX_NUM_THREADS={threads!r} is not a thread count: give a whole number >= 1")
    set_num_threads(n)
    name = os.environ.get("MGX_CPU_ISA", "").strip()
    if name and name not in supported_isas():
        raise CPUSettingError(f"MGX_CPU_ISA={name!r} is not a kernel path of this host: it runs "
                              f"{', '.join(supported_isas())}")  # fmt: skip
    if name:
        set_isa(name)


_apply_env()


# -- argument checks ----------------------------------------------------------------------------------


_F32 = np.dtype(np.float32)


def _rows(x: np.ndarray, name: str, width: int | None = None) -> None:
    """x must be float32 [T, F] (F = width when given) with contiguous rows."""
    # The common case in one expression: this runs for every activation of every op.
    if (
        type(x) is np.ndarray
        and x.dtype is _F32
        and x.ndim == 2
        and (width is None or x.shape[1] == width)
        and (x.strides[1] == 4 or x.shape[1] <= 1)
    ):
        return
    if not isinstance(x, np.ndarray) or x.dtype != np.float32:
        raise TypeError(f"{name} must be a float32 numpy array, got {getattr(x, 'dtype', type(x))}")
    if x.ndim != 2:
        raise ValueError(f"{name} must be 2-D [tokens, features], got shape {x.shape}")
    if width is not None and x.shape[1] != width:
        raise ValueError(f"{name} has {x.shape[1]} features, expected {width}")
    # No rows: nothing is read (numpy gives the rows of an empty index strides 0).
    if x.shape[1] > 1 and x.strides[1] != 4 and x.shape[0] > 0:
        raise ValueError(f"{name} must have contiguous rows (strides {x.strides})")


def _vector(a: np.ndarray, dtype: type, name: str) -> np.ndarray:
    """``a`` as a contiguous 1-D array of ``dtype`` (converted only when it is not one already)."""
    return np.ascontiguousarray(np.asarray(a).reshape(-1), dtype=dtype)


# -- weights ------------------------------------------------------------------------------------------


class LinearWeight:
    """A weight of a linear, LM head or embedding op, handed to the kernels without copying.

    The handle keeps the mapped arrays alive and records their scheme and layout once, so each call
    passes only activations.
    """

    __slots__ = ("name", "scheme", "layout", "out_features", "in_features", "_handle")

    def __init__(self, weight: Tensor, aux: Mapping[str, Tensor] | None = None, bias: np.ndarray | None = None) -> None:
        """``weight`` with its companions by role (``scales``, ``zeros``, ``meta``) and a float bias [N]."""
        aux = aux or {}
        self.name, self.scheme, self.layout = weight.name, weight.scheme, weight.layout
        where = f"tensor {weight.name} (scheme {weight.scheme!r}, layout {weight.layout!r})"
        if weight.scheme not in _SCHEMES or weight.layout not in _LAYOUTS:
            raise CPUWeightError(
                f"{where}: the CPU kernels read schemes {', '.join(_SCHEMES)} in layouts {', '.join(_LAYOUTS)}"
            )
        if weight.data is None:
            raise CPUWeightError(f"{where}: no data")
        expected = _INT_DTYPE.get(weight.scheme)
        if expected is None and weight.dtype not in _FLOATS:
            raise CPUWeightError(f"{where}: values must be f32, bf16 or f16, got {weight.dtype.value}")
        if expected is not None and weight.dtype != expected:
            raise CPUWeightError(f"{where}: values must be {expected.value}, got {weight.dtype.value}")
        n = weight.shape[0]
        k = int(weight.scheme_params.get("cols", weight.shape[1] if len(weight.shape) == 2 else 0))
        group = int(weight.scheme_params.get("group_size", 0))
        if weight.scheme in ("int4", "sparse24_int4") and not weight.scheme_params.get("symmetric", False):
            if "zeros" not in aux:
                raise CPUWeightError(f"{where}: asymmetric int4 needs zeros")
        arrays = {role: _data(aux[role], where) if role in aux else None for role in ("scales", "zeros", "meta")}
        if arrays["zeros"] is not None and weight.scheme_params.get("symmetric", False):
            arrays["zeros"] = None  # symmetric: the zero point is 8 whatever is stored
        b = None if bias is None else _vector(bias, np.float32, "bias")
        try:
            self._handle = _C.make_weight(
                _SCHEMES[weight.scheme],
                _LAYOUTS[weight.layout],
                _FLOATS.get(weight.dtype, 0),
                n,
                k,
                group,
                _data(weight, where),
                arrays["scales"],
                arrays["zeros"],
                arrays["meta"],
                b,
            )
        except (TypeError, ValueError) as exc:
            raise CPUWeightError(f"{where}: {exc}") from None
        self.out_features, self.in_features = n, k

    def __repr__(self) -> str:
        return f"LinearWeight({self.name!r}, {self.scheme}, {self.layout}, [{self.out_features}, {self.in_features}])"


def _data(t: Tensor, where: str) -> np.ndarray:
    if t.data is None or not t.data.flags.c_contiguous:
        raise CPUWeightError(f"{where}: tensor {t.name} must have contiguous data")
    return t.data


# -- kernels ------------------------------------------------------------------------------------------


def linear(x: np.ndarray, w: LinearWeight, out: np.ndarray | None = None) -> np.ndarray:
    """x [T, K] @ W^T (+ bias) -> [T, N] float32."""
    _rows(x, "x", w.in_features)
    if out is None:
        out = np.empty((x.shape[0], w.out_features), np.float32)
    else:
        _rows(out, "out", w.out_features)
    _C.linear(w._handle, x, out)
    return out


def lm_head_argmax(x: np.ndarray, w: LinearWeight) -> tuple[np.ndarray, np.ndarray]:
    """Greedy tokens of x [R, K]: per row the index (int64, first on ties) and value of the largest
    logit, computed block by block without materializing the [R, V] logits."""
    _rows(x, "x", w.in_features)
    index = np.empty(x.shape[0], np.int64)
    value = np.empty(x.shape[0], np.float32)
    _C.linear_argmax(w._handle, x, index, value)
    return index, value


def embedding(tokens: np.ndarray, w: LinearWeight) -> np.ndarray:
    """Rows ``tokens`` [T] of the (dequantized) table -> [T, H] float32; IndexError outside the vocabulary."""
    rows = _vector(tokens, np.int64, "tokens")
    out = np.empty((rows.size, w.in_features), np.float32)
    _C.gather_rows(w._handle, rows, out)
    return out


def rms_norm(
    x: np.ndarray,
    weight: np.ndarray | None,
    *,
    eps: float,
    group: int,
    residual: np.ndarray | None = None,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """RMSNorm of x [T, F] over groups of ``group`` features, times weight [group] (float32).

    With ``residual`` it normalizes ``x + residual`` in the same pass and returns ``(out, x + residual)``.
    """
    _rows(x, "x")
    if x.shape[1] % group:
        raise ValueError(f"width {x.shape[1]} is not a multiple of group {group}")
    if weight is not None and (weight.dtype != np.float32 or weight.shape != (group,)):
        raise ValueError(f"weight must be float32 [{group}], got {weight.dtype} {weight.shape}")
    out = np.empty(x.shape, np.float32)
    if residual is None:
        _C.rms_norm(x, None, weight, group, eps, None, out)
        return out
    _rows(residual, "residual", x.shape[1])
    if residual.shape != x.shape:
        raise ValueError(f"residual shape {residual.shape} != x shape {x.shape}")
    total = np.empty(x.shape, np.float32)
    _C.rms_norm(x, residual, weight, group, eps, total, out)
    return out, total


def rope_table(positions: np.ndarray, inv_freq: np.ndarray, attention_scaling: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [T, R/2] of each position's angles (float32 product, as Hugging Face computes them),
    times ``attention_scaling``. Computed once per step and shared by every layer's ``rope``."""
    pos = _vector(positions, np.int64, "positions")
    freq = _vector(inv_freq, np.float32, "inv_freq")
    cos = np.empty((pos.size, freq.size), np.float32)
    sin = np.empty((pos.size, freq.size), np.float32)
    _C.rope_table(pos, freq, float(attention_scaling), cos, sin)
    return cos, sin


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, *, head_dim: int, rotary_dim: int) -> np.ndarray:
    """Rotate-half RoPE of x [T, H*D]: the first ``rotary_dim`` dims of each head turn by cos/sin [T, R/2]."""
    _rows(x, "x")
    if x.shape[1] % head_dim:
        raise ValueError(f"width {x.shape[1]} is not a multiple of head_dim {head_dim}")
    for name, table in (("cos", cos), ("sin", sin)):
        _rows(table, name, rotary_dim // 2)
    out = np.empty(x.shape, np.float32)
    _C.rope(x, x.shape[1] // head_dim, head_dim, rotary_dim, cos, sin, out)
    return out


def silu_mul(gate: np.ndarray, up: np.ndarray | None = None) -> np.ndarray:
    """silu(gate) * up -> [T, F]; with ``up`` None, gate [T, 2F] holds gate then up."""
    _rows(gate, "gate")
    if up is None:
        if gate.shape[1] % 2:
            raise ValueError(f"fused gate/up width {gate.shape[1]} is odd")
        half = gate.shape[1] // 2
        gate, up = gate[:, :half], gate[:, half:]
    _rows(up, "up", gate.shape[1])
    out = np.empty(gate.shape, np.float32)
    _C.silu_mul(gate, up, out)
    return out


_CACHE_TYPES = {np.dtype(np.float32): 0, np.dtype(np.float16): 2}


def paged_attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    positions: np.ndarray,
    block_tables: np.ndarray,
    context_lens: np.ndarray,
    query_start_loc: np.ndarray,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    scale: float,
    sliding_window: int = 0,
    bf16_cache: bool = False,
) -> np.ndarray:
    """Write k, v [T, Hk*D] into their slots of the paged caches, then causal GQA attention -> [T, Hq*D].

    The contract of ``mgx.runtime.batch.PagedStep``: caches [num_blocks, block_size, Hk, D] (float32,
    float16, or bf16 as uint16 with ``bf16_cache``); sequence i owns rows
    ``query_start_loc[i]:query_start_loc[i+1]`` and ``block_tables[i]``; a query at position p sees
    keys j <= p (and p - j < sliding_window when it is > 0). Prefill and decode rows mix freely.
    """
    _rows(q, "q", num_heads * head_dim)
    _rows(k, "k", num_kv_heads * head_dim)
    _rows(v, "v", num_kv_heads * head_dim)
    if bf16_cache:
        if k_cache.dtype != np.uint16:
            raise TypeError(f"a bf16 cache holds uint16 bit patterns, got {k_cache.dtype}")
        cache_type = 1
    elif k_cache.dtype in _CACHE_TYPES:
        cache_type = _CACHE_TYPES[k_cache.dtype]
    else:
        raise TypeError(f"cache dtype must be float32 or float16 (or uint16 with bf16_cache), got {k_cache.dtype}")
    if v_cache.dtype != k_cache.dtype or v_cache.shape != k_cache.shape:
        raise ValueError("k_cache and v_cache must have one dtype and shape")
    tables = np.ascontiguousarray(block_tables, dtype=np.int32)
    if tables.ndim != 2:
        raise ValueError(f"block_tables must be [B, max_blocks], got shape {tables.shape}")
    out = np.empty((q.shape[0], num_heads * head_dim), np.float32)
    _C.attention(
        q,
        k,
        v,
        out,
        _vector(positions, np.int64, "positions"),
        _vector(query_start_loc, np.int32, "query_start_loc"),
        _vector(context_lens, np.int32, "context_lens"),
        tables,
        k_cache,
        v_cache,
        cache_type,
        num_heads,
        num_kv_heads,
        head_dim,
        float(scale),
        int(sliding_window),
    )
    return out
