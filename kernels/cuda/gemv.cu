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
#include <cuda_fp16.h>
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

// load_stream as a volatile asm: it stays where it is written relative to the other volatile asm (the
// MMAs), so the pipelined tensor-core GEMV's loads of the next pass are issued before it computes this one.
__device__ __forceinline__ uint4 load_stream_now(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.b32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// load_stream_now with the L2 told to fetch whole 256-byte blocks from DRAM (kinds imma: a lane quad
// reads 64 (int4) or 128 (W8A16) bytes of a row a step, and the rest of the block is the next warps'
// steps). On the H200 (16th session, cold L2) it took 1-3% off every imma shape against no hint, and
// the same as L2::128B.
__device__ __forceinline__ uint4 load_stream_fetch(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.b32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// Volatile scalar loads through the read-only path, in written order with the loads above.
__device__ __forceinline__ float load_now(const float* p) {
  float v;
  asm volatile("ld.global.nc.f32 %0, [%1];" : "=f"(v) : "l"(p));
  return v;
}

__device__ __forceinline__ float4 load_now(const float4* p) {
  float4 v;
  asm volatile("ld.global.nc.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ uint2 load_now(const uint2* p) {
  uint2 v;
  asm volatile("ld.global.nc.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}

__device__ __forceinline__ uint32_t load_now(const uint8_t* p) {
  uint16_t v;
  asm volatile("ld.global.nc.u8 %0, [%1];" : "=h"(v) : "l"(p));
  return v;
}

__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

// Words of 8 bf16 columns of x: from global memory through the read-only cache, or (the RMSNorm
// prologue's row) from shared memory.
template <bool kShared>
__device__ __forceinline__ uint4 x_word(const uint4* __restrict__ x, int t) {
  if constexpr (kShared) {
    return x[t];
  } else {
    return __ldg(x + t);
  }
}

// x[8t .. 8t + 7] as fp32 (bf16 -> fp32 is a shift of the bits).
template <bool kShared>
__device__ __forceinline__ void load_x(const uint4* __restrict__ x, int t, float (&xf)[8]) {
  const uint4 u = x_word<kShared>(x, t);
  const uint32_t v[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    xf[2 * i] = __uint_as_float(v[i] << 16);
    xf[2 * i + 1] = __uint_as_float(v[i] & 0xFFFF0000u);
  }
}

// (a & b) | c in one LOP3, c in a register: nvcc 13 otherwise emits an AND and an OR where both
// b and c are constants (a SASS instruction holds one 32-bit immediate).
__device__ __forceinline__ uint32_t and_or(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
}

// sum_i (q_i - z) x_i over the 8 nibbles of `q` (nibble i is column i); zb = 2^23 + z.
__device__ __forceinline__ float dot_int4(uint32_t q, float zb, const float (&xf)[8]) {
  float p = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) p = fmaf(__uint_as_float(and_or(q >> (4 * i), 0xFu, 0x4B000000u)) - zb, xf[i], p);
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

__device__ __forceinline__ float round_bf16(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

// silu(gate) * up with transformers' roundings in bf16: gate and up (its linears' outputs), silu(gate),
// then the product (rounded by the caller's store).
__device__ __forceinline__ float silu_times(float gate, float up) {
  return round_bf16(silu(round_bf16(gate))) * round_bf16(up);
}

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
      if (n0 + r < n_out) out[n0 + r] = __float2bfloat16_rn(silu_times(v[r], v[kOut + r]));
  } else {
#pragma unroll
    for (int r = 0; r < R; ++r)
      if (n0 + r < n_out) out[n0 + r] = __float2bfloat16_rn(v[r]);
  }
}

// The rows of output group `blk`: R consecutive outputs from n0, or (silu_f > 0) R/2 gate rows and
// the up rows F below them. Rows past the end repeat the last one (computed, never stored).
template <int R>
__device__ __forceinline__ int block_rows(int (&row)[R], int n, int silu_f, int blk) {
  const int per = silu_f > 0 ? R / 2 : R;
  const int n0 = blk * per;
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

// ---- RMSNorm in the prologue --------------------------------------------------------------------
//
// The row a GEMV multiplies is often rms_norm(res + delta) * g (a decoder layer's input norms). With
// NormIn every block computes that row itself into shared memory first, exactly as rmsnorm.cu rounds
// it (res + delta to bf16; the normalized value to bf16 before g multiplies it), and block 0 writes
// res + delta for the layers after it: one kernel instead of the norm's and the GEMV's. Sums of
// squares are fp32 in another order than rmsnorm.cu's, so 1/rms may differ from its in the last bit.

struct NormIn {
  const __nv_bfloat16* res;    // [K]
  const __nv_bfloat16* delta;  // [K] added to res first; nullptr: none
  const __nv_bfloat16* g;      // [K] the norm's weight; nullptr: none
  __nv_bfloat16* res_out;      // [K] res + delta (block 0 writes it); never res or delta
  float eps;
};

__device__ __forceinline__ float lo_bf16(uint32_t v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float hi_bf16(uint32_t v) { return __uint_as_float(v & 0xFFFF0000u); }

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 p = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&p);
}

// Word j (columns 8 j ..) of the fused MLP's fixed-point row as bf16 pairs: each int64 of 2^-32 to the
// nearest fp32, then to bf16 (NaN throughout where `bad`).
__device__ __forceinline__ uint4 fx_word(const long long* __restrict__ row, int j, bool bad) {
  const longlong2* p = reinterpret_cast<const longlong2*>(row) + 4 * j;
  uint32_t o[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const longlong2 v = __ldg(p + i);
    o[i] = bad ? 0x7FC07FC0u : pack_bf16(__ll2float_rn(v.x) * 0x1p-32f, __ll2float_rn(v.y) * 0x1p-32f);
  }
  return make_uint4(o[0], o[1], o[2], o[3]);
}

// Fills xs[0 .. K/8) with the normalized row; every thread of the block returns after it is complete.
// Words a thread of the RMSNorm prologue loads before it uses them. 4 took the int4 imma _norm entries
// from 64 to 70 registers (sm_90a; one block an SM fewer), 2 keeps 64 (twentieth session, cuobjdump).
constexpr int kNormBatch = 2;

// A thread's norm weights for its first batch of words (j = threadIdx.x + u blockDim.x): no kernel's
// output, so a kernel may load them before its PDL wait (mgx_abi.cuh) and hand them to norm_prologue.
struct NormWeights {
  uint4 w[kNormBatch];
};

// Word j of the norm's weights (zero past the row's `words` words, or without weights).
__device__ __forceinline__ uint4 norm_weight(const NormIn& in, int j, int words) {
  return j < words && in.g != nullptr ? __ldg(reinterpret_cast<const uint4*>(in.g) + j) : make_uint4(0, 0, 0, 0);
}

__device__ __forceinline__ NormWeights norm_weights_first(const NormIn& in, int k) {
  NormWeights first;
#pragma unroll
  for (int u = 0; u < kNormBatch; ++u) first.w[u] = norm_weight(in, threadIdx.x + u * blockDim.x, k >> 3);
  return first;
}

// A warp's sum: blocks of up to 1,024 threads (imma_w16's _norm entries: 16 warps). One array whichever
// norm_prologue asks (a static of the template would be one array per instantiation).
__device__ __forceinline__ float* norm_partials() {
  __shared__ float part[32];
  return part;
}

// first: the thread's first batch of weights, loaded already (norm_weights_first; nullptr: load them
// here, after the sums of squares, a round trip to memory on the block's path).
// kFx: the delta added to res is delta_fx [K + 2] instead of in.delta (never null then): the fused
// MLP's row (mlp_int4_fused: int64 multiples of 2^-32, then its flag of a NaN or Inf met), rounded to
// bf16 as a GEMV rounds its output, NaN throughout where the flag is set.
template <bool kFx = false>
__device__ void norm_prologue(uint4* __restrict__ xs, const NormIn& in, int k, const NormWeights* first = nullptr,
                              const long long* __restrict__ delta_fx = nullptr) {
  float* part = norm_partials();
  const int words = k >> 3;
  const uint4 zero = make_uint4(0, 0, 0, 0);
  bool bad = false;
  if constexpr (kFx) bad = __ldg(delta_fx + k) != 0;
  float ss = 0.0f;
  // A thread's words in batches of kNormBatch, each batch's loads (x and delta) issued before any is
  // used: the prologue waits about one L2 round trip a batch instead of one a word, and the same for
  // the norm's weights below (a row of 4,096 columns on 128 threads, imma_w4's blocks: 4 words a
  // thread, 2 round trips instead of 4 in each loop). The sums run in the same order: the same bits.
  // Twentieth session; not yet run on a GPU.
  for (int j0 = threadIdx.x; j0 < words; j0 += kNormBatch * blockDim.x) {
    uint4 a[kNormBatch], b[kNormBatch];
#pragma unroll
    for (int u = 0; u < kNormBatch; ++u) {
      const int j = j0 + u * blockDim.x;
      a[u] = j < words ? __ldg(reinterpret_cast<const uint4*>(in.res) + j) : zero;
      if constexpr (kFx) {
        b[u] = j < words ? fx_word(delta_fx, j, bad) : zero;
      } else {
        b[u] = j < words && in.delta != nullptr ? __ldg(reinterpret_cast<const uint4*>(in.delta) + j) : zero;
      }
    }
#pragma unroll
    for (int u = 0; u < kNormBatch; ++u) {
      const int j = j0 + u * blockDim.x;
      if (j >= words) break;
      uint4 s = a[u];
      if (kFx || in.delta != nullptr) {
        s = make_uint4(pack_bf16(lo_bf16(s.x) + lo_bf16(b[u].x), hi_bf16(s.x) + hi_bf16(b[u].x)),
                       pack_bf16(lo_bf16(s.y) + lo_bf16(b[u].y), hi_bf16(s.y) + hi_bf16(b[u].y)),
                       pack_bf16(lo_bf16(s.z) + lo_bf16(b[u].z), hi_bf16(s.z) + hi_bf16(b[u].z)),
                       pack_bf16(lo_bf16(s.w) + lo_bf16(b[u].w), hi_bf16(s.w) + hi_bf16(b[u].w)));
        if (blockIdx.x == 0) reinterpret_cast<uint4*>(in.res_out)[j] = s;
      }
      const uint32_t v[4] = {s.x, s.y, s.z, s.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) ss += lo_bf16(v[i]) * lo_bf16(v[i]) + hi_bf16(v[i]) * hi_bf16(v[i]);
      xs[j] = s;
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xFFFFFFFFu, ss, o);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = ss;
  __syncthreads();
  ss = 0.0f;
  for (int i = 0; i < (blockDim.x >> 5); ++i) ss += part[i];
  const float rstd = rsqrtf(ss / static_cast<float>(k) + in.eps);
  for (int j0 = threadIdx.x; j0 < words; j0 += kNormBatch * blockDim.x) {
    uint4 gs[kNormBatch];  // the norm's weights, loaded a batch at a time as above
#pragma unroll
    for (int u = 0; u < kNormBatch; ++u) {
      const int j = j0 + u * blockDim.x;
      gs[u] = first != nullptr && j0 == threadIdx.x ? first->w[u] : norm_weight(in, j, words);
    }
#pragma unroll
    for (int u = 0; u < kNormBatch; ++u) {
      const int j = j0 + u * blockDim.x;
      if (j >= words) break;
      const uint4 a = xs[j];
      const uint4 g = gs[u];
      const uint32_t v[4] = {a.x, a.y, a.z, a.w}, gv[4] = {g.x, g.y, g.z, g.w};
      uint32_t o[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        float lo = round_bf16(lo_bf16(v[i]) * rstd), hi = round_bf16(hi_bf16(v[i]) * rstd);
        if (in.g != nullptr) {
          lo *= lo_bf16(gv[i]);
          hi *= hi_bf16(gv[i]);
        }
        o[i] = pack_bf16(lo, hi);
      }
      xs[j] = make_uint4(o[0], o[1], o[2], o[3]);
    }
  }
  __syncthreads();
}

// Output groups of R rows (R/2 gate/up pairs with silu_f): block b takes group b (the plain launches,
// a block per group) or, with kNorm, groups b, b + gridDim.x, ... (fewer blocks than groups, so that
// each computes the normalized row once for several). With kNorm, x is the block's shared
// row, which the prologue fills after the block's first weights are sent towards L2. A thread waits
// for the kernel before (mgx_abi.cuh) once its first weights are requested, before it reads x.
template <class Codes, int R, bool kNorm>
__device__ void gemv_rows(__nv_bfloat16* __restrict__ out, const uint4* __restrict__ x,
                          const uint8_t* __restrict__ w, const Codes codes, const float* __restrict__ row_scale,
                          const __nv_bfloat16* __restrict__ bias, int n, int k, long long stride_w, int silu_f,
                          const NormIn* norm) {
  using Word = typename Codes::Word;
  const int n_out = silu_f > 0 ? silu_f : n;
  const int per = silu_f > 0 ? R / 2 : R;
  const int groups = (n_out + per - 1) / per;
  const int words = k >> 3;
  for (int blk = blockIdx.x; blk < groups; blk += gridDim.x) {
    int row[R];
    const int n0 = block_rows<R>(row, n, silu_f, blk);
    if constexpr (kNorm) {
      if (blk == blockIdx.x) {  // the weights are no kernel's output: on their way before the wait
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int t = threadIdx.x + u * blockDim.x;
#pragma unroll
          for (int r = 0; r < R; ++r)
            if (t < words) prefetch_l2(reinterpret_cast<const Word*>(w + row[r] * stride_w) + t);
        }
        mgx_pdl_wait();
        norm_prologue(const_cast<uint4*>(x), *norm, k);
      }
    }
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
      if (base == threadIdx.x) mgx_pdl_wait();  // the first weights are on their way; x may be the last kernel's
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int t = base + u * blockDim.x;
        if (t >= words) break;
        float xf[8];
        load_x<kNorm>(x, t, xf);
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r] += codes(q[u][r], xf, row[r], t);
      }
    }
    block_sum<R>(acc);
    store<R>(out, acc, row, n0, n_out, row_scale, bias, silu_f > 0);
    if constexpr (!kNorm) break;  // the plain launches have a block per group
    __syncthreads();  // block_sum's shared partials serve the next group
  }
}

// ---- int4 and int8 on the tensor cores ----------------------------------------------------------------
//
// One warp computes 16 rows (mma.m16n8k16 A = W tile, B = x in its 8 columns alike, D column 0 kept)
// over 128 columns at a time, one int4 group of 128 (or a part of a longer one). Lane (g = lane / 4,
// t = lane % 4) loads the codes of rows g and g + 8 at columns 128 i + 32 t .. + 31 (16 bytes of
// int4, 32 of int8).
// - int4: LOP3 turns each word's nibbles j and j + 4 into one bf16 pair 128 + q (exact), and the
//   same k-slots of B get x at those two columns, so every lane with the same t agrees on which
//   column a k-slot holds. A second MMA with A = 1 gives the sum of x over the 128 columns; then the
//   row's total is s * (D - (128 + z) * sum x).
// - int8 (W8A16): a code is 16 h + l with l its low nibble and h its signed high one; byte permutes
//   put columns j and j + 4 side by side, and LOP3 makes the pairs 128 + l and 136 + h (the XOR that
//   flips h's sign bit folded in). The MMA's first k-slots take the l pair against x, its last ones
//   the h pair against 16 x (exact in bf16), so D = sum (2304 + q) x; the same A = 1 MMA gives sum x,
//   the row's total is D - 2304 * sum x, and the row's scale multiplies it once at the end.
// The block's warps split K and add through shared memory. A grid smaller than the groups makes each
// block take groups b, b + grid, ...: as it starts one, every lane asks L2 for the rest of its share
// of this group (past the first steps, whose loads it has issued) and for its share of the next
// (prefetch), so the weight stream goes on while it computes. Pipelined (kind mma_pipelined, kPipe):
// every lane issues its loads of the warp's next steps (codes and, for int4, scales and zeros) before
// it computes the current ones, so a warp always has a pass of loads in flight instead of waiting for
// each pass before it computes; same sums in the same order. An int8 step's codes take twice the
// registers of an int4 one's, so its passes are half as many steps (the same bytes in flight).
constexpr int kMmaWarps = 8;   // warps per block
constexpr int kMmaUnroll = 4;  // 128-column steps per warp whose loads are issued together
// The same, pipelined (two passes' registers): 2 steps = 128 registers a thread on sm_90a, two blocks
// an SM, 32 KB of codes an SM in flight throughout; 3 steps spilled, 4 took 183 registers (one block).
constexpr int kMmaPipeUnroll = 2;

__device__ __forceinline__ void mma_bf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                         uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();  // bf16 MMA needs sm_80; the launcher never picks this kernel on older GPUs
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}

