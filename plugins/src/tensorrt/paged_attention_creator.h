// IPluginCreatorV3One for TrtpagedPagedAttention: builds the plugin from the
// ONNX node's fields (build phase) or from its serialized fields (runtime).
#pragma once

#include <NvInferRuntime.h>

#include "tensorrt/fields.h"

namespace trtpaged {
namespace trt {

class PagedAttentionCreator : public nvinfer1::IPluginCreatorV3One {
 public:
  PagedAttentionCreator() = default;
  ~PagedAttentionCreator() override = default;

  char const* getPluginName() const noexcept override { return kPluginName; }
  char const* getPluginVersion() const noexcept override { return kPluginVersion; }
  char const* getPluginNamespace() const noexcept override { return kPluginNamespace; }
  nvinfer1::PluginFieldCollection const* getFieldNames() noexcept override { return field_names(); }
  nvinfer1::IPluginV3* createPlugin(char const* name, nvinfer1::PluginFieldCollection const* fc,
                                    nvinfer1::TensorRTPhase phase) noexcept override;
};

}  // namespace trt
}  // namespace trtpaged
