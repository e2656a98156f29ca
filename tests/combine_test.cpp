#include "ops/combine.h"

#include <cmath>
#include <tuple>
#include <vector>

#include "gradcheck.h"
#include "ops/dispatch.h"
#include "ops/grouped_linear.h"
#include "ops/router.h"
#include "ops/swiglu.h"

namespace marrow {
namespace {

using testing::random_buffer;

Buffer i32_buffer(std::initializer_list<int64_t> dims, const std::vector<int32_t>& values) {
  Buffer b(DType::i32, Device::cpu, dims);
  std::copy(values.begin(), values.end(), b.ptr<int32_t>());
  return b;
}

TEST(Combine, ForwardMatchesHandComputedCase) {
  // Token 0's copies sit in rows 1 (slot 0) and 0 (slot 1).
  Buffer rows = i32_buffer({1, 2}, {1, 0});
  double residual[2] = {10, 20}, y_perm[4] = {1, 2, 3, 4}, w[2] = {0.25, 0.75}, out[2];
  combine_forward(Tensor(out, DType::f64, Device::cpu, {1, 2}), Tensor(residual, DType::f64, Device::cpu, {1, 2}),
                  Tensor(y_perm, DType::f64, Device::cpu, {2, 2}), Tensor(w, DType::f64, Device::cpu, {1, 2}), rows);
  EXPECT_DOUBLE_EQ(out[0], 10 + 0.25 * 3 + 0.75 * 1);
  EXPECT_DOUBLE_EQ(out[1], 20 + 0.25 * 4 + 0.75 * 2);
}

// Expert parallelism: copies held by other ranks are -1, and y_perm has R != T * K rows.
TEST(Combine, ForwardSkipsAbsentCopies) {
  // Token 0 here in slot 1 only (row 2), token 1 not here at all; rows 0 and 1 are nobody's.
  Buffer rows = i32_buffer({2, 2}, {-1, 2, -1, -1});
  double residual[4] = {10, 20, 30, 40}, y_perm[6] = {1, 2, 3, 4, 5, 6}, w[4] = {0.25, 0.75, 0.5, 0.5}, out[4];
  combine_forward(Tensor(out, DType::f64, Device::cpu, {2, 2}), Tensor(residual, DType::f64, Device::cpu, {2, 2}),
                  Tensor(y_perm, DType::f64, Device::cpu, {3, 2}), Tensor(w, DType::f64, Device::cpu, {2, 2}), rows);
  EXPECT_EQ(std::vector<double>(out, out + 4), (std::vector<double>{10 + 0.75 * 5, 20 + 0.75 * 6, 30, 40}));
}

TEST(Combine, ForwardWithoutResidualIsTheWeightedSum) {
  Buffer rows = i32_buffer({2, 2}, {-1, 2, -1, -1});
  double y_perm[6] = {1, 2, 3, 4, 5, 6}, w[4] = {0.25, 0.75, 0.5, 0.5}, out[4] = {-9, -9, -9, -9};
  combine_forward(Tensor(out, DType::f64, Device::cpu, {2, 2}), Tensor{}, Tensor(y_perm, DType::f64, Device::cpu, {3, 2}),
                  Tensor(w, DType::f64, Device::cpu, {2, 2}), rows);
  EXPECT_EQ(std::vector<double>(out, out + 4), (std::vector<double>{0.75 * 5, 0.75 * 6, 0, 0}));
}

TEST(Combine, BackwardOfAbsentCopies) {
  // Token 0: slot 0 in row 3, slot 1 not here; token 1: slot 0 not here, slot 1 in row 0. Rows 1, 2 are nobody's.
  Buffer rows = i32_buffer({2, 2}, {3, -1, -1, 0});
  double dout[4] = {1, 2, 3, 4}, y_perm[8] = {1, 1, 2, 2, 3, 3, 4, 5}, w[4] = {0.5, 0.25, 2, 4};
  double dy_perm[8] = {-9, -9, -9, -9, -9, -9, -9, -9}, dw[4] = {-9, -9, -9, -9};
  combine_backward(Tensor(dy_perm, DType::f64, Device::cpu, {4, 2}), Tensor(dw, DType::f64, Device::cpu, {2, 2}),
                   Tensor(dout, DType::f64, Device::cpu, {2, 2}), Tensor(y_perm, DType::f64, Device::cpu, {4, 2}),
                   Tensor(w, DType::f64, Device::cpu, {2, 2}), rows);
  EXPECT_EQ(std::vector<double>(dy_perm, dy_perm + 8), (std::vector<double>{12, 16, -9, -9, -9, -9, 0.5, 1}));
  EXPECT_EQ(std::vector<double>(dw, dw + 4), (std::vector<double>{1 * 4 + 2 * 5, 0, 0, 3 * 1 + 4 * 1}));
}

TEST(Combine, OutMayAliasResidual) {
  const int64_t n = 3, k = 2, h = 4;
  Buffer rows = i32_buffer({n, k}, {5, 0, 1, 4, 2, 3});
  Buffer residual = random_buffer(DType::f32, {n, h}, 1), y_perm = random_buffer(DType::f32, {n * k, h}, 2),
         w = random_buffer(DType::f32, {n, k}, 3), out(DType::f32, Device::cpu, {n, h});
  combine_forward(out, residual, y_perm, w, rows);
  combine_forward(residual, residual, y_perm, w, rows);
  for (int64_t i = 0; i < n * h; ++i) EXPECT_EQ(residual.ptr<float>()[i], out.ptr<float>()[i]);
}

TEST(Combine, GradientsMatchFiniteDifferences) {
  struct Case {
    int64_t n, k;
    std::vector<int32_t> rows;
  };
  for (const Case& c : {Case{3, 2, {5, 0, 1, 4, 2, 3}}, Case{1, 3, {2, 0, 1}}}) {
    const int64_t h = 4;
    Buffer rows = i32_buffer({c.n, c.k}, c.rows);
    Buffer residual = random_buffer(DType::f64, {c.n, h}, 1), y_perm = random_buffer(DType::f64, {c.n * c.k, h}, 2),
           w = random_buffer(DType::f64, {c.n, c.k}, 3), r = random_buffer(DType::f64, {c.n, h}, 4);
    Buffer out(DType::f64, Device::cpu, {c.n, h}), dy_perm(DType::f64, Device::cpu, {c.n * c.k, h}),
        dw(DType::f64, Device::cpu, {c.n, c.k});
    auto loss = [&] {
      combine_forward(out, residual, y_perm, w, rows);
      return testing::weighted_sum(out, r);
    };
    loss();
    combine_backward(dy_perm, dw, r, y_perm, w, rows);
    testing::expect_gradient("dy_perm", y_perm, dy_perm, loss);
    testing::expect_gradient("dtopk_weight", w, dw, loss);
    testing::expect_gradient("dresidual", residual, r, loss);
  }
}

TEST(Combine, GradientsMatchFiniteDifferencesWithAbsentCopies) {
  // R = 5 rows for T * K = 6 slots: row 2 is nobody's, token 1 is not here at all. Without and with a residual.
  const int64_t n = 3, k = 2, r_rows = 5, h = 4;
  Buffer rows = i32_buffer({n, k}, {4, -1, -1, -1, 0, 3});
  for (bool with_residual : {false, true}) {
    Buffer residual = random_buffer(DType::f64, {n, h}, 1), y_perm = random_buffer(DType::f64, {r_rows, h}, 2),
           w = random_buffer(DType::f64, {n, k}, 3), r = random_buffer(DType::f64, {n, h}, 4);
    Buffer out(DType::f64, Device::cpu, {n, h}), dy_perm = Buffer::zeros(DType::f64, Device::cpu, {r_rows, h}),
           dw(DType::f64, Device::cpu, {n, k});
    auto loss = [&] {
      combine_forward(out, with_residual ? residual.view() : Tensor{}, y_perm, w, rows);
      return testing::weighted_sum(out, r);
    };
    loss();
    combine_backward(dy_perm, dw, r, y_perm, w, rows);
    testing::expect_gradient("dy_perm", y_perm, dy_perm, loss);
    testing::expect_gradient("dtopk_weight", w, dw, loss);
    if (with_residual) testing::expect_gradient("dresidual", residual, r, loss);
  }
}

// One MoE block end to end, as the model strings the ops together:
//   router -> dispatch -> grouped gate/up -> SwiGLU -> grouped down -> combine (+ residual),
// and the backward in reverse. The loss is sum(r * out) + aux_grad * aux_loss.
struct ExpertBlock {
  static constexpr int64_t n = 6, h = 8, e = 4, k = 2, inter = 5;
  static constexpr double aux_grad = 0.4;
  Buffer x, logits, w_gate_up, w_down, residual, r;
  Buffer probs, topk_index, topk_weight, routing_stats, offsets, copy_row, x_perm, gate_up, act, y_perm, out;
  Buffer dx, dlogits, dw_gate_up, dw_down, dtopk_weight, dy_perm, dact, dgate_up, dx_perm;

