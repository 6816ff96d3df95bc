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
// Everything here runs on the scores' type A (float32 for float32/bfloat16/float16 tiles, float64
// for float64), after the tile product and before masking (as eager Gemma-2 does). The backward
// walks the chain in reverse: d/ds of CAP is 1 - tanh^2 (the tanh values of the forward
// recomputation are kept per CAP stage), ADD passes the gradient through and accumulates it per
// (head, distance), from which autograd reaches slopes and tables.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "tiles.h"

namespace attnkit {

enum ScoreModOp : int64_t { ADD = 0, CAP = 1 };

template <typename A>
struct ScoreMods {
  // Additive bias (B, Hq, Tq, Tk) through strides (0 on broadcast dims); null when absent.
  const A* bias = nullptr;
  int64_t bias_sb = 0, bias_sh = 0, bias_sq = 0, bias_sk = 0;
  // ADD vectors: dist[(a * Hq + h) * ndist + (d - dmin)], a = the ADD op's rank.
  const A* dist = nullptr;
  int64_t Hq = 0, n_add = 0, ndist = 0, dmin = 0;
  const int64_t* ops = nullptr;  // ScoreModOp codes in chain order
  int64_t n_ops = 0, n_cap = 0;
  const double* caps = nullptr;  // one per CAP op, in order
  const A* sinks = nullptr;      // (Hq) or null

