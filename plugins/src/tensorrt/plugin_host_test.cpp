// Host-side checks of the plugin glue, run without TensorRT or a GPU (tests/test_tensorrt.py
// builds and runs this): the creator and plugin are driven the way TensorRT drives them,
// and no call here reaches a CUDA kernel. Prints "FAIL ..." per failed check; exit status 1 then.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <stdexcept>
#include <string>

#include "tensorrt/allreduce_plugin.h"
#include "tensorrt/attention_io.h"
#include "tensorrt/communicator.h"
#include "tensorrt/paged_attention_creator.h"
#include "tensorrt/paged_attention_plugin.h"

using namespace nvinfer1;
using trtpaged::trt::PagedAttentionCreator;
using trtpaged::trt::PagedAttentionPlugin;

namespace {

int failures = 0;

void check(bool ok, char const* what) {
  if (!ok) {
    std::printf("FAIL %s\n", what);
    ++failures;
  }
}

struct Fields {
  int32_t num_heads = 8, num_kv_heads = 2, head_dim = 64, block_size = 16, layer = 0;
  float scale = 0.125F;
  int64_t workspace_bytes = -1;  // -1: not given
  std::string kv_cache_dtype;    // "": not given (auto)
  char const* kv_cache_dtype_name = "kv_cache_dtype";  // "kv_dtype": the deprecated spelling of older plans
  std::string kv_pool;           // "": not given (aliased)
  int32_t num_layers = -1;       // -1: not given
  PluginField fields[10];
  PluginFieldCollection fc{};

