"""RMSNorm, optionally fused with the residual add that precedes it in every transformer block.

``rms_norm(x, w, eps)`` is the IR's ``rms_norm`` op; with ``residual`` it computes
``s = x + residual`` (rounded to the IO dtype, as the unfused add would), returns ``norm(s) * w``
and ``s``, reading each input once and writing each output once. Sums of squares are fp32. In
16-bit IO the normalized row is rounded before the weight multiplies it, as transformers does (the
models were trained that way); in fp32 that rounding is a no-op.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._common import cast_as, cdiv, check_float, next_pow2, num_sms, round_as, rows_of

__all__ = ["RMSNormConfig", "rms_norm", "rms_norm_ref", "default_config", "candidates", "CONFIGS", "LOOP_CONFIGS"]

MAX_COLS = 65536  # one program holds a whole row in registers


@triton.jit
def _norm_rows(x, res, r, c, cols, mask, cmask, w_ptr, out_ptr, res_out_ptr, stride_o, stride_ro, eps,
               HAS_RES: tl.constexpr, HAS_W: tl.constexpr):  # fmt: skip
    """Normalize the loaded rows ``r`` (``x`` plus ``res``; ``mask``: their elements) and store them (and
    the sum)."""
    r64 = r.to(tl.int64)[:, None]
    if HAS_RES:
        # Round the sum to the IO dtype first: the next layer reads that rounded residual.
        x = cast_as(x.to(tl.float32) + res.to(tl.float32), res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + r64 * stride_ro + c[None, :], x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=1) / cols + eps)  # [BLOCK_M]
    y = xf * rstd[:, None]
    if HAS_W:
        # As transformers' RMSNorm: the normalized row is rounded to the IO dtype before the weight
        # multiplies it (nothing to round in fp32).
        y = round_as(y, out_ptr.dtype.element_ty) * tl.load(w_ptr + c, mask=cmask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + r64 * stride_o + c[None, :], cast_as(y, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _load_rows(x_ptr, res_ptr, r, c, rows, cmask, stride_x, stride_r, HAS_RES: tl.constexpr):
    """Rows ``r`` of x and of the residual (x again without one), [BLOCK_M, BLOCK_N], and their mask."""
    r64 = r.to(tl.int64)[:, None]
    mask = (r < rows)[:, None] & cmask[None, :]
    x = tl.load(x_ptr + r64 * stride_x + c[None, :], mask=mask, other=0.0)
    res = x
    if HAS_RES:
        res = tl.load(res_ptr + r64 * stride_r + c[None, :], mask=mask, other=0.0)
    return x, res, mask


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    rows, cols, stride_x, stride_r, stride_o, stride_ro, eps,
    HAS_RES: tl.constexpr, HAS_W: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LOOP: tl.constexpr,
):  # fmt: skip
    """Program p normalizes row block p; with LOOP, on fewer programs than blocks, it takes blocks p,
    p + programs, ... and asks for the next block's rows before it normalizes the current one, so its
    loads stay in flight across its blocks instead of each block's program starting cold."""
    p = tl.program_id(0)
    c = tl.arange(0, BLOCK_N)
    cmask = c < cols
    r = p * BLOCK_M + tl.arange(0, BLOCK_M)
    x, res, mask = _load_rows(x_ptr, res_ptr, r, c, rows, cmask, stride_x, stride_r, HAS_RES)
    if LOOP:
        step = tl.num_programs(0)
        for b in range(p, tl.cdiv(rows, BLOCK_M), step):
            r_next = (b + step) * BLOCK_M + tl.arange(0, BLOCK_M)
            x_next, res_next, mask_next = _load_rows(x_ptr, res_ptr, r_next, c, rows, cmask, stride_x, stride_r,
                                                     HAS_RES)  # fmt: skip
            _norm_rows(x, res, r, c, cols, mask, cmask, w_ptr, out_ptr, res_out_ptr, stride_o, stride_ro, eps,
                       HAS_RES, HAS_W)  # fmt: skip
            x, res, r, mask = x_next, res_next, r_next, mask_next
    else:
        _norm_rows(x, res, r, c, cols, mask, cmask, w_ptr, out_ptr, res_out_ptr, stride_o, stride_ro, eps, HAS_RES,
                   HAS_W)  # fmt: skip


@dataclass(frozen=True, slots=True)
class RMSNormConfig:
    """Launch configuration (the benchmark sweeps ``CONFIGS`` and ``LOOP_CONFIGS``, the autotune pass
    ``candidates``; wrappers take one)."""

    block_m: int  # rows per program
    num_warps: int
    # 0: a program per block of rows; else at most this many programs a streaming multiprocessor,
    # each looping over blocks of rows with the next block's loads in flight (_rms_norm_kernel's LOOP)
    per_sm: int = 0


