#include "tensorrt/attention_io.h"

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <string>

namespace trtpaged {
namespace trt {
namespace {

using nvinfer1::DataType;
using nvinfer1::Dims;

constexpr char const* kInputNames[kNbInputs] = {"q",           "k",           "v",           "kv_cache",
                                                "positions",   "query_start", "context_lens", "block_tables"};
constexpr int32_t kRanks[kNbInputs] = {3, 3, 3, 6, 1, 1, 1, 2};

std::string dims_str(Dims const& d) {
  std::string s = "[";
  for (int32_t i = 0; i < d.nbDims; ++i) s += (i ? ", " : "") + std::to_string(d.d[i]);
  return s + "]";
}

// Checks d.d[axis] == want when both are known (>= 0).
void expect(Dims const& d, int32_t input, int32_t axis, int64_t want, char const* what) {
  int64_t const got = d.d[axis];
  if (got >= 0 && want >= 0 && got != want) {
    throw std::invalid_argument(std::string(kPluginName) + " input " + kInputNames[input] + " " + dims_str(d) +
                                ": dimension " + std::to_string(axis) + " must be " + what + " = " +
                                std::to_string(want));
  }
}

int32_t to_i32(int64_t v, char const* what) {
  if (v < 0 || v > std::numeric_limits<int32_t>::max()) {
    throw std::invalid_argument(std::string(kPluginName) + ": " + what + " " + std::to_string(v) +
                                " is not a non-negative int32");
  }
  return static_cast<int32_t>(v);
}

trtpaged_dtype kernel_dtype(DataType type, char const* what) {
  switch (type) {
    case DataType::kFLOAT: return TRTPAGED_FLOAT32;
    case DataType::kHALF: return TRTPAGED_FLOAT16;
    case DataType::kBF16: return TRTPAGED_BFLOAT16;
    default: throw std::invalid_argument(std::string(kPluginName) + ": " + what + " must be fp32, fp16 or bf16");
  }
}

bool quantized(KvFormat format) { return kv_format_quantized(format); }

bool address(AttentionFields const& f) { return f.kv_pool == KvPool::kAddress; }

// The float type a named format stores (kAuto: none).
bool named_float(KvFormat format, DataType* type) {
  switch (format) {
    case KvFormat::kFloat32: *type = DataType::kFLOAT; return true;
    case KvFormat::kFloat16: *type = DataType::kHALF; return true;
    case KvFormat::kBFloat16: *type = DataType::kBF16; return true;
    default: return false;
  }
}

int64_t element_bytes(DataType type) { return type == DataType::kHALF || type == DataType::kBF16 ? 2 : 1; }

}  // namespace

int32_t output_count(AttentionFields const& f) noexcept { return address(f) ? 1 : kNbOutputs; }

bool is_activation_type(DataType type) noexcept {
  return type == DataType::kFLOAT || type == DataType::kHALF || type == DataType::kBF16;
}

bool is_pool_type(AttentionFields const& f, DataType type) noexcept {
  if (address(f)) return type == DataType::kINT64;
  // not kUINT8: the aliased pool is also output kv_cache_out, and a plugin output may not be kUINT8 (getOutputDataTypes)
  if (quantized(f.kv_format)) return type == DataType::kINT8 || type == DataType::kHALF;
  DataType named{};
  return named_float(f.kv_format, &named) ? type == named : is_activation_type(type);
}

void check_shapes(AttentionFields const& f, Dims const* in, int32_t nbInputs, DataType pool_type) {
  if (nbInputs != kNbInputs) {
    throw std::invalid_argument(std::string(kPluginName) + ": expected 8 inputs, got " + std::to_string(nbInputs));
  }
  for (int32_t i = 0; i < kNbInputs; ++i) {
    int32_t const rank = i == kKvCache && address(f) ? 1 : kRanks[i];
    if (in[i].nbDims != rank) {
      throw std::invalid_argument(std::string(kPluginName) + " input " + kInputNames[i] + " " + dims_str(in[i]) +
                                  ": expected rank " + std::to_string(rank));
    }
  }
  Dims const& q = in[kQ];
  Dims const& pool = in[kKvCache];
  int64_t const tokens = q.d[0];
  int64_t const seqs = in[kBlockTables].d[0];
  expect(q, kQ, 1, f.num_heads, "num_heads");
  expect(q, kQ, 2, f.head_dim, "head_dim");
  for (int32_t kv : {kK, kV}) {
    expect(in[kv], kv, 0, tokens, "num_tokens");
    expect(in[kv], kv, 1, f.num_kv_heads, "num_kv_heads");
    expect(in[kv], kv, 2, f.head_dim, "head_dim");
  }
  if (address(f)) {
    expect(pool, kKvCache, 0, 2, "2 (the pool's device address, num_kv_blocks)");
  } else {
    expect(pool, kKvCache, 2, 2, "2 (K and V)");
    expect(pool, kKvCache, 3, f.num_kv_heads, "num_kv_heads");
    expect(pool, kKvCache, 4, f.block_size, "block_size");
    if (quantized(f.kv_format)) {  // head_dim + 2 bytes, as int8 or as fp16 pairs (head_dim is even)
      expect(pool, kKvCache, 5, (f.head_dim + 2) / element_bytes(pool_type),
             (std::string("(head_dim + 2) bytes (a ") + kv_format_name(f.kv_format) +
              " row: codes, then its fp16 scale) in the pool type's elements").c_str());
    } else {
      expect(pool, kKvCache, 5, f.head_dim, "head_dim");
    }
    if (pool.d[1] >= 0 && f.layer >= pool.d[1]) {
      throw std::invalid_argument(std::string(kPluginName) + ": layer " + std::to_string(f.layer) +
                                  " is outside the pool's " + std::to_string(pool.d[1]) + " layers");
    }
  }
  expect(in[kPositions], kPositions, 0, tokens, "num_tokens");
  expect(in[kQueryStart], kQueryStart, 0, seqs >= 0 ? seqs + 1 : -1, "num_seqs + 1");
  expect(in[kContextLens], kContextLens, 0, seqs, "num_seqs");
}

trtpaged_attention_params make_params(AttentionFields const& f, Dims const* in, DataType io_type, DataType kv_type) {
  trtpaged_attention_params p{};
  p.num_tokens = to_i32(in[kQ].d[0], "num_tokens");
  p.num_seqs = to_i32(in[kBlockTables].d[0], "num_seqs");
  p.max_blocks_per_seq = to_i32(in[kBlockTables].d[1], "max_blocks_per_seq");
  p.num_heads = f.num_heads;
  p.num_kv_heads = f.num_kv_heads;
  p.head_dim = f.head_dim;
  p.num_kv_blocks = address(f) ? 1 : to_i32(in[kKvCache].d[0], "num_kv_blocks");
  p.num_layers = address(f) ? f.num_layers : to_i32(in[kKvCache].d[1], "num_layers");
  p.layer = f.layer;
  p.block_size = f.block_size;
  p.scale = f.scale;
  p.io_dtype = kernel_dtype(io_type, "q");
  DataType named{};
  if (!is_pool_type(f, kv_type)) {
    throw std::invalid_argument(std::string(kPluginName) + ": kv_cache's type does not fit kv_cache_dtype " +
                                kv_format_name(f.kv_format) + " and kv_pool " + kv_pool_name(f.kv_pool));
  }
  if (quantized(f.kv_format)) {
    p.kv_cache_dtype = f.kv_format == KvFormat::kInt8 ? TRTPAGED_INT8 : TRTPAGED_FP8_E4M3;
  } else if (named_float(f.kv_format, &named)) {
    p.kv_cache_dtype = kernel_dtype(named, "kv_cache_dtype");
  } else {
    p.kv_cache_dtype = kernel_dtype(kv_type, "kv_cache");
  }
  return p;
}

PoolAddress read_pool_address(AttentionFields const& f, void const* host_input) {
  if (!address(f)) throw std::logic_error("read_pool_address: kv_pool is aliased");
  if (host_input == nullptr) throw std::invalid_argument(std::string(kPluginName) + ": no kv_cache address tensor");
  int64_t const* values = static_cast<int64_t const*>(host_input);
  if (values[0] == 0) throw std::invalid_argument(std::string(kPluginName) + ": kv_cache address is null");
  if (values[1] < 1 || values[1] > std::numeric_limits<int32_t>::max()) {
    throw std::invalid_argument(std::string(kPluginName) + ": kv_cache num_kv_blocks " + std::to_string(values[1]) +
                                " is not in [1, 2^31)");
  }
  return {reinterpret_cast<void*>(static_cast<intptr_t>(values[0])), static_cast<int32_t>(values[1])};
}

int32_t max_context_len(AttentionFields const& f, Dims const& block_tables) {
  int64_t const span = std::max<int64_t>(block_tables.d[1], 0) * f.block_size;
  return static_cast<int32_t>(std::min<int64_t>(span, std::numeric_limits<int32_t>::max()));
}

size_t workspace_bound(AttentionFields const& f, nvinfer1::DynamicPluginTensorDesc const* inputs) {
  Dims shapes[kNbInputs];
  for (int32_t i = 0; i < kNbInputs; ++i) shapes[i] = inputs[i].max;
  Dims const& tables_min = inputs[kBlockTables].min;
  Dims const& tables_max = inputs[kBlockTables].max;
  int64_t const seqs_lo = std::max<int64_t>(tables_min.d[0], 1);
  int64_t const blocks_lo = std::max<int64_t>(tables_min.d[1], 1);
  size_t bound = 0;
  // The decode split count falls as num_seqs grows, so num_seqs * splits is not
  // monotonic: take the largest size over every shape the profile admits.
  for (int64_t seqs = seqs_lo; seqs <= tables_max.d[0]; ++seqs) {
    for (int64_t blocks = blocks_lo; blocks <= tables_max.d[1]; ++blocks) {
      shapes[kBlockTables].d[0] = seqs;
      shapes[kBlockTables].d[1] = blocks;
      trtpaged_attention_params const p =
          make_params(f, shapes, inputs[kQ].desc.type, inputs[kKvCache].desc.type);
      size_t const bytes = trtpaged_paged_attention_cuda_workspace_size(&p, max_context_len(f, shapes[kBlockTables]));
      char const* error = trtpaged_last_error();
      if (bytes == 0 && error != nullptr && *error != '\0') {  // 0 is also the answer for "unsupported"
        throw std::invalid_argument(std::string(kPluginName) + " layer " + std::to_string(f.layer) + ": " + error);
      }
      bound = std::max(bound, bytes);
    }
  }
  return bound;
}

}  // namespace trt
}  // namespace trtpaged
