// Gated linear attention on the CPU: the chunked gated delta rule and Mamba2's SSD (forward and
// hand-written backward), and the recurrent step of every gated rule (decode).
//
// Inputs arrive prepared by attnkit/backends/kernelized/gated/kernel.py: float32, contiguous,
// q already scaled, key heads repeated to the value heads, log-decays g <= 0 clamped at -1e3.
// Per token (see recurrence.py, the naive twin):
//
//     S_t = (I - b_t k_t k_tᵀ) Diag(exp(g_t)) S_{t-1} + b_t k_t v_tᵀ     (delta rule, b given)
//     S_t = exp(g_t) S_{t-1} + k_t v_tᵀ                                  (SSD: no b)
//     o_t = S_tᵀ q_t
//
// Chunked form (as gated_delta.py, whose _ChunkedGatedDelta this file follows line by line): within
// a chunk of C tokens, G the float64 cumulative log-decay from the chunk's start, Γ_ij = exp(G_i -
// G_j) for j <= i (0 above; every exponent <= 0), M = strict_lower(diag(b) K Kᵀ ⊙ Γ):
//
//     [u | w] = (I + M)⁻¹ [diag(b) V | diag(b) K ⊙ exp(G)]         (SSD: u = V, no w)
//     per chunk n, S the state before it:
//         v_new = u - w S;  S <- exp(G_C) S + (K ⊙ exp(G_C - G))ᵀ v_new
//     o = (Q Kᵀ ⊙ Γ) v_new + (Q ⊙ exp(G)) S_n
//
// Work items are (batch, head) pairs under at::parallel_for; each runs its whole sequence with
// ATen's matmuls on its chunk tiles (single-threaded inside the parallel region) and loops for the
// gates and the unit-lower inverse. Shapes, tile orders and reduction orders depend on the shapes
// alone, so a call repeats bitwise at one thread count. Zero padding to whole chunks is inert
// (g = 0, b = 0, k = v = 0, after the real tokens).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

namespace {

using at::Tensor;

// The gates of one head's chunks, from its log-decays g (T floats, padded with 0 to N * C).
struct Gates {
  Tensor gamma;  // (N, C, C) exp(G_i - G_j), 0 above the diagonal
  Tensor eg;     // (N, C) exp(G_i)
  Tensor er;     // (N, C) exp(G_C - G_i)
  Tensor decay;  // (N) exp(G_C)
  std::vector<float> decay_v;
};

Gates chunk_gates(const float* g, int64_t T, int64_t N, int64_t C) {
  auto opts = at::TensorOptions().dtype(at::kFloat);
  Gates out{at::empty({N, C, C}, opts), at::empty({N, C}, opts), at::empty({N, C}, opts), at::empty({N}, opts),
            std::vector<float>(N)};
  float* gamma = out.gamma.data_ptr<float>();
  float* eg = out.eg.data_ptr<float>();
  float* er = out.er.data_ptr<float>();
  float* dec = out.decay.data_ptr<float>();
  const float minus_inf = -std::numeric_limits<float>::infinity();
  std::vector<double> G(C);
  // the exponents (differences of float64 cumulative sums, all <= 0), then one vectorized exp each
  for (int64_t n = 0; n < N; ++n) {
    double acc = 0;
    for (int64_t i = 0; i < C; ++i) {
      const int64_t t = n * C + i;
      acc += t < T ? static_cast<double>(g[t]) : 0.0;
      G[i] = acc;
    }
    const double last = G[C - 1];
    for (int64_t i = 0; i < C; ++i) {
      eg[n * C + i] = static_cast<float>(G[i]);
      er[n * C + i] = static_cast<float>(last - G[i]);
      float* row = gamma + (n * C + i) * C;
      for (int64_t j = 0; j <= i; ++j) row[j] = static_cast<float>(G[i] - G[j]);
      for (int64_t j = i + 1; j < C; ++j) row[j] = minus_inf;  // exp(-inf) = 0 above the diagonal
    }
    dec[n] = static_cast<float>(last);
  }
  out.gamma.exp_();
  out.eg.exp_();
  out.er.exp_();
  out.decay.exp_();
  for (int64_t n = 0; n < N; ++n) out.decay_v[n] = dec[n];
  return out;
}

// (I + M)⁻¹ for each strictly lower M (N, C, C) (its diagonal and upper part are ignored), by
// forward substitution: row i of X = e_i - sum_{j<i} M_ij X_j. Unit lower triangular.
Tensor unit_lower_inverse(const Tensor& M) {
  const int64_t N = M.size(0), C = M.size(1);
  Tensor X = at::zeros_like(M);
  const float* m = M.data_ptr<float>();
  float* x = X.data_ptr<float>();
  for (int64_t n = 0; n < N; ++n) {
    const float* mn = m + n * C * C;
    float* xn = x + n * C * C;
    for (int64_t i = 0; i < C; ++i) {
      float* row = xn + i * C;
      row[i] = 1.f;
      for (int64_t j = 0; j < i; ++j) {
        const float a = mn[i * C + j];
        if (a == 0.f) continue;
        const float* xj = xn + j * C;
        for (int64_t c = 0; c <= j; ++c) row[c] -= a * xj[c];
      }
    }
  }
  return X;
}

// One head's chunk tiles: (N, C, D) views of padded, contiguous (B·H, N·C, D) tensors.
Tensor tiles(const Tensor& x, int64_t bh, int64_t N, int64_t C) { return x[bh].view({N, C, x.size(-1)}); }

// (B, H, T, D) -> (B·H, N·C, D) float32 contiguous, zero-padded to whole chunks.
Tensor padded(const Tensor& x, int64_t pad) {
  Tensor y = x.reshape({x.size(0) * x.size(1), x.size(2), x.size(3)});
  if (pad) y = at::constant_pad_nd(y, {0, 0, 0, pad}, 0);
  return y.contiguous();
}

Tensor padded_rows(const Tensor& x, int64_t pad) {  // (B, H, T) -> (B·H, N·C)
  Tensor y = x.reshape({x.size(0) * x.size(1), x.size(2)});
  if (pad) y = at::constant_pad_nd(y, {0, pad}, 0);
  return y.contiguous();
}

void check(const Tensor& x, const char* name, int64_t dim) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == dim,
              "attnkit_gated: ", name, " must be a float32 CPU tensor of ", dim, " dims, got ", x.scalar_type(),
              " with ", x.dim());
}

