#include "engine/memory_guard.h"

#include "core/errors.h"

namespace marrow {

namespace {

constexpr double kBytesPerTableEntry = 160;     // a TensorSpec: name, shape, offsets

std::string gib(double bytes) { return fmt::format("{:.4g} GiB", bytes / 1073741824.0); }

}  // namespace

void check_state_fits(const ModelSize& size, int64_t processes, Device device, int gpu, int moment_bytes) {
  const int each = 8 + 2 * moment_bytes;  // fp32 weights and gradients, exp_avg, exp_avg_sq
  const double state = size.parameters * each, share = state / double(processes);
  const std::string kind = moment_bytes == 4 ? "fp32 training state" : "training state (bf16 moments)";
  const double table = size.tensors * kBytesPerTableEntry;
  const std::string spread = processes > 1 ? fmt::format(", {} per process over {}", gib(share), processes) : "";
  // The table always lives in host memory; the state on the run's device (host memory on the CPU).
  const double host = double(device_memory_bytes(Device::cpu)), gpu_bytes = double(device_memory_bytes(device, gpu));
  const double on_host = table + (device == Device::cpu ? share : 0);
  MARROW_CHECK(host == 0 || on_host <= host,
               "the model cannot fit: {:.4g} parameters need {} of {} ({} bytes each){} plus {} for their table of "
               "{:.4g} tensors, more than the {} of this machine; `marrow estimate` gives the whole bill",
               size.parameters, gib(state), kind, each, spread, gib(table), size.tensors, gib(host));
  MARROW_CHECK(device == Device::cpu || gpu_bytes == 0 || share <= gpu_bytes,
               "the model cannot fit: {:.4g} parameters need {} of {} ({} bytes each){}, more than the {} of this GPU; "
               "`marrow estimate` gives the whole bill", size.parameters, gib(state), kind, each, spread, gib(gpu_bytes));
}

}  // namespace marrow
