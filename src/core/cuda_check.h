// Checked CUDA runtime calls: on failure, file:line, the call and CUDA's message.
// In builds without CUDA (MARROW_CUDA=0) this header provides nothing.
#pragma once
#include "core/errors.h"

#if MARROW_CUDA
#include <cuda_runtime.h>

namespace marrow {
inline bool cuda_failed(cudaError_t e) { return e != cudaSuccess; }
}  // namespace marrow
#define MARROW_CUDA_CHECK(call) MARROW_CHECK_RESULT(call, #call, ::marrow::cuda_failed, cudaGetErrorString)

// After a kernel launch: catches bad launch configurations at the launch site.
#define MARROW_CUDA_CHECK_LAUNCH() MARROW_CUDA_CHECK(cudaGetLastError())
#endif
