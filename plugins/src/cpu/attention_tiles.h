// Inner loops of the CPU paged attention: scores and value accumulation for a small
// group of query rows (up to kRowGroup) over a tile of keys spread over blocks.
// Templated on the row count NR and head dim D (0 = runtime) so that the compiler
// unrolls over rows: each K/V row is loaded once for all NR query rows, and the NR
// independent dot products hide each other's latency.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu/dtype_cpu.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace trtpaged::cpu {
inline namespace TRTPAGED_CPU_TARGET_NS {  // see dtype_cpu.h

constexpr int kRowGroup = 4;

// One SIMD register of floats (GCC/Clang vector extension): 16 lanes with AVX-512, else 8
// (AVX/AVX2, or two SSE/NEON registers). head_dim is a multiple of 16 on the CPU.
// kAccumulators: the fvec accumulators a loop may keep live and leave registers for its operands (32 AVX-512
// registers, 16 AVX ones, 16 SSE ones holding half an fvec each).
#if defined(__AVX512F__)
constexpr int kLanes = 16;
constexpr int kAccumulators = 24;
#elif defined(__AVX__)
constexpr int kLanes = 8;
constexpr int kAccumulators = 12;
#else
constexpr int kLanes = 8;
constexpr int kAccumulators = 6;
#endif
typedef float fvec __attribute__((vector_size(kLanes * sizeof(float))));
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));

