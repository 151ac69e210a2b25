// Small fused element-wise ops of the eager step model (float32, CPU): RMSNorm with an optional
// residual add, rotate-half RoPE on the q and k heads of a fused qkv projection, and SiLU-gated
// multiply. Each replaces several torch ops (and their per-op dispatch cost) with one C call.
//
// Plain loops the compiler vectorizes. This file is compiled without -march=native (see
// CMakeLists.txt) so the library runs on any x86-64; the row loops are cloned for AVX-512 and
// AVX2 (x86-64-v4/v3) and the loader picks the clone for the CPU (an ifunc, resolved once).
// Baseline SSE2 alone made silu_mul at 16 x 1536 take 51 us; the AVX-512 clone takes ~4 us.
#include <cmath>
#include <cstdint>
#include <string>

#include "common.h"

namespace {

using trtpaged::fail;

// An OpenMP region costs microseconds even when it runs serially: only large calls (prefill
// chunks) open one.
constexpr int64_t kParallelElements = int64_t(1) << 16;

int check_ptr(const void* p, const char* name) {
  return p ? TRTPAGED_OK : fail(TRTPAGED_ERR_INVALID_ARGUMENT, std::string(name) + ": must not be NULL");
}

int check_dim(int64_t v, int64_t min, const char* name) {
  if (v >= min) return TRTPAGED_OK;
  return fail(TRTPAGED_ERR_INVALID_ARGUMENT,
              std::string(name) + ": must be >= " + std::to_string(min) + ", got " + std::to_string(v));
}

#define TRTPAGED_ROW_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))

template <typename Body>
void for_rows(int64_t rows, int64_t elements, Body body) {
  if (rows > 1 && elements >= kParallelElements) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) body(r);
  } else {
    for (int64_t r = 0; r < rows; ++r) body(r);
  }
}

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
  const float n = (x * 1.44269504f + 12582912.f) - 12582912.f;  // round to nearest (1.5 * 2^23 trick)
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;  // Cody-Waite ln2 split
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const int32_t bits = (int32_t(n) + 127) << 23;
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

TRTPAGED_ROW_CLONES void silu_mul_row(const float* g, const float* u, int64_t n, float* o) {
  for (int64_t i = 0; i < n; ++i) o[i] = silu(g[i]) * u[i];
}

// h = x + residual (into h), then out = rmsnorm(h); without residual, out = rmsnorm(x).
TRTPAGED_ROW_CLONES void rmsnorm_residual_row(const float* x, const float* residual, const float* w, float eps,
                                              int64_t n, float* out, float* h) {
  if (residual) {
    for (int64_t i = 0; i < n; ++i) h[i] = x[i] + residual[i];
    x = h;
  }
  rmsnorm_row(x, w, eps, n, out);
}

// HF rotate-half RoPE of one head: y = x * cos + cat(-x2, x1) * sin.
TRTPAGED_ROW_CLONES void rotate_heads(const float* src, int64_t heads, int64_t d, const float* c, const float* sn,
                                      float* dst) {
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

// Greedy choice over one logits row: the first index of the maximum, and log(sum(exp(x))).
// 16 lanes of running maxima (a vector max, where a scalar running argmax does not vectorize),
// then the first lane-chunk holding the maximum, then the exponentials of x - max (<= 0).
typedef float f32x16 __attribute__((vector_size(64)));

TRTPAGED_ROW_CLONES void greedy_row(const float* x, int64_t n, int64_t* argmax, float* logsumexp) {
  int64_t i = 0;
  float m = -__builtin_inff();
  if (n >= 16) {
    f32x16 lanes;
    __builtin_memcpy(&lanes, x, sizeof(lanes));
    for (i = 16; i + 16 <= n; i += 16) {
      f32x16 v;
      __builtin_memcpy(&v, x + i, sizeof(v));
      lanes = v > lanes ? v : lanes;
    }
    for (int l = 0; l < 16; ++l) m = lanes[l] > m ? lanes[l] : m;
  }
  for (; i < n; ++i) m = x[i] > m ? x[i] : m;
  int64_t first = 0;
  while (first + 1 < n && x[first] != m) ++first;  // bounded: a NaN row has no such element
  *argmax = first;
  float sum = 0.f;
  float part[16] = {};
  for (i = 0; i + 16 <= n; i += 16)
    for (int l = 0; l < 16; ++l) part[l] += exp_nonpositive(x[i + l] - m);
  for (; i < n; ++i) sum += exp_nonpositive(x[i] - m);
  for (int l = 0; l < 16; ++l) sum += part[l];
  *logsumexp = m + std::log(sum);
}

}  // namespace

