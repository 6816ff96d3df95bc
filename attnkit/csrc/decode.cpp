// Split-K decode attention for the CPU: few queries (Tq <= 16) over a long KV cache, read in place.
//
// Decoding reads the whole cache once per token, so its limit is memory bandwidth. Each work item is
// one (sequence, K/V head, split of the keys): it reads its keys once for all G * Tq query rows that
// share the K/V head (GQA), converting each key and value as it is read (bf16/fp16 to float32, int8
// times its per-token, per-head scale folded into the score and the probability), through the block
// table for a paged pool (no gather copy). Each split yields a partial result (row max m, softmax
// mass l, unnormalized output o, FlashDecoding); a second pass merges the splits of a (sequence,
// head) in order by their log-sum-exp, adding the attention sink of each query head.
//
// Batch invariance: a sequence's splits start at the first key its queries keep and are sized from
// the span up to its last kept key and the thread count (never from the batch's longest row or
// its size); the span is the same whether the mask comes as band bounds and key lengths or as a
// keep tensor (decode_spans), as a ragged batch's per-row mask does. Every split is reduced by one
// thread in a fixed order and the splits are merged in order, so a sequence decoded alone or in any
// batch at one thread count gives bitwise-equal output. Rows of a batch hold different lengths (no
// padding to the longest).
//
// Masks and score modifiers arrive as the kernel spec (spec.h), read with the prefill kernel's own
// code: s = scale * q.k (* k_scale), + bias, then the modifiers in chain order (soft-cap with the
// prefill's tanh, so a capped score rounds alike; ALiBi from its slopes; a relative bias from its
// values per clamped distance), then the mask (band bounds, a byte keep view) sets -inf. A row that
// keeps no key gets output 0 and LSE -inf (its sink's logit with sinks).
//
// The NaN/Inf contract of attention() is kept here, with no scan of K/V: keys past a sequence's
// length or outside its span are never read; a key a row may not see gets the score -inf by
// replacement (whatever its score held) and its value is skipped for that row (never multiplied by
// 0: 0 * NaN = NaN), so NaN/Inf there changes no bit of the row. NaN/Inf in a query, or in a key or
// value a row sees, flows through IEEE arithmetic into that row alone: a +Inf score makes the row
// NaN (inf - inf in the max subtraction), a -Inf score weight 0, every value the row sees is added
// (0 * NaN included), and the split merge works row by row.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "spec.h"
#include "tiles.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>
#if defined(__AVX__)
#include <immintrin.h>  // the AVX/AVX2/F16C/AVX-512 conversions below, each behind its own guard
#endif

namespace {

using attnkit::kLanes;
constexpr int64_t kChunk = 64;  // keys scored together (a small block of scores per row)
static_assert(kChunk % kLanes == 0 && kChunk <= 64, "a chunk is whole 16-key blocks, its live keys one 64-bit mask");
// A row's softmax reference moves only when a score passes it by more than this (natural log units:
// exps stay below e^8 ~ 3e3, sums over a 4096-key split below 1.3e7: far from float32's range).
constexpr float kRescaleAbove = 8.f;

// The kernel's vector code is GCC's generic 16-float vectors (kLanes, as in tiles.h) that the
// compiler maps onto the machine's registers (one zmm, two ymm): ATen's Vectorized<float> is its
// scalar fallback in an extension (no CPU_CAPABILITY is defined here), plain loops compiled to
// gathers, and the fixed lane count keeps every summation order the same on every ISA.
typedef float V16 __attribute__((vector_size(64)));
typedef int32_t I16 __attribute__((vector_size(64)));
typedef uint32_t U16 __attribute__((vector_size(64)));

// 16 elements of a key or value row as float32, converted in registers: bf16 and fp16 through
// their bits, int8 exactly (its scale is applied to the score and the probability). The
// conversions are exact, so the instruction set changes no bit; x86 intrinsics where GCC's generic
// conversions compile to scalar code.
#if defined(__AVX__)
// Two 8-lane halves as one 16-lane vector (the paths below without AVX-512).
inline V16 join(__m256 lo, __m256 hi) {
  V16 v;
  std::memcpy(&v, &lo, sizeof lo);
  std::memcpy(reinterpret_cast<char*>(&v) + sizeof lo, &hi, sizeof hi);
  return v;
}
#endif
inline V16 load16(const float* p) {
  V16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline V16 load16(const c10::BFloat16* p) {
#if defined(__AVX512F__)
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return reinterpret_cast<V16>(_mm512_slli_epi32(w, 16));
#else
  typedef uint16_t H __attribute__((vector_size(32)));
  H h;
  std::memcpy(&h, p, sizeof h);
  return reinterpret_cast<V16>(__builtin_convertvector(h, U16) << 16);
#endif
}
inline V16 load16(const c10::Half* p) {
#if defined(__AVX512F__)
  return reinterpret_cast<V16>(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#elif defined(__F16C__)
  return join(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
              _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p) + 1)));
#else
  typedef _Float16 H __attribute__((vector_size(32)));
  H h;
  std::memcpy(&h, p, sizeof h);
  return __builtin_convertvector(h, V16);
#endif
}
inline V16 load16(const int8_t* p) {
#if defined(__AVX512F__)
  return reinterpret_cast<V16>(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
#elif defined(__AVX2__)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return join(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)),
              _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(b, b))));
#else
  typedef int8_t H __attribute__((vector_size(16)));
  H h;
  std::memcpy(&h, p, sizeof h);
  return __builtin_convertvector(__builtin_convertvector(h, I16), V16);
#endif
}
// The first n < 16 elements, the other lanes 0 (nothing past the row is read: AVX-512 masked loads,
// else a copy).
template <typename T>
inline V16 load_part(const T* p, int64_t n) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  const uint32_t mask = (1u << n) - 1u;
  if constexpr (std::is_same_v<T, float>) {
    return reinterpret_cast<V16>(_mm512_maskz_loadu_ps(static_cast<__mmask16>(mask), p));
  } else if constexpr (sizeof(T) == 2) {
    const __m256i h = _mm256_maskz_loadu_epi16(static_cast<__mmask16>(mask), p);
    T t[kLanes];
    std::memcpy(static_cast<void*>(t), &h, sizeof t);
    return load16(t);
  } else {
    const __m128i b = _mm_maskz_loadu_epi8(static_cast<__mmask16>(mask), p);
    T t[kLanes];
    std::memcpy(static_cast<void*>(t), &b, sizeof t);
    return load16(t);
  }
#else
  T t[kLanes];
  std::memset(static_cast<void*>(t), 0, sizeof t);
  std::memcpy(static_cast<void*>(t), p, n * sizeof(T));
  return load16(t);
#endif
}

