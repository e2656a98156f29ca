#include "ops/linear.h"

#include <algorithm>
#include <initializer_list>
#include <utility>

#include "ops/common.h"

#ifdef __CUDACC__
#include <array>
#include <cstdint>
#include <map>
#include <mutex>

#include "core/blas.h"
#include "core/cuda_check.h"
#endif

namespace marrow {

namespace {

// How many rows of length `cols` make a block that stays in the L2 cache while the loop over the
// other operand's rows reuses it.
template <typename T>
int64_t block_rows(int64_t cols) {
  return std::max<int64_t>(1, (128 << 10) / (std::max<int64_t>(1, cols) * int64_t(sizeof(T))));
}

// Dot products of contiguous rows of x and W, with a block of weight rows held in cache.
template <typename T>
void forward_cpu(T* y, const T* x, const T* w, int64_t n, int64_t in, int64_t out) {
  const int64_t block = block_rows<T>(in);
  for (int64_t o0 = 0; o0 < out; o0 += block) {
    const int64_t o1 = std::min(out, o0 + block);
#pragma omp parallel for schedule(static) if (n * (o1 - o0) * in > kParallelWork)
    for (int64_t r = 0; r < n; ++r)
      for (int64_t o = o0; o < o1; ++o) y[r * out + o] = dot(x + r * in, w + o * in, in);
  }
}

// dx[r, :] = sum_o dy[r, o] W[o, :] as contiguous row updates, with a block of weight rows in cache.
template <typename T>
void backward_input_cpu(T* dx, const T* dy, const T* w, int64_t n, int64_t in, int64_t out, bool accumulate) {
  if (!accumulate) std::fill(dx, dx + n * in, T(0));
  const int64_t block = block_rows<T>(in);
  for (int64_t o0 = 0; o0 < out; o0 += block) {
    const int64_t o1 = std::min(out, o0 + block);
#pragma omp parallel for schedule(static) if (n * (o1 - o0) * in > kParallelWork)
    for (int64_t r = 0; r < n; ++r)
      for (int64_t o = o0; o < o1; ++o) axpy(dx + r * in, dy[r * out + o], w + o * in, in);
  }
}

// dW[o, :] += sum_r dy[r, o] x[r, :] as contiguous row updates, with a block of x rows in cache.
// Blocks run in row order, so each element sums its terms in the order r = 0, 1, ...
template <typename T>
void backward_weight_cpu(T* dw, const T* dy, const T* x, int64_t n, int64_t in, int64_t out) {
  const int64_t block = block_rows<T>(in);
  for (int64_t r0 = 0; r0 < n; r0 += block) {
    const int64_t r1 = std::min(n, r0 + block);
#pragma omp parallel for schedule(static) if (out * (r1 - r0) * in > kParallelWork)
    for (int64_t o = 0; o < out; ++o)
      for (int64_t r = r0; r < r1; ++r) axpy(dw + o * in, dy[r * out + o], x + r * in, in);
  }
}

// The batch B of the operands: all 2-D (B = 1) or all 3-D with one leading size; the first names the layout.
int64_t batch_of(const char* op, std::initializer_list<std::pair<const char*, const Tensor*>> tensors, const char* layout) {
  const auto [first, t0] = *tensors.begin();
  MARROW_CHECK(t0->ndim == 2 || t0->ndim == 3, "{}: {} has shape {} but expected {} or [batch, {}", op, first, t0->shape_string(), layout,
               layout + 1);
  for (const auto& [name, t] : tensors)
    MARROW_CHECK(t->ndim == t0->ndim && (t0->ndim == 2 || t->size(0) == t0->size(0)), "{}: {} has shape {} but {} has shape {}", op, name,
                 t->shape_string(), first, t0->shape_string());
  return t0->ndim == 3 ? t0->size(0) : 1;
}

void expect_matrices(const char* op, const char* name, const Tensor& t, int64_t batch, int64_t rows, int64_t cols) {
  if (t.ndim == 3) return expect_shape(op, name, t, {batch, rows, cols});
  expect_shape(op, name, t, {rows, cols});
}

#ifdef __CUDACC__
int64_t batch_count(const Tensor& t) { return t.ndim == 3 ? t.size(0) : 1; }

// GPU: one cuBLASLt matmul per call, bf16 operands, fp32 compute and scale. cuBLASLt is
// column-major, and a row-major [r, c] matrix is the column-major [c, r] matrix with ld = c, so each
// product is written for the column-major views (W is HF's [O, I], i.e. column-major [I, O]):
//   forward          y[N,O] = x W^T   ->  Y[O,N]  = op_T(W[I,O]) X[I,N]          (TN: m=O, n=N, k=I)
//   backward_input   dx[N,I] = dy W   ->  DX[I,N] = W[I,O] DY[O,N]               (NN: m=I, n=N, k=O)
//   backward_weight  dW[O,I] += dy^T x -> DW[I,O] += X[I,N] op_T(DY[O,N])        (NT: m=I, n=O, k=N)
struct LtGemm {
  cublasOperation_t transa, transb;
  int64_t m, n, k;
  const void* a;
  int64_t lda;
  const void* b;
  int64_t ldb;
  void* d;  // also C: beta = 1 accumulates into D in place
  int64_t ldd;
  cudaDataType_t d_type;  // CUDA_R_16BF or CUDA_R_32F; A and B are always CUDA_R_16BF
  float beta;
  int64_t batch = 1;  // products of contiguous matrices one after another in a, b and d
};

// Descriptors, layouts and the heuristic's algorithm for one shape, built once and kept for the
// process: the same shape always runs the same algorithm, so results repeat bit for bit.
struct LtPlan {
  cublasLtMatmulDesc_t desc;
  cublasLtMatrixLayout_t a, b, d;
  cublasLtMatmulAlgo_t algo;
};

// The largest power of two up to 256 that divides the address: the heuristic must only offer
// algorithms that work with pointers this aligned (its default assumes 256).
uint32_t alignment(const void* p) {
  const auto v = reinterpret_cast<uintptr_t>(p);
  uint32_t a = 256;
  while (a > 1 && v % a != 0) a /= 2;
  return a;
}

const LtPlan& lt_plan(const char* op, const LtGemm& g) {
  int device = 0;
  MARROW_CUDA_CHECK(cudaGetDevice(&device));
  const uint32_t align_a = alignment(g.a), align_b = alignment(g.b), align_d = alignment(g.d);
  const std::array<int64_t, 14> key{device, g.transa, g.transb, g.m, g.n, g.k, g.lda, g.ldb, g.ldd, g.d_type,
                                    align_a, align_b, align_d, g.batch};
  static std::mutex mutex;
  static std::map<std::array<int64_t, 14>, LtPlan> plans;
  std::lock_guard<std::mutex> lock(mutex);
  if (auto it = plans.find(key); it != plans.end()) return it->second;

  LtPlan p{};
  MARROW_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  MARROW_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &g.transa, sizeof(g.transa)));
  MARROW_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &g.transb, sizeof(g.transb)));
  // Layouts describe the matrices as stored, before op().
  const bool ta = g.transa == CUBLAS_OP_T, tb = g.transb == CUBLAS_OP_T;
  MARROW_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.a, CUDA_R_16BF, ta ? g.k : g.m, ta ? g.m : g.k, g.lda));
  MARROW_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.b, CUDA_R_16BF, tb ? g.n : g.k, tb ? g.k : g.n, g.ldb));
  MARROW_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.d, g.d_type, g.m, g.n, g.ldd));
  if (g.batch > 1) {
    const int32_t count = int32_t(g.batch);
    const std::array<std::pair<cublasLtMatrixLayout_t, int64_t>, 3> strides{{{p.a, g.m * g.k}, {p.b, g.k * g.n}, {p.d, g.m * g.n}}};
    for (const auto& [layout, stride] : strides) {
      MARROW_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)));
      MARROW_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof(stride)));
    }
  }

  cublasLtMatmulPreference_t pref;
  MARROW_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t workspace = kBlasWorkspaceBytes;
  MARROW_CUBLAS_CHECK(
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace, sizeof(workspace)));
  MARROW_CUBLAS_CHECK(
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_a, sizeof(align_a)));
  MARROW_CUBLAS_CHECK(
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_b, sizeof(align_b)));
  MARROW_CUBLAS_CHECK(
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_d, sizeof(align_d)));
  MARROW_CUBLAS_CHECK(
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_d, sizeof(align_d)));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t status =
      cublasLtMatmulAlgoGetHeuristic(cublaslt_handle(), p.desc, p.a, p.b, p.d, p.d, pref, 1, &result, &found);
  const cublasStatus_t destroyed = cublasLtMatmulPreferenceDestroy(pref);
  MARROW_CUBLAS_CHECK(status);
  MARROW_CUBLAS_CHECK(destroyed);
  MARROW_CHECK(found > 0, "{}: cuBLASLt has no algorithm for m={} n={} k={} (lda={} ldb={} ldd={}, alignment {}/{}/{} bytes)", op,
               g.m, g.n, g.k, g.lda, g.ldb, g.ldd, align_a, align_b, align_d);
  p.algo = result.algo;
  return plans.emplace(key, p).first->second;
}

