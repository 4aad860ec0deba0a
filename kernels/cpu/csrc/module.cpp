// mgx.kernels.cpu._mgx_cpu: the Python entry points of the CPU kernels.
//
// Plain CPython C API and the buffer protocol (no numpy headers, no pybind11), so the extension
// builds with nothing but a C++17 compiler and works with any numpy version. The Python wrappers in
// mgx/kernels/cpu/__init__.py check dtypes and shapes and allocate outputs; this file re-checks what
// memory safety depends on (element sizes, inner strides, buffer lengths), picks the ISA table, and
// releases the GIL around every kernel.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>

#ifdef _OPENMP
#include <omp.h>
#endif

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__)) && !defined(MGX_PORTABLE_ONLY)
#include <cpuid.h>
#define MGX_HAVE_CPUID 1
#else
#define MGX_HAVE_CPUID 0
#endif

#include "common.h"

namespace mgx {

// ---------------------------------------------------------------------------------------------
// Shared helpers declared in common.h.

static int g_threads = 1;

int num_threads() { return g_threads; }

int64_t value_units(const WeightDesc& w) {
  switch (w.scheme) {
    case Scheme::None:
    case Scheme::W8A16: return w.k;
    case Scheme::Int4: return w.k / 2;
    case Scheme::Sparse24: return w.k / 2;
    case Scheme::Sparse24Int4: return w.k / 4;
  }
  return 0;
}

int64_t group_count(const WeightDesc& w) {
  switch (w.scheme) {
    case Scheme::W8A16: return 1;
    case Scheme::Int4: return (w.k + w.group - 1) / w.group;
    case Scheme::Sparse24Int4: return (w.k / 2 + w.group - 1) / w.group;
    default: return 0;
  }
}

// ---------------------------------------------------------------------------------------------
// CPU features and the ISA table in use.

struct Features {
  bool avx2 = false, fma = false, f16c = false, avx512f = false, avx512bw = false, avx512vl = false,
       avx512dq = false, avx512_vnni = false, avx512_bf16 = false, avx_vnni = false;
};

static Features detect() {
  Features f;
#if MGX_HAVE_CPUID
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  const bool osxsave = c & (1u << 27), avx = c & (1u << 28);
  f.fma = c & (1u << 12);
  f.f16c = c & (1u << 29);
  if (!osxsave || !avx) return Features{};
  unsigned xlo, xhi;
  __asm__ volatile("xgetbv" : "=a"(xlo), "=d"(xhi) : "c"(0));
  const bool ymm_state = (xlo & 0x6u) == 0x6u;     // the OS saves SSE and AVX registers
  const bool zmm_state = (xlo & 0xE6u) == 0xE6u;   // ... and the AVX-512 opmask and upper registers
  if (!ymm_state) return Features{};
  __cpuid_count(7, 0, a, b, c, d);
  f.avx2 = b & (1u << 5);
  if (zmm_state) {
    f.avx512f = b & (1u << 16);
    f.avx512dq = b & (1u << 17);
    f.avx512bw = b & (1u << 30);
    f.avx512vl = b & (1u << 31);
    f.avx512_vnni = c & (1u << 11);
    __cpuid_count(7, 1, a, b, c, d);
    f.avx512_bf16 = a & (1u << 5);
  }
  __cpuid_count(7, 1, a, b, c, d);
  f.avx_vnni = a & (1u << 4);
#endif
  return f;
}

static Features g_features;
static const KernelTable* g_table = nullptr;

// Tables usable on this host, best first; the scalar table is always last.
static int usable_tables(const KernelTable** out) {
  int n = 0;
  const Features& f = g_features;
  if (avx512_table() && f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq && f.avx2 && f.fma && f.f16c)
    out[n++] = avx512_table();
  if (avx2_table() && f.avx2 && f.fma && f.f16c) out[n++] = avx2_table();
  out[n++] = scalar_table();
  return n;
}

}  // namespace mgx

using namespace mgx;

// ---------------------------------------------------------------------------------------------
// Buffers.

