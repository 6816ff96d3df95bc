// The one data contract between Python and every attention kernel (prefill: attention.cpp, decode:
// decode.cpp): the mask's structure and the score modifiers of a call, as three grouped operator
// arguments built by one Python helper (attnkit/backends/native_ops.py, kernel_spec):
//
//   Tensor[] tensors  one slot per kind of data (Slot below; an empty tensor: absent)
//   SymInt[] ints     positions and band bounds (Int below), then the score-modifier chain as
//                     triples (op, a, b) in the order the modifiers apply (Op below)
//   float[]  floats   the scale (Float below), then one cap per soft-cap op
//
// The slot numbers here and in native_ops.py are the same list; a new kind of data is one more slot
// at the end of both.
//
// Score pipeline per (query, key), positions absolute, d = pos(k) - pos(q):
//   s = scale * q.k  (+ bias[b, h, i, j], read through its strides: 0 on broadcast dims)
//   then the chain, in order:
//     ADD    s += dist[a, h, d - dmin]        (per-(head, distance) vectors: prefill, differentiable)
//     CAP    s  = cap * tanh(s / cap)         (one tanh for every kernel: tanh_approx below)
//     ALIBI  s -= slopes[a, h] * |d|          (from the slopes: nothing per call grows with Tk)
//     REL    s += rel[a + h * (2b + 1) + clamp(d, -b, b) + b]
//            (a relative bias as its value per clamped distance: T5's buckets are constant past
//            max_distance = b in either direction, so 2b + 1 values per head are exact)
//   then the mask: band bounds (-left <= d <= right), key lengths, key validity, document ids, a
//   block layout, and byte keep data (prefill: keep tiles per PARTIAL tile; decode: a broadcast
//   (B, Hq, Tq, Tk) bool view); a key a row may not see gets -inf by replacement;
//   then sinks[h] join each row's softmax normaliser.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "tiles.h"

namespace attnkit {

// Tensor slots (Tensor[] tensors).
enum Slot : int64_t {
  GRID = 0,     // prefill: (nQ, nK) uint8 tile grid (0 EMPTY, 1 PARTIAL, 2 FULL)
  LENGTHS,      // (B) int64: pos(k) < lengths[b]
  VALID,        // (Bv, P) bool: valid[b, pos(k)]
  DOC,          // (Bd, P) int64: doc[b, pos(q)] == doc[b, pos(k)]
  LAYOUT,       // (Hl, nQB, nKB) bool block layout (block size: Int LAYOUT_BS)
  EXTRA_INDEX,  // prefill: (nQ, nK) int64 tile -> keep tile number, -1 none
  EXTRA,        // prefill: (n, Bx, Hx, block_q, block_k) uint8 keep tiles
  KEEP,         // decode: a (B, Hq, Tq, Tk) bool view (strides 0 where broadcast)
  BIAS,         // (B, Hq, Tq, Tk) view of the statistics' dtype (strides 0 where broadcast)
  DIST,         // (n_add, Hq, Tq + Tk - 1) contiguous: ADD vectors from distance Int DMIN
  SLOPES,       // (n_alibi, Hq) contiguous: ALIBI slopes
  REL_VALUES,   // flat: each REL op's (Hq, 2 L + 1) values per clamped distance
  SINKS,        // (Hq) sink logits
  NUM_SLOTS
};

// Int slots (SymInt[] ints); the chain follows as triples from NUM_INTS.
enum Int : int64_t { Q_OFFSET = 0, KV_OFFSET, HAS_LEFT, LEFT, HAS_RIGHT, RIGHT, LAYOUT_BS, DMIN, NUM_INTS };
// Float slots (float[] floats); the caps follow from NUM_FLOATS.
enum Float : int64_t { SCALE = 0, NUM_FLOATS };

enum Op : int64_t { ADD = 0, CAP = 1, ALIBI = 2, REL = 3 };

struct Strided4 {  // a broadcast (B, Hq, Tq, Tk) view: strides in elements (0 where broadcast)
  int64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  inline int64_t at(int64_t b, int64_t h, int64_t i, int64_t j) const { return b * s0 + h * s1 + i * s2 + j * s3; }
};

inline Strided4 strides4(const at::Tensor& x) {
  Strided4 s;
  s.s0 = x.stride(0), s.s1 = x.stride(1), s.s2 = x.stride(2), s.s3 = x.stride(3);
  return s;
}

// Everything that decides keep(b, h, i, j).
struct MaskSpec {
  const uint8_t* grid = nullptr;  // prefill (at least nQ x nK): the call's tiles first (a traced call's grid has a spare row and column)
  int64_t nK = 0;                 // the grid's row stride
  bool has_left = false, has_right = false;
  int64_t left = 0, right = 0;          // -left <= pos(k) - pos(q) <= right
  const int64_t* lengths = nullptr;     // (B): pos(k) < lengths[b]; or null
  const bool* valid = nullptr;          // (Bv, P): valid[b, pos(k)]; or null
  int64_t valid_b = 0, valid_p = 0;
  const int64_t* doc = nullptr;         // (Bd, P): doc[b, pos(q)] == doc[b, pos(k)]; or null
  int64_t doc_b = 0, doc_p = 0;
  const bool* layout = nullptr;         // (Hl, nQB, nKB) with block size layout_bs; or null
  int64_t layout_h = 0, layout_r = 0, layout_c = 0, layout_bs = 0;
  const int64_t* extra_index = nullptr; // prefill: shaped like grid: tile number in extra, -1 = none; or null
  const uint8_t* extra = nullptr;       // (n, Bx, Hx, block_q, block_k)
  int64_t extra_b = 0, extra_h = 0;
  const bool* keep = nullptr;           // decode: (B, Hq, Tq, Tk) through keep_st; or null
  Strided4 keep_st;

