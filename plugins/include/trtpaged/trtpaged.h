/*
 * trtpaged kernel library: the C ABI shared by the Python binding (ctypes),
 * the TensorRT plugin and C++ programs that embed the engine.
 *
 * Conventions
 * - Every function returns a trtpaged_status; on failure a message naming the
 *   argument and the limit is available from trtpaged_last_error() (per thread).
 * - Tensors are dense, row-major, contiguous. Index tensors are int32.
 * - The KV pool is block-major (docs/architecture.md, "KV layout"):
 *     kv_cache[num_kv_blocks][num_layers][2][num_kv_heads][block_size][head_dim]
 *   where index 0 of the "2" axis is K and 1 is V.
 * - Quantized KV cache (kv_cache_dtype TRTPAGED_INT8 or TRTPAGED_FP8_E4M3): the pool is bytes,
 *     kv_cache[num_kv_blocks][num_layers][2][num_kv_heads][block_size][head_dim + 2]
 *   each token row of one head holding head_dim 1-byte codes followed by that row's scale as
 *   IEEE fp16 (little-endian). The value is code * scale, with scale = fp16(max|x| / M)
 *   (round to nearest even) and codes made with that stored scale: int8 codes are
 *   clamp(round-half-even(x / scale), -127, 127), M = 127; fp8 codes are e4m3fn(x / scale)
 *   (round to nearest even, saturating at 448), M = 448. A zero scale means zero codes. A row
 *   is written once, when its token is, so nothing is ever re-quantized; scales live inside
 *   the block, so block copy and swap move them with the codes (block_bytes = num_layers * 2 *
 *   num_kv_heads * block_size * (head_dim + 2)). The CPU and CUDA paths write the same bytes
 *   (fp8: the sm_89+ hardware conversion, or on sm_80 the CPU's software codec).
 * - The cache slot of the token at position p of sequence s is
 *     block_tables[s * max_blocks_per_seq + p / block_size], offset p % block_size.
 * - *_cpu functions take host pointers; *_cuda functions take device pointers
 *   (except where a parameter says host) and a cudaStream_t passed as void*.
 */
#ifndef TRTPAGED_TRTPAGED_H
#define TRTPAGED_TRTPAGED_H

#include <stddef.h>
#include <stdint.h>

#if defined(_WIN32)
#define TRTPAGED_API __declspec(dllexport)
#else
#define TRTPAGED_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

typedef enum trtpaged_status {
  TRTPAGED_OK = 0,
  TRTPAGED_ERR_INVALID_ARGUMENT = 1, /* null pointer, bad shape, index out of range */
  TRTPAGED_ERR_UNSUPPORTED = 2,      /* valid but not implemented (e.g. head_dim) */
  TRTPAGED_ERR_CUDA = 3,             /* a CUDA runtime call failed */
  TRTPAGED_ERR_NOT_BUILT = 4,        /* the library was built without this backend */
  TRTPAGED_ERR_IO = 5,               /* a file could not be opened or read (runtime.h) */
  TRTPAGED_ERR_OUT_OF_MEMORY = 6     /* an allocation failed */
} trtpaged_status;

typedef enum trtpaged_dtype {
  TRTPAGED_FLOAT32 = 0,
  TRTPAGED_FLOAT16 = 1,
  TRTPAGED_BFLOAT16 = 2,
  TRTPAGED_INT8 = 3,     /* kv_cache_dtype only: quantized KV cache, see "Quantized KV cache" below */
  TRTPAGED_FP8_E4M3 = 4  /* kv_cache_dtype only: quantized KV cache (OCP e4m3fn codes) */
} trtpaged_dtype;

/* Shapes and options of one paged-attention call (one layer, one step). */
typedef struct trtpaged_attention_params {
  int32_t num_tokens;         /* packed query tokens this step (>= 0) */
  int32_t num_seqs;           /* sequences this step (>= 1 when num_tokens > 0) */
  int32_t max_blocks_per_seq; /* row length of block_tables */
  int32_t num_heads;          /* query heads; a multiple of num_kv_heads */
  int32_t num_kv_heads;
  int32_t head_dim;
  int32_t num_kv_blocks;         /* blocks in the pool */
  int32_t num_layers;         /* layers in the pool */
  int32_t layer;              /* layer this call reads and writes, in [0, num_layers) */
  int32_t block_size;         /* tokens per block: 8, 16, 32, 64 or 128 */
  float scale;                /* softmax scale, usually 1/sqrt(head_dim) */
  trtpaged_dtype io_dtype;    /* dtype of q, k, v and out: float32, float16 or bfloat16 */
  trtpaged_dtype kv_cache_dtype;    /* dtype of kv_cache (any); accumulation is always fp32 */
} trtpaged_attention_params;

