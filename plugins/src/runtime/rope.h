// Rotary position embeddings as trtpaged/models/rope.py and models/llama.py (Rotary) compute them, in the same
// float32 operations: the frequencies of each rope type, then the cos/sin tables of a step's positions.
#pragma once

#include <cstdint>
#include <vector>

#include "runtime/engine_dir.h"

namespace trtpaged::rt {

// The most a cos/sin scaling may be in magnitude (rope.py's MAX_ROPE_SCALING): q and k are both scaled, so the
// scores grow as its square (at 1e20 they pass float32 and every logit is NaN); real models' are 1 to 2.
inline constexpr float kMaxRopeScaling = 1000;

struct RotaryFrequencies {
  std::vector<float> inv_freq;  // [dim / 2]
  double attention_scaling = 1;  // cos and sin are multiplied by it (yarn, longrope)
  bool finite() const;           // every frequency finite in float32
  bool scaling_usable() const;   // non-zero, at most kMaxRopeScaling in magnitude as the tables' float32
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
