#include "tensorrt/paged_attention_plugin.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "tensorrt/attention_io.h"
#include "tensorrt/logging.h"
#include "trtpaged/trtpaged.h"

namespace trtpaged {
namespace trt {

using nvinfer1::DataType;
using nvinfer1::Dims;
using nvinfer1::DimsExprs;
using nvinfer1::DynamicPluginTensorDesc;
using nvinfer1::IPluginCapability;
using nvinfer1::IPluginV3;
using nvinfer1::PluginCapabilityType;
using nvinfer1::PluginTensorDesc;
using nvinfer1::TensorFormat;

namespace {

void expect_io_counts(AttentionFields const& f, int32_t nbInputs, int32_t nbOutputs) {
  if (nbInputs != kNbInputs || nbOutputs != output_count(f)) {
    throw std::invalid_argument("expected 8 inputs and " + std::to_string(output_count(f)) + " output(s) (kv_pool " +
                                kv_pool_name(f.kv_pool) + "), got " + std::to_string(nbInputs) + " and " +
                                std::to_string(nbOutputs));
  }
}

}  // namespace

IPluginCapability* PagedAttentionPlugin::getCapabilityInterface(PluginCapabilityType type) noexcept {
  switch (type) {
    case PluginCapabilityType::kCORE: return static_cast<nvinfer1::IPluginV3OneCore*>(this);
    case PluginCapabilityType::kBUILD: return static_cast<nvinfer1::IPluginV3OneBuildV2*>(this);
    case PluginCapabilityType::kRUNTIME: return static_cast<nvinfer1::IPluginV3OneRuntime*>(this);
  }
  return nullptr;
}

IPluginV3* PagedAttentionPlugin::clone() noexcept {
  return guarded<IPluginV3*>("clone", nullptr, [&] { return new PagedAttentionPlugin(current_fields()); });
}

AttentionFields PagedAttentionPlugin::current_fields() const {
  AttentionFields f = mFields;
  f.workspace_bytes = mWorkspaceBytes;
  return f;
}

int32_t PagedAttentionPlugin::getNbOutputs() const noexcept { return output_count(mFields); }

int32_t PagedAttentionPlugin::getOutputDataTypes(DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes,
                                                 int32_t nbInputs) const noexcept {
  return guarded<int32_t>("getOutputDataTypes", -1, [&] {
    expect_io_counts(mFields, nbInputs, nbOutputs);
    outputTypes[kOut] = inputTypes[kQ];
    if (nbOutputs > kKvCacheOut) outputTypes[kKvCacheOut] = inputTypes[kKvCache];
    return 0;
  });
}

int32_t PagedAttentionPlugin::getOutputShapes(DimsExprs const* inputs, int32_t nbInputs, DimsExprs const* /*shapeInputs*/,
                                              int32_t nbShapeInputs, DimsExprs* outputs, int32_t nbOutputs,
                                              nvinfer1::IExprBuilder& exprBuilder) noexcept {
  return guarded<int32_t>("getOutputShapes", -1, [&] {
    expect_io_counts(mFields, nbInputs, nbOutputs);
    if (nbShapeInputs != 0) throw std::invalid_argument("takes no shape inputs");
    int32_t const pool_rank = mFields.kv_pool == KvPool::kAddress ? 1 : 6;
    if (inputs[kQ].nbDims != 3 || inputs[kKvCache].nbDims != pool_rank) {
      throw std::invalid_argument("q must have rank 3 and kv_cache rank " + std::to_string(pool_rank));
    }
    // out: [num_tokens (from q), num_heads, head_dim]; the pool keeps its shape.
    outputs[kOut].nbDims = 3;
    outputs[kOut].d[0] = inputs[kQ].d[0];
    outputs[kOut].d[1] = exprBuilder.constant(mFields.num_heads);
    outputs[kOut].d[2] = exprBuilder.constant(mFields.head_dim);
    if (nbOutputs > kKvCacheOut) outputs[kKvCacheOut] = inputs[kKvCache];
    return 0;
  });
}

bool PagedAttentionPlugin::supportsFormatCombination(int32_t pos, DynamicPluginTensorDesc const* inOut,
                                                     int32_t nbInputs, int32_t nbOutputs) noexcept {
  return guarded<bool>("supportsFormatCombination", false, [&] {
    expect_io_counts(mFields, nbInputs, nbOutputs);
    PluginTensorDesc const& d = inOut[pos].desc;
    if (d.format != TensorFormat::kLINEAR) return false;
    switch (pos) {
      case kQ: return is_activation_type(d.type);
      case kK:
      case kV: return d.type == inOut[kQ].desc.type;
      case kKvCache: return is_pool_type(mFields, d.type);
      case kPositions:
      case kQueryStart:
      case kContextLens:
      case kBlockTables: return d.type == DataType::kINT32;
      case kNbInputs + kOut: return d.type == inOut[kQ].desc.type;
      case kNbInputs + kKvCacheOut: return d.type == inOut[kKvCache].desc.type;
      default: return false;
    }
  });
}

int32_t PagedAttentionPlugin::configurePlugin(DynamicPluginTensorDesc const* in, int32_t nbInputs,
                                              DynamicPluginTensorDesc const* /*out*/, int32_t nbOutputs) noexcept {
  return guarded<int32_t>("configurePlugin", -1, [&] {
    expect_io_counts(mFields, nbInputs, nbOutputs);
    Dims dims[kNbInputs];
    for (int32_t i = 0; i < kNbInputs; ++i) dims[i] = in[i].desc.dims;  // -1 where dynamic: not checked
    check_shapes(mFields, dims, nbInputs, in[kKvCache].desc.type);
    // Also runs the kernel library's own checks (head_dim, dtypes, grid limits) over the profile.
    mWorkspaceBytes = std::max<int64_t>(mWorkspaceBytes, static_cast<int64_t>(workspace_bound(mFields, in)));
    return 0;
  });
}

size_t PagedAttentionPlugin::getWorkspaceSize(DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
                                              DynamicPluginTensorDesc const* /*outputs*/,
                                              int32_t nbOutputs) const noexcept {
  return guarded<size_t>("getWorkspaceSize", 0, [&] {
    expect_io_counts(mFields, nbInputs, nbOutputs);
    size_t const bytes = workspace_bound(mFields, inputs);
    mWorkspaceBytes = std::max<int64_t>(mWorkspaceBytes, static_cast<int64_t>(bytes));
    return bytes;
  });
}

int32_t PagedAttentionPlugin::getAliasedInput(int32_t outputIndex) noexcept {
  // kv_pool address: no pool tensor in the network, nothing aliased (and no copy TensorRT could insert)
  bool const aliased = mFields.kv_pool == KvPool::kAliased && outputIndex == kKvCacheOut;
  return aliased ? static_cast<int32_t>(kKvCache) : -1;
}

int32_t PagedAttentionPlugin::onShapeChange(PluginTensorDesc const* in, int32_t nbInputs,
                                            PluginTensorDesc const* /*out*/, int32_t nbOutputs) noexcept {
  return guarded<int32_t>("onShapeChange", -1, [&] {
    expect_io_counts(mFields, nbInputs, nbOutputs);
    Dims dims[kNbInputs];
    for (int32_t i = 0; i < kNbInputs; ++i) dims[i] = in[i].dims;
    check_shapes(mFields, dims, nbInputs, in[kKvCache].type);
    return 0;
  });
}

int32_t PagedAttentionPlugin::enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const* outputDesc,
                                      void const* const* inputs, void* const* outputs, void* workspace,
                                      cudaStream_t stream) noexcept {
  return guarded<int32_t>("enqueue", -1, [&] {
    Dims dims[kNbInputs];
    for (int32_t i = 0; i < kNbInputs; ++i) dims[i] = inputDesc[i].dims;
    trtpaged_attention_params p = make_params(mFields, dims, inputDesc[kQ].type, inputDesc[kKvCache].type);
    void* pool = nullptr;
    if (mFields.kv_pool == KvPool::kAddress) {
      // int64 {address, num_kv_blocks} in pinned host memory (the runner binds it; readable here and, through
      // unified addressing, by the device): the pool itself is no tensor of the network
      PoolAddress const where = read_pool_address(mFields, inputs[kKvCache]);
      pool = where.pool;
      p.num_kv_blocks = where.num_kv_blocks;
    } else {
      // The pool is updated in place: its output is aliased to input kKvCache.
      pool = outputs[kKvCacheOut];
      if (pool != inputs[kKvCache]) {
        throw std::runtime_error(
            "kv_cache_out is not aliased to kv_cache (enable PreviewFeature ALIASED_PLUGIN_IO_10_03)");
      }
    }
    int32_t const max_context = max_context_len(mFields, dims[kBlockTables]);
    size_t const needed = trtpaged_paged_attention_cuda_workspace_size(&p, max_context);
    // What TensorRT reserved (getWorkspaceSize at build, serialized into the plan). Unknown where the
    // serialized instance never answered getWorkspaceSize (the header leaves which instance TensorRT
    // serializes open): TensorRT reserved the bound over the profile, which the shapes here are within.
    size_t const given = mWorkspaceBytes >= 0 ? static_cast<size_t>(mWorkspaceBytes) : needed;
    if (needed > given) {
      throw std::runtime_error("layer " + std::to_string(mFields.layer) + ": this step needs " +
                               std::to_string(needed) + " workspace bytes, TensorRT reserved " +
                               std::to_string(given) + " (a shape outside the plan's profile?)");
    }
    (void)outputDesc;
    trtpaged_attention_options const options{mFields.sliding_window, mFields.logit_softcap};
    int const rc = trtpaged_paged_attention_ex_cuda(
        &p, &options, inputs[kQ], inputs[kK], inputs[kV], pool, static_cast<int32_t const*>(inputs[kPositions]),
        static_cast<int32_t const*>(inputs[kQueryStart]), static_cast<int32_t const*>(inputs[kContextLens]),
        static_cast<int32_t const*>(inputs[kBlockTables]), outputs[kOut], max_context, workspace, given,
        static_cast<void*>(stream));
    if (rc != TRTPAGED_OK) {
      throw std::runtime_error("layer " + std::to_string(mFields.layer) + ": " + trtpaged_last_error());
    }
    return 0;
  });
}

IPluginV3* PagedAttentionPlugin::attachToContext(nvinfer1::IPluginResourceContext* /*context*/) noexcept {
  return clone();  // no per-context resources
}

nvinfer1::PluginFieldCollection const* PagedAttentionPlugin::getFieldsToSerialize() noexcept {
  return guarded<nvinfer1::PluginFieldCollection const*>("getFieldsToSerialize", nullptr, [&] {
    mSerialized.emplace(current_fields());
    return mSerialized->collection();
  });
}

}  // namespace trt
}  // namespace trtpaged
