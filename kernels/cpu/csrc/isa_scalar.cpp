// The portable path: plain C++ that any architecture compiles (the compiler may auto-vectorize it
// for its baseline ISA). It is the reference the vector paths are tested against on every host.
#include "isa_prelude.h"

namespace mgx {
namespace scalar {

// A "register" of 16 floats in plain arrays: the kernels then have the structure of the AVX-512 path
// (one register per tile row), and each operation is a short loop the compiler may vectorize for
// whatever the target has (SSE2, NEON, ...).
struct V16 {
  float v[16];
};
struct I16 {
  int32_t v[16];
};

#define MGX_LANES(expr)                         \
  V16 r;                                        \
  for (int i = 0; i < 16; ++i) r.v[i] = (expr); \
  return r

struct O {
  static constexpr const char* kName = "scalar";
  using R = V16;
  using RI = I16;
  using Quad = const float*;
  static constexpr int W = 16;
  static constexpr int kStreamRows = 4;
  static constexpr int kMicroRows = 4;

  static R zero() { MGX_LANES(0.0f); }
  static R set1(float x) { MGX_LANES(x); }
  static R load(const float* p) { MGX_LANES(p[i]); }
  static void store(float* p, const R& a) { std::memcpy(p, a.v, sizeof a.v); }
  static R add(const R& a, const R& b) { MGX_LANES(a.v[i] + b.v[i]); }
  static R sub(const R& a, const R& b) { MGX_LANES(a.v[i] - b.v[i]); }
  static R mul(const R& a, const R& b) { MGX_LANES(a.v[i] * b.v[i]); }
  static R div(const R& a, const R& b) { MGX_LANES(a.v[i] / b.v[i]); }
  static R max(const R& a, const R& b) { MGX_LANES(a.v[i] > b.v[i] ? a.v[i] : b.v[i]); }
  static R fma(const R& a, const R& b, const R& c) { MGX_LANES(a.v[i] * b.v[i] + c.v[i]); }
  static R floor(const R& a) { MGX_LANES(std::floor(a.v[i])); }
  static R exp(const R& a) { MGX_LANES(std::exp(a.v[i])); }
  static R iota() { MGX_LANES(float(i)); }
  static float hsum(const R& a) {
    float s = 0.0f;
    for (float x : a.v) s += x;
    return s;
  }
  static float hmax(const R& a) {
    float m = a.v[0];
    for (float x : a.v) m = x > m ? x : m;
    return m;
  }
  static R keep_range(const R& s, const R& pos, float lo, float hi) {
    MGX_LANES(pos.v[i] >= lo && pos.v[i] <= hi ? s.v[i] : -std::numeric_limits<float>::infinity());
  }
  static R sel_eq(const R& a, float b, const R& x) { MGX_LANES(a.v[i] == b ? x.v[i] : 0.0f); }
  static R from_bf16(const uint16_t* p) { MGX_LANES(bf16_to_f32(p[i])); }
  static R from_f16(const uint16_t* p) { MGX_LANES(f16_to_f32(p[i])); }
  static R from_i8(const int8_t* p) { MGX_LANES(float(p[i])); }
  static R from_u8(const uint8_t* p) { MGX_LANES(float(p[i])); }
  static void nibbles(const uint8_t* p, R* lo, R* hi) {
    for (int i = 0; i < 16; ++i) lo->v[i] = float(p[i] & 15), hi->v[i] = float(p[i] >> 4);
  }
  static void nibbles_w(const uint8_t* p, R& lo, R& hi) { nibbles(p, &lo, &hi); }
  static Quad quad(const float* x) { return x; }
  static void meta_idx(const uint8_t* p, RI& i0, RI& i1) {
    for (int i = 0; i < 16; ++i) i0.v[i] = p[i] & 3, i1.v[i] = (p[i] >> 2) & 3;
  }
  static R perm4(Quad q, const RI& idx) { MGX_LANES(q[idx.v[i]]); }
};

#undef MGX_LANES

#include "impl.h"

}  // namespace scalar

const KernelTable* scalar_table() { return &scalar::kTable; }

}  // namespace mgx
