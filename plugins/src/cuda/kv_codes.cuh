// Quantized KV cache on the GPU (layout in trtpaged/trtpaged.h): the code types the kernels are
// instantiated for, the row format of each pool element type, and the conversions between codes
// and fp32. fp8 e4m3 uses the hardware conversions of cuda_fp8.h on sm_89+ and, below, the software
// codec the CPU kernels use (fp8_e4m3.h), so both write the same bytes.
#pragma once

#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "fp8_e4m3.h"

namespace trtpaged {
namespace cuda {

// One-byte code types; a row of the pool is D codes then the row's fp16 scale.
struct Int8Code {
  uint8_t bits;
};
struct Fp8Code {
  uint8_t bits;
};

// Row format of a pool element type: plain values (float, __half, __nv_bfloat16) or codes + scale.
template <typename KvT>
struct KvFormat {
  static constexpr bool quantized = false;
  static constexpr int scale_elems = 0;
};
template <>
struct KvFormat<Int8Code> {
  static constexpr bool quantized = true;
  static constexpr int scale_elems = 2;  // the fp16 scale's bytes after the codes
  static constexpr float code_max = 127.f;
};
template <>
struct KvFormat<Fp8Code> {
  static constexpr bool quantized = true;
  static constexpr int scale_elems = 2;
  static constexpr float code_max = 448.f;
};

// Elements of one token row of one head in the pool (head_dim, or head_dim + 2 bytes).
template <typename KvT, int D>
constexpr int kv_row_elems() {
  return D + KvFormat<KvT>::scale_elems;
}

// Two codes (the first in the low byte of w) as floats.
template <typename CodeT>
__device__ __forceinline__ float2 decode_code_pair(uint32_t w);

template <>
__device__ __forceinline__ float2 decode_code_pair<Int8Code>(uint32_t w) {
  return make_float2(static_cast<float>(static_cast<int8_t>(w & 0xffu)),
                     static_cast<float>(static_cast<int8_t>((w >> 8) & 0xffu)));
}

template <>
__device__ __forceinline__ float2 decode_code_pair<Fp8Code>(uint32_t w) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(w & 0xffffu), __NV_E4M3);
  return __half22float2(__half2(h));
#else
  // Branch-free (e4m3_half_bits): exact fp16 of value / 256, widened and scaled back; NaN codes made NaN.
  const uint8_t lo = static_cast<uint8_t>(w & 0xffu);
  const uint8_t hi = static_cast<uint8_t>((w >> 8) & 0xffu);
  const float2 f = __half22float2(__halves2half2(__ushort_as_half(e4m3_half_bits(lo)),
                                                 __ushort_as_half(e4m3_half_bits(hi))));
  return make_float2((lo & 0x7fu) == 0x7fu ? __int_as_float(0x7fc00000) : f.x * 256.f,
                     (hi & 0x7fu) == 0x7fu ? __int_as_float(0x7fc00000) : f.y * 256.f);
#endif
}

// Two floats (already divided by the row's scale) as two codes, the first in the low byte.
template <typename CodeT>
__device__ __forceinline__ uint16_t encode_code_pair(float x0, float x1);

template <>
__device__ __forceinline__ uint16_t encode_code_pair<Int8Code>(float x0, float x1) {
  const int c0 = max(-127, min(127, __float2int_rn(x0)));  // round half to even, as the CPU's nearbyint
  const int c1 = max(-127, min(127, __float2int_rn(x1)));
  return static_cast<uint16_t>((c0 & 0xff) | ((c1 & 0xff) << 8));
}

template <>
__device__ __forceinline__ uint16_t encode_code_pair<Fp8Code>(float x0, float x1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  return static_cast<uint16_t>(__nv_cvt_float2_to_fp8x2(make_float2(x0, x1), __NV_SATFINITE, __NV_E4M3));
#else
  return static_cast<uint16_t>(e4m3_encode(x0) | (static_cast<uint16_t>(e4m3_encode(x1)) << 8));
#endif
}

// The row's scale, stored as fp16 right after its D codes (2-byte aligned).
template <int D>
__device__ __forceinline__ float row_scale(const uint8_t* row) {
  return __half2float(__ushort_as_half(*reinterpret_cast<const unsigned short*>(row + D)));
}

// N consecutive codes of a row (N even, src 2-byte aligned) as floats, without the scale.
template <typename CodeT, int N>
__device__ __forceinline__ void load_codes(const uint8_t* src, float (&dst)[N]) {
  static_assert(N % 2 == 0, "codes are read in pairs");
  const unsigned short* s = reinterpret_cast<const unsigned short*>(src);
#pragma unroll
  for (int i = 0; i < N / 2; ++i) {
    const float2 f = decode_code_pair<CodeT>(s[i]);
    dst[2 * i] = f.x;
    dst[2 * i + 1] = f.y;
  }
}

}  // namespace cuda
}  // namespace trtpaged
