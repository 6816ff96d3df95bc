// Fused online-softmax attention for the CPU, forward and backward (FlashAttention-2 style), on
// PyTorch's own building blocks: at::parallel_for, oneDNN's GEMM micro-kernel through
// at::native::cpublas::brgemm (tiles.h), at::vec conversions.
//
// Precision: float32 and float64 inputs run in their own type. bfloat16 and float16 inputs run
// their tile products in that type (VNNI-packed operands where the CPU has the instructions) with
// float32 accumulation; scores, softmax statistics, the LSE and the gradient accumulators are
// float32. (The caller decides, by measurement, whether to upcast to float32 instead.)
//
// The mask and the score modifiers arrive as the kernel spec (spec.h), the one contract the decode
// kernel reads too. The mask arrives as its structure: a tile grid (0 EMPTY: skipped, 1 PARTIAL: masked per element,
// 2 FULL: no mask work), and for PARTIAL tiles the positional parts evaluated here from a few
// integers or index vectors (band bounds and key lengths as one kept range per row; key validity,
// document ids, a block layout) plus, for any other mask, a byte keep tile computed by the caller.
// Positions are absolute (index + offset). A query row that sees no key gets output 0 and LSE
// -inf; its gradients are 0. NaN/Inf keys arrive zeroed with a per-key flag (B, Hkv, Tk); the
// forward returns a per-row flag marking the rows that keep a flagged key (the caller makes them
// NaN). GEMM shapes never depend on the data, so a row that cannot see a flagged key is bitwise
// what it is without the flag.
//
// Score modifiers (score_mod.h) run on the float32 (float64) scores of each tile, after the scale
// and before the mask: an additive bias read through its strides, per-(head, distance) vectors
// (ALiBi, relative biases), soft-caps; per-head sinks join each row's normaliser. The backward
// returns the bias's gradient (dense) and the distance vectors' (per query-tile buffers, reduced
// in a fixed order at the end, so it stays deterministic under both schedules).
//
// Schedules. Forward: parallel over (batch, head, query tile). Backward (FA2): dK/dV parallel over
// key tiles and dQ over query tiles when (batch x kv heads) is smaller than the thread count, else
// one pass per (batch, kv head). Every accumulator is owned by one task and summed in a fixed
// order (query tiles ascending for dK/dV, key tiles ascending for dQ), identical in both schedules:
// the backward is deterministic, bitwise, whatever the thread count.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <cstring>
#include <limits>
#include <vector>

#include "score_mod.h"
#include "spec.h"
#include "tiles.h"

namespace {

using attnkit::Acc;
using attnkit::DistGrad;
using attnkit::ScoreMods;
using attnkit::gemm;
using attnkit::pack_a;
using attnkit::pack_b;
using attnkit::padded_k;
using attnkit::vnni_available;

using attnkit::MaskSpec;

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

// The mask's part of the kernel spec (spec.h), checked against the call's tiles.
MaskSpec make_spec(const at::Tensor& q, const at::Tensor& k, int64_t block_q, int64_t block_k,
                   c10::ArrayRef<at::Tensor> spec, c10::IntArrayRef ints) {
  TORCH_CHECK(block_q > 0 && block_k > 0, "tile sizes must be positive");
  const int64_t nQ = (q.size(2) + block_q - 1) / block_q, nK = (k.size(2) + block_k - 1) / block_k;
  MaskSpec m = attnkit::make_mask_spec(spec, ints);
  const at::Tensor& grid = spec[attnkit::GRID];
  TORCH_CHECK(m.grid && grid.size(0) >= nQ && grid.size(1) >= nK,
              "tile grid: expected uint8 with at least (", nQ, ", ", nK, ") tiles, got ", grid.sizes());
  TORCH_CHECK(!m.keep, "the prefill kernel reads keep tiles (EXTRA), not a keep tensor");
  return m;
}

template <typename T>
inline void mask_row(const MaskSpec& m, int64_t b, int64_t qp, int64_t kp0, int64_t nk, const uint8_t* keep, T* row) {
  const T ninf = -std::numeric_limits<T>::infinity();
  if (keep) {

    for (int64_t j = 0; j < nk; ++j) row[j] = keep[j] ? row[j] : ninf;
    return;
  }
  int64_t lo, hi;  // keys kp0 + j for j in [lo, hi) are kept
  m.band_range(b, qp, kp0, nk, lo, hi);
  std::fill(row, row + lo, ninf);
  std::fill(row + hi, row + nk, ninf);
}

// Task i of n in an order that pairs cheap and expensive tiles (0, n-1, 1, n-2, ...), so the
// contiguous ranges at::parallel_for hands each thread carry similar work under a causal mask.
inline int64_t zigzag(int64_t i, int64_t n) { return (i & 1) ? n - 1 - i / 2 : i / 2; }

// Shapes, tile sizes, the mask and the score modifiers of one call.
template <typename T>
struct Problem {
  int64_t B, Hq, Hkv, G, Tq, Tk, D, Dv, bq, bk, nQ, nK, qpos0, kpos0;
  int64_t Dp, Dvp, bqp, bkp;  // K dimensions as the GEMM operands store them (even for VNNI)
  const MaskSpec* m;
  const ScoreMods<Acc<T>>* mods;
  // Scores scaled in score_tile (the modifiers read scaled scores; exp_row needs a scale > 0), else
  // by exp_row: exp_scale is what exp_row multiplies scores by.
  bool prescale;
  Acc<T> scale, exp_scale;
  bool vnni;

