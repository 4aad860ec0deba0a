"""The CUDA backend: the Triton kernels of ``mgx.kernels.triton`` on an NVIDIA GPU, torch for memory.

Weights. Every tensor an op reads is copied once from the mapped artifact into one device arena
(256-byte aligned slices): the bytes go through two pinned staging buffers of ``MGX_CUDA_STAGE_MB``
(default 64) in turn, so filling one from the page cache (``MGX_CUDA_UPLOAD_THREADS`` threads, default
up to 8) overlaps the copy of the other on a copy stream; ``upload_stats`` says how many bytes moved at
what rate. Dense weights stored in another
float type than the compute dtype are converted on the device; quantized weights stay as stored
(int8 / int4 codes, float32 scales). Layouts the GPU kernels do not read (``cpu_tile16``) are
unpacked to ``row_major`` on the host first.

Compute dtype: the model's own (the dense weights' float type; bf16 for a fully quantized model),
or ``dtype=`` / ``MGX_CUDA_DTYPE`` (f32, bf16, f16). K/V are cached in the compute dtype.

Fusions, each with the results of running the ops one by one: an ``add`` followed by the
``rms_norm`` of its output is one kernel; a ``linear`` whose output only feeds a one-input
``silu_mul`` (the fused gate/up projection) computes the SiLU product in its epilogue; a ``rope``
whose outputs only feed the ``attention`` op rotates q and k in the same kernel that writes k and v
into the paged cache (the attention prologue). With ``MGX_CUDA_NORM_GEMV=1``, at batch 1, where
the artifact's native GEMVs take the projection, an ``add`` and the ``rms_norm`` after it run in the
prologue of the GEMV that reads the norm (``NormPrologue``) instead of a kernel of their own. Off by
default: on the H200 the batch-1 graphs were slower with it (8B bf16 4.88 vs 4.80 ms, INT4 3.68 vs
3.46 ms; 1B bf16 and W8A16 too; only 1B INT4 gained, 0.86 vs 0.93 ms; later INT4 3.33 vs 2.11 ms,
when its launches ran imma_w4 at half occupancy, fixed in the nineteenth session, not re-measured). At
batch 1, an add and the RMSNorm after it that feed an INT4 projection on an imma kind run as
``norm_stage``, which also stages the normalized row once for every block, and the projection runs
the kind's staged twin on that record (``gemv_staged``; ``STAGED_SCHEMES`` says what it gained).
``MGX_CUDA_STAGED_X=1`` does so for W8A16 too, a kind's name (``imma``, ``imma_w4``, ``imma_w16``)
forces that kind, ``=0`` turns it off. On sm_90 and newer the
decode-path kernels are launched overlapped (programmatic dependent launches; the Triton linear,
decode attention and LM head kernels and the native ones): each may start while the kernel before it
finishes and waits for it before reading its output or writing anything (``overlap_launches``;
``MGX_CUDA_PDL=0`` turns it off). Where a ``linear`` feeds an ``add`` whose ``rms_norm`` feeds one
``linear`` that runs as the Triton one-row GEMV, the add and the norm have no kernel of their own:
the first projection adds the residual in its epilogue and stores its rows' partial sums of squares
(``linear_add_squares``), the second normalizes x as it loads it (``linear(norm=)``;
``MGX_CUDA_NORM_ACROSS=0`` turns it off). Only where the second one's weights are INT4
(``NORM_IN_SCHEMES``): on the H200 the 8B W8A16 graph took 3.98 ms with it against 2.80 ms with the
norm kernels (1B 0.843 vs 0.769), when the W8A16 GEMV normalized x at every weight element it
loaded; normalizing a vector instead, 1B still took 0.738 vs 0.729 ms (eleventh session). Dense
readers lost wherever autotune gave gate/up a one-row GEMV configuration (so that it took the norm):
the 8B bf16 graph took 4.612 ms with it against 4.138 with the norm kernels (fourteenth session;
4.60 vs 4.29 ms twice in the twelfth); where autotune chose the swapped tensor-core tiles it never
ran. ``MGX_CUDA_NORM_ACROSS_W8A16=1`` and ``MGX_CUDA_NORM_ACROSS_DENSE=1`` include those readers,
for these A/Bs.

CUDA graphs: a step of decode rows only (one new token and one sampled row per sequence) runs as a
captured graph for the smallest batch bucket (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256) that
holds it; the rows past the real ones point at a scratch KV block that no sequence owns. A graph
is captured the first time its bucket is needed. A step that prefills one sequence (a prompt, a
chunk of one, or what follows a cached prefix; no other rows) runs as a graph too, padded to the
smallest of ``PREFILL_GRAPH_TOKENS`` that holds it, from the second such step of that bucket on
(the first runs eagerly: a one-off prompt pays for no capture). The padding takes the positions
after the real tokens, so causal attention keeps it out of their rows, and its K/V land in the
sequence's own last block past its end (written again by its next tokens) or in the scratch block.
Fresh prompts attend through SDPA, the others through the paged prefill kernel.
Launched op by op, a 2,048-token prefill of the 1B shape took 19-20 ms of host time on the H200's
host against 7.2 ms of GPU work (24th session). Steps of several sequences (prefill rows with
decode rows) run as graphs per token bucket and sequence capacity (``MIXED_GRAPH_SEQS``), also from
a key's second step on: the real sequences as they are, one more holding the padding rows on the
scratch block, the rest empty; every sequence samples its last row or none. Under 32 requests/s of
the 1B shape they took the median time per output token from 11.5 ms to 1.68 ms (H200, 57th run,
``bench_gpu_model.py --serve``). A capture that runs out of device memory turns its kind off, with
one warning.
``MGX_CUDA_GRAPHS=0`` turns graphs off, ``MGX_CUDA_PREFILL_GRAPHS=0`` the prefill ones,
``MGX_CUDA_MIXED_GRAPHS=0`` the mixed ones.

Steps launched ahead: a greedy decode step's ``launch`` replays its graph and returns; the picks
follow into a pinned slot (read by ``result()``) and stay on the device, where the engine's next
step, launched before the host has read them, takes them as its tokens (``tokens_from``). The GPU
then runs one step while the host handles the one before. ``MGX_CUDA_AHEAD=0`` turns this off.

The same code runs on a CPU device under ``TRITON_INTERPRET=1`` (``device="cpu"``): that is how CI
checks this backend's plumbing without a GPU (no pinned memory, no graphs there).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from mgx.formats import layouts as layout_registry
from mgx.formats.ir import DType, Graph, Op, Tensor
from mgx.kernels.cuda.gemv import (
    ARGMAX_ENTRIES,
    ARGMAX_LABEL,
    STAGED_SCHEMES,
    TILE16_MARKER,
    NormPrologue,
    argmax_groups,
    fixed_rows,
    fixed_to,
    fused_mlp,
    fused_mlp_applies,
    gemv,
    gemv_applies,
    gemv_argmax,
    gemv_staged,
    half_scales_hold,
    norm_stage,
    norm_stage_applies,
    norm_stage_fx,
    reads_half_scales,
    scale_pairs,
    staged_applies,
)
from mgx.kernels.cuda.gemv import ENTRIES as GEMV_ENTRIES
from mgx.kernels.cuda.gemv import LABELS as GEMV_LABELS
from mgx.kernels.cuda.rmsnorm import CudaKernels, arch_runs_on, load_cuda_kernels, rms_norm
from mgx.kernels.triton._common import num_sms, overlapped_launches
from mgx.kernels.triton.attention import (
    SELF_MERGE_MAX_SPLITS,
    DecodeConfig,
    DecodeRope,
    decode_splits,
    new_decode_counters,
    paged_attention_decode,
    paged_attention_prefill,
    write_kv,
)
from mgx.kernels.triton.linear import (
    GEMV_MAX_M,
    SCHEME_IDS,
    SPLIT_MAX_M,
    GpuWeight,
    LinearConfig,
    NormIn,
    default_config,
    dense_product,
    dequantize,
    linear,
    linear_add_squares,
    linear_silu_mul,
    min_block_k,
    new_split_workspace,
    runs_gemv,
    silu_mul,
)
from mgx.kernels.triton.linear import LAYOUTS as GPU_LAYOUTS
from mgx.kernels.triton.lm_head import lm_head_argmax, lm_head_tiles
from mgx.kernels.triton.rope import rope_, rope_and_write_kv
from mgx.kernels.triton.tuning import (
    ARGMAX_MERGE,
    ATTENTION_DECODE,
    ATTENTION_PREFILL,
    DECODE_MERGE,
    DEQUANTIZE,
    EMBEDDING_ROWS,
    ROPE_KV,
    SILU_MUL,
    Tunings,
    attention_signature,
    merge_signature,
    silu_signature,
    weight_signature,
)
from mgx.kernels.triton.weights import TORCH_DTYPES, gpu_arrays, gpu_weight

from .backend import GRAPH_KINDS, Array, AttentionAttrs, Backend, StepResult, picked
from .batch import StepBatch
from .errors import EngineError, UnsupportedModelError
from .kv_cache import KVCache

__all__ = ["CUDABackend", "CudaKVCache", "UploadStats", "GRAPH_BUCKETS", "graph_table_width"]

GRAPH_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256)
# Weight schemes whose Triton one-row GEMV takes an RMSNorm in its loads for ``norm_across`` by
# default; W8A16 and dense readers lost on the H200 (module docstring).
NORM_IN_SCHEMES = frozenset({"int4"})
# Token buckets of the prefill graphs (module docstring): powers of two up to 256, then
# steps of 128 to 512 and of 256 to 4,096, so that padding adds less than half to prompts past 256
# tokens and less than a third past 768.
PREFILL_GRAPH_TOKENS = (16, 32, 64, 128, 256, 384, 512, *range(768, 4097, 256))
# Sequence capacities of the mixed-step graphs (MGX_CUDA_MIXED_GRAPHS=0: off): a step of s sequences
# takes the smallest that holds s + 1 (one sequence holds the padding tokens).
MIXED_GRAPH_SEQS = (4, 8, 16, 32, 64, 128, 256)
GRAPH_MIN_TABLE_BLOCKS = 64  # the narrowest block table a decode graph is captured with
SDPA_MAX_SEQS = 4  # fresh prompts per step that torch's SDPA takes one by one (more: the varlen kernel)
# How fresh prompts reach SDPA's fused kernels, in the order tried: query heads mapped to KV heads by
# SDPA itself, or K and V expanded to every query head first.
SDPA_MODES = ("gqa", "expand")
# How torch says that no enabled SDPA kernel takes the inputs: "No available kernel" (torch 2.13), or,
# with the math fallback disabled, "Invalid backend" (torch 2.11 on an H200: fp32 with enable_gqa).
SDPA_REFUSALS = ("No available kernel", "Invalid backend")

_AUX_ROLES = ("scales", "zeros", "meta")
_ALIGN = 256
_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
# Device memory kept out of the KV budget for activations, graph pools and kernels' scratch.
_RESERVE_BYTES = 2 << 30


def _aligned_ints(n: int) -> int:
    """int32 slots ``n`` values take where the next part must start 16 bytes in."""
    return -(-n // 4) * 4


def graph_table_width(needed: int, max_blocks: int) -> int:
    """Block-table columns of a decode graph for a batch whose longest table has ``needed`` blocks:
    the next power of two from ``GRAPH_MIN_TABLE_BLOCKS`` up, at most the model's whole context.

    A graph spans only the contexts it has met (rounded up), so a replay copies and resets tables
    of that width, not of the model's longest context, and its attention is split for that length;
    a longer batch captures the graph again, at most log2(context / 1024 tokens) times a bucket."""
    width = GRAPH_MIN_TABLE_BLOCKS
    while width < needed:
        width *= 2
    return max(1, min(width, max_blocks))


@dataclass(frozen=True, slots=True)
class UploadStats:
    """How the weights reached the device."""

    bytes: int
    seconds: float
    chunks: int
    pinned: bool

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


class CudaKVCache(KVCache):
    """K/V blocks in device memory, one extra block at the end that padded graph rows write into."""

    def __init__(self, graph: Graph, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(num_blocks, block_size, 0)
        self.scratch_block = num_blocks
        for s in graph.states:
            if s.kind != "kv":
                raise UnsupportedModelError(f"the CUDA backend has no kernel for state kind {s.kind!r}")
            shape = (num_blocks + 1, block_size, s.num_kv_heads, s.head_dim)
            self.k[s.layer] = torch.zeros(shape, dtype=dtype, device=device)
            self.v[s.layer] = torch.zeros(shape, dtype=dtype, device=device)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in [*self.k.values(), *self.v.values()])


@dataclass(slots=True)
class _Step:
    """One step's metadata on the device (static buffers when the step runs as a graph)."""

    token_ids: torch.Tensor  # [T] int64 (int32 in a graph's packed buffer)
    positions: torch.Tensor  # [T] int32
    block_tables: torch.Tensor  # [S, W] int32
    context_lens: torch.Tensor  # [S] int32
    query_start_loc: torch.Tensor  # [S+1] int32
    sample_rows: torch.Tensor  # [R] int64
    max_query_len: int
    max_context_len: int
    decode_splits: int | None = None  # fixed in graphs; None: chosen from max_context_len
    # Graphs only: token ids, positions, context lengths and block tables are views of one device
    # buffer, filled from one pinned host buffer by a single copy per step.
    packed: torch.Tensor | None = None
    host: torch.Tensor | None = None
    # Eager prefill steps whose sequences (at most SDPA_MAX_SEQS) have nothing cached: their
    # query_start_loc on the host. Attention then runs on the new q, k, v directly (``_fresh_attention``).
    fresh: tuple[int, ...] | None = None


