// train.fp8 on a family's tiny model (qwen3_moe_test, gpt_oss_test): the experts' GEMMs from E4M3
// operands stay within a few percent of full precision, give the same bits twice, and follow the
// weights when they change (the FP8 copies are made again). Run: the family's TinyRun (model,
// params, grads, loss_and_gradients()); changed(run) is the bf16 expert weight the test scales, as an
// optimizer step would change it.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>

#include "core/weights_generation.h"
#include "ops/grouped_linear_fp8.h"

namespace marrow::testing {

template <class Run> void expect_fp8_experts_close(Run& plain, Run& fp8, Run& again, const std::function<Tensor(Run&)>& changed) {
  const double plain_loss = plain.loss_and_gradients();
  set_expert_fp8(true);
  const double fp8_loss = fp8.loss_and_gradients(), again_loss = again.loss_and_gradients();
  EXPECT_EQ(fp8_loss, again_loss);
  EXPECT_EQ(std::memcmp(fp8.grads.all().data, again.grads.all().data, fp8.grads.bytes()), 0);
  EXPECT_NE(fp8_loss, plain_loss);
  EXPECT_NEAR(fp8_loss, plain_loss, 0.03 * plain_loss);
  double error = 0, norm = 0;
  for (int64_t i = 0; i < plain.model.num_parameters(); ++i) {
    error += std::pow(double(fp8.grads.all().template ptr<float>()[i]) - plain.grads.all().template ptr<float>()[i], 2);
    norm += std::pow(double(plain.grads.all().template ptr<float>()[i]), 2);
  }
  EXPECT_LT(std::sqrt(error / norm), 0.15);
  for (Run* run : {&fp8, &plain}) {
    const Tensor w = changed(*run);
    for (int64_t i = 0; i < w.numel(); ++i) w.template ptr<float>()[i] *= -0.5f;
  }
  ++weights_generation();
  const double changed_loss = fp8.loss_and_gradients();
  set_expert_fp8(false);
  const double changed_plain = plain.loss_and_gradients();
  EXPECT_NE(changed_loss, fp8_loss);
  EXPECT_NEAR(changed_loss, changed_plain, 0.03 * changed_plain);
}

}  // namespace marrow::testing
