// Paged decode attention for one bf16 query row per sequence (sm_90 and newer), the contract of
// kernels/triton/attention.py: key position j of sequence s is at cache slot
// table[s, j / page] * page + j % page of a [slots, HK, D] bf16 cache; the query sits at ctx - 1 and
// sees keys j in [lo, ctx), lo = max(ctx - window, 0) with a sliding window (else 0). Query head
// h * G + g reads kv head h.
//
// One thread-block cluster per (sequence, kv head): its C blocks cut the context into C pieces and
// each keeps the G query rows' partial softmax (max, sum, weighted values) of its piece in shared
// memory; after a cluster barrier every block merges a share of the outputs from all C blocks'
// shared memory (distributed shared memory), so no piece goes through global memory and no
// arrival counter is needed (the Triton kernel's self-merge takes a release/acquire round trip to
// L2 and then reads the partials back from it).
//
// A block of 256 threads takes its piece 128 tokens at a time. For scores two threads hold a token's
// key row, 64 dims each; for values a thread holds 8 dims of 8 tokens (16 dim groups x 16 token
// groups): 64 registers of cache a thread. (Threads of a whole key row and 16 tokens' values, 128
// a block, took 255 registers, and nvcc then rebuilt shared-memory addresses before every load:
// 11 us a launch on the H200 where the Triton kernel takes 5.5.) With RoPE fused, the first tile's
// pages, keys and values, and the angles, are read before griddepcontrol.wait: they are not the
// previous kernel's output (the backend fills the tables before a step's first kernel).
//
// With rot > 0 the query is rotated here (rotate-half RoPE of its first rot dims at position ctx - 1,
// with transformers' bf16 roundings, as rope.py's _rotate) and this step's k (rotated) and v are
// written into the cache slot of ctx - 1 by the block whose piece holds it, which also uses them in
// place of what its registers read from that slot before the wait.
//
// Scores, softmax and the weighted sums are fp32 (exp2 of log2-scaled scores); one rounding to bf16
// ends it.

#include <cuda_bf16.h>
#include <stdint.h>

#include "mgx_abi.cuh"

namespace mgx_attn {

constexpr int kD = 128;                         // head dim
constexpr int kThreads = 256;                   // threads per block
constexpr int kTile = 128;                      // tokens a block takes at a time
constexpr int kWarps = kThreads / 32;
constexpr int kHalf = kD / 2;                   // key dims a thread holds
constexpr int kQHalf = kHalf + 4;               // a query half-row in shared memory, padded off the other half's banks
constexpr int kOcts = kD / 8;                   // value dims a thread holds: one 16-byte word of 8
constexpr int kGroups = kThreads / kOcts;       // 16 token groups for the values
constexpr int kPerGroup = kTile / kGroups;      // 8 tokens each
constexpr int kMaxCluster = 16;

__device__ __forceinline__ float bf16_round(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

__device__ __forceinline__ float2 bf2(uint32_t w) {
  __nv_bfloat162 b = *reinterpret_cast<__nv_bfloat162*>(&w);
  return __bfloat1622float2(b);
}

__device__ __forceinline__ uint4 pack8(const float* f) {
  __nv_bfloat162 w[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) w[j] = __floats2bfloat162_rn(f[2 * j], f[2 * j + 1]);
  return *reinterpret_cast<uint4*>(w);
}

// The cluster, in PTX (no generic pointers into shared memory).
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

__device__ __forceinline__ uint32_t cluster_blocks() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(r));
  return r;
}

// Every thread of the cluster arrives (its shared-memory writes released) and waits for all (acquired).
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// The float at `local` (this block's shared memory) in block `rank` of the cluster.
__device__ __forceinline__ float load_from_block(const float* local, uint32_t rank) {
  const uint32_t here = static_cast<uint32_t>(__cvta_generic_to_shared(local));
  uint32_t there;
  float v;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(there) : "r"(here), "r"(rank));
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(there) : "memory");
  return v;
}

template <int MAXG>
struct Shared {
  float q[MAXG][2][kQHalf];        // the rotated query rows, by halves
  float p[MAXG][kTile];            // the tile's probabilities
  float red[kWarps][MAXG][kD];     // the value sums of each warp's two token groups; red[0]: the piece's
  float wmax[kWarps][MAXG];
  float wsum[kWarps][MAXG];
  float m[MAXG], l[MAXG];          // the piece's maxima and sums, for the merge
  int slot[kTile];                 // the tile's cache slots
  float knew[kD], vnew[kD];        // this step's k (rotated) and v, as bf16 values
};

