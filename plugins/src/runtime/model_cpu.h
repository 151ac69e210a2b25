// The Llama-family step model on the CPU through the kernel library: the same kernel calls, in the
// same order on the same buffers, as the Python runtime's eager step model (trtpaged/models/llama.py:
// the c_layers plan when every linear is quantized, else the fused plan; sliding windows take the fused
// plan, as in Python), so that the two produce the same logits for the same packed batch (up to the rotary
// tables' last bit: see docs/embedding.md), Qwen3's q/k norms and SmolLM3's layers without RoPE included.
// Other families' features run as in the fused plan too: Gemma's norms through the rmsnorm kernel ((1 + w) folded
// into its weights), its attention scale and soft-caps through the attention's options, its local layers on their
// own RoPE table; where Python takes torch ops (partial rotary, tanh GELU, the final soft-cap), plain loops rounding
// each operation as torch does.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "runtime/engine_dir.h"
#include "runtime/rope.h"
#include "trtpaged/trtpaged.h"

namespace trtpaged::rt {

// 64-byte aligned bytes (the packed quantized weights need it).
struct AlignedBytes {
  std::unique_ptr<unsigned char, void (*)(void*)> data{nullptr, [](void* p) { std::free(p); }};
  size_t size = 0;
  void allocate(size_t bytes);
};

// y[m, n] = x[m, k] @ W^T (+ bias): float32 weights, or quantized and packed for the qlinear kernels.
struct Linear {
  int64_t n = 0, k = 0;
  bool quantized = false;
  int32_t bits = 0, group_size = 0, activations = TRTPAGED_QLINEAR_INT8_ACTIVATIONS;
  std::vector<float> weight;  // float [n, k]
  AlignedBytes packed;        // quantized
  std::vector<float> bias;    // [n] or empty
  void run(const float* x, int64_t m, float* y) const;
  trtpaged_qlinear_weight described() const;
};

// A decoder layer; Gemma's norm weights are held as (1 + w), the weights its RMSNorm scales by.
struct Layer {
  std::vector<float> input_norm, post_attention_norm;
  std::vector<float> pre_feedforward_norm, post_feedforward_norm;  // Gemma: around the MLP, else empty
  std::vector<float> q_norm, k_norm;  // [head_dim] each with qk_norm (Qwen3, Gemma 3), else empty
  Linear qkv, o, gate_up, down;
  int32_t window = 0;       // sliding window (tokens; 0: the whole sequence)
  bool rope = true;         // false: a layer without RoPE (SmolLM3)
  bool local_rope = false;  // rotated by the local RoPE base (Gemma 3's windowed layers)
};

// The packed step of the engine I/O contract, checked by the caller.
struct StepView {
  int32_t num_tokens, num_seqs, max_blocks_per_seq, num_outputs;
  const int32_t *input_ids, *positions, *query_start, *context_lens, *block_tables, *logits_index;
};

class CpuModel {
 public:
  // Loads the weights (root/manifest.weights_file), checked against the manifest's dims and
  // quantization: every tensor present with its shape and dtype, no other, float ones finite.
  // manifest_where: the manifest's path and ": ", in front of the errors of its fields.
  CpuModel(const Manifest& manifest, const std::string& weights_path, const std::string& manifest_where = "");
  // Runs one step over pool (kv_cache_dtype pool of num_kv_blocks blocks); logits [num_outputs, vocab].
  void step(const StepView& s, void* pool, int32_t num_kv_blocks, float* logits);
  bool quantized() const { return quantized_; }
  bool one_call() const { return one_call_; }
  trtpaged_dtype kv_cache_dtype() const { return kv_cache_dtype_; }

 private:
  void embed(const int32_t* ids, int32_t rows, float* out) const;
  void layers(float* stream, float* last, const trtpaged_attention_params& attn, void* pool, const StepView& s);
  // rmsnorm(x) or, with residual, rmsnorm(x + residual) with residual updated to that sum: rows of hidden_size
  void norm(const float* x, float* residual, const std::vector<float>& weight, int64_t rows, float* out) const;
  void norm_heads(float* qkv, int64_t rows, const Layer& l);
  void rotate(const Layer& l, int64_t rows);
  void gated_activation(int64_t rows);

  Manifest m_;
  trtpaged_dtype kv_cache_dtype_ = TRTPAGED_FLOAT32;
  bool quantized_ = false, one_call_ = false;
  float eps_ = 0, scale_ = 0;
  // embedding: a float table, or int8 rows with per-group scales
  std::vector<float> embed_f32_;
  std::vector<int8_t> embed_codes_;
  std::vector<float> embed_scales_;
  int32_t embed_group_ = 0;
  std::vector<Layer> layers_;
  std::vector<trtpaged_llama_layer> described_;
  std::vector<float> final_norm_;
  Linear head_;
  RotaryTable rope_, local_rope_;  // local_rope_: Gemma 3's windowed layers' (local_rope_theta), else unused
  // scratch reused from step to step
  std::vector<float> stream_, last_, rows_x_, rows_res_, rows_out_;
  std::vector<float> ones_, zeros_;  // the tables of no rotation, for layers without RoPE
  std::vector<float> heads_;         // q (or k) heads, densely, for their norms
  std::vector<float> x_, qkv_, q_, k_, v_, attn_, o_, gate_up_, act_;
};

}  // namespace trtpaged::rt