namespace {

struct Buffer {
  Py_buffer view{};
  bool held = false;
  Buffer() = default;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() { release(); }
  void release() {
    if (held) PyBuffer_Release(&view);
    held = false;
  }
  // A buffer of `itemsize`-byte elements, 1-D or 2-D (any rank with `any_rank`), contiguous within rows.
  bool get(PyObject* obj, Py_ssize_t itemsize, bool writable, const char* what, bool any_rank = false) {
    int flags = PyBUF_STRIDES | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, &view, flags) != 0) {
      PyErr_Format(PyExc_TypeError, "%s: expected a%s buffer (numpy array)", what, writable ? " writable" : "");
      return false;
    }
    held = true;
    if (view.itemsize != itemsize) {
      PyErr_Format(PyExc_TypeError, "%s: elements of %zd bytes expected, got %zd", what, itemsize, view.itemsize);
      return false;
    }
    if (view.ndim < 1 || (view.ndim > 2 && !any_rank)) {
      PyErr_Format(PyExc_ValueError, "%s: 1-D or 2-D expected, got %d-D", what, view.ndim);
      return false;
    }
    const Py_ssize_t inner = view.strides[view.ndim - 1];
    if (view.shape[view.ndim - 1] > 1 && inner != itemsize) {
      PyErr_Format(PyExc_ValueError, "%s: rows must be contiguous", what);
      return false;
    }
    if (view.ndim == 2 && view.shape[0] > 1 && (view.strides[0] < 0 || view.strides[0] % itemsize)) {
      PyErr_Format(PyExc_ValueError, "%s: unsupported row stride", what);
      return false;
    }
    return true;
  }
  int64_t rows() const { return view.ndim == 2 ? view.shape[0] : 1; }
  int64_t cols() const { return view.shape[view.ndim - 1]; }
  int64_t ld() const { return view.ndim == 2 && view.shape[0] > 1 ? view.strides[0] / view.itemsize : cols(); }
  // Elements reachable from buf: (rows - 1) * ld + cols.
  int64_t span() const { return rows() == 0 ? 0 : (rows() - 1) * ld() + cols(); }
  template <class T> T* ptr() const { return static_cast<T*>(view.buf); }
};

bool need(bool cond, const char* message) {
  if (!cond) PyErr_SetString(PyExc_ValueError, message);
  return cond;
}

// A float32 matrix [rows, cols] (1-D counts as one row).
bool get_matrix(Buffer& b, PyObject* obj, bool writable, const char* what) {
  return b.get(obj, 4, writable, what);
}

// ---------------------------------------------------------------------------------------------
// Weight handles: a WeightDesc plus the buffers it points into, held as long as the handle lives.

struct WeightHandle {
  WeightDesc desc;
  Buffer buffers[5];
};

const char* kWeightCapsule = "mgx.cpu.Weight";

void free_weight(PyObject* capsule) {
  delete static_cast<WeightHandle*>(PyCapsule_GetPointer(capsule, kWeightCapsule));
}

const WeightDesc* weight_of(PyObject* capsule) {
  auto* h = static_cast<WeightHandle*>(PyCapsule_GetPointer(capsule, kWeightCapsule));
  return h ? &h->desc : nullptr;
}

int64_t total_elements(const Buffer& b) {
  int64_t n = 1;
  for (int i = 0; i < b.view.ndim; ++i) n *= b.view.shape[i];
  return n;
}

