// Weight-only quantized linear on the CPU: y = x @ W^T with W given as int8 or uint4 codes
// and per-group scales (and offsets for int4). Two kinds of kernels over one packed form:
// - int8 activations: x quantized on the fly to int8 per block of 32 (symmetric, float scale),
//   dot products on integers, fp32 accumulation across blocks (compute-bound batches);
// - float activations: x stays float32, weight codes de-quantized in registers, fp32 FMA
//   (as accurate as F.linear on the de-quantized weight; decode, where weights' bytes dominate).
//
// This file is compiled without -march=native: every SIMD variant carries its own
// __attribute__((target)) and one is chosen at run time, so the library runs on any x86-64.
//
// Packed form (per tile of kRows = 4 output rows, rows past n are zero padding):
//   for each pair p of 32-blocks (k in [64p, 64p + 64), K padded with zeros to a multiple of 64):
//     codes  kRows x 64 bytes (int8: q + 128 as uint8) or kRows x 32 bytes (int4: byte j holds
//            q[64p + j] in the low nibble and q[64p + 32 + j] in the high nibble)
//     scales kRows x 2 fp16 (the scale of each row's two blocks; groups expanded to blocks)
//   then (int4 only) offsets kRows x ceil(K/G) fp16, and padding to 64 bytes.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "common.h"

// GCC 12's AVX-512 intrinsics (_mm512_reduce_add_ps, _mm512_cvtepi32_ps) start from
// _mm512_undefined_*(), which -Wuninitialized reports as used uninitialized: a false positive.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace {

using trtpaged::fail;

constexpr int kRows = 4;     // output rows per tile
constexpr int kMaxMB = 4;    // activation rows per kernel call (register blocking)
constexpr int kPairK = 64;   // inputs per pair of 32-blocks

enum Isa { kScalar = 0, kAvx2 = 1, kAvxVnni = 2, kAvx512Vnni = 3 };
const char* const kIsaNames[] = {"scalar", "avx2", "avxvnni", "avx512vnni"};

struct Layout {
  int bits;
  int64_t n, k;
  int32_t group;
  int64_t ntiles, npairs, ngroups;
  size_t row_pair_codes;  // code bytes of one row in one pair
  size_t pair_bytes;      // codes and scales of one pair (all rows of a tile)
  size_t tile_bytes;      // rounded up to 64
};

Layout make_layout(int bits, int64_t n, int64_t k, int32_t group) {
  Layout l{};
  l.bits = bits;
  l.n = n;
  l.k = k;
  l.group = group;
  l.ntiles = (n + kRows - 1) / kRows;
  l.npairs = (k + kPairK - 1) / kPairK;
  l.ngroups = k / group;
  l.row_pair_codes = bits == 8 ? 64 : 32;
  l.pair_bytes = kRows * l.row_pair_codes + kRows * 2 * sizeof(uint16_t);
  size_t bytes = l.npairs * l.pair_bytes + (bits == 4 ? kRows * l.ngroups * sizeof(uint16_t) : 0);
  l.tile_bytes = (bytes + 63) / 64 * 64;
  return l;
}

int validate_shape(int32_t bits, int64_t n, int64_t k, int32_t group) {
  if (bits != 8 && bits != 4)
    return fail(TRTPAGED_ERR_UNSUPPORTED, "bits: " + std::to_string(bits) + " not supported (4 or 8)");
  if (n < 1) return fail(TRTPAGED_ERR_INVALID_ARGUMENT, "n: must be >= 1, got " + std::to_string(n));
  if (k < 32 || k % 32 != 0)
    return fail(TRTPAGED_ERR_INVALID_ARGUMENT, "k: must be a positive multiple of 32, got " + std::to_string(k));
  if (k > (int64_t(1) << 24))
    return fail(TRTPAGED_ERR_UNSUPPORTED, "k: must be <= 2^24, got " + std::to_string(k));
  bool group_ok = group == 32 || group == 64 || group == 128 || (bits == 8 && group == k);
  if (!group_ok)
    return fail(TRTPAGED_ERR_UNSUPPORTED,
                "group_size: " + std::to_string(group) + " not supported (32, 64, 128" +
                    (bits == 8 ? std::string(" or k = ") + std::to_string(k) : std::string()) + " for bits " +
                    std::to_string(bits) + ")");
  if (k % group != 0)
    return fail(TRTPAGED_ERR_INVALID_ARGUMENT,
                "group_size: k = " + std::to_string(k) + " is not a multiple of " + std::to_string(group));
  return TRTPAGED_OK;
}

// fp16 bits of f, or false when f is not exactly representable as a finite fp16.
bool to_half_exact(float f, uint16_t* out) {
  if (!std::isfinite(f)) return false;
  _Float16 h = static_cast<_Float16>(f);
  if (static_cast<float>(h) != f) return false;
  std::memcpy(out, &h, sizeof(h));
  return true;
}

inline float half_to_float(uint16_t bits) {
  _Float16 h;
  std::memcpy(&h, &bits, sizeof(h));
  return static_cast<float>(h);
}

// ---------------------------------------------------------------------------------------------
// Activations quantized once per call, shared by all threads.
struct BlockRecord {  // one pair of 32-blocks of one activation row
  float dx[2];        // block scales
  int32_t nbias[2];   // -128 * sum of the block's codes (int8 weights are stored as q + 128)
};

struct Acts {
  int64_t m, k_padded, npairs, ngroups;
  const int8_t* xq;           // [m][k_padded]
  const BlockRecord* rec;     // [m][npairs]
  const float* group_sums;    // [m][ngroups]: sum over the group's blocks of dx * sum(codes); int4 only
};