// Nibbles p and p + 4 of `w` (columns p and p + 4 of its word) as the bf16 pair (128 + q_p, 128 + q_p+4),
// in one LOP3 (``and_or``; with an AND and an OR the loop took 128 more of its 732 instructions).
__device__ __forceinline__ uint32_t nibble_pair(uint32_t w, int p) { return and_or(w >> (4 * p), 0x000F000Fu, 0x43004300u); }

// m ? (a ^ c) : c, bit by bit, in one LOP3: with m = 0x000F000F and c = 0x43084308, the nibbles at bits
// 0 and 16 of `a` with their top bit flipped, as the bf16 pair (128 + (h ^ 8), ...) = (136 + h, ...) for
// a signed nibble h.
__device__ __forceinline__ uint32_t sel_xor(uint32_t a, uint32_t m, uint32_t c) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0x6A;" : "=r"(r) : "r"(a), "r"(m), "r"(c));
  return r;
}

// The bf16 pair 16 * (lo, hi) of a pair of x (exact: a power of two).
__device__ __forceinline__ uint32_t times16(uint32_t v) {
  const __nv_bfloat162 h = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&v), __floats2bfloat162_rn(16.0f, 16.0f));
  return *reinterpret_cast<const uint32_t*>(&h);
}

// Into L2: lane t's codes (W uint4 words) of 128-column steps first, first + kMmaWarps, ... below `last`, of rows a and b.
template <int W>
__device__ __forceinline__ void prefetch_steps(const uint8_t* a, const uint8_t* b, int first, int last, int t) {
#pragma unroll 1
  for (int s = first; s < last; s += kMmaWarps) {
    prefetch_l2(reinterpret_cast<const uint4*>(a + s * 64 * W) + W * t);
    prefetch_l2(reinterpret_cast<const uint4*>(b + s * 64 * W) + W * t);
  }
}

// What a warp loads for one pass of U steps: W words of codes of rows lo and hi (16 bytes each: int4
// 1, int8 2) and, pipelined, their scales and zeros (int4).
template <bool kPipe, int U, int W>
struct MmaPass {
  uint4 lo[U * W], hi[U * W];  // step u's word v at u * W + v
};
template <int U, int W>
struct MmaPass<true, U, W> {
  uint4 lo[U * W], hi[U * W];
  float s_lo[U], s_hi[U];
  uint32_t z_lo[U], z_hi[U];
};

// The end of a tensor-core GEMV's output group: lanes t = 0 of every warp hold the partial sums of
// rows g (acc_lo) and g + 8 (acc_hi) over the warp's steps; the block adds them up through shared
// memory and thread 0 stores the group (row_scale: W8A16's, else null). Every thread of the block
// calls it; it returns once part[] may serve the next group.
__device__ __forceinline__ void finish_group(__nv_bfloat16* __restrict__ out, float acc_lo, float acc_hi, int blk,
                                             int n, int silu_f, const float* __restrict__ row_scale,
                                             const __nv_bfloat16* __restrict__ bias, bool silu_mul) {
  __shared__ float part[kMmaWarps][16];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2;
  if ((lane & 3) == 0) {
    part[warp][g] = acc_lo;
    part[warp][g + 8] = acc_hi;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float total[16];
#pragma unroll
    for (int r = 0; r < 16; ++r) {
      total[r] = 0.0f;
      for (int i = 0; i < kMmaWarps; ++i) total[r] += part[i][r];
    }
    int row[16];  // the rows the group's lanes read, for the bias and the row scales
    const int n0 = block_rows<16>(row, n, silu_mul ? silu_f : 0, blk);
    store<16>(out, total, row, n0, silu_mul ? silu_f : n, row_scale, bias, silu_mul);
  }
  __syncthreads();  // part[] serves the next group
}

// kInt8: W8A16 codes (scales per row, applied in store(); zeros and group_shift unused), else int4.
template <bool kInt8, bool kSilu, bool kNorm, bool kPipe>
__device__ void gemv_mma(__nv_bfloat16* __restrict__ out, const uint4* __restrict__ x, const uint8_t* __restrict__ w,
                         const float* __restrict__ scales, const uint8_t* __restrict__ zeros,
                         const __nv_bfloat16* __restrict__ bias, int n, int k, long long stride_w, long long stride_s,
                         int group_shift, int silu_f, const NormIn* norm) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int n_out = kSilu ? silu_f : n;
  const int groups = (n_out + (kSilu ? 7 : 15)) / (kSilu ? 8 : 16);
  const int steps = k >> 7;
  // A's rows g and g + 8 for output group b: 16 outputs, or 8 gate rows and their up rows; rows g
  // and g + 8 of block_rows<16>, which the epilogue takes (rows past the end repeat the last one,
  // never stored).
  const auto row_lo = [&](int b) { return min(b * (kSilu ? 8 : 16) + g, n_out - 1); };
  const auto row_hi = [&](int b) { return kSilu ? silu_f + row_lo(b) : min(b * 16 + g + 8, n - 1); };
  constexpr int kW = kInt8 ? 2 : 1;  // 16-byte words of codes a lane loads per row and step
  constexpr int kU = (kPipe ? kMmaPipeUnroll : kMmaUnroll) / kW;
  constexpr int kPass = kMmaWarps * kU;  // steps the block's warps load at once
  using Pass = MmaPass<kPipe, kU, kW>;
  for (int blk = blockIdx.x; blk < groups; blk += gridDim.x) {  // as in gemv_rows
    const int lo = row_lo(blk), hi = row_hi(blk);
    const uint8_t* w_lo = w + lo * stride_w;
    const uint8_t* w_hi = w + hi * stride_w;
    if constexpr (kNorm) {
      if (blk == blockIdx.x) {  // as in gemv_rows
        prefetch_steps<kW>(w_lo, w_hi, warp, min(steps, warp + kPass), t);
        mgx_pdl_wait();
        norm_prologue(const_cast<uint4*>(x), *norm, k);
      }
    }
    const uint32_t ones = 0x3F803F80u;  // bf16 pair (1, 1)
    float acc_lo = 0.0f, acc_hi = 0.0f;
    // A pass: lane t's codes of rows lo and hi for steps s0, s0 + kMmaWarps, ... (zeros past K) and,
    // pipelined, those steps' int4 scales and zeros (the plain kind reads them as it computes).
    const float* s_row_lo = scales + lo * stride_s;
    const float* s_row_hi = scales + hi * stride_s;
    const uint8_t* z_row_lo = zeros != nullptr ? zeros + lo * stride_s : nullptr;  // null: symmetric, z = 8
    const uint8_t* z_row_hi = zeros != nullptr ? zeros + hi * stride_s : nullptr;
    const auto load_pass = [&](int s0, Pass& p) {
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int s = s0 + u * kMmaWarps;
        const uint4* a = reinterpret_cast<const uint4*>(w_lo + s * 64 * kW) + kW * t;
        const uint4* b = reinterpret_cast<const uint4*>(w_hi + s * 64 * kW) + kW * t;
        if constexpr (kPipe) {
          const int grp = (s << 7) >> group_shift;
          p.lo[u * kW] = s < steps ? load_stream_now(a) : make_uint4(0, 0, 0, 0);
          if constexpr (kW == 2) p.lo[u * kW + 1] = s < steps ? load_stream_now(a + 1) : make_uint4(0, 0, 0, 0);
          p.hi[u * kW] = s < steps ? load_stream_now(b) : make_uint4(0, 0, 0, 0);
          if constexpr (kW == 2) p.hi[u * kW + 1] = s < steps ? load_stream_now(b + 1) : make_uint4(0, 0, 0, 0);
          if constexpr (!kInt8) {  // (an int8 row's scale is read once, in store())
            p.s_lo[u] = s < steps ? load_now(s_row_lo + grp) : 0.0f;
            p.s_hi[u] = s < steps ? load_now(s_row_hi + grp) : 0.0f;
            p.z_lo[u] = z_row_lo != nullptr && s < steps ? load_now(z_row_lo + grp) : 8u;
            p.z_hi[u] = z_row_hi != nullptr && s < steps ? load_now(z_row_hi + grp) : 8u;
          }
        } else {
          p.lo[u * kW] = s < steps ? load_stream(a) : make_uint4(0, 0, 0, 0);
          if constexpr (kW == 2) p.lo[u * kW + 1] = s < steps ? load_stream(a + 1) : make_uint4(0, 0, 0, 0);
          p.hi[u * kW] = s < steps ? load_stream(b) : make_uint4(0, 0, 0, 0);
          if constexpr (kW == 2) p.hi[u * kW + 1] = s < steps ? load_stream(b + 1) : make_uint4(0, 0, 0, 0);
        }
      }
    };
    // Once a group, after its first loads: wait for the kernel before (x), and prefetch into L2.
    const auto first_pass = [&]() {
      mgx_pdl_wait();  // as in gemv_rows
      if (gridDim.x < groups) prefetch_steps<kW>(w_lo, w_hi, warp + kPass, steps, t);  // persistent: the rest
      const int next = blk + gridDim.x;
      if (next < groups) prefetch_steps<kW>(w + row_lo(next) * stride_w, w + row_hi(next) * stride_w, warp, steps, t);
    };
    const auto compute_pass = [&](int s0, const Pass& p) {
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const int s = s0 + u * kMmaWarps;
        if (s >= steps) break;
        float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};   // sum (128 + q) x (int8: (2304 + q) x): d[0] row g, d[2] row g + 8
        float sx[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // sum x, in every element
        if constexpr (kInt8) {
          const int xw = s * 16 + t * 4;  // as below
          // Words 2j and 2j + 1: the codes of columns 8j .. 8j + 3 and 8j + 4 .. 8j + 7 of the lane's 32.
          const uint32_t wl[8] = {p.lo[u * kW].x, p.lo[u * kW].y, p.lo[u * kW].z, p.lo[u * kW].w,
                                  p.lo[u * kW + 1].x, p.lo[u * kW + 1].y, p.lo[u * kW + 1].z, p.lo[u * kW + 1].w};
          const uint32_t wh[8] = {p.hi[u * kW].x, p.hi[u * kW].y, p.hi[u * kW].z, p.hi[u * kW].w,
                                  p.hi[u * kW + 1].x, p.hi[u * kW + 1].y, p.hi[u * kW + 1].z, p.hi[u * kW + 1].w};
          constexpr uint32_t kLow = 0x000F000Fu, kPair = 0x43004300u, kFlip = 0x43084308u;
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const uint4 xx = x_word<kNorm>(x, xw + j);
            const uint32_t b[4] = {__byte_perm(xx.x, xx.z, 0x5410), __byte_perm(xx.x, xx.z, 0x7632),   // (x0,x4), (x1,x5)
                                   __byte_perm(xx.y, xx.w, 0x5410), __byte_perm(xx.y, xx.w, 0x7632)};  // (x2,x6), (x3,x7)
            // Bytes (c0, c1, c4, c5) and (c2, c3, c6, c7) of each row: pair p = (c_p, c_p+4) at bits 0 and 16
            // of z >> 8 (p % 2) (low nibbles) and z >> 8 (p % 2) + 4 (high nibbles).
            const uint32_t zl[2] = {__byte_perm(wl[2 * j], wl[2 * j + 1], 0x5410), __byte_perm(wl[2 * j], wl[2 * j + 1], 0x7632)};
            const uint32_t zh[2] = {__byte_perm(wh[2 * j], wh[2 * j + 1], 0x5410), __byte_perm(wh[2 * j], wh[2 * j + 1], 0x7632)};
#pragma unroll
            for (int q = 0; q < 4; ++q) {
              const int sh = 8 * (q & 1);
              const uint32_t l = zl[q >> 1] >> sh, h = zh[q >> 1] >> sh;
              mma_bf16(d, and_or(l, kLow, kPair), and_or(h, kLow, kPair), sel_xor(l >> 4, kLow, kFlip),
                       sel_xor(h >> 4, kLow, kFlip), b[q], times16(b[q]));
            }
            mma_bf16(sx, ones, ones, ones, ones, b[0], b[1]);
            mma_bf16(sx, ones, ones, ones, ones, b[2], b[3]);
          }
          acc_lo += fmaf(-2304.0f, sx[0], d[0]);
          acc_hi += fmaf(-2304.0f, sx[2], d[2]);
          continue;
        }
        const uint32_t wl[4] = {p.lo[u * kW].x, p.lo[u * kW].y, p.lo[u * kW].z, p.lo[u * kW].w};
        const uint32_t wh[4] = {p.hi[u * kW].x, p.hi[u * kW].y, p.hi[u * kW].z, p.hi[u * kW].w};
        const int xw = s * 16 + t * 4;  // x[128 s + 32 t + 8 j ..] is word xw + j
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const uint4 xx = x_word<kNorm>(x, xw + j);
          const uint32_t b0 = __byte_perm(xx.x, xx.z, 0x5410), b1 = __byte_perm(xx.x, xx.z, 0x7632);  // (x0,x4), (x1,x5)
          const uint32_t b2 = __byte_perm(xx.y, xx.w, 0x5410), b3 = __byte_perm(xx.y, xx.w, 0x7632);  // (x2,x6), (x3,x7)
          mma_bf16(d, nibble_pair(wl[j], 0), nibble_pair(wh[j], 0), nibble_pair(wl[j], 1), nibble_pair(wh[j], 1), b0, b1);
          mma_bf16(d, nibble_pair(wl[j], 2), nibble_pair(wh[j], 2), nibble_pair(wl[j], 3), nibble_pair(wh[j], 3), b2, b3);
          mma_bf16(sx, ones, ones, ones, ones, b0, b1);
          mma_bf16(sx, ones, ones, ones, ones, b2, b3);
        }
        float s_lo, s_hi, z_lo, z_hi;
        if constexpr (kPipe) {
          s_lo = p.s_lo[u], s_hi = p.s_hi[u], z_lo = static_cast<float>(p.z_lo[u]), z_hi = static_cast<float>(p.z_hi[u]);
        } else {
          const int grp = (s << 7) >> group_shift;
          const long long at_lo = lo * stride_s + grp, at_hi = hi * stride_s + grp;
          s_lo = __ldg(scales + at_lo), s_hi = __ldg(scales + at_hi);
          z_lo = zeros != nullptr ? static_cast<float>(__ldg(zeros + at_lo)) : 8.0f;
          z_hi = zeros != nullptr ? static_cast<float>(__ldg(zeros + at_hi)) : 8.0f;
        }
        acc_lo = fmaf(s_lo, fmaf(-(128.0f + z_lo), sx[0], d[0]), acc_lo);
        acc_hi = fmaf(s_hi, fmaf(-(128.0f + z_hi), sx[2], d[2]), acc_hi);
      }
    };
    if constexpr (kPipe) {
      Pass even, odd;  // two passes' registers, by turns (no copies between them)
      load_pass(warp, even);
      first_pass();
      for (int s0 = warp; s0 < steps; s0 += 2 * kPass) {
        load_pass(s0 + kPass, odd);
        compute_pass(s0, even);
        if (s0 + kPass >= steps) break;
        load_pass(s0 + 2 * kPass, even);
        compute_pass(s0 + kPass, odd);
      }
    } else {
      for (int s0 = warp; s0 < steps; s0 += kPass) {
        Pass cur;
        load_pass(s0, cur);
        if (s0 == warp) first_pass();
        compute_pass(s0, cur);
      }
    }
    finish_group(out, acc_lo, acc_hi, blk, n, silu_f, kInt8 ? scales : nullptr, bias, kSilu);
  }
}

