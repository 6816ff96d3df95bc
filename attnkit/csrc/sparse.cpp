// Top-k sparse attention on the CPU: each query attends only the keys its list names (a TopK mask),
// forward and backward, in O(Tq * k * D) time and O(Tq) extra memory (the (Tq, Tk) scores are never
// built). The `topk` backend (attnkit/backends/topk.py) calls these ops; its PyTorch gather is the
// twin and the fallback.
//
//   forward(q, k, v, index, scale) -> (out, lse)
//   backward(dout, q, k, v, out, lse, index, scale) -> (dq, dk, dv)
//
// q (B, Hq, Tq, D), k (B, Hkv, Tk, D), v (B, Hkv, Tk, Dv): contiguous float32 or float64 (the backend
// upcasts half precision). index (Bi, Hi, Tq, K) int64, contiguous, Bi in {1, B}, Hi in {1, Hq}: the
// call-relative key of each listed pair, -1 where nothing is kept (padding, a repeat, a pair another
// mask drops). Query head h reads key/value head h / (Hq / Hkv). A row with no key gives 0, LSE -inf.
//
// Forward runs at::parallel_for over (batch, kv head, query); a list shared by every head (Hi == 1)
// is read once per group: each listed key row is loaded once for the G query heads of its group.
// Backward recomputes the probabilities from the LSE (FlashAttention-2) and runs over (batch, kv
// head, query segment): dq rows are written by the one task that owns their query, dk/dv rows are
// accumulated in the segment's own buffer and the segments summed in a fixed order. The segment
// count follows from the shapes alone, so results do not depend on the thread count.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros_like.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

#include "tiles.h"

namespace {

// Vector code in GCC's generic 64-byte vectors (16 floats, 8 doubles) that the compiler maps onto the
// machine's registers (one zmm, two ymm): ATen's Vectorized<T> is its scalar fallback in an extension
// (no CPU_CAPABILITY is defined here), and the fixed lane count keeps every summation order the same
// on every instruction set.
template <typename T>
struct Lanes;
template <>
struct Lanes<float> {
  typedef float V __attribute__((vector_size(64)));
  static constexpr int64_t n = 16;
};
template <>
struct Lanes<double> {
  typedef double V __attribute__((vector_size(64)));
  static constexpr int64_t n = 8;
};

template <typename T>
inline typename Lanes<T>::V load(const T* p) {
  typename Lanes<T>::V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// The lanes' sum as a tree of halves (a fixed order: the same bits on every instruction set).
template <typename T>
inline T hsum(typename Lanes<T>::V v) {
  typedef T H __attribute__((vector_size(32)));
  typedef T Q __attribute__((vector_size(16)));
  H lo, hi;
  std::memcpy(&lo, &v, sizeof lo);
  std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof lo, sizeof hi);
  const H h = lo + hi;
  Q a, b;
  std::memcpy(&a, &h, sizeof a);
  std::memcpy(&b, reinterpret_cast<const char*>(&h) + sizeof a, sizeof b);
  const Q q = a + b;
  T s = 0;
  for (size_t l = 0; l < sizeof(Q) / sizeof(T); ++l) s += q[l];
  return s;
}

template <typename T>
T dot(const T* a, const T* b, int64_t n) {
  constexpr int64_t L = Lanes<T>::n;
  typename Lanes<T>::V acc = {};
  int64_t i = 0;
  for (; i + L <= n; i += L) {
    acc += load(a + i) * load(b + i);
  }
  T s = hsum<T>(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// y += alpha * x
template <typename T>
void axpy(T alpha, const T* x, T* y, int64_t n) {
  constexpr int64_t L = Lanes<T>::n;
  int64_t i = 0;
  for (; i + L <= n; i += L) {
    const typename Lanes<T>::V r = load(y + i) + alpha * load(x + i);
    std::memcpy(y + i, &r, sizeof r);
  }
  for (; i < n; ++i) y[i] += alpha * x[i];
}

struct Shape {
  int64_t B, Hq, Hkv, G, Tq, Tk, D, Dv, Bi, Hi, K;
  // The heads one list serves (G when the list is shared by every head, else 1), the lists per
  // (batch, kv head, query), and the first query head of list l.
  int64_t per_list() const { return Hi == 1 ? G : 1; }
  int64_t lists() const { return Hi == 1 ? 1 : G; }
  const int64_t* list(const int64_t* index, int64_t b, int64_t hkv, int64_t l, int64_t i) const {
    const int64_t bi = Bi == 1 ? 0 : b, hi = Hi == 1 ? 0 : hkv * G + l;
    return index + ((bi * Hi + hi) * Tq + i) * K;
  }
};

Shape shape_of(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& index) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && index.dim() == 4, "attnkit_sparse: 4-D tensors expected");
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous() && index.is_contiguous(),
              "attnkit_sparse: contiguous tensors expected");
  TORCH_CHECK(index.scalar_type() == at::kLong, "attnkit_sparse: int64 index expected");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), "attnkit_sparse: one dtype");
  Shape s{q.size(0), q.size(1), k.size(1), 0, q.size(2), k.size(2), q.size(3), v.size(3),
          index.size(0), index.size(1), index.size(3)};
  TORCH_CHECK(s.Hkv > 0 && s.Hq % s.Hkv == 0, "attnkit_sparse: Hq must be a multiple of Hkv");
  s.G = s.Hq / s.Hkv;
  TORCH_CHECK((s.Bi == 1 || s.Bi == s.B) && (s.Hi == 1 || s.Hi == s.Hq) && index.size(2) == s.Tq,
              "attnkit_sparse: index must be (1|B, 1|Hq, Tq, K)");
  return s;
}

