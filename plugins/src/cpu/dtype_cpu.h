// Storage types of the CPU kernels and their conversions to and from float.
// fp16 and bf16 are stored as raw 16-bit patterns; rounding is to nearest even,
// as PyTorch does, so cache contents match `tensor.to(dtype)` bit for bit.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <cstring>
#include <limits>

#include "fp8_e4m3.h"

#if defined(__F16C__)
#include <immintrin.h>
#endif

// This header and attention_tiles.h are compiled once per instruction set (the paged attention's
// copies, paged_attention_{scalar,avx2,avx512}.cpp, each with its own -march). The linker keeps one
// definition of an inline function, so each target's definitions live in a namespace of their own:
// an AVX-512 copy can never be what the scalar path calls.
#if defined(__AVX512F__)
#define TRTPAGED_CPU_TARGET_NS target_avx512
#elif defined(__AVX2__)
#define TRTPAGED_CPU_TARGET_NS target_avx2
#else
#define TRTPAGED_CPU_TARGET_NS target_x86_64
#endif

namespace trtpaged::cpu {
inline namespace TRTPAGED_CPU_TARGET_NS {

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

// Quantized KV cache codes (see trtpaged.h): each token row of a head is head_dim one-byte
// codes followed by an fp16 scale; value = code * scale. Write-once per row, so a new token
// never forces re-quantizing the block's earlier rows.
struct int8_code {
  int8_t bits;
};
struct fp8_code {  // OCP e4m3fn: bias 7, 3 mantissa bits, no inf, 0x7f/0xff NaN, max 448
  uint8_t bits;
};

template <typename T>
constexpr bool is_quantized_v = std::is_same_v<T, int8_code> || std::is_same_v<T, fp8_code>;

template <typename T>
constexpr float code_max() {
  return std::is_same_v<T, int8_code> ? 127.0f : 448.0f;
}

// fp8 codes are made and read by the shared software codec (fp8_e4m3.h), which the CUDA kernels
// built for sm_80 use too.
inline uint8_t float_to_e4m3(float x) { return e4m3_encode(x); }
inline float e4m3_to_float(uint8_t c) { return e4m3_decode(c); }

// All 256 e4m3 values, for de-quantizing by table lookup.
struct E4m3Table {
  float v[256];
  E4m3Table() {
    for (int i = 0; i < 256; ++i) v[i] = e4m3_to_float(uint8_t(i));
  }
};
inline const E4m3Table& e4m3_table() {
  static const E4m3Table table;
  return table;
}

// Quantizes one row of n values into codes and its scale (written after the codes), as
// trtpaged/kv_quant.py's quantize_rows does. A row holding a NaN gets a NaN scale and zero codes,
// so it reads back as NaN: int8 has no NaN code, and a scale from the other values would turn the
// NaN into a plausible number (it used to become code 0, and an all-NaN row a zero row).
template <typename C, typename IO>
inline void quantize_row(const IO* src, int64_t n, C* codes, float* buf) {
  float amax = 0.0f;
  bool nan = false;
  for (int64_t i = 0; i < n; ++i) {
    buf[i] = to_float(src[i]);
    amax = std::max(amax, std::fabs(buf[i]));  // a NaN never wins this max, on any path
    nan |= buf[i] != buf[i];
  }
  half_t stored;  // the scale as stored (fp16, round to nearest even): codes are made with it
  store(stored, nan ? std::numeric_limits<float>::quiet_NaN() : std::min(amax / code_max<C>(), 65504.0f));
  const float scale = to_float(stored);
  for (int64_t i = 0; i < n; ++i) {
    // Division (not a multiply by the reciprocal) so that codes equal round(x / scale) exactly;
    // a zero or NaN scale gives zero codes.
    const float x = scale > 0.0f ? buf[i] / scale : 0.0f;
    if constexpr (std::is_same_v<C, int8_code>)
      codes[i].bits = int8_t(std::clamp(__builtin_nearbyintf(x), -127.0f, 127.0f));
    else
      codes[i].bits = float_to_e4m3(x);  // saturates at +-448 (the scale may have rounded down)
  }
  std::memcpy(codes + n, &stored, 2);
}

// De-quantizes `rows` rows of d codes (each followed by its scale) into dst [rows, d].
template <typename C>
inline void dequantize_rows(const C* src, int64_t rows, int64_t d, float* dst) {
  for (int64_t r = 0; r < rows; ++r, src += d + int64_t(sizeof(half_t)), dst += d) {
    half_t stored;
    std::memcpy(&stored, src + d, 2);
    const float scale = to_float(stored);
    if constexpr (std::is_same_v<C, int8_code>) {
      const int8_t* c = reinterpret_cast<const int8_t*>(src);
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) dst[i] = float(c[i]) * scale;
    } else {
      const float* table = e4m3_table().v;
      const uint8_t* c = reinterpret_cast<const uint8_t*>(src);
      for (int64_t i = 0; i < d; ++i) dst[i] = table[c[i]] * scale;
    }
  }
}

}  // namespace TRTPAGED_CPU_TARGET_NS
}  // namespace trtpaged::cpu
