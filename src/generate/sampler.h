// Next-token selection from a row of logits: greedy (argmax) or sampling with HF's warpers in HF's order:
// temperature, then top-k, then top-p (keep the smallest set of most likely tokens whose cumulative
// probability reaches top_p; at least one), then a draw from the renormalised distribution.
//
// RNG: std::mt19937_64 seeded with `seed`; one draw per sampled token, u = (rng() >> 11) * 2^-53 in [0, 1),
// the token = the first one (in descending probability order) where the cumulative probability exceeds
// u. Reproducible for a seed; not torch.multinomial's stream.
#pragma once
#include <cstdint>
#include <random>
#include <vector>

namespace titan {

struct SamplingOptions {
  bool do_sample = false;    // false: greedy (the other fields are ignored)
  double temperature = 1.0;  // > 0
  int64_t top_k = 0;         // 0: off
  double top_p = 1.0;        // (0, 1]; 1: off
  uint64_t seed = 0;
};

// Index of the largest logit; the first one on ties (torch.argmax).
int32_t argmax(const float* logits, int64_t V);

class Sampler {
 public:
  explicit Sampler(const SamplingOptions& opts);
  int32_t next(const float* logits, int64_t V);
  // The tokens that sampling could pick and their probabilities (descending), after every warper; for
  // tests and diagnostics.
  std::vector<std::pair<int32_t, double>> candidates(const float* logits, int64_t V) const;

 private:
  SamplingOptions opts_;
  std::mt19937_64 rng_;
};

}  // namespace titan
