// The MGX CPU kernels, written once over a vector-ops traits class `O` and instantiated per ISA.
//
// Each isa_*.cpp defines its traits (AVX-512, AVX2+FMA, portable scalar), switches the compiler's
// target for the rest of its translation unit, and includes this file inside its own namespace, so
// the instantiations of different ISAs never share a symbol (no ODR merging of AVX-512 code into a
// path an AVX2 machine runs). `O` provides, over a register R of O::W floats:
//   zero, set1, load, store, add, sub, mul, div, max, floor, fma(a, b, c) = a*b + c, hsum, hmax,
//   exp, iota (0..W-1), keep_range, sel_eq, from_bf16 / from_f16 / from_i8 / from_u8 (W elements),
//   nibbles (16 bytes -> low and high nibbles of 16 lanes as 16/W registers each), nibbles_w (W
//   bytes -> one register of each), RI / meta_idx / quad / perm4 (2:4 weights: each lane picks its
//   x[0..3] by index), and the tile sizes kStreamRows and kMicroRows.
//
// Layout of the linear kernels: a weight is processed one tile of 16 output channels at a time.
//  * Streaming (rows <= O::kStreamRows, tiled layout): each k step of a tile is decoded into
//    registers and multiplied into every row at once, so the weight is read exactly once (decode is
//    bandwidth-bound; this is the batch-1 path).
//  * Panel (more rows, the row-major layout, or a narrow last tile): a [KC x 16] block is decoded to
//    float32 in L1 once, then an O::kMicroRows x 16 register-blocked FMA kernel sweeps all rows.
// Both read the artifact's mapped bytes directly; nothing is repacked at load.

// The includer provides the standard headers (before its target switch, so standard-library code
// stays baseline) and wraps this file in its ISA namespace inside namespace mgx.

using R = O::R;
constexpr int W = O::W;
constexpr int NV = int(kTile) / W;  // registers per tile row
constexpr int64_t KC = 256;        // k block of a panel: 16 KiB of float32, stays in L1
constexpr int64_t MC = 128;        // rows per panel sweep: their KC slice of x stays in L2

#define MGX_INLINE __attribute__((always_inline)) inline

inline int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Register tiles are arrays of registers indexed by compile-time constants: unroll<N>(f) calls
// f(std::integral_constant<int, i>) for i = 0..N-1. GCC scalarizes such arrays into registers;
// with plain loops over the indices it keeps them in memory and stores them every iteration.
template <class F, int... I>
MGX_INLINE void unroll_seq(F&& f, std::integer_sequence<int, I...>) {
  (f(std::integral_constant<int, I>{}), ...);
}
template <int N, class F>
MGX_INLINE void unroll(F&& f) {
  unroll_seq(f, std::make_integer_sequence<int, N>{});
}

// dispatch_rows calls fn(std::integral_constant<int, rows>) for a runtime rows in [1, MAX];
// split_rows covers `rows` with blocks of S rows, then of smaller powers of two, calling
// fn(first_row, size): fewer template instances (a faster build) than one per row count.
template <int MAX, class Fn>
MGX_INLINE void dispatch_rows(int64_t rows, Fn&& fn) {
  if constexpr (MAX > 1) {
    if (rows < MAX) return dispatch_rows<MAX - 1>(rows, fn);
  }
  fn(std::integral_constant<int, MAX>{});
}

constexpr int pow2_below(int s) {
  int p = 1;
  while (p * 2 < s) p *= 2;
  return p;
}

template <int S, class Fn>
MGX_INLINE void split_rows(int64_t rows, Fn&& fn, int64_t first = 0) {
  constexpr int P = pow2_below(S);
  int64_t full = rows / S, rest = rows % S;
  if (full > 0 && rest > 0 && rest < P && S + rest <= 2 * P) --full, rest += S;  // 6 + 2 -> 4 + 4
  for (; full > 0; --full, first += S) fn(first, std::integral_constant<int, S>{});
  if constexpr (S > 1) {
    if (rest > 0) split_rows<P>(rest, fn, first);
  }
}

// ------------------------------------------------------------------------------------------------
// Decoders: k steps of one full tile (16 lanes, tiled layout) as float32 registers.
// rows<N>(k, out) writes rows k..k+N-1 (N = KSTEP, or 1 for the last row of an odd K when
// kRowTail), lane-register j of row s at out[s * NV + j]. span() is the k period of per-group
// parameters, loaded by begin(k); post is a per-lane factor applied after the dot product.

template <class T> MGX_INLINE R load_as_f32(const T* p);
template <> MGX_INLINE R load_as_f32<float>(const float* p) { return O::load(p); }
template <> MGX_INLINE R load_as_f32<bf16_t>(const bf16_t* p) { return O::from_bf16(reinterpret_cast<const uint16_t*>(p)); }
template <> MGX_INLINE R load_as_f32<f16_t>(const f16_t* p) { return O::from_f16(reinterpret_cast<const uint16_t*>(p)); }

constexpr int64_t kNoGroups = std::numeric_limits<int64_t>::max();

// Dense and int8 decoders yield two k rows a step, so a batch-1 dot product has two independent
// accumulator chains (one chain would be bound by FMA latency, not by memory).
template <class T>
struct DenseDec {  // scheme none: [tile][K][16] values
  static constexpr int KSTEP = 2;
  static constexpr bool kRowTail = true, kSparse = false;
  const WeightDesc& w;
  const T* base = nullptr;
  const float* post = nullptr;
  explicit DenseDec(const WeightDesc& w_) : w(w_) {}
  void tile(int64_t t) { base = static_cast<const T*>(w.values) + t * kTile * w.k; }
  int64_t span() const { return kNoGroups; }
  void begin(int64_t) {}
  template <int N>
  MGX_INLINE void rows(int64_t k, R* out) const {
    unroll<N>([&](auto s) { unroll<NV>([&](auto j) { out[s * NV + j] = load_as_f32<T>(base + (k + s) * kTile + j * W); }); });
  }
};

struct W8Dec {  // w8a16: [tile][K][16] int8, channel scales applied after the dot product
  static constexpr int KSTEP = 2;
  static constexpr bool kRowTail = true, kSparse = false;
  const WeightDesc& w;
  const int8_t* base = nullptr;
  const float* post = nullptr;
  explicit W8Dec(const WeightDesc& w_) : w(w_) {}
  void tile(int64_t t) {
    base = static_cast<const int8_t*>(w.values) + t * kTile * w.k;
    post = w.scales + t * kTile;
  }
  int64_t span() const { return kNoGroups; }
  void begin(int64_t) {}
  template <int N>
  MGX_INLINE void rows(int64_t k, R* out) const {
    unroll<N>([&](auto s) { unroll<NV>([&](auto j) { out[s * NV + j] = O::from_i8(base + (k + s) * kTile + j * W); }); });
  }
};

// Group parameters of the int4 schemes: W = q * s + (-z * s), loaded per group for 16 lanes.
struct Int4Group {
  R s[NV], zs[NV];
  MGX_INLINE void load(const WeightDesc& w, int64_t t, int64_t g, int64_t groups) {
    const float* sp = w.scales + t * kTile * groups + g * kTile;
    const uint8_t* zp = w.zeros ? w.zeros + t * kTile * groups + g * kTile : nullptr;
    unroll<NV>([&](auto j) {
      s[j] = O::load(sp + j * W);
      const R z = zp ? O::from_u8(zp + j * W) : O::set1(8.0f);
      zs[j] = O::sub(O::zero(), O::mul(z, s[j]));
    });
  }
  // 16 bytes of nibbles -> the dequantized low (first) and high (second) values of 16 lanes.
  MGX_INLINE void decode(const uint8_t* p, R* lo, R* hi) const {
    O::nibbles(p, lo, hi);
    unroll<NV>([&](auto j) {
      lo[j] = O::fma(lo[j], s[j], zs[j]);
      hi[j] = O::fma(hi[j], s[j], zs[j]);
    });
  }
};

