#include "ops/fp8.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/bf16.h"
#include "core/cuda_check.h"
#include "ops/common.h"

#ifdef __CUDACC__
#include <cuda_fp8.h>

#include "ops/cuda_common.cuh"
#endif

namespace marrow {

// ---- the format, shared by the CPU reference and the kernels -------------------------------------

// With amax = m 2^e (m in [0.5, 1)) and 448 = 0.875 2^9, amax / 2^k <= 448 first holds at k = e - 9
// when m <= 0.875, else at e - 8. Scales stay normal floats (k >= -126): a block of tiny values
// then rounds to E4M3's subnormals or zero, as it must.
#ifdef __CUDACC__
__host__ __device__
#endif
    static inline float block_scale(float amax) {
  if (!(amax <= std::numeric_limits<float>::max())) return std::numeric_limits<float>::quiet_NaN();
  if (amax == 0) return 1;
  int e = 0;
  const float m = frexpf(amax, &e);
  const int k = m <= 0.875f ? e - 9 : e - 8;
  return ldexpf(1.0f, k < -126 ? -126 : k);
}

float fp8_block_scale(float amax) { return block_scale(amax); }

Fp8Buffer Fp8Buffer::rows(Device device, int64_t r, int64_t c, Stream stream) {
  return {Buffer(DType::fp8_e4m3, device, {r, c}, stream), Buffer(DType::f32, device, {fp8_blocks(c), r}, stream)};
}

Fp8Buffer Fp8Buffer::blocks(Device device, int64_t e, int64_t o, int64_t i, Stream stream) {
  return {Buffer(DType::fp8_e4m3, device, {e, o, i}, stream), Buffer(DType::f32, device, {e, fp8_blocks(o), fp8_blocks(i)}, stream)};
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

// |v|'s contribution to a block's amax: a NaN must win, which max and fmaxf would drop.
#ifdef __CUDACC__
__host__ __device__
#endif
    inline float magnitude(float v) {
  return v != v ? std::numeric_limits<float>::infinity() : std::fabs(v);
}

// ---- CPU reference -------------------------------------------------------------------------------

void quantize_rows_cpu(Fp8Tensor out, Tensor x) {
  const int64_t R = x.size(0), C = x.size(1), CB = fp8_blocks(C);
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
  const int64_t E = w.size(0), O = w.size(1), I = w.size(2), OB = fp8_blocks(O), IB = fp8_blocks(I);
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
template <typename T> __device__ __forceinline__ float to_float(T v) { return float(v); }
template <> __device__ __forceinline__ float to_float(bf16 v) { return __bfloat162float(v); }

// NaN (of either sign) as 0x7F, as the CPU reference writes it.
__device__ __forceinline__ uint8_t to_e4m3(float v) { return isnan(v) ? 0x7F : __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3); }

// Eight consecutive values from row `row` at columns col .. col + 7 of a [rows, cols] matrix as f32,
// zeros past its end: one 16-byte load (two for f32) when all eight lie inside and `vector` (cols a
// multiple of 8, the base 16-byte aligned), else one load each.
template <typename T> __device__ __forceinline__ void load8(float (&v)[8], const T* x, int64_t row, int64_t col, int64_t cols, bool vector) {
  const T* p = x + row * cols + col;
  if (vector && col + 8 <= cols) {
    if constexpr (sizeof(T) == 2) {
      const uint4 raw = *reinterpret_cast<const uint4*>(p);
      const auto* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float2 f = __bfloat1622float2(h[j]);
        v[2 * j] = f.x, v[2 * j + 1] = f.y;
      }
    } else {
      const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
      v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    }
    return;
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) v[j] = col + j < cols ? to_float(p[j]) : 0.0f;
}

// Eight bytes to q[row, col .. col + 7] of a [rows, cols] byte matrix, those past its end left out:
// one 8-byte store when all lie inside and `vector`, else one each.
__device__ __forceinline__ void store8(uint8_t* q, const uint8_t (&b)[8], int64_t row, int64_t col, int64_t cols, bool vector) {
  uint8_t* p = q + row * cols + col;
  if (vector && col + 8 <= cols) {
    *reinterpret_cast<uint2*>(p) = make_uint2(uint32_t(b[0]) | uint32_t(b[1]) << 8 | uint32_t(b[2]) << 16 | uint32_t(b[3]) << 24,
                                              uint32_t(b[4]) | uint32_t(b[5]) << 8 | uint32_t(b[6]) << 16 | uint32_t(b[7]) << 24);
    return;
  }
#pragma unroll
  for (int j = 0; j < 8; ++j)
    if (col + j < cols) p[j] = b[j];
}

// Eight lanes per (row, block of 128 columns), an item; lane l of the eight holds columns
// 16l .. 16l + 15. The kernel is bound by its instructions, not its bytes: with 8 columns a lane
// and a 64-bit item division it ran at ~2.2 TB/s, so each lane takes 16 columns (the item's
// division, shuffles and scale shared by twice the bytes) and items are 32-bit.
template <typename T>
__global__ void quantize_rows_kernel(uint8_t* q, float* scales, const T* x, int64_t rows, int64_t cols, uint32_t col_blocks, uint32_t items,
                                     bool vector) {
  begin_after_previous_grid();
  const uint32_t item = (blockIdx.x * blockDim.x + threadIdx.x) / 8;
  const bool inside = item < items;  // every lane of a warp takes part in the shuffles
  const int lane = threadIdx.x % 8;
  const uint32_t r = inside ? item / col_blocks : 0, cb = inside ? item - r * col_blocks : 0;
  const int64_t c0 = int64_t(cb) * kFp8Block + 16 * lane;
  float v[2][8] = {};
  if (inside) {
    load8(v[0], x, r, c0, cols, vector);
    load8(v[1], x, r, c0 + 8, cols, vector);
  }
  float amax = 0;
#pragma unroll
  for (int j = 0; j < 16; ++j) amax = fmaxf(amax, magnitude(v[j / 8][j % 8]));
#pragma unroll
  for (int m = 4; m > 0; m /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));
  const float scale = block_scale(amax), inverse = 1.0f / scale;
  if (!inside) return;
  uint8_t b[2][8];
#pragma unroll
  for (int j = 0; j < 16; ++j) b[j / 8][j % 8] = to_e4m3(v[j / 8][j % 8] * inverse);
  if (c0 < cols) store8(q, b[0], r, c0, cols, vector);
  if (c0 + 8 < cols) store8(q, b[1], r, c0 + 8, cols, vector);
  if (lane == 0) scales[int64_t(cb) * rows + r] = scale;
}

