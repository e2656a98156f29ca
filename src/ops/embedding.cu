#include "ops/embedding.h"

#include "ops/common.h"

namespace marrow {

namespace {

// Ids are checked before anything is written: a bad id would otherwise read or write outside the
// table, and a half-written output is harder to reason about than none.
void check_ids(const char* op, const int32_t* ids, int64_t n, int64_t vocab) {
  for (int64_t t = 0; t < n; ++t)
    MARROW_CHECK(0 <= ids[t] && ids[t] < vocab, "{}: id {} at position {} is outside the vocabulary [0, {})", op,
                 ids[t], t, vocab);
}

template <typename T>
void forward_cpu(T* out, const int32_t* ids, const T* table, int64_t n, int64_t h) {
  for (int64_t t = 0; t < n; ++t) {
    const T* row = table + int64_t(ids[t]) * h;
    for (int64_t j = 0; j < h; ++j) out[t * h + j] = row[j];
  }
}

template <typename T>
void backward_cpu(T* dtable, const T* dout, const int32_t* ids, int64_t n, int64_t h) {
  for (int64_t t = 0; t < n; ++t) {
    T* row = dtable + int64_t(ids[t]) * h;
    for (int64_t j = 0; j < h; ++j) row[j] += dout[t * h + j];
  }
}

}  // namespace

void embedding_forward(Tensor out, Tensor ids, Tensor table, Stream stream) {
  const char* op = "embedding_forward";
  MARROW_CHECK(ids.ndim == 1, "{}: ids must be [tokens], got {}", op, ids.shape_string());
  MARROW_CHECK(table.ndim == 2, "{}: table must be [vocab, hidden], got {}", op, table.shape_string());
  const int64_t n = ids.size(0), vocab = table.size(0), h = table.size(1);
  expect_shape(op, "out", out, {n, h});
  expect_dtype(op, "ids", ids, DType::i32);
  expect_same_dtype(op, {{"table", &table}, {"out", &out}});
  if (common_device(op, {{"table", &table}, {"out", &out}, {"ids", &ids}}) == Device::cuda) no_cuda_kernel(op);
  (void)stream;
  check_ids(op, ids.ptr<int32_t>(), n, vocab);
  with_cpu_scalar(op, table, [&](auto s) {
    using T = decltype(s);
    forward_cpu<T>(out.ptr<T>(), ids.ptr<int32_t>(), table.ptr<T>(), n, h);
  });
}

void embedding_backward(Tensor dtable, Tensor dout, Tensor ids, Stream stream) {
  const char* op = "embedding_backward";
  MARROW_CHECK(ids.ndim == 1, "{}: ids must be [tokens], got {}", op, ids.shape_string());
  MARROW_CHECK(dtable.ndim == 2, "{}: dtable must be [vocab, hidden], got {}", op, dtable.shape_string());
  const int64_t n = ids.size(0), vocab = dtable.size(0), h = dtable.size(1);
  expect_shape(op, "dout", dout, {n, h});
  expect_dtype(op, "ids", ids, DType::i32);
  expect_same_dtype(op, {{"dtable", &dtable}, {"dout", &dout}});
  if (common_device(op, {{"dtable", &dtable}, {"dout", &dout}, {"ids", &ids}}) == Device::cuda) no_cuda_kernel(op);
  (void)stream;
  check_ids(op, ids.ptr<int32_t>(), n, vocab);
  with_cpu_scalar(op, dtable, [&](auto s) {
    using T = decltype(s);
    backward_cpu<T>(dtable.ptr<T>(), dout.ptr<T>(), ids.ptr<int32_t>(), n, h);
  });
}

}  // namespace marrow