  Problem(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale_d, int64_t qo, int64_t ko,
          int64_t block_q, int64_t block_k, const MaskSpec& spec, const ScoreMods<Acc<T>>& sm)
      : B(q.size(0)), Hq(q.size(1)), Hkv(k.size(1)), G(q.size(1) / k.size(1)), Tq(q.size(2)), Tk(k.size(2)),
        D(q.size(3)), Dv(v.size(3)), bq(block_q), bk(block_k), nQ((Tq + bq - 1) / bq), nK((Tk + bk - 1) / bk),
        qpos0(qo), kpos0(ko), Dp(padded_k<T>(D)), Dvp(padded_k<T>(Dv)), bqp(padded_k<T>(bq)), bkp(padded_k<T>(bk)),
        m(&spec), mods(&sm), prescale(!(scale_d > 0) || sm.modifies()), scale(static_cast<Acc<T>>(scale_d)),
        exp_scale(prescale ? Acc<T>(1) : scale), vnni(vnni_available<T>()) {}
  int64_t kv_tile(int64_t b, int64_t hk, int64_t kt) const { return (b * Hkv + hk) * nK + kt; }
  int64_t q_tile(int64_t b, int64_t h, int64_t qt) const { return (b * Hq + h) * nQ + qt; }
};

// The scores of one tile after its GEMM: scaled here when P.prescale (else exp_row applies the
// scale), then the score modifiers (their tanh values kept in `tanh_keep` when given), then masked
// (-inf where not kept) when the tile is PARTIAL. FULL tiles do no mask work; band/length masks
// fill each row's two excluded ends.
struct Tile {
  int64_t b, h, qt, kt, q0, nq, k0, nk;
};

template <typename T>
void score_tile(const Problem<T>& P, const Tile& t, Acc<T>* s, uint8_t* keep, Acc<T>* tanh_keep) {
  const MaskSpec& m = *P.m;
  if (P.prescale)
    for (int64_t i = 0; i < t.nq; ++i) attnkit::scale_row(s + i * P.bk, t.nk, P.scale);
  if (P.mods->modifies()) {
    attnkit::apply_score_mods(*P.mods, t.b, t.h, t.q0, t.k0, P.qpos0 + t.q0, P.kpos0 + t.k0, t.nq, t.nk, P.bk,
                              P.bq * P.bk, s, tanh_keep);
  }
  if (m.grid[t.qt * m.nK + t.kt] != 1) return;
  const bool per_element = !m.ranges_only();
  if (per_element) tile_keep(m, t.b, t.h, t.qt, t.kt, t.q0, t.nq, t.k0, t.nk, P.qpos0, P.kpos0, P.bq, P.bk, keep);
  for (int64_t i = 0; i < t.nq; ++i) {
    mask_row(m, t.b, P.qpos0 + t.q0 + i, P.kpos0 + t.k0, t.nk, per_element ? keep + i * P.bk : nullptr, s + i * P.bk);
  }
}

// GEMM operands packed once per call, one slot per key tile (or query tile): the products read
// them for every tile pair. An undefined store means the operand is read in place instead
// (row-major, not transposed, no VNNI).
template <typename T>
struct Packed {
  at::Tensor store;
  int64_t slot = 0;
  const T* at(int64_t i) const { return store.data_ptr<T>() + i * slot; }
};

// The packed operands' memory, kept by the calling thread between calls, one buffer per use
// (grow-only, at most kKeptBytes in all per thread; a larger pack gets memory of its own): each call
// writes where the last one did, in pages already mapped and warm in the caches, whatever the
// allocator did in between (fresh pages cost a page fault each, a tenth of a short call).
enum Use { kFwdK, kFwdV, kBwdK, kBwdV, kBwdKB, kBwdQ, kBwdDout, kUses };
constexpr int64_t kKeptBytes = int64_t(32) << 20;

at::Tensor scratch(Use use, int64_t numel, const at::TensorOptions& opts) {
  thread_local at::Tensor kept[kUses];
  at::Tensor& mine = kept[use];
  const int64_t bytes = numel * int64_t(opts.dtype().itemsize());
  if (mine.defined() && mine.dtype() == opts.dtype() && mine.numel() >= numel) return mine.narrow(0, 0, numel);
  int64_t others = 0;
  for (const at::Tensor& t : kept) others += &t == &mine || !t.defined() ? 0 : t.nbytes();
  if (others + bytes > kKeptBytes) return at::empty({numel}, opts);
  mine = at::empty({numel}, opts);
  return mine.narrow(0, 0, numel);
}

template <typename X>
void grow(std::vector<X>& buf, int64_t n) {
  if (int64_t(buf.size()) < n) buf.resize(n);
}

// Pack, for every (batch, head, tile) of x (B, H, T, C): B = tile (rows x C) or its transpose.
template <typename T>
Packed<T> pack_tiles(const at::Tensor& x, int64_t block, bool transposed, Use use) {
  const int64_t B = x.size(0), H = x.size(1), T_ = x.size(2), C = x.size(3), n = (T_ + block - 1) / block;
  Packed<T> p;
  p.slot = transposed ? padded_k<T>(C) * block : padded_k<T>(block) * C;
  p.store = scratch(use, B * H * n * p.slot, x.options());
  const T* src = x.data_ptr<T>();
  at::parallel_for(0, B * H * n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      const int64_t t = w % n, bh = w / n, r0 = t * block, rows = std::min(block, T_ - r0);
      const T* tile = src + (bh * T_ + r0) * C;
      T* dst = const_cast<T*>(p.at(w));
      if (transposed) {
        pack_b<T>(tile, C, true, C, rows, dst);  // (C x rows)
      } else {
        pack_b<T>(tile, C, false, rows, C, dst);  // (rows x C)
      }
    }
  });
  return p;
}

