// IPluginV3 glue for the tensor-parallel all-reduce (ONNX TrtpagedAllReduce,
// trtpaged/builder/onnx_allreduce.py): y = sum of x over the ranks, with NCCL
// (loaded at run time, nccl_loader.h) on the engine's stream.
#pragma once

#include <NvInferRuntime.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace trtpaged {
namespace trt {

constexpr char const* kAllReduceName = "TrtpagedAllReduce";

// The node's attributes.
struct AllReduceFields {
  int32_t rank{-1};
  int32_t world_size{0};
};

// Reads and validates rank and world_size; throws std::invalid_argument naming the field.
AllReduceFields parse_allreduce_fields(nvinfer1::PluginFieldCollection const* fc);

// The fields createPlugin() expects, for getFieldNames().
nvinfer1::PluginFieldCollection const* allreduce_field_names() noexcept;

class AllReducePlugin : public nvinfer1::IPluginV3,
                        public nvinfer1::IPluginV3OneCore,
                        public nvinfer1::IPluginV3OneBuild,
                        public nvinfer1::IPluginV3OneRuntime {
 public:
  // phase: TensorRT's, from createPlugin. A build-phase instance never calls NCCL: TensorRT runs plugins while it
  // times tactics, each rank's builder on its own, and a collective there would wait for ranks that are not
  // running it (or pair with another rank's unrelated call). Its enqueue leaves the output as it is (timing runs'
  // outputs are discarded); the runtime instance (deserialized, or attachToContext) reduces.
  AllReducePlugin(AllReduceFields const& fields, nvinfer1::TensorRTPhase phase) : mFields(fields), mPhase(phase) {}
  ~AllReducePlugin() override = default;

  // IPluginV3
  nvinfer1::IPluginCapability* getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept override;
  nvinfer1::IPluginV3* clone() noexcept override;

  // IPluginV3OneCore
  char const* getPluginName() const noexcept override;
  char const* getPluginVersion() const noexcept override;
  char const* getPluginNamespace() const noexcept override;

  // IPluginV3OneBuild
  int32_t getNbOutputs() const noexcept override { return 1; }
  int32_t getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs, nvinfer1::DataType const* inputTypes,
                             int32_t nbInputs) const noexcept override;
  int32_t getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs, nvinfer1::DimsExprs const* shapeInputs,
                          int32_t nbShapeInputs, nvinfer1::DimsExprs* outputs, int32_t nbOutputs,
                          nvinfer1::IExprBuilder& exprBuilder) noexcept override;
  bool supportsFormatCombination(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
                                 int32_t nbOutputs) noexcept override;
  int32_t configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
                          nvinfer1::DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept override;
  size_t getWorkspaceSize(nvinfer1::DynamicPluginTensorDesc const* /*inputs*/, int32_t /*nbInputs*/,
                          nvinfer1::DynamicPluginTensorDesc const* /*outputs*/,
                          int32_t /*nbOutputs*/) const noexcept override {
    return 0;  // NCCL reduces from the input straight into the output
  }

  // IPluginV3OneRuntime
  int32_t onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs, nvinfer1::PluginTensorDesc const* out,
                        int32_t nbOutputs) noexcept override;
  int32_t enqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const* outputDesc,
                  void const* const* inputs, void* const* outputs, void* workspace,
                  cudaStream_t stream) noexcept override;
  nvinfer1::IPluginV3* attachToContext(nvinfer1::IPluginResourceContext* context) noexcept override;
  nvinfer1::PluginFieldCollection const* getFieldsToSerialize() noexcept override;

 private:
  AllReduceFields const mFields;
  nvinfer1::TensorRTPhase const mPhase;
  std::vector<nvinfer1::PluginField> mSerialized;
  nvinfer1::PluginFieldCollection mCollection{};
};

class AllReduceCreator : public nvinfer1::IPluginCreatorV3One {
 public:
  char const* getPluginName() const noexcept override;
  char const* getPluginVersion() const noexcept override;
  char const* getPluginNamespace() const noexcept override;
  nvinfer1::PluginFieldCollection const* getFieldNames() noexcept override { return allreduce_field_names(); }
  nvinfer1::IPluginV3* createPlugin(char const* name, nvinfer1::PluginFieldCollection const* fc,
                                    nvinfer1::TensorRTPhase phase) noexcept override;
};

}  // namespace trt
}  // namespace trtpaged
