#include "io/json_file.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "core/error.h"

namespace titan {

namespace {

// nlohmann's message without its "[json.exception.parse_error.101] " tag.
std::string parse_message(const nlohmann::json::exception& e) {
  std::string m = e.what();
  if (!m.empty() && m[0] == '[') {
    const size_t close = m.find("] ");
    if (close != std::string::npos) m.erase(0, close + 2);
  }
  return m;
}

template <class Json>
Json parse_bounded(std::string_view text, const std::string& where) {
  // The callback sees every value with its depth; a start event past the bound stops the parse before
  // anything deeper is built.
  auto bound = [&](int depth, typename Json::parse_event_t event, Json&) {
    if ((event == Json::parse_event_t::object_start || event == Json::parse_event_t::array_start) &&
        depth >= kMaxJsonDepth)
      fail(where, ": JSON nested deeper than ", kMaxJsonDepth, " levels");
    return true;
  };
  try {
    return Json::parse(text.begin(), text.end(), bound);
  } catch (const nlohmann::json::exception& e) {
    fail(where, ": not valid JSON: ", parse_message(e));
  }
}

}  // namespace

nlohmann::json parse_json(std::string_view text, const std::string& where) {
  return parse_bounded<nlohmann::json>(text, where);
}

nlohmann::ordered_json parse_ordered_json(std::string_view text, const std::string& where) {
  return parse_bounded<nlohmann::ordered_json>(text, where);
}

nlohmann::json read_json_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  TITAN_CHECK(f, path, ": cannot open (", std::strerror(errno), ")");
  std::ostringstream text;
  text << f.rdbuf();
  TITAN_CHECK(!f.bad(), path, ": read failed (", std::strerror(errno), ")");
  return parse_json(text.str(), path);
}

}  // namespace titan