struct Int4Dec {  // int4: [tile][K/2][16] bytes, low nibble = even k
  static constexpr int KSTEP = 2;
  static constexpr bool kRowTail = false, kSparse = false;  // K is even: steps are whole
  const WeightDesc& w;
  const uint8_t* base = nullptr;
  const float* post = nullptr;
  int64_t t = 0, groups;
  Int4Group grp;
  explicit Int4Dec(const WeightDesc& w_) : w(w_), groups(group_count(w_)) {}
  void tile(int64_t t_) {
    t = t_;
    base = static_cast<const uint8_t*>(w.values) + t * kTile * value_units(w);
  }
  int64_t span() const { return w.group; }
  MGX_INLINE void begin(int64_t k) { grp.load(w, t, k / w.group, groups); }
  template <int N>
  MGX_INLINE void rows(int64_t k, R* out) const {
    static_assert(N == KSTEP, "int4 steps are whole");
    grp.decode(base + (k / 2) * kTile, out, out + NV);
  }
};

// Expand the two kept values of each lane's 4-column group into 4 dense rows.
MGX_INLINE void expand24(const uint8_t* meta16, const R* v0, const R* v1, R* out) {
  unroll<NV>([&](auto j) {
    const R m = O::from_u8(meta16 + j * W);  // i0 + 4 * i1 as float
    const R i1 = O::floor(O::mul(m, O::set1(0.25f)));
    const R i0 = O::sub(m, O::mul(i1, O::set1(4.0f)));
    unroll<4>([&](auto c) {
      out[c * NV + j] = O::add(O::sel_eq(i0, float(c), v0[j]), O::sel_eq(i1, float(c), v1[j]));
    });
  });
}

template <class T>
struct Sparse24Dec {  // sparse24: values [tile][K/2][16] (kept pairs), meta [tile][K/4][16]
  static constexpr int KSTEP = 4;
  static constexpr bool kRowTail = false, kSparse = true;  // K % 4 == 0
  const WeightDesc& w;
  const T* vals = nullptr;
  const uint8_t* meta = nullptr;
  const float* post = nullptr;
  explicit Sparse24Dec(const WeightDesc& w_) : w(w_) {}
  void tile(int64_t t) {
    vals = static_cast<const T*>(w.values) + t * kTile * (w.k / 2);
    meta = w.meta + t * kTile * (w.k / 4);
  }
  int64_t span() const { return kNoGroups; }
  void begin(int64_t) {}
  MGX_INLINE void kept(int64_t k, R* v0, R* v1) const {
    const T* p = vals + (k / 2) * kTile;
    unroll<NV>([&](auto j) {
      v0[j] = load_as_f32<T>(p + j * W);
      v1[j] = load_as_f32<T>(p + kTile + j * W);
    });
  }
  template <int N>
  MGX_INLINE void rows(int64_t k, R* out) const {
    static_assert(N == KSTEP, "2:4 steps are whole");
    R v0[NV], v1[NV];
    kept(k, v0, v1);
    expand24(meta + (k / 4) * kTile, v0, v1, out);
  }
};

struct Sparse24Int4Dec {  // sparse24_int4: kept values int4 [tile][K/4][16] bytes, meta as sparse24
  static constexpr int KSTEP = 4;
  static constexpr bool kRowTail = false, kSparse = true;
  const WeightDesc& w;
  const uint8_t* vals = nullptr;
  const uint8_t* meta = nullptr;
  const float* post = nullptr;
  int64_t t = 0, groups;
  Int4Group grp;
  explicit Sparse24Int4Dec(const WeightDesc& w_) : w(w_), groups(group_count(w_)) {}
  void tile(int64_t t_) {
    t = t_;
    vals = static_cast<const uint8_t*>(w.values) + t * kTile * (w.k / 4);
    meta = w.meta + t * kTile * (w.k / 4);
  }
  int64_t span() const { return 2 * w.group; }  // a group of g kept values covers 2g columns
  MGX_INLINE void begin(int64_t k) { grp.load(w, t, (k / 2) / w.group, groups); }
  MGX_INLINE void kept(int64_t k, R* v0, R* v1) const { grp.decode(vals + (k / 4) * kTile, v0, v1); }
  template <int N>
  MGX_INLINE void rows(int64_t k, R* out) const {
    static_assert(N == KSTEP, "2:4 steps are whole");
    R v0[NV], v1[NV];
    kept(k, v0, v1);
    expand24(meta + (k / 4) * kTile, v0, v1, out);
  }
};

// Walk k in [k0, k1) in the decoder's steps: begin() at every group boundary, then
// fn(k, std::integral_constant<int, rows>) per step (rows = KSTEP, or 1 for an odd K's last row).
template <class Dec, class Fn>
MGX_INLINE void for_each_step(Dec& dec, int64_t k0, int64_t k1, Fn&& fn) {
  const int64_t span = dec.span();
  for (int64_t k = k0; k < k1;) {
    const int64_t bound = span == kNoGroups ? k1 : std::min(k1, (k / span + 1) * span);
    dec.begin(k);
    for (; k + Dec::KSTEP <= bound; k += Dec::KSTEP) fn(k, std::integral_constant<int, Dec::KSTEP>{});
    if constexpr (Dec::kRowTail) {
      for (; k < bound; ++k) fn(k, std::integral_constant<int, 1>{});
    }
    k = bound;
  }
}

// ------------------------------------------------------------------------------------------------
// Element-wise dequantization of any scheme and layout: rows of the weight as float32.
// Used for the narrow last tile, row-major 2:4 weights, and embedding lookups.

inline float dequant_at(const WeightDesc& w, int64_t n, int64_t kk) {
  const int64_t units = value_units(w);
  auto off = [&](int64_t u, int64_t per_row) { return role_offset(w.layout, w.n, per_row, n, u); };
  auto float_at = [&](int64_t u) {
    switch (w.ftype) {
      case FloatType::F32: return static_cast<const float*>(w.values)[off(u, units)];
      case FloatType::BF16: return bf16_to_f32(static_cast<const uint16_t*>(w.values)[off(u, units)]);
      case FloatType::F16: return f16_to_f32(static_cast<const uint16_t*>(w.values)[off(u, units)]);
    }
    return 0.0f;
  };
  auto int4_at = [&](int64_t idx, int64_t group_index) {  // idx-th nibble of the row
    const uint8_t byte = static_cast<const uint8_t*>(w.values)[off(idx / 2, units)];
    const int q = (idx & 1) ? (byte >> 4) : (byte & 15);
    const int64_t groups = group_count(w);
    const float s = w.scales[off(group_index, groups)];
    const float z = w.zeros ? float(w.zeros[off(group_index, groups)]) : 8.0f;
    return (float(q) - z) * s;
  };
  switch (w.scheme) {
    case Scheme::None:
      return float_at(kk);
    case Scheme::W8A16:
      return float(static_cast<const int8_t*>(w.values)[off(kk, units)]) * w.scales[n];
    case Scheme::Int4:
      return int4_at(kk, kk / w.group);
    case Scheme::Sparse24:
    case Scheme::Sparse24Int4: {
      const uint8_t m = w.meta[off(kk / 4, w.k / 4)];
      const int c = int(kk % 4);
      int slot = -1;
      if ((m & 3) == c) slot = 0;
      else if (((m >> 2) & 3) == c) slot = 1;
      if (slot < 0) return 0.0f;
      const int64_t u = (kk / 4) * 2 + slot;  // index among the kept values
      return w.scheme == Scheme::Sparse24 ? float_at(u) : int4_at(u, u / w.group);
    }
  }
  return 0.0f;
}

