// Reading JSON from files and records that come from outside (configs, checkpoint metadata, chat data,
// safetensors headers): errors name the file (cannot open / not valid JSON), and nesting is bounded so
// that no input can exhaust the stack of a later recursive walk (printing a value, the chat template's
// conversion of a record).
#pragma once
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

namespace titan {

// Deeper than any configuration, metadata or conversation (tool schemas nest ~10 levels); far below
// what a recursive walk of the value needs stack for.
constexpr int kMaxJsonDepth = 512;

// Parses `text`; `where` (a file, "file:line") starts every error: "<where>: not valid JSON: ..." or
// "<where>: JSON nested deeper than 512 levels".
nlohmann::json parse_json(std::string_view text, const std::string& where);
nlohmann::ordered_json parse_ordered_json(std::string_view text, const std::string& where);

nlohmann::json read_json_file(const std::string& path);

}  // namespace titan
