// Built instead of plugins/src/cuda/*.cu when the library is compiled without CUDA:
// every CUDA entry point reports TRTPAGED_ERR_NOT_BUILT.
#include "common.h"

namespace {
int not_built() {
  return trtpaged::fail(TRTPAGED_ERR_NOT_BUILT,
                        "this trtpaged library was built without CUDA (rebuild with nvcc on PATH or -DTRTPAGED_CUDA=ON)");
}
}  // namespace

extern "C" {

TRTPAGED_API size_t trtpaged_paged_attention_cuda_workspace_size(const trtpaged_attention_params*, int32_t) {
  return 0;
}

TRTPAGED_API int trtpaged_paged_attention_cuda(const trtpaged_attention_params*, const void*, const void*, const void*,
                                               void*, const int32_t*, const int32_t*, const int32_t*, const int32_t*,
                                               void*, int32_t, void*, size_t, void*) {
  return not_built();
}

TRTPAGED_API int trtpaged_paged_attention_ex_cuda(const trtpaged_attention_params*, const trtpaged_attention_options*,
                                                  const void*, const void*, const void*, void*, const int32_t*,
                                                  const int32_t*, const int32_t*, const int32_t*, void*, int32_t, void*,
                                                  size_t, void*) {
  return not_built();
}

TRTPAGED_API int trtpaged_copy_blocks_cuda(void*, int32_t, size_t, const int32_t*, int32_t, void*) { return not_built(); }

TRTPAGED_API int trtpaged_swap_blocks_cuda(const void*, int32_t, void*, int32_t, size_t, const int32_t*, int32_t,
                                           void*) {
  return not_built();
}

}  // extern "C"
