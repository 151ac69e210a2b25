// Attention for sequences with two or more new tokens (prefill chunks and
// continuing chunks), any mix with decode sequences in the same batch.
//
// CTA = (work item, KV head x head tile), where a work item is one
// (sequence, tile of query tokens) pair; the kernel finds its pair by scanning
// query_start, so the host needs no per-sequence lengths. The CTA holds 32
// query rows (token, head of the GQA group), four lanes per row, each lane
// owning D/4 elements of q and of the output accumulator in registers. K/V tiles
// stream through smem (cp.async, double buffered); online softmax per row;
// causal mask: a query at position p reads keys at positions <= p. A quantized
// pool's tiles hold the rows as the pool does (codes, then the fp16 scale); codes
// are widened in registers and each key's scale applied once to its score and
// to its softmax weight.
#pragma once

#include <cstdint>

#include "cuda/cp_async.cuh"
#include "cuda/dtype.cuh"
#include "cuda/kv_tile.cuh"
#include "cuda/paged_args.h"

namespace trtpaged {
namespace cuda {

constexpr int kPrefillTileKeys = 16;

// Finds the (sequence, query tile) of work item `target` among sequences with
// q_len >= 2. Run by one full warp; returns false when target is past the end.
__device__ __forceinline__ bool find_prefill_work(const PagedArgs& a, int tokens_per_cta, int64_t target,
                                                  int* seq, int* tile) {
  constexpr int kPerLane = 4;
  const int lane = threadIdx.x & 31;
  int64_t base = 0;
  for (int s0 = 0; s0 < a.num_seqs; s0 += 32 * kPerLane) {
    int64_t n[kPerLane];
    int64_t mine = 0;
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) {
      const int s = s0 + lane * kPerLane + k;
      n[k] = 0;
      if (s < a.num_seqs) {
        int q_len = a.query_start[s + 1] - a.query_start[s];
        q_len = q_len < 0 ? 0 : (q_len > a.num_tokens ? a.num_tokens : q_len);
        if (q_len >= 2) n[k] = (q_len + tokens_per_cta - 1) / tokens_per_cta;
      }
      mine += n[k];
    }
    int64_t incl = mine;
#pragma unroll
    for (int o = 1; o < 32; o *= 2) {
      const int64_t up = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= o) incl += up;
    }
    int64_t lo = base + incl - mine;
    int found = 0;
    if (target >= lo && target < lo + mine) {
#pragma unroll
      for (int k = 0; k < kPerLane; ++k) {
        if (!found && target < lo + n[k]) {
          *seq = s0 + lane * kPerLane + k;
          *tile = static_cast<int>(target - lo);
          found = 1;
        }
        if (!found) lo += n[k];
      }
    }
    const unsigned who = __ballot_sync(0xffffffffu, found);
    if (who != 0u) {
      const int src = __ffs(who) - 1;
      *seq = __shfl_sync(0xffffffffu, *seq, src);
      *tile = __shfl_sync(0xffffffffu, *tile, src);
      return true;
    }
    base += __shfl_sync(0xffffffffu, incl, 31);
  }
  return false;
}

