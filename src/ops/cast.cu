#include "ops/cast.h"

#include "core/bf16.h"
#include "core/cuda_check.h"
#include "core/split_f32.h"
#include "ops/common.h"

#ifdef __CUDACC__
#include "ops/cuda_common.cuh"
#endif

namespace marrow {

namespace {

float load(const void* p, DType t, int64_t i) {
  switch (t) {
    case DType::f32: return static_cast<const float*>(p)[i];
    case DType::f64: return float(static_cast<const double*>(p)[i]);
    default: return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
  }
}

void cast_cpu(Tensor out, Tensor in) {
  const int64_t n = in.numel();
  if (out.dtype == DType::f64 && in.dtype == DType::f64) {
    std::memcpy(out.data, in.data, in.bytes());
  } else if (out.dtype == DType::f64) {
    for (int64_t i = 0; i < n; ++i) out.ptr<double>()[i] = double(load(in.data, in.dtype, i));
  } else if (in.dtype == DType::f64) {
    // Straight from double: a detour through float would round twice.
    const double* src = in.ptr<double>();
    for (int64_t i = 0; i < n; ++i) {
      if (out.dtype == DType::f32) out.ptr<float>()[i] = float(src[i]);
      else static_cast<uint16_t*>(out.data)[i] = float_to_bf16(float(src[i]));
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      const float v = load(in.data, in.dtype, i);
      if (out.dtype == DType::f32) out.ptr<float>()[i] = v;
      else static_cast<uint16_t*>(out.data)[i] = float_to_bf16(v);
    }
  }
}

#ifdef __CUDACC__
template <typename Out, typename In> __global__ void cast_kernel(Out* out, const In* in, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = Out(float(in[i]));
}

template <typename Out, typename In> void launch_cast(Tensor out, Tensor in, Stream stream) {
  const int64_t n = in.numel();
  if (n > 0) launch_plain(cast_kernel<Out, In>, grid_stride_blocks(n, 256, 65536), 256, 0, stream, static_cast<Out*>(out.data),
                          static_cast<const In*>(in.data), n);
}

void launch_cast(const char* op, Tensor out, Tensor in, Stream stream) {
  if (out.dtype == DType::bf16 && in.dtype == DType::f32) return launch_cast<bf16, float>(out, in, stream);
  if (out.dtype == DType::f32 && in.dtype == DType::bf16) return launch_cast<float, bf16>(out, in, stream);
  if (out.dtype == DType::f32 && in.dtype == DType::f32) return launch_cast<float, float>(out, in, stream);
  if (out.dtype == DType::bf16 && in.dtype == DType::bf16) return launch_cast<bf16, bf16>(out, in, stream);
  fail("{}: {} to {} is not supported on the GPU", op, dtype_name(in.dtype), dtype_name(out.dtype));
}

// Thread i splits (forward) or joins element i, grid-stride.
__global__ void split_f32_kernel(uint16_t* high, uint16_t* low, const uint32_t* value, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    split_bits(value[i], high[i], low[i]);
}

__global__ void join_f32_kernel(uint32_t* value, const uint16_t* high, const uint16_t* low, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    value[i] = split_join(high[i], low[i]);
}

// split_f32_kernel or join_f32_kernel over n elements.
template <typename Kernel, typename... Args> void launch_split(Kernel kernel, int64_t n, Stream stream, Args... args) {
  if (n > 0) launch_plain(kernel, grid_stride_blocks(n, 256, 65536), 256, 0, stream, args..., n);
}
#endif

// split_f32 and join_f32's checks; returns the device.
Device check_split(const char* op, const Tensor& value, const Tensor& high, const Tensor& low) {
  for (auto [name, t] : {std::pair{"high", &high}, std::pair{"low", &low}})
    MARROW_CHECK(t->numel() == value.numel(), "{}: {} has {} elements but value has {}", op, name, t->numel(), value.numel());
  expect_dtype(op, "value", value, DType::f32);
  expect_dtype(op, "high", high, DType::bf16);
  expect_dtype(op, "low", low, DType::u16);
  return common_device(op, {{"value", &value}, {"high", &high}, {"low", &low}});
}

}  // namespace

void split_f32(Tensor high, Tensor low, Tensor value, Stream stream) {
  const char* op = "split_f32";
  const int64_t n = value.numel();
  if (check_split(op, value, high, low) == Device::cpu) {
    for (int64_t i = 0; i < n; ++i)
      split_bits(static_cast<const uint32_t*>(value.data)[i], static_cast<uint16_t*>(high.data)[i], static_cast<uint16_t*>(low.data)[i]);
    return;
  }
  MARROW_GPU_RETURN(op, stream, launch_split(split_f32_kernel, n, stream, static_cast<uint16_t*>(high.data), static_cast<uint16_t*>(low.data),
                                             static_cast<const uint32_t*>(value.data)));
}

void join_f32(Tensor value, Tensor high, Tensor low, Stream stream) {
  const char* op = "join_f32";
  const int64_t n = value.numel();
  if (check_split(op, value, high, low) == Device::cpu) {
    for (int64_t i = 0; i < n; ++i)
      static_cast<uint32_t*>(value.data)[i] = split_join(static_cast<const uint16_t*>(high.data)[i], static_cast<const uint16_t*>(low.data)[i]);
    return;
  }
  MARROW_GPU_RETURN(op, stream, launch_split(join_f32_kernel, n, stream, static_cast<uint32_t*>(value.data),
                                             static_cast<const uint16_t*>(high.data), static_cast<const uint16_t*>(low.data)));
}

void cast(Tensor out, Tensor in, Stream stream) {
  const char* op = "cast";
  MARROW_CHECK(out.numel() == in.numel(), "{}: out has {} elements but in has {}", op, out.numel(), in.numel());
  for (auto [name, t] : {std::pair{"out", &out}, std::pair{"in", &in}})
    MARROW_CHECK(t->dtype == DType::f32 || t->dtype == DType::bf16 || t->dtype == DType::f64,
                 "{}: {} has dtype {} but only f32, f64 and bf16 are supported", op, name, dtype_name(t->dtype));
  if (common_device(op, {{"out", &out}, {"in", &in}}) == Device::cpu) return cast_cpu(out, in);
  MARROW_GPU_RETURN(op, stream, launch_cast(op, out, in, stream));
}

}  // namespace marrow
