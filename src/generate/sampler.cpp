#include "generate/sampler.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace titan {

int32_t argmax(const float* logits, int64_t V) {
  int64_t best = 0;
  for (int64_t v = 1; v < V; ++v)
    if (logits[v] > logits[best]) best = v;
  return static_cast<int32_t>(best);
}

Sampler::Sampler(const SamplingOptions& opts) : opts_(opts), rng_(opts.seed) {
  TITAN_CHECK(opts.top_k >= 0, "top_k must be >= 0 (0: off), got ", opts.top_k);
  TITAN_CHECK(opts.top_p > 0 && opts.top_p <= 1, "top_p must be in (0, 1], got ", opts.top_p);
  TITAN_CHECK(!opts.do_sample || (opts.temperature > 0 && std::isfinite(opts.temperature)),
              "temperature must be > 0, got ", opts.temperature, " (greedy decoding is temperature 0)");
}

std::vector<std::pair<int32_t, double>> Sampler::candidates(const float* logits, int64_t V) const {
  // Temperature-scaled logits, most likely first; top-k keeps the first k (ties at the k-th logit keep only
  // k tokens here; HF keeps every token tied with the k-th).
  std::vector<std::pair<double, int32_t>> s(V);
  for (int64_t v = 0; v < V; ++v) s[v] = {(double)logits[v] / opts_.temperature, (int32_t)v};
  auto desc = [](const auto& a, const auto& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  const int64_t k = opts_.top_k > 0 ? std::min<int64_t>(opts_.top_k, V) : V;
  std::partial_sort(s.begin(), s.begin() + k, s.end(), desc);
  s.resize(k);
  // Softmax over the kept tokens (the others are -inf).
  std::vector<std::pair<int32_t, double>> out(k);
  double sum = 0;
  for (int64_t i = 0; i < k; ++i) sum += (out[i].second = std::exp(s[i].first - s[0].first));
  for (int64_t i = 0; i < k; ++i) out[i] = {s[i].second, out[i].second / sum};
  // Top-p: the smallest prefix whose probability reaches top_p, renormalised.
  if (opts_.top_p < 1.0) {
    double cum = 0;
    size_t keep = 0;
    while (keep < out.size() && cum < opts_.top_p) cum += out[keep++].second;
    out.resize(std::max<size_t>(keep, 1));
    double total = 0;
    for (auto& c : out) total += c.second;
    for (auto& c : out) c.second /= total;
  }
  return out;
}

int32_t Sampler::next(const float* logits, int64_t V) {
  if (!opts_.do_sample) return argmax(logits, V);
  const auto c = candidates(logits, V);
  const double u = static_cast<double>(rng_() >> 11) * 0x1.0p-53;
  double cum = 0;
  for (const auto& [id, p] : c)
    if ((cum += p) > u) return id;
  return c.back().first;  // u beyond the rounded total
}

}  // namespace titan
