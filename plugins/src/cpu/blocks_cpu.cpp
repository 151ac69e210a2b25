// CPU block copies: copy-on-write inside one pool, and swaps between two pools.
// A block is one contiguous chunk (every layer's K and V) in the block-major layout.
#include <cstring>
#include <string>

#include "common.h"

namespace {

int copy_pairs(const char* src, char* dst, size_t block_bytes, const int32_t* pairs, int32_t num_pairs) {
#pragma omp parallel for schedule(static) if (num_pairs > 4)
  for (int32_t i = 0; i < num_pairs; ++i)
    std::memcpy(dst + size_t(pairs[2 * i + 1]) * block_bytes, src + size_t(pairs[2 * i]) * block_bytes, block_bytes);
  return trtpaged::ok();
}

}  // namespace

extern "C" {

TRTPAGED_API int trtpaged_copy_blocks_cpu(void* kv_cache, int32_t num_kv_blocks, size_t block_bytes,
                                          const int32_t* pairs, int32_t num_pairs) {
  using namespace trtpaged;
  try {
    if (num_pairs > 0 && !kv_cache) return fail(TRTPAGED_ERR_INVALID_ARGUMENT, "kv_cache: null pointer");
    if (block_bytes == 0) return fail(TRTPAGED_ERR_INVALID_ARGUMENT, "block_bytes: must be > 0");
    if (int rc = validate_block_pairs(pairs, num_pairs, num_kv_blocks, num_kv_blocks, true)) return rc;
    return copy_pairs(static_cast<const char*>(kv_cache), static_cast<char*>(kv_cache), block_bytes, pairs, num_pairs);
  } catch (const std::exception& e) {
    return fail_from(e, "copy_blocks_cpu");
  }
}

TRTPAGED_API int trtpaged_swap_blocks_cpu(const void* src_pool, int32_t src_num_kv_blocks, void* dst_pool,
                                          int32_t dst_num_kv_blocks, size_t block_bytes, const int32_t* pairs,
                                          int32_t num_pairs) {
  using namespace trtpaged;
  try {
    if (num_pairs > 0 && (!src_pool || !dst_pool))
      return fail(TRTPAGED_ERR_INVALID_ARGUMENT, "src_pool, dst_pool: null pointer");
    if (block_bytes == 0) return fail(TRTPAGED_ERR_INVALID_ARGUMENT, "block_bytes: must be > 0");
    if (src_pool == dst_pool)
      return fail(TRTPAGED_ERR_INVALID_ARGUMENT, "dst_pool: same pool as src_pool (use copy_blocks)");
    if (int rc = validate_block_pairs(pairs, num_pairs, src_num_kv_blocks, dst_num_kv_blocks, false)) return rc;
    return copy_pairs(static_cast<const char*>(src_pool), static_cast<char*>(dst_pool), block_bytes, pairs, num_pairs);
  } catch (const std::exception& e) {
    return fail_from(e, "swap_blocks_cpu");
  }
}

}  // extern "C"
