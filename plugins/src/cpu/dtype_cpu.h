// Storage types of the CPU kernels and their conversions to and from float.
// fp16 and bf16 are stored as raw 16-bit patterns; rounding is to nearest even,
// as PyTorch does, so cache contents match `tensor.to(dtype)` bit for bit.
#pragma once

#include <cstdint>
#include <type_traits>
#include <cstring>

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace trtpaged::cpu {

#if defined(__FLT16_MAX__)
// The compiler's half type: conversions become vcvtph2ps/vcvtps2ph and vectorize.
using half_t = _Float16;
#else
struct half_t {
  uint16_t bits;
};
#endif
struct bfloat_t {
  uint16_t bits;
};

inline float to_float(float x) { return x; }

inline float to_float(bfloat_t x) {
  const uint32_t u = uint32_t(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

#if defined(__FLT16_MAX__)
inline float to_float(half_t x) { return float(x); }
inline void store(half_t& dst, float x) { dst = half_t(x); }
#else
inline float to_float(half_t x) {
  const uint32_t sign = uint32_t(x.bits & 0x8000u) << 16;
  uint32_t exp = (x.bits >> 10) & 0x1fu, mant = x.bits & 0x3ffu, u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {
    u = sign | ((exp + 112u) << 23) | (mant << 13);
  } else if (mant == 0) {
    u = sign;
  } else {  // subnormal: normalise
    exp = 113;
    while (!(mant & 0x400u)) {
      mant <<= 1;
      --exp;
    }
    u = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline void store(half_t& dst, float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  u &= 0x7fffffffu;
  if (u >= 0x7f800000u) {  // inf or nan
    dst.bits = sign | 0x7c00u | (u > 0x7f800000u ? 0x200u : 0u);
  } else if (u >= 0x477ff000u) {  // rounds to >= 65520: overflow to inf
    dst.bits = sign | 0x7c00u;
  } else if (u < 0x38800000u) {  // subnormal or zero in half
    float a;
    std::memcpy(&a, &u, 4);
    // scale to units of 2^-24 and round to nearest even with the FPU
    const float scaled = a * 16777216.0f;
    uint32_t m = uint32_t(scaled);
    const float rem = scaled - float(m);
    if (rem > 0.5f || (rem == 0.5f && (m & 1u))) ++m;
    dst.bits = sign | uint16_t(m);
  } else {
    const uint32_t mant_odd = (u >> 13) & 1u;
    u += 0xfffu + mant_odd;
    dst.bits = sign | uint16_t(((u >> 13) - (112u << 10)) & 0x7fffu);
  }
}
#endif

inline void store(float& dst, float x) { dst = x; }

inline void store(bfloat_t& dst, float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    dst.bits = uint16_t((u >> 16) | 0x40u);  // quiet nan
    return;
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  dst.bits = uint16_t(u >> 16);
}

// dst[i] = float(src[i]) for i < n; 8 halves per instruction with F16C (GCC does not
// vectorize _Float16 conversions without AVX512-FP16).
template <typename T>
inline void convert_to_float(const T* src, int64_t n, float* dst) {
  int64_t i = 0;
#if defined(__F16C__) && defined(__FLT16_MAX__)
  if constexpr (std::is_same_v<T, half_t>) {
    for (; i + 8 <= n; i += 8) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
    }
  }
#endif
  for (; i < n; ++i) dst[i] = to_float(src[i]);
}

}  // namespace trtpaged::cpu
