// marrow check, attention group: the causal op on every set_attention_kernels setting (rows of
// cuDNN's name it; its non-deterministic backward has no "same bits" rows), cuDNN's backward in
// forced query chunks ("chunk N"), the wgmma kernels, ring attention's blocks and log-sum-exp merge,
// GPT-OSS's variant (windows, sinks) and packed documents (own kernels), against the f32 CPU reference at odd lengths, GQA groups
// 1, 4 and 8, head_dim 64 and 128 and the bench shape (B 1, S 4096, 32 / 4 heads of 128), and
// DeepSeek-V2's head dims (q, k 192, v 128: cuDNN's under every setting, rows "D192 Dv128").
//
// Bounds, as error = max |gpu - cpu| / max |cpu| (check.h). Both sides read the same bf16 inputs,
// and the tensor cores multiply bf16 operands exactly into f32 accumulators, so the GPU's coarse
// roundings are only these: P (forward, dv) and dS (dq, dk) rounded to bf16 as operands of the
// second product, 2^-9 relative per term and of random sign, and the bf16 outputs, 2^-9 relative
// to each element. A numpy model of the kernels' arithmetic measured 2e-3 to 4e-3 on these shapes;
// the bounds leave a 5-10x margin without hiding a wrong mask or a wrong row (those give O(1)).
// lse never passes through bf16: exact scores, an f32 running max and sum (exp2 on the SFU, about
// 2^-22 relative), so its error is near f32 rounding, ~1e-7 of |lse| >= O(1); 1e-4 still leaves
// room for a sum of 4096 terms in another order.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <iterator>
#include <utility>
#include <vector>

#include "gpu_check/check.h"
#include "core/errors.h"
#include "ops/attention.h"
#include "ops/attention_cudnn.h"
#include "ops/attention_hopper.h"

namespace marrow {
namespace {

constexpr double kOutBound = 2e-2;
constexpr double kLseBound = 1e-4;
constexpr double kGradBound = 3e-2;
constexpr DType bf16 = DType::bf16, f32 = DType::f32;

// d: q's and k's head dim; dv: v's and out's (0: d).
struct Shape {
  int64_t b, s, hq, hkv, d, dv = 0;
  int64_t vd() const { return dv ? dv : d; }
};

// The head dims in a row's name: "D128", or "D192 Dv128" where v's differs.
std::string dims_label(const Shape& n) { return n.vd() == n.d ? fmt::format("D{}", n.d) : fmt::format("D{} Dv{}", n.d, n.vd()); }

// How cuDNN's deterministic backward is forced to split (rows "... chunk 64"); empty for its own plan.
std::string backward_variant;

// Rows of the causal op name the kernels that ran it when they are cuDNN's.
std::string label(const std::string& what, const Shape& n) {
  const std::string kernels =
      attention_kernels() == AttentionKernels::own ? "" : fmt::format(" {}", attention_kernels_name(attention_kernels()));
  return fmt::format("attention{}{} {} B{} S{} H{}/{} {}", kernels, backward_variant, what, n.b, n.s, n.hq, n.hkv, dims_label(n));
}

Buffer rows4(int64_t b, int64_t s, int64_t heads, int64_t d) { return Buffer(f32, Device::cpu, {b, s, heads, d}); }

// A host f32 copy rounded to bf16: the out that both backwards read, as the GPU's would be.
Buffer rounded(Tensor out) {
  Buffer b = rows4(out.size(0), out.size(1), out.size(2), out.size(3));
  copy(b, out);
  round_to_bf16(b);
  return b;
}

// Inputs (rounded to bf16, with their GPU copies) and the CPU reference's results; q [B, S], k and v
// [B, kv_seq]. Seeds depend on the seed and the tensor only, so a problem at S = 1024 (B = 1) holds
// exactly the first 1024 positions of the same problem at S = 4096.
struct Problem {
  Shape n;
  int64_t kv_seq;
  Both q, k, v, dout;
  Buffer out{}, lse{}, dq{}, dk{}, dv{}, out_bf16{};
};

Problem make_inputs(const Shape& n, uint64_t seed, int64_t kv_seq = 0) {
  const int64_t kv = kv_seq ? kv_seq : n.s;
  return {n, kv, Both(random_bf16({n.b, n.s, n.hq, n.d}, seed), bf16), Both(random_bf16({n.b, kv, n.hkv, n.d}, seed + 1), bf16),
          Both(random_bf16({n.b, kv, n.hkv, n.vd()}, seed + 2), bf16), Both(random_bf16({n.b, n.s, n.hq, n.vd()}, seed + 3), bf16)};
}

// With a variant (GPT-OSS's sinks and window; the plain op's bits without one), dsinks [Hq] gets the
// sinks' gradient.
Problem reference(const Shape& n, uint64_t seed, const AttentionVariant& variant = {}, Tensor dsinks = {}) {
  Problem p = make_inputs(n, seed);
  p.out = rows4(n.b, n.s, n.hq, n.vd());
  p.lse = Buffer(f32, Device::cpu, {n.b, n.hq, n.s});
  attention_forward(p.out, p.lse, p.q.cpu, p.k.cpu, p.v.cpu, variant);
  p.out_bf16 = rounded(p.out);
  p.dq = rows4(n.b, n.s, n.hq, n.d), p.dk = rows4(n.b, n.s, n.hkv, n.d), p.dv = rows4(n.b, n.s, n.hkv, n.vd());
  attention_backward(p.dq, p.dk, p.dv, dsinks, p.dout.cpu, p.q.cpu, p.k.cpu, p.v.cpu, p.out_bf16, p.lse, variant);
  return p;
}

// The GPU side of a problem; every run's outputs are freshly poisoned.
struct Gpu {
  const Problem& p;
  Buffer out{}, lse{}, dq{}, dk{}, dv{};