/*
 * Paged attention over a packed mixed batch (prefill chunks and decode tokens).
 *
 *   q            [num_tokens, num_heads, head_dim]      io_dtype
 *   k, v         [num_tokens, num_kv_heads, head_dim]   io_dtype (new K/V of each token)
 *   kv_cache     the pool (layout above)                kv_cache_dtype, updated in place
 *   positions    [num_tokens]          absolute position of each token
 *   query_start  [num_seqs + 1]        CSR offsets of each sequence's tokens
 *   context_lens [num_seqs]            KV length of each sequence after this step
 *   block_tables [num_seqs, max_blocks_per_seq]
 *   out          [num_tokens, num_heads, head_dim]      io_dtype
 *
 * First every new token's K and V is written to its cache slot, then each
 * query token attends causally (cache positions <= its own position) to its
 * sequence's cached tokens. Requirements checked on the CPU path (the CUDA path
 * checks scalars; index contents live on the device): 0 <= positions[t] <
 * context_lens[s], query_start non-decreasing from 0 to num_tokens, every block
 * id used in [0, num_kv_blocks).
 * The CUDA path reads only scalars on the host to decide which kernels to launch:
 * a call with num_tokens == num_seqs is taken as decode-only (so there every
 * sequence must have exactly one new token; the CPU path also accepts sequences
 * with none), and a call with one sequence of 2+ tokens as prefill-only.
 */
TRTPAGED_API int trtpaged_paged_attention_cpu(const trtpaged_attention_params* params,
                                              const void* q, const void* k, const void* v,
                                              void* kv_cache, const int32_t* positions,
                                              const int32_t* query_start,
                                              const int32_t* context_lens,
                                              const int32_t* block_tables, void* out);

/*
 * CUDA version; device pointers. workspace must hold
 * trtpaged_paged_attention_cuda_workspace_size(params, max_context_len) bytes
 * (it may be NULL when that size is 0). max_context_len bounds context_lens.
 */
TRTPAGED_API size_t trtpaged_paged_attention_cuda_workspace_size(
    const trtpaged_attention_params* params, int32_t max_context_len);
TRTPAGED_API int trtpaged_paged_attention_cuda(const trtpaged_attention_params* params,
                                               const void* q, const void* k, const void* v,
                                               void* kv_cache, const int32_t* positions,
                                               const int32_t* query_start,
                                               const int32_t* context_lens,
                                               const int32_t* block_tables, void* out,
                                               int32_t max_context_len, void* workspace,
                                               size_t workspace_size, void* stream);

/*
 * Copy-on-write: for each pair i, copy block pairs[2i] to block pairs[2i+1]
 * (every layer, K and V: one contiguous chunk of block_bytes). pairs is a host
 * array of 2*num_pairs ids in [0, num_kv_blocks); destinations must be distinct
 * and must not be sources.
 */
TRTPAGED_API int trtpaged_copy_blocks_cpu(void* kv_cache, int32_t num_kv_blocks, size_t block_bytes,
                                          const int32_t* pairs, int32_t num_pairs);
TRTPAGED_API int trtpaged_copy_blocks_cuda(void* kv_cache, int32_t num_kv_blocks, size_t block_bytes,
                                           const int32_t* pairs, int32_t num_pairs, void* stream);

/*
 * Swap blocks between two pools (device <-> host for preemption by swap, or
 * host <-> host): block pairs[2i] of src goes to block pairs[2i+1] of dst.
 * pairs is a host array. The _cpu version needs both pools in host memory; the
 * _cuda version accepts any mix of device and (preferably pinned) host memory.
 */
TRTPAGED_API int trtpaged_swap_blocks_cpu(const void* src_pool, int32_t src_num_kv_blocks,
                                          void* dst_pool, int32_t dst_num_kv_blocks,
                                          size_t block_bytes, const int32_t* pairs,
                                          int32_t num_pairs);
TRTPAGED_API int trtpaged_swap_blocks_cuda(const void* src_pool, int32_t src_num_kv_blocks,
                                           void* dst_pool, int32_t dst_num_kv_blocks,
                                           size_t block_bytes, const int32_t* pairs,
                                           int32_t num_pairs, void* stream);

