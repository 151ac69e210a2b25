// Run-time choice of the CPU kernels' instruction set (see isa.h) and its C ABI.
#include "cpu/isa.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "common.h"

namespace trtpaged::cpu {

const char* const kIsaNames[4] = {"scalar", "avx2", "avxvnni", "avx512vnni"};
const char* const kAttentionPathNames[3] = {"scalar", "avx2", "avx512"};

bool isa_supported(Isa isa) {
  __builtin_cpu_init();
  const bool v3 = __builtin_cpu_supports("x86-64-v3");
  switch (isa) {
    case kAvx512Vnni: return v3 && __builtin_cpu_supports("x86-64-v4") && __builtin_cpu_supports("avx512vnni");
    case kAvxVnni: return v3 && __builtin_cpu_supports("avxvnni");
    case kAvx2: return v3;
    default: return true;
  }
}

Isa best_isa() {
  for (Isa isa : {kAvx512Vnni, kAvxVnni, kAvx2})
    if (isa_supported(isa)) return isa;
  return kScalar;
}

namespace {

int isa_from_name(const char* name) {
  for (int i = 0; i < 4; ++i)
    if (std::strcmp(name, kIsaNames[i]) == 0) return i;
  return -1;
}

// -1 until first use; then the ISA in use. Set from TRTPAGED_CPU_ISA at first use (when not above
// the best and supported; otherwise ignored, said once on stderr), or by trtpaged_set_cpu_isa.
int g_isa = -1;
std::atomic_flag g_env_refusal_said = ATOMIC_FLAG_INIT;

}  // namespace

Isa current_isa() {
  int isa = __atomic_load_n(&g_isa, __ATOMIC_ACQUIRE);
  if (isa >= 0) return Isa(isa);
  Isa best = best_isa();
  Isa chosen = best;
  if (const char* env = std::getenv("TRTPAGED_CPU_ISA"); env != nullptr && *env != '\0') {
    const int want = isa_from_name(env);
    if (want >= 0 && want <= best && isa_supported(Isa(want))) {
      chosen = Isa(want);
    } else if (!g_env_refusal_said.test_and_set()) {
      // said once (two threads may both reach the first use): a force that did nothing would mislead a comparison
      std::fprintf(stderr, "trtpaged: TRTPAGED_CPU_ISA=%.40s ignored (%s); the CPU kernels run %s\n", env,
                   want < 0 ? "expected scalar, avx2, avxvnni or avx512vnni" : "this CPU lacks it", kIsaNames[best]);
    }
  }
  __atomic_store_n(&g_isa, int(chosen), __ATOMIC_RELEASE);
  return chosen;
}

AttentionPath attention_path(Isa isa) {
  switch (isa) {
    case kAvx512Vnni: return kAttentionAvx512;
    case kAvx2:
    case kAvxVnni: return kAttentionAvx2;
    default: return kAttentionScalar;
  }
}

}  // namespace trtpaged::cpu

extern "C" {

TRTPAGED_API const char* trtpaged_cpu_isa(void) { return trtpaged::cpu::kIsaNames[trtpaged::cpu::current_isa()]; }

TRTPAGED_API const char* trtpaged_best_cpu_isa(void) { return trtpaged::cpu::kIsaNames[trtpaged::cpu::best_isa()]; }

TRTPAGED_API const char* trtpaged_attention_cpu_path(void) {
  using namespace trtpaged::cpu;
  return kAttentionPathNames[attention_path(current_isa())];
}

TRTPAGED_API trtpaged_status trtpaged_set_cpu_isa(const char* name) {
  using namespace trtpaged;
  using namespace trtpaged::cpu;
  const Isa best = best_isa();
  if (!name || !*name) {
    __atomic_store_n(&g_isa, int(best), __ATOMIC_RELEASE);
    return trtpaged_status(ok());
  }
  const int want = isa_from_name(name);
  if (want < 0)
    return trtpaged_status(fail(TRTPAGED_ERR_INVALID_ARGUMENT, std::string("name: unknown instruction set '") + name +
                                                                   "' (avx512vnni, avxvnni, avx2 or scalar)"));
  if (!isa_supported(Isa(want)))
    return trtpaged_status(fail(TRTPAGED_ERR_UNSUPPORTED, std::string("name: this CPU does not support ") + name +
                                                              " (best: " + kIsaNames[best] + ")"));
  __atomic_store_n(&g_isa, want, __ATOMIC_RELEASE);
  return trtpaged_status(ok());
}

}  // extern "C"
