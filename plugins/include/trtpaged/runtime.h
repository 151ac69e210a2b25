/*
 * trtpaged runtime library (libtrtpaged_runtime): load an engine dir and generate from C, C++ or
 * anything that binds C, without Python. Built on the kernel library (trtpaged.h), whose
 * trtpaged_last_error() carries this library's messages too. docs/embedding.md has the guide.
 *
 * Two levels:
 * - the step (trtpaged_runtime_step): one packed step of the engine I/O contract, for embedders
 *   that run their own scheduler and block tables;
 * - requests (trtpaged_request_*, trtpaged_runtime_run_step): add a prompt given as token ids,
 *   step, read the new tokens, abort. Continuous batching, chunked prefill, prefix sharing of full
 *   blocks, preemption by recompute and, when every layer has a sliding window, the blocks before a
 *   request's window returned to the pool, by the Python scheduler's rules; a deliberately small
 *   subset of it (one sample per request: no n > 1, beams, swap, log-probs, penalties or stop
 *   strings). Tokenization stays with the embedder.
 *
 * Backends: the CPU (weights.safetensors; float32 engines, float or weight-quantized linears).
 * CUDA/TensorRT engines (engine.plan) are refused with TRTPAGED_ERR_UNSUPPORTED.
 *
 * Errors: every function returns a trtpaged_status (TRTPAGED_OK = 0); on failure
 * trtpaged_last_error() (per thread) names the argument or engine-dir field and the limit.
 * No C++ exception crosses this boundary.
 *
 * Thread safety and ownership: a trtpaged_runtime is used by one thread at a time (calls on
 * one handle must be serialized by the caller); different handles may run on different threads.
 * A call that overlaps another thread's call on the same handle returns INVALID_ARGUMENT instead of
 * racing (closing a handle another thread uses is still undefined).
 * The handle owns the weights and the KV pool; trtpaged_runtime_close frees them. Input arrays are
 * read during the call only (never kept); output arrays are written during the call only.
 */
#ifndef TRTPAGED_RUNTIME_H
#define TRTPAGED_RUNTIME_H

#include <stddef.h>
#include <stdint.h>

#include "trtpaged/trtpaged.h"

