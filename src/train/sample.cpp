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
  KVCacheModel kv(model, static_cast<int64_t>(ids.size()) + n);
  GenerateOptions go;
  go.max_new_tokens = n;
  go.sampling = SamplingOptions{true, 0.8, 40, 1.0, seed};
  return generate(kv, ids, go);
}

}  // namespace titan
