// Variants of gemv.cu's fused batch-1 int4 MLP (mlp_int4_fused, forty-third session), built into one
// unit after the product's kernels with MGX_IMMA_TILE16=1 and MGX_IMMA_HALF_SCALES=1 and timed by
// examples/bench_gpu_mlp.py; gemv.cu says what the kernel does. Entry names: warps a block (w), gate/up
// steps a warp keeps in flight (u), down row groups in flight (d), whether those are double-buffered
// (b); "_x": the row in 64-bit fixed point (the same bits every run), else fp32 reductions (their order
// varies). The product's entry is w16_u2_d4_b1_x (mgx_mlp_int4_fused).

#define MGX_MLP_ENTRY(W, U, DB, DBUF, FX, X) \
  MGX_MLP_ENTRY_NAMED(mgx_mlp_int4_w##W##_u##U##_d##DB##_b##DBUF##X, W, U, DB, DBUF, FX)

MGX_MLP_ENTRY(32, 2, 2, 0, false, )
MGX_MLP_ENTRY(16, 4, 4, 1, false, )
MGX_MLP_ENTRY(16, 2, 4, 1, false, )
MGX_MLP_ENTRY(32, 2, 2, 0, true, _x)
MGX_MLP_ENTRY(16, 2, 4, 1, true, _x)

// ---- Forty-eighth session: down's tiles taken from a queue (entries *_q) --------------------------
//
// mlp_int4_fused's block b ends when its own step's 4096 rows are done, so the kernel lasts as long as
// its slowest block (phase 1 took 15.1-18.7 us a block in the 143rd run) and the SMs beyond F / 128
// (20 of the H200's 132 for the 8B) idle. Here phase 1 is the same; then warp 0 stages the 128 SiLU
// outputs as one imma step and publishes that record (each lane's B words, the factor and sum X) in
// ws, takes a slot with an add on ws[0] and stores b + 1 there with release semantics. Every block
// (blocks past F / 128 have no phase 1 and start here) then takes items from ws[1]: item w is chunk w
// % C of the step in slot w / C (C = row groups / (W DB): each warp one batch of DB row groups), waited
// for with acquire loads, the next item's tiles loaded while the current one is computed. ws: u32
// [1024] zero before (counters, slots), then the records, 33 uint4 a step.
namespace mgx_gemv {

__device__ __forceinline__ unsigned ld_acquire_u32(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_u32(unsigned* p, unsigned v) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

template <int W, int U, int DB, bool kFixed>
__device__ void mlp_int4_queued(void* __restrict__ acc_out, const uint4* __restrict__ rec, const uint8_t* __restrict__ wgu,
                                const uint2* __restrict__ pgu, const uint8_t* __restrict__ wd,
                                const uint2* __restrict__ pd, int f, int k, int n, int groups_gu, int groups_d,
                                int group_shift, unsigned* __restrict__ ws, unsigned long long* __restrict__ stamps) {
  static_assert(W % 16 == 0, "16 SiLU groups a block, W / 16 warps each");
  float* acc = static_cast<float*>(acc_out);
  unsigned long long* acc_fx = static_cast<unsigned long long*>(acc_out);
  constexpr int kShare = W / 16;
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
  __shared__ int item_s[2];
  extern __shared__ uint4 rec_s[];
  uint4* pub = reinterpret_cast<uint4*>(ws + 1024);
  uint8_t* buf = imma_buffer<W>(warp);
  const ImmaLane weigh{(t & 1) ? 64 : 0, (t & 1) ? 0.0f : 1.0f, (t & 1) ? 65536.0f : 256.0f, t >= 2};
  const auto nibbles = [](uint4 v, int h) {
    constexpr uint32_t kMask = 0x0F0F0F0Fu;
    return h == 0 ? make_uint4(v.x & kMask, v.y & kMask, v.z & kMask, v.w & kMask)
                  : make_uint4((v.x >> 4) & kMask, (v.y >> 4) & kMask, (v.z >> 4) & kMask, (v.w >> 4) & kMask);
  };
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

  if (b < steps_d) {  // ---- phase 1, as mlp_int4_fused's
    reinterpret_cast<uint32_t*>(buf + imma_column(2))[lane] = 0x01010101u;
    const int rec_words = steps * 32 + (steps + 1) / 2;
    const int j = b * 16 + (warp & 15), share = warp >> 4;
    const auto tile_at = [&](uint32_t r0) {
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
    constexpr int kStride = U * kShare;
    int s = share;
    load_w(s, even);
    mgx_pdl_wait();
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
    for (int o = 1; o < 4; o <<= 1) {
      acc_lo += __shfl_xor_sync(0xFFFFFFFFu, acc_lo, o);
      acc_hi += __shfl_xor_sync(0xFFFFFFFFu, acc_hi, o);
    }
    if (t == 0) {
      part[warp][g] = acc_lo;
      part[warp][g + 8] = acc_hi;
    }
    __syncthreads();
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
    if (warp == 0) {  // publish the step's record, then its slot
      float sum_x;
      const float factor = imma4_stage_x(buf, x_oct<true>(reinterpret_cast<const uint4*>(xs), lane >> 1), lane, sum_x);
      const int b_at = imma_column(g & 3) + 16 * t + 8 * (g >> 2);
      const uint2 c0 = *reinterpret_cast<const uint2*>(buf + b_at), c1 = *reinterpret_cast<const uint2*>(buf + b_at + 64);
      pub[b * 33 + lane] = make_uint4(c0.x, c0.y, c1.x, c1.y);
      if (lane == 0) pub[b * 33 + 32] = make_uint4(__float_as_uint(factor), __float_as_uint(sum_x), 0u, 0u);
      __threadfence();
      __syncwarp();
      if (lane == 0) st_release_u32(ws + 2 + atomicAdd(ws, 1u), static_cast<unsigned>(b) + 1u);
    }
    if (stamps != nullptr && threadIdx.x == 0) {
      unsigned sm;
      asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
      stamps[blockIdx.x * 4 + 1] = now();
      stamps[blockIdx.x * 4 + 3] = sm;
    }
  } else {
    mgx_pdl_wait();  // nothing of the kernel before is read here, but the next one waits for every block
    if (stamps != nullptr && threadIdx.x == 0) {
      unsigned sm;
      asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
      stamps[blockIdx.x * 4 + 1] = now();
      stamps[blockIdx.x * 4 + 3] = sm;
    }
  }

  // ---- phase 2: items from the queue
  constexpr int kPer = W * DB;  // row groups an item
  const int chunks = (row_groups + kPer - 1) / kPer, total = steps_d * chunks;
  struct Item {
    uint4 lo[DB], hi[DB];
    uint2 sz[DB];
    uint4 bw;
    uint4 fs;
  };
  const auto take = [&](int p) {
    if (threadIdx.x == 0) {
      const unsigned w = atomicAdd(ws + 1, 1u);
      int v = -1;
      if (w < static_cast<unsigned>(total)) {
        const unsigned slot = w / static_cast<unsigned>(chunks);
        unsigned q;
        while ((q = ld_acquire_u32(ws + 2 + slot)) == 0u) __nanosleep(32);
        v = static_cast<int>((q - 1u) * static_cast<unsigned>(chunks) + w % static_cast<unsigned>(chunks));
      }
      item_s[p] = v;
    }
    __syncthreads();
    return item_s[p];
  };
  const auto load_item = [&](int v, Item& it) {
    const int bs = v / chunks, c = v % chunks;
    const uint32_t grp_d = (static_cast<uint32_t>(bs) << 7) >> group_shift;
#pragma unroll
    for (int u = 0; u < DB; ++u) {
      const int rg = c * kPer + warp + W * u;
      const bool in = rg < row_groups;
      const uint32_t at = (static_cast<uint32_t>(rg) * steps_d + bs) * 1024u + 16u * lane;
      it.lo[u] = in ? load_stream_fetch(reinterpret_cast<const uint4*>(wd + at)) : make_uint4(0, 0, 0, 0);
      it.hi[u] = in ? load_stream_fetch(reinterpret_cast<const uint4*>(wd + at + 512u)) : make_uint4(0, 0, 0, 0);
      it.sz[u] = in ? load_now(pd + (static_cast<uint32_t>(rg) * groups_d + grp_d) * 8u + g)
                    : make_uint2(kIdleHalves, kIdleHalves);
    }
    it.bw = __ldcg(pub + bs * 33 + lane);
    it.fs = __ldcg(pub + bs * 33 + 32);
  };
  const auto put = [&](int rg, float lo, float hi) {
#pragma unroll
    for (int o = 1; o < 4; o <<= 1) {
      lo += __shfl_xor_sync(0xFFFFFFFFu, lo, o);
      hi += __shfl_xor_sync(0xFFFFFFFFu, hi, o);
    }
    if constexpr (kFixed) {
      if (t == 0 && rg < row_groups) {
        const auto fx = [](float v) { return static_cast<unsigned long long>(__float2ll_rn(v * 4294967296.0f)); };
        if (!isfinite(lo) || !isfinite(hi)) atomicOr(acc_fx + n, 1ull);
        atomicAdd(acc_fx + 16 * rg + g, fx(lo));
        atomicAdd(acc_fx + 16 * rg + g + 8, fx(hi));
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
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
      __trap();
#else
      atomicAdd(reinterpret_cast<float4*>(acc + 16 * rg) + q, make_float4(v[0], v[1], v[2], v[3]));
#endif
    }
  };
  const auto compute_item = [&](int v, const Item& it) {
    const int c = v % chunks;
#pragma unroll
    for (int u = 0; u < DB; ++u) {
      float lo = 0.0f, hi = 0.0f;
      step(it.lo[u], it.hi[u], it.bw, __uint_as_float(it.fs.x), __uint_as_float(it.fs.y), it.sz[u], lo, hi);
      put(c * kPer + warp + W * u, lo, hi);
    }
  };
  Item a, c;
  int cur = take(0);
  if (cur >= 0) load_item(cur, a);
  while (cur >= 0) {
    const int nxt = take(1);
    if (nxt >= 0) load_item(nxt, c);
    compute_item(cur, a);
    if (nxt < 0) break;
    cur = take(0);
    if (cur >= 0) load_item(cur, a);
    compute_item(nxt, c);
  }
  if (stamps != nullptr) {
    __syncthreads();
    if (threadIdx.x == 0) stamps[blockIdx.x * 4 + 2] = now();
  }
}

}  // namespace mgx_gemv

#define MGX_MLP_QUEUED_ENTRY(W, U, DB, FX, X)                                                                 \
  extern "C" __global__ void __launch_bounds__(W * 32, 1) MGX_ENTRY(mgx_mlp_int4_w##W##_u##U##_d##DB##_q##X)( \
      void* acc, const uint8_t* rec, const uint8_t* wgu, const uint2* pgu, const uint8_t* wd, const uint2* pd,  \
      int f, int k, int n, int groups_gu, int groups_d, int group_shift, int mode, unsigned long long* stamps,  \
      unsigned* ws) {                                                                                        \
    mgx_gemv::mlp_int4_queued<W, U, DB, FX>(acc, reinterpret_cast<const uint4*>(rec), wgu, pgu, wd, pd, f, k, n, \
                                            groups_gu, groups_d, group_shift, ws, stamps);                    \
  }

MGX_MLP_QUEUED_ENTRY(16, 2, 4, true, _x)
MGX_MLP_QUEUED_ENTRY(16, 2, 2, true, _x)
