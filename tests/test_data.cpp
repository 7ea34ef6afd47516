// Data pipeline: readers, packing, shuffling, data-parallel sharding, resumable state, validation
// split, token shards, `titan data prepare`, and bad input.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "core/error.h"
#include "data/encoder.h"
#include "data/loader.h"
#include "data/prepare.h"
#include "data/shuffle.h"
#include "data/sources.h"
#include "data/text_reader.h"
#include "data/token_shard.h"
#include "data/utf8.h"
#include "tokenizer/tokenizer.h"

namespace fs = std::filesystem;
using namespace titan::data;
using Ids = std::vector<int32_t>;

namespace {

class DataTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() / ("titan_test_data_" + std::to_string(::getpid()) + "_" + info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  std::string write(const std::string& name, const std::string& content) const {
    const fs::path p = dir_ / name;
    fs::create_directories(p.parent_path());
    std::ofstream(p, std::ios::binary) << content;
    return p.string();
  }

  DataConfig config(std::vector<std::string> sources, int64_t seq_len = 8, int64_t batch = 2) {
    DataConfig c;
    c.sources = std::move(sources);
    c.seq_len = seq_len;
    c.batch_size = batch;
    c.shuffle = false;
    c.on_warning = [this](const std::string& w) { warnings_.push_back(w); };
    return c;
  }

  fs::path dir_;
  std::vector<std::string> warnings_;
};

// Windows (input_ids + last label, seq_len + 1 tokens each) of the next `steps` batches.
std::vector<Ids> read_windows(DataLoader& loader, int steps) {
  std::vector<Ids> windows;
  Batch batch;
  for (int s = 0; s < steps; ++s) {
    if (!loader.next_batch(batch)) break;
    const auto L = static_cast<size_t>(batch.seq_len);
    for (int64_t b = 0; b < batch.batch_size; ++b) {
      const int32_t* in = batch.input_ids.data() + b * L;
      const int32_t* lab = batch.labels.data() + b * L;
      for (size_t t = 0; t + 1 < L; ++t) EXPECT_EQ(lab[t], in[t + 1]) << "labels are the next tokens";
      Ids w(in, in + L);
      w.push_back(lab[L - 1]);
      windows.push_back(std::move(w));
    }
  }
  return windows;
}

Ids concat(const std::vector<Ids>& windows) {
  Ids out;
  for (const auto& w : windows) out.insert(out.end(), w.begin(), w.end());
  return out;
}

Ids bytes_of(const std::string& s) {
  Ids out;
  for (unsigned char c : s) out.push_back(c);
  return out;
}

// The packed stream of documents: each followed by EOS (256 with the byte encoder).
Ids packed(const std::vector<std::string>& docs, int repeats = 1) {
  Ids out;
  for (int r = 0; r < repeats; ++r)
    for (const auto& d : docs) {
      const Ids b = bytes_of(d);
      out.insert(out.end(), b.begin(), b.end());
      out.push_back(256);
    }
  return out;
}

std::vector<std::string> read_pieces(const std::string& file, FileFormat format, TextReaderOptions o) {
  TextFileReader reader(file, format, o);
  std::vector<std::string> docs;
  std::string current;
  TextPiece piece;
  while (reader.next(piece)) {
    current += piece.text;
    if (piece.ends_document) docs.push_back(std::move(current)), current.clear();
  }
  return docs;
}

// A token dataset whose token ids are unique across documents (EOS = 0 aside): doc i holds
// `len(i)` ids starting at 1 + 1000 * i.
std::string write_unique_token_dataset(const fs::path& dir, int docs, int docs_per_shard) {
  fs::create_directories(dir);
  TokenIndex index;
  index.vocab_size = 1000 * docs + 1000;
  index.eos_id = 0;
  for (int s = 0; s * docs_per_shard < docs; ++s) {
    const std::string name = "shard_" + std::to_string(s) + ".bin";
    ShardWriter w((dir / name).string(), index.vocab_size, index.eos_id);
    for (int i = s * docs_per_shard; i < std::min(docs, (s + 1) * docs_per_shard); ++i) {
      Ids doc;
      for (int j = 0; j < 3 + (i * 7) % 11; ++j) doc.push_back(1 + 1000 * i + j);
      w.add_document(doc);
    }
    w.finish();
    index.shards.push_back({name, w.num_tokens(), w.num_docs()});
  }
  write_token_index(dir.string(), index);
  return dir.string();
}

// The document (id / 1000) a window's first non-EOS token belongs to; -1 when all EOS.
std::multiset<Ids> as_multiset(const std::vector<Ids>& v) {
  return {v.begin(), v.end()};
}

int run_titan(const std::string& args, std::string* output = nullptr) {
  const std::string cmd = std::string(TITAN_BINARY) + " " + args + " 2>&1";
  FILE* p = ::popen(cmd.c_str(), "r");
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int status = ::pclose(p);
  if (output) *output = out;
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const titan::Error& e) {
    return e.what();
  }
  return "<no titan::Error thrown>";
}

}  // namespace

// ---------------------------------------------------------------- determinism primitives

TEST(DataShuffle, FeistelIsAPermutation) {
  for (uint64_t n : {0ull, 1ull, 2ull, 3ull, 10ull, 17ull, 1000ull, 4097ull}) {
    FeistelPermutation p(n, 42);
    std::vector<bool> seen(n, false);
    for (uint64_t i = 0; i < n; ++i) {
      const uint64_t j = p(i);
      ASSERT_LT(j, n);
      ASSERT_FALSE(seen[j]) << "n=" << n;
      seen[j] = true;
    }
  }
  // A different key gives a different order; the same key the same order.
  FeistelPermutation a(1000, 1), b(1000, 2), c(1000, 1);
  int same = 0;
  for (uint64_t i = 0; i < 1000; ++i) {
    same += a(i) == b(i);
    EXPECT_EQ(a(i), c(i));
  }
  EXPECT_LT(same, 20);
}

