"""Paged attention: decode (split over the context, flash-decoding style) and prefill (flash, causal).

Both read K and V from the paged cache through the engine's block tables (the contract is in
``rope.py``'s docstring): key position j of sequence i is at slot
``block_table[i, j // block_size] * block_size + j % block_size``. A query at position p sees keys
j <= p, and with a sliding window w > 0 only those with j > p - w. Query head h reads kv head
h // (Hq / Hk). ``context_lens[i]`` counts the tokens cached after this step's were written, so the
cache write (``write_kv`` or ``rope_and_write_kv``) runs first.

Decode runs one program per (sequence, kv head, split): the G = Hq/Hk query heads that share a kv
head are the rows of one tile, so each K/V byte is read once for all of them; long contexts are
split so that the grid fills the GPU, and the splits' partial softmaxes are merged: by a second
kernel, or, given zeroed ``counters``, by the split of each (sequence, kv head) that finishes last
(it counts arrivals, merges, and zeroes its counter for the next launch), one launch fewer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._common import (
    cast_as,
    cdiv,
    check_float,
    dot_precision,
    next_pow2,
    num_sms,
    overlap_options,
    overlap_start,
    rows_of,
)
from .rope import _angles, _rotate, check_cache, write_kv_launch

__all__ = [
    "write_kv",
    "paged_attention",
    "paged_attention_decode",
    "paged_attention_prefill",
    "paged_attention_ref",
    "decode_splits",
    "new_decode_counters",
    "DecodeRope",
    "DecodeConfig",
    "MergeConfig",
    "PrefillConfig",
    "DECODE_BLOCK_NS",
    "DECODE_CONFIGS",
    "MERGE_CONFIGS",
    "PREFILL_CONFIGS",
    "merge_splits",
]

LOG2E = 1.4426950408889634
# Splits a merge loads at a time: [G, 16, D] fp32 partials fit a program's registers (all of 33-64
# splits at once took 255 registers and 120 bytes of stack on sm_90a). Two tiles only, masked
# (``merge_tile``): a tile fitted to the count (1, 2, 4, 8, 16) was a variant of the decode kernel
# for each, compiled mid-load as contexts grew (1.5 s each on the H200, 27th session). One tile of 16
# for every count cost 8B heads (D = 128) 0.5 us at 6-8 splits (7.08 against 6.58 us at batch 1, a
# 768-token context), and 1B heads nothing measurable; a tile of 8 up to 8 splits is what those ran.
MERGE_SPLITS = 16
SMALL_MERGE_SPLITS = 8
# Decode splits merge themselves (the last to finish merges all) up to this many in the CUDA backend;
# past it the merge kernel runs. On the H200 (8B heads, batch 1) the self-merge won at 10 splits (640
# tokens: 14.0 vs 17.4 us with three launches) and lost at 32-33 (8,192-131,072 tokens: by 2.1-2.7 us),
# when it loaded all splits at once (255 registers and a stack on sm_90a). It now loads 16 at a time
# and only the pieces that hold keys (MERGE_SPLITS): to be measured again before this limit moves.
SELF_MERGE_MAX_SPLITS = 16


@triton.jit
def _kv_slots(page, pos, h, d, PAGE: tl.constexpr, HK: tl.constexpr, D: tl.constexpr):
    """Element offsets [BLOCK_N, BLOCK_D] of kv head h for key positions pos on their pages."""
    slot = page.to(tl.int64) * PAGE + pos % PAGE
    return slot[:, None] * (HK * D) + h * D + d[None, :]


@triton.jit
def _kv_offsets(bt_ptr, seq_row, pos, valid, h, d, PAGE: tl.constexpr, HK: tl.constexpr, D: tl.constexpr):
    """Element offsets [BLOCK_N, BLOCK_D] of kv head h for key positions pos, through the block table."""
    page = tl.load(bt_ptr + seq_row + pos // PAGE, mask=valid, other=0)
    return _kv_slots(page, pos, h, d, PAGE, HK, D)


@triton.jit
def _decode_tile(q, kc_ptr, vc_ptr, off, valid, scale_log2, m, denom, acc, d, D: tl.constexpr,
                 DOT_PREC: tl.constexpr):  # fmt: skip
    """One tile of keys (element offsets ``off``, rows ``valid``) into the running softmax (m, denom,
    acc) of the G query rows."""
    kv_mask = valid[:, None] & (d < D)[None, :]
    k = tl.load(kc_ptr + off, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
    v = tl.load(vc_ptr + off, mask=kv_mask, other=0.0)
    return _decode_kv(q, k, v, valid, scale_log2, m, denom, acc, DOT_PREC)


@triton.jit
def _decode_kv(q, k, v, valid, scale_log2, m, denom, acc, DOT_PREC: tl.constexpr):
    """Keys k and values v [BLOCK_N, BLOCK_D] (rows ``valid``) into the running softmax (m, denom,
    acc) of the G query rows."""
    sc = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale_log2  # [BLOCK_G, BLOCK_N]
    sc = tl.where(valid[None, :], sc, float("-inf"))
    m_new = tl.maximum(m, tl.max(sc, axis=1))
    # Rows that have seen no key yet (an empty piece) keep m = -inf, denom = 0 and acc = 0.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_safe)
    pr = tl.exp2(sc - m_safe[:, None])
    denom = denom * alpha + tl.sum(pr, axis=1)
    acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v, input_precision=DOT_PREC)
    return m_new, denom, acc


@triton.jit(do_not_specialize=["bt_cols", "stride_bt"], do_not_specialize_on_alignment=["num_splits"])  # per-step counts (_common.py)
def _decode_kernel(
    q_ptr, kc_ptr, vc_ptr, bt_ptr, ctx_ptr, out_ptr, part_o_ptr, part_m_ptr, part_l_ptr, cnt_ptr,
    k_ptr, v_ptr, inv_ptr, stride_k, stride_v, attention_scaling,
    stride_q, stride_o, stride_bt, bt_cols, scale_log2, window, num_splits,
    HK: tl.constexpr, G: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_R: tl.constexpr,
    SPLIT: tl.constexpr, MERGE: tl.constexpr, ROT: tl.constexpr, DOT_PREC: tl.constexpr, OVERLAP: tl.constexpr,
):  # fmt: skip
    # With RoPE fused (ROT > 0) this kernel writes the step's K/V itself: what it reads before its
    # wait below (the context length, block table and cache, written before the previous kernel
    # began) is not the previous kernel's output, so those round trips of memory overlap it.
    if ROT == 0:
        overlap_start(OVERLAP)
    s = tl.program_id(0)
    h = tl.program_id(1)
    p = tl.program_id(2)
    s64 = s.to(tl.int64)
    seq_row = s64 * stride_bt
    # The usual piece is the one tile at p * BLOCK_N (no window, num_splits * BLOCK_N covering the
    # context): its pages are read before the context length, not after it (one round trip fewer).
    pos1 = p * BLOCK_N + tl.arange(0, BLOCK_N)
    page1 = tl.load(bt_ptr + seq_row + pos1 // PAGE, mask=pos1 < bt_cols * PAGE, other=0)
    ctx = tl.load(ctx_ptr + s)
    lo = ctx * 0
    if window > 0:
        lo = tl.maximum(ctx - window, 0)  # the query sits at ctx - 1
    chunk = tl.cdiv(tl.cdiv(ctx - lo, num_splits), BLOCK_N) * BLOCK_N
    start = lo + p * chunk
    end = tl.minimum(start + chunk, ctx)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    hq = h * G + g
    gd_mask = (g < G)[:, None] & (d < D)[None, :]
    one_tile = (lo == 0) & (chunk == BLOCK_N)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    # The piece's first tile of keys and values (a one-tile piece's through the pages read above).
    # With RoPE fused they are read before the wait, and the slot at ctx - 1, if in the tile, is
    # stale until this step's k, v replace it below.
    if one_tile:
        pos_f, page_f = pos1, page1
    else:
        pos_f = start + tl.arange(0, BLOCK_N)
        page_f = tl.load(bt_ptr + seq_row + pos_f // PAGE, mask=pos_f < end, other=0)
    off_f = _kv_slots(page_f, pos_f, h, d, PAGE, HK, D)
    kv_mask = (pos_f < end)[:, None] & (d < D)[None, :]
    k_f = tl.load(kc_ptr + off_f, mask=kv_mask, other=0.0)
    v_f = tl.load(vc_ptr + off_f, mask=kv_mask, other=0.0)
    if ROT > 0:
        cos, sin, partner, sign, rot = _angles(inv_ptr, ctx - 1, d, attention_scaling, ROT)
        overlap_start(OVERLAP)
        # RoPE in the prologue (as rope_and_write_kv would): q's G heads here, at position ctx - 1;
        # the program whose share holds that position turns k and writes it and v to the cache
        # (no other program reads that slot).
        q = _rotate(q_ptr + h * (G * D), s64 * stride_q, G, cos, sin, partner, sign, rot, BLOCK_G, BLOCK_D, D)
        q = cast_as(q, q_ptr.dtype.element_ty)
        if (start <= ctx - 1) & (ctx - 1 < end):
            one = tl.arange(0, 2)
            kmask = (one < 1)[:, None] & (d < D)[None, :]
            k_new = _rotate(k_ptr + h * D, s64 * stride_k, 1, cos, sin, partner, sign, rot, 2, BLOCK_D, D)
            if ctx - 1 < start + BLOCK_N:  # the slot's page is among the first tile's, already loaded
                page = tl.sum(tl.where(pos_f == ctx - 1, page_f, 0), axis=0).to(tl.int64)
            else:
                page = tl.load(bt_ptr + seq_row + (ctx - 1) // PAGE).to(tl.int64)
            dst = (page * PAGE + (ctx - 1) % PAGE) * (HK * D) + h * D
            k_new = cast_as(k_new, k_ptr.dtype.element_ty).to(kc_ptr.dtype.element_ty)
            tl.store(kc_ptr + dst + one[:, None] * D + d[None, :], k_new, mask=kmask)
            v_new = tl.load(v_ptr + s64 * stride_v + h * D + d, mask=d < D, other=0.0).to(vc_ptr.dtype.element_ty)
            tl.store(vc_ptr + dst + d, v_new, mask=d < D)
            # The first tile's row at ctx - 1 as it is now in the cache (no row where it is not there).
            k_row = tl.sum(tl.where(kmask, k_new.to(tl.float32), 0.0), axis=0).to(kc_ptr.dtype.element_ty)
            here = (pos_f == ctx - 1)[:, None]
            k_f = tl.where(here, k_row[None, :], k_f)
            v_f = tl.where(here, v_new[None, :], v_f)
            tl.debug_barrier()  # every thread's cache writes land before the loop's reads below
    else:
        q = tl.load(q_ptr + s64 * stride_q + hq[:, None] * D + d[None, :], mask=gd_mask, other=0.0)
    m, denom, acc = _decode_kv(q, k_f, v_f, pos_f < end, scale_log2, m, denom, acc, DOT_PREC)
    for n0 in range(start + BLOCK_N, end, BLOCK_N):  # the piece's other tiles
        pos = n0 + tl.arange(0, BLOCK_N)
        valid = pos < end
        off = _kv_offsets(bt_ptr, seq_row, pos, valid, h, d, PAGE, HK, D)
        m, denom, acc = _decode_tile(q, kc_ptr, vc_ptr, off, valid, scale_log2, m, denom, acc, d, D, DOT_PREC)

    if SPLIT:
        first = (s * (HK * G) + hq).to(tl.int64) * num_splits  # [BLOCK_G]: split 0 of each row of [S, Hq, splits]
        row = first + p
        tl.store(part_o_ptr + row[:, None] * D + d[None, :], acc, mask=gd_mask)
        tl.store(part_m_ptr + row, m, mask=g < G)
        tl.store(part_l_ptr + row, denom, mask=g < G)
        if MERGE:
            tl.debug_barrier()  # every thread's stores are issued before the release below
            cnt = cnt_ptr + s * HK + h
            if tl.atomic_add(cnt, 1, sem="acq_rel") == num_splits - 1:
                # The other splits' stores are in L2: loads bypass L1 (.cg). The G query rows of
                # this KV head in one round of loads (one after another they waited on L2 G times).
                live = tl.cdiv(ctx - lo, tl.maximum(chunk, 1))  # the pieces that hold keys
                _merge_rows(part_o_ptr, part_m_ptr, part_l_ptr, (s * (HK * G) + h * G).to(tl.int64) * num_splits,
                            out_ptr + s64 * stride_o + h * G * D, d, num_splits, live, G, D, BLOCK_R, BLOCK_P, BLOCK_D,
                            ".cg")  # fmt: skip
                tl.store(cnt, 0)
    else:
        out = acc / denom[:, None]
        dst = out_ptr + s.to(tl.int64) * stride_o + hq[:, None] * D + d[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=gd_mask)


@triton.jit
def _merge_rows(part_o_ptr, part_m_ptr, part_l_ptr, first, dst_ptr, d, num_splits, live, ROWS: tl.constexpr,
                D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
                CACHE: tl.constexpr):  # fmt: skip
    """``ROWS`` consecutive query rows' outputs (at ``dst_ptr``, D apart) from the partial softmaxes
    of their first ``live`` splits (rows ``first`` onwards of the [S * Hq, num_splits] partials; the
    splits past ``live`` are empty), ``BLOCK_P`` splits of every row loaded at a time (one round of
    loads up to ``BLOCK_P`` splits; a bounded tile, so many splits do not spill registers). Empty
    splits (m = -inf) weigh nothing; at least one split of a row is not empty."""
    r = tl.arange(0, BLOCK_R)
    top = tl.full([BLOCK_R], float("-inf"), tl.float32)
    o_sum = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    l_sum = tl.zeros([BLOCK_R], tl.float32)
    for p0 in range(0, live, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        mask = (r < ROWS)[:, None] & (p < live)[None, :]  # [BLOCK_R, BLOCK_P]
        row = first + r[:, None] * num_splits + p[None, :]
        m = tl.load(part_m_ptr + row, mask=mask, other=float("-inf"), cache_modifier=CACHE)
        denom = tl.load(part_l_ptr + row, mask=mask, other=0.0, cache_modifier=CACHE)
        o = tl.load(part_o_ptr + row[:, :, None] * D + d[None, None, :], mask=mask[:, :, None] & (d < D)[None, None, :],
                    other=0.0, cache_modifier=CACHE)  # fmt: skip
        new_top = tl.maximum(top, tl.max(m, axis=1))
        safe = tl.where(new_top == float("-inf"), 0.0, new_top)  # padding rows: all -inf
        alpha = tl.exp2(top - safe)  # 0 in the first round
        w = tl.exp2(m - safe[:, None])
        o_sum = o_sum * alpha[:, None] + tl.sum(w[:, :, None] * o, axis=1)
        l_sum = l_sum * alpha + tl.sum(w * denom, axis=1)
        top = new_top
    out = o_sum / tl.maximum(l_sum, 1e-30)[:, None]
    tl.store(dst_ptr + r[:, None] * D + d[None, :], out.to(dst_ptr.dtype.element_ty),
             mask=(r < ROWS)[:, None] & (d < D)[None, :])  # fmt: skip


@triton.jit(do_not_specialize_on_alignment=["num_splits"])  # a per-step count (_common.py says why)
def _decode_merge_kernel(
    part_o_ptr, part_m_ptr, part_l_ptr, out_ptr, stride_o, num_splits,
    HQ: tl.constexpr, D: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr, OVERLAP: tl.constexpr,
):  # fmt: skip
    overlap_start(OVERLAP)
    s = tl.program_id(0)
    hq = tl.program_id(1)
    _merge_rows(part_o_ptr, part_m_ptr, part_l_ptr, (s * HQ + hq).to(tl.int64) * num_splits,
                out_ptr + s.to(tl.int64) * stride_o + hq * D, tl.arange(0, BLOCK_D), num_splits, num_splits, 1, D, 1,
                BLOCK_P, BLOCK_D, "")  # fmt: skip


@triton.jit(do_not_specialize=["stride_bt"])  # a per-step count (_common.py says why)
def _prefill_kernel(
    q_ptr, kc_ptr, vc_ptr, bt_ptr, ctx_ptr, qsl_ptr, pos_ptr, out_ptr,
    stride_q, stride_o, stride_bt, scale_log2, window,
    HK: tl.constexpr, G: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
):  # fmt: skip
    mb = tl.program_id(0)
    s = tl.program_id(1)
    hq = tl.program_id(2)
    h = hq // G
    q0 = tl.load(qsl_ptr + s)
    qlen = tl.load(qsl_ptr + s + 1) - q0
    if mb * BLOCK_M >= qlen:
        return
    i = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    imask = i < qlen
    rows = (q0 + i).to(tl.int64)
    qpos = tl.load(pos_ptr + rows, mask=imask, other=-1)  # padding rows see no key
    ctx = tl.load(ctx_ptr + s)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    q = tl.load(q_ptr + rows[:, None] * stride_q + hq * D + d[None, :], mask=imask[:, None] & dmask[None, :], other=0.0)

    hi = tl.minimum(ctx, tl.max(qpos, axis=0) + 1)
    lo = ctx * 0
    if window > 0:
        first = tl.min(tl.where(imask, qpos, 2147483647), axis=0)
        lo = tl.maximum(first - window + 1, 0) // BLOCK_N * BLOCK_N
    # A finite floor keeps exp2(m - m_new) defined for rows that have seen no key yet.
    m = tl.full([BLOCK_M], -1.0e30, tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    seq_row = s.to(tl.int64) * stride_bt
    for n0 in range(lo, hi, BLOCK_N):
        kpos = n0 + tl.arange(0, BLOCK_N)
        kvalid = kpos < hi
        off = _kv_offsets(bt_ptr, seq_row, kpos, kvalid, h, d, PAGE, HK, D)
        kv_mask = kvalid[:, None] & dmask[None, :]
        k = tl.load(kc_ptr + off, mask=kv_mask, other=0.0)
        v = tl.load(vc_ptr + off, mask=kv_mask, other=0.0)
        sc = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale_log2  # [BLOCK_M, BLOCK_N]
        vis = kvalid[None, :] & (kpos[None, :] <= qpos[:, None])
        vis = vis & ((window <= 0) | (kpos[None, :] > qpos[:, None] - window))
        sc = tl.where(vis, sc, float("-inf"))
        m_new = tl.maximum(m, tl.max(sc, axis=1))
        alpha = tl.exp2(m - m_new)
        pr = tl.exp2(sc - m_new[:, None])
        denom = denom * alpha + tl.sum(pr, axis=1)
        acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v, input_precision=DOT_PREC)
        m = m_new
    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    dst = out_ptr + rows[:, None] * stride_o + hq * D + d[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=imask[:, None] & dmask[None, :])


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
) -> None:
    """Store k, v [T, Hk*D] (token t at ``positions[t]`` of its sequence) into the paged caches."""
    write_kv_launch(k, v, positions, k_cache, v_cache, block_table, query_start_loc)


@dataclass(frozen=True, slots=True)
class DecodeRope:
    """What ``paged_attention_decode`` needs to rotate q and k and write this step's K/V itself:
    k, v [S, Hk*D] of the new tokens (k unrotated) and ``rope_and_write_kv``'s RoPE parameters."""

    k: torch.Tensor
    v: torch.Tensor
    inv_freq: torch.Tensor
    rotary_dim: int | None = None
    attention_scaling: float = 1.0


