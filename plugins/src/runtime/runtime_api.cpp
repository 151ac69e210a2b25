// The C API of libtrtpaged_runtime (trtpaged/runtime.h): argument checks, the KV pool, the request
// table, and the boundary where internal errors become a status and trtpaged_last_error().
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <new>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "runtime/engine_dir.h"
#include "runtime/error.h"
#include "runtime/model_cpu.h"
#include "runtime/sampler.h"
#include "runtime/scheduler.h"
#include "trtpaged/runtime.h"

using namespace trtpaged::rt;

struct trtpaged_runtime {
  Manifest manifest;
  std::unique_ptr<CpuModel> model;
  Limits limits{};
  int32_t num_kv_blocks = 0;
  int64_t block_bytes = 0;
  std::unique_ptr<unsigned char, void (*)(void*)> pool{nullptr, [](void* p) { std::free(p); }};
  std::unique_ptr<Scheduler> scheduler;
  std::map<int64_t, std::unique_ptr<Request>> requests;
  int64_t next_id = 0;
  int64_t num_steps = 0, num_tokens_computed = 0;
  std::mt19937_64 rng{std::random_device{}()};  // unseeded sampled requests
  std::vector<float> logits;
  std::vector<int32_t> ids, positions, query_start, context_lens, tables, logits_index;
  // set while a call uses the handle: a second thread's overlapping call is refused, not a silent data race
  mutable std::atomic<bool> in_call{false};
};

namespace {

// the architectures of trtpaged/models/dims.py: MODEL_TYPES, every one the Python runtime builds
constexpr const char* kArchitectures[] = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                                          "Qwen3ForCausalLM", "SmolLM3ForCausalLM", "Phi3ForCausalLM",
                                          "Gemma2ForCausalLM", "Gemma3ForCausalLM"};

// Runs body; an exception becomes its status and this thread's last error (never crosses the boundary).
template <typename F>
trtpaged_status guarded(F&& body) {
  try {
    body();
    trtpaged_record_error(TRTPAGED_OK, "");
    return TRTPAGED_OK;
  } catch (const Error& e) {
    return trtpaged_record_error(e.status, e.what());
  } catch (const std::bad_alloc&) {
    return trtpaged_record_error(TRTPAGED_ERR_OUT_OF_MEMORY, "out of memory");
  } catch (const std::exception& e) {
    return trtpaged_record_error(TRTPAGED_ERR_INVALID_ARGUMENT, e.what());
  } catch (...) {
    return trtpaged_record_error(TRTPAGED_ERR_INVALID_ARGUMENT, "unknown error");
  }
}

void need(const void* p, const char* name) {
  if (!p) invalid(std::string(name) + ": null pointer");
}

// A 0/1 field: any other value is a caller's mistake (an uninitialised struct, a count passed for a flag), not "true".
bool flag(int32_t value, const char* name) {
  if (value != 0 && value != 1) invalid(std::string(name) + ": got " + std::to_string(value) + "; expected 0 or 1");
  return value == 1;
}

// The scheduler and pool counters by name: trtpaged_runtime_stats's fields and those added after it
// (trtpaged_runtime_get_counter).
std::map<std::string, int64_t> counters_of(const trtpaged_runtime& rt) {
  const int64_t free_blocks = rt.scheduler->pool().num_free();
  return {{"num_waiting", rt.scheduler->num_waiting()},
          {"num_running", rt.scheduler->num_running()},
          {"num_steps", rt.num_steps},
          {"num_tokens_computed", rt.num_tokens_computed},
          {"num_preemptions", rt.scheduler->num_preemptions()},
          {"kv_blocks_free", free_blocks},
          {"kv_blocks_used", rt.num_kv_blocks - free_blocks},
          {"prefix_cache_hits_tokens", rt.scheduler->prefix_hits_tokens()},
          {"kv_blocks_reclaimed", rt.scheduler->num_reclaimed()}};
}

// Holds the handle for one call (`guarded_on`). The contract is one thread at a time per handle; a call
// that overlaps another's is refused instead of racing on the scheduler and the pool.
class OneCall {
 public:
  explicit OneCall(const trtpaged_runtime& rt) : rt_(rt) {
    if (rt_.in_call.exchange(true))
      invalid("runtime: called from two threads at once; a handle takes one call at a time (serialize the calls, "
              "or open a handle per thread)");
    held_ = true;
  }
  ~OneCall() {
    if (held_) rt_.in_call.store(false);
  }
  OneCall(const OneCall&) = delete;
  OneCall& operator=(const OneCall&) = delete;