TEST(DataShuffle, SeededShuffleIsPinned) {
  // std::mt19937_64 is fixed by the standard and the uniform mapping is ours: this order must be
  // the same on every platform and standard library.
  std::vector<int> v(10);
  for (int i = 0; i < 10; ++i) v[i] = i;
  seeded_shuffle(v, 7);
  std::vector<int> sorted = v;
  std::sort(sorted.begin(), sorted.end());
  for (int i = 0; i < 10; ++i) EXPECT_EQ(sorted[i], i);
  std::mt19937_64 rng(5489);
  EXPECT_EQ(rng(), 14514284786278117030ull);  // the standard's 1st output for the default seed
  std::string order;
  for (int x : v) order += std::to_string(x);
  EXPECT_EQ(order, "0749312865");
}

// ---------------------------------------------------------------- UTF-8

TEST(DataUtf8, ReplacesMaximalInvalidSubparts) {
  size_t n = 0;
  EXPECT_EQ(sanitize_utf8("h\xC3\xA9llo \xE2\x82\xAC \xF0\x9F\x98\x80", &n),
            "h\xC3\xA9llo \xE2\x82\xAC \xF0\x9F\x98\x80");
  EXPECT_EQ(n, 0u);
  EXPECT_EQ(sanitize_utf8("a\xFF"
                          "b",
                          &n),
            "a\xEF\xBF\xBD"
            "b");
  EXPECT_EQ(n, 1u);
  n = 0;
  EXPECT_EQ(sanitize_utf8("x\xE2\x82", &n), "x\xEF\xBF\xBD");  // truncated sequence: one U+FFFD
  EXPECT_EQ(n, 1u);
  n = 0;
  EXPECT_EQ(sanitize_utf8("\xC0\xAF", &n), "\xEF\xBF\xBD\xEF\xBF\xBD");  // overlong
  EXPECT_EQ(n, 2u);
  n = 0;
  sanitize_utf8("\xED\xA0\x80", &n);  // surrogate
  EXPECT_EQ(n, 3u);
  EXPECT_EQ(utf8_boundary_before("a\xE2\x82\xAC", 2), 1u);
  EXPECT_EQ(utf8_boundary_before("a\xE2\x82\xAC", 1), 1u);
}

// ---------------------------------------------------------------- text readers

TEST_F(DataTest, PercentDelimitedRecords) {
  const std::string f = write("fortunes", "first\n%\nsecond\nline two\n%\n%\n  \n%\nlast one\n%");
  TextReaderOptions o;
  o.delimiter = DocDelimiter::Percent;
  EXPECT_EQ(read_pieces(f, FileFormat::Text, o),
            (std::vector<std::string>{"first", "second\nline two", "last one"}));
  // Not a delimiter: '%' inside a line, or a line with more than '%'.
  const std::string g = write("g", "50% off\n%%\n%\nnext\n");
  EXPECT_EQ(read_pieces(g, FileFormat::Text, o), (std::vector<std::string>{"50% off\n%%", "next"}));
}

TEST_F(DataTest, BlankLineAndWholeFileDocuments) {
  const std::string f = write("paras.txt", "p1 a\np1 b\n\n\n \t\np2\r\n\r\np3");
  TextReaderOptions o;
  o.delimiter = DocDelimiter::BlankLine;
  EXPECT_EQ(read_pieces(f, FileFormat::Text, o), (std::vector<std::string>{"p1 a\np1 b", "p2", "p3"}));
  o.delimiter = DocDelimiter::File;
  EXPECT_EQ(read_pieces(f, FileFormat::Text, o),
            (std::vector<std::string>{"p1 a\np1 b\n\n\n \t\np2\r\n\r\np3"}));
}

TEST_F(DataTest, LargeDocumentsArriveInPiecesAtUtf8Boundaries) {
  // A file much larger than the read buffer and the piece limit: pieces rejoin into the document.
  std::string text;
  for (int i = 0; text.size() < 200000; ++i)
    text += "line " + std::to_string(i) + " \xE2\x82\xAC\xC3\xA9" + (i % 7 ? " " : "\n");
  const std::string f = write("big.txt", text);
  TextReaderOptions o;
  o.buffer_bytes = 64;
  o.max_piece_bytes = 1000;
  TextFileReader reader(f, FileFormat::Text, o);
  TextPiece piece;
  std::string joined;
  int pieces = 0;
  while (reader.next(piece)) {
    ++pieces;
    EXPECT_LE(piece.text.size(), 1008u);
    size_t bad = 0;
    sanitize_utf8(piece.text, &bad);
    EXPECT_EQ(bad, 0u) << "piece cut inside a UTF-8 sequence";
    EXPECT_EQ(piece.ends_document, joined.size() + piece.text.size() == text.size());
    joined += piece.text;
  }
  EXPECT_GT(pieces, 150);
  EXPECT_EQ(joined, text);
  EXPECT_EQ(reader.invalid_utf8_replaced(), 0u);
}

TEST_F(DataTest, JsonlTextField) {
  const std::string f = write(
      "d.jsonl",
      "{\"text\": \"hello\", \"id\": 1}\n\n{\"id\": 2, \"text\": \"w\\u00f6rld\\n\"}\n{\"text\": \"\"}\n");
  TextReaderOptions o;
  EXPECT_EQ(read_pieces(f, FileFormat::Jsonl, o), (std::vector<std::string>{"hello", "w\xC3\xB6rld\n"}));
  o.text_field = "content";
  const std::string g = write("g.jsonl", "{\"content\": \"abc\"}");
  EXPECT_EQ(read_pieces(g, FileFormat::Jsonl, o), (std::vector<std::string>{"abc"}));
}

