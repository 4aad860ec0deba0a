"""Shared fixtures: tiny random HF models of every family, compiled once per session."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

# One BLAS thread: the reference backend's small matmuls run 10-100x slower when OpenBLAS threads
# spin against the test process on a 2-core machine (measured: 0.11 ms vs 11.9 ms for 1x576 @ 576x1536).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
# Built native kernels are kept in the temp directory, not the user's cache (shared by the workers
# of one run and by later runs: the cache's keys are what decides the bytes).
os.environ.setdefault("MGX_CUDA_KERNEL_CACHE", os.path.join(tempfile.gettempdir(), "mgx-test-cuda-kernels"))
# `python -m pytest` (the README's test command) puts the working directory, the repository root,
# first on sys.path. There this project's folders (kernels/, runtime/, ...) would stand for top-level
# packages of their names, which they are not (the package is `mgx`, installed): transformers 5
# imports the Hugging Face `kernels` package, and the root's kernels/ shadowed it. The tests' own
# `python -c` subprocesses (run from the root) get PYTHONSAFEPATH, which keeps it off theirs (3.11+).
sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != Path(__file__).resolve().parents[1]]
os.environ.setdefault("PYTHONSAFEPATH", "1")
sys.path.insert(0, str(Path(__file__).parent))

# Under pytest-xdist each worker is a process whose torch (OpenMP) pool takes a thread a core, so N
# workers run N threads a core and their busy-waiting pools slow each other: here, two workers each
# building SmolLM2's artifact took 113 s at the default against 68 s at one thread each; on the H200's
# 16 cores, three of them had not finished after 500 s (168th run) where one alone took 28 s. Each
# worker gets its share of the cores unless OMP_NUM_THREADS says otherwise.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
_SHARE = max(1, (os.cpu_count() or 1) // _WORKERS) if _WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ else 0
if _SHARE:
    os.environ["OMP_NUM_THREADS"] = str(_SHARE)

# Without a GPU, Triton kernels run in Triton's interpreter; this must be set before anything
# imports triton (its driver is chosen once, at import).
try:
    import torch as _torch

    if _SHARE:
        _torch.set_num_threads(_SHARE)  # in case a plugin imported torch before this file
    _HAS_CUDA = _torch.cuda.is_available()
except ImportError:
    _HAS_CUDA = False
if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parents[1]


def pytest_collection_modifyitems(config, items):  # noqa: ANN001
    if not _HAS_CUDA:
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
    elif os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        # Triton launches compiled kernels here, which cannot read CPU tensors; the gpu-marked
        # tests run the same code paths on the device.
        skip = pytest.mark.skip(reason="runs CPU tensors under TRITON_INTERPRET=1; this host has a GPU")
        for item in items:
            if "interpreted" in item.keywords:
                item.add_marker(skip)
