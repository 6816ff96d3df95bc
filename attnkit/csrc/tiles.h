// Tile building blocks of the native attention kernel: the tile GEMM, operand packing and the
// row operations of the online softmax. Everything here has the same summation order on every
// x86 ISA (a fixed 16-lane split, whatever the vector width), so results are bitwise repeatable
// on one machine and equal within rounding across AVX2 / AVX-512 / AMX.
//
// Element types: T is the type of the GEMM operands (float, double, BFloat16, Half), Acc<T> the
// type of scores, statistics and accumulators (float for every T but double).
#pragma once

#include <ATen/Context.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace attnkit {

template <typename T> struct AccOf { using type = float; };
template <> struct AccOf<double> { using type = double; };
template <typename T> using Acc = typename AccOf<T>::type;

template <typename T> constexpr bool is_reduced = std::is_same_v<T, at::BFloat16> || std::is_same_v<T, at::Half>;

// Whether the oneDNN batch-reduce GEMM micro-kernel (cpublas::brgemm, exported by every x86 torch
// build with oneDNN) takes T in the VNNI layout on this CPU: bf16 on AVX-512 and AMX, fp16 on
// AVX512-FP16/AMX-FP16. Probed once by running it on a 2x16x2 product; elsewhere the operands stay
// row-major and cpublas falls back to its own GEMM (correct everywhere, slower).
template <typename T>
bool vnni_available() {
  if constexpr (!is_reduced<T>) {
    return false;
  } else {
    static const bool ok = [] {
      T a[4], b[64];
      float c[32] = {};
      for (int i = 0; i < 4; ++i) a[i] = T(float(i + 1));
      for (int i = 0; i < 64; ++i) b[i] = T(float(i % 5));  // VNNI: b[(k/2)*32 + n*2 + k%2] = B[k][n]
      try {
        at::native::cpublas::brgemm(2, 16, 2, 2, 16, 16, false, a, b, c, true);
        at::native::cpublas::brgemm_release(true);
      } catch (const std::exception&) {
        return false;
      }
      for (int i = 0; i < 2; ++i)
        for (int n = 0; n < 16; ++n)
          if (c[i * 16 + n] != float(a[2 * i]) * float(b[n * 2]) + float(a[2 * i + 1]) * float(b[n * 2 + 1])) return false;
      return true;
    }();
    // oneDNN off (torch.backends.mkldnn.enabled = False): cpublas takes no VNNI operands then.
    return ok && at::globalContext().userEnabledMkldnn();
  }
}

// The K dimension a GEMM operand is stored with: even for VNNI (pairs of K rows interleaved).
template <typename T>
inline int64_t padded_k(int64_t k) {
  return vnni_available<T>() ? k + (k & 1) : k;
}

// The B operand (K x N, logically B[k][n]) of a tile GEMM in the layout gemm() reads:
// B[k][n] = src[k * ld + n], or src[n * ld + k] when `transposed`. VNNI: dst[(k/2)*2N + 2n + k%2]
// (K padded to even with zeros); otherwise row-major K x N. Writes padded_k<T>(K) * N elements.
template <typename T>
void pack_b(const T* src, int64_t ld, bool transposed, int64_t K, int64_t N, T* dst) {
  if (vnni_available<T>()) {
    const int64_t Kp = padded_k<T>(K);
    for (int64_t k = 0; k < Kp; ++k) {
      T* row = dst + (k / 2) * 2 * N + (k & 1);
      if (k >= K) {
        for (int64_t n = 0; n < N; ++n) row[2 * n] = T(0.f);
      } else if (transposed) {
        for (int64_t n = 0; n < N; ++n) row[2 * n] = src[n * ld + k];
      } else {
        for (int64_t n = 0; n < N; ++n) row[2 * n] = src[k * ld + n];
      }
    }
  } else if (transposed) {
    for (int64_t k = 0; k < K; ++k)
      for (int64_t n = 0; n < N; ++n) dst[k * N + n] = src[n * ld + k];
  } else {
    for (int64_t k = 0; k < K; ++k) std::memcpy(dst + k * N, src + k * ld, N * sizeof(T));
  }
}

// The bits of x rounded to T (nearest even: bitwise what c10's conversion gives), in branch-free
// code the compiler vectorizes (c10's scalar conversion would cost more than the tile GEMM).
template <typename T>
inline uint16_t reduced_bits(float x) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    const uint32_t b = __builtin_bit_cast(uint32_t, x);
    const uint16_t r = static_cast<uint16_t>((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
    return x != x ? uint16_t(0x7fc0) : r;
  } else {
    return __builtin_bit_cast(uint16_t, static_cast<_Float16>(x));
  }
}

// dst[0..n) = src[0..n) in T (a copy when the types agree).
template <typename T, typename S>
inline void convert_row(const S* __restrict src, T* __restrict dst, int64_t n) {
  if constexpr (std::is_same_v<S, T>) {
    std::memcpy(dst, src, n * sizeof(T));
  } else {
    uint16_t* d = reinterpret_cast<uint16_t*>(dst);
    for (int64_t j = 0; j < n; ++j) d[j] = reduced_bits<T>(src[j]);
  }
}

// The A operand (M x K) as gemm() reads it: row-major with leading dimension lda >= padded_k(K),
// converted from Acc (or copied from T), optionally transposed (A[m][k] = src[k * ld + m], for
// operands packed once per call); columns K..padded_k(K) zero.
template <typename T, typename S>
void pack_a(const S* src, int64_t ld, bool transposed, int64_t M, int64_t K, T* dst, int64_t lda) {
  const int64_t Kp = padded_k<T>(K);
  for (int64_t m = 0; m < M; ++m) {
    T* row = dst + m * lda;
    if (transposed) {
      for (int64_t k = 0; k < K; ++k) row[k] = static_cast<T>(src[k * ld + m]);
    } else {
      convert_row(src + m * ld, row, K);
    }
    for (int64_t k = K; k < Kp; ++k) row[k] = T(0.f);
  }
}

