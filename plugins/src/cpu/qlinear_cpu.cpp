// Weight-only quantized linear on the CPU: y = x @ W^T with W given as int8 or uint4 codes
// and per-group scales (and offsets for int4). Two kinds of kernels over one packed form:
// - int8 activations: x quantized on the fly to int8 per block of 32 (symmetric, float scale),
//   dot products on integers (vpdpbusd / vpmaddubsw), fp32 accumulation across blocks;
// - float activations, two ways, both as accurate as F.linear on the de-quantized weight:
//   * limbs (small batches): each block of x split into kLimbs int8 "limbs",
//     x = d1 q1 + d2 q2 + d3 q3 with d(l+1) = d(l) / 254, i.e. the int8 rounding residual quantized
//     again; the limb rows run through the integer kernels as extra activation rows and their
//     outputs are summed. What is left out is below max|x| * 6.1e-8 per block: fp32 rounding level.
//   * float tiles (larger batches): x stays float32, weight codes converted to float in
//     registers, fp32 FMA.
//   The two round differently. FLOAT activations choose by the row count (limb_max_rows); FLOAT_LIMB
//   activations take the limbs at every row count, so that each row's y is that of the row run alone (where one row
//   takes the float tiles, plain AVX2 int8 weights, both take the float tiles: the same bits at every row count).
//
// This file is compiled without -march=native: every SIMD variant carries its own
// __attribute__((target)) and one is chosen at run time, so the library runs on any x86-64.
//
// Packed form: tiles of kRows = 16 output rows (rows past n are zero padding), each
//   for each 32-block b of inputs (k in [32b, 32b + 32)):
//     codes, "row-interleaved": 4 consecutive inputs (a quad) of the 16 rows side by side, so
//       one 64-byte register holds one quad of every row (lane r = row r):
//       int8: 8 quads x 16 rows x 4 bytes, byte = q + 128 (uint8 for vpdpbusd);
//       int4: 4 x 16 x 4 bytes, the low nibble from quad g (g < 4), the high from quad g + 4;
//     scales: 16 fp16 (each row's group scale of this block)
//   then (int4 only) offsets ngroups x 16 fp16, and padding to 64 bytes.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "common.h"
#include "cpu/isa.h"

// GCC 12's AVX-512 intrinsics (_mm512_reduce_add_ps, _mm512_cvtepi32_ps) start from
// _mm512_undefined_*(), which -Wuninitialized reports as used uninitialized: a false positive.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace {

using trtpaged::fail;

constexpr int kRows = 16;   // output rows per tile
constexpr int kMaxMB = 8;   // activation rows per kernel call (register blocking), at most
// Tiles at least this long get the next tile prefetched in the second pass of the two-pass AVX2 kernels
// (qlinear_tile256.inc).
constexpr size_t kPrefetchTileBytes = 12288;
// Weights that come from memory: the kernels that can request the next tile while one runs do so
// (TileArgs::prefetch_next; which ones: where they read it). Two cases:
// - packed weights of kPrefetchWeightBytes and up (the LM head: 28 MB in int8) do not stay in a core's caches between
//   calls, at any row count. Weights held in the L2 or L3 measured 0.85-0.90x with it at 2-4 float rows on AVX2 (one
//   more load-port op per 8.5 code bytes);
// - calls of at most kStreamedMaxRows rows of x (decode steps of up to 16 sequences; a float row's three limb rows
//   count as one), whatever the weight's size: a model's linears together outgrow the caches, so each
//   weight comes back from memory at the next step, and a tile's few rows of compute leave the memory idle between
//   demand misses. SmolLM2's 120 body linears, each weight read once per step as in a decode step, two threads, on a
//   Xeon with AVX-512 and AVX-VNNI (docs/benchmarks.md, round 20), one row: int4 weights 1.28-1.38x on AVX2,
//   1.17-1.31x on AVX-512, 1.14-1.25x on AVX-VNNI; int4 at 4-16 rows of int8 activations 1.12-1.29x on AVX-512;
//   int8 weights with int8 activations at 4-16 rows 1.2-1.6x on AVX2, up to 1.18x on AVX-512. The same calls on
//   weights held in the L2 (one layer's again and again) measured 0.84-1.02x.
constexpr size_t kPrefetchWeightBytes = size_t(8) << 20;
constexpr int64_t kStreamedMaxRows = 16;

using trtpaged::cpu::Isa;
using trtpaged::cpu::kAvx2;
using trtpaged::cpu::kAvx512Vnni;
using trtpaged::cpu::kAvxVnni;
using trtpaged::cpu::kScalar;

struct Layout {
  int bits;
  int64_t n, k;
  int32_t group;
  int64_t ntiles, nblocks, ngroups;
  size_t block_codes;  // code bytes of one block (16 rows x 32 inputs)
  size_t block_bytes;  // codes and scales of one block
  size_t tile_bytes;   // rounded up to 64
};

Layout make_layout(int bits, int64_t n, int64_t k, int32_t group) {
  Layout l{};
  l.bits = bits;
  l.n = n;
  l.k = k;
  l.group = group;
  l.ntiles = (n + kRows - 1) / kRows;
  l.nblocks = k / 32;
  l.ngroups = k / group;
  l.block_codes = bits == 8 ? kRows * 32 : kRows * 16;
  l.block_bytes = l.block_codes + kRows * sizeof(uint16_t);
  size_t bytes = l.nblocks * l.block_bytes + (bits == 4 ? kRows * l.ngroups * sizeof(uint16_t) : 0);
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
// Activations quantized once per call (int8 path), shared by all threads.
struct BlockRecord {  // one 32-block of one activation row
  float dx;           // block scale
  int32_t nbias;      // -128 * sum of the block's codes (int8 weights are stored as q + 128)
};

struct Acts {
  const int8_t* xq;         // [m][k]
  const BlockRecord* rec;   // [m][nblocks]
  const float* group_sums;  // [m][ngroups]: sum over the group's blocks of dx * sum(codes); int4 only
};

// ---------------------------------------------------------------------------------------------
// Tile kernels: out[i * kRows + r] = y[m0 + i][tile row r] without bias, for min(count, the
// variant's register block) activation rows; they return how many.
struct TileArgs {
  const Layout* l;
  const uint8_t* tile;
  int64_t m0;
  const Acts* a;           // int8 activations
  const float* x;          // float activations: x[m0], row stride l->k
  const float* xgroup;     // float activations, int4: sums of x per group, [m][ngroups]
  bool prefetch_next;      // request the next tile (the caller's next work item) while this one runs
};

using TileKernel = int (*)(const TileArgs&, int count, float* out);

// Requests (into the L2) block b of the next tile, the caller's next work item, and line b of that tile's tail (int4
// offsets): called at each block of a tile, it requests the whole next tile spread over this one's blocks, a few
// lines at a time (a whole tile at once filled the core's miss buffers). Past the last tile the addresses lie beyond
// the packed weights: prefetches do not fault. always_inline: as a call, GCC 12 at -O2 and up found the function free of
// side effects (IPA mod-ref) and deleted it, prefetches and all.
__attribute__((always_inline)) inline void request_next_tile_block(const TileArgs& t, int64_t b) {
  const Layout& l = *t.l;
  const uintptr_t next = reinterpret_cast<uintptr_t>(t.tile) + l.tile_bytes;
  for (size_t c = 0; c < l.block_bytes; c += 64)
    _mm_prefetch(reinterpret_cast<const char*>(next + size_t(b) * l.block_bytes + c), _MM_HINT_T1);
  const size_t tail = size_t(l.nblocks) * l.block_bytes + 64 * size_t(b);
  if (l.bits == 4 && tail < l.tile_bytes) _mm_prefetch(reinterpret_cast<const char*>(next + tail), _MM_HINT_T1);
}

inline int32_t load_u32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// Code (as the signed weight code: int8 q, or int4 0..15) of row r, input j of a block.
template <int BITS>
inline int code_at(const uint8_t* block, int r, int j) {
  if (BITS == 8) return int(block[((j / 4) * kRows + r) * 4 + j % 4]) - 128;
  const uint8_t byte = block[(((j / 4) % 4) * kRows + r) * 4 + j % 4];
  return j < 16 ? (byte & 0x0F) : (byte >> 4);
}

// Portable kernels, also the reference for the layout. FLOAT: float activations.
template <int BITS, bool FLOAT>
int tile_scalar(const TileArgs& t, int count, float* out) {
  const Layout& l = *t.l;
  const int mb = std::min(count, 4);
  for (int i = 0; i < mb; ++i) {
    const int64_t row = t.m0 + i;
    float acc[kRows] = {};
    for (int64_t b = 0; b < l.nblocks; ++b) {
      const uint8_t* blk = t.tile + b * l.block_bytes;
      const uint16_t* sc = reinterpret_cast<const uint16_t*>(blk + l.block_codes);
      for (int r = 0; r < kRows; ++r) {
        const float sw = half_to_float(sc[r]);
        if (FLOAT) {
          const float* xb = t.x + i * l.k + b * 32;
          float s = 0.f;
          for (int j = 0; j < 32; ++j) s = std::fma(float(code_at<BITS>(blk, r, j)), xb[j], s);
          acc[r] = std::fma(s, sw, acc[r]);
        } else {
          const int8_t* xb = t.a->xq + row * l.k + b * 32;
          int32_t s = 0;
          for (int j = 0; j < 32; ++j) s += code_at<BITS>(blk, r, j) * xb[j];
          acc[r] += float(s) * (sw * t.a->rec[row * l.nblocks + b].dx);
        }
      }
    }
    if (BITS == 4) {
      const uint16_t* oh = reinterpret_cast<const uint16_t*>(t.tile + l.nblocks * l.block_bytes);
      const float* gs = FLOAT ? t.xgroup + row * l.ngroups : t.a->group_sums + row * l.ngroups;
      for (int64_t g = 0; g < l.ngroups; ++g)
        for (int r = 0; r < kRows; ++r) acc[r] = std::fma(half_to_float(oh[g * kRows + r]), gs[g], acc[r]);
    }
    for (int r = 0; r < kRows; ++r) out[i * kRows + r] = acc[r];
  }
  return mb;
}

// s += dpbusd(w, x's 4 bytes at p broadcast to every lane), the broadcast folded into the instruction as
// its {1to16} memory operand (GCC loads it into a register first: one more instruction per dot product).
__attribute__((target("avx512f,avx512vnni"))) inline __m512i dpbusd_bcast(__m512i s, __m512i w, const int8_t* p) {
  asm("vpdpbusd %[x]%{1to16%}, %[w], %[s]" : [s] "+v"(s) : [w] "v"(w), [x] "m"(*reinterpret_cast<const int32_t*>(p)));
  return s;
}

// 512-bit, int8 activations: lane r of a register holds 4 consecutive inputs of row r (one "quad");
// x's matching 4 bytes are broadcast, so vpdpbusd does 16 rows x 4 inputs and no horizontal sum is
// needed. A block = 8 vpdpbusd + 1 convert + 1 multiply + 1 FMA per activation row. Rows inner: each
// code register is decoded once per block and used by every row before the next is loaded, so a block
// keeps one int32 sum per row live (a row-outer form, all 8 code registers held across the rows, spilled
// from 8 rows on: an 8-row call cost 2x a 6-row one). Integer sums are exact in any order and each row's
// float steps do not depend on the others: a row's output does not depend on how many rows share the call.
template <int BITS, int MB>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c"))) void tile_avx512_rows(
    const TileArgs& t, float* out) {
  const Layout& l = *t.l;
  const Acts& a = *t.a;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 acc[MB];
  for (int i = 0; i < MB; ++i) acc[i] = _mm512_setzero_ps();
  const int8_t* x0 = a.xq + t.m0 * l.k;
  const BlockRecord* r0 = a.rec + t.m0 * l.nblocks;
  for (int64_t b = 0; b < l.nblocks; ++b) {
    const uint8_t* blk = t.tile + b * l.block_bytes;
    if (t.prefetch_next) request_next_tile_block(t, b);
    __m512i s[MB];
    for (int i = 0; i < MB; ++i)
      s[i] = BITS == 8 ? _mm512_set1_epi32(r0[i * l.nblocks + b].nbias) : _mm512_setzero_si512();
    const int8_t* xb = x0 + b * 32;
    if (BITS == 8) {
      for (int g = 0; g < 8; ++g) {
        __m512i w = _mm512_loadu_si512(blk + 64 * g);
        asm volatile("" : "+v"(w));  // order barriers, as in qlinear_tile256.inc
        for (int i = 0; i < MB; ++i)
          s[i] = dpbusd_bcast(s[i], w, xb + i * l.k + 4 * g);
        for (int i = 0; i < MB; ++i) asm volatile("" : "+v"(s[i]));
      }
    } else {
      for (int g = 0; g < 4; ++g) {
        __m512i v = _mm512_loadu_si512(blk + 64 * g);
        asm volatile("" : "+v"(v));
        const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        for (int i = 0; i < MB; ++i) {
          s[i] = dpbusd_bcast(s[i], lo, xb + i * l.k + 4 * g);
          s[i] = dpbusd_bcast(s[i], hi, xb + i * l.k + 4 * g + 16);
        }
        for (int i = 0; i < MB; ++i) asm volatile("" : "+v"(s[i]));
      }
    }
    const __m512 sw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + l.block_codes)));
    for (int i = 0; i < MB; ++i)
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[i]), _mm512_mul_ps(sw, _mm512_set1_ps(r0[i * l.nblocks + b].dx)),
                               acc[i]);
  }
  if (BITS == 4) {
    const uint16_t* oh = reinterpret_cast<const uint16_t*>(t.tile + l.nblocks * l.block_bytes);
    for (int64_t g = 0; g < l.ngroups; ++g) {
      const __m512 o = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(oh + g * kRows)));
      for (int i = 0; i < MB; ++i)
        acc[i] = _mm512_fmadd_ps(o, _mm512_set1_ps(a.group_sums[(t.m0 + i) * l.ngroups + g]), acc[i]);
    }
  }
  for (int i = 0; i < MB; ++i) _mm512_storeu_ps(out + i * kRows, acc[i]);
}

