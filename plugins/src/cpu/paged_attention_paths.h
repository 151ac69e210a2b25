// The CPU paged attention's compiled copies, one per instruction set (cpu/paged_attention_kernel.h
// built by paged_attention_{scalar,avx2,avx512}.cpp); trtpaged_paged_attention_cpu picks one at run
// time (cpu/isa.h).
#pragma once

#include <cstdint>

#include "trtpaged/trtpaged.h"

namespace trtpaged::cpu {

constexpr int kMaxHeadDim = 256;  // the CPU limit checked in trtpaged_paged_attention_cpu

// One call's arguments, every index already checked (trtpaged_paged_attention_cpu).
struct AttentionCall {
  const trtpaged_attention_params* params;
  const void* q;
  const void* k;
  const void* v;
  void* kv_cache;
  const int32_t* positions;
  const int32_t* query_start;
  const int32_t* block_tables;
  void* out;
  trtpaged_attention_options options;  // sliding window and logit soft-cap (0: none)
};

void paged_attention_scalar(const AttentionCall& call);  // x86-64 (SSE2)
void paged_attention_avx2(const AttentionCall& call);    // x86-64-v3: AVX2, FMA, F16C
void paged_attention_avx512(const AttentionCall& call);  // x86-64-v4: AVX-512 F/BW/CD/DQ/VL

}  // namespace trtpaged::cpu
