// Learning-rate schedules, as a pure function of the 1-based step so a resumed run needs no state.
//   cosine: linear warmup to lr, then cosine decay to min_lr at the last step.
//   wsd:    linear warmup, constant lr, then a linear decay to min_lr over the last decay_fraction.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

namespace marrow {

struct LrSchedule {
  std::string kind = "cosine";
  double lr = 3e-4, min_lr = 0;
  int64_t warmup_steps = 0, total_steps = 1;
  double decay_fraction = 0.2;

  double at(int64_t step) const {
    if (step <= warmup_steps) return lr * double(step) / double(std::max<int64_t>(1, warmup_steps));
    if (kind == "wsd") {
      const double decay_steps = std::max(1.0, decay_fraction * double(total_steps));
      const double into_decay = double(step) - (double(total_steps) - decay_steps);
      if (into_decay <= 0) return lr;
      return lr + (min_lr - lr) * std::min(1.0, into_decay / decay_steps);
    }
    const double progress = double(step - warmup_steps) / double(std::max<int64_t>(1, total_steps - warmup_steps));
    return min_lr + 0.5 * (lr - min_lr) * (1 + std::cos(M_PI * std::min(1.0, progress)));
  }
};

}  // namespace marrow
