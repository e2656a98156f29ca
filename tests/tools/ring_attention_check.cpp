// Ring attention (parallel/ring_attention.h) over the processes of an mpirun job, the cp group
// being the whole job: each rank draws the same random sequence, runs the one-process causal op
// on all of it in f64 (the reference), takes its zigzag slices, runs ring attention forward and
// backward on them, and compares its out, lse, dq, dk, dv with the reference's slices. Both sides
// are exact f64 arithmetic in a different order (blocks merged one by one, gradients summed block
// by block), so they agree to ~1e-15 relative; 1e-12 leaves room for that and none for a wrong
// mask, block or hop (O(1) errors). Both orders of a block's backward run (halves, and fused as
// on the GPU's wgmma kernels). GPT-OSS's variant too: sinks (their gradient summed over the members)
// and sliding windows shorter than a chunk, across chunks and longer than the sequence. Packed K/V
// (DeepSeek's MLA under CP): each block expanded by linear maps k = packed Wk, v = packed Wv (v's head
// dim differing from k's), against the one-process op on the expanded whole: out, lse, dq, dpacked,
// and dWk, dWv summed over the members. Packed documents (data.document_mask) in both: boundaries
// inside a chunk, on a chunk's first token, and documents across two and three chunks.
// Run as `mpirun -np P ring_attention_check`; prints PASS or FAIL.
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "core/memory.h"
#include "mpi_check.h"
#include "ops/attention.h"
#include "parallel/comm.h"
#include "parallel/ring_attention.h"
#include "zigzag_compare.h"

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

// Each token's position in its document [B, S] (i32): row b cycles through documents of its
// lengths, so with chunks of 7 boundaries fall inside chunks, on chunk starts and across chunks.
Buffer documents_of(int64_t batch, int64_t seq) {
  Buffer p(DType::i32, Device::cpu, {batch, seq});
  for (int64_t b = 0; b < batch; ++b) {
    const std::vector<int64_t> lengths = b % 2 == 0 ? std::vector<int64_t>{3, 14, 4, 7} : std::vector<int64_t>{10, 1, 17};
    for (int64_t i = 0, doc = 0, at = 0; i < seq; ++i, ++at) {
      if (at == lengths[size_t(doc) % lengths.size()]) at = 0, ++doc;
      p.ptr<int32_t>()[b * seq + i] = int32_t(at);
    }
  }
  return p;
}

// This rank's documents of whole[B, S] (i32), or none.
Buffer local_documents(const Buffer& whole, const ZigzagSplit& z) {
  if (!whole.view().data) return Buffer();
  Buffer out(DType::i32, Device::cpu, {whole.view().size(0), 2 * z.chunk});
  zigzag_slice(out, whole, z);
  return out;
}

// window: the variant's sliding window (0: none); sinks: whether it has sinks; documents: packed documents.
void run_case(const Comm& cp, const Shape& n, int64_t window = 0, bool sinks = false, bool documents = false) {
  std::mt19937_64 rng(77);  // the same sequence on every rank
  Buffer q = random_f64(rng, {n.b, n.s, n.hq, n.d}), k = random_f64(rng, {n.b, n.s, n.hkv, n.d}),
         v = random_f64(rng, {n.b, n.s, n.hkv, n.d}), dout = random_f64(rng, {n.b, n.s, n.hq, n.d});
  Buffer sink_logits = random_f64(rng, {n.hq});
  const Buffer docs = documents ? documents_of(n.b, n.s) : Buffer();
  const AttentionVariant variant{sinks ? sink_logits.view() : Tensor{}, window, docs.view()};
  Buffer out(DType::f64, Device::cpu, {n.b, n.s, n.hq, n.d}), lse(DType::f64, Device::cpu, {n.b, n.hq, n.s});
  Buffer dq(DType::f64, Device::cpu, {n.b, n.s, n.hq, n.d}), dk(DType::f64, Device::cpu, {n.b, n.s, n.hkv, n.d}),
      dv(DType::f64, Device::cpu, {n.b, n.s, n.hkv, n.d});
  Buffer dsinks = Buffer::zeros(DType::f64, Device::cpu, {n.hq}), ldsinks = Buffer::zeros(DType::f64, Device::cpu, {n.hq});
  attention_forward(out, lse, q, k, v, variant);
  attention_backward(dq, dk, dv, sinks ? dsinks.view() : Tensor{}, dout, q, k, v, out, lse, variant);

  const ZigzagSplit z = zigzag_split(n.s, cp.rank(), cp.size());
  const int64_t sl = 2 * z.chunk;
  Buffer lq = zigzag_share(q, {n.b, sl, n.hq, n.d}, z), lk = zigzag_share(k, {n.b, sl, n.hkv, n.d}, z),
         lv = zigzag_share(v, {n.b, sl, n.hkv, n.d}, z), ldout = zigzag_share(dout, {n.b, sl, n.hq, n.d}, z);
  Buffer lout(DType::f64, Device::cpu, {n.b, sl, n.hq, n.d}), llse(DType::f64, Device::cpu, {n.b, n.hq, sl});
  Buffer ldq(DType::f64, Device::cpu, {n.b, sl, n.hq, n.d}), ldk(DType::f64, Device::cpu, {n.b, sl, n.hkv, n.d}),
      ldv(DType::f64, Device::cpu, {n.b, sl, n.hkv, n.d});
  const Buffer ldocs = local_documents(docs, z);
  const AttentionVariant local_variant{variant.sinks, window, ldocs.view()};
  ring_attention_forward(lout, llse, lq, lk, lv, cp, local_variant);
  ring_attention_backward(ldq, ldk, ldv, ldout, lq, lk, lv, lout, llse, cp, local_variant, sinks ? ldsinks.view() : Tensor{});

  expect_close("out", lout, zigzag_share(out, {n.b, sl, n.hq, n.d}, z));
  expect_close("lse", llse.view().reshape({n.b * n.hq, sl}),
               zigzag_share(lse.view().reshape({n.b * n.hq, n.s}), {n.b * n.hq, sl}, z));
  expect_close("dq", ldq, zigzag_share(dq, {n.b, sl, n.hq, n.d}, z));
  expect_close("dk", ldk, zigzag_share(dk, {n.b, sl, n.hkv, n.d}, z));
  expect_close("dv", ldv, zigzag_share(dv, {n.b, sl, n.hkv, n.d}, z));
  for (int64_t h = 0; h < n.hq; ++h) ldsinks.ptr<double>()[h] = cp.sum(ldsinks.ptr<double>()[h], "dsinks (sum)");
  expect_close("dsinks", ldsinks, dsinks);
}

