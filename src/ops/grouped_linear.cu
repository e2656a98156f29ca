#include "ops/grouped_linear.h"

#include <algorithm>
#include <array>
#include <vector>

#include "ops/common.h"

#ifdef __CUDACC__
#include <cuda_bf16.h>

#include <cstring>

#include "core/blas.h"
#include "core/cuda_check.h"
#include "core/memory.h"
#include "ops/wgmma.cuh"
#endif

namespace marrow {

namespace {

GroupedGemmBackend grouped_gemm_backend = GroupedGemmBackend::wgmma;

template <typename T>
void forward_cpu(T* y, const T* x, const T* weight, const int32_t* offsets, int64_t e, int64_t o, int64_t in) {
  for (int64_t g = 0; g < e; ++g) {
#pragma omp parallel for schedule(static) if ((offsets[g + 1] - offsets[g]) * o * in > kParallelWork)
    for (int64_t r = offsets[g]; r < offsets[g + 1]; ++r)
      for (int64_t i = 0; i < o; ++i) {
        const T *w = weight + (g * o + i) * in, *xr = x + r * in;
        double sum = 0;
        for (int64_t c = 0; c < in; ++c) sum += double(xr[c]) * w[c];
        y[r * o + i] = T(sum);
      }
  }
}

template <typename T>
void backward_input_cpu(T* dx, const T* dy, const T* weight, const int32_t* offsets, int64_t e, int64_t o, int64_t in) {
  for (int64_t g = 0; g < e; ++g) {
#pragma omp parallel if ((offsets[g + 1] - offsets[g]) * o * in > kParallelWork)
    {
      std::vector<double> sum(in);
#pragma omp for schedule(static)
      for (int64_t r = offsets[g]; r < offsets[g + 1]; ++r) {
        std::fill(sum.begin(), sum.end(), 0.0);
        for (int64_t i = 0; i < o; ++i) {
          const T* w = weight + (g * o + i) * in;
          const double d = dy[r * o + i];
          for (int64_t c = 0; c < in; ++c) sum[c] += d * w[c];
        }
        for (int64_t c = 0; c < in; ++c) dx[r * in + c] = T(sum[c]);
      }
    }
  }
}

template <typename T>
void backward_weight_cpu(T* dweight, const T* dy, const T* x, const int32_t* offsets, int64_t e, int64_t o, int64_t in, bool overwrite) {
  for (int64_t g = 0; g < e; ++g) {
#pragma omp parallel if ((offsets[g + 1] - offsets[g]) * o * in > kParallelWork)
    {
      std::vector<double> sum(in);
#pragma omp for schedule(static)
      for (int64_t i = 0; i < o; ++i) {
        std::fill(sum.begin(), sum.end(), 0.0);
        for (int64_t r = offsets[g]; r < offsets[g + 1]; ++r) {
          const double d = dy[r * o + i];
          for (int64_t c = 0; c < in; ++c) sum[c] += d * x[r * in + c];
        }
        T* dw = dweight + (g * o + i) * in;
        for (int64_t c = 0; c < in; ++c) dw[c] = overwrite ? T(sum[c]) : T(dw[c] + sum[c]);
      }
    }
  }
}

// weight[E, O, I]: returns (E, O, I).
std::array<int64_t, 3> weight_sizes(const char* op, const char* name, const Tensor& weight) {
  MARROW_CHECK(weight.ndim == 3, "{}: {} must be [experts, out, in], got {}", op, name, weight.shape_string());
  return {weight.size(0), weight.size(1), weight.size(2)};
}

// The offsets drive raw row loops, so they must split [0, rows) into consecutive groups.
void check_offsets(const char* op, const Tensor& offsets, int64_t experts, int64_t rows) {
  expect_shape(op, "expert_offsets", offsets, {experts + 1});
  expect_dtype(op, "expert_offsets", offsets, DType::i32);
  expect_device(op, "expert_offsets", offsets, Device::cpu);
  const int32_t* o = offsets.ptr<int32_t>();
  MARROW_CHECK(o[0] == 0 && o[experts] == rows, "{}: expert_offsets must run from 0 to the {} rows, got {} to {}", op, rows,
               o[0], o[experts]);
  for (int64_t g = 0; g < experts; ++g)
    MARROW_CHECK(o[g] <= o[g + 1],
                 "{}: expert_offsets must not decrease, got expert_offsets[{}] = {} > expert_offsets[{}] = {}", op, g, o[g],
                 g + 1, o[g + 1]);
}

// R from a [rows, cols] tensor.
int64_t row_count(const char* op, const char* name, const Tensor& t) {
  MARROW_CHECK(t.ndim == 2, "{}: {} must be [rows, features], got {}", op, name, t.shape_string());
  return t.size(0);
}

#ifdef __CUDACC__
// ---------------------------------------------------------------------------------------------
// GPU. Forward and backward_input: the own wgmma kernel (ops/wgmma.cuh) or, selected by
// set_grouped_gemm_backend, one cublasGemmGroupedBatchedEx call (bf16 in/out, fp32 compute) where
// every expert with rows is a group of one problem; experts without rows are left out. (cuBLAS 13's
// grouped call runs SM80 mma.sync kernels, ~260 TFLOP/s at the bench shapes; an own mma.sync kernel
// was 4-12% slower still; the wgmma kernel does 490-640: docs/performance.md.) backward_weight: an
// own grouped kernel (tensor cores through mma.sync, fp32 accumulators) that adds dy_e^T x_e straight
// into the fp32 gradient; cuBLAS's grouped call has no fp32 output.
using bf16 = __nv_bfloat16;

bool aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// Copies a small host array into device memory in stream order by passing it as kernel parameters:
// unlike cudaMemcpyAsync from pageable memory this never waits for the stream, and the host array
// may go away as soon as the call returns.
constexpr int kParamBytes = 2048;
struct ParamBytes {
  unsigned char bytes[kParamBytes];
};

__global__ void store_bytes_kernel(unsigned char* out, ParamBytes in, int n) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = in.bytes[i];
}

template <typename T>
Buffer upload(const std::vector<T>& host, Stream stream) {
  const size_t bytes = host.size() * sizeof(T);
  Buffer device(DType::i64, Device::cuda, {int64_t((bytes + 7) / 8)}, stream);
  auto* out = static_cast<unsigned char*>(device.view().data);
  for (size_t begin = 0; begin < bytes; begin += kParamBytes) {
    ParamBytes chunk;
    const size_t n = std::min<size_t>(kParamBytes, bytes - begin);
    std::memcpy(chunk.bytes, reinterpret_cast<const unsigned char*>(host.data()) + begin, n);
    store_bytes_kernel<<<1, 256, 0, static_cast<cudaStream_t>(stream.handle)>>>(out + begin, chunk, int(n));
    MARROW_CUDA_CHECK_LAUNCH();
  }
  return device;
}

// --- forward / backward_input ----------------------------------------------------------------
// Row-major to cuBLAS's column-major (W_e is [O, I] row-major = column-major [I, O]):
//   forward         y_e[R_e,O] = x_e W_e^T  ->  Y_e[O,R_e]  = op_T(W_e[I,O]) X_e[I,R_e]   (m=O, n=R_e, k=I)
//   backward_input  dx_e[R_e,I] = dy_e W_e  ->  DX_e[I,R_e] = W_e[I,O] DY_e[O,R_e]        (m=I, n=R_e, k=O)
// cuBLAS cannot look at the matrix pointers (they sit in device memory), so its kernels assume an
// alignment; the grouped call is used only where every matrix and every row starts on 16 bytes
// (O and I multiples of 8, base pointers 16-byte aligned): always true for the models' shapes, and
// the same condition as the wgmma kernel's. Other shapes (odd sizes in tests) take
// grouped_simple_kernel below.
void grouped_gemm_cublas(bool forward, Tensor out, Tensor in, Tensor weight, const int32_t* offsets, int64_t e, int64_t o,
                         int64_t i, Stream stream) {
  const int64_t m = forward ? o : i, k = forward ? i : o;  // out is [R, m], in is [R, k]
  std::vector<int> ms, ns, ks, ldas, ldbs, ldcs, sizes;
  std::vector<void*> a, b, c;
  for (int64_t g = 0; g < e; ++g) {
    const int64_t rows = offsets[g + 1] - offsets[g];
    if (rows == 0) continue;
    ms.push_back(int(m));
    ns.push_back(int(rows));
    ks.push_back(int(k));
    ldas.push_back(int(i));
    ldbs.push_back(int(k));
    ldcs.push_back(int(m));
    sizes.push_back(1);
    a.push_back(static_cast<bf16*>(weight.data) + g * o * i);
    b.push_back(static_cast<bf16*>(in.data) + int64_t(offsets[g]) * k);
    c.push_back(static_cast<bf16*>(out.data) + int64_t(offsets[g]) * m);
  }
  const int groups = int(ms.size());
  if (groups == 0) return;
  std::vector<cublasOperation_t> transa(groups, forward ? CUBLAS_OP_T : CUBLAS_OP_N), transb(groups, CUBLAS_OP_N);
  std::vector<float> alpha(groups, 1.0f), beta(groups, 0.0f);
  std::vector<void*> pointers = a;
  pointers.insert(pointers.end(), b.begin(), b.end());
  pointers.insert(pointers.end(), c.begin(), c.end());
  Buffer device_pointers = upload(pointers, stream);
  void** p = static_cast<void**>(device_pointers.view().data);
  cublasHandle_t handle = cublas_handle(static_cast<cudaStream_t>(stream.handle));
  MARROW_CUBLAS_CHECK(cublasGemmGroupedBatchedEx(handle, transa.data(), transb.data(), ms.data(), ns.data(), ks.data(), alpha.data(),
                                                 p, CUDA_R_16BF, ldas.data(), p + groups, CUDA_R_16BF, ldbs.data(), beta.data(),
                                                 p + 2 * groups, CUDA_R_16BF, ldcs.data(), groups, sizes.data(),
                                                 CUBLAS_COMPUTE_32F));
}

// The wgmma kernel: its tile schedule (offsets, each expert's first tile, a counter) goes to the
// device in stream order with the call.
void grouped_gemm_wgmma(bool forward, Tensor out, Tensor in, Tensor weight, const int32_t* offsets, int64_t e, int64_t o, int64_t i,
                        Stream stream) {
  const std::vector<int32_t> schedule = wgmma::tile_schedule(offsets, e, forward ? o : i);
  Buffer device_schedule = upload(schedule, stream);
  wgmma::grouped_gemm(forward, static_cast<bf16*>(out.data), static_cast<const bf16*>(in.data), static_cast<const bf16*>(weight.data),
                      static_cast<int32_t*>(device_schedule.view().data), schedule[size_t(2 * e + 1)], e, o, i, in.size(0),
                      static_cast<cudaStream_t>(stream.handle));
}

// out[r, c] = sum_j in[r, j] W_e[c * wc + j * wj] for row r of expert e, one thread per output, fp32
// sums in a fixed order. Only for shapes the wgmma kernel and the grouped cuBLAS call cannot take
// (see above): slow.
__global__ void grouped_simple_kernel(bf16* out, const bf16* in, const bf16* weight, const int32_t* offsets, int experts,
                                      int64_t rows, int cols, int inner, int64_t wc, int64_t wj) {
  const int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (idx >= rows * cols) return;
  const int64_t r = idx / cols;
  const int c = int(idx % cols);
  int lo = 0, hi = experts;  // the last expert whose first row is <= r: offsets[lo] <= r < offsets[lo + 1]
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (offsets[mid] <= r) lo = mid;
    else hi = mid;
  }
  const bf16* w = weight + int64_t(lo) * cols * inner + c * wc;
  const bf16* x = in + r * inner;
  float sum = 0;
  for (int j = 0; j < inner; ++j) sum += __bfloat162float(x[j]) * __bfloat162float(w[j * wj]);
  out[idx] = __float2bfloat16(sum);
}

