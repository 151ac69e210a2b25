#include "tensorrt/allreduce_plugin.h"

#include <cstdint>
#include <stdexcept>
#include <string>

#include "tensorrt/communicator.h"
#include "tensorrt/fields.h"
#include "tensorrt/logging.h"
#include "tensorrt/nccl_loader.h"

namespace trtpaged {
namespace trt {

using nvinfer1::DataType;
using nvinfer1::PluginField;
using nvinfer1::PluginFieldCollection;
using nvinfer1::PluginFieldType;

namespace {

std::invalid_argument field_error(std::string const& name, std::string const& why) {
  return std::invalid_argument(std::string(kAllReduceName) + " field " + name + ": " + why);
}

void expect_io_counts(int32_t nbInputs, int32_t nbOutputs) {
  if (nbInputs != 1 || nbOutputs != 1) {
    throw std::invalid_argument("expected 1 input and 1 output, got " + std::to_string(nbInputs) + " and " +
                                std::to_string(nbOutputs));
  }
}

int nccl_type(DataType type) {
  switch (type) {
    case DataType::kFLOAT: return nccl::kFloat32;
    case DataType::kHALF: return nccl::kFloat16;
    case DataType::kBF16: return nccl::kBfloat16;
    default: throw std::invalid_argument("x: expected float32, float16 or bfloat16");
  }
}

size_t element_count(nvinfer1::Dims const& dims) {
  size_t n = 1;
  for (int32_t i = 0; i < dims.nbDims; ++i) n *= static_cast<size_t>(dims.d[i]);
  return n;
}

}  // namespace

AllReduceFields parse_allreduce_fields(PluginFieldCollection const* fc) {
  if (fc == nullptr) throw std::invalid_argument(std::string(kAllReduceName) + ": no plugin fields given");
  AllReduceFields f;
  for (int32_t i = 0; i < fc->nbFields; ++i) {
    PluginField const& field = fc->fields[i];
    if (field.name == nullptr) continue;
    std::string const name(field.name);
    int32_t* slot = name == "rank" ? &f.rank : name == "world_size" ? &f.world_size : nullptr;
    if (slot == nullptr) continue;  // plugin_version, plugin_namespace: not ours
    if (field.data == nullptr || field.length != 1) throw field_error(name, "expected one value");
    if (field.type == PluginFieldType::kINT32) {
      *slot = *static_cast<int32_t const*>(field.data);
    } else if (field.type == PluginFieldType::kINT64) {
      int64_t const value = *static_cast<int64_t const*>(field.data);
      if (value < INT32_MIN || value > INT32_MAX) throw field_error(name, "got " + std::to_string(value) + ", past int32");
      *slot = static_cast<int32_t>(value);
    } else {
      throw field_error(name, "expected an int32 or int64 field");
    }
  }
  if (f.world_size < 1) throw field_error("world_size", "missing or < 1");
  if (f.rank < 0 || f.rank >= f.world_size) {
    throw field_error("rank", "must be in [0, world_size " + std::to_string(f.world_size) + "), got " +
                                  std::to_string(f.rank));
  }
  return f;
}

PluginFieldCollection const* allreduce_field_names() noexcept {
  static PluginField const fields[] = {PluginField("rank", nullptr, PluginFieldType::kINT32, 1),
                                       PluginField("world_size", nullptr, PluginFieldType::kINT32, 1)};
  static PluginFieldCollection const collection{2, fields};
  return &collection;
}

nvinfer1::IPluginCapability* AllReducePlugin::getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept {
  switch (type) {
    case nvinfer1::PluginCapabilityType::kCORE: return static_cast<nvinfer1::IPluginV3OneCore*>(this);
    case nvinfer1::PluginCapabilityType::kBUILD: return static_cast<nvinfer1::IPluginV3OneBuild*>(this);
    case nvinfer1::PluginCapabilityType::kRUNTIME: return static_cast<nvinfer1::IPluginV3OneRuntime*>(this);
  }
  return nullptr;
}

nvinfer1::IPluginV3* AllReducePlugin::clone() noexcept {
  return guarded<nvinfer1::IPluginV3*>("clone", nullptr, [&] { return new AllReducePlugin(mFields, mPhase); });
}

char const* AllReducePlugin::getPluginName() const noexcept { return kAllReduceName; }
char const* AllReducePlugin::getPluginVersion() const noexcept { return kPluginVersion; }
char const* AllReducePlugin::getPluginNamespace() const noexcept { return kPluginNamespace; }

int32_t AllReducePlugin::getOutputDataTypes(DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes,
                                            int32_t nbInputs) const noexcept {
  return guarded<int32_t>("getOutputDataTypes", -1, [&] {
    expect_io_counts(nbInputs, nbOutputs);
    outputTypes[0] = inputTypes[0];
    return 0;
  });
}

int32_t AllReducePlugin::getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs,
                                         nvinfer1::DimsExprs const* /*shapeInputs*/, int32_t nbShapeInputs,
                                         nvinfer1::DimsExprs* outputs, int32_t nbOutputs,
                                         nvinfer1::IExprBuilder& /*exprBuilder*/) noexcept {
  return guarded<int32_t>("getOutputShapes", -1, [&] {
    expect_io_counts(nbInputs, nbOutputs);
    if (nbShapeInputs != 0) throw std::invalid_argument("takes no shape inputs");
    outputs[0] = inputs[0];
    return 0;
  });
}

bool AllReducePlugin::supportsFormatCombination(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut,
                                                int32_t nbInputs, int32_t nbOutputs) noexcept {
  return guarded<bool>("supportsFormatCombination", false, [&] {
    expect_io_counts(nbInputs, nbOutputs);
    nvinfer1::PluginTensorDesc const& d = inOut[pos].desc;
    if (d.format != nvinfer1::TensorFormat::kLINEAR) return false;
    if (pos == 0) return d.type == DataType::kFLOAT || d.type == DataType::kHALF || d.type == DataType::kBF16;
    return d.type == inOut[0].desc.type;
  });
}

int32_t AllReducePlugin::configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
                                         nvinfer1::DynamicPluginTensorDesc const* /*out*/, int32_t nbOutputs) noexcept {
  return guarded<int32_t>("configurePlugin", -1, [&] {
    expect_io_counts(nbInputs, nbOutputs);
    nccl_type(in[0].desc.type);
    return 0;
  });
}

