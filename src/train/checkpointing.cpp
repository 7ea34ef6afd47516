#include "train/checkpointing.h"

#include <algorithm>
#include <array>
#include <functional>
#include <map>

#include "core/error.h"
#include "distributed/process_group.h"
#include "distributed/tensor_parallel.h"

namespace titan {

std::string group_name(int64_t num_layers, int g) {
  if (g == 0) return "embed";
  if (g <= num_layers) return "layers." + std::to_string(g - 1);
  return "final";
}

namespace {

void add_buffers(Qwen3Model& model, std::vector<ckpt::Slice>& out) {
  for (auto& [name, t] : model.buffers()) out.push_back(ckpt::Slice{"buffer/" + name, t.numel(), 0, t});
}

// Where this rank's buffer of group g sits in the group's global layout (every expert): pieces of
// (offset in the local buffer, offset in the global group, count). Without expert parallel one piece;
// with it, the non-expert part, then this rank's experts' gate/up rows ([E, 2I, H] globally) and their
// down projections ([E, H, I]).
struct Piece {
  int64_t local, global, count;
  bool expert;
};
std::vector<Piece> group_pieces(const Qwen3Model& model, int g, const std::vector<int64_t>& expert_offsets,
                                int64_t* global_numel) {
  const int64_t numel = model.group_numel(g), eo = expert_offsets[g];
  if (model.expert_parallel_degree() == 1 || eo >= numel) {
    *global_numel = numel;
    return {{0, 0, numel, false}};
  }
  const auto& c = model.config();
  const int64_t E = c.num_experts, El = model.local_experts(), first = model.first_expert();
  const int64_t gu = 2 * c.moe_intermediate_size * c.hidden_size,
                dn = c.hidden_size * c.moe_intermediate_size;
  *global_numel = eo + E * (gu + dn);
  return {{0, 0, eo, false},
          {eo, eo + first * gu, El * gu, true},
          {eo + El * gu, eo + E * gu + first * dn, El * dn, true}};
}

}  // namespace

void tensor_parallel_slices(const std::vector<Param>& local, const std::vector<Param>& full,
                            const std::function<std::array<std::string, 3>(int group)>& group_keys,
                            const std::function<int64_t(int group)>& full_numel, dist::DataParallelPlan& dp,
                            AdamW& optimizer, bool for_save, const dist::TensorParallel& tp,
                            std::vector<ckpt::Slice>& out) {
  std::map<std::string, const Param*> full_params;
  for (const Param& p : full) full_params[p.name] = &p;
  for (const Param& p : local) {
    const Param& f = *full_params.at(p.name);
    const bool replicated = dist::tensor_parallel_split(p.name) == dist::TpSplit::Replicated;
    const bool expert = p.name.find(".mlp.experts.") != std::string::npos;  // (expert parallel: this rank's)
    const bool one_per_group = replicated && !(expert && tp.experts_over_group());
    if (for_save &&
        (!(expert ? dp.saves_expert_state() : dp.saves_state()) || (one_per_group && tp.rank() != 0)))
      continue;
    const std::array<std::string, 3> keys = group_keys(p.group);
    const int64_t numel = full_numel(p.group);
    // The optimizer's buffer of this group holds local elements [first, first + held) (FSDP: a shard).
    const int64_t first = dp.optimizer_offset(p.group), held = dp.optimizer_count(p.group);
    for (const dist::TensorParallel::Run& r : tp.runs(p.name, f.shape)) {
      const int64_t lo = std::max(p.offset + r.local, first);
      const int64_t hi = std::min(p.offset + r.local + r.count, first + held);
      if (hi <= lo) continue;
      const int64_t global = f.offset + r.global + (lo - p.offset - r.local), at = lo - first, n = hi - lo;
      out.push_back({keys[0], numel, global, dp.optimizer_params()[p.group].view_at(at, {n})});
      out.push_back({keys[1], numel, global, optimizer.exp_avg()[p.group].view_at(at, {n})});
      out.push_back({keys[2], numel, global, optimizer.exp_avg_sq()[p.group].view_at(at, {n})});
    }
  }
}

namespace {

// Tensor parallel: every parameter of the local model placed in the full model's groups (the full layout
// is that of a model of full_config, built without buffers).
std::vector<ckpt::Slice> tensor_parallel_slices(Qwen3Model& model, dist::DataParallelPlan& dp,
                                                AdamW& optimizer, bool for_save,
                                                const dist::TensorParallel& tp,
                                                const Qwen3Config& full_config) {
  std::vector<ckpt::Slice> out;
  const Qwen3Model full(full_config, {}, nullptr, /*allocate=*/false);
  const int64_t L = full_config.num_hidden_layers;
  std::vector<Param> local;  // (pipeline parallel: a tied embedding's copy on the last stage is not saved)
  for (const Param& p : model.params())
    if (!(for_save && p.group == 0 && model.holds_embedding_copy())) local.push_back(p);
  tensor_parallel_slices(
      local, full.params(),
      [L](int g) {
        const std::string group = group_name(L, g);
        return std::array<std::string, 3>{"model/" + group, "exp_avg/" + group, "exp_avg_sq/" + group};
      },
      [&full](int g) { return full.group_numel(g); }, dp, optimizer, for_save, tp, out);
  if (!for_save || (dp.world_rank() == 0 && tp.rank() == 0)) add_buffers(model, out);
  return out;
}

}  // namespace

std::vector<ckpt::Slice> training_slices(Qwen3Model& model, dist::DataParallelPlan& dp, AdamW& optimizer,
                                         bool for_save, const dist::TensorParallel* tp,
                                         const Qwen3Config* full_config) {
  if (tp && tp->size() > 1) return tensor_parallel_slices(model, dp, optimizer, for_save, *tp, *full_config);
  std::vector<ckpt::Slice> out;
  const int64_t L = model.config().num_hidden_layers;
  const std::vector<int64_t> expert_offsets = model.expert_offsets();
  for (int g = 0; g < model.num_groups(); ++g) {
    // Pipeline parallel: the groups of this rank's stages (the tied embedding's copy is read, not written).
    if (!model.holds_group(g) || (for_save && g == 0 && model.holds_embedding_copy())) continue;
    const std::string group = group_name(L, g);
    int64_t numel = 0;
    const std::vector<Piece> pieces = group_pieces(model, g, expert_offsets, &numel);
    auto add = [&](int64_t local, int64_t global, int64_t count) {
      out.push_back({"model/" + group, numel, global, dp.optimizer_params()[g].view_at(local, {count})});
      out.push_back({"exp_avg/" + group, numel, global, optimizer.exp_avg()[g].view_at(local, {count})});
      out.push_back(
          {"exp_avg_sq/" + group, numel, global, optimizer.exp_avg_sq()[g].view_at(local, {count})});
    };
    if (pieces.size() == 1) {
      // Full buffers (single, DDP) or this rank's FSDP/HSDP shard.
      if (!for_save || dp.saves_state()) add(0, dp.optimizer_offset(g), dp.optimizer_count(g));
      continue;
    }
    for (const Piece& p : pieces)  // expert parallel (with DDP: full local buffers)
      if (!for_save || (p.expert ? dp.saves_expert_state() : dp.saves_state()))
        add(p.local, p.global, p.count);
  }
  // Buffers (replicated): written by rank 0, read by every rank.
  if (!for_save || dp.world_rank() == 0) add_buffers(model, out);
  return out;
}

std::vector<ckpt::Slice> model_slices(Qwen3Model& model) {
  std::vector<ckpt::Slice> out;
  const int64_t L = model.config().num_hidden_layers;
  const std::vector<int64_t> expert_offsets = model.expert_offsets();
  auto& full = model.flat_params();
  for (int g = 0; g < model.num_groups(); ++g) {
    if (!model.holds_group(g)) continue;  // (pipeline parallel: another stage's)
    int64_t numel = 0;
    for (const Piece& p : group_pieces(model, g, expert_offsets, &numel))
      out.push_back({"model/" + group_name(L, g), numel, p.global, full[g].view_at(p.local, {p.count})});
  }
  add_buffers(model, out);
  return out;
}

nlohmann::json training_metadata(const Qwen3Config& model_config, const TrainConfig& cfg,
                                 const AdamW& optimizer, const nlohmann::json& loader_state,
                                 const dist::DataParallelPlan& dp, int64_t global_batch_size) {
  const AdamWConfig& oc = optimizer.config();
  return {
      {"model_config", model_config.to_hf_json()},
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

namespace {

// meta[section][key] of a checkpoint, which must be a non-negative integer (integer) or a boolean.
const nlohmann::json& saved_field(const ckpt::Reader& reader, const char* section, const char* key,
                                  bool integer) {
  const nlohmann::json& meta = reader.meta();
  const std::string where = reader.dir() + "/metadata.json";
  TITAN_CHECK(meta.contains(section) && meta[section].is_object(), where, ": field '", section,
              "' is missing or not an object");
  const nlohmann::json& o = meta[section];
  TITAN_CHECK(o.contains(key), where, ": field '", section, ".", key, "' is missing");
  const nlohmann::json& v = o[key];
  TITAN_CHECK(integer ? v.is_number_integer() && v.get<int64_t>() >= 0 : v.is_boolean(), where, ": field '",
              section, ".", key, "' must be ", integer ? "a non-negative integer" : "true or false", ", got ",
              v.dump());
  return v;
}

}  // namespace

Qwen3Config saved_model_config(const ckpt::Reader& reader) {
  const std::string where = reader.dir() + "/metadata.json";
  TITAN_CHECK(reader.meta().contains("model_config") && reader.meta()["model_config"].is_object(), where,
              ": field 'model_config' is missing or not an object");
  Qwen3Config config = Qwen3Config::from_hf_json(reader.meta()["model_config"], where + " (model_config)");
  config.validate(where + " (model_config)");
  return config;
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
  const int64_t saved_gbs = saved_field(reader, "training", "global_batch_size", true).get<int64_t>();
  const int64_t saved_seq = saved_field(reader, "training", "seq_len", true).get<int64_t>();
  (void)saved_field(reader, "optimizer", "step", true);
  TITAN_CHECK(meta["data_loader"].is_object(), "checkpoint ", reader.dir(),
              "/metadata.json: field 'data_loader' must be an object, got ", meta["data_loader"].dump());
  TITAN_CHECK(!meta.contains("lora") || meta["lora"].is_boolean(), "checkpoint ", reader.dir(),
              "/metadata.json: field 'lora' must be true or false, got ", meta["lora"].dump());
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

void load_model_from_checkpoint(Qwen3Model& local, const std::string& dir, bool log,
                                const dist::TensorParallel& tp, const Qwen3Config& full_config) {
  ckpt::Reader reader(dir);
  check_same_model(reader, full_config);
  const Qwen3Model full(full_config, {}, nullptr, /*allocate=*/false);  // the checkpoint's layout
  std::map<std::string, const Param*> full_params;
  for (const Param& p : full.params()) full_params[p.name] = &p;
  const int64_t L = full_config.num_hidden_layers;
  std::vector<ckpt::Slice> wanted;
  for (const Param& p : local.params()) {
    const Param& f = *full_params.at(p.name);
    for (const dist::TensorParallel::Run& r : tp.runs(p.name, f.shape))
      wanted.push_back({"model/" + group_name(L, p.group), full.group_numel(p.group), f.offset + r.global,
                        local.flat_params()[p.group].view_at(p.offset + r.local, {r.count})});
  }
  add_buffers(local, wanted);
  reader.read(wanted, log);
}

}  // namespace titan
