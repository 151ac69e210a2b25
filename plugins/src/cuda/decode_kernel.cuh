// Split-K decode attention for sequences with exactly one new token.
//
// CTA = (sequence, KV head x head tile, KV split). Threads form rows of
// kDecodeLanes lanes; row = (query head g of the GQA group, token lane z). All
// heads of the group share one smem copy of each K/V tile (GQA: K/V are read
// from memory once per group). Each row runs its own online softmax over the
// keys it owns; rows are merged through smem at the end. The result is written
// straight to `out` when the sequence needs one split, else as a partial
// (unnormalised output, max, sum) that decode_reduce_kernel merges.
//
// A quantized pool (int8, fp8_e4m3) is read as codes: the smem tile holds the rows as the pool does
// (D codes, then the fp16 scale), each lane widens its codes in registers, and the row's scale is
// applied once per key: score = scale_k * (q . codes_k), acc += (p * scale_v) * codes_v.
#pragma once

#include <cstdint>

#include "cuda/cp_async.cuh"
#include "cuda/dtype.cuh"
#include "cuda/kv_tile.cuh"
#include "cuda/paged_args.h"

namespace trtpaged {
namespace cuda {

// Tokens per smem tile: about 8 KB of K (and as much of V) per stage (a quantized row's scale counted).
template <int D, typename KvT>
struct DecodeTile {
  static constexpr int kRowBytes = kv_row_elems<KvT, D>() * static_cast<int>(sizeof(KvT));
  static constexpr int tokens = kRowBytes <= 128 ? 64 : (kRowBytes <= 256 ? 32 : 16);
};

// Number of splits actually used by a sequence whose query reads kv_len keys.
__device__ __forceinline__ int decode_used_splits(int kv_len, int split_len) {
  return kv_len > 0 ? (kv_len + split_len - 1) / split_len : 1;
}

// Sequence s is a decode sequence iff it has exactly one token; returns that token or -1.
__device__ __forceinline__ int decode_token(const PagedArgs& a, int s) {
  const int q0 = a.query_start[s];
  const int q1 = a.query_start[s + 1];
  if (q1 - q0 != 1 || q0 < 0 || q0 >= a.num_tokens) return -1;
  return q0;
}

template <int D, typename IoT, typename KvT>
__global__ void __launch_bounds__(kDecodeMaxThreads, 2) decode_kernel(PagedArgs a, DecodePlan p) {
  constexpr int E = D / kDecodeLanes;  // elements of a row owned by one lane
  constexpr int T = DecodeTile<D, KvT>::tokens;
  constexpr int R = kv_row_elems<KvT, D>();  // pool row: D values, or D codes + the scale's 2 bytes
  constexpr bool kQuant = KvFormat<KvT>::quantized;
  constexpr int kStageElems = 2 * T * R;  // K tile then V tile
  constexpr int kSmemBytes = 2 * kStageElems * static_cast<int>(sizeof(KvT));
  constexpr int kMaxRows = kDecodeMaxThreads / kDecodeLanes;
  static_assert(D % (2 * kDecodeLanes) == 0, "head_dim must be a multiple of 16");
  static_assert(kMaxRows * (D + 2) * static_cast<int>(sizeof(float)) <= kSmemBytes,
                "the row merge reuses the tile buffers");
  __shared__ __align__(16) unsigned char smem[kSmemBytes];

  const int s = blockIdx.x;
  const int token = decode_token(a, s);
  if (token < 0) return;
  const int kv_len = query_kv_len(seq_kv_len(a, s), a.positions[token]);
  const int used_splits = decode_used_splits(kv_len, p.split_len);
  const int split = blockIdx.z;
  if (split >= used_splits) return;
  const int begin = split * p.split_len;
  const int end = min(kv_len, begin + p.split_len);  // begin < end unless kv_len == 0

  const int kv_head = blockIdx.y / p.head_tiles;
  const int head_tile = blockIdx.y - kv_head * p.head_tiles;
  const int lane = threadIdx.x % kDecodeLanes;
  const int row = threadIdx.x / kDecodeLanes;
  const int g = row % p.heads_per_cta;
  const int z = row / p.heads_per_cta;
  const int group_head = head_tile * p.heads_per_cta + g;
  const int head = kv_head * a.group + group_head;
  // The kDecodeLanes lanes of this row, for shuffles that other rows may not reach.
  const unsigned row_mask = ((1u << kDecodeLanes) - 1u) << (threadIdx.x & 31 & ~(kDecodeLanes - 1));

  float q[E];
  if (group_head < a.group) {
    const IoT* qp = static_cast<const IoT*>(a.q) + (static_cast<int64_t>(token) * a.num_heads + head) * D;
    load_float<IoT, E>(qp + lane * E, q);
#pragma unroll
    for (int e = 0; e < E; ++e) q[e] *= a.scale_log2;
  } else {
#pragma unroll
    for (int e = 0; e < E; ++e) q[e] = 0.f;
  }
  float acc[E];
#pragma unroll
  for (int e = 0; e < E; ++e) acc[e] = 0.f;
  float m = -INFINITY;
  float l = 0.f;

  const int32_t* block_row = a.block_tables + static_cast<int64_t>(s) * a.max_blocks_per_seq;
  KvT* stage_base = reinterpret_cast<KvT*>(smem);
  const int num_tiles = (end - begin + T - 1) / T;
  // a sliding window: tiles wholly before the query's first key are not read
  const int lo = query_kv_first(a.positions[token], a.window);
  const int first_tile = lo > begin ? min(num_tiles, (lo - begin) / T) : 0;

  if (num_tiles > first_tile) {
    KvT* first_stage = stage_base + (first_tile & 1) * kStageElems;
    load_tile<KvT, D, T>(a, block_row, kv_head, begin + first_tile * T, end, first_stage, first_stage + T * R);
  }
  cp_async_commit();
  for (int it = first_tile; it < num_tiles; ++it) {
    if (it + 1 < num_tiles) {
      KvT* next = stage_base + ((it + 1) & 1) * kStageElems;
      load_tile<KvT, D, T>(a, block_row, kv_head, begin + (it + 1) * T, end, next, next + T * R);
    }
    cp_async_commit();
    cp_async_wait<1>();  // tile `it` has landed (only the group just committed may be pending)
    __syncthreads();

    const KvT* sk = stage_base + (it & 1) * kStageElems;
    const KvT* sv = sk + T * R;
    const int valid = min(T, end - (begin + it * T));
    const int chunks = (valid + 3) / 4;
    for (int c = z; c < chunks; c += p.rows_z) {
      float sc[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const KvT* key = sk + (c * 4 + i) * R;
        float kf[E];
        load_row_part<KvT, E>(key, lane * E, kf);
        float dot = 0.f;
#pragma unroll
        for (int e = 0; e < E; ++e) dot = fmaf(q[e], kf[e], dot);
#pragma unroll
        for (int o = kDecodeLanes / 2; o > 0; o /= 2) dot += __shfl_xor_sync(row_mask, dot, o);
        if constexpr (kQuant) dot *= row_scale<D>(reinterpret_cast<const uint8_t*>(key));
        const int key_pos = begin + it * T + c * 4 + i;
        sc[i] = c * 4 + i < valid && key_pos >= lo ? soft_cap(dot, a.softcap_log2) : -INFINITY;
      }
      const float m_new = fmaxf(m, fmaxf(fmaxf(sc[0], sc[1]), fmaxf(sc[2], sc[3])));
      if (m_new == -INFINITY) continue;  // same value on every lane of the row
      const float alpha = exp2f(m - m_new);
      l *= alpha;
#pragma unroll
      for (int e = 0; e < E; ++e) acc[e] *= alpha;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float pr = exp2f(sc[i] - m_new);
        l += pr;
        const KvT* value = sv + (c * 4 + i) * R;
        float vf[E];
        load_row_part<KvT, E>(value, lane * E, vf);
        float w = pr;
        if constexpr (kQuant) w *= row_scale<D>(reinterpret_cast<const uint8_t*>(value));
#pragma unroll
        for (int e = 0; e < E; ++e) acc[e] = fmaf(w, vf[e], acc[e]);
      }
      m = m_new;
    }
    __syncthreads();  // everyone is done with this stage before it is refilled
  }
  cp_async_wait<0>();
  __syncthreads();

