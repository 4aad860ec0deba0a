"""examples/ncu_gemv.py without a GPU: reading Nsight Compute's CSV report and the table per kind."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _examples import load_example

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "ncu_gemv.py"
ncu_gemv = load_example("ncu_gemv")

HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC",'
          '"Section Name","Metric Name","Metric Unit","Metric Value","Rule Name","Rule Type","Rule Description",'
          '"Estimated Speedup Type","Estimated Speedup"')  # fmt: skip


def _row(i: int, kernel: str, grid: str, section: str, metric: str, unit: str, value: str) -> str:
    return (f'"{i}","1176","python3.12","127.0.0.1","{kernel}","1","7","(256, 1, 1)","{grid}","0","9.0",'
            f'"{section}","{metric}","{unit}","{value}",')  # fmt: skip


def _report(launches: list[tuple[str, str, dict[str, str]]]) -> str:
    lines = ["==PROF== Connected to process 1176 (/usr/bin/python3.12)", "==PROF== Disconnected from process 1176", HEADER]
    for i, (kernel, grid, metrics) in enumerate(launches):
        lines.append(_row(i, kernel, grid, "GPU Speed Of Light Throughput", "SM Frequency", "hz", "1,346,011,691.62"))
        for name, value in metrics.items():
            lines.append(_row(i, kernel, grid, "GPU Speed Of Light Throughput", name, "", value))
    return "\n".join(lines) + "\n"


def _metrics(duration: str, instructions: str) -> dict[str, str]:
    return {"Duration": duration, "DRAM Throughput": "36.97", "Compute (SM) Throughput": "65.00",
            "Executed Instructions": instructions, "Warp Cycles Per Issued Instruction": "9.55",
            "Achieved Occupancy": "42.27", "Registers Per Thread": "62"}  # fmt: skip


MANIFEST = [{"scheme": "int4", "n": 28672, "k": 4096, "kind": "imma", "entry": "mgx_gemv_int4_imma_bf16",
             "weight_bytes": 62_390_272}] * 2  # fmt: skip


def test_report_is_read_per_launch_in_order_and_summarized_per_kind() -> None:
    """Two launches of one kind: their metrics (numbers with thousands separators) by launch, then one
    row with the medians, the weights' GB/s and warp instructions per KiB of weights."""
    text = _report([("mgx_gemv_int4_imma_bf16_v1", "(1792, 1, 1)", _metrics("36,864", "16,902,144")),
                    ("mgx_gemv_int4_imma_bf16_v1", "(1792, 1, 1)", _metrics("37,152", "16,902,144"))])  # fmt: skip
    launches = ncu_gemv.parse_report(text)
    assert [(la["kernel"], la["duration_ns"], la["instructions"]) for la in launches] == [
        ("mgx_gemv_int4_imma_bf16_v1", 36864.0, 16902144.0), ("mgx_gemv_int4_imma_bf16_v1", 37152.0, 16902144.0)]
    (row,) = ncu_gemv.summarize(launches, MANIFEST)
    assert row["duration_ns"] == pytest.approx(37008.0) and row["registers"] == 62.0
    assert row["weight_gb_s"] == pytest.approx(62_390_272 / 37008.0)
    assert row["instructions_per_kib"] == pytest.approx(16902144 / (62_390_272 / 1024))
    assert "28672x4096 | imma | (1792, 1, 1) | 37.0 | 1686 | 37.0 | 65.0 | 277.4 | 9.55 | 42.3 | 62" in ncu_gemv.table([row])


def test_a_report_that_does_not_match_the_manifest_is_refused() -> None:
    one = _report([("mgx_gemv_int4_imma_bf16_v1", "(1792, 1, 1)", _metrics("36,864", "16,902,144"))])
    with pytest.raises(ValueError, match="1 launches and the manifest 2"):
        ncu_gemv.summarize(ncu_gemv.parse_report(one), MANIFEST)
    other = _report([("mgx_gemv_w8a16_imma_bf16_v1", "(1792, 1, 1)", _metrics("1", "1"))] * 2)
    with pytest.raises(ValueError, match="is not the manifest's"):
        ncu_gemv.summarize(ncu_gemv.parse_report(other), MANIFEST)
    with pytest.raises(ValueError, match="no ncu CSV header"):
        ncu_gemv.parse_report("==PROF== nothing profiled\n")


def test_parse_mode_prints_the_table_from_saved_files(tmp_path: Path) -> None:
    report, manifest = tmp_path / "r.csv", tmp_path / "m.json"
    report.write_text(_report([("mgx_gemv_int4_imma_bf16_v1", "(1792, 1, 1)", _metrics("36,864", "16,902,144"))] * 2))
    manifest.write_text(json.dumps(MANIFEST))
    done = subprocess.run([sys.executable, str(SCRIPT), "--parse", str(report), "--manifest", str(manifest)],
                          capture_output=True, text=True, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0].startswith("scheme | N x K | kind")
    assert "int4 | 28672x4096 | imma" in done.stdout
    done = subprocess.run([sys.executable, str(SCRIPT), "--parse", str(report)], capture_output=True, text=True, check=False)
    assert done.returncode == 2 and "--parse needs --manifest" in done.stderr


def test_stall_reasons_are_read_and_the_largest_three_named() -> None:
    """With --stalls ncu lists the raw warp-state metrics outside the sections: each reason's cycles
    per issued instruction, medians per kind, and the table names the three largest."""
    stalls = {f"{ncu_gemv.STALL_PREFIX}{r}{ncu_gemv.STALL_SUFFIX}": v
              for r, v in (("long_scoreboard", "5.10"), ("wait", "1.25"), ("barrier", "0.30"), ("math_pipe_throttle", "0.80"))}
    text = _report([("mgx_gemv_int4_imma_bf16_v1", "(1792, 1, 1)", {**_metrics("36,864", "16,902,144"), **stalls}),
                    ("mgx_gemv_int4_imma_bf16_v1", "(1792, 1, 1)", {**_metrics("37,152", "16,902,144"), **stalls})])  # fmt: skip
    (row,) = ncu_gemv.summarize(ncu_gemv.parse_report(text), MANIFEST)
    assert row["stall:long_scoreboard"] == pytest.approx(5.1) and row["stall:barrier"] == pytest.approx(0.3)
    assert ncu_gemv.top_stalls(row) == "long_scoreboard 5.10, wait 1.25, math_pipe_throttle 0.80"
    out = ncu_gemv.table([row])
    assert out.splitlines()[0].endswith("| top stalls (cycles a warp waits per issue)")
    assert out.splitlines()[1].endswith("| 62 | long_scoreboard 5.10, wait 1.25, math_pipe_throttle 0.80")
    assert "top stalls" not in ncu_gemv.table([{k: v for k, v in row.items() if not k.startswith("stall:")}])


def test_a_kind_with_the_staged_suffix_names_its_staged_twin_and_an_unknown_kind_is_refused() -> None:
    assert ncu_gemv.split_kind("imma_w4+staged") == ("imma_w4", True)
    assert ncu_gemv.split_kind("imma_w4") == ("imma_w4", False)
    # refused before ncu is looked for: gemv has no staged twin, "immaa" is no kind
    for bad in ("gemv+staged", "immaa"):
        done = subprocess.run([sys.executable, str(SCRIPT), "--kinds", f"imma,{bad}"], capture_output=True, text=True,
                              check=False)  # fmt: skip
        assert done.returncode == 2 and f"unknown kind '{bad}'" in done.stderr and "imma_w16 with +staged" in done.stderr
