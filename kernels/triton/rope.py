"""Rotary position embedding (rotate-half style) of q and k, fused with the paged K/V cache write.

One program per token: it turns every q and k head of that token at the token's position and,
with ``rope_and_write_kv``, stores the turned k and the v of the token in their cache slot, so k
goes through device memory once between the QKV projection and attention.

The cache contract (shared with the engine and the CPU backend): each layer's K and V caches are
``[num_blocks, block_size, num_kv_heads, head_dim]``; the token at position ``pos`` of sequence
``i`` lives in slot ``block_table[i, pos // block_size] * block_size + pos % block_size``; the query
rows of sequence ``i`` are ``query_start_loc[i]:query_start_loc[i + 1]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._common import cast_as, check_float, next_pow2, round_apart, round_as, rows_of

__all__ = ["CONFIGS", "RopeConfig", "rope_", "rope_and_write_kv", "rope_ref", "check_cache"]

# Sequence ends _seq_of_token compares a token's row with at a time: a step of up to 64 sequences
# (every prefill step, most mixed ones) takes one load; the largest mixed graphs' 256 take four.
SEQ_ENDS_TILE = 64


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Launch configuration of the RoPE / K/V write kernel, whose programs each take one token (its
    tiles are the token's heads): the warps a program."""

    num_warps: int = 4


CONFIGS = [RopeConfig(w) for w in (1, 2, 4, 8, 16)]  # the autotune pass's candidates (the default among them)


@triton.jit
def _seq_of_token(qsl_ptr, num_seqs, t, BLOCK_S: tl.constexpr):
    """The sequence whose query rows hold row t: how many sequences end at or before t, counted
    over the step's sequence ends ``BLOCK_S`` at a time (one tile for any step count: no variant
    per count, which a served load would otherwise compile mid-load)."""
    seq = tl.full((), 0, tl.int32)
    for first in range(0, num_seqs, BLOCK_S):
        i = first + tl.arange(0, BLOCK_S)
        ends = tl.load(qsl_ptr + 1 + i, mask=i < num_seqs, other=2147483647)
        seq += tl.sum((ends <= t).to(tl.int32), axis=0)
    return seq


@triton.jit
def _angles(inv_ptr, pos, d, attention_scaling, ROT: tl.constexpr):
    """For dims ``d`` at position ``pos``: (cos, sin) scaled by ``attention_scaling``, each dim's
    rotate-half partner and sign, and which dims turn (the first ROT), as ``_rotate`` takes them."""
    half = ROT // 2
    rot = d < ROT
    first = d < half
    inv = tl.load(inv_ptr + tl.where(first, d, d - half), mask=rot, other=0.0).to(tl.float32)
    angle = pos.to(tl.float32) * inv  # the same fp32 product HF takes
    cos = tl.cos(angle) * attention_scaling
    sin = tl.sin(angle) * attention_scaling
    return cos, sin, tl.where(first, d + half, d - half), tl.where(first, -1.0, 1.0), rot