TEST_F(DataTest, JsonlErrorsNameFileAndLine) {
  TextReaderOptions o;
  const std::string missing = write("missing.jsonl", "{\"text\": \"a\"}\n{\"body\": \"b\"}\n");
  std::string e = error_of([&] { read_pieces(missing, FileFormat::Jsonl, o); });
  EXPECT_NE(e.find("missing.jsonl:2"), std::string::npos) << e;
  EXPECT_NE(e.find("no field \"text\""), std::string::npos) << e;

  const std::string bad = write("bad.jsonl", "{\"text\": \"a\"}\n\n{\"text\": \"b\"\n");
  e = error_of([&] { read_pieces(bad, FileFormat::Jsonl, o); });
  EXPECT_NE(e.find("bad.jsonl:3"), std::string::npos) << e;
  EXPECT_NE(e.find("not valid JSON"), std::string::npos) << e;

  const std::string number = write("number.jsonl", "{\"text\": 5}\n");
  e = error_of([&] { read_pieces(number, FileFormat::Jsonl, o); });
  EXPECT_NE(e.find("number.jsonl:1"), std::string::npos) << e;

  const std::string array = write("array.jsonl", "[1, 2]\n");
  e = error_of([&] { read_pieces(array, FileFormat::Jsonl, o); });
  EXPECT_NE(e.find("array.jsonl:1: expected a JSON object"), std::string::npos) << e;

  // The loader reports the same error at construction or when it reaches the line.
  auto cfg = config({missing});
  e = error_of([&] {
    DataLoader loader(cfg, byte_encoder());
    read_windows(loader, 10);
  });
  EXPECT_NE(e.find("missing.jsonl:2"), std::string::npos) << e;
}

TEST(DataConfigJson, RoundTripAndTypos) {
  DataConfig c = data_config_from_json(nlohmann::json::parse(
      R"({"sources": "corpus", "format": "jsonl", "seq_len": 64, "split": "validation", "eos_id": 5})"));
  EXPECT_EQ(c.sources, std::vector<std::string>{"corpus"});
  EXPECT_EQ(c.format, DataFormat::Jsonl);
  EXPECT_EQ(c.seq_len, 64);
  EXPECT_EQ(c.split, Split::Validation);
  EXPECT_EQ(c.eos_id, 5);
  EXPECT_EQ(to_json(data_config_from_json(to_json(c))), to_json(c));
  EXPECT_NE(error_of([] {
              data_config_from_json({{"seq_lenn", 3}});
            }).find("unknown key 'seq_lenn'"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              data_config_from_json({{"seq_len", "x"}});
            }).find("key 'seq_len'"),
            std::string::npos);
}

// ---------------------------------------------------------------- packing

TEST_F(DataTest, PacksDocumentsWithEosIntoConsecutiveWindows) {
  const std::string f = write("docs.txt", "abc\n%\nde\n%\nfghij\n");
  auto cfg = config({f}, /*seq_len=*/4, /*batch=*/3);
  cfg.delimiter = DocDelimiter::Percent;
  DataLoader loader(cfg, byte_encoder());
  EXPECT_EQ(loader.eos_id(), 256);
  const auto windows = read_windows(loader, 4);
  ASSERT_EQ(windows.size(), 12u);
  // Stream: docs + EOS, wrapping around epochs; windows of seq_len + 1 taken back to back.
  const Ids stream = packed({"abc", "de", "fghij"}, 10);
  for (size_t i = 0; i < windows.size(); ++i)
    EXPECT_EQ(windows[i], Ids(stream.begin() + i * 5, stream.begin() + i * 5 + 5)) << "window " << i;
  EXPECT_EQ(loader.tokens_consumed(), 60u);
  EXPECT_GE(loader.epoch(), 4u);
}

TEST_F(DataTest, StreamsAFileLargerThanEveryBuffer) {
  std::string text;
  for (int i = 0; text.size() < 100000; ++i) text += "sentence " + std::to_string(i) + (i % 5 ? ". " : ".\n");
  const std::string f = write("big.txt", text);
  auto cfg = config({f}, 127, 4);
  cfg.read_buffer_bytes = 100;
  cfg.max_piece_bytes = 777;
  DataLoader loader(cfg, byte_encoder());
  const size_t steps = 2 * text.size() / (4 * 128) + 3;  // more than two epochs
  const Ids got = concat(read_windows(loader, static_cast<int>(steps)));
  const Ids want = packed({text}, 3);
  ASSERT_LE(got.size(), want.size());
  EXPECT_TRUE(std::equal(got.begin(), got.end(), want.begin())) << "one EOS per document, not per piece";
}

TEST_F(DataTest, DirectoriesAndFormatDetection) {
  write("corpus/b.txt", "bee");
  write("corpus/a.jsonl", "{\"text\": \"ay\"}\n");
  write("corpus/sub/c.txt", "sea");
  write("corpus/.hidden", "never");
  auto cfg = config({path("corpus")}, 3, 1);
  DataLoader loader(cfg, byte_encoder());
  const Ids got = concat(read_windows(loader, 3));
  const Ids want = packed({"ay", "bee", "sea"}, 2);  // sorted paths; jsonl parsed; hidden skipped
  EXPECT_EQ(got, Ids(want.begin(), want.begin() + 12));
}

// ---------------------------------------------------------------- bad input

