#include "engine/metrics_log.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <utility>
#include <vector>

#include "core/errors.h"

namespace marrow {

MetricsLog::MetricsLog(const std::string& path, bool fresh) : path_(path) {
  file_ = std::fopen(path.c_str(), fresh ? "w" : "a");
  MARROW_CHECK(file_ != nullptr, "cannot open {} for writing: {}", path, std::strerror(errno));
}

MetricsLog::~MetricsLog() {
  if (file_) std::fclose(file_);
}

MetricsLog::MetricsLog(MetricsLog&& other) noexcept : path_(std::move(other.path_)), file_(std::exchange(other.file_, nullptr)) {}

MetricsLog& MetricsLog::operator=(MetricsLog&& other) noexcept {
  std::swap(path_, other.path_);
  std::swap(file_, other.file_);
  return *this;
}

void MetricsLog::append(const std::string& line) {
  MARROW_CHECK(file_ != nullptr, "internal: {} was written before it was opened", path_);
  const long before = std::fseek(file_, 0, SEEK_END) == 0 ? std::ftell(file_) : -1;
  const std::string text = line + "\n";
  if (std::fwrite(text.data(), 1, text.size(), file_) == text.size() && std::fflush(file_) == 0) return;
  const int err = errno;
  // Closed first, so that nothing left in its buffer is written after the cut; cutting a file
  // back needs no space.
  std::fclose(file_);
  file_ = nullptr;
  const bool cut = before >= 0 && ::truncate(path_.c_str(), before) == 0;
  fail("cannot write {}: {} (is the disk full?); {}", path_, std::strerror(err),
       cut ? "the file is as it was before this step" : "its last line may be cut short");
}

std::string keep_earlier_records(const std::string& out_dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path metrics = fs::path(out_dir) / "metrics.jsonl", tb = fs::path(out_dir) / "tb";
  std::vector<fs::path> events;
  if (fs::is_directory(tb, ec))
    for (const auto& entry : fs::directory_iterator(tb))
      if (entry.path().filename().string().starts_with("events.out.tfevents.")) events.push_back(entry.path());
  const bool has_metrics = fs::exists(metrics, ec) && fs::file_size(metrics, ec) > 0;
  if (!has_metrics && events.empty()) return "";
  fs::path kept;
  for (int n = 1; kept.empty() || fs::exists(kept, ec); ++n) kept = fs::path(out_dir) / "earlier-runs" / std::to_string(n);
  fs::create_directories(kept / "tb", ec);
  MARROW_CHECK(!ec, "cannot create {} for the earlier run's records: {}", kept.string(), ec.message());
  // The event files first: a crash between the moves leaves metrics.jsonl, so the next start moves
  // the rest into another earlier-runs/<n>, and nothing is removed.
  for (const fs::path& path : events) {
    fs::rename(path, kept / "tb" / path.filename(), ec);
    MARROW_CHECK(!ec, "cannot move {} into {}: {}", path.string(), kept.string(), ec.message());
  }
  if (has_metrics) {
    fs::rename(metrics, kept / "metrics.jsonl", ec);
    MARROW_CHECK(!ec, "cannot move {} into {}: {}", metrics.string(), kept.string(), ec.message());
  }
  return fmt::format("note: output.dir {} held the records of an earlier run with no checkpoint to resume; they are kept in {}",
                     out_dir, kept.string());
}

}  // namespace marrow
