// The request-level scheduler of the C runtime: a deliberately small subset of the Python runtime's
// (trtpaged/runtime/scheduler.py, kv_cache_manager.py, block_pool.py), with the same rules so that
// the same requests make the same steps: one sequence per request (no n > 1, beams or swap),
// continuous batching within max_num_tokens / max_batch_size (decoding requests first, then prefill
// chunks, then waiting requests admitted in arrival order), chunked prefill, prefix sharing of full
// blocks through a hash chain (a hit compares tokens and the parent block's identity), LRU eviction
// of cached free blocks, preemption of the newest running request by recompute, and, when every layer
// has a sliding window, the blocks wholly before a request's window returned to the pool (reclaim).
#pragma once

#include <cstdint>
#include <deque>
#include <list>
#include <memory>
#include <random>
#include <unordered_map>
#include <utility>
#include <vector>

namespace trtpaged::rt {

struct Block {
  int32_t id = 0;
  int32_t ref_cnt = 0;
  uint64_t generation = 0;
  bool cached = false;
  uint64_t hash = 0;
  std::vector<int32_t> tokens;  // when cached
  bool has_parent = false;      // when cached: the chain predecessor's (id, generation)
  int32_t parent_id = 0;
  uint64_t parent_generation = 0;
  Block* prev_free = nullptr;
  Block* next_free = nullptr;
  bool in_free_queue = false;
};

// Every block of the pool, their LRU free queue and the prefix cache (hash -> blocks).
class BlockPool {
 public:
  BlockPool(int32_t num_kv_blocks, bool enable_caching);
  int32_t num_kv_blocks() const { return int32_t(blocks_.size()); }
  int32_t num_free() const { return free_len_; }
  bool caching() const { return caching_; }
  std::vector<Block*> allocate(int32_t count);
  void touch(const std::vector<Block*>& blocks);
  void free(const std::vector<Block*>& blocks);  // in the given order (tail blocks first)
  Block* lookup(uint64_t hash, const std::vector<int32_t>& tokens, const Block* parent) const;
  void cache(Block* block, uint64_t hash, const std::vector<int32_t>& tokens, const Block* parent);
  // Drops every prefix-cache entry (the blocks stay free): their K/V may have been overwritten.
  void forget_cached();

 private:
  void append(Block* b);
  void appendleft(Block* b);
  void remove(Block* b);
  void evict(Block* b);
  std::vector<std::unique_ptr<Block>> blocks_;
  Block head_, tail_;
  int32_t free_len_ = 0;
  bool caching_;
  std::unordered_map<uint64_t, std::vector<Block*>> cache_;
};

enum class Status { kWaiting, kRunning, kFinished };

struct Sampling {
  int32_t max_tokens = 16;
  float temperature = 0;
  int32_t top_k = 0;
  float top_p = 1;
  bool ignore_eos = false;
  std::vector<int32_t> stop_token_ids;
};

struct Request {
  int64_t id = 0;
  int64_t arrival = 0;
  std::vector<int32_t> tokens;  // prompt + output
  int32_t num_prompt_tokens = 0;
  int32_t num_computed = 0;
  bool forked = false;          // sampled at least once
  Status status = Status::kWaiting;
  int32_t finish_reason = 0;    // trtpaged_finish_reason
  size_t num_read = 0;          // output tokens already read
  Sampling sampling;
  std::mt19937_64 rng;
  int32_t num_outputs() const { return int32_t(tokens.size()) - num_prompt_tokens; }
  bool is_decoding() const { return forked && int32_t(tokens.size()) - num_computed == 1; }
};

struct Scheduled {
  Request* request;
  int32_t start, num_tokens;
  bool sample;
};

struct SchedulerOutput {
  std::vector<Scheduled> scheduled;
  std::vector<Request*> sampled;
  std::vector<std::pair<int32_t, int32_t>> block_copies;
};

struct Limits {
  int32_t block_size, max_batch_size, max_num_tokens, max_seq_len;
};

class Scheduler {
 public:
  // reclaim_window > 0: every layer has a sliding window, this the largest (KVCacheManager.reclaim_window)
  Scheduler(const Limits& limits, int32_t num_kv_blocks, bool enable_caching, int32_t reclaim_window,
            std::vector<int32_t> eos);
  // Refuses (invalid argument) a request that can never run; naming the argument and the limit.
  void check_request(int64_t num_prompt_tokens, int64_t max_tokens) const;
  void add(Request* r);
  bool abort(Request* r);
  SchedulerOutput schedule();
  // The step ran: computed tokens are cached; each sampled request takes its token (row order of
  // out.sampled), finishes on EOS / stop tokens / length and frees its blocks.
  void update(const SchedulerOutput& out, const std::vector<int32_t>& tokens, const std::vector<bool>& failed);
  std::vector<int32_t> block_table(const Request* r) const;
  bool has_unfinished() const { return !waiting_.empty() || !running_.empty(); }
  int32_t num_waiting() const { return int32_t(waiting_.size()); }
  int32_t num_running() const { return int32_t(running_.size()); }
  int64_t num_preemptions() const { return num_preemptions_; }
  int64_t prefix_hits_tokens() const { return prefix_hits_tokens_; }
  int64_t num_reclaimed() const { return num_reclaimed_; }
  const BlockPool& pool() const { return pool_; }
  // Before the step API writes the pool (no request unfinished): cached prefixes may not survive it.
  void forget_cached_prefixes() { pool_.forget_cached(); }

 private:
  struct Plan {
    Request* request;
    int32_t num_tokens;
    std::vector<Block*> hits;
    bool copy_last = false;
    int32_t new_blocks = 0;
    int32_t num_kv_blocks = 0;  // free-queue blocks it takes
  };
  std::vector<Block*> find_cached_prefix(const Request* r) const;
  // Tokens this step and whether it samples after it; false when nothing fits the budget.
  bool plan(Request* r, int32_t budget_tokens, int32_t budget_seqs, Plan* out);
  void plan_allocation(Plan* p) const;
  void allocate(const Plan& p, SchedulerOutput* out);
  void commit(const Plan& p, bool sample, int32_t* budget, SchedulerOutput* out);
  void cache_computed_blocks(Request* r);
  void reclaim(Request* r);
  int32_t dead_hits(int32_t hits) const;
  int32_t blocks_before_window(int32_t position) const;
  void free_blocks(Request* r);
  void preempt(Request* r);
  void finish(Request* r, int32_t reason);
  void admit(int32_t* budget, SchedulerOutput* out);
  static void insert(std::deque<Request*>& queue, Request* r);
  static void insert(std::vector<Request*>& queue, Request* r);
  uint64_t chain_hash(bool has_parent, uint64_t parent_hash, const int32_t* tokens) const;

  Limits limits_;
  int32_t reclaim_window_;
  BlockPool pool_;
  std::vector<int32_t> eos_;
  std::deque<Request*> waiting_;
  std::vector<Request*> running_;
  // nullptr: a block returned by reclaim (only ever a leading run of the table)
  std::unordered_map<const Request*, std::vector<Block*>> tables_;
  std::unordered_map<const Request*, std::vector<uint64_t>> hashes_;
  int64_t num_preemptions_ = 0, prefix_hits_tokens_ = 0, num_reclaimed_ = 0;
};

}  // namespace trtpaged::rt
