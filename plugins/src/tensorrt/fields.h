// The field spec of the paged-attention plugin: names, types and validation of
// the attributes the ONNX node carries (trtpaged/builder/onnx_node.py), and
// their round trip through PluginFieldCollection for build and serialization.
#pragma once

#include <NvInferRuntime.h>

#include <cstdint>
#include <string>
#include <vector>

namespace trtpaged {
namespace trt {

// The ONNX parser finds the creator by op_type, plugin_version and plugin_namespace.
constexpr char const* kPluginName = "TrtpagedPagedAttention";
constexpr char const* kPluginVersion = "1";
constexpr char const* kPluginNamespace = "trtpaged";

// How the plugin reads the pool (the node's kv_cache_dtype attribute): kAuto as values of the pool tensor's
// own float type; kInt8 / kFp8E4M3 as one-byte codes with an fp16 scale per row, rows of head_dim + 2
// bytes (trtpaged/trtpaged.h, "Quantized KV cache"), the pool tensor's type int8 or fp16 (the
// same bytes: tensorrt.quantized_pool); kFloat32 / kFloat16 / kBFloat16 name a float pool's type where
// no pool tensor shows it (kv_pool address).
enum class KvFormat : int32_t { kAuto = 0, kInt8 = 1, kFp8E4M3 = 2, kFloat32 = 3, kFloat16 = 4, kBFloat16 = 5 };

// The kv_cache_dtype attribute's spelling of a format: "auto", "int8", "fp8_e4m3", "float32", "float16", "bfloat16".
char const* kv_format_name(KvFormat format) noexcept;

// True for the one-byte-code formats (int8, fp8_e4m3).
bool kv_format_quantized(KvFormat format) noexcept;

// Where the pool is (the node's kv_pool attribute, model.yaml tensorrt.kv_pool):
// kAliased: input kv_cache is the pool tensor and output kv_cache_out is aliased to it (updated in place);
// kAddress: input kv_cache is an int64 [2] host tensor {the pool's device address, num_kv_blocks} that the
//           plugin writes through, and the plugin has one output (TensorRT-LLM's host pool pointers).
enum class KvPool : int32_t { kAliased = 0, kAddress = 1 };

char const* kv_pool_name(KvPool pool) noexcept;

// The node's attributes: everything the plugin needs besides the tensors' shapes.
struct AttentionFields {
  int32_t num_heads{0};
  int32_t num_kv_heads{0};
  int32_t head_dim{0};
  int32_t block_size{0};
  int32_t layer{0};
  float scale{0.F};
  KvFormat kv_format{KvFormat::kAuto};  // optional field kv_cache_dtype (absent: auto)
  int32_t sliding_window{0};  // optional field: the layer's sliding window (absent or 0: none)
  float logit_softcap{0.F};   // optional field: attention score soft-cap (absent or 0: none)
  KvPool kv_pool{KvPool::kAliased};     // optional field kv_pool (absent: aliased)
  int32_t num_layers{0};                // optional field num_layers: the pool's layers, needed for kv_pool address
  // Workspace bytes TensorRT reserves for every shape of the profile: not an ONNX
  // attribute, recorded at build (getWorkspaceSize) and serialized into the plan
  // so that enqueue checks each step's need against what TensorRT gives. -1: not known yet.
  int64_t workspace_bytes{-1};
};

// The head_dim values the CUDA kernels have, as text for messages ("64, 80, 96, 128").
std::string supported_head_dims();

// Reads and validates every field; throws std::invalid_argument naming the field.
AttentionFields parse_fields(nvinfer1::PluginFieldCollection const* fc);

// The fields createPlugin() expects (names and types; no data), for getFieldNames().
nvinfer1::PluginFieldCollection const* field_names() noexcept;

// A PluginFieldCollection whose fields point into a copy of the values it was given.
class SerializedFields {
 public:
  explicit SerializedFields(AttentionFields const& values);
  SerializedFields(SerializedFields const& other) : SerializedFields(other.mValues) {}
  SerializedFields& operator=(SerializedFields const&) = delete;

  nvinfer1::PluginFieldCollection const* collection() const noexcept { return &mCollection; }

 private:
  AttentionFields mValues;
  std::string mKvCacheDtype;  // kv_format_name(mValues.kv_format), the kv_cache_dtype field's characters
  std::string mKvPool;   // kv_pool_name(mValues.kv_pool)
  std::vector<nvinfer1::PluginField> mFields;
  nvinfer1::PluginFieldCollection mCollection{};
};

}  // namespace trt
}  // namespace trtpaged
