// Streaming readers of text corpora: one file at a time, one document (or piece of a very large
// document) at a time, in memory bounded by the read buffer and the maximum piece size.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>

namespace titan::data {

enum class FileFormat { Text, Jsonl };

// How a plain text file splits into documents.
enum class DocDelimiter {
  File,       // the whole file is one document
  Percent,    // fortune(6) style: records separated by lines holding only "%"
  BlankLine,  // paragraphs separated by one or more blank (whitespace-only) lines
};

DocDelimiter parse_doc_delimiter(std::string_view name);  // "file" | "percent" | "blank"
std::string to_string(DocDelimiter d);

struct TextReaderOptions {
  DocDelimiter delimiter = DocDelimiter::File;
  std::string text_field = "text";    // JSON Lines: the field holding the document
  bool raw_jsonl = false;             // JSON Lines: hand out each non-blank line itself (chat records)
  size_t buffer_bytes = 1 << 20;      // read buffer
  size_t max_piece_bytes = 64 << 20;  // text documents larger than this arrive in pieces
  size_t max_line_bytes = 256 << 20;  // JSON Lines: longer lines are an error
};

// Where a reader stands: enough to reopen the file and continue with the same next piece.
struct TextPosition {
  uint64_t offset = 0;        // byte offset of the next unread piece
  uint64_t ordinal = 0;       // documents completed before it (names documents for the split)
  uint64_t line = 0;          // lines before `offset` (for error messages)
  bool at_line_start = true;  // false when a piece was cut inside a long line
  bool in_document = false;   // true when earlier pieces of the same document were handed out
};

struct TextPiece {
  std::string text;           // valid UTF-8
  uint64_t ordinal = 0;       // which document of the file it belongs to
  uint64_t line = 0;          // 1-based line where it starts
  bool ends_document = true;  // false: more pieces of the same document follow
};

class TextFileReader {
 public:
  // Opens `path`; throws titan::Error when it cannot be opened.
  TextFileReader(std::string path, FileFormat format, const TextReaderOptions& options);
  ~TextFileReader();
  TextFileReader(const TextFileReader&) = delete;
  TextFileReader& operator=(const TextFileReader&) = delete;

  // The next non-empty piece, or false at end of file. Throws titan::Error naming file and line on
  // malformed JSON, a missing text field or a read error.
  bool next(TextPiece& piece);

  TextPosition tell() const;
  void seek(const TextPosition& pos);

  const std::string& path() const { return path_; }
  uint64_t invalid_utf8_replaced() const { return invalid_utf8_; }
  uint64_t size_bytes() const { return file_size_; }

 private:
  // Appends the next line (with its '\n') or at most max_bytes of it; returns bytes appended
  // (0 at end of file) and sets *complete when the line ended within those bytes.
  size_t read_line(std::string& out, size_t max_bytes, bool* complete);
  bool fill();
  bool next_text(TextPiece& piece);
  bool next_jsonl(TextPiece& piece);
  bool emit(TextPiece& piece, size_t len, bool ends_document);
  TextPosition current_position() const;

  std::string path_;
  FileFormat format_;
  TextReaderOptions options_;
  int fd_ = -1;
  uint64_t file_size_ = 0;
  std::string buffer_;
  size_t buffer_pos_ = 0, buffer_len_ = 0;
  uint64_t read_offset_ = 0;  // file offset of buffer_[buffer_pos_]
  uint64_t line_ = 0;         // lines consumed through read_offset_
  bool at_line_start_ = true;

  // Accumulated bytes of the current record, not yet handed out.
  std::string record_;
  TextPosition record_start_;
  uint64_t ordinal_ = 0;
  bool in_document_ = false;
  uint64_t invalid_utf8_ = 0;
};

}  // namespace titan::data
