"""Nsight Compute's view of the native GEMV kinds on the Llama-3.1-8B decode products: per scheme,
shape and kind, the kernel's duration, DRAM and SM throughput, warp instructions per KiB of weights,
cycles between a warp's instructions and occupancy -- what says whether a GEMV is bound by its bytes
or by its instructions.

    python examples/ncu_gemv.py [--kinds imma,imma_persistent] [--schemes int4,w8a16] [--nvcc-flag=-D...] [--stalls]
    python examples/ncu_gemv.py --kinds imma_w4,imma_w4+staged --schemes int4   # a kind's staged twin beside it
    python examples/ncu_gemv.py --kinds imma_w4+staged --schemes int4 --nvcc-flag=-DMGX_IMMA_TILE16=1 --stalls
        # a build that reads cuda_tile16 codes (the product's for cuda artifacts) gets tiled weights
    python examples/ncu_gemv.py --parse report.csv --manifest launches.json   # a saved report, no GPU

On a GPU host the script runs itself under ncu (``--launch``: build gemv.cu, launch every applicable
kind twice per product, and write the manifest of those launches in order) and reads ncu's CSV
back. ncu locks the clocks at the GPU's base frequency (1.35 GHz SM on the H200), so durations are
longer than ``bench_gpu_kernels.py --only native`` reports; the ratios between kinds and the
instruction counts are what to compare.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SHAPES = ((6144, 4096, False), (4096, 4096, False), (28672, 4096, True), (4096, 14336, False))  # (N, K, gate/up)
METRICS = {  # ncu metric name -> our key
    "Duration": "duration_ns",
    "DRAM Throughput": "dram_pct",
    "Compute (SM) Throughput": "sm_pct",
    "Executed Instructions": "instructions",
    "Warp Cycles Per Issued Instruction": "cycles_per_issue",
    "Achieved Occupancy": "occupancy_pct",
    "Registers Per Thread": "registers",
}
SECTIONS = ("SpeedOfLight", "Occupancy", "LaunchStats", "WarpStateStats", "InstructionStats")
# --stalls: where a warp's cycles between two issued instructions go, per reason (ncu's raw warp-state
# metrics, listed by ncu outside the sections); the table names the three largest.
STALL_PREFIX, STALL_SUFFIX = "smsp__average_warps_issue_stalled_", "_per_issue_active.ratio"
STALLS = ("long_scoreboard", "short_scoreboard", "wait", "barrier", "membar", "math_pipe_throttle", "mio_throttle",
          "lg_throttle", "not_selected", "selected", "no_instruction", "dispatch_stall", "branch_resolving", "drain",
          "sleeping", "imc_miss", "tex_throttle", "misc")  # fmt: skip


def parse_report(text: str) -> list[dict]:
    """ncu's ``--csv --page details`` output (any lines before its header, e.g. ``==PROF==``, ignored):
    one dict per profiled launch, in launch order, with the kernel's name and METRICS' values."""
    start = text.find('"ID"')
    if start < 0:
        raise ValueError("no ncu CSV header (a line starting with \"ID\") in the report")
    launches: dict[int, dict] = {}
    for row in csv.DictReader(io.StringIO(text[start:])):
        if not row.get("ID", "").isdigit():
            continue
        launch = launches.setdefault(int(row["ID"]), {"kernel": row["Kernel Name"], "grid": row["Grid Size"]})
        name = row["Metric Name"]
        key = METRICS.get(name)
        if name.startswith(STALL_PREFIX) and name.endswith(STALL_SUFFIX):
            key = "stall:" + name[len(STALL_PREFIX) : -len(STALL_SUFFIX)]
        if key is not None:
            launch[key] = float(row["Metric Value"].replace(",", ""))
    return [launches[i] for i in sorted(launches)]


def summarize(launches: list[dict], manifest: list[dict]) -> list[dict]:
    """One row per (scheme, N, K, kind) of the manifest: the median of its launches' metrics, with the
    weights' bytes per second and warp instructions per KiB of weights."""
    if len(launches) != len(manifest):
        raise ValueError(f"the report has {len(launches)} launches and the manifest {len(manifest)}: "
                         "profile with the filter the script uses, and every launch it makes")  # fmt: skip
    groups: dict[tuple, list[tuple[dict, dict]]] = {}
    for launch, entry in zip(launches, manifest, strict=True):
        if entry["entry"] not in launch["kernel"]:
            raise ValueError(f"launch {launch['kernel']!r} is not the manifest's {entry['entry']!r}")
        groups.setdefault((entry["scheme"], entry["n"], entry["k"], entry["kind"]), []).append((launch, entry))
    rows = []
    for (scheme, n, k, kind), pairs in groups.items():
        row = {"scheme": scheme, "n": n, "k": k, "kind": kind, "grid": pairs[0][0]["grid"]}
        keys = [*METRICS.values(), *sorted({k for launch, _ in pairs for k in launch if k.startswith("stall:")})]
        for key in keys:
            values = [launch[key] for launch, _ in pairs if key in launch]
            if values:
                row[key] = statistics.median(values)
        weight_bytes = pairs[0][1]["weight_bytes"]
        if "duration_ns" in row:
            row["weight_gb_s"] = weight_bytes / row["duration_ns"]
        if "instructions" in row:
            row["instructions_per_kib"] = row["instructions"] / (weight_bytes / 1024)
        rows.append(row)
    return rows


