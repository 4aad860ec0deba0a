"""The Llama-3.1-8B INT4 MLP at batch 1 as one kernel (gemv.cu's ``mlp_int4_fused``, forty-third
session; the variants in ``examples/mlp_fused.cu``) against the two GEMVs the model runs by default,
on an NVIDIA GPU.

Without the fused MLP (``MGX_CUDA_FUSED_MLP=0``) the model runs gate/up with the SiLU product
(``imma_w4``'s staged twin on the record ``norm_stage`` wrote) and then down (``imma_w16``, which
stages its x in each of its blocks), two launches a layer. The fused kernel's block b computes SiLU outputs 128 b .. 128 b + 127 and multiplies
them by down's 128-column step b at once, adding its share of every output row into a row in L2: fp32
(its last bits vary from run to run) or, in the ``_x`` entries, 64-bit fixed point (the same bits every
run). ``w16_u2_d4_b1_x`` is the variant of the product's entry, which the CUDA backend runs by
default.

- ``check``: the fused kernel's row against the two GEMVs' on random 8B weights (three scales of x);
- ``chains``: 32 layers in one CUDA graph, ms: the MLP after its norm (``norm_stage``) both ways, the
  GEMVs alone both ways, the fused kernel with each phase alone (timing only), and the whole decode
  layer (``bench_gpu_layer.py``'s chain staged by the norms) both ways;
- ``timeline``: one replay of the MLP chain with per-block timestamps: when each block finished phase 1
  (gate/up) and phase 2 (down), and the gap to the next layer's first block;
- ``leave_out``: the whole decode layer with the fused MLP again, twice over, with o_proj, QKV or both
  left out (their stand-in outputs read instead): what each launch costs in the step, an upper bound
  on what folding it into a neighbour could save.

    python examples/bench_gpu_mlp.py [--entries w16_u4_d4_b1,w32_u2_d2_b0] [--parts check,chains,timeline]

Entries are named by warps a block (w), gate/up steps a warp keeps in flight (u), down row groups in
flight (d) and whether those are double-buffered (b). Needs an NVIDIA GPU of sm_90 or newer and nvcc.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "mlp_fused.cu"
# MGX_MLP_ENTRY's in mlp_fused.cu; "_x": the row in 64-bit fixed point (the same bits every run)
ENTRIES = ("w32_u2_d2_b0", "w16_u4_d4_b1", "w16_u2_d4_b1", "w32_u2_d2_b0_x", "w16_u2_d4_b1_x")
PARTS = ("check", "chains", "timeline", "leave_out")
LEAVE_OUT = ((), ("o",), ("qkv",), ("qkv", "o"))  # the leave_out part's chains: projections left out
FLAGS = ("-DMGX_IMMA_TILE16=1", "-DMGX_IMMA_HALF_SCALES=1")  # the layout and scales the kernel reads
MODES = {"phase 1 only": 1, "phase 2 only": 2, "stores, no reductions": 4}  # mlp_fused.cu's timing knobs


def entry_name(entry: str) -> str:
    from mgx.kernels.cuda.rmsnorm import KERNEL_ABI

    return f"mgx_mlp_int4_{entry}_v{KERNEL_ABI}"


def warps(entry: str) -> int:
    return int(entry.split("_")[0][1:])


def fixed(entry: str) -> bool:
    """Whether ``entry`` adds the row up in 64-bit fixed point (int64 of 2^-32) instead of fp32."""
    return entry.endswith("_x")


def new_rows(entry: str, *shape: int):  # noqa: ANN201
    """Zeroed rows for ``entry``'s sums: int64 with ``fixed`` (and two more columns: the flag the kernel
    sets where it meets a NaN or Inf, a pad), else fp32."""
    import torch

    if fixed(entry):
        return torch.zeros(*shape[:-1], shape[-1] + 2, dtype=torch.int64, device="cuda")
    return torch.zeros(*shape, dtype=torch.float32, device="cuda")


def as_float(entry: str, row):  # noqa: ANN001, ANN201
    """``entry``'s summed row as fp32."""
    return (row.double() * 2.0**-32).float() if fixed(entry) else row


def unit_text() -> str:
    """The translation unit: the product's kernels, then the experiment's (it uses gemv.cu's helpers)."""
    from mgx.kernels.cuda import build

    return "".join(f'#include "{build.HERE / name}"\n' for name in build.SOURCES) + f'#include "{SOURCE}"\n'


def build_image(arch: str) -> bytes:
    from mgx.kernels.cuda import build

    return build.compile_unit(unit_text(), arch, extra_flags=FLAGS)


def record_bytes(k: int) -> int:
    """Dynamic shared memory of a launch on K columns: the staged record, rounded up to 16 bytes."""
    from mgx.kernels.cuda.gemv import fused_mlp_shared

    return fused_mlp_shared(k)