// One block of 256 threads per 128 x 128 block of one expert's weight: thread t holds columns
// 8 (t % 16) .. + 7 of rows t / 16 + 16 j. The transposed bytes go out through a shared tile whose
// rows are 129 bytes apart, so that reading down a column of it touches 16 different banks.
constexpr int kBlockThreads = 256, kTileStride = kFp8Block + 1;

// A thread's 8 x 8 values of its block: f32 as they are; bf16 kept packed (32 registers, not 64),
// so that four blocks share an SM instead of two and more loads are in flight around each block's
// barrier. value(j, c) is row j's column c as f32, zero outside the matrix.
template <typename T> struct HeldValues {
  float v[8][8];
  __device__ __forceinline__ void load(const T* src, int j, int64_t o, int64_t i, int64_t O, int64_t I, bool vector) {
#pragma unroll
    for (int c = 0; c < 8; ++c) v[j][c] = 0;
    if (o < O) load8(v[j], src, o, i, I, vector);
  }
  __device__ __forceinline__ float value(int j, int c) const { return v[j][c]; }
};
template <> struct HeldValues<bf16> {
  __nv_bfloat162 v[8][4];
  __device__ __forceinline__ void load(const bf16* src, int j, int64_t o, int64_t i, int64_t O, int64_t I, bool vector) {
    if (o < O && vector && i + 8 <= I) {
      const uint4 raw = *reinterpret_cast<const uint4*>(src + o * I + i);
      const auto* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
      for (int c = 0; c < 4; ++c) v[j][c] = pairs[c];
      return;
    }
    float f[8] = {};
    if (o < O) load8(f, src, o, i, I, vector);
#pragma unroll
    for (int c = 0; c < 4; ++c) v[j][c] = __floats2bfloat162_rn(f[2 * c], f[2 * c + 1]);  // exact: bf16 values
  }
  __device__ __forceinline__ float value(int j, int c) const { return c % 2 ? __high2float(v[j][c / 2]) : __low2float(v[j][c / 2]); }
};

