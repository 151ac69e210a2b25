// Error reporting and argument validation shared by every backend.
#include <new>
#include <string>
#include <unordered_set>

#include "common.h"

namespace trtpaged {
namespace {
thread_local std::string g_last_error;

std::string dims_list(const AttentionLimits& limits) {
  std::string s;
  for (int i = 0; i < limits.num_head_dims; ++i) s += (i ? ", " : "") + std::to_string(limits.head_dims[i]);
  return s;
}
}  // namespace

// The length of the well-formed UTF-8 sequence at s[i] (shortest form, no surrogates, at most U+10FFFF), 0 if none.
static size_t utf8_sequence(const std::string& s, size_t i) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char b = byte(i);
  if (b < 0x80) return 1;
  size_t n = b >= 0xF0 && b <= 0xF4 ? 4 : b >= 0xE0 ? 3 : b >= 0xC2 && b <= 0xDF ? 2 : 0;
  if (n == 3 && b > 0xEF) n = 0;
  if (n == 0 || i + n > s.size()) return 0;
  for (size_t k = 1; k < n; ++k)
    if ((byte(i + k) & 0xC0) != 0x80) return 0;
  const unsigned char c = byte(i + 1);
  if ((b == 0xE0 && c < 0xA0) || (b == 0xED && c > 0x9F) || (b == 0xF0 && c < 0x90) || (b == 0xF4 && c > 0x8F))
    return 0;
  return n;
}

// Messages may quote untrusted bytes (a corrupt manifest's): bytes that are not UTF-8 are written as \xNN, so
// that every binding can decode trtpaged_last_error() as UTF-8.
static std::string utf8_safe(const std::string& msg) {
  std::string out;
  out.reserve(msg.size());
  for (size_t i = 0; i < msg.size();) {
    const size_t n = utf8_sequence(msg, i);
    if (n) {
      out.append(msg, i, n);
      i += n;
      continue;
    }
    static const char hex[] = "0123456789abcdef";
    const unsigned char b = static_cast<unsigned char>(msg[i++]);
    out += "\\x";
    out += hex[b >> 4];
    out += hex[b & 15];
  }
  return out;
}

int fail(int code, const std::string& msg) {
  g_last_error = utf8_safe(msg);
  return code;
}

int fail_from(const std::exception& e, const char* where) {
  if (dynamic_cast<const std::bad_alloc*>(&e))
    return fail(TRTPAGED_ERR_OUT_OF_MEMORY, std::string(where) + ": out of memory (" + e.what() + ")");
  return fail(TRTPAGED_ERR_INVALID_ARGUMENT, std::string(where) + ": " + e.what());
}

int ok() {
  g_last_error.clear();
  return TRTPAGED_OK;
}

const char* last_error() { return g_last_error.c_str(); }

bool dtype_valid(trtpaged_dtype dtype) {
  return dtype == TRTPAGED_FLOAT32 || dtype == TRTPAGED_FLOAT16 || dtype == TRTPAGED_BFLOAT16;
}

bool kv_cache_dtype_valid(trtpaged_dtype dtype) {
  return dtype_valid(dtype) || dtype == TRTPAGED_INT8 || dtype == TRTPAGED_FP8_E4M3;
}

bool kv_cache_dtype_quantized(trtpaged_dtype dtype) { return dtype == TRTPAGED_INT8 || dtype == TRTPAGED_FP8_E4M3; }

size_t dtype_size(trtpaged_dtype dtype) {
  return dtype == TRTPAGED_FLOAT32 ? 4 : (kv_cache_dtype_quantized(dtype) ? 1 : 2);
}

int validate_attention_options(const trtpaged_attention_options& o) {
  if (o.sliding_window < 0)
    return fail(TRTPAGED_ERR_INVALID_ARGUMENT, "sliding_window: " + std::to_string(o.sliding_window) + " is negative");
  if (!(o.logit_softcap >= 0.0f) || o.logit_softcap > 3.0e38f)
    return fail(TRTPAGED_ERR_INVALID_ARGUMENT, "logit_softcap: must be finite and >= 0 (0: none)");
  return TRTPAGED_OK;
}

