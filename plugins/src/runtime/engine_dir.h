// An engine dir as the C runtime reads it: the manifest (trtpaged.json, the format trtpaged/manifest.py
// writes), paths confined to the dir, and the weights file's safetensors header. Engine dirs are
// untrusted input: every value is checked, and sizes before anything is allocated.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace trtpaged::rt {

constexpr int kFormatVersion = 1;

// dims.rope_scaling as trtpaged/models/rope.py reads it, for yarn and longrope with the defaults it takes filled in
// (longrope's factor: max_position_embeddings / original_max_position_embeddings).
struct RopeScaling {
  std::string type = "default";  // default, linear, llama3, yarn, longrope
  double factor = 1, low_freq_factor = 1, high_freq_factor = 4, original_max_position_embeddings = 8192;
  double attention_factor = 0;            // yarn, longrope: the cos/sin scaling; 0: derived from the factor
  double beta_fast = 32, beta_slow = 1;   // yarn's ramp between extrapolated and interpolated frequencies
  double mscale = 0, mscale_all_dim = 0;  // yarn; used when both are non-zero
  bool truncate = true;                   // yarn: the ramp's ends rounded to whole dims
  std::vector<double> short_factor;       // longrope: one divisor per rotated pair (positions below the original)
};

struct Manifest {
  std::string architecture;
  int64_t num_layers = 0, hidden_size = 0, intermediate_size = 0, num_heads = 0, num_kv_heads = 0, head_dim = 0,
          vocab_size = 0, max_position_embeddings = 0;
  double rms_norm_eps = 0, rope_theta = 0;
  RopeScaling rope;
  double partial_rotary_factor = 1;  // RoPE on the first head_dim * factor dims (Phi-3)
  bool tie_word_embeddings = false, attention_bias = false, o_proj_bias = false, mlp_bias = false;
  bool qk_norm = false;                // per-head RMSNorm of q and k before RoPE (Qwen3)
  std::vector<int64_t> layer_windows;  // one sliding window per layer (0: global); empty: none reaches a sequence
  std::vector<int64_t> nope_layers;    // layers without RoPE (SmolLM3)
  // Gemma 2/3 (ModelDims' fields of the same names; 0: none)
  std::string hidden_act = "silu";  // the gated MLP's activation: silu or gelu_tanh
  bool gemma_norms = false;         // (1 + w) RMSNorms, and norms after attention and around the MLP
  double embed_scale = 1, attention_scale = 0, attn_logit_softcap = 0, final_logit_softcap = 0, local_rope_theta = 0;
  std::vector<int64_t> local_rope_layers;  // the windowed layers, rotated by local_rope_theta (Gemma 3)
  int64_t max_batch_size = 0, max_num_tokens = 0, max_seq_len = 0, block_size = 0;
  int64_t num_kv_blocks = 0, kv_memory_bytes = 0;  // 0: not set
  double kv_fraction = 0;                          // 0: not set
  std::string dtype, kv_cache_dtype, weights_file;
  std::vector<int64_t> eos_token_ids;
  std::vector<std::string> backends;
  std::map<std::string, std::pair<int, int>> quant_modules;  // module -> (bits, group_size)
  std::string activations = "int8";                          // quantization.activations
  int64_t tensor_parallel = 1;

  int64_t rotary_dim() const { return int64_t(double(head_dim) * partial_rotary_factor); }
  // a feature of the families beyond Llama's layer (trtpaged/models/execution_plan.py: family_features), which the
  // one-call runner does not compute
  bool has_family_features() const;
  // bytes of one token's K (or V) row of one head in the pool
  int64_t kv_row_bytes() const;
  int64_t kv_bytes_per_block() const { return 2 * num_layers * num_kv_heads * kv_row_bytes() * block_size; }
};

// The real path of the engine dir (which must be a directory holding trtpaged.json).
std::string resolve_engine_dir(const std::string& engine_dir);
// root/rel once rel is a relative path without ".." whose real path stays inside root; names field.
std::string engine_path(const std::string& root, const std::string& rel, const std::string& field);
// Reads and checks root/trtpaged.json.
Manifest read_manifest(const std::string& root);

struct TensorEntry {
  std::string dtype;
  std::vector<int64_t> shape;
  uint64_t start = 0, end = 0;  // byte range from the file start
  int64_t numel() const;
};

// The tensors of a safetensors file, checked against the file's size (header length, dtypes,
// shapes, byte ranges tiling the data exactly), as trtpaged/engine_files.py checks them.
std::map<std::string, TensorEntry> read_safetensors_header(const std::string& path, const std::string& field);

}  // namespace trtpaged::rt
