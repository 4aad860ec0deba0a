"""Building the native CUDA kernels into one cubin for one GPU architecture, with nvcc.

The compiler calls ``build_cuda_kernels(arch)`` when the artifact is built for target ``cuda`` and
stores the bytes with ``arch`` beside them; the runtime hands both to ``load_cuda_kernels``. Only
the standard library is used here: the build host needs nvcc, not torch.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

__all__ = ["CudaBuildError", "SOURCES", "build_cuda_kernels", "find_nvcc", "gencode"]

HERE = Path(__file__).resolve().parent
SOURCES = sorted(p.name for p in HERE.glob("*.cu"))  # every .cu here goes into the one cubin


class CudaBuildError(RuntimeError):
    """nvcc is missing, or it rejected the sources or the architecture."""


def find_nvcc() -> str | None:
    """The nvcc to use: $NVCC, then PATH, then $CUDA_HOME/bin and /usr/local/cuda/bin."""
    candidates = [os.environ.get("NVCC"), shutil.which("nvcc")]
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root:
            candidates.append(str(Path(root) / "bin" / "nvcc"))
    for c in candidates:
        if c and Path(c).is_file() and os.access(c, os.X_OK):
            return c
    return None


def gencode(arch: str) -> str:
    """nvcc's -gencode for ``arch`` ("sm_90a", "sm_80", ...): machine code for exactly that chip.

    The explicit form matters for the "a" targets: ``-arch=sm_90a`` also runs a plain sm_90 pass.
    """
    m = re.fullmatch(r"sm_(\d+)([af]?)", arch)
    if m is None:
        raise CudaBuildError(f"architecture {arch!r} is not of the form sm_<major><minor>[a|f], e.g. sm_90a")
    return f"-gencode=arch=compute_{m.group(1)}{m.group(2)},code={arch}"


def build_cuda_kernels(arch: str = "sm_90a", *, nvcc: str | None = None, extra_flags: tuple[str, ...] = ()) -> bytes:
    """Compile every kernel in ``kernels/cuda/*.cu`` into one cubin for ``arch``; returns its bytes."""
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise CudaBuildError("nvcc not found (set NVCC or CUDA_HOME, or put it on PATH)")
    with tempfile.TemporaryDirectory(prefix="mgx-cuda-") as tmp:
        unit = Path(tmp) / "mgx_kernels.cu"
        unit.write_text("".join(f'#include "{HERE / name}"\n' for name in SOURCES))
        cubin = Path(tmp) / "mgx_kernels.cubin"
        cmd = [nvcc, "-cubin", gencode(arch), "-O3", "-std=c++17", "-lineinfo", *extra_flags, "-o", str(cubin), str(unit)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise CudaBuildError(f"nvcc failed ({' '.join(cmd)}):\n{proc.stderr.strip()}")
        return cubin.read_bytes()