inline void dequant_row(const WeightDesc& w, int64_t n, int64_t k0, int64_t k1, float* out) {
  if (w.layout == Layout::RowMajor && w.scheme == Scheme::None && w.ftype == FloatType::F32) {
    std::memcpy(out, static_cast<const float*>(w.values) + n * w.k + k0, size_t(k1 - k0) * 4);
    return;
  }
  for (int64_t kk = k0; kk < k1; ++kk) out[kk - k0] = dequant_at(w, n, kk);
}

// Panel of tile t, columns [k0, k1), from element-wise dequantization; lanes past the tile are 0.
inline void generic_panel(const WeightDesc& w, int64_t t, int64_t k0, int64_t k1, float* panel, float* row) {
  const int64_t width = std::min<int64_t>(kTile, w.n - t * kTile);
  for (int64_t lane = 0; lane < kTile; ++lane) {
    if (lane < width) {
      dequant_row(w, t * kTile + lane, k0, k1, row);
      for (int64_t kk = 0; kk < k1 - k0; ++kk) panel[kk * kTile + lane] = row[kk];
    } else {
      for (int64_t kk = 0; kk < k1 - k0; ++kk) panel[kk * kTile + lane] = 0.0f;
    }
  }
}

// Panel of a full tile in the tiled layout, through the vector decoder (post factors folded in).
template <class Dec>
inline void tiled_panel(Dec& dec, int64_t k0, int64_t k1, float* panel) {
  for_each_step(dec, k0, k1, [&](int64_t k, auto nrows) __attribute__((always_inline)) {
    constexpr int N = decltype(nrows)::value;
    R rows[N * NV];
    dec.template rows<N>(k, rows);
    unroll<N>([&](auto s) {
      unroll<NV>([&](auto j) {
        R v = rows[s * NV + j];
        if (dec.post) v = O::mul(v, O::load(dec.post + j * W));
        O::store(panel + (k - k0 + s) * kTile + j * W, v);
      });
    });
  });
}

// ------------------------------------------------------------------------------------------------
// Row-major weights (no reorder_weights, or an LM head tied to a row-major embedding table): dot
// products along k, vectorized over k, NB weight rows times MB x rows per pass.

template <class T>
struct RowDense {  // none: W[n, k] values; no per-row factor
  const T* base;
  int64_t k;
  explicit RowDense(const WeightDesc& w) : base(static_cast<const T*>(w.values)), k(w.k) {}
  MGX_INLINE R load(int64_t n, int64_t kk) const { return load_as_f32<T>(base + n * k + kk); }
  float at(int64_t n, int64_t kk) const { return to_f32(base[n * k + kk]); }
  float post(int64_t) const { return 1.0f; }
};

struct RowW8 {  // w8a16: W[n, k] int8, times scales[n] after the dot product
  const int8_t* base;
  const float* scales;
  int64_t k;
  explicit RowW8(const WeightDesc& w) : base(static_cast<const int8_t*>(w.values)), scales(w.scales), k(w.k) {}
  MGX_INLINE R load(int64_t n, int64_t kk) const { return O::from_i8(base + n * k + kk); }
  float at(int64_t n, int64_t kk) const { return float(base[n * k + kk]); }
  float post(int64_t n) const { return scales[n]; }
};

template <class Row, int MB, int NB>
inline void rowdot_block(const Row& row, const float* x, int64_t ldx, int64_t n0, int64_t k, float* y, int64_t ldy,
                         const float* bias) {
  R acc[MB][NB];
  unroll<MB>([&](auto i) { unroll<NB>([&](auto j) { acc[i][j] = O::zero(); }); });
  int64_t kk = 0;
  for (; kk + W <= k; kk += W) {
    R wv[NB];
    unroll<NB>([&](auto j) { wv[j] = row.load(n0 + j, kk); });
    unroll<MB>([&](auto i) {
      const R xv = O::load(x + i * ldx + kk);
      unroll<NB>([&](auto j) { acc[i][j] = O::fma(wv[j], xv, acc[i][j]); });
    });
  }
  unroll<MB>([&](auto i) {
    unroll<NB>([&](auto j) {
      float sum = O::hsum(acc[i][j]);
      for (int64_t t = kk; t < k; ++t) sum += row.at(n0 + j, t) * x[i * ldx + t];
      sum *= row.post(n0 + j);
      y[i * ldy + j] = bias ? sum + bias[n0 + j] : sum;
    });
  });
}

// Rows [n0, n1) of the output for all m rows.
template <class Row>
void rowdot(const Row& row, const float* x, int64_t ldx, int64_t m, int64_t n0, int64_t n1, int64_t k, float* y,
            int64_t ldy, const float* bias) {
  constexpr int NB = 2;
  split_rows<O::kStreamRows>(m, [&](int64_t m0, auto rows) {
    constexpr int M = decltype(rows)::value;
    const float* xm = x + m0 * ldx;
    float* ym = y + m0 * ldy;
    for (int64_t n = n0; n < n1; n += NB) {
      if (n + NB <= n1) rowdot_block<Row, M, NB>(row, xm, ldx, n, k, ym + n, ldy, bias);
      else rowdot_block<Row, M, 1>(row, xm, ldx, n, k, ym + n, ldy, bias);
    }
  });
}

// int4 rows: byte b of a row holds columns 2b (low nibble) and 2b+1. x is split once into its even
// and odd columns so that a register of low nibbles meets a register of even x values. Per group,
// sum_k x_k (q_k - z) s = s * (sum_k x_k q_k) - s * z * (sum_k x_k): the first term accumulates in
// vector form (no horizontal sum per group), the second from per-group sums of x.
struct Int4Rows {
  const WeightDesc& w;
  int64_t groups, half;
  std::vector<float> xe, xo, xs;  // [m, K/2] even and odd columns, [m, groups] group sums
  explicit Int4Rows(const WeightDesc& w_) : w(w_), groups(group_count(w_)), half(w_.k / 2) {}
  void prepare(const float* x, int64_t ldx, int64_t m) {
    xe.assign(size_t(m * half), 0.0f);
    xo.assign(size_t(m * half), 0.0f);
    xs.assign(size_t(m * groups), 0.0f);
    for (int64_t i = 0; i < m; ++i)
      for (int64_t kk = 0; kk < w.k; ++kk) {
        const float v = x[i * ldx + kk];
        (kk % 2 ? xo : xe)[size_t(i * half + kk / 2)] = v;
        xs[size_t(i * groups + kk / w.group)] += v;
      }
  }
};

