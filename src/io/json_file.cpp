#include "io/json_file.h"

#include <fstream>

#include "core/error.h"

namespace titan {

nlohmann::json read_json_file(const std::string& path) {
  std::ifstream f(path);
  TITAN_CHECK(f, path, ": cannot open");
  try {
    return nlohmann::json::parse(f);
  } catch (const nlohmann::json::exception& e) {
    fail(path, ": not valid JSON (", e.what(), ")");
  }
}

}  // namespace titan
