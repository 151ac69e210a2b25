// The fused ops' row loops for x86-64-v4 (AVX-512 F/BW/CD/DQ/VL); CMakeLists.txt sets this file's -march.
#include "cpu/fused_rows_kernel.h"

#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VL__)
#error "fused_rows_avx512.cpp must be compiled with -march=x86-64-v4"
#endif

const trtpaged::cpu::FusedRows trtpaged::cpu::kFusedRowsAvx512 = trtpaged::cpu::kThisTargetRows;
