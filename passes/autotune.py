"""autotune: time the Triton kernels on the build GPU for this model's shapes; store the winners.

For target ``cuda`` only, on a machine with a CUDA GPU (the build GPU: choices are stored per GPU
architecture, ``sm_90`` for an H200, and a runtime on another architecture ignores them). For every
distinct linear weight (scheme, layout, int4 group, N, K) and every row count in ``rows`` (decode
batch buckets, and a prefill chunk), each candidate launch configuration of the kernel that op runs
(``linear``, ``linear_silu_mul`` for the fused gate/up projection, ``lm_head_argmax`` for the LM head)
is timed on random activations with the weight's real bytes, and the fastest is kept. At one row the
native CUDA GEMV (``kernels/cuda/gemv.cu``, built with nvcc for the build GPU when nvcc is there) is
timed too, and where it beats the best Triton configuration the entry says so (``native``; the Triton
configuration stays in the entry as the fallback for a runtime without the native code); for the LM
head, the imma kinds' greedy entries (``gemv_argmax``), which must pick the Triton kernel's token. The
LM head of sampling steps (``linear`` into fp32 logits) gets ``linear`` entries of its own
(``_tune_sampling_head``, option ``sampling_head``). The graph is not changed; the choices travel in
the pass result's ``stats["autotune"]`` ({arch: entries}), which the compiler stores in the
artifact, and the CUDA backend reads them instead of tuning at start-up.
``stats["timings"]`` says what the winners measured ({"<kernel> <shape key>": chosen kind, us per
launch, weight GB/s, the best Triton configuration's us and blocks, each native kind's us
(``native_us``), and with ``fused`` how it was timed: "add", "norm", "after_norm" (option
``after_norm``: the time of the norm and the projection) or ""}), for build logs and benchmarks: a
slow build GPU or a shape that lost shows there before any model runs.

The paged attention kernels too (``_tune_attention``): prefill for each chunk length in ``rows`` of
16 and more, and, with ``decode_attention`` (off by default: ``AutotuneOptions`` says why), decode for
each batch bucket; the RoPE + K/V write before them (``_tune_rope``, option ``rope``) and the Triton
RMSNorm (``_tune_norms``, option ``rms_norm``), the native one's fallback, for each of their shapes
and row counts. A candidate of these must first give the default configuration's output. Where the
backend runs a product on cuBLAS instead (``linear.dense_product``: quantized weights from
DEQUANTIZE_MIN_M rows, dense ones past one row; option ``dense_products``), no Triton GEMM is timed;
``dequantize`` of each quantized weight and the SiLU product after each fused gate/up are
(``_tune_dense_path``). So are the merge of the greedy LM head's tile argmaxes, for the tiles the
chosen head leaves (``_tune_argmax_merge``, option ``argmax_merge``), ``dequantize``'s lookup of the
rows of a quantized embedding for each row count (``_tune_embedding_rows``, option
``embedding_rows``), and the merge kernel of split decode attention, where the model's longest
context splits a batch bucket's attention more than the splits merge themselves
(``_tune_decode_merge``, option ``decode_merge``). The winners' times go to
``stats["attention_timings"]`` (attention, RoPE, decode merge) and ``stats["elementwise_timings"]``
(RMSNorm, dequantize, SiLU product, argmax merge, embedding rows) ({"<kernel> <shape key>": chosen
configuration, us, the default configuration's us}).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

from mgx.formats import ir

from ._base import PassContext, PassError, PassResult
from ._common import options_dict, parse_options, to_f32

__all__ = ["AutotuneOptions", "run"]


@dataclass(frozen=True, slots=True)
class AutotuneOptions:
    """model.yaml options of autotune."""

    rows: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 2048)  # activation rows M to tune for
    dtype: str = "bf16"  # compute dtype the runtime will use: bf16, f16 or f32
    repeats: int = 20  # timed launches per candidate (median; L2 flushed between launches)
    native: bool = True  # also time the native CUDA GEMV at one row (needs nvcc on the build host)
    # Time dense one-row projections as the CUDA backend's norm across runs them (``_fused_roles``;
    # the backend gives dense readers the norm only with MGX_CUDA_NORM_ACROSS_DENSE=1 since the
    # fourteenth session): an A/B switch, off until a GPU run shows it choosing better configurations.
    fused: bool = False
    # Time every candidate launched overlapped (programmatic dependent launches: each kernel may start
    # while the one before it finishes) where the CUDA backend launches them so: sm_90 and newer. Timed
    # apart from the way they run, the 8B W8A16 choices cost 0.3 ms a decode step on the H200 (see
    # ``_overlap``); False: time them one after the other (for A/Bs and for runtimes with MGX_CUDA_PDL=0).
    overlapped: bool = True
    # Time the one-row projections that a whole-row add + RMSNorm feeds (QKV and gate/up) after that
    # norm, as the CUDA backend's decode step runs them: on weights it stages x for (``STAGED_SCHEMES``)
    # a kind with a staged twin as ``norm_stage`` + the twin, every other candidate after the plain add
    # + RMSNorm kernel (``_after_norm_launch`` says why). False: each alone, as before the forty-seventh
    # session. ``fused`` takes the dense projections it times.
    after_norm: bool = True
    # Also tune the paged attention kernels for the model's heads. Prefill (tiles, warps, stages) for
    # each row count from PREFILL_MIN_M: one chunk of that many fresh tokens. Decode (tile width and
    # warps) for each row count up to GRAPH_MAX_M: sequences of a batch bucket over ``decode_context``
    # cached tokens (capped by the model's context); off by default, because a decode attention timed
    # alone is a poor guide to the step: the kernel benchmark's best at batch 1 (32-token tiles) gained
    # nothing in the 8B bf16 graph and lost 1% in the 1B ones, and 8 warps lost in the 8B INT4 layer
    # chain (49th session); ``mgx-run tune`` chooses the tile width in the whole step instead. Every
    # candidate must give the default configuration's result (ATTENTION_TOLERANCE) before it is timed.
    prefill_attention: bool = True
    decode_attention: bool = False
    decode_context: int = 1024
    # Also tune the warps of the RoPE + K/V write kernel (``rope_and_write_kv``, a program a token: what
    # runs before the paged attention kernels in prefill and mixed steps; decode steps rotate in the
    # decode kernel) for each attention shape whose RoPE feeds it and each row count.
    rope: bool = True
    # Also tune the kernels around the dense (cuBLAS) products that the CUDA backend runs instead of
    # the Triton GEMM (``linear.dense_product``: quantized weights from DEQUANTIZE_MIN_M rows, dense
    # ones past one row): ``dequantize`` of each quantized weight, once, and the SiLU product
    # (``silu_mul``) after each fused gate/up at each such row count. The Triton GEMM is not timed
    # where it would not run.
    dense_products: bool = True
    # Also tune the LM head of sampling steps (the CUDA backend's ``lm_head``: fp32 logits from the
    # Triton ``linear`` kernel, without split K; stored as the head weight's ``linear`` entries), where
    # it runs: every row count for a quantized head, one row for a dense one (cuBLAS past it). Until the
    # fifty-second session only the greedy head (``lm_head_argmax``) was tuned, so sampling ran the
    # kernel's default configuration.
    sampling_head: bool = True
    # Also tune the Triton RMSNorm for each norm shape (input width, group, residual added first) and
    # row count: on a GPU it runs where the native RMSNorm cannot (a build host without nvcc stores no
    # native code; a driver older than the build's nvcc refuses it). Every candidate must give the
    # default configuration's result first, element by element (ELEMENTWISE_TOLERANCE). False: those runtimes
    # launch its default configuration.
    rms_norm: bool = True
    # Also tune the merge of the greedy LM head's tile argmaxes (``lm_head.merge_tile_argmax``, one
    # program a row, which every greedy decode step runs after the head) for the tiles the chosen head
    # leaves at each row count; its candidates must give the default's tokens and logits exactly.
    argmax_merge: bool = True
    # Also tune the row lookup of each quantized embedding table (``dequantize`` with ``rows``: one
    # kernel gathers and dequantizes the step's tokens' rows) at each row count; its candidates must
    # give the default's rows exactly.
    embedding_rows: bool = True
    # Also tune the merge kernel of split decode attention (``attention.merge_splits``: it runs where a
    # decode step's splits do not merge themselves, more than SELF_MERGE_MAX_SPLITS of them: small
    # batches over long contexts) for each batch bucket whose splits at the model's longest context
    # need it, on that many splits.
    decode_merge: bool = True

    def __post_init__(self) -> None:
        if not self.rows or any(int(m) < 1 for m in self.rows):
            raise PassError(f"autotune: rows must be positive row counts, got {list(self.rows)}")
        object.__setattr__(self, "rows", tuple(sorted({int(m) for m in self.rows})))  # each count once, ascending
        if self.dtype not in ("bf16", "f16", "f32"):
            raise PassError(f"autotune: dtype must be bf16, f16 or f32, got {self.dtype!r}")
        if self.repeats < 1:
            raise PassError(f"autotune: repeats must be >= 1, got {self.repeats}")
        if self.decode_context < 1:
            raise PassError(f"autotune: decode_context must be >= 1 token, got {self.decode_context}")


def _device() -> Any:
    """The build GPU (a torch device) and its architecture name; PassError without one."""
    import torch

    if not torch.cuda.is_available():
        raise PassError("autotune times kernels on the build GPU, and torch sees no CUDA device here; "
                        "compile on a machine with the target GPU, or drop the pass")  # fmt: skip
    major, minor = torch.cuda.get_device_capability()
    return torch.device("cuda"), f"sm_{major}{minor}"


def _native_kernels(graph: ir.Graph) -> Any:
    """The native kernels built and loaded for the build GPU, to time the native GEMV; None without
    nvcc or when nvcc or the driver refuses them (then only Triton configurations are timed)."""
    from mgx.kernels.cuda.build import CudaBuildError, find_nvcc
    from mgx.kernels.cuda.rmsnorm import load_cuda_kernels

    from .cuda_kernels import _build, _device_arch, kernel_flags

    arch = _device_arch()
    if arch is None or find_nvcc() is None:
        return None
    try:
        image = _build(arch, kernel_flags(graph))  # as the cuda_kernels pass builds them for these weights
    except CudaBuildError:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a refused image: the Triton GEMV is timed alone
        return load_cuda_kernels(image, arch)


def _overlap(arch: str, kernels: Any, on: bool) -> bool:
    """Whether the candidates are timed launched overlapped, as the CUDA backend launches its decode
    kernels on ``arch`` (sm_90 and newer; the native ones where their image allows it, which this sets
    on ``kernels``). Why: on the H200 (nineteenth session), in the 8B W8A16 decode graph, the down
    projection on kind ``imma_w16`` took 0.18 ms a step less than on ``imma`` and gate/up on ``imma``
    0.11 ms less than on ``imma_persistent_w4``, though timed one after the other without overlap
    autotune had ranked them the other way round."""
    sm = int(arch[3:]) if arch.startswith("sm_") and arch[3:].isdigit() else 0
    on = on and sm >= 90
    if on and kernels is not None:
        kernels.allow_overlap(sm)  # a freshly loaded image launches one after the other
    return on


PREFILL_MIN_M = 16  # the smallest prefill chunk the attention tuning times
ATTENTION_TOLERANCE = 2e-2  # an attention candidate's relative (Frobenius) distance from the default's output
# An RMSNorm, RoPE, dequantize, SiLU product or decode merge candidate's largest elementwise distance
# from the default's output over its largest |value| (elementwise: one wrong row of 4,096 is 1.6e-2 of
# the whole's norm, within ATTENTION_TOLERANCE). The argmax merge and embedding lookup must match exactly.
ELEMENTWISE_TOLERANCE = 1e-2
KV_BLOCK = 16  # tokens a KV-cache block of the timed attention batches (the engine's default)
GRAPH_LAUNCHES = 8  # launches per captured graph when timing the decode regime
GRAPH_MAX_M = 256  # rows up to which decode steps run as CUDA graphs (the CUDA backend's largest bucket)


def _time(fn: Callable[..., Any], repeats: int, weights: list[Any] | None = None, graph: bool = False) -> float:
    """Median seconds of one launch of ``fn`` on the GPU.

    With ``weights`` (copies of the weight, together several times the L2): as a decode step runs it,
    ``GRAPH_LAUNCHES`` launches back to back in a captured CUDA graph, each on the next copy
    (``fn(w=copy)``), so every launch reads its weight from memory and pays its in-graph start and
    tail. Timed alone with L2 flushed before each launch (``triton.testing.do_bench``), a kernel
    that lost inside the decode graph won (the native GEMV on the 8B shapes; 2026-11-30). With
    ``graph`` and no weights: ``GRAPH_LAUNCHES`` launches of ``fn`` on the same inputs in a graph, for
    kernels of a few microseconds whose eager timing is mostly launch and event noise (do_bench's
    medians of one 8B RMSNorm shape's candidates ranged 4-42 us on an H200). Otherwise, or where
    the capture fails: do_bench."""
    import torch
    from triton.testing import do_bench

    if weights or graph:
        launches = ([functools.partial(fn, w=weights[i % len(weights)]) for i in range(max(GRAPH_LAUNCHES, len(weights)))]
                    if weights else [fn] * GRAPH_LAUNCHES)  # fmt: skip
        try:
            return _time_in_graph(launches, repeats)
        except Exception as e:  # noqa: BLE001 - e.g. a kernel that cannot run inside a capture
            if _does_not_fit(_why(e)):
                raise  # no launch of it runs: its candidate is skipped
            warnings.warn(f"autotune: graph timing failed ({type(e).__name__}: {e}); timing alone", stacklevel=2)
            torch.cuda.synchronize()
    return float(do_bench(fn, warmup=5, rep=repeats, return_mode="median")) / 1e3


def _time_in_graph(launches: list[Callable[[], Any]], repeats: int) -> float:
    import torch

    for launch in launches[:2]:  # compile and load outside the capture
        launch()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for launch in launches:
            launch()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(max(repeats, 3)):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return sorted(times)[len(times) // 2] / 1e3 / len(launches)


def _weight_copies(w: Any, upload: Callable[[], Any], device: Any) -> list[Any] | None:
    """``w`` and enough fresh uploads of it that together they span at least 4x the GPU's L2 (at
    least two); None off a CUDA device (no graph timing there)."""
    import torch

    if device.type != "cuda":
        return None
    l2 = int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)) or 64 << 20
    return [w] + [upload() for _ in range(copies_for(w.nbytes, l2) - 1)]


def _timing(best: tuple[float, Any], triton_s: float, w: Any) -> dict[str, Any]:
    """What the build log says of one tuned shape: the winner (a native kind or "triton"), its time
    per launch and the weight bytes it read per second, and the best Triton configuration's time and
    blocks (M x N x K, warps, stages, split K)."""
    seconds, config = best
    triton = (f"{config.block_m}x{config.block_n}x{config.block_k} w{config.num_warps} s{config.num_stages} "
              f"k{config.split_k}" + (" swap" if config.swap else ""))  # the Triton configuration (the fallback)
    return {"chosen": config.native or "triton", "us": seconds * 1e6, "triton_us": triton_s * 1e6,
            "weight_gb_s": w.nbytes / seconds / 1e9 if seconds > 0 else 0.0, "triton_config": triton}


def _fused_roles(graph: ir.Graph) -> dict[tuple[str, int, int], tuple[str, ir.Op, ir.Op]]:
    """For ``fused``: the dense projections that the CUDA backend runs fused at one row under norm
    across (its ``_find_fusions``: a linear read only by the next op, an add whose output the op
    after it RMS-normalizes, and that norm read only by the linear after it). By (kernel, N, K): the
    producer ("add", its norm, itself), timed with the residual add and the squares in its epilogue,
    and the reader ("norm", its norm, its producer), timed with the norm in its loads. Shapes met in both roles, or where
    no chain holds (the first layer's QKV after the embedding's norm), keep the role most of their
    ops have."""
    ops = graph.ops
    users = _users(graph)
    role_of: dict[int, tuple[str, ir.Op, ir.Op]] = {}  # id(linear) -> its role, its chain's norm and producer
    for i, op in enumerate(ops[:-3]):
        if op.kind == "linear" and users.get(op.outputs[0]) == [ops[i + 1]] and _add_norm_linear(graph, ops[i + 1 : i + 4], users):
            role_of[id(op)] = ("add", ops[i + 2], op)
            role_of[id(ops[i + 3])] = ("norm", ops[i + 2], op)
    votes: dict[tuple[str, int, int], Counter] = {}
    found: dict[tuple[tuple[str, int, int], str], tuple[str, ir.Op, ir.Op]] = {}
    for op in ops:
        if op.kind != "linear":
            continue
        key = (_kernel_of(graph, op), *graph.tensor(op.weights["weight"]).shape)
        role = role_of.get(id(op))
        votes.setdefault(key, Counter())[role[0] if role else ""] += 1
        if role:
            found[key, role[0]] = role
    roles = {}
    for key, counted in votes.items():
        role = max(counted, key=lambda r: (counted[r], r != ""))  # a tie goes to the chain's role
        if role:
            roles[key] = found[key, role]
    return roles


def _users(graph: ir.Graph) -> dict[str, list[ir.Op | None]]:
    """Each tensor's readers in op order; None for the graph's caller (its outputs)."""
    users: dict[str, list[ir.Op | None]] = {}
    for op in graph.ops:
        for name in op.inputs:
            users.setdefault(name, []).append(op)
    for name in graph.outputs:
        users.setdefault(name, []).append(None)  # read by the caller
    return users


def _norm_weight(graph: ir.Graph, norm: ir.Op, device: Any, dtype: Any) -> Any:
    """An RMSNorm op's weight on the device in ``dtype`` (None where it has none)."""
    import torch

    t = graph.tensors.get(norm.weights.get("weight", ""))
    return None if t is None else torch.as_tensor(to_f32(t), device=device).to(dtype).contiguous()