// This thread's share of the tile at `tile` (positions before `end`): half a key row, and 8 dims of
// 8 tokens' values (zeros past `end`).
template <int MAXG>
__device__ __forceinline__ void load_tile(const __nv_bfloat16* kc, const __nv_bfloat16* vc, const int* table,
                                          int tile, int end, int page, int hk, int h, Shared<MAXG>& sh,
                                          uint4 (&k)[kHalf / 8], uint4 (&v)[kPerGroup]) {
  const int t = threadIdx.x, kt = t >> 1, kh = t & 1;
  const int pos = tile + kt;
  const int sl = pos < end ? table[pos / page] * page + pos % page : -1;
  if (kh == 0) sh.slot[kt] = sl;
  const uint4* row = reinterpret_cast<const uint4*>(kc + ((size_t)max(sl, 0) * hk + h) * kD + kh * kHalf);
#pragma unroll
  for (int i = 0; i < kHalf / 8; ++i) k[i] = sl >= 0 ? row[i] : make_uint4(0, 0, 0, 0);
  __syncthreads();
  const int oct = t % kOcts, grp = t / kOcts;
#pragma unroll
  for (int j = 0; j < kPerGroup; ++j) {
    const int s = sh.slot[grp * kPerGroup + j];
    v[j] = s >= 0 ? reinterpret_cast<const uint4*>(vc + ((size_t)s * hk + h) * kD)[oct] : make_uint4(0, 0, 0, 0);
  }
}

// Rotate-half RoPE of dim d of a head row at `x` (rope.py's _rotate roundings), as a bf16 value.
__device__ __forceinline__ float rotate(const __nv_bfloat16* x, int d, int rot, float c, float s) {
  const float v = __bfloat162float(x[d]);
  if (d >= rot) return v;
  const int half = rot / 2;
  const bool first = d < half;
  const float partner = __bfloat162float(x[first ? d + half : d - half]);
  const float turned = bf16_round(v * c) + bf16_round((first ? -partner : partner) * s);
  return bf16_round(turned);
}

// cos and sin of dim d's angle at position pos, scaled and rounded as rope.py's (1, 0 past rot).
__device__ __forceinline__ float2 angle_of(const float* inv_freq, int pos, int d, int rot, float scaling) {
  if (d >= rot) return make_float2(1.0f, 0.0f);
  const int half = rot / 2;
  const float angle = (float)pos * inv_freq[d < half ? d : d - half];
  return make_float2(bf16_round(cosf(angle) * scaling), bf16_round(sinf(angle) * scaling));
}

template <int MAXG>
__device__ __forceinline__ void decode(
    __nv_bfloat16* __restrict__ out, const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k_new,
    const __nv_bfloat16* __restrict__ v_new, __nv_bfloat16* kc, __nv_bfloat16* vc, const int* __restrict__ table,
    const int* __restrict__ ctx_lens, const float* __restrict__ inv_freq, float attention_scaling, float scale_log2,
    long long stride_q, long long stride_k, long long stride_v, long long stride_o, long long stride_bt, int hk,
    int g_count, int page, int window, int rot) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  __shared__ Shared<MAXG> sh;
  const int rank = (int)cluster_rank();
  const int pieces = (int)cluster_blocks();
  const int t = threadIdx.x, lane = t % 32, warp = t / 32;
  const int kt = t >> 1, kh = t & 1;          // key role: token, half
  const int oct = t % kOcts, grp = t / kOcts; // value role: dims, token group
  const int h = blockIdx.y;
  const long long seq = blockIdx.z;
  const int* row_table = table + seq * stride_bt;

  const int ctx = ctx_lens[seq];
  const int lo = window > 0 ? max(ctx - window, 0) : 0;
  const int chunk = (ctx - lo + pieces - 1) / pieces;
  const int start = lo + rank * chunk;
  const int end = min(start + chunk, ctx);

  // Without RoPE here the kernel before wrote this step's k and v into the cache: wait for it first.
  if (rot == 0) mgx_pdl_wait();
  uint4 kreg[kHalf / 8], vreg[kPerGroup];
  if (start < end) load_tile(kc, vc, row_table, start, end, page, hk, h, sh, kreg, vreg);
  const int last = ctx - 1;
  const int d = t % kD;
  const float2 cs = angle_of(inv_freq, last, d, rot, attention_scaling);  // no kernel's output either
  if (rot > 0) mgx_pdl_wait();

  // The query rows (rotated), and this step's k and v where the piece holds ctx - 1.
  const bool holds_last = rot > 0 && start <= last && last < end;
  {
    const __nv_bfloat16* qrow = q + seq * stride_q + (long long)h * g_count * kD;
#pragma unroll
    for (int g = t / kD; g < MAXG; g += kThreads / kD) {
      if (g < g_count)
        sh.q[g][d / kHalf][d % kHalf] = rot > 0 ? rotate(qrow + g * kD, d, rot, cs.x, cs.y) : __bfloat162float(qrow[g * kD + d]);
    }
    if (holds_last && t < kD) {
      const float kv = rotate(k_new + seq * stride_k + h * kD, d, rot, cs.x, cs.y);
      const __nv_bfloat16 vv = v_new[seq * stride_v + h * kD + d];
      const size_t dst = ((size_t)(row_table[last / page] * page + last % page) * hk + h) * kD + d;
      kc[dst] = __float2bfloat16_rn(kv);
      vc[dst] = vv;
      sh.knew[d] = kv;
      sh.vnew[d] = __bfloat162float(vv);
    }
  }
  // The running softmax: maxima (the same in every thread), this thread's token's share of the sums,
  // and its value dims' weighted sums.
  float m_run[MAXG], l_part[MAXG], acc[MAXG][8];