  explicit ExpertBlock(DType dtype)
      : x(random_buffer(dtype, {n, h}, 1)),
        w_gate_up(random_buffer(dtype, {e, 2 * inter, h}, 3, 0.5)),
        w_down(random_buffer(dtype, {e, h, inter}, 4, 0.5)),
        residual(random_buffer(dtype, {n, h}, 5)),
        r(random_buffer(dtype, {n, h}, 6)),
        probs(dtype, Device::cpu, {n, e}),
        topk_index(DType::i32, Device::cpu, {n, k}),
        topk_weight(dtype, Device::cpu, {n, k}),
        routing_stats(dtype, Device::cpu, {2 * e + 1}),
        offsets(DType::i32, Device::cpu, {e + 1}),
        copy_row(DType::i32, Device::cpu, {n, k}),
        x_perm(dtype, Device::cpu, {n * k, h}),
        gate_up(dtype, Device::cpu, {n * k, 2 * inter}),
        act(dtype, Device::cpu, {n * k, inter}),
        y_perm(dtype, Device::cpu, {n * k, h}),
        out(dtype, Device::cpu, {n, h}),
        dx(dtype, Device::cpu, {n, h}),
        dlogits(dtype, Device::cpu, {n, e}),
        dw_gate_up(Buffer::zeros(dtype, Device::cpu, {e, 2 * inter, h})),
        dw_down(Buffer::zeros(dtype, Device::cpu, {e, h, inter})),
        dtopk_weight(dtype, Device::cpu, {n, k}),
        dy_perm(dtype, Device::cpu, {n * k, h}),
        dact(dtype, Device::cpu, {n * k, inter}),
        dgate_up(dtype, Device::cpu, {n * k, 2 * inter}),
        dx_perm(dtype, Device::cpu, {n * k, h}) {
    // Levels 1 apart so that no top-k choice is near a tie; expert 2 is never chosen.
    logits = Buffer(dtype, Device::cpu, {n, e});
    for (int64_t t = 0; t < n; ++t)
      for (int64_t i = 0; i < e; ++i) testing::set_element(logits, t * e + i, i == 2 ? -5.0 : double((i + t) % e) + 0.1 * t);
  }

