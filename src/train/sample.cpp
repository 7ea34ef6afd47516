#include "train/sample.h"

#include <algorithm>

#include "generate/generator.h"

namespace titan {

std::vector<int32_t> sample_tokens(Qwen3Model& model, std::vector<int32_t> ids, int64_t n,
                                   int64_t max_context, uint64_t seed) {
  if (n <= 0) return {};
  const int64_t ctx = std::min<int64_t>(max_context, model.config().max_position_embeddings);
  const int64_t keep = std::max<int64_t>(ctx - n, 1);
  if (static_cast<int64_t>(ids.size()) > keep) ids.erase(ids.begin(), ids.end() - keep);
  const SamplingOptions sampling{true, 0.8, 40, 1.0, seed};
  if (!model.lora() && !model.param_streamer()) {
    KVCacheModel kv(model, static_cast<int64_t>(ids.size()) + n);
    GenerateOptions go;
    go.max_new_tokens = n;
    go.sampling = sampling;
    return generate(kv, ids, go);
  }
  Sampler sampler(sampling);
  const int64_t V = model.config().vocab_size;
  std::vector<float> last(V);
  std::vector<int32_t> out;
  ForwardOptions fo;
  fo.compute_grad = false;
  fo.keep_logits = true;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t T = static_cast<int64_t>(ids.size());
    model.forward(ids.data(), ids.data(), 1, T, fo);
    model.logits().view_at((T - 1) * V, {V}).copy_to_host(last.data());
    out.push_back(sampler.next(last.data(), V));
    ids.push_back(out.back());
  }
  return out;
}

}  // namespace titan
