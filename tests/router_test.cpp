#include "ops/router.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

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

// DeepSeek's routing options: routed_scaling_factor, norm_topk_prob, n_group and topk_group.
RouterOptions deepseek(bool normalize, double scale, int64_t groups, int64_t top_groups) {
  RouterOptions o;
  o.normalize = normalize;
  o.scale = scale;
  o.groups = groups;
  o.top_groups = top_groups;
  return o;
}

template <class Call>
void expect_error(const Call& call, const char* message) {
  try {
    call();
    FAIL() << "expected an error: " << message;
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), message);
  }
}

TEST(RouterOptions, ScaleMultipliesTheWeightsAfterTheNormalisation) {
  // softmax(log [1, 2, 3, 4]) = [0.1, 0.2, 0.3, 0.4]
  double logits[4] = {0, std::log(2.0), std::log(3.0), std::log(4.0)}, probs[4], w[2];
  int32_t idx[2];
  for (bool normalize : {false, true}) {
    router_forward(host(probs, DType::f64, {1, 4}), host(idx, DType::i32, {1, 2}), host(w, DType::f64, {1, 2}),
                   host(logits, DType::f64, {1, 4}), deepseek(normalize, 16.0, 1, 1));
    EXPECT_EQ(idx[0], 3);
    EXPECT_EQ(idx[1], 2);
    EXPECT_NEAR(w[0], normalize ? 16 * 4.0 / 7 : 16 * 0.4, 1e-14);
    EXPECT_NEAR(w[1], normalize ? 16 * 3.0 / 7 : 16 * 0.3, 1e-14);
  }
}

// transformers' group_limited_greedy written out: group scores, the top groups by (score, lower
// index), then the top K of the kept experts by (probability, lower index).
void route_directly(const double* p, int64_t e, int64_t k, const RouterOptions& o, std::vector<int32_t>& idx) {
  const int64_t size = e / o.groups;
  std::vector<int64_t> order(o.groups), experts;
  std::iota(order.begin(), order.end(), 0);
  auto score = [&](int64_t g) { return *std::max_element(p + g * size, p + (g + 1) * size); };
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return score(a) > score(b); });
  for (int64_t r = 0; r < o.top_groups; ++r)
    for (int64_t i = order[r] * size; i < (order[r] + 1) * size; ++i) experts.push_back(i);
  std::sort(experts.begin(), experts.end());
  std::stable_sort(experts.begin(), experts.end(), [&](int64_t a, int64_t b) { return p[a] > p[b]; });
  idx.assign(experts.begin(), experts.begin() + k);
}

TEST(RouterOptions, GroupLimitedSelectionMatchesADirectImplementation) {
  const int64_t n = 11, e = 16, k = 3;
  for (RouterOptions o : {deepseek(false, 2.5, 4, 2), deepseek(true, 1.0, 8, 3), deepseek(false, 1.0, 16, 5)}) {
    SCOPED_TRACE(::testing::Message() << "groups=" << o.groups << " top_groups=" << o.top_groups);
    Buffer logits = random_buffer(DType::f64, {n, e}, 21, 2.0), probs(DType::f64, Device::cpu, {n, e}), idx(DType::i32, Device::cpu, {n, k}),
           w(DType::f64, Device::cpu, {n, k});
    router_forward(probs, idx, w, logits, o);
    std::vector<int32_t> want;
    for (int64_t t = 0; t < n; ++t) {
      const double* p = probs.ptr<double>() + t * e;
      route_directly(p, e, k, o, want);
      double sum = 0;
      for (int64_t j = 0; j < k; ++j) sum += p[want[j]];
      for (int64_t j = 0; j < k; ++j) {
        ASSERT_EQ(idx.ptr<int32_t>()[t * k + j], want[j]) << "token " << t << " slot " << j;
        EXPECT_NEAR(w.ptr<double>()[t * k + j], p[want[j]] / (o.normalize ? sum : 1.0) * o.scale, 1e-15) << "token " << t << " slot " << j;
      }
    }
  }
}

// Groups of two: groups 1 and 2 tie at the highest score, so with one kept group the lower index
// wins, and expert 3 is chosen over the more probable 4 and 5 of the dropped group.
TEST(RouterOptions, GroupTiesGoToTheLowerGroupAndDroppedGroupsAreNeverChosen) {
  double logits[8] = {0, 0, 1, 0.5, 1, 0.8, 0, 0}, probs[8], w[2];
  int32_t idx[2];
  router_forward(host(probs, DType::f64, {1, 8}), host(idx, DType::i32, {1, 2}), host(w, DType::f64, {1, 2}),
                 host(logits, DType::f64, {1, 8}), deepseek(false, 1.0, 4, 1));
  EXPECT_EQ(idx[0], 2);
  EXPECT_EQ(idx[1], 3);
}

