"""Stored launch configurations: what the ``autotune`` pass chose per shape, looked up at run time.

An entry is keyed by the kernel (``linear``, ``linear_silu_mul``, ``lm_head_argmax``), the weight's
signature (scheme, layout, int4 group, N, K) and the number of activation rows M it was timed at. A
step with M rows takes the entry tuned for the smallest tuned M >= M (the largest one beyond them);
a shape that was never tuned gets the kernel's default configuration, and a one-row (GEMV) entry never
serves several rows nor the reverse.

Attention entries (``paged_attention_decode``: a ``DecodeConfig`` per batch bucket, M the number of
sequences; ``paged_attention_prefill``: a ``PrefillConfig`` per chunk, M its query rows;
``rope_and_write_kv``: a ``RopeConfig`` of the RoPE and K/V write before the paged kernels, M the
step's tokens; ``decode_merge``: a ``MergeConfig`` of split decode's merge kernel, M as decode's)
are keyed by the attention's heads (``attention_signature``); a step takes the entry of the smallest
tuned M >= its rows (the largest beyond them), and an untuned shape the kernel's defaults.

Entries of the kernels around the dense (cuBLAS) products that replace these kernels for many rows
(``linear.dense_product``): ``dequantize`` (a ``DequantizeConfig``, keyed by the weight's signature,
M the first tuned row count it serves) and ``silu_mul`` (a ``SiluMulConfig``, keyed by the output
width, ``silu_signature``), looked up as the attention entries; so is ``argmax_merge`` (an
``ArgmaxMergeConfig`` of the greedy LM head's second kernel, keyed by the tiles a row is merged
from, ``merge_signature``), and ``embedding_rows`` (a ``DequantizeConfig`` of a quantized embedding's
row lookup, keyed by the table's weight signature, M the rows looked up).

RMSNorm entries (``rms_norm``: an ``RMSNormConfig`` of the Triton RMSNorm, which runs where the native
one cannot) are keyed by the norm's input width, group and whether it adds a residual first
(``norm_signature``), M its activation rows; a launch takes the entry of the smallest tuned M >= its
rows (the largest beyond them), an untuned shape the kernel's default.

Entries of four other kinds, switches of the decode step that ``mgx-run tune`` chose by the time of
the whole step (shape key ``M=1``): ``decode_attention`` (``{"block_n": 32 or 64}``, the decode
attention's tile width), ``norm_prologue`` (``{"on": bool}``, the add + RMSNorm in the prologue of
the native GEMV that reads it), ``staged_x`` (``{"on": bool}``, that add + RMSNorm staging x once
for the imma GEMV's staged twin, whatever the weights' scheme) and ``fused_mlp`` (``{"on": bool}``, the
batch-1 int4 MLP in one launch where x is staged: ``gemv.fused_mlp``).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import asdict
from typing import Any

import torch

from .attention import DECODE_BLOCK_NS, DecodeConfig, MergeConfig, PrefillConfig
from .linear import (
    GEMM_CONFIGS,
    GEMV_CONFIGS,
    GEMV_MAX_M,
    SWAP_CONFIGS,
    DequantizeConfig,
    GpuWeight,
    LinearConfig,
    SiluMulConfig,
    swap_applies,
)
from .lm_head import ArgmaxMergeConfig
from .rmsnorm import RMSNormConfig
from .rope import RopeConfig

__all__ = ["ATTENTION_DECODE", "ATTENTION_PREFILL", "RMS_NORM", "ROPE_KV", "DEQUANTIZE", "SILU_MUL", "ARGMAX_MERGE", "EMBEDDING_ROWS", "DECODE_MERGE", "attention_signature", "silu_signature", "merge_signature", "norm_signature", "DECODE_ATTENTION", "DECODE_BLOCK_NS", "FUSED_MLP", "NORM_PROLOGUE", "STAGED_X", "Tunings", "weight_signature", "shape_key", "candidates"]

DECODE_ATTENTION = "decode_attention"  # the entry of the decode attention's tile width
NORM_PROLOGUE = "norm_prologue"  # the entry of the switch of norms in native GEMV prologues
STAGED_X = "staged_x"  # the entry of the switch of norms staging x for the imma GEMVs' staged twins
FUSED_MLP = "fused_mlp"  # the entry of the switch of the batch-1 int4 MLP in one launch
_ON_OFF = (NORM_PROLOGUE, STAGED_X, FUSED_MLP)  # switch entries of the form {"on": bool}
LINEAR_KERNELS = ("linear", "linear_silu_mul", "lm_head_argmax")  # entries of LinearConfig
ATTENTION_DECODE = "paged_attention_decode"  # entries of DecodeConfig per batch bucket
ATTENTION_PREFILL = "paged_attention_prefill"  # entries of PrefillConfig per chunk length
RMS_NORM = "rms_norm"  # entries of RMSNormConfig per norm shape and row count
ROPE_KV = "rope_and_write_kv"  # entries of RopeConfig per attention shape and row count
DEQUANTIZE = "dequantize"  # entries of DequantizeConfig per quantized weight (before its dense products)
SILU_MUL = "silu_mul"  # entries of SiluMulConfig per width and row count (after a gate/up dense product)
ARGMAX_MERGE = "argmax_merge"  # entries of ArgmaxMergeConfig per tile count and row count (the greedy head's merge)
EMBEDDING_ROWS = "embedding_rows"  # entries of DequantizeConfig per quantized embedding and row count (its lookup)
DECODE_MERGE = "decode_merge"  # entries of MergeConfig per attention shape and batch bucket (split decode's merge)
# Entries keyed by a signature and M, looked up by M
_SHAPED = {ATTENTION_DECODE: DecodeConfig, ATTENTION_PREFILL: PrefillConfig, RMS_NORM: RMSNormConfig,
           ROPE_KV: RopeConfig, DEQUANTIZE: DequantizeConfig, SILU_MUL: SiluMulConfig,
           ARGMAX_MERGE: ArgmaxMergeConfig, EMBEDDING_ROWS: DequantizeConfig, DECODE_MERGE: MergeConfig}  # fmt: skip
_COUNTS = ("num_stages", "per_sm")  # fields of those configurations that need not be powers of two


def attention_signature(num_heads: int, num_kv_heads: int, head_dim: int) -> str:
    """An attention shape as attention entries' shape keys name it (``...,M=<rows>`` after it)."""
    return f"Hq={num_heads},Hk={num_kv_heads},D={head_dim}"


