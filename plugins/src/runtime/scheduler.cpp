// The C runtime's scheduler, block pool and block tables (the rules of trtpaged/runtime/scheduler.py).
#include "runtime/scheduler.h"

#include <algorithm>
#include <string>
#include <unordered_set>

#include "runtime/error.h"
#include "trtpaged/runtime.h"

namespace trtpaged::rt {

// ---- block pool -----------------------------------------------------------------------------------

BlockPool::BlockPool(int32_t num_kv_blocks, bool enable_caching) : caching_(enable_caching) {
  head_.next_free = &tail_;
  tail_.prev_free = &head_;
  blocks_.reserve(size_t(num_kv_blocks));
  for (int32_t i = 0; i < num_kv_blocks; ++i) {
    blocks_.push_back(std::make_unique<Block>());
    blocks_.back()->id = i;
    append(blocks_.back().get());
  }
}

void BlockPool::append(Block* b) {
  Block* prev = tail_.prev_free;
  b->prev_free = prev;
  b->next_free = &tail_;
  prev->next_free = b;
  tail_.prev_free = b;
  b->in_free_queue = true;
  ++free_len_;
}

void BlockPool::appendleft(Block* b) {
  Block* next = head_.next_free;
  b->prev_free = &head_;
  b->next_free = next;
  head_.next_free = b;
  next->prev_free = b;
  b->in_free_queue = true;
  ++free_len_;
}

void BlockPool::remove(Block* b) {
  b->prev_free->next_free = b->next_free;
  b->next_free->prev_free = b->prev_free;
  b->prev_free = b->next_free = nullptr;
  b->in_free_queue = false;
  --free_len_;
}

void BlockPool::evict(Block* b) {
  if (!b->cached) return;
  auto& bucket = cache_[b->hash];
  bucket.erase(std::find(bucket.begin(), bucket.end(), b));
  if (bucket.empty()) cache_.erase(b->hash);
  b->cached = false;
  b->tokens.clear();
  b->has_parent = false;
}

std::vector<Block*> BlockPool::allocate(int32_t count) {
  if (count > free_len_) raise(TRTPAGED_ERR_INVALID_ARGUMENT, "allocate: more blocks than free (internal)");
  std::vector<Block*> out;
  for (int32_t i = 0; i < count; ++i) {
    Block* b = head_.next_free;
    remove(b);
    evict(b);
    ++b->generation;  // a new identity: no stale chain link can reach it
    b->ref_cnt = 1;
    out.push_back(b);
  }
  return out;
}

void BlockPool::touch(const std::vector<Block*>& blocks) {
  for (Block* b : blocks) {
    if (b->ref_cnt == 0) remove(b);
    ++b->ref_cnt;
  }
}

void BlockPool::free(const std::vector<Block*>& blocks) {
  for (Block* b : blocks) {
    if (--b->ref_cnt > 0) continue;
    if (b->cached)
      append(b);  // evicted last (least recently used first)
    else
      appendleft(b);  // holds nothing worth keeping: reused first
  }
}

Block* BlockPool::lookup(uint64_t hash, const std::vector<int32_t>& tokens, const Block* parent) const {
  if (!caching_) return nullptr;
  auto it = cache_.find(hash);
  if (it == cache_.end()) return nullptr;
  for (Block* b : it->second) {
    const bool same_parent = parent ? (b->has_parent && b->parent_id == parent->id &&
                                       b->parent_generation == parent->generation)
                                    : !b->has_parent;
    if (same_parent && b->tokens == tokens) return b;
  }
  return nullptr;
}

void BlockPool::cache(Block* block, uint64_t hash, const std::vector<int32_t>& tokens, const Block* parent) {
  if (!caching_ || block->cached || lookup(hash, tokens, parent)) return;
  block->cached = true;
  block->hash = hash;
  block->tokens = tokens;
  block->has_parent = parent != nullptr;
  if (parent) {
    block->parent_id = parent->id;
    block->parent_generation = parent->generation;
  }
  cache_[hash].push_back(block);
}

void BlockPool::forget_cached() {
  for (auto& b : blocks_) evict(b.get());
}

// ---- scheduler --------------------------------------------------------------------------------------

Scheduler::Scheduler(const Limits& limits, int32_t num_kv_blocks, bool enable_caching, int32_t reclaim_window,
                     std::vector<int32_t> eos)
    : limits_(limits), reclaim_window_(reclaim_window), pool_(num_kv_blocks, enable_caching), eos_(std::move(eos)) {}

uint64_t Scheduler::chain_hash(bool has_parent, uint64_t parent_hash, const int32_t* tokens) const {
  // FNV-1a over the parent's hash and the block's tokens; a collision costs a miss, never wrong K/V
  uint64_t h = has_parent ? parent_hash ^ 0x9E3779B97F4A7C15ull : 0xcbf29ce484222325ull;
  for (int32_t i = 0; i < limits_.block_size; ++i) {
    h ^= uint32_t(tokens[i]);
    h *= 0x100000001b3ull;
  }
  return h;
}

void Scheduler::check_request(int64_t n, int64_t max_tokens) const {
  const int64_t max_seq_len = limits_.max_seq_len, bs = limits_.block_size;
  if (n < 1) invalid("prompt_len: must have at least one token (got " + std::to_string(n) + ")");
  if (n >= max_seq_len)
    invalid("prompt_len: " + std::to_string(n) + " tokens " + (n == max_seq_len ? "reach" : "exceed") +
            " max_seq_len (" + std::to_string(max_seq_len) + "), leaving no room for a generated token (at most " +
            std::to_string(max_seq_len - 1) + " prompt tokens)");
  int64_t blocks = (n + bs - 1) / bs;
  if (reclaim_window_)  // at most its window, one chunk, a partial block at each end and the chain parent live
    blocks = std::min(blocks, (reclaim_window_ + std::min<int64_t>(n, limits_.max_num_tokens) + bs - 1) / bs + 2);
  if (blocks > pool_.num_kv_blocks())
    invalid("prompt_len: " + std::to_string(n) + " tokens need " + std::to_string(blocks) +
            " KV blocks, more than the whole pool (num_kv_blocks " + std::to_string(pool_.num_kv_blocks()) +
            ", block_size " + std::to_string(bs) + ")");
  const int64_t room = max_seq_len - n;
  if (max_tokens < 1 || max_tokens > room)
    invalid("sampling.max_tokens: got " + std::to_string(max_tokens) + "; with " + std::to_string(n) +
            " prompt tokens it must be in [1, " + std::to_string(room) + "] (max_seq_len " +
            std::to_string(max_seq_len) + ")");
}

void Scheduler::insert(std::deque<Request*>& queue, Request* r) {
  auto at = std::upper_bound(queue.begin(), queue.end(), r->arrival,
                             [](int64_t a, const Request* x) { return a < x->arrival; });
  queue.insert(at, r);
}

void Scheduler::insert(std::vector<Request*>& queue, Request* r) {
  auto at = std::upper_bound(queue.begin(), queue.end(), r->arrival,
                             [](int64_t a, const Request* x) { return a < x->arrival; });
  queue.insert(at, r);
}

void Scheduler::add(Request* r) {
  r->status = Status::kWaiting;
  insert(waiting_, r);
}

bool Scheduler::abort(Request* r) {
  auto w = std::find(waiting_.begin(), waiting_.end(), r);
  auto q = std::find(running_.begin(), running_.end(), r);
  if (w == waiting_.end() && q == running_.end()) return false;
  if (w != waiting_.end()) waiting_.erase(w);
  finish(r, TRTPAGED_FINISH_ABORT);
  return true;
}

void Scheduler::finish(Request* r, int32_t reason) {
  free_blocks(r);
  auto q = std::find(running_.begin(), running_.end(), r);
  if (q != running_.end()) running_.erase(q);
  r->status = Status::kFinished;
  r->finish_reason = reason;
}

void Scheduler::free_blocks(Request* r) {
  auto it = tables_.find(r);
  if (it != tables_.end()) {
    std::vector<Block*> reversed;  // tail first
    for (auto b = it->second.rbegin(); b != it->second.rend() && *b; ++b) reversed.push_back(*b);
    pool_.free(reversed);
    tables_.erase(it);
  }
  hashes_.erase(r);
}

std::vector<int32_t> Scheduler::block_table(const Request* r) const {
  std::vector<int32_t> ids;
  auto it = tables_.find(r);
  if (it != tables_.end())
    for (const Block* b : it->second) ids.push_back(b ? b->id : 0);  // a reclaimed block: any id, never read
  return ids;
}

std::vector<Block*> Scheduler::find_cached_prefix(const Request* r) const {
  std::vector<Block*> hits;
  if (!pool_.caching() || tables_.count(r)) return hits;
  const int32_t bs = limits_.block_size;
  const Block* parent = nullptr;
  uint64_t prev = 0;
  std::vector<int32_t> tokens;
  for (size_t j = 0; j < (r->tokens.size() - 1) / size_t(bs); ++j) {  // never the last token: its logits are needed
    const int32_t* t = r->tokens.data() + j * size_t(bs);
    tokens.assign(t, t + bs);
    const uint64_t h = chain_hash(parent != nullptr, prev, t);
    Block* b = pool_.lookup(h, tokens, parent);
    if (!b) break;
    hits.push_back(b);
    parent = b;
    prev = h;
  }
  return hits;
}

bool Scheduler::plan(Request* r, int32_t tokens_left, int32_t seqs_left, Plan* out) {
  out->request = r;
  out->hits = find_cached_prefix(r);
  const int32_t cached = int32_t(out->hits.size()) * limits_.block_size;
  const int32_t remaining = int32_t(r->tokens.size()) - (out->hits.empty() ? r->num_computed : cached);
  if (seqs_left < 1 || tokens_left <= 0) return false;
  int32_t limit = tokens_left;
  if (reclaim_window_) {  // a recompute (prompt + outputs) in chunks that fit the pool, as check_request's bound
    const int64_t fit = (int64_t(pool_.num_kv_blocks()) - 2) * limits_.block_size - reclaim_window_;
    limit = int32_t(std::min<int64_t>(
        tokens_left, std::max<int64_t>(std::min(r->num_prompt_tokens, limits_.max_num_tokens), fit)));
  }
  if (remaining <= limit) {
    out->num_tokens = remaining;
  } else {  // a chunk that leaves at least one token: the request samples in a later step
    out->num_tokens = std::max(0, std::min(remaining - 1, limit));
    if (out->num_tokens == 0) return false;
  }
  return true;
}

void Scheduler::plan_allocation(Plan* p) const {
  const int32_t bs = limits_.block_size;
  int32_t start, table_len, reclaimed = 0;
  p->copy_last = false;
  if (!p->hits.empty()) {
    const int32_t dead = dead_hits(int32_t(p->hits.size()));  // holes from the start: never taken off the queue
    for (size_t j = size_t(dead); j < p->hits.size(); ++j) reclaimed += p->hits[j]->ref_cnt == 0;
    start = int32_t(p->hits.size()) * bs;
    table_len = int32_t(p->hits.size());
  } else {
    auto it = tables_.find(p->request);
    table_len = it == tables_.end() ? 0 : int32_t(it->second.size());
    start = p->request->num_computed;
    const int32_t j = start / bs;
    if (p->num_tokens > 0 && j < table_len) p->copy_last = it->second[size_t(j)]->ref_cnt > 1;
  }
  p->new_blocks = p->num_tokens > 0 ? std::max(0, (start + p->num_tokens + bs - 1) / bs - table_len) : 0;
  p->num_kv_blocks = int32_t(p->copy_last) + p->new_blocks + reclaimed;
}

void Scheduler::allocate(const Plan& p, SchedulerOutput* out) {
  Request* r = p.request;
  if (!p.hits.empty()) {
    // hits wholly before the window of the first token computed are holes at once (as reclaim would leave them
    // after this step): taking them would need more blocks than the window bound check_request admitted
    const size_t dead = size_t(dead_hits(int32_t(p.hits.size())));
    pool_.touch(std::vector<Block*>(p.hits.begin() + std::ptrdiff_t(dead), p.hits.end()));
    tables_[r] = p.hits;
    std::fill(tables_[r].begin(), tables_[r].begin() + std::ptrdiff_t(dead), nullptr);
    auto& hashes = hashes_[r];
    hashes.clear();
    for (const Block* b : p.hits) hashes.push_back(b->hash);
    prefix_hits_tokens_ += int64_t(p.hits.size()) * limits_.block_size;
  }
  auto& table = tables_[r];
  hashes_[r];
  if (p.copy_last) {
    const size_t j = size_t(r->num_computed / limits_.block_size);
    Block* fresh = pool_.allocate(1)[0];
    out->block_copies.emplace_back(table[j]->id, fresh->id);
    pool_.free({table[j]});
    table[j] = fresh;
  }
  if (p.new_blocks) {
    auto fresh = pool_.allocate(p.new_blocks);
    table.insert(table.end(), fresh.begin(), fresh.end());
  }
}

void Scheduler::commit(const Plan& p, bool sample, int32_t* budget, SchedulerOutput* out) {
  allocate(p, out);
  Request* r = p.request;
  if (!p.hits.empty()) r->num_computed = int32_t(p.hits.size()) * limits_.block_size;
  out->scheduled.push_back({r, r->num_computed, p.num_tokens, sample});
  budget[0] -= p.num_tokens;
  budget[1] -= 1;
  if (sample) out->sampled.push_back(r);
}

void Scheduler::preempt(Request* r) {
  running_.erase(std::find(running_.begin(), running_.end(), r));
  ++num_preemptions_;
  free_blocks(r);
  r->num_computed = 0;  // recomputed from its first token when it is admitted again
  r->status = Status::kWaiting;
  insert(waiting_, r);
}

void Scheduler::admit(int32_t* budget, SchedulerOutput* out) {
  while (!waiting_.empty()) {
    Request* r = waiting_.front();
    Plan p;
    if (!plan(r, budget[0], budget[1], &p)) return;
    const bool sample = p.num_tokens == int32_t(r->tokens.size()) - (p.hits.empty() ? r->num_computed
                                                                                       : int32_t(p.hits.size()) *
                                                                                             limits_.block_size);
    plan_allocation(&p);
    if (p.num_kv_blocks > pool_.num_free()) {
      if (running_.empty() && out->scheduled.empty()) {  // an empty pool cannot hold it: it never will
        waiting_.pop_front();
        finish(r, TRTPAGED_FINISH_LENGTH);
        continue;
      }
      return;
    }
    waiting_.pop_front();
    r->status = Status::kRunning;
    insert(running_, r);
    commit(p, sample, budget, out);
  }
}

SchedulerOutput Scheduler::schedule() {
  SchedulerOutput out;
  int32_t budget[2] = {limits_.max_num_tokens, limits_.max_batch_size};
  std::unordered_set<const Request*> done;
  bool preempted = false;
  std::vector<Request*> order = running_;
  std::stable_sort(order.begin(), order.end(),
                   [](const Request* a, const Request* b) { return a->is_decoding() && !b->is_decoding(); });
  for (Request* r : order) {
    if (r->status != Status::kRunning) continue;  // preempted earlier this step
    Plan p;
    if (!plan(r, budget[0], budget[1], &p)) continue;
    const int32_t remaining = int32_t(r->tokens.size()) -
                              (p.hits.empty() ? r->num_computed : int32_t(p.hits.size()) * limits_.block_size);
    const bool sample = p.num_tokens == remaining;
    bool committed = true;
    for (plan_allocation(&p); p.num_kv_blocks > pool_.num_free(); plan_allocation(&p)) {
      Request* victim = nullptr;
      for (auto it = running_.rbegin(); it != running_.rend(); ++it)
        if (!done.count(*it)) {
          victim = *it;
          break;
        }
      if (victim == r && done.empty() && running_.size() == 1) {  // it alone outgrew the whole pool
        finish(r, TRTPAGED_FINISH_LENGTH);
        committed = false;
        break;
      }
      preempt(victim);
      preempted = true;
      if (victim == r) {
        committed = false;
        break;
      }
    }
    if (committed) {
      commit(p, sample, budget, &out);
      done.insert(r);
    }
  }
  if (!preempted) admit(budget, &out);
  std::stable_sort(out.scheduled.begin(), out.scheduled.end(), [](const Scheduled& a, const Scheduled& b) {
    return (a.num_tokens == 1) < (b.num_tokens == 1);  // prefill chunks first, then decode tokens
  });
  return out;
}

void Scheduler::cache_computed_blocks(Request* r) {
  if (!pool_.caching()) return;
  auto t = tables_.find(r);
  if (t == tables_.end()) return;
  auto& hashes = hashes_[r];
  const int32_t bs = limits_.block_size;
  std::vector<int32_t> tokens;
  for (size_t j = hashes.size(); j < size_t(r->num_computed / bs); ++j) {
    const int32_t* tk = r->tokens.data() + j * size_t(bs);
    tokens.assign(tk, tk + bs);
    const uint64_t h = chain_hash(!hashes.empty(), hashes.empty() ? 0 : hashes.back(), tk);
    pool_.cache(t->second[j], h, tokens, j ? t->second[j - 1] : nullptr);
    hashes.push_back(h);
  }
}

// Of a request adopting `hits` cached blocks, how many lie wholly before its next token's window (the last kept: the
// next block's chain parent); 0 without a reclaim window.
int32_t Scheduler::dead_hits(int32_t hits) const {
  if (!reclaim_window_) return 0;
  return std::max(0, std::min(blocks_before_window(hits * limits_.block_size), hits - 1));
}

// How many of a table's leading blocks lie wholly before the window of the token at `position`.
int32_t Scheduler::blocks_before_window(int32_t position) const {
  return std::max(0, position - reclaim_window_ + 1) / limits_.block_size;
}

// Returns the blocks wholly before the window of the request's next token (position num_computed): no layer reads
// them again. With prefix caching the last cached block stays until the next one is cached (its chain parent).
void Scheduler::reclaim(Request* r) {
  auto t = tables_.find(r);
  if (!reclaim_window_ || t == tables_.end()) return;
  auto& table = t->second;
  int32_t dead = blocks_before_window(r->num_computed);
  if (pool_.caching()) dead = std::min(dead, int32_t(hashes_[r].size()) - 1);
  dead = std::min(dead, int32_t(table.size()));
  std::vector<Block*> blocks;  // tail first, as free_blocks
  for (int32_t j = dead - 1; j >= 0 && table[size_t(j)]; --j) {
    blocks.push_back(table[size_t(j)]);
    table[size_t(j)] = nullptr;
  }
  num_reclaimed_ += int64_t(blocks.size());
  pool_.free(blocks);
}

void Scheduler::update(const SchedulerOutput& out, const std::vector<int32_t>& tokens,
                       const std::vector<bool>& failed) {
  for (const Scheduled& s : out.scheduled) {
    s.request->num_computed += s.num_tokens;
    cache_computed_blocks(s.request);
    reclaim(s.request);  // after caching: a block's chain parent is kept until it is cached
  }
  for (size_t i = 0; i < out.sampled.size(); ++i) {
    Request* r = out.sampled[i];
    r->forked = true;
    if (failed[i]) {
      finish(r, TRTPAGED_FINISH_ERROR);
      continue;
    }
    const int32_t token = tokens[i];
    r->tokens.push_back(token);
    const auto& stop = r->sampling.stop_token_ids;
    const bool is_eos = !r->sampling.ignore_eos && std::find(eos_.begin(), eos_.end(), token) != eos_.end();
    if (is_eos || std::find(stop.begin(), stop.end(), token) != stop.end())
      finish(r, TRTPAGED_FINISH_STOP);
    else if (r->num_outputs() >= r->sampling.max_tokens || int32_t(r->tokens.size()) >= limits_.max_seq_len)
      finish(r, TRTPAGED_FINISH_LENGTH);
  }
}

}  // namespace trtpaged::rt