// With every group kept, the group-limited choice is greedy's: the bool overload's bits.
TEST(RouterOptions, AllGroupsKeptIsGreedy) {
  const int64_t n = 9, e = 16, k = 4;
  Buffer logits = random_buffer(DType::f32, {n, e}, 22, 2.0);
  Buffer p[2] = {Buffer(DType::f32, Device::cpu, {n, e}), Buffer(DType::f32, Device::cpu, {n, e})};
  Buffer idx[2] = {Buffer(DType::i32, Device::cpu, {n, k}), Buffer(DType::i32, Device::cpu, {n, k})};
  Buffer w[2] = {Buffer(DType::f32, Device::cpu, {n, k}), Buffer(DType::f32, Device::cpu, {n, k})};
  router_forward(p[0], idx[0], w[0], logits, true);
  router_forward(p[1], idx[1], w[1], logits, deepseek(true, 1.0, 4, 4));
  const Tensor outputs[3][2] = {{p[0], p[1]}, {idx[0], idx[1]}, {w[0], w[1]}};
  for (int b = 0; b < 3; ++b) EXPECT_EQ(std::memcmp(outputs[b][0].data, outputs[b][1].data, outputs[b][0].bytes()), 0) << "output " << b;
}

// Rows g of [G, 2E + 1] are router_statistics of the g-th run of tokens; the loss is the mean of
// the rows' losses; one row is router_statistics itself.
TEST(RouterOptions, GroupedStatisticsAreEachGroupsStatistics) {
  const int64_t n = 12, e = 8, k = 2, per = 4, g = n / per;
  Buffer logits = random_buffer(DType::f64, {n, e}, 23, 2.0), probs(DType::f64, Device::cpu, {n, e}), idx(DType::i32, Device::cpu, {n, k}),
         w(DType::f64, Device::cpu, {n, k}), stats(DType::f64, Device::cpu, {g, 2 * e + 1}), row(DType::f64, Device::cpu, {2 * e + 1});
  router_forward(probs, idx, w, logits, false);
  router_statistics_grouped(stats, probs, idx, per);
  double mean = 0;
  for (int64_t r = 0; r < g; ++r) {
    router_statistics(row, probs.view().rows(r * per, (r + 1) * per), idx.view().rows(r * per, (r + 1) * per));
    for (int64_t i = 0; i < 2 * e + 1; ++i) ASSERT_EQ(stats.ptr<double>()[r * (2 * e + 1) + i], row.ptr<double>()[i]) << "row " << r << " " << i;
    mean += router_aux_loss(row) / double(g);
  }
  EXPECT_NEAR(router_aux_loss(stats), mean, 1e-14 * mean);
  double total = 0.25;
  router_aux_loss_add(host(&total, DType::f64, {1}), stats);
  EXPECT_EQ(total, 0.25 + router_aux_loss(stats));

  Buffer one(DType::f64, Device::cpu, {1, 2 * e + 1}), whole(DType::f64, Device::cpu, {2 * e + 1});
  router_statistics_grouped(one, probs, idx, n);
  router_statistics(whole, probs, idx);
  for (int64_t i = 0; i < 2 * e + 1; ++i) ASSERT_EQ(one.ptr<double>()[i], whole.ptr<double>()[i]) << i;
  EXPECT_EQ(router_aux_loss(one), router_aux_loss(whole));
}

// d/dlogits of sum(r * topk_weight) + aux_grad * aux_loss with DeepSeek's options, the aux loss
// from one row of statistics or per sequence (G rows of T / G tokens).
TEST(RouterOptions, GradientsMatchFiniteDifferences) {
  const int64_t n = 6, e = 16;
  for (RouterOptions o : {deepseek(false, 16.0, 1, 1), deepseek(true, 2.5, 4, 2), deepseek(false, 1.0, 8, 3)})
    for (int64_t k : {int64_t(1), int64_t(3)})
      for (int64_t groups : {int64_t(1), int64_t(2), int64_t(3)}) {
        SCOPED_TRACE(::testing::Message() << "normalize=" << o.normalize << " scale=" << o.scale << " groups=" << o.groups << " k=" << k
                                          << " stats rows=" << groups);
        const double aux_grad = 0.7;
        Buffer logits = separated_logits(DType::f64, n, e, 24), r = random_buffer(DType::f64, {n, k}, 25);
        Buffer probs(DType::f64, Device::cpu, {n, e}), idx(DType::i32, Device::cpu, {n, k}), w(DType::f64, Device::cpu, {n, k}),
            stats(DType::f64, Device::cpu, {groups, 2 * e + 1}), dlogits(DType::f64, Device::cpu, {n, e});
        auto loss = [&] {
          router_forward(probs, idx, w, logits, o);
          router_statistics_grouped(stats, probs, idx, n / groups);
          return testing::weighted_sum(w, r) + aux_grad * router_aux_loss(stats);
        };
        loss();
        router_backward(dlogits, r, probs, idx, w, o, aux_grad, stats);
        testing::expect_gradient("dlogits", logits, dlogits, loss);
      }
}

