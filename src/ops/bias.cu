#include "ops/bias.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "ops/common.h"
#include "ops/dispatch.h"
#include "ops/grouped_linear.h"

namespace marrow {

namespace {

// Columns one thread of the backward sums at a time: its double sums stay in L1 while it walks the rows.
constexpr int64_t kColumnBlock = 256;

// Rows [r0, r1) of y [., O] += bias [O]; rows are independent, so threads split them.
template <typename T> void add_rows_cpu(T* y, const T* bias, int64_t r0, int64_t r1, int64_t o) {
#pragma omp parallel for schedule(static) if ((r1 - r0) * o > kParallelWork)
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t c = 0; c < o; ++c) y[r * o + c] += bias[c];
}

// dbias [O] (+)= the sum of rows [r0, r1) of dy [., O], in double, each column in row order. Threads
// split the columns, never the rows, so the bits do not depend on the thread count.
template <typename T>
void sum_rows_cpu(T* dbias, const T* dy, int64_t r0, int64_t r1, int64_t o, bool overwrite, const T* row_scale = nullptr) {
#pragma omp parallel if ((r1 - r0) * o > kParallelWork)
  {
    std::vector<double> sum(kColumnBlock);
#pragma omp for schedule(static)
    for (int64_t c0 = 0; c0 < o; c0 += kColumnBlock) {
      const int64_t width = std::min(kColumnBlock, o - c0);
      std::fill(sum.begin(), sum.end(), 0.0);
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = 0; c < width; ++c) sum[c] += row_scale ? double(row_scale[r]) * dy[r * o + c0 + c] : double(dy[r * o + c0 + c]);
      for (int64_t c = 0; c < width; ++c) dbias[c0 + c] = overwrite ? T(sum[c]) : T(dbias[c0 + c] + sum[c]);
    }
  }
}

// The checks every bias op makes after the shapes: one dtype, and the CPU.
void expect_cpu(const char* op, std::initializer_list<std::pair<const char*, const Tensor*>> tensors) {
  expect_same_dtype(op, tensors);
  MARROW_CHECK(common_device(op, tensors) == Device::cpu, "{}: biases run on the CPU only so far, but {} is on the GPU", op,
               tensors.begin()->first);
}

void expect_rows(const char* op, const char* name, const Tensor& t) {
  MARROW_CHECK(t.ndim == 2, "{}: {} must be [rows, out], got {}", op, name, t.shape_string());
}

// bias_forward's and bias_backward's checks of the rows [N, O] and the bias [O].
void check_plain(const char* op, const char* rows_name, const Tensor& rows, const char* bias_name, const Tensor& bias) {
  expect_rows(op, rows_name, rows);
  expect_shape(op, bias_name, bias, {rows.size(1)});
  expect_cpu(op, {{rows_name, &rows}, {bias_name, &bias}});
}

// The grouped ops' checks of the rows [R, O], the bias [E, O] and expert_offsets [E + 1] (on the
// host, splitting the R rows), then f(T{}, g, r0, r1) for every expert g and its rows [r0, r1) in
// turn, T the tensors' CPU scalar type.
template <typename F>
void for_each_expert(const char* op, const char* rows_name, const Tensor& rows, const char* bias_name, const Tensor& bias,
                     const Tensor& expert_offsets, F&& f) {
  expect_rows(op, rows_name, rows);
  MARROW_CHECK(bias.ndim == 2, "{}: {} must be [experts, out], got {}", op, bias_name, bias.shape_string());
  const int64_t e = bias.size(0);
  expect_shape(op, bias_name, bias, {e, rows.size(1)});
  expect_cpu(op, {{rows_name, &rows}, {bias_name, &bias}});
  expect_device(op, "expert_offsets", expert_offsets, Device::cpu);
  check_expert_offsets(op, expert_offsets, e, rows.size(0));
  const int32_t* offsets = expert_offsets.ptr<int32_t>();
  with_cpu_scalar(op, rows, [&](auto s) {
    for (int64_t g = 0; g < e; ++g) f(s, g, int64_t(offsets[g]), int64_t(offsets[g + 1]));
  });
}

}  // namespace

