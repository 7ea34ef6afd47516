#include "data/loader.h"

#include <algorithm>
#include <cstring>
#include <span>

#include "core/error.h"
#include "data/sources.h"
#include "data/token_shard.h"

namespace titan::data {

namespace {

constexpr int kStateVersion = 1;

void check_config(const DataConfig& cfg) {
  TITAN_CHECK(cfg.seq_len >= 1, "data: seq_len must be >= 1, got ", cfg.seq_len);
  // A window of seq_len + 1 token ids per row is allocated before reading: bounded like the model's
  // positions.
  TITAN_CHECK(cfg.seq_len <= (int64_t(1) << 24), "data: seq_len = ", cfg.seq_len,
              " is larger than titan accepts (at most ", int64_t(1) << 24, ")");
  TITAN_CHECK(cfg.batch_size >= 1, "data: batch_size must be >= 1, got ", cfg.batch_size);
  TITAN_CHECK(cfg.batch_size <= (int64_t(1) << 20) && cfg.batch_size * cfg.seq_len <= (int64_t(1) << 30),
              "data: batch_size x seq_len = ", cfg.batch_size, " x ", cfg.seq_len,
              " tokens per batch is larger than titan accepts (at most 2^30)");
  TITAN_CHECK(cfg.dp_world >= 1 && cfg.dp_rank >= 0 && cfg.dp_rank < cfg.dp_world, "data: dp_rank ",
              cfg.dp_rank, " is not in [0, dp_world = ", cfg.dp_world, ")");
  TITAN_CHECK(cfg.val_fraction >= 0 && cfg.val_fraction < 1, "data: val_fraction must be in [0, 1), got ",
              cfg.val_fraction);
  TITAN_CHECK(cfg.max_epochs >= 0, "data: max_epochs must be >= 0, got ", cfg.max_epochs);
  TITAN_CHECK(!cfg.packing || cfg.format == DataFormat::Chat,
              "data: packing applies to chat data (text and token windows are always packed), got format '",
              to_string(cfg.format), "'");
}

bool sources_are_tokens(const DataConfig& cfg) {
  if (cfg.format == DataFormat::Tokens) return true;
  if (cfg.format != DataFormat::Auto) return false;
  return !cfg.sources.empty() && std::all_of(cfg.sources.begin(), cfg.sources.end(), is_token_dataset);
}

}  // namespace

struct DataLoader::Impl {
  DataConfig cfg;
  std::unique_ptr<DocumentSource> source;
  int32_t eos = -1, vocab = 0;
  nlohmann::json fingerprint;

  // Cursor: the current document (or piece), and how much of it (EOS included) is consumed.
  uint64_t epoch = 0;
  nlohmann::json doc_position;
  std::span<const int32_t> doc, doc_labels;  // doc_labels: chat data only
  bool chat = false;
  bool doc_has_eos = true;
  uint64_t doc_len = 0, doc_offset = 0;
  bool epoch_from_start = true;  // false after a resume: the epoch's earlier documents were not seen
  uint64_t docs_in_epoch = 0;
  bool finished = false;

  uint64_t step = 0, tokens = 0;
  std::vector<int32_t> window;
  LoaderStats stats;

  void init(const DataConfig& config, const TextEncoder& encoder) {
    check_config(config);
    cfg = config;
    chat = cfg.format == DataFormat::Chat;
    source = open_document_source(cfg, encoder);
    eos = source->eos_id();
    vocab = source->vocab_size();
    fingerprint = source->fingerprint();
    fingerprint["seed"] = cfg.seed;
    fingerprint["shuffle"] = cfg.shuffle;
    fingerprint["split"] = cfg.split == Split::Train ? "train" : "validation";
    fingerprint["val_fraction"] = cfg.val_fraction;
    fingerprint["split_seed"] = cfg.split_seed;
    fingerprint["eos_id"] = eos;
    // Load the first document now: an empty dataset is an error at construction, not mid-run.
    TITAN_CHECK(load_next_doc(), "no data");
  }