// The B operand (K x N) from a float tile (B[k][n] = src[k * ld + n]) in a reduced type: VNNI
// pairs of rows interleaved (K padded to even with zeros), else row-major; ldb = N.
template <typename T>
void pack_b_rows(const float* src, int64_t ld, int64_t K, int64_t N, T* dst) {
  if (!vnni_available<T>()) {
    for (int64_t k = 0; k < K; ++k) convert_row(src + k * ld, dst + k * N, N);
    return;
  }
  for (int64_t k = 0; k < K; k += 2) {
    const float* lo = src + k * ld;
    const float* hi = k + 1 < K ? lo + ld : nullptr;
    uint32_t* d = reinterpret_cast<uint32_t*>(dst + k * N);  // row pair k/2: 2N elements
    if (hi) {
      for (int64_t n = 0; n < N; ++n) d[n] = reduced_bits<T>(lo[n]) | (uint32_t(reduced_bits<T>(hi[n])) << 16);
    } else {
      for (int64_t n = 0; n < N; ++n) d[n] = reduced_bits<T>(lo[n]);
    }
  }
}

// C[M x N] (+)= A[M x K] B[K x N], row-major, A as pack_a writes it, B as pack_b writes it (ldb = N),
// K = padded_k(K) of the operands. fp32 and reduced precision run oneDNN's micro-kernel through
// cpublas::brgemm (fp32 accumulation; its fallback is cpublas's own GEMM, present in every build);
// float64 runs at::mm on views.
template <typename T>
void gemm(int64_t M, int64_t N, int64_t K, const T* A, int64_t lda, const T* B, int64_t ldb, Acc<T>* C, int64_t ldc,
          bool accumulate) {
  if constexpr (std::is_same_v<T, double>) {
    auto opts = at::TensorOptions().dtype(at::kDouble);
    auto a = at::from_blob(const_cast<double*>(A), {M, K}, {lda, 1}, opts);
    auto b = at::from_blob(const_cast<double*>(B), {K, N}, {ldb, 1}, opts);
    auto c = at::from_blob(C, {M, N}, {ldc, 1}, opts);
    if (accumulate) {
      c.addmm_(a, b);
    } else {
      at::mm_out(c, a, b);
    }
  } else {
    at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, accumulate, A, B, C, vnni_available<T>());
  }
}

// Releases the micro-kernel's hardware context (AMX tiles) at the end of a parallel task.
template <typename T>
inline void gemm_done() {
  if (vnni_available<T>()) at::native::cpublas::brgemm_release(true);
}

// A fixed 16-lane split for row reductions: the compiler maps it onto 8 or 16 wide registers, the
// summation order stays the same on every ISA.
constexpr int kLanes = 16;

template <typename A>
inline A lane_sum(A* lanes) {  // pairwise, in a fixed tree
  for (int w = kLanes / 2; w >= 1; w /= 2)
    for (int u = 0; u < w; ++u) lanes[u] = lanes[u] + lanes[u + w];
  return lanes[0];
}

template <typename A>
inline void scale_row(A* __restrict x, int64_t n, A scale) {
  for (int64_t j = 0; j < n; ++j) x[j] *= scale;
}

// max(init, x[0..n)) (exact: the order does not matter; lanes only make it vectorize).
template <typename A>
inline A row_max(const A* __restrict x, int64_t n, A init) {
  A lanes[kLanes];
  for (int u = 0; u < kLanes; ++u) lanes[u] = init;
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int u = 0; u < kLanes; ++u) lanes[u] = x[j + u] > lanes[u] ? x[j + u] : lanes[u];
  A mx = init;
  for (int u = 0; u < kLanes; ++u) mx = lanes[u] > mx ? lanes[u] : mx;
  for (; j < n; ++j) mx = x[j] > mx ? x[j] : mx;
  return mx;
}

// exp(x) for float: Cephes' expf polynomial (|error| ~ 1 ulp), branch-free so the row loops
// vectorize; arguments below -87.3 (and -inf) give exactly 0.
inline float exp_poly(float a) {
  const float xc = std::min(std::max(a, -87.3f), 88.3f);
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
  const float e = y * __builtin_bit_cast(float, bits);
  return a < -87.3f ? 0.f : e;
}
inline double exp_poly(double a) { return std::exp(a); }

// exp(x * scale - shift) over a row into out (in place when out == x; a reduced type rounds the
// stored value, the sum adds the float ones), returning the row sum (fixed 16-lane order). scale > 0.
template <typename A, typename O>
inline A exp_row(const A* x, int64_t n, A scale, A shift, O* out) {
  A lanes[kLanes] = {};
  auto store = [&](int64_t j, A e) {
    if constexpr (std::is_same_v<O, A>) {
      out[j] = e;
    } else {
      reinterpret_cast<uint16_t*>(out)[j] = reduced_bits<O>(e);
    }
  };
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int u = 0; u < kLanes; ++u) {
      const A e = exp_poly(x[j + u] * scale - shift);
      store(j + u, e);
      lanes[u] += e;
    }
  for (int u = 0; j < n; ++j, ++u) {
    const A e = exp_poly(x[j] * scale - shift);
    store(j, e);
    lanes[u] += e;
  }
  return lane_sum(lanes);
}

}  // namespace attnkit
