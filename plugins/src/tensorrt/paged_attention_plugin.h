// IPluginV3 glue for one layer's paged attention: shapes, formats, aliasing,
// workspace and enqueue. The math is the kernel library's (trtpaged/trtpaged.h).
#pragma once

#include <NvInferRuntime.h>

#include <cstdint>
#include <optional>

#include "tensorrt/fields.h"

namespace trtpaged {
namespace trt {

class PagedAttentionPlugin : public nvinfer1::IPluginV3,
                             public nvinfer1::IPluginV3OneCore,
                             public nvinfer1::IPluginV3OneBuildV2,
                             public nvinfer1::IPluginV3OneRuntime {
 public:
  explicit PagedAttentionPlugin(AttentionFields const& fields)
      : mFields(fields), mWorkspaceBytes(fields.workspace_bytes) {}
  ~PagedAttentionPlugin() override = default;

  // IPluginV3
  nvinfer1::IPluginCapability* getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept override;
  nvinfer1::IPluginV3* clone() noexcept override;

  // IPluginV3OneCore
  char const* getPluginName() const noexcept override { return kPluginName; }
  char const* getPluginVersion() const noexcept override { return kPluginVersion; }
  char const* getPluginNamespace() const noexcept override { return kPluginNamespace; }

  // IPluginV3OneBuildV2
  int32_t getNbOutputs() const noexcept override;
  int32_t getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs, nvinfer1::DataType const* inputTypes,
                             int32_t nbInputs) const noexcept override;
  int32_t getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs, nvinfer1::DimsExprs const* shapeInputs,
                          int32_t nbShapeInputs, nvinfer1::DimsExprs* outputs, int32_t nbOutputs,
                          nvinfer1::IExprBuilder& exprBuilder) noexcept override;
  bool supportsFormatCombination(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
                                 int32_t nbOutputs) noexcept override;
  int32_t configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
                          nvinfer1::DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept override;
  size_t getWorkspaceSize(nvinfer1::DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
                          nvinfer1::DynamicPluginTensorDesc const* outputs, int32_t nbOutputs) const noexcept override;
  int32_t getAliasedInput(int32_t outputIndex) noexcept override;

  // IPluginV3OneRuntime
  int32_t onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs, nvinfer1::PluginTensorDesc const* out,
                        int32_t nbOutputs) noexcept override;
  int32_t enqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const* outputDesc,
                  void const* const* inputs, void* const* outputs, void* workspace,
                  cudaStream_t stream) noexcept override;
  nvinfer1::IPluginV3* attachToContext(nvinfer1::IPluginResourceContext* context) noexcept override;
  nvinfer1::PluginFieldCollection const* getFieldsToSerialize() noexcept override;

 private:
  AttentionFields current_fields() const;

  AttentionFields const mFields;
  // Recorded by configurePlugin/getWorkspaceSize at build, read from the plan at runtime; -1 until known.
  mutable int64_t mWorkspaceBytes;
  std::optional<SerializedFields> mSerialized;
};

}  // namespace trt
}  // namespace trtpaged
