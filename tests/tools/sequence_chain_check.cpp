// The sequence chain (parallel/sequence_chain.h) over the processes of an mpirun job, the cp group
// being the whole job: every rank draws the same sequences, computes on all of them in f64 in one
// process (the reference), then its zigzag share through the chain, and compares.
// - The gated delta rule (ops/gated_delta.h) piece by piece, each piece's initial state received
//   along the chain, its final state sent on (as models/qwen3_5_moe.cpp runs it): out, the last
//   chunk's final state, dqkv, dg, dbeta, and the first chunk's initial-state gradient; pieces of 7
//   tokens in op chunks of 3, 7 and 64 (a piece ending inside, at and before a chunk's end).
// - previous_tokens: each piece's history is the whole sequence's n tokens before it (zeros at the
//   start); previous_tokens_backward: each member's dx gains exactly the history gradients of the
//   tokens it holds, whichever piece read them.
// Both sides are exact f64 arithmetic in another order: 1e-12 relative leaves room for that and none
// for a state from the wrong piece or member (O(1) errors). Run as `mpirun -np P sequence_chain_check`.
#include <cmath>
#include <cstdio>
#include <random>

#include "core/memory.h"
#include "mpi_check.h"
#include "ops/gated_delta.h"
#include "parallel/comm.h"
#include "parallel/ring_attention.h"
#include "parallel/sequence_chain.h"
#include "zigzag_compare.h"