// Pack, for every (batch, head, tile) of x (B, H, T, C): the A operand tile^T (C x rows, lda
// padded_k(block)), for the products that reduce over the tile's rows.
template <typename T>
Packed<T> pack_tiles_a_transposed(const at::Tensor& x, int64_t block, Use use) {
  const int64_t B = x.size(0), H = x.size(1), T_ = x.size(2), C = x.size(3), n = (T_ + block - 1) / block;
  Packed<T> p;
  const int64_t lda = padded_k<T>(block);
  p.slot = C * lda;
  p.store = scratch(use, B * H * n * p.slot, x.options());
  const T* src = x.data_ptr<T>();
  at::parallel_for(0, B * H * n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      const int64_t t = w % n, bh = w / n, r0 = t * block, rows = std::min(block, T_ - r0);
      pack_a<T, T>(src + (bh * T_ + r0) * C, C, true, C, rows, const_cast<T*>(p.at(w)), lda);
    }
  });
  return p;
}

template <typename T>
void forward_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out, at::Tensor& lse,
                  const at::Tensor& bad, at::Tensor& hit, const Problem<T>& P) {
  using A = Acc<T>;
  const MaskSpec& m = *P.m;
  const uint8_t* badp = bad.numel() ? bad.data_ptr<uint8_t>() : nullptr;  // (B, Hkv, Tk) or none
  uint8_t* hitp = badp ? hit.data_ptr<uint8_t>() : nullptr;                // (B, Hq, Tq)
  const T *qp = q.data_ptr<T>(), *vp = v.data_ptr<T>();
  T* op = out.data_ptr<T>();
  A* lp = lse.data_ptr<A>();
  const A ninf = -std::numeric_limits<A>::infinity();
  const Packed<T> kT = pack_tiles<T>(k, P.bk, true, kFwdK);  // S = Q K^T
  const bool v_direct = !P.vnni;                           // P V reads V in place unless VNNI
  const Packed<T> vp_ = v_direct ? Packed<T>{} : pack_tiles<T>(v, P.bk, false, kFwdV);
  at::parallel_for(0, P.B * P.Hq * P.nQ, 1, [&](int64_t begin, int64_t end) {
    // A worker's tiles, kept by its thread between calls (grow-only: the largest tiles it ran).
    thread_local std::vector<A> s, acc, mrow, lrow;
    thread_local std::vector<T> qa, pa;
    thread_local std::vector<uint8_t> keep;
    grow(s, P.bq * P.bk), grow(acc, P.bq * P.Dv), grow(mrow, P.bq), grow(lrow, P.bq);
    grow(qa, P.bq * P.Dp), grow(pa, P.bq * P.bkp), grow(keep, P.bq * P.bk);
    for (int64_t w = begin; w < end; ++w) {
      const int64_t qt = zigzag(w % P.nQ, P.nQ), h = (w / P.nQ) % P.Hq, b = w / (P.nQ * P.Hq), hk = h / P.G;
      const int64_t q0 = qt * P.bq, nq = std::min(P.bq, P.Tq - q0), row0 = (b * P.Hq + h) * P.Tq + q0;
      const T* qb = qp + row0 * P.D;
      const T* qA = qb;
      if constexpr (attnkit::is_reduced<T>) {
        pack_a<T, T>(qb, P.D, false, nq, P.D, qa.data(), P.Dp);
        qA = qa.data();
      }
      std::fill_n(acc.data(), P.bq * P.Dv, A(0));
      // A sink starts the row max at its logit (a +inf sink at the largest finite value: the keys
      // then weigh 0 and the sink term below makes the sum +inf, output 0 and LSE +inf).
      const A sink = P.mods->sinks ? P.mods->sinks[h] : ninf;
      std::fill_n(mrow.data(), P.bq, std::min(sink, std::numeric_limits<A>::max()));
      std::fill_n(lrow.data(), P.bq, A(0));
      for (int64_t kt = 0; kt < P.nK; ++kt) {
        if (m.grid[qt * m.nK + kt] == 0) continue;
        const int64_t k0 = kt * P.bk, nk = std::min(P.bk, P.Tk - k0);
        gemm<T>(nq, nk, P.Dp, qA, P.Dp, kT.at(P.kv_tile(b, hk, kt)), nk, s.data(), P.bk, false);
        score_tile(P, {b, h, qt, kt, q0, nq, k0, nk}, s.data(), keep.data(), nullptr);
        // Flagged keys (zeroed by the caller, so their scores are finite): mark the rows that keep one
        // (score not -inf). Tiles without a flagged key cost one byte scan.
        const uint8_t* bk = badp ? badp + (b * P.Hkv + hk) * P.Tk + k0 : nullptr;
        if (bk && std::memchr(bk, 1, nk)) {
          uint8_t* hb = hitp + row0;
          for (int64_t i = 0; i < nq; ++i) {
            const A* row = s.data() + i * P.bk;
            for (int64_t j = 0; j < nk && !hb[i]; ++j) hb[i] = bk[j] && row[j] != ninf;
          }
        }
        // P in the GEMM's operand type: in place (fp32/fp64), or rounded into pa as it is computed.
        T* pA = reinterpret_cast<T*>(s.data());
        const int64_t ldp = std::is_same_v<T, A> ? P.bk : P.bkp;
        if constexpr (!std::is_same_v<T, A>) pA = pa.data();
        for (int64_t i = 0; i < nq; ++i) {
          A* row = s.data() + i * P.bk;
          const A mx = std::max(mrow[i], attnkit::row_max(row, nk, ninf) * P.exp_scale);
          // A row with nothing kept so far keeps max -inf: shift by 0 so exp(-inf) = 0, not NaN.
          const A shift = mx == ninf ? A(0) : mx;
          const A sum = attnkit::exp_row(row, nk, P.exp_scale, shift, pA + i * ldp);
          if (padded_k<T>(nk) > nk) pA[i * ldp + nk] = T(0);
          const A alpha = std::exp(mrow[i] - shift);  // 0 while the row had nothing kept
          lrow[i] = lrow[i] * alpha + sum;
          mrow[i] = mx;
          if (alpha != A(1)) {  // the max moved (most tiles after the first few keep it: no pass)
            A* a = acc.data() + i * P.Dv;
            for (int64_t c = 0; c < P.Dv; ++c) a[c] *= alpha;
          }
        }
        const T* vB = v_direct ? vp + ((b * P.Hkv + hk) * P.Tk + k0) * P.Dv : vp_.at(P.kv_tile(b, hk, kt));
        gemm<T>(nq, P.Dv, padded_k<T>(nk), pA, ldp, vB, P.Dv, acc.data(), P.Dv, true);
      }
      T* ob = op + row0 * P.Dv;
      for (int64_t i = 0; i < nq; ++i) {
        const A l = lrow[i] + (sink == ninf ? A(0) : std::exp(sink - mrow[i]));  // mrow >= sink: no overflow
        const A inv = l == A(0) ? A(0) : A(1) / l;
        for (int64_t c = 0; c < P.Dv; ++c) ob[i * P.Dv + c] = static_cast<T>(acc[i * P.Dv + c] * inv);
        lp[row0 + i] = l == A(0) ? ninf : mrow[i] + std::log(l);
      }
    }
    attnkit::gemm_done<T>();
  });
}