// exp(x[i] - shift) in place for i < n, the sum returned: the prefill kernel's row exponential
// (tiles.h: Cephes' expf polynomial for float, std::exp for double, summed in a fixed 16-lane order, so
// the same arithmetic on every instruction set).
template <typename T>
inline T exp_shift(T* x, int64_t n, T shift) {
  return attnkit::exp_row<T, T>(x, n, T(1), shift, x);
}

// The listed keys of one list, compacted: keys[0 .. count) (padding and dropped pairs skipped).
inline int64_t compact(const int64_t* list, int64_t K, int64_t* keys) {
  int64_t c = 0;
  for (int64_t n = 0; n < K; ++n) {
    if (list[n] >= 0) keys[c++] = list[n];
  }
  return c;
}

template <typename T>
void forward_kernel(const Shape s, const T* q, const T* k, const T* v, const int64_t* index, T scale, T* out,
                    T* lse) {
  const int64_t P = s.per_list();
  constexpr T inf = std::numeric_limits<T>::infinity();
  at::parallel_for(0, s.B * s.Hkv * s.Tq, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> scores(P * s.K);
    std::vector<int64_t> keys(s.K);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task % s.Tq, hkv = (task / s.Tq) % s.Hkv, b = task / (s.Tq * s.Hkv);
      const T* kb = k + (b * s.Hkv + hkv) * s.Tk * s.D;
      const T* vb = v + (b * s.Hkv + hkv) * s.Tk * s.Dv;
      for (int64_t l = 0; l < s.lists(); ++l) {
        const int64_t c = compact(s.list(index, b, hkv, l, i), s.K, keys.data());
        const int64_t h0 = hkv * s.G + l * P;  // the first query head this list serves
        auto row = [&](int64_t g) { return (b * s.Hq + h0 + g) * s.Tq + i; };
        for (int64_t n = 0; n < c; ++n) {  // each listed key row read once for the P heads
          const T* krow = kb + keys[n] * s.D;
          for (int64_t g = 0; g < P; ++g) scores[g * s.K + n] = dot(q + row(g) * s.D, krow, s.D) * scale;
        }
        for (int64_t g = 0; g < P; ++g) {
          T* o = out + row(g) * s.Dv;
          std::fill(o, o + s.Dv, T(0));
          T* sc = scores.data() + g * s.K;
          T m = -inf;
          for (int64_t n = 0; n < c; ++n) m = std::max(m, sc[n]);
          if (m == -inf) {  // nothing listed (or every score -inf): 0
            lse[row(g)] = -inf;
            continue;
          }
          const T sum = exp_shift(sc, c, m);
          for (int64_t n = 0; n < c; ++n) axpy(sc[n], vb + keys[n] * s.Dv, o, s.Dv);
          const T inv = T(1) / sum;
          for (int64_t d = 0; d < s.Dv; ++d) o[d] *= inv;
          lse[row(g)] = m + std::log(sum);
        }
      }
    }
  });
}

