"""Launching the native GEMV (``gemv.cu``): one bf16 activation row times int4, W8A16 or dense bf16
weights, optionally fused with the SiLU-gated product of a gate/up projection.

Six kinds (``KINDS``): ``gemv`` on the CUDA cores (every scheme here), ``mma`` on the tensor
cores (int4 with groups of a multiple of 128, and W8A16; K a multiple of 128, sm_80 and newer), ``mma_persistent``, the same
kernel on ``MMA_BLOCKS_PER_SM`` blocks per SM that loop over the output groups and prefetch the
weights ahead into L2, and ``mma_pipelined``, its own entry point (``mma_pipe``), whose warps
issue the loads of their next steps (codes, and int4 scales and zeros) before they compute the current ones,
and ``imma`` (W8A16, and int4 with groups of a multiple of 128), whose int8 codes (int4: nibbles
masked into bytes) enter integer MMAs against x made integer per 128-column step (three bytes of a
fixed-point x; gemv.cu says how), with ``imma_persistent`` its launch
on at most ``IMMA_BLOCKS_PER_SM`` blocks per SM, each with an equal share of the groups, each warp streaming its
loads across the block's groups and staging x once for all of them (its own entry, ``imma_multi``),
and ``imma_w4`` and ``imma_w16``, ``imma``'s kernels on blocks of 4 and 16 warps (entries ``imma4`` and
``imma16``; a group's steps split over fewer or more warps, so their sums run in another order), with
``imma_persistent_w4`` the 4-warp kernels launched as ``imma_persistent`` (entry ``imma4_multi``, on
``IMMA_W4_BLOCKS_PER_SM`` blocks per SM; ``imma_w4``'s bits).
``gemv_applies`` says whether the
loaded kernels can take a product with a kind (else the caller runs the Triton kernels); ``gemv``
launches it. With ``norm`` (``NormPrologue``) the row it multiplies is rms_norm(x + delta) * weight,
computed by every block first (a decoder layer's add + RMSNorm and the projection after it, in one
launch: the ``_norm`` entry points). Which runs a shape is the autotune pass's choice (``LinearConfig.native``, checked
against the Triton kernel's result first); untuned, the CUDA backend runs ``gemv`` for quantized
weights only. ``gemv_argmax`` runs the imma kinds as the greedy LM head (``_argmax`` entries: each
block keeps its output group's largest fp32 logit and its row, and ``merge_tile_argmax`` takes the
row's argmax over those), where autotune chose one for the LM head. The launch goes on torch's
current stream, so it is captured into CUDA graphs like any other kernel.
"""

from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass, replace

import torch

from mgx.kernels.triton._common import num_sms
from mgx.kernels.triton.linear import GpuWeight
from mgx.kernels.triton.lm_head import ArgmaxMergeConfig, merge_tile_argmax

from .rmsnorm import KERNEL_ABI, CudaKernels

__all__ = ["ARGMAX_ENTRIES", "ARGMAX_LABEL", "ENTRIES", "KINDS", "LABELS", "MAX_NORM_K", "NATIVE_TOLERANCE", "NORM_ENTRIES", "ROWS", "NormPrologue", "argmax_groups", "block_threads", "entry_for",
           "equal_shares", "gemv", "gemv_applies", "gemv_argmax", "gemv_staged", "gemv_threads", "native_error", "native_error_text", "norm_blocks_per_sm", "norm_most",
           "relative_error", "run_native", "NORM_STAGE_ENTRIES", "norm_stage", "norm_stage_applies", "STAGED_ENTRIES", "STAGED_KINDS", "STAGED_SCHEMES", "STAGE_ENTRIES", "stage_x", "staged_applies", "staged_bytes", "HALF_SCALES_MARKER", "TILE16_MARKER", "half_scales_hold", "reads_half_scales", "reads_tile16", "scale_pairs",
           "FIXED_ONE", "FUSED_MLP_ENTRY", "NORM_STAGE_FX_ENTRY", "fixed_rows", "fixed_to", "fused_mlp", "fused_mlp_applies", "fused_mlp_blocks",
           "fused_mlp_args", "fused_mlp_shared", "norm_stage_fx"]  # fmt: skip

KINDS = ("gemv", "mma", "mma_persistent", "mma_pipelined", "imma", "imma_persistent", "imma_w4", "imma_w16",
         "imma_persistent_w4")
# kind -> the entry it launches (ENTRIES' first key)
_ENTRY_KIND = {"gemv": "gemv", "mma": "mma", "mma_persistent": "mma", "mma_pipelined": "mma_pipe", "imma": "imma",
               "imma_persistent": "imma_multi", "imma_w4": "imma4", "imma_w16": "imma16", "imma_persistent_w4": "imma4_multi"}