def top_stalls(row: dict, most: int = 3) -> str:
    """The row's largest stall reasons, "long_scoreboard 6.10, wait 1.20, ..." (cycles per issued
    instruction), or "" without --stalls."""
    stalls = sorted(((v, k.removeprefix("stall:")) for k, v in row.items() if k.startswith("stall:")), reverse=True)
    return ", ".join(f"{name} {value:.2f}" for value, name in stalls[:most])


def table(rows: list[dict]) -> str:
    stalls = any(k.startswith("stall:") for r in rows for k in r)
    head = ("scheme", "N x K", "kind", "grid", "us", "GB/s", "DRAM %", "SM %", "inst/KiB", "cyc/issue", "occ %", "regs")
    lines = [" | ".join(head + (("top stalls (cycles a warp waits per issue)",) if stalls else ()))]
    for r in rows:
        def num(key: str, fmt: str, scale: float = 1.0, r: dict = r) -> str:
            return format(r[key] * scale, fmt) if key in r else "-"

        cells = (r["scheme"], f"{r['n']}x{r['k']}", r["kind"], r["grid"], num("duration_ns", ".1f", 1e-3),
                 num("weight_gb_s", ".0f"), num("dram_pct", ".1f"), num("sm_pct", ".1f"),
                 num("instructions_per_kib", ".1f"), num("cycles_per_issue", ".2f"),
                 num("occupancy_pct", ".1f"), num("registers", ".0f"))  # fmt: skip
        lines.append(" | ".join(cells + ((top_stalls(r) or "-",) if stalls else ())))
    return "\n".join(lines)


STAGED_SUFFIX = "+staged"  # a kind's staged twin (gemv_staged on x staged once, as a model runs INT4)


def split_kind(kind: str) -> tuple[str, bool]:
    """(native kind, staged twin?) of a ``--kinds`` item: ``imma_w4`` or ``imma_w4+staged``."""
    return (kind[: -len(STAGED_SUFFIX)], True) if kind.endswith(STAGED_SUFFIX) else (kind, False)