// ---- W8A16 and int4 on the integer tensor cores (kind imma) ----------------------------------------
//
// The int8 codes enter mma.m16n8k32.s8.u8 as loaded: nothing decodes them, and no register moves
// build A's fragments. x is made integer instead, per 128-column step: with e the exponent field of
// the step's largest |x|, the FFMA x 2^(148 - e) + 1.5 2^23 leaves U = X + 2^22 in the low 23 bits,
// X = rn(x 2^(148 - e)) below 2^22 in magnitude -- exact for every x within 2^14 of the largest, the
// rest rounded at 2^-23 of it -- and U's three bytes are u8 columns of B, with a column of ones beside
// them: sum q X = D0 + 2^8 D1 + 2^16 (D3 - 64 D2) (columns: byte 0, byte 1, ones, byte 2), each D below
// 2^24 in magnitude (64 products a step of |q| <= 128 and bytes <= 255), so every part converts to
// fp32 exactly. A's 16 rows are 8 rows of W twice: A-row g takes columns 16 t + 0..3 and 8..11 of W's
// row g, A-row g + 8 columns 16 t + 4..7 and 12..15 of the same row, so the 16 bytes lane (g, t)
// loads from row g are its A fragment as they are; B's columns 0-3 hold the first part's x, 4-7 the
// second's (the x 4 columns on), and D[g][0..3] + D[g + 8][4..7] is row g's sum. A quad's lane t holds
// D columns 2t and 2t + 1 of both A-rows and weighs the useful pair (even t: 1 and 2^8; odd t: (top -
// 64 ones) by 2^16); the step's value times 2^(e - 148) adds to an fp32 total, the quad's lanes add
// at the end and the row's scale multiplies once (store()). An x that is Inf or NaN makes its step's
// factor NaN: the outputs are NaN, as a dense product's would be.
// A warp takes 16 rows of W as two such sets (rows g and g + 8 of the group, as the other tensor-core
// GEMVs) against the same B, converts the x of its own steps (each lane four columns), passes the bytes
// through its shared buffer into B's layout, and keeps its next pass of codes and x in flight while it
// computes (as mma_pipelined), also across the end of a group (imma_finish: no block barrier).
// int4 (imma4_stage_x, gemv_imma<true, ...>): a lane's 16-byte load of packed codes (columns 32 t ..
// of a 64-byte step) masked to its low nibbles and to its high nibbles is two u8 A fragments of the
// same shape (byte i: columns 32 t + 2 i and 32 t + 2 i + 1), one against x's even columns and one
// against its odd ones, so each lane stages every other column of 8 and writes B's words where the
// W8A16 kind's reads expect them. sum (q - z) x = (sum q X - z sum X) 2^(e - 148), sum X from one warp
// REDUX a step; the scale of the step's group multiplies the step's value.
// Tried on the H200 in the sixteenth session and dropped: four sets of 8 rows a warp for int4 (the
// staging shared by twice the bytes; 96 registers, two blocks an SM: the same times), a bulk L2
// prefetch of each group's rows (cp.async.bulk.prefetch.L2: 7-32% slower), and codes streamed through
// a ring of 3-8 steps in shared memory with cp.async (int4 up to 63%, W8A16 19-100% slower).
// Seventeenth session: a kind whose producer warp copied each group's 16 rows, 8 steps at a time, into
// a ring of 2-8 shared-memory slots with cp.async.bulk (mbarriers full and empty, scales beside the
// rows by cp.async, x in shared memory, the grid in equal shares of the groups): right to the bit, but
// slower on every 8B shape at 1-4 blocks an SM (int4 gate/up 38.0 vs 32.1 us, W8A16 48.8 vs 39.0).
// Nsight Compute (gate/up, clocks locked at 1.35 GHz): int4 imma runs 295 warp instructions per
// 16 x 128 step at 65% of the SM's issue rate and 37% of DRAM bandwidth, so it is bound by its
// instructions; the bulk kind ran 254 a step but issued at 46% (10.7 cycles between a warp's
// instructions, 35% occupancy). W8A16 imma: 203 a step (twice the bytes), 67-70% of DRAM bandwidth.
// Eighteenth session: the warps a block became a template parameter (kinds imma_w4, imma_w16, at the
// end of this file). Hoisting each group's row addresses out of its steps (about 90 of an int4 step's
// ~200 SASS instructions are the 64-bit products of rows and strides) took 72-79 registers, spilled
// under imma_w16's 64-register bound and was slower on the H200 (imma_w4 gate/up 31.1 vs 28.9 us,
// imma_w16 down 20.6 vs 19.3); 32-bit wide products instead barely changed the SASS.
#ifndef MGX_IMMA_UNROLL
#define MGX_IMMA_UNROLL 1
#endif
// Build flag MGX_IMMA_TILE16 (0 by default; the cuda_kernels pass sets it for an artifact whose int4 or
// W8A16 weights reorder_weights put in the cuda_tile16 layout): the imma kinds read their codes in that
// layout (formats/layouts.py) instead of row-major. Byte b of row r lies at
//   ((r / 16) S + b / (64 kW)) 1024 kW + ((b / 64) % kW) 1024 + (r % 16) 64 + b % 64
// (S = K / 128 steps; kW = 1 int4, 2 W8A16), so a warp's load of 8 rows' step (or of a word of them)
// is 512 contiguous bytes instead of 64 bytes of 8 rows, with the SiLU product's gate and up rows too.
// Same sums, same bits. On the H200 (32nd session, 83rd run) the 8B layer chain took W8A16 2.308 ->
// 2.260 ms and INT4 (x staged by the norms, its default) 1.728 -> 1.707 ms.
// Build flag MGX_IMMA_HALF_SCALES (0 by default; the cuda_kernels pass sets it beside MGX_IMMA_TILE16
// when every int4 weight's scales are fp16 values, as quantize_int4 writes them, and its groups a
// multiple of 128 columns): the int4 imma kinds read each group's scales and zeros of the warp's 16 rows
// from a table of fp16 pairs that gemv.py's scale_pairs builds beside the weight when it is uploaded, a
// uint2 (s lo, z lo, s hi, z hi) per lane row g at ((b * G + group) * 8 + g) for the kernel's output
// group b (rows as row_lo and row_hi: with the SiLU product, lo a gate row and hi its up row), one 8-byte
// load a lane and step where row-major fp32 scales and u8 zeros take four scalar loads; 64 bytes a warp's
// 16 rows and group against 80. fp16 holds those scales and the zeros (0..15) exactly: the same values,
// the same bits. On the H200 (42nd session, 133rd run) the 8B INT4 layer chain staged by the norms took
// 1.685 / 1.689 -> 1.629 ms (the GEMVs alone 1.400 -> 1.354). Tried beside it in the same run: the
// 31st session's table in fp32 (a float4 a lane, 128 bytes a group; build flag MGX_IMMA_TILES=1, gone)
// 1.649 ms, and one fp16 (s, z) a row ([N / 8][G][8], the same for both row pairings), lanes t = 0, 2
// loading row lo's and t = 1, 3 row hi's and a shuffle swapping them, 1.650 ms. The element-level
// tiling of fp32 scales and zeros (33rd session: four loads from 2 lines instead of 32) gained nothing,
// so what counts is the one load a lane.
#ifndef MGX_IMMA_TILE16
#define MGX_IMMA_TILE16 0
#endif
#ifndef MGX_IMMA_HALF_SCALES
#define MGX_IMMA_HALF_SCALES 0
#endif
constexpr bool kTile16 = MGX_IMMA_TILE16 != 0;
constexpr bool kHalfScales = MGX_IMMA_HALF_SCALES != 0;
constexpr uint32_t kIdleHalves = 0x48000000u;  // (s, z) = (0, 8) as fp16 halves: a pass with no work

// norm_stage_fx (the add + norm after the fused MLP, before QKV) lets QKV launch before its own wait
// (mgx_abi.cuh releases after it), so that QKV's blocks take the SMs the MLP's 112 blocks leave free and
// load their first pass while the MLP ends; QKV releases after its wait, so no third kernel follows
// early. Build flag MGX_NORM_FX_EARLY, 1 by default. In the 8B INT4 model on the H200 (forty-fifth
// session, 151st-152nd runs, graph ms, the flag rebuilt in the same run): with QKV and o on their
// tuned imma_w16, 1.690 against 1.702 / 1.695 without; on imma (MGX_CUDA_STAGED_X=imma), 1.635 against
// 1.678 / 1.671. Both norms early: 1.681 (151st) and 1.676 (150th, against 1.703 / 1.694); the norm
// before the MLP alone 1.710 (its successor's blocks fill an SM and wait for o's to leave anyway); the
// staged GEMVs releasing early too, 1.702-1.703.
#ifndef MGX_NORM_FX_EARLY
#define MGX_NORM_FX_EARLY 1
#endif
constexpr bool kNormFxEarly = MGX_NORM_FX_EARLY != 0;

// (s, z) from their fp16 halves (s in the low one).
__device__ __forceinline__ float2 half_pair(uint32_t r) {
  return __half22float2(*reinterpret_cast<const __half2*>(&r));
}
// Tried on the H200 (36th session, 99th-100th runs) and dropped: each warp copying its next 1-4 passes
// of codes, scales and zeros into shared memory with cp.async before mgx_pdl_wait (build flag
// MGX_IMMA_PRELOAD). Same bits and occupancy, but the 8B INT4 chain lost (1.713 -> 1.883-2.240 ms) and
// every kernel alone was slower (gate/up imma_w4 staged 23.4 -> 28.5 us with one pass): kernels/cuda/NOTEBOOK.md.
// Tried on the H200 (45th session, 149th-152nd runs; 5a4cee7, build flag MGX_PRELOAD bit 1) and
// dropped: a staged int4 GEMV copying its block's whole output group (steps x 1 KB of cuda_tile16
// codes and the group's scale pairs, contiguous) into shared memory with one cp.async.bulk before its
// PDL wait, and reading it from there. Same bits (the half-scales test, 6 passed), but in the 8B INT4
// model 1.698 against 1.702 / 1.694 ms with QKV and o on imma_w16 (384 blocks at two an SM: two
// waves), 1.646 against 1.678 / 1.671 on imma, and 1.653 with norm_stage_fx's early release, which alone
// gave 1.635: the windows before QKV and o (a norm, decode attention) are already used by the first
// pass each block loads before its wait.
// Tried on the H200 (35th session, 95th run) and dropped: a kernel of its own asking L2 for the next
// projections' weights (cp.async.bulk.prefetch.L2 over byte spans) after QKV, while decode attention
// runs. Every plan lost in the 8B INT4 layer chain (1.697 ms without; o's 9 MB 1.853; o and 16 MB of
// gate/up 2.258): each MB asked for cost about what reading it from DRAM again costs (kernels/cuda/NOTEBOOK.md).
// Tried on the H200 (34th session, 94th run) and dropped: loading a pass with no work (a warp's steps
// past K, the pass after the block's last group) from the last group and step instead of predicating
// its loads off with zero fills (cuda_tile16 int4 imma4 staged: 131 -> 120 SASS instructions a step
// that does not end its group; same bits). The 8B INT4 layer chain lost: staged by the norms 1.703 ->
// 1.718 ms, staged 1.752 -> 1.775, unstaged 1.828 -> 1.827; fewer instructions alone do not pay.
#ifndef MGX_IMMA_WARPS
#define MGX_IMMA_WARPS 8
#endif
constexpr int kImmaUnroll = MGX_IMMA_UNROLL;  // steps per pass (two passes' registers); 2 was slower on the H200
constexpr int kImmaWarps = MGX_IMMA_WARPS;    // warps per block of kinds imma and imma_persistent (gemv.py's
                                              // IMMA_THREADS / 32); imma_w4 and imma_w16: 4 and 16
constexpr int kImmaBuffer = 640;   // bytes of a warp's buffer: B's four distinct columns of 128 bytes, offset

// Where B column c (0: byte 0, 1: byte 1, 2: ones, 3: byte 2) starts in a warp's buffer: the offsets
// make a warp's LDS.64 of all eight columns free of bank conflicts.
__device__ __forceinline__ int imma_column(int c) { return 128 * c + 8 * (c & 1) + 64 * (c >> 1); }

// D += A B over k = 32: A int8 (kUnsignedA: u8, int4 codes), B u8.
template <bool kUnsignedA>
__device__ __forceinline__ void mma_imma(int (&d)[4], uint4 a, uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();  // m16n8k32 integer MMA needs sm_80; the launcher never picks this kernel on older GPUs
#else
  if constexpr (kUnsignedA) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.u8.u8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.u8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "r"(b0), "r"(b1));
  }
#endif
}

__device__ __forceinline__ uint32_t warp_max(uint32_t v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  return __reduce_max_sync(0xFFFFFFFFu, v);
#else
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xFFFFFFFFu, v, o));
  return v;
#endif
}

__device__ __forceinline__ int warp_sum(int v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  return __reduce_add_sync(0xFFFFFFFFu, v);
#else
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, o);
  return v;
#endif
}

