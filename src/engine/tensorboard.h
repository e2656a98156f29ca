// What a training run shows in TensorBoard (`tensorboard --logdir <output.dir>/tb`): one event file
// per start of the run, tb/events.out.tfevents.<unix time>.<host>.<NNNN> (engine/event_file.h), with
// - every number of each metrics.jsonl line as a scalar at its step: loss -> train/loss, val_loss ->
//   val/loss, tokens_per_s, step_ms -> perf/..., peak_bytes -> perf/peak_memory_gib, any other <key>
//   -> train/<key>;
// - the run config (command-line arguments, then the file) as the text "run_config" at the start's step.
// As for metrics.jsonl each step is in the files once: a fresh start removes an earlier run's event
// files, a resume cuts them back to the checkpoint's step. File names sort in the order written.
// A resume cuts metrics.jsonl and the earlier tb/ event files back to the checkpoint's step (later
// steps are trained again). TensorBoard's Rust server drops such orphaned steps itself, but its
// Python reader (EventAccumulator, which the tests and most tools use) would show them twice. Each
// start of a run writes a new event file whose name sorts last.
#pragma once
#include <cstdint>
#include <string>

#include "core/json.h"
#include "engine/event_file.h"
#include "engine/run_config.h"

namespace marrow {

class TensorBoardLog {
 public:
  // Opens the run's new event file; continues: go on with the records in tb/ (a resume of
  // output.dir's own run), else they are removed (keep_earlier_records moved them aside first).
  TensorBoardLog(const RunConfig& rc, int64_t first_step, bool continues);
  // The numbers of one metrics.jsonl line (an object with "step") as scalars at that step.
  void add_step(const Json& metrics);

 private:
  EventFileWriter file_;
};

}  // namespace marrow
