// BPE trainer (see trainer.h). Words are counted once after pre-tokenization; merging keeps pair
// counts and pair -> words indexes and updates them only for the words a merge touches.
#include "tokenizer/trainer.h"

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>
#include <queue>
#include <sstream>
#include <unordered_map>
#include <unordered_set>

#include "core/error.h"
#include "tokenizer/added_tokens.h"
#include "tokenizer/bpe.h"
#include "tokenizer/pipeline.h"
#include "tokenizer/unicode.h"

namespace titan {

using nlohmann::json;
using nlohmann::ordered_json;

namespace {
const char* kQwenPattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

ordered_json byte_level_json() {
  return ordered_json{
      {"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", false}};
}
ordered_json pre_tokenizer_json() {
  return ordered_json{
      {"type", "Sequence"},
      {"pretokenizers", ordered_json::array({ordered_json{{"type", "Split"},
                                                          {"pattern", ordered_json{{"Regex", kQwenPattern}}},
                                                          {"behavior", "Isolated"},
                                                          {"invert", false}},
                                             byte_level_json()})}};
}
}  // namespace

struct BpeTrainer::State {
  std::vector<std::string> specials;
  tok::Normalizer normalizer;
  tok::PreTokenizer pre_tokenizer;
  tok::AddedTokenMatcher matcher;
  std::unordered_map<std::string, int64_t, tok::StringHash, std::equal_to<>> words;

