// An experiment of the 43rd session (examples/bench_gpu_mlp.py builds and times it; not in the product):
// the batch-1 int4 MLP -- gate/up with the SiLU product, then down -- in one kernel, so that down has
// no launch of its own and x is staged once a block instead of in each of down's blocks.
//
// Block b takes SiLU outputs 128 b .. 128 b + 127, i.e. down's 128-column step b:
// - phase 1: the 16 SiLU groups of 8 outputs (gate rows 8 j .., up rows F + 8 j ..), W / 16 warps a
//   group, from the record norm_stage wrote (gemv.cu's ImmaStaged, copied into shared memory once a
//   block) and the cuda_tile16 codes with their fp16 scale pairs, as gemv_imma's staged twin computes a
//   step; the block adds up its warps' sums, applies the SiLU product with transformers' roundings and
//   keeps the 128 bf16 outputs in shared memory;
// - phase 2: each warp stages those 128 values as one imma step (imma4_stage_x) and multiplies them by
//   down's step b for its row groups (warp, warp + W, ...; DB at a time in flight, double-buffered
//   with kDB), adding each group's 16 row sums into acc with one 16-byte reduction in L2 per 4 rows.
//
// acc is fp32 and must be zero before; its sums over the blocks run in whatever order the reductions
// land, so the last bits vary from run to run (the product's kernels give the same bits every run).
// With kFixed, acc is int64 instead: each block adds its share of a row rounded to a multiple of 2^-32
// (fixed point, |row| < 2^31), whose sums are exact in any order: the same bits every run (a NaN or
// Inf does not survive it: __float2ll_rn saturates, NaN to -2^63).
// Built into one unit after gemv.cu (whose helpers it uses) with MGX_IMMA_TILE16=1 and
// MGX_IMMA_HALF_SCALES=1; sm_90 (the 16-byte fp32 reductions).
//
// Timing knobs (`mode` bits, the results then meaningless): 1 phase 1 only, 2 phase 2 only, 4 plain
// stores instead of the reductions. `stamps` (or null): per block, %globaltimer at its start, after
// phase 1, at its end, and its SM.

namespace mgx_gemv {

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
    constexpr uint32_t kLow = 0x0F0F0F0Fu;
    return h == 0 ? make_uint4(v.x & kLow, v.y & kLow, v.z & kLow, v.w & kLow)
                  : make_uint4((v.x >> 4) & kLow, (v.y >> 4) & kLow, (v.z >> 4) & kLow, (v.w >> 4) & kLow);
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
        atomicAdd(at, make_float4(v[0], v[1], v[2], v[3]));
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

// acc [n] fp32 (int64 of 2^-32 with X: kFixed; zero before) += down(silu(gate) * up) of the row whose record rec is (norm_stage's, K
// columns); wgu [2F, K] and wd [n, F] int4 in cuda_tile16 with groups of 128 << s columns, pgu and pd
// their scale pairs (gemv.scale_pairs; pgu in the SiLU product's order) with groups_gu and groups_d
// groups a row. Grid: F / 128 blocks of W warps; dynamic shared memory: the record (rounded up to 16
// bytes). F, K, n multiples of 128, 128 and 16.
#define MGX_MLP_ENTRY(W, U, DB, DBUF, FX, X)                                                                       \
  extern "C" __global__ void __launch_bounds__(W * 32, 1) MGX_ENTRY(mgx_mlp_int4_w##W##_u##U##_d##DB##_b##DBUF##X)( \
      void* acc, const uint8_t* rec, const uint8_t* wgu, const uint2* pgu, const uint8_t* wd, const uint2* pd,   \
      int f, int k, int n, int groups_gu, int groups_d, int group_shift, int mode, unsigned long long* stamps) {  \
    mgx_gemv::mlp_int4_fused<W, U, DB, DBUF, FX>(acc, reinterpret_cast<const uint4*>(rec), wgu, pgu, wd, pd, f, k, n, \
                                             groups_gu, groups_d, group_shift, mode, stamps);                     \
  }

MGX_MLP_ENTRY(32, 2, 2, 0, false, )
MGX_MLP_ENTRY(16, 4, 4, 1, false, )
MGX_MLP_ENTRY(16, 2, 4, 1, false, )
MGX_MLP_ENTRY(32, 2, 2, 0, true, _x)
MGX_MLP_ENTRY(16, 2, 4, 1, true, _x)
