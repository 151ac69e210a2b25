// Reading an engine dir's manifest and safetensors header with nlohmann/json; the checks mirror
// trtpaged/manifest.py and trtpaged/engine_files.py (same bounds, same field names in messages).
#include "runtime/engine_dir.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <utility>

#include <nlohmann/json.hpp>

#include "runtime/error.h"

namespace trtpaged::rt {

namespace {

using json = nlohmann::json;

constexpr const char* kManifestName = "trtpaged.json";
constexpr int64_t kMaxManifestBytes = 16 << 20;
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;
constexpr int64_t kMaxKvBlocks = (int64_t(1) << 31) - 1;
constexpr int64_t kMaxKvMemory = int64_t(1) << 50;

const std::map<std::string, int> kSafetensorsDtypeBytes = {
    {"F64", 8}, {"F32", 4}, {"F16", 2}, {"BF16", 2}, {"I64", 8}, {"I32", 4}, {"I16", 2},
    {"I8", 1},  {"U8", 1},  {"BOOL", 1}, {"F8_E4M3", 1}, {"F8_E5M2", 1}};
// name -> (element bytes, scale bytes) of the KV formats (trtpaged/kv_formats.py)
const std::map<std::string, std::pair<int, int>> kKvFormats = {
    {"float32", {4, 0}}, {"float16", {2, 0}}, {"bfloat16", {2, 0}}, {"int8", {1, 2}}, {"fp8_e4m3", {1, 2}}};

// Manifests and safetensors headers nest 3 or 4 levels; nlohmann's dump, copy and comparison recurse, so a value
// nested 100,000 deep would overflow the stack (in an error message, at that).
constexpr int kMaxJsonDepth = 64;
struct JsonTooDeep {};

// Parses untrusted JSON, throwing JsonTooDeep past kMaxJsonDepth levels (json::exception when it is not JSON).
json parse_bounded(const std::string& text) {
  return json::parse(text, [](int depth, json::parse_event_t, json&) {
    if (depth > kMaxJsonDepth) throw JsonTooDeep{};
    return true;
  });
}

std::string show(const json& v) {
  if (v.is_array() && v.size() > 8) return "a list of " + std::to_string(v.size()) + " items";
  if (v.is_object() && v.size() > 8) return "an object of " + std::to_string(v.size()) + " keys";
  std::string s = v.dump();
  return s.size() > 80 ? s.substr(0, 80) + "..." : s;
}

std::string real_path(const std::string& path) {
  std::unique_ptr<char, decltype(&std::free)> real(::realpath(path.c_str(), nullptr), &std::free);
  return real ? std::string(real.get()) : std::string();
}

bool is_inside(const std::string& root, const std::string& path) {
  return path == root || (path.size() > root.size() && path.compare(0, root.size(), root) == 0 &&
                          (root.back() == '/' || path[root.size()] == '/'));
}

void check_relative(const std::string& rel, const std::string& field, const std::string& where) {
  bool bad = rel.empty() || rel.size() > 4096 || rel.find('\0') != std::string::npos ||
             rel.find('\\') != std::string::npos || rel[0] == '/';
  size_t start = 0;
  while (!bad && start <= rel.size()) {
    size_t end = rel.find('/', start);
    if (end == std::string::npos) end = rel.size();
    if (rel.compare(start, end - start, "..") == 0 && end - start == 2) bad = true;
    start = end + 1;
  }
  if (bad)
    invalid(where + ": " + field + ": '" + rel.substr(0, 200) +
            "' is not a path inside the engine dir (absolute paths and '..' are refused)");
}

// Strict field access: the manifest's types are checked exactly (as pydantic's strict mode does).
class Fields {
 public:
  Fields(const json& obj, std::string prefix, std::string where)
      : obj_(obj), prefix_(std::move(prefix)), where_(std::move(where)) {}