  // For masks made of band bounds and key lengths only, a row keeps one contiguous range of keys.
  bool ranges_only() const { return !valid && !doc && !layout && !extra_index && !keep; }

  // The keys kp0 + j, j in [lo, hi) of [0, nk), that the band bounds and key lengths keep for the
  // query at qp in sequence b.
  inline void band_range(int64_t b, int64_t qp, int64_t kp0, int64_t nk, int64_t& lo, int64_t& hi) const {
    lo = 0, hi = nk;
    if (has_left) lo = std::max(lo, qp - left - kp0);
    if (has_right) hi = std::min(hi, qp + right - kp0 + 1);
    if (lengths) hi = std::min(hi, lengths[b] - kp0);
    lo = std::min(std::max(lo, int64_t(0)), nk);
    hi = std::max(std::min(hi, nk), lo);
  }
};

// The score modifiers, in the scores' type A (float32 for float32/bfloat16/float16, float64 for
// float64).
template <typename A>
struct ScoreMods {
  const A* bias = nullptr;  // BIAS through bias_st; null when absent
  Strided4 bias_st;
  const A* dist = nullptr;  // DIST: dist[(a * Hq + h) * ndist + (d - dmin)]
  int64_t Hq = 0, n_add = 0, ndist = 0, dmin = 0;
  const A* slopes = nullptr;  // SLOPES (n_alibi, Hq)
  const A* rel = nullptr;     // REL values
  const int64_t* chain = nullptr;  // triples (op, a, b)
  int64_t n_ops = 0, n_cap = 0;
  const double* caps = nullptr;  // one per CAP op, in order
  const A* sinks = nullptr;      // (Hq) or null