// Query segments per (batch, kv head) in the backward: enough tasks for 16 threads, at least 128
// queries a segment; from the shapes alone (the sum order of dk/dv never follows the thread count).
int64_t segments(const Shape& s) {
  const int64_t want = std::max<int64_t>(1, 16 / std::max<int64_t>(1, s.B * s.Hkv));
  return std::max<int64_t>(1, std::min<int64_t>(want, (s.Tq + 127) / 128));
}

template <typename T>
void backward_kernel(const Shape s, const T* dout, const T* q, const T* k, const T* v, const T* out, const T* lse,
                     const int64_t* index, T scale, T* dq, T* dk, T* dv) {
  const int64_t P = s.per_list(), S = segments(s);
  const int64_t seg_len = (s.Tq + S - 1) / S;
  constexpr T inf = std::numeric_limits<T>::infinity();
  // Segment 0 accumulates in dk/dv directly; the others in their own buffers, summed after.
  std::vector<T> part_k(S > 1 ? (S - 1) * s.B * s.Hkv * s.Tk * s.D : 0);
  std::vector<T> part_v(S > 1 ? (S - 1) * s.B * s.Hkv * s.Tk * s.Dv : 0);
  at::parallel_for(0, s.B * s.Hkv * S, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> p(P * s.K), ds(P * s.K), delta(P);
    std::vector<int64_t> keys(s.K);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seg = task % S, bh = task / S, hkv = bh % s.Hkv, b = bh / s.Hkv;
      const T* kb = k + bh * s.Tk * s.D;
      const T* vb = v + bh * s.Tk * s.Dv;
      T* dkb = seg == 0 ? dk + bh * s.Tk * s.D : part_k.data() + ((seg - 1) * s.B * s.Hkv + bh) * s.Tk * s.D;
      T* dvb = seg == 0 ? dv + bh * s.Tk * s.Dv : part_v.data() + ((seg - 1) * s.B * s.Hkv + bh) * s.Tk * s.Dv;
      for (int64_t i = seg * seg_len; i < std::min(s.Tq, (seg + 1) * seg_len); ++i) {
        for (int64_t l = 0; l < s.lists(); ++l) {
          const int64_t c = compact(s.list(index, b, hkv, l, i), s.K, keys.data());
          const int64_t h0 = hkv * s.G + l * P;
          auto row = [&](int64_t g) { return (b * s.Hq + h0 + g) * s.Tq + i; };
          for (int64_t g = 0; g < P; ++g) delta[g] = dot(dout + row(g) * s.Dv, out + row(g) * s.Dv, s.Dv);
          for (int64_t n = 0; n < c; ++n) {  // scores and dO·v of the listed pairs
            const T* krow = kb + keys[n] * s.D;
            const T* vrow = vb + keys[n] * s.Dv;
            for (int64_t g = 0; g < P; ++g) {
              p[g * s.K + n] = dot(q + row(g) * s.D, krow, s.D) * scale;
              ds[g * s.K + n] = dot(dout + row(g) * s.Dv, vrow, s.Dv);
            }
          }
          for (int64_t g = 0; g < P; ++g) {
            T* pg = p.data() + g * s.K;
            T* dsg = ds.data() + g * s.K;
            const T l_ = lse[row(g)];
            if (l_ == -inf) {  // a row that keeps nothing: zero probabilities, zero gradients
              std::fill(pg, pg + c, T(0));
            } else {
              exp_shift(pg, c, l_);  // the probabilities, from the saved log-sum-exp
            }
            for (int64_t n = 0; n < c; ++n) dsg[n] = pg[n] * (dsg[n] - delta[g]) * scale;
            T* dqr = dq + row(g) * s.D;
            const T* qr = q + row(g) * s.D;
            const T* dor = dout + row(g) * s.Dv;
            for (int64_t n = 0; n < c; ++n) {
              const int64_t j = keys[n];
              axpy(dsg[n], kb + j * s.D, dqr, s.D);
              axpy(dsg[n], qr, dkb + j * s.D, s.D);
              axpy(pg[n], dor, dvb + j * s.Dv, s.Dv);
            }
          }
        }
      }
    }
  });
  if (S > 1) {  // the segments' dk/dv, in segment order
    const int64_t nk = s.B * s.Hkv * s.Tk * s.D, nv = s.B * s.Hkv * s.Tk * s.Dv;
    at::parallel_for(0, nk, 4096, [&](int64_t a, int64_t e) {
      for (int64_t seg = 1; seg < S; ++seg) {
        for (int64_t x = a; x < e; ++x) dk[x] += part_k[(seg - 1) * nk + x];
      }
    });
    at::parallel_for(0, nv, 4096, [&](int64_t a, int64_t e) {
      for (int64_t seg = 1; seg < S; ++seg) {
        for (int64_t x = a; x < e; ++x) dv[x] += part_v[(seg - 1) * nv + x];
      }
    });
  }
}