void bias_forward(Tensor y, Tensor bias, Stream stream) {
  const char* op = "bias_forward";
  check_plain(op, "y", y, "bias", bias);
  (void)stream;
  with_cpu_scalar(op, y, [&](auto s) {
    using T = decltype(s);
    add_rows_cpu<T>(y.ptr<T>(), bias.ptr<T>(), 0, y.size(0), y.size(1));
  });
}

void bias_backward(Tensor dbias, Tensor dy, bool overwrite, Stream stream) {
  const char* op = "bias_backward";
  check_plain(op, "dy", dy, "dbias", dbias);
  (void)stream;
  with_cpu_scalar(op, dy, [&](auto s) {
    using T = decltype(s);
    sum_rows_cpu<T>(dbias.ptr<T>(), dy.ptr<T>(), 0, dy.size(0), dy.size(1), overwrite);
  });
}

void grouped_bias_forward(Tensor y, Tensor bias, Tensor expert_offsets, Stream stream) {
  (void)stream;
  for_each_expert("grouped_bias_forward", "y", y, "bias", bias, expert_offsets, [&](auto s, int64_t g, int64_t r0, int64_t r1) {
    using T = decltype(s);
    add_rows_cpu<T>(y.ptr<T>(), bias.ptr<T>() + g * y.size(1), r0, r1, y.size(1));
  });
}

void grouped_bias_backward(Tensor dbias, Tensor dy, Tensor expert_offsets, bool overwrite, Tensor row_scale, Stream stream) {
  const char* op = "grouped_bias_backward";
  (void)stream;
  if (row_scale.data) {
    expect_shape(op, "row_scale", row_scale, {dy.size(0)});
    expect_cpu(op, {{"dy", &dy}, {"row_scale", &row_scale}});
  }
  for_each_expert(op, "dy", dy, "dbias", dbias, expert_offsets, [&](auto s, int64_t g, int64_t r0, int64_t r1) {
    using T = decltype(s);
    const T* scale = row_scale.data ? row_scale.ptr<T>() : nullptr;
    if (overwrite || r1 > r0) sum_rows_cpu<T>(dbias.ptr<T>() + g * dy.size(1), dy.ptr<T>(), r0, r1, dy.size(1), overwrite, scale);
  });
}

void grouped_bias_dot_add(Tensor dtopk_weight, Tensor dy, Tensor bias, Tensor expert_offsets, Tensor copy_row, Stream stream) {
  const char* op = "grouped_bias_dot_add";
  (void)stream;
  MARROW_CHECK(copy_row.ndim == 2, "{}: copy_row must be [tokens, k], got {}", op, copy_row.shape_string());
  expect_dtype(op, "copy_row", copy_row, DType::i32);
  expect_shape(op, "dtopk_weight", dtopk_weight, {copy_row.size(0), copy_row.size(1)});
  expect_cpu(op, {{"dy", &dy}, {"dtopk_weight", &dtopk_weight}});
  expect_copy_rows(op, copy_row, dy.size(0));
  std::vector<int64_t> expert_of(size_t(dy.size(0)));
  for_each_expert(op, "dy", dy, "bias", bias, expert_offsets, [&](auto, int64_t g, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) expert_of[size_t(r)] = g;
  });
  with_cpu_scalar(op, dy, [&](auto s) {
    using T = decltype(s);
    const int64_t o = dy.size(1);
    const int32_t* rows = copy_row.ptr<int32_t>();
    T* d = dtopk_weight.ptr<T>();
    for (int64_t c = 0; c < copy_row.numel(); ++c) {
      if (rows[c] < 0) continue;
      const T *y = dy.ptr<T>() + rows[c] * o, *b = bias.ptr<T>() + expert_of[size_t(rows[c])] * o;
      double dot = 0;
      for (int64_t i = 0; i < o; ++i) dot += double(y[i]) * b[i];
      d[c] = T(d[c] + dot);
    }
  });
}

}  // namespace marrow