  void forward(const AttentionVariant& variant = {}) {
    out = poisoned(bf16, {p.n.b, p.n.s, p.n.hq, p.n.vd()});
    lse = poisoned(f32, {p.n.b, p.n.hq, p.n.s});
    attention_forward(out, lse, p.q.gpu, p.k.gpu, p.v.gpu, variant);
  }
  // Backward from the given out and lse (by default the forward's own); with sinks, dsinks is added to.
  void backward(Tensor out_in = {}, Tensor lse_in = {}, const AttentionVariant& variant = {}, Tensor dsinks = {}) {
    dq = poisoned(bf16, {p.n.b, p.n.s, p.n.hq, p.n.d});
    dk = poisoned(bf16, {p.n.b, p.n.s, p.n.hkv, p.n.d});
    dv = poisoned(bf16, {p.n.b, p.n.s, p.n.hkv, p.n.vd()});
    attention_backward(dq, dk, dv, dsinks, p.dout.gpu, p.q.gpu, p.k.gpu, p.v.gpu, out_in.data ? out_in : out.view(),
                       lse_in.data ? lse_in : lse.view(), variant);
  }
  std::array<std::pair<const char*, const Buffer*>, 5> results() const {
    return {{{"out", &out}, {"lse", &lse}, {"dq", &dq}, {"dk", &dk}, {"dv", &dv}}};
  }
};

// Like report.compare, but where the reference is exactly zero (S = 1: the only key has
// probability 1, so dS = 0 and dq = dk = 0) the relative error has no scale: there the row
// measures the absolute error against the same bound, on O(1) inputs.
void compare(CheckReport& report, const std::string& name, Tensor gpu, Tensor cpu, double bound) {
  if (std::any_of(cpu.ptr<float>(), cpu.ptr<float>() + cpu.numel(), [](float c) { return c != 0.f; }))
    return report.compare(name, gpu, cpu, bound);
  Buffer got = to_host_f32(gpu);
  double max_abs = 0;
  bool finite = true;
  for (int64_t i = 0; i < got.numel(); ++i) {
    finite = finite && std::isfinite(got.ptr<float>()[i]);
    max_abs = std::max(max_abs, double(std::abs(got.ptr<float>()[i])));
  }
  const double error = finite ? max_abs : INFINITY;
  report.add({name + " (abs, ref 0)", error, bound, finite && error <= bound});
}

// The gradients' rows against the reference's.
template <class Name>
void compare_grads(CheckReport& report, const Problem& p, const Gpu& g, const Name& name) {
  compare(report, name("dq"), g.dq, p.dq, kGradBound);
  compare(report, name("dk"), g.dk, p.dk, kGradBound);
  compare(report, name("dv"), g.dv, p.dv, kGradBound);
}

void check_shape(CheckReport& report, const Problem& p) {
  Gpu g{p};
  g.forward();
  compare(report, label("out", p.n), g.out, p.out, kOutBound);
  compare(report, label("lse", p.n), g.lse, p.lse, kLseBound);
  // The backward reads the reference's out and lse, so its rows measure the backward alone.
  const Both out_in(p.out_bf16, bf16), lse_in(p.lse, f32);
  g.backward(out_in.gpu, lse_in.gpu);
  compare_grads(report, p, g, [&](const char* what) { return label(what, p.n); });
}

// The bench shape (and the same at head_dim 64, which the wgmma kernels leave to cuDNN): the CPU
// reference of S = 4096 takes minutes (O(S^2 D H)), so the reference runs at S = 1024 on the same
// inputs' first 1024 positions. Causality makes the bench run's first 1024 rows of out, lse and dq
// functions of those positions alone, computed by the very same tiles, so they are compared with
// that reference; every S = 4096 result must be finite (poison shows), and a second run must give
// the same bits (no atomics, DESIGN.md §4).
void check_bench(CheckReport& report, int64_t head_dim) {
  const Shape bench{1, 4096, 32, 4, head_dim}, prefix{1, 1024, 32, 4, head_dim};
  const uint64_t seed = 500 + uint64_t(head_dim);
  const Problem ref = reference(prefix, seed);
  check_shape(report, ref);

  const Problem p = make_inputs(bench, seed);
  Gpu first{p}, second{p};
  for (Gpu* g : {&first, &second}) {
    g->forward();
    g->backward();
  }
  const int64_t rows = prefix.s * prefix.hq * prefix.d;  // B = 1: a prefix of positions is a prefix of memory
  auto head = [&](const Buffer& b) { return b.view().reshape({bench.s * bench.hq * bench.d}).rows(0, rows); };
  report.compare(label("out[:1024]", bench), head(first.out), ref.out, kOutBound);
  report.compare(label("dq[:1024]", bench), head(first.dq), ref.dq, kGradBound);
  Buffer lse = to_host_f32(first.lse), lse_prefix(f32, Device::cpu, {prefix.b, prefix.hq, prefix.s});
  for (int64_t h = 0; h < bench.hq; ++h)
    std::memcpy(lse_prefix.ptr<float>() + h * prefix.s, lse.ptr<float>() + h * bench.s, size_t(prefix.s) * sizeof(float));
  report.compare(label("lse[:1024]", bench), lse_prefix, ref.lse, kLseBound);
  for (size_t i = 0; i < first.results().size(); ++i) {
    const auto [what, result] = first.results()[i];
    report.expect_finite(label(fmt::format("{} finite", what), bench), *result);
    if (attention_kernels() == AttentionKernels::cudnn_nondeterministic) continue;  // its dq differs run to run
    report.expect_same_bits(label(fmt::format("{} same bits", what), bench), *second.results()[i].second, *result);
  }
}

// Head dims without a kernel are a clear error, not a launch.
void check_rejects_head_dim(CheckReport& report) {
  Buffer q(bf16, Device::cuda, {1, 4, 2, 96}), kv(bf16, Device::cuda, {1, 4, 1, 96}), out(bf16, Device::cuda, {1, 4, 2, 96}),
      lse(f32, Device::cuda, {1, 2, 4});
  report.expect("attention rejects head_dim 96 on the GPU", refuses([&] { attention_forward(out, lse, q, kv, kv); }));
  // A v head dim unlike q's and k's that cuDNN does not serve either (only 192 / 128 mixes).
  Buffer q128(bf16, Device::cuda, {1, 4, 2, 128}), k128(bf16, Device::cuda, {1, 4, 1, 128}), v64(bf16, Device::cuda, {1, 4, 1, 64}),
      out64(bf16, Device::cuda, {1, 4, 2, 64});
  report.expect("attention rejects head dims 128 / 64 (q, k / v) on the GPU",
                refuses([&] { attention_forward(out64, lse, q128, k128, v64); }));
}

// Blocks (ring attention): q[B, Sq] against k, v[B, Sk] on sub-ranges, full and causal.
struct BlockCase {
  Shape n;  // n.s is Sq
  int64_t kv_seq;
  AttentionBlock block;
  bool fused = false;  // must run as one kernel for all three gradients, wgmma's or cuDNN's (a row says whether it does)
  const Both* documents = nullptr;  // packed documents [B, Sq] (i32), or none
  // The block on side 0 (the CPU) or 1 (the GPU), with that side's documents.
  AttentionBlock on(int side) const {
    AttentionBlock b = block;
    if (documents) b.documents = (*documents)[side];
    return b;
  }
};

std::string block_label(const char* what, const BlockCase& c) {
  const AttentionBlock& b = c.block;
  const std::string window = b.window > 0 || c.documents ? fmt::format(" window {} distance {}", b.window, b.distance) : "";
  return fmt::format("attention block {} {}{}{} q[{}, {}) k[{}, {}) B{} Sq{} Sk{} H{}/{} {}", what,
                     b.mask == AttentionMask::full ? "full" : "causal", c.documents ? " documents" : "", window, b.q_begin, b.q_end, b.k_begin, b.k_end, c.n.b,
                     c.n.s, c.kv_seq, c.n.hq, c.n.hkv, dims_label(c.n));
}

// lse against the reference where some rows saw no key (a windowed block's: -inf, which the GPU must
// give exactly); elsewhere the relative error against the largest finite |lse|, as report.compare.
void compare_lse(CheckReport& report, const std::string& name, Tensor gpu, const Buffer& cpu) {
  Buffer got = to_host_f32(gpu);
  double max_diff = 0, max_ref = 0;
  bool ok = true;
  for (int64_t i = 0; i < got.numel(); ++i) {
    const float g = got.ptr<float>()[i], w = cpu.ptr<float>()[i];
    if (std::isinf(w)) {
      ok = ok && g == w;
      continue;
    }
    ok = ok && std::isfinite(g);
    max_diff = std::max(max_diff, double(std::abs(g - w)));
    max_ref = std::max(max_ref, double(std::abs(w)));
  }
  const double error = ok ? max_diff / std::max(max_ref, 1e-30) : INFINITY;
  report.add({name, error, kLseBound, ok && error <= kLseBound});
}

// The block forward (rows outside the block must keep their zeros), then the block backward from
// the block's own out and lse added into random f32 gradients: the GPU's sums minus those starting
// values against the CPU's share.
void check_block(CheckReport& report, const BlockCase& c, uint64_t seed) {
  const Shape& n = c.n;
  Problem p = make_inputs(n, seed, c.kv_seq);
  auto zeros = [](std::initializer_list<int64_t> dims) { return Buffer::zeros(f32, Device::cpu, dims); };
  p.out = zeros({n.b, n.s, n.hq, n.vd()}), p.lse = zeros({n.b, n.hq, n.s}), p.dq = zeros({n.b, n.s, n.hq, n.d});
  p.dk = zeros({n.b, c.kv_seq, n.hkv, n.d}), p.dv = zeros({n.b, c.kv_seq, n.hkv, n.vd()});
  attention_block_forward(p.out, p.lse, p.q.cpu, p.k.cpu, p.v.cpu, c.on(0));
  if (c.fused)
    report.expect(block_label(n.vd() == n.d ? "on the wgmma kernels" : "on cuDNN", c),
                  attention_block_backward_fused(p.q.gpu, p.k.gpu, c.block, p.v.gpu));
  Buffer out = Buffer::zeros(bf16, Device::cuda, {n.b, n.s, n.hq, n.vd()}), lse = Buffer::zeros(f32, Device::cuda, {n.b, n.hq, n.s});
  attention_block_forward(out, lse, p.q.gpu, p.k.gpu, p.v.gpu, c.on(1));
  compare(report, block_label("out", c), out, p.out, kOutBound);
  compare_lse(report, block_label("lse", c), lse, p.lse);

  p.out_bf16 = rounded(p.out);
  attention_block_backward(p.dq, p.dk, p.dv, p.dout.cpu, p.q.cpu, p.k.cpu, p.v.cpu, p.out_bf16, p.lse, c.on(0));
  const Both out_in(p.out_bf16, bf16), lse_in(p.lse, f32);
  const Buffer base[3] = {random_host({n.b, n.s, n.hq, n.d}, seed + 4), random_host({n.b, c.kv_seq, n.hkv, n.d}, seed + 5),
                          random_host({n.b, c.kv_seq, n.hkv, n.vd()}, seed + 6)};
  const Both grads[3] = {Both(base[0], f32), Both(base[1], f32), Both(base[2], f32)};
  const Both halves[3] = {Both(base[0], f32), Both(base[1], f32), Both(base[2], f32)};
  auto backward = [&](const Both* g, AttentionGrads half) {
    attention_block_backward(g[0].gpu, g[1].gpu, g[2].gpu, p.dout.gpu, p.q.gpu, p.k.gpu, p.v.gpu, out_in.gpu, lse_in.gpu, c.on(1), half);
  };
  backward(grads, AttentionGrads::all);
  // Ring attention runs the kv half and the q half apart: together they must give the whole's bits.
  for (AttentionGrads half : {AttentionGrads::kv, AttentionGrads::q}) backward(halves, half);
  const std::pair<const char*, const Buffer*> want[3] = {{"dq", &p.dq}, {"dk", &p.dk}, {"dv", &p.dv}};
  for (int i = 0; i < 3; ++i)
    report.expect_same_bits(block_label(want[i].first, c) + " (kv half, then q half: the whole's bits)", halves[i].gpu, grads[i].gpu);
  for (int i = 0; i < 3; ++i) {
    Buffer added = to_host_f32(grads[i].gpu);
    for (int64_t e = 0; e < added.numel(); ++e) added.ptr<float>()[e] -= base[i].ptr<float>()[e];
    compare(report, block_label(want[i].first, c), added, *want[i].second, kGradBound);
  }
}

// The merge of two partials (keys [0, 20) and [20, 45) in full) into a running result at (0, -inf),
// on query rows [3, 30) of 37: f32 arithmetic on the same inputs (the partial out rounded to bf16
// on both sides), so 1e-5 of the largest element bounds it; rows outside must keep 0 and -inf. Then
// the sinks joining the merged result (ring attention with GPT-OSS's sinks); rows outside [3, 30)
// saw no key, so they take the sink's lse and keep out 0.
void check_merge(CheckReport& report) {
  const Shape n{2, 37, 8, 2, 64};
  const int64_t begin = 3, end = 30;
  Buffer q = random_host({n.b, n.s, n.hq, n.d}, 700), k = random_host({n.b, 45, n.hkv, n.d}, 701), v = random_host({n.b, 45, n.hkv, n.d}, 702);
  Buffer out = Buffer::zeros(f32, Device::cpu, {n.b, n.s, n.hq, n.d}), lse(f32, Device::cpu, {n.b, n.hq, n.s}), sinks = random_bf16({n.hq}, 703);
  std::fill(lse.ptr<float>(), lse.ptr<float>() + lse.numel(), -INFINITY);
  const Both merged_out(out, f32), merged_lse(lse, f32);
  for (const auto& [k0, k1] : {std::pair{int64_t(0), int64_t(20)}, std::pair{int64_t(20), int64_t(45)}}) {
    Buffer part = Buffer::zeros(f32, Device::cpu, {n.b, n.s, n.hq, n.d}), part_lse = Buffer::zeros(f32, Device::cpu, {n.b, n.hq, n.s});
    attention_block_forward(part, part_lse, q, k, v, {AttentionMask::full, begin, end, k0, k1});
    round_to_bf16(part);
    const Both part_both(part, bf16), part_lse_both(part_lse, f32);
    on_each_side([&](int s) { attention_merge(merged_out[s], merged_lse[s], part_both[s], part_lse_both[s], begin, end); });
  }
  report.compare("attention merge out B2 S37 rows [3, 30) H8 D64", merged_out, 1e-5);
  Buffer got_lse = to_host_f32(merged_lse.gpu);
  double error = 0;
  for (int64_t i = 0; i < lse.numel(); ++i) {
    const float g = got_lse.ptr<float>()[i], w = lse.ptr<float>()[i];
    error = std::max(error, std::isinf(w) ? (g == w ? 0.0 : INFINITY) : std::abs(double(g) - w));
  }
  report.add({"attention merge lse B2 S37 rows [3, 30) (abs; -inf outside)", error, 1e-5, error <= 1e-5});
  const Both sinks_both(sinks, bf16);
  on_each_side([&](int s) { attention_sinks_merge(merged_out[s], merged_lse[s], sinks_both[s]); });
  report.compare("attention sinks merge out B2 S37 H8 D64", merged_out, 1e-5);
  report.compare("attention sinks merge lse B2 S37 H8 D64", merged_lse, 1e-6);
}

// GPT-OSS's variant (ops/attention.h's AttentionVariant): the causal op with a sliding window
// (shorter than a tile, across tiles, longer than the sequence) and sinks, against the CPU's variant
// op, on the own kernels' V instantiations (setting own) and on cuDNN's (hopper_backward, the
// default: the wgmma kernels take no variant), or the settings given, each run twice for the same
// bits; the sinks' gradient from attention_sinks_backward's kernel. The sinks are bf16 like the
// working weights. With packed documents (i32 [B, S]) the rows say "documents".
void check_variant(CheckReport& report, const Shape& n, int64_t window, bool with_sinks, uint64_t seed,
                   std::initializer_list<AttentionKernels> settings = {AttentionKernels::own, AttentionKernels::hopper_backward},
                   const Both* documents = nullptr) {
  Buffer dsinks = Buffer::zeros(f32, Device::cpu, {n.hq});
  const Both sinks(random_bf16({n.hq}, seed + 4), bf16);
  const Problem p = reference(n, seed, AttentionVariant{with_sinks ? sinks.cpu : Tensor{}, window, documents ? documents->cpu : Tensor{}},
                              with_sinks ? dsinks.view() : Tensor{});
  const AttentionVariant variant{with_sinks ? sinks.gpu : Tensor{}, window, documents ? documents->gpu : Tensor{}};
  // The backward reads the reference's out and lse, so its rows measure the backward alone.
  const Both out_in(p.out_bf16, bf16), lse_in(p.lse, f32);
  const std::string what = fmt::format("{} window {}{}", documents ? "documents" : "variant", window, with_sinks ? " sinks" : "");
  auto name = [&](const std::string& tensor) { return label(fmt::format("{} {}", what, tensor), n); };
  for (const AttentionKernels kernels : settings) {
    set_attention_kernels(kernels);
    Gpu runs[2] = {Gpu{p}, Gpu{p}};
    Buffer run_dsinks[2];
    for (int r = 0; r < 2; ++r) {
      run_dsinks[r] = Buffer::zeros(f32, Device::cuda, {n.hq});
      runs[r].forward(variant);
      runs[r].backward(out_in.gpu, lse_in.gpu, variant, with_sinks ? run_dsinks[r].view() : Tensor{});
    }
    report.compare(name("out"), runs[0].out, p.out, kOutBound);
    report.compare(name("lse"), runs[0].lse, p.lse, kLseBound);
    // A window of 1 gives every row one key of probability 1, so dq = dk = 0 exactly on the CPU: compare's absolute rows.
    compare_grads(report, p, runs[0], name);
    if (with_sinks) compare(report, name("dsinks"), run_dsinks[0], dsinks, kGradBound);
    for (size_t i = 0; i < runs[0].results().size(); ++i) {
      const auto [tensor, result] = runs[0].results()[i];
      report.expect_same_bits(name(fmt::format("{} same bits", tensor)), *runs[1].results()[i].second, *result);
    }
    if (with_sinks) report.expect_same_bits(name("dsinks same bits"), run_dsinks[1], run_dsinks[0]);
  }
}

// cuDNN's deterministic backward in query chunks, which its plan takes only past the workspace cap
// (S > 16384 at the bench's heads), forced here: chunks that do not divide odd lengths (the first
// chunk is the short one, a single row joins the next), both head dims, two batch rows; chunks within
// two key/value head groups (a cap that one call over all heads passes); the bench shape in chunks of
// 1024 (its first 1024 rows against the reference, the same bits twice).
void check_cudnn_chunks(CheckReport& report) {
  set_attention_kernels(AttentionKernels::cudnn);
  const std::pair<Shape, int64_t> chunked[] = {
      {{2, 37, 8, 2, 64}, 16},     // chunks 5 + 16 + 16
      {{1, 257, 4, 4, 128}, 64},   // 65 + 3 x 64
      {{1, 129, 8, 1, 64}, 64},    // 65 + 64
      {{1, 300, 8, 2, 128}, 128},  // 44 + 2 x 128
  };
  uint64_t chunk_seed = 900;
  for (const auto& [n, rows] : chunked) {
    set_cudnn_backward_chunk(rows);
    backward_variant = fmt::format(" chunk {}", rows);
    check_shape(report, reference(n, chunk_seed += 4));
  }
  set_cudnn_backward_chunk(64);
  set_cudnn_backward_workspace_cap(100000);  // one call of 4 heads x 64 x 320 x 2 B = 160 KiB passes; 2 heads fit
  backward_variant = " chunk 64 in 2 head groups";
  check_shape(report, reference({1, 257, 4, 4, 128}, chunk_seed += 4));
  set_cudnn_backward_workspace_cap(0);
  backward_variant = " chunk 64";  // the window's band aligned to each chunk's last row
  check_variant(report, {1, 300, 16, 2, 64}, 128, true, chunk_seed += 8, {AttentionKernels::cudnn});
  set_cudnn_backward_chunk(1024);
  backward_variant = " chunk 1024";
  check_bench(report, 128);
  set_cudnn_backward_chunk(0);
  backward_variant.clear();
}

// Marrow's wgmma forward and backward (ops/attention_hopper.h) where they serve the sizes: two batch
// rows, groups 1, 4 and 8, one key block, and the backward's chunks of one head and of three (the
// last one short); then the backward alone behind cuDNN's forward.
void check_hopper(CheckReport& report) {
  set_attention_kernels(AttentionKernels::hopper);
  const Shape hopper_shapes[] = {{2, 256, 8, 2, 128}, {1, 384, 4, 1, 128}, {1, 128, 2, 2, 128}, {1, 640, 8, 1, 128}};
  uint64_t hopper_seed = 1300;
  for (const Shape& n : hopper_shapes) check_shape(report, reference(n, hopper_seed += 4));
  for (const int heads : {1, 3}) {
    set_hopper_backward_chunk_heads(heads);
    backward_variant = fmt::format(" chunks of {} heads", heads);
    check_shape(report, reference({2, 384, 4, 2, 128}, hopper_seed += 4));
  }
  set_hopper_backward_chunk_heads(0);
  set_attention_kernels(AttentionKernels::hopper_backward);  // cuDNN's forward with it (the bench shape: above)
  backward_variant.clear();
  for (const Shape& n : hopper_shapes) check_shape(report, reference(n, hopper_seed += 4));
}

// Ring attention's blocks: the zigzag split's at chunks of 65 (two chunks: 130 local tokens) and odd
// sub-ranges; then on the wgmma kernels (any setting but own) the zigzag split's two full blocks at
// chunks of 128 and (two batch rows, group 8) 256, offsets with Sq != Sk (group 1), and a causal block
// at different offsets in q and k.
void check_blocks(CheckReport& report, uint64_t seed) {
  const BlockCase blocks[] = {
      {{1, 130, 8, 2, 128}, 130, {AttentionMask::full, 0, 130, 0, 65}},   // an earlier member's K/V
      {{1, 130, 8, 2, 128}, 130, {AttentionMask::full, 65, 130, 0, 130}},  // a later member's K/V
      {{2, 37, 8, 2, 64}, 45, {AttentionMask::full, 5, 37, 3, 44}},         // Sq != Sk, offsets
      {{1, 80, 4, 4, 64}, 90, {AttentionMask::causal, 3, 70, 10, 77}},      // causal with different offsets
      {{1, 1, 8, 1, 128}, 1, {AttentionMask::full, 0, 1, 0, 1}},            // one query, one key
  };
  for (const BlockCase& c : blocks) check_block(report, c, seed += 8);
  set_attention_kernels(AttentionKernels::hopper_backward);
  const BlockCase wgmma_blocks[] = {
      {{1, 256, 8, 2, 128}, 256, {AttentionMask::full, 0, 256, 0, 128}, true},
      {{2, 512, 8, 1, 128}, 512, {AttentionMask::full, 256, 512, 0, 512}, true},
      {{1, 388, 4, 4, 128}, 300, {AttentionMask::full, 4, 388, 44, 300}, true},
      {{1, 300, 8, 2, 128}, 260, {AttentionMask::causal, 16, 144, 132, 260}, true},
  };
  for (const BlockCase& c : wgmma_blocks) check_block(report, c, seed += 8);
  // Windowed blocks (GPT-OSS's ring attention): ring_attention's chunk pairs, whose keys sit
  // `distance` positions before their queries: a causal block with a window inside it, an adjacent
  // earlier chunk the window reaches into, and a chunk two apart where the later rows see no key
  // (out 0, lse -inf); D 128 too, and two batch rows at odd offsets.
  const BlockCase windowed[] = {
      {{1, 160, 8, 1, 64}, 160, {AttentionMask::causal, 0, 80, 0, 80, 37, 0}},
      {{1, 160, 8, 1, 64}, 160, {AttentionMask::full, 80, 160, 0, 80, 128, 80}},
      {{1, 160, 8, 1, 64}, 160, {AttentionMask::full, 80, 160, 0, 80, 128, 160}},
      {{1, 256, 4, 2, 128}, 256, {AttentionMask::full, 128, 256, 0, 128, 100, 128}},
      {{2, 150, 8, 2, 64}, 150, {AttentionMask::causal, 10, 75, 20, 85, 20, 0}},
  };
  for (const BlockCase& c : windowed) check_block(report, c, seed += 8);
  // DeepSeek-V2's head dims (D 192, Dv 128), which only cuDNN serves (any setting sends them there):
  // the zigzag split's two full blocks (group 1 and, two batch rows, group 4) and a causal block at
  // different offsets in q and k; one call for all three gradients, so ring attention asks for them at once.
  const BlockCase cudnn_blocks[] = {
      {{1, 256, 16, 16, 192, 128}, 256, {AttentionMask::full, 0, 256, 0, 128}, true},
      {{2, 200, 16, 4, 192, 128}, 200, {AttentionMask::full, 100, 200, 0, 200}, true},
      {{1, 130, 8, 2, 192, 128}, 150, {AttentionMask::causal, 5, 70, 40, 105}, true},
  };
  for (const BlockCase& c : cudnn_blocks) check_block(report, c, seed += 8);
}

// DeepSeek-V2's head dims (D 192 for q and k, Dv 128 for v and out) and Qwen3.5's 256, which only
// cuDNN serves: every setting must send the causal op there (the rows name the setting), forward and
// backward, with multi-head attention at S 256 and 1024, one and two batch rows, GQA groups of 4 and 8.
void check_value_head_dim(CheckReport& report, uint64_t seed) {
  const Shape shapes[] = {{1, 256, 16, 16, 192, 128}, {2, 256, 16, 16, 192, 128}, {1, 1024, 16, 16, 192, 128},
                          {2, 1024, 16, 16, 192, 128}, {1, 1024, 16, 4, 192, 128}, {1, 300, 16, 2, 256, 256}, {1, 1024, 16, 2, 256, 256}};
  for (const Shape& n : shapes) {
    const Problem p = reference(n, seed += 4);
    for (const AttentionKernels kernels : kAttentionKernels) {
      set_attention_kernels(kernels);
      check_shape(report, p);
    }
  }
}

void check_variants(CheckReport& report, uint64_t seed) {
  // GPT-OSS's shapes: head_dim 64, groups of 8, window 128 (across tiles of 64), and gpt-oss-20b's
  // heads at 2048 positions (many key tiles a row: where unordered sums would show); windows of 1
  // and 37 (inside a tile), one longer than the sequence; odd lengths; D 128 too.
  const std::pair<Shape, int64_t> cases[] = {{{2, 300, 16, 2, 64}, 128}, {{1, 257, 4, 4, 128}, 37}, {{1, 129, 8, 1, 64}, 1},
                                             {{1, 37, 8, 2, 64}, 100},   {{1, 200, 8, 1, 64}, 0},     {{1, 2048, 64, 8, 64}, 128},
                                             {{1, 2048, 64, 8, 64}, 0}};
  const AttentionKernels before = attention_kernels();
  for (const auto& [n, window] : cases)
    for (const bool with_sinks : {false, true})
      if ((window > 0 || with_sinks) && (n.s < 2048 || with_sinks)) check_variant(report, n, window, with_sinks, seed += 8);
  set_attention_kernels(before);
}

// Packed documents [B, S] (i32, data.document_mask): each token's position in its document, the
// documents' lengths cycling along each row, row b starting 11 b tokens into the cycle.
Buffer packed_documents(int64_t batch, int64_t seq, const std::vector<int64_t>& lengths) {
  Buffer p(DType::i32, Device::cpu, {batch, seq});
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t i = 0, doc = 0, at = 11 * b; i < seq; ++i, ++at) {
      while (at >= lengths[size_t(doc) % lengths.size()]) at -= lengths[size_t(doc++) % lengths.size()];
      p.ptr<int32_t>()[b * seq + i] = int32_t(at);
    }
  return p;
}

// Packed documents on the own mma.sync kernels, the only ones that take them (other settings
// refuse): documents of one token, inside a tile and across tiles, alone and with GPT-OSS's window
// and sinks, the causal op (check_variant) and ring attention's chunk-pair blocks (a causal one, an
// earlier chunk whose rows partly see no key, and one with a window).
void check_documents(CheckReport& report, uint64_t seed) {
  const std::vector<int64_t> lengths = {37, 150, 1, 64, 90};
  for (const Shape& n : {Shape{2, 300, 16, 2, 64}, Shape{1, 257, 4, 4, 128}}) {
    const Both documents(packed_documents(n.b, n.s, lengths), DType::i32);
    for (const int64_t window : {int64_t(0), int64_t(128)})
      check_variant(report, n, window, window > 0, seed += 8, {AttentionKernels::own}, &documents);
    set_attention_kernels(AttentionKernels::hopper_backward);
    const Problem p = make_inputs(n, seed);
    Gpu g{p};
    report.expect(label("documents refused under hopper_backward", n), refuses([&] { g.forward({Tensor{}, 0, documents.gpu}); }));
  }
  set_attention_kernels(AttentionKernels::own);
  const Both documents(packed_documents(1, 160, lengths), DType::i32);
  const BlockCase blocks[] = {
      {{1, 160, 8, 1, 64}, 160, {AttentionMask::causal, 0, 80, 0, 80}, false, &documents},
      {{1, 160, 8, 1, 64}, 160, {AttentionMask::full, 80, 160, 0, 80, 0, 80}, false, &documents},
      {{1, 160, 8, 1, 64}, 160, {AttentionMask::full, 80, 160, 0, 80, 64, 80}, false, &documents},
  };
  for (const BlockCase& c : blocks) check_block(report, c, seed += 8);
}

}  // namespace