  [[noreturn]] void bad(const std::string& name, const std::string& message) const {
    invalid(where_ + ": " + prefix_ + name + ": " + message);
  }
  void only(std::initializer_list<const char*> allowed) const {
    for (auto it = obj_.begin(); it != obj_.end(); ++it) {
      if (std::none_of(allowed.begin(), allowed.end(), [&](const char* a) { return it.key() == a; }))
        bad(it.key(), "unknown field");
    }
  }
  bool has(const char* name) const { return obj_.contains(name); }
  // Python's non-Optional fields (a default, not None) refuse null: so do these, every field but the nullable
  void refuse_nulls(std::initializer_list<const char*> nullable) const {
    for (auto it = obj_.begin(); it != obj_.end(); ++it)
      if (it->is_null() && std::none_of(nullable.begin(), nullable.end(), [&](const char* n) { return it.key() == n; }))
        bad(it.key(), "got null; expected a value");
  }
  const json* get(const char* name, bool required) const {
    auto it = obj_.find(name);
    if (it == obj_.end() || (it->is_null() && !required)) {
      if (required) bad(name, "missing");
      return nullptr;
    }
    return &*it;
  }
  int64_t integer(const char* name, int64_t low, int64_t high, bool required = true, int64_t fallback = 0) const {
    const json* v = get(name, required);
    if (!v) return fallback;
    if (!v->is_number_integer()) bad(name, "got " + show(*v) + "; expected an integer");
    if (v->is_number_unsigned() && v->get<uint64_t>() > uint64_t(INT64_MAX))
      bad(name, "got " + show(*v) + "; too large");
    int64_t x = v->get<int64_t>();
    if (x < low || x > high)
      bad(name, "got " + std::to_string(x) + "; expected " + std::to_string(low) + " to " + std::to_string(high));
    return x;
  }
  double number(const char* name, bool required = true, double fallback = 0) const {
    const json* v = get(name, required);
    if (!v) return fallback;
    if (!v->is_number_float() && !v->is_number_integer()) bad(name, "got " + show(*v) + "; expected a number");
    return v->get<double>();
  }
  double positive(const char* name) const {
    double x = number(name);
    if (!(std::isfinite(x) && x > 0)) bad(name, "got " + show(obj_.at(name)) + "; expected a finite positive number");
    return x;
  }
  // as trtpaged/manifest.py: a value the kernels take as a float must stay finite and non-zero in float32
  double positive_float32(const char* name) const {
    const double x = positive(name);
    const float f = float(x);
    if (!(std::isfinite(f) && f > 0))
      bad(name, "got " + show(obj_.at(name)) + "; expected a positive number, finite and not 0 in float32 (the "
                "kernels' type)");
    return x;
  }
  // a finite positive number, or fallback where the field is absent or null (rope.py's `p.get(name) or fallback`)
  double positive_or(const char* name, double fallback) const { return get(name, false) ? positive(name) : fallback; }
  double finite_or(const char* name, double fallback) const {
    const double x = number(name, false, fallback);
    if (!std::isfinite(x)) bad(name, "got " + show(obj_.at(name)) + "; expected a finite number");
    return x;
  }
  bool boolean(const char* name, bool fallback) const {
    const json* v = get(name, false);
    if (!v) return fallback;
    if (!v->is_boolean()) bad(name, "got " + show(*v) + "; expected true or false");
    return v->get<bool>();
  }
  std::string string(const char* name, bool required = true, const std::string& fallback = "") const {
    const json* v = get(name, required);
    if (!v) return fallback;
    if (!v->is_string()) bad(name, "got " + show(*v) + "; expected a string");
    return v->get<std::string>();
  }
  const json& object(const char* name, bool required = true) const {
    static const json empty = json::object();
    const json* v = get(name, required);
    if (!v) return empty;
    if (!v->is_object()) bad(name, "got " + show(*v) + "; expected an object");
    return *v;
  }
  const json& array(const char* name) const {
    static const json empty = json::array();
    const json* v = get(name, false);
    if (!v) return empty;
    if (!v->is_array()) bad(name, "got " + show(*v) + "; expected a list");
    return *v;
  }
  const std::string& where() const { return where_; }

 private:
  const json& obj_;
  std::string prefix_, where_;
};

std::string read_small_file(const std::string& path, int64_t limit, const std::string& field) {
  std::unique_ptr<FILE, decltype(&std::fclose)> f(std::fopen(path.c_str(), "rb"), &std::fclose);
  if (!f) raise(TRTPAGED_ERR_IO, path + ": " + field + ": cannot be read (" + std::strerror(errno) + ")");
  std::string text;
  char buf[65536];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f.get())) > 0) {
    text.append(buf, n);
    if (int64_t(text.size()) > limit)
      invalid(path + ": " + field + ": larger than " + std::to_string(limit) + " bytes");
  }
  return text;
}

// longrope's factors: one finite positive number per rotated pair (as rope.py divides the frequencies by them)
std::vector<double> read_rope_factors(const Fields& r, const char* name, int64_t pairs) {
  const json* list = r.get(name, true);
  auto finite_positive = [](const json& f) {
    return f.is_number() && std::isfinite(f.get<double>()) && f.get<double>() > 0;
  };
  if (!list->is_array() || int64_t(list->size()) != pairs || !std::all_of(list->begin(), list->end(), finite_positive))
    r.bad(name, "got " + show(*list) + "; expected " + std::to_string(pairs) + " finite positive numbers, one per "
                "rotated pair of the " + std::to_string(2 * pairs) + " rotary dims");
  return list->get<std::vector<double>>();
}

