// Fused online-softmax attention for the CPU, forward and backward (FlashAttention-2 style),
// on PyTorch's own primitives: at::parallel_for over (batch, head, query tile) in the forward and
// over (batch, key/value head) in the backward, at::native::cpublas::gemm for every tile product
// (the CPU BLAS PyTorch's own flash kernel uses), fp32/fp64 statistics.
//
// The mask arrives as its structure: a tile grid (0 EMPTY: skipped, 1 PARTIAL: masked per element,
// 2 FULL: no mask), and for PARTIAL tiles the positional parts evaluated here from a few integers or
// index vectors (band bounds, key lengths, key validity, document ids, a block layout) plus, for any
// other mask, a byte keep tile computed by the caller. Positions are absolute (index + offset).
// A query row that sees no key gets output 0 and LSE -inf; its gradients are 0.
// NaN/Inf keys arrive zeroed with a per-key flag (B, Hkv, Tk); the forward returns a per-row flag
// marking the rows that keep a flagged key (the caller makes them NaN). GEMM shapes never depend
// on the data, so a row that cannot see a flagged key is bitwise what it is without the flag.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "score_mod.h"

using attnkit_score_mod::ScoreMods;

// The BLAS that PyTorch's CPU build links (MKL): its Fortran symbols are exported by libtorch_cpu
// (at::native::cpublas::gemm, which wraps them, is not). A torch build without them fails to load
// this extension, and the backend then declines with the loader's message.
extern "C" {
void sgemm_(const char* ta, const char* tb, const int* m, const int* n, const int* k, const float* alpha,
            const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c,
            const int* ldc);
void dgemm_(const char* ta, const char* tb, const int* m, const int* n, const int* k, const double* alpha,
            const double* a, const int* lda, const double* b, const int* ldb, const double* beta, double* c,
            const int* ldc);
}

namespace {

inline void blas(const char* ta, const char* tb, int m, int n, int k, float alpha, const float* a, int lda,
                 const float* b, int ldb, float beta, float* c, int ldc) {
  sgemm_(ta, tb, &m, &n, &k, &alpha, a, &lda, b, &ldb, &beta, c, &ldc);
}
inline void blas(const char* ta, const char* tb, int m, int n, int k, double alpha, const double* a, int lda,
                 const double* b, int ldb, double beta, double* c, int ldc) {
  dgemm_(ta, tb, &m, &n, &k, &alpha, a, &lda, b, &ldb, &beta, c, &ldc);
}

// Row-major C[M x N] = alpha * op(A) op(B) + beta * C, through the column-major BLAS: C^T = op(B)^T op(A)^T.
template <typename T>
void mm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, T alpha, const T* A, int64_t lda, const T* B,
        int64_t ldb, T beta, T* C, int64_t ldc) {
  blas(tb ? "T" : "N", ta ? "T" : "N", N, M, K, alpha, B, ldb, A, lda, beta, C, ldc);
}

// exp(x - shift) over a row, in place, returning the row sum. For float a polynomial exp
// (Cephes' expf: |error| ~ 1 ulp) that the compiler vectorizes, since a libm call per score
// would cost more than the two tile products; arguments below -87.3 (and -inf) give exactly 0.
inline float exp_row(float* __restrict x, int64_t n, float shift) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    const float a = x[j] - shift;
    const float e = attnkit_score_mod::exp_approx(std::min(a, 88.3f));
    x[j] = a < -87.3f ? 0.f : e;
    sum += x[j];
  }
  return sum;
}

inline double exp_row(double* x, int64_t n, double shift) {
  double sum = 0.;
  for (int64_t j = 0; j < n; ++j) {
    x[j] = std::exp(x[j] - shift);
    sum += x[j];
  }
  return sum;
}

// max(init, x[0..n)): float rows in 16-wide GCC vectors (a plain max reduction is one long
// dependency chain the compiler does not vectorize).
inline float row_max(const float* x, int64_t n, float init) {
  typedef float v16 __attribute__((vector_size(64)));
  v16 lanes = init - (v16){};
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    v16 v;
    std::memcpy(&v, x + j, sizeof(v));
    lanes = v > lanes ? v : lanes;
  }
  float mx = init;
  for (int u = 0; u < 16; ++u) mx = lanes[u] > mx ? lanes[u] : mx;
  for (; j < n; ++j) mx = x[j] > mx ? x[j] : mx;
  return mx;
}