  std::string describe() const {
    return str_cat(cfg.split == Split::Train ? "training" : "validation", " split of ", cfg.sources.front(),
                   cfg.sources.size() > 1 ? " ..." : "");
  }

  bool load_next_doc() {
    for (;;) {
      nlohmann::json position = source->tell();
      std::span<const int32_t> ids;
      bool ends = true;
      if (source->next(ids, ends)) {
        // Chat conversations end with the template's own end-of-turn token: no EOS appended.
        const uint64_t len = ids.size() + (ends && !chat ? 1 : 0);
        if (len == 0) continue;
        doc = ids;
        doc_labels = source->labels();
        doc_has_eos = ends;
        doc_len = len;
        doc_offset = 0;
        doc_position = std::move(position);
        ++docs_in_epoch;
        ++stats.documents;
        return true;
      }
      if (epoch_from_start && docs_in_epoch == 0)
        fail("the ", describe(), " holds no documents",
             cfg.split == Split::Validation ? " (is val_fraction > 0?)" : "");
      if (cfg.max_epochs > 0 && epoch + 1 >= static_cast<uint64_t>(cfg.max_epochs)) {
        finished = true;
        return false;
      }
      ++epoch;
      docs_in_epoch = 0;
      epoch_from_start = true;
      source->start_epoch(epoch);
    }
  }

  // Copies the next n stream tokens to out (or skips them when out is null). Returns how many
  // there were: fewer than n only at the end of a finite run.
  uint64_t take(int32_t* out, uint64_t n) {
    uint64_t done = 0;
    while (done < n) {
      if (doc_offset == doc_len && !load_next_doc()) break;
      const uint64_t k = std::min(doc_len - doc_offset, n - done);
      if (out) {
        const uint64_t from_doc =
            doc_offset < doc.size() ? std::min<uint64_t>(k, doc.size() - doc_offset) : 0;
        std::memcpy(out + done, doc.data() + doc_offset, from_doc * sizeof(int32_t));
        if (from_doc < k) out[done + from_doc] = eos;  // only the last token of a document can be EOS
      }
      doc_offset += k;
      done += k;
    }
    tokens += done;
    return done;
  }

  // Chat: the next conversation as one row (or skipped when row is null): input_ids its first
  // seq_len tokens, then padding (EOS); labels[t] = its token t + 1 when that is an assistant
  // token, else -100. Longer conversations are truncated to seq_len + 1 tokens.
  bool take_row(int32_t* row_ids, int32_t* row_labels) {
    if (doc_offset == doc_len && !load_next_doc()) return false;
    const uint64_t L = static_cast<uint64_t>(cfg.seq_len), n = std::min<uint64_t>(doc.size(), L + 1);
    if (row_ids) {
      for (uint64_t t = 0; t < L; ++t) {
        row_ids[t] = t < n ? doc[t] : eos;
        row_labels[t] = t + 1 < n ? doc_labels[t + 1] : -100;
        stats.trained += row_labels[t] != -100;
      }
      ++stats.rows;
      stats.tokens += std::min(n, L);
      stats.padding += L - std::min(n, L);
      stats.truncated += doc.size() > L + 1;
    }
    doc_offset = doc_len;
    tokens += n;
    return true;
  }

