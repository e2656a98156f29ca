// marrow check, elementwise group: the memory-bound ops (embedding, rmsnorm and its fusions with add
// and rope, rope (YaRN too), biases, add, muon, router, dispatch, combine, swiglu, cross-entropy, AdamW,
// gradient norm), forward and backward, each against its f32 CPU reference on random inputs rounded
// to the GPU's dtypes (docs/gpu-path.md), at odd sizes and at the bench sizes where the CPU
// reference is cheap. GPU outputs start poisoned; accumulated outputs start from the same random
// values on both sides; the fused kernels are held bit for bit against the unfused GPU ops too.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <iterator>
#include <string>
#include <utility>

#include "gpu_check/check.h"
#include "core/bf16.h"
#include "core/rng.h"
#include "core/split_f32.h"
#include "ops/adamw.h"
#include "ops/add.h"
#include "ops/bias.h"
#include "ops/cast.h"
#include "ops/combine.h"
#include "ops/cross_entropy.h"
#include "ops/dispatch.h"
#include "ops/embedding.h"
#include "ops/expert_sends.h"
#include "ops/grad_norm.h"
#include "ops/known_zero.h"
#include "ops/rmsnorm.h"
#include "ops/rope.h"
#include "ops/router.h"
#include "ops/muon.h"
#include "ops/swiglu.h"