@dataclass(frozen=True, slots=True)
class DecodeConfig:
    """A decode launch configuration (what the autotune pass stores per batch bucket): the context's
    tile width in tokens and the warps of a program."""

    block_n: int = 64
    num_warps: int = 4


@dataclass(frozen=True, slots=True)
class MergeConfig:
    """Launch configuration of the merge kernel of split decode attention (a program a query row;
    it runs where the splits do not merge themselves: more than ``SELF_MERGE_MAX_SPLITS``, or no
    counters): the warps of a program."""

    num_warps: int = 4


@dataclass(frozen=True, slots=True)
class PrefillConfig:
    """A prefill launch configuration (what the autotune pass stores per chunk length): query rows and
    key tokens of a tile, warps, pipeline stages."""

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2


DECODE_BLOCK_NS = (32, 64)  # the tile widths the CUDA backend's decode attention takes (its splits' unit)
# The autotune pass's candidates, the default first. Decode: those widths on 4 or 8 warps (both run on
# the H200, 49th session).
DECODE_CONFIGS = [DecodeConfig(n, w) for n in reversed(DECODE_BLOCK_NS) for w in (4, 8)]
MERGE_CONFIGS = [MergeConfig(w) for w in (4, 1, 2, 8, 16)]  # the merge kernel's, the default first
# Prefill: the configurations examples/bench_gpu_kernels.py sweeps on the H200.
PREFILL_CONFIGS = [PrefillConfig(64, 64, 4, 2), PrefillConfig(64, 64, 4, 3), PrefillConfig(128, 64, 4, 3),
                   PrefillConfig(128, 64, 8, 3), PrefillConfig(128, 128, 8, 2), PrefillConfig(64, 128, 4, 3)]  # fmt: skip


