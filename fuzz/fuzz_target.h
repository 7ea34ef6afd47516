// Shared by the fuzz targets (fuzz/README.md): each target is one LLVMFuzzerTestOneInput that feeds
// its input to one of titan's parsers the way titan reads that file, and accepts exactly one outcome
// besides success: a titan::Error whose message names the file (or template) the input stands for.
// Anything else -- another exception (a library's raw text), a crash, a sanitizer report, a hang or
// an allocation past the fuzzer's limit -- is a finding.
#pragma once
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>

#include "core/error.h"

namespace titan::fuzz {

// Runs `parse`; a titan::Error must name `must_name`, any other exception escapes (a finding).
template <class F>
void expect_clean_error(const std::string& must_name, F&& parse) {
  try {
    parse();
  } catch (const titan::Error& e) {
    const std::string_view m = e.what();
    if (m.find(must_name) == std::string_view::npos) {
      std::fprintf(stderr, "fuzz: error message does not name '%s': %s\n", must_name.c_str(), e.what());
      std::abort();
    }
  }
}

// A directory of this process's own for inputs that titan reads as files (removed at exit).
inline const std::filesystem::path& scratch_dir() {
  static const std::filesystem::path dir = [] {
    std::filesystem::path d =
        std::filesystem::temp_directory_path() / ("titan-fuzz-" + std::to_string(::getpid()));
    std::filesystem::create_directories(d);
    static struct Cleanup {
      std::filesystem::path d;
      ~Cleanup() {
        std::error_code ec;
        std::filesystem::remove_all(d, ec);
      }
    } cleanup{d};
    return d;
  }();
  return dir;
}

// Writes `bytes` to `relative` under the scratch directory; returns its path.
inline std::string write_scratch(const std::string& relative, std::string_view bytes) {
  const std::filesystem::path p = scratch_dir() / relative;
  std::filesystem::create_directories(p.parent_path());
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  f.close();
  if (!f) {
    std::fprintf(stderr, "fuzz: cannot write %s\n", p.c_str());
    std::abort();
  }
  return p.string();
}

inline std::string_view as_text(const uint8_t* data, size_t size) {
  return {reinterpret_cast<const char*>(data), size};
}

}  // namespace titan::fuzz
