#include "engine/kernel_trace.h"

#include <cxxabi.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <set>

#include "core/json.h"

#if MARROW_CUDA
#include <cupti.h>
#include <link.h>
#include <nvtx3/nvToolsExt.h>

#include <mutex>
#include <unordered_map>

#define MARROW_CUPTI_CHECK(call) MARROW_CHECK_RESULT(call, #call, ::marrow::cupti_failed, ::marrow::cupti_message)

namespace marrow {
namespace {
bool cupti_failed(CUptiResult r) { return r != CUPTI_SUCCESS; }
const char* cupti_message(CUptiResult r) {
  const char* message = "unknown CUPTI error";
  cuptiGetResultString(r, &message);
  return message;
}
}  // namespace
}  // namespace marrow
#endif

namespace marrow {

namespace {

const char* kind_name(ActivityKind kind) {
  switch (kind) {
    case ActivityKind::kernel: return "kernel";
    case ActivityKind::memcpy: return "memcpy";
    case ActivityKind::memset: return "memset";
    case ActivityKind::range: return "nvtx";
  }
  return "?";
}

double duration_ns(const KernelRecord& r) { return r.end_ns > r.start_ns ? double(r.end_ns - r.start_ns) : 0.0; }

}  // namespace

std::vector<KernelStat> top_kernels(const std::vector<KernelRecord>& records, size_t n) {
  std::map<std::string, KernelStat> by_name;
  double total_ms = 0;
  for (const KernelRecord& r : records) {
    if (r.kind != ActivityKind::kernel) continue;
    const std::string name = kernel_display_name(r.name);
    KernelStat& s = by_name[name];
    s.name = name;
    s.calls += 1;
    s.total_ms += duration_ns(r) / 1e6;
    total_ms += duration_ns(r) / 1e6;
  }
  std::vector<KernelStat> rows;
  for (auto& [name, s] : by_name) {
    s.mean_us = s.total_ms * 1e3 / double(s.calls);
    s.share = total_ms > 0 ? s.total_ms / total_ms : 0;
    rows.push_back(s);
  }
  std::stable_sort(rows.begin(), rows.end(), [](const KernelStat& a, const KernelStat& b) { return a.total_ms > b.total_ms; });
  if (rows.size() > n) rows.resize(n);
  return rows;
}

std::string kernel_display_name(const std::string& raw) {
  int status = 0;
  std::unique_ptr<char, decltype(&std::free)> demangled(abi::__cxa_demangle(raw.c_str(), nullptr, nullptr, &status), &std::free);
  std::string name = status == 0 && demangled ? demangled.get() : raw;
  // Template kernels demangle with their return type and every parameter type: neither tells two
  // kernels apart, and both make the table unreadable.
  if (!name.empty() && name.back() == ')') {
    int depth = 0;
    for (size_t i = name.size(); i-- > 0;) {
      depth += name[i] == ')' ? 1 : name[i] == '(' ? -1 : 0;
      if (depth == 0) {
        name.resize(i);
        break;
      }
    }
  }
  if (name.starts_with("void ")) name.erase(0, 5);
  const std::string anonymous = "(anonymous namespace)::";
  for (size_t at; (at = name.find(anonymous)) != std::string::npos;) name.erase(at, anonymous.size());
  return name.empty() ? raw : name;
}

void write_chrome_trace(const std::string& path, const std::vector<KernelRecord>& records) {
  uint64_t t0 = UINT64_MAX;
  int64_t host = 0;  // NVTX ranges go to a process of their own, after the GPUs
  for (const KernelRecord& r : records) {
    t0 = std::min(t0, r.start_ns);
    if (r.kind != ActivityKind::range) host = std::max(host, int64_t(r.device) + 1);
  }
  const std::string tmp = path + ".tmp";
  std::ofstream out(tmp, std::ios::trunc);
  MARROW_CHECK(out.good(), "cannot write {}", tmp);
  // One event per line rather than write_json_file's indented dump: traces of many steps stay
  // half the size, and a name that is not UTF-8 is replaced instead of failing the run.
  bool first = true;
  auto emit = [&](const Json& event) {
    out << (first ? "\n" : ",\n") << event.dump(-1, ' ', false, Json::error_handler_t::replace);
    first = false;
  };
  out << "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[";
  std::set<std::pair<int64_t, uint32_t>> tracks;
  for (const KernelRecord& r : records) {
    const int64_t pid = r.kind == ActivityKind::range ? host : int64_t(r.device);
    Json event{{"name", r.kind == ActivityKind::kernel ? kernel_display_name(r.name) : r.name},
               {"cat", kind_name(r.kind)},
               {"ph", "X"},
               {"ts", double(r.start_ns - t0) / 1e3},
               {"dur", duration_ns(r) / 1e3},
               {"pid", pid},
               {"tid", r.stream}};
    if (r.kind == ActivityKind::kernel)
      event["args"] = {{"grid", fmt::format("{}x{}x{}", r.grid[0], r.grid[1], r.grid[2])},
                       {"block", fmt::format("{}x{}x{}", r.block[0], r.block[1], r.block[2])}};
    else if (r.kind != ActivityKind::range)
      event["args"] = {{"bytes", r.bytes}};
    emit(event);
    tracks.insert({pid, r.stream});
  }
  std::set<int64_t> named;
  for (const auto& [pid, tid] : tracks) {
    const bool is_host = pid == host;
    if (named.insert(pid).second)
      emit({{"name", "process_name"}, {"ph", "M"}, {"pid", pid},
            {"args", {{"name", is_host ? "host: NVTX ranges" : fmt::format("GPU {}", pid)}}}});
    emit({{"name", "thread_name"}, {"ph", "M"}, {"pid", pid}, {"tid", tid},
          {"args", {{"name", fmt::format("{} {}", is_host ? "thread" : "stream", tid)}}}});
  }
  out << "\n]}\n";
  out.close();
  MARROW_CHECK(out.good(), "error while writing {}", tmp);
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  MARROW_CHECK(!ec, "cannot rename {} to {}: {}", tmp, path, ec.message());
}

std::string kernel_table(const std::vector<KernelRecord>& records, size_t n) {
  const std::vector<KernelStat> rows = top_kernels(records, SIZE_MAX);
  constexpr size_t kWidth = 72;
  auto row = [&](const std::string& name, int64_t calls, double ms, const std::string& mean, const std::string& share) {
    const std::string shown = name.size() > kWidth ? name.substr(0, kWidth - 3) + "..." : name;
    std::string line = fmt::format("{:<{}} {:>8} {:>11.3f} {:>10} {:>7}", shown, kWidth, calls, ms, mean, share);
    return line.erase(line.find_last_not_of(' ') + 1) + "\n";
  };
  auto percent = [](double share) { return fmt::format("{:.1f}%", 100 * share); };
  std::string table = fmt::format("{:<{}} {:>8} {:>11} {:>10} {:>7}\n", fmt::format("top {} kernels by total time", n), kWidth,
                                  "calls", "total ms", "mean us", "share");
  int64_t calls = 0, other_calls = 0;
  double ms = 0, other_ms = 0, other_share = 0;
  for (size_t i = 0; i < rows.size(); ++i) {
    const KernelStat& s = rows[i];
    calls += s.calls;
    ms += s.total_ms;
    if (i < n) {
      table += row(s.name, s.calls, s.total_ms, fmt::format("{:.1f}", s.mean_us), percent(s.share));
    } else {
      other_calls += s.calls;
      other_ms += s.total_ms;
      other_share += s.share;
    }
  }
  if (rows.size() > n) table += row(fmt::format("other {} kernels", rows.size() - n), other_calls, other_ms, "", percent(other_share));
  table += row(fmt::format("all {} kernels", rows.size()), calls, ms, "", percent(rows.empty() ? 0 : 1));
  int64_t copies = 0;
  double copy_ms = 0;
  for (const KernelRecord& r : records)
    if (r.kind == ActivityKind::memcpy || r.kind == ActivityKind::memset) {
      copies += 1;
      copy_ms += duration_ns(r) / 1e6;
    }
  if (copies > 0) table += row("memcpy and memset", copies, copy_ms, "", "");
  return table;
}

namespace {

// CUPTI reports NCCL's kernels mangled ("_Z22ncclDevKernel_SendRecv..." on some versions).
bool is_communication(const KernelRecord& r) {
  return r.kind == ActivityKind::kernel && kernel_display_name(r.name).starts_with("nccl");
}

// The union of a device's compute kernels' intervals, sorted and disjoint.
std::vector<std::pair<uint64_t, uint64_t>> compute_busy(const std::vector<KernelRecord>& records, uint32_t device) {
  std::vector<std::pair<uint64_t, uint64_t>> spans, merged;
  for (const KernelRecord& r : records)
    if (r.kind == ActivityKind::kernel && !is_communication(r) && r.device == device) spans.push_back({r.start_ns, r.end_ns});
  std::sort(spans.begin(), spans.end());
  for (const auto& s : spans)
    if (!merged.empty() && s.first <= merged.back().second) merged.back().second = std::max(merged.back().second, s.second);
    else merged.push_back(s);
  return merged;
}

uint64_t covered_ns(const std::vector<std::pair<uint64_t, uint64_t>>& busy, uint64_t start, uint64_t end) {
  uint64_t covered = 0;
  auto at = std::upper_bound(busy.begin(), busy.end(), std::pair<uint64_t, uint64_t>{start, 0});
  if (at != busy.begin()) --at;
  for (; at != busy.end() && at->first < end; ++at)
    if (at->second > start) covered += std::min(end, at->second) - std::max(start, at->first);
  return covered;
}

}  // namespace

std::vector<CommunicationOverlap> communication_overlap(const std::vector<KernelRecord>& records) {
  std::map<uint32_t, std::vector<std::pair<uint64_t, uint64_t>>> busy;
  std::map<std::string, CommunicationOverlap> rows;
  for (const KernelRecord& r : records) {
    if (!is_communication(r)) continue;
    if (!busy.count(r.device)) busy[r.device] = compute_busy(records, r.device);
    CommunicationOverlap& row = rows[kernel_display_name(r.name)];
    row.calls += 1;
    row.total_ms += duration_ns(r) / 1e6;
    row.hidden_ms += covered_ns(busy[r.device], r.start_ns, r.end_ns) / 1e6;
  }
  std::vector<CommunicationOverlap> out;
  for (auto& [name, row] : rows) {
    row.name = name;
    out.push_back(row);
  }
  return out;
}

std::string communication_table(const std::vector<CommunicationOverlap>& rows) {
  if (rows.empty()) return "";
  std::string table = fmt::format("{:<60} {:>8} {:>11} {:>11} {:>7}\n", "communication kernels (NCCL)", "calls", "total ms", "hidden ms", "hidden");
  CommunicationOverlap all{"all communication", 0, 0, 0};
  for (const CommunicationOverlap& r : rows) {
    all.calls += r.calls;
    all.total_ms += r.total_ms;
    all.hidden_ms += r.hidden_ms;
  }
  std::vector<CommunicationOverlap> shown = rows;
  shown.push_back(all);
  for (const CommunicationOverlap& r : shown)
    table += fmt::format("{:<60} {:>8} {:>11.3f} {:>11.3f} {:>6.1f}%\n", r.name.substr(0, 60), r.calls, r.total_ms, r.hidden_ms,
                         r.total_ms > 0 ? 100 * r.hidden_ms / r.total_ms : 0.0);
  return table;
}

std::string compute_busy_lines(const std::vector<KernelRecord>& records) {
  std::map<uint32_t, std::pair<uint64_t, uint64_t>> span;  // per device: first start, last end
  for (const KernelRecord& r : records) {
    if (r.kind != ActivityKind::kernel) continue;
    auto [at, added] = span.try_emplace(r.device, r.start_ns, r.end_ns);
    if (!added) at->second = {std::min(at->second.first, r.start_ns), std::max(at->second.second, r.end_ns)};
  }
  std::string out;
  for (const auto& [device, s] : span) {
    uint64_t busy = 0;
    for (const auto& b : compute_busy(records, device)) busy += b.second - b.first;
    const double total = double(s.second - s.first);
    out += fmt::format("compute kernels on GPU {}: busy {:.3f} ms of the {:.3f} ms from the first kernel to the last ({:.1f}% idle)\n",
                       device, busy / 1e6, total / 1e6, total > 0 ? 100 * (1 - busy / total) : 0.0);
  }
  return out;
}

void report_trace(const std::vector<KernelRecord>& records, const std::string& path) {
  write_chrome_trace(path, records);
  const auto ranges = std::count_if(records.begin(), records.end(), [](const KernelRecord& r) { return r.kind == ActivityKind::range; });
  std::printf("kernel trace: %s (%zu records, %zu of them NVTX ranges; open it in ui.perfetto.dev)\n%s%s", path.c_str(), records.size(),
              size_t(ranges), kernel_table(records).c_str(),
              (communication_table(communication_overlap(records)) + compute_busy_lines(records)).c_str());
  std::fflush(stdout);
}

#if MARROW_CUDA

namespace {

constexpr CUpti_ActivityKind kKinds[] = {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMCPY, CUPTI_ACTIVITY_KIND_MEMSET,
                                         CUPTI_ACTIVITY_KIND_MARKER};
constexpr size_t kBufferBytes = size_t(8) << 20;

// An NVTX push or pop as CUPTI reports it; pushes and pops are paired by id once all are in.
struct Marker {
  uint32_t id = 0, thread = 0;
  bool start = false;
  uint64_t timestamp = 0;
  std::string name;
};

// CUPTI hands over filled buffers on its own thread, so what they hold is guarded.
struct Collector {
  std::mutex mutex;
  std::vector<KernelRecord> records;
  std::vector<Marker> markers;
  size_t dropped = 0;
  std::string error;  // the first CUPTI failure inside a callback (which cannot throw), for stop()'s warning
};

// Never destroyed: CUPTI may hand back its last buffers while the process exits.
Collector& collector() {
  static Collector* c = new Collector;
  return *c;
}

const char* copy_kind(uint8_t kind) {
  switch (kind) {
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOD: return "memcpy HtoD";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOH: return "memcpy DtoH";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOD: return "memcpy DtoD";
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOH: return "memcpy HtoH";
    case CUPTI_ACTIVITY_MEMCPY_KIND_PTOP: return "memcpy PtoP";
    default: return "memcpy";
  }
}

void add(Collector& c, const CUpti_Activity* record) {
  KernelRecord r;
  switch (record->kind) {
    case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
      const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
      r = {k->name ? k->name : "(unnamed kernel)", k->start, k->end, k->deviceId, k->streamId, ActivityKind::kernel,
           {k->gridX, k->gridY, k->gridZ}, {k->blockX, k->blockY, k->blockZ}};
      break;
    }
    case CUPTI_ACTIVITY_KIND_MEMCPY: {
      const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(record);
      r = {copy_kind(m->copyKind), m->start, m->end, m->deviceId, m->streamId, ActivityKind::memcpy};
      r.bytes = m->bytes;
      break;
    }
    case CUPTI_ACTIVITY_KIND_MEMSET: {
      const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(record);
      r = {"memset", m->start, m->end, m->deviceId, m->streamId, ActivityKind::memset};
      r.bytes = m->bytes;
      break;
    }
    case CUPTI_ACTIVITY_KIND_MARKER: {
      const auto* m = reinterpret_cast<const CUpti_ActivityMarker2*>(record);
      const bool start = m->flags & CUPTI_ACTIVITY_FLAG_MARKER_START;
      if (start || (m->flags & CUPTI_ACTIVITY_FLAG_MARKER_END))
        c.markers.push_back({m->id, m->objectKind == CUPTI_ACTIVITY_OBJECT_THREAD ? m->objectId.pt.threadId : 0, start, m->timestamp,
                             m->name ? m->name : ""});
      return;
    }
    default: return;
  }
  // Both timestamps 0: CUPTI had no device memory left to time it.
  if (r.start_ns == 0 && r.end_ns == 0) c.dropped += 1;
  else c.records.push_back(std::move(r));
}

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  // CUPTI wants 8-byte aligned buffers; a null one makes it drop records, which stop() reports.
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
  *size = kBufferBytes;
  *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid_bytes) {
  Collector& c = collector();
  {
    std::lock_guard lock(c.mutex);
    CUpti_Activity* record = nullptr;
    CUptiResult status = CUPTI_SUCCESS;
    while ((status = cuptiActivityGetNextRecord(buffer, valid_bytes, &record)) == CUPTI_SUCCESS) add(c, record);
    size_t dropped = 0;
    const CUptiResult counted = cuptiActivityGetNumDroppedRecords(nullptr, 0, &dropped);
    if (counted == CUPTI_SUCCESS) c.dropped += dropped;
    // The buffer's end reads as MAX_LIMIT_REACHED; any other status cut its records short.
    for (const CUptiResult r : {status == CUPTI_ERROR_MAX_LIMIT_REACHED ? CUPTI_SUCCESS : status, counted}) {
      const char* text = nullptr;
      if (r != CUPTI_SUCCESS && c.error.empty()) c.error = cuptiGetResultString(r, &text) == CUPTI_SUCCESS && text ? text : "unknown";
    }
  }
  std::free(buffer);
}

