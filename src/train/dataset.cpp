#include "train/dataset.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "distributed/runtime.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/trainer.h"

namespace titan {

namespace fs = std::filesystem;

namespace {

constexpr const char* kFortuneDir = "/usr/share/games/fortunes";

bool is_text_dataset(const TrainConfig& cfg, const std::vector<std::string>& sources) {
  if (cfg.training.dataset_format == "tokens") return false;
  if (cfg.training.dataset_format != "auto") return true;
  for (auto& s : sources)
    if (!(fs::is_directory(s) && fs::exists(fs::path(s) / "index.json")) &&
        fs::path(s).filename() != "index.json")
      return true;
  return false;
}

// Every regular file under the sources, sorted (the BPE trainer's input).
std::vector<std::string> corpus_files(const std::vector<std::string>& sources) {
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
  return files;
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
  const std::string json = train_bpe(corpus_files(sources), static_cast<int>(vocab), {"<|endoftext|>"});
  fs::create_directories(dir);
  const std::string tmp = path.string() + ".tmp";
  std::ofstream(tmp) << json;
  fs::rename(tmp, path);
  return path.string();
}

std::string validation_source(const TrainConfig& cfg) {
  if (!cfg.validation.dataset.empty()) return "validation.dataset";
  return str_cat(
      "the held-out split of training.dataset (training.val_fraction = ", cfg.training.val_fraction, ")");
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

std::vector<std::string> resolve_sources(const std::vector<std::string>& sources, const std::string& field) {
  std::vector<std::string> out;
  for (auto& s : sources) {
    if (s == "fortunes") {
      auto files = fortune_files();
      TITAN_CHECK(!files.empty(), field, " = \"fortunes\": no fortune files in ", kFortuneDir,
                  " (install the Debian packages fortunes and fortunes-min: scripts/setup.sh does)");
      out.insert(out.end(), files.begin(), files.end());
    } else {
      TITAN_CHECK(fs::exists(s), field, ": '", s, "' does not exist");
      out.push_back(s);
    }
  }
  return out;
}

data::DataConfig base_data_config(const TrainConfig& cfg, const std::vector<std::string>& sources,
                                  const std::string& tokenizer_path, int64_t dp_rank, int64_t dp_world) {
  data::DataConfig dc;
  dc.sources = sources;
  dc.format = data::parse_data_format(cfg.training.dataset_format);
  dc.delimiter = data::parse_doc_delimiter(cfg.training.dataset_delimiter);
  dc.text_field = cfg.training.text_field;
  dc.packing = cfg.training.packing;
  dc.tokenizer = tokenizer_path;
  dc.seq_len = cfg.training.seq_len;
  dc.batch_size = cfg.training.local_batch_size;
  dc.seed = cfg.training.seed;
  dc.dp_rank = static_cast<int>(dp_rank);
  dc.dp_world = static_cast<int>(dp_world);
  return dc;
}

TrainData build_train_data(const TrainConfig& cfg, dist::ProcessGroup& pg, int64_t vocab_size) {
  TrainData d;
  d.sources = resolve_sources(cfg.training.dataset, "training.dataset");
  if (is_text_dataset(cfg, d.sources)) {
    // Rank 0 trains the tokenizer when one is needed; the others wait and load it.
    const bool lead = pg.rank() == 0;
    if (lead) d.tokenizer_path = resolve_tokenizer(cfg, d.sources, vocab_size);
    pg.barrier();
    if (!lead) d.tokenizer_path = resolve_tokenizer(cfg, d.sources, vocab_size);
  }
  data::DataConfig dc = base_data_config(cfg, d.sources, d.tokenizer_path, pg.rank(), pg.size());
  dc.val_fraction = cfg.training.val_fraction;
  d.train = std::make_unique<data::DataLoader>(dc);
  TITAN_CHECK(d.train->vocab_size() <= vocab_size, "the data's vocabulary (", d.train->vocab_size(),
              " ids) does not fit the model's vocab_size (", vocab_size, ")");
  if (cfg.validation.enable) {
    d.validation = build_validation_loader(cfg, d, pg.rank(), pg.size());
    d.validation_source = validation_source(cfg);
    TITAN_CHECK(d.validation->vocab_size() <= vocab_size, "the validation data's vocabulary (",
                d.validation->vocab_size(), " ids) does not fit the model's vocab_size (", vocab_size, ")");
  }
  return d;
}

std::unique_ptr<data::DataLoader> build_validation_loader(const TrainConfig& cfg, const TrainData& data,
                                                          int64_t dp_rank, int64_t dp_world) {
  const bool own = !cfg.validation.dataset.empty();
  data::DataConfig dc = base_data_config(
      cfg, own ? resolve_sources(cfg.validation.dataset, "validation.dataset") : data.sources,
      data.tokenizer_path, dp_rank, dp_world);
  if (!own) {
    dc.val_fraction = cfg.training.val_fraction;
    dc.split = data::Split::Validation;
  }
  dc.max_epochs = 1;
  const std::string what = validation_source(cfg);
  const char* fix = "; give it more data (or set validation.enable = false)";
  std::unique_ptr<data::DataLoader> loader;
  try {
    loader = std::make_unique<data::DataLoader>(dc);
  } catch (const Error& e) {  // e.g. a held-out split that caught no document
    fail("validation: ", what, ": ", e.what(), fix);
  }
  data::Batch probe;
  TITAN_CHECK(loader->next_batch(probe), "validation: ", what, " cannot fill one batch of ",
              cfg.training.local_batch_size, " x ", cfg.training.seq_len + 1, "-token windows on each of ",
              dp_world, " ranks", fix);
  loader->reset();
  return loader;
}

}  // namespace titan
