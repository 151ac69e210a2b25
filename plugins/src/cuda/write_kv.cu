// Step 1 of paged attention: scatter each new token's K and V into its cache slot
// (quantizing each row, with its own scale, for an int8 / fp8_e4m3 pool).
#include <cstdint>

#include "cuda/dispatch.h"
#include "cuda/dtype.cuh"
#include "cuda/head_dims.h"
#include "cuda/kv_codes.cuh"
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

// The cache slot of packed token t: its block id and offset in the block; false when the token has
// no valid slot (no sequence, a negative position, past the block table, or an out-of-range block).
__device__ bool token_slot(const PagedArgs& a, int t, int* block, int* offset) {
  const int s = token_sequence(a, t);
  if (s < 0) return false;
  const int pos = a.positions[t];
  if (pos < 0) return false;
  const int index = pos >> a.block_size_log2;
  if (index >= a.max_blocks_per_seq) return false;
  *block = a.block_tables[static_cast<int64_t>(s) * a.max_blocks_per_seq + index];
  *offset = pos & (a.block_size - 1);
  return block_valid(a, *block);
}

// One CTA per packed token; threads stride over (kv_head, element pair).
template <typename IoT, typename KvT>
__global__ void __launch_bounds__(128) write_kv_kernel(PagedArgs a) {
  const int t = blockIdx.x;
  int block, offset;
  if (!token_slot(a, t, &block, &offset)) return;

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

// Quantized pools: one CTA per packed token, one warp per (K or V, kv head) row. The warp finds the
// row's max |x|, rounds max|x| / code_max to the fp16 scale stored after the codes, and writes each
// code from x / stored scale, exactly as the CPU kernel (quantize_row in cpu/dtype_cpu.h) does: IEEE
// division, round half to even, int8 clamped to +-127, fp8 saturated to +-448. A row holding a NaN gets
// the NaN scale (0x7e00) and zero codes, so it reads back as NaN, as on the CPU.
template <typename IoT, typename CodeT>
__global__ void __launch_bounds__(128) write_kv_quant_kernel(PagedArgs a) {
  constexpr int kPairsPerLane = kMaxHeadDim / 64;  // head_dim / 2 pairs over 32 lanes
  const int t = blockIdx.x;
  int block, offset;
  if (!token_slot(a, t, &block, &offset)) return;

  const int lane = threadIdx.x & 31;
  const int pairs = a.head_dim / 2;
  uint8_t* cache = static_cast<uint8_t*>(a.kv_cache);
  for (int r = threadIdx.x >> 5; r < 2 * a.num_kv_heads; r += blockDim.x >> 5) {
    const int kv = r / a.num_kv_heads;
    const int h = r - kv * a.num_kv_heads;
    const IoT* src = static_cast<const IoT*>(kv ? a.v : a.k) + (static_cast<int64_t>(t) * a.num_kv_heads + h) * a.head_dim;
    float x[kPairsPerLane][2];
    float amax = 0.f;
    bool nan = false;
#pragma unroll
    for (int j = 0; j < kPairsPerLane; ++j) {
      const int i = lane + 32 * j;
      x[j][0] = x[j][1] = 0.f;
      if (i < pairs) load_float<IoT, 2>(src + 2 * i, x[j]);
      amax = fmaxf(amax, fmaxf(fabsf(x[j][0]), fabsf(x[j][1])));  // fmaxf drops a NaN: tracked apart
      nan |= (x[j][0] != x[j][0]) | (x[j][1] != x[j][1]);
    }
#pragma unroll
    for (int o = 16; o > 0; o /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    nan = __any_sync(0xffffffffu, nan);
    const __half stored = nan ? __ushort_as_half(0x7e00)
                              : __float2half_rn(fminf(__fdiv_rn(amax, KvFormat<CodeT>::code_max), 65504.f));
    const float scale = nan ? 0.f : __half2float(stored);  // a zero scale writes zero codes
    uint8_t* row = cache + kv_head_offset(a, block, kv, h) + static_cast<int64_t>(offset) * a.kv_row;
    unsigned short* codes = reinterpret_cast<unsigned short*>(row);  // rows are 2-byte aligned
#pragma unroll
    for (int j = 0; j < kPairsPerLane; ++j) {
      const int i = lane + 32 * j;
      if (i >= pairs) continue;
      const float y0 = scale > 0.f ? __fdiv_rn(x[j][0], scale) : 0.f;
      const float y1 = scale > 0.f ? __fdiv_rn(x[j][1], scale) : 0.f;
      codes[i] = encode_code_pair<CodeT>(y0, y1);
    }
    if (lane == 0) *reinterpret_cast<unsigned short*>(row + a.head_dim) = __half_as_ushort(stored);
  }
}

}  // namespace

cudaError_t launch_write_kv(const PagedArgs& a, trtpaged_dtype io, trtpaged_dtype kv, cudaStream_t stream) {
  if (a.num_tokens <= 0) return cudaSuccess;
  bool io_ok = false;
  bool kv_ok = false;
  io_ok = with_dtype(io, [&](auto io_tag) {
    kv_ok = with_kv_cache_dtype(kv, [&](auto kv_tag) {
      using IoT = typename decltype(io_tag)::type;
      using KvT = typename decltype(kv_tag)::type;
      if constexpr (KvFormat<KvT>::quantized) {
        write_kv_quant_kernel<IoT, KvT><<<a.num_tokens, 128, 0, stream>>>(a);
      } else {
        write_kv_kernel<IoT, KvT><<<a.num_tokens, 128, 0, stream>>>(a);
      }
    });
  });
  if (!io_ok || !kv_ok) return cudaErrorInvalidValue;
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace trtpaged
