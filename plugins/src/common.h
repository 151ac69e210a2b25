// Internal helpers shared by the CPU and CUDA implementations: error reporting
// and argument validation. Nothing here is exported.
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <string>

#include "trtpaged/trtpaged.h"

namespace trtpaged {

// Records msg as this thread's last error and returns code.
int fail(int code, const std::string& msg);
// What an exception caught at the C ABI's edge becomes: OUT_OF_MEMORY for std::bad_alloc, INVALID_ARGUMENT else.
int fail_from(const std::exception& e, const char* where);
// Clears this thread's last error and returns TRTPAGED_OK.
int ok();

size_t dtype_size(trtpaged_dtype dtype);
// Float dtypes (io and kv).
bool dtype_valid(trtpaged_dtype dtype);
// Any kv_cache_dtype: the float ones plus the quantized int8 and fp8_e4m3.
bool kv_cache_dtype_valid(trtpaged_dtype dtype);
bool kv_cache_dtype_quantized(trtpaged_dtype dtype);

// What a backend supports, for validate_attention_params.
struct AttentionLimits {
  const int* head_dims;     // exact list of supported head_dims, or nullptr
  int num_head_dims;
  int head_dim_multiple;    // when head_dims is nullptr: head_dim % this == 0 ...
  int max_head_dim;         // ... and head_dim <= this
  bool any_block_size;      // false: only 8, 16, 32, 64, 128
};

// Checks the scalar fields of params (counts, head_dim, block_size, layer,
// dtypes) against a backend's limits. Returns TRTPAGED_OK or an error.
int validate_attention_params(const trtpaged_attention_params* p, const AttentionLimits& limits);
// Checks trtpaged_attention_options: sliding_window >= 0, logit_softcap finite and >= 0.
int validate_attention_options(const trtpaged_attention_options& o);

// Checks block copy/swap pairs (host array).
int validate_block_pairs(const int32_t* pairs, int32_t num_pairs, int32_t src_num_kv_blocks,
                         int32_t dst_num_kv_blocks, bool same_pool);

}  // namespace trtpaged

namespace trtpaged {
// This thread's last error message ("" if none).
const char* last_error();
}  // namespace trtpaged
