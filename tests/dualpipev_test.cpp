// DualPipeV's layer partition, per-rank orders and simulator (parallel/dualpipev.h).
#include "parallel/dualpipev.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <map>

#include "core/errors.h"

namespace marrow {
namespace {

std::vector<int64_t> layer_counts(int64_t layers, int64_t pp) {
  std::vector<int64_t> out;
  for (const PipelineChunk& c : pipeline_chunks(layers, pp)) out.push_back(c.layers(layers));
  return out;
}

TEST(DualPipeV, ChunksPutTheRemainderOnInteriorChunks) {
  EXPECT_EQ(layer_counts(16, 2), (std::vector<int64_t>{4, 4, 4, 4}));
  EXPECT_EQ(layer_counts(6, 2), (std::vector<int64_t>{1, 2, 2, 1}));
  EXPECT_EQ(layer_counts(7, 2), (std::vector<int64_t>{2, 2, 2, 1}));
  EXPECT_EQ(layer_counts(5, 1), (std::vector<int64_t>{3, 2}));
  EXPECT_EQ(layer_counts(11, 4), (std::vector<int64_t>{1, 1, 2, 2, 2, 1, 1, 1}));
  const std::vector<PipelineChunk> c = pipeline_chunks(6, 2);
  EXPECT_EQ(c[0].first, -1);  // the prolog
  EXPECT_EQ(c[0].last, 0);
  EXPECT_EQ(c[1].first, 1);
  EXPECT_EQ(c[3].first, 5);
  EXPECT_EQ(c[3].last, 6);  // the epilog
  EXPECT_THROW(pipeline_chunks(3, 2), Error);
}

TEST(DualPipeV, ChunksFromLayerCountsAndTheirCosts) {
  const std::vector<PipelineChunk> c = pipeline_chunks(std::vector<int64_t>{2, 1, 1, 3});
  ASSERT_EQ(c.size(), 4u);
  EXPECT_EQ(c[0].first, -1);
  EXPECT_EQ(c[0].last, 1);
  EXPECT_EQ(c[1].first, 2);
  EXPECT_EQ(c[2].first, 3);
  EXPECT_EQ(c[3].first, 4);
  EXPECT_EQ(c[3].last, 7);  // the epilog of 7 layers
  EXPECT_EQ(chunk_layer_counts(c, 7), (std::vector<int64_t>{2, 1, 1, 3}));
  // Stage costs -1 .. 7: the prolog 0.5, layer l costs l + 1 forward, the epilog 10.
  std::vector<ChunkCost> stage{{0.5, 0.5, 0}};
  for (int64_t l = 0; l < 7; ++l) stage.push_back({double(l + 1), 2.0 * double(l + 1), 1});
  stage.push_back({10, 20, 0});
  const std::vector<ChunkCost> cost = chunk_costs(c, stage);
  EXPECT_DOUBLE_EQ(cost[0].forward, 0.5 + 1 + 2);
  EXPECT_DOUBLE_EQ(cost[1].backward, 6);
  EXPECT_DOUBLE_EQ(cost[3].forward, 5 + 6 + 7 + 10);
  EXPECT_DOUBLE_EQ(cost[3].weights, 3);
}

// Stage costs of `layers` equal decoder layers (forward 1, backward 1, weights 1) between a free
// prolog and an epilog of `head` layers' work.
std::vector<ChunkCost> uniform_stages(int64_t layers, double head) {
  std::vector<ChunkCost> stage{{0, 0, 0}};
  for (int64_t l = 0; l < layers; ++l) stage.push_back({1, 1, 1});
  stage.push_back({head, 2 * head, 0});
  return stage;
}

TEST(DualPipeV, BalancedLayersMoveWorkOffTheLmHeadsRank) {
  for (int64_t n : {4, 8, 16}) {
    // Nothing at the ends: the even split is already the best the moves find.
    EXPECT_EQ(balanced_chunk_layers(2, n, uniform_stages(16, 0)), (std::vector<int64_t>{4, 4, 4, 4})) << n;
    // A head of 2.5 layers (the bench model's, docs/performance.md): rank 0 (chunks 0 and 3) gives
    // up layers and the simulated step is shorter than the even split's.
    const std::vector<ChunkCost> stage = uniform_stages(16, 2.5);
    const std::vector<int64_t> layers = balanced_chunk_layers(2, n, stage);
    EXPECT_LT(layers[0] + layers[3], 8) << n;
    EXPECT_EQ(layers[0] + layers[1] + layers[2] + layers[3], 16);
    const double even = simulate_dualpipev(2, n, chunk_costs(pipeline_chunks(16, 2), stage)).makespan;
    const double balanced = simulate_dualpipev(2, n, chunk_costs(pipeline_chunks(layers), stage)).makespan;
    EXPECT_LT(balanced, even * 0.97) << n;
  }
  // Each chunk keeps at least one layer however heavy the head.
  for (int64_t count : balanced_chunk_layers(2, 4, uniform_stages(4, 100))) EXPECT_GE(count, 1);
}

TEST(DualPipeV, PipelineLayersSettingChoosesTheChunks) {
  const std::vector<ChunkCost> stage = uniform_stages(16, 2.5);
  EXPECT_EQ(chunk_layer_counts(chosen_pipeline_chunks("even", 16, 2, 8, stage), 16), (std::vector<int64_t>{4, 4, 4, 4}));
  EXPECT_EQ(chunk_layer_counts(chosen_pipeline_chunks("auto", 16, 2, 8, stage), 16), balanced_chunk_layers(2, 8, stage));
  EXPECT_EQ(chunk_layer_counts(chosen_pipeline_chunks("3,5,5,3", 16, 2, 8, stage), 16), (std::vector<int64_t>{3, 5, 5, 3}));
  auto error = [&](const std::string& setting, int64_t pp) {
    try {
      chosen_pipeline_chunks(setting, 16, pp, 8, stage);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(error("3,5,5", 2),
            "parallel.pp_layers = '3,5,5' gives 3 chunks of 13 layers in all; parallel.pp = 2 needs 4 chunks and the model has 16 decoder layers");
  EXPECT_NE(error("3,5,5,4", 2).find("gives 4 chunks of 17 layers in all"), std::string::npos);
  EXPECT_NE(error("3,0,8,5", 2).find("must be auto, even or a comma-separated list"), std::string::npos);
  EXPECT_NE(error("auto", 9).find("cuts the model into 18 pipeline chunks but it has only 16 decoder layers"), std::string::npos);
}

TEST(DualPipeV, OnePipelineRankPairsTheTwoChunks) {
  EXPECT_EQ(describe_order(dualpipev_order(1, 0, 2)), "F0.0 F1.0 F0.1 B1.0 FB1.1/0.0 B1.1 B0.1w W0.1");
  EXPECT_EQ(describe_order(dualpipev_order(1, 0, 4)),
            "F0.0 F1.0 F0.1 B1.0 FB1.1/0.0 FB0.2/1.1 FB1.2/0.1 FB0.3/1.2 FB1.3/0.2 B1.3 B0.3w W0.3");
  // 2N - 3 of the 2N forwards run paired with a backward (the share of expert exchanges that can
  // hide; docs/performance.md): three forwards of the warm-up and three backwards of the cool-down not.
  for (int64_t n : {2, 8, 16, 17}) {
    const std::vector<PipelineOp> order = dualpipev_order(1, 0, n);
    EXPECT_EQ(std::count_if(order.begin(), order.end(), [](const PipelineOp& op) { return op.kind == PipelineOp::forward_backward; }),
              2 * n - 3)
        << n;
  }
}

// Every rank runs each (chunk, micro-batch) forward and backward once, in micro-batch order, and
// a W for each deferred backward after it.
TEST(DualPipeV, EveryOrderRunsEachMicroBatchOnceInOrder) {
  for (int64_t pp : {1, 2, 3, 4})
    for (int64_t n : {2 * pp, 2 * pp + 1, 3 * pp + 2})
      for (int64_t r = 0; r < pp; ++r) {
        std::map<int, std::vector<int64_t>> forwards, backwards;
        std::vector<std::pair<int, int64_t>> deferred, weighed;
        for (const PipelineOp& op : dualpipev_order(pp, r, n)) {
          if (op.kind == PipelineOp::forward || op.kind == PipelineOp::forward_backward) forwards[op.phase].push_back(op.micro);
          if (op.kind == PipelineOp::backward) backwards[op.phase].push_back(op.micro);
          if (op.kind == PipelineOp::forward_backward) backwards[1 - op.phase].push_back(op.back_micro);
          if (op.kind == PipelineOp::backward && op.defer_weights) deferred.push_back({op.phase, op.micro});
          if (op.kind == PipelineOp::weights) weighed.push_back({op.phase, op.micro});
        }
        std::vector<int64_t> all(static_cast<size_t>(n));
        for (int64_t i = 0; i < n; ++i) all[size_t(i)] = i;
        for (int phase : {0, 1}) {
          EXPECT_EQ(forwards[phase], all) << "pp " << pp << " rank " << r << " phase " << phase;
          EXPECT_EQ(backwards[phase], all) << "pp " << pp << " rank " << r << " phase " << phase;
        }
        EXPECT_EQ(deferred, weighed) << "pp " << pp << " rank " << r;
      }
}

TEST(DualPipeV, SimulationFinishesWithASmallBubble) {
  for (int64_t pp : {1, 2, 4}) {
    const int64_t n = 4 * pp;
    const PipelineSimulation sim = simulate_dualpipev(pp, n, std::vector<ChunkCost>(size_t(2 * pp)));
    // Per rank: 2n chunk forwards, backwards and weights of cost 1 each.
    for (double b : sim.busy) EXPECT_DOUBLE_EQ(b, 6.0 * double(n));
    // 1F1B on pp ranks with n micro-batches idles (pp - 1) / (n + pp - 1); the V with its W
    // slots idles less.
    EXPECT_LT(sim.bubble(), double(pp - 1) / double(n + pp - 1) + 1e-12) << "pp " << pp;
    EXPECT_GE(sim.bubble(), 0.0);
    for (int64_t live : sim.peak_live) EXPECT_LE(live, 2 * pp + 1);
  }
  EXPECT_DOUBLE_EQ(simulate_dualpipev(1, 2, std::vector<ChunkCost>(2)).bubble(), 0.0);
  EXPECT_THROW(dualpipev_order(2, 0, 3), Error);
}

// The timeline of docs/architecture.md (pp 2, 6 micro-batches, unit costs), printed by this test:
// every op in its place, each rank's line as long as the step, idle cells where the simulator says.
TEST(DualPipeV, TimelineDrawsEveryOpWhereTheSimulatorPutsIt) {
  const PipelineSimulation sim = simulate_dualpipev(2, 6, std::vector<ChunkCost>(4));
  const std::string picture = draw_timeline(2, 6, sim, 5);
  std::printf("%s", picture.c_str());
  const size_t first_line = picture.find('\n');
  const std::string rank0 = picture.substr(0, first_line), rank1 = picture.substr(first_line + 1, picture.size() - first_line - 2);
  EXPECT_EQ(rank0.size(), rank1.size());
  EXPECT_EQ(rank0.size(), std::string("rank 0 |").size() + size_t(sim.makespan * 5) + 1);
  for (int64_t r = 0; r < 2; ++r) {
    const std::string& line = r == 0 ? rank0 : rank1;
    for (const PipelineOp& op : dualpipev_order(2, r, 6)) EXPECT_NE(line.find(describe_order({op})), std::string::npos) << line;
    const double idle = double(std::count(line.begin() + line.find('|'), line.end(), ' ')) / 5;
    EXPECT_DOUBLE_EQ(idle, sim.makespan - sim.busy[size_t(r)]) << line;
  }
}

}  // namespace
}  // namespace marrow