PyObject* make_weight(PyObject*, PyObject* args) {
  int scheme, layout, ftype;
  long long n, k, group;
  PyObject *values, *scales, *zeros, *meta, *bias;
  if (!PyArg_ParseTuple(args, "iiiLLLOOOOO", &scheme, &layout, &ftype, &n, &k, &group, &values, &scales, &zeros,
                        &meta, &bias))
    return nullptr;
  if (!need(scheme >= 0 && scheme <= 4 && layout >= 0 && layout <= 1 && ftype >= 0 && ftype <= 2,
            "unknown scheme, layout or float type code") ||
      !need(n > 0 && k > 0, "weight sizes must be positive"))
    return nullptr;
  auto h = std::make_unique<WeightHandle>();
  WeightDesc& w = h->desc;
  w = WeightDesc{Scheme(scheme), Layout(layout), FloatType(ftype), n, k, group, nullptr, nullptr, nullptr, nullptr, nullptr};
  const bool quantized_int4 = w.scheme == Scheme::Int4 || w.scheme == Scheme::Sparse24Int4;
  if (quantized_int4 && !need(group > 0 && group % 2 == 0, "int4 group size must be even and positive")) return nullptr;
  if (w.scheme == Scheme::Int4 && !need(k % 2 == 0, "int4 weights need an even K (two columns a byte)")) return nullptr;
  if ((w.scheme == Scheme::Sparse24 || w.scheme == Scheme::Sparse24Int4) && !need(k % 4 == 0, "2:4 sparse weights need K % 4 == 0"))
    return nullptr;
  const bool float_values = w.scheme == Scheme::None || w.scheme == Scheme::Sparse24;
  const Py_ssize_t vsize = float_values ? (w.ftype == FloatType::F32 ? 4 : 2) : 1;
  if (!h->buffers[0].get(values, vsize, false, "weight")) return nullptr;
  if (!need(total_elements(h->buffers[0]) == n * value_units(w) && h->buffers[0].ld() == h->buffers[0].cols(),
            "weight buffer has the wrong size for its scheme (or is not contiguous)"))
    return nullptr;
  w.values = h->buffers[0].view.buf;
  const int64_t groups = group_count(w);
  if (w.scheme == Scheme::W8A16 || quantized_int4) {
    if (!need(scales != Py_None, "this scheme needs scales")) return nullptr;
    if (!h->buffers[1].get(scales, 4, false, "scales")) return nullptr;
    if (!need(total_elements(h->buffers[1]) == n * groups && h->buffers[1].ld() == h->buffers[1].cols(),
              "scales have the wrong size"))
      return nullptr;
    w.scales = h->buffers[1].ptr<float>();
  }
  if (quantized_int4 && zeros != Py_None) {
    if (!h->buffers[2].get(zeros, 1, false, "zeros")) return nullptr;
    if (!need(total_elements(h->buffers[2]) == n * groups, "zeros have the wrong size")) return nullptr;
    w.zeros = h->buffers[2].ptr<uint8_t>();
  }
  if (w.scheme == Scheme::Sparse24 || w.scheme == Scheme::Sparse24Int4) {
    if (!need(meta != Py_None, "2:4 sparse weights need meta")) return nullptr;
    if (!h->buffers[3].get(meta, 1, false, "meta")) return nullptr;
    if (!need(total_elements(h->buffers[3]) == n * (k / 4), "meta has the wrong size")) return nullptr;
    w.meta = h->buffers[3].ptr<uint8_t>();
  }
  if (bias != Py_None) {
    if (!h->buffers[4].get(bias, 4, false, "bias")) return nullptr;
    if (!need(total_elements(h->buffers[4]) == n, "bias must have out_features elements")) return nullptr;
    w.bias = h->buffers[4].ptr<float>();
  }
  PyObject* capsule = PyCapsule_New(h.get(), kWeightCapsule, free_weight);
  if (capsule) h.release();
  return capsule;
}

// ---------------------------------------------------------------------------------------------
// Kernels.

#define MGX_NOGIL(stmt)       \
  do {                        \
    Py_BEGIN_ALLOW_THREADS;   \
    stmt;                     \
    Py_END_ALLOW_THREADS;     \
  } while (0)

PyObject* py_linear(PyObject*, PyObject* args) {
  PyObject *cap, *xo, *yo;
  if (!PyArg_ParseTuple(args, "OOO", &cap, &xo, &yo)) return nullptr;
  const WeightDesc* w = weight_of(cap);
  if (!w) return nullptr;
  Buffer x, y;
  if (!get_matrix(x, xo, false, "x") || !get_matrix(y, yo, true, "out")) return nullptr;
  if (!need(x.cols() == w->k && y.cols() == w->n && x.rows() == y.rows(), "linear: shapes do not match the weight"))
    return nullptr;
  if (x.rows() > 0) MGX_NOGIL(g_table->linear(*w, x.ptr<float>(), x.ld(), x.rows(), y.ptr<float>(), y.ld()));
  Py_RETURN_NONE;
}

PyObject* py_linear_argmax(PyObject*, PyObject* args) {
  PyObject *cap, *xo, *io, *vo;
  if (!PyArg_ParseTuple(args, "OOOO", &cap, &xo, &io, &vo)) return nullptr;
  const WeightDesc* w = weight_of(cap);
  if (!w) return nullptr;
  Buffer x, idx, val;
  if (!get_matrix(x, xo, false, "x") || !idx.get(io, 8, true, "index") || !get_matrix(val, vo, true, "value"))
    return nullptr;
  if (!need(x.cols() == w->k && total_elements(idx) == x.rows() && total_elements(val) == x.rows() &&
                idx.ld() == idx.cols() && val.ld() == val.cols(),
            "linear_argmax: shapes do not match"))
    return nullptr;
  if (x.rows() > 0)
    MGX_NOGIL(g_table->linear_argmax(*w, x.ptr<float>(), x.ld(), x.rows(), idx.ptr<int64_t>(), val.ptr<float>()));
  Py_RETURN_NONE;
}

