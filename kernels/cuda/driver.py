"""A minimal binding of the CUDA driver API through ctypes: load a cubin, look up kernels, launch them.

It needs libcuda (the driver, present wherever a GPU is) and nothing else: no CUDA toolkit, no
cuda-python. Modules load into the primary context of the device, the one PyTorch uses, so
launches on PyTorch's streams (and inside its CUDA graph captures) work.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Sequence

__all__ = ["CudaDriverError", "CudaModule", "LaunchAttribute", "LaunchConfig", "cubin_sm", "device_sm"]

CUDA_SUCCESS = 0
_ATTR_CC_MAJOR = 75  # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
_ATTR_CC_MINOR = 76
_LAUNCH_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


class LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute (cuda.h): an id, then a 64-byte value union at offset 8 (72 bytes)."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]

    @classmethod
    def of(cls, attr_id: int, value: bytes) -> LaunchAttribute:
        """The attribute ``attr_id`` with ``value``'s bytes at the start of its value, zeros after them.
        Copied as bytes: assigning to the c_char array stops at the first zero byte, which a value of
        several fields (a cluster's 8, 1, 1) has inside it."""
        if len(value) > ctypes.sizeof(cls) - cls.value.offset:
            raise ValueError(f"a launch attribute's value holds 64 bytes, not {len(value)}")
        attr = cls(id=attr_id)
        ctypes.memmove(ctypes.addressof(attr) + cls.value.offset, value, len(value))
        return attr


class LaunchConfig(ctypes.Structure):
    """CUlaunchConfig (cuda.h): grid, block, dynamic shared memory, stream, attributes (56 bytes)."""

    _fields_ = [
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("shared_mem_bytes", ctypes.c_uint),
        ("stream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(LaunchAttribute)),
        ("num_attrs", ctypes.c_uint),
    ]


class CudaDriverError(RuntimeError):
    """A driver call failed; ``code`` is the CUresult."""

    def __init__(self, call: str, code: int, name: str) -> None:
        super().__init__(f"{call} failed: {name} ({code})")
        self.code = code


_lib: ctypes.CDLL | None = None


def _driver() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        lib = ctypes.CDLL("libcuda.so.1")
        vp, u, i = ctypes.c_void_p, ctypes.c_uint, ctypes.c_int
        lib.cuInit.argtypes = [u]
        lib.cuGetErrorName.argtypes = [i, ctypes.POINTER(ctypes.c_char_p)]
        lib.cuDeviceGet.argtypes = [ctypes.POINTER(i), i]
        lib.cuDeviceGetAttribute.argtypes = [ctypes.POINTER(i), i, i]
        lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(vp)]
        lib.cuCtxSetCurrent.argtypes = [vp]
        lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(vp), i]
        lib.cuModuleLoadData.argtypes = [ctypes.POINTER(vp), ctypes.c_char_p]
        lib.cuModuleUnload.argtypes = [vp]
        lib.cuModuleGetFunction.argtypes = [ctypes.POINTER(vp), vp, ctypes.c_char_p]
        lib.cuLaunchKernel.argtypes = [vp, u, u, u, u, u, u, u, vp, ctypes.POINTER(vp), ctypes.POINTER(vp)]
        if hasattr(lib, "cuLaunchKernelEx"):  # CUDA 12.0 and newer drivers
            lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(LaunchConfig), vp, ctypes.POINTER(vp), ctypes.POINTER(vp)]
        _check(lib, "cuInit", lib.cuInit(0))
        _lib = lib
    return _lib


def _check(lib: ctypes.CDLL, call: str, code: int) -> None:
    if code != CUDA_SUCCESS:
        name = ctypes.c_char_p()
        lib.cuGetErrorName(code, ctypes.byref(name))
        raise CudaDriverError(call, code, (name.value or b"?").decode())


def device_sm(device: int) -> int:
    """Compute capability of ``device`` as one number (9.0 -> 90)."""
    lib = _driver()
    dev, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    _check(lib, "cuDeviceGet", lib.cuDeviceGet(ctypes.byref(dev), device))
    _check(lib, "cuDeviceGetAttribute", lib.cuDeviceGetAttribute(ctypes.byref(major), _ATTR_CC_MAJOR, dev))
    _check(lib, "cuDeviceGetAttribute", lib.cuDeviceGetAttribute(ctypes.byref(minor), _ATTR_CC_MINOR, dev))
    return major.value * 10 + minor.value


