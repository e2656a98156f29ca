#include "engine/lr_schedule.h"

#include <gtest/gtest.h>

namespace marrow {
namespace {

TEST(LrSchedule, CosineWarmsUpLinearlyThenDecaysToMinLr) {
  const LrSchedule s{"cosine", 1e-3, 1e-4, 10, 110, 0.2};
  EXPECT_DOUBLE_EQ(s.at(1), 1e-4);
  EXPECT_DOUBLE_EQ(s.at(5), 5e-4);
  EXPECT_DOUBLE_EQ(s.at(10), 1e-3);
  EXPECT_NEAR(s.at(60), 0.5 * (1e-3 + 1e-4), 1e-12);  // half way through the decay
  EXPECT_NEAR(s.at(110), 1e-4, 1e-15);
  for (int64_t step = 11; step <= 110; ++step) EXPECT_LE(s.at(step), s.at(step - 1)) << step;
}

TEST(LrSchedule, WarmupStableDecayHoldsThenDecaysOverTheLastFraction) {
  const LrSchedule s{"wsd", 1e-3, 0.0, 10, 100, 0.2};
  EXPECT_DOUBLE_EQ(s.at(10), 1e-3);
  EXPECT_DOUBLE_EQ(s.at(50), 1e-3);
  EXPECT_DOUBLE_EQ(s.at(80), 1e-3);  // the decay covers steps 81..100
  EXPECT_NEAR(s.at(90), 0.5e-3, 1e-15);
  EXPECT_NEAR(s.at(100), 0.0, 1e-15);
}

TEST(LrSchedule, NoWarmupStartsAtFullRate) {
  const LrSchedule s{"cosine", 2e-3, 0.0, 0, 50, 0.2};
  EXPECT_NEAR(s.at(1), 2e-3, 1e-5);
}

}  // namespace
}  // namespace marrow
