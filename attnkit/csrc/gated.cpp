// Gated linear attention on the CPU: every chunked gated rule (the gated delta rule, KDA, Mamba2's
// SSD, GLA), forward and hand-written backward, and the recurrent step of every rule (decode).
//
// Inputs arrive prepared by attnkit/backends/kernelized/gated/kernel.py: float32, contiguous,
// q already scaled, key heads repeated to the value heads, log-decays g <= 0 clamped at -1e3, one per
// head and token (B, H, T) or per key channel (B, H, T, Dk). Per token (see recurrence.py, the naive
// twin), with a_t = exp(g_t) scaling the state's rows:
//
//     S_t = (I - b_t k_t k_tᵀ) Diag(a_t) S_{t-1} + b_t k_t v_tᵀ       (delta rule, b given: gated delta, KDA)
//     S_t = Diag(a_t) S_{t-1} + k_t v_tᵀ                              (no b: SSD, GLA)
//     o_t = S_tᵀ q_t
//
// Chunked form (gated_delta.py and kda.py, whose backward this file follows): within a chunk of C
// tokens, G the float64 cumulative log-decay from the chunk's start (per channel for per-channel
// gates), Γ_ij = exp(G_i - G_j) for j <= i (0 above; every exponent <= 0),
//
//     KK = (K Kᵀ) ⊙ Γ,  A = (Q Kᵀ) ⊙ Γ                 per-channel: KK_ij = sum_d k_id k_jd Γ_ijd, A likewise
//     [u | w] = (I + strict_lower(diag(b) KK))⁻¹ [diag(b) V | diag(b) K ⊙ exp(G)]     (no b: u = V, no w)
//     per chunk n, S the state before it:
//         v_new = u - w S;  S <- exp(G_C) ⊙ S + (K ⊙ exp(G_C - G))ᵀ v_new
//     o = A v_new + (Q ⊙ exp(G)) S_n
//
// Only the gates and the two within-chunk products depend on the kind of gate: per head they are
// matmuls times Γ, per channel Γ-weighted sums over a segment of chunks (Γ is C²·Dk numbers per
// chunk). The rest is shared. Work items are (batch, head) pairs under at::parallel_for; each works
// through its sequence a segment of chunks at a time (about 1 MiB of q, k, v, so the temporaries
// stay in cache; backward from the last segment), with ATen's matmuls on the chunk tiles
// (single-threaded inside the parallel region) and loops for the gates and the unit-lower inverse. Shapes, tile orders and reduction
// orders depend on the shapes alone, so a call repeats bitwise at one thread count. Zero padding to
// whole chunks is inert (g = 0, b = 0, k = v = 0, after the real tokens).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

namespace {

using at::Tensor;

void check(const Tensor& x, const char* name, int64_t dim) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == dim,
              "attnkit_gated: ", name, " must be a float32 CPU tensor of ", dim, " dims, got ", x.scalar_type(),
              " with ", x.dim());
}

bool given(const c10::optional<Tensor>& x) { return x.has_value() && x->defined(); }

// One call's shapes and its inputs as (B·H, N·C, ·) float32 contiguous, zero-padded to whole chunks.
struct Problem {
  int64_t B, H, T, Dk, Dv, C, N, pad, BH;
  bool delta, per_channel;
  Tensor qp, kp, vp, gp, bp;  // gp (B·H, N·C) per head or (B·H, N·C, Dk) per channel; bp (B·H, N·C) or undefined
  at::TensorOptions opts;

  Tensor pad_tokens(const Tensor& x) const {  // (B, H, T, ...) -> (B·H, N·C, ...)
    std::vector<int64_t> shape{BH, T};
    for (int64_t d = 3; d < x.dim(); ++d) shape.push_back(x.size(d));
    Tensor y = x.reshape(shape);
    if (pad) {
      std::vector<int64_t> widths(2 * (y.dim() - 2), 0);
      widths.push_back(0);
      widths.push_back(pad);
      y = at::constant_pad_nd(y, widths, 0);
    }
    return y.contiguous();
  }
  Tensor unpad(const Tensor& x) const {  // (B·H, N·C, ...) -> (B, H, T, ...)
    Tensor y = x.narrow(1, 0, T);
    if (pad) y = y.contiguous();
    std::vector<int64_t> shape{B, H, T};
    for (int64_t d = 2; d < y.dim(); ++d) shape.push_back(y.size(d));
    return y.view(shape);
  }
  Tensor tiles(const Tensor& x, int64_t bh) const {  // one head's (N, C, D) chunk tiles
    return x[bh].view({N, C, x.size(-1)});
  }
};

