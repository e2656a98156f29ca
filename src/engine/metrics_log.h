// <output.dir>/metrics.jsonl, one JSON line per step, appended by the leader. Every append is
// flushed and checked: a full disk (or a file-size limit) stops the run with a sentence instead of
// leaving a truncated line behind, and the file is cut back to its last whole line so that a
// resume reads it as it was.
#pragma once
#include <cstdio>
#include <string>

namespace marrow {

class MetricsLog {
 public:
  MetricsLog() = default;
  // Opens path for appending (truncating it when fresh).
  MetricsLog(const std::string& path, bool fresh);
  ~MetricsLog();
  MetricsLog(const MetricsLog&) = delete;
  MetricsLog& operator=(const MetricsLog&) = delete;
  MetricsLog(MetricsLog&& other) noexcept;
  MetricsLog& operator=(MetricsLog&& other) noexcept;

  // Appends line + "\n", or fails with one sentence (after removing what part of it was written).
  void append(const std::string& line);

 private:
  std::string path_;
  std::FILE* file_ = nullptr;
};

// A run that does not continue output.dir's own run (a fresh start, or a start from another
// directory's checkpoint) keeps an earlier run's records there: metrics.jsonl and tb/'s event files
// move into earlier-runs/<n>/ (n = 1, 2, ...: the first free one), and the returned note says where.
// "" when there was nothing to keep.
std::string keep_earlier_records(const std::string& out_dir);

}  // namespace marrow
