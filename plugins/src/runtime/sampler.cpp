#include "runtime/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "runtime/error.h"
#include "trtpaged/trtpaged.h"

namespace trtpaged::rt {

int32_t sample_row(const float* row, int64_t vocab, const SampleParams& p, std::mt19937_64& rng) {
  if (p.temperature < kGreedyEps) {
    const int64_t index = 0;
    int64_t argmax = 0;
    float logsumexp = 0;
    check_kernel(trtpaged_greedy_rows_cpu(row, vocab, &index, 1, &argmax, &logsumexp), "greedy_rows");
    return std::isfinite(logsumexp) ? int32_t(argmax) : -1;
  }
  // temperature, then top-k and top-p over the tokens sorted by logit (the most likely always survives)
  std::vector<float> scaled(row, row + vocab);
  float top = -INFINITY;
  for (float& x : scaled) {
    x /= p.temperature;
    if (std::isnan(x)) return -1;
    top = std::max(top, x);
  }
  if (!std::isfinite(top)) return -1;
  std::vector<int32_t> order(static_cast<size_t>(vocab));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return scaled[size_t(a)] > scaled[size_t(b)]; });
  size_t keep = size_t(vocab);
  if (p.top_k > 0 && p.top_k < vocab) {
    const float kth = scaled[size_t(order[size_t(p.top_k - 1)])];
    keep = size_t(p.top_k);
    while (keep < size_t(vocab) && scaled[size_t(order[keep])] >= kth) ++keep;  // ties with the k-th stay
  }
  std::vector<double> probs(keep);
  double total = 0;
  for (size_t i = 0; i < keep; ++i) total += probs[i] = std::exp(double(scaled[size_t(order[i])]) - double(top));
  if (p.top_p < 1.0f) {
    double mass = 0;
    size_t cut = keep;
    for (size_t i = 0; i < keep; ++i) {
      if (i > 0 && mass >= double(p.top_p)) {  // the mass before this token is already enough
        cut = i;
        break;
      }
      mass += probs[i] / total;
    }
    keep = cut;
    total = std::accumulate(probs.begin(), probs.begin() + long(keep), 0.0);
  }
  double u = std::uniform_real_distribution<double>(0.0, total)(rng);
  for (size_t i = 0; i < keep; ++i) {
    u -= probs[i];
    if (u < 0) return order[i];
  }
  return order[keep - 1];
}

}  // namespace trtpaged::rt