// yarn's and longrope's keys, with the defaults trtpaged/models/rope.py takes where one is absent
void read_long_context_rope(const Fields& r, Manifest& m) {
  RopeScaling& s = m.rope;
  s.original_max_position_embeddings = r.positive_or("original_max_position_embeddings",
                                                     double(m.max_position_embeddings));
  if (s.original_max_position_embeddings < 1)
    r.bad("original_max_position_embeddings", "got " + show(*r.get("original_max_position_embeddings", true)) +
                                                   "; expected a number of positions >= 1");
  s.original_max_position_embeddings = std::floor(s.original_max_position_embeddings);  // rope.py takes int()
  // it multiplies cos and sin: as the tables take it, a float32 (trtpaged/manifest.py checks the same)
  s.attention_factor = r.get("attention_factor", false) ? r.positive_float32("attention_factor") : 0;
  if (s.type == "yarn") {
    s.factor = r.positive("factor");
    s.beta_fast = r.positive_or("beta_fast", 32);
    s.beta_slow = r.positive_or("beta_slow", 1);
    s.mscale = r.finite_or("mscale", 0);
    s.mscale_all_dim = r.finite_or("mscale_all_dim", 0);
    if (r.has("truncate") && !r.get("truncate", true)->is_boolean())  // null too: rope.py reads it as false
      r.bad("truncate", "got " + show(*r.get("truncate", true)) + "; expected true or false");
    s.truncate = r.boolean("truncate", true);
    return;
  }
  s.factor = r.positive_or("factor", double(m.max_position_embeddings) / s.original_max_position_embeddings);
  const int64_t pairs = m.rotary_dim() / 2;
  s.short_factor = read_rope_factors(r, "short_factor", pairs);
  // the long factors are checked, not used: the build refuses a max_seq_len past the original length, where
  // transformers would switch to them
  if (r.has("long_factor")) read_rope_factors(r, "long_factor", pairs);
}

// dims.rope_scaling (after the rotary dims, which longrope's factors are counted against)
void read_rope_scaling(const json& value, Manifest& m, const std::string& where) {
  if (value.is_null()) return;
  if (!value.is_object()) invalid(where + ": dims.rope_scaling: got " + show(value) + "; expected an object or null");
  Fields r(value, "dims.rope_scaling.", where);
  // as rope.py reads it: rope_type where present (null too: refused below, as Python refuses "None"), else type
  const json* kind = r.has("rope_type") ? r.get("rope_type", true) : r.has("type") ? r.get("type", true) : nullptr;
  m.rope.type = kind ? (kind->is_string() ? kind->get<std::string>() : "?") : "default";
  if (m.rope.type == "linear") {
    m.rope.factor = r.positive("factor");
  } else if (m.rope.type == "llama3") {
    m.rope.factor = r.positive("factor");
    m.rope.low_freq_factor = r.positive("low_freq_factor");
    m.rope.high_freq_factor = r.positive("high_freq_factor");
    m.rope.original_max_position_embeddings = r.positive("original_max_position_embeddings");
    if (m.rope.high_freq_factor == m.rope.low_freq_factor)
      r.bad("high_freq_factor", "equals low_freq_factor (the blend divides by their difference)");
  } else if (m.rope.type == "yarn" || m.rope.type == "longrope") {
    read_long_context_rope(r, m);
  } else if (m.rope.type != "default") {
    raise(TRTPAGED_ERR_UNSUPPORTED, where + ": dims.rope_scaling.rope_type: got " + show(*kind) +
                                        "; the C runtime supports default, linear, llama3, yarn, longrope");
  }
}

// dims.layer_windows, checked as the Python reader checks it (one window >= 0 per layer, or none): true when no
// sequence reaches any layer's window (each 0, or >= max_seq_len: a stock Mistral config built shorter), which is no
// window at all.
bool windows_reach_no_sequence(const json& dims, int64_t max_seq_len, const std::string& where) {
  const json& value = dims["layer_windows"];
  const json* layers = dims.contains("num_layers") ? &dims["num_layers"] : nullptr;
  bool counted = value.is_array() && (value.empty() || (layers && layers->is_number_integer() &&
                                                        int64_t(value.size()) == layers->get<int64_t>()));
  if (!counted || !std::all_of(value.begin(), value.end(), [](const json& w) {
        return w.is_number_integer() && w.get<int64_t>() >= 0;
      }))
    invalid(where + ": dims.layer_windows: got " + show(value) + "; one window (a number of tokens >= 0, 0: "
            "global) per layer");
  return std::all_of(value.begin(), value.end(), [&](const json& w) {
    return w.get<int64_t>() == 0 || w.get<int64_t>() >= max_seq_len;
  });
}

