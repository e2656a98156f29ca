#include "ops/grouped_linear.h"

#include <algorithm>
#include <array>
#include <vector>

#include "ops/common.h"

#ifdef __CUDACC__
#include <cstring>

#include "core/blas.h"
#include "core/cuda_check.h"
#include "core/memory.h"
#include "ops/wgmma.cuh"
#include "ops/wgmma_dw.cuh"
#endif

namespace marrow {

// The offsets drive raw row loops, so they must split [0, rows) into consecutive groups. Offsets in
// GPU memory (dispatch_plan's without a host copy) are checked for shape and type only: reading
// them would wait for the GPU, which is what keeping them there avoids.
void check_expert_offsets(const char* op, const Tensor& offsets, int64_t experts, int64_t rows) {
  expect_shape(op, "expert_offsets", offsets, {experts + 1});
  expect_dtype(op, "expert_offsets", offsets, DType::i32);
  if (offsets.device == Device::cuda) return;
  const int32_t* o = offsets.ptr<int32_t>();
  MARROW_CHECK(o[0] == 0 && o[experts] == rows, "{}: expert_offsets must run from 0 to the {} rows, got {} to {}", op, rows, o[0], o[experts]);
  for (int64_t g = 0; g < experts; ++g)
    MARROW_CHECK(o[g] <= o[g + 1], "{}: expert_offsets must not decrease, got expert_offsets[{}] = {} > expert_offsets[{}] = {}", op, g, o[g],
                 g + 1, o[g + 1]);
}

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

// grouped_linear.h's bands of dweight [E, O, I], each summed in f64 in row-major order.
template <typename T> void band_squares_cpu(double* squares, const T* dweight, int64_t e, int64_t o, int64_t in) {
  const int64_t bands_o = (o + kSquaresBandRows - 1) / kSquaresBandRows, bands_i = (in + kSquaresBandCols - 1) / kSquaresBandCols;
  for (int64_t band = 0; band < e * bands_o * bands_i; ++band) {
    const int64_t g = band / (bands_o * bands_i), r0 = band / bands_i % bands_o * kSquaresBandRows, c0 = band % bands_i * kSquaresBandCols;
    double sum = 0;
    for (int64_t r = r0; r < std::min(o, r0 + kSquaresBandRows); ++r)
      for (int64_t c = c0; c < std::min(in, c0 + kSquaresBandCols); ++c) {
        const double v = dweight[(g * o + r) * in + c];
        sum += v * v;
      }
    squares[band] = sum;
  }
}

// known_zero: grouped_linear.h's flags (null: none); an overwrite skips the flagged experts without
// rows, and the flags are updated after.
template <typename T>
void backward_weight_cpu(T* dweight, const T* dy, const T* x, const int32_t* offsets, int64_t e, int64_t o, int64_t in, bool overwrite,
                         int32_t* known_zero) {
  for (int64_t g = 0; g < e; ++g) {
    const bool rows = offsets[g + 1] > offsets[g];
    const bool skip = known_zero && overwrite && !rows && known_zero[g];
    if (known_zero && (overwrite || rows)) known_zero[g] = rows ? 0 : 1;
    if (skip) continue;
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
  expect_ndim(op, name, weight, 3, "[experts, out, in]");
  return {weight.size(0), weight.size(1), weight.size(2)};
}

// R from a [rows, cols] tensor.
int64_t row_count(const char* op, const char* name, const Tensor& t) {
  expect_ndim(op, name, t, 2, "[rows, features]");
  return t.size(0);
}

#ifdef __CUDACC__
// ---------------------------------------------------------------------------------------------
// GPU. Forward and backward_input: the own wgmma kernel (ops/wgmma.cuh) or, selected by
// set_grouped_gemm_backend, one cublasGemmGroupedBatchedEx call (bf16 in/out, fp32 compute) where
// every expert with rows is a group of one problem; experts without rows are left out. (cuBLAS 13's
// grouped call runs SM80 mma.sync kernels, ~260 TFLOP/s at the bench shapes; an own mma.sync kernel
// was 4-12% slower still; the wgmma kernel does 490-640: docs/performance.md.) backward_weight: an
// own TMA + wgmma kernel (ops/wgmma_dw.cuh) that adds dy_e^T x_e straight into the fp32 gradient;
// cuBLAS's grouped call has no fp32 output.
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
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "upload: 4- or 8-byte elements");
  const size_t bytes = host.size() * sizeof(T);
  Buffer device(sizeof(T) == 4 ? DType::i32 : DType::i64, Device::cuda, {int64_t(host.size())}, stream);
  auto* out = static_cast<unsigned char*>(device.view().data);
  for (size_t begin = 0; begin < bytes; begin += kParamBytes) {
    ParamBytes chunk;
    const size_t n = std::min<size_t>(kParamBytes, bytes - begin);
    std::memcpy(chunk.bytes, reinterpret_cast<const unsigned char*>(host.data()) + begin, n);
    launch_plain(store_bytes_kernel, 1, 256, 0, stream, out + begin, chunk, int(n));
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
  cublasHandle_t handle = cublas_handle(cuda_stream(stream));
  MARROW_CUBLAS_CHECK(cublasGemmGroupedBatchedEx(handle, transa.data(), transb.data(), ms.data(), ns.data(), ks.data(), alpha.data(),
                                                 p, CUDA_R_16BF, ldas.data(), p + groups, CUDA_R_16BF, ldbs.data(), beta.data(),
                                                 p + 2 * groups, CUDA_R_16BF, ldcs.data(), groups, sizes.data(),
                                                 CUBLAS_COMPUTE_32F));
}


// The offsets on the host (a copy, waiting for the GPU, when they are in its memory), for the paths
// that need the group sizes there.
std::vector<int32_t> host_offsets(Tensor expert_offsets, Stream stream) {
  if (expert_offsets.device == Device::cpu)
    return std::vector<int32_t>(expert_offsets.ptr<int32_t>(), expert_offsets.ptr<int32_t>() + expert_offsets.numel());
  const Buffer host = to_host(expert_offsets, stream);
  return std::vector<int32_t>(host.ptr<int32_t>(), host.ptr<int32_t>() + host.numel());
}

// The offsets in GPU memory, for the plain kernels: as given, or uploaded in stream order into
// `holder` when they are on the host.
const int32_t* device_offsets(Tensor expert_offsets, Buffer& holder, Stream stream) {
  if (expert_offsets.device == Device::cuda) return expert_offsets.ptr<int32_t>();
  holder = upload(host_offsets(expert_offsets, stream), stream);
  return holder.ptr<int32_t>();
}

static_assert(wgmma::kMaxExperts == kWgmmaMaxExperts, "grouped_linear.h's kWgmmaMaxExperts is not the wgmma kernel's limit");

// The wgmma kernel, which finds each expert's tiles from the offsets in GPU memory itself; with host
// offsets (uploaded) the host also knows the tile count and sizes the grid by it.
void grouped_gemm_wgmma(bool forward, Tensor out, Tensor in, Tensor weight, Tensor expert_offsets, int64_t e, int64_t o, int64_t i,
                        Stream stream) {
  Buffer holder;
  const int32_t* offsets = device_offsets(expert_offsets, holder, stream);
  const int tiles = expert_offsets.device == Device::cpu ? wgmma::tile_count(expert_offsets.ptr<int32_t>(), e, forward ? o : i) : -1;
  wgmma::grouped_gemm(forward, static_cast<bf16*>(out.data), static_cast<const bf16*>(in.data), static_cast<const bf16*>(weight.data),
                      offsets, tiles, e, o, i, in.size(0), cuda_stream(stream));
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
  if (rows == 0 || cols == 0) return;
  if (inner == 0) {  // empty sums
    MARROW_CUDA_CHECK(cudaMemsetAsync(out.data, 0, out.bytes(), cuda_stream(stream)));
    return;
  }
  if (o % 8 == 0 && i % 8 == 0 && aligned(out.data, 16) && aligned(in.data, 16) && aligned(weight.data, 16)) {
    if (grouped_gemm_backend == GroupedGemmBackend::cublas || e > kWgmmaMaxExperts)
      return grouped_gemm_cublas(forward, out, in, weight, host_offsets(expert_offsets, stream).data(), e, o, i, stream);
    return grouped_gemm_wgmma(forward, out, in, weight, expert_offsets, e, o, i, stream);
  }
  Buffer holder;
  const int32_t* offsets = device_offsets(expert_offsets, holder, stream);
  launch_plain(grouped_simple_kernel, unsigned((rows * cols + 255) / 256), 256, 0, stream, bf16_ptr(out), bf16_ptr(in), bf16_ptr(weight),
               offsets, int(e), rows, int(cols), int(inner), forward ? i : 1, forward ? 1 : i);
}

// --- backward_weight: dW[e] += dy_e^T x_e ----------------------------------------------------
// The own wgmma kernel (ops/wgmma_dw.cuh) where O and I are multiples of 8 and dy, x 16-byte
// aligned (TMA's rule), else grouped_dw_simple_kernel.

// dW[e][o][c] (+)= sum over expert e's rows r of dy[r, o] x[r, c], one thread per dW element, fp32
// sums in row order; an expert without rows is left alone when accumulating. Only for shapes the
// wgmma kernel cannot take (odd test shapes): slow.
__global__ void grouped_dw_simple_kernel(float* dweight, const bf16* dy, const bf16* x, const int32_t* offsets, int64_t n, int o_size,
                                         int i_size, bool accumulate) {
  const int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (idx >= n) return;
  const int64_t per_expert = int64_t(o_size) * i_size;
  const int e = int(idx / per_expert), o = int(idx % per_expert / i_size), c = int(idx % i_size);
  const int begin = offsets[e], end = offsets[e + 1];
  if (accumulate && begin == end) return;
  float sum = accumulate ? dweight[idx] : 0.0f;
  for (int64_t r = begin; r < end; ++r) sum += __bfloat162float(dy[r * o_size + o]) * __bfloat162float(x[r * i_size + c]);
  dweight[idx] = sum;
}

// grouped_linear.h's bands of dweight [E, O, I] read back (every expert's), one thread a band in
// f64, row-major: for the paths other than the wgmma kernel's epilogue (odd shapes, no rows at all).
__global__ void band_squares_kernel(double* squares, const float* dweight, int64_t bands, int o_size, int i_size) {
  const int64_t band = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (band >= bands) return;
  const int bands_o = int((o_size + kSquaresBandRows - 1) / kSquaresBandRows), bands_i = int((i_size + kSquaresBandCols - 1) / kSquaresBandCols);
  const int64_t g = band / (bands_o * bands_i);
  const int r0 = int(band / bands_i % bands_o * kSquaresBandRows), c0 = int(band % bands_i * kSquaresBandCols);
  double sum = 0;
  for (int r = r0; r < min(o_size, r0 + int(kSquaresBandRows)); ++r)
    for (int c = c0; c < min(i_size, c0 + int(kSquaresBandCols)); ++c) {
      const double v = dweight[(g * o_size + r) * i_size + c];
      sum += v * v;
    }
  squares[band] = sum;
}

// The wgmma kernel and its work list (wgmma_dw.cuh's work_list) over one source, or two (second's
// offsets not null): built on the host and sent in stream order, or, from offsets in GPU memory or
// with known_zero flags (which live there), built there by one block.
void backward_weight_wgmma(float* dweight, const wgmma::dw::Source (&sources)[2], Tensor offsets, Tensor second_offsets, int64_t e,
                           int64_t o, int64_t i, bool overwrite, double* squares, int32_t* known_zero, Stream stream) {
  const bool two = second_offsets.data != nullptr;
  Buffer work;
  int works = -1;  // not known on the host for a list built on the GPU
  if (offsets.device == Device::cuda || known_zero) {
    Buffer holders[2];
    const int32_t* first = device_offsets(offsets, holders[0], stream);
    const int32_t* second = two ? device_offsets(second_offsets, holders[1], stream) : nullptr;
    work = Buffer(DType::i32, Device::cuda, {wgmma::dw::kWorkInts * e + 2}, stream);
    const int band_count = int(grouped_weight_squares_count(1, o, i));
    launch_dependent(wgmma::dw::work_list_kernel, 1, wgmma::kScheduleThreads, 0, stream, work.ptr<int32_t>(), first, second, int(e), overwrite,
                     known_zero, squares, band_count);
  } else {
    const std::vector<int32_t> host =
        wgmma::dw::work_list(offsets.ptr<int32_t>(), two ? second_offsets.ptr<int32_t>() : nullptr, e, overwrite);
    works = host[0];
    if (works == 0) return;
    work = upload(host, stream);
  }
  wgmma::dw::grouped_dw(dweight, sources, work.ptr<int32_t>(), works, o, i, !overwrite, squares, cuda_stream(stream));
}

// Whether the wgmma kernel takes these rows (TMA's rules).
bool wgmma_takes(const Tensor& dweight, const Tensor& dy, const Tensor& x) {
  return dweight.size(1) % 8 == 0 && dweight.size(2) % 8 == 0 && aligned(dy.data, 16) && aligned(x.data, 16) && aligned(dweight.data, 8);
}

wgmma::dw::Source source_of(const Tensor& dy, const Tensor& x) {
  return {bf16_ptr(dy), bf16_ptr(x), dy.size(0)};
}

// grouped_linear.h's known_zero flags after a call that wrote every expert (overwrite) or every
// expert with rows, one thread an expert.
__global__ void update_known_zero_kernel(int32_t* known_zero, const int32_t* offsets, int experts, bool overwrite) {
  const int e = int(blockIdx.x * blockDim.x + threadIdx.x);
  if (e >= experts) return;
  const bool rows = offsets[e + 1] > offsets[e];
  if (overwrite || rows) known_zero[e] = rows ? 0 : 1;
}

void backward_weight_gpu(Tensor dweight, Tensor dy, Tensor x, Tensor expert_offsets, bool overwrite, Tensor squares, Tensor known_zero,
                         Stream stream) {
  const int64_t e = dweight.size(0), o = dweight.size(1), i = dweight.size(2), rows = dy.size(0);
  auto* dw_ptr = static_cast<float*>(dweight.data);
  auto* squares_ptr = static_cast<double*>(squares.data);
  auto* known_zero_ptr = static_cast<int32_t*>(known_zero.data);
  if (e == 0 || o == 0 || i == 0) return;
  if (rows > 0 && wgmma_takes(dweight, dy, x)) {
    const wgmma::dw::Source sources[2] = {source_of(dy, x), {nullptr, nullptr, 0}};
    return backward_weight_wgmma(dw_ptr, sources, expert_offsets, Tensor{}, e, o, i, overwrite, squares_ptr, known_zero_ptr, stream);
  }
  Buffer holder;
  const int32_t* offsets = device_offsets(expert_offsets, holder, stream);
  if (rows == 0) {  // every expert empty
    if (overwrite) MARROW_CUDA_CHECK(cudaMemsetAsync(dweight.data, 0, dweight.bytes(), cuda_stream(stream)));
  } else {
    launch_plain(grouped_dw_simple_kernel, unsigned((e * o * i + 255) / 256), 256, 0, stream, dw_ptr, bf16_ptr(dy), bf16_ptr(x), offsets,
                 e * o * i, int(o), int(i), !overwrite);
  }
  if (known_zero_ptr)
    launch_plain(update_known_zero_kernel, unsigned((e + 255) / 256), 256, 0, stream, known_zero_ptr, offsets, int(e), overwrite);
  if (squares_ptr)
    launch_plain(band_squares_kernel, unsigned((squares.numel() + 255) / 256), 256, 0, stream, squares_ptr, dw_ptr, squares.numel(), int(o),
                 int(i));
}

// One pass of the wgmma kernel over both micro-batches where it takes both, else the two calls.
void backward_weight_pair_gpu(Tensor dweight, const ExpertRows& first, const ExpertRows& second, bool overwrite, Tensor squares,
                              Tensor known_zero, Stream stream) {
  const int64_t e = dweight.size(0), o = dweight.size(1), i = dweight.size(2);
  if (e == 0 || o == 0 || i == 0) return;
  if (first.dy.size(0) + second.dy.size(0) > 0 && wgmma_takes(dweight, first.dy, first.x) && wgmma_takes(dweight, second.dy, second.x)) {
    const wgmma::dw::Source sources[2] = {source_of(first.dy, first.x), source_of(second.dy, second.x)};
    return backward_weight_wgmma(static_cast<float*>(dweight.data), sources, first.expert_offsets, second.expert_offsets, e, o, i,
                                 overwrite, static_cast<double*>(squares.data), static_cast<int32_t*>(known_zero.data), stream);
  }
  backward_weight_gpu(dweight, first.dy, first.x, first.expert_offsets, overwrite, squares, known_zero, stream);
  backward_weight_gpu(dweight, second.dy, second.x, second.expert_offsets, false, squares, known_zero, stream);
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
  check_expert_offsets(op, expert_offsets, e, r);
  if (common_device(op, {{"x", &x}, {"y", &y}, {"weight", &weight}}) == Device::cpu) {
    expect_same_dtype(op, {{"x", &x}, {"y", &y}, {"weight", &weight}});
    expect_device(op, "expert_offsets", expert_offsets, Device::cpu);
    return with_cpu_scalar(op, x, [&](auto s) {
      using T = decltype(s);
      forward_cpu<T>(y.ptr<T>(), x.ptr<T>(), weight.ptr<T>(), expert_offsets.ptr<int32_t>(), e, o, in);
    });
  }
  for (auto [name, t] : {std::pair{"x", &x}, std::pair{"y", &y}, std::pair{"weight", &weight}}) expect_dtype(op, name, *t, DType::bf16);
  MARROW_GPU_RETURN(op, stream, grouped_gemm_gpu(true, y, x, weight, expert_offsets, stream));
}

void grouped_linear_backward_input(Tensor dx, Tensor dy, Tensor weight, Tensor expert_offsets, Stream stream) {
  const char* op = "grouped_linear_backward_input";
  const std::array<int64_t, 3> sizes = weight_sizes(op, "weight", weight);
  const int64_t e = sizes[0], o = sizes[1], in = sizes[2];
  const int64_t r = row_count(op, "dy", dy);
  expect_shape(op, "dy", dy, {r, o});
  expect_shape(op, "dx", dx, {r, in});
  check_expert_offsets(op, expert_offsets, e, r);
  if (common_device(op, {{"dy", &dy}, {"dx", &dx}, {"weight", &weight}}) == Device::cpu) {
    expect_same_dtype(op, {{"dy", &dy}, {"dx", &dx}, {"weight", &weight}});
    expect_device(op, "expert_offsets", expert_offsets, Device::cpu);
    return with_cpu_scalar(op, dy, [&](auto s) {
      using T = decltype(s);
      backward_input_cpu<T>(dx.ptr<T>(), dy.ptr<T>(), weight.ptr<T>(), expert_offsets.ptr<int32_t>(), e, o, in);
    });
  }
  for (auto [name, t] : {std::pair{"dy", &dy}, std::pair{"dx", &dx}, std::pair{"weight", &weight}}) expect_dtype(op, name, *t, DType::bf16);
  MARROW_GPU_RETURN(op, stream, grouped_gemm_gpu(false, dx, dy, weight, expert_offsets, stream));
}

int64_t grouped_weight_squares_count(int64_t experts, int64_t o, int64_t i) {
  return experts * ((o + kSquaresBandRows - 1) / kSquaresBandRows) * ((i + kSquaresBandCols - 1) / kSquaresBandCols);
}

namespace {
// grouped_linear_backward_weight's checks of one call's tensors; returns whether they are on the CPU.
bool check_backward_weight(const char* op, const Tensor& dweight, const Tensor& dy, const Tensor& x, const Tensor& expert_offsets,
                           const Tensor& squares, const Tensor& known_zero) {
  const std::array<int64_t, 3> sizes = weight_sizes(op, "dweight", dweight);
  const int64_t e = sizes[0], o = sizes[1], in = sizes[2];
  const int64_t r = row_count(op, "dy", dy);
  expect_shape(op, "dy", dy, {r, o});
  expect_shape(op, "x", x, {r, in});
  check_expert_offsets(op, expert_offsets, e, r);
  if (squares.data != nullptr) {
    expect_shape(op, "squares", squares, {grouped_weight_squares_count(e, o, in)});
    expect_dtype(op, "squares", squares, DType::f64);
    expect_device(op, "squares", squares, dweight.device);
  }
  if (known_zero.data != nullptr) {
    expect_shape(op, "known_zero", known_zero, {e});
    expect_dtype(op, "known_zero", known_zero, DType::i32);
    expect_device(op, "known_zero", known_zero, dweight.device);
  }
  if (common_device(op, {{"dy", &dy}, {"dweight", &dweight}, {"x", &x}}) == Device::cpu) {
    expect_same_dtype(op, {{"dy", &dy}, {"dweight", &dweight}, {"x", &x}});
    expect_device(op, "expert_offsets", expert_offsets, Device::cpu);
    return true;
  }
  expect_dtype(op, "dy", dy, DType::bf16);
  expect_dtype(op, "x", x, DType::bf16);
  expect_dtype(op, "dweight", dweight, DType::f32);
  return false;
}
}  // namespace

void grouped_linear_backward_weight(Tensor dweight, Tensor dy, Tensor x, Tensor expert_offsets, bool overwrite, Tensor squares,
                                    Tensor known_zero, Stream stream) {
  const char* op = "grouped_linear_backward_weight";
  if (check_backward_weight(op, dweight, dy, x, expert_offsets, squares, known_zero)) {
    const int64_t e = dweight.size(0), o = dweight.size(1), in = dweight.size(2);
    return with_cpu_scalar(op, dy, [&](auto s) {
      using T = decltype(s);
      backward_weight_cpu<T>(dweight.ptr<T>(), dy.ptr<T>(), x.ptr<T>(), expert_offsets.ptr<int32_t>(), e, o, in, overwrite,
                             known_zero.data ? known_zero.ptr<int32_t>() : nullptr);
      if (squares.data != nullptr) band_squares_cpu<T>(squares.ptr<double>(), dweight.ptr<T>(), e, o, in);
    });
  }
  MARROW_GPU_RETURN(op, stream, backward_weight_gpu(dweight, dy, x, expert_offsets, overwrite, squares, known_zero, stream));
}

void grouped_linear_backward_weight_pair(Tensor dweight, const ExpertRows& first, const ExpertRows& second, bool overwrite,
                                         Tensor squares, Tensor known_zero, Stream stream) {
  const char* op = "grouped_linear_backward_weight_pair";
  // The rows' names in the messages say which micro-batch's are wrong.
  const bool cpu = check_backward_weight("grouped_linear_backward_weight_pair (first micro-batch)", dweight, first.dy, first.x,
                                         first.expert_offsets, squares, known_zero);
  check_backward_weight("grouped_linear_backward_weight_pair (second micro-batch)", dweight, second.dy, second.x, second.expert_offsets,
                        squares, known_zero);
  MARROW_CHECK(first.expert_offsets.device == second.expert_offsets.device,
               "{}: the two micro-batches' expert_offsets must be on the same device, got {} and {}", op,
               device_name(first.expert_offsets.device), device_name(second.expert_offsets.device));
  if (cpu) {
    grouped_linear_backward_weight(dweight, first.dy, first.x, first.expert_offsets, overwrite, squares, known_zero, stream);
    return grouped_linear_backward_weight(dweight, second.dy, second.x, second.expert_offsets, false, squares, known_zero, stream);
  }
  MARROW_GPU_RETURN(op, stream, backward_weight_pair_gpu(dweight, first, second, overwrite, squares, known_zero, stream));
}

const int32_t* expert_offsets_on_device(Tensor expert_offsets, Buffer& holder, Stream stream) {
  expect_dtype("expert_offsets_on_device", "expert_offsets", expert_offsets, DType::i32);
  MARROW_CHECK(expert_offsets.ndim == 1, "expert_offsets_on_device: expert_offsets must be [E + 1], got {}", expert_offsets.shape_string());
#ifdef __CUDACC__
  return device_offsets(expert_offsets, holder, stream);
#else
  (void)expert_offsets;
  (void)holder;
  (void)stream;
  no_cuda_kernel("expert_offsets_on_device");
#endif
}

}  // namespace marrow