def _add_norm_linear(graph: ir.Graph, three: list[ir.Op], users: dict[str, list[ir.Op | None]]) -> bool:
    """An add, the whole-row RMSNorm of its output, and a linear reading only that norm (the norm
    across chain's tail)."""
    add, norm, reader = three
    return (add.kind == "add" and norm.kind == "rms_norm" and norm.inputs == add.outputs and reader.kind == "linear"
            and reader.inputs == norm.outputs and users.get(norm.outputs[0]) == [reader]
            and int(norm.attrs["group"]) == graph.tensor(reader.weights["weight"]).shape[1])  # fmt: skip


def _fused_launch(fused: tuple[str, ir.Op, ir.Op], launch: Callable[..., Any], x: Any, w: Any, graph: ir.Graph,
                  entries: dict[Any, Any], device: Any, dtype: Any) -> Callable[[Any], Callable[..., Any]]:
    """For ``fused``: config -> the timed call of one candidate as norm across runs it (``_fused_roles``).
    A producer adds a residual and leaves its rows' squares (``linear_add_squares``); a reader applies
    the norm in its loads (``NormIn``: the norm's weight and eps, squares in as many partial sums as
    the producer's stored configuration leaves, 16-column tiles if it has none yet), or, for a
    configuration that is not the one-row GEMV (which cannot take the norm), runs as it is."""
    import torch

    from mgx.kernels.triton.linear import NormIn, RowSquares, linear_add_squares, runs_gemv

    role, norm, producer = fused
    if role == "add":
        residual = torch.randn(1, w.n, dtype=dtype, device=device)
        return lambda config: lambda c=config, x=x, w=w, r=residual: linear_add_squares(x, w, None, r, config=c)
    n, k = graph.tensor(producer.weights["weight"]).shape
    block_n = 16
    for e in entries.values():  # the producer's one-row entry, when it is tuned already (it comes first)
        fields = dict(part.split("=", 1) for part in e.shape_key.split(","))
        if e.kernel == "linear" and (fields.get("scheme"), fields.get("N"), fields.get("K"), fields.get("M")) == (
                "none", str(n), str(k), "1"):  # fmt: skip
            block_n = int(e.config["block_n"])
    weight = _norm_weight(graph, norm, device, dtype)
    tiles = -(-w.k // block_n)
    squares = RowSquares(torch.rand(1, tiles, device=device, dtype=torch.float32) * (w.k / tiles), tiles)
    how = NormIn(squares, weight, float(norm.attrs["eps"]))

    def timed(config: Any) -> Callable[..., Any]:
        if not runs_gemv(1, w, config, dtype):
            return lambda c=config, f=launch, x=x, w=w: f(x, w, config=c)
        return lambda c=config, f=launch, x=x, w=w, n=how: f(x, w, config=c, norm=n)

    return timed


def _norm_readers(graph: ir.Graph) -> dict[tuple[str, int, int], ir.Op]:
    """For ``after_norm``: by (kernel, N, K), an RMSNorm whose whole row only that linear reads (QKV
    and gate/up after their norms; the CUDA backend's ``_one_row_reader``), for the shapes most of
    whose linears are such readers."""
    users = _users(graph)
    norm_of = {}
    for op in graph.ops:
        readers = users.get(op.outputs[0], []) if op.kind == "rms_norm" else []
        reader = readers[0] if len(readers) == 1 else None  # None also where the caller reads it
        if (reader is not None and reader.kind == "linear" and reader.inputs == op.outputs
                and int(op.attrs["group"]) == int(reader.attrs["in_features"])):  # fmt: skip
            norm_of[id(reader)] = op
    votes: dict[tuple[str, int, int], list[ir.Op | None]] = {}
    for op in graph.ops:  # keyed by the logical shape (a quantized weight's codes are packed)
        if op.kind == "linear":
            key = (_kernel_of(graph, op), int(op.attrs["out_features"]), int(op.attrs["in_features"]))
            votes.setdefault(key, []).append(norm_of.get(id(op)))
    return {key: next(n for n in norms if n is not None) for key, norms in votes.items()
            if 2 * sum(n is not None for n in norms) >= len(norms)}  # fmt: skip


class _AfterNorm(NamedTuple):
    """``_after_norm_launch``'s timed calls: config -> a Triton candidate's, native config -> a native kind's."""

    triton: Callable[[Any], Callable[..., Any]]
    native: Callable[[Any], Callable[..., Any]]


def _after_norm_launch(norm: ir.Op, launch: Callable[..., Any], silu: bool, w: Any, kernels: Any, graph: ir.Graph,
                       device: Any, dtype: Any) -> _AfterNorm:  # fmt: skip
    """For ``after_norm``: the timed calls of a Triton candidate and of a native kind, each after the
    norm that feeds it in the CUDA backend's batch-1 step, on a random row and residual.

    Timed alone, a projection's kind was ranked otherwise than in the step: on the H200 (forty-sixth
    session, the 8B INT4 model) autotune chose ``imma_w16`` for QKV (6.7 us alone) where ``mgx-run
    tune`` measured the step 3.5% shorter on ``imma`` (1.631 against 1.690 ms): launched while its
    norm runs, ``imma``'s 8-warp blocks are all resident and load their first weights before they
    wait, where ``imma_w16``'s 16-warp blocks take two waves. Timed after the norm, each candidate
    meets that. Where the backend stages x (``STAGED_SCHEMES`` weights, the kernels' ``norm_stage``
    taking the row), a kind with a staged twin runs as the backend runs it, ``norm_stage`` (the norm
    that also stages x) and the twin on its record; every other candidate reads the row of the plain
    add + RMSNorm kernel (``rms_norm`` with the residual), as where the backend stages nothing."""
    import torch

    from mgx.kernels.cuda.gemv import (
        STAGED_SCHEMES,
        NormPrologue,
        gemv_staged,
        norm_stage,
        norm_stage_applies,
        run_native,
        staged_applies,
    )
    from mgx.kernels.cuda.rmsnorm import rms_norm

    k = w.k
    x = torch.randn(1, k, dtype=dtype, device=device)
    delta = torch.randn(1, k, dtype=dtype, device=device)
    weight = _norm_weight(graph, norm, device, dtype)
    eps = float(norm.attrs["eps"])
    normed, total = torch.empty_like(x), torch.empty_like(x)
    prologue = NormPrologue(delta, weight, eps, total)
    stages = w.scheme in STAGED_SCHEMES and norm_stage_applies(kernels, x, prologue, w.scheme)

    def plain(x: Any) -> Any:
        return rms_norm(x, weight, eps, kernels=kernels, residual=delta, out=normed)[0]

    # The timed calls take their candidate first and the weight by name, as the plain ones in ``run``.
    def triton(config: Any) -> Callable[..., Any]:
        return lambda c=config, f=launch, x=x, w=w: f(plain(x), w, config=c)

    def native(config: Any) -> Callable[..., Any]:
        if stages and staged_applies(kernels, x, w, config.native):
            def twin(c: Any = config, x: Any = x, w: Any = w, s: bool = silu) -> Any:
                _, rec = norm_stage(x, prologue, w.scheme, kernels=kernels, out=normed)
                return gemv_staged(rec, w, kernels=kernels, kind=c.native, silu_mul=s)

            return twin
        return lambda c=config, x=x, w=w, s=silu: run_native(plain(x), w, kernels=kernels, kind=c.native, silu_mul=s)

    return _AfterNorm(triton, native)


def _why(e: Exception) -> str:
    """A failed candidate's reason as the summary counts it: the exception's type and first line."""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"


def _does_not_fit(reason: str) -> bool:
    """Whether a failed candidate's reason (``_why``) is a launch asking for more shared memory (or
    registers) than this GPU has: the summary counts those as skipped, not as kernels that broke."""
    return reason.startswith("OutOfResources")


def copies_for(nbytes: int, l2_bytes: int) -> int:
    """How many copies of an ``nbytes`` weight span 4x an L2 of ``l2_bytes``: 2 to 16."""
    return min(16, max(2, -(-4 * l2_bytes // max(1, nbytes))))


def _attention_shapes(graph: ir.Graph) -> tuple[dict[str, tuple[int, int, int, tuple[int, ...]]], str]:
    """The model's distinct attention shapes, signature -> (query heads, kv heads, head dim, the
    sliding windows of its layers, 0 for none), in graph order, and the decode one: the first layer
    with the most kv heads, as the CUDA backend looks its decode entries up (``_decode_signature``)."""
    from mgx.kernels.triton.tuning import attention_signature

    shapes: dict[str, tuple[int, int, int, set[int]]] = {}
    for op in graph.ops:
        if op.kind == "attention":
            hq, hk, d, w = (int(op.attrs[k]) for k in ("num_heads", "num_kv_heads", "head_dim", "sliding_window"))
            shapes.setdefault(attention_signature(hq, hk, d), (hq, hk, d, set()))[3].add(w)
    found = {sig: (hq, hk, d, tuple(sorted(ws))) for sig, (hq, hk, d, ws) in shapes.items()}
    return found, max(found, key=lambda s: found[s][1], default="")


def _tune_attention(graph: ir.Graph, opts: AutotuneOptions, device: Any, dtype: Any, entries: dict,
                    measured: dict[str, dict[str, Any]], failed: list[str]) -> int:  # fmt: skip
    """Time the paged attention kernels' candidates (``AutotuneOptions.prefill_attention`` and
    ``decode_attention``) and add the winners to ``entries``, their times to ``measured``; returns how
    many candidates were timed."""
    import torch

    from mgx.kernels.triton._common import num_sms
    from mgx.kernels.triton.attention import (
        DECODE_CONFIGS,
        PREFILL_CONFIGS,
        SELF_MERGE_MAX_SPLITS,
        decode_splits,
        new_decode_counters,
        paged_attention_decode,
        paged_attention_prefill,
    )
    from mgx.kernels.triton.testing import paged_batch
    from mgx.kernels.triton.tuning import ATTENTION_DECODE, ATTENTION_PREFILL

    shapes, decode_sig = _attention_shapes(graph)
    context = max(1, min(opts.decode_context, int(graph.arch.max_position)))
    timed = 0
    for sig, (hq, hk, d, windows) in shapes.items():
        heads = {"num_heads": hq, "num_kv_heads": hk, "head_dim": d, "block_size": KV_BLOCK, "dtype": dtype, "device": device}
        scale = d**-0.5
        for m in (r for r in opts.rows if opts.decode_attention and r <= GRAPH_MAX_M and sig == decode_sig):
            b = paged_batch([context] * m, [1] * m, **heads, spare_blocks=0)
            counters = new_decode_counters(device, m, hk)

            def decode(c: Any, b: Any = b, m: int = m, hk: int = hk, scale: float = scale, counters: Any = counters) -> Any:
                splits = decode_splits(m, hk, context, num_sms(device), c.block_n, 1)  # the backend's one-tile pieces
                return paged_attention_decode(b.q, b.k_cache, b.v_cache, b.block_table, b.context_lens, scale=scale,
                                              num_splits=splits, max_context_len=context, block_n=c.block_n,
                                              num_warps=c.num_warps,
                                              counters=counters if splits <= SELF_MERGE_MAX_SPLITS else None)  # fmt: skip

            timed += _tune_by_output(ATTENTION_DECODE, f"{sig},M={m}", DECODE_CONFIGS, decode, opts, entries,
                                     measured, failed)  # fmt: skip
        for m in (r for r in opts.rows if opts.prefill_attention and r >= PREFILL_MIN_M):
            b = paged_batch([m], [m], **heads, spare_blocks=0)

            def prefill(c: Any, b: Any = b, m: int = m, scale: float = scale, windows: tuple = windows) -> Any:
                # One launch for each window the signature's layers have (a stored configuration serves
                # them all, so each must give the default's output; a tile size once computed wrong with
                # a window only, attention.py's paged_attention_prefill says).
                outs = [paged_attention_prefill(
                    b.q, b.k_cache, b.v_cache, b.block_table, b.context_lens, b.query_start_loc, b.positions,
                    scale=scale, sliding_window=w, max_query_len=m, block_m=c.block_m, block_n=c.block_n,
                    num_warps=c.num_warps, num_stages=c.num_stages).flatten() for w in windows]  # fmt: skip
                return outs[0] if len(outs) == 1 else torch.cat(outs)  # one window: no copy in the timed call

            timed += _tune_by_output(ATTENTION_PREFILL, f"{sig},M={m}", PREFILL_CONFIGS, prefill, opts, entries,
                                     measured, failed)  # fmt: skip
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the batches of this shape
    return timed


def _tune_decode_merge(graph: ir.Graph, opts: AutotuneOptions, device: Any, entries: dict,
                       measured: dict[str, dict[str, Any]], failed: list[str]) -> int:  # fmt: skip
    """Time split decode's merge kernel (``attention.merge_splits``) for the model's decode shape at
    each batch bucket where, at the model's longest context, the backend's splits (one-tile pieces of
    the decode attention's tile width: the entry just tuned for that bucket's, else the default's)
    outnumber SELF_MERGE_MAX_SPLITS, on random partials of that many splits; a candidate must first
    give the default's output element by element. Returns how many were timed."""
    import torch

    from mgx.kernels.triton._common import num_sms
    from mgx.kernels.triton.attention import (
        MERGE_CONFIGS,
        SELF_MERGE_MAX_SPLITS,
        DecodeConfig,
        decode_splits,
        merge_splits,
    )
    from mgx.kernels.triton.tuning import ATTENTION_DECODE, DECODE_MERGE

    shapes, sig = _attention_shapes(graph)
    if not sig:
        return 0
    hq, hk, d, _ = shapes[sig]
    context = max(1, int(graph.arch.max_position))
    timed = 0
    for m in (r for r in opts.rows if r <= GRAPH_MAX_M):
        tuned = entries.get((ATTENTION_DECODE, f"{sig},M={m}"))  # the backend's tiles at this bucket
        block_n = int(tuned.config["block_n"]) if tuned is not None else DecodeConfig().block_n
        splits = decode_splits(m, hk, context, num_sms(device), block_n, 1)  # one-tile pieces
        if splits <= SELF_MERGE_MAX_SPLITS:
            continue
        g = torch.Generator(device="cpu").manual_seed(m * splits)
        part_o = torch.randn(m, hq, splits, d, generator=g).to(device)
        part_m = (torch.randn(m, hq, splits, generator=g) * 4).to(device)
        part_l = torch.rand(m, hq, splits, generator=g).add_(0.5).to(device)
        out = torch.empty(m, hq * d, dtype=torch.float32, device=device)

        def merge(c: Any, o: Any = part_o, mx: Any = part_m, den: Any = part_l, out: Any = out) -> Any:
            return merge_splits(o, mx, den, out, config=c)

        timed += _tune_by_output(DECODE_MERGE, f"{sig},M={m}", MERGE_CONFIGS, merge, opts, entries, measured, failed,
                                 error=elementwise_error, tolerance=ELEMENTWISE_TOLERANCE, graph=True)  # fmt: skip
    return timed


def _norm_shapes(graph: ir.Graph) -> dict[str, tuple[int, int, bool, ir.Op]]:
    """The model's distinct RMSNorm shapes as the CUDA backend launches them, signature -> (input
    width, group, whether the add before it is fused in as a residual, its first op), in graph order.
    A norm whose input width the graph leaves open is not among them."""
    from mgx.kernels.triton.tuning import norm_signature

    widths = ir.verify(graph)
    shapes: dict[str, tuple[int, int, bool, ir.Op]] = {}
    prev = None
    for op in graph.ops:
        width = widths.get(op.inputs[0]) if op.kind == "rms_norm" else None
        if width is not None:
            residual = prev is not None and prev.kind == "add" and op.inputs == prev.outputs  # backend_cuda's norm_after_add
            group = int(op.attrs["group"])
            shapes.setdefault(norm_signature(width, group, residual), (width, group, residual, op))
        prev = op
    return shapes


def _tune_norms(graph: ir.Graph, opts: AutotuneOptions, device: Any, dtype: Any, entries: dict,
                measured: dict[str, dict[str, Any]], failed: list[str]) -> int:  # fmt: skip
    """Time the Triton RMSNorm's candidates (``rmsnorm.candidates``) for every norm shape and row
    count; the winners go to ``entries``, their times to ``measured``. Returns how many were timed."""
    import torch

    from mgx.kernels.triton import rmsnorm
    from mgx.kernels.triton._common import num_sms
    from mgx.kernels.triton.tuning import RMS_NORM

    timed = 0
    for sig, (width, group, residual, op) in _norm_shapes(graph).items():
        weight = _norm_weight(graph, op, device, dtype)
        eps = float(op.attrs["eps"])
        for m in opts.rows:
            x = torch.randn(m, width, dtype=dtype, device=device)
            res = torch.randn(m, width, dtype=dtype, device=device) if residual else None

            def norm(c: Any, x: Any = x, res: Any = res, weight: Any = weight, eps: float = eps, group: int = group) -> Any:
                return rmsnorm.rms_norm(x, weight, eps, group=group, residual=res, config=c)

            configs = rmsnorm.candidates(m * (width // group), group, num_sms(device))
            timed += _tune_by_output(RMS_NORM, f"{sig},M={m}", configs, norm, opts, entries, measured, failed,
                                     error=elementwise_error, tolerance=ELEMENTWISE_TOLERANCE, graph=True)  # fmt: skip
    return timed


def _rope_shapes(graph: ir.Graph) -> dict[str, tuple[int, int, int, ir.Op]]:
    """The attention shapes whose q and k a RoPE op right before them rotates (the CUDA backend's
    ``rope_into_attention``: the RoPE it runs with the K/V write), signature -> (query heads, kv
    heads, head dim, the first such RoPE op), in graph order."""
    from mgx.kernels.triton.tuning import attention_signature

    shapes: dict[str, tuple[int, int, int, ir.Op]] = {}
    for op, nxt in zip(graph.ops, graph.ops[1:]):
        if op.kind == "rope" and nxt.kind == "attention" and nxt.inputs[:2] == op.outputs:
            hq, hk, d = (int(nxt.attrs[k]) for k in ("num_heads", "num_kv_heads", "head_dim"))
            shapes.setdefault(attention_signature(hq, hk, d), (hq, hk, d, op))
    return shapes


def _tune_rope(graph: ir.Graph, opts: AutotuneOptions, device: Any, dtype: Any, entries: dict,
               measured: dict[str, dict[str, Any]], failed: list[str]) -> int:  # fmt: skip
    """Time the RoPE + K/V write kernel's candidates (``rope.CONFIGS``) for every attention shape a
    RoPE feeds and every row count (one sequence of that many fresh tokens); each candidate is first
    checked on fresh copies of q, k and zeroed caches. Returns how many were timed."""
    import torch

    from mgx.kernels.triton.rope import CONFIGS, RopeConfig, rope_and_write_kv
    from mgx.kernels.triton.testing import paged_batch
    from mgx.kernels.triton.tuning import ROPE_KV

    timed = 0
    for sig, (hq, hk, d, op) in _rope_shapes(graph).items():
        inv_freq = torch.as_tensor(to_f32(graph.tensor(op.weights["inv_freq"])), device=device).float().reshape(-1)
        a = op.attrs
        how = {"head_dim": int(a["head_dim"]), "rotary_dim": int(a["rotary_dim"]), "attention_scaling": float(a["attention_scaling"])}
        configs = [RopeConfig(), *(c for c in CONFIGS if c != RopeConfig())]
        for m in opts.rows:
            b = paged_batch([m], [m], num_heads=hq, num_kv_heads=hk, head_dim=d, block_size=KV_BLOCK, dtype=dtype,
                            device=device, spare_blocks=0)  # fmt: skip

            def run(c: Any, q: Any, k: Any, kc: Any, vc: Any, b: Any = b, inv: Any = inv_freq, how: dict = how) -> Any:
                rope_and_write_kv(q, k, b.v, b.positions, inv, kc, vc, b.block_table, b.query_start_loc, **how, config=c)
                return q, k, kc, vc

            work = (b.q.clone(), b.k.clone())  # rotated in place by the timed launches (the work stays the same)

            def launch(c: Any, b: Any = b, work: tuple = work) -> Any:
                return run(c, *work, b.k_cache, b.v_cache)

            def fresh(c: Any, b: Any = b) -> Any:  # checked: on copies of q, k as drawn, into zeroed caches
                return run(c, b.q.clone(), b.k.clone(), torch.zeros_like(b.k_cache), torch.zeros_like(b.v_cache))

            timed += _tune_by_output(ROPE_KV, f"{sig},M={m}", configs, launch, opts, entries, measured, failed,
                                     error=elementwise_error, tolerance=ELEMENTWISE_TOLERANCE, check=fresh,
                                     graph=True)  # fmt: skip
    return timed


def _fastest(configs: Iterable[Any], call: Callable[[Any], Callable[..., Any]], repeats: int, ws: list[Any] | None,
             failed: list[str]) -> tuple[tuple[float, Any] | None, int]:  # fmt: skip
    """Time ``call(config)`` (the timed call of one candidate) for each of ``configs``, in graphs over
    ``ws`` where given (``_time``); one that cannot launch goes to ``failed``. Returns the fastest
    (seconds, config), None if none ran, and how many were timed."""
    best, timed = None, 0
    for config in configs:
        try:
            seconds = _time(call(config), repeats, ws)
        except Exception as e:  # noqa: BLE001 - a configuration this GPU cannot launch (shared memory)
            failed.append(_why(e))
            continue
        timed += 1
        if best is None or seconds < best[0]:
            best = (seconds, config)
    return best, timed


def _tune_sampling_head(x: Any, w: Any, ws: list[Any] | None, opts: AutotuneOptions, entries: dict,
                        measured: dict[str, dict[str, Any]], failed: list[str]) -> int:  # fmt: skip
    """Time the LM head of sampling steps on ``x``'s rows as the CUDA backend's ``lm_head`` runs it
    (``linear`` into fp32 logits, each candidate with split K off, so those differing only there are
    one; in graphs over ``ws`` as the greedy head's); the fastest becomes ``w``'s ``linear`` entry at
    that row count. Returns how many were timed."""
    import torch

    from mgx.formats.artifact import AutotuneEntry
    from mgx.kernels.triton.linear import linear
    from mgx.kernels.triton.tuning import candidates, config_dict, shape_key

    m = x.shape[0]
    out = torch.empty((m, w.n), dtype=torch.float32, device=x.device)
    configs = dict.fromkeys(dataclasses.replace(c, split_k=1) for c in candidates(m, w, x.dtype))

    def call(config: Any) -> Callable[..., Any]:
        return lambda c=config, x=x, w=w, out=out: linear(x, w, out=out, config=c)

    best, timed = _fastest(configs, call, opts.repeats, ws, failed)
    if best is not None:
        key = shape_key(w, m)
        entries[("linear", key)] = AutotuneEntry("linear", key, config_dict(best[1]))
        measured[f"linear {key}"] = {**_timing(best, best[0], w), "fused": "sampling_head", "native_us": {}}
    return timed


def _tune_dense_path(w: Any, silu: bool, m: int, opts: AutotuneOptions, dtype: Any, entries: dict,
                     measured: dict[str, dict[str, Any]], failed: list[str]) -> int:  # fmt: skip
    """For ``m`` rows of ``w`` that run as a dense product: time ``dequantize``'s candidates for a
    quantized ``w`` (once per weight signature) and, for a fused gate/up (``silu``), ``silu_mul``'s
    for its width at ``m`` rows; each must first write the default's output. Returns how many were
    timed."""
    import torch

    from mgx.kernels.triton.linear import dequantize, dequantize_candidates, silu_mul, silu_mul_candidates
    from mgx.kernels.triton.tuning import DEQUANTIZE, SILU_MUL, silu_signature, weight_signature

    timed = 0
    sig = weight_signature(w)
    if w.scheme != "none" and not any(k[0] == DEQUANTIZE and k[1].rpartition(",M=")[0] == sig for k in entries):
        buf = torch.empty(w.n * w.k, dtype=dtype, device=w.weight.device)

        def into(c: Any, w: Any = w, buf: Any = buf) -> Any:  # timed: into one buffer, as the backend's
            return dequantize(w, dtype, out=buf, config=c)

        timed += _tune_by_output(DEQUANTIZE, f"{sig},M={m}", dequantize_candidates(w), into, opts, entries, measured,
                                 failed, error=elementwise_error, tolerance=ELEMENTWISE_TOLERANCE,
                                 check=lambda c, w=w: dequantize(w, dtype, config=c))  # fmt: skip
    f = w.n // 2
    if silu and (SILU_MUL, f"{silu_signature(f)},M={m}") not in entries:
        x = torch.randn(m, w.n, dtype=dtype, device=w.weight.device)
        out = torch.empty(m, f, dtype=dtype, device=w.weight.device)

        def product(c: Any, x: Any = x, out: Any = out) -> Any:
            return silu_mul(x, out=out, config=c)

        timed += _tune_by_output(SILU_MUL, f"{silu_signature(f)},M={m}", silu_mul_candidates(f), product, opts, entries,
                                 measured, failed, error=elementwise_error, tolerance=ELEMENTWISE_TOLERANCE,
                                 check=lambda c, x=x: silu_mul(x, config=c), graph=True)  # fmt: skip
    return timed


def _device_weight(graph: ir.Graph, op: ir.Op, device: Any, dtype: Any) -> Any:
    """``op``'s weight on ``device`` as the CUDA backend uploads it (before any scale pairs); PassError
    naming it where it cannot be."""
    from mgx.kernels.triton.weights import gpu_arrays, gpu_weight

    t = graph.tensor(op.weights["weight"])
    aux = {r: graph.tensor(op.weights[r]) for r in ("scales", "zeros", "meta") if r in op.weights}
    try:
        return gpu_weight(t, gpu_arrays(t, aux, device), dtype)
    except ValueError as e:
        raise PassError(f"autotune: {op.kind} {t.name}: {e}") from None


def _tune_embedding_rows(graph: ir.Graph, opts: AutotuneOptions, device: Any, dtype: Any, entries: dict,
                         measured: dict[str, dict[str, Any]], failed: list[str]) -> int:  # fmt: skip
    """Time the row lookup of each distinct quantized embedding table (``dequantize`` with ``rows``,
    as the CUDA backend's ``embedding`` runs it) at each row count on random token ids; a candidate
    must give the default's rows exactly. Returns how many were timed."""
    import torch

    from mgx.kernels.triton.linear import dequantize, dequantize_candidates
    from mgx.kernels.triton.tuning import EMBEDDING_ROWS, weight_signature

    timed = 0
    for op in graph.ops:
        if op.kind != "embedding" or "scales" not in op.weights:  # a dense table: torch's index_select
            continue
        w = _device_weight(graph, op, device, dtype)
        sig = weight_signature(w)
        g = torch.Generator(device="cpu").manual_seed(w.n)
        for m in opts.rows:
            if (EMBEDDING_ROWS, f"{sig},M={m}") in entries:
                continue
            ids = torch.randint(0, w.n, (m,), generator=g, dtype=torch.int32).to(device)
            out = torch.empty(m, w.k, dtype=dtype, device=device)

            def lookup(c: Any, w: Any = w, ids: Any = ids, out: Any = out) -> Any:
                return dequantize(w, dtype, out=out, rows=ids, config=c)

            timed += _tune_by_output(EMBEDDING_ROWS, f"{sig},M={m}", dequantize_candidates(w, rows=m), lookup, opts,
                                     entries, measured, failed, error=exact_error, tolerance=0.0, graph=True,
                                     check=lambda c, w=w, ids=ids: dequantize(w, dtype, rows=ids, config=c))  # fmt: skip
    return timed


def _flat(out: Any) -> Any:
    """A launch's output as one fp32 vector (several outputs, all of them)."""
    import torch

    return torch.cat([t.float().flatten() for t in out]) if isinstance(out, tuple) else out.float()


def relative_error(got: Any, want: Any) -> float:
    """``got``'s distance from ``want`` relative to ``want``, in the Frobenius norm."""
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def _tune_argmax_merge(head: Any, w: Any, m: int, device: Any, opts: AutotuneOptions, entries: dict,
                       measured: dict[str, dict[str, Any]], failed: list[str]) -> int:  # fmt: skip
    """Time the merge of the greedy LM head's tiles at ``m`` rows for as many tiles as ``head`` (the
    LinearConfig chosen for ``w``, ``native`` naming the kind if one won) leaves, on random tile maxima
    with ties; a candidate must give the default's ids and logits exactly. Returns how many were timed."""
    import torch

    from mgx.kernels.cuda.gemv import argmax_groups
    from mgx.kernels.triton.lm_head import lm_head_tiles, merge_candidates, merge_tile_argmax
    from mgx.kernels.triton.tuning import ARGMAX_MERGE, merge_signature

    tiles = argmax_groups(w) if head.native else lm_head_tiles(w.n, head, m, w.k, w.scheme)
    key = f"{merge_signature(tiles)},M={m}"
    if (ARGMAX_MERGE, key) in entries:
        return 0
    g = torch.Generator(device="cpu").manual_seed(tiles + m)
    part_v = torch.randint(-64, 64, (m, tiles), generator=g).float().div_(8).to(device)  # ties between tiles
    part_i = (torch.arange(tiles, dtype=torch.int32) * 16).repeat(m, 1).to(device)
    ids = torch.empty(m, dtype=torch.int32, device=device)
    vals = torch.empty(m, dtype=torch.float32, device=device)

    def merge(c: Any, part_v: Any = part_v, part_i: Any = part_i, ids: Any = ids, vals: Any = vals) -> Any:
        return merge_tile_argmax(part_v, part_i, ids, vals, config=c)

    return _tune_by_output(ARGMAX_MERGE, key, merge_candidates(tiles), merge, opts, entries, measured, failed,
                           error=exact_error, tolerance=0.0, graph=True)  # fmt: skip


def exact_error(got: Any, want: Any) -> float:
    """0 where ``got`` equals ``want`` bit for bit (tokens: one id off is wrong), else infinity."""
    import torch

    return 0.0 if torch.equal(got, want) else float("inf")


def elementwise_error(got: Any, want: Any) -> float:
    """``got``'s largest elementwise distance from ``want`` over ``want``'s largest magnitude."""
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def _tune_by_output(kernel: str, key: str, configs: list[Any], launch: Callable[[Any], Any], opts: AutotuneOptions,
                    entries: dict, measured: dict[str, dict[str, Any]], failed: list[str], *,
                    error: Callable[[Any, Any], float] = relative_error, tolerance: float = ATTENTION_TOLERANCE,
                    check: Callable[[Any], Any] | None = None, graph: bool = False) -> int:  # fmt: skip
    """Time ``configs`` (the default first) of one shape of a signature-keyed kind (attention, RMSNorm,
    RoPE, dequantize, SiLU product, argmax merge, embedding rows); a candidate whose
    output (``check``'s, where the timed ``launch`` works in place) is not within ``tolerance`` of the
    default's by ``error``, or that cannot launch, goes to ``failed`` instead; each is timed by ``_time``
    (``graph``: in a graph of launches). The fastest becomes the entry ``(kernel, key)``. Returns how
    many were timed."""
    from mgx.formats.artifact import AutotuneEntry

    check = check or launch
    try:
        want = _flat(check(configs[0])).clone()  # kept: a launch may write into the same buffer again
    except Exception as e:  # noqa: BLE001 - the default cannot run here: nothing to compare with, no entry
        failed.append(f"{kernel} default {configs[0]}: {_why(e)}")
        return 0
    best, default_s, timed = None, None, 0
    for c in configs:
        try:
            got = want if c == configs[0] else _flat(check(c))
            err = error(got, want)
            if not err <= tolerance:  # NaN too
                failed.append(f"{kernel} {c} gave other results (relative error {err:.1e})")
                continue
            seconds = _time(lambda c=c, f=launch: f(c), opts.repeats, None, graph)
        except Exception as e:  # noqa: BLE001 - a configuration this GPU cannot launch (shared memory)
            failed.append(_why(e))
            continue
        timed += 1
        default_s = seconds if c == configs[0] else default_s
        if best is None or seconds < best[0]:
            best = (seconds, c)
    if best is not None:
        entries[(kernel, key)] = AutotuneEntry(kernel, key, dataclasses.asdict(best[1]))
        measured[f"{kernel} {key}"] = {"chosen": dataclasses.asdict(best[1]), "us": best[0] * 1e6,
                                       "default_us": None if default_s is None else default_s * 1e6}  # fmt: skip
    return timed


def _kernel_of(graph: ir.Graph, op: ir.Op) -> str:
    if op.kind == "lm_head":
        return "lm_head_argmax"
    users = [o for o in graph.ops if op.outputs[0] in o.inputs]
    if len(users) == 1 and users[0].kind == "silu_mul" and len(users[0].inputs) == 1:
        return "linear_silu_mul"  # what the CUDA backend fuses it into
    return "linear"


def run(graph: ir.Graph, options: dict[str, Any], context: PassContext) -> PassResult:
    """Tune the Triton kernels' launch configurations for ``graph``'s shapes; see the module docstring."""
    opts = parse_options(AutotuneOptions, options, "autotune")
    if context.target != "cuda":
        raise PassError(f"autotune tunes the CUDA kernels; the build target is {context.target!r} (set target: cuda)")
    import torch

    from mgx.formats.artifact import AutotuneEntry
    from mgx.kernels.cuda.gemv import KINDS as NATIVE_KINDS
    from mgx.kernels.cuda.gemv import (
        NATIVE_TOLERANCE,
        gemv_applies,
        half_scales_hold,
        native_error,
        native_error_text,
        reads_half_scales,
        run_native,
        scale_pairs,
    )
    from mgx.kernels.triton._common import overlapped_launches
    from mgx.kernels.triton.linear import GEMV_MAX_M, dense_product, linear, linear_silu_mul
    from mgx.kernels.triton.lm_head import lm_head_argmax
    from mgx.kernels.triton.tuning import candidates, config_dict, shape_key

    device, arch = _device()
    kernels = _native_kernels(graph) if opts.native else None
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[opts.dtype]
    launch = {"linear": linear, "linear_silu_mul": linear_silu_mul, "lm_head_argmax": lm_head_argmax}
    roles = _fused_roles(graph) if opts.fused else {}
    norms = _norm_readers(graph) if opts.after_norm else {}
    entries: dict[str, AutotuneEntry] = {}
    measured: dict[str, dict[str, Any]] = {}  # the winners' times, for the build log (stats["timings"])
    timed = 0
    rejected: list[str] = []  # native GEMV shapes whose results disagreed with the Triton kernel's
    failed: list[str] = []  # why candidates could not run (reported, so that a broken kernel shows)
    attention: dict[str, dict[str, Any]] = {}  # the attention winners' times (stats["attention_timings"])
    # the RMSNorm's, dequantize's (whole weights and embedding rows), the SiLU product's and the argmax
    # merge's winners' times (stats["elementwise_timings"])
    elementwise: dict[str, dict[str, Any]] = {}
    with overlapped_launches(_overlap(arch, kernels, opts.overlapped)):  # as the backend launches them
        if opts.prefill_attention or opts.decode_attention:
            timed += _tune_attention(graph, opts, device, dtype, entries, attention, failed)
        if opts.decode_merge:
            timed += _tune_decode_merge(graph, opts, device, entries, attention, failed)
        if opts.rms_norm:
            timed += _tune_norms(graph, opts, device, dtype, entries, elementwise, failed)
        if opts.rope:
            timed += _tune_rope(graph, opts, device, dtype, entries, attention, failed)
        if opts.embedding_rows:
            timed += _tune_embedding_rows(graph, opts, device, dtype, entries, elementwise, failed)
        for op in graph.ops:
            if op.kind not in ("linear", "lm_head"):
                continue
            kernel = _kernel_of(graph, op)

            def upload(op: ir.Op = op, silu: bool = kernel == "linear_silu_mul") -> Any:
                """The weight on the device as the CUDA backend holds it (scale pairs where it makes them)."""
                w = _device_weight(graph, op, device, dtype)
                return scale_pairs(w, silu) if reads_half_scales(kernels) and half_scales_hold(w) else w

            w = upload()
            copies = ws = None  # copies of w, for timing the decode regime in graphs (made when first needed)
            for m in opts.rows:
                key = (kernel, shape_key(w, m))
                if key in entries:
                    continue
                if kernel != "lm_head_argmax" and dense_product(w, m):  # cuBLAS runs it in the CUDA backend
                    if opts.dense_products:
                        timed += _tune_dense_path(w, kernel == "linear_silu_mul", m, opts, dtype, entries,
                                                  elementwise, failed)  # fmt: skip
                    continue
                x = torch.randn(m, w.k, dtype=dtype, device=device)
                if m <= GRAPH_MAX_M and copies is None:  # decode steps run as CUDA graphs: time them so
                    copies = _weight_copies(w, upload, device)
                ws = copies if m <= GRAPH_MAX_M else None
                fused = roles.get((kernel, w.n, w.k)) if m == 1 and w.scheme == "none" else None
                as_run = _fused_launch(fused, launch[kernel], x, w, graph, entries, device, dtype) if fused else None
                norm = norms.get((kernel, w.n, w.k)) if m == 1 and fused is None else None
                after = None if norm is None else _after_norm_launch(
                    norm, launch[kernel], kernel == "linear_silu_mul", w, kernels, graph, device, dtype)  # fmt: skip

                def plain(config: Any, f: Callable[..., Any] = launch[kernel], x: Any = x, w: Any = w) -> Callable[..., Any]:
                    return lambda c=config, f=f, x=x, w=w: f(x, w, config=c)

                call = as_run if as_run is not None else after.triton if after is not None else plain
                best, n = _fastest(candidates(m, w if kernel != "lm_head_argmax" else None, dtype), call, opts.repeats,
                                   ws, failed)  # fmt: skip
                timed += n
                triton_s = best[0] if best is not None else None
                # A fused shape stays on Triton: a native kind there would turn norm across off for its chain.
                one_row = best is not None and m == 1 and fused is None
                head = kernel == "lm_head_argmax"  # the greedy LM head: the imma kinds' argmax entries
                kinds = [k for k in NATIVE_KINDS if one_row and gemv_applies(kernels, x, w, kind=k, argmax=head)]
                silu = kernel == "linear_silu_mul"
                # A candidate must first give the Triton kernel's result (within one rounding of the output
                # dtype; the LM head: the same token, its logit within that): a native kernel that
                # disagrees is reported, never chosen.
                want = launch[kernel](x, w, config=best[1]) if kinds else None
                natives_us: dict[str, float] = {}  # each native kind's time, for the build log
                for kind in kinds:
                    err = native_error(x, w, None, kernels=kernels, kind=kind, want=want, silu_mul=silu, argmax=head)
                    if err > NATIVE_TOLERANCE:
                        rejected.append(f"{kind} {key[1]} ({native_error_text(err, head)})")
                        continue
                    native = dataclasses.replace(best[1], native=kind)
                    call = after.native(native) if after is not None else (lambda c=native, x=x, w=w, s=silu, d=kind, h=head: run_native(
                        x, w, kernels=kernels, kind=d, silu_mul=s, argmax=h))  # fmt: skip
                    seconds = _time(call, opts.repeats, ws)
                    timed += 1
                    natives_us[kind] = seconds * 1e6
                    if seconds < best[0]:
                        best = (seconds, native)
                if best is not None:
                    entries[key] = AutotuneEntry(kernel, key[1], config_dict(best[1]))
                    how = fused[0] if fused else "after_norm" if after is not None else ""
                    measured[f"{kernel} {key[1]}"] = {**_timing(best, triton_s, w), "fused": how, "native_us": natives_us}
                if head and opts.argmax_merge and best is not None:
                    timed += _tune_argmax_merge(best[1], w, m, device, opts, entries, elementwise, failed)
                if head and opts.sampling_head and (w.scheme != "none" or m <= GEMV_MAX_M):  # else cuBLAS
                    timed += _tune_sampling_head(x, w, ws, opts, entries, measured, failed)
            copies = ws = None  # freed before the next weight's copies are made
    found = sorted(entries.values(), key=lambda e: (e.kernel, e.shape_key))
    chosen = [f"{e.config.get('native')} for {e.kernel} {e.shape_key}" for e in found if e.config.get("native")]
    natives = f"native GEMV chosen for {len(chosen)}" + (f" ({', '.join(chosen)})" if chosen else "")
    if kernels is None:
        natives = "native GEMV not timed (no nvcc or image)"
    if rejected:
        natives += f"; native GEMV rejected (wrong results) for {', '.join(rejected)}"
    unfit = [r for r in failed if _does_not_fit(r)]
    if unfit:
        natives += f"; {len(unfit)} configurations skipped (more than this GPU's shared memory or registers)"
    if broken := [r for r in failed if not _does_not_fit(r)]:
        reasons = Counter(broken).most_common(3)
        natives += f"; {len(broken)} configurations could not run ({'; '.join(f'{n}x {r}' for r, n in reasons)})"
    return PassResult(
        f"{arch}: {len(found)} shapes tuned ({timed} configurations timed) over rows {list(opts.rows)}; {natives}",
        {"autotune": {arch: found}, "timings": measured, "attention_timings": attention, "elementwise_timings": elementwise},
        options_dict(opts),
    )
