// Small fused element-wise ops of the eager step model (float32, CPU): RMSNorm with an optional
// residual add, rotate-half RoPE on the q and k heads of a fused qkv projection, and SiLU-gated
// multiply. Each replaces several torch ops (and their per-op dispatch cost) with one C call.
//
// The argument checks and the threading are here; the row loops are compiled once per instruction set
// (cpu/fused_rows.h) and the copy of the ISA in use runs, as the paged attention's does. Baseline SSE2
// alone made silu_mul at 16 x 1536 take 51 us; the AVX-512 copy takes ~4 us.
#include <cmath>
#include <cstdint>
#include <string>

#include "common.h"
#include "cpu/fused_rows.h"
#include "cpu/isa.h"

namespace trtpaged::cpu {

const FusedRows& fused_rows() {
  switch (attention_path(current_isa())) {
    case kAttentionAvx512: return kFusedRowsAvx512;
    case kAttentionAvx2: return kFusedRowsAvx2;
    default: return kFusedRowsScalar;
  }
}

}  // namespace trtpaged::cpu

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

template <typename Body>
void for_rows(int64_t rows, int64_t elements, Body body) {
  if (rows > 1 && elements >= kParallelElements) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) body(r);
  } else {
    for (int64_t r = 0; r < rows; ++r) body(r);
  }
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
  const auto row = trtpaged::cpu::fused_rows().rmsnorm_residual_row;
  for_rows(rows, rows * hidden, [&](int64_t r) {
    const int64_t off = r * hidden;
    row(x + off, residual ? residual + off : nullptr, weight, eps, hidden, out + off,
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
  const auto rotate_heads = trtpaged::cpu::fused_rows().rotate_heads;
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
  const auto silu_mul_row = trtpaged::cpu::fused_rows().silu_mul_row;
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
  const auto greedy_row = trtpaged::cpu::fused_rows().greedy_row;
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
