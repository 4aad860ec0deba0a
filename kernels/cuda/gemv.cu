// GEMV for one bf16 activation row (batch-1 decode): out[n] = sum_k x[k] * W[n, k], with W int4
// group-quantized, int8 per-row (W8A16) or dense bf16, in the layouts of kernels/triton/linear.py:
//
// - int4: bytes [N, K/2], column 2b + j in nibble j of byte b (low first); fp32 scales [N, K/g] and,
//   unless symmetric (z = 8), u8 zeros [N, K/g]: W = (q - z) * s.
// - w8a16: int8 [N, K], fp32 scales [N]: W = q * s.
// - none: bf16 [N, K].
//
// Each block computes R outputs (with `silu_f` > 0, R gate rows n and their up rows F + n, and
// out[n] = silu(gate) * up). All of the block's threads split K between them in words of 8 columns
// (4 bytes of int4, 8 of int8, 16 of bf16) and keep U words of each row in flight before using any: the weight
// is streamed once, past L1 (ld.global.nc.L1::no_allocate), while x (read by every block) stays in L1.
// Codes become exact fp32 without I2F: a code OR-ed into the mantissa of 2^23 is 2^23 + code, and
// subtracting 2^23 + zero is exact. Products and sums are fp32; the block reduces with warp shuffles
// and shared memory, and one rounding to bf16 ends it.
//
// Requirements the launcher checks: K % 8 == 0; int4 groups g a power of two >= 8; x and W rows
// 16-byte (x) and word-size (W) aligned; blockDim.x a multiple of 32 and at most kMaxThreads.

#include <cuda_bf16.h>
#include <stdint.h>

#include "mgx_abi.cuh"

namespace mgx_gemv {  // named: every .cu is one translation unit with the others

constexpr int kMaxThreads = 256;  // threads per block the launcher may use
constexpr int kRows = 4;          // outputs per block
constexpr int kUnroll = 4;        // words per row each thread loads before it uses them
constexpr float kTwo23 = 8388608.0f;

__device__ __forceinline__ uint32_t load_stream(const uint32_t* p) {
  uint32_t v;
  asm("ld.global.nc.L1::no_allocate.b32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

__device__ __forceinline__ uint2 load_stream(const uint2* p) {
  uint2 v;
  asm("ld.global.nc.L1::no_allocate.v2.b32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}

__device__ __forceinline__ uint4 load_stream(const uint4* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.b32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

// x[8t .. 8t + 7] as fp32 (bf16 -> fp32 is a shift of the bits).
__device__ __forceinline__ void load_x(const __nv_bfloat16* __restrict__ x, int t, float (&xf)[8]) {
  const uint4 u = __ldg(reinterpret_cast<const uint4*>(x) + t);
  const uint32_t v[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    xf[2 * i] = __uint_as_float(v[i] << 16);
    xf[2 * i + 1] = __uint_as_float(v[i] & 0xFFFF0000u);
  }
}

// sum_i (q_i - z) x_i over the 8 nibbles of `q` (nibble i is column i); zb = 2^23 + z.
__device__ __forceinline__ float dot_int4(uint32_t q, float zb, const float (&xf)[8]) {
  float p = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) p = fmaf(__uint_as_float(((q >> (4 * i)) & 0xFu) | 0x4B000000u) - zb, xf[i], p);
  return p;
}

// sum_i q_i x_i over the 8 int8 codes of `q` (byte i is column i).
__device__ __forceinline__ float dot_int8(uint2 q, const float (&xf)[8]) {
  const uint32_t h[2] = {q.x ^ 0x80808080u, q.y ^ 0x80808080u};  // q + 128, as unsigned bytes
  float p = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    // Byte i%4 of the half into the low byte of 0x4B000000: 2^23 + q + 128.
    const float f = __uint_as_float(__byte_perm(h[i / 4], 0x4B000000u, 0x7440u + (i % 4)));
    p = fmaf(f - (kTwo23 + 128.0f), xf[i], p);
  }
  return p;
}

__device__ __forceinline__ float silu(float v) { return v / (1.0f + __expf(-v)); }

// Sums acc[r] over the block; thread r < R of warp 0 gets row r's total.
template <int R>
__device__ __forceinline__ void block_sum(float (&acc)[R]) {
  __shared__ float part[kMaxThreads / 32][R];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc[r] += __shfl_xor_sync(0xFFFFFFFFu, acc[r], o);
  }
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < R; ++r) part[warp][r] = acc[r];
  }
  __syncthreads();
  if (warp == 0) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float s = 0.0f;
      for (int i = 0; i < warps; ++i) s += part[i][r];
      acc[r] = s;
    }
  }
}

