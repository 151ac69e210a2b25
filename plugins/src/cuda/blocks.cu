// C ABI of the CUDA block copy (copy-on-write) and swap: runs of consecutive
// pairs become one cudaMemcpyAsync each.
#include <cuda_runtime.h>

#include <cstdint>
#include <exception>
#include <string>

#include "common.h"

namespace {

// Copies block pairs[2i] of src to block pairs[2i+1] of dst, merging consecutive runs.
int copy_pairs(const char* src, char* dst, size_t block_bytes, const int32_t* pairs, int32_t num_pairs,
               cudaMemcpyKind kind, cudaStream_t stream, const char* what) {
  int32_t i = 0;
  while (i < num_pairs) {
    int32_t run = 1;
    while (i + run < num_pairs && pairs[2 * (i + run)] == pairs[2 * i] + run &&
           pairs[2 * (i + run) + 1] == pairs[2 * i + 1] + run) {
      ++run;
    }
    const size_t from = static_cast<size_t>(pairs[2 * i]) * block_bytes;
    const size_t to = static_cast<size_t>(pairs[2 * i + 1]) * block_bytes;
    const cudaError_t err = cudaMemcpyAsync(dst + to, src + from, run * block_bytes, kind, stream);
    if (err != cudaSuccess) {
      return trtpaged::fail(TRTPAGED_ERR_CUDA, std::string(what) + ": " + cudaGetErrorString(err));
    }
    i += run;
  }
  return trtpaged::ok();
}

}  // namespace

extern "C" TRTPAGED_API int trtpaged_copy_blocks_cuda(void* kv_cache, int32_t num_kv_blocks, size_t block_bytes,
                                                      const int32_t* pairs, int32_t num_pairs, void* stream) {
  try {
    const int rc = trtpaged::validate_block_pairs(pairs, num_pairs, num_kv_blocks, num_kv_blocks, true);
    if (rc != TRTPAGED_OK) return rc;
    if (num_pairs == 0 || block_bytes == 0) return trtpaged::ok();
    if (kv_cache == nullptr) return trtpaged::fail(TRTPAGED_ERR_INVALID_ARGUMENT, "kv_cache is NULL");
    char* pool = static_cast<char*>(kv_cache);
    return copy_pairs(pool, pool, block_bytes, pairs, num_pairs, cudaMemcpyDeviceToDevice,
                      static_cast<cudaStream_t>(stream), "copy_blocks cudaMemcpyAsync");
  } catch (const std::exception& e) {
    return trtpaged::fail(TRTPAGED_ERR_CUDA, std::string("trtpaged_copy_blocks_cuda: ") + e.what());
  } catch (...) {
    return trtpaged::fail(TRTPAGED_ERR_CUDA, "trtpaged_copy_blocks_cuda: unknown exception");
  }
}

extern "C" TRTPAGED_API int trtpaged_swap_blocks_cuda(const void* src_pool, int32_t src_num_kv_blocks, void* dst_pool,
                                                      int32_t dst_num_kv_blocks, size_t block_bytes,
                                                      const int32_t* pairs, int32_t num_pairs, void* stream) {
  try {
    const int rc = trtpaged::validate_block_pairs(pairs, num_pairs, src_num_kv_blocks, dst_num_kv_blocks, false);
    if (rc != TRTPAGED_OK) return rc;
    if (num_pairs == 0 || block_bytes == 0) return trtpaged::ok();
    if (src_pool == nullptr || dst_pool == nullptr) {
      return trtpaged::fail(TRTPAGED_ERR_INVALID_ARGUMENT, "src_pool and dst_pool must be non-NULL");
    }
    return copy_pairs(static_cast<const char*>(src_pool), static_cast<char*>(dst_pool), block_bytes, pairs,
                      num_pairs, cudaMemcpyDefault, static_cast<cudaStream_t>(stream),
                      "swap_blocks cudaMemcpyAsync");
  } catch (const std::exception& e) {
    return trtpaged::fail(TRTPAGED_ERR_CUDA, std::string("trtpaged_swap_blocks_cuda: ") + e.what());
  } catch (...) {
    return trtpaged::fail(TRTPAGED_ERR_CUDA, "trtpaged_swap_blocks_cuda: unknown exception");
  }
}