// The fields of the families beyond Llama's (written only where they differ from Llama's), checked as
// trtpaged/manifest.py checks them: values the step model can run.
void read_family_fields(const Fields& dims, Manifest& m) {
  m.partial_rotary_factor = dims.number("partial_rotary_factor", false, 1);
  const bool in_range = m.partial_rotary_factor > 0 && m.partial_rotary_factor <= 1;  // then rotary_dim() is too
  if (!in_range || m.rotary_dim() < 2 || m.rotary_dim() % 2)
    dims.bad("partial_rotary_factor", "got " + show(*dims.get("partial_rotary_factor", true)) + "; expected a number "
             "in (0, 1] leaving an even number (>= 2) of head_dim " + std::to_string(m.head_dim) + "'s dims rotated");
  m.hidden_act = dims.string("hidden_act", false, "silu");
  if (m.hidden_act != "silu" && m.hidden_act != "gelu_tanh")
    dims.bad("hidden_act", "got " + show(*dims.get("hidden_act", true)) + "; one of silu, gelu_tanh");
  const bool gemma = m.architecture.rfind("Gemma", 0) == 0;
  m.gemma_norms = dims.boolean("gemma_norms", false);
  if (m.gemma_norms != gemma)
    dims.bad("gemma_norms", std::string("got ") + (m.gemma_norms ? "true" : "false") + " for " +
                                m.architecture.substr(0, 60) + "; Gemma's norms go with Gemma only");
  // Gemma's embeddings are scaled by sqrt(hidden_size) (transformers computes it); other families' are not
  const double scale = gemma ? std::sqrt(double(m.hidden_size)) : 1.0;
  m.embed_scale = dims.number("embed_scale", false, 1);
  if (!(std::fabs(m.embed_scale - scale) <= 1e-6 * std::max(std::fabs(m.embed_scale), scale))) {
    char expected[32];
    std::snprintf(expected, sizeof expected, "%g", scale);
    const std::string got = show(dims.has("embed_scale") ? *dims.get("embed_scale", true) : json(m.embed_scale));
    dims.bad("embed_scale", "got " + got + "; " + m.architecture.substr(0, 60) + " scales embeddings by " + expected +
                                (gemma ? " (sqrt(hidden_size))" : ""));
  }
  for (auto [name, value] : {std::pair{"attention_scale", &m.attention_scale},
                             std::pair{"attn_logit_softcap", &m.attn_logit_softcap},
                             std::pair{"final_logit_softcap", &m.final_logit_softcap},
                             std::pair{"local_rope_theta", &m.local_rope_theta}}) {
    *value = dims.number(name, false, 0);
    if (*value != 0 && !(gemma && std::isfinite(*value) && *value > 0 && std::isfinite(float(*value)) &&
                         float(*value) > 0))
      dims.bad(name, "got " + show(*dims.get(name, true)) + "; expected 0 (none) or, for Gemma, a positive number, "
                     "finite and not 0 in float32");
  }
}

void read_quantization(const json& q, Manifest& m, const std::string& where) {
  Fields f(q, "quantization.", where);
  if (q.empty()) return;
  // the summary's types, as trtpaged/manifest.py checks them (a float engine's manifest may not claim one)
  const json* weights = f.get("weights", false);
  if (!weights || !weights->is_string() || (*weights != "int8" && *weights != "int4"))
    f.bad("weights", "got " + (weights ? show(*weights) : std::string("none")) + "; one of int8, int4");
  f.integer("group_size", 1, INT64_MAX, false);
  for (const char* key : {"lm_head", "activations"}) f.string(key, false);
  const json& origin = f.object("origin", false);
  if (!std::all_of(origin.begin(), origin.end(), [](const json& n) { return n.is_number_integer(); }))
    f.bad("origin", "got " + show(origin) + "; expected {how: module count}");
  const json& modules = f.object("modules", false);
  for (auto it = modules.begin(); it != modules.end(); ++it) {
    const json& spec = it.value();
    bool ok = spec.is_array() && spec.size() == 2 && spec[0].is_number_integer() && spec[1].is_number_integer() &&
              (spec[0].get<int64_t>() == 4 || spec[0].get<int64_t>() == 8) && spec[1].get<int64_t>() > 0 &&
              spec[1].get<int64_t>() <= (1 << 20);
    if (!ok) f.bad("modules['" + it.key() + "']", "got " + show(spec) + "; expected [bits 4 or 8, group size]");
    m.quant_modules[it.key()] = {int(spec[0].get<int64_t>()), int(spec[1].get<int64_t>())};
  }
  if (!modules.empty()) {
    m.activations = f.string("activations", false, "int8");
    if (m.activations != "int8" && m.activations != "float")
      f.bad("activations", "got '" + m.activations + "'; one of float, int8");
  }
}

// Deprecated spellings of manifest fields written by older builds, read as their one name for one
// release (the same table as trtpaged/names.py RENAMED_KEYS).
constexpr std::pair<const char*, const char*> kRenamedKeys[] = {{"kv_dtype", "kv_cache_dtype"},
                                                                  {"num_blocks", "num_kv_blocks"}};

json renamed(const json& obj, const std::string& prefix, const std::string& where) {
  json out = obj;
  for (const auto& [old_name, new_name] : kRenamedKeys) {
    if (!out.is_object() || !out.contains(old_name)) continue;
    if (out.contains(new_name))
      invalid(where + ": " + prefix + new_name + ": set twice (" + prefix + old_name + " is its deprecated spelling)");
    out[new_name] = out[old_name];
    out.erase(old_name);
  }
  return out;
}

}  // namespace