@triton.jit
def _rotate(x_ptr, row, heads, scale_cos, scale_sin, partner, sign, rot,
            BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, D: tl.constexpr):  # fmt: skip
    """Load heads [heads, D] of one token and rotate their first dims (rot); returns fp32 [BLOCK_H, BLOCK_D].

    The roundings are transformers' in the IO dtype (no-ops in fp32): cos and sin rounded, then each
    of the two products, then their sum (by the caller's store)."""
    io = x_ptr.dtype.element_ty
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h < heads)[:, None] & (d < D)[None, :]
    base = x_ptr + row + h[:, None] * D
    x = tl.load(base + d[None, :], mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(base + partner[None, :], mask=mask & rot[None, :], other=0.0).to(tl.float32)
    c = round_as(scale_cos, io)[None, :]
    s = round_as(scale_sin, io)[None, :]
    turned = round_apart(x * c, io) + round_apart(sign[None, :] * xp * s, io)
    return tl.where(rot[None, :], turned, x)


@triton.jit(do_not_specialize=["stride_bt", "num_seqs"])  # per-step counts (_common.py); a 1 is no constexpr either
def _rope_kv_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, inv_ptr, kc_ptr, vc_ptr, bt_ptr, qsl_ptr,
    num_seqs, stride_q, stride_k, stride_v, stride_bt, attention_scaling,
    HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr, PAGE: tl.constexpr,
    ROPE: tl.constexpr, WRITE_KV: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    t64 = t.to(tl.int64)
    pos = tl.load(pos_ptr + t)
    d = tl.arange(0, BLOCK_D)
    hk = tl.arange(0, BLOCK_HK)
    kmask = (hk < HK)[:, None] & (d < D)[None, :]
    if ROPE:
        c, s, partner, sign, rot = _angles(inv_ptr, pos, d, attention_scaling, ROT)
        hq = tl.arange(0, BLOCK_HQ)
        qmask = (hq < HQ)[:, None] & (d < D)[None, :]
        q = _rotate(q_ptr, t64 * stride_q, HQ, c, s, partner, sign, rot, BLOCK_HQ, BLOCK_D, D)
        k = _rotate(k_ptr, t64 * stride_k, HK, c, s, partner, sign, rot, BLOCK_HK, BLOCK_D, D)
        # In place: a head's partner dims may sit in another warp (k's 8 x 128 on 16 warps), which
        # must have loaded them before this one's stores overwrite them (a race the H200 showed).
        tl.debug_barrier()
        q = cast_as(q, q_ptr.dtype.element_ty)
        k = cast_as(k, k_ptr.dtype.element_ty)
        tl.store(q_ptr + t64 * stride_q + hq[:, None] * D + d[None, :], q, mask=qmask)
        tl.store(k_ptr + t64 * stride_k + hk[:, None] * D + d[None, :], k, mask=kmask)
    else:
        k = tl.load(k_ptr + t64 * stride_k + hk[:, None] * D + d[None, :], mask=kmask, other=0.0)
    if WRITE_KV:
        seq = _seq_of_token(qsl_ptr, num_seqs, t, BLOCK_S)
        page = tl.load(bt_ptr + seq.to(tl.int64) * stride_bt + pos // PAGE).to(tl.int64)
        slot = page * PAGE + pos % PAGE
        dst = slot * (HK * D) + hk[:, None] * D + d[None, :]
        tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=kmask)
        v = tl.load(v_ptr + t64 * stride_v + hk[:, None] * D + d[None, :], mask=kmask, other=0.0)
        tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=kmask)


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
    """(block_size, num_kv_heads, head_dim) of a contiguous [num_blocks, block_size, Hk, D] cache pair."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"K/V caches must both be [num_blocks, block_size, Hk, D], got {tuple(k_cache.shape)} "
            f"and {tuple(v_cache.shape)}"
        )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("K/V caches must be contiguous")
    _, page, hk, d = k_cache.shape
    return int(page), int(hk), int(d)


def _launch(q, k, v, positions, inv_freq, k_cache, v_cache, block_table, query_start_loc, *,
            head_dim, rotary_dim, attention_scaling, rope, write_kv, config=None):  # fmt: skip
    d = int(head_dim)
    k = rows_of("k", k)
    t = k.shape[0]
    hk = k.shape[1] // d
    if k.shape[1] != hk * d:
        raise ValueError(f"k width {k.shape[1]} is not a multiple of head_dim {d}")
    if positions.shape != (t,):
        raise ValueError(f"positions must be [{t}], got {tuple(positions.shape)}")
    hq = 1
    if rope:
        q = rows_of("q", q)
        hq = q.shape[1] // d
        if q.shape != (t, hq * d):
            raise ValueError(f"q shape {tuple(q.shape)} does not match k's {t} tokens of head_dim {d}")
        rotary_dim = d if rotary_dim is None else int(rotary_dim)
        if not (0 < rotary_dim <= d and rotary_dim % 2 == 0):
            raise ValueError(f"rotary_dim {rotary_dim} must be even and in (0, {d}]")
        if inv_freq.shape != (rotary_dim // 2,):
            raise ValueError(f"inv_freq must be [{rotary_dim // 2}], got {tuple(inv_freq.shape)}")
    num_seqs, page = 1, 1
    if write_kv:
        v = rows_of("v", v, k.shape[1])
        page, chk, chd = check_cache(k_cache, v_cache)
        if (chk, chd) != (hk, d):
            raise ValueError(f"cache holds {chk} heads of {chd}, k has {hk} of {d}")
        num_seqs = query_start_loc.shape[0] - 1
    if t == 0:
        return
    dummy = k
    _rope_kv_kernel[(t,)](
        q if rope else dummy, k, v if write_kv else dummy, positions,
        inv_freq if rope else dummy, k_cache if write_kv else dummy, v_cache if write_kv else dummy,
        block_table if write_kv else positions, query_start_loc if write_kv else positions,
        num_seqs, q.stride(0) if rope else 0, k.stride(0), v.stride(0) if write_kv else 0,
        block_table.stride(0) if write_kv else 0, float(attention_scaling),
        HQ=hq, HK=hk, D=d, ROT=rotary_dim if rope else 0, PAGE=page, ROPE=rope, WRITE_KV=write_kv,
        BLOCK_HQ=next_pow2(hq), BLOCK_HK=next_pow2(hk), BLOCK_D=next_pow2(d), BLOCK_S=SEQ_ENDS_TILE,  # one variant (_seq_of_token)
        num_warps=(config or RopeConfig()).num_warps,
    )  # fmt: skip


def rope_(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    *,
    head_dim: int,
    rotary_dim: int | None = None,
    attention_scaling: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq*D] and k [T, Hk*D] in place at ``positions`` [T]; returns them.

    angle = pos * inv_freq [rotary_dim/2] in fp32; cos and sin are scaled by ``attention_scaling``;
    dims past ``rotary_dim`` pass through.
    """
    check_float("q", q)
    _launch(q, k, None, positions, inv_freq, None, None, None, None, head_dim=head_dim,
            rotary_dim=rotary_dim, attention_scaling=attention_scaling, rope=True, write_kv=False)  # fmt: skip
    return q, k