// Columns 4 l .. 4 l + 3 of x (two words of bf16), in written order with the codes' loads.
template <bool kShared>
__device__ __forceinline__ uint2 x_quad(const uint4* __restrict__ x, int l) {
  if constexpr (kShared) {
    return reinterpret_cast<const uint2*>(x)[l];
  } else {
    uint2 v;
    asm volatile("ld.global.nc.v2.b32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(reinterpret_cast<const uint2*>(x) + l));
    return v;
  }
}

// Columns 8 o .. 8 o + 7 of x (four words of bf16), in written order with the codes' loads.
template <bool kShared>
__device__ __forceinline__ uint4 x_oct(const uint4* __restrict__ x, int o) {
  if constexpr (kShared) {
    return x[o];
  } else {
    uint4 v;
    asm volatile("ld.global.nc.v4.b32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(x + o));
    return v;
  }
}

// The step's scale from m, the bits of its largest |x| (bf16, sign cleared, warp-reduced): up = 2^(148 -
// ec) makes x integer; the returned factor 2^(e - 148) undoes it (NaN: Inf or NaN in the step's x).
__device__ __forceinline__ float imma_factor(uint32_t m, float& up) {
  const int e = static_cast<int>(m >> 7);  // bf16 exponent field of the largest |x|
  const int ec = max(e, 22);               // below (zero, tiny x): 2^126 keeps the factor finite
  up = __uint_as_float(static_cast<uint32_t>(275 - ec) << 23);  // 2^(148 - ec)
  return e == 255 ? __uint_as_float(0x7FC00000u) : __uint_as_float(static_cast<uint32_t>(ec - 21) << 23);
}

constexpr float kMagic = 12582912.0f;  // 1.5 2^23: x up + kMagic has 2^22 + rn(x up) in its low 23 bits

// Bytes 0, 1 and 2 of u0..u3 (four x made integer, in B's k order) as the words at `at` of B's columns 0,
// 1 and 3 in the warp's buffer, between the warp's reads of the step before and of this one.
__device__ __forceinline__ void imma_put(uint8_t* buf, int at, uint32_t u0, uint32_t u1, uint32_t u2, uint32_t u3) {
  const uint32_t p01 = __byte_perm(u0, u1, 0x5140), p23 = __byte_perm(u2, u3, 0x5140);  // bytes 0, 0', 1, 1'
  __syncwarp();  // the warp's reads of the last step are done
  *reinterpret_cast<uint32_t*>(buf + imma_column(0) + at) = __byte_perm(p01, p23, 0x5410);
  *reinterpret_cast<uint32_t*>(buf + imma_column(1) + at) = __byte_perm(p01, p23, 0x7632);
  *reinterpret_cast<uint32_t*>(buf + imma_column(3) + at) = __byte_perm(__byte_perm(u0, u1, 0x0062), __byte_perm(u2, u3, 0x0062), 0x5410);
  __syncwarp();
}

// Lane l's part of a step: its four x (columns 4 l ..) as bytes of B's columns 0, 1 and 3 in the warp's
// buffer, each 16 columns' words in the order 0, 2, 1, 3 (a part's two words side by side); returns the
// step's factor 2^(e - 148) (NaN: Inf or NaN in the step's x). Every lane of the warp calls it.
__device__ __forceinline__ float imma_stage_x(uint8_t* buf, uint2 xv, int lane) {
  uint32_t m = __vmaxu2(xv.x & 0x7FFF7FFFu, xv.y & 0x7FFF7FFFu);  // |x| as bits, ordered as the values
  float up;
  const float factor = imma_factor(warp_max(max(m & 0xFFFFu, m >> 16)), up);
  const uint32_t u0 = __float_as_uint(fmaf(lo_bf16(xv.x), up, kMagic));
  const uint32_t u1 = __float_as_uint(fmaf(hi_bf16(xv.x), up, kMagic));
  const uint32_t u2 = __float_as_uint(fmaf(lo_bf16(xv.y), up, kMagic));
  const uint32_t u3 = __float_as_uint(fmaf(hi_bf16(xv.y), up, kMagic));
  imma_put(buf, 16 * (lane >> 2) + 4 * (((lane & 1) << 1) | ((lane >> 1) & 1)), u0, u1, u2, u3);
  return factor;
}

// The int4 kind's step (see gemv_imma): lane l holds columns 8 o .. 8 o + 7 of x (o = l / 2) and takes
// those of parity h = l % 2, 8 o + h + 2 i, i = 0..3: the low (h = 0) or high (h = 1) nibbles of byte
// 4 o + i of a 64-byte row. With o = 4 t + 2 r + p they are B's k-slots 16 r + 4 t + i of part p, so
// the lane writes one word of each byte column at 64 h + 16 t + 8 p + 4 r, the layout the W8A16 kind
// reads. Returns the factor as imma_stage_x; sum_x is the step's sum of X (the integer x) over all 128
// columns, exact in int32 (|X| < 2^22) and then rounded to fp32.
__device__ __forceinline__ float imma4_stage_x(uint8_t* buf, uint4 xv, int lane, float& sum_x) {
  const uint32_t m2 = __vmaxu2(__vmaxu2(xv.x & 0x7FFF7FFFu, xv.y & 0x7FFF7FFFu), __vmaxu2(xv.z & 0x7FFF7FFFu, xv.w & 0x7FFF7FFFu));
  float up;
  const float factor = imma_factor(warp_max(max(m2 & 0xFFFFu, m2 >> 16)), up);
  const uint32_t pick = (lane & 1) ? 0x3244u : 0x1044u;  // the word's high or low bf16 as fp32 bits
  const uint32_t u0 = __float_as_uint(fmaf(__uint_as_float(__byte_perm(xv.x, 0u, pick)), up, kMagic));
  const uint32_t u1 = __float_as_uint(fmaf(__uint_as_float(__byte_perm(xv.y, 0u, pick)), up, kMagic));
  const uint32_t u2 = __float_as_uint(fmaf(__uint_as_float(__byte_perm(xv.z, 0u, pick)), up, kMagic));
  const uint32_t u3 = __float_as_uint(fmaf(__uint_as_float(__byte_perm(xv.w, 0u, pick)), up, kMagic));
  const int o = lane >> 1;
  imma_put(buf, 64 * (lane & 1) + 16 * (o >> 2) + 8 * (o & 1) + 4 * ((o >> 1) & 1), u0, u1, u2, u3);
  constexpr uint32_t kLow23 = 0x7FFFFFu;  // 2^22 + X: a lane's four below 2^25, the warp's 128 below 2^30
  const int lane_sum = static_cast<int>((u0 & kLow23) + (u1 & kLow23) + (u2 & kLow23) + (u3 & kLow23));
  sum_x = static_cast<float>(warp_sum(lane_sum) - (1 << 29));  // minus 128 2^22
  return factor;
}

// Warp `warp`'s buffer (one array per kernel, whichever instantiation asks).
template <int W>
__device__ __forceinline__ uint8_t* imma_buffer(int warp) {
  __shared__ __align__(16) uint8_t buffers[W][kImmaBuffer];
  return buffers[warp];
}

// Lane t's share of one set's step sums d (see above): its useful pair of D columns (lo, hi), as
// fp32 hi' * c_hi + lo * c_lo with hi' = hi - m * lo; (m, c_lo, c_hi) = (0, 1, 2^8) for even t and
// (64, 0, 2^16) for odd t (ImmaLane).
struct ImmaLane {
  int m;
  float c_lo, c_hi;
  bool second;  // t >= 2: the pair is D[g + 8][..], the second part's
};

__device__ __forceinline__ float imma_value(const int (&d)[4], const ImmaLane& l) {
  const int lo = l.second ? d[2] : d[0], hi = l.second ? d[3] : d[1];
  return fmaf(static_cast<float>(hi - l.m * lo), l.c_hi, static_cast<float>(lo) * l.c_lo);
}

// The end of an imma output group without a block barrier: each warp leaves its partial sums (rows g
// and g + 8 in lanes t = 0) in the group's half of `ImmaTally` and counts itself in; the warp that
// arrives last adds the partials in warp order (the same sums whichever warp it is) and stores the
// group, one output a lane, while the others go on to their next group. Groups alternate halves; a
// warp waits before it writes a half only while that half's group before is not yet stored.
template <int W>
struct ImmaTally {
  float part[2][W][16];
  int arrived[2];
  int stored[2];  // groups of that half stored so far
};

template <int W>
__device__ __forceinline__ ImmaTally<W>& imma_tally() {
  __shared__ ImmaTally<W> tally;
  return tally;
}

// kArgmax (the greedy LM head): out is float [2 groups]; the group's largest output and its row (the
// smallest on ties; NaN counts as -inf, so a group of NaN still gives its first row, as lm_head.py's
// kernels) go to out[blk] and, as int, out[groups + blk] instead of the outputs.
template <int W, bool kArgmax = false>
__device__ __forceinline__ void imma_finish(__nv_bfloat16* __restrict__ out, float acc_lo, float acc_hi, int blk,
                                            int use, int n, int silu_f, const float* __restrict__ row_scale,
                                            const __nv_bfloat16* __restrict__ bias, bool silu_mul) {
  ImmaTally<W>& tally = imma_tally<W>();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, h = use & 1;
  if (lane == 0) {  // this half's group before must be stored: its partials are read until then
    while (atomicAdd(&tally.stored[h], 0) < (use >> 1)) {
    }
  }
  __syncwarp();
  if ((lane & 3) == 0) {
    tally.part[h][warp][g] = acc_lo;
    tally.part[h][warp][g + 8] = acc_hi;
  }
  __syncwarp();
  int last = 0;
  if (lane == 0) {
    __threadfence_block();
    last = atomicAdd(&tally.arrived[h], 1) == W - 1;
    __threadfence_block();
  }
  if (!__shfl_sync(0xFFFFFFFFu, last, 0)) return;
  float v = 0.0f;
  if (lane < 16) {
    for (int i = 0; i < W; ++i) v += tally.part[h][i][lane];
  }
  const int per = silu_mul ? 8 : 16, n_out = silu_mul ? silu_f : n, n0 = blk * per;
  const int i = min(n0 + lane % per, n_out - 1);  // as block_rows<16>
  const int row = silu_mul && lane >= 8 ? silu_f + i : i;
  if (lane < 16) {
    if (row_scale != nullptr) v *= row_scale[row];
    if (bias != nullptr) v += __bfloat162float(bias[row]);
  }
  const float up = __shfl_down_sync(0xFFFFFFFFu, v, 8);  // lane r < 8: row r + 8's total
  if constexpr (kArgmax) {
    // Lanes 0-15 hold rows n0 + lane; the xor steps below 16 stay within them.
    const bool real = lane < 16 && n0 + lane < n;
    float best = real && !isnan(v) ? v : -INFINITY;
    int at = real ? n0 + lane : 0x7FFFFFFF;
#pragma unroll
    for (int o = 8; o > 0; o >>= 1) {
      const float ob = __shfl_xor_sync(0xFFFFFFFFu, best, o);
      const int oa = __shfl_xor_sync(0xFFFFFFFFu, at, o);
      if (ob > best || (ob == best && oa < at)) {
        best = ob;
        at = oa;
      }
    }
    if (lane == 0) {
      float* part = reinterpret_cast<float*>(out);
      part[blk] = best;
      reinterpret_cast<int*>(part + (n + 15) / 16)[blk] = at;
    }
  } else if (silu_mul) {
    if (lane < 8 && n0 + lane < n_out) out[n0 + lane] = __float2bfloat16_rn(silu_times(v, up));
  } else if (lane < 16 && n0 + lane < n_out) {
    out[n0 + lane] = __float2bfloat16_rn(v);
  }
  __syncwarp();
  if (lane == 0) {
    tally.arrived[h] = 0;
    __threadfence_block();
    atomicAdd(&tally.stored[h], 1);
  }
}

// With the RMSNorm prologue, and in kind imma_persistent's entry (kMulti), a block takes several output
// groups (b, b + grid, ...) against the same x, and each warp the same steps in each (warp, warp + W,
// ...): so a warp keeps what it staged for its first kImmaCache / W steps in the block's first group
// -- its lanes' B words, the step's factor and sum X -- and reads them back in the others instead of
// staging x again (the staging is about a quarter of a step's instructions; the same values, so the
// same bits).
#ifndef MGX_IMMA_CACHE
#define MGX_IMMA_CACHE 32
#endif
constexpr int kImmaCache = MGX_IMMA_CACHE;  // steps a block keeps: all up to K = 128 kImmaCache (0: none); 16 KB
template <int W>
struct ImmaCache {
  static constexpr int kSteps = kImmaCache / W;  // a warp's
  uint4 b[kSteps > 0 ? kSteps : 1][W][32];       // lane's B words (h = 0: .x, .y; h = 1: .z, .w)
  float2 fs[kSteps > 0 ? kSteps : 1][W];         // the step's factor and sum X (int4)
};

template <int W>
__device__ __forceinline__ ImmaCache<W>& imma_cache() {
  __shared__ ImmaCache<W> cache;
  return cache;
}

// ---- x staged once for every block (kStaged) ----------------------------------------------------------
//
// Every imma block stages x again for each of its output groups (about 50 of an int4 step's ~190 SASS
// instructions on sm_90a: the largest |x|, the FFMAs, the byte permutes, the buffer and the sum X).
// imma_stage_rows does it once for a GEMV, a warp a 128-column step, exactly as a GEMV warp would
// (imma_stage_x / imma4_stage_x, the same buffer and the same reads of it), and writes what each lane
// of a GEMV warp then holds: ImmaStaged = [steps][32 lanes] uint4 B words, then [steps] float2 (the
// step's factor, sum X). A kStaged GEMV loads those (one LDG.128 and one LDG.64 a lane and step).
__device__ __forceinline__ float2 staged_fs(const uint4* __restrict__ rec, int steps, int s) {
  float2 v;
  asm volatile("ld.global.nc.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y)
               : "l"(reinterpret_cast<const float2*>(rec + steps * 32) + s));
  return v;
}

constexpr int kStageWarps = 4;  // warps a block of imma_stage_rows (a step each)

// One warp's step s of x (global memory, or with kShared the block's row) into rec: staged in the
// warp's buffer as a GEMV warp stages it, then each lane's B words as that lane reads them, and the
// step's factor and sum X. Every lane of the warp calls it.
template <bool kInt4, bool kShared>
__device__ __forceinline__ void imma_stage_step(uint4* __restrict__ rec, uint8_t* buf, const uint4* __restrict__ x, int s,
                                                int steps) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  float sum_x = 0.0f;
  const float factor = kInt4 ? imma4_stage_x(buf, x_oct<kShared>(x, s * 16 + (lane >> 1)), lane, sum_x)
                             : imma_stage_x(buf, x_quad<kShared>(x, s * 32 + lane), lane);
  const int b_at = imma_column(g & 3) + 16 * t + 8 * (g >> 2);  // as gemv_imma's lane (g, t)
  const uint2 b0 = *reinterpret_cast<const uint2*>(buf + b_at), b1 = *reinterpret_cast<const uint2*>(buf + b_at + 64);
  rec[s * 32 + lane] = make_uint4(b0.x, b0.y, b1.x, b1.y);
  if (lane == 0) reinterpret_cast<float2*>(rec + steps * 32)[s] = make_float2(factor, sum_x);
}

template <bool kInt4>
__device__ void imma_stage_rows(uint4* __restrict__ rec, const uint4* __restrict__ x, int k) {
  const int warp = threadIdx.x >> 5, s = blockIdx.x * kStageWarps + warp;
  uint8_t* buf = imma_buffer<kStageWarps>(warp);
  reinterpret_cast<uint32_t*>(buf + imma_column(2))[threadIdx.x & 31] = 0x01010101u;  // column 2: ones, as gemv_imma
  __syncwarp();
  mgx_pdl_wait();  // x may be the kernel before's output
  if (s < (k >> 7)) imma_stage_step<kInt4, false>(rec, buf, x, s, k >> 7);
}

// The RMSNorm before a staged GEMV, writing its record too: a block normalizes the row
// (norm_prologue: rms_norm(res + delta) * g, res + delta to res_out) into shared memory, writes its
// share to `out`, and its warps stage their steps from there as imma_stage_rows does from
// global memory (so `rec` is stage_x(out)'s, to the bit). Replaces the norm's kernel and the stage's.
// Run instead by the last block of the projection before it (o_proj, down: a block counter, then this
// work), it lost twice on the H200: the 8B INT4 chain 1.716 -> 1.757 ms (32nd session) and 1.681 ->
// 1.735 (37th, the same bits as this kernel); this kernel, launched early and waiting, starts sooner.
template <bool kInt4, bool kFx = false>
__device__ void norm_stage_row(__nv_bfloat16* __restrict__ out, uint4* __restrict__ rec, const NormIn& in, int k,
                               const long long* __restrict__ delta_fx = nullptr) {
  extern __shared__ uint4 xs[];
  const int warp = threadIdx.x >> 5, steps = k >> 7;
  uint8_t* buf = imma_buffer<kMaxThreads / 32>(warp);
  reinterpret_cast<uint32_t*>(buf + imma_column(2))[threadIdx.x & 31] = 0x01010101u;  // column 2: ones
  // The norm's weights before the wait: one round trip to memory off the block's path. On the H200
  // (thirty-seventh session, 105th run) the 8B INT4 layer chain staged by the norms, cuda_tile16
  // build, took 1.698 and 1.689 ms against 1.721 and 1.707 without (two A/B pairs, 32 layers), the
  // norms alone 0.155 and 0.152 against 0.164 and 0.165; the same values, so the same bits.
  const NormWeights first = norm_weights_first(in, k);
  if constexpr (kFx && kNormFxEarly) mgx_pdl_release();
  mgx_pdl_wait();
  norm_prologue<kFx>(xs, in, k, &first, delta_fx);  // ends with a block barrier: xs is complete
  // Each block normalizes the whole row (its sum of squares needs all of it; the reads are one batch
  // of L2 round trips a thread) but writes and stages only its share: steps warps w of the grid, w +
  // all the grid's warps, ...; block 0 writes res + delta (norm_prologue). One block staging all 32
  // steps of an 8B row took four steps a warp, one after another, on the chain's critical path: on the
  // H200 (fortieth session, 122nd run) the 8B INT4 layer chain staged by the norms, cuda_tile16 build,
  // took 1.679 and 1.687 ms on a step a warp (4 blocks) against 1.701 and 1.697 on one block, the
  // norms alone 0.115 and 0.117 against 0.147 and 0.148 (32 layers); the 8B INT4 model's graph was
  // unchanged (1.794 ms, 124th run). The thirty-fifth session's same change had lost (96th run: 1.725
  // against 1.706 ms), before the norm's weights were loaded ahead of the wait.
  const int warps = blockDim.x >> 5, all = gridDim.x * warps, first_step = blockIdx.x * warps + warp;
  for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < (k >> 3); j += gridDim.x * blockDim.x) {
    reinterpret_cast<uint4*>(out)[j] = xs[j];
  }
  for (int s = first_step; s < steps; s += all) imma_stage_step<kInt4, true>(rec, buf, xs, s, steps);
}

