// BPE model: loading vocab/merges from tokenizer.json and merging words by rank (see bpe.h).
#include "tokenizer/bpe.h"

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <queue>

#include "core/error.h"
#include "tokenizer/unicode.h"

namespace titan::tok {

namespace {
inline size_t hash_bytes(std::string_view s) {
  // Word-at-a-time multiply-xorshift hash: cheap for short tokens, good spread for open addressing.
  uint64_t h = 0xcbf29ce484222325ull ^ s.size();
  size_t i = 0;
  for (; i + 8 <= s.size(); i += 8) {
    uint64_t w;
    std::memcpy(&w, s.data() + i, 8);
    h = (h ^ w) * 0x100000001b3ull;
    h ^= h >> 29;
  }
  uint64_t tail = 0;
  std::memcpy(&tail, s.data() + i, s.size() - i);
  h = (h ^ tail) * 0x9E3779B97F4A7C15ull;
  return static_cast<size_t>(h ^ (h >> 32));
}

std::atomic<uint64_t> g_next_instance{1};

// Recently encoded words of the current thread (one model at a time; switching models clears
// it): open addressing on a 64-bit hash, keys and ids in flat arenas, cleared when half full.
struct WordCache {
  static constexpr size_t kSlots = 1 << 18;
  static constexpr size_t kMaxWordBytes = 256;
  struct Slot {
    uint64_t hash = 0;
    uint32_t key_off = 0, ids_off = 0;
    uint16_t key_len = 0, ids_len = 0;
    uint32_t generation = 0;  // the slot is live only when it equals the cache's generation
  };
  uint64_t owner = 0;
  uint32_t generation = 0;
  size_t used = 0;
  std::vector<Slot> slots;
  std::string keys;
  std::vector<int32_t> ids;
  // Empties the cache without touching the slots (a new generation), so alternating between
  // tokenizers on one thread stays cheap.
  void reset(uint64_t new_owner) {
    owner = new_owner;
    used = 0;
    if (slots.empty() || ++generation == 0) {
      slots.assign(kSlots, Slot{});
      generation = 1;
    }
    keys.clear();
    ids.clear();
  }
  // Returns the slot holding word, or the empty slot where it belongs.
  Slot& find(std::string_view word, uint64_t hash) {
    for (size_t h = hash & (kSlots - 1);; h = (h + 1) & (kSlots - 1)) {
      Slot& s = slots[h];
      if (s.generation != generation) return s;
      if (s.hash == hash && s.key_len == word.size() &&
          !std::memcmp(keys.data() + s.key_off, word.data(), word.size()))
        return s;
    }
  }
};
thread_local WordCache t_cache;
thread_local std::vector<int32_t> t_syms;
}  // namespace

void BpeModel::add_merge(int32_t left, int32_t right, int32_t rank, int32_t merged) {
  uint64_t key = (uint64_t(uint32_t(left)) << 32) | uint32_t(right);
  size_t mask = merges_.size() - 1;
  size_t h = (key * 0x9E3779B97F4A7C15ull) >> 20 & mask;
  while (merges_[h].key != kEmpty && merges_[h].key != key) h = (h + 1) & mask;
  if (merges_[h].key == key) return;  // a repeated merge keeps its first (best) rank, as HF does
  merges_[h] = MergeSlot{key, rank, merged};
}

int32_t BpeModel::find_token(std::string_view token) const {
  if (slots_.empty()) return -1;
  const size_t mask = slots_.size() - 1;
  const uint64_t hash = hash_bytes(token), tag = hash >> 32;
  for (size_t h = hash & mask;; h = (h + 1) & mask) {
    uint64_t v = slots_[h];
    if (v == ~uint64_t{0}) return -1;
    // The tag skips string compares (and their cache misses) for colliding entries.
    if ((v >> 32) == tag && id_to_token_[static_cast<uint32_t>(v)] == token) return static_cast<int32_t>(v);
  }
}

void BpeModel::load(const nlohmann::json& model, std::vector<std::pair<std::string, int64_t>>&& vocab,
                    const std::vector<std::pair<std::string, std::string>>& merges, const std::string& file) {
  instance_ = g_next_instance++;
  auto where = [&](const char* field) { return str_cat(file, ": model.", field); };
  int64_t max_id = -1;
  for (const auto& [tok, id] : vocab) max_id = std::max(max_id, id);
  id_to_token_.assign(static_cast<size_t>(max_id + 1), std::string());
  has_id_.assign(static_cast<size_t>(max_id + 1), 0);
  size_t cap = 16;
  while (cap < vocab.size() * 2) cap <<= 1;
  slots_.assign(cap, ~uint64_t{0});
  for (auto& [tok, id64] : vocab) {
    int32_t id = static_cast<int32_t>(id64);
    TITAN_CHECK(find_token(tok) < 0, where("vocab"), ": token '", tok, "' appears twice");
    TITAN_CHECK(!has_id_[id], where("vocab"), ": id ", id, " is used by '", id_to_token_[id], "' and '", tok,
                "'");
    const uint64_t hash = hash_bytes(tok);
    size_t h = hash & (cap - 1);
    while (slots_[h] != ~uint64_t{0}) h = (h + 1) & (cap - 1);
    slots_[h] = ((hash >> 32) << 32) | static_cast<uint32_t>(id);
    id_to_token_[id] = std::move(tok);
    has_id_[id] = 1;
  }

  auto opt_string = [&](const char* key) -> std::string {
    auto it = model.find(key);
    if (it == model.end() || it->is_null()) return "";
    TITAN_CHECK(it->is_string(), where(key), ": expected a string");
    return it->get<std::string>();
  };
  auto opt_bool = [&](const char* key) {
    auto it = model.find(key);
    if (it == model.end() || it->is_null()) return false;
    TITAN_CHECK(it->is_boolean(), where(key), ": expected a boolean");
    return it->get<bool>();
  };
  TITAN_CHECK(opt_string("continuing_subword_prefix").empty(), where("continuing_subword_prefix"),
              ": unsupported (only byte-level BPE without subword prefixes is supported)");
  TITAN_CHECK(opt_string("end_of_word_suffix").empty(), where("end_of_word_suffix"),
              ": unsupported (only byte-level BPE without word suffixes is supported)");
  if (auto it = model.find("dropout"); it != model.end() && !it->is_null()) {
    TITAN_CHECK(it->is_number() && it->get<double>() == 0.0, where("dropout"),
                ": BPE dropout is not supported (encoding must be deterministic)");
  }
  std::string unk = opt_string("unk_token");
  if (!unk.empty()) {
    int32_t id = find_token(unk);
    TITAN_CHECK(id >= 0, where("unk_token"), ": '", unk, "' is not in the vocab");
    unk_id_ = id;
  }
  fuse_unk_ = opt_bool("fuse_unk");
  byte_fallback_ = opt_bool("byte_fallback");
  ignore_merges_ = opt_bool("ignore_merges");

  cap = 16;
  while (cap < merges.size() * 2) cap <<= 1;
  merges_.assign(cap, MergeSlot{kEmpty, 0, 0});
  // Resolve merge strings to ids in parallel (read-only lookups), then fill the table in rank order.
  const long n_merges = static_cast<long>(merges.size());
  long merge_base = 0;
  if (n_merges > 0) {
    std::string first = merges[0].first + merges[0].second;
    merge_base = std::max(0, find_token(first));
  }
  std::vector<int32_t> left(n_merges), right(n_merges), result(n_merges);
#pragma omp parallel for schedule(static) if (n_merges > 10000)
  for (long rank = 0; rank < n_merges; ++rank) {
    const auto& [a, b] = merges[rank];
    left[rank] = find_token(a);
    right[rank] = find_token(b);
    if (left[rank] < 0 || right[rank] < 0) continue;  // reported below, in rank order
    // Trained vocabs usually give merge r the id (first merged id + r): check that slot first, a
    // sequential access, before hashing.
    const size_t guess = static_cast<size_t>(merge_base + rank);
    if (guess < id_to_token_.size() && has_id_[guess] && id_to_token_[guess].size() == a.size() + b.size() &&
        id_to_token_[guess].starts_with(a) && id_to_token_[guess].ends_with(b)) {
      result[rank] = static_cast<int32_t>(guess);
      continue;
    }
    std::string joined;
    joined.reserve(a.size() + b.size());
    joined.append(a).append(b);
    result[rank] = find_token(joined);
  }
  for (long rank = 0; rank < n_merges; ++rank) {
    const auto& [a, b] = merges[rank];
    TITAN_CHECK(left[rank] >= 0 && right[rank] >= 0, where("merges"), "[", rank, "]: token '",
                left[rank] < 0 ? a : b, "' is not in the vocab");
    TITAN_CHECK(result[rank] >= 0, where("merges"), "[", rank, "]: merged token '", a, b,
                "' is not in the vocab");
    add_merge(left[rank], right[rank], static_cast<int32_t>(rank), result[rank]);
  }
  for (int b = 0; b < 256; ++b) byte_ids_[b] = find_token(byte_level_char(static_cast<uint8_t>(b)));
}

std::optional<int32_t> BpeModel::token_to_id(std::string_view token) const {
  int32_t id = find_token(token);
  if (id < 0) return std::nullopt;
  return id;
}

const std::string* BpeModel::id_to_token(int32_t id) const {
  if (id < 0 || id >= static_cast<int32_t>(id_to_token_.size())) return nullptr;
  return has_id_[id] ? &id_to_token_[id] : nullptr;
}

// Initial symbols of a word: one per character (byte-level char when byte_level), with HF's
// byte_fallback / unk handling for characters missing from the vocab.
void BpeModel::initial_symbols(std::string_view word, bool byte_level, std::vector<int32_t>& syms) const {
  syms.clear();
  if (byte_level) {
    bool all = true;
    for (unsigned char c : word) {
      int32_t id = byte_ids_[c];
      if (id < 0) {
        all = false;
        break;
      }
      syms.push_back(id);
    }
    if (all) return;
    syms.clear();
  }
  std::string mapped;
  std::string_view text = word;
  if (byte_level) {
    mapped = to_byte_level(word);
    text = mapped;
  }
  bool pending_unk = false;
  for (size_t i = 0; i < text.size();) {
    size_t start = i;
    next_codepoint(text, i);
    std::string_view ch = text.substr(start, i - start);
    if (int32_t id = find_token(ch); id >= 0) {
      if (pending_unk) syms.push_back(*unk_id_), pending_unk = false;
      syms.push_back(id);
      continue;
    }
    if (byte_fallback_) {
      std::vector<int32_t> bytes;
      for (unsigned char b : ch) {
        char name[8];
        std::snprintf(name, sizeof name, "<0x%02X>", b);
        int32_t id = find_token(name);
        if (id < 0) break;
        bytes.push_back(id);
      }
      if (bytes.size() == ch.size()) {
        if (pending_unk) syms.push_back(*unk_id_), pending_unk = false;
        syms.insert(syms.end(), bytes.begin(), bytes.end());
        continue;
      }
    }
    if (unk_id_) {
      if (pending_unk && !fuse_unk_) syms.push_back(*unk_id_);
      pending_unk = true;
    }
  }
  if (pending_unk) syms.push_back(*unk_id_);
}

// Applies merges lowest rank first (leftmost among equal ranks), exactly like HF's Word::merge_all.
void BpeModel::merge_symbols(std::vector<int32_t>& syms) const {
  const size_t n = syms.size();
  if (n < 2) return;
  if (n <= 64) {
    // Short words: keep the rank of each adjacent pair; a merge re-ranks only its two neighbours.
    int32_t rank[64], merged[64];
    auto rank_pair = [&](size_t i) {
      const MergeSlot* m = find_merge(syms[i], syms[i + 1]);
      rank[i] = m ? m->rank : INT32_MAX;
      merged[i] = m ? m->merged : 0;
    };
    size_t len = n;
    for (size_t i = 0; i + 1 < len; ++i) rank_pair(i);
    while (len >= 2) {
      size_t best = 0;
      for (size_t i = 1; i + 1 < len; ++i)
        if (rank[i] < rank[best]) best = i;
      if (rank[best] == INT32_MAX) break;
      syms[best] = merged[best];
      for (size_t i = best + 1; i + 1 < len; ++i)
        syms[i] = syms[i + 1], rank[i] = rank[i + 1], merged[i] = merged[i + 1];
      --len;
      if (best > 0) rank_pair(best - 1);
      if (best + 1 < len) rank_pair(best);
    }
    syms.resize(len);
    return;
  }
  // Long words: a doubly linked list of symbols and a min-heap of candidate merges.
  std::vector<int32_t> prev(n), next(n);
  std::vector<uint8_t> alive(n, 1);
  for (size_t i = 0; i < n; ++i) prev[i] = static_cast<int32_t>(i) - 1, next[i] = i + 1 < n ? i + 1 : -1;
  struct Cand {
    int32_t rank, pos, left, right;
    bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> heap;
  auto push = [&](int32_t pos) {
    if (pos < 0 || next[pos] < 0) return;
    if (const MergeSlot* m = find_merge(syms[pos], syms[next[pos]]))
      heap.push({m->rank, pos, syms[pos], syms[next[pos]]});
  };
  for (size_t i = 0; i + 1 < n; ++i) push(static_cast<int32_t>(i));
  while (!heap.empty()) {
    Cand c = heap.top();
    heap.pop();
    if (!alive[c.pos] || next[c.pos] < 0) continue;
    int32_t r = next[c.pos];
    if (syms[c.pos] != c.left || syms[r] != c.right) continue;  // stale candidate
    syms[c.pos] = find_merge(c.left, c.right)->merged;
    alive[r] = 0;
    next[c.pos] = next[r];
    if (next[r] >= 0) prev[next[r]] = c.pos;
    push(prev[c.pos]);
    push(c.pos);
  }
  size_t k = 0;
  for (int32_t i = 0; i >= 0; i = next[i]) syms[k++] = syms[i];
  syms.resize(k);
}

void BpeModel::encode_word(std::string_view word, bool byte_level, std::vector<int32_t>& out) const {
  if (word.empty()) return;
  if (byte_level && word.size() == 1 && byte_ids_[static_cast<unsigned char>(word[0])] >= 0) {
    out.push_back(byte_ids_[static_cast<unsigned char>(word[0])]);
    return;
  }
  WordCache& cache = t_cache;
  if (cache.owner != instance_) cache.reset(instance_);
  const bool cacheable = word.size() <= WordCache::kMaxWordBytes;
  const uint64_t hash = cacheable ? hash_bytes(word) : 0;
  if (cacheable) {
    WordCache::Slot& slot = cache.find(word, hash);
    if (slot.generation == cache.generation) {
      out.insert(out.end(), cache.ids.begin() + slot.ids_off,
                 cache.ids.begin() + slot.ids_off + slot.ids_len);
      return;
    }
  }
  std::vector<int32_t>& syms = t_syms;
  bool whole = false;
  if (ignore_merges_) {
    // Words already in the vocab are emitted whole (Llama-3 style ignore_merges).
    int32_t id = byte_level ? find_token(to_byte_level(word)) : find_token(word);
    if (id >= 0) syms.assign(1, id), whole = true;
  }
  if (!whole) {
    initial_symbols(word, byte_level, syms);
    merge_symbols(syms);
  }
  out.insert(out.end(), syms.begin(), syms.end());
  if (cacheable) {
    if (cache.used * 2 >= WordCache::kSlots) cache.reset(instance_);
    WordCache::Slot& slot = cache.find(word, hash);
    slot = WordCache::Slot{hash,
                           static_cast<uint32_t>(cache.keys.size()),
                           static_cast<uint32_t>(cache.ids.size()),
                           static_cast<uint16_t>(word.size()),
                           static_cast<uint16_t>(syms.size()),
                           cache.generation};
    cache.keys.append(word);
    cache.ids.insert(cache.ids.end(), syms.begin(), syms.end());
    ++cache.used;
  }
}

}  // namespace titan::tok