template <int MB, int NB>
inline void int4_rowdot_block(const Int4Rows& r, int64_t m0, int64_t n0, float* y, int64_t ldy, const float* bias) {
  const WeightDesc& w = r.w;
  const uint8_t* q = static_cast<const uint8_t*>(w.values);
  R total[MB][NB];
  float zterm[MB][NB];
  unroll<MB>([&](auto i) { unroll<NB>([&](auto j) { total[i][j] = O::zero(), zterm[i][j] = 0.0f; }); });
  for (int64_t g = 0; g < r.groups; ++g) {
    const int64_t b0 = g * w.group / 2, b1 = std::min(r.half, (g + 1) * w.group / 2);
    R acc[MB][NB];
    unroll<MB>([&](auto i) { unroll<NB>([&](auto j) { acc[i][j] = O::zero(); }); });
    int64_t b = b0;
    for (; b + W <= b1; b += W) {
      R lo[NB], hi[NB];
      unroll<NB>([&](auto j) { O::nibbles_w(q + (n0 + j) * r.half + b, lo[j], hi[j]); });
      unroll<MB>([&](auto i) {
        const R e = O::load(r.xe.data() + (m0 + i) * r.half + b), o = O::load(r.xo.data() + (m0 + i) * r.half + b);
        unroll<NB>([&](auto j) { acc[i][j] = O::fma(hi[j], o, O::fma(lo[j], e, acc[i][j])); });
      });
    }
    unroll<NB>([&](auto j) {
      const int64_t n = n0 + j;
      const float s = w.scales[n * r.groups + g];
      const float z = w.zeros ? float(w.zeros[n * r.groups + g]) : 8.0f;
      unroll<MB>([&](auto i) {
        float tail = 0.0f;  // bytes of the group past the last whole register
        for (int64_t t = b; t < b1; ++t) {
          const uint8_t byte = q[n * r.half + t];
          tail += float(byte & 15) * r.xe[size_t((m0 + i) * r.half + t)] +
                  float(byte >> 4) * r.xo[size_t((m0 + i) * r.half + t)];
        }
        total[i][j] = O::fma(acc[i][j], O::set1(s), total[i][j]);
        zterm[i][j] += s * (z * r.xs[size_t((m0 + i) * r.groups + g)] - tail);
      });
    });
  }
  unroll<MB>([&](auto i) {
    unroll<NB>([&](auto j) {
      const float v = O::hsum(total[i][j]) - zterm[i][j];
      y[i * ldy + j] = bias ? v + bias[n0 + j] : v;
    });
  });
}

void int4_rowdot(const Int4Rows& r, int64_t m, int64_t n0, int64_t n1, float* y, int64_t ldy, const float* bias) {
  constexpr int NB = 2;
  split_rows<O::kStreamRows>(m, [&](int64_t m0, auto rows) {
    constexpr int M = decltype(rows)::value;
    for (int64_t n = n0; n < n1; n += NB) {
      if (n + NB <= n1) int4_rowdot_block<M, NB>(r, m0, n, y + m0 * ldy + n, ldy, bias);
      else int4_rowdot_block<M, 1>(r, m0, n, y + m0 * ldy + n, ldy, bias);
    }
  });
}

// ------------------------------------------------------------------------------------------------
// Linear: y[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]).

// Store one register of an output row: y (+)= v (+ bias), only `lanes` lanes when the tile is narrow.
MGX_INLINE void store_reg(float* y, R v, int64_t lanes, bool accumulate, const float* bias) {
  if (lanes >= W) {
    if (accumulate) v = O::add(O::load(y), v);
    if (bias) v = O::add(v, O::load(bias));
    O::store(y, v);
    return;
  }
  alignas(64) float tmp[W];
  O::store(tmp, v);
  for (int64_t l = 0; l < lanes; ++l) {
    const float r = accumulate ? y[l] + tmp[l] : tmp[l];
    y[l] = bias ? r + bias[l] : r;
  }
}

// MR rows x 16 lanes over a decoded panel [kc][16]; accumulators live in registers.
template <int MR>
inline void micro(const float* panel, int64_t kc, const float* x, int64_t ldx, float* y, int64_t ldy,
                  int64_t width, bool accumulate, const float* bias) {
  R acc[MR][NV];
  unroll<MR>([&](auto i) { unroll<NV>([&](auto j) { acc[i][j] = O::zero(); }); });
  for (int64_t k = 0; k < kc; ++k) {
    R b[NV];
    unroll<NV>([&](auto j) { b[j] = O::load(panel + k * kTile + j * W); });
    unroll<MR>([&](auto i) {
      const R xi = O::set1(x[i * ldx + k]);
      unroll<NV>([&](auto j) { acc[i][j] = O::fma(b[j], xi, acc[i][j]); });
    });
  }
  unroll<MR>([&](auto i) {
    unroll<NV>([&](auto j) {
      if (width > j * W)
        store_reg(y + i * ldy + j * W, acc[i][j], width - j * W, accumulate, bias ? bias + j * W : nullptr);
    });
  });
}

// M rows streamed through one full tile: decode each k step once, FMA it into every row. At small M
// the rows of a step alternate between U accumulator sets, for enough independent FMA chains.
template <class Dec, int M>
inline void stream_tile(Dec& dec, const float* x, int64_t ldx, float* y, int64_t ldy, const float* bias) {
  constexpr int U = M * NV >= 8 ? 1 : 2;
  R acc[U][M][NV];
  unroll<U>([&](auto u) { unroll<M>([&](auto i) { unroll<NV>([&](auto j) { acc[u][i][j] = O::zero(); }); }); });
  for_each_step(dec, 0, dec.w.k, [&](int64_t k, auto nrows) __attribute__((always_inline)) {
    constexpr int N = decltype(nrows)::value;
    R rows[N * NV];
    dec.template rows<N>(k, rows);
    unroll<N>([&](auto s) {
      unroll<M>([&](auto i) {
        const R xi = O::set1(x[i * ldx + k + s]);
        unroll<NV>([&](auto j) { acc[s % U][i][j] = O::fma(rows[s * NV + j], xi, acc[s % U][i][j]); });
      });
    });
  });
  unroll<M>([&](auto i) {
    unroll<NV>([&](auto j) {
      R v = acc[0][i][j];
      if constexpr (U > 1) v = O::add(v, acc[1][i][j]);
      if (dec.post) v = O::mul(v, O::load(dec.post + j * W));
      store_reg(y + i * ldy + j * W, v, W, false, bias ? bias + j * W : nullptr);
    });
  });
}