def launch(kinds: list[str], schemes: list[str], flags: tuple[str, ...], manifest_path: Path) -> None:
    """Under ncu: each applicable (scheme, product, kind) launched twice; the manifest records them in order."""
    import torch

    from mgx.kernels.cuda import gemv as cg
    from mgx.kernels.cuda.build import arch_for, build_cuda_kernels
    from mgx.kernels.cuda.rmsnorm import load_cuda_kernels
    from mgx.kernels.triton.testing import as_read_by, make_weight

    major, minor = torch.cuda.get_device_capability()
    arch = arch_for(major, minor)
    for flag in flags:  # a block of another warp count launches with as many threads
        if flag.startswith("-DMGX_IMMA_WARPS="):
            cg.IMMA_THREADS = 32 * int(flag.split("=", 1)[1])
    kernels = load_cuda_kernels(build_cuda_kernels(arch, extra_flags=flags), arch)
    if kernels is None:
        raise SystemExit(f"the native kernels did not load for {arch}")
    manifest = []
    for scheme in schemes:
        for n, k, silu in SHAPES:
            w = make_weight(scheme, n, k, device="cuda", **({"group_size": 128} if scheme == "int4" else {}))
            w = as_read_by(w, kernels, silu)  # cuda_tile16 codes (and scale pairs) as the build reads them
            x = torch.randn(1, k, device="cuda").to(torch.bfloat16)
            weight_bytes = w.gemv_nbytes  # codes, scales and zeros or their fp16 pairs
            for kind in kinds:
                base, staged = split_kind(kind)
                if not (cg.staged_applies if staged else cg.gemv_applies)(kernels, x, w, kind=base):
                    continue
                # the stage kernel's name is not the filter's (mgx_imma_stage_...): it runs unprofiled
                rec = cg.stage_x(x, scheme, kernels=kernels) if staged else None
                entry = (cg.STAGED_ENTRIES[base, scheme] if staged else cg.entry_for(base, scheme)).rsplit("_v", 1)[0]
                for _ in range(2):
                    if staged:
                        cg.gemv_staged(rec, w, kernels=kernels, kind=base, silu_mul=silu)
                    else:
                        cg.gemv(x, w, kernels=kernels, silu_mul=silu, kind=base)
                    manifest.append({"scheme": scheme, "n": n, "k": k, "kind": kind, "entry": entry,
                                     "weight_bytes": weight_bytes})  # fmt: skip
            torch.cuda.synchronize()
    manifest_path.write_text(json.dumps(manifest))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kinds", default="mma_pipelined,imma,imma_persistent",
                    help="native kinds, comma-separated; KIND+staged: its staged twin (imma, imma_w4, imma_w16)")
    ap.add_argument("--schemes", default="int4,w8a16")
    ap.add_argument("--nvcc-flag", action="append", default=[], help="a compile-time setting of gemv.cu, written --nvcc-flag=-DMGX_IMMA_CACHE=0")
    ap.add_argument("--csv", type=Path, help="keep ncu's report here")
    ap.add_argument("--stalls", action="store_true", help="also collect the warp stall reasons (the table's top three)")
    ap.add_argument("--parse", type=Path, help="summarize a saved report (with --manifest) instead of profiling")
    ap.add_argument("--manifest", type=Path)
    ap.add_argument("--launch", action="store_true", help=argparse.SUPPRESS)  # the child run under ncu
    args = ap.parse_args()
    kinds, schemes = args.kinds.split(","), args.schemes.split(",")
    if args.parse is not None:
        if args.manifest is None:
            ap.error("--parse needs --manifest (the launches the report holds, in order)")
        print(table(summarize(parse_report(args.parse.read_text()), json.loads(args.manifest.read_text()))))
        return
    from mgx.kernels.cuda.gemv import KINDS, STAGED_KINDS

    for kind in kinds:
        base, staged = split_kind(kind)
        if base not in (STAGED_KINDS if staged else KINDS):
            ap.error(f"unknown kind {kind!r}: one of {', '.join(KINDS)}, or {', '.join(STAGED_KINDS)} with {STAGED_SUFFIX}")
    if args.launch:
        launch(kinds, schemes, tuple(args.nvcc_flag), args.manifest)
        return
    ncu = shutil.which("ncu") or "/usr/local/cuda/bin/ncu"
    if not Path(ncu).exists():
        raise SystemExit("ncu (Nsight Compute) not found: put it on PATH")
    with tempfile.TemporaryDirectory() as tmp:
        manifest = Path(tmp) / "launches.json"
        stalls = ["--metrics", ",".join(STALL_PREFIX + r + STALL_SUFFIX for r in STALLS)] if args.stalls else []
        cmd = [ncu, "--csv", "--page", "details", "-k", "regex:^mgx_gemv_", *(a for s in SECTIONS for a in ("--section", s)),
               *stalls,
               sys.executable, __file__, "--launch", "--kinds", args.kinds, "--schemes", args.schemes,
               "--manifest", str(manifest), *(f"--nvcc-flag={f}" for f in args.nvcc_flag)]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0 or not manifest.exists():
            raise SystemExit(f"ncu failed ({done.returncode}):\n{done.stderr[-3000:]}")
        if args.csv is not None:
            args.csv.write_text(done.stdout)
        print(table(summarize(parse_report(done.stdout), json.loads(manifest.read_text()))))


if __name__ == "__main__":
    main()
