// Whether Marrow's own kernels launch as programmatic dependents of the kernel before them
// in the stream (ops/cuda_common.cuh: launch_dependent), which hides part of each kernel boundary on
// Hopper. On by default; train.dependent_launch=false launches them plainly (same results: every
// such kernel waits for the previous grid before touching memory either way).
#pragma once

namespace marrow {

void set_dependent_launch(bool on);
bool dependent_launch();

}  // namespace marrow