TEST_F(DataTest, InvalidUtf8IsReplacedAndReportedOnce) {
  const std::string f = write("bad_utf8.txt", "ok \xFF\xFE text \xC3");
  auto cfg = config({f}, 4, 1);
  DataLoader loader(cfg, byte_encoder());
  const Ids got = concat(read_windows(loader, 20));
  const Ids once = packed({"ok \xEF\xBF\xBD\xEF\xBF\xBD text \xEF\xBF\xBD"});
  EXPECT_TRUE(std::equal(once.begin(), once.end(), got.begin()));
  ASSERT_EQ(warnings_.size(), 1u) << "reported once, although the file was read in several epochs";
  EXPECT_NE(warnings_[0].find("bad_utf8.txt"), std::string::npos);
  EXPECT_NE(warnings_[0].find("replaced 3 invalid UTF-8"), std::string::npos) << warnings_[0];
}

TEST_F(DataTest, EmptyFilesAreSkippedEmptyDatasetsFail) {
  const std::string empty = write("empty.txt", "");
  const std::string full = write("full.txt", "xyz");
  auto cfg = config({empty, full}, 3, 1);
  DataLoader loader(cfg, byte_encoder());
  EXPECT_EQ(concat(read_windows(loader, 1)), packed({"xyz"}));
  ASSERT_EQ(warnings_.size(), 1u);
  EXPECT_NE(warnings_[0].find("empty.txt: empty file"), std::string::npos) << warnings_[0];

  const std::string blank = write("blank.txt", "  \n\n");
  auto empty_cfg = config({empty, blank});
  const std::string e = error_of([&] { DataLoader l(empty_cfg, byte_encoder()); });
  EXPECT_NE(e.find("holds no documents"), std::string::npos) << e;

  write("emptydir/.keep", "");
  auto dir_cfg = config({path("emptydir")});
  EXPECT_NE(error_of([&] { DataLoader l(dir_cfg, byte_encoder()); }).find("no files"), std::string::npos);
}

TEST_F(DataTest, MissingOrUnreadableFilesFail) {
  auto cfg = config({path("nope.txt")});
  std::string e = error_of([&] { DataLoader l(cfg, byte_encoder()); });
  EXPECT_NE(e.find("nope.txt"), std::string::npos) << e;
  EXPECT_NE(e.find("no such file"), std::string::npos) << e;
  if (::geteuid() != 0) {  // root reads anything
    const std::string locked = write("locked.txt", "secret");
    fs::permissions(locked, fs::perms::none);
    auto c2 = config({locked});
    e = error_of([&] { DataLoader l(c2, byte_encoder()); });
    EXPECT_NE(e.find("locked.txt"), std::string::npos) << e;
    fs::permissions(locked, fs::perms::owner_all);
  }
}

TEST_F(DataTest, RandomBytesNeverCrash) {
  std::mt19937_64 rng(1);
  for (int trial = 0; trial < 30; ++trial) {
    std::string junk(1 + rng() % 3000, '\0');
    for (char& c : junk) c = static_cast<char>(rng() % 4 == 0 ? '\n' : rng() % 4 == 1 ? '{' : rng());
    const std::string t = write("junk" + std::to_string(trial) + ".txt", junk);
    const std::string j = write("junk" + std::to_string(trial) + ".jsonl", junk);
    for (const auto& f : {t, j}) {
      for (auto delimiter : {DocDelimiter::File, DocDelimiter::Percent, DocDelimiter::BlankLine}) {
        auto cfg = config({f}, 7, 2);
        cfg.delimiter = delimiter;
        cfg.max_piece_bytes = 100;
        try {
          DataLoader loader(cfg, byte_encoder());
          for (const auto& w : read_windows(loader, 10))
            for (int32_t id : w) ASSERT_TRUE(id >= 0 && id <= 256);
        } catch (const titan::Error& e) {
          EXPECT_NE(std::string(e.what()).find("junk"), std::string::npos) << e.what();
        }
      }
    }
  }
}

// ---------------------------------------------------------------- shuffling and epochs

TEST_F(DataTest, ShuffleIsDeterministicAndReshufflesEachEpoch) {
  const std::string ds = write_unique_token_dataset(dir_ / "tok", 50, 16);
  auto doc_order = [&](uint64_t seed, uint64_t epoch) {
    auto cfg = config({ds});
    cfg.shuffle = true;
    cfg.seed = seed;
    auto source = open_document_source(cfg, {});
    source->start_epoch(epoch);
    std::vector<int> order;
    std::span<const int32_t> ids;
    bool ends;
    while (source->next(ids, ends)) order.push_back(ids[0] / 1000);
    return order;
  };
  const auto e0 = doc_order(3, 0), e1 = doc_order(3, 1);
  EXPECT_EQ(e0, doc_order(3, 0));
  EXPECT_NE(e0, e1);
  EXPECT_NE(e0, doc_order(4, 0));
  auto s0 = e0, s1 = e1;
  std::sort(s0.begin(), s0.end());
  std::sort(s1.begin(), s1.end());
  ASSERT_EQ(s0.size(), 50u);
  for (int i = 0; i < 50; ++i) EXPECT_EQ(s0[i], i);
  EXPECT_EQ(s0, s1);

  // Loaders with the same seed agree batch for batch; another seed differs.
  auto cfg = config({ds}, 16, 4);
  cfg.shuffle = true;
  cfg.seed = 9;
  DataLoader a(cfg, {}), b(cfg, {});
  cfg.seed = 10;
  DataLoader c(cfg, {});
  const auto wa = read_windows(a, 30);
  EXPECT_EQ(wa, read_windows(b, 30));
  EXPECT_NE(wa, read_windows(c, 30));
}