inline fvec load_vec(const float* p) {
  fvec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store_vec(float* p, const fvec& v) { std::memcpy(p, &v, sizeof(v)); }

// Horizontal sum by halving. A plain `#pragma omp simd reduction` must keep the scalar
// order without -ffast-math and ends each dot product in a long chain of dependent adds.
inline float hsum(const fvec& v) {
#if defined(__AVX512F__)
  const f32x8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                  __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  const f32x8 a = v;
#endif
  const f32x4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  const f32x4 c = b + __builtin_shufflevector(b, b, 2, 3, 0, 1);
  return c[0] + c[1];
}

// Requests [p, p + bytes) into L2, every 64-byte line. Blocks hold one head's K (or V) in a chunk of
// block_size * head_dim values, so a sequence's keys are short runs that the hardware
// prefetcher, which stops at page boundaries, follows poorly (about 15% faster decode from
// DRAM here; prefetching into L1 instead gained nothing). One request per 128 bytes relied on
// Intel's adjacent-line prefetcher to fetch the other line; AMD cores have none, and the paged
// decode there was ~40% slower than the contiguous one until every line was requested. A volatile
// asm: a loop of __builtin_prefetch has no side effects and GCC may delete it.
inline void prefetch_bytes(const void* ptr, int64_t bytes) {
  const char* p = static_cast<const char*>(ptr);
  for (int64_t off = 0; off < bytes; off += 64) {
#if defined(__x86_64__) || defined(__i386__)
    asm volatile("prefetcht1 %0" : : "m"(p[off]));
#else
    __builtin_prefetch(p + off, 0, 3);
#endif
  }
}

// A span of bytes requested over `steps` steps of a loop, a share of whole lines a step.
struct Spread {
  const char* from = nullptr;
  int64_t bytes = 0, share = 0;
  Spread(const char* p, int64_t n, int64_t steps)
      : from(p), bytes(n), share(((n + 63) / 64 + steps - 1) / steps * 64) {}
  void step(int64_t i) const {
    const int64_t at = i * share;
    if (at < bytes) prefetch_bytes(from + at, std::min(share, bytes - at));
  }
};

// The next tile's K (or V) rows, requested a few at a time as the loops read this tile's rows of the
// same index: the next tile has this tile's geometry (runs of `run` rows behind one pointer), so the
// requests are spread evenly over the tile's work. (One request burst per run stalled the loop of the
// contiguous layout, whose run is the whole tile, once every line was requested: the core's miss
// buffers filled.)
struct NextBlocks {
  static constexpr int64_t kRows = 8;  // rows per request in the loops that go one row at a time
  const void* const* blocks = nullptr;
  int64_t rows = 0;  // rows of the next tile; 0: nothing to request
  int64_t run = 0;
  int64_t row_bytes = 0;
  bool spread = false;  // the scores loop spreads a group's requests over its steps (calls from memory)

  // Rows [i, i + count) of the next tile's run b (those that exist) as a span of bytes; bytes 0: nothing to
  // request.
  const char* span(int64_t b, int64_t i, int64_t count, int64_t* bytes) const {
    const int64_t left = rows - b * run - i;
    *bytes = left <= 0 ? 0 : std::min({count, left, run - i}) * row_bytes;
    return *bytes ? static_cast<const char*>(blocks[b]) + i * row_bytes : nullptr;
  }
  // Requests those rows at once (a loop that spreads them over its steps uses Spread).
  void prefetch(int64_t b, int64_t i, int64_t count) const {
    int64_t bytes = 0;
    const char* from = span(b, i, count, &bytes);
    prefetch_bytes(from, bytes);
  }
  // For loops over the rows i of run b one by one: every kRows-th row requests the next kRows.
  void prefetch_row(int64_t b, int64_t i) const {
    if (i % kRows == 0) prefetch(b, i, kRows);
  }
  // Rows [j, rows) at once: those beyond the rows this tile's loops read.
  void prefetch_from(int64_t j) const {
    for (int64_t b = j / run; b * run < rows; ++b) {
      const int64_t i = std::max<int64_t>(0, j - b * run);
      prefetch(b, i, run - i);
    }
  }
};

// scores[r * stride + j] = q_r . k_j for j < n, keys j in blocks of bs rows at kp[j / bs].
template <int D, int NR>
void tile_scores(const float* q, int64_t d_runtime, const float* const* kp, int64_t bs, int64_t n, float* scores,
                 int64_t stride, const NextBlocks& next) {
  if constexpr (D > 0) {
    constexpr int kVecs = D / kLanes;
    fvec qv[NR][kVecs];  // held in registers: stores to scores could alias q otherwise
    for (int r = 0; r < NR; ++r)
      for (int i = 0; i < kVecs; ++i) qv[r][i] = load_vec(q + r * D + i * kLanes);
    for (int64_t b = 0, j = 0; j < n; ++b) {
      const float* k = kp[b];
      for (const int64_t start = j, end = std::min(n, j + bs); j < end; ++j, k += D) {
        next.prefetch_row(b, j - start);
        fvec part[NR] = {};
        for (int i = 0; i < kVecs; ++i) {
          const fvec kv = load_vec(k + i * kLanes);
          for (int r = 0; r < NR; ++r) part[r] += qv[r][i] * kv;
        }
        for (int r = 0; r < NR; ++r) scores[r * stride + j] = hsum(part[r]);
      }
    }
  } else {
    const int64_t d = d_runtime;
    for (int64_t b = 0, j = 0; j < n; ++b) {
      const float* k = kp[b];
      for (const int64_t start = j, end = std::min(n, j + bs); j < end; ++j, k += d) {
        next.prefetch_row(b, j - start);
        fvec part[NR] = {};
        for (int64_t i = 0; i < d; i += kLanes) {
          const fvec kv = load_vec(k + i);
          for (int r = 0; r < NR; ++r) part[r] += load_vec(q + r * d + i) * kv;
        }
        for (int r = 0; r < NR; ++r) scores[r * stride + j] = hsum(part[r]);
      }
    }
  }
}

// acc[r] += sum_j weights[r * stride + j] * v_j for j < n. With D known, the NR x D
// accumulators stay in registers for the whole tile (no store/reload chain per key).
template <int D, int NR>
void tile_accumulate(const float* weights, int64_t stride, const float* const* vp, int64_t bs, int64_t n,
                     float* acc, int64_t d_runtime, const NextBlocks& next) {
  if constexpr (D > 0) {
    constexpr int kVecs = D / kLanes;
    fvec a[NR][kVecs];
    for (int r = 0; r < NR; ++r)
      for (int i = 0; i < kVecs; ++i) a[r][i] = load_vec(acc + r * D + i * kLanes);
    for (int64_t b = 0, j = 0; j < n; ++b) {
      const float* v = vp[b];
      for (const int64_t start = j, end = std::min(n, j + bs); j < end; ++j, v += D) {
        next.prefetch_row(b, j - start);
        for (int i = 0; i < kVecs; ++i) {
          const fvec vv = load_vec(v + i * kLanes);
          for (int r = 0; r < NR; ++r) a[r][i] += weights[r * stride + j] * vv;
        }
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int i = 0; i < kVecs; ++i) store_vec(acc + r * D + i * kLanes, a[r][i]);
  } else {
    const int64_t d = d_runtime;
    for (int64_t b = 0, j = 0; j < n; ++b) {
      const float* v = vp[b];
      for (const int64_t start = j, end = std::min(n, j + bs); j < end; ++j, v += d) {
        next.prefetch_row(b, j - start);
        for (int r = 0; r < NR; ++r) {
          const float w = weights[r * stride + j];
          float* a = acc + r * d;
#pragma omp simd
          for (int64_t i = 0; i < d; ++i) a[i] += w * v[i];
        }
      }
    }
  }
}

typedef int32_t ivec __attribute__((vector_size(kLanes * sizeof(int32_t))));
typedef uint32_t uvec __attribute__((vector_size(kLanes * sizeof(uint32_t))));

// exp(x) for x <= 0, kLanes at a time: x = n ln2 + r (Cody-Waite), exp(r) by a degree-6
// polynomial, 2^n from the exponent bits; relative error below 2e-7, and x below -87 gives ~1e-38
// rather than 0. The scalar loop did not vectorize (a libm floor per element) and was 60% of the
// kernel's own time at decode.
inline fvec exp_nonpositive_vec(fvec x) {
  x = x < -87.0f ? fvec{} - 87.0f : x;
  const fvec t = x * 1.44269504f + 12582912.0f;  // round to nearest (1.5 * 2^23): n in t's low bits
  const fvec n = t - 12582912.0f;
  const fvec r = (x - n * 0.693145752f) - n * 1.42860677e-6f;
  fvec poly = fvec{} + 1.0f / 720.0f;
  poly = poly * r + 1.0f / 120.0f;
  poly = poly * r + 1.0f / 24.0f;
  poly = poly * r + 1.0f / 6.0f;
  poly = poly * r + 0.5f;
  poly = poly * r + 1.0f;
  poly = poly * r + 1.0f;
  // 2^n from t's bits as unsigned integers: no float-to-int conversion, which is undefined for a NaN
  // (a NaN still comes out, through poly)
  uvec bits;
  std::memcpy(&bits, &t, sizeof(bits));
  bits = (bits - 0x4B400000u + 127u) << 23;
  fvec scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return poly * scale;
}

// row[j] = exp(row[j] - m) for first <= j < limit and 0 elsewhere in [0, n) (limit <= n); returns their sum.
inline float exp_shifted_row(float* row, int64_t first, int64_t limit, int64_t n, float m) {
  fvec total{};
  ivec lane;
  for (int l = 0; l < kLanes; ++l) lane[l] = l;
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const fvec e = exp_nonpositive_vec(load_vec(row + j) - m);
    const ivec idx = lane + int32_t(j);
    const fvec kept = (idx < int32_t(limit)) & (idx >= int32_t(first)) ? e : fvec{};
    store_vec(row + j, kept);
    total += kept;
  }
  if (j < n) {  // the tail, through a padded copy
    alignas(64) float tail[kLanes] = {};
    std::memcpy(tail, row + j, size_t(n - j) * sizeof(float));
    const fvec e = exp_nonpositive_vec(load_vec(tail) - m);
    const ivec idx = lane + int32_t(j);
    const fvec kept = (idx < int32_t(limit)) & (idx >= int32_t(first)) ? e : fvec{};
    store_vec(tail, kept);
    std::memcpy(row + j, tail, size_t(n - j) * sizeof(float));
    total += kept;
  }
  return hsum(total);
}

// max(x[0..n)), kLanes at a time (a scalar running max is a chain of dependent maxes).
inline float max_of(const float* x, int64_t n) {
  float m = -__builtin_inff();
  int64_t j = 0;
  if (n >= kLanes) {
    fvec v = load_vec(x);
    for (j = kLanes; j + kLanes <= n; j += kLanes) {
      const fvec y = load_vec(x + j);
      v = v > y ? v : y;
    }
    for (int l = 0; l < kLanes; ++l) m = std::max(m, v[l]);
  }
  for (; j < n; ++j) m = std::max(m, x[j]);
  return m;
}

// int8 (and fp8) KV rows (D codes, then an fp16 scale) read directly, the de-quantization fused into the
// loops: a key's codes are widened to floats in registers, its dot products are scaled once
// (score = scale * sum q * code) and its weight is scaled once (acc += (w * scale) * code). This
// reads a quarter of fp32's bytes with no pass through a scratch buffer.
// GCC lowers __builtin_convertvector from int8 to one scalar conversion per lane, so the widening
// is spelled with intrinsics (sign-extend to int32, then convert: two instructions per vector).
// (GCC 12 warns that the intrinsics' own undefined-vector helpers may be used uninitialized.)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
inline fvec load_codes(const int8_t* p) {
#if defined(__AVX512F__)
  const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
  const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#endif
#if defined(__AVX512F__) || defined(__AVX2__)
  fvec v;
  std::memcpy(&v, &f, sizeof(v));
  return v;
#else
  fvec v;
  for (int i = 0; i < kLanes; ++i) v[i] = float(p[i]);
  return v;
#endif
}

// fp8 e4m3 codes widened through fp16: moving the 7 magnitude bits up by 7 gives an fp16 whose
// value is the e4m3 value / 256 (exponent bias 15 vs 7), subnormals included; the 256 is folded
// into the row's scale. Needs F16C (AVX2 machines) or AVX-512; elsewhere fp8 takes the table path.
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__F16C__))
constexpr bool kFusedFp8 = true;
inline fvec load_fp8_codes(const int8_t* p) {
#if defined(__AVX512F__)
  const __m256i x = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(x, _mm256_set1_epi16(0x80)), 8),
                                    _mm256_slli_epi16(_mm256_and_si256(x, _mm256_set1_epi16(0x7f)), 7));
  const __m512 f = _mm512_cvtph_ps(h);
