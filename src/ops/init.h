// Parameter initialisation: element i of the tensor called `name` is std * N(0, 1) drawn from
// Philox(seed, name) at counter i (core/rng.h). CPU and GPU draw the same numbers, so every device
// and every parallel layout starts from the same model. fill_constant sets every element.
#pragma once
#include <string_view>

#include "core/tensor.h"

namespace marrow {

// out: f32 or f64 on the CPU, f32 on the GPU.
void fill_normal(Tensor out, uint64_t seed, std::string_view name, double std, Stream stream = {});
void fill_constant(Tensor out, double value, Stream stream = {});

}  // namespace marrow