namespace {

using namespace marrow;

Buffer random_f64(std::mt19937_64& rng, std::initializer_list<int64_t> dims, double lo = -1, double hi = 1) {
  Buffer t(DType::f64, Device::cpu, dims);
  std::uniform_real_distribution<double> u(lo, hi);
  for (int64_t i = 0; i < t.numel(); ++i) t.ptr<double>()[i] = u(rng);
  return t;
}

// Sequence b's piece p of t [B, 2 c, ...] as [1, c, ...].
Tensor piece(Tensor t, int64_t b, int64_t p) {
  t.shape[0] *= 2, t.shape[1] /= 2;
  return t.rows(2 * b + p, 2 * b + p + 1);
}

void delta_rule_case(const Comm& cp, int64_t chunk) {
  const int64_t B = 2, c = 7, S = 2 * cp.size() * c, Hk = 1, Dk = 4, Hv = 2, Dv = 3, F = 2 * Hk * Dk + Hv * Dv;
  std::mt19937_64 rng(5);
  const Buffer qkv = random_f64(rng, {B, S, F}), g = random_f64(rng, {B, S, Hv}, -1.0, -0.05), beta = random_f64(rng, {B, S, Hv}, 0.05, 0.95);
  const Buffer dout = random_f64(rng, {B, S, Hv, Dv});
  Buffer out(DType::f64, Device::cpu, {B, S, Hv, Dv}), final(DType::f64, Device::cpu, {B, Hv, Dk, Dv});
  Buffer dqkv(DType::f64, Device::cpu, {B, S, F}), dg(DType::f64, Device::cpu, {B, S, Hv}), dbeta(DType::f64, Device::cpu, {B, S, Hv});
  Buffer dinitial(DType::f64, Device::cpu, {B, Hv, Dk, Dv});
  const Buffer zeros = Buffer::zeros(DType::f64, Device::cpu, {B, Hv, Dk, Dv});
  gated_delta_forward(out, final, qkv, g, beta, Hk, Dk, zeros, chunk);
  gated_delta_backward(dqkv, dg, dbeta, dinitial, dout, qkv, g, beta, Hk, Dk, zeros, {}, chunk);

  const ZigzagSplit z = zigzag_split(S, cp.rank(), cp.size());
  const Buffer lqkv = zigzag_share(qkv, {B, 2 * c, F}, z), lg = zigzag_share(g, {B, 2 * c, Hv}, z), lbeta = zigzag_share(beta, {B, 2 * c, Hv}, z);
  const Buffer ldout = zigzag_share(dout, {B, 2 * c, Hv, Dv}, z);
  Buffer lout(DType::f64, Device::cpu, {B, 2 * c, Hv, Dv}), ldqkv(DType::f64, Device::cpu, {B, 2 * c, F});
  Buffer ldg(DType::f64, Device::cpu, {B, 2 * c, Hv}), ldbeta(DType::f64, Device::cpu, {B, 2 * c, Hv});
  Buffer states(DType::f64, Device::cpu, {2 * B, Hv, Dk, Dv}), d_final(DType::f64, Device::cpu, {2 * B, Hv, Dk, Dv});
  Buffer last_final(DType::f64, Device::cpu, {B, Hv, Dk, Dv}), first_dinitial(DType::f64, Device::cpu, {B, Hv, Dk, Dv});
  const SequenceChain chain = sequence_chain(cp);
  const bool holds_last = cp.rank() == 0, holds_first = cp.rank() == 0;
  chain.forward(states, [&](int64_t p, Tensor f) {
    for (int64_t b = 0; b < B; ++b)
      gated_delta_forward(piece(lout, b, p), f.rows(b, b + 1), piece(lqkv, b, p), piece(lg, b, p), piece(lbeta, b, p), Hk, Dk,
                          states.view().rows(p * B + b, p * B + b + 1), chunk);
    if (holds_last && p == 1) copy(last_final, f);
  });
  chain.backward(d_final, [&](int64_t p, Tensor d_initial) {
    for (int64_t b = 0; b < B; ++b)
      gated_delta_backward(piece(ldqkv, b, p), piece(ldg, b, p), piece(ldbeta, b, p), d_initial.rows(b, b + 1), piece(ldout, b, p),
                           piece(lqkv, b, p), piece(lg, b, p), piece(lbeta, b, p), Hk, Dk, states.view().rows(p * B + b, p * B + b + 1),
                           d_final.view().rows(p * B + b, p * B + b + 1), chunk);
    if (holds_first && p == 0) copy(first_dinitial, d_initial);
  });
  expect_close("delta out", lout, zigzag_share(out, {B, 2 * c, Hv, Dv}, z));
  expect_close("delta dqkv", ldqkv, zigzag_share(dqkv, {B, 2 * c, F}, z));
  expect_close("delta dg", ldg, zigzag_share(dg, {B, 2 * c, Hv}, z));
  expect_close("delta dbeta", ldbeta, zigzag_share(dbeta, {B, 2 * c, Hv}, z));
  if (holds_last) expect_close("the last chunk's final state", last_final, final);
  if (holds_first) expect_close("the first chunk's initial-state gradient", first_dinitial, dinitial);
}

void previous_tokens_case(const Comm& cp, int64_t n) {
  const int64_t B = 2, c = 5, chunks = 2 * cp.size(), S = chunks * c, F = 3;
  std::mt19937_64 rng(9);
  const Buffer x = random_f64(rng, {B, S, F}), dhistory_all = random_f64(rng, {B, chunks, n, F});
  const ZigzagSplit z = zigzag_split(S, cp.rank(), cp.size());
  const int64_t mine[2] = {z.first / c, z.second / c};
  // The reference: chunk j's history is x's rows [j c - n, j c); its gradient adds to the same rows.
  Buffer want(DType::f64, Device::cpu, {B, 2, n, F}), dx_whole = Buffer::zeros(DType::f64, Device::cpu, {B, S, F});
  Buffer dhistory(DType::f64, Device::cpu, {B, 2, n, F});
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < chunks; ++j)
      for (int64_t t = 0; t < n; ++t)
        for (int64_t f = 0; f < F; ++f) {
          const int64_t at = j * c - n + t;
          const double d = dhistory_all.ptr<double>()[((b * chunks + j) * n + t) * F + f];
          if (at >= 0) dx_whole.ptr<double>()[(b * S + at) * F + f] += d;
          for (int64_t p = 0; p < 2; ++p)
            if (mine[p] == j) {
              want.ptr<double>()[((b * 2 + p) * n + t) * F + f] = at >= 0 ? x.ptr<double>()[(b * S + at) * F + f] : 0.0;
              dhistory.ptr<double>()[((b * 2 + p) * n + t) * F + f] = d;
            }
        }
  const SequenceChain chain = sequence_chain(cp);
  const Buffer lx = zigzag_share(x, {B, 2 * c, F}, z);
  Buffer history(DType::f64, Device::cpu, {B, 2, n, F}), ldx = Buffer::zeros(DType::f64, Device::cpu, {B, 2 * c, F});
  chain.previous_tokens(history, lx);
  chain.previous_tokens_backward(ldx, dhistory);
  expect_close("history", history, want);
  expect_close("history's gradient in dx", ldx, zigzag_share(dx_whole, {B, 2 * c, F}, z));
}

}  // namespace

int main(int argc, char** argv) {
  return marrow::run_mpi_check(argc, argv, [](const marrow::Comm& cp) {
    for (const int64_t chunk : {3, 7, 64}) delta_rule_case(cp, chunk);
    for (const int64_t n : {1, 3, 5}) previous_tokens_case(cp, n);
    const double all_worst = cp.sum(worst_error(), "worst error (sum)");
    if (cp.rank() == 0)
      std::printf("sequence chain on %d processes: worst relative error %.2e against one process\nPASS\n", cp.size(), all_worst);
  });
}
