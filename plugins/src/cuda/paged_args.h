// Arguments of one paged-attention call as the CUDA kernels see them, and the
// launch plan (split-K decode, query tiling) shared by the workspace-size query
// and the launch so that both always agree.
#pragma once

#include <cstddef>
#include <cstdint>

#include "trtpaged/trtpaged.h"

namespace trtpaged {
namespace cuda {

struct PagedArgs {
  const void* q;
  const void* k;
  const void* v;
  void* kv_cache;
  const int32_t* positions;
  const int32_t* query_start;
  const int32_t* context_lens;
  const int32_t* block_tables;
  void* out;
  int num_tokens;
  int num_seqs;
  int max_blocks_per_seq;
  int num_heads;
  int num_kv_heads;
  int group;  // num_heads / num_kv_heads
  int head_dim;
  int kv_row;  // elements of one token row of one head in the pool: head_dim, or head_dim + 2 bytes (int8/fp8)
  int num_kv_blocks;
  int num_layers;
  int layer;
  int block_size;
  int block_size_log2;
  int max_kv_len;    // min(max_context_len, max_blocks_per_seq * block_size): bounds every read
  float scale_log2;  // softmax scale * log2(e): scores live in the exp2 domain
  int window;           // sliding window (trtpaged_attention_options), 0: none
  float softcap_log2;   // logit soft-cap * log2(e) (scores are in the exp2 domain), 0: none
};

// Decode (q_len == 1) work split: grid (num_seqs, num_kv_heads * head_tiles, num_splits).
struct DecodePlan {
  int num_splits;     // KV splits per sequence; > 1 means partials go to the workspace
  int split_len;      // KV tokens per split
  int heads_per_cta;  // query heads of one GQA group handled by one CTA
  int head_tiles;     // CTAs per KV head covering the whole group
  int rows_z;         // token-parallel rows per head inside a CTA
  float* partial_o;   // [num_seqs][num_heads][num_splits][head_dim], unnormalised
  float* partial_ml;  // [num_seqs][num_heads][num_splits][2]: running max (log2 domain), sum
  size_t workspace_bytes;
};

// Prefill/mixed (q_len >= 2) work: grid (max_work_items, num_kv_heads * head_tiles).
struct PrefillPlan {
  int heads_per_cta;
  int head_tiles;
  int tokens_per_cta;  // query tokens per CTA (32 rows / heads_per_cta)
  int max_work_items;  // upper bound on the (sequence, query tile) pairs
};

constexpr int kDecodeLanes = 8;         // lanes sharing one key row in the decode kernel
constexpr int kDecodeRows = 16;         // target rows (of kDecodeLanes lanes) per decode CTA
constexpr int kDecodeMaxHeads = 16;     // query heads per decode CTA at most
constexpr int kDecodeMaxThreads = 256;  // kDecodeLanes * max over heads of heads * ceil(16 / heads)
constexpr int kMinSplitLen = 256;       // shorter splits cost more in reduction than they gain
constexpr int kTargetCtas = 2048;       // enough CTAs for several small waves on any current GPU
constexpr int kMaxSplits = 256;
constexpr int kPrefillThreads = 128;
constexpr int kPrefillRows = 32;  // query rows (token, head) per prefill CTA, 4 lanes each
constexpr int kPrefillMaxHeads = 8;

inline int ceil_div(int a, int b) { return (a + b - 1) / b; }

inline int max_kv_len(const trtpaged_attention_params& p, int32_t max_context_len) {
  const int64_t table_span = static_cast<int64_t>(p.max_blocks_per_seq) * p.block_size;
  const int64_t bound = table_span < max_context_len ? table_span : max_context_len;
  return bound > 0 ? static_cast<int>(bound) : 0;
}

inline DecodePlan make_decode_plan(const trtpaged_attention_params& p, int32_t max_context_len) {
  DecodePlan plan{};
  const int group = p.num_heads / p.num_kv_heads;
  plan.heads_per_cta = group < kDecodeMaxHeads ? group : kDecodeMaxHeads;
  plan.head_tiles = ceil_div(group, plan.heads_per_cta);
  plan.rows_z = ceil_div(kDecodeRows, plan.heads_per_cta);

  const int kv = max_kv_len(p, max_context_len);
  const int64_t base_ctas = static_cast<int64_t>(p.num_seqs) * p.num_kv_heads * plan.head_tiles;
  int64_t splits = base_ctas > 0 ? (kTargetCtas + base_ctas - 1) / base_ctas : 1;
  const int64_t by_len = kv > 0 ? ceil_div(kv, kMinSplitLen) : 1;
  if (splits > by_len) splits = by_len;
  if (splits > kMaxSplits) splits = kMaxSplits;
  if (splits < 1) splits = 1;
  plan.split_len = kv > 0 ? ceil_div(kv, static_cast<int>(splits)) : kMinSplitLen;
  plan.split_len = ceil_div(plan.split_len, 64) * 64;
  plan.num_splits = kv > 0 ? ceil_div(kv, plan.split_len) : 1;
  if (plan.num_splits > 1) {
    const size_t per_split = static_cast<size_t>(p.num_seqs) * p.num_heads * plan.num_splits;
    const size_t o_bytes = (per_split * p.head_dim * sizeof(float) + 255) / 256 * 256;
    plan.workspace_bytes = o_bytes + per_split * 2 * sizeof(float);
  }
  return plan;
}

// Which kernels a call launches, from the host-side counts alone (query_start
// lives on the device). The CUDA path takes every sequence of a call to have at
// least one token (the runtime never schedules an empty one), so
// num_tokens == num_seqs is a decode-only batch; a single sequence with two or
// more tokens is a prefill-only one. Otherwise both parts may be present.
struct LaunchParts {
  bool decode;
  bool prefill;
};

inline LaunchParts launch_parts(const trtpaged_attention_params& p) {
  if (p.num_tokens <= 0 || p.num_seqs <= 0) return {false, false};
  const bool decode_only = p.num_tokens == p.num_seqs;
  const bool prefill_only = p.num_seqs == 1 && p.num_tokens >= 2;
  return {!prefill_only, !decode_only};
}

inline PrefillPlan make_prefill_plan(const trtpaged_attention_params& p) {
  PrefillPlan plan{};
  const int group = p.num_heads / p.num_kv_heads;
  plan.heads_per_cta = group < kPrefillMaxHeads ? group : kPrefillMaxHeads;
  plan.head_tiles = ceil_div(group, plan.heads_per_cta);
  plan.tokens_per_cta = kPrefillRows / plan.heads_per_cta;
  // Only sequences with q_len >= 2 get tiles: sum(ceil(q_len / T)) <= tokens / T + seqs with q_len >= 2.
  const int multi = p.num_seqs < p.num_tokens / 2 ? p.num_seqs : p.num_tokens / 2;
  plan.max_work_items = ceil_div(p.num_tokens, plan.tokens_per_cta) + multi;
  return plan;
}

}  // namespace cuda
}  // namespace trtpaged