template <int BITS>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c"))) int tile_avx512(
    const TileArgs& t, int count, float* out) {
  switch (std::min(count, kMaxMB)) {
    case 8: return tile_avx512_rows<BITS, 8>(t, out), 8;
    case 7: return tile_avx512_rows<BITS, 7>(t, out), 7;
    case 6: return tile_avx512_rows<BITS, 6>(t, out), 6;
    case 5: return tile_avx512_rows<BITS, 5>(t, out), 5;
    case 4: return tile_avx512_rows<BITS, 4>(t, out), 4;
    case 3: return tile_avx512_rows<BITS, 3>(t, out), 3;
    case 2: return tile_avx512_rows<BITS, 2>(t, out), 2;
    default: return tile_avx512_rows<BITS, 1>(t, out), 1;
  }
}

// 256-bit, int8 activations: each half of the tile (rows 0-7, 8-15) is the low / high 32
// bytes of a quad's 64. VNNI: vpdpbusd. Plain AVX2: int8 weights via vpmaddubsw on |q| and
// x with q's sign (|x| <= 127, so pair sums fit int16), then vpmaddwd; int4 weights (<= 15)
// sum all 8 quads' vpmaddubsw in int16 (8 * 2 * 15 * 127 < 2^15) before one vpmaddwd.
#define TRTPAGED_TILE256_NAME tile_avx256_mb
#define TRTPAGED_TILE256_TARGET "avx2,fma,f16c"
#include "qlinear_tile256.inc"
#undef TRTPAGED_TILE256_NAME
#undef TRTPAGED_TILE256_TARGET

// The same body compiled with AVX-VNNI enabled (VNNI = true only).
#define TRTPAGED_TILE256_NAME tile_avxvnni256_mb
#define TRTPAGED_TILE256_TARGET "avx2,fma,f16c,avxvnni"
#include "qlinear_tile256.inc"
#undef TRTPAGED_TILE256_NAME
#undef TRTPAGED_TILE256_TARGET

// Plain AVX2, int4 weights, int8 activations, from kW4MinRows rows on: tile_avx256_mb runs the tile's halves (rows
// 0-7, 8-15) in two passes, unpacks the nibbles in every call of at most 8 rows and broadcasts each quad of x once
// per half. Here a chunk of kW4ChunkBlocks blocks is unpacked once per call into an L1 buffer (codes as bytes 0..15,
// block scales as floats), and a microkernel runs up to kW4GroupRows rows x both halves over it: one broadcast of x
// feeds the two halves' products. Per row and block: 8 broadcasts, 16 vpmaddubsw, 14 vpaddw and the float steps
// (against 16, 16, 16 and the unpacking's share). The integer sums are exact in any order and each row's float
// steps are tile_avx256_mb's (per block fma(sum, scale x dx) in block order, then the offsets per group in order):
// the same bits whichever kernel or rows a row gets. Single thread, forced AVX2 on the EPYC, against tile_avx256_mb
// (scripts/qlinear_rows_probe.py, docs/benchmarks.md): 1.06-1.18x at 12-64 rows, about even at 8, 0.94x at 5.
constexpr int kW4MinRows = 8;       // so 5-7 rows keep tile_avx256_mb's 5- and 6-row forms
constexpr int kW4ChunkBlocks = 8;   // 256 inputs: 4 KiB of codes
constexpr int kW4MaxRows = 64;      // activation rows per call (run_tiles' output buffer holds kFloatMaxRows)
// Rows per microkernel call: two int16 sums per row in registers, besides two code registers and a broadcast (6 rows
// spilled a sum: its store and reload then chained the quads, slower; 4 rows measured the same as 5).
constexpr int kW4GroupRows = 5;
constexpr size_t kW4BlockCodes = 512;  // unpacked codes of a block: 8 quads x 2 halves x 32 bytes

// codes[bb][q][h] (32 bytes: quad q of rows 8h .. 8h + 7, one code a byte) and sw[bb][16] of blocks b0 .. b0 + nb - 1.
__attribute__((target("avx2,fma,f16c"))) void unpack_chunk_w4_avx2(const Layout& l, const uint8_t* tile, int64_t b0,
                                                                      int nb, uint8_t* codes, float* sw) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int bb = 0; bb < nb; ++bb) {
    const uint8_t* blk = tile + (b0 + bb) * l.block_bytes;
    uint8_t* cb = codes + bb * kW4BlockCodes;
    for (int g = 0; g < 4; ++g)
      for (int h = 0; h < 2; ++h) {  // quad g in the low nibbles, quad g + 4 in the high
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * g + 32 * h));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(cb + 64 * g + 32 * h), _mm256_and_si256(v, low4));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(cb + 64 * (g + 4) + 32 * h),
                            _mm256_and_si256(_mm256_srli_epi16(v, 4), low4));
      }
    for (int h = 0; h < 2; ++h)
      _mm256_storeu_ps(sw + bb * kRows + 8 * h, _mm256_cvtph_ps(_mm_loadu_si128(
                                                    reinterpret_cast<const __m128i*>(blk + l.block_codes + 16 * h))));
  }
}

// acc[i * kRows + r] += the terms of blocks 0 .. nb - 1 of the chunk for rows i < R (xq, rec: row 0 at the chunk's
// first block). The last quad is peeled: each row's float steps follow its last products, so no row's sums wait in
// memory for the others' (with all rows' float steps after the quads GCC spilled the sums: 3-5% slower).
template <int R>
__attribute__((target("avx2,fma,f16c"))) void w4_rows_avx2(const uint8_t* codes, const float* sw, int nb,
                                                           const int8_t* xq, int64_t k, const BlockRecord* rec,
                                                           int64_t nblocks, float* acc) {
  for (int bb = 0; bb < nb; ++bb) {
    const uint8_t* cb = codes + bb * kW4BlockCodes;
    const int8_t* xb = xq + bb * 32;
    __m256i s0[R], s1[R];  // int16 pair sums of the two halves: at most 8 * 2 * 15 * 127 < 2^15
#pragma GCC unroll 8
    for (int q = 0; q < 7; ++q) {
      __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cb + 64 * q));
      __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cb + 64 * q + 32));
      // Order barriers, as in qlinear_tile256.inc: without them GCC computed the whole block's products ahead of
      // the sums and spilled them.
      asm volatile("" : "+x"(w0), "+x"(w1));
#pragma GCC unroll 5
      for (int i = 0; i < R; ++i) {
        const __m256i xv = _mm256_set1_epi32(load_u32(xb + i * k + 4 * q));
        const __m256i p0 = _mm256_maddubs_epi16(w0, xv), p1 = _mm256_maddubs_epi16(w1, xv);
        s0[i] = q == 0 ? p0 : _mm256_add_epi16(s0[i], p0);
        s1[i] = q == 0 ? p1 : _mm256_add_epi16(s1[i], p1);
      }
#pragma GCC unroll 5
      for (int i = 0; i < R; ++i) asm volatile("" : "+x"(s0[i]), "+x"(s1[i]));
    }
    __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cb + 64 * 7));
    __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cb + 64 * 7 + 32));
    asm volatile("" : "+x"(w0), "+x"(w1));