  PluginFieldCollection const* collection() {
    int32_t n = 0;
    fields[n++] = PluginField("num_heads", &num_heads, PluginFieldType::kINT32, 1);
    fields[n++] = PluginField("num_kv_heads", &num_kv_heads, PluginFieldType::kINT32, 1);
    fields[n++] = PluginField("head_dim", &head_dim, PluginFieldType::kINT32, 1);
    fields[n++] = PluginField("block_size", &block_size, PluginFieldType::kINT32, 1);
    fields[n++] = PluginField("layer", &layer, PluginFieldType::kINT32, 1);
    fields[n++] = PluginField("scale", &scale, PluginFieldType::kFLOAT32, 1);
    if (workspace_bytes >= 0) fields[n++] = PluginField("workspace_bytes", &workspace_bytes, PluginFieldType::kINT64, 1);
    // as TensorRT's ONNX parser passes a string attribute: terminating NUL counted (onnxOpImporters.cpp copyField)
    if (!kv_cache_dtype.empty()) {
      fields[n++] = PluginField(kv_cache_dtype_name, kv_cache_dtype.c_str(), PluginFieldType::kCHAR,
                                static_cast<int32_t>(kv_cache_dtype.size() + 1));
    }
    if (!kv_pool.empty()) {
      fields[n++] =
          PluginField("kv_pool", kv_pool.c_str(), PluginFieldType::kCHAR, static_cast<int32_t>(kv_pool.size() + 1));
    }
    if (num_layers >= 0) fields[n++] = PluginField("num_layers", &num_layers, PluginFieldType::kINT32, 1);
    fc.nbFields = n;
    fc.fields = fields;
    return &fc;
  }
};

Dims dims(std::initializer_list<int64_t> values) {
  Dims d{};
  d.nbDims = static_cast<int32_t>(values.size());
  int32_t i = 0;
  for (int64_t v : values) d.d[i++] = v;
  return d;
}

// Shapes of the 8 inputs for num_tokens, num_seqs and max_blocks_per_seq (head_dim 64, GQA 8/2);
// pool_row is the pool's last dimension (64, or 66 for a quantized pool).
void shapes(Dims* out, int64_t tokens, int64_t seqs, int64_t blocks, int64_t pool_row = 64) {
  out[0] = dims({tokens, 8, 64});
  out[1] = dims({tokens, 2, 64});
  out[2] = dims({tokens, 2, 64});
  out[3] = dims({4096, 2, 2, 2, 16, pool_row});
  out[4] = dims({tokens});
  out[5] = dims({seqs + 1});
  out[6] = dims({seqs});
  out[7] = dims({seqs, blocks});
}

DataType input_type(int32_t i) { return i < 4 ? DataType::kHALF : DataType::kINT32; }

PagedAttentionPlugin* as_plugin(IPluginV3* p) { return dynamic_cast<PagedAttentionPlugin*>(p); }

std::string serialized_string(PagedAttentionPlugin* plugin, char const* name) {
  PluginFieldCollection const* fc = plugin->getFieldsToSerialize();
  for (int32_t i = 0; fc != nullptr && i < fc->nbFields; ++i) {
    PluginField const& f = fc->fields[i];
    if (std::string(f.name) == name) return std::string(static_cast<char const*>(f.data), f.length);
  }
  return "";
}

std::string serialized_kv_cache_dtype(PagedAttentionPlugin* plugin) {
  return serialized_string(plugin, "kv_cache_dtype");
}

// Build-time descriptors of the 8 inputs over a profile from (1, 1, 1) to (2048, 4, 256).
void profile(DynamicPluginTensorDesc* in, int64_t pool_row, DataType pool_type) {
  Dims lo[8], hi[8];
  shapes(lo, 1, 1, 1, pool_row);
  shapes(hi, 2048, 4, 256, pool_row);
  for (int32_t i = 0; i < 8; ++i) {
    in[i].desc.dims = hi[i];
    in[i].desc.type = i == 3 ? pool_type : input_type(i);
    in[i].desc.format = TensorFormat::kLINEAR;
    in[i].min = lo[i];
    in[i].max = hi[i];
    in[i].opt = hi[i];
  }
}

// The quantized KV cache: kv_cache_dtype travels as a plugin field, the pool is int8 bytes with rows of
// head_dim + 2, and anything else is refused naming what is wrong.
void check_kv_cache_dtype_field(PagedAttentionCreator& creator) {
  for (char const* name : {"int8", "fp8_e4m3"}) {
    Fields f;
    f.kv_cache_dtype = name;
    std::unique_ptr<IPluginV3> p(creator.createPlugin("layer0", f.collection(), TensorRTPhase::kBUILD));
    check(p != nullptr, "kv_cache_dtype int8 / fp8_e4m3 must be accepted");
    if (p == nullptr) continue;
    PagedAttentionPlugin* plugin = as_plugin(p.get());
    check(serialized_kv_cache_dtype(plugin) == name, "kv_cache_dtype is serialized as given");
    DynamicPluginTensorDesc in[10]{};
    DynamicPluginTensorDesc out[2]{};
    profile(in, 66, DataType::kINT8);
    in[8] = in[0];  // out: q's type
    in[9] = in[3];  // kv_cache_out: the pool's
    check(plugin->supportsFormatCombination(3, in, 8, 2), "a quantized plugin takes an int8 pool");
    in[3].desc.type = DataType::kBF16;  // fp16 is the bytes as pairs (tensorrt.quantized_pool); bf16 is not
    check(!plugin->supportsFormatCombination(3, in, 8, 2), "a quantized plugin refuses a bf16 pool");
    profile(in, 66, DataType::kINT8);
    check(plugin->configurePlugin(in, 8, out, 2) == 0, "int8 pool with rows of head_dim + 2");
    check(plugin->getWorkspaceSize(in, 8, out, 2) > 0, "a quantized long-context profile needs a decode workspace");
    profile(in, 64, DataType::kINT8);
    check(plugin->configurePlugin(in, 8, out, 2) != 0, "rows of head_dim bytes leave no room for the scale");
    // the serialized fields recreate the same plugin (TensorRT's runtime phase)
    std::unique_ptr<IPluginV3> again(
        creator.createPlugin("layer0", plugin->getFieldsToSerialize(), TensorRTPhase::kRUNTIME));
    check(again != nullptr && serialized_kv_cache_dtype(as_plugin(again.get())) == name,
          "kv_cache_dtype survives serialization");
    // an engine.plan of an older build names the field kv_dtype: read as kv_cache_dtype, serialized the new way
    Fields old;
    old.kv_cache_dtype = name;
    old.kv_cache_dtype_name = "kv_dtype";
    old.workspace_bytes = 4096;  // a plan's fields record it
    std::unique_ptr<IPluginV3> read(creator.createPlugin("layer0", old.collection(), TensorRTPhase::kRUNTIME));
    check(read != nullptr && serialized_kv_cache_dtype(as_plugin(read.get())) == name,
          "the deprecated field name kv_dtype reads as kv_cache_dtype");
  }
  {  // a float (auto) plugin does not take an int8 pool
    Fields f;
    std::unique_ptr<IPluginV3> p(creator.createPlugin("layer0", f.collection(), TensorRTPhase::kBUILD));
    DynamicPluginTensorDesc in[10]{};
    profile(in, 64, DataType::kINT8);
    check(p != nullptr && !as_plugin(p.get())->supportsFormatCombination(3, in, 8, 2),
          "without kv_cache_dtype an int8 pool is refused");
    check(p != nullptr && serialized_kv_cache_dtype(as_plugin(p.get())) == "auto",
          "no kv_cache_dtype field serializes as auto");
  }
  {
    Fields f;
    f.kv_cache_dtype = "int4";
    std::unique_ptr<IPluginV3> p(creator.createPlugin("layer0", f.collection(), TensorRTPhase::kBUILD));
    check(p == nullptr, "kv_cache_dtype int4 must be refused at createPlugin");
  }
}

// tensorrt.quantized_pool: a quantized pool's rows of head_dim + 2 bytes may be typed int8 or fp16 (rows of
// (head_dim + 2) / 2 elements); not uint8 (the pool is also an output, and a plugin output may not be kUINT8); a
// float type other than fp16 is not the bytes.
void check_quantized_pool_types(PagedAttentionCreator& creator) {
  Fields f;
  f.kv_cache_dtype = "int8";
  std::unique_ptr<IPluginV3> p(creator.createPlugin("layer0", f.collection(), TensorRTPhase::kBUILD));
  if (p == nullptr) return check(false, "kv_cache_dtype int8 plugin");
  PagedAttentionPlugin* plugin = as_plugin(p.get());
  DynamicPluginTensorDesc in[10]{};
  DynamicPluginTensorDesc out[2]{};
  profile(in, 66, DataType::kUINT8);
  check(!plugin->supportsFormatCombination(3, in, 8, 2), "a quantized pool typed uint8 is refused");
  profile(in, 33, DataType::kHALF);
  check(plugin->supportsFormatCombination(3, in, 8, 2), "a quantized pool typed fp16 (byte pairs)");
  check(plugin->configurePlugin(in, 8, out, 2) == 0, "fp16 rows of (head_dim + 2) / 2");
  profile(in, 66, DataType::kHALF);
  check(plugin->configurePlugin(in, 8, out, 2) != 0, "fp16 rows of head_dim + 2 elements are twice the bytes");
  profile(in, 33, DataType::kFLOAT);
  check(!plugin->supportsFormatCombination(3, in, 8, 2), "a quantized pool typed fp32 is refused");
}

// tensorrt.kv_pool address: input 3 is int64 [2] {address, num_kv_blocks} on the host, one output, nothing aliased.
void check_address_pool(PagedAttentionCreator& creator) {
  {
    Fields f;
    f.kv_pool = "address";
    f.kv_cache_dtype = "float16";
    std::unique_ptr<IPluginV3> missing(creator.createPlugin("layer0", f.collection(), TensorRTPhase::kBUILD));
    check(missing == nullptr, "kv_pool address without num_layers is refused");
    f.num_layers = 2;
    f.kv_cache_dtype = "";
    std::unique_ptr<IPluginV3> unnamed(creator.createPlugin("layer0", f.collection(), TensorRTPhase::kBUILD));
    check(unnamed == nullptr, "kv_pool address with kv_cache_dtype auto is refused (no pool tensor shows its type)");
    f.kv_pool = "adress";
    f.kv_cache_dtype = "float16";
    std::unique_ptr<IPluginV3> typo(creator.createPlugin("layer0", f.collection(), TensorRTPhase::kBUILD));
    check(typo == nullptr, "kv_pool adress is refused");
  }
  for (char const* kv : {"float16", "int8"}) {
    Fields f;
    f.kv_pool = "address";
    f.kv_cache_dtype = kv;
    f.num_layers = 2;
    f.workspace_bytes = 1 << 20;
    std::unique_ptr<IPluginV3> p(creator.createPlugin("layer0", f.collection(), TensorRTPhase::kBUILD));
    if (p == nullptr) {
      check(false, "kv_pool address with num_layers and a named kv_cache_dtype");
      continue;
    }
    PagedAttentionPlugin* plugin = as_plugin(p.get());
    check(plugin->getNbOutputs() == 1, "kv_pool address: one output");
    check(plugin->getAliasedInput(0) == -1 && plugin->getAliasedInput(1) == -1, "kv_pool address: nothing aliased");
    DataType types_in[8] = {DataType::kHALF, DataType::kHALF, DataType::kHALF, DataType::kINT64,
                            DataType::kINT32, DataType::kINT32, DataType::kINT32, DataType::kINT32};
    DataType types_out[1] = {};
    check(plugin->getOutputDataTypes(types_out, 1, types_in, 8) == 0 && types_out[0] == DataType::kHALF,
          "kv_pool address: out has q's type");
    DynamicPluginTensorDesc in[9]{};
    DynamicPluginTensorDesc out[1]{};
    profile(in, 64, DataType::kINT64);
    for (DynamicPluginTensorDesc* d : {&in[3]}) d->desc.dims = d->min = d->max = d->opt = dims({2});
    in[8] = in[0];
    check(plugin->supportsFormatCombination(3, in, 8, 1), "kv_pool address: the pool input is int64");
    check(plugin->supportsFormatCombination(8, in, 8, 1), "kv_pool address: out is q's type");
    check(plugin->configurePlugin(in, 8, out, 1) == 0, "kv_pool address: configure over a profile");
    check(plugin->configurePlugin(in, 8, out, 2) != 0, "kv_pool address: two outputs are refused");
    in[3].desc.type = DataType::kHALF;
    check(!plugin->supportsFormatCombination(3, in, 8, 1), "kv_pool address: a float pool tensor is refused");
    check(serialized_string(plugin, "kv_pool") == "address", "kv_pool serialized");
    std::unique_ptr<IPluginV3> again(
        creator.createPlugin("layer0", plugin->getFieldsToSerialize(), TensorRTPhase::kRUNTIME));
    check(again != nullptr && as_plugin(again.get())->getNbOutputs() == 1 &&
              serialized_string(as_plugin(again.get()), "kv_cache_dtype") == kv,
          "kv_pool address, num_layers and kv_cache_dtype survive serialization");
    if (again == nullptr) continue;
    // enqueue reads the host tensor and refuses a null address before any CUDA call
    PluginTensorDesc step[8]{};
    Dims d[8];
    shapes(d, 4, 4, 2);
    d[3] = dims({2});
    for (int32_t i = 0; i < 8; ++i) {
      step[i].dims = d[i];
      step[i].type = types_in[i];
      step[i].format = TensorFormat::kLINEAR;
    }
    int64_t host[2] = {0, 4096};
    void const* inputs[8] = {nullptr, nullptr, nullptr, host, nullptr, nullptr, nullptr, nullptr};
    void* outputs[1] = {nullptr};
    check(as_plugin(again.get())->enqueue(step, nullptr, inputs, outputs, nullptr, nullptr) != 0,
          "kv_pool address: a null pool address is refused");
  }
  {
    trtpaged::trt::AttentionFields f;
    f.kv_pool = trtpaged::trt::KvPool::kAddress;
    int64_t host[2] = {0x7f0000001000, 512};
    trtpaged::trt::PoolAddress const a = trtpaged::trt::read_pool_address(f, host);
    check(a.pool == reinterpret_cast<void*>(0x7f0000001000) && a.num_kv_blocks == 512, "pool address read from host");
    host[1] = 0;
    bool threw = false;
    try {
      trtpaged::trt::read_pool_address(f, host);
    } catch (std::invalid_argument const&) {
      threw = true;
    }
    check(threw, "num_kv_blocks 0 is refused");
  }
}

int64_t serialized_workspace(PagedAttentionPlugin* plugin) {
  PluginFieldCollection const* fc = plugin->getFieldsToSerialize();
  for (int32_t i = 0; fc != nullptr && i < fc->nbFields; ++i) {
    if (std::string(fc->fields[i].name) == "workspace_bytes") return *static_cast<int64_t const*>(fc->fields[i].data);
  }
  return -1;
}

}  // namespace