// Quantizes one block of 32: d = max|x| / 127, q = round(x / d) (ties to even, as torch.round),
// computed as x * (1 / d) in float32 so a reference can reproduce it bit for bit.
inline float quantize_block_scalar(const float* x, int8_t* q, int32_t* sum) {
  float amax = 0.f;
  for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[i]));
  float d = amax / 127.f;
  float id = d > 0.f ? 1.f / d : 0.f;
  int32_t s = 0;
  for (int i = 0; i < 32; ++i) {
    int v = static_cast<int>(std::nearbyint(x[i] * id));
    q[i] = static_cast<int8_t>(v);
    s += v;
  }
  *sum = s;
  return d;
}

__attribute__((target("avx2,fma"))) float quantize_block_avx2(const float* x, int8_t* q, int32_t* sum) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 v[4];
  __m256 amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  float d = _mm_cvtss_f32(m4) / 127.f;
  float id = d > 0.f ? 1.f / d : 0.f;
  const __m256 idv = _mm256_set1_ps(id);
  __m256i iv[4];
  for (int i = 0; i < 4; ++i) iv[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], idv));  // MXCSR: nearest even
  __m256i s = _mm256_add_epi32(_mm256_add_epi32(iv[0], iv[1]), _mm256_add_epi32(iv[2], iv[3]));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
  *sum = _mm_cvtsi128_si32(s4);
  __m256i p16a = _mm256_packs_epi32(iv[0], iv[1]);
  __m256i p16b = _mm256_packs_epi32(iv[2], iv[3]);
  __m256i p8 = _mm256_packs_epi16(p16a, p16b);
  // packs works per 128-bit lane: restore element order.
  p8 = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), p8);
  return d;
}

// ---------------------------------------------------------------------------------------------
// Tile kernels: out[r * kMaxMB + i] = sum over k of x[m0 + i] (quantized) . (scale * code)[row r],
// without the int4 offset term (added by the driver).
struct TileArgs {
  const Layout* l;
  const Acts* a;
  const uint8_t* tile;
  int64_t m0;
};

// Computes min(count, the variant's register block) activation rows and returns how many.
using TileKernel = int (*)(const TileArgs&, int count, float* out);

template <int BITS, int MB>
void tile_scalar_mb(const TileArgs& t, float* out) {
  const Layout& l = *t.l;
  const Acts& a = *t.a;
  float acc[kRows][MB] = {};
  for (int64_t p = 0; p < l.npairs; ++p) {
    const uint8_t* pc = t.tile + p * l.pair_bytes;
    const uint16_t* sc = reinterpret_cast<const uint16_t*>(pc + kRows * l.row_pair_codes);
    for (int r = 0; r < kRows; ++r) {
      const uint8_t* w = pc + r * l.row_pair_codes;
      for (int h = 0; h < 2; ++h) {
        float sw = half_to_float(sc[2 * r + h]);
        for (int i = 0; i < MB; ++i) {
          const int8_t* xq = a.xq + (t.m0 + i) * a.k_padded + p * kPairK + h * 32;
          int32_t s = 0;
          for (int j = 0; j < 32; ++j) {
            int wv = BITS == 8 ? int(w[h * 32 + j]) - 128 : (h == 0 ? (w[j] & 0x0F) : (w[j] >> 4));
            s += wv * xq[j];
          }
          acc[r][i] += float(s) * (sw * a.rec[(t.m0 + i) * a.npairs + p].dx[h]);
        }
      }
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int i = 0; i < MB; ++i) out[r * kMaxMB + i] = acc[r][i];
}

template <int BITS>
int tile_scalar(const TileArgs& t, int count, float* out) {
  switch (count) {
    case 4: return tile_scalar_mb<BITS, 4>(t, out), 4;
    case 3: return tile_scalar_mb<BITS, 3>(t, out), 3;
    case 2: return tile_scalar_mb<BITS, 2>(t, out), 2;
    default: return tile_scalar_mb<BITS, 1>(t, out), 1;
  }
}

__attribute__((target("avx2,fma"))) inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 256-bit kernels: one 32-block per register. VNNI uses vpdpbusd (u8 x s8 -> s32) with the
// int8 weights' +128 bias removed through the accumulator's initial value; plain AVX2 uses
// vpmaddubsw on |w| (|-128| = 128 as uint8) and x with w's sign (int8; |x| <= 127 so negating
// is exact and pair sums stay within int16), or directly (uint4).
#define TRTPAGED_TILE256_BODY(DOT)                                                                 \
  const Layout& l = *t.l;                                                                          \
  const Acts& a = *t.a;                                                                            \
  const __m256i low4 = _mm256_set1_epi8(0x0F);                                                     \
  __m256 acc[kRows][MB];                                                                           \
  for (int r = 0; r < kRows; ++r)                                                                  \
    for (int i = 0; i < MB; ++i) acc[r][i] = _mm256_setzero_ps();                                  \
  for (int64_t p = 0; p < l.npairs; ++p) {                                                         \
    const uint8_t* pc = t.tile + p * l.pair_bytes;                                                 \
    alignas(32) float sw[8];                                                                       \
    _mm256_store_ps(sw, _mm256_cvtph_ps(_mm_loadu_si128(                                            \
                            reinterpret_cast<const __m128i*>(pc + kRows * l.row_pair_codes))));    \
    for (int h = 0; h < 2; ++h) {                                                                  \
      __m256i w[kRows];                                                                            \
      for (int r = 0; r < kRows; ++r) {                                                            \
        if (BITS == 8) {                                                                           \
          w[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pc + r * 64 + h * 32));        \
        } else {                                                                                   \
          __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pc + r * 32));            \
          w[r] = _mm256_and_si256(h == 0 ? b : _mm256_srli_epi16(b, 4), low4);                     \
        }                                                                                          \
      }                                                                                            \
      for (int i = 0; i < MB; ++i) {                                                               \
        const BlockRecord& rec = a.rec[(t.m0 + i) * a.npairs + p];                                 \
        __m256i xv = _mm256_loadu_si256(                                                           \
            reinterpret_cast<const __m256i*>(a.xq + (t.m0 + i) * a.k_padded + p * kPairK + h * 32)); \
        for (int r = 0; r < kRows; ++r) {                                                          \
          __m256i d32 = DOT;                                                                       \
          acc[r][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d32), _mm256_set1_ps(sw[2 * r + h] * rec.dx[h]), \
                                      acc[r][i]);                                                  \
        }                                                                                          \
      }                                                                                            \
    }                                                                                              \
  }                                                                                                \
  for (int r = 0; r < kRows; ++r)                                                                  \
    for (int i = 0; i < MB; ++i) out[r * kMaxMB + i] = hsum256(acc[r][i]);