namespace marrow {

namespace {

// Bounds on max |gpu - cpu| / max |cpu|. kBf16: a bf16 output is one rounding (2^-9 relative) off
// f32 math. kF32: f32 outputs of f32 math that sums in another order than the CPU. kSameOrder: f32
// results the GPU computes in the CPU's own order (exact in practice). kExact: copies.
constexpr double kBf16 = 1e-2, kF32 = 1e-5, kSameOrder = 1e-6, kExact = 0;
constexpr DType bf16 = DType::bf16, f32 = DType::f32, i32 = DType::i32;

Buffer host_f32(std::initializer_list<int64_t> dims) { return Buffer(f32, Device::cpu, dims); }

// i32 values uniform in [0, limit).
Buffer random_ids(std::initializer_list<int64_t> dims, int64_t limit, uint64_t seed) {
  Buffer b(i32, Device::cpu, dims);
  Philox rng = philox_for(seed, "check ids");
  for (int64_t i = 0; i < b.numel(); ++i)
    b.ptr<int32_t>()[i] = int32_t(std::min<int64_t>(int64_t(rng.uniform(uint64_t(i)) * double(limit)), limit - 1));
  return b;
}

// i32 flags [rows]: flag(r) for each row.
template <class Flag>
Buffer row_flags(int64_t rows, const Flag& flag) {
  Buffer b(i32, Device::cpu, {rows});
  for (int64_t r = 0; r < rows; ++r) b.ptr<int32_t>()[r] = flag(r) ? 1 : 0;
  return b;
}

// The GPU's op on a copy of `start` (poisoned when it overwrites) against the CPU's on `start`, and a
// second GPU run from the same start: the same bits. op(dst, side) runs one side's call.
template <class Op>
void check_twice(CheckReport& report, const std::string& what, const std::string& size, Buffer start, bool overwrite, double bound,
                 const Op& op) {
  Both dst(start, f32), again(start, f32);
  for (Tensor t : {dst.gpu, again.gpu})
    if (overwrite) poison(t);
  op(dst.cpu, 0);
  op(dst.gpu, 1);
  op(again.gpu, 1);
  report.compare(what + size, dst, bound);
  report.expect_same_bits(what + "two runs " + size, again.gpu, dst.gpu);
}

void check_embedding(CheckReport& report, int64_t n, int64_t vocab, int64_t h) {
  const std::string size = fmt::format("T={} V={} H={}", n, vocab, h);
  Buffer ids_host = random_ids({n}, vocab, 1);
  for (int64_t t = 0; t < n; t += 5) ids_host.ptr<int32_t>()[t] = 7;  // one long run of equal ids, like padding
  const Both ids(std::move(ids_host), i32), table(random_bf16({vocab, h}, 2), bf16), dout(random_bf16({n, h}, 3), bf16);
  Both out = Both::out(bf16, {n, h}), dtable(random_host({vocab, h}, 4), f32);
  on_each_side([&](int s) { embedding_forward(out[s], ids[s], table[s]); });
  report.compare("embedding_forward " + size, out, kExact);
  on_each_side([&](int s) { embedding_backward(dtable[s], dout[s], ids[s]); });
  report.compare("embedding_backward dtable " + size, dtable, kSameOrder);

  // The gradient's row flags (ops/known_zero.h): every third row flagged (and zero), the others
  // holding old values; a restart, then a backward with the flags, twice (the second adds to rows
  // of the first). GPU against CPU bit for bit, gradient and flags.
  Buffer grad_host = random_host({vocab, h}, 5);
  for (int64_t v = 0; v < vocab; v += 3) std::fill(grad_host.ptr<float>() + v * h, grad_host.ptr<float>() + (v + 1) * h, 0.0f);
  Both grad(std::move(grad_host), f32), flags(row_flags(vocab, [](int64_t v) { return v % 3 == 0; }), i32);
  on_each_side([&](int s) { restart_known_zero(grad[s], flags[s]); });
  report.expect_equal("restart_known_zero grad " + size, grad);
  report.expect_equal("restart_known_zero flags " + size, flags);
  for (int pass = 1; pass <= 2; ++pass) {
    on_each_side([&](int s) { embedding_backward(grad[s], dout[s], ids[s], flags[s]); });
    report.expect_equal(fmt::format("embedding_backward known zero, pass {}: dtable {}", pass, size), grad);
    report.expect_equal(fmt::format("embedding_backward known zero, pass {}: flags {}", pass, size), flags);
  }
}

// offset: the norm's NormWeight offset (1: Qwen3.5's zero-centred weights).
void check_rmsnorm(CheckReport& report, int64_t n, int64_t d, float offset = 0) {
  const std::string size = fmt::format("N={} D={}{}", n, d, offset ? fmt::format(" offset {}", offset) : "");
  const Both x(random_bf16({n, d}, 10), bf16), weight(random_bf16({d}, 11, 0.5), bf16), dy(random_bf16({n, d}, 12), bf16);
  Both y = Both::out(bf16, {n, d}), rstd = Both::out(f32, {n}), dx = Both::out(bf16, {n, d}), dweight(random_host({d}, 13), f32);
  on_each_side([&](int s) { rmsnorm_forward(y[s], rstd[s], x[s], NormWeight(weight[s], offset), 1e-6); });
  report.compare("rmsnorm_forward y " + size, y, kBf16);
  report.compare("rmsnorm_forward rstd " + size, rstd, kF32);
  const Both rstd_in(rstd.cpu, f32);  // both backwards read the CPU's rstd
  on_each_side([&](int s) { rmsnorm_backward(dx[s], dweight[s], dy[s], x[s], NormWeight(weight[s], offset), rstd_in[s]); });
  report.compare("rmsnorm_backward dx " + size, dx, kBf16);
  report.compare("rmsnorm_backward dweight " + size, dweight, kF32);
}

// The residual add fused into the norm (sum written over x, as the model does) and the residual's
// gradient joined to dx (written over dresidual). Against the f32 CPU reference -- whose norm reads
// the sum rounded to bf16, as the GPU's does -- and bit for bit against the unfused GPU ops (add,
// then rmsnorm_forward; rmsnorm_backward, then add), which the fused kernels round and sum like.
// dweight runs twice from the same start: the same bits.
void check_rmsnorm_add(CheckReport& report, int64_t n, int64_t d, float offset = 0) {
  const std::string size = fmt::format("N={} D={}{}", n, d, offset ? fmt::format(" offset {}", offset) : "");
  const double eps = 1e-6;
  const Both x(random_bf16({n, d}, 14), bf16), residual(random_bf16({n, d}, 15), bf16), weight(random_bf16({d}, 16, 0.5), bf16);
  const NormWeight w_cpu(weight.cpu, offset), w_gpu(weight.gpu, offset);
  const Both sum_unfused(x.cpu, bf16);
  Buffer sum = host_f32({n, d});
  Both y = Both::out(bf16, {n, d}), rstd = Both::out(f32, {n}), y_unfused = Both::out(bf16, {n, d}), rstd_unfused = Both::out(f32, {n});
  rmsnorm_add_forward(y.cpu, sum, rstd.cpu, x.cpu, residual.cpu, w_cpu, eps);
  rmsnorm_add_forward(y.gpu, x.gpu, rstd.gpu, x.gpu, residual.gpu, w_gpu, eps);
  add(sum_unfused.gpu, sum_unfused.gpu, residual.gpu);
  rmsnorm_forward(y_unfused.gpu, rstd_unfused.gpu, sum_unfused.gpu, w_gpu, eps);
  report.compare("rmsnorm_add_forward sum in place " + size, x.gpu, sum, kBf16);
  round_to_bf16(sum);
  rmsnorm_forward(y.cpu, rstd.cpu, sum, w_cpu, eps);
  report.compare("rmsnorm_add_forward y " + size, y, kBf16);
  report.compare("rmsnorm_add_forward rstd " + size, rstd, kF32);
  report.expect_same_bits("rmsnorm_add_forward sum = add's bits " + size, x.gpu, sum_unfused.gpu);
  report.expect_same_bits("rmsnorm_add_forward y = add + rmsnorm_forward bits " + size, y.gpu, y_unfused.gpu);
  report.expect_same_bits("rmsnorm_add_forward rstd = add + rmsnorm_forward bits " + size, rstd.gpu, rstd_unfused.gpu);

  Buffer dresidual = random_bf16({n, d}, 18), dx = host_f32({n, d}), dweight_host = random_host({d}, 19);
  const Both dy(random_bf16({n, d}, 17), bf16), sum_in(sum, bf16), rstd_in(rstd.cpu, f32), dresidual_in(dresidual, bf16);
  const Both dx_fused(dresidual, bf16), dx_again(dresidual, bf16), dx_unfused = Both::out(bf16, {n, d});
  const Both dweight(dweight_host, f32), dweight_again(dweight_host, f32), dweight_unfused(dweight_host, f32);
  rmsnorm_backward(dx, dweight.cpu, dy.cpu, sum, w_cpu, rstd.cpu, dresidual);
  for (const Both* t : {&dx_fused, &dx_again})
    rmsnorm_backward(t->gpu, (t == &dx_fused ? dweight : dweight_again).gpu, dy.gpu, sum_in.gpu, w_gpu, rstd_in.gpu, t->gpu);
  rmsnorm_backward(dx_unfused.gpu, dweight_unfused.gpu, dy.gpu, sum_in.gpu, w_gpu, rstd_in.gpu);
  add(dx_unfused.gpu, dx_unfused.gpu, dresidual_in.gpu);
  const std::string op = "rmsnorm_backward + dresidual ";
  report.compare(op + "in place dx " + size, dx_fused.gpu, dx, kBf16);
  report.compare(op + "dweight " + size, dweight, kF32);
  report.expect_same_bits(op + "dx = rmsnorm_backward + add bits " + size, dx_fused.gpu, dx_unfused.gpu);
  report.expect_same_bits(op + "dweight = rmsnorm_backward bits " + size, dweight.gpu, dweight_unfused.gpu);
  report.expect_same_bits(op + "dx, two runs " + size, dx_again.gpu, dx_fused.gpu);
  report.expect_same_bits(op + "dweight, two runs " + size, dweight_again.gpu, dweight.gpu);
}

// QK-norm with RoPE in one op against the f32 CPU reference (the norm, then rope, unrounded between
// them: bf16 bounds) and bit for bit against the unfused GPU ops (rmsnorm_forward, then rope_forward
// in place; rope_backward, then rmsnorm_backward); dweight twice from the same start: the same bits;
// and with the angles' cosines and sines read from rope_cos_sin_table: the same bits again.
// Random positions in [0, 40000).
void check_rmsnorm_rope(CheckReport& report, int64_t n, int64_t heads, int64_t d) {
  const std::string size = fmt::format("T={} H={} D={}", n, heads, d);
  const double eps = 1e-6, theta = 1e6;
  auto flat = [&](Tensor t) { return t.reshape({n * heads, d}); };
  const Both positions(random_ids({n}, 40000, 29), i32), x(random_bf16({n, heads, d}, 24), bf16), weight(random_bf16({d}, 25, 0.5), bf16);
  Both y = Both::out(bf16, {n, heads, d}), rstd = Both::out(f32, {n * heads}), table = Both::out(f32, {n, d / 2, 2});
  const Both y_unfused = Both::out(bf16, {n, heads, d}), rstd_unfused = Both::out(f32, {n * heads});
  const Both y_table = Both::out(bf16, {n, heads, d}), rstd_table = Both::out(f32, {n * heads});
  on_each_side([&](int s) { rmsnorm_rope_forward(y[s], rstd[s], x[s], weight[s], positions[s], eps, theta); });
  rmsnorm_forward(flat(y_unfused.gpu), rstd_unfused.gpu, flat(x.gpu), weight.gpu, eps);
  rope_forward(y_unfused.gpu, y_unfused.gpu, positions.gpu, theta);
  report.compare("rmsnorm_rope_forward y " + size, y, kBf16);
  report.compare("rmsnorm_rope_forward rstd " + size, rstd, kF32);
  report.expect_same_bits("rmsnorm_rope_forward y = rmsnorm_forward + rope_forward bits " + size, y.gpu, y_unfused.gpu);
  report.expect_same_bits("rmsnorm_rope_forward rstd = rmsnorm_forward bits " + size, rstd.gpu, rstd_unfused.gpu);
  on_each_side([&](int s) { rope_cos_sin_table(table[s], positions[s], d, theta); });
  report.compare("rope_cos_sin_table " + size, table, kF32);
  rmsnorm_rope_forward(y_table.gpu, rstd_table.gpu, x.gpu, weight.gpu, positions.gpu, eps, theta, table.gpu);
  report.expect_same_bits("rmsnorm_rope_forward with the cos/sin table: y bits " + size, y_table.gpu, y.gpu);
  report.expect_same_bits("rmsnorm_rope_forward with the cos/sin table: rstd bits " + size, rstd_table.gpu, rstd.gpu);

  Buffer dweight_host = random_host({d}, 27);
  const Both dy(random_bf16({n, heads, d}, 26), bf16), dy_unrotated(dy.cpu, bf16), rstd_in(rstd.cpu, f32);
  const Both dx = Both::out(bf16, {n, heads, d}), dweight(dweight_host, f32);
  const Both dx_again = Both::out(bf16, {n, heads, d}), dx_unfused = Both::out(bf16, {n, heads, d}), dx_table = Both::out(bf16, {n, heads, d});
  const Both dweight_again(dweight_host, f32), dweight_unfused(dweight_host, f32), dweight_table(dweight_host, f32);
  rmsnorm_rope_backward(dx.cpu, dweight_host, dy.cpu, x.cpu, weight.cpu, rstd.cpu, positions.cpu, theta);
  for (const Both* t : {&dx, &dx_again})
    rmsnorm_rope_backward(t->gpu, (t == &dx ? dweight : dweight_again).gpu, dy.gpu, x.gpu, weight.gpu, rstd_in.gpu, positions.gpu, theta);
  rope_backward(dy_unrotated.gpu, dy_unrotated.gpu, positions.gpu, theta);
  rmsnorm_backward(flat(dx_unfused.gpu), dweight_unfused.gpu, flat(dy_unrotated.gpu), flat(x.gpu), weight.gpu, rstd_in.gpu);
  const std::string op = "rmsnorm_rope_backward ";
  report.compare(op + "dx " + size, dx, kBf16);
  // The GPU sums dy un-rotated and rounded to bf16 (2^-9 each), the CPU unrounded.
  report.compare(op + "dweight " + size, dweight, kBf16);
  report.expect_same_bits(op + "dx = rope_backward + rmsnorm_backward bits " + size, dx.gpu, dx_unfused.gpu);
  report.expect_same_bits(op + "dweight = rope_backward + rmsnorm_backward bits " + size, dweight.gpu, dweight_unfused.gpu);
  report.expect_same_bits(op + "dx, two runs " + size, dx_again.gpu, dx.gpu);
  report.expect_same_bits(op + "dweight, two runs " + size, dweight_again.gpu, dweight.gpu);
  rmsnorm_rope_backward(dx_table.gpu, dweight_table.gpu, dy.gpu, x.gpu, weight.gpu, rstd_in.gpu, positions.gpu, theta, table.gpu);
  report.expect_same_bits(op + "with the cos/sin table: dx bits " + size, dx_table.gpu, dx.gpu);
  report.expect_same_bits(op + "with the cos/sin table: dweight bits " + size, dweight_table.gpu, dweight.gpu);
}

// rope_forward and rope_backward on random x [n, heads, d] (seeds seed, seed + 1) at `positions`,
// GPU against CPU; `rope` is a theta (and a rotary_dim) or RopeParameters.
template <class... Rope>
void compare_rope(CheckReport& report, const std::string& size, Buffer positions_host, int64_t n, int64_t heads, int64_t d, bool in_place,
                  uint64_t seed, const Rope&... rope) {
  const Both positions(std::move(positions_host), i32);
  for (int backward = 0; backward < 2; ++backward) {
    const Both x(random_bf16({n, heads, d}, seed + backward), bf16), y = Both::out(bf16, {n, heads, d});
    const Tensor out[2] = {y.cpu, in_place ? x.gpu : y.gpu};
    on_each_side([&](int s) {
      if (backward) rope_backward(out[s], x[s], positions[s], rope...);
      else rope_forward(out[s], x[s], positions[s], rope...);
    });
    report.compare((backward ? "rope_backward " : "rope_forward ") + size, out[1], y.cpu, kBf16);
  }
}

// positions = t when `sequential`, else random in [0, 40000); the bench size runs in place.
void check_rope(CheckReport& report, int64_t n, int64_t heads, int64_t d, bool sequential, bool in_place) {
  const std::string size = fmt::format("T={} H={} D={}{}", n, heads, d, in_place ? " in place" : "");
  Buffer positions = random_ids({n}, 40000, 20);
  for (int64_t t = 0; sequential && t < n; ++t) positions.ptr<int32_t>()[t] = int32_t(t);
  compare_rope(report, size, std::move(positions), n, heads, d, in_place, 21, 1e6);
}

// Partial RoPE (Qwen3.5: the first 64 of a head of 256 rotate, theta 1e7) at random positions in
// [0, 262144); out of place, the GPU copies the passed-through elements.
void check_rope_partial(CheckReport& report, int64_t n, int64_t heads, int64_t d, int64_t rotary_dim, bool in_place) {
  const std::string size = fmt::format("rotary_dim {} T={} H={} D={}{}", rotary_dim, n, heads, d, in_place ? " in place" : "");
  compare_rope(report, size, random_ids({n}, 262144, 22), n, heads, d, in_place, 25, 1e7, rotary_dim);
}

// YaRN RoPE with GPT-OSS's rope_parameters (attention_factor 0: Hugging Face's default, 1.35 for
// factor 32; 1: the unscaled kernel with YaRN's frequencies) at random positions in [0, 131072)
// with 0, the original context's edge (4095, 4096) and the longest (131071) among them.
void check_rope_yarn(CheckReport& report, int64_t n, int64_t heads, int64_t d, bool in_place, double attention_factor) {
  const std::string size =
      fmt::format("yarn attention_factor {} T={} H={} D={}{}", attention_factor, n, heads, d, in_place ? " in place" : "");
  const RopeParameters rope{.theta = 150000.0, .yarn = true, .factor = 32.0, .beta_fast = 32.0, .beta_slow = 1.0,
                            .attention_factor = attention_factor, .original_max_positions = 4096, .truncate = false};
  Buffer positions = random_ids({n}, 131072, 28);
  const int32_t planted[] = {0, 4095, 4096, 131071};
  std::copy(std::begin(planted), std::end(planted), positions.ptr<int32_t>());
  compare_rope(report, size, std::move(positions), n, heads, d, in_place, 23, rope);
}

// bias_forward in place, then bias_backward accumulating into random values and overwriting poison,
// each twice from the same start (the same bits: the GPU's column sums run in a fixed order, not
// the CPU's: kF32).
void check_bias(CheckReport& report, int64_t n, int64_t o) {
  const std::string size = fmt::format("N={} O={}", n, o);
  const Both y(random_bf16({n, o}, 100), bf16), bias(random_bf16({o}, 101), bf16), dy(random_bf16({n, o}, 102), bf16);
  on_each_side([&](int s) { bias_forward(y[s], bias[s]); });
  report.compare("bias_forward in place " + size, y, kBf16);
  const Both logits(random_host({n, o}, 104), f32);  // f32 rows (the router's logits) with a bf16 bias
  on_each_side([&](int s) { bias_forward(logits[s], bias[s]); });
  report.compare("bias_forward f32 rows in place " + size, logits, kF32);
  for (bool overwrite : {false, true})
    check_twice(report, overwrite ? "bias_backward overwrite " : "bias_backward accumulate ", size, random_host({o}, 103), overwrite, kF32,
                [&](Tensor dbias, int s) { bias_backward(dbias, dy[s], overwrite); });
}

// The grouped biases on the rows of experts with `counts` rows each (empty ones and one of a single
// row among them), expert_offsets on the GPU (one process) or on the host (expert parallelism).
// The backward with and without row_scale, accumulating into random values (experts without rows
// keep them) and overwriting poison (they get zeros), each twice: the same bits. dot_add on copies
// that read row 7i mod (R + 3), -1 past R, into random values (the -1 entries keep them).
void check_grouped_bias(CheckReport& report, const std::vector<int32_t>& counts, int64_t o, bool offsets_on_gpu) {
  const Buffer offsets = offsets_host(counts), offsets_gpu = to_device(offsets, i32);
  const Tensor offs[2] = {offsets, offsets_on_gpu ? offsets_gpu.view() : offsets.view()};
  const int64_t e = int64_t(counts.size()), rows = offsets.ptr<int32_t>()[e];
  const std::string size = fmt::format("E={} R={} O={} offsets on the {}", e, rows, o, offsets_on_gpu ? "GPU" : "host");
  const Both y(random_bf16({rows, o}, 110), bf16), bias(random_bf16({e, o}, 111), bf16);
  on_each_side([&](int s) { grouped_bias_forward(y[s], bias[s], offs[s]); });
  report.compare("grouped_bias_forward in place " + size, y, kBf16);

  const Both dy(random_bf16({rows, o}, 112), bf16), scale(random_host({rows}, 113), f32);
  for (bool scaled : {false, true})
    for (bool overwrite : {false, true})
      check_twice(report, fmt::format("grouped_bias_backward{} {} ", scaled ? " row_scale" : "", overwrite ? "overwrite" : "accumulate"),
                  size, random_host({e, o}, 114), overwrite, kF32, [&](Tensor dbias, int s) {
                    grouped_bias_backward(dbias, dy[s], offs[s], overwrite, scaled ? scale[s] : Tensor{});
                  });

  const int64_t k = 2, tokens = (rows + 3 + k - 1) / k;
  Buffer copy_row(i32, Device::cpu, {tokens, k});
  for (int64_t i = 0; i < tokens * k; ++i) copy_row.ptr<int32_t>()[i] = i * 7 % (rows + 3) < rows ? int32_t(i * 7 % (rows + 3)) : -1;
  const Both rows_in(copy_row, i32), dtopk_weight(random_host({tokens, k}, 115), f32);
  on_each_side([&](int s) { grouped_bias_dot_add(dtopk_weight[s], dy[s], bias[s], offs[s], rows_in[s]); });
  report.compare("grouped_bias_dot_add " + size, dtopk_weight, kF32);
}

void check_add(CheckReport& report, int64_t rows, int64_t cols, DType dtype) {
  const std::string size = fmt::format("{} [{}, {}] in place", dtype_name(dtype), rows, cols);
  const Both a(random_bf16({rows, cols}, 30), dtype), b(random_bf16({rows, cols}, 31), dtype);
  Buffer out = host_f32({rows, cols});
  add(out, a.cpu, b.cpu);
  add(a.gpu, a.gpu, b.gpu);
  report.compare("add " + size, a.gpu, out, dtype == bf16 ? kBf16 : kSameOrder);
}

// acc (f32) += x (bf16 or f32): x's values are bf16-exact on both sides, one f32 addition each.
void check_add_into(CheckReport& report, int64_t rows, int64_t cols, DType dtype) {
  const Both acc(random_bf16({rows, cols}, 32), f32), x(random_bf16({rows, cols}, 33), dtype);
  on_each_side([&](int s) { add_into(acc[s], x[s]); });
  report.compare(fmt::format("add_into f32 += {} [{}, {}]", dtype_name(dtype), rows, cols), acc, kSameOrder);
}

// Muon (ops/muon.h): the momentum in f32 (clipping's scale folded in); Newton-Schulz's 5 steps of bf16
// GEMMs against the CPU's f32, one matrix and a batch of 3 (strided-batched GEMMs): each step rounds its
// three products to bf16 (2^-9 relative) and the iteration contracts the singular values' errors, so
// the bound is a few roundings, 5e-2; the apply step on an fp32 master with its copy and on split
// halves, from the same bf16 orth on both sides: bit for bit (each product rounded on its own).
void check_muon(CheckReport& report, int64_t rows, int64_t cols) {
  const std::string size = fmt::format("[{}, {}]", rows, cols);
  const Both update = Both::out(f32, {3, rows, cols}), momentum(random_host({3, rows, cols}, 140), f32);
  const Both grad(random_host({3, rows, cols}, 141), f32);
  on_each_side([&](int s) { muon_momentum(update[s], momentum[s], grad[s], 0.95, 0.37); });
  report.compare("muon_momentum update " + size, update, kF32);
  report.compare("muon_momentum momentum " + size, momentum, kF32);
  const Both one = Both::out(bf16, {rows, cols}), batch = Both::out(bf16, {3, rows, cols});
  on_each_side([&](int s) { newton_schulz(one[s], update[s].rows(0, 1).reshape({rows, cols}), 5); });
  report.compare("newton_schulz 5 steps " + size, one, 5e-2);
  on_each_side([&](int s) { newton_schulz(batch[s], update[s], 5); });
  report.compare("newton_schulz 5 steps, a batch of 3 " + size, batch, 5e-2);
  const Both orth(random_bf16({rows * cols}, 142), bf16);
  for (const bool split : {false, true}) {
    Buffer value = random_host({rows * cols}, 143), high(bf16, Device::cpu, {rows * cols}), low(DType::u16, Device::cpu, {rows * cols});
    if (split) split_f32(high, low, value);
    const Both first = split ? Both(low, DType::u16) : Both(value, f32), second(high, bf16);
    if (!split) poison(second.gpu);
    on_each_side([&](int s) { muon_apply(first[s], second[s], orth[s], 0.02, 0.1, 0.2 * std::sqrt(double(std::max(rows, cols)))); });
    const std::string what = split ? "muon_apply split master " : "muon_apply ";
    report.expect_equal(what + (split ? "low " : "param ") + size, first);
    report.expect_equal(what + (split ? "high " : "param_bf16 ") + size, second);
  }
}

// GPT-OSS's alpha; its limit is 7, and a limit of 1.5 makes the clamps bite on many more values.
constexpr double kClampedAlpha = 1.702;

// gate_up [rows, 2 * inter] for a SwiGLU (limit 0: seed 40, N(0, 2)) or a clamped one (seed 130,
// drawn at the limit's scale: about a sixth of the gates and a third of the ups lie past a bound).
// Then row 0's first four interleaved (gate, up) pairs at and past the clamps' bounds: gate and up
// at the limit (both pass the gradient), gate past it (none) with up at -limit (passes), gate past
// -limit (gate has no lower clamp) with up past the limit, and up past -limit. bf16 holds them for
// the limits checked here (7, 7.25, 1.5, 1.75); I >= 4.
Buffer swiglu_input(int64_t rows, int64_t inter, uint64_t seed, double limit) {
  Buffer gate_up = random_bf16({rows, 2 * inter}, seed, limit > 0 ? limit : 2.0);
  if (limit == 0) return gate_up;
  const float at = float(limit), past = float(limit + 0.25);
  const float pairs[8] = {at, at, past, -at, -past, past, 0.5f, -past};
  std::copy(std::begin(pairs), std::end(pairs), gate_up.ptr<float>());
  round_to_bf16(gate_up);
  return gate_up;
}

// The SwiGLU (limit 0) or GPT-OSS's clamped SwiGLU at `limit`, forward and backward.
void check_swiglu(CheckReport& report, int64_t rows, int64_t inter, double limit) {
  const std::string size = fmt::format("R={} I={}", rows, inter) + (limit > 0 ? fmt::format(" limit {}", limit) : "");
  const std::string op = limit > 0 ? "clamped_swiglu_" : "swiglu_";
  const Both gate_up(swiglu_input(rows, inter, limit > 0 ? 130 : 40, limit), bf16);
  const Both dout(random_bf16({rows, inter}, limit > 0 ? 131 : 41), bf16);
  Both out = Both::out(bf16, {rows, inter}), dgate_up = Both::out(bf16, {rows, 2 * inter});
  on_each_side([&](int s) {
    if (limit > 0) clamped_swiglu_forward(out[s], gate_up[s], kClampedAlpha, limit);
    else swiglu_forward(out[s], gate_up[s]);
  });
  report.compare(op + "forward " + size, out, kBf16);
  on_each_side([&](int s) {
    if (limit > 0) clamped_swiglu_backward(dgate_up[s], dout[s], gate_up[s], kClampedAlpha, limit);
    else swiglu_backward(dgate_up[s], dout[s], gate_up[s]);
  });
  report.compare(op + "backward " + size, dgate_up, kBf16);
}

// Dispatch on a plan (copy_row [T, K] of R rows, as dispatch_plan's), in `dtype`: bf16 activations,
// or f32 routing weights and their gradients (H = K); x and dx_perm from seeds seed, seed + 1.
void check_dispatch(CheckReport& report, const std::string& size, const Both& copy_row, int64_t rows, int64_t h, DType dtype, uint64_t seed) {
  const int64_t n = copy_row.cpu.size(0);
  auto input = [&](std::initializer_list<int64_t> dims, uint64_t from) {
    return Both(dtype == bf16 ? random_bf16(dims, from) : random_host(dims, from), dtype);
  };
  const Both x = input({n, h}, seed), dx_perm = input({rows, h}, seed + 1);
  Both x_perm = Both::out(dtype, {rows, h}), dx = Both::out(dtype, {n, h});
  on_each_side([&](int s) { dispatch_forward(x_perm[s], x[s], copy_row[s]); });
  report.compare("dispatch_forward " + size, x_perm, kExact);
  on_each_side([&](int s) { dispatch_backward(dx[s], dx_perm[s], copy_row[s]); });
  report.compare("dispatch_backward " + size, dx, dtype == bf16 ? kBf16 : kF32);
}

// Combine on a plan with routing weights `weight`: (partial: the partial sum without a residual,)
// in place on a residual, as the model updates the residual stream, and the backward. y_perm,
// residual and dout from seeds[0..2].
void check_combine(CheckReport& report, const std::string& size, const Both& copy_row, int64_t rows, int64_t h, const Both& weight,
                   std::array<uint64_t, 3> seeds, bool partial) {
  const int64_t n = copy_row.cpu.size(0), k = copy_row.cpu.size(1);
  const Both y_perm(random_bf16({rows, h}, seeds[0]), bf16), residual(random_bf16({n, h}, seeds[1]), bf16), dout(random_bf16({n, h}, seeds[2]), bf16);
  Both out = Both::out(bf16, {n, h}), dy_perm = Both::out(bf16, {rows, h}), dweight = Both::out(f32, {n, k});
  if (partial) {
    on_each_side([&](int s) { combine_forward(out[s], Tensor{}, y_perm[s], weight[s], copy_row[s]); });
    report.compare("combine_forward without residual " + size, out, kBf16);
  }
  const Tensor dst[2] = {out.cpu, residual.gpu};
  on_each_side([&](int s) { combine_forward(dst[s], residual[s], y_perm[s], weight[s], copy_row[s]); });
  report.compare("combine_forward in place " + size, residual.gpu, out.cpu, kBf16);
  on_each_side([&](int s) { combine_backward(dy_perm[s], dweight[s], dout[s], y_perm[s], weight[s], copy_row[s]); });
  report.compare("combine_backward dy_perm " + size, dy_perm, kBf16);
  report.compare("combine_backward dtopk_weight " + size, dweight, kF32);
}

// The router's forward, statistics, aux loss and backward on T tokens over E experts, top-K; then
// the dispatch plan, dispatch and combine on the CPU's routing at hidden size H. Each GPU op gets
// the CPU's inputs, so a failure points at one op. Expert `starved` (if >= 0) gets a logit of -30
// for every token, so it receives zero tokens.
void check_moe(CheckReport& report, int64_t n, int64_t e, int64_t k, int64_t h, bool normalize, int64_t starved) {
  const std::string size = fmt::format("T={} E={} K={}", n, e, k), hsize = fmt::format("{} H={}", size, h);
  Buffer logits_host = random_host({n, e}, 50, 2.0);
  for (int64_t t = 0; starved >= 0 && t < n; ++t) logits_host.ptr<float>()[t * e + starved] = -30;
  const Both logits(std::move(logits_host), f32);
  Both probs = Both::out(f32, {n, e}), topk_weight = Both::out(f32, {n, k}), topk_index = Both::out(i32, {n, k});
  on_each_side([&](int s) { router_forward(probs[s], topk_index[s], topk_weight[s], logits[s], normalize); });
  report.compare("router_forward probs " + size, probs, kF32);
  report.expect_equal("router_forward topk_index " + size, topk_index);
  report.compare("router_forward topk_weight " + size, topk_weight, kF32);

  const Both probs_in(probs.cpu, f32), index_in(topk_index.cpu, i32), weight_in(topk_weight.cpu, f32);
  Both stats = Both::out(f32, {2 * e + 1});
  on_each_side([&](int s) { router_statistics(stats[s], probs_in[s], index_in[s]); });
  report.expect_equal("router_statistics counts " + size, stats.gpu.rows(0, e), stats.cpu.rows(0, e));
  report.compare("router_statistics sums " + size, stats.gpu.rows(e, 2 * e + 1), stats.cpu.rows(e, 2 * e + 1), kF32);
  Buffer aux = host_f32({1}), aux_gpu = host_f32({1});
  aux.ptr<float>()[0] = float(router_aux_loss(stats.cpu));
  aux_gpu.ptr<float>()[0] = float(router_aux_loss(stats.gpu));
  report.compare("router_aux_loss " + size, aux_gpu, aux, kF32);
  // The engine's form sums on the device: the same double arithmetic, so the same bits as the host's.
  Buffer total = Buffer::zeros(DType::f64, Device::cpu, {1}), total_gpu = Buffer::zeros(DType::f64, Device::cuda, {1});
  router_aux_loss_add(total, to_host(stats.gpu));
  router_aux_loss_add(total_gpu, stats.gpu);
  report.expect_equal("router_aux_loss_add " + size, total_gpu, total);

  // aux_grad = T / 2 makes the aux term's gradient comparable to the routing weights'.
  const Both dtopk(random_host({n, k}, 51), f32), stats_in(stats.cpu, f32);
  Both dlogits = Both::out(bf16, {n, e});
  on_each_side([&](int s) {
    router_backward(dlogits[s], dtopk[s], probs_in[s], index_in[s], weight_in[s], normalize, 0.5 * double(n), stats_in[s]);
  });
  report.compare("router_backward dlogits " + size, dlogits, kBf16);

  Buffer offsets(i32, Device::cpu, {e + 1}), offsets_gpu(i32, Device::cpu, {e + 1});
  std::fill(offsets_gpu.ptr<int32_t>(), offsets_gpu.ptr<int32_t>() + e + 1, -1);
  const Tensor offs[2] = {offsets, offsets_gpu};
  Both copy_row = Both::out(i32, {n, k});
  on_each_side([&](int s) { dispatch_plan(offs[s], copy_row[s], index_in[s]); });
  report.expect_equal("dispatch_plan expert_offsets " + size, offsets_gpu, offsets);
  report.expect_equal("dispatch_plan copy_row " + size, copy_row);

  const Both rows_in(copy_row.cpu, i32);
  check_dispatch(report, hsize, rows_in, n * k, h, bf16, 52);
  check_combine(report, hsize, rows_in, n * k, h, weight_in, {55, 54, 56}, false);
}

// Expert indices outside [0, E) (-1 and E here): the GPU statistics count them for no expert, the
// GPU plan with offsets on the host refuses E, and with offsets on the GPU takes both as -1 (not
// here): copy_row -1, expert_offsets[E] the other copies.
void check_routing_outside(CheckReport& report, int64_t n, int64_t e, int64_t k) {
  const std::string size = fmt::format("T={} E={} K={}", n, e, k), outside = ", indices outside [0, E) " + size;
  Buffer topk_index(i32, Device::cpu, {n, k}), counts = Buffer::zeros(f32, Device::cpu, {e});
  int32_t* idx = topk_index.ptr<int32_t>();
  for (int64_t i = 0; i < n * k; ++i) idx[i] = int32_t(i % e);
  idx[3] = -1;
  idx[n * k - 2] = int32_t(e);
  for (int64_t i = 0; i < n * k; ++i)
    if (0 <= idx[i] && idx[i] < e) counts.ptr<float>()[idx[i]] += 1;
  const Both index(topk_index, i32), probs(random_host({n, e}, 57), f32);
  Buffer stats = poisoned(f32, {2 * e + 1});
  router_statistics(stats, probs.gpu, index.gpu);
  report.expect_equal("router_statistics counts" + outside, stats.view().rows(0, e), counts);

  Buffer offsets(i32, Device::cpu, {e + 1}), copy_row = poisoned(i32, {n, k});
  report.expect("dispatch_plan rejects indices outside [0, E) " + size, refuses([&] { dispatch_plan(offsets, copy_row, index.gpu); }));
  Buffer offsets_d = poisoned(i32, {e + 1}), copy_row_d = poisoned(i32, {n, k});
  dispatch_plan(offsets_d, copy_row_d, index.gpu);
  const int32_t last = to_host(offsets_d).ptr<int32_t>()[e], valid = int32_t(n * k - 2);
  report.add({"dispatch_plan offsets on the GPU: expert_offsets[E] = valid copies" + outside, double(std::abs(last - valid)), 0, last == valid});
  // The CPU plan with every index outside [0, E) as -1.
  Buffer absent(i32, Device::cpu, {n, k}), expected(i32, Device::cpu, {n, k}), expected_offsets(i32, Device::cpu, {e + 1});
  for (int64_t i = 0; i < n * k; ++i) absent.ptr<int32_t>()[i] = 0 <= idx[i] && idx[i] < e ? idx[i] : -1;
  dispatch_plan(expected_offsets, expected, absent);
  report.expect_equal("dispatch_plan copy_row on the GPU" + outside, copy_row_d, expected);
}

// DeepSeek-V3's expert bias in the router's choice (groups too), the global-batch form's running
// statistics and the bias update (ops/router.h), GPU against CPU: the same f32 and double arithmetic,
// so the choice, the totals, the rewritten counts and the biases bit for bit.
void check_load_balance(CheckReport& report, int64_t n, int64_t e, int64_t k, int64_t groups) {
  const std::string size = fmt::format("T={} E={} K={} groups={}", n, e, k, groups);
  const Both logits(random_host({n, e}, 60, 2.0), f32), bias(random_host({e}, 61, 0.05), f32);
  Both probs = Both::out(f32, {n, e}), index = Both::out(i32, {n, k}), weight = Both::out(f32, {n, k});
  on_each_side([&](int s) {
    RouterOptions o;
    o.normalize = true;
    o.groups = groups;
    o.top_groups = groups > 1 ? groups / 2 : 1;
    o.selection_bias = bias[s];
    router_forward(probs[s], index[s], weight[s], logits[s], o);
  });
  report.expect_equal("router_forward selection_bias topk_index " + size, index);
  report.compare("router_forward selection_bias topk_weight " + size, weight, kF32);

  // The CPU's statistics on both sides, after earlier micro-batches of 3T tokens.
  Buffer stats_host(f32, Device::cpu, {2 * e + 1}), totals = Buffer::zeros(DType::f64, Device::cpu, {e + 1});
  router_statistics(stats_host, probs.cpu, index.cpu);
  for (int64_t i = 0; i < e; ++i) totals.ptr<double>()[i] = double((5 * i) % 11);
  totals.ptr<double>()[e] = double(3 * n);
  Buffer totals_gpu(DType::f64, Device::cuda, {e + 1}), loads = Buffer::zeros(DType::f64, Device::cpu, {3, e + 1});
  copy(totals_gpu, totals);
  const Both stats(stats_host, f32);
  const Tensor totals_side[2] = {totals, totals_gpu};
  on_each_side([&](int s) { router_step_statistics(totals_side[s], stats[s], true); });
  report.expect_equal("router_step_statistics totals " + size, totals_gpu, totals);
  report.expect_equal("router_step_statistics global-form counts " + size, stats);

  for (int64_t i = 0; i < 2 * (e + 1); ++i) loads.ptr<double>()[i] = double((37 * i) % 13);  // the third layer without load
  Buffer loads_gpu(DType::f64, Device::cuda, {3, e + 1});
  copy(loads_gpu, loads);
  const Both expert_bias(random_host({3, e}, 62, 0.01), f32);
  const Tensor loads_side[2] = {loads, loads_gpu};
  on_each_side([&](int s) { expert_bias_update(expert_bias[s], loads_side[s], 1e-3); });
  report.expect_equal("expert_bias_update " + size, expert_bias);
}

// The sender's expert-parallel plan (ops/expert_sends.h) on the GPU against the CPU, bit for bit:
// members and copies per member, each token's row per member (dispatch_plan over the members, -1
// entries skipped), then the sent rows' slots; T tokens of top-K over E experts on P members.
void check_expert_sends(CheckReport& report, int64_t n, int64_t e, int64_t k, int64_t members) {
  const std::string size = fmt::format("T={} E={} K={} P={}", n, e, k, members);
  const int64_t local = e / members;
  Buffer owner_host(i32, Device::cpu, {e});
  for (int64_t x = 0; x < e; ++x) owner_host.ptr<int32_t>()[x] = int32_t(x / local);
  const Both index(random_ids({n, k}, e, 91), i32), owner(std::move(owner_host), i32);
  Both member_index = Both::out(i32, {n, members}), copies = Both::out(i32, {members}), offsets = Both::out(i32, {members + 1});
  Both send_row = Both::out(i32, {n, members}), slots = Both::out(i32, {n * members, k});
  on_each_side([&](int s) {
    expert_send_members(member_index[s], copies[s], index[s], owner[s]);
    dispatch_plan(offsets[s], send_row[s], member_index[s]);
    expert_send_slots(slots[s], index[s], owner[s], send_row[s], local);
  });
  report.expect_equal("expert_send_members member_index " + size, member_index);
  report.expect_equal("expert_send_members copies " + size, copies);
  report.expect_equal("dispatch_plan of the members, offsets " + size, offsets);
  report.expect_equal("dispatch_plan of the members, send_row " + size, send_row);
  report.expect_equal("expert_send_slots " + size, slots);
}

// Expert parallelism: rank `rank` of `ranks` holds experts [rank * E / ranks, (rank + 1) * E / ranks)
// and sees its part of the plan: copy_row keeps the rows of its experts' copies, shifted to start
// at 0, and -1 for the copies other ranks hold, so the permuted tensors have R < T * K rows (the
// rank's block of the full plan). Token 0 sends every slot to the next rank, so at least one token
// has no copy here.
struct RankPlan {
  Buffer copy_row;
  int64_t rows = 0;
  std::string size;  // "T=.. E=.. K=.. <width> rank r of P (R=..)"
};

RankPlan rank_plan(int64_t n, int64_t e, int64_t k, const std::string& width, int64_t ranks, int64_t rank) {
  const int64_t per_rank = e / ranks;
  Buffer topk_index = random_ids({n, k}, e, 90);
  for (int64_t j = 0; j < k; ++j) topk_index.ptr<int32_t>()[j] = int32_t((rank + 1) % ranks * per_rank);
  Buffer offsets(i32, Device::cpu, {e + 1});
  RankPlan plan{Buffer(i32, Device::cpu, {n, k}), 0, {}};
  dispatch_plan(offsets, plan.copy_row, topk_index);
  const int32_t first = offsets.ptr<int32_t>()[rank * per_rank], end = offsets.ptr<int32_t>()[(rank + 1) * per_rank];
  int32_t* row = plan.copy_row.ptr<int32_t>();
  for (int64_t i = 0; i < n * k; ++i) row[i] = first <= row[i] && row[i] < end ? row[i] - first : -1;
  plan.rows = end - first;
  plan.size = fmt::format("T={} E={} K={} {} rank {} of {} (R={})", n, e, k, width, rank, ranks, plan.rows);
  return plan;
}

// Dispatch on a rank's plan (bf16 activations, or f32 routing weights: H = K).
void check_dispatch_rank(CheckReport& report, int64_t n, int64_t e, int64_t k, int64_t h, int64_t ranks, int64_t rank, DType dtype) {
  const RankPlan plan = rank_plan(n, e, k, fmt::format("H={}", h), ranks, rank);
  check_dispatch(report, fmt::format("{} {}", dtype_name(dtype), plan.size), Both(plan.copy_row, i32), plan.rows, h, dtype, 91);
}

// Combine on a rank's plan: the rank's partial sum without a residual too.
void check_combine_rank(CheckReport& report, int64_t n, int64_t e, int64_t k, int64_t h, int64_t ranks, int64_t rank) {
  const RankPlan plan = rank_plan(n, e, k, fmt::format("H={}", h), ranks, rank);
  check_combine(report, plan.size, Both(plan.copy_row, i32), plan.rows, h, Both(random_host({n, k}, 94), f32), {93, 95, 96}, true);
}

// The experts' backward with the routing weights (one expert-parallel rank), on a rank's plan for
// its -1 entries: the SwiGLU's (limit 0) or the clamped SwiGLU's, which also gives each row's
// routing weight (a copy: exact; every row of a rank's plan is named once).
void check_swiglu_weighted_rank(CheckReport& report, int64_t n, int64_t e, int64_t k, int64_t inter, int64_t ranks, int64_t rank,
                                double limit) {
  const bool clamped = limit > 0;
  const RankPlan plan = rank_plan(n, e, k, fmt::format("I={}", inter) + (clamped ? fmt::format(" limit {}", limit) : ""), ranks, rank);
  const uint64_t seed = clamped ? 132 : 97;
  const Both rows_in(plan.copy_row, i32), gate_up(swiglu_input(plan.rows, inter, seed, limit), bf16);
  const Both dact(random_bf16({plan.rows, inter}, seed + 1), bf16), weight(random_host({n, k}, seed + 2), f32);
  Both dgate_up = Both::out(bf16, {plan.rows, 2 * inter}), act = Both::out(bf16, {plan.rows, inter}), dweight = Both::out(f32, {n, k});
  Both row_weight = Both::out(f32, {plan.rows});
  on_each_side([&](int s) {
    if (clamped)
      clamped_swiglu_weighted_backward(dgate_up[s], act[s], row_weight[s], dweight[s], dact[s], gate_up[s], weight[s], rows_in[s],
                                       kClampedAlpha, limit);
    else swiglu_weighted_backward(dgate_up[s], act[s], dweight[s], dact[s], gate_up[s], weight[s], rows_in[s]);
  });
  const std::string op = clamped ? "clamped_swiglu_weighted_backward " : "swiglu_weighted_backward ";
  // The GPU's dot reads act rounded to bf16, as the separate ops did: a bf16 bound.
  report.compare(op + "dtopk_weight " + plan.size, dweight, kBf16);
  report.compare(op + "act " + plan.size, act, kBf16);
  report.compare(op + "dgate_up " + plan.size, dgate_up, kBf16);
  if (clamped) report.compare(op + "row_weight " + plan.size, row_weight, kExact);
}

// Every 7th target is the ignore index; the backward writes dlogits over the logits, as the model does.
void check_cross_entropy(CheckReport& report, int64_t n, int64_t vocab) {
  const std::string size = fmt::format("T={} V={}", n, vocab);
  Buffer targets_host = random_ids({n}, vocab, 61);
  int64_t counted = n;
  for (int64_t t = 3; t < n; t += 7, --counted) targets_host.ptr<int32_t>()[t] = kIgnoreIndex;
  const Both logits(random_bf16({n, vocab}, 60, 2.0), bf16), targets(std::move(targets_host), i32);
  Both loss = Both::out(f32, {n}), lse = Both::out(f32, {n});
  on_each_side([&](int s) { cross_entropy_forward(loss[s], lse[s], logits[s], targets[s]); });
  report.compare("cross_entropy_forward token_loss " + size, loss, kF32);
  report.compare("cross_entropy_forward lse " + size, lse, kF32);
  const Both lse_in(lse.cpu, f32);
  // In place on the CPU too: halves host memory.
  on_each_side([&](int s) { cross_entropy_backward(logits[s], logits[s], lse_in[s], targets[s], 1.0 / double(counted)); });
  report.compare("cross_entropy_backward in place " + size, logits, kBf16);
}

// A host bf16 copy of a host f32 tensor (rounded to nearest).
Buffer host_bf16(Tensor host_f32) {
  Buffer out(bf16, Device::cpu, {host_f32.numel()});
  for (int64_t i = 0; i < host_f32.numel(); ++i) static_cast<uint16_t*>(out.view().data)[i] = float_to_bf16(host_f32.ptr<float>()[i]);
  return out;
}

// AdamW over n elements shifted by `offset` (1: off 16-byte alignment, the kernels' scalar path) or,
// with rows > 0, adamw_step_known_zero over rows of n / rows, every third flagged (its gradient,
// random, must not be read; the CPU's flagged rows take a zero gradient). The gradient is scaled
// (clipping folded into the step). Moments in f32 or bf16 (optimizer.moments); the weights in f32
// with their bf16 copy written in the same pass, or split (core/split_f32.h): both halves. The GPU
// follows the CPU's order of operations: f32 results within kSameOrder (exact in practice), the rest
// bit for bit. Inputs from seeds seed .. seed + 3.
void check_adamw(CheckReport& report, int64_t n, int64_t offset, int64_t rows, DType moments, bool split, uint64_t seed) {
  const std::string size = (rows > 0 ? fmt::format("{} rows of {}", rows, n / rows) : fmt::format("n={}{}", n, offset ? " unaligned" : "")) +
                           (split && moments == bf16 ? ", bf16 moments" : "");
  const std::string op =
      fmt::format("adamw_step{} {}", rows > 0 ? "_known_zero" : "", split ? "split master " : moments == bf16 ? "bf16 moments " : "");
  AdamWHyper hyper{1e-3, 0.9, 0.95, 1e-8, 0.1, 3};
  hyper.grad_scale = 0.37;
  const int64_t all = n + offset;
  Buffer value = random_host({all}, seed), m = random_host({all}, seed + 2, 0.1), v = random_host({all}, seed + 3, 0.01);
  for (int64_t i = 0; i < all; ++i) v.ptr<float>()[i] = std::abs(v.ptr<float>()[i]);
  if (moments == bf16) m = host_bf16(m), v = host_bf16(v);
  Buffer high(bf16, Device::cpu, {all}), low(DType::u16, Device::cpu, {all});
  if (split) split_f32(high, low, value);
  // The weights: (f32, its bf16 copy) or (low half, high half).
  const Both first = split ? Both(low, DType::u16) : Both(value, f32), second(high, bf16);
  if (!split) poison(second.gpu);
  const Both m_both(m, moments), v_both(v, moments), grad(random_host({all}, seed + 1), f32);
  const Both known(row_flags(std::max<int64_t>(rows, 1), [&](int64_t r) { return r < rows && r % 3 == 1; }), i32);
  auto tail = [&](Tensor t) { return t.rows(offset, all); };
  on_each_side([&](int s) {
    if (rows > 0) adamw_step_known_zero(tail(first[s]), tail(second[s]), tail(m_both[s]), tail(v_both[s]), tail(grad[s]), known[s], hyper);
    else adamw_step(tail(first[s]), tail(second[s]), tail(m_both[s]), tail(v_both[s]), tail(grad[s]), hyper);
  });
  if (split) {
    report.expect_equal(op + "high " + size, second);
    report.expect_equal(op + "low " + size, first);
    report.expect_equal(op + "exp_avg " + size, m_both);
    report.expect_equal(op + "exp_avg_sq " + size, v_both);
    return;
  }
  report.compare(op + "param " + size, first, kSameOrder);
  for (const auto& [what, t] : {std::pair{"exp_avg ", &m_both}, std::pair{"exp_avg_sq ", &v_both}}) {
    if (moments == f32) report.compare(op + what + size, *t, kSameOrder);
    else report.expect_equal(op + what + size, tail(t->gpu), tail(t->cpu));
  }
  report.expect_equal(op + "param_bf16 " + size, tail(second.gpu), tail(second.cpu));
}

// Split master weights (core/split_f32.h): split_f32 and join_f32 on the GPU against the CPU, bit
// for bit, over random values and the midpoints between bf16 values (both parities of the lower
// neighbour, both signs), zeros, subnormals and large values; and the GPU's join of its own split
// gives every value back except the midpoints above an odd bf16, one unit higher.
void check_split_f32(CheckReport& report, int64_t n) {
  Buffer value_host = random_host({n}, 95);
  auto* bits = static_cast<uint32_t*>(value_host.view().data);
  const uint32_t planted[] = {0x3f808000u, 0x3f818000u, 0xbf808000u, 0xbf818000u, 0x00000000u, 0x80000000u,
                              0x00018000u, 0x7f7effffu, 0x3f80ffffu, 0x3f7fffffu, 0x40000001u, 0xc0008001u};
  for (size_t i = 0; i < std::size(planted); ++i) bits[i * 7] = planted[i];
  const Both value(value_host, f32);
  Both high(Buffer(bf16, Device::cpu, {n}), bf16), low = Both::out(DType::u16, {n}), joined = Both::out(f32, {n});
  poison(high.gpu);
  on_each_side([&](int s) {
    split_f32(high[s], low[s], value[s]);
    join_f32(joined[s], high[s], low[s]);
  });
  const std::string size = fmt::format("n={}", n);
  report.expect_equal("split_f32 high " + size, high);
  report.expect_equal("split_f32 low " + size, low);
  report.expect_equal("join_f32 " + size, joined);
  Buffer storable(f32, Device::cpu, {n});
  for (int64_t i = 0; i < n; ++i) static_cast<uint32_t*>(storable.view().data)[i] = split_storable(bits[i]);
  report.expect_equal("join_f32 of split_f32: the values as stored " + size, joined.gpu, storable);
}

// Rows an embedding step did not see: zero gradient and moments (+0 and -0). AdamW skips the square
// root and the divisions for them (ops/adamw.cu); the results are known exactly: the moments become
// +0 and the weight only decays, float(double(param) * decay). lr and weight_decay make decay
// 0.875, exact in any rounding.
void check_adamw_zero_moments(CheckReport& report, int64_t n) {
  AdamWHyper hyper{0.25, 0.9, 0.95, 1e-8, 0.5, 3};
  Buffer param = random_host({n}, 74), m = Buffer::zeros(f32, Device::cpu, {n}), zero = Buffer::zeros(f32, Device::cpu, {n}),
         want = host_f32({n});
  float* p = param.ptr<float>();
  p[0] = 0.0f;
  p[1] = -0.0f;
  for (int64_t i = 0; i < n; ++i) {
    m.ptr<float>()[i] = i % 2 ? -0.0f : 0.0f;
    want.ptr<float>()[i] = float(double(p[i]) * 0.875);
  }
  const Both param_d(param, f32), grad_d(zero, f32), m_d(m, f32), v_d(zero, f32);
  adamw_step(param_d.gpu, Tensor{}, m_d.gpu, v_d.gpu, grad_d.gpu, hyper);
  const std::string size = fmt::format("n={}", n);
  report.expect_equal("adamw_step zero moments: param only decays " + size, param_d.gpu, want);
  report.expect_equal("adamw_step zero moments: exp_avg +0 " + size, m_d.gpu, zero);
  report.expect_equal("adamw_step zero moments: exp_avg_sq +0 " + size, v_d.gpu, zero);
}

// sum_squares_parts with known-zero rows (every other row flagged, zeros; NaN planted on the GPU
// side of each, which must not be read) gives the parts of the same call without them, bit for bit.
void check_sum_squares_known_zero(CheckReport& report, int64_t before, int64_t rows, int64_t per_row) {
  Buffer x_host = random_host({before + rows * per_row + 3}, 81);
  for (int64_t r = 1; r < rows; r += 2) std::fill(x_host.ptr<float>() + before + r * per_row, x_host.ptr<float>() + before + (r + 1) * per_row, 0.0f);
  const Both x(x_host, f32), flags(row_flags(rows, [](int64_t r) { return r % 2; }), i32);
  Buffer plain = poisoned(DType::f64, {kSumParts}), known = poisoned(DType::f64, {kSumParts});
  sum_squares_parts(plain, x.gpu);
  for (int64_t r = 1; r < rows; r += 2) poison(x.gpu.rows(before + r * per_row, before + r * per_row + 1));
  sum_squares_parts(known, x.gpu, KnownZeroRows{flags.gpu, before, per_row});
  report.expect_same_bits(fmt::format("sum_squares_parts known zero rows = plain {} + {} rows of {} + 3", before, rows, per_row), known, plain);
}

void check_grad_norm(CheckReport& report, int64_t n, int64_t offset) {
  const Both x(random_host({n + offset}, 80), f32);
  const double cpu = l2_norm(x.cpu.rows(offset, n + offset)), gpu = l2_norm(x.gpu.rows(offset, n + offset));
  const double error = std::abs(gpu - cpu) / std::max(std::abs(cpu), 1e-30);
  // Both sides sum in double, in different orders: ~1e-13 apart over 16M elements.
  report.add({fmt::format("l2_norm n={}{}", n, offset ? " unaligned" : ""), error, 1e-10, std::isfinite(gpu) && error <= 1e-10});
}

}  // namespace

void check_elementwise_ops(CheckReport& report) {
  // Odd sizes: rows not multiples of 8 (scalar kernel paths) next to ones that are (16-byte paths).
  for (int64_t d : {72, 75}) check_embedding(report, 37, 101, d);
  for (float offset : {0.0f, 1.0f})
    for (int64_t d : {72, 75}) {
      check_rmsnorm(report, 37, d, offset);
      check_rmsnorm_add(report, 37, d, offset);
    }
  // The fused kernels at 8 lanes a head (D 64), 16 (D 128: the bench model's 32 query heads, 4 warps
  // a token, the last chunk of dweight's partials short; 4 heads: 16 warps a block; 5: a warp's last
  // pass holding one head of two) and 32 (D 256), dweight's partials from the dx kernel (8, 4 and 32
  // heads); past them (D 512) the unfused pair; rows in packs of 8 with halves (36) one element at a
  // time (D 72), and one element at a time throughout (D 18).
  for (auto [heads, d] : {std::pair{3, 64}, {32, 128}, {8, 64}, {4, 128}, {5, 128}, {3, 256}, {3, 512}, {3, 72}, {3, 18}})
    check_rmsnorm_rope(report, 37, heads, d);
  check_rope(report, 37, 3, 72, false, false);
  check_rope(report, 37, 3, 16, false, true);
  check_rope_yarn(report, 37, 3, 64, false, 0);  // packs of 8, cos and sin scaled
  check_rope_yarn(report, 37, 3, 18, true, 0);   // one pair at a time
  check_rope_yarn(report, 37, 3, 64, false, 1);  // YaRN's frequencies, unscaled
  // Partial: one pair at a time (D 20 of 12 rotated), packs of 8 for both the pairs and the copies (48 of 16).
  for (bool in_place : {false, true}) check_rope_partial(report, 37, 3, 20, 12, in_place);
  check_rope_partial(report, 37, 3, 48, 16, false);
  // Packs of 8, odd widths, rows in 15 chunks with the last one shorter, the router's width (4 chunks).
  for (auto [n, o] : {std::pair{37, 72}, {37, 75}, {1000, 75}, {300, 32}}) check_bias(report, n, o);
  // Empty experts first, in the middle and last; one of a single row.
  for (auto [o, on_gpu] : {std::pair{72, false}, {75, false}, {75, true}}) check_grouped_bias(report, {0, 5, 1, 0, 13, 18, 0}, o, on_gpu);
  for (DType dtype : {bf16, f32}) check_add(report, 37, 75, dtype);
  for (DType dtype : {bf16, f32}) check_add_into(report, 37, 75, dtype);
  for (auto [rows, cols] : {std::pair{37L, 75L}, std::pair{75L, 37L}, std::pair{64L, 64L}}) check_muon(report, rows, cols);
  for (int64_t i : {72, 75}) check_swiglu(report, 37, i, 0);
  for (int64_t i : {72, 75})
    for (double limit : {7.0, 1.5}) check_swiglu(report, 37, i, limit);
  // (T, E, K, H, normalize, starved): K = E, an expert without tokens, the GPU plan's warps each
  // taking a run of copies (3001 tokens).
  for (auto [n, e, k, h, normalize, starved] : {std::tuple{37, 8, 2, 72, true, -1}, {37, 8, 2, 75, false, -1}, {37, 8, 8, 72, true, -1},
                                                {37, 128, 8, 75, true, 5}, {3001, 300, 6, 72, true, 7}})
    check_moe(report, n, e, k, h, normalize, starved);
  for (auto [n, e, k] : {std::tuple{37, 8, 2}, {37, 128, 8}, {3001, 300, 6}}) check_routing_outside(report, n, e, k);
  for (auto [n, e, k, groups] : {std::tuple{37, 8, 2, 1}, {37, 64, 6, 8}, {3001, 300, 6, 1}, {4096, 128, 8, 1}})
    check_load_balance(report, n, e, k, groups);
  // The bench routing with EP = 2 and 8; 64: the most members a token mask holds.
  for (auto [n, e, k, p] : {std::tuple{37, 8, 2, 4}, {4096, 128, 8, 2}, {4096, 128, 8, 8}, {1000, 64, 8, 64}}) check_expert_sends(report, n, e, k, p);
  check_dispatch_rank(report, 37, 8, 2, 72, 4, 1, bf16);
  check_dispatch_rank(report, 37, 8, 2, 75, 4, 1, bf16);
  check_dispatch_rank(report, 37, 8, 8, 8, 2, 0, f32);  // routing weights: H = K
  check_dispatch_rank(report, 37, 8, 2, 2, 4, 3, f32);
  for (int64_t h : {72, 75}) check_combine_rank(report, 37, 8, 2, h, 4, 1);
  for (int64_t i : {72, 75}) check_swiglu_weighted_rank(report, 37, 8, 2, i, 4, 1, 0);
  check_swiglu_weighted_rank(report, 4096, 128, 8, 768, 1, 0, 0);
  for (int64_t i : {72, 75})
    for (double limit : {7.0, 1.5}) check_swiglu_weighted_rank(report, 37, 8, 2, i, 4, 1, limit);
  // GPT-OSS-20b's experts (32, top-4, I = 2880) on 1,024 tokens: drawing the inputs on the CPU takes ~1 s per limit.
  for (double limit : {7.0, 1.5}) check_swiglu_weighted_rank(report, 1024, 32, 4, 2880, 1, 0, limit);
  check_cross_entropy(report, 37, 1001);
  check_cross_entropy(report, 300, 151936);  // Qwen3's vocabulary: packs of 8
  for (int64_t offset : {0, 1}) check_adamw(report, 37 * 75, offset, 0, f32, false, 70);
  // More rows than a grid's y (65,535): an embedding's.
  for (auto [rows, per_row] : {std::pair{7, 36}, {5, 37}, {70001, 8}}) check_adamw(report, rows * per_row, 0, rows, f32, false, 75);
  check_sum_squares_known_zero(report, 4, 37, 72);
  check_sum_squares_known_zero(report, 5, 37, 75);
  check_adamw_zero_moments(report, 37 * 75);
  // (n, offset, rows): aligned, unaligned, and two of known-zero rows.
  const std::array<int64_t, 3> adamw_cases[] = {{37 * 75, 0, 0}, {37 * 75, 1, 0}, {7 * 36, 0, 7}, {5 * 37, 0, 5}};
  for (const auto& [n, offset, rows] : adamw_cases) check_adamw(report, n, offset, rows, bf16, false, 90);
  check_split_f32(report, 37 * 75);
  for (DType moments : {f32, bf16})
    for (const auto& [n, offset, rows] : adamw_cases) check_adamw(report, n, offset, rows, moments, true, 96);
  for (int64_t offset : {0, 1}) check_grad_norm(report, 37 * 75, offset);

  // Bench sizes (Qwen3-30B-A3B-like: T = 4096, H = 2048, E = 128, K = 8, head_dim 128, I = 768).
  check_embedding(report, 4096, 4099, 2048);  // V small enough for the CPU, so ids repeat a lot
  check_rmsnorm(report, 4096, 2048);
  check_rmsnorm(report, 4096 * 4, 128);  // QK-norm: rows are (token, head)
  check_rmsnorm_add(report, 4096, 2048);
  // Qwen3.5-like: hidden 2048 and QK-norm over heads of 256, zero-centred (a quarter of its 16 query
  // heads' rows: at 65,536 the CPU's serial f32 dweight sum drifts past kF32); its full-attention RoPE.
  check_rmsnorm_add(report, 4096, 2048, 1);
  check_rmsnorm(report, 4096 * 4, 256, 1);
  for (bool in_place : {true, false}) check_rope_partial(report, 4096, 16, 256, 64, in_place);
  check_rmsnorm_rope(report, 4096, 32, 128);  // queries
  check_rmsnorm_rope(report, 4096, 4, 128);   // keys
  check_rope(report, 4096, 32, 128, true, true);
  // GPT-OSS-20b: 64 query heads of 64, hidden 2880, 32 experts, top-4.
  check_rope_yarn(report, 4096, 64, 64, true, 0);
  check_bias(report, 4096, 64 * 64);
  check_grouped_bias(report, skewed_counts(32, 4096 * 4), 2880, true);
  for (DType dtype : {bf16, f32}) check_add(report, 4096, 2048, dtype);
  check_swiglu(report, 4096 * 8, 768, 0);
  for (double limit : {7.0, 1.5}) check_swiglu(report, 4096, 2880, limit);  // GPT-OSS-20b's I
  check_moe(report, 4096, 128, 8, 2048, true, 5);
  check_dispatch_rank(report, 4096, 128, 8, 2048, 8, 3, bf16);
  check_dispatch_rank(report, 4096, 128, 8, 8, 8, 3, f32);
  check_combine_rank(report, 4096, 128, 8, 2048, 8, 3);
  // Full vocabulary; 1024 rows rather than 4096: each row is one block, and drawing the random
  // logits on the CPU (~30 ns each) would dominate the whole check.
  check_cross_entropy(report, 1024, 151936);
  check_adamw(report, (1 << 20) + 3, 0, 0, f32, false, 70);
  check_adamw(report, (1 << 20) + 3, 0, 0, f32, true, 96);
  check_grad_norm(report, (1 << 24) + 3, 0);
  check_mla_ops(report);
}

}  // namespace marrow