inline double row_max(const double* x, int64_t n, double init) {
  double mx = init;
  for (int64_t j = 0; j < n; ++j) mx = x[j] > mx ? x[j] : mx;
  return mx;
}

// Everything that decides keep(b, h, i, j) inside a PARTIAL tile.
struct MaskSpec {
  const uint8_t* grid;  // (nQ, nK)
  int64_t nK;
  bool has_left, has_right;
  int64_t left, right;          // -left <= pos(k) - pos(q) <= right
  const int64_t* lengths;       // (B): pos(k) < lengths[b]; or null
  const bool* valid;            // (Bv, P): valid[b, pos(k)]; or null
  int64_t valid_b, valid_p;
  const int64_t* doc;           // (Bd, P): doc[b, pos(q)] == doc[b, pos(k)]; or null
  int64_t doc_b, doc_p;
  const bool* layout;           // (Hl, nQB, nKB) with block size layout_bs; or null
  int64_t layout_h, layout_r, layout_c, layout_bs;
  const int64_t* extra_index;   // (nQ, nK): tile number in extra, -1 = none; or null
  const uint8_t* extra;         // (n, Bx, Hx, block_q, block_k)
  int64_t extra_b, extra_h;
};

// Fill keep[i * bk + j] for the tile (query rows q0.., key rows k0..) of batch b, query head h.
void tile_keep(const MaskSpec& m, int64_t b, int64_t h, int64_t qt, int64_t kt, int64_t q0, int64_t nq, int64_t k0,
               int64_t nk, int64_t qpos0, int64_t kpos0, int64_t block_q, int64_t block_k, uint8_t* keep) {
  const uint8_t* extra = nullptr;
  if (m.extra_index && m.extra_index[qt * m.nK + kt] >= 0) {
    int64_t t = m.extra_index[qt * m.nK + kt];
    int64_t bx = m.extra_b > 1 ? b : 0, hx = m.extra_h > 1 ? h : 0;
    extra = m.extra + (((t * m.extra_b + bx) * m.extra_h + hx) * block_q) * block_k;
  }
  for (int64_t i = 0; i < nq; ++i) {
    const int64_t qp = qpos0 + q0 + i;
    for (int64_t j = 0; j < nk; ++j) {
      const int64_t kp = kpos0 + k0 + j;
      const int64_t d = kp - qp;
      bool ok = (!m.has_left || d >= -m.left) && (!m.has_right || d <= m.right);
      if (ok && m.lengths) ok = kp < m.lengths[b];
      if (ok && m.valid) ok = m.valid[(m.valid_b > 1 ? b : 0) * m.valid_p + kp];
      if (ok && m.doc) {
        const int64_t* ids = m.doc + (m.doc_b > 1 ? b : 0) * m.doc_p;
        ok = ids[qp] == ids[kp];
      }
      if (ok && m.layout) {
        ok = qp >= 0 && m.layout[((m.layout_h > 1 ? h : 0) * m.layout_r + qp / m.layout_bs) * m.layout_c + kp / m.layout_bs];
      }
      if (ok && extra) ok = extra[i * block_k + j];
      keep[i * block_k + j] = ok;
    }
  }
}

MaskSpec make_spec(const at::Tensor& grid, c10::IntArrayRef band, const at::Tensor& lengths,
                   const at::Tensor& valid, const at::Tensor& doc, const at::Tensor& layout, int64_t layout_bs,
                   const at::Tensor& extra_index, const at::Tensor& extra) {
  MaskSpec m{};
  m.grid = grid.data_ptr<uint8_t>();
  m.nK = grid.size(1);
  m.has_left = band[0] != 0, m.left = band[1], m.has_right = band[2] != 0, m.right = band[3];
  if (lengths.numel()) m.lengths = lengths.data_ptr<int64_t>();
  if (valid.numel()) m.valid = valid.data_ptr<bool>(), m.valid_b = valid.size(0), m.valid_p = valid.size(1);
  if (doc.numel()) m.doc = doc.data_ptr<int64_t>(), m.doc_b = doc.size(0), m.doc_p = doc.size(1);
  if (layout.numel()) {
    m.layout = layout.data_ptr<bool>();
    m.layout_h = layout.size(0), m.layout_r = layout.size(1), m.layout_c = layout.size(2), m.layout_bs = layout_bs;
  }
  if (extra_index.numel()) {
    m.extra_index = extra_index.data_ptr<int64_t>();
    m.extra = extra.data_ptr<uint8_t>(), m.extra_b = extra.size(1), m.extra_h = extra.size(2);
  }
  return m;
}