template <int BITS, int MB>
__attribute__((target("avx2,fma,f16c"))) void tile_avx2_mb(const TileArgs& t, float* out) {
  const __m256i ones16 = _mm256_set1_epi16(1);
  const __m256i flip = _mm256_set1_epi8(char(0x80));
  TRTPAGED_TILE256_BODY(
      (BITS == 8 ? _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(_mm256_xor_si256(w[r], flip)),
                                                          _mm256_sign_epi8(xv, _mm256_xor_si256(w[r], flip))),
                                     ones16)
                 : _mm256_madd_epi16(_mm256_maddubs_epi16(w[r], xv), ones16)))
}

template <int BITS, int MB>
__attribute__((target("avx2,fma,f16c,avxvnni"))) void tile_avxvnni_mb(const TileArgs& t, float* out) {
  TRTPAGED_TILE256_BODY(_mm256_dpbusd_avx_epi32(
      BITS == 8 ? _mm256_setr_epi32(rec.nbias[h], 0, 0, 0, 0, 0, 0, 0) : _mm256_setzero_si256(), w[r], xv))
}

template <int BITS>
__attribute__((target("avx2,fma,f16c"))) int tile_avx2(const TileArgs& t, int count, float* out) {
  if (count >= 2) return tile_avx2_mb<BITS, 2>(t, out), 2;
  return tile_avx2_mb<BITS, 1>(t, out), 1;
}

template <int BITS>
__attribute__((target("avx2,fma,f16c,avxvnni"))) int tile_avxvnni(const TileArgs& t, int count, float* out) {
  if (count >= 2) return tile_avxvnni_mb<BITS, 2>(t, out), 2;
  return tile_avxvnni_mb<BITS, 1>(t, out), 1;
}

// 512-bit kernel: a pair of 32-blocks per register (lanes 0-7 block 0, lanes 8-15 block 1).
template <int BITS, int MB>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c"))) void tile_avx512_mb(
    const TileArgs& t, float* out) {
  const Layout& l = *t.l;
  const Acts& a = *t.a;
  const __m512i half_idx = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i bias_idx = _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2);
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m512i row_idx[kRows];
  for (int r = 0; r < kRows; ++r)
    row_idx[r] = _mm512_add_epi32(half_idx, _mm512_set1_epi32(2 * r));
  __m512 acc[kRows][MB];
  for (int r = 0; r < kRows; ++r)
    for (int i = 0; i < MB; ++i) acc[r][i] = _mm512_setzero_ps();
  for (int64_t p = 0; p < l.npairs; ++p) {
    const uint8_t* pc = t.tile + p * l.pair_bytes;
    __m512i w[kRows];
    for (int r = 0; r < kRows; ++r) {
      if (BITS == 8) {
        w[r] = _mm512_loadu_si512(pc + r * 64);
      } else {
        __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pc + r * 32));
        w[r] = _mm512_inserti64x4(_mm512_zextsi256_si512(_mm256_and_si256(b, low4)),
                                  _mm256_and_si256(_mm256_srli_epi16(b, 4), low4), 1);
      }
    }
    __m512 s8 = _mm512_zextps256_ps512(
        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pc + kRows * l.row_pair_codes))));
    __m512 sw[kRows];
    for (int r = 0; r < kRows; ++r) sw[r] = _mm512_permutexvar_ps(row_idx[r], s8);
    for (int i = 0; i < MB; ++i) {
      __m128 rec = _mm_loadu_ps(reinterpret_cast<const float*>(&a.rec[(t.m0 + i) * a.npairs + p]));
      __m512 dx = _mm512_permutexvar_ps(half_idx, _mm512_zextps128_ps512(rec));
      __m512i bias = BITS == 8 ? _mm512_maskz_permutexvar_epi32(0x0101, bias_idx,
                                                                _mm512_zextsi128_si512(_mm_castps_si128(rec)))
                               : _mm512_setzero_si512();
      __m512i xv = _mm512_loadu_si512(a.xq + (t.m0 + i) * a.k_padded + p * kPairK);
      for (int r = 0; r < kRows; ++r) {
        __m512i d32 = _mm512_dpbusd_epi32(bias, w[r], xv);
        acc[r][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d32), _mm512_mul_ps(sw[r], dx), acc[r][i]);
      }
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int i = 0; i < MB; ++i) out[r * kMaxMB + i] = _mm512_reduce_add_ps(acc[r][i]);
}

