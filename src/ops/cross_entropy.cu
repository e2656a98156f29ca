#include "ops/cross_entropy.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "ops/common.h"

namespace marrow {

namespace {

void check_targets(const char* op, const int32_t* targets, int64_t n, int64_t vocab) {
  for (int64_t t = 0; t < n; ++t)
    MARROW_CHECK(targets[t] == kIgnoreIndex || (0 <= targets[t] && targets[t] < vocab),
                 "{}: target {} at position {} is outside the vocabulary [0, {}) and is not the ignore index {}", op,
                 targets[t], t, vocab, kIgnoreIndex);
}

// The maximum is subtracted before exponentiating so large logits cannot overflow.
template <typename T>
void forward_cpu(T* token_loss, T* lse, const T* logits, const int32_t* targets, int64_t n, int64_t vocab) {
  for (int64_t t = 0; t < n; ++t) {
    const T* row = logits + t * vocab;
    T m = -std::numeric_limits<T>::infinity();
    for (int64_t j = 0; j < vocab; ++j) m = std::max(m, row[j]);
    double sum = 0;
    for (int64_t j = 0; j < vocab; ++j) sum += std::exp(row[j] - m);
    lse[t] = T(m + std::log(sum));
    token_loss[t] = targets[t] == kIgnoreIndex ? T(0) : lse[t] - row[targets[t]];
  }
}

// Each element is read before it is written at the same index, which is what lets dlogits alias
// logits.
template <typename T>
void backward_cpu(T* dlogits, const T* logits, const T* lse, const int32_t* targets, int64_t n, int64_t vocab,
                  T scale) {
  for (int64_t t = 0; t < n; ++t) {
    T* drow = dlogits + t * vocab;
    const T* row = logits + t * vocab;
    if (targets[t] == kIgnoreIndex) {
      std::fill(drow, drow + vocab, T(0));
      continue;
    }
    for (int64_t j = 0; j < vocab; ++j) drow[j] = scale * std::exp(row[j] - lse[t]);
    drow[targets[t]] -= scale;
  }
}

}  // namespace

void cross_entropy_forward(Tensor token_loss, Tensor lse, Tensor logits, Tensor targets, Stream stream) {
  const char* op = "cross_entropy_forward";
  MARROW_CHECK(logits.ndim == 2, "{}: logits must be [tokens, vocab], got {}", op, logits.shape_string());
  const int64_t n = logits.size(0), vocab = logits.size(1);
  expect_shape(op, "targets", targets, {n});
  expect_shape(op, "token_loss", token_loss, {n});
  expect_shape(op, "lse", lse, {n});
  expect_dtype(op, "targets", targets, DType::i32);
  expect_same_dtype(op, {{"logits", &logits}, {"token_loss", &token_loss}, {"lse", &lse}});
  if (common_device(op, {{"logits", &logits}, {"token_loss", &token_loss}, {"lse", &lse}, {"targets", &targets}}) ==
      Device::cuda)
    no_cuda_kernel(op);
  (void)stream;
  check_targets(op, targets.ptr<int32_t>(), n, vocab);
  with_cpu_scalar(op, logits, [&](auto s) {
    using T = decltype(s);
    forward_cpu<T>(token_loss.ptr<T>(), lse.ptr<T>(), logits.ptr<T>(), targets.ptr<int32_t>(), n, vocab);
  });
}

void cross_entropy_backward(Tensor dlogits, Tensor logits, Tensor lse, Tensor targets, double scale, Stream stream) {
  const char* op = "cross_entropy_backward";
  MARROW_CHECK(logits.ndim == 2, "{}: logits must be [tokens, vocab], got {}", op, logits.shape_string());
  const int64_t n = logits.size(0), vocab = logits.size(1);
  expect_shape(op, "dlogits", dlogits, {n, vocab});
  expect_shape(op, "targets", targets, {n});
  expect_shape(op, "lse", lse, {n});
  expect_dtype(op, "targets", targets, DType::i32);
  expect_same_dtype(op, {{"logits", &logits}, {"dlogits", &dlogits}, {"lse", &lse}});
  if (common_device(op, {{"logits", &logits}, {"dlogits", &dlogits}, {"lse", &lse}, {"targets", &targets}}) ==
      Device::cuda)
    no_cuda_kernel(op);
  (void)stream;
  check_targets(op, targets.ptr<int32_t>(), n, vocab);
  with_cpu_scalar(op, logits, [&](auto s) {
    using T = decltype(s);
    backward_cpu<T>(dlogits.ptr<T>(), logits.ptr<T>(), lse.ptr<T>(), targets.ptr<int32_t>(), n, vocab, T(scale));
  });
}

}  // namespace marrow
