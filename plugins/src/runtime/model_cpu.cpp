// Loading the step model's weights from safetensors and running one packed step on the CPU.
#include "runtime/model_cpu.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <set>
#include <tuple>

#include "runtime/error.h"

namespace trtpaged::rt {

void AlignedBytes::allocate(size_t bytes) {
  size = bytes;
  void* p = std::aligned_alloc(64, std::max<size_t>(64, (bytes + 63) / 64 * 64));
  if (!p) raise(TRTPAGED_ERR_OUT_OF_MEMORY, "weights: cannot allocate " + std::to_string(bytes) + " bytes");
  data.reset(static_cast<unsigned char*>(p));
}

namespace {

// The weights file's tensors, each read once and checked against what the model needs.
class WeightFile {
 public:
  WeightFile(const std::string& path) : path_(path), entries_(read_safetensors_header(path, "weights_file")) {
    file_ = std::fopen(path.c_str(), "rb");
    if (!file_) raise(TRTPAGED_ERR_IO, path + ": weights_file: cannot be read (" + std::strerror(errno) + ")");
  }
  ~WeightFile() {
    if (file_) std::fclose(file_);
  }
  WeightFile(const WeightFile&) = delete;
  WeightFile& operator=(const WeightFile&) = delete;

  bool has(const std::string& name) const { return entries_.count(name) != 0; }

  // The tensor's bytes, once its dtype and shape are the expected ones.
  template <typename T>
  std::vector<T> read(const std::string& name, const char* dtype, std::vector<int64_t> shape) {
    auto it = entries_.find(name);
    if (it == entries_.end())
      invalid(path_ + ": " + name + ": missing from the weights, which the manifest's dims and quantization need; "
                                    "rebuild the engine");
    const TensorEntry& e = it->second;
    if (e.dtype != dtype || e.shape != shape)
      invalid(path_ + ": " + name + ": " + e.dtype + " " + dims(e.shape) +
              " in the weights, the manifest's dims need " + dtype + " " + dims(shape));
    used_.insert(name);
    std::vector<T> out;
    try {
      out.resize(size_t(e.numel()));
    } catch (const std::bad_alloc&) {
      raise(TRTPAGED_ERR_OUT_OF_MEMORY, name + ": cannot allocate " + std::to_string(e.end - e.start) + " bytes");
    }
    if (std::fseek(file_, long(e.start), SEEK_SET) != 0 ||
        std::fread(out.data(), 1, size_t(e.end - e.start), file_) != size_t(e.end - e.start))
      raise(TRTPAGED_ERR_IO, path_ + ": " + name + ": short read");
    if constexpr (std::is_same_v<T, float>) {
      size_t bad = size_t(std::count_if(out.begin(), out.end(), [](float x) { return !std::isfinite(x); }));
      if (bad)
        invalid(path_ + ": " + name + ": " + std::to_string(bad) + " of its " + std::to_string(out.size()) +
                " values are NaN/inf; the weights are corrupt, rebuild the engine");
    }
    return out;
  }

  // Fails on a tensor the model does not have.
  void check_all_used() const {
    size_t extra = 0;
    std::string first;
    for (const auto& kv : entries_)
      if (!used_.count(kv.first) && extra++ == 0) first = kv.first;
    if (extra)
      invalid(path_ + ": " + first + ": a tensor the step model does not have (" + std::to_string(extra) + " such)");
  }

