#include "engine/stage_timer.h"

#include "core/cuda_check.h"

#if MARROW_CUDA
#include <nvtx3/nvToolsExt.h>
#endif

namespace marrow {

namespace {

#if MARROW_CUDA
void* new_event(std::vector<void*>& free_events) {
  if (!free_events.empty()) {
    void* e = free_events.back();
    free_events.pop_back();
    return e;
  }
  cudaEvent_t e;
  MARROW_CUDA_CHECK(cudaEventCreate(&e));
  return e;
}
#endif

}  // namespace

StageTimer::~StageTimer() {
#if MARROW_CUDA
  for (Mark& m : marks_) free_events_.insert(free_events_.end(), {m.start, m.stop});
  for (void* e : free_events_)
    if (e) cudaEventDestroy(static_cast<cudaEvent_t>(e));  // cleanup: status ignored (a destructor)
#endif
}

void StageTimer::begin(Stage stage) {
#if MARROW_CUDA
  nvtxRangePushA(kStageNames[int(stage)]);
#endif
  if (!timing_) return;
  Mark m;
  m.stage = stage;
#if MARROW_CUDA
  if (device_ == Device::cuda) {
    m.start = new_event(free_events_);
    m.stop = new_event(free_events_);
    MARROW_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(m.start)));
  }
#endif
  m.host_start = std::chrono::steady_clock::now();
  marks_.push_back(m);
}

void StageTimer::end(Stage stage) {
  if (!timing_) {
#if MARROW_CUDA
    nvtxRangePop();
#endif
    return;
  }
  MARROW_CHECK(!marks_.empty() && marks_.back().stage == stage && !marks_.back().host_stop.time_since_epoch().count(),
               "StageTimer: stage '{}' ends without beginning", kStageNames[int(stage)]);
  Mark& m = marks_.back();
  m.host_stop = std::chrono::steady_clock::now();
#if MARROW_CUDA
  if (device_ == Device::cuda) MARROW_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(m.stop)));
  nvtxRangePop();
#endif
}

void StageTimer::collect() {
  for (Mark& m : marks_) {
    double ms = std::chrono::duration<double, std::milli>(m.host_stop - m.host_start).count();
#if MARROW_CUDA
    if (device_ == Device::cuda) {
      float gpu_ms = 0;
      MARROW_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(m.stop)));
      MARROW_CUDA_CHECK(cudaEventElapsedTime(&gpu_ms, static_cast<cudaEvent_t>(m.start), static_cast<cudaEvent_t>(m.stop)));
      ms = gpu_ms;
      free_events_.insert(free_events_.end(), {m.start, m.stop});
    }
#endif
    total_ms_[size_t(m.stage)] += ms;
  }
  marks_.clear();
}

}  // namespace marrow