// ---- Per-channel gates (KDA; GLA without b): g (B, H, T, Dk), as kda.py. Γ_ijd = exp(G_id - G_jd)
// is a vector per pair, so the two within-chunk products are Γ-weighted sums, not matmuls:
//     KK_ij = sum_d k_id k_jd Γ_ijd        A_ij = sum_d q_id k_jd Γ_ijd      (j <= i)
// and the decays exp(G), exp(G_C - G), exp(G_C) are per channel (the state's rows). The scan and the
// UT transform are those of the scalar rule. Γ is formed for a segment of chunks at a time.

// One head's cumulative gates per chunk, float64 (N, C, Dk), from g (T, Dk) padded with 0.
Tensor channel_cumgates(const Tensor& g_head, int64_t N, int64_t C) {
  return g_head.to(at::kDouble).view({N, C, g_head.size(-1)}).cumsum(1);
}

// Γ (n, C, C, Dk) float for the chunks of G (n, C, Dk): exp(G_i - G_j), 0 above the diagonal.
Tensor channel_gamma(const Tensor& G) {
  const int64_t C = G.size(1);
  Tensor diff = G.unsqueeze(2) - G.unsqueeze(1);  // (n, C, C, Dk): [i, j] = G_i - G_j
  Tensor upper = at::ones({C, C}, at::TensorOptions().dtype(at::kBool)).triu(1).view({1, C, C, 1});
  return diff.masked_fill_(upper, -std::numeric_limits<double>::infinity()).exp_().to(at::kFloat);
}

// Segments of chunks whose Γ stays near 4 MiB.
int64_t channel_segment(int64_t C, int64_t Dk) { return std::max<int64_t>(1, (int64_t(1) << 20) / (C * C * Dk)); }

struct ChannelGates {
  Tensor G, eg, er, decay;  // G float64 (N, C, Dk); exp(G), exp(G_C - G) (N, C, Dk); exp(G_C) (N, Dk)
};

ChannelGates channel_gates(const Tensor& g_head, int64_t N, int64_t C) {
  Tensor G = channel_cumgates(g_head, N, C);
  Tensor last = G.narrow(1, C - 1, 1);
  return {G, G.exp().to(at::kFloat), (last - G).exp_().to(at::kFloat), last.squeeze(1).exp().to(at::kFloat)};
}

