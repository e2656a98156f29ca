// Standalone probe for the wgmma grouped GEMM (src/ops/wgmma.cuh) and the expert weight gradient
// (src/ops/wgmma_dw.cuh) without the rest of Marrow: correctness against a plain CUDA reference,
// bitwise determinism, and TFLOP/s (the GEMM against cublasGemmGroupedBatchedEx) at the bench
// shapes (skewed and even routing), plus a timing study (uniform vs normal data, one call vs 20 back
// to back, host time per launch). It uses Marrow's headers, not its library. On a GPU machine, from
// the repository root:
//   ninja -C build-gpu wgmma_probe && build-gpu/wgmma_probe (built with the CUDA code), or by hand:
//   cd tools/wgmma_probe && nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -I../../src \
//     -DFMT_HEADER_ONLY -DMARROW_CUDA=1 -o probe probe.cu -lcublas && ./probe
//   (PROBE_SHORT=1: the timing study only; PROBE_DW=1: dW only)
#include <cublas_v2.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "ops/wgmma.cuh"
#include "ops/wgmma_dw.cuh"

// cuBLAS calls: file:line, the call and cuBLAS's message (the probe's stand-in for Marrow's macro).
#define MARROW_CUBLAS_CHECK(call)                                                         \
  do {                                                                                    \
    cublasStatus_t marrow_st_ = (call);                                                   \
    if (marrow_st_ != CUBLAS_STATUS_SUCCESS)                                              \
      ::marrow::fail_call(__FILE__, __LINE__, #call, cublasGetStatusString(marrow_st_));  \
  } while (0)

using marrow::wgmma::bf16;

// ops/launch.h's switch, which marrow_lib defines: the probe launches the kernels plainly, one at a
// time, as it times them.
bool marrow::dependent_launch() { return false; }

__global__ void fill_random(bf16* p, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed * 40503u ^ uint32_t(i >> 32) * 97u;
    h ^= h >> 15; h *= 2246822519u; h ^= h >> 13; h *= 3266489917u; h ^= h >> 16;
    p[i] = __float2bfloat16(float(h & 0xFFFF) / 32768.0f - 1.0f);
  }
}
// Normal(0, 1) values like Marrow's random_device (Box-Muller on two hashes).
__global__ void fill_normal(bf16* p, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed * 40503u ^ uint32_t(i >> 32) * 97u;
    h ^= h >> 15; h *= 2246822519u; h ^= h >> 13; h *= 3266489917u; h ^= h >> 16;
    uint32_t g = h * 747796405u + 2891336453u; g ^= g >> 13; g *= 2246822519u; g ^= g >> 16;
    const float u1 = (float(h >> 8) + 1.0f) / 16777217.0f, u2 = float(g >> 8) / 16777216.0f;
    p[i] = __float2bfloat16(sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2));
  }
}
__global__ void fill_nan(bf16* p, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    p[i] = __ushort_as_bfloat16(0x7FC1);
}
// out[r, c] = sum_j in[r, j] B_e(j, c); B_e(j, c) = W[e][c][j] (forward) or W[e][j][c] (backward).
__global__ void reference(float* out, const bf16* in, const bf16* w, const int32_t* offsets, int experts, int64_t rows, int cols, int inner,
                          int o, int i, bool forward) {
  const int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (idx >= rows * cols) return;
  const int64_t r = idx / cols;
  const int c = int(idx % cols);
  int e = 0;
  while (offsets[e + 1] <= r) ++e;
  const bf16* we = w + int64_t(e) * o * i;
  float sum = 0;
  for (int j = 0; j < inner; ++j)
    sum += __bfloat162float(in[r * inner + j]) * __bfloat162float(forward ? we[int64_t(c) * i + j] : we[int64_t(j) * i + c]);
  out[idx] = sum;
}
__global__ void error_kernel(const bf16* got, const float* want, int64_t n, float* result) {  // result: max |diff|, max |want|, nan count
  float diff = 0, mag = 0, bad = 0;
  for (int64_t k = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; k < n; k += int64_t(gridDim.x) * blockDim.x) {
    const float g = __bfloat162float(got[k]);
    if (!isfinite(g)) bad += 1;
    else diff = fmaxf(diff, fabsf(g - want[k]));
    mag = fmaxf(mag, fabsf(want[k]));
  }
  atomicMax(reinterpret_cast<int*>(result), __float_as_int(diff));
  atomicMax(reinterpret_cast<int*>(result + 1), __float_as_int(mag));
  atomicAdd(result + 2, bad);
}