// Pulls the n bytes at p toward the cache (L2) ahead of their use: a hint that never faults and
// changes no result, given only rows the kernel reads.
inline void prefetch(const void* p, int64_t n) {
  const char* c = static_cast<const char*>(p);
  for (int64_t b = 0; b < n; b += 64) __builtin_prefetch(c + b, 0, 2);
}

// Lane shuffles of two vectors (lanes 0..15 of a, 16..31 of b).
template <int... I>
inline V16 pick(V16 a, V16 b) {
  return __builtin_shuffle(a, b, I16{I...});
}

// How q . k is computed (chosen per call from the cache's dtype, the options and the CPU's features):
//   kFloat: q scaled, float32; keys converted to float32 as read, float32 FMAs (exact to the stored keys);
//   kBf16Dot: bfloat16 q and keys, bf16 dot products with float32 accumulation (AVX512_BF16's
//     vdpbf16ps; q is bfloat16 already, so nothing is rounded but what the instruction rounds);
//   kInt8Dot: int8 keys against a per-row int8-quantized q (DecodeOptions(quantized_query=True)): exact
//     integer dot products (AVX512_VNNI's vpdpbusd, else portable int32 vectors: the same integers),
//     the row's quantization scale applied to the score.
enum QMode : int { kFloat = 0, kBf16Dot = 1, kInt8Dot = 2 };
template <int Mode> struct QOf { using type = float; };
template <> struct QOf<kBf16Dot> { using type = uint16_t; };
template <> struct QOf<kInt8Dot> { using type = int8_t; };
// Elements of a row of the query buffer: q padded with zeros to a whole number of the mode's steps
// (16 floats, 32 bf16, 64 int8), then for kInt8Dot 64 bytes of per-lane corrections (vpdpbusd).
inline int64_t q_stride(int mode, int64_t D) {
  if (mode == kBf16Dot) return (D + 31) / 32 * 32;
  if (mode == kInt8Dot) return (D + 63) / 64 * 64 + 64;
  return (D + kLanes - 1) / kLanes * kLanes;
}

// out[j][r] = the 16 lane partials of q_r . k_j over the head dim for R query rows and four keys
// (the lane tree of qk16 then adds them): kFloat lane u takes dims u, u + 16, ... in order, the tail
// dims add into lanes 0...; a tail lane past D adds 0 * 0. Each piece of the query rows is loaded
// once for the four keys (a row's piece feeds four products), each piece of a key converted once for
// all R rows; every accumulator is one chain over the head dim in order, whatever the loop nest.
// kInt8Dot lanes hold exact integers (|q.k| < 2^24 for D <= 1040: exact as floats too).
template <int R, int Mode, typename KT>
inline void qk_lanes(const typename QOf<Mode>::type* __restrict q, int64_t ld, int64_t D, const KT* const* k,
                     V16 (*__restrict out)[R]) {
  if constexpr (Mode == kFloat) {
    V16 acc[4][R];
    for (int j = 0; j < 4; ++j)
      for (int r = 0; r < R; ++r) acc[j][r] = V16{};
    for (int64_t c = 0; c < D; c += kLanes) {
      V16 qv[R];
      for (int r = 0; r < R; ++r) qv[r] = load16(q + r * ld + c);
      for (int j = 0; j < 4; ++j) {
        const V16 kv = c + kLanes <= D ? load16(k[j] + c) : load_part(k[j] + c, D - c);
        for (int r = 0; r < R; ++r) acc[j][r] += qv[r] * kv;
      }
    }
    for (int j = 0; j < 4; ++j)
      for (int r = 0; r < R; ++r) out[j][r] = acc[j][r];
  } else if constexpr (Mode == kBf16Dot) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    __m512 acc[4][R];
    for (int j = 0; j < 4; ++j)
      for (int r = 0; r < R; ++r) acc[j][r] = _mm512_setzero_ps();
    for (int64_t c = 0; c < D; c += 32) {
      const __mmask32 tail = c + 32 <= D ? ~__mmask32(0) : static_cast<__mmask32>((uint64_t(1) << (D - c)) - 1);
      __m512bh qv[R];
      for (int r = 0; r < R; ++r) qv[r] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(q + r * ld + c));
      for (int j = 0; j < 4; ++j) {
        const __m512bh kv = reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi16(tail, k[j] + c));
        for (int r = 0; r < R; ++r) acc[j][r] = _mm512_dpbf16_ps(acc[j][r], qv[r], kv);
      }
    }
    for (int j = 0; j < 4; ++j)
      for (int r = 0; r < R; ++r) out[j][r] = reinterpret_cast<V16>(acc[j][r]);
#else
    TORCH_CHECK(false, "decode: bf16 dot products are not compiled in (no AVX512_BF16)");
#endif
  } else {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    // vpdpbusd multiplies unsigned by signed bytes: (k + 128) . q, the 128 . q part taken out by the
    // per-lane corrections stored after the row (-128 times the lane's q elements summed).
    const int64_t Dp = (D + 63) / 64 * 64;
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    __m512i acc[4][R];
    for (int r = 0; r < R; ++r) {
      const __m512i corr = _mm512_loadu_si512(q + r * ld + Dp);
      for (int j = 0; j < 4; ++j) acc[j][r] = corr;
    }
    for (int64_t c = 0; c < D; c += 64) {
      const __mmask64 tail = c + 64 <= D ? ~__mmask64(0) : (uint64_t(1) << (D - c)) - 1;
      __m512i qv[R];
      for (int r = 0; r < R; ++r) qv[r] = _mm512_loadu_si512(q + r * ld + c);
      for (int j = 0; j < 4; ++j) {
        const __m512i kv = _mm512_xor_si512(_mm512_maskz_loadu_epi8(tail, k[j] + c), flip);
        for (int r = 0; r < R; ++r) acc[j][r] = _mm512_dpbusd_epi32(acc[j][r], kv, qv[r]);
      }
    }
    for (int j = 0; j < 4; ++j)
      for (int r = 0; r < R; ++r) out[j][r] = reinterpret_cast<V16>(_mm512_cvtepi32_ps(acc[j][r]));
#else
    typedef int8_t B16 __attribute__((vector_size(16)));
    I16 acc[4][R];
    for (int j = 0; j < 4; ++j)
      for (int r = 0; r < R; ++r) acc[j][r] = I16{};
    for (int64_t c = 0; c < D; c += kLanes) {
      I16 qv[R];
      for (int r = 0; r < R; ++r) {
        B16 qb;
        std::memcpy(&qb, q + r * ld + c, sizeof qb);
        qv[r] = __builtin_convertvector(qb, I16);
      }
      for (int j = 0; j < 4; ++j) {
        B16 kb = {};
        std::memcpy(&kb, k[j] + c, std::min<int64_t>(kLanes, D - c));
        const I16 kv = __builtin_convertvector(kb, I16);
        for (int r = 0; r < R; ++r) acc[j][r] += qv[r] * kv;
      }
    }
    for (int j = 0; j < 4; ++j)
      for (int r = 0; r < R; ++r) out[j][r] = __builtin_convertvector(acc[j][r], V16);
#endif
  }
}

