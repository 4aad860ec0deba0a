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
