// The CPU paged attention for any x86-64 (SSE2); CMakeLists.txt sets this file's -march.
#include "cpu/paged_attention_kernel.h"

#if defined(__AVX__)
#error "paged_attention_scalar.cpp must be compiled for baseline x86-64 (-march=x86-64)"
#endif

void trtpaged::cpu::paged_attention_scalar(const AttentionCall& call) { run_paged_attention(call); }