TEST_F(DataTest, TextFileOrderIsShuffledPerEpoch) {
  std::vector<std::string> names;
  for (int i = 0; i < 12; ++i) write("files/f" + std::to_string(10 + i) + ".txt", std::string(1, 'a' + i));
  auto cfg = config({path("files")}, 1, 13);  // windows of 2 = one document + EOS
  cfg.shuffle = true;
  cfg.seed = 1;
  DataLoader loader(cfg, byte_encoder());
  const auto w = read_windows(loader, 4);  // 2 epochs of 12 documents, then some
  std::string epoch0, epoch1;
  for (int i = 0; i < 12; ++i)
    epoch0 += static_cast<char>(w[i][0]), epoch1 += static_cast<char>(w[12 + i][0]);
  std::string sorted0 = epoch0, sorted1 = epoch1;
  std::sort(sorted0.begin(), sorted0.end());
  std::sort(sorted1.begin(), sorted1.end());
  EXPECT_EQ(sorted0, "abcdefghijkl");
  EXPECT_EQ(sorted1, "abcdefghijkl");
  EXPECT_NE(epoch0, "abcdefghijkl");
  EXPECT_NE(epoch0, epoch1);
}

// ---------------------------------------------------------------- data parallel

TEST_F(DataTest, RanksPartitionTheSingleRankWindows) {
  const std::string ds = write_unique_token_dataset(dir_ / "tok", 40, 7);
  const int world = 3, steps = 25;
  auto cfg = config({ds}, 10, 2);
  cfg.shuffle = true;
  DataLoader single(cfg, {});
  const auto all = read_windows(single, steps * world);
  std::vector<std::vector<Ids>> per_rank;
  std::vector<Ids> union_of_ranks;
  for (int r = 0; r < world; ++r) {
    cfg.dp_rank = r;
    cfg.dp_world = world;
    DataLoader loader(cfg, {});
    per_rank.push_back(read_windows(loader, steps));
    union_of_ranks.insert(union_of_ranks.end(), per_rank.back().begin(), per_rank.back().end());
  }
  EXPECT_EQ(as_multiset(union_of_ranks), as_multiset(all));
  // Pairwise disjoint (by position: windows of different ranks never share a stream position;
  // within the first epoch every window's first token is unique).
  std::set<Ids> seen;
  const size_t first_epoch_windows = 40 * 9 / 11;  // well inside epoch 0
  for (int r = 0; r < world; ++r)
    for (size_t i = 0; i < per_rank[r].size() && i * world < first_epoch_windows; ++i)
      EXPECT_TRUE(seen.insert(per_rank[r][i]).second) << "rank " << r << " window " << i;
  // And the interleaving: rank r's b-th row of step s is global window (s * B + b) * world + r.
  for (int r = 0; r < world; ++r)
    for (size_t i = 0; i < per_rank[r].size(); ++i) EXPECT_EQ(per_rank[r][i], all[i * world + r]);
}

TEST_F(DataTest, TextRanksPartitionTheSingleRankWindows) {
  std::string fortunes;
  for (int i = 0; i < 200; ++i) fortunes += "fortune number " + std::to_string(i) + "\n%\n";
  write("f/a", fortunes);
  write("f/b", "tail document\n%\nanother\n");
  auto cfg = config({path("f")}, 12, 3);
  cfg.delimiter = DocDelimiter::Percent;
  cfg.shuffle = true;
  DataLoader single(cfg, byte_encoder());
  const auto all = read_windows(single, 40);
  std::vector<Ids> union_of_ranks;
  for (int r = 0; r < 4; ++r) {
    cfg.dp_rank = r;
    cfg.dp_world = 4;
    DataLoader loader(cfg, byte_encoder());
    const auto w = read_windows(loader, 10);
    union_of_ranks.insert(union_of_ranks.end(), w.begin(), w.end());
  }
  EXPECT_EQ(as_multiset(union_of_ranks), as_multiset(all));
}

// ---------------------------------------------------------------- resume

void expect_resume_exact(DataConfig cfg, const TextEncoder& enc, int before, int after) {
  DataLoader first(cfg, enc);
  read_windows(first, before);
  const std::string saved = first.state().dump();
  const auto continued = read_windows(first, after);
  DataLoader resumed(cfg, enc);
  read_windows(resumed, 3);  // a loader elsewhere in the stream: load_state must move it
  resumed.load_state(nlohmann::json::parse(saved));
  EXPECT_EQ(resumed.step(), static_cast<uint64_t>(before));
  EXPECT_EQ(read_windows(resumed, after), continued);
  EXPECT_EQ(resumed.state(), first.state());
}

TEST_F(DataTest, ResumeContinuesAtTheNextTokenText) {
  std::string big;
  for (int i = 0; big.size() < 20000; ++i) big += "word" + std::to_string(i) + (i % 9 ? " " : "\n");
  write("c/big.txt", big);  // arrives in pieces
  std::string fortunes;
  for (int i = 0; i < 60; ++i) fortunes += "saying " + std::to_string(i * i) + "\n%\n";
  write("c/fortunes", fortunes);
  write("c/x.jsonl", "{\"text\": \"json doc one\"}\n{\"text\": \"json doc two\"}\n");
  write("c/y.txt",
        std::string(1700, 'y') + "\n%\n" + std::string(900, 'z') + "\n%\nshort\n");  // cut mid-line
  auto cfg = config({path("c")}, 33, 2);
  cfg.delimiter = DocDelimiter::Percent;
  cfg.max_piece_bytes = 500;
  cfg.read_buffer_bytes = 64;
  cfg.shuffle = true;
  cfg.dp_world = 2;
  cfg.dp_rank = 1;
  for (int before : {0, 1, 7, 150, 263})
    expect_resume_exact(cfg, byte_encoder(), before, 60);  // crosses epochs
}

