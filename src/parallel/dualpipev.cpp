#include "parallel/dualpipev.h"

#include <algorithm>
#include <deque>
#include <limits>

#include <fmt/format.h>

#include "core/errors.h"

namespace marrow {

int64_t PipelineChunk::layers(int64_t num_layers) const {
  return std::min(last, num_layers - 1) - std::max(first, int64_t(0)) + 1;
}

std::vector<PipelineChunk> pipeline_chunks(int64_t num_layers, int64_t pp) {
  const int64_t chunks = 2 * pp;
  MARROW_CHECK(num_layers >= chunks, "parallel.pp = {} cuts the model into {} pipeline chunks but it has only {} decoder layers", pp,
               chunks, num_layers);
  std::vector<int64_t> layers(size_t(chunks), num_layers / chunks);
  int64_t extra = num_layers % chunks;
  // Interior chunks from the middle outwards, then the embedding's chunk (the LM head's is heaviest).
  std::vector<int64_t> order;
  for (int64_t d = 0; d < pp - 1; ++d) {
    order.push_back(pp - 1 - d);
    order.push_back(pp + d);
  }
  order.push_back(0);
  for (size_t i = 0; extra > 0; ++i, --extra) ++layers[size_t(order[i])];
  return pipeline_chunks(layers);
}

std::vector<PipelineChunk> pipeline_chunks(const std::vector<int64_t>& layers) {
  std::vector<PipelineChunk> out;
  int64_t next = 0;
  for (size_t c = 0; c < layers.size(); ++c) {
    MARROW_CHECK(layers[c] >= 1, "internal: pipeline chunk {} would hold {} decoder layers", c, layers[c]);
    PipelineChunk chunk{next, next + layers[c] - 1};
    next = chunk.last + 1;
    if (c == 0) chunk.first = -1;
    if (c + 1 == layers.size()) chunk.last = next;
    out.push_back(chunk);
  }
  return out;
}

std::vector<int64_t> chunk_layer_counts(const std::vector<PipelineChunk>& chunks, int64_t num_layers) {
  std::vector<int64_t> out;
  for (const PipelineChunk& c : chunks) out.push_back(c.layers(num_layers));
  return out;
}

std::vector<ChunkCost> chunk_costs(const std::vector<PipelineChunk>& chunks, const std::vector<ChunkCost>& stage_cost) {
  std::vector<ChunkCost> out;
  for (const PipelineChunk& c : chunks) {
    ChunkCost sum{0, 0, 0};
    for (int64_t stage = c.first; stage <= c.last; ++stage) {
      const ChunkCost& k = stage_cost.at(size_t(stage + 1));
      sum = {sum.forward + k.forward, sum.backward + k.backward, sum.weights + k.weights};
    }
    out.push_back(sum);
  }
  return out;
}

std::vector<int64_t> balanced_chunk_layers(int64_t pp, int64_t micro_batches, const std::vector<ChunkCost>& stage_cost) {
  const int64_t num_layers = int64_t(stage_cost.size()) - 2;
  auto step_time = [&](const std::vector<int64_t>& layers) {
    return simulate_dualpipev(pp, micro_batches, chunk_costs(pipeline_chunks(layers), stage_cost)).makespan;
  };
  std::vector<int64_t> best = chunk_layer_counts(pipeline_chunks(num_layers, pp), num_layers);
  double best_time = step_time(best);
  for (bool moved = true; moved;) {
    moved = false;
    std::vector<int64_t> round_best = best;
    for (size_t from = 0; from < best.size(); ++from)
      for (size_t to = 0; to < best.size(); ++to) {
        if (from == to || best[from] == 1) continue;
        std::vector<int64_t> trial = best;
        --trial[from];
        ++trial[to];
        // A relative margin, so that rounding in the sums never makes two equal steps differ.
        if (const double t = step_time(trial); t < best_time * (1 - 1e-9)) {
          best_time = t;
          round_best = trial;
          moved = true;
        }
      }
    best = round_best;
  }
  return best;
}

std::vector<PipelineChunk> chosen_pipeline_chunks(const std::string& pp_layers, int64_t num_layers, int64_t pp, int64_t micro_batches,
                                                  const std::vector<ChunkCost>& stage_cost) {
  if (pp_layers == "even") return pipeline_chunks(num_layers, pp);
  if (pp_layers == "auto") {
    pipeline_chunks(num_layers, pp);  // the one-sentence refusal of too few layers
    return pipeline_chunks(balanced_chunk_layers(pp, micro_batches, stage_cost));
  }
  std::vector<int64_t> layers;
  for (size_t start = 0; start <= pp_layers.size();) {
    const size_t comma = std::min(pp_layers.find(',', start), pp_layers.size());
    const std::string item = pp_layers.substr(start, comma - start);
    MARROW_CHECK(!item.empty() && item.find_first_not_of("0123456789") == std::string::npos && item.size() <= 9 && std::stoll(item) >= 1,
                 "parallel.pp_layers must be auto, even or a comma-separated list of layer counts of at least 1, got '{}'", pp_layers);
    layers.push_back(std::stoll(item));
    start = comma + 1;
  }
  int64_t sum = 0;
  for (int64_t n : layers) sum += n;
  MARROW_CHECK(int64_t(layers.size()) == 2 * pp && sum == num_layers,
               "parallel.pp_layers = '{}' gives {} chunks of {} layers in all; parallel.pp = {} needs {} chunks and the model has {} decoder layers",
               pp_layers, layers.size(), sum, pp, 2 * pp, num_layers);
  return pipeline_chunks(layers);
}

std::vector<int64_t> held_stage_chunks(const std::vector<PipelineChunk>& chunks, int64_t num_layers, int64_t rank) {
  std::vector<int64_t> held(size_t(num_layers + 2), -1);
  const int64_t pp = int64_t(chunks.size()) / 2;
  for (int64_t c : {rank, 2 * pp - 1 - rank})
    for (int64_t stage = chunks[size_t(c)].first; stage <= chunks[size_t(c)].last; ++stage) held[size_t(stage + 1)] = c;
  return held;
}

namespace {

// Hands out micro-batch numbers in order per phase, and the deferred backwards in the order a W
// completes them.
struct OrderBuilder {
  std::vector<PipelineOp> ops;
  int64_t next_forward[2] = {0, 0}, next_backward[2] = {0, 0};
  std::deque<PipelineOp> deferred;

