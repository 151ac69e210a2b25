// The fused ops' row loops for x86-64-v3 (AVX2, FMA, F16C); CMakeLists.txt sets this file's -march.
#include "cpu/fused_rows_kernel.h"

#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__) || defined(__AVX512F__)
#error "fused_rows_avx2.cpp must be compiled with -march=x86-64-v3"
#endif

const trtpaged::cpu::FusedRows trtpaged::cpu::kFusedRowsAvx2 = trtpaged::cpu::kThisTargetRows;
