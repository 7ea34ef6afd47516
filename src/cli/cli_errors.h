// Command-line mistakes reported like every other error: "titan <command>: error: <what>" on stderr (the
// app's name is "titan <command>") and a non-zero exit; --help still prints the help and exits 0.
#pragma once
#include <CLI/CLI.hpp>

#include <cstdio>

namespace titan::cli {

inline int exit_on_parse_error(const CLI::App& app, const CLI::ParseError& e) {
  if (e.get_exit_code() == 0) return const_cast<CLI::App&>(app).exit(e);  // --help, --version
  std::fprintf(stderr, "%s: error: %s (run with --help for the flags)\n", app.get_name().c_str(), e.what());
  return e.get_exit_code();
}

}  // namespace titan::cli