#pragma GCC unroll 5
    for (int i = 0; i < R; ++i) {
      const __m256i xv = _mm256_set1_epi32(load_u32(xb + i * k + 28));
      const __m256i t0 = _mm256_add_epi16(s0[i], _mm256_maddubs_epi16(w0, xv));
      const __m256i t1 = _mm256_add_epi16(s1[i], _mm256_maddubs_epi16(w1, xv));
      const __m256 dx = _mm256_set1_ps(rec[i * nblocks + bb].dx);
      const __m256i ones16 = _mm256_set1_epi16(1);
      float* a = acc + i * kRows;
      const __m256 sc0 = _mm256_mul_ps(_mm256_loadu_ps(sw + bb * kRows), dx);
      const __m256 sc1 = _mm256_mul_ps(_mm256_loadu_ps(sw + bb * kRows + 8), dx);
      _mm256_storeu_ps(a, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(t0, ones16)), sc0, _mm256_loadu_ps(a)));
      _mm256_storeu_ps(a + 8,
                       _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(t1, ones16)), sc1, _mm256_loadu_ps(a + 8)));
    }
  }
}

// out[(i0 + i) * kRows + r] += the int4 offsets x the group sums of rows i0 .. i0 + R - 1, groups in order (R rows
// at once: one row alone would wait on the FMA latency at every group).
template <int R>
__attribute__((target("avx2,fma,f16c"))) void w4_offsets_avx2(const TileArgs& t, int i0, float* out) {
  const Layout& l = *t.l;
  const uint16_t* oh = reinterpret_cast<const uint16_t*>(t.tile + l.nblocks * l.block_bytes);
  const float* gs = t.a->group_sums + (t.m0 + i0) * l.ngroups;
  float* o = out + i0 * kRows;
  __m256 a0[R], a1[R];
  for (int i = 0; i < R; ++i) {
    a0[i] = _mm256_loadu_ps(o + i * kRows);
    a1[i] = _mm256_loadu_ps(o + i * kRows + 8);
  }
  for (int64_t g = 0; g < l.ngroups; ++g) {
    const __m256 o0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(oh + g * kRows)));
    const __m256 o1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(oh + g * kRows + 8)));
    for (int i = 0; i < R; ++i) {
      const __m256 s = _mm256_set1_ps(gs[i * l.ngroups + g]);
      a0[i] = _mm256_fmadd_ps(o0, s, a0[i]);
      a1[i] = _mm256_fmadd_ps(o1, s, a1[i]);
    }
  }
  for (int i = 0; i < R; ++i) {
    _mm256_storeu_ps(o + i * kRows, a0[i]);
    _mm256_storeu_ps(o + i * kRows + 8, a1[i]);
  }
}

__attribute__((target("avx2,fma,f16c"))) int tile_avx2_w4_decoded(const TileArgs& t, int count, float* out) {
  const Layout& l = *t.l;
  const Acts& a = *t.a;
  const int m = std::min(count, kW4MaxRows);
  alignas(32) uint8_t codes[kW4ChunkBlocks * kW4BlockCodes];
  alignas(32) float sw[kW4ChunkBlocks * kRows];
  std::fill(out, out + m * kRows, 0.f);
  for (int64_t b0 = 0; b0 < l.nblocks; b0 += kW4ChunkBlocks) {
    const int nb = int(std::min<int64_t>(kW4ChunkBlocks, l.nblocks - b0));
    unpack_chunk_w4_avx2(l, t.tile, b0, nb, codes, sw);
    // The next chunk's bytes (after the last chunk: the offsets and the next tile, the caller's next work item) are
    // requested while this one is computed: the unpacking reads a chunk in a burst and then nothing for a long while,
    // which the hardware prefetcher does not run ahead of (weights streamed from memory: each chunk started cold).
    // (addresses past the packed weights after the last tile: prefetches do not fault)
    const uintptr_t next = reinterpret_cast<uintptr_t>(t.tile) + size_t(b0 + nb) * l.block_bytes;
    for (size_t c = 0; c < kW4ChunkBlocks * l.block_bytes; c += 64)
      _mm_prefetch(reinterpret_cast<const char*>(next + c), _MM_HINT_T0);
    for (int i = 0; i < m;) {
      // groups of at most kW4GroupRows rows, as even as possible
      const int left = m - i, groups = (left + kW4GroupRows - 1) / kW4GroupRows, r = (left + groups - 1) / groups;
      const int8_t* xq = a.xq + (t.m0 + i) * l.k + b0 * 32;
      const BlockRecord* rec = a.rec + (t.m0 + i) * l.nblocks + b0;
      float* acc = out + i * kRows;
      switch (r) {
        case 5: w4_rows_avx2<5>(codes, sw, nb, xq, l.k, rec, l.nblocks, acc); break;
        case 4: w4_rows_avx2<4>(codes, sw, nb, xq, l.k, rec, l.nblocks, acc); break;
        case 3: w4_rows_avx2<3>(codes, sw, nb, xq, l.k, rec, l.nblocks, acc); break;
        case 2: w4_rows_avx2<2>(codes, sw, nb, xq, l.k, rec, l.nblocks, acc); break;
        default: w4_rows_avx2<1>(codes, sw, nb, xq, l.k, rec, l.nblocks, acc); break;
      }
      i += r;
    }
  }
  for (int i = 0; i < m; i += 4) {
    switch (std::min(m - i, 4)) {
      case 4: w4_offsets_avx2<4>(t, i, out); break;
      case 3: w4_offsets_avx2<3>(t, i, out); break;
      case 2: w4_offsets_avx2<2>(t, i, out); break;
      default: w4_offsets_avx2<1>(t, i, out); break;
    }
  }
  return m;
}

// Plain AVX2, int4 weights, int8 activations, 1-3 rows (one float-activation row's 3 limbs: the M = 1 decode step of a
// float-activation engine): both halves of the tile in one pass over the blocks, unpacked in registers, so one
// broadcast of x feeds both halves' products and one row's offsets run as two FMA chains (tile_avx256_mb's two passes
// broadcast each quad of x once per half, and one row's offsets were one chain per half, waiting on the FMA latency).
// Rows inner, as there; 1-2 rows keep their accumulators in registers, 3 in `out` (two int16 sums per row, four code
// registers and two broadcasts leave no room). The integer sums are exact in any order and each row's float steps are
// tile_avx256_mb's (per half and block fma(sum, scale x dx) in block order, then the offsets per group in order): the
// same bits. It issues fewer instructions than the two passes for the same multiplies on any CPU (no staging in L1,
// nothing CPU-dependent to choose). Thread CPU time on the Zen 1-class EPYC against tile_avx256_mb
// (scripts/qlinear_rows_probe.py, docs/benchmarks.md issue 21 round 14): int8 activations 1.16-1.25x at 1-2 rows,
// float activations at M = 1 (3 limb rows) 1.03-1.08x; 4 rows measured 0.98-1.03x (noise), so 4 keep the two passes.
constexpr int kW4OnePassMaxRows = 3;
template <int MB>
__attribute__((target("avx2,fma,f16c"))) void tile_avx2_w4_onepass(const TileArgs& t, float* out) {
  static_assert(MB >= 1 && MB <= kW4OnePassMaxRows, "1 to 3 rows");
  const Layout& l = *t.l;
  const Acts& a = *t.a;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  constexpr bool kRegAcc = MB <= 2;
  __m256 acc[MB][2];
  for (int i = 0; i < MB; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  if constexpr (!kRegAcc) std::fill(out, out + MB * kRows, 0.f);
  const int8_t* x0 = a.xq + t.m0 * l.k;
  const BlockRecord* r0 = a.rec + t.m0 * l.nblocks;
  for (int64_t b = 0; b < l.nblocks; ++b) {
    const uint8_t* blk = t.tile + b * l.block_bytes;
    if (t.prefetch_next) request_next_tile_block(t, b);
    const int8_t* xb = x0 + b * 32;
    __m256i s[MB][2];  // int16 pair sums of the two halves: at most 8 * 2 * 15 * 127 < 2^15
#pragma GCC unroll 4
    for (int g = 0; g < 4; ++g) {  // quad g in the low nibbles, quad g + 4 in the high
      __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * g));
      __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * g + 32));
      // Order barriers, as in qlinear_tile256.inc: each code register used by every row and dropped.
      asm volatile("" : "+x"(v0), "+x"(v1));
      const __m256i lo0 = _mm256_and_si256(v0, low4), hi0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), low4);
      const __m256i lo1 = _mm256_and_si256(v1, low4), hi1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), low4);
#pragma GCC unroll 3
      for (int i = 0; i < MB; ++i) {
        const __m256i xl = _mm256_set1_epi32(load_u32(xb + i * l.k + 4 * g));
        const __m256i xh = _mm256_set1_epi32(load_u32(xb + i * l.k + 4 * g + 16));
        const __m256i p0 = _mm256_add_epi16(_mm256_maddubs_epi16(lo0, xl), _mm256_maddubs_epi16(hi0, xh));
        const __m256i p1 = _mm256_add_epi16(_mm256_maddubs_epi16(lo1, xl), _mm256_maddubs_epi16(hi1, xh));
        s[i][0] = g == 0 ? p0 : _mm256_add_epi16(s[i][0], p0);
        s[i][1] = g == 0 ? p1 : _mm256_add_epi16(s[i][1], p1);
      }
#pragma GCC unroll 4
      for (int i = 0; i < MB; ++i) asm volatile("" : "+x"(s[i][0]), "+x"(s[i][1]));
    }
    const __m256i ones16 = _mm256_set1_epi16(1);
    const __m256 sw0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + l.block_codes)));
    const __m256 sw1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + l.block_codes + 16)));
#pragma GCC unroll 4
    for (int i = 0; i < MB; ++i) {
      const __m256 dx = _mm256_set1_ps(r0[i * l.nblocks + b].dx);
      const __m256 f0 = _mm256_cvtepi32_ps(_mm256_madd_epi16(s[i][0], ones16));
      const __m256 f1 = _mm256_cvtepi32_ps(_mm256_madd_epi16(s[i][1], ones16));
      if constexpr (kRegAcc) {
        acc[i][0] = _mm256_fmadd_ps(f0, _mm256_mul_ps(sw0, dx), acc[i][0]);
        acc[i][1] = _mm256_fmadd_ps(f1, _mm256_mul_ps(sw1, dx), acc[i][1]);
      } else {
        float* o = out + i * kRows;
        _mm256_storeu_ps(o, _mm256_fmadd_ps(f0, _mm256_mul_ps(sw0, dx), _mm256_loadu_ps(o)));
        _mm256_storeu_ps(o + 8, _mm256_fmadd_ps(f1, _mm256_mul_ps(sw1, dx), _mm256_loadu_ps(o + 8)));
      }
    }
  }
  if constexpr (!kRegAcc)
    for (int i = 0; i < MB; ++i) {
      acc[i][0] = _mm256_loadu_ps(out + i * kRows);
      acc[i][1] = _mm256_loadu_ps(out + i * kRows + 8);
    }
  const uint16_t* oh = reinterpret_cast<const uint16_t*>(t.tile + l.nblocks * l.block_bytes);
  const float* gs = a.group_sums + t.m0 * l.ngroups;
  for (int64_t g = 0; g < l.ngroups; ++g) {
    const __m256 o0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(oh + g * kRows)));
    const __m256 o1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(oh + g * kRows + 8)));
    for (int i = 0; i < MB; ++i) {
      const __m256 x = _mm256_set1_ps(gs[i * l.ngroups + g]);
      acc[i][0] = _mm256_fmadd_ps(o0, x, acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(o1, x, acc[i][1]);
    }
  }
  for (int i = 0; i < MB; ++i) {
    _mm256_storeu_ps(out + i * kRows, acc[i][0]);
    _mm256_storeu_ps(out + i * kRows + 8, acc[i][1]);
  }
}

