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