  // Merge the token rows of each head: red_o[row][D], red_m[row], red_l[row].
  const int rows = p.heads_per_cta * p.rows_z;
  float* red_o = reinterpret_cast<float*>(smem);
  float* red_m = red_o + rows * D;
  float* red_l = red_m + rows;
#pragma unroll
  for (int e = 0; e < E; ++e) red_o[row * D + lane * E + e] = acc[e];
  if (lane == 0) {
    red_m[row] = m;
    red_l[row] = l;
  }
  __syncthreads();

  for (int idx = threadIdx.x; idx < p.heads_per_cta * D; idx += blockDim.x) {
    const int hg = idx / D;
    const int d = idx - hg * D;
    const int gh = head_tile * p.heads_per_cta + hg;
    if (gh >= a.group) continue;
    float mx = -INFINITY;
    for (int zz = 0; zz < p.rows_z; ++zz) mx = fmaxf(mx, red_m[zz * p.heads_per_cta + hg]);
    float sum = 0.f;
    float o = 0.f;
    if (mx != -INFINITY) {
      for (int zz = 0; zz < p.rows_z; ++zz) {
        const int r = zz * p.heads_per_cta + hg;
        const float w = exp2f(red_m[r] - mx);
        sum += w * red_l[r];
        o += w * red_o[r * D + d];
      }
    }
    const int h = kv_head * a.group + gh;
    if (used_splits == 1) {
      IoT* out = static_cast<IoT*>(a.out) + (static_cast<int64_t>(token) * a.num_heads + h) * D;
      out[d] = from_float<IoT>(sum > 0.f ? o / sum : 0.f);
    } else {
      const int64_t slot = (static_cast<int64_t>(s) * a.num_heads + h) * p.num_splits + split;
      p.partial_o[slot * D + d] = o;
      if (d == 0) {
        p.partial_ml[slot * 2] = mx;
        p.partial_ml[slot * 2 + 1] = sum;
      }
    }
  }
}

// Merges the split partials of every decode sequence that used more than one split.
// Grid (num_seqs, num_heads); threads stride over head_dim.
template <typename IoT>
__global__ void __launch_bounds__(128) decode_reduce_kernel(PagedArgs a, DecodePlan p) {
  const int s = blockIdx.x;
  const int h = blockIdx.y;
  const int token = decode_token(a, s);
  if (token < 0) return;
  const int kv_len = query_kv_len(seq_kv_len(a, s), a.positions[token]);
  const int used = decode_used_splits(kv_len, p.split_len);
  if (used <= 1) return;  // the decode kernel wrote this sequence directly
  const int64_t first = (static_cast<int64_t>(s) * a.num_heads + h) * p.num_splits;
  float mx = -INFINITY;
  for (int i = 0; i < used; ++i) mx = fmaxf(mx, p.partial_ml[(first + i) * 2]);
  IoT* out = static_cast<IoT*>(a.out) + (static_cast<int64_t>(token) * a.num_heads + h) * a.head_dim;
  for (int d = threadIdx.x; d < a.head_dim; d += blockDim.x) {
    float sum = 0.f;
    float o = 0.f;
    if (mx != -INFINITY) {
      for (int i = 0; i < used; ++i) {
        const float w = exp2f(p.partial_ml[(first + i) * 2] - mx);
        sum += w * p.partial_ml[(first + i) * 2 + 1];
        o += w * p.partial_o[(first + i) * a.head_dim + d];
      }
    }
    out[d] = from_float<IoT>(sum > 0.f ? o / sum : 0.f);
  }
}

}  // namespace cuda
}  // namespace trtpaged