  // Packed chat: whole conversations one after another from row position 0 (as take_row, without
  // padding between them) while they fit; positions restart at each. A conversation longer than the row
  // fills it alone, truncated. Returns false when no conversation is left to start the row.
  std::vector<int32_t> scratch_ids, scratch_labels, scratch_pos;
  bool take_packed_row(int32_t* row_ids, int32_t* row_labels, int32_t* row_pos) {
    const uint64_t L = static_cast<uint64_t>(cfg.seq_len);
    const bool mine = row_ids != nullptr;
    if (!mine) {  // another rank's row: built all the same, to know where it ends
      scratch_ids.resize(L), scratch_labels.resize(L), scratch_pos.resize(L);
      row_ids = scratch_ids.data(), row_labels = scratch_labels.data(), row_pos = scratch_pos.data();
    }
    uint64_t t = 0, convs = 0;
    while (t < L) {
      if (doc_offset == doc_len && !load_next_doc()) break;
      const uint64_t size = doc.size();
      if (t > 0 && size > L - t) break;  // starts the next row
      // n tokens of the conversation enter the row; a row-long one also takes its token L as the last label.
      const uint64_t n = std::min(size, L), label_end = std::min(size, L + 1);
      for (uint64_t i = 0; i < n; ++i) {
        row_ids[t + i] = doc[i];
        row_labels[t + i] = i + 1 < label_end ? doc_labels[i + 1] : -100;
        row_pos[t + i] = static_cast<int32_t>(i);
        if (mine) stats.trained += row_labels[t + i] != -100;
      }
      if (mine) stats.truncated += size > L + 1;
      doc_offset = doc_len;
      tokens += label_end;
      t += n;
      ++convs;
    }
    if (convs == 0) return false;
    if (mine) {
      ++stats.rows;
      stats.tokens += t;
      stats.padding += L - t;
    }
    for (; t < L; ++t) row_ids[t] = eos, row_labels[t] = -100, row_pos[t] = 0;
    return true;
  }

  bool next_chat_batch(Batch& batch) {
    const uint64_t B = static_cast<uint64_t>(cfg.batch_size), L = static_cast<uint64_t>(cfg.seq_len);
    const uint64_t N = static_cast<uint64_t>(cfg.dp_world), r = static_cast<uint64_t>(cfg.dp_rank);
    for (uint64_t b = 0; b < B; ++b) {
      // Global rows of this step, row b: N consecutive conversations, one per rank.
      bool ok = true;
      for (uint64_t k = 0; k < N && ok; ++k) {
        int32_t* ids = k == r ? batch.input_ids.data() + b * L : nullptr;
        ok = cfg.packing
                 ? take_packed_row(ids, batch.labels.data() + b * L, batch.position_ids.data() + b * L)
                 : take_row(ids, batch.labels.data() + b * L);
      }
      if (!ok) {
        finished = true;
        return false;
      }
      for (uint64_t t = 0; t < L; ++t) {
        const int32_t id = batch.input_ids[b * L + t];
        TITAN_CHECK(id >= 0 && id < vocab, "token id ", id, " outside the vocabulary of ", vocab, " in the ",
                    describe(), " (wrong tokenizer?)");
      }
    }
    batch.step = step++;
    return true;
  }

  bool next_batch(Batch& batch) {
    if (finished) return false;
    const uint64_t B = static_cast<uint64_t>(cfg.batch_size), L = static_cast<uint64_t>(cfg.seq_len);
    const uint64_t W = L + 1, N = static_cast<uint64_t>(cfg.dp_world), r = static_cast<uint64_t>(cfg.dp_rank);
    batch.batch_size = cfg.batch_size;
    batch.seq_len = cfg.seq_len;
    batch.input_ids.resize(B * L);
    batch.labels.resize(B * L);
    batch.position_ids.resize(cfg.packing ? B * L : 0);
    batch.epoch = epoch;
    if (chat) return next_chat_batch(batch);
    window.resize(W);
    for (uint64_t b = 0; b < B; ++b) {
      // Global windows of this step, row b: N consecutive windows, one per rank.
      if (take(nullptr, r * W) < r * W || take(window.data(), W) < W ||
          take(nullptr, (N - 1 - r) * W) < (N - 1 - r) * W) {
        finished = true;
        return false;
      }
      for (const int32_t id : window)
        TITAN_CHECK(id >= 0 && id < vocab, "token id ", id, " outside the vocabulary of ", vocab, " in the ",
                    describe(), " (corrupt data or wrong tokenizer?)");
      std::copy(window.begin(), window.end() - 1,
                batch.input_ids.begin() + static_cast<std::ptrdiff_t>(b * L));
      std::copy(window.begin() + 1, window.end(), batch.labels.begin() + static_cast<std::ptrdiff_t>(b * L));
      ++stats.rows;
      stats.tokens += L;
      stats.trained += L;
    }
    batch.step = step++;
    return true;
  }

