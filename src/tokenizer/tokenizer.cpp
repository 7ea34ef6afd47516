// Tokenizer: loading an HF tokenizer.json and running the pipeline
//   added tokens (raw) -> normalizer -> added tokens (normalized) -> pre-tokenizer -> BPE
//   -> post-processor (with add_special_tokens)
// and the reverse for decode (ids -> tokens -> decoder), as HF tokenizers does.
#include "tokenizer/tokenizer.h"

#include <deque>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <unordered_map>

#include "core/error.h"
#include "tokenizer/added_tokens.h"
#include "tokenizer/bpe.h"
#include "tokenizer/json_load.h"
#include "tokenizer/pipeline.h"
#include "tokenizer/unicode.h"

namespace titan {

using nlohmann::json;

struct Tokenizer::Impl {
  std::string file;
  tok::Normalizer normalizer;
  tok::PreTokenizer pre_tokenizer;
  tok::BpeModel model;
  tok::PostProcessor post_processor;
  tok::Decoder decoder;
  std::vector<tok::AddedToken> added;
  std::unordered_map<int32_t, size_t> added_by_id;  // id -> index into added
  tok::StringIdMap added_by_content;
  tok::AddedTokenMatcher raw_matcher, normalized_matcher;
  int32_t vocab_size = 0;
  std::optional<int32_t> eos;

  void encode_plain(std::string_view text, std::vector<int32_t>& out) const;
};

namespace {
std::string resolve_path(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::is_directory(path, ec)) return (fs::path(path) / "tokenizer.json").string();
  return path;
}

std::string read_file(const std::string& file) {
  std::ifstream in(file, std::ios::binary);
  TITAN_CHECK(in.good(), "tokenizer: cannot open '", file, "'");
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

tok::AddedToken parse_added_token(const json& j, const std::string& where) {
  TITAN_CHECK(j.is_object(), where, ": expected an object");
  tok::AddedToken t;
  auto c = j.find("content");
  TITAN_CHECK(c != j.end() && c->is_string(), where, ".content: missing or not a string");
  t.content = c->get<std::string>();
  auto id = j.find("id");
  TITAN_CHECK(id != j.end() && id->is_number_integer() && id->get<int64_t>() >= 0, where,
              ".id: missing or not a non-negative integer");
  t.id = id->get<int32_t>();
  auto flag = [&](const char* key, bool def) {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) return def;
    TITAN_CHECK(it->is_boolean(), where, ".", key, ": expected a boolean");
    return it->get<bool>();
  };
  t.special = flag("special", false);
  t.single_word = flag("single_word", false);
  t.lstrip = flag("lstrip", false);
  t.rstrip = flag("rstrip", false);
  t.normalized = flag("normalized", !t.special);
  return t;
}
}  // namespace

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::load(const std::string& path) {
  auto impl = std::make_unique<Impl>();
  const std::string file = resolve_path(path);
  impl->file = file;
  std::string text = read_file(file);
  tok::TokenizerFile parsed = tok::parse_tokenizer_file(text, file);
  std::string().swap(text);
  const json& j = parsed.rest;
  TITAN_CHECK(j.is_object(), "tokenizer: '", file, "': expected a JSON object at the top level");
  try {
    auto section = [&](const char* key) -> const json& {
      static const json null_json;
      auto it = j.find(key);
      return it == j.end() ? null_json : *it;
    };
    const json& model = section("model");
    TITAN_CHECK(model.is_object(), file, ": model: missing or not an object");
    std::string type = model.contains("type") && model["type"].is_string() ? model["type"].get<std::string>()
                       : parsed.has_merges                                 ? "BPE"
                                                                           : "";
    TITAN_CHECK(type == "BPE", file, ": model.type: unsupported model type '", type,
                "' (only BPE is supported)");
    TITAN_CHECK(parsed.has_vocab, file, ": model.vocab: missing");
    TITAN_CHECK(parsed.has_merges, file, ": model.merges: missing");
    impl->model.load(model, std::move(parsed.vocab), parsed.merges, file);
    impl->normalizer.load(section("normalizer"), file + ": normalizer");
    impl->pre_tokenizer.load(section("pre_tokenizer"), file + ": pre_tokenizer");
    impl->post_processor.load(section("post_processor"), file + ": post_processor");
    impl->decoder.load(section("decoder"), file + ": decoder");

    const json& added = section("added_tokens");
    TITAN_CHECK(added.is_null() || added.is_array(), file, ": added_tokens: expected an array");
    int32_t max_id = impl->model.max_id();
    for (size_t i = 0; !added.is_null() && i < added.size(); ++i) {
      tok::AddedToken t = parse_added_token(added[i], str_cat(file, ": added_tokens[", i, "]"));
      if (t.content.empty()) continue;
      max_id = std::max(max_id, t.id);
      impl->added_by_id[t.id] = impl->added.size();
      impl->added_by_content[t.content] = t.id;
      impl->added.push_back(std::move(t));
    }
    impl->vocab_size = max_id + 1;
    // Two matchers as in HF: raw-input tokens, and normalized tokens (patterns normalized too).
    std::vector<tok::AddedToken> raw, norm;
    std::vector<std::string> raw_pat, norm_pat;
    for (const auto& t : impl->added) {
      if (t.normalized) {
        std::string storage;
        norm_pat.emplace_back(impl->normalizer.apply(t.content, storage));
        norm.push_back(t);
      } else {
        raw_pat.push_back(t.content);
        raw.push_back(t);
      }
    }
    impl->raw_matcher.build(std::move(raw), raw_pat);
    impl->normalized_matcher.build(std::move(norm), norm_pat);
  } catch (const json::exception& e) {
    fail("tokenizer: '", file, "': malformed field: ", e.what());
  }
  for (const char* name : {"<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>"}) {
    auto it = impl->added_by_content.find(std::string_view(name));
    if (it != impl->added_by_content.end()) {
      impl->eos = it->second;
      break;
    }
    if (auto id = impl->model.token_to_id(name)) {
      impl->eos = id;
      break;
    }
  }
  return Tokenizer(std::move(impl));
}