// kInt4: int4 codes (u8 nibbles, scales and zeros per group of a multiple of 128 columns, applied per
// step), else W8A16 (int8 codes, the row's scale applied in imma_finish).
// W: warps a block (kImmaWarps; kinds imma_w4 and imma_w16: 4 and 16), which split each group's steps.
// kStaged: x is not the row but its steps as imma_stage_rows staged them (ImmaStaged): each lane loads
// its B words and the step's factor and sum X instead of staging x itself (the same values, so the
// same bits as the kernel without it).
template <bool kInt4, bool kSilu, bool kNorm, bool kMulti, int W, bool kArgmax = false, bool kStaged = false>
__device__ void gemv_imma(__nv_bfloat16* __restrict__ out, const uint4* __restrict__ x, const uint8_t* __restrict__ w,
                          const float* __restrict__ scales, const uint8_t* __restrict__ zeros,
                          const __nv_bfloat16* __restrict__ bias, int n, int k, long long stride_w, long long stride_s,
                          int group_shift, int silu_f, const NormIn* norm) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int n_out = kSilu ? silu_f : n;
  const int groups = (n_out + (kSilu ? 7 : 15)) / (kSilu ? 8 : 16);
  const int steps = k >> 7;
  uint8_t* buf = imma_buffer<W>(warp);
  reinterpret_cast<uint32_t*>(buf + imma_column(2))[lane] = 0x01010101u;  // column 2: ones (sum q)
  if (threadIdx.x < 4) (&imma_tally<W>().arrived[0])[threadIdx.x] = 0;  // arrived[2], stored[2]
  __syncthreads();
  // Lane (g, t) reads B column g % 4 of part g / 4 (a warp's LDS.64 covers all eight).
  const int b_at = imma_column(g & 3) + 16 * t + 8 * (g >> 2);
  const ImmaLane weigh{(t & 1) ? 64 : 0, (t & 1) ? 0.0f : 1.0f, (t & 1) ? 65536.0f : 256.0f, t >= 2};
  const auto row_lo = [&](int b) { return min(b * (kSilu ? 8 : 16) + g, n_out - 1); };  // as gemv_mma
  const auto row_hi = [&](int b) { return kSilu ? silu_f + row_lo(b) : min(b * 16 + g + 8, n - 1); };
  constexpr int kU = kImmaUnroll;
  constexpr int kW = kInt4 ? 1 : 2;  // 16-byte words of a row a lane loads per step
  constexpr int kPass = W * kU;
  struct Pass {
    uint4 lo[kW * kU], hi[kW * kU];  // step u's words of rows lo and hi at kW u ..: W8A16 bytes 16 t .. and
                                     // 64 + 16 t .., int4 bytes 16 t .. (columns 32 t ..)
    uint4 xv[kU];                    // W8A16: .x, .y (columns 4 l ..); int4: columns 8 (l / 2) ..; kStaged: B words
    float2 fs[kStaged ? kU : 1];     // kStaged: the step's factor and sum X
    float s_lo[kInt4 ? kU : 1], s_hi[kInt4 ? kU : 1];  // int4: the step's scales and zeros
    uint32_t z_lo[kInt4 ? kU : 1], z_hi[kInt4 ? kU : 1];  // kHalfScales: rows lo's and hi's fp16 (s, z)
  };
  // A warp's passes run as one stream over the block's groups (b, b + grid, ...; its passes of a group
  // at steps warp, warp + kPass, ...): the next pass is loaded before the current one is computed, also
  // across the end of a group, whose sums the block then adds and stores while those loads are on
  // their way. A warp with no step in a group (K below 128 x 8) still takes one empty pass of it.
  const auto next = [&](int b, int s0) { return s0 + kPass < steps ? make_int2(b, s0 + kPass) : make_int2(b + gridDim.x, warp); };
  // A lane's first code byte of row r at step 0 (then + s kStepBytes at step s, + kWordBytes for its
  // second word of W8A16), row-major or in cuda_tile16 (kTile16; N % 16 == 0 and K % 128 == 0 there).
  constexpr uint32_t kStepBytes = kTile16 ? 1024u * kW : 64u * kW;
  constexpr uint32_t kWordBytes = kTile16 ? 1024u : 64u;
  // In cuda_tile16 the 8 rows of a half (rows r0 .. r0 + 7, r0 a multiple of 8: gemv_imma's rows
  // unclamped, since N % 16 == 0 and the SiLU product's F % 8 == 0 there) are 512 contiguous bytes a
  // unit, lane (g, t) at 16 lane.
  const auto code_at = [&](int b, bool high) {
    if constexpr (kTile16) {
      const uint32_t r0 = static_cast<uint32_t>(kSilu ? (high ? silu_f : 0) + 8 * b : 16 * b + (high ? 8 : 0));
      return (r0 >> 4) * (static_cast<uint32_t>(steps) * kStepBytes) + (r0 & 15u) * 64u + 16u * lane;
    } else {
      return static_cast<uint32_t>(high ? row_hi(b) : row_lo(b)) * static_cast<uint32_t>(stride_w) + 16u * t;
    }
  };
  const auto load_w = [&](int2 at, Pass& p) {
    const int lo = row_lo(at.x), hi = row_hi(at.x);
    // Offsets in 32 bits (gemv_applies refuses codes or scales past 2^31 bytes and entries): one IMAD
    // each, and the scales' index shared with the zeros'. sm_90a, int4 imma_w4: a step's loads and
    // addresses take 66 SASS instructions against 100 with 64-bit products. On the H200 (cold L2,
    // twentieth session; build flag MGX_IMMA_INDEX32 until then) int4 gate/up imma_w4 28.7 -> 27.5 us,
    // imma_persistent_w4 27.6 -> 26.3, down imma_w16 19.0 -> 18.7; W8A16 within +-0.5 us either way.
    const uint32_t w_lo = code_at(at.x, false), w_hi = code_at(at.x, true);
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int s = at.y + u * W;
      const uint4* a = reinterpret_cast<const uint4*>(w + (w_lo + static_cast<uint32_t>(s) * kStepBytes));
      const uint4* b = reinterpret_cast<const uint4*>(w + (w_hi + static_cast<uint32_t>(s) * kStepBytes));
      const uint4 zero = make_uint4(0, 0, 0, 0);
      const bool in = s < steps && at.x < groups;
#pragma unroll
      for (int v = 0; v < kW; ++v) {  // cuda_tile16: each word's 32 lanes read 512 contiguous bytes
        p.lo[kW * u + v] = in ? load_stream_fetch(a + kWordBytes / 16 * v) : zero;
        p.hi[kW * u + v] = in ? load_stream_fetch(b + kWordBytes / 16 * v) : zero;
      }
      if constexpr (kInt4 && kHalfScales) {
        const uint32_t grp = (static_cast<uint32_t>(s) << 7) >> group_shift;
        const uint32_t i = (static_cast<uint32_t>(at.x) * static_cast<uint32_t>(stride_s) + grp) * 8u + static_cast<uint32_t>(g);
        const uint2 sz = in ? load_now(reinterpret_cast<const uint2*>(scales) + i) : make_uint2(kIdleHalves, kIdleHalves);
        p.z_lo[u] = sz.x;
        p.z_hi[u] = sz.y;
      } else if constexpr (kInt4) {
        const uint32_t grp = (static_cast<uint32_t>(s) << 7) >> group_shift;
        const uint32_t i_lo = static_cast<uint32_t>(lo) * static_cast<uint32_t>(stride_s) + grp;
        const uint32_t i_hi = static_cast<uint32_t>(hi) * static_cast<uint32_t>(stride_s) + grp;
        p.s_lo[u] = in ? load_now(scales + i_lo) : 0.0f;
        p.s_hi[u] = in ? load_now(scales + i_hi) : 0.0f;
        p.z_lo[u] = zeros != nullptr && in ? load_now(zeros + i_lo) : 8u;  // null: symmetric
        p.z_hi[u] = zeros != nullptr && in ? load_now(zeros + i_hi) : 8u;
      }
    }
  };
  // Whether the warp keeps its staging of step s (see ImmaCache), and whether group b reads it back.
  const auto keeps = [&](int s) { return (kNorm || kMulti) && s / W < ImmaCache<W>::kSteps; };
  const auto reuse = [&](int b, int s) { return keeps(s) && b != blockIdx.x; };
  const auto load_x = [&](int2 at, Pass& p) {
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int s = at.y + u * W;
      const bool in = s < steps && at.x < groups && !reuse(at.x, s);
      if constexpr (kStaged) {
        p.xv[u] = in ? x_oct<false>(x, s * 32 + lane) : make_uint4(0, 0, 0, 0);
        p.fs[u] = in ? staged_fs(x, steps, s) : make_float2(0.0f, 0.0f);
      } else if constexpr (kInt4) {
        p.xv[u] = in ? x_oct<kNorm>(x, s * 16 + (lane >> 1)) : make_uint4(0, 0, 0, 0);
      } else {
        const uint2 q = in ? x_quad<kNorm>(x, s * 32 + lane) : make_uint2(0, 0);
        p.xv[u] = make_uint4(q.x, q.y, 0, 0);
      }
    }
  };
  float acc_lo = 0.0f, acc_hi = 0.0f;
  int uses = 0;  // groups this warp has finished
  const auto compute = [&](int2 at, const Pass& p) {  // then, at a group's last pass, its sums out
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int s = at.y + u * W;
      if (s >= steps) break;
      float sum_x = 0.0f, factor;
      uint4 bw;  // the lane's B words of both halves
      if constexpr (kStaged) {
        bw = p.xv[u];
        factor = p.fs[u].x;
        sum_x = p.fs[u].y;
      } else if (reuse(at.x, s)) {
        bw = imma_cache<W>().b[s / W][warp][lane];
        const float2 fs = imma_cache<W>().fs[s / W][warp];
        factor = fs.x;
        sum_x = fs.y;
      } else {
        factor = kInt4 ? imma4_stage_x(buf, p.xv[u], lane, sum_x)
                       : imma_stage_x(buf, make_uint2(p.xv[u].x, p.xv[u].y), lane);
        const uint2 b0 = *reinterpret_cast<const uint2*>(buf + b_at), b1 = *reinterpret_cast<const uint2*>(buf + b_at + 64);
        bw = make_uint4(b0.x, b0.y, b1.x, b1.y);
        if (keeps(s)) {  // the block's first group: kept for the others
          imma_cache<W>().b[s / W][warp][lane] = bw;
          if (lane == 0) imma_cache<W>().fs[s / W][warp] = make_float2(factor, sum_x);
        }
      }
      int d[4] = {0, 0, 0, 0}, e[4] = {0, 0, 0, 0};  // rows lo (set 1) and hi (set 2)
#pragma unroll
      for (int h = 0; h < 2; ++h) {  // W8A16: 64-column halves; int4: low and high nibbles
        const uint2 b = h == 0 ? make_uint2(bw.x, bw.y) : make_uint2(bw.z, bw.w);
        if constexpr (kInt4) {
          const auto nibbles = [h](uint4 v) {
            constexpr uint32_t kLowNibbles = 0x0F0F0F0Fu;
            return h == 0 ? make_uint4(v.x & kLowNibbles, v.y & kLowNibbles, v.z & kLowNibbles, v.w & kLowNibbles)
                          : make_uint4((v.x >> 4) & kLowNibbles, (v.y >> 4) & kLowNibbles, (v.z >> 4) & kLowNibbles,
                                       (v.w >> 4) & kLowNibbles);
          };
          mma_imma<true>(d, nibbles(p.lo[u]), b.x, b.y);
          mma_imma<true>(e, nibbles(p.hi[u]), b.x, b.y);
        } else {
          mma_imma<false>(d, p.lo[2 * u + h], b.x, b.y);
          mma_imma<false>(e, p.hi[2 * u + h], b.x, b.y);
        }
      }
      if constexpr (kInt4) {  // s (sum q X - z sum X), the zero's part once a quad (lane t = 0)
        const float zx = t == 0 ? sum_x : 0.0f;
        float s_lo, s_hi, z_lo, z_hi;
        if constexpr (kHalfScales) {
          const float2 a = half_pair(p.z_lo[u]), c = half_pair(p.z_hi[u]);
          s_lo = a.x, z_lo = a.y, s_hi = c.x, z_hi = c.y;
        } else {
          s_lo = p.s_lo[u], s_hi = p.s_hi[u];
          z_lo = static_cast<float>(p.z_lo[u]), z_hi = static_cast<float>(p.z_hi[u]);
        }
        acc_lo = fmaf(factor * s_lo, fmaf(-z_lo, zx, imma_value(d, weigh)), acc_lo);
        acc_hi = fmaf(factor * s_hi, fmaf(-z_hi, zx, imma_value(e, weigh)), acc_hi);
      } else {
        acc_lo = fmaf(factor, imma_value(d, weigh), acc_lo);
        acc_hi = fmaf(factor, imma_value(e, weigh), acc_hi);
      }
    }
    if (at.y + kPass < steps) return;
