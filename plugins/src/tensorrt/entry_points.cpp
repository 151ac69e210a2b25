// The two entry points TensorRT looks up in a plugin library
// (IPluginRegistry::loadLibrary, trtexec --dynamicPlugins): the library's
// creators and the logger finder. Nothing else is exported.
#include <NvInferRuntime.h>
#include <NvInferVersion.h>

#include <cstdint>

#include "tensorrt/allreduce_plugin.h"
#include "tensorrt/logging.h"
#include "tensorrt/paged_attention_creator.h"

#define TRTPAGED_PLUGIN_EXPORT __attribute__((visibility("default")))
#define TRTPAGED_STR2(x) #x
#define TRTPAGED_STR(x) TRTPAGED_STR2(x)

static_assert(NV_TENSORRT_MAJOR == TRTPAGED_TRT_MAJOR, "CMake named the library for another TensorRT major");

namespace {
// The TensorRT major this library is compiled for, as text in the file (not a symbol):
// trtpaged/builder/compile.py reads it to refuse a library built for another major.
__attribute__((used)) char const kTensorRTMajorTag[] =
    "trtpaged-plugin-tensorrt-major=" TRTPAGED_STR(NV_TENSORRT_MAJOR) ";";
}  // namespace

extern "C" {

TRTPAGED_PLUGIN_EXPORT void setLoggerFinder(nvinfer1::ILoggerFinder* finder) {
  trtpaged::trt::set_logger_finder(finder);
}

TRTPAGED_PLUGIN_EXPORT nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators) {
  static trtpaged::trt::PagedAttentionCreator attention;
  static trtpaged::trt::AllReduceCreator all_reduce;  // tensor parallelism: NCCL, loaded at first use
  static nvinfer1::IPluginCreatorInterface* const creators[] = {&attention, &all_reduce};
  nbCreators = static_cast<int32_t>(sizeof(creators) / sizeof(creators[0]));
  return creators;
}

}  // extern "C"
