#include "generate/eval.h"

#include <cmath>

#include "core/error.h"
#include "data/loader.h"

namespace titan {

data::DataConfig eval_data_config(const std::vector<std::string>& sources, const std::string& tokenizer,
                                  int64_t seq_len, data::DataFormat format, const std::string& text_field) {
  TITAN_CHECK(!sources.empty(), "eval: no data file given");
  TITAN_CHECK(seq_len > 0, "eval: seq_len must be > 0, got ", seq_len);
  data::DataConfig cfg;
  cfg.sources = sources;
  cfg.format = format;
  cfg.text_field = text_field;
  cfg.tokenizer = tokenizer;
  cfg.seq_len = seq_len;
  cfg.batch_size = 1;  // windows are grouped into forwards here, so a partial last batch is not dropped
  cfg.shuffle = false;
  cfg.max_epochs = 1;
  return cfg;
}

EvalResult evaluate_dataset(Qwen3Model& model, const data::DataConfig& cfg, int64_t batch, int64_t* windows) {
  TITAN_CHECK(batch > 0, "eval: batch must be > 0, got ", batch);
  data::DataLoader loader(cfg);
  TITAN_CHECK(loader.vocab_size() <= model.config().vocab_size, "eval: the tokenizer has ",
              loader.vocab_size(), " ids but the model's vocabulary is ", model.config().vocab_size);
  const int64_t T = cfg.seq_len;
  std::vector<int32_t> ids, labels;
  ForwardOptions fo;
  fo.compute_grad = false;
  fo.labels_shifted = true;  // the loader's labels are the next tokens already
  EvalResult r;
  if (windows) *windows = 0;
  auto run = [&] {
    const int64_t B = static_cast<int64_t>(ids.size()) / T;
    if (B == 0) return;
    const ForwardResult f = model.forward(ids.data(), labels.data(), B, T, fo);
    r.loss_sum += f.loss_sum;
    r.targets += f.num_valid;
    ++r.batches;
    if (windows) *windows += B;
    ids.clear(), labels.clear();
  };
  data::Batch b;
  while (loader.next_batch(b)) {
    ids.insert(ids.end(), b.input_ids.begin(), b.input_ids.end());
    labels.insert(labels.end(), b.labels.begin(), b.labels.end());
    if (static_cast<int64_t>(ids.size()) == batch * T) run();
  }
  run();
  TITAN_CHECK(r.batches > 0, "eval: the data holds no whole window of seq_len + 1 = ", T + 1,
              " tokens (use a smaller --seq-len)");
  return r;
}

}  // namespace titan
