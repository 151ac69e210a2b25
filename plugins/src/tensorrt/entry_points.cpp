// The two entry points TensorRT looks up in a plugin library
// (IPluginRegistry::loadLibrary, trtexec --dynamicPlugins): the library's
// creators and the logger finder. Nothing else is exported.
#include <NvInferRuntime.h>

#include <cstdint>

#include "tensorrt/logging.h"
#include "tensorrt/paged_attention_creator.h"

#define TRTPAGED_PLUGIN_EXPORT __attribute__((visibility("default")))

extern "C" {

TRTPAGED_PLUGIN_EXPORT void setLoggerFinder(nvinfer1::ILoggerFinder* finder) {
  trtpaged::trt::set_logger_finder(finder);
}

TRTPAGED_PLUGIN_EXPORT nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators) {
  static trtpaged::trt::PagedAttentionCreator creator;
  static nvinfer1::IPluginCreatorInterface* const creators[] = {&creator};
  nbCreators = static_cast<int32_t>(sizeof(creators) / sizeof(creators[0]));
  return creators;
}

}  // extern "C"
