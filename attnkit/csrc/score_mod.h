// The score modifiers' backward for the fused CPU attention kernel, one tile at a time. The
// modifiers' data and their forward (shared with the decode kernel) are the kernel spec (spec.h).
//
// The backward walks the chain in reverse: d/ds of CAP is 1 - tanh^2 (the tanh values of the
// forward recomputation are kept per CAP stage), ADD passes the gradient through and accumulates it
// per (head, distance), from which autograd reaches ALiBi slopes and relative-bias tables (the
// prefill lowers both to ADD vectors); ALIBI and REL pass it through (their values need none).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "spec.h"

namespace attnkit {

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
    if (m.op(o) == ALIBI || m.op(o) == REL) continue;
    if (m.op(o) == ADD) {
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

}  // namespace attnkit