// Writes the block's outputs from the totals (thread 0 of the block), scaling each row by
// `row_scale` (w8a16; nullptr: none) and adding the bias first.
template <int R>
__device__ __forceinline__ void store(__nv_bfloat16* __restrict__ out, const float (&acc)[R], const int (&row)[R],
                                      int n0, int n_out, const float* __restrict__ row_scale,
                                      const __nv_bfloat16* __restrict__ bias, bool silu_mul) {
  if (threadIdx.x != 0) return;
  float v[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    v[r] = acc[r];
    if (row_scale != nullptr) v[r] *= row_scale[row[r]];
    if (bias != nullptr) v[r] += __bfloat162float(bias[row[r]]);
  }
  constexpr int kOut = R / 2;  // with silu_mul the first half are gate rows, the second their up rows
  if (silu_mul) {
#pragma unroll
    for (int r = 0; r < kOut; ++r)
      if (n0 + r < n_out) out[n0 + r] = __float2bfloat16_rn(silu(v[r]) * v[kOut + r]);
  } else {
#pragma unroll
    for (int r = 0; r < R; ++r)
      if (n0 + r < n_out) out[n0 + r] = __float2bfloat16_rn(v[r]);
  }
}

// The rows block `blockIdx.x` reads: R consecutive outputs from n0, or (silu_f > 0) R/2 gate rows and
// the up rows F below them. Rows past the end repeat the last one (computed, never stored).
template <int R>
__device__ __forceinline__ int block_rows(int (&row)[R], int n, int silu_f) {
  const int per = silu_f > 0 ? R / 2 : R;
  const int n0 = blockIdx.x * per;
  const int n_out = silu_f > 0 ? silu_f : n;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int i = min(n0 + (silu_f > 0 ? r % per : r), n_out - 1);
    row[r] = (silu_f > 0 && r >= per) ? silu_f + i : i;
  }
  return n0;
}

// int4 codes, 8 to a 4-byte word: one group's scale (and zero) per word.
struct Int4Codes {
  using Word = uint32_t;
  const float* __restrict__ scales;
  const uint8_t* __restrict__ zeros;  // nullptr: symmetric (z = 8)
  long long stride_s;
  int group_shift;

  __device__ __forceinline__ float operator()(Word q, const float (&xf)[8], int row, int t) const {
    const long long at = row * stride_s + ((t << 3) >> group_shift);
    const float zb = kTwo23 + (zeros != nullptr ? static_cast<float>(__ldg(zeros + at)) : 8.0f);
    return __ldg(scales + at) * dot_int4(q, zb, xf);
  }
};

// int8 codes, 8 to an 8-byte word; the row's scale is applied once, in store().
struct Int8Codes {
  using Word = uint2;

  __device__ __forceinline__ float operator()(Word q, const float (&xf)[8], int, int) const { return dot_int8(q, xf); }
};

// Dense bf16 weights, 8 to a 16-byte word.
struct Bf16Weights {
  using Word = uint4;