#pragma unroll
    for (int o = 1; o < 4; o <<= 1) {  // the quad's lanes
      acc_lo += __shfl_xor_sync(0xFFFFFFFFu, acc_lo, o);
      acc_hi += __shfl_xor_sync(0xFFFFFFFFu, acc_hi, o);
    }
    imma_finish<W, kArgmax>(out, acc_lo, acc_hi, at.x, uses++, n, silu_f, kInt4 ? nullptr : scales, bias, kSilu);
    acc_lo = acc_hi = 0.0f;
  };
  int2 at = make_int2(blockIdx.x, warp);
  if constexpr (kNorm) {  // as in gemv_rows
    if constexpr (kTile16) {  // the lane's words of its first pass
#pragma unroll
      for (int u = 0; u < kU; ++u) {
        const uint32_t s = static_cast<uint32_t>(warp + u * W);
#pragma unroll
        for (int v = 0; v < kW; ++v) {
          if (s < static_cast<uint32_t>(steps)) {
            prefetch_l2(w + code_at(at.x, false) + s * kStepBytes + v * kWordBytes);
            prefetch_l2(w + code_at(at.x, true) + s * kStepBytes + v * kWordBytes);
          }
        }
      }
    } else {
      prefetch_steps<kW>(w + row_lo(at.x) * stride_w, w + row_hi(at.x) * stride_w, warp, min(steps, warp + kPass), t);
    }
    mgx_pdl_wait();
    norm_prologue(const_cast<uint4*>(x), *norm, k);
  }
  Pass even, odd;  // two passes' registers, by turns
  // Only the first pass's codes before the wait: asking L2 for the block's whole first group there
  // (build flag MGX_IMMA_PREFETCH, twenty-first session) lost on the H200 (the 8B layer chained 32
  // times: INT4 2.24 vs 1.81 ms, W8A16 2.92 vs 2.32).
  load_w(at, even);
  mgx_pdl_wait();  // as in gemv_rows: the first codes are on their way; x may be the last kernel's
  load_x(at, even);
  while (at.x < groups) {
    int2 later = next(at.x, at.y);
    load_w(later, odd);
    load_x(later, odd);
    compute(at, even);
    at = later;
    if (at.x >= groups) break;
    later = next(at.x, at.y);
    load_w(later, even);
    load_x(later, even);
    compute(at, odd);
    at = later;
  }
}

// One function per entry pair below; x is global memory (kNorm false) or the block's shared row that
// the RMSNorm prologue fills (norm: its operands).
template <bool kNorm>
__device__ __forceinline__ void gemv_int4(__nv_bfloat16* out, const uint4* x, const uint8_t* w, const float* scales,
                                          const uint8_t* zeros, const __nv_bfloat16* bias, int n, int k,
                                          long long stride_w, long long stride_s, int group_shift, int silu_f,
                                          const NormIn* norm) {
  const Int4Codes codes{scales, zeros, stride_s, group_shift};
  gemv_rows<Int4Codes, kRows, kNorm>(out, x, w, codes, nullptr, bias, n, k, stride_w, silu_f, norm);
}

template <bool kNorm>
__device__ __forceinline__ void gemv_w8a16(__nv_bfloat16* out, const uint4* x, const int8_t* w, const float* scales,
                                           const __nv_bfloat16* bias, int n, int k, long long stride_w, int silu_f,
                                           const NormIn* norm) {
  gemv_rows<Int8Codes, kRows, kNorm>(out, x, reinterpret_cast<const uint8_t*>(w), Int8Codes{}, scales, bias, n, k,
                                     stride_w, silu_f, norm);
}

template <bool kNorm>
__device__ __forceinline__ void gemv_bf16(__nv_bfloat16* out, const uint4* x, const __nv_bfloat16* w,
                                          const __nv_bfloat16* bias, int n, int k, long long stride_w, int silu_f,
                                          const NormIn* norm) {
  gemv_rows<Bf16Weights, kRows, kNorm>(out, x, reinterpret_cast<const uint8_t*>(w), Bf16Weights{}, nullptr, bias, n,
                                       k, stride_w, silu_f, norm);
}

template <bool kNorm, bool kPipe = false>
__device__ __forceinline__ void gemv_int4_tc(__nv_bfloat16* out, const uint4* x, const uint8_t* w, const float* scales,
                                             const uint8_t* zeros, const __nv_bfloat16* bias, int n, int k,
                                             long long stride_w, long long stride_s, int group_shift, int silu_f,
                                             const NormIn* norm) {
  if (silu_f > 0) {
    gemv_mma<false, true, kNorm, kPipe>(out, x, w, scales, zeros, bias, n, k, stride_w, stride_s, group_shift, silu_f, norm);
  } else {
    gemv_mma<false, false, kNorm, kPipe>(out, x, w, scales, zeros, bias, n, k, stride_w, stride_s, group_shift, silu_f, norm);
  }
}

template <bool kNorm, bool kPipe = false>
__device__ __forceinline__ void gemv_w8a16_tc(__nv_bfloat16* out, const uint4* x, const int8_t* w, const float* scales,
                                              const __nv_bfloat16* bias, int n, int k, long long stride_w, int silu_f,
                                              const NormIn* norm) {
  const uint8_t* codes = reinterpret_cast<const uint8_t*>(w);
  if (silu_f > 0) {
    gemv_mma<true, true, kNorm, kPipe>(out, x, codes, scales, nullptr, bias, n, k, stride_w, 0, 0, silu_f, norm);
  } else {
    gemv_mma<true, false, kNorm, kPipe>(out, x, codes, scales, nullptr, bias, n, k, stride_w, 0, 0, silu_f, norm);
  }
}

// kArgmax: the entries of the greedy LM head (imma_finish; no SiLU product).
template <bool kNorm, bool kMulti = false, int W = kImmaWarps, bool kArgmax = false, bool kStaged = false>
__device__ __forceinline__ void gemv_w8a16_imma(__nv_bfloat16* out, const uint4* x, const int8_t* w, const float* scales,
                                                const __nv_bfloat16* bias, int n, int k, long long stride_w, int silu_f,
                                                const NormIn* norm) {
  const uint8_t* codes = reinterpret_cast<const uint8_t*>(w);
  if constexpr (kArgmax) {
    gemv_imma<false, false, kNorm, kMulti, W, true>(out, x, codes, scales, nullptr, bias, n, k, stride_w, 0, 0, 0, norm);
  } else if (silu_f > 0) {
    gemv_imma<false, true, kNorm, kMulti, W, false, kStaged>(out, x, codes, scales, nullptr, bias, n, k, stride_w, 0, 0,
                                                             silu_f, norm);
  } else {
    gemv_imma<false, false, kNorm, kMulti, W, false, kStaged>(out, x, codes, scales, nullptr, bias, n, k, stride_w, 0, 0,
                                                              silu_f, norm);
  }
}

template <bool kNorm, bool kMulti = false, int W = kImmaWarps, bool kArgmax = false, bool kStaged = false>
__device__ __forceinline__ void gemv_int4_imma(__nv_bfloat16* out, const uint4* x, const uint8_t* w, const float* scales,
                                               const uint8_t* zeros, const __nv_bfloat16* bias, int n, int k,
                                               long long stride_w, long long stride_s, int group_shift, int silu_f,
                                               const NormIn* norm) {
  if constexpr (kArgmax) {
    gemv_imma<true, false, kNorm, kMulti, W, true>(out, x, w, scales, zeros, bias, n, k, stride_w, stride_s, group_shift,
                                                0, norm);
  } else if (silu_f > 0) {
    gemv_imma<true, true, kNorm, kMulti, W, false, kStaged>(out, x, w, scales, zeros, bias, n, k, stride_w, stride_s,
                                                            group_shift, silu_f, norm);
  } else {
    gemv_imma<true, false, kNorm, kMulti, W, false, kStaged>(out, x, w, scales, zeros, bias, n, k, stride_w, stride_s,
                                                             group_shift, silu_f, norm);
  }
}

// ---- The batch-1 int4 MLP in one kernel (forty-third session) ------------------------------------------
//
// gate/up with the SiLU product, then down, for one row whose x norm_stage staged (int4 in cuda_tile16
// with fp16 scale pairs: a MGX_IMMA_TILE16 + MGX_IMMA_HALF_SCALES build), so that down has no launch
// of its own and x is staged once a block instead of in each of down's blocks. Block b takes SiLU
// outputs 128 b .. 128 b + 127, i.e. down's 128-column step b:
// - phase 1: the 16 SiLU groups of 8 outputs (gate rows 8 j .., up rows F + 8 j ..), W / 16 warps a
//   group, from the record (copied into shared memory once a block) and the codes with their scale
//   pairs, a step as gemv_imma's staged twin computes it; the block adds up its warps' sums, applies
//   the SiLU product with transformers' roundings and keeps the 128 bf16 outputs in shared memory;
// - phase 2: each warp stages those 128 values as one imma step (imma4_stage_x) and multiplies them by
//   down's step b for its row groups (warp, warp + W, ...; DB at a time in flight, double-buffered with
//   kDB), adding each group's row sums into acc in L2.
// kFixed: acc is int64 [n + 2]: each block's share of a row rounded to a multiple of 2^-32 (|row| <
// 2^31) and added with 64-bit reductions, exact in any order, so the same bits every run; a NaN or Inf
// share sets acc[n] (norm_stage_fx then makes the row NaN). Else acc is fp32 [n] with 16-byte
// reductions whose order, and so whose last bits, vary from run to run (examples/bench_gpu_mlp.py
// times both). acc must be zero before.
// On the H200 (143rd-144th runs, examples/bench_gpu_mlp.py) the 8B decode layer chained 32 times took
// 1.613 -> 1.556 ms with <16, 2, 4, true, true> (the product's entry below), 1.609 -> 1.554 with the
// fp32 <32, 2, 2, false, false>; kernels/cuda/NOTEBOOK.md ("Forty-third session") has the rest.
// Timing knobs (`mode` bits, the results then meaningless): 1 phase 1 only, 2 phase 2 only, 4 plain
// stores instead of the reductions. `stamps` (or null): per block, %globaltimer at its start, after
// phase 1, at its end, and its SM.
// Tried on the H200 (48th session, 163rd-164th runs; e3a2164, ae3dc2e) and dropped: phase 2 shared out
// beyond block b, by a queue of items all blocks took from (the decode layer chain 1.736 against 1.577
// ms) or by giving the last row groups of every step to 10-20 extra blocks that waited for the step's
// published record (1.746-1.998 against 1.559): the counters and flags cost more than the blocks'
// imbalance and the idle SMs give back (kernels/cuda/NOTEBOOK.md, "Forty-eighth session").
// Also dropped (172nd run, 2c872e6): down's second batch asked for before the SiLU barrier too (8 tiles a
// warp in flight across it): 1.603 against 1.571 ms; phase 1 slowed by what phase 2 gained.
// And (49th session, 173rd run, 2b47034): the add + RMSNorm before the MLP in every block (norm_prologue,
// then the steps staged into the shared record; no norm_stage launch): the same bits, 1.612 / 1.616
// against 1.576 / 1.574 ms; the early-launched norm kernel costs less than the prologue on the path.
// And (177th run, f953fad): helper blocks on the 20 idle SMs taking each SiLU group's last 2 or 4 gate/up steps,
// their sums handed over by release flags: 1.716-1.802 against 1.563-1.565 ms; phase 1 looks bound by
// DRAM as a whole, not by the 112 SMs (the owners' phase 1 and hand-over no shorter than the product's).

