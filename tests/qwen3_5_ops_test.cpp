// Qwen3.5-MoE's elementwise ops (ops/causal_conv.h, gated_rmsnorm.h, sigmoid_gate.h) in f64: each
// against its formula written out here, and each gradient against central differences; the
// parameter gradients start from ones, so that += is checked too.
#include <array>
#include <cmath>
#include <functional>
#include <string>

#include "gradcheck.h"
#include "ops/causal_conv.h"
#include "ops/gated_rmsnorm.h"
#include "ops/sigmoid_gate.h"

namespace marrow {
namespace {

using testing::random_buffer;
using testing::weighted_sum;
constexpr DType f64 = DType::f64;

Buffer zeros(std::initializer_list<int64_t> dims) { return Buffer::zeros(f64, Device::cpu, dims); }
Buffer ones(std::initializer_list<int64_t> dims) {
  Buffer b = zeros(dims);
  for (int64_t i = 0; i < b.numel(); ++i) b.ptr<double>()[i] = 1;
  return b;
}
double at(const Tensor& t, int64_t i) { return t.ptr<double>()[i]; }
double sigmoid(double v) { return 1 / (1 + std::exp(-v)); }
double silu(double v) { return v * sigmoid(v); }

// Checks a parameter gradient accumulated onto ones: analytic = grad - 1.
void expect_accumulated(const std::string& what, const Tensor& input, const Tensor& grad, const std::function<double()>& loss) {
  Buffer analytic = zeros({grad.numel()});
  for (int64_t i = 0; i < grad.numel(); ++i) analytic.ptr<double>()[i] = at(grad, i) - 1;
  testing::expect_gradient(what, input, analytic, loss);
}

std::string error_of(const std::function<void()>& call) {
  try {
    call();
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

TEST(Qwen35Ops, CausalConvIsTheFormulaWithinEachSequence) {
  const int64_t b = 3, s = 5, c = 3, k = 4;
  Buffer x = random_buffer(f64, {b, s, c}, 1), w = random_buffer(f64, {c, k}, 2), y = zeros({b, s, c});
  causal_conv_forward(y, x, w);
  for (int64_t q = 0; q < b; ++q)
    for (int64_t t = 0; t < s; ++t)
      for (int64_t ch = 0; ch < c; ++ch) {
        double pre = 0;
        for (int64_t j = 0; j < k; ++j)
          if (t - k + 1 + j >= 0) pre += at(w, ch * k + j) * at(x, (q * s + t - k + 1 + j) * c + ch);
        EXPECT_NEAR(at(y, (q * s + t) * c + ch), silu(pre), 1e-14) << q << " " << t << " " << ch;
      }
  // Backward: sequence 1 alone gives the batch's dx rows bit for bit (nothing leaks across the boundaries).
  Buffer dy = random_buffer(f64, {b, s, c}, 3), dx = zeros({b, s, c}), dw = zeros({c, k}), dx1 = zeros({1, s, c}), dw1 = zeros({c, k});
  causal_conv_backward(dx, dw, dy, x, w);
  causal_conv_backward(dx1, dw1, dy.view().rows(1, 2), x.view().rows(1, 2), w);
  for (int64_t i = 0; i < s * c; ++i) EXPECT_EQ(at(dx, s * c + i), at(dx1, i)) << i;
}

TEST(Qwen35Ops, CausalConvGradientsMatchFiniteDifferences) {
  for (auto [b, s, c, k] : {std::array<int64_t, 4>{2, 6, 3, 4}, {3, 2, 2, 4}, {1, 5, 2, 1}}) {
    Buffer x = random_buffer(f64, {b, s, c}, 4), w = random_buffer(f64, {c, k}, 5), r = random_buffer(f64, {b, s, c}, 6);
    Buffer y = zeros({b, s, c}), dx = zeros({b, s, c}), dw = ones({c, k});
    auto loss = [&] {
      causal_conv_forward(y, x, w);
      return weighted_sum(y, r);
    };
    causal_conv_backward(dx, dw, r, x, w);
    testing::expect_gradient("conv dx", x, dx, loss);
    expect_accumulated("conv dweight", w, dw, loss);
  }
}

TEST(Qwen35Ops, GatedRmsNormIsTheFormulaAndItsGradients) {
  const int64_t n = 4, d = 6;
  const double eps = 1e-6;
  Buffer x = random_buffer(f64, {n, d}, 7), z = random_buffer(f64, {n, d}, 8, 2.0), w = random_buffer(f64, {d}, 9),
         r = random_buffer(f64, {n, d}, 10);
  Buffer y = zeros({n, d}), rstd = zeros({n}), dx = zeros({n, d}), dz = zeros({n, d}), dw = ones({d});
  auto loss = [&] {
    gated_rmsnorm_forward(y, rstd, x, z, w, eps);
    return weighted_sum(y, r);
  };
  loss();
  for (int64_t i = 0; i < n; ++i) {
    double ss = 0;
    for (int64_t j = 0; j < d; ++j) ss += at(x, i * d + j) * at(x, i * d + j);
    const double want_rstd = 1 / std::sqrt(ss / double(d) + eps);
    EXPECT_NEAR(at(rstd, i), want_rstd, 1e-14);
    for (int64_t j = 0; j < d; ++j)
      EXPECT_NEAR(at(y, i * d + j), at(w, j) * at(x, i * d + j) * want_rstd * silu(at(z, i * d + j)), 1e-14) << i << " " << j;
  }
  gated_rmsnorm_backward(dx, dz, dw, r, x, z, w, rstd);
  testing::expect_gradient("gated norm dx", x, dx, loss);
  testing::expect_gradient("gated norm dz", z, dz, loss);
  expect_accumulated("gated norm dweight", w, dw, loss);
}

TEST(Qwen35Ops, DeltaGatesAreTheFormulaAndTheirGradients) {
  const int64_t t = 5, hv = 3;
  Buffer ba = random_buffer(f64, {t, 2 * hv}, 11, 2.0), a_log = random_buffer(f64, {hv}, 12), dt = random_buffer(f64, {hv}, 13);
  Buffer g = zeros({t, hv}), beta = zeros({t, hv}), rg = random_buffer(f64, {t, hv}, 14), rb = random_buffer(f64, {t, hv}, 15);
  Buffer dba = zeros({t, 2 * hv}), da_log = ones({hv}), ddt = ones({hv});
  auto loss = [&] {
    delta_gates_forward(g, beta, ba, a_log, dt);
    return weighted_sum(g, rg) + weighted_sum(beta, rb);
  };
  loss();
  for (int64_t i = 0; i < t * hv; ++i) {
    const int64_t h = i % hv, row = i / hv;
    EXPECT_NEAR(at(beta, i), sigmoid(at(ba, row * 2 * hv + h)), 1e-15);
    EXPECT_NEAR(at(g, i), -std::exp(at(a_log, h)) * std::log1p(std::exp(at(ba, row * 2 * hv + hv + h) + at(dt, h))), 1e-13);
  }
  delta_gates_backward(dba, da_log, ddt, rg, rb, ba, a_log, dt);
  testing::expect_gradient("delta gates dba", ba, dba, loss);
  expect_accumulated("delta gates dA_log", a_log, da_log, loss);
  expect_accumulated("delta gates ddt_bias", dt, ddt, loss);
}

// torch's softplus passes x > 20 through (value x, gradient 1) and computes log1p(exp(x)) at 20 itself.
TEST(Qwen35Ops, DeltaGatesSoftplusThreshold) {
  double ba[6] = {0, 0, 0, 25, 20, 19.5}, a_log[3] = {0.5, -1, 2}, dt[3] = {0, 0, 0}, g[3], beta[3], dg[3] = {1, 1, 1}, dbeta[3] = {};
  double dba[6], da_log[3] = {}, ddt[3] = {};
  const auto t = [](double* p, std::initializer_list<int64_t> dims) { return Tensor(p, f64, Device::cpu, dims); };
  delta_gates_forward(t(g, {1, 3}), t(beta, {1, 3}), t(ba, {1, 6}), t(a_log, {3}), t(dt, {3}));
  EXPECT_EQ(g[0], -std::exp(0.5) * 25);
  EXPECT_EQ(g[1], -std::exp(-1.0) * std::log1p(std::exp(20.0)));
  EXPECT_NE(g[1], -std::exp(-1.0) * 20);
  EXPECT_EQ(g[2], -std::exp(2.0) * std::log1p(std::exp(19.5)));
  delta_gates_backward(t(dba, {1, 6}), t(da_log, {3}), t(ddt, {3}), t(dg, {1, 3}), t(dbeta, {1, 3}), t(ba, {1, 6}), t(a_log, {3}), t(dt, {3}));
  EXPECT_EQ(dba[3], -std::exp(0.5));
  EXPECT_NEAR(dba[4], -std::exp(-1.0) * sigmoid(20), 1e-15);
  EXPECT_NE(dba[4], -std::exp(-1.0));
}

TEST(Qwen35Ops, SplitQueryGateSplitsEachHeadAndMergesBack) {
  const int64_t t = 2, h = 3, d = 4;
  Buffer qg = random_buffer(f64, {t, h, 2 * d}, 16), q = zeros({t, h, d}), gate = zeros({t, h, d}), back = zeros({t, h, 2 * d});
  split_query_gate_forward(q, gate, qg);
  for (int64_t i = 0; i < t * h * d; ++i) {
    EXPECT_EQ(at(q, i), at(qg, i / d * 2 * d + i % d));
    EXPECT_EQ(at(gate, i), at(qg, i / d * 2 * d + d + i % d));
  }
  split_query_gate_backward(back, q, gate);
  for (int64_t i = 0; i < qg.numel(); ++i) EXPECT_EQ(at(back, i), at(qg, i));
}

TEST(Qwen35Ops, SigmoidGateFullAndPerRow) {
  const int64_t n = 3, d = 5;
  for (int64_t gd : {d, int64_t(1)}) {
    Buffer x = random_buffer(f64, {n, d}, 17), gate = random_buffer(f64, {n, gd}, 18, 2.0), r = random_buffer(f64, {n, d}, 19);
    Buffer y = zeros({n, d}), dx = zeros({n, d}), dgate = zeros({n, gd}), in_place = random_buffer(f64, {n, d}, 19), dgate2 = zeros({n, gd});
    auto loss = [&] {
      sigmoid_gate_forward(y, x, gate);
      return weighted_sum(y, r);
    };
    loss();
    for (int64_t i = 0; i < n * d; ++i) EXPECT_NEAR(at(y, i), at(x, i) * sigmoid(at(gate, gd == 1 ? i / d : i)), 1e-15) << gd << " " << i;
    sigmoid_gate_backward(dx, dgate, r, x, gate);
    testing::expect_gradient("sigmoid gate dx", x, dx, loss);
    testing::expect_gradient("sigmoid gate dgate", gate, dgate, loss);
    sigmoid_gate_backward(in_place, dgate2, in_place, x, gate);  // dx over dy
    for (int64_t i = 0; i < n * d; ++i) EXPECT_EQ(at(in_place, i), at(dx, i));
    for (int64_t i = 0; i < n * gd; ++i) EXPECT_EQ(at(dgate2, i), at(dgate, i));
  }
}

TEST(Qwen35Ops, ShapeErrorsNameTheTensor) {
  Buffer x = zeros({2, 3, 4}), w = zeros({4, 4}), y = zeros({2, 3, 5}), m = zeros({6, 4}), v = zeros({3}), r = zeros({6});
  EXPECT_EQ(error_of([&] { causal_conv_forward(y, x, w); }), "causal_conv_forward: y has shape [2, 3, 5] but expected [2, 3, 4]");
  EXPECT_EQ(error_of([&] {
              causal_conv_forward(zeros({2, 3, 4}), x, zeros({3, 4}));
            }),
            "causal_conv_forward: weight has shape [3, 4] but expected [4, 4]");
  EXPECT_EQ(error_of([&] { gated_rmsnorm_forward(m, r, m, m, v, 1e-6); }), "gated_rmsnorm_forward: weight has shape [3] but expected [4]");
  EXPECT_EQ(error_of([&] {
              delta_gates_forward(zeros({6, 2}), zeros({6, 2}), m, v, v);
            }),
            "delta_gates_forward: A_log has shape [3] but expected [2]");
  EXPECT_EQ(error_of([&] {
              delta_gates_forward(m, m, zeros({6, 3}), v, v);
            }),
            "delta_gates_forward: ba must be [tokens, 2 * value_heads], got [6, 3]");
  EXPECT_EQ(error_of([&] {
              split_query_gate_backward(zeros({2, 3, 4}), x, zeros({2, 3, 2}));
            }),
            "split_query_gate_backward: dgate has shape [2, 3, 2] but expected [2, 3, 4]");
  EXPECT_EQ(error_of([&] {
              sigmoid_gate_forward(m, m, zeros({6, 2}));
            }),
            "sigmoid_gate_forward: gate has shape [6, 2] but expected [6, 4] or [6, 1]");
  EXPECT_EQ(error_of([&] {
              sigmoid_gate_backward(m, zeros({6, 4}), m, m, zeros({6, 1}));
            }),
            "sigmoid_gate_backward: dgate has shape [6, 4] but expected [6, 1]");
}

}  // namespace
}  // namespace marrow
