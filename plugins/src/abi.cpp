// Library-wide ABI functions: version, capabilities, last error.
#include "common.h"

#ifndef TRTPAGED_VERSION
#define TRTPAGED_VERSION "0.0.0"
#endif

extern "C" {

TRTPAGED_API const char* trtpaged_last_error(void) { return trtpaged::last_error(); }

TRTPAGED_API trtpaged_status trtpaged_record_error(trtpaged_status status, const char* message) {
  return trtpaged_status(trtpaged::fail(status, message ? message : ""));
}

TRTPAGED_API const char* trtpaged_version(void) { return TRTPAGED_VERSION; }

TRTPAGED_API int trtpaged_has_cuda(void) {
#ifdef TRTPAGED_WITH_CUDA
  return 1;
#else
  return 0;
#endif
}

TRTPAGED_API const char* trtpaged_cuda_archs(void) {
#ifdef TRTPAGED_CUDA_ARCH_LIST
  return TRTPAGED_CUDA_ARCH_LIST;
#else
  return "";
#endif
}

}  // extern "C"
