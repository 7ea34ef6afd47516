// BPE model of an HF tokenizer.json: vocab, merges ranked by position, and word encoding.
// Merges are hashed by (left id, right id) so loading never builds merge strings and encoding
// never touches strings; a per-thread cache remembers recent words.
#pragma once
#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace titan::tok {

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const noexcept { return std::hash<std::string_view>{}(s); }
};
using StringIdMap = std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>>;

class BpeModel {
 public:
  // model: the "model" object of tokenizer.json (its options); vocab (token, id) and merges
  // (left, right) by rank come separately (see json_load.h); file names the source in errors.
  void load(const nlohmann::json& model, std::vector<std::pair<std::string, int64_t>>&& vocab,
            const std::vector<std::pair<std::string, std::string>>& merges, const std::string& file);

  // Appends the ids of one pre-tokenized word. byte_level: word holds raw bytes that the
  // ByteLevel pre-tokenizer maps to its alphabet; otherwise word is text split into characters.
  void encode_word(std::string_view word, bool byte_level, std::vector<int32_t>& out) const;

  std::optional<int32_t> token_to_id(std::string_view token) const;
  const std::string* id_to_token(int32_t id) const;
  int32_t max_id() const { return static_cast<int32_t>(id_to_token_.size()) - 1; }

 private:
  struct MergeSlot {
    uint64_t key;  // (left << 32) | right, kEmpty when unused
    int32_t rank;
    int32_t merged;
  };
  static constexpr uint64_t kEmpty = ~uint64_t{0};
  void add_merge(int32_t left, int32_t right, int32_t rank, int32_t merged);
  const MergeSlot* find_merge(int32_t left, int32_t right) const {
    uint64_t key = (uint64_t(uint32_t(left)) << 32) | uint32_t(right);
    size_t mask = merges_.size() - 1;
    size_t h = (key * 0x9E3779B97F4A7C15ull) >> 20 & mask;
    while (true) {
      const MergeSlot& s = merges_[h];
      if (s.key == key) return &s;
      if (s.key == kEmpty) return nullptr;
      h = (h + 1) & mask;
    }
  }
  void initial_symbols(std::string_view word, bool byte_level, std::vector<int32_t>& syms) const;
  void merge_symbols(std::vector<int32_t>& syms) const;

  // Vocab lookup: open addressing over ids, keys compared against id_to_token_ (no nodes).
  int32_t find_token(std::string_view token) const;
  std::vector<uint64_t> slots_;  // (hash tag << 32) | id; ~0 when empty
  std::vector<std::string> id_to_token_;
  std::vector<uint8_t> has_id_;
  std::vector<MergeSlot> merges_;
  int32_t byte_ids_[256];  // id of each byte's byte-level char, -1 when absent from the vocab
  std::optional<int32_t> unk_id_;
  bool fuse_unk_ = false;
  bool byte_fallback_ = false;
  bool ignore_merges_ = false;
  uint64_t instance_ = 0;  // distinguishes models in the per-thread cache
};

}  // namespace titan::tok