// The scores of R query rows against 16 keys (kr[0..nk), the rest of the lanes unused):
// out[r] lane j = q_r . k_j: the lane partials of qk_lanes, then the fixed pairwise lane tree of
// attnkit::lane_sum (u + 8, then + 4, + 2, + 1) run on 16 keys at once with shuffles. The order
// depends on D only: never on the batch, the data or the ISA. Every four keys, two tree levels
// leave one vector per row (4 lanes per key).
template <int R, int Mode, typename KT>
inline void qk16(const typename QOf<Mode>::type* __restrict q, int64_t ld, int64_t D, const KT* const* kr, int nk,
                 V16* out) {
  V16 quad[R][4];
  for (int j0 = 0; j0 < kLanes; j0 += 4) {
    if (j0 >= nk) {
      for (int r = 0; r < R; ++r) quad[r][j0 / 4] = V16{};
      continue;
    }
    V16 acc[4][R];
    const KT* k4[4];
    for (int j = 0; j < 4; ++j) k4[j] = kr[j0 + j < nk ? j0 + j : j0];  // past nk: scored, unused
    qk_lanes<R, Mode>(q, ld, D, k4, acc);
    for (int r = 0; r < R; ++r) {
      // level u + 8: keys (0, 1) and (2, 3) -> 8 lanes each
      const V16 h01 = pick<0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23>(acc[0][r], acc[1][r]) +
                      pick<8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31>(acc[0][r], acc[1][r]);
      const V16 h23 = pick<0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23>(acc[2][r], acc[3][r]) +
                      pick<8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31>(acc[2][r], acc[3][r]);
      // level u + 4: keys 0..3 -> 4 lanes each
      quad[r][j0 / 4] = pick<0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27>(h01, h23) +
                        pick<4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31>(h01, h23);
    }
  }
  for (int r = 0; r < R; ++r) {
    // level u + 2: keys 0..7 and 8..15 -> 2 lanes each; level u + 1: lane j = key j
    const V16 a = pick<0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29>(quad[r][0], quad[r][1]) +
                  pick<2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31>(quad[r][0], quad[r][1]);
    const V16 b = pick<0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29>(quad[r][2], quad[r][3]) +
                  pick<2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31>(quad[r][2], quad[r][3]);
    out[r] = pick<0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30>(a, b) +
             pick<1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31>(a, b);
  }
}

// s[r * kChunk + j] = q_r . k_j for the M rows and n <= kChunk keys of a chunk (qk16 per 16 keys
// and up to 4 rows; the lanes past n are written and unused). pa, pb: kChunk rows to prefetch
// meanwhile (na, nb bytes each; null entries skipped), 16 keys' rows before each 16 keys are scored
// (measured: faster than spreading them key by key or issuing the whole chunk's at once).
template <int Mode, typename KT>
inline void qk(const typename QOf<Mode>::type* q, int64_t ld, int64_t M, int64_t D, const KT* const* kr, int64_t n, float* s,
               const void* const* pa, int64_t na, const void* const* pb, int64_t nb) {
  for (int64_t j = 0; j < n; j += kLanes) {
    const int nk = static_cast<int>(std::min<int64_t>(kLanes, n - j));
    for (int u = 0; u < kLanes; ++u) {
      if (pa[j + u]) prefetch(pa[j + u], na);
      if (pb[j + u]) prefetch(pb[j + u], nb);
    }
    V16 out[4];
    int64_t r = 0;
    for (; r + 4 <= M; r += 4) {
      qk16<4, Mode>(q + r * ld, ld, D, kr + j, nk, out);
      for (int i = 0; i < 4; ++i) std::memcpy(s + (r + i) * kChunk + j, &out[i], sizeof(V16));
    }
    const int rest = static_cast<int>(M - r);
    if (rest == 3) qk16<3, Mode>(q + r * ld, ld, D, kr + j, nk, out);
    if (rest == 2) qk16<2, Mode>(q + r * ld, ld, D, kr + j, nk, out);
    if (rest == 1) qk16<1, Mode>(q + r * ld, ld, D, kr + j, nk, out);
    for (int i = 0; i < rest; ++i) std::memcpy(s + (r + i) * kChunk + j, &out[i], sizeof(V16));
  }
}

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }
inline float to_float(int8_t x) { return static_cast<float>(x); }

// o[r] += sum over the live keys (in order) of p[r][t] * v_t for R rows: W columns of the R rows
// held in registers while the keys stream through. Each output is one chain over the keys, in order.
// Masked: row r adds only the keys its bit set vis[r] holds (bit = key index in the chunk); a key it
// may not see is skipped, not multiplied by 0 (0 * NaN = NaN), and skipping it adds nothing to the
// chain, so the row's bits are those of the keys it sees, in order, whatever the other rows see.
template <int R, int W, bool Masked, typename KT>
inline void pv_cols(float* __restrict o, int64_t Dv, const float* __restrict p, const KT* const* vr,
                    const int64_t* live, int64_t nlive, int64_t c, const uint64_t* vis) {
  if constexpr (W % kLanes == 0) {
    constexpr int N = W / kLanes;
    V16 acc[R][N];
    for (int r = 0; r < R; ++r)
      for (int u = 0; u < N; ++u) acc[r][u] = load16(o + r * Dv + c + u * kLanes);
    for (int64_t t = 0; t < nlive; ++t) {
      const KT* v = vr[live[t]] + c;
      V16 vv[N];
      for (int u = 0; u < N; ++u) vv[u] = load16(v + u * kLanes);
      for (int r = 0; r < R; ++r) {
        if constexpr (Masked) {
          if (!((vis[r] >> live[t]) & 1)) continue;
        }
        const float pr = p[r * kChunk + live[t]];
        for (int u = 0; u < N; ++u) acc[r][u] += pr * vv[u];
      }
    }
    for (int r = 0; r < R; ++r)
      for (int u = 0; u < N; ++u) std::memcpy(o + r * Dv + c + u * kLanes, &acc[r][u], sizeof(V16));
  } else {
    for (int r = 0; r < R; ++r)
      for (int u = 0; u < W; ++u) {
        float a = o[r * Dv + c + u];
        for (int64_t t = 0; t < nlive; ++t) {
          if constexpr (Masked) {
            if (!((vis[r] >> live[t]) & 1)) continue;
          }
          a = std::fma(p[r * kChunk + live[t]], to_float(vr[live[t]][c + u]), a);
        }
        o[r * Dv + c + u] = a;
      }
  }
}