@dataclass(slots=True)
class _Graph:
    graph: Any  # torch.cuda.CUDAGraph
    step: _Step
    out: Any  # logits [bucket, V] float32, or (ids [bucket], their logits [bucket]); written by every replay
    free: list[_Slot] = field(default_factory=list)  # host buffers of greedy launches, free again


@dataclass(slots=True)
class _Slot:
    """The pinned host side of one greedy graph launch: its inputs (``_Step.packed``'s layout) and
    picks, and an event recorded once the picks are on the host. A launch holds its slot until its
    picks are read or discarded, so at most the launches in flight have one each."""

    host: torch.Tensor  # int32 like _Step.packed
    ids: torch.Tensor  # [bucket] as the graph's ids
    top: torch.Tensor  # [bucket] as the graph's top logits
    done: Any  # torch.cuda.Event (a stand-in off the GPU)


class _NoEvent:
    """``torch.cuda.Event``'s two calls used here, for a backend off the GPU (tests)."""

    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _GraphResult(StepResult):
    """The picks of a greedy graph launch: on the host once ``done``; on the device until the next launch."""

    __slots__ = ("_graph", "_slot", "_n", "_ids")

    def __init__(self, graph: _Graph, slot: _Slot, n: int, ids: torch.Tensor) -> None:
        super().__init__(None)
        self._graph, self._slot, self._n, self._ids = graph, slot, n, ids

    def result(self) -> Any:
        slot = self._slot
        if slot is not None:
            slot.done.synchronize()
            n = self._n
            # Copies: the slot goes back to its graph for a later launch.
            self._out = (slot.ids[:n].numpy().astype(np.int64), slot.top[:n].float().numpy().copy())
            self._release()
        return self._out

    def device_ids(self) -> Any:
        return self._ids

    def discard(self) -> None:
        self._release()

    def _release(self) -> None:
        if self._slot is not None:
            self._graph.free.append(self._slot)
            self._slot = self._ids = None


@dataclass(slots=True)
class _Fusions:
    norm_after_add: dict[int, Op] = field(default_factory=dict)  # id(add) -> the rms_norm it computes
    silu_after_linear: dict[int, Op] = field(default_factory=dict)  # id(linear) -> the silu_mul it computes
    rope_into_attention: dict[int, Op] = field(default_factory=dict)  # id(rope) -> the attention it joins
    linear_after_norm: dict[int, Op] = field(default_factory=dict)  # id(rms_norm after an add) -> its one reader
    # id(linear) -> (the add reading it alone, that add's rms_norm, the one linear reading the norm)
    norm_across: dict[int, tuple[Op, Op, Op]] = field(default_factory=dict)
    # id(gate/up linear) -> (its silu_mul, the one linear reading that (down), the add reading down alone)
    mlp: dict[int, tuple[Op, Op, Op]] = field(default_factory=dict)


def _fused_row(a: Array, b: Array) -> tuple[Array, Array] | None:
    """(the fused MLP's fixed-point row, the residual) where one input of an add is that row (down's
    output when ``gemv.fused_mlp`` ran it: int64), else None."""
    if b.dtype == torch.int64:
        return b, a
    return (a, b) if a.dtype == torch.int64 else None


@dataclass(frozen=True, slots=True)
class _StagedX:
    """A projection whose x its add + RMSNorm staged (``MGX_CUDA_STAGED_X``): the kind whose staged twin
    runs it, and the record."""

    kind: str
    rec: Array


@dataclass(frozen=True, slots=True)
class _FusedRows:
    """Down's output where the fused MLP ran gate/up and down in one launch (``MGX_CUDA_FUSED_MLP``): its
    fixed-point row (``gemv.fused_mlp``), which the add after it reads."""

    rows: Array


@dataclass(frozen=True, slots=True)
class _Across:
    """A projection held back until its add (``norm_across``): the op, its input (also the stand-in
    value it returned, which the add tells from the residual), its configuration, and the add and the
    linear that reads the add's norm."""

    proj: Op
    x: Array
    config: LinearConfig | None
    add: Op
    reader: Op


