// The E4M3 block format's arithmetic (ops/fp8.h says what it computes), shared by ops/fp8.cu's
// quantization and ops/adamw.cu's AdamW that writes the weights' blocks in its pass. The kernels'
// part is CUDA only.
#pragma once
#include <cmath>
#include <cstdint>
#include <limits>

#include "core/rng.h"  // MARROW_HD
#include "ops/fp8.h"

#ifdef __CUDACC__
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#endif

namespace marrow::fp8_format {

// With amax = m 2^e (m in [0.5, 1)) and 448 = 0.875 2^9, amax / 2^k <= 448 first holds at k = e - 9
// when m <= 0.875, else at e - 8. Scales stay normal floats (k >= -126): a block of tiny values
// then rounds to E4M3's subnormals or zero, as it must.
MARROW_HD inline float block_scale(float amax) {
  if (!(amax <= std::numeric_limits<float>::max())) return std::numeric_limits<float>::quiet_NaN();
  if (amax == 0) return 1;
  int e = 0;
  const float m = frexpf(amax, &e);
  const int k = m <= 0.875f ? e - 9 : e - 8;
  return ldexpf(1.0f, k < -126 ? -126 : k);
}

// |v|'s contribution to a block's amax: a NaN must win, which max and fmaxf would drop.
MARROW_HD inline float magnitude(float v) {
  return v != v ? std::numeric_limits<float>::infinity() : std::fabs(v);
}

#ifdef __CUDACC__
template <typename T> __device__ __forceinline__ float to_float(T v) { return float(v); }
template <> __device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

// NaN (of either sign) as 0x7F, as the CPU reference writes it.
__device__ __forceinline__ uint8_t to_e4m3(float v) { return isnan(v) ? 0x7F : __nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3); }

__device__ __forceinline__ float warp_max(float v) {
  for (int m = 16; m > 0; m /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, m));
  return v;
}

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

// A 128 x 128 block of one matrix of [E, O, I] and its place: matrix e, block row ob of OB, block
// column ib of IB.
struct BlockPlace {
  int64_t e, ob, ib, OB, IB, O, I;
};

// kBlockThreads threads hold one block: thread t the columns block_col(t) .. + 7 of rows
// block_row(t, j), j < 8. The transposed bytes go out through a shared tile whose rows are 129
// bytes apart, so that reading down a column of it touches 16 different banks.
constexpr int kBlockThreads = 256, kTileStride = kFp8Block + 1;
__device__ __forceinline__ int block_row(int t, int j) { return t / 16 + 16 * j; }
__device__ __forceinline__ int block_col(int t) { return 8 * (t % 16); }

// The block's scale from all its values, then its bytes to q[e, o, i] and, when qt is given, to
// qt[e, i, o]; the scale to scales (and scales_t) at the block's place. value(j, c): this thread's
// value at row block_row(t, j), column block_col(t) + c (zero outside the matrix). vector: store8's
// condition for both byte matrices.
template <typename Value>
__device__ __forceinline__ void store_quantized_block(const Value& value, const BlockPlace& at, uint8_t* q, float* scales, uint8_t* qt,
                                                      float* scales_t, bool vector) {
  __shared__ uint8_t tile[kFp8Block * kTileStride];
  __shared__ float warp_amax[kBlockThreads / 32];
  const int t = threadIdx.x, col = block_col(t);
  float amax = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int c = 0; c < 8; ++c) amax = fmaxf(amax, magnitude(value(j, c)));
  amax = warp_max(amax);
  if (t % 32 == 0) warp_amax[t / 32] = amax;
  __syncthreads();
  amax = 0;
  for (int k = 0; k < kBlockThreads / 32; ++k) amax = fmaxf(amax, warp_amax[k]);
  const float scale = block_scale(amax), inverse = 1.0f / scale;
  const int64_t O = at.O, I = at.I;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int row = block_row(t, j);
    const int64_t o = at.ob * kFp8Block + row, i = at.ib * kFp8Block + col;
    uint8_t b[8];
#pragma unroll
    for (int c = 0; c < 8; ++c) {
      b[c] = to_e4m3(value(j, c) * inverse);
      tile[row * kTileStride + col + c] = b[c];
    }
    if (o < O && i < I) store8(q + at.e * O * I, b, o, i, I, vector);
  }
  if (t == 0) scales[(at.e * at.OB + at.ob) * at.IB + at.ib] = scale;
  if (qt == nullptr) return;
  if (t == 0) scales_t[(at.e * at.IB + at.ib) * at.OB + at.ob] = scale;
  __syncthreads();
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int out_row = block_row(t, j);  // a column of the tile
    const int64_t i = at.ib * kFp8Block + out_row, o = at.ob * kFp8Block + col;
    uint8_t b[8];
#pragma unroll
    for (int c = 0; c < 8; ++c) b[c] = tile[(col + c) * kTileStride + out_row];
    if (i < I && o < O) store8(qt + at.e * I * O, b, i, o, O, vector);
  }
}
#endif

}  // namespace marrow::fp8_format