/*
 * Weight-only quantized linear (CPU). A weight W [n, k] (n outputs, k inputs) is given as
 * codes q, per-group scales s and (4-bit only) per-group offsets o, a group being group_size
 * consecutive inputs of one output row:
 *     W[i, j] = s[i, j / group_size] * q[i, j] + o[i, j / group_size]
 *   bits 8: codes int8 [n, k]; offsets NULL; group_size 32, 64, 128 or k.
 *   bits 4: codes uint8 [n, k/2], ONNX-packed: byte [i, j] holds q[i, 2j] in its low nibble
 *           and q[i, 2j+1] in its high nibble (q in 0..15); offsets float [n, k/group_size];
 *           group_size 32, 64 or 128.
 * scales (and offsets) are float [n, k/group_size] whose values must be exactly representable
 * in fp16 (they are stored as fp16). k must be a multiple of 32 and of group_size.
 *
 * With int8 activations (trtpaged_qlinear_cpu), the kernel quantizes each row of x to int8
 * per block of 32 inputs (d = max|x|/127, q = round(x * (1/d)), ties to even, in float32), so
 * y equals x_dequantized @ W^T up to fp32 rounding: integer dot products per block, fp32
 * accumulation across blocks. The int4 offset term uses the blocks' quantized sums
 * (d * sum q), which keeps that identity exact.
 */

/* Bytes of the packed form of one quantized weight (host memory). */
TRTPAGED_API trtpaged_status trtpaged_qlinear_packed_bytes(int32_t bits, int64_t n, int64_t k, int32_t group_size,
                                                           size_t* bytes);
/* Repacks codes, scales and offsets (NULL for bits 8) into packed (64-byte aligned, of
 * trtpaged_qlinear_packed_bytes bytes). Fails with UNSUPPORTED, naming the value, when a scale
 * or offset is not exactly representable in fp16. */
TRTPAGED_API trtpaged_status trtpaged_qlinear_pack(int32_t bits, int64_t n, int64_t k, int32_t group_size,
                                                   const void* codes, const float* scales, const float* offsets,
                                                   void* packed);
/* y[m, n] = x[m, k] @ W^T (+ bias[n] when bias is not NULL), float32 row-major; W in packed form.
 * Multithreaded (OpenMP) across output features. Same as trtpaged_qlinear_cpu_ex with
 * TRTPAGED_QLINEAR_INT8_ACTIVATIONS. */
TRTPAGED_API trtpaged_status trtpaged_qlinear_cpu(const float* x, int64_t m, const void* packed, int32_t bits,
                                                  int64_t n, int64_t k, int32_t group_size, const float* bias,
                                                  float* y);
/* activations of trtpaged_qlinear_cpu_ex. INT8: x quantized per block of 32 as described above
 * (integer dot products: fastest, by far for large m). FLOAT: y equals x @ W^T up to fp32
 * rounding, as F.linear on the de-quantized weight would be: for m = 1 (AVX-VNNI: int8 weights at
 * any m, int4 up to m = 4; plain AVX2 int8 weights: never), each block of x is split into three
 * int8 limbs (x = d q1 + d/254 q2 + d/254^2 q3, what is left out below max|x| * 6.1e-8) run
 * through the integer kernels and summed; otherwise the codes are converted to float and dotted
 * with x in fp32, times the block's scale, and (bits 4) the offsets times float sums of x per group
 * are added. Costs more per weight byte than INT8
 * (about 1.3-2.5x on AVX-512), for accuracy. */
#define TRTPAGED_QLINEAR_INT8_ACTIVATIONS 0
#define TRTPAGED_QLINEAR_FLOAT_ACTIVATIONS 1
/* FLOAT_LIMB: as FLOAT, but the three limbs at every m, so each row of y is bit-identical to that row
 * run alone (FLOAT picks limbs or float tiles by m, and the two round differently): for a step whose
 * rows must give the logits a one-row step would (a one-sequence speculative verification). Where
 * FLOAT runs one row as float tiles too (plain AVX2, int8 weights), both run the float tiles, whose
 * rows have the same bits at every m. */
#define TRTPAGED_QLINEAR_FLOAT_LIMB_ACTIVATIONS 2
/* trtpaged_qlinear_cpu with a choice of activations (one of the three values above; other
 * values: INVALID_ARGUMENT). Same packed form. */
TRTPAGED_API trtpaged_status trtpaged_qlinear_cpu_ex(const float* x, int64_t m, const void* packed, int32_t bits,
                                                     int64_t n, int64_t k, int32_t group_size, const float* bias,
                                                     float* y, int32_t activations);