  void count(std::string_view text) {
    std::vector<std::string_view> pieces;
    std::deque<std::string> arena;
    pre_tokenizer.apply(text, pieces, arena);
    for (std::string_view w : pieces) {
      auto it = words.find(w);
      if (it == words.end())
        words.emplace(std::string(w), 1);
      else
        ++it->second;
    }
  }
};

BpeTrainer::BpeTrainer(std::vector<std::string> special_tokens) : state_(std::make_unique<State>()) {
  if (special_tokens.empty()) special_tokens.push_back("<|endoftext|>");
  for (const auto& s : special_tokens) {
    TITAN_CHECK(!s.empty(), "tokenizer train: empty special token");
    TITAN_CHECK(tok::is_valid_utf8(s), "tokenizer train: special token is not valid UTF-8");
    if (std::find(state_->specials.begin(), state_->specials.end(), s) == state_->specials.end())
      state_->specials.push_back(s);
  }
  state_->normalizer.load(json{{"type", "NFC"}}, "trainer normalizer");
  state_->pre_tokenizer.load(json::parse(pre_tokenizer_json().dump()), "trainer pre_tokenizer");
  std::vector<tok::AddedToken> toks;
  for (size_t i = 0; i < state_->specials.size(); ++i) {
    tok::AddedToken t;
    t.content = state_->specials[i];
    t.id = static_cast<int32_t>(i);
    t.special = true;
    t.normalized = false;
    toks.push_back(t);
  }
  state_->matcher.build(toks, state_->specials);
}
BpeTrainer::~BpeTrainer() = default;
BpeTrainer::BpeTrainer(BpeTrainer&&) noexcept = default;
BpeTrainer& BpeTrainer::operator=(BpeTrainer&&) noexcept = default;

void BpeTrainer::add_text(std::string_view text) {
  std::string repaired;
  if (!tok::is_valid_utf8(text)) repaired = tok::repair_utf8(text), text = repaired;
  // Special tokens in the text are cut out before counting, as the HF pipeline does at encode time.
  std::vector<tok::Segment> segs;
  state_->matcher.split(text, segs);
  std::string storage;
  for (const tok::Segment& s : segs)
    if (s.id < 0) state_->count(state_->normalizer.apply(text.substr(s.start, s.end - s.start), storage));
}

std::string BpeTrainer::train(int vocab_size) const {
  const State& st = *state_;
  const int n_special = static_cast<int>(st.specials.size());
  TITAN_CHECK(vocab_size >= 256 + n_special, "tokenizer train: --vocab-size ", vocab_size,
              " is smaller than the 256 byte tokens plus ", n_special, " special tokens");
  // Ids 0..255: the byte-level alphabet sorted by code point (as HF's trainer orders it).
  std::vector<std::pair<uint32_t, int>> alphabet;
  for (int b = 0; b < 256; ++b) alphabet.push_back({tok::byte_to_char(static_cast<uint8_t>(b)), b});
  std::sort(alphabet.begin(), alphabet.end());
  std::vector<std::string> tokens;
  int32_t byte_id[256];
  for (size_t i = 0; i < alphabet.size(); ++i) {
    tokens.push_back(tok::byte_level_char(static_cast<uint8_t>(alphabet[i].second)));
    byte_id[alphabet[i].second] = static_cast<int32_t>(i);
  }
  tok::StringIdMap token_ids;
  for (size_t i = 0; i < tokens.size(); ++i) token_ids.emplace(tokens[i], static_cast<int32_t>(i));

  // Words sorted for a deterministic order, as symbol sequences with their counts.
  std::vector<std::pair<std::string_view, int64_t>> sorted(st.words.begin(), st.words.end());
  std::sort(sorted.begin(), sorted.end());
  std::vector<std::vector<int32_t>> words(sorted.size());
  std::vector<int64_t> freq(sorted.size());
  auto key = [](int32_t a, int32_t b) { return (uint64_t(uint32_t(a)) << 32) | uint32_t(b); };
  std::unordered_map<uint64_t, int64_t> pair_count;
  std::unordered_map<uint64_t, std::vector<int32_t>> pair_words;
  for (size_t w = 0; w < sorted.size(); ++w) {
    freq[w] = sorted[w].second;
    for (unsigned char c : sorted[w].first) words[w].push_back(byte_id[c]);
    const auto& s = words[w];
    for (size_t i = 0; i + 1 < s.size(); ++i) {
      uint64_t k = key(s[i], s[i + 1]);
      pair_count[k] += freq[w];
      auto& list = pair_words[k];
      if (list.empty() || list.back() != static_cast<int32_t>(w)) list.push_back(static_cast<int32_t>(w));
    }
  }
  // Max-heap on (count, then smallest pair); entries go stale and are re-checked on pop.
  struct Cand {
    int64_t count;
    uint64_t pair;
    bool operator<(const Cand& o) const { return count != o.count ? count < o.count : pair > o.pair; }
  };
  std::priority_queue<Cand> heap;
  for (const auto& [k, c] : pair_count) heap.push({c, k});

  std::vector<std::pair<int32_t, int32_t>> merges;
  const size_t target = static_cast<size_t>(vocab_size - n_special);
  std::vector<int32_t> merged;
  while (tokens.size() < target && !heap.empty()) {
    Cand top = heap.top();
    heap.pop();
    auto pc = pair_count.find(top.pair);
    int64_t current = pc == pair_count.end() ? 0 : pc->second;
    if (current != top.count) {
      if (current > 0) heap.push({current, top.pair});
      continue;
    }
    if (current < 2) break;
    const int32_t a = static_cast<int32_t>(top.pair >> 32), b = static_cast<int32_t>(top.pair & 0xFFFFFFFFu);
    std::string text = tokens[a] + tokens[b];
    int32_t new_id;
    if (auto it = token_ids.find(text); it != token_ids.end()) {
      new_id = it->second;
    } else {
      new_id = static_cast<int32_t>(tokens.size());
      tokens.push_back(text);
      token_ids.emplace(text, new_id);
    }
    merges.push_back({a, b});
    std::vector<int32_t> affected = std::move(pair_words[top.pair]);
    pair_words.erase(top.pair);
    std::sort(affected.begin(), affected.end());
    affected.erase(std::unique(affected.begin(), affected.end()), affected.end());
    std::unordered_map<uint64_t, int64_t> delta;
    for (int32_t w : affected) {
      auto& s = words[w];
      merged.clear();
      for (size_t i = 0; i < s.size(); ++i) {
        if (i + 1 < s.size() && s[i] == a && s[i + 1] == b)
          merged.push_back(new_id), ++i;
        else
          merged.push_back(s[i]);
      }
      if (merged.size() == s.size()) continue;
      for (size_t i = 0; i + 1 < s.size(); ++i) delta[key(s[i], s[i + 1])] -= freq[w];
      for (size_t i = 0; i + 1 < merged.size(); ++i) {
        uint64_t k = key(merged[i], merged[i + 1]);
        delta[k] += freq[w];
        if (merged[i] == new_id || merged[i + 1] == new_id) pair_words[k].push_back(w);
      }
      s.swap(merged);
    }
    // Apply deltas in sorted order so the heap contents never depend on hash iteration order.
    std::vector<std::pair<uint64_t, int64_t>> changes(delta.begin(), delta.end());
    std::sort(changes.begin(), changes.end());
    for (auto [k, d] : changes) {
      if (d == 0) continue;
      int64_t& c = pair_count[k];
      c += d;
      if (c <= 0) {
        pair_count.erase(k);
        continue;
      }
      if (d > 0) heap.push({c, k});
    }
  }

  ordered_json vocab = ordered_json::object();
  for (size_t i = 0; i < tokens.size(); ++i) vocab[tokens[i]] = i;
  ordered_json merge_list = ordered_json::array();
  for (auto [a, b] : merges) merge_list.push_back(ordered_json::array({tokens[a], tokens[b]}));
  ordered_json added = ordered_json::array();
  for (int i = 0; i < n_special; ++i)
    added.push_back(ordered_json{{"id", tokens.size() + i},
                                 {"content", st.specials[i]},
                                 {"single_word", false},
                                 {"lstrip", false},
                                 {"rstrip", false},
                                 {"normalized", false},
                                 {"special", true}});
  ordered_json model{{"type", "BPE"},
                     {"dropout", nullptr},
                     {"unk_token", nullptr},
                     {"continuing_subword_prefix", ""},
                     {"end_of_word_suffix", ""},
                     {"fuse_unk", false},
                     {"byte_fallback", false},
                     {"ignore_merges", false},
                     {"vocab", vocab},
                     {"merges", merge_list}};
  ordered_json out{{"version", "1.0"},
                   {"truncation", nullptr},
                   {"padding", nullptr},
                   {"added_tokens", added},
                   {"normalizer", ordered_json{{"type", "NFC"}}},
                   {"pre_tokenizer", pre_tokenizer_json()},
                   {"post_processor", byte_level_json()},
                   {"decoder", byte_level_json()},
                   {"model", model}};
  return out.dump(1, ' ', false) + "\n";
}

std::string train_bpe(const std::vector<std::string>& files, int vocab_size,
                      std::vector<std::string> special_tokens) {
  TITAN_CHECK(!files.empty(), "tokenizer train: no input files");
  BpeTrainer trainer(std::move(special_tokens));
  for (const auto& f : files) {
    std::ifstream in(f, std::ios::binary);
    TITAN_CHECK(in.good(), "tokenizer train: cannot open '", f, "'");
    std::ostringstream ss;
    ss << in.rdbuf();
    trainer.add_text(ss.str());
  }
  return trainer.train(vocab_size);
}

}  // namespace titan
