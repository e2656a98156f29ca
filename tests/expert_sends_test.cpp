// The sender's half of the expert-parallel plan (ops/expert_sends.h), by hand.
#include "ops/expert_sends.h"

#include <gtest/gtest.h>

#include <vector>

#include "core/errors.h"
#include "core/memory.h"
#include "ops/dispatch.h"

namespace marrow {
namespace {

Buffer ints(std::initializer_list<int64_t> dims, const std::vector<int32_t>& values) {
  Buffer b(DType::i32, Device::cpu, dims);
  EXPECT_EQ(b.numel(), int64_t(values.size()));
  std::copy(values.begin(), values.end(), b.ptr<int32_t>());
  return b;
}

std::vector<int32_t> contents(const Buffer& b) { return std::vector<int32_t>(b.ptr<int32_t>(), b.ptr<int32_t>() + b.numel()); }

// 3 members of 2 experts each (owner 0 0 1 1 2 2), 4 tokens of top-2: token 0 on members 0 and 2,
// token 1 twice on member 1, token 2 on member 0 only, token 3 on members 2 and 0.
TEST(ExpertSends, MembersRowsAndSlotsByHand) {
  const Buffer owner = ints({6}, {0, 0, 1, 1, 2, 2});
  const Buffer topk = ints({4, 2}, {1, 4, 3, 2, 0, 1, 5, 0});
  Buffer members(DType::i32, Device::cpu, {4, 3}), copies(DType::i32, Device::cpu, {3});
  expert_send_members(members, copies, topk, owner);
  EXPECT_EQ(contents(members), (std::vector<int32_t>{0, -1, 2, -1, 1, -1, 0, -1, -1, 0, -1, 2}));
  EXPECT_EQ(contents(copies), (std::vector<int32_t>{4, 2, 2}));

  // Rows to member 0: tokens 0, 2, 3 (rows 0-2); to member 1: token 1 (row 3); to member 2: tokens 0, 3 (rows 4, 5).
  Buffer offsets(DType::i32, Device::cpu, {4}), send_row(DType::i32, Device::cpu, {4, 3});
  dispatch_plan(offsets, send_row, members);
  EXPECT_EQ(contents(offsets), (std::vector<int32_t>{0, 3, 4, 6}));
  EXPECT_EQ(contents(send_row), (std::vector<int32_t>{0, -1, 4, -1, 3, -1, 1, -1, -1, 2, -1, 5}));

  Buffer slots(DType::i32, Device::cpu, {7, 2});  // one row more than sent: stays -1
  expert_send_slots(slots, topk, owner, send_row, 2);
  EXPECT_EQ(contents(slots), (std::vector<int32_t>{1, -1,   // token 0 to member 0: expert 1 in slot 0
                                                   0, 1,    // token 2: experts 0 and 1
                                                   -1, 0,   // token 3: expert 0 in slot 1
                                                   1, 0,    // token 1 to member 1: experts 3 and 2
                                                   -1, 0,   // token 0 to member 2: expert 4 in slot 1
                                                   1, -1,   // token 3: expert 5 in slot 0
                                                   -1, -1}));
}

TEST(ExpertSends, RefusesExpertsOutsideTheTable) {
  const Buffer owner = ints({4}, {0, 0, 1, 1});
  Buffer members(DType::i32, Device::cpu, {1, 2}), copies(DType::i32, Device::cpu, {2});
  EXPECT_THROW(expert_send_members(members, copies, ints({1, 2}, {0, 4}), owner), Error);
  EXPECT_THROW(expert_send_members(members, copies, ints({1, 2}, {0, 1}), ints({4}, {0, 0, 2, 2})), Error);  // member 2 of 2
  Buffer wrong(DType::i32, Device::cpu, {1, 3});
  EXPECT_THROW(expert_send_members(wrong, copies, ints({1, 2}, {0, 1}), owner), Error);
}

}  // namespace
}  // namespace marrow