/* The instruction set the CPU kernels (quantized linear, paged attention) use on this CPU:
 * "avx512vnni", "avxvnni", "avx2" or "scalar". Chosen at first use: the best the CPU supports, or
 * $TRTPAGED_CPU_ISA if lower. */
TRTPAGED_API const char* trtpaged_cpu_isa(void);
/* The best instruction set this CPU supports (what trtpaged_cpu_isa gives when nothing forces a
 * lower one); same names. */
TRTPAGED_API const char* trtpaged_best_cpu_isa(void);
/* Forces the CPU kernels' instruction set (tests, comparisons); NULL or "" restores the
 * best. UNSUPPORTED if this CPU lacks it. Not to be called while a kernel runs. */
TRTPAGED_API trtpaged_status trtpaged_set_cpu_isa(const char* name);
/* The compiled copy of the CPU paged attention (KV write, quantization, attention) that the current
 * instruction set runs: "avx512" (x86-64-v4, under avx512vnni), "avx2" (x86-64-v3, under avx2 and
 * avxvnni) or "scalar". Every copy writes the same cache bytes. */
TRTPAGED_API const char* trtpaged_attention_cpu_path(void);

/*
 * Fused element-wise ops of the eager step model (CPU, float32, row-major, contiguous). Each is
 * one call where the torch form is several ops. OpenMP is used only for large calls.
 *
 * RMSNorm as HF Llama computes it: with residual (not NULL), h = x + residual is written to
 * residual_out (the new residual stream) and out = weight * (h * rsqrt(mean(h^2) + eps));
 * without, h = x (residual_out must then be NULL too). x, residual [rows, hidden], weight [hidden].
 * The mean of squares is accumulated in double. out may alias x; residual_out may alias x or
 * residual.
 */
TRTPAGED_API trtpaged_status trtpaged_rmsnorm_cpu(const float* x, const float* residual, const float* weight,
                                                  float eps, int64_t rows, int64_t hidden, float* out,
                                                  float* residual_out);
/*
 * Rotate-half RoPE (HF Llama: x * cos + cat(-x2, x1) * sin) on the q and k heads of a fused qkv
 * projection qkv [rows, (num_heads + 2 * num_kv_heads) * head_dim] (q heads, then k, then v);
 * cos, sin [rows, head_dim]. With q_out, k_out, v_out all NULL it rotates in place; with all
 * three given, qkv is only read and the rotated q [rows, num_heads, head_dim], rotated k and a
 * copy of v [rows, num_kv_heads, head_dim] are written there, dense.
 */
TRTPAGED_API trtpaged_status trtpaged_rope_qk_cpu(float* qkv, int64_t rows, int32_t num_heads, int32_t num_kv_heads,
                                                  int32_t head_dim, const float* cos, const float* sin, float* q_out,
                                                  float* k_out, float* v_out);
/* out [rows, intermediate] = silu(gate) * up, where gate_up [rows, 2 * intermediate] holds gate
 * then up in each row. */
TRTPAGED_API trtpaged_status trtpaged_silu_mul_cpu(const float* gate_up, int64_t rows, int64_t intermediate,
                                                   float* out);
/* Greedy choice and its log-probability in one pass over each selected logits row: for i < n,
 * row = logits + rows[i] * vocab (logits [*, vocab], rows[i] >= 0 and in range: not checked),
 * argmax[i] = the first index of the row's maximum and logsumexp[i] = log(sum(exp(row))), so
 * that row[argmax] - logsumexp is the chosen token's log-prob. Rows should be finite (an all-NaN
 * row gives an index in range and a NaN logsumexp; nothing past the row is read). */
TRTPAGED_API trtpaged_status trtpaged_greedy_rows_cpu(const float* logits, int64_t vocab, const int64_t* rows,
                                                      int64_t n, int64_t* argmax, float* logsumexp);

/* One quantized linear of a layer, as trtpaged_qlinear_cpu_ex takes it (packed by
 * trtpaged_qlinear_pack; bias may be NULL; activations: one of the three values above). */
typedef struct trtpaged_qlinear_weight {
  const void* packed;
  const float* bias;
  int64_t n, k;
  int32_t bits, group_size, activations;
} trtpaged_qlinear_weight;

