// Parameter initialisation: element i of the tensor called `name` is std * N(0, 1) drawn from
// Philox(seed, name) at counter i (core/rng.h). CPU and GPU draw the same numbers, so every device
// and every parallel layout starts from the same model. fill_constant sets every element.
#pragma once
#include <string_view>

#include "core/tensor.h"

namespace marrow {

// out: f32 or f64 on the CPU, f32 on the GPU. out[i] is element first + i of the tensor `name`
// (a shard of it: the counter is the element's index in the whole tensor).
void fill_normal(Tensor out, uint64_t seed, std::string_view name, double std, int64_t first = 0, Stream stream = {});
void fill_constant(Tensor out, double value, Stream stream = {});

}  // namespace marrow
