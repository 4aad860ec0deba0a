"""Where a batch-1 decode step's time goes: the Llama-3.1-8B decode layer's kernels, launched as the
CUDA backend launches them (native RMSNorm and GEMVs, decode attention with RoPE and the K/V write
fused, programmatic dependent launches), chained over 32 layers in one CUDA graph with random
weights, then the same chain with parts left out:

- ``all``: norm, QKV, attention, o_proj, add + norm, gate/up with SiLU, down (no embedding, LM head);
- ``gemvs``: the four GEMVs alone; ``others``: everything but the GEMVs; ``norms``; ``attention``;
- ``qkv``, ``o``, ``gate_up``, ``down``: that projection alone, 32 times (with the rate at which it
  reads its weights: codes, scales and zeros);
- ``no_norms``: the GEMVs and attention without the norms (what a step would take if the norms cost
  nothing: with ``--staged``, read the variant whose records are staged before the graph).

A model's step replays more than this (the LM head, the sampled token's embedding), and its GEMVs'
kinds are the stored tunings'; this is for splitting a step into its parts and for A/Bs of a build
flag of the native kernels (``--nvcc-flag``: every chain again on kernels built with it):

    python examples/bench_gpu_layer.py --scheme int4 --context 768 --nvcc-flag=-DMGX_IMMA_UNROLL=2

Longer contexts take a wider block table (``--table-blocks``, 16-token pages); past the backend's
``SELF_MERGE_MAX_SPLITS`` pieces the last piece no longer merges them and the merge kernel runs, as
in the backend; ``--self-merge-max 16,64`` times each limit (whether self-merging wins there):

    python examples/bench_gpu_layer.py --context 3000 --table-blocks 256 --parts all,attention --self-merge-max 16,64

``--attention-warps 4,8`` and ``--attention-block-n 64,128`` time the decode attention's warps a
program and tokens a tile (the pieces cut for each tile as the backend cuts them); the backend runs 4
and 64 (on the H200, 176th run, context 640: 128-token tiles 6.9 against 5.6 us a layer).

``--staged qkv,gate_up`` times the chains again with those projections' x staged once
(``gemv.stage_x``, a kernel of its own before the GEMV) and run on their kinds' staged twins
(``gemv.gemv_staged``), then with the records staged before the graph and only the twins in it (the
values are stale, the time is not), then with the norms before QKV and gate/up writing their records
(``gemv.norm_stage``: one kernel for the norm and the staging):

    python examples/bench_gpu_layer.py --scheme int4 --parts all,gemvs --staged qkv,gate_up

``--attention-warps 4,2,8`` times every chain again with the decode attention on that many warps a
program (the backend launches 4).

Needs an NVIDIA GPU and nvcc. Times are medians of graph replays, milliseconds for all layers.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from collections.abc import Callable

# (name, N, K) of the 8B layer's one-row products; gate/up holds the gate rows, then the up rows.
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 4096, 32, 8, 128, 14336, 32
DEFAULT_KINDS = {"int4": "qkv=imma,o=imma_w16,gate_up=imma_w4,down=imma_w16",
                 "w8a16": "qkv=imma,o=imma,gate_up=imma_w4,down=imma_w16"}  # the 44th/45th runs' tunings
PROJECTIONS = ("qkv", "o", "gate_up", "down")
PARTS = ("all", "gemvs", "others", "norms", "attention", "no_norms", *PROJECTIONS)  # a projection: it alone


def parse_kinds(text: str) -> dict[str, str]:
    """``qkv=imma,o=...`` -> {projection: native kind}; every projection must be named once."""
    kinds = {}
    for item in text.split(","):
        name, sep, kind = item.partition("=")
        if not sep or name not in ("qkv", "o", "gate_up", "down") or not kind or name in kinds:
            raise ValueError(f"--kinds: {item!r} is not one of qkv=, o=, gate_up=, down= with a kind")
        kinds[name] = kind
    missing = {"qkv", "o", "gate_up", "down"} - set(kinds)
    if missing:
        raise ValueError(f"--kinds names no kind for {', '.join(sorted(missing))}")
    return kinds


class Chain:
    """The layers' weights, caches and step buffers on the GPU, and one decode layer's launches."""

    def __init__(self, scheme: str, context: int, page: int = 16, table_blocks: int = 64) -> None:
        import torch

        from mgx.kernels.triton import attention
        from mgx.kernels.triton.testing import make_weight

        if context > table_blocks * page:
            raise ValueError(f"--context {context} is past the table's {table_blocks * page} tokens")
        dev, bf16 = "cuda", torch.bfloat16
        self.scheme = scheme
        group = {"group_size": 128} if scheme == "int4" else {}
        qkv_n = (HEADS + 2 * KV_HEADS) * HEAD_DIM

        def weight(n: int, k: int):  # noqa: ANN202
            return make_weight(scheme, n, k, device=dev, **group)

        def cache():  # noqa: ANN202
            return torch.randn(table_blocks, page, KV_HEADS, HEAD_DIM, device=dev).to(bf16)

        self.layers = [{"qkv": weight(qkv_n, HIDDEN), "o": weight(HIDDEN, HEADS * HEAD_DIM),
                        "gate_up": weight(2 * FFN, HIDDEN), "down": weight(HIDDEN, FFN),
                        "g1": torch.rand(HIDDEN, device=dev).to(bf16) + 0.5,
                        "g2": torch.rand(HIDDEN, device=dev).to(bf16) + 0.5,
                        "kc": cache(), "vc": cache(),
                        "counters": attention.new_decode_counters(dev, 1, KV_HEADS)}
                       for _ in range(LAYERS)]  # fmt: skip
        self.table = torch.arange(table_blocks, device=dev, dtype=torch.int32)[None]
        self.max_context = table_blocks * page
        self.context = torch.tensor([context], device=dev, dtype=torch.int32)
        self.inv_freq = 1.0 / (500000.0 ** (torch.arange(0, HEAD_DIM, 2, device=dev).float() / HEAD_DIM))
        self.sms = torch.cuda.get_device_properties(dev).multi_processor_count
        # As the backend's batch-1 graph: pieces of one 64-token tile over the table's context
        # (self.attention_block_n; --attention-block-n).
        self.tiles_of(64)
        self.attention_warps = 4  # the decode attention's warps a program (the backend's; --attention-warps)
        self.self_merge = True  # whether the pieces' last merges them (the backend's rule: SELF_MERGE_MAX_SPLITS)
        self.stand_in = {"qkv": torch.randn(1, qkv_n, device=dev).to(bf16),  # outputs of the parts left out
                         "attention": torch.randn(1, HEADS * HEAD_DIM, device=dev).to(bf16),
                         "gate_up": torch.randn(1, FFN, device=dev).to(bf16),
                         "down": torch.randn(1, HIDDEN, device=dev).to(bf16)}  # fmt: skip
        self.x = {"res": torch.randn(1, HIDDEN, device=dev).to(bf16), "d": self.stand_in["down"]}
        self.staged: set[str] = set()  # projections whose x is staged once (--staged)
        self.stage_in_graph = True  # False: their records are staged before the graph (stale, for timing)
        self.norm_stages = False  # the norms before QKV and gate/up write the records (gemv.norm_stage)
        self.records: dict[str, object] = {}
        self.tiled: dict[bool, list[dict]] = {}  # the layers in cuda_tile16, without and with scale pairs (layers_for)
        self.totals = [torch.empty(1, HIDDEN, device=dev, dtype=bf16) for _ in range(2)]  # norm_stage's x + delta, by turns
        # Stands in for gate/up and down where set: called with gate/up's record (bench_gpu_mlp.py's
        # fused MLP); the next layer's norm then reads the stand-in for down's output.
        self.mlp: Callable[[object], None] | None = None
        # Projections left out of every chain (their stand-in outputs instead): what the rest takes
        # without them (bench_gpu_mlp.py's leave_out part).
        self.leave_out: set[str] = set()

    def tiles_of(self, block_n: int) -> None:
        """Decode attention on tiles of ``block_n`` tokens, the context cut into pieces as the backend cuts
        it for its batch-1 graph (one tile a piece at least)."""
        from mgx.kernels.triton import attention

        self.attention_block_n = block_n
        self.splits = attention.decode_splits(1, KV_HEADS, self.max_context, self.sms, block_n, 1)

    def _norm(self, name: str, x, res, g, kernels):  # noqa: ANN001, ANN202
        """The add + RMSNorm before projection ``name``: (its x, the new residual, its record or None)."""
        from mgx.kernels.cuda.gemv import NormPrologue, norm_stage
        from mgx.kernels.cuda.rmsnorm import rms_norm

        if not (self.norm_stages and name in self.staged):
            return (*rms_norm(x, g, 1e-5, kernels=kernels, residual=res), None)
        total = self.totals[0] if res.data_ptr() != self.totals[0].data_ptr() else self.totals[1]
        out, rec = norm_stage(res, NormPrologue(x, g, 1e-5, total), self.scheme, kernels=kernels)
        return out, total, rec

    def _gemv(self, name: str, x, w: dict, kernels, kind: str, silu_mul: bool = False, rec=None):  # noqa: ANN001, ANN202
        """One projection, as --staged says: the kind itself, or x staged once (``rec``: by the norm)
        and its staged twin."""
        from mgx.kernels.cuda.gemv import gemv, gemv_staged, stage_x, staged_bytes

        if name not in self.staged:
            return gemv(x, w[name], kernels=kernels, kind=kind, silu_mul=silu_mul)
        if rec is not None:
            return gemv_staged(rec, w[name], kernels=kernels, kind=kind, silu_mul=silu_mul)
        import torch

        rec = self.records.get(name)
        if rec is None or self.stage_in_graph:  # staged before the graph: once, in the first (uncaptured) run
            if rec is None:
                rec = self.records[name] = torch.empty(staged_bytes(x.shape[1]), dtype=torch.uint8, device=x.device)
            stage_x(x, w[name].scheme, kernels=kernels, out=rec)
        return gemv_staged(rec, w[name], kernels=kernels, kind=kind, silu_mul=silu_mul)

    def layer(self, w: dict, kernels, kinds: dict[str, str], part: str) -> None:  # noqa: ANN001
        from mgx.kernels.triton.attention import DecodeRope, paged_attention_decode

        gemvs, norms = part in ("all", "gemvs", "no_norms"), part in ("all", "others", "norms")
        runs = {p: (gemvs or part == p) and p not in self.leave_out for p in PROJECTIONS}
        attend = part in ("all", "others", "attention", "no_norms")
        res = self.x["res"]
        x, rec = self.x["d"], None
        if norms:
            x, res, rec = self._norm("qkv", x, res, w["g1"], kernels)
        qkv = self._gemv("qkv", x, w, kernels, kinds["qkv"], rec=rec) if runs["qkv"] else self.stand_in["qkv"]
        a = self.stand_in["attention"]
        if attend:
            q_end, k_end = HEADS * HEAD_DIM, (HEADS + KV_HEADS) * HEAD_DIM
            rope = DecodeRope(qkv[:, q_end:k_end], qkv[:, k_end:], self.inv_freq)
            a = paged_attention_decode(qkv[:, :q_end], w["kc"], w["vc"], self.table, self.context,
                                       scale=HEAD_DIM**-0.5, num_splits=self.splits, max_context_len=self.max_context,
                                       counters=w["counters"] if self.self_merge else None, rope=rope,
                                       block_n=self.attention_block_n, num_warps=self.attention_warps)  # fmt: skip
        o = self._gemv("o", a, w, kernels, kinds["o"]) if runs["o"] else self.stand_in["down"]
        x2, rec = o, None
        if norms:
            x2, res, rec = self._norm("gate_up", o, res, w["g2"], kernels)
        if self.mlp is not None and rec is not None:
            self.mlp(rec)
            self.x["d"] = self.stand_in["down"]
        else:
            h = self._gemv("gate_up", x2, w, kernels, kinds["gate_up"], silu_mul=True, rec=rec) if runs["gate_up"] else self.stand_in["gate_up"]
            self.x["d"] = self._gemv("down", h, w, kernels, kinds["down"]) if runs["down"] else self.stand_in["down"]
        self.x["res"] = res

    def layers_for(self, kernels) -> list[dict]:  # noqa: ANN001
        """The layers' weights as ``kernels`` read them: in the cuda_tile16 layout for a MGX_IMMA_TILE16
        build (tiled once, kept beside the row-major ones; with scale pairs for a MGX_IMMA_HALF_SCALES
        one), else row-major."""
        from mgx.kernels.cuda.gemv import reads_half_scales, reads_tile16
        from mgx.kernels.triton.testing import as_read_by

        if not reads_tile16(kernels, self.scheme):
            return self.layers
        half = reads_half_scales(kernels)
        if half not in self.tiled:
            names = ("qkv", "o", "gate_up", "down")
            self.tiled[half] = [{**w, **{p: as_read_by(w[p], kernels, p == "gate_up") for p in names}}
                                for w in self.layers]  # fmt: skip
        return self.tiled[half]

    def step(self, kernels, kinds: dict[str, str], part: str) -> Callable[[], None]:  # noqa: ANN001
        layers = self.layers_for(kernels)

        def run() -> None:
            for w in layers:
                self.layer(w, kernels, kinds, part)

        return run


def int_list(ap: argparse.ArgumentParser, option: str, text: str) -> list[int]:
    """``option``'s comma-separated integers, or the parser's error naming it."""
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        ap.error(f"{option}: {text!r} is not a comma-separated list of integers")


def graph_ms(fn: Callable[[], None], replays: int) -> float:
    """Median milliseconds of a replay of ``fn`` captured in a CUDA graph with overlapped launches."""
    import torch

    from mgx.kernels.triton._common import overlapped_launches

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), overlapped_launches(True):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with overlapped_launches(True), torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def load_kernels(flags: tuple[str, ...]):  # noqa: ANN201
    """The native kernels built for this GPU with ``flags``, launched overlapped where they can be."""
    import torch

    from mgx.kernels.cuda.build import arch_for, build_cuda_kernels
    from mgx.kernels.cuda.rmsnorm import load_cuda_kernels

    major, minor = torch.cuda.get_device_capability()
    arch = arch_for(major, minor)
    kernels = load_cuda_kernels(build_cuda_kernels(arch, extra_flags=flags), arch)
    if kernels is None:
        raise SystemExit(f"the native kernels built for {arch} do not load on this GPU")
    kernels.allow_overlap(10 * major + minor)
    return kernels


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scheme", choices=sorted(DEFAULT_KINDS), default="int4")
    ap.add_argument("--kinds", help="native kind of each projection, e.g. qkv=imma,o=imma_w16,gate_up=imma_w4,down=imma_w16")
    ap.add_argument("--context", type=int, default=768, help="tokens in the cache (at most 16 x --table-blocks)")
    ap.add_argument("--table-blocks", type=int, default=64, help="block table width in 16-token pages (the graph's)")
    ap.add_argument("--self-merge-max", default="", help="most pieces the last one merges, comma-separated "
                    "limits to time (default: the backend's SELF_MERGE_MAX_SPLITS)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"which chains, of {', '.join(PARTS)}")
    ap.add_argument("--nvcc-flag", action="append", default=[], help="also on kernels built with this flag (repeatable; with =: --nvcc-flag=-D...; "
                    "several flags of one build apart by spaces)")
    ap.add_argument("--staged", default="", help="also with these projections' x staged once (of qkv, o, gate_up, "
                    "down; their kinds: imma, imma_w4 or imma_w16), staged in the graph and before it")
    ap.add_argument("--attention-warps", default="4", help="warps a decode attention program, comma-separated "
                    "counts to time (the backend launches 4)")
    ap.add_argument("--attention-block-n", default="64", help="tokens a decode attention tile, comma-separated "
                    "sizes to time (the backend's 64; the pieces are cut for each as the backend cuts them)")
    ap.add_argument("--replays", type=int, default=50)
    args = ap.parse_args(argv)
    try:
        kinds = parse_kinds(args.kinds or DEFAULT_KINDS[args.scheme])
    except ValueError as e:
        ap.error(str(e))
    staged = [p for p in args.staged.split(",") if p]
    from mgx.kernels.cuda.gemv import STAGED_KINDS

    if bad := [p for p in staged if p not in kinds or kinds[p] not in STAGED_KINDS]:
        ap.error(f"--staged: {', '.join(bad)} not a projection on one of {', '.join(STAGED_KINDS)}")
    warps = int_list(ap, "--attention-warps", args.attention_warps)
    if bad_warps := [w for w in warps if w not in (1, 2, 4, 8, 16)]:
        ap.error(f"--attention-warps: {bad_warps} not a power of two from 1 to 16")
    tiles = int_list(ap, "--attention-block-n", args.attention_block_n)
    if bad_tiles := [n for n in tiles if n not in (16, 32, 64, 128, 256)]:
        ap.error(f"--attention-block-n: {bad_tiles} not a power of two from 16 to 256")
    parts = args.parts.split(",")
    if unknown := [p for p in parts if p not in PARTS]:
        ap.error(f"--parts: {', '.join(unknown)} not one of {', '.join(PARTS)}")
    if not 0 < args.context <= 16 * args.table_blocks:
        ap.error(f"--context {args.context} is not within the table's {16 * args.table_blocks} tokens (--table-blocks)")
    limits = int_list(ap, "--self-merge-max", args.self_merge_max) if args.self_merge_max else [None]
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu_layer needs an NVIDIA GPU")
    builds = {"stored flags": load_kernels(())}
    builds.update({flag: load_kernels(tuple(flag.split())) for flag in args.nvcc_flag})  # "-DA=1 -DB=2": both
    from mgx.runtime.backend_cuda import SELF_MERGE_MAX_SPLITS

    chain = Chain(args.scheme, args.context, table_blocks=args.table_blocks)
    print(f"{args.scheme}, {LAYERS} layers, context {args.context}, {chain.splits} attention pieces, kinds {kinds}")
    for limit in limits:
        variants = [("", set(), True, False)]
        if staged:
            variants += [(f" [{'+'.join(staged)} staged]", set(staged), True, False),
                         (f" [{'+'.join(staged)} staged before the graph]", set(staged), False, False)]  # fmt: skip
            if {"qkv", "gate_up"} & set(staged):
                variants.append((f" [{'+'.join(staged)} staged, qkv/gate_up by their norms]", set(staged), True, True))
        for (label, kernels), chain.attention_warps, block_n in itertools.product(builds.items(), warps, tiles):
            if len(warps) > 1:
                label = f"{label} [attention on {chain.attention_warps} warps]"
            chain.tiles_of(block_n)
            chain.self_merge = chain.splits <= (SELF_MERGE_MAX_SPLITS if limit is None else limit)
            merge = "" if limit is None else f" [{'self-merge' if chain.self_merge else 'merge kernel'}, limit {limit}]"
            if len(tiles) > 1:
                label = f"{label} [attention tiles of {block_n}, {chain.splits} pieces]"
            for how, chain.staged, chain.stage_in_graph, chain.norm_stages in variants:
                chain.records.clear()
                for part in parts:
                    ms = graph_ms(chain.step(kernels, kinds, part), args.replays)
                    rate = ""
                    if part in PROJECTIONS:
                        gb = sum(w[part].gemv_nbytes for w in chain.layers_for(kernels)) / 1e9  # codes, scales, zeros or pairs
                        rate = f", {1e3 * gb / ms:.0f} GB/s of weights"
                    print(f"  {label}{merge}{how}: {part} {ms:.3f} ms ({1e3 * ms / LAYERS:.2f} us a layer{rate})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