#else
  const __m128i x = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(x, _mm_set1_epi16(0x80)), 8),
                                 _mm_slli_epi16(_mm_and_si128(x, _mm_set1_epi16(0x7f)), 7));
  const __m256 f = _mm256_cvtph_ps(h);
#endif
  fvec v;
  std::memcpy(&v, &f, sizeof(v));
  return v;
}
#else
constexpr bool kFusedFp8 = false;
inline fvec load_fp8_codes(const int8_t*) { return fvec{}; }  // never called
#endif
#pragma GCC diagnostic pop

inline float row_scale(const int8_t* row, int64_t value_bytes) {
  half_t s;
  std::memcpy(&s, row + value_bytes, sizeof(s));
  return to_float(s);
}

// How the fused loops read a cached row: D values converted to floats in registers, times a
// per-row factor (the stored fp16 scale for int8/fp8 rows; none for fp16/bf16 rows).
struct Int8Rows {
  static constexpr bool kScaled = true;
  static constexpr float kCodeScale = 1.0f;
  static constexpr int64_t kExtraBytes = sizeof(half_t);
  static fvec load(const uint8_t* p) { return load_codes(reinterpret_cast<const int8_t*>(p)); }
};
struct Fp8Rows {
  static constexpr bool kScaled = true;
  static constexpr float kCodeScale = 256.0f;  // see load_fp8_codes
  static constexpr int64_t kExtraBytes = sizeof(half_t);
  static fvec load(const uint8_t* p) { return load_fp8_codes(reinterpret_cast<const int8_t*>(p)); }
};

