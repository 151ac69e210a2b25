// The CPU paged attention for x86-64-v3 (AVX2, FMA, F16C); CMakeLists.txt sets this file's -march.
#include "cpu/paged_attention_kernel.h"

#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__) || defined(__AVX512F__)
#error "paged_attention_avx2.cpp must be compiled with -march=x86-64-v3"
#endif

void trtpaged::cpu::paged_attention_avx2(const AttentionCall& call) { run_paged_attention(call); }