// For masks made of band bounds and key lengths only, a PARTIAL tile row keeps one contiguous
// range of keys: [lo, hi) within the tile, computed from a few integers (no per-element test).
inline bool ranges_only(const MaskSpec& m) { return !m.valid && !m.doc && !m.layout && !m.extra_index; }

template <typename T>
inline void mask_row(const MaskSpec& m, int64_t b, int64_t qp, int64_t kp0, int64_t nk, const uint8_t* keep, T* row) {
  const T ninf = -std::numeric_limits<T>::infinity();
  if (keep) {
#pragma omp simd
    for (int64_t j = 0; j < nk; ++j) row[j] = keep[j] ? row[j] : ninf;
    return;
  }
  int64_t lo = 0, hi = nk;  // keys kp0 + j for j in [lo, hi) are kept
  if (m.has_left) lo = std::max(lo, qp - m.left - kp0);
  if (m.has_right) hi = std::min(hi, qp + m.right - kp0 + 1);
  if (m.lengths) hi = std::min(hi, m.lengths[b] - kp0);
  lo = std::min(std::max(lo, int64_t(0)), nk);
  hi = std::max(std::min(hi, nk), lo);
  std::fill(row, row + lo, ninf);
  std::fill(row + hi, row + nk, ninf);
}

// The scaled scores of one tile, s[i * block_k + j] = scale * q_i . k_j, then the score modifiers
// (score_mod.h; their tanh values kept in `tanh_keep` when given), then the mask applied (-inf where
// not kept) when the tile is PARTIAL. Forward and backward both start here.
struct Tile {
  int64_t b, h, qt, kt, q0, nq, k0, nk;
};

template <typename T>
void tile_scores(const MaskSpec& m, const Tile& t, int64_t qpos0, int64_t kpos0, int64_t block_q, int64_t block_k,
                 T scale, const T* qb, const T* kb, int64_t D, T* s, uint8_t* keep, const ScoreMods<T>& mods,
                 T* tanh_keep) {
  mm<T>(false, true, t.nq, t.nk, D, scale, qb, D, kb, D, T(0), s, block_k);
  if (mods.modifies()) {
    attnkit_score_mod::apply_score_mods<T>(mods, t.b, t.h, t.q0, t.k0, qpos0 + t.q0, kpos0 + t.k0, t.nq, t.nk, block_k,
                                           block_q * block_k, s, tanh_keep);
  }
  if (m.grid[t.qt * m.nK + t.kt] != 1) return;
  const bool per_element = !ranges_only(m);
  if (per_element) tile_keep(m, t.b, t.h, t.qt, t.kt, t.q0, t.nq, t.k0, t.nk, qpos0, kpos0, block_q, block_k, keep);
  for (int64_t i = 0; i < t.nq; ++i) {
    mask_row(m, t.b, qpos0 + t.q0 + i, kpos0 + t.k0, t.nk, per_element ? keep + i * block_k : nullptr, s + i * block_k);
  }
}