# the tensor-core entries: 16 outputs a block, 128-column steps
_MMA = ("mma", "mma_pipe", "imma", "imma_multi", "imma4", "imma16", "imma4_multi")
ENTRIES = {  # (kind, scheme) -> entry point
    ("gemv", "int4"): f"mgx_gemv_int4_bf16_v{KERNEL_ABI}",
    ("gemv", "w8a16"): f"mgx_gemv_w8a16_bf16_v{KERNEL_ABI}",
    ("gemv", "none"): f"mgx_gemv_bf16_bf16_v{KERNEL_ABI}",
    ("mma", "int4"): f"mgx_gemv_int4_mma_bf16_v{KERNEL_ABI}",
    ("mma_pipe", "int4"): f"mgx_gemv_int4_mma_pipe_bf16_v{KERNEL_ABI}",
    ("mma", "w8a16"): f"mgx_gemv_w8a16_mma_bf16_v{KERNEL_ABI}",
    ("mma_pipe", "w8a16"): f"mgx_gemv_w8a16_mma_pipe_bf16_v{KERNEL_ABI}",
    ("imma", "w8a16"): f"mgx_gemv_w8a16_imma_bf16_v{KERNEL_ABI}",
    ("imma", "int4"): f"mgx_gemv_int4_imma_bf16_v{KERNEL_ABI}",
    ("imma_multi", "w8a16"): f"mgx_gemv_w8a16_imma_multi_bf16_v{KERNEL_ABI}",
    ("imma_multi", "int4"): f"mgx_gemv_int4_imma_multi_bf16_v{KERNEL_ABI}",
    ("imma4", "w8a16"): f"mgx_gemv_w8a16_imma4_bf16_v{KERNEL_ABI}",
    ("imma4", "int4"): f"mgx_gemv_int4_imma4_bf16_v{KERNEL_ABI}",
    ("imma16", "w8a16"): f"mgx_gemv_w8a16_imma16_bf16_v{KERNEL_ABI}",
    ("imma16", "int4"): f"mgx_gemv_int4_imma16_bf16_v{KERNEL_ABI}",
    ("imma4_multi", "w8a16"): f"mgx_gemv_w8a16_imma4_multi_bf16_v{KERNEL_ABI}",
    ("imma4_multi", "int4"): f"mgx_gemv_int4_imma4_multi_bf16_v{KERNEL_ABI}",
}
NORM_ENTRIES = {key: name.replace(f"_v{KERNEL_ABI}", f"_norm_v{KERNEL_ABI}") for key, name in ENTRIES.items()}
# The greedy LM head on the imma kinds (``gemv_argmax``): each output group's largest logit and its id.
ARGMAX_ENTRIES = {key: name.replace(f"_bf16_v{KERNEL_ABI}", f"_argmax_v{KERNEL_ABI}")
                  for key, name in ENTRIES.items() if key[0].startswith("imma")}  # fmt: skip
ARGMAX_LABEL = "greedy LM head on the integer tensor cores"  # the kernel note's name for them
LABELS = {  # how the engine's kernel note names them
    ("gemv", "int4"): "int4 GEMV",
    ("gemv", "w8a16"): "w8a16 GEMV",
    ("gemv", "none"): "bf16 GEMV",
    ("mma", "int4"): "int4 tensor-core GEMV",
    ("mma_pipe", "int4"): "pipelined int4 tensor-core GEMV",
    ("mma", "w8a16"): "w8a16 tensor-core GEMV",
    ("mma_pipe", "w8a16"): "pipelined w8a16 tensor-core GEMV",
    ("imma", "w8a16"): "w8a16 integer tensor-core GEMV",
    ("imma", "int4"): "int4 integer tensor-core GEMV",
    ("imma_multi", "w8a16"): "w8a16 integer tensor-core GEMV over several groups a block",
    ("imma_multi", "int4"): "int4 integer tensor-core GEMV over several groups a block",
    ("imma4", "w8a16"): "w8a16 integer tensor-core GEMV on 4 warps a block",
    ("imma4", "int4"): "int4 integer tensor-core GEMV on 4 warps a block",
    ("imma16", "w8a16"): "w8a16 integer tensor-core GEMV on 16 warps a block",
    ("imma16", "int4"): "int4 integer tensor-core GEMV on 16 warps a block",
    ("imma4_multi", "w8a16"): "w8a16 integer tensor-core GEMV on 4 warps a block over several groups",
    ("imma4_multi", "int4"): "int4 integer tensor-core GEMV on 4 warps a block over several groups",
}
# x staged once for every block (gemv.cu: imma_stage_rows and the kStaged entries; 26th session, an
# experiment not yet run on a GPU and taken by no model): ``stage_x`` writes a row's record, and
# ``gemv_staged`` runs a kind's twin that loads each step's B words, factor and sum X from it instead
# of staging x in every block (about 190 -> 140 SASS instructions an int4 step on sm_90a). The same
# bits as the kind itself.
STAGED_KINDS = ("imma", "imma_w4", "imma_w16")
STAGED_ENTRIES = {(kind, scheme): ENTRIES[_ENTRY_KIND[kind], scheme].replace(f"_bf16_v{KERNEL_ABI}", f"_staged_bf16_v{KERNEL_ABI}")
                  for kind in STAGED_KINDS for scheme in ("int4", "w8a16")}  # fmt: skip
