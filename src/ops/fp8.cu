#include "ops/fp8.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/bf16.h"
#include "core/cuda_check.h"
#include "ops/common.h"

#include "ops/fp8_format.h"

#ifdef __CUDACC__
#include "ops/cuda_common.cuh"
#endif

namespace marrow {

using namespace fp8_format;

float fp8_block_scale(float amax) { return block_scale(amax); }

Fp8Buffer Fp8Buffer::rows(Device device, int64_t r, int64_t c, Stream stream) {
  const int64_t blocks = (c + kFp8Block - 1) / kFp8Block;
  return {Buffer(DType::fp8_e4m3, device, {r, c}, stream), Buffer(DType::f32, device, {blocks, r}, stream)};
}

Fp8Buffer Fp8Buffer::blocks(Device device, int64_t e, int64_t o, int64_t i, Stream stream) {
  const int64_t ob = (o + kFp8Block - 1) / kFp8Block, ib = (i + kFp8Block - 1) / kFp8Block;
  return {Buffer(DType::fp8_e4m3, device, {e, o, i}, stream), Buffer(DType::f32, device, {e, ob, ib}, stream)};
}

uint8_t fp8_e4m3_from_float(float v) {
  if (std::isnan(v)) return 0x7F;
  const uint8_t sign = std::signbit(v) ? 0x80 : 0;
  const float a = std::fabs(v);
  if (a >= kFp8Max) return sign | 0x7E;  // saturating: 448 is the largest finite E4M3
  int e = 0;
  std::frexp(a, &e);
  const int exponent = std::max(e - 1, -6);                 // subnormals share 2^-6's spacing
  const float quantum = std::ldexp(1.0f, exponent - 3);     // three mantissa bits
  const float q = std::nearbyint(a / quantum) * quantum;    // ties to even (the default rounding)
  if (q == 0) return sign;
  std::frexp(q, &e);  // q may have rounded up into the next binade
  const int biased = e - 1 + 7;
  if (biased <= 0) return sign | uint8_t(q / std::ldexp(1.0f, -9));  // subnormal: q / 2^-9 eighths of 2^-6
  return sign | uint8_t(biased << 3) | uint8_t(q / std::ldexp(1.0f, e - 1 - 3) - 8);
}

float fp8_e4m3_to_float(uint8_t byte) {
  const float sign = (byte & 0x80) ? -1.0f : 1.0f;
  const int biased = (byte >> 3) & 0xF, mantissa = byte & 7;
  if (biased == 0xF && mantissa == 7) return std::numeric_limits<float>::quiet_NaN();
  if (biased == 0) return sign * std::ldexp(float(mantissa), -9);
  return sign * std::ldexp(float(8 + mantissa), biased - 7 - 3);
}

namespace {

const char* kQuantizeRows = "quantize_rows";
const char* kQuantizeBlocks = "quantize_blocks";

float load_value(const Tensor& t, int64_t i) {
  return t.dtype == DType::f32 ? t.ptr<float>()[i] : bf16_to_float(static_cast<const uint16_t*>(t.data)[i]);
}

int64_t blocks_of(int64_t n) { return (n + kFp8Block - 1) / kFp8Block; }

// ---- CPU reference -------------------------------------------------------------------------------

void quantize_rows_cpu(Fp8Tensor out, Tensor x) {
  const int64_t R = x.size(0), C = x.size(1), CB = blocks_of(C);
  uint8_t* q = static_cast<uint8_t*>(out.values.data);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t cb = 0; cb < CB; ++cb) {
      const int64_t c0 = cb * kFp8Block, c1 = std::min(C, c0 + kFp8Block);
      float amax = 0;
      for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, magnitude(load_value(x, r * C + c)));
      const float scale = block_scale(amax), inverse = 1.0f / scale;
      for (int64_t c = c0; c < c1; ++c) q[r * C + c] = fp8_e4m3_from_float(load_value(x, r * C + c) * inverse);
      out.scales.ptr<float>()[cb * R + r] = scale;
    }
}