template <typename T>
void forward_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out, at::Tensor& lse,
                  const at::Tensor& bad, at::Tensor& hit, double scale_d, int64_t qpos0, int64_t kpos0, int64_t block_q,
                  int64_t block_k, const MaskSpec& m, const ScoreMods<T>& mods) {
  const int64_t B = q.size(0), Hq = q.size(1), Tq = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), Tk = k.size(2), Dv = v.size(3), G = Hq / Hkv;
  const int64_t nQ = (Tq + block_q - 1) / block_q, nK = (Tk + block_k - 1) / block_k;
  const T scale = static_cast<T>(scale_d);
  const uint8_t* badp = bad.numel() ? bad.data_ptr<uint8_t>() : nullptr;  // (B, Hkv, Tk) or none
  uint8_t* hitp = badp ? hit.data_ptr<uint8_t>() : nullptr;                // (B, Hq, Tq)
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  T* op = out.data_ptr<T>();
  T* lp = lse.data_ptr<T>();
  const T ninf = -std::numeric_limits<T>::infinity();
  at::parallel_for(0, B * Hq * nQ, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> s(block_q * block_k), acc(block_q * Dv), mrow(block_q), lrow(block_q);
    std::vector<uint8_t> keep(block_q * block_k);
    for (int64_t w = begin; w < end; ++w) {
      const int64_t qt = w % nQ, h = (w / nQ) % Hq, b = w / (nQ * Hq), hk = h / G;
      const int64_t q0 = qt * block_q, nq = std::min(block_q, Tq - q0);
      const T* qb = qp + ((b * Hq + h) * Tq + q0) * D;
      const T* kh = kp + (b * Hkv + hk) * Tk * D;
      const T* vh = vp + (b * Hkv + hk) * Tk * Dv;
      std::fill(acc.begin(), acc.end(), T(0));
      // A sink starts the row max at its logit (a +inf sink at the largest finite value: the keys
      // then weigh 0 and the sink term below makes the sum +inf, output 0 and LSE +inf).
      const T sink = mods.sinks ? mods.sinks[h] : ninf;
      std::fill(mrow.begin(), mrow.end(), std::min(sink, std::numeric_limits<T>::max()));
      std::fill(lrow.begin(), lrow.end(), T(0));
      for (int64_t kt = 0; kt < nK; ++kt) {
        const uint8_t status = m.grid[qt * nK + kt];
        if (status == 0) continue;
        const int64_t k0 = kt * block_k, nk = std::min(block_k, Tk - k0);
        tile_scores<T>(m, {b, h, qt, kt, q0, nq, k0, nk}, qpos0, kpos0, block_q, block_k, scale, qb, kh + k0 * D, D,
                       s.data(), keep.data(), mods, nullptr);
        // Flagged keys (zeroed by the caller, so their scores are finite): mark the rows that keep one
        // (score not -inf). Tiles without a flagged key cost one byte scan.
        const uint8_t* bk = badp ? badp + (b * Hkv + hk) * Tk + k0 : nullptr;
        if (bk && std::memchr(bk, 1, nk)) {
          uint8_t* hb = hitp + (b * Hq + h) * Tq + q0;
          for (int64_t i = 0; i < nq; ++i) {
            const T* row = s.data() + i * block_k;
            for (int64_t j = 0; j < nk && !hb[i]; ++j) hb[i] = bk[j] && row[j] != ninf;
          }
        }
        for (int64_t i = 0; i < nq; ++i) {
          T* row = s.data() + i * block_k;
          const T mx = row_max(row, nk, mrow[i]);
          // A row with nothing kept so far keeps max -inf: shift by 0 so exp(-inf) = 0, not NaN.
          const T shift = mx == ninf ? T(0) : mx;
          const T sum = exp_row(row, nk, shift);
          const T alpha = std::exp(mrow[i] - shift);  // 0 while the row had nothing kept
          lrow[i] = lrow[i] * alpha + sum;
          mrow[i] = mx;
          T* a = acc.data() + i * Dv;
          for (int64_t c = 0; c < Dv; ++c) a[c] *= alpha;
        }
        mm<T>(false, false, nq, Dv, nk, T(1), s.data(), block_k, vh + k0 * Dv, Dv, T(1), acc.data(), Dv);
      }
      T* ob = op + ((b * Hq + h) * Tq + q0) * Dv;
      T* lb = lp + (b * Hq + h) * Tq + q0;
      for (int64_t i = 0; i < nq; ++i) {
        const T l = lrow[i] + (mods.sinks ? std::exp(sink - mrow[i]) : T(0));  // mrow >= sink: no overflow
        const T inv = l == T(0) ? T(0) : T(1) / l;
        for (int64_t c = 0; c < Dv; ++c) ob[i * Dv + c] = acc[i * Dv + c] * inv;
        lb[i] = l == T(0) ? ninf : mrow[i] + std::log(l);
      }
    }
  });
}