std::vector<int32_t> skewed_counts(int64_t experts, int64_t rows) {  // Marrow's check.cpp routing
  std::vector<double> weight(experts);
  for (int64_t g = 0; g < experts; ++g) weight[g] = (g % 19 == 7 || g == 3) ? 0.0 : 1.0 / (1.0 + double((g * 37) % experts) / 8.0);
  double total = 0;
  for (double v : weight) total += v;
  std::vector<int32_t> counts(experts);
  counts[3 % experts] = 1;
  int64_t assigned = 1;
  for (int64_t g = 0; g < experts; ++g) {
    if (weight[g] == 0) continue;
    counts[g] = int32_t(std::floor(double(rows - 1) * weight[g] / total));
    assigned += counts[g];
  }
  counts[0] += int32_t(rows - assigned);
  return counts;
}

cublasHandle_t handle;
void cublas_grouped(bool forward, bf16* out, const bf16* in, const bf16* weight, const std::vector<int32_t>& offsets, int64_t o, int64_t i,
                    void** dev_ptrs) {
  const int64_t m = forward ? o : i, k = forward ? i : o;
  std::vector<int> ms, ns, ks, ldas, ldbs, ldcs, sizes;
  std::vector<void*> a, b, c;
  for (size_t g = 0; g + 1 < offsets.size(); ++g) {
    const int rows = offsets[g + 1] - offsets[g];
    if (rows == 0) continue;
    ms.push_back(int(m)); ns.push_back(rows); ks.push_back(int(k)); ldas.push_back(int(i)); ldbs.push_back(int(k)); ldcs.push_back(int(m));
    sizes.push_back(1);
    a.push_back((void*)(weight + g * o * i)); b.push_back((void*)(in + int64_t(offsets[g]) * k)); c.push_back(out + int64_t(offsets[g]) * m);
  }
  const int groups = int(ms.size());
  std::vector<cublasOperation_t> ta(groups, forward ? CUBLAS_OP_T : CUBLAS_OP_N), tb(groups, CUBLAS_OP_N);
  std::vector<float> alpha(groups, 1.0f), beta(groups, 0.0f);
  std::vector<void*> p = a;
  p.insert(p.end(), b.begin(), b.end());
  p.insert(p.end(), c.begin(), c.end());
  MARROW_CUDA_CHECK(cudaMemcpy(dev_ptrs, p.data(), p.size() * sizeof(void*), cudaMemcpyHostToDevice));
  cublasStatus_t st = cublasGemmGroupedBatchedEx(handle, ta.data(), tb.data(), ms.data(), ns.data(), ks.data(), alpha.data(), (const void**)dev_ptrs,
                                                 CUDA_R_16BF, ldas.data(), (const void**)(dev_ptrs + groups), CUDA_R_16BF, ldbs.data(), beta.data(),
                                                 dev_ptrs + 2 * groups, CUDA_R_16BF, ldcs.data(), groups, sizes.data(), CUBLAS_COMPUTE_32F);
  MARROW_CUBLAS_CHECK(st);
}

template <class F>
float median_ms(F&& f) {
  cudaEvent_t a, b;
  MARROW_CUDA_CHECK(cudaEventCreate(&a)); MARROW_CUDA_CHECK(cudaEventCreate(&b));
  f(); f();
  std::vector<float> t;
  for (int rep = 0; rep < 10; ++rep) {
    MARROW_CUDA_CHECK(cudaEventRecord(a)); f(); MARROW_CUDA_CHECK(cudaEventRecord(b)); MARROW_CUDA_CHECK(cudaEventSynchronize(b));
    float ms; MARROW_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b)); t.push_back(ms);
  }
  std::sort(t.begin(), t.end());
  return t[5];
}