// One (query tile, key tile) of the backward: recompute P from the LSE, dS = P (dP - delta) scale,
// then dV^T += dO^T P and dK^T += Q^T dS (kv), and/or dQ += dS K (q). dK and dV are accumulated
// transposed, (D x Tk), so P and dS serve as B operands as they are (fp32) or packed row-pairwise
// (VNNI): no tile is transposed. Accumulators are float32 (float64 for float64 inputs).
//
// Score modifiers: dS is taken back through the chain (score_mods_backward) before the scale. The
// pass that computes dQ (each (query tile, key tile) once, in both schedules) also writes the bias
// gradient and adds the distance vectors' gradient into the buffer of its (batch, head, query tile)
// (key tiles ascending): in the split schedule the tasks of one head work on different query tiles,
// so the buffers are reduced afterwards in a fixed order (reduce_dist), never raced on.
template <typename T>
struct Backward {
  using A = Acc<T>;
  const Problem<T>& P;
  const T *q, *k, *v, *dout;
  const A *lse, *delta;
  A *dq, *dkT, *dvT;  // (B, Hq, Tq, D), (B, Hkv, D, Tk), (B, Hkv, Dv, Tk)
  Packed<T> kT, vT, kB, qT, doT;  // B: K^T, V^T (scores, dP), K (dQ); A: Q^T, dO^T (dK, dV)
  A* dist_buf = nullptr;  // (n_add, B, Hq, nQ, dist_w) or null: the distance vectors' gradient per query tile
  A* dbias = nullptr;     // (B, Hq, Tq, Tk) or null
  // The gradients as returned, in the inputs' dtype: each task writes the part it owns once that part is
  // final (dK, dV untransposed). dq_out is null when the accumulator dq is returned as it is (T == A).
  T *dk_out = nullptr, *dv_out = nullptr, *dq_out = nullptr;

