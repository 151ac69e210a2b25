// The row loops of the fused element-wise ops (cpu/fused_rows.h), compiled once per instruction set by
// fused_rows_{scalar,avx2,avx512}.cpp, each with its own -march (CMakeLists.txt): plain loops the compiler
// vectorizes. Everything here sits in the target's own namespace (TRTPAGED_CPU_TARGET_NS, cpu/dtype_cpu.h),
// so the linker can never hand one target's copy of an inline function to another.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "cpu/dtype_cpu.h"
#include "cpu/fused_rows.h"

namespace trtpaged::cpu {
inline namespace TRTPAGED_CPU_TARGET_NS {

// Sum of squares in double, in 8 independent lanes so the loop vectorizes without reordering
// license from -ffast-math.
inline double sum_squares(const float* h, int64_t n) {
  double lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) lanes[j] += double(h[i + j]) * double(h[i + j]);
  double s = 0;
  for (; i < n; ++i) s += double(h[i]) * double(h[i]);
  for (int j = 0; j < 8; ++j) s += lanes[j];
  return s;
}

// out = weight * (h * rsqrt(mean(h^2) + eps)), in HF Llama's order of float32 operations.
inline void rmsnorm_row(const float* h, const float* w, float eps, int64_t n, float* out) {
  const float mean = float(sum_squares(h, n) / double(n));
  const float r = 1.f / std::sqrt(mean + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = w[i] * (h[i] * r);
}

// exp(x) for x <= 0 as a branch-free polynomial the compiler vectorizes (std::exp does not, and
// costs ~10 ns an element): x = n ln2 + r, |r| <= ln2/2, exp(r) by Cephes' degree-6 expf
// polynomial, 2^n from the exponent bits. Relative error ~2 ulp; below -87 it flushes to 0.
inline float exp_nonpositive(float x) {
  x = x < -87.f ? -87.f : x;
  const float t = x * 1.44269504f + 12582912.f;  // round to nearest (1.5 * 2^23 trick): n in t's low bits
  const float n = t - 12582912.f;
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;  // Cody-Waite ln2 split
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  // 2^n from t's bits as unsigned integers: no float-to-int conversion, which is undefined for a NaN x
  // (a NaN still comes out, through p)
  uint32_t t_bits;
  __builtin_memcpy(&t_bits, &t, sizeof(t_bits));
  const uint32_t bits = (t_bits - 0x4B400000u + 127u) << 23;
  float scale;
  __builtin_memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// silu(g) = g * sigmoid(g), through exp(-|g|) so that the exponential never overflows.
inline float silu(float g) {
  const float e = exp_nonpositive(-std::fabs(g));
  const float s = 1.f / (1.f + e);  // sigmoid(|g|)
  return g * (g < 0.f ? e * s : s);
}

void silu_mul_row(const float* g, const float* u, int64_t n, float* o) {
  for (int64_t i = 0; i < n; ++i) o[i] = silu(g[i]) * u[i];
}

// h = x + residual (into h), then out = rmsnorm(h); without residual, out = rmsnorm(x).
void rmsnorm_residual_row(const float* x, const float* residual, const float* w, float eps, int64_t n, float* out,
                          float* h) {
  if (residual) {
    for (int64_t i = 0; i < n; ++i) h[i] = x[i] + residual[i];
    x = h;
  }
  rmsnorm_row(x, w, eps, n, out);
}

// HF rotate-half RoPE of one head: y = x * cos + cat(-x2, x1) * sin.
void rotate_heads(const float* src, int64_t heads, int64_t d, const float* c, const float* sn, float* dst) {
  const int64_t half = d / 2;
  for (int64_t h = 0; h < heads; ++h) {
    const float* x = src + h * d;
    float* y = dst + h * d;
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = x[i], x2 = x[i + half];
      y[i] = x1 * c[i] - x2 * sn[i];
      y[i + half] = x2 * c[i + half] + x1 * sn[i + half];
    }
  }
}

// Greedy choice over one logits row: the first index of the maximum, and log(sum(exp(x))). Three passes, each
// kGreedyLanes wide, the target's own vector width (an AVX-512 width on AVX2 is split into scalar maxima there:
// 77 against 21 us a 49152-wide row): the maximum, in two independent sets of lanes so that the max chains
// overlap; the first element equal to it, a vector compare at a time, stopping at the first hit (a model's
// choice is often an early, frequent token, so this pass is usually short); then the exponentials of x - max.
#if defined(__AVX512F__)
constexpr int kGreedyLanes = 16;
#elif defined(__AVX2__)
constexpr int kGreedyLanes = 8;
#else
constexpr int kGreedyLanes = 4;
#endif
typedef float greedy_fvec __attribute__((vector_size(4 * kGreedyLanes)));

// The lanes of x[0, kGreedyLanes) equal to m, as bits.
inline uint32_t lanes_equal(const float* x, float m) {
#if defined(__AVX512F__)
  return _mm512_cmp_ps_mask(_mm512_loadu_ps(x), _mm512_set1_ps(m), _CMP_EQ_OQ);
#elif defined(__AVX2__)
  return uint32_t(_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x), _mm256_set1_ps(m), _CMP_EQ_OQ)));
#else
  return uint32_t(_mm_movemask_ps(_mm_cmpeq_ps(_mm_loadu_ps(x), _mm_set1_ps(m))));
#endif
}

inline void greedy_row(const float* x, int64_t n, int64_t* argmax, float* logsumexp) {
  constexpr int W = kGreedyLanes;
  int64_t i = 0;
  float m = -__builtin_inff();
  if (n >= 2 * W) {
    greedy_fvec top[2];
    __builtin_memcpy(&top[0], x, sizeof(top[0]));
    __builtin_memcpy(&top[1], x + W, sizeof(top[1]));
    for (i = 2 * W; i + 2 * W <= n; i += 2 * W) {
      for (int s = 0; s < 2; ++s) {
        greedy_fvec v;
        __builtin_memcpy(&v, x + i + s * W, sizeof(v));
        top[s] = v > top[s] ? v : top[s];
      }
    }
    for (int s = 0; s < 2; ++s)
      for (int l = 0; l < W; ++l) m = top[s][l] > m ? top[s][l] : m;
  }
  for (; i < n; ++i) m = x[i] > m ? x[i] : m;
  int64_t first = -1;
  for (i = 0; i + W <= n && first < 0; i += W)
    if (const uint32_t hit = lanes_equal(x + i, m)) first = i + __builtin_ctz(hit);
  for (; i < n && first < 0; ++i)
    if (x[i] == m) first = i;
  *argmax = first < 0 ? n - 1 : first;  // none equal: a NaN row (its log-sum-exp is NaN), any index in range
  float sum = 0.f;
  float part[16] = {};
  for (i = 0; i + 16 <= n; i += 16)
    for (int l = 0; l < 16; ++l) part[l] += exp_nonpositive(x[i + l] - m);
  for (; i < n; ++i) sum += exp_nonpositive(x[i] - m);
  for (int l = 0; l < 16; ++l) sum += part[l];
  *logsumexp = m + std::log(sum);
}

// This target's table (fused_rows.h).
constexpr FusedRows kThisTargetRows = {rmsnorm_residual_row, rotate_heads, silu_mul_row, greedy_row};

}  // namespace TRTPAGED_CPU_TARGET_NS
}  // namespace trtpaged::cpu
