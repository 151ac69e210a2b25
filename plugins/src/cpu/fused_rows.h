// The fused element-wise ops' row loops (rmsnorm with a residual add, rotate-half RoPE, SiLU-gated multiply, the
// greedy choice), compiled once per instruction set (cpu/fused_rows_kernel.h built by
// fused_rows_{scalar,avx2,avx512}.cpp) and picked at run time with the paged attention's path (cpu/isa.h), so
// a forced ISA ($TRTPAGED_CPU_ISA, trtpaged_set_cpu_isa) runs and tests each copy on any machine that has it.
#pragma once

#include <cstdint>

namespace trtpaged::cpu {

struct FusedRows {
  // h = x + residual (into h), then out = rmsnorm(h); without residual (and h), out = rmsnorm(x)
  void (*rmsnorm_residual_row)(const float* x, const float* residual, const float* w, float eps, int64_t n,
                               float* out, float* h);
  // HF rotate-half RoPE of `heads` heads of d values: dst = src * cos + cat(-src2, src1) * sin
  void (*rotate_heads)(const float* src, int64_t heads, int64_t d, const float* cos, const float* sin, float* dst);
  // o = silu(g) * u
  void (*silu_mul_row)(const float* g, const float* u, int64_t n, float* o);
  // the first index of the row's maximum, and log(sum(exp(x)))
  void (*greedy_row)(const float* x, int64_t n, int64_t* argmax, float* logsumexp);
};

extern const FusedRows kFusedRowsScalar;  // x86-64 (SSE2)
extern const FusedRows kFusedRowsAvx2;    // x86-64-v3: AVX2, FMA, F16C
extern const FusedRows kFusedRowsAvx512;  // x86-64-v4: AVX-512 F/BW/CD/DQ/VL

// The copy for the ISA in use (attention_path(current_isa())).
const FusedRows& fused_rows();

}  // namespace trtpaged::cpu
