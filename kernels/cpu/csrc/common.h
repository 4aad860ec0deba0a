// Declarations shared by every MGX CPU translation unit: how a weight and a paged KV cache are
// described to the kernels, and the table of kernels one ISA provides.
//
// Nothing here uses ISA-specific types, so the Python module (compiled for baseline x86-64 or any
// other architecture) can hold pointers to kernels compiled for AVX2 or AVX-512.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace mgx {

// Storage type of float values (weights of schemes none/sparse24, KV cache entries).
enum class FloatType : int32_t { F32 = 0, BF16 = 1, F16 = 2 };

// Weight schemes of formats/README.md "Weight schemes and layouts".
enum class Scheme : int32_t { None = 0, W8A16 = 1, Int4 = 2, Sparse24 = 3, Sparse24Int4 = 4 };

// Byte layouts: RowMajor is the scheme's plain layout; Tile16 is formats.layouts "cpu_tile16":
// every per-output-channel array [N, U] is cut into tiles of 16 channels, each stored transposed
// ([U][16], the last tile [U][N % 16]), so one k step of 16 outputs is one contiguous load.
enum class Layout : int32_t { RowMajor = 0, Tile16 = 1 };

constexpr int64_t kTile = 16;  // output channels per tile (the layout's, not an ISA's, width)

// A linear weight as the artifact maps it: pointers into the file, never a copy.
struct WeightDesc {
  Scheme scheme;
  Layout layout;
  FloatType ftype;        // none / sparse24: type of the stored values
  int64_t n, k;           // logical out_features, in_features
  int64_t group;          // int4: group size along k; sparse24_int4: along the kept values; else 0
  const void* values;     // the "weight" role
  const float* scales;    // w8a16 [N]; int4 [N, G]; sparse24_int4 [N, G]
  const uint8_t* zeros;   // [N, G] zero points; null for symmetric int4 (zero point 8)
  const uint8_t* meta;    // sparse: [N, K/4] in-group indices (bits 0-1 first, bits 2-3 second)
  const float* bias;      // [N] or null
};

// Units per output channel of each role array ([N, U] before tiling).
int64_t value_units(const WeightDesc& w);  // elements (float / i8 schemes) or bytes (int4 schemes)
int64_t group_count(const WeightDesc& w);  // columns of scales / zeros (1 for w8a16)

// Offset of element (n, u) of an [N, U] role array in the weight's layout.
inline int64_t role_offset(Layout layout, int64_t n_total, int64_t units, int64_t n, int64_t u) {
  if (layout == Layout::RowMajor) return n * units + u;
  const int64_t t = n / kTile, lane = n % kTile;
  const int64_t width = (n_total - t * kTile) < kTile ? (n_total - t * kTile) : kTile;
  return t * kTile * units + u * width + lane;
}

// One step of paged attention (the KV contract shared with the block manager): sequence i owns
// query rows query_start[i]..query_start[i+1] and block_table[i, :]; a token at position p lives in
// slot block_table[i, p / block_size] * block_size + p % block_size of each layer's caches,
// which are [num_blocks, block_size, num_kv_heads, head_dim].
struct AttentionArgs {
  const float* q; int64_t ldq;   // [T, Hq*D]
  const float* k; int64_t ldk;   // [T, Hk*D], written into the cache before attending
  const float* v; int64_t ldv;   // [T, Hk*D]
  float* out; int64_t ldo;       // [T, Hq*D]
  const int64_t* positions;      // [T]
  int64_t num_tokens;
  int64_t num_seqs;
  const int32_t* query_start;    // [B + 1]
  const int32_t* context_lens;   // [B] tokens cached once this step's are written
  const int32_t* block_table;    // [B, max_blocks]
  int64_t max_blocks;
  void* k_cache; void* v_cache;  // [num_blocks, block_size, Hk, D]
  FloatType cache_type;
  int64_t num_blocks, block_size;
  int64_t num_heads, num_kv_heads, head_dim;
  float scale;
  int64_t sliding_window;        // 0: none; else keys with p - j < window
};

// The kernels one ISA provides. Every function is multi-threaded internally (OpenMP) and safe to
// call without the GIL. Activations are float32 rows with a row stride (ld*) in elements.
struct KernelTable {
  const char* name;
  int stream_rows;  // up to this many rows, linear streams each weight once straight into FMAs
  void (*linear)(const WeightDesc& w, const float* x, int64_t ldx, int64_t m, float* y, int64_t ldy);
  // Greedy LM head: the argmax (first on ties) and max of each row's logits, never stored whole.
  void (*linear_argmax)(const WeightDesc& w, const float* x, int64_t ldx, int64_t m, int64_t* index,
                        float* value);
  // Rows of the dequantized weight (embedding lookups).
  void (*gather_rows)(const WeightDesc& w, const int64_t* rows, int64_t count, float* out, int64_t ldo);
  // out = rms_norm(x (+ res)) * weight over groups of `group` features; with res, sum_out = x + res.
  void (*rms_norm)(const float* x, int64_t ldx, const float* res, int64_t ldr, int64_t t, int64_t f,
                   int64_t group, const float* weight, float eps, float* sum_out, int64_t lds,
                   float* out, int64_t ldo);
  // Rotate-half RoPE of `heads` heads of width d (first `rot` dims) with per-row cos/sin [T, rot/2].
  void (*rope)(const float* x, int64_t ldx, int64_t t, int64_t heads, int64_t d, int64_t rot,
               const float* cos, const float* sin, float* out, int64_t ldo);
  void (*silu_mul)(const float* gate, int64_t ldg, const float* up, int64_t ldu, int64_t t, int64_t f,
                   float* out, int64_t ldo);
  void (*attention)(const AttentionArgs& a);
};

// Per-ISA tables; null when the ISA was not compiled into this build (non-x86 hosts).
const KernelTable* scalar_table();
const KernelTable* avx2_table();
const KernelTable* avx512_table();

// Worker threads the kernels use (set from Python; OpenMP when built with it).
int num_threads();

}  // namespace mgx
