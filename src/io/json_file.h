// Reading JSON files with errors that name the file (cannot open / not valid JSON).
#pragma once
#include <nlohmann/json.hpp>
#include <string>

namespace titan {

nlohmann::json read_json_file(const std::string& path);

}  // namespace titan
