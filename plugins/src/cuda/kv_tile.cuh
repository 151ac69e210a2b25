// Paged KV addressing and the tile loader shared by the attention kernels.
// Everything read from device index arrays is clamped here: a bad block id or
// position never leads to an access outside the pool or the block table.
#pragma once

#include <cstdint>

#include "cuda/cp_async.cuh"
#include "cuda/dtype.cuh"
#include "cuda/kv_codes.cuh"
#include "cuda/paged_args.h"

namespace trtpaged {
namespace cuda {

// Element offset of kv_cache[block][layer][kv][head][0][0].
__device__ __forceinline__ int64_t kv_head_offset(const PagedArgs& a, int block, int kv, int head) {
  const int64_t slab = (static_cast<int64_t>(block) * a.num_layers + a.layer) * 2 + kv;
  return ((slab * a.num_kv_heads + head) * a.block_size) * a.kv_row;
}

__device__ __forceinline__ bool block_valid(const PagedArgs& a, int block) {
  return block >= 0 && block < a.num_kv_blocks;
}

// KV tokens of sequence s readable this step: context_lens[s] clamped to the table and max_context_len.
__device__ __forceinline__ int seq_kv_len(const PagedArgs& a, int s) {
  const int n = a.context_lens[s];
  return n < 0 ? 0 : (n < a.max_kv_len ? n : a.max_kv_len);
}

// Keys a query at position pos attends to: [0, min(kv_len, pos + 1)).
__device__ __forceinline__ int query_kv_len(int kv_len, int pos) {
  if (pos < 0) return 0;
  return pos < kv_len ? pos + 1 : kv_len;
}

// First key a query at position pos attends to under a sliding window (0: none).
__device__ __forceinline__ int query_kv_first(int pos, int window) {
  return window > 0 && pos - window + 1 > 0 ? pos - window + 1 : 0;
}

// A score in the exp2 domain, soft-capped (Gemma 2) when cap_log2 > 0: cap * tanh(s / cap).
__device__ __forceinline__ float soft_cap(float score, float cap_log2) {
  return cap_log2 > 0.f ? cap_log2 * tanhf(score / cap_log2) : score;
}

// Copies the K and V rows of tokens [first, first + T) of one KV head into
// sk/sv ([T][D] each, 16-byte aligned). Rows at or past `end`, or in a block
// outside the pool, are zero-filled so that masked keys can never inject NaN.
// The caller commits the cp.async group.
template <typename KvT, int D, int T>
__device__ __forceinline__ void load_kv_tile(const PagedArgs& a, const int32_t* block_row, int kv_head,
                                             int first, int end, KvT* sk, KvT* sv) {
  constexpr int kChunk = 16 / static_cast<int>(sizeof(KvT));  // elements per 16-byte copy
  constexpr int kRowChunks = D / kChunk;
  constexpr int kTileChunks = T * kRowChunks;
  static_assert(D % kChunk == 0, "a K/V row must be a whole number of 16-byte chunks");
  const KvT* cache = static_cast<const KvT*>(a.kv_cache);
  for (int i = threadIdx.x; i < 2 * kTileChunks; i += blockDim.x) {
    const int kv = i >= kTileChunks ? 1 : 0;
    const int r = i - kv * kTileChunks;
    const int t = r / kRowChunks;
    const int c = r - t * kRowChunks;
    KvT* dst = (kv ? sv : sk) + t * D + c * kChunk;
    const int token = first + t;
    const KvT* src = nullptr;
    if (token < end) {
      const int block = block_row[token >> a.block_size_log2];
      if (block_valid(a, block)) {
        const int offset = token & (a.block_size - 1);
        src = cache + kv_head_offset(a, block, kv, kv_head) + static_cast<int64_t>(offset) * D + c * kChunk;
      }
    }
    if (src != nullptr) {
      cp_async_16(dst, src);
    } else {
      *reinterpret_cast<uint4*>(dst) = make_uint4(0u, 0u, 0u, 0u);
    }
  }
}

// Quantized pools: copies the K and V rows (D codes and the fp16 scale, D + 2 bytes each) of tokens
// [first, first + T) of one KV head into sk/sv ([T][D + 2] bytes each, packed as in the pool, 16-byte
// aligned). Rows are not 16-byte aligned, but the rows of one block are contiguous: a tile is copied
// as runs of min(T, block_size) rows (first is a multiple of T, T and block_size powers of two >= 8,
// so every run starts a block or lies inside one and spans a whole number of 16-byte chunks).
// Bytes of rows at or past `end`, or in a block outside the pool, are zero-filled: a masked key's
// stale codes or scale can never inject NaN.
template <int D, int T>
__device__ __forceinline__ void load_quant_kv_tile(const PagedArgs& a, const int32_t* block_row, int kv_head,
                                                   int first, int end, uint8_t* sk, uint8_t* sv) {
  constexpr int kRow = D + 2;
  constexpr int kTileChunks = T * kRow / 16;
  static_assert(T % 8 == 0 && (8 * kRow) % 16 == 0, "runs of 8 rows must be whole 16-byte chunks");
  const int run = T < a.block_size ? T : a.block_size;
  const int run_chunks = run * kRow / 16;
  const uint8_t* cache = static_cast<const uint8_t*>(a.kv_cache);
  for (int i = threadIdx.x; i < 2 * kTileChunks; i += blockDim.x) {
    const int kv = i >= kTileChunks ? 1 : 0;
    const int c = i - kv * kTileChunks;
    const int r = c / run_chunks;
    const int byte = (c - r * run_chunks) * 16;  // inside the run
    uint8_t* dst = (kv ? sv : sk) + c * 16;
    const int token = first + r * run;
    int bytes = 0;
    const uint8_t* src = nullptr;
    if (token < end) {
      const int block = block_row[token >> a.block_size_log2];
      if (block_valid(a, block)) {
        const int rows = min(end - token, run);
        bytes = max(0, min(16, rows * kRow - byte));
        const int offset = token & (a.block_size - 1);
        src = cache + kv_head_offset(a, block, kv, kv_head) + static_cast<int64_t>(offset) * kRow + byte;
      }
    }
    if (bytes > 0) {
      cp_async_16_zfill(dst, src, bytes);
    } else {
      *reinterpret_cast<uint4*>(dst) = make_uint4(0u, 0u, 0u, 0u);
    }
  }
}

// The tile loader of the pool element type KvT: rows of D values, or of D codes and a scale.
template <typename KvT, int D, int T>
__device__ __forceinline__ void load_tile(const PagedArgs& a, const int32_t* block_row, int kv_head, int first,
                                          int end, KvT* sk, KvT* sv) {
  if constexpr (KvFormat<KvT>::quantized) {
    load_quant_kv_tile<D, T>(a, block_row, kv_head, first, end, reinterpret_cast<uint8_t*>(sk),
                             reinterpret_cast<uint8_t*>(sv));
  } else {
    load_kv_tile<KvT, D, T>(a, block_row, kv_head, first, end, sk, sv);
  }
}

// N consecutive values of a cached row starting at element `first` as floats, unscaled: a quantized
// row's codes (its scale is applied once per key by the caller, row_scale).
template <typename KvT, int N>
__device__ __forceinline__ void load_row_part(const KvT* row, int first, float (&dst)[N]) {
  if constexpr (KvFormat<KvT>::quantized) {
    load_codes<KvT, N>(reinterpret_cast<const uint8_t*>(row) + first, dst);
  } else {
    load_float<KvT, N>(row + first, dst);
  }
}

}  // namespace cuda
}  // namespace trtpaged