std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                           const at::Tensor& index, double scale) {
  const Shape s = shape_of(q, k, v, index);
  at::Tensor out = at::empty({s.B, s.Hq, s.Tq, s.Dv}, q.options());
  at::Tensor lse = at::empty({s.B, s.Hq, s.Tq}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "attnkit_sparse_forward", [&] {
    forward_kernel<scalar_t>(s, q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
                             index.data_ptr<int64_t>(), static_cast<scalar_t>(scale), out.data_ptr<scalar_t>(),
                             lse.data_ptr<scalar_t>());
  });
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> backward(const at::Tensor& dout, const at::Tensor& q,
                                                        const at::Tensor& k, const at::Tensor& v,
                                                        const at::Tensor& out, const at::Tensor& lse,
                                                        const at::Tensor& index, double scale) {
  const Shape s = shape_of(q, k, v, index);
  TORCH_CHECK(dout.is_contiguous() && out.is_contiguous() && lse.is_contiguous(),
              "attnkit_sparse: contiguous tensors expected");
  at::Tensor dq = at::zeros_like(q), dk = at::zeros_like(k), dv = at::zeros_like(v);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "attnkit_sparse_backward", [&] {
    backward_kernel<scalar_t>(s, dout.data_ptr<scalar_t>(), q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(),
                              v.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), lse.data_ptr<scalar_t>(),
                              index.data_ptr<int64_t>(), static_cast<scalar_t>(scale), dq.data_ptr<scalar_t>(),
                              dk.data_ptr<scalar_t>(), dv.data_ptr<scalar_t>());
  });
  return {dq, dk, dv};
}

}  // namespace

TORCH_LIBRARY(attnkit_sparse, m) {
  m.def("forward(Tensor q, Tensor k, Tensor v, Tensor index, float scale) -> (Tensor, Tensor)");
  m.impl("forward", c10::DispatchKey::CPU, TORCH_FN(forward));
  m.def("backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor index, float scale) "
        "-> (Tensor, Tensor, Tensor)");
  m.impl("backward", c10::DispatchKey::CPU, TORCH_FN(backward));
}