void quantize_blocks_cpu(Fp8Tensor out, Fp8Tensor transposed, Tensor w) {
  const int64_t E = w.size(0), O = w.size(1), I = w.size(2), OB = blocks_of(O), IB = blocks_of(I);
  uint8_t* q = static_cast<uint8_t*>(out.values.data);
  uint8_t* qt = static_cast<uint8_t*>(transposed.values.data);
  for (int64_t e = 0; e < E; ++e)
    for (int64_t ob = 0; ob < OB; ++ob)
      for (int64_t ib = 0; ib < IB; ++ib) {
        const int64_t o1 = std::min(O, (ob + 1) * kFp8Block), i1 = std::min(I, (ib + 1) * kFp8Block);
        float amax = 0;
        for (int64_t o = ob * kFp8Block; o < o1; ++o)
          for (int64_t i = ib * kFp8Block; i < i1; ++i) amax = std::max(amax, magnitude(load_value(w, (e * O + o) * I + i)));
        const float scale = block_scale(amax), inverse = 1.0f / scale;
        for (int64_t o = ob * kFp8Block; o < o1; ++o)
          for (int64_t i = ib * kFp8Block; i < i1; ++i) {
            const uint8_t byte = fp8_e4m3_from_float(load_value(w, (e * O + o) * I + i) * inverse);
            q[(e * O + o) * I + i] = byte;
            if (qt) qt[(e * I + i) * O + o] = byte;
          }
        out.scales.ptr<float>()[(e * OB + ob) * IB + ib] = scale;
        if (qt) transposed.scales.ptr<float>()[(e * IB + ib) * OB + ob] = scale;
      }
}

// ---- CUDA kernels --------------------------------------------------------------------------------
#ifdef __CUDACC__
// Both halves of a warp: the same reduction over the 16 lanes of each.
__device__ __forceinline__ float half_warp_max(float v) {
  for (int m = 8; m > 0; m /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, m));
  return v;
}

// Half a warp per (row, block of 128 columns); lane l of the half holds columns 8l .. 8l + 7.
template <typename T>
__global__ void quantize_rows_kernel(uint8_t* q, float* scales, const T* x, int64_t rows, int64_t cols, int64_t col_blocks, bool vector) {
  begin_after_previous_grid();
  const int64_t item = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 16;
  const bool inside = item < rows * col_blocks;  // both halves of a warp take part in the shuffles
  const int lane = threadIdx.x % 16;
  const int64_t r = inside ? item / col_blocks : 0, cb = inside ? item % col_blocks : 0, c0 = cb * kFp8Block + 8 * lane;
  float v[8] = {};
  if (inside) load8(v, x, r, c0, cols, vector);
  float amax = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) amax = fmaxf(amax, magnitude(v[j]));
  const float scale = block_scale(half_warp_max(amax)), inverse = 1.0f / scale;
  if (!inside) return;
  uint8_t b[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) b[j] = to_e4m3(v[j] * inverse);
  if (c0 < cols) store8(q, b, r, c0, cols, vector);
  if (lane == 0) scales[cb * rows + r] = scale;
}

// One block of kBlockThreads threads per 128 x 128 block of one expert's weight, in
// store_quantized_block's layout.
template <typename T>
__global__ void __launch_bounds__(kBlockThreads)
    quantize_blocks_kernel(uint8_t* q, float* scales, uint8_t* qt, float* scales_t, const T* w, int64_t O, int64_t I, bool vector) {
  begin_after_previous_grid();
  const BlockPlace at{blockIdx.z, blockIdx.y, blockIdx.x, gridDim.y, gridDim.x, O, I};
  const int t = threadIdx.x;
  const T* src = w + at.e * O * I;
  float v[8][8];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
#pragma unroll
    for (int c = 0; c < 8; ++c) v[j][c] = 0;
    const int64_t o = at.ob * kFp8Block + block_row(t, j);
    if (o < O) load8(v[j], src, o, at.ib * kFp8Block + block_col(t), I, vector);
  }
  store_quantized_block([&](int j, int c) { return v[j][c]; }, at, q, scales, qt, scales_t, vector);
}

