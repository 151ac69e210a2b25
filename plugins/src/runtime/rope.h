// Rotary position embeddings as trtpaged/models/rope.py and models/llama.py (Rotary) compute them, in the same
// float32 operations: the frequencies of each rope type, then the cos/sin tables of a step's positions.
#pragma once

#include <cstdint>
#include <vector>

#include "runtime/engine_dir.h"

namespace trtpaged::rt {

struct RotaryFrequencies {
  std::vector<float> inv_freq;  // [dim / 2]
  double attention_scaling = 1;  // cos and sin are multiplied by it (yarn, longrope)
  bool finite() const;           // every frequency finite in float32
  bool scaling_usable() const;   // the scaling finite and non-zero as the tables' float32 (else NaN or 0 logits)
};

// dim: the rotated dims (head_dim * partial_rotary_factor). A parameter out of its domain gives non-finite
// frequencies, which the caller refuses.
RotaryFrequencies rotary_frequencies(int64_t dim, double theta, const RopeScaling& scaling);

// cos/sin [rows, dim] of a step's positions: the angle position * inv_freq rounded to float32, its cos and sin
// correctly rounded (computed in double), each half of the dims the same, times the attention scaling.
struct RotaryTable {
  RotaryFrequencies frequencies;
  std::vector<float> cos, sin;
  int64_t dim() const { return 2 * int64_t(frequencies.inv_freq.size()); }
  void fill(const int32_t* positions, int32_t rows);
};

}  // namespace trtpaged::rt