int validate_attention_params(const trtpaged_attention_params* p, const AttentionLimits& limits) {
  if (!p) return fail(TRTPAGED_ERR_INVALID_ARGUMENT, "params: null pointer");
  auto bad = [](const std::string& msg) { return fail(TRTPAGED_ERR_INVALID_ARGUMENT, msg); };
  if (p->num_tokens < 0) return bad("num_tokens: " + std::to_string(p->num_tokens) + " is negative");
  if (p->num_seqs < 0) return bad("num_seqs: " + std::to_string(p->num_seqs) + " is negative");
  if (p->num_tokens > 0 && p->num_seqs == 0) return bad("num_seqs: 0 with num_tokens > 0");
  if (p->max_blocks_per_seq < 0) return bad("max_blocks_per_seq: must be >= 0");
  if (p->num_kv_heads <= 0) return bad("num_kv_heads: " + std::to_string(p->num_kv_heads) + " must be > 0");
  if (p->num_heads <= 0 || p->num_heads % p->num_kv_heads != 0)
    return bad("num_heads: " + std::to_string(p->num_heads) + " must be a positive multiple of num_kv_heads (" +
               std::to_string(p->num_kv_heads) + ")");
  if (p->num_kv_blocks <= 0) return bad("num_kv_blocks: " + std::to_string(p->num_kv_blocks) + " must be > 0");
  if (p->num_layers <= 0) return bad("num_layers: " + std::to_string(p->num_layers) + " must be > 0");
  if (p->layer < 0 || p->layer >= p->num_layers)
    return bad("layer: " + std::to_string(p->layer) + " out of range [0, " + std::to_string(p->num_layers) + ")");
  if (!(p->scale > 0.0f)) return bad("scale: must be > 0");
  if (!dtype_valid(p->io_dtype))
    return bad("io_dtype: dtype " + std::to_string(p->io_dtype) + " not one of float32, float16, bfloat16");
  if (!kv_cache_dtype_valid(p->kv_cache_dtype))
    return bad("kv_cache_dtype: dtype " + std::to_string(p->kv_cache_dtype) +
               " not one of float32, float16, bfloat16, int8, fp8_e4m3");
  if (limits.any_block_size) {
    if (p->block_size <= 0) return bad("block_size: " + std::to_string(p->block_size) + " must be > 0");
  } else if (p->block_size != 8 && p->block_size != 16 && p->block_size != 32 && p->block_size != 64 &&
             p->block_size != 128) {
    return bad("block_size: " + std::to_string(p->block_size) + " not one of 8, 16, 32, 64, 128");
  }
  if (p->head_dim <= 0) return bad("head_dim: " + std::to_string(p->head_dim) + " must be > 0");
  if (limits.head_dims) {
    for (int i = 0; i < limits.num_head_dims; ++i)
      if (limits.head_dims[i] == p->head_dim) return ok();
    return fail(TRTPAGED_ERR_UNSUPPORTED,
                "head_dim: " + std::to_string(p->head_dim) + " not supported (supported: " + dims_list(limits) + ")");
  }
  if (p->head_dim % limits.head_dim_multiple != 0 || p->head_dim > limits.max_head_dim)
    return fail(TRTPAGED_ERR_UNSUPPORTED, "head_dim: " + std::to_string(p->head_dim) + " not supported (a multiple of " +
                                              std::to_string(limits.head_dim_multiple) + " up to " +
                                              std::to_string(limits.max_head_dim) + ")");
  return ok();
}

int validate_block_pairs(const int32_t* pairs, int32_t num_pairs, int32_t src_num_kv_blocks, int32_t dst_num_kv_blocks,
                         bool same_pool) {
  if (num_pairs < 0) return fail(TRTPAGED_ERR_INVALID_ARGUMENT, "num_pairs: must be >= 0");
  if (num_pairs > 0 && !pairs) return fail(TRTPAGED_ERR_INVALID_ARGUMENT, "pairs: null pointer");
  std::unordered_set<int32_t> dsts;
  for (int32_t i = 0; i < num_pairs; ++i) {
    const int32_t src = pairs[2 * i], dst = pairs[2 * i + 1];
    if (src < 0 || src >= src_num_kv_blocks)
      return fail(TRTPAGED_ERR_INVALID_ARGUMENT, "pairs[" + std::to_string(i) + "]: source block " +
                                                     std::to_string(src) + " out of range [0, " +
                                                     std::to_string(src_num_kv_blocks) + ")");
    if (dst < 0 || dst >= dst_num_kv_blocks)
      return fail(TRTPAGED_ERR_INVALID_ARGUMENT, "pairs[" + std::to_string(i) + "]: destination block " +
                                                     std::to_string(dst) + " out of range [0, " +
                                                     std::to_string(dst_num_kv_blocks) + ")");
    if (!dsts.insert(dst).second)
      return fail(TRTPAGED_ERR_INVALID_ARGUMENT,
                  "pairs[" + std::to_string(i) + "]: destination block " + std::to_string(dst) + " written twice");
  }
  if (same_pool) {
    for (int32_t i = 0; i < num_pairs; ++i)
      if (dsts.count(pairs[2 * i]))
        return fail(TRTPAGED_ERR_INVALID_ARGUMENT, "pairs[" + std::to_string(i) + "]: block " +
                                                       std::to_string(pairs[2 * i]) +
                                                       " is both a source and a destination");
  }
  return ok();
}

}  // namespace trtpaged