void run(const char* label, bool forward, std::vector<int32_t> counts, int64_t o, int64_t i, bool time) {
  const int64_t e = int64_t(counts.size());
  std::vector<int32_t> offsets(e + 1, 0);
  for (int64_t g = 0; g < e; ++g) offsets[g + 1] = offsets[g] + counts[g];
  const int64_t rows = offsets[e], cols = forward ? o : i, inner = forward ? i : o;
  bf16 *in, *w, *out, *out2;
  float *ref, *err;
  int32_t* doff;
  void** ptrs;
  MARROW_CUDA_CHECK(cudaMalloc(&in, std::max<int64_t>(1, rows * inner) * 2));
  MARROW_CUDA_CHECK(cudaMalloc(&w, e * o * i * 2));
  MARROW_CUDA_CHECK(cudaMalloc(&out, std::max<int64_t>(1, rows * cols) * 2));
  MARROW_CUDA_CHECK(cudaMalloc(&out2, std::max<int64_t>(1, rows * cols) * 2));
  MARROW_CUDA_CHECK(cudaMalloc(&ref, std::max<int64_t>(1, rows * cols) * 4));
  MARROW_CUDA_CHECK(cudaMalloc(&err, 16));
  MARROW_CUDA_CHECK(cudaMalloc(&ptrs, 3 * e * sizeof(void*)));
  MARROW_CUDA_CHECK(cudaMalloc(&doff, (e + 1) * 4));
  fill_random<<<1024, 256>>>(in, rows * inner, 1); MARROW_CUDA_CHECK_LAUNCH();
  fill_random<<<1024, 256>>>(w, e * o * i, 2); MARROW_CUDA_CHECK_LAUNCH();
  fill_nan<<<1024, 256>>>(out, rows * cols); MARROW_CUDA_CHECK_LAUNCH();
  MARROW_CUDA_CHECK(cudaMemcpy(doff, offsets.data(), (e + 1) * 4, cudaMemcpyHostToDevice));
  const int tiles = marrow::wgmma::tile_count(offsets.data(), e, cols);
  auto mine = [&](bf16* dst) { marrow::wgmma::grouped_gemm(forward, dst, in, w, doff, tiles, e, o, i, rows, 0); };
  mine(out);
  MARROW_CUDA_CHECK(cudaDeviceSynchronize());
  float h[3] = {0, 0, 0};
  if (rows * cols > 0) {
    reference<<<unsigned((rows * cols + 255) / 256), 256>>>(ref, in, w, doff, int(e), rows, int(cols), int(inner), int(o), int(i), forward); MARROW_CUDA_CHECK_LAUNCH();
    MARROW_CUDA_CHECK(cudaMemset(err, 0, 16));
    error_kernel<<<1024, 256>>>(out, ref, rows * cols, err); MARROW_CUDA_CHECK_LAUNCH();
    MARROW_CUDA_CHECK(cudaDeviceSynchronize());
    MARROW_CUDA_CHECK(cudaMemcpy(h, err, 12, cudaMemcpyDeviceToHost));
  }
  fill_nan<<<1024, 256>>>(out2, rows * cols); MARROW_CUDA_CHECK_LAUNCH();
  mine(out2);
  MARROW_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<uint16_t> a(rows * cols), b(rows * cols);
  MARROW_CUDA_CHECK(cudaMemcpy(a.data(), out, a.size() * 2, cudaMemcpyDeviceToHost));
  MARROW_CUDA_CHECK(cudaMemcpy(b.data(), out2, b.size() * 2, cudaMemcpyDeviceToHost));
  const bool same = a == b;
  const double rel = h[1] > 0 ? h[0] / h[1] : h[0];
  printf("%-34s %s E%-3ld R%-6ld %5ldx%-5ld tiles %5d  err %.3e (max|ref| %.1f) nan %.0f  bitwise-repeat %s  %s", label, forward ? "fwd" : "bwd",
         long(e), long(rows), long(inner), long(cols), tiles, rel, h[1], h[2], same ? "yes" : "NO", rel < 1e-2 && h[2] == 0 && same ? "PASS" : "FAIL");
  if (time) {
    const double flops = 2.0 * rows * cols * inner;
    const float t_mine = median_ms([&] { mine(out); });
    const float t_cublas = median_ms([&] { cublas_grouped(forward, out2, in, w, offsets, o, i, ptrs); });
    printf("  wgmma %.3f ms %.0f TFLOP/s | cublas %.3f ms %.0f TFLOP/s", t_mine, flops / t_mine * 1e-9, t_cublas, flops / t_cublas * 1e-9);
  }
  printf("\n");
  fflush(stdout);
  for (void* p : std::initializer_list<void*>{in, w, out, out2, ref, err, ptrs, doff}) MARROW_CUDA_CHECK(cudaFree(p));
}

