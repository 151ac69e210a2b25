#include "tensorrt/fields.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#include "cuda/head_dims.h"

namespace trtpaged {
namespace trt {
namespace {

using nvinfer1::PluginField;
using nvinfer1::PluginFieldCollection;
using nvinfer1::PluginFieldType;

constexpr char const* kIntFields[] = {"num_heads", "num_kv_heads", "head_dim", "block_size", "layer"};
constexpr char const* kScale = "scale";
constexpr char const* kWorkspace = "workspace_bytes";  // optional: absent in the ONNX node
constexpr char const* kKvCacheDtype = "kv_cache_dtype";  // optional string: auto (absent), int8, fp8_e4m3, ...
// Deprecated spelling of kv_cache_dtype in the engine.plan files of older builds, read for one release
// (trtpaged/names.py RENAMED_KEYS). An older ONNX graph's attribute of that name never arrives: the parser passes
// only the fields getFieldNames lists (the build refuses such a graph first: builder/tensorrt_rules.py).
constexpr char const* kKvCacheDtypeDeprecated = "kv_dtype";
constexpr char const* kKvPool = "kv_pool";             // optional string: aliased (absent), address
constexpr char const* kNumLayers = "num_layers";       // optional int: required with kv_pool address
constexpr KvFormat kFormats[] = {KvFormat::kAuto,    KvFormat::kInt8,    KvFormat::kFp8E4M3,
                                 KvFormat::kFloat32, KvFormat::kFloat16, KvFormat::kBFloat16};
constexpr char const* kWindow = "sliding_window";      // optional int: 0 (absent) or the layer's window
constexpr char const* kSoftcap = "logit_softcap";      // optional float: 0 (absent) or the score soft-cap

int32_t* int_slot(AttentionFields& f, std::string const& name) {
  if (name == "num_heads") return &f.num_heads;
  if (name == "num_kv_heads") return &f.num_kv_heads;
  if (name == "head_dim") return &f.head_dim;
  if (name == "block_size") return &f.block_size;
  if (name == "layer") return &f.layer;
  return nullptr;
}

std::invalid_argument field_error(std::string const& name, std::string const& why) {
  return std::invalid_argument(std::string(kPluginName) + " field " + name + ": " + why);
}

int64_t read_int(PluginField const& field) {
  if (field.data == nullptr || field.length != 1) throw field_error(field.name, "expected one value");
  switch (field.type) {
    case PluginFieldType::kINT32: return *static_cast<int32_t const*>(field.data);
    case PluginFieldType::kINT64: return *static_cast<int64_t const*>(field.data);
    default: throw field_error(field.name, "expected an int32 or int64 field");
  }
}

double read_float(PluginField const& field) {
  if (field.data == nullptr || field.length != 1) throw field_error(field.name, "expected one value");
  switch (field.type) {
    case PluginFieldType::kFLOAT32: return *static_cast<float const*>(field.data);
    case PluginFieldType::kFLOAT64: return *static_cast<double const*>(field.data);
    default: throw field_error(field.name, "expected a float32 or float64 field");
  }
}

// A kCHAR field as a string. TensorRT's ONNX parser counts the terminating NUL in the length (onnxOpImporters.cpp
// copyField for a STRING attribute appends '\0'); getFieldsToSerialize does not: trailing NULs are dropped.
std::string read_string(PluginField const& field) {
  if (field.type != PluginFieldType::kCHAR) throw field_error(field.name, "expected a string (char) field");
  if (field.data == nullptr || field.length < 0) throw field_error(field.name, "expected a string");
  std::string s(static_cast<char const*>(field.data), static_cast<size_t>(field.length));
  while (!s.empty() && s.back() == '\0') s.pop_back();
  return s;
}

KvFormat parse_kv_format(std::string const& name) {
  for (KvFormat f : kFormats) {
    if (name == kv_format_name(f)) return f;
  }
  throw field_error(kKvCacheDtype, "\"" + name + "\" is not one of auto, int8, fp8_e4m3, float32, float16, "
                                   "bfloat16 (kv_cache_dtype of the build)");
}

KvPool parse_kv_pool(std::string const& name) {
  for (KvPool p : {KvPool::kAliased, KvPool::kAddress}) {
    if (name == kv_pool_name(p)) return p;
  }
  throw field_error(kKvPool, "\"" + name + "\" is not one of aliased, address (tensorrt.kv_pool of the build)");
}

void validate(AttentionFields const& f) {
  if (f.num_heads < 1) throw field_error("num_heads", "must be >= 1, got " + std::to_string(f.num_heads));
  if (f.num_kv_heads < 1 || f.num_heads % f.num_kv_heads != 0) {
    throw field_error("num_kv_heads", "must divide num_heads " + std::to_string(f.num_heads) + ", got " +
                                          std::to_string(f.num_kv_heads));
  }
  if (!cuda::head_dim_supported(f.head_dim)) {
    throw field_error("head_dim", std::to_string(f.head_dim) + " has no CUDA kernel (supported: " +
                                      supported_head_dims() + ")");
  }
  bool const block_ok = f.block_size == 8 || f.block_size == 16 || f.block_size == 32 || f.block_size == 64 ||
                        f.block_size == 128;
  if (!block_ok) throw field_error("block_size", "must be 8, 16, 32, 64 or 128, got " + std::to_string(f.block_size));
  if (f.layer < 0) throw field_error("layer", "must be >= 0, got " + std::to_string(f.layer));
  if (!std::isfinite(f.scale) || f.scale <= 0.F) throw field_error("scale", "must be a finite number > 0");
  if (f.sliding_window < 0)
    throw field_error(kWindow, "must be >= 0 (0: none), got " + std::to_string(f.sliding_window));
  if (!std::isfinite(f.logit_softcap) || f.logit_softcap < 0.F)
    throw field_error(kSoftcap, "must be a finite number >= 0 (0: none)");
  if (f.kv_pool == KvPool::kAddress) {
    if (f.num_layers <= f.layer) {
      throw field_error(kNumLayers, "kv_pool address needs the pool's layer count (> layer " +
                                        std::to_string(f.layer) + "), got " + std::to_string(f.num_layers));
    }
    if (f.kv_format == KvFormat::kAuto) {
      throw field_error(kKvCacheDtype, "kv_pool address needs the pool's type named (float32, float16, bfloat16, "
                                       "int8 or fp8_e4m3): no pool tensor shows it");
    }
  }
}

}  // namespace

char const* kv_format_name(KvFormat format) noexcept {
  switch (format) {
    case KvFormat::kInt8: return "int8";
    case KvFormat::kFp8E4M3: return "fp8_e4m3";
    case KvFormat::kFloat32: return "float32";
    case KvFormat::kFloat16: return "float16";
    case KvFormat::kBFloat16: return "bfloat16";
    case KvFormat::kAuto: break;
  }
  return "auto";
}

bool kv_format_quantized(KvFormat format) noexcept {
  return format == KvFormat::kInt8 || format == KvFormat::kFp8E4M3;
}

char const* kv_pool_name(KvPool pool) noexcept { return pool == KvPool::kAddress ? "address" : "aliased"; }

std::string supported_head_dims() {
  std::string s;
  for (int d : cuda::kHeadDims) s += (s.empty() ? "" : ", ") + std::to_string(d);
  return s;
}

AttentionFields parse_fields(PluginFieldCollection const* fc) {
  if (fc == nullptr) throw std::invalid_argument(std::string(kPluginName) + ": no plugin fields given");
  AttentionFields f;
  bool seen_int[5] = {false, false, false, false, false};
  bool seen_scale = false;
  for (int32_t i = 0; i < fc->nbFields; ++i) {
    PluginField const& field = fc->fields[i];
    if (field.name == nullptr) continue;
    std::string const name(field.name);
    if (name == kScale) {
      f.scale = static_cast<float>(read_float(field));
      seen_scale = true;
    } else if (name == kKvCacheDtype || name == kKvCacheDtypeDeprecated) {
      f.kv_format = parse_kv_format(read_string(field));
    } else if (name == kWindow) {
      int64_t const value = read_int(field);
      if (value < 0 || value > INT32_MAX) throw field_error(name, "must be in [0, 2^31), got " + std::to_string(value));
      f.sliding_window = static_cast<int32_t>(value);
    } else if (name == kSoftcap) {
      f.logit_softcap = static_cast<float>(read_float(field));
    } else if (name == kKvPool) {
      f.kv_pool = parse_kv_pool(read_string(field));
    } else if (name == kNumLayers) {
      int64_t const value = read_int(field);
      if (value < 0 || value > INT32_MAX) throw field_error(name, "out of range");
      f.num_layers = static_cast<int32_t>(value);
    } else if (name == kWorkspace) {
      f.workspace_bytes = read_int(field);
      if (f.workspace_bytes < 0) throw field_error(name, "must be >= 0");
    } else if (int32_t* slot = int_slot(f, name)) {
      int64_t const value = read_int(field);
      if (value < INT32_MIN || value > INT32_MAX) throw field_error(name, "out of int32 range");
      *slot = static_cast<int32_t>(value);
      for (int k = 0; k < 5; ++k) seen_int[k] = seen_int[k] || name == kIntFields[k];
    }  // other fields (e.g. plugin_version) are not ours
  }
  for (int k = 0; k < 5; ++k) {
    if (!seen_int[k]) throw field_error(kIntFields[k], "missing");
  }
  if (!seen_scale) throw field_error(kScale, "missing");
  validate(f);
  return f;
}

PluginFieldCollection const* field_names() noexcept {
  static PluginField const fields[] = {
      PluginField(kIntFields[0], nullptr, PluginFieldType::kINT32, 1),
      PluginField(kIntFields[1], nullptr, PluginFieldType::kINT32, 1),
      PluginField(kIntFields[2], nullptr, PluginFieldType::kINT32, 1),
      PluginField(kIntFields[3], nullptr, PluginFieldType::kINT32, 1),
      PluginField(kIntFields[4], nullptr, PluginFieldType::kINT32, 1),
      PluginField(kScale, nullptr, PluginFieldType::kFLOAT32, 1),
      PluginField(kKvCacheDtype, nullptr, PluginFieldType::kCHAR, 0),
      PluginField(kWindow, nullptr, PluginFieldType::kINT32, 1),
      PluginField(kSoftcap, nullptr, PluginFieldType::kFLOAT32, 1),
      PluginField(kKvPool, nullptr, PluginFieldType::kCHAR, 0),
      PluginField(kNumLayers, nullptr, PluginFieldType::kINT32, 1),
  };
  static PluginFieldCollection const collection{static_cast<int32_t>(sizeof(fields) / sizeof(fields[0])), fields};
  return &collection;
}

SerializedFields::SerializedFields(AttentionFields const& values)
    : mValues(values), mKvCacheDtype(kv_format_name(values.kv_format)), mKvPool(kv_pool_name(values.kv_pool)) {
  auto const i32 = PluginFieldType::kINT32;
  mFields = {
      PluginField(kIntFields[0], &mValues.num_heads, i32, 1),
      PluginField(kIntFields[1], &mValues.num_kv_heads, i32, 1),
      PluginField(kIntFields[2], &mValues.head_dim, i32, 1),
      PluginField(kIntFields[3], &mValues.block_size, i32, 1),
      PluginField(kIntFields[4], &mValues.layer, i32, 1),
      PluginField(kScale, &mValues.scale, PluginFieldType::kFLOAT32, 1),
      PluginField(kKvCacheDtype, mKvCacheDtype.c_str(), PluginFieldType::kCHAR,
                  static_cast<int32_t>(mKvCacheDtype.size())),
      PluginField(kWindow, &mValues.sliding_window, i32, 1),
      PluginField(kSoftcap, &mValues.logit_softcap, PluginFieldType::kFLOAT32, 1),
      PluginField(kKvPool, mKvPool.c_str(), PluginFieldType::kCHAR, static_cast<int32_t>(mKvPool.size())),
      PluginField(kNumLayers, &mValues.num_layers, i32, 1),
  };
  if (mValues.workspace_bytes >= 0) {
    mFields.emplace_back(kWorkspace, &mValues.workspace_bytes, PluginFieldType::kINT64, 1);
  }
  mCollection.nbFields = static_cast<int32_t>(mFields.size());
  mCollection.fields = mFields.data();
}

}  // namespace trt
}  // namespace trtpaged