// KK (strict lower part used) and A (lower) for every chunk, by segments.
std::pair<Tensor, Tensor> channel_products(const Tensor& G, const Tensor& qh, const Tensor& kh, bool with_kk) {
  const int64_t N = qh.size(0), C = qh.size(1), seg = channel_segment(C, qh.size(2));
  Tensor kk = with_kk ? at::empty({N, C, C}, qh.options()) : Tensor(), a = at::empty({N, C, C}, qh.options());
  for (int64_t s = 0; s < N; s += seg) {
    const int64_t n = std::min(seg, N - s);
    Tensor gamma = channel_gamma(G.narrow(0, s, n));
    Tensor kj = kh.narrow(0, s, n).unsqueeze(1);  // (n, 1, C, Dk): k_j
    Tensor gk = gamma * kj;  // Γ_ijd k_jd
    a.narrow(0, s, n).copy_((gk * qh.narrow(0, s, n).unsqueeze(2)).sum(-1));
    if (with_kk) kk.narrow(0, s, n).copy_((gk * kh.narrow(0, s, n).unsqueeze(2)).sum(-1));
  }
  return {kk, a};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> channel_forward(
    const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const c10::optional<Tensor>& beta_opt,
    const c10::optional<Tensor>& initial_opt, int64_t chunk, bool keep) {
  const bool delta = beta_opt.has_value() && beta_opt->defined();
  const bool has_init = initial_opt.has_value() && initial_opt->defined();
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), Dk = q.size(3), Dv = v.size(3);
  const int64_t C = std::max<int64_t>(1, std::min(chunk, T));
  const int64_t N = T ? (T + C - 1) / C : 0, pad = N * C - T, BH = B * H;
  const Tensor qp = padded(q, pad), kp = padded(k, pad), vp = padded(v, pad), gp = padded(g, pad);
  const Tensor bp = delta ? padded_rows(*beta_opt, pad) : Tensor();
  const Tensor init = has_init ? initial_opt->reshape({BH, Dk, Dv}).to(at::kFloat).contiguous() : Tensor();
  auto opts = q.options();
  Tensor o = at::empty({BH, N * C, Dv}, opts);
  Tensor final_state = at::empty({BH, Dk, Dv}, opts);
  Tensor inv_all = keep && delta ? at::empty({BH, N, C, C}, opts) : at::empty({0}, opts);
  Tensor states_all = keep ? at::empty({BH, N, Dk, Dv}, opts) : at::empty({0}, opts);
  Tensor vnew_all = keep && delta ? at::empty({BH, N, C, Dv}, opts) : at::empty({0}, opts);
  at::parallel_for(0, BH, 1, [&](int64_t begin, int64_t end) {
    at::AutoDispatchBelowAutograd below;
    for (int64_t bh = begin; bh < end; ++bh) {
      Tensor qh = tiles(qp, bh, N, C), kh = tiles(kp, bh, N, C), vh = tiles(vp, bh, N, C);
      ChannelGates gt = channel_gates(gp[bh], N, C);
      auto [kk, a] = channel_products(gt.G, qh, kh, delta);
      Tensor kdT = (kh * gt.er).transpose(1, 2).contiguous();  // (N, Dk, C)
      Tensor states = keep ? states_all[bh] : at::empty({N, Dk, Dv}, opts);
      Tensor vnew = vh, w;
      if (delta) {
        Tensor b = bp[bh].view({N, C, 1});
        Tensor inv = unit_lower_inverse((kk * b).contiguous());
        if (keep) inv_all[bh].copy_(inv);
        Tensor inv_b = inv * b.view({N, 1, C});
        vnew = keep ? vnew_all[bh] : at::empty({N, C, Dv}, opts);
        at::bmm_out(vnew, inv_b, vh);
        w = at::bmm(inv_b, kh * gt.eg);
      }
      Tensor decay = gt.decay.unsqueeze(-1);  // (N, Dk, 1): scales the state's rows
      Tensor S = has_init ? init[bh].clone() : at::zeros({Dk, Dv}, opts);
      for (int64_t n = 0; n < N; ++n) {
        states[n].copy_(S);
        if (delta) vnew[n].addmm_(w[n], S, 1, -1);
        S.mul_(decay[n]).addmm_(kdT[n], vnew[n]);
      }
      final_state[bh].copy_(S);
      Tensor oh = o[bh].view({N, C, Dv});
      at::bmm_out(oh, qh * gt.eg, states);
      oh.baddbmm_(a, vnew);
    }
  });
  Tensor out = o.narrow(1, 0, T).view({B, H, T, Dv});
  if (pad) out = out.contiguous();
  return {out, final_state.view({B, H, Dk, Dv}), inv_all, states_all, vnew_all};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> channel_backward(
    const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const c10::optional<Tensor>& beta_opt,
    const Tensor& inv_all, const Tensor& states_all, const Tensor& vnew_all, const Tensor& d_out,
    const c10::optional<Tensor>& d_final_opt, int64_t chunk) {
  const bool delta = beta_opt.has_value() && beta_opt->defined();
  const bool has_df = d_final_opt.has_value() && d_final_opt->defined();
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), Dk = q.size(3), Dv = v.size(3);
  const int64_t C = std::max<int64_t>(1, std::min(chunk, T));
  const int64_t N = T ? (T + C - 1) / C : 0, pad = N * C - T, BH = B * H;
  const Tensor qp = padded(q, pad), kp = padded(k, pad), vp = padded(v, pad), gp = padded(g, pad);
  const Tensor dop = padded(d_out, pad);
  const Tensor bp = delta ? padded_rows(*beta_opt, pad) : Tensor();
  const Tensor df = has_df ? d_final_opt->reshape({BH, Dk, Dv}).to(at::kFloat).contiguous() : Tensor();
  auto opts = q.options();
  Tensor dq = at::empty({BH, N * C, Dk}, opts), dk = at::empty({BH, N * C, Dk}, opts);
  Tensor dv = at::empty({BH, N * C, Dv}, opts), dg = at::empty({BH, N * C, Dk}, opts);
  Tensor dbeta = at::zeros({BH, N * C}, opts), dS0 = at::empty({BH, Dk, Dv}, opts);
  const int64_t seg = channel_segment(C, Dk);
  at::parallel_for(0, BH, 1, [&](int64_t begin, int64_t end) {
    at::AutoDispatchBelowAutograd below;
    for (int64_t bh = begin; bh < end; ++bh) {
      Tensor qh = tiles(qp, bh, N, C), kh = tiles(kp, bh, N, C), vh = tiles(vp, bh, N, C);
      Tensor doh = tiles(dop, bh, N, C);
      ChannelGates gt = channel_gates(gp[bh], N, C);
      auto [kk, a] = channel_products(gt.G, qh, kh, delta);
      Tensor st = states_all[bh];
      Tensor vn = delta ? vnew_all[bh] : vh;
      Tensor qg = qh * gt.eg, kd = kh * gt.er;
      Tensor b, bk, inv, u, w;
      if (delta) {
        b = bp[bh].view({N, C, 1});
        bk = kh * (b * gt.eg);
        inv = inv_all[bh];
        u = at::bmm(inv, vh * b);
        w = at::bmm(inv, bk);
      }
      Tensor dvn = at::bmm(a.transpose(1, 2), doh);
      Tensor dS_o = at::bmm(qg.transpose(1, 2), doh);
      Tensor d_after = at::empty({N, Dk, Dv}, opts);
      Tensor decay = gt.decay.unsqueeze(-1);
      Tensor dS = has_df ? df[bh].clone() : at::zeros({Dk, Dv}, opts);
      Tensor wT = delta ? w.transpose(1, 2) : Tensor();
      for (int64_t n = N - 1; n >= 0; --n) {
        d_after[n].copy_(dS);
        dvn[n].addmm_(kd[n], dS);
        Tensor next = at::addcmul(dS_o[n], dS, decay[n]);
        if (delta) next.addmm_(wT[n], dvn[n], 1, -1);
        dS = next;
      }
      dS0[bh].copy_(dS);
      Tensor stT = st.transpose(1, 2);
      Tensor dqg = at::bmm(doh, stT);  // (N, C, Dk)
      Tensor d_a = at::bmm(doh, vn.transpose(1, 2)).tril_();  // the gradient of A (lower)
      Tensor dkd = at::bmm(vn, d_after.transpose(1, 2));  // (N, C, Dk)
      Tensor d_decay = (st * d_after).sum(-1) * gt.decay;  // (N, Dk)
      Tensor dqh = tiles(dq, bh, N, C), dkh = tiles(dk, bh, N, C), dvh = tiles(dv, bh, N, C);
      Tensor dGh = dg[bh].view({N, C, Dk});
      at::mul_out(dqh, dqg, gt.eg);
      at::mul_out(dkh, dkd, gt.er);
      Tensor dG = dqg * qg;
      Tensor to_rest = dkd * kd;  // d/d(G_C - G_i), per channel
      dG.sub_(to_rest);
      dG.select(1, C - 1).add_(to_rest.sum(1) + d_decay);
      Tensor d_kk;
      if (delta) {
        Tensor dw = at::bmm(dvn, stT).neg_();
        Tensor invT = inv.transpose(1, 2);
        Tensor dbv = at::bmm(invT, dvn), dbk = at::bmm(invT, dw);
        Tensor dm = at::bmm(dbv, u.transpose(1, 2)).baddbmm_(dbk, w.transpose(1, 2)).tril_(-1).neg_();
        d_kk = dm * b;
        dkh.addcmul_(dbk, b * gt.eg);
        at::mul_out(dvh, dbv, b);
        Tensor db = (dm * kk).sum(-1) + (dbv * vh).sum(-1) + (dbk * kh * gt.eg).sum(-1);
        dbeta[bh].view({N, C}).copy_(db);
        dG.add_(dbk * bk);
      } else {
        dvh.copy_(dvn);
      }
      // through the Γ-weighted products, a segment of chunks at a time
      for (int64_t s = 0; s < N; s += seg) {
        const int64_t n = std::min(seg, N - s);
        Tensor gamma = channel_gamma(gt.G.narrow(0, s, n));  // (n, C, C, Dk)
        Tensor q_s = qh.narrow(0, s, n), k_s = kh.narrow(0, s, n);
        Tensor ki = k_s.unsqueeze(2), kj = k_s.unsqueeze(1), qi = q_s.unsqueeze(2);
        Tensor y = d_a.narrow(0, s, n).unsqueeze(-1) * gamma;  // dA_ij Γ_ijd
        Tensor yk = y * kj;
        dqh.narrow(0, s, n).add_(yk.sum(2));
        Tensor yq = y * qi;
        dkh.narrow(0, s, n).add_(yq.sum(1));
        Tensor p = yq * kj;  // dA_ij Γ_ijd q_id k_jd
        Tensor dG_s = dG.narrow(0, s, n);
        dG_s.add_(p.sum(2)).sub_(p.sum(1));
        if (delta) {
          Tensor x = d_kk.narrow(0, s, n).unsqueeze(-1) * gamma;  // dKK_ij Γ_ijd
          Tensor xk = x * kj;
          dkh.narrow(0, s, n).add_(xk.sum(2)).add_((x * ki).sum(1));
          Tensor r = xk * ki;
          dG_s.add_(r.sum(2)).sub_(r.sum(1));
        }
      }
      // G = cumsum(g) within each chunk, per channel
      dGh.copy_(at::flip(at::flip(dG, {1}).cumsum(1), {1}));
    }
  });
  auto unpad = [&](const Tensor& x, int64_t D) {
    Tensor y = x.narrow(1, 0, T);
    return (pad ? y.contiguous() : y).view({B, H, T, D});
  };
  Tensor db = dbeta.narrow(1, 0, T);
  return {unpad(dq, Dk), unpad(dk, Dk), unpad(dv, Dv), unpad(dg, Dk),
          delta ? (pad ? db.contiguous() : db).view({B, H, T}) : at::empty({0}, opts), dS0.view({B, H, Dk, Dv})};
}