 private:
  const trtpaged_runtime& rt_;
  bool held_ = false;
};

// `guarded` for a call on a handle: the handle is checked, then held for the call (OneCall).
template <typename Runtime, typename F>
trtpaged_status guarded_on(Runtime* rt, F&& body) {
  return guarded([&] {
    need(rt, "runtime");
    OneCall one(*rt);
    body();
  });
}

// The step API and the request API write the same KV pool: the step API only while no request is unfinished,
// and what it writes may overwrite blocks the prefix cache still offers (the caller forgets them first).
void refuse_while_requests_run(const trtpaged_runtime& rt) {
  if (rt.scheduler->has_unfinished())
    invalid("runtime: " + std::to_string(rt.scheduler->num_waiting() + rt.scheduler->num_running()) +
            " requests are unfinished; the step API and the request API would write the same KV pool");
}

int64_t meminfo_available() {
  std::ifstream f("/proc/meminfo");
  std::string key;
  int64_t kb = 0;
  std::string unit;
  while (f >> key >> kb >> unit)
    if (key == "MemAvailable:") return kb * 1024;
  return int64_t(::sysconf(_SC_AVPHYS_PAGES)) * ::sysconf(_SC_PAGE_SIZE);
}

int32_t tightened(const char* name, int32_t value, int64_t limit) {
  if (value == 0) return int32_t(limit);
  if (value < 0 || value > limit)
    invalid(std::string("options.") + name + ": must be in [1, " + std::to_string(limit) +
            "] (the engine's build limit) or 0, got " + std::to_string(value));
  return value;
}

// The KV pool: zeroed, 2 MiB-aligned and advised for transparent huge pages, as trtpaged/kv_pool_memory.py
// does for the Python runtime (the paged attention reads short runs of rows from blocks scattered
// over the pool; with 4 KiB pages each run costs a TLB miss). Pages are touched here, not at the first
// step. nullptr when out of memory.
void* allocate_pool(size_t bytes) {
  constexpr size_t kHugePage = size_t(2) << 20;
  const size_t rounded = (std::max<size_t>(bytes, 1) + kHugePage - 1) / kHugePage * kHugePage;
  void* pool = std::aligned_alloc(kHugePage, rounded);
  if (!pool) return nullptr;
#ifdef MADV_HUGEPAGE
  madvise(pool, rounded, MADV_HUGEPAGE);  // a hint: 4 KiB pages where THP is off
#endif
  std::memset(pool, 0, rounded);
  return pool;
}

// Blocks of the pool: the options' override, else the manifest's budget (trtpaged/kv_budget.py's rules).
// *field: the setting the count came from, a manifest field named with `where` (the manifest's path and ": ").
int64_t kv_blocks(const Manifest& m, const trtpaged_open_options& o, const std::string& where, std::string* field) {
  const int64_t per_block = m.kv_bytes_per_block();
  if (o.num_kv_blocks < 0 || o.kv_bytes < 0) invalid("options.num_kv_blocks/kv_bytes: must be >= 0 (0: not set)");
  if (o.num_kv_blocks > 0 && o.kv_bytes > 0) invalid("options.num_kv_blocks, options.kv_bytes: set at most one");
  int64_t blocks;
  if (o.num_kv_blocks > 0) {
    *field = "options.num_kv_blocks";
    blocks = o.num_kv_blocks;
  } else if (o.kv_bytes > 0) {
    *field = "options.kv_bytes";
    blocks = o.kv_bytes / per_block;
  } else if (m.num_kv_blocks > 0) {
    *field = where + "kv_cache.num_kv_blocks";
    blocks = m.num_kv_blocks;
  } else if (m.kv_memory_bytes > 0) {
    *field = where + "kv_cache.memory_bytes";
    blocks = m.kv_memory_bytes / per_block;
  } else {
    *field = where + "kv_cache.fraction";
    const double free_bytes = double(::sysconf(_SC_AVPHYS_PAGES)) * double(::sysconf(_SC_PAGE_SIZE));
    const int64_t useful = m.max_batch_size * ((m.max_seq_len + m.block_size - 1) / m.block_size);
    blocks = std::min(int64_t(free_bytes * m.kv_fraction) / per_block, useful);
  }
  if (blocks < 1)
    invalid(*field + ": holds no KV block of " + std::to_string(per_block) + " bytes");
  if (blocks > (int64_t(1) << 31) - 1)
    invalid(*field + ": " + std::to_string(blocks) + " blocks; at most 2147483647 (int32 block ids)");
  return blocks;
}

