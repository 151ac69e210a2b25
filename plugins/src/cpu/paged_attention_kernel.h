// The CPU paged attention: write the step's K/V into the block-major pool, then
// causal attention of each query token over its sequence's cached tokens.
//
// This header is the kernel's whole body and is compiled once per instruction set, by
// paged_attention_{scalar,avx2,avx512}.cpp, each with its own -march (CMakeLists.txt);
// paged_attention_cpu.cpp checks the call and runs the copy of the ISA in use (cpu/isa.h).
// Everything here has internal linkage, and the headers below live in a namespace named for
// the target, so no copy built for one ISA can be linked into another's path.
//
// Work is split into tasks (sequence, kv heads, chunk of query tokens, range of
// keys) run by OpenMP threads. Each task streams its keys block by block with
// an online softmax, so a block is converted to fp32 once and read by all the
// query heads of its GQA group. A task takes all the KV heads of its sequence whenever
// that leaves every thread two tasks: it then reads each block's K and V of every head
// (one contiguous run per block and layer) tile by tile, instead of one head's slice
// of every block, a few KiB apart. Contexts longer than kSplitKeys are split over key
// ranges of a fixed grid and merged afterwards (flash-decoding on the CPU), so every
// core works on batch-1 decode too, and a row's splits are the same in every call.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu/attention_tiles.h"
#include "cpu/dtype_cpu.h"
#include "cpu/paged_attention_paths.h"

