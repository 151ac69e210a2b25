#include "tensorrt/communicator.h"

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>

namespace trtpaged {
namespace trt {
namespace {

int hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

}  // namespace

nccl::UniqueId parse_unique_id(char const* hex) {
  if (hex == nullptr) {
    throw std::invalid_argument("TRTPAGED_NCCL_UNIQUE_ID: not set; rank 0 makes it (ncclGetUniqueId) and every rank "
                                "sets it before running a tensor-parallel engine");
  }
  size_t const want = 2 * nccl::kUniqueIdBytes;
  if (std::strlen(hex) != want) {
    throw std::invalid_argument("TRTPAGED_NCCL_UNIQUE_ID: expected " + std::to_string(want) + " hex digits, got " +
                                std::to_string(std::strlen(hex)));
  }
  nccl::UniqueId id{};
  for (int i = 0; i < nccl::kUniqueIdBytes; ++i) {
    int const hi = hex_value(hex[2 * i]);
    int const lo = hex_value(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) throw std::invalid_argument("TRTPAGED_NCCL_UNIQUE_ID: not hex at digit " + std::to_string(2 * i));
    id.internal[i] = static_cast<char>(hi * 16 + lo);
  }
  return id;
}

nccl::comm_t communicator(int rank, int world_size) {
  static std::mutex mutex;
  static nccl::comm_t comm = nullptr;
  static int comm_rank = -1;
  static int comm_world = -1;
  std::lock_guard<std::mutex> lock(mutex);
  if (comm != nullptr) {
    if (rank != comm_rank || world_size != comm_world) {
      throw std::runtime_error("rank " + std::to_string(rank) + " of " + std::to_string(world_size) +
                               ": this process's communicator is rank " + std::to_string(comm_rank) + " of " +
                               std::to_string(comm_world) + " (one rank per process)");
    }
    return comm;
  }
  nccl::Library const& lib = nccl::library();
  nccl::UniqueId const id = parse_unique_id(std::getenv("TRTPAGED_NCCL_UNIQUE_ID"));
  nccl::check(lib.CommInitRank(&comm, world_size, id, rank),
              "ncclCommInitRank(rank " + std::to_string(rank) + " of " + std::to_string(world_size) + ")");
  comm_rank = rank;
  comm_world = world_size;
  return comm;
}

}  // namespace trt
}  // namespace trtpaged
