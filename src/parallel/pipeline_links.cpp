#include "parallel/pipeline_links.h"

namespace marrow {

PipelineLinks PipelineLinks::create(const Comm& pipeline) {
  PipelineLinks links;
  const int r = pipeline.rank();
  for (size_t k = 0; k < 4; ++k) {
    // Two splits pair every rank with both neighbours: (0,1)(2,3)... and (1,2)(3,4)...
    const Comm even = pipeline.split(r / 2, r), odd = pipeline.split((r + 1) / 2, r);
    links.down[k] = r % 2 == 0 ? even : odd;
    links.up[k] = r % 2 == 1 ? even : odd;
  }
  return links;
}

void PipelineLinks::wait_sends() const {
  for (size_t k = 0; k < 4; ++k) {
    down[k].wait_sends();
    up[k].wait_sends();
  }
}

}  // namespace marrow