std::string loaded_cupti() {
  std::string path;
  dl_iterate_phdr(
      [](dl_phdr_info* info, size_t, void* out) {
        if (!info->dlpi_name || !std::strstr(info->dlpi_name, "/libcupti.so")) return 0;
        *static_cast<std::string*>(out) = info->dlpi_name;
        return 1;
      },
      &path);
  return path;
}

}  // namespace

KernelTrace::KernelTrace(Device device) {
  MARROW_CHECK(device == Device::cuda, "--profile-steps traces GPU kernels, but this run computes on the CPU");
  // NVTX binds the library named by NVTX_INJECTION64_PATH on the process's first NVTX call: naming
  // the libcupti this binary loaded makes CUPTI see the step and stage ranges. A profiler that set
  // it already (Nsight Systems) keeps it.
  const std::string cupti = loaded_cupti();
  if (!cupti.empty()) setenv("NVTX_INJECTION64_PATH", cupti.c_str(), 0);
  MARROW_CUPTI_CHECK(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed));
}

KernelTrace::~KernelTrace() {
  if (!running_) return;
  // cleanup: statuses ignored (a destructor, which may run while an error unwinds)
  for (CUpti_ActivityKind kind : kKinds) cuptiActivityDisable(kind);
  cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
}

void KernelTrace::start() {
  Collector& c = collector();
  {
    std::lock_guard lock(c.mutex);
    c.records.clear();
    c.markers.clear();
    c.dropped = 0;
    c.error.clear();
  }
  running_ = true;
  for (CUpti_ActivityKind kind : kKinds) MARROW_CUPTI_CHECK(cuptiActivityEnable(kind));
}

