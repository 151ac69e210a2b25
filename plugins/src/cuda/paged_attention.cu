// C ABI of the CUDA paged attention: validates, plans and launches
// write_kv -> decode (+ reduce) -> prefill on the caller's stream, each part
// only when the batch can have work for it (launch_parts).
#include <cuda_runtime.h>

#include <cstdint>
#include <exception>
#include <string>

#include "common.h"
#include "cuda/dispatch.h"
#include "cuda/launch.h"
#include "cuda/paged_args.h"

namespace trtpaged {
namespace cuda {
namespace {

int log2_exact(int x) {
  int n = 0;
  while ((1 << n) < x) ++n;
  return (1 << n) == x ? n : -1;
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Checks everything the CUDA path can check on the host; TRTPAGED_OK or an error code.
int check_params(const trtpaged_attention_params* p, int32_t max_context_len) {
  if (p == nullptr) return fail(TRTPAGED_ERR_INVALID_ARGUMENT, "params is NULL");
  const AttentionLimits limits{kHeadDims, kNumHeadDims, 16, kMaxHeadDim, false};
  const int rc = validate_attention_params(p, limits);
  if (rc != TRTPAGED_OK) return rc;
  if (log2_exact(p->block_size) < 0) {
    return fail(TRTPAGED_ERR_UNSUPPORTED,
                "block_size " + std::to_string(p->block_size) + " is not a power of two");
  }
  if (max_context_len < 0) {
    return fail(TRTPAGED_ERR_INVALID_ARGUMENT,
                "max_context_len must be >= 0, got " + std::to_string(max_context_len));
  }
  const int group = p->num_heads / p->num_kv_heads;
  // The prefill grid has the most CTAs in y (its head tiles are the smaller ones).
  const int64_t rows = static_cast<int64_t>(p->num_kv_heads) * ceil_div(group, kPrefillMaxHeads);
  if (rows > 65535) {
    return fail(TRTPAGED_ERR_UNSUPPORTED, "num_kv_heads " + std::to_string(p->num_kv_heads) +
                                              " with group " + std::to_string(group) +
                                              " exceeds the CUDA grid limit (65535 CTAs in y)");
  }
  return TRTPAGED_OK;
}

int cuda_error(const char* what, cudaError_t err) {
  return fail(TRTPAGED_ERR_CUDA, std::string(what) + ": " + cudaGetErrorString(err));
}

}  // namespace
}  // namespace cuda
}  // namespace trtpaged

extern "C" TRTPAGED_API size_t trtpaged_paged_attention_cuda_workspace_size(const trtpaged_attention_params* params,
                                                                            int32_t max_context_len) {
  using namespace trtpaged::cuda;
  try {
    if (check_params(params, max_context_len) != TRTPAGED_OK) return 0;
    return make_decode_plan(*params, max_context_len).workspace_bytes;
  } catch (...) {
    return 0;
  }
}

extern "C" TRTPAGED_API int trtpaged_paged_attention_ex_cuda(const trtpaged_attention_params* params,
                                                             const trtpaged_attention_options* options, const void* q,
                                                             const void* k, const void* v, void* kv_cache,
                                                             const int32_t* positions, const int32_t* query_start,
                                                             const int32_t* context_lens, const int32_t* block_tables,
                                                             void* out, int32_t max_context_len, void* workspace,
                                                             size_t workspace_size, void* stream) {
  using namespace trtpaged::cuda;
  using trtpaged::fail;
  try {
    const int rc = check_params(params, max_context_len);
    if (rc != TRTPAGED_OK) return rc;
    const trtpaged_attention_options opt = options ? *options : trtpaged_attention_options{0, 0.0f};
    if (int orc = trtpaged::validate_attention_options(opt)) return orc;
    const trtpaged_attention_params& p = *params;
    if (p.num_tokens == 0) return trtpaged::ok();
    if (p.num_seqs <= 0) return fail(TRTPAGED_ERR_INVALID_ARGUMENT, "num_seqs must be >= 1 when num_tokens > 0");
    if (!q || !k || !v || !kv_cache || !positions || !query_start || !context_lens || !block_tables || !out) {
      return fail(TRTPAGED_ERR_INVALID_ARGUMENT,
                  "q, k, v, kv_cache, positions, query_start, context_lens, block_tables and out must be non-NULL");
    }
    if (!aligned16(q) || !aligned16(k) || !aligned16(v) || !aligned16(kv_cache) || !aligned16(out)) {
      return fail(TRTPAGED_ERR_INVALID_ARGUMENT, "q, k, v, kv_cache and out must be 16-byte aligned");
    }
    DecodePlan decode = make_decode_plan(p, max_context_len);
    if (decode.workspace_bytes > 0) {
      if (workspace == nullptr || workspace_size < decode.workspace_bytes || !aligned16(workspace)) {
        return fail(TRTPAGED_ERR_INVALID_ARGUMENT,
                    "workspace must be a 16-byte aligned buffer of at least " +
                        std::to_string(decode.workspace_bytes) + " bytes (got " + std::to_string(workspace_size) +
                        "); see trtpaged_paged_attention_cuda_workspace_size");
      }
      const size_t per_split = static_cast<size_t>(p.num_seqs) * p.num_heads * decode.num_splits;
      const size_t o_bytes = (per_split * p.head_dim * sizeof(float) + 255) / 256 * 256;
      decode.partial_o = static_cast<float*>(workspace);
      decode.partial_ml = reinterpret_cast<float*>(static_cast<char*>(workspace) + o_bytes);
    }
    const PrefillPlan prefill = make_prefill_plan(p);

    PagedArgs a{};
    a.q = q;
    a.k = k;
    a.v = v;
    a.kv_cache = kv_cache;
    a.positions = positions;
    a.query_start = query_start;
    a.context_lens = context_lens;
    a.block_tables = block_tables;
    a.out = out;
    a.num_tokens = p.num_tokens;
    a.num_seqs = p.num_seqs;
    a.max_blocks_per_seq = p.max_blocks_per_seq;
    a.num_heads = p.num_heads;
    a.num_kv_heads = p.num_kv_heads;
    a.group = p.num_heads / p.num_kv_heads;
    a.head_dim = p.head_dim;
    a.kv_row = trtpaged::kv_cache_dtype_quantized(p.kv_cache_dtype) ? p.head_dim + 2 : p.head_dim;
    a.num_kv_blocks = p.num_kv_blocks;
    a.num_layers = p.num_layers;
    a.layer = p.layer;
    a.block_size = p.block_size;
    a.block_size_log2 = log2_exact(p.block_size);
    a.max_kv_len = max_kv_len(p, max_context_len);
    a.scale_log2 = p.scale * 1.4426950408889634f;
    a.window = opt.sliding_window;
    a.softcap_log2 = opt.logit_softcap * 1.4426950408889634f;

    cudaStream_t s = static_cast<cudaStream_t>(stream);
    cudaError_t err = launch_write_kv(a, p.io_dtype, p.kv_cache_dtype, s);
    if (err != cudaSuccess) return cuda_error("paged attention K/V write", err);
    const LaunchParts parts = launch_parts(p);
    if (parts.decode) {
      err = launch_decode(a, decode, p.io_dtype, p.kv_cache_dtype, s);
      if (err != cudaSuccess) return cuda_error("paged attention decode", err);
    }
    if (parts.prefill) {
      err = launch_prefill(a, prefill, p.io_dtype, p.kv_cache_dtype, s);
      if (err != cudaSuccess) return cuda_error("paged attention prefill", err);
    }
    return trtpaged::ok();
  } catch (const std::exception& e) {
    return fail(TRTPAGED_ERR_CUDA, std::string("trtpaged_paged_attention_cuda: ") + e.what());
  } catch (...) {
    return fail(TRTPAGED_ERR_CUDA, "trtpaged_paged_attention_cuda: unknown exception");
  }
}

extern "C" TRTPAGED_API int trtpaged_paged_attention_cuda(const trtpaged_attention_params* params, const void* q,
                                                          const void* k, const void* v, void* kv_cache,
                                                          const int32_t* positions, const int32_t* query_start,
                                                          const int32_t* context_lens, const int32_t* block_tables,
                                                          void* out, int32_t max_context_len, void* workspace,
                                                          size_t workspace_size, void* stream) {
  return trtpaged_paged_attention_ex_cuda(params, nullptr, q, k, v, kv_cache, positions, query_start, context_lens,
                                          block_tables, out, max_context_len, workspace, workspace_size, stream);
}
