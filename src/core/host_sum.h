// A sum, in double on the host, of small tensors that may live on the GPU (token losses, the
// load-balance loss): a step's reads must not wait for the GPU one by one, or it idles while the
// host catches up. add(t) queues t's copy into page-locked memory and returns; value() waits for
// those copies alone and adds each part's elements in index order, then the parts in order: the
// same bits as reading each part with to_host when it was added.
#pragma once
#include <memory>
#include <vector>

#include "core/memory.h"

namespace marrow {

class HostSum {
 public:
  // A part: the sum of t's values (f32 or f64, any device); the copy is queued on `stream`.
  void add(Tensor t, Stream stream = {});
  // A part: another sum's value.
  void add(HostSum part);
  double value() const;

  struct Slot;  // page-locked memory from a process-wide pool (host_sum.cpp), back to it with the part

 private:
  struct Part {
    std::shared_ptr<Slot> slot;
    Tensor host;
    StreamMark copied;
    std::vector<HostSum> nested;  // one sum, for a part that is another sum
  };
  std::vector<Part> parts_;
};

}  // namespace marrow