def rope_and_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    head_dim: int,
    rotary_dim: int | None = None,
    attention_scaling: float = 1.0,
    config: RopeConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rope_`` and then store k, v [T, Hk*D] of each token in its slot of the paged caches;
    ``config``: the launch configuration (default ``RopeConfig()``)."""
    check_float("q", q)
    _launch(q, k, v, positions, inv_freq, k_cache, v_cache, block_table, query_start_loc,
            head_dim=head_dim, rotary_dim=rotary_dim, attention_scaling=attention_scaling,
            rope=True, write_kv=True, config=config)  # fmt: skip
    return q, k


def write_kv_launch(k, v, positions, k_cache, v_cache, block_table, query_start_loc) -> None:
    """Store k, v [T, Hk*D] in the paged caches (no rotation); ``attention.write_kv`` is the entry point."""
    d = k_cache.shape[-1] if k_cache.dim() == 4 else 1
    _launch(None, k, v, positions, None, k_cache, v_cache, block_table, query_start_loc,
            head_dim=d, rotary_dim=None, attention_scaling=1.0, rope=False, write_kv=True)  # fmt: skip


def rope_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    *,
    head_dim: int,
    rotary_dim: int | None = None,
    attention_scaling: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference (results in the input dtype; inputs untouched): fp32 math with transformers'
    roundings in the input dtype -- cos and sin, each product, their sum (no-ops in fp32)."""
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    angle = positions.float()[:, None] * inv_freq.float()[None, :]  # [T, R/2]
    angle = torch.cat([angle, angle], dim=-1)[:, None, :]  # [T, 1, R]
    cos, sin = angle.cos() * attention_scaling, angle.sin() * attention_scaling

    def turn(x: torch.Tensor) -> torch.Tensor:
        def rnd(t: torch.Tensor) -> torch.Tensor:
            return t.to(x.dtype).float()

        h = x.float().reshape(x.shape[0], -1, head_dim).clone()  # [T, H, D]
        r = h[..., :rotary_dim]
        half = rotary_dim // 2
        rotated = torch.cat([-r[..., half:], r[..., :half]], dim=-1)
        h[..., :rotary_dim] = rnd(r * rnd(cos)) + rnd(rotated * rnd(sin))
        return h.reshape(x.shape).to(x.dtype)

    return turn(q), turn(k)
