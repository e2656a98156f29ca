// Checkpoints (DESIGN.md §6). A checkpoint is a directory, e.g. runs/tiny-moe/step-00001000/:
//   meta.json     format and Marrow version, step, tokens seen, seed, mesh, the model's config.json,
//                 the run config, the corpus, and every file below with its size and sha256
//   config.json   the model's Hugging Face config.json (usable as [model] config)
//   weights-0000k-of-0000n.safetensors      fp32 master weights
//   exp_avg-0000k-of-0000n.safetensors      AdamW first moments   } absent after `marrow import` or with
//   exp_avg_sq-0000k-of-0000n.safetensors   AdamW second moments  } checkpoint.optimizer_state = false:
//                                                                   a resume starts them at zero
//   (the moments fp32, or bf16 when the run kept them in bf16: optimizer.moments; a run that keeps
//   the other dtype converts them as it reads, bf16 -> fp32 exactly)
//   tokenizer.json  the corpus's tokenizer, when it has one (export hands it on)
// Every safetensors entry is a canonical tensor under its Hugging Face name, in table order: whole,
// or (sharded runs, each rank writing its own files) a flat slice whose offset meta.json records.
// Files are cut at ~2 GiB. Any mesh reads any checkpoint, assembling the slices it needs.
// Crash safety: files are written into <dir>.tmp and fsync'ed, meta.json last, then the directory
// is renamed to <dir>; a step-XXXXXXXX directory holding meta.json is complete, and leftovers
// (*.tmp) are never read. Opening checks each file's size, verify_checkpoint its sha256.
// Checkpoints of sharded runs hold slices: read them with load_checkpoint_pieces (tests:
// tests/python/checkpoint_tensors.py, which assembles them from meta.json), never by opening one
// safetensors file. TrainCheckpoints::require_disk_space refuses, before training, a run whose
// output.dir cannot hold one checkpoint (12 bytes a parameter with the AdamW moments; marrow estimate
// prints the size; Qwen3-30B-A3B's is 341 GiB, more than the 8-GPU kind's disk).
// MARROW_TEST_SAVE_PAUSE_MS pauses a save so a test can kill it midway.
#pragma once
#include <optional>
#include <string>
#include <vector>

#include "core/json.h"
#include "core/memory.h"
#include "core/tensor_spec.h"
#include "engine/run_config.h"
#include "parallel/comm.h"

