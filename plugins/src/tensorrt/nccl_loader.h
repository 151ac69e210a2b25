// NCCL, loaded at run time: the plugin library does not link it (a TensorRT engine
// without a TrtpagedAllReduce node never needs it, and one NCCL serves whatever
// CUDA the process has). The few types and prototypes used are declared here as
// NCCL's nccl.h defines them (ABI-stable since NCCL 2.0), so no NCCL headers are
// needed to build.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <string>

namespace trtpaged {
namespace trt {
namespace nccl {

struct Comm;  // ncclComm: opaque
using comm_t = Comm*;
constexpr int kUniqueIdBytes = 128;
struct UniqueId {
  char internal[kUniqueIdBytes];
};
using result_t = int;  // ncclResult_t: ncclSuccess = 0
constexpr result_t kSuccess = 0;
// ncclDataType_t values used here
constexpr int kFloat16 = 6;
constexpr int kFloat32 = 7;
constexpr int kBfloat16 = 9;
constexpr int kSum = 0;  // ncclRedOp_t

// The entry points of libnccl.so.2 this library calls.
struct Library {
  result_t (*GetUniqueId)(UniqueId* id);
  result_t (*CommInitRank)(comm_t* comm, int nranks, UniqueId id, int rank);
  result_t (*AllReduce)(void const* send, void* recv, size_t count, int datatype, int op, comm_t comm,
                        cudaStream_t stream);
  result_t (*CommDestroy)(comm_t comm);
  char const* (*GetErrorString)(result_t result);
};

// libnccl.so.2 ($TRTPAGED_NCCL_LIBRARY when set), loaded once; throws std::runtime_error saying what is missing.
Library const& library();

// "<what>: <NCCL's message>" for a failed call; throws std::runtime_error when rc is not success.
void check(result_t rc, std::string const& what);

}  // namespace nccl
}  // namespace trt
}  // namespace trtpaged
