// Maps the runtime head_dim and dtypes onto the kernel template arguments.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "cuda/head_dims.h"
#include "cuda/kv_codes.cuh"
#include "trtpaged/trtpaged.h"

namespace trtpaged {
namespace cuda {

template <typename T>
struct TypeTag {
  using type = T;
};

// Calls f(TypeTag<T>{}) for the element type of dtype; false if dtype is unknown.
template <typename F>
bool with_dtype(trtpaged_dtype dtype, F&& f) {
  switch (dtype) {
    case TRTPAGED_FLOAT32:
      f(TypeTag<float>{});
      return true;
    case TRTPAGED_FLOAT16:
      f(TypeTag<__half>{});
      return true;
    case TRTPAGED_BFLOAT16:
      f(TypeTag<__nv_bfloat16>{});
      return true;
    default:  // the quantized codes and anything unknown: not an activation type
      return false;
  }
}

// Calls f(TypeTag<T>{}) for the pool element type of a kv_cache_dtype: the float types, or the one-byte
// code types of the quantized caches (Int8Code, Fp8Code); false if kv_cache_dtype is unknown.
template <typename F>
bool with_kv_cache_dtype(trtpaged_dtype dtype, F&& f) {
  switch (dtype) {
    case TRTPAGED_INT8:
      f(TypeTag<Int8Code>{});
      return true;
    case TRTPAGED_FP8_E4M3:
      f(TypeTag<Fp8Code>{});
      return true;
    default:
      return with_dtype(dtype, f);
  }
}

// Calls f(std::integral_constant<int, D>{}) for a compiled head_dim (cuda/head_dims.h); false otherwise.
template <typename F>
bool with_head_dim(int head_dim, F&& f) {
  switch (head_dim) {
    case 64:
      f(std::integral_constant<int, 64>{});
      return true;
    case 80:
      f(std::integral_constant<int, 80>{});
      return true;
    case 96:
      f(std::integral_constant<int, 96>{});
      return true;
    case 128:
      f(std::integral_constant<int, 128>{});
      return true;
  }
  return false;
}

// Calls f(dim, io_tag, kv_tag); false if any of the three has no kernel.
template <typename F>
bool with_kernel_types(int head_dim, trtpaged_dtype io, trtpaged_dtype kv, F&& f) {
  bool io_ok = false;
  bool kv_ok = false;
  const bool dim_ok = with_head_dim(head_dim, [&](auto dim) {
    io_ok = with_dtype(io, [&](auto io_tag) { kv_ok = with_kv_cache_dtype(kv, [&](auto kv_tag) { f(dim, io_tag, kv_tag); }); });
  });
  return dim_ok && io_ok && kv_ok;
}

}  // namespace cuda
}  // namespace trtpaged