namespace {
struct Scratch {
  std::vector<tok::Segment> raw_segments, norm_segments;
  std::vector<std::string_view> words;
  std::deque<std::string> arena;
  std::string normalized;
};
thread_local Scratch t_scratch;
}  // namespace

// Text with no added tokens in it: pre-tokenize and run the model on each word.
void Tokenizer::Impl::encode_plain(std::string_view text, std::vector<int32_t>& out) const {
  Scratch& s = t_scratch;
  pre_tokenizer.apply(text, s.words, s.arena);
  const bool byte_level = pre_tokenizer.byte_level();
  for (std::string_view w : s.words) model.encode_word(w, byte_level, out);
  s.arena.clear();
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special_tokens) const {
  std::string repaired;
  if (!tok::is_valid_utf8(text)) {
    repaired = tok::repair_utf8(text);
    text = repaired;
  }
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 4);
  const Impl& im = *impl_;
  // Per-thread scratch: no allocations per call once warm (encode_plain uses other fields).
  Scratch& s = t_scratch;
  std::vector<tok::Segment>& raw_segments = s.raw_segments;
  raw_segments.clear();
  if (im.raw_matcher.empty()) {
    if (!text.empty()) raw_segments.push_back({0, text.size(), -1});
  } else {
    im.raw_matcher.split(text, raw_segments);
  }
  for (const tok::Segment& seg : raw_segments) {
    if (seg.id >= 0) {
      out.push_back(seg.id);
      continue;
    }
    std::string_view piece = text.substr(seg.start, seg.end - seg.start);
    std::string_view norm = im.normalizer.empty() ? piece : im.normalizer.apply(piece, s.normalized);
    if (im.normalized_matcher.empty()) {
      im.encode_plain(norm, out);
      continue;
    }
    im.normalized_matcher.split(norm, s.norm_segments);
    for (const tok::Segment& ns : s.norm_segments) {
      if (ns.id >= 0)
        out.push_back(ns.id);
      else
        im.encode_plain(norm.substr(ns.start, ns.end - ns.start), out);
    }
  }
  if (add_special_tokens) im.post_processor.apply(out);
  return out;
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  const Impl& im = *impl_;
  std::vector<const std::string*> tokens;
  tokens.reserve(ids.size());
  for (int32_t id : ids) {
    // HF looks up added tokens first, then the model; unknown ids are dropped.
    auto it = im.added_by_id.find(id);
    if (it != im.added_by_id.end()) {
      const tok::AddedToken& t = im.added[it->second];
      if (!(skip_special_tokens && t.special)) tokens.push_back(&t.content);
      continue;
    }
    if (const std::string* t = im.model.id_to_token(id)) tokens.push_back(t);
  }
  return im.decoder.apply(tokens);
}

std::string Tokenizer::token_bytes(int32_t id) const {
  const Impl& im = *impl_;
  auto it = im.added_by_id.find(id);
  if (it != im.added_by_id.end()) return im.added[it->second].content;
  const std::string* t = im.model.id_to_token(id);
  return t ? im.decoder.raw_bytes({t}) : std::string();
}

int32_t Tokenizer::vocab_size() const {
  return impl_->vocab_size;
}

std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const {
  auto it = impl_->added_by_content.find(token);
  if (it != impl_->added_by_content.end()) return it->second;
  return impl_->model.token_to_id(token);
}

std::optional<int32_t> Tokenizer::eos_id() const {
  return impl_->eos;
}

}  // namespace titan