#include <chrono>
// Where bench --kernels and the probe differ: data (uniform vs normal), one call between events vs
// 20 back to back (host overhead hidden), and the host time of one launch.
void timing_study(const char* label, bool forward, const std::vector<int32_t>& counts, int64_t o, int64_t i) {
  const int64_t e = int64_t(counts.size());
  std::vector<int32_t> offsets(e + 1, 0);
  for (int64_t g = 0; g < e; ++g) offsets[g + 1] = offsets[g] + counts[g];
  const int64_t rows = offsets[e], cols = forward ? o : i, inner = forward ? i : o;
  bf16 *in, *w, *out;
  int32_t* doff;
  void** ptrs;
  MARROW_CUDA_CHECK(cudaMalloc(&in, rows * inner * 2));
  MARROW_CUDA_CHECK(cudaMalloc(&w, e * o * i * 2));
  MARROW_CUDA_CHECK(cudaMalloc(&out, rows * cols * 2));
  MARROW_CUDA_CHECK(cudaMalloc(&ptrs, 3 * e * sizeof(void*)));
  MARROW_CUDA_CHECK(cudaMalloc(&doff, (e + 1) * 4));
  MARROW_CUDA_CHECK(cudaMemcpy(doff, offsets.data(), (e + 1) * 4, cudaMemcpyHostToDevice));
  const int tiles = marrow::wgmma::tile_count(offsets.data(), e, cols);
  const double flops = 2.0 * rows * cols * inner;
  auto mine = [&] { marrow::wgmma::grouped_gemm(forward, out, in, w, doff, tiles, e, o, i, rows, 0); };
  auto theirs = [&] { cublas_grouped(forward, out, in, w, offsets, o, i, ptrs); };
  cudaEvent_t a, b;
  MARROW_CUDA_CHECK(cudaEventCreate(&a)); MARROW_CUDA_CHECK(cudaEventCreate(&b));
  for (int normal = 0; normal < 2; ++normal) {
    if (normal) { fill_normal<<<1024, 256>>>(in, rows * inner, 1); MARROW_CUDA_CHECK_LAUNCH(); fill_normal<<<1024, 256>>>(w, e * o * i, 2); MARROW_CUDA_CHECK_LAUNCH(); }
    else { fill_random<<<1024, 256>>>(in, rows * inner, 1); MARROW_CUDA_CHECK_LAUNCH(); fill_random<<<1024, 256>>>(w, e * o * i, 2); MARROW_CUDA_CHECK_LAUNCH(); }
    MARROW_CUDA_CHECK(cudaDeviceSynchronize());
    printf("%-20s %s %s data:", label, forward ? "fwd" : "bwd", normal ? "normal " : "uniform");
    for (int which = 0; which < 2; ++which) {
      auto call = [&] { which ? theirs() : mine(); };
      const float single = median_ms(call);
      call();
      MARROW_CUDA_CHECK(cudaEventRecord(a));
      const auto h0 = std::chrono::steady_clock::now();
      for (int rep = 0; rep < 20; ++rep) call();
      const auto h1 = std::chrono::steady_clock::now();
      MARROW_CUDA_CHECK(cudaEventRecord(b)); MARROW_CUDA_CHECK(cudaEventSynchronize(b));
      float ms; MARROW_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
      const double host_us = std::chrono::duration<double, std::micro>(h1 - h0).count() / 20;
      printf("  %s single %.3f ms %.0f TF, back-to-back %.3f ms %.0f TF, host %.0f us/call;", which ? "cublas" : "wgmma", single,
             flops / single * 1e-9, ms / 20, flops / (ms / 20) * 1e-9, host_us);
    }
    printf("\n");
    fflush(stdout);
  }
  for (void* p : std::initializer_list<void*>{in, w, out, ptrs, doff}) MARROW_CUDA_CHECK(cudaFree(p));
}

