#include "train/config.h"

#include <toml++/toml.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <variant>

#include "core/error.h"
#include "device/device.h"

namespace titan {

namespace {

using FieldPtr = std::variant<std::string*, int64_t*, uint64_t*, double*, bool*, std::vector<std::string>*>;

struct Field {
  std::string section, key;
  FieldPtr ptr;
};

// The schema: every section.key the trainer understands, bound to `c`'s members.
std::vector<Field> fields(TrainConfig& c) {
  return {
      {"job", "dump_folder", &c.job.dump_folder},
      {"job", "description", &c.job.description},
      {"job", "print_config", &c.job.print_config},
      {"job", "device", &c.job.device},
      {"model", "name", &c.model.name},
      {"model", "flavor", &c.model.flavor},
      {"model", "hf_assets_path", &c.model.hf_assets_path},
      {"model", "tokenizer_path", &c.model.tokenizer_path},
      {"model", "vocab_size", &c.model.vocab_size},
      {"model", "num_hidden_layers", &c.model.num_hidden_layers},
      {"model", "moe_aux_loss", &c.model.moe_aux_loss},
      {"model", "load_balance_coeff", &c.model.load_balance_coeff},
      {"optimizer", "name", &c.optimizer.name},
      {"optimizer", "lr", &c.optimizer.lr},
      {"optimizer", "beta1", &c.optimizer.beta1},
      {"optimizer", "beta2", &c.optimizer.beta2},
      {"optimizer", "eps", &c.optimizer.eps},
      {"optimizer", "weight_decay", &c.optimizer.weight_decay},
      {"optimizer", "implementation", &c.optimizer.implementation},
      {"lr_scheduler", "warmup_steps", &c.lr_scheduler.warmup_steps},
      {"lr_scheduler", "decay_ratio", &c.lr_scheduler.decay_ratio},
      {"lr_scheduler", "decay_type", &c.lr_scheduler.decay_type},
      {"lr_scheduler", "min_lr_factor", &c.lr_scheduler.min_lr_factor},
      {"training", "dataset", &c.training.dataset},
      {"training", "dataset_format", &c.training.dataset_format},
      {"training", "dataset_delimiter", &c.training.dataset_delimiter},
      {"training", "text_field", &c.training.text_field},
      {"training", "packing", &c.training.packing},
      {"training", "val_fraction", &c.training.val_fraction},
      {"training", "local_batch_size", &c.training.local_batch_size},
      {"training", "global_batch_size", &c.training.global_batch_size},
      {"training", "seq_len", &c.training.seq_len},
      {"training", "max_norm", &c.training.max_norm},
      {"training", "steps", &c.training.steps},
      {"training", "seed", &c.training.seed},
      {"training", "mixed_precision_param", &c.training.mixed_precision_param},
      {"training", "skip_nan_inf", &c.training.skip_nan_inf},
      {"training", "sample_tokens", &c.training.sample_tokens},
      {"training", "sample_prompt", &c.training.sample_prompt},
      {"validation", "enable", &c.validation.enable},
      {"validation", "dataset", &c.validation.dataset},
      {"validation", "freq", &c.validation.freq},
      {"validation", "steps", &c.validation.steps},
      {"parallelism", "data_parallel_replicate_degree", &c.parallelism.data_parallel_replicate_degree},
      {"parallelism", "data_parallel_shard_degree", &c.parallelism.data_parallel_shard_degree},
      {"parallelism", "expert_parallel_degree", &c.parallelism.expert_parallel_degree},
      {"parallelism", "tensor_parallel_degree", &c.parallelism.tensor_parallel_degree},
      {"parallelism", "enable_sequence_parallel", &c.parallelism.enable_sequence_parallel},
      {"parallelism", "pipeline_parallel_degree", &c.parallelism.pipeline_parallel_degree},
      {"parallelism", "pipeline_parallel_schedule", &c.parallelism.pipeline_parallel_schedule},
      {"parallelism", "pipeline_parallel_microbatch_size", &c.parallelism.pipeline_parallel_microbatch_size},
      {"parallelism", "pipeline_parallel_layers_per_stage",
       &c.parallelism.pipeline_parallel_layers_per_stage},
      {"parallelism", "pipeline_parallel_first_stage_less_layers",
       &c.parallelism.pipeline_parallel_first_stage_less_layers},
      {"parallelism", "pipeline_parallel_last_stage_less_layers",
       &c.parallelism.pipeline_parallel_last_stage_less_layers},
      {"parallelism", "context_parallel_degree", &c.parallelism.context_parallel_degree},
      {"checkpoint", "enable", &c.checkpoint.enable},
      {"checkpoint", "folder", &c.checkpoint.folder},
      {"checkpoint", "interval", &c.checkpoint.interval},
      {"checkpoint", "keep_latest_k", &c.checkpoint.keep_latest_k},
      {"checkpoint", "initial_load_path", &c.checkpoint.initial_load_path},
      {"checkpoint", "initial_load_in_hf", &c.checkpoint.initial_load_in_hf},
      {"checkpoint", "last_save_in_hf", &c.checkpoint.last_save_in_hf},
      {"checkpoint", "export_dtype", &c.checkpoint.export_dtype},
      {"metrics", "log_freq", &c.metrics.log_freq},
      {"metrics", "peak_tflops", &c.metrics.peak_tflops},
      {"metrics", "enable_jsonl", &c.metrics.enable_jsonl},
      {"metrics", "progress_bar", &c.metrics.progress_bar},
      {"metrics", "enable_tensorboard", &c.metrics.enable_tensorboard},
      {"metrics", "save_tb_folder", &c.metrics.save_tb_folder},
      {"compile", "enable", &c.compile.enable},
      {"compile", "components", &c.compile.components},
      {"compile", "backend", &c.compile.backend},
      {"activation_checkpoint", "mode", &c.activation_checkpoint.mode},
      {"activation_checkpoint", "selective_ac_option", &c.activation_checkpoint.selective_ac_option},
      {"lora", "enable", &c.lora.enable},
      {"lora", "rank", &c.lora.rank},
      {"lora", "alpha", &c.lora.alpha},
      {"lora", "dropout", &c.lora.dropout},
      {"lora", "target_modules", &c.lora.target_modules},
      {"lora", "base_dtype", &c.lora.base_dtype},
      {"lora", "adapter_path", &c.lora.adapter_path},
  };
}

const std::vector<std::string>& section_names() {
  static const std::vector<std::string> names = {
      "job",         "model",      "optimizer", "lr_scheduler", "training", "validation",
      "parallelism", "checkpoint", "metrics",   "compile",      "kernels",  "activation_checkpoint",
      "lora"};
  return names;
}

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (auto& x : v) s += (s.empty() ? "" : ", ") + x;
  return s;
}

std::string valid_keys(TrainConfig& c, const std::string& section) {
  std::vector<std::string> keys;
  for (auto& f : fields(c))
    if (f.section == section) keys.push_back(f.key);
  return join(keys);
}

// Sets one field from a TOML node; `where` names the origin for messages.
void set_field(const Field& f, const toml::node& node, const std::string& where) {
  const std::string name = f.section + "." + f.key;
  auto type_error = [&](const char* want) { fail(where, ": ", name, " must be ", want); };
  std::visit(
      [&](auto* p) {
        using T = std::remove_pointer_t<decltype(p)>;
        if constexpr (std::is_same_v<T, std::string>) {
          // An integer where a string is expected reads as its digits (--activation_checkpoint.
          // selective_ac_option=2, as torchtitan's "2"; --job.dump_folder=2024).
          if (node.is_integer()) {
            *p = std::to_string(node.as_integer()->get());
            return;
          }
          if (!node.is_string()) type_error("a string");
          *p = node.as_string()->get();
        } else if constexpr (std::is_same_v<T, int64_t>) {
          if (!node.is_integer()) type_error("an integer");
          *p = node.as_integer()->get();
        } else if constexpr (std::is_same_v<T, uint64_t>) {
          if (!node.is_integer() || node.as_integer()->get() < 0) type_error("a non-negative integer");
          *p = static_cast<uint64_t>(node.as_integer()->get());
        } else if constexpr (std::is_same_v<T, double>) {
          if (node.is_integer())
            *p = static_cast<double>(node.as_integer()->get());
          else if (node.is_floating_point())
            *p = node.as_floating_point()->get();
          else
            type_error("a number");
        } else if constexpr (std::is_same_v<T, bool>) {
          if (!node.is_boolean()) type_error("true or false");
          *p = node.as_boolean()->get();
        } else {
          p->clear();
          if (node.is_string()) {
            p->push_back(node.as_string()->get());
          } else if (node.is_array()) {
            for (auto& e : *node.as_array()) {
              if (!e.is_string()) type_error("a string or an array of strings");
              p->push_back(e.as_string()->get());
            }
          } else {
            type_error("a string or an array of strings");
          }
        }
      },
      f.ptr);
}

void apply_table(TrainConfig& c, const toml::table& root, const std::string& origin) {
  auto schema = fields(c);
  for (auto& [section_key, section_node] : root) {
    const std::string section(section_key.str());
    if (std::find(section_names().begin(), section_names().end(), section) == section_names().end())
      fail(origin, ": unknown section [", section, "] (valid: ", join(section_names()), ")");
    const toml::table* tbl = section_node.as_table();
    TITAN_CHECK(tbl, origin, ": [", section, "] must be a table");
    for (auto& [key_node, value] : *tbl) {
      const std::string key(key_node.str());
      if (section == "kernels") {
        TITAN_CHECK(value.is_string(), origin, ": kernels.", key,
                    " must be a string (an implementation name)");
        c.kernels[key] = value.as_string()->get();
        continue;
      }
      auto it = std::find_if(schema.begin(), schema.end(),
                             [&](const Field& f) { return f.section == section && f.key == key; });
      if (it == schema.end())
        fail(origin, ": unknown key ", section, ".", key, " (valid keys of [", section,
             "]: ", valid_keys(c, section), ")");
      set_field(*it, value, origin);
    }
  }
}

void check_choice(const std::string& name, const std::string& value, const std::vector<std::string>& valid) {
  TITAN_CHECK(std::find(valid.begin(), valid.end(), value) != valid.end(), name, " = '", value,
              "' is not valid (valid: ", join(valid), ")");
}

}  // namespace

