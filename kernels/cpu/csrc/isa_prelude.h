// Included first by every isa_*.cpp: the standard headers the kernels use (compiled for the
// baseline ISA, before any target switch) and the macros that switch the target of what follows.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "common.h"
#include "scalar_types.h"

// MGX_PORTABLE_ONLY builds what a non-x86 host builds (the scalar path only), on any host.
#if (defined(__x86_64__) || defined(_M_X64)) && !defined(MGX_PORTABLE_ONLY)
#define MGX_X86 1
#else
#define MGX_X86 0
#endif

#define MGX_PRAGMA(x) _Pragma(#x)
#if defined(__clang__)
#define MGX_TARGET_PUSH(t) MGX_PRAGMA(clang attribute push(__attribute__((target(t))), apply_to = function))
#define MGX_TARGET_POP MGX_PRAGMA(clang attribute pop)
#else
#define MGX_TARGET_PUSH(t) MGX_PRAGMA(GCC push_options) MGX_PRAGMA(GCC target(t))
#define MGX_TARGET_POP MGX_PRAGMA(GCC pop_options)
#endif
