// Paged KV addressing and the tile loader shared by the attention kernels.
// Everything read from device index arrays is clamped here: a bad block id or
// position never leads to an access outside the pool or the block table.
#pragma once

#include <cstdint>

#include "cuda/cp_async.cuh"
#include "cuda/paged_args.h"

namespace trtpaged {
namespace cuda {

// Element offset of kv_cache[block][layer][kv][head][0][0].
__device__ __forceinline__ int64_t kv_head_offset(const PagedArgs& a, int block, int kv, int head) {
  const int64_t slab = (static_cast<int64_t>(block) * a.num_layers + a.layer) * 2 + kv;
  return ((slab * a.num_kv_heads + head) * a.block_size) * a.head_dim;
}

__device__ __forceinline__ bool block_valid(const PagedArgs& a, int block) {
  return block >= 0 && block < a.num_blocks;
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

}  // namespace cuda
}  // namespace trtpaged