template <typename T> void launch_quantize_rows(Fp8Tensor out, Tensor x, cudaStream_t stream) {
  const int64_t R = x.size(0), C = x.size(1), CB = blocks_of(C), items = R * CB;
  if (items == 0) return;
  const int threads = 256;
  const bool vector = packable(C, {x.data, out.values.data});
  launch_dependent(quantize_rows_kernel<T>, dim3(unsigned((items * 16 + threads - 1) / threads)), dim3(threads), 0, stream,
                   static_cast<uint8_t*>(out.values.data), out.scales.ptr<float>(), static_cast<const T*>(x.data), R, C, CB, vector);
  MARROW_CUDA_CHECK_LAUNCH();
}

template <typename T> void launch_quantize_blocks(Fp8Tensor out, Fp8Tensor transposed, Tensor w, cudaStream_t stream) {
  const int64_t E = w.size(0), O = w.size(1), I = w.size(2);
  if (w.numel() == 0) return;
  MARROW_CHECK(blocks_of(O) <= 65535 && E <= 65535, "{}: weight {} has too many 128-row blocks for one launch", kQuantizeBlocks,
               w.shape_string());
  const bool vector = packable(I, {w.data, out.values.data}) && packable(O, {transposed.values.data});
  launch_dependent(quantize_blocks_kernel<T>, dim3(unsigned(blocks_of(I)), unsigned(blocks_of(O)), unsigned(E)), dim3(kBlockThreads), 0,
                   stream, static_cast<uint8_t*>(out.values.data), out.scales.ptr<float>(), static_cast<uint8_t*>(transposed.values.data),
                   transposed.values.data ? transposed.scales.ptr<float>() : nullptr, static_cast<const T*>(w.data), O, I, vector);
  MARROW_CUDA_CHECK_LAUNCH();
}
#endif

void expect_input(const char* op, const Tensor& x, int64_t ndim) {
  MARROW_CHECK(x.dtype == DType::f32 || x.dtype == DType::bf16, "{}: the input has dtype {} but must be f32 or bf16", op,
               dtype_name(x.dtype));
  MARROW_CHECK(x.ndim == ndim, "{}: the input has shape {} but must have {} dimensions", op, x.shape_string(), ndim);
}

// dequantize_*'s checks: tensors on the CPU, out f32, values of ndim dimensions (`layout`).
void expect_dequantize(const char* op, const Tensor& out, const Fp8Tensor& in, int ndim, const char* layout) {
  MARROW_CHECK(out.device == Device::cpu && in.values.device == Device::cpu && in.scales.device == Device::cpu,
               "{}: the tensors must be on the CPU", op);
  expect_dtype(op, "out", out, DType::f32);
  MARROW_CHECK(in.values.ndim == ndim, "{}: values has shape {} but must be {}", op, in.values.shape_string(), layout);
}

}  // namespace

void quantize_rows(Fp8Tensor out, Tensor x, Stream stream) {
  const char* op = kQuantizeRows;
  expect_input(op, x, 2);
  const int64_t R = x.size(0), C = x.size(1);
  expect_dtype(op, "values", out.values, DType::fp8_e4m3);
  expect_dtype(op, "scales", out.scales, DType::f32);
  expect_shape(op, "values", out.values, {R, C});
  expect_shape(op, "scales", out.scales, {blocks_of(C), R});
  if (common_device(op, {{"x", &x}, {"values", &out.values}, {"scales", &out.scales}}) == Device::cpu) return quantize_rows_cpu(out, x);
#ifdef __CUDACC__
  const cudaStream_t s = static_cast<cudaStream_t>(stream.handle);
  if (x.dtype == DType::bf16) return launch_quantize_rows<__nv_bfloat16>(out, x, s);
  return launch_quantize_rows<float>(out, x, s);
#else
  (void)stream;
  no_cuda_kernel(op);
#endif
}