template <int BITS>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c"))) int tile_avx512(
    const TileArgs& t, int count, float* out) {
  switch (count) {
    case 4: return tile_avx512_mb<BITS, 4>(t, out), 4;
    case 3: return tile_avx512_mb<BITS, 3>(t, out), 3;
    case 2: return tile_avx512_mb<BITS, 2>(t, out), 2;
    default: return tile_avx512_mb<BITS, 1>(t, out), 1;
  }
}

// ---------------------------------------------------------------------------------------------
// Float-activation kernels: x stays float32; each weight block's codes are converted to float
// in registers, dotted with x in fp32 (a fresh partial sum per block), and the block sum is
// scaled by the block's scale. out[r * kMaxMB + i] as for the integer kernels: without the int4
// offset term, which the driver adds from float group sums of x.
struct FloatTileArgs {
  const Layout* l;
  const float* x;  // row m0 of x, row stride l->k
  const uint8_t* tile;
};

using FloatTileKernel = int (*)(const FloatTileArgs&, int count, float* out);

template <int BITS, int MB>
void ftile_scalar_mb(const FloatTileArgs& t, float* out) {
  const Layout& l = *t.l;
  float acc[kRows][MB] = {};
  for (int64_t b = 0; b < l.k / 32; ++b) {
    const int64_t p = b / 2;
    const int h = int(b % 2);
    const uint8_t* pc = t.tile + p * l.pair_bytes;
    const uint16_t* sc = reinterpret_cast<const uint16_t*>(pc + kRows * l.row_pair_codes);
    for (int r = 0; r < kRows; ++r) {
      const uint8_t* w = pc + r * l.row_pair_codes;
      for (int i = 0; i < MB; ++i) {
        const float* xb = t.x + i * l.k + b * 32;
        float blk = 0.f;
        for (int j = 0; j < 32; ++j) {
          const int q = BITS == 8 ? int(w[h * 32 + j]) - 128 : (h == 0 ? (w[j] & 0x0F) : (w[j] >> 4));
          blk = std::fma(float(q), xb[j], blk);
        }
        acc[r][i] = std::fma(blk, half_to_float(sc[2 * r + h]), acc[r][i]);
      }
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int i = 0; i < MB; ++i) out[r * kMaxMB + i] = acc[r][i];
}

template <int BITS>
int ftile_scalar(const FloatTileArgs& t, int count, float* out) {
  if (count >= 2) return ftile_scalar_mb<BITS, 2>(t, out), 2;
  return ftile_scalar_mb<BITS, 1>(t, out), 1;
}

template <int BITS, int MB>
__attribute__((target("avx2,fma,f16c"))) void ftile_avx2_mb(const FloatTileArgs& t, float* out) {
  const Layout& l = *t.l;
  const __m256i flip = _mm256_set1_epi8(char(0x80));
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m256 acc[kRows][MB];
  for (int r = 0; r < kRows; ++r)
    for (int i = 0; i < MB; ++i) acc[r][i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < l.k / 32; ++b) {
    const int64_t p = b / 2;
    const int h = int(b % 2);
    const uint8_t* pc = t.tile + p * l.pair_bytes;
    alignas(32) float sw[8];
    _mm256_store_ps(sw, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pc + kRows * l.row_pair_codes))));
    for (int r = 0; r < kRows; ++r) {
      __m256i c;  // the block's 32 codes, as int8 (bits 8) or uint8 0..15 (bits 4)
      if (BITS == 8) {
        c = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(pc + r * 64 + h * 32)), flip);
      } else {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pc + r * 32));
        c = _mm256_and_si256(h == 0 ? raw : _mm256_srli_epi16(raw, 4), low4);
      }
      const __m128i halves[2] = {_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1)};
      __m256 blk[MB];
      for (int q8 = 0; q8 < 4; ++q8) {
        const __m128i part = q8 % 2 == 0 ? halves[q8 / 2] : _mm_srli_si128(halves[q8 / 2], 8);
        const __m256 w = _mm256_cvtepi32_ps(BITS == 8 ? _mm256_cvtepi8_epi32(part) : _mm256_cvtepu8_epi32(part));
        for (int i = 0; i < MB; ++i) {
          const __m256 xv = _mm256_loadu_ps(t.x + i * l.k + b * 32 + q8 * 8);
          blk[i] = q8 == 0 ? _mm256_mul_ps(w, xv) : _mm256_fmadd_ps(w, xv, blk[i]);
        }
      }
      const __m256 sv = _mm256_set1_ps(sw[2 * r + h]);
      for (int i = 0; i < MB; ++i) acc[r][i] = _mm256_fmadd_ps(blk[i], sv, acc[r][i]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int i = 0; i < MB; ++i) out[r * kMaxMB + i] = hsum256(acc[r][i]);
}

template <int BITS>
__attribute__((target("avx2,fma,f16c"))) int ftile_avx2(const FloatTileArgs& t, int count, float* out) {
  if (count >= 2) return ftile_avx2_mb<BITS, 2>(t, out), 2;
  return ftile_avx2_mb<BITS, 1>(t, out), 1;
}