Problem problem(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                const c10::optional<Tensor>& beta, int64_t chunk) {
  check(q, "q", 4); check(k, "k", 4); check(v, "v", 4);
  check(g, "g", g.dim() == 4 ? 4 : 3);
  TORCH_CHECK(chunk >= 1, "attnkit_gated: chunk must be >= 1");
  Problem p;
  p.B = q.size(0); p.H = q.size(1); p.T = q.size(2); p.Dk = q.size(3); p.Dv = v.size(3);
  p.C = std::max<int64_t>(1, std::min(chunk, p.T));
  p.N = p.T ? (p.T + p.C - 1) / p.C : 0;
  p.pad = p.N * p.C - p.T;
  p.BH = p.B * p.H;
  p.delta = given(beta);
  p.per_channel = g.dim() == 4;
  p.opts = q.options();
  p.qp = p.pad_tokens(q); p.kp = p.pad_tokens(k); p.vp = p.pad_tokens(v); p.gp = p.pad_tokens(g);
  if (p.delta) p.bp = p.pad_tokens(*beta);
  return p;
}

// One head's gates, in the shapes both kinds of gate share (broadcasting over the channels per head).
struct Gates {
  Tensor eg, er;  // (N, C, 1) or (N, C, Dk): exp(G), exp(G_C - G)
  Tensor decay;   // (N, 1, 1) or (N, Dk, 1): exp(G_C), scaling the state's rows
  Tensor gamma;   // per head: (N, C, C); per channel: undefined (formed a segment at a time from G)
  Tensor G;       // per channel: float64 (N, C, Dk)
};

// Per head: the exponents (differences of float64 cumulative sums, all <= 0), then one vectorized exp.
// g_head: the log-decays of N whole chunks (zero padding included).
Gates head_gates(const Tensor& g_head, int64_t N, int64_t C) {
  auto opts = at::TensorOptions().dtype(at::kFloat);
  Tensor gamma = at::empty({N, C, C}, opts), eg = at::empty({N, C, 1}, opts), er = at::empty({N, C, 1}, opts);
  Tensor decay = at::empty({N, 1, 1}, opts);
  const float* g = g_head.data_ptr<float>();
  float *gm = gamma.data_ptr<float>(), *e = eg.data_ptr<float>(), *r = er.data_ptr<float>();
  float* dec = decay.data_ptr<float>();
  const float minus_inf = -std::numeric_limits<float>::infinity();
  std::vector<double> G(C);
  for (int64_t n = 0; n < N; ++n) {
    double acc = 0;
    for (int64_t i = 0; i < C; ++i) {
      acc += static_cast<double>(g[n * C + i]);
      G[i] = acc;
    }
    const double last = G[C - 1];
    for (int64_t i = 0; i < C; ++i) {
      e[n * C + i] = static_cast<float>(G[i]);
      r[n * C + i] = static_cast<float>(last - G[i]);
      float* row = gm + (n * C + i) * C;
      for (int64_t j = 0; j <= i; ++j) row[j] = static_cast<float>(G[i] - G[j]);
      for (int64_t j = i + 1; j < C; ++j) row[j] = minus_inf;  // exp(-inf) = 0 above the diagonal
    }
    dec[n] = static_cast<float>(last);
  }
  return {eg.exp_(), er.exp_(), decay.exp_(), gamma.exp_(), Tensor()};
}

Gates channel_gates(const Tensor& g_head, int64_t N, int64_t C) {
  Tensor G = g_head.to(at::kDouble).view({N, C, g_head.size(-1)}).cumsum(1);
  Tensor last = G.narrow(1, C - 1, 1);
  return {G.exp().to(at::kFloat), (last - G).exp_().to(at::kFloat), last.transpose(1, 2).exp().to(at::kFloat),
          Tensor(), G};
}

