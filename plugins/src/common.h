// Internal helpers shared by the CPU and CUDA implementations: error reporting
// and argument validation. Nothing here is exported.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "trtpaged/trtpaged.h"

namespace trtpaged {

// Records msg as this thread's last error and returns code.
int fail(int code, const std::string& msg);
// Clears this thread's last error and returns TRTPAGED_OK.
int ok();

size_t dtype_size(trtpaged_dtype dtype);
bool dtype_valid(trtpaged_dtype dtype);

// Checks the scalar fields of params (head counts, head_dim, block_size, layer,
// dtypes). max_head_dim is the backend's limit. Returns TRTPAGED_OK or an error.
int validate_attention_params(const trtpaged_attention_params* p, int max_head_dim,
                              bool head_dim_multiple_of_16_only, const int* supported_head_dims,
                              int num_supported_head_dims);

// Checks block copy/swap pairs (host array).
int validate_block_pairs(const int32_t* pairs, int32_t num_pairs, int32_t src_num_blocks,
                         int32_t dst_num_blocks, bool same_pool);

}  // namespace trtpaged
