#include "ops/add.h"

#include "ops/common.h"

namespace marrow {

namespace {

template <typename T>
void add_cpu(T* out, const T* a, const T* b, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

}  // namespace

void add(Tensor out, Tensor a, Tensor b, Stream stream) {
  const char* op = "add";
  for (auto [name, t] : {std::pair{"a", &a}, std::pair{"b", &b}})
    MARROW_CHECK(t->numel() == out.numel(), "{}: {} has shape {} ({} elements) but out has shape {} ({} elements)", op,
                 name, t->shape_string(), t->numel(), out.shape_string(), out.numel());
  expect_same_dtype(op, {{"out", &out}, {"a", &a}, {"b", &b}});
  if (common_device(op, {{"out", &out}, {"a", &a}, {"b", &b}}) == Device::cuda) no_cuda_kernel(op);
  (void)stream;
  with_cpu_scalar(op, out, [&](auto s) {
    using T = decltype(s);
    add_cpu<T>(out.ptr<T>(), a.ptr<T>(), b.ptr<T>(), out.numel());
  });
}

}  // namespace marrow
