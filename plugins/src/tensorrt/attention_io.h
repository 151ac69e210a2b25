// The paged-attention node's tensors as TensorRT sees them, and their mapping
// onto the kernel C ABI (trtpaged/trtpaged.h): shape checks, kernel params and
// the workspace bound. No TensorRT plugin logic and no math live here.
#pragma once

#include <NvInferRuntime.h>

#include <cstddef>
#include <cstdint>

#include "tensorrt/fields.h"
#include "trtpaged/trtpaged.h"

namespace trtpaged {
namespace trt {

// Input order of the ONNX node (trtpaged/builder/onnx_node.py INPUTS).
enum Input : int32_t {
  kQ = 0,           // [num_tokens, num_heads, head_dim]
  kK = 1,           // [num_tokens, num_kv_heads, head_dim]
  kV = 2,           // [num_tokens, num_kv_heads, head_dim]
  kKvCache = 3,     // [num_kv_blocks, num_layers, 2, num_kv_heads, block_size, row], row: head_dim, or head_dim + 2
                    // bytes when quantized (in the pool type's elements); kv_pool address: int64 [2] on the host
  kPositions = 4,   // [num_tokens] int32
  kQueryStart = 5,  // [num_seqs + 1] int32
  kContextLens = 6, // [num_seqs] int32
  kBlockTables = 7, // [num_seqs, max_blocks_per_seq] int32
  kNbInputs = 8
};
// Outputs: out [num_tokens, num_heads, head_dim], and (kv_pool aliased) the pool aliased to input kKvCache.
enum Output : int32_t { kOut = 0, kKvCacheOut = 1, kNbOutputs = 2 };

// The plugin's output count: 2 with an aliased pool, 1 (out) with the pool's address.
int32_t output_count(AttentionFields const& f) noexcept;

bool is_activation_type(nvinfer1::DataType type) noexcept;  // fp32, fp16 or bf16

// The type input kKvCache may have: int64 (the address) for kv_pool address; else for a quantized format
// int8 or fp16 (the row's bytes as those elements), for a named float format that type, for auto
// any activation type.
bool is_pool_type(AttentionFields const& f, nvinfer1::DataType type) noexcept;

// Checks ranks and every known (non-negative) dimension against the fields and
// each other; throws std::invalid_argument naming the tensor. pool_type: input kKvCache's type.
void check_shapes(AttentionFields const& f, nvinfer1::Dims const* inputs, int32_t nbInputs,
                  nvinfer1::DataType pool_type);

// Kernel params of one call, from the resolved input shapes and types. With kv_pool address, num_kv_blocks
// is 1 here (enqueue sets it from the host tensor) and num_layers the field's.
trtpaged_attention_params make_params(AttentionFields const& f, nvinfer1::Dims const* inputs,
                                      nvinfer1::DataType io_type, nvinfer1::DataType kv_type);

// {device address, num_kv_blocks} of the pool from kv_pool address's host tensor; throws std::invalid_argument
// unless the address is set and num_kv_blocks >= 1.
struct PoolAddress {
  void* pool;
  int32_t num_kv_blocks;
};
PoolAddress read_pool_address(AttentionFields const& f, void const* host_input);

// Upper bound of context_lens: max_blocks_per_seq * block_size.
int32_t max_context_len(AttentionFields const& f, nvinfer1::Dims const& block_tables);

// Workspace enough for every shape in the inputs' [min, max] ranges, from the
// kernel ABI's workspace function (which is not monotonic in num_seqs).
size_t workspace_bound(AttentionFields const& f, nvinfer1::DynamicPluginTensorDesc const* inputs);

}  // namespace trt
}  // namespace trtpaged
