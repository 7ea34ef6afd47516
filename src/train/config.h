// The trainer's configuration: TOML files whose sections follow torchtitan (job, model, optimizer,
// lr_scheduler, training, validation, parallelism, checkpoint, metrics, compile, kernels,
// activation_checkpoint), command-line overrides `--section.key=value`, validation that lists the valid keys,
// and dumping.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "train/plan.h"

namespace titan {

struct JobConfig {
  std::string dump_folder = "./outputs";
  std::string description = "";
  bool print_config = true;
  // Where the model trains: "cpu", "cuda" (each rank on GPU local_rank mod #GPUs of its node), "cuda:N" or
  // "guard" (src/device/guard/: the CPU's kernels behind addresses the host cannot read; a check).
  std::string device = "cpu";
};

struct ModelConfig {
  std::string name = "qwen3";
  std::string flavor = "debug";     // flavor registry name; ignored when hf_assets_path has a config.json
  std::string hf_assets_path = "";  // HF directory: config.json (+ tokenizer.json)
  std::string tokenizer_path = "";  // tokenizer.json or dir; "" = hf_assets_path, or trained (default run)
  int64_t vocab_size = 0;           // > 0: override the flavor's vocabulary (e.g. to the tokenizer's)
  int64_t num_hidden_layers = 0;    // > 0: override the flavor's depth (a released shape cut short)
  // MoE: "on" adds router_aux_loss_coef x HF load-balancing loss to the loss (output_router_logits),
  // "off" does not, "auto" keeps the model config's setting.
  std::string moe_aux_loss = "auto";
  double load_balance_coeff = -1;  // >= 0: torchtitan aux-loss-free balancing coefficient (0 = off)
};

struct OptimizerConfig {
  std::string name = "AdamW";
  double lr = 2e-3;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;
  std::string implementation = "";  // kernel name ("" = default)
};

struct LRSchedulerConfig {
  int64_t warmup_steps = 50;
  double decay_ratio = -1;  // < 0: decay over every step after warmup
  std::string decay_type = "cosine";
  double min_lr_factor = 0.1;
};

struct TrainingConfig {
  std::vector<std::string> dataset = {"fortunes"};  // files/dirs; "fortunes" = the fortune(6) corpus
  std::string dataset_format = "auto";              // auto | text | jsonl | tokens | chat (SFT)
  std::string dataset_delimiter = "percent";        // text: file | percent | blank
  std::string text_field = "text";
  // Chat data: several whole conversations per row, attention and RoPE positions per conversation (TRL's
  // padding-free packing; data/loader.h).
  bool packing = false;
  // Share of the documents held out of training (the validation split when validation.dataset is empty).
  double val_fraction = 0.01;
  int64_t local_batch_size = 8;
  int64_t global_batch_size = -1;  // -1: local_batch_size * data-parallel degree
  int64_t seq_len = 256;
  double max_norm = 1.0;
  int64_t steps = 500;
  uint64_t seed = 42;
  std::string mixed_precision_param = "float32";  // float32 | bfloat16 (bf16 compute, f32 master)
  bool skip_nan_inf = false;                      // skip a step whose loss is NaN/Inf instead of stopping
  int64_t sample_tokens = 48;                     // tokens generated at the end (0: none)
  std::string sample_prompt = "";
};

// Validation (torchtitan [validation]): forward-only mean loss over held-out windows, every `freq` steps
// and after the last step.
struct ValidationConfig {
  bool enable = true;
  std::vector<std::string> dataset;  // sources; empty: the training.val_fraction split of training.dataset
  int64_t freq = 100;                // validate after every freq-th step (and the last)
  int64_t steps = -1;                // batches per rank per validation; -1: the whole set
};

struct ParallelismConfig {
  int64_t data_parallel_replicate_degree = 1;
  int64_t data_parallel_shard_degree = -1;  // -1: whatever is left of the world size
  int64_t expert_parallel_degree = 1;
  // Megatron tensor parallel over groups of this many consecutive ranks (innermost: world = data-parallel
  // degrees x tensor_parallel_degree); distributed/tensor_parallel.h.
  int64_t tensor_parallel_degree = 1;
  bool enable_sequence_parallel = true;  // torchtitan's default: norms and residual stream split by rows
  // Pipeline parallel (torchtitan's keys; distributed/pipeline_layout.h): planned by `titan plan`.
  int64_t pipeline_parallel_degree = 1;
  std::string pipeline_parallel_schedule = "1F1B";  // GPipe | 1F1B | Interleaved1F1B
  int64_t pipeline_parallel_microbatch_size = 1;    // rows of a micro-batch
  int64_t pipeline_parallel_layers_per_stage = 0;   // 0: one stage per rank (two for Interleaved1F1B)
  int64_t pipeline_parallel_first_stage_less_layers = 1;
  int64_t pipeline_parallel_last_stage_less_layers = 1;
  // Context parallel: each sequence split over this many ranks; planned by `titan plan`.
  int64_t context_parallel_degree = 1;
  dist::PipelineOptions pipeline() const {
    return {pipeline_parallel_degree,
            pipeline_parallel_schedule,
            pipeline_parallel_microbatch_size,
            pipeline_parallel_layers_per_stage,
            pipeline_parallel_first_stage_less_layers,
            pipeline_parallel_last_stage_less_layers};
  }
};

struct CheckpointConfig {
  bool enable = false;
  std::string folder = "checkpoint";
  int64_t interval = 500;
  int64_t keep_latest_k = 10;
  std::string initial_load_path = "";
  bool initial_load_in_hf = true;
  bool last_save_in_hf = true;
  std::string export_dtype = "float32";  // float32 | bfloat16
};

struct MetricsConfig {
  int64_t log_freq = 1;
  double peak_tflops = 0;  // > 0: peak for MFU; 0: measure the GEMM rate at start
  bool enable_jsonl = true;
  bool progress_bar = true;  // only when stdout is a terminal
  // TensorBoard event files in <dump_folder>/<save_tb_folder>/<YYYYmmdd-HHMM>/ (torchtitan's keys; lead
  // rank).
  bool enable_tensorboard = false;
  std::string save_tb_folder = "tb";
};

// torchtitan's [compile]. The CPU device's step is already native code with a fixed memory plan: there
// enable = true is accepted and changes nothing (logged once). On the CUDA device it is refused until the
// step is captured into CUDA graphs.
struct CompileConfig {
  bool enable = false;
  std::vector<std::string> components = {"model", "loss"};  // any of model, loss
  std::string backend = "inductor";                         // inductor | aot_eager | eager | cudagraphs
};

// torchtitan's [activation_checkpoint]: mode none | full | selective; selective_ac_option "N" checkpoints
// every N-th layer (layers N-1, 2N-1, ...: each keeps only its input and is recomputed in backward), "op"
// keeps every layer's GEMM and attention outputs and recomputes the pointwise ops.
struct ActivationCheckpointConfig {
  std::string mode = "none";
  std::string selective_ac_option = "2";
  // Layers checkpointed: 0 none, 1 every layer, N every N-th (validated by TrainConfig::validate); under
  // selective_ac_option = "op" none, and the layers recompute their pointwise ops instead.
  int64_t every() const;
  bool recompute_ops() const { return mode == "selective" && selective_ac_option == "op"; }
  CheckpointPolicy policy() const { return {every(), recompute_ops()}; }
};

// LoRA fine-tuning (HF PEFT semantics, models/qwen3/lora.h): the base is frozen, only the adapters train.
struct LoraTrainConfig {
  bool enable = false;
  int64_t rank = 16;
  double alpha = 32;
  double dropout = 0;
  std::vector<std::string> target_modules = {"q_proj",    "k_proj",  "v_proj",   "o_proj",
                                             "gate_proj", "up_proj", "down_proj"};
  std::string base_dtype = "bfloat16";  // frozen base storage: bfloat16 (2 bytes/param) | float32
  std::string adapter_path = "";        // PEFT adapter dir to start from ("" = fresh: A kaiming, B = 0)
};

struct TrainConfig {
  JobConfig job;
  ModelConfig model;
  OptimizerConfig optimizer;
  LRSchedulerConfig lr_scheduler;
  TrainingConfig training;
  ValidationConfig validation;
  ParallelismConfig parallelism;
  CheckpointConfig checkpoint;
  MetricsConfig metrics;
  CompileConfig compile;
  std::map<std::string, std::string> kernels;  // op -> implementation
  ActivationCheckpointConfig activation_checkpoint;
  LoraTrainConfig lora;
  bool dry_run = false;

  // TOML text of every setting (what `titan train` prints and saves as config.toml).
  std::string to_toml() const;
  // Checks values (names the section.key and lists valid choices); throws titan::Error.
  void validate() const;
};

// Applies a TOML document over `config`; unknown sections/keys and wrong types are errors that list
// the valid ones. `origin` names the file in messages.
void apply_toml(TrainConfig& config, const std::string& toml_text, const std::string& origin);
// Applies one override "section.key=value" (value parsed as TOML, else taken as a string).
void apply_override(TrainConfig& config, const std::string& assignment);
// Resolves --config: a path to a .toml file, or the name of a shipped config (configs/NAME.toml).
std::string resolve_config_path(const std::string& name_or_path);
// Parses `titan train` arguments: [--config FILE|NAME] [--dry-run] [--section.key=value | --section.key
// value]...
TrainConfig parse_train_args(const std::vector<std::string>& args);

}  // namespace titan
