// The instruction set the CPU kernels run with, chosen at run time (never at build time), so one
// library runs on any x86-64 and every path can be tested on one machine by forcing a lower one
// ($TRTPAGED_CPU_ISA, or trtpaged_set_cpu_isa).
#pragma once

namespace trtpaged::cpu {

enum Isa { kScalar = 0, kAvx2 = 1, kAvxVnni = 2, kAvx512Vnni = 3 };
extern const char* const kIsaNames[4];

// Whether this CPU (and OS) can run a variant. kAvx2 means all of x86-64-v3 (AVX2, FMA, F16C, BMI2,
// ...), kAvx512Vnni all of x86-64-v4 (AVX-512 F/BW/CD/DQ/VL) plus VNNI: what the per-ISA files are
// compiled for. AVX-512 VNNI and AVX-VNNI are independent (Ice Lake and Zen 4 have the first only).
bool isa_supported(Isa isa);
Isa best_isa();
// The ISA in use: the best one, or $TRTPAGED_CPU_ISA at first use when lower and supported.
Isa current_isa();

// The paged-attention (and KV write) code paths, one per compiled copy of the kernel.
enum AttentionPath { kAttentionScalar = 0, kAttentionAvx2 = 1, kAttentionAvx512 = 2 };
extern const char* const kAttentionPathNames[3];
// The path an ISA runs: AVX-VNNI adds nothing the attention uses, so it runs the AVX2 copy.
AttentionPath attention_path(Isa isa);

}  // namespace trtpaged::cpu