class Fused:
    """The experiment's kernels on one GPU, beside the product's (same image, same flags)."""

    def __init__(self) -> None:
        import torch

        from mgx.kernels.cuda.build import arch_for
        from mgx.kernels.cuda.rmsnorm import load_cuda_kernels

        major, minor = torch.cuda.get_device_capability()
        arch = arch_for(major, minor)
        self.kernels = load_cuda_kernels(build_image(arch), arch)
        if self.kernels is None:
            raise SystemExit(f"the kernels built for {arch} do not load on this GPU")
        self.kernels.allow_overlap(10 * major + minor)

    def launch(self, entry: str, rec, wgu, wd, acc, mode: int = 0, stamps=None) -> None:  # noqa: ANN001
        """acc (``new_rows``: fp32 [1, N], or int64 of 2^-32 [1, N + 2] for a ``fixed`` entry) +=
        down(silu(gate) * up) of the row staged in rec; wgu and wd as ``testing.as_read_by`` gives them
        to a MGX_IMMA_TILE16 + HALF_SCALES build (the 8B shapes: the record fits 48 KB of shared memory)."""
        import torch

        from mgx.kernels.cuda.gemv import fused_mlp_args, fused_mlp_blocks

        stream = torch.cuda.current_stream().cuda_stream
        self.kernels.module.launch(entry_name(entry), (fused_mlp_blocks(wgu),), (32 * warps(entry),),
                                   fused_mlp_args(acc, rec, wgu, wd, mode, stamps), stream, record_bytes(wgu.k),
                                   overlap=self.kernels.overlap)  # fmt: skip