template <int W, int U, int DB, bool kDB, bool kFixed>
__device__ void mlp_int4_fused(void* __restrict__ acc_out, const uint4* __restrict__ rec, const uint8_t* __restrict__ wgu,
                               const uint2* __restrict__ pgu, const uint8_t* __restrict__ wd,
                               const uint2* __restrict__ pd, int f, int k, int n, int groups_gu, int groups_d,
                               int group_shift, int mode, unsigned long long* __restrict__ stamps) {
  static_assert(W % 16 == 0, "16 SiLU groups a block, W / 16 warps each");
  float* acc = static_cast<float*>(acc_out);
  unsigned long long* acc_fx = static_cast<unsigned long long*>(acc_out);
  constexpr int kShare = W / 16;  // warps a SiLU group
  const auto now = [] {
    unsigned long long v;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(v));
    return v;
  };
  if (stamps != nullptr && threadIdx.x == 0) stamps[blockIdx.x * 4] = now();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int b = blockIdx.x, steps = k >> 7, steps_d = f >> 7, row_groups = n >> 4;
  __shared__ float part[W][16];
  __shared__ __align__(16) __nv_bfloat16 xs[128];
  extern __shared__ uint4 rec_s[];  // the record: steps x 32 lanes' B words, then steps float2 (factor, sum X)
  const int rec_words = steps * 32 + (steps + 1) / 2;
  uint8_t* buf = imma_buffer<W>(warp);
  reinterpret_cast<uint32_t*>(buf + imma_column(2))[lane] = 0x01010101u;  // column 2: ones (sum q)
  const int b_at = imma_column(g & 3) + 16 * t + 8 * (g >> 2);
  const ImmaLane weigh{(t & 1) ? 64 : 0, (t & 1) ? 0.0f : 1.0f, (t & 1) ? 65536.0f : 256.0f, t >= 2};
  const auto nibbles = [](uint4 v, int h) {
    constexpr uint32_t kMask = 0x0F0F0F0Fu;  // as gemv_imma's kLowNibbles
    return h == 0 ? make_uint4(v.x & kMask, v.y & kMask, v.z & kMask, v.w & kMask)
                  : make_uint4((v.x >> 4) & kMask, (v.y >> 4) & kMask, (v.z >> 4) & kMask, (v.w >> 4) & kMask);
  };
  // One step's s (sum q X - z sum X) of the lane's rows lo and hi into (acc_lo, acc_hi), as gemv_imma.
  const auto step = [&](uint4 lo, uint4 hi, uint4 bw, float factor, float sum_x, uint2 sz, float& acc_lo,
                        float& acc_hi) {
    int d[4] = {0, 0, 0, 0}, e[4] = {0, 0, 0, 0};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t b0 = h == 0 ? bw.x : bw.z, b1 = h == 0 ? bw.y : bw.w;
      mma_imma<true>(d, nibbles(lo, h), b0, b1);
      mma_imma<true>(e, nibbles(hi, h), b0, b1);
    }
    const float zx = t == 0 ? sum_x : 0.0f;
    const float2 pl = half_pair(sz.x), ph = half_pair(sz.y);
    acc_lo = fmaf(factor * pl.x, fmaf(-pl.y, zx, imma_value(d, weigh)), acc_lo);
    acc_hi = fmaf(factor * ph.x, fmaf(-ph.y, zx, imma_value(e, weigh)), acc_hi);
  };

  // ---- phase 1: SiLU group j, steps share, share + kShare, ... (U a pass, the next pass in flight)
  const int j = b * 16 + (warp & 15), share = warp >> 4;
  const auto tile_at = [&](uint32_t r0) {  // cuda_tile16: rows r0 .. r0 + 7 at step 0, the lane's 16 bytes
    return (r0 >> 4) * (static_cast<uint32_t>(steps) * 1024u) + (r0 & 15u) * 64u + 16u * lane;
  };
  const uint32_t a_lo = tile_at(8u * j), a_hi = tile_at(static_cast<uint32_t>(f) + 8u * j);
  struct Pass {
    uint4 lo[U], hi[U];
    uint2 sz[U];
  };
  const auto load_w = [&](int s0, Pass& p) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int s = s0 + u * kShare;
      const bool in = s < steps;
      const uint32_t at = static_cast<uint32_t>(s) * 1024u;
      p.lo[u] = in ? load_stream_fetch(reinterpret_cast<const uint4*>(wgu + a_lo + at)) : make_uint4(0, 0, 0, 0);
      p.hi[u] = in ? load_stream_fetch(reinterpret_cast<const uint4*>(wgu + a_hi + at)) : make_uint4(0, 0, 0, 0);
      const uint32_t grp = (static_cast<uint32_t>(s) << 7) >> group_shift;
      p.sz[u] = in ? load_now(pgu + (static_cast<uint32_t>(j) * groups_gu + grp) * 8u + g)
                   : make_uint2(kIdleHalves, kIdleHalves);
    }
  };
  float acc_lo = 0.0f, acc_hi = 0.0f;
  Pass even, odd;
  constexpr int kStride = U * kShare;  // steps a warp's pass advances
  int s = (mode & 2) ? steps : share;
  load_w(s, even);  // the codes are no kernel's output: before the wait
  mgx_pdl_wait();   // the record is the norm's
  for (int i = threadIdx.x; i < rec_words; i += blockDim.x) rec_s[i] = x_oct<false>(rec, i);
  __syncthreads();
  const float2* fs_s = reinterpret_cast<const float2*>(rec_s + steps * 32);
  const auto compute = [&](int s0, const Pass& p) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int st = s0 + u * kShare;
      if (st >= steps) break;
      const float2 fs = fs_s[st];
      step(p.lo[u], p.hi[u], rec_s[st * 32 + lane], fs.x, fs.y, p.sz[u], acc_lo, acc_hi);
    }
  };
  while (s < steps) {
    load_w(s + kStride, odd);
    compute(s, even);
    s += kStride;
    if (s >= steps) break;
    load_w(s + kStride, even);
    compute(s, odd);
    s += kStride;
  }
#pragma unroll
  for (int o = 1; o < 4; o <<= 1) {  // the quad's lanes
    acc_lo += __shfl_xor_sync(0xFFFFFFFFu, acc_lo, o);
    acc_hi += __shfl_xor_sync(0xFFFFFFFFu, acc_hi, o);
  }
  if (t == 0) {
    part[warp][g] = acc_lo;  // gate row 8 j + g
    part[warp][g + 8] = acc_hi;  // its up row
  }

  // ---- phase 2: down's step b for row groups warp, warp + W, ...
  struct Down {
    uint4 lo, hi;
    uint2 sz;
  };
  const uint32_t grp_d = (static_cast<uint32_t>(b) << 7) >> group_shift;
  const auto load_d = [&](int i0, Down (&dd)[DB]) {
#pragma unroll
    for (int u = 0; u < DB; ++u) {
      const int rg = warp + W * (i0 + u);
      const bool in = rg < row_groups && !(mode & 1);
      const uint32_t at = (static_cast<uint32_t>(rg) * steps_d + b) * 1024u + 16u * lane;
      dd[u].lo = in ? load_stream_fetch(reinterpret_cast<const uint4*>(wd + at)) : make_uint4(0, 0, 0, 0);
      dd[u].hi = in ? load_stream_fetch(reinterpret_cast<const uint4*>(wd + at + 512u)) : make_uint4(0, 0, 0, 0);
      dd[u].sz = in ? load_now(pd + (static_cast<uint32_t>(rg) * groups_d + grp_d) * 8u + g)
                    : make_uint2(kIdleHalves, kIdleHalves);
    }
  };
  Down dn[DB], dn2[kDB ? DB : 1];
  load_d(0, dn);  // on their way while the block adds up its SiLU outputs
  __syncthreads();
  if (stamps != nullptr && threadIdx.x == 0) {
    unsigned sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    stamps[blockIdx.x * 4 + 1] = now();
    stamps[blockIdx.x * 4 + 3] = sm;
  }
  if (threadIdx.x < 128) {
    const int jl = threadIdx.x >> 3, r = threadIdx.x & 7;
    float gate = 0.0f, up = 0.0f;
#pragma unroll
    for (int h = 0; h < kShare; ++h) {
      gate += part[jl + 16 * h][r];
      up += part[jl + 16 * h][r + 8];
    }
    xs[threadIdx.x] = __float2bfloat16_rn(silu_times(gate, up));
  }
  __syncthreads();
  if (mode & 1) {  // phase 1 only: something for the compiler to keep
    if (threadIdx.x < 128) {
      if constexpr (kFixed) {
        acc_fx[(b * 128 + threadIdx.x) % n] = __bfloat16_as_ushort(xs[threadIdx.x]);
      } else {
        acc[(b * 128 + threadIdx.x) % n] = __bfloat162float(xs[threadIdx.x]);
      }
    }
    return;
  }
  float sum_x;
  const float factor = imma4_stage_x(buf, x_oct<true>(reinterpret_cast<const uint4*>(xs), lane >> 1), lane, sum_x);
  const uint2 c0 = *reinterpret_cast<const uint2*>(buf + b_at), c1 = *reinterpret_cast<const uint2*>(buf + b_at + 64);
  const uint4 bw = make_uint4(c0.x, c0.y, c1.x, c1.y);
  // Row group rg's 16 sums into acc: rows 4 q .. 4 q + 3 gathered in lane q < 4 (rows r < 8 are lane 4
  // r's lo, rows r >= 8 lane 4 (r - 8)'s hi), one 16-byte reduction each.
  const auto put = [&](int rg, float lo, float hi) {
#pragma unroll
    for (int o = 1; o < 4; o <<= 1) {
      lo += __shfl_xor_sync(0xFFFFFFFFu, lo, o);
      hi += __shfl_xor_sync(0xFFFFFFFFu, hi, o);
    }
    if constexpr (kFixed) {  // rows g and g + 8 from lane (g, 0), as 64-bit integers of 2^-32
      if (t == 0 && rg < row_groups) {
        const auto fx = [](float v) { return static_cast<unsigned long long>(__float2ll_rn(v * 4294967296.0f)); };
        if (!isfinite(lo) || !isfinite(hi)) atomicOr(acc_fx + n, 1ull);  // the row's flag: NaN downstream
        if (mode & 4) {
          acc_fx[16 * rg + g] = fx(lo);
          acc_fx[16 * rg + g + 8] = fx(hi);
        } else {
          atomicAdd(acc_fx + 16 * rg + g, fx(lo));
          atomicAdd(acc_fx + 16 * rg + g + 8, fx(hi));
        }
      }
      return;
    }
    const int q = lane & 3;
    float v[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int src = 4 * (4 * (q & 1) + i);
      const float a = __shfl_sync(0xFFFFFFFFu, lo, src), c = __shfl_sync(0xFFFFFFFFu, hi, src);
      v[i] = q < 2 ? a : c;
    }
    if (lane < 4 && rg < row_groups) {
      float4* at = reinterpret_cast<float4*>(acc + 16 * rg) + q;
      if (mode & 4) {
        *at = make_float4(v[0], v[1], v[2], v[3]);
      } else {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
        __trap();  // 16-byte fp32 reductions need sm_90 (the product's entry is kFixed)
#else
        atomicAdd(at, make_float4(v[0], v[1], v[2], v[3]));
#endif
      }
    }
  };
  const auto compute_d = [&](int i0, const Down (&dd)[DB]) {
#pragma unroll
    for (int u = 0; u < DB; ++u) {
      float lo = 0.0f, hi = 0.0f;
      step(dd[u].lo, dd[u].hi, bw, factor, sum_x, dd[u].sz, lo, hi);
      put(warp + W * (i0 + u), lo, hi);
    }
  };
  const int per_warp = (row_groups + W - 1) / W;
  if constexpr (kDB) {
    for (int i0 = 0; i0 < per_warp; i0 += 2 * DB) {
      if (i0 + DB < per_warp) load_d(i0 + DB, dn2);
      compute_d(i0, dn);
      if (i0 + DB >= per_warp) break;
      if (i0 + 2 * DB < per_warp) load_d(i0 + 2 * DB, dn);
      compute_d(i0 + DB, dn2);
    }
  } else {
    for (int i0 = 0; i0 < per_warp; i0 += DB) {
      compute_d(i0, dn);
      if (i0 + DB < per_warp) load_d(i0 + DB, dn);
    }
  }
  if (stamps != nullptr) {
    __syncthreads();
    if (threadIdx.x == 0) stamps[blockIdx.x * 4 + 2] = now();
  }
}

}  // namespace mgx_gemv

// Each GEMV has two entry points: NAME(out, x, ...) reads x [K]; NAME_norm(out, res_out, res, delta,
// g, eps, ...) multiplies rms_norm(res + delta) * g instead (NormIn; 2K bytes of dynamic shared
// memory, K <= MAX_NORM_K in gemv.py) and writes res + delta to res_out when delta is given. The remaining
// parameters are the same; a _norm grid may be smaller than the number of output groups.
// MGX_GEMV_ENTRIES_WITH passes FN template arguments after kNorm: FLAGS is (, a, ...) or ().
#define MGX_UNPAREN(...) __VA_ARGS__
#define MGX_GEMV_ENTRIES(NAME, THREADS, FN, PARAMS, ARGS) MGX_GEMV_ENTRIES_WITH(NAME, THREADS, FN, (), PARAMS, ARGS)
#define MGX_GEMV_ENTRIES_WITH(NAME, THREADS, FN, FLAGS, PARAMS, ARGS)                                              \
  extern "C" __global__ void __launch_bounds__(THREADS)                                                           \
      MGX_ENTRY(NAME)(__nv_bfloat16* out, const __nv_bfloat16* x, MGX_UNPAREN PARAMS) {                           \
    mgx_gemv::FN<false MGX_UNPAREN FLAGS>(out, reinterpret_cast<const uint4*>(x), MGX_UNPAREN ARGS, nullptr);     \
  }                                                                                                               \
  extern "C" __global__ void __launch_bounds__(THREADS)                                                           \
      MGX_ENTRY(NAME##_norm)(__nv_bfloat16* out, __nv_bfloat16* res_out, const __nv_bfloat16* res,                \
                             const __nv_bfloat16* delta, const __nv_bfloat16* g, float eps, MGX_UNPAREN PARAMS) { \
    extern __shared__ uint4 xs[];                                                                                 \
    const mgx_gemv::NormIn in{res, delta, g, res_out, eps};                                                       \
    mgx_gemv::FN<true MGX_UNPAREN FLAGS>(out, xs, MGX_UNPAREN ARGS, &in);                                         \
  }

// The parameters after (out, x) of the int4 and W8A16 entries (every kind of a scheme takes the same).
#define MGX_INT4_PARAMS                                                                                      \
  (const uint8_t* w, const float* scales, const uint8_t* zeros, const __nv_bfloat16* bias, int n, int k, \
   long long stride_w, long long stride_s, int group_shift, int silu_f)
#define MGX_INT4_ARGS (w, scales, zeros, bias, n, k, stride_w, stride_s, group_shift, silu_f)
#define MGX_W8A16_PARAMS \
  (const int8_t* w, const float* scales, const __nv_bfloat16* bias, int n, int k, long long stride_w, int silu_f)
#define MGX_W8A16_ARGS (w, scales, bias, n, k, stride_w, silu_f)

// out [N] (or [F] with silu_f = F > 0, W holding 2F rows: gate then up) from x [K]; bias [N] or null;
// zeros null for symmetric int4; stride_w in bytes. Grid: ceil(outputs / 4) blocks (2 with silu_f) of blockDim.x threads.
MGX_GEMV_ENTRIES(mgx_gemv_int4_bf16, mgx_gemv::kMaxThreads, gemv_int4,
                 MGX_INT4_PARAMS, MGX_INT4_ARGS)

MGX_GEMV_ENTRIES(mgx_gemv_w8a16_bf16, mgx_gemv::kMaxThreads, gemv_w8a16,
                 MGX_W8A16_PARAMS, MGX_W8A16_ARGS)

MGX_GEMV_ENTRIES(mgx_gemv_bf16_bf16, mgx_gemv::kMaxThreads, gemv_bf16,
                 (const __nv_bfloat16* w, const __nv_bfloat16* bias, int n, int k, long long stride_w, int silu_f),
                 (w, bias, n, k, stride_w, silu_f))

// The tensor-core int4 GEMV: groups of a multiple of 128, K % 128 == 0, 16-byte aligned rows. Grid:
// ceil(outputs / 16) blocks (8 with silu_f) of kMmaWarps warps.
MGX_GEMV_ENTRIES(mgx_gemv_int4_mma_bf16, mgx_gemv::kMmaWarps * 32, gemv_int4_tc,
                 MGX_INT4_PARAMS, MGX_INT4_ARGS)

// The same, pipelined (kPipe true): kind mma_pipelined.
MGX_GEMV_ENTRIES_WITH(mgx_gemv_int4_mma_pipe_bf16, mgx_gemv::kMmaWarps * 32, gemv_int4_tc, (, true),
                 MGX_INT4_PARAMS, MGX_INT4_ARGS)