#ifdef __cplusplus
extern "C" {
#endif

/* An engine dir loaded with its KV pool and request state. Opaque. */
typedef struct trtpaged_runtime trtpaged_runtime;

/* What to open an engine dir with. Initialize with trtpaged_open_options_init, then set fields. */
typedef struct trtpaged_open_options {
  uint32_t struct_size;          /* sizeof(trtpaged_open_options), set by _init */
  int64_t num_kv_blocks;         /* > 0: KV pool blocks (overrides the manifest's budget); 0: not set */
  int64_t kv_bytes;              /* > 0: KV pool bytes (blocks = kv_bytes / block bytes); 0: not set.
                                    At most one of num_kv_blocks and kv_bytes; neither: the manifest's budget */
  int32_t max_batch_size;        /* > 0: tighten the engine's limit; 0: the engine's */
  int32_t max_num_tokens;        /* > 0: tighten (tokens per step); 0: the engine's */
  int32_t max_seq_len;           /* > 0: tighten (prompt + output tokens); 0: the engine's */
  int32_t enable_prefix_caching; /* 1 (default): share full prompt blocks between requests; 0: off (else refused) */
  const char* backend;           /* NULL, "auto" or "cpu"; "tensorrt" is refused (UNSUPPORTED) */
} trtpaged_open_options;

TRTPAGED_API void trtpaged_open_options_init(trtpaged_open_options* options);

/* Opens engine_dir (the directory holding trtpaged.json). The manifest is checked (format version,
 * architecture, dims, limits, dtypes, quantization, backends) and every file it names must stay
 * inside the dir (no absolute paths, no "..", no symlink out). The weights' safetensors header is
 * checked against the file size and the model's tensors before anything is allocated; float
 * weights are checked for NaN/inf. File hashes are not checked (trtpaged inspect --verify does).
 * Every family trtpaged builds runs (Llama, Mistral, Qwen2/3, SmolLM3, Phi-3, Gemma 2/3: sliding windows, q/k
 * norms, partial rotary, yarn and LongRoPE, Gemma's norms, scales and soft-caps); a rope type other than those
 * is TRTPAGED_ERR_UNSUPPORTED naming its manifest field (docs/embedding.md).
 * options may be NULL (defaults). On success *out is a new handle; on failure *out is NULL. */
TRTPAGED_API trtpaged_status trtpaged_runtime_open(const char* engine_dir, const trtpaged_open_options* options,
                                                   trtpaged_runtime** out);
/* Frees everything the handle owns; NULL is ignored. The handle must not be used afterwards. */
TRTPAGED_API void trtpaged_runtime_close(trtpaged_runtime* runtime);

/* What an opened engine runs with (limits after tightening). */
typedef struct trtpaged_runtime_info {
  int32_t vocab_size, hidden_size, num_layers, num_heads, num_kv_heads, head_dim;
  int32_t block_size, max_batch_size, max_num_tokens, max_seq_len;
  int64_t num_kv_blocks;     /* blocks in the pool */
  int64_t kv_bytes_per_block;
  int32_t num_eos_token_ids; /* how many of eos_token_ids are set: the manifest's first 8 at most (all of its
                                eos_token_ids stop a request, those past 8 too) */
  int32_t eos_token_ids[8];
  int32_t quantized;         /* 1 when the linears are weight-quantized */
  int32_t one_call_layers;   /* 1 when every layer runs in one kernel call (trtpaged_llama_layers_cpu) */
} trtpaged_runtime_info;

TRTPAGED_API trtpaged_status trtpaged_runtime_get_info(const trtpaged_runtime* runtime, trtpaged_runtime_info* out);

/* ---- the step (engine I/O contract, docs/architecture.md) -------------------------------------------- */

/* One packed step: num_seqs sequences, each with a chunk of new tokens (a prefill chunk or one decode
 * token), int32 host arrays:
 *   input_ids     [num_tokens]   token ids, in [0, vocab_size)
 *   positions     [num_tokens]   absolute position of each token
 *   query_start   [num_seqs + 1] CSR offsets of each sequence's tokens (0 ... num_tokens)
 *   context_lens  [num_seqs]     KV length of each sequence after this step (<= max_seq_len)
 *   block_tables  [num_seqs, max_blocks_per_seq] block ids in [0, num_kv_blocks) of each sequence
 *   logits_index  [num_outputs]  rows of the packed tokens whose logits come back
 * Limits: 1 <= num_seqs <= max_batch_size, num_seqs <= num_tokens <= max_num_tokens,
 * 0 <= positions[t] < context_lens[s]. The new tokens' K/V is written to their slots (the slot of
 * position p is block_tables[s][p / block_size], offset p % block_size); no slot is written by two sequences of
 * a step (refused: give each writer its own block, trtpaged_runtime_copy_blocks). */
typedef struct trtpaged_step_inputs {
  int32_t num_tokens, num_seqs, max_blocks_per_seq, num_outputs;
  const int32_t* input_ids;
  const int32_t* positions;
  const int32_t* query_start;
  const int32_t* context_lens;
  const int32_t* block_tables;
  const int32_t* logits_index;
} trtpaged_step_inputs;

/* Runs one step; logits [num_outputs, vocab_size] float32 (logits_capacity: floats it holds). Every
 * input is checked before anything is written. Refused (INVALID_ARGUMENT) while requests of the
 * request API are unfinished: both would write the same pool. It empties the request API's prefix
 * cache (the blocks it wrote may be ones the cache offers); so does trtpaged_runtime_copy_blocks. */
TRTPAGED_API trtpaged_status trtpaged_runtime_step(trtpaged_runtime* runtime, const trtpaged_step_inputs* inputs,
                                                   float* logits, size_t logits_capacity);
/* Copies whole blocks (every layer, K and V): block pairs[2i] to pairs[2i+1] (copy-on-write). Refused
 * while requests of the request API are unfinished, as trtpaged_runtime_step is. */
TRTPAGED_API trtpaged_status trtpaged_runtime_copy_blocks(trtpaged_runtime* runtime, const int32_t* pairs,
                                                          int32_t num_pairs);

/* ---- requests ------------------------------------------------------------------------------------ */

/* How a request picks its tokens and when it stops. Initialize with trtpaged_sampling_init (greedy,
 * 16 tokens). */
typedef struct trtpaged_sampling {
  uint32_t struct_size;           /* sizeof(trtpaged_sampling), set by _init */
  int32_t max_tokens;             /* >= 1, at most max_seq_len - prompt length */
  float temperature;              /* 0 (< 1e-5): greedy, the first most likely token; else sampled */
  int32_t top_k;                  /* 0 (or -1, vLLM's): off; else keep the k most likely (sampled only) */
  float top_p;                    /* (0, 1]; 1: off (sampled only) */
  int32_t has_seed;               /* 1: draw from a private generator seeded with seed; 0: not (else refused) */
  uint64_t seed;
  const int32_t* stop_token_ids;  /* tokens in [0, vocab_size) that end the request (kept in its output); may be NULL
                                     if 0 */
  int32_t num_stop_token_ids;     /* at most 64 */
  int32_t ignore_eos;             /* 1: do not stop at the manifest's eos_token_ids; 0: stop (else refused) */
} trtpaged_sampling;

TRTPAGED_API void trtpaged_sampling_init(trtpaged_sampling* sampling);

/* Why a request ended (trtpaged_request_read's *finish_reason). */
typedef enum trtpaged_finish_reason {
  TRTPAGED_RUNNING = 0,      /* not finished, or finished with tokens left unread */
  TRTPAGED_FINISH_STOP = 1,  /* an EOS or stop token (the last token read) */
  TRTPAGED_FINISH_LENGTH = 2, /* max_tokens or max_seq_len, or the pool can never hold it */
  TRTPAGED_FINISH_ABORT = 3, /* trtpaged_request_abort */
  TRTPAGED_FINISH_ERROR = 4  /* its logits were not finite, or the kernels failed in its step */
} trtpaged_finish_reason;

/* Queues a request: prompt [prompt_len] token ids in [0, vocab_size). Refused (INVALID_ARGUMENT,
 * naming the argument and the limit) when it can never run: an empty or too long prompt, a token id
 * outside the vocabulary, more blocks than the pool, max_tokens beyond max_seq_len. sampling NULL:
 * the _init defaults. *request_id: a new id (>= 0), never reused by this handle. */
TRTPAGED_API trtpaged_status trtpaged_request_add(trtpaged_runtime* runtime, const int32_t* prompt, int32_t prompt_len,
                                                  const trtpaged_sampling* sampling, int64_t* request_id);
/* One iteration: schedules (decode first, then prefill chunks, then admits waiting requests in
 * arrival order within max_num_tokens and max_batch_size), runs the step and appends one token to
 * every request whose prompt is complete. *num_tokens (may be NULL): tokens computed (0: nothing
 * to do). A failure here (the kernels) returns its status and ends the step's requests with
 * TRTPAGED_FINISH_ERROR (their blocks return to the pool); the other requests are as they were. */
TRTPAGED_API trtpaged_status trtpaged_runtime_run_step(trtpaged_runtime* runtime, int32_t* num_tokens);
/* Copies the tokens request_id generated since the last read (at most capacity; the rest stay for
 * the next read) to tokens, their count to *num_read and its state to *finish_reason: TRTPAGED_RUNNING
 * while tokens are left unread, its finish reason from the read that returns its last token on. That read
 * forgets a finished request (its id is then unknown). */
TRTPAGED_API trtpaged_status trtpaged_request_read(trtpaged_runtime* runtime, int64_t request_id, int32_t* tokens,
                                                   int32_t capacity, int32_t* num_read, int32_t* finish_reason);
/* Ends a request now and frees its blocks; its unread tokens stay readable (finish reason ABORT). */
TRTPAGED_API trtpaged_status trtpaged_request_abort(trtpaged_runtime* runtime, int64_t request_id);

/* Scheduler and pool counters. */
typedef struct trtpaged_runtime_stats {
  int32_t num_waiting, num_running;  /* unfinished requests */
  int64_t num_steps, num_tokens_computed, num_preemptions;
  int64_t kv_blocks_free, kv_blocks_used, prefix_cache_hits_tokens;
} trtpaged_runtime_stats;

TRTPAGED_API trtpaged_status trtpaged_runtime_get_stats(const trtpaged_runtime* runtime, trtpaged_runtime_stats* out);
/* One counter by name, for counters added after trtpaged_runtime_stats (whose size is fixed, so that a program
 * built against an older header stays safe): each field of trtpaged_runtime_stats by its name, and
 * "kv_blocks_reclaimed" (blocks a sliding-window engine gave back to the pool before their request ended: wholly
 * before every layer's window; 0 where a layer is global). An unknown name is INVALID_ARGUMENT naming it. */
TRTPAGED_API trtpaged_status trtpaged_runtime_get_counter(const trtpaged_runtime* runtime, const char* name,
                                                          int64_t* value);

#ifdef __cplusplus
}
#endif

#endif /* TRTPAGED_RUNTIME_H */
