// How many times the weights' values have changed in this process. ShardedParameters bumps it
// wherever the master weights change (an optimizer step, a checkpoint or initial values written),
// so that copies derived from the weights (the FP8 expert weights of train.fp8, models/) can tell
// when they are stale without the engine knowing they exist.
#pragma once
#include <cstdint>

namespace marrow {

inline uint64_t& weights_generation() {
  static uint64_t generation = 0;
  return generation;
}

}  // namespace marrow