// ---- dW: dweight[e] (+)= dy_e^T x_e ----
// want[e, o, c] = base[e, o, c] + sum_r dy[r, o] x[r, c] (base: the old dW, or 0 when overwriting;
// kept for an expert without rows when accumulating), one thread per element.
__global__ void dw_reference(float* want, const float* base, const bf16* dy, const bf16* x, const int32_t* offsets, int64_t n, int o, int i) {
  const int64_t idx = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (idx >= n) return;
  const int e = int(idx / (int64_t(o) * i)), row = int(idx / i % o), c = int(idx % i);
  float sum = base ? base[idx] : 0.0f;
  for (int r = offsets[e]; r < offsets[e + 1]; ++r) sum += __bfloat162float(dy[int64_t(r) * o + row]) * __bfloat162float(x[int64_t(r) * i + c]);
  want[idx] = sum;
}
__global__ void dw_error(const float* got, const float* want, int64_t n, float* result) {  // max |diff|, max |want|, non-finite count
  float diff = 0, mag = 0, bad = 0;
  for (int64_t k = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; k < n; k += int64_t(gridDim.x) * blockDim.x) {
    if (!isfinite(got[k])) bad += 1;
    else diff = fmaxf(diff, fabsf(got[k] - want[k]));
    mag = fmaxf(mag, fabsf(want[k]));
  }
  atomicMax(reinterpret_cast<int*>(result), __float_as_int(diff));
  atomicMax(reinterpret_cast<int*>(result + 1), __float_as_int(mag));
  atomicAdd(result + 2, bad);
}
__global__ void bf16_to_f32(float* out, const bf16* in, int64_t n) {
  for (int64_t k = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; k < n; k += int64_t(gridDim.x) * blockDim.x) out[k] = __bfloat162float(in[k]);
}