  // A query tile's buffer element l is the gradient at distance d0(qt) + l; the tile's
  // pos(k) - pos(q) span k0 + j - i for i < bq, so bq - 1 + Tk elements cover every key.
  int64_t dist_w() const { return P.Tk + P.bq - 1; }
  int64_t dist_d0(int64_t qt) const { return P.kpos0 - P.qpos0 - qt * P.bq - (P.bq - 1); }

  struct Work {
    std::vector<A> p, dp, tanh_keep;
    std::vector<T> qa, doa, pb, dsb, dsa;
    std::vector<uint8_t> keep;
    explicit Work(const Problem<T>& P)
        : p(P.bq * P.bk), dp(P.bq * P.bk), tanh_keep(P.mods->n_cap * P.bq * P.bk), qa(P.bq * P.Dp),
          doa(P.bq * P.Dvp), pb(P.bqp * P.bk), dsb(P.bqp * P.bk), dsa(P.bq * P.bkp), keep(P.bq * P.bk) {}
  };

  // The A operands of query tile (b, h, qt): Q and dO, padded for VNNI.
  void load_q(Work& w, int64_t row0, int64_t nq) const {
    pack_a<T, T>(q + row0 * P.D, P.D, false, nq, P.D, w.qa.data(), P.Dp);
    pack_a<T, T>(dout + row0 * P.Dv, P.Dv, false, nq, P.Dv, w.doa.data(), P.Dvp);
  }

  // A float tile (nq x nk, ld bk) as the B operand of a K = nq product.
  const T* as_b(const A* src, int64_t nq, int64_t nk, std::vector<T>& buf) const {
    if constexpr (std::is_same_v<T, A>) {
      return src;
    } else {
      attnkit::pack_b_rows<T>(src, P.bk, nq, nk, buf.data());
      return buf.data();
    }
  }

  void tile(Work& w, int64_t b, int64_t h, int64_t qt, int64_t kt, bool kv, bool dq_too) const {
    const int64_t hk = h / P.G, q0 = qt * P.bq, nq = std::min(P.bq, P.Tq - q0), row0 = (b * P.Hq + h) * P.Tq + q0;
    const int64_t k0 = kt * P.bk, nk = std::min(P.bk, P.Tk - k0), kslot = P.kv_tile(b, hk, kt);
    const A ninf = -std::numeric_limits<A>::infinity();
    A *p = w.p.data(), *ds = w.dp.data();
    gemm<T>(nq, nk, P.Dp, w.qa.data(), P.Dp, kT.at(kslot), nk, p, P.bk, false);
    const ScoreMods<A>& mods = *P.mods;
    score_tile(P, {b, h, qt, kt, q0, nq, k0, nk}, p, w.keep.data(), w.tanh_keep.data());
    for (int64_t i = 0; i < nq; ++i) {
      A* row = p + i * P.bk;
      const A l = lse[row0 + i];
      if (l == ninf) {
        std::fill(row, row + nk, A(0));  // the row sees nothing: probabilities 0
      } else {
        attnkit::exp_row(row, nk, P.exp_scale, l, row);
      }
    }
    gemm<T>(nq, nk, P.Dvp, w.doa.data(), P.Dvp, vT.at(kslot), nk, ds, P.bk, false);  // dP = dO V^T
    if (!mods.modifies()) {
      for (int64_t i = 0; i < nq; ++i) {
        const A dl = delta[row0 + i];
        A* dr = ds + i * P.bk;
        const A* pr = p + i * P.bk;
        for (int64_t j = 0; j < nk; ++j) dr[j] = pr[j] * (dr[j] - dl) * P.scale;
      }
    } else {  // dS by the modified scores -> by the scaled scores (and the modifiers' gradients) -> scaled
      for (int64_t i = 0; i < nq; ++i) {
        const A dl = delta[row0 + i];
        A* dr = ds + i * P.bk;
        const A* pr = p + i * P.bk;
        for (int64_t j = 0; j < nk; ++j) dr[j] = pr[j] * (dr[j] - dl);
      }
      DistGrad<A> dd;
      if (dq_too && dist_buf) {
        const int64_t per_a = P.B * P.Hq * P.nQ * dist_w();
        dd = {dist_buf + P.q_tile(b, h, qt) * dist_w(), per_a, dist_d0(qt)};
      }
      attnkit::score_mods_backward(mods, b, h, q0, k0, P.qpos0 + q0, P.kpos0 + k0, nq, nk, P.bk, P.bq * P.bk,
                                   w.tanh_keep.data(), ds, dd, dq_too ? dbias : nullptr, P.Tq, P.Tk);
      for (int64_t i = 0; i < nq; ++i) attnkit::scale_row(ds + i * P.bk, nk, P.scale);
    }
    const int64_t ldb = std::is_same_v<T, A> ? P.bk : nk, nqk = padded_k<T>(nq);
    if (kv) {  // dV^T += dO^T P;  dK^T += Q^T dS
      const int64_t qslot = P.q_tile(b, h, qt), kv0 = (b * P.Hkv + hk) * P.Tk;
      gemm<T>(P.Dv, nk, nqk, doT.at(qslot), P.bqp, as_b(p, nq, nk, w.pb), ldb, dvT + kv0 * P.Dv + k0, P.Tk, true);
      gemm<T>(P.D, nk, nqk, qT.at(qslot), P.bqp, as_b(ds, nq, nk, w.dsb), ldb, dkT + kv0 * P.D + k0, P.Tk, true);
    }
    if (dq_too) {  // dQ += dS K
      const T* dsA = reinterpret_cast<const T*>(ds);
      int64_t lda = P.bk;
      if constexpr (!std::is_same_v<T, A>) {
        pack_a<T, A>(ds, P.bk, false, nq, nk, w.dsa.data(), P.bkp);
        dsA = w.dsa.data(), lda = P.bkp;
      }
      const T* kb = kB.store.defined() ? kB.at(kslot) : k + ((b * P.Hkv + hk) * P.Tk + k0) * P.D;
      gemm<T>(nq, P.D, padded_k<T>(nk), dsA, lda, kb, P.D, dq + row0 * P.D, P.D, true);
    }
  }