template <typename T>
void backward_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& dout,
                   const at::Tensor& lse, const at::Tensor& delta, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv,
                   double scale_d, int64_t qpos0, int64_t kpos0, int64_t block_q, int64_t block_k, const MaskSpec& m,
                   const ScoreMods<T>& mods, T* d_dist, T* dbias) {
  const int64_t B = q.size(0), Hq = q.size(1), Tq = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), Tk = k.size(2), Dv = v.size(3), G = Hq / Hkv;
  const int64_t nQ = (Tq + block_q - 1) / block_q, nK = (Tk + block_k - 1) / block_k;
  const T scale = static_cast<T>(scale_d);
  const T ninf = -std::numeric_limits<T>::infinity();
  const T *qp = q.data_ptr<T>(), *kp = k.data_ptr<T>(), *vp = v.data_ptr<T>(), *dop = dout.data_ptr<T>();
  const T *lp = lse.data_ptr<T>(), *dlp = delta.data_ptr<T>();
  T *dqp = dq.data_ptr<T>(), *dkp = dk.data_ptr<T>(), *dvp = dv.data_ptr<T>();
  // One (batch, kv head) per task: it owns dK/dV of its head and dQ of its G query heads (no races).
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> p(block_q * block_k), ds(block_q * block_k), tanh_keep(mods.n_cap * block_q * block_k);
    std::vector<uint8_t> keep(block_q * block_k);
    for (int64_t w = begin; w < end; ++w) {
      const int64_t hk = w % Hkv, b = w / Hkv;
      const T* kh = kp + (b * Hkv + hk) * Tk * D;
      const T* vh = vp + (b * Hkv + hk) * Tk * Dv;
      T* dkh = dkp + (b * Hkv + hk) * Tk * D;
      T* dvh = dvp + (b * Hkv + hk) * Tk * Dv;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t h = hk * G + g;
        for (int64_t qt = 0; qt < nQ; ++qt) {
          const int64_t q0 = qt * block_q, nq = std::min(block_q, Tq - q0);
          const int64_t row0 = (b * Hq + h) * Tq + q0;
          const T* qb = qp + row0 * D;
          const T* dob = dop + row0 * Dv;
          T* dqb = dqp + row0 * D;
          for (int64_t kt = 0; kt < nK; ++kt) {
            const uint8_t status = m.grid[qt * nK + kt];
            if (status == 0) continue;
            const int64_t k0 = kt * block_k, nk = std::min(block_k, Tk - k0);
            tile_scores<T>(m, {b, h, qt, kt, q0, nq, k0, nk}, qpos0, kpos0, block_q, block_k, scale, qb, kh + k0 * D,
                           D, p.data(), keep.data(), mods, tanh_keep.data());
            for (int64_t i = 0; i < nq; ++i) {
              T* row = p.data() + i * block_k;
              const T l = lp[row0 + i];
              if (l == ninf) {
                std::fill(row, row + nk, T(0));  // the row sees nothing: probabilities 0
              } else {
                exp_row(row, nk, l);
              }
            }
            // dV += P^T dO;  dP = dO V^T;  dS = P * (dP - delta);  dQ += dS K;  dK += dS^T Q
            mm<T>(true, false, nk, Dv, nq, T(1), p.data(), block_k, dob, Dv, T(1), dvh + k0 * Dv, Dv);
            mm<T>(false, true, nq, nk, Dv, T(1), dob, Dv, vh + k0 * Dv, Dv, T(0), ds.data(), block_k);
            for (int64_t i = 0; i < nq; ++i) {
              const T dl = dlp[row0 + i];
              T* dr = ds.data() + i * block_k;
              const T* pr = p.data() + i * block_k;
#pragma omp simd
              for (int64_t j = 0; j < nk; ++j) dr[j] = pr[j] * (dr[j] - dl);
            }
            if (mods.modifies()) {  // dS by the modified scores -> by the scaled scores (and the modifiers' grads)
              attnkit_score_mod::score_mods_backward<T>(mods, b, h, q0, k0, qpos0 + q0, kpos0 + k0, nq, nk, block_k,
                                                        block_q * block_k, tanh_keep.data(), ds.data(),
                                                        d_dist ? d_dist + b * mods.n_add * mods.Hq * mods.ndist : nullptr, dbias, Tq, Tk);
            }
            mm<T>(false, false, nq, D, nk, scale, ds.data(), block_k, kh + k0 * D, D, T(1), dqb, D);
            mm<T>(true, false, nk, D, nq, scale, ds.data(), block_k, qb, D, T(1), dkh + k0 * D, D);
          }
        }
      }
    }
  });
}