PyObject* py_gather_rows(PyObject*, PyObject* args) {
  PyObject *cap, *ro, *oo;
  if (!PyArg_ParseTuple(args, "OOO", &cap, &ro, &oo)) return nullptr;
  const WeightDesc* w = weight_of(cap);
  if (!w) return nullptr;
  Buffer rows, out;
  if (!rows.get(ro, 8, false, "rows") || !get_matrix(out, oo, true, "out")) return nullptr;
  const int64_t count = total_elements(rows);
  if (!need(rows.ld() == rows.cols() && out.rows() == count && out.cols() == w->k, "gather_rows: shapes do not match"))
    return nullptr;
  const int64_t* r = rows.ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i)
    if (r[i] < 0 || r[i] >= w->n) {
      PyErr_Format(PyExc_IndexError, "row %lld is outside [0, %lld)", (long long)r[i], (long long)w->n);
      return nullptr;
    }
  MGX_NOGIL(g_table->gather_rows(*w, r, count, out.ptr<float>(), out.ld()));
  Py_RETURN_NONE;
}

PyObject* py_rms_norm(PyObject*, PyObject* args) {
  PyObject *xo, *ro, *wo, *so, *oo;
  long long group;
  float eps;
  if (!PyArg_ParseTuple(args, "OOOLfOO", &xo, &ro, &wo, &group, &eps, &so, &oo)) return nullptr;
  Buffer x, res, weight, sum, out;
  if (!get_matrix(x, xo, false, "x") || !get_matrix(out, oo, true, "out")) return nullptr;
  const int64_t t = x.rows(), f = x.cols();
  if (!need(group > 0 && f % group == 0, "rms_norm: width must be a multiple of group") ||
      !need(out.rows() == t && out.cols() == f, "rms_norm: out shape differs from x"))
    return nullptr;
  if (ro != Py_None) {
    if (!get_matrix(res, ro, false, "residual") || !get_matrix(sum, so, true, "sum_out")) return nullptr;
    if (!need(res.rows() == t && res.cols() == f && sum.rows() == t && sum.cols() == f,
              "rms_norm: residual / sum shapes differ from x"))
      return nullptr;
  }
  if (wo != Py_None) {
    if (!get_matrix(weight, wo, false, "weight")) return nullptr;
    if (!need(total_elements(weight) == group, "rms_norm: weight must have `group` elements")) return nullptr;
  }
  MGX_NOGIL(g_table->rms_norm(x.ptr<float>(), x.ld(), res.held ? res.ptr<float>() : nullptr, res.held ? res.ld() : 0, t,
                              f, group, weight.held ? weight.ptr<float>() : nullptr, eps,
                              sum.held ? sum.ptr<float>() : nullptr, sum.held ? sum.ld() : 0, out.ptr<float>(),
                              out.ld()));
  Py_RETURN_NONE;
}

// cos/sin [T, R/2] of RoPE angles, in float32 as Hugging Face computes them (float32 product of
// position and inverse frequency), the cosine itself in double then rounded. Portable code: it runs
// once per step and is shared by every layer.
PyObject* py_rope_table(PyObject*, PyObject* args) {
  PyObject *po, *fo, *co, *so;
  float scaling;
  if (!PyArg_ParseTuple(args, "OOfOO", &po, &fo, &scaling, &co, &so)) return nullptr;
  Buffer pos, freq, c, s;
  if (!pos.get(po, 8, false, "positions") || !freq.get(fo, 4, false, "inv_freq") || !get_matrix(c, co, true, "cos") ||
      !get_matrix(s, so, true, "sin"))
    return nullptr;
  const int64_t t = total_elements(pos), half = total_elements(freq);
  if (!need(c.rows() == t && c.cols() == half && s.rows() == t && s.cols() == half && c.ld() == half && s.ld() == half,
            "rope_table: cos/sin must be [T, rotary_dim/2]"))
    return nullptr;
  const int64_t* p = pos.ptr<int64_t>();
  const float* f = freq.ptr<float>();
  float* cp = c.ptr<float>();
  float* sp = s.ptr<float>();
  MGX_NOGIL(for (int64_t r = 0; r < t; ++r) {
    const float pf = float(p[r]);
    for (int64_t i = 0; i < half; ++i) {
      const double angle = double(pf * f[i]);
      cp[r * half + i] = float(std::cos(angle)) * scaling;
      sp[r * half + i] = float(std::sin(angle)) * scaling;
    }
  });
  Py_RETURN_NONE;
}