  __device__ __forceinline__ float operator()(Word q, const float (&xf)[8], int, int) const {
    const uint32_t h[4] = {q.x, q.y, q.z, q.w};
    float p = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      p = fmaf(__uint_as_float(h[i] << 16), xf[2 * i], p);
      p = fmaf(__uint_as_float(h[i] & 0xFFFF0000u), xf[2 * i + 1], p);
    }
    return p;
  }
};

template <class Codes, int R>
__device__ void gemv_rows(__nv_bfloat16* __restrict__ out, const __nv_bfloat16* __restrict__ x,
                          const uint8_t* __restrict__ w, const Codes codes, const float* __restrict__ row_scale,
                          const __nv_bfloat16* __restrict__ bias, int n, int k, long long stride_w, int silu_f) {
  using Word = typename Codes::Word;
  int row[R];
  const int n0 = block_rows<R>(row, n, silu_f);
  const int words = k >> 3;
  float acc[R];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = 0.0f;
  for (int base = threadIdx.x; base < words; base += blockDim.x * kUnroll) {
    Word q[kUnroll][R];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int t = base + u * blockDim.x;
#pragma unroll
      for (int r = 0; r < R; ++r)
        q[u][r] = t < words ? load_stream(reinterpret_cast<const Word*>(w + row[r] * stride_w) + t) : Word{};
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int t = base + u * blockDim.x;
      if (t >= words) break;
      float xf[8];
      load_x(x, t, xf);
#pragma unroll
      for (int r = 0; r < R; ++r) acc[r] += codes(q[u][r], xf, row[r], t);
    }
  }
  block_sum<R>(acc);
  store<R>(out, acc, row, n0, silu_f > 0 ? silu_f : n, row_scale, bias, silu_f > 0);
}

}  // namespace mgx_gemv

// out [N] (or [F] with silu_f = F > 0, W holding 2F rows: gate then up) from x [K]; bias [N] or null;
// zeros null for symmetric int4; stride_w in bytes. Grid: ceil(outputs / 4) blocks (2 with silu_f) of blockDim.x threads.
extern "C" __global__ void __launch_bounds__(mgx_gemv::kMaxThreads)
    MGX_ENTRY(mgx_gemv_int4_bf16)(__nv_bfloat16* out, const __nv_bfloat16* x, const uint8_t* w, const float* scales,
                                  const uint8_t* zeros, const __nv_bfloat16* bias, int n, int k, long long stride_w,
                                  long long stride_s, int group_shift, int silu_f) {
  const mgx_gemv::Int4Codes codes{scales, zeros, stride_s, group_shift};
  mgx_gemv::gemv_rows<mgx_gemv::Int4Codes, mgx_gemv::kRows>(out, x, w, codes, nullptr, bias, n, k, stride_w, silu_f);
}

extern "C" __global__ void __launch_bounds__(mgx_gemv::kMaxThreads)
    MGX_ENTRY(mgx_gemv_w8a16_bf16)(__nv_bfloat16* out, const __nv_bfloat16* x, const int8_t* w, const float* scales,
                                   const __nv_bfloat16* bias, int n, int k, long long stride_w, int silu_f) {
  mgx_gemv::gemv_rows<mgx_gemv::Int8Codes, mgx_gemv::kRows>(out, x, reinterpret_cast<const uint8_t*>(w),
                                                            mgx_gemv::Int8Codes{}, scales, bias, n, k, stride_w,
                                                            silu_f);
}

extern "C" __global__ void __launch_bounds__(mgx_gemv::kMaxThreads)
    MGX_ENTRY(mgx_gemv_bf16_bf16)(__nv_bfloat16* out, const __nv_bfloat16* x, const __nv_bfloat16* w,
                                  const __nv_bfloat16* bias, int n, int k, long long stride_w, int silu_f) {
  mgx_gemv::gemv_rows<mgx_gemv::Bf16Weights, mgx_gemv::kRows>(out, x, reinterpret_cast<const uint8_t*>(w),
                                                              mgx_gemv::Bf16Weights{}, nullptr, bias, n, k, stride_w,
                                                              silu_f);
}
