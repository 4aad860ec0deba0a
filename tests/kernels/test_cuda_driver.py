"""The driver binding's structures and the overlapped-launch switch, on the CPU (launches themselves:
tests/gpu and the GPU tests of tests/e2e/test_cuda_kernels.py)."""

from __future__ import annotations

import ctypes

import pytest

pytest.importorskip("torch")

from mgx.kernels.cuda import rmsnorm as crms  # noqa: E402
from mgx.kernels.cuda.driver import CudaDriverError, LaunchAttribute, LaunchConfig  # noqa: E402


def test_launch_structures_have_cuda_h_layout() -> None:
    """CUlaunchAttribute and CUlaunchConfig as cuda.h (CUDA 12 and 13) lays them out on x86-64:
    cuLaunchKernelEx reads these bytes."""
    assert ctypes.sizeof(LaunchAttribute) == 72 and LaunchAttribute.value.offset == 8
    assert ctypes.sizeof(LaunchConfig) == 56
    assert (LaunchConfig.shared_mem_bytes.offset, LaunchConfig.stream.offset) == (24, 32)
    assert (LaunchConfig.attrs.offset, LaunchConfig.num_attrs.offset) == (40, 48)


def test_launch_attribute_values_keep_their_zero_bytes() -> None:
    """A value of several fields (a cluster's dimensions 8, 1, 1: 08 00 00 00 01 ...) reaches the
    attribute whole (a plain assignment to the c_char array stopped at the first zero byte: the
    forty-first session's cluster launches read 8 x 0 x 0 and were refused), zeros after it."""
    import struct

    attr = LaunchAttribute.of(4, struct.pack("<III", 8, 1, 1))
    raw = ctypes.string_at(ctypes.addressof(attr), ctypes.sizeof(attr))
    assert raw[:4] == struct.pack("<i", 4)
    assert raw[8:20] == struct.pack("<III", 8, 1, 1) and raw[20:] == bytes(52)
    with pytest.raises(ValueError, match="64 bytes"):
        LaunchAttribute.of(4, bytes(65))


class FakeModule:
    def __init__(self, entries: set[str], supports_overlap: bool) -> None:
        self.entries, self.supports_overlap = entries, supports_overlap

    def function(self, name: str) -> object:
        if name not in self.entries:
            raise CudaDriverError(f"cuModuleGetFunction({name})", 500, "CUDA_ERROR_NOT_FOUND")
        return object()


@pytest.mark.parametrize(
    ("sm", "marker", "driver", "want"),
    [(90, True, True, True), (100, True, True, True), (89, True, True, False), (90, False, True, False), (90, True, False, False)],
)
def test_overlap_only_for_code_that_waits_on_a_driver_and_gpu_that_can(sm: int, marker: bool, driver: bool, want: bool) -> None:
    entries = {crms.OVERLAP_MARKER} if marker else set()
    kernels = crms.CudaKernels(FakeModule(entries, driver), "sm_90a", 0)
    assert not kernels.overlap  # never by default
    assert kernels.allow_overlap(sm) is want and kernels.overlap is want
