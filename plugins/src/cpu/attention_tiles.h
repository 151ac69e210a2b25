// Inner loops of the CPU paged attention: scores and value accumulation for a small
// group of query rows (up to kRowGroup) over a tile of keys spread over blocks.
// Templated on the row count NR and head dim D (0 = runtime) so that the compiler
// unrolls over rows: each K/V row is loaded once for all NR query rows, and the NR
// independent dot products hide each other's latency.
#pragma once

#include <algorithm>
#include <cstdint>

namespace trtpaged::cpu {

constexpr int kRowGroup = 4;

// scores[r * stride + j] = q_r . k_j for j < n, keys j in blocks of bs rows at kp[j / bs].
template <int D, int NR>
void tile_scores(const float* q, int64_t d_runtime, const float* const* kp, int64_t bs, int64_t n, float* scores,
                 int64_t stride) {
  const int64_t d = D > 0 ? D : d_runtime;
  for (int64_t b = 0, j = 0; j < n; ++b) {
    const float* k = kp[b];
    for (const int64_t end = std::min(n, j + bs); j < end; ++j, k += d) {
      float dot[NR];
      for (int r = 0; r < NR; ++r) {
        const float* qr = q + r * d;
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int64_t i = 0; i < d; ++i) s += qr[i] * k[i];
        dot[r] = s;
      }
      for (int r = 0; r < NR; ++r) scores[r * stride + j] = dot[r];
    }
  }
}

// acc[r] += sum_j weights[r * stride + j] * v_j for j < n.
template <int D, int NR>
void tile_accumulate(const float* weights, int64_t stride, const float* const* vp, int64_t bs, int64_t n,
                     float* acc, int64_t d_runtime) {
  const int64_t d = D > 0 ? D : d_runtime;
  for (int64_t b = 0, j = 0; j < n; ++b) {
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

// Runtime row count → template instantiation.
template <int D>
void tile_scores_rows(int nr, const float* q, int64_t d, const float* const* kp, int64_t bs, int64_t n,
                      float* scores, int64_t stride) {
  switch (nr) {
    case 1: return tile_scores<D, 1>(q, d, kp, bs, n, scores, stride);
    case 2: return tile_scores<D, 2>(q, d, kp, bs, n, scores, stride);
    case 3: return tile_scores<D, 3>(q, d, kp, bs, n, scores, stride);
    default: return tile_scores<D, 4>(q, d, kp, bs, n, scores, stride);
  }
}

template <int D>
void tile_accumulate_rows(int nr, const float* weights, int64_t stride, const float* const* vp, int64_t bs,
                          int64_t n, float* acc, int64_t d) {
  switch (nr) {
    case 1: return tile_accumulate<D, 1>(weights, stride, vp, bs, n, acc, d);
    case 2: return tile_accumulate<D, 2>(weights, stride, vp, bs, n, acc, d);
    case 3: return tile_accumulate<D, 3>(weights, stride, vp, bs, n, acc, d);
    default: return tile_accumulate<D, 4>(weights, stride, vp, bs, n, acc, d);
  }
}

// Head dims with specialised (fully unrolled) inner loops; others use the runtime-d version.
inline void scores_for(int nr, const float* q, int64_t d, const float* const* kp, int64_t bs, int64_t n,
                       float* scores, int64_t stride) {
  switch (d) {
    case 64: return tile_scores_rows<64>(nr, q, d, kp, bs, n, scores, stride);
    case 128: return tile_scores_rows<128>(nr, q, d, kp, bs, n, scores, stride);
    default: return tile_scores_rows<0>(nr, q, d, kp, bs, n, scores, stride);
  }
}

inline void accumulate_for(int nr, const float* weights, int64_t stride, const float* const* vp, int64_t bs,
                           int64_t n, float* acc, int64_t d) {
  switch (d) {
    case 64: return tile_accumulate_rows<64>(nr, weights, stride, vp, bs, n, acc, d);
    case 128: return tile_accumulate_rows<128>(nr, weights, stride, vp, bs, n, acc, d);
    default: return tile_accumulate_rows<0>(nr, weights, stride, vp, bs, n, acc, d);
  }
}

}  // namespace trtpaged::cpu
