#include "train/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>

#include "checkpoint/checkpoint.h"
#include "core/error.h"
#include "data/loader.h"
#include "device/device.h"
#include "dist/data_parallel_plan.h"
#include "dist/expert_parallel.h"
#include "dist/runtime.h"
#include "generate/generator.h"
#include "kernels/registry.h"
#include "models/qwen3/model.h"
#include "optim/optimizer.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/trainer.h"
#include "train/checkpointing.h"
#include "train/metrics.h"
#include "train/plan.h"
#include "train/plan_streamer.h"

namespace titan {

namespace fs = std::filesystem;

namespace {

constexpr const char* kFortuneDir = "/usr/share/games/fortunes";

// Expands the "fortunes" shorthand; other sources pass through unchanged.
std::vector<std::string> resolve_sources(const std::vector<std::string>& sources) {
  std::vector<std::string> out;
  for (auto& s : sources) {
    if (s == "fortunes") {
      auto files = fortune_files();
      TITAN_CHECK(!files.empty(), "training.dataset = \"fortunes\": no fortune files in ", kFortuneDir,
                  " (install the Debian packages fortunes and fortunes-min: scripts/setup.sh does)");
      out.insert(out.end(), files.begin(), files.end());
    } else {
      TITAN_CHECK(fs::exists(s), "training.dataset: '", s, "' does not exist");
      out.push_back(s);
    }
  }
  return out;
}

}  // namespace

Qwen3Config resolve_model_config(const TrainConfig& cfg) {
  Qwen3Config c;
  const std::string hf_config = cfg.model.hf_assets_path + "/config.json";
  if (!cfg.model.hf_assets_path.empty() && fs::exists(hf_config)) {
    c = Qwen3Config::from_hf_file(hf_config);
  } else {
    if (!cfg.model.hf_assets_path.empty())
      std::printf("note: %s not present; planning with flavor '%s'\n", hf_config.c_str(),
                  cfg.model.flavor.c_str());
    c = Qwen3Config::flavor(cfg.model.flavor);
  }
  if (cfg.model.vocab_size > 0) c.vocab_size = cfg.model.vocab_size;
  if (cfg.model.moe_aux_loss != "auto") c.output_router_logits = cfg.model.moe_aux_loss == "on";
  if (cfg.model.load_balance_coeff >= 0) c.load_balance_coeff = cfg.model.load_balance_coeff;
  c.validate("model");
  return c;
}

namespace {

bool is_text_dataset(const TrainConfig& cfg, const std::vector<std::string>& sources) {
  if (cfg.training.dataset_format == "tokens") return false;
  if (cfg.training.dataset_format != "auto") return true;
  for (auto& s : sources)
    if (!(fs::is_directory(s) && fs::exists(fs::path(s) / "index.json")) &&
        fs::path(s).filename() != "index.json")
      return true;
  return false;
}

// The tokenizer for text data: model.tokenizer_path, else hf_assets_path, else one trained by our BPE
// trainer on the training corpus (cached in the dump folder) with the model's vocabulary size.
std::string resolve_tokenizer(const TrainConfig& cfg, const std::vector<std::string>& sources,
                              int64_t vocab) {
  if (!cfg.model.tokenizer_path.empty()) return cfg.model.tokenizer_path;
  if (!cfg.model.hf_assets_path.empty() && fs::exists(fs::path(cfg.model.hf_assets_path) / "tokenizer.json"))
    return cfg.model.hf_assets_path;
  const fs::path dir = fs::path(cfg.job.dump_folder) / "tokenizer";
  const fs::path path = dir / "tokenizer.json";
  if (fs::exists(path)) {
    Tokenizer t = Tokenizer::load(path.string());
    if (t.vocab_size() == vocab) return path.string();
  }
  std::printf("training a %lld-token byte-level BPE tokenizer on the corpus (%zu files)...\n",
              (long long)vocab, sources.size());
  std::fflush(stdout);
  std::vector<std::string> files;
  for (auto& s : sources) {
    if (fs::is_directory(s)) {
      for (auto& e : fs::recursive_directory_iterator(s))
        if (e.is_regular_file()) files.push_back(e.path().string());
    } else {
      files.push_back(s);
    }
  }
  std::sort(files.begin(), files.end());
  const std::string json = train_bpe(files, static_cast<int>(vocab), {"<|endoftext|>"});
  fs::create_directories(dir);
  const std::string tmp = path.string() + ".tmp";
  std::ofstream(tmp) << json;
  fs::rename(tmp, path);
  return path.string();
}

// Samples `n` tokens after `prompt` (temperature 0.8, top-k 40, seeded) with the KV-cache generator; the
// prompt keeps its last max_context - n tokens when prompt + sample would exceed max_context positions.
std::vector<int32_t> sample_tokens(Qwen3Model& model, std::vector<int32_t> ids, int64_t n,
                                   int64_t max_context, uint64_t seed) {
  const int64_t ctx = std::min<int64_t>(max_context, model.config().max_position_embeddings);
  const int64_t keep = std::max<int64_t>(ctx - n, 1);
  if (static_cast<int64_t>(ids.size()) > keep) ids.erase(ids.begin(), ids.end() - keep);
  KVCacheModel kv(model, static_cast<int64_t>(ids.size()) + n);
  GenerateOptions go;
  go.max_new_tokens = n;
  go.sampling = SamplingOptions{true, 0.8, 40, 1.0, seed};
  return generate(kv, ids, go);
}

// Every [kernels] entry names a registered op and one of its implementations.
void validate_kernel_choice(const std::map<std::string, std::string>& kernels) {
  for (auto& [op, impl] : kernels) {
    auto ops = KernelRegistry::global().ops();
    std::string valid_ops;
    for (auto& o : ops) valid_ops += (valid_ops.empty() ? "" : ", ") + o;
    TITAN_CHECK(std::find(ops.begin(), ops.end(), op) != ops.end(), "kernels.", op,
                ": unknown op (valid: ", valid_ops, ")");
    auto impls = KernelRegistry::global().impls(op, DeviceType::CPU);
    std::string valid;
    for (auto& i : impls) valid += (valid.empty() ? "" : ", ") + i;
    TITAN_CHECK(std::find(impls.begin(), impls.end(), impl) != impls.end(), "kernels.", op, " = '", impl,
                "': no such implementation (valid: ", valid, ")");
  }
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

std::vector<std::string> fortune_files() {
  std::vector<std::string> files;
  if (!fs::is_directory(kFortuneDir)) return files;
  for (auto& e : fs::directory_iterator(kFortuneDir)) {
    // Text files have no extension; *.dat are strfile indexes, *.u8 links to the same text.
    if (!e.is_regular_file() || e.path().has_extension()) continue;
    files.push_back(e.path().string());
  }
  std::sort(files.begin(), files.end());
  return files;
}

TrainResult run_training(const TrainConfig& cfg) {
  cfg.validate();
  TrainResult result;
  dist::ProcessGroup& pg = dist::init();
  const int64_t world = pg.size(), rank = pg.rank();
  const bool lead = rank == 0;  // rank 0 prints and writes the artifacts
  const int64_t dp_shard = cfg.parallelism.data_parallel_shard_degree > 0
                               ? cfg.parallelism.data_parallel_shard_degree
                               : world / cfg.parallelism.data_parallel_replicate_degree;
  Qwen3Config mc = resolve_model_config(cfg);
  const RunPlan plan =
      make_plan(mc, world, cfg.parallelism.data_parallel_replicate_degree, dp_shard,
                cfg.training.local_batch_size, cfg.training.global_batch_size, cfg.training.seq_len,
                cfg.activation_checkpoint.mode, cfg.parallelism.expert_parallel_degree);
  if (cfg.job.print_config && lead) std::printf("# titan train: resolved config\n%s", cfg.to_toml().c_str());
  if (lead) std::printf("# plan\n%s\n", plan.describe().c_str());
  if (cfg.dry_run) {
    // Validate everything that can be checked without allocating the model.
    validate_kernel_choice(cfg.kernels);
    if (!cfg.checkpoint.initial_load_path.empty() && !fs::exists(cfg.checkpoint.initial_load_path))
      std::printf("note: checkpoint.initial_load_path '%s' is not present here; a real run needs it\n",
                  cfg.checkpoint.initial_load_path.c_str());
    std::printf("dry run: config valid, nothing allocated\n");
    result.dry_run = true;
    return result;
  }

  if (lead) {
    fs::create_directories(cfg.job.dump_folder);
    std::ofstream f(fs::path(cfg.job.dump_folder) / "config.toml");
    f << cfg.to_toml();
  }
  // Data.
  const std::vector<std::string> sources = resolve_sources(cfg.training.dataset);
  data::DataConfig dc;
  dc.sources = sources;
  dc.format = data::parse_data_format(cfg.training.dataset_format);
  dc.delimiter = data::parse_doc_delimiter(cfg.training.dataset_delimiter);
  dc.text_field = cfg.training.text_field;
  dc.seq_len = cfg.training.seq_len;
  dc.batch_size = cfg.training.local_batch_size;
  dc.seed = cfg.training.seed;
  dc.dp_rank = static_cast<int>(rank);
  dc.dp_world = static_cast<int>(world);
  dc.val_fraction = cfg.training.val_fraction;
  std::string tokenizer_path;
  if (is_text_dataset(cfg, sources)) {
    // Rank 0 trains the tokenizer when one is needed; the others wait and load it.
    if (lead) tokenizer_path = resolve_tokenizer(cfg, sources, mc.vocab_size);
    pg.barrier();
    if (!lead) tokenizer_path = resolve_tokenizer(cfg, sources, mc.vocab_size);
    dc.tokenizer = tokenizer_path;
  }
  data::DataLoader loader(dc);
  TITAN_CHECK(loader.vocab_size() <= mc.vocab_size, "the data's vocabulary (", loader.vocab_size(),
              " ids) does not fit the model's vocab_size (", mc.vocab_size, ")");

  // Model.
  validate_kernel_choice(cfg.kernels);
  // Expert parallel: groups of expert_parallel_degree consecutive ranks split every sparse layer's experts.
  const std::shared_ptr<dist::ProcessGroup> ep_group =
      dist::make_expert_group(pg, static_cast<int>(plan.expert_parallel));
  Qwen3Model model(mc, cfg.kernels, ep_group.get());
  model.init_weights(cfg.training.seed);
  model.set_activation_checkpointing(cfg.activation_checkpoint.mode == "full");
  // Checkpoints: with checkpoint.enable, the newest complete one in <dump>/<folder> is resumed (rank 0
  // picks it so that every rank reads the same); otherwise checkpoint.initial_load_path gives the
  // initial weights (HF directory, or a titan checkpoint with initial_load_in_hf = false).
  const std::string ckpt_folder = (fs::path(cfg.job.dump_folder) / cfg.checkpoint.folder).string();
  std::string resume_dir;
  if (cfg.checkpoint.enable) {
    int64_t found = -1;
    if (lead) {
      const std::string dir = ckpt::latest(ckpt_folder, true);
      if (!dir.empty()) found = ckpt::Reader(dir).step();
    }
    pg.broadcast(&found, 1, dist::CommType::I64, 0);
    if (found >= 0) resume_dir = (fs::path(ckpt_folder) / ("step-" + std::to_string(found))).string();
  }
  std::optional<ckpt::Reader> resume;  // set when the checkpoint holds training state
  if (!resume_dir.empty()) {
    ckpt::Reader reader(resume_dir);
    if (has_training_state(reader)) {
      resume.emplace(std::move(reader));
    } else {
      if (lead)
        std::printf("checkpoint: initial weights from the model-only checkpoint %s\n", resume_dir.c_str());
      load_model_from_checkpoint(model, resume_dir, lead);
    }
  } else if (!cfg.checkpoint.initial_load_path.empty()) {
    if (cfg.checkpoint.initial_load_in_hf) {
      if (lead) std::printf("loading HF weights from %s\n", cfg.checkpoint.initial_load_path.c_str());
      model.load_hf(cfg.checkpoint.initial_load_path);
    } else {
      if (lead)
        std::printf("loading model weights from checkpoint %s\n", cfg.checkpoint.initial_load_path.c_str());
      load_model_from_checkpoint(model, cfg.checkpoint.initial_load_path, lead);
    }
  }
  const bool bf16 = cfg.training.mixed_precision_param == "bfloat16";
  // bf16 compute with f32 master weights: AdamW steps the master copy, the model computes with its
  // bf16-rounded image (refreshed after every step).
  // FSDP/HSDP stream the parameters (ZeRO-3): every rank keeps 1/S of the parameters, gradients and
  // optimizer state; a layer group is gathered just before its forward/backward and freed after.
  const bool stream = plan.dp_shard > 1;
  std::vector<Tensor> master;
  if (bf16 && !stream) {
    for (auto& p : model.flat_params()) master.push_back(p.clone());
    model.set_bf16_compute(true);
    if (lead)
      std::printf(
          "mixed precision: bf16 compute (bf16 GEMM operands, f32 accumulation), f32 master weights\n");
  }
  // Data parallelism (DDP / FSDP / HSDP from the replicate x shard degrees); with one rank a no-op.
  dist::DataParallelPlan dp(pg, static_cast<int>(plan.dp_replicate), static_cast<int>(plan.dp_shard),
                            master.empty() ? model.flat_params() : master, model.flat_grads(),
                            int64_t(25) << 20, stream,
                            dist::ExpertParallelLayout{ep_group, model.expert_offsets()});
  PlanStreamer streamer(dp);
  if (stream) {
    model.set_param_streamer(&streamer);  // drops the full buffers; the shards are f32 master weights
    if (bf16) {
      model.set_bf16_compute(true);  // gathered groups are rounded to bf16
      if (lead) std::printf("mixed precision: bf16 compute, f32 master weights in the FSDP shards\n");
    }
  }
  if (lead) {  // after the mixed-precision switch, which picks the bf16 engines
    std::printf("kernels:");
    for (auto& [op, impl] : model.kernel_names()) std::printf(" %s=%s", op.c_str(), impl.c_str());
    std::printf("\n");
  }
  // bf16 with full buffers: the model computes with the bf16-rounded image of the f32 master weights.
  auto refresh_bf16_model = [&] {
    if (master.empty()) return;
    for (size_t i = 0; i < master.size(); ++i) model.flat_params()[i].copy_from(master[i]);
    model.set_bf16_compute(true);
  };
  dp.broadcast_from(0);
  refresh_bf16_model();
  if (lead && world > 1) std::printf("data parallel: %s\n", dp.describe().c_str());
  AdamW optimizer(dp.optimizer_params(), dp.optimizer_grads(),
                  AdamWConfig{(float)cfg.optimizer.lr, (float)cfg.optimizer.beta1, (float)cfg.optimizer.beta2,
                              (float)cfg.optimizer.eps, (float)cfg.optimizer.weight_decay},
                  cfg.optimizer.implementation);
  {
    // Persistent training state on this rank (FSDP/HSDP: shards only, ~16/S bytes per parameter).
    int64_t param_bytes = 0, grad_bytes = 0;
    for (auto& t : model.flat_params()) param_bytes += t.defined() ? t.nbytes() : 0;
    for (auto& t : model.flat_grads()) grad_bytes += t.defined() ? t.nbytes() : 0;
    for (auto& t : master) param_bytes += t.nbytes();
    if (stream || dp.shard_degree() > 1) {
      for (auto& t : dp.optimizer_params()) param_bytes += t.nbytes();
      for (auto& t : dp.optimizer_grads()) grad_bytes += t.nbytes();
    }
    const int64_t opt_bytes = optimizer.state_bytes();
    if (lead)
      std::printf(
          "state per rank: parameters %.2f MiB, gradients %.2f MiB, optimizer %.2f MiB (%.2f "
          "bytes/parameter)\n",
          param_bytes / 1048576.0, grad_bytes / 1048576.0, opt_bytes / 1048576.0,
          double(param_bytes + grad_bytes + opt_bytes) / double(model.num_params()));
  }
  LRSchedule schedule(LRScheduleConfig{cfg.lr_scheduler.warmup_steps, cfg.lr_scheduler.decay_ratio,
                                       cfg.lr_scheduler.decay_type, cfg.lr_scheduler.min_lr_factor},
                      cfg.training.steps);
  int64_t first_step = 1;
  if (resume) {
    // Everything is validated before any state is replaced; each rank reads its own slices (any
    // world size: the layout is the model's flat groups, not the writer's sharding).
    const ckpt::Reader& reader = *resume;
    check_resumable(reader, mc, cfg, plan.global_batch);
    if (lead)
      std::printf("checkpoint: resuming from %s (step %lld)\n", resume_dir.c_str(), (long long)reader.step());
    std::vector<ckpt::Slice> wanted = training_slices(model, dp, optimizer, /*for_save=*/false);
    reader.read(wanted, lead);
    optimizer.set_step_count(reader.meta()["optimizer"].at("step").get<int64_t>());
    dp.after_optimizer_step();  // FSDP/HSDP: the loaded shards into the full parameter buffers
    refresh_bf16_model();
    loader.load_state(reader.meta()["data_loader"]);
    first_step = reader.step() + 1;
  }
  result.first_step = first_step;
  // Saves a training checkpoint after `step` (collective); the final one also carries the HF export.
  auto save_checkpoint = [&](int64_t step, const std::function<void(const std::string&)>& hf_export) {
    ckpt::SaveRequest req;
    req.folder = ckpt_folder;
    req.step = step;
    req.slices = training_slices(model, dp, optimizer, /*for_save=*/true);
    if (lead) req.meta = training_metadata(model, cfg, optimizer, loader.state(), dp, plan.global_batch);
    if (lead) req.extra_files = hf_export;
    const std::string dir = ckpt::save(pg, req);
    if (lead) ckpt::prune(ckpt_folder, cfg.checkpoint.keep_latest_k);
    return dir;
  };
  double peak_tflops = cfg.metrics.peak_tflops;
  if (peak_tflops > 0) {
    if (lead) std::printf("MFU peak: %.3f TFLOP/s (metrics.peak_tflops)\n", peak_tflops);
  } else {
    peak_tflops = measure_gemm_tflops(model.matmul_kernels());
    if (lead)
      std::printf(
          "MFU peak: %.3f TFLOP/s (measured rate of the model's GEMM engine, matmul=%s, %d threads)\n",
          peak_tflops, model.kernel_names()["matmul"].c_str(),
          device_interface(DeviceType::CPU).num_threads());
  }
  MetricsLogger metrics(
      cfg.metrics.enable_jsonl && lead ? (fs::path(cfg.job.dump_folder) / "metrics.jsonl").string() : "",
      cfg.training.steps, cfg.metrics.progress_bar && world == 1, lead, first_step - 1);
  const auto& mem = device_interface(DeviceType::CPU).allocator->stats;
  const double phys_gib = physical_memory_bytes() / double(int64_t(1) << 30);

  data::Batch batch;
  const int64_t tokens_per_micro = cfg.training.local_batch_size * cfg.training.seq_len;
  // HF export (rank 0): config.json + safetensors (+ tokenizer.json) into `dir`.
  Qwen3Model* export_model = &model;  // expert parallel: a full model gathered on rank 0 at the end
  std::unique_ptr<Qwen3Model> gathered;
  bool finished_model = false;
  // After the last step (collective): streamed parameters back into full buffers; under expert
  // parallel every expert gathered into a full model on rank 0 (HF export, sample).
  auto finish_model = [&] {
    if (finished_model) return;
    finished_model = true;
    if (model.param_streamer()) model.set_param_streamer(nullptr);
    if (ep_group && (cfg.checkpoint.last_save_in_hf || cfg.training.sample_tokens > 0)) {
      NamedTensors all = model.gathered_state_dict();  // collective over the expert group
      if (lead) {
        gathered = std::make_unique<Qwen3Model>(mc, cfg.kernels);
        gathered->load_state_dict(all);
        gathered->expert_bias().copy_from(model.expert_bias());
        export_model = gathered.get();
      }
    }
  };
  const std::function<void(const std::string&)> export_hf = [&](const std::string& dir) {
    export_model->save_hf(dir, cfg.checkpoint.export_dtype == "bfloat16" ? DType::BF16 : DType::F32);
    if (!tokenizer_path.empty()) {
      fs::path tok = fs::is_directory(tokenizer_path) ? fs::path(tokenizer_path) / "tokenizer.json"
                                                      : fs::path(tokenizer_path);
      fs::copy_file(tok, fs::path(dir) / "tokenizer.json", fs::copy_options::overwrite_existing);
    }
  };
  const fs::path final_dir = fs::path(ckpt_folder) / ("step-" + std::to_string(cfg.training.steps));
  for (int64_t step = first_step; step <= cfg.training.steps; ++step) {
    const double t0 = now_s();
    model.zero_grad();
    double loss_sum = 0, aux_sum = 0;
    int64_t valid = 0;
    for (int64_t micro = 0; micro < plan.grad_accum; ++micro) {
      TITAN_CHECK(loader.next_batch(batch), "the dataset ran out of data at step ", step);
      ForwardOptions fo;
      // Mean over every target of the accumulation window (HF num_items_in_batch semantics).
      fo.grad_scale = 1.0f / static_cast<float>(tokens_per_micro * plan.grad_accum);
      fo.labels_shifted = true;  // the loader's labels are the next tokens (torchtitan packing)
      // MoE aux loss: its coefficient split over the micro-batches (each contributes its own aux).
      fo.aux_loss_scale =
          mc.output_router_logits ? static_cast<float>(mc.router_aux_loss_coef / plan.grad_accum) : 0.0f;
      ForwardResult r =
          model.forward(batch.input_ids.data(), batch.labels.data(), batch.batch_size, batch.seq_len, fo);
      model.backward();
      loss_sum += r.loss_sum;
      valid += r.num_valid;
      aux_sum += r.aux_loss;
    }
    // Packed windows have no ignored targets (every position has its next token), so every rank's
    // window mean above is the plain mean and
    // the data-parallel average of the gradients is the gradient of the global mean.
    double totals[3] = {loss_sum, static_cast<double>(valid), aux_sum};
    if (world > 1) pg.all_reduce(totals, 3, dist::ReduceOp::Sum);
    double loss = totals[1] > 0 ? totals[0] / totals[1] : std::nan("");
    // HF MoE loss: CE + router_aux_loss_coef x aux (aux averaged over micro-batches and ranks).
    if (mc.num_experts > 0 && mc.output_router_logits)
      loss += mc.router_aux_loss_coef * totals[2] / static_cast<double>(plan.grad_accum * world);
    if (!std::isfinite(loss)) {
      TITAN_CHECK(cfg.training.skip_nan_inf, "loss is ", loss, " at step ", step,
                  " (set training.skip_nan_inf = true to skip such steps)");
      if (lead)
        std::printf("step %lld: loss is %f, step skipped (training.skip_nan_inf)\n", (long long)step, loss);
      result.losses.push_back(loss);
      continue;
    }
    dp.reduce_grads();
    if (mc.num_experts > 0 && mc.load_balance_coeff > 0) {
      // Aux-loss-free balancing: global routed-token counts, then the expert-bias update.
      if (world > 1) pg.all_reduce(model.expert_token_counts(), dist::ReduceOp::Sum);
      model.update_expert_bias();
    }
    // Clipping (torch's clip_grad_norm_) is applied inside the optimizer step: one pass fewer over the
    // gradients.
    const double grad_norm = dp.grad_norm();
    const double lr = cfg.optimizer.lr * schedule.factor(step - 1);
    optimizer.step(static_cast<float>(lr), clip_coefficient(grad_norm, cfg.training.max_norm));
    dp.after_optimizer_step();
    refresh_bf16_model();
    const double dt = now_s() - t0;
    result.losses.push_back(loss);
    if (step % cfg.metrics.log_freq == 0 || step == cfg.training.steps) {
      StepMetrics m;
      m.step = step;
      m.loss = loss;
      m.grad_norm = grad_norm;
      m.lr = lr;
      m.tokens = tokens_per_micro * plan.grad_accum;
      m.tps = m.tokens / dt;
      m.tflops = plan.flops_per_token * m.tps / 1e12;
      m.mfu = 100.0 * m.tflops / peak_tflops;
      m.mem_gib = mem.peak.load() / double(int64_t(1) << 30);
      m.mem_pct = 100.0 * m.mem_gib / phys_gib;
      m.time_s = dt;
      metrics.log(m);
    }
    if (step == cfg.training.steps) finish_model();
    if (cfg.checkpoint.enable && (step % cfg.checkpoint.interval == 0 || step == cfg.training.steps)) {
      const bool final_export = step == cfg.training.steps && cfg.checkpoint.last_save_in_hf;
      result.checkpoint_dir = save_checkpoint(step, final_export ? export_hf : nullptr);
      if (final_export) result.export_dir = result.checkpoint_dir;
    }
  }
  metrics.finish();
  finish_model();
  // Artifacts (rank 0): HF checkpoint (+ tokenizer), loss curve, sample.
  if (!lead) return result;
  if (cfg.checkpoint.last_save_in_hf && !cfg.checkpoint.enable) {
    ckpt::publish_directory(final_dir.string(), export_hf);
    result.export_dir = final_dir.string();
  }
  if (!result.export_dir.empty()) std::printf("saved HF checkpoint: %s\n", result.export_dir.c_str());
  const std::string svg = (fs::path(cfg.job.dump_folder) / "loss.svg").string();
  write_loss_svg(svg, result.losses,
                 "titan train: " + mc.to_hf_json().value("model_type", "qwen3") + " loss");
  std::printf("loss curve: %s\n", svg.c_str());
  if (cfg.training.sample_tokens > 0 && !tokenizer_path.empty()) {
    Tokenizer tok = Tokenizer::load(tokenizer_path);
    std::vector<int32_t> prompt = tok.encode(cfg.training.sample_prompt);
    if (prompt.empty()) prompt.push_back(loader.eos_id() >= 0 ? loader.eos_id() : 0);
    if (bf16) export_model->set_bf16_compute(true);
    auto ids = sample_tokens(*export_model, prompt, cfg.training.sample_tokens, cfg.training.seq_len,
                             cfg.training.seed);
    result.sample = cfg.training.sample_prompt + tok.decode(ids, true);
    std::ofstream(fs::path(cfg.job.dump_folder) / "sample.txt") << result.sample << "\n";
    std::printf("sample:\n%s\n", result.sample.c_str());
  }
  return result;
}

}  // namespace titan
