// DualPipeV (DeepSeek's DualPipe folded into a V; the pipeline PithTrain runs): the layer
// partition, each rank's order of work for one step, and a simulator of that order.
//
// The model's stages (-1 the prolog, 0..L-1 the decoder layers, L the epilog) are cut into 2 x PP
// chunks placed in a V: rank r holds chunk r (phase 0) and chunk 2 PP - 1 - r (phase 1). A forward
// runs down the ranks through phase 0, turns on the last rank and comes back up through phase 1, so
// rank 0 holds both the embedding and the LM head; the backward retraces the path.
// Each rank runs N >= 2 PP micro-batches in dualpipev_order(): warm-up forwards, then pairs in
// which one micro-batch's forward overlaps another's backward of the other chunk, then cool-down
// backwards; some backwards leave their expert weight gradients to a later W (zero bubble) that
// fills a slot where the rank would wait. Each chunk takes the micro-batches in order, so every
// link carries each kind of message in micro-batch order. Stages and costs are only numbers here.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace marrow {

// Stages [first, last] of one chunk (-1 is the prolog, num_layers the epilog).
struct PipelineChunk {
  int64_t first = 0, last = 0;
  int64_t layers(int64_t num_layers) const;  // decoder layers in it
};

// The 2 x pp chunks of num_layers decoder layers, split evenly, the remainder to the interior
// chunks first (the ends hold the embedding and LM head); one sentence when num_layers < 2 x pp.
std::vector<PipelineChunk> pipeline_chunks(int64_t num_layers, int64_t pp);
// The chunks holding layers[c] >= 1 decoder layers each (the prolog in the first, the epilog in the last).
std::vector<PipelineChunk> pipeline_chunks(const std::vector<int64_t>& layers);
std::vector<int64_t> chunk_layer_counts(const std::vector<PipelineChunk>& chunks, int64_t num_layers);

// The chunk of each stage (index stage + 1) pipeline rank `rank` holds, -1 for the other ranks' stages.
std::vector<int64_t> held_stage_chunks(const std::vector<PipelineChunk>& chunks, int64_t num_layers, int64_t rank);

// One unit of a rank's work. phase 0 is the rank's chunk r, phase 1 its chunk 2 PP - 1 - r.
struct PipelineOp {
  enum Kind { forward, backward, weights, forward_backward };
  Kind kind = forward;
  int phase = 0;            // forward, backward: the chunk; forward_backward: the forward's chunk
  int64_t micro = 0;        // forward, backward, weights: the micro-batch; forward_backward: the forward's
  int64_t back_micro = 0;   // forward_backward: the backward's micro-batch (its chunk is 1 - phase)
  bool defer_weights = false;  // backward: expert weight gradients wait for a later weights op
};

// Rank `rank` of `pp`'s order of work for one step of `micro_batches` (>= 2 x pp) micro-batches.
std::vector<PipelineOp> dualpipev_order(int64_t pp, int64_t rank, int64_t micro_batches);

// "F0.0 B1.0w W1.0 FB1.3/0.1 ...": the order as one line (w: weights deferred; FB: a forward
// overlapped with a backward), as `marrow estimate` and parallel.print_schedule print it.
std::string describe_order(const std::vector<PipelineOp>& order);

// Costs of one chunk's work, any unit (the estimate uses FLOPs).
struct ChunkCost {
  double forward = 1, backward = 1, weights = 1;  // backward: input gradients only
};

struct PipelineSimulation {
  double makespan = 0;
  std::vector<double> busy;               // per rank: time spent computing
  std::vector<int64_t> peak_live;         // per rank: most micro-batch chunks whose activations are alive at once
  double bubble() const;                  // 1 - sum(busy) / (ranks x makespan)
  std::vector<std::vector<double>> start, end;  // per rank, per op of its order
};

// Each chunk's cost: the sum of its stages' (stage_cost[stage + 1], stages -1 .. num_layers).
std::vector<ChunkCost> chunk_costs(const std::vector<PipelineChunk>& chunks, const std::vector<ChunkCost>& stage_cost);

// Layers per chunk for which the simulated step is shortest: a local search from the even split,
// each round making the one-layer move between two chunks that shortens it most. A pure function,
// so every rank and `marrow estimate` agree. Not the even split, because the LM head (about 2.5
// decoder layers of the bench model, docs/performance.md) and the embedding both sit on rank 0.
std::vector<int64_t> balanced_chunk_layers(int64_t pp, int64_t micro_batches, const std::vector<ChunkCost>& stage_cost);

// The partition parallel.pp_layers asks for: "auto" (balanced_chunk_layers), "even", or 2 x pp
// comma-separated layer counts summing to num_layers (one sentence for a list that does not fit).
std::vector<PipelineChunk> chosen_pipeline_chunks(const std::string& pp_layers, int64_t num_layers, int64_t pp, int64_t micro_batches,
                                                  const std::vector<ChunkCost>& stage_cost);

// Runs every rank's dualpipev_order on an ideal machine: an op starts when its rank is free and
// its inputs exist (plus `hop` across ranks); a pair costs the sum of both; cost[c] is chunk c's.
// One sentence if the orders deadlock (a schedule bug).
PipelineSimulation simulate_dualpipev(int64_t pp, int64_t micro_batches, const std::vector<ChunkCost>& cost, double hop = 0);

// The simulation as text, a line per rank, `columns` characters a unit of time: each op its label
// padded with '=' to its length, idle time blank.
std::string draw_timeline(int64_t pp, int64_t micro_batches, const PipelineSimulation& sim, double columns);

}  // namespace marrow
