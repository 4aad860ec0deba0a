"""The LM head fused with argmax, for greedy decoding.

Each program computes the logits of one vocabulary tile for a block of rows, keeps only each row's
largest logit and its index, and writes those [R, V / BLOCK_N] pairs; a second small kernel reduces
them per row. The [R, V] logits never reach device memory, which at batch 1 leaves the weight read
as the only real traffic. Ties go to the smallest token id, like numpy's and torch's argmax. A NaN
logit counts as -inf (never picked over a number, as in the CPU kernels), so the token is always one
of the vocabulary's, the smallest where every logit is NaN or -inf (its logit then reads -inf): a
greedy step's token goes on the device into the next step's embedding lookup, where an id outside
the table would end the process.

The argmax is over the fp32 logits, not over logits rounded to the activation dtype: bf16 logits of
magnitude 16-32 come in steps of 0.125, so rounding would turn near-ties into exact ties that the
smallest id wins, and greedy decoding would leave the model's own most likely token there. (SmolLM2
in bf16 on the H200, 30 prompts of 32 tokens, 2026-11-30: teacher-forced through an fp32 head, MGX's
top token was fp32's at 948 of 960 steps, as transformers bf16's; free-running through this head,
which then rounded, MGX parted from fp32's tokens on 8 prompts where transformers bf16 with an fp32
head did not, and on 1 the other way round.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._common import cdiv, check_float, dot_precision, next_pow2, overlap_options, overlap_start, rows_of
from .linear import (
    GEMV_MAX_M,
    LAYOUT_IDS,
    SCHEME_IDS,
    GpuWeight,
    LinearConfig,
    _mm_tile,
    default_config,
    dequantize_ref,
    min_block_k,
)

__all__ = ["ArgmaxMergeConfig", "lm_head_argmax", "lm_head_argmax_ref", "lm_head_tiles", "merge_candidates", "merge_tile_argmax"]

MERGE_MAX_TILE = 16384  # the most tiles' pairs one merge program holds at a time (32 per thread on 16 warps)


@dataclass(frozen=True, slots=True)
class ArgmaxMergeConfig:
    """Launch configuration of the merge of a row's tile argmaxes (one program a row): tiles it reads
    at a time (``block_t``, capped at the row's tile count rounded up to a power of two) and warps."""

    block_t: int = 1024
    num_warps: int = 4


def merge_candidates(num_tiles: int) -> list[ArgmaxMergeConfig]:
    """The autotune pass's candidates for rows of ``num_tiles`` tiles, the default first: tiles of 256
    to ``MERGE_MAX_TILE``, each capped at the row's tiles rounded up to a power of two (as a launch
    caps them), on 1-16 warps, none that launches as the default does. One program a row, so at batch
    1 the merge is a single program's loads (8,016 tiles of the 8B vocabulary on the imma kinds: eight
    rounds of loads on the default)."""
    top = min(MERGE_MAX_TILE, next_pow2(num_tiles))
    default = ArgmaxMergeConfig()
    as_default = ArgmaxMergeConfig(min(default.block_t, top), default.num_warps)
    tiles = sorted({min(top, t) for t in (256, 512, 1024, 2048, 4096, 8192, 16384)})
    return [default] + [c for c in (ArgmaxMergeConfig(t, w) for t in tiles for w in (1, 2, 4, 8, 16)) if c != as_default]


@triton.jit(do_not_specialize_on_alignment=["M", "num_tiles"])  # per-step counts (_common.py says why)
def _lm_head_tile_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, meta_ptr, b_ptr, part_v_ptr, part_i_ptr,
    M, N, K, stride_xm, stride_w, stride_s, stride_m, num_tiles,
    SCHEME: tl.constexpr, GROUP: tl.constexpr, SYMMETRIC: tl.constexpr, LAYOUT: tl.constexpr,
    HAS_BIAS: tl.constexpr, USE_DOT: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr, OVERLAP: tl.constexpr,
):  # fmt: skip
    overlap_start(OVERLAP)
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    pid_n = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = rm < M
    n_mask = rn < N
    acc = _mm_tile(x_ptr, stride_xm, rm, m_mask, w_ptr, s_ptr, z_ptr, meta_ptr, stride_w, stride_s, stride_m,
                   rn, n_mask, K, 0, K, 1.0, x_ptr, SCHEME, GROUP, SYMMETRIC, LAYOUT, USE_DOT, DOT_PREC,
                   BLOCK_M, BLOCK_N, BLOCK_K, EVEN, False, False)  # fmt: skip
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    acc = tl.where(n_mask[None, :] & (acc == acc), acc, float("-inf"))  # NaN counts as -inf
    best = tl.max(acc, axis=1)  # [BLOCK_M]
    idx = tl.argmax(acc, axis=1, tie_break_left=True) + pid_n * BLOCK_N
    dst = rm.to(tl.int64) * num_tiles + pid_n
    tl.store(part_v_ptr + dst, best, mask=m_mask)
    tl.store(part_i_ptr + dst, idx, mask=m_mask)