// y[N, O] += x[N, I] w[I, O]; transpose: y[N, I] += x[N, O] w[I, O]^T. accumulate_weight: dw[I, O] += x^T dy.
void matmul(Tensor y, Tensor x, Tensor w, bool transpose = false) {
  const int64_t rows = x.size(0), in = w.size(0), out = w.size(1);
  const double *a = x.ptr<double>(), *b = w.ptr<double>();
  double* c = y.ptr<double>();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < in; ++i)
      for (int64_t o = 0; o < out; ++o) {
        if (transpose) c[r * in + i] += a[r * out + o] * b[i * out + o];
        else c[r * out + o] += a[r * in + i] * b[i * out + o];
      }
}
void accumulate_weight(Tensor dw, Tensor x, Tensor dy) {
  const int64_t rows = x.size(0), in = dw.size(0), out = dw.size(1);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < in; ++i)
      for (int64_t o = 0; o < out; ++o) dw.ptr<double>()[i * out + o] += x.ptr<double>()[r * in + i] * dy.ptr<double>()[r * out + o];
}

// The linear expansion of packed [B, S, W] with weights wk [W, Hkv D], wv [W, Hkv Dv], adding to dwk, dwv.
KvExpansion linear_expansion(const Shape& n, int64_t width, int64_t dv_dim, Tensor wk, Tensor wv, Tensor dwk, Tensor dwv) {
  auto two_d = [](Tensor t) { return t.reshape({t.size(0) * t.size(1), t.numel() / (t.size(0) * t.size(1))}); };
  KvExpansion e{width, n.hkv, n.d, dv_dim, {}, {}};
  e.expand = [=](Tensor k, Tensor v, Tensor packed) {
    fill_zero(k);
    fill_zero(v);
    matmul(two_d(k), two_d(packed), wk);
    matmul(two_d(v), two_d(packed), wv);
  };
  e.expand_backward = [=](Tensor dpacked, Tensor dk, Tensor dv, Tensor packed) {
    fill_zero(dpacked);
    matmul(two_d(dpacked), two_d(dk), wk, true);
    matmul(two_d(dpacked), two_d(dv), wv, true);
    accumulate_weight(dwk, two_d(packed), two_d(dk));
    accumulate_weight(dwv, two_d(packed), two_d(dv));
  };
  return e;
}

void sum_over_members(const Comm& cp, Tensor t) {
  for (int64_t i = 0; i < t.numel(); ++i) t.ptr<double>()[i] = cp.sum(t.ptr<double>()[i], "packed weight gradients (sum)");
}