template <int BITS>
__attribute__((target("avx2,fma,f16c"))) int tile_avx2(const TileArgs& t, int count, float* out) {
  // int4: from kW4MinRows rows on, every row of the call over each unpacked chunk; 5-7 rows in one call (rows inner:
  // one sum and one accumulator per row); 1-3 rows both halves in one pass. int8 weights: 4 rows a call (their
  // one-pass form holds two of each per row); one row runs two passes, or one where the weights stream from memory
  // (TileArgs::prefetch_next: the LM head, and a tile's first call in a decode step). Thread CPU time against 4-row
  // calls, gate_up / down / qkv: 5 and 6 rows 0.86-0.88x.
  if (BITS == 4 && count >= kW4MinRows) return tile_avx2_w4_decoded(t, count, out);
  if (BITS == 4 && count >= 5) {
    if (count >= 6) return tile_avx256_mb<BITS, 6, false>(t, out), 6;
    return tile_avx256_mb<BITS, 5, false>(t, out), 5;
  }
  if (BITS == 4 && count <= kW4OnePassMaxRows) {
    switch (count) {
      case 3: return tile_avx2_w4_onepass<3>(t, out), 3;
      case 2: return tile_avx2_w4_onepass<2>(t, out), 2;
      default: return tile_avx2_w4_onepass<1>(t, out), 1;
    }
  }
  switch (std::min(count, 4)) {
    case 4: return tile_avx256_mb<BITS, 4, false>(t, out), 4;
    case 3: return tile_avx256_mb<BITS, 3, false>(t, out), 3;
    case 2: return tile_avx256_mb<BITS, 2, false>(t, out), 2;
    default:
      if constexpr (BITS == 8)  // int4 rows never get here (tile_avx2_w4_onepass): no streamed int4 instance
        if (t.prefetch_next) return tile_avx256_mb<BITS, 1, false, true>(t, out), 1;
      return tile_avx256_mb<BITS, 1, false>(t, out), 1;
  }
}

template <int BITS>
__attribute__((target("avx2,fma,f16c,avxvnni"))) int tile_avxvnni(const TileArgs& t, int count, float* out) {
  switch (std::min(count, 4)) {
    case 4: return tile_avxvnni256_mb<BITS, 4, true>(t, out), 4;
    case 3: return tile_avxvnni256_mb<BITS, 3, true>(t, out), 3;
    case 2: return tile_avxvnni256_mb<BITS, 2, true>(t, out), 2;
    default: return tile_avxvnni256_mb<BITS, 1, true>(t, out), 1;
  }
}

// Float activations, AVX2, int8 weights: input e (0-3) of each lane's quad as an int32, from the sign-flipped codes q.
// vpshufb moves byte e of every 32-bit lane to the lane's top byte (the other three zeroed) and one arithmetic shift
// sign-extends it (byte 3 is on top already): the integers of a left and a right shift, with one shift instead of
// two. On the Zen 1-class EPYC the vector shifts run on one pipe, which the two-shift decode saturated: an L1-resident
// loop of decode, convert and FMA ran 6.1-6.5 weights/ns against 5.3-5.4 (docs/benchmarks.md, round 18).
// Called in loops unrolled over e, so e and the shuffle index are constants.
__attribute__((target("avx2"))) inline __m256i w8_input_avx2(__m256i q, int e) {
  if (e == 3) return _mm256_srai_epi32(q, 24);
  const int32_t zero = 0x808080;  // index bit 7 zeroes a byte
  const __m256i to_top = _mm256_setr_epi32(e << 24 | zero, (4 + e) << 24 | zero, (8 + e) << 24 | zero,
                                           (12 + e) << 24 | zero, e << 24 | zero, (4 + e) << 24 | zero,
                                           (8 + e) << 24 | zero, (12 + e) << 24 | zero);
  return _mm256_srai_epi32(_mm256_shuffle_epi8(q, to_top), 24);
}

// Float activations: x stays float32. Element e of every lane's quad (one input of 16 rows)
// is shifted into place, converted to float and FMA'd with x broadcast; per block the fp32
// sum is scaled by the block's scales, and int4 adds offsets x float group sums of x. Two
// partial sums per block shorten the FMA dependency chain.
template <int BITS, int MB>
__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"))) void ftile_avx512_mb(const TileArgs& t,
                                                                                          float* out) {
  const Layout& l = *t.l;
  const __m512i flip = _mm512_set1_epi8(char(0x80));
  __m512 acc[MB];
  for (int i = 0; i < MB; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < l.nblocks; ++b) {
    const uint8_t* blk = t.tile + b * l.block_bytes;
    const __m512 sw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + l.block_codes)));
    __m512 s[MB][2];
    for (int i = 0; i < MB; ++i) s[i][0] = s[i][1] = _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int g = 0; g < (BITS == 8 ? 8 : 4); ++g) {
      const __m512i v = _mm512_loadu_si512(blk + 64 * g);
#pragma GCC unroll 8
      for (int e = 0; e < (BITS == 8 ? 4 : 8); ++e) {
        __m512i c;
        int j;  // input within the block
        if (BITS == 8) {
          const __m512i q = _mm512_xor_si512(v, flip);  // signed bytes
          c = e == 3 ? _mm512_srai_epi32(q, 24) : _mm512_srai_epi32(_mm512_slli_epi32(q, 24 - 8 * e), 24);
          j = 4 * g + e;
        } else {
          // x comes prescaled (prescale_x_int4): the code is masked in place, q * 2^shift,
          // exact in float, saving the shift; the top nibble (shift 28) would set the sign bit.
          const int byte = e % 4, nib = e / 4;  // nibble 0: quad g, nibble 1: quad g + 4
          const int shift = 8 * byte + 4 * nib;
          c = shift == 28 ? _mm512_srli_epi32(v, 28) : _mm512_and_si512(v, _mm512_set1_epi32(0xF << shift));
          j = 4 * (g + 4 * nib) + byte;
        }
        const __m512 wf = _mm512_cvtepi32_ps(c);
        for (int i = 0; i < MB; ++i)
          s[i][e & 1] = _mm512_fmadd_ps(wf, _mm512_set1_ps(t.x[i * l.k + b * 32 + j]), s[i][e & 1]);
      }
    }
    for (int i = 0; i < MB; ++i) acc[i] = _mm512_fmadd_ps(_mm512_add_ps(s[i][0], s[i][1]), sw, acc[i]);
  }
  if (BITS == 4) {
    const uint16_t* oh = reinterpret_cast<const uint16_t*>(t.tile + l.nblocks * l.block_bytes);
    for (int64_t g = 0; g < l.ngroups; ++g) {
      const __m512 o = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(oh + g * kRows)));
      for (int i = 0; i < MB; ++i)
        acc[i] = _mm512_fmadd_ps(o, _mm512_set1_ps(t.xgroup[(t.m0 + i) * l.ngroups + g]), acc[i]);
    }
  }
  for (int i = 0; i < MB; ++i) _mm512_storeu_ps(out + i * kRows, acc[i]);
}

template <int BITS>
__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"))) int ftile_avx512(const TileArgs& t, int count,
                                                                                      float* out) {
  switch (std::min(count, 4)) {
    case 4: return ftile_avx512_mb<BITS, 4>(t, out), 4;
    case 3: return ftile_avx512_mb<BITS, 3>(t, out), 3;
    case 2: return ftile_avx512_mb<BITS, 2>(t, out), 2;
    default: return ftile_avx512_mb<BITS, 1>(t, out), 1;
  }
}

// Float activations, AVX2, int8 weights, up to 8 rows (ftile_avx2_w8 below takes more): ftile_avx2_mb, up to 4 rows
// per call (the code registers decoded for each call; the int4 weights' form below measured slower for the LM head at
// 2-8 rows: docs/benchmarks.md). PREFETCH (TileArgs::prefetch_next: weights of kPrefetchWeightBytes or more, and
// decode steps): its second pass over a tile (from cache) requests the next tile's int8 blocks; the LM head (28 MB of
// them) ran 1.2x so at 4-8 rows (round 13).
template <int BITS, int MB, bool PREFETCH = false>
__attribute__((target("avx2,fma,f16c"))) void ftile_avx2_mb(const TileArgs& t, float* out) {
  const Layout& l = *t.l;
  const __m256i flip = _mm256_set1_epi8(char(0x80));
  const __m256i low4 = _mm256_set1_epi32(0x0F);
  for (int half = 0; half < 2; ++half) {
    __m256 acc[MB];
    for (int i = 0; i < MB; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < l.nblocks; ++b) {
      const uint8_t* blk = t.tile + b * l.block_bytes;
      if (PREFETCH && half == 1) request_next_tile_block(t, b);
      const __m256 sw =
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + l.block_codes + 16 * half)));
      __m256 s[MB][2];
      for (int i = 0; i < MB; ++i) s[i][0] = s[i][1] = _mm256_setzero_ps();
#pragma GCC unroll 8
      for (int g = 0; g < (BITS == 8 ? 8 : 4); ++g) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * g + 32 * half));