void check(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous(), name, " must be a contiguous CPU tensor");
}

// The score modifiers' arguments (score_mod.h) as kernel data; every tensor may be empty (absent).
template <typename T>
ScoreMods<T> make_mods(const at::Tensor& bias, const at::Tensor& dist, int64_t dmin, c10::IntArrayRef ops,
                       c10::ArrayRef<double> caps, const at::Tensor& sinks, int64_t Hq) {
  ScoreMods<T> mods;
  if (bias.numel()) {
    TORCH_CHECK(bias.dim() == 4, "bias: expected 4 dims (broadcast strides 0)");
    mods.bias = bias.data_ptr<T>();
    mods.bias_sb = bias.stride(0), mods.bias_sh = bias.stride(1), mods.bias_sq = bias.stride(2);
    mods.bias_sk = bias.stride(3);
  }
  mods.Hq = Hq;
  if (dist.numel()) {
    TORCH_CHECK(dist.dim() == 3 && dist.size(1) == Hq && dist.is_contiguous(), "dist: expected (n_add, Hq, ndist)");
    mods.dist = dist.data_ptr<T>(), mods.n_add = dist.size(0), mods.ndist = dist.size(2), mods.dmin = dmin;
  }
  mods.ops = ops.data(), mods.n_ops = static_cast<int64_t>(ops.size()), mods.caps = caps.data();
  int64_t n_add = 0;
  for (int64_t op : ops) {
    TORCH_CHECK(op == attnkit_score_mod::ADD || op == attnkit_score_mod::CAP, "score mod ops: 0 (add) or 1 (cap)");
    mods.n_cap += op == attnkit_score_mod::CAP, n_add += op == attnkit_score_mod::ADD;
  }
  TORCH_CHECK(n_add == mods.n_add && mods.n_cap == static_cast<int64_t>(caps.size()),
              "score mod ops: one dist vector per add, one cap per cap");
  if (sinks.numel()) {
    TORCH_CHECK(sinks.numel() == Hq && sinks.is_contiguous(), "sinks: expected (Hq,)");
    mods.sinks = sinks.data_ptr<T>();
  }
  return mods;
}

std::vector<at::Tensor> forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                                int64_t q_offset, int64_t kv_offset, int64_t block_q, int64_t block_k,
                                const at::Tensor& grid, c10::IntArrayRef band, const at::Tensor& lengths,
                                const at::Tensor& valid, const at::Tensor& doc, const at::Tensor& layout,
                                int64_t layout_bs, const at::Tensor& extra_index, const at::Tensor& extra,
                                const at::Tensor& bad, const at::Tensor& bias, const at::Tensor& dist, int64_t dmin,
                                c10::IntArrayRef ops, c10::ArrayRef<double> caps, const at::Tensor& sinks) {
  for (auto* t : {&q, &k, &v, &grid, &bad}) check(*t, "q, k, v, the tile grid and the key flags");
  TORCH_CHECK(bad.numel() == 0 || (bad.scalar_type() == at::kByte && bad.numel() == k.size(0) * k.size(1) * k.size(2)),
              "key flags: expected an empty or a uint8 (B, Hkv, Tk) tensor");
  auto out = at::empty({q.size(0), q.size(1), q.size(2), v.size(3)}, q.options());
  auto lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  auto hit = bad.numel() ? at::zeros({q.size(0), q.size(1), q.size(2)}, bad.options()) : at::empty({0}, bad.options());
  MaskSpec m = make_spec(grid, band, lengths, valid, doc, layout, layout_bs, extra_index, extra);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "attnkit_native_forward", [&] {
    auto mods = make_mods<scalar_t>(bias, dist, dmin, ops, caps, sinks, q.size(1));
    forward_impl<scalar_t>(q, k, v, out, lse, bad, hit, scale, q_offset, kv_offset, block_q, block_k, m, mods);
  });
  return {out, lse, hit};
}