def new_decode_counters(device: torch.device | str, num_seqs: int, num_kv_heads: int) -> torch.Tensor:
    """Zeroed arrival counters for ``paged_attention_decode`` of up to ``num_seqs`` sequences. Made
    before a CUDA graph's capture (zeros written while capturing appear only at its first replay)."""
    return torch.zeros(max(1, num_seqs * num_kv_heads), dtype=torch.int32, device=device)


def decode_splits(num_seqs: int, num_kv_heads: int, max_context_len: int, sms: int, block_n: int = 64,
                  min_tiles: int = 2) -> int:  # fmt: skip
    """How many pieces to cut each context into so that about two waves of programs fill the GPU,
    each piece keeping at least ``min_tiles`` tiles of ``block_n`` tokens."""
    programs = max(1, num_seqs * num_kv_heads)
    want = math.ceil(2 * sms / programs)
    most = max(1, math.ceil(max_context_len / (min_tiles * block_n)))
    return max(1, min(want, most, 256))


def merge_tile(num_splits: int) -> int:
    """Splits a merge of ``num_splits`` partials loads at a time (``MERGE_SPLITS`` says why two sizes)."""
    return SMALL_MERGE_SPLITS if num_splits <= SMALL_MERGE_SPLITS else MERGE_SPLITS


