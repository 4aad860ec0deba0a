"""The CUDA backend's weight upload, host side: how pieces of the mapped artifact pass through the
pinned staging buffers (``_stage_loads``), and the threaded fill of those buffers in turn
(``_stream_stages``), with the device copy replaced by a copy into a host arena."""

from __future__ import annotations

import numpy as np
import pytest
from _examples import load_example

from mgx.runtime import backend_cuda as bc
from mgx.runtime.errors import EngineError

ALIGN = 256


def _pieces(sizes: list[int], seed: int = 0) -> tuple[list[tuple[int, np.ndarray]], int]:
    """Arrays of ``sizes`` bytes (some not uint8, some not contiguous) at 256-byte aligned offsets."""
    rng = np.random.default_rng(seed)
    pieces, off = [], 0
    for i, n in enumerate(sizes):
        raw = rng.integers(0, 256, n, dtype=np.uint8)
        if i % 3 == 1 and n % 4 == 0:
            a = raw.view(np.float32).reshape(-1, 1)  # another dtype and shape
        elif i % 3 == 2 and n % 2 == 0:
            a = np.stack([raw[: n // 2], raw[n // 2 :]], axis=1).T  # not contiguous: [2, n/2] view of a transpose
        else:
            a = raw
        pieces.append((off, a))
        off += -(-n // ALIGN) * ALIGN
    return pieces, off


def _expected(pieces: list[tuple[int, np.ndarray]], total: int) -> np.ndarray:
    out = np.zeros(total, np.uint8)
    for off, a in pieces:
        flat = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        out[off : off + flat.size] = flat
    return out


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize(("sizes", "stage"), [([1000, 4096, 10], 8192), ([50_000, 7, 300, 12_288, 1], 4096),
                                              ([8192, 8192], 8192), ([3 * 4096 + 5], 4096), ([], 4096),
                                              ([100, 9000, 200], 1 << 20)])  # fmt: skip
def test_staged_upload_puts_every_byte_at_its_offset(sizes: list[int], stage: int, threads: int,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Every piece lands at its offset through two staging buffers used in turn, each waited for
    before it is refilled and sent full of the right bytes (the stand-in for the device copy takes
    them at once, so a buffer refilled too early would show); no load is larger than a buffer,
    consecutive loads never overlap, and slices of the fill (_FILL_SLICE) cut pieces as threads take them."""
    monkeypatch.setattr(bc, "_FILL_SLICE", 1000)  # many slices a load, in several threads
    pieces, total = _pieces(sizes)
    loads = bc._stage_loads(pieces, stage)
    assert all(0 < load.fill <= stage for load in loads)
    assert all(a.start + a.fill <= b.start for a, b in zip(loads, loads[1:], strict=False))
    arena = np.zeros(total, np.uint8)
    views = [np.full(stage, 0xEE, np.uint8) for _ in range(2)]
    events: list[tuple[str, int]] = []

    def send(cur: int, load: bc._StageLoad) -> None:
        events.append(("send", cur))
        arena[load.start : load.start + load.fill] = views[cur][: load.fill]

    bc._stream_stages(loads, views, send, lambda cur: events.append(("wait", cur)), threads)
    assert events == [(kind, i % 2) for i in range(len(loads)) for kind in ("wait", "send")]
    want = _expected(pieces, total)
    covered = np.zeros(total, bool)
    for load in loads:
        covered[load.start : load.start + load.fill] = True
    for off, a in pieces:  # padding between pieces is not compared (the arena leaves it as it is)
        n = a.nbytes
        assert covered[off : off + n].all()
        assert np.array_equal(arena[off : off + n], want[off : off + n]), (off, n)


def test_upload_threads_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MGX_CUDA_UPLOAD_THREADS", "3")
    assert bc._upload_threads() == 3
    monkeypatch.delenv("MGX_CUDA_UPLOAD_THREADS")
    assert 1 <= bc._upload_threads() <= 8
    for bad, says in (("0", "at least 1"), ("four", "whole number")):  # the CLI's clean errors (EngineError)
        monkeypatch.setenv("MGX_CUDA_UPLOAD_THREADS", bad)
        with pytest.raises(EngineError, match=says):
            bc._upload_threads()
    monkeypatch.setenv("MGX_CUDA_STAGE_MB", "lots")
    with pytest.raises(EngineError, match="MGX_CUDA_STAGE_MB must be a whole number of MiB"):
        bc._env_count("MGX_CUDA_STAGE_MB", 64, "MiB")


def test_bench_load_times_the_staging_fill_per_thread_count(tmp_path) -> None:  # noqa: ANN001
    """examples/bench_load.py --staging: a rate for each thread count, from a real artifact's tensors."""

    from test_artifact import make_contents

    from mgx.formats.artifact import write_artifact

    bench = load_example("bench_load")
    path = tmp_path / "m.mgx"
    write_artifact(path, make_contents())
    rates = bench.time_staging(str(path), [1, 2], runs=1)
    assert list(rates) == [1, 2] and all(0 < r < float("inf") for r in rates.values())