// ids[0, n): token ids inside the vocabulary, else the first one outside is named (`name`[i]).
void check_token_ids(const int32_t* ids, int32_t n, int64_t vocab, const char* name) {
  for (int32_t i = 0; i < n; ++i)
    if (ids[i] < 0 || ids[i] >= vocab)
      invalid(std::string(name) + "[" + std::to_string(i) + "]: token id " + std::to_string(ids[i]) +
              " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
}

// No KV slot written by two sequences in one step (s checked otherwise): the kernels write each sequence's K/V on
// a thread of its own, so that would be a data race, not one token's K/V.
void check_one_writer_per_slot(const trtpaged_runtime& rt, const trtpaged_step_inputs& s) {
  const int32_t bs = rt.limits.block_size;
  std::unordered_map<int64_t, std::pair<int32_t, int32_t>> writer;  // block * block_size + offset -> (seq, token)
  for (int32_t q = 0; q < s.num_seqs; ++q)
    for (int32_t t = s.query_start[q]; t < s.query_start[q + 1]; ++t) {
      const int32_t pos = s.positions[t], block = s.block_tables[int64_t(q) * s.max_blocks_per_seq + pos / bs];
      const auto [it, first] = writer.emplace(int64_t(block) * bs + pos % bs, std::make_pair(q, t));
      if (!first && it->second.first != q)
        invalid("inputs.positions[" + std::to_string(t) + "]: sequence " + std::to_string(q) + " writes block " +
                std::to_string(block) + " offset " + std::to_string(pos % bs) + ", as sequence " +
                std::to_string(it->second.first) + " (token " + std::to_string(it->second.second) +
                ") does in this step; a KV slot takes one sequence's token a step (copy a shared block first: "
                "trtpaged_runtime_copy_blocks)");
    }
}

void check_step(const trtpaged_runtime& rt, const trtpaged_step_inputs& s, size_t logits_capacity) {
  const Limits& l = rt.limits;
  const int64_t max_blocks = (l.max_seq_len + l.block_size - 1) / l.block_size;
  if (s.num_seqs < 1 || s.num_seqs > l.max_batch_size)
    invalid("inputs.num_seqs: got " + std::to_string(s.num_seqs) + "; expected 1 to max_batch_size " +
            std::to_string(l.max_batch_size));
  if (s.num_tokens < s.num_seqs || s.num_tokens > l.max_num_tokens)
    invalid("inputs.num_tokens: got " + std::to_string(s.num_tokens) + "; expected num_seqs to max_num_tokens " +
            std::to_string(l.max_num_tokens));
  if (s.max_blocks_per_seq < 1 || s.max_blocks_per_seq > max_blocks)
    invalid("inputs.max_blocks_per_seq: got " + std::to_string(s.max_blocks_per_seq) + "; expected 1 to " +
            std::to_string(max_blocks) + " (max_seq_len / block_size)");
  if (s.num_outputs < 0 || s.num_outputs > s.num_tokens)
    invalid("inputs.num_outputs: got " + std::to_string(s.num_outputs) + "; expected 0 to num_tokens");
  need(s.input_ids, "inputs.input_ids");
  need(s.positions, "inputs.positions");
  need(s.query_start, "inputs.query_start");
  need(s.context_lens, "inputs.context_lens");
  need(s.block_tables, "inputs.block_tables");
  if (s.num_outputs) need(s.logits_index, "inputs.logits_index");
  const int64_t vocab = rt.manifest.vocab_size;
  if (size_t(s.num_outputs) * size_t(vocab) > logits_capacity)
    invalid("logits_capacity: " + std::to_string(logits_capacity) + " floats; num_outputs x vocab_size needs " +
            std::to_string(int64_t(s.num_outputs) * vocab));
  check_token_ids(s.input_ids, s.num_tokens, vocab, "inputs.input_ids");
  if (s.query_start[0] != 0 || s.query_start[s.num_seqs] != s.num_tokens)
    invalid("inputs.query_start: must run from 0 to num_tokens");
  // all of query_start before any of positions is read through it: with 0 <= query_start[q] <= query_start[q + 1]
  // and the last one num_tokens, every index below stays inside positions
  for (int32_t q = 0; q < s.num_seqs; ++q)
    if (s.query_start[q + 1] < s.query_start[q])
      invalid("inputs.query_start[" + std::to_string(q + 1) + "]: decreases");
  for (int32_t q = 0; q < s.num_seqs; ++q) {
    const int32_t a = s.query_start[q], b = s.query_start[q + 1], len = s.context_lens[q];
    if (len < 1 || len > l.max_seq_len)
      invalid("inputs.context_lens[" + std::to_string(q) + "]: got " + std::to_string(len) +
              "; expected 1 to max_seq_len " + std::to_string(l.max_seq_len));
    const int32_t used = (len + l.block_size - 1) / l.block_size;
    if (used > s.max_blocks_per_seq)
      invalid("inputs.context_lens[" + std::to_string(q) + "]: " + std::to_string(len) + " tokens need " +
              std::to_string(used) + " blocks, more than max_blocks_per_seq");
    for (int32_t j = 0; j < used; ++j) {
      const int32_t id = s.block_tables[int64_t(q) * s.max_blocks_per_seq + j];
      if (id < 0 || id >= rt.num_kv_blocks)
        invalid("inputs.block_tables[" + std::to_string(q) + "][" + std::to_string(j) + "]: block " +
                std::to_string(id) + " is outside the pool [0, " + std::to_string(rt.num_kv_blocks) + ")");
    }
    for (int32_t t = a; t < b; ++t)
      if (s.positions[t] < 0 || s.positions[t] >= len)
        invalid("inputs.positions[" + std::to_string(t) + "]: got " + std::to_string(s.positions[t]) +
                "; expected 0 to context_lens[" + std::to_string(q) + "] - 1 = " + std::to_string(len - 1));
  }
  check_one_writer_per_slot(rt, s);
  for (int32_t i = 0; i < s.num_outputs; ++i)
    if (s.logits_index[i] < 0 || s.logits_index[i] >= s.num_tokens)
      invalid("inputs.logits_index[" + std::to_string(i) + "]: got " + std::to_string(s.logits_index[i]) +
              "; expected 0 to num_tokens - 1");
}

void run_model(trtpaged_runtime& rt, const trtpaged_step_inputs& s, float* logits) {
  StepView v{s.num_tokens,     s.num_seqs,      s.max_blocks_per_seq, s.num_outputs, s.input_ids,
             s.positions,      s.query_start,   s.context_lens,       s.block_tables, s.logits_index};
  rt.model->step(v, rt.pool.get(), rt.num_kv_blocks, logits);
}

// One request-level iteration (the Python LLMEngine.step's order: schedule, copies, step, sample, update).
int32_t run_requests_step(trtpaged_runtime& rt) {
  SchedulerOutput out = rt.scheduler->schedule();
  if (out.scheduled.empty()) return 0;
  try {
    if (!out.block_copies.empty()) {
      std::vector<int32_t> pairs;
      for (auto& c : out.block_copies) pairs.insert(pairs.end(), {c.first, c.second});
      check_kernel(trtpaged_copy_blocks_cpu(rt.pool.get(), rt.num_kv_blocks, size_t(rt.block_bytes), pairs.data(),
                                            int32_t(out.block_copies.size())),
                   "copy_blocks");
    }
    size_t width = 0;
    std::vector<std::vector<int32_t>> tables;
    rt.ids.clear();
    rt.positions.clear();
    rt.query_start.assign(1, 0);
    rt.context_lens.clear();
    rt.logits_index.clear();
    for (const Scheduled& s : out.scheduled) {
      const int32_t end = s.start + s.num_tokens;
      rt.ids.insert(rt.ids.end(), s.request->tokens.begin() + s.start, s.request->tokens.begin() + end);
      for (int32_t p = s.start; p < end; ++p) rt.positions.push_back(p);
      rt.query_start.push_back(int32_t(rt.ids.size()));
      rt.context_lens.push_back(end);
      tables.push_back(rt.scheduler->block_table(s.request));
      width = std::max(width, tables.back().size());
    }
    rt.tables.assign(tables.size() * width, 0);
    for (size_t i = 0; i < tables.size(); ++i)
      std::copy(tables[i].begin(), tables[i].end(), rt.tables.begin() + long(i * width));
    // logits rows in the order of out.sampled (the scheduled order of sampling requests)
    std::map<const Request*, int32_t> row_of;
    for (size_t i = 0; i < out.scheduled.size(); ++i)
      if (out.scheduled[i].sample) {
        row_of[out.scheduled[i].request] = int32_t(rt.logits_index.size());
        rt.logits_index.push_back(rt.query_start[i + 1] - 1);
      }
    const int64_t vocab = rt.manifest.vocab_size;
    rt.logits.resize(rt.logits_index.size() * size_t(vocab));
    trtpaged_step_inputs in{int32_t(rt.ids.size()), int32_t(out.scheduled.size()), int32_t(width),
                            int32_t(rt.logits_index.size()), rt.ids.data(), rt.positions.data(),
                            rt.query_start.data(), rt.context_lens.data(), rt.tables.data(),
                            rt.logits_index.data()};
    run_model(rt, in, rt.logits.data());
    std::vector<int32_t> tokens;
    std::vector<bool> failed;
    for (Request* r : out.sampled) {
      const SampleParams p{r->sampling.temperature, r->sampling.top_k, r->sampling.top_p};
      const int32_t t = sample_row(rt.logits.data() + int64_t(row_of.at(r)) * vocab, vocab, p, r->rng);
      tokens.push_back(t);
      failed.push_back(t < 0);
    }
    rt.scheduler->update(out, tokens, failed);
  } catch (...) {  // the step's requests end here (their blocks return to the pool); the error propagates
    for (const Scheduled& s : out.scheduled)
      if (s.request->status != Status::kFinished) {
        rt.scheduler->abort(s.request);
        s.request->finish_reason = TRTPAGED_FINISH_ERROR;
      }
    throw;
  }
  ++rt.num_steps;
  int32_t n = 0;
  for (const Scheduled& s : out.scheduled) n += s.num_tokens;
  rt.num_tokens_computed += n;
  return n;
}

Request& find_request(trtpaged_runtime& rt, int64_t id) {
  auto it = rt.requests.find(id);
  if (it == rt.requests.end())
    invalid("request_id: no request " + std::to_string(id) + " (never added, or finished and read)");
  return *it->second;
}

}  // namespace

