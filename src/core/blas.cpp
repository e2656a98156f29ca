#include "core/blas.h"

#if MARROW_CUDA
#include <map>
#include <mutex>
#include <utility>

#include "core/cuda_check.h"

namespace marrow {

namespace {

std::mutex& blas_mutex() {
  static std::mutex m;
  return m;
}

int current_device() {
  int device = 0;
  MARROW_CUDA_CHECK(cudaGetDevice(&device));
  return device;
}

// Called with blas_mutex held.
void* workspace_locked(int device, cudaStream_t stream) {
  static std::map<std::pair<int, cudaStream_t>, void*> workspaces;
  void*& w = workspaces[{device, stream}];
  if (w == nullptr) MARROW_CUDA_CHECK(cudaMalloc(&w, kBlasWorkspaceBytes));
  return w;
}

}  // namespace

std::string cublas_status_message(cublasStatus_t status) {
  return fmt::format("{} ({})", cublasGetStatusName(status), cublasGetStatusString(status));
}

cublasLtHandle_t cublaslt_handle() {
  static std::map<int, cublasLtHandle_t> handles;
  std::lock_guard<std::mutex> lock(blas_mutex());
  cublasLtHandle_t& h = handles[current_device()];
  if (h == nullptr) MARROW_CUBLAS_CHECK(cublasLtCreate(&h));
  return h;
}

cublasHandle_t cublas_handle(cudaStream_t stream) {
  static std::map<int, cublasHandle_t> handles;
  std::lock_guard<std::mutex> lock(blas_mutex());
  const int device = current_device();
  cublasHandle_t& h = handles[device];
  if (h == nullptr) MARROW_CUBLAS_CHECK(cublasCreate(&h));
  // cublasSetStream resets the workspace to cuBLAS's default pool, so the stream's own is set after it.
  MARROW_CUBLAS_CHECK(cublasSetStream(h, stream));
  MARROW_CUBLAS_CHECK(cublasSetWorkspace(h, workspace_locked(device, stream), kBlasWorkspaceBytes));
  return h;
}

void* blas_workspace(cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(blas_mutex());
  return workspace_locked(current_device(), stream);
}

}  // namespace marrow
#endif
