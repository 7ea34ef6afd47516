#include "train/sample.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <random>

namespace titan {

namespace {

// Index into the top-k candidates drawn with weights exp((logit - max) / temperature).
int64_t draw_top_k(const std::vector<std::pair<float, int32_t>>& top, int64_t k, double temperature,
                   std::mt19937_64& rng) {
  std::vector<double> w(k);
  for (int64_t j = 0; j < k; ++j) w[j] = std::exp((top[j].first - top[0].first) / temperature);
  double total = 0;
  for (double x : w) total += x;
  double r = (rng() >> 11) * 0x1.0p-53 * total;
  int64_t pick = 0;
  while (pick + 1 < k && r >= w[pick]) r -= w[pick++];
  return pick;
}

}  // namespace

std::vector<int32_t> sample_tokens(Qwen3Model& model, std::vector<int32_t> ids, int64_t n,
                                   int64_t max_context, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const int64_t V = model.config().vocab_size;
  const int64_t start = static_cast<int64_t>(ids.size());
  for (int64_t i = 0; i < n; ++i) {
    const int64_t T = std::min<int64_t>(static_cast<int64_t>(ids.size()), max_context);
    std::vector<int32_t> ctx(ids.end() - T, ids.end()), labels(T, -100);
    ForwardOptions fo;
    fo.compute_grad = false;
    fo.keep_logits = true;
    model.forward(ctx.data(), labels.data(), 1, T, fo);
    const float* last = model.logits().f32() + (T - 1) * V;
    std::vector<std::pair<float, int32_t>> top(V);
    for (int64_t v = 0; v < V; ++v) top[v] = {last[v], static_cast<int32_t>(v)};
    const int64_t k = std::min<int64_t>(40, V);
    std::partial_sort(top.begin(), top.begin() + k, top.end(), std::greater<>());
    ids.push_back(top[draw_top_k(top, k, 0.8, rng)].second);
  }
  return std::vector<int32_t>(ids.begin() + start, ids.end());
}

}  // namespace titan
