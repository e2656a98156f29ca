// A sum, in double on the host, of small tensors' values that may live on the GPU (a micro-batch's
// token losses, its load-balance loss): the reads of a step must not wait for the GPU one by one,
// or the host falls behind the GPU after each wait and the GPU idles while it catches up.
//
// add(t) queues t's copy in stream order into page-locked memory and returns at once; value() waits
// for those copies alone (at the end of a step the GPU is past them) and adds, in double, each part's
// elements in index order, then the parts in the order added, from zero. So the bits equal reading
// each part with to_host when it was added and adding it then.
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
