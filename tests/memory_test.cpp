// PinnedHost (core/memory.h): the staging memory of the expert-parallel plan; HostSum (core/host_sum.h) over it. On a machine without a
// GPU it is plain host memory; what these tests hold on any machine is its reuse and growth.
#include <gtest/gtest.h>

#include "core/host_sum.h"
#include "core/memory.h"

namespace marrow {
namespace {

TEST(PinnedHost, ReusesItsMemoryAndGrowsByAtLeastHalf) {
  PinnedHost staging;
  const Tensor first = staging.tensor(DType::i32, {4, 8}, Device::cpu);
  ASSERT_NE(first.data, nullptr);
  EXPECT_EQ(first.device, Device::cpu);
  EXPECT_EQ(first.dtype, DType::i32);
  EXPECT_EQ(first.numel(), 32);
  for (int64_t i = 0; i < first.numel(); ++i) first.ptr<int32_t>()[i] = int32_t(i);
  // A smaller or equal request is the same memory, contents as they were.
  const Tensor smaller = staging.tensor(DType::i32, {2, 8}, Device::cpu);
  EXPECT_EQ(smaller.data, first.data);
  EXPECT_EQ(smaller.ptr<int32_t>()[15], 15);
  // A larger one grows to at least 1.5x the old size, so sizes creeping up do not regrow each time.
  const Tensor larger = staging.tensor(DType::i32, {33}, Device::cpu);
  EXPECT_EQ(larger.numel(), 33);
  const Tensor within = staging.tensor(DType::i32, {48}, Device::cpu);
  EXPECT_EQ(within.data, larger.data);
  larger.ptr<int32_t>()[32] = 7;
  EXPECT_EQ(within.ptr<int32_t>()[32], 7);
  // Nothing asked: no memory, and a tensor of no elements.
  PinnedHost empty;
  EXPECT_EQ(empty.tensor(DType::f32, {0, 3}, Device::cpu).numel(), 0);
}

TEST(StreamMark, OnTheCpuThereIsNothingToWaitFor) {
  const StreamMark mark = StreamMark::record(Device::cpu);
  mark.wait();
  StreamMark{}.wait();
}

// The sum is taken as reading each part when added would take it: each part's elements from zero
// in index order, then the parts from zero in order; a nested sum is one part. (Added flat, 1 + 1 +
// 1e16 would be 1e16 + 2; as parts, 1 + (1 + 1e16) rounds to 1e16.)
TEST(HostSum, AddsEachPartInOrderThenThePartsAsReadingThemAtOnceWould) {
  std::vector<float> a = {1.0f};
  std::vector<double> b = {1.0, 1e16};
  HostSum inner;
  inner.add(Tensor(b.data(), DType::f64, Device::cpu, {2}));
  HostSum sum;
  sum.add(Tensor(a.data(), DType::f32, Device::cpu, {1}));
  a[0] = 7;  // a CPU part is copied at once
  sum.add(std::move(inner));
  sum.add(HostSum{});
  EXPECT_EQ(sum.value(), 1e16);
  EXPECT_EQ(sum.value(), (0.0 + 1.0) + ((0.0 + 1.0) + 1e16) + 0.0);
  EXPECT_EQ(HostSum{}.value(), 0.0);
}

TEST(HostSum, IntegerPartsAreOneSentence) {
  std::vector<int32_t> ids = {1, 2};
  HostSum sum;
  EXPECT_THROW(sum.add(Tensor(ids.data(), DType::i32, Device::cpu, {2})), Error);
}

}  // namespace
}  // namespace marrow