namespace trtpaged::cpu {
namespace {

constexpr int kQueryChunk = 16;        // query tokens per task
// Key ranges are split over tasks on a fixed grid of this many keys (whole tiles), counted from key 0, in
// every call: a row's keys fall into the same splits whatever rows and sequences share the call, so its
// result does not depend on them (a speculative verification step gives each row the bits of a decode step).
constexpr int kSplitKeys = 512;
constexpr int kTileKeys = 256;  // keys per online-softmax update
// Block-major tiles (a decode task of every KV head, blocks shorter than a tile): the loops read a block's K of
// every head (one contiguous run of the pool), block after block, and then its V, and request the block this many
// keys further on (whole blocks, at least one) in the thread's stream of tiles. One block ahead (16 keys) measured
// best; two to four blocks, or a whole tile, less well (docs/benchmarks.md, "Round 40").
constexpr int kPrefetchKeys = 16;
// Calls whose step reads more K and V than this (the call's keys times the pool's layers: a model's step calls each
// layer in turn, so a layer's keys are read back from memory once all layers' outgrow the last-level cache) read
// decode tiles block-major and spread their requests (NextBlocks::spread). Where the keys stay in the cache, as
// when one layer is called again and again, the block-major loops' more calls (one a block and head, not one a
// tile and head) cost more than the requests gain (contexts of 128-256 x 32 sequences measured 5-8% slower); from
// memory they gain (Rounds 40, 41). 32 MiB: the L3 of the AMD machines measured (sysconf reports a VM host's).
constexpr int64_t kBlockMajorBytes = int64_t(32) << 20;
constexpr int kMaxKv = 16;  // KV heads of a block-major task, at most
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

int num_threads() {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

// Element offsets into the block-major pool [blocks][layers][2][kv_heads][block_size][row], where
// a row is head_dim values, or for a quantized cache head_dim one-byte codes and an fp16 scale.
struct PoolLayout {
  int64_t num_layers, num_kv_heads, block_size, head_dim, row;
  int64_t head_elems() const { return block_size * row; }
  int64_t offset(int64_t block, int64_t layer, int kv, int64_t head) const {
    return (((block * num_layers + layer) * 2 + kv) * num_kv_heads + head) * head_elems();
  }
};

struct Task {
  int32_t seq, kv_head, num_kv;  // kv heads [kv_head, kv_head + num_kv)
  int32_t q_begin, q_end;  // packed token range
  int32_t k_begin, k_end;  // key positions [k_begin, k_end)
  int32_t split, num_splits;
  int64_t partial;  // first row of this task's partial results in `partials`, -1 when unsplit
};

template <typename IO, typename KV>
void write_kv(const trtpaged_attention_params& p, const PoolLayout& pool, const IO* k, const IO* v, KV* cache,
              const int32_t* positions, const int32_t* query_start, const int32_t* block_tables) {
  const int64_t d = p.head_dim;
#pragma omp parallel for schedule(static)
  for (int32_t s = 0; s < p.num_seqs; ++s) {
    float buf[kMaxHeadDim];
    for (int32_t t = query_start[s]; t < query_start[s + 1]; ++t) {
      const int32_t pos = positions[t];
      const int64_t block = block_tables[int64_t(s) * p.max_blocks_per_seq + pos / p.block_size];
      const int64_t slot = int64_t(pos % p.block_size) * pool.row;
      for (int32_t h = 0; h < p.num_kv_heads; ++h) {
        const IO* ks = k + (int64_t(t) * p.num_kv_heads + h) * d;
        const IO* vs = v + (int64_t(t) * p.num_kv_heads + h) * d;
        KV* kd = cache + pool.offset(block, p.layer, 0, h) + slot;
        KV* vd = cache + pool.offset(block, p.layer, 1, h) + slot;
        if constexpr (is_quantized_v<KV>) {  // one scale per token row: written once, never re-quantized
          quantize_row(ks, d, kd, buf);
          quantize_row(vs, d, vd, buf);
        } else {
          for (int64_t i = 0; i < d; ++i) {
            store(kd[i], to_float(ks[i]));
            store(vd[i], to_float(vs[i]));
          }
        }
      }
    }
  }
}

// Keys per tile (one online-softmax update): whole blocks when blocks are small, and slices of a block
// when blocks are large (a multiple of kTileKeys), so that every layout streams the same tile size.
int64_t tile_keys_of(int64_t block_size) {
  return block_size < kTileKeys ? kTileKeys / block_size * block_size
                                : (block_size % kTileKeys == 0 ? kTileKeys : block_size);
}

// The tasks of a call, each of `heads_per_task` KV heads (1 or all of them).
std::vector<Task> plan_tasks_of(const trtpaged_attention_params& p, int32_t window, const int32_t* positions,
                                const int32_t* query_start, int32_t heads_per_task, int64_t* num_partials) {
  const int32_t group = p.num_heads / p.num_kv_heads;
  std::vector<Task> tasks;
  // A window's first key is rounded down to a whole run (a block, or a tile of a large block); split
  // ranges are whole tiles, the same keys in every layout, so that the contiguous and paged layouts run
  // the same tasks
  const int32_t unit = p.block_size < kTileKeys ? p.block_size
                                                : (p.block_size % kTileKeys == 0 ? kTileKeys : p.block_size);
  const int64_t split_unit = tile_keys_of(p.block_size);
  const int32_t grid = int32_t((kSplitKeys + split_unit - 1) / split_unit * split_unit);
  *num_partials = 0;
  for (int32_t s = 0; s < p.num_seqs; ++s) {
    for (int32_t q0 = query_start[s]; q0 < query_start[s + 1]; q0 += kQueryChunk) {
      const int32_t q1 = std::min(q0 + kQueryChunk, query_start[s + 1]);
      int32_t max_pos = 0, min_pos = positions[q0];
      for (int32_t t = q0; t < q1; ++t) {
        max_pos = std::max(max_pos, positions[t]);
        min_pos = std::min(min_pos, positions[t]);
      }
      // a sliding window skips the whole blocks before the first key any query of the chunk reads
      const int32_t first_key = window > 0 ? std::max(0, min_pos - window + 1) : 0;
      const int32_t first = first_key / unit * unit;
      const int32_t end = max_pos + 1;
      const int32_t first_cell = first / grid;
      const int32_t splits = (end - 1) / grid - first_cell + 1;
      for (int32_t h = 0; h < p.num_kv_heads; h += heads_per_task) {
        for (int32_t i = 0; i < splits; ++i) {
          Task task{s, h, heads_per_task, q0, q1, std::max(first, (first_cell + i) * grid),
                    std::min(end, (first_cell + i + 1) * grid), i, splits, -1};
          if (splits > 1) {  // its rows of partials follow the previous split task's
            task.partial = *num_partials;
            *num_partials += int64_t(q1 - q0) * group * heads_per_task;
          }
          tasks.push_back(task);
        }
      }
    }
  }
  return tasks;
}

// A task takes all of a sequence's KV heads whenever that still gives each thread two tasks (with the key-range
// splits of the fixed grid): a block's K and V of every head are then one contiguous run
// (24 KiB for SmolLM2-like fp32 heads) read within one tile, where a task of one head reads a 4 KiB slice of
// each block, and scattered 4 KiB runs read from DRAM at about 0.75x of 24 KiB runs' rate on one core here
// (docs/benchmarks.md). Else (short prompts and contexts of one or two sequences), one head per task.
std::vector<Task> plan_tasks(const trtpaged_attention_params& p, int32_t window, const int32_t* positions,
                             const int32_t* query_start, int64_t* num_partials) {
  std::vector<Task> all_heads = plan_tasks_of(p, window, positions, query_start, p.num_kv_heads, num_partials);
  if (p.num_kv_heads == 1 || int64_t(all_heads.size()) >= 2 * int64_t(num_threads())) return all_heads;
  return plan_tasks_of(p, window, positions, query_start, 1, num_partials);
}

// The fused loops' reader for a cache element type, and whether those loops cover it on this build
// (other types are converted tile by tile into fp32 scratch first).
template <typename KV>
using RowCodec = std::conditional_t<
    std::is_same_v<KV, float>, FloatRows,
    std::conditional_t<std::is_same_v<KV, half_t>, HalfRows,
                       std::conditional_t<std::is_same_v<KV, bfloat_t>, BfloatRows,
                                          std::conditional_t<std::is_same_v<KV, fp8_code>, Fp8Rows, Int8Rows>>>>;
template <typename KV>
constexpr bool kFusedRows = std::is_same_v<KV, float> || std::is_same_v<KV, int8_code> ||
                            (std::is_same_v<KV, fp8_code> && kFusedFp8) ||
                            ((std::is_same_v<KV, half_t> || std::is_same_v<KV, bfloat_t>) && kFused16);

// Per-thread scratch, reused across tasks.
struct Scratch {
  std::vector<float> q, acc, m, l, scores, kf, vf;
  std::vector<int32_t> pos;
  std::vector<const float*> kp, vp;
  std::vector<const uint8_t*> kc, vc;  // rows read in place by the fused loops
  std::vector<const void*> knext, vnext;
  std::vector<const void*> base, next_base;  // a tile's runs: K rows of the task's first KV head
};

// Returns `rows` cached rows of d values as floats: src itself for fp32, else converted (or
// de-quantized with each row's scale) into buf, one tile at a time inside the key loop.
template <typename T>
const float* as_float(const T* src, int64_t rows, int64_t d, float* buf) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else if constexpr (is_quantized_v<T>) {
    dequantize_rows(src, rows, d, buf);
    return buf;
  } else {
    convert_to_float(src, rows * d, buf);
    return buf;
  }
}

// Runs one task. Keys are processed in tiles of whole blocks (about kTileKeys keys): the
// scores of a tile are computed block by block, then one online-softmax update per tile,
// so small blocks cost no more softmax bookkeeping than one large contiguous block. A task of
// several KV heads runs each tile for every head in turn (the tile's blocks hold all of them).
// Writes the normalised output, or for a split task its partial (acc, max, sum) into
// `partials` rows of head_dim + 2 floats.
//
// The thread reads its keys as one stream: what it requests ahead of the loops may lie in its next task, which it
// claims (claim()) into `next` as the requests reach it, so that it streams its keys without a stall at task
// boundaries; the caller runs `next` after this one. `prefetched` says an earlier task requested this one's first
// tile.
template <typename IO, typename KV, typename Claim>
void run_task(const Task& task, const trtpaged_attention_params& p, const trtpaged_attention_options& opt,
                     const PoolLayout& pool, const IO* q, const KV* cache, const int32_t* positions,
                     const int32_t* block_tables, IO* out, float* partials, Scratch& sc, Claim&& claim,
                     const Task*& next, bool prefetched, bool from_memory) {
  const int32_t group = p.num_heads / p.num_kv_heads;
  const int64_t d = p.head_dim, bs = p.block_size;
  const int64_t tile_keys = tile_keys_of(bs);
  const int64_t run = std::min(bs, tile_keys);  // contiguous keys behind one pointer
  const int64_t tile_blocks = tile_keys / run;
  const int32_t head_rows = (task.q_end - task.q_begin) * group;  // rows of one KV head
  const int32_t rows = head_rows * task.num_kv;                    // row r: kv head r / head_rows
  sc.q.resize(size_t(rows * d));
  sc.acc.assign(size_t(rows * d), 0.0f);
  sc.m.assign(size_t(rows), kNegInf);
  sc.l.assign(size_t(rows), 0.0f);
  sc.pos.resize(size_t(rows));
  sc.scores.resize(size_t(kRowGroup * tile_keys * task.num_kv));
  sc.kp.resize(size_t(tile_blocks));
  sc.vp.resize(size_t(tile_blocks));
  using Codec = RowCodec<KV>;
  constexpr bool kFusable = kFusedRows<KV>;
  constexpr int kElem = is_quantized_v<KV> ? 1 : int(sizeof(KV));
  const bool fused = kFusable && fused_head_dim(d);
  sc.kc.resize(size_t(tile_blocks));
  sc.vc.resize(size_t(tile_blocks));
  sc.base.resize(size_t(tile_blocks));
  sc.knext.resize(size_t(tile_blocks));
  sc.vnext.resize(size_t(tile_blocks));
  sc.next_base.resize(size_t(tile_blocks));
  if (!std::is_same_v<KV, float>) {
    sc.kf.resize(size_t(tile_keys * d));
    sc.vf.resize(size_t(tile_keys * d));
  }
  for (int32_t r = 0; r < rows; ++r) {
    const int32_t t = task.q_begin + (r % head_rows) / group;
    const int32_t head = (task.kv_head + r / head_rows) * group + r % group;
    const IO* src = q + (int64_t(t) * p.num_heads + head) * d;
    float* dst = sc.q.data() + r * d;
    for (int64_t i = 0; i < d; ++i) dst[i] = to_float(src[i]) * p.scale;
    sc.pos[size_t(r)] = positions[t];
  }
  // A key's row of K in the task's first KV head; that head's V and the other heads' K and V are at
  // fixed distances from it in the block (PoolLayout).
  auto key_ptr_of = [&](const Task& of, int64_t key) {
    const int32_t* table = block_tables + int64_t(of.seq) * p.max_blocks_per_seq;
    return cache + pool.offset(table[key / bs], p.layer, 0, of.kv_head) + (key % bs) * pool.row;
  };
  const int64_t head_step = pool.head_elems(), v_step = p.num_kv_heads * pool.head_elems();
  const int64_t row_bytes = pool.row * int64_t(sizeof(KV));
  // The thread's keys as a stream of units of `unit_keys` keys (blocks or tiles; they divide a tile): this task's
  // from its unit at `key`, then its next task's from its first key. The unit `ahead` units after the one at
  // `key`: its first key in *at and its task, claiming the next task as the stream reaches it; nullptr when none
  // is left (or the unit lies beyond the next task, which a request of one tile or a few blocks never reaches).
  auto stream_at = [&](int64_t unit_keys, int64_t key, int64_t ahead, int64_t* at) -> const Task* {
    const int64_t here = (task.k_end - key + unit_keys - 1) / unit_keys;  // this task's units from `key`
    if (ahead < here) return *at = key + ahead * unit_keys, &task;
    if (next == nullptr) next = claim();
    ahead -= here;
    if (next == nullptr || ahead >= (next->k_end - next->k_begin + unit_keys - 1) / unit_keys) return nullptr;
    return *at = next->k_begin + ahead * unit_keys, next;
  };
  // Requests all of a tile's runs at once, so that they are fetched in parallel rather than one
  // demand miss after another.
  auto burst = [&](const Task& of, int64_t t0) {
    const int64_t n_keys = std::min<int64_t>(tile_keys, of.k_end - t0);
    for (int64_t b = 0; b * run < n_keys; ++b) {
      const int64_t bytes = std::min<int64_t>(run, n_keys - b * run) * row_bytes;
      const KV* k0 = key_ptr_of(of, t0 + b * run);
      for (int32_t h = 0; h < of.num_kv; ++h) {
        prefetch_bytes(k0 + h * head_step, bytes);
        prefetch_bytes(k0 + h * head_step + v_step, bytes);
      }
    }
  };
  // One online-softmax update of rows [r0, r0 + nr) over a tile's scores (rows tile_keys apart).
  auto softmax_group = [&](int32_t r0, int nr, float* scores, const int64_t* limits, const int64_t* firsts,
                           int64_t group_limit) {
    for (int i = 0; i < nr; ++i) {
      float* row = scores + i * tile_keys;
      const int64_t limit = limits[i], first = firsts[i];
      if (opt.logit_softcap > 0.0f) {
        const float cap = opt.logit_softcap, inv_cap = 1.0f / opt.logit_softcap;
        for (int64_t j = first; j < limit; ++j) row[j] = cap * std::tanh(row[j] * inv_cap);
      }
      const float tile_max = max_of(row + first, limit - first);
      float& m = sc.m[size_t(r0 + i)];
      const float m_new = std::max(m, tile_max);
      const float alpha = (m == kNegInf || limit == 0) ? (limit == 0 ? 1.0f : 0.0f) : std::exp(m - m_new);
      const float sum = exp_shifted_row(row, first, limit, group_limit, m_new);
      if (limit == 0) continue;
      sc.l[size_t(r0 + i)] = sc.l[size_t(r0 + i)] * alpha + sum;
      if (alpha != 1.0f) {
        float* acc = sc.acc.data() + (r0 + i) * d;
#pragma omp simd
        for (int64_t k = 0; k < d; ++k) acc[k] *= alpha;
      }
      m = m_new;
    }
  };
  const bool block_major = from_memory && fused && task.num_kv > 1 && task.num_kv <= kMaxKv &&
                           head_rows <= kRowGroup && run < tile_keys;
  const int64_t prefetch_blocks = std::max<int64_t>(1, kPrefetchKeys / run);
  for (int64_t tile = task.k_begin; tile < task.k_end; tile += tile_keys) {
    const int64_t tile_n = std::min<int64_t>(tile_keys, task.k_end - tile);
    const int64_t nblocks = (tile_n + run - 1) / run;
    for (int64_t b = 0; b < nblocks; ++b) sc.base[size_t(b)] = key_ptr_of(task, tile + b * run);
    if (tile == task.k_begin && !prefetched) {
      // Nothing prefetched the stream's first tiles (the thread's first task)
      burst(task, tile);
    }
    // every task of a call has the same heads (plan_tasks), so the next task's head h follows this one's
    auto run_of = [&](const std::vector<const void*>& bases, int64_t b, int32_t h, int kv) {
      return static_cast<const KV*>(bases[size_t(b)]) + h * head_step + kv * v_step;
    };
    if (block_major) {
      // Each block's K of every head (one contiguous run), block by block, then each head's softmax, then
      // each block's V of every head: the reads go through a block's runs in address order.
      int64_t limits[kMaxKv][kRowGroup], firsts[kMaxKv][kRowGroup], glimit[kMaxKv];
      for (int32_t h = 0; h < task.num_kv; ++h) {
        glimit[h] = 0;
        for (int i = 0; i < head_rows; ++i) {
          const int64_t pos = sc.pos[size_t(h * head_rows + i)];
          limits[h][i] = std::clamp<int64_t>(pos - tile + 1, 0, tile_n);
          firsts[h][i] =
              opt.sliding_window > 0 ? std::clamp<int64_t>(pos - opt.sliding_window + 1 - tile, 0, tile_n) : 0;
          if (firsts[h][i] >= limits[h][i]) firsts[h][i] = limits[h][i] = 0;
          glimit[h] = std::max(glimit[h], limits[h][i]);
        }
      }
      auto next_block = [&](int64_t b, int64_t* nrows) -> const KV* {
        int64_t at = 0;
        const Task* of = stream_at(run, tile + b * run, prefetch_blocks, &at);
        *nrows = of ? std::clamp<int64_t>(of->k_end - at, 0, run) : 0;
        return *nrows > 0 ? key_ptr_of(*of, at) : nullptr;
      };
      // kv 0: each block's K of every head into the scores; kv 1: each block's V of every head into the sums
      auto block_pass = [&](int kv) {
        for (int64_t b = 0; b < nblocks; ++b) {
          int64_t nrows = 0;
          const KV* nk = next_block(b, &nrows);
          for (int32_t h = 0; h < task.num_kv; ++h) {
            const int64_t n = std::clamp<int64_t>(glimit[h] - b * run, 0, run);
            if (n == 0) continue;
            const void* np = nk ? static_cast<const void*>(nk + h * head_step + kv * v_step) : nullptr;
            const NextBlocks nx{&np, nrows, run, row_bytes, true};
            const uint8_t* block = reinterpret_cast<const uint8_t*>(run_of(sc.base, b, h, kv));
            float* scores = sc.scores.data() + h * kRowGroup * tile_keys + b * run;
            if (kv == 0)
              scores_fused_for<Codec, kElem>(head_rows, sc.q.data() + h * head_rows * d, d, &block, run, n, scores,
                                             tile_keys, nx);
            else
              accumulate_fused_for<Codec, kElem>(head_rows, scores, tile_keys, &block, run, n,
                                                 sc.acc.data() + h * head_rows * d, d, nx);
          }
        }
      };
      block_pass(0);
      for (int32_t h = 0; h < task.num_kv; ++h)
        if (glimit[h] > 0)
          softmax_group(h * head_rows, head_rows, sc.scores.data() + h * kRowGroup * tile_keys, limits[h], firsts[h],
                        glimit[h]);
      block_pass(1);
      continue;
    }
    // K and V blocks of the next tile (this task's, or the next task's first), requested while this tile is
    // computed
    int64_t next_tile = 0;
    const Task* next_of = stream_at(tile_keys, tile, 1, &next_tile);
    const int64_t next_n = next_of ? std::clamp<int64_t>(next_of->k_end - next_tile, 0, tile_keys) : 0;
    const int64_t next_blocks = (next_n + run - 1) / run;
    for (int64_t b = 0; b < next_blocks; ++b) sc.next_base[size_t(b)] = key_ptr_of(*next_of, next_tile + b * run);
    for (int32_t h = 0; h < task.num_kv; ++h) {
      for (int64_t b = 0; b < nblocks; ++b) {
        if (fused) {
          sc.kc[size_t(b)] = reinterpret_cast<const uint8_t*>(run_of(sc.base, b, h, 0));
          sc.vc[size_t(b)] = reinterpret_cast<const uint8_t*>(run_of(sc.base, b, h, 1));
          continue;
        }
        const int64_t n = std::min<int64_t>(run, tile_n - b * run);
        sc.kp[size_t(b)] = as_float(run_of(sc.base, b, h, 0), n, d, sc.kf.data() + b * run * d);
        sc.vp[size_t(b)] = as_float(run_of(sc.base, b, h, 1), n, d, sc.vf.data() + b * run * d);
      }
      for (int64_t b = 0; b < next_blocks; ++b) {
        sc.knext[size_t(b)] = run_of(sc.next_base, b, h, 0);
        sc.vnext[size_t(b)] = run_of(sc.next_base, b, h, 1);
      }
      if (next_n > tile_n) {  // the loops below request the next tile's rows up to this tile's length
        NextBlocks{sc.knext.data(), next_n, run, row_bytes}.prefetch_from(tile_n);
        NextBlocks{sc.vnext.data(), next_n, run, row_bytes}.prefetch_from(tile_n);
      }
      for (int32_t r0 = h * head_rows; r0 < (h + 1) * head_rows; r0 += kRowGroup) {
        const bool first_group = r0 == h * head_rows;
        const NextBlocks next_k{sc.knext.data(), first_group ? next_n : 0, run, row_bytes, from_memory};
        const NextBlocks next_v{sc.vnext.data(), first_group ? next_n : 0, run, row_bytes, from_memory};
        const int nr = std::min(kRowGroup, (h + 1) * head_rows - r0);
        int64_t limits[kRowGroup], firsts[kRowGroup];  // each row's visible keys in the tile: [first, limit)
        int64_t group_limit = 0;
        for (int i = 0; i < nr; ++i) {
          const int64_t pos = sc.pos[size_t(r0 + i)];
          limits[i] = std::clamp<int64_t>(pos - tile + 1, 0, tile_n);  // causal
          firsts[i] =
              opt.sliding_window > 0 ? std::clamp<int64_t>(pos - opt.sliding_window + 1 - tile, 0, tile_n) : 0;
          if (firsts[i] >= limits[i]) firsts[i] = limits[i] = 0;  // the whole tile is outside the row's window
          group_limit = std::max(group_limit, limits[i]);
        }
        if (group_limit == 0) continue;
        float* scores = sc.scores.data();
        if (fused)
          scores_fused_for<Codec, kElem>(nr, sc.q.data() + r0 * d, d, sc.kc.data(), run, group_limit, scores,
                                         tile_keys, next_k);
        else
          scores_for(nr, sc.q.data() + r0 * d, d, sc.kp.data(), run, group_limit, scores, tile_keys, next_k);
        softmax_group(r0, nr, scores, limits, firsts, group_limit);
        if (fused)
          accumulate_fused_for<Codec, kElem>(nr, scores, tile_keys, sc.vc.data(), run, group_limit,
                                             sc.acc.data() + r0 * d, d, next_v);
        else
          accumulate_for(nr, scores, tile_keys, sc.vp.data(), run, group_limit, sc.acc.data() + r0 * d, d, next_v);
      }
    }
  }
  for (int32_t r = 0; r < rows; ++r) {
    const float* acc = sc.acc.data() + r * d;
    const int32_t t = task.q_begin + (r % head_rows) / group;
    const int32_t head = (task.kv_head + r / head_rows) * group + r % group;
    if (task.partial >= 0) {
      float* dst = partials + (task.partial + r) * (d + 2);
      std::copy(acc, acc + d, dst);
      dst[d] = sc.m[size_t(r)];
      dst[d + 1] = sc.l[size_t(r)];
    } else {
      IO* dst = out + (int64_t(t) * p.num_heads + head) * d;
      const float inv = 1.0f / sc.l[size_t(r)];
      for (int64_t i = 0; i < d; ++i) store(dst[i], acc[i] * inv);
    }
  }
}

// Combines the partials of the split tasks that start a split group (split == 0).
template <typename IO>
void merge_splits(const Task& first, const trtpaged_attention_params& p, const float* partials, IO* out) {
  const int32_t group = p.num_heads / p.num_kv_heads;
  const int64_t d = p.head_dim;
  const int32_t head_rows = (first.q_end - first.q_begin) * group;
  const int32_t rows = head_rows * first.num_kv;
  std::vector<float> acc(static_cast<size_t>(d));
  for (int32_t r = 0; r < rows; ++r) {
    float m_max = kNegInf;
    for (int32_t i = 0; i < first.num_splits; ++i)
      m_max = std::max(m_max, partials[(first.partial + int64_t(i) * rows + r) * (d + 2) + d]);
    std::fill(acc.begin(), acc.end(), 0.0f);
    float l = 0.0f;
    for (int32_t i = 0; i < first.num_splits; ++i) {
      const float* part = partials + (first.partial + int64_t(i) * rows + r) * (d + 2);
      if (part[d + 1] == 0.0f) continue;  // no key of this split was visible to the row
      const float w = std::exp(part[d] - m_max);
      l += part[d + 1] * w;
      for (int64_t j = 0; j < d; ++j) acc[size_t(j)] += part[j] * w;
    }
    const int32_t t = first.q_begin + (r % head_rows) / group;
    const int32_t head = (first.kv_head + r / head_rows) * group + r % group;
    IO* dst = out + (int64_t(t) * p.num_heads + head) * d;
    const float inv = 1.0f / l;  // as an unsplit task normalises: one split gives the same bits
    for (int64_t j = 0; j < d; ++j) store(dst[j], acc[size_t(j)] * inv);
  }
}

template <typename IO, typename KV>
void paged_attention(const trtpaged_attention_params& p, const trtpaged_attention_options& opt, const IO* q,
                     const IO* k, const IO* v, KV* cache, const int32_t* positions, const int32_t* query_start,
                     const int32_t* block_tables, IO* out) {
  const int64_t row = is_quantized_v<KV> ? p.head_dim + int64_t(sizeof(half_t)) : p.head_dim;
  const PoolLayout pool{p.num_layers, p.num_kv_heads, p.block_size, p.head_dim, row};
  write_kv(p, pool, k, v, cache, positions, query_start, block_tables);
  int64_t num_partials = 0;
  const std::vector<Task> tasks = plan_tasks(p, opt.sliding_window, positions, query_start, &num_partials);
  std::vector<float> partials(size_t(num_partials * (p.head_dim + 2)));  // num_partials: rows
  int64_t kv_bytes = 0;
  for (const Task& t : tasks) kv_bytes += std::max<int64_t>(0, t.k_end - t.k_begin) * t.num_kv * 2 * row;
  const bool from_memory = kv_bytes * int64_t(sizeof(KV)) * p.num_layers > kBlockMajorBytes;
  // Tasks are handed out one at a time, as schedule(dynamic, 1) would, but a thread claims its next
  // one before it finishes the current one (run_task), to prefetch it.
  std::atomic<size_t> next_task{0};
  auto claim = [&]() -> const Task* {
    const size_t i = next_task.fetch_add(1, std::memory_order_relaxed);
    return i < tasks.size() ? &tasks[i] : nullptr;
  };
#pragma omp parallel
  {
    Scratch scratch;
    bool prefetched = false;
    for (const Task* task = claim(); task != nullptr; prefetched = true) {
      const Task* next = nullptr;  // claimed by run_task when its requests reach it
      run_task(*task, p, opt, pool, q, cache, positions, block_tables, out, partials.data(), scratch, claim, next,
               prefetched, from_memory);
      task = next != nullptr ? next : claim();
    }
#pragma omp barrier
#pragma omp for schedule(dynamic, 1)
    for (size_t i = 0; i < tasks.size(); ++i)
      if (tasks[i].partial >= 0 && tasks[i].split == 0) merge_splits(tasks[i], p, partials.data(), out);
  }
}

template <typename IO>
void dispatch_kv(const trtpaged_attention_params& p, const trtpaged_attention_options& opt, const void* q,
                 const void* k, const void* v, void* cache, const int32_t* positions, const int32_t* query_start,
                 const int32_t* block_tables, void* out) {
  const IO* qi = static_cast<const IO*>(q);
  const IO* ki = static_cast<const IO*>(k);
  const IO* vi = static_cast<const IO*>(v);
  IO* oi = static_cast<IO*>(out);
  switch (p.kv_cache_dtype) {
    case TRTPAGED_FLOAT32:
      return paged_attention(p, opt, qi, ki, vi, static_cast<float*>(cache), positions, query_start, block_tables, oi);
    case TRTPAGED_FLOAT16:
      return paged_attention(p, opt, qi, ki, vi, static_cast<half_t*>(cache), positions, query_start, block_tables, oi);
    case TRTPAGED_BFLOAT16:
      return paged_attention(p, opt, qi, ki, vi, static_cast<bfloat_t*>(cache), positions, query_start, block_tables,
                             oi);
    case TRTPAGED_INT8:
      return paged_attention(p, opt, qi, ki, vi, static_cast<int8_code*>(cache), positions, query_start, block_tables,
                             oi);
    case TRTPAGED_FP8_E4M3:
      return paged_attention(p, opt, qi, ki, vi, static_cast<fp8_code*>(cache), positions, query_start, block_tables,
                             oi);
  }
}

inline void run_paged_attention(const AttentionCall& c) {
  const trtpaged_attention_params& p = *c.params;
  switch (p.io_dtype) {
    case TRTPAGED_FLOAT32:
      return dispatch_kv<float>(p, c.options, c.q, c.k, c.v, c.kv_cache, c.positions, c.query_start, c.block_tables,
                                c.out);
    case TRTPAGED_FLOAT16:
      return dispatch_kv<half_t>(p, c.options, c.q, c.k, c.v, c.kv_cache, c.positions, c.query_start, c.block_tables,
                                 c.out);
    case TRTPAGED_BFLOAT16:
      return dispatch_kv<bfloat_t>(p, c.options, c.q, c.k, c.v, c.kv_cache, c.positions, c.query_start,
                                   c.block_tables, c.out);
    default:  // validate_attention_params allows only the float dtypes for io
      return;
  }
}

}  // namespace
}  // namespace trtpaged::cpu
