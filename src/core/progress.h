// A progress line on stderr for slow work of known size in bytes (export, import, a corpus's
// sha256). Silent for the first few seconds, then "<what>: 1.20 GB of 3.40 GB, 150.0 MB/s, 15 s
// left", rewritten about once a second on a terminal or a new line every 10 s otherwise; finish()
// ends it with "<what>: 3.40 GB in 22.5 s, 151.1 MB/s", destruction midway only ends the line.
// A disabled reporter (--quiet) prints nothing. One thread calls it.
// Test hook: MARROW_TEST_PROGRESS_DELAY_S=<seconds> replaces the silent first seconds (tests use 0).
#pragma once
#include <chrono>
#include <cstdint>
#include <string>

namespace marrow {

class Progress {
 public:
  Progress(std::string what, uint64_t total_bytes, bool enabled = true);
  ~Progress();
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  void add(uint64_t bytes) { set(done_ + bytes); }
  void set(uint64_t done_bytes);
  // Prints the closing line if a line was printed: the work is done.
  void finish();

 private:
  using Clock = std::chrono::steady_clock;
  double seconds() const { return std::chrono::duration<double>(Clock::now() - start_).count(); }

  std::string what_;
  uint64_t total_, done_ = 0;
  bool enabled_, tty_, printed_ = false;
  double delay_s_;
  Clock::time_point start_, last_print_;
};

// The running line for done of total bytes after seconds (no carriage return or newline).
std::string progress_line(const std::string& what, uint64_t done, uint64_t total, double seconds);
// The closing line for total bytes done in seconds.
std::string progress_done_line(const std::string& what, uint64_t total, double seconds);
// "950 B", "12.3 kB", "1.20 GB": decimal units, as disks and networks count.
std::string human_size(double bytes);
// "42 s", "3 min 20 s", "2 h 05 min".
std::string human_duration(double seconds);

}  // namespace marrow