// INT4 at small batch: the codes (0..15) multiply x as they are, and each group's scale and zero
// point are applied once per group and lane: y += s * (sum_k q x - z * sum_k x). Per 32 weights this
// saves the FMAs that dequantize each code (the batch-1 int4 product is bound by instructions on
// AVX2, not by bytes). The rounding differs from dequantize-then-multiply by float32 ulps only.
// xsum[i * groups + g]: the sum of row i of x over group g (computed once per call, not per tile).
template <int M>
inline void stream_tile_int4(const Int4Dec& dec, const float* x, int64_t ldx, const float* xsum, float* y,
                             int64_t ldy, const float* bias) {
  const WeightDesc& w = dec.w;
  constexpr int U = M * NV < 8 ? 2 : 1;  // low and high nibbles in separate chains when few rows
  const float* scales = w.scales + dec.t * kTile * dec.groups;
  const uint8_t* zeros = w.zeros ? w.zeros + dec.t * kTile * dec.groups : nullptr;
  R acc[M][NV];
  unroll<M>([&](auto i) { unroll<NV>([&](auto j) { acc[i][j] = O::zero(); }); });
  for (int64_t g = 0, k0 = 0; k0 < w.k; ++g, k0 += w.group) {
    const int64_t k1 = std::min<int64_t>(w.k, k0 + w.group);
    R part[U][M][NV];
    unroll<U>([&](auto u) { unroll<M>([&](auto i) { unroll<NV>([&](auto j) { part[u][i][j] = O::zero(); }); }); });
    for (int64_t k = k0; k < k1; k += 2) {
      R lo[NV], hi[NV];
      O::nibbles(dec.base + (k / 2) * kTile, lo, hi);
      unroll<M>([&](auto i) {
        const R x0 = O::set1(x[i * ldx + k]), x1 = O::set1(x[i * ldx + k + 1]);
        unroll<NV>([&](auto j) {
          part[0][i][j] = O::fma(lo[j], x0, part[0][i][j]);
          part[U - 1][i][j] = O::fma(hi[j], x1, part[U - 1][i][j]);
        });
      });
    }
    unroll<M>([&](auto i) {
      const R vxs = O::set1(xsum[i * dec.groups + g]);
      unroll<NV>([&](auto j) {
        R q = part[0][i][j];
        if constexpr (U > 1) q = O::add(q, part[1][i][j]);
        const R z = zeros ? O::from_u8(zeros + g * kTile + j * W) : O::set1(8.0f);
        const R s = O::load(scales + g * kTile + j * W);
        acc[i][j] = O::fma(s, O::sub(q, O::mul(z, vxs)), acc[i][j]);
      });
    });
  }
  unroll<M>([&](auto i) {
    unroll<NV>([&](auto j) { store_reg(y + i * ldy + j * W, acc[i][j], W, false, bias ? bias + j * W : nullptr); });
  });
}

// 2:4 sparse weights at small batch: instead of expanding zeros, each lane picks its two x values
// with a permute (perm4), so only the kept values and their metadata are read and multiplied.
template <class Dec, int M>
inline void stream_tile_24(Dec& dec, const float* x, int64_t ldx, float* y, int64_t ldy, const float* bias) {
  using RI = typename O::RI;
  R acc[M][NV];
  unroll<M>([&](auto i) { unroll<NV>([&](auto j) { acc[i][j] = O::zero(); }); });
  for_each_step(dec, 0, dec.w.k, [&](int64_t k, auto) __attribute__((always_inline)) {
    R v0[NV], v1[NV];
    dec.kept(k, v0, v1);
    RI i0[NV], i1[NV];
    unroll<NV>([&](auto j) { O::meta_idx(dec.meta + (k / 4) * kTile + j * W, i0[j], i1[j]); });
    unroll<M>([&](auto i) {
      const auto x4 = O::quad(x + i * ldx + k);
      unroll<NV>([&](auto j) {
        acc[i][j] = O::fma(v0[j], O::perm4(x4, i0[j]), acc[i][j]);
        acc[i][j] = O::fma(v1[j], O::perm4(x4, i1[j]), acc[i][j]);
      });
    });
  });
  unroll<M>([&](auto i) {
    unroll<NV>([&](auto j) { store_reg(y + i * ldy + j * W, acc[i][j], W, false, bias ? bias + j * W : nullptr); });
  });
}

// Tiles [t0, t1) of the output for all m rows, single-threaded; y points at output column 0.
template <class Dec>
void linear_tiles(const WeightDesc& w, const float* x, int64_t ldx, int64_t m, float* y, int64_t ldy,
                  int64_t t0, int64_t t1) {
  alignas(64) float panel[KC * kTile];
  std::vector<float> row;
  Dec dec(w);
  std::vector<float> xsum;  // int4 streaming: each row's sum of x per group
  if constexpr (std::is_same_v<Dec, Int4Dec>) {
    if (m <= O::kStreamRows && w.layout == Layout::Tile16) {
      xsum.assign(m * dec.groups, 0.0f);
      for (int64_t i = 0; i < m; ++i)
        for (int64_t k = 0; k < w.k; ++k) xsum[i * dec.groups + k / w.group] += x[i * ldx + k];
    }
  }
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t width = std::min<int64_t>(kTile, w.n - t * kTile);
    const bool tiled = w.layout == Layout::Tile16 && width == kTile;
    const float* bias = w.bias ? w.bias + t * kTile : nullptr;
    float* yt = y + t * kTile;
    if (tiled) dec.tile(t);
    if (tiled && m <= O::kStreamRows) {
      dispatch_rows<O::kStreamRows>(m, [&](auto rows) {
        constexpr int M = decltype(rows)::value;
        if constexpr (Dec::kSparse) stream_tile_24<Dec, M>(dec, x, ldx, yt, ldy, bias);
        else if constexpr (std::is_same_v<Dec, Int4Dec>) stream_tile_int4<M>(dec, x, ldx, xsum.data(), yt, ldy, bias);
        else stream_tile<Dec, M>(dec, x, ldx, yt, ldy, bias);
      });
      continue;
    }
    if (!tiled && row.empty()) row.resize(KC);
    for (int64_t m0 = 0; m0 < m; m0 += MC) {
      const int64_t mb = std::min(MC, m - m0);
      for (int64_t k0 = 0; k0 < w.k; k0 += KC) {
        const int64_t k1 = std::min(w.k, k0 + KC);
        if (tiled) tiled_panel(dec, k0, k1, panel);
        else generic_panel(w, t, k0, k1, panel, row.data());
        const float* last_bias = k1 == w.k ? bias : nullptr;
        split_rows<O::kMicroRows>(mb, [&](int64_t r, auto rows) {
          micro<decltype(rows)::value>(panel, k1 - k0, x + (m0 + r) * ldx + k0, ldx, yt + (m0 + r) * ldy, ldy, width,
                                       k0 > 0, last_bias);
        });
      }
    }
  }
}

template <class Row>
void rowmajor_tiles(const WeightDesc& w, const float* x, int64_t ldx, int64_t m, float* y, int64_t ldy, int64_t t0,
                    int64_t t1) {
  rowdot(Row(w), x, ldx, m, t0 * kTile, std::min(w.n, t1 * kTile), w.k, y, ldy, w.bias);
}

void int4_rowmajor_tiles(const WeightDesc& w, const float* x, int64_t ldx, int64_t m, float* y, int64_t ldy,
                         int64_t t0, int64_t t1) {
  Int4Rows rows(w);
  rows.prepare(x, ldx, m);
  int4_rowdot(rows, m, t0 * kTile, std::min(w.n, t1 * kTile), y, ldy, w.bias);
}

using TilesFn = void (*)(const WeightDesc&, const float*, int64_t, int64_t, float*, int64_t, int64_t, int64_t);

template <template <class> class Tmpl>
inline TilesFn by_float_type(FloatType t) {
  switch (t) {
    case FloatType::F32: return Tmpl<float>::run;
    case FloatType::BF16: return Tmpl<bf16_t>::run;
    case FloatType::F16: return Tmpl<f16_t>::run;
  }
  return nullptr;
}

template <class T> struct TiledDense { static constexpr TilesFn run = &linear_tiles<DenseDec<T>>; };
template <class T> struct TiledSparse { static constexpr TilesFn run = &linear_tiles<Sparse24Dec<T>>; };
template <class T> struct RowMajorDense { static constexpr TilesFn run = &rowmajor_tiles<RowDense<T>>; };

