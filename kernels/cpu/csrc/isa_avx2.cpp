// AVX2 + FMA + F16C kernels (Haswell and later, Zen and later): 8 floats per register.
#include "isa_prelude.h"

#if MGX_X86
MGX_TARGET_PUSH("avx2,fma,f16c")
#include <immintrin.h>

namespace mgx {
namespace avx2 {

struct O {
  static constexpr const char* kName = "avx2";
  using R = __m256;
  using RI = __m256i;
  using Quad = __m256;
  static constexpr int W = 8;
  static constexpr int kStreamRows = 4;  // 2 registers per row: 4 rows + weights + group params fit 16
  static constexpr int kMicroRows = 6;   // 6 x 16 accumulators = 12 of the 16 registers

  static R zero() { return _mm256_setzero_ps(); }
  static R set1(float v) { return _mm256_set1_ps(v); }
  static R load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, R v) { _mm256_storeu_ps(p, v); }
  static R add(R a, R b) { return _mm256_add_ps(a, b); }
  static R sub(R a, R b) { return _mm256_sub_ps(a, b); }
  static R mul(R a, R b) { return _mm256_mul_ps(a, b); }
  static R div(R a, R b) { return _mm256_div_ps(a, b); }
  static R max(R a, R b) { return _mm256_max_ps(a, b); }
  static R fma(R a, R b, R c) { return _mm256_fmadd_ps(a, b, c); }
  static R floor(R a) { return _mm256_floor_ps(a); }
  static float hsum(R a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
  static float hmax(R a) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
  }
  // exp with the Cephes polynomial (about 1 ulp); exactly 0 below -87.3 and for -inf.
  static R exp(R x) {
    const R underflow = _mm256_cmp_ps(x, set1(-87.33654f), _CMP_LT_OQ);
    x = _mm256_max_ps(_mm256_min_ps(x, set1(88.0f)), set1(-87.33654f));
    const R fx = _mm256_round_ps(mul(x, set1(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(fx, set1(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, set1(-2.12194440e-4f), x);
    R y = set1(1.9875691500e-4f);
    y = fma(y, x, set1(1.3981999507e-3f));
    y = fma(y, x, set1(8.3334519073e-3f));
    y = fma(y, x, set1(4.1665795894e-2f));
    y = fma(y, x, set1(1.6666665459e-1f));
    y = fma(y, x, set1(5.0000001201e-1f));
    y = fma(y, mul(x, x), add(x, set1(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(underflow, mul(y, _mm256_castsi256_ps(e)));
  }
  static R iota() { return _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7); }
  static R keep_range(R s, R pos, float lo, float hi) {
    const R in = _mm256_and_ps(_mm256_cmp_ps(pos, set1(lo), _CMP_GE_OQ), _mm256_cmp_ps(pos, set1(hi), _CMP_LE_OQ));
    return _mm256_blendv_ps(set1(-std::numeric_limits<float>::infinity()), s, in);
  }
  static R sel_eq(R a, float b, R v) { return _mm256_and_ps(_mm256_cmp_ps(a, set1(b), _CMP_EQ_OQ), v); }
  static R from_bf16(const uint16_t* p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  static R from_f16(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static R from_i8(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static R from_u8(const uint8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static void nibbles(const uint8_t* p, R* lo, R* hi) {
    nibbles_w(p, lo[0], hi[0]);
    nibbles_w(p + 8, lo[1], hi[1]);
  }
  // W bytes -> their low and high nibbles as floats.
  static void nibbles_w(const uint8_t* p, R& lo, R& hi) {
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    lo = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
    hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
  }
  // x[0..3] in both 128-bit halves: permutevar8x32 then picks x[i & 3] for any 3-bit index.
  static Quad quad(const float* x) { return _mm256_broadcast_ps(reinterpret_cast<const __m128*>(x)); }
  static void meta_idx(const uint8_t* p, RI& i0, RI& i1) {
    const __m256i m = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    i0 = _mm256_and_si256(m, _mm256_set1_epi32(3));
    i1 = _mm256_and_si256(_mm256_srli_epi32(m, 2), _mm256_set1_epi32(3));
  }
  static R perm4(Quad q, RI i) { return _mm256_permutevar8x32_ps(q, i); }
};

#include "impl.h"

}  // namespace avx2

const KernelTable* avx2_table() { return &avx2::kTable; }

}  // namespace mgx

MGX_TARGET_POP
#else
namespace mgx {
const KernelTable* avx2_table() { return nullptr; }
}  // namespace mgx
#endif