namespace marrow {

constexpr size_t kCheckpointShardBytes = size_t(2) << 30;

// The arenas a checkpoint holds, laid out by one spec table; null moments are neither saved nor read.
struct CheckpointArenas {
  const Arena* weights = nullptr;
  const Arena* exp_avg = nullptr;
  const Arena* exp_avg_sq = nullptr;
};

struct Checkpoint {
  std::string dir;
  Json meta;
  int64_t step = 0;
  bool has_optimizer_state = false;
  std::string config_path() const { return dir + "/config.json"; }
  std::string tokenizer_path() const;  // "" when the checkpoint holds no tokenizer
};

// "step-00001000"
std::string checkpoint_name(int64_t step);
// Bytes a parameter takes in one checkpoint of rc's run (fp32 weights; with checkpoint.optimizer_state
// the moments too, 4 or 2 bytes each by optimizer.moments), and those contents in words.
int64_t checkpoint_bytes_per_parameter(const RunConfig& rc);
std::string checkpoint_contents(const RunConfig& rc);

// A checkpoint is written in three steps, so several processes can each write their part:
// start_checkpoint makes <dir>.tmp (one process); write_checkpoint_part writes pieces of the arenas
// into <group>-[<part>-]0000k-of-0000n.safetensors and returns their meta.json entries (a slice's
// records "slices": {name: {"first", "count", "shape"}}); finish_checkpoint (one process, after
// every part) adds config.json, the tokenizer and meta.json and renames <dir>.tmp to <dir>.
void start_checkpoint(const std::string& dir);
Json write_checkpoint_part(const std::string& tmp, const std::vector<TensorSpec>& specs, const std::vector<TensorPiece>& pieces,
                           const CheckpointArenas& arenas, const std::string& part, size_t shard_bytes = kCheckpointShardBytes,
                           bool show_progress = true);
void finish_checkpoint(const std::string& dir, Json files, Json meta, const Json& model_config, const std::string& tokenizer_json);

// One process writes a complete checkpoint at dir (replacing one already there), meta getting the
// file list.
void write_checkpoint(const std::string& dir, const std::vector<TensorSpec>& specs, const CheckpointArenas& arenas, Json meta,
                      const Json& model_config, const std::string& tokenizer_json = "",
                      size_t shard_bytes = kCheckpointShardBytes);

// The newest complete step-XXXXXXXX directory in run_dir, if any.
std::optional<std::string> latest_checkpoint(const std::string& run_dir);

// The checkpoint or run directory (checkpoints, metrics.jsonl or a run lock) that path is or lies
// inside, or "": other commands' outputs must never land there.
std::string enclosing_run_data(const std::string& path);

// Opens a checkpoint directory, or a run directory (its newest checkpoint): reads meta.json and
// checks that every file it lists is there with its recorded size.
Checkpoint open_checkpoint(const std::string& path);
// Checks every file's sha256 against meta.json. show_progress, here and below: a progress line
// (core/progress.h) when the work takes more than a few seconds.
void verify_checkpoint(const Checkpoint& checkpoint, bool show_progress = true);
// Fills arena (any device) with group "weights", "exp_avg" or "exp_avg_sq", piece by piece, whatever
// slicing wrote it; every element must be there, and the group must hold model_tensors tensors
// (0: specs.size()).
void load_checkpoint_pieces(const Checkpoint& checkpoint, const std::string& group, const std::vector<TensorSpec>& specs,
                            const std::vector<TensorPiece>& pieces, const Arena& arena, size_t model_tensors = 0,
                            bool show_progress = true);
// The same for whole tensors at their spec offsets.
void load_checkpoint_tensors(const Checkpoint& checkpoint, const std::string& group, const std::vector<TensorSpec>& specs,
                             const Arena& arena, size_t model_tensors = 0, bool show_progress = true);
// One piece per spec: the whole tensor at its offset in an arena laid out by the table.
std::vector<TensorPiece> whole_tensors(const std::vector<TensorSpec>& specs);

// The first architectural difference between two model config.json objects, as "key is A there but
// B here", or "" when they describe the same model (keys such as torch_dtype do not count).
std::string model_config_difference(const Json& saved, const Json& current);

// Any source of model weights: a checkpoint, a run directory (its newest checkpoint) or a Hugging
// Face model directory (config.json + safetensors, sharded or not, fp32 or bf16).
struct ModelSource {
  std::string dir;        // the checkpoint or Hugging Face directory
  bool is_checkpoint = false;
  Json config;            // the model's config.json
  std::string config_path;
  std::string tokenizer;  // tokenizer.json path, "" when absent
};
ModelSource find_model(const std::string& path);
// Loads the weights of a model source into a parameter arena laid out by specs.
void load_model_weights(const ModelSource& source, const std::vector<TensorSpec>& specs, const Arena& params, bool show_progress = true);

// How a job's processes share a checkpoint: each writes the pieces it holds (when it is the replica
// that saves them) into files of its own; world rank 0 writes meta.json once every part is on disk.
struct CheckpointSharing {
  Comm world;                        // the group of this process alone for one process
  std::vector<TensorPiece> pieces;   // what this process holds (empty: every spec whole, at its offset)
  bool saves = true;                 // whether this process writes its pieces
  size_t model_tensors = 0;          // tensors of the whole model (0: this process holds all)
  Json mesh = {{"pp", 1}, {"dp", 1}, {"cp", 1}, {"ep", 1}};
};

// Training's side: resume at start, saves during the run (RunConfig's [checkpoint] keys).
class TrainCheckpoints {
 public:
  TrainCheckpoints(const RunConfig& rc, const Json& model_config, const std::vector<TensorSpec>& specs, CheckpointArenas arenas,
                   CheckpointSharing sharing = {});
  // Loads the newest checkpoint in output.dir, else checkpoint.resume, into the arenas; returns its
  // step (0: a fresh start). Another model, or a change checkpoint.allow_changes does not name
  // (engine/config_changes.h), is an Error.
  int64_t resume();
  // AdamW updates applied up to the resumed checkpoint (0 without optimizer state): bias correction counts these.
  int64_t resumed_updates() const { return resumed_updates_; }
  // Whether resume() continued output.dir's own run: only then do its records (metrics.jsonl, tb/) go on.
  bool continues_output_dir() const { return continues_output_dir_; }
  // Samples and tokens (targets) trained on through step: the resumed checkpoint's counts plus this
  // run's batch for each step since (a batch changed at a resume counts what each step read).
  int64_t samples_seen(int64_t step) const { return resumed_samples_ + (step - resumed_step_) * rc_.global_batch; }
  int64_t tokens_seen(int64_t step) const { return resumed_tokens_ + (step - resumed_step_) * rc_.global_batch * rc_.seq_len; }
  // Whether step (just finished) is saved: every checkpoint.every steps, the last step, or a stop.
  bool due(int64_t step, bool stopping) const;
  // With checkpoints on, an Error when output.dir has less room than one checkpoint of this run:
  // said before training, not at the first save. Every process calls it (the size is summed).
  void require_disk_space() const;
  // Saves step, with `updates` AdamW updates applied so far, into output.dir/step-XXXXXXXX, then
  // deletes all but the newest checkpoint.keep.
  std::string save(int64_t step, int64_t updates);
  // train.expert_bias_update's bias (f32 [layers, E], any device; empty: none), saved in meta.json's
  // "expert_bias" (exact: f32 through JSON's doubles) and restored by resume(), zeros when absent.
  void keep_expert_bias(Tensor bias) { expert_bias_ = bias; }

 private:
  void prepare_directory(const std::string& dir) const;  // leader: output.dir, no leftovers of killed saves, dir.tmp
  Json write_parts(const std::string& dir) const;        // every process: its tensors; the leader gets every file's entry
  Json meta_json(int64_t step, int64_t updates) const;
  void delete_old_checkpoints() const;  // all but the newest checkpoint.keep
  const RunConfig& rc_;
  const Json& model_config_;
  const std::vector<TensorSpec>& specs_;
  CheckpointArenas arenas_;
  CheckpointSharing sharing_;
  std::vector<TensorPiece> pieces_;
  int64_t resumed_updates_ = 0;
  int64_t resumed_step_ = 0, resumed_samples_ = 0, resumed_tokens_ = 0;
  bool continues_output_dir_ = false;
  Json config_changes_ = Json::array();  // the allowed changes of every resume so far (meta.json)
  Tensor expert_bias_;
};

// Rewrites a metrics.jsonl keeping the lines of steps <= step (a resumed run appends after them).
void keep_metrics_through(const std::string& path, int64_t step);

// While alive, SIGTERM and SIGINT ask the training loop to stop after the current step (and save);
// a second signal exits at once (a save in progress is never completed).
class StopSignals {
 public:
  StopSignals();
  ~StopSignals();
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;
  // The signal received (SIGTERM, SIGINT), or 0.
  static int received();
};

}  // namespace marrow