void apply_toml(TrainConfig& config, const std::string& toml_text, const std::string& origin) {
  toml::table root;
  try {
    root = toml::parse(toml_text, origin);
  } catch (const toml::parse_error& e) {
    std::ostringstream os;
    os << e.description() << " (line " << e.source().begin.line << ")";
    fail(origin, ": invalid TOML: ", os.str());
  }
  apply_table(config, root, origin);
}

void apply_override(TrainConfig& config, const std::string& assignment) {
  auto eq = assignment.find('=');
  TITAN_CHECK(eq != std::string::npos, "override '", assignment, "' must look like section.key=value");
  const std::string path = assignment.substr(0, eq), value = assignment.substr(eq + 1);
  auto dot = path.find('.');
  TITAN_CHECK(dot != std::string::npos && dot > 0 && dot + 1 < path.size(), "override '", assignment,
              "' must look like section.key=value");
  const std::string section = path.substr(0, dot), key = path.substr(dot + 1);
  // Parse the value as TOML (numbers, booleans, arrays, quoted strings); bare words are strings.
  std::string doc = "[" + section + "]\n\"" + key + "\" = " + value + "\n";
  toml::table root;
  try {
    root = toml::parse(doc);
  } catch (const toml::parse_error&) {
    toml::table t;
    t.insert(section, toml::table{{key, value}});
    root = std::move(t);
  }
  apply_table(config, root, "--" + section + "." + key);
}