#pragma GCC unroll 8
        for (int e = 0; e < (BITS == 8 ? 4 : 8); ++e) {
          __m256i c;
          int j;
          if (BITS == 8) {
            const __m256i q = _mm256_xor_si256(v, flip);
            c = w8_input_avx2(q, e);
            j = 4 * g + e;
          } else {
            const int byte = e % 4, nib = e / 4;
            c = _mm256_and_si256(_mm256_srli_epi32(v, 8 * byte + 4 * nib), low4);
            j = 4 * (g + 4 * nib) + byte;
          }
          const __m256 wf = _mm256_cvtepi32_ps(c);
          for (int i = 0; i < MB; ++i)
            s[i][e & 1] = _mm256_fmadd_ps(wf, _mm256_set1_ps(t.x[i * l.k + b * 32 + j]), s[i][e & 1]);
        }
      }
      for (int i = 0; i < MB; ++i) acc[i] = _mm256_fmadd_ps(_mm256_add_ps(s[i][0], s[i][1]), sw, acc[i]);
    }
    if (BITS == 4) {
      const uint16_t* oh = reinterpret_cast<const uint16_t*>(t.tile + l.nblocks * l.block_bytes);
      for (int64_t g = 0; g < l.ngroups; ++g) {
        const __m256 o = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(oh + g * kRows + 8 * half)));
        for (int i = 0; i < MB; ++i)
          acc[i] = _mm256_fmadd_ps(o, _mm256_set1_ps(t.xgroup[(t.m0 + i) * l.ngroups + g]), acc[i]);
      }
    }
    for (int i = 0; i < MB; ++i) _mm256_storeu_ps(out + i * kRows + 8 * half, acc[i]);
  }
}

// PREFETCH: the form that requests the next tile (TileArgs::prefetch_next), an instance of its own (a branch in the
// loop, or both forms compiled into one function, cost weights held in cache about 5%).
template <int BITS, bool PREFETCH = false>
__attribute__((target("avx2,fma,f16c"), noinline)) int ftile_avx2_rows(const TileArgs& t, int count, float* out) {
  switch (std::min(count, 4)) {
    case 4: return ftile_avx2_mb<BITS, 4, PREFETCH>(t, out), 4;
    case 3: return ftile_avx2_mb<BITS, 3, PREFETCH>(t, out), 3;
    case 2: return ftile_avx2_mb<BITS, 2, PREFETCH>(t, out), 2;
    default: return ftile_avx2_mb<BITS, 1, PREFETCH>(t, out), 1;
  }
}

// Float activations, AVX2, int4 weights: a chunk of kFloatChunkBlocks blocks of the tile is decoded once into
// floats (code x block scale: exact in fp32, 4 x 11 significant bits), then register-blocked microkernels run every
// activation row of the call (up to kFloatMaxRows) over it, 4-6 rows x the tile's two 8-row vectors at a time
// (ftile_avx2_mb decodes the codes in registers for every call of at most 4 rows: 3 decode instructions per 4
// FMAs, and one load per FMA). Each row and 8 outputs sum in two FMA chains, over blocks [0, h) and
// [h, nblocks), inputs in order, whatever the row count and grouping: a row's output does not depend on the rows
// with it. Single thread, forced AVX2 on the EPYC, against ftile_avx2_mb for int4 (scripts/qlinear_rows_probe.py,
// docs/benchmarks.md, issue 21): 1.04-1.24x at 16 rows, 1.09-1.38x at 32, 1.32-1.35x at 64, about even at 5-8,
// 0.57-0.89x at 2-4 (the decode's multiply and store per call); the 16-request int4 mix 1.09-1.18x (quiet A/B).
// A form with ftile_avx2_mb's per-block scaling (4 rows decoded in registers, more over the chunk: no multiply
// in the decode, no loss at 2-4 rows) measured 0.9-1.06x at 5-32 rows and 1.02-1.10x on the mix.
constexpr int kFloatChunkBlocks = 4;  // 128 inputs: 8 KiB of decoded weights
constexpr int kFloatMaxRows = 64;     // activation rows per call
static_assert(kW4MaxRows <= kFloatMaxRows, "run_tiles' output buffer holds kFloatMaxRows rows");
constexpr int kFloatDualRows = 4;     // fewer rows run both chains at once (4-11 rows so: 0.6-0.9x)

// 2^e for |e| < 127, from its bits (a constant where e is: std::ldexp is a library call)
inline float pow2(int e) {
  const uint32_t bits = uint32_t(127 + e) << 23;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// w[j * kRows + r] = the int4 weight of tile row r, input j of blocks b0 .. b0 + nb - 1 (without the offsets).
__attribute__((target("avx2,fma,f16c"))) void decode_chunk_avx2(const Layout& l, const uint8_t* tile, int64_t b0,
                                                                   int nb, float* w) {
  for (int bb = 0; bb < nb; ++bb) {
    const uint8_t* blk = tile + (b0 + bb) * l.block_bytes;
    float* wb = w + bb * 32 * kRows;
    for (int half = 0; half < 2; ++half) {
      const __m256 sw =
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + l.block_codes + 16 * half)));
      // The code is masked in place (q * 2^shift, exact in float) and its scale carries 2^-shift: the product is
      // q * scale exactly, one shift saved; the top nibble (shift 28) would set the sign bit, so it shifts.
      __m256 s[8];
      for (int e = 0; e < 8; ++e) {
        const int shift = 8 * (e % 4) + 4 * (e / 4);
        s[e] = shift == 28 ? sw : _mm256_mul_ps(sw, _mm256_set1_ps(pow2(-shift)));
      }
#pragma GCC unroll 4
      for (int g = 0; g < 4; ++g) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * g + 32 * half));
#pragma GCC unroll 8
        for (int e = 0; e < 8; ++e) {  // quad g in the low nibbles, quad g + 4 in the high
          const int byte = e % 4, nib = e / 4, shift = 8 * byte + 4 * nib;
          const __m256i c =
              shift == 28 ? _mm256_srli_epi32(v, 28) : _mm256_and_si256(v, _mm256_set1_epi32(0xF << shift));
          _mm256_storeu_ps(wb + (4 * (g + 4 * nib) + byte) * kRows + 8 * half,
                           _mm256_mul_ps(_mm256_cvtepi32_ps(c), s[e]));
        }
      }
    }
  }
}

// acc[i * kRows + r] += sum over j < kc of w[j * kRows + r] * x[i * ldx + j], for R <= 6 rows, j in order.
// DUAL (R <= 3): also acc2 += the same over w2 and x2, two independent chains interleaved (few rows alone would
// wait on the FMA latency). Named accumulators, not arrays: GCC kept arrays of them in registers but also
// stored every one to the stack after each FMA (2x slower).
#define TRTPAGED_FROW_LOAD(i)                          \
  __m256 p##i = _mm256_setzero_ps(), q##i = p##i;     \
  __m256 u##i = p##i, v##i = p##i;                    \
  if constexpr (R > i) {                              \
    p##i = _mm256_loadu_ps(acc + i * kRows);          \
    q##i = _mm256_loadu_ps(acc + i * kRows + 8);      \
    if constexpr (DUAL) {                             \
      u##i = _mm256_loadu_ps(acc2 + i * kRows);       \
      v##i = _mm256_loadu_ps(acc2 + i * kRows + 8);   \
    }                                                 \
  }
#define TRTPAGED_FROW_FMA(i)                                   \
  if constexpr (R > i) {                                      \
    const __m256 xb = _mm256_broadcast_ss(x + i * ldx + j);   \
    p##i = _mm256_fmadd_ps(w0, xb, p##i);                     \
    q##i = _mm256_fmadd_ps(w1, xb, q##i);                     \
    if constexpr (DUAL) {                                     \
      const __m256 xc = _mm256_broadcast_ss(x2 + i * ldx + j); \
      u##i = _mm256_fmadd_ps(_mm256_loadu_ps(w2 + j * kRows), xc, u##i);     \
      v##i = _mm256_fmadd_ps(_mm256_loadu_ps(w2 + j * kRows + 8), xc, v##i); \
    }                                                         \
  }