template <typename T>
__global__ void __launch_bounds__(kBlockThreads, sizeof(T) == 2 ? 4 : 2)
    quantize_blocks_kernel(uint8_t* q, float* scales, uint8_t* qt, float* scales_t, const T* w, int64_t O, int64_t I, bool vector) {
  __shared__ uint8_t tile[kFp8Block * kTileStride];
  __shared__ float warp_amax[kBlockThreads / 32];
  begin_after_previous_grid();
  const int64_t e = blockIdx.z, ob = blockIdx.y, ib = blockIdx.x, OB = gridDim.y, IB = gridDim.x;
  const int t = threadIdx.x, col = 8 * (t % 16);
  const T* src = w + e * O * I;
  HeldValues<T> held;
  float amax = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    held.load(src, j, ob * kFp8Block + t / 16 + 16 * j, ib * kFp8Block + col, O, I, vector);
#pragma unroll
    for (int c = 0; c < 8; ++c) amax = fmaxf(amax, magnitude(held.value(j, c)));
  }
  amax = warp_max(amax);
  if (t % 32 == 0) warp_amax[t / 32] = amax;
  __syncthreads();
  amax = 0;
  for (int k = 0; k < kBlockThreads / 32; ++k) amax = fmaxf(amax, warp_amax[k]);
  const float scale = block_scale(amax), inverse = 1.0f / scale;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int row = t / 16 + 16 * j;
    const int64_t o = ob * kFp8Block + row, i = ib * kFp8Block + col;
    uint8_t b[8];
#pragma unroll
    for (int c = 0; c < 8; ++c) {
      b[c] = to_e4m3(held.value(j, c) * inverse);
      tile[row * kTileStride + col + c] = b[c];
    }
    if (o < O && i < I) store8(q + e * O * I, b, o, i, I, vector);
  }
  if (t == 0) scales[(e * OB + ob) * IB + ib] = scale;
  if (qt == nullptr) return;
  if (t == 0) scales_t[(e * IB + ib) * OB + ob] = scale;
  __syncthreads();
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int out_row = t / 16 + 16 * j;  // a column of the tile
    const int64_t i = ib * kFp8Block + out_row, o = ob * kFp8Block + col;
    uint8_t b[8];
#pragma unroll
    for (int c = 0; c < 8; ++c) b[c] = tile[(col + c) * kTileStride + out_row];
    if (i < I && o < O) store8(qt + e * I * O, b, i, o, O, vector);
  }
}

template <typename T> void launch_quantize_rows(Fp8Tensor out, Tensor x, Stream stream) {
  const int64_t R = x.size(0), C = x.size(1), CB = fp8_blocks(C), items = R * CB;
  if (items == 0) return;
  const int threads = 256;
  const bool vector = packable(C, {x.data, out.values.data});
  MARROW_CHECK(items * 8 <= (int64_t(1) << 31), "{}: x {} has too many 128-column blocks for one launch", kQuantizeRows, x.shape_string());
  launch_dependent(quantize_rows_kernel<T>, dim3(unsigned((items * 8 + threads - 1) / threads)), dim3(threads), 0, stream,
                   static_cast<uint8_t*>(out.values.data), out.scales.ptr<float>(), static_cast<const T*>(x.data), R, C, uint32_t(CB),
                   uint32_t(items), vector);
}

template <typename T> void launch_quantize_blocks(Fp8Tensor out, Fp8Tensor transposed, Tensor w, Stream stream) {
  const int64_t E = w.size(0), O = w.size(1), I = w.size(2);
  if (w.numel() == 0) return;
  MARROW_CHECK(fp8_blocks(O) <= 65535 && E <= 65535, "{}: weight {} has too many 128-row blocks for one launch", kQuantizeBlocks,
               w.shape_string());
  const bool vector = packable(I, {w.data, out.values.data}) && packable(O, {transposed.values.data});
  launch_dependent(quantize_blocks_kernel<T>, dim3(unsigned(fp8_blocks(I)), unsigned(fp8_blocks(O)), unsigned(E)), dim3(kBlockThreads), 0,
                   stream, static_cast<uint8_t*>(out.values.data), out.scales.ptr<float>(), static_cast<uint8_t*>(transposed.values.data),
                   transposed.values.data ? transposed.scales.ptr<float>() : nullptr, static_cast<const T*>(w.data), O, I, vector);
}
#endif

void expect_input(const char* op, const char* name, const Tensor& x, int64_t ndim) {
  MARROW_CHECK(x.dtype == DType::f32 || x.dtype == DType::bf16, "{}: {} has dtype {} but must be f32 or bf16", op, name,
               dtype_name(x.dtype));
  MARROW_CHECK(x.ndim == ndim, "{}: {} has shape {} but must have {} dimensions", op, name, x.shape_string(), ndim);
}