std::string resolve_config_path(const std::string& name_or_path) {
  namespace fs = std::filesystem;
  if (fs::exists(name_or_path)) return name_or_path;
  std::vector<std::string> candidates = {
      std::string(TITAN_SOURCE_DIR_STR) + "/configs/" + name_or_path + ".toml",
      "configs/" + name_or_path + ".toml"};
  for (auto& c : candidates)
    if (fs::exists(c)) return c;
  std::vector<std::string> shipped;
  for (auto& dir : {std::string(TITAN_SOURCE_DIR_STR) + "/configs", std::string("configs")})
    if (fs::is_directory(dir))
      for (auto& e : fs::directory_iterator(dir))
        if (e.path().extension() == ".toml") shipped.push_back(e.path().stem().string());
  std::sort(shipped.begin(), shipped.end());
  shipped.erase(std::unique(shipped.begin(), shipped.end()), shipped.end());
  fail("config '", name_or_path, "' is neither a file nor a shipped config (shipped: ", join(shipped), ")");
}

TrainConfig parse_train_args(const std::vector<std::string>& args) {
  TrainConfig c;
  std::vector<std::string> overrides;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--config" || a.starts_with("--config=") || a.starts_with("--job.config_file")) {
      std::string v;
      if (a.find('=') != std::string::npos) {
        v = a.substr(a.find('=') + 1);
      } else {
        TITAN_CHECK(i + 1 < args.size(), "--config needs a value");
        v = args[++i];
      }
      const std::string path = resolve_config_path(v);
      std::ifstream f(path);
      TITAN_CHECK(f, path, ": cannot open");
      std::stringstream ss;
      ss << f.rdbuf();
      apply_toml(c, ss.str(), path);
    } else if (a == "--dry-run") {
      c.dry_run = true;
    } else if (a.starts_with("--") && a.find('.') != std::string::npos) {
      if (a.find('=') != std::string::npos) {
        overrides.push_back(a.substr(2));
      } else {
        TITAN_CHECK(i + 1 < args.size(), a, " needs a value");
        overrides.push_back(a.substr(2) + "=" + args[i + 1]);
        ++i;
      }
    } else {
      fail("unknown argument '", a, "' (expected --config FILE|NAME, --dry-run or --section.key=value)");
    }
  }
  // Overrides apply after the file, whatever their position on the command line.
  for (auto& o : overrides) apply_override(c, o);
  c.validate();
  return c;
}