void lt_matmul(const char* op, const LtGemm& g, Stream stream) {
  auto s = static_cast<cudaStream_t>(stream.handle);
  if (g.m == 0 || g.n == 0) return;
  if (g.k == 0) {  // an empty sum: D = beta * C
    if (g.beta == 0)
      MARROW_CUDA_CHECK(cudaMemset2DAsync(g.d, size_t(g.ldd) * (g.d_type == CUDA_R_32F ? 4 : 2), 0,
                                          size_t(g.m) * (g.d_type == CUDA_R_32F ? 4 : 2), size_t(g.n * g.batch), s));
    return;
  }
  const LtPlan& p = lt_plan(op, g);
  const float alpha = 1.0f, beta = g.beta;
  MARROW_CUBLAS_CHECK(cublasLtMatmul(cublaslt_handle(), p.desc, &alpha, g.a, p.a, g.b, p.b, &beta, g.d, p.d, g.d, p.d, &p.algo,
                                     blas_workspace(s), kBlasWorkspaceBytes, s));
}

void forward_gpu(const char* op, Tensor y, Tensor x, Tensor w, Stream stream) {
  expect_dtype(op, "x", x, DType::bf16);
  expect_dtype(op, "weight", w, DType::bf16);
  MARROW_CHECK(y.dtype == DType::bf16 || y.dtype == DType::f32, "{}: y has dtype {} but expected bf16 or f32", op,
               dtype_name(y.dtype));
  const int64_t n = x.size(-2), in = x.size(-1), out = w.size(-2);
  lt_matmul(op, {CUBLAS_OP_T, CUBLAS_OP_N, out, n, in, w.data, in, x.data, in, y.data, out,
                 y.dtype == DType::f32 ? CUDA_R_32F : CUDA_R_16BF, 0.0f, batch_count(x)},
            stream);
}