def check(fused: Fused, entry: str, w: dict) -> list[tuple[float, float, float]]:
    """Per scale of x: (relative error of the fused row against the two GEMVs' bf16 row, the same with
    the fused row rounded to bf16, the largest difference between two runs of the fused kernel over the
    row's largest magnitude)."""
    import torch

    from mgx.kernels.cuda.gemv import gemv, gemv_staged, stage_x

    k = fused.kernels
    gen = torch.Generator(device="cuda").manual_seed(0)
    found = []
    for scale in (1.0, 4.0, 16.0):
        x = (torch.randn(1, w["gate_up"].k, device="cuda", generator=gen) * scale).to(torch.bfloat16)
        rec = stage_x(x, "int4", kernels=k)
        h = gemv_staged(rec, w["gate_up"], kernels=k, kind="imma_w4", silu_mul=True)
        want = gemv(h, w["down"], kernels=k, kind="imma_w16").float()
        runs = []
        for _ in range(2):
            acc = new_rows(entry, 1, w["down"].n)
            fused.launch(entry, rec, w["gate_up"], w["down"], acc)
            runs.append(as_float(entry, acc[:, : w["down"].n]))
        torch.cuda.synchronize()
        norm = float(want.norm())
        found.append((float((runs[0] - want).norm()) / norm, float((runs[0].bfloat16().float() - want).norm()) / norm,
                      float((runs[0] - runs[1]).abs().max() / want.abs().max())))  # fmt: skip
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--entries", default=",".join(ENTRIES), help=f"fused kernels to run, of {', '.join(ENTRIES)}")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"of {', '.join(PARTS)}")
    ap.add_argument("--replays", type=int, default=50)
    args = ap.parse_args(argv)
    entries, parts = args.entries.split(","), args.parts.split(",")
    if bad := [e for e in entries if e not in ENTRIES]:
        ap.error(f"--entries: {', '.join(bad)} not one of {', '.join(ENTRIES)}")
    if bad := [p for p in parts if p not in PARTS]:
        ap.error(f"--parts: {', '.join(bad)} not one of {', '.join(PARTS)}")
    if args.replays < 1:
        ap.error("--replays must be positive")
    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        raise SystemExit("bench_gpu_mlp needs an NVIDIA GPU of sm_90 or newer")
    sys.path.insert(0, str(HERE))
    from bench_gpu_layer import LAYERS, Chain, graph_ms

    from mgx.kernels.cuda.gemv import fused_mlp_blocks, gemv, gemv_staged, stage_x

    fused = Fused()
    chain = Chain("int4", 768)
    chain.staged, chain.norm_stages, chain.stage_in_graph = {"qkv", "gate_up"}, True, True
    layers = chain.layers_for(fused.kernels)
    kinds = {"qkv": "imma", "o": "imma_w16", "gate_up": "imma_w4", "down": "imma_w16"}
    rows = {e: new_rows(e, LAYERS, 1, layers[0]["down"].n) for e in entries}
    fixed = stage_x(torch.randn(1, layers[0]["gate_up"].k, device="cuda").to(torch.bfloat16), "int4", kernels=fused.kernels)

    def mlp(entry: str | None, norms: bool, mode: int = 0, stamps=None):  # noqa: ANN001, ANN202
        def run() -> None:
            if entry is not None:
                rows[entry].zero_()
            res = chain.x["res"]
            for i, w in enumerate(layers):
                rec = fixed
                if norms:
                    _, res, rec = chain._norm("gate_up", chain.stand_in["down"], res, w["g2"], fused.kernels)
                if entry is None:
                    h = gemv_staged(rec, w["gate_up"], kernels=fused.kernels, kind=kinds["gate_up"], silu_mul=True)
                    gemv(h, w["down"], kernels=fused.kernels, kind=kinds["down"])
                else:
                    fused.launch(entry, rec, w["gate_up"], w["down"], rows[entry][i], mode,
                                 None if stamps is None else stamps[i])  # fmt: skip

        return run

    def layer(entry: str, leave_out: tuple[str, ...] = ()):  # noqa: ANN202
        def run() -> None:  # bench_gpu_layer's decode layer with the MLP fused (its next norm reads a stand-in)
            rows[entry].zero_()
            chain.leave_out = set(leave_out)
            for i, w in enumerate(layers):
                chain.mlp = lambda rec, w=w, i=i: fused.launch(entry, rec, w["gate_up"], w["down"], rows[entry][i])
                chain.layer(w, fused.kernels, kinds, "all")
            chain.mlp, chain.leave_out = None, set()

        return run

    for entry in entries:
        print(f"{entry} ({entry_name(entry)}):", flush=True)
        if "check" in parts:
            for scale, (err, err_bf16, spread) in zip((1, 4, 16), check(fused, entry, layers[0]), strict=True):
                print(f"  check, x of scale {scale}: relative error {err:.2e} against the two GEMVs (fused row rounded to "
                      f"bf16: {err_bf16:.2e}); two runs differ by at most {spread:.1e} of its largest", flush=True)
        if "chains" in parts:
            times = {"mlp after its norm, two GEMVs": mlp(None, True), "mlp after its norm, fused": mlp(entry, True),
                     "GEMVs alone, two": mlp(None, False), "GEMVs alone, fused": mlp(entry, False),
                     **{f"fused, {what}": mlp(entry, False, mode) for what, mode in MODES.items()},
                     "decode layer, two GEMVs": chain.step(fused.kernels, kinds, "all"), "decode layer, fused": layer(entry)}  # fmt: skip
            for what, fn in times.items():
                ms = graph_ms(fn, args.replays)
                print(f"  {what}: {ms:.3f} ms ({1e3 * ms / LAYERS:.2f} us a layer)", flush=True)
        if "leave_out" in parts:
            for rnd, left in itertools.product((1, 2), LEAVE_OUT):
                ms = graph_ms(layer(entry, left), args.replays)
                print(f"  decode layer, fused, without {' and '.join(left) or 'nothing'} (round {rnd}): {ms:.3f} ms "
                      f"({1e3 * ms / LAYERS:.2f} us a layer)", flush=True)  # fmt: skip
        if "timeline" in parts:
            blocks = fused_mlp_blocks(layers[0]["gate_up"])
            stamps = torch.zeros(LAYERS, blocks, 4, dtype=torch.int64, device="cuda")
            graph_ms(mlp(entry, True, 0, stamps), 1)
            for line in timeline_lines(stamps.cpu().double().tolist()):
                print(f"  {line}", flush=True)
    return 0


def timeline_lines(stamps: list[list[list[float]]]) -> list[str]:
    """What the per-block stamps [layer][block][start, phase 1 end, end, SM] (ns) of one replay say,
    for the second, a middle and the last layer: quantiles over the blocks, us."""

    def q(values: list[float]) -> str:
        v = sorted(values)
        at = [v[0], v[len(v) // 10], statistics.median(v), v[(9 * len(v)) // 10], v[-1]]
        return " ".join(f"{x / 1e3:.2f}" for x in at)

    out = []
    last = len(stamps) - 1
    for i in sorted({min(1, last), last // 2, last}):
        start, mid, end = ([b[c] for b in stamps[i]] for c in range(3))
        t0 = min(start)
        out.append(f"layer {i} (us from its first block; min p10 median p90 max): phase 1 ends "
                   f"{q([m - t0 for m in mid])}, blocks end {q([e - t0 for e in end])}; phase 1 takes "
                   f"{q([m - s for s, m in zip(start, mid, strict=True)])}, phase 2 {q([e - m for m, e in zip(mid, end, strict=True)])}; "
                   f"{len({int(b[3]) for b in stamps[i]})} SMs")  # fmt: skip
        if i < last:
            out.append(f"  gap to layer {i + 1}'s first block: {(min(b[0] for b in stamps[i + 1]) - max(end)) / 1e3:.2f} us")
    return out


if __name__ == "__main__":
    sys.exit(main())
