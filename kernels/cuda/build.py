"""Building the native CUDA kernels into one cubin for one GPU architecture, with nvcc.

The compiler calls ``build_cuda_kernels(arch)`` when the artifact is built for target ``cuda`` and
stores the bytes with ``arch`` beside them; the runtime hands both to ``load_cuda_kernels``. Only
the standard library is used here: the build host needs nvcc, not torch.

A build takes nvcc tens of seconds, and one compile asks for the same image several times (the
``cuda_kernels`` pass, then ``autotune`` to time the native GEMVs), as does every scheme a benchmark
builds. So images are kept, in the process and on disk (``MGX_CUDA_KERNEL_CACHE``: a directory, or
``off``; default ``$XDG_CACHE_HOME/mgx/cuda-kernels``, else ``~/.cache/mgx/cuda-kernels``), under a
key of everything that decides the bytes: nvcc's ``--version``, the command's flags and the name
and bytes of every source and header here. An entry that is not a cubin is rebuilt; a cache that
cannot be written is skipped.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

__all__ = ["CudaBuildError", "SOURCES", "arch_for", "build_cuda_kernels", "cache_dir", "compile_unit", "find_nvcc", "gencode"]

HERE = Path(__file__).resolve().parent
SOURCES = sorted(p.name for p in HERE.glob("*.cu"))  # every .cu here goes into the one cubin
_MEMO: dict[str, bytes] = {}  # cache key -> image, for this process
_VERSIONS: dict[str, str] = {}  # nvcc path -> its --version text


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


def arch_for(major: int, minor: int) -> str:
    """The architecture the native kernels are built for on a GPU of compute capability major.minor:
    sm_90a on sm_90 (machine code for exactly that chip, where the kernels are tuned), else sm_XY.
    The ``cuda_kernels`` pass's default, and what the benchmarks and GPU tests build."""
    return "sm_90a" if (major, minor) == (9, 0) else f"sm_{major}{minor}"


def gencode(arch: str) -> str:
    """nvcc's -gencode for ``arch`` ("sm_90a", "sm_80", ...): machine code for exactly that chip.

    The explicit form matters for the "a" targets: ``-arch=sm_90a`` also runs a plain sm_90 pass.
    """
    m = re.fullmatch(r"sm_(\d+)([af]?)", arch)
    if m is None:
        raise CudaBuildError(f"architecture {arch!r} is not of the form sm_<major><minor>[a|f], e.g. sm_90a")
    return f"-gencode=arch=compute_{m.group(1)}{m.group(2)},code={arch}"


def build_cuda_kernels(arch: str = "sm_90a", *, nvcc: str | None = None, extra_flags: tuple[str, ...] = ()) -> bytes:
    """Compile every kernel in ``kernels/cuda/*.cu`` into one cubin for ``arch``; returns its bytes
    (a kept image when nothing that decides them has changed: see the module docstring)."""
    nvcc = _nvcc(nvcc)
    flags = _flags(arch, extra_flags)
    key = _cache_key(nvcc, flags)
    image = _MEMO.get(key) or _read_kept(key)
    if image is None:
        image = _run_nvcc(nvcc, flags, "".join(f'#include "{HERE / name}"\n' for name in SOURCES))
        _keep(key, image)
    _MEMO[key] = image
    return image


def compile_unit(text: str, arch: str, *, nvcc: str | None = None, extra_flags: tuple[str, ...] = ()) -> bytes:
    """One CUDA translation unit's ``text`` compiled into a cubin for ``arch`` with the kernels'
    flags, not kept (a benchmark's own kernels)."""
    return _run_nvcc(_nvcc(nvcc), _flags(arch, extra_flags), text)


def _nvcc(nvcc: str | None) -> str:
    found = nvcc or find_nvcc()
    if found is None:
        raise CudaBuildError("nvcc not found (set NVCC or CUDA_HOME, or put it on PATH)")
    return found


def _flags(arch: str, extra_flags: tuple[str, ...]) -> list[str]:
    return [gencode(arch), "-O3", "-std=c++17", "-lineinfo", *extra_flags]


def _run_nvcc(nvcc: str, flags: list[str], text: str) -> bytes:
    with tempfile.TemporaryDirectory(prefix="mgx-cuda-") as tmp:
        unit = Path(tmp) / "mgx_kernels.cu"
        unit.write_text(text)
        cubin = Path(tmp) / "mgx_kernels.cubin"
        cmd = [nvcc, "-cubin", *flags, "-o", str(cubin), str(unit)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise CudaBuildError(f"nvcc failed ({' '.join(cmd)}):\n{proc.stderr.strip()}")
        return cubin.read_bytes()


def _nvcc_version(nvcc: str) -> str:
    if nvcc not in _VERSIONS:
        try:
            proc = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise CudaBuildError(f"nvcc at {nvcc} did not run: {e}") from None
        if proc.returncode != 0:
            raise CudaBuildError(f"{nvcc} --version failed: {proc.stderr.strip()}")
        _VERSIONS[nvcc] = proc.stdout
    return _VERSIONS[nvcc]


def _cache_key(nvcc: str, flags: list[str]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for part in (_nvcc_version(nvcc), *flags):
        h.update(part.encode() + b"\0")
    for path in sorted(p for p in HERE.iterdir() if p.suffix in (".cu", ".cuh", ".h")):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def cache_dir() -> Path | None:
    """Where built images are kept on disk (``MGX_CUDA_KERNEL_CACHE``), or None when that is off."""
    env = os.environ.get("MGX_CUDA_KERNEL_CACHE")
    if env is not None and env.strip().lower() in ("", "0", "off", "none"):
        return None
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mgx" / "cuda-kernels"


def _read_kept(key: str) -> bytes | None:
    where = cache_dir()
    if where is None:
        return None
    try:
        image = (where / f"{key}.cubin").read_bytes()
    except OSError:
        return None
    return image if image.startswith(b"\x7fELF") else None  # a torn or foreign file: build again


def _keep(key: str, image: bytes) -> None:
    where = cache_dir()
    if where is None:
        return
    tmp = None
    try:
        where.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=where, prefix=f".{key}.", delete=False) as f:
            tmp = f.name
            f.write(image)
        os.replace(tmp, where / f"{key}.cubin")  # whole or not at all, also with builds racing
    except OSError:  # a read-only or full disk: the image is still used, just not kept
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
