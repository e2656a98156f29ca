// The run configuration: a TOML file of [section] key = value lines (read by toml++) plus
// command-line overrides --section.key=value (the command line wins). Every key is a CLI11 option, so types,
// ranges and unknown keys are all checked in one place with one message each.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace marrow {

struct RunConfig {
  // [model]
  // Relative paths (model.config, data.path, output.dir, checkpoint.resume) resolve against the
  // working directory, not the config file's; a missing one's message says so.
  std::string model_config;  // path to a Hugging Face config.json
  // [data]
  std::string data_path;     // tokenized corpus directory (marrow tokenize)
  double validation_fraction = 0.01;
  // Passes over the training samples a run may make (dataset.h's endless order: a new permutation
  // each pass); a run that needs more is refused, so a small corpus is never repeated unasked.
  int64_t max_epochs = 1;
  // [train]
  int64_t steps = 200;
  int64_t global_batch = 8;  // sequences per optimizer step
  int64_t micro_batch = 8;   // sequences per forward/backward
  int64_t seq_len = 128;
  uint64_t seed = 1234;
  std::string device = "auto";  // auto, cpu or cuda
  double aux_loss_coef = -1;    // load-balance coefficient; negative takes router_aux_loss_coef from config.json
  int64_t max_bad_steps = 5;    // non-finite steps in a row that stop the run
  bool dependent_launch = true;  // GPU: own kernels launched as programmatic dependents (ops/launch.h)
  std::string attention_kernels = "hopper_backward";  // GPU attention: hopper_backward, hopper, cudnn, own or cudnn_nondeterministic (ops/attention.h)
  // How the GPU keeps the fp32 master weights: "split" (core/split_f32.h: the bf16 copy it computes
  // with as their high halves plus 16 low bits, 4 bytes a parameter for both) or "fp32" (an fp32
  // master and a separate bf16 copy, 6 bytes). The CPU computes on an fp32 master either way.
  std::string master_weights = "split";
  // With master_weights = "fp32": a bf16 copy of every weight kept for the step (GPU). false: each
  // decoder layer's weights are cast from the fp32 master into a slot before each use (2 bytes per
  // parameter less, a cast per layer per use).
  bool bf16_weight_copy = true;
  // Micro-batches 2i and 2i + 1 compute their expert weight gradients in one pass over the fp32
  // gradients (engine/model.h: pairs_expert_weight_gradients); false saves the memory the pair holds.
  bool pair_expert_grads = true;
  // The experts' dispatched inputs x_perm ([tokens x top_k, hidden], one per layer) from the forward to
  // the backward: "keep" them, "gather" them again from the normed hidden states for the backward
  // (T x K x H activations less per layer for one more gather; with expert parallelism x_perm is what
  // arrived and is always kept), or "auto": keep them unless the estimated total with them kept
  // would pass 90% of the GPU's memory (engine/memory_estimate.h: gathers_expert_inputs_again).
  std::string expert_inputs = "auto";
  // The expert layers' forward and backward-input GEMMs in FP8 (E4M3 with DeepSeek-V3's block scales,
  // ops/grouped_linear_fp8.h); their weight gradients and every other GEMM stay bf16.
  bool fp8 = false;
  // [optimizer]
  double lr = 3e-3, min_lr = 3e-4, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.1, grad_clip = 1.0;
  // The AdamW moments' storage: "fp32", or "bf16" (DeepSeek-V3's choice; Megatron-LM's
  // --exp-avg-dtype / --exp-avg-sq-dtype bf16): 4 bytes per parameter less memory and 8 less
  // optimizer traffic. Rounded to nearest, so beta2 must leave v an update bf16 can hold (<= 0.99).
  std::string moments = "fp32";
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
  // [parallel] (parallel/mesh.h): processes per pipeline stage, context and expert group; the
  // data-parallel width is what remains of the job's processes.
  int64_t pp = 1, cp = 1, ep = 1;
  double timeout_s = 600;  // a step with no communication progress for this long ends the job (parallel/watchdog.h)
  // Sum each stage's gradients over the processes as soon as the last micro-batch's backward has
  // passed it, overlapping the stages below (else all after the backward).
  bool overlap_grad_reduce = true;
  // Fully sharded data parallelism (parallel/sharded_params.h): the fp32 master weights, gradients
  // and AdamW moments are sharded over groups of dp_shard data-parallel ranks and replicated across
  // the dp / dp_shard groups (HSDP). 0 shards over all of dp (ZeRO-3); 1 replicates (plain DDP).
  int64_t dp_shard = 0;
  // true: gather each layer's weights once per step and keep them (faster, more memory); false:
  // gather them before each use, forward and backward.
  bool keep_gathered = false;
  // true: accumulate each layer's whole gradient over the micro-batches and reduce-scatter it once
  // per step (less traffic, more memory); false: reduce-scatter each micro-batch's.
  bool keep_whole_grads = false;
  // How a step runs its micro-batches: "sequential" (each forward then its backward), "dualpipev"
  // (parallel/dualpipev.h: forwards overlapped with other micro-batches' backwards, on two chunks
  // of the model even with pp = 1), "auto" (dualpipev when pp > 1). DualPipeV gathers weights and
  // reduces gradients once per step (keep_gathered and keep_whole_grads are implied).
  std::string pipeline_schedule = "auto";  // parallel.schedule
  bool print_schedule = false;  // print each pipeline rank's order of work in the first step
  // DualPipeV's decoder layers per chunk: "auto" (the split whose simulated step is shortest,
  // parallel/dualpipev.h), "even", or 2 x pp comma-separated counts.
  std::string pp_layers = "auto";  // parallel.pp_layers
  bool uses_dualpipev() const { return pipeline_schedule == "dualpipev" || (pipeline_schedule == "auto" && pp > 1); }
  // --profile-steps A:B (engine/kernel_trace.h): a kernel trace of optimizer steps A..B (1-based,
  // inclusive) in output.dir; 0:0 traces nothing.
  int64_t profile_first = 0, profile_last = 0;
  // --quiet: no progress lines for slow work (core/progress.h), such as checking a large corpus.
  bool quiet = false;

  std::string source;                  // the run config file, for messages
  std::vector<std::string> overrides;  // the command line after it, as given (for the logs)
};

// Parses `<run-config> [--section.key=value ...] [--profile-steps A:B] [--quiet]` (argv[0] is the subcommand's
// name). Any problem (missing file, unknown key, bad value, inconsistent sizes) is a marrow::Error
// with one sentence.
RunConfig parse_run_config(int argc, char** argv);

// Fails with one sentence unless model.config is a file (a relative one's message says that it
// resolves against the working directory, as a missing corpus's does, data/token_corpus.h) and
// output.dir is not itself a checkpoint.
void check_run_paths(const RunConfig& rc);

// `marrow <cmd> --help` (or -h): prints the usage and every run-config key and returns true; else false.
bool print_run_config_help(int argc, char** argv);

// Fails unless 1 <= profile_first <= profile_last <= steps; marrow bench sets its own step count
// after parsing, so the trainer checks again.
void check_profile_steps(const RunConfig& rc);

}  // namespace marrow