// Forward. beta undefined: SSD. Returns (o, final state, inv, states, v_new); the last three are
// what backward reads (empty when `keep` is false).
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> chunk_forward(
    const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const c10::optional<Tensor>& beta_opt,
    const c10::optional<Tensor>& initial_opt, int64_t chunk, bool keep) {
  check(q, "q", 4); check(k, "k", 4); check(v, "v", 4);
  at::AutoDispatchBelowAutograd below;
  if (g.dim() == 4) {
    check(g, "g", 4);
    return channel_forward(q, k, v, g, beta_opt, initial_opt, chunk, keep);
  }
  check(g, "g", 3);
  const bool delta = beta_opt.has_value() && beta_opt->defined();
  const bool has_init = initial_opt.has_value() && initial_opt->defined();
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), Dk = q.size(3), Dv = v.size(3);
  TORCH_CHECK(chunk >= 1, "attnkit_gated: chunk must be >= 1");
  const int64_t C = std::max<int64_t>(1, std::min(chunk, T));
  const int64_t N = T ? (T + C - 1) / C : 0, pad = N * C - T, BH = B * H;
  const Tensor qp = padded(q, pad), kp = padded(k, pad), vp = padded(v, pad), gp = padded_rows(g, pad);
  const Tensor bp = delta ? padded_rows(*beta_opt, pad) : Tensor();
  const Tensor init = has_init ? initial_opt->reshape({BH, Dk, Dv}).to(at::kFloat).contiguous() : Tensor();
  auto opts = q.options();
  Tensor o = at::empty({BH, N * C, Dv}, opts);
  Tensor final_state = at::empty({BH, Dk, Dv}, opts);
  Tensor inv_all = keep && delta ? at::empty({BH, N, C, C}, opts) : at::empty({0}, opts);
  Tensor states_all = keep ? at::empty({BH, N, Dk, Dv}, opts) : at::empty({0}, opts);
  Tensor vnew_all = keep && delta ? at::empty({BH, N, C, Dv}, opts) : at::empty({0}, opts);
  at::parallel_for(0, BH, 1, [&](int64_t begin, int64_t end) {
    at::AutoDispatchBelowAutograd below;  // plain tensor arithmetic in every worker thread
    for (int64_t bh = begin; bh < end; ++bh) {
      Gates gt = chunk_gates(gp[bh].data_ptr<float>(), T, N, C);
      Tensor qh = tiles(qp, bh, N, C), kh = tiles(kp, bh, N, C), vh = tiles(vp, bh, N, C);
      Tensor kT = kh.transpose(1, 2);
      Tensor qk = at::bmm(qh, kT);  // (N, C, C)
      Tensor kdT = (kh * gt.er.unsqueeze(-1)).transpose(1, 2).contiguous();  // (N, Dk, C)
      Tensor states = keep ? states_all[bh] : at::empty({N, Dk, Dv}, opts);
      Tensor vnew = vh, w;  // SSD: v_new = v
      if (delta) {
        Tensor b = bp[bh].view({N, C, 1});
        Tensor inv = unit_lower_inverse((at::bmm(kh, kT) * gt.gamma * b).contiguous());
        if (keep) inv_all[bh].copy_(inv);
        Tensor inv_b = inv * b.view({N, 1, C});  // (I + M)⁻¹ diag(b)
        vnew = keep ? vnew_all[bh] : at::empty({N, C, Dv}, opts);
        at::bmm_out(vnew, inv_b, vh);  // u, made v_new in place by the scan
        w = at::bmm(inv_b, kh * gt.eg.unsqueeze(-1));  // (N, C, Dk)
      }
      Tensor S = has_init ? init[bh].clone() : at::zeros({Dk, Dv}, opts);
      for (int64_t n = 0; n < N; ++n) {
        states[n].copy_(S);
        if (delta) vnew[n].addmm_(w[n], S, 1, -1);
        S.addmm_(kdT[n], vnew[n], gt.decay_v[n], 1);
      }
      final_state[bh].copy_(S);
      Tensor oh = o[bh].view({N, C, Dv});
      at::bmm_out(oh, qh * gt.eg.unsqueeze(-1), states);
      oh.baddbmm_(qk * gt.gamma, vnew);
    }
  });
  Tensor out = o.narrow(1, 0, T).view({B, H, T, Dv});
  if (pad) out = out.contiguous();
  return {out, final_state.view({B, H, Dk, Dv}), inv_all, states_all, vnew_all};
}