int main() {
  PagedAttentionCreator creator;

  {  // head_dim without CUDA kernels: refused when the ONNX parser creates the plugin
    Fields f;
    f.head_dim = 32;
    std::unique_ptr<IPluginV3> p(creator.createPlugin("layer0", f.collection(), TensorRTPhase::kBUILD));
    check(p == nullptr, "head_dim 32 must be refused at createPlugin");
  }

  // Build phase: the workspace TensorRT is asked for is recorded and serialized.
  Fields build;
  std::unique_ptr<IPluginV3> built(creator.createPlugin("layer0", build.collection(), TensorRTPhase::kBUILD));
  check(built != nullptr, "head_dim 64 must be accepted");
  if (built == nullptr) return 1;
  PagedAttentionPlugin* plugin = as_plugin(built.get());
  check(serialized_workspace(plugin) == -1, "no workspace_bytes before TensorRT asked for the workspace");
  DynamicPluginTensorDesc in[8]{};
  DynamicPluginTensorDesc out[2]{};
  Dims lo[8], hi[8];
  shapes(lo, 1, 1, 1);
  shapes(hi, 2048, 4, 256);  // 4 sequences of up to 4096 tokens: decode splits use the workspace
  for (int32_t i = 0; i < 8; ++i) {
    in[i].desc.dims = hi[i];
    in[i].desc.type = input_type(i);
    in[i].desc.format = TensorFormat::kLINEAR;
    in[i].min = lo[i];
    in[i].max = hi[i];
    in[i].opt = hi[i];
  }
  check(plugin->configurePlugin(in, 8, out, 2) == 0, "configurePlugin over a valid profile");
  size_t const reserved = plugin->getWorkspaceSize(in, 8, out, 2);
  check(reserved > 0, "a long-context profile needs a decode workspace");
  check(serialized_workspace(plugin) == static_cast<int64_t>(reserved), "workspace_bytes serialized = reserved");

  {  // Runtime phase: a plan without workspace_bytes (serialized from an instance TensorRT never asked) is read.
    Fields old;
    std::unique_ptr<IPluginV3> p(creator.createPlugin("layer0", old.collection(), TensorRTPhase::kRUNTIME));
    check(p != nullptr, "a runtime plugin without workspace_bytes is read");
  }

  {  // Runtime phase: enqueue refuses a step that needs more workspace than the plan reserved.
    Fields small;
    small.workspace_bytes = 64;
    std::unique_ptr<IPluginV3> p(creator.createPlugin("layer0", small.collection(), TensorRTPhase::kRUNTIME));
    check(p != nullptr, "a runtime plugin with workspace_bytes");
    if (p != nullptr) {
      PluginTensorDesc step[8]{};
      Dims d[8];
      shapes(d, 4, 4, 256);  // 4 decode tokens over up to 4096 cached tokens each: needs splits
      for (int32_t i = 0; i < 8; ++i) {
        step[i].dims = d[i];
        step[i].type = input_type(i);
        step[i].format = TensorFormat::kLINEAR;
      }
      void const* inputs[8] = {};
      void* outputs[2] = {};
      int32_t const rc = as_plugin(p.get())->enqueue(step, nullptr, inputs, outputs, nullptr, nullptr);
      check(rc != 0, "enqueue must refuse a step needing more workspace than TensorRT reserved");
    }
  }

  check_kv_cache_dtype_field(creator);
  check_quantized_pool_types(creator);
  check_address_pool(creator);

  {  // TrtpagedAllReduce: fields validated and serialized; no NCCL call without a communicator to make
    trtpaged::trt::AllReduceCreator ar;
    int32_t rank = 2, world = 2;
    PluginField fields[2] = {PluginField("rank", &rank, PluginFieldType::kINT32, 1),
                             PluginField("world_size", &world, PluginFieldType::kINT32, 1)};
    PluginFieldCollection fc{2, fields};
    std::unique_ptr<IPluginV3> bad(ar.createPlugin("ar", &fc, TensorRTPhase::kBUILD));
    check(bad == nullptr, "all-reduce rank 2 of 2 must be refused");
    rank = 1;
    std::unique_ptr<IPluginV3> p(ar.createPlugin("ar", &fc, TensorRTPhase::kBUILD));
    check(p != nullptr, "all-reduce rank 1 of 2");
    if (p != nullptr) {
      auto* plugin = dynamic_cast<trtpaged::trt::AllReducePlugin*>(p.get());
      PluginFieldCollection const* out = plugin->getFieldsToSerialize();
      check(out != nullptr && out->nbFields == 2 && *static_cast<int32_t const*>(out->fields[0].data) == 1 &&
                *static_cast<int32_t const*>(out->fields[1].data) == 2,
            "all-reduce serializes rank 1 and world_size 2");
      PluginTensorDesc x{};
      x.dims = dims({0, 576});
      x.type = DataType::kHALF;
      void const* inputs[1] = {};
      void* outputs[1] = {};
      check(plugin->enqueue(&x, &x, inputs, outputs, nullptr, nullptr) == 0, "an empty all-reduce is a no-op");
      unsetenv("TRTPAGED_NCCL_UNIQUE_ID");
      setenv("TRTPAGED_NCCL_LIBRARY", "/nonexistent/libnccl.so.2", 1);
      x.dims = dims({4, 576});
      // the build-phase instance (TensorRT timing tactics) makes no NCCL call: it would fail here
      check(plugin->enqueue(&x, &x, inputs, outputs, nullptr, nullptr) == 0,
            "a build-phase all-reduce makes no collective (no NCCL, no communicator)");
      std::unique_ptr<IPluginV3> built_clone(plugin->clone());
      check(built_clone != nullptr && dynamic_cast<trtpaged::trt::AllReducePlugin*>(built_clone.get())
                                              ->enqueue(&x, &x, inputs, outputs, nullptr, nullptr) == 0,
            "a clone of a build-phase all-reduce stays build-phase");
      std::unique_ptr<IPluginV3> attached(plugin->attachToContext(nullptr));
      check(attached != nullptr && dynamic_cast<trtpaged::trt::AllReducePlugin*>(attached.get())
                                           ->enqueue(&x, &x, inputs, outputs, nullptr, nullptr) != 0,
            "the runtime instance (attachToContext) reduces: without NCCL it must fail, not crash");
      std::unique_ptr<IPluginV3> runtime(ar.createPlugin("ar", &fc, TensorRTPhase::kRUNTIME));
      check(runtime != nullptr && dynamic_cast<trtpaged::trt::AllReducePlugin*>(runtime.get())
                                          ->enqueue(&x, &x, inputs, outputs, nullptr, nullptr) != 0,
            "a deserialized (runtime-phase) all-reduce without NCCL or TRTPAGED_NCCL_UNIQUE_ID fails, not crash");
    }
    bool threw = false;
    try {
      trtpaged::trt::parse_unique_id("zz");
    } catch (std::invalid_argument const&) {
      threw = true;
    }
    check(threw, "a malformed TRTPAGED_NCCL_UNIQUE_ID is refused");
    std::string const hex(256, 'a');
    check(trtpaged::trt::parse_unique_id(hex.c_str()).internal[127] == static_cast<char>(0xaa), "unique id parsed");
  }

  std::printf("%s\n", failures == 0 ? "plugin host checks passed" : "plugin host checks FAILED");
  return failures == 0 ? 0 : 1;
}