std::vector<KernelRecord> KernelTrace::stop() {
  running_ = false;
  for (CUpti_ActivityKind kind : kKinds) MARROW_CUPTI_CHECK(cuptiActivityDisable(kind));
  MARROW_CUPTI_CHECK(cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED));
  Collector& c = collector();
  std::lock_guard lock(c.mutex);
  std::vector<KernelRecord> records = std::move(c.records);
  c.records.clear();
  std::unordered_map<uint32_t, const Marker*> open;
  for (const Marker& m : c.markers) {
    if (m.start) {
      open[m.id] = &m;
    } else if (auto it = open.find(m.id); it != open.end()) {
      records.push_back({it->second->name, it->second->timestamp, m.timestamp, 0, m.thread, ActivityKind::range});
      open.erase(it);
    }
  }
  c.markers.clear();
  if (c.dropped > 0)
    std::fprintf(stderr, "warning: CUPTI dropped or could not time %zu activity records: the kernel trace is incomplete\n", c.dropped);
  if (!c.error.empty())
    std::fprintf(stderr, "warning: CUPTI failed while handing back activity records (%s): the kernel trace is incomplete\n",
                 c.error.c_str());
  return records;
}

NvtxRange::NvtxRange(const std::string& name) { nvtxRangePushA(name.c_str()); }
NvtxRange::~NvtxRange() { nvtxRangePop(); }

#else

KernelTrace::KernelTrace(Device) {
  fail("--profile-steps records kernels with CUPTI, and this build has no CUDA support (configure with -DMARROW_CUDA=ON)");
}
KernelTrace::~KernelTrace() = default;
// Unreachable: the constructor fails.
void KernelTrace::start() {}
std::vector<KernelRecord> KernelTrace::stop() { return {}; }

NvtxRange::NvtxRange(const std::string&) {}
NvtxRange::~NvtxRange() = default;

#endif

}  // namespace marrow
