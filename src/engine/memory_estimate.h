// The memory bill of one training process, computed without a GPU: `marrow estimate` prints it,
// and the trainer can print it at start. Every figure is in bytes and follows the code that
// allocates it:
// - state: fp32 master weights, gradients and the two AdamW moments, each the sum of this
//   process's chunks of the shard units (parallel/sharded_params.h's layout: prolog, each layer's
//   dense and expert tensors, epilog, all norms; a unit of N elements over a shard group of n
//   processes has chunk c = ceil(N / n); n = 1 is the whole unit, today's replicated layout).
// - weights: the compute copies (bf16 on the GPU) and whole fp32 gradients: units kept whole for
//   the step (prolog, epilog, norms, any unit with n = 1, every unit with keep_gathered) hold n*c
//   elements each; the other decoder layers hold their working shard plus two shared slots per kind
//   (dense, expert) of gathered weights and of gradients.
// - activations: one micro-batch at its peak moment (micro-batches run one after the other, so only
//   one is alive); with DualPipeV, the micro-batch chunks alive at the heaviest op of the pipeline
//   rank's order, and of the ranks the one with the largest bill. The model family reports its stages' bytes (core/stage_bytes.h); the walk in
//   memory_estimate.cpp replays engine/step.h's forward and backward order with the engine's own
//   buffers (residual gradient, dispatch/combine rows, the expert all-to-all buffers with ep > 1).
// - runtime (GPU only): CUDA context, cuBLAS workspace and NCCL communicators, which live outside
//   the arenas and the activation pool, so the trainer's `peak` figure does not count them.
// Invariant: with n = 1 everywhere the state and weights items equal the trainer's arenas.
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

// The shard group sizes n of the layout: expert units over dp_shard x cp processes, the others over
// dp_shard x cp x ep (dp_shard = parallel.dp_shard, 0 meaning all of dp).
struct ShardGroups {
  int64_t dense = 1, expert = 1;
};
ShardGroups shard_groups(const MeshShape& mesh);

// train.expert_inputs = "auto" keeps x_perm while the estimated total with it kept stays within this
// share of the device's memory (the rest: the allocator's slack, other processes' contexts).
constexpr double kKeptExpertInputsShare = 0.9;

// Whether the trainer drops x_perm after each layer's experts forward and gathers it again for the
// backward (train.expert_inputs: "gather"; "auto" when keeping it would pass kKeptExpertInputsShare of
// device_bytes; never with expert parallelism, where x_perm is what arrived). device_bytes 0: the
// device's memory is not known, and "auto" keeps.
bool gathers_expert_inputs_again(const RunConfig& rc, const EstimatedModel& model, const MeshShape& mesh, ShardGroups groups, Device device,
                                 double device_bytes);
// groups {1, 1} is the trainer before FSDP: every process holds whole copies of its tensors.
// device_bytes: the device's memory, which train.expert_inputs = "auto" decides against (0: keep).
MemoryBill estimate_memory(const RunConfig& rc, const EstimatedModel& model, const MeshShape& mesh, ShardGroups groups, Device device,
                           double device_bytes = 0);
LargestFit largest_fit(const RunConfig& rc, const EstimatedModel& model, const MeshShape& mesh, Device device, double gpu_bytes);
// DualPipeV's cost of each stage (index stage + 1) per token, in time at rates measured on the
// H200, and the chunks parallel.pp_layers asks for under those costs (the trainer's and the
// estimate's partition: parallel/dualpipev.h's chosen_pipeline_chunks).
std::vector<ChunkCost> pipeline_stage_costs(const RunConfig& rc, const EstimatedModel& model, const MeshShape& mesh);
std::vector<PipelineChunk> pipeline_layout(const RunConfig& rc, const EstimatedModel& model, const MeshShape& mesh);
// With DualPipeV: the chunks, each pipeline rank's order of work (as the trainer prints it with
// parallel.print_schedule), and the simulated bubble and live activations (parallel/dualpipev.h).
std::string pipeline_report(const RunConfig& rc, const EstimatedModel& model, const MeshShape& mesh);

// The bill as a table, with the total against gpu_bytes of device memory (GPU bills only).
std::string format_bill(const MemoryBill& bill, double gpu_bytes);

// A setting that trades memory for speed, turned to the side that saves memory: its run-config
// override and the change it makes.
struct MemorySaving {
  std::string setting;
  std::function<void(RunConfig&)> apply;
};
// Those rc has on the side that holds memory: AdamW moments in bf16 (where beta2 allows it), no
// persistent bf16 weight copy, no paired expert weight gradients, the experts' inputs gathered again
// for the backward, FSDP's gathered weights and whole gradients freed after use.
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