#define TRTPAGED_FROW_STORE(i)                    \
  if constexpr (R > i) {                         \
    _mm256_storeu_ps(acc + i * kRows, p##i);       \
    _mm256_storeu_ps(acc + i * kRows + 8, q##i);   \
    if constexpr (DUAL) {                        \
      _mm256_storeu_ps(acc2 + i * kRows, u##i);     \
      _mm256_storeu_ps(acc2 + i * kRows + 8, v##i); \
    }                                            \
  }
template <int R, bool DUAL = false>
__attribute__((target("avx2,fma"))) void float_rows_avx2(const float* w, int kc, const float* x, int64_t ldx,
                                                         float* acc, const float* w2 = nullptr,
                                                         const float* x2 = nullptr, float* acc2 = nullptr) {
  static_assert(R >= 1 && R <= (DUAL ? 3 : 6), "1 to 6 rows, 1 to 3 dual");
  TRTPAGED_FROW_LOAD(0) TRTPAGED_FROW_LOAD(1) TRTPAGED_FROW_LOAD(2)
  TRTPAGED_FROW_LOAD(3) TRTPAGED_FROW_LOAD(4) TRTPAGED_FROW_LOAD(5)
  for (int j = 0; j < kc; ++j) {
    const __m256 w0 = _mm256_loadu_ps(w + j * kRows), w1 = _mm256_loadu_ps(w + j * kRows + 8);
    TRTPAGED_FROW_FMA(0) TRTPAGED_FROW_FMA(1) TRTPAGED_FROW_FMA(2)
    TRTPAGED_FROW_FMA(3) TRTPAGED_FROW_FMA(4) TRTPAGED_FROW_FMA(5)
  }
  TRTPAGED_FROW_STORE(0) TRTPAGED_FROW_STORE(1) TRTPAGED_FROW_STORE(2)
  TRTPAGED_FROW_STORE(3) TRTPAGED_FROW_STORE(4) TRTPAGED_FROW_STORE(5)
}
#undef TRTPAGED_FROW_LOAD
#undef TRTPAGED_FROW_FMA
#undef TRTPAGED_FROW_STORE

// Each row and 8 outputs sum in two FMA chains, over blocks [0, h) and [h, nblocks) (h = nblocks / 2), added at
// the end: up to 3 rows run both chains at once, more rows one after the other; the same sums either way.
__attribute__((target("avx2,fma,f16c"))) int ftile_avx2_decoded(const TileArgs& t, int count, float* out) {
  const Layout& l = *t.l;
  const int m = std::min(count, kFloatMaxRows);
  const int64_t h = l.nblocks / 2;
  alignas(32) float w[kFloatChunkBlocks * 32 * kRows], w2[kFloatChunkBlocks * 32 * kRows];
  alignas(32) float out2[kFloatMaxRows * kRows];  // the second chains
  std::fill(out, out + m * kRows, 0.f);
  std::fill(out2, out2 + m * kRows, 0.f);
  // rows i .. i + r - 1 over the decoded blocks b0 .. b0 + nb - 1 of w, into acc
  auto rows = [&](const float* wc, int64_t b0, int nb, int i, int r, float* acc) {
    const float* xr = t.x + i * l.k + b0 * 32;
    switch (r) {
      case 6: float_rows_avx2<6>(wc, nb * 32, xr, l.k, acc); break;
      case 5: float_rows_avx2<5>(wc, nb * 32, xr, l.k, acc); break;
      case 4: float_rows_avx2<4>(wc, nb * 32, xr, l.k, acc); break;
      case 3: float_rows_avx2<3>(wc, nb * 32, xr, l.k, acc); break;
      case 2: float_rows_avx2<2>(wc, nb * 32, xr, l.k, acc); break;
      default: float_rows_avx2<1>(wc, nb * 32, xr, l.k, acc); break;
    }
  };
  int64_t hi_done = h;  // the second chains' blocks before this are summed
  const bool dual = m < kFloatDualRows;
  if (dual) {
    for (int64_t b0 = 0; b0 < h; b0 += kFloatChunkBlocks) {
      const int nb = int(std::min<int64_t>(kFloatChunkBlocks, h - b0));
      decode_chunk_avx2(l, t.tile, b0, nb, w);
      decode_chunk_avx2(l, t.tile, h + b0, nb, w2);
      for (int i = 0; i < m;) {
        const int left = m - i, groups = (left + 2) / 3, r = (left + groups - 1) / groups;  // <= 3, even
        const float* x1 = t.x + i * l.k + b0 * 32;
        const float* x2 = x1 + h * 32;
        float* a1 = out + i * kRows;
        float* a2 = out2 + i * kRows;
        switch (r) {
          case 3: float_rows_avx2<3, true>(w, nb * 32, x1, l.k, a1, w2, x2, a2); break;
          case 2: float_rows_avx2<2, true>(w, nb * 32, x1, l.k, a1, w2, x2, a2); break;
          default: float_rows_avx2<1, true>(w, nb * 32, x1, l.k, a1, w2, x2, a2); break;
        }
        i += r;
      }
    }
    hi_done = 2 * h;
  }
  for (int chain = dual ? 1 : 0; chain < 2; ++chain) {
    const int64_t bbeg = chain == 0 ? 0 : hi_done, bend = chain == 0 ? h : l.nblocks;
    float* acc = chain == 0 ? out : out2;
    for (int64_t b0 = bbeg; b0 < bend; b0 += kFloatChunkBlocks) {
      const int nb = int(std::min<int64_t>(kFloatChunkBlocks, bend - b0));
      decode_chunk_avx2(l, t.tile, b0, nb, w);
      for (int i = 0; i < m;) {
        // groups of at most 6 rows, as even as possible: 4 rows or more keep both FMA units busy
        const int left = m - i, groups = (left + 5) / 6, r = (left + groups - 1) / groups;
        rows(w, b0, nb, i, r, acc + i * kRows);
        i += r;
      }
    }
  }
  for (int i = 0; i < m * kRows; i += 8)
    _mm256_storeu_ps(out + i, _mm256_add_ps(_mm256_loadu_ps(out + i), _mm256_loadu_ps(out2 + i)));
  {  // the int4 offsets x sums of x per group
    const uint16_t* oh = reinterpret_cast<const uint16_t*>(t.tile + l.nblocks * l.block_bytes);
    for (int i = 0; i < m; ++i) {
      __m256 a0 = _mm256_loadu_ps(out + i * kRows), a1 = _mm256_loadu_ps(out + i * kRows + 8);
      for (int64_t g = 0; g < l.ngroups; ++g) {
        const __m256 xs = _mm256_set1_ps(t.xgroup[(t.m0 + i) * l.ngroups + g]);
        a0 = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(oh + g * kRows))), xs,
                             a0);
        a1 = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(oh + g * kRows + 8))),
                             xs, a1);
      }
      _mm256_storeu_ps(out + i * kRows, a0);
      _mm256_storeu_ps(out + i * kRows + 8, a1);
    }
  }
  return m;
}

// Float activations, AVX2, int8 weights (the LM head), from kF8MinRows rows: ftile_avx2_mb's sums over a chunk of
// kF8ChunkBlocks blocks decoded once per call into floats (the codes, unscaled, and the block scales), run for
// every row of the call (up to kFloatMaxRows), 3 rows x both halves of the tile at a time (12 accumulators; 2
// weight loads and 3 broadcasts per 6 FMAs, against ftile_avx2_mb's decode of each code register per call of at
// most 4 rows and one broadcast per FMA). Each row's float steps are ftile_avx2_mb's: per block and 8 outputs, two
// FMA chains from zero over the even and the odd inputs in order, added, then fma(sum, block scale, acc) in block
// order: the same bits whichever kernel, row count or grouping a row gets. With TileArgs::prefetch_next, while a
// chunk runs the same blocks of the next tile are requested. One thread, forced AVX2 on the EPYC, quiet
// (scripts/qlinear_rows_probe.py, docs/benchmarks.md round 13): LM head 1.16-1.45x main's kernel at 9-32 rows, 1.07x
// at 64 (1.03-1.15x of ftile_avx2_mb with the same prefetch); int8 weights held in cache 1.07-1.29x at 9-64 rows;
// at 8 rows 0.90-1.04x of ftile_avx2_mb, so 8 or fewer keep it.
constexpr int kF8ChunkBlocks = 4;  // 128 inputs: 8 KiB of decoded codes (6 blocks measured the same)
constexpr int kF8MinRows = 9;

// w[bb * 32 * kRows + j * kRows + r] = code of tile row r, input j of block b0 + bb (as a float, unscaled);
// sw[bb * kRows + r] = its block scale.
__attribute__((target("avx2,fma,f16c"))) void decode_chunk_w8_avx2(const Layout& l, const uint8_t* tile, int64_t b0,
                                                                      int nb, float* w, float* sw) {
  const __m256i flip = _mm256_set1_epi8(char(0x80));
  for (int bb = 0; bb < nb; ++bb) {
    const uint8_t* blk = tile + (b0 + bb) * l.block_bytes;
    float* wb = w + bb * 32 * kRows;
    for (int half = 0; half < 2; ++half) {
#pragma GCC unroll 8
      for (int g = 0; g < 8; ++g) {
        const __m256i q = _mm256_xor_si256(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * g + 32 * half)), flip);
#pragma GCC unroll 4
        for (int e = 0; e < 4; ++e) {
          _mm256_storeu_ps(wb + (4 * g + e) * kRows + 8 * half, _mm256_cvtepi32_ps(w8_input_avx2(q, e)));
        }
      }
      const __m128i sh = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + l.block_codes + 16 * half));
      _mm256_storeu_ps(sw + bb * kRows + 8 * half, _mm256_cvtph_ps(sh));
    }
  }
}

// acc[i * kRows + r] += the terms of blocks 0 .. nb - 1 of the decoded chunk for rows i < R <= 3 (x: row 0 at the
// chunk's first input). Named accumulators: e/o the even / odd inputs' chains, 0/1 the tile's halves.
#define TRTPAGED_F8_ZERO(i) __m256 e0##i = _mm256_setzero_ps(), e1##i = e0##i, o0##i = e0##i, o1##i = e0##i;
#define TRTPAGED_F8_FMA(i, c, j)                                              \
  if constexpr (R > i) {                                                      \
    const __m256 xb = _mm256_broadcast_ss(xr + i * ldx + (j));                \
    c##0##i = _mm256_fmadd_ps(w0, xb, c##0##i);                               \
    c##1##i = _mm256_fmadd_ps(w1, xb, c##1##i);                               \
  }
#define TRTPAGED_F8_STEP(c, j)                                                                            \
  {                                                                                                       \
    __m256 w0 = _mm256_loadu_ps(wb + (j) * kRows), w1 = _mm256_loadu_ps(wb + (j) * kRows + 8);            \
    asm("" : "+x"(w0), "+x"(w1)); /* loaded once for all rows, not folded into each row's FMA */          \
    TRTPAGED_F8_FMA(0, c, j) TRTPAGED_F8_FMA(1, c, j) TRTPAGED_F8_FMA(2, c, j)                            \
  }