TEST_F(DataTest, ResumeContinuesAtTheNextTokenShards) {
  const std::string ds = write_unique_token_dataset(dir_ / "tok", 30, 8);
  auto cfg = config({ds}, 9, 2);
  cfg.shuffle = true;
  cfg.val_fraction = 0.2;
  for (int before : {0, 5, 13, 40}) expect_resume_exact(cfg, {}, before, 30);
  // The state is a position in the global stream: resuming with another world size continues
  // with exactly the windows the single rank would have read next.
  DataLoader single(cfg, {});
  read_windows(single, 11);
  const auto state = single.state();
  const auto next = read_windows(single, 12);
  std::vector<Ids> union_of_ranks;
  for (int r = 0; r < 2; ++r) {
    auto c = cfg;
    c.dp_world = 2;
    c.dp_rank = r;
    DataLoader loader(c, {});
    loader.load_state(state);
    const auto w = read_windows(loader, 6);
    union_of_ranks.insert(union_of_ranks.end(), w.begin(), w.end());
  }
  EXPECT_EQ(as_multiset(union_of_ranks), as_multiset(next));
}

TEST_F(DataTest, StateFromOtherDataIsRejected) {
  const std::string ds = write_unique_token_dataset(dir_ / "tok", 30, 8);
  auto cfg = config({ds});
  DataLoader a(cfg, {});
  read_windows(a, 2);
  auto other = cfg;
  other.seed = 77;
  DataLoader b(other, {});
  const std::string e = error_of([&] { b.load_state(a.state()); });
  EXPECT_NE(e.find("field 'seed'"), std::string::npos) << e;
  EXPECT_NE(error_of([&] {
              b.load_state(nlohmann::json{{"version", 1}});
            }).find("malformed loader state"),
            std::string::npos);
}

// ---------------------------------------------------------------- validation split

TEST_F(DataTest, ValidationSplitIsDeterministicAndDisjoint) {
  const std::string ds = write_unique_token_dataset(dir_ / "tok", 400, 64);
  std::string jsonl;
  for (int i = 0; i < 300; ++i) jsonl += "{\"text\": \"doc " + std::to_string(i) + "\"}\n";
  const std::string text = write("t.jsonl", jsonl);
  for (const std::string& source : {ds, text}) {
    auto docs_of = [&](Split split, uint64_t seed) {
      auto cfg = config({source});
      cfg.val_fraction = 0.25;
      cfg.split = split;
      cfg.seed = seed;  // the shuffle seed does not move documents between splits
      cfg.shuffle = true;
      auto src = open_document_source(cfg, byte_encoder());
      std::set<Ids> docs;
      std::span<const int32_t> ids;
      bool ends;
      while (src->next(ids, ends)) docs.insert(Ids(ids.begin(), ids.end()));
      return docs;
    };
    const auto train = docs_of(Split::Train, 1), val = docs_of(Split::Validation, 1);
    EXPECT_EQ(train, docs_of(Split::Train, 2));
    EXPECT_EQ(val, docs_of(Split::Validation, 3));
    const size_t total = source == ds ? 400 : 300;
    EXPECT_EQ(train.size() + val.size(), total);
    for (const auto& d : val) EXPECT_FALSE(train.count(d)) << "a document in both splits";
    EXPECT_GT(val.size(), total / 8);
    EXPECT_LT(val.size(), total * 3 / 8);
  }
}

TEST_F(DataTest, FiniteValidationLoaderEndsTogetherOnAllRanks) {
  const std::string ds = write_unique_token_dataset(dir_ / "tok", 200, 64);
  auto cfg = config({ds}, 16, 2);
  cfg.val_fraction = 0.3;
  cfg.split = Split::Validation;
  cfg.max_epochs = 1;
  std::vector<size_t> batches;
  for (int r = 0; r < 3; ++r) {
    cfg.dp_rank = r;
    cfg.dp_world = 3;
    DataLoader loader(cfg, {});
    const auto windows = read_windows(loader, 1000);
    batches.push_back(windows.size());
    Batch b;
    EXPECT_FALSE(loader.next_batch(b));
    loader.reset();  // the next evaluation pass sees the same batches
    EXPECT_EQ(read_windows(loader, 1000), windows);
  }
  EXPECT_GT(batches[0], 0u);
  EXPECT_EQ(batches[0], batches[1]);
  EXPECT_EQ(batches[0], batches[2]);
  cfg.val_fraction = 0;
  EXPECT_NE(error_of([&] { DataLoader l(cfg, {}); }).find("validation split"), std::string::npos);
}

// ---------------------------------------------------------------- token shards

TEST_F(DataTest, TokenShardRoundTrip) {
  const std::string p = path("s.bin");
  ShardWriter w(p, 5000, 7);
  w.add_document(Ids{1, 2, 3});
  w.add_tokens(Ids{4});
  w.add_tokens(Ids{4999});
  w.end_document();
  w.add_document(Ids{});
  w.finish();
  TokenShard s(p);
  EXPECT_EQ(s.vocab_size(), 5000u);
  EXPECT_EQ(s.eos_id(), 7);
  EXPECT_EQ(s.num_tokens(), 5u);
  ASSERT_EQ(s.num_docs(), 3u);
  EXPECT_EQ(std::vector<uint32_t>(s.document(1).begin(), s.document(1).end()),
            (std::vector<uint32_t>{4, 4999}));
  EXPECT_TRUE(s.document(2).empty());
  ShardWriter bad(path("t.bin"), 10, 0);
  EXPECT_NE(error_of([&] { bad.add_document(Ids{10}); }).find("outside the vocabulary"), std::string::npos);
}

