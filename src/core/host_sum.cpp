#include "core/host_sum.h"

#include <mutex>

#include "core/errors.h"

namespace marrow {

// Page-locked host memory is slow to allocate and to free (cudaFreeHost waits for the device), so
// the slots of finished parts go back to a pool. A slot taken again first waits for its last copy,
// which by then has long finished.
struct HostSum::Slot {
  PinnedHost memory;
  StreamMark last_copy;
};

namespace {

std::mutex pool_mutex;
std::vector<std::unique_ptr<HostSum::Slot>>& pool() {
  static std::vector<std::unique_ptr<HostSum::Slot>> slots;
  return slots;
}

}  // namespace

void HostSum::add(Tensor t, Stream stream) {
  MARROW_CHECK(t.dtype == DType::f32 || t.dtype == DType::f64, "HostSum::add: the tensor must be f32 or f64, got {}", dtype_name(t.dtype));
  std::unique_ptr<Slot> taken;
  {
    std::lock_guard lock(pool_mutex);
    if (!pool().empty()) {
      taken = std::move(pool().back());
      pool().pop_back();
    }
  }
  if (!taken) taken = std::make_unique<Slot>();
  taken->last_copy.wait();
  Part part;
  part.host = taken->memory.tensor(t.dtype, {t.numel()}, t.device);
  part.copied = copy_to_host_async(part.host, t, stream);
  taken->last_copy = part.copied;
  part.slot = std::shared_ptr<Slot>(taken.release(), [](Slot* s) {
    std::lock_guard lock(pool_mutex);
    pool().emplace_back(s);
  });
  parts_.push_back(std::move(part));
}

void HostSum::add(HostSum part) {
  Part p;
  p.nested.push_back(std::move(part));
  parts_.push_back(std::move(p));
}

double HostSum::value() const {
  double total = 0;
  for (const Part& p : parts_) {
    if (!p.nested.empty()) {
      total += p.nested.front().value();
      continue;
    }
    p.copied.wait();
    double sum = 0;
    for (int64_t i = 0; i < p.host.numel(); ++i) sum += p.host.dtype == DType::f64 ? p.host.ptr<double>()[i] : p.host.ptr<float>()[i];
    total += sum;
  }
  return total;
}

}  // namespace marrow