// dequantize_*'s checks: tensors on the CPU, out f32, values of ndim dimensions (`layout`).
void expect_dequantize(const char* op, const Tensor& out, const Fp8Tensor& in, int ndim, const char* layout) {
  for (auto [name, t] : {std::pair{"out", &out}, std::pair{"values", &in.values}, std::pair{"scales", &in.scales}})
    expect_device(op, name, *t, Device::cpu);
  expect_dtype(op, "out", out, DType::f32);
  expect_dtype(op, "values", in.values, DType::fp8_e4m3);
  expect_dtype(op, "scales", in.scales, DType::f32);
  MARROW_CHECK(in.values.ndim == ndim, "{}: values has shape {} but must be {}", op, in.values.shape_string(), layout);
}

}  // namespace

void quantize_rows(Fp8Tensor out, Tensor x, Stream stream) {
  const char* op = kQuantizeRows;
  expect_input(op, "x", x, 2);
  const int64_t R = x.size(0), C = x.size(1);
  expect_dtype(op, "values", out.values, DType::fp8_e4m3);
  expect_dtype(op, "scales", out.scales, DType::f32);
  expect_shape(op, "values", out.values, {R, C});
  expect_shape(op, "scales", out.scales, {fp8_blocks(C), R});
  if (common_device(op, {{"x", &x}, {"values", &out.values}, {"scales", &out.scales}}) == Device::cpu) return quantize_rows_cpu(out, x);
  MARROW_GPU_RETURN(op, stream, x.dtype == DType::bf16 ? launch_quantize_rows<bf16>(out, x, stream) : launch_quantize_rows<float>(out, x, stream));
}

void quantize_blocks(Fp8Tensor out, Fp8Tensor transposed, Tensor weight, Stream stream) {
  const char* op = kQuantizeBlocks;
  expect_input(op, "weight", weight, 3);
  const int64_t E = weight.size(0), O = weight.size(1), I = weight.size(2);
  expect_dtype(op, "values", out.values, DType::fp8_e4m3);
  expect_dtype(op, "scales", out.scales, DType::f32);
  expect_shape(op, "values", out.values, {E, O, I});
  expect_shape(op, "scales", out.scales, {E, fp8_blocks(O), fp8_blocks(I)});
  const bool with_transposed = transposed.values.data != nullptr;
  if (with_transposed) {
    expect_dtype(op, "transposed values", transposed.values, DType::fp8_e4m3);
    expect_dtype(op, "transposed scales", transposed.scales, DType::f32);
    expect_shape(op, "transposed values", transposed.values, {E, I, O});
    expect_shape(op, "transposed scales", transposed.scales, {E, fp8_blocks(I), fp8_blocks(O)});
  }
  Tensor tv = with_transposed ? transposed.values : out.values, ts = with_transposed ? transposed.scales : out.scales;
  const Device device = common_device(op, {{"weight", &weight}, {"values", &out.values}, {"scales", &out.scales},
                                           {"transposed values", &tv}, {"transposed scales", &ts}});
  if (device == Device::cpu) return quantize_blocks_cpu(out, transposed, weight);
  MARROW_GPU_RETURN(op, stream, weight.dtype == DType::bf16 ? launch_quantize_blocks<bf16>(out, transposed, weight, stream)
                                                            : launch_quantize_blocks<float>(out, transposed, weight, stream));
}

void dequantize_rows(Tensor out, Fp8Tensor in) {
  const char* op = "dequantize_rows";
  expect_dequantize(op, out, in, 2, "[R, C]");
  const int64_t R = in.values.size(0), C = in.values.size(1);
  expect_shape(op, "out", out, {R, C});
  expect_shape(op, "scales", in.scales, {fp8_blocks(C), R});
  const uint8_t* q = static_cast<const uint8_t*>(in.values.data);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c)
      out.ptr<float>()[r * C + c] = fp8_e4m3_to_float(q[r * C + c]) * in.scales.ptr<float>()[(c / kFp8Block) * R + r];
}

void dequantize_blocks(Tensor out, Fp8Tensor in) {
  const char* op = "dequantize_blocks";
  expect_dequantize(op, out, in, 3, "[E, O, I]");
  const int64_t E = in.values.size(0), O = in.values.size(1), I = in.values.size(2), OB = fp8_blocks(O), IB = fp8_blocks(I);
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
