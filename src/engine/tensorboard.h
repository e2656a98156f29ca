// What a training run shows in TensorBoard (`tensorboard --logdir <output.dir>/tb`): one event file
// per start of the run, tb/events.out.tfevents.<unix time>.<host>.<NNNN> (engine/event_file.h),
// holding
// - every number of each metrics.jsonl line as a scalar at its step, under these tags:
//     loss -> train/loss, val_loss -> val/loss, lr -> train/lr, grad_norm -> train/grad_norm,
//     load_balance -> train/load_balance, tokens_seen -> train/tokens_seen,
//     tokens_per_s -> perf/tokens_per_s, step_ms -> perf/step_ms, peak_bytes -> perf/peak_memory_gib (GiB),
//   any other number <key> -> train/<key> (flags such as skipped are not numbers and stay out);
// - the run config (its command-line arguments, then the file) as the text "run_config", at step 0
//   for a fresh run and at the checkpoint's step for a resume, so each start shows how it ran.
// Invariant, as for metrics.jsonl: each step is in the files once. A fresh start (or one from another
// directory's checkpoint) removes the event files an earlier run left in tb/; a resume of output.dir's
// own run cuts those files back to the steps <= the checkpoint's
// (the steps after it are trained again, and TensorBoard's Python reader would show both copies).
// The file names sort in the order they were written (by time; within a second on one host, by
// NNNN), which is the order readers take them in.
#pragma once
#include <cstdint>
#include <string>

#include "core/json.h"
#include "engine/event_file.h"
#include "engine/run_config.h"

namespace marrow {

class TensorBoardLog {
 public:
  // Opens the run's new event file; first_step is the run's first step; continues: it goes on with the
  // records in tb/ (a resume of output.dir's own run), else they are removed (keep_earlier_records
  // moved them aside first).
  TensorBoardLog(const RunConfig& rc, int64_t first_step, bool continues);
  // The numbers of one metrics.jsonl line (an object with "step") as scalars at that step.
  void add_step(const Json& metrics);

 private:
  EventFileWriter file_;
};

}  // namespace marrow