PyObject* py_rope(PyObject*, PyObject* args) {
  PyObject *xo, *co, *so, *oo;
  long long heads, d, rot;
  if (!PyArg_ParseTuple(args, "OLLLOOO", &xo, &heads, &d, &rot, &co, &so, &oo)) return nullptr;
  Buffer x, c, s, out;
  if (!get_matrix(x, xo, false, "x") || !get_matrix(c, co, false, "cos") || !get_matrix(s, so, false, "sin") ||
      !get_matrix(out, oo, true, "out"))
    return nullptr;
  const int64_t t = x.rows();
  if (!need(rot > 0 && rot % 2 == 0 && rot <= d && x.cols() == heads * d, "rope: bad head sizes") ||
      !need(out.rows() == t && out.cols() == x.cols(), "rope: out shape differs from x") ||
      !need(c.rows() == t && c.cols() == rot / 2 && c.ld() == rot / 2 && s.rows() == t && s.cols() == rot / 2 &&
                s.ld() == rot / 2,
            "rope: cos/sin must be [T, rotary_dim/2]"))
    return nullptr;
  MGX_NOGIL(g_table->rope(x.ptr<float>(), x.ld(), t, heads, d, rot, c.ptr<float>(), s.ptr<float>(), out.ptr<float>(),
                          out.ld()));
  Py_RETURN_NONE;
}

PyObject* py_silu_mul(PyObject*, PyObject* args) {
  PyObject *go, *uo, *oo;
  if (!PyArg_ParseTuple(args, "OOO", &go, &uo, &oo)) return nullptr;
  Buffer g, u, out;
  if (!get_matrix(g, go, false, "gate") || !get_matrix(u, uo, false, "up") || !get_matrix(out, oo, true, "out"))
    return nullptr;
  if (!need(g.rows() == u.rows() && g.cols() == u.cols() && out.rows() == g.rows() && out.cols() == g.cols(),
            "silu_mul: shapes differ"))
    return nullptr;
  MGX_NOGIL(g_table->silu_mul(g.ptr<float>(), g.ld(), u.ptr<float>(), u.ld(), g.rows(), g.cols(), out.ptr<float>(),
                              out.ld()));
  Py_RETURN_NONE;
}

