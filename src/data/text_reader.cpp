#include "data/text_reader.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "data/utf8.h"
#include "io/json_file.h"

namespace titan::data {

DocDelimiter parse_doc_delimiter(std::string_view name) {
  if (name == "file") return DocDelimiter::File;
  if (name == "percent" || name == "%") return DocDelimiter::Percent;
  if (name == "blank" || name == "blank-line" || name == "paragraph") return DocDelimiter::BlankLine;
  fail("unknown document delimiter '", name, "' (expected file, percent or blank)");
}

std::string to_string(DocDelimiter d) {
  switch (d) {
    case DocDelimiter::File:
      return "file";
    case DocDelimiter::Percent:
      return "percent";
    case DocDelimiter::BlankLine:
      return "blank";
  }
  return "?";
}

namespace {

bool is_space(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

bool all_space(std::string_view s) {
  return std::all_of(s.begin(), s.end(), is_space);
}

bool is_delimiter_line(DocDelimiter d, std::string_view line) {
  if (d == DocDelimiter::Percent) return line == "%\n" || line == "%\r\n" || line == "%";
  if (d == DocDelimiter::BlankLine) return all_space(line);
  return false;
}

}  // namespace

TextFileReader::TextFileReader(std::string path, FileFormat format, const TextReaderOptions& options)
    : path_(std::move(path)), format_(format), options_(options) {
  TITAN_CHECK(options_.buffer_bytes > 0 && options_.max_piece_bytes > 0,
              "text reader: buffer sizes must be > 0");
  fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd_ < 0) fail(path_, ": cannot open: ", std::strerror(errno));
  struct stat st;
  if (::fstat(fd_, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd_);
    fd_ = -1;
    fail(path_, ": not a regular file");
  }
  file_size_ = static_cast<uint64_t>(st.st_size);
  ::posix_fadvise(fd_, 0, 0, POSIX_FADV_SEQUENTIAL);
  buffer_.resize(options_.buffer_bytes);
}

TextFileReader::~TextFileReader() {
  if (fd_ >= 0) ::close(fd_);
}

bool TextFileReader::fill() {
  for (;;) {
    const ssize_t n = ::read(fd_, buffer_.data(), buffer_.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) fail(path_, ": read error at byte ", read_offset_, ": ", std::strerror(errno));
    buffer_pos_ = 0;
    buffer_len_ = static_cast<size_t>(n);
    return n > 0;
  }
}

size_t TextFileReader::read_line(std::string& out, size_t max_bytes, bool* complete) {
  size_t appended = 0;
  *complete = false;
  while (appended < max_bytes) {
    if (buffer_pos_ == buffer_len_ && !fill()) {
      *complete = appended > 0;  // the last line of a file need not end with '\n'
      break;
    }
    const char* start = buffer_.data() + buffer_pos_;
    const size_t n = std::min(buffer_len_ - buffer_pos_, max_bytes - appended);
    const char* newline = static_cast<const char*>(std::memchr(start, '\n', n));
    const size_t take = newline ? static_cast<size_t>(newline - start) + 1 : n;
    out.append(start, take);
    buffer_pos_ += take;
    read_offset_ += take;
    appended += take;
    at_line_start_ = newline != nullptr;
    if (newline) {
      ++line_;
      *complete = true;
      break;
    }
  }
  return appended;
}

TextPosition TextFileReader::current_position() const {
  return TextPosition{read_offset_, ordinal_, line_, at_line_start_, in_document_};
}

TextPosition TextFileReader::tell() const {
  return record_.empty() ? current_position() : record_start_;
}

void TextFileReader::seek(const TextPosition& pos) {
  TITAN_CHECK(pos.offset <= file_size_, path_, ": cannot seek to byte ", pos.offset, " of a ", file_size_,
              "-byte file (has the file changed since the state was saved?)");
  if (::lseek(fd_, static_cast<off_t>(pos.offset), SEEK_SET) < 0)
    fail(path_, ": cannot seek: ", std::strerror(errno));
  buffer_pos_ = buffer_len_ = 0;
  read_offset_ = pos.offset;
  line_ = pos.line;
  at_line_start_ = pos.at_line_start;
  ordinal_ = pos.ordinal;
  in_document_ = pos.in_document;
  record_.clear();
}

bool TextFileReader::next(TextPiece& piece) {
  return format_ == FileFormat::Jsonl ? next_jsonl(piece) : next_text(piece);
}

// Hands out record_[0, len) as a piece. Returns false (and drops it) for a whitespace-only
// document, which carries nothing to learn from.
bool TextFileReader::emit(TextPiece& piece, size_t len, bool ends_document) {
  std::string_view text(record_.data(), len);
  if (ends_document && options_.delimiter != DocDelimiter::File) {
    // The newline before a delimiter line belongs to the delimiter, not to the document.
    if (text.ends_with("\r\n"))
      text.remove_suffix(2);
    else if (text.ends_with('\n'))
      text.remove_suffix(1);
  }
  const TextPosition start = record_start_;
  const bool keep = !(ends_document && !start.in_document && all_space(text));
  if (keep) {
    size_t replaced = 0;
    piece.text = sanitize_utf8(text, &replaced);
    invalid_utf8_ += replaced;
    piece.ordinal = ordinal_;
    piece.line = start.line + 1;
    piece.ends_document = ends_document;
  }
  if (ends_document) {
    record_.clear();
    if (keep) ++ordinal_;
    in_document_ = false;
  } else {
    // The rest of the record is the next piece; remember where it starts for tell().
    const auto lines = std::count(record_.begin(), record_.begin() + static_cast<std::ptrdiff_t>(len), '\n');
    record_start_.offset += len;
    record_start_.line += static_cast<uint64_t>(lines);
    record_start_.at_line_start = record_[len - 1] == '\n';
    record_start_.in_document = true;
    in_document_ = true;
    record_.erase(0, len);
  }
  return keep;
}

bool TextFileReader::next_text(TextPiece& piece) {
  const size_t max_piece = options_.max_piece_bytes;
  for (;;) {
    if (record_.size() >= max_piece) {
      // Cut a large document: after the last newline in its second half, else at a UTF-8 boundary.
      const std::string_view r(record_);
      const size_t newline = r.rfind('\n', max_piece - 1);
      size_t cut = newline != std::string_view::npos && newline + 1 >= max_piece / 2
                       ? newline + 1
                       : utf8_boundary_before(r, max_piece);
      if (cut == 0) cut = max_piece;
      emit(piece, cut, /*ends_document=*/false);
      return true;
    }
    if (record_.empty()) record_start_ = current_position();
    const bool line_start = at_line_start_;
    const size_t line_begin = record_.size();
    bool complete;
    // A few bytes of slack so a short delimiter line is never split at the piece limit.
    const size_t n = read_line(record_, max_piece - record_.size() + 8, &complete);
    if (n == 0) {
      if (record_.empty()) return false;
      if (emit(piece, record_.size(), /*ends_document=*/true)) return true;
      continue;
    }
    if (options_.delimiter == DocDelimiter::File) continue;
    const std::string_view line(record_.data() + line_begin, n);
    if (!(line_start && complete && is_delimiter_line(options_.delimiter, line))) continue;
    record_.resize(line_begin);  // drop the delimiter line itself
    if (record_.empty()) continue;
    if (emit(piece, record_.size(), /*ends_document=*/true)) return true;
  }
}

bool TextFileReader::next_jsonl(TextPiece& piece) {
  std::string line;
  for (;;) {
    line.clear();
    const uint64_t line_number = line_ + 1;
    bool complete;
    const size_t n = read_line(line, options_.max_line_bytes + 1, &complete);
    if (n == 0) return false;
    if (!complete) fail(path_, ":", line_number, ": line longer than ", options_.max_line_bytes, " bytes");
    if (all_space(line)) continue;
    size_t replaced = 0;
    const std::string clean = sanitize_utf8(line, &replaced);
    invalid_utf8_ += replaced;
    if (options_.raw_jsonl) {
      piece.text = clean;
      piece.ordinal = line_number;
      piece.line = line_number;
      piece.ends_document = true;
      return true;
    }
    const nlohmann::json record = parse_json(clean, str_cat(path_, ":", line_number));
    if (!record.is_object())
      fail(path_, ":", line_number, ": expected a JSON object, got ", record.type_name());
    const auto it = record.find(options_.text_field);
    if (it == record.end()) fail(path_, ":", line_number, ": no field \"", options_.text_field, "\"");
    if (!it->is_string())
      fail(path_, ":", line_number, ": field \"", options_.text_field, "\" is a ", it->type_name(),
           ", expected a string");
    piece.text = it->get<std::string>();
    if (piece.text.empty()) continue;
    piece.ordinal = line_number;  // stable name of the document within the file
    piece.line = line_number;
    piece.ends_document = true;
    return true;
  }
}

}  // namespace titan::data