void grouped_gemm_gpu(bool forward, Tensor out, Tensor in, Tensor weight, Tensor expert_offsets, Stream stream) {
  const int64_t e = weight.size(0), o = weight.size(1), i = weight.size(2), rows = in.size(0);
  const int64_t cols = forward ? o : i, inner = forward ? i : o;
  auto s = static_cast<cudaStream_t>(stream.handle);
  if (rows == 0 || cols == 0) return;
  if (inner == 0) {  // empty sums
    MARROW_CUDA_CHECK(cudaMemsetAsync(out.data, 0, out.bytes(), s));
    return;
  }
  if (o % 8 == 0 && i % 8 == 0 && aligned(out.data, 16) && aligned(in.data, 16) && aligned(weight.data, 16)) {
    if (grouped_gemm_backend == GroupedGemmBackend::cublas)
      return grouped_gemm_cublas(forward, out, in, weight, expert_offsets.ptr<int32_t>(), e, o, i, stream);
    return grouped_gemm_wgmma(forward, out, in, weight, expert_offsets.ptr<int32_t>(), e, o, i, stream);
  }
  Buffer offsets = upload(std::vector<int32_t>(expert_offsets.ptr<int32_t>(), expert_offsets.ptr<int32_t>() + e + 1), stream);
  const int64_t n = rows * cols;
  grouped_simple_kernel<<<unsigned((n + 255) / 256), 256, 0, s>>>(
      static_cast<bf16*>(out.data), static_cast<const bf16*>(in.data), static_cast<const bf16*>(weight.data),
      static_cast<const int32_t*>(offsets.view().data), int(e), rows, int(cols), int(inner), forward ? i : 1, forward ? 1 : i);
  MARROW_CUDA_CHECK_LAUNCH();
}