// Returns dq, dk, dv, and with score modifiers d_dist (B, n_add, Hq, ndist) (summed over B by the
// caller) and, when need_dbias, dbias (B, Hq, Tq, Tk) (reduced to the bias's shape by the caller).
std::vector<at::Tensor> backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& dout, const at::Tensor& lse, const at::Tensor& delta, double scale,
                                 int64_t q_offset, int64_t kv_offset, int64_t block_q, int64_t block_k,
                                 const at::Tensor& grid, c10::IntArrayRef band, const at::Tensor& lengths,
                                 const at::Tensor& valid, const at::Tensor& doc, const at::Tensor& layout,
                                 int64_t layout_bs, const at::Tensor& extra_index, const at::Tensor& extra,
                                 const at::Tensor& bias, const at::Tensor& dist, int64_t dmin, c10::IntArrayRef ops,
                                 c10::ArrayRef<double> caps, const at::Tensor& sinks, bool need_dist, bool need_dbias) {
  for (auto* t : {&q, &k, &v, &dout, &lse, &delta, &grid}) check(*t, "backward inputs");
  auto dq = at::zeros_like(q), dk = at::zeros_like(k), dv = at::zeros_like(v);
  const int64_t B = q.size(0), Hq = q.size(1);
  auto d_dist = need_dist && dist.numel() ? at::zeros({B, dist.size(0), Hq, dist.size(2)}, q.options())
                                          : at::empty({0}, q.options());
  auto dbias = need_dbias ? at::zeros({B, Hq, q.size(2), k.size(2)}, q.options()) : at::empty({0}, q.options());
  MaskSpec m = make_spec(grid, band, lengths, valid, doc, layout, layout_bs, extra_index, extra);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "attnkit_native_backward", [&] {
    auto mods = make_mods<scalar_t>(bias, dist, dmin, ops, caps, sinks, Hq);
    backward_impl<scalar_t>(q, k, v, dout, lse, delta, dq, dk, dv, scale, q_offset, kv_offset, block_q, block_k, m,
                            mods, d_dist.numel() ? d_dist.data_ptr<scalar_t>() : nullptr,
                            need_dbias ? dbias.data_ptr<scalar_t>() : nullptr);
  });
  return {dq, dk, dv, d_dist, dbias};
}

}  // namespace

// Registered as torch operators (torch.ops.attnkit_native.*): no Python headers, a faster build.
TORCH_LIBRARY(attnkit_native, m) {
  m.def("forward(Tensor q, Tensor k, Tensor v, float scale, int q_offset, int kv_offset, int block_q, int block_k, "
        "Tensor grid, int[] band, Tensor lengths, Tensor valid, Tensor doc, Tensor layout, int layout_bs, "
        "Tensor extra_index, Tensor extra, Tensor bad, Tensor bias, Tensor dist, int dmin, int[] ops, float[] caps, "
        "Tensor sinks) -> Tensor[]");
  m.def("backward(Tensor q, Tensor k, Tensor v, Tensor dout, Tensor lse, Tensor delta, float scale, int q_offset, "
        "int kv_offset, int block_q, int block_k, Tensor grid, int[] band, Tensor lengths, Tensor valid, Tensor doc, "
        "Tensor layout, int layout_bs, Tensor extra_index, Tensor extra, Tensor bias, Tensor dist, int dmin, int[] ops, "
        "float[] caps, Tensor sinks, bool need_dist, bool need_dbias) -> Tensor[]");
  m.impl("forward", c10::DispatchKey::CPU, TORCH_FN(forward));
  m.impl("backward", c10::DispatchKey::CPU, TORCH_FN(backward));
}