PyObject* py_attention(PyObject*, PyObject* args) {
  PyObject *qo, *ko, *vo, *oo, *po, *qso, *clo, *bto, *kco, *vco;
  int cache_type;
  long long hq, hk, d, window;
  float scale;
  if (!PyArg_ParseTuple(args, "OOOOOOOOOOiLLLfL", &qo, &ko, &vo, &oo, &po, &qso, &clo, &bto, &kco, &vco, &cache_type,
                        &hq, &hk, &d, &scale, &window))
    return nullptr;
  if (!need(cache_type >= 0 && cache_type <= 2, "unknown cache type code")) return nullptr;
  const Py_ssize_t csize = cache_type == 0 ? 4 : 2;
  Buffer q, k, v, out, pos, qs, cl, bt, kc, vc;
  if (!get_matrix(q, qo, false, "q") || !get_matrix(k, ko, false, "k") || !get_matrix(v, vo, false, "v") ||
      !get_matrix(out, oo, true, "out") || !pos.get(po, 8, false, "positions") ||
      !qs.get(qso, 4, false, "query_start") || !cl.get(clo, 4, false, "context_lens") ||
      !bt.get(bto, 4, false, "block_table") || !kc.get(kco, csize, true, "k_cache", true) ||
      !vc.get(vco, csize, true, "v_cache", true))
    return nullptr;
  const int64_t t = q.rows(), b = total_elements(cl);
  if (!need(hq > 0 && hk > 0 && d > 0 && hq % hk == 0, "attention: bad head counts") ||
      !need(q.cols() == hq * d && out.cols() == hq * d && out.rows() == t, "attention: q/out must be [T, Hq*D]") ||
      !need(k.rows() == t && v.rows() == t && k.cols() == hk * d && v.cols() == hk * d, "attention: k/v must be [T, Hk*D]") ||
      !need(total_elements(pos) == t && total_elements(qs) == b + 1, "attention: positions [T], query_start [B+1]") ||
      !need(bt.view.ndim == 2 && bt.view.shape[0] == b && bt.ld() == bt.cols(), "attention: block_table must be [B, max_blocks]"))
    return nullptr;
  // The cache is [num_blocks, block_size, Hk, D], seen here as a contiguous buffer.
  Py_buffer& kv = kc.view;
  if (!need(PyBuffer_IsContiguous(&kv, 'C') && PyBuffer_IsContiguous(&vc.view, 'C') && kv.len == vc.view.len,
            "attention: caches must be contiguous and of one size"))
    return nullptr;
  if (!need(kv.ndim == 4 && kv.shape[2] == hk && kv.shape[3] == d, "attention: caches must be [blocks, block_size, Hk, D]"))
    return nullptr;
  AttentionArgs a{};
  a.q = q.ptr<float>(), a.ldq = q.ld(), a.k = k.ptr<float>(), a.ldk = k.ld(), a.v = v.ptr<float>(), a.ldv = v.ld();
  a.out = out.ptr<float>(), a.ldo = out.ld();
  a.positions = pos.ptr<int64_t>(), a.num_tokens = t, a.num_seqs = b;
  a.query_start = qs.ptr<int32_t>(), a.context_lens = cl.ptr<int32_t>();
  a.block_table = bt.ptr<int32_t>(), a.max_blocks = bt.cols();
  a.k_cache = kv.buf, a.v_cache = vc.view.buf, a.cache_type = FloatType(cache_type);
  a.num_blocks = kv.shape[0], a.block_size = kv.shape[1];
  a.num_heads = hq, a.num_kv_heads = hk, a.head_dim = d, a.scale = scale, a.sliding_window = window;
  // Every index the kernel will follow is checked here, so a bad table raises instead of corrupting memory.
  if (!need(a.query_start[0] == 0 && a.query_start[b] == t, "attention: query_start must run from 0 to T")) return nullptr;
  for (int64_t i = 0; i < b; ++i) {
    const int64_t r0 = a.query_start[i], r1 = a.query_start[i + 1], ctx = a.context_lens[i];
    if (!need(r0 <= r1, "attention: query_start must not decrease") ||
        !need(ctx >= 0 && (ctx + a.block_size - 1) / a.block_size <= a.max_blocks, "attention: context longer than the block table"))
      return nullptr;
    for (int64_t r = r0; r < r1; ++r)
      if (!need(a.positions[r] >= 0 && a.positions[r] < ctx, "attention: a position is outside its sequence's context"))
        return nullptr;
    for (int64_t j = 0; j < (ctx + a.block_size - 1) / a.block_size; ++j) {
      const int32_t blk = a.block_table[i * a.max_blocks + j];
      if (!need(blk >= 0 && blk < a.num_blocks, "attention: block id outside the cache")) return nullptr;
    }
  }
  MGX_NOGIL(g_table->attention(a));
  Py_RETURN_NONE;
}

// ---------------------------------------------------------------------------------------------
// Configuration.

PyObject* py_features(PyObject*, PyObject*) {
  const Features& f = g_features;
  return Py_BuildValue("{s:O,s:O,s:O,s:O,s:O,s:O,s:O,s:O,s:O,s:O}", "avx2", f.avx2 ? Py_True : Py_False, "fma",
                       f.fma ? Py_True : Py_False, "f16c", f.f16c ? Py_True : Py_False, "avx512f",
                       f.avx512f ? Py_True : Py_False, "avx512bw", f.avx512bw ? Py_True : Py_False, "avx512vl",
                       f.avx512vl ? Py_True : Py_False, "avx512dq", f.avx512dq ? Py_True : Py_False, "avx512_vnni",
                       f.avx512_vnni ? Py_True : Py_False, "avx512_bf16", f.avx512_bf16 ? Py_True : Py_False,
                       "avx_vnni", f.avx_vnni ? Py_True : Py_False);
}

PyObject* py_compiled_isas(PyObject*, PyObject*) {
  PyObject* out = PyList_New(0);
  for (const KernelTable* t : {avx512_table(), avx2_table(), scalar_table()})
    if (t) {
      PyObject* name = PyUnicode_FromString(t->name);
      PyList_Append(out, name);
      Py_DECREF(name);
    }
  return out;
}

