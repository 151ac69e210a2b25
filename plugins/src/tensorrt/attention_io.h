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
  kKvCache = 3,     // [num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim (+ 2 when quantized)]
  kPositions = 4,   // [num_tokens] int32
  kQueryStart = 5,  // [num_seqs + 1] int32
  kContextLens = 6, // [num_seqs] int32
  kBlockTables = 7, // [num_seqs, max_blocks_per_seq] int32
  kNbInputs = 8
};
// Outputs: out [num_tokens, num_heads, head_dim], and the pool aliased to input kKvCache.
enum Output : int32_t { kOut = 0, kKvCacheOut = 1, kNbOutputs = 2 };

bool is_activation_type(nvinfer1::DataType type) noexcept;  // fp32, fp16 or bf16

// The pool tensor type the plugin takes for a kv format: int8 bytes when quantized, else any activation type.
bool is_pool_type(KvFormat format, nvinfer1::DataType type) noexcept;

// Checks ranks and every known (non-negative) dimension against the fields and
// each other; throws std::invalid_argument naming the tensor.
void check_shapes(AttentionFields const& f, nvinfer1::Dims const* inputs, int32_t nbInputs);

// Kernel params of one call, from the resolved input shapes and types.
trtpaged_attention_params make_params(AttentionFields const& f, nvinfer1::Dims const* inputs,
                                      nvinfer1::DataType io_type, nvinfer1::DataType kv_type);

// Upper bound of context_lens: max_blocks_per_seq * block_size.
int32_t max_context_len(AttentionFields const& f, nvinfer1::Dims const& block_tables);

// Workspace enough for every shape in the inputs' [min, max] ranges, from the
// kernel ABI's workspace function (which is not monotonic in num_seqs).
size_t workspace_bound(AttentionFields const& f, nvinfer1::DynamicPluginTensorDesc const* inputs);

}  // namespace trt
}  // namespace trtpaged
