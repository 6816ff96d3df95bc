// Score modifiers for the fused CPU attention kernel, forward and backward, one tile at a time.
//
// The modifiers arrive as data (attnkit.score_mods.ScoreModSpec, lowered by the native backend):
//   * an optional additive bias tensor read through its strides (broadcast dims have stride 0),
//     added to the scaled scores first;
//   * a chain of operations in the order they apply: ADD adds a per-(head, relative distance)
//     vector (ALiBi is -slope[h] * |d|, a T5 relative bias is table[h, bucket(d)], with
//     d = pos(k) - pos(q); consecutive additive terms arrive summed), CAP soft-caps
//     (cap * tanh(s / cap));
//   * optional per-head sink logits, which join each row's softmax normaliser (in the kernel).
// Masking comes after the modifiers (the caller masks the tile after apply_score_mods), as eager
// Gemma-2 does. The backward walks the chain in reverse: d/ds of CAP is 1 - tanh^2 (the tanh
// values of the forward recomputation are kept per CAP stage), ADD passes the gradient through
// and accumulates it per (head, distance), from which autograd reaches slopes and tables.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace attnkit_score_mod {

enum Op : int64_t { ADD = 0, CAP = 1 };

template <typename T>
struct ScoreMods {
  // Additive bias (B|1, Hq|1, Tq|1, Tk|1) through strides; null when absent.
  const T* bias = nullptr;
  int64_t bias_sb = 0, bias_sh = 0, bias_sq = 0, bias_sk = 0;
  // ADD vectors: dist[(a * Hq + h) * ndist + (d - dmin)], a = the ADD op's rank.
  const T* dist = nullptr;
  int64_t Hq = 0, n_add = 0, ndist = 0, dmin = 0;
  const int64_t* ops = nullptr;  // Op codes in chain order
  int64_t n_ops = 0, n_cap = 0;
  const double* caps = nullptr;  // one per CAP op, in order
  const T* sinks = nullptr;      // (Hq) or null

  bool modifies() const { return bias || n_ops; }
};

// exp(a) for a <= 88.3, vectorizable: Cephes' expf polynomial (|error| ~ 1 ulp); arguments below
// -87.3 are clamped there (the caller maps them to 0 where it needs exactly 0).
inline float exp_approx(float a) {
  const float xc = std::max(a, -87.3f);
  const float fn = std::floor(xc * 1.44269504088896341f + 0.5f);
  const float r = xc - fn * 0.693359375f + fn * 2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(fn) + 127) << 23;
  return y * __builtin_bit_cast(float, bits);
}

// tanh, vectorizable: Cephes' tanhf (a polynomial below 0.625, 1 - 2 / (exp(2|x|) + 1) above;
// |error| ~ 2 ulp). The double version calls std::tanh.
inline float tanh_approx(float x) {
  const float ax = std::min(std::fabs(x), 9.f);  // tanh(9) rounds to 1 in float
  const float z = x * x;
  const float small =
      ((((-5.70498872745e-3f * z + 2.06390887954e-2f) * z - 5.37397155531e-2f) * z + 1.33314422036e-1f) * z -
       3.33332819422e-1f) * z * x + x;
  const float large = 1.f - 2.f / (exp_approx(2.f * ax) + 1.f);
  return ax < 0.625f ? small : (x < 0.f ? -large : large);
}
inline double tanh_approx(double x) { return std::tanh(x); }