#define TRTPAGED_F8_SCALE(i)                                                                                 \
  if constexpr (R > i) {                                                                                     \
    float* a = acc + i * kRows;                                                                              \
    _mm256_storeu_ps(a, _mm256_fmadd_ps(_mm256_add_ps(e0##i, o0##i), s0, _mm256_loadu_ps(a)));              \
    _mm256_storeu_ps(a + 8, _mm256_fmadd_ps(_mm256_add_ps(e1##i, o1##i), s1, _mm256_loadu_ps(a + 8)));      \
  }
template <int R>
__attribute__((target("avx2,fma"))) void w8_float_rows_avx2(const float* w, const float* sw, int nb, const float* x,
                                                            int64_t ldx, float* acc) {
  static_assert(R >= 1 && R <= 3, "1 to 3 rows");
  for (int bb = 0; bb < nb; ++bb) {
    const float* wb = w + bb * 32 * kRows;
    const float* xr = x + bb * 32;
    TRTPAGED_F8_ZERO(0) TRTPAGED_F8_ZERO(1) TRTPAGED_F8_ZERO(2)
    for (int j = 0; j < 32; j += 2) {
      TRTPAGED_F8_STEP(e, j)
      TRTPAGED_F8_STEP(o, j + 1)
    }
    const __m256 s0 = _mm256_loadu_ps(sw + bb * kRows), s1 = _mm256_loadu_ps(sw + bb * kRows + 8);
    TRTPAGED_F8_SCALE(0) TRTPAGED_F8_SCALE(1) TRTPAGED_F8_SCALE(2)
  }
}
#undef TRTPAGED_F8_ZERO
#undef TRTPAGED_F8_FMA
#undef TRTPAGED_F8_STEP
#undef TRTPAGED_F8_SCALE

// Chunk by chunk in block order, the call's rows in groups of 3 or 2 (as even as possible: a lone row would wait on
// the FMA latency).
__attribute__((target("avx2,fma,f16c"))) int ftile_avx2_w8_decoded(const TileArgs& t, int count, float* out) {
  const Layout& l = *t.l;
  const int m = std::min(count, kFloatMaxRows);
  alignas(32) float w[kF8ChunkBlocks * 32 * kRows], sw[kF8ChunkBlocks * kRows];
  std::fill(out, out + m * kRows, 0.f);
  for (int64_t b0 = 0; b0 < l.nblocks; b0 += kF8ChunkBlocks) {
    const int nb = int(std::min<int64_t>(kF8ChunkBlocks, l.nblocks - b0));
    decode_chunk_w8_avx2(l, t.tile, b0, nb, w, sw);
    if (t.prefetch_next)  // the same blocks of the next tile
      for (int b = 0; b < nb; ++b) request_next_tile_block(t, b0 + b);
    for (int i = 0; i < m;) {
      const int left = m - i, groups = (left + 2) / 3, r = (left + groups - 1) / groups;  // groups of 2-3 rows
      const float* xr = t.x + i * l.k + b0 * 32;
      switch (r) {
        case 3: w8_float_rows_avx2<3>(w, sw, nb, xr, l.k, out + i * kRows); break;
        case 2: w8_float_rows_avx2<2>(w, sw, nb, xr, l.k, out + i * kRows); break;
        default: w8_float_rows_avx2<1>(w, sw, nb, xr, l.k, out + i * kRows); break;
      }
      i += r;
    }
  }
  return m;
}

// Float activations, AVX2 and AVX-VNNI, int8 weights: the decoded chunks from kF8MinRows rows, ftile_avx2_mb below.
__attribute__((target("avx2,fma,f16c"))) int ftile_avx2_w8(const TileArgs& t, int count, float* out) {
  if (count >= kF8MinRows) return ftile_avx2_w8_decoded(t, count, out);
  return t.prefetch_next ? ftile_avx2_rows<8, true>(t, count, out) : ftile_avx2_rows<8>(t, count, out);
}

// ---------------------------------------------------------------------------------------------
// Dispatch: the kernels of the ISA in use (chosen in isa.cpp).
TileKernel tile_kernel(Isa isa, int bits, bool float_activations) {
  if (float_activations) {
    switch (isa) {
      case kAvx512Vnni: return bits == 8 ? ftile_avx512<8> : ftile_avx512<4>;
      case kAvxVnni:
      case kAvx2: return bits == 8 ? ftile_avx2_w8 : ftile_avx2_decoded;
      default: return bits == 8 ? tile_scalar<8, true> : tile_scalar<4, true>;
    }
  }
  switch (isa) {
    case kAvx512Vnni: return bits == 8 ? tile_avx512<8> : tile_avx512<4>;
    case kAvxVnni: return bits == 8 ? tile_avxvnni<8> : tile_avxvnni<4>;
    case kAvx2: return bits == 8 ? tile_avx2<8> : tile_avx2<4>;
    default: return bits == 8 ? tile_scalar<8, false> : tile_scalar<4, false>;
  }
}

// Activation rows one call of an int8-activation tile kernel takes at most (plain AVX2 int4: every row of the call
// over each unpacked chunk, tile_avx2_w4_decoded).
int tile_max_rows(Isa isa, int bits) {
  if (isa == kAvx2 && bits == 4) return kW4MaxRows;
  return isa == kAvx512Vnni ? 8 : 4;
}

// Activation rows one call of tile_kernel's float-activation kernel takes at most: on AVX2 and AVX-VNNI
// ftile_avx2_decoded (int4) and ftile_avx2_w8 (int8, from kF8MinRows rows) run every row of a call over each decoded
// chunk, the others kMaxMB.
int float_tile_max_rows(Isa isa) { return isa == kAvx2 || isa == kAvxVnni ? kFloatMaxRows : kMaxMB; }

// ---------------------------------------------------------------------------------------------
// Per-call buffers, one set per calling thread, reused across calls (no allocation per decode step).
struct CallBuffers {
  std::vector<float> xs;  // prescaled x (prescale_x_int4)
  std::vector<int8_t> xq;
  std::vector<BlockRecord> rec;
  std::vector<float> group_sums;
};

// Float activations as kLimbs int8 limb rows (see the top of the file).
constexpr int kLimbs = 3;
// Float activations take the limbs up to this many rows, the float tiles above. One row streams the
// weights and the limbs read fewer bytes per weight than the float tiles convert; from two rows on
// the work is compute, where three limb rows cost as much as or more than one float row. Forced ISA on
// the EPYC (AVX-512 VNNI, Zen 4), one thread, interleaved calls, limbs / float tiles: int8 lm_head
// 49152 x 576, AVX-512 M = 4: 1.34-1.51x, M = 2, 6, 8, 16: 0.84-1.07x (noise); plain AVX2 M = 2:
// 1.35x, M = 4: 1.75x, M = 16: 1.82x; int4 gate_up 3072 x 576, AVX-512 M = 4: 1.03x; plain AVX2 M = 2:
// 1.15x, M = 4: 1.54x (M = 1: 0.70x), against the float tiles before ftile_avx2_decoded. AVX-VNNI keeps the limbs for
// int8 at any batch (a row's bits at every row count) and for int4 takes them at one row only, as AVX-512 does: up to
// 4 rows, as it had them, the rows of a 2-4 row call differed from the same rows among 5 or more
// (test_float_activations_row_results_do_not_depend_on_the_batch, on the first AVX-VNNI CPU here, a Xeon with
// AVX-512 too). The float tiles cost that CPU's int4 calls of 2 and 3 rows 0.66-0.69x and 0.82-0.86x (one thread,
// SmolLM2's shapes in cache; 4 rows even).
// The two round differently, so under this rule a row's y depends on how many rows share the call. Where that
// must not be (a one-sequence speculative verification step, whose rows must get the logits of one-row decode
// steps), the caller passes FLOAT_LIMB activations: the limbs at every M. That costs a 6-row SmolLM2 int4 step
// 1.02-1.07x of the float tiles on AVX-512 and 1.22x on plain AVX2 (4 rows: 1.14x on both; measured against the
// float tiles before ftile_avx2_decoded), so only such steps take it; batches keep this rule
// (docs/speculative.md, "Greedy identity on quantized engines").
// Plain AVX2, int8 weights (the LM head): none, the float tiles at every row count. There one row's float tile runs
// about 1.3x as fast as the three limb rows' integer work on the Zen 1-class EPYC (an L1-resident loop of each: 6.1-6.5
// against 4.8-4.9 weights/ns, with the tile's vpshufb decode; the LM head at one row, 2 threads: 1.08-1.26x, as a
// 6-row FLOAT_LIMB call 1.6-2.0x), and the float tiles give a row the same bits at every row count, so FLOAT_LIMB
// takes them too (a row's y is still that of the row alone).
int64_t limb_max_rows(Isa isa, int bits) {
  if (isa == kAvxVnni) return bits == 8 ? INT64_MAX : 1;
  if (isa == kAvx2 && bits == 8) return 0;
  return 1;
}

// max |x| over a block of 32.
inline float block_amax_scalar(const float* x) {
  float amax = 0.f;
  for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[j]));
  return amax;
}
__attribute__((target("avx2,fma"))) float block_amax_avx2(const float* x) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + 8 * i)));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  return _mm_cvtss_f32(m4);
}

// One limb of a block of 32: q = clamp(round(r / d)) (ties to even, as torch.round; computed as
// r * (1 / d) in float32 so a reference can reproduce it bit for bit); returns sum(q). With rest
// (which may be r itself), rest = r - q * d: what the next limb quantizes.
inline int32_t limb_block_scalar(const float* r, float* rest, float d, int8_t* q) {
  const float id = d > 0.f ? 1.f / d : 0.f;
  int32_t sum = 0;
  for (int j = 0; j < 32; ++j) {
    const int c = int(std::clamp(std::nearbyint(r[j] * id), -127.f, 127.f));
    q[j] = int8_t(c);
    sum += c;
    if (rest) rest[j] = std::fma(-float(c), d, r[j]);
  }
  return sum;
}
__attribute__((target("avx2,fma"))) int32_t limb_block_avx2(const float* r, float* rest, float d, int8_t* q) {
  const __m256 idv = _mm256_set1_ps(d > 0.f ? 1.f / d : 0.f), dv = _mm256_set1_ps(d);
  const __m256 lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
  __m256i iv[4];
  for (int i = 0; i < 4; ++i) {
    const __m256 v = _mm256_loadu_ps(r + 8 * i);
    const __m256 c = _mm256_min_ps(_mm256_max_ps(_mm256_round_ps(_mm256_mul_ps(v, idv), _MM_FROUND_TO_NEAREST_INT |
                                                                  _MM_FROUND_NO_EXC), lo), hi);
    if (rest) _mm256_storeu_ps(rest + 8 * i, _mm256_fnmadd_ps(c, dv, v));
    iv[i] = _mm256_cvtps_epi32(c);
  }
  __m256i s = _mm256_add_epi32(_mm256_add_epi32(iv[0], iv[1]), _mm256_add_epi32(iv[2], iv[3]));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
  __m256i p8 = _mm256_packs_epi16(_mm256_packs_epi32(iv[0], iv[1]), _mm256_packs_epi32(iv[2], iv[3]));
  p8 = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), p8);
  return _mm_cvtsi128_si32(s4);
}

// x quantized per block of 32 for the integer kernels, in `limbs` int8 rows per row of x: row i
// becomes rows i * limbs + l. Limb 0 has the block scale d = max|x| / 127 (the int8-activation
// path is limbs = 1); limb l > 0 quantizes what the limbs before it left, with scale d / 254^l
// (|q| <= 127 since that remainder is at most half the previous scale). Each limb row gets its
// block records and, for int4, its group sums of d * sum(q).
void quantize_activations(const float* x, int64_t m, int limbs, const Layout& l, Isa isa, CallBuffers& buf,
                          Acts& acts) {
  const int64_t rows = m * limbs;
  buf.xq.resize(size_t(rows * l.k));
  buf.rec.resize(size_t(rows * l.nblocks));
  if (l.bits == 4) buf.group_sums.assign(size_t(rows * l.ngroups), 0.f);
  const int64_t blocks_per_group = l.group / 32;
  const bool simd = isa != kScalar;
  auto quantize_row = [&](int64_t i) {
    for (int64_t b = 0; b < l.nblocks; ++b) {
      const float* xb = x + i * l.k + b * 32;
      alignas(32) float rest[32];  // what the limbs so far leave of the block
      float d = (simd ? block_amax_avx2(xb) : block_amax_scalar(xb)) / 127.f;
      for (int limb = 0; limb < limbs; ++limb, d /= 254.f) {
        const int64_t row = i * limbs + limb;
        int8_t* q = buf.xq.data() + row * l.k + b * 32;
        const float* r = limb == 0 ? xb : rest;
        float* next = limb + 1 < limbs ? rest : nullptr;
        const int32_t sum = simd ? limb_block_avx2(r, next, d, q) : limb_block_scalar(r, next, d, q);
        buf.rec[size_t(row * l.nblocks + b)] = BlockRecord{d, -128 * sum};
        if (l.bits == 4) buf.group_sums[size_t(row * l.ngroups + b / blocks_per_group)] += d * float(sum);
      }
    }
  };
  // An OpenMP region costs microseconds even when it runs serially: small calls skip it.
  if (rows * l.k >= (1 << 16)) {
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < m; ++i) quantize_row(i);
  } else {
    for (int64_t i = 0; i < m; ++i) quantize_row(i);
  }
  acts.xq = buf.xq.data();
  acts.rec = buf.rec.data();
  acts.group_sums = l.bits == 4 ? buf.group_sums.data() : nullptr;
}