@triton.jit(do_not_specialize_on_alignment=["num_tiles"])  # a per-step count (_common.py says why)
def _argmax_merge_kernel(part_v_ptr, part_i_ptr, ids_ptr, vals_ptr, num_tiles, BLOCK_T: tl.constexpr,
                         OVERLAP: tl.constexpr):  # fmt: skip
    overlap_start(OVERLAP)
    r = tl.program_id(0).to(tl.int64)
    best = tl.full([BLOCK_T], float("-inf"), tl.float32)
    best_i = tl.full([BLOCK_T], 2147483647, tl.int32)
    for t0 in range(0, num_tiles, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        v = tl.load(part_v_ptr + r * num_tiles + t, mask=t < num_tiles, other=float("-inf"))
        i = tl.load(part_i_ptr + r * num_tiles + t, mask=t < num_tiles, other=2147483647)
        # Lanes keep their best, the smaller id on ties (so that rows of -inf logits, NaN's included,
        # still give a token of the vocabulary: the smallest).
        better = (v > best) | ((v == best) & (i < best_i))
        best = tl.where(better, v, best)
        best_i = tl.where(better, i, best_i)
    top = tl.max(best, axis=0)
    token = tl.min(tl.where(best == top, best_i, 2147483647), axis=0)
    tl.store(ids_ptr + r, token)
    tl.store(vals_ptr + r, top)


def lm_head_argmax(
    x: torch.Tensor,
    weight: GpuWeight,
    bias: torch.Tensor | None = None,
    *,
    config: LinearConfig | None = None,
    merge: ArgmaxMergeConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy tokens for x [R, H] and W [V, H]: (ids [R] int32, their logits [R] fp32); ``config``
    the tile kernel's launch configuration, ``merge`` the merge's (``merge_tile_argmax``)."""
    check_float("x", x)
    x = rows_of("x", x, weight.k)
    m, n = x.shape[0], weight.n
    cfg = config or default_config(m, n, weight.k, weight.scheme)
    use_dot = m > GEMV_MAX_M if config is None else cfg.block_m >= 16
    block_m = cfg.block_m if use_dot else 1  # the GEMV takes one row per program
    block_k = max(min(cfg.block_k, next_pow2(weight.k)), min_block_k(weight))
    num_tiles = lm_head_tiles(n, cfg, m, weight.k, weight.scheme)
    ids = torch.empty(m, dtype=torch.int32, device=x.device)
    vals = torch.empty(m, dtype=torch.float32, device=x.device)
    if m == 0:
        return ids, vals
    part_v = torch.empty((m, num_tiles), dtype=torch.float32, device=x.device)
    part_i = torch.empty((m, num_tiles), dtype=torch.int32, device=x.device)
    s, z, meta = weight.scales, weight.zeros, weight.meta
    _lm_head_tile_kernel[(cdiv(m, block_m), num_tiles)](
        x, weight.weight, s if s is not None else x, z if z is not None else x, meta if meta is not None else x,
        bias if bias is not None else x, part_v, part_i,
        m, n, weight.k, x.stride(0), weight.weight.stride(0), s.stride(0) if s is not None and s.dim() == 2 else 0,
        meta.stride(0) if meta is not None else 0, num_tiles,
        SCHEME=SCHEME_IDS[weight.scheme], GROUP=weight.group_size or 1, SYMMETRIC=weight.symmetric,
        LAYOUT=LAYOUT_IDS[weight.layout], HAS_BIAS=bias is not None,
        USE_DOT=use_dot, DOT_PREC=dot_precision(x.dtype),
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k, EVEN=n % cfg.block_n == 0 and weight.k % block_k == 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **overlap_options(),
    )  # fmt: skip
    return merge_tile_argmax(part_v, part_i, ids, vals, config=merge)


def lm_head_tiles(n: int, config: LinearConfig | None, m: int, k: int, scheme: str) -> int:
    """How many tiles ``lm_head_argmax`` splits a vocabulary of ``n`` into at ``m`` rows under ``config``
    (None: the default), i.e. the merge's row length (its entries' key)."""
    return cdiv(n, (config or default_config(m, n, k, scheme)).block_n)


def merge_tile_argmax(
    part_v: torch.Tensor, part_i: torch.Tensor, ids: torch.Tensor | None = None, vals: torch.Tensor | None = None,
    *, config: ArgmaxMergeConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's argmax from its tiles' best logits part_v [R, T] (fp32) at ids part_i [R, T]
    (int32; each tile's smallest on ties): (ids [R] int32, logits [R] fp32), the smallest id on ties.
    The Triton LM head's second kernel, and the native one's (``cuda.gemv.gemv_argmax``); ``config``:
    the launch configuration (default ``ArgmaxMergeConfig()``)."""
    m, num_tiles = part_v.shape
    ids = torch.empty(m, dtype=torch.int32, device=part_v.device) if ids is None else ids
    vals = torch.empty(m, dtype=torch.float32, device=part_v.device) if vals is None else vals
    config = config or ArgmaxMergeConfig()
    block_t = min(config.block_t, next_pow2(num_tiles))
    _argmax_merge_kernel[(m,)](part_v, part_i, ids, vals, num_tiles, BLOCK_T=block_t, num_warps=config.num_warps,
                               **overlap_options())  # fmt: skip
    return ids, vals


def lm_head_argmax_ref(
    x: torch.Tensor, weight: GpuWeight, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits in fp32 (not rounded to x's dtype), then torch.argmax (first index on ties)."""
    logits = x.float() @ dequantize_ref(weight).T
    if bias is not None:
        logits = logits + bias.float()
    ids = logits.argmax(dim=1)
    return ids.to(torch.int32), logits.gather(1, ids[:, None])[:, 0]