#pragma unroll
  for (int g = 0; g < MAXG; ++g) {
    m_run[g] = -INFINITY;
    l_part[g] = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[g][i] = 0.0f;
  }
  __syncthreads();

  for (int tile = start; tile < end; tile += kTile) {
    if (tile != start) {
      __syncthreads();  // the previous tile's slots and probabilities are read
      load_tile(kc, vc, row_table, tile, end, page, hk, h, sh, kreg, vreg);
    }
    const int n = min(kTile, end - tile);
    const int at = holds_last ? last - tile : -1;  // this step's token in the tile, or out of it
    if (at == kt) {
#pragma unroll
      for (int i = 0; i < kHalf / 8; ++i) kreg[i] = pack8(&sh.knew[kh * kHalf + 8 * i]);
    }
    if (at >= 0 && at < kTile && at / kPerGroup == grp) {
      const uint4 w = pack8(&sh.vnew[8 * oct]);
      const int jl = at % kPerGroup;
#pragma unroll
      for (int j = 0; j < kPerGroup; ++j) {  // selects, not an indexed store: vreg stays in registers
        vreg[j].x = j == jl ? w.x : vreg[j].x;
        vreg[j].y = j == jl ? w.y : vreg[j].y;
        vreg[j].z = j == jl ? w.z : vreg[j].z;
        vreg[j].w = j == jl ? w.w : vreg[j].w;
      }
    }

    // Scores of this thread's token for the G rows: its half, then its partner's.
    float sc[MAXG];
#pragma unroll
    for (int g = 0; g < MAXG; ++g) sc[g] = 0.0f;
#pragma unroll
    for (int i = 0; i < kHalf / 8; ++i) {
      const uint32_t* w = reinterpret_cast<const uint32_t*>(&kreg[i]);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 kk = bf2(w[j]);
#pragma unroll
        for (int g = 0; g < MAXG; ++g) {
          const float2 qq = *reinterpret_cast<const float2*>(&sh.q[g][kh][8 * i + 2 * j]);
          sc[g] = fmaf(qq.x, kk.x, fmaf(qq.y, kk.y, sc[g]));
        }
      }
    }
    const bool valid = kt < n;
#pragma unroll
    for (int g = 0; g < MAXG; ++g) {
      float x = sc[g] + __shfl_xor_sync(0xffffffffu, sc[g], 1);
      x = valid ? x * scale_log2 : -INFINITY;
      sc[g] = x;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
      if (lane == 0) sh.wmax[warp][g] = x;
    }
    __syncthreads();
    float alpha[MAXG];
#pragma unroll
    for (int g = 0; g < MAXG; ++g) {
      float tm = sh.wmax[0][g];
#pragma unroll
      for (int w = 1; w < kWarps; ++w) tm = fmaxf(tm, sh.wmax[w][g]);
      const float m_new = fmaxf(m_run[g], tm);  // n > 0: finite
      alpha[g] = exp2f(m_run[g] - m_new);       // 0 for the first tile
      const float pr = valid ? exp2f(sc[g] - m_new) : 0.0f;
      if (kh == 0) {
        sh.p[g][kt] = pr;
        l_part[g] = fmaf(l_part[g], alpha[g], pr);
      }
      m_run[g] = m_new;
    }
    __syncthreads();
    // Weighted values: this thread's 8 dims over its 8 tokens.