template <int R, bool Masked, typename KT>
inline void pv_rows(float* o, int64_t Dv, const float* p, const KT* const* vr, const int64_t* live, int64_t nlive,
                    const uint64_t* vis) {
  int64_t c = 0;
  for (; c + 4 * kLanes <= Dv; c += 4 * kLanes) pv_cols<R, 4 * kLanes, Masked>(o, Dv, p, vr, live, nlive, c, vis);
  for (; c + 2 * kLanes <= Dv; c += 2 * kLanes) pv_cols<R, 2 * kLanes, Masked>(o, Dv, p, vr, live, nlive, c, vis);
  for (; c + kLanes <= Dv; c += kLanes) pv_cols<R, kLanes, Masked>(o, Dv, p, vr, live, nlive, c, vis);
  for (; c < Dv; ++c) pv_cols<R, 1, Masked>(o, Dv, p, vr, live, nlive, c, vis);
}

template <bool Masked, typename KT>
inline void pv_all(float* o, int64_t M, int64_t Dv, const float* p, const KT* const* vr, const int64_t* live,
                   int64_t nlive, const uint64_t* vis) {
  int64_t r = 0;
  for (; r + 4 <= M; r += 4) pv_rows<4, Masked>(o + r * Dv, Dv, p + r * kChunk, vr, live, nlive, vis + r);
  switch (M - r) {
    case 3: pv_rows<3, Masked>(o + r * Dv, Dv, p + r * kChunk, vr, live, nlive, vis + r); break;
    case 2: pv_rows<2, Masked>(o + r * Dv, Dv, p + r * kChunk, vr, live, nlive, vis + r); break;
    case 1: pv_rows<1, Masked>(o + r * Dv, Dv, p + r * kChunk, vr, live, nlive, vis + r); break;
    default: break;
  }
}

// o += p v over the live keys (the keys some row sees). vis[r]: the keys row r sees; when every row
// sees every live key (one query, or rows that share the band) no row needs its own check.
template <typename KT>
inline void pv(float* o, int64_t M, int64_t Dv, const float* p, const KT* const* vr, const int64_t* live,
               int64_t nlive, const uint64_t* vis, bool uniform) {
  if (uniform) {
    pv_all<false>(o, M, Dv, p, vr, live, nlive, vis);
  } else {
    pv_all<true>(o, M, Dv, p, vr, live, nlive, vis);
  }
}

// x[i] += a * y[i]
inline void axpy(float* __restrict x, float a, const float* __restrict y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) x[i] = std::fma(a, y[i], x[i]);
}

inline void scale_row(float* x, float a, int64_t n) { attnkit::scale_row(x, n, a); }

// x[i] = exp(x[i] - shift) in place; returns the sum. The prefill kernel's exp and its fixed 16-lane
// summation order (tiles.h): the same bits on every ISA; exactly 0 for -inf scores.
inline float exp_row(float* x, int64_t n, float shift) { return attnkit::exp_row<float, float>(x, n, 1.f, shift, x); }

// Where key j of sequence b, K/V head hk lives: a dense (B, Hkv, S, D) tensor or a paged pool
// (Hkv, N, bs, D) through the block table (strides in elements; the last dim is contiguous).
struct Layout {
  int64_t s0, s1, s2;             // strides of the first three dims
  const int64_t* table = nullptr;  // (B, nb) block table, or null for dense
  int64_t table_stride = 0, bs = 1;
  // off[i]: where key j0 + i lives, for i < n (one division per call, not one per key)
  inline void offsets(int64_t b, int64_t hk, int64_t j0, int64_t n, int64_t* off) const {
    if (!table) {
      const int64_t base = b * s0 + hk * s1 + j0 * s2;
      for (int64_t i = 0; i < n; ++i) off[i] = base + i * s2;
      return;
    }
    const int64_t* row = table + b * table_stride;
    int64_t blk = j0 / bs, in = j0 % bs;
    for (int64_t i = 0; i < n; ++blk, in = 0) {  // block by block
      const int64_t base = hk * s0 + row[blk] * s1, m = std::min(bs - in, n - i);
      for (int64_t t = 0; t < m; ++t) off[i + t] = base + (in + t) * s2;
      i += m;
    }
  }
};

using attnkit::MaskSpec;
using attnkit::Strided4;

struct Problem {
  int64_t B, Hq, Hkv, G, Tq, D, Dv, M;  // M = G * Tq rows per K/V head
  int64_t kv_offset;
  float scale;
  const int64_t* rows;  // (B, 4): first key, end key (exclusive), split size, first query position
  Layout kl, vl, ksl, vsl;
  const float* q;  // (B, Hq, Tq, D) contiguous
  int qmode = 0;   // QMode: how q . k is computed
  MaskSpec mask;   // the kernel spec (spec.h): band bounds and a keep view
  attnkit::ScoreMods<float> mods;
};

// Prefetches the cache lines holding elements [j0, j0 + n) of a per-key float array (the int8
// scales), each line once; off: scratch for n offsets.
inline void prefetch_lines(const Layout& L, const float* base, int64_t b, int64_t hk, int64_t j0, int64_t n,
                           int64_t* off) {
  L.offsets(b, hk, j0, n, off);
  uintptr_t last = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uintptr_t line = reinterpret_cast<uintptr_t>(base + off[i]) >> 6;
    if (line != last) prefetch(base + off[i], 1), last = line;
  }
}

// n rounded up to a multiple of kLanes
inline int64_t padded(int64_t n) { return (n + kLanes - 1) / kLanes * kLanes; }