// The tile function of a weight. Row-major sparse weights take the generic (element-wise) panel
// path of linear_tiles: correct, and slow; reorder_weights gives them the tiled layout.
inline TilesFn tiles_fn(const WeightDesc& w) {
  const bool rows = w.layout == Layout::RowMajor;
  switch (w.scheme) {
    case Scheme::None: return rows ? by_float_type<RowMajorDense>(w.ftype) : by_float_type<TiledDense>(w.ftype);
    case Scheme::W8A16: return rows ? &rowmajor_tiles<RowW8> : &linear_tiles<W8Dec>;
    case Scheme::Int4: return rows ? &int4_rowmajor_tiles : &linear_tiles<Int4Dec>;
    case Scheme::Sparse24: return by_float_type<TiledSparse>(w.ftype);
    case Scheme::Sparse24Int4: return &linear_tiles<Sparse24Int4Dec>;
  }
  return nullptr;
}

// Threads for `work` multiply-adds (or elements) split into at most `parts` pieces: one per 64K, so a
// small op never pays a fork/join (microseconds, and far more when the cores are shared).
inline int threads_for(int64_t work, int64_t parts) {
  constexpr int64_t kWorkPerThread = int64_t(1) << 16;
  return int(std::max<int64_t>(1, std::min<int64_t>({num_threads(), parts, work / kWorkPerThread})));
}

// Contiguous tile ranges per thread: each thread streams its own slice of the weight.
template <class Fn>
inline void parallel_tiles(int64_t ntiles, int64_t work, Fn&& fn) {
  const int threads = threads_for(work, ntiles);
#ifdef _OPENMP
  if (threads > 1) {
#pragma omp parallel num_threads(threads)
    {
      const int id = omp_get_thread_num(), n = omp_get_num_threads();
      fn(ntiles * id / n, ntiles * (id + 1) / n);
    }
    return;
  }
#endif
  (void)threads;
  fn(int64_t(0), ntiles);
}

void linear(const WeightDesc& w, const float* x, int64_t ldx, int64_t m, float* y, int64_t ldy) {
  const TilesFn fn = tiles_fn(w);
  parallel_tiles(cdiv(w.n, kTile), w.n * w.k * m, [&](int64_t t0, int64_t t1) { fn(w, x, ldx, m, y, ldy, t0, t1); });
}

void linear_argmax(const WeightDesc& w, const float* x, int64_t ldx, int64_t m, int64_t* index, float* value) {
  const TilesFn fn = tiles_fn(w);
  constexpr int64_t chunk = 64;  // tiles per logits block: [m, 1024] floats at a time
  const int64_t ntiles = cdiv(w.n, kTile);
  const int threads = std::max(1, num_threads());
  std::vector<int64_t> best_i(size_t(threads) * m, -1);
  std::vector<float> best_v(size_t(threads) * m, -std::numeric_limits<float>::infinity());
  parallel_tiles(ntiles, w.n * w.k * m, [&](int64_t t0, int64_t t1) {
#ifdef _OPENMP
    const int id = omp_get_thread_num();
#else
    const int id = 0;
#endif
    std::vector<float> logits(size_t(m) * chunk * kTile);
    int64_t* bi = best_i.data() + size_t(id) * m;
    float* bv = best_v.data() + size_t(id) * m;
    for (int64_t c0 = t0; c0 < t1; c0 += chunk) {
      const int64_t c1 = std::min(t1, c0 + chunk);
      const int64_t ld = chunk * kTile;
      fn(w, x, ldx, m, logits.data() - c0 * kTile, ld, c0, c1);
      const int64_t n1 = std::min(w.n, c1 * kTile);
      for (int64_t i = 0; i < m; ++i) {
        const float* row = logits.data() + i * ld - c0 * kTile;
        for (int64_t n = c0 * kTile; n < n1; ++n) {
          // NaN counts as -inf (as the GPU heads): never picked over a number, and a row of NaN gives
          // its first id with -inf (a NaN first logit used to hold its place against every number).
          const float v = row[n] == row[n] ? row[n] : -std::numeric_limits<float>::infinity();
          if (v > bv[i] || bi[i] < 0) bv[i] = v, bi[i] = n;
        }
      }
    }
  });
  // Threads hold ascending tile ranges: a later thread wins only with a strictly larger value.
  for (int64_t i = 0; i < m; ++i) {
    index[i] = -1;
    value[i] = -std::numeric_limits<float>::infinity();
    for (int th = 0; th < threads; ++th) {
      const int64_t bi = best_i[size_t(th) * m + i];
      const float bv = best_v[size_t(th) * m + i];
      if (bi >= 0 && (index[i] < 0 || bv > value[i])) index[i] = bi, value[i] = bv;
    }
  }
}

void gather_rows(const WeightDesc& w, const int64_t* rows, int64_t count, float* out, int64_t ldo) {
#pragma omp parallel for num_threads(threads_for(count * w.k * 8, count)) schedule(static)
  for (int64_t i = 0; i < count; ++i) dequant_row(w, rows[i], 0, w.k, out + i * ldo);
}

// ------------------------------------------------------------------------------------------------
// Element-wise kernels. Rows are independent: threads split rows when there are enough of them.

inline int row_threads(int64_t rows, int64_t work_per_row) { return threads_for(rows * work_per_row, rows); }

void rms_norm(const float* x, int64_t ldx, const float* res, int64_t ldr, int64_t t, int64_t f, int64_t group,
              const float* weight, float eps, float* sum_out, int64_t lds, float* out, int64_t ldo) {
#pragma omp parallel for num_threads(row_threads(t, f)) schedule(static)
  for (int64_t r = 0; r < t; ++r) {
    const float* xr = x + r * ldx;
    const float* src = xr;
    if (res) {  // fused residual add: the sum is both an output and the norm's input
      float* s = sum_out + r * lds;
      const float* rr = res + r * ldr;
      int64_t i = 0;
      for (; i + W <= f; i += W) O::store(s + i, O::add(O::load(xr + i), O::load(rr + i)));
      for (; i < f; ++i) s[i] = xr[i] + rr[i];
      src = s;
    }
    float* o = out + r * ldo;
    for (int64_t g0 = 0; g0 < f; g0 += group) {
      const float* gx = src + g0;
      R acc = O::zero();
      int64_t i = 0;
      for (; i + W <= group; i += W) {
        const R v = O::load(gx + i);
        acc = O::fma(v, v, acc);
      }
      float ss = O::hsum(acc);
      for (; i < group; ++i) ss += gx[i] * gx[i];
      const float inv = 1.0f / std::sqrt(ss / float(group) + eps);
      const R vinv = O::set1(inv);
      float* go = o + g0;
      i = 0;
      if (weight) {
        for (; i + W <= group; i += W) O::store(go + i, O::mul(O::mul(O::load(gx + i), vinv), O::load(weight + i)));
        for (; i < group; ++i) go[i] = gx[i] * inv * weight[i];
      } else {
        for (; i + W <= group; i += W) O::store(go + i, O::mul(O::load(gx + i), vinv));
        for (; i < group; ++i) go[i] = gx[i] * inv;
      }
    }
  }
}

