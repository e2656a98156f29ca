#include "ops/gated_delta.h"

#include <omp.h>

#include <cmath>
#include <string>
#include <vector>

#include "gradcheck.h"

namespace marrow {
namespace {

using testing::element;
using testing::random_buffer;

struct Dims {
  int64_t B, S, Hk, Hv, Dk, Dv;
};

// Random inputs as the model makes them: g = -softplus (log decays <= 0), beta = sigmoid, and the
// gradients reaching o and the final state.
struct Problem {
  Dims n;
  DType dtype;
  Buffer qkv, g, beta, s0, d_out, d_final;
  Problem(DType dtype, Dims n, uint64_t seed = 1)
      : n(n), dtype(dtype), qkv(random_buffer(dtype, {n.B, n.S, 2 * n.Hk * n.Dk + n.Hv * n.Dv}, seed)),
        g(random_buffer(dtype, {n.B, n.S, n.Hv}, seed + 1)), beta(random_buffer(dtype, {n.B, n.S, n.Hv}, seed + 2)),
        s0(random_buffer(dtype, {n.B, n.Hv, n.Dk, n.Dv}, seed + 3, 0.5)), d_out(random_buffer(dtype, {n.B, n.S, n.Hv, n.Dv}, seed + 4)),
        d_final(random_buffer(dtype, {n.B, n.Hv, n.Dk, n.Dv}, seed + 5)) {
    for (int64_t i = 0; i < g.numel(); ++i) {
      testing::set_element(g, i, -std::log1p(std::exp(element(g, i) + 1.0)));
      testing::set_element(beta, i, 1.0 / (1.0 + std::exp(-element(beta, i))));
    }
  }
  Buffer make(std::initializer_list<int64_t> dims) const { return Buffer(dtype, Device::cpu, dims); }
};

// The op's outputs for one problem: chunk > 0 the chunked op, 0 the recurrence; states optional.
struct Result {
  Buffer o, final_state, dqkv, dg, dbeta, d_initial;
  Result(const Problem& p, int64_t chunk, bool with_states)
      : o(p.make({p.n.B, p.n.S, p.n.Hv, p.n.Dv})), final_state(p.make({p.n.B, p.n.Hv, p.n.Dk, p.n.Dv})),
        dqkv(p.make({p.n.B, p.n.S, p.qkv.view().size(2)})), dg(p.make({p.n.B, p.n.S, p.n.Hv})), dbeta(p.make({p.n.B, p.n.S, p.n.Hv})),
        d_initial(p.make({p.n.B, p.n.Hv, p.n.Dk, p.n.Dv})) {
    const Tensor s0 = with_states ? p.s0.view() : Tensor{}, d_final = with_states ? p.d_final.view() : Tensor{};
    if (chunk > 0) {
      gated_delta_forward(o, final_state, p.qkv, p.g, p.beta, p.n.Hk, p.n.Dk, s0, chunk);
      gated_delta_backward(dqkv, dg, dbeta, d_initial, p.d_out, p.qkv, p.g, p.beta, p.n.Hk, p.n.Dk, s0, d_final, chunk);
    } else {
      gated_delta_recurrent_forward(o, final_state, p.qkv, p.g, p.beta, p.n.Hk, p.n.Dk, s0);
      gated_delta_recurrent_backward(dqkv, dg, dbeta, d_initial, p.d_out, p.qkv, p.g, p.beta, p.n.Hk, p.n.Dk, s0, d_final);
    }
  }
  std::vector<std::pair<const char*, const Buffer*>> all() const {
    return {{"o", &o}, {"final_state", &final_state}, {"dqkv", &dqkv}, {"dg", &dg}, {"dbeta", &dbeta}, {"d_initial_state", &d_initial}};
  }
};

// max |a - b| / max |b| over each output stays within bound; no output is all zeros, but dg with
// one token and no initial state (the decay then meets only zeros).
void expect_close(const Result& a, const Result& b, double bound, bool dg_zero = false) {
  for (size_t t = 0; t < a.all().size(); ++t) {
    const Buffer &x = *a.all()[t].second, &y = *b.all()[t].second;
    double diff = 0, scale = 0;
    for (int64_t i = 0; i < x.numel(); ++i)
      diff = std::max(diff, std::abs(element(x, i) - element(y, i))), scale = std::max(scale, std::abs(element(y, i)));
    EXPECT_LE(diff, bound * scale) << a.all()[t].first;
    EXPECT_TRUE(scale > 0 || (dg_zero && a.all()[t].second == &a.dg)) << a.all()[t].first;
  }
}

const std::vector<Dims>& shapes() {
  static const std::vector<Dims> all = {{1, 1, 1, 1, 4, 3}, {2, 7, 2, 4, 5, 3}, {1, 65, 2, 2, 8, 6}, {1, 130, 1, 2, 6, 8}};
  return all;
}

TEST(GatedDelta, ChunkedMatchesTheRecurrenceForwardAndBackward) {
  for (const Dims& n : shapes())
    for (int64_t chunk : {1, 3, 16, 64})
      for (bool with_states : {false, true}) {
        SCOPED_TRACE(::testing::Message() << "S=" << n.S << " Hk=" << n.Hk << " Hv=" << n.Hv << " chunk " << chunk << " states " << with_states);
        const Problem p(DType::f64, n);
        expect_close(Result(p, chunk, with_states), Result(p, 0, with_states), 1e-12, n.S == 1 && !with_states);
      }
}

// One token from a zero state: S = beta k v^T, o = beta (q . k) v with q, k l2-normalized (q times
// Dk^-0.5), and value head h reads key head h / (Hv / Hk).
TEST(GatedDelta, OneTokenIsTheNormalizedProductAndValueHeadsShareKeyHeads) {
  const Problem p(DType::f64, {1, 1, 2, 4, 3, 2});
  const Result r(p, 64, false);
  const double* x = p.qkv.ptr<double>();
  for (int64_t h = 0; h < 4; ++h) {
    const double *q = x + h / 2 * 3, *k = x + 6 + h / 2 * 3, *v = x + 12 + h * 2;
    double qq = 1e-6, kk = 1e-6, qk = 0;
    for (int i = 0; i < 3; ++i) qq += q[i] * q[i], kk += k[i] * k[i], qk += q[i] * k[i];
    const double b = element(p.beta, h), scale = b * qk / std::sqrt(qq * kk * 3.0);
    for (int64_t j = 0; j < 2; ++j) EXPECT_NEAR(element(r.o, h * 2 + j), scale * v[j], 1e-14) << "head " << h;
  }
}

TEST(GatedDelta, RecurrentBackwardMatchesFiniteDifferences) {
  for (const Dims& n : {Dims{2, 5, 1, 2, 4, 3}, Dims{1, 4, 2, 2, 3, 5}}) {
    Problem p(DType::f64, n, 7);
    const Result r(p, 0, true);
    Buffer o = p.make({n.B, n.S, n.Hv, n.Dv}), final_state = p.make({n.B, n.Hv, n.Dk, n.Dv});
    auto loss = [&] {
      gated_delta_recurrent_forward(o, final_state, p.qkv, p.g, p.beta, n.Hk, n.Dk, p.s0);
      return testing::weighted_sum(o, p.d_out) + testing::weighted_sum(final_state, p.d_final);
    };
    testing::expect_gradient("dqkv", p.qkv, r.dqkv, loss);
    testing::expect_gradient("dg", p.g, r.dg, loss);
    testing::expect_gradient("dbeta", p.beta, r.dbeta, loss);
    testing::expect_gradient("d_initial_state", p.s0, r.d_initial, loss);
  }
}

TEST(GatedDelta, F32MatchesF64) {
  const Dims n{1, 130, 2, 4, 16, 16};
  expect_close(Result(Problem(DType::f32, n), 64, true), Result(Problem(DType::f64, n), 64, true), 2e-5);
}

TEST(GatedDelta, ThreadCountDoesNotChangeTheBits) {
  const Problem p(DType::f32, {2, 70, 2, 4, 32, 32});
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  const Result one(p, 16, true);
  omp_set_num_threads(3);
  const Result three(p, 16, true);
  omp_set_num_threads(saved);
  for (size_t t = 0; t < one.all().size(); ++t)
    for (int64_t i = 0; i < one.all()[t].second->numel(); ++i)
      ASSERT_EQ(element(*one.all()[t].second, i), element(*three.all()[t].second, i)) << one.all()[t].first << " " << i;
}

template <class Call> void expect_error(const Call& call, const std::string& message) {
  try {
    call();
    FAIL() << "expected an error: " << message;
  } catch (const Error& e) {
    EXPECT_EQ(e.what(), message);
  }
}

TEST(GatedDelta, RejectsBadShapesNamingTheTensor) {
  const Problem p(DType::f32, {1, 5, 2, 4, 3, 2});
  Result r(p, 4, true);
  Buffer bad = p.make({1, 5, 3}), bad_state = p.make({1, 4, 2, 3}), f64_g(DType::f64, Device::cpu, {1, 5, 4});
  expect_error([&] { gated_delta_forward(r.o, {}, p.qkv, bad, p.beta, 2, 3); }, "gated_delta_forward: g has shape [1, 5, 3] but expected [1, 5, 4]");
  expect_error([&] { gated_delta_forward(r.o, {}, p.qkv, p.g, p.beta, 3, 3); },
               "gated_delta_forward: key_heads (3) must be positive and divide the value heads (4), key_dim (3) positive");
  expect_error([&] { gated_delta_forward(r.o, {}, p.qkv, p.g, p.beta, 2, 4); },
               "gated_delta_forward: qkv has shape [1, 5, 20] but expected [1, 5, 24]");
  expect_error([&] { gated_delta_forward(r.o, bad_state, p.qkv, p.g, p.beta, 2, 3); },
               "gated_delta_forward: final_state has shape [1, 4, 2, 3] but expected [1, 4, 3, 2]");
  expect_error([&] { gated_delta_recurrent_forward(r.o, {}, p.qkv, f64_g, p.beta, 2, 3); },
               "gated_delta_recurrent_forward: g has dtype f64 but qkv has f32");
  expect_error([&] { gated_delta_backward(r.dqkv, r.dg, bad, {}, p.d_out, p.qkv, p.g, p.beta, 2, 3); },
               "gated_delta_backward: dbeta has shape [1, 5, 3] but expected [1, 5, 4]");
  expect_error([&] { gated_delta_recurrent_backward(r.dqkv, r.dg, r.dbeta, bad_state, p.d_out, p.qkv, p.g, p.beta, 2, 3); },
               "gated_delta_recurrent_backward: d_initial_state has shape [1, 4, 2, 3] but expected [1, 4, 3, 2]");
  expect_error([&] { gated_delta_forward(r.o, {}, p.qkv, p.g, p.beta, 2, 3, {}, 0); }, "gated_delta_forward: chunk must be positive, got 0");
  // The checks come before anything reads the data, so host pointers stand in for GPU memory.
  Tensor gpu_o(r.o.ptr<float>(), DType::f32, Device::cuda, {1, 5, 4, 2}), gpu_qkv(p.qkv.ptr<float>(), DType::bf16, Device::cuda, {1, 5, 20});
  Tensor gpu_g(p.g.ptr<float>(), DType::f32, Device::cuda, {1, 5, 4}), gpu_beta(p.beta.ptr<float>(), DType::f32, Device::cuda, {1, 5, 4});
  expect_error([&] { gated_delta_forward(gpu_o, {}, gpu_qkv, gpu_g, gpu_beta, 2, 3); }, "gated_delta_forward: o has dtype f32 but expected bf16");
}

}  // namespace
}  // namespace marrow