class CUDABackend(Backend):
    """Runs a graph with the Triton kernels on one GPU (or, interpreted, on the CPU for tests)."""

    name: ClassVar[str] = "cuda"
    has_greedy_head: ClassVar[bool] = True

    def __init__(
        self, graph: Graph, *, device: str | torch.device | None = None, dtype: str | None = None, graphs: bool | None = None
    ) -> None:
        super().__init__(graph)
        self.device = torch.device(device if device is not None else os.environ.get("MGX_CUDA_DEVICE", "cuda"))
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise UnsupportedModelError("backend 'cuda': torch sees no CUDA device on this host")
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = self._compute_dtype(dtype or os.environ.get("MGX_CUDA_DTYPE"))
        self.kv_itemsize = torch.empty((), dtype=self.dtype).element_size()
        if graphs is None:
            graphs = os.environ.get("MGX_CUDA_GRAPHS", "1") != "0"
        self.use_graphs = bool(graphs) and self.device.type == "cuda"
        # Greedy decode steps replay graphs without waiting for their picks (``launch``), so the
        # engine launches the next one ahead; MGX_CUDA_AHEAD=0 makes it wait for each step.
        self.overlaps_steps = self.use_graphs and os.environ.get("MGX_CUDA_AHEAD", "1") != "0"
        # Decode-only steps: a graph per batch bucket (off for good once a capture runs out of memory).
        self.decode_graphs = self.use_graphs
        # One sequence's prefill alone in a step: a graph per token bucket (MGX_CUDA_PREFILL_GRAPHS=0: eager).
        self.prefill_graphs = self.use_graphs and os.environ.get("MGX_CUDA_PREFILL_GRAPHS", "1") != "0"
        # Several sequences' prefill and decode rows in one step: graphs per token bucket and
        # sequence capacity (MGX_CUDA_MIXED_GRAPHS=0: eager).
        self.mixed_graphs = self.use_graphs and os.environ.get("MGX_CUDA_MIXED_GRAPHS", "1") != "0"
        self._last_launch: StepResult | None = None  # whose device picks are intact
        self._fuse = self._find_fusions()
        # Tensors in a layout the kernels do not read (cpu_tile16) are unpacked and uploaded by
        # _gpu_weight instead; everything else goes up as stored.
        names = sorted({name for op in graph.ops for name in op.weights.values()})
        self._dev, self.upload_stats = self._upload(
            {name: graph.tensors[name] for name in names if graph.tensors[name].layout in GPU_LAYOUTS}
        )
        self._weights: dict[int, GpuWeight] = {}
        self._bias: dict[int, torch.Tensor | None] = {}
        self._norm: dict[int, tuple[torch.Tensor | None, float, int]] = {}
        self._attn: dict[int, AttentionAttrs] = {}
        self._attn_sig: dict[int, str] = {}  # id(attention op) -> its shape as tunings key it
        self._inv_freq: dict[int, tuple[torch.Tensor, int, int, float]] = {}
        for op in graph.ops:
            self._prepare(op)
        # The shape decode attention entries are looked up by, one for every layer: the first layer
        # with the most kv heads, whose count the graphs' splits are computed for.
        self._decode_sig = self._attn_sig[max(self._attn, key=lambda i: self._attn[i].num_kv_heads)] if self._attn else ""
        # The split-K workspace of every linear launch, zeroed now: a graph captured later must
        # find it zeroed on its first replay (zeros written during a capture come only then).
        widest = max((self._weights[id(op)].n for op in graph.ops if op.kind == "linear"), default=1)
        self._split_ws = new_split_workspace(self.device, SPLIT_MAX_M * widest, SPLIT_MAX_M * widest // 4)
        # Decode attention in one launch: RoPE and the K/V write in its prologue, and its splits
        # merging themselves through arrival counters (zeroed now for the same reason as the
        # workspace, for the largest graph bucket; larger eager steps merge in a second kernel).
        # MGX_CUDA_DECODE_FUSION=0: rope_and_write_kv, decode and the merge kernel apart.
        self._decode_fusion = os.environ.get("MGX_CUDA_DECODE_FUSION", "1") != "0"
        hk = max((a.num_kv_heads for a in self._attn.values()), default=1)
        self._decode_counters = new_decode_counters(self.device, GRAPH_BUCKETS[-1], hk) if self._decode_fusion else None
        self._norm_gemv = os.environ.get("MGX_CUDA_NORM_GEMV", "0") == "1"  # add + RMSNorm in a GEMV's prologue
        self.norm_gemv_pinned = os.environ.get("MGX_CUDA_NORM_GEMV", "") in ("0", "1")  # else a stored tuning's
        self.tuned_gemvs = True  # the stored tunings' native GEMV choices (False: their Triton configurations)
        # x staged once for the imma GEMVs after an add + RMSNorm at batch 1 (``_norm_stage_into_gemv``):
        # by default for INT4 weights where the stored tuning's kind has a staged twin (``STAGED_SCHEMES``);
        # MGX_CUDA_STAGED_X=1 for every scheme with twins, =<kind> for that kind's twin wherever it takes
        # the product (``staged_kind``), =0 never.
        staged = os.environ.get("MGX_CUDA_STAGED_X", "")
        self.staged_x = staged != "0"
        self.staged_kind = "" if staged in ("", "0", "1") else staged
        self.staged_schemes = STAGED_SCHEMES if staged == "" else None  # None: any the kernels take
        self.staged_x_pinned = staged != ""  # else a stored tuning's (mgx-run tune)
        self.norm_across = os.environ.get("MGX_CUDA_NORM_ACROSS", "1") != "0"  # see the module docstring
        # The batch-1 int4 MLP in one launch where x is staged (``gemv.fused_mlp``, forty-third session;
        # on by default since the forty-fourth, MGX_CUDA_FUSED_MLP=0 or a stored tuning (mgx-run tune)
        # turns it off: on the H200 the 8B INT4 graph took 1.703 against 1.735 ms with the two GEMVs,
        # 146th run). Its rows, one per fused MLP, are zeroed as each step starts (``_mlp_rows``, made by
        # ``use_cuda_kernels``).
        self._fused_mlp = os.environ.get("MGX_CUDA_FUSED_MLP", "1") == "1"
        self._fused_mlp_env = os.environ.get("MGX_CUDA_FUSED_MLP", "") in ("0", "1")  # else a stored tuning's
        self._mlp_rows: torch.Tensor | None = None
        self._mlp_row_of: dict[int, int] = {}  # id(gate/up linear) -> its row
        self.norm_across_w8a16 = os.environ.get("MGX_CUDA_NORM_ACROSS_W8A16", "0") == "1"  # W8A16 readers too
        self.norm_across_dense = os.environ.get("MGX_CUDA_NORM_ACROSS_DENSE", "0") == "1"  # dense readers too
        # Decode attention over 32-token tiles instead of 64 (so up to twice the splits): the kernel
        # bench's best at a 640-token context on the H200, but no gain in the 8B bf16 graph and 1%
        # slower in all three 1B ones (README), so off by default; in the 8B W8A16 graph it took 0.04-0.14
        # ms off a 2.7-2.8 ms step in three measurements (nineteenth session). A stored tuning (``mgx-run tune``) sets it where
        # MGX_CUDA_DECODE_NARROW does not (use_tunings). None: neither chose, so each batch bucket takes
        # the width the autotune pass stored for it, or 64 (``_decode_config``; ``narrow_decode_tiles``).
        self.decode_tiles_pinned = os.environ.get("MGX_CUDA_DECODE_NARROW", "") in ("0", "1")
        self._decode_width: int | None = {"1": 32, "0": 64}.get(os.environ.get("MGX_CUDA_DECODE_NARROW", ""))
        # Decode attention cut into pieces of one tile each (up to twice the splits, one pass of the
        # tile loop per program) instead of two (MGX_CUDA_DECODE_ONE_TILE=0).
        self.one_tile_pieces = os.environ.get("MGX_CUDA_DECODE_ONE_TILE", "1") != "0"
        # Programmatic dependent launches (sm_90 and newer; MGX_CUDA_PDL=0 turns them off): see overlap_launches.
        major, minor = torch.cuda.get_device_capability(self.device) if self.device.type == "cuda" else (0, 0)
        self._sm = 10 * major + minor
        self._overlap = os.environ.get("MGX_CUDA_PDL", "1") != "0" and self._sm >= 90
        # Long prefills on quantized weights: dequantize into this buffer, then cuBLAS (``linear``).
        quantized = [w.n * w.k for op in graph.ops if op.kind == "linear" and (w := self._weights[id(op)]).scheme != "none"]
        self._dequant_buf = torch.empty(max(quantized), dtype=self.dtype, device=self.device) if quantized else None
        self._pending: dict[int, Array] = {}  # id(op) -> output computed by the op fused before it
        self._mm_fp32 = self._probe_mm_fp32()  # cuBLAS writes the dense LM head's logits in fp32 (lm_head)
        # The ways left to run fresh prompts through a fused SDPA kernel (MGX_CUDA_SDPA=0: none, the
        # paged prefill kernel runs them).
        self._sdpa_modes = list(SDPA_MODES) if os.environ.get("MGX_CUDA_SDPA", "1") != "0" else []
        self._sdpa_proven = False  # a fresh-prompt SDPA call has succeeded
        self._step: _Step | None = None
        self._decode_graphs: dict[tuple[int, bool], _Graph] = {}  # (batch bucket, greedy) -> captured step
        # (token bucket, greedy, nothing cached before) -> captured prefill step
        self._prefill_graphs: dict[tuple[int, bool, bool], _Graph] = {}
        self._mixed_graphs: dict[tuple[int, int, bool], _Graph] = {}  # (token bucket, sequences, greedy) -> step
        self._seen: set[tuple[Any, ...]] = set()  # prefill and mixed keys whose first step ran eagerly
        # Steps launched by path (decode, prefill, mixed graphs; eager) and graphs captured by kind
        # (decode, prefill, mixed; again when a table outgrows one): ``graph_stats``.
        self.steps_by_path: Counter[str] = Counter()
        self.captures: Counter[str] = Counter()
        self.capture_s: Counter[str] = Counter()  # host seconds spent capturing (warm-up runs included)
        self._pool: Any = None  # the captured steps' memory pool (``_graph_pool``)
        self._pool_anchor: Any = None  # the graph that keeps it open
        self._kv: CudaKVCache | None = None
        self._max_blocks = 0
        self.tunings = Tunings()  # stored autotune choices for this GPU (use_tunings); empty: defaults
        self.cuda_kernels: CudaKernels | None = None  # native RMSNorm, GEMV (use_cuda_kernels); None: Triton

    # -- setup ----------------------------------------------------------------------------------

    def _compute_dtype(self, name: str | None) -> torch.dtype:
        if name is not None:
            if name not in _DTYPES:
                raise UnsupportedModelError(f"CUDA compute dtype {name!r}: expected one of {', '.join(_DTYPES)}")
            return _DTYPES[name]
        for op in self.graph.ops:
            if op.kind in ("embedding", "linear", "lm_head"):
                t = self.graph.tensors[op.weights["weight"]]
                if t.scheme in ("none", "sparse24") and t.dtype in (DType.F32, DType.F16, DType.BF16):
                    return TORCH_DTYPES[t.dtype]
        return torch.bfloat16

    def _find_fusions(self) -> _Fusions:
        f = _Fusions()
        ops, users = self.graph.ops, _users(self.graph)
        prev: Op | None = None
        for op, nxt in zip(ops, ops[1:]):
            only_next = all(users.get(o) == [nxt] for o in op.outputs)
            if op.kind == "add" and nxt.kind == "rms_norm" and nxt.inputs == op.outputs:
                f.norm_after_add[id(op)] = nxt
            elif op.kind == "linear" and nxt.kind == "silu_mul" and nxt.inputs == op.outputs and only_next:
                f.silu_after_linear[id(op)] = nxt
            elif op.kind == "rope" and nxt.kind == "attention" and nxt.inputs[:2] == op.outputs and only_next:
                f.rope_into_attention[id(op)] = nxt
            elif (op.kind == "rms_norm" and prev is not None and f.norm_after_add.get(id(prev)) is op
                  and nxt.kind == "linear" and nxt.inputs == op.outputs and only_next):  # fmt: skip
                f.linear_after_norm[id(op)] = nxt
            prev = op
        for op, nxt in zip(ops, ops[1:]):
            norm = f.norm_after_add.get(id(nxt))
            reader = f.linear_after_norm.get(id(norm)) if norm is not None else None
            if op.kind == "linear" and reader is not None and users.get(op.outputs[0]) == [nxt]:
                f.norm_across[id(op)] = (nxt, norm, reader)
        by_input = {o: op for op in ops for o in op.inputs}  # a tensor -> an op reading it (the only one where checked)
        for gate_up, silu in [(op, f.silu_after_linear[id(op)]) for op in ops if id(op) in f.silu_after_linear]:
            down = by_input.get(silu.outputs[0])
            if down is None or down.kind != "linear" or users.get(silu.outputs[0]) != [down]:
                continue
            add = by_input.get(down.outputs[0])
            if add is not None and add.kind == "add" and users.get(down.outputs[0]) == [add]:
                f.mlp[id(gate_up)] = (silu, down, add)
        return f

    def _upload(self, tensors: dict[str, Tensor], threads: int | None = None) -> tuple[dict[str, torch.Tensor], UploadStats]:
        """Copy every tensor's bytes into one device arena; returns a typed view per tensor. ``threads``:
        staging fill threads (default ``_upload_threads()``)."""
        host: dict[str, np.ndarray] = {}
        for name, t in tensors.items():
            if t.data is None:
                raise UnsupportedModelError(f"tensor {name} has no data")
            host[name] = t.data
        pieces, total = _arena_pieces(list(host.values()))
        offsets = {name: off for name, (off, _) in zip(host, pieces, strict=True)}
        arena = torch.empty(max(total, 1), dtype=torch.uint8, device=self.device)
        t0 = time.perf_counter()
        pinned = self.device.type == "cuda"
        chunks = _copy_to_arena(arena, pieces, pinned, threads)
        if pinned:
            torch.cuda.synchronize(self.device)
        stats = UploadStats(sum(a.nbytes for a in host.values()), time.perf_counter() - t0, chunks, pinned)
        views = {}
        for name, a in host.items():
            t = tensors[name]
            raw = arena[offsets[name] : offsets[name] + a.nbytes]
            views[name] = raw.view(TORCH_DTYPES[t.dtype]).view(a.shape)
        return views, stats

    def _prepare(self, op: Op) -> None:
        a = op.attrs
        if op.kind in ("linear", "lm_head", "embedding"):
            self._weights[id(op)] = self._gpu_weight(op)
            b = op.weights.get("bias")
            self._bias[id(op)] = None if b is None else self._dev[b].to(self.dtype)
        elif op.kind == "rms_norm":
            w = op.weights.get("weight")
            # In the compute dtype: the native kernel reads weight and x alike (Triton's takes any).
            weight = None if w is None else self._dev[w].to(self.dtype).contiguous()
            self._norm[id(op)] = (weight, float(a["eps"]), int(a["group"]))
        elif op.kind == "rope":
            self._inv_freq[id(op)] = (
                self._dev[op.weights["inv_freq"]].float().reshape(-1),
                int(a["head_dim"]),
                int(a["rotary_dim"]),
                float(a["attention_scaling"]),
            )
        elif op.kind == "attention":
            a = self._attn[id(op)] = AttentionAttrs.of(op)
            self._attn_sig[id(op)] = attention_signature(a.num_heads, a.num_kv_heads, a.head_dim)

    def _gpu_weight(self, op: Op) -> GpuWeight:
        tensors = self.graph.tensors
        t = tensors[op.weights["weight"]]
        where = f"{op.kind} from {op.source or '?'}: weight {t.name}"
        if t.scheme not in SCHEME_IDS:
            raise UnsupportedModelError(f"{where} uses scheme {t.scheme!r}; the CUDA kernels read {', '.join(SCHEME_IDS)}")
        aux = {r: tensors[op.weights[r]] for r in _AUX_ROLES if r in op.weights}
        try:
            if t.layout in GPU_LAYOUTS:  # read where the upload put it
                arrays = {"weight": self._dev[t.name], **{r: self._dev[a.name] for r, a in aux.items()}}
            else:  # unpacked on the host once (a layout for another target)
                arrays = gpu_arrays(t, aux, self.device)
            return gpu_weight(t, arrays, self.dtype)
        except (ValueError, layout_registry.LayoutError) as e:
            raise UnsupportedModelError(f"{where}: {e}") from None

    def _probe_mm_fp32(self) -> bool:
        """Whether ``torch.mm`` takes ``out_dtype=torch.float32`` for the compute dtype on this device
        (cuBLAS writing fp32 from 16-bit operands; a CUDA op since torch 2.8). Tried once, here, on two
        tiny operands: never inside a graph capture."""
        dense_head = any(op.kind == "lm_head" and self._weights[id(op)].scheme == "none" for op in self.graph.ops)
        if not dense_head or self.device.type != "cuda" or self.dtype == torch.float32:
            return False  # only a dense LM head's several sampling rows go to cuBLAS
        a = torch.ones(2, 16, dtype=self.dtype, device=self.device)
        try:
            return torch.mm(a, a.t(), out_dtype=torch.float32).dtype == torch.float32
        except (TypeError, RuntimeError, NotImplementedError):
            return False

    @property
    def arch(self) -> str:
        """The architecture stored tunings are kept under: ``sm_90`` on an H200, ``interpreter`` off a GPU."""
        return f"sm_{self._sm}" if self.device.type == "cuda" else "interpreter"

    def one_row_linears(self) -> list[tuple[str, GpuWeight, Array | None]]:
        """(kernel, weight, bias) of every linear op and of the LM head, the kernel named as stored
        tunings name it (``linear_silu_mul`` for a gate/up projection whose SiLU product its epilogue
        takes, ``lm_head_argmax`` for the LM head, which a greedy decode step runs with its argmax)."""
        def kernel(op: Op) -> str:
            if op.kind == "lm_head":
                return "lm_head_argmax"
            return "linear_silu_mul" if id(op) in self._fuse.silu_after_linear else "linear"

        return [(kernel(op), self._weights[id(op)], self._bias[id(op)]) for op in self.graph.ops
                if op.kind in ("linear", "lm_head")]  # fmt: skip

    def warm_batch_sizes(self, max_num_seqs: int) -> list[int]:
        """One batch size per decode-graph bucket a step of up to ``max_num_seqs`` sequences meets:
        the buckets below it, then ``max_num_seqs`` itself (its bucket; the largest past it)."""
        if not self.decode_graphs:
            return []
        top = min(max_num_seqs, GRAPH_BUCKETS[-1])
        return [b for b in GRAPH_BUCKETS if b < top] + [top]

    def _stages(self, scheme: str) -> bool:
        """Whether the staged switch is on for weights of ``scheme`` (``STAGED_SCHEMES`` by default;
        the kernels still decide where it runs)."""
        return self.staged_x and (self.staged_schemes is None or scheme in self.staged_schemes)

    def stages_x(self) -> bool:
        """Whether the staged switch is on for some projection of this model."""
        return any(self._stages(w.scheme) for kernel, w, _ in self.one_row_linears() if kernel != "lm_head_argmax")

    def set_staged_x(self, on: bool) -> None:
        """The staged switch as ``mgx-run tune`` stores it: on for every scheme with staged twins, or off."""
        self.staged_x, self.staged_schemes = on, None

    def warm_prompt_lengths(self, max_tokens_per_step: int) -> list[int]:
        """One prompt length per prefill-graph token bucket a prompt (or a chunk of one) of up to
        ``max_tokens_per_step`` tokens meets: the buckets below it, then the budget itself. A bucket's
        first prompt runs eagerly (its kernels compile then: the K/V write's tile, the LM head's rows,
        the quantized linears' row counts) and its second captures the graph. None without graphs."""
        if not self.prefill_graphs:
            return []
        top = min(max_tokens_per_step, PREFILL_GRAPH_TOKENS[-1])
        return [b for b in PREFILL_GRAPH_TOKENS if b < top] + [top] if top >= 2 else []

    def graph_stats(self) -> dict[str, dict[str, float]]:
        """Steps launched by path ("decode", "prefill", "mixed" graphs; "eager"), graphs captured by
        kind and the host seconds those captures took, since the backend was made."""
        return {"steps": dict(self.steps_by_path), "captures": dict(self.captures), "capture_s": dict(self.capture_s)}

    def drop_graphs(self, kinds: Iterable[str] = GRAPH_KINDS) -> None:
        """Forget the captured steps of ``kinds`` (decode, prefill, mixed), to be captured anew when next
        needed (after a change of tunings or switches, or ``Engine.warm_up``'s long prompts; never while
        a launched step is in flight)."""
        kinds = list(kinds)
        if unknown := next((k for k in kinds if k not in GRAPH_KINDS), None):
            raise ValueError(f"unknown graph kind {unknown!r} (one of {', '.join(GRAPH_KINDS)})")
        for kind in kinds:
            getattr(self, f"_{kind}_graphs").clear()

    def replay_ms(self, bucket: int, replays: int = 50) -> float | None:
        """Milliseconds per replay of the captured decode step of ``bucket`` rows (the greedy one where
        both are), ``replays`` back to back after one unclocked; None where none is captured. The
        step's GPU time alone, without the host's share of a step."""
        g = self._decode_graphs.get((bucket, True)) or self._decode_graphs.get((bucket, False))
        if g is None:
            return None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        g.graph.replay()
        start.record()
        for _ in range(replays):
            g.graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / replays

    def use_tunings(self, autotune: dict[str, list[Any]]) -> str:
        """Take the artifact's stored launch configurations for this GPU's architecture; never tunes.

        Returns a line saying what was taken (the engine logs it)."""
        arch = self.arch
        entries = autotune.get(arch)
        if entries is None:
            stored = ", ".join(sorted(autotune)) or "none"
            return f"no stored tunings for {arch} (stored: {stored}); default launch configurations"
        try:
            self.tunings = Tunings(entries)
        except ValueError as e:
            raise UnsupportedModelError(f"the artifact's stored tunings for {arch}: {e}") from None
        for w in {id(w): w for w in self._weights.values() if w.scheme != "none"}.values():
            for kind in (DEQUANTIZE, EMBEDDING_ROWS):
                for c in self.tunings.stored(kind, weight_signature(w)):
                    if c.block_k % min_block_k(w):  # it would fail in the first long prefill or step
                        raise UnsupportedModelError(
                            f"the artifact's stored tunings for {arch}: {kind} of {weight_signature(w)} has K tiles of "
                            f"{c.block_k}, which split its groups of {min_block_k(w)}")  # fmt: skip
        if self.tunings.decode_block_n is not None and not self.decode_tiles_pinned:
            self.narrow_decode_tiles = self.tunings.decode_block_n == 32
        if self.tunings.norm_prologue is not None and not self.norm_gemv_pinned:
            self._norm_gemv = self.tunings.norm_prologue
        if self.tunings.staged_x is not None and not self.staged_x_pinned:
            self.set_staged_x(self.tunings.staged_x)
        if self.tunings.fused_mlp is not None and not self._fused_mlp_env:
            self.fused_mlp = self.tunings.fused_mlp
        skipped = Counter(self.tunings.unknown)
        unknown = f"; {sum(skipped.values())} entries of kernels this runtime does not know skipped ({', '.join(sorted(skipped))})"
        return f"{len(self.tunings)} stored launch configurations for {arch}" + (unknown if skipped else "")

    def use_cuda_kernels(self, images: dict[str, bytes]) -> str:
        """Load the artifact's native kernels (the RMSNorm) from the image whose code runs on this GPU.

        Without one (none stored, all for other GPUs, refused by the driver) the Triton kernels run and
        ``load_cuda_kernels`` warns once. Returns a line saying which (the engine logs it)."""
        if self.device.type != "cuda":
            return "native CUDA kernels are not used on this device (Triton RMSNorm)"
        sm = self._sm
        runs = [a for a in images if arch_runs_on(a, sm)]  # all of this GPU's major version
        # Code for exactly this chip (sm_90a) first, then the newest sm_XY; with none that runs, a stored
        # image all the same, so that the warning names what is there.
        arch = max(runs, key=lambda a: (a[-1] in "af", a)) if runs else min(images, default=None)
        self.cuda_kernels = load_cuda_kernels(images.get(arch) if arch else None, arch, self.device.index)
        if self.cuda_kernels is None:
            stored = ", ".join(sorted(images)) or "none"
            return f"no native CUDA kernels for sm_{sm} (stored: {stored}); Triton RMSNorm"
        gemvs = [GEMV_LABELS[key] for key, entry in GEMV_ENTRIES.items() if self.cuda_kernels.has(entry)]
        if any(self.cuda_kernels.has(entry) for entry in ARGMAX_ENTRIES.values()):
            gemvs.append(ARGMAX_LABEL)
        if self.cuda_kernels.has(TILE16_MARKER):
            gemvs.append("the integer tensor-core kinds on cuda_tile16 weights")
        if reads_half_scales(self.cuda_kernels):
            paired = self._pair_scales()
            gemvs.append(f"int4 scales as fp16 pairs for {paired} weights")
        if self.fused_mlp and self._make_mlp_rows():
            gemvs.append(f"the int4 MLP in one launch in {len(self._mlp_row_of)} of {len(self._fuse.mlp)} layers "
                         "(MGX_CUDA_FUSED_MLP)")  # fmt: skip
        note = f"native CUDA kernels for {arch} ({', '.join(['RMSNorm', *gemvs])})"
        if self._overlap:
            overlapped = self.cuda_kernels.allow_overlap(sm)
            note += ", launched overlapped" if overlapped else ", not overlapped (needs cuLaunchKernelEx, newer code)"
        return note

    def _pair_scales(self) -> int:
        """Give each int4 linear weight and LM head its scales and zeros as the fp16 pairs that the int4
        imma kinds of a MGX_IMMA_HALF_SCALES build read (``gemv.scale_pairs``, ordered for the SiLU
        product where its epilogue takes one; built on the device from the uploaded scales and kept
        beside them, which the Triton kernels read). A weight whose scales fp16 would change keeps none
        and runs on the Triton kernels. Returns how many got them."""
        paired = 0
        for op in self.graph.ops:
            w = self._weights.get(id(op)) if op.kind in ("linear", "lm_head") else None
            if w is not None and w.pairs is None and half_scales_hold(w):
                self._weights[id(op)] = scale_pairs(w, id(op) in self._fuse.silu_after_linear)
                paired += 1
        return paired

    def _mlp_widths(self) -> dict[int, int]:
        """id(gate/up) -> down's width, for the MLPs ``fused_mlp`` may run: int4 gate/up and down whose
        add's norm feeds an int4 linear (the next layer's QKV, which ``norm_stage_fx`` stages from the
        row; not the last layer's, whose norm feeds the LM head and would need the row converted by
        torch ops); none unless the downs' widths are alike."""
        widths = {}
        for key, (_, down, add) in self._fuse.mlp.items():  # in the graph's order
            norm = self._fuse.norm_after_add.get(id(add))
            reader = self._fuse.linear_after_norm.get(id(norm)) if norm is not None else None
            if reader is not None and {self._weights[key].scheme, self._weights[id(down)].scheme,
                                       self._weights[id(reader)].scheme} == {"int4"}:  # fmt: skip
                widths[key] = self._weights[id(down)].n
        return widths if len(set(widths.values())) == 1 else {}

    def _make_mlp_rows(self) -> bool:
        """The fixed-point rows of the MLPs ``fused_mlp`` may run (``_mlp_widths``): one int64 row each,
        zeroed as each step starts (``embedding``). Returns whether there are any."""
        widths = self._mlp_widths()
        if not widths:
            return False
        self._mlp_row_of = {key: i for i, key in enumerate(widths)}
        self._mlp_rows = fixed_rows(next(iter(widths.values())), self.device, len(widths))
        return True

    @property
    def fused_mlp_pinned(self) -> bool:
        """Whether ``mgx-run tune`` leaves the fused MLP switch alone: MGX_CUDA_FUSED_MLP set, or no MLP of
        this model that the fused kernel could run."""
        return self._fused_mlp_env or not self._mlp_widths()

    @property
    def fused_mlp(self) -> bool:
        """Whether batch-1 decode runs the int4 MLPs ``_mlp_widths`` names in one launch each."""
        return self._fused_mlp

    @fused_mlp.setter
    def fused_mlp(self, on: bool) -> None:
        # Switched on once the native kernels are loaded (mgx-run tune, an A/B flip), the rows are made
        # here; before that, use_cuda_kernels makes them.
        self._fused_mlp = bool(on)
        if on and self._mlp_rows is None and self.cuda_kernels is not None:
            self._make_mlp_rows()

    @property
    def overlap_launches(self) -> bool:
        """Whether the decode-path kernels are launched overlapped (programmatic dependent launches):
        the Triton linear, decode attention and LM head kernels, and the native kernels where their
        code allows it. Each kernel may then start while the one before it finishes and waits for it
        before reading its output. On by default on sm_90 and newer (``MGX_CUDA_PDL=0``: off): on the
        H200 the 8B bf16 graph gained in the ninth session's three runs (4.145 vs 4.299 ms at best),
        after losing in three of four the session before; 1B INT4 gained, 1B bf16 and W8A16 lost 2-4%.
        Steps captured before a change keep the launches they were captured with."""
        return self._overlap

    @overlap_launches.setter
    def overlap_launches(self, on: bool) -> None:
        self._overlap = bool(on) and self._sm >= 90
        if self.cuda_kernels is not None:
            self.cuda_kernels.overlap = self._overlap and self.cuda_kernels.allow_overlap(self._sm)

    def new_kv_cache(self, num_blocks: int, block_size: int, num_state_slots: int = 0) -> KVCache:
        if num_state_slots:
            raise UnsupportedModelError("the CUDA backend has no recurrent-state kernels yet")
        self._kv = CudaKVCache(self.graph, num_blocks, block_size, self.dtype, self.device)
        self._max_blocks = -(-self.graph.arch.max_position // block_size)
        return self._kv

    def memory_available(self) -> int:
        if self.device.type != "cuda":
            return super().memory_available()
        free, _ = torch.cuda.mem_get_info(self.device)
        return max(0, free - _RESERVE_BYTES)

    # -- a step -----------------------------------------------------------------------------------

    def execute(self, run_ops: Callable[[StepBatch], Array], batch: StepBatch, kv: KVCache) -> Any:
        return self.launch(run_ops, batch, kv).result()

    def launch(
        self,
        run_ops: Callable[[StepBatch], Array],
        batch: StepBatch,
        kv: KVCache,
        tokens_from: StepResult | None = None,
        rows: list[int] | None = None,
    ) -> StepResult:
        """A greedy decode step replays its graph and returns without waiting: its picks reach a
        pinned buffer behind it, and stay on the device for the next launch (``tokens_from``; those
        at ``rows`` when the next step leaves sequences out, gathered on the device).
        Other steps (prefill, mixed, sampling, beyond the largest bucket), and every step with
        ``overlaps_steps`` off (``MGX_CUDA_AHEAD=0``), run to the end first."""
        paged = batch.paged
        assert paged is not None, "the runner attaches the paged view before running ops"
        s = len(batch.seq_ids)
        decode = batch.num_tokens == s and batch.sample_rows.size == s and np.array_equal(batch.sample_rows, np.arange(s))
        graphed = self.decode_graphs and decode and s <= GRAPH_BUCKETS[-1]
        unwaited = graphed and batch.greedy and self.overlaps_steps
        prefill = self.prefill_bucket(batch) if self.prefill_graphs and not decode else None
        if prefill is not None and not self._graph_due(self._prefill_graphs, self._prefill_key(batch, prefill)):
            prefill = None
        mixed = self.mixed_key(batch) if self.mixed_graphs and not decode and s > 1 else None
        if mixed is not None and not self._graph_due(self._mixed_graphs, mixed):
            mixed = None
        fed = None  # the previous launch's picks, where they are still on the device
        if tokens_from is not None:
            if unwaited and tokens_from is self._last_launch:
                fed = tokens_from.device_ids()
                if fed is not None and rows is not None:
                    at = torch.tensor(rows, dtype=torch.int64, pin_memory=self.device.type == "cuda")
                    fed = fed.index_select(0, at.to(fed.device, non_blocking=True))
            if fed is None:
                batch.token_ids = picked(tokens_from, rows)
        self._last_launch = None
        with overlapped_launches(self._overlap):
            graph_out: StepResult | None = None
            if graphed:
                graph_out = self._graph_or_none(
                    "decode", s, lambda: self._launch_graph(run_ops, batch, fed) if unwaited else StepResult(self._replay(run_ops, batch))
                )
                if graph_out is None and fed is not None:  # eager after all: it needs the picks on the host
                    batch.token_ids = picked(tokens_from, rows)
            elif prefill is not None:
                graph_out = self._graph_or_none("prefill", prefill, lambda: StepResult(self._replay_prefill(run_ops, batch, prefill)))
            elif mixed is not None:
                graph_out = self._graph_or_none("mixed", mixed[0], lambda: StepResult(self._replay_mixed(run_ops, batch, mixed)))
            if graph_out is not None:
                out: StepResult = graph_out
            else:
                self.steps_by_path["eager"] += 1
                self._step = self._eager_step(batch)
                try:
                    out = StepResult(_to_host(run_ops(batch)))
                finally:
                    self._step = None
                    self._pending.clear()
        self._last_launch = out
        return out

    def _graph_or_none(self, kind: str, rows: int, step: Callable[[], StepResult]) -> StepResult | None:
        """``step()`` (a decode, prefill or mixed graph's step), or None (the step then runs eagerly)
        where capturing the graph ran out of device memory: graphs of that kind are then off for
        good, with one warning. ``rows``: the step's sequences (decode) or tokens, for the warning."""
        try:
            out = step()
        except torch.OutOfMemoryError as e:
            setattr(self, f"{kind}_graphs", False)
            getattr(self, f"_{kind}_graphs").clear()
            if kind == "decode":  # nothing returns before its output now: the engine stops launching ahead
                self.overlaps_steps = False
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            what = f"{rows} sequences" if kind == "decode" else f"{rows} tokens"
            warnings.warn(f"MGX: capturing a {kind} graph of {what} ran out of device memory ({e}); "
                          f"{kind} steps run op by op from now on", RuntimeWarning, stacklevel=3)  # fmt: skip
            return None
        self.steps_by_path[kind] += 1
        return out

    @staticmethod
    def prefill_bucket(batch: StepBatch) -> int | None:
        """The token bucket of the prefill graph that runs ``batch``: one sequence's new tokens, at
        least two (a whole prompt, a chunk of one, or what follows a cached prefix), no other rows,
        its last row sampled or none, and a bucket that holds them (None: the step runs eagerly)."""
        t = batch.num_tokens
        if len(batch.seq_ids) != 1 or t < 2 or t > PREFILL_GRAPH_TOKENS[-1]:
            return None
        rows = batch.sample_rows
        if rows.size > 1 or (rows.size == 1 and rows[0] != t - 1):
            return None
        return next(b for b in PREFILL_GRAPH_TOKENS if b >= t)

    @staticmethod
    def _prefill_key(batch: StepBatch, bucket: int) -> tuple[int, bool, bool]:
        """(bucket, greedy, fresh): a prompt with nothing cached before it attends through SDPA
        (``_fresh_attention``), one after cached tokens through the paged prefill kernel."""
        return bucket, batch.greedy, bool(batch.paged.context_lens[0] == batch.num_tokens)

    @staticmethod
    def mixed_key(batch: StepBatch) -> tuple[int, int, bool] | None:
        """(token bucket, sequence capacity, greedy) of the mixed-step graph that runs ``batch``: up
        to ``MIXED_GRAPH_SEQS[-1] - 1`` sequences and ``PREFILL_GRAPH_TOKENS[-1]`` tokens, each
        sampling its last row or none (None: the step runs eagerly)."""
        s, t = len(batch.seq_ids), batch.num_tokens
        if s >= MIXED_GRAPH_SEQS[-1] or t > PREFILL_GRAPH_TOKENS[-1]:
            return None
        rows = batch.sample_rows
        if rows.size:  # every sampled row is a sequence's last (np.isin took ~50-100 us here)
            last = np.zeros(t, dtype=bool)
            last[batch.paged.query_start_loc[1:] - 1] = True
            if not last[rows].all():
                return None
        cap = next(c for c in MIXED_GRAPH_SEQS if c > s)
        return next(b for b in PREFILL_GRAPH_TOKENS if b >= t), cap, batch.greedy

    def _graph_due(self, graphs: dict, key: tuple) -> bool:
        """Whether a step of ``key`` replays its graph in ``graphs`` (prefill or mixed; captured now
        if need be): from the key's second step on. The first runs eagerly, so a one-off prompt
        (``mgx-run generate``'s cold start) pays for no capture (two more eager runs and the capture)."""
        if key in graphs or (graphs is self._prefill_graphs, key) in self._seen:
            return True
        self._seen.add((graphs is self._prefill_graphs, key))
        return False

    def _eager_step(self, batch: StepBatch) -> _Step:
        paged = batch.paged
        t, s = batch.num_tokens, len(batch.seq_ids)
        # Each part starts 16 bytes in: Triton specializes a kernel on whether its pointers are
        # 16-byte aligned, so parts packed back to back made a new variant (a compile of ~0.3-1 s on
        # the H200's host) whenever the step's counts moved an offset (26th session: 49 compiles of
        # the K/V-write kernel in 480 requests).
        cut = np.cumsum([_aligned_ints(t), _aligned_ints(s), _aligned_ints(s + 1)])
        ints = np.zeros(cut[2] + paged.block_tables.size, dtype=np.int32)
        ints[:t], ints[cut[0] : cut[0] + s] = batch.positions, paged.context_lens
        ints[cut[1] : cut[1] + s + 1], ints[cut[2] :] = paged.query_start_loc, paged.block_tables.ravel()
        dev = torch.from_numpy(ints).to(self.device, non_blocking=True)
        longs = torch.from_numpy(np.concatenate([batch.token_ids, batch.sample_rows])).to(self.device, non_blocking=True)
        qlens = np.diff(paged.query_start_loc)
        fresh = s <= SDPA_MAX_SEQS and qlens.size and qlens.max() > 1 and np.array_equal(paged.context_lens, qlens)
        return _Step(
            token_ids=longs[:t],
            positions=dev[:t],
            context_lens=dev[cut[0] : cut[0] + s],
            query_start_loc=dev[cut[1] : cut[1] + s + 1],
            block_tables=dev[cut[2] :].view(paged.block_tables.shape),
            sample_rows=longs[t:],
            max_query_len=int(qlens.max()) if qlens.size else 0,
            max_context_len=int(paged.context_lens.max()) if s else 0,
            fresh=tuple(paged.query_start_loc.tolist()) if fresh else None,
        )

    def _graph_for(self, run_ops: Callable[[StepBatch], Array], batch: StepBatch) -> _Graph:
        """The captured step for ``batch``'s bucket, captured (again, wider) when its table outgrew it."""
        key = (next(b for b in GRAPH_BUCKETS if b >= len(batch.seq_ids)), batch.greedy)
        needed = batch.paged.block_tables.shape[1]
        width = graph_table_width(needed, self._max_blocks)
        return self._graph_at("decode", key, needed, lambda: self._capture(run_ops, batch, key[0], width))

    def _graph_at(self, kind: str, key: Any, needed: int, capture: Callable[[], _Graph]) -> _Graph:
        """The ``kind`` graph (decode, prefill, mixed) of ``key``; captured by ``capture`` when there is
        none yet, or again (wider) when its block table is narrower than ``needed`` blocks. A launch
        still in flight holds its old graph and slot; the capture's warm-up runs on a stream that
        waits for it."""
        graphs = getattr(self, f"_{kind}_graphs")
        g = graphs.get(key)
        if g is None or g.step.block_tables.shape[1] < needed:
            graphs.pop(key, None)
            g = None  # the old graph's memory goes back to the pool before the new capture
            t0 = time.perf_counter()
            g = graphs[key] = capture()
            self.captures[kind] += 1
            self.capture_s[kind] += time.perf_counter() - t0
        return g

    @staticmethod
    def _replay_waited(g: _Graph, fill: Callable[[_Step, StepBatch | None, torch.Tensor], None], batch: StepBatch,
                       rows: int) -> Any:  # fmt: skip
        """``batch`` written into ``g``'s static buffers by ``fill``, the graph replayed and waited
        for: its first ``rows`` host logits [rows, V] (or the greedy pair: ids stay integers)."""
        assert g.step.host is not None
        fill(g.step, batch, g.step.host)
        g.graph.replay()
        return _to_host(tuple(t[:rows] for t in g.out) if isinstance(g.out, tuple) else g.out[:rows])

    def _replay(self, run_ops: Callable[[StepBatch], Array], batch: StepBatch) -> Any:
        """A decode step's graph, waited for: host logits [S, V] (or the greedy pair)."""
        return self._replay_waited(self._graph_for(run_ops, batch), self._fill, batch, len(batch.seq_ids))

    def _replay_prefill(self, run_ops: Callable[[StepBatch], Array], batch: StepBatch, bucket: int) -> Any:
        """One sequence's prefill step on the graph of ``bucket`` tokens (captured, or captured again
        wider, when its block table does not reach the padding's last position), waited for: host
        logits [R, V] (or the greedy pair), R = 0 or 1 sampled rows."""
        assert self._kv is not None, "the KV cache is made before the first step"
        key = self._prefill_key(batch, bucket)
        block = self._kv.block_size
        start = int(batch.paged.context_lens[0]) - batch.num_tokens  # tokens cached before this step's
        needed = -(-(start + bucket) // block)
        # A table past the model's context: the padding's positions run up to a bucket beyond it.
        width = needed if start == 0 else graph_table_width(needed, self._max_blocks + -(-bucket // block))
        g = self._graph_at("prefill", key, needed,
                           lambda: self._capture_prefill(run_ops, batch, bucket, width, fresh=key[2]))  # fmt: skip
        return self._replay_waited(g, self._fill_prefill, batch, batch.sample_rows.size)

    def _replay_mixed(self, run_ops: Callable[[StepBatch], Array], batch: StepBatch, key: tuple[int, int, bool]) -> Any:
        """A step of several sequences on the mixed graph of ``key`` (captured, or captured again
        wider, when a table does not fit), waited for: host logits [R, V] (or the greedy pair)."""
        assert self._kv is not None, "the KV cache is made before the first step"
        block = self._kv.block_size
        # The padding sequence's rows take positions 0 .. (all of the bucket while capturing).
        needed = max(batch.paged.block_tables.shape[1], -(-key[0] // block))
        width = graph_table_width(needed, self._max_blocks + -(-key[0] // block))
        g = self._graph_at("mixed", key, needed,
                           lambda: self._capture_mixed(run_ops, batch, key[0], key[1], width))  # fmt: skip
        return self._replay_waited(g, self._fill_mixed, batch, batch.sample_rows.size)

    def _launch_graph(self, run_ops: Callable[[StepBatch], Array], batch: StepBatch, fed: Any) -> _GraphResult:
        """A greedy decode step's graph, not waited for; ``fed``: device ids [S] that are its tokens."""
        g = self._graph_for(run_ops, batch)
        slot = self._slot(g)
        self._fill(g.step, batch, slot.host)
        s = len(batch.seq_ids)
        if fed is not None:  # after the inputs' copy, before the replay that overwrites the picks
            g.step.token_ids[:s].copy_(fed)
        g.graph.replay()
        ids, top = g.out
        slot.ids[:s].copy_(ids[:s], non_blocking=True)
        slot.top[:s].copy_(top[:s], non_blocking=True)
        slot.done.record()
        return _GraphResult(g, slot, s, ids[:s])

    def _slot(self, g: _Graph) -> _Slot:
        """A free slot of ``g`` (once the launch that last used it is done), or a new one."""
        if g.free:
            slot = g.free.pop()
            slot.done.synchronize()  # a discarded launch may still be copying through it
            return slot
        assert g.step.host is not None
        ids, top = g.out
        pin = self.device.type == "cuda"
        return _Slot(
            host=torch.empty(g.step.host.shape, dtype=g.step.host.dtype, pin_memory=pin),
            ids=torch.empty(ids.shape, dtype=ids.dtype, pin_memory=pin),
            top=torch.empty(top.shape, dtype=top.dtype, pin_memory=pin),
            done=torch.cuda.Event() if pin else _NoEvent(),
        )

    def _static_step(self, bucket: int, width: int) -> _Step:
        assert self._kv is not None, "the KV cache is made before the first step"
        max_context = min(self.graph.arch.max_position, width * self._kv.block_size)
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        hk = max((a.num_kv_heads for a in self._attn.values()), default=1)
        return _Step(
            **_decode_buffers(bucket, width, self.device),
            query_start_loc=torch.arange(bucket + 1, dtype=torch.int32, device=self.device),
            sample_rows=torch.arange(bucket, dtype=torch.int64, device=self.device),
            max_query_len=1,
            max_context_len=max_context,
            decode_splits=decode_splits(bucket, hk, max_context, sms, self._decode_config(bucket).block_n,
                                        self._decode_min_tiles),  # fmt: skip
        )

    def _fill(self, st: _Step, batch: StepBatch | None, pinned: torch.Tensor) -> None:
        """Write a decode batch into a graph's static buffers through the host buffer ``pinned``
        (free: no copy from it is pending); rows past the batch decode into the scratch block."""
        assert st.packed is not None
        bucket = st.token_ids.shape[0]
        s = 0 if batch is None else len(batch.seq_ids)
        width = st.block_tables.shape[1]
        host, a = pinned.numpy(), _aligned_ints(bucket)
        tok, pos, ctx = host[:bucket], host[a : a + bucket], host[2 * a : 2 * a + bucket]
        tables = host[3 * a :].reshape(bucket, width)
        # The table is as wide as the graph's contexts (``graph_table_width``), not the model's.
        tables.fill(-1)
        tables[s:, 0] = self._kv.scratch_block
        ctx[s:], pos[s:], tok[s:] = 1, 0, 0
        if batch is not None:
            bt = batch.paged.block_tables
            tables[:s, : bt.shape[1]] = bt[:, :width]
            ctx[:s] = batch.paged.context_lens
            pos[:s] = batch.positions
            tok[:s] = batch.token_ids
        st.packed.copy_(pinned, non_blocking=True)

    def _prefill_step(self, bucket: int, width: int, fresh: bool) -> _Step:
        """Static buffers of a prefill graph: one sequence's ``bucket`` rows (its new tokens, then
        padding) and a block table of ``width`` blocks; ``fresh``: nothing cached before them (SDPA)."""
        assert self._kv is not None, "the KV cache is made before the first step"
        # [token ids | positions | context length | block table | sampled row], all int32, the
        # parts the kernels read 16 bytes in (buckets are multiples of 16)
        at = _prefill_cuts(bucket, width)
        packed = torch.zeros(at[-1] + 1, dtype=torch.int32, device=self.device)
        return _Step(
            token_ids=packed[:bucket],
            positions=packed[bucket : 2 * bucket],
            context_lens=packed[at[0] : at[0] + 1],
            block_tables=packed[at[1] : at[1] + width].view(1, width),
            query_start_loc=torch.tensor([0, bucket], dtype=torch.int32, device=self.device),
            sample_rows=packed[at[2] :],
            max_query_len=bucket,
            max_context_len=width * self._kv.block_size,
            packed=packed,
            host=torch.zeros(packed.shape, dtype=torch.int32, pin_memory=self.device.type == "cuda"),
            fresh=(0, bucket) if fresh else None,
        )

    def _fill_prefill(self, st: _Step, batch: StepBatch | None, pinned: torch.Tensor) -> None:
        """Write one sequence's prefill step into a prefill graph's static buffers through the host
        buffer ``pinned``: its tokens then zeros at the positions after its cached ones, the context
        through the last padding row, its blocks then the scratch block (where the padding past its
        last block writes), its last row sampled. Without a batch, all padding at positions 0 ..."""
        assert st.packed is not None and self._kv is not None
        bucket, width = st.token_ids.shape[0], st.block_tables.shape[1]
        host, at = pinned.numpy(), _prefill_cuts(bucket, width)
        tok, pos, table = host[:bucket], host[bucket : 2 * bucket], host[at[1] : at[1] + width]
        n = 0 if batch is None else batch.num_tokens
        start = 0 if batch is None else int(batch.paged.context_lens[0]) - n
        used = -(-(start + n) // self._kv.block_size)
        if batch is not None:
            tok[:n] = batch.token_ids
            table[:used] = batch.paged.block_tables[0, :used]
        tok[n:] = 0
        pos[:] = np.arange(start, start + bucket)
        host[at[0]] = start + bucket
        table[used:] = self._kv.scratch_block
        host[-1] = max(n - 1, 0)  # with no row sampled, this one's logits are computed and dropped
        st.packed.copy_(pinned, non_blocking=True)

    def _capture_prefill(self, run_ops: Callable[[StepBatch], Array], batch: StepBatch, bucket: int, width: int,
                         fresh: bool) -> _Graph:  # fmt: skip
        return self._record(run_ops, batch, self._prefill_step(bucket, width, fresh), self._fill_prefill)

    def _mixed_step(self, bucket: int, cap: int, width: int) -> _Step:
        """Static buffers of a mixed-step graph: ``bucket`` rows of up to ``cap`` sequences (the real
        ones, then one that holds the padding rows, then empty ones) and tables of ``width`` blocks."""
        assert self._kv is not None, "the KV cache is made before the first step"
        cut = _mixed_cuts(bucket, cap, width)
        packed = torch.zeros(cut[-1] + cap, dtype=torch.int32, device=self.device)
        return _Step(
            token_ids=packed[: cut[0]],
            positions=packed[cut[0] : cut[1]],
            context_lens=packed[cut[1] : cut[2]],
            query_start_loc=packed[cut[2] : cut[2] + cap + 1],
            block_tables=packed[cut[3] : cut[4]].view(cap, width),
            sample_rows=packed[cut[4] :],
            max_query_len=bucket,
            max_context_len=width * self._kv.block_size,
            packed=packed,
            host=torch.zeros(packed.shape, dtype=torch.int32, pin_memory=self.device.type == "cuda"),
        )

    def _fill_mixed(self, st: _Step, batch: StepBatch | None, pinned: torch.Tensor) -> None:
        """Write a step of several sequences into a mixed graph's static buffers through ``pinned``:
        the real sequences as they are; after them one sequence of the padding rows at positions 0 ..
        on the scratch block; the rest empty. Sampled rows past the real ones repeat row 0. Without a
        batch, all padding."""
        assert st.packed is not None and self._kv is not None
        bucket, (cap, width) = st.token_ids.shape[0], st.block_tables.shape
        host = pinned.numpy()
        cut = _mixed_cuts(bucket, cap, width)
        tok, pos, ctx, qsl = host[: cut[0]], host[cut[0] : cut[1]], host[cut[1] : cut[2]], host[cut[2] : cut[2] + cap + 1]
        tables, rows = host[cut[3] : cut[4]].reshape(cap, width), host[cut[4] :]
        s = 0 if batch is None else len(batch.seq_ids)
        t = 0 if batch is None else batch.num_tokens
        tables.fill(-1)
        tables[s:, :] = self._kv.scratch_block
        rows[:] = 0
        if batch is not None:
            paged = batch.paged
            tok[:t], pos[:t] = batch.token_ids, batch.positions
            ctx[:s], qsl[: s + 1] = paged.context_lens, paged.query_start_loc
            bt = paged.block_tables
            tables[:s, : bt.shape[1]] = bt[:, :width]
            rows[: batch.sample_rows.size] = batch.sample_rows
        else:
            qsl[0] = 0
        tok[t:] = 0
        pos[t:] = np.arange(bucket - t)
        ctx[s], ctx[s + 1 :] = bucket - t, 0
        qsl[s + 1 :] = bucket
        st.packed.copy_(pinned, non_blocking=True)

    def _capture_mixed(self, run_ops: Callable[[StepBatch], Array], batch: StepBatch, bucket: int, cap: int,
                       width: int) -> _Graph:  # fmt: skip
        return self._record(run_ops, batch, self._mixed_step(bucket, cap, width), self._fill_mixed)

    def _graph_pool(self) -> Any:
        """The private memory pool that every captured step allocates from, held open for the backend's
        life by a graph of its own (``_pool_anchor``: one 4-byte fill). torch counts the graphs that
        use a pool; when every step is dropped (``mgx-run tune`` drops them all between its trials)
        the count falls to zero, and while a tensor allocated in the pool is still alive torch keeps
        the pool and refuses the next capture into it with an internal assert (torch 2.11 on the
        H200, the 154th run: 8B INT4 after tune's first trial)."""
        pool = torch.cuda.graph_pool_handle()
        self._pool_anchor = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self._pool_anchor, pool=pool):
            torch.zeros(1, dtype=torch.int32, device=self.device)
        return pool

    def _capture(self, run_ops: Callable[[StepBatch], Array], batch: StepBatch, bucket: int, width: int) -> _Graph:
        return self._record(run_ops, batch, self._static_step(bucket, width), self._fill)

    def _record(self, run_ops: Callable[[StepBatch], Array], batch: StepBatch, st: _Step,
                fill: Callable[[_Step, StepBatch | None, torch.Tensor], None]) -> _Graph:  # fmt: skip
        """``run_ops`` on the static step ``st``, filled by ``fill`` with padding only (warming up
        writes only the scratch block, nothing a sequence owns): run twice, then captured."""
        fill(st, None, st.host)
        self._step = st
        try:
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):  # compile every kernel and let the allocator settle
                    run_ops(batch)
                    self._pending.clear()
            torch.cuda.current_stream(self.device).wait_stream(side)
            if self._pool is None:
                self._pool = self._graph_pool()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                out = run_ops(batch)
                if not isinstance(out, tuple):
                    out = out.float()
            self._pending.clear()
        finally:
            self._step = None
        return _Graph(graph, st, out)

    # -- ops ------------------------------------------------------------------------------------

    @property
    def _cur(self) -> _Step:
        st = self._step
        assert st is not None, "ops run inside execute()"
        return st

    def embedding(self, op: Op, tokens: np.ndarray) -> Array:
        if self.fused_mlp and self._mlp_rows is not None:  # the step starts: the fused MLPs add into zeroed rows
            self._mlp_rows.zero_()
        w = self._weights[id(op)]
        ids = self._cur.token_ids
        if w.scheme == "none":
            return w.weight.index_select(0, ids)
        config = self.tunings.lookup(EMBEDDING_ROWS, weight_signature(w), ids.shape[0])
        return dequantize(w, self.dtype, rows=ids, config=config)  # one kernel: the rows' codes, scales and zeros

    def rms_norm(self, op: Op, x: Array) -> Array:
        done = self._pending.pop(id(op), None)
        if done is not None:
            return done
        weight, eps, group = self._norm[id(op)]
        if group != x.shape[1] and x.stride(0) != x.shape[1]:
            x = x.contiguous()  # q/k norm of a split view: groups need whole rows
        return self._rms_norm(x, weight, eps, group)

    def _rms_norm(self, x: Array, weight: Array | None, eps: float, group: int,
                  residual: Array | None = None) -> Array | tuple[Array, Array]:  # fmt: skip
        """``rms_norm`` on the native kernel, or on the Triton one with its stored configuration."""
        config = self.tunings.rms_norm(x.shape[1], group, residual is not None, x.shape[0])
        return rms_norm(x, weight, eps, group=group, residual=residual, kernels=self.cuda_kernels, config=config)

    def linear(self, op: Op, x: Array) -> Array:
        w, m = self._weights[id(op)], x.shape[0]
        silu = self._fuse.silu_after_linear.get(id(op))
        bias = self._bias[id(op)]
        normed = self._pending.pop(id(op), None)
        across = self._across(op, x) if normed is None else None
        if across is not None:  # held back: its add runs it (``add``)
            self._pending[id(across.add)] = across
            return x
        if isinstance(normed, _FusedRows):  # down, run with gate/up by the fused MLP: the add reads its row
            return normed.rows
        if isinstance(normed, _StagedX) and self._fuses_mlp(op, x, w, bias):
            silu, down, _ = self._fuse.mlp[id(op)]
            rows = fused_mlp(normed.rec, w, self._weights[id(down)], kernels=self.cuda_kernels,
                             out=self._mlp_rows[self._mlp_row_of[id(op)]])  # fmt: skip
            self._pending[id(silu)] = rows  # a stand-in: only down reads the product, and down is done
            self._pending[id(down)] = _FusedRows(rows)
            return rows
        if isinstance(normed, _StagedX):  # x staged by its norm: the kind's staged twin reads the record
            out = gemv_staged(normed.rec, w, bias, kernels=self.cuda_kernels, silu_mul=silu is not None, kind=normed.kind)
        elif isinstance(normed, NormIn):  # x is the norm's input, normalized as the GEMV loads it
            run = linear if silu is None else linear_silu_mul
            out = run(x, w, bias, config=self._config(op, m), workspace=self._split_ws, norm=normed)
        elif normed is not None:  # x is the residual: the add and the norm before this op run in the prologue
            kind, norm = normed
            out = gemv(x, w, bias, kernels=self.cuda_kernels, silu_mul=silu is not None, kind=kind, norm=norm)
        elif dense_product(w, m):
            # Dense weights and several rows: cuBLAS (the Triton GEMM has nothing to dequantize and
            # is slower); quantized weights and a long prefill: dequantize once, then cuBLAS. A fused
            # gate/up then takes the SiLU product in a second, small kernel.
            dense = w.weight
            if w.scheme != "none":
                tuned = self.tunings.lookup(DEQUANTIZE, weight_signature(w), m)
                dense = dequantize(w, self.dtype, out=self._dequant_buf, config=tuned)
            out = torch.nn.functional.linear(x, dense, bias)
            if silu is not None:
                out = self._silu_mul(out)
        else:
            config = self._config(op, m)
            # One row: the native GEMV where the stored tuning chose it, or (untuned) for quantized
            # weights, when the artifact's kernels hold it; the Triton kernels otherwise.
            native = self._native_kind(x, w, bias, config)
            if native:
                out = gemv(x, w, bias, kernels=self.cuda_kernels, silu_mul=silu is not None, kind=native)
            elif silu is not None:
                out = linear_silu_mul(x, w, bias, config=config, workspace=self._split_ws)
            else:
                out = linear(x, w, bias, config=config, workspace=self._split_ws)
        if silu is not None:
            self._pending[id(silu)] = out
        return out

    def _fuses_mlp(self, op: Op, x: Array, w: GpuWeight, bias: Array | None) -> bool:
        """Whether gate/up ``op`` and the down after it run as one fused MLP launch (``MGX_CUDA_FUSED_MLP``,
        x staged, rows made, no biases, and ``fused_mlp_applies``)."""
        if not self.fused_mlp or id(op) not in self._mlp_row_of or bias is not None:  # rows: made for these only
            return False
        down = self._fuse.mlp[id(op)][1]
        return self._bias[id(down)] is None and fused_mlp_applies(self.cuda_kernels, x, w, self._weights[id(down)])

    def _native_kind(self, x: Array, w: GpuWeight, bias: Array | None, config: LinearConfig | None) -> str:
        """The native GEMV kind that runs one row of ``w`` under ``config`` ("" for the Triton kernels):
        the stored tuning's choice, or (untuned) the CUDA-core ``gemv`` for quantized weights (the integer
        tensor-core ``imma`` for weights in the cuda_tile16 layout, which only the imma kinds read), where
        the artifact's kernels hold it."""
        untuned = "imma" if w.layout == "cuda_tile16" else "gemv" if w.scheme != "none" else ""
        native = config.native if config is not None else untuned
        if x.shape[0] == 1 and native and (config is None or self.tuned_gemvs):
            return native if gemv_applies(self.cuda_kernels, x, w, bias, kind=native) else ""
        return ""

    def _config(self, op: Op, m: int) -> LinearConfig | None:
        """The stored tuning for linear ``op`` at ``m`` rows (as the fused gate/up SiLU product where it is one)."""
        kernel = "linear" if id(op) not in self._fuse.silu_after_linear else "linear_silu_mul"
        return self.tunings.config(kernel, self._weights[id(op)], m)

    def _runs_triton(self, op: Op, x: Array, *, gemv_only: bool) -> tuple[bool, LinearConfig | None]:
        """Whether ``linear`` runs ``op`` on x's rows with the Triton linear kernels (``gemv_only``: as
        the one-row GEMV), and with which stored configuration."""
        w, m = self._weights[id(op)], x.shape[0]
        if dense_product(w, m):
            return False, None
        config = self._config(op, m)
        if self._native_kind(x, w, self._bias[id(op)], config):
            return False, config
        return not gemv_only or runs_gemv(m, w, config, x.dtype), config

    def _across(self, op: Op, x: Array) -> _Across | None:
        """``op`` held back for ``norm_across`` (see the module docstring), or None where that fusion
        does not run: switched off, a grouped norm, the norm's reader on weights outside
        ``NORM_IN_SCHEMES`` (W8A16 ones unless ``norm_across_w8a16``, dense ones unless
        ``norm_across_dense``), or the projection not on the Triton kernels."""
        chain = self._fuse.norm_across.get(id(op)) if self.norm_across else None
        if chain is None or self._norm[id(chain[1])][2] != self._weights[id(op)].n:
            return None
        scheme = self._weights[id(chain[2])].scheme
        switched_on = {"w8a16": self.norm_across_w8a16, "none": self.norm_across_dense}
        if scheme not in NORM_IN_SCHEMES and not switched_on.get(scheme, False):
            return None
        runs, config = self._runs_triton(op, x, gemv_only=False)
        return _Across(op, x, config, chain[0], chain[2]) if runs else None

    def _add_across(self, held: _Across, residual: Array, norm_op: Op, weight: Array | None, eps: float,
                    group: int) -> Array:  # fmt: skip
        """The held projection plus ``residual`` with its rows' squares; the norm then runs in its
        reader's loads where that is the Triton one-row GEMV, else as a kernel of its own."""
        proj = held.proj
        total, squares = linear_add_squares(held.x, self._weights[id(proj)], self._bias[id(proj)], residual,
                                            config=held.config, workspace=self._split_ws)  # fmt: skip
        if self._runs_triton(held.reader, total, gemv_only=True)[0]:
            self._pending[id(norm_op)] = total  # the norm's value: a stand-in its one reader normalizes
            self._pending[id(held.reader)] = NormIn(squares, weight, eps)
        else:
            self._pending[id(norm_op)] = self._rms_norm(total, weight, eps, group)
        return total

    def split(self, op: Op, x: Array) -> list[Array]:
        return list(torch.split(x, [int(s) for s in op.attrs["sizes"]], dim=1))

    def rope(self, op: Op, q: Array, k: Array, positions: np.ndarray) -> tuple[Array, Array]:
        attn = self._fuse.rope_into_attention.get(id(op))
        if attn is not None:
            self._pending[id(attn)] = op  # rotated in the attention op's prologue
            return q, k
        inv_freq, head_dim, rotary_dim, scaling = self._inv_freq[id(op)]
        return rope_(q, k, self._cur.positions, inv_freq, head_dim=head_dim, rotary_dim=rotary_dim,
                        attention_scaling=scaling)  # fmt: skip

    def attention(self, op: Op, q: Array, k: Array, v: Array, batch: StepBatch, kv: KVCache) -> Array:
        a = self._attn[id(op)]
        st = self._cur
        kc, vc = kv.k[a.layer], kv.v[a.layer]
        rope_op = self._pending.pop(id(op), None)
        decode = st.max_query_len == 1 and q.shape[0] == st.context_lens.shape[0]
        if rope_op is not None:
            inv_freq, head_dim, rotary_dim, scaling = self._inv_freq[id(rope_op)]
            if decode and self._decode_fusion and head_dim == a.head_dim:
                return self._decode(q, kc, vc, a, DecodeRope(k, v, inv_freq, rotary_dim, scaling))
            rope_and_write_kv(q, k, v, st.positions, inv_freq, kc, vc, st.block_tables, st.query_start_loc,
                              head_dim=head_dim, rotary_dim=rotary_dim, attention_scaling=scaling,
                              config=self.tunings.lookup(ROPE_KV, self._attn_sig[id(op)], q.shape[0]))  # fmt: skip
        else:
            write_kv(k, v, st.positions, kc, vc, st.block_tables, st.query_start_loc)
        if st.fresh is not None and not a.window and self._sdpa_modes:
            out = self._sdpa_fresh(q, k, v, st.fresh, a)
            if out is not None:
                return out
        if decode:
            return self._decode(q, kc, vc, a, None)
        tuned = self.tunings.lookup(ATTENTION_PREFILL, self._attn_sig[id(op)], st.max_query_len)
        return paged_attention_prefill(
            q, kc, vc, st.block_tables, st.context_lens, st.query_start_loc, st.positions,
            scale=a.scale, sliding_window=a.window, max_query_len=st.max_query_len,
            **(dataclasses.asdict(tuned) if tuned is not None else {}),
        )  # fmt: skip

    def _decode(self, q: Array, kc: Array, vc: Array, a: AttentionAttrs, rope: DecodeRope | None) -> Array:
        """Decode attention of the step's one row per sequence (``rope``: q, k unrotated, K/V unwritten)."""
        st = self._cur
        config = self._decode_config(q.shape[0])
        splits = st.decode_splits
        if splits is None:  # as the kernel would choose them
            splits = decode_splits(q.shape[0], a.num_kv_heads, st.max_context_len, num_sms(q.device), config.block_n,
                                   self._decode_min_tiles)  # fmt: skip
        counters = self._decode_counters
        if counters is not None and (q.shape[0] * a.num_kv_heads > counters.numel() or splits > SELF_MERGE_MAX_SPLITS):
            counters = None
        merge = self.tunings.lookup(DECODE_MERGE, self._decode_sig, q.shape[0]) if counters is None and splits > 1 else None
        return paged_attention_decode(
            q, kc, vc, st.block_tables, st.context_lens, scale=a.scale, sliding_window=a.window,
            num_splits=splits, max_context_len=st.max_context_len, counters=counters, rope=rope,
            block_n=config.block_n, num_warps=config.num_warps, merge=merge,
        )  # fmt: skip

    def _decode_config(self, rows: int) -> DecodeConfig:
        """The decode attention's launch configuration at ``rows`` sequences, one for every layer (the
        graphs' splits are computed for its tile width): the autotune pass's entry for that bucket
        and the model's decode shape (``_decode_sig``), its width replaced where the environment or
        ``mgx-run tune``'s switch pinned one (``narrow_decode_tiles``); else the kernel's defaults."""
        config = self.tunings.lookup(ATTENTION_DECODE, self._decode_sig, rows) or DecodeConfig()
        if self._decode_width is not None:
            config = dataclasses.replace(config, block_n=self._decode_width)
        return config

    @property
    def narrow_decode_tiles(self) -> bool:
        """Whether batch 1's decode attention runs on 32-token tiles. Setting it pins the width for
        every batch (the environment, tune's switch and A/Bs do), over what autotune stored."""
        return self._decode_config(1).block_n == 32

    @narrow_decode_tiles.setter
    def narrow_decode_tiles(self, on: bool) -> None:
        self._decode_width = 32 if on else 64

    @property
    def _decode_min_tiles(self) -> int:
        return 1 if self.one_tile_pieces else 2

    def _sdpa_fresh(self, q: Array, k: Array, v: Array, qsl: tuple[int, ...], a: AttentionAttrs) -> Array | None:
        """Fresh prompts through one of SDPA's fused kernels (never its math fallback, which ran a
        2,048-token prompt in fp32 at a fifth of the paged kernel's rate on an H200). A mode that no
        fused kernel takes is dropped for good; with none left, None (the paged kernel runs) and one
        warning. torch's own reasons for refusing a kernel are silenced until a call has succeeded
        (afterwards a refusal is rare, and the warning context costs a few microseconds per layer)."""
        while self._sdpa_modes:
            gqa = self._sdpa_modes[0] == "gqa"
            try:
                with _no_math_sdp():
                    if self._sdpa_proven:
                        return _fresh_attention(q, k, v, qsl, a, gqa=gqa)
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")  # summed up below
                        out = _fresh_attention(q, k, v, qsl, a, gqa=gqa)
                self._sdpa_proven = True
                return out
            except RuntimeError as e:
                if not any(m in str(e) for m in SDPA_REFUSALS):
                    raise  # out of memory and the like are not a refusal
                mode = self._sdpa_modes.pop(0)
                if not self._sdpa_modes:
                    warnings.warn(f"MGX: no fused SDPA kernel takes fresh prompts here ({mode}: {e}); "
                                  "the paged prefill kernel runs them", RuntimeWarning, stacklevel=2)  # fmt: skip
        return None

    def silu_mul(self, op: Op, gate: Array, up: Array | None) -> Array:
        done = self._pending.pop(id(op), None)
        if done is not None:
            return done
        if up is None:
            return self._silu_mul(gate)
        # In the compute dtype, rounding where transformers does: silu(gate), then the product.
        return torch.nn.functional.silu(gate.float()).to(self.dtype).float().mul_(up.float()).to(self.dtype)

    def _silu_mul(self, x: Array) -> Array:
        """silu(gate) * up of x [T, 2F] with its stored configuration."""
        return silu_mul(x, config=self.tunings.lookup(SILU_MUL, silu_signature(x.shape[1] // 2), x.shape[0]))

    def add(self, op: Op, a: Array, b: Array) -> Array:
        norm_op = self._fuse.norm_after_add.get(id(op))
        fused = _fused_row(a, b)
        if norm_op is None:
            return a + b if fused is None else fused[1] + fixed_to(fused[0].view(1, -1), fused[1].dtype)
        weight, eps, group = self._norm[id(norm_op)]
        held = self._pending.pop(id(op), None)
        if isinstance(held, _Across):  # its projection adds the residual and leaves the norm's squares
            return self._add_across(held, b if a is held.x else a, norm_op, weight, eps, group)
        if fused is not None:
            rows, res = fused
            total = self._norm_stage_fx_into_gemv(norm_op, res, rows, weight, eps, group)
            if total is not None:
                return total
            a, b = res, fixed_to(rows.view(1, -1), res.dtype)  # the row as the GEMV would have written it

        total = self._norm_into_gemv(norm_op, a, b, weight, eps, group)
        if total is None:
            total = self._norm_stage_into_gemv(norm_op, a, b, weight, eps, group)
        if total is not None:
            return total
        normed, total = self._rms_norm(a, weight, eps, group, residual=b)
        self._pending[id(norm_op)] = normed
        return total

    def _norm_into_gemv(self, norm_op: Op, a: Array, b: Array, weight: Array | None, eps: float, group: int) -> Array | None:
        """One row whose norm feeds one linear that a native GEMV takes: the add and the norm become
        that GEMV's prologue. Returns the sum it will write (the add's output), or None where it cannot.
        As for a plain row: the stored tuning's native kind, none where Triton won; untuned,
        quantized weights only, the tensor-core kernel for int4 where it applies, else the CUDA-core one."""
        lin = self._one_row_reader(norm_op, a, group) if self._norm_gemv else None
        if lin is None:
            return None
        w, bias = self._weights[id(lin)], self._bias[id(lin)]
        config = self._config(lin, 1)
        if (config is None and w.scheme == "none") or (config is not None and not (config.native and self.tuned_gemvs)):
            return None
        # Untuned: the tensor-core kernel for int4 only (the W8A16 one runs where autotune measured it
        # faster); for weights in cuda_tile16 the imma kind (the only one that reads that layout).
        untuned = ("imma",) if w.layout == "cuda_tile16" else ("mma", "gemv") if w.scheme == "int4" else ("gemv",)
        kinds = [config.native] if config is not None else [k for k in untuned if (k, w.scheme) in GEMV_ENTRIES]
        norm = NormPrologue(b, weight, eps, torch.empty_like(a))
        for kind in kinds:
            if gemv_applies(self.cuda_kernels, a, w, bias, kind=kind, norm=norm):
                self._pending[id(norm_op)] = a  # the norm op's value: a stand-in no kernel reads
                self._pending[id(lin)] = (kind, norm)
                return norm.total
        return None

    def _one_row_reader(self, norm_op: Op, a: Array, group: int) -> Op | None:
        """The one linear that reads ``norm_op``'s output, where the norm after an add is of one row
        (x [1, K], the whole row one group); else None."""
        return self._fuse.linear_after_norm.get(id(norm_op)) if a.shape[0] == 1 and group == a.shape[1] else None

    def _norm_stage_into_gemv(self, norm_op: Op, a: Array, b: Array, weight: Array | None, eps: float,
                              group: int) -> Array | None:  # fmt: skip
        """One row whose add + RMSNorm feeds one linear on an imma kind with a staged twin (the
        stored tuning's, on ``STAGED_SCHEMES`` weights by default or any with ``MGX_CUDA_STAGED_X=1``;
        else the kind named): the norm's kernel also stages its output (``norm_stage``) and the linear
        runs the twin on that record. Returns the add's output, or None where it does not apply."""
        reader = self._staged_reader(norm_op, a, group)
        if reader is None:
            return None
        lin, kind = reader
        norm = NormPrologue(b, weight, eps, torch.empty_like(a))
        if not norm_stage_applies(self.cuda_kernels, a, norm, self._weights[id(lin)].scheme):
            return None
        normed, rec = norm_stage(a, norm, self._weights[id(lin)].scheme, kernels=self.cuda_kernels)
        self._pending[id(norm_op)] = normed
        self._pending[id(lin)] = _StagedX(kind, rec)
        return norm.total

    def _staged_reader(self, norm_op: Op, a: Array, group: int, scheme: str | None = None) -> tuple[Op, str] | None:
        """The one linear reading ``norm_op``'s one row and the kind whose staged twin runs it (the stored
        tuning's, on ``STAGED_SCHEMES`` weights by default or any with ``MGX_CUDA_STAGED_X=1``; else the
        kind named), where the staged switch and the kernels take it (and its weights are ``scheme``'s
        where given); else None."""
        lin = self._one_row_reader(norm_op, a, group) if self.staged_x else None
        if lin is None or not self._stages(self._weights[id(lin)].scheme):
            return None
        w, bias = self._weights[id(lin)], self._bias[id(lin)]
        if scheme is not None and w.scheme != scheme:
            return None
        config = self._config(lin, 1)
        kind = self.staged_kind or (config.native if config is not None and self.tuned_gemvs else "")
        return (lin, kind) if staged_applies(self.cuda_kernels, a, w, kind, bias) else None

    def _norm_stage_fx_into_gemv(self, norm_op: Op, res: Array, rows: Array, weight: Array | None, eps: float,
                                 group: int) -> Array | None:  # fmt: skip
        """``_norm_stage_into_gemv`` where the add's other input is a fused MLP's fixed-point row:
        ``norm_stage_fx`` normalizes res + that row and stages it for the staged twin of the one linear
        reading the norm. Returns the add's output, or None where it does not apply (the caller then
        turns the row into the compute dtype and takes the usual path)."""
        reader = self._staged_reader(norm_op, res, group, scheme="int4")  # norm_stage_fx stages for int4
        if reader is None or not norm_stage_applies(self.cuda_kernels, res, NormPrologue(None, weight, eps), "int4"):
            return None
        lin, kind = reader
        total = torch.empty_like(res)
        normed, rec = norm_stage_fx(res, rows, weight, eps, total, kernels=self.cuda_kernels)
        self._pending[id(norm_op)] = normed
        self._pending[id(lin)] = _StagedX(kind, rec)
        return total

    def lm_head(self, op: Op, x: Array, rows: np.ndarray) -> Array:
        """The sampling rows' logits [R, V] in fp32 (as the greedy head takes its argmax: not rounded
        to the compute dtype, so that a greedy request in a batch with sampling ones picks as it would
        alone). Dense weights with more than GEMV_MAX_M (1) rows go to cuBLAS, which writes fp32 where
        this torch's ``mm`` takes ``out_dtype`` (``_mm_fp32``), else logits in the compute dtype."""
        x, w = self._sampled(x), self._weights[id(op)]
        if w.scheme == "none" and x.shape[0] > GEMV_MAX_M:
            if not self._mm_fp32:
                return torch.nn.functional.linear(x, w.weight, self._bias[id(op)])
            out = torch.mm(x, w.weight.t(), out_dtype=torch.float32)  # cuBLAS, fp32 out: as the kernels
            bias = self._bias[id(op)]
            return out if bias is None else out.add_(bias)
        # A vocabulary is wide enough to fill the GPU without splitting K (and the workspace is sized
        # for the linear ops).
        config = self.tunings.config("linear", w, x.shape[0]) or default_config(x.shape[0], w.n, w.k, w.scheme)
        out = torch.empty((x.shape[0], w.n), dtype=torch.float32, device=x.device)
        return linear(x, w, self._bias[id(op)], out=out, config=dataclasses.replace(config, split_k=1))

    def greedy_head(self, op: Op, x: Array, rows: np.ndarray) -> tuple[Array, Array]:
        """Greedy tokens and their fp32 logits: one row on the native kind the stored tuning chose
        (``gemv_argmax``) where the artifact's kernels hold it, else the Triton LM head; either one's
        merge of the tiles' argmaxes with the stored configuration for that many tiles."""
        x, w, bias = self._sampled(x), self._weights[id(op)], self._bias[id(op)]
        m = x.shape[0]
        config = self.tunings.config("lm_head_argmax", w, m)
        native = config.native if config is not None and self.tuned_gemvs else ""
        if native and gemv_applies(self.cuda_kernels, x, w, bias, kind=native, argmax=True):
            merge = self.tunings.lookup(ARGMAX_MERGE, merge_signature(argmax_groups(w)), m)
            return gemv_argmax(x, w, bias, kernels=self.cuda_kernels, kind=native, merge=merge)
        merge = self.tunings.lookup(ARGMAX_MERGE, merge_signature(lm_head_tiles(w.n, config, m, w.k, w.scheme)), m)
        return lm_head_argmax(x, w, bias, config=config, merge=merge)

    def _sampled(self, x: Array) -> Array:
        st = self._cur
        return x if st.sample_rows.shape[0] == x.shape[0] else x.index_select(0, st.sample_rows)


@contextlib.contextmanager
def _no_math_sdp() -> Iterator[None]:
    """SDPA may pick any of its fused kernels but not the math fallback. (``torch.nn.attention.sdpa_kernel``
    does the same through a backend list, at about 30 us per use on the VM against 1 us here.)"""
    was = torch.backends.cuda.math_sdp_enabled()
    torch.backends.cuda.enable_math_sdp(False)
    try:
        yield
    finally:
        torch.backends.cuda.enable_math_sdp(was)


def _fresh_attention(q: Array, k: Array, v: Array, qsl: tuple[int, ...], a: AttentionAttrs, *, gqa: bool) -> Array:
    """Causal attention of prompts with nothing cached, from their new q, k, v [T, H*D] (rotated)
    through torch's SDPA (FlashAttention on the GPU: about twice the paged prefill kernel's rate at
    2,048 tokens on an H200), one sequence at a time; the paged cache is written all the same.

    The fused kernels take only 4-D [batch, heads, tokens, head_dim] inputs. With ``gqa`` SDPA maps
    query heads to KV heads itself (``enable_gqa``); without, K and V are expanded to every query
    head first (query head h reads KV head h // (num_heads / num_kv_heads), as in the model)."""
    d, hq, hk = a.head_dim, a.num_heads, a.num_kv_heads
    one = len(qsl) == 2  # one prompt: its output is the result, no copy into a shared buffer
    out = None if one else torch.empty((q.shape[0], hq * d), dtype=q.dtype, device=q.device)
    for lo, hi in zip(qsl, qsl[1:]):
        n = hi - lo
        kk, vv = k[lo:hi].view(n, hk, d), v[lo:hi].view(n, hk, d)
        if hq != hk and not gqa:
            kk, vv = kk.repeat_interleave(hq // hk, dim=1), vv.repeat_interleave(hq // hk, dim=1)
        o = torch.nn.functional.scaled_dot_product_attention(
            q[lo:hi].view(n, hq, d).transpose(0, 1)[None], kk.transpose(0, 1)[None], vv.transpose(0, 1)[None],
            is_causal=True, scale=a.scale, enable_gqa=gqa and hq != hk,
        )  # fmt: skip
        if one:
            # The fused kernels write [tokens, heads, head_dim] memory behind the [heads, tokens]
            # view, so this reshape is a view there (a copy otherwise).
            return o[0].transpose(0, 1).reshape(n, hq * d)
        out[lo:hi].view(n, hq, d).copy_(o[0].transpose(0, 1))
    return out


def _mixed_cuts(bucket: int, cap: int, width: int) -> np.ndarray:
    """Where each part of a mixed graph's packed int32 buffer ends: [token ids | positions | context
    lengths | query starts (``cap`` + 1, then 3 unused) | block tables], then the sampled rows
    (``cap``) to the end; buckets and capacities are multiples of 4, so every part starts 16 bytes in."""
    return np.cumsum([bucket, bucket, cap, cap + 4, cap * width])


def _decode_buffers(bucket: int, width: int, device: torch.device | str) -> dict[str, torch.Tensor]:
    """A decode graph's packed int32 buffer, [token ids | positions | context lengths | block tables]
    (each part 16 bytes in), the ``_Step`` fields that view it, and its host twin (pinned on a GPU)."""
    a = _aligned_ints(bucket)
    packed = torch.zeros(3 * a + bucket * width, dtype=torch.int32, device=device)
    return {"token_ids": packed[:bucket], "positions": packed[a : a + bucket], "context_lens": packed[2 * a : 2 * a + bucket],
            "block_tables": packed[3 * a :].view(bucket, width), "packed": packed,
            "host": torch.zeros(packed.shape, dtype=torch.int32, pin_memory=packed.is_cuda)}  # fmt: skip


def _prefill_cuts(bucket: int, width: int) -> tuple[int, int, int]:
    """Where a prefill graph's context length, block table and sampled row start in its packed
    int32 buffer (after ``bucket`` token ids and ``bucket`` positions), each 16 bytes in."""
    table = 2 * bucket + 4
    return 2 * bucket, table, table + _aligned_ints(width)


def _to_host(out: Any) -> Any:
    """Device logits (or the greedy pair) -> host numpy: float32 logits, int64 ids."""
    if isinstance(out, tuple):
        ids, top = out
        return ids.cpu().numpy().astype(np.int64), top.float().cpu().numpy()
    return out.float().cpu().numpy()


def _users(graph: Graph) -> dict[str, list[Op]]:
    users: dict[str, list[Op]] = {}
    for op in graph.ops:
        for name in op.inputs:
            users.setdefault(name, []).append(op)
    for name in graph.outputs:
        users.setdefault(name, []).append(None)  # type: ignore[arg-type]  # read by the caller
    return users


def _arena_pieces(arrays: list[np.ndarray]) -> tuple[list[tuple[int, np.ndarray]], int]:
    """Where ``arrays`` lie in the device arena, one after the other at _ALIGN-byte offsets: the
    (offset, array) pieces ``_copy_to_arena`` takes, and the arena's size."""
    pieces, total = [], 0
    for a in arrays:
        pieces.append((total, a))
        total += -(-a.nbytes // _ALIGN) * _ALIGN
    return pieces, total


@dataclass(frozen=True, slots=True)
class _StageLoad:
    """One fill of a staging buffer: ``fill`` bytes for the arena at ``start``, gathered by ``copies``
    (position in the buffer, source bytes, position in the source, length)."""

    start: int
    fill: int
    copies: tuple[tuple[int, np.ndarray, int, int], ...]


def _stage_loads(pieces: list[tuple[int, np.ndarray]], stage_bytes: int) -> list[_StageLoad]:
    """How ``pieces`` (arena offset, array; in increasing offsets) pass through staging buffers of
    ``stage_bytes``: consecutive pieces share a buffer, the alignment padding between them included,
    and a piece longer than the room left continues in the next."""
    loads: list[_StageLoad] = []
    copies: list[tuple[int, np.ndarray, int, int]] = []
    start = fill = 0

    def close() -> None:
        nonlocal copies, fill
        if fill:
            loads.append(_StageLoad(start, fill, tuple(copies)))
        copies, fill = [], 0

    for off, a in pieces:
        flat = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        if fill:
            gap = off - (start + fill)  # the alignment padding before this piece
            if 0 <= gap and fill + gap < stage_bytes:
                fill += gap
            else:
                close()
        if not fill:
            start = off
        pos = 0
        while pos < flat.size:
            n = min(flat.size - pos, stage_bytes - fill)
            copies.append((fill, flat, pos, n))
            fill += n
            pos += n
            if fill == stage_bytes:
                close()
                start = off + pos
    close()
    return loads


_FILL_SLICE = 4 << 20  # bytes a thread copies at a time into a staging buffer


def _fill_stage(view: np.ndarray, load: _StageLoad, pool: ThreadPoolExecutor | None) -> None:
    """Gather ``load``'s bytes into the staging buffer ``view``: slices of _FILL_SLICE on ``pool``'s
    threads at once (numpy's copies release the GIL, and the mapped file's page faults and the copies
    spread over the cores), or in this thread without one."""
    slices = [(at + o, src, pos + o, min(_FILL_SLICE, n - o)) for at, src, pos, n in load.copies
              for o in range(0, n, _FILL_SLICE)]  # fmt: skip

    def copy(s: tuple[int, np.ndarray, int, int]) -> None:
        at, src, pos, n = s
        view[at : at + n] = src[pos : pos + n]

    if pool is None or len(slices) == 1:
        for piece in slices:
            copy(piece)
    else:
        for _ in pool.map(copy, slices):
            pass


def _env_count(name: str, default: int, what: str) -> int:
    """A positive whole number from environment variable ``name`` (``default`` where unset); EngineError
    (which the CLI prints as it is) for any other value."""
    raw = os.environ.get(name, "")
    try:
        n = int(raw) if raw else default
    except ValueError:
        raise EngineError(f"{name} must be a whole number of {what}, got {raw!r}") from None
    if n < 1:
        raise EngineError(f"{name} must be at least 1, got {n}")
    return n


def _upload_threads() -> int:
    """Threads that fill the staging buffers (``MGX_CUDA_UPLOAD_THREADS``; default: up to 8 cores)."""
    return _env_count("MGX_CUDA_UPLOAD_THREADS", min(8, os.cpu_count() or 1), "threads")


def _stream_stages(loads: list[_StageLoad], views: list[np.ndarray], send: Callable[[int, _StageLoad], None],
                   wait: Callable[[int], None], threads: int) -> None:  # fmt: skip
    """Fill the staging buffers ``views`` in turn with ``loads`` and ``send`` each (buffer index, load)
    on its way, after ``wait`` (buffer index) says that buffer's previous send is done with it."""
    with contextlib.ExitStack() as stack:
        pool = stack.enter_context(ThreadPoolExecutor(threads, "mgx-upload")) if threads > 1 else None
        for i, load in enumerate(loads):
            cur = i % len(views)
            wait(cur)
            _fill_stage(views[cur], load, pool)
            send(cur, load)


def _copy_to_arena(arena: torch.Tensor, pieces: list[tuple[int, np.ndarray]], pinned: bool,
                   threads: int | None = None) -> int:  # fmt: skip
    """Copy host arrays to their byte offsets in ``arena``; returns the number of device copies made.

    On a GPU the bytes go through two pinned staging buffers in turn: while the copy engine moves one
    to the device, the host fills the other from the mapped file (``threads`` threads at once; default
    ``_upload_threads``).
    """
    if not pinned:  # a CPU arena (tests): plain copies
        host = arena.numpy()
        for off, a in pieces:
            flat = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
            host[off : off + flat.size] = flat
        return len(pieces)
    threads = _upload_threads() if threads is None else threads
    stage_bytes = _env_count("MGX_CUDA_STAGE_MB", 64, "MiB") << 20
    loads = _stage_loads(pieces, stage_bytes)
    stages = [torch.empty(stage_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(min(2, len(loads)))]
    done: list[torch.cuda.Event | None] = [None] * len(stages)  # the event after each stage's last copy
    stream = torch.cuda.Stream(arena.device)

    def send(cur: int, load: _StageLoad) -> None:
        with torch.cuda.stream(stream):
            arena[load.start : load.start + load.fill].copy_(stages[cur][: load.fill], non_blocking=True)
            done[cur] = torch.cuda.Event()
            done[cur].record(stream)

    def wait(cur: int) -> None:
        if done[cur] is not None:
            done[cur].synchronize()  # the copy engine is done with this stage

    _stream_stages(loads, [s.numpy() for s in stages], send, wait, threads)
    stream.synchronize()
    return len(loads)
