#include "ops/grouped_linear.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "gradcheck.h"

namespace marrow {
namespace {

using testing::random_buffer;

Buffer offsets_buffer(const std::vector<int32_t>& values) {
  Buffer b(DType::i32, Device::cpu, {int64_t(values.size())});
  std::copy(values.begin(), values.end(), b.ptr<int32_t>());
  return b;
}

TEST(GroupedLinear, ForwardMatchesHandComputedCase) {
  // Three experts of weight [1, 2] (O = 1, I = 2); expert 1 has no rows.
  double x[6] = {1, 1, 2, 3, 4, 5}, w[6] = {1, 2, 9, 9, 0, 1}, y[3];
  Buffer offsets = offsets_buffer({0, 1, 1, 3});
  grouped_linear_forward(Tensor(y, DType::f64, Device::cpu, {3, 1}), Tensor(x, DType::f64, Device::cpu, {3, 2}),
                         Tensor(w, DType::f64, Device::cpu, {3, 1, 2}), offsets);
  EXPECT_DOUBLE_EQ(y[0], 3);
  EXPECT_DOUBLE_EQ(y[1], 3);
  EXPECT_DOUBLE_EQ(y[2], 5);
}

// Weight gradients accumulate: dweight starts from `prior`, and what the backward added is compared
// with finite differences; an expert without rows keeps its prior exactly.
TEST(GroupedLinear, GradientsMatchFiniteDifferences) {
  const int64_t e = 4, o = 3, in = 5;
  for (const std::vector<int32_t>& bounds :
       {std::vector<int32_t>{0, 2, 2, 5, 6}, std::vector<int32_t>{0, 0, 1, 1, 1}, std::vector<int32_t>{0, 0, 0, 0, 0}}) {
    const int64_t r = bounds.back();
    SCOPED_TRACE(::testing::Message() << "rows " << r);
    Buffer offsets = offsets_buffer(bounds);
    Buffer x = random_buffer(DType::f64, {r, in}, 1), w = random_buffer(DType::f64, {e, o, in}, 2),
           dy = random_buffer(DType::f64, {r, o}, 3), prior = random_buffer(DType::f64, {e, o, in}, 4);
    Buffer y(DType::f64, Device::cpu, {r, o}), dx(DType::f64, Device::cpu, {r, in}),
        dw = random_buffer(DType::f64, {e, o, in}, 4);
    auto loss = [&] {
      grouped_linear_forward(y, x, w, offsets);
      return testing::weighted_sum(y, dy);
    };
    loss();
    grouped_linear_backward_input(dx, dy, w, offsets);
    grouped_linear_backward_weight(dw, dy, x, offsets);
    Buffer added(DType::f64, Device::cpu, {e, o, in});
    for (int64_t i = 0; i < dw.numel(); ++i) added.ptr<double>()[i] = dw.ptr<double>()[i] - prior.ptr<double>()[i];
    testing::expect_gradient("dx", x, dx, loss);
    testing::expect_gradient("dweight", w, added, loss, 1e-6, 1000);
    for (int64_t g = 0; g < e; ++g)
      if (bounds[g] == bounds[g + 1])
        for (int64_t i = g * o * in; i < (g + 1) * o * in; ++i) EXPECT_EQ(dw.ptr<double>()[i], prior.ptr<double>()[i]);
  }
}

// overwrite = true gives what accumulating onto zeros gives, whatever dweight held, and zeros for
// an expert without rows.
TEST(GroupedLinear, OverwriteEqualsAccumulatingOntoZeros) {
  const int64_t e = 4, o = 3, in = 5;
  Buffer offsets = offsets_buffer({0, 2, 2, 5, 6});
  Buffer x = random_buffer(DType::f64, {6, in}, 1), dy = random_buffer(DType::f64, {6, o}, 3);
  Buffer accumulated = Buffer::zeros(DType::f64, Device::cpu, {e, o, in}), written = random_buffer(DType::f64, {e, o, in}, 4);
  grouped_linear_backward_weight(accumulated, dy, x, offsets);
  grouped_linear_backward_weight(written, dy, x, offsets, true);
  for (int64_t i = 0; i < written.numel(); ++i) EXPECT_EQ(written.ptr<double>()[i], accumulated.ptr<double>()[i]) << i;
  for (int64_t i = o * in; i < 2 * o * in; ++i) EXPECT_EQ(written.ptr<double>()[i], 0.0);
}

TEST(GroupedLinear, RejectsOffsetsOnTheGpuForDataOnTheCpu) {
  Buffer x(DType::f32, Device::cpu, {2, 3}), w(DType::f32, Device::cpu, {2, 4, 3}), y(DType::f32, Device::cpu, {2, 4});
  int32_t bounds[3] = {0, 1, 2};
  try {
    grouped_linear_forward(y, x, w, Tensor(bounds, DType::i32, Device::cuda, {3}));
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "grouped_linear_forward: expert_offsets is on cuda but expected cpu");
  }
}

TEST(GroupedLinear, RejectsDecreasingOffsets) {
  Buffer dy(DType::f32, Device::cpu, {3, 4}), w(DType::f32, Device::cpu, {3, 4, 2}), dx(DType::f32, Device::cpu, {3, 2});
  Buffer offsets = offsets_buffer({0, 2, 1, 3});
  try {
    grouped_linear_backward_input(dx, dy, w, offsets);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(),
                 "grouped_linear_backward_input: expert_offsets must not decrease, got expert_offsets[1] = 2 > "
                 "expert_offsets[2] = 1");
  }
}