// The gates of head bh's chunks s0 .. s0 + n - 1.
Gates gates(const Problem& p, int64_t bh, int64_t s0, int64_t n) {
  Tensor g = p.gp[bh].narrow(0, s0 * p.C, n * p.C);
  return p.per_channel ? channel_gates(g, n, p.C) : head_gates(g, n, p.C);
}

// Chunks processed together per head (about 1 MiB of their q, k, v), so a segment's temporaries
// stay in cache and the memory of inference does not grow with T.
int64_t chunks_per_segment(const Problem& p) {
  return std::max<int64_t>(1, (int64_t(1) << 20) / (p.C * (2 * p.Dk + p.Dv) * 4));
}

// Per channel: Γ (n, C, C, Dk) float for the chunks of G (n, C, Dk), exp(G_i - G_j), 0 above the diagonal.
Tensor channel_gamma(const Tensor& G) {
  const int64_t C = G.size(1);
  Tensor diff = G.unsqueeze(2) - G.unsqueeze(1);  // [n, i, j] = G_i - G_j
  Tensor upper = at::ones({C, C}, at::TensorOptions().dtype(at::kBool)).triu(1).view({1, C, C, 1});
  return diff.masked_fill_(upper, -std::numeric_limits<double>::infinity()).exp_().to(at::kFloat);
}

// Chunks whose per-channel Γ (float32) stays near 4 MiB, formed together.
int64_t gamma_chunks(const Problem& p) { return std::max<int64_t>(1, (int64_t(1) << 20) / (p.C * p.C * p.Dk)); }

// KK = (K Kᵀ) ⊙ Γ (only with the delta rule) and A = (Q Kᵀ) ⊙ Γ, (N, C, C) each.
std::pair<Tensor, Tensor> products(const Problem& p, const Gates& gt, const Tensor& qh, const Tensor& kh) {
  Tensor kT = kh.transpose(1, 2);
  if (!p.per_channel)
    return {p.delta ? at::bmm(kh, kT).mul_(gt.gamma) : Tensor(), at::bmm(qh, kT).mul_(gt.gamma)};
  const int64_t N = qh.size(0);
  Tensor kk = p.delta ? at::empty({N, p.C, p.C}, p.opts) : Tensor(), a = at::empty({N, p.C, p.C}, p.opts);
  for (int64_t s = 0, seg = gamma_chunks(p); s < N; s += seg) {
    const int64_t n = std::min(seg, N - s);
    Tensor gk = channel_gamma(gt.G.narrow(0, s, n)) * kh.narrow(0, s, n).unsqueeze(1);  // Γ_ijd k_jd
    Tensor a_s = a.narrow(0, s, n);
    at::sum_out(a_s, gk * qh.narrow(0, s, n).unsqueeze(2), {-1});
    if (p.delta) {
      Tensor kk_s = kk.narrow(0, s, n);
      at::sum_out(kk_s, gk.mul_(kh.narrow(0, s, n).unsqueeze(2)), {-1});
    }
  }
  return {kk, a};
}

