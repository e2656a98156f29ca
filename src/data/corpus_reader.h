// Reading raw text corpora: which files the user means (files, directories, globs), and their
// bytes in large chunks cut at line boundaries, decompressing zstd on the way. Formats:
//   .txt            one document per file
//   .jsonl          one document per line, its text in a string field ("text" by default)
//   either + .zst or .zstd
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace marrow {

struct InputFile {
  std::string path;
  bool jsonl = false;
  bool zstd = false;
};

// Expands each spec (a file, a directory searched recursively, or a glob) into input files, in
// sorted order per spec, without repeats. A spec that names nothing readable is an Error.
std::vector<InputFile> find_input_files(const std::vector<std::string>& specs);

// A run of whole lines of one file. A text file's document may span several chunks; it is cut
// only before a line that starts with an ASCII letter or digit, where no pre-tokenizer piece of
// the Qwen or GPT-2 splits can cross, so encoding the chunks one by one equals encoding the whole.
struct TextChunk {
  size_t file_index = 0;
  int64_t first_line = 1;
  std::string bytes;
  bool ends_file = false;
};

class ChunkReader {
 public:
  explicit ChunkReader(std::vector<InputFile> files, size_t chunk_bytes = size_t(4) << 20);
  ~ChunkReader();
  // The next chunk in file order; false after the last. A truncated or corrupt zstd stream or an
  // unreadable file is an Error naming the file.
  bool next(TextChunk& chunk);
  const std::vector<InputFile>& files() const { return files_; }
  // Bytes of text produced so far (after decompression).
  uint64_t bytes_read() const { return bytes_read_; }

 private:
  bool fill();  // appends more text of the current file to pending_; false at its end
  void open_current();
  void close_current();

  std::vector<InputFile> files_;
  size_t chunk_bytes_;
  size_t current_ = 0;
  int fd_ = -1;
  bool at_end_of_file_ = false;
  struct Zstd;
  std::unique_ptr<Zstd> zstd_;
  std::string pending_;
  int64_t next_line_ = 1;
  uint64_t bytes_read_ = 0;
};

struct BadLine {
  size_t file_index = 0;
  int64_t line = 0;
  std::string reason;
};

// The documents in a chunk: for JSONL each line's field (invalid UTF-8, invalid JSON, a missing or
// non-string field make a bad line, which is skipped); for text the chunk itself, less any lines
// that are not valid UTF-8. `visit` gets each text, whether a document ends with it and whether it
// carries no loss: with a no_loss_field (JSONL only), that field's text first (a prompt), then the document's.
void chunk_documents(const InputFile& file, const TextChunk& chunk, const std::string& field,
                     const std::function<void(std::string_view text, bool ends_document, bool no_loss)>& visit,
                     std::vector<BadLine>& bad_lines, const std::string& no_loss_field = {});

// Bad lines as the commands report them: a warning on stderr for each of the first 20 (or, with
// strict, an error at the first), then how many more were skipped.
class BadLineReport {
 public:
  // newline_first: start each warning on a new line (a progress line ending in '\r' is on screen).
  BadLineReport(const std::vector<InputFile>& files, bool strict, bool newline_first)
      : files_(files), strict_(strict), newline_first_(newline_first) {}
  void skip(const std::vector<BadLine>& bad_lines);
  void finish() const;  // after the last chunk
  int64_t count() const { return count_; }

 private:
  const std::vector<InputFile>& files_;
  const bool strict_, newline_first_;
  int64_t count_ = 0;
};

}  // namespace marrow
