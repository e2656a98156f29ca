// Time per stage of the training step, for `marrow bench`'s split: CUDA events around each stage on
// the GPU, read once per step after its synchronisation, or the host clock on the CPU. Each stage
// is also an NVTX range, so profilers show the same names (the router counts in attention).
#pragma once
#include <array>
#include <chrono>
#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace marrow {

enum class Stage : int { prolog, attention, dispatch, experts, combine, epilog, optimizer };
inline constexpr int kStageCount = 7;
inline constexpr const char* kStageNames[kStageCount] = {"prolog (embedding)", "attention + router", "dispatch", "experts",
                                                          "combine + aggregate", "epilog (head, loss)", "optimizer"};

class StageTimer {
 public:
  explicit StageTimer(Device device) : device_(device) {}
  ~StageTimer();
  StageTimer(const StageTimer&) = delete;
  StageTimer& operator=(const StageTimer&) = delete;

  // Steps from `step` on are timed; the others only mark their stages as NVTX ranges. Timing
  // slows a step (docs/performance.md), so the bench times steps of its own after the measured ones.
  void time_from_step(int64_t step) { first_step_ = step; }
  bool times(int64_t step) const { return step >= first_step_; }
  // Called by the training loop before each step.
  void start_step(int64_t step) { timing_ = times(step); }

  void begin(Stage stage);
  void end(Stage stage);
  // Adds the times of the stages run since the last call to the totals; on the GPU, call it after
  // the step's work is done (it waits for the recorded events).
  void collect();
  const std::array<double, kStageCount>& total_ms() const { return total_ms_; }

 private:
  struct Mark {
    Stage stage = Stage::prolog;
    void* start = nullptr;  // cudaEvent_t on the GPU
    void* stop = nullptr;
    std::chrono::steady_clock::time_point host_start, host_stop;
  };
  Device device_;
  std::vector<Mark> marks_;
  std::vector<void*> free_events_;
  std::array<double, kStageCount> total_ms_{};
  int64_t first_step_ = 1;
  bool timing_ = true;
};

// Times one stage for the lifetime of the scope; a null timer times nothing.
class StageScope {
 public:
  StageScope(StageTimer* timer, Stage stage) : timer_(timer), stage_(stage) {
    if (timer_) timer_->begin(stage_);
  }
  ~StageScope() {
    if (timer_) timer_->end(stage_);
  }
  StageScope(const StageScope&) = delete;
  StageScope& operator=(const StageScope&) = delete;

 private:
  StageTimer* timer_;
  Stage stage_;
};

}  // namespace marrow
