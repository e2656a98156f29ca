// Kernel traces: `marrow train/bench --profile-steps A:B` records every kernel, memcpy and memset
// of steps A..B with CUPTI, plus the steps' and stages' NVTX ranges, writes them as a Chrome trace
// (ui.perfetto.dev) and prints the heaviest kernels. Plain records, so tests need no GPU.
#pragma once
#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace marrow {

enum class ActivityKind : int { kernel, memcpy, memset, range };

struct KernelRecord {
  std::string name;  // kernels: as CUPTI reports it (mangled); copies: "memcpy HtoD"; ranges: the NVTX name
  uint64_t start_ns = 0, end_ns = 0;
  uint32_t device = 0;
  uint32_t stream = 0;  // the CUDA stream; for NVTX ranges, the host thread
  ActivityKind kind = ActivityKind::kernel;
  std::array<int32_t, 3> grid{}, block{};  // kernels only
  uint64_t bytes = 0;                      // copies and sets only
};

// A kernel's name as the trace and the table show it: demangled (the raw name when it is not a
// mangled C++ name), without the return type, the parameter list and "(anonymous namespace)::".
std::string kernel_display_name(const std::string& raw);

// Chrome trace JSON (one complete event per record, microseconds from the first; pid = device, tid
// = stream, NVTX ranges under the host process), written to <path>.tmp and renamed.
void write_chrome_trace(const std::string& path, const std::vector<KernelRecord>& records);

struct KernelStat {
  std::string name;  // kernel_display_name
  int64_t calls = 0;
  double total_ms = 0, mean_us = 0;
  double share = 0;  // of all kernels' time, 0..1
};

// The kernels aggregated by display name, heaviest total first (ties by name); at most n rows.
std::vector<KernelStat> top_kernels(const std::vector<KernelRecord>& records, size_t n);

// The n heaviest kernels as a table, then the rest of the kernels, their total, and the copies.
std::string kernel_table(const std::vector<KernelRecord>& records, size_t n = 10);

// How much of each NCCL kernel's time passed while a compute kernel (any other) ran on the same GPU.
struct CommunicationOverlap {
  std::string name;  // kernel_display_name
  int64_t calls = 0;
  double total_ms = 0, hidden_ms = 0;
};
std::vector<CommunicationOverlap> communication_overlap(const std::vector<KernelRecord>& records);
std::string communication_table(const std::vector<CommunicationOverlap>& rows);
// Per GPU: the time some compute kernel ran, of the time from the first kernel to the last (the
// rest is idle: a pipeline's bubble, waits for other processes, the host).
std::string compute_busy_lines(const std::vector<KernelRecord>& records);

// Writes the trace to path and prints where it is, the top-10 table and the communication overlap.
void report_trace(const std::vector<KernelRecord>& records, const std::string& path);

// Collects the GPU's activity between start() and stop() through CUPTI. Construct it before the
// process's first NVTX range (NVTX binds its tool on its first call). Any failure (no CUDA, a CPU
// run) is an Error with one sentence.
class KernelTrace {
 public:
  explicit KernelTrace(Device device);
  ~KernelTrace();
  KernelTrace(const KernelTrace&) = delete;
  KernelTrace& operator=(const KernelTrace&) = delete;

  void start();
  // Call after the traced work has been synchronised: returns everything recorded since start().
  std::vector<KernelRecord> stop();
  bool running() const { return running_; }

 private:
  bool running_ = false;
};

// An NVTX range for the lifetime of the scope (nothing in builds without CUDA).
class NvtxRange {
 public:
  explicit NvtxRange(const std::string& name);
  ~NvtxRange();
  NvtxRange(const NvtxRange&) = delete;
  NvtxRange& operator=(const NvtxRange&) = delete;
};

}  // namespace marrow
