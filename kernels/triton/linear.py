"""Weight-only quantized and 2:4-sparse linear layers: y = x @ W^T with W dequantized in registers.

Schemes (``formats/README.md``, "Weight schemes and layouts"), W [N, K]:

- ``none``: dense W in the activation dtype.
- ``w8a16``: int8 q [N, K], fp32 scales [N]: W = q * s; the scale is applied once per output.
- ``int4``: bytes [N, K/2], column 2b + j in nibble j (low first); fp32 scales [N, K/g] and u8 zeros
  [N, K/g] (or z = 8 when symmetric): W = (q - z) * s.
- ``sparse24``: kept values [N, K/2] and meta [N, K/4] u8 (bits 0-1 and 2-3 the in-group indices of
  the two kept columns of each group of 4), or with the ``sparse24_nibble_meta`` layout meta
  [N, K/8], two groups a byte (``layouts.py``).
- ``sparse24_int4``: the K/2 kept values as int4 (bytes [N, K/4], groups along the kept values),
  placed by meta as in ``sparse24``.

Two code paths: for one row (batch-1 decode) a GEMV on the CUDA cores that streams W once with
fp32 products; for more rows a tensor-core GEMM (``tl.dot``) on tiles dequantized to the activation
dtype (16-row tiles cover small decode batches). Accumulation is fp32 in both.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from mgx.formats import layouts as layout_registry

from ._common import (
    COMPILED,
    cast_as,
    cdiv,
    check_float,
    dot_precision,
    interpreting,
    next_pow2,
    overlap_options,
    overlap_start,
    round_as,
    rows_of,
)

__all__ = [
    "GpuWeight",
    "LinearConfig",
    "linear",
    "linear_silu_mul",
    "linear_add_squares",
    "runs_gemv",
    "NormIn",
    "RowSquares",
    "MAX_SQUARE_TILES",
    "silu_mul",
    "dequantize",
    "dequantize_ref",
    "code_rows",
    "take_rows",
    "linear_ref",
    "linear_silu_mul_ref",
    "silu_mul_ref",
    "default_config",
    "GEMV_CONFIGS",
    "GEMM_CONFIGS",
    "SPLIT_MAX_M",
    "DEQUANTIZE_MIN_M",
    "DequantizeConfig",
    "SiluMulConfig",
    "dequantize_candidates",
    "silu_mul_candidates",
    "dense_product",
    "SWAP_CONFIGS",
    "SplitWorkspace",
    "new_split_workspace",
    "split_workspace",
    "swap_applies",
]

SCHEME_IDS = {"none": 0, "w8a16": 1, "int4": 2, "sparse24": 3, "sparse24_int4": 4}
LAYOUT_IDS = {"row_major": 0, "sparse24_nibble_meta": 1, "cuda_tile16": 2}  # the kernels' LAYOUT
LAYOUTS = frozenset(LAYOUT_IDS)  # the layouts these kernels read (each for the schemes its registry entry holds)
# Only a single row takes the CUDA-core GEMV path: with 2..8 rows the GEMV re-read the weights per
# row (an LM head at R=8 ran at 30% of bandwidth, at R=32 through tl.dot at 98%).
GEMV_MAX_M = 1


@dataclass(frozen=True, slots=True)
class GpuWeight:
    """A linear op's weight on the device, with its scheme's companion tensors (see module docstring)."""

    scheme: str  # "none", "w8a16", "int4", "sparse24" or "sparse24_int4"
    n: int  # out_features
    k: int  # in_features
    weight: torch.Tensor  # the stored weight (see module docstring for its shape per scheme)
    scales: torch.Tensor | None = None  # w8a16 [N] f32; int4 [N, ceil(K/g)] f32 (sparse24_int4: ceil(K/2/g))
    zeros: torch.Tensor | None = None  # int4 asymmetric, shaped like scales, u8
    meta: torch.Tensor | None = None  # sparse24 [N, K/4] u8 (row_major) or [N, K/8] (nibble layout)
    group_size: int = 0  # int4 group along K (along the kept values for sparse24_int4)
    symmetric: bool = True  # int4: z = 8 when True
    layout: str = "row_major"  # "row_major", "sparse24_nibble_meta" or "cuda_tile16"
    # int4: the scales and zeros again as the fp16 pairs the native imma kinds of a MGX_IMMA_HALF_SCALES
    # build read (``mgx.kernels.cuda.gemv.scale_pairs``), ordered for the SiLU product's rows when
    # ``pairs_silu``; the Triton kernels read ``scales`` and ``zeros``
    pairs: torch.Tensor | None = None
    pairs_silu: bool = False

    def __post_init__(self) -> None:
        s, n, k = self.scheme, self.n, self.k
        if s not in SCHEME_IDS:
            raise ValueError(f"no GPU linear kernel for scheme {s!r}; known: {', '.join(SCHEME_IDS)}")
        if self.layout not in LAYOUTS or s not in layout_registry.LAYOUTS[self.layout].schemes:
            raise ValueError(f"no GPU linear kernel for scheme {s!r} in layout {self.layout!r}")
        if self.layout == "cuda_tile16" and not layout_registry.tile16_holds(n, k):
            raise ValueError(f"cuda_tile16 needs N % 16 == 0 and K % 128 == 0, got N={n}, K={k}")
        want = {"none": (n, k), "w8a16": (n, k), "int4": (n, k // 2), "sparse24": (n, k // 2),
                "sparse24_int4": (n, k // 4)}[s]  # fmt: skip
        _expect(self.weight, "weight", want)
        if self.weight.stride(1) != 1:
            raise ValueError("weight rows must be contiguous")
        if s == "w8a16":
            _expect(self.weight, "weight", want, torch.int8)
            _expect(self.scales, "scales", (n,), torch.float32)
        if s in ("int4", "sparse24_int4"):
            g, cols = self.group_size, (k if s == "int4" else k // 2)  # int4 groups run along the stored values
            if g < 2 or g & (g - 1) or cols % 2:
                raise ValueError(f"int4 group_size {g} must be a power of two >= 2, over an even count ({cols})")
            _expect(self.weight, "weight", want, torch.uint8)
            _expect(self.scales, "scales", (n, -(-cols // g)), torch.float32)
            if not self.symmetric:
                _expect(self.zeros, "zeros", (n, -(-cols // g)), torch.uint8)
        if self.pairs is not None:
            n_out, per = (n // 2, 8) if self.pairs_silu else (n, 16)
            if s != "int4" or self.group_size % 128 or k % 128:
                raise ValueError(f"scale pairs need int4 groups of a multiple of 128 columns, not {s} g{self.group_size}")
            _expect(self.pairs, "pairs", (-(-n_out // per), -(-k // self.group_size), 8, 4), torch.float16)
        if s.startswith("sparse24"):
            packed = self.layout == "sparse24_nibble_meta"
            if k % (8 if packed else 4):
                raise ValueError(f"{s} needs K={k} divisible by {8 if packed else 4}")
            _expect(self.meta, "meta", (n, k // 8 if packed else k // 4), torch.uint8)

    @property
    def nbytes(self) -> int:
        """Bytes a full pass over the weight reads (weight and companions)."""
        ts = (self.weight, self.scales, self.zeros, self.meta)
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    @property
    def gemv_nbytes(self) -> int:
        """Bytes a one-row GEMV reads of the weight: ``nbytes``, but with ``pairs`` (read by the native
        imma kinds of a MGX_IMMA_HALF_SCALES build) in place of the scales and zeros."""
        if self.pairs is None:
            return self.nbytes
        ts = (self.weight, self.pairs, self.meta)
        return sum(t.numel() * t.element_size() for t in ts if t is not None)


def _expect(t: torch.Tensor | None, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> None:
    if t is None:
        raise ValueError(f"missing {name}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} shape {tuple(t.shape)} != {shape}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{name} dtype {t.dtype} != {dtype}")


@triton.jit
def _code_at(row, b, stride_w, LAYOUT: tl.constexpr, UNITS: tl.constexpr):
    """Offsets of bytes b [1, C] of rows row [R, 1] (int64) of a weight's codes: row-major (stride_w
    bytes a row), or in the cuda_tile16 layout (LAYOUT 2; ``mgx.formats.layouts``: 16-row tiles of
    UNITS 64-byte units a 128-column step, 1 for int4 and 2 for W8A16, where 16 stride_w is a row
    of tiles). The tiled offsets run in 64 contiguous bytes, so the loads stay 16-byte vectors."""
    if LAYOUT == 2:
        return ((row >> 4) * (16 * stride_w) + (row & 15) * 64 + (b // (64 * UNITS)) * (1024 * UNITS)
                + ((b // 64) % UNITS) * 1024 + b % 64)  # fmt: skip
    else:
        return row * stride_w + b


@triton.jit
def _int4_tile(w_ptr, s_ptr, z_ptr, row, n_mask, c0, C, stride_w, stride_s,
               GROUP: tl.constexpr, SYMMETRIC: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
               LAYOUT: tl.constexpr = 0):  # fmt: skip
    """fp32 [BLOCK_N, BLOCK_C]: int4 codes of columns c0.. of C, dequantized per group of GROUP columns."""
    kb = c0 // 2 + tl.arange(0, BLOCK_C // 2)
    p = tl.load(w_ptr + _code_at(row, kb[None, :], stride_w, LAYOUT, 1), mask=n_mask[:, None] & (kb < C // 2)[None, :],
                other=0)  # fmt: skip
    p = p.to(tl.int32)
    # OR-ing a nibble into the mantissa of 2^23 and subtracting 2^23 converts it exactly, without I2F.
    lo = ((p & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
    hi = ((p >> 4) | 0x4B000000).to(tl.float32, bitcast=True)
    q = tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_C // GROUP, GROUP))  # column 2b + j = nibble j of byte b
    g = c0 // GROUP + tl.arange(0, BLOCK_C // GROUP)
    gmask = n_mask[:, None] & (g < tl.cdiv(C, GROUP))[None, :]  # the last group may be shorter
    s = tl.load(s_ptr + row * stride_s + g[None, :], mask=gmask, other=0.0)  # [BLOCK_N, BLOCK_C/GROUP]
    if SYMMETRIC:
        zb = tl.full(s.shape, 8.0 + 8388608.0, tl.float32)
    else:
        zb = tl.load(z_ptr + row * stride_s + g[None, :], mask=gmask, other=0).to(tl.float32) + 8388608.0
    return tl.reshape((q - zb[:, :, None]) * s[:, :, None], (BLOCK_N, BLOCK_C))


@triton.jit
def _expand_24(vals, meta_ptr, row, n_mask, k0, K, stride_m,
               LAYOUT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """Dense [BLOCK_N, BLOCK_K] from the kept values [BLOCK_N, BLOCK_K/2] of columns k0.. and their meta."""
    if LAYOUT == 1:  # sparse24_nibble_meta
        kmb = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        mb = tl.load(meta_ptr + row * stride_m + kmb[None, :], mask=n_mask[:, None] & (kmb < K // 8)[None, :], other=0)
        mb = mb.to(tl.int32)
        meta = tl.reshape(tl.join(mb & 0xF, mb >> 4), (BLOCK_N, BLOCK_K // 4))
    else:
        km = k0 // 4 + tl.arange(0, BLOCK_K // 4)
        meta = tl.load(meta_ptr + row * stride_m + km[None, :], mask=n_mask[:, None] & (km < K // 4)[None, :], other=0)
        meta = meta.to(tl.int32)
    v0, v1 = tl.split(tl.reshape(vals, (BLOCK_N, BLOCK_K // 4, 2)))  # [BLOCK_N, BLOCK_K/4] each
    j = tl.arange(0, 4)[None, None, :]
    w = tl.where((meta & 3)[:, :, None] == j, v0[:, :, None], 0.0)
    w = tl.where(((meta >> 2) & 3)[:, :, None] == j, v1[:, :, None], w)
    return tl.reshape(w, (BLOCK_N, BLOCK_K))


@triton.jit
def _w_tile(
    w_ptr, s_ptr, z_ptr, meta_ptr, stride_w, stride_s, stride_m, rn, n_mask, k0, K,
    SCHEME: tl.constexpr, GROUP: tl.constexpr, SYMMETRIC: tl.constexpr, LAYOUT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, OUT: tl.constexpr,
):  # fmt: skip
    """Rows rn [BLOCK_N], columns k0.. of W as a [BLOCK_N, BLOCK_K] tile of OUT (w8a16 still unscaled)."""
    row = rn.to(tl.int64)[:, None]
    if SCHEME == 0 or SCHEME == 1:
        k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + _code_at(row, k[None, :], stride_w, LAYOUT, 2), mask=n_mask[:, None] & (k < K)[None, :],
                    other=0)  # fmt: skip
        if SCHEME == 1:
            w = w.to(tl.float32)  # int8 -> fp32 is exact; straight to bf16 is wrong in the interpreter
        w = w.to(OUT)
    elif SCHEME == 2:
        w = _int4_tile(w_ptr, s_ptr, z_ptr, row, n_mask, k0, K, stride_w, stride_s, GROUP, SYMMETRIC,
                       BLOCK_N, BLOCK_K, LAYOUT).to(OUT)  # fmt: skip
    elif SCHEME == 3:
        kv = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        v = tl.load(w_ptr + row * stride_w + kv[None, :], mask=n_mask[:, None] & (kv < K // 2)[None, :], other=0)
        w = _expand_24(v.to(OUT), meta_ptr, row, n_mask, k0, K, stride_m, LAYOUT, BLOCK_N, BLOCK_K).to(OUT)
    else:
        # sparse24_int4: int4 codes of the K/2 kept values, grouped along them, then placed by meta.
        v = _int4_tile(w_ptr, s_ptr, z_ptr, row, n_mask, k0 // 2, K // 2, stride_w, stride_s, GROUP, SYMMETRIC,
                       BLOCK_N, BLOCK_K // 2)  # fmt: skip
        w = _expand_24(v.to(OUT), meta_ptr, row, n_mask, k0, K, stride_m, LAYOUT, BLOCK_N, BLOCK_K).to(OUT)
    return w


@triton.jit
def _x_pairs(xrow, c0, K, HALF: tl.constexpr, EVEN: tl.constexpr):
    """x at columns c0 + 2j and c0 + 2j + 1 (j < HALF), as two fp32 [HALF] vectors."""
    j = tl.arange(0, HALF)
    col = c0 + 2 * j
    if xrow.dtype.element_ty == tl.bfloat16:
        # One 32-bit load holds both bf16 values; each becomes fp32 by a shift or a mask.
        if EVEN:
            u = tl.load(xrow.to(tl.pointer_type(tl.int32)) + c0 // 2 + j)
        else:
            u = tl.load(xrow.to(tl.pointer_type(tl.int32)) + c0 // 2 + j, mask=col < K, other=0)
        xe = (u << 16).to(tl.float32, bitcast=True)
        xo = (u & -65536).to(tl.float32, bitcast=True)
    else:
        xe = tl.load(xrow + col, mask=col < K, other=0.0).to(tl.float32)
        xo = tl.load(xrow + col + 1, mask=col + 1 < K, other=0.0).to(tl.float32)
    return xe, xo


@triton.jit
def _norm_x(x, cols, nw_ptr, rstd, K, NORM_W: tl.constexpr, EVEN: tl.constexpr, IO: tl.constexpr):
    """RMSNorm of x (fp32, the values at ``cols`` of a row whose 1/rms is ``rstd``) with the roundings of
    ``rms_norm`` and transformers: x * rstd rounded to IO, then times the norm weight and rounded again."""
    y = round_as(x * rstd, IO)
    if NORM_W:
        if EVEN:
            g = tl.load(nw_ptr + cols)
        else:
            g = tl.load(nw_ptr + cols, mask=cols < K, other=0.0)
        y = round_as(y * g.to(tl.float32), IO)
    return y


# Four int8 codes in $4 to four fp32 2^23 + (q + 128) in $0..$3: one XOR flips the four sign bits
# (q + 128 as unsigned bytes), then each byte permute puts one byte under 2^23's exponent (0x4B).
_W8_ASM = tl.constexpr("""{
    .reg .b32 t;
    xor.b32 t, $4, 0x80808080;
    prmt.b32 $0, t, 0x4B000000, 0x7650;
    prmt.b32 $1, t, 0x4B000000, 0x7651;
    prmt.b32 $2, t, 0x4B000000, 0x7652;
    prmt.b32 $3, t, 0x4B000000, 0x7653;
    }""")


@triton.jit
def _w8_f32(q):
    """int8 codes ``q`` as exact fp32 values without integer-to-float conversions: q + 128 in the
    mantissa of 2^23, minus 2^23 + 128. Compiled, an XOR per four codes and a byte permute per code
    build 2^23 + q + 128 (``_W8_ASM``; the one-row W8A16 GEMV's loop took 3.97 instructions per weight
    element in sm_90 SASS against 4.72 with the integer add); the interpreter adds it in integers."""
    if COMPILED:
        v = tl.inline_asm_elementwise(asm=_W8_ASM, constraints="=r,=r,=r,=r,r", args=[q], dtype=tl.float32,
                                      is_pure=True, pack=4)  # fmt: skip
    else:
        v = (q.to(tl.int32) + 0x4B000080).to(tl.float32, bitcast=True)
    return v - 8388736.0


# Four bytes of int4 codes in $8 to 2^23 + their low nibbles in $0..$3 and high nibbles in $4..$7: a
# byte permute puts each byte (of the word, then of the word shifted by 4) under 2^23's exponent, and
# an AND keeps 0x4B and the nibble -- two instructions a code and a shift per four bytes.
_NIBBLES_F32_ASM = tl.constexpr("""{
    .reg .b32 s;
    prmt.b32 $0, $8, 0x4B000000, 0x7650;
    prmt.b32 $1, $8, 0x4B000000, 0x7651;
    prmt.b32 $2, $8, 0x4B000000, 0x7652;
    prmt.b32 $3, $8, 0x4B000000, 0x7653;
    shr.u32 s, $8, 4;
    prmt.b32 $4, s, 0x4B000000, 0x7650;
    prmt.b32 $5, s, 0x4B000000, 0x7651;
    prmt.b32 $6, s, 0x4B000000, 0x7652;
    prmt.b32 $7, s, 0x4B000000, 0x7653;
    and.b32 $0, $0, 0x4B00000F;
    and.b32 $1, $1, 0x4B00000F;
    and.b32 $2, $2, 0x4B00000F;
    and.b32 $3, $3, 0x4B00000F;
    and.b32 $4, $4, 0x4B00000F;
    and.b32 $5, $5, 0x4B00000F;
    and.b32 $6, $6, 0x4B00000F;
    and.b32 $7, $7, 0x4B00000F;
    }""")


@triton.jit
def _nibbles_f32(p):
    """2^23 + the low and the high nibble of each byte of ``p`` (int4 codes, two a byte) as fp32:
    OR-ing a nibble into the mantissa of 2^23 converts it exactly, without I2F. Compiled, in
    ``_NIBBLES_F32_ASM`` (sm_90 SASS of the one-row INT4 GEMV, 32 x 256, 4 warps: 6.39 instructions a
    code against 7.25 with Triton's own integer code); the interpreter computes it in integers."""
    if COMPILED:
        lo, hi = tl.inline_asm_elementwise(asm=_NIBBLES_F32_ASM, constraints="=r,=r,=r,=r,=r,=r,=r,=r,r", args=[p],
                                           dtype=(tl.float32, tl.float32), is_pure=True, pack=4)  # fmt: skip
    else:
        q = p.to(tl.int32) & 0xFF
        lo = ((q & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
        hi = ((q >> 4) | 0x4B000000).to(tl.float32, bitcast=True)
    return lo, hi


@triton.jit
def _gemv_row(
    xrow, w_ptr, s_ptr, z_ptr, meta_ptr, stride_w, stride_s, stride_m, rn, n_mask, K, k_lo, k_hi, rstd, nw_ptr,
    SCHEME: tl.constexpr, GROUP: tl.constexpr, SYMMETRIC: tl.constexpr, LAYOUT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr, NORM_IN: tl.constexpr, NORM_W: tl.constexpr,
):  # fmt: skip
    """fp32 [1, BLOCK_N]: one activation row (xrow) times W[rn]^T over columns k_lo..k_hi, on the CUDA cores.

    EVEN (N and K are multiples of the tile) drops the bounds checks, which cost as many integer
    instructions as the dequantization itself.

    Products accumulate elementwise in a [BLOCK_N, columns] tile that is reduced once, after the
    K loop. x is loaded as a vector so that it broadcasts over the rows in registers.

    NORM_IN: xrow is an RMSNorm's input and ``rstd`` its row's 1/rms; each x is normalized as loaded
    (``_norm_x``).
    """
    row = rn.to(tl.int64)[:, None]
    nm = n_mask[:, None]
    if SCHEME == 2:
        # int4: one group of GROUP columns at a time (its scale and zero are per row), the low and
        # high nibbles against the even and odd columns of x, so the codes are never reshaped.
        acc2 = tl.zeros([BLOCK_N, GROUP // 2], tl.float32)
        ngroups = tl.cdiv(K, GROUP)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            for gi in tl.static_range(BLOCK_K // GROUP):
                c0 = k0 + gi * GROUP
                b = c0 // 2 + tl.arange(0, GROUP // 2)
                g = c0 // GROUP
                at = _code_at(row, b[None, :], stride_w, LAYOUT, 1)
                if EVEN:
                    p = tl.load(w_ptr + at)
                    s = tl.load(s_ptr + rn.to(tl.int64) * stride_s + g)
                else:
                    p = tl.load(w_ptr + at, mask=nm & (b < K // 2)[None, :], other=0)
                    s = tl.load(s_ptr + rn.to(tl.int64) * stride_s + g, mask=n_mask & (g < ngroups), other=0.0)
                if SYMMETRIC:
                    zb = tl.full([BLOCK_N], 8.0 + 8388608.0, tl.float32)
                elif EVEN:
                    zb = tl.load(z_ptr + rn.to(tl.int64) * stride_s + g).to(tl.float32) + 8388608.0
                else:
                    zb = tl.load(z_ptr + rn.to(tl.int64) * stride_s + g, mask=n_mask & (g < ngroups), other=0)
                    zb = zb.to(tl.float32) + 8388608.0
                xe, xo = _x_pairs(xrow, c0, K, GROUP // 2, EVEN)
                if NORM_IN:
                    col = c0 + 2 * tl.arange(0, GROUP // 2)
                    xe = _norm_x(xe, col, nw_ptr, rstd, K, NORM_W, EVEN, xrow.dtype.element_ty)
                    xo = _norm_x(xo, col + 1, nw_ptr, rstd, K, NORM_W, EVEN, xrow.dtype.element_ty)
                lo, hi = _nibbles_f32(p)
                lo = lo - zb[:, None]
                hi = hi - zb[:, None]
                acc2 += (lo * xe[None, :] + hi * xo[None, :]) * s[:, None]
        acc = tl.sum(acc2, axis=1)
    else:
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            # x is loaded in the weight tile's shape (row stride 0, so L1 serves the repeats): it then
            # shares the tile's register layout, and needs no shuffle through shared memory. W8A16
            # with NORM_IN normalizes x as a vector and broadcasts it (through shared memory): in the
            # tile's shape the norm ran once per row a thread holds (sm_90 SASS, 16 x 512, 4 warps:
            # 5.67 instructions per weight element against 4.38 so, 3.97 without the norm).
            if NORM_IN and SCHEME == 1:
                if EVEN:
                    xv = tl.load(xrow + k).to(tl.float32)
                else:
                    xv = tl.load(xrow + k, mask=k < K, other=0.0).to(tl.float32)
                xk = _norm_x(xv, k, nw_ptr, rstd, K, NORM_W, EVEN, xrow.dtype.element_ty)[None, :]
            else:
                if EVEN:
                    xk = tl.load(xrow + (k[None, :] + 0 * rn[:, None])).to(tl.float32)
                else:
                    xk = tl.load(xrow + (k[None, :] + 0 * rn[:, None]), mask=(k < K)[None, :], other=0.0)
                    xk = xk.to(tl.float32)
                if NORM_IN:
                    xk = _norm_x(xk, k[None, :] + 0 * rn[:, None], nw_ptr, rstd, K, NORM_W, EVEN,
                                 xrow.dtype.element_ty)  # fmt: skip
            if SCHEME == 1:
                if EVEN:
                    q = tl.load(w_ptr + _code_at(row, k[None, :], stride_w, LAYOUT, 2))
                else:
                    q = tl.load(w_ptr + _code_at(row, k[None, :], stride_w, LAYOUT, 2), mask=nm & (k < K)[None, :],
                                other=0)  # fmt: skip
                w = _w8_f32(q)
            elif SCHEME == 0 and EVEN:
                w = tl.load(w_ptr + row * stride_w + k[None, :]).to(tl.float32)
            else:
                w = _w_tile(w_ptr, s_ptr, z_ptr, meta_ptr, stride_w, stride_s, stride_m, rn, n_mask, k0, K,
                            SCHEME, GROUP, SYMMETRIC, LAYOUT, BLOCK_N, BLOCK_K, tl.float32)  # fmt: skip
            acc2 += w * xk
        acc = tl.sum(acc2, axis=1)
        if SCHEME == 1:
            acc = acc * tl.load(s_ptr + rn, mask=n_mask, other=0.0)
    return tl.reshape(acc, (1, BLOCK_N))


def _nibble_asm(high: str) -> tl.constexpr:
    """The PTX of ``_nibbles_bf16`` for four bytes in $4: low nibbles to $0, $1 and high ones to $2,
    $3 as bf16 pairs, the high pair's LOP3 taking ``high`` (its constant and truth table)."""
    return tl.constexpr(f"""{{
            .reg .b32 t0, t1;
            prmt.b32 t0, $4, 0, 0x4140;
            prmt.b32 t1, $4, 0, 0x4342;
            lop3.b32 $0, t0, 0x000F000F, 0x43004300, 0xEA;
            lop3.b32 $1, t1, 0x000F000F, 0x43004300, 0xEA;
            shr.u32 t0, t0, 4;
            shr.u32 t1, t1, 4;
            lop3.b32 $2, t0, 0x000F000F, {high};
            lop3.b32 $3, t1, 0x000F000F, {high};
            }}""")


_NIBBLES_OR = _nibble_asm("0x43004300, 0xEA")  # (a & b) | c
_NIBBLES_FLIP = _nibble_asm("0x43084308, 0x6A")  # (a & b) ^ c: also flips bit 3 of the nibble


@triton.jit
def _nibbles_bf16(p, FLIP_HIGH: tl.constexpr, FAST_CVT: tl.constexpr):
    """(128 + low nibble, 128 + high nibble) of the bytes p as two bf16 tensors shaped like p.

    FLIP_HIGH flips the top bit of the high nibble (int8 q -> q + 128 = 16 h + l). Every value is an
    integer in [128, 143], exact in bf16. FAST_CVT converts four bytes per asm block: two byte
    permutes put bytes 0 and 1 (2 and 3) in the two halves of a register, and one LOP3 per pair of
    nibbles masks them into the mantissa of 128.0 (0x4300) -- no integer-to-float conversions. With
    FLIP_HIGH the high pair is masked and XOR-ed with 0x4308 (LOP3 0x6A: (a & b) ^ c), which sets
    128.0's bits and flips bit 3 of the nibble at once.
    """
    if FAST_CVT:
        lo, hi = tl.inline_asm_elementwise(
            asm=_NIBBLES_FLIP if FLIP_HIGH else _NIBBLES_OR,
            constraints="=r,=r,=r,=r,r",
            args=[p],
            dtype=(tl.bfloat16, tl.bfloat16),
            is_pure=True,
            pack=4,
        )
    else:
        b = p.to(tl.int32) & 0xFF
        lo = ((b & 0xF) + 128).to(tl.float32).to(tl.bfloat16)
        hi = (((b >> 4) ^ (8 if FLIP_HIGH else 0)) + 128).to(tl.float32).to(tl.bfloat16)
    return lo, hi


@triton.jit
def _swap_tile(
    x_ptr, stride_xm, rm, m_mask, w_ptr, s_ptr, z_ptr, stride_w, stride_s, rn, n_mask, K, k_lo, k_hi,
    SCHEME: tl.constexpr, GROUP: tl.constexpr, SYMMETRIC: tl.constexpr, FAST_CVT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr, LAYOUT: tl.constexpr,
):  # fmt: skip
    """fp32 [BLOCK_M, BLOCK_N] like ``_mm_tile``, computed transposed on the tensor cores: W^T x^T.

    For a few activation rows (bf16) the weight tile is the wide operand of the dot and x^T the
    16-column one, so a 1-row GEMV still runs as MMAs and the CUDA cores only unpack weights.
    Quantized codes enter the dot as exact small integers (``_nibbles_bf16``); zero points and the
    int8 offset come off afterwards through sums of x, scales multiply the fp32 results:
    - int4, per group: sum((q - z) x) = dot(128 + q, x) - (128 + z) sum(x);
    - int8: q + 128 = 16 h + l, so sum(q x) = 16 dot(128 + h, x) + dot(128 + l, x) - 2304 sum(x).
    """
    row = rn.to(tl.int64)[:, None]
    nm = n_mask[:, None]
    xcol = x_ptr + rm.to(tl.int64)[None, :] * stride_xm  # x^T: rows along K, one column per activation row
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    if SCHEME == 2:
        ngroups = tl.cdiv(K, GROUP)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            for gi in tl.static_range(BLOCK_K // GROUP):
                c0 = k0 + gi * GROUP
                b = c0 // 2 + tl.arange(0, GROUP // 2)
                j = c0 + 2 * tl.arange(0, GROUP // 2)
                g = c0 // GROUP
                at = _code_at(row, b[None, :], stride_w, LAYOUT, 1)
                if EVEN:
                    p = tl.load(w_ptr + at)
                    s = tl.load(s_ptr + rn.to(tl.int64) * stride_s + g)
                else:
                    p = tl.load(w_ptr + at, mask=nm & (b < K // 2)[None, :], other=0)
                    s = tl.load(s_ptr + rn.to(tl.int64) * stride_s + g, mask=n_mask & (g < ngroups), other=0.0)
                if SYMMETRIC:
                    zb = tl.full([BLOCK_N], 136.0, tl.float32)
                else:
                    zb = tl.load(z_ptr + rn.to(tl.int64) * stride_s + g, mask=n_mask & (g < ngroups), other=0)
                    zb = zb.to(tl.float32) + 128.0
                xe = tl.load(xcol + j[:, None], mask=m_mask[None, :] & (j < K)[:, None], other=0.0)
                xo = tl.load(xcol + j[:, None] + 1, mask=m_mask[None, :] & (j + 1 < K)[:, None], other=0.0)
                lo, hi = _nibbles_bf16(p, False, FAST_CVT)
                d = tl.dot(lo, xe)
                d = tl.dot(hi, xo, d)
                xs = tl.sum(xe.to(tl.float32), axis=0) + tl.sum(xo.to(tl.float32), axis=0)
                acc += (d - zb[:, None] * xs[None, :]) * s[:, None]
    elif SCHEME == 1:
        acc_l = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
        xs = tl.zeros([BLOCK_M], tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            if EVEN:
                q = tl.load(w_ptr + _code_at(row, k[None, :], stride_w, LAYOUT, 2))
            else:
                q = tl.load(w_ptr + _code_at(row, k[None, :], stride_w, LAYOUT, 2), mask=nm & (k < K)[None, :], other=0)
            xt = tl.load(xcol + k[:, None], mask=m_mask[None, :] & (k < K)[:, None], other=0.0)
            lo, hi = _nibbles_bf16(q, True, FAST_CVT)
            acc = tl.dot(hi, xt, acc)
            acc_l = tl.dot(lo, xt, acc_l)
            xs += tl.sum(xt.to(tl.float32), axis=0)
        acc = (16.0 * acc + acc_l - 2304.0 * xs[None, :]) * tl.load(s_ptr + rn, mask=n_mask, other=0.0)[:, None]
    else:
        for k0 in range(k_lo, k_hi, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            if EVEN:
                w = tl.load(w_ptr + row * stride_w + k[None, :])
            else:
                w = tl.load(w_ptr + row * stride_w + k[None, :], mask=nm & (k < K)[None, :], other=0.0)
            xt = tl.load(xcol + k[:, None], mask=m_mask[None, :] & (k < K)[:, None], other=0.0)
            acc = tl.dot(w, xt, acc)
    return tl.trans(acc)


@triton.jit
def _mm_tile(
    x_ptr, stride_xm, rm, m_mask, w_ptr, s_ptr, z_ptr, meta_ptr, stride_w, stride_s, stride_m, rn, n_mask, K, k_lo, k_hi,
    rstd, nw_ptr,
    SCHEME: tl.constexpr, GROUP: tl.constexpr, SYMMETRIC: tl.constexpr, LAYOUT: tl.constexpr,
    USE_DOT: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr,
    NORM_IN: tl.constexpr, NORM_W: tl.constexpr,
):  # fmt: skip
    """fp32 [BLOCK_M, BLOCK_N] tile of x[rm] @ W[rn]^T over columns k_lo..k_hi, w8a16 scales applied.

    Without USE_DOT, BLOCK_M is 1 (one activation row per program: the GEMV); only then NORM_IN.
    """
    if not USE_DOT:
        xrow = x_ptr + tl.max(rm, axis=0).to(tl.int64) * stride_xm
        return _gemv_row(xrow, w_ptr, s_ptr, z_ptr, meta_ptr, stride_w, stride_s, stride_m, rn, n_mask, K, k_lo, k_hi,
                         rstd, nw_ptr, SCHEME, GROUP, SYMMETRIC, LAYOUT, BLOCK_N, BLOCK_K, EVEN,
                         NORM_IN, NORM_W)  # fmt: skip
    xrow = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(xrow + k[None, :], mask=m_mask[:, None] & (k < K)[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        w = _w_tile(w_ptr, s_ptr, z_ptr, meta_ptr, stride_w, stride_s, stride_m, rn, n_mask, k0, K,
                    SCHEME, GROUP, SYMMETRIC, LAYOUT, BLOCK_N, BLOCK_K, x_ptr.dtype.element_ty)  # fmt: skip
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PREC)
    if SCHEME == 1:
        acc = acc * tl.load(s_ptr + rn, mask=n_mask, other=0.0)[None, :]
    return acc


@triton.jit
def _silu_times(gate, up, OUT: tl.constexpr):
    """silu(gate) * up with transformers' roundings in OUT: gate and up rounded (the outputs of its two
    linears), then silu(gate), then the product (the store rounds that). Nothing rounds in fp32."""
    g = round_as(gate, OUT)
    return round_as(g * tl.sigmoid(g), OUT) * round_as(up, OUT)


@triton.jit
def _epilogue(acc, up, b_ptr, out_ptr, res_ptr, sq_ptr, rm, rn, m_mask, n_mask, N, stride_om, stride_rm,
              HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, RES_SQ: tl.constexpr):  # fmt: skip
    """Bias, the SiLU product and the store of a finished [BLOCK_M, BLOCK_N] tile.

    RES_SQ: the tile plus the residual's, rounded as transformers rounds (the projection's output,
    then the sum) is what is stored, and each row's sum of the squares of the stored values over
    the tile goes to ``sq_ptr`` [M, tiles along N] for the RMSNorm that reads the sum (NORM_IN)."""
    OUT = out_ptr.dtype.element_ty
    mask = m_mask[:, None] & n_mask[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if SILU_MUL:
        if HAS_BIAS:
            up += tl.load(b_ptr + N + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        acc = _silu_times(acc, up, OUT)
    if RES_SQ:
        res = tl.load(res_ptr + rm.to(tl.int64)[:, None] * stride_rm + rn[None, :], mask=mask, other=0.0)
        acc = round_as(round_as(acc, OUT) + res.to(tl.float32), OUT)
        tiles = tl.num_programs(1)
        tl.store(sq_ptr + rm.to(tl.int64) * tiles + tl.program_id(1), tl.sum(tl.where(mask, acc * acc, 0.0), axis=1),
                 mask=m_mask)  # fmt: skip
    dst = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    # Rounded on the bits (round_as), so that Triton's interpreter rounds as the GPU does.
    tl.store(dst, cast_as(acc, OUT), mask=mask)


@triton.jit
def _linear_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, meta_ptr, b_ptr, out_ptr, ws_ptr, cnt_ptr, res_ptr, sq_ptr, nw_ptr,
    M, N, K, stride_xm, stride_w, stride_s, stride_m, stride_om, stride_rm, n_sq, eps,
    SCHEME: tl.constexpr, GROUP: tl.constexpr, SYMMETRIC: tl.constexpr, LAYOUT: tl.constexpr,
    HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, USE_DOT: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr,
    SPLIT_K: tl.constexpr, SWAP: tl.constexpr, FAST_CVT: tl.constexpr, OVERLAP: tl.constexpr,
    RES_SQ: tl.constexpr, NORM_IN: tl.constexpr, NORM_W: tl.constexpr, BLOCK_SQ: tl.constexpr,
):  # fmt: skip
    # With SILU_MUL, W has 2N rows (gate rows, then up rows) and out = silu(x @ Wg^T) * (x @ Wu^T).
    # m varies fastest across programs, so the programs that share a weight tile run together.
    # RES_SQ (``linear_add_squares``): the residual is added in the epilogue and the rows' partial
    # sums of squares stored; NORM_IN (``linear(norm=)``, the GEMV only): x is the RMSNorm's input,
    # normalized as loaded with 1/rms from the n_sq partial sums its producer stored.
    overlap_start(OVERLAP)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = rm < M
    n_mask = rn < N
    if SPLIT_K == 1:
        k_lo = 0
        k_hi = K
    else:  # this program's share of K: whole BLOCK_K tiles, so EVEN still holds per share
        span = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
        k_lo = tl.program_id(2) * span
        k_hi = tl.minimum(K, k_lo + span)
    rstd = 1.0
    if NORM_IN:
        j = tl.arange(0, BLOCK_SQ)
        sq = tl.load(sq_ptr + tl.max(rm, axis=0).to(tl.int64) * n_sq + j, mask=j < n_sq, other=0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(sq, axis=0) / K + eps)  # as rms_norm's kernel takes it
    if SWAP:
        acc = _swap_tile(x_ptr, stride_xm, rm, m_mask, w_ptr, s_ptr, z_ptr, stride_w, stride_s, rn, n_mask, K,
                         k_lo, k_hi, SCHEME, GROUP, SYMMETRIC, FAST_CVT, BLOCK_M, BLOCK_N, BLOCK_K, EVEN, LAYOUT)  # fmt: skip
    else:
        acc = _mm_tile(x_ptr, stride_xm, rm, m_mask, w_ptr, s_ptr, z_ptr, meta_ptr, stride_w, stride_s, stride_m,
                       rn, n_mask, K, k_lo, k_hi, rstd, nw_ptr, SCHEME, GROUP, SYMMETRIC, LAYOUT, USE_DOT,
                       DOT_PREC, BLOCK_M, BLOCK_N, BLOCK_K, EVEN, NORM_IN, NORM_W)  # fmt: skip
    up = acc
    if SILU_MUL:
        if SWAP:
            up = _swap_tile(x_ptr, stride_xm, rm, m_mask, w_ptr, s_ptr, z_ptr, stride_w, stride_s, rn + N, n_mask, K,
                            k_lo, k_hi, SCHEME, GROUP, SYMMETRIC, FAST_CVT, BLOCK_M, BLOCK_N, BLOCK_K, EVEN, LAYOUT)  # fmt: skip
        else:
            up = _mm_tile(x_ptr, stride_xm, rm, m_mask, w_ptr, s_ptr, z_ptr, meta_ptr, stride_w, stride_s, stride_m,
                          rn + N, n_mask, K, k_lo, k_hi, rstd, nw_ptr, SCHEME, GROUP, SYMMETRIC, LAYOUT,
                          USE_DOT, DOT_PREC, BLOCK_M, BLOCK_N, BLOCK_K, EVEN, NORM_IN, NORM_W)  # fmt: skip
    if SPLIT_K == 1:
        _epilogue(acc, up, b_ptr, out_ptr, res_ptr, sq_ptr, rm, rn, m_mask, n_mask, N, stride_om, stride_rm,
                  HAS_BIAS, SILU_MUL, RES_SQ)
    else:
        # Split K: every share adds its partial sums into an fp32 workspace [M, N] (gate, then up:
        # [M, 2N]); the share that arrives last at the tile's counter reads the sums back, resets
        # workspace and counter to zero for the next launch, and finishes the tile.
        width = 2 * N if SILU_MUL else N
        mask = m_mask[:, None] & n_mask[None, :]
        ws = ws_ptr + rm.to(tl.int64)[:, None] * width + rn[None, :]
        tl.atomic_add(ws, acc, mask=mask, sem="relaxed")
        if SILU_MUL:
            tl.atomic_add(ws + N, up, mask=mask, sem="relaxed")
        tl.debug_barrier()  # every thread's adds are issued before the release below
        tile = cnt_ptr + pid_m * tl.num_programs(1) + pid_n
        if tl.atomic_add(tile, 1, sem="acq_rel") == SPLIT_K - 1:
            # Atomic reads (adding zero) come from L2, where the other shares' adds landed.
            acc = tl.atomic_add(ws, tl.zeros_like(acc), mask=mask, sem="relaxed")
            tl.store(ws, tl.zeros_like(acc), mask=mask)
            if SILU_MUL:
                up = tl.atomic_add(ws + N, tl.zeros_like(up), mask=mask, sem="relaxed")
                tl.store(ws + N, tl.zeros_like(up), mask=mask)
            tl.store(tile, 0)
            _epilogue(acc, up, b_ptr, out_ptr, res_ptr, sq_ptr, rm, rn, m_mask, n_mask, N, stride_om, stride_rm,
                      HAS_BIAS, SILU_MUL, RES_SQ)


@triton.jit
def _dequantize_kernel(
    w_ptr, s_ptr, z_ptr, meta_ptr, rows_ptr, out_ptr, N, K, stride_w, stride_s, stride_m, stride_o,
    SCHEME: tl.constexpr, GROUP: tl.constexpr, SYMMETRIC: tl.constexpr, LAYOUT: tl.constexpr,
    GATHER: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Output rows rn of W, or with GATHER of W[rows[rn]] (an embedding's lookup)."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    n_mask = rn < N
    if GATHER:
        src = tl.load(rows_ptr + rn, mask=n_mask, other=0).to(tl.int64)
    else:
        src = rn
    w = _w_tile(w_ptr, s_ptr, z_ptr, meta_ptr, stride_w, stride_s, stride_m, src, n_mask, k0, K,
                SCHEME, GROUP, SYMMETRIC, LAYOUT, BLOCK_N, BLOCK_K, tl.float32)  # fmt: skip
    if SCHEME == 1:
        w = w * tl.load(s_ptr + src, mask=n_mask, other=0.0)[:, None]
    k = k0 + tl.arange(0, BLOCK_K)
    dst = out_ptr + rn.to(tl.int64)[:, None] * stride_o + k[None, :]
    tl.store(dst, cast_as(w, out_ptr.dtype.element_ty), mask=n_mask[:, None] & (k < K)[None, :])


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, F, stride_x, stride_o, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < F
    g = tl.load(x_ptr + t * stride_x + c, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + t * stride_x + F + c, mask=mask, other=0.0).to(tl.float32)
    out = cast_as(_silu_times(g, u, out_ptr.dtype.element_ty), out_ptr.dtype.element_ty)
    tl.store(out_ptr + t * stride_o + c, out, mask=mask)


@dataclass(frozen=True, slots=True)
class LinearConfig:
    """Launch configuration of the linear kernels (what the autotune pass stores per shape)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int = 2
    split_k: int = 1  # programs sharing one output tile along K (see SPLIT_MAX_M)
    swap: bool = False  # W^T x^T on the tensor cores for a few bf16 rows (``swap_applies``); block_m >= 16
    # One row: the native CUDA GEMV of this kind (one of kernels/cuda/gemv.py's KINDS) when the
    # artifact holds it (the autotune pass sets it where that kernel was faster); "" runs Triton. The
    # fields above are the Triton fallback either way.
    native: str = ""


# Candidates for the autotune pass and the benchmark. The GEMV takes one activation row per program.
# The last row: deeper pipelines (num_stages > 1) and wider K tiles keep more weight bytes in flight
# per SM; the H200 sweep of the rows above (all one stage) found split K -- more programs, so more
# loads in flight -- worth up to 2.1x for INT4, which points at memory-level parallelism.
GEMV_CONFIGS = [
    LinearConfig(1, bn, bk, w, s, sk)
    for bn, bk, w, s, sk in [(4, 512, 4, 1, 1), (8, 256, 4, 1, 1), (8, 512, 4, 1, 1), (16, 256, 4, 1, 1),
                             (16, 512, 8, 1, 1), (32, 128, 4, 1, 1), (32, 256, 8, 1, 1), (32, 512, 4, 1, 1),
                             (64, 128, 8, 1, 1), (64, 256, 8, 1, 1), (16, 1024, 8, 1, 1), (128, 128, 8, 1, 1),
                             (8, 512, 4, 1, 2), (16, 512, 4, 1, 4), (32, 256, 4, 1, 4), (32, 512, 8, 1, 8),
                             (64, 256, 8, 1, 8),
                             (8, 512, 4, 3, 1), (16, 1024, 8, 2, 1), (32, 256, 4, 3, 4), (64, 256, 8, 3, 8),
                             (32, 512, 4, 2, 4), (64, 512, 8, 2, 4), (16, 512, 4, 3, 2)]
]  # fmt: skip
GEMM_CONFIGS = [
    LinearConfig(bm, bn, bk, w, s, sk)
    for bm, bn, bk, w, s, sk in [(16, 64, 128, 4, 4, 1), (32, 64, 128, 4, 4, 1), (64, 64, 64, 4, 4, 1),
                                 (64, 128, 64, 4, 4, 1), (128, 128, 64, 8, 3, 1), (128, 256, 64, 8, 3, 1),
                                 (128, 128, 128, 8, 3, 1), (16, 64, 128, 4, 4, 2), (16, 64, 128, 4, 4, 4),
                                 (16, 64, 256, 4, 3, 8), (32, 64, 128, 4, 4, 4), (64, 64, 64, 4, 4, 4)]
]  # fmt: skip
# The transposed tensor-core path for a few bf16 rows (``swap_applies``): W tiles of block_n rows.
SWAP_CONFIGS = [
    LinearConfig(16, bn, bk, w, s, sk, swap=True)
    for bn, bk, w, s, sk in [(32, 128, 4, 3, 1), (64, 128, 4, 3, 1), (64, 256, 4, 3, 1), (128, 128, 4, 3, 1),
                             (128, 128, 8, 3, 1), (128, 256, 8, 3, 1), (64, 128, 4, 4, 1), (32, 256, 4, 4, 1),
                             (32, 128, 4, 3, 2), (64, 128, 4, 3, 2), (64, 128, 4, 3, 4), (128, 128, 8, 3, 4),
                             (32, 256, 4, 3, 4), (64, 256, 4, 3, 8)]
]  # fmt: skip
# From this many rows on, a quantized weight is dequantized (``dequantize``) for a dense product.
DEQUANTIZE_MIN_M = 256


def dense_product(w: GpuWeight, m: int) -> bool:
    """Whether the CUDA backend runs ``m`` rows of ``w`` as a dense (cuBLAS) product instead of these
    kernels: dense weights past the GEMV's rows, quantized ones (``dequantize`` first) from
    ``DEQUANTIZE_MIN_M`` rows; a fused gate/up then takes its SiLU product from ``silu_mul``."""
    return (w.scheme == "none" and m > GEMV_MAX_M) or (w.scheme != "none" and m >= DEQUANTIZE_MIN_M)


@dataclass(frozen=True, slots=True)
class DequantizeConfig:
    """``dequantize``'s launch configuration: a program's output tile, rows by columns, and warps."""

    block_n: int
    block_k: int
    num_warps: int = 4


@dataclass(frozen=True, slots=True)
class SiluMulConfig:
    """``silu_mul``'s launch configuration: the output columns of a program (one row) and its warps."""

    block: int
    num_warps: int = 4


MAX_ELEMENTS_PER_THREAD = 64  # the most a thread holds in the elementwise kernels' candidates
_DEQUANTIZE_CONFIGS = [DequantizeConfig(n, k, w) for n in (8, 16, 32, 64) for k in (128, 256, 512) for w in (2, 4, 8)]
_SILU_MUL_CONFIGS = [SiluMulConfig(b, w) for b in (64, 128, 256, 512, 1024, 2048, 4096) for w in (1, 2, 4, 8, 16)]


def _default_dequantize(w: GpuWeight, n: int) -> DequantizeConfig:
    return DequantizeConfig(min(32, next_pow2(n)), max(128, min_block_k(w)))


def _default_silu_mul(f: int) -> SiluMulConfig:
    return SiluMulConfig(min(1024, next_pow2(f)))


def dequantize_candidates(w: GpuWeight, rows: int | None = None) -> list[DequantizeConfig]:
    """The configurations the autotune pass times for dequantizing all of ``w`` (or, with ``rows``,
    looking that many of its rows up: an embedding's), the default first: K tiles of whole int4
    groups (``min_block_k``), row tiles no taller than the rows (capped at them, rounded up to a
    power of two, for a lookup of a few), and at most ``MAX_ELEMENTS_PER_THREAD`` elements a thread."""
    n = w.n if rows is None else rows
    default = _default_dequantize(w, n)
    tiles = dict.fromkeys(DequantizeConfig(min(c.block_n, next_pow2(n)), c.block_k, c.num_warps) for c in _DEQUANTIZE_CONFIGS)
    return [default] + [c for c in tiles if c != default and c.block_k % min_block_k(w) == 0
                        and c.block_n * c.block_k <= MAX_ELEMENTS_PER_THREAD * 32 * c.num_warps]  # fmt: skip


def silu_mul_candidates(f: int) -> list[SiluMulConfig]:
    """The configurations the autotune pass times for ``silu_mul`` to width ``f``, the default first:
    tiles no wider than ``f`` (rounded up to a power of two) and 1 to ``MAX_ELEMENTS_PER_THREAD``
    elements a thread."""
    default = _default_silu_mul(f)
    return [default] + [c for c in _SILU_MUL_CONFIGS if c != default and c.block <= next_pow2(f)
                        and 32 * c.num_warps <= c.block <= MAX_ELEMENTS_PER_THREAD * 32 * c.num_warps]  # fmt: skip


# Split K only while the fp32 workspace stays small (decode batches, not prefill chunks).
SPLIT_MAX_M = 256
_TARGET_PROGRAMS = 256  # about two waves of programs on an H200's 132 SMs


def default_config(m: int, n: int, k: int, scheme: str = "none") -> LinearConfig:
    """A good guess without tuning (the autotune pass stores better ones per shape).

    Small decode batches on narrow weights make too few output tiles to fill the GPU: K is then
    split until there are about ``_TARGET_PROGRAMS`` programs, each keeping two K tiles or more.
    """
    if m <= GEMV_MAX_M:
        # Measured on an H200 (bf16 activations, Llama-3.2-1B and -3.1-8B shapes): dense, 16 rows x
        # 1024 columns per program beat 8 x 512 by 12-35%. int4 g128, the best of the sweep was
        # 64 x 256 split 8 ways for N <= 4096 and 32 x 256 split 4 ways for wider weights, 1.3-2.1x
        # the old 8 x 512 default (e.g. 4096 x 14336: 30.3 vs 64.3 us); w8a16 keeps 8 x 512.
        if scheme == "none":
            return LinearConfig(1, 16, 1024, 8, 1)
        if scheme == "int4":
            return LinearConfig(1, 64, 256, 8, 1, 8) if n <= 4096 else LinearConfig(1, 32, 256, 4, 1, 4)
        return LinearConfig(1, 8, 512, 4, 1)
    if m <= 32:
        tile = LinearConfig(max(16, next_pow2(m)), 64, 128, 4, 4)  # small decode batches: W read once
    elif m <= SPLIT_MAX_M:
        tile = LinearConfig(64, 64, 64, 4, 4)  # large decode batches: 128 x 128 tiles ran 2-3x slower here
    else:
        return LinearConfig(128, 128, 64, 8, 3)
    tiles = -(-m // tile.block_m) * -(-n // tile.block_n)
    split, k_tiles = 1, -(-k // tile.block_k)
    while tiles * split * 2 <= _TARGET_PROGRAMS and k_tiles // (split * 2) >= 2:
        split *= 2
    return LinearConfig(tile.block_m, tile.block_n, tile.block_k, tile.num_warps, tile.num_stages, split)


SplitWorkspace = tuple[torch.Tensor, torch.Tensor]  # (fp32 partial sums, int32 tile counters), both zeroed
_workspaces: dict[str, list[SplitWorkspace]] = {}


def new_split_workspace(device: torch.device | str, numel: int, tiles: int) -> SplitWorkspace:
    """A zeroed split-K workspace: ``numel`` fp32 partial sums and ``tiles`` int32 counters.

    Split-K launches leave it zeroed again, so one workspace serves every launch on its device that
    runs after the previous one finished (one stream, or streams ordered by events). A CUDA graph
    that will replay split-K launches needs one made before its capture: zeros written while
    capturing only appear once the graph first replays.
    """
    return (torch.zeros(max(1, numel), dtype=torch.float32, device=device),
            torch.zeros(max(1, tiles), dtype=torch.int32, device=device))  # fmt: skip


def split_workspace(device: torch.device, numel: int, tiles: int) -> SplitWorkspace:
    """The module's shared workspace for ``device``, grown to hold ``numel`` sums and ``tiles`` counters.

    For callers that pass none (tests, the autotune pass, benchmarks): launches on one device must
    not overlap. A larger workspace is a new allocation, and the earlier ones stay alive because a
    captured CUDA graph may still use them. It is never allocated while a CUDA graph is being
    captured (see ``new_split_workspace``): run the launch once before capturing it.
    """
    pairs = _workspaces.setdefault(str(device), [])
    if not pairs or pairs[-1][0].numel() < numel or pairs[-1][1].numel() < tiles:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "split-K linear: no workspace large enough exists and none can be zeroed while a CUDA graph "
                "is being captured; run the launch once before capturing, or pass workspace="
            )
        have = pairs[-1] if pairs else (torch.empty(0), torch.empty(0))
        pairs.append(new_split_workspace(device, max(numel, have[0].numel()), max(tiles, have[1].numel())))
    return pairs[-1]


def min_block_k(w: GpuWeight) -> int:
    """The narrowest K tile the scheme allows: whole int4 groups, whole bytes of packed meta."""
    return {"int4": w.group_size, "sparse24_int4": max(16, 2 * w.group_size)}.get(w.scheme, 16)


@dataclass(frozen=True, slots=True)
class RowSquares:
    """What ``linear_add_squares`` leaves for the RMSNorm of its output: ``sq`` [M, tiles] fp32, each
    row's sum of squares over each output tile (summed by the reader in a fixed order)."""

    sq: torch.Tensor
    tiles: int


@dataclass(frozen=True, slots=True)
class NormIn:
    """An RMSNorm that the GEMV reading its input applies to x as it loads it (``linear(norm=)``):
    the squares of its input's rows, its weight (None: weightless) and eps."""

    squares: RowSquares
    weight: torch.Tensor | None
    eps: float


MAX_SQUARE_TILES = 4096  # partial sums a NormIn reader adds up (one vector load)


def _launch(x, w: GpuWeight, bias, out, config, silu_mul: bool, workspace: SplitWorkspace | None = None,
            residual: torch.Tensor | None = None, norm: NormIn | None = None):  # fmt: skip
    check_float("x", x)
    x = rows_of("x", x, w.k)
    m = x.shape[0]
    n = w.n // 2 if silu_mul else w.n
    if silu_mul and w.n % 2:
        raise ValueError(f"gate/up weight has an odd number of rows ({w.n})")
    if w.scheme == "none" and w.weight.dtype != x.dtype:
        raise TypeError(f"dense weight is {w.weight.dtype}, activations are {x.dtype}")
    if bias is not None and tuple(bias.shape) != (w.n,):
        raise ValueError(f"bias shape {tuple(bias.shape)} != ({w.n},)")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device) if out is None else out
    if m == 0:
        return out
    cfg = config or default_config(m, n, w.k, w.scheme)
    swap = cfg.swap and swap_applies(w, x.dtype)
    use_dot = not runs_gemv(m, w, config, x.dtype)
    block_m = max(16, cfg.block_m) if swap else cfg.block_m if use_dot else 1  # the GEMV takes one row per program
    block_k = max(min(cfg.block_k, next_pow2(w.k)), min_block_k(w))
    num_stages = cfg.num_stages
    if use_dot:
        # A K tile widened for whole int4 groups must still fit shared memory at this depth.
        tile_bytes = (block_m + cfg.block_n) * block_k * x.element_size()
        num_stages = max(1, min(num_stages, (160 * 1024) // tile_bytes))
    split_k = cfg.split_k if m <= SPLIT_MAX_M else 1
    split_k = max(1, min(split_k, cdiv(w.k, block_k)))  # no share without a K tile
    grid = (cdiv(m, block_m), cdiv(n, cfg.block_n), split_k)
    sq, n_sq, block_sq = out, 0, 1
    if residual is not None:
        if silu_mul or tuple(residual.shape) != (m, n) or residual.dtype != x.dtype or residual.stride(1) != 1:
            raise ValueError(f"residual must be [{m}, {n}] {x.dtype} with contiguous rows (and no SiLU product), "
                             f"got {tuple(residual.shape)} {residual.dtype}")  # fmt: skip
        sq = torch.empty((m, grid[1]), dtype=torch.float32, device=x.device)
    if norm is not None:
        sq, n_sq = norm.squares.sq, norm.squares.tiles
        if use_dot:
            raise ValueError("norm= runs in the one-row GEMV: a configuration with block_m 1 and no swap")
        if sq.dtype != torch.float32 or not sq.is_contiguous() or sq.shape[0] < m or sq.numel() < m * n_sq:
            raise ValueError(f"norm squares must be contiguous float32 [>= {m}, {n_sq}], got {tuple(sq.shape)} {sq.dtype}")
        if not 1 <= n_sq <= MAX_SQUARE_TILES:
            raise ValueError(f"norm squares come in {n_sq} partial sums; 1 to {MAX_SQUARE_TILES} are read")
        if norm.weight is not None and tuple(norm.weight.shape) != (w.k,):
            raise ValueError(f"norm weight shape {tuple(norm.weight.shape)} != ({w.k},)")
        block_sq = next_pow2(n_sq)
    ws = cnt = out
    if split_k > 1:
        numel, tiles = m * (2 * n if silu_mul else n), grid[0] * grid[1]
        if workspace is None:
            ws, cnt = split_workspace(x.device, numel, tiles)
        else:
            ws, cnt = workspace
            if ws.numel() < numel or cnt.numel() < tiles or ws.dtype != torch.float32 or cnt.dtype != torch.int32:
                raise ValueError(f"split-K workspace holds {ws.numel()} {ws.dtype} sums and {cnt.numel()} "
                                 f"{cnt.dtype} counters; this launch needs {numel} float32 and {tiles} int32")  # fmt: skip
    s, z, meta = w.scales, w.zeros, w.meta
    _linear_kernel[grid](
        x, w.weight, s if s is not None else x, z if z is not None else x, meta if meta is not None else x,
        bias if bias is not None else x, out, ws, cnt, residual if residual is not None else x, sq,
        norm.weight if norm is not None and norm.weight is not None else x,
        m, n, w.k, x.stride(0), w.weight.stride(0), s.stride(0) if s is not None and s.dim() == 2 else 0,
        meta.stride(0) if meta is not None else 0, out.stride(0), residual.stride(0) if residual is not None else 0,
        n_sq, float(norm.eps) if norm is not None else 0.0,
        SCHEME=SCHEME_IDS[w.scheme], GROUP=w.group_size or 1, SYMMETRIC=w.symmetric,
        LAYOUT=LAYOUT_IDS[w.layout], HAS_BIAS=bias is not None, SILU_MUL=silu_mul,
        USE_DOT=use_dot, DOT_PREC=dot_precision(x.dtype),
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k, EVEN=n % cfg.block_n == 0 and w.k % block_k == 0,
        SPLIT_K=split_k, SWAP=swap, FAST_CVT=not interpreting(), RES_SQ=residual is not None,
        NORM_IN=norm is not None, NORM_W=norm is not None and norm.weight is not None, BLOCK_SQ=block_sq,
        num_warps=cfg.num_warps, num_stages=num_stages, **overlap_options(),
    )  # fmt: skip
    if residual is not None:
        return out, RowSquares(sq, grid[1])
    return out


def runs_gemv(m: int, w: GpuWeight, config: LinearConfig | None, dtype: torch.dtype) -> bool:
    """Whether ``linear`` with ``config`` (None: the default) runs ``m`` rows of ``dtype`` as the
    one-row GEMV (one row per program, CUDA cores), the path that takes ``norm=``."""
    if config is None:
        return m <= GEMV_MAX_M
    return not (config.swap and swap_applies(w, dtype)) and config.block_m < 16


def swap_applies(w: GpuWeight, dtype: torch.dtype) -> bool:
    """Whether the transposed tensor-core path (``LinearConfig.swap``) runs ``w`` for activations of ``dtype``:
    bf16 activations, dense bf16, w8a16 or int4 weights, int4 groups of 32 or more (the dot's K is
    half a group). Otherwise a swap configuration runs as a ``tl.dot`` tile."""
    return dtype == torch.bfloat16 and (w.scheme in ("none", "w8a16") or (w.scheme == "int4" and w.group_size >= 32))


def linear(
    x: torch.Tensor,
    weight: GpuWeight,
    bias: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    config: LinearConfig | None = None,
    workspace: SplitWorkspace | None = None,
    norm: NormIn | None = None,
) -> torch.Tensor:
    """x [M, K] @ W[N, K]^T (+ bias [N]) -> [M, N] in x's dtype, for any scheme ``GpuWeight`` holds.

    ``workspace`` (``new_split_workspace``) serves split-K launches; without one the module's
    shared workspace for the device is used. ``norm``: x is the input of that RMSNorm, whose output
    the product takes (as ``linear(rms_norm(x))`` rounds it; the one-row GEMV configurations only)."""
    return _launch(x, weight, bias, out, config, silu_mul=False, workspace=workspace, norm=norm)


def linear_add_squares(
    x: torch.Tensor,
    weight: GpuWeight,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    *,
    config: LinearConfig | None = None,
    workspace: SplitWorkspace | None = None,
) -> tuple[torch.Tensor, RowSquares]:
    """``residual + linear(x)`` (the projection rounded to x's dtype, then the sum, as transformers
    adds a residual) and its rows' squares for an RMSNorm of it that a ``linear(norm=NormIn(...))``
    reading it applies: the add and the norm's statistics without a kernel of their own."""
    return _launch(x, weight, bias, None, config, silu_mul=False, workspace=workspace, residual=residual)


def linear_silu_mul(
    x: torch.Tensor,
    weight: GpuWeight,
    bias: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    config: LinearConfig | None = None,
    workspace: SplitWorkspace | None = None,
    norm: NormIn | None = None,
) -> torch.Tensor:
    """The fused gate/up projection and SiLU-mul: W [2F, K] is gate rows then up rows -> [M, F].
    ``norm`` as for ``linear``."""
    return _launch(x, weight, bias, out, config, silu_mul=True, workspace=workspace, norm=norm)


def dequantize(w: GpuWeight, dtype: torch.dtype, *, out: torch.Tensor | None = None,
               rows: torch.Tensor | None = None, config: DequantizeConfig | None = None) -> torch.Tensor:  # fmt: skip
    """W [N, K] in ``dtype`` (rounded once from the fp32 value ``dequantize_ref`` defines), written
    into ``out`` when given (a buffer of at least N * K elements; the first N * K are used). With
    ``rows`` (int32 or int64 [R], each in [0, N)): W[rows] [R, K] instead, an embedding's lookup in one
    kernel, as ``dequantize_ref(take_rows(w, rows))`` rounded to ``dtype``.

    Long prefills on quantized weights dequantize once and run the dense matrix product: at
    thousands of rows the weight is read once either way, and the dense product runs at the
    tensor cores' rate. ``config``: the launch configuration (default: 32-row tiles of the narrowest
    K the scheme allows, 128 columns or more, 4 warps)."""
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"dequantize to {dtype}: expected a float dtype")
    n = w.n
    if rows is not None:
        if rows.dim() != 1 or rows.dtype not in (torch.int32, torch.int64) or rows.device != w.weight.device:
            raise ValueError(f"dequantize rows: {rows.dtype} {tuple(rows.shape)} on {rows.device}; need int32 "
                             f"or int64 [R] on {w.weight.device}")  # fmt: skip
        n = rows.shape[0]
        rows = rows.contiguous()
    if out is None:
        out = torch.empty((n, w.k), dtype=dtype, device=w.weight.device)
    else:
        if out.dtype != dtype or not out.is_contiguous() or out.numel() < n * w.k:
            raise ValueError(f"dequantize buffer: {out.dtype} of {out.numel()} elements; need {dtype}, "
                             f"contiguous, >= {n * w.k}")  # fmt: skip
        out = out.view(-1)[: n * w.k].view(n, w.k)
    if n == 0:
        return out
    config = config or _default_dequantize(w, n)
    if config.block_k % min_block_k(w):
        raise ValueError(f"dequantize: K tile {config.block_k} is not a multiple of {min_block_k(w)} ({w.scheme})")
    block_n, block_k = config.block_n, config.block_k
    s, z, meta = w.scales, w.zeros, w.meta
    _dequantize_kernel[(cdiv(n, block_n), cdiv(w.k, block_k))](
        w.weight, s if s is not None else out, z if z is not None else out, meta if meta is not None else out,
        rows if rows is not None else out, out,
        n, w.k, w.weight.stride(0), s.stride(0) if s is not None and s.dim() == 2 else 0,
        meta.stride(0) if meta is not None else 0, out.stride(0),
        SCHEME=SCHEME_IDS[w.scheme], GROUP=w.group_size or 1, SYMMETRIC=w.symmetric,
        LAYOUT=LAYOUT_IDS[w.layout], GATHER=rows is not None, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=config.num_warps,
    )  # fmt: skip
    return out


def silu_mul(x: torch.Tensor, *, out: torch.Tensor | None = None, config: SiluMulConfig | None = None) -> torch.Tensor:
    """silu(gate) * up for x [T, 2F] holding gate then up -> [T, F]; ``config``: the launch
    configuration (default: tiles of up to 1,024 columns, 4 warps)."""
    check_float("x", x)
    x = rows_of("x", x)
    t, f2 = x.shape
    if f2 % 2:
        raise ValueError(f"fused width {f2} is odd")
    f = f2 // 2
    out = torch.empty((t, f), dtype=x.dtype, device=x.device) if out is None else out
    if t:
        config = config or _default_silu_mul(f)
        _silu_mul_kernel[(t, cdiv(f, config.block))](x, out, f, x.stride(0), out.stride(0), BLOCK=config.block,
                                                     num_warps=config.num_warps)  # fmt: skip
    return out


def row_major_codes(w: GpuWeight) -> torch.Tensor:
    """``w``'s stored codes [N, row bytes] in row-major order (a copy where the layout is cuda_tile16)."""
    if w.layout != "cuda_tile16":
        return w.weight
    shape, order = layout_registry.tile16_axes(w.scheme, *w.weight.shape)
    tiled = w.weight.reshape([shape[i] for i in order])
    return tiled.permute([order.index(i) for i in range(len(order))]).reshape(w.weight.shape)


def code_rows(w: GpuWeight, rows: torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` of ``w``'s stored codes, row-major [len(rows), row bytes] whatever the layout (a
    tied, tiled LM head's rows too: only those rows are read). With ``take_rows``, the torch reference
    of an embedding's lookup; the CUDA backend runs ``dequantize(rows=)``."""
    if w.layout != "cuda_tile16":
        return w.weight.index_select(0, rows)
    shape, order = layout_registry.tile16_axes(w.scheme, *w.weight.shape)
    tiled = w.weight.reshape([shape[i] for i in order])  # [N/16, S, U, 16, 64]
    return tiled[rows // shape[1], :, :, rows % shape[1], :].reshape(rows.shape[0], w.weight.shape[1])


def take_rows(w: GpuWeight, rows: torch.Tensor) -> GpuWeight:
    """The rows ``rows`` of ``w`` as a weight of their own: codes and their per-row companions gathered,
    the codes row-major where ``w`` is tiled (16-row tiles do not hold an arbitrary set of rows).
    ``dequantize_ref(take_rows(w, rows))`` is the reference that ``dequantize(rows=)`` is tested and
    timed against."""
    def pick(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.index_select(0, rows)

    layout = "row_major" if w.layout == "cuda_tile16" else w.layout
    return replace(w, n=rows.shape[0], weight=code_rows(w, rows), scales=pick(w.scales), zeros=pick(w.zeros),
                   meta=pick(w.meta), layout=layout, pairs=None)  # fmt: skip


def dequantize_ref(w: GpuWeight) -> torch.Tensor:
    """The fp32 W [N, K] that ``w`` stands for (torch; the oracle for these kernels)."""
    n, k = w.n, w.k
    if w.layout == "cuda_tile16":
        return dequantize_ref(replace(w, weight=row_major_codes(w), layout="row_major"))
    if w.scheme == "none":
        return w.weight.float()
    if w.scheme == "w8a16":
        return w.weight.float() * w.scales[:, None]
    if w.scheme == "int4":
        return _int4_ref(w.weight, w.scales, w.zeros, w.group_size, w.symmetric, k)
    vals = w.weight.float() if w.scheme == "sparse24" else _int4_ref(w.weight, w.scales, w.zeros, w.group_size,
                                                                     w.symmetric, k // 2)  # fmt: skip
    meta = w.meta.to(torch.int32)
    if w.layout == "sparse24_nibble_meta":
        meta = torch.stack([meta & 0xF, meta >> 4], dim=-1).reshape(n, k // 4)
    pairs = vals.reshape(n, k // 4, 2)
    dense = torch.zeros(n, k // 4, 4, dtype=torch.float32, device=w.weight.device)
    dense.scatter_(2, (meta & 3).long()[..., None], pairs[..., :1])
    dense.scatter_(2, ((meta >> 2) & 3).long()[..., None], pairs[..., 1:])
    return dense.reshape(n, k)


def _int4_ref(packed, scales, zeros, group: int, symmetric: bool, cols: int) -> torch.Tensor:
    p = packed.to(torch.int32)
    q = torch.stack([p & 0xF, p >> 4], dim=-1).reshape(p.shape[0], cols).float()
    s = scales.repeat_interleave(group, dim=1)[:, :cols]
    z = 8.0 if symmetric else zeros.float().repeat_interleave(group, dim=1)[:, :cols]
    return (q - z) * s


def linear_ref(x: torch.Tensor, w: GpuWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 x @ dequantize(W)^T (+ bias), cast to x's dtype."""
    y = x.float() @ dequantize_ref(w).T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def silu_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of x [T, 2F] as transformers computes it in x's dtype: silu(gate) rounded, then
    the product rounded (each a no-op in fp32)."""
    g, u = x.chunk(2, dim=1)
    a = torch.nn.functional.silu(g.float()).to(x.dtype)
    return (a.float() * u.float()).to(x.dtype)


def linear_silu_mul_ref(x: torch.Tensor, w: GpuWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The fused gate/up product and SiLU-mul: the product rounded to x's dtype (as transformers' two
    linears return it), then ``silu_mul_ref``."""
    y = x.float() @ dequantize_ref(w).T
    if bias is not None:
        y = y + bias.float()
    return silu_mul_ref(y.to(x.dtype))
