// Step 1 of paged attention: scatter each new token's K and V into its cache slot.
#include <cstdint>

#include "cuda/dispatch.h"
#include "cuda/dtype.cuh"
#include "cuda/kv_tile.cuh"
#include "cuda/launch.h"

namespace trtpaged {
namespace cuda {
namespace {

// Sequence owning packed token t (largest s with query_start[s] <= t), or -1.
__device__ int token_sequence(const PagedArgs& a, int t) {
  if (a.query_start[0] > t) return -1;
  int lo = 0;
  int hi = a.num_seqs - 1;
  while (lo < hi) {
    const int mid = lo + (hi - lo + 1) / 2;
    if (a.query_start[mid] <= t) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return t < a.query_start[lo + 1] ? lo : -1;
}

// One CTA per packed token; threads stride over (kv_head, element pair).
template <typename IoT, typename KvT>
__global__ void __launch_bounds__(128) write_kv_kernel(PagedArgs a) {
  const int t = blockIdx.x;
  const int s = token_sequence(a, t);
  if (s < 0) return;
  const int pos = a.positions[t];
  if (pos < 0) return;
  const int index = pos >> a.block_size_log2;
  if (index >= a.max_blocks_per_seq) return;
  const int block = a.block_tables[static_cast<int64_t>(s) * a.max_blocks_per_seq + index];
  if (!block_valid(a, block)) return;
  const int offset = pos & (a.block_size - 1);

  const int pairs = a.num_kv_heads * a.head_dim / 2;
  const int64_t src_base = static_cast<int64_t>(t) * a.num_kv_heads * a.head_dim;
  const IoT* k = static_cast<const IoT*>(a.k) + src_base;
  const IoT* v = static_cast<const IoT*>(a.v) + src_base;
  KvT* cache = static_cast<KvT*>(a.kv_cache);
  for (int i = threadIdx.x; i < pairs; i += blockDim.x) {
    const int h = (2 * i) / a.head_dim;
    const int d = 2 * i - h * a.head_dim;
    const int64_t slot = static_cast<int64_t>(offset) * a.head_dim + d;
    float x[2];
    load_float<IoT, 2>(k + 2 * i, x);
    store_float<KvT, 2>(cache + kv_head_offset(a, block, 0, h) + slot, x);
    load_float<IoT, 2>(v + 2 * i, x);
    store_float<KvT, 2>(cache + kv_head_offset(a, block, 1, h) + slot, x);
  }
}

}  // namespace

cudaError_t launch_write_kv(const PagedArgs& a, trtpaged_dtype io, trtpaged_dtype kv, cudaStream_t stream) {
  if (a.num_tokens <= 0) return cudaSuccess;
  bool io_ok = false;
  bool kv_ok = false;
  io_ok = with_dtype(io, [&](auto io_tag) {
    kv_ok = with_dtype(kv, [&](auto kv_tag) {
      using IoT = typename decltype(io_tag)::type;
      using KvT = typename decltype(kv_tag)::type;
      write_kv_kernel<IoT, KvT><<<a.num_tokens, 128, 0, stream>>>(a);
    });
  });
  if (!io_ok || !kv_ok) return cudaErrorInvalidValue;
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace trtpaged
