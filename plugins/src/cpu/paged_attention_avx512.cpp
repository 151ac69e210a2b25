// The CPU paged attention for x86-64-v4 (AVX-512 F/BW/CD/DQ/VL); CMakeLists.txt sets this file's -march.
#include "cpu/paged_attention_kernel.h"

#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VL__) || !defined(__F16C__)
#error "paged_attention_avx512.cpp must be compiled with -march=x86-64-v4"
#endif

void trtpaged::cpu::paged_attention_avx512(const AttentionCall& call) { run_paged_attention(call); }