// One split: keys [j0, j1) of sequence b, K/V head hk; writes m, l (M) and o (M, Dv). vis: scratch
// for M bit sets (the keys of a chunk each row sees).
// The query rows (sequence b, K/V head hk) in the mode's buffer (q_stride(Mode, D) elements a row,
// zero past D), and rs[r]: what row r's products are multiplied by (kFloat: 1, q is scaled here;
// kBf16Dot: the scale; kInt8Dot: the scale times the row's quantization step max|q| / 127, NaN for
// a row holding NaN/Inf, which then scores NaN as IEEE arithmetic would make it).
template <int Mode>
void load_queries(const Problem& P, int64_t b, int64_t hk, typename QOf<Mode>::type* qb, float* rs) {
  const int64_t D = P.D, Tq = P.Tq, ld = q_stride(Mode, D);
  for (int64_t r = 0; r < P.M; ++r) {
    const int64_t g = r / Tq, i = r % Tq;
    const float* src = P.q + ((b * P.Hq + hk * P.G + g) * Tq + i) * D;
    auto* row = qb + r * ld;
    std::memset(static_cast<void*>(row), 0, ld * sizeof(*row));
    if constexpr (Mode == kFloat) {
      for (int64_t c = 0; c < D; ++c) row[c] = src[c] * P.scale;
      rs[r] = 1.f;
    } else if constexpr (Mode == kBf16Dot) {  // q holds bfloat16 values: its high half is exact
      for (int64_t c = 0; c < D; ++c) row[c] = static_cast<uint16_t>(__builtin_bit_cast(uint32_t, src[c]) >> 16);
      rs[r] = P.scale;
    } else {
      float amax = 0.f;
      bool finite = true;
      for (int64_t c = 0; c < D; ++c) finite &= std::isfinite(src[c]), amax = std::max(amax, std::fabs(src[c]));
      const float inv = 127.f / amax;
      if (!finite || !std::isfinite(inv)) {  // zeros: NaN times them (a NaN/Inf row), else scores 0 (a
        // row of zeros, or all below 4e-37: its exact scores round to no change of the softmax either)
        rs[r] = finite ? 0.f : std::numeric_limits<float>::quiet_NaN();
      } else {
        for (int64_t c = 0; c < D; ++c)
          row[c] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(src[c] * inv))));
        rs[r] = amax / 127.f * P.scale;
      }
      // vpdpbusd's corrections: lane u adds the bytes 4u..4u+3 of every 64; -128 times their sum
      int32_t corr[kLanes] = {};
      const int64_t Dp = ld - 64;
      for (int64_t c = 0; c < Dp; ++c) corr[(c % 64) / 4] -= 128 * row[c];
      std::memcpy(row + Dp, corr, sizeof corr);
    }
  }
}

// One split: keys [j0, j1) of sequence b, K/V head hk; writes m, l (M) and o (M, Dv). vis: scratch
// for M bit sets (the keys of a chunk each row sees); work: the scores and the query buffer.
template <typename KT, int Mode>
void split_partial(const Problem& P, const KT* kp, const KT* vp, const float* ksp, const float* vsp, int64_t b,
                   int64_t hk, int64_t j0, int64_t j1, float* m, float* l, float* o, float* work, uint64_t* vis) {
  using QT = typename QOf<Mode>::type;
  const int64_t M = P.M, D = P.D, Dv = P.Dv, Tq = P.Tq;
  const float ninf = -std::numeric_limits<float>::infinity();
  const int64_t ld = q_stride(Mode, D);
  float* s = work;                 // (M, kChunk) scores, then probabilities
  float* rs = s + M * kChunk;      // (M) the rows' product scales
  QT* qs = reinterpret_cast<QT*>(rs + padded(M));  // (M, ld) queries in the mode's type
  const KT* kr[kChunk];
  const KT* kn[kChunk];  // the next chunk's keys
  const KT* vr[kChunk];
  const void* pfk[kChunk];  // rows prefetched while a chunk is scored: the next chunk's keys
  const void* pfv[kChunk];  // and this chunk's values
  float kscale[kChunk], vscale[kChunk];
  int64_t live[kChunk], koff[kChunk], voff[kChunk], vsoff[kChunk];
  const int64_t qpos0 = P.rows[b * 4 + 3];
  load_queries<Mode>(P, b, hk, qs, rs);
  for (int64_t r = 0; r < M; ++r) m[r] = ninf, l[r] = 0.f;
  std::fill(o, o + M * Dv, 0.f);
  P.kl.offsets(b, hk, j0, std::min(kChunk, j1 - j0), koff);
  for (int64_t jj = 0; jj < std::min(kChunk, j1 - j0); ++jj) kn[jj] = kp + koff[jj];
  for (int64_t c0 = j0; c0 < j1; c0 += kChunk) {
    const int64_t n = std::min(kChunk, j1 - c0), n1 = std::max<int64_t>(0, std::min(kChunk, j1 - c0 - kChunk));
    std::copy(kn, kn + n, kr);
    P.kl.offsets(b, hk, c0 + kChunk, n1, koff);
    for (int64_t jj = 0; jj < n1; ++jj) kn[jj] = kp + koff[jj];
    P.vl.offsets(b, hk, c0, n, voff);
    for (int64_t jj = 0; jj < kChunk; ++jj) {
      pfk[jj] = jj < n1 ? kn[jj] : nullptr;
      pfv[jj] = jj < n ? vp + voff[jj] : nullptr;
    }
    // the next chunk's scales (a line per 16 keys, or per block of a paged pool)
    if (ksp) prefetch_lines(P.ksl, ksp, b, hk, c0 + kChunk, n1, koff);
    if (vsp) prefetch_lines(P.vsl, vsp, b, hk, c0 + kChunk, n1, koff);
    if (ksp) {
      P.ksl.offsets(b, hk, c0, n, koff);
      for (int64_t jj = 0; jj < n; ++jj) kscale[jj] = ksp[koff[jj]];
    }
    qk<Mode>(qs, ld, M, D, kr, n, s, pfk, D * int64_t(sizeof(KT)), pfv, Dv * int64_t(sizeof(KT)));
    for (int64_t r = 0; r < M; ++r) {
      const int64_t g = r / Tq, i = r % Tq, h = hk * P.G + g, qp = qpos0 + i;
      float* row = s + r * kChunk;
      if constexpr (Mode != kFloat) {
        for (int64_t jj = 0; jj < n; ++jj) row[jj] *= rs[r];
      }
      if (ksp) {
        for (int64_t jj = 0; jj < n; ++jj) row[jj] *= kscale[jj];
      }
      // bias and score modifiers: the prefill kernel's code (spec.h), so a soft-cap rounds alike
      if (P.mods.modifies()) attnkit::apply_score_mods<float>(P.mods, b, h, i, c0, qp, P.kv_offset + c0, 1, n, n, 0, row, nullptr);
      // keys kv_offset + c0 + jj kept for jj in [lo, hi) by the band (key lengths are in the span)
      int64_t lo, hi;
      P.mask.band_range(b, qp, P.kv_offset + c0, n, lo, hi);
      // A key the row may not see gets the score -inf (replaced, never added to: its score may be
      // NaN), and its bit in vis[r] stays clear, so its value is never read for this row.
      std::fill(row, row + lo, ninf);
      std::fill(row + hi, row + n, ninf);
      uint64_t seen = (hi == kChunk ? ~uint64_t(0) : (uint64_t(1) << hi) - 1) & ~((uint64_t(1) << lo) - 1);
      if (P.mask.keep) {
        for (int64_t jj = lo; jj < hi; ++jj)
          if (!P.mask.keep[P.mask.keep_st.at(b, h, i, c0 + jj)]) row[jj] = ninf, seen &= ~(uint64_t(1) << jj);
      }
      vis[r] = seen;
      // Lazy rescale: m[r] is the reference the row's exps are taken against, moved (and o, l
      // rescaled) only when a chunk's max passes it by more than kRescaleAbove; below that the
      // exps stay under e^kRescaleAbove, far from overflow. The result is the same softmax (o and l
      // share the reference), without a pass over o each time the max creeps up.
      const float mx = attnkit::row_max(row, n, ninf);
      if (mx > m[r] + kRescaleAbove) {  // also a row's first kept key (m = -inf); never for a NaN max
        const float alpha = std::exp(m[r] - mx);  // 0 while the row had nothing kept
        if (alpha != 1.f) scale_row(o + r * Dv, alpha, Dv);
        l[r] *= alpha;
        m[r] = mx;
      }
      // A row with nothing kept so far keeps -inf: shift by 0 so exp(-inf) = 0, not NaN.
      l[r] += exp_row(row, n, m[r] == ninf ? 0.f : m[r]);
    }
    // The values of the keys some row may see (a key no row sees is never read), then o += p v.
    // Every key a row sees is added, even at probability 0 (a score of -inf, or one that underflows):
    // a NaN/Inf value there makes the row's output what IEEE arithmetic gives.
    uint64_t kept = 0;
    for (int64_t r = 0; r < M; ++r) kept |= vis[r];
    if (kept == 0) continue;
    bool uniform = true;
    for (int64_t r = 0; r < M; ++r) uniform &= vis[r] == kept;
    int64_t nlive = 0;
    for (uint64_t bits = kept; bits; bits &= bits - 1) live[nlive++] = __builtin_ctzll(bits);
    if (vsp) P.vsl.offsets(b, hk, c0, n, vsoff);
    for (int64_t t = 0; t < nlive; ++t) {
      const int64_t jj = live[t];
      vr[jj] = vp + voff[jj];
      if (vsp) vscale[jj] = vsp[vsoff[jj]];
    }
    if (vsp && nlive == n) {
      for (int64_t r = 0; r < M; ++r)
        for (int64_t jj = 0; jj < n; ++jj) s[r * kChunk + jj] *= vscale[jj];
    } else if (vsp) {
      for (int64_t r = 0; r < M; ++r)
        for (int64_t t = 0; t < nlive; ++t) s[r * kChunk + live[t]] *= vscale[live[t]];
    }
    pv(o, M, Dv, s, vr, live, nlive, vis, uniform);
  }
}

