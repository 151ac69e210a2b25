#include "tensorrt/paged_attention_creator.h"

#include <stdexcept>
#include <string>

#include "tensorrt/logging.h"
#include "tensorrt/paged_attention_plugin.h"

namespace trtpaged {
namespace trt {

nvinfer1::IPluginV3* PagedAttentionCreator::createPlugin(char const* name, nvinfer1::PluginFieldCollection const* fc,
                                                         nvinfer1::TensorRTPhase phase) noexcept {
  std::string const where = std::string("createPlugin(") + (name != nullptr ? name : "") + ")";
  return guarded<nvinfer1::IPluginV3*>(where.c_str(), nullptr, [&] {
    (void)phase;  // a plan without workspace_bytes is read too: the header does not say which instance TensorRT
                  // serializes, and one that never answered getWorkspaceSize has none (enqueue then trusts TensorRT)
    return new PagedAttentionPlugin(parse_fields(fc));
  });
}

}  // namespace trt
}  // namespace trtpaged