  double forward() {
    router_forward(probs, topk_index, topk_weight, logits, true);
    router_statistics(routing_stats, probs, topk_index);
    dispatch_plan(offsets, copy_row, topk_index);
    dispatch_forward(x_perm, x, copy_row);
    grouped_linear_forward(gate_up, x_perm, w_gate_up, offsets);
    swiglu_forward(act, gate_up);
    grouped_linear_forward(y_perm, act, w_down, offsets);
    combine_forward(out, residual, y_perm, topk_weight, copy_row);
    return testing::weighted_sum(out, r) + aux_grad * router_aux_loss(routing_stats);
  }

  // weights_in_experts: the one-process path of the engine, where combine's backward passes dout's
  // copies unweighted and the experts apply the routing weights (swiglu_weighted_backward).
  void backward(bool weights_in_experts = false) {
    if (weights_in_experts) {
      dispatch_forward(dy_perm, r, copy_row);
      grouped_linear_backward_input(dact, dy_perm, w_down, offsets);
      swiglu_weighted_backward(dgate_up, act, dtopk_weight, dact, gate_up, topk_weight, copy_row);
    } else {
      combine_backward(dy_perm, dtopk_weight, r, y_perm, topk_weight, copy_row);
      grouped_linear_backward_input(dact, dy_perm, w_down, offsets);
      swiglu_backward(dgate_up, dact, gate_up);
    }
    grouped_linear_backward_weight(dw_down, dy_perm, act, offsets);
    grouped_linear_backward_input(dx_perm, dgate_up, w_gate_up, offsets);
    grouped_linear_backward_weight(dw_gate_up, dgate_up, x_perm, offsets);
    dispatch_backward(dx, dx_perm, copy_row);
    router_backward(dlogits, dtopk_weight, probs, topk_index, topk_weight, true, aux_grad, routing_stats);
  }
};

TEST(Combine, WholeExpertBlockGradientsMatchFiniteDifferences) {
  ExpertBlock b(DType::f64);
  b.forward();
  EXPECT_EQ(b.offsets.ptr<int32_t>()[2], b.offsets.ptr<int32_t>()[3]) << "expert 2 should have no tokens";
  b.backward();
  auto loss = [&] { return b.forward(); };
  testing::expect_gradient("dx", b.x, b.dx, loss);
  testing::expect_gradient("dlogits", b.logits, b.dlogits, loss);
  testing::expect_gradient("dw_gate_up", b.w_gate_up, b.dw_gate_up, loss);
  testing::expect_gradient("dw_down", b.w_down, b.dw_down, loss);
}

TEST(Combine, RoutingWeightsAppliedInTheExpertsGiveTheSameGradients) {
  ExpertBlock weighted(DType::f64), in_experts(DType::f64);
  weighted.forward();
  in_experts.forward();
  weighted.backward();
  in_experts.backward(true);
  for (auto [name, a, e] : {std::tuple{"dx", &in_experts.dx, &weighted.dx}, std::tuple{"dlogits", &in_experts.dlogits, &weighted.dlogits},
                            std::tuple{"dtopk_weight", &in_experts.dtopk_weight, &weighted.dtopk_weight},
                            std::tuple{"dw_gate_up", &in_experts.dw_gate_up, &weighted.dw_gate_up},
                            std::tuple{"dw_down", &in_experts.dw_down, &weighted.dw_down}})
    for (int64_t i = 0; i < e->numel(); ++i) {
      const double want = testing::element(*e, i);
      EXPECT_NEAR(testing::element(*a, i), want, 1e-12 * (1 + std::abs(want))) << name << " element " << i;
    }
}

TEST(Combine, F32PathMatchesF64ThroughWholeExpertBlock) {
  ExpertBlock b64(DType::f64), b32(DType::f32);
  const double loss64 = b64.forward(), loss32 = b32.forward();
  EXPECT_NEAR(loss32, loss64, 1e-5 * (1 + std::abs(loss64)));
  b64.backward();
  b32.backward();
  for (int64_t i = 0; i < b64.topk_index.numel(); ++i)
    ASSERT_EQ(b32.topk_index.ptr<int32_t>()[i], b64.topk_index.ptr<int32_t>()[i]);
  for (auto [name, a, e] :
       {std::tuple{"out", &b32.out, &b64.out}, std::tuple{"dx", &b32.dx, &b64.dx},
        std::tuple{"dlogits", &b32.dlogits, &b64.dlogits}, std::tuple{"dw_gate_up", &b32.dw_gate_up, &b64.dw_gate_up},
        std::tuple{"dw_down", &b32.dw_down, &b64.dw_down}})
    for (int64_t i = 0; i < e->numel(); ++i) {
      double want = testing::element(*e, i);
      EXPECT_NEAR(testing::element(*a, i), want, 1e-5 * (1 + std::abs(want))) << name << " element " << i;
    }
}

TEST(Combine, RejectsCopyRowOutsideRange) {
  // R = 3 rows: 3 is past the end even though T * K = 4.
  Buffer rows = i32_buffer({2, 2}, {0, -1, 2, 3});
  Buffer residual(DType::f32, Device::cpu, {2, 3}), out(DType::f32, Device::cpu, {2, 3}),
      y_perm(DType::f32, Device::cpu, {3, 3}), w(DType::f32, Device::cpu, {2, 2});
  try {
    combine_forward(out, residual, y_perm, w, rows);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "combine_forward: copy_row[1, 1] = 3 is neither -1 nor inside [0, 3)");
  }
}

TEST(Combine, BackwardRejectsCopyRowOutsideRange) {
  Buffer rows = i32_buffer({2, 2}, {5, -1, 0, 1});
  Buffer dout(DType::f32, Device::cpu, {2, 3}), y_perm(DType::f32, Device::cpu, {5, 3}),
      dy_perm(DType::f32, Device::cpu, {5, 3}), w(DType::f32, Device::cpu, {2, 2}), dw(DType::f32, Device::cpu, {2, 2});
  try {
    combine_backward(dy_perm, dw, dout, y_perm, w, rows);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "combine_backward: copy_row[0, 0] = 5 is neither -1 nor inside [0, 5)");
  }
}

TEST(Combine, RejectsMisshapenTopKWeight) {
  Buffer rows = i32_buffer({2, 2}, {0, 1, 2, 3});
  Buffer dout(DType::f32, Device::cpu, {2, 3}), y_perm(DType::f32, Device::cpu, {4, 3}),
      dy_perm(DType::f32, Device::cpu, {4, 3}), w(DType::f32, Device::cpu, {2, 3}), dw(DType::f32, Device::cpu, {2, 2});
  try {
    combine_backward(dy_perm, dw, dout, y_perm, w, rows);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "combine_backward: topk_weight has shape [2, 3] but expected [2, 2]");
  }
}

}  // namespace
}  // namespace marrow