// k, v (4-d) or their scales (3-d): strides of the first three dims; a paged pool adds the table.
Layout layout_of(const at::Tensor& x, const at::Tensor& table) {
  Layout L{};
  L.s0 = x.stride(0), L.s1 = x.stride(1), L.s2 = x.stride(2);
  if (table.numel()) L.table = table.data_ptr<int64_t>(), L.table_stride = table.stride(0), L.bs = x.size(2);
  return L;
}

// Merges the splits [t0, t1) of sequence b, K/V head hk into out and lse, in split order: each
// split's partial (m, l, o) weighted by exp(m - max), the query head's sink added to the mass.
void merge_splits(const Problem& P, int64_t b, int64_t hk, int64_t t0, int64_t t1, const float* part_m,
                  const float* part_l, const float* part_o, float* out, float* lse, const float* sinks) {
  const float ninf = -std::numeric_limits<float>::infinity();
  const int64_t Hkv = P.Hkv, M = P.M, Dv = P.Dv, Tq = P.Tq;
  for (int64_t r = 0; r < M; ++r) {
    const int64_t g = r / Tq, i = r % Tq, h = hk * P.G + g;
    float mx = sinks ? sinks[h] : ninf;
    for (int64_t t = t0; t < t1; ++t) mx = std::max(mx, part_m[(t * Hkv + hk) * M + r]);
    const float shift = mx == ninf ? 0.f : mx;
    float l = sinks ? std::exp(sinks[h] - shift) : 0.f;
    float* ob = out + ((b * P.Hq + h) * Tq + i) * Dv;
    std::fill(ob, ob + Dv, 0.f);
    for (int64_t t = t0; t < t1; ++t) {
      // A split where the row sees nothing (m = -inf, l = 0, o = 0) adds 0 * 0; one where every
      // key it sees scores -inf adds 0 * o, NaN where a value it sees is NaN/Inf (as IEEE gives).
      const int64_t at_ = (t * Hkv + hk) * M + r;
      const float wgt = std::exp(part_m[at_] - shift);
      l += part_l[at_] * wgt;
      axpy(ob, wgt, part_o + at_ * Dv, Dv);
    }
    const float inv = l == 0.f ? 0.f : 1.f / l;
    scale_row(ob, inv, Dv);
    lse[(b * P.Hq + h) * Tq + i] = l == 0.f ? ninf : shift + std::log(l);
  }
}

// A buffer of at least n elements kept by the calling thread between calls (a decode step runs
// this kernel once per layer: no allocation per call once the largest call has run).
template <typename T>
T* scratch(std::vector<T>& buffer, size_t n) {
  if (buffer.size() < n) buffer.resize(n);
  return buffer.data();
}

