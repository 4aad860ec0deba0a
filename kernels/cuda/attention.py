"""Launching the native paged decode attention (``attention.cu``): one bf16 query row per sequence
against the paged K/V cache, its pieces merged inside a thread-block cluster (sm_90 and newer).

It takes what ``triton.attention.paged_attention_decode`` takes (RoPE and this step's K/V write
included, through ``DecodeRope``) and gives the same attention within rounding: its sums run in
another order, and its probabilities stay fp32 where the Triton kernel rounds them to bf16 for its
tensor-core product. ``decode_attention_applies`` says whether the loaded kernels take a case (bf16
q and caches, head dim 128, at most 8 query heads per kv head, sm_90); else the caller runs Triton.
"""

from __future__ import annotations

import ctypes
import math

import torch

from .driver import PORTABLE_CLUSTER, device_sm
from .rmsnorm import KERNEL_ABI, CudaKernels

__all__ = ["ENTRIES", "HEAD_DIM", "MAX_CLUSTER", "TILE", "decode_attention", "decode_attention_applies", "decode_pieces"]

HEAD_DIM = 128  # kD in attention.cu
TILE = 128  # tokens a block takes at a time (kTile)
THREADS = 256  # kThreads: threads a block
MAX_CLUSTER = 16  # kMaxCluster: pieces a cluster merges (past PORTABLE_CLUSTER: H100/H200)
ENTRIES = {g: f"mgx_decode_attn_g{g}_bf16_v{KERNEL_ABI}" for g in (4, 8)}  # by the most query heads a kv head
LOG2E = 1.4426950408889634


def _entry(g: int) -> str | None:
    return next((ENTRIES[m] for m in sorted(ENTRIES) if g <= m), None)


def decode_pieces(max_context_len: int, cluster_max: int = PORTABLE_CLUSTER) -> int:
    """Blocks a cluster cuts a context of up to ``max_context_len`` tokens into: one 128-token tile
    each while that fits in ``cluster_max`` blocks, else ``cluster_max`` (each then loops over its tiles)."""
    if not 1 <= cluster_max <= MAX_CLUSTER:
        raise ValueError(f"a cluster holds 1 to {MAX_CLUSTER} blocks, not {cluster_max}")
    return max(1, min(cluster_max, math.ceil(max(1, max_context_len) / TILE)))


def decode_attention_applies(kernels: CudaKernels | None, q: torch.Tensor, k_cache: torch.Tensor,
                             v_cache: torch.Tensor) -> bool:  # fmt: skip
    """Whether the native kernel takes decode attention of q [S, Hq*D] on these caches [blocks, page, Hk, D]."""
    if kernels is None or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        return False
    hk, d = k_cache.shape[2], k_cache.shape[3]
    if d != HEAD_DIM or q.dim() != 2 or q.shape[1] % (hk * d):
        return False
    entry = _entry(q.shape[1] // (hk * d))
    return (entry is not None and kernels.has(entry) and device_sm(kernels.device) >= 90
            and q.dtype == k_cache.dtype == v_cache.dtype == torch.bfloat16
            and q.is_cuda and q.device.index == kernels.device and k_cache.device == q.device == v_cache.device
            and q.stride(1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous())  # fmt: skip


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    *,
    kernels: CudaKernels,
    scale: float,
    pieces: int,
    sliding_window: int = 0,
    rope=None,  # noqa: ANN001 (triton.attention.DecodeRope)
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention of q [S, Hq*D] (one row per sequence, at position context_lens[s] - 1) -> [S,
    Hq*D] bf16, each (sequence, kv head) on a cluster of ``pieces`` blocks (``decode_pieces``; fixed
    in a CUDA graph). ``rope``: as ``paged_attention_decode``'s (q and k unrotated, this step's k and v
    not yet in the cache). The caller checks ``decode_attention_applies`` first."""
    n, hk, page = q.shape[0], k_cache.shape[2], k_cache.shape[1]
    if not 1 <= pieces <= MAX_CLUSTER:
        raise ValueError(f"decode attention runs on 1 to {MAX_CLUSTER} pieces, not {pieces}")
    if block_table.dim() != 2 or block_table.stride(1) != 1 or block_table.dtype != torch.int32:
        raise ValueError("block_table must be an int32 [num_seqs, max_blocks] tensor with contiguous rows")
    if context_lens.dtype != torch.int32 or context_lens.numel() < n:
        raise ValueError(f"context_lens must hold {n} int32 lengths")
    g = q.shape[1] // (hk * HEAD_DIM)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    if n == 0:
        return out
    k_new = v_new = inv = q
    rot, scaling = 0, 1.0
    if rope is not None:
        k_new, v_new = rope.k, rope.v
        rot = HEAD_DIM if rope.rotary_dim is None else int(rope.rotary_dim)
        ok = (k_new.shape == v_new.shape == (n, hk * HEAD_DIM) and k_new.stride(1) == v_new.stride(1) == 1
              and k_new.dtype == v_new.dtype == torch.bfloat16 and 0 < rot <= HEAD_DIM and rot % 2 == 0
              and rope.inv_freq.shape == (rot // 2,) and rope.inv_freq.dtype == torch.float32)  # fmt: skip
        if not ok:
            raise ValueError(f"decode rope: k {tuple(k_new.shape)}, v {tuple(v_new.shape)} bf16 rows for {n} "
                             f"sequences, rotary_dim {rot}, fp32 inv_freq [{rot // 2}]")  # fmt: skip
        inv, scaling = rope.inv_freq, float(rope.attention_scaling)
    i64, i32 = ctypes.c_longlong, ctypes.c_int
    args = [_ptr(out), _ptr(q), _ptr(k_new), _ptr(v_new), _ptr(k_cache), _ptr(v_cache), _ptr(block_table),
            _ptr(context_lens), _ptr(inv), ctypes.c_float(scaling), ctypes.c_float(float(scale) * LOG2E),
            i64(q.stride(0)), i64(k_new.stride(0)), i64(v_new.stride(0)), i64(out.stride(0)), i64(block_table.stride(0)),
            i32(hk), i32(g), i32(page), i32(int(sliding_window)), i32(rot)]  # fmt: skip
    stream = torch.cuda.current_stream(q.device).cuda_stream
    kernels.module.launch(_entry(g), (pieces, hk, n), (THREADS,), args, stream, overlap=kernels.overlap, cluster=pieces)
    return out


def _ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())