// Checks accumulate (onto random old values) and overwrite (onto NaN, twice: same bits), then times
// both; TFLOP/s count 2 x rows x O x I, GB/s the dW bytes (read + write, or write).
void dw_run(const char* label, const std::vector<int32_t>& counts, int64_t o, int64_t i, bool time) {
  const int64_t e = int64_t(counts.size()), n = e * o * i;
  std::vector<int32_t> offsets(e + 1, 0);
  for (int64_t g = 0; g < e; ++g) offsets[g + 1] = offsets[g] + counts[g];
  const int64_t rows = offsets[e];
  bf16 *dy, *x, *old16;
  float *old, *dw, *dw2, *want, *err;
  int32_t *doff, *work_acc, *work_over;
  MARROW_CUDA_CHECK(cudaMalloc(&dy, rows * o * 2));
  MARROW_CUDA_CHECK(cudaMalloc(&x, rows * i * 2));
  MARROW_CUDA_CHECK(cudaMalloc(&old16, n * 2));
  MARROW_CUDA_CHECK(cudaMalloc(&old, n * 4));
  MARROW_CUDA_CHECK(cudaMalloc(&dw, n * 4));
  MARROW_CUDA_CHECK(cudaMalloc(&dw2, n * 4));
  MARROW_CUDA_CHECK(cudaMalloc(&want, n * 4));
  MARROW_CUDA_CHECK(cudaMalloc(&err, 16));
  MARROW_CUDA_CHECK(cudaMalloc(&doff, (e + 1) * 4));
  MARROW_CUDA_CHECK(cudaMalloc(&work_acc, (marrow::wgmma::dw::kWorkInts * e + 2) * 4));
  MARROW_CUDA_CHECK(cudaMalloc(&work_over, (marrow::wgmma::dw::kWorkInts * e + 2) * 4));
  fill_random<<<1024, 256>>>(dy, rows * o, 3); MARROW_CUDA_CHECK_LAUNCH();
  fill_random<<<1024, 256>>>(x, rows * i, 4); MARROW_CUDA_CHECK_LAUNCH();
  fill_random<<<1024, 256>>>(old16, n, 5); MARROW_CUDA_CHECK_LAUNCH();
  bf16_to_f32<<<1024, 256>>>(old, old16, n); MARROW_CUDA_CHECK_LAUNCH();
  MARROW_CUDA_CHECK(cudaMemcpy(doff, offsets.data(), (e + 1) * 4, cudaMemcpyHostToDevice));
  const std::vector<int32_t> acc_list = marrow::wgmma::dw::work_list(offsets.data(), nullptr, e, false),
                             over_list = marrow::wgmma::dw::work_list(offsets.data(), nullptr, e, true);
  MARROW_CUDA_CHECK(cudaMemcpy(work_acc, acc_list.data(), acc_list.size() * 4, cudaMemcpyHostToDevice));
  MARROW_CUDA_CHECK(cudaMemcpy(work_over, over_list.data(), over_list.size() * 4, cudaMemcpyHostToDevice));
  auto call = [&](float* out, bool accumulate) {  // the counter back to zero, then the kernel
    const int works = accumulate ? acc_list[0] : over_list[0];
    int32_t* work = accumulate ? work_acc : work_over;
    MARROW_CUDA_CHECK(cudaMemsetAsync(work + 1, 0, 4));
    const marrow::wgmma::dw::Source sources[2] = {{dy, x, rows}, {nullptr, nullptr, 0}};
    marrow::wgmma::dw::grouped_dw(out, sources, work, works, o, i, accumulate, nullptr, 0);
  };
  auto error = [&](const float* got, const char* what) {
    float h[3] = {0, 0, 0};
    MARROW_CUDA_CHECK(cudaMemset(err, 0, 16));
    dw_error<<<1024, 256>>>(got, want, n, err); MARROW_CUDA_CHECK_LAUNCH();
    MARROW_CUDA_CHECK(cudaMemcpy(h, err, 12, cudaMemcpyDeviceToHost));
    const double rel = h[1] > 0 ? h[0] / h[1] : h[0];
    printf("  %s err %.2e nan %.0f %s;", what, rel, h[2], rel < 1e-3 && h[2] == 0 ? "PASS" : "FAIL");
    return rel < 1e-3 && h[2] == 0;
  };
  printf("%-18s dW E%-3ld R%-6ld O%-5ld I%-5ld:", label, long(e), long(rows), long(o), long(i));
  MARROW_CUDA_CHECK(cudaMemcpy(dw, old, n * 4, cudaMemcpyDeviceToDevice));
  call(dw, true);
  dw_reference<<<unsigned((n + 255) / 256), 256>>>(want, old, dy, x, doff, n, int(o), int(i)); MARROW_CUDA_CHECK_LAUNCH();
  MARROW_CUDA_CHECK(cudaDeviceSynchronize());
  bool ok = error(dw, "accumulate");
  fill_nan<<<1024, 256>>>(reinterpret_cast<bf16*>(dw), 2 * n); MARROW_CUDA_CHECK_LAUNCH();
  fill_nan<<<1024, 256>>>(reinterpret_cast<bf16*>(dw2), 2 * n); MARROW_CUDA_CHECK_LAUNCH();
  call(dw, false);
  call(dw2, false);
  dw_reference<<<unsigned((n + 255) / 256), 256>>>(want, nullptr, dy, x, doff, n, int(o), int(i)); MARROW_CUDA_CHECK_LAUNCH();
  MARROW_CUDA_CHECK(cudaDeviceSynchronize());
  ok = error(dw, "overwrite") && ok;
  std::vector<float> a(n), b(n);
  MARROW_CUDA_CHECK(cudaMemcpy(a.data(), dw, n * 4, cudaMemcpyDeviceToHost));
  MARROW_CUDA_CHECK(cudaMemcpy(b.data(), dw2, n * 4, cudaMemcpyDeviceToHost));
  const bool same = std::memcmp(a.data(), b.data(), n * 4) == 0;
  printf("  bitwise-repeat %s  %s\n", same ? "yes" : "NO", ok && same ? "PASS" : "FAIL");
  if (time) {
    const double flops = 2.0 * rows * o * i;
    for (bool accumulate : {true, false}) {
      const float ms = median_ms([&] { call(dw, accumulate); });
      printf("    %-10s %.3f ms %6.1f TFLOP/s  dW %.2f TB/s\n", accumulate ? "accumulate" : "overwrite", ms, flops / ms * 1e-9,
             (accumulate ? 8.0 : 4.0) * n / ms * 1e-9);
    }
  }
  fflush(stdout);
  for (void* p : std::initializer_list<void*>{dy, x, old16, old, dw, dw2, want, err}) MARROW_CUDA_CHECK(cudaFree(p));
  for (void* p : std::initializer_list<void*>{doff, work_acc, work_over}) MARROW_CUDA_CHECK(cudaFree(p));
}