TEST(GroupedLinear, RejectsOffsetsThatDoNotCoverTheRows) {
  Buffer dy(DType::f32, Device::cpu, {3, 4}), x(DType::f32, Device::cpu, {3, 2}), dw(DType::f32, Device::cpu, {2, 4, 2});
  Buffer offsets = offsets_buffer({0, 1, 2});
  try {
    grouped_linear_backward_weight(dw, dy, x, offsets);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "grouped_linear_backward_weight: expert_offsets must run from 0 to the 3 rows, got 0 to 2");
  }
}

TEST(GroupedLinear, RejectsMismatchedInputWidth) {
  Buffer x(DType::f32, Device::cpu, {2, 4}), w(DType::f32, Device::cpu, {2, 4, 3}), y(DType::f32, Device::cpu, {2, 4});
  Buffer offsets = offsets_buffer({0, 1, 2});
  try {
    grouped_linear_forward(y, x, w, offsets);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "grouped_linear_forward: x has shape [2, 4] but expected [2, 3]");
  }
}

// squares: every band of 16 rows x 256 columns of each expert's resulting dweight (also an expert
// without rows, whose gradient stays), summed; shapes that cut the last bands at O and I.
TEST(GroupedLinear, SquaresSumEachBandOfTheResultingGradient) {
  const int64_t e = 3, o = 20, in = 300, bands_o = 2, bands_i = 2;
  Buffer offsets = offsets_buffer({0, 2, 2, 5});
  Buffer x = random_buffer(DType::f64, {5, in}, 1), dy = random_buffer(DType::f64, {5, o}, 3), dw = random_buffer(DType::f64, {e, o, in}, 4);
  ASSERT_EQ(grouped_weight_squares_count(e, o, in), e * bands_o * bands_i);
  Buffer squares(DType::f64, Device::cpu, {e * bands_o * bands_i});
  grouped_linear_backward_weight(dw, dy, x, offsets, false, squares);
  for (int64_t g = 0; g < e; ++g)
    for (int64_t b = 0; b < bands_o; ++b)
      for (int64_t c = 0; c < bands_i; ++c) {
        double expected = 0;
        for (int64_t r = 16 * b; r < std::min<int64_t>(o, 16 * (b + 1)); ++r)
          for (int64_t k = 256 * c; k < std::min<int64_t>(in, 256 * (c + 1)); ++k) expected += std::pow(dw.ptr<double>()[(g * o + r) * in + k], 2);
        EXPECT_NEAR(squares.ptr<double>()[(g * bands_o + b) * bands_i + c], expected, 1e-12 * expected) << g << " " << b << " " << c;
      }
  Buffer wrong(DType::f64, Device::cpu, {5});
  try {
    grouped_linear_backward_weight(dw, dy, x, offsets, false, wrong);
    FAIL() << "expected an error";
  } catch (const Error& err) {
    EXPECT_STREQ(err.what(), "grouped_linear_backward_weight: squares has shape [5] but expected [12]");
  }
}

// Two micro-batches at once: the bits of the two calls it stands for (the first overwriting or
// not, the second accumulating; squares of the final gradient), experts without rows in either.
TEST(GroupedLinear, PairIsTheTwoCallsItStandsFor) {
  const int64_t e = 4, o = 20, in = 300;
  Buffer first_offsets = offsets_buffer({0, 2, 2, 5, 5}), second_offsets = offsets_buffer({0, 0, 3, 3, 4});
  Buffer x1 = random_buffer(DType::f32, {5, in}, 1), dy1 = random_buffer(DType::f32, {5, o}, 2);
  Buffer x2 = random_buffer(DType::f32, {4, in}, 3), dy2 = random_buffer(DType::f32, {4, o}, 4);
  for (const bool overwrite : {true, false}) {
    Buffer twice = random_buffer(DType::f32, {e, o, in}, 5), paired = random_buffer(DType::f32, {e, o, in}, 5);
    Buffer squares_twice(DType::f64, Device::cpu, {grouped_weight_squares_count(e, o, in)});
    Buffer squares_paired(DType::f64, Device::cpu, {grouped_weight_squares_count(e, o, in)});
    grouped_linear_backward_weight(twice, dy1, x1, first_offsets, overwrite, squares_twice);
    grouped_linear_backward_weight(twice, dy2, x2, second_offsets, false, squares_twice);
    grouped_linear_backward_weight_pair(paired, {dy1, x1, first_offsets}, {dy2, x2, second_offsets}, overwrite, squares_paired);
    EXPECT_EQ(std::memcmp(paired.view().data, twice.view().data, twice.view().bytes()), 0) << overwrite;
    EXPECT_EQ(std::memcmp(squares_paired.view().data, squares_twice.view().data, squares_twice.view().bytes()), 0) << overwrite;
  }
  Buffer dw(DType::f32, Device::cpu, {e, o, in});
  try {
    grouped_linear_backward_weight_pair(dw, {dy1, x1, first_offsets}, {dy2, x1, second_offsets});
    FAIL() << "expected an error";
  } catch (const Error& err) {
    EXPECT_STREQ(err.what(), "grouped_linear_backward_weight_pair (second micro-batch): x has shape [5, 300] but expected [4, 300]");
  }
}