void TrainConfig::validate() const {
  check_choice("model.name", model.name, {"qwen3"});
  check_choice("optimizer.name", optimizer.name, {"AdamW"});
  check_choice("model.moe_aux_loss", model.moe_aux_loss, {"auto", "on", "off"});
  parse_device(job.device, "job.device");
  check_choice("lr_scheduler.decay_type", lr_scheduler.decay_type, {"linear", "sqrt", "cosine", "constant"});
  check_choice("training.dataset_format", training.dataset_format,
               {"auto", "text", "jsonl", "tokens", "chat"});
  check_choice("training.dataset_delimiter", training.dataset_delimiter, {"file", "percent", "blank"});
  TITAN_CHECK(!training.packing || training.dataset_format == "chat",
              "training.packing = true applies to chat data (training.dataset_format = 'chat'); text and "
              "token windows are always packed, got dataset_format = '",
              training.dataset_format, "'");
  check_choice("training.mixed_precision_param", training.mixed_precision_param, {"float32", "bfloat16"});
  check_choice("checkpoint.export_dtype", checkpoint.export_dtype, {"float32", "bfloat16"});
  check_choice("activation_checkpoint.mode", activation_checkpoint.mode, {"none", "full", "selective"});
  (void)activation_checkpoint.every();
  check_choice("lora.base_dtype", lora.base_dtype, {"bfloat16", "float32"});
  TITAN_CHECK(!metrics.enable_tensorboard || !metrics.save_tb_folder.empty(),
              "metrics.save_tb_folder must name a folder (relative to job.dump_folder) when "
              "metrics.enable_tensorboard = true");
  TITAN_CHECK(lora.rank > 0, "lora.rank must be positive, got ", lora.rank);
  TITAN_CHECK(lora.alpha > 0, "lora.alpha must be positive, got ", lora.alpha);
  TITAN_CHECK(lora.dropout >= 0 && lora.dropout < 1, "lora.dropout must be in [0, 1), got ", lora.dropout);
  TITAN_CHECK(checkpoint.interval > 0, "checkpoint.interval must be positive, got ", checkpoint.interval);
  TITAN_CHECK(checkpoint.keep_latest_k >= 0, "checkpoint.keep_latest_k must be >= 0 (0 keeps all), got ",
              checkpoint.keep_latest_k);
  TITAN_CHECK(!checkpoint.folder.empty() && checkpoint.folder.find("..") == std::string::npos,
              "checkpoint.folder must be a non-empty folder name inside job.dump_folder, got '",
              checkpoint.folder, "'");
  auto positive = [](const char* name, double v) { TITAN_CHECK(v > 0, name, " must be positive, got ", v); };
  positive("training.local_batch_size", training.local_batch_size);
  positive("training.seq_len", training.seq_len);
  positive("training.steps", training.steps);
  positive("optimizer.lr", optimizer.lr);
  positive("metrics.log_freq", metrics.log_freq);
  TITAN_CHECK(optimizer.beta1 >= 0 && optimizer.beta1 < 1 && optimizer.beta2 >= 0 && optimizer.beta2 < 1,
              "optimizer.beta1 and optimizer.beta2 must be in [0, 1)");
  TITAN_CHECK(optimizer.weight_decay >= 0, "optimizer.weight_decay must be >= 0");
  TITAN_CHECK(lr_scheduler.warmup_steps >= 0, "lr_scheduler.warmup_steps must be >= 0");
  TITAN_CHECK(lr_scheduler.min_lr_factor >= 0 && lr_scheduler.min_lr_factor <= 1,
              "lr_scheduler.min_lr_factor must be in [0, 1]");
  TITAN_CHECK(training.val_fraction >= 0 && training.val_fraction < 1,
              "training.val_fraction must be in [0, 1)");
  TITAN_CHECK(
      !validation.enable || !validation.dataset.empty() || training.val_fraction > 0,
      "validation.enable = true needs validation data: set validation.dataset, or hold out a share of "
      "training.dataset with training.val_fraction > 0 (or set validation.enable = false)");
  TITAN_CHECK(validation.freq > 0, "validation.freq must be positive, got ", validation.freq);
  TITAN_CHECK(validation.steps == -1 || validation.steps > 0,
              "validation.steps must be -1 (the whole set) or positive, got ", validation.steps);
  TITAN_CHECK(training.global_batch_size == -1 || training.global_batch_size > 0,
              "training.global_batch_size must be -1 or positive");
  TITAN_CHECK(!training.dataset.empty(), "training.dataset needs at least one source");
  TITAN_CHECK(parallelism.data_parallel_replicate_degree >= 1,
              "parallelism.data_parallel_replicate_degree must be >= 1");
  TITAN_CHECK(parallelism.data_parallel_shard_degree == -1 || parallelism.data_parallel_shard_degree >= 1,
              "parallelism.data_parallel_shard_degree must be -1 or >= 1");
  TITAN_CHECK(parallelism.expert_parallel_degree >= 1, "parallelism.expert_parallel_degree must be >= 1");
  const int64_t tp = parallelism.tensor_parallel_degree;
  TITAN_CHECK(tp >= 1, "parallelism.tensor_parallel_degree must be >= 1, got ", tp);
  TITAN_CHECK(parallelism.pipeline_parallel_degree >= 1,
              "parallelism.pipeline_parallel_degree must be >= 1, got ",
              parallelism.pipeline_parallel_degree);
  TITAN_CHECK(parallelism.context_parallel_degree >= 1,
              "parallelism.context_parallel_degree must be >= 1, got ", parallelism.context_parallel_degree);
  dist::parse_pipeline_schedule(parallelism.pipeline_parallel_schedule);
  if (tp > 1) {
    // What tensor parallel runs with today; each refusal names what to change.
    auto refuse = [tp](bool bad, const std::string& what) {
      TITAN_CHECK(!bad, "parallelism.tensor_parallel_degree = ", tp, ": ", what);
    };
    const int64_t tokens = training.local_batch_size * training.seq_len;
    refuse(parallelism.enable_sequence_parallel && tokens % tp != 0,
           "sequence parallel (parallelism.enable_sequence_parallel = true) splits a micro-batch's "
           "training.local_batch_size x training.seq_len = " +
               std::to_string(tokens) +
               " tokens over the tensor-parallel ranks, and they do not divide evenly (or set "
               "enable_sequence_parallel = false)");
  }
  for (const auto& c : compile.components) check_choice("compile.components", c, {"model", "loss"});
  check_choice("compile.backend", compile.backend, {"inductor", "aot_eager", "eager", "cudagraphs"});
  TITAN_CHECK(!compile.enable || parse_device(job.device, "job.device").type != DeviceType::GUARD,
              "compile.enable = true on job.device = '", job.device,
              "': the guard device runs the CPU's kernels and has no graphs; set compile.enable = false");
}