template <int BITS, int MB>
__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"))) void ftile_avx512_mb(const FloatTileArgs& t,
                                                                                          float* out) {
  const Layout& l = *t.l;
  const __m256i flip = _mm256_set1_epi8(char(0x80));
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m512 acc[kRows][MB];
  for (int r = 0; r < kRows; ++r)
    for (int i = 0; i < MB; ++i) acc[r][i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < l.k / 32; ++b) {
    const int64_t p = b / 2;
    const int h = int(b % 2);
    const uint8_t* pc = t.tile + p * l.pair_bytes;
    alignas(32) float sw[8];
    _mm256_store_ps(sw, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pc + kRows * l.row_pair_codes))));
    __m512 xv[MB][2];
    for (int i = 0; i < MB; ++i) {
      xv[i][0] = _mm512_loadu_ps(t.x + i * l.k + b * 32);
      xv[i][1] = _mm512_loadu_ps(t.x + i * l.k + b * 32 + 16);
    }
    for (int r = 0; r < kRows; ++r) {
      __m256i c;
      if (BITS == 8) {
        c = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(pc + r * 64 + h * 32)), flip);
      } else {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pc + r * 32));
        c = _mm256_and_si256(h == 0 ? raw : _mm256_srli_epi16(raw, 4), low4);
      }
      const __m512 w0 = _mm512_cvtepi32_ps(BITS == 8 ? _mm512_cvtepi8_epi32(_mm256_castsi256_si128(c))
                                                     : _mm512_cvtepu8_epi32(_mm256_castsi256_si128(c)));
      const __m512 w1 = _mm512_cvtepi32_ps(BITS == 8 ? _mm512_cvtepi8_epi32(_mm256_extracti128_si256(c, 1))
                                                     : _mm512_cvtepu8_epi32(_mm256_extracti128_si256(c, 1)));
      const __m512 sv = _mm512_set1_ps(sw[2 * r + h]);
      for (int i = 0; i < MB; ++i)
        acc[r][i] = _mm512_fmadd_ps(_mm512_fmadd_ps(w1, xv[i][1], _mm512_mul_ps(w0, xv[i][0])), sv, acc[r][i]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int i = 0; i < MB; ++i) out[r * kMaxMB + i] = _mm512_reduce_add_ps(acc[r][i]);
}

template <int BITS>
__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"))) int ftile_avx512(const FloatTileArgs& t,
                                                                                      int count, float* out) {
  switch (count) {
    case 4: return ftile_avx512_mb<BITS, 4>(t, out), 4;
    case 3: return ftile_avx512_mb<BITS, 3>(t, out), 3;
    case 2: return ftile_avx512_mb<BITS, 2>(t, out), 2;
    default: return ftile_avx512_mb<BITS, 1>(t, out), 1;
  }
}

// int4 offset term of one tile for one activation row: off[r] = sum_g offsets[r][g] * group_sums[g].
using OffsetFn = void (*)(const uint16_t* offsets, const float* group_sums, int64_t ngroups, float* off);

void offsets_scalar(const uint16_t* oh, const float* gs, int64_t ng, float* off) {
  for (int r = 0; r < kRows; ++r) {
    float s = 0.f;
    for (int64_t g = 0; g < ng; ++g) s += half_to_float(oh[r * ng + g]) * gs[g];
    off[r] = s;
  }
}

__attribute__((target("avx2,fma,f16c"))) void offsets_avx2(const uint16_t* oh, const float* gs, int64_t ng,
                                                           float* off) {
  __m256 acc[kRows];
  for (int r = 0; r < kRows; ++r) acc[r] = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= ng; g += 8) {
    const __m256 gv = _mm256_loadu_ps(gs + g);
    for (int r = 0; r < kRows; ++r)
      acc[r] = _mm256_fmadd_ps(
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(oh + r * ng + g))), gv, acc[r]);
  }
  for (int r = 0; r < kRows; ++r) {
    float s = hsum256(acc[r]);
    for (int64_t j = g; j < ng; ++j) s += _cvtsh_ss(oh[r * ng + j]) * gs[j];
    off[r] = s;
  }
}

// ---------------------------------------------------------------------------------------------
// Dispatch.
// Whether this CPU (and OS) can run a variant: AVX-512 VNNI and AVX-VNNI are independent
// (Ice Lake and Zen 4 have the first without the second).
bool isa_supported(Isa isa) {
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  switch (isa) {
    case kAvx512Vnni:
      return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
    case kAvxVnni: return avx2 && __builtin_cpu_supports("avxvnni");
    case kAvx2: return avx2;
    default: return true;
  }
}

Isa best_isa() {
  for (Isa isa : {kAvx512Vnni, kAvxVnni, kAvx2})
    if (isa_supported(isa)) return isa;
  return kScalar;
}

int isa_from_name(const char* name) {
  for (int i = 0; i < 4; ++i)
    if (std::strcmp(name, kIsaNames[i]) == 0) return i;
  return -1;
}

// -1 until first use; then the ISA in use. Set from TRTPAGED_CPU_ISA at first use (when lower
// than the best and supported; otherwise ignored), or by trtpaged_set_cpu_isa.
int g_isa = -1;

Isa current_isa() {
  int isa = __atomic_load_n(&g_isa, __ATOMIC_ACQUIRE);
  if (isa >= 0) return Isa(isa);
  Isa best = best_isa();
  Isa chosen = best;
  if (const char* env = std::getenv("TRTPAGED_CPU_ISA")) {
    const int want = isa_from_name(env);
    if (want >= 0 && want < best && isa_supported(Isa(want))) chosen = Isa(want);
  }
  __atomic_store_n(&g_isa, int(chosen), __ATOMIC_RELEASE);
  return chosen;
}

TileKernel tile_kernel(Isa isa, int bits) {
  switch (isa) {
    case kAvx512Vnni: return bits == 8 ? tile_avx512<8> : tile_avx512<4>;
    case kAvxVnni: return bits == 8 ? tile_avxvnni<8> : tile_avxvnni<4>;
    case kAvx2: return bits == 8 ? tile_avx2<8> : tile_avx2<4>;
    default: return bits == 8 ? tile_scalar<8> : tile_scalar<4>;
  }
}

