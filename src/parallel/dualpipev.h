// DualPipeV (DeepSeek's DualPipe folded into a V; the pipeline PithTrain runs): the layer
// partition, each rank's order of work for one step, and a simulator of that order.
//
// The model's stages (-1 the prolog, 0..L-1 the decoder layers, L the epilog) are cut into 2 x PP
// chunks of consecutive stages, placed in a V: pipeline rank r holds chunk r (its phase 0) and
// chunk 2 PP - 1 - r (its phase 1). A micro-batch's forward runs down the ranks through phase 0,
// turns on the last rank (chunk PP - 1 hands over to chunk PP without leaving it) and comes back up
// through phase 1, so rank 0 holds both the embedding (chunk 0) and the LM head (chunk 2 PP - 1).
// Its backward retraces the path in reverse.
//
// Each rank runs N micro-batches (N >= 2 PP) through both of its chunks in the order
// dualpipev_order() gives: warm-up forwards, then pairs in which one micro-batch's forward of one
// chunk overlaps another's backward of the other chunk, then cool-down backwards; some backwards
// compute only input gradients and leave their expert weight gradients to a later W (zero bubble),
// which fills a slot where the rank would otherwise wait. Within each chunk, forwards, backwards
// and Ws take the micro-batches in order 0, 1, ..., N - 1, so every point-to-point link carries
// each kind of message in micro-batch order.
//
// This file knows no model: stages are numbers, costs are numbers.
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

// The 2 x pp chunks of a model of num_layers decoder layers: layers split as evenly as possible,
// the remainder going to the interior chunks first so the ends (embedding, LM head) are lighter.
// One sentence when num_layers < 2 x pp.
std::vector<PipelineChunk> pipeline_chunks(int64_t num_layers, int64_t pp);
// The chunks holding layers[c] decoder layers each, in order (the prolog in the first, the epilog
// in the last); every count at least 1.
std::vector<PipelineChunk> pipeline_chunks(const std::vector<int64_t>& layers);
std::vector<int64_t> chunk_layer_counts(const std::vector<PipelineChunk>& chunks, int64_t num_layers);

// The chunk holding each stage (index stage + 1) that pipeline rank `rank` holds, -1 for the
// stages of the other ranks.
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

// "F0.0 B1.0w W FB1.3/0.1 ...": the order as one line (F forward, B backward with w when its
// weights are deferred, W weights, FB<phase>.<micro>/<phase>.<micro> a forward overlapped with a
// backward). What `marrow estimate` prints and what the trainer prints with parallel.print_schedule.
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

// Layers per chunk (2 x pp counts) for which the simulated step of `micro_batches` is shortest, for
// stage costs as chunk_costs takes them. A local search from the even split: each round moves one
// layer from one chunk to another (every pair tried, counts staying >= 1) where that shortens the
// simulated step most, until no move does. A pure function of its arguments, so every rank and
// `marrow estimate` find the same partition. Why not the even split: the LM head's chunk and the
// embedding's are on pipeline rank 0, and the head alone costs about 2.5 decoder layers of the
// bench model (docs/performance.md), so rank 1 idles a fifth of the step with equal layers.
std::vector<int64_t> balanced_chunk_layers(int64_t pp, int64_t micro_batches, const std::vector<ChunkCost>& stage_cost);

// The partition parallel.pp_layers asks for: "auto" (balanced_chunk_layers), "even"
// (pipeline_chunks(num_layers, pp)) or a comma-separated list of 2 x pp layer counts that sum to
// num_layers. One sentence for a list that does not fit the model or the pipeline.
std::vector<PipelineChunk> chosen_pipeline_chunks(const std::string& pp_layers, int64_t num_layers, int64_t pp, int64_t micro_batches,
                                                  const std::vector<ChunkCost>& stage_cost);

// Runs every rank's dualpipev_order on an ideal machine: an op starts when its rank is free and the
// activations or gradients it consumes exist (plus `hop` for one crossing a rank boundary); a
// forward and backward pair costs the sum of both. cost[c] is chunk c's. One sentence if the orders
// deadlock (a schedule bug).
PipelineSimulation simulate_dualpipev(int64_t pp, int64_t micro_batches, const std::vector<ChunkCost>& cost, double hop = 0);

// The simulation as text, one line per rank, `columns` characters per unit of time: each op is its
// label ("FB1.2/0.0" etc.) padded with '=' to its length, idle time is blank.
std::string draw_timeline(int64_t pp, int64_t micro_batches, const PipelineSimulation& sim, double columns);

}  // namespace marrow
