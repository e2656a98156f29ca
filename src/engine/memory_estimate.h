// The memory bill of one training process, computed without a GPU (`marrow estimate`, and the
// trainer at start). Every figure is in bytes and follows the code that allocates it:
// - state: fp32 master weights, gradients and AdamW moments: this process's chunks of the shard
//   units (parallel/sharded_params.h; a unit of N elements over n processes has c = ceil(N / n)).
// - weights: the compute copies and whole fp32 gradients: units kept whole hold n*c elements, the
//   other decoder layers their working shard plus two slots per kind (dense, expert).
// - activations: one micro-batch at its peak moment, replaying engine/step.h's order with the
//   model's stage bytes (core/stage_bytes.h) and the engine's own buffers; with DualPipeV, the
//   chunks alive at the heaviest op of the pipeline rank with the largest bill.
// - runtime (GPU only): CUDA context, cuBLAS workspace and NCCL communicators, outside the
//   trainer's `peak` figure.
// Invariant: with n = 1 everywhere the state and weights items equal the trainer's arenas.
// pipeline_layout is computed by every rank and by marrow estimate on their own: it must stay a
// pure function of the run config and the model (no timing, no rank), or ranks disagree on who holds
// which layer. pipeline_stage_costs' rates are H200 measurements: re-derive them from a bench stage
// split when the step's balance changes a lot (docs/performance.md, "DualPipeV's layer partition").
// train.expert_inputs = auto is resolved once, against the device's memory, by
// gathers_expert_inputs_again: the trainer (TrainSetup::gathers_expert_inputs ->
// MicroBatch::gathers_expert_inputs) and marrow estimate (--gpu-memory) take the same decision, so
// the bill matches the run. A new activation kept only when memory allows follows that pattern (a
// setting, resolved here, set on the micro-batch). Either way gives the same bits
// (tools/gpu_inputs.sh on the GPU).
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/stage_bytes.h"
#include "core/tensor.h"
#include "core/tensor_spec.h"
#include "engine/model.h"
#include "engine/run_config.h"
#include "parallel/dualpipev.h"
#include "parallel/mesh.h"

