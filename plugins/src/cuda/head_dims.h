// head_dim values the CUDA kernels are compiled for. Plain C++ (no CUDA headers):
// the TensorRT plugin checks against it at build time, and
// trtpaged/models/dims.py CUDA_HEAD_DIMS mirrors it (tests/test_tensorrt.py checks both agree).
#pragma once

namespace trtpaged {
namespace cuda {

constexpr int kHeadDims[] = {64, 80, 96, 128};
constexpr int kNumHeadDims = 4;
constexpr int kMaxHeadDim = 128;

constexpr bool head_dim_supported(int head_dim) {
  for (int d : kHeadDims) {
    if (d == head_dim) return true;
  }
  return false;
}

}  // namespace cuda
}  // namespace trtpaged