 private:
  static std::string dims(const std::vector<int64_t>& shape) {
    std::string s = "[";
    for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
    return s + "]";
  }
  std::string path_;
  std::map<std::string, TensorEntry> entries_;
  std::set<std::string> used_;
  FILE* file_ = nullptr;
};

Linear load_linear(WeightFile& w, const Manifest& m, const std::string& module, int64_t in, int64_t out, bool bias) {
  Linear l;
  l.n = out;
  l.k = in;
  auto scheme = m.quant_modules.find(module);
  if (scheme == m.quant_modules.end()) {
    l.weight = w.read<float>(module + ".weight", "F32", {out, in});
  } else {
    l.quantized = true;
    l.bits = scheme->second.first;
    l.group_size = scheme->second.second;
    l.activations = m.activations == "float" ? TRTPAGED_QLINEAR_FLOAT_ACTIVATIONS : TRTPAGED_QLINEAR_INT8_ACTIVATIONS;
    if (in % 32 || in % l.group_size)
      raise(TRTPAGED_ERR_UNSUPPORTED, "quantization.modules['" + module + "']: in_features " + std::to_string(in) +
                                          " is not a multiple of 32 and of the group size " +
                                          std::to_string(l.group_size) + " (the C runtime has no de-quantized form)");
    const int64_t groups = in / l.group_size;
    std::vector<float> scales = w.read<float>(module + ".scales", "F32", {out, groups}), offsets;
    std::vector<uint8_t> codes;
    if (l.bits == 4) {
      codes = w.read<uint8_t>(module + ".codes", "U8", {out, in / 2});
      offsets = w.read<float>(module + ".offsets", "F32", {out, groups});
    } else {
      codes = w.read<uint8_t>(module + ".codes", "I8", {out, in});
    }
    size_t bytes = 0;
    check_kernel(trtpaged_qlinear_packed_bytes(l.bits, out, in, l.group_size, &bytes), module.c_str());
    l.packed.allocate(bytes);
    check_kernel(trtpaged_qlinear_pack(l.bits, out, in, l.group_size, codes.data(), scales.data(),
                                       offsets.empty() ? nullptr : offsets.data(), l.packed.data.get()),
                 module.c_str());
  }
  if (bias) l.bias = w.read<float>(module + ".bias", "F32", {out});
  return l;
}

// A norm's weight; Gemma's RMSNorm scales by (1 + w), computed in float32 as transformers computes it.
std::vector<float> load_norm(WeightFile& w, const std::string& name, int64_t size, bool gemma) {
  std::vector<float> weight = w.read<float>(name, "F32", {size});
  if (gemma)
    for (float& x : weight) x = 1.0f + x;
  return weight;
}

// The rotary table of a RoPE base and scaling over the rotated dims, refused (naming the fields) where its
// frequencies are not finite in float32: every position's angle, and so every logit, would be NaN.
RotaryTable rotary_table(const Manifest& m, double theta, const RopeScaling& scaling, const std::string& field,
                         const std::string& manifest_where) {
  RotaryTable table;
  table.frequencies = rotary_frequencies(m.rotary_dim(), theta, scaling);
  const bool finite = table.frequencies.finite(), usable = table.frequencies.scaling_usable();
  if (finite && usable) return table;
  // as rope.py refuses: a factor finite as a double may not be as a float (1e-300 -> 0, then inv = inf); a cos/sin
  // scaling past float32 (yarn's mscales of 1e300) would make every logit NaN, one of 0 every q and k 0
  char theta_text[32], factor[32], scaled[32], most[32];
  std::snprintf(theta_text, sizeof theta_text, "%g", theta);
  std::snprintf(factor, sizeof factor, "%g", scaling.factor);
  std::snprintf(scaled, sizeof scaled, "%g", table.frequencies.attention_scaling);
  std::snprintf(most, sizeof most, "%g", double(kMaxRopeScaling));
  invalid(manifest_where +
          (scaling.type != "default" ? "dims." + field + " / dims.rope_scaling: " + field + " " + theta_text +
                                           " with factor " + factor
                                     : "dims." + field + ": " + theta_text) +
          (finite ? std::string(" gives a cos/sin scaling of ") + scaled + " (attention_factor, or from factor, mscale "
                        "and mscale_all_dim), not non-zero and at most " + most + " in magnitude in float32 (a " +
                        "real model's is 1 to 2; the attention scores grow as its square)"
                  : std::string(" gives non-finite rotary frequencies in float32")));
}

// Rotate-half RoPE of one head in torch's operations (models/rope.py: rotate): the first rot dims rotate, the
// rest pass through (partial rotary).
void rotate_head(const float* x, int64_t d, int64_t rot, const float* c, const float* s, float* y) {
  const int64_t half = rot / 2;
  for (int64_t i = 0; i < half; ++i) {
    y[i] = x[i] * c[i] - x[i + half] * s[i];
    y[i + half] = x[i + half] * c[i + half] + x[i] * s[i + half];
  }
  std::copy(x + rot, x + d, y + rot);
}

// tanh GELU by ATen's formula in float64, rounded once, as models/llama.py (SwiGLU.forward_fused) computes it: the
// two tanh implementations agree once rounded to float32, where in float32 they differ in the last bit now and then
float gelu_tanh(float x) {
  const double g = x, beta = M_SQRT2 * M_2_SQRTPI * 0.5, kappa = 0.044715;
  return float(0.5 * g * (1 + std::tanh(beta * (g + kappa * (g * g * g)))));
}

}  // namespace

void Linear::run(const float* x, int64_t m, float* y) const {
  if (quantized) {
    check_kernel(trtpaged_qlinear_cpu_ex(x, m, packed.data.get(), bits, n, k, group_size,
                                         bias.empty() ? nullptr : bias.data(), y, activations),
                 "qlinear");
    return;
  }
  // float32 x @ W^T: eight partial sums per dot product (vectorizable without reassociation flags)
  const float* w = weight.data();
  const float* b = bias.empty() ? nullptr : bias.data();
#pragma omp parallel for schedule(static) if (m * n * k > (1 << 18))
  for (int64_t j = 0; j < n; ++j) {
    const float* wj = w + j * k;
    for (int64_t i = 0; i < m; ++i) {
      const float* xi = x + i * k;
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      int64_t t = 0;
      for (; t + 8 <= k; t += 8)
        for (int u = 0; u < 8; ++u) acc[u] += xi[t + u] * wj[t + u];
      float s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
      for (; t < k; ++t) s += xi[t] * wj[t];
      y[i * n + j] = b ? s + b[j] : s;
    }
  }
}

trtpaged_qlinear_weight Linear::described() const {
  trtpaged_qlinear_weight d{};
  d.packed = packed.data.get();
  d.bias = bias.empty() ? nullptr : bias.data();
  d.n = n;
  d.k = k;
  d.bits = bits;
  d.group_size = group_size;
  d.activations = activations;
  return d;
}

CpuModel::CpuModel(const Manifest& manifest, const std::string& weights_path, const std::string& manifest_where)
    : m_(manifest) {
  const std::map<std::string, trtpaged_dtype> kv_codes = {{"float32", TRTPAGED_FLOAT32},
                                                          {"float16", TRTPAGED_FLOAT16},
                                                          {"bfloat16", TRTPAGED_BFLOAT16},
                                                          {"int8", TRTPAGED_INT8},
                                                          {"fp8_e4m3", TRTPAGED_FP8_E4M3}};
  kv_cache_dtype_ = kv_codes.at(m_.kv_cache_dtype);
  eps_ = float(m_.rms_norm_eps);
  scale_ = float(m_.attention_scale != 0 ? m_.attention_scale : std::pow(double(m_.head_dim), -0.5));
  WeightFile w(weights_path);
  const int64_t h = m_.hidden_size, q_size = m_.num_heads * m_.head_dim, kv_size = m_.num_kv_heads * m_.head_dim;
  auto embed = m_.quant_modules.find("embed_tokens");
  if (embed == m_.quant_modules.end()) {
    embed_f32_ = w.read<float>("embed_tokens.weight", "F32", {m_.vocab_size, h});
  } else {
    if (embed->second.first != 8 || h % embed->second.second)
      invalid("quantization.modules['embed_tokens']: embeddings are int8 rows with a group size dividing hidden_size");
    embed_group_ = embed->second.second;
    std::vector<uint8_t> codes = w.read<uint8_t>("embed_tokens.head.codes", "I8", {m_.vocab_size, h});
    embed_codes_.assign(codes.begin(), codes.end());
    embed_scales_ = w.read<float>("embed_tokens.head.scales", "F32", {m_.vocab_size, h / embed_group_});
  }
  layers_.resize(size_t(m_.num_layers));
  const bool gemma = m_.gemma_norms;
  for (int64_t i = 0; i < m_.num_layers; ++i) {
    const std::string p = "layers." + std::to_string(i) + ".";
    Layer& l = layers_[size_t(i)];
    l.input_norm = load_norm(w, p + "input_layernorm.weight", h, gemma);
    l.post_attention_norm = load_norm(w, p + "post_attention_layernorm.weight", h, gemma);
    if (gemma) {
      l.pre_feedforward_norm = load_norm(w, p + "pre_feedforward_layernorm.weight", h, gemma);
      l.post_feedforward_norm = load_norm(w, p + "post_feedforward_layernorm.weight", h, gemma);
    }
    if (m_.qk_norm) {
      l.q_norm = load_norm(w, p + "self_attn.q_norm.weight", m_.head_dim, gemma);
      l.k_norm = load_norm(w, p + "self_attn.k_norm.weight", m_.head_dim, gemma);
    }
    if (!m_.layer_windows.empty()) l.window = int32_t(std::min<int64_t>(m_.layer_windows[size_t(i)], INT32_MAX));
    l.rope = std::find(m_.nope_layers.begin(), m_.nope_layers.end(), i) == m_.nope_layers.end();
    l.local_rope = std::count(m_.local_rope_layers.begin(), m_.local_rope_layers.end(), i) != 0;
    l.qkv = load_linear(w, m_, p + "self_attn.qkv_proj", h, q_size + 2 * kv_size, m_.attention_bias);
    l.o = load_linear(w, m_, p + "self_attn.o_proj", q_size, h, m_.o_proj_bias);
    l.gate_up = load_linear(w, m_, p + "mlp.gate_up_proj", h, 2 * m_.intermediate_size, m_.mlp_bias);
    l.down = load_linear(w, m_, p + "mlp.down_proj", m_.intermediate_size, h, m_.mlp_bias);
  }
  final_norm_ = load_norm(w, "norm.weight", h, gemma);
  if (!m_.tie_word_embeddings) {
    head_ = load_linear(w, m_, "lm_head", h, m_.vocab_size, false);
  } else if (embed_group_) {  // the tied head is the int8 embedding's rows as a quantized linear
    head_.n = m_.vocab_size;
    head_.k = h;
    head_.quantized = true;
    head_.bits = 8;
    head_.group_size = embed_group_;
    head_.activations =
        m_.activations == "float" ? TRTPAGED_QLINEAR_FLOAT_ACTIVATIONS : TRTPAGED_QLINEAR_INT8_ACTIVATIONS;
    if (h % 32) raise(TRTPAGED_ERR_UNSUPPORTED, "embed_tokens: hidden_size is not a multiple of 32");
    size_t bytes = 0;
    check_kernel(trtpaged_qlinear_packed_bytes(8, head_.n, h, embed_group_, &bytes), "lm_head");
    head_.packed.allocate(bytes);
    check_kernel(trtpaged_qlinear_pack(8, head_.n, h, embed_group_, embed_codes_.data(), embed_scales_.data(), nullptr,
                                       head_.packed.data.get()),
                 "lm_head");
  } else {
    head_.n = m_.vocab_size;
    head_.k = h;
    head_.weight = embed_f32_;
  }
  w.check_all_used();
  // as the Python model decides its execution plan: every layer's linears quantized -> one call, unless a layer
  // has a window or q/k norms (the one-call runner's attention reads whole sequences and it has no q/k norms), or
  // the model another family's features (it computes Llama's layer)
  quantized_ = !m_.quant_modules.empty();
  one_call_ = !m_.has_family_features() && m_.layer_windows.empty() && !m_.qk_norm && m_.nope_layers.empty() &&
              std::all_of(layers_.begin(), layers_.end(), [](const Layer& l) {
                return l.qkv.quantized && l.o.quantized && l.gate_up.quantized && l.down.quantized;
              });
  if (one_call_)
    for (const Layer& l : layers_)
      described_.push_back({l.input_norm.data(), l.post_attention_norm.data(), l.qkv.described(), l.o.described(),
                            l.gate_up.described(), l.down.described()});
  rope_ = rotary_table(m_, m_.rope_theta, m_.rope, "rope_theta", manifest_where);
  if (!m_.local_rope_layers.empty())  // Gemma 3's local layers: the default RoPE on their own base
    local_rope_ = rotary_table(m_, m_.local_rope_theta, RopeScaling{}, "local_rope_theta", manifest_where);
}

void CpuModel::embed(const int32_t* ids, int32_t rows, float* out) const {
  const int64_t h = m_.hidden_size;
  for (int32_t t = 0; t < rows; ++t) {
    float* o = out + t * h;
    if (!embed_f32_.empty()) {
      std::memcpy(o, embed_f32_.data() + int64_t(ids[t]) * h, size_t(h) * sizeof(float));
      continue;
    }
    const int8_t* c = embed_codes_.data() + int64_t(ids[t]) * h;
    const float* s = embed_scales_.data() + int64_t(ids[t]) * (h / embed_group_);
    for (int64_t j = 0; j < h; ++j) o[j] = float(c[j]) * s[j / embed_group_];
  }
  if (m_.embed_scale == 1) return;
  const float scale = float(m_.embed_scale);  // Gemma's normalizer, rounded to float32 as transformers rounds it
  for (int64_t i = 0; i < rows * h; ++i) out[i] *= scale;
}

void CpuModel::norm(const float* x, float* residual, const std::vector<float>& weight, int64_t rows,
                    float* out) const {
  check_kernel(trtpaged_rmsnorm_cpu(x, residual, weight.data(), eps_, rows, m_.hidden_size, out, residual),
               "rmsnorm");
}

void CpuModel::layers(float* stream, float* last, const trtpaged_attention_params& attn, void* pool,
                      const StepView& s) {
  const int64_t rows = s.num_tokens, h = m_.hidden_size, inter = m_.intermediate_size;
  const int64_t q_size = m_.num_heads * m_.head_dim, kv_size = m_.num_kv_heads * m_.head_dim;
  x_.resize(size_t(rows * h));
  qkv_.resize(size_t(rows * (q_size + 2 * kv_size)));
  q_.resize(size_t(rows * q_size));
  k_.resize(size_t(rows * kv_size));
  v_.resize(size_t(rows * kv_size));
  attn_.resize(size_t(rows * q_size));
  o_.resize(size_t(rows * h));
  gate_up_.resize(size_t(rows * 2 * inter));
  act_.resize(size_t(rows * inter));
  if (!m_.nope_layers.empty()) {  // cos 1, sin 0: rope_qk's copies of q and k, unrotated (x * 1 + y * 0 is x)
    ones_.assign(size_t(rows * m_.head_dim), 1.0f);
    zeros_.assign(size_t(rows * m_.head_dim), 0.0f);
  }
  trtpaged_attention_params p = attn;
  for (size_t i = 0; i < layers_.size(); ++i) {
    const Layer& l = layers_[i];
    p.layer = int32_t(i);
    const trtpaged_attention_options options{l.window, float(m_.attn_logit_softcap)};
    norm(i == 0 ? stream : last, i == 0 ? nullptr : stream, l.input_norm, rows, x_.data());
    l.qkv.run(x_.data(), rows, qkv_.data());
    if (!l.q_norm.empty()) norm_heads(qkv_.data(), rows, l);
    rotate(l, rows);
    check_kernel(trtpaged_paged_attention_ex_cpu(&p, &options, q_.data(), k_.data(), v_.data(), pool, s.positions,
                                                 s.query_start, s.context_lens, s.block_tables, attn_.data()),
                 "paged_attention");
    l.o.run(attn_.data(), rows, o_.data());
    if (l.post_feedforward_norm.empty()) {
      norm(o_.data(), stream, l.post_attention_norm, rows, x_.data());
    } else {  // Gemma: the attention's output normed before it is added; the MLP's input by a norm of its own
      norm(o_.data(), nullptr, l.post_attention_norm, rows, o_.data());
      norm(o_.data(), stream, l.pre_feedforward_norm, rows, x_.data());
    }
    l.gate_up.run(x_.data(), rows, gate_up_.data());
    gated_activation(rows);
    l.down.run(act_.data(), rows, last);
    if (!l.post_feedforward_norm.empty()) norm(last, nullptr, l.post_feedforward_norm, rows, last);
  }
}

// q and k rotated (and v copied) densely out of the qkv rows: through the rope kernel (a layer without RoPE: with
// the tables of no rotation), or, for partial rotary, which the kernel does not do, in torch's operations.
void CpuModel::rotate(const Layer& l, int64_t rows) {
  const RotaryTable& table = l.local_rope ? local_rope_ : rope_;
  const int64_t d = m_.head_dim, q_size = m_.num_heads * d, kv_size = m_.num_kv_heads * d;
  if (m_.partial_rotary_factor == 1) {
    check_kernel(trtpaged_rope_qk_cpu(qkv_.data(), rows, int32_t(m_.num_heads), int32_t(m_.num_kv_heads), int32_t(d),
                                      l.rope ? table.cos.data() : ones_.data(),
                                      l.rope ? table.sin.data() : zeros_.data(), q_.data(), k_.data(), v_.data()),
                 "rope_qk");
    return;
  }
  const int64_t rot = l.rope ? table.dim() : 0;
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = qkv_.data() + r * (q_size + 2 * kv_size);
    const float* c = table.cos.data() + r * rot;
    const float* sn = table.sin.data() + r * rot;
    for (int64_t head = 0; head < m_.num_heads; ++head)
      rotate_head(row + head * d, d, rot, c, sn, q_.data() + r * q_size + head * d);
    for (int64_t head = 0; head < m_.num_kv_heads; ++head)
      rotate_head(row + q_size + head * d, d, rot, c, sn, k_.data() + r * kv_size + head * d);
    std::copy(row + q_size + kv_size, row + q_size + 2 * kv_size, v_.data() + r * kv_size);
  }
}

