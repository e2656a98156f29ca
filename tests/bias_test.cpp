#include "ops/bias.h"

#include <omp.h>

#include <algorithm>
#include <string>
#include <vector>

#include "data_test_util.h"
#include "gradcheck.h"

namespace marrow {
namespace {

using data_testing::error_of;
using testing::element;
using testing::random_buffer;

Buffer offsets_buffer(const std::vector<int32_t>& values) {
  Buffer b(DType::i32, Device::cpu, {int64_t(values.size())});
  std::copy(values.begin(), values.end(), b.ptr<int32_t>());
  return b;
}

// dbias[c] (+)= dy's column c of rows [r0, r1), summed in double in row order: what the op promises.
void column_sums(const Tensor& dbias, int64_t at, const Tensor& dy, int64_t r0, int64_t r1, bool overwrite) {
  const int64_t o = dy.size(1);
  for (int64_t c = 0; c < o; ++c) {
    double sum = 0;
    for (int64_t r = r0; r < r1; ++r) sum += element(dy, r * o + c);
    testing::set_element(dbias, at + c, overwrite ? sum : element(dbias, at + c) + sum);
  }
}

TEST(Bias, ForwardAddsTheBiasToEveryRow) {
  const int64_t n = 5, o = 3;
  Buffer y = random_buffer(DType::f32, {n, o}, 1), before = random_buffer(DType::f32, {n, o}, 1), bias = random_buffer(DType::f32, {o}, 2);
  bias_forward(y, bias);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t c = 0; c < o; ++c)
      EXPECT_EQ(y.ptr<float>()[r * o + c], before.ptr<float>()[r * o + c] + bias.ptr<float>()[c]) << r << " " << c;
}

// Overwriting writes the column sums; accumulating adds them to what dbias held. Both are the
// direct loop's bits, in f32 and f64.
TEST(Bias, BackwardSumsTheColumnsInRowOrder) {
  for (DType dtype : {DType::f32, DType::f64})
    for (bool overwrite : {true, false}) {
      SCOPED_TRACE(::testing::Message() << dtype_name(dtype) << (overwrite ? " overwrite" : " accumulate"));
      const int64_t n = 7, o = 300;  // two column blocks
      Buffer dy = random_buffer(dtype, {n, o}, 3), dbias = random_buffer(dtype, {o}, 4), want = random_buffer(dtype, {o}, 4);
      bias_backward(dbias, dy, overwrite);
      column_sums(want, 0, dy, 0, n, overwrite);
      for (int64_t c = 0; c < o; ++c) ASSERT_EQ(element(dbias, c), element(want, c)) << c;
    }
}

TEST(Bias, BackwardOfNoRows) {
  double dy[1], dbias[2] = {3, 4};
  bias_backward(Tensor(dbias, DType::f64, Device::cpu, {2}), Tensor(dy, DType::f64, Device::cpu, {0, 2}));
  EXPECT_EQ(dbias[0], 3);
  EXPECT_EQ(dbias[1], 4);
  bias_backward(Tensor(dbias, DType::f64, Device::cpu, {2}), Tensor(dy, DType::f64, Device::cpu, {0, 2}), true);
  EXPECT_EQ(dbias[0], 0);
  EXPECT_EQ(dbias[1], 0);
}

// Four experts: 3 rows, none, 1 row, 2 rows.
TEST(GroupedBias, ForwardAddsEachExpertsBiasToItsRows) {
  const int64_t e = 4, o = 3;
  const std::vector<int32_t> bounds = {0, 3, 3, 4, 6};
  Buffer offsets = offsets_buffer(bounds);
  Buffer y = random_buffer(DType::f64, {6, o}, 1), before = random_buffer(DType::f64, {6, o}, 1), bias = random_buffer(DType::f64, {e, o}, 2);
  grouped_bias_forward(y, bias, offsets);
  for (int64_t g = 0; g < e; ++g)
    for (int64_t r = bounds[g]; r < bounds[g + 1]; ++r)
      for (int64_t c = 0; c < o; ++c)
        EXPECT_EQ(y.ptr<double>()[r * o + c], before.ptr<double>()[r * o + c] + bias.ptr<double>()[g * o + c]) << r << " " << c;
}

// An expert without rows gets zeros when overwriting and keeps its values when accumulating; one
// with a single row gets that row.
TEST(GroupedBias, BackwardSumsEachExpertsRows) {
  const int64_t e = 4, o = 5;
  const std::vector<int32_t> bounds = {0, 3, 3, 4, 6};
  Buffer offsets = offsets_buffer(bounds);
  for (bool overwrite : {true, false}) {
    SCOPED_TRACE(overwrite ? "overwrite" : "accumulate");
    Buffer dy = random_buffer(DType::f32, {6, o}, 3), prior = random_buffer(DType::f32, {e, o}, 4);
    Buffer dbias = random_buffer(DType::f32, {e, o}, 4), want = random_buffer(DType::f32, {e, o}, 4);
    grouped_bias_backward(dbias, dy, offsets, overwrite);
    for (int64_t g = 0; g < e; ++g) column_sums(want, g * o, dy, bounds[g], bounds[g + 1], overwrite);
    for (int64_t i = 0; i < e * o; ++i) ASSERT_EQ(element(dbias, i), element(want, i)) << i;
    for (int64_t c = 0; c < o; ++c) {
      EXPECT_EQ(element(dbias, o + c), overwrite ? 0.0 : element(prior, o + c)) << "empty expert";
      EXPECT_EQ(element(dbias, 2 * o + c), float(element(dy, 3 * o + c) + (overwrite ? 0.0 : element(prior, 2 * o + c)))) << "one-row expert";
    }
  }
}

// The backward splits columns over threads, never rows, so any thread count gives the same bits.
TEST(GroupedBias, ThreadCountDoesNotChangeTheBits) {
  const int64_t o = 700, r = 400;
  Buffer offsets = offsets_buffer({0, 150, 150, 400});
  Buffer dy = random_buffer(DType::f32, {r, o}, 5);
  std::vector<std::vector<float>> results;
  const int saved = omp_get_max_threads();
  for (int threads : {1, 3}) {
    omp_set_num_threads(threads);
    Buffer dbias = random_buffer(DType::f32, {3, o}, 6), plain = random_buffer(DType::f32, {o}, 6);
    grouped_bias_backward(dbias, dy, offsets);
    bias_backward(plain, dy);
    results.emplace_back(dbias.ptr<float>(), dbias.ptr<float>() + 3 * o);
    results.back().insert(results.back().end(), plain.ptr<float>(), plain.ptr<float>() + o);
  }
  omp_set_num_threads(saved);
  EXPECT_EQ(results[0], results[1]);
}

// Rows scaled by row_scale before the sums (GPT-OSS's routing weights): the same as scaling them first.
TEST(GroupedBias, BackwardWithRowScaleSumsTheScaledRows) {
  const int64_t o = 4;
  Buffer offsets = offsets_buffer({0, 2, 2, 5});
  Buffer dy = random_buffer(DType::f64, {5, o}, 3), scale = random_buffer(DType::f64, {5}, 4), scaled(DType::f64, Device::cpu, {5, o});
  for (int64_t i = 0; i < 5 * o; ++i) scaled.ptr<double>()[i] = scale.ptr<double>()[i / o] * dy.ptr<double>()[i];
  Buffer got = random_buffer(DType::f64, {3, o}, 5), want(DType::f64, Device::cpu, {3, o});
  std::copy(got.ptr<double>(), got.ptr<double>() + 3 * o, want.ptr<double>());
  grouped_bias_backward(got, dy, offsets, false, scale);
  grouped_bias_backward(want, scaled, offsets, false);
  for (int64_t i = 0; i < 3 * o; ++i) EXPECT_DOUBLE_EQ(got.ptr<double>()[i], want.ptr<double>()[i]) << i;
}

// dtopk_weight[t, j] += dot(dy[r], bias[expert of r]); an entry of -1 is left alone.
TEST(GroupedBias, DotAddGivesEachCopyItsExpertsBias) {
  const int64_t o = 3;
  Buffer offsets = offsets_buffer({0, 1, 3});
  Buffer dy = random_buffer(DType::f64, {3, o}, 6), bias = random_buffer(DType::f64, {2, o}, 7);
  int32_t rows[4] = {2, 0, -1, 1};
  Tensor copy_row(rows, DType::i32, Device::cpu, {2, 2});
  Buffer dtopk = random_buffer(DType::f64, {2, 2}, 8), before(DType::f64, Device::cpu, {2, 2});
  std::copy(dtopk.ptr<double>(), dtopk.ptr<double>() + 4, before.ptr<double>());
  grouped_bias_dot_add(dtopk, dy, bias, offsets, copy_row);
  const int64_t expert_of_row[3] = {0, 1, 1};
  for (int64_t c = 0; c < 4; ++c) {
    double want = before.ptr<double>()[c];
    if (rows[c] >= 0)
      for (int64_t i = 0; i < o; ++i) want += dy.ptr<double>()[rows[c] * o + i] * bias.ptr<double>()[expert_of_row[rows[c]] * o + i];
    EXPECT_DOUBLE_EQ(dtopk.ptr<double>()[c], want) << c;
  }
}

TEST(Bias, RejectsWrongShapesNamingTheTensor) {
  Buffer y(DType::f32, Device::cpu, {4, 3}), bias(DType::f32, Device::cpu, {4}), grouped(DType::f32, Device::cpu, {2, 3}),
      offsets = offsets_buffer({0, 1, 4}), short_offsets = offsets_buffer({0, 1, 3});
  EXPECT_EQ(error_of([&] { bias_forward(y, bias); }), "bias_forward: bias has shape [4] but expected [3]");
  EXPECT_EQ(error_of([&] { bias_backward(bias, y); }), "bias_backward: dbias has shape [4] but expected [3]");
  EXPECT_EQ(error_of([&] { bias_backward(y, bias); }), "bias_backward: dy must be [rows, out], got [4]");
  EXPECT_EQ(error_of([&] { grouped_bias_forward(y, bias, offsets); }), "grouped_bias_forward: bias must be [experts, out], got [4]");
  EXPECT_EQ(error_of([&] { grouped_bias_backward(Buffer(DType::f32, Device::cpu, {2, 4}), y, offsets); }),
            "grouped_bias_backward: dbias has shape [2, 4] but expected [2, 3]");
  EXPECT_EQ(error_of([&] { grouped_bias_forward(y, grouped, short_offsets); }),
            "grouped_bias_forward: expert_offsets must run from 0 to the 4 rows, got 0 to 3");
  EXPECT_EQ(error_of([&] { grouped_bias_forward(y, Buffer(DType::f64, Device::cpu, {2, 3}), offsets); }),
            "grouped_bias_forward: bias has dtype f64 but y has f32");
  // The GPU's dtypes are checked before anything reads the data, so host memory stands in for the GPU's.
  EXPECT_EQ(error_of([&] {
              bias_forward(Tensor(y.ptr<float>(), DType::f32, Device::cuda, {4, 3}), Tensor(bias.ptr<float>(), DType::f32, Device::cuda, {3}));
            }),
            "bias_forward: bias has dtype f32 but expected bf16");
  EXPECT_EQ(error_of([&] {
              bias_backward(Tensor(bias.ptr<float>(), DType::bf16, Device::cuda, {3}), Tensor(y.ptr<float>(), DType::bf16, Device::cuda, {4, 3}));
            }),
            "bias_backward: dbias has dtype bf16 but expected f32");
}

}  // namespace
}  // namespace marrow
