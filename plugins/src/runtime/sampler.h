// Picks one token per logits row: greedy (the first most likely token, as torch.argmax and the
// Python runtime's greedy path pick it), or temperature / top-k / top-p sampling from the
// request's own generator. Produces tokens only; the scheduler applies them.
#pragma once

#include <cstdint>
#include <random>

namespace trtpaged::rt {

struct SampleParams {
  float temperature;  // < 1e-5: greedy
  int32_t top_k;      // 0: off
  float top_p;        // 1: off
};

// The token for row [vocab] of logits, or -1 when the row is not finite (no token can be chosen).
int32_t sample_row(const float* row, int64_t vocab, const SampleParams& p, std::mt19937_64& rng);

constexpr float kGreedyEps = 1e-5f;

}  // namespace trtpaged::rt