  bool modifies() const { return bias || n_ops; }
  int64_t op(int64_t o) const { return chain[3 * o]; }
};

// tanh, vectorizable: Cephes' tanhf (a polynomial below 0.625, 1 - 2 / (exp(2|x|) + 1) above, with
// the row exp's polynomial; |error| ~ 2 ulp). The double version calls std::tanh. Every kernel's
// soft-cap is this function, so prefill and decode cap a score to the same bits.
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

// Modify the scaled scores s[i * ld + j] (rows: call queries i0.., absolute positions qp0..;
// columns: call keys j0.., absolute kp0..) for batch b, query head h. `tanh_keep`, when given,
// receives the tanh values of each CAP stage (n_cap planes of `plane` elements, ld apart).
template <typename A>
void apply_score_mods(const ScoreMods<A>& m, int64_t b, int64_t h, int64_t i0, int64_t j0, int64_t qp0, int64_t kp0,
                      int64_t nq, int64_t nk, int64_t ld, int64_t plane, A* s, A* tanh_keep) {
  if (m.bias) {
    for (int64_t i = 0; i < nq; ++i) {
      const A* br = m.bias + m.bias_st.at(b, h, i0 + i, j0);
      A* row = s + i * ld;
      const int64_t sk = m.bias_st.s3;
      if (sk == 1) {
        for (int64_t j = 0; j < nk; ++j) row[j] += br[j];
      } else {
        for (int64_t j = 0; j < nk; ++j) row[j] += br[j * sk];
      }
    }
  }
  int64_t c = 0;
  for (int64_t o = 0; o < m.n_ops; ++o) {
    const int64_t a = m.chain[3 * o + 1], w = m.chain[3 * o + 2];
    switch (m.op(o)) {
      case ADD: {
        const A* vec = m.dist + (a * m.Hq + h) * m.ndist;
        for (int64_t i = 0; i < nq; ++i) {
          const A* r = vec + (kp0 - (qp0 + i) - m.dmin);  // r[j]: distance (kp0 + j) - (qp0 + i)
          A* row = s + i * ld;
          for (int64_t j = 0; j < nk; ++j) row[j] += r[j];
        }
        break;
      }
      case CAP: {
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
        break;
      }
      case ALIBI: {
        const A slope = m.slopes[a * m.Hq + h];
        for (int64_t i = 0; i < nq; ++i) {
          const int64_t d0 = kp0 - (qp0 + i);
          A* row = s + i * ld;
          for (int64_t j = 0; j < nk; ++j) row[j] -= slope * static_cast<A>(std::abs(d0 + j));
        }
        break;
      }
      default: {  // REL
        const A* vals = m.rel + a + h * (2 * w + 1) + w;  // vals[d], -w <= d <= w
        for (int64_t i = 0; i < nq; ++i) {
          const int64_t d0 = kp0 - (qp0 + i);
          A* row = s + i * ld;
          for (int64_t j = 0; j < nk; ++j) row[j] += vals[std::min(std::max(d0 + j, -w), w)];
        }
        break;
      }
    }
  }
}

// The mask's part of the contract from the grouped arguments (tensors, ints).
inline MaskSpec make_mask_spec(c10::ArrayRef<at::Tensor> t, c10::IntArrayRef ints) {
  TORCH_CHECK(static_cast<int64_t>(t.size()) == NUM_SLOTS && static_cast<int64_t>(ints.size()) >= NUM_INTS,
              "kernel spec: expected ", int64_t(NUM_SLOTS), " tensors and at least ", int64_t(NUM_INTS),
              " ints (attnkit.backends.native_ops.kernel_spec builds them)");
  MaskSpec m{};
  m.has_left = ints[HAS_LEFT] != 0, m.left = ints[LEFT], m.has_right = ints[HAS_RIGHT] != 0, m.right = ints[RIGHT];
  if (t[GRID].numel()) {
    TORCH_CHECK(t[GRID].scalar_type() == at::kByte && t[GRID].dim() == 2 && t[GRID].is_contiguous(),
                "tile grid: expected a contiguous uint8 (nQ, nK) tensor");
    m.grid = t[GRID].data_ptr<uint8_t>(), m.nK = t[GRID].size(1);
  }
  if (t[LENGTHS].numel()) m.lengths = t[LENGTHS].data_ptr<int64_t>();
  if (t[VALID].numel()) m.valid = t[VALID].data_ptr<bool>(), m.valid_b = t[VALID].size(0), m.valid_p = t[VALID].size(1);
  if (t[DOC].numel()) m.doc = t[DOC].data_ptr<int64_t>(), m.doc_b = t[DOC].size(0), m.doc_p = t[DOC].size(1);
  if (t[LAYOUT].numel()) {
    const at::Tensor& l = t[LAYOUT];
    m.layout = l.data_ptr<bool>(), m.layout_h = l.size(0), m.layout_r = l.size(1), m.layout_c = l.size(2);
    m.layout_bs = ints[LAYOUT_BS];
  }
  if (t[EXTRA_INDEX].numel()) {
    TORCH_CHECK(t[EXTRA_INDEX].sizes() == t[GRID].sizes(), "extra tile index: expected the grid's shape");
    m.extra_index = t[EXTRA_INDEX].data_ptr<int64_t>();
    m.extra = t[EXTRA].data_ptr<uint8_t>(), m.extra_b = t[EXTRA].size(1), m.extra_h = t[EXTRA].size(2);
  }
  if (t[KEEP].numel()) {
    TORCH_CHECK(t[KEEP].scalar_type() == at::kBool && t[KEEP].dim() == 4, "keep: expected a 4-d bool tensor");
    m.keep = t[KEEP].data_ptr<bool>(), m.keep_st = strides4(t[KEEP]);
  }
  return m;
}

// The score modifiers' part of the contract, in the scores' type A, for queries (B, Hq, Tq) and Tk
// keys; an empty slot is absent.
template <typename A>
ScoreMods<A> make_mods(c10::ArrayRef<at::Tensor> t, c10::IntArrayRef ints, c10::ArrayRef<double> floats, int64_t B,
                       int64_t Hq, int64_t Tq, int64_t Tk) {
  const auto stat = c10::CppTypeToScalarType<A>::value;
  for (const Slot s : {BIAS, DIST, SLOPES, REL_VALUES, SINKS}) {
    TORCH_CHECK(t[s].numel() == 0 || (t[s].device().is_cpu() && t[s].scalar_type() == stat),
                "bias, dist, slopes, relative values and sinks: expected CPU tensors of the statistics' dtype ", stat);
  }
  ScoreMods<A> mods;
  mods.Hq = Hq;
  if (t[BIAS].numel()) {
    const at::Tensor& bias = t[BIAS];
    TORCH_CHECK(bias.dim() == 4 && bias.size(0) == B && bias.size(1) == Hq && bias.size(2) == Tq &&
                    bias.size(3) == Tk,
                "bias: expected (B, Hq, Tq, Tk) (broadcast dims with stride 0), got ", bias.sizes());
    mods.bias = bias.data_ptr<A>(), mods.bias_st = strides4(bias);
  }
  if (t[DIST].numel()) {
    const at::Tensor& dist = t[DIST];
    const int64_t dmin = ints[DMIN];
    TORCH_CHECK(dist.dim() == 3 && dist.size(1) == Hq && dist.size(2) == Tq + Tk - 1 && dist.is_contiguous() &&
                    dmin == ints[KV_OFFSET] - (ints[Q_OFFSET] + Tq - 1),
                "dist: expected a contiguous (n_add, Hq, Tq + Tk - 1) tensor starting at distance "
                "kv_offset - (q_offset + Tq - 1)");
    mods.dist = dist.data_ptr<A>(), mods.n_add = dist.size(0), mods.ndist = dist.size(2), mods.dmin = dmin;
  }
  int64_t n_alibi = 0;
  if (t[SLOPES].numel()) {
    TORCH_CHECK(t[SLOPES].dim() == 2 && t[SLOPES].size(1) == Hq && t[SLOPES].is_contiguous(),
                "slopes: expected a contiguous (n_alibi, Hq) tensor");
    mods.slopes = t[SLOPES].data_ptr<A>(), n_alibi = t[SLOPES].size(0);
  }
  if (t[REL_VALUES].numel()) {
    TORCH_CHECK(t[REL_VALUES].is_contiguous(), "relative values: expected a contiguous tensor");
    mods.rel = t[REL_VALUES].data_ptr<A>();
  }
  const int64_t n_chain = static_cast<int64_t>(ints.size()) - NUM_INTS;
  TORCH_CHECK(n_chain % 3 == 0, "score modifier chain: expected triples (op, a, b) after the ", int64_t(NUM_INTS),
              " position ints");
  mods.chain = ints.data() + NUM_INTS, mods.n_ops = n_chain / 3, mods.caps = floats.data() + NUM_FLOATS;
  int64_t n_add = 0;
  for (int64_t o = 0; o < mods.n_ops; ++o) {
    const int64_t op = mods.chain[3 * o], a = mods.chain[3 * o + 1], w = mods.chain[3 * o + 2];
    switch (op) {
      case ADD: TORCH_CHECK(a == n_add++, "score modifier chain: ADD rows in order"); break;
      case CAP: ++mods.n_cap; break;
      case ALIBI: TORCH_CHECK(0 <= a && a < n_alibi, "score modifier chain: ALIBI row ", a, " of ", n_alibi); break;
      case REL:
        TORCH_CHECK(w >= 0 && a >= 0 && a + Hq * (2 * w + 1) <= t[REL_VALUES].numel(),
                    "score modifier chain: REL values out of range");
        break;
      default: TORCH_CHECK(false, "score modifier ops: 0 add, 1 cap, 2 alibi, 3 relative, got ", op);
    }
  }
  TORCH_CHECK(n_add == mods.n_add && mods.n_cap == static_cast<int64_t>(floats.size()) - NUM_FLOATS,
              "score modifier chain: one dist vector per add, one cap per cap");
  if (t[SINKS].numel()) {
    TORCH_CHECK(t[SINKS].numel() == Hq && t[SINKS].is_contiguous(), "sinks: expected (Hq,)");
    mods.sinks = t[SINKS].data_ptr<A>();
  }
  return mods;
}

}  // namespace attnkit
