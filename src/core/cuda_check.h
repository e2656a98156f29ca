// Checked CUDA runtime calls: on failure, file:line, the call and CUDA's message.
// In builds without CUDA (MARROW_CUDA=0) this header provides nothing.
#pragma once
#include "core/errors.h"

#if MARROW_CUDA
#include <cuda_runtime.h>

#define MARROW_CUDA_CHECK(call)                                                        \
  do {                                                                                 \
    cudaError_t marrow_err_ = (call);                                                  \
    if (marrow_err_ != cudaSuccess)                                                    \
      ::marrow::fail_call(__FILE__, __LINE__, #call, cudaGetErrorString(marrow_err_)); \
  } while (0)

// After a kernel launch: catches bad launch configurations at the launch site.
#define MARROW_CUDA_CHECK_LAUNCH() MARROW_CUDA_CHECK(cudaGetLastError())
#endif