def norm_signature(width: int, group: int, residual: bool) -> str:
    """An RMSNorm shape as its entries' shape keys name it: input width F, group, and whether a
    residual is added first (``...,M=<rows>`` after it)."""
    return f"F={width},group={group},residual={int(residual)}"


def silu_signature(width: int) -> str:
    """A SiLU product's shape as its entries' shape keys name it: the output width F."""
    return f"F={width}"


def merge_signature(num_tiles: int) -> str:
    """The greedy LM head's merge as its entries' shape keys name it: the tiles T a row's argmax is
    merged from (``lm_head.lm_head_tiles``, ``cuda.gemv.argmax_groups``)."""
    return f"T={num_tiles}"


def _norm_shape(signature: str) -> tuple[int, int, bool]:
    """``norm_signature``'s fields back; ValueError naming the key where it is not one."""
    fields = dict(part.partition("=")[::2] for part in signature.split(","))
    values = [fields.get(f, "") for f in ("F", "group", "residual")]
    if len(fields) != 3 or not all(v.isdigit() for v in values) or values[2] not in ("0", "1"):
        raise ValueError(f"autotune entry {RMS_NORM!r}: shape key {signature!r} is not F=<width>,group=<group>,residual=<0|1>")
    return int(values[0]), int(values[1]), values[2] == "1"


def _shaped_config(kernel: str, config: dict[str, Any]) -> Any:
    """A stored configuration of one of the signature-keyed kinds (``_SHAPED``), checked; ValueError
    naming what is wrong."""
    try:
        c = _SHAPED[kernel](**config)
    except TypeError as e:
        raise ValueError(f"autotune entry {kernel!r}: {e}") from None
    sizes = {f: getattr(c, f) for f in c.__slots__}
    if not all(type(v) is int and (v > 0 or (f == "per_sm" and v == 0)) for f, v in sizes.items()):
        raise ValueError(f"autotune entry {kernel!r}: sizes must be positive integers, got {config}")
    if kernel == ATTENTION_DECODE and c.block_n not in DECODE_BLOCK_NS:
        raise ValueError(f"autotune entry {kernel!r}: block_n {c.block_n} is not one of {DECODE_BLOCK_NS}")
    if any(v & (v - 1) for f, v in sizes.items() if f not in _COUNTS):
        raise ValueError(f"autotune entry {kernel!r}: tile sizes and warps must be powers of two, got {config}")
    return c


def weight_signature(w: GpuWeight) -> str:
    return f"scheme={w.scheme},layout={w.layout},group={w.group_size},N={w.n},K={w.k}"


def shape_key(w: GpuWeight, m: int) -> str:
    """The ``AutotuneEntry.shape_key`` of a weight at M rows."""
    return f"{weight_signature(w)},M={m}"


def candidates(m: int, w: GpuWeight | None = None, dtype: torch.dtype | None = None) -> list[LinearConfig]:
    """The configurations the autotune pass times at M rows; with the weight and activation dtype,
    the transposed tensor-core ones too where they apply (up to 16 rows, ``swap_applies``)."""
    found = list(GEMV_CONFIGS if m <= GEMV_MAX_M else GEMM_CONFIGS)
    if w is not None and dtype is not None and m <= 16 and swap_applies(w, dtype):
        found += SWAP_CONFIGS
    return found


def config_dict(config: LinearConfig) -> dict[str, Any]:
    return asdict(config)


