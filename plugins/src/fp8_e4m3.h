// OCP fp8 e4m3fn in software, one implementation for the CPU kernels and the CUDA kernels built for
// GPUs without the hardware conversion (sm_80): bias 7, 3 mantissa bits, no infinities, 0x7f/0xff NaN,
// largest finite 448. Encoding rounds to nearest even and saturates to +-448 (what the sm_89+
// instruction cvt.rn.satfinite.e4m3x2.f32 and torch's float8_e4m3fn conversion of in-range values do),
// so the bytes a cache holds do not depend on where they were written.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define TRTPAGED_HOST_DEVICE __host__ __device__ __forceinline__
#else
// static: the CPU paged attention compiles this header once per instruction set (its -march differs
// per file), and the linker must not merge those copies.
#define TRTPAGED_HOST_DEVICE static inline
#endif

namespace trtpaged {

TRTPAGED_HOST_DEVICE uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
#endif
}

TRTPAGED_HOST_DEVICE float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// x as an e4m3fn byte: round to nearest even, +-448 beyond the range (and for infinities), NaN -> 0x7f.
TRTPAGED_HOST_DEVICE uint8_t e4m3_encode(float x) {
  uint32_t u = float_bits(x);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  u &= 0x7fffffffu;
  if (u > 0x7f800000u) return sign | 0x7fu;  // NaN
  const float a = bits_float(u);
  if (a >= 448.0f) return sign | 0x7eu;      // saturate (448 < a < 464 would round to 448 as well)
  if (a < 0.015625f) {                       // below 2^-6: subnormal, units of 2^-9 (a*512 is exact)
    return sign | static_cast<uint8_t>(rintf(a * 512.0f));  // 8 rounds up to the smallest normal, 0x08
  }
  u += 0x7ffffu + ((u >> 20) & 1u);  // round the 23-bit mantissa to 3 bits, ties to even
  return sign | static_cast<uint8_t>((u >> 20) - (120u << 3));
}

// The value of an e4m3fn byte (exact in float; 0x7f/0xff are NaN).
TRTPAGED_HOST_DEVICE float e4m3_decode(uint8_t c) {
  const uint32_t sign = static_cast<uint32_t>(c & 0x80u) << 24;
  const uint32_t exp = (c >> 3) & 0xfu;
  const uint32_t mant = c & 0x7u;
  if (exp == 15 && mant == 7) return bits_float(sign | 0x7fc00000u);
  if (exp == 0) return bits_float(float_bits(static_cast<float>(mant) * (1.0f / 512.0f)) | sign);
  return bits_float(sign | ((exp + 120u) << 23) | (mant << 20));
}

// The fp16 bit pattern of an e4m3fn code's value / 256, without branches: e4m3's sign, 4 exponent and
// 3 mantissa bits moved up by 7 bits land in fp16's sign, exponent (bias 15 = 7 + 8) and mantissa
// fields, subnormals included, so the fp16 is exact. The NaN codes (0x7f, 0xff) give +-1.875 (x 256 =
// 480), not NaN: callers that may meet them test (c & 0x7f) == 0x7f. The encoder never writes them.
TRTPAGED_HOST_DEVICE uint16_t e4m3_half_bits(uint8_t c) {
  return static_cast<uint16_t>(((c & 0x80u) << 8) | ((c & 0x7fu) << 7));
}

}  // namespace trtpaged