int32_t AllReducePlugin::onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs,
                                       nvinfer1::PluginTensorDesc const* /*out*/, int32_t nbOutputs) noexcept {
  return guarded<int32_t>("onShapeChange", -1, [&] {
    expect_io_counts(nbInputs, nbOutputs);
    nccl_type(in[0].type);
    return 0;
  });
}

int32_t AllReducePlugin::enqueue(nvinfer1::PluginTensorDesc const* inputDesc,
                                 nvinfer1::PluginTensorDesc const* /*outputDesc*/, void const* const* inputs,
                                 void* const* outputs, void* /*workspace*/, cudaStream_t stream) noexcept {
  return guarded<int32_t>("enqueue", -1, [&] {
    size_t const count = element_count(inputDesc[0].dims);
    if (count == 0 || mPhase == nvinfer1::TensorRTPhase::kBUILD) return 0;  // no collective while building
    nccl::comm_t const comm = communicator(mFields.rank, mFields.world_size);
    nccl::check(nccl::library().AllReduce(inputs[0], outputs[0], count, nccl_type(inputDesc[0].type), nccl::kSum,
                                          comm, stream),
                "ncclAllReduce(rank " + std::to_string(mFields.rank) + ")");
    return 0;
  });
}

nvinfer1::IPluginV3* AllReducePlugin::attachToContext(nvinfer1::IPluginResourceContext* /*context*/) noexcept {
  // the runtime instance: it reduces (the communicator is the process's, one rank per process)
  return guarded<nvinfer1::IPluginV3*>("attachToContext", nullptr, [&] {
    return new AllReducePlugin(mFields, nvinfer1::TensorRTPhase::kRUNTIME);
  });
}

PluginFieldCollection const* AllReducePlugin::getFieldsToSerialize() noexcept {
  mSerialized = {PluginField("rank", &mFields.rank, PluginFieldType::kINT32, 1),
                 PluginField("world_size", &mFields.world_size, PluginFieldType::kINT32, 1)};
  mCollection.nbFields = static_cast<int32_t>(mSerialized.size());
  mCollection.fields = mSerialized.data();
  return &mCollection;
}

char const* AllReduceCreator::getPluginName() const noexcept { return kAllReduceName; }
char const* AllReduceCreator::getPluginVersion() const noexcept { return kPluginVersion; }
char const* AllReduceCreator::getPluginNamespace() const noexcept { return kPluginNamespace; }

nvinfer1::IPluginV3* AllReduceCreator::createPlugin(char const* name, PluginFieldCollection const* fc,
                                                    nvinfer1::TensorRTPhase phase) noexcept {
  std::string const where = std::string("createPlugin(") + (name != nullptr ? name : "") + ")";
  return guarded<nvinfer1::IPluginV3*>(where.c_str(), nullptr,
                                       [&] { return new AllReducePlugin(parse_allreduce_fields(fc), phase); });
}

}  // namespace trt
}  // namespace trtpaged