// The tensor-core W8A16 GEMV (kinds mma, mma_persistent) and its pipelined twin (mma_pipelined): K %
// 128 == 0, 16-byte aligned rows; grid and blocks as the int4 ones.
MGX_GEMV_ENTRIES(mgx_gemv_w8a16_mma_bf16, mgx_gemv::kMmaWarps * 32, gemv_w8a16_tc,
                 MGX_W8A16_PARAMS, MGX_W8A16_ARGS)

MGX_GEMV_ENTRIES_WITH(mgx_gemv_w8a16_mma_pipe_bf16, mgx_gemv::kMmaWarps * 32, gemv_w8a16_tc, (, true),
                 MGX_W8A16_PARAMS, MGX_W8A16_ARGS)

// W8A16 on the integer tensor cores (kind imma): K % 128 == 0, 16-byte aligned rows; grid and blocks
// as the other tensor-core GEMVs.
MGX_GEMV_ENTRIES(mgx_gemv_w8a16_imma_bf16, mgx_gemv::kImmaWarps * 32, gemv_w8a16_imma,
                 MGX_W8A16_PARAMS, MGX_W8A16_ARGS)

// int4 on the integer tensor cores (kind imma): groups of a multiple of 128, K % 128 == 0, 16-byte
// aligned rows; grid and blocks as the other tensor-core GEMVs.
MGX_GEMV_ENTRIES(mgx_gemv_int4_imma_bf16, mgx_gemv::kImmaWarps * 32, gemv_int4_imma,
                 MGX_INT4_PARAMS, MGX_INT4_ARGS)

// Kind imma_persistent's entries: the same kernels for blocks that take several output groups, each
// warp keeping its staged x from the first for the others (ImmaCache). Grid: at most
// IMMA_BLOCKS_PER_SM blocks an SM, each an equal share of the groups (gemv.py).
MGX_GEMV_ENTRIES_WITH(mgx_gemv_w8a16_imma_multi_bf16, mgx_gemv::kImmaWarps * 32, gemv_w8a16_imma, (, true),
                 MGX_W8A16_PARAMS, MGX_W8A16_ARGS)

MGX_GEMV_ENTRIES_WITH(mgx_gemv_int4_imma_multi_bf16, mgx_gemv::kImmaWarps * 32, gemv_int4_imma, (, true),
                 MGX_INT4_PARAMS, MGX_INT4_ARGS)

// Kinds imma_w4 and imma_w16: kind imma's kernels on blocks of 4 and 16 warps (a group's steps split
// over fewer or more warps: other sums' order, so not imma's bits). On the H200 (cold L2, 2026-12-01)
// 4 warps took int4 gate/up 28672 x 4096 from 32.2 to 28.8 us and 16 warps int4 4096 x 14336 from
// 21.4 to 19.3 us; the autotune pass times all three.
MGX_GEMV_ENTRIES_WITH(mgx_gemv_w8a16_imma4_bf16, 4 * 32, gemv_w8a16_imma, (, false, 4),
                 MGX_W8A16_PARAMS, MGX_W8A16_ARGS)

MGX_GEMV_ENTRIES_WITH(mgx_gemv_int4_imma4_bf16, 4 * 32, gemv_int4_imma, (, false, 4),
                 MGX_INT4_PARAMS, MGX_INT4_ARGS)

MGX_GEMV_ENTRIES_WITH(mgx_gemv_w8a16_imma16_bf16, 16 * 32, gemv_w8a16_imma, (, false, 16),
                 MGX_W8A16_PARAMS, MGX_W8A16_ARGS)

MGX_GEMV_ENTRIES_WITH(mgx_gemv_int4_imma16_bf16, 16 * 32, gemv_int4_imma, (, false, 16),
                 MGX_INT4_PARAMS, MGX_INT4_ARGS)

// Kind imma_persistent_w4: imma_w4's kernels for blocks that take several output groups, each warp
// keeping its staged x from the first for the others (ImmaCache: all of it up to K = 4096), on
// IMMA_W4_BLOCKS_PER_SM blocks an SM in equal shares (gemv.py). The same sums as imma_w4, so its bits.
MGX_GEMV_ENTRIES_WITH(mgx_gemv_w8a16_imma4_multi_bf16, 4 * 32, gemv_w8a16_imma, (, true, 4),
                 MGX_W8A16_PARAMS, MGX_W8A16_ARGS)

MGX_GEMV_ENTRIES_WITH(mgx_gemv_int4_imma4_multi_bf16, 4 * 32, gemv_int4_imma, (, true, 4),
                 MGX_INT4_PARAMS, MGX_INT4_ARGS)

// The greedy LM head on the imma kinds (kArgmax): NAME(part, x, ...) with the scheme's parameters
// (silu_f ignored) writes each output group's largest logit to part[b] (fp32) and its row to
// ((int*)part)[groups + b], groups = ceil(n / 16); a second kernel (lm_head.py) takes the row's
// argmax over them. The logits never reach memory. Grids as the kinds' plain entries.
#define MGX_ARGMAX_ENTRY(NAME, THREADS, FN, FLAGS, PARAMS, ARGS)                                                    \
  extern "C" __global__ void __launch_bounds__(THREADS)                                                           \
      MGX_ENTRY(NAME)(float* part, const __nv_bfloat16* x, MGX_UNPAREN PARAMS) {                                  \
    mgx_gemv::FN<false MGX_UNPAREN FLAGS>(reinterpret_cast<__nv_bfloat16*>(part), reinterpret_cast<const uint4*>(x), \
                                         MGX_UNPAREN ARGS, nullptr);                                              \
  }

MGX_ARGMAX_ENTRY(mgx_gemv_int4_imma_argmax, mgx_gemv::kImmaWarps * 32, gemv_int4_imma, (, false, mgx_gemv::kImmaWarps, true),
                 MGX_INT4_PARAMS, MGX_INT4_ARGS)
MGX_ARGMAX_ENTRY(mgx_gemv_int4_imma_multi_argmax, mgx_gemv::kImmaWarps * 32, gemv_int4_imma,
                 (, true, mgx_gemv::kImmaWarps, true), MGX_INT4_PARAMS, MGX_INT4_ARGS)
MGX_ARGMAX_ENTRY(mgx_gemv_int4_imma4_argmax, 4 * 32, gemv_int4_imma, (, false, 4, true), MGX_INT4_PARAMS, MGX_INT4_ARGS)
MGX_ARGMAX_ENTRY(mgx_gemv_int4_imma16_argmax, 16 * 32, gemv_int4_imma, (, false, 16, true), MGX_INT4_PARAMS, MGX_INT4_ARGS)
MGX_ARGMAX_ENTRY(mgx_gemv_int4_imma4_multi_argmax, 4 * 32, gemv_int4_imma, (, true, 4, true), MGX_INT4_PARAMS,
                 MGX_INT4_ARGS)
MGX_ARGMAX_ENTRY(mgx_gemv_w8a16_imma_argmax, mgx_gemv::kImmaWarps * 32, gemv_w8a16_imma,
                 (, false, mgx_gemv::kImmaWarps, true), MGX_W8A16_PARAMS, MGX_W8A16_ARGS)
MGX_ARGMAX_ENTRY(mgx_gemv_w8a16_imma_multi_argmax, mgx_gemv::kImmaWarps * 32, gemv_w8a16_imma,
                 (, true, mgx_gemv::kImmaWarps, true), MGX_W8A16_PARAMS, MGX_W8A16_ARGS)
MGX_ARGMAX_ENTRY(mgx_gemv_w8a16_imma4_argmax, 4 * 32, gemv_w8a16_imma, (, false, 4, true), MGX_W8A16_PARAMS,
                 MGX_W8A16_ARGS)
MGX_ARGMAX_ENTRY(mgx_gemv_w8a16_imma16_argmax, 16 * 32, gemv_w8a16_imma, (, false, 16, true), MGX_W8A16_PARAMS,
                 MGX_W8A16_ARGS)
MGX_ARGMAX_ENTRY(mgx_gemv_w8a16_imma4_multi_argmax, 4 * 32, gemv_w8a16_imma, (, true, 4, true), MGX_W8A16_PARAMS,
                 MGX_W8A16_ARGS)

// x staged once (kStaged; kinds imma_staged, imma_w4_staged, imma_w16_staged in gemv.py): NAME(rec, x, k)
// writes x [K]'s ImmaStaged record (K % 128 == 0; rec 16-byte aligned, K / 128 * 520 bytes) on
// ceil(K / 128 / kStageWarps) blocks of kStageWarps warps; the staged GEMVs take the record where the
// others take x, with their kinds' parameters, grids and blocks, and give those kinds' bits. No
// prologue and no greedy-head entries.
#define MGX_STAGE_ENTRY(NAME, INT4)                                                                          \
  extern "C" __global__ void __launch_bounds__(mgx_gemv::kStageWarps * 32)                                  \
      MGX_ENTRY(NAME)(uint4* rec, const __nv_bfloat16* x, int k) {                                          \
    mgx_gemv::imma_stage_rows<INT4>(rec, reinterpret_cast<const uint4*>(x), k);                             \
  }
MGX_STAGE_ENTRY(mgx_imma_stage_int4, true)
MGX_STAGE_ENTRY(mgx_imma_stage_w8a16, false)

// At most 64 registers a thread, as the kinds' own entries take (more would lose a block an SM: the
// record's registers took imma to 74 and imma16 to 72 unbounded).
#define MGX_STAGED_ENTRY(NAME, THREADS, FN, FLAGS, PARAMS, ARGS)                                              \
  extern "C" __global__ void __launch_bounds__(THREADS, 65536 / (64 * (THREADS)))                          \
      MGX_ENTRY(NAME)(__nv_bfloat16* out, const uint4* rec, MGX_UNPAREN PARAMS) {                           \
    mgx_gemv::FN<false MGX_UNPAREN FLAGS>(out, rec, MGX_UNPAREN ARGS, nullptr);                             \
  }

MGX_STAGED_ENTRY(mgx_gemv_int4_imma_staged_bf16, mgx_gemv::kImmaWarps * 32, gemv_int4_imma,
                 (, false, mgx_gemv::kImmaWarps, false, true), MGX_INT4_PARAMS, MGX_INT4_ARGS)
MGX_STAGED_ENTRY(mgx_gemv_int4_imma4_staged_bf16, 4 * 32, gemv_int4_imma, (, false, 4, false, true), MGX_INT4_PARAMS,
                 MGX_INT4_ARGS)
MGX_STAGED_ENTRY(mgx_gemv_int4_imma16_staged_bf16, 16 * 32, gemv_int4_imma, (, false, 16, false, true), MGX_INT4_PARAMS,
                 MGX_INT4_ARGS)
MGX_STAGED_ENTRY(mgx_gemv_w8a16_imma_staged_bf16, mgx_gemv::kImmaWarps * 32, gemv_w8a16_imma,
                 (, false, mgx_gemv::kImmaWarps, false, true), MGX_W8A16_PARAMS, MGX_W8A16_ARGS)
MGX_STAGED_ENTRY(mgx_gemv_w8a16_imma4_staged_bf16, 4 * 32, gemv_w8a16_imma, (, false, 4, false, true), MGX_W8A16_PARAMS,
                 MGX_W8A16_ARGS)
MGX_STAGED_ENTRY(mgx_gemv_w8a16_imma16_staged_bf16, 16 * 32, gemv_w8a16_imma, (, false, 16, false, true),
                 MGX_W8A16_PARAMS, MGX_W8A16_ARGS)

// The RMSNorm that also stages its output for the staged GEMVs (norm_stage_row): NAME(out, res_out, res,
// delta, g, eps, rec, k) on any number of blocks (they split the steps) of up to kMaxThreads threads
// with 2K bytes of dynamic shared memory (K % 128 == 0, K <= MAX_NORM_K in gemv.py; delta null: none,
// and then res_out unused).
#define MGX_NORM_STAGE_ENTRY(NAME, INT4)                                                                     \
  extern "C" __global__ void __launch_bounds__(mgx_gemv::kMaxThreads)                                       \
      MGX_ENTRY(NAME)(__nv_bfloat16* out, __nv_bfloat16* res_out, const __nv_bfloat16* res,                 \
                      const __nv_bfloat16* delta, const __nv_bfloat16* g, float eps, uint4* rec, int k) {   \
    const mgx_gemv::NormIn in{res, delta, g, res_out, eps};                                                  \
    mgx_gemv::norm_stage_row<INT4>(out, rec, in, k);                                                         \
  }
MGX_NORM_STAGE_ENTRY(mgx_norm_stage_int4, true)
MGX_NORM_STAGE_ENTRY(mgx_norm_stage_w8a16, false)

// The same for int4 after the fused MLP (mlp_int4_fused): delta is its fixed-point row [K + 2] (never
// null; gemv.py's norm_stage_fx).
extern "C" __global__ void __launch_bounds__(mgx_gemv::kMaxThreads)
    MGX_ENTRY(mgx_norm_stage_fx_int4)(__nv_bfloat16* out, __nv_bfloat16* res_out, const __nv_bfloat16* res,
                                      const long long* delta, const __nv_bfloat16* g, float eps, uint4* rec, int k) {
  const mgx_gemv::NormIn in{res, nullptr, g, res_out, eps};
  mgx_gemv::norm_stage_row<true, true>(out, rec, in, k, delta);
}

// The fused batch-1 int4 MLP (mlp_int4_fused): acc [n + 2] int64 (zero before) += down(silu(gate) * up)
// of the row whose record rec is (norm_stage's, K columns); wgu [2F, K] and wd [n, F] int4 in
// cuda_tile16 with groups of 1 << group_shift columns (a multiple of 128), pgu and pd their scale
// pairs (gemv.scale_pairs; pgu in the SiLU product's order) with groups_gu and groups_d groups a row.
// Grid: F / 128 blocks of W warps; dynamic shared memory: the record (rounded up to 16 bytes; over 48
// KB needs the attribute). F and K multiples of 128, n of 16. The macro is examples/mlp_fused.cu's too.
#define MGX_MLP_ENTRY_NAMED(NAME, W, U, DB, DBUF, FX)                                                          \
  extern "C" __global__ void __launch_bounds__(W * 32, 1) MGX_ENTRY(NAME)(                                   \
      void* acc, const uint8_t* rec, const uint8_t* wgu, const uint2* pgu, const uint8_t* wd, const uint2* pd, \
      int f, int k, int n, int groups_gu, int groups_d, int group_shift, int mode, unsigned long long* stamps) { \
    mgx_gemv::mlp_int4_fused<W, U, DB, DBUF, FX>(acc, reinterpret_cast<const uint4*>(rec), wgu, pgu, wd, pd, f, k, \
                                                 n, groups_gu, groups_d, group_shift, mode, stamps);            \
  }
#if MGX_IMMA_TILE16 && MGX_IMMA_HALF_SCALES
MGX_MLP_ENTRY_NAMED(mgx_mlp_int4_fused, 16, 2, 4, true, true)
#endif

// Markers of the builds (gemv.py: which layout and scale table the imma kinds read).
#if MGX_IMMA_HALF_SCALES
extern "C" __global__ void MGX_ENTRY(mgx_imma_half_scales)() {}
#endif
#if MGX_IMMA_TILE16
extern "C" __global__ void MGX_ENTRY(mgx_imma_tile16)() {}
#endif