void rope(const float* x, int64_t ldx, int64_t t, int64_t heads, int64_t d, int64_t rot, const float* cos,
          const float* sin, float* out, int64_t ldo) {
  const int64_t half = rot / 2;
#pragma omp parallel for num_threads(row_threads(t, heads * d)) schedule(static)
  for (int64_t r = 0; r < t; ++r) {
    const float* c = cos + r * half;
    const float* s = sin + r * half;
    for (int64_t h = 0; h < heads; ++h) {
      const float* xh = x + r * ldx + h * d;
      float* oh = out + r * ldo + h * d;
      int64_t i = 0;
      for (; i + W <= half; i += W) {
        const R x1 = O::load(xh + i), x2 = O::load(xh + half + i);
        const R ci = O::load(c + i), si = O::load(s + i);
        O::store(oh + i, O::sub(O::mul(x1, ci), O::mul(x2, si)));
        O::store(oh + half + i, O::add(O::mul(x2, ci), O::mul(x1, si)));
      }
      for (; i < half; ++i) {
        const float x1 = xh[i], x2 = xh[half + i];
        oh[i] = x1 * c[i] - x2 * s[i];
        oh[half + i] = x2 * c[i] + x1 * s[i];
      }
      if (oh != xh)
        for (int64_t j = rot; j < d; ++j) oh[j] = xh[j];
    }
  }
}