int64_t ActivationCheckpointConfig::every() const {
  if (mode == "none") return 0;
  if (mode == "full") return 1;
  const std::string& o = selective_ac_option;
  if (o == "op") return 0;
  int64_t n = 0;
  const auto [end, ec] = std::from_chars(o.data(), o.data() + o.size(), n);
  TITAN_CHECK(ec == std::errc() && end == o.data() + o.size() && n >= 1,
              "activation_checkpoint.selective_ac_option must be 'op' (keep GEMM and attention outputs, "
              "recompute the pointwise ops) or a positive integer N (checkpoint every N-th layer), got '",
              o, "'");
  return n;
}

namespace {

// The shortest decimal that reads back as the same double, as a TOML float (never an integer literal).
std::string shortest_toml_float(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  char buf[64];
  const auto [end, ec] = std::to_chars(buf, buf + sizeof buf, x);
  std::string out(buf, end);
  if (out.find_first_of(".e") == std::string::npos) out += ".0";
  return out;
}

}  // namespace

std::string TrainConfig::to_toml() const {
  TrainConfig copy = *this;
  toml::table root;
  for (auto& s : section_names()) root.insert(s, toml::table{});
  for (auto& f : fields(copy)) {
    toml::table& t = *root[f.section].as_table();
    std::visit(
        [&](auto* p) {
          using T = std::remove_pointer_t<decltype(p)>;
          if constexpr (std::is_same_v<T, std::vector<std::string>>) {
            toml::array a;
            for (auto& s : *p) a.push_back(s);
            t.insert(f.key, a);
          } else if constexpr (std::is_same_v<T, uint64_t>) {
            t.insert(f.key, static_cast<int64_t>(*p));
          } else {
            t.insert(f.key, *p);
          }
        },
        f.ptr);
  }
  toml::table& k = *root["kernels"].as_table();
  for (auto& [op, impl] : kernels) k.insert(op, impl);
  std::ostringstream os;
  for (auto& s : section_names()) {
    os << "[" << s << "]\n";
    for (auto& [key, value] : *root[s].as_table()) {
      if (const auto* d = value.as_floating_point()) {  // as the user wrote it: 0.9, not 0.90000000000000002
        os << key.str() << " = " << shortest_toml_float(d->get()) << "\n";
        continue;
      }
      toml::table one;
      one.insert(key, value);
      os << one << "\n";
    }
    os << "\n";
  }
  return os.str();
}

}  // namespace titan