// known_zero: an overwrite writes an empty expert's zeros only where its flag is not set, and the
// flags follow grouped_linear.h (set exactly for the experts without rows after an overwrite,
// cleared by rows); the results are those of the same calls without flags. Garbage planted in a
// flagged expert's slice stays: the op trusts the flag (the caller's promise).
TEST(GroupedLinear, KnownZeroFlagsSkipOnlyZerosThatAreThere) {
  const int64_t e = 4, o = 3, in = 5;
  Buffer offsets = offsets_buffer({0, 2, 2, 5, 5}), later = offsets_buffer({0, 0, 1, 1, 3});
  Buffer x = random_buffer(DType::f64, {5, in}, 1), dy = random_buffer(DType::f64, {5, o}, 2);
  Buffer x2 = random_buffer(DType::f64, {3, in}, 3), dy2 = random_buffer(DType::f64, {3, o}, 4);
  Buffer plain = random_buffer(DType::f64, {e, o, in}, 5), flagged = random_buffer(DType::f64, {e, o, in}, 6);
  Buffer known(DType::i32, Device::cpu, {e});
  std::fill_n(known.ptr<int32_t>(), e, 0);
  auto flags = [&] { return std::vector<int32_t>(known.ptr<int32_t>(), known.ptr<int32_t>() + e); };
  auto same = [&] { return std::memcmp(plain.view().data, flagged.view().data, plain.view().bytes()) == 0; };
  for (int step = 0; step < 2; ++step) {  // the second finds the empty experts' zeros known
    grouped_linear_backward_weight(plain, dy, x, offsets, true);
    grouped_linear_backward_weight(flagged, dy, x, offsets, true, {}, known);
    EXPECT_TRUE(same()) << step;
    EXPECT_EQ(flags(), (std::vector<int32_t>{0, 1, 0, 1})) << step;
  }
  grouped_linear_backward_weight(plain, dy2, x2, later, false);
  grouped_linear_backward_weight(flagged, dy2, x2, later, false, {}, known);
  EXPECT_TRUE(same());
  EXPECT_EQ(flags(), (std::vector<int32_t>{0, 0, 0, 0}));  // experts 1 and 3 got rows
  grouped_linear_backward_weight(flagged, dy, x, offsets, true, {}, known);
  EXPECT_EQ(flags(), (std::vector<int32_t>{0, 1, 0, 1}));
  flagged.ptr<double>()[3 * o * in] = 7;  // expert 3, flagged
  grouped_linear_backward_weight(flagged, dy, x, offsets, true, {}, known);
  EXPECT_EQ(flagged.ptr<double>()[3 * o * in], 7);
  EXPECT_EQ(flagged.ptr<double>()[1 * o * in], 0);

  // A pair from all-zero gradients, all flagged: experts 1 and 3 have rows in the second micro-batch
  // only; rows in either count, and the results are the flagless pair's.
  Buffer pair_flags(DType::i32, Device::cpu, {e});
  std::fill_n(pair_flags.ptr<int32_t>(), e, 1);
  fill_zero(plain);
  fill_zero(flagged);
  grouped_linear_backward_weight_pair(plain, {dy, x, offsets}, {dy2, x2, later}, true);
  grouped_linear_backward_weight_pair(flagged, {dy, x, offsets}, {dy2, x2, later}, true, {}, pair_flags);
  EXPECT_TRUE(same());
  EXPECT_EQ(std::vector<int32_t>(pair_flags.ptr<int32_t>(), pair_flags.ptr<int32_t>() + e), (std::vector<int32_t>{0, 0, 0, 0}));
  Buffer wrong(DType::i32, Device::cpu, {3});
  try {
    grouped_linear_backward_weight(flagged, dy, x, offsets, true, {}, wrong);
    FAIL() << "expected an error";
  } catch (const Error& err) {
    EXPECT_STREQ(err.what(), "grouped_linear_backward_weight: known_zero has shape [3] but expected [4]");
  }
}

}  // namespace
}  // namespace marrow