// --- backward_weight: dW[e] += dy_e^T x_e ----------------------------------------------------
// One block owns one 128x128 tile of one expert's dW[e] ([O, I], fp32) and loops over the expert's
// rows in order, 32 at a time: no other block touches the tile and the sum order is fixed, so the
// result is deterministic (no split over rows, no atomics). Rows stream through a 4-stage cp.async
// pipeline into shared memory as they lie in memory (dy rows: 128 o-values, x rows: 128 i-values);
// ldmatrix.trans turns them into mma.sync m16n8k16 fragments (A = dy^T, B = x). 8 warps as 2 x 4,
// each computing 64 x 32. Shapes with O or I not a multiple of 8 (or unaligned tensors) load
// element by element instead (kVec = false); everything else is the same.
namespace dw {
constexpr int kTile = 128;  // dW tile: 128 rows (o) x 128 columns (i); also the row length of a stage tile
constexpr int kRows = 32;   // token rows per pipeline stage (the GEMM's k step)
constexpr int kStages = 4;
constexpr int kThreads = 256;
constexpr int kStageElems = kRows * kTile;                           // one operand's stage tile
constexpr int kSmemBytes = kStages * 2 * kStageElems * int(sizeof(bf16));  // 64 KiB
}  // namespace dw

// Element (row, col) of a stage tile (rows of 128 bf16 = 16 chunks of 16 bytes): the chunk index is
// XORed with row % 8, so the 8 row addresses of one ldmatrix hit 8 different bank groups.
__device__ __forceinline__ int swizzle(int row, int col) { return row * dw::kTile + ((((col >> 3) ^ (row & 7))) << 3) + (col & 7); }