bool Manifest::has_family_features() const {
  return partial_rotary_factor != 1 || hidden_act != "silu" || gemma_norms || embed_scale != 1 ||
         attention_scale != 0 || attn_logit_softcap != 0 || final_logit_softcap != 0 || local_rope_theta != 0;
}

int64_t Manifest::kv_row_bytes() const {
  const auto& fmt = kKvFormats.at(kv_cache_dtype);
  return head_dim * fmt.first + fmt.second;
}

int64_t TensorEntry::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string resolve_engine_dir(const std::string& engine_dir) {
  struct stat st {};
  if (engine_dir.empty()) invalid("engine_dir: empty path");
  if (::stat(engine_dir.c_str(), &st) != 0)
    raise(TRTPAGED_ERR_IO, "engine_dir: '" + engine_dir + "' does not exist (" + std::strerror(errno) + ")");
  if (!S_ISDIR(st.st_mode)) invalid("engine_dir: '" + engine_dir + "' is not a directory");
  std::string root = real_path(engine_dir);
  if (root.empty()) raise(TRTPAGED_ERR_IO, "engine_dir: '" + engine_dir + "' cannot be resolved");
  return root;
}

std::string engine_path(const std::string& root, const std::string& rel, const std::string& field) {
  const std::string where = root + "/" + kManifestName;
  check_relative(rel, field, where);
  const std::string full = root + "/" + rel;
  const std::string real = real_path(full);
  if (real.empty()) raise(TRTPAGED_ERR_IO, full + ": " + field + ": missing or cannot be resolved; rebuild the engine");
  if (!is_inside(root, real))
    invalid(full + ": " + field + ": resolves to " + real + ", outside the engine dir (a symlink out of it)");
  return real;
}