void backward_input_gpu(const char* op, Tensor dx, Tensor dy, Tensor w, bool accumulate, Stream stream) {
  expect_dtype(op, "dy", dy, DType::bf16);
  expect_dtype(op, "dx", dx, DType::bf16);
  expect_dtype(op, "weight", w, DType::bf16);
  const int64_t n = dy.size(-2), out = w.size(-2), in = w.size(-1);
  lt_matmul(op,
            {CUBLAS_OP_N, CUBLAS_OP_N, in, n, out, w.data, in, dy.data, out, dx.data, in, CUDA_R_16BF, accumulate ? 1.0f : 0.0f, batch_count(dy)},
            stream);
}

void backward_weight_gpu(const char* op, Tensor dw, Tensor dy, Tensor x, bool overwrite, Stream stream) {
  expect_dtype(op, "x", x, DType::bf16);
  expect_dtype(op, "dy", dy, DType::bf16);
  expect_dtype(op, "dweight", dw, DType::f32);
  const int64_t n = x.size(-2), in = x.size(-1), out = dy.size(-1);
  lt_matmul(op,
            {CUBLAS_OP_N, CUBLAS_OP_T, in, out, n, x.data, in, dy.data, out, dw.data, in, CUDA_R_32F, overwrite ? 0.0f : 1.0f, batch_count(x)},
            stream);
}
#endif

}  // namespace