// Packed K/V of `width` values a token expanded to k [.., Hkv, D] and v [.., Hkv, dv_dim].
void run_packed_case(const Comm& cp, const Shape& n, int64_t width, int64_t dv_dim, bool documents = false) {
  std::mt19937_64 rng(91);
  Buffer q = random_f64(rng, {n.b, n.s, n.hq, n.d}), packed = random_f64(rng, {n.b, n.s, width});
  Buffer wk = random_f64(rng, {width, n.hkv * n.d}), wv = random_f64(rng, {width, n.hkv * dv_dim});
  Buffer dout = random_f64(rng, {n.b, n.s, n.hq, dv_dim});
  Buffer dwk = Buffer::zeros(DType::f64, Device::cpu, {width, n.hkv * n.d}), dwv = Buffer::zeros(DType::f64, Device::cpu, {width, n.hkv * dv_dim});
  Buffer ldwk = Buffer::zeros(DType::f64, Device::cpu, {width, n.hkv * n.d}), ldwv = Buffer::zeros(DType::f64, Device::cpu, {width, n.hkv * dv_dim});
  const KvExpansion whole_e = linear_expansion(n, width, dv_dim, wk, wv, dwk, dwv), local_e = linear_expansion(n, width, dv_dim, wk, wv, ldwk, ldwv);
  Buffer k(DType::f64, Device::cpu, {n.b, n.s, n.hkv, n.d}), v(DType::f64, Device::cpu, {n.b, n.s, n.hkv, dv_dim});
  whole_e.expand(k, v, packed);
  Buffer out(DType::f64, Device::cpu, {n.b, n.s, n.hq, dv_dim}), lse(DType::f64, Device::cpu, {n.b, n.hq, n.s});
  Buffer dq(DType::f64, Device::cpu, {n.b, n.s, n.hq, n.d}), dk(DType::f64, Device::cpu, {n.b, n.s, n.hkv, n.d}),
      dv(DType::f64, Device::cpu, {n.b, n.s, n.hkv, dv_dim}), dpacked(DType::f64, Device::cpu, {n.b, n.s, width});
  const Buffer docs = documents ? documents_of(n.b, n.s) : Buffer();
  attention_forward(out, lse, q, k, v, {.documents = docs.view()});
  attention_backward(dq, dk, dv, {}, dout, q, k, v, out, lse, {.documents = docs.view()});
  whole_e.expand_backward(dpacked, dk, dv, packed);

  const ZigzagSplit z = zigzag_split(n.s, cp.rank(), cp.size());
  const int64_t sl = 2 * z.chunk;
  Buffer lq = zigzag_share(q, {n.b, sl, n.hq, n.d}, z), lpacked = zigzag_share(packed, {n.b, sl, width}, z), ldout = zigzag_share(dout, {n.b, sl, n.hq, dv_dim}, z);
  Buffer lout(DType::f64, Device::cpu, {n.b, sl, n.hq, dv_dim}), llse(DType::f64, Device::cpu, {n.b, n.hq, sl});
  Buffer ldq(DType::f64, Device::cpu, {n.b, sl, n.hq, n.d}), ldpacked(DType::f64, Device::cpu, {n.b, sl, width});
  const Buffer ldocs = local_documents(docs, z);
  ring_attention_forward_packed(lout, llse, lq, lpacked, local_e, cp, ldocs.view());
  ring_attention_backward_packed(ldq, ldpacked, ldout, lq, lpacked, lout, llse, local_e, cp, ldocs.view());

  expect_close("packed out", lout, zigzag_share(out, {n.b, sl, n.hq, dv_dim}, z));
  expect_close("packed lse", llse.view().reshape({n.b * n.hq, sl}), zigzag_share(lse.view().reshape({n.b * n.hq, n.s}), {n.b * n.hq, sl}, z));
  expect_close("packed dq", ldq, zigzag_share(dq, {n.b, sl, n.hq, n.d}, z));
  expect_close("dpacked", ldpacked, zigzag_share(dpacked, {n.b, sl, width}, z));
  sum_over_members(cp, ldwk);
  sum_over_members(cp, ldwv);
  expect_close("dWk (sum)", ldwk, dwk);
  expect_close("dWv (sum)", ldwv, dwv);
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
    // Packed K/V: 6 values a token to 2 heads of k 8 and v 4; to 1 head of k 16 and v 8 with GQA 4.
    for (const bool fused : {false, true}) {
      marrow::set_cpu_blocks_fused(fused);
      run_packed_case(cp, {2, chunks * 7, 4, 2, 8}, 6, 4);
      run_packed_case(cp, {1, chunks * 5, 4, 1, 16}, 5, 8);
      run_packed_case(cp, {2, chunks * 7, 4, 2, 8}, 6, 4, true);
    }
    // Packed documents: alone, with windows inside a chunk and across chunks, with sinks.
    for (const bool fused : {false, true}) {
      marrow::set_cpu_blocks_fused(fused);
      for (const int64_t window : {int64_t(0), int64_t(3), int64_t(9)}) run_case(cp, {2, chunks * 7, 4, 2, 8}, window, window > 0, true);
    }
    marrow::set_cpu_blocks_fused(false);
    const double all_worst = cp.sum(worst_error(), "worst error (sum)");
    if (cp.rank() == 0)
      std::printf("ring attention on %d processes: worst relative error %.2e against one process\nPASS\n", cp.size(),
                  all_worst);
  });
}
