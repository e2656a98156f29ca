#include "engine/memory_guard.h"

#include "core/errors.h"

namespace marrow {

namespace {

constexpr double kStateBytesPerParameter = 16;  // fp32 weights, gradients, exp_avg, exp_avg_sq
constexpr double kBytesPerTableEntry = 160;     // a TensorSpec: name, shape, offsets

std::string gib(double bytes) { return fmt::format("{:.4g} GiB", bytes / 1073741824.0); }

}  // namespace

void check_state_fits(const ModelSize& size, int64_t processes, Device device, int gpu) {
  const double available = double(device_memory_bytes(device, gpu));
  const double state = size.parameters * kStateBytesPerParameter, table = size.tensors * kBytesPerTableEntry;
  const double need = state / double(processes) + table;
  MARROW_CHECK(available == 0 || need <= available,
               "the model cannot fit: {:.4g} parameters need {} of fp32 training state (16 bytes each){} plus {} for their table of "
               "{:.4g} tensors, more than the {} of this {}; `marrow estimate` gives the whole bill",
               size.parameters, gib(state), processes > 1 ? fmt::format(", {} per process over {}", gib(state / double(processes)), processes) : "",
               gib(table), size.tensors, gib(available), device == Device::cpu ? "machine" : "GPU");
}

}  // namespace marrow
