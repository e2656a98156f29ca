#include "core/progress.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include <fmt/format.h>

namespace marrow {
namespace {

constexpr double kSilentSeconds = 3;      // "more than a few seconds"
constexpr double kTerminalInterval = 1;   // an in-place line can change often
constexpr double kLogInterval = 10;       // each line of a log file stays there

double silent_seconds() {
  const char* test = std::getenv("MARROW_TEST_PROGRESS_DELAY_S");
  return test ? std::max(0.0, std::atof(test)) : kSilentSeconds;
}

}  // namespace

std::string human_size(double bytes) {
  if (bytes >= 1e12) return fmt::format("{:.2f} TB", bytes / 1e12);
  if (bytes >= 1e9) return fmt::format("{:.2f} GB", bytes / 1e9);
  if (bytes >= 1e6) return fmt::format("{:.1f} MB", bytes / 1e6);
  if (bytes >= 1e3) return fmt::format("{:.1f} kB", bytes / 1e3);
  return fmt::format("{:.0f} B", bytes);
}

std::string human_duration(double seconds) {
  const auto s = int64_t(std::llround(std::max(0.0, seconds)));
  if (s < 60) return fmt::format("{} s", s);
  if (s < 3600) return fmt::format("{} min {} s", s / 60, s % 60);
  return fmt::format("{} h {:02d} min", s / 3600, (s % 3600) / 60);
}

std::string progress_line(const std::string& what, uint64_t done, uint64_t total, double seconds) {
  const double rate = double(done) / std::max(seconds, 1e-9);
  const std::string left = done == 0 ? "time left unknown" : human_duration(double(total - std::min(done, total)) / rate) + " left";
  return fmt::format("{}: {} of {}, {}/s, {}", what, human_size(double(done)), human_size(double(total)), human_size(rate), left);
}

std::string progress_done_line(const std::string& what, uint64_t total, double seconds) {
  return fmt::format("{}: {} in {:.1f} s, {}/s", what, human_size(double(total)), seconds,
                     human_size(double(total) / std::max(seconds, 1e-9)));
}

Progress::Progress(std::string what, uint64_t total_bytes, bool enabled)
    : what_(std::move(what)),
      total_(total_bytes),
      enabled_(enabled),
      tty_(::isatty(STDERR_FILENO) == 1),
      delay_s_(silent_seconds()),
      start_(Clock::now()),
      last_print_(start_) {}

Progress::~Progress() {
  if (printed_ && tty_) std::fprintf(stderr, "\n");
}

void Progress::set(uint64_t done_bytes) {
  done_ = done_bytes;
  if (!enabled_) return;
  const double elapsed = seconds();
  const double since_print = std::chrono::duration<double>(Clock::now() - last_print_).count();
  if (elapsed < delay_s_ || (printed_ && since_print < (tty_ ? kTerminalInterval : kLogInterval))) return;
  const std::string line = progress_line(what_, done_, total_, elapsed);
  // On a terminal the line is rewritten in place; \33[K clears what a longer earlier line left.
  std::fprintf(stderr, tty_ ? "\r%s\33[K" : "%s\n", line.c_str());
  std::fflush(stderr);
  printed_ = true;
  last_print_ = Clock::now();
}

void Progress::finish() {
  if (!printed_) return;
  printed_ = false;
  std::fprintf(stderr, tty_ ? "\r%s\33[K\n" : "%s\n", progress_done_line(what_, total_, seconds()).c_str());
  std::fflush(stderr);
}

}  // namespace marrow
