#include "ops/launch.h"

#include <atomic>

namespace marrow {
namespace {
std::atomic<bool>& dependent_launch_setting() {
  static std::atomic<bool> on{true};
  return on;
}
}  // namespace

void set_dependent_launch(bool on) { dependent_launch_setting() = on; }
bool dependent_launch() { return dependent_launch_setting(); }

}  // namespace marrow
