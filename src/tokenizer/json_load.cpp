// SAX reader for tokenizer.json (see json_load.h).
#include "tokenizer/json_load.h"

#include "core/error.h"

namespace titan::tok {

using nlohmann::json;

namespace {
class Reader : public nlohmann::json_sax<json> {
 public:
  Reader(TokenizerFile& out, const std::string& file) : out_(out), file_(file) {}
  std::string error;  // first semantic error (field-level), reported after parsing

  bool null() override { return value(json(nullptr)); }
  bool boolean(bool v) override { return value(json(v)); }
  bool number_integer(number_integer_t v) override {
    if (mode_ == kVocab) return vocab_id(v);
    return value(json(v));
  }
  bool number_unsigned(number_unsigned_t v) override {
    if (mode_ == kVocab) return vocab_id(v <= INT64_MAX ? static_cast<int64_t>(v) : -1);
    return value(json(v));
  }
  bool number_float(number_float_t v, const string_t&) override { return value(json(v)); }
  bool binary(binary_t&) override { return bad("unexpected binary value"); }
  bool string(string_t& s) override {
    if (mode_ == kMerges) {
      if (merge_depth_ == 1) {
        size_t sp = s.find(' ');
        if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos)
          return bad(
              str_cat("model.merges[", out_.merges.size(), "]: expected \"left right\", got \"", s, "\""));
        out_.merges.emplace_back(s.substr(0, sp), s.substr(sp + 1));
        return true;
      }
      if (merge_depth_ == 2 && pair_.size() < 2) {
        pair_.push_back(std::move(s));
        return true;
      }
      return bad(str_cat("model.merges[", out_.merges.size(), "]: expected a pair of strings"));
    }
    return value(json(std::move(s)));
  }
  bool start_object(std::size_t) override {
    if (mode_ == kVocab) {
      if (++vocab_depth_ == 1) return true;
      return bad("model.vocab: ids must be integers");
    }
    if (mode_ == kMerges)
      return bad(str_cat("model.merges[", out_.merges.size(), "]: expected a pair of strings"));
    return open(json::object());
  }
  bool key(string_t& k) override {
    if (mode_ == kVocab) {
      key_ = std::move(k);
      return true;
    }
    // model.vocab / model.merges: the object at depth 2 reached through the root key "model".
    if (stack_.size() == 2 && path_.size() == 2 && path_[1] == "model") {
      if (k == "vocab" || k == "merges") {
        pending_ = k == "vocab" ? kVocab : kMerges;
        return true;
      }
    }
    key_ = std::move(k);
    return true;
  }
  bool end_object() override {
    if (mode_ == kVocab) {
      mode_ = kDom;
      out_.has_vocab = true;
      return true;
    }
    stack_.pop_back();
    path_.pop_back();
    return true;
  }
  bool start_array(std::size_t) override {
    if (pending_ == kMerges) {
      pending_ = kDom;
      mode_ = kMerges;
      merge_depth_ = 1;
      return true;
    }
    if (mode_ == kMerges) {
      if (merge_depth_ != 1)
        return bad(str_cat("model.merges[", out_.merges.size(), "]: expected a pair of strings"));
      merge_depth_ = 2;
      pair_.clear();
      return true;
    }
    if (mode_ == kVocab) return bad("model.vocab: ids must be integers");
    return open(json::array());
  }
  bool end_array() override {
    if (mode_ == kMerges) {
      if (merge_depth_ == 2) {
        if (pair_.size() != 2)
          return bad(str_cat("model.merges[", out_.merges.size(), "]: expected a pair of strings"));
        out_.merges.emplace_back(std::move(pair_[0]), std::move(pair_[1]));
        merge_depth_ = 1;
        return true;
      }
      mode_ = kDom;
      out_.has_merges = true;
      return true;
    }
    stack_.pop_back();
    path_.pop_back();
    return true;
  }
  bool parse_error(std::size_t pos, const std::string&, const nlohmann::detail::exception& e) override {
    fail("tokenizer: '", file_, "' is not valid JSON (byte ", pos, "): ", e.what());
  }

 private:
  enum Mode { kDom, kVocab, kMerges };
  bool bad(std::string msg) {
    if (error.empty()) error = std::move(msg);
    return false;
  }
  bool vocab_id(int64_t id) {
    if (id < 0 || id >= INT32_MAX)
      return bad(str_cat("model.vocab: id ", id, " of '", key_, "' out of range"));
    out_.vocab.emplace_back(std::move(key_), id);
    return true;
  }
  // Places v in the tree (root, array element or object member) and returns where it went.
  json* place(json&& v) {
    if (stack_.empty()) {
      out_.rest = std::move(v);
      return &out_.rest;
    }
    json& top = *stack_.back();
    if (top.is_array()) {
      top.push_back(std::move(v));
      return &top.back();
    }
    json& slot = top[key_];
    slot = std::move(v);
    return &slot;
  }
  bool value(json&& v) {
    if (pending_ == kVocab) return bad("model.vocab: expected an object of token -> id");
    if (pending_ == kMerges) return bad("model.merges: expected an array");
    if (mode_ == kVocab) return bad(str_cat("model.vocab: id of '", key_, "' is not an integer"));
    if (mode_ == kMerges)
      return bad(str_cat("model.merges[", out_.merges.size(), "]: expected a pair of strings"));
    place(std::move(v));
    return true;
  }
  bool open(json&& v) {
    if (pending_ == kVocab) {
      if (!v.is_object()) return bad("model.vocab: expected an object of token -> id");
      pending_ = kDom;
      mode_ = kVocab;
      vocab_depth_ = 0;
      return start_object(0);
    }
    if (pending_ == kMerges) return bad("model.merges: expected an array");
    std::string name = stack_.empty() || stack_.back()->is_array() ? std::string() : key_;
    stack_.push_back(place(std::move(v)));
    path_.push_back(std::move(name));
    return true;
  }

  TokenizerFile& out_;
  const std::string& file_;
  std::vector<json*> stack_;
  std::vector<std::string> path_;  // member name of each open container ("" for the root/arrays)
  std::string key_;
  Mode mode_ = kDom, pending_ = kDom;
  int vocab_depth_ = 0, merge_depth_ = 0;
  std::vector<std::string> pair_;
};
}  // namespace

TokenizerFile parse_tokenizer_file(const std::string& text, const std::string& file) {
  TokenizerFile out;
  Reader reader(out, file);
  bool ok = json::sax_parse(text, &reader);
  if (!ok) {
    if (!reader.error.empty()) fail(file, ": ", reader.error);
    fail("tokenizer: '", file, "' is not valid JSON");
  }
  return out;
}

}  // namespace titan::tok
