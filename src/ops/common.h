// What every op file shares: picking the CPU reference's scalar type and checking that an op's
// tensors live on one device. The CPU references are templates over the scalar type: f32 is the
// path CI trains with, f64 lets gradient checks run the very same code in double precision.
// A CPU reference splits an outer loop only where one thread computes each output element in the
// sequential order (rows of y, rows of dW, key/value heads of attention), with an `if` on
// kParallelWork; the *.ThreadCountDoesNotChangeTheBits tests check 1 against 3 threads.
#pragma once
#include <initializer_list>

#include "core/tensor.h"

namespace marrow {

// The CPU references split their outer loops over OpenMP threads only where each output element is
// computed by one thread in the sequential order (rows of y, rows of dW, heads of attention), so
// results are bitwise the same for any thread count. Loops below this many multiply-adds stay on
// one thread: a parallel region costs a few microseconds.
constexpr int64_t kParallelWork = 1 << 16;

// Calls f(float{}) or f(double{}) by the floating dtype of t; other dtypes are an error naming op.
template <typename F> void with_cpu_scalar(const char* op, const Tensor& t, F&& f) {
  if (t.dtype == DType::f32) {
    f(float{});
  } else if (t.dtype == DType::f64) {
    f(double{});
  } else {
    fail("{}: the CPU reference takes f32 or f64 tensors, got {}", op, dtype_name(t.dtype));
  }
}

// t has `ndim` dimensions, named in `layout` (e.g. "[tokens, hidden]") by the error.
inline void expect_ndim(const char* op, const char* name, const Tensor& t, int ndim, const char* layout) {
  MARROW_CHECK(t.ndim == ndim, "{}: {} must be {}, got {}", op, name, layout, t.shape_string());
}

// All floating tensors of an op share the dtype of the first; names come in the same order.
inline void expect_same_dtype(const char* op, std::initializer_list<std::pair<const char*, const Tensor*>> tensors) {
  const Tensor* first = tensors.begin()->second;
  for (auto& [name, t] : tensors)
    MARROW_CHECK(t->dtype == first->dtype, "{}: {} has dtype {} but {} has {}", op, name, dtype_name(t->dtype),
                 tensors.begin()->first, dtype_name(first->dtype));
}

// All tensors of an op are on one device; returns it.
inline Device common_device(const char* op, std::initializer_list<std::pair<const char*, const Tensor*>> tensors) {
  Device d = tensors.begin()->second->device;
  for (auto& [name, t] : tensors)
    MARROW_CHECK(t->device == d, "{}: {} is on {} but {} is on {}", op, name, device_name(t->device), tensors.begin()->first,
                 device_name(d));
  return d;
}

// A tensor of an op and the dtype the GPU kernels take for it.
struct Operand {
  const char* name;
  const Tensor* tensor;
  DType gpu_dtype;
};

// The device checks of an op after its shapes: all operands on the first's device; on the CPU all
// but the i32 index tensors of the first's dtype (the reference runs in one scalar type), on the
// GPU each of its gpu_dtype. Returns whether they are on the GPU.
inline bool on_gpu(const char* op, std::initializer_list<Operand> operands) {
  const Operand& first = *operands.begin();
  for (const Operand& o : operands)
    MARROW_CHECK(o.tensor->device == first.tensor->device, "{}: {} is on {} but {} is on {}", op, o.name, device_name(o.tensor->device),
                 first.name, device_name(first.tensor->device));
  if (first.tensor->device == Device::cpu) {
    for (const Operand& o : operands)
      MARROW_CHECK(o.gpu_dtype == DType::i32 || o.tensor->dtype == first.tensor->dtype, "{}: {} has dtype {} but {} has {}", op, o.name,
                   dtype_name(o.tensor->dtype), first.name, dtype_name(first.tensor->dtype));
    return false;
  }
  for (const Operand& o : operands) expect_dtype(op, o.name, *o.tensor, o.gpu_dtype);
  return true;
}

// Index tensors [N, K] (i32, host) come from the caller: an entry outside [0, limit) is an error
// naming the entry, not a stray memory access.
inline void expect_indices_below(const char* op, const char* name, const Tensor& index, int64_t limit) {
  const int32_t* idx = index.ptr<int32_t>();
  const int64_t k = index.ndim > 1 ? index.size(1) : 1;
  for (int64_t i = 0; i < index.numel(); ++i)
    MARROW_CHECK(0 <= idx[i] && idx[i] < limit, "{}: {}[{}, {}] = {} is outside [0, {})", op, name, i / k, i % k, idx[i], limit);
}

// CPU reference helpers. Eight independent partial sums: one running sum would serialise on the
// latency of the add. The order is fixed, so the result is deterministic.
template <typename T> T dot(const T* a, const T* b, int64_t n) {
  T acc[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) acc[l] += a[i + l] * b[i + l];
  for (int l = 0; i < n; ++i, ++l) acc[l] += a[i] * b[i];
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

template <typename T> void axpy(T* y, T alpha, const T* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

// The GPU branch of an op in a build without CUDA: a clear error, not a crash.
[[noreturn]] inline void no_cuda_kernel(const char* op) {
  fail("{}: the tensors are on the GPU but this build of marrow has no CUDA support (configure with -DMARROW_CUDA=ON)", op);
}

// The GPU branch of a void op, `MARROW_GPU_RETURN(op, stream, launch(...));`: with CUDA it returns
// the launch (code of the file's #ifdef __CUDACC__ section); without, the launch drops out unseen
// and the op fails with no_cuda_kernel's message (stream named, so that it counts as used).
#ifdef __CUDACC__
#define MARROW_GPU_RETURN(op, stream, ...) return __VA_ARGS__
#else
#define MARROW_GPU_RETURN(op, stream, ...) return (void)(stream), ::marrow::no_cuda_kernel(op)
#endif

}  // namespace marrow
