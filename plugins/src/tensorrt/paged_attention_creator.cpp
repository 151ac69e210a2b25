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
    AttentionFields const fields = parse_fields(fc);
    if (phase == nvinfer1::TensorRTPhase::kRUNTIME && fields.workspace_bytes < 0) {
      throw std::invalid_argument("the plan does not record workspace_bytes (built by an older plugin); rebuild it");
    }
    return new PagedAttentionPlugin(fields);
  });
}

}  // namespace trt
}  // namespace trtpaged
