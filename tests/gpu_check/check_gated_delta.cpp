// marrow check, linear_attention group: the gated delta rule (ops/gated_delta.h), forward and
// backward, on the GPU against the CPU's chunked f32 reference on the same inputs (qkv and the
// output gradient rounded to bf16, g, beta and the states f32): a tiny shape, an odd length with
// odd head dims (Dk != Dv, padded to 32 inside) and initial / final states, and Qwen3.5-MoE's layer
// (S = 4096, Hk = 16, Hv = 32, Dk = Dv = 128). The backward runs twice: the same bits.
#include <cmath>
#include <string>

#include "gpu_check/check.h"
#include "ops/gated_delta.h"

namespace marrow {

namespace {

// The GPU rounds the products' operands to bf16 (normalized q and k, W, P, the states, Vn, dVn: 2^-9
// each) and sums in f32; o and dqkv are one more bf16 rounding. Those leave ~3e-3 of the largest
// element; the bounds keep a 5-10x margin, and a wrong term, mask or chunk gives O(1).
constexpr double kForward = 2e-2, kBackward = 3e-2;
constexpr DType bf16 = DType::bf16, f32 = DType::f32;

// The model's gates: g = -softplus(x + 1) (log decays in (-inf, 0)), beta = sigmoid(x).
Buffer gate_values(std::initializer_list<int64_t> dims, uint64_t seed, bool beta) {
  Buffer b = random_host(dims, seed);
  for (int64_t i = 0; i < b.numel(); ++i) {
    const float x = b.ptr<float>()[i];
    b.ptr<float>()[i] = beta ? 1.0f / (1.0f + std::exp(-x)) : -std::log1p(std::exp(x + 1.0f));
  }
  return b;
}

struct Case {
  int64_t B, S, Hk, Hv, Dk, Dv;
  bool states;
};

void check_case(CheckReport& report, const Case& n) {
  const std::string size = fmt::format("B={} S={} Hk={} Hv={} Dk={} Dv={}{}", n.B, n.S, n.Hk, n.Hv, n.Dk, n.Dv, n.states ? " states" : "");
  const int64_t width = 2 * n.Hk * n.Dk + n.Hv * n.Dv;
  const Both qkv(random_bf16({n.B, n.S, width}, 300), bf16), g(gate_values({n.B, n.S, n.Hv}, 301, false), f32);
  const Both beta(gate_values({n.B, n.S, n.Hv}, 302, true), f32), s0(random_host({n.B, n.Hv, n.Dk, n.Dv}, 303, 0.5), f32);
  const Both o = Both::out(bf16, {n.B, n.S, n.Hv, n.Dv}), final_state = Both::out(f32, {n.B, n.Hv, n.Dk, n.Dv});
  const auto state = [&](const Both& t, int s) { return n.states ? t[s] : Tensor{}; };
  on_each_side([&](int s) { gated_delta_forward(o[s], state(final_state, s), qkv[s], g[s], beta[s], n.Hk, n.Dk, state(s0, s)); });
  report.compare("gated_delta_forward o " + size, o, kForward);
  if (n.states) report.compare("gated_delta_forward final_state " + size, final_state, kForward);

  const Both d_out(random_bf16({n.B, n.S, n.Hv, n.Dv}, 304), bf16), d_final(random_host({n.B, n.Hv, n.Dk, n.Dv}, 305), f32);
  const Both dqkv = Both::out(bf16, {n.B, n.S, width}), dg = Both::out(f32, {n.B, n.S, n.Hv}), dbeta = Both::out(f32, {n.B, n.S, n.Hv});
  const Both d_initial = Both::out(f32, {n.B, n.Hv, n.Dk, n.Dv});
  on_each_side([&](int s) {
    gated_delta_backward(dqkv[s], dg[s], dbeta[s], state(d_initial, s), d_out[s], qkv[s], g[s], beta[s], n.Hk, n.Dk, state(s0, s),
                         state(d_final, s));
  });
  report.compare("gated_delta_backward dqkv " + size, dqkv, kBackward);
  report.compare("gated_delta_backward dg " + size, dg, kBackward);
  report.compare("gated_delta_backward dbeta " + size, dbeta, kBackward);
  if (n.states) report.compare("gated_delta_backward d_initial_state " + size, d_initial, kBackward);

  const Buffer dqkv_again = poisoned(bf16, {n.B, n.S, width}), dg_again = poisoned(f32, {n.B, n.S, n.Hv});
  const Buffer dbeta_again = poisoned(f32, {n.B, n.S, n.Hv});
  gated_delta_backward(dqkv_again, dg_again, dbeta_again, {}, d_out.gpu, qkv.gpu, g.gpu, beta.gpu, n.Hk, n.Dk, state(s0, 1), state(d_final, 1));
  report.expect_same_bits("gated_delta_backward dqkv two runs " + size, dqkv_again, dqkv.gpu);
  report.expect_same_bits("gated_delta_backward dg two runs " + size, dg_again, dg.gpu);
}

}  // namespace

void check_gated_delta(CheckReport& report) {
  check_case(report, {1, 64, 1, 1, 32, 32, false});   // one chunk
  check_case(report, {2, 77, 2, 4, 24, 40, true});    // a partial chunk, odd dims, GQA, the states
  check_case(report, {1, 4096, 16, 32, 128, 128, false});  // Qwen3.5-MoE's layer
  const Both qkv(random_bf16({1, 8, 128}, 306), bf16), g(gate_values({1, 8, 2}, 307, false), f32), beta(gate_values({1, 8, 2}, 308, true), f32);
  const Both o = Both::out(bf16, {1, 8, 2, 32});
  report.expect("gated_delta_forward refuses chunks other than 64 on the GPU",
                refuses([&] { gated_delta_forward(o.gpu, {}, qkv.gpu, g.gpu, beta.gpu, 1, 32, {}, 32); }));
}

}  // namespace marrow