_STAGED = {(_ENTRY_KIND[kind], scheme): name for (kind, scheme), name in STAGED_ENTRIES.items()}  # as _launch looks up
# Weights whose projections after an add + RMSNorm the CUDA backend runs on the staged twin by default
# at batch 1 (its ``_norm_stage_into_gemv``; the autotune pass times them so). On the H200 (27th
# session, 8B shape, tuned kinds) the INT4 batch-1 graph took 1.861 ms staged against 1.924 unstaged;
# the W8A16 layer chain was slower staged (2.353 against 2.311 ms), so W8A16 stays unstaged unless
# MGX_CUDA_STAGED_X=1.
STAGED_SCHEMES = frozenset({"int4"})
STAGE_ENTRIES = {"int4": f"mgx_imma_stage_int4_v{KERNEL_ABI}", "w8a16": f"mgx_imma_stage_w8a16_v{KERNEL_ABI}"}
STAGE_WARPS = 4  # kStageWarps in gemv.cu: warps (steps) a block of the stage kernel
# The RMSNorm that also writes the record (``norm_stage``: one kernel instead of the norm's and the stage's).
NORM_STAGE_ENTRIES = {"int4": f"mgx_norm_stage_int4_v{KERNEL_ABI}", "w8a16": f"mgx_norm_stage_w8a16_v{KERNEL_ABI}"}
MMA_ROWS = 16  # outputs per block of the tensor-core kernel (8 gate/up pairs with silu_mul)
MMA_THREADS = 256  # kMmaWarps * 32 in gemv.cu
IMMA_THREADS = 256  # kImmaWarps * 32 in gemv.cu (kinds imma and imma_persistent)
_IMMA_WARPS = {"imma4": 4, "imma16": 16, "imma4_multi": 4}  # the entries of other block sizes
MMA_COLUMNS = 128  # columns per MMA step: K and the int4 group (W8A16: none, 0) must be multiples of it
_WORD_BYTES = {"int4": 4, "w8a16": 8, "none": 16}  # bytes of weight per 8 columns
ROWS = 4  # kRows in gemv.cu: outputs per block (2 gate/up pairs with silu_mul)
UNROLL = 4  # kUnroll in gemv.cu
MAX_THREADS = 256  # kMaxThreads in gemv.cu
MAX_NORM_K = 8192  # the widest row the RMSNorm prologue normalizes (2 bytes a column of shared memory)
# Warps an SM of a _norm launch: each block normalizes the row once and then takes output groups
# b, b + grid, ... (one block per group would repeat the prologue thousands of times). Four blocks of
# 8 warps until the nineteenth session, whatever a block's warps: imma_w4's norm launches then ran 16
# warps an SM where its plain ones run 32, which may be why the prologue lost in the 8B graphs
# (INT4 3.33 vs 2.11 ms with gate/up on imma_w4); now the warps are kept (norm_blocks_per_sm).
NORM_WARPS_PER_SM = 32
# Kind ``mma`` without a prologue: one block per group of 16 outputs; ``mma_persistent``:
# MMA_BLOCKS_PER_SM blocks per SM, each taking groups b, b + grid, ... and prefetching ahead into L2.
# Autotune times both and stores the faster per shape (on the H200 it took mma_persistent for 1 of 4
# int4 shapes at 1B and 8B; every mma launch made persistent was 7% (1B) and 14% (8B) slower).
MMA_BLOCKS_PER_SM = 2  # 80 registers a thread (sm_90a): up to three blocks of 256 threads fit an SM
# Kind ``imma_persistent``: 64-76 registers a thread (sm_90a), three blocks fit; three measured best of
# 2-6 on the H200 (a variant of the kernel, 2026-12-01). The grid gives every block the same share of
# the groups (``equal_shares``): the fewest blocks with the share this many blocks an SM would take.
IMMA_BLOCKS_PER_SM = 3
# Kind ``imma_persistent_w4``: blocks of 4 warps, 72 registers a thread for int4 (sm_90a), so seven fit
# an SM by registers (and by shared memory: 19 KB a block).
IMMA_W4_BLOCKS_PER_SM = 7
_EQUAL_SHARES = {"imma_persistent": IMMA_BLOCKS_PER_SM, "imma_persistent_w4": IMMA_W4_BLOCKS_PER_SM}  # kind -> blocks an SM


@dataclass(frozen=True, slots=True)
class NormPrologue:
    """The GEMV multiplies rms_norm(x + delta) * weight (transformers' roundings, as ``rms_norm``)
    instead of x: ``delta`` None adds nothing; ``weight`` None multiplies by nothing; ``total``
    receives x + delta (required with delta, and neither x nor delta). All bf16 [1, K] (weight [K])."""

    delta: torch.Tensor | None
    weight: torch.Tensor | None
    eps: float
    total: torch.Tensor | None = None

    def applies(self, x: torch.Tensor) -> bool:
        """Whether the prologue can read these operands next to the row x [1, K]."""
        k = x.shape[1]
        if k > MAX_NORM_K or (self.delta is None) != (self.total is None):
            return False
        for t in (self.delta, self.weight, self.total):
            if t is not None and (t.dtype != torch.bfloat16 or t.numel() != k or not t.is_contiguous()
                                  or t.device != x.device or t.data_ptr() % 16):  # fmt: skip
                return False
        return self.total is None or all(
            t is None or self.total.untyped_storage().data_ptr() != t.untyped_storage().data_ptr() for t in (x, self.delta)
        )


