// What the f64 checks of context parallelism under mpirun share (ring_attention_check.cpp,
// sequence_chain_check.cpp): a rank's zigzag share of a whole tensor, and the comparison of its
// results with the one-process reference's share at 1e-12 relative, the worst error kept.
#pragma once
#include <algorithm>
#include <cmath>

#include "core/errors.h"
#include "core/memory.h"
#include "parallel/ring_attention.h"

namespace marrow {

// This rank's tokens of whole[N, S, ...] as a new buffer of `local` shape.
inline Buffer zigzag_share(Tensor whole, std::initializer_list<int64_t> local, const ZigzagSplit& z) {
  Buffer out(DType::f64, Device::cpu, local);
  zigzag_slice(out, whole, z);
  return out;
}

// Both sides are exact f64 arithmetic in other orders (~1e-15 apart); a wrong block, hop or state is O(1).
inline double& worst_error() {
  static double worst = 0;
  return worst;
}
inline void expect_close(const char* what, const Tensor& got, const Tensor& want) {
  MARROW_CHECK(got.numel() == want.numel(), "{} has {} elements, the reference {}", what, got.numel(), want.numel());
  for (int64_t i = 0; i < want.numel(); ++i) {
    const double g = got.ptr<double>()[i], w = want.ptr<double>()[i], error = std::abs(g - w) / (1 + std::abs(w));
    worst_error() = std::max(worst_error(), error);
    MARROW_CHECK(error <= 1e-12, "{}[{}] is {} but the one-process op gives {}", what, i, g, w);
  }
}

}  // namespace marrow