// Backward of chunk_forward (gradients of q, k, v, g, beta and the initial state), reading what it
// saved: the chunks' inverses (delta rule), starting states and v_new.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> chunk_backward(
    const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const c10::optional<Tensor>& beta_opt,
    const Tensor& inv_all, const Tensor& states_all, const Tensor& vnew_all, const Tensor& d_out,
    const c10::optional<Tensor>& d_final_opt, int64_t chunk) {
  check(q, "q", 4); check(k, "k", 4); check(v, "v", 4); check(d_out, "d_out", 4);
  at::AutoDispatchBelowAutograd below;
  if (g.dim() == 4) {
    check(g, "g", 4);
    return channel_backward(q, k, v, g, beta_opt, inv_all, states_all, vnew_all, d_out, d_final_opt, chunk);
  }
  check(g, "g", 3);
  const bool delta = beta_opt.has_value() && beta_opt->defined();
  const bool has_df = d_final_opt.has_value() && d_final_opt->defined();
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), Dk = q.size(3), Dv = v.size(3);
  const int64_t C = std::max<int64_t>(1, std::min(chunk, T));
  const int64_t N = T ? (T + C - 1) / C : 0, pad = N * C - T, BH = B * H;
  const Tensor qp = padded(q, pad), kp = padded(k, pad), vp = padded(v, pad), gp = padded_rows(g, pad);
  const Tensor dop = padded(d_out, pad);
  const Tensor bp = delta ? padded_rows(*beta_opt, pad) : Tensor();
  const Tensor df = has_df ? d_final_opt->reshape({BH, Dk, Dv}).to(at::kFloat).contiguous() : Tensor();
  auto opts = q.options();
  Tensor dq = at::empty({BH, N * C, Dk}, opts), dk = at::empty({BH, N * C, Dk}, opts);
  Tensor dv = at::empty({BH, N * C, Dv}, opts), dg = at::empty({BH, N * C}, opts);
  Tensor dbeta = at::zeros({BH, N * C}, opts), dS0 = at::empty({BH, Dk, Dv}, opts);
  at::parallel_for(0, BH, 1, [&](int64_t begin, int64_t end) {
    at::AutoDispatchBelowAutograd below;  // plain tensor arithmetic in every worker thread
    for (int64_t bh = begin; bh < end; ++bh) {
      Gates gt = chunk_gates(gp[bh].data_ptr<float>(), T, N, C);
      Tensor qh = tiles(qp, bh, N, C), kh = tiles(kp, bh, N, C), vh = tiles(vp, bh, N, C);
      Tensor doh = tiles(dop, bh, N, C);
      Tensor st = states_all[bh];  // (N, Dk, Dv)
      Tensor vn = delta ? vnew_all[bh] : vh;
      Tensor eg = gt.eg.unsqueeze(-1), er = gt.er.unsqueeze(-1);
      Tensor qg = qh * eg, kd = kh * er;
      Tensor kT = kh.transpose(1, 2);
      Tensor qk = at::bmm(qh, kT);
      Tensor b, bk, inv, kk, u, w;
      if (delta) {
        b = bp[bh].view({N, C, 1});
        bk = kh * (b * eg);
        inv = inv_all[bh];
        kk = at::bmm(kh, kT);
        u = at::bmm(inv, vh * b);
        w = at::bmm(inv, bk);
      }
      // the reverse scan over chunks; d_after[n] is the gradient of the state after chunk n
      Tensor dvn = at::bmm((qk * gt.gamma).transpose(1, 2), doh);  // (N, C, Dv): the outputs' part
      Tensor dS_o = at::bmm(qg.transpose(1, 2), doh);  // (N, Dk, Dv)
      Tensor d_after = at::empty({N, Dk, Dv}, opts);
      Tensor dS = has_df ? df[bh].clone() : at::zeros({Dk, Dv}, opts);
      Tensor wT = delta ? w.transpose(1, 2) : Tensor();
      for (int64_t n = N - 1; n >= 0; --n) {
        d_after[n].copy_(dS);
        dvn[n].addmm_(kd[n], dS);
        Tensor next = at::add(dS_o[n], dS, gt.decay_v[n]);
        if (delta) next.addmm_(wT[n], dvn[n], 1, -1);
        dS = next;
      }
      dS0[bh].copy_(dS);
      Tensor stT = st.transpose(1, 2);  // (N, Dv, Dk)
      Tensor dqg = at::bmm(doh, stT);  // (N, C, Dk)
      Tensor d_a = at::bmm(doh, vn.transpose(1, 2)) * gt.gamma;  // dA ⊙ Γ, zero above the diagonal
      Tensor dkd = at::bmm(vn, d_after.transpose(1, 2));  // (N, C, Dk)
      Tensor d_decay = (st * d_after).sum({-1, -2}) * gt.decay;  // (N)
      Tensor d_gamma = d_a * qk;  // dΓ ⊙ Γ
      Tensor dqh = tiles(dq, bh, N, C), dkh = tiles(dk, bh, N, C), dvh = tiles(dv, bh, N, C);
      at::bmm_out(dqh, d_a, kh);
      dqh.addcmul_(dqg, eg);
      at::bmm_out(dkh, d_a.transpose(1, 2), qh);
      dkh.addcmul_(dkd, er);
      Tensor dG = (dqg * qg).sum(-1);  // (N, C)
      if (delta) {
        Tensor dw = at::bmm(dvn, stT).neg_();
        Tensor invT = inv.transpose(1, 2);
        Tensor dbv = at::bmm(invT, dvn), dbk = at::bmm(invT, dw);  // d(bV), d(bK exp(G))
        Tensor dm = at::bmm(dbv, u.transpose(1, 2)).baddbmm_(dbk, w.transpose(1, 2)).tril_(-1).neg_();
        Tensor d_kk = dm * b * gt.gamma;
        d_gamma.addcmul_(d_kk, kk);
        dkh.baddbmm_(d_kk + d_kk.transpose(1, 2), kh);
        dkh.addcmul_(dbk, b * eg);
        at::mul_out(dvh, dbv, b);
        Tensor db = (dm * kk * gt.gamma).sum(-1) + (dbv * vh).sum(-1) + (dbk * kh * eg).sum(-1);
        dbeta[bh].view({N, C}).copy_(db);
        dG.add_((dbk * bk).sum(-1));
      } else {
        dvh.copy_(dvn);
      }
      Tensor to_rest = (dkd * kd).sum(-1);  // d/d(G_C - G_i)
      dG.add_(d_gamma.sum(-1)).sub_(d_gamma.sum(-2)).sub_(to_rest);
      dG.select(1, C - 1).add_(to_rest.sum(-1) + d_decay);
      // G = cumsum(g) within each chunk: dg is the reverse cumulative sum of dG
      dg[bh].view({N, C}).copy_(at::flip(at::flip(dG, {1}).cumsum(1), {1}));
    }
  });
  auto unpad = [&](const Tensor& x, int64_t D) {
    Tensor y = x.narrow(1, 0, T);
    return (pad ? y.contiguous() : y).view({B, H, T, D});
  };
  auto unpad_rows = [&](const Tensor& x) {
    Tensor y = x.narrow(1, 0, T);
    return (pad ? y.contiguous() : y).view({B, H, T});
  };
  return {unpad(dq, Dk), unpad(dk, Dk), unpad(dv, Dv), unpad_rows(dg), delta ? unpad_rows(dbeta) : at::empty({0}, opts),
          dS0.view({B, H, Dk, Dv})};
}

