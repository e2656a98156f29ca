#include "ops/grad_norm.h"

#include <cmath>

#include "ops/common.h"

namespace marrow {

double l2_norm(Tensor x, Stream stream) {
  const char* op = "l2_norm";
  if (x.device == Device::cuda) no_cuda_kernel(op);
  (void)stream;
  double sum = 0;
  with_cpu_scalar(op, x, [&](auto s) {
    using T = decltype(s);
    const T* p = x.ptr<T>();
    for (int64_t i = 0; i < x.numel(); ++i) sum += double(p[i]) * p[i];
  });
  return std::sqrt(sum);
}

void scale(Tensor x, double factor, Stream stream) {
  const char* op = "scale";
  if (x.device == Device::cuda) no_cuda_kernel(op);
  (void)stream;
  with_cpu_scalar(op, x, [&](auto s) {
    using T = decltype(s);
    T* p = x.ptr<T>();
    for (int64_t i = 0; i < x.numel(); ++i) p[i] = T(p[i] * factor);
  });
}

}  // namespace marrow