PyObject* py_supported_isas(PyObject*, PyObject*) {
  const KernelTable* tables[3];
  const int n = usable_tables(tables);
  PyObject* out = PyList_New(n);
  for (int i = 0; i < n; ++i) PyList_SET_ITEM(out, i, PyUnicode_FromString(tables[i]->name));
  return out;
}

PyObject* py_set_isa(PyObject*, PyObject* args) {
  const char* name;
  if (!PyArg_ParseTuple(args, "s", &name)) return nullptr;
  const KernelTable* tables[3];
  const int n = usable_tables(tables);
  for (int i = 0; i < n; ++i)
    if (std::strcmp(tables[i]->name, name) == 0) {
      g_table = tables[i];
      Py_RETURN_NONE;
    }
  PyErr_Format(PyExc_ValueError, "ISA %s is not available on this host", name);
  return nullptr;
}

PyObject* py_get_isa(PyObject*, PyObject*) { return PyUnicode_FromString(g_table->name); }

PyObject* py_stream_rows(PyObject*, PyObject*) { return PyLong_FromLong(g_table->stream_rows); }

PyObject* py_set_num_threads(PyObject*, PyObject* args) {
  int n;
  if (!PyArg_ParseTuple(args, "i", &n)) return nullptr;
  if (!need(n >= 1, "the thread count must be >= 1")) return nullptr;
  g_threads = n;
  Py_RETURN_NONE;
}

PyObject* py_get_num_threads(PyObject*, PyObject*) { return PyLong_FromLong(g_threads); }

PyObject* py_has_openmp(PyObject*, PyObject*) {
#ifdef _OPENMP
  Py_RETURN_TRUE;
#else
  Py_RETURN_FALSE;
#endif
}

PyMethodDef kMethods[] = {
    {"make_weight", make_weight, METH_VARARGS, "make_weight(scheme, layout, ftype, n, k, group, values, scales, zeros, meta, bias)"},
    {"linear", py_linear, METH_VARARGS, "linear(weight, x, out)"},
    {"linear_argmax", py_linear_argmax, METH_VARARGS, "linear_argmax(weight, x, index, value)"},
    {"gather_rows", py_gather_rows, METH_VARARGS, "gather_rows(weight, rows, out)"},
    {"rms_norm", py_rms_norm, METH_VARARGS, "rms_norm(x, residual, weight, group, eps, sum_out, out)"},
    {"rope_table", py_rope_table, METH_VARARGS, "rope_table(positions, inv_freq, scaling, cos, sin)"},
    {"rope", py_rope, METH_VARARGS, "rope(x, heads, head_dim, rotary_dim, cos, sin, out)"},
    {"silu_mul", py_silu_mul, METH_VARARGS, "silu_mul(gate, up, out)"},
    {"attention", py_attention, METH_VARARGS, "attention(q, k, v, out, positions, query_start, context_lens, block_table, k_cache, v_cache, cache_type, Hq, Hk, D, scale, window)"},
    {"features", py_features, METH_NOARGS, "CPU features this host reports"},
    {"compiled_isas", py_compiled_isas, METH_NOARGS, "ISA paths compiled into this build"},
    {"supported_isas", py_supported_isas, METH_NOARGS, "ISA paths this host can run, best first"},
    {"set_isa", py_set_isa, METH_VARARGS, "set_isa(name)"},
    {"get_isa", py_get_isa, METH_NOARGS, "the ISA path in use"},
    {"stream_rows", py_stream_rows, METH_NOARGS, "rows up to which linear streams weights"},
    {"set_num_threads", py_set_num_threads, METH_VARARGS, "set_num_threads(n)"},
    {"get_num_threads", py_get_num_threads, METH_NOARGS, "worker threads per kernel"},
    {"has_openmp", py_has_openmp, METH_NOARGS, "whether the build uses OpenMP"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_mgx_cpu", "MGX C++ CPU kernels (see mgx.kernels.cpu)", -1, kMethods,
                     nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__mgx_cpu() {
  g_features = detect();
  const KernelTable* tables[3];
  usable_tables(tables);
  g_table = tables[0];
  g_threads = int(std::max(1u, std::thread::hardware_concurrency()));
  return PyModule_Create(&kModule);
}