extern "C" {

TRTPAGED_API void trtpaged_open_options_init(trtpaged_open_options* o) {
  if (!o) return;
  std::memset(o, 0, sizeof *o);
  o->struct_size = sizeof *o;
  o->enable_prefix_caching = 1;
}

TRTPAGED_API void trtpaged_sampling_init(trtpaged_sampling* s) {
  if (!s) return;
  std::memset(s, 0, sizeof *s);
  s->struct_size = sizeof *s;
  s->max_tokens = 16;
  s->top_p = 1.0f;
}

TRTPAGED_API trtpaged_status trtpaged_runtime_open(const char* engine_dir, const trtpaged_open_options* options,
                                                   trtpaged_runtime** out) {
  if (out) *out = nullptr;
  return guarded([&] {
    need(out, "out");
    need(engine_dir, "engine_dir");
    trtpaged_open_options o;
    trtpaged_open_options_init(&o);
    if (options) {
      if (options->struct_size != sizeof o)
        invalid("options.struct_size: got " + std::to_string(options->struct_size) + ", this library's is " +
                std::to_string(sizeof o) + " (call trtpaged_open_options_init)");
      o = *options;
    }
    const bool prefix_caching = flag(o.enable_prefix_caching, "options.enable_prefix_caching");
    const std::string backend = o.backend ? o.backend : "auto";
    if (backend == "tensorrt" || backend == "cuda")
      raise(TRTPAGED_ERR_UNSUPPORTED, "options.backend: '" + backend +
                                          "' is not implemented by the C runtime (CPU only); use the Python runtime");
    if (backend != "auto" && backend != "cpu")
      invalid("options.backend: got '" + backend + "'; one of auto, cpu");
    auto rt = std::make_unique<trtpaged_runtime>();
    const std::string root = resolve_engine_dir(engine_dir);
    rt->manifest = read_manifest(root);
    const Manifest& m = rt->manifest;
    const std::string where = root + "/trtpaged.json: ";
    if (!std::count(m.backends.begin(), m.backends.end(), "torch"))
      raise(TRTPAGED_ERR_UNSUPPORTED,
            where + "backends: the engine has no CPU (torch) form; the C runtime runs only that");
    if (std::none_of(std::begin(kArchitectures), std::end(kArchitectures),
                     [&](const char* a) { return m.architecture == a; })) {
      std::string supported;
      for (const char* a : kArchitectures) supported += (supported.empty() ? "" : ", ") + std::string(a);
      raise(TRTPAGED_ERR_UNSUPPORTED,
            where + "dims.architecture: " + m.architecture + " is not supported; supported: " + supported);
    }
    if (m.tensor_parallel != 1)
      raise(TRTPAGED_ERR_UNSUPPORTED, where + "tensor_parallel: " + std::to_string(m.tensor_parallel) +
                                          " ranks; the C runtime runs unsplit engines only");
    if (m.dtype != "float32")
      raise(TRTPAGED_ERR_UNSUPPORTED, where + "dtype: " + m.dtype + "; the C runtime's CPU backend computes float32");
    if (m.head_dim % 16 || m.head_dim > 256)
      raise(TRTPAGED_ERR_UNSUPPORTED, where + "dims.head_dim: " + std::to_string(m.head_dim) +
                                          "; the CPU attention takes multiples of 16 up to 256");
    rt->limits.block_size = int32_t(m.block_size);
    rt->limits.max_batch_size = tightened("max_batch_size", o.max_batch_size, m.max_batch_size);
    rt->limits.max_num_tokens = tightened("max_num_tokens", o.max_num_tokens, m.max_num_tokens);
    rt->limits.max_seq_len = tightened("max_seq_len", o.max_seq_len, m.max_seq_len);
    if (rt->limits.max_num_tokens < rt->limits.max_batch_size)
      invalid("options.max_num_tokens: " + std::to_string(rt->limits.max_num_tokens) + " is less than max_batch_size " +
              std::to_string(rt->limits.max_batch_size));
    std::string field;
    const int64_t blocks = kv_blocks(m, o, where, &field);
    rt->block_bytes = m.kv_bytes_per_block();
    const int64_t available = meminfo_available();
    if (double(blocks) * double(rt->block_bytes) > double(available))
      raise(TRTPAGED_ERR_OUT_OF_MEMORY, field + ": " + std::to_string(blocks) + " blocks of " +
                                            std::to_string(rt->block_bytes) + " bytes need more than the " +
                                            std::to_string(available) + " bytes this host has available");
    rt->num_kv_blocks = int32_t(blocks);
    const std::string weights = engine_path(root, m.weights_file, "weights_file");
    rt->model = std::make_unique<CpuModel>(m, weights, where);  // checks the header before reading any tensor
    void* pool = allocate_pool(size_t(blocks) * size_t(rt->block_bytes));
    if (!pool)
      raise(TRTPAGED_ERR_OUT_OF_MEMORY,
            field + ": cannot allocate " + std::to_string(blocks) + " KV blocks");
    rt->pool.reset(static_cast<unsigned char*>(pool));
    std::vector<int32_t> eos(m.eos_token_ids.begin(), m.eos_token_ids.end());
    // every layer windowed: the largest window, past which a request's blocks go back to the pool (dims.max_window)
    const auto& w = m.layer_windows;
    int32_t reclaim_window = 0;
    if (!w.empty() && std::find(w.begin(), w.end(), 0) == w.end())
      reclaim_window = int32_t(std::min<int64_t>(*std::max_element(w.begin(), w.end()), INT32_MAX));
    rt->scheduler = std::make_unique<Scheduler>(rt->limits, rt->num_kv_blocks, prefix_caching,
                                                reclaim_window, eos);
    *out = rt.release();
  });
}

TRTPAGED_API void trtpaged_runtime_close(trtpaged_runtime* runtime) { delete runtime; }

TRTPAGED_API trtpaged_status trtpaged_runtime_get_info(const trtpaged_runtime* rt, trtpaged_runtime_info* out) {
  return guarded_on(rt, [&] {
    need(out, "out");
    const Manifest& m = rt->manifest;
    *out = trtpaged_runtime_info{};
    out->vocab_size = int32_t(m.vocab_size);
    out->hidden_size = int32_t(m.hidden_size);
    out->num_layers = int32_t(m.num_layers);
    out->num_heads = int32_t(m.num_heads);
    out->num_kv_heads = int32_t(m.num_kv_heads);
    out->head_dim = int32_t(m.head_dim);
    out->block_size = rt->limits.block_size;
    out->max_batch_size = rt->limits.max_batch_size;
    out->max_num_tokens = rt->limits.max_num_tokens;
    out->max_seq_len = rt->limits.max_seq_len;
    out->num_kv_blocks = rt->num_kv_blocks;
    out->kv_bytes_per_block = rt->block_bytes;
    out->num_eos_token_ids = int32_t(std::min<size_t>(8, m.eos_token_ids.size()));
    for (int32_t i = 0; i < out->num_eos_token_ids; ++i) out->eos_token_ids[i] = int32_t(m.eos_token_ids[size_t(i)]);
    out->quantized = rt->model->quantized();
    out->one_call_layers = rt->model->one_call();
  });
}

TRTPAGED_API trtpaged_status trtpaged_runtime_step(trtpaged_runtime* rt, const trtpaged_step_inputs* inputs,
                                                   float* logits, size_t logits_capacity) {
  return guarded_on(rt, [&] {
    need(inputs, "inputs");
    if (inputs->num_outputs > 0) need(logits, "logits");
    refuse_while_requests_run(*rt);
    check_step(*rt, *inputs, logits_capacity);
    rt->scheduler->forget_cached_prefixes();
    run_model(*rt, *inputs, logits);
  });
}

TRTPAGED_API trtpaged_status trtpaged_runtime_copy_blocks(trtpaged_runtime* rt, const int32_t* pairs,
                                                          int32_t num_pairs) {
  return guarded_on(rt, [&] {
    if (num_pairs > 0) need(pairs, "pairs");
    refuse_while_requests_run(*rt);
    rt->scheduler->forget_cached_prefixes();
    check_kernel(trtpaged_copy_blocks_cpu(rt->pool.get(), rt->num_kv_blocks, size_t(rt->block_bytes), pairs, num_pairs),
                 "copy_blocks");
  });
}

TRTPAGED_API trtpaged_status trtpaged_request_add(trtpaged_runtime* rt, const int32_t* prompt, int32_t prompt_len,
                                                  const trtpaged_sampling* sampling, int64_t* request_id) {
  return guarded_on(rt, [&] {
    need(request_id, "request_id");
    if (prompt_len > 0) need(prompt, "prompt");
    trtpaged_sampling s;
    trtpaged_sampling_init(&s);
    if (sampling) {
      if (sampling->struct_size != sizeof s)
        invalid("sampling.struct_size: got " + std::to_string(sampling->struct_size) + ", this library's is " +
                std::to_string(sizeof s) + " (call trtpaged_sampling_init)");
      s = *sampling;
    }
    rt->scheduler->check_request(prompt_len, s.max_tokens);  // first: a length that cannot run is not read
    const bool has_seed = flag(s.has_seed, "sampling.has_seed");
    const bool ignore_eos = flag(s.ignore_eos, "sampling.ignore_eos");
    const int64_t vocab = rt->manifest.vocab_size;
    check_token_ids(prompt, prompt_len, vocab, "prompt");
    if (!(std::isfinite(s.temperature) && s.temperature >= 0))
      invalid("sampling.temperature: got " + std::to_string(s.temperature) + "; expected a finite number >= 0");
    if (s.top_k < -1)
      invalid("sampling.top_k: got " + std::to_string(s.top_k) + "; expected >= 0 (0 or -1, vLLM's: off)");
    if (s.top_k == -1) s.top_k = 0;
    if (!(s.top_p > 0 && s.top_p <= 1)) invalid("sampling.top_p: got " + std::to_string(s.top_p) + "; expected (0, 1]");
    if (s.num_stop_token_ids < 0 || s.num_stop_token_ids > 64)
      invalid("sampling.num_stop_token_ids: got " + std::to_string(s.num_stop_token_ids) + "; expected 0 to 64");
    if (s.num_stop_token_ids > 0) need(s.stop_token_ids, "sampling.stop_token_ids");
    check_token_ids(s.stop_token_ids, s.num_stop_token_ids, vocab, "sampling.stop_token_ids");
    auto r = std::make_unique<Request>();
    r->id = rt->next_id++;
    r->arrival = r->id;
    r->tokens.assign(prompt, prompt + prompt_len);
    r->num_prompt_tokens = prompt_len;
    r->sampling.max_tokens = s.max_tokens;
    r->sampling.temperature = s.temperature;
    r->sampling.top_k = s.top_k;
    r->sampling.top_p = s.top_p;
    r->sampling.ignore_eos = ignore_eos;
    r->sampling.stop_token_ids.assign(s.stop_token_ids, s.stop_token_ids + s.num_stop_token_ids);
    r->rng.seed(has_seed ? s.seed : rt->rng());
    rt->scheduler->add(r.get());
    *request_id = r->id;
    rt->requests[r->id] = std::move(r);
  });
}

TRTPAGED_API trtpaged_status trtpaged_runtime_run_step(trtpaged_runtime* rt, int32_t* num_tokens) {
  if (num_tokens) *num_tokens = 0;
  return guarded_on(rt, [&] {
    const int32_t n = run_requests_step(*rt);
    if (num_tokens) *num_tokens = n;
  });
}

TRTPAGED_API trtpaged_status trtpaged_request_read(trtpaged_runtime* rt, int64_t request_id, int32_t* tokens,
                                                   int32_t capacity, int32_t* num_read, int32_t* finish_reason) {
  if (num_read) *num_read = 0;
  return guarded_on(rt, [&] {
    need(num_read, "num_read");
    need(finish_reason, "finish_reason");
    if (capacity < 0) invalid("capacity: got " + std::to_string(capacity) + "; expected >= 0");
    if (capacity > 0) need(tokens, "tokens");
    Request& r = find_request(*rt, request_id);
    const size_t outputs = size_t(r.num_outputs());
    const size_t n = std::min(outputs - r.num_read, size_t(capacity));
    std::copy_n(r.tokens.begin() + long(size_t(r.num_prompt_tokens) + r.num_read), n, tokens);
    r.num_read += n;
    *num_read = int32_t(n);
    // the reason comes with the last token, so a reader looping while RUNNING gets every token whatever its buffer
    const bool done = r.status == Status::kFinished && r.num_read == outputs;
    *finish_reason = done ? r.finish_reason : TRTPAGED_RUNNING;
    if (done) rt->requests.erase(request_id);
  });
}

TRTPAGED_API trtpaged_status trtpaged_request_abort(trtpaged_runtime* rt, int64_t request_id) {
  return guarded_on(rt, [&] {
    Request& r = find_request(*rt, request_id);
    if (r.status != Status::kFinished) rt->scheduler->abort(&r);
  });
}

TRTPAGED_API trtpaged_status trtpaged_runtime_get_stats(const trtpaged_runtime* rt, trtpaged_runtime_stats* out) {
  return guarded_on(rt, [&] {
    need(out, "out");
    *out = trtpaged_runtime_stats{};
    const auto c = counters_of(*rt);
    out->num_waiting = int32_t(c.at("num_waiting"));
    out->num_running = int32_t(c.at("num_running"));
    out->num_steps = c.at("num_steps");
    out->num_tokens_computed = c.at("num_tokens_computed");
    out->num_preemptions = c.at("num_preemptions");
    out->kv_blocks_free = c.at("kv_blocks_free");
    out->kv_blocks_used = c.at("kv_blocks_used");
    out->prefix_cache_hits_tokens = c.at("prefix_cache_hits_tokens");
  });
}

TRTPAGED_API trtpaged_status trtpaged_runtime_get_counter(const trtpaged_runtime* rt, const char* name,
                                                          int64_t* value) {
  return guarded_on(rt, [&] {
    need(name, "name");
    need(value, "value");
    const std::map<std::string, int64_t> counters = counters_of(*rt);
    const std::string key(name, strnlen(name, 64));
    auto it = counters.find(key);
    if (it == counters.end()) {
      std::string known;
      for (const auto& [k, v] : counters) known += (known.empty() ? "" : ", ") + k;
      invalid("name: got '" + key.substr(0, 40) + (key.size() > 40 || name[key.size()] ? "...'" : "'") +
              "; expected one of " + known);
    }
    *value = it->second;
  });
}

}  // extern "C"