extern "C" {

TRTPAGED_API trtpaged_status trtpaged_rmsnorm_cpu(const float* x, const float* residual, const float* weight,
                                                  float eps, int64_t rows, int64_t hidden, float* out,
                                                  float* residual_out) {
  int s;
  if ((s = check_dim(rows, 0, "rows")) || (s = check_dim(hidden, 1, "hidden"))) return trtpaged_status(s);
  if (!(eps >= 0.f) || !std::isfinite(eps))
    return trtpaged_status(fail(TRTPAGED_ERR_INVALID_ARGUMENT, "eps: must be finite and >= 0, got " +
                                                                   std::to_string(eps)));
  if ((residual == nullptr) != (residual_out == nullptr))
    return trtpaged_status(fail(TRTPAGED_ERR_INVALID_ARGUMENT,
                                "residual_out: must be given exactly when residual is (both or neither)"));
  if (rows == 0) return trtpaged_status(trtpaged::ok());
  if ((s = check_ptr(x, "x")) || (s = check_ptr(weight, "weight")) || (s = check_ptr(out, "out")))
    return trtpaged_status(s);
  for_rows(rows, rows * hidden, [&](int64_t r) {
    const int64_t off = r * hidden;
    rmsnorm_residual_row(x + off, residual ? residual + off : nullptr, weight, eps, hidden, out + off,
                         residual ? residual_out + off : nullptr);
  });
  return trtpaged_status(trtpaged::ok());
}

TRTPAGED_API trtpaged_status trtpaged_rope_qk_cpu(float* qkv, int64_t rows, int32_t num_heads, int32_t num_kv_heads,
                                                  int32_t head_dim, const float* cos, const float* sin, float* q_out,
                                                  float* k_out, float* v_out) {
  int s;
  if ((s = check_dim(rows, 0, "rows")) || (s = check_dim(num_heads, 1, "num_heads")) ||
      (s = check_dim(num_kv_heads, 1, "num_kv_heads")) || (s = check_dim(head_dim, 2, "head_dim")))
    return trtpaged_status(s);
  if (head_dim % 2)
    return trtpaged_status(fail(TRTPAGED_ERR_INVALID_ARGUMENT,
                                "head_dim: must be even, got " + std::to_string(head_dim)));
  const bool dense = q_out || k_out || v_out;
  if (dense && !(q_out && k_out && v_out))
    return trtpaged_status(fail(TRTPAGED_ERR_INVALID_ARGUMENT,
                                "q_out/k_out/v_out: give all three (dense outputs) or none (in place)"));
  if (rows == 0) return trtpaged_status(trtpaged::ok());
  if ((s = check_ptr(qkv, "qkv")) || (s = check_ptr(cos, "cos")) || (s = check_ptr(sin, "sin")))
    return trtpaged_status(s);
  const int64_t d = head_dim;
  const int64_t q_size = int64_t(num_heads) * d, kv_size = int64_t(num_kv_heads) * d;
  const int64_t width = q_size + 2 * kv_size;
  for_rows(rows, rows * width, [&](int64_t r) {
    float* src = qkv + r * width;
    const float* c = cos + r * d;
    const float* sn = sin + r * d;
    rotate_heads(src, num_heads, d, c, sn, dense ? q_out + r * q_size : src);
    rotate_heads(src + q_size, num_kv_heads, d, c, sn, dense ? k_out + r * kv_size : src + q_size);
    if (dense) {
      const float* v = src + q_size + kv_size;
      float* vr = v_out + r * kv_size;
      for (int64_t i = 0; i < kv_size; ++i) vr[i] = v[i];
    }
  });
  return trtpaged_status(trtpaged::ok());
}

TRTPAGED_API trtpaged_status trtpaged_silu_mul_cpu(const float* gate_up, int64_t rows, int64_t intermediate,
                                                   float* out) {
  int s;
  if ((s = check_dim(rows, 0, "rows")) || (s = check_dim(intermediate, 1, "intermediate"))) return trtpaged_status(s);
  if (rows == 0) return trtpaged_status(trtpaged::ok());
  if ((s = check_ptr(gate_up, "gate_up")) || (s = check_ptr(out, "out"))) return trtpaged_status(s);
  const int64_t n = intermediate;
  for_rows(rows, rows * n, [&](int64_t r) {
    const float* g = gate_up + r * 2 * n;
    silu_mul_row(g, g + n, n, out + r * n);
  });
  return trtpaged_status(trtpaged::ok());
}

TRTPAGED_API trtpaged_status trtpaged_greedy_rows_cpu(const float* logits, int64_t vocab, const int64_t* rows,
                                                      int64_t n, int64_t* argmax, float* logsumexp) {
  int s;
  if ((s = check_dim(vocab, 1, "vocab")) || (s = check_dim(n, 0, "n"))) return trtpaged_status(s);
  if (n == 0) return trtpaged_status(trtpaged::ok());
  if ((s = check_ptr(logits, "logits")) || (s = check_ptr(rows, "rows")) || (s = check_ptr(argmax, "argmax")) ||
      (s = check_ptr(logsumexp, "logsumexp")))
    return trtpaged_status(s);
  // rows of a decode batch are independent and each is a full vocab pass: parallel from two rows
  if (n > 1 && n * vocab >= kParallelElements) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) greedy_row(logits + rows[i] * vocab, vocab, argmax + i, logsumexp + i);
  } else {
    for (int64_t i = 0; i < n; ++i) greedy_row(logits + rows[i] * vocab, vocab, argmax + i, logsumexp + i);
  }
  return trtpaged_status(trtpaged::ok());
}

}  // extern "C"