// act(gate) * up from the gate_up rows: the SiLU kernel, or Gemma's tanh GELU.
void CpuModel::gated_activation(int64_t rows) {
  const int64_t n = m_.intermediate_size;
  if (m_.hidden_act == "silu") {
    check_kernel(trtpaged_silu_mul_cpu(gate_up_.data(), rows, n, act_.data()), "silu_mul");
    return;
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float* gate = gate_up_.data() + r * 2 * n;
    const float* up = gate + n;
    for (int64_t i = 0; i < n; ++i) act_[size_t(r * n + i)] = gelu_tanh(gate[i]) * up[i];
  }
}

// Qwen3's q_norm and k_norm (transformers' Qwen3RMSNorm over head_dim, before RoPE) on the packed qkv rows, in
// place: the q heads (then the k heads) of every row copied out densely, each head one row of the rmsnorm kernel,
// and copied back; the calls the Python runtime's fused form makes, so that both give the same bits.
void CpuModel::norm_heads(float* qkv, int64_t rows, const Layer& l) {
  const int64_t d = m_.head_dim, q_size = m_.num_heads * d, kv_size = m_.num_kv_heads * d;
  const int64_t stride = q_size + 2 * kv_size;
  for (const auto& [start, size, weight] : {std::tuple{int64_t(0), q_size, l.q_norm.data()},
                                            std::tuple{q_size, kv_size, l.k_norm.data()}}) {
    heads_.resize(size_t(rows * size));
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(heads_.data() + r * size, qkv + r * stride + start, size_t(size) * sizeof(float));
    check_kernel(trtpaged_rmsnorm_cpu(heads_.data(), nullptr, weight, eps_, rows * size / d, d, heads_.data(),
                                      nullptr),
                 "rmsnorm");
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(qkv + r * stride + start, heads_.data() + r * size, size_t(size) * sizeof(float));
  }
}