  void F(int phase) { ops.push_back({PipelineOp::forward, phase, next_forward[phase]++}); }
  void B(int phase, bool defer = false) {
    PipelineOp op{PipelineOp::backward, phase, next_backward[phase]++};
    op.defer_weights = defer;
    if (defer) deferred.push_back(op);
    ops.push_back(op);
  }
  void W() {
    MARROW_CHECK(!deferred.empty(), "internal: a DualPipeV weights op with no deferred backward");
    ops.push_back({PipelineOp::weights, deferred.front().phase, deferred.front().micro});
    deferred.pop_front();
  }
  // The forward of phase f overlapped with the backward of the other phase.
  void FB(int f) {
    PipelineOp op{PipelineOp::forward_backward, f, next_forward[f]++};
    op.back_micro = next_backward[1 - f]++;
    ops.push_back(op);
  }
};

}  // namespace

std::vector<PipelineOp> dualpipev_order(int64_t pp, int64_t rank, int64_t micro_batches) {
  MARROW_CHECK(micro_batches >= 2 * pp, "DualPipeV needs at least 2 x parallel.pp = {} micro-batches per step on each pipeline, got {}",
               2 * pp, micro_batches);
  const int64_t P = pp, r = rank, N = micro_batches;
  OrderBuilder o;
  // 1. Warm-up: the ranks further down the V start first, so phase 0 fills the pipeline.
  for (int64_t i = 0; i < 2 * (P - r - 1); ++i) o.F(0);
  // 2. Forward pairs: phase 1 forwards start as the turn of the V reaches this rank.
  for (int64_t i = 0; i < r + 1; ++i) {
    o.F(0);
    o.F(1);
  }
  // 3. The first phase 1 backwards, their expert weight gradients deferred to the W that follows.
  for (int64_t i = 0; i < P - r - 1; ++i) {
    o.B(1, true);
    o.W();
    o.F(1);
  }
  // 4. Main loop: each forward overlaps a backward of the other chunk. The last rank's first pair
  // runs apart: its phase 1 forward waits for this very phase 0 forward.
  for (int64_t i = 0; i < N - 2 * P + r + 1; ++i) {
    if (i == 0 && r == P - 1) {
      o.F(0);
      o.B(1);
    } else {
      o.FB(0);
    }
    o.FB(1);
  }
  // 5. Phase 0 forwards run out; phase 1 backwards drain.
  for (int64_t i = 0; i < P - r - 1; ++i) {
    o.B(1);
    o.FB(1);
  }
  // 6. Backwards of both chunks; from the middle on, their weight gradients wait for step 7's gaps.
  bool defer = false;
  for (int64_t i = 0; i < r + 1; ++i) {
    if (i == (r + 1) / 2 && r % 2 == 1) defer = true;
    o.B(1, defer);
    if (i == (r + 1) / 2 && r % 2 == 0) defer = true;
    o.B(0, defer);
  }
  // 7. The last phase 0 backwards, each after a deferred W while its gradient travels.
  for (int64_t i = 0; i < P - r - 1; ++i) {
    o.W();
    o.B(0, true);
  }
  // 8. The remaining deferred weight gradients.
  for (int64_t i = 0; i < r + 1; ++i) o.W();
  MARROW_CHECK(o.deferred.empty(), "internal: DualPipeV left {} deferred backwards without a W", o.deferred.size());
  return o.ops;
}

std::string describe_order(const std::vector<PipelineOp>& order) {
  std::string out;
  for (const PipelineOp& op : order) {
    if (!out.empty()) out += ' ';
    switch (op.kind) {
      case PipelineOp::forward: out += fmt::format("F{}.{}", op.phase, op.micro); break;
      case PipelineOp::backward: out += fmt::format("B{}.{}{}", op.phase, op.micro, op.defer_weights ? "w" : ""); break;
      case PipelineOp::weights: out += fmt::format("W{}.{}", op.phase, op.micro); break;
      case PipelineOp::forward_backward: out += fmt::format("FB{}.{}/{}.{}", op.phase, op.micro, 1 - op.phase, op.back_micro); break;
    }
  }
  return out;
}

double PipelineSimulation::bubble() const {
  double busy_sum = 0;
  for (double b : busy) busy_sum += b;
  return makespan > 0 ? 1 - busy_sum / (double(busy.size()) * makespan) : 0;
}

namespace {

constexpr double kNotYet = std::numeric_limits<double>::infinity();

// When each (chunk, micro-batch)'s forward output and backward input gradient exist.
struct Done {
  int64_t micro_batches;
  std::vector<double> forward, backward;  // [chunk * N + micro]
  Done(int64_t chunks, int64_t n) : micro_batches(n), forward(size_t(chunks * n), kNotYet), backward(size_t(chunks * n), kNotYet) {}
  double& f(int64_t c, int64_t i) { return forward[size_t(c * micro_batches + i)]; }
  double& b(int64_t c, int64_t i) { return backward[size_t(c * micro_batches + i)]; }
};

struct Simulator {
  int64_t P, N;
  const std::vector<ChunkCost>& cost;
  double hop;
  Done done;

