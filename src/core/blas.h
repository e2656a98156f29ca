// cuBLAS and cuBLASLt: the checked-call macro and the per-process handles and workspaces.
//
// The handles are created on first use, one per device, and live until the process ends
// (destroying them at exit can race the CUDA runtime's teardown); not for several host threads at
// once. Each stream has its own workspace of kBlasWorkspaceBytes shared by its cuBLASLt and cuBLAS
// calls: two streams never share scratch memory, which keeps results deterministic. Without CUDA
// this header provides only the workspace size (the memory estimate counts it).
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

#define MARROW_CUBLAS_CHECK(call) MARROW_CHECK_RESULT(call, #call, ::marrow::cublas_failed, ::marrow::cublas_status_message)

namespace marrow {

inline bool cublas_failed(cublasStatus_t s) { return s != CUBLAS_STATUS_SUCCESS; }

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