void check_attention_op(CheckReport& report) {
  const Shape shapes[] = {
      {2, 37, 8, 2, 64},    // odd S inside one tile, group 4, two batch rows
      {1, 257, 4, 4, 128},  // one row past four tiles, group 1 (dk, dv written directly)
      {1, 1, 8, 1, 128},    // a single position, group 8
      {1, 129, 8, 1, 64},   // group 8 at D 64, S one past two tiles
  };
  const uint64_t seed = 100;  // each problem draws from seeds seed .. seed + 3
  const AttentionKernels before = attention_kernels();
  for (const AttentionKernels kernels : kAttentionKernels) {
    set_attention_kernels(kernels);
    uint64_t shape_seed = seed;
    for (const Shape& n : shapes) check_shape(report, reference(n, shape_seed += 4));
    check_bench(report, 128);
    check_bench(report, 64);
  }
  check_cudnn_chunks(report);
  check_hopper(report);
  set_attention_kernels(before);
  check_blocks(report, seed + 4 * std::size(shapes));
  set_attention_kernels(before);
  check_merge(report);
  check_variants(report, seed + 1000);
  check_value_head_dim(report, seed + 2000);
  check_documents(report, seed + 3000);
  set_attention_kernels(before);
  check_rejects_head_dim(report);
}

}  // namespace marrow