FloatTileKernel float_tile_kernel(Isa isa, int bits) {
  switch (isa) {
    case kAvx512Vnni: return bits == 8 ? ftile_avx512<8> : ftile_avx512<4>;
    case kAvxVnni:
    case kAvx2: return bits == 8 ? ftile_avx2<8> : ftile_avx2<4>;
    default: return bits == 8 ? ftile_scalar<8> : ftile_scalar<4>;
  }
}

// ---------------------------------------------------------------------------------------------
struct ActBuffer {
  std::vector<int8_t> xq;
  std::vector<BlockRecord> rec;
  std::vector<float> group_sums;
};

void quantize_activations(const float* x, int64_t m, const Layout& l, Isa isa, ActBuffer& buf, Acts& acts) {
  const int64_t kp = l.npairs * kPairK;
  buf.xq.assign(size_t(m * kp), 0);
  buf.rec.assign(size_t(m * l.npairs), BlockRecord{{0.f, 0.f}, {0, 0}});
  if (l.bits == 4) buf.group_sums.assign(size_t(m * l.ngroups), 0.f);
  const int64_t nblocks = l.k / 32;
  const int64_t blocks_per_group = l.group / 32;
  const bool simd = isa != kScalar;
  auto quantize_row = [&](int64_t row) {
    for (int64_t b = 0; b < nblocks; ++b) {
      int32_t sum;
      const float* xb = x + row * l.k + b * 32;
      int8_t* qb = buf.xq.data() + row * kp + b * 32;
      float d = simd ? quantize_block_avx2(xb, qb, &sum) : quantize_block_scalar(xb, qb, &sum);
      BlockRecord& rec = buf.rec[row * l.npairs + b / 2];
      rec.dx[b % 2] = d;
      rec.nbias[b % 2] = -128 * sum;
      if (l.bits == 4) buf.group_sums[row * l.ngroups + b / blocks_per_group] += d * float(sum);
    }
  };
  // An OpenMP region costs microseconds even when it runs serially: small calls skip it.
  if (m * l.k >= (1 << 16)) {
#pragma omp parallel for schedule(static)
    for (int64_t row = 0; row < m; ++row) quantize_row(row);
  } else {
    for (int64_t row = 0; row < m; ++row) quantize_row(row);
  }
  acts.m = m;
  acts.k_padded = kp;
  acts.npairs = l.npairs;
  acts.ngroups = l.ngroups;
  acts.xq = buf.xq.data();
  acts.rec = buf.rec.data();
  acts.group_sums = l.bits == 4 ? buf.group_sums.data() : nullptr;
}

void run_tiles(const Layout& l, const Acts& a, const uint8_t* packed, const float* bias, float* y, Isa isa) {
  const TileKernel kernel = tile_kernel(isa, l.bits);
  const OffsetFn offset_term = isa == kScalar ? offsets_scalar : offsets_avx2;
  const int64_t m = a.m;
  // Work items: (tile, chunk of activation rows); tile-major so one thread's consecutive items
  // reuse the tile's weights from cache.
  const int64_t mchunk = 64;
  const int64_t nchunks = (m + mchunk - 1) / mchunk;
  const int64_t items = l.ntiles * nchunks;
  const double work = double(l.ntiles) * kRows * double(l.k) * double(m);
  auto run_item = [&](int64_t item) {
    const int64_t tile = item / nchunks;
    const int64_t mbeg = (item % nchunks) * mchunk;
    const int64_t mend = std::min(m, mbeg + mchunk);
    const uint8_t* tp = packed + tile * l.tile_bytes;
    const int rows = int(std::min<int64_t>(kRows, l.n - tile * kRows));
    for (int64_t m0 = mbeg; m0 < mend;) {
      float out[kRows * kMaxMB];
      TileArgs args{&l, &a, tp, m0};
      const int count = kernel(args, int(std::min<int64_t>(kMaxMB, mend - m0)), out);
      for (int i = 0; i < count; ++i) {
        float off[kRows] = {0.f, 0.f, 0.f, 0.f};
        if (l.bits == 4)
          offset_term(reinterpret_cast<const uint16_t*>(tp + l.npairs * l.pair_bytes),
                      a.group_sums + (m0 + i) * l.ngroups, l.ngroups, off);
        float* yrow = y + (m0 + i) * l.n + tile * kRows;
        for (int r = 0; r < rows; ++r)
          yrow[r] = out[r * kMaxMB + i] + off[r] + (bias ? bias[tile * kRows + r] : 0.f);
      }
      m0 += count;
    }
  };
  if (work >= 32768.0) {
#pragma omp parallel for schedule(static)
    for (int64_t item = 0; item < items; ++item) run_item(item);
  } else {
    for (int64_t item = 0; item < items; ++item) run_item(item);
  }
}

