// The fused ops' row loops for x86-64 (SSE2); CMakeLists.txt sets this file's -march.
#include "cpu/fused_rows_kernel.h"

#if defined(__AVX__)
#error "fused_rows_scalar.cpp must be compiled with -march=x86-64"
#endif

const trtpaged::cpu::FusedRows trtpaged::cpu::kFusedRowsScalar = trtpaged::cpu::kThisTargetRows;
