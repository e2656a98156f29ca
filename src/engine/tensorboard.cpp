#include "engine/tensorboard.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/errors.h"

namespace fs = std::filesystem;

namespace marrow {
namespace {

// The keys of metrics.jsonl not shown as train/<key>.
struct TagOf {
  const char* key;  // in metrics.jsonl
  const char* tag;  // in TensorBoard
  double scale;
};
constexpr TagOf kTags[] = {{"val_loss", "val/loss", 1},
                           {"tokens_per_s", "perf/tokens_per_s", 1},
                           {"step_ms", "perf/step_ms", 1},
                           {"peak_bytes", "perf/peak_memory_gib", 1.0 / 1073741824.0}};

double wall_time() { return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count(); }

std::string host_name() {
  char name[256] = {};
  MARROW_CHECK(::gethostname(name, sizeof name - 1) == 0, "cannot read the host name: {}", std::strerror(errno));
  return name[0] ? name : "localhost";
}

// The run config's command-line arguments and file as markdown (indented lines are code blocks).
std::string run_config_markdown(const RunConfig& rc) {
  std::string arguments = rc.source;
  for (const std::string& arg : rc.overrides) arguments += " " + arg;
  std::string text = "    " + arguments + "\n\n";
  std::ifstream in(rc.source);
  std::string line;
  while (std::getline(in, line)) text += "    " + line + "\n";
  return text;
}

// The event files in dir, in the order they were written.
std::vector<std::string> event_files(const std::string& dir) {
  std::error_code ec;
  std::vector<std::string> files;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (entry.is_regular_file() && name.starts_with("events.out.tfevents.") && !name.ends_with(".tmp"))
      files.push_back(entry.path().string());
  }
  MARROW_CHECK(!ec, "cannot list {}: {}", dir, ec.message());
  std::sort(files.begin(), files.end());
  return files;
}

// A rewrite killed midway leaves <file>.tmp, which readers would take for events of the run.
void remove_rewrite_leftovers(const std::string& dir) {
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (!name.starts_with("events.out.tfevents.") || !name.ends_with(".tmp")) continue;
    std::error_code removed;
    fs::remove(entry.path(), removed);
    MARROW_CHECK(!removed, "cannot remove {}: {}", entry.path().string(), removed.message());
  }
  MARROW_CHECK(!ec, "cannot list {}: {}", dir, ec.message());
}

// The run's new event file, after the earlier ones are removed (a fresh start) or cut back (a
// resume). Its name sorts after every earlier one: its time is not earlier and, within the same
// second on the same host, its number is larger.
std::string new_event_file(const RunConfig& rc, int64_t first_step, bool continues) {
  const std::string dir = rc.out_dir + "/tb";
  std::error_code ec;
  fs::create_directories(dir, ec);
  MARROW_CHECK(!ec, "cannot create {}: {}", dir, ec.message());
  std::vector<std::string> earlier = event_files(dir);
  remove_rewrite_leftovers(dir);
  for (const std::string& path : earlier) {
    if (continues) {
      keep_events_through(path, first_step - 1);
      continue;
    }
    fs::remove(path, ec);
    MARROW_CHECK(!ec, "cannot remove {} (an earlier run's events): {}", path, ec.message());
  }
  const size_t number = continues ? earlier.size() : 0;
  return fmt::format("{}/events.out.tfevents.{:010d}.{}.{:04d}", dir, std::time(nullptr), host_name(), number);
}

}  // namespace

TensorBoardLog::TensorBoardLog(const RunConfig& rc, int64_t first_step, bool continues)
    : file_(new_event_file(rc, first_step, continues)) {
  const double now = wall_time();
  file_.write(file_version_event(now));
  file_.write(text_event(now, first_step - 1, "run_config", run_config_markdown(rc)));
}

void TensorBoardLog::add_step(const Json& metrics) {
  MARROW_CHECK(metrics.is_object() && metrics.contains("step") && metrics["step"].is_number_integer(),
               "internal: a metrics line without a step: {}", metrics.dump());
  std::vector<std::pair<std::string, float>> scalars;
  for (const auto& [key, value] : metrics.items()) {
    if (key == "step" || !value.is_number()) continue;
    const TagOf* known = std::find_if(std::begin(kTags), std::end(kTags), [&](const TagOf& t) { return key == t.key; });
    if (known != std::end(kTags)) scalars.push_back({known->tag, float(value.get<double>() * known->scale)});
    else scalars.push_back({"train/" + key, float(value.get<double>())});
  }
  file_.write(scalars_event(wall_time(), metrics["step"].get<int64_t>(), scalars));
}

}  // namespace marrow
