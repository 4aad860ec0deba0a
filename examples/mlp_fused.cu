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

// Forty-eighth session: down's second batch of row groups also asked for before the block adds up its
// SiLU outputs (kTwoEarly), so that 8 tiles a warp are in flight across that barrier instead of 4.
extern "C" __global__ void __launch_bounds__(16 * 32, 1) MGX_ENTRY(mgx_mlp_int4_w16_u2_d4_b1_e2_x)(
    void* acc, const uint8_t* rec, const uint8_t* wgu, const uint2* pgu, const uint8_t* wd, const uint2* pd, int f,
    int k, int n, int groups_gu, int groups_d, int group_shift, int mode, unsigned long long* stamps) {
  mgx_gemv::mlp_int4_fused<16, 2, 4, true, true, true>(acc, reinterpret_cast<const uint4*>(rec), wgu, pgu, wd, pd, f, k,
                                                       n, groups_gu, groups_d, group_shift, mode, stamps);
}