Manifest read_manifest(const std::string& root) {
  const std::string where = root + "/" + kManifestName;
  struct stat st {};
  if (::stat(where.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) {
    if (::lstat(where.c_str(), &st) == 0)  // a FIFO (whose open would block), a dir, a dangling link: not "missing"
      invalid(where + ": (file): is not a regular file");
    raise(TRTPAGED_ERR_IO, where + ": (file): missing; not an engine dir (build one with trtpaged build)");
  }
  // a symlink out of the dir is refused, as by the Python loader; the file is read as resolved (no swap in between)
  const std::string real = engine_path(root, kManifestName, "(manifest)");
  json data;
  try {
    data = parse_bounded(read_small_file(real, kMaxManifestBytes, "(file)"));
  } catch (const json::exception& e) {
    invalid(where + ": (file): not valid JSON (" + e.what() + ")");
  } catch (const JsonTooDeep&) {
    invalid(where + ": (file): JSON nested deeper than " + std::to_string(kMaxJsonDepth) + " levels");
  }
  if (!data.is_object()) invalid(where + ": (file): expected a JSON object, got " + show(data));
  const json* version = data.contains("format_version") ? &data["format_version"] : nullptr;
  if (!version || !version->is_number_integer() || version->get<int64_t>() != kFormatVersion)
    raise(TRTPAGED_ERR_UNSUPPORTED, where + ": format_version: engine dir has " + (version ? show(*version) : "none") +
                                        ", this runtime reads " + std::to_string(kFormatVersion) +
                                        "; rebuild the engine");
  Manifest m;
  Fields top(data, "", where);
  top.only({"dims", "limits", "kv_cache", "dtype", "kv_cache_dtype", "tokenizer_dir", "bos_token_id", "eos_token_ids",
            "chat_template", "weights_file", "onnx_file", "plan_file", "backends", "files", "source", "verification",
            "quantization", "tensor_parallel", "shards", "format_version", "kv_bytes_per_token", "kv_bytes_per_block",
            "kv_bytes_per_token_per_rank", "tensorrt", "sampling_defaults", "content_sha256"});
  // manifest.py's Optional fields, and the kv_bytes_per_* it writes for readers and never reads back
  top.refuse_nulls({"bos_token_id", "chat_template", "onnx_file", "plan_file", "kv_bytes_per_token",
                    "kv_bytes_per_block", "kv_bytes_per_token_per_rank"});
  top.object("tensorrt", false);  // the TensorRT build's forms (graph, pool form): nothing the CPU runtime reads
  {  // the model's sampling defaults (trtpaged/sampling_defaults.py): checked as Python checks them, not used (the
     // caller's sampling settings rule in this runtime)
    Fields defaults(top.object("sampling_defaults", false), "sampling_defaults.", where);
    defaults.only({"temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens"});
    struct Range {
      const char* name;
      double low, high;
      bool low_open;
    };
    for (const Range& r : {Range{"temperature", 0.0, 3.4028234663852886e38, false}, Range{"top_p", 0.0, 1.0, true},
                           Range{"min_p", 0.0, 1.0, false}, Range{"repetition_penalty", 0.01, 100.0, false}}) {
      if (!defaults.get(r.name, false)) continue;
      const double x = defaults.number(r.name);
      if (!std::isfinite(x) || x > r.high || (r.low_open ? x <= r.low : x < r.low))
        defaults.bad(r.name, "got " + show(*defaults.get(r.name, true)) + "; expected " + (r.low_open ? "(" : "[") +
                                 show(json(r.low)) + ", " + show(json(r.high)) + "]");
    }
    defaults.integer("top_k", -1, INT64_MAX, false);
    defaults.integer("max_tokens", 1, int64_t(1) << 24, false);
  }

  Fields dims(top.object("dims"), "dims.", where);
  dims.refuse_nulls({"rope_scaling"});
  std::vector<int64_t> windows;  // as written: Gemma 3's windowed layers take the local RoPE, reached or not
  {
    const json& limits_obj = top.object("limits");
    const json* seq = limits_obj.contains("max_seq_len") ? &limits_obj["max_seq_len"] : nullptr;
    // an unreadable max_seq_len reaches no window here; its own check below names it
    const json& dims_obj = top.object("dims");
    if (dims_obj.contains("layer_windows")) {
      const bool none_reached = windows_reach_no_sequence(
          dims_obj, seq && seq->is_number_integer() ? seq->get<int64_t>() : INT64_MAX, where);
      for (const json& w : dims_obj["layer_windows"]) windows.push_back(w.get<int64_t>());
      if (!none_reached) m.layer_windows = windows;
    }
  }
  dims.only({"layer_windows", "qk_norm", "nope_layers", "architecture", "num_layers", "hidden_size",
             "intermediate_size", "num_heads", "num_kv_heads", "head_dim",
             "vocab_size", "rms_norm_eps", "rope_theta", "rope_scaling", "max_position_embeddings",
             "tie_word_embeddings", "attention_bias", "o_proj_bias", "mlp_bias", "partial_rotary_factor",
             "hidden_act", "gemma_norms", "embed_scale", "attention_scale", "attn_logit_softcap",
             "final_logit_softcap", "local_rope_theta"});
  m.architecture = dims.string("architecture");
  m.num_layers = dims.integer("num_layers", 1, 1024);
  m.hidden_size = dims.integer("hidden_size", 1, 1 << 16);
  m.intermediate_size = dims.integer("intermediate_size", 1, 1 << 18);
  m.num_heads = dims.integer("num_heads", 1, 1024);
  m.num_kv_heads = dims.integer("num_kv_heads", 1, 1024);
  m.head_dim = dims.integer("head_dim", 1, 1024);
  m.vocab_size = dims.integer("vocab_size", 1, 1 << 22);
  m.max_position_embeddings = dims.integer("max_position_embeddings", 1, 1 << 24, false, 2048);
  m.rms_norm_eps = dims.positive_float32("rms_norm_eps");
  m.rope_theta = dims.positive_float32("rope_theta");
  m.tie_word_embeddings = dims.boolean("tie_word_embeddings", false);
  m.attention_bias = dims.boolean("attention_bias", false);
  m.o_proj_bias = dims.boolean("o_proj_bias", false);
  m.mlp_bias = dims.boolean("mlp_bias", false);
  m.qk_norm = dims.boolean("qk_norm", false);
  if (const json* nope = dims.get("nope_layers", false)) {  // distinct layer indices, as the Python reader checks
    const bool ok = nope->is_array() && std::all_of(nope->begin(), nope->end(), [&](const json& i) {
      return i.is_number_integer() && i.get<int64_t>() >= 0 && i.get<int64_t>() < m.num_layers;
    });
    if (ok)
      for (const json& i : *nope) m.nope_layers.push_back(i.get<int64_t>());
    std::vector<int64_t> sorted = m.nope_layers;
    std::sort(sorted.begin(), sorted.end());
    if (!ok || std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end())
      dims.bad("nope_layers", "got " + show(*nope) + "; expected distinct layer indices in [0, num_layers)");
  }
  if (m.num_heads % m.num_kv_heads)
    dims.bad("num_kv_heads",
             std::to_string(m.num_kv_heads) + " does not divide num_heads " + std::to_string(m.num_heads));
  read_family_fields(dims, m);
  for (size_t i = 0; m.local_rope_theta != 0 && i < windows.size(); ++i)
    if (windows[i]) m.local_rope_layers.push_back(int64_t(i));
  read_rope_scaling(top.object("dims").value("rope_scaling", json()), m, where);

  Fields limits(top.object("limits"), "limits.", where);
  limits.only({"max_batch_size", "max_num_tokens", "max_seq_len", "block_size"});
  m.max_batch_size = limits.integer("max_batch_size", 1, 1 << 16);
  m.max_num_tokens = limits.integer("max_num_tokens", 1, 1 << 24);
  m.max_seq_len = limits.integer("max_seq_len", 1, 1 << 24);
  m.block_size = limits.integer("block_size", 8, 128);
  if (m.block_size != 8 && m.block_size != 16 && m.block_size != 32 && m.block_size != 64 && m.block_size != 128)
    limits.bad("block_size", "got " + std::to_string(m.block_size) + "; one of 8, 16, 32, 64, 128");
  if (m.max_num_tokens < m.max_batch_size)
    limits.bad("max_num_tokens", std::to_string(m.max_num_tokens) + " is less than max_batch_size " +
                                     std::to_string(m.max_batch_size));

  const json kv_obj = renamed(top.object("kv_cache"), "kv_cache.", where);
  Fields kv(kv_obj, "kv_cache.", where);
  kv.only({"num_kv_blocks", "memory_bytes", "fraction"});
  m.num_kv_blocks = kv.integer("num_kv_blocks", 1, kMaxKvBlocks, false);
  m.kv_memory_bytes = kv.integer("memory_bytes", 1, kMaxKvMemory, false);
  m.kv_fraction = kv.number("fraction", false, 0);
  if (kv.get("fraction", false) && !(std::isfinite(m.kv_fraction) && m.kv_fraction > 0 && m.kv_fraction <= 1))
    kv.bad("fraction", "got " + std::to_string(m.kv_fraction) + "; expected a number in (0, 1]");
  if ((m.num_kv_blocks > 0) + (m.kv_memory_bytes > 0) + (m.kv_fraction > 0) != 1)
    invalid(where + ": kv_cache: exactly one of num_kv_blocks, memory_bytes, fraction must be set");

  m.dtype = top.string("dtype");
  if (m.dtype != "float32" && m.dtype != "float16" && m.dtype != "bfloat16")
    top.bad("dtype", "got '" + m.dtype + "'; one of float32, float16, bfloat16");
  m.kv_cache_dtype = top.string("kv_cache_dtype");
  if (!kKvFormats.count(m.kv_cache_dtype))
    top.bad("kv_cache_dtype", "got '" + m.kv_cache_dtype + "'; one of float32, float16, bfloat16, int8, fp8_e4m3");
  if (const json* bos = top.get("bos_token_id", false)) {
    if (!bos->is_number_integer() || bos->get<int64_t>() < 0 || bos->get<int64_t>() >= m.vocab_size)
      top.bad("bos_token_id", "token id " + show(*bos) + " is outside the vocabulary (vocab_size " +
                                  std::to_string(m.vocab_size) + ")");
  }
  const json& eos = top.array("eos_token_ids");
  for (size_t i = 0; i < eos.size(); ++i) {
    if (!eos[i].is_number_integer() || eos[i].get<int64_t>() < 0 || eos[i].get<int64_t>() >= m.vocab_size)
      top.bad("eos_token_ids[" + std::to_string(i) + "]", "token id " + show(eos[i]) +
                                                              " is outside the vocabulary (vocab_size " +
                                                              std::to_string(m.vocab_size) + ")");
    m.eos_token_ids.push_back(eos[i].get<int64_t>());
  }
  for (const json& b : top.array("backends")) {
    if (!b.is_string()) top.bad("backends", "got " + show(b) + "; expected strings");
    m.backends.push_back(b.get<std::string>());
  }
  m.tensor_parallel = top.integer("tensor_parallel", 1, 64, false, 1);
  m.weights_file = top.string("weights_file", false, "weights.safetensors");
  // every path the manifest names must be a relative path inside the dir, as the Python loader requires
  check_relative(m.weights_file, "weights_file", where);
  check_relative(top.string("tokenizer_dir", false, "tokenizer"), "tokenizer_dir", where);
  for (const char* name : {"onnx_file", "plan_file"})
    if (top.get(name, false)) check_relative(top.string(name), name, where);
  // the manifest's hash of its own fields: its form is checked, not its value (as with the files' hashes, that
  // is `trtpaged inspect --verify` and the Python loader)
  if (const json* own = top.get("content_sha256", false)) {
    const std::string digest = own->is_string() ? own->get<std::string>() : "";
    if (digest.size() != 64 || digest.find_first_not_of("0123456789abcdef") != std::string::npos)
      top.bad("content_sha256", "got " + show(*own) + "; expected a sha256 hex digest");
  }
  const json& files = top.object("files", false);
  for (auto it = files.begin(); it != files.end(); ++it) {
    const std::string field = "files['" + it.key() + "']";
    check_relative(it.key(), field, where);
    const std::string digest = it.value().is_string() ? it.value().get<std::string>() : "";
    if (digest.size() != 64 || digest.find_first_not_of("0123456789abcdef") != std::string::npos)
      top.bad(field, "got " + show(it.value()) + "; expected a sha256 hex digest");
  }
  const json& shards = top.array("shards");
  for (size_t r = 0; r < shards.size(); ++r) {
    if (!shards[r].is_object()) top.bad("shards[" + std::to_string(r) + "]", "expected an object");
    for (auto it = shards[r].begin(); it != shards[r].end(); ++it)
      if (it.value().is_string())
        check_relative(it.value().get<std::string>(), "shards[" + std::to_string(r) + "]." + it.key(), where);
  }
  read_quantization(top.object("quantization", false), m, where);
  return m;
}

std::map<std::string, TensorEntry> read_safetensors_header(const std::string& path, const std::string& field) {
  auto bad = [&](const std::string& message) {
    invalid(path + ": " + field + ": not a valid safetensors file: " + message);
  };
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode))
    raise(TRTPAGED_ERR_IO, path + ": " + field + ": missing or not a regular file; rebuild the engine");
  const uint64_t size = uint64_t(st.st_size);
  std::unique_ptr<FILE, decltype(&std::fclose)> f(std::fopen(path.c_str(), "rb"), &std::fclose);
  if (!f) raise(TRTPAGED_ERR_IO, path + ": " + field + ": cannot be read (" + std::strerror(errno) + ")");
  unsigned char head[8];
  if (size < 8 || std::fread(head, 1, 8, f.get()) != 8)
    bad(std::to_string(size) + " bytes, shorter than the 8-byte header length");
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | head[i];
  if (header_len > std::min(size - 8, kMaxHeaderBytes))
    bad("header length " + std::to_string(header_len) + " exceeds the file (" + std::to_string(size) + " bytes) or " +
        std::to_string(kMaxHeaderBytes));
  std::string raw(size_t(header_len), '\0');
  if (header_len && std::fread(&raw[0], 1, size_t(header_len), f.get()) != header_len)
    raise(TRTPAGED_ERR_IO, path + ": " + field + ": short read of the header");
  json header;
  try {
    header = parse_bounded(raw);
  } catch (const json::exception&) {
    bad("the header is not JSON");
  } catch (const JsonTooDeep&) {
    bad("the header nests deeper than " + std::to_string(kMaxJsonDepth) + " levels");
  }
  if (!header.is_object()) bad("the header is not a JSON object");
  const uint64_t base = 8 + header_len;
  std::map<std::string, TensorEntry> entries;
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") continue;
    const std::string name = "tensor '" + it.key() + "'";
    const json& info = it.value();
    if (!info.is_object()) bad(name + " is not described by an object");
    TensorEntry e;
    auto dtype = info.find("dtype");
    if (dtype == info.end() || !dtype->is_string() || !kSafetensorsDtypeBytes.count(dtype->get<std::string>()))
      bad(name + " has dtype " + (dtype == info.end() ? "none" : show(*dtype)));
    e.dtype = dtype->get<std::string>();
    auto shape = info.find("shape");
    if (shape == info.end() || !shape->is_array()) bad(name + " has no shape list");
    unsigned __int128 numel = 1;
    for (const json& d : *shape) {
      if (!d.is_number_integer() || d.get<int64_t>() < 0 || d.get<int64_t>() >= (int64_t(1) << 40))
        bad(name + " has shape " + show(*shape));
      e.shape.push_back(d.get<int64_t>());
      numel *= uint64_t(d.get<int64_t>());
      if (numel > (unsigned __int128)size) numel = (unsigned __int128)size + 1;  // too big for the file either way
    }
    auto offsets = info.find("data_offsets");
    if (offsets == info.end() || !offsets->is_array() || offsets->size() != 2 || !(*offsets)[0].is_number_unsigned() ||
        !(*offsets)[1].is_number_unsigned() || (*offsets)[0].get<uint64_t>() > (*offsets)[1].get<uint64_t>())
      bad(name + " has data_offsets " + (offsets == info.end() ? "none" : show(*offsets)));
    const uint64_t a = (*offsets)[0].get<uint64_t>(), b = (*offsets)[1].get<uint64_t>();
    if ((unsigned __int128)(b - a) != numel * unsigned(kSafetensorsDtypeBytes.at(e.dtype)))
      bad(name + ": its shape and dtype do not match its data_offsets");
    if (b > size - base) bad(name + " ends past the end of the file (" + std::to_string(size) + " bytes): truncated");
    e.start = base + a;
    e.end = base + b;
    entries[it.key()] = e;
  }
  std::vector<const std::pair<const std::string, TensorEntry>*> order;
  for (const auto& kv : entries) order.push_back(&kv);
  std::sort(order.begin(), order.end(), [](auto* x, auto* y) {
    return std::make_pair(x->second.start, x->second.end) < std::make_pair(y->second.start, y->second.end);
  });
  uint64_t position = base;
  for (auto* kv : order) {
    if (kv->second.start != position)
      bad("tensor '" + kv->first + "' starts at byte " + std::to_string(kv->second.start) + ", expected " +
          std::to_string(position) + " (a gap or an overlap)");
    position = kv->second.end;
  }
  if (position != size) bad("the tensors hold " + std::to_string(position - base) + " bytes, the file has " +
                            std::to_string(size - base) + " after the header");
  return entries;
}

}  // namespace trtpaged::rt