// The rows (all columns) `rows` of t, in that order.
Buffer gather_rows(const Tensor& t, const std::vector<int64_t>& rows) {
  Buffer out(t.dtype, Device::cpu, {int64_t(rows.size()), t.numel() / t.size(0)});
  const size_t row_bytes = t.bytes() / size_t(t.size(0));
  for (size_t i = 0; i < rows.size(); ++i)
    std::memcpy(static_cast<char*>(out.view().data) + i * row_bytes, static_cast<const char*>(t.data) + size_t(rows[i]) * row_bytes, row_bytes);
  return out;
}

// Context parallelism: two sequences of 6 tokens, each split between two ranks (tokens 0-2 of each
// on rank 0, 3-5 on rank 1). Each rank's per-sequence rows summed give the sequences' statistics,
// their loss, and on each rank the whole batch's dlogits.
TEST(RouterOptions, PerSequenceStatisticsSummedOverRanksGiveTheSequencesLossAndGradient) {
  const int64_t sequences = 2, length = 6, n = sequences * length, e = 8, k = 3, width = 2 * e + 1;
  const double aux_grad = 0.9;
  const RouterOptions o = deepseek(false, 16.0, 4, 2);
  Buffer logits = random_buffer(DType::f64, {n, e}, 26, 2.0), r = random_buffer(DType::f64, {n, k}, 27);
  Buffer probs(DType::f64, Device::cpu, {n, e}), idx(DType::i32, Device::cpu, {n, k}), w(DType::f64, Device::cpu, {n, k}),
      stats(DType::f64, Device::cpu, {sequences, width}), dlogits(DType::f64, Device::cpu, {n, e});
  router_forward(probs, idx, w, logits, o);
  router_statistics_grouped(stats, probs, idx, length);
  router_backward(dlogits, r, probs, idx, w, o, aux_grad, stats);

  std::vector<int64_t> rank_rows[2];
  for (int64_t s = 0; s < sequences; ++s)
    for (int64_t t = 0; t < length; ++t) rank_rows[t < length / 2 ? 0 : 1].push_back(s * length + t);
  Buffer summed = Buffer::zeros(DType::f64, Device::cpu, {sequences, width}), part_stats(DType::f64, Device::cpu, {sequences, width});
  for (int rank = 0; rank < 2; ++rank) {
    router_statistics_grouped(part_stats, gather_rows(probs, rank_rows[rank]), gather_rows(idx, rank_rows[rank]), length / 2);
    for (int64_t i = 0; i < sequences * width; ++i) summed.ptr<double>()[i] += part_stats.ptr<double>()[i];
  }
  for (int64_t s = 0; s < sequences; ++s) {
    for (int64_t i = 0; i < e; ++i) EXPECT_EQ(summed.ptr<double>()[s * width + i], stats.ptr<double>()[s * width + i]) << s << " count " << i;
    EXPECT_EQ(summed.ptr<double>()[s * width + 2 * e], double(length));
  }
  const double whole = router_aux_loss(stats);
  EXPECT_NEAR(router_aux_loss(summed), whole, 1e-12 * whole);
  for (int rank = 0; rank < 2; ++rank) {
    const std::vector<int64_t>& rows = rank_rows[rank];
    Buffer part_dlogits(DType::f64, Device::cpu, {int64_t(rows.size()), e});
    router_backward(part_dlogits, gather_rows(r, rows), gather_rows(probs, rows), gather_rows(idx, rows), gather_rows(w, rows), o, aux_grad,
                    summed);
    for (size_t i = 0; i < rows.size(); ++i)
      for (int64_t x = 0; x < e; ++x) {
        const double expected = dlogits.ptr<double>()[rows[i] * e + x];
        EXPECT_NEAR(part_dlogits.ptr<double>()[i * e + x], expected, 1e-12 * (1 + std::abs(expected))) << "rank " << rank << " row " << i;
      }
  }
}

TEST(RouterOptions, RejectsGroupsThatDoNotFitAndStatisticsOfOtherRows) {
  Buffer logits(DType::f32, Device::cpu, {6, 8}), probs(DType::f32, Device::cpu, {6, 8}), idx(DType::i32, Device::cpu, {6, 3}),
      w(DType::f32, Device::cpu, {6, 3});
  expect_error([&] { router_forward(probs, idx, w, logits, deepseek(false, 1.0, 3, 1)); }, "router_forward: 8 experts do not split into 3 groups");
  expect_error([&] { router_forward(probs, idx, w, logits, deepseek(false, 1.0, 4, 1)); },
               "router_forward: k = 3 exceeds the 2 experts of the top 1 groups");
  expect_error([&] { router_forward(probs, idx, w, logits, deepseek(false, 1.0, 4, 5)); },
               "router_forward: top_groups = 5 must be between 1 and the 4 groups");
  Buffer stats(DType::f32, Device::cpu, {4, 17});
  expect_error([&] { router_statistics_grouped(stats, probs, idx, 4); },
               "router_statistics_grouped: tokens_per_group = 4 must be positive and divide the 6 tokens");
  expect_error([&] { router_backward(logits, w, probs, idx, w, deepseek(false, 1.0, 1, 1), 1.0, stats); },
               "router_backward: stats has 4 rows, which do not divide the 6 tokens of probs");
}

}  // namespace
}  // namespace marrow