void CpuModel::step(const StepView& s, void* pool, int32_t num_kv_blocks, float* logits) {
  const int64_t rows = s.num_tokens, h = m_.hidden_size;
  stream_.resize(size_t(rows * h));
  last_.resize(size_t(rows * h));
  embed(s.input_ids, s.num_tokens, stream_.data());
  rope_.fill(s.positions, s.num_tokens);
  if (!m_.local_rope_layers.empty()) local_rope_.fill(s.positions, s.num_tokens);
  trtpaged_attention_params attn{};
  attn.num_tokens = s.num_tokens;
  attn.num_seqs = s.num_seqs;
  attn.max_blocks_per_seq = s.max_blocks_per_seq;
  attn.num_heads = int32_t(m_.num_heads);
  attn.num_kv_heads = int32_t(m_.num_kv_heads);
  attn.head_dim = int32_t(m_.head_dim);
  attn.num_kv_blocks = num_kv_blocks;
  attn.num_layers = int32_t(m_.num_layers);
  attn.block_size = int32_t(m_.block_size);
  attn.scale = scale_;
  attn.io_dtype = TRTPAGED_FLOAT32;
  attn.kv_cache_dtype = kv_cache_dtype_;
  if (rows > 0) {
    if (one_call_)
      check_kernel(trtpaged_llama_layers_cpu(described_.data(), int32_t(described_.size()), int32_t(h),
                                             int32_t(m_.intermediate_size), eps_, stream_.data(), last_.data(),
                                             rope_.cos.data(), rope_.sin.data(), &attn, pool, s.positions,
                                             s.query_start,
                                             s.context_lens, s.block_tables),
                   "llama_layers");
    else
      layers(stream_.data(), last_.data(), attn, pool, s);
  }
  // the final norm over the logits rows only (rmsnorm(last + stream)), then the head
  const int64_t outs = s.num_outputs;
  rows_x_.resize(size_t(outs * h));
  rows_res_.resize(size_t(outs * h));
  rows_out_.resize(size_t(outs * h));
  for (int64_t i = 0; i < outs; ++i) {
    const int64_t r = s.logits_index[i];
    std::memcpy(rows_x_.data() + i * h, last_.data() + r * h, size_t(h) * sizeof(float));
    std::memcpy(rows_res_.data() + i * h, stream_.data() + r * h, size_t(h) * sizeof(float));
  }
  if (outs == 0) return;
  norm(rows_x_.data(), rows_res_.data(), final_norm_, outs, rows_out_.data());
  head_.run(rows_out_.data(), outs, logits);
  if (m_.final_logit_softcap == 0) return;
  const float cap = float(m_.final_logit_softcap);  // Gemma: tanh(logits / cap) * cap, in torch's float32 ops
  for (int64_t i = 0; i < outs * m_.vocab_size; ++i) logits[i] = std::tanh(logits[i] / cap) * cap;
}

}  // namespace trtpaged::rt