  bool live(int64_t qt, int64_t kt) const { return P.m->grid[qt * P.m->nK + kt] != 0; }

  // dst (columns c0..c0+nc of src, as rows of width `rows`) = src (rows x Tk) transposed, in T.
  void store_transposed(const A* src, int64_t rows, int64_t c0, int64_t nc, T* dst) const {
    constexpr int64_t S = 16;
    for (int64_t j0 = c0; j0 < c0 + nc; j0 += S) {
      const int64_t j1 = std::min(j0 + S, c0 + nc);
      for (int64_t i0 = 0; i0 < rows; i0 += S) {
        const int64_t i1 = std::min(i0 + S, rows);
        for (int64_t j = j0; j < j1; ++j)
          for (int64_t i = i0; i < i1; ++i) dst[j * rows + i] = static_cast<T>(src[i * P.Tk + j]);
      }
    }
  }

  // Key rows k0..k0+nk of kv head (b, hk) are final: write dK and dV as returned.
  void store_kv(int64_t b, int64_t hk, int64_t k0, int64_t nk) const {
    const int64_t kv0 = (b * P.Hkv + hk) * P.Tk;
    store_transposed(dkT + kv0 * P.D, P.D, k0, nk, dk_out + kv0 * P.D);
    store_transposed(dvT + kv0 * P.Dv, P.Dv, k0, nk, dv_out + kv0 * P.Dv);
  }

  // Query rows row0..row0+nq (flat over batch, head, position) are final: write dQ as returned.
  void store_q(int64_t row0, int64_t nq) const {
    if (!dq_out) return;
    const A* src = dq + row0 * P.D;
    T* dst = dq_out + row0 * P.D;
    for (int64_t i = 0; i < nq * P.D; ++i) dst[i] = static_cast<T>(src[i]);
  }

  // dK, dV of key tile kt: query heads of the group and query tiles ascending.
  void key_tile(Work& w, int64_t b, int64_t hk, int64_t kt) const {
    for (int64_t g = 0; g < P.G; ++g) {
      const int64_t h = hk * P.G + g;
      for (int64_t qt = 0; qt < P.nQ; ++qt) {
        if (!live(qt, kt)) continue;
        const int64_t q0 = qt * P.bq;
        load_q(w, (b * P.Hq + h) * P.Tq + q0, std::min(P.bq, P.Tq - q0));
        tile(w, b, h, qt, kt, true, false);
      }
    }
  }