  bool modifies() const { return bias || n_ops; }
};

// tanh, vectorizable: Cephes' tanhf (a polynomial below 0.625, 1 - 2 / (exp(2|x|) + 1) above, with
// the row exp's polynomial; |error| ~ 2 ulp). The double version calls std::tanh.
inline float tanh_approx(float x) {
  const float ax = std::min(std::fabs(x), 9.f);  // tanh(9) rounds to 1 in float
  const float z = x * x;
  const float small =
      ((((-5.70498872745e-3f * z + 2.06390887954e-2f) * z - 5.37397155531e-2f) * z + 1.33314422036e-1f) * z -
       3.33332819422e-1f) * z * x + x;
  const float large = 1.f - 2.f / (exp_poly(2.f * ax) + 1.f);
  return ax < 0.625f ? small : (x < 0.f ? -large : large);
}
inline double tanh_approx(double x) { return std::tanh(x); }

// Modify the tile's scaled scores s[i * ld + j] (rows: call queries i0.., absolute positions
// qp0..; columns: call keys j0.., absolute kp0..) for batch b, query head h. `tanh_keep`, when
// given, receives the tanh values of each CAP stage (n_cap planes of `plane` elements, ld apart).
template <typename A>
void apply_score_mods(const ScoreMods<A>& m, int64_t b, int64_t h, int64_t i0, int64_t j0, int64_t qp0, int64_t kp0,
                      int64_t nq, int64_t nk, int64_t ld, int64_t plane, A* s, A* tanh_keep) {
  if (m.bias) {
    const A* bb = m.bias + b * m.bias_sb + h * m.bias_sh;
    for (int64_t i = 0; i < nq; ++i) {
      const A* br = bb + (i0 + i) * m.bias_sq + j0 * m.bias_sk;
      A* row = s + i * ld;
      if (m.bias_sk == 1) {
        for (int64_t j = 0; j < nk; ++j) row[j] += br[j];
      } else {
        for (int64_t j = 0; j < nk; ++j) row[j] += br[j * m.bias_sk];
      }
    }
  }
  int64_t a = 0, c = 0;
  for (int64_t o = 0; o < m.n_ops; ++o) {
    if (m.ops[o] == ADD) {
      const A* vec = m.dist + (a * m.Hq + h) * m.ndist;
      for (int64_t i = 0; i < nq; ++i) {
        const A* r = vec + (kp0 - (qp0 + i) - m.dmin);  // r[j]: distance (kp0 + j) - (qp0 + i)
        A* row = s + i * ld;
        for (int64_t j = 0; j < nk; ++j) row[j] += r[j];
      }
      ++a;
    } else {
      const A cap = static_cast<A>(m.caps[c]), inv = A(1) / cap;
      A* keep = tanh_keep ? tanh_keep + c * plane : nullptr;
      for (int64_t i = 0; i < nq; ++i) {
        A* row = s + i * ld;
        if (keep) {
          A* kr = keep + i * ld;
          for (int64_t j = 0; j < nk; ++j) {
            kr[j] = tanh_approx(row[j] * inv);
            row[j] = cap * kr[j];
          }
        } else {
          for (int64_t j = 0; j < nk; ++j) row[j] = cap * tanh_approx(row[j] * inv);
        }
      }
      ++c;
    }
  }
}

// Where the backward accumulates the ADD vectors' gradients for one tile: acc + a * stride_a is
// the buffer of ADD rank a, its element 0 the gradient at relative distance d0 (null: not wanted).
template <typename A>
struct DistGrad {
  A* acc = nullptr;
  int64_t stride_a = 0, d0 = 0;
};

// The chain rule through the modifiers: g[i * ld + j] holds d loss / d (modified score) and becomes
// d loss / d (scaled score) (what the bias receives). ADD gradients accumulate into `dd` (rows in
// order, keys ascending: a fixed order); the bias gradient, when wanted, is written (each tile
// once) to dbias (B, Hq, Tq, Tk) dense.
template <typename A>
void score_mods_backward(const ScoreMods<A>& m, int64_t b, int64_t h, int64_t i0, int64_t j0, int64_t qp0, int64_t kp0,
                         int64_t nq, int64_t nk, int64_t ld, int64_t plane, const A* tanh_keep, A* g,
                         const DistGrad<A>& dd, A* dbias, int64_t Tq, int64_t Tk) {
  int64_t a = m.n_add, c = m.n_cap;
  for (int64_t o = m.n_ops - 1; o >= 0; --o) {
    if (m.ops[o] == ADD) {
      --a;
      if (!dd.acc) continue;
      A* vec = dd.acc + a * dd.stride_a;
      for (int64_t i = 0; i < nq; ++i) {
        A* r = vec + (kp0 - (qp0 + i) - dd.d0);
        const A* gr = g + i * ld;
        for (int64_t j = 0; j < nk; ++j) r[j] += gr[j];
      }
    } else {
      --c;
      const A* keep = tanh_keep + c * plane;
      for (int64_t i = 0; i < nq; ++i) {
        A* gr = g + i * ld;
        const A* kr = keep + i * ld;
        for (int64_t j = 0; j < nk; ++j) gr[j] *= A(1) - kr[j] * kr[j];
      }
    }
  }
  if (dbias) {
    for (int64_t i = 0; i < nq; ++i) {
      std::memcpy(dbias + ((b * m.Hq + h) * Tq + i0 + i) * Tk + j0, g + i * ld, nk * sizeof(A));
    }
  }
}

// The score modifiers' arguments (score_mod.h) as kernel data, in the scores' type A; an empty
// bias, dist or sinks is absent.
template <typename A>
ScoreMods<A> make_mods(const at::Tensor& q, const at::Tensor& k, int64_t q_offset, int64_t kv_offset,
                       const at::Tensor& bias, const at::Tensor& dist, int64_t dmin, c10::IntArrayRef ops,
                       c10::ArrayRef<double> caps, const at::Tensor& sinks) {
  const auto stat = c10::CppTypeToScalarType<A>::value;
  const int64_t B = q.size(0), Hq = q.size(1), Tq = q.size(2), Tk = k.size(2);
  for (auto* t : {&bias, &dist, &sinks}) {
    TORCH_CHECK(t->numel() == 0 || (t->device().is_cpu() && t->scalar_type() == stat),
                "bias, dist and sinks: expected CPU tensors of the statistics' dtype ", stat);
  }
  ScoreMods<A> mods;
  mods.Hq = Hq;
  if (bias.numel()) {
    TORCH_CHECK(bias.dim() == 4 && bias.size(0) == B && bias.size(1) == Hq && bias.size(2) == Tq &&
                    bias.size(3) == Tk,
                "bias: expected (B, Hq, Tq, Tk) (broadcast dims with stride 0), got ", bias.sizes());
    mods.bias = bias.data_ptr<A>();
    mods.bias_sb = bias.stride(0), mods.bias_sh = bias.stride(1), mods.bias_sq = bias.stride(2);
    mods.bias_sk = bias.stride(3);
  }
  if (dist.numel()) {
    TORCH_CHECK(dist.dim() == 3 && dist.size(1) == Hq && dist.size(2) == Tq + Tk - 1 && dist.is_contiguous() &&
                    dmin == kv_offset - (q_offset + Tq - 1),
                "dist: expected a contiguous (n_add, Hq, Tq + Tk - 1) tensor starting at distance "
                "kv_offset - (q_offset + Tq - 1)");
    mods.dist = dist.data_ptr<A>(), mods.n_add = dist.size(0), mods.ndist = dist.size(2), mods.dmin = dmin;
  }
  mods.ops = ops.data(), mods.n_ops = static_cast<int64_t>(ops.size()), mods.caps = caps.data();
  int64_t n_add = 0;
  for (int64_t op : ops) {
    TORCH_CHECK(op == attnkit::ADD || op == attnkit::CAP, "score mod ops: 0 (add) or 1 (cap), got ", op);
    mods.n_cap += op == attnkit::CAP, n_add += op == attnkit::ADD;
  }
  TORCH_CHECK(n_add == mods.n_add && mods.n_cap == static_cast<int64_t>(caps.size()),
              "score mod ops: one dist vector per add, one cap per cap");
  if (sinks.numel()) {
    TORCH_CHECK(sinks.numel() == Hq && sinks.is_contiguous(), "sinks: expected (Hq,)");
    mods.sinks = sinks.data_ptr<A>();
  }
  return mods;
}

}  // namespace attnkit