__device__ __forceinline__ uint32_t smem_address(const void* p) { return uint32_t(__cvta_generic_to_shared(p)); }

// Rows [row0, row0 + kRows) and columns [col0, col0 + 128) of g (row length ld) into a stage tile;
// rows at or past row_end and columns at or past cols are zero.
template <bool kVec>
__device__ __forceinline__ void load_stage(bf16* tile, const bf16* g, int64_t ld, int64_t row0, int64_t row_end, int col0, int cols) {
  if constexpr (kVec) {
    for (int chunk = threadIdx.x; chunk < dw::kRows * 16; chunk += dw::kThreads) {
      const int row = chunk >> 4, col = (chunk & 15) * 8;
      const bool inside = row0 + row < row_end && col0 + col < cols;
      const bf16* src = inside ? g + (row0 + row) * ld + col0 + col : g;
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_address(tile + swizzle(row, col))), "l"(src),
                   "r"(inside ? 16 : 0)
                   : "memory");
    }
  } else {
    for (int idx = threadIdx.x; idx < dw::kStageElems; idx += dw::kThreads) {
      const int row = idx / dw::kTile, col = idx % dw::kTile;
      const bool inside = row0 + row < row_end && col0 + col < cols;
      tile[swizzle(row, col)] = inside ? g[(row0 + row) * ld + col0 + col] : __float2bfloat16(0.0f);
    }
  }
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

__device__ __forceinline__ void mma_bf16_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The K loop: load(step) issues the cp.async copies of step `step` into stage
// step % kStages, compute(stage) multiplies a stage. kStages - 1 steps are in flight while one is
// multiplied; one barrier per step both publishes the stage and frees the one loaded next.
template <int kStages, class Load, class Compute>
__device__ __forceinline__ void pipelined_k_loop(int steps, Load&& load, Compute&& compute) {
  for (int step = 0; step < kStages - 1; ++step) {
    if (step < steps) load(step);
    cp_async_commit();
  }
  for (int step = 0; step < steps; ++step) {
    cp_async_wait<kStages - 2>();
    __syncthreads();
    if (step + kStages - 1 < steps) load(step + kStages - 1);
    cp_async_commit();
    compute(step % kStages);
  }
  cp_async_wait<0>();
}

