// The point-to-point links of one pipeline rank (parallel/dualpipev.h): to rank r + 1 ("down") and
// to rank r - 1 ("up"), each a group of the two ranks, one per kind of message. A kind travels in
// one direction only and in micro-batch order (forwards of phase 0 and backwards of phase 1 go
// down, the other two up), so with one group per kind a receiver never finds another kind's
// message first, and on the GPU a send waits behind nothing but earlier sends of its kind.
// A new kind of message needs its own group, or a receiver can take another kind's message.
#pragma once
#include <array>

#include "parallel/comm.h"

namespace marrow {

struct PipelineLinks {
  enum Kind { forward0, forward1, backward0, backward1 };
  // down[k]: this rank is member 0 and rank r + 1 member 1; up[k]: rank r - 1 is member 0 and this
  // rank member 1. Groups of one where there is no such neighbour.
  std::array<Comm, 4> down, up;

  // Every member of the pipeline group calls it.
  static PipelineLinks create(const Comm& pipeline);
  // Host: every send has completed; GPU: the compute stream waits for them (then the sent buffers
  // may be freed).
  void wait_sends() const;
};

}  // namespace marrow
