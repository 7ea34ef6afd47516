// The fuzz targets' driver in a build without libFuzzer (any compiler): runs every seed input, then a
// fixed number of deterministic mutations of them (bit flips, interesting bytes, deletions,
// duplications, splices of two seeds, truncations), so the suite keeps each target building and
// passing on its corpus. The real search is libFuzzer's (-DTITAN_FUZZ=ON, scripts/fuzz.sh).
//
//   fuzz_<target> [-runs=N] [-seed=S] CORPUS_DIR_OR_FILE...
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

// The input being run, so that a crash can name it (written from the signal handler: write() only).
const std::string* g_current = nullptr;
char g_label[128] = "";

void report_and_die(int sig) {
  const char* head = "\nfuzz replay: the input below ended the process (";
  (void)!write(2, head, std::strlen(head));
  (void)!write(2, g_label, std::strlen(g_label));
  (void)!write(2, "), bytes as hex:\n", 17);
  if (g_current) {
    static const char hex[] = "0123456789abcdef";
    for (size_t i = 0; i < g_current->size() && i < 4096; ++i) {
      const unsigned char c = static_cast<unsigned char>((*g_current)[i]);
      const char pair[2] = {hex[c >> 4], hex[c & 15]};
      (void)!write(2, pair, 2);
    }
    (void)!write(2, "\n", 1);
  }
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

struct Rng {
  uint64_t s;
  uint64_t next() {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    return s;
  }
  size_t below(size_t n) { return n ? next() % n : 0; }
};

std::string mutate(const std::string& in, const std::vector<std::string>& seeds, Rng& rng) {
  static const char kInteresting[] = {'\0', '\xff', '"',  '\\',   '{',    '}',  '[', ']', ':', ',', '-',
                                      '9',  '%',    '\n', '\x80', '\xc3', '\'', '.', 'e', '0', '='};
  std::string s = in;
  const int edits = 1 + static_cast<int>(rng.below(4));
  for (int k = 0; k < edits; ++k) {
    const size_t n = s.size();
    switch (rng.below(7)) {
      case 0:
        if (n) s[rng.below(n)] ^= static_cast<char>(1u << rng.below(8));
        break;
      case 1:
        if (n) s[rng.below(n)] = kInteresting[rng.below(sizeof kInteresting)];
        break;
      case 2:
        s.insert(s.begin() + static_cast<std::ptrdiff_t>(rng.below(n + 1)),
                 kInteresting[rng.below(sizeof kInteresting)]);
        break;
      case 3:
        if (n) {
          const size_t at = rng.below(n);
          s.erase(at, 1 + rng.below(std::min<size_t>(n - at, 64)));
        }
        break;
      case 4:
        if (n) {
          const size_t at = rng.below(n), len = 1 + rng.below(std::min<size_t>(n - at, 64));
          s.insert(rng.below(n + 1), s.substr(at, len));
        }
        break;
      case 5: {
        const std::string& other = seeds[rng.below(seeds.size())];
        if (!other.empty()) {
          const size_t at = rng.below(other.size()),
                       len = 1 + rng.below(std::min<size_t>(other.size() - at, 256));
          s.insert(rng.below(n + 1), other.substr(at, len));
        }
        break;
      }
      case 6:
        if (n) s.resize(rng.below(n));
        break;
    }
  }
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  long runs = 2000;
  uint64_t seed = 1;
  std::vector<std::string> paths;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("-runs=", 0) == 0)
      runs = std::strtol(a.c_str() + 6, nullptr, 10);
    else if (a.rfind("-seed=", 0) == 0)
      seed = std::strtoull(a.c_str() + 6, nullptr, 10);
    else
      paths.push_back(a);
  }
  std::vector<std::string> seeds;
  for (const auto& p : paths) {
    std::vector<std::filesystem::path> files;
    if (std::filesystem::is_directory(p)) {
      for (const auto& e : std::filesystem::directory_iterator(p))
        if (e.is_regular_file()) files.push_back(e.path());
    } else {
      files.push_back(p);
    }
    std::sort(files.begin(), files.end());
    for (const auto& f : files) {
      std::ifstream in(f, std::ios::binary);
      if (!in) {
        std::fprintf(stderr, "fuzz replay: cannot read %s\n", f.c_str());
        return 2;
      }
      seeds.emplace_back(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
    }
  }
  if (seeds.empty()) {
    std::fprintf(stderr, "usage: %s [-runs=N] [-seed=S] CORPUS_DIR_OR_FILE...\n", argv[0]);
    return 2;
  }
  for (int sig : {SIGABRT, SIGSEGV, SIGBUS, SIGFPE, SIGILL}) std::signal(sig, report_and_die);
  auto run = [&](const std::string& input) {
    g_current = &input;
    LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(input.data()), input.size());
  };
  for (size_t i = 0; i < seeds.size(); ++i) {
    std::snprintf(g_label, sizeof g_label, "seed %zu", i);
    run(seeds[i]);
  }
  Rng rng{seed * 0x9E3779B97F4A7C15ull + 1};
  for (long r = 0; r < runs; ++r) {
    std::snprintf(g_label, sizeof g_label, "mutation %ld of seed run -seed=%llu", r,
                  static_cast<unsigned long long>(seed));
    run(mutate(seeds[rng.below(seeds.size())], seeds, rng));
  }
  std::printf("%s: %zu seeds and %ld mutations ran, no finding\n", argv[0], seeds.size(), runs);
  return 0;
}