  void reset() {
    epoch = step = tokens = 0;
    docs_in_epoch = doc_len = doc_offset = 0;
    epoch_from_start = true;
    finished = false;
    source->start_epoch(0);
    TITAN_CHECK(load_next_doc(), "no data");
  }

  nlohmann::json state() const {
    return {
        {"version", kStateVersion},
        {"fingerprint", fingerprint},
        {"epoch", epoch},
        {"doc", doc_position},
        {"doc_offset", doc_offset},
        {"step", step},
        {"tokens", tokens},
        {"finished", finished},
        {"layout", {{"dp_world", cfg.dp_world}, {"batch_size", cfg.batch_size}, {"seq_len", cfg.seq_len}}}};
  }

  void load_state(const nlohmann::json& s) {
    try {
      TITAN_CHECK(s.at("version").get<int>() == kStateVersion,
                  "loader state: unsupported field 'version' = ", s.at("version"));
      const nlohmann::json& saved = s.at("fingerprint");
      for (const auto& [key, value] : fingerprint.items()) {
        TITAN_CHECK(saved.contains(key) && saved[key] == value,
                    "loader state does not match this data: field '", key, "' is ",
                    saved.contains(key) ? saved[key].dump() : "missing", " in the state, ", value.dump(),
                    " now");
      }
      epoch = s.at("epoch").get<uint64_t>();
      source->seek(epoch, s.at("doc"));
      epoch_from_start = false;
      docs_in_epoch = 0;
      finished = false;
      doc_len = doc_offset = 0;
      TITAN_CHECK(load_next_doc() && epoch == s.at("epoch").get<uint64_t>(),
                  "loader state points past the end of epoch ", s.at("epoch"), " (has the data changed?)");
      const uint64_t offset = s.at("doc_offset").get<uint64_t>();
      TITAN_CHECK(offset <= doc_len, "loader state: field 'doc_offset' = ", offset,
                  " exceeds the document length ", doc_len, " (has the data changed?)");
      doc_offset = offset;
      step = s.at("step").get<uint64_t>();
      tokens = s.at("tokens").get<uint64_t>();
      finished = s.at("finished").get<bool>();
    } catch (const nlohmann::json::exception& e) {
      fail("malformed loader state: ", e.what());
    }
  }
};

DataLoader::DataLoader(const DataConfig& cfg) : impl_(std::make_unique<Impl>()) {
  TextEncoder encoder;
  if (cfg.format == DataFormat::Chat)
    encoder = make_chat_encoder(cfg.tokenizer, cfg.chat_template);
  else if (!sources_are_tokens(cfg))
    encoder = make_text_encoder(cfg.tokenizer);
  impl_->init(cfg, encoder);
}

DataLoader::DataLoader(const DataConfig& cfg, TextEncoder encoder) : impl_(std::make_unique<Impl>()) {
  impl_->init(cfg, encoder);
}

DataLoader::~DataLoader() = default;
DataLoader::DataLoader(DataLoader&&) noexcept = default;
DataLoader& DataLoader::operator=(DataLoader&&) noexcept = default;

bool DataLoader::next_batch(Batch& batch) {
  return impl_->next_batch(batch);
}
nlohmann::json DataLoader::state() const {
  return impl_->state();
}
void DataLoader::load_state(const nlohmann::json& state) {
  impl_->load_state(state);
}
void DataLoader::reset() {
  impl_->reset();
}
int32_t DataLoader::vocab_size() const {
  return impl_->vocab;
}
int32_t DataLoader::eos_id() const {
  return impl_->eos;
}
uint64_t DataLoader::epoch() const {
  return impl_->epoch;
}
uint64_t DataLoader::step() const {
  return impl_->step;
}
uint64_t DataLoader::tokens_consumed() const {
  return impl_->tokens;
}
const DataConfig& DataLoader::config() const {
  return impl_->cfg;
}
LoaderStats DataLoader::stats() const {
  LoaderStats s = impl_->stats;
  s.skipped = impl_->source->skipped();
  return s;
}

}  // namespace titan::data
