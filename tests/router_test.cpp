#include "ops/router.h"

#include <cmath>

#include "gradcheck.h"

namespace marrow {
namespace {

using testing::random_buffer;

// Logits whose top-k cannot flip under a finite-difference step: each token ranks the experts in
// its own order on levels 0.5 apart (3 is coprime to the expert counts used), plus a little noise.
// The last expert sits far below the rest, so with k < E it gets no tokens.
Buffer separated_logits(DType dtype, int64_t n, int64_t e, uint64_t seed) {
  Buffer noise = random_buffer(DType::f64, {n, e}, seed, 0.01), b(dtype, Device::cpu, {n, e});
  for (int64_t t = 0; t < n; ++t)
    for (int64_t i = 0; i < e; ++i) {
      double v = i == e - 1 ? -3.0 : 0.5 * double((3 * i + 5 * t) % e) + noise.ptr<double>()[t * e + i];
      testing::set_element(b, t * e + i, v);
    }
  return b;
}

template <typename T>
Tensor host(T* data, DType dtype, std::initializer_list<int64_t> dims) {
  return Tensor(data, dtype, Device::cpu, dims);
}

// The aux loss of probs and topk_index through their statistics.
double aux_loss_of(const Tensor& probs, const Tensor& topk_index) {
  Buffer stats(probs.dtype, Device::cpu, {2 * probs.size(1) + 1});
  router_statistics(stats, probs, topk_index);
  return router_aux_loss(stats);
}

TEST(Router, ForwardMatchesHandComputedSoftmaxAndTopK) {
  // softmax(log [1, 2, 3, 4]) = [0.1, 0.2, 0.3, 0.4]
  float logits[4] = {0, std::log(2.0f), std::log(3.0f), std::log(4.0f)}, probs[4], w[2];
  int32_t idx[2];
  for (bool normalize : {false, true}) {
    router_forward(host(probs, DType::f32, {1, 4}), host(idx, DType::i32, {1, 2}), host(w, DType::f32, {1, 2}),
                   host(logits, DType::f32, {1, 4}), normalize);
    for (int i = 0; i < 4; ++i) EXPECT_NEAR(probs[i], 0.1 * (i + 1), 1e-6);
    EXPECT_EQ(idx[0], 3);
    EXPECT_EQ(idx[1], 2);
    EXPECT_NEAR(w[0], normalize ? 4.0 / 7 : 0.4, 1e-6);
    EXPECT_NEAR(w[1], normalize ? 3.0 / 7 : 0.3, 1e-6);
  }
}

TEST(Router, TiesGoToTheLowerExpertIndex) {
  double logits[8] = {1, 2, 2, 2, 0, 0, 0, 0}, probs[8], w[4];
  int32_t idx[4];
  router_forward(host(probs, DType::f64, {2, 4}), host(idx, DType::i32, {2, 2}), host(w, DType::f64, {2, 2}),
                 host(logits, DType::f64, {2, 4}), true);
  EXPECT_EQ(idx[0], 1);
  EXPECT_EQ(idx[1], 2);
  EXPECT_EQ(idx[2], 0);
  EXPECT_EQ(idx[3], 1);
  EXPECT_DOUBLE_EQ(w[0], 0.5);
  EXPECT_DOUBLE_EQ(w[3], 0.5);
}

TEST(Router, BalancedRoutingGivesAuxLossK) {
  // Uniform probabilities and every expert chosen by exactly T * K / E copies.
  double probs[16];
  for (double& p : probs) p = 0.25;
  int32_t idx[8] = {0, 1, 2, 3, 1, 0, 3, 2};
  EXPECT_DOUBLE_EQ(aux_loss_of(host(probs, DType::f64, {4, 4}), host(idx, DType::i32, {4, 2})), 2.0);
}

TEST(Router, StatisticsMatchHandCountsAndSums) {
  double probs[9] = {0.5, 0.3, 0.2, 0.1, 0.6, 0.3, 0.2, 0.2, 0.6}, stats[7];
  int32_t idx[6] = {0, 1, 1, 2, 2, 1};
  router_statistics(host(stats, DType::f64, {7}), host(probs, DType::f64, {3, 3}), host(idx, DType::i32, {3, 2}));
  const double expected[7] = {1, 3, 2, 0.8, 1.1, 1.1, 3};
  for (int i = 0; i < 7; ++i) EXPECT_NEAR(stats[i], expected[i], 1e-15) << "stats[" << i << "]";
  // 3 * (1/3 * 0.8/3 + 3/3 * 1.1/3 + 2/3 * 1.1/3) = 6.3 / 3
  EXPECT_NEAR(router_aux_loss(host(stats, DType::f64, {7})), 2.1, 1e-15);
  // The device-side form adds the same value to a running total, here twice.
  double total = 0.5;
  router_aux_loss_add(host(&total, DType::f64, {1}), host(stats, DType::f64, {7}));
  router_aux_loss_add(host(&total, DType::f64, {1}), host(stats, DType::f64, {7}));
  EXPECT_DOUBLE_EQ(total, 0.5 + router_aux_loss(host(stats, DType::f64, {7})) + router_aux_loss(host(stats, DType::f64, {7})));
}

TEST(Router, AuxLossAddRejectsATotalThatIsNotOneDouble) {
  double stats[7] = {1, 3, 2, 0.8, 1.1, 1.1, 3};
  float total = 0;
  try {
    router_aux_loss_add(host(&total, DType::f32, {1}), host(stats, DType::f64, {7}));
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "router_aux_loss_add: total has dtype f32 but expected f64");
  }
}

TEST(Router, AuxLossFromStatisticsMatchesTheDirectFormula) {
  const int64_t n = 9, e = 6, k = 2;
  Buffer logits = random_buffer(DType::f64, {n, e}, 11, 2.0), probs(DType::f64, Device::cpu, {n, e}),
         idx(DType::i32, Device::cpu, {n, k}), w(DType::f64, Device::cpu, {n, k});
  router_forward(probs, idx, w, logits, true);
  double expected = 0;
  for (int64_t i = 0; i < e; ++i) {
    double count = 0, prob_sum = 0;
    for (int64_t c = 0; c < n * k; ++c) count += idx.ptr<int32_t>()[c] == i;
    for (int64_t t = 0; t < n; ++t) prob_sum += probs.ptr<double>()[t * e + i];
    expected += count / n * (prob_sum / n);
  }
  expected *= e;
  EXPECT_NEAR(aux_loss_of(probs, idx), expected, 1e-14 * expected);
}

TEST(Router, TopKOfAllExpertsGivesAuxLossKForAnyLogits) {
  // k = E: every expert gets every token (f_e = 1) and the P_e sum to 1, so the loss is E = K.
  const int64_t n = 3, e = 5;
  Buffer logits = random_buffer(DType::f64, {n, e}, 7), probs(DType::f64, Device::cpu, {n, e}),
         idx(DType::i32, Device::cpu, {n, e}), w(DType::f64, Device::cpu, {n, e});
  router_forward(probs, idx, w, logits, true);
  EXPECT_NEAR(aux_loss_of(probs, idx), double(e), 1e-12);
  for (int64_t i = 0; i < n * e; ++i)
    EXPECT_NEAR(w.ptr<double>()[i], probs.ptr<double>()[(i / e) * e + idx.ptr<int32_t>()[i]], 1e-15);
}

// d/dlogits of sum(r * topk_weight) + aux_grad * aux_loss, against central differences. The
// cases cover a single token, k = E and an expert with no tokens (the last one, when k < E).
TEST(Router, GradientsMatchFiniteDifferences) {
  struct Case {
    int64_t n, e, k;
  };
  for (Case c : {Case{5, 8, 2}, Case{1, 8, 3}, Case{3, 4, 4}})
    for (bool normalize : {false, true})
      for (double aux_grad : {0.0, 0.7}) {
        SCOPED_TRACE(::testing::Message() << "n=" << c.n << " e=" << c.e << " k=" << c.k << " normalize=" << normalize
                                          << " aux_grad=" << aux_grad);
        Buffer logits = separated_logits(DType::f64, c.n, c.e, 1), r = random_buffer(DType::f64, {c.n, c.k}, 2);
        Buffer probs(DType::f64, Device::cpu, {c.n, c.e}), idx(DType::i32, Device::cpu, {c.n, c.k}),
            w(DType::f64, Device::cpu, {c.n, c.k}), stats(DType::f64, Device::cpu, {2 * c.e + 1}),
            dlogits(DType::f64, Device::cpu, {c.n, c.e});
        auto loss = [&] {
          router_forward(probs, idx, w, logits, normalize);
          router_statistics(stats, probs, idx);
          return testing::weighted_sum(w, r) + aux_grad * router_aux_loss(stats);
        };
        loss();
        router_backward(dlogits, r, probs, idx, w, normalize, aux_grad, stats);
        testing::expect_gradient("dlogits", logits, dlogits, loss);
      }
}

// The aux loss alone, differentiated through probs -> logits with the top-k choice held fixed.
TEST(Router, AuxLossGradientMatchesFiniteDifferences) {
  const int64_t n = 6, e = 8, k = 2;
  const double aux_grad = 1.3;
  Buffer logits = separated_logits(DType::f64, n, e, 3), probs(DType::f64, Device::cpu, {n, e}),
         idx(DType::i32, Device::cpu, {n, k}), scratch_idx(DType::i32, Device::cpu, {n, k}), w(DType::f64, Device::cpu, {n, k}),
         stats(DType::f64, Device::cpu, {2 * e + 1}), dlogits(DType::f64, Device::cpu, {n, e}),
         no_weight_grad = Buffer::zeros(DType::f64, Device::cpu, {n, k});
  router_forward(probs, idx, w, logits, true);
  auto loss = [&] {
    router_forward(probs, scratch_idx, w, logits, true);
    router_statistics(stats, probs, idx);
    return aux_grad * router_aux_loss(stats);
  };
  loss();
  router_backward(dlogits, no_weight_grad, probs, idx, w, true, aux_grad, stats);
  testing::expect_gradient("dlogits", logits, dlogits, loss);
}

// Data parallelism: two processes route the two parts of one batch (split unevenly) and sum their
// statistics. The aux loss and each part's dlogits must equal the whole batch's.
TEST(Router, StatisticsSummedOverPartsGiveTheWholeBatchLossAndGradient) {
  const int64_t n = 10, e = 8, k = 3, split = 4;
  const double aux_grad = 0.9;
  Buffer logits = random_buffer(DType::f64, {n, e}, 12, 2.0), r = random_buffer(DType::f64, {n, k}, 13);
  Buffer probs(DType::f64, Device::cpu, {n, e}), idx(DType::i32, Device::cpu, {n, k}), w(DType::f64, Device::cpu, {n, k}),
      stats(DType::f64, Device::cpu, {2 * e + 1}), dlogits(DType::f64, Device::cpu, {n, e});
  router_forward(probs, idx, w, logits, true);
  router_statistics(stats, probs, idx);
  router_backward(dlogits, r, probs, idx, w, true, aux_grad, stats);

  Buffer part_stats[2] = {Buffer(DType::f64, Device::cpu, {2 * e + 1}), Buffer(DType::f64, Device::cpu, {2 * e + 1})};
  const int64_t begin[2] = {0, split}, end[2] = {split, n};
  for (int p = 0; p < 2; ++p) router_statistics(part_stats[p], probs.view().rows(begin[p], end[p]), idx.view().rows(begin[p], end[p]));
  Buffer summed(DType::f64, Device::cpu, {2 * e + 1});
  for (int64_t i = 0; i < 2 * e + 1; ++i) summed.ptr<double>()[i] = part_stats[0].ptr<double>()[i] + part_stats[1].ptr<double>()[i];
  for (int64_t i = 0; i < e; ++i) EXPECT_EQ(summed.ptr<double>()[i], stats.ptr<double>()[i]) << "count of expert " << i;
  EXPECT_EQ(summed.ptr<double>()[2 * e], double(n));
  const double whole = router_aux_loss(stats);
  EXPECT_NEAR(router_aux_loss(summed), whole, 1e-12 * whole);

  for (int p = 0; p < 2; ++p) {
    const int64_t rows = end[p] - begin[p];
    Buffer part_dlogits(DType::f64, Device::cpu, {rows, e});
    router_backward(part_dlogits, r.view().rows(begin[p], end[p]), probs.view().rows(begin[p], end[p]),
                    idx.view().rows(begin[p], end[p]), w.view().rows(begin[p], end[p]), true, aux_grad, summed);
    for (int64_t i = 0; i < rows * e; ++i) {
      const double expected = dlogits.ptr<double>()[begin[p] * e + i];
      EXPECT_NEAR(part_dlogits.ptr<double>()[i], expected, 1e-12 * std::abs(expected)) << "part " << p << " element " << i;
    }
  }
}

TEST(Router, F32PathMatchesF64) {
  const int64_t n = 7, e = 8, k = 3;
  std::vector<Buffer> out[2];
  double aux[2];
  for (DType dtype : {DType::f64, DType::f32}) {
    Buffer logits = separated_logits(dtype, n, e, 4), r = random_buffer(dtype, {n, k}, 5);
    Buffer probs(dtype, Device::cpu, {n, e}), idx(DType::i32, Device::cpu, {n, k}), w(dtype, Device::cpu, {n, k}),
        stats(dtype, Device::cpu, {2 * e + 1}), dlogits(dtype, Device::cpu, {n, e});
    router_forward(probs, idx, w, logits, true);
    router_statistics(stats, probs, idx);
    aux[dtype == DType::f32] = router_aux_loss(stats);
    router_backward(dlogits, r, probs, idx, w, true, 0.3, stats);
    auto& o = out[dtype == DType::f32];
    o.push_back(std::move(probs));
    o.push_back(std::move(w));
    o.push_back(std::move(stats));
    o.push_back(std::move(dlogits));
    o.push_back(std::move(idx));
  }
  for (size_t b = 0; b + 1 < out[0].size(); ++b)
    for (int64_t i = 0; i < out[0][b].numel(); ++i)
      EXPECT_NEAR(testing::element(out[1][b], i), testing::element(out[0][b], i), 1e-6) << "output " << b << " element " << i;
  for (int64_t i = 0; i < n * k; ++i) EXPECT_EQ(out[1].back().ptr<int32_t>()[i], out[0].back().ptr<int32_t>()[i]);
  EXPECT_NEAR(aux[1], aux[0], 1e-6);
}

TEST(Router, RejectsKAboveExpertCount) {
  Buffer logits(DType::f32, Device::cpu, {2, 4}), probs(DType::f32, Device::cpu, {2, 4}), idx(DType::i32, Device::cpu, {2, 5}),
      w(DType::f32, Device::cpu, {2, 5});
  try {
    router_forward(probs, idx, w, logits, true);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "router_forward: k = 5 must be between 1 and the number of experts 4");
  }
}

TEST(Router, RejectsExpertIndexOutsideRange) {
  float probs[8] = {}, stats[9];
  int32_t idx[4] = {0, 1, 4, 2};
  try {
    router_statistics(host(stats, DType::f32, {9}), host(probs, DType::f32, {2, 4}), host(idx, DType::i32, {2, 2}));
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "router_statistics: topk_index[1, 0] = 4 is outside [0, 4)");
  }
}

TEST(Router, BackwardRejectsStatisticsOfFewerTokens) {
  float probs[8] = {}, dlogits[8], g[4] = {}, w[4] = {}, stats[9] = {};
  int32_t idx[4] = {0, 1, 2, 3};
  stats[8] = 1;
  try {
    router_backward(host(dlogits, DType::f32, {2, 4}), host(g, DType::f32, {2, 2}), host(probs, DType::f32, {2, 4}),
                    host(idx, DType::i32, {2, 2}), host(w, DType::f32, {2, 2}), true, 1.0, host(stats, DType::f32, {9}));
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "router_backward: stats counts 1 tokens, fewer than the 2 rows of probs");
  }
}

}  // namespace
}  // namespace marrow
