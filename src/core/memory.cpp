#include "core/memory.h"

#include <algorithm>

#include <sys/resource.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <memory>

#include "core/cuda_check.h"

namespace marrow {

namespace {

void* allocate(size_t bytes, Device device, [[maybe_unused]] Stream stream) {
  if (bytes == 0) return nullptr;
  if (device == Device::cpu) {
    void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
    MARROW_CHECK(p != nullptr, "out of host memory allocating {} bytes", bytes);
    return p;
  }
#if MARROW_CUDA
  void* p = nullptr;
  const cudaError_t err = cudaMallocAsync(&p, bytes, static_cast<cudaStream_t>(stream.handle));
  if (err == cudaErrorMemoryAllocation) {
    cudaGetLastError();  // clears the error, so that the message below is the one the run ends with
    size_t free = 0, total = 0;
    if (cudaMemGetInfo(&free, &total) != cudaSuccess) free = total = 0;  // best effort: the sentence below matters, not these
    fail("out of GPU memory allocating {:.1f} MiB ({:.2f} GiB free of {:.2f}); `marrow estimate` with the same config and "
         "overrides gives the bill and the settings that save memory",
         bytes / 1048576.0, free / 1073741824.0, total / 1073741824.0);
  }
  MARROW_CUDA_CHECK(err);
  return p;
#else
  fail("this build of marrow has no CUDA support (configure with -DMARROW_CUDA=ON)");
#endif
}

void deallocate(void* p, Device device, [[maybe_unused]] Stream stream) {
  if (p == nullptr) return;
  if (device == Device::cpu) {
    std::free(p);
    return;
  }
#if MARROW_CUDA
  cudaFreeAsync(p, static_cast<cudaStream_t>(stream.handle));  // status ignored: also runs while an error unwinds
#endif
}

}  // namespace

Buffer::Buffer(DType dtype, Device device, std::initializer_list<int64_t> dims, Stream stream)
    : tensor_(nullptr, dtype, device, dims), stream_(stream) {
  for (int i = 0; i < tensor_.ndim; ++i) MARROW_CHECK(tensor_.shape[i] >= 0, "negative dimension in shape {}", tensor_.shape_string());
  tensor_.data = allocate(tensor_.bytes(), device, stream);
}

Buffer Buffer::zeros(DType dtype, Device device, std::initializer_list<int64_t> dims, Stream stream) {
  Buffer b(dtype, device, dims, stream);
  fill_zero(b.tensor_, stream);
  return b;
}

Buffer& Buffer::operator=(Buffer&& other) noexcept {
  if (this != &other) {
    release();
    tensor_ = other.tensor_;
    stream_ = other.stream_;
    other.tensor_.data = nullptr;
  }
  return *this;
}

void Buffer::release() {
  deallocate(tensor_.data, tensor_.device, stream_);
  tensor_.data = nullptr;
}

void Arena::Free::operator()(void* p) const {
  if (device == Device::cpu) {
    std::free(p);
  } else {
#if MARROW_CUDA
    cudaFree(p);  // cleanup: status ignored (a deleter, which may run while an error unwinds)
#endif
  }
}

Arena::Arena(std::string category, DType dtype, Device device, int64_t numel)
    : category_(std::move(category)), dtype_(dtype), device_(device), numel_(numel), data_(nullptr, Free{device}) {
  size_t bytes = size_t(numel) * dtype_size(dtype);
  if (device == Device::cpu) {
    data_.reset(allocate(bytes, device, {}));
  } else {
#if MARROW_CUDA
    void* p = nullptr;
    cudaError_t err = cudaMalloc(&p, bytes);
    // A sentence naming the arena (the run's memory bill says which one did not fit); CUDA's message in it.
    MARROW_CHECK(err == cudaSuccess, "cannot allocate the {} arena ({:.1f} MiB) on the GPU: {}", category_, bytes / 1048576.0,
                 cudaGetErrorString(err));
    data_.reset(p);
#else
    fail("this build of marrow has no CUDA support (configure with -DMARROW_CUDA=ON)");
#endif
  }
  fill_zero();
}

Arena::~Arena() = default;

Tensor Arena::slice(int64_t offset, std::initializer_list<int64_t> dims) const {
  Tensor t(nullptr, dtype_, device_, dims);
  MARROW_CHECK(offset >= 0 && offset + t.numel() <= numel_, "{} arena: slice [{}, {}) exceeds its {} elements", category_, offset,
               offset + t.numel(), numel_);
  t.data = static_cast<char*>(data_.get()) + size_t(offset) * dtype_size(dtype_);
  return t;
}

void Arena::fill_zero(Stream stream) const { marrow::fill_zero(all(), stream); }

void fill_zero(Tensor t, [[maybe_unused]] Stream stream) {
  if (t.bytes() == 0 || !t.data) return;
  if (t.device == Device::cpu) {
    std::memset(t.data, 0, t.bytes());
  } else {
#if MARROW_CUDA
    MARROW_CUDA_CHECK(cudaMemsetAsync(t.data, 0, t.bytes(), static_cast<cudaStream_t>(stream.handle)));
#endif
  }
}

void Placement::place(int64_t begin, Tensor storage) {
  auto at = std::upper_bound(ranges_.begin(), ranges_.end(), begin, [](int64_t b, const Range& r) { return b < r.begin; });
  MARROW_CHECK(at == ranges_.end() || begin + storage.numel() <= at->begin, "internal: placed ranges overlap at element {}", begin);
  MARROW_CHECK(at == ranges_.begin() || std::prev(at)->begin + std::prev(at)->storage.numel() <= begin,
               "internal: placed ranges overlap at element {}", begin);
  ranges_.insert(at, {begin, storage.reshape({storage.numel()})});
}

void Placement::place_absent(int64_t begin, int64_t numel, DType dtype, Device device) {
  place(begin, Tensor(nullptr, dtype, device, {numel}));
}

Tensor Placement::slice(int64_t offset, std::initializer_list<int64_t> dims) const {
  int64_t n = 1;
  for (int64_t d : dims) n *= d;
  auto at = std::upper_bound(ranges_.begin(), ranges_.end(), offset, [](int64_t b, const Range& r) { return b < r.begin; });
  MARROW_CHECK(at != ranges_.begin(), "internal: no placed range holds element {}", offset);
  const Range& r = *std::prev(at);
  MARROW_CHECK(offset + n <= r.begin + r.storage.numel(), "internal: elements [{}, {}) cross the end of a placed range", offset, offset + n);
  if (r.storage.data == nullptr) return Tensor(nullptr, r.storage.dtype, r.storage.device, dims);
  return r.storage.rows(offset - r.begin, offset - r.begin + n).reshape(dims);
}

void copy(Tensor dst, Tensor src, [[maybe_unused]] Stream stream) {
  MARROW_CHECK(dst.dtype == src.dtype && dst.numel() == src.numel(), "copy: destination {} {} does not match source {} {}",
               dtype_name(dst.dtype), dst.shape_string(), dtype_name(src.dtype), src.shape_string());
  if (src.bytes() == 0) return;
  if (dst.device == Device::cpu && src.device == Device::cpu) {
    std::memmove(dst.data, src.data, src.bytes());
    return;
  }
#if MARROW_CUDA
  auto s = static_cast<cudaStream_t>(stream.handle);
  MARROW_CUDA_CHECK(cudaMemcpyAsync(dst.data, src.data, src.bytes(), cudaMemcpyDefault, s));
  if (dst.device == Device::cpu) MARROW_CUDA_CHECK(cudaStreamSynchronize(s));
#else
  fail("copy: this build of marrow has no CUDA support (configure with -DMARROW_CUDA=ON)");
#endif
}

void PinnedHost::Free::operator()(void* p) const {
#if MARROW_CUDA
  if (pinned) {
    MARROW_CUDA_CHECK(cudaFreeHost(p));
    return;
  }
#endif
  std::free(p);
}

Tensor PinnedHost::tensor(DType dtype, std::initializer_list<int64_t> dims, Device device) {
  Tensor t(nullptr, dtype, Device::cpu, dims);
  const size_t bytes = t.bytes();
  if (bytes > bytes_) {
    const size_t grown = std::max(bytes, bytes_ + bytes_ / 2);
    data_.reset();
    void* p = nullptr;
    const bool pinned = MARROW_CUDA && device == Device::cuda;
#if MARROW_CUDA
    if (pinned) MARROW_CUDA_CHECK(cudaMallocHost(&p, grown));
#endif
    if (!pinned) p = std::aligned_alloc(64, (grown + 63) / 64 * 64);
    MARROW_CHECK(p != nullptr, "out of host memory allocating {} bytes", grown);
    data_ = std::unique_ptr<void, Free>(p, Free{pinned});
    bytes_ = grown;
  }
  t.data = data_.get();
  return t;
}

StreamMark StreamMark::record([[maybe_unused]] Device device, [[maybe_unused]] Stream stream) {
  StreamMark mark;
#if MARROW_CUDA
  if (device == Device::cuda) {
    cudaEvent_t event = nullptr;
    MARROW_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    mark.event_ = std::shared_ptr<void>(event, [](void* e) { cudaEventDestroy(static_cast<cudaEvent_t>(e)); });
    MARROW_CUDA_CHECK(cudaEventRecord(event, static_cast<cudaStream_t>(stream.handle)));
  }
#endif
  return mark;
}

void StreamMark::wait() const {
#if MARROW_CUDA
  if (event_) MARROW_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(event_.get())));
