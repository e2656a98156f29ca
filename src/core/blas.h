// cuBLAS and cuBLASLt: the checked-call macro and the per-process handles and workspaces.
//
// MARROW_CUBLAS_CHECK(call) throws marrow::Error with file:line, the call and cuBLAS's status name
// and message. The handles are created on first use, one per device, and live until the process
// ends (destroying them at exit can race the CUDA runtime's own teardown). Each stream gets its own
// workspace of kBlasWorkspaceBytes, allocated once and shared by cuBLASLt and cuBLAS calls on that
// stream: calls on one stream run in order, and two streams never share scratch memory, which keeps
// results deterministic. The handles are not meant to be used from several host threads at once.
// In builds without CUDA (MARROW_CUDA=0) this header provides only the workspace size (the memory
// estimate counts it).
#pragma once
#include <cstddef>

#include "core/errors.h"

namespace marrow {
inline constexpr size_t kBlasWorkspaceBytes = size_t(32) << 20;
}  // namespace marrow

#if MARROW_CUDA
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <string>

#define MARROW_CUBLAS_CHECK(call)                                                                        \
  do {                                                                                                   \
    cublasStatus_t marrow_status_ = (call);                                                              \
    if (marrow_status_ != CUBLAS_STATUS_SUCCESS)                                                         \
      ::marrow::fail_call(__FILE__, __LINE__, #call, ::marrow::cublas_status_message(marrow_status_)); \
  } while (0)

namespace marrow {

// "CUBLAS_STATUS_NOT_SUPPORTED (the functionality requested is not supported)".
std::string cublas_status_message(cublasStatus_t status);

// The cuBLASLt handle of the current device.
cublasLtHandle_t cublaslt_handle();

// The cuBLAS handle of the current device, bound to stream and to that stream's workspace.
cublasHandle_t cublas_handle(cudaStream_t stream);

// The workspace of stream on the current device: kBlasWorkspaceBytes, 256-byte aligned.
void* blas_workspace(cudaStream_t stream);

}  // namespace marrow
#endif