TEST_F(DataTest, CorruptTokenShardsFailClearly) {
  const std::string ds = write_unique_token_dataset(dir_ / "tok", 10, 100);
  const std::string shard = (dir_ / "tok" / "shard_0.bin").string();
  const std::string pristine = [&] {
    std::ifstream in(shard, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }();
  auto with_bytes = [&](std::string bytes) {
    std::ofstream(shard, std::ios::binary | std::ios::trunc) << bytes;
    auto cfg = config({ds});
    return error_of([&] { DataLoader l(cfg, {}); });
  };
  std::string b = pristine;
  b[0] = 'X';
  std::string e = with_bytes(b);
  EXPECT_NE(e.find("shard_0.bin"), std::string::npos) << e;
  EXPECT_NE(e.find("'magic'"), std::string::npos) << e;
  b = pristine;
  b[8] = 9;
  e = with_bytes(b);
  EXPECT_NE(e.find("'version' is 9"), std::string::npos) << e;
  e = with_bytes(pristine.substr(0, pristine.size() - 12));
  EXPECT_NE(e.find("truncated"), std::string::npos) << e;
  EXPECT_NE(e.find("shard_0.bin"), std::string::npos) << e;
  e = with_bytes(pristine.substr(0, 30));
  EXPECT_NE(e.find("truncated"), std::string::npos) << e;
  // Corrupt document offsets: found when the document is read, not by a crash.
  b = pristine;
  const size_t offsets_at = b.size() - 8 * 11;  // doc_offsets[0..10] end the file
  const uint64_t huge = 1ull << 40;
  std::memcpy(&b[offsets_at + 8 * 5], &huge, 8);
  e = with_bytes(b);
  EXPECT_EQ(e, "<no titan::Error thrown>");  // opening checks only the first and last offset
  e = error_of([&] {
    auto cfg = config({ds});
    DataLoader l(cfg, {});
    read_windows(l, 20);
  });
  EXPECT_NE(e.find("'doc_offsets'"), std::string::npos) << e;
  EXPECT_NE(e.find("shard_0.bin"), std::string::npos) << e;
  // A well-formed shard that disagrees with the index.
  {
    ShardWriter w(shard, 11000, 0);
    w.add_document(Ids{1, 2});
    w.finish();
  }
  e = error_of([&] {
    auto cfg = config({ds});
    DataLoader l(cfg, {});
  });
  EXPECT_NE(e.find("'num_tokens'"), std::string::npos) << e;
  // A broken index.
  std::ofstream(dir_ / "tok" / "index.json") << "{\"format\": \"titan-tokens\", \"version\": 1";
  e = error_of([&] {
    auto cfg = config({ds});
    DataLoader l(cfg, {});
  });
  EXPECT_NE(e.find("index.json"), std::string::npos) << e;
}

// ---------------------------------------------------------------- titan data prepare

TEST_F(DataTest, PreparedShardsGiveTheSameWindowsAsText) {
  std::string fortunes;
  for (int i = 0; i < 300; ++i)
    fortunes += "fortune " + std::to_string(i * 7919 % 1000) + " \xC3\xA9t\xC3\xA9\n%\n";
  write("in/a.txt", fortunes);
  write("in/b.txt", "x\n%\n\xFFy\n");
  write("in/empty.txt", "");
  PrepareOptions o;
  o.inputs = {path("in")};
  o.output = path("out");
  o.delimiter = DocDelimiter::Percent;
  o.shard_tokens = 1000;  // several shards
  o.threads = 2;
  o.on_warning = [this](const std::string& w) { warnings_.push_back(w); };
  const PrepareStats s = prepare_token_dataset(o, byte_encoder());
  EXPECT_EQ(s.docs, 302u);
  EXPECT_EQ(s.empty_files, 1u);
  EXPECT_EQ(s.invalid_utf8, 1u);
  EXPECT_GT(s.shards, 3u);
  EXPECT_EQ(warnings_.size(), 2u);  // the empty file and the invalid UTF-8

  const TokenIndex index = read_token_index(o.output);
  EXPECT_EQ(index.shards.size(), s.shards);
  EXPECT_EQ(index.num_docs(), 302u);
  EXPECT_EQ(index.num_tokens(), s.tokens);
  EXPECT_EQ(index.eos_id, 256);
  EXPECT_EQ(index.vocab_size, 257u);
  EXPECT_EQ(index.metadata["tokenizer"], kByteEncoderName);

  auto text_cfg = config({path("in")}, 50, 3);
  text_cfg.delimiter = DocDelimiter::Percent;
  auto tok_cfg = config({o.output}, 50, 3);
  DataLoader from_text(text_cfg, byte_encoder()), from_tokens(tok_cfg, {});
  EXPECT_EQ(read_windows(from_tokens, 80), read_windows(from_text, 80));

  // No temporary directories are left next to the output.
  for (const auto& entry : fs::directory_iterator(dir_))
    EXPECT_EQ(entry.path().filename().string().find(".out.tmp"), std::string::npos);

  // An existing output is kept unless overwrite is asked for.
  EXPECT_NE(error_of([&] { prepare_token_dataset(o, byte_encoder()); }).find("already exists"),
            std::string::npos);
  o.overwrite = true;
  o.inputs = {path("in/b.txt")};
  EXPECT_EQ(prepare_token_dataset(o, byte_encoder()).docs, 2u);
  EXPECT_EQ(read_token_index(o.output).num_docs(), 2u);
}

TEST_F(DataTest, PrepareLeavesNoPartialOutputOnError) {
  std::string good;
  for (int i = 0; i < 5000; ++i) good += "{\"text\": \"document " + std::to_string(i) + "\"}\n";
  write("in/a.jsonl", good);
  write("in/b.jsonl", "{\"text\": \"fine\"}\n{\"txt\": \"typo\"}\n");
  PrepareOptions o;
  o.inputs = {path("in")};
  o.output = path("out");
  o.shard_tokens = 4096;  // shards were already written when the error is found
  o.on_warning = [this](const std::string& w) { warnings_.push_back(w); };
  const std::string e = error_of([&] { prepare_token_dataset(o, byte_encoder()); });
  EXPECT_NE(e.find("b.jsonl:2"), std::string::npos) << e;
  EXPECT_FALSE(fs::exists(o.output));
  size_t entries = 0;
  for ([[maybe_unused]] const auto& entry : fs::directory_iterator(dir_)) ++entries;
  EXPECT_EQ(entries, 1u) << "only the input directory remains";
  o.inputs = {path("in/none.txt")};
  EXPECT_NE(error_of([&] { prepare_token_dataset(o, byte_encoder()); }).find("none.txt"), std::string::npos);
  write("blank.txt", "\n\n");
  o.inputs = {path("blank.txt")};
  EXPECT_NE(error_of([&] { prepare_token_dataset(o, byte_encoder()); }).find("no documents"),
            std::string::npos);
  EXPECT_FALSE(fs::exists(o.output));
}

TEST_F(DataTest, CliPrepareAndInfo) {
  write("in/a.txt", "one\n%\ntwo\n%\nthree\n");
  const std::string out = path("out");
  std::string log;
  ASSERT_EQ(run_titan("data prepare --tokenizer builtin:bytes --input " + path("in") + " --output " + out +
                          " --delimiter percent",
                      &log),
            0)
      << log;
  EXPECT_NE(log.find("3 documents"), std::string::npos) << log;
  EXPECT_EQ(read_token_index(out).num_tokens(), 11u);
  ASSERT_EQ(run_titan("data info " + out + " --seq-len 3 --batches 2", &log), 0) << log;
  EXPECT_NE(log.find("train: 3 documents, 14 tokens"), std::string::npos) << log;

  // Failures: a non-zero exit, one error line, and no output directory.
  write("bad/x.jsonl", "{\"text\": \"a\"}\nnot json\n");
  EXPECT_EQ(
      run_titan("data prepare --tokenizer builtin:bytes --input " + path("bad") + " --output " + path("o2"),
                &log),
      1);
  EXPECT_NE(log.find("x.jsonl:2: not valid JSON"), std::string::npos) << log;
  EXPECT_FALSE(fs::exists(path("o2")));
  EXPECT_EQ(run_titan("data prepare --tokenizer builtin:bytes --input " + path("missing") + " --output " +
                          path("o3"),
                      &log),
            1);
  EXPECT_NE(log.find("missing"), std::string::npos) << log;
  EXPECT_FALSE(fs::exists(path("o3")));
  // A corrupt shard: clear error, non-zero exit.
  std::ofstream(fs::path(out) / "shard_00000.bin", std::ios::binary | std::ios::trunc) << "garbage";
  EXPECT_EQ(run_titan("data info " + out, &log), 1);
  EXPECT_NE(log.find("shard_00000.bin"), std::string::npos) << log;
  EXPECT_NE(run_titan("data prepare --input x", &log), 0);  // missing required flags
}

// ---------------------------------------------------------------- with the real tokenizer

TEST_F(DataTest, PrepareWithTheRealTokenizer) {
  const std::string tok_path = std::string(TITAN_SOURCE_DIR) + "/tests/golden/tokenizer/small/tokenizer.json";
  if (!fs::exists(tok_path)) GTEST_SKIP() << "no tokenizer fixture at " << tok_path;
  std::unique_ptr<titan::Tokenizer> tok;
  try {
    tok = std::make_unique<titan::Tokenizer>(titan::Tokenizer::load(tok_path));
    tok->encode("probe");
  } catch (const titan::Error& e) {
    if (std::string(e.what()).find("not implemented") != std::string::npos)
      GTEST_SKIP() << "titan::Tokenizer is not implemented yet: " << e.what();
    throw;
  }
  ASSERT_TRUE(tok->eos_id().has_value()) << tok_path;
  const std::vector<std::string> docs = {"hello world", "all well \xE2\x82\xAC", "hell"};
  write("in/a.jsonl",
        "{\"text\": \"hello world\"}\n{\"text\": \"all well \xE2\x82\xAC\"}\n{\"text\": \"hell\"}\n");
  std::string log;
  ASSERT_EQ(run_titan("data prepare --threads 3 --tokenizer " + tok_path + " --input " + path("in") +
                          " --output " + path("out"),
                      &log),
            0)
      << log;
  Ids want;
  for (const auto& d : docs) {
    const auto ids = tok->encode(d);
    want.insert(want.end(), ids.begin(), ids.end());
    want.push_back(*tok->eos_id());
  }
  auto cfg = config({path("out")}, 99, 1);
  const int steps = static_cast<int>(want.size() / 100);
  DataLoader loader(cfg);
  EXPECT_EQ(concat(read_windows(loader, steps)), Ids(want.begin(), want.begin() + steps * 100));
  // The loader can also tokenize the text directly, with the same result.
  auto text_cfg = config({path("in")}, 99, 1);
  text_cfg.tokenizer = tok_path;
  DataLoader text_loader(text_cfg);
  EXPECT_EQ(concat(read_windows(text_loader, steps)), Ids(want.begin(), want.begin() + steps * 100));
}
