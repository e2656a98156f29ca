// The run configuration: a TOML file of [section] key = value lines plus command-line overrides
// --section.key=value (the command line wins). Every key is a CLI11 option, so types, ranges and
// unknown keys are checked in one place.
// Paths in a run config resolve against the working directory, not the config file's (the files in
// configs/ name configs/...).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace marrow {

struct RunConfig {
  // [model] (relative paths here and below resolve against the working directory)
  std::string model_config;  // path to a Hugging Face config.json
  // [data]
  std::string data_path;     // tokenized corpus directory (marrow tokenize)
  double validation_fraction = 0.01;
  int64_t max_epochs = 1;  // passes over the training samples a run may make (never repeated unasked)
  bool document_mask = false;  // packed documents: attention within each document, RoPE positions restart (ops/attention.h)
  bool loss_mask = false;      // train only on the targets the corpus's loss mask leaves (marrow tokenize --loss-mask)
  // [train]
  int64_t steps = 200;
  int64_t global_batch = 8;  // sequences per optimizer step
  int64_t micro_batch = 8;   // sequences per forward/backward
  int64_t seq_len = 128;
  uint64_t seed = 1234;
  std::string device = "auto";  // auto, cpu or cuda
  double aux_loss_coef = -1;    // load-balance coefficient; negative takes router_aux_loss_coef from config.json
  // The load-balance loss (engine/trainer.h's load_balance_form): "micro_batch", "global_batch" or
  // "sequence"; "" (unset) is micro_batch, or sequence for a DeepSeek-V2 config with seq_aux.
  std::string load_balance;
  double expert_bias_update = 0;  // DeepSeek-V3's auxiliary-loss-free bias, moved by this much a step (0: off)
  int64_t max_bad_steps = 5;    // non-finite steps in a row that stop the run
  bool dependent_launch = true;  // GPU: own kernels launched as programmatic dependents (ops/launch.h)
  std::string attention_kernels = "hopper_backward";  // GPU attention: hopper_backward, hopper, cudnn, own or cudnn_nondeterministic (ops/attention.h)
  // GPU fp32 master weights: "split" (core/split_f32.h: the bf16 copy as high halves plus 16 low
  // bits, 4 bytes a parameter) or "fp32" (a master and a separate bf16 copy, 6 bytes).
  std::string master_weights = "split";
  // master_weights = "fp32", false: each layer's weights cast from the master before each use.
  bool bf16_weight_copy = true;
  bool pair_expert_grads = true;  // micro-batches in pairs for the expert weight gradients (engine/model.h)
  // x_perm from the forward to the backward: "keep", "gather" again from h2, or "auto" (keep unless
  // that would pass 90% of the GPU's memory: engine/memory_estimate.h).
  std::string expert_inputs = "auto";
  bool fp8 = false;  // the expert forward and backward-input GEMMs in FP8 (ops/grouped_linear_fp8.h)
  // [optimizer]
  double lr = 3e-3, min_lr = 3e-4, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.1, grad_clip = 1.0;
  // The AdamW moments' storage: "fp32" or "bf16" (4 bytes a parameter less; rounded to nearest,
  // so beta2 must leave v an update bf16 can hold: <= 0.99).
  std::string moments = "fp32";
  // "adamw", or "muon": Muon (ops/muon.h) for the hidden layers' matrices (TensorSpec::orthogonalized)
  // with momentum muon_momentum, muon_steps Newton-Schulz iterations and its update scaled by
  // muon_scale * sqrt(max(rows, cols)); AdamW for the rest. Both take lr, its schedule and weight_decay.
  std::string optimizer_kind = "adamw";
  double muon_momentum = 0.95, muon_scale = 0.2;
  int64_t muon_steps = 5;
  // [schedule]
  std::string schedule = "cosine";  // cosine (linear warmup, cosine decay) or wsd (warmup, stable, decay)
  int64_t warmup_steps = 20;
  double decay_fraction = 0.2;  // wsd: share of the steps spent decaying linearly to min_lr
  // [output]
  std::string out_dir = "runs/default";
  int64_t log_every = 1;
  // [eval]
  int64_t eval_every = 0;     // validation loss every N steps and at the last step (0: never)
  int64_t eval_samples = 16;  // held-out sequences per evaluation (the same ones each time)
  // [checkpoint] (engine/checkpoint.h)
  int64_t checkpoint_every = 100;          // save every N steps and at the end (0: never)
  int64_t checkpoint_keep = 2;             // complete checkpoints kept in output.dir; older ones are deleted
  std::string checkpoint_resume;           // a checkpoint to start from when output.dir holds none
  bool checkpoint_optimizer_state = true;  // false: weights only (a resume restarts the AdamW moments at zero)
  std::string checkpoint_allow_changes;    // comma-separated kinds a resume may change (engine/config_changes.h): data, tokenizer
  // [parallel] (parallel/mesh.h): the data-parallel width is what remains of the job's processes.
  int64_t pp = 1, cp = 1, ep = 1;
  double timeout_s = 600;  // no communication progress for this long ends the job (parallel/watchdog.h)
  bool overlap_grad_reduce = true;  // reduce a stage's gradients as soon as the last backward passed it
  // FSDP (parallel/sharded_params.h) over groups of dp_shard ranks, replicated across the groups
  // (HSDP): 0 shards over all of dp (ZeRO-3), 1 replicates (DDP).
  int64_t dp_shard = 0;
  bool keep_gathered = false;     // gather each layer's weights once a step and keep them
  bool keep_whole_grads = false;  // reduce-scatter each layer's gradient once a step, not each micro-batch's
  // parallel.schedule: "sequential", "dualpipev" (parallel/dualpipev.h, also with pp = 1; implies
  // keep_gathered and keep_whole_grads) or "auto" (dualpipev when pp > 1).
  std::string pipeline_schedule = "auto";
  bool print_schedule = false;  // print each pipeline rank's order of work in the first step
  std::string pp_layers = "auto";  // DualPipeV's layers per chunk: "auto", "even" or 2 x pp counts
  bool uses_dualpipev() const { return pipeline_schedule == "dualpipev" || (pipeline_schedule == "auto" && pp > 1); }
  // --profile-steps A:B (engine/kernel_trace.h): a kernel trace of steps A..B; 0:0 traces nothing.
  int64_t profile_first = 0, profile_last = 0;
  bool quiet = false;  // --quiet: no progress lines (core/progress.h)

  std::string source;                  // the run config file, for messages
  std::vector<std::string> overrides;  // the command line after it, as given (for the logs)
};

// Parses `<run-config> [--section.key=value ...] [--profile-steps A:B] [--quiet]` (argv[0]: the
// subcommand); any problem is a marrow::Error with one sentence.
RunConfig parse_run_config(int argc, char** argv);

// Fails with one sentence unless model.config is a file and output.dir is not itself a checkpoint.
void check_run_paths(const RunConfig& rc);

// `marrow <cmd> --help` (or -h): prints the usage and every run-config key and returns true; else false.
bool print_run_config_help(int argc, char** argv);

// Fails unless 1 <= profile_first <= profile_last <= steps (the trainer checks again: bench sets steps).
void check_profile_steps(const RunConfig& rc);

}  // namespace marrow