void run_tiles_float(const Layout& l, const float* x, int64_t m, const uint8_t* packed, const float* bias, float* y,
                     Isa isa) {
  const FloatTileKernel kernel = float_tile_kernel(isa, l.bits);
  const OffsetFn offset_term = isa == kScalar ? offsets_scalar : offsets_avx2;
  // int4: the offset term sum_g offset[g] * (sum of x over group g), from float group sums.
  static thread_local std::vector<float> group_sums;
  if (l.bits == 4) {
    group_sums.assign(size_t(m * l.ngroups), 0.f);
    for (int64_t row = 0; row < m; ++row)
      for (int64_t g = 0; g < l.ngroups; ++g) {
        const float* xg = x + row * l.k + g * l.group;
        float s = 0.f;
        for (int32_t j = 0; j < l.group; ++j) s += xg[j];
        group_sums[row * l.ngroups + g] = s;
      }
  }
  const float* gsums = group_sums.data();
  const int64_t mchunk = 64;
  const int64_t nchunks = (m + mchunk - 1) / mchunk;
  const int64_t items = l.ntiles * nchunks;
  const double work = double(l.ntiles) * kRows * double(l.k) * double(m);
  auto run_item = [&](int64_t item) {
    const int64_t tile = item / nchunks;
    const int64_t mbeg = (item % nchunks) * mchunk;
    const int64_t mend = std::min(m, mbeg + mchunk);
    const uint8_t* tp = packed + tile * l.tile_bytes;
    const int rows = int(std::min<int64_t>(kRows, l.n - tile * kRows));
    for (int64_t m0 = mbeg; m0 < mend;) {
      float out[kRows * kMaxMB];
      FloatTileArgs args{&l, x + m0 * l.k, tp};
      const int count = kernel(args, int(std::min<int64_t>(kMaxMB, mend - m0)), out);
      for (int i = 0; i < count; ++i) {
        float off[kRows] = {0.f, 0.f, 0.f, 0.f};
        if (l.bits == 4)
          offset_term(reinterpret_cast<const uint16_t*>(tp + l.npairs * l.pair_bytes), gsums + (m0 + i) * l.ngroups,
                      l.ngroups, off);
        float* yrow = y + (m0 + i) * l.n + tile * kRows;
        for (int r = 0; r < rows; ++r) yrow[r] = out[r * kMaxMB + i] + off[r] + (bias ? bias[tile * kRows + r] : 0.f);
      }
      m0 += count;
    }
  };
  if (work >= 32768.0) {
#pragma omp parallel for schedule(static)
    for (int64_t item = 0; item < items; ++item) run_item(item);
  } else {
    for (int64_t item = 0; item < items; ++item) run_item(item);
  }
}

}  // namespace

