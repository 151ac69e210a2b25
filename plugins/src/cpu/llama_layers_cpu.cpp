// A step's decoder layers in one C call (float32, CPU, quantized linears): the same kernel calls
// the eager Python model makes (rmsnorm, qlinear, rope_qk, paged attention, silu_mul), in the same
// order on the same buffers, without the ~10 Python-level calls a layer costs there (about 60 us a
// layer, a fifth of a single-stream decode step of the int4 SmolLM2).
#include <string>
#include <vector>

#include "common.h"

namespace {

using trtpaged::fail;

// Scratch of one call, reused by the calling thread from step to step.
struct LayerBuffers {
  std::vector<float> x, qkv, q, k, v, attn, o, gate_up, act;
};

int linear(const trtpaged_qlinear_weight& w, const float* x, int64_t rows, float* y) {
  return trtpaged_qlinear_cpu_ex(x, rows, w.packed, w.bits, w.n, w.k, w.group_size, w.bias, y, w.activations);
}

int check_layer(const trtpaged_llama_layer& l, int32_t index, int64_t hidden, int64_t intermediate, int64_t q_size,
                int64_t kv_size) {
  const std::string at = "layers[" + std::to_string(index) + "].";
  if (!l.input_norm || !l.post_attention_norm)
    return fail(TRTPAGED_ERR_INVALID_ARGUMENT, at + "input_norm/post_attention_norm: null pointer");
  const struct {
    const char* name;
    const trtpaged_qlinear_weight& w;
    int64_t n, k;
  } linears[] = {{"qkv", l.qkv, q_size + 2 * kv_size, hidden},
                 {"o", l.o, hidden, q_size},
                 {"gate_up", l.gate_up, 2 * intermediate, hidden},
                 {"down", l.down, hidden, intermediate}};
  for (const auto& lin : linears)
    if (lin.w.n != lin.n || lin.w.k != lin.k || !lin.w.packed)
      return fail(TRTPAGED_ERR_INVALID_ARGUMENT, at + lin.name + ": expected a packed [" + std::to_string(lin.n) +
                                                     ", " + std::to_string(lin.k) + "] weight, got [" +
                                                     std::to_string(lin.w.n) + ", " + std::to_string(lin.w.k) + "]");
  return TRTPAGED_OK;
}

}  // namespace

extern "C" TRTPAGED_API trtpaged_status trtpaged_llama_layers_cpu(
    const trtpaged_llama_layer* layers, int32_t num_layers, int32_t hidden, int32_t intermediate, float eps,
    float* stream, float* last, const float* cos, const float* sin, const trtpaged_attention_params* attn,
    void* kv_cache, const int32_t* positions, const int32_t* query_start, const int32_t* context_lens,
    const int32_t* block_tables) {
  using namespace trtpaged;
  try {
    if (!attn || !stream || !last || !cos || !sin || (num_layers > 0 && !layers))
      return trtpaged_status(fail(TRTPAGED_ERR_INVALID_ARGUMENT, "layers, stream, last, cos, sin, attn: null pointer"));
    if (num_layers < 0 || hidden < 1 || intermediate < 1)
      return trtpaged_status(fail(TRTPAGED_ERR_INVALID_ARGUMENT, "num_layers, hidden, intermediate: must be >= 0, "
                                                                 ">= 1, >= 1"));
    if (attn->io_dtype != TRTPAGED_FLOAT32)
      return trtpaged_status(fail(TRTPAGED_ERR_UNSUPPORTED, "attn.io_dtype: only float32"));
    const int64_t rows = attn->num_tokens, d = attn->head_dim;
    const int64_t q_size = attn->num_heads * d, kv_size = attn->num_kv_heads * d;
    for (int32_t i = 0; i < num_layers; ++i)
      if (int rc = check_layer(layers[i], i, hidden, intermediate, q_size, kv_size)) return trtpaged_status(rc);
    if (rows == 0 || num_layers == 0) return trtpaged_status(ok());
    static thread_local LayerBuffers buf;
    buf.x.resize(size_t(rows * hidden));
    buf.qkv.resize(size_t(rows * (q_size + 2 * kv_size)));
    buf.q.resize(size_t(rows * q_size));
    buf.k.resize(size_t(rows * kv_size));
    buf.v.resize(size_t(rows * kv_size));
    buf.attn.resize(size_t(rows * q_size));
    buf.o.resize(size_t(rows * hidden));
    buf.gate_up.resize(size_t(rows * 2 * intermediate));
    buf.act.resize(size_t(rows * intermediate));
    trtpaged_attention_params p = *attn;
    for (int32_t i = 0; i < num_layers; ++i) {
      const trtpaged_llama_layer& l = layers[i];
      p.layer = i;
      int rc;
      // the first layer's stream is the embeddings themselves; later ones add the last MLP output
      if (i == 0)
        rc = trtpaged_rmsnorm_cpu(stream, nullptr, l.input_norm, eps, rows, hidden, buf.x.data(), nullptr);
      else
        rc = trtpaged_rmsnorm_cpu(last, stream, l.input_norm, eps, rows, hidden, buf.x.data(), stream);
      if (!rc) rc = linear(l.qkv, buf.x.data(), rows, buf.qkv.data());
      if (!rc)
        rc = trtpaged_rope_qk_cpu(buf.qkv.data(), rows, attn->num_heads, attn->num_kv_heads, int32_t(d), cos, sin,
                                  buf.q.data(), buf.k.data(), buf.v.data());
      if (!rc)
        rc = trtpaged_paged_attention_cpu(&p, buf.q.data(), buf.k.data(), buf.v.data(), kv_cache, positions,
                                          query_start, context_lens, block_tables, buf.attn.data());
      if (!rc) rc = linear(l.o, buf.attn.data(), rows, buf.o.data());
      if (!rc)
        rc = trtpaged_rmsnorm_cpu(buf.o.data(), stream, l.post_attention_norm, eps, rows, hidden, buf.x.data(),
                                  stream);
      if (!rc) rc = linear(l.gate_up, buf.x.data(), rows, buf.gate_up.data());
      if (!rc) rc = trtpaged_silu_mul_cpu(buf.gate_up.data(), rows, intermediate, buf.act.data());
      if (!rc) rc = linear(l.down, buf.act.data(), rows, last);
      if (rc) return trtpaged_status(rc);  // the failing call recorded the message
    }
    return trtpaged_status(ok());
  } catch (const std::exception& e) {
    return trtpaged_status(fail_from(e, "llama_layers_cpu"));
  }
}