// int4 with float activations: sums of x over each group, for the offset term.
void float_group_sums(const float* x, int64_t m, const Layout& l, CallBuffers& buf) {
  buf.group_sums.resize(size_t(m * l.ngroups));
  for (int64_t row = 0; row < m; ++row)
    for (int64_t g = 0; g < l.ngroups; ++g) {
      const float* xg = x + row * l.k + g * l.group;
      float s = 0.f;
      for (int32_t j = 0; j < l.group; ++j) s += xg[j];
      buf.group_sums[row * l.ngroups + g] = s;
    }
}

// int4, float activations, AVX-512: x times 2^-shift of each input's code position in its
// 32-bit lane (see ftile_avx512_mb), so the kernel needs no shift. Powers of two: exact unless
// |x| < 2^-98 (then subnormal, off by at most 2^-149 * 2^28 absolute).
void prescale_x_int4(const float* x, int64_t m, const Layout& l, CallBuffers& buf) {
  float factor[32];
  for (int j = 0; j < 32; ++j) {
    const int shift = 8 * (j % 4) + 4 * (j / 16);
    factor[j] = shift == 28 ? 1.f : std::ldexp(1.f, -shift);
  }
  buf.xs.resize(size_t(m * l.k));
  for (int64_t i = 0; i < m * l.k; ++i) buf.xs[i] = x[i] * factor[i % 32];
}

// Activation bytes of one band of run_tiles' work items: about a third of a core's L2 (1 MiB on Zen 4, 1.25-2 MiB on
// recent Xeons), the rest left to the tiles' weights and the outputs.
constexpr int64_t kBandBytes = 384 << 10;

// limbs > 1: the activation rows are limb rows (quantize_activations), `limbs` per output row; each
// kernel call takes whole groups of them (max_rows: the kernel's register block) and their
// outputs are summed into one y row.
void run_tiles(const Layout& l, TileKernel kernel, const Acts* acts, const float* x, const float* xgroup, int64_t m,
               const uint8_t* packed, const float* bias, float* y, int limbs = 1, int max_rows = kMaxMB) {
  // Work items: (tile, chunk of activation rows), in bands of chunks whose activations fit in a core's L2:
  // band by band, and within a band tile-major, so one thread's consecutive items reuse the tile's weights
  // from cache and every tile of the band reads the band's activations from the L2. (One band of all the
  // rows re-read a prefill's whole x, megabytes, from the L3 for every tile.)
  const int64_t mchunk = 64 / limbs * limbs;
  const int64_t call_rows = std::max(1, max_rows / limbs) * limbs;
  const int64_t nchunks = (m + mchunk - 1) / mchunk;
  const int64_t row_bytes = l.k * (x ? int64_t(sizeof(float)) : int64_t(sizeof(int8_t)));
  const int64_t band = std::max<int64_t>(1, kBandBytes / (row_bytes * mchunk));  // chunks per band
  const int64_t band_items = l.ntiles * band;  // work items of a whole band
  const int64_t items = l.ntiles * nchunks;
  const double work = double(l.ntiles) * kRows * double(l.k) * double(m);
  const bool stream_weights =
      size_t(l.ntiles) * l.tile_bytes >= kPrefetchWeightBytes || m / limbs <= kStreamedMaxRows;
  auto run_item = [&](int64_t item) {
    const int64_t b0 = item / band_items * band;  // the band's first chunk
    const int64_t width = std::min(band, nchunks - b0);
    const int64_t within = item - b0 * l.ntiles;
    const int64_t tile = within / width;
    const int64_t mbeg = (b0 + within % width) * mchunk;
    const int64_t mend = std::min(m, mbeg + mchunk);
    const uint8_t* tp = packed + tile * l.tile_bytes;
    const int rows = int(std::min<int64_t>(kRows, l.n - tile * kRows));
    for (int64_t m0 = mbeg; m0 < mend;) {
      alignas(64) float out[kFloatMaxRows * kRows];
      // the first call of a tile requests the next one
      const TileArgs args{&l, tp, m0, acts, x ? x + m0 * l.k : nullptr, xgroup, stream_weights && m0 == mbeg};
      const int want = int(std::min<int64_t>(call_rows, mend - m0));
      // The y lines this call writes are requested (for writing) while the tile is computed: with
      // wide outputs (the LM head) they are cache misses, which the stores below would otherwise wait on.
      for (int i = 0; i < want; i += limbs) __builtin_prefetch(y + (m0 + i) / limbs * l.n + tile * kRows, 1, 3);
      const int count = kernel(args, want, out);
      const float* b = bias ? bias + tile * kRows : nullptr;
      for (int i = 0; i < count; i += limbs) {
        float* yrow = y + (m0 + i) / limbs * l.n + tile * kRows;
        float v[kRows];
        for (int r = 0; r < kRows; ++r) v[r] = out[i * kRows + r];
        for (int j = 1; j < limbs; ++j)
          for (int r = 0; r < kRows; ++r) v[r] += out[(i + j) * kRows + r];
        if (b)
          for (int r = 0; r < kRows; ++r) v[r] += rows == kRows || r < rows ? b[r] : 0.f;
        if (rows == kRows)
          std::memcpy(yrow, v, sizeof(v));
        else
          std::memcpy(yrow, v, size_t(rows) * sizeof(float));
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
        for (int64_t b = 0; b < l.nblocks; ++b) {
          uint8_t* blk = tp + b * l.block_bytes;
          if (row >= n) {  // padding rows: zero codes and scales (int8: stored q + 128 = 128)
            if (bits == 8)
              for (int j = 0; j < 32; ++j) blk[((j / 4) * kRows + r) * 4 + j % 4] = 128;
            continue;
          }
          uint16_t* sc = reinterpret_cast<uint16_t*>(blk + l.block_codes);
          to_half_exact(scales[row * ng + b * 32 / group_size], &sc[r]);
          for (int j = 0; j < 32; ++j) {
            const int64_t kk = b * 32 + j;
            if (bits == 8) {
              blk[((j / 4) * kRows + r) * 4 + j % 4] = uint8_t(c8[row * k + kk] + 128);
            } else {
              const uint8_t byte = c4[row * (k / 2) + kk / 2];
              const uint8_t q = kk % 2 == 0 ? (byte & 0x0F) : (byte >> 4);
              blk[(((j / 4) % 4) * kRows + r) * 4 + j % 4] |= uint8_t(j < 16 ? q : q << 4);
            }
          }
        }
        if (bits == 4 && row < n) {
          uint16_t* oh = reinterpret_cast<uint16_t*>(tp + l.nblocks * l.block_bytes);
          for (int64_t g = 0; g < ng; ++g) to_half_exact(offsets[row * ng + g], &oh[g * kRows + r]);
        }
      }
    }
    return trtpaged_status(ok());
  } catch (const std::exception& e) {
    return trtpaged_status(fail_from(e, "qlinear_pack"));
  }
}

TRTPAGED_API trtpaged_status trtpaged_qlinear_cpu_ex(const float* x, int64_t m, const void* packed, int32_t bits,
                                                     int64_t n, int64_t k, int32_t group_size, const float* bias,
                                                     float* y, int32_t activations) {
  using namespace trtpaged;
  try {
    if (int rc = validate_shape(bits, n, k, group_size)) return trtpaged_status(rc);
    if (activations != TRTPAGED_QLINEAR_INT8_ACTIVATIONS && activations != TRTPAGED_QLINEAR_FLOAT_ACTIVATIONS &&
        activations != TRTPAGED_QLINEAR_FLOAT_LIMB_ACTIVATIONS)
      return trtpaged_status(fail(TRTPAGED_ERR_INVALID_ARGUMENT,
                                  "activations: must be 0 (int8), 1 (float32) or 2 (float32 as limbs), got " +
                                      std::to_string(activations)));
    if (m < 0) return trtpaged_status(fail(TRTPAGED_ERR_INVALID_ARGUMENT, "m: must be >= 0, got " + std::to_string(m)));
    if (m == 0) return trtpaged_status(ok());
    if (!x) return trtpaged_status(fail(TRTPAGED_ERR_INVALID_ARGUMENT, "x: null pointer"));
    if (!packed) return trtpaged_status(fail(TRTPAGED_ERR_INVALID_ARGUMENT, "packed: null pointer"));
    if (!y) return trtpaged_status(fail(TRTPAGED_ERR_INVALID_ARGUMENT, "y: null pointer"));
    const Layout l = make_layout(bits, n, k, group_size);
    const Isa isa = trtpaged::cpu::current_isa();
    const bool limbs_always = activations == TRTPAGED_QLINEAR_FLOAT_LIMB_ACTIVATIONS;
    const bool float_acts = activations == TRTPAGED_QLINEAR_FLOAT_ACTIVATIONS || limbs_always;
    static thread_local CallBuffers buf;
    Acts acts{};
    const int64_t limb_rows = limb_max_rows(isa, bits);
    if (float_acts && limb_rows > 0 && (limbs_always || m <= limb_rows)) {
      quantize_activations(x, m, kLimbs, l, isa, buf, acts);
      run_tiles(l, tile_kernel(isa, bits, false), &acts, nullptr, nullptr, m * kLimbs,
                static_cast<const uint8_t*>(packed), bias, y, kLimbs, tile_max_rows(isa, bits));
      return trtpaged_status(ok());
    }
    if (float_acts) {
      if (bits == 4) float_group_sums(x, m, l, buf);
      if (bits == 4 && isa == kAvx512Vnni) {
        prescale_x_int4(x, m, l, buf);
        x = buf.xs.data();
      }
    } else {
      quantize_activations(x, m, 1, l, isa, buf, acts);
    }
    run_tiles(l, tile_kernel(isa, bits, float_acts), float_acts ? nullptr : &acts, float_acts ? x : nullptr,
              float_acts && bits == 4 ? buf.group_sums.data() : nullptr, m, static_cast<const uint8_t*>(packed), bias,
              y, 1, float_acts ? float_tile_max_rows(isa) : std::max(kMaxMB, tile_max_rows(isa, bits)));
    return trtpaged_status(ok());
  } catch (const std::exception& e) {
    return trtpaged_status(fail_from(e, "qlinear_cpu"));
  }
}

TRTPAGED_API trtpaged_status trtpaged_qlinear_cpu(const float* x, int64_t m, const void* packed, int32_t bits,
                                                  int64_t n, int64_t k, int32_t group_size, const float* bias,
                                                  float* y) {
  return trtpaged_qlinear_cpu_ex(x, m, packed, bits, n, k, group_size, bias, y, TRTPAGED_QLINEAR_INT8_ACTIVATIONS);
}

}  // extern "C"
