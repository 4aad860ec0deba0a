"""Launching the native CUDA RMSNorm (``rmsnorm.cu``), with the Triton kernel as its fallback.

``load_cuda_kernels(cubin, arch)`` loads the artifact's stored cubin for this GPU, or returns None
after warning once when the code cannot run here (no code stored, built for another architecture,
refused by the driver). ``rms_norm(..., kernels=...)`` runs the CUDA kernel when it is loaded and the
tensors suit it (16-byte aligned rows, a width that is a multiple of 16 bytes), else the Triton one.
"""

from __future__ import annotations

import ctypes
import re
import warnings
from typing import TYPE_CHECKING

import torch

from .driver import CudaDriverError, CudaModule, cubin_sm, device_sm

if TYPE_CHECKING:
    from mgx.kernels.triton.rmsnorm import RMSNormConfig

__all__ = ["KERNEL_ABI", "OVERLAP_MARKER", "CudaKernels", "arch_runs_on", "load_cuda_kernels", "rms_norm", "reset_fallback_warning"]

MAX_VEC = 4  # kMaxVec in rmsnorm.cu
MAX_THREADS = 512  # kMaxThreads in rmsnorm.cu
KERNEL_ABI = 1  # MGX_KERNEL_ABI in rmsnorm.cu: the suffix of every entry point's name
OVERLAP_MARKER = f"mgx_overlap_aware_v{KERNEL_ABI}"  # in images whose kernels may be launched overlapped
_ENTRY = {
    dtype: f"mgx_rms_norm_{name}_v{KERNEL_ABI}"
    for dtype, name in ((torch.float32, "f32"), (torch.float16, "f16"), (torch.bfloat16, "bf16"))
}

_warned = False


class CudaKernels:
    """The native kernels of one artifact, loaded on one device."""

    def __init__(self, module: CudaModule, arch: str, device: int) -> None:
        self.module = module
        self.arch = arch
        self.device = device
        self._has: dict[str, bool] = {}
        # Launch overlapped with the kernel before (programmatic dependent launches, mgx_abi.cuh);
        # set through ``allow_overlap``.
        self.overlap = False

    def allow_overlap(self, sm: int) -> bool:
        """Launch the kernels overlapped from now on where they can be: sm_90 or newer, a driver with
        cuLaunchKernelEx, and code whose kernels wait for their predecessor (OVERLAP_MARKER).
        Returns whether they will be."""
        self.overlap = sm >= 90 and self.module.supports_overlap and self.has(OVERLAP_MARKER)
        return self.overlap

    def has(self, entry: str) -> bool:
        """Whether the module holds ``entry`` (kernels added after the RMSNorm are optional: an
        artifact built before them runs their Triton counterparts)."""
        found = self._has.get(entry)
        if found is None:
            try:
                self.module.function(entry)
                found = True
            except CudaDriverError:
                found = False
            self._has[entry] = found
        return found


def reset_fallback_warning() -> None:
    """Let the next fallback warn again (for tests)."""
    global _warned
    _warned = False


