// Owners of device and host memory.
//
// Arena: one allocation per category (parameters, gradients, optimizer state), carved into tensors
// from a table of offsets computed once at start; the run prints the bill of all arenas.
// Buffer: one activation-sized allocation that frees itself; on the GPU it comes from CUDA's
// stream-ordered pool so a freed buffer is reused without a device synchronisation.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace marrow {

class Buffer {
 public:
  Buffer() = default;
  Buffer(DType dtype, Device device, std::initializer_list<int64_t> dims, Stream stream = {});
  Buffer(Buffer&& other) noexcept { *this = std::move(other); }
  Buffer& operator=(Buffer&& other) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() { release(); }

  static Buffer zeros(DType dtype, Device device, std::initializer_list<int64_t> dims, Stream stream = {});

  Tensor view() const { return tensor_; }
  operator Tensor() const { return tensor_; }
  template <typename T> T* ptr() const { return tensor_.ptr<T>(); }
  int64_t numel() const { return tensor_.numel(); }
  void release();

 private:
  Tensor tensor_;
  Stream stream_;
};

class Arena {
 public:
  Arena(std::string category, DType dtype, Device device, int64_t numel);
  Arena(Arena&&) = default;
  Arena& operator=(Arena&&) = default;
  ~Arena();

  // The elements [offset, offset + prod(dims)) seen as a tensor of shape dims.
  Tensor slice(int64_t offset, std::initializer_list<int64_t> dims) const;
  Tensor all() const { return Tensor(data_.get(), dtype_, device_, {numel_}); }
  void fill_zero(Stream stream = {}) const;
  const std::string& category() const { return category_; }
  size_t bytes() const { return size_t(numel_) * dtype_size(dtype_); }

 private:
  struct Free {
    Device device;
    void operator()(void* p) const;
  };
  std::string category_;
  DType dtype_;
  Device device_;
  int64_t numel_;
  std::unique_ptr<void, Free> data_;
};

// Where the elements of a model's parameter layout live when not all in one arena (FSDP's buffers):
// element o of a placed range [begin, end) is element o - begin of its storage.
class Placement {
 public:
  Placement() = default;
  Placement(const Arena& arena) { place(0, arena.all()); }  // NOLINT: an arena is the one-range placement
  // Elements [begin, begin + storage.numel()) live in storage (a flat view); ranges must not overlap.
  void place(int64_t begin, Tensor storage);
  // Elements [begin, begin + numel) are another pipeline rank's: their slices have no data.
  void place_absent(int64_t begin, int64_t numel, DType dtype, Device device);
  // Elements [offset, offset + prod(dims)) seen as a tensor of shape dims; they must lie in one range.
  Tensor slice(int64_t offset, std::initializer_list<int64_t> dims) const;

 private:
  struct Range {
    int64_t begin;
    Tensor storage;
  };
  std::vector<Range> ranges_;  // sorted by begin
};

// Sets every byte of t to zero (0.0 in every float dtype), in stream order on the GPU.
void fill_zero(Tensor t, Stream stream = {});

// Copies src into dst: same dtype and element count, any pair of devices. On the GPU the copy is
// queued on stream; a copy to the host waits for it, so the host can read the result at once.
void copy(Tensor dst, Tensor src, Stream stream = {});

// Page-locked host memory that grows to the largest size asked for and keeps its pages: the host
// side of copies that must not wait for the GPU's queue (pageable memory may). A growth frees the
// old pages, so no queued copy may still use them.
class PinnedHost {
 public:
  PinnedHost() = default;
  PinnedHost(PinnedHost&&) = default;
  PinnedHost& operator=(PinnedHost&&) = default;
  // A host tensor of dims over this memory, page-locked when its copies involve `device` = cuda.
  Tensor tensor(DType dtype, std::initializer_list<int64_t> dims, Device device);

 private:
  struct Free {
    bool pinned;  // no default initializer: unique_ptr needs Free default-constructible here
    void operator()(void* p) const;
  };
  std::unique_ptr<void, Free> data_{nullptr, Free{false}};
  size_t bytes_ = 0;
};

// A point in a GPU stream's queue that the host can wait for alone, without waiting for what was
// queued after it (nothing to wait for on the CPU).
class StreamMark {
 public:
  static StreamMark record(Device device, Stream stream = {});
  void wait() const;

 private:
  std::shared_ptr<void> event_;
};

// Queues a copy of src (any device) into `host` (page-locked: PinnedHost) on `stream` and returns
// the point to wait at before reading it.
StreamMark copy_to_host_async(Tensor host, Tensor src, Stream stream = {});

// A host copy of a tensor on any device, e.g. to read a loss or check a kernel.
Buffer to_host(Tensor src, Stream stream = {});

// Waits until all work queued on the GPU stream is done; call it only for GPU work (a build with
// CUDA on a machine without a GPU has no driver to ask).
void synchronize(Stream stream = {});

// Whether this build has CUDA and a GPU is visible.
bool cuda_available();

// Makes GPU `index` this process's device (one process per GPU: the local rank); one sentence when
// the machine has fewer GPUs.
void use_gpu(int index);

// Keeps freed activation memory cached in CUDA's stream-ordered pool instead of returning it to the
// driver at every synchronisation (DESIGN.md §4); call once before training on the GPU.
void keep_pool_memory();

// "parameters 12.3 MiB, gradients 12.3 MiB, ... (total 49.2 MiB)" and, on a GPU, free memory.
std::string memory_bill(const std::vector<const Arena*>& arenas);

// Peak bytes in use on the device so far (host: resident set high-water mark).
size_t peak_memory_bytes(Device device);

// The memory a device has in all: the machine's physical memory (cpu), or GPU `gpu`'s (cuda; read
// from its properties, which creates no context on it). 0 when unknown.
size_t device_memory_bytes(Device device, int gpu = 0);

}  // namespace marrow