  int64_t chunk(int64_t rank, int phase) const { return phase == 0 ? rank : 2 * P - 1 - rank; }
  int64_t rank_of(int64_t c) const { return c < P ? c : 2 * P - 1 - c; }
  // When the input of chunk c's forward (backward) of micro-batch i is here, or kNotYet.
  double forward_ready(int64_t c, int64_t i) {
    if (c == 0) return 0;
    const double t = done.f(c - 1, i);
    return t + (rank_of(c - 1) != rank_of(c) ? hop : 0);
  }
  double backward_ready(int64_t c, int64_t i) {
    const double own = done.f(c, i);
    if (c == 2 * P - 1) return own;
    const double t = done.b(c + 1, i) + (rank_of(c + 1) != rank_of(c) ? hop : 0);
    return std::max(own, t);
  }
  // Returns the op's (ready time, duration); ready is kNotYet while an input is missing.
  std::pair<double, double> need(int64_t rank, const PipelineOp& op) {
    const int64_t c = chunk(rank, op.phase), cb = chunk(rank, 1 - op.phase);
    const ChunkCost& k = cost[size_t(c)];
    switch (op.kind) {
      case PipelineOp::forward: return {forward_ready(c, op.micro), k.forward};
      case PipelineOp::backward: return {backward_ready(c, op.micro), k.backward + (op.defer_weights ? 0 : k.weights)};
      case PipelineOp::weights: return {done.b(c, op.micro), k.weights};
      case PipelineOp::forward_backward: {
        const ChunkCost& kb = cost[size_t(cb)];
        return {std::max(forward_ready(c, op.micro), backward_ready(cb, op.back_micro)), k.forward + kb.backward + kb.weights};
      }
    }
    return {kNotYet, 0};
  }
  void finish(int64_t rank, const PipelineOp& op, double end) {
    if (op.kind == PipelineOp::forward || op.kind == PipelineOp::forward_backward) done.f(chunk(rank, op.phase), op.micro) = end;
    if (op.kind == PipelineOp::backward) done.b(chunk(rank, op.phase), op.micro) = end;
    if (op.kind == PipelineOp::forward_backward) done.b(chunk(rank, 1 - op.phase), op.back_micro) = end;
  }
};

// Live activations after the op: +1 per forward, -1 per backward (or its W when deferred).
int64_t live_change(const PipelineOp& op) {
  switch (op.kind) {
    case PipelineOp::forward: return 1;
    case PipelineOp::backward: return op.defer_weights ? 0 : -1;
    case PipelineOp::weights: return -1;
    case PipelineOp::forward_backward: return 0;
  }
  return 0;
}

}  // namespace

PipelineSimulation simulate_dualpipev(int64_t pp, int64_t micro_batches, const std::vector<ChunkCost>& cost, double hop) {
  MARROW_CHECK(int64_t(cost.size()) == 2 * pp, "internal: {} chunk costs for {} pipeline ranks", cost.size(), pp);
  Simulator sim{pp, micro_batches, cost, hop, Done(2 * pp, micro_batches)};
  std::vector<std::vector<PipelineOp>> orders;
  for (int64_t r = 0; r < pp; ++r) orders.push_back(dualpipev_order(pp, r, micro_batches));
  PipelineSimulation out;
  out.busy.assign(size_t(pp), 0);
  out.peak_live.assign(size_t(pp), 0);
  out.start.resize(size_t(pp));
  out.end.resize(size_t(pp));
  std::vector<size_t> next(size_t(pp), 0);
  std::vector<double> free(size_t(pp), 0);
  std::vector<int64_t> live(size_t(pp), 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (int64_t r = 0; r < pp; ++r)
      while (next[size_t(r)] < orders[size_t(r)].size()) {
        const PipelineOp& op = orders[size_t(r)][next[size_t(r)]];
        const auto [ready, duration] = sim.need(r, op);
        if (ready == kNotYet) break;
        const double start = std::max(ready, free[size_t(r)]);
        out.start[size_t(r)].push_back(start);
        free[size_t(r)] = start + duration;
        out.end[size_t(r)].push_back(start + duration);
        out.busy[size_t(r)] += duration;
        sim.finish(r, op, free[size_t(r)]);
        // A forward-backward pair holds the new activations before it frees the old ones.
        const int64_t high = live[size_t(r)] + (op.kind == PipelineOp::forward_backward ? 1 : std::max<int64_t>(live_change(op), 0));
        out.peak_live[size_t(r)] = std::max(out.peak_live[size_t(r)], high);
        live[size_t(r)] += live_change(op);
        ++next[size_t(r)];
        progress = true;
      }
  }
  for (int64_t r = 0; r < pp; ++r) {
    MARROW_CHECK(next[size_t(r)] == orders[size_t(r)].size(), "internal: the DualPipeV orders deadlock: pipeline rank {} stops at its op {} ({})",
                 r, next[size_t(r)], describe_order({orders[size_t(r)][next[size_t(r)]]}));
    out.makespan = std::max(out.makespan, free[size_t(r)]);
  }
  return out;
}

std::string draw_timeline(int64_t pp, int64_t micro_batches, const PipelineSimulation& sim, double columns) {
  std::string out;
  for (int64_t r = 0; r < pp; ++r) {
    const std::vector<PipelineOp> order = dualpipev_order(pp, r, micro_batches);
    std::string line = fmt::format("rank {} |", r);
    const size_t origin = line.size();
    for (size_t i = 0; i < order.size(); ++i) {
      const size_t from = origin + size_t(sim.start[size_t(r)][i] * columns + 0.5), to = origin + size_t(sim.end[size_t(r)][i] * columns + 0.5);
      line.resize(std::max(line.size(), from), ' ');
      std::string cell = describe_order({order[i]});
      cell.resize(std::max(cell.size(), to - from), '=');
      line += cell;
    }
    line.resize(std::max(line.size(), origin + size_t(sim.makespan * columns + 0.5)), ' ');
    out += line + "|\n";
  }
  return out;
}

}  // namespace marrow