#pragma unroll
    for (int j = 0; j < kPerGroup; ++j) {
      const uint32_t* w = reinterpret_cast<const uint32_t*>(&vreg[j]);
      float vv[8];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float2 f = bf2(w[i]);
        vv[2 * i] = f.x;
        vv[2 * i + 1] = f.y;
      }
#pragma unroll
      for (int g = 0; g < MAXG; ++g) {
        const float pr = sh.p[g][grp * kPerGroup + j];
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[g][i] = fmaf(pr, vv[i], j == 0 ? acc[g][i] * alpha[g] : acc[g][i]);
      }
    }
  }

  // The piece's sums: the two token groups of a warp by a shuffle, the warps through shared memory.
#pragma unroll
  for (int g = 0; g < MAXG; ++g) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float x = acc[g][i] + __shfl_xor_sync(0xffffffffu, acc[g][i], 16);
      if (lane < 16) sh.red[warp][g][8 * oct + i] = x;
    }
    float x = l_part[g];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    if (lane == 0) sh.wsum[warp][g] = x;
    if (t == g) sh.m[g] = m_run[g];
  }
  __syncthreads();
  for (int idx = t; idx < g_count * kD; idx += kThreads) {
    const int g = idx / kD, d = idx % kD;
    float x = sh.red[0][g][d];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) x += sh.red[w][g][d];
    sh.red[0][g][d] = x;  // only this thread reads or writes (g, d) here
  }
  if (t < g_count) {
    float x = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) x += sh.wsum[w][t];
    sh.l[t] = x;
  }

  // Merge across the cluster: every block writes a share of the G x 128 outputs.
  cluster_sync();
  const int total = g_count * kD;
  const int share = (total + pieces - 1) / pieces;
  for (int idx = rank * share + t; idx < min(total, (rank + 1) * share); idx += kThreads) {
    const int g = idx / kD, d = idx % kD;
    float mc[kMaxCluster];
    float top = -INFINITY;
#pragma unroll
    for (int c = 0; c < kMaxCluster; ++c) {
      if (c < pieces) {
        mc[c] = load_from_block(&sh.m[g], c);
        top = fmaxf(top, mc[c]);
      }
    }
    const float safe = top == -INFINITY ? 0.0f : top;
    float num = 0.0f, den = 0.0f;
#pragma unroll
    for (int c = 0; c < kMaxCluster; ++c) {
      if (c < pieces) {
        const float w = exp2f(mc[c] - safe);  // an empty piece: 0
        num = fmaf(w, load_from_block(&sh.red[0][g][d], c), num);
        den = fmaf(w, load_from_block(&sh.l[g], c), den);
      }
    }
    out[seq * stride_o + ((long long)h * g_count + g) * kD + d] = __float2bfloat16_rn(num / fmaxf(den, 1e-30f));
  }
  cluster_sync();  // no block leaves while another still reads its shared memory
#endif
}

}  // namespace mgx_attn

// MIN_BLOCKS: 2 an SM for 4 query heads a kv head (128 registers, 160 bytes of spills: 196 otherwise),
// 1 for 8 (128 registers spilled a kilobyte).
#define MGX_DECODE_ATTN_ENTRY(MAXG, MIN_BLOCKS)                                                                 \
  extern "C" __global__ void __launch_bounds__(mgx_attn::kThreads, MIN_BLOCKS) MGX_ENTRY(mgx_decode_attn_g##MAXG##_bf16)( \
      __nv_bfloat16* out, const __nv_bfloat16* q, const __nv_bfloat16* k_new, const __nv_bfloat16* v_new,      \
      __nv_bfloat16* kc, __nv_bfloat16* vc, const int* table, const int* ctx_lens, const float* inv_freq,      \
      float attention_scaling, float scale_log2, long long stride_q, long long stride_k, long long stride_v,   \
      long long stride_o, long long stride_bt, int hk, int g_count, int page, int window, int rot) {           \
    mgx_attn::decode<MAXG>(out, q, k_new, v_new, kc, vc, table, ctx_lens, inv_freq, attention_scaling,          \
                           scale_log2, stride_q, stride_k, stride_v, stride_o, stride_bt, hk, g_count, page,    \
                           window, rot);                                                                        \
  }

MGX_DECODE_ATTN_ENTRY(4, 2)
MGX_DECODE_ATTN_ENTRY(8, 1)