def equal_shares(groups: int, most: int) -> int:
    """Blocks for ``groups`` output groups taken b, b + grid, ... by at most ``most`` blocks: the fewest
    that keep the largest share (so every block takes the same number of groups, the last ones at
    most one fewer, and none runs on alone at the end), unless that leaves fewer than 3/4 of ``most``
    (say 397 groups: 199 blocks of two), where ``most`` blocks run and a few take one group more."""
    share = -(-groups // most)
    even = -(-groups // share)
    return even if 4 * even >= 3 * most else min(groups, most)


NATIVE_TOLERANCE = 1e-2  # relative error (over the output) a native kind may show against the Triton GEMV


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in float64 (inf where got is not finite): how the autotune pass and
    ``mgx-run tune`` check a native kind's result against the Triton kernel's before timing it."""
    got, want = got.double(), want.double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30)) if bool(got.isfinite().all()) else float("inf")


def native_error(
    x: torch.Tensor,
    w: GpuWeight,
    bias: torch.Tensor | None,
    *,
    kernels: CudaKernels,
    kind: str,
    want: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    silu_mul: bool = False,
    argmax: bool = False,
) -> float:
    """How far ``kind``'s result on the row x is from ``want``, the Triton kernel's (what the autotune
    pass and ``mgx-run tune`` check before timing a kind; at most NATIVE_TOLERANCE passes):
    ``relative_error`` of the outputs, or with ``argmax`` (want: the Triton head's ids and logits) of
    the logits where ``gemv_argmax`` picks the same token, else inf."""
    got = run_native(x, w, bias, kernels=kernels, kind=kind, silu_mul=silu_mul, argmax=argmax)
    if argmax:
        return relative_error(got[1], want[1]) if torch.equal(got[0], want[0]) else float("inf")
    return relative_error(got, want)


def run_native(
    x: torch.Tensor,
    w: GpuWeight,
    bias: torch.Tensor | None = None,
    *,
    kernels: CudaKernels,
    kind: str,
    silu_mul: bool = False,
    argmax: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``kind`` on the row x as the autotune pass and ``mgx-run tune`` check and time it: the greedy
    LM head (``gemv_argmax``) with ``argmax``, else ``gemv``."""
    if argmax:
        return gemv_argmax(x, w, bias, kernels=kernels, kind=kind)
    return gemv(x, w, bias, kernels=kernels, silu_mul=silu_mul, kind=kind)


def native_error_text(err: float, argmax: bool = False) -> str:
    """How reports name a rejected kind's ``native_error``."""
    return "another token than the Triton head's" if argmax and err == float("inf") else f"relative error {err:.1e}"


def norm_blocks_per_sm(kind: str, k: int, resident: int) -> int:
    """Blocks an SM of ``kind``'s _norm launch on K columns: NORM_WARPS_PER_SM warps' worth (8 blocks
    of 4 warps, 4 of 8, 2 of 16), but no more than an SM holds at once (``resident``: the driver's
    count for the entry), so that no block waits for a second wave with its whole share."""
    return max(1, min(NORM_WARPS_PER_SM // max(1, block_threads(kind, k) // 32), resident))


def norm_most(kernels: CudaKernels, kind: str, scheme: str, k: int, device: torch.device) -> int:
    """The most blocks of ``kind``'s _norm launch for ``scheme`` on K columns (gemv takes
    ``equal_shares`` of its groups on them)."""
    entry, threads = NORM_ENTRIES[_ENTRY_KIND[kind], scheme], block_threads(kind, k)
    return norm_blocks_per_sm(kind, k, kernels.module.max_blocks_per_sm(entry, threads, 2 * k)) * num_sms(device)


def entry_for(kind: str, scheme: str, norm: bool = False, argmax: bool = False) -> str | None:
    """The entry point ``kind`` launches for ``scheme`` (its ``_norm`` twin with ``norm``, its greedy
    LM head with ``argmax``); None: none."""
    base = _ENTRY_KIND.get(kind)
    return (ARGMAX_ENTRIES if argmax else NORM_ENTRIES if norm else ENTRIES).get((base, scheme))


def gemv_threads(k: int) -> int:
    """Threads per block for K columns: enough that each keeps about UNROLL words of 8 columns per
    row in flight, a power of two from one warp to MAX_THREADS."""
    words = -(-k // 8)
    t = 32
    while t < MAX_THREADS and t * UNROLL < words:
        t *= 2
    return t


def block_threads(kind: str, k: int) -> int:
    """Threads per block of ``kind``'s launch on K columns."""
    base = _ENTRY_KIND[kind]
    if base in _IMMA_WARPS:
        return 32 * _IMMA_WARPS[base]
    if base in _MMA:
        return IMMA_THREADS if base.startswith("imma") else MMA_THREADS
    return gemv_threads(k)


def _sm(arch: str) -> int:
    """80 for "sm_80", 90 for "sm_90a": the code's architecture decides (the MMA kernel traps below sm_80)."""
    m = re.match(r"sm_(\d+)", arch)
    return int(m.group(1)) if m else 0


def gemv_applies(
    kernels: CudaKernels | None,
    x: torch.Tensor,
    w: GpuWeight,
    bias: torch.Tensor | None = None,
    kind: str = "gemv",
    norm: NormPrologue | None = None,
    argmax: bool = False,
) -> bool:
    """Whether ``gemv`` of ``kind`` runs x @ W^T here: loaded kernels holding its entry for the scheme,
    one bf16 row on their device, int4 (groups of 8 or more; the ``mma`` kinds: of a multiple of 128
    and K too), w8a16 (the ``mma`` kinds: K a multiple of 128) or bf16 weights in the row-major layout
    (the imma kinds of a MGX_IMMA_TILE16 build: int4 and w8a16 in cuda_tile16 only), K % 8 == 0, and the aligned rows the kernel's vector
    loads need; with ``norm``, its entry point too and operands it can read; with ``argmax``, whether
    ``gemv_argmax`` does (the imma kinds, no prologue)."""
    base = _ENTRY_KIND.get(kind)
    if argmax and norm is not None:
        return False
    entry = entry_for(kind, w.scheme, norm is not None, argmax)
    if kernels is None or entry is None or not kernels.has(entry):
        return False
    if w.layout != ("cuda_tile16" if base.startswith("imma") and reads_tile16(kernels, w.scheme) else "row_major"):
        return False  # the imma kinds of a MGX_IMMA_TILE16 build read int4 and W8A16 in cuda_tile16 only
    if w.scheme == "int4" and base.startswith("imma") and reads_half_scales(kernels) and w.pairs is None:
        return False  # those of a MGX_IMMA_HALF_SCALES build read int4 scales from GpuWeight.pairs only
    if not _one_row(kernels, x) or w.k % 8 or x.shape[1] != w.k:
        return False
    if (w.scheme == "int4" and w.group_size < 8) or (w.scheme == "none" and w.weight.dtype != torch.bfloat16):
        return False
    if base in _MMA and (w.group_size % MMA_COLUMNS or w.k % MMA_COLUMNS or w.weight.data_ptr() % 16
                          or w.weight.stride(0) % 16 or _sm(kernels.arch) < 80):  # fmt: skip
        return False
    if base.startswith("imma") and (w.n * w.weight.stride(0) * w.weight.element_size() >= 1 << 31
                                    or (w.scales is not None and w.n * w.scales.stride(0) >= 1 << 31)):
        return False  # offsets past 2^31 (gemv.cu takes them in 32 bits)
    word = _WORD_BYTES[w.scheme]
    if w.weight.data_ptr() % word or (w.weight.stride(0) * w.weight.element_size()) % word:
        return False
    if w.scales is not None and (w.scales.stride(-1) != 1 or (w.zeros is not None and w.zeros.stride(-1) != 1)):
        return False
    if norm is not None and not norm.applies(x):
        return False
    return bias is None or (bias.dtype == torch.bfloat16 and bias.is_contiguous())


def gemv(
    x: torch.Tensor,
    w: GpuWeight,
    bias: torch.Tensor | None = None,
    *,
    kernels: CudaKernels,
    silu_mul: bool = False,
    out: torch.Tensor | None = None,
    kind: str = "gemv",
    norm: NormPrologue | None = None,
) -> torch.Tensor:
    """x [1, K] @ W[N, K]^T (+ bias) -> [1, N] bf16; with ``silu_mul`` W holds gate rows then up rows
    and the result is silu(gate) * up, [1, N/2]; with ``norm``, rms_norm(x + norm.delta) * norm.weight
    takes x's place. The caller checks ``gemv_applies`` first."""
    out = _out_row(w, silu_mul, out, x.device)
    _launch(x, w, bias, kernels, kind, out, silu_mul, norm, ENTRIES)
    return out


def argmax_groups(w: GpuWeight) -> int:
    """How many output groups ``gemv_argmax`` leaves a best logit for: the merge's row length."""
    return -(-w.n // MMA_ROWS)


def gemv_argmax(
    x: torch.Tensor, w: GpuWeight, bias: torch.Tensor | None = None, *, kernels: CudaKernels, kind: str,
    merge: ArgmaxMergeConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The greedy LM head for one row on an imma ``kind``: (ids [1] int32, their logits [1] fp32), the
    argmax over x [1, K] @ W[V, K]^T (+ bias) in fp32 with the smallest id on ties, as
    ``lm_head_argmax``; the logits never reach memory (each block keeps its group's best, and
    ``merge_tile_argmax`` reduces those, launched with ``merge``). The caller checks
    ``gemv_applies(..., argmax=True)`` first."""
    groups = argmax_groups(w)
    part = torch.empty(2 * groups, dtype=torch.float32, device=x.device)
    _launch(x, w, bias, kernels, kind, part, False, None, ARGMAX_ENTRIES)
    return merge_tile_argmax(part[:groups].view(1, groups), part[groups:].view(torch.int32).view(1, groups),
                             config=merge)  # fmt: skip


def staged_bytes(k: int) -> int:
    """Bytes of a row of K columns staged by ``stage_x``: per 128-column step, 32 lanes' 16 bytes of B
    words, then per step the factor and sum X (two fp32)."""
    return (k // MMA_COLUMNS) * (32 * 16 + 8)


def staged_applies(kernels: CudaKernels | None, x: torch.Tensor, w: GpuWeight, kind: str,
                   bias: torch.Tensor | None = None) -> bool:  # fmt: skip
    """Whether ``stage_x`` and ``gemv_staged`` of ``kind`` run x @ W^T (+ bias) here: ``kind`` has a
    staged twin among the loaded kernels, with the stage entry of the scheme, and takes the product itself."""
    return (kind in STAGED_KINDS and w.scheme in STAGE_ENTRIES and kernels is not None
            and kernels.has(STAGED_ENTRIES[kind, w.scheme]) and kernels.has(STAGE_ENTRIES[w.scheme])
            and gemv_applies(kernels, x, w, bias, kind=kind))  # fmt: skip


def stage_x(x: torch.Tensor, scheme: str, *, kernels: CudaKernels, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [1, K] bf16 (K % 128 == 0) staged for ``gemv_staged`` on ``scheme``'s weights: a uint8 record of
    ``staged_bytes(K)``, on torch's current stream (captured into CUDA graphs like the GEMV)."""
    k = x.shape[1]
    rec = torch.empty(staged_bytes(k), dtype=torch.uint8, device=x.device) if out is None else out
    steps = k // MMA_COLUMNS
    stream = torch.cuda.current_stream(x.device).cuda_stream
    args = [_ptr(rec), _ptr(x), ctypes.c_int(k)]
    kernels.module.launch(STAGE_ENTRIES[scheme], (-(-steps // STAGE_WARPS),), (32 * STAGE_WARPS,), args, stream,
                          shared_bytes=0, overlap=kernels.overlap)  # fmt: skip
    return rec


def norm_stage_applies(kernels: CudaKernels | None, x: torch.Tensor, norm: NormPrologue, scheme: str) -> bool:
    """Whether ``norm_stage`` takes the row x [1, K] with ``norm``'s operands for ``scheme``'s staged GEMVs."""
    return (scheme in NORM_STAGE_ENTRIES and kernels is not None and kernels.has(NORM_STAGE_ENTRIES[scheme])
            and _one_row(kernels, x) and x.shape[1] % MMA_COLUMNS == 0 and norm.applies(x))  # fmt: skip


def norm_stage(
    x: torch.Tensor, norm: NormPrologue, scheme: str, *, kernels: CudaKernels, out: torch.Tensor | None = None,
    rec: torch.Tensor | None = None, blocks: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """rms_norm(x + norm.delta) * norm.weight of the row x [1, K] (``NormPrologue``'s roundings; x +
    delta to ``norm.total``) and its record for ``gemv_staged`` on ``scheme``'s weights, in one kernel:
    (the normalized row [1, K] bf16, the record, which is ``stage_x`` of that row to the bit). Each of
    ``blocks`` blocks (default: enough for one 128-column step a warp) normalizes the whole row and
    stages its share of the steps; the result does not depend on how many. The caller checks
    ``norm_stage_applies`` first."""
    k = x.shape[1]
    if blocks is None:
        blocks = -(-(k // MMA_COLUMNS) // (MAX_THREADS // 32))
    elif blocks < 1:
        raise ValueError(f"norm_stage needs at least one block, not {blocks}")
    out = torch.empty_like(x) if out is None else out
    rec = torch.empty(staged_bytes(k), dtype=torch.uint8, device=x.device) if rec is None else rec
    args = [_ptr(out), _ptr(norm.total), _ptr(x), _ptr(norm.delta), _ptr(norm.weight), ctypes.c_float(norm.eps),
            _ptr(rec), ctypes.c_int(k)]  # fmt: skip
    stream = torch.cuda.current_stream(x.device).cuda_stream
    kernels.module.launch(NORM_STAGE_ENTRIES[scheme], (blocks,), (MAX_THREADS,), args, stream, shared_bytes=2 * k,
                          overlap=kernels.overlap)  # fmt: skip
    return out, rec


def gemv_staged(
    rec: torch.Tensor,
    w: GpuWeight,
    bias: torch.Tensor | None = None,
    *,
    kernels: CudaKernels,
    kind: str,
    silu_mul: bool = False,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``gemv`` of ``kind`` on the row that ``stage_x`` staged into ``rec`` (for W's scheme): the same
    result, to the bit. The caller checks ``staged_applies`` first."""
    out = _out_row(w, silu_mul, out, rec.device)
    _launch(rec, w, bias, kernels, kind, out, silu_mul, None, _STAGED)
    return out


# A MGX_IMMA_TILE16 build of gemv.cu (the cuda_kernels pass's, for an artifact whose int4 or W8A16
# weights are in the cuda_tile16 layout): its imma kinds read those schemes' codes in that layout only.
TILE16_MARKER = f"mgx_imma_tile16_v{KERNEL_ABI}"


def reads_tile16(kernels: CudaKernels, scheme: str) -> bool:
    """Whether the imma kinds of ``kernels`` read ``scheme``'s codes in the cuda_tile16 layout."""
    return scheme in ("int4", "w8a16") and kernels.has(TILE16_MARKER)


# An MGX_IMMA_HALF_SCALES build of gemv.cu (the cuda_kernels pass asks for it where every int4 weight's
# scales are fp16 values): its int4 imma kinds read a weight's scales and zeros from ``GpuWeight.pairs``,
# which ``scale_pairs`` builds when the weight is uploaded, and run only on weights that carry it.
HALF_SCALES_MARKER = f"mgx_imma_half_scales_v{KERNEL_ABI}"
_IMMA_BASES = ("imma", "imma_multi", "imma4", "imma16", "imma4_multi")


def reads_half_scales(kernels: CudaKernels | None) -> bool:
    """Whether the int4 imma kinds of ``kernels`` read their scales and zeros from ``GpuWeight.pairs``."""
    return kernels is not None and kernels.has(HALF_SCALES_MARKER)


def half_scales_hold(w: GpuWeight) -> bool:
    """Whether ``scale_pairs`` takes ``w``: int4, groups of a multiple of 128 columns, every scale an fp16
    value (a device check: one sync)."""
    if w.scheme != "int4" or w.group_size % MMA_COLUMNS or w.k % MMA_COLUMNS or w.scales is None:
        return False
    return bool(torch.equal(w.scales.to(torch.float16).float(), w.scales))


def scale_pairs(w: GpuWeight, silu_mul: bool) -> GpuWeight:
    """``w`` with ``pairs``: its int4 scales and zeros as float16 [B, G, 8, 4], at [b, j, g] the scale and
    zero of rows lo and hi of the imma kinds' output group b (``gemv_imma``'s row_lo and row_hi: 16 rows
    a group, lo = 16 b + g and hi = lo + 8; with ``silu_mul`` 8 outputs a group, lo = 8 b + g a gate row
    and hi = F + lo its up row; clamped past the end) for group j of columns; zeros 8 when symmetric.
    Raises ``ValueError`` where ``half_scales_hold`` does not (fp16 would change a scale)."""
    if not half_scales_hold(w):
        raise ValueError(f"no fp16 scale pairs for {w.scheme} g{w.group_size} K={w.k}: they need int4 groups "
                         "of a multiple of 128 columns and scales that are fp16 values")  # fmt: skip
    if silu_mul and w.n % 2:
        raise ValueError(f"fused gate/up width {w.n} is odd")
    n_out = w.n // 2 if silu_mul else w.n
    per = 8 if silu_mul else 16
    dev = w.weight.device
    b, g = torch.arange(-(-n_out // per), device=dev)[:, None], torch.arange(8, device=dev)[None, :]
    lo = torch.clamp(b * per + g, max=n_out - 1)
    hi = n_out + lo if silu_mul else torch.clamp(b * 16 + g + 8, max=w.n - 1)
    z = torch.full_like(w.scales, 8.0) if w.symmetric else w.zeros.float()
    parts = [w.scales[lo], z[lo], w.scales[hi], z[hi]]  # each [B, 8, G]
    pairs = torch.stack(parts, dim=-1).permute(0, 2, 1, 3).to(torch.float16).contiguous()  # [B, G, 8, 4]
    return replace(w, pairs=pairs, pairs_silu=silu_mul)


def _out_row(w: GpuWeight, silu_mul: bool, out: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """``out``, or a new bf16 row for the GEMV's outputs ([1, N], or [1, N/2] with the SiLU product)."""
    if silu_mul and w.n % 2:
        raise ValueError(f"fused gate/up width {w.n} is odd")
    return torch.empty((1, w.n // 2 if silu_mul else w.n), dtype=torch.bfloat16, device=device) if out is None else out


def _ptr(t: torch.Tensor | None) -> ctypes.c_void_p:
    """A tensor's device address as a kernel argument (null for None)."""
    return ctypes.c_void_p(t.data_ptr() if t is not None else None)


def _one_row(kernels: CudaKernels, x: torch.Tensor) -> bool:
    """Whether x is one bf16 row on the kernels' GPU, contiguous and 16-byte aligned (what the native
    kernels' vector loads of x need)."""
    return (x.dim() == 2 and x.shape[0] == 1 and x.dtype == torch.bfloat16 and x.is_cuda
            and x.device.index == kernels.device and x.stride(1) == 1 and x.data_ptr() % 16 == 0)  # fmt: skip


def _launch(
    x: torch.Tensor,
    w: GpuWeight,
    bias: torch.Tensor | None,
    kernels: CudaKernels,
    kind: str,
    out: torch.Tensor,
    silu_mul: bool,
    norm: NormPrologue | None,
    entries: dict[tuple[str, str], str],
) -> None:
    """Launch ``kind``'s entry of ``entries`` (its _norm twin with ``norm``) writing ``out``."""
    n_out = w.n // 2 if silu_mul else w.n
    base = _ENTRY_KIND[kind]
    rows = MMA_ROWS if base in _MMA else ROWS
    per_block = rows // 2 if silu_mul else rows
    threads = block_threads(kind, w.k)

    silu_f = ctypes.c_int(n_out if silu_mul else 0)
    n, k = ctypes.c_int(w.n), ctypes.c_int(w.k)
    stride_w = ctypes.c_longlong(w.weight.stride(0) * w.weight.element_size())  # bytes
    if w.scheme == "int4":
        group_shift = w.group_size.bit_length() - 1
        args = [_ptr(out), _ptr(x), _ptr(w.weight), _ptr(w.scales), _ptr(None if w.symmetric else w.zeros), _ptr(bias),
                n, k, stride_w, ctypes.c_longlong(w.scales.stride(0)), ctypes.c_int(group_shift), silu_f]  # fmt: skip
    elif w.scheme == "w8a16":
        args = [_ptr(out), _ptr(x), _ptr(w.weight), _ptr(w.scales), _ptr(bias), n, k, stride_w, silu_f]
    else:
        args = [_ptr(out), _ptr(x), _ptr(w.weight), _ptr(bias), n, k, stride_w, silu_f]
    if w.scheme == "int4" and base in _IMMA_BASES and reads_half_scales(kernels):
        if w.pairs is None or w.pairs_silu != silu_mul:
            raise ValueError(f"this build's int4 imma kinds read scale pairs ordered for {'the SiLU product' if silu_mul else 'plain rows'}; "
                             "the weight has " + ("none" if w.pairs is None else "the other order") + " (gemv.scale_pairs)")  # fmt: skip
        args[3:5] = [_ptr(w.pairs), _ptr(None)]
        args[9] = ctypes.c_longlong(w.pairs.shape[1])  # groups a row
    entry, blocks, shared = entries[base, w.scheme], -(-n_out // per_block), 0
    if norm is not None:  # (out, x) -> (out, total, x, delta, weight, eps)
        entry, shared = NORM_ENTRIES[base, w.scheme], 2 * w.k
        blocks = equal_shares(blocks, norm_most(kernels, kind, w.scheme, w.k, x.device))
        args[1:2] = [_ptr(norm.total), _ptr(x), _ptr(norm.delta), _ptr(norm.weight), ctypes.c_float(norm.eps)]
    elif kind == "mma_persistent":
        blocks = min(blocks, MMA_BLOCKS_PER_SM * num_sms(x.device))
    elif kind in _EQUAL_SHARES:
        blocks = equal_shares(blocks, _EQUAL_SHARES[kind] * num_sms(x.device))
    stream = torch.cuda.current_stream(x.device).cuda_stream
    kernels.module.launch(entry, (blocks,), (threads,), args, stream, shared_bytes=shared, overlap=kernels.overlap)


# The batch-1 int4 MLP in one kernel (gemv.cu's mlp_int4_fused, forty-third session; the CUDA backend
# runs it by default since the forty-fourth, MGX_CUDA_FUSED_MLP=0: not): gate/up with the SiLU product and down from the record
# norm_stage wrote, in a MGX_IMMA_TILE16 + MGX_IMMA_HALF_SCALES build. Its output row is int64
# multiples of 1 / FIXED_ONE, added up over its blocks in L2 (exact in any order: the same bits every
# run), then a flag set where a NaN or Inf was met: ``fixed_rows`` makes zeroed rows, ``norm_stage_fx``
# is the add + RMSNorm (and staging) after it, ``fixed_to`` the row in a float dtype.
FUSED_MLP_ENTRY = f"mgx_mlp_int4_fused_v{KERNEL_ABI}"
FUSED_MLP_THREADS = 16 * 32  # the entry's W warps
NORM_STAGE_FX_ENTRY = f"mgx_norm_stage_fx_int4_v{KERNEL_ABI}"
FIXED_ONE = 2**32
_MAX_STATIC_SHARED = 48 * 1024  # dynamic shared memory a launch takes without the opt-in attribute


def fixed_rows(n: int, device: torch.device | str, count: int = 1) -> torch.Tensor:
    """``count`` zeroed rows [count, n + 2] int64 for ``fused_mlp`` (n values, the non-finite flag, a pad
    keeping each row 16-byte aligned)."""
    return torch.zeros((count, n + 2), dtype=torch.int64, device=device)


def fixed_to(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``fused_mlp``'s rows [R, n + 2] as [R, n] in ``dtype``: each value to the nearest fp32 (as
    ``norm_stage_fx`` reads it), then to ``dtype``; NaN throughout a row whose flag is set."""
    n = rows.shape[-1] - 2
    vals = (rows[..., :n].to(torch.float32) * (1.0 / FIXED_ONE)).to(dtype)
    return torch.where(rows[..., n : n + 1] != 0, torch.full_like(vals, float("nan")), vals)


def fused_mlp_shared(k: int) -> int:
    """Dynamic shared memory of a ``fused_mlp`` launch on K columns: the record, rounded up to 16 bytes."""
    steps = k // MMA_COLUMNS
    return (steps * 32 + (steps + 1) // 2) * 16


def fused_mlp_blocks(gate_up: GpuWeight) -> int:
    """Blocks of a ``fused_mlp`` launch: one per 128 SiLU outputs (a 128-column step of down)."""
    return gate_up.n // 2 // MMA_COLUMNS


def fused_mlp_applies(kernels: CudaKernels | None, x: torch.Tensor, gate_up: GpuWeight, down: GpuWeight) -> bool:
    """Whether ``fused_mlp`` takes the row x [1, K] (whose record ``norm_stage`` writes) through ``gate_up``
    [2F, K] (the SiLU product's) and ``down`` [N, F]: the loaded kernels hold its entry and
    ``norm_stage_fx``'s, read cuda_tile16 codes with scale pairs (pairs in the SiLU order for gate/up),
    int4 groups of the same multiple of 128 columns, F and K multiples of 128, N of 16, offsets below
    2^31, and a record that fits the launch's shared memory."""
    if kernels is None or not (kernels.has(FUSED_MLP_ENTRY) and kernels.has(NORM_STAGE_FX_ENTRY)):
        return False
    if not (_one_row(kernels, x) and reads_tile16(kernels, "int4") and reads_half_scales(kernels)):
        return False
    for w, silu in ((gate_up, True), (down, False)):
        if w.scheme != "int4" or w.layout != "cuda_tile16" or w.pairs is None or w.pairs_silu != silu:
            return False
        if w.n * w.weight.stride(0) >= 1 << 31 or w.weight.data_ptr() % 16:
            return False
    f, k = gate_up.n // 2, gate_up.k
    return (gate_up.group_size == down.group_size and gate_up.group_size % MMA_COLUMNS == 0 and gate_up.n % 2 == 0
            and f % MMA_COLUMNS == 0 and k % MMA_COLUMNS == 0 and down.k == f and down.n % 16 == 0
            and x.shape[1] == k and fused_mlp_shared(k) <= _MAX_STATIC_SHARED and _sm(kernels.arch) >= 80)  # fmt: skip


def fused_mlp(rec: torch.Tensor, gate_up: GpuWeight, down: GpuWeight, *, kernels: CudaKernels,
              out: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """out [n + 2] int64 (zero before; ``fixed_rows``) += down(silu(gate) * up) of the row whose record
    ``rec`` is (``norm_stage``'s or ``stage_x``'s for int4), in fixed point (``fixed_to``). One launch of
    F / 128 blocks on torch's current stream. The caller checks ``fused_mlp_applies`` first."""
    k, n = gate_up.k, down.n
    if out.dtype != torch.int64 or out.numel() != n + 2 or not out.is_contiguous():
        raise ValueError(f"fused_mlp writes an int64 row of {n + 2} (fixed_rows), not {out.dtype} of {out.numel()}")
    stream = torch.cuda.current_stream(rec.device).cuda_stream
    kernels.module.launch(FUSED_MLP_ENTRY, (fused_mlp_blocks(gate_up),), (FUSED_MLP_THREADS,), fused_mlp_args(out, rec, gate_up, down),
                          stream, shared_bytes=fused_mlp_shared(k), overlap=kernels.overlap)  # fmt: skip
    return out


def fused_mlp_args(out: torch.Tensor, rec: torch.Tensor, gate_up: GpuWeight, down: GpuWeight, mode: int = 0,
                   stamps: torch.Tensor | None = None) -> list[ctypes._SimpleCData]:  # fmt: skip
    """The arguments of an ``mlp_int4_fused`` entry (gemv.cu's MGX_MLP_ENTRY_NAMED; the product's and
    examples/mlp_fused.cu's variants), with its timing knobs ``mode`` and ``stamps``."""
    return [_ptr(out), _ptr(rec), _ptr(gate_up.weight), _ptr(gate_up.pairs), _ptr(down.weight), _ptr(down.pairs),
            ctypes.c_int(gate_up.n // 2), ctypes.c_int(gate_up.k), ctypes.c_int(down.n), ctypes.c_int(gate_up.pairs.shape[1]),
            ctypes.c_int(down.pairs.shape[1]), ctypes.c_int(gate_up.group_size.bit_length() - 1), ctypes.c_int(mode),
            _ptr(stamps)]  # fmt: skip


def norm_stage_fx(
    x: torch.Tensor, rows: torch.Tensor, weight: torch.Tensor | None, eps: float, total: torch.Tensor, *,
    kernels: CudaKernels, out: torch.Tensor | None = None, rec: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``norm_stage`` on int4 with the delta ``fused_mlp``'s row ``rows`` [K + 2] (each value rounded to bf16
    as a GEMV's output is; NaN where its flag is set): rms_norm(x + delta) * weight of the row x [1, K],
    x + delta to ``total``, and the record. The caller checks ``norm_stage_applies`` for the bf16 row
    and ``fused_mlp_applies`` (which needs this entry)."""
    k = x.shape[1]
    if rows.dtype != torch.int64 or rows.numel() != k + 2 or not rows.is_contiguous():
        raise ValueError(f"norm_stage_fx reads an int64 row of {k + 2} (fixed_rows), not {rows.dtype} of {rows.numel()}")
    blocks = -(-(k // MMA_COLUMNS) // (MAX_THREADS // 32))
    out = torch.empty_like(x) if out is None else out
    rec = torch.empty(staged_bytes(k), dtype=torch.uint8, device=x.device) if rec is None else rec
    args = [_ptr(out), _ptr(total), _ptr(x), _ptr(rows), _ptr(weight), ctypes.c_float(eps), _ptr(rec), ctypes.c_int(k)]
    stream = torch.cuda.current_stream(x.device).cuda_stream
    kernels.module.launch(NORM_STAGE_FX_ENTRY, (blocks,), (MAX_THREADS,), args, stream, shared_bytes=2 * k,
                          overlap=kernels.overlap)  # fmt: skip
    return out, rec
