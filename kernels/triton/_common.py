"""Helpers shared by the launch wrappers: argument checks and launch-size heuristics."""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator
from typing import Any

import torch
import triton
import triton.language as tl

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# torch dtype -> the triton dtype kernels cast to when they store
TL_DTYPE = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


# Read once, at import, as Triton itself decides at import whether its kernels are interpreted (an
# environment lookup per launch cost 2 us on the VM).
_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
# For kernels: compiled for the GPU (not interpreted). Compiled kernels round fp32 to bf16 with the
# GPU's conversion (``round_as``) and may use inline PTX; the interpreter takes the plain Triton code.
COMPILED = tl.constexpr(not _INTERPRETING)


# Kernels that a serving step launches with counts that change from step to step (sequences, rows,
# block-table widths, splits) take them unspecialized on alignment
# (``triton.jit(do_not_specialize_on_alignment=...)``): Triton otherwise compiles a variant for a
# count that is a multiple of 16 and another for any other (besides a count of 1, which keeps its
# own: the batch-1 paths fold it), again for each combination, mid-load. On the H200 (26th session,
# 1B shape, 480 requests at 8/s with steps of several sequences launched op by op) that was 81
# compiles taking 67 s of host time, 49 of them the K/V-write kernel's; steps waited up to 3.1 s.
# With these counts not specialized at all (``do_not_specialize``, the sixtieth run), the same load
# compiled 14 variants, all in its first pass. Block-table strides and widths are not specialized at
# all (a table of one column is no faster, but was a variant of its own). The packed step metadata
# starts each part 16 bytes in for the same reason: pointer alignment is specialized too.

_OVERLAP = contextvars.ContextVar("mgx_triton_overlap", default=False)


@contextlib.contextmanager
def overlapped_launches(on: bool) -> Iterator[None]:
    """Inside it, the kernels that take ``overlap_options()`` (the linear, decode attention and LM
    head kernels) are launched overlapped: programmatic dependent launches (sm_90 and newer), each
    letting the next kernel start and waiting for the one before it first (``overlap_start``).
    Never in the interpreter."""
    token = _OVERLAP.set(bool(on) and not _INTERPRETING)
    try:
        yield
    finally:
        _OVERLAP.reset(token)


def overlap_options() -> dict[str, Any]:
    """A launch's OVERLAP constexpr and, when on, Triton's ``launch_pdl`` option."""
    return {"OVERLAP": True, "launch_pdl": True} if _OVERLAP.get() else {"OVERLAP": False}


@triton.jit
def overlap_start(OVERLAP: tl.constexpr):
    """A kernel's first statement: launched overlapped, it waits until the one before it has finished
    (and its writes are visible), before reading anything or writing at all, and only then lets the
    next kernel on the stream start (mgx_abi.cuh says why in that order). A no-op otherwise."""
    if OVERLAP:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1`` at import)."""
    return _INTERPRETING


def _fix_interpreter() -> None:
    """Two fixes to Triton's CPU interpreter (3.6), so CI runs the kernels as the GPU does.

    - Scalars are 1-element arrays converted with ``int(array)``, which numpy >= 2.4 refuses;
      ``range(lo, hi)`` over loaded bounds then fails. Take the element instead.
    - ``tl.dot`` on bf16 multiplies the uint16 bit patterns the interpreter stores bf16 in; widen
      bf16 operands to fp32 first (exact), which is what the tensor cores compute with.

    Only the interpreter is touched; compiled kernels never see this.
    """
    import numpy as np
    from triton.runtime import interpreter

    if getattr(interpreter, "_mgx_fixed", False):
        return
    original_patch = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):  # noqa: ANN001
        original_patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    builder = interpreter.InterpreterBuilder
    original_dot = builder.create_dot

    def widen(h):  # noqa: ANN001, ANN202
        if h.dtype.scalar != tl.bfloat16:
            return h
        return interpreter.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):  # noqa: ANN001, ANN202
        return original_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    interpreter._patch_lang_tensor = patch_lang_tensor
    builder.create_dot = create_dot
    interpreter._mgx_fixed = True


if interpreting():
    _fix_interpreter()


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for launch grids, in plain Python (``triton.cdiv``'s constexpr wrapper cost 3.1 us a call)."""
    return -(-int(a) // int(b))


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1). Plain Python: ``triton.next_power_of_2`` is a
    constexpr function whose wrapper cost 3.4 us a call on the VM against 0.3 us, and the launch
    wrappers call this about 180 times per eager step."""
    return 1 << (max(1, int(n)) - 1).bit_length()


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (a small stand-in on the CPU interpreter)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def check_float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")


def rows_of(name: str, t: torch.Tensor, width: int | None = None) -> torch.Tensor:
    """``t`` as a [rows, width] tensor whose last dimension is contiguous (copied only if needed)."""
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D [tokens, features], got shape {tuple(t.shape)}")
    if width is not None and t.shape[1] != width:
        raise ValueError(f"{name} has {t.shape[1]} features, expected {width}")
    return t if t.stride(1) == 1 else t.contiguous()


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 operands multiply exactly ("ieee"), not in tf32, so fp32 models match the CPU reference."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def round_as(v, IO: tl.constexpr):
    """fp32 ``v`` rounded to the precision of IO (round to nearest even) and returned as fp32: where a
    16-bit model rounds an intermediate result. In the interpreter bf16 is rounded on the bits, because
    Triton's CPU interpreter truncates a bf16 cast where the GPU rounds; compiled, by the GPU's
    conversion (cvt.rn.bf16.f32, the same value: one F2FP for two values where the bit operations took
    four instructions a value, and the compiler may then multiply bf16 pairs, as in the RMSNorm that a
    GEMV applies to x as it loads it). fp32 is returned as it is."""
    if IO == tl.bfloat16:
        if COMPILED:
            return v.to(tl.bfloat16).to(tl.float32)
        b = v.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        return b.to(tl.float32, bitcast=True)
    elif IO == tl.float16:
        return v.to(tl.float16).to(tl.float32)
    else:
        return v


@triton.jit
def round_apart(v, IO: tl.constexpr):
    """``round_as``, kept apart from the operation that reads it: where two rounded products are
    added (RoPE), the compiled conversions would let LLVM narrow the products and their sum to bf16
    operations and contract them into one bf16 FMA, which rounds once where the 16-bit model rounds
    three times (seen on the H200: RoPE outputs more than one bf16 step from transformers'). An empty
    inline-asm move hides the rounded value from that rewrite; the interpreter needs none."""
    r = round_as(v, IO)
    if COMPILED and IO != tl.float32:
        r = tl.inline_asm_elementwise(asm="mov.b32 $0, $1;", constraints="=r,r", args=[r], dtype=tl.float32,
                                      is_pure=True, pack=1)  # fmt: skip
    return r


@triton.jit
def cast_as(v, IO: tl.constexpr):
    """fp32 ``v`` cast to IO for a store, rounded to nearest even in the interpreter too (``round_as``)."""
    return round_as(v, IO).to(IO)