void linear_forward(Tensor y, Tensor x, Tensor weight, Stream stream) {
  const char* op = "linear_forward";
  const int64_t batch = batch_of(op, {{"x", &x}, {"weight", &weight}, {"y", &y}}, "[rows, in]");
  const int64_t n = x.size(-2), in = x.size(-1), out = weight.size(-2);
  expect_matrices(op, "weight", weight, batch, out, in);
  expect_matrices(op, "y", y, batch, n, out);
  if (common_device(op, {{"x", &x}, {"y", &y}, {"weight", &weight}}) == Device::cpu) {
    expect_same_dtype(op, {{"x", &x}, {"y", &y}, {"weight", &weight}});
    return with_cpu_scalar(op, x, [&](auto s) {
      using T = decltype(s);
      for (int64_t b = 0; b < batch; ++b)
        forward_cpu<T>(y.ptr<T>() + b * n * out, x.ptr<T>() + b * n * in, weight.ptr<T>() + b * out * in, n, in, out);
    });
  }
  MARROW_GPU_RETURN(op, stream, forward_gpu(op, y, x, weight, stream));
}

void linear_backward_input(Tensor dx, Tensor dy, Tensor weight, bool accumulate, Stream stream) {
  const char* op = "linear_backward_input";
  const int64_t batch = batch_of(op, {{"dy", &dy}, {"weight", &weight}, {"dx", &dx}}, "[rows, out]");
  const int64_t n = dy.size(-2), out = weight.size(-2), in = weight.size(-1);
  expect_matrices(op, "dy", dy, batch, n, out);
  expect_matrices(op, "dx", dx, batch, n, in);
  if (common_device(op, {{"dy", &dy}, {"dx", &dx}, {"weight", &weight}}) == Device::cpu) {
    expect_same_dtype(op, {{"dy", &dy}, {"dx", &dx}, {"weight", &weight}});
    return with_cpu_scalar(op, dy, [&](auto s) {
      using T = decltype(s);
      for (int64_t b = 0; b < batch; ++b)
        backward_input_cpu<T>(dx.ptr<T>() + b * n * in, dy.ptr<T>() + b * n * out, weight.ptr<T>() + b * out * in, n, in, out, accumulate);
    });
  }
  MARROW_GPU_RETURN(op, stream, backward_input_gpu(op, dx, dy, weight, accumulate, stream));
}

void linear_backward_weight(Tensor dweight, Tensor dy, Tensor x, bool overwrite, Stream stream) {
  const char* op = "linear_backward_weight";
  const int64_t batch = batch_of(op, {{"x", &x}, {"dy", &dy}, {"dweight", &dweight}}, "[rows, in]");
  const int64_t n = x.size(-2), in = x.size(-1), out = dy.size(-1);
  expect_matrices(op, "dy", dy, batch, n, out);
  expect_matrices(op, "dweight", dweight, batch, out, in);
  if (common_device(op, {{"x", &x}, {"dy", &dy}, {"dweight", &dweight}}) == Device::cpu) {
    expect_same_dtype(op, {{"x", &x}, {"dy", &dy}, {"dweight", &dweight}});
    return with_cpu_scalar(op, x, [&](auto s) {
      using T = decltype(s);
      if (overwrite) std::fill(dweight.ptr<T>(), dweight.ptr<T>() + batch * out * in, T(0));
      for (int64_t b = 0; b < batch; ++b)
        backward_weight_cpu<T>(dweight.ptr<T>() + b * out * in, dy.ptr<T>() + b * n * out, x.ptr<T>() + b * n * in, n, in, out);
    });
  }
  MARROW_GPU_RETURN(op, stream, backward_weight_gpu(op, dweight, dy, x, overwrite, stream));
}

}  // namespace marrow