  void run(bool split) const {
    if (!split) {  // one pass per (batch, kv head): it owns dK/dV of its head and dQ of its query heads
      at::parallel_for(0, P.B * P.Hkv, 1, [&](int64_t begin, int64_t end) {
        Work w(P);
        for (int64_t t = begin; t < end; ++t) {
          const int64_t hk = t % P.Hkv, b = t / P.Hkv;
          for (int64_t g = 0; g < P.G; ++g) {
            for (int64_t qt = 0; qt < P.nQ; ++qt) {
              const int64_t h = hk * P.G + g, q0 = qt * P.bq;
              load_q(w, (b * P.Hq + h) * P.Tq + q0, std::min(P.bq, P.Tq - q0));
              for (int64_t kt = 0; kt < P.nK; ++kt)
                if (live(qt, kt)) tile(w, b, h, qt, kt, true, true);
            }
            store_q((b * P.Hq + hk * P.G + g) * P.Tq, P.Tq);
          }
          store_kv(b, hk, 0, P.Tk);
        }
        attnkit::gemm_done<T>();
      });
      return;
    }
    at::parallel_for(0, P.B * P.Hkv * P.nK, 1, [&](int64_t begin, int64_t end) {
      Work w(P);
      for (int64_t t = begin; t < end; ++t) {
        const int64_t b = t / (P.Hkv * P.nK), hk = (t / P.nK) % P.Hkv, kt = zigzag(t % P.nK, P.nK);
        key_tile(w, b, hk, kt);
        store_kv(b, hk, kt * P.bk, std::min(P.bk, P.Tk - kt * P.bk));
      }
      attnkit::gemm_done<T>();
    });
    at::parallel_for(0, P.B * P.Hq * P.nQ, 1, [&](int64_t begin, int64_t end) {
      Work w(P);
      for (int64_t t = begin; t < end; ++t) {
        const int64_t qt = zigzag(t % P.nQ, P.nQ), h = (t / P.nQ) % P.Hq, b = t / (P.nQ * P.Hq), q0 = qt * P.bq;
        load_q(w, (b * P.Hq + h) * P.Tq + q0, std::min(P.bq, P.Tq - q0));
        for (int64_t kt = 0; kt < P.nK; ++kt)
          if (live(qt, kt)) tile(w, b, h, qt, kt, false, true);
        store_q((b * P.Hq + h) * P.Tq + q0, std::min(P.bq, P.Tq - q0));
      }
      attnkit::gemm_done<T>();
    });
  }

  // d_dist (n_add, Hq, ndist) = the query tiles' buffers summed, batches then query tiles ascending.
  void reduce_dist(A* d_dist) const {
    const ScoreMods<A>& mods = *P.mods;
    const int64_t W = dist_w(), nd = mods.ndist;
    at::parallel_for(0, mods.n_add * P.Hq, 1, [&](int64_t begin, int64_t end) {
      for (int64_t ah = begin; ah < end; ++ah) {
        const int64_t a = ah / P.Hq, h = ah % P.Hq;
        A* out = d_dist + ah * nd;
        for (int64_t b = 0; b < P.B; ++b) {
          for (int64_t qt = 0; qt < P.nQ; ++qt) {
            const A* buf = dist_buf + (a * P.B * P.Hq * P.nQ + P.q_tile(b, h, qt)) * W;
            const int64_t shift = dist_d0(qt) - mods.dmin;  // buffer element l is d_dist element l + shift
            const int64_t lo = std::max<int64_t>(0, -shift), hi = std::min(W, nd - shift);
            for (int64_t l = lo; l < hi; ++l) out[l + shift] += buf[l];
          }
        }
      }
    });
  }
};

void check(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous(), name, " must be a contiguous CPU tensor");
}

// float, double, and the reduced types run natively; Acc<T> is the statistics' type.
#define ATTNKIT_DISPATCH(dtype, name, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, name, __VA_ARGS__)

// Returns out, lse and hit (see native_ops.forward_outputs). Fixed-arity tuples, not Tensor[]: a list
// return would make torch.library's autograd wrap every call in a pytree flatten (about 0.4 ms).
using Outs3 = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using Outs5 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

Outs3 forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::TensorList spec,
              c10::IntArrayRef ints, c10::ArrayRef<double> floats, int64_t block_q, int64_t block_k,
              const at::Tensor& bad) {
  for (auto* t : {&q, &k, &v, &bad}) check(*t, "q, k, v and the key flags");
  TORCH_CHECK(bad.numel() == 0 || (bad.scalar_type() == at::kByte && bad.numel() == k.size(0) * k.size(1) * k.size(2)),
              "key flags: expected an empty or a uint8 (B, Hkv, Tk) tensor");
  const auto stat = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  auto out = at::empty({q.size(0), q.size(1), q.size(2), v.size(3)}, q.options());
  auto lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(stat));
  auto hit = bad.numel() ? at::zeros({q.size(0), q.size(1), q.size(2)}, bad.options()) : at::empty({0}, bad.options());
  MaskSpec m = make_spec(q, k, block_q, block_k, spec, ints);
  ATTNKIT_DISPATCH(q.scalar_type(), "attnkit_native_forward", [&] {
    auto mods = attnkit::make_mods<Acc<scalar_t>>(spec, ints, floats, q.size(0), q.size(1), q.size(2), k.size(2));
    Problem<scalar_t> P(q, k, v, floats[attnkit::SCALE], ints[attnkit::Q_OFFSET], ints[attnkit::KV_OFFSET], block_q,
                        block_k, m, mods);
    forward_impl<scalar_t>(q, k, v, out, lse, bad, hit, P);
  });
  return {out, lse, hit};
}

