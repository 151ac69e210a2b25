// The rope types of trtpaged/models/rope.py, each the same float32 operations in the same order (torch's
// tensor-scalar ops take the scalar as a float32; 1.0 / x is a float32 reciprocal).
#include "runtime/rope.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace trtpaged::rt {

namespace {

// base ** (2i / dim) for i < dim / 2: float32 exponents, the power correctly rounded to float32 (rope.py: _powers)
std::vector<float> powers(int64_t dim, double base) {
  std::vector<float> out;
  for (int64_t i = 0; i < dim / 2; ++i) out.push_back(float(std::pow(base, double(float(2 * i) / float(dim)))));
  return out;
}

// Llama 3.1: long wavelengths divided by factor, a smooth blend in between (rope.py: _llama3)
float llama3_scaled(float inv, const RopeScaling& r) {
  const float factor = float(r.factor), low = float(r.low_freq_factor), high = float(r.high_freq_factor),
              old_len = float(r.original_max_position_embeddings);
  const float low_wavelen = old_len / low, high_wavelen = old_len / high;
  const float wavelen = float(2 * M_PI) / inv;
  const float scaled = wavelen > low_wavelen ? inv / factor : inv;
  const float smooth = (old_len / wavelen - low) / (high - low);
  const float blended = (1 - smooth) * scaled / factor + smooth * scaled;
  return (!(wavelen < high_wavelen) && !(wavelen > low_wavelen)) ? blended : scaled;
}

// Phi-3 LongRoPE with its short factors (rope.py: _longrope); the reader filled in the derived factor
RotaryFrequencies longrope(int64_t dim, double base, const RopeScaling& r) {
  RotaryFrequencies out;
  const double original = r.original_max_position_embeddings;
  out.attention_scaling = r.attention_factor != 0 ? r.attention_factor
                          : r.factor <= 1          ? 1.0
                                                   : std::sqrt(1 + std::log(r.factor) / std::log(original));
  const std::vector<float> p = powers(dim, base);
  for (size_t i = 0; i < p.size(); ++i) out.inv_freq.push_back(1.0f / (float(r.short_factor[i]) * p[i]));
  return out;
}

// yarn's attention scaling (rope.py: _yarn's get_mscale)
double yarn_scaling(const RopeScaling& r) {
  if (r.attention_factor != 0) return r.attention_factor;
  auto mscale = [&](double m) { return r.factor <= 1 ? 1.0 : 0.1 * m * std::log(r.factor) + 1.0; };
  return r.mscale != 0 && r.mscale_all_dim != 0 ? mscale(r.mscale) / mscale(r.mscale_all_dim) : mscale(1.0);
}

// YaRN: interpolated long wavelengths, extrapolated short ones, a linear ramp between (rope.py: _yarn)
RotaryFrequencies yarn(int64_t dim, double base, const RopeScaling& r) {
  auto correction_dim = [&](double rotations) {
    return (double(dim) * std::log(r.original_max_position_embeddings / (rotations * 2 * M_PI))) /
           (2 * std::log(base));
  };
  double low = correction_dim(r.beta_fast), high = correction_dim(r.beta_slow);
  if (!std::isfinite(low) || !std::isfinite(high))  // rope.py fails there (a zero division, floor of inf)
    return {std::vector<float>(size_t(dim / 2), std::numeric_limits<float>::quiet_NaN()), 1};
  if (r.truncate) {
    low = std::floor(low);
    high = std::ceil(high);
  }
  low = std::max(low, 0.0);
  high = std::min(high, double(dim - 1));
  const float span = float(high != low ? high - low : 0.001);
  RotaryFrequencies out;
  out.attention_scaling = yarn_scaling(r);
  const std::vector<float> p = powers(dim, base);
  for (size_t i = 0; i < p.size(); ++i) {
    const float extrapolation = 1.0f / p[i], interpolation = 1.0f / (float(r.factor) * p[i]);
    const float ramp = (float(i) - float(low)) / span;
    const float extrapolation_factor = 1.0f - (ramp < 0 ? 0.0f : ramp > 1 ? 1.0f : ramp);  // a NaN stays NaN
    out.inv_freq.push_back(interpolation * (1.0f - extrapolation_factor) + extrapolation * extrapolation_factor);
  }
  return out;
}

}  // namespace

bool RotaryFrequencies::finite() const {
  return std::all_of(inv_freq.begin(), inv_freq.end(), [](float f) { return std::isfinite(f); });
}

bool RotaryFrequencies::scaling_usable() const {
  const float s = float(attention_scaling);  // as fill multiplies the tables by it
  return std::isfinite(attention_scaling) && std::isfinite(s) && s != 0 && std::fabs(s) <= kMaxRopeScaling;
}

RotaryFrequencies rotary_frequencies(int64_t dim, double theta, const RopeScaling& scaling) {
  if (scaling.type == "longrope") return longrope(dim, theta, scaling);
  if (scaling.type == "yarn") return yarn(dim, theta, scaling);
  RotaryFrequencies out;
  for (float p : powers(dim, theta)) {
    const float inv = 1.0f / p;
    out.inv_freq.push_back(scaling.type == "linear"   ? inv / float(scaling.factor)
                           : scaling.type == "llama3" ? llama3_scaled(inv, scaling)
                                                      : inv);
  }
  return out;
}

void RotaryTable::fill(const int32_t* positions, int32_t rows) {
  const int64_t d = dim(), half = d / 2;
  const float scaling = float(frequencies.attention_scaling);
  cos.resize(size_t(rows * d));
  sin.resize(size_t(rows * d));
  for (int32_t t = 0; t < rows; ++t) {
    const float p = float(positions[t]);
    for (int64_t i = 0; i < half; ++i) {
      const float f = p * frequencies.inv_freq[size_t(i)];
      const float c = float(std::cos(double(f))) * scaling, s = float(std::sin(double(f))) * scaling;
      cos[size_t(t * d + i)] = cos[size_t(t * d + i + half)] = c;
      sin[size_t(t * d + i)] = sin[size_t(t * d + i + half)] = s;
    }
  }
}

}  // namespace trtpaged::rt