// work[3 * z ..]: (expert, first row, end row) of the z-th expert with rows; grid (I tiles, O tiles, experts with rows).
template <bool kVec>
__global__ void __launch_bounds__(dw::kThreads, 2)
    grouped_dw_kernel(float* dweight, const bf16* dy, const bf16* x, const int32_t* work, int o_size, int i_size, bool accumulate) {
  extern __shared__ __align__(128) unsigned char smem[];
  bf16* sa = reinterpret_cast<bf16*>(smem);  // dy rows, [kStages][kRows][128 o]
  bf16* sb = sa + dw::kStages * dw::kStageElems;  // x rows,  [kStages][kRows][128 i]
  const int expert = work[3 * blockIdx.z], row_begin = work[3 * blockIdx.z + 1], row_end = work[3 * blockIdx.z + 2];
  const int o0 = blockIdx.y * dw::kTile, i0 = blockIdx.x * dw::kTile;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int warp_o = (warp >> 2) * 64, warp_i = (warp & 3) * 32;
  const int steps = (row_end - row_begin + dw::kRows - 1) / dw::kRows;

  auto load = [&](int step) {
    const int stage = step % dw::kStages;
    const int64_t r0 = row_begin + int64_t(step) * dw::kRows;
    load_stage<kVec>(sa + stage * dw::kStageElems, dy, o_size, r0, row_end, o0, o_size);
    load_stage<kVec>(sb + stage * dw::kStageElems, x, i_size, r0, row_end, i0, i_size);
  };

  // The accumulators start from the tile's current dW values (or zero when overwriting, where the
  // work list has every expert, so experts without rows get zeros): the kernel is bound by this fp32
  // read-modify-write (2 x 4 bytes per dW element against ~2 x 2 x 256 / 128 bytes of input per
  // element at the average expert's 256 rows), so the reads are issued first and wait in flight
  // behind the input pipeline, and the epilogue only stores (stores do not stall the block).
  // Accumulator (mi, ni): c0, c1 at (o = g, i = 2t, 2t + 1), c2, c3 at (o = g + 8, same i).
  float* out = dweight + int64_t(expert) * o_size * i_size;
  const int g = lane >> 2, t = lane & 3;
  float acc[4][4][4];
#pragma unroll
  for (int mi = 0; mi < 4; ++mi)
#pragma unroll
    for (int ni = 0; ni < 4; ++ni)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int o = o0 + warp_o + mi * 16 + g + half * 8, i = i0 + warp_i + ni * 8 + 2 * t;
        const float* p = out + int64_t(o) * i_size + i;
        float2 v = make_float2(0.0f, 0.0f);
        if (accumulate && o < o_size) {
          if constexpr (kVec) {
            if (i < i_size) v = *reinterpret_cast<const float2*>(p);
          } else {
            if (i < i_size) v.x = p[0];
            if (i + 1 < i_size) v.y = p[1];
          }
        }
        acc[mi][ni][2 * half] = v.x;
        acc[mi][ni][2 * half + 1] = v.y;
      }
  // ldmatrix lane roles: lane l gives the address of row l % 8 of 8x8 matrix l / 8.
  const int mat = lane >> 3, mat_row = lane & 7;
  pipelined_k_loop<dw::kStages>(steps, load, [&](int stage) {
    const bf16* a = sa + stage * dw::kStageElems;
    const bf16* b = sb + stage * dw::kStageElems;
#pragma unroll
    for (int kk = 0; kk < dw::kRows; kk += 16) {
      // A (16 o x 16 rows) = dy^T: matrices (o 0-7, k 0-7), (o 8-15, k 0-7), (o 0-7, k 8-15), (o 8-15, k 8-15).
      uint32_t af[4][4];
#pragma unroll
      for (int mi = 0; mi < 4; ++mi)
        ldmatrix_x4_trans(af[mi], smem_address(a + swizzle(kk + (mat >> 1) * 8 + mat_row, warp_o + mi * 16 + (mat & 1) * 8)));
      // B (16 rows x 8 i) = x, two n-tiles per ldmatrix: (k 0-7, i 0-7), (k 8-15, i 0-7), (k 0-7, i 8-15), (k 8-15, i 8-15).
      uint32_t bfrag[2][4];
#pragma unroll
      for (int nj = 0; nj < 2; ++nj)
        ldmatrix_x4_trans(bfrag[nj], smem_address(b + swizzle(kk + (mat & 1) * 8 + mat_row, warp_i + nj * 16 + (mat >> 1) * 8)));
#pragma unroll
      for (int mi = 0; mi < 4; ++mi)
#pragma unroll
        for (int ni = 0; ni < 4; ++ni)
          mma_bf16_16816(acc[mi][ni], af[mi], bfrag[ni >> 1][(ni & 1) * 2], bfrag[ni >> 1][(ni & 1) * 2 + 1]);
    }
  });