# Candidates of the benchmark's sweep and of the autotune pass (``candidates``).
CONFIGS = [RMSNormConfig(m, w) for m in (1, 2, 4, 8, 16) for w in (1, 2, 4, 8, 16)]
# Looping candidates, for many rows.
LOOP_CONFIGS = [RMSNormConfig(m, w, k) for m in (1, 2) for w in (2, 4, 8) for k in (4, 8, 16)]
MAX_PER_THREAD = 128  # elements a thread holds, at most, in a candidate the autotune pass times


def default_config(rows: int, cols: int) -> RMSNormConfig:
    """A good guess without tuning: about 2-4K elements per program, 16 elements per thread."""
    block_n = next_pow2(cols)
    block_m = max(1, min(16, 2048 // block_n, next_pow2(rows)))
    num_warps = max(1, min(16, block_m * block_n // 512))
    return RMSNormConfig(block_m, num_warps)


def candidates(rows: int, cols: int, sms: int) -> list[RMSNormConfig]:
    """The configurations the autotune pass times for ``rows`` rows of ``cols``, ``default_config``'s
    first: of ``CONFIGS`` those with no more row tiles than the rows fill and 1 to ``MAX_PER_THREAD``
    elements a thread (more spill registers), and of ``LOOP_CONFIGS`` those that leave some programs
    more than one block on a GPU of ``sms`` multiprocessors (else they launch a program a block)."""
    block_n = next_pow2(cols)
    default = default_config(rows, cols)
    found = [default]
    for c in CONFIGS + LOOP_CONFIGS:
        per_thread = c.block_m * block_n // (32 * c.num_warps)
        fits = c.block_m <= next_pow2(rows) and 1 <= per_thread <= MAX_PER_THREAD
        if fits and c != default and (c.per_sm == 0 or cdiv(rows, c.block_m) > c.per_sm * sms):
            found.append(c)
    return found


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    *,
    group: int | None = None,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: RMSNormConfig | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x [T, F] over each contiguous group of ``group`` features (default F), times weight [group].

    With ``residual`` [T, F], normalizes ``x + residual`` and returns ``(out, x + residual)``.
    """
    check_float("x", x)
    x = rows_of("x", x)
    t, f = x.shape
    group = f if group is None else int(group)
    if f % group:
        raise ValueError(f"width {f} is not a multiple of group {group}")
    if group > MAX_COLS:
        raise ValueError(f"group {group} is wider than {MAX_COLS}, the widest row one program holds")
    if weight is not None and tuple(weight.shape) != (group,):
        raise ValueError(f"weight shape {tuple(weight.shape)} != ({group},)")
    res_out = None
    if residual is not None:
        residual = rows_of("residual", residual, f)
        if residual.shape[0] != t:
            raise ValueError(f"residual has {residual.shape[0]} rows, x has {t}")
        res_out = torch.empty_like(x, memory_format=torch.contiguous_format)
    out = torch.empty_like(x, memory_format=torch.contiguous_format) if out is None else out
    if t == 0:
        return out if residual is None else (out, res_out)
    # Groups narrower than the row are rows of their own: [T, F] -> [T*F/group, group].
    xs = _as_groups(x, group, copy=True)
    rs = _as_groups(residual, group, copy=True) if residual is not None else xs
    os_ = _as_groups(out, group)
    ros = _as_groups(res_out, group) if res_out is not None else os_
    rows = xs.shape[0]
    cfg = config or default_config(rows, group)
    grid = (cdiv(rows, cfg.block_m),)
    if cfg.per_sm > 0:
        grid = (max(1, min(grid[0], cfg.per_sm * num_sms(x.device))),)
    _rms_norm_kernel[grid](
        xs, rs, weight if weight is not None else xs, os_, ros,
        rows, group, xs.stride(0), rs.stride(0), os_.stride(0), ros.stride(0), float(eps),
        HAS_RES=residual is not None, HAS_W=weight is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=next_pow2(group), LOOP=cfg.per_sm > 0, num_warps=cfg.num_warps,
    )  # fmt: skip
    return out if residual is None else (out, res_out)


def _as_groups(t: torch.Tensor, group: int, *, copy: bool = False) -> torch.Tensor:
    """``t`` [T, F] as [T*F/group, group]. Rows that are not back to back (q or k split off a fused
    QKV output) are copied first for an input (``copy``); an output buffer must be viewable."""
    if t.shape[1] == group:
        return t
    if t.stride(0) != t.shape[1]:
        if not copy:
            raise ValueError("grouped RMSNorm needs an output with contiguous rows")
        t = t.contiguous()
    return t.view(-1, group)


def rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    *,
    group: int | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The torch reference: fp32 math, the sum rounded to the IO dtype like the unfused add, and (as in
    transformers) the normalized rows rounded to the IO dtype before the weight multiplies them."""
    if residual is not None:
        x = (x.float() + residual.float()).to(x.dtype)
    t, f = x.shape
    group = f if group is None else group
    g = x.float().reshape(t, f // group, group)
    y = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y.to(x.dtype).float() * weight.float()
    y = y.reshape(t, f).to(x.dtype)
    return y if residual is None else (y, x)
