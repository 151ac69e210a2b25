// Inner loops of the CPU paged attention: scores and value accumulation for a small
// group of query rows (up to kRowGroup) over a tile of keys spread over blocks.
// Templated on the row count NR and head dim D (0 = runtime) so that the compiler
// unrolls over rows: each K/V row is loaded once for all NR query rows, and the NR
// independent dot products hide each other's latency.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu/dtype_cpu.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace trtpaged::cpu {

constexpr int kRowGroup = 4;

// One SIMD register of floats (GCC/Clang vector extension): 16 lanes with AVX-512, else 8
// (AVX/AVX2, or two SSE/NEON registers). head_dim is a multiple of 16 on the CPU.
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
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

// Requests [p, p + bytes) into L2. Blocks hold one head's K (or V) in a chunk of
// block_size * head_dim values, so a sequence's keys are short runs that the hardware
// prefetcher, which stops at page boundaries, follows poorly (about 15% faster decode from
// DRAM here; prefetching into L1 instead gained nothing). A volatile asm: a loop of
// __builtin_prefetch has no side effects and GCC may delete it.
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

// The blocks of the next tile, prefetched one per block of this tile from the outer loops.
struct NextBlocks {
  const void* const* blocks = nullptr;  // count entries
  int64_t count = 0;
  int64_t bytes = 0;  // per block

  void prefetch(int64_t b) const {
    if (b < count) prefetch_bytes(blocks[b], bytes);
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
      next.prefetch(b);
      const float* k = kp[b];
      for (const int64_t end = std::min(n, j + bs); j < end; ++j, k += D) {
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
      next.prefetch(b);
      const float* k = kp[b];
      for (const int64_t end = std::min(n, j + bs); j < end; ++j, k += d) {
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
      next.prefetch(b);
      const float* v = vp[b];
      for (const int64_t end = std::min(n, j + bs); j < end; ++j, v += D) {
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
      next.prefetch(b);
      const float* v = vp[b];
      for (const int64_t end = std::min(n, j + bs); j < end; ++j, v += d) {
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

// Codes of one vector, and the factor the row's stored scale takes, for int8 or fp8 rows.
template <bool kFp8>
inline fvec load_row_codes(const int8_t* p) {
  if constexpr (kFp8)
    return load_fp8_codes(p);
  else
    return load_codes(p);
}
template <bool kFp8>
constexpr float kCodeScale = kFp8 ? 256.0f : 1.0f;

inline float row_scale(const int8_t* row, int64_t d) {
  half_t s;
  std::memcpy(&s, row + d, sizeof(s));
  return to_float(s);
}

template <int D, int NR, bool kFp8>
void tile_scores_i8(const float* q, const int8_t* const* kp, int64_t bs, int64_t n, float* scores, int64_t stride,
                    const NextBlocks& next) {
  constexpr int kVecs = D / kLanes;
  constexpr int64_t kRow = D + int64_t(sizeof(half_t));
  fvec qv[NR][kVecs];
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < kVecs; ++i) qv[r][i] = load_vec(q + r * D + i * kLanes);
  for (int64_t b = 0, j = 0; j < n; ++b) {
    next.prefetch(b);
    const int8_t* k = kp[b];
    for (const int64_t end = std::min(n, j + bs); j < end; ++j, k += kRow) {
      fvec part[NR] = {};
      for (int i = 0; i < kVecs; ++i) {
        const fvec kv = load_row_codes<kFp8>(k + i * kLanes);
        for (int r = 0; r < NR; ++r) part[r] += qv[r][i] * kv;
      }
      const float scale = row_scale(k, D) * kCodeScale<kFp8>;
      for (int r = 0; r < NR; ++r) scores[r * stride + j] = hsum(part[r]) * scale;
    }
  }
}

template <int D, int NR, bool kFp8>
void tile_accumulate_i8(const float* weights, int64_t stride, const int8_t* const* vp, int64_t bs, int64_t n,
                        float* acc, const NextBlocks& next) {
  constexpr int kVecs = D / kLanes;
  constexpr int64_t kRow = D + int64_t(sizeof(half_t));
  fvec a[NR][kVecs];
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < kVecs; ++i) a[r][i] = load_vec(acc + r * D + i * kLanes);
  for (int64_t b = 0, j = 0; j < n; ++b) {
    next.prefetch(b);
    const int8_t* v = vp[b];
    for (const int64_t end = std::min(n, j + bs); j < end; ++j, v += kRow) {
      const float scale = row_scale(v, D) * kCodeScale<kFp8>;
      float w[NR];
      for (int r = 0; r < NR; ++r) w[r] = weights[r * stride + j] * scale;
      for (int i = 0; i < kVecs; ++i) {
        const fvec vv = load_row_codes<kFp8>(v + i * kLanes);
        for (int r = 0; r < NR; ++r) a[r][i] += w[r] * vv;
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < kVecs; ++i) store_vec(acc + r * D + i * kLanes, a[r][i]);
}

template <int D, bool kFp8>
void scores_i8_rows(int nr, const float* q, const int8_t* const* kp, int64_t bs, int64_t n, float* scores,
                    int64_t stride, const NextBlocks& next) {
  switch (nr) {
    case 1: return tile_scores_i8<D, 1, kFp8>(q, kp, bs, n, scores, stride, next);
    case 2: return tile_scores_i8<D, 2, kFp8>(q, kp, bs, n, scores, stride, next);
    case 3: return tile_scores_i8<D, 3, kFp8>(q, kp, bs, n, scores, stride, next);
    default: return tile_scores_i8<D, 4, kFp8>(q, kp, bs, n, scores, stride, next);
  }
}

template <int D, bool kFp8>
void accumulate_i8_rows(int nr, const float* weights, int64_t stride, const int8_t* const* vp, int64_t bs, int64_t n,
                        float* acc, const NextBlocks& next) {
  switch (nr) {
    case 1: return tile_accumulate_i8<D, 1, kFp8>(weights, stride, vp, bs, n, acc, next);
    case 2: return tile_accumulate_i8<D, 2, kFp8>(weights, stride, vp, bs, n, acc, next);
    case 3: return tile_accumulate_i8<D, 3, kFp8>(weights, stride, vp, bs, n, acc, next);
    default: return tile_accumulate_i8<D, 4, kFp8>(weights, stride, vp, bs, n, acc, next);
  }
}

// Head dims the fused int8/fp8 loops cover; others de-quantize a tile into fp32 scratch first.
inline bool fused_int8_head_dim(int64_t d) { return d == 64 || d == 128; }

template <bool kFp8>
inline void scores_i8_for(int nr, const float* q, int64_t d, const int8_t* const* kp, int64_t bs, int64_t n,
                          float* scores, int64_t stride, const NextBlocks& next) {
  if (d == 64) return scores_i8_rows<64, kFp8>(nr, q, kp, bs, n, scores, stride, next);
  return scores_i8_rows<128, kFp8>(nr, q, kp, bs, n, scores, stride, next);
}

template <bool kFp8>
inline void accumulate_i8_for(int nr, const float* weights, int64_t stride, const int8_t* const* vp, int64_t bs,
                              int64_t n, float* acc, int64_t d, const NextBlocks& next) {
  if (d == 64) return accumulate_i8_rows<64, kFp8>(nr, weights, stride, vp, bs, n, acc, next);
  return accumulate_i8_rows<128, kFp8>(nr, weights, stride, vp, bs, n, acc, next);
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

}  // namespace trtpaged::cpu