// The recurrent step of every gated rule, T tokens (decode: 1), reading and writing `state`
// (B, H, Dk, Dv) float32 in place. g (B, H, T) per head or (B, H, T, Dk) per key channel; beta
// undefined: no delta rule. Per token: S <- a ⊙ S (rows), then the delta (or plain) update, then
// o = Sᵀ q: two passes over S.
Tensor step(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const c10::optional<Tensor>& beta_opt,
            Tensor& state) {
  check(q, "q", 4); check(k, "k", 4); check(v, "v", 4); check(state, "state", 4);
  TORCH_CHECK(g.scalar_type() == at::kFloat && (g.dim() == 3 || g.dim() == 4), "attnkit_gated: g must be float32");
  TORCH_CHECK(state.is_contiguous(), "attnkit_gated: state must be contiguous");
  const bool delta = beta_opt.has_value() && beta_opt->defined();
  const bool per_channel = g.dim() == 4;
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), Dk = q.size(3), Dv = v.size(3);
  const Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous(), gc = g.contiguous();
  const Tensor bc = delta ? beta_opt->contiguous() : Tensor();
  Tensor o = at::empty({B, H, T, Dv}, q.options());
  const float *qd = qc.data_ptr<float>(), *kd = kc.data_ptr<float>(), *vd = vc.data_ptr<float>();
  const float* gd = gc.data_ptr<float>();
  const float* bd = delta ? bc.data_ptr<float>() : nullptr;
  float* od = o.data_ptr<float>();
  float* sd = state.data_ptr<float>();
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(Dv), a(Dk);
    for (int64_t bh = begin; bh < end; ++bh) {
      float* S = sd + bh * Dk * Dv;
      for (int64_t t = 0; t < T; ++t) {
        const int64_t row = bh * T + t;
        const float *qt = qd + row * Dk, *kt = kd + row * Dk, *vt = vd + row * Dv;
        for (int64_t r = 0; r < Dk; ++r) a[r] = std::exp(per_channel ? gd[row * Dk + r] : gd[row]);
        // pass 1: decay the rows, and (delta rule) read kᵀ S
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t r = 0; r < Dk; ++r) {
          float* Sr = S + r * Dv;
          const float ar = a[r], kr = kt[r];
          for (int64_t c = 0; c < Dv; ++c) {
            Sr[c] *= ar;
            acc[c] += kr * Sr[c];
          }
        }
        if (delta) {
          const float b = bd[row];
          for (int64_t c = 0; c < Dv; ++c) acc[c] = b * (vt[c] - acc[c]);
        } else {
          for (int64_t c = 0; c < Dv; ++c) acc[c] = vt[c];
        }
        // pass 2: S += k (the update)ᵀ, and o = Sᵀ q
        float* ot = od + row * Dv;
        std::fill(ot, ot + Dv, 0.f);
        for (int64_t r = 0; r < Dk; ++r) {
          float* Sr = S + r * Dv;
          const float kr = kt[r], qr = qt[r];
          for (int64_t c = 0; c < Dv; ++c) {
            Sr[c] += kr * acc[c];
            ot[c] += qr * Sr[c];
          }
        }
      }
    }
  });
  return o;
}

}  // namespace

// The gated family's own library and op namespace (attnkit_gated): it loads, or fails to build,
// independently of the other kernels.
TORCH_LIBRARY(attnkit_gated, m) {
  m.def("chunk_forward(Tensor q, Tensor k, Tensor v, Tensor g, Tensor? beta, Tensor? initial_state, int chunk, "
        "bool keep) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("chunk_backward(Tensor q, Tensor k, Tensor v, Tensor g, Tensor? beta, Tensor inv, Tensor states, "
        "Tensor v_new, Tensor d_out, Tensor? d_final, int chunk) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("step(Tensor q, Tensor k, Tensor v, Tensor g, Tensor? beta, Tensor(a!) state) -> Tensor");
  m.impl("chunk_forward", c10::DispatchKey::CPU, TORCH_FN(chunk_forward));
  m.impl("chunk_backward", c10::DispatchKey::CPU, TORCH_FN(chunk_backward));
  m.impl("step", c10::DispatchKey::CPU, TORCH_FN(step));
}
