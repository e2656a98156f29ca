// Stand-in for Marrow's core/cuda_check.h (which needs the library's fail_call) in the standalone probe.
#pragma once
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdlib>
#define MARROW_CUDA_CHECK(call)                                                                       \
  do {                                                                                               \
    cudaError_t e_ = (call);                                                                         \
    if (e_ != cudaSuccess) { fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); exit(1); } \
  } while (0)
#define MARROW_CUDA_CHECK_LAUNCH() MARROW_CUDA_CHECK(cudaGetLastError())
#define MARROW_CHECK(cond, ...)                                              \
  do {                                                                       \
    if (!(cond)) { fprintf(stderr, "%s:%d check failed: %s\n", __FILE__, __LINE__, #cond); exit(1); } \
  } while (0)
#include <string>
namespace marrow {
[[noreturn]] inline void fail_call(const char* file, int line, const char* call, const std::string& why) {
  fprintf(stderr, "%s:%d %s: %s\n", file, line, call, why.c_str());
  exit(1);
}
}  // namespace marrow
