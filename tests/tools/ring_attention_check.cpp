// Ring attention (parallel/ring_attention.h) over the processes of an mpirun job, the cp group
// being the whole job: each rank draws the same random sequence, runs the one-process causal op
// on all of it in f64 (the reference), takes its zigzag slices, runs ring attention forward and
// backward on them, and compares its out, lse, dq, dk, dv with the reference's slices. Both sides
// are exact f64 arithmetic in a different order (blocks merged one by one, gradients summed block
// by block), so they agree to ~1e-15 relative; 1e-12 leaves room for that and none for a wrong
// mask, block or hop (O(1) errors). Both orders of a block's backward run (halves, and fused as
// on the GPU's wgmma kernels). GPT-OSS's variant too: sinks (their gradient summed over the members)
// and sliding windows shorter than a chunk, across chunks and longer than the sequence.
// Run as `mpirun -np P ring_attention_check`; prints PASS or FAIL.
#include <cmath>
#include <cstdio>
#include <random>

#include "core/memory.h"
#include "mpi_check.h"
#include "ops/attention.h"
#include "parallel/comm.h"
#include "parallel/ring_attention.h"

namespace {

using namespace marrow;

struct Shape {
  int64_t b, s, hq, hkv, d;
};

Buffer random_f64(std::mt19937_64& rng, std::initializer_list<int64_t> dims) {
  Buffer t(DType::f64, Device::cpu, dims);
  std::normal_distribution<double> normal;
  for (int64_t i = 0; i < t.numel(); ++i) t.ptr<double>()[i] = normal(rng);
  return t;
}

// This rank's tokens of whole[N, S, ...] as a new buffer of `local` shape.
Buffer slice(Tensor whole, std::initializer_list<int64_t> local, const ZigzagSplit& z) {
  Buffer out(DType::f64, Device::cpu, local);
  zigzag_slice(out, whole, z);
  return out;
}

double worst = 0;
void expect_close(const char* what, const Tensor& got, const Tensor& want, int rank) {
  for (int64_t i = 0; i < want.numel(); ++i) {
    const double g = got.ptr<double>()[i], w = want.ptr<double>()[i];
    const double error = std::abs(g - w) / (1 + std::abs(w));
    worst = std::max(worst, error);
    MARROW_CHECK(error <= 1e-12, "rank {}: {}[{}] is {} but the one-process op gives {}", rank, what, i, g, w);
  }
}

// window: the variant's sliding window (0: none); sinks: whether it has sinks.
void run_case(const Comm& cp, const Shape& n, int64_t window = 0, bool sinks = false) {
  std::mt19937_64 rng(77);  // the same sequence on every rank
  Buffer q = random_f64(rng, {n.b, n.s, n.hq, n.d}), k = random_f64(rng, {n.b, n.s, n.hkv, n.d}),
         v = random_f64(rng, {n.b, n.s, n.hkv, n.d}), dout = random_f64(rng, {n.b, n.s, n.hq, n.d});
  Buffer sink_logits = random_f64(rng, {n.hq});
  const AttentionVariant variant{sinks ? sink_logits.view() : Tensor{}, window};
  Buffer out(DType::f64, Device::cpu, {n.b, n.s, n.hq, n.d}), lse(DType::f64, Device::cpu, {n.b, n.hq, n.s});
  Buffer dq(DType::f64, Device::cpu, {n.b, n.s, n.hq, n.d}), dk(DType::f64, Device::cpu, {n.b, n.s, n.hkv, n.d}),
      dv(DType::f64, Device::cpu, {n.b, n.s, n.hkv, n.d});
  Buffer dsinks = Buffer::zeros(DType::f64, Device::cpu, {n.hq}), ldsinks = Buffer::zeros(DType::f64, Device::cpu, {n.hq});
  attention_forward(out, lse, q, k, v, variant);
  attention_backward(dq, dk, dv, sinks ? dsinks.view() : Tensor{}, dout, q, k, v, out, lse, variant);

  const ZigzagSplit z = zigzag_split(n.s, cp.rank(), cp.size());
  const int64_t sl = 2 * z.chunk;
  Buffer lq = slice(q, {n.b, sl, n.hq, n.d}, z), lk = slice(k, {n.b, sl, n.hkv, n.d}, z),
         lv = slice(v, {n.b, sl, n.hkv, n.d}, z), ldout = slice(dout, {n.b, sl, n.hq, n.d}, z);
  Buffer lout(DType::f64, Device::cpu, {n.b, sl, n.hq, n.d}), llse(DType::f64, Device::cpu, {n.b, n.hq, sl});
  Buffer ldq(DType::f64, Device::cpu, {n.b, sl, n.hq, n.d}), ldk(DType::f64, Device::cpu, {n.b, sl, n.hkv, n.d}),
      ldv(DType::f64, Device::cpu, {n.b, sl, n.hkv, n.d});
  ring_attention_forward(lout, llse, lq, lk, lv, cp, variant);
  ring_attention_backward(ldq, ldk, ldv, ldout, lq, lk, lv, lout, llse, cp, variant, sinks ? ldsinks.view() : Tensor{});

  expect_close("out", lout, slice(out, {n.b, sl, n.hq, n.d}, z), cp.rank());
  expect_close("lse", llse.view().reshape({n.b * n.hq, sl}),
               slice(lse.view().reshape({n.b * n.hq, n.s}), {n.b * n.hq, sl}, z), cp.rank());
  expect_close("dq", ldq, slice(dq, {n.b, sl, n.hq, n.d}, z), cp.rank());
  expect_close("dk", ldk, slice(dk, {n.b, sl, n.hkv, n.d}, z), cp.rank());
  expect_close("dv", ldv, slice(dv, {n.b, sl, n.hkv, n.d}, z), cp.rank());
  for (int64_t h = 0; h < n.hq; ++h) ldsinks.ptr<double>()[h] = cp.sum(ldsinks.ptr<double>()[h], "dsinks (sum)");
  expect_close("dsinks", ldsinks, dsinks, cp.rank());
}

}  // namespace

int main(int argc, char** argv) {
  return marrow::run_mpi_check(argc, argv, [](const marrow::Comm& cp) {
    const int64_t chunks = 2 * cp.size();
    // GQA groups of 2 and 4, chunks of 7 and 5 tokens (no tile size divides them), head_dim 8 and 64;
    // each with the blocks' backward in two halves and fused (the GPU's wgmma kernels' order).
    for (const bool fused : {false, true}) {
      marrow::set_cpu_blocks_fused(fused);
      run_case(cp, {2, chunks * 7, 4, 2, 8});
      run_case(cp, {1, chunks * 5, 4, 1, 64});
    }
    marrow::set_cpu_blocks_fused(false);
    // GPT-OSS's variant on chunks of 7: windows of 1, 3 (inside a chunk), 9 and 2 chunks + 1 (across
    // chunks), the whole sequence; with and without sinks; the blocks' backward in both orders.
    for (const bool fused : {false, true}) {
      marrow::set_cpu_blocks_fused(fused);
      for (const int64_t window : {int64_t(1), int64_t(3), int64_t(9), int64_t(15), chunks * 7})
        for (const bool sinks : {false, true}) run_case(cp, {2, chunks * 7, 4, 2, 8}, window, sinks);
      run_case(cp, {1, chunks * 5, 4, 1, 16}, 0, true);
    }
    marrow::set_cpu_blocks_fused(false);
    const double all_worst = cp.sum(worst, "worst error (sum)");
    if (cp.rank() == 0)
      std::printf("ring attention on %d processes: worst relative error %.2e against one process\nPASS\n", cp.size(),
                  all_worst);
  });
}
