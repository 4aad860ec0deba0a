// The version suffix of every native entry point. Names end in _v<MGX_KERNEL_ABI>: bump it (and
// KERNEL_ABI in rmsnorm.py) whenever an entry's parameters change, so that a runtime never launches
// code stored by a build with other parameters -- it finds no entry of its version and falls back to
// Triton instead.
#pragma once

#ifndef MGX_KERNEL_ABI
#define MGX_KERNEL_ABI 1
#endif
#define MGX_CAT_(a, b) a##b
#define MGX_CAT(a, b) MGX_CAT_(a, b)
#define MGX_ENTRY(NAME) MGX_CAT(NAME##_v, MGX_KERNEL_ABI)

// Programmatic dependent launches (sm_90 and newer). A kernel launched with the overlap attribute may
// start while the kernel before it on the stream is still running: it calls mgx_pdl_wait() before it
// reads anything that kernel wrote (or writes anything), and only once past that wait lets the next
// kernel start. Released first thing (as before), each kernel let its successor launch at once,
// which could release its own in turn: the blocks of several waiting kernels could sit on the SMs
// beside the one running, and the 8B graph got slower on the H200 with the native GEMVs (2026-11-30).
// A no-op for ordinary launches and below sm_90.
// The entry mgx_overlap_aware marks code built so.
__device__ __forceinline__ void mgx_pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Lets the next kernel launch now, before this one's mgx_pdl_wait (which releases it anyway): only
// where that kernel's blocks, waiting, cannot hold up this one's or release a third early (gemv.cu's
// norm_stage_fx). A no-op below sm_90.
__device__ __forceinline__ void mgx_pdl_release() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