template <typename KT>
void run(const Problem& P, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_scale,
         const at::Tensor& v_scale, float* out, float* lse, const float* sinks) {
  const int64_t B = P.B, Hkv = P.Hkv, M = P.M, Dv = P.Dv;
  // The splits of every sequence, in order: (sequence, first key, end key). No padding.
  thread_local std::vector<int64_t> index;
  int64_t nsplit = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t lo = P.rows[b * 4], hi = P.rows[b * 4 + 1], split = P.rows[b * 4 + 2];
    nsplit += hi > lo ? (hi - lo + split - 1) / split : 0;
  }
  // sb, sj0, sj1 (nsplit each), first (B + 1), order (nsplit), remaining (B * Hkv)
  int64_t* sb = scratch(index, 4 * nsplit + B + 1 + B * Hkv);
  int64_t *sj0 = sb + nsplit, *sj1 = sj0 + nsplit, *order = sj1 + nsplit, *first = order + nsplit;
  int64_t* remaining = first + B + 1;
  for (int64_t b = 0, t = 0; b < B; ++b) {
    const int64_t lo = P.rows[b * 4], hi = P.rows[b * 4 + 1], split = P.rows[b * 4 + 2];
    first[b] = t;
    for (int64_t j = lo; j < hi; j += split, ++t) sb[t] = b, sj0[t] = j, sj1[t] = std::min(hi, j + split);
    for (int64_t hk = 0; hk < Hkv; ++hk) remaining[b * Hkv + hk] = t - first[b];
  }
  first[B] = nsplit;
  thread_local std::vector<float> partials;
  float* part_m = scratch(partials, nsplit * Hkv * M * (Dv + 2));
  float *part_l = part_m + nsplit * Hkv * M, *part_o = part_l + nsplit * Hkv * M;
  const KT* kp = k.data_ptr<KT>();
  const KT* vp = v.data_ptr<KT>();
  const float* ksp = k_scale.numel() ? k_scale.data_ptr<float>() : nullptr;
  const float* vsp = v_scale.numel() ? v_scale.data_ptr<float>() : nullptr;
  // A sequence that reads no key (an empty span) is merged here: output 0, LSE -inf (or its sinks').
  for (int64_t b = 0; b < B; ++b)
    if (first[b] == first[b + 1])
      for (int64_t hk = 0; hk < Hkv; ++hk) merge_splits(P, b, hk, 0, 0, part_m, part_l, part_o, out, lse, sinks);
  // Work items (split, head), longest split first, taken by the threads as they come free; the
  // thread that finishes a (sequence, head)'s last split merges its splits, in split order. Which
  // thread reduces a split or merges a head, and in what order the items finish, change no bit.
  for (int64_t t = 0; t < nsplit; ++t) order[t] = t;
  std::stable_sort(order, order + nsplit, [&](int64_t a, int64_t b) { return sj1[a] - sj0[a] > sj1[b] - sj0[b]; });
  const int64_t items = nsplit * Hkv;
  // Splits of one width (a batch of equal spans, one sequence) are dealt out in fixed contiguous
  // blocks, so a thread reads the same heads call after call (its own cache keeps them); others are
  // taken as threads come free.
  bool equal = true;
  for (int64_t t = 1; t < nsplit; ++t) equal &= sj1[t] - sj0[t] == sj1[0] - sj0[0];
  const int64_t slots = std::min<int64_t>(items, at::get_num_threads());
  std::atomic<int64_t> next{0};
  at::parallel_for(0, slots, 1, [&](int64_t begin, int64_t end) {
    const int64_t qbytes = M * q_stride(P.qmode, P.D) * (P.qmode == kFloat ? 4 : P.qmode == kBf16Dot ? 2 : 1);
    thread_local std::vector<float> work_buffer;
    thread_local std::vector<uint64_t> vis_buffer;
    float* work = scratch(work_buffer, M * kChunk + padded(M) + (qbytes + 3) / 4);
    uint64_t* vis = scratch(vis_buffer, M);
    auto item = [&](int64_t i) {
      const int64_t t = order[i / Hkv], hk = i % Hkv, w = t * Hkv + hk, b = sb[t];
      float *pm = part_m + w * M, *pl = part_l + w * M, *po = part_o + w * M * Dv;
      bool done = false;
      if constexpr (std::is_same_v<KT, c10::BFloat16>) {
        if (P.qmode == kBf16Dot) {
          split_partial<KT, kBf16Dot>(P, kp, vp, ksp, vsp, b, hk, sj0[t], sj1[t], pm, pl, po, work, vis);
          done = true;
        }
      }
      if constexpr (std::is_same_v<KT, int8_t>) {
        if (P.qmode == kInt8Dot) {
          split_partial<KT, kInt8Dot>(P, kp, vp, ksp, vsp, b, hk, sj0[t], sj1[t], pm, pl, po, work, vis);
          done = true;
        }
      }
      if (!done) split_partial<KT, kFloat>(P, kp, vp, ksp, vsp, b, hk, sj0[t], sj1[t], pm, pl, po, work, vis);
      // acquire-release: the thread that takes the count to 0 sees every other split's partial
      if (__atomic_sub_fetch(&remaining[b * Hkv + hk], 1, __ATOMIC_ACQ_REL) == 0)
        merge_splits(P, b, hk, first[b], first[b + 1], part_m, part_l, part_o, out, lse, sinks);
    };
    if (equal) {
      for (int64_t slot = begin; slot < end; ++slot)
        for (int64_t i = slot * items / slots; i < (slot + 1) * items / slots; ++i) item(i);
    } else {
      for (int64_t i = next++; i < items; i = next++) item(i);
    }
  });
}

// The first key in [lo, hi) that row p (keys at stride s) keeps, or hi; one past the last, or lo.
inline int64_t first_kept(const bool* p, int64_t s, int64_t lo, int64_t hi) {
  if (s == 1) {
    const void* f = lo < hi ? std::memchr(p + lo, 1, hi - lo) : nullptr;
    return f ? static_cast<const bool*>(f) - p : hi;
  }
  for (; lo < hi; ++lo)
    if (p[lo * s]) return lo;
  return hi;
}
inline int64_t end_kept(const bool* p, int64_t s, int64_t lo, int64_t hi) {
  if (s == 1) {
    const void* f = lo < hi ? memrchr(p + lo, 1, hi - lo) : nullptr;
    return f ? static_cast<const bool*>(f) - p + 1 : lo;
  }
  for (; hi > lo; --hi)
    if (p[(hi - 1) * s]) return hi;
  return lo;
}

// The keys each sequence's queries keep: spans (B, 2) holds each sequence's band range [lo, hi);
// returns it narrowed to the first and one past the last key that keep (a broadcast (B, Hq, Tq, Tk)
// bool view) keeps for some head and query (an empty range when none). A sequence's splits start
// at its range and are sized from its width, so the range must not depend on how the mask arrived
// (band bounds, or a keep tensor that holds the same band, as a ragged batch's per-row mask does).
at::Tensor decode_spans(const at::Tensor& keep, const at::Tensor& spans) {
  TORCH_CHECK(keep.scalar_type() == at::kBool && keep.dim() == 4, "decode_spans: keep must be a 4-d bool tensor");
  TORCH_CHECK(spans.scalar_type() == at::kLong && spans.is_contiguous() && spans.dim() == 2 &&
                  spans.size(0) == keep.size(0) && spans.size(1) == 2,
              "decode_spans: spans must be a contiguous int64 (B, 2) tensor");
  const Strided4 st = attnkit::strides4(keep);
  const bool* kp = keep.data_ptr<bool>();
  // distinct heads and queries only (a broadcast dim has stride 0)
  const int64_t B = keep.size(0), H = st.s1 ? keep.size(1) : 1, Tq = st.s2 ? keep.size(2) : 1, Tk = keep.size(3);
  auto out = spans.clone();
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t lo = std::max<int64_t>(o[2 * b], 0), hi = std::max(lo, std::min(o[2 * b + 1], Tk));
    int64_t first = hi, end;
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < Tq; ++i) first = first_kept(kp + st.at(b, h, i, 0), st.s3, lo, first);
    end = first;  // a key is kept at first, unless none is (first == hi: the range is empty)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < Tq; ++i) end = end_kept(kp + st.at(b, h, i, 0), st.s3, end, hi);
    o[2 * b] = first, o[2 * b + 1] = end;
  }
  return out;
}