// Modify the tile's scaled scores s[i * ld + j] (rows: call queries i0.., absolute positions
// qp0..; columns: call keys j0.., absolute kp0..) for batch b, query head h. `tanh_keep`, when
// given, receives the tanh values of each CAP stage (n_cap planes of block_q * ld) for the backward.
template <typename T>
void apply_score_mods(const ScoreMods<T>& m, int64_t b, int64_t h, int64_t i0, int64_t j0, int64_t qp0, int64_t kp0,
                      int64_t nq, int64_t nk, int64_t ld, int64_t plane, T* s, T* tanh_keep) {
  if (m.bias) {
    const T* bb = m.bias + b * m.bias_sb + h * m.bias_sh;
    for (int64_t i = 0; i < nq; ++i) {
      const T* br = bb + (i0 + i) * m.bias_sq + j0 * m.bias_sk;
      T* row = s + i * ld;
      if (m.bias_sk == 1) {
#pragma omp simd
        for (int64_t j = 0; j < nk; ++j) row[j] += br[j];
      } else {
        for (int64_t j = 0; j < nk; ++j) row[j] += br[j * m.bias_sk];
      }
    }
  }
  int64_t a = 0, c = 0;
  for (int64_t o = 0; o < m.n_ops; ++o) {
    if (m.ops[o] == ADD) {
      const T* vec = m.dist + (a * m.Hq + h) * m.ndist;
      for (int64_t i = 0; i < nq; ++i) {
        const T* r = vec + (kp0 - (qp0 + i) - m.dmin);  // r[j]: distance (kp0 + j) - (qp0 + i)
        T* row = s + i * ld;
#pragma omp simd
        for (int64_t j = 0; j < nk; ++j) row[j] += r[j];
      }
      ++a;
    } else {
      const T cap = static_cast<T>(m.caps[c]), inv = T(1) / cap;
      T* keep = tanh_keep ? tanh_keep + c * plane : nullptr;
      for (int64_t i = 0; i < nq; ++i) {
        T* row = s + i * ld;
        T* kr = keep ? keep + i * ld : nullptr;
#pragma omp simd
        for (int64_t j = 0; j < nk; ++j) {
          const T t = tanh_approx(row[j] * inv);
          if (kr) kr[j] = t;
          row[j] = cap * t;
        }
      }
      ++c;
    }
  }
}

// The chain rule through the modifiers: g[i * ld + j] holds d loss / d (modified score) and
// becomes d loss / d (scaled score). ADD gradients accumulate into d_dist (n_add, Hq, ndist) of
// this batch row; the bias gradient, when wanted, is written to dbias (B, Hq, Tq, Tk) dense.
template <typename T>
void score_mods_backward(const ScoreMods<T>& m, int64_t b, int64_t h, int64_t i0, int64_t j0, int64_t qp0, int64_t kp0,
                         int64_t nq, int64_t nk, int64_t ld, int64_t plane, const T* tanh_keep, T* g, T* d_dist,
                         T* dbias, int64_t Tq, int64_t Tk) {
  int64_t a = 0;
  for (int64_t o = 0; o < m.n_ops; ++o) a += m.ops[o] == ADD;
  int64_t c = m.n_cap;
  for (int64_t o = m.n_ops - 1; o >= 0; --o) {
    if (m.ops[o] == ADD) {
      --a;
      if (!d_dist) continue;
      T* vec = d_dist + (a * m.Hq + h) * m.ndist;
      for (int64_t i = 0; i < nq; ++i) {
        T* r = vec + (kp0 - (qp0 + i) - m.dmin);
        const T* gr = g + i * ld;
        for (int64_t j = 0; j < nk; ++j) r[j] += gr[j];
      }
    } else {
      --c;
      const T* keep = tanh_keep + c * plane;
      for (int64_t i = 0; i < nq; ++i) {
        T* gr = g + i * ld;
        const T* kr = keep + i * ld;
#pragma omp simd
        for (int64_t j = 0; j < nk; ++j) gr[j] *= T(1) - kr[j] * kr[j];
      }
    }
  }
  if (dbias) {
    for (int64_t i = 0; i < nq; ++i) {
      std::memcpy(dbias + ((b * m.Hq + h) * Tq + i0 + i) * Tk + j0, g + i * ld, nk * sizeof(T));
    }
  }
}

}  // namespace attnkit_score_mod