int main() {
  MARROW_CUBLAS_CHECK(cublasCreate(&handle));
  cudaDeviceProp prop;
  MARROW_CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  printf("%s, %d SMs\n", prop.name, prop.multiProcessorCount);
  const int64_t E = 128, R = 32768;
  // dW: experts of 0, 1, 44, 64, 65, 127, 264, 300 rows (K = the expert's rows), partial dW tiles.
  dw_run("small odd", {0, 1, 44, 64, 65, 0, 300}, 520, 264, false);
  dw_run("small odd", {44, 0, 1, 64, 65, 264, 127, 0}, 264, 520, false);
  dw_run("small aligned", {128, 256, 0, 64}, 256, 512, false);
  for (bool even : {false, true}) {
    const std::vector<int32_t> counts = even ? std::vector<int32_t>(E, R / E) : skewed_counts(E, R);
    dw_run(even ? "gate/up even" : "gate/up skewed", counts, 1536, 2048, true);
    dw_run(even ? "down even" : "down skewed", counts, 2048, 768, true);
  }
  if (getenv("PROBE_DW")) return 0;
  // Small odd shapes: experts with 0 and 1 rows, partial tiles, K not a multiple of 64, N not of 256.
  for (bool fwd : {true, false}) {
    run("small odd", fwd, {0, 1, 37, 130}, 136, 200, false);
    run("small odd", fwd, {0, 1, 37, 130}, 264, 128, false);
    run("small 2 tiles", fwd, {300, 0, 64, 65}, 512, 320, false);
  }
  run("many experts", true, std::vector<int32_t>(70, 3), 264, 256, false);
  run("many experts", false, {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 5, 129, 0, 1}, 264, 256, false);
  timing_study("gate/up skewed", true, skewed_counts(E, R), 1536, 2048);
  timing_study("down skewed", true, skewed_counts(E, R), 2048, 768);
  timing_study("gate/up skewed", false, skewed_counts(E, R), 1536, 2048);
  timing_study("down skewed", false, skewed_counts(E, R), 2048, 768);
  if (getenv("PROBE_SHORT")) return 0;
  for (bool even : {false, true}) {
    const std::vector<int32_t> counts = even ? std::vector<int32_t>(E, R / E) : skewed_counts(E, R);
    const char* routing = even ? "even" : "skewed";
    run((std::string("gate/up ") + routing).c_str(), true, counts, 1536, 2048, true);
    run((std::string("down ") + routing).c_str(), true, counts, 2048, 768, true);
    run((std::string("gate/up ") + routing).c_str(), false, counts, 1536, 2048, true);
    run((std::string("down ") + routing).c_str(), false, counts, 2048, 768, true);
  }
  return 0;
}
