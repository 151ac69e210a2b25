// CPU paged attention, the C entry point: checks every argument and index, then runs the kernel
// copy of the instruction set in use (cpu/isa.h), so that which SIMD code runs is chosen at run
// time and every copy can be forced and tested on one machine. The kernel itself is
// cpu/paged_attention_kernel.h.
#include <algorithm>
#include <string>

#include "common.h"
#include "cpu/isa.h"
#include "cpu/paged_attention_paths.h"

namespace trtpaged::cpu {
namespace {

// Host-side checks of every index the kernel will follow, done before any write.
// With a sliding window, blocks before the first key the step's queries read are not checked (never read).
int validate_indices(const trtpaged_attention_params& p, int32_t window, const int32_t* positions,
                     const int32_t* query_start, const int32_t* context_lens, const int32_t* block_tables) {
  auto bad = [](const std::string& msg) { return fail(TRTPAGED_ERR_INVALID_ARGUMENT, msg); };
  if (query_start[0] != 0) return bad("query_start[0]: " + std::to_string(query_start[0]) + " must be 0");
  if (query_start[p.num_seqs] != p.num_tokens)
    return bad("query_start[num_seqs]: " + std::to_string(query_start[p.num_seqs]) + " must equal num_tokens (" +
               std::to_string(p.num_tokens) + ")");
  // every offset first: the loop below reads positions[query_start[s] .. query_start[s + 1])
  for (int32_t s = 0; s < p.num_seqs; ++s)
    if (query_start[s + 1] < query_start[s] || query_start[s + 1] > p.num_tokens)
      return bad("query_start[" + std::to_string(s + 1) + "]: " + std::to_string(query_start[s + 1]) +
                 " must be in [query_start[" + std::to_string(s) + "] = " + std::to_string(query_start[s]) +
                 ", num_tokens = " + std::to_string(p.num_tokens) + "] (offsets must not decrease)");
  const int64_t max_len = int64_t(p.max_blocks_per_seq) * p.block_size;
  for (int32_t s = 0; s < p.num_seqs; ++s) {
    const std::string seq = "[" + std::to_string(s) + "]";
    const int32_t len = context_lens[s];
    if (len < 0 || len > max_len)
      return bad("context_lens" + seq + ": " + std::to_string(len) + " out of range [0, max_blocks_per_seq * block_size = " +
                 std::to_string(max_len) + "]");
    if (query_start[s + 1] == query_start[s]) continue;
    for (int32_t t = query_start[s]; t < query_start[s + 1]; ++t)
      if (positions[t] < 0 || positions[t] >= len)
        return bad("positions[" + std::to_string(t) + "]: " + std::to_string(positions[t]) +
                   " out of range [0, context_lens" + seq + " = " + std::to_string(len) + ")");
    const int64_t used_blocks = (int64_t(len) + p.block_size - 1) / p.block_size;  // int32 overflowed near 2^31
    int64_t first_block = 0;
    if (window > 0) {
      int32_t min_pos = len;
      for (int32_t t = query_start[s]; t < query_start[s + 1]; ++t) min_pos = std::min(min_pos, positions[t]);
      first_block = std::max(0, min_pos - window + 1) / p.block_size;
    }
    for (int64_t b = first_block; b < used_blocks; ++b) {
      const int32_t id = block_tables[int64_t(s) * p.max_blocks_per_seq + b];
      if (id < 0 || id >= p.num_kv_blocks)
        return bad("block_tables[" + std::to_string(s) + "][" + std::to_string(b) + "]: block " + std::to_string(id) +
                   " out of range [0, num_kv_blocks = " + std::to_string(p.num_kv_blocks) + ")");
    }
  }
  return TRTPAGED_OK;
}

}  // namespace
}  // namespace trtpaged::cpu


extern "C" TRTPAGED_API int trtpaged_paged_attention_ex_cpu(const trtpaged_attention_params* params,
                                                            const trtpaged_attention_options* options, const void* q,
                                                            const void* k, const void* v, void* kv_cache,
                                                            const int32_t* positions, const int32_t* query_start,
                                                            const int32_t* context_lens, const int32_t* block_tables,
                                                            void* out) {
  using namespace trtpaged;
  try {
    const AttentionLimits limits{nullptr, 0, 16, cpu::kMaxHeadDim, true};
    if (int rc = validate_attention_params(params, limits)) return rc;
    const trtpaged_attention_options opt = options ? *options : trtpaged_attention_options{0, 0.0f};
    if (int rc = validate_attention_options(opt)) return rc;
    const trtpaged_attention_params& p = *params;
    if (p.num_tokens == 0) return ok();
    if (!q || !k || !v || !kv_cache || !positions || !query_start || !context_lens || !block_tables || !out)
      return fail(TRTPAGED_ERR_INVALID_ARGUMENT,
                  "q, k, v, kv_cache, positions, query_start, context_lens, block_tables, out: null pointer");
    if (int rc = cpu::validate_indices(p, opt.sliding_window, positions, query_start, context_lens, block_tables))
      return rc;
    const cpu::AttentionCall call{params, q, k, v, kv_cache, positions, query_start, block_tables, out, opt};
    switch (cpu::attention_path(cpu::current_isa())) {
      case cpu::kAttentionAvx512: cpu::paged_attention_avx512(call); break;
      case cpu::kAttentionAvx2: cpu::paged_attention_avx2(call); break;
      default: cpu::paged_attention_scalar(call); break;
    }
    return ok();
  } catch (const std::exception& e) {
    return fail_from(e, "paged_attention_cpu");
  }
}

extern "C" TRTPAGED_API int trtpaged_paged_attention_cpu(const trtpaged_attention_params* params, const void* q,
                                                         const void* k, const void* v, void* kv_cache,
                                                         const int32_t* positions, const int32_t* query_start,
                                                         const int32_t* context_lens, const int32_t* block_tables,
                                                         void* out) {
  return trtpaged_paged_attention_ex_cpu(params, nullptr, q, k, v, kv_cache, positions, query_start, context_lens,
                                         block_tables, out);
}
