"""Progress reporting for compile steps: a live line for steps that run longer than a second."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO


class Progress:
    """Prints step timings to ``stream``; a ticking line on a terminal once a step passes 1 s."""

    def __init__(self, stream: TextIO | None = None, enabled: bool = True):
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.live = enabled and self.stream.isatty()
        self.timings: dict[str, float] = {}

    def _write(self, text: str) -> None:
        if self.enabled:
            self.stream.write(text)
            self.stream.flush()

    @contextmanager
    def step(self, label: str) -> Iterator[None]:
        """Time a step; shows a spinner with elapsed seconds after the first second."""
        start = time.perf_counter()
        done = threading.Event()

        def tick() -> None:
            frames = "|/-\\"
            i = 0
            if done.wait(1.0):
                return
            if not self.live:
                self._write(f"  {label} ...\n")
                return
            while not done.wait(0.25):
                self._write(f"\r  {frames[i % 4]} {label} {time.perf_counter() - start:5.1f}s")
                i += 1

        thread = threading.Thread(target=tick, daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()
            elapsed = time.perf_counter() - start
            self.timings[label] = elapsed
            prefix = "\r" if self.live else ""
            self._write(f"{prefix}  {label}: {elapsed:.1f}s{' ' * 10}\n")

    def bar(self, label: str):
        """A callback ``(done, total)`` drawing a byte progress bar for one step."""
        last = [0.0]

        def update(done: int, total: int) -> None:
            now = time.perf_counter()
            if not self.live or (now - last[0] < 0.1 and done < total):
                return
            last[0] = now
            frac = done / total if total else 1.0
            filled = int(frac * 30)
            self._write(f"\r  {label} [{'#' * filled}{'.' * (30 - filled)}] {frac * 100:5.1f}% "
                        f"{done / 1e6:8.1f}/{total / 1e6:.1f} MB")

        return update