def _check(q, k_cache, v_cache, block_table, context_lens, out):
    check_float("q", q)
    page, hk, d = check_cache(k_cache, v_cache)
    q = rows_of("q", q)
    hq = q.shape[1] // d
    if q.shape[1] != hq * d or hq % hk:
        raise ValueError(f"q width {q.shape[1]} is not a multiple of {hk} kv heads of {d}")
    if block_table.dim() != 2 or block_table.stride(1) != 1:
        raise ValueError("block_table must be a [num_seqs, max_blocks] tensor with contiguous rows")
    out = torch.empty_like(q, memory_format=torch.contiguous_format) if out is None else out
    return q, page, hk, d, hq, out


def paged_attention_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    scale: float,
    sliding_window: int = 0,
    num_splits: int | None = None,
    max_context_len: int | None = None,
    out: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
    rope: DecodeRope | None = None,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    merge: MergeConfig | None = None,
) -> torch.Tensor:
    """One query row per sequence, q [S, Hq*D] at position context_lens[i] - 1 -> [S, Hq*D].

    ``num_splits`` fixes the split of the context (a CUDA graph needs it fixed); by default it is
    chosen from ``max_context_len`` (read from ``context_lens`` when not given, which synchronizes).
    ``counters``: zeroed int32, at least S * Hk of them (``new_decode_counters``), left zeroed: split
    programs merge their partials themselves instead of a second kernel (one stream at a time).
    ``rope``: q is not yet rotated, and this step's k and v are not yet in the cache: the kernel does
    what ``rope_and_write_kv`` would first (q itself is left as it was), one launch fewer. Launched
    overlapped (``overlapped_launches``), it then reads ``context_lens``, ``block_table`` and the
    cache's earlier slots before it waits for the kernel launched just before it: none of them may be
    that kernel's output (the backend fills them before a step's first kernel). ``merge``: the merge
    kernel's launch configuration, where one runs (split, no counters).
    """
    q, page, hk, d, hq, out = _check(q, k_cache, v_cache, block_table, context_lens, out)
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two of at least 16 (tl.dot's smallest K), got {block_n}")
    n = q.shape[0]
    if n == 0:
        return out
    k_new = v_new = inv = q
    rot, scaling = 0, 1.0
    if rope is not None:
        k_new, v_new = rows_of("k", rope.k, hk * d), rows_of("v", rope.v, hk * d)
        rot = d if rope.rotary_dim is None else int(rope.rotary_dim)
        if k_new.shape[0] != n or v_new.shape[0] != n or not (0 < rot <= d and rot % 2 == 0):
            raise ValueError(f"decode rope: k {tuple(k_new.shape)}, v {tuple(v_new.shape)} for {n} rows; "
                             f"rotary_dim {rot} of head_dim {d}")  # fmt: skip
        if rope.inv_freq.shape != (rot // 2,):
            raise ValueError(f"inv_freq must be [{rot // 2}], got {tuple(rope.inv_freq.shape)}")
        inv, scaling = rope.inv_freq, float(rope.attention_scaling)
    if num_splits is None:
        if max_context_len is None:
            max_context_len = int(context_lens.max())
        num_splits = decode_splits(n, hk, max_context_len, num_sms(q.device), block_n)
    g = hq // hk
    split = num_splits > 1
    self_merge = split and counters is not None  # the split programs merge their partials themselves
    if self_merge and (counters.dtype != torch.int32 or counters.numel() < n * hk):
        raise ValueError(f"decode counters: {counters.numel()} {counters.dtype}; this launch needs {n * hk} int32")
    f32 = torch.float32
    part_o = torch.empty((n, hq, num_splits, d), dtype=f32, device=q.device) if split else out
    part_m = torch.empty((n, hq, num_splits), dtype=f32, device=q.device) if split else out
    part_l = torch.empty((n, hq, num_splits), dtype=f32, device=q.device) if split else out
    _decode_kernel[(n, hk, num_splits)](
        q, k_cache, v_cache, block_table, context_lens, out, part_o, part_m, part_l, counters if self_merge else out,
        k_new, v_new, inv, k_new.stride(0), v_new.stride(0), scaling,
        q.stride(0), out.stride(0), block_table.stride(0), block_table.shape[1], float(scale) * LOG2E,
        int(sliding_window), num_splits,
        HK=hk, G=g, D=d, PAGE=page, BLOCK_G=max(16, next_pow2(g)), BLOCK_D=max(16, next_pow2(d)),
        BLOCK_N=block_n, BLOCK_P=merge_tile(num_splits) if self_merge else 1, BLOCK_R=next_pow2(g) if self_merge else 1,
        SPLIT=split, MERGE=self_merge, ROT=rot, DOT_PREC=dot_precision(q.dtype), num_warps=num_warps,
        num_stages=num_stages, **overlap_options(),
    )  # fmt: skip
    if split and not self_merge:
        merge_splits(part_o, part_m, part_l, out, config=merge)
    return out


def merge_splits(part_o: torch.Tensor, part_m: torch.Tensor, part_l: torch.Tensor, out: torch.Tensor, *,
                 config: MergeConfig | None = None) -> torch.Tensor:  # fmt: skip
    """Split decode attention's merge kernel: out [S, Hq*D] from the splits' partial outputs
    part_o [S, Hq, P, D], running maxima part_m [S, Hq, P] (log2 domain, -inf for an empty split) and
    denominators part_l [S, Hq, P], all fp32; a program a query row (``config``: its warps)."""
    n, hq, splits, d = part_o.shape
    if part_m.shape != (n, hq, splits) or part_l.shape != (n, hq, splits) or out.shape[0] != n:
        raise ValueError(f"decode merge: partials {tuple(part_o.shape)}, {tuple(part_m.shape)}, {tuple(part_l.shape)} "
                         f"for out {tuple(out.shape)}")  # fmt: skip
    _decode_merge_kernel[(n, hq)](
        part_o, part_m, part_l, out, out.stride(0), splits,
        HQ=hq, D=d, BLOCK_P=merge_tile(splits), BLOCK_D=next_pow2(d), num_warps=(config or MergeConfig()).num_warps,
        **overlap_options(),
    )  # fmt: skip
    return out


def paged_attention_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    *,
    scale: float,
    sliding_window: int = 0,
    max_query_len: int | None = None,
    out: torch.Tensor | None = None,
    block_m: int = 64,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """Causal attention of the packed query rows q [T, Hq*D] (at ``positions`` [T]) over the paged cache."""
    q, page, hk, d, hq, out = _check(q, k_cache, v_cache, block_table, context_lens, out)
    t = q.shape[0]
    num_seqs = query_start_loc.shape[0] - 1
    if t == 0 or num_seqs == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    block_m = min(block_m, max(16, next_pow2(max_query_len)))
    if sliding_window > 0 and block_m == 32:
        # On an H200 with Triton 3.6, 32-row tiles with a sliding window returned zeros (fp32 and bf16,
        # 1 or 2 stages; 16- and 64-row tiles were right): the window's first-row reduction is the
        # suspect. tests/gpu/test_gpu_kernels.py::test_prefill_window_tile_sizes guards this.
        block_m = 64
    grid = (cdiv(max_query_len, block_m), num_seqs, hq)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_table, context_lens, query_start_loc, positions, out,
        q.stride(0), out.stride(0), block_table.stride(0), float(scale) * LOG2E, int(sliding_window),
        HK=hk, G=hq // hk, D=d, PAGE=page, BLOCK_M=block_m, BLOCK_D=max(16, next_pow2(d)), BLOCK_N=block_n,
        DOT_PREC=dot_precision(q.dtype), num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    *,
    scale: float,
    sliding_window: int = 0,
    max_query_len: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The IR's ``attention`` op: store this step's k, v in the cache, then attend (decode or prefill)."""
    write_kv(k, v, positions, k_cache, v_cache, block_table, query_start_loc)
    num_seqs = query_start_loc.shape[0] - 1
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max()) if num_seqs else 0
    if max_query_len == 1 and q.shape[0] == num_seqs:
        # Decode: the query is the last cached token, so positions[i] == context_lens[i] - 1.
        return paged_attention_decode(q, k_cache, v_cache, block_table, context_lens, scale=scale,
                                      sliding_window=sliding_window, out=out)  # fmt: skip
    return paged_attention_prefill(q, k_cache, v_cache, block_table, context_lens, query_start_loc, positions,
                                   scale=scale, sliding_window=sliding_window, max_query_len=max_query_len,
                                   out=out)  # fmt: skip


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    *,
    scale: float,
    sliding_window: int = 0,
) -> torch.Tensor:
    """The torch reference: gathers each sequence's K/V from the cache and attends in fp32."""
    page, hk, d = check_cache(k_cache, v_cache)
    hq = q.shape[1] // d
    g = hq // hk
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    qsl = query_start_loc.tolist()
    for i in range(len(qsl) - 1):
        a, b = qsl[i], qsl[i + 1]
        if a == b:
            continue
        n = int(context_lens[i])
        j = torch.arange(n, device=q.device)
        slots = block_table[i, j // page].long() * page + j % page
        kk = k_cache.reshape(-1, hk, d)[slots].float()  # [S, Hk, D]
        vv = v_cache.reshape(-1, hk, d)[slots].float()
        qq = q[a:b].float().reshape(b - a, hk, g, d)  # [T, Hk, G, D]
        sc = torch.einsum("tkgd,skd->kgts", qq, kk) * scale  # [Hk, G, T, S]
        p = positions[a:b].long()[:, None]
        vis = j[None, :] <= p
        if sliding_window > 0:
            vis &= j[None, :] > p - sliding_window
        sc = sc.masked_fill(~vis, float("-inf")).softmax(-1)
        o = torch.einsum("kgts,skd->tkgd", sc, vv)
        out[a:b] = o.reshape(b - a, hq * d)
    return out.to(q.dtype)