#pragma unroll
  for (int mi = 0; mi < 4; ++mi)
#pragma unroll
    for (int ni = 0; ni < 4; ++ni)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int o = o0 + warp_o + mi * 16 + g + half * 8, i = i0 + warp_i + ni * 8 + 2 * t;
        if (o >= o_size) continue;
        float* p = out + int64_t(o) * i_size + i;
        const float c0 = acc[mi][ni][2 * half], c1 = acc[mi][ni][2 * half + 1];
        if constexpr (kVec) {
          if (i < i_size) *reinterpret_cast<float2*>(p) = make_float2(c0, c1);
        } else {
          if (i < i_size) p[0] = c0;
          if (i + 1 < i_size) p[1] = c1;
        }
      }
}

template <bool kVec>
void launch_grouped_dw(dim3 grid, float* dweight, const bf16* dy, const bf16* x, const int32_t* work, int o, int i, bool accumulate,
                       cudaStream_t s) {
  MARROW_CUDA_CHECK(cudaFuncSetAttribute(grouped_dw_kernel<kVec>, cudaFuncAttributeMaxDynamicSharedMemorySize, dw::kSmemBytes));
  grouped_dw_kernel<kVec><<<grid, dw::kThreads, dw::kSmemBytes, s>>>(dweight, dy, x, work, o, i, accumulate);
  MARROW_CUDA_CHECK_LAUNCH();
}

void backward_weight_gpu(Tensor dweight, Tensor dy, Tensor x, Tensor expert_offsets, bool overwrite, Stream stream) {
  const int64_t e = dweight.size(0), o = dweight.size(1), i = dweight.size(2);
  const int32_t* offsets = expert_offsets.ptr<int32_t>();
  std::vector<int32_t> work;
  for (int64_t g = 0; g < e; ++g)
    if (overwrite || offsets[g + 1] > offsets[g]) work.insert(work.end(), {int32_t(g), offsets[g], offsets[g + 1]});
  const int64_t experts = int64_t(work.size()) / 3;
  if (experts == 0 || o == 0 || i == 0) return;
  MARROW_CHECK(experts <= 65535, "grouped_linear_backward_weight: {} experts with rows exceed the grid limit of 65535", experts);
  Buffer device_work = upload(work, stream);
  const dim3 grid(unsigned((i + dw::kTile - 1) / dw::kTile), unsigned((o + dw::kTile - 1) / dw::kTile), unsigned(experts));
  auto* dw_ptr = static_cast<float*>(dweight.data);
  auto *dy_ptr = static_cast<const bf16*>(dy.data), *x_ptr = static_cast<const bf16*>(x.data);
  auto* work_ptr = static_cast<const int32_t*>(device_work.view().data);
  auto s = static_cast<cudaStream_t>(stream.handle);
  if (o % 8 == 0 && i % 8 == 0 && aligned(dy.data, 16) && aligned(x.data, 16) && aligned(dweight.data, 8))
    launch_grouped_dw<true>(grid, dw_ptr, dy_ptr, x_ptr, work_ptr, int(o), int(i), !overwrite, s);
  else
    launch_grouped_dw<false>(grid, dw_ptr, dy_ptr, x_ptr, work_ptr, int(o), int(i), !overwrite, s);
}
#endif

}  // namespace

void set_grouped_gemm_backend(GroupedGemmBackend backend) { grouped_gemm_backend = backend; }