void silu_mul(const float* gate, int64_t ldg, const float* up, int64_t ldu, int64_t t, int64_t f, float* out,
              int64_t ldo) {
#pragma omp parallel for num_threads(row_threads(t, f)) schedule(static)
  for (int64_t r = 0; r < t; ++r) {
    const float* g = gate + r * ldg;
    const float* u = up + r * ldu;
    float* o = out + r * ldo;
    int64_t i = 0;
    const R one = O::set1(1.0f);
    for (; i + W <= f; i += W) {
      const R gv = O::load(g + i);
      const R sig = O::div(one, O::add(one, O::exp(O::sub(O::zero(), gv))));
      O::store(o + i, O::mul(O::mul(gv, sig), O::load(u + i)));
    }
    for (; i < f; ++i) o[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
  }
}

// ------------------------------------------------------------------------------------------------
// Paged attention. Work items are (sequence, kv head, tile of up to QT query rows); each walks the
// visible keys in chunks of 16 positions with an online softmax. The item's query vectors (its rows
// times the G query heads sharing the kv head) reuse each chunk's K (transposed to [D][16]) and V.

constexpr int64_t QT = 32;            // query rows per work item (prefill): each gathers a chunk of K/V once
constexpr int64_t kGatherQueries = 8;  // from this many query vectors per item, transpose each chunk of K

// Scores of Q queries (rows of q, stride ldq) against a chunk of 16 keys stored transposed, kt[e][16].
template <int Q>
inline void chunk_scores(const float* q, int64_t ldq, const float* kt, int64_t d, float* out) {
  R acc[Q][NV];
  unroll<Q>([&](auto i) { unroll<NV>([&](auto j) { acc[i][j] = O::zero(); }); });
  for (int64_t e = 0; e < d; ++e) {
    R k[NV];
    unroll<NV>([&](auto j) { k[j] = O::load(kt + e * kTile + j * W); });
    unroll<Q>([&](auto i) {
      const R qe = O::set1(q[i * ldq + e]);
      unroll<NV>([&](auto j) { acc[i][j] = O::fma(qe, k[j], acc[i][j]); });
    });
  }
  unroll<Q>([&](auto i) { unroll<NV>([&](auto j) { O::store(out + i * kTile + j * W, acc[i][j]); }); });
}

// od[0..d) = od * corr + sum_j p[j] * rows[j][0..d) for j in [j0, j1). Up to eight registers of the
// output stay in registers while the keys stream by: eight independent FMA chains, one broadcast
// of p[j] per key; rows of 16-bit caches are converted as they are read.
template <class T>
inline void accumulate_pv(float* od, float corr, const float* p, const T* const* rows, int64_t j0, int64_t j1,
                          int64_t d) {
  const R vcorr = O::set1(corr);
  const int64_t whole = d / W * W;
  for (int64_t e0 = 0; e0 < whole; e0 += 8 * W) {
    const int64_t n = std::min<int64_t>(8, (whole - e0) / W);
    R acc[8];
    unroll<8>([&](auto u) { acc[u] = u < n ? O::mul(O::load(od + e0 + u * W), vcorr) : O::zero(); });
    for (int64_t j = j0; j < j1; ++j) {
      const R pj = O::set1(p[j]);
      const T* row = rows[j] + e0;
      unroll<8>([&](auto u) {
        if (u < n) acc[u] = O::fma(pj, load_as_f32<T>(row + u * W), acc[u]);
      });
    }
    unroll<8>([&](auto u) {
      if (u < n) O::store(od + e0 + u * W, acc[u]);
    });
  }
  for (int64_t e = whole; e < d; ++e) {  // a head width that is not whole registers
    float acc = od[e] * corr;
    for (int64_t j = j0; j < j1; ++j) acc += p[j] * to_f32(rows[j][e]);
    od[e] = acc;
  }
}

template <class KT>
void attention_impl(const AttentionArgs& a) {
  const int64_t hq = a.num_heads, hk = a.num_kv_heads, d = a.head_dim, G = hq / hk, bs = a.block_size;
  KT* kc = static_cast<KT*>(a.k_cache);
  KT* vc = static_cast<KT*>(a.v_cache);
  auto slot_of = [&](int64_t seq, int64_t pos) {
    return int64_t(a.block_table[seq * a.max_blocks + pos / bs]) * bs + pos % bs;
  };
  // 1. Write this step's keys and values into their slots.
  std::vector<int32_t> seq_of(size_t(a.num_tokens));
  for (int64_t i = 0; i < a.num_seqs; ++i)
    for (int64_t r = a.query_start[i]; r < a.query_start[i + 1]; ++r) seq_of[size_t(r)] = int32_t(i);
#pragma omp parallel for num_threads(row_threads(a.num_tokens, hk * d)) schedule(static)
  for (int64_t r = 0; r < a.num_tokens; ++r) {
    const int64_t slot = slot_of(seq_of[size_t(r)], a.positions[r]);
    KT* kd = kc + slot * hk * d;
    KT* vd = vc + slot * hk * d;
    for (int64_t e = 0; e < hk * d; ++e) {
      kd[e] = from_f32<KT>(a.k[r * a.ldk + e]);
      vd[e] = from_f32<KT>(a.v[r * a.ldv + e]);
    }
  }
  // 2. Attend.
  struct Item { int64_t seq, head, r0, r1; };
  std::vector<Item> items;
  for (int64_t i = 0; i < a.num_seqs; ++i)
    for (int64_t h = 0; h < hk; ++h)
      for (int64_t r0 = a.query_start[i]; r0 < a.query_start[i + 1]; r0 += QT)
        items.push_back({i, h, r0, std::min<int64_t>(r0 + QT, a.query_start[i + 1])});
  const int64_t dp = cdiv(d, W) * W;  // head width padded to whole registers
  const int64_t nitems = int64_t(items.size());
  int64_t work = 0;  // query-key dot products times head width, both for scores and for values
  for (int64_t i = 0; i < a.num_seqs; ++i) work += 2 * (a.query_start[i + 1] - a.query_start[i]) * a.context_lens[i] * hq * d;
  const int threads = threads_for(work, nitems);
  (void)threads;  // unused when built without OpenMP
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> qbuf(size_t(QT * G * dp)), obuf(size_t(QT * G * dp)), kt(size_t(dp * kTile)),
        vbuf(size_t(kTile * dp)), mrow(size_t(QT * G)), lrow(size_t(QT * G));
    std::vector<const KT*> krow(kTile), vrow(kTile);
    std::vector<const float*> vtile(kTile);
    std::vector<float> sbuf(size_t(QT * G * kTile));
    alignas(64) float p[kTile];
    const R lane_pos = O::iota();
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < nitems; ++it) {
      const Item item = items[size_t(it)];
      const int64_t nq = (item.r1 - item.r0) * G;
      int64_t pmin = std::numeric_limits<int64_t>::max(), pmax = -1;
      for (int64_t r = item.r0; r < item.r1; ++r) {
        pmin = std::min(pmin, a.positions[r]);
        pmax = std::max(pmax, a.positions[r]);
      }
      pmax = std::min<int64_t>(pmax, a.context_lens[item.seq] - 1);
      for (int64_t qi = 0; qi < nq; ++qi) {  // scaled queries, zero-padded to dp
        const int64_t r = item.r0 + qi / G, h = item.head * G + qi % G;
        float* qd = qbuf.data() + qi * dp;
        for (int64_t e = 0; e < dp; ++e) qd[e] = e < d ? a.q[r * a.ldq + h * d + e] * a.scale : 0.0f;
        std::fill(obuf.data() + qi * dp, obuf.data() + (qi + 1) * dp, 0.0f);
        mrow[size_t(qi)] = -std::numeric_limits<float>::infinity();
        lrow[size_t(qi)] = 0.0f;
      }
      int64_t kstart = a.sliding_window > 0 ? std::max<int64_t>(0, pmin - a.sliding_window + 1) : 0;
      kstart -= kstart % kTile;
      // Few query vectors (decode): read each key and value row where it lies, one dot product per
      // query and key. Many (prefill): copy the chunk's K transposed and V converted to float32 once,
      // then every query's scores are 16 lanes of FMAs over the chunk.
      const bool in_place = nq < kGatherQueries;
      for (int64_t c0 = kstart; c0 <= pmax; c0 += kTile) {
        const int64_t nk = std::min<int64_t>(kTile, pmax + 1 - c0);
        for (int64_t j = 0; j < nk; ++j) {
          const int64_t off = (slot_of(item.seq, c0 + j) * hk + item.head) * d;
          krow[size_t(j)] = kc + off;
          vrow[size_t(j)] = vc + off;
        }
        if (!in_place) {  // padding (keys past the chunk, lanes past d) stays zero from the fill below
          if (nk < kTile || c0 == kstart) {
            std::fill(kt.begin(), kt.end(), 0.0f);
            std::fill(vbuf.begin(), vbuf.end(), 0.0f);
          }
          for (int64_t j = 0; j < nk; ++j) {
            const KT* kr = krow[size_t(j)];
            const KT* vr = vrow[size_t(j)];
            float* vd = vbuf.data() + j * dp;
            for (int64_t e = 0; e < d; ++e) {
              kt[size_t(e * kTile + j)] = to_f32(kr[e]);
              vd[e] = to_f32(vr[e]);
            }
          }
          for (int64_t j = 0; j < kTile; ++j) vtile[size_t(j)] = vbuf.data() + j * dp;
          // Scores of four queries at a time: 4 x NV independent FMA chains over the head width.
          int64_t qi = 0;
          for (; qi + 4 <= nq; qi += 4) chunk_scores<4>(qbuf.data() + qi * dp, dp, kt.data(), d, sbuf.data() + qi * kTile);
          for (; qi < nq; ++qi) chunk_scores<1>(qbuf.data() + qi * dp, dp, kt.data(), d, sbuf.data() + qi * kTile);
        }
        for (int64_t qi = 0; qi < nq; ++qi) {
          const int64_t pos = a.positions[item.r0 + qi / G];
          const int64_t lo = a.sliding_window > 0 ? std::max<int64_t>(c0, pos - a.sliding_window + 1) : c0;
          const int64_t hi = std::min(pos, c0 + nk - 1);
          if (hi < lo) continue;  // nothing visible to this query in the chunk
          const float* qd = qbuf.data() + qi * dp;
          R s[NV];
          if (in_place) {
            alignas(64) float sc[kTile];
            for (int64_t j = 0; j < kTile; ++j) sc[j] = -std::numeric_limits<float>::infinity();
            // Four keys at a time: four independent FMA chains, each query register loaded once.
            int64_t j = lo - c0;
            for (; j + 4 <= hi - c0 + 1; j += 4) {
              R acc[4];
              unroll<4>([&](auto u) { acc[u] = O::zero(); });
              int64_t e = 0;
              for (; e + W <= d; e += W) {
                const R qv = O::load(qd + e);
                unroll<4>([&](auto u) { acc[u] = O::fma(qv, load_as_f32<KT>(krow[size_t(j + u)] + e), acc[u]); });
              }
              unroll<4>([&](auto u) {
                float dot = O::hsum(acc[u]);
                for (int64_t t = e; t < d; ++t) dot += qd[t] * to_f32(krow[size_t(j + u)][t]);
                sc[j + u] = dot;
              });
            }
            for (; j <= hi - c0; ++j) {
              R acc = O::zero();
              int64_t e = 0;
              for (; e + W <= d; e += W) acc = O::fma(O::load(qd + e), load_as_f32<KT>(krow[size_t(j)] + e), acc);
              float dot = O::hsum(acc);
              for (; e < d; ++e) dot += qd[e] * to_f32(krow[size_t(j)][e]);
              sc[j] = dot;
            }
            for (int j = 0; j < NV; ++j) s[j] = O::load(sc + j * W);
          } else {
            for (int j = 0; j < NV; ++j) {
              const R pos_j = O::add(lane_pos, O::set1(float(c0 + j * W)));
              s[j] = O::keep_range(O::load(sbuf.data() + qi * kTile + j * W), pos_j, float(lo), float(hi));
            }
          }
          R mx = O::set1(-std::numeric_limits<float>::infinity());
          for (int j = 0; j < NV; ++j) mx = O::max(mx, s[j]);
          const float m_old = mrow[size_t(qi)];
          const float m_new = std::max(m_old, O::hmax(mx));
          const float corr = std::exp(m_old - m_new);  // 0 on the first visible chunk
          R sum = O::zero();
          for (int j = 0; j < NV; ++j) {
            const R pj = O::exp(O::sub(s[j], O::set1(m_new)));  // masked lanes: exp(-inf) = 0
            sum = O::add(sum, pj);
            O::store(p + j * W, pj);
          }
          mrow[size_t(qi)] = m_new;
          lrow[size_t(qi)] = lrow[size_t(qi)] * corr + O::hsum(sum);
          float* od = obuf.data() + qi * dp;
          if (in_place) accumulate_pv(od, corr, p, vrow.data(), lo - c0, hi - c0 + 1, d);
          else accumulate_pv(od, corr, p, vtile.data(), 0, nk, dp);
        }
      }
      for (int64_t qi = 0; qi < nq; ++qi) {
        const int64_t r = item.r0 + qi / G, h = item.head * G + qi % G;
        const float inv = lrow[size_t(qi)] > 0 ? 1.0f / lrow[size_t(qi)] : 0.0f;
        const float* od = obuf.data() + qi * dp;
        float* o = a.out + r * a.ldo + h * d;
        for (int64_t e = 0; e < d; ++e) o[e] = od[e] * inv;
      }
    }
  }
}

void attention(const AttentionArgs& a) {
  switch (a.cache_type) {
    case FloatType::F32: return attention_impl<float>(a);
    case FloatType::BF16: return attention_impl<bf16_t>(a);
    case FloatType::F16: return attention_impl<f16_t>(a);
  }
}

const KernelTable kTable = {
    O::kName, O::kStreamRows, &linear, &linear_argmax, &gather_rows, &rms_norm, &rope, &silu_mul, &attention,
};
