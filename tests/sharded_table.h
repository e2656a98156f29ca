// A parameter table of a few tensors for ShardedParameters' tests (split_master_test, the
// parallel_check tool): prolog, two decoder layers (dense and experts) and epilog, of sizes that no
// process count divides.
#pragma once
#include <vector>

#include "core/tensor_spec.h"

namespace marrow::testing {

inline std::vector<TensorSpec> sharded_table() {
  std::vector<TensorSpec> specs;
  auto add = [&](const char* name, int64_t numel, int64_t layer, bool expert) {
    const int64_t offset = specs.empty() ? 0 : specs.back().offset + specs.back().numel;
    specs.push_back(
        {.name = name, .shape = {numel}, .offset = offset, .numel = numel, .first_backward_writes = expert, .is_expert = expert, .layer = layer});
  };
  add("embed", 37, -1, false);
  for (int64_t l = 0; l < 2; ++l) {
    add("dense", 29, l, false);
    add("experts", 41, l, true);
  }
  add("head", 37, 2, false);
  return specs;
}

}  // namespace marrow::testing