Device expect_quantize_blocks(const char* op, const Fp8Tensor& out, const Fp8Tensor& transposed, const Tensor& weight) {
  expect_input(op, weight, 3);
  const int64_t E = weight.size(0), O = weight.size(1), I = weight.size(2);
  expect_dtype(op, "values", out.values, DType::fp8_e4m3);
  expect_dtype(op, "scales", out.scales, DType::f32);
  expect_shape(op, "values", out.values, {E, O, I});
  expect_shape(op, "scales", out.scales, {E, blocks_of(O), blocks_of(I)});
  const bool with_transposed = transposed.values.data != nullptr;
  if (with_transposed) {
    expect_dtype(op, "transposed values", transposed.values, DType::fp8_e4m3);
    expect_dtype(op, "transposed scales", transposed.scales, DType::f32);
    expect_shape(op, "transposed values", transposed.values, {E, I, O});
    expect_shape(op, "transposed scales", transposed.scales, {E, blocks_of(I), blocks_of(O)});
  }
  Tensor tv = with_transposed ? transposed.values : out.values, ts = with_transposed ? transposed.scales : out.scales;
  return common_device(op, {{"weight", &weight}, {"values", &out.values}, {"scales", &out.scales}, {"transposed values", &tv},
                            {"transposed scales", &ts}});
}

void quantize_blocks(Fp8Tensor out, Fp8Tensor transposed, Tensor weight, Stream stream) {
  const char* op = kQuantizeBlocks;
  const Device device = expect_quantize_blocks(op, out, transposed, weight);
  if (device == Device::cpu) return quantize_blocks_cpu(out, transposed, weight);
#ifdef __CUDACC__
  const cudaStream_t s = static_cast<cudaStream_t>(stream.handle);
  if (weight.dtype == DType::bf16) return launch_quantize_blocks<__nv_bfloat16>(out, transposed, weight, s);
  return launch_quantize_blocks<float>(out, transposed, weight, s);
#else
  (void)stream;
  no_cuda_kernel(op);
#endif
}

void dequantize_rows(Tensor out, Fp8Tensor in) {
  const char* op = "dequantize_rows";
  expect_dequantize(op, out, in, 2, "[R, C]");
  const int64_t R = in.values.size(0), C = in.values.size(1);
  expect_shape(op, "out", out, {R, C});
  expect_shape(op, "scales", in.scales, {blocks_of(C), R});
  const uint8_t* q = static_cast<const uint8_t*>(in.values.data);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c)
      out.ptr<float>()[r * C + c] = fp8_e4m3_to_float(q[r * C + c]) * in.scales.ptr<float>()[(c / kFp8Block) * R + r];
}

void dequantize_blocks(Tensor out, Fp8Tensor in) {
  const char* op = "dequantize_blocks";
  expect_dequantize(op, out, in, 3, "[E, O, I]");
  const int64_t E = in.values.size(0), O = in.values.size(1), I = in.values.size(2), OB = blocks_of(O), IB = blocks_of(I);
  expect_shape(op, "out", out, {E, O, I});
  expect_shape(op, "scales", in.scales, {E, OB, IB});
  const uint8_t* q = static_cast<const uint8_t*>(in.values.data);
  for (int64_t e = 0; e < E; ++e)
    for (int64_t o = 0; o < O; ++o)
      for (int64_t i = 0; i < I; ++i) {
        const float scale = in.scales.ptr<float>()[(e * OB + o / kFp8Block) * IB + i / kFp8Block];
        out.ptr<float>()[(e * O + o) * I + i] = fp8_e4m3_to_float(q[(e * O + o) * I + i]) * scale;
      }
}

}  // namespace marrow