// The gradient through KK and A (d_kk, d_a given, lower) into dq, dk (N, C, Dk) and the cumulative
// gates' dG ((N, C) per head, (N, C, Dk) per channel).
void products_backward(const Problem& p, const Gates& gt, const Tensor& qh, const Tensor& kh, const Tensor& kk,
                       const Tensor& a, const Tensor& d_kk, const Tensor& d_a, Tensor& dqh, Tensor& dkh, Tensor& dG) {
  if (!p.per_channel) {
    Tensor da_g = d_a * gt.gamma;  // the gradient of Q Kᵀ
    dqh.baddbmm_(da_g, kh);
    dkh.baddbmm_(da_g.transpose(1, 2), qh);
    Tensor d_gamma = d_a * a;  // dΓ ⊙ Γ
    if (p.delta) {
      Tensor dkk_g = d_kk * gt.gamma;  // the gradient of K Kᵀ
      dkh.baddbmm_(dkk_g + dkk_g.transpose(1, 2), kh);
      d_gamma.addcmul_(d_kk, kk);
    }
    dG.add_(d_gamma.sum(-1)).sub_(d_gamma.sum(-2));  // Γ_ij = exp(G_i - G_j)
    return;
  }
  for (int64_t s = 0, seg = gamma_chunks(p), N = qh.size(0); s < N; s += seg) {
    const int64_t n = std::min(seg, N - s);
    Tensor gamma = channel_gamma(gt.G.narrow(0, s, n));  // (n, C, C, Dk)
    Tensor q_s = qh.narrow(0, s, n), k_s = kh.narrow(0, s, n);
    Tensor ki = k_s.unsqueeze(2), kj = k_s.unsqueeze(1), qi = q_s.unsqueeze(2);
    Tensor dq_s = dqh.narrow(0, s, n), dk_s = dkh.narrow(0, s, n), dG_s = dG.narrow(0, s, n);
    Tensor y = d_a.narrow(0, s, n).unsqueeze(-1) * gamma;  // dA_ij Γ_ijd
    dq_s.add_((y * kj).sum(2));
    Tensor yq = y * qi;
    dk_s.add_(yq.sum(1));
    Tensor r = yq.mul_(kj);  // dA_ij Γ_ijd q_id k_jd
    dG_s.add_(r.sum(2)).sub_(r.sum(1));
    if (p.delta) {
      Tensor x = d_kk.narrow(0, s, n).unsqueeze(-1) * gamma;  // dKK_ij Γ_ijd
      Tensor xk = x * kj;
      dk_s.add_(xk.sum(2)).add_((x * ki).sum(1));
      Tensor rk = xk.mul_(ki);
      dG_s.add_(rk.sum(2)).sub_(rk.sum(1));
    }
  }
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

// Forward. beta undefined: no delta rule. Returns (o, final state, inv, states, v_new); the last three
// are what backward reads (empty when `keep` is false; inv and v_new also without the delta rule).
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> chunk_forward(
    const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const c10::optional<Tensor>& beta,
    const c10::optional<Tensor>& initial_opt, int64_t chunk, bool keep) {
  at::AutoDispatchBelowAutograd below;
  const Problem p = problem(q, k, v, g, beta, chunk);
  const int64_t N = p.N, C = p.C, Dk = p.Dk, Dv = p.Dv, BH = p.BH, seg = chunks_per_segment(p);
  const bool delta = p.delta, has_init = given(initial_opt);
  const Tensor init = has_init ? initial_opt->reshape({BH, Dk, Dv}).to(at::kFloat).contiguous() : Tensor();
  const auto opts = p.opts;
  Tensor o = at::empty({BH, N * C, Dv}, opts);
  Tensor final_state = at::empty({BH, Dk, Dv}, opts);
  Tensor inv_all = keep && delta ? at::empty({BH, N, C, C}, opts) : at::empty({0}, opts);
  Tensor states_all = keep ? at::empty({BH, N, Dk, Dv}, opts) : at::empty({0}, opts);
  Tensor vnew_all = keep && delta ? at::empty({BH, N, C, Dv}, opts) : at::empty({0}, opts);
  const bool inference = c10::InferenceMode::is_enabled();  // thread-local: the workers do not inherit it
  at::parallel_for(0, BH, 1, [&](int64_t begin, int64_t end) {
    std::optional<c10::InferenceMode> inference_in_worker;  // in place on inference tensors needs the mode
    if (inference) inference_in_worker.emplace();
    at::AutoDispatchBelowAutograd below_in_worker;  // plain tensor arithmetic in every worker thread
    // inference keeps one segment's states and v_new, reused
    Tensor states_seg = keep ? Tensor() : at::empty({std::min(seg, N), Dk, Dv}, opts);
    Tensor vnew_seg = keep || !delta ? Tensor() : at::empty({std::min(seg, N), C, Dv}, opts);
    for (int64_t bh = begin; bh < end; ++bh) {
      Tensor S = has_init ? init[bh].clone() : at::zeros({Dk, Dv}, opts);
      for (int64_t s0 = 0; s0 < N; s0 += seg) {
        const int64_t n = std::min(seg, N - s0);
        Tensor qh = p.tiles(p.qp, bh).narrow(0, s0, n), kh = p.tiles(p.kp, bh).narrow(0, s0, n);
        Tensor vh = p.tiles(p.vp, bh).narrow(0, s0, n);
        const Gates gt = gates(p, bh, s0, n);
        auto [kk, a] = products(p, gt, qh, kh);
        Tensor kdT = (kh * gt.er).transpose(1, 2).contiguous();  // (n, Dk, C)
        Tensor states = keep ? states_all[bh].narrow(0, s0, n) : states_seg.narrow(0, 0, n);
        Tensor vnew = vh, w;  // no delta rule: v_new = v
        if (delta) {
          Tensor b = p.bp[bh].view({N, C, 1}).narrow(0, s0, n);
          Tensor inv = unit_lower_inverse((kk * b).contiguous());
          if (keep) inv_all[bh].narrow(0, s0, n).copy_(inv);
          Tensor inv_b = inv * b.view({n, 1, C});  // (I + M)⁻¹ diag(b)
          vnew = keep ? vnew_all[bh].narrow(0, s0, n) : vnew_seg.narrow(0, 0, n);
          at::bmm_out(vnew, inv_b, vh);  // u, made v_new in place by the scan
          w = at::bmm(inv_b, kh * gt.eg);  // (n, C, Dk)
        }
        for (int64_t i = 0; i < n; ++i) {  // the one sequential part: carry S across the chunks
          states[i].copy_(S);
          if (delta) vnew[i].addmm_(w[i], S, 1, -1);
          S.mul_(gt.decay[i]).addmm_(kdT[i], vnew[i]);
        }
        Tensor oh = o[bh].view({N, C, Dv}).narrow(0, s0, n);
        at::bmm_out(oh, qh * gt.eg, states);
        oh.baddbmm_(a, vnew);
      }
      final_state[bh].copy_(S);
    }
  });
  return {p.unpad(o), final_state.view({p.B, p.H, Dk, Dv}), inv_all, states_all, vnew_all};
}

// Backward of chunk_forward (gradients of q, k, v, g, beta and the initial state), reading what it
// saved (the chunks' inverses, starting states and v_new) and recomputing the rest, a segment of
// chunks at a time from the last.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> chunk_backward(
    const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const c10::optional<Tensor>& beta,
    const Tensor& inv_all, const Tensor& states_all, const Tensor& vnew_all, const Tensor& d_out,
    const c10::optional<Tensor>& d_final_opt, int64_t chunk) {
  at::AutoDispatchBelowAutograd below;
  check(d_out, "d_out", 4);
  const Problem p = problem(q, k, v, g, beta, chunk);
  const int64_t N = p.N, C = p.C, Dk = p.Dk, Dv = p.Dv, BH = p.BH, seg = chunks_per_segment(p);
  const bool delta = p.delta, has_df = given(d_final_opt);
  const Tensor dop = p.pad_tokens(d_out);
  const Tensor df = has_df ? d_final_opt->reshape({BH, Dk, Dv}).to(at::kFloat).contiguous() : Tensor();
  const auto opts = p.opts;
  Tensor dq = at::empty({BH, N * C, Dk}, opts), dk = at::empty({BH, N * C, Dk}, opts);
  Tensor dv = at::empty({BH, N * C, Dv}, opts), dg = at::empty_like(p.gp);
  Tensor dbeta = at::zeros({BH, N * C}, opts), dS0 = at::empty({BH, Dk, Dv}, opts);
  const bool inference = c10::InferenceMode::is_enabled();
  at::parallel_for(0, BH, 1, [&](int64_t begin, int64_t end) {
    std::optional<c10::InferenceMode> inference_in_worker;
    if (inference) inference_in_worker.emplace();
    at::AutoDispatchBelowAutograd below_in_worker;
    for (int64_t bh = begin; bh < end; ++bh) {
      Tensor dS = has_df ? df[bh].clone() : at::zeros({Dk, Dv}, opts);
      for (int64_t s0 = N ? (N - 1) / seg * seg : -1; s0 >= 0; s0 -= seg) {
        const int64_t n = std::min(seg, N - s0);
        auto part = [&](const Tensor& x) { return p.tiles(x, bh).narrow(0, s0, n); };
        Tensor qh = part(p.qp), kh = part(p.kp), vh = part(p.vp), doh = part(dop);
        const Gates gt = gates(p, bh, s0, n);
        auto [kk, a] = products(p, gt, qh, kh);
        Tensor st = states_all[bh].narrow(0, s0, n);  // (n, Dk, Dv)
        Tensor vn = delta ? vnew_all[bh].narrow(0, s0, n) : vh;
        Tensor qg = qh * gt.eg, kd = kh * gt.er;
        Tensor b, bk, inv, u, w;
        if (delta) {
          b = p.bp[bh].view({N, C, 1}).narrow(0, s0, n);
          bk = kh * (b * gt.eg);
          inv = inv_all[bh].narrow(0, s0, n);
          u = at::bmm(inv, vh * b);
          w = at::bmm(inv, bk);
        }
        // the reverse scan; d_after[i] is the gradient of the state after chunk s0 + i
        Tensor dvn = at::bmm(a.transpose(1, 2), doh);  // (n, C, Dv): the outputs' part
        Tensor dS_o = at::bmm(qg.transpose(1, 2), doh);  // (n, Dk, Dv)
        Tensor d_after = at::empty({n, Dk, Dv}, opts);
        Tensor wT = delta ? w.transpose(1, 2) : Tensor();
        for (int64_t i = n - 1; i >= 0; --i) {
          d_after[i].copy_(dS);
          dvn[i].addmm_(kd[i], dS);
          Tensor next = at::addcmul(dS_o[i], dS, gt.decay[i]);
          if (delta) next.addmm_(wT[i], dvn[i], 1, -1);
          dS = next;
        }
        Tensor stT = st.transpose(1, 2);  // (n, Dv, Dk)
        Tensor dqg = at::bmm(doh, stT);  // (n, C, Dk)
        Tensor d_a = at::bmm(doh, vn.transpose(1, 2)).tril_();  // the gradient of A
        Tensor dkd = at::bmm(vn, d_after.transpose(1, 2));  // (n, C, Dk)
        Tensor dqh = part(dq), dkh = part(dk), dvh = part(dv);
        at::mul_out(dqh, dqg, gt.eg);
        at::mul_out(dkh, dkd, gt.er);
        // dG per channel (summed over the channels at the end for per-head gates)
        Tensor dGc = dqg * qg;  // through exp(G) in q ⊙ exp(G)
        Tensor to_rest = dkd * kd;  // through exp(G_C - G) in k ⊙ exp(G_C - G)
        dGc.sub_(to_rest);
        Tensor d_decay = (st * d_after).sum(-1) * gt.decay.squeeze(-1);  // (n, Dk) through exp(G_C)
        dGc.select(1, C - 1).add_(to_rest.sum(1) + d_decay);
        Tensor d_kk;
        if (delta) {
          Tensor dw = at::bmm(dvn, stT).neg_();
          Tensor invT = inv.transpose(1, 2);
          Tensor dbv = at::bmm(invT, dvn), dbk = at::bmm(invT, dw);  // d(bV), d(bK ⊙ exp(G))
          Tensor dm = at::bmm(dbv, u.transpose(1, 2)).baddbmm_(dbk, w.transpose(1, 2)).tril_(-1).neg_();
          d_kk = dm * b;  // the gradient of KK
          dkh.addcmul_(dbk, b * gt.eg);
          at::mul_out(dvh, dbv, b);
          Tensor db = (dm * kk).sum(-1) + (dbv * vh).sum(-1) + (dbk * kh * gt.eg).sum(-1);
          dbeta[bh].view({N, C}).narrow(0, s0, n).copy_(db);
          dGc.addcmul_(dbk, bk);
        } else {
          dvh.copy_(dvn);
        }
        Tensor dG = p.per_channel ? dGc : dGc.sum(-1);
        products_backward(p, gt, qh, kh, kk, a, d_kk, d_a, dqh, dkh, dG);
        // G = cumsum(g) within each chunk: dg is the reverse cumulative sum of dG
        dg[bh].narrow(0, s0 * C, n * C).view(dG.sizes()).copy_(at::flip(at::flip(dG, {1}).cumsum(1), {1}));
      }
      dS0[bh].copy_(dS);
    }
  });
  return {p.unpad(dq), p.unpad(dk), p.unpad(dv), p.unpad(dg), delta ? p.unpad(dbeta) : at::empty({0}, opts),
          dS0.view({p.B, p.H, Dk, Dv})};
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
