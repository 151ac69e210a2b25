// Generates greedily from an engine dir with the C runtime (trtpaged/runtime.h), without Python.
//
//   trtpaged_generate ENGINE_DIR [options] PROMPT...
//
// Each PROMPT is a comma-separated list of token ids ("1,2,3"): tokenization stays with the embedder.
// All prompts are added at once and run with continuous batching; each request's tokens are printed
// as it finishes:  "request <i>: <ids separated by spaces> (<finish reason>)".
// Options: --max-tokens N (default 16), --num-kv-blocks N, --max-num-tokens N, --max-batch-size N,
// --ignore-eos, --no-prefix-caching, --stats (a line of scheduler counters), --bench (single-stream
// decode speed of the first prompt: "decode_tok_s <x>").
#include <cctype>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "trtpaged/runtime.h"

namespace {

const char* reason_name(int32_t r) {
  switch (r) {
    case TRTPAGED_FINISH_STOP: return "stop";
    case TRTPAGED_FINISH_LENGTH: return "length";
    case TRTPAGED_FINISH_ABORT: return "abort";
    case TRTPAGED_FINISH_ERROR: return "error";
    default: return "running";
  }
}

int fail(const char* what) {
  std::fprintf(stderr, "error: %s: %s\n", what, trtpaged_last_error());
  return 1;
}

// text as a whole base-10 integer in [low, high] (atol read "1e3" as 1 and "abc" as 0, and a cast to int32 wrapped
// 99999999999 to another number): false otherwise.
bool parse_int(const std::string& text, long long low, long long high, long long* out) {
  if (text.empty() || std::isspace(static_cast<unsigned char>(text[0]))) return false;
  errno = 0;
  char* stop = nullptr;
  const long long v = std::strtoll(text.c_str(), &stop, 10);
  if (*stop || errno == ERANGE || v < low || v > high) return false;
  *out = v;
  return true;
}

// A PROMPT's comma-separated token ids; false, with the message printed, when one is not a token id.
bool parse_prompt(const char* text, std::vector<int32_t>* out) {
  std::string s(text);
  size_t start = 0;
  while (start <= s.size()) {
    size_t end = s.find(',', start);
    if (end == std::string::npos) end = s.size();
    const std::string item = s.substr(start, end - start);
    long long v = 0;
    if (!parse_int(item, 0, INT32_MAX, &v)) {
      std::fprintf(stderr, "error: PROMPT '%s': '%s' is not a token id (comma-separated integers in [0, %d])\n", text,
                   item.c_str(), INT32_MAX);
      return false;
    }
    out->push_back(int32_t(v));
    start = end + 1;
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s ENGINE_DIR [--max-tokens N] [--num-kv-blocks N] [--max-num-tokens N] "
                         "[--max-batch-size N] [--ignore-eos] [--no-prefix-caching] [--stats] [--bench] PROMPT...\n",
                 argv[0]);
    return 2;
  }
  trtpaged_open_options options;
  trtpaged_open_options_init(&options);
  trtpaged_sampling sampling;
  trtpaged_sampling_init(&sampling);  // greedy
  bool stats = false, bench = false;
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&](const char* name) {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "error: %s needs a value\n", name);
        std::exit(2);
      }
      long long v = 0;
      const long long high = std::strcmp(name, "--num-kv-blocks") ? INT32_MAX : INT64_MAX;
      if (!parse_int(argv[++i], -high - 1, high, &v)) {
        std::fprintf(stderr, "error: %s: '%s' is not an integer in [%lld, %lld]\n", name, argv[i], -high - 1, high);
        std::exit(2);
      }
      return v;  // in range: the runtime names the option's own limits
    };
    if (a == "--max-tokens") sampling.max_tokens = int32_t(value("--max-tokens"));
    else if (a == "--num-kv-blocks") options.num_kv_blocks = value("--num-kv-blocks");
    else if (a == "--max-num-tokens") options.max_num_tokens = int32_t(value("--max-num-tokens"));
    else if (a == "--max-batch-size") options.max_batch_size = int32_t(value("--max-batch-size"));
    else if (a == "--ignore-eos") sampling.ignore_eos = 1;
    else if (a == "--no-prefix-caching") options.enable_prefix_caching = 0;
    else if (a == "--stats") stats = true;
    else if (a == "--bench") bench = true;
    else if (a.rfind("--", 0) == 0) {
      std::fprintf(stderr, "error: unknown option '%s'\n", argv[i]);
      return 2;
    } else {
      prompts.emplace_back();
      if (!parse_prompt(argv[i], &prompts.back())) return 2;
    }
  }
  trtpaged_runtime* rt = nullptr;
  if (trtpaged_runtime_open(argv[1], &options, &rt) != TRTPAGED_OK) return fail("open");
  int rc = 0;
  std::vector<int64_t> ids;
  std::vector<std::vector<int32_t>> outputs(prompts.size());
  std::vector<int32_t> reasons(prompts.size(), TRTPAGED_RUNNING);
  for (const auto& p : prompts) {
    int64_t id = -1;
    if (trtpaged_request_add(rt, p.data(), int32_t(p.size()), &sampling, &id) != TRTPAGED_OK) {
      rc = fail("add");
      break;
    }
    ids.push_back(id);
  }
  using clock = std::chrono::steady_clock;
  clock::time_point first_token{};
  size_t done = 0;
  std::vector<int32_t> buf(4096);
  while (rc == 0 && done < ids.size()) {
    int32_t computed = 0;
    if (trtpaged_runtime_run_step(rt, &computed) != TRTPAGED_OK) {
      rc = fail("step");
      break;
    }
    for (size_t i = 0; i < ids.size(); ++i) {
      if (reasons[i] != TRTPAGED_RUNNING) continue;
      int32_t n = 0, reason = 0;
      do {
        if (trtpaged_request_read(rt, ids[i], buf.data(), int32_t(buf.size()), &n, &reason) != TRTPAGED_OK) {
          rc = fail("read");
          break;
        }
        outputs[i].insert(outputs[i].end(), buf.begin(), buf.begin() + n);
      } while (n == int32_t(buf.size()) && reason == TRTPAGED_RUNNING);
      if (i == 0 && outputs[0].size() == 1 && n == 1) first_token = clock::now();
      if (reason != TRTPAGED_RUNNING) {
        reasons[i] = reason;
        ++done;
        std::printf("request %zu:", i);
        for (int32_t t : outputs[i]) std::printf(" %d", t);
        std::printf(" (%s)\n", reason_name(reason));
        if (i == 0 && bench && outputs[0].size() > 1) {
          const double s = std::chrono::duration<double>(clock::now() - first_token).count();
          std::printf("decode_tok_s %.2f\n", double(outputs[0].size() - 1) / s);
        }
      }
    }
    if (computed == 0 && done < ids.size()) {
      std::fprintf(stderr, "error: the scheduler made no progress\n");
      rc = 1;
    }
  }
  if (stats && rc == 0) {
    trtpaged_runtime_stats st;
    int64_t reclaimed = 0;
    if (trtpaged_runtime_get_stats(rt, &st) != TRTPAGED_OK ||
        trtpaged_runtime_get_counter(rt, "kv_blocks_reclaimed", &reclaimed) != TRTPAGED_OK)
      rc = fail("stats");
    else
      std::printf("stats: steps %lld tokens %lld preemptions %lld prefix_hits_tokens %lld blocks_used %lld "
                  "blocks_reclaimed %lld\n",
                  (long long)st.num_steps, (long long)st.num_tokens_computed, (long long)st.num_preemptions,
                  (long long)st.prefix_cache_hits_tokens, (long long)st.kv_blocks_used, (long long)reclaimed);
  }
  trtpaged_runtime_close(rt);
  return rc;
}
