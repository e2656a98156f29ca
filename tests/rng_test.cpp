#include "core/rng.h"

#include <gtest/gtest.h>

#include <cmath>

namespace marrow {
namespace {

TEST(Philox, DrawsArePureFunctionsOfSeedNameAndIndex) {
  const Philox a = philox_for(7, "model.layers.0.mlp.gate.weight"), b = philox_for(7, "model.layers.0.mlp.gate.weight");
  for (uint64_t i : {0ull, 1ull, 12345ull, 1ull << 40}) EXPECT_EQ(a.normal(i), b.normal(i));
  EXPECT_NE(a.normal(3), philox_for(8, "model.layers.0.mlp.gate.weight").normal(3));
  EXPECT_NE(a.normal(3), philox_for(7, "model.layers.1.mlp.gate.weight").normal(3));
  EXPECT_NE(a.normal(3), a.normal(4));
}

TEST(Philox, NormalHasUnitMomentsAndUniformStaysInRange) {
  const Philox rng = philox_for(1, "moments");
  const int n = 200000;
  double sum = 0, sum_sq = 0;
  for (int i = 0; i < n; ++i) {
    const double v = rng.normal(uint64_t(i));
    ASSERT_TRUE(std::isfinite(v));
    sum += v;
    sum_sq += v * v;
    const float u = rng.uniform(uint64_t(i));
    ASSERT_TRUE(u >= 0.0f && u < 1.0f);
  }
  // Standard errors are 1/sqrt(n) ~ 0.0022 for the mean and ~0.0032 for the variance.
  EXPECT_NEAR(sum / n, 0.0, 0.012);
  EXPECT_NEAR(sum_sq / n, 1.0, 0.016);
}

TEST(Philox, MatchesTheRandom123KnownAnswer) {
  // Known-answer test of Philox4x32-10 (Salmon et al., Random123 kat_vectors): counter and key all
  // 0xffffffff.
  Philox rng{0xffffffffu, 0xffffffffu};
  uint32_t c[4] = {0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu};
  rng(c);
  EXPECT_EQ(c[0], 0x408f276du);
  EXPECT_EQ(c[1], 0x41c83b0eu);
  EXPECT_EQ(c[2], 0xa20bc7c6u);
  EXPECT_EQ(c[3], 0x6d5451fdu);
}

}  // namespace
}  // namespace marrow
