// marrow check, linear_attention group: Qwen3.5-MoE's elementwise ops (ops/causal_conv.h,
// gated_rmsnorm.h, sigmoid_gate.h), forward and backward, GPU against the f32 CPU reference on the
// same bf16-rounded inputs: odd sizes (one element at a time), packs of 8, and the model's shapes
// (T = 4096; conv channels C = 2 * 16 * 128 + 32 * 128 = 8192; 32 value heads of 128; 16 query heads
// of 256; hidden 2048). GPU outputs start poisoned, accumulated gradients from the same random values
// on both sides; the reductions run twice from the same start: the same bits.
#include <array>
#include <string>
#include <utility>

#include "gpu_check/check.h"
#include "ops/causal_conv.h"
#include "ops/gated_rmsnorm.h"
#include "ops/sigmoid_gate.h"

namespace marrow {

namespace {

// kBf16: bf16 outputs, one to three roundings (2^-9 each) off the CPU's unrounded f32 math. kF32:
// elementwise f32 results (expf, log1pf: a few ulp off std::exp, std::log1p). kSum: f32 sums of up
// to 131,072 terms in another order than the CPU's sequential one (error ~ eps sqrt(n)). kExact: copies.
constexpr double kBf16 = 1e-2, kF32 = 1e-5, kSum = 1e-4, kExact = 0;
constexpr DType bf16 = DType::bf16, f32 = DType::f32;

void check_conv(CheckReport& report, int64_t b, int64_t s, int64_t c, int64_t k) {
  const std::string size = fmt::format("B={} S={} C={} K={}", b, s, c, k);
  const Both x(random_bf16({b, s, c}, 300), bf16), w(random_bf16({c, k}, 301, 0.5), bf16), dy(random_bf16({b, s, c}, 302), bf16);
  Buffer dw_start = random_host({c, k}, 303);
  const Both y = Both::out(bf16, {b, s, c}), dx = Both::out(bf16, {b, s, c}), dw(dw_start, f32), dw_again(dw_start, f32);
  on_each_side([&](int i) { causal_conv_forward(y[i], x[i], w[i]); });
  report.compare("causal_conv_forward y " + size, y, kBf16);
  on_each_side([&](int i) { causal_conv_backward(dx[i], dw[i], dy[i], x[i], w[i]); });
  report.compare("causal_conv_backward dx " + size, dx, kBf16);
  report.compare("causal_conv_backward dweight " + size, dw, kSum);
  causal_conv_backward(dx.gpu, dw_again.gpu, dy.gpu, x.gpu, w.gpu);
  report.expect_same_bits("causal_conv_backward dweight, two runs " + size, dw_again.gpu, dw.gpu);
}

void check_gated_norm(CheckReport& report, int64_t n, int64_t d) {
  const std::string size = fmt::format("N={} D={}", n, d);
  const Both x(random_bf16({n, d}, 310), bf16), z(random_bf16({n, d}, 311, 2.0), bf16), w(random_bf16({d}, 312, 0.5), bf16);
  const Both y = Both::out(bf16, {n, d}), rstd = Both::out(f32, {n});
  on_each_side([&](int i) { gated_rmsnorm_forward(y[i], rstd[i], x[i], z[i], w[i], 1e-6); });
  report.compare("gated_rmsnorm_forward y " + size, y, kBf16);
  report.compare("gated_rmsnorm_forward rstd " + size, rstd, kF32);
  Buffer dw_start = random_host({d}, 314);
  const Both dy(random_bf16({n, d}, 313), bf16), rstd_in(rstd.cpu, f32), dx = Both::out(bf16, {n, d}), dz = Both::out(bf16, {n, d});
  const Both dw(dw_start, f32), dw_again(dw_start, f32);
  on_each_side([&](int i) { gated_rmsnorm_backward(dx[i], dz[i], dw[i], dy[i], x[i], z[i], w[i], rstd_in[i]); });
  report.compare("gated_rmsnorm_backward dx " + size, dx, kBf16);
  report.compare("gated_rmsnorm_backward dz " + size, dz, kBf16);
  report.compare("gated_rmsnorm_backward dweight " + size, dw, kSum);
  gated_rmsnorm_backward(dx.gpu, dz.gpu, dw_again.gpu, dy.gpu, x.gpu, z.gpu, w.gpu, rstd_in.gpu);
  report.expect_same_bits("gated_rmsnorm_backward dweight, two runs " + size, dw_again.gpu, dw.gpu);
}

// ba of scale 8: some a + dt_bias past softplus's threshold of 20, some b where the sigmoid saturates.
void check_delta_gates(CheckReport& report, int64_t t, int64_t hv) {
  const std::string size = fmt::format("T={} Hv={}", t, hv);
  const Both ba(random_bf16({t, 2 * hv}, 320, 8.0), bf16), a_log(random_bf16({hv}, 321), bf16), dt(random_bf16({hv}, 322), bf16);
  const Both g = Both::out(f32, {t, hv}), beta = Both::out(f32, {t, hv});
  on_each_side([&](int i) { delta_gates_forward(g[i], beta[i], ba[i], a_log[i], dt[i]); });
  report.compare("delta_gates_forward g " + size, g, kF32);
  report.compare("delta_gates_forward beta (GPU: bf16's) " + size, beta, kBf16);
  Buffer da_start = random_host({hv}, 325), ddt_start = random_host({hv}, 326);
  const Both dg(random_host({t, hv}, 323), f32), dbeta(random_host({t, hv}, 324), f32), dba = Both::out(bf16, {t, 2 * hv});
  const Both da(da_start, f32), ddt(ddt_start, f32), da_again(da_start, f32), ddt_again(ddt_start, f32);
  on_each_side([&](int i) { delta_gates_backward(dba[i], da[i], ddt[i], dg[i], dbeta[i], ba[i], a_log[i], dt[i]); });
  report.compare("delta_gates_backward dba " + size, dba, kBf16);
  report.compare("delta_gates_backward dA_log " + size, da, kSum);
  report.compare("delta_gates_backward ddt_bias " + size, ddt, kSum);
  delta_gates_backward(dba.gpu, da_again.gpu, ddt_again.gpu, dg.gpu, dbeta.gpu, ba.gpu, a_log.gpu, dt.gpu);
  report.expect_same_bits("delta_gates_backward dA_log, two runs " + size, da_again.gpu, da.gpu);
  report.expect_same_bits("delta_gates_backward ddt_bias, two runs " + size, ddt_again.gpu, ddt.gpu);
}

void check_split(CheckReport& report, int64_t t, int64_t h, int64_t d) {
  const std::string size = fmt::format("T={} H={} D={}", t, h, d);
  const Both qg(random_bf16({t, h, 2 * d}, 330), bf16), q = Both::out(bf16, {t, h, d}), gate = Both::out(bf16, {t, h, d});
  on_each_side([&](int i) { split_query_gate_forward(q[i], gate[i], qg[i]); });
  report.compare("split_query_gate_forward q " + size, q, kExact);
  report.compare("split_query_gate_forward gate " + size, gate, kExact);
  const Both dq(random_bf16({t, h, d}, 331), bf16), dgate(random_bf16({t, h, d}, 332), bf16), dqg = Both::out(bf16, {t, h, 2 * d});
  on_each_side([&](int i) { split_query_gate_backward(dqg[i], dq[i], dgate[i]); });
  report.compare("split_query_gate_backward dqg " + size, dqg, kExact);
}

// gd: the gate's columns, d or 1 (one a row); then forward and backward in place (y over x, dx over dy).
void check_sigmoid_gate(CheckReport& report, int64_t n, int64_t d, int64_t gd) {
  const std::string size = fmt::format("N={} D={} gate [{}, {}]", n, d, n, gd);
  const Both x(random_bf16({n, d}, 340), bf16), gate(random_bf16({n, gd}, 341, 2.0), bf16), dy(random_bf16({n, d}, 342), bf16);
  const Both y = Both::out(bf16, {n, d}), dx = Both::out(bf16, {n, d}), dgate = Both::out(bf16, {n, gd});
  on_each_side([&](int i) { sigmoid_gate_forward(y[i], x[i], gate[i]); });
  report.compare("sigmoid_gate_forward y " + size, y, kBf16);
  on_each_side([&](int i) { sigmoid_gate_backward(dx[i], dgate[i], dy[i], x[i], gate[i]); });
  report.compare("sigmoid_gate_backward dx " + size, dx, kBf16);
  report.compare("sigmoid_gate_backward dgate " + size, dgate, kBf16);
  const Both in_place(x.cpu, bf16), dy_in_place(dy.cpu, bf16), dgate_again = Both::out(bf16, {n, gd});
  sigmoid_gate_forward(in_place.gpu, in_place.gpu, gate.gpu);
  report.expect_same_bits("sigmoid_gate_forward in place " + size, in_place.gpu, y.gpu);
  sigmoid_gate_backward(dy_in_place.gpu, dgate_again.gpu, dy_in_place.gpu, x.gpu, gate.gpu);
  report.expect_same_bits("sigmoid_gate_backward in place: dx " + size, dy_in_place.gpu, dx.gpu);
  report.expect_same_bits("sigmoid_gate_backward in place: dgate, two runs " + size, dgate_again.gpu, dgate.gpu);
}

}  // namespace

void check_qwen3_5_ops(CheckReport& report) {
  // One channel at a time (C 75), packs of 8 (72), tiles of 64 tokens with a short last one (130,
  // K = 3), the most taps (8) over a sequence shorter than them; a sequence's start in every batch.
  for (auto [b, s, c, k] : {std::array<int64_t, 4>{3, 37, 75, 4}, {2, 37, 72, 4}, {2, 130, 72, 3}, {2, 5, 8, 8}}) check_conv(report, b, s, c, k);
  {
    const Both x(random_bf16({1, 4, 8}, 350), bf16), w(random_bf16({8, 9}, 351), bf16), y = Both::out(bf16, {1, 4, 8});
    report.expect("causal_conv_forward refuses 9 taps on the GPU", refuses([&] { causal_conv_forward(y.gpu, x.gpu, w.gpu); }));
  }
  // Rows of 128 at most in packs of 8 take 16 lanes (72), longer rows 32 (256), odd ones one element at a time (75).
  for (int64_t d : {75, 72, 256}) check_gated_norm(report, 37, d);
  check_delta_gates(report, 37, 3);
  for (int64_t d : {36, 72}) check_split(report, 37, 3, d);
  for (auto [d, gd] : {std::pair<int64_t, int64_t>{75, 75}, {72, 72}, {75, 1}, {72, 1}}) check_sigmoid_gate(report, 37, d, gd);

  // The model's shapes at T = 4096.
  check_conv(report, 1, 4096, 8192, 4);
  check_gated_norm(report, 4096 * 32, 128);
  check_delta_gates(report, 4096, 32);
  check_split(report, 4096, 16, 256);
  check_sigmoid_gate(report, 4096, 16 * 256, 16 * 256);  // the attention output's gate
  check_sigmoid_gate(report, 4096, 2048, 1);             // the shared expert's
}

}  // namespace marrow