def cubin_sm(image: bytes) -> int | None:
    """The SM number a cubin's machine code is for (90 for sm_90 and sm_90a), or None if not a cubin.

    CUDA ELF files carry it in e_flags: bits 8-15 from ELF ABI version 8 on (nvcc 13), bits 0-7
    before. The driver's own check at load time stays the final word.
    """
    if len(image) < 0x34 or image[:4] != b"\x7fELF" or image[4] != 2 or image[7] != 0x41:
        return None
    e_flags = struct.unpack_from("<I", image, 0x30)[0]
    return (e_flags >> 8) & 0xFF if image[8] >= 8 else e_flags & 0xFF


class CudaModule:
    """A cubin loaded into ``device``'s primary context."""

    def __init__(self, image: bytes, device: int = 0) -> None:
        lib = _driver()
        ctx = ctypes.c_void_p()
        _check(lib, "cuCtxGetCurrent", lib.cuCtxGetCurrent(ctypes.byref(ctx)))
        if not ctx.value:
            dev = ctypes.c_int()
            _check(lib, "cuDeviceGet", lib.cuDeviceGet(ctypes.byref(dev), device))
            _check(lib, "cuDevicePrimaryCtxRetain", lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev))
            _check(lib, "cuCtxSetCurrent", lib.cuCtxSetCurrent(ctx))
        self._lib = lib
        self._module = ctypes.c_void_p()
        _check(lib, "cuModuleLoadData", lib.cuModuleLoadData(ctypes.byref(self._module), image))
        self._functions: dict[str, ctypes.c_void_p] = {}
        self._resident: dict[tuple[str, int, int], int] = {}

    def function(self, name: str) -> ctypes.c_void_p:
        """The kernel ``name`` (an ``extern "C"`` symbol of the module)."""
        fn = self._functions.get(name)
        if fn is None:
            fn = ctypes.c_void_p()
            rc = self._lib.cuModuleGetFunction(ctypes.byref(fn), self._module, name.encode())
            _check(self._lib, f"cuModuleGetFunction({name})", rc)
            self._functions[name] = fn
        return fn

    def launch(
        self,
        name: str,
        grid: Sequence[int],
        block: Sequence[int],
        args: Sequence[ctypes._SimpleCData],
        stream: int = 0,
        shared_bytes: int = 0,
        overlap: bool = False,
    ) -> None:
        """Launch kernel ``name`` on ``stream`` (a CUstream handle, e.g. torch's ``cuda_stream``).

        ``overlap``: a programmatic dependent launch (sm_90 and newer; ``supports_overlap``): the kernel
        may start while the one before it on the stream finishes, so it must wait for it
        (griddepcontrol.wait) before it reads anything that kernel wrote, or writes anything at all."""
        gx, gy, gz = (tuple(grid) + (1, 1))[:3]
        bx, by, bz = (tuple(block) + (1, 1))[:3]
        params = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.pointer(a), ctypes.c_void_p) for a in args])
        if overlap:
            attr = LaunchAttribute.of(_LAUNCH_PROGRAMMATIC_STREAM_SERIALIZATION, struct.pack("<I", 1))  # allowed
            config = LaunchConfig((gx, gy, gz), (bx, by, bz), shared_bytes, ctypes.c_void_p(stream),
                                  ctypes.pointer(attr), 1)  # fmt: skip
            rc = self._lib.cuLaunchKernelEx(ctypes.byref(config), self.function(name), params, None)
            _check(self._lib, f"cuLaunchKernelEx({name})", rc)
            return
        rc = self._lib.cuLaunchKernel(
            self.function(name), gx, gy, gz, bx, by, bz, shared_bytes, ctypes.c_void_p(stream), params, None
        )
        _check(self._lib, f"cuLaunchKernel({name})", rc)

    def max_blocks_per_sm(self, name: str, threads: int, shared_bytes: int = 0) -> int:
        """How many blocks of kernel ``name`` (``threads`` each, ``shared_bytes`` of dynamic shared
        memory) one SM holds at once, by the driver's occupancy calculator (registers, shared memory,
        threads); cached."""
        key = (name, threads, shared_bytes)
        found = self._resident.get(key)
        if found is None:
            blocks = ctypes.c_int()
            rc = self._lib.cuOccupancyMaxActiveBlocksPerMultiprocessor(
                ctypes.byref(blocks), self.function(name), ctypes.c_int(threads), ctypes.c_size_t(shared_bytes)
            )
            _check(self._lib, f"cuOccupancyMaxActiveBlocksPerMultiprocessor({name})", rc)
            found = self._resident[key] = blocks.value
        return found

    @property
    def supports_overlap(self) -> bool:
        """Whether this driver has cuLaunchKernelEx (programmatic dependent launches)."""
        return hasattr(self._lib, "cuLaunchKernelEx")