/* One Llama-family decoder layer with quantized linears (float32 norms). */
typedef struct trtpaged_llama_layer {
  const float* input_norm;          /* [hidden] */
  const float* post_attention_norm; /* [hidden] */
  trtpaged_qlinear_weight qkv;      /* hidden -> (num_heads + 2 num_kv_heads) head_dim: q, k, v */
  trtpaged_qlinear_weight o;        /* num_heads head_dim -> hidden */
  trtpaged_qlinear_weight gate_up;  /* hidden -> 2 intermediate: gate, then up */
  trtpaged_qlinear_weight down;     /* intermediate -> hidden */
} trtpaged_llama_layer;

/*
 * Runs num_layers decoder layers over one step's packed tokens (float32, CPU), each exactly as
 * the calls it replaces: rmsnorm (with the residual add), qkv, rope_qk, paged attention (layer
 * i of the pool, attn's other fields as trtpaged_paged_attention_cpu takes them; attn->layer
 * is ignored), o, rmsnorm, gate_up, silu_mul, down. stream [rows, hidden]: in, the embeddings;
 * out, the residual stream before the last layer's MLP output is added. last [rows, hidden]:
 * out, that output (so the final norm is rmsnorm(last + stream)). cos/sin [rows, head_dim],
 * rows = attn->num_tokens, eps: the norms' epsilon. One C call per step where the Python model
 * makes ten per layer.
 */
TRTPAGED_API trtpaged_status trtpaged_llama_layers_cpu(const trtpaged_llama_layer* layers, int32_t num_layers,
                                                       int32_t hidden, int32_t intermediate, float eps,
                                                       float* stream, float* last, const float* cos,
                                                       const float* sin, const trtpaged_attention_params* attn,
                                                       void* kv_cache, const int32_t* positions,
                                                       const int32_t* query_start, const int32_t* context_lens,
                                                       const int32_t* block_tables);

/*
 * Per-layer attention options some model families need (appended to the ABI: trtpaged_attention_params
 * keeps its layout, and trtpaged_paged_attention_cpu/_cuda behave as these with every option 0).
 *   sliding_window > 0: the query at position p attends only to cached positions in
 *     [p - sliding_window + 1, p] (Mistral, Qwen2, Gemma 2/3 local layers: the query and the
 *     sliding_window - 1 tokens before it); keys before that are skipped, not read, and their
 *     blocks' ids in block_tables are not checked (a runtime may have returned those blocks to its
 *     pool). 0: every cached position <= p.
 *   logit_softcap > 0: each scaled score s becomes logit_softcap * tanh(s / logit_softcap) before the
 *     softmax (Gemma 2). 0: none.
 */
typedef struct trtpaged_attention_options {
  int32_t sliding_window;
  float logit_softcap;
} trtpaged_attention_options;

/* trtpaged_paged_attention_cpu with options (NULL: all 0). */
TRTPAGED_API int trtpaged_paged_attention_ex_cpu(const trtpaged_attention_params* params,
                                                 const trtpaged_attention_options* options,
                                                 const void* q, const void* k, const void* v,
                                                 void* kv_cache, const int32_t* positions,
                                                 const int32_t* query_start,
                                                 const int32_t* context_lens,
                                                 const int32_t* block_tables, void* out);
/* trtpaged_paged_attention_cuda with options (NULL: all 0); same workspace size. */
TRTPAGED_API int trtpaged_paged_attention_ex_cuda(const trtpaged_attention_params* params,
                                                  const trtpaged_attention_options* options,
                                                  const void* q, const void* k, const void* v,
                                                  void* kv_cache, const int32_t* positions,
                                                  const int32_t* query_start,
                                                  const int32_t* context_lens,
                                                  const int32_t* block_tables, void* out,
                                                  int32_t max_context_len, void* workspace,
                                                  size_t workspace_size, void* stream);

/* Message of the last failed call on this thread ("" if none). */
TRTPAGED_API const char* trtpaged_last_error(void);
/* Records message (NULL: "") as this thread's last error and returns status: how a library built on
 * this one (the runtime, runtime.h) reports through trtpaged_last_error(). */
TRTPAGED_API trtpaged_status trtpaged_record_error(trtpaged_status status, const char* message);
/* 1 if CUDA kernels were compiled into this library, else 0. */
TRTPAGED_API int trtpaged_has_cuda(void);
/* Library version, e.g. "0.1.0". */
TRTPAGED_API const char* trtpaged_version(void);
/* Comma-separated CUDA architectures compiled in, e.g. "80,90" ("" without CUDA). */
TRTPAGED_API const char* trtpaged_cuda_archs(void);

#ifdef __cplusplus
}
#endif

#endif /* TRTPAGED_TRTPAGED_H */
