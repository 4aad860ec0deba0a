// AVX-512 (F, BW, VL, DQ) kernels (Skylake-SP and later, Zen 4 and later): 16 floats per register,
// so one register holds a whole 16-channel tile row.
#include "isa_prelude.h"

#if MGX_X86
MGX_TARGET_PUSH("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"  // GCC 12's own _mm512_undefined_* idiom
#endif
#include <immintrin.h>

namespace mgx {
namespace avx512 {

struct O {
  static constexpr const char* kName = "avx512";
  using R = __m512;
  using RI = __m512i;
  using Quad = __m512;
  static constexpr int W = 16;
  static constexpr int kStreamRows = 4;   // beyond 4 rows the panel path's decode-once wins anyway
  static constexpr int kMicroRows = 12;

  static R zero() { return _mm512_setzero_ps(); }
  static R set1(float v) { return _mm512_set1_ps(v); }
  static R load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, R v) { _mm512_storeu_ps(p, v); }
  static R add(R a, R b) { return _mm512_add_ps(a, b); }
  static R sub(R a, R b) { return _mm512_sub_ps(a, b); }
  static R mul(R a, R b) { return _mm512_mul_ps(a, b); }
  static R div(R a, R b) { return _mm512_div_ps(a, b); }
  static R max(R a, R b) { return _mm512_max_ps(a, b); }
  static R fma(R a, R b, R c) { return _mm512_fmadd_ps(a, b, c); }
  static R floor(R a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
  static float hsum(R a) { return _mm512_reduce_add_ps(a); }
  static float hmax(R a) { return _mm512_reduce_max_ps(a); }
  static R exp(R x) {  // as the AVX2 version
    const __mmask16 underflow = _mm512_cmp_ps_mask(x, set1(-87.33654f), _CMP_LT_OQ);
    x = _mm512_max_ps(_mm512_min_ps(x, set1(88.0f)), set1(-87.33654f));
    const R fx = _mm512_roundscale_ps(mul(x, set1(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(fx, set1(0.693359375f), x);
    x = _mm512_fnmadd_ps(fx, set1(-2.12194440e-4f), x);
    R y = set1(1.9875691500e-4f);
    y = fma(y, x, set1(1.3981999507e-3f));
    y = fma(y, x, set1(8.3334519073e-3f));
    y = fma(y, x, set1(4.1665795894e-2f));
    y = fma(y, x, set1(1.6666665459e-1f));
    y = fma(y, x, set1(5.0000001201e-1f));
    y = fma(y, mul(x, x), add(x, set1(1.0f)));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(fx), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mov_ps(__mmask16(~underflow), mul(y, _mm512_castsi512_ps(e)));
  }
  static R iota() { return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
  static R keep_range(R s, R pos, float lo, float hi) {
    const __mmask16 in = _mm512_cmp_ps_mask(pos, set1(lo), _CMP_GE_OQ) & _mm512_cmp_ps_mask(pos, set1(hi), _CMP_LE_OQ);
    return _mm512_mask_blend_ps(in, set1(-std::numeric_limits<float>::infinity()), s);
  }
  static R sel_eq(R a, float b, R v) { return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(a, set1(b), _CMP_EQ_OQ), v); }
  static R from_bf16(const uint16_t* p) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
  static R from_f16(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static R from_i8(const int8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static R from_u8(const uint8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static void nibbles(const uint8_t* p, R* lo, R* hi) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i mask = _mm_set1_epi8(0x0F);
    lo[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(b, mask)));
    hi[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(b, 4), mask)));
  }
  static void nibbles_w(const uint8_t* p, R& lo, R& hi) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
    hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
  }
  // x[0..3] in all four 128-bit lanes: permutexvar then picks x[i & 3] for any 4-bit index.
  static Quad quad(const float* x) { return _mm512_broadcast_f32x4(_mm_loadu_ps(x)); }
  static void meta_idx(const uint8_t* p, RI& i0, RI& i1) {
    const __m512i m = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    i0 = _mm512_and_si512(m, _mm512_set1_epi32(3));
    i1 = _mm512_and_si512(_mm512_srli_epi32(m, 2), _mm512_set1_epi32(3));
  }
  static R perm4(Quad q, RI i) { return _mm512_permutexvar_ps(i, q); }
};

#include "impl.h"

}  // namespace avx512

const KernelTable* avx512_table() { return &avx512::kTable; }

}  // namespace mgx

MGX_TARGET_POP
#else
namespace mgx {
const KernelTable* avx512_table() { return nullptr; }
}  // namespace mgx
#endif