def _fallback(reason: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(f"MGX: {reason}; using the Triton RMSNorm instead", RuntimeWarning, stacklevel=3)


def arch_runs_on(arch: str, sm: int) -> bool:
    """Whether machine code for ``arch`` ("sm_90a", "sm_80") runs on a GPU of compute capability ``sm``.

    Code for sm_XY runs on sm_XZ with Z >= Y (same major); the "a"/"f" targets only on their own chip.
    """
    m = re.fullmatch(r"sm_(\d+)(\d)([af]?)", arch)
    if m is None:
        return False
    major, minor, suffix = int(m.group(1)), int(m.group(2)), m.group(3)
    if suffix:
        return sm == major * 10 + minor
    return sm // 10 == major and sm % 10 >= minor


def load_cuda_kernels(cubin: bytes | None, arch: str | None, device: int | None = None) -> CudaKernels | None:
    """The stored kernels loaded for ``device`` (default: the current one), or None with a warning (once)."""
    device = torch.cuda.current_device() if device is None else device
    if not cubin:
        _fallback("the artifact holds no native CUDA kernels")
        return None
    sm = device_sm(device)
    built = cubin_sm(cubin)
    name = f"sm_{sm}"
    if arch is not None and not arch_runs_on(arch, sm):
        _fallback(f"the stored CUDA kernels are built for {arch}, this GPU is {name}")
        return None
    if built is not None and built // 10 != sm // 10:
        _fallback(f"the stored CUDA kernels hold code for sm_{built}, this GPU is {name}")
        return None
    torch.cuda.init()
    with torch.cuda.device(device):
        torch.empty(1, device=f"cuda:{device}")  # makes torch's (primary) context current on this thread
        try:
            module = CudaModule(cubin, device)
        except CudaDriverError as e:
            _fallback(f"the driver refused the stored CUDA kernels on {name} ({e})")
            return None
        for entry in _ENTRY.values():
            try:
                module.function(entry)
            except CudaDriverError:
                _fallback(f"the stored CUDA kernels have no {entry} (built for another kernel ABI than "
                          f"v{KERNEL_ABI}; compile the artifact again with this version of MGX)")  # fmt: skip
                return None
    return CudaKernels(module, arch or f"sm_{built}", device)


def _launch_shape(cols: int, elem: int, vecs_per_thread: int) -> tuple[int, int] | None:
    """(threads per row, rows per block), or None when a row is too wide for the kernel."""
    v = 16 // elem
    nvec = cols // v
    tpr = 32
    while tpr < MAX_THREADS and tpr * vecs_per_thread < nvec:
        tpr *= 2
    if nvec > tpr * MAX_VEC:
        return None
    return tpr, (4 if tpr == 32 else 1)


def _aligned(*ts: torch.Tensor | None) -> bool:
    return all(t is None or (t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0) for t in ts)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    *,
    kernels: CudaKernels | None,
    group: int | None = None,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    vecs_per_thread: int = 4,
    config: RMSNormConfig | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm as ``mgx.kernels.triton.rmsnorm.rms_norm``, on the native kernel when it can run; else
    on the Triton kernel, launched with ``config`` (default: its ``default_config``)."""
    from mgx.kernels.triton.rmsnorm import rms_norm as triton_rms_norm

    t, f = x.shape
    group = f if group is None else int(group)
    shape = _launch_shape(group, x.element_size(), vecs_per_thread) if x.dtype in _ENTRY else None
    usable = (
        kernels is not None
        and shape is not None
        and x.is_cuda
        and x.device.index == kernels.device
        and group % (16 // x.element_size()) == 0
        and x.stride(1) == 1
        and (group == f or all(u is None or u.is_contiguous() for u in (x, residual, out)))
        and (weight is None or (weight.is_contiguous() and weight.dtype == x.dtype))
        and (residual is None or (residual.shape == x.shape and residual.stride(1) == 1 and residual.dtype == x.dtype))
    )
    if usable:
        out = torch.empty_like(x, memory_format=torch.contiguous_format) if out is None else out
        res_out = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else None
        usable = _aligned(x, residual, out, res_out) and (weight is None or weight.data_ptr() % 16 == 0)
    if not usable:
        return triton_rms_norm(x, weight, eps, group=group, residual=residual, out=out, config=config)
    rows = t * (f // group)
    if rows == 0:
        return out if residual is None else (out, res_out)
    # Grouped rows are contiguous slices of ``group`` elements, so the row stride is ``group``.
    sx = x.stride(0) if group == f else group
    sr = (residual.stride(0) if group == f else group) if residual is not None else 0
    so = out.stride(0) if group == f else group
    sro = (res_out.stride(0) if group == f else group) if res_out is not None else 0
    tpr, rpb = shape

    def ptr(tensor: torch.Tensor | None) -> ctypes.c_void_p:
        return ctypes.c_void_p(tensor.data_ptr() if tensor is not None else None)

    args = [
        ptr(out), ptr(res_out), ptr(x), ptr(residual), ptr(weight),
        ctypes.c_int(rows), ctypes.c_int(group), ctypes.c_longlong(sx), ctypes.c_longlong(sr),
        ctypes.c_longlong(so), ctypes.c_longlong(sro), ctypes.c_float(eps),
    ]  # fmt: skip
    stream = torch.cuda.current_stream(x.device).cuda_stream
    kernels.module.launch(_ENTRY[x.dtype], ((rows + rpb - 1) // rpb,), (tpr, rpb), args, stream, overlap=kernels.overlap)
    return out if residual is None else (out, res_out)
