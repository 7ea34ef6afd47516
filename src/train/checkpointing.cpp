#include "train/checkpointing.h"

#include "core/error.h"
#include "dist/process_group.h"

namespace titan {

std::string group_name(int64_t num_layers, int g) {
  if (g == 0) return "embed";
  if (g <= num_layers) return "layers." + std::to_string(g - 1);
  return "final";
}

namespace {

ckpt::Slice slice_of(const std::string& name, int64_t numel, int64_t offset, const Tensor& t, int64_t count) {
  return ckpt::Slice{name, numel, offset, t.view_at(0, {count})};
}

void add_buffers(Qwen3Model& model, std::vector<ckpt::Slice>& out) {
  for (auto& [name, t] : model.buffers()) out.push_back(ckpt::Slice{"buffer/" + name, t.numel(), 0, t});
}

}  // namespace

std::vector<ckpt::Slice> training_slices(Qwen3Model& model, dist::DataParallelPlan& dp, AdamW& optimizer,
                                         bool buffers) {
  std::vector<ckpt::Slice> out;
  const int64_t L = model.config().num_hidden_layers;
  for (int g = 0; g < model.num_groups(); ++g) {
    const std::string group = group_name(L, g);
    const int64_t numel = model.group_numel(g), offset = dp.optimizer_offset(g),
                  count = dp.optimizer_count(g);
    out.push_back(slice_of("model/" + group, numel, offset, dp.optimizer_params()[g], count));
    out.push_back(slice_of("exp_avg/" + group, numel, offset, optimizer.exp_avg()[g], count));
    out.push_back(slice_of("exp_avg_sq/" + group, numel, offset, optimizer.exp_avg_sq()[g], count));
  }
  if (buffers) add_buffers(model, out);
  return out;
}

std::vector<ckpt::Slice> model_slices(Qwen3Model& model) {
  std::vector<ckpt::Slice> out;
  const int64_t L = model.config().num_hidden_layers;
  auto& full = model.flat_params();
  for (int g = 0; g < static_cast<int>(full.size()); ++g)
    out.push_back(slice_of("model/" + group_name(L, g), full[g].numel(), 0, full[g], full[g].numel()));
  add_buffers(model, out);
  return out;
}

nlohmann::json training_metadata(const Qwen3Model& model, const TrainConfig& cfg, const AdamW& optimizer,
                                 const nlohmann::json& loader_state, const dist::DataParallelPlan& dp,
                                 int64_t global_batch_size) {
  const AdamWConfig& oc = optimizer.config();
  return {
      {"model_config", model.config().to_hf_json()},
      {"optimizer",
       {{"name", "AdamW"},
        {"step", optimizer.step_count()},
        {"lr", oc.lr},
        {"beta1", oc.beta1},
        {"beta2", oc.beta2},
        {"eps", oc.eps},
        {"weight_decay", oc.weight_decay}}},
      {"lr_scheduler",
       {{"warmup_steps", cfg.lr_scheduler.warmup_steps},
        {"decay_ratio", cfg.lr_scheduler.decay_ratio},
        {"decay_type", cfg.lr_scheduler.decay_type},
        {"min_lr_factor", cfg.lr_scheduler.min_lr_factor},
        {"total_steps", cfg.training.steps}}},
      {"data_loader", loader_state},
      {"training",
       {{"global_batch_size", global_batch_size},
        {"local_batch_size", cfg.training.local_batch_size},
        {"seq_len", cfg.training.seq_len},
        {"mixed_precision_param", cfg.training.mixed_precision_param}}},
      {"parallelism",
       {{"mode", dp.mode()},
        {"replicate_degree", dp.replicate_degree()},
        {"shard_degree", dp.shard_degree()}}},
      // Training draws no random numbers after initialisation (no dropout; shuffling is a function of the
      // seed and the data position), so the seed is the whole random state.
      {"rng", {{"seed", cfg.training.seed}}},
  };
}

void check_same_model(const ckpt::Reader& reader, const Qwen3Config& config) {
  const nlohmann::json saved = reader.meta().value("model_config", nlohmann::json());
  const nlohmann::json mine = config.to_hf_json();
  TITAN_CHECK(saved.is_object(), "checkpoint ", reader.dir(), ": metadata.json has no 'model_config'");
  for (auto& [key, value] : mine.items()) {
    const nlohmann::json other = saved.contains(key) ? saved[key] : nlohmann::json();
    TITAN_CHECK(other == value, "checkpoint ", reader.dir(), " is of another model: field '", key, "' is ",
                saved.contains(key) ? other.dump() : "missing", " in the checkpoint, ", value.dump(),
                " in this run");
  }
}

void check_resumable(const ckpt::Reader& reader, const Qwen3Config& config, const TrainConfig& cfg,
                     int64_t global_batch_size) {
  check_same_model(reader, config);
  const nlohmann::json& meta = reader.meta();
  TITAN_CHECK(meta.contains("optimizer") && meta.contains("data_loader") && meta.contains("training"),
              "checkpoint ", reader.dir(),
              ": metadata.json lacks the optimizer / data-loader / training fields");
  const nlohmann::json& t = meta["training"];
  const int64_t saved_gbs = t.at("global_batch_size"), saved_seq = t.at("seq_len");
  TITAN_CHECK(saved_seq == cfg.training.seq_len, "checkpoint ", reader.dir(), ": training.seq_len is ",
              saved_seq, " in the checkpoint, ", cfg.training.seq_len,
              " in this run (resuming needs the same sequence length)");
  TITAN_CHECK(saved_gbs == global_batch_size, "checkpoint ", reader.dir(),
              " cannot be resharded onto this run: ", "it was trained with training.global_batch_size ",
              saved_gbs, " (", meta.value("world_size", 0), " rank(s)); this run's global batch is ",
              global_batch_size,
              ". Resuming needs the same global batch: set training.global_batch_size = ", saved_gbs,
              " with a local batch and a world size that divide it");
  TITAN_CHECK(reader.step() <= cfg.training.steps, "checkpoint ", reader.dir(), " is at step ", reader.step(),
              ", past training.steps = ", cfg.training.steps);
}

std::string save_model_checkpoint(Qwen3Model& model, const std::string& folder, int64_t step) {
  dist::SingleProcessGroup pg;
  std::vector<ckpt::Slice> slices = model_slices(model);
  // A fresh optimizer: zero moments (AdamW state before its first step).
  std::vector<Tensor> zeros;
  const int64_t L = model.config().num_hidden_layers;
  for (int g = 0; g < static_cast<int>(model.flat_params().size()); ++g) {
    const int64_t n = model.flat_params()[g].numel();
    zeros.push_back(Tensor::zeros({n}));
    slices.push_back(ckpt::Slice{"exp_avg/" + group_name(L, g), n, 0, zeros.back()});
    slices.push_back(ckpt::Slice{"exp_avg_sq/" + group_name(L, g), n, 0, zeros.back()});
  }
  ckpt::SaveRequest req;
  req.folder = folder;
  req.step = step;
  req.meta = {{"model_config", model.config().to_hf_json()}};
  req.slices = std::move(slices);
  return ckpt::save(pg, req);
}

void load_model_from_checkpoint(Qwen3Model& model, const std::string& dir, bool log) {
  ckpt::Reader reader(dir);
  check_same_model(reader, model.config());
  std::vector<ckpt::Slice> wanted = model_slices(model);
  reader.read(wanted, log);
}

}  // namespace titan