struct FloatRows {
  static constexpr bool kScaled = false;
  static constexpr float kCodeScale = 1.0f;
  static constexpr int64_t kExtraBytes = 0;
  static fvec load(const uint8_t* p) { return load_vec(reinterpret_cast<const float*>(p)); }
};

// fp16 and bf16 rows widened in registers (vcvtph2ps; bf16 is the top half of a float), so a
// 16-bit cache reads half of fp32's bytes with no pass through a scratch buffer.
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__F16C__))
constexpr bool kFused16 = true;
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
struct HalfRows {
  static constexpr bool kScaled = false;
  static constexpr float kCodeScale = 1.0f;
  static constexpr int64_t kExtraBytes = 0;
  static fvec load(const uint8_t* p) {
#if defined(__AVX512F__)
    const __m512 f = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#else
    const __m256 f = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#endif
    fvec v;
    std::memcpy(&v, &f, sizeof(v));
    return v;
  }
};
struct BfloatRows {
  static constexpr bool kScaled = false;
  static constexpr float kCodeScale = 1.0f;
  static constexpr int64_t kExtraBytes = 0;
  static fvec load(const uint8_t* p) {
#if defined(__AVX512F__)
    const __m512i f = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
#else
    const __m256i f = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16);
#endif
    fvec v;
    std::memcpy(&v, &f, sizeof(v));
    return v;
  }
};
#pragma GCC diagnostic pop
#else
constexpr bool kFused16 = false;
struct HalfRows : Int8Rows {};    // never used: kFused16 is false
struct BfloatRows : Int8Rows {};  // never used: kFused16 is false
#endif

