#include "ops/attention.h"

#include <cmath>

#include "gradcheck.h"

namespace marrow {
namespace {

using testing::element;
using testing::random_buffer;

struct Shape {
  int64_t b, s, hq, hkv, d;
};

struct Attn {
  Buffer q, k, v, out, lse, dq, dk, dv, dout;
  // Random inputs of dtype t; seeds do not depend on t, so the f32 and f64 runs see the same values.
  Attn(DType t, Shape n)
      : q(random_buffer(t, {n.b, n.s, n.hq, n.d}, 1)),
        k(random_buffer(t, {n.b, n.s, n.hkv, n.d}, 2)),
        v(random_buffer(t, {n.b, n.s, n.hkv, n.d}, 3)),
        out(t, Device::cpu, {n.b, n.s, n.hq, n.d}),
        lse(t, Device::cpu, {n.b, n.hq, n.s}),
        dq(t, Device::cpu, {n.b, n.s, n.hq, n.d}),
        dk(t, Device::cpu, {n.b, n.s, n.hkv, n.d}),
        dv(t, Device::cpu, {n.b, n.s, n.hkv, n.d}),
        dout(random_buffer(t, {n.b, n.s, n.hq, n.d}, 4)) {}
  void forward() { attention_forward(out, lse, q, k, v); }
  void backward() { attention_backward(dq, dk, dv, dout, q, k, v, out, lse); }
};

TEST(Attention, SingleTokenReturnsItsValue) {
  // Eight query heads share one key/value head: every head attends only to token 0 and returns v.
  const Shape n{2, 1, 8, 1, 5};
  Attn r(DType::f64, n);
  r.forward();
  for (int64_t b = 0; b < n.b; ++b)
    for (int64_t h = 0; h < n.hq; ++h) {
      double score = 0;
      for (int64_t e = 0; e < n.d; ++e) {
        EXPECT_NEAR(element(r.out, (b * n.hq + h) * n.d + e), element(r.v, b * n.d + e), 1e-15);
        score += element(r.q, (b * n.hq + h) * n.d + e) * element(r.k, b * n.d + e);
      }
      EXPECT_NEAR(element(r.lse, b * n.hq + h), score / std::sqrt(double(n.d)), 1e-14);
    }
}

// Zero queries make every allowed score 0: token i averages v_0 .. v_i and lse_i = log(i + 1).
TEST(Attention, ZeroQueriesAverageThePrefix) {
  const Shape n{1, 4, 2, 2, 3};
  Attn r(DType::f64, n);
  for (int64_t i = 0; i < r.q.numel(); ++i) r.q.ptr<double>()[i] = 0;
  r.forward();
  for (int64_t h = 0; h < n.hq; ++h)
    for (int64_t i = 0; i < n.s; ++i) {
      EXPECT_NEAR(element(r.lse, h * n.s + i), std::log(double(i + 1)), 1e-14);
      for (int64_t e = 0; e < n.d; ++e) {
        double mean = 0;
        for (int64_t j = 0; j <= i; ++j) mean += element(r.v, (j * n.hkv + h) * n.d + e) / double(i + 1);
        EXPECT_NEAR(element(r.out, (i * n.hq + h) * n.d + e), mean, 1e-14);
      }
    }
}

TEST(Attention, LaterTokensDoNotChangeEarlierOutputs) {
  const Shape n{1, 5, 2, 1, 4};
  Attn r(DType::f64, n);
  r.forward();
  Buffer before(DType::f64, Device::cpu, {n.s * n.hq * n.d});
  for (int64_t i = 0; i < before.numel(); ++i) before.ptr<double>()[i] = element(r.out, i);
  for (int64_t e = 0; e < n.d; ++e) {
    r.k.ptr<double>()[(n.s - 1) * n.d + e] += 3;
    r.v.ptr<double>()[(n.s - 1) * n.d + e] -= 5;
  }
  r.forward();
  for (int64_t i = 0; i < (n.s - 1) * n.hq * n.d; ++i) EXPECT_EQ(element(r.out, i), element(before, i)) << i;
}

// Query head h reads key/value head h / (Hq / Hkv): the grouped run equals a run whose keys and values
// are repeated per query head (repeat_kv), and its dk, dv are the sums over each group.
TEST(Attention, GroupedHeadsMatchRepeatedKeysAndValues) {
  const Shape g{2, 3, 8, 2, 4}, full{2, 3, 8, 8, 4};
  Attn grouped(DType::f64, g), repeated(DType::f64, full);
  const int64_t group = g.hq / g.hkv, rows = g.b * g.s;
  for (int64_t row = 0; row < rows; ++row)
    for (int64_t h = 0; h < g.hq; ++h)
      for (int64_t e = 0; e < g.d; ++e) {
        const int64_t src = (row * g.hkv + h / group) * g.d + e, dst = (row * g.hq + h) * g.d + e;
        repeated.q.ptr<double>()[dst] = element(grouped.q, dst);
        repeated.k.ptr<double>()[dst] = element(grouped.k, src);
        repeated.v.ptr<double>()[dst] = element(grouped.v, src);
        repeated.dout.ptr<double>()[dst] = element(grouped.dout, dst);
      }
  for (Attn* r : {&grouped, &repeated}) {
    r->forward();
    r->backward();
  }
  for (int64_t i = 0; i < grouped.out.numel(); ++i) {
    EXPECT_NEAR(element(grouped.out, i), element(repeated.out, i), 1e-14) << i;
    EXPECT_NEAR(element(grouped.dq, i), element(repeated.dq, i), 1e-14) << i;
  }
  for (int64_t row = 0; row < rows; ++row)
    for (int64_t kvh = 0; kvh < g.hkv; ++kvh)
      for (int64_t e = 0; e < g.d; ++e) {
        double dk = 0, dv = 0;
        for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h) {
          dk += element(repeated.dk, (row * g.hq + h) * g.d + e);
          dv += element(repeated.dv, (row * g.hq + h) * g.d + e);
        }
        EXPECT_NEAR(element(grouped.dk, (row * g.hkv + kvh) * g.d + e), dk, 1e-13);
        EXPECT_NEAR(element(grouped.dv, (row * g.hkv + kvh) * g.d + e), dv, 1e-13);
      }
}

TEST(Attention, GradientsMatchFiniteDifferences) {
  // GQA groups of 2, 8 and 1 (plain multi-head), one token, odd head dims.
  for (Shape n :
       {Shape{2, 5, 4, 2, 3}, Shape{1, 6, 8, 1, 5}, Shape{1, 4, 3, 3, 8}, Shape{2, 1, 8, 1, 4}, Shape{1, 3, 1, 1, 1}}) {
    Attn r(DType::f64, n);
    // Poison the gradients: the backward must overwrite them.
    for (Buffer* g : {&r.dq, &r.dk, &r.dv})
      for (int64_t i = 0; i < g->numel(); ++i) g->ptr<double>()[i] = NAN;
    auto loss = [&] {
      r.forward();
      return testing::weighted_sum(r.out, r.dout);
    };
    loss();
    r.backward();
    testing::expect_gradient("dq", r.q, r.dq, loss);
    testing::expect_gradient("dk", r.k, r.dk, loss);
    testing::expect_gradient("dv", r.v, r.dv, loss);
  }
}

TEST(Attention, F32MatchesF64) {
  const Shape n{2, 37, 4, 2, 64};
  Attn r32(DType::f32, n), r64(DType::f64, n);
  for (Attn* r : {&r32, &r64}) {
    r->forward();
    r->backward();
  }
  for (auto [a, b] : {std::pair{&r32.out, &r64.out}, std::pair{&r32.lse, &r64.lse}, std::pair{&r32.dq, &r64.dq},
                      std::pair{&r32.dk, &r64.dk}, std::pair{&r32.dv, &r64.dv}})
    for (int64_t i = 0; i < a->numel(); ++i)
      ASSERT_NEAR(element(*a, i), element(*b, i), 1e-5 * (1 + std::abs(element(*b, i)))) << i;
}

TEST(Attention, RejectsBadShapes) {
  Buffer q(DType::f32, Device::cpu, {1, 4, 6, 8}), k(DType::f32, Device::cpu, {1, 4, 4, 8}),
      v(DType::f32, Device::cpu, {1, 4, 4, 8}), out(DType::f32, Device::cpu, {1, 4, 6, 8}),
      lse(DType::f32, Device::cpu, {1, 6, 4});
  try {
    attention_forward(out, lse, q, k, v);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(),
                 "attention_forward: the 6 query heads of q are not a multiple of the 4 key/value heads of k");
  }
  Buffer k2(DType::f32, Device::cpu, {1, 4, 2, 8}), v2(DType::f32, Device::cpu, {1, 4, 2, 4});
  try {
    attention_forward(out, lse, q, k2, v2);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "attention_forward: v has shape [1, 4, 2, 4] but expected [1, 4, 2, 8]");
  }
  Buffer bad_lse(DType::f32, Device::cpu, {1, 4, 6});
  try {
    attention_backward(q, k2, k2, out, q, k2, k2, out, bad_lse);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "attention_backward: lse has shape [1, 4, 6] but expected [1, 6, 4]");
  }
}

}  // namespace
}  // namespace marrow