// Whether this build and this CPU run bf16 dot products (compiled for AVX512_BF16, and the CPU has it:
// the build stamp declines a copy on another CPU, this checks again at no cost).
bool bf16_dot_available() {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  static const bool ok = __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw");
  return ok;
#else
  return false;
#endif
}

bool int8_vnni_available() {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  static const bool ok = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw");
  return ok;
#else
  return false;
#endif
}

// [bf16 dot products (AVX512_BF16), int8 dot products in hardware (AVX512_VNNI; without it the
// quantized-q path runs portable int32 vectors, with the same integers)], as 0/1.
std::vector<int64_t> dot_products() { return {bf16_dot_available(), int8_vnni_available()}; }

// cache: k_scale, v_scale (int8 K/V: per-token, per-head float32 scales; else empty), block_table
// (a paged pool: (B, nb) int64; else empty), rows ((B, 4) int64: first key, end key, split size, first
// query position per sequence). spec, ints, floats: the kernel spec (spec.h).
// qmode: QMode (kBf16Dot for bfloat16 K/V with bfloat16 queries where the CPU has AVX512_BF16,
// kInt8Dot for int8 K/V with a quantized q), else kFloat.
std::vector<at::Tensor> decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::TensorList cache,
                               at::TensorList spec, c10::IntArrayRef ints, c10::ArrayRef<double> floats,
                               int64_t qmode) {
  TORCH_CHECK(cache.size() == 4, "decode: cache holds k_scale, v_scale, block_table, rows");
  const at::Tensor &k_scale = cache[0], &v_scale = cache[1], &block_table = cache[2], &rows = cache[3];
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kFloat && q.is_contiguous() && q.dim() == 4,
              "decode: q must be a contiguous float32 CPU tensor (B, Hq, Tq, D)");
  const bool paged = block_table.numel() > 0;
  TORCH_CHECK(k.dim() == 4 && v.dim() == 4 && k.stride(3) == 1 && v.stride(3) == 1,
              "decode: k and v must be 4-d with a contiguous last dim");
  TORCH_CHECK(k.scalar_type() == v.scalar_type(), "decode: k and v must share a dtype");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.is_contiguous() && rows.size(0) == q.size(0) && rows.size(1) == 4,
              "decode: rows must be a contiguous int64 (B, 4) tensor");
  TORCH_CHECK(!paged || (block_table.scalar_type() == at::kLong && block_table.stride(1) == 1),
              "decode: block_table must be int64 with a contiguous last dim");
  TORCH_CHECK(k.scalar_type() != at::kChar || (k_scale.numel() && v_scale.numel()),
              "decode: int8 K/V need k_scale and v_scale");
  Problem P{};
  P.B = q.size(0), P.Hq = q.size(1), P.Tq = q.size(2), P.D = q.size(3);
  P.Hkv = paged ? k.size(0) : k.size(1);
  P.Dv = v.size(3);
  TORCH_CHECK(P.Hq % P.Hkv == 0, "decode: Hq must be a multiple of Hkv");
  P.G = P.Hq / P.Hkv, P.M = P.G * P.Tq;
  P.mask = attnkit::make_mask_spec(spec, ints);
  TORCH_CHECK(!P.mask.grid && !P.mask.lengths && !P.mask.valid && !P.mask.doc && !P.mask.layout,
              "decode: the mask arrives as band bounds and a keep view (key lengths in rows)");
  const int64_t Tk = spec[attnkit::KEEP].numel() ? spec[attnkit::KEEP].size(3)
                     : spec[attnkit::BIAS].numel() ? spec[attnkit::BIAS].size(3) : 0;
  P.mods = attnkit::make_mods<float>(spec, ints, floats, P.B, P.Hq, P.Tq, Tk);
  TORCH_CHECK(!P.mods.dist, "decode: ALiBi and relative biases arrive as slopes and values (not ADD vectors)");
  P.kv_offset = ints[attnkit::KV_OFFSET];
  P.scale = static_cast<float>(floats[attnkit::SCALE]);
  P.rows = rows.data_ptr<int64_t>();
  P.kl = layout_of(k, block_table), P.vl = layout_of(v, block_table);
  if (k_scale.numel()) {
    TORCH_CHECK(k_scale.scalar_type() == at::kFloat && v_scale.scalar_type() == at::kFloat, "decode: float32 scales");
    P.ksl = layout_of(k_scale, block_table), P.vsl = layout_of(v_scale, block_table);
  }
  P.q = q.data_ptr<float>();
  TORCH_CHECK(qmode == kFloat || (qmode == kBf16Dot && k.scalar_type() == at::kBFloat16 && bf16_dot_available()) ||
                  (qmode == kInt8Dot && k.scalar_type() == at::kChar),
              "decode: qmode ", qmode, " does not apply to ", k.scalar_type(), " K/V on this CPU");
  P.qmode = static_cast<int>(qmode);
  const float* sinkp = P.mods.sinks;
  auto out = at::empty({P.B, P.Hq, P.Tq, P.Dv}, q.options());
  auto lse = at::empty({P.B, P.Hq, P.Tq}, q.options());
  switch (k.scalar_type()) {
    case at::kFloat: run<float>(P, k, v, k_scale, v_scale, out.data_ptr<float>(), lse.data_ptr<float>(), sinkp); break;
    case at::kBFloat16:
      run<c10::BFloat16>(P, k, v, k_scale, v_scale, out.data_ptr<float>(), lse.data_ptr<float>(), sinkp);
      break;
    case at::kHalf: run<c10::Half>(P, k, v, k_scale, v_scale, out.data_ptr<float>(), lse.data_ptr<float>(), sinkp); break;
    case at::kChar: run<int8_t>(P, k, v, k_scale, v_scale, out.data_ptr<float>(), lse.data_ptr<float>(), sinkp); break;
    default: TORCH_CHECK(false, "decode: K/V dtype must be float32, bfloat16, float16 or int8, got ", k.scalar_type());
  }
  return {out, lse};
}

}  // namespace

// The decode family's own library and op namespace (attnkit_decode): it loads, or fails to build,
// independently of the prefill kernel's (attnkit_native).
TORCH_LIBRARY(attnkit_decode, m) {
  m.def("decode(Tensor q, Tensor k, Tensor v, Tensor[] cache, Tensor[] spec, int[] ints, float[] floats, int qmode) "
        "-> Tensor[]");
  m.def("dot_products() -> int[]");
  m.impl("dot_products", c10::DispatchKey::CatchAll, TORCH_FN(dot_products));
  m.impl("decode", c10::DispatchKey::CPU, TORCH_FN(decode));
  m.def("decode_spans(Tensor keep, Tensor spans) -> Tensor");
  m.impl("decode_spans", c10::DispatchKey::CPU, TORCH_FN(decode_spans));
}