#endif
}

StreamMark copy_to_host_async(Tensor host, Tensor src, Stream stream) {
  MARROW_CHECK(host.device == Device::cpu && host.dtype == src.dtype && host.numel() == src.numel(),
               "copy_to_host_async: destination {} {} on {} does not match source {} {}", dtype_name(host.dtype), host.shape_string(),
               device_name(host.device), dtype_name(src.dtype), src.shape_string());
  if (src.device == Device::cpu) {
    copy(host, src);
    return {};
  }
#if MARROW_CUDA
  MARROW_CUDA_CHECK(cudaMemcpyAsync(host.data, src.data, src.bytes(), cudaMemcpyDeviceToHost, static_cast<cudaStream_t>(stream.handle)));
#endif
  return StreamMark::record(src.device, stream);
}

Buffer to_host(Tensor src, Stream stream) {
  Buffer b(src.dtype, Device::cpu, {src.numel()});
  copy(b, src, stream);
  return b;
}

void synchronize([[maybe_unused]] Stream stream) {
#if MARROW_CUDA
  MARROW_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream.handle)));
#endif
}

bool cuda_available() {
#if MARROW_CUDA
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
#else
  return false;
#endif
}

void use_gpu(int index) {
#if MARROW_CUDA
  int count = 0;
  MARROW_CUDA_CHECK(cudaGetDeviceCount(&count));
  MARROW_CHECK(index < count, "this process is local rank {} but the machine shows {} GPU{}: start at most one process per GPU", index,
               count, count == 1 ? "" : "s");
  MARROW_CUDA_CHECK(cudaSetDevice(index));
#else
  fail("GPU {} asked for, but this build of marrow has no CUDA support (configure with -DMARROW_CUDA=ON)", index);
#endif
}

