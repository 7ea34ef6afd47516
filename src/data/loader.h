// DataLoader: packs the documents of a dataset into fixed-length training windows.
//
// Packing follows torchtitan: documents, each followed by EOS, are concatenated into one token
// stream (epoch after epoch, each in its own shuffled order); the stream is cut into consecutive,
// non-overlapping windows of seq_len + 1 tokens; a window w gives input_ids = w[:-1] and
// labels = w[1:]. Global window k belongs to data-parallel rank k % dp_world, so the ranks see
// disjoint windows that together are exactly the windows a single rank would see. Batch s of every
// rank is drawn from global windows [s * B * dp_world, (s + 1) * B * dp_world).
//
// Chat data (DataFormat::Chat) is not packed: each row is one conversation, its first seq_len
// tokens padded with EOS, labels[t] = token t + 1 where that is an assistant token and -100
// elsewhere (padding included). Conversations longer than seq_len + 1 tokens are truncated;
// causal attention keeps the padding after a conversation from affecting it, so no document mask
// is needed. Global row k belongs to rank k % dp_world; the state is the position of the next
// conversation, so resuming is exact as for packed data.
//
// Packed chat data (DataConfig::packing, TRL's padding-free packing): a row takes whole conversations
// in order while they fit in seq_len positions, each with its own shifted labels (the last token of a
// conversation predicts nothing), then padding; position_ids restart at 0 with each conversation (HF's
// packing positions: the model keeps attention inside each one). A conversation is never split: one
// that does not fit starts the next row; one longer than a row fills a row alone, truncated as above.
//
// Memory is constant in the corpus size: token shards are memory-mapped, text is streamed.
#pragma once
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <vector>

#include "data/config.h"
#include "data/encoder.h"

namespace titan::data {

class DocumentSource;

struct Batch {
  int64_t batch_size = 0;
  int64_t seq_len = 0;
  std::vector<int32_t> input_ids;  // [batch_size, seq_len], row-major
  std::vector<int32_t> labels;     // [batch_size, seq_len]: labels[b][t] = input_ids[b][t + 1] in the stream
                                   // (chat: -100 where that token is not the assistant's)
  std::vector<int32_t> position_ids;  // packed chat rows: [batch_size, seq_len], 0 at each conversation's
                                      // first token (HF position_ids); empty otherwise
  uint64_t step = 0;                  // index of this batch (same on every rank)
  uint64_t epoch = 0;                 // epoch of the batch's first token
};

// What this rank's batches held so far (`titan data show`).
struct LoaderStats {
  uint64_t rows = 0;       // rows of seq_len positions
  uint64_t documents = 0;  // documents begun (chat: conversations, one per row unless packed)
  uint64_t tokens = 0;     // input positions holding data (not padding)
  uint64_t trained = 0;    // positions whose label is not -100
  uint64_t truncated = 0;  // chat: conversations longer than seq_len + 1 tokens, cut
  uint64_t padding = 0;    // chat: input positions after the row's conversation(s) (EOS, label -100)
  uint64_t skipped = 0;    // records the source skipped (chat: no assistant token within seq_len + 1)
};

class DataLoader {
 public:
  // Builds the encoder from cfg.tokenizer when the sources are text.
  explicit DataLoader(const DataConfig& cfg);
  // Uses `encoder` for text sources (tests pass byte_encoder()).
  DataLoader(const DataConfig& cfg, TextEncoder encoder);
  ~DataLoader();
  DataLoader(DataLoader&&) noexcept;
  DataLoader& operator=(DataLoader&&) noexcept;

  // Fills `batch` with the next batch of this rank. Returns false only when max_epochs is set and
  // the data cannot fill a whole batch on every rank (all ranks agree).
  bool next_batch(Batch& batch);

  // JSON state after the last batch; load_state() on a loader with the same data and options
  // continues with exactly the next token. dp_world, batch_size and seq_len may change between
  // save and load: the state is a position in the global token stream.
  nlohmann::json state() const;
  void load_state(const nlohmann::json& state);

  // Back to the first batch of epoch 0 (e.g. before each evaluation pass of a validation loader).
  void reset();

  int32_t vocab_size() const;
  int32_t eos_id() const;
  uint64_t epoch() const;
  uint64_t step() const;
  uint64_t tokens_consumed() const;  // global stream tokens behind us (all ranks)
  const DataConfig& config() const;
  LoaderStats stats() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace titan::data