// Row bytes of D values of `Elem` bytes each, plus the codec's trailing scale.
template <class Codec, int D, int Elem>
constexpr int64_t kRowBytes = int64_t(D) * Elem + Codec::kExtraBytes;

template <class Codec>
inline float row_factor(const uint8_t* row, int64_t value_bytes) {
  if constexpr (Codec::kScaled)
    return row_scale(reinterpret_cast<const int8_t*>(row), value_bytes) * Codec::kCodeScale;
  else
    return 1.0f;
}

// p[j] holds the kLanes partial products of key j's dot product (j < kLanes); returns the vector
// whose lane j is their sum. A transpose-and-add tree: log2(kLanes) levels of two-source shuffles,
// 3 * (kLanes - 1) vector ops for kLanes sums instead of a horizontal sum (~9 ops) per key.
inline fvec sum_lanes_transposed(const fvec* p) {
#if defined(__AVX512F__)
  fvec a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = __builtin_shufflevector(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(p[2 * i], p[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(c[0], c[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(c[0], c[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#else
  fvec a[4], b[2];
  for (int i = 0; i < 4; ++i)
    a[i] = __builtin_shufflevector(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(p[2 * i], p[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  for (int i = 0; i < 2; ++i)
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  return __builtin_shufflevector(b[0], b[1], 0, 2, 4, 6, 8, 10, 12, 14) +
         __builtin_shufflevector(b[0], b[1], 1, 3, 5, 7, 9, 11, 13, 15);
#endif
}

// scores[r * stride + j] = q_r . k_j (times the row's factor) for j < n. Keys come kLanes at a time
// (one vector of scores per query row through sum_lanes_transposed), the rest of a block one by one.
template <int D, int NR, class Codec, int Elem, bool kSpread>
void tile_scores_fused(const float* q, const uint8_t* const* kp, int64_t bs, int64_t n, float* scores, int64_t stride,
                       const NextBlocks& next) {
  constexpr int kVecs = D / kLanes;
  constexpr int64_t kRow = kRowBytes<Codec, D, Elem>;
  for (int64_t b = 0, j = 0; j < n; ++b) {
    const uint8_t* k = kp[b];
    const int64_t start = j, end = std::min(n, j + bs);
    // A converted (non-fp32) group of keys is staged as floats once, rather than converted again for every
    // row. Also with one row: the loop that converted inside the products rounded some scores differently
    // from the staged one, so a query row alone in its group (MHA, or the last of a GQA head's rows) scored
    // otherwise than inside a group of rows (greedy outputs changed with speculation on).
    constexpr bool kStage = !std::is_same_v<Codec, FloatRows>;
    alignas(64) float staged[kStage ? kLanes * D : 1];
    for (; j + kLanes <= end; j += kLanes, k += kLanes * kRow) {
      // Calls from memory spread the group's requests over its steps (a row's products with a key): a burst of
      // them (a whole block with AVX-512) fills the miss buffers and stalls the loop until lines arrive. Calls
      // from the cache request them at once: there the spread's steps cost more than they save.
      int64_t span_bytes = 0;
      const char* span = kSpread ? next.span(b, j - start, kLanes, &span_bytes) : nullptr;
      const Spread requests(span, span_bytes, NR * kLanes);
      if constexpr (!kSpread) next.prefetch(b, j - start, kLanes);
      fvec factor = fvec{} + 1.0f;
      if constexpr (Codec::kScaled)
        for (int l = 0; l < kLanes; ++l) factor[l] = row_factor<Codec>(k + l * kRow, D * Elem);
      if constexpr (kStage)
        for (int l = 0; l < kLanes; ++l)
          for (int i = 0; i < kVecs; ++i)
            store_vec(staged + l * D + i * kLanes, Codec::load(k + l * kRow + i * kLanes * Elem));
      auto key_vec = [&](int l, int i) {
        if constexpr (kStage)
          return load_vec(staged + l * D + i * kLanes);
        else
          return Codec::load(k + l * kRow + i * kLanes * Elem);
      };
      for (int r = 0; r < NR; ++r) {
        // Read the staged keys from memory in every row's products: otherwise GCC hoists their 64 loads out of
        // the row loop and spills them to a second stack copy (a load and a store per vector and group),
        // which made the loop store-bound (fp16 KV: 1.1-1.4x slower decode attention, same results).
        if constexpr (kStage && D == 64) asm volatile("" : : : "memory");  // head_dim 128: measured no gain
        const float* qr = q + r * D;
        fvec part[kLanes];
        for (int l = 0; l < kLanes; ++l) {
          if constexpr (kSpread) requests.step(r * kLanes + l);
          fvec sum = load_vec(qr) * key_vec(l, 0);
          for (int i = 1; i < kVecs; ++i) sum += load_vec(qr + i * kLanes) * key_vec(l, i);
          part[l] = sum;
        }
        fvec row = sum_lanes_transposed(part);
        if constexpr (Codec::kScaled) row *= factor;
        store_vec(scores + r * stride + j, row);
      }
    }
    if (j < end) {
      // The block's last keys, fewer than kLanes: one group padded with zero keys, summed as above. A key's
      // score then does not depend on n, which is the longest visible range of the rows that share the
      // call: a key that ends one row's range alone can sit inside a full group when a later query row of
      // the same sequence (a speculative verification step) runs with it, and the per-key sum rounded
      // differently there (greedy outputs changed with speculation on).
      const int64_t left = end - j;
      next.prefetch(b, j - start, left);
      alignas(64) float padded[kLanes * D];
      fvec factor = fvec{} + 1.0f;
      for (int l = 0; l < kLanes; ++l)
        for (int i = 0; i < kVecs; ++i)
          store_vec(padded + l * D + i * kLanes, l < left ? Codec::load(k + l * kRow + i * kLanes * Elem) : fvec{});
      if constexpr (Codec::kScaled)
        for (int l = 0; l < left; ++l) factor[l] = row_factor<Codec>(k + l * kRow, D * Elem);
      for (int r = 0; r < NR; ++r) {
        const float* qr = q + r * D;
        fvec part[kLanes];
        for (int l = 0; l < kLanes; ++l) {
          fvec sum = load_vec(qr) * load_vec(padded + l * D);
          for (int i = 1; i < kVecs; ++i) sum += load_vec(qr + i * kLanes) * load_vec(padded + l * D + i * kLanes);
          part[l] = sum;
        }
        fvec row = sum_lanes_transposed(part);
        if constexpr (Codec::kScaled) row *= factor;
        std::memcpy(scores + r * stride + j, &row, size_t(left) * sizeof(float));
      }
      j = end;
    }
  }
}

// The accumulators of NR rows over a pass's kSlice vectors of each value row stay in registers: rows whose
// NR * kVecs accumulators would not fit (AVX2 has 16 vector registers) take the head's vectors in slices,
// one pass over the tile's value rows per slice. Each accumulator sums the same products in the same order
// either way.
template <int NR, int kVecs>
constexpr int accumulate_slice() {
  int slice = kVecs;
  while (slice > 1 && (NR * slice > kAccumulators || kVecs % slice != 0)) --slice;
  // One row, or more than 4 passes (AVX2, head_dim 128, 4 rows: 8 passes of 2 vectors), measured slower than
  // one spilling pass: each pass reloads the rows' weights for few products.
  return NR == 1 || kVecs / slice > 4 ? kVecs : slice;
}

template <int D, int NR, class Codec, int Elem>
void tile_accumulate_fused(const float* weights, int64_t stride, const uint8_t* const* vp, int64_t bs, int64_t n,
                           float* acc, const NextBlocks& next) {
  constexpr int kVecs = D / kLanes;
  constexpr int kSlice = accumulate_slice<NR, kVecs>();
  constexpr int64_t kRow = kRowBytes<Codec, D, Elem>;
  for (int s = 0; s < kVecs; s += kSlice) {
    fvec a[NR][kSlice];
    for (int r = 0; r < NR; ++r)
      for (int i = 0; i < kSlice; ++i) a[r][i] = load_vec(acc + r * D + (s + i) * kLanes);
    for (int64_t b = 0, j = 0; j < n; ++b) {
      const uint8_t* v = vp[b];
      for (const int64_t start = j, end = std::min(n, j + bs); j < end; ++j, v += kRow) {
        // the next tile's requests spread over the passes (a burst of them fills the miss buffers)
        if ((j - start) / NextBlocks::kRows % (kVecs / kSlice) == s / kSlice) next.prefetch_row(b, j - start);
        const float factor = row_factor<Codec>(v, D * Elem);
        float w[NR];
        for (int r = 0; r < NR; ++r) w[r] = weights[r * stride + j] * factor;
        for (int i = 0; i < kSlice; ++i) {
          const fvec vv = Codec::load(v + (s + i) * kLanes * Elem);
          for (int r = 0; r < NR; ++r) a[r][i] += w[r] * vv;
        }
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int i = 0; i < kSlice; ++i) store_vec(acc + r * D + (s + i) * kLanes, a[r][i]);
  }
}

template <int D, class Codec, int Elem>
void scores_fused_rows(int nr, const float* q, const uint8_t* const* kp, int64_t bs, int64_t n, float* scores,
                       int64_t stride, const NextBlocks& next) {
  auto rows = [&](auto spread) {
    switch (nr) {
      case 1: return tile_scores_fused<D, 1, Codec, Elem, spread>(q, kp, bs, n, scores, stride, next);
      case 2: return tile_scores_fused<D, 2, Codec, Elem, spread>(q, kp, bs, n, scores, stride, next);
      case 3: return tile_scores_fused<D, 3, Codec, Elem, spread>(q, kp, bs, n, scores, stride, next);
      default: return tile_scores_fused<D, 4, Codec, Elem, spread>(q, kp, bs, n, scores, stride, next);
    }
  };
  return next.spread ? rows(std::true_type{}) : rows(std::false_type{});
}

template <int D, class Codec, int Elem>
void accumulate_fused_rows(int nr, const float* weights, int64_t stride, const uint8_t* const* vp, int64_t bs,
                           int64_t n, float* acc, const NextBlocks& next) {
  switch (nr) {
    case 1: return tile_accumulate_fused<D, 1, Codec, Elem>(weights, stride, vp, bs, n, acc, next);
    case 2: return tile_accumulate_fused<D, 2, Codec, Elem>(weights, stride, vp, bs, n, acc, next);
    case 3: return tile_accumulate_fused<D, 3, Codec, Elem>(weights, stride, vp, bs, n, acc, next);
    default: return tile_accumulate_fused<D, 4, Codec, Elem>(weights, stride, vp, bs, n, acc, next);
  }
}

// Head dims the fused loops cover; others convert a tile into fp32 scratch first.
inline bool fused_head_dim(int64_t d) { return d == 64 || d == 128; }

template <class Codec, int Elem>
inline void scores_fused_for(int nr, const float* q, int64_t d, const uint8_t* const* kp, int64_t bs, int64_t n,
                             float* scores, int64_t stride, const NextBlocks& next) {
  if (d == 64) return scores_fused_rows<64, Codec, Elem>(nr, q, kp, bs, n, scores, stride, next);
  return scores_fused_rows<128, Codec, Elem>(nr, q, kp, bs, n, scores, stride, next);
}

template <class Codec, int Elem>
inline void accumulate_fused_for(int nr, const float* weights, int64_t stride, const uint8_t* const* vp, int64_t bs,
                                 int64_t n, float* acc, int64_t d, const NextBlocks& next) {
  if (d == 64) return accumulate_fused_rows<64, Codec, Elem>(nr, weights, stride, vp, bs, n, acc, next);
  return accumulate_fused_rows<128, Codec, Elem>(nr, weights, stride, vp, bs, n, acc, next);
}

// Runtime row count → template instantiation.
template <int D>
void tile_scores_rows(int nr, const float* q, int64_t d, const float* const* kp, int64_t bs, int64_t n,
                      float* scores, int64_t stride, const NextBlocks& next) {
  switch (nr) {
    case 1: return tile_scores<D, 1>(q, d, kp, bs, n, scores, stride, next);
    case 2: return tile_scores<D, 2>(q, d, kp, bs, n, scores, stride, next);
    case 3: return tile_scores<D, 3>(q, d, kp, bs, n, scores, stride, next);
    default: return tile_scores<D, 4>(q, d, kp, bs, n, scores, stride, next);
  }
}

template <int D>
void tile_accumulate_rows(int nr, const float* weights, int64_t stride, const float* const* vp, int64_t bs,
                          int64_t n, float* acc, int64_t d, const NextBlocks& next) {
  switch (nr) {
    case 1: return tile_accumulate<D, 1>(weights, stride, vp, bs, n, acc, d, next);
    case 2: return tile_accumulate<D, 2>(weights, stride, vp, bs, n, acc, d, next);
    case 3: return tile_accumulate<D, 3>(weights, stride, vp, bs, n, acc, d, next);
    default: return tile_accumulate<D, 4>(weights, stride, vp, bs, n, acc, d, next);
  }
}

// Head dims with specialised (fully unrolled) inner loops; others use the runtime-d version.
inline void scores_for(int nr, const float* q, int64_t d, const float* const* kp, int64_t bs, int64_t n,
                       float* scores, int64_t stride, const NextBlocks& next) {
  switch (d) {
    case 64: return tile_scores_rows<64>(nr, q, d, kp, bs, n, scores, stride, next);
    case 128: return tile_scores_rows<128>(nr, q, d, kp, bs, n, scores, stride, next);
    default: return tile_scores_rows<0>(nr, q, d, kp, bs, n, scores, stride, next);
  }
}

inline void accumulate_for(int nr, const float* weights, int64_t stride, const float* const* vp, int64_t bs,
                           int64_t n, float* acc, int64_t d, const NextBlocks& next) {
  switch (d) {
    case 64: return tile_accumulate_rows<64>(nr, weights, stride, vp, bs, n, acc, d, next);
    case 128: return tile_accumulate_rows<128>(nr, weights, stride, vp, bs, n, acc, d, next);
    default: return tile_accumulate_rows<0>(nr, weights, stride, vp, bs, n, acc, d, next);
  }
}

}  // namespace TRTPAGED_CPU_TARGET_NS
}  // namespace trtpaged::cpu
