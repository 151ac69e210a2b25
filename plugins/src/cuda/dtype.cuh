// Element conversions and vector loads/stores that widen to / narrow from fp32.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace trtpaged {
namespace cuda {

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// The widest access (bytes, at most 16) that tiles kBytes exactly.
template <int kBytes>
struct Access {
  static constexpr int bytes = kBytes % 16 == 0 ? 16 : kBytes % 8 == 0 ? 8 : kBytes % 4 == 0 ? 4 : 2;
};
template <int kBytes>
struct Word;
template <>
struct Word<16> {
  using type = uint4;
};
template <>
struct Word<8> {
  using type = uint2;
};
template <>
struct Word<4> {
  using type = uint32_t;
};
template <>
struct Word<2> {
  using type = uint16_t;
};

// Loads N consecutive elements at src (aligned to the access width, which holds
// whenever src is a 16-byte aligned row plus a multiple of N elements).
template <typename T, int N>
__device__ __forceinline__ void load_float(const T* src, float (&dst)[N]) {
  constexpr int kBytes = N * static_cast<int>(sizeof(T));
  constexpr int kAccess = Access<kBytes>::bytes;
  using W = typename Word<kAccess>::type;
  W raw[kBytes / kAccess];
  const W* s = reinterpret_cast<const W*>(src);
#pragma unroll
  for (int i = 0; i < kBytes / kAccess; ++i) raw[i] = s[i];
  const T* e = reinterpret_cast<const T*>(raw);
#pragma unroll
  for (int i = 0; i < N; ++i) dst[i] = to_float(e[i]);
}

template <typename T, int N>
__device__ __forceinline__ void store_float(T* dst, const float (&src)[N]) {
  constexpr int kBytes = N * static_cast<int>(sizeof(T));
  constexpr int kAccess = Access<kBytes>::bytes;
  using W = typename Word<kAccess>::type;
  W raw[kBytes / kAccess];
  T* e = reinterpret_cast<T*>(raw);
#pragma unroll
  for (int i = 0; i < N; ++i) e[i] = from_float<T>(src[i]);
  W* d = reinterpret_cast<W*>(dst);
#pragma unroll
  for (int i = 0; i < kBytes / kAccess; ++i) d[i] = raw[i];
}

}  // namespace cuda
}  // namespace trtpaged
