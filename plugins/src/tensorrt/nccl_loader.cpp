#include "tensorrt/nccl_loader.h"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>
#include <stdexcept>

namespace trtpaged {
namespace trt {
namespace nccl {
namespace {

template <typename F>
void bind(void* handle, char const* name, F& slot) {
  void* symbol = dlsym(handle, name);
  if (symbol == nullptr) throw std::runtime_error(std::string("NCCL library lacks ") + name);
  slot = reinterpret_cast<F>(symbol);
}

Library load() {
  char const* env = std::getenv("TRTPAGED_NCCL_LIBRARY");
  char const* path = env != nullptr && *env != '\0' ? env : "libnccl.so.2";
  void* handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    char const* why = dlerror();
    throw std::runtime_error(std::string("cannot load NCCL (") + path + "): " + (why != nullptr ? why : "unknown") +
                             "; install NCCL 2 or set TRTPAGED_NCCL_LIBRARY to libnccl.so.2's path");
  }
  Library lib{};
  bind(handle, "ncclGetUniqueId", lib.GetUniqueId);
  bind(handle, "ncclCommInitRank", lib.CommInitRank);
  bind(handle, "ncclAllReduce", lib.AllReduce);
  bind(handle, "ncclCommDestroy", lib.CommDestroy);
  bind(handle, "ncclGetErrorString", lib.GetErrorString);
  return lib;  // the handle stays open for the life of the process
}

}  // namespace

Library const& library() {
  static std::once_flag once;
  static Library lib{};
  static std::string error;
  std::call_once(once, [] {
    try {
      lib = load();
    } catch (std::exception const& e) {
      error = e.what();
    }
  });
  if (!error.empty()) throw std::runtime_error(error);
  return lib;
}

void check(result_t rc, std::string const& what) {
  if (rc == kSuccess) return;
  throw std::runtime_error(what + ": " + library().GetErrorString(rc));
}

}  // namespace nccl
}  // namespace trt
}  // namespace trtpaged
