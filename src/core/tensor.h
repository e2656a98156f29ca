// Tensor: a non-owning view of a dense, row-major array of up to 4 dimensions on one device.
// Views never free memory; owners are the arenas (parameters, gradients, optimizer state) and
// Buffer (activations). Ops take views and check shapes and dtypes at entry with the helpers
// below, naming the tensors in their messages.
#pragma once
#include <array>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <string>
#include <vector>

#include "core/errors.h"

namespace marrow {

// f64 exists for the CPU reference only: gradient checks run the same code in double precision.
// u16 holds the low halves of fp32 master weights kept split (core/split_f32.h).
enum class DType : uint8_t { f32, f64, bf16, i32, i64, fp8_e4m3, u16, u8 };
enum class Device : uint8_t { cpu, cuda };

inline size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32: return 4;
    case DType::f64: return 8;
    case DType::bf16: return 2;
    case DType::i32: return 4;
    case DType::i64: return 8;
    case DType::fp8_e4m3: return 1;
    case DType::u16: return 2;
    case DType::u8: return 1;
  }
  return 0;
}

inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "f32";
    case DType::f64: return "f64";
    case DType::bf16: return "bf16";
    case DType::i32: return "i32";
    case DType::i64: return "i64";
    case DType::fp8_e4m3: return "fp8_e4m3";
    case DType::u16: return "u16";
    case DType::u8: return "u8";
  }
  return "?";
}

inline const char* device_name(Device d) { return d == Device::cpu ? "cpu" : "cuda"; }

template <typename T> constexpr DType dtype_of();
template <> constexpr DType dtype_of<float>() { return DType::f32; }
template <> constexpr DType dtype_of<double>() { return DType::f64; }
template <> constexpr DType dtype_of<int32_t>() { return DType::i32; }
template <> constexpr DType dtype_of<int64_t>() { return DType::i64; }

// The CUDA stream an op is queued on; null on the CPU. Kept opaque so host code needs no CUDA headers.
struct Stream {
  void* handle = nullptr;
};

struct Tensor {
  void* data = nullptr;
  DType dtype = DType::f32;
  Device device = Device::cpu;
  int ndim = 0;
  std::array<int64_t, 4> shape{};

  Tensor() = default;
  Tensor(void* data, DType dtype, Device device, std::initializer_list<int64_t> dims)
      : data(data), dtype(dtype), device(device), ndim(int(dims.size())) {
    MARROW_CHECK(dims.size() <= 4, "a tensor has at most 4 dimensions, got {}", dims.size());
    int i = 0;
    for (int64_t d : dims) shape[i++] = d;
  }

  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < ndim; ++i) n *= shape[i];
    return n;
  }
  size_t bytes() const { return size_t(numel()) * dtype_size(dtype); }
  int64_t size(int dim) const { return shape[dim < 0 ? ndim + dim : dim]; }

  template <typename T> T* ptr() const {
    MARROW_CHECK(dtype_of<T>() == dtype, "tensor of dtype {} read as {}", dtype_name(dtype), dtype_name(dtype_of<T>()));
    return static_cast<T*>(data);
  }

  // The same memory seen with another shape of the same element count.
  Tensor reshape(std::initializer_list<int64_t> dims) const {
    Tensor t(data, dtype, device, dims);
    MARROW_CHECK(t.numel() == numel(), "cannot reshape {} elements into {}", numel(), t.shape_string());
    return t;
  }

  // Rows [begin, end) of the first dimension.
  Tensor rows(int64_t begin, int64_t end) const {
    MARROW_CHECK(ndim >= 1 && 0 <= begin && begin <= end && end <= shape[0], "row slice [{}, {}) out of range for shape {}",
                 begin, end, shape_string());
    Tensor t = *this;
    t.shape[0] = end - begin;
    t.data = static_cast<char*>(data) + size_t(begin) * (bytes() / size_t(shape[0] ? shape[0] : 1));
    return t;
  }

  std::string shape_string() const {
    std::string s = "[";
    for (int i = 0; i < ndim; ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
    return s + "]";
  }
};

// A host tensor over data with a shape known at run time (a file's, a spec's).
inline Tensor host_tensor(void* data, DType dtype, const std::vector<int64_t>& shape) {
  Tensor t(data, dtype, Device::cpu, {});
  MARROW_CHECK(shape.size() <= 4, "a tensor has at most 4 dimensions, got {}", shape.size());
  t.ndim = int(shape.size());
  for (size_t i = 0; i < shape.size(); ++i) t.shape[i] = shape[i];
  return t;
}

// Shape and dtype checks at op entry. `op` and `name` appear in the message, e.g.
// "rmsnorm_forward: weight has shape [63] but expected [64]".
inline void expect_shape(const char* op, const char* name, const Tensor& t, std::initializer_list<int64_t> dims) {
  bool ok = t.ndim == int(dims.size());
  int i = 0;
  for (int64_t d : dims) ok = ok && t.shape[i++] == d;
  if (!ok) {
    Tensor want(nullptr, t.dtype, t.device, dims);
    fail("{}: {} has shape {} but expected {}", op, name, t.shape_string(), want.shape_string());
  }
}

inline void expect_dtype(const char* op, const char* name, const Tensor& t, DType dtype) {
  MARROW_CHECK(t.dtype == dtype, "{}: {} has dtype {} but expected {}", op, name, dtype_name(t.dtype), dtype_name(dtype));
}

inline void expect_device(const char* op, const char* name, const Tensor& t, Device device) {
  MARROW_CHECK(t.device == device, "{}: {} is on {} but expected {}", op, name, device_name(t.device), device_name(device));
}

}  // namespace marrow
