// RMSNorm, optionally fused with the residual add before it: native CUDA for one target architecture.
//
// out = T(x / sqrt(mean(x^2) + eps)) * w over rows of `cols` elements (rounded to T before the weight
// multiplies, as transformers does); with `res` given, x + res is
// rounded to the IO type, written to `res_out`, and normalized (as the unfused add would leave it).
//
// Each row is handled by `blockDim.x` threads (a power of two, at least a warp); a block holds
// `blockDim.y` rows (more than one only when a row fits in one warp). Every thread loads up to
// kMaxVec 16-byte vectors of the row into registers before it uses any of them, so the row is read
// once; sums of squares are fp32, reduced with warp shuffles and, across warps, shared memory.
//
// Requirements the launcher checks: cols % (16 / sizeof(T)) == 0; pointers and row strides 16-byte
// aligned; cols <= kMaxVec * blockDim.x * (16 / sizeof(T)).

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "mgx_abi.cuh"

namespace {

constexpr int kMaxVec = 4;        // 16-byte vectors one thread keeps in registers
constexpr int kMaxThreads = 512;  // threads a block may have (the register budget is set for it)

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

template <typename T>
__device__ __forceinline__ void rms_norm_rows(T* __restrict__ out, T* __restrict__ res_out,
                                              const T* __restrict__ x, const T* __restrict__ res,
                                              const T* __restrict__ w, int rows, int cols, int64_t stride_x,
                                              int64_t stride_r, int64_t stride_o, int64_t stride_ro, float eps) {
  constexpr int V = 16 / sizeof(T);  // elements per 16-byte vector
  union Pack {
    uint4 raw;
    T e[V];
  };
  const int tpr = blockDim.x;  // threads per row
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  const bool live = row < rows;
  const int nvec = cols / V;

  // Issue every load of the row before using any, so all of them are in flight at once. The weight
  // (shared by all rows, so cached) is requested first: it is no other kernel's output, so it may be
  // read before the kernel this one overlaps (mgx_abi.cuh) has finished.
  Pack a[kMaxVec], b[kMaxVec], g[kMaxVec];
#pragma unroll
  for (int i = 0; i < kMaxVec; ++i) {
    const int j = threadIdx.x + i * tpr;
    if (live && j < nvec && w != nullptr) g[i].raw = reinterpret_cast<const uint4*>(w)[j];
  }
  mgx_pdl_wait();
#pragma unroll
  for (int i = 0; i < kMaxVec; ++i) {
    const int j = threadIdx.x + i * tpr;
    if (live && j < nvec) {
      a[i].raw = reinterpret_cast<const uint4*>(x + row * stride_x)[j];
      if (res != nullptr) b[i].raw = reinterpret_cast<const uint4*>(res + row * stride_r)[j];
    }
  }
  float vals[kMaxVec][V];
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < kMaxVec; ++i) {
    const int j = threadIdx.x + i * tpr;
    if (live && j < nvec) {
      if (res != nullptr) {
#pragma unroll
        for (int v = 0; v < V; ++v) a[i].e[v] = from_float<T>(to_float(a[i].e[v]) + to_float(b[i].e[v]));
        reinterpret_cast<uint4*>(res_out + row * stride_ro)[j] = a[i].raw;
      }
#pragma unroll
      for (int v = 0; v < V; ++v) {
        vals[i][v] = to_float(a[i].e[v]);
        ss += vals[i][v] * vals[i][v];
      }
    }
  }

  // Reduce over the row's threads: inside each warp by shuffles, then across warps by shared memory.
  const int width = tpr < 32 ? tpr : 32;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    if (off < width) ss += __shfl_xor_sync(0xffffffffu, ss, off);
  }
  if (tpr > 32) {  // then blockDim.y == 1
    __shared__ float partial[32];
    const int warp = threadIdx.x >> 5;
    if ((threadIdx.x & 31) == 0) partial[warp] = ss;
    __syncthreads();
    ss = 0.f;
    for (int i = 0; i < (tpr >> 5); ++i) ss += partial[i];
  }
  const float rstd = rsqrtf(ss / static_cast<float>(cols) + eps);

#pragma unroll
  for (int i = 0; i < kMaxVec; ++i) {
    const int j = threadIdx.x + i * tpr;
    if (live && j < nvec) {
      Pack o;
      if (w != nullptr) {
#pragma unroll
        for (int v = 0; v < V; ++v) {
          // As transformers' RMSNorm: the normalized value is rounded to T before the weight multiplies it.
          o.e[v] = from_float<T>(to_float(from_float<T>(vals[i][v] * rstd)) * to_float(g[i].e[v]));
        }
      } else {
#pragma unroll
        for (int v = 0; v < V; ++v) o.e[v] = from_float<T>(vals[i][v] * rstd);
      }
      reinterpret_cast<uint4*>(out + row * stride_o)[j] = o.raw;
    }
  }
}

}  // namespace

// One entry point per IO type; names are what the Python launcher looks up in the module, with the
// version suffix of mgx_abi.cuh.
#define MGX_RMS_NORM_ENTRY(NAME, T)                                                                   \
  extern "C" __global__ void __launch_bounds__(kMaxThreads)                                                 \
      MGX_ENTRY(NAME)(T* out, T* res_out, const T* x, const T* res, const T* w, int rows, int cols,              \
           long long stride_x, long long stride_r, long long stride_o, long long stride_ro, float eps) { \
    rms_norm_rows<T>(out, res_out, x, res, w, rows, cols, stride_x, stride_r, stride_o, stride_ro, eps); \
  }

MGX_RMS_NORM_ENTRY(mgx_rms_norm_f32, float)
MGX_RMS_NORM_ENTRY(mgx_rms_norm_f16, __half)
MGX_RMS_NORM_ENTRY(mgx_rms_norm_bf16, __nv_bfloat16)

// Present in code whose every entry point waits as mgx_abi.cuh says: only then does the runtime
// launch them overlapped (an older image's kernels would read their input too early).
extern "C" __global__ void MGX_ENTRY(mgx_overlap_aware)() {}