void keep_pool_memory() {
#if MARROW_CUDA
  int dev = 0;
  cudaMemPool_t pool;
  MARROW_CUDA_CHECK(cudaGetDevice(&dev));
  MARROW_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, dev));
  uint64_t threshold = UINT64_MAX;
  MARROW_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold));
#endif
}

std::string memory_bill(const std::vector<const Arena*>& arenas) {
  std::string s;
  size_t total = 0;
  for (const Arena* a : arenas) {
    s += fmt::format("{}{} {:.1f} MiB", s.empty() ? "" : ", ", a->category(), a->bytes() / 1048576.0);
    total += a->bytes();
  }
  s += fmt::format(" (total {:.1f} MiB)", total / 1048576.0);
#if MARROW_CUDA
  size_t free_bytes = 0, total_bytes = 0;
  if (cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess)
    s += fmt::format("; GPU free {:.1f} of {:.1f} GiB", free_bytes / 1073741824.0, total_bytes / 1073741824.0);
#endif
  return s;
}

size_t device_memory_bytes(Device device, [[maybe_unused]] int gpu) {
  if (device == Device::cpu) {
    const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
    return pages > 0 && page > 0 ? size_t(pages) * size_t(page) : 0;
  }
#if MARROW_CUDA
  cudaDeviceProp properties{};
  if (cudaGetDeviceProperties(&properties, gpu) == cudaSuccess) return properties.totalGlobalMem;
#endif
  return 0;
}

size_t peak_memory_bytes(Device device) {
  if (device == Device::cpu) {
    struct rusage usage {};
    getrusage(RUSAGE_SELF, &usage);
    return size_t(usage.ru_maxrss) * 1024;
  }
#if MARROW_CUDA
  cudaMemPool_t pool;
  int dev = 0;
  MARROW_CUDA_CHECK(cudaGetDevice(&dev));
  MARROW_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, dev));
  uint64_t high = 0;
  MARROW_CUDA_CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &high));
  return size_t(high);
#else
  return 0;
#endif
}

}  // namespace marrow