namespace marrow {

enum class BillGroup { state, weights, activations, runtime };

struct BillItem {
  BillGroup group;
  std::string name;
  int64_t bytes = 0;
  std::string note;  // how the figure is made up
};

struct MemoryBill {
  std::vector<std::string> context;  // what was estimated: model, layout, micro-batch
  Device device = Device::cuda;
  std::vector<BillItem> items;
  std::string activation_peak_at;  // the moment of the micro-batch that the activation items describe
  int64_t bytes(BillGroup group) const;
  int64_t total() const;
  // What the trainer's `peak` figure counts: arenas plus the activation pool (all but the runtime).
  int64_t trainer_peak() const { return total() - bytes(BillGroup::runtime); }
};

// The model as the estimate sees it: this process's parameter table (its experts only) and its
// stages' activation bytes for (batch, seq, expert rows per layer).
struct EstimatedModel {
  std::string description;
  const std::vector<TensorSpec>& specs;
  int64_t num_layers = 0, hidden_size = 0, top_k = 0, num_experts = 0, attention_width = 0;
  std::function<ModelActivationBytes(int64_t, int64_t, int64_t)> activation_bytes;
};

// The AdamW moments' storage that optimizer.moments names.
DType moments_dtype(const RunConfig& rc);

// The layout of `world` processes under rc's [parallel] sizes, as the trainer builds it, with one
// sentence for a layout it refuses.
MeshShape estimate_mesh(const RunConfig& rc, int64_t num_experts, int64_t world);
// The trainer's refusal of a global batch that the data-parallel processes cannot split.
void check_global_batch(const RunConfig& rc, const MeshShape& mesh);

// The largest train.micro_batch (at rc's seq_len) and train.seq_len (at rc's micro_batch) whose
// bill fits in gpu_bytes; 0 where not even 1 fits.
struct LargestFit {
  int64_t micro_batch = 0, seq_len = 0;
  bool micro_batch_at_limit = false, seq_len_at_limit = false;  // the search's end (2^31 tokens a micro-batch) fits too
};

// The shard group sizes n: expert units over dp_shard x cp processes, the others over dp_shard x cp x ep.
struct ShardGroups {
  int64_t dense = 1, expert = 1;
};
ShardGroups shard_groups(const MeshShape& mesh);

// train.expert_inputs = "auto" keeps x_perm while the estimated total stays within this share of
// the device's memory (the rest: the allocator's slack, other processes' contexts).
constexpr double kKeptExpertInputsShare = 0.9;

// Whether the trainer gathers x_perm again for the backward (train.expert_inputs resolved; never
// with expert parallelism). device_bytes 0: the device's memory is unknown, and "auto" keeps.
bool gathers_expert_inputs_again(const RunConfig& rc, const EstimatedModel& model, const MeshShape& mesh, ShardGroups groups, Device device,
                                 double device_bytes);
// groups {1, 1}: every process holds whole copies of its tensors.
MemoryBill estimate_memory(const RunConfig& rc, const EstimatedModel& model, const MeshShape& mesh, ShardGroups groups, Device device,
                           double device_bytes = 0);
LargestFit largest_fit(const RunConfig& rc, const EstimatedModel& model, const MeshShape& mesh, Device device, double gpu_bytes);
// DualPipeV's cost of each stage (index stage + 1), in time at rates measured on the H200, and the
// chunks parallel.pp_layers asks for under those costs (the trainer's and the estimate's).
std::vector<ChunkCost> pipeline_stage_costs(const RunConfig& rc, const EstimatedModel& model, const MeshShape& mesh);
std::vector<PipelineChunk> pipeline_layout(const RunConfig& rc, const EstimatedModel& model, const MeshShape& mesh);
// With DualPipeV: the chunks, each rank's order of work, the simulated bubble and live activations.
std::string pipeline_report(const RunConfig& rc, const EstimatedModel& model, const MeshShape& mesh);

// The bill as a table, with the total against gpu_bytes of device memory (GPU bills only).
std::string format_bill(const MemoryBill& bill, double gpu_bytes);

// A setting that trades memory for speed, turned to the side that saves memory.
struct MemorySaving {
  std::string setting;
  std::function<void(RunConfig&)> apply;
};
// Those rc has on the side that holds memory (bf16 moments where beta2 allows, split master, no
// pairs, x_perm gathered again, FSDP's gathered weights and whole gradients freed after use).
std::vector<MemorySaving> memory_savings(const RunConfig& rc);
// An option: a saving's setting (or "all of the above together") and the bill's total with it.
struct MemoryOption {
  std::string setting;
  int64_t total = 0;
};
// Each option's total against gpu_bytes, a line each under a heading (empty without options).
std::string format_memory_options(const std::vector<MemoryOption>& options, double gpu_bytes);

// Calls f(EstimatedModel, MeshShape) for the share of M that one process of `world` holds.
template <MoeModel M, class F>
auto with_estimated_model(const RunConfig& rc, const typename M::Config& config, int64_t world, Device device, F&& f) {
  const MeshShape mesh = estimate_mesh(rc, config.num_experts, world);
  const int64_t local_experts = config.num_experts / mesh.ep;
  const M model(config, device == Device::cuda ? DType::bf16 : DType::f32, device, ExpertShard{0, local_experts});
  const std::string description =
      fmt::format("{}, {} layers, {} experts top-{}; {:.2f}M parameters, {:.2f}M on this process ({} experts per layer)", M::model_type,
                  model.num_layers(), model.num_experts(), model.top_k(), M(config, DType::f32, Device::cpu).num_parameters() / 1e6,
                  model.num_parameters() / 1e6, local_experts);
  const EstimatedModel estimated{description, model.specs(), model.num_layers(), model.hidden_size(), model.top_k(), model.num_experts(),
                                 model.attention_width(), [&](int64_t b, int64_t s, int64_t rows) { return model.activation_bytes(b, s, rows); }};
  return f(estimated, mesh);
}

// The bill of one process of a job of `world` processes training M under rc.
template <MoeModel M>
MemoryBill estimate_memory(const RunConfig& rc, const typename M::Config& config, int64_t world, Device device, double device_bytes = 0) {
  return with_estimated_model<M>(rc, config, world, device, [&](const EstimatedModel& m, const MeshShape& mesh) {
    return estimate_memory(rc, m, mesh, shard_groups(mesh), device, device_bytes);
  });
}

// train.expert_inputs resolved for M under rc (gathers_expert_inputs_again).
template <MoeModel M>
bool gathers_expert_inputs_again(const RunConfig& rc, const typename M::Config& config, int64_t world, Device device, double device_bytes) {
  return with_estimated_model<M>(rc, config, world, device, [&](const EstimatedModel& m, const MeshShape& mesh) {
    return gathers_expert_inputs_again(rc, m, mesh, shard_groups(mesh), device, device_bytes);
  });
}

// The trainer's DualPipeV chunks for M under rc on `world` processes.
template <MoeModel M>
std::vector<PipelineChunk> pipeline_layout(const RunConfig& rc, const typename M::Config& config, int64_t world, Device device) {
  return with_estimated_model<M>(rc, config, world, device,
                                 [&](const EstimatedModel& m, const MeshShape& mesh) { return pipeline_layout(rc, m, mesh); });
}

// The savings that shrink rc's bill, each alone (the others as rc has them), then all of those
// together when there are several.
template <MoeModel M>
std::vector<MemoryOption> memory_options(const RunConfig& rc, const typename M::Config& config, int64_t world, Device device,
                                         double device_bytes = 0) {
  const int64_t now = estimate_memory<M>(rc, config, world, device, device_bytes).total();
  std::vector<MemoryOption> options;
  RunConfig all = rc;
  for (const MemorySaving& saving : memory_savings(rc)) {
    RunConfig one = rc;
    saving.apply(one);
    const int64_t total = estimate_memory<M>(one, config, world, device, device_bytes).total();
    if (total >= now) continue;
    saving.apply(all);
    options.push_back({saving.setting, total});
  }
  if (options.size() > 1) options.push_back({"all of the above together", estimate_memory<M>(all, config, world, device, device_bytes).total()});
  return options;
}

template <MoeModel M>
LargestFit largest_fit(const RunConfig& rc, const typename M::Config& config, int64_t world, Device device, double gpu_bytes) {
  return with_estimated_model<M>(rc, config, world, device, [&](const EstimatedModel& m, const MeshShape& mesh) {
    return largest_fit(rc, m, mesh, device, gpu_bytes);
  });
}

}  // namespace marrow