void grouped_linear_forward(Tensor y, Tensor x, Tensor weight, Tensor expert_offsets, Stream stream) {
  const char* op = "grouped_linear_forward";
  const std::array<int64_t, 3> sizes = weight_sizes(op, "weight", weight);
  const int64_t e = sizes[0], o = sizes[1], in = sizes[2];
  const int64_t r = row_count(op, "x", x);
  expect_shape(op, "x", x, {r, in});
  expect_shape(op, "y", y, {r, o});
  check_offsets(op, expert_offsets, e, r);
  if (common_device(op, {{"x", &x}, {"y", &y}, {"weight", &weight}}) == Device::cpu) {
    expect_same_dtype(op, {{"x", &x}, {"y", &y}, {"weight", &weight}});
    return with_cpu_scalar(op, x, [&](auto s) {
      using T = decltype(s);
      forward_cpu<T>(y.ptr<T>(), x.ptr<T>(), weight.ptr<T>(), expert_offsets.ptr<int32_t>(), e, o, in);
    });
  }
#ifdef __CUDACC__
  for (auto [name, t] : {std::pair{"x", &x}, std::pair{"y", &y}, std::pair{"weight", &weight}}) expect_dtype(op, name, *t, DType::bf16);
  grouped_gemm_gpu(true, y, x, weight, expert_offsets, stream);
#else
  (void)stream;
  no_cuda_kernel(op);
#endif
}

void grouped_linear_backward_input(Tensor dx, Tensor dy, Tensor weight, Tensor expert_offsets, Stream stream) {
  const char* op = "grouped_linear_backward_input";
  const std::array<int64_t, 3> sizes = weight_sizes(op, "weight", weight);
  const int64_t e = sizes[0], o = sizes[1], in = sizes[2];
  const int64_t r = row_count(op, "dy", dy);
  expect_shape(op, "dy", dy, {r, o});
  expect_shape(op, "dx", dx, {r, in});
  check_offsets(op, expert_offsets, e, r);
  if (common_device(op, {{"dy", &dy}, {"dx", &dx}, {"weight", &weight}}) == Device::cpu) {
    expect_same_dtype(op, {{"dy", &dy}, {"dx", &dx}, {"weight", &weight}});
    return with_cpu_scalar(op, dy, [&](auto s) {
      using T = decltype(s);
      backward_input_cpu<T>(dx.ptr<T>(), dy.ptr<T>(), weight.ptr<T>(), expert_offsets.ptr<int32_t>(), e, o, in);
    });
  }
#ifdef __CUDACC__
  for (auto [name, t] : {std::pair{"dy", &dy}, std::pair{"dx", &dx}, std::pair{"weight", &weight}}) expect_dtype(op, name, *t, DType::bf16);
  grouped_gemm_gpu(false, dx, dy, weight, expert_offsets, stream);
#else
  (void)stream;
  no_cuda_kernel(op);
#endif
}

void grouped_linear_backward_weight(Tensor dweight, Tensor dy, Tensor x, Tensor expert_offsets, bool overwrite, Stream stream) {
  const char* op = "grouped_linear_backward_weight";
  const std::array<int64_t, 3> sizes = weight_sizes(op, "dweight", dweight);
  const int64_t e = sizes[0], o = sizes[1], in = sizes[2];
  const int64_t r = row_count(op, "dy", dy);
  expect_shape(op, "dy", dy, {r, o});
  expect_shape(op, "x", x, {r, in});
  check_offsets(op, expert_offsets, e, r);
  if (common_device(op, {{"dy", &dy}, {"dweight", &dweight}, {"x", &x}}) == Device::cpu) {
    expect_same_dtype(op, {{"dy", &dy}, {"dweight", &dweight}, {"x", &x}});
    return with_cpu_scalar(op, dy, [&](auto s) {
      using T = decltype(s);
      backward_weight_cpu<T>(dweight.ptr<T>(), dy.ptr<T>(), x.ptr<T>(), expert_offsets.ptr<int32_t>(), e, o, in, overwrite);
    });
  }
#ifdef __CUDACC__
  expect_dtype(op, "dy", dy, DType::bf16);
  expect_dtype(op, "x", x, DType::bf16);
  expect_dtype(op, "dweight", dweight, DType::f32);
  backward_weight_gpu(dweight, dy, x, expert_offsets, overwrite, stream);
#else
  (void)stream;
  no_cuda_kernel(op);
#endif
}

}  // namespace marrow