// Returns dq, dk, dv, then d_dist (n_add, Hq, ndist) when need_dist and there is a dist, and dbias
// (B, Hq, Tq, Tk) when need_dbias (both in the statistics' dtype; empty when not computed).
Outs5 backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
               const at::Tensor& dout, const at::Tensor& lse, const at::Tensor& delta, at::TensorList spec,
               c10::IntArrayRef ints, c10::ArrayRef<double> floats, int64_t block_q, int64_t block_k, bool need_dist,
               bool need_dbias) {
  const at::Tensor& dist = spec[attnkit::DIST];
  for (auto* t : {&q, &k, &v, &dout, &lse, &delta}) check(*t, "backward inputs");
  const auto stat = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  TORCH_CHECK(lse.scalar_type() == stat && delta.scalar_type() == stat, "backward: lse and delta must be ", stat);
  auto opts = q.options().dtype(stat);
  auto dq = at::zeros(q.sizes(), opts);
  auto dkT = at::zeros({k.size(0), k.size(1), k.size(3), k.size(2)}, opts);  // accumulated transposed
  auto dvT = at::zeros({v.size(0), v.size(1), v.size(3), v.size(2)}, opts);
  const bool with_dist = need_dist && dist.dim() == 3;
  auto d_dist = with_dist ? at::zeros(dist.sizes(), opts) : at::empty({0}, opts);
  auto dbias = need_dbias ? at::zeros({q.size(0), q.size(1), q.size(2), k.size(2)}, opts) : at::empty({0}, opts);
  auto dk = at::empty(k.sizes(), k.options()), dv = at::empty(v.sizes(), v.options());
  auto dq_out = q.scalar_type() == stat ? dq : at::empty(q.sizes(), q.options());
  MaskSpec m = make_spec(q, k, block_q, block_k, spec, ints);
  ATTNKIT_DISPATCH(q.scalar_type(), "attnkit_native_backward", [&] {
    using T = scalar_t;
    auto mods = attnkit::make_mods<Acc<T>>(spec, ints, floats, q.size(0), q.size(1), q.size(2), k.size(2));
    for (int64_t o = 0; o < mods.n_ops; ++o)
      TORCH_CHECK(mods.op(o) == attnkit::ADD || mods.op(o) == attnkit::CAP,
                  "backward: the chain's additive terms as ADD vectors (kernel_spec(distance_vectors=True))");
    Problem<T> P(q, k, v, floats[attnkit::SCALE], ints[attnkit::Q_OFFSET], ints[attnkit::KV_OFFSET], block_q,
                 block_k, m, mods);
    Backward<T> bw{P,
                   q.data_ptr<T>(),
                   k.data_ptr<T>(),
                   v.data_ptr<T>(),
                   dout.data_ptr<T>(),
                   lse.data_ptr<Acc<T>>(),
                   delta.data_ptr<Acc<T>>(),
                   dq.data_ptr<Acc<T>>(),
                   dkT.data_ptr<Acc<T>>(),
                   dvT.data_ptr<Acc<T>>(),
                   pack_tiles<T>(k, block_k, true, kBwdK),
                   pack_tiles<T>(v, block_k, true, kBwdV),
                   P.vnni ? pack_tiles<T>(k, block_k, false, kBwdKB) : Packed<T>{},
                   pack_tiles_a_transposed<T>(q, block_q, kBwdQ),
                   pack_tiles_a_transposed<T>(dout, block_q, kBwdDout)};
    // the distance vectors' gradient per (batch, head, query tile): O(B Hq Tq Tk / block_q) memory
    at::Tensor dist_buf;
    if (with_dist && mods.n_add) {
      dist_buf = at::zeros({mods.n_add * P.B * P.Hq * P.nQ * bw.dist_w()}, opts);
      bw.dist_buf = dist_buf.data_ptr<Acc<T>>();
    }
    if (need_dbias) bw.dbias = dbias.data_ptr<Acc<T>>();
    bw.dk_out = dk.data_ptr<T>(), bw.dv_out = dv.data_ptr<T>();
    if (q.scalar_type() != stat) bw.dq_out = dq_out.data_ptr<T>();
    bw.run(P.B * P.Hkv < at::get_num_threads());
    if (bw.dist_buf) bw.reduce_dist(d_dist.data_ptr<Acc<T>>());
  });
  return {dq_out, dk, dv, d_dist, dbias};
}

}  // namespace

// Registered as torch operators (torch.ops.attnkit_native.*): no Python headers, a faster build.
// Dtypes: out, dq, dk, dv have the inputs' dtype; lse, delta, bias, dist, sinks and their gradients are
// float32 (float64 for float64).
TORCH_LIBRARY(attnkit_native, m) {
  // The mask and score modifiers arrive as the kernel spec (spec.h; built by native_ops.kernel_spec).
  // Its ints (offsets, band bounds, the modifiers' first distance) are SymInt: traced with dynamic
  // shapes they follow the lengths without a guard on their values; the CPU kernels get int64_t.
  m.def("forward(Tensor q, Tensor k, Tensor v, Tensor[] spec, SymInt[] ints, float[] floats, int block_q, "
        "int block_k, Tensor bad) -> (Tensor, Tensor, Tensor)");
  m.def("backward(Tensor q, Tensor k, Tensor v, Tensor dout, Tensor lse, Tensor delta, Tensor[] spec, SymInt[] ints, "
        "float[] floats, int block_q, int block_k, bool need_dist, bool need_dbias) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.impl("forward", c10::DispatchKey::CPU, TORCH_FN(forward));
  m.impl("backward", c10::DispatchKey::CPU, TORCH_FN(backward));
}
