"""cuda_kernels: build the native CUDA kernels (``kernels/cuda/*.cu``, the RMSNorm) with nvcc for the artifact.

For target ``cuda`` only. For each architecture in ``archs`` (default: the build GPU's, ``sm_90a`` on
an sm_90 GPU such as the H100/H200, ``sm_XY`` on others), nvcc compiles every kernel source into one
cubin (with ``kernel_flags``: the imma GEMVs read the cuda_tile16 layout where the weights are in it).
The graph is not changed; the images travel in the pass result's ``stats["cuda_kernels"]``
({arch: bytes}), which the compiler stores in the artifact (``Model.cuda_kernels``). The CUDA backend
loads the image whose code runs on its GPU; with none it runs the Triton kernels and says so once.
The build host needs nvcc (``$NVCC``, ``$CUDA_HOME/bin`` or PATH); a GPU only when ``archs`` is not given.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from dataclasses import dataclass
from typing import Any

from mgx.formats import ir

from ._base import PassContext, PassError, PassResult
from ._common import fmt_bytes, options_dict, parse_options
from ._schemes import are_f16

__all__ = ["CudaKernelsOptions", "kernel_flags", "run"]

_ARCH = re.compile(r"sm_\d+[af]?")  # what nvcc's -gencode accepts for real code (build.gencode)


@dataclass(frozen=True, slots=True)
class CudaKernelsOptions:
    """model.yaml options of cuda_kernels."""

    archs: tuple[str, ...] = ()  # as nvcc names them ("sm_90a", "sm_80"); empty: the build GPU's

    def __post_init__(self) -> None:
        for arch in self.archs:
            if _ARCH.fullmatch(arch) is None:
                raise PassError(
                    f"cuda_kernels: archs: {arch!r} is not of the form sm_<number>[a|f], e.g. sm_90a"
                )
        if len(set(self.archs)) != len(self.archs):
            raise PassError(f"cuda_kernels: archs lists an architecture twice: {list(self.archs)}")


def _device_arch() -> str | None:
    """The build GPU's architecture ("sm_90a" on sm_90, else "sm_XY"), or None without one."""
    import torch

    if not torch.cuda.is_available():
        return None
    from mgx.kernels.cuda.build import arch_for

    return arch_for(*torch.cuda.get_device_capability())


def kernel_flags(graph: ir.Graph) -> tuple[str, ...]:
    """The nvcc flags the artifact's weights ask for: ``-DMGX_IMMA_TILE16=1`` where reorder_weights put
    int4 or W8A16 weights in the cuda_tile16 layout (the imma GEMVs then read that layout only), and
    with it ``-DMGX_IMMA_HALF_SCALES=1`` where every int4 linear weight can give its scales and zeros
    as fp16 pairs (``_half_scales``; the int4 imma GEMVs then read those only)."""
    if not any(t.layout == "cuda_tile16" for t in graph.tensors.values()):
        return ()
    return ("-DMGX_IMMA_TILE16=1", "-DMGX_IMMA_HALF_SCALES=1") if _half_scales(graph) else ("-DMGX_IMMA_TILE16=1",)


def _half_scales(graph: ir.Graph) -> bool:
    """Whether the graph has int4 linear weights (or LM head) and each has groups of a multiple of 128
    columns and scales that are fp16 values (quantize_int4's ``f16_scales``), which is what the CUDA
    backend's ``gemv.scale_pairs`` takes."""
    found = False
    for op in _int4_linears(graph):
        t = graph.tensor(op.weights["weight"])
        scales = graph.tensor(op.weights["scales"]).data if "scales" in op.weights else None
        k = int(t.scheme_params.get("cols", 2 * t.shape[1]))
        if scales is None or int(t.scheme_params.get("group_size", 0)) % 128 or k % 128:
            return False
        if not are_f16(scales):
            return False
        found = True
    return found


def _int4_linears(graph: ir.Graph) -> list[ir.Op]:
    """The linear ops and LM head whose weight is int4."""
    return [op for op in graph.ops if op.kind in ("linear", "lm_head") and "weight" in op.weights
            and graph.tensor(op.weights["weight"]).scheme == "int4"]  # fmt: skip


def _build(arch: str, flags: tuple[str, ...] = ()) -> bytes:
    """nvcc's cubin of every kernel source for ``arch`` with ``flags`` (tests replace this)."""
    from mgx.kernels.cuda.build import build_cuda_kernels

    return build_cuda_kernels(arch, extra_flags=flags)


def _sources_digest() -> str:
    """Which sources the images come from: file names and a short digest of their bytes (the pass log)."""
    from mgx.kernels.cuda.build import HERE, SOURCES

    h = hashlib.blake2b(digest_size=8)
    for name in SOURCES:
        h.update(name.encode() + b"\0" + (HERE / name).read_bytes())
    return f"{', '.join(SOURCES)} (blake2b-64 {h.hexdigest()})"


def run(graph: ir.Graph, options: dict[str, Any], context: PassContext) -> PassResult:
    """Build the native kernels for each architecture; see the module docstring."""
    opts = parse_options(CudaKernelsOptions, options, "cuda_kernels")
    if context.target != "cuda":
        raise PassError(
            f"cuda_kernels builds native CUDA code; the build target is {context.target!r} (set target: cuda)"
        )
    archs = opts.archs
    if not archs:
        device = _device_arch()
        if device is None:
            raise PassError("cuda_kernels: torch sees no CUDA device to take the architecture from; "
                            "name the deployment GPUs' architectures (archs: [sm_90a]), or drop the pass")  # fmt: skip
        archs = (device,)
    from mgx.kernels.cuda.build import CudaBuildError

    images: dict[str, bytes] = {}
    flags = kernel_flags(graph)
    for arch in archs:
        try:
            images[arch] = _build(arch, flags)
        except CudaBuildError as e:
            raise PassError(
                f"cuda_kernels: {arch}: {e}; or drop the pass (the runtime then runs the Triton kernels)"
            ) from None
        if not images[arch]:
            raise PassError(f"cuda_kernels: {arch}: nvcc produced an empty image")
    built = ", ".join(f"{arch} {fmt_bytes(len(code))}" for arch, code in images.items())
    note = ""
    if flags and "-DMGX_IMMA_HALF_SCALES=1" not in flags and _int4_linears(graph):
        note = ("; int4 scales read as fp32 by the imma GEMVs (four loads a step instead of one): not every int4 "
                "weight has fp16-valued scales (quantize_int4's f16_scales) and groups of a multiple of 128 columns")  # fmt: skip
    return PassResult(
        f"built {_sources_digest()}{' with ' + ' '.join(flags) if flags else ''} for {built}{note}",
        {"cuda_kernels": images},
        options_dict(dataclasses.replace(opts, archs=tuple(archs))),
    )