class Tunings:
    """(kernel, weight signature) -> configurations by tuned M; built from stored entries."""

    def __init__(self, entries: Iterable[Any] = ()) -> None:  # AutotuneEntry-like: kernel, shape_key, config
        self._by: dict[tuple[str, str], tuple[list[int], list[LinearConfig]]] = {}
        self.decode_block_n: int | None = None  # the decode attention's tile width, where one is stored
        self.norm_prologue: bool | None = None  # norms in native GEMV prologues, where stored
        self.staged_x: bool | None = None  # norms staging x for the staged twins, where stored
        self.fused_mlp: bool | None = None  # the int4 MLP in one launch, where stored
        self.unknown: list[str] = []  # kernels of entries this runtime does not know (skipped)
        self._shaped: dict[tuple[str, str], tuple[list[int], list[Any]]] = {}  # the _SHAPED kinds by M
        self._norms: dict[tuple[int, int, bool], tuple[list[int], list[RMSNormConfig]]] = {}  # by norm_signature's fields
        rows: dict[tuple[str, str], dict[int, LinearConfig]] = {}
        shaped_rows: dict[tuple[str, str], dict[int, Any]] = {}
        for e in entries:
            if e.kernel == DECODE_ATTENTION:
                block_n = e.config.get("block_n")
                if block_n not in DECODE_BLOCK_NS:
                    raise ValueError(f"autotune entry {e.kernel!r}: block_n {block_n!r} is not one of {DECODE_BLOCK_NS}")
                self.decode_block_n = block_n
                continue
            if e.kernel in _ON_OFF:
                on = e.config.get("on")
                if not isinstance(on, bool):
                    raise ValueError(f"autotune entry {e.kernel!r}: 'on' must be true or false, got {on!r}")
                setattr(self, e.kernel, on)
                continue
            if e.kernel not in LINEAR_KERNELS and e.kernel not in _SHAPED:  # from a newer compiler:
                self.unknown.append(e.kernel)  # this runtime launches that kernel untuned
                continue
            signature, _, m = e.shape_key.rpartition(",M=")
            if not signature or not m.isdigit():
                raise ValueError(f"autotune entry {e.kernel!r}: shape key {e.shape_key!r} has no M")
            if e.kernel in _SHAPED:
                shaped_rows.setdefault((e.kernel, signature), {})[int(m)] = _shaped_config(e.kernel, e.config)
                continue
            try:
                rows.setdefault((e.kernel, signature), {})[int(m)] = LinearConfig(**e.config)
            except TypeError as err:
                raise ValueError(f"autotune entry {e.kernel!r} {e.shape_key!r}: {err}") from None
        for key, by_m in rows.items():
            ms = sorted(by_m)
            self._by[key] = (ms, [by_m[m] for m in ms])
        for key, by_m in shaped_rows.items():
            ms = sorted(by_m)
            self._shaped[key] = (ms, [by_m[m] for m in ms])
            if key[0] == RMS_NORM:
                self._norms[_norm_shape(key[1])] = self._shaped[key]

    def __len__(self) -> int:
        switches = sum(v is not None for v in (self.decode_block_n, self.norm_prologue, self.staged_x, self.fused_mlp))
        return sum(len(ms) for ms, _ in (*self._by.values(), *self._shaped.values())) + switches

    def lookup(self, kernel: str, signature: str, m: int) -> Any:
        """The stored configuration of ``kernel`` (one of the signature-keyed kinds, ``_SHAPED``) for
        ``signature`` at ``m`` rows: the smallest tuned M >= m, the largest beyond them; None where
        that shape was not tuned (the kernel's defaults)."""
        return _nearest(self._shaped.get((kernel, signature)), m)

    def stored(self, kernel: str, signature: str) -> list[Any]:
        """Every stored ``kernel`` configuration for ``signature``, whatever its row count (for checks
        against the model's shapes)."""
        found = self._shaped.get((kernel, signature))
        return [] if found is None else list(found[1])

    def rms_norm(self, width: int, group: int, residual: bool, m: int) -> RMSNormConfig | None:
        """The stored Triton RMSNorm configuration for ``m`` rows of ``width`` in groups of ``group``
        (after adding a residual, with ``residual``): the smallest tuned M >= m, the largest beyond
        them; None where that shape was not tuned (the kernel's default)."""
        return _nearest(self._norms.get((width, group, residual)), m) if self._norms else None

    def config(self, kernel: str, w: GpuWeight, m: int) -> LinearConfig | None:
        """The stored configuration for ``kernel`` on ``w`` at ``m`` rows, or None (use the default)."""
        found = self._by.get((kernel, weight_signature(w)))
        if found is None:
            return None
        ms, configs = found
        # Only entries of the same regime: a one-row GEMV configuration never serves several rows.
        lo = bisect.bisect_right(ms, GEMV_MAX_M) if m > GEMV_MAX_M else 0
        hi = len(ms) if m > GEMV_MAX_M else bisect.bisect_right(ms, GEMV_MAX_M)
        if lo == hi:
            return None
        i = bisect.bisect_left(ms, m, lo, hi)
        return configs[min(i, hi - 1)]


def _nearest(found: tuple[list[int], list[Any]] | None, m: int) -> Any:
    """Of configurations by ascending tuned M, the one of the smallest M >= m (the largest M's beyond
    them); None without any."""
    if found is None:
        return None
    ms, configs = found
    return configs[min(bisect.bisect_left(ms, m), len(ms) - 1)]
