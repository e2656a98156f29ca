#include "ops/linear.h"

#include <cstring>

#include "gradcheck.h"

namespace marrow {
namespace {

using testing::element;
using testing::random_buffer;

TEST(Linear, ForwardMatchesHandComputed) {
  // Hugging Face layout: row o of the weight holds the inputs' coefficients of output o.
  float x[4] = {1, 2, 3, 4}, w[6] = {1, 0, 0, 1, 1, 1}, y[6];
  linear_forward(Tensor(y, DType::f32, Device::cpu, {2, 3}), Tensor(x, DType::f32, Device::cpu, {2, 2}),
                 Tensor(w, DType::f32, Device::cpu, {3, 2}));
  const float want[6] = {1, 2, 3, 3, 4, 7};
  for (int i = 0; i < 6; ++i) EXPECT_EQ(y[i], want[i]) << i;
}

TEST(Linear, GradientsMatchFiniteDifferences) {
  struct Case {
    int64_t n, in, out;
  };
  for (Case c : {Case{1, 1, 1}, Case{3, 5, 7}, Case{4, 19, 3}, Case{2, 40, 9}}) {
    Buffer x = random_buffer(DType::f64, {c.n, c.in}, 1), w = random_buffer(DType::f64, {c.out, c.in}, 2),
           r = random_buffer(DType::f64, {c.n, c.out}, 3);
    Buffer y(DType::f64, Device::cpu, {c.n, c.out}), dx(DType::f64, Device::cpu, {c.n, c.in}),
        dw = Buffer::zeros(DType::f64, Device::cpu, {c.out, c.in});
    auto loss = [&] {
      linear_forward(y, x, w);
      return testing::weighted_sum(y, r);
    };
    linear_backward_input(dx, r, w);
    linear_backward_weight(dw, r, x);
    testing::expect_gradient("dx", x, dx, loss);
    testing::expect_gradient("dweight", w, dw, loss);
  }
}

// overwrite = true ignores what dweight held: the bits of accumulating into zeros.
TEST(Linear, BackwardWeightOverwriteIsAccumulatingIntoZeros) {
  Buffer x = random_buffer(DType::f64, {3, 4}, 1), dy = random_buffer(DType::f64, {3, 5}, 3);
  Buffer fresh = Buffer::zeros(DType::f64, Device::cpu, {5, 4}), dw = random_buffer(DType::f64, {5, 4}, 4);
  linear_backward_weight(fresh, dy, x);
  linear_backward_weight(dw, dy, x, true);
  EXPECT_EQ(std::memcmp(dw.view().data, fresh.view().data, dw.view().bytes()), 0);
}

TEST(Linear, BackwardWeightAccumulatesAndBackwardInputOverwrites) {
  Buffer x = random_buffer(DType::f64, {3, 4}, 1), w = random_buffer(DType::f64, {5, 4}, 2),
         dy = random_buffer(DType::f64, {3, 5}, 3);
  Buffer fresh = Buffer::zeros(DType::f64, Device::cpu, {5, 4}), dw = random_buffer(DType::f64, {5, 4}, 4),
         before = random_buffer(DType::f64, {5, 4}, 4);
  linear_backward_weight(fresh, dy, x);
  linear_backward_weight(dw, dy, x);
  for (int64_t i = 0; i < dw.numel(); ++i)
    EXPECT_NEAR(element(dw, i), element(before, i) + element(fresh, i), 1e-12) << i;
  Buffer dx1(DType::f64, Device::cpu, {3, 4}), dx2 = random_buffer(DType::f64, {3, 4}, 5);
  linear_backward_input(dx1, dy, w);
  linear_backward_input(dx2, dy, w);
  for (int64_t i = 0; i < dx1.numel(); ++i) EXPECT_EQ(element(dx1, i), element(dx2, i)) << i;
  // accumulate = true adds the product to what dx holds.
  Buffer dx3 = random_buffer(DType::f64, {3, 4}, 6), start = random_buffer(DType::f64, {3, 4}, 6);
  linear_backward_input(dx3, dy, w, true);
  for (int64_t i = 0; i < dx3.numel(); ++i) EXPECT_NEAR(element(dx3, i), element(start, i) + element(dx1, i), 1e-12) << i;
}

// Sizes that span several cache blocks (in f64 a block of rows of 2000 elements is 8 rows) and an
// inner length that is not a multiple of the eight partial sums, against plain loops.
TEST(Linear, ManyBlocksMatchPlainLoops) {
  const int64_t n = 19, in = 2001, out = 21;
  Buffer x = random_buffer(DType::f64, {n, in}, 1), w = random_buffer(DType::f64, {out, in}, 2),
         dy = random_buffer(DType::f64, {n, out}, 3);
  Buffer y(DType::f64, Device::cpu, {n, out}), dx(DType::f64, Device::cpu, {n, in}),
      dw = Buffer::zeros(DType::f64, Device::cpu, {out, in});
  linear_forward(y, x, w);
  linear_backward_input(dx, dy, w);
  linear_backward_weight(dw, dy, x);
  const double *px = x.ptr<double>(), *pw = w.ptr<double>(), *pdy = dy.ptr<double>();
  for (int64_t r = 0; r < n; ++r)
    for (int64_t o = 0; o < out; ++o) {
      double s = 0;
      for (int64_t i = 0; i < in; ++i) s += px[r * in + i] * pw[o * in + i];
      EXPECT_NEAR(y.ptr<double>()[r * out + o], s, 1e-9) << r << " " << o;
    }
  for (int64_t r = 0; r < n; ++r)
    for (int64_t i = 0; i < in; i += 97) {
      double s = 0;
      for (int64_t o = 0; o < out; ++o) s += pdy[r * out + o] * pw[o * in + i];
      EXPECT_NEAR(dx.ptr<double>()[r * in + i], s, 1e-9) << r << " " << i;
    }
  for (int64_t o = 0; o < out; ++o)
    for (int64_t i = 0; i < in; i += 97) {
      double s = 0;
      for (int64_t r = 0; r < n; ++r) s += pdy[r * out + o] * px[r * in + i];
      EXPECT_NEAR(dw.ptr<double>()[o * in + i], s, 1e-9) << o << " " << i;
    }
}

TEST(Linear, F32MatchesF64) {
  const int64_t n = 33, in = 300, out = 70;
  auto run = [&](DType t, Buffer& y, Buffer& dx, Buffer& dw) {
    Buffer x = random_buffer(t, {n, in}, 1), w = random_buffer(t, {out, in}, 2), dy = random_buffer(t, {n, out}, 3);
    y = Buffer(t, Device::cpu, {n, out});
    dx = Buffer(t, Device::cpu, {n, in});
    dw = Buffer::zeros(t, Device::cpu, {out, in});
    linear_forward(y, x, w);
    linear_backward_input(dx, dy, w);
    linear_backward_weight(dw, dy, x);
  };
  Buffer y32, dx32, dw32, y64, dx64, dw64;
  run(DType::f32, y32, dx32, dw32);
  run(DType::f64, y64, dx64, dw64);
  // Sums of a few hundred unit-variance products: a magnitude ~20, float rounding ~1e-5 of that.
  for (auto [a, b] : {std::pair{&y32, &y64}, std::pair{&dx32, &dx64}, std::pair{&dw32, &dw64}})
    for (int64_t i = 0; i < a->numel(); ++i) ASSERT_NEAR(element(*a, i), element(*b, i), 1e-4) << i;
}

TEST(Linear, RejectsMismatchedShapes) {
  Buffer x(DType::f32, Device::cpu, {3, 5}), w(DType::f32, Device::cpu, {7, 4}), y(DType::f32, Device::cpu, {3, 7});
  try {
    linear_forward(y, x, w);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "linear_forward: weight has shape [7, 4] but expected [7, 5]");
  }
  Buffer dy(DType::f32, Device::cpu, {3, 6}), dx(DType::f32, Device::cpu, {3, 4});
  try {
    linear_backward_input(dx, dy, w);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "linear_backward_input: dy has shape [3, 6] but expected [3, 7]");
  }
  Buffer dw(DType::f32, Device::cpu, {6, 4});
  try {
    linear_backward_weight(dw, dy, x);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "linear_backward_weight: dweight has shape [6, 4] but expected [6, 5]");
  }
}

}  // namespace
}  // namespace marrow