extern "C" {

TRTPAGED_API trtpaged_status trtpaged_qlinear_packed_bytes(int32_t bits, int64_t n, int64_t k, int32_t group_size,
                                                           size_t* bytes) {
  using namespace trtpaged;
  if (!bytes) return trtpaged_status(fail(TRTPAGED_ERR_INVALID_ARGUMENT, "bytes: null pointer"));
  if (int rc = validate_shape(bits, n, k, group_size)) return trtpaged_status(rc);
  Layout l = make_layout(bits, n, k, group_size);
  *bytes = size_t(l.ntiles) * l.tile_bytes;
  return trtpaged_status(ok());
}

TRTPAGED_API trtpaged_status trtpaged_qlinear_pack(int32_t bits, int64_t n, int64_t k, int32_t group_size,
                                                   const void* codes, const float* scales, const float* offsets,
                                                   void* packed) {
  using namespace trtpaged;
  try {
    if (int rc = validate_shape(bits, n, k, group_size)) return trtpaged_status(rc);
    if (!codes) return trtpaged_status(fail(TRTPAGED_ERR_INVALID_ARGUMENT, "codes: null pointer"));
    if (!scales) return trtpaged_status(fail(TRTPAGED_ERR_INVALID_ARGUMENT, "scales: null pointer"));
    if (!packed) return trtpaged_status(fail(TRTPAGED_ERR_INVALID_ARGUMENT, "packed: null pointer"));
    if (bits == 4 && !offsets)
      return trtpaged_status(fail(TRTPAGED_ERR_INVALID_ARGUMENT, "offsets: required for bits 4"));
    if (bits == 8 && offsets)
      return trtpaged_status(fail(TRTPAGED_ERR_INVALID_ARGUMENT, "offsets: must be NULL for bits 8"));
    if (reinterpret_cast<uintptr_t>(packed) % 64 != 0)
      return trtpaged_status(fail(TRTPAGED_ERR_INVALID_ARGUMENT, "packed: must be 64-byte aligned"));
    const Layout l = make_layout(bits, n, k, group_size);
    const int64_t ng = l.ngroups;
    // Check every scale and offset before writing anything.
    for (int64_t i = 0; i < n * ng; ++i) {
      uint16_t h;
      if (!to_half_exact(scales[i], &h))
        return trtpaged_status(fail(TRTPAGED_ERR_UNSUPPORTED,
                                    "scales: value " + std::to_string(scales[i]) + " at [" + std::to_string(i / ng) +
                                        ", " + std::to_string(i % ng) + "] is not exactly representable in fp16"));
      if (offsets && !to_half_exact(offsets[i], &h))
        return trtpaged_status(fail(TRTPAGED_ERR_UNSUPPORTED,
                                    "offsets: value " + std::to_string(offsets[i]) + " at [" +
                                        std::to_string(i / ng) + ", " + std::to_string(i % ng) +
                                        "] is not exactly representable in fp16"));
    }
    uint8_t* out = static_cast<uint8_t*>(packed);
    std::memset(out, 0, size_t(l.ntiles) * l.tile_bytes);
    const int8_t* c8 = static_cast<const int8_t*>(codes);
    const uint8_t* c4 = static_cast<const uint8_t*>(codes);
    for (int64_t tile = 0; tile < l.ntiles; ++tile) {
      uint8_t* tp = out + tile * l.tile_bytes;
      for (int r = 0; r < kRows; ++r) {
        const int64_t row = tile * kRows + r;
        const bool real = row < n;
        for (int64_t p = 0; p < l.npairs; ++p) {
          uint8_t* pc = tp + p * l.pair_bytes;
          uint8_t* w = pc + r * l.row_pair_codes;
          uint16_t* sc = reinterpret_cast<uint16_t*>(pc + kRows * l.row_pair_codes);
          for (int h = 0; h < 2; ++h) {
            const int64_t kb = p * kPairK + h * 32;  // first input of this block
            if (real && kb < k) to_half_exact(scales[row * ng + kb / group_size], &sc[2 * r + h]);
          }
          for (int j = 0; j < (bits == 8 ? 64 : 32); ++j) {
            if (bits == 8) {
              const int64_t kk = p * kPairK + j;
              const int q = (real && kk < k) ? c8[row * k + kk] : 0;
              w[j] = uint8_t(q + 128);
            } else {
              auto nib = [&](int64_t kk) -> uint8_t {
                if (!real || kk >= k) return 0;
                const uint8_t byte = c4[row * (k / 2) + kk / 2];
                return kk % 2 == 0 ? (byte & 0x0F) : (byte >> 4);
              };
              w[j] = uint8_t(nib(p * kPairK + j) | (nib(p * kPairK + 32 + j) << 4));
            }
          }
        }
        if (bits == 4 && real) {
          uint16_t* oh = reinterpret_cast<uint16_t*>(tp + l.npairs * l.pair_bytes);
          for (int64_t g = 0; g < ng; ++g) to_half_exact(offsets[row * ng + g], &oh[r * ng + g]);
        }
      }
    }
    return trtpaged_status(ok());
  } catch (const std::exception& e) {
    return trtpaged_status(fail(TRTPAGED_ERR_INVALID_ARGUMENT, std::string("qlinear_pack: ") + e.what()));
  }
}

TRTPAGED_API trtpaged_status trtpaged_qlinear_cpu_ex(const float* x, int64_t m, const void* packed, int32_t bits,
                                                     int64_t n, int64_t k, int32_t group_size, const float* bias,
                                                     float* y, int32_t activations) {
  using namespace trtpaged;
  try {
    if (int rc = validate_shape(bits, n, k, group_size)) return trtpaged_status(rc);
    if (activations != TRTPAGED_QLINEAR_INT8_ACTIVATIONS && activations != TRTPAGED_QLINEAR_FLOAT_ACTIVATIONS)
      return trtpaged_status(fail(TRTPAGED_ERR_INVALID_ARGUMENT,
                                  "activations: must be 0 (int8) or 1 (float32), got " + std::to_string(activations)));
    if (m < 0) return trtpaged_status(fail(TRTPAGED_ERR_INVALID_ARGUMENT, "m: must be >= 0, got " + std::to_string(m)));
    if (m == 0) return trtpaged_status(ok());
    if (!x) return trtpaged_status(fail(TRTPAGED_ERR_INVALID_ARGUMENT, "x: null pointer"));
    if (!packed) return trtpaged_status(fail(TRTPAGED_ERR_INVALID_ARGUMENT, "packed: null pointer"));
    if (!y) return trtpaged_status(fail(TRTPAGED_ERR_INVALID_ARGUMENT, "y: null pointer"));
    const Layout l = make_layout(bits, n, k, group_size);
    const Isa isa = current_isa();
    if (activations == TRTPAGED_QLINEAR_FLOAT_ACTIVATIONS) {
      run_tiles_float(l, x, m, static_cast<const uint8_t*>(packed), bias, y, isa);
      return trtpaged_status(ok());
    }
    // One buffer per calling thread, reused across calls (no allocation per decode step).
    static thread_local ActBuffer buf;
    Acts acts{};
    quantize_activations(x, m, l, isa, buf, acts);
    run_tiles(l, acts, static_cast<const uint8_t*>(packed), bias, y, isa);
    return trtpaged_status(ok());
  } catch (const std::exception& e) {
    return trtpaged_status(fail(TRTPAGED_ERR_INVALID_ARGUMENT, std::string("qlinear_cpu: ") + e.what()));
  }
}

TRTPAGED_API trtpaged_status trtpaged_qlinear_cpu(const float* x, int64_t m, const void* packed, int32_t bits,
                                                  int64_t n, int64_t k, int32_t group_size, const float* bias,
                                                  float* y) {
  return trtpaged_qlinear_cpu_ex(x, m, packed, bits, n, k, group_size, bias, y, TRTPAGED_QLINEAR_INT8_ACTIVATIONS);
}

TRTPAGED_API const char* trtpaged_cpu_isa(void) { return kIsaNames[current_isa()]; }

TRTPAGED_API trtpaged_status trtpaged_set_cpu_isa(const char* name) {
  using namespace trtpaged;
  const Isa best = best_isa();
  if (!name || !*name) {
    __atomic_store_n(&g_isa, int(best), __ATOMIC_RELEASE);
    return trtpaged_status(ok());
  }
  const int want = isa_from_name(name);
  if (want < 0)
    return trtpaged_status(fail(TRTPAGED_ERR_INVALID_ARGUMENT, std::string("name: unknown instruction set '") + name +
                                                                   "' (avx512vnni, avxvnni, avx2 or scalar)"));
  if (!isa_supported(Isa(want)))
    return trtpaged_status(fail(TRTPAGED_ERR_UNSUPPORTED, std::string("name: this CPU does not support ") + name +
                                                              " (best: " + kIsaNames[best] + ")"));
  __atomic_store_n(&g_isa, want, __ATOMIC_RELEASE);
  return trtpaged_status(ok());
}

}  // extern "C"
