// The process's NCCL communicator for the tensor-parallel ranks, made at the
// first all-reduce. The ranks agree on it through TRTPAGED_NCCL_UNIQUE_ID: the
// 128-byte ncclUniqueId as 256 hex digits, made by rank 0 (ncclGetUniqueId) and
// handed to every rank before its engine runs (as the runtime hands over the
// step batch); rank and world size come from the node's fields.
#pragma once

#include "tensorrt/nccl_loader.h"

namespace trtpaged {
namespace trt {

// The communicator of (rank, world_size) on the current CUDA device; throws std::runtime_error naming what is
// wrong (no or bad TRTPAGED_NCCL_UNIQUE_ID, another rank/world_size than the first call's, NCCL errors).
nccl::comm_t communicator(int rank, int world_size);

// The ncclUniqueId of TRTPAGED_NCCL_UNIQUE_ID's hex text; throws std::invalid_argument.
nccl::UniqueId parse_unique_id(char const* hex);

}  // namespace trt
}  // namespace trtpaged