template <int D, typename IoT, typename KvT>
__global__ void __launch_bounds__(kPrefillThreads) prefill_kernel(PagedArgs a, PrefillPlan p) {
  constexpr int TK = kPrefillTileKeys;
  constexpr int kPairs = D / 8;  // each lane owns pairs (8j + 2*lane4, +1), j < D/8
  constexpr int R = kv_row_elems<KvT, D>();  // pool row: D values, or D codes + the scale's 2 bytes
  constexpr bool kQuant = KvFormat<KvT>::quantized;
  constexpr int kStageElems = 2 * TK * R;
  static_assert(D % 8 == 0, "head_dim must be a multiple of 8");
  static_assert(kPrefillThreads == 4 * kPrefillRows, "four lanes per query row");
  __shared__ __align__(16) unsigned char smem[2 * kStageElems * sizeof(KvT)];
  __shared__ int s_seq;
  __shared__ int s_tile;
  __shared__ int s_kv_end;
  __shared__ int s_kv_begin;  // first key any row of the CTA reads (sliding window)

  if (threadIdx.x < 32) {
    int seq = -1;
    int tile = 0;
    if (!find_prefill_work(a, p.tokens_per_cta, blockIdx.x, &seq, &tile)) seq = -1;
    if (threadIdx.x == 0) {
      s_seq = seq;
      s_tile = tile;
      s_kv_end = 0;
      s_kv_begin = 0x7fffffff;
    }
  }
  __syncthreads();
  const int s = s_seq;
  if (s < 0) return;

  const int kv_head = blockIdx.y / p.head_tiles;
  const int head_tile = blockIdx.y - kv_head * p.head_tiles;
  const int lane4 = threadIdx.x & 3;
  const int row = threadIdx.x >> 2;
  const int qi = row / p.heads_per_cta;
  const int g = row - qi * p.heads_per_cta;
  const int group_head = head_tile * p.heads_per_cta + g;
  const int head = kv_head * a.group + group_head;
  const int q_end = min(a.query_start[s + 1], a.num_tokens);
  const int64_t token64 = static_cast<int64_t>(a.query_start[s]) + static_cast<int64_t>(s_tile) * p.tokens_per_cta + qi;
  const bool row_ok = qi < p.tokens_per_cta && group_head < a.group && token64 >= 0 && token64 < q_end;
  const int token = row_ok ? static_cast<int>(token64) : 0;
  const int kv_len = seq_kv_len(a, s);
  const int row_lim = row_ok ? query_kv_len(kv_len, a.positions[token]) : 0;
  const int row_first = row_ok ? query_kv_first(a.positions[token], a.window) : 0;

  float q[2 * kPairs];
  float acc[2 * kPairs];
  const IoT* qp = static_cast<const IoT*>(a.q) + (static_cast<int64_t>(token) * a.num_heads + head) * D;
#pragma unroll
  for (int j = 0; j < kPairs; ++j) {
    float pair[2] = {0.f, 0.f};
    if (row_ok) load_float<IoT, 2>(qp + 8 * j + 2 * lane4, pair);
    q[2 * j] = pair[0] * a.scale_log2;
    q[2 * j + 1] = pair[1] * a.scale_log2;
    acc[2 * j] = 0.f;
    acc[2 * j + 1] = 0.f;
  }
  float m = -INFINITY;
  float l = 0.f;

  if (row_ok && lane4 == 0) {
    atomicMax(&s_kv_end, row_lim);
    atomicMin(&s_kv_begin, row_first);
  }
  __syncthreads();
  const int kv_end = s_kv_end;

  const int32_t* block_row = a.block_tables + static_cast<int64_t>(s) * a.max_blocks_per_seq;
  KvT* stage_base = reinterpret_cast<KvT*>(smem);
  const int num_tiles = (kv_end + TK - 1) / TK;
  const int first_tile = min(num_tiles, s_kv_begin / TK);  // tiles before every row's window are not read

  if (num_tiles > first_tile) {
    KvT* first_stage = stage_base + (first_tile & 1) * kStageElems;
    load_tile<KvT, D, TK>(a, block_row, kv_head, first_tile * TK, kv_end, first_stage, first_stage + TK * R);
  }
  cp_async_commit();
  for (int it = first_tile; it < num_tiles; ++it) {
    if (it + 1 < num_tiles) {
      KvT* next = stage_base + ((it + 1) & 1) * kStageElems;
      load_tile<KvT, D, TK>(a, block_row, kv_head, (it + 1) * TK, kv_end, next, next + TK * R);
    }
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();

    const KvT* sk = stage_base + (it & 1) * kStageElems;
    const KvT* sv = sk + TK * R;
    const int first = it * TK;
    float sc[TK];
#pragma unroll
    for (int t = 0; t < TK; ++t) {
      float dot = 0.f;
#pragma unroll
      for (int j = 0; j < kPairs; ++j) {
        float kf[2];
        load_row_part<KvT, 2>(sk + t * R, 8 * j + 2 * lane4, kf);
        dot = fmaf(q[2 * j], kf[0], dot);
        dot = fmaf(q[2 * j + 1], kf[1], dot);
      }
      dot += __shfl_xor_sync(0xffffffffu, dot, 1);
      dot += __shfl_xor_sync(0xffffffffu, dot, 2);
      if constexpr (kQuant) dot *= row_scale<D>(reinterpret_cast<const uint8_t*>(sk + t * R));
      sc[t] = first + t < row_lim && first + t >= row_first ? soft_cap(dot, a.softcap_log2) : -INFINITY;
    }
    float mx = sc[0];
#pragma unroll
    for (int t = 1; t < TK; ++t) mx = fmaxf(mx, sc[t]);
    const float m_new = fmaxf(m, mx);
    if (m_new != -INFINITY) {  // uniform across the row's four lanes
      const float alpha = exp2f(m - m_new);
      l *= alpha;
#pragma unroll
      for (int e = 0; e < 2 * kPairs; ++e) acc[e] *= alpha;
#pragma unroll
      for (int t = 0; t < TK; ++t) {
        const float pr = exp2f(sc[t] - m_new);
        l += pr;
        float w = pr;
        if constexpr (kQuant) w *= row_scale<D>(reinterpret_cast<const uint8_t*>(sv + t * R));
#pragma unroll
        for (int j = 0; j < kPairs; ++j) {
          float vf[2];
          load_row_part<KvT, 2>(sv + t * R, 8 * j + 2 * lane4, vf);
          acc[2 * j] = fmaf(w, vf[0], acc[2 * j]);
          acc[2 * j + 1] = fmaf(w, vf[1], acc[2 * j + 1]);
        }
      }
      m = m_new;
    }
    __syncthreads();
  }
  cp_async_wait<0>();

  if (!row_ok) return;
  const float inv = l > 0.f ? 1.f / l : 0.f;
  IoT* op = static_cast<IoT*>(a.out) + (static_cast<int64_t>(token) * a.num_heads + head) * D;
#pragma unroll
  for (int j = 0; j < kPairs; ++j) {
    const float pair[2] = {acc[2 * j] * inv, acc[2 * j + 1] * inv};
    store_float<IoT, 2>(op + 8 * j + 2 * lane4, pair);
  }
}

}  // namespace cuda
}  // namespace trtpaged
