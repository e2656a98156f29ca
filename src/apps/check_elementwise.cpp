// marrow check, elementwise group: the memory-bound ops (embedding, rmsnorm and its fusions with add
// and rope, rope (YaRN too), biases, add, router, dispatch, combine, swiglu, cross-entropy, AdamW, gradient norm), forward and backward, each
// against its f32 CPU reference on random inputs rounded to the GPU's dtypes (docs/gpu-path.md),
// at odd sizes and at the bench sizes where the CPU reference is cheap. GPU outputs start
// poisoned; accumulated outputs start from the same random values on both sides.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <iterator>
#include <string>

#include "apps/check.h"
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
#include "ops/swiglu.h"

namespace marrow {

namespace {

// Bounds on max |gpu - cpu| / max |cpu|. kBf16: a bf16 output is one rounding (2^-9 relative) off
// f32 math. kF32: f32 outputs of f32 math that sums in another order than the CPU. kSameOrder: f32
// results the GPU computes in the CPU's own order (exact in practice). kExact: copies.
constexpr double kBf16 = 1e-2, kF32 = 1e-5, kSameOrder = 1e-6, kExact = 0;

// A device copy, in the GPU dtype, of a host tensor, shaped like it.
struct OnDevice {
  Buffer buffer;
  Tensor tensor;
  OnDevice(Tensor host, DType dtype) : buffer(to_device(host, dtype)), tensor(host) {
    tensor.data = buffer.view().data;
    tensor.dtype = dtype;
    tensor.device = Device::cuda;
  }
  operator Tensor() const { return tensor; }
};

Buffer host_f32(std::initializer_list<int64_t> dims) { return Buffer(DType::f32, Device::cpu, dims); }

// normal(0, scale) values that bf16 holds exactly, so the CPU sees the GPU's inputs.
Buffer random_bf16(std::initializer_list<int64_t> dims, uint64_t seed, double scale = 1.0) {
  Buffer b = random_host(dims, seed, scale);
  round_to_bf16(b);
  return b;
}

// i32 values uniform in [0, limit).
Buffer random_ids(std::initializer_list<int64_t> dims, int64_t limit, uint64_t seed) {
  Buffer b(DType::i32, Device::cpu, dims);
  Philox rng = philox_for(seed, "check ids");
  for (int64_t i = 0; i < b.numel(); ++i)
    b.ptr<int32_t>()[i] = int32_t(std::min<int64_t>(int64_t(rng.uniform(uint64_t(i)) * double(limit)), limit - 1));
  return b;
}

// The embedding gradient's row flags (ops/known_zero.h): every third row flagged (and zero), the
// others holding old values; a restart, then a backward with the flags, twice (the second adds to
// rows of the first). GPU against CPU bit for bit, gradient and flags.
void check_embedding_known_zero(CheckReport& report, const Buffer& ids, const OnDevice& ids_d, const Buffer& dout, const OnDevice& dout_d,
                                int64_t vocab, int64_t h, const std::string& size) {
  Buffer dtable = random_host({vocab, h}, 5), flags(DType::i32, Device::cpu, {vocab});
  for (int64_t v = 0; v < vocab; ++v) {
    flags.ptr<int32_t>()[v] = v % 3 == 0;
    if (v % 3 == 0) std::fill(dtable.ptr<float>() + v * h, dtable.ptr<float>() + (v + 1) * h, 0.0f);
  }
  OnDevice dtable_d(dtable, DType::f32), flags_d(flags, DType::i32);
  restart_known_zero(dtable, flags);
  restart_known_zero(dtable_d, flags_d);
  report.expect_equal("restart_known_zero grad " + size, dtable_d, dtable);
  report.expect_equal("restart_known_zero flags " + size, flags_d, flags);
  for (int pass = 1; pass <= 2; ++pass) {
    embedding_backward(dtable, dout, ids, flags);
    embedding_backward(dtable_d, dout_d, ids_d, flags_d);
    report.expect_equal(fmt::format("embedding_backward known zero, pass {}: dtable {}", pass, size), dtable_d, dtable);
    report.expect_equal(fmt::format("embedding_backward known zero, pass {}: flags {}", pass, size), flags_d, flags);
  }
}

void check_embedding(CheckReport& report, int64_t n, int64_t vocab, int64_t h) {
  const std::string size = fmt::format("T={} V={} H={}", n, vocab, h);
  Buffer ids = random_ids({n}, vocab, 1), table = random_bf16({vocab, h}, 2), out = host_f32({n, h});
  for (int64_t t = 0; t < n; t += 5) ids.ptr<int32_t>()[t] = 7;  // one long run of equal ids, like padding
  OnDevice ids_d(ids, DType::i32), table_d(table, DType::bf16);
  Buffer out_d = poisoned(DType::bf16, {n, h});
  embedding_forward(out, ids, table);
  embedding_forward(out_d, ids_d, table_d);
  report.compare("embedding_forward " + size, out_d, out, kExact);

  Buffer dout = random_bf16({n, h}, 3), dtable = random_host({vocab, h}, 4);
  OnDevice dout_d(dout, DType::bf16), dtable_d(dtable, DType::f32);
  embedding_backward(dtable, dout, ids);
  embedding_backward(dtable_d, dout_d, ids_d);
  report.compare("embedding_backward dtable " + size, dtable_d, dtable, kSameOrder);
  check_embedding_known_zero(report, ids, ids_d, dout, dout_d, vocab, h, size);
}

void check_rmsnorm(CheckReport& report, int64_t n, int64_t d) {
  const std::string size = fmt::format("N={} D={}", n, d);
  const double eps = 1e-6;
  Buffer x = random_bf16({n, d}, 10), weight = random_bf16({d}, 11, 0.5), y = host_f32({n, d}), rstd = host_f32({n});
  OnDevice x_d(x, DType::bf16), weight_d(weight, DType::bf16);
  Buffer y_d = poisoned(DType::bf16, {n, d}), rstd_d = poisoned(DType::f32, {n});
  rmsnorm_forward(y, rstd, x, weight, eps);
  rmsnorm_forward(y_d, rstd_d, x_d, weight_d, eps);
  report.compare("rmsnorm_forward y " + size, y_d, y, kBf16);
  report.compare("rmsnorm_forward rstd " + size, rstd_d, rstd, kF32);

  Buffer dy = random_bf16({n, d}, 12), dx = host_f32({n, d}), dweight = random_host({d}, 13);
  OnDevice dy_d(dy, DType::bf16), rstd_same(rstd, DType::f32), dweight_d(dweight, DType::f32);
  Buffer dx_d = poisoned(DType::bf16, {n, d});
  rmsnorm_backward(dx, dweight, dy, x, weight, rstd);
  rmsnorm_backward(dx_d, dweight_d, dy_d, x_d, weight_d, rstd_same);
  report.compare("rmsnorm_backward dx " + size, dx_d, dx, kBf16);
  report.compare("rmsnorm_backward dweight " + size, dweight_d, dweight, kF32);
}

// The residual add fused into the norm (sum written over x, as the model does) and the residual's
// gradient joined to dx (written over dresidual). Against the f32 CPU reference -- whose norm reads
// the sum rounded to bf16, as the GPU's does -- and bit for bit against the unfused GPU ops (add,
// then rmsnorm_forward; rmsnorm_backward, then add), which the fused kernels round and sum like.
// dweight runs twice from the same start: the same bits.
void check_rmsnorm_add(CheckReport& report, int64_t n, int64_t d) {
  const std::string size = fmt::format("N={} D={}", n, d);
  const double eps = 1e-6;
  Buffer x = random_bf16({n, d}, 14), residual = random_bf16({n, d}, 15), weight = random_bf16({d}, 16, 0.5);
  Buffer sum = host_f32({n, d}), y = host_f32({n, d}), rstd = host_f32({n});
  OnDevice x_d(x, DType::bf16), residual_d(residual, DType::bf16), weight_d(weight, DType::bf16), sum_unfused_d(x, DType::bf16);
  Buffer y_d = poisoned(DType::bf16, {n, d}), rstd_d = poisoned(DType::f32, {n});
  Buffer y_unfused_d = poisoned(DType::bf16, {n, d}), rstd_unfused_d = poisoned(DType::f32, {n});
  rmsnorm_add_forward(y, sum, rstd, x, residual, weight, eps);
  rmsnorm_add_forward(y_d, x_d, rstd_d, x_d, residual_d, weight_d, eps);
  add(sum_unfused_d, sum_unfused_d, residual_d);
  rmsnorm_forward(y_unfused_d, rstd_unfused_d, sum_unfused_d, weight_d, eps);
  report.compare("rmsnorm_add_forward sum in place " + size, x_d, sum, kBf16);
  round_to_bf16(sum);
  rmsnorm_forward(y, rstd, sum, weight, eps);
  report.compare("rmsnorm_add_forward y " + size, y_d, y, kBf16);
  report.compare("rmsnorm_add_forward rstd " + size, rstd_d, rstd, kF32);
  report.expect_equal("rmsnorm_add_forward sum = add's bits " + size, x_d, to_host(sum_unfused_d));
  report.expect_equal("rmsnorm_add_forward y = add + rmsnorm_forward bits " + size, y_d, to_host(y_unfused_d));
  report.expect_equal("rmsnorm_add_forward rstd = add + rmsnorm_forward bits " + size, rstd_d, to_host(rstd_unfused_d));

  Buffer dy = random_bf16({n, d}, 17), dresidual = random_bf16({n, d}, 18), dx = host_f32({n, d}), dweight = random_host({d}, 19);
  OnDevice dy_d(dy, DType::bf16), sum_d(sum, DType::bf16), rstd_same(rstd, DType::f32);
  OnDevice dx_d(dresidual, DType::bf16), dx_again_d(dresidual, DType::bf16), dresidual_d(dresidual, DType::bf16);
  OnDevice dweight_d(dweight, DType::f32), dweight_again_d(dweight, DType::f32), dweight_unfused_d(dweight, DType::f32),
      dweight_table_d(dweight, DType::f32);
  Buffer dx_unfused_d = poisoned(DType::bf16, {n, d});
  rmsnorm_backward(dx, dweight, dy, sum, weight, rstd, dresidual);
  rmsnorm_backward(dx_d, dweight_d, dy_d, sum_d, weight_d, rstd_same, dx_d);
  rmsnorm_backward(dx_again_d, dweight_again_d, dy_d, sum_d, weight_d, rstd_same, dx_again_d);
  rmsnorm_backward(dx_unfused_d, dweight_unfused_d, dy_d, sum_d, weight_d, rstd_same);
  add(dx_unfused_d, dx_unfused_d, dresidual_d);
  report.compare("rmsnorm_backward + dresidual in place dx " + size, dx_d, dx, kBf16);
  report.compare("rmsnorm_backward + dresidual dweight " + size, dweight_d, dweight, kF32);
  report.expect_equal("rmsnorm_backward + dresidual dx = rmsnorm_backward + add bits " + size, dx_d, to_host(dx_unfused_d));
  report.expect_equal("rmsnorm_backward + dresidual dweight = rmsnorm_backward bits " + size, dweight_d, to_host(dweight_unfused_d));
  report.expect_equal("rmsnorm_backward + dresidual dx, two runs " + size, dx_again_d, to_host(dx_d));
  report.expect_equal("rmsnorm_backward + dresidual dweight, two runs " + size, dweight_again_d, to_host(dweight_d));
}

// QK-norm with RoPE in one op against the f32 CPU reference (the norm, then rope, unrounded between
// them: bf16 bounds) and bit for bit against the unfused GPU ops (rmsnorm_forward, then rope_forward
// in place; rope_backward, then rmsnorm_backward); dweight twice from the same start: the same bits.
// Random positions in [0, 40000).
void check_rmsnorm_rope(CheckReport& report, int64_t n, int64_t heads, int64_t d) {
  const std::string size = fmt::format("T={} H={} D={}", n, heads, d);
  const double eps = 1e-6, theta = 1e6;
  Buffer positions = random_ids({n}, 40000, 29);
  Buffer x = random_bf16({n, heads, d}, 24), weight = random_bf16({d}, 25, 0.5), y = host_f32({n, heads, d}), rstd = host_f32({n * heads});
  OnDevice positions_d(positions, DType::i32), x_d(x, DType::bf16), weight_d(weight, DType::bf16);
  Buffer y_d = poisoned(DType::bf16, {n, heads, d}), rstd_d = poisoned(DType::f32, {n * heads});
  Buffer y_unfused_d = poisoned(DType::bf16, {n, heads, d}), rstd_unfused_d = poisoned(DType::f32, {n * heads});
  rmsnorm_rope_forward(y, rstd, x, weight, positions, eps, theta);
  rmsnorm_rope_forward(y_d, rstd_d, x_d, weight_d, positions_d, eps, theta);
  rmsnorm_forward(y_unfused_d.view().reshape({n * heads, d}), rstd_unfused_d, x_d.tensor.reshape({n * heads, d}), weight_d, eps);
  rope_forward(y_unfused_d, y_unfused_d, positions_d, theta);
  report.compare("rmsnorm_rope_forward y " + size, y_d, y, kBf16);
  report.compare("rmsnorm_rope_forward rstd " + size, rstd_d, rstd, kF32);
  report.expect_equal("rmsnorm_rope_forward y = rmsnorm_forward + rope_forward bits " + size, y_d, to_host(y_unfused_d));
  report.expect_equal("rmsnorm_rope_forward rstd = rmsnorm_forward bits " + size, rstd_d, to_host(rstd_unfused_d));
  // The same with the angles' cosines and sines read from rope_cos_sin_table: the same bits.
  Buffer table = host_f32({n, d / 2, 2}), table_d = poisoned(DType::f32, {n, d / 2, 2});
  rope_cos_sin_table(table, positions, d, theta);
  rope_cos_sin_table(table_d, positions_d, d, theta);
  report.compare("rope_cos_sin_table " + size, table_d, table, kF32);
  Buffer y_table_d = poisoned(DType::bf16, {n, heads, d}), rstd_table_d = poisoned(DType::f32, {n * heads});
  rmsnorm_rope_forward(y_table_d, rstd_table_d, x_d, weight_d, positions_d, eps, theta, table_d);
  report.expect_equal("rmsnorm_rope_forward with the cos/sin table: y bits " + size, y_table_d, to_host(y_d));
  report.expect_equal("rmsnorm_rope_forward with the cos/sin table: rstd bits " + size, rstd_table_d, to_host(rstd_d));

  Buffer dy = random_bf16({n, heads, d}, 26), dx = host_f32({n, heads, d}), dweight = random_host({d}, 27);
  OnDevice dy_d(dy, DType::bf16), dy_unrotated_d(dy, DType::bf16), rstd_same(rstd, DType::f32);
  OnDevice dweight_d(dweight, DType::f32), dweight_again_d(dweight, DType::f32), dweight_unfused_d(dweight, DType::f32),
      dweight_table_d(dweight, DType::f32);
  Buffer dx_d = poisoned(DType::bf16, {n, heads, d}), dx_again_d = poisoned(DType::bf16, {n, heads, d}),
         dx_unfused_d = poisoned(DType::bf16, {n, heads, d});
  rmsnorm_rope_backward(dx, dweight, dy, x, weight, rstd, positions, theta);
  rmsnorm_rope_backward(dx_d, dweight_d, dy_d, x_d, weight_d, rstd_same, positions_d, theta);
  rmsnorm_rope_backward(dx_again_d, dweight_again_d, dy_d, x_d, weight_d, rstd_same, positions_d, theta);
  rope_backward(dy_unrotated_d, dy_unrotated_d, positions_d, theta);
  rmsnorm_backward(dx_unfused_d.view().reshape({n * heads, d}), dweight_unfused_d, dy_unrotated_d.tensor.reshape({n * heads, d}),
                   x_d.tensor.reshape({n * heads, d}), weight_d, rstd_same);
  report.compare("rmsnorm_rope_backward dx " + size, dx_d, dx, kBf16);
  // The GPU sums dy un-rotated and rounded to bf16 (2^-9 each), the CPU unrounded.
  report.compare("rmsnorm_rope_backward dweight " + size, dweight_d, dweight, kBf16);
  report.expect_equal("rmsnorm_rope_backward dx = rope_backward + rmsnorm_backward bits " + size, dx_d, to_host(dx_unfused_d));
  report.expect_equal("rmsnorm_rope_backward dweight = rope_backward + rmsnorm_backward bits " + size, dweight_d,
                      to_host(dweight_unfused_d));
  report.expect_equal("rmsnorm_rope_backward dx, two runs " + size, dx_again_d, to_host(dx_d));
  report.expect_equal("rmsnorm_rope_backward dweight, two runs " + size, dweight_again_d, to_host(dweight_d));
  Buffer dx_table_d = poisoned(DType::bf16, {n, heads, d});
  rmsnorm_rope_backward(dx_table_d, dweight_table_d, dy_d, x_d, weight_d, rstd_same, positions_d, theta, table_d);
  report.expect_equal("rmsnorm_rope_backward with the cos/sin table: dx bits " + size, dx_table_d, to_host(dx_d));
  report.expect_equal("rmsnorm_rope_backward with the cos/sin table: dweight bits " + size, dweight_table_d, to_host(dweight_d));
}

// rope_forward and rope_backward on random x [n, heads, d] (seeds seed, seed + 1) at `positions`,
// GPU against CPU; `rope` is a theta or RopeParameters.
template <class Rope>
void compare_rope(CheckReport& report, const std::string& size, const Buffer& positions, int64_t n, int64_t heads, int64_t d, bool in_place,
                  uint64_t seed, const Rope& rope) {
  OnDevice positions_d(positions, DType::i32);
  for (int backward = 0; backward < 2; ++backward) {
    Buffer x = random_bf16({n, heads, d}, seed + backward), y = host_f32({n, heads, d});
    OnDevice x_d(x, DType::bf16);
    Buffer y_d = poisoned(DType::bf16, {n, heads, d});
    Tensor out_d = in_place ? x_d.tensor : y_d.view();
    if (backward) {
      rope_backward(y, x, positions, rope);
      rope_backward(out_d, x_d, positions_d, rope);
    } else {
      rope_forward(y, x, positions, rope);
      rope_forward(out_d, x_d, positions_d, rope);
    }
    report.compare((backward ? "rope_backward " : "rope_forward ") + size, out_d, y, kBf16);
  }
}

// positions = t when `sequential`, else random in [0, 40000); the bench size runs in place.
void check_rope(CheckReport& report, int64_t n, int64_t heads, int64_t d, bool sequential, bool in_place) {
  const std::string size = fmt::format("T={} H={} D={}{}", n, heads, d, in_place ? " in place" : "");
  const double theta = 1e6;
  Buffer positions = random_ids({n}, 40000, 20);
  if (sequential)
    for (int64_t t = 0; t < n; ++t) positions.ptr<int32_t>()[t] = int32_t(t);
  compare_rope(report, size, positions, n, heads, d, in_place, 21, theta);
}

// YaRN RoPE with GPT-OSS's rope_parameters (attention_factor 0: Hugging Face's default, 1.35 for
// factor 32; 1: the unscaled kernel with YaRN's frequencies) at random positions in [0, 131072)
// with 0, the original context's edge (4095, 4096) and the longest (131071) among them.
void check_rope_yarn(CheckReport& report, int64_t n, int64_t heads, int64_t d, bool in_place, double attention_factor) {
  const std::string size =
      fmt::format("yarn attention_factor {} T={} H={} D={}{}", attention_factor, n, heads, d, in_place ? " in place" : "");
  RopeParameters rope;
  rope.theta = 150000.0;
  rope.yarn = true;
  rope.factor = 32.0;
  rope.beta_fast = 32.0;
  rope.beta_slow = 1.0;
  rope.original_max_positions = 4096;
  rope.truncate = false;
  rope.attention_factor = attention_factor;
  Buffer positions = random_ids({n}, 131072, 28);
  const int32_t planted[] = {0, 4095, 4096, 131071};
  std::copy(std::begin(planted), std::end(planted), positions.ptr<int32_t>());
  compare_rope(report, size, positions, n, heads, d, in_place, 23, rope);
}

// bias_forward in place, then bias_backward accumulating into random values and overwriting poison,
// each twice from the same start (the same bits: the GPU's column sums run in a fixed order, not
// the CPU's: kF32).
void check_bias(CheckReport& report, int64_t n, int64_t o) {
  const std::string size = fmt::format("N={} O={}", n, o);
  Buffer y = random_bf16({n, o}, 100), bias = random_bf16({o}, 101);
  OnDevice y_d(y, DType::bf16), bias_d(bias, DType::bf16);
  bias_forward(y, bias);
  bias_forward(y_d, bias_d);
  report.compare("bias_forward in place " + size, y_d, y, kBf16);
  // f32 rows (the router's logits) with a bf16 bias.
  Buffer logits = random_host({n, o}, 104);
  OnDevice logits_d(logits, DType::f32);
  bias_forward(logits, bias);
  bias_forward(logits_d, bias_d);
  report.compare("bias_forward f32 rows in place " + size, logits_d, logits, kF32);

  Buffer dy = random_bf16({n, o}, 102);
  OnDevice dy_d(dy, DType::bf16);
  for (bool overwrite : {false, true}) {
    const std::string what = overwrite ? "bias_backward overwrite " : "bias_backward accumulate ";
    Buffer dbias = random_host({o}, 103);
    Buffer dbias_d = overwrite ? poisoned(DType::f32, {o}) : to_device(dbias, DType::f32);
    Buffer again_d = overwrite ? poisoned(DType::f32, {o}) : to_device(dbias, DType::f32);
    bias_backward(dbias, dy, overwrite);
    bias_backward(dbias_d, dy_d, overwrite);
    bias_backward(again_d, dy_d, overwrite);
    report.compare(what + size, dbias_d, dbias, kF32);
    report.expect_equal(what + "two runs " + size, again_d, to_host(dbias_d));
  }
}

// The grouped biases on the rows of experts with `counts` rows each (empty ones and one of a single
// row among them), expert_offsets on the GPU (one process) or on the host (expert parallelism).
// The backward with and without row_scale, accumulating into random values (experts without rows
// keep them) and overwriting poison (they get zeros), each twice: the same bits. dot_add on copies
// that read row 7i mod (R + 3), -1 past R, into random values (the -1 entries keep them).
void check_grouped_bias(CheckReport& report, const std::vector<int32_t>& counts, int64_t o, bool offsets_on_gpu) {
  const Buffer offsets = offsets_host(counts), offsets_gpu = to_device(offsets, DType::i32);
  const Tensor offsets_d = offsets_on_gpu ? offsets_gpu.view() : offsets.view();
  const int64_t e = int64_t(counts.size()), rows = offsets.ptr<int32_t>()[e];
  const std::string size = fmt::format("E={} R={} O={} offsets on the {}", e, rows, o, offsets_on_gpu ? "GPU" : "host");
  Buffer y = random_bf16({rows, o}, 110), bias = random_bf16({e, o}, 111);
  OnDevice y_d(y, DType::bf16), bias_d(bias, DType::bf16);
  grouped_bias_forward(y, bias, offsets);
  grouped_bias_forward(y_d, bias_d, offsets_d);
  report.compare("grouped_bias_forward in place " + size, y_d, y, kBf16);

  Buffer dy = random_bf16({rows, o}, 112), scale = random_host({rows}, 113);
  OnDevice dy_d(dy, DType::bf16), scale_d(scale, DType::f32);
  for (bool scaled : {false, true})
    for (bool overwrite : {false, true}) {
      const std::string what =
          fmt::format("grouped_bias_backward{} {} ", scaled ? " row_scale" : "", overwrite ? "overwrite" : "accumulate");
      const Tensor row_scale = scaled ? scale.view() : Tensor{}, row_scale_d = scaled ? scale_d.tensor : Tensor{};
      Buffer dbias = random_host({e, o}, 114);
      Buffer dbias_d = overwrite ? poisoned(DType::f32, {e, o}) : to_device(dbias, DType::f32);
      Buffer again_d = overwrite ? poisoned(DType::f32, {e, o}) : to_device(dbias, DType::f32);
      grouped_bias_backward(dbias, dy, offsets, overwrite, row_scale);
      grouped_bias_backward(dbias_d.view().reshape({e, o}), dy_d, offsets_d, overwrite, row_scale_d);  // to_device's copies are flat
      grouped_bias_backward(again_d.view().reshape({e, o}), dy_d, offsets_d, overwrite, row_scale_d);
      report.compare(what + size, dbias_d, dbias, kF32);
      report.expect_equal(what + "two runs " + size, again_d, to_host(dbias_d));
    }

  const int64_t k = 2, tokens = (rows + 3 + k - 1) / k;
  Buffer copy_row(DType::i32, Device::cpu, {tokens, k}), dtopk_weight = random_host({tokens, k}, 115);
  for (int64_t i = 0; i < tokens * k; ++i) {
    const int64_t r = i * 7 % (rows + 3);
    copy_row.ptr<int32_t>()[i] = r < rows ? int32_t(r) : -1;
  }
  OnDevice copy_row_d(copy_row, DType::i32), dtopk_weight_d(dtopk_weight, DType::f32);
  grouped_bias_dot_add(dtopk_weight, dy, bias, offsets, copy_row);
  grouped_bias_dot_add(dtopk_weight_d, dy_d, bias_d, offsets_d, copy_row_d);
  report.compare("grouped_bias_dot_add " + size, dtopk_weight_d, dtopk_weight, kF32);
}

void check_add(CheckReport& report, int64_t rows, int64_t cols, DType dtype) {
  const std::string size = fmt::format("{} [{}, {}] in place", dtype_name(dtype), rows, cols);
  Buffer a = random_bf16({rows, cols}, 30), b = random_bf16({rows, cols}, 31), out = host_f32({rows, cols});
  OnDevice a_d(a, dtype), b_d(b, dtype);
  add(out, a, b);
  add(a_d, a_d, b_d);
  report.compare("add " + size, a_d, out, dtype == DType::bf16 ? kBf16 : kSameOrder);
}

// acc (f32) += x (bf16 or f32): x's values are bf16-exact on both sides, one f32 addition each.
void check_add_into(CheckReport& report, int64_t rows, int64_t cols, DType dtype) {
  const std::string size = fmt::format("{} [{}, {}]", dtype_name(dtype), rows, cols);
  Buffer acc = random_bf16({rows, cols}, 32), x = random_bf16({rows, cols}, 33);
  OnDevice acc_d(acc, DType::f32), x_d(x, dtype);
  add_into(acc, x);
  add_into(acc_d, x_d);
  report.compare("add_into f32 += " + size, acc_d, acc, kSameOrder);
}

void check_swiglu(CheckReport& report, int64_t rows, int64_t inter) {
  const std::string size = fmt::format("R={} I={}", rows, inter);
  Buffer gate_up = random_bf16({rows, 2 * inter}, 40, 2.0), out = host_f32({rows, inter});
  OnDevice gate_up_d(gate_up, DType::bf16);
  Buffer out_d = poisoned(DType::bf16, {rows, inter});
  swiglu_forward(out, gate_up);
  swiglu_forward(out_d, gate_up_d);
  report.compare("swiglu_forward " + size, out_d, out, kBf16);

  Buffer dout = random_bf16({rows, inter}, 41), dgate_up = host_f32({rows, 2 * inter});
  OnDevice dout_d(dout, DType::bf16);
  Buffer dgate_up_d = poisoned(DType::bf16, {rows, 2 * inter});
  swiglu_backward(dgate_up, dout, gate_up);
  swiglu_backward(dgate_up_d, dout_d, gate_up_d);
  report.compare("swiglu_backward " + size, dgate_up_d, dgate_up, kBf16);
}

// GPT-OSS's alpha; its limit is 7, and a limit of 1.5 makes the clamps bite on many more values.
constexpr double kClampedAlpha = 1.702;

// Row 0's first four interleaved (gate, up) pairs at and past the clamps' bounds: gate and up at the
// limit (both pass the gradient), gate past it (none) with up at -limit (passes), gate past -limit
// (gate has no lower clamp) with up past the limit, and up past -limit. bf16 holds them for the
// limits checked here (7, 7.25, 1.5, 1.75); I >= 4.
void plant_clamp_bounds(Tensor gate_up, double limit) {
  const float at = float(limit), past = float(limit + 0.25);
  const float pairs[8] = {at, at, past, -at, -past, past, 0.5f, -past};
  std::copy(std::begin(pairs), std::end(pairs), gate_up.ptr<float>());
  round_to_bf16(gate_up);
}

// gate_up drawn at the limit's scale: about a sixth of the gates and a third of the ups lie past a bound.
void check_clamped_swiglu(CheckReport& report, int64_t rows, int64_t inter) {
  for (double limit : {7.0, 1.5}) {
    const std::string size = fmt::format("R={} I={} limit {}", rows, inter, limit);
    Buffer gate_up = random_bf16({rows, 2 * inter}, 130, limit), out = host_f32({rows, inter});
    plant_clamp_bounds(gate_up, limit);
    OnDevice gate_up_d(gate_up, DType::bf16);
    Buffer out_d = poisoned(DType::bf16, {rows, inter});
    clamped_swiglu_forward(out, gate_up, kClampedAlpha, limit);
    clamped_swiglu_forward(out_d, gate_up_d, kClampedAlpha, limit);
    report.compare("clamped_swiglu_forward " + size, out_d, out, kBf16);

    Buffer dout = random_bf16({rows, inter}, 131), dgate_up = host_f32({rows, 2 * inter});
    OnDevice dout_d(dout, DType::bf16);
    Buffer dgate_up_d = poisoned(DType::bf16, {rows, 2 * inter});
    clamped_swiglu_backward(dgate_up, dout, gate_up, kClampedAlpha, limit);
    clamped_swiglu_backward(dgate_up_d, dout_d, gate_up_d, kClampedAlpha, limit);
    report.compare("clamped_swiglu_backward " + size, dgate_up_d, dgate_up, kBf16);
  }
}

// The CPU's routing of T tokens over E experts, top-K, which the ops after the router take.
struct Routing {
  int64_t n, e, k;
  Buffer topk_weight, topk_index;
  std::string size;
};

// The router's forward, statistics, aux loss and backward; each GPU op gets the CPU's inputs, so a
// failure points at one op. Expert `starved` (if >= 0) gets a logit of -30 for every token, so it
// receives zero tokens.
Routing check_router(CheckReport& report, int64_t n, int64_t e, int64_t k, bool normalize, int64_t starved) {
  const std::string size = fmt::format("T={} E={} K={}", n, e, k);
  Buffer logits = random_host({n, e}, 50, 2.0);
  if (starved >= 0)
    for (int64_t t = 0; t < n; ++t) logits.ptr<float>()[t * e + starved] = -30;
  Buffer probs = host_f32({n, e}), topk_weight = host_f32({n, k}), topk_index(DType::i32, Device::cpu, {n, k});
  OnDevice logits_d(logits, DType::f32);
  Buffer probs_d = poisoned(DType::f32, {n, e}), topk_weight_d = poisoned(DType::f32, {n, k}),
         topk_index_d = poisoned(DType::i32, {n, k});
  router_forward(probs, topk_index, topk_weight, logits, normalize);
  router_forward(probs_d, topk_index_d, topk_weight_d, logits_d, normalize);
  report.compare("router_forward probs " + size, probs_d, probs, kF32);
  report.expect_equal("router_forward topk_index " + size, topk_index_d, topk_index);
  report.compare("router_forward topk_weight " + size, topk_weight_d, topk_weight, kF32);

  OnDevice probs_same(probs, DType::f32), index_same(topk_index, DType::i32), weight_same(topk_weight, DType::f32);
  Buffer stats = host_f32({2 * e + 1}), stats_d = poisoned(DType::f32, {2 * e + 1});
  router_statistics(stats, probs, topk_index);
  router_statistics(stats_d, probs_same, index_same);
  report.expect_equal("router_statistics counts " + size, stats_d.view().rows(0, e), stats.view().rows(0, e));
  report.compare("router_statistics sums " + size, stats_d.view().rows(e, 2 * e + 1), stats.view().rows(e, 2 * e + 1), kF32);
  Buffer aux = host_f32({1}), aux_d = host_f32({1});
  aux.ptr<float>()[0] = float(router_aux_loss(stats));
  aux_d.ptr<float>()[0] = float(router_aux_loss(stats_d));
  report.compare("router_aux_loss " + size, aux_d, aux, kF32);
  // The engine's form sums on the device: the same double arithmetic, so the same bits as the host's.
  Buffer total = Buffer::zeros(DType::f64, Device::cpu, {1}), total_d = Buffer::zeros(DType::f64, Device::cuda, {1});
  router_aux_loss_add(total, to_host(stats_d));
  router_aux_loss_add(total_d, stats_d);
  report.expect_equal("router_aux_loss_add " + size, total_d, total);

  // aux_grad = T / 2 makes the aux term's gradient comparable to the routing weights'.
  Buffer dtopk = random_host({n, k}, 51), dlogits = host_f32({n, e});
  OnDevice dtopk_d(dtopk, DType::f32);
  Buffer dlogits_d = poisoned(DType::bf16, {n, e});
  OnDevice stats_same(stats, DType::f32);
  router_backward(dlogits, dtopk, probs, topk_index, topk_weight, normalize, 0.5 * double(n), stats);
  router_backward(dlogits_d, dtopk_d, probs_same, index_same, weight_same, normalize, 0.5 * double(n), stats_same);
  report.compare("router_backward dlogits " + size, dlogits_d, dlogits, kBf16);
  return {n, e, k, std::move(topk_weight), std::move(topk_index), size};
}

// The dispatch plan, dispatch and combine on one routing at hidden size H, from the CPU's inputs
// (topk_index, copy_row) as above.
void check_dispatch_combine(CheckReport& report, const Routing& routing, int64_t h) {
  const int64_t n = routing.n, e = routing.e, k = routing.k;
  const std::string& size = routing.size;
  const Buffer& topk_weight = routing.topk_weight;
  const Buffer& topk_index = routing.topk_index;
  OnDevice index_same(topk_index, DType::i32), weight_same(topk_weight, DType::f32);
  Buffer offsets(DType::i32, Device::cpu, {e + 1}), offsets_gpu(DType::i32, Device::cpu, {e + 1});
  Buffer copy_row(DType::i32, Device::cpu, {n, k}), copy_row_d = poisoned(DType::i32, {n, k});
  std::fill(offsets_gpu.ptr<int32_t>(), offsets_gpu.ptr<int32_t>() + e + 1, -1);
  dispatch_plan(offsets, copy_row, topk_index);
  dispatch_plan(offsets_gpu, copy_row_d, index_same);
  report.expect_equal("dispatch_plan expert_offsets " + size, offsets_gpu, offsets);
  report.expect_equal("dispatch_plan copy_row " + size, copy_row_d, copy_row);

  const std::string hsize = fmt::format("{} H={}", size, h);
  OnDevice rows_same(copy_row, DType::i32);
  Buffer x = random_bf16({n, h}, 52), x_perm = host_f32({n * k, h});
  OnDevice x_d(x, DType::bf16);
  Buffer x_perm_d = poisoned(DType::bf16, {n * k, h});
  dispatch_forward(x_perm, x, copy_row);
  dispatch_forward(x_perm_d, x_d, rows_same);
  report.compare("dispatch_forward " + hsize, x_perm_d, x_perm, kExact);

  Buffer dx_perm = random_bf16({n * k, h}, 53), dx = host_f32({n, h});
  OnDevice dx_perm_d(dx_perm, DType::bf16);
  Buffer dx_d = poisoned(DType::bf16, {n, h});
  dispatch_backward(dx, dx_perm, copy_row);
  dispatch_backward(dx_d, dx_perm_d, rows_same);
  report.compare("dispatch_backward " + hsize, dx_d, dx, kBf16);

  // The model updates the residual stream in place: out aliases residual on the GPU.
  Buffer residual = random_bf16({n, h}, 54), y_perm = random_bf16({n * k, h}, 55), out = host_f32({n, h});
  OnDevice residual_d(residual, DType::bf16), y_perm_d(y_perm, DType::bf16);
  combine_forward(out, residual, y_perm, topk_weight, copy_row);
  combine_forward(residual_d, residual_d, y_perm_d, weight_same, rows_same);
  report.compare("combine_forward in place " + hsize, residual_d, out, kBf16);

  Buffer dout = random_bf16({n, h}, 56), dy_perm = host_f32({n * k, h}), dweight = host_f32({n, k});
  OnDevice dout_d(dout, DType::bf16);
  Buffer dy_perm_d = poisoned(DType::bf16, {n * k, h}), dweight_d = poisoned(DType::f32, {n, k});
  combine_backward(dy_perm, dweight, dout, y_perm, topk_weight, copy_row);
  combine_backward(dy_perm_d, dweight_d, dout_d, y_perm_d, weight_same, rows_same);
  report.compare("combine_backward dy_perm " + hsize, dy_perm_d, dy_perm, kBf16);
  report.compare("combine_backward dtopk_weight " + hsize, dweight_d, dweight, kF32);
}


// Router, dispatch and combine on one routing: T tokens, E experts, top-K, hidden size H.
void check_moe(CheckReport& report, int64_t n, int64_t e, int64_t k, int64_t h, bool normalize, int64_t starved) {
  check_dispatch_combine(report, check_router(report, n, e, k, normalize, starved), h);
}

// Expert indices outside [0, E) (-1 and E here): the GPU statistics count them for no expert, the
// GPU plan with offsets on the host refuses E, and with offsets on the GPU takes both as -1 (not
// here): copy_row -1, expert_offsets[E] the other copies.
void check_routing_outside(CheckReport& report, int64_t n, int64_t e, int64_t k) {
  const std::string size = fmt::format("T={} E={} K={}", n, e, k);
  Buffer topk_index(DType::i32, Device::cpu, {n, k});
  int32_t* idx = topk_index.ptr<int32_t>();
  for (int64_t i = 0; i < n * k; ++i) idx[i] = int32_t(i % e);
  idx[3] = -1;
  idx[n * k - 2] = int32_t(e);
  Buffer counts = host_f32({e});
  std::fill(counts.ptr<float>(), counts.ptr<float>() + e, 0.0f);
  for (int64_t i = 0; i < n * k; ++i)
    if (0 <= idx[i] && idx[i] < e) counts.ptr<float>()[idx[i]] += 1;
  OnDevice index_d(topk_index, DType::i32), probs_d(random_host({n, e}, 57), DType::f32);
  Buffer stats_d = poisoned(DType::f32, {2 * e + 1});
  router_statistics(stats_d, probs_d, index_d);
  report.expect_equal("router_statistics counts, indices outside [0, E) " + size, stats_d.view().rows(0, e), counts);

  Buffer offsets(DType::i32, Device::cpu, {e + 1}), copy_row = poisoned(DType::i32, {n, k});
  bool rejected = false;
  try {
    dispatch_plan(offsets, copy_row, index_d);
  } catch (const Error&) {
    rejected = true;
  }
  report.add({"dispatch_plan rejects indices outside [0, E) " + size, rejected ? 0.0 : 1.0, 0, rejected});
  Buffer offsets_d = poisoned(DType::i32, {e + 1}), copy_row_d = poisoned(DType::i32, {n, k});
  dispatch_plan(offsets_d, copy_row_d, index_d);
  const Buffer last = to_host(offsets_d);
  const int64_t valid = n * k - 2;
  report.add({"dispatch_plan offsets on the GPU: expert_offsets[E] = valid copies, indices outside [0, E) " + size,
              double(std::abs(last.ptr<int32_t>()[e] - valid)), 0, last.ptr<int32_t>()[e] == valid});
  // The CPU plan with every index outside [0, E) as -1.
  Buffer absent(DType::i32, Device::cpu, {n, k}), expected(DType::i32, Device::cpu, {n, k});
  Buffer expected_offsets(DType::i32, Device::cpu, {e + 1});
  for (int64_t i = 0; i < n * k; ++i) absent.ptr<int32_t>()[i] = 0 <= idx[i] && idx[i] < e ? idx[i] : -1;
  dispatch_plan(expected_offsets, expected, absent);
  report.expect_equal("dispatch_plan copy_row on the GPU, indices outside [0, E) " + size, copy_row_d, expected);
}

// The sender's expert-parallel plan (ops/expert_sends.h) on the GPU against the CPU, bit for bit:
// members and copies per member, each token's row per member (dispatch_plan over the members, -1
// entries skipped), then the sent rows' slots; T tokens of top-K over E experts on P members.
void check_expert_sends(CheckReport& report, int64_t n, int64_t e, int64_t k, int64_t members) {
  const std::string size = fmt::format("T={} E={} K={} P={}", n, e, k, members);
  const int64_t local = e / members;
  Buffer topk_index = random_ids({n, k}, e, 91), owner(DType::i32, Device::cpu, {e});
  for (int64_t x = 0; x < e; ++x) owner.ptr<int32_t>()[x] = int32_t(x / local);
  OnDevice index_d(topk_index, DType::i32), owner_d(owner, DType::i32);
  Buffer member_index(DType::i32, Device::cpu, {n, members}), copies(DType::i32, Device::cpu, {members});
  Buffer member_index_d = poisoned(DType::i32, {n, members}), copies_d = poisoned(DType::i32, {members});
  expert_send_members(member_index, copies, topk_index, owner);
  expert_send_members(member_index_d, copies_d, index_d, owner_d);
  report.expect_equal("expert_send_members member_index " + size, member_index_d, member_index);
  report.expect_equal("expert_send_members copies " + size, copies_d, copies);
  Buffer offsets(DType::i32, Device::cpu, {members + 1}), send_row(DType::i32, Device::cpu, {n, members});
  Buffer offsets_d = poisoned(DType::i32, {members + 1}), send_row_d = poisoned(DType::i32, {n, members});
  dispatch_plan(offsets, send_row, member_index);
  dispatch_plan(offsets_d, send_row_d, member_index_d);
  report.expect_equal("dispatch_plan of the members, offsets " + size, offsets_d, offsets);
  report.expect_equal("dispatch_plan of the members, send_row " + size, send_row_d, send_row);
  Buffer slots(DType::i32, Device::cpu, {n * members, k}), slots_d = poisoned(DType::i32, {n * members, k});
  expert_send_slots(slots, topk_index, owner, send_row, local);
  expert_send_slots(slots_d, index_d, owner_d, send_row_d, local);
  report.expect_equal("expert_send_slots " + size, slots_d, slots);
}

// Expert parallelism: rank `rank` of `ranks` holds experts [rank * E / ranks, (rank + 1) * E / ranks)
// and sees its part of the plan: copy_row keeps the rows of its experts' copies, shifted to start
// at 0, and -1 for the copies other ranks hold, so the permuted tensors have R < T * K rows (the
// rank's block of the full plan). Token 0 sends every slot to the next rank, so at least one token
// has no copy here.
struct RankPlan {
  Buffer copy_row;
  int64_t rows = 0;
};

RankPlan rank_plan(int64_t n, int64_t e, int64_t k, int64_t ranks, int64_t rank) {
  const int64_t per_rank = e / ranks;
  Buffer topk_index = random_ids({n, k}, e, 90);
  for (int64_t j = 0; j < k; ++j) topk_index.ptr<int32_t>()[j] = int32_t((rank + 1) % ranks * per_rank);
  Buffer offsets(DType::i32, Device::cpu, {e + 1});
  RankPlan plan{Buffer(DType::i32, Device::cpu, {n, k})};
  dispatch_plan(offsets, plan.copy_row, topk_index);
  const int32_t first = offsets.ptr<int32_t>()[rank * per_rank], end = offsets.ptr<int32_t>()[(rank + 1) * per_rank];
  int32_t* row = plan.copy_row.ptr<int32_t>();
  for (int64_t i = 0; i < n * k; ++i) row[i] = first <= row[i] && row[i] < end ? row[i] - first : -1;
  plan.rows = end - first;
  return plan;
}

// Dispatch on a rank's plan, in `dtype`: bf16 activations, or f32 routing weights and their
// gradients (H = K).
void check_dispatch_rank(CheckReport& report, int64_t n, int64_t e, int64_t k, int64_t h, int64_t ranks, int64_t rank,
                         DType dtype) {
  const RankPlan plan = rank_plan(n, e, k, ranks, rank);
  const std::string size =
      fmt::format("{} T={} E={} K={} H={} rank {} of {} (R={})", dtype_name(dtype), n, e, k, h, rank, ranks, plan.rows);
  auto random_input = [&](std::initializer_list<int64_t> dims, uint64_t seed) {
    return dtype == DType::bf16 ? random_bf16(dims, seed) : random_host(dims, seed);
  };
  OnDevice rows_d(plan.copy_row, DType::i32);
  Buffer x = random_input({n, h}, 91), x_perm = host_f32({plan.rows, h});
  OnDevice x_d(x, dtype);
  Buffer x_perm_d = poisoned(dtype, {plan.rows, h});
  dispatch_forward(x_perm, x, plan.copy_row);
  dispatch_forward(x_perm_d, x_d, rows_d);
  report.compare("dispatch_forward " + size, x_perm_d, x_perm, kExact);

  Buffer dx_perm = random_input({plan.rows, h}, 92), dx = host_f32({n, h});
  OnDevice dx_perm_d(dx_perm, dtype);
  Buffer dx_d = poisoned(dtype, {n, h});
  dispatch_backward(dx, dx_perm, plan.copy_row);
  dispatch_backward(dx_d, dx_perm_d, rows_d);
  report.compare("dispatch_backward " + size, dx_d, dx, dtype == DType::bf16 ? kBf16 : kF32);
}

// Combine on a rank's plan: the rank's partial sum without a residual, in place on a residual, and
// the backward.
void check_combine_rank(CheckReport& report, int64_t n, int64_t e, int64_t k, int64_t h, int64_t ranks, int64_t rank) {
  const RankPlan plan = rank_plan(n, e, k, ranks, rank);
  const std::string size = fmt::format("T={} E={} K={} H={} rank {} of {} (R={})", n, e, k, h, rank, ranks, plan.rows);
  OnDevice rows_d(plan.copy_row, DType::i32);
  Buffer y_perm = random_bf16({plan.rows, h}, 93), topk_weight = random_host({n, k}, 94), out = host_f32({n, h});
  OnDevice y_perm_d(y_perm, DType::bf16), weight_d(topk_weight, DType::f32);
  Buffer out_d = poisoned(DType::bf16, {n, h});
  combine_forward(out, Tensor{}, y_perm, topk_weight, plan.copy_row);
  combine_forward(out_d, Tensor{}, y_perm_d, weight_d, rows_d);
  report.compare("combine_forward without residual " + size, out_d, out, kBf16);

  Buffer residual = random_bf16({n, h}, 95);
  OnDevice residual_d(residual, DType::bf16);
  combine_forward(out, residual, y_perm, topk_weight, plan.copy_row);
  combine_forward(residual_d, residual_d, y_perm_d, weight_d, rows_d);
  report.compare("combine_forward in place " + size, residual_d, out, kBf16);

  Buffer dout = random_bf16({n, h}, 96), dy_perm = host_f32({plan.rows, h}), dweight = host_f32({n, k});
  OnDevice dout_d(dout, DType::bf16);
  Buffer dy_perm_d = poisoned(DType::bf16, {plan.rows, h}), dweight_d = poisoned(DType::f32, {n, k});
  combine_backward(dy_perm, dweight, dout, y_perm, topk_weight, plan.copy_row);
  combine_backward(dy_perm_d, dweight_d, dout_d, y_perm_d, weight_d, rows_d);
  report.compare("combine_backward dy_perm " + size, dy_perm_d, dy_perm, kBf16);
  report.compare("combine_backward dtopk_weight " + size, dweight_d, dweight, kF32);
}

// The experts' backward with the routing weights (one expert-parallel rank), on a rank's plan for
// its -1 entries.
void check_swiglu_weighted_rank(CheckReport& report, int64_t n, int64_t e, int64_t k, int64_t inter, int64_t ranks, int64_t rank) {
  const RankPlan plan = rank_plan(n, e, k, ranks, rank);
  const std::string size = fmt::format("T={} E={} K={} I={} rank {} of {} (R={})", n, e, k, inter, rank, ranks, plan.rows);
  OnDevice rows_d(plan.copy_row, DType::i32);
  Buffer gate_up = random_bf16({plan.rows, 2 * inter}, 97, 2.0), dact = random_bf16({plan.rows, inter}, 98);
  Buffer topk_weight = random_host({n, k}, 99);
  Buffer dgate_up = host_f32({plan.rows, 2 * inter}), act = host_f32({plan.rows, inter}), dweight = host_f32({n, k});
  OnDevice gate_up_d(gate_up, DType::bf16), dact_d(dact, DType::bf16), weight_d(topk_weight, DType::f32);
  Buffer dgate_up_d = poisoned(DType::bf16, {plan.rows, 2 * inter}), act_d = poisoned(DType::bf16, {plan.rows, inter});
  Buffer dweight_d = poisoned(DType::f32, {n, k});
  swiglu_weighted_backward(dgate_up, act, dweight, dact, gate_up, topk_weight, plan.copy_row);
  swiglu_weighted_backward(dgate_up_d, act_d, dweight_d, dact_d, gate_up_d, weight_d, rows_d);
  // The GPU's dot reads act rounded to bf16, as the separate ops did: a bf16 bound.
  report.compare("swiglu_weighted_backward dtopk_weight " + size, dweight_d, dweight, kBf16);
  report.compare("swiglu_weighted_backward act " + size, act_d, act, kBf16);
  report.compare("swiglu_weighted_backward dgate_up " + size, dgate_up_d, dgate_up, kBf16);
}

// The clamped SwiGLU's experts' backward with the routing weights, as check_swiglu_weighted_rank,
// plus each row's routing weight (a copy: exact; every row of a rank's plan is named once).
void check_clamped_swiglu_weighted_rank(CheckReport& report, int64_t n, int64_t e, int64_t k, int64_t inter, int64_t ranks,
                                        int64_t rank) {
  const RankPlan plan = rank_plan(n, e, k, ranks, rank);
  OnDevice rows_d(plan.copy_row, DType::i32);
  for (double limit : {7.0, 1.5}) {
    const std::string size =
        fmt::format("T={} E={} K={} I={} limit {} rank {} of {} (R={})", n, e, k, inter, limit, rank, ranks, plan.rows);
    Buffer gate_up = random_bf16({plan.rows, 2 * inter}, 132, limit), dact = random_bf16({plan.rows, inter}, 133);
    plant_clamp_bounds(gate_up, limit);
    Buffer topk_weight = random_host({n, k}, 134);
    Buffer dgate_up = host_f32({plan.rows, 2 * inter}), act = host_f32({plan.rows, inter}), row_weight = host_f32({plan.rows}),
           dweight = host_f32({n, k});
    OnDevice gate_up_d(gate_up, DType::bf16), dact_d(dact, DType::bf16), weight_d(topk_weight, DType::f32);
    Buffer dgate_up_d = poisoned(DType::bf16, {plan.rows, 2 * inter}), act_d = poisoned(DType::bf16, {plan.rows, inter});
    Buffer row_weight_d = poisoned(DType::f32, {plan.rows}), dweight_d = poisoned(DType::f32, {n, k});
    clamped_swiglu_weighted_backward(dgate_up, act, row_weight, dweight, dact, gate_up, topk_weight, plan.copy_row, kClampedAlpha, limit);
    clamped_swiglu_weighted_backward(dgate_up_d, act_d, row_weight_d, dweight_d, dact_d, gate_up_d, weight_d, rows_d, kClampedAlpha, limit);
    // The GPU's dot reads act rounded to bf16, as the separate ops did: a bf16 bound.
    report.compare("clamped_swiglu_weighted_backward dtopk_weight " + size, dweight_d, dweight, kBf16);
    report.compare("clamped_swiglu_weighted_backward act " + size, act_d, act, kBf16);
    report.compare("clamped_swiglu_weighted_backward dgate_up " + size, dgate_up_d, dgate_up, kBf16);
    report.compare("clamped_swiglu_weighted_backward row_weight " + size, row_weight_d, row_weight, kExact);
  }
}

// Every 7th target is the ignore index; the backward writes dlogits over the logits, as the model does.
void check_cross_entropy(CheckReport& report, int64_t n, int64_t vocab) {
  const std::string size = fmt::format("T={} V={}", n, vocab);
  Buffer logits = random_bf16({n, vocab}, 60, 2.0), targets = random_ids({n}, vocab, 61);
  int64_t counted = n;
  for (int64_t t = 3; t < n; t += 7, --counted) targets.ptr<int32_t>()[t] = kIgnoreIndex;
  Buffer loss = host_f32({n}), lse = host_f32({n});
  OnDevice logits_d(logits, DType::bf16), targets_d(targets, DType::i32);
  Buffer loss_d = poisoned(DType::f32, {n}), lse_d = poisoned(DType::f32, {n});
  cross_entropy_forward(loss, lse, logits, targets);
  cross_entropy_forward(loss_d, lse_d, logits_d, targets_d);
  report.compare("cross_entropy_forward token_loss " + size, loss_d, loss, kF32);
  report.compare("cross_entropy_forward lse " + size, lse_d, lse, kF32);

  OnDevice lse_same(lse, DType::f32);
  const double scale = 1.0 / double(counted);
  cross_entropy_backward(logits, logits, lse, targets, scale);  // in place on the CPU too: halves host memory
  cross_entropy_backward(logits_d, logits_d, lse_same, targets_d, scale);
  report.compare("cross_entropy_backward in place " + size, logits_d, logits, kBf16);
}

// offset = 1 shifts the tensors by one element, off 16-byte alignment (the kernels' scalar path).
// The gradient is scaled (clipping folded into the step) and the bf16 copy of the updated weights
// is written in the same pass; the GPU follows the CPU's order of operations, so all is exact.
void check_adamw(CheckReport& report, int64_t n, int64_t offset) {
  const std::string size = fmt::format("n={}{}", n, offset ? " unaligned" : "");
  AdamWHyper hyper{1e-3, 0.9, 0.95, 1e-8, 0.1, 3};
  hyper.grad_scale = 0.37;
  Buffer param = random_host({n + offset}, 70), grad = random_host({n + offset}, 71), m = random_host({n + offset}, 72, 0.1),
         v = random_host({n + offset}, 73, 0.01);
  for (int64_t i = 0; i < n + offset; ++i) v.ptr<float>()[i] = std::abs(v.ptr<float>()[i]);
  OnDevice param_d(param, DType::f32), grad_d(grad, DType::f32), m_d(m, DType::f32), v_d(v, DType::f32);
  Buffer copy(DType::bf16, Device::cpu, {n + offset}), copy_d = poisoned(DType::bf16, {n + offset});
  auto tail = [&](Tensor t) { return t.rows(offset, n + offset); };
  adamw_step(tail(param), tail(copy), tail(m), tail(v), tail(grad), hyper);
  adamw_step(tail(param_d), tail(copy_d), tail(m_d), tail(v_d), tail(grad_d), hyper);
  report.compare("adamw_step param " + size, param_d, param, kSameOrder);
  report.compare("adamw_step exp_avg " + size, m_d, m, kSameOrder);
  report.compare("adamw_step exp_avg_sq " + size, v_d, v, kSameOrder);
  report.expect_equal("adamw_step param_bf16 " + size, tail(copy_d), tail(copy));
}

// adamw_step_known_zero over `rows` rows, every third flagged (its gradient, random, must not be
// read), against the CPU's, whose flagged rows take a zero gradient (exact in practice, as
// check_adamw).
void check_adamw_known_zero(CheckReport& report, int64_t rows, int64_t per_row) {
  const int64_t n = rows * per_row;
  const std::string size = fmt::format("{} rows of {}", rows, per_row);
  AdamWHyper hyper{1e-3, 0.9, 0.95, 1e-8, 0.1, 3};
  hyper.grad_scale = 0.37;
  Buffer param = random_host({n}, 75), grad = random_host({n}, 76), m = random_host({n}, 77, 0.1), v = random_host({n}, 78, 0.01);
  Buffer known(DType::i32, Device::cpu, {rows});
  for (int64_t i = 0; i < n; ++i) v.ptr<float>()[i] = std::abs(v.ptr<float>()[i]);
  for (int64_t r = 0; r < rows; ++r) known.ptr<int32_t>()[r] = r % 3 == 1;
  OnDevice param_d(param, DType::f32), grad_d(grad, DType::f32), m_d(m, DType::f32), v_d(v, DType::f32);
  const Buffer known_d = to_device(known, DType::i32);
  Buffer copy(DType::bf16, Device::cpu, {n}), copy_d = poisoned(DType::bf16, {n});
  adamw_step_known_zero(param, copy, m, v, grad, known, hyper);
  adamw_step_known_zero(param_d, copy_d, m_d, v_d, grad_d, known_d, hyper);
  report.compare("adamw_step_known_zero param " + size, param_d, param, kSameOrder);
  report.compare("adamw_step_known_zero exp_avg " + size, m_d, m, kSameOrder);
  report.compare("adamw_step_known_zero exp_avg_sq " + size, v_d, v, kSameOrder);
  report.expect_equal("adamw_step_known_zero param_bf16 " + size, copy_d, copy);
}

// A host bf16 copy of a host f32 tensor (rounded to nearest).
Buffer host_bf16(Tensor host_f32) {
  Buffer out(DType::bf16, Device::cpu, {host_f32.numel()});
  for (int64_t i = 0; i < host_f32.numel(); ++i) static_cast<uint16_t*>(out.view().data)[i] = float_to_bf16(host_f32.ptr<float>()[i]);
  return out;
}

// optimizer.moments = "bf16": the moments stored in bf16, over n elements shifted by `offset` (1:
// off alignment, the scalar path) or, with rows > 0, adamw_step_known_zero over rows of n / rows
// (every third flagged). Bit for bit against the CPU, moments and weights.
void check_adamw_bf16_moments(CheckReport& report, int64_t n, int64_t offset, int64_t rows) {
  const std::string size = rows > 0 ? fmt::format("{} rows of {}", rows, n / rows) : fmt::format("n={}{}", n, offset ? " unaligned" : "");
  AdamWHyper hyper{1e-3, 0.9, 0.95, 1e-8, 0.1, 3};
  hyper.grad_scale = 0.37;
  Buffer param = random_host({n + offset}, 90), grad = random_host({n + offset}, 91), m32 = random_host({n + offset}, 92, 0.1),
         v32 = random_host({n + offset}, 93, 0.01);
  for (int64_t i = 0; i < n + offset; ++i) v32.ptr<float>()[i] = std::abs(v32.ptr<float>()[i]);
  Buffer m = host_bf16(m32), v = host_bf16(v32), known(DType::i32, Device::cpu, {std::max<int64_t>(rows, 1)});
  for (int64_t r = 0; r < rows; ++r) known.ptr<int32_t>()[r] = r % 3 == 1;
  OnDevice param_d(param, DType::f32), grad_d(grad, DType::f32);
  const Buffer m_d = to_device(m32, DType::bf16), v_d = to_device(v32, DType::bf16), known_d = to_device(known, DType::i32);
  Buffer copy(DType::bf16, Device::cpu, {n + offset}), copy_d = poisoned(DType::bf16, {n + offset});
  auto tail = [&](Tensor t) { return t.rows(offset, n + offset); };
  if (rows > 0) {
    adamw_step_known_zero(tail(param), tail(copy), tail(m), tail(v), tail(grad), known, hyper);
    adamw_step_known_zero(tail(param_d), tail(copy_d), tail(m_d), tail(v_d), tail(grad_d), known_d, hyper);
  } else {
    adamw_step(tail(param), tail(copy), tail(m), tail(v), tail(grad), hyper);
    adamw_step(tail(param_d), tail(copy_d), tail(m_d), tail(v_d), tail(grad_d), hyper);
  }
  const std::string op = rows > 0 ? "adamw_step_known_zero bf16 moments " : "adamw_step bf16 moments ";
  report.compare(op + "param " + size, param_d, param, kSameOrder);
  report.expect_equal(op + "exp_avg " + size, tail(m_d), tail(m));
  report.expect_equal(op + "exp_avg_sq " + size, tail(v_d), tail(v));
  report.expect_equal(op + "param_bf16 " + size, tail(copy_d), tail(copy));
}

// Split master weights (core/split_f32.h): split_f32 and join_f32 on the GPU against the CPU, bit
// for bit, over random values and the midpoints between bf16 values (both parities of the lower
// neighbour, both signs), zeros, subnormals and large values; and the GPU's join of its own split
// gives every value back except the midpoints above an odd bf16, one unit higher.
void check_split_f32(CheckReport& report, int64_t n) {
  Buffer value = random_host({n}, 95);
  auto* bits = static_cast<uint32_t*>(value.view().data);
  const uint32_t planted[] = {0x3f808000u, 0x3f818000u, 0xbf808000u, 0xbf818000u, 0x00000000u, 0x80000000u,
                              0x00018000u, 0x7f7effffu, 0x3f80ffffu, 0x3f7fffffu, 0x40000001u, 0xc0008001u};
  for (size_t i = 0; i < std::size(planted); ++i) bits[i * 7] = planted[i];
  Buffer high(DType::bf16, Device::cpu, {n}), low(DType::u16, Device::cpu, {n}), joined(DType::f32, Device::cpu, {n});
  split_f32(high, low, value);
  join_f32(joined, high, low);
  Buffer value_d(DType::f32, Device::cuda, {n}), high_d = poisoned(DType::bf16, {n}), low_d = poisoned(DType::u16, {n}),
         joined_d = poisoned(DType::f32, {n});
  copy(value_d, value);
  split_f32(high_d, low_d, value_d);
  join_f32(joined_d, high_d, low_d);
  const std::string size = fmt::format("n={}", n);
  report.expect_equal("split_f32 high " + size, high_d, high);
  report.expect_equal("split_f32 low " + size, low_d, low);
  report.expect_equal("join_f32 " + size, joined_d, joined);
  Buffer storable(DType::f32, Device::cpu, {n});
  for (int64_t i = 0; i < n; ++i) static_cast<uint32_t*>(storable.view().data)[i] = split_storable(bits[i]);
  report.expect_equal("join_f32 of split_f32: the values as stored " + size, joined_d, storable);
}

// adamw_step (rows > 0: adamw_step_known_zero, every third row flagged) on split master weights,
// fp32 or bf16 moments, against the CPU, bit for bit: both halves of the weights and the moments.
void check_adamw_split(CheckReport& report, int64_t n, int64_t offset, int64_t rows, DType moments) {
  const std::string size = (rows > 0 ? fmt::format("{} rows of {}", rows, n / rows) : fmt::format("n={}{}", n, offset ? " unaligned" : "")) +
                           (moments == DType::bf16 ? ", bf16 moments" : "");
  AdamWHyper hyper{1e-3, 0.9, 0.95, 1e-8, 0.1, 3};
  hyper.grad_scale = 0.37;
  const int64_t all = n + offset;
  Buffer value = random_host({all}, 96), grad = random_host({all}, 97), m32 = random_host({all}, 98, 0.1), v32 = random_host({all}, 99, 0.01);
  for (int64_t i = 0; i < all; ++i) v32.ptr<float>()[i] = std::abs(v32.ptr<float>()[i]);
  Buffer high(DType::bf16, Device::cpu, {all}), low(DType::u16, Device::cpu, {all}), known(DType::i32, Device::cpu, {std::max<int64_t>(rows, 1)});
  split_f32(high, low, value);
  for (int64_t r = 0; r < rows; ++r) known.ptr<int32_t>()[r] = r % 3 == 1;
  Buffer m = moments == DType::bf16 ? host_bf16(m32) : std::move(m32), v = moments == DType::bf16 ? host_bf16(v32) : std::move(v32);
  Buffer high_d(DType::bf16, Device::cuda, {all}), low_d(DType::u16, Device::cuda, {all}), m_d(moments, Device::cuda, {all}),
      v_d(moments, Device::cuda, {all});
  for (auto [d, h] : {std::pair{&high_d, &high}, std::pair{&low_d, &low}, std::pair{&m_d, &m}, std::pair{&v_d, &v}}) copy(*d, *h);
  const Buffer grad_d = to_device(grad, DType::f32), known_d = to_device(known, DType::i32);
  auto tail = [&](Tensor t) { return t.rows(offset, all); };
  if (rows > 0) {
    adamw_step_known_zero(tail(low), tail(high), tail(m), tail(v), tail(grad), known, hyper);
    adamw_step_known_zero(tail(low_d), tail(high_d), tail(m_d), tail(v_d), tail(grad_d), known_d, hyper);
  } else {
    adamw_step(tail(low), tail(high), tail(m), tail(v), tail(grad), hyper);
    adamw_step(tail(low_d), tail(high_d), tail(m_d), tail(v_d), tail(grad_d), hyper);
  }
  const std::string op = rows > 0 ? "adamw_step_known_zero split master " : "adamw_step split master ";
  report.expect_equal(op + "high " + size, high_d, high);
  report.expect_equal(op + "low " + size, low_d, low);
  report.expect_equal(op + "exp_avg " + size, m_d, m);
  report.expect_equal(op + "exp_avg_sq " + size, v_d, v);
}

// Rows an embedding step did not see: zero gradient and moments (+0 and -0). AdamW skips the square
// root and the divisions for them (ops/adamw.cu); the results are known exactly: the moments become
// +0 and the weight only decays, float(double(param) * decay). lr and weight_decay make decay
// 0.875, exact in any rounding.
void check_adamw_zero_moments(CheckReport& report, int64_t n) {
  AdamWHyper hyper{0.25, 0.9, 0.95, 1e-8, 0.5, 3};
  Buffer param = random_host({n}, 74), grad(DType::f32, Device::cpu, {n}), m(DType::f32, Device::cpu, {n}),
         v(DType::f32, Device::cpu, {n}), zero(DType::f32, Device::cpu, {n}), want(DType::f32, Device::cpu, {n});
  float* p = param.ptr<float>();
  p[0] = 0.0f;
  p[1] = -0.0f;
  for (int64_t i = 0; i < n; ++i) {
    grad.ptr<float>()[i] = v.ptr<float>()[i] = zero.ptr<float>()[i] = 0.0f;
    m.ptr<float>()[i] = i % 2 ? -0.0f : 0.0f;
    want.ptr<float>()[i] = float(double(p[i]) * 0.875);
  }
  OnDevice param_d(param, DType::f32), grad_d(grad, DType::f32), m_d(m, DType::f32), v_d(v, DType::f32);
  adamw_step(param_d, Tensor{}, m_d, v_d, grad_d, hyper);
  const std::string size = fmt::format("n={}", n);
  report.expect_equal("adamw_step zero moments: param only decays " + size, param_d, want);
  report.expect_equal("adamw_step zero moments: exp_avg +0 " + size, m_d, zero);
  report.expect_equal("adamw_step zero moments: exp_avg_sq +0 " + size, v_d, zero);
}

// sum_squares_parts with known-zero rows (every other row flagged, zeros; NaN planted on the GPU
// side of each, which must not be read) gives the parts of the same call without them, bit for bit.
void check_sum_squares_known_zero(CheckReport& report, int64_t before, int64_t rows, int64_t per_row) {
  const std::string size = fmt::format("{} + {} rows of {} + 3", before, rows, per_row);
  Buffer x = random_host({before + rows * per_row + 3}, 81), flags(DType::i32, Device::cpu, {rows});
  for (int64_t r = 0; r < rows; ++r) {
    flags.ptr<int32_t>()[r] = r % 2;
    if (r % 2) std::fill(x.ptr<float>() + before + r * per_row, x.ptr<float>() + before + (r + 1) * per_row, 0.0f);
  }
  OnDevice x_d(x, DType::f32), flags_d(flags, DType::i32);
  Buffer plain = poisoned(DType::f64, {kSumParts}), known = poisoned(DType::f64, {kSumParts});
  sum_squares_parts(plain, x_d);
  for (int64_t r = 1; r < rows; r += 2) poison(x_d.tensor.rows(before + r * per_row, before + r * per_row + 1));
  sum_squares_parts(known, x_d, KnownZeroRows{flags_d, before, per_row});
  report.expect_equal("sum_squares_parts known zero rows = plain " + size, known, to_host(plain));
}

void check_grad_norm(CheckReport& report, int64_t n, int64_t offset) {
  const std::string size = fmt::format("n={}{}", n, offset ? " unaligned" : "");
  Buffer x = random_host({n + offset}, 80);
  OnDevice x_d(x, DType::f32);
  const double cpu = l2_norm(x.view().rows(offset, n + offset)), gpu = l2_norm(x_d.tensor.rows(offset, n + offset));
  const double error = std::abs(gpu - cpu) / std::max(std::abs(cpu), 1e-30);
  // Both sides sum in double, in different orders: ~1e-13 apart over 16M elements.
  report.add({"l2_norm " + size, error, 1e-10, std::isfinite(gpu) && error <= 1e-10});
}

}  // namespace

void check_elementwise_ops(CheckReport& report) {
  // Odd sizes: rows not multiples of 8 (scalar kernel paths) next to ones that are (16-byte paths).
  check_embedding(report, 37, 101, 72);
  check_embedding(report, 37, 101, 75);
  check_rmsnorm(report, 37, 72);
  check_rmsnorm(report, 37, 75);
  check_rmsnorm_add(report, 37, 72);
  check_rmsnorm_add(report, 37, 75);
  check_rmsnorm_rope(report, 37, 3, 64);    // the fused kernels: 8 lanes a head
  check_rmsnorm_rope(report, 37, 32, 128);  // 16 lanes a head, the bench model's 32 query heads: 4 warps a token; dweight's
                                            // partials from the dx kernel, the last chunk short
  check_rmsnorm_rope(report, 37, 8, 64);    // 8 lanes a head, dweight's partials from the dx kernel
  check_rmsnorm_rope(report, 37, 4, 128);   // 4 heads: 16 warps a block, dweight's partials from the dx kernel
  check_rmsnorm_rope(report, 37, 5, 128);   // a warp's last pass holding one head of two
  check_rmsnorm_rope(report, 37, 3, 256);   // 32 lanes a head
  check_rmsnorm_rope(report, 37, 3, 512);   // past the fused kernels: the unfused pair
  check_rmsnorm_rope(report, 37, 3, 72);  // rows in packs of 8, halves (36) one element at a time
  check_rmsnorm_rope(report, 37, 3, 18);  // one element at a time throughout
  check_rope(report, 37, 3, 72, false, false);
  check_rope(report, 37, 3, 16, false, true);
  check_rope_yarn(report, 37, 3, 64, false, 0);  // packs of 8, cos and sin scaled
  check_rope_yarn(report, 37, 3, 18, true, 0);   // one pair at a time
  check_rope_yarn(report, 37, 3, 64, false, 1);  // YaRN's frequencies, unscaled
  check_bias(report, 37, 72);  // packs of 8
  check_bias(report, 37, 75);
  check_bias(report, 1000, 75);  // rows in 15 chunks, the last one shorter
  check_bias(report, 300, 32);   // the router's width: 4 chunks
  // Empty experts first, in the middle and last; one of a single row.
  for (int64_t o : {72, 75}) check_grouped_bias(report, {0, 5, 1, 0, 13, 18, 0}, o, false);
  check_grouped_bias(report, {0, 5, 1, 0, 13, 18, 0}, 75, true);
  check_add(report, 37, 75, DType::bf16);
  check_add(report, 37, 75, DType::f32);
  check_add_into(report, 37, 75, DType::bf16);
  check_add_into(report, 37, 75, DType::f32);
  check_swiglu(report, 37, 72);
  check_swiglu(report, 37, 75);
  check_clamped_swiglu(report, 37, 72);
  check_clamped_swiglu(report, 37, 75);
  check_moe(report, 37, 8, 2, 72, true, -1);
  check_moe(report, 37, 8, 2, 75, false, -1);
  check_moe(report, 37, 8, 8, 72, true, -1);  // K = E
  check_moe(report, 37, 128, 8, 75, true, 5);
  check_moe(report, 3001, 300, 6, 72, true, 7);
  check_routing_outside(report, 37, 8, 2);
  check_routing_outside(report, 37, 128, 8);
  check_routing_outside(report, 3001, 300, 6);  // the GPU plan's warps each take a run of copies
  check_expert_sends(report, 37, 8, 2, 4);
  check_expert_sends(report, 4096, 128, 8, 2);  // the bench routing with EP = 2 and 8
  check_expert_sends(report, 4096, 128, 8, 8);
  check_expert_sends(report, 1000, 64, 8, 64);  // the most members a token mask holds
  check_dispatch_rank(report, 37, 8, 2, 72, 4, 1, DType::bf16);
  check_dispatch_rank(report, 37, 8, 2, 75, 4, 1, DType::bf16);
  check_dispatch_rank(report, 37, 8, 8, 8, 2, 0, DType::f32);  // routing weights: H = K
  check_dispatch_rank(report, 37, 8, 2, 2, 4, 3, DType::f32);
  check_combine_rank(report, 37, 8, 2, 72, 4, 1);
  check_combine_rank(report, 37, 8, 2, 75, 4, 1);
  check_swiglu_weighted_rank(report, 37, 8, 2, 72, 4, 1);
  check_swiglu_weighted_rank(report, 37, 8, 2, 75, 4, 1);
  check_swiglu_weighted_rank(report, 4096, 128, 8, 768, 1, 0);
  check_clamped_swiglu_weighted_rank(report, 37, 8, 2, 72, 4, 1);
  check_clamped_swiglu_weighted_rank(report, 37, 8, 2, 75, 4, 1);
  // GPT-OSS-20b's experts (32, top-4, I = 2880) on 1,024 tokens: drawing the inputs on the CPU takes ~1 s per limit.
  check_clamped_swiglu_weighted_rank(report, 1024, 32, 4, 2880, 1, 0);
  check_cross_entropy(report, 37, 1001);
  check_cross_entropy(report, 300, 151936);  // Qwen3's vocabulary: packs of 8
  check_adamw(report, 37 * 75, 0);
  check_adamw(report, 37 * 75, 1);
  check_adamw_known_zero(report, 7, 36);
  check_adamw_known_zero(report, 5, 37);
  check_adamw_known_zero(report, 70001, 8);  // more rows than a grid's y (65,535): an embedding's
  check_sum_squares_known_zero(report, 4, 37, 72);
  check_sum_squares_known_zero(report, 5, 37, 75);
  check_adamw_zero_moments(report, 37 * 75);
  check_adamw_bf16_moments(report, 37 * 75, 0, 0);
  check_adamw_bf16_moments(report, 37 * 75, 1, 0);
  check_adamw_bf16_moments(report, 7 * 36, 0, 7);
  check_adamw_bf16_moments(report, 5 * 37, 0, 5);
  check_split_f32(report, 37 * 75);
  for (DType moments : {DType::f32, DType::bf16}) {
    check_adamw_split(report, 37 * 75, 0, 0, moments);
    check_adamw_split(report, 37 * 75, 1, 0, moments);
    check_adamw_split(report, 7 * 36, 0, 7, moments);
    check_adamw_split(report, 5 * 37, 0, 5, moments);
  }
  check_grad_norm(report, 37 * 75, 0);
  check_grad_norm(report, 37 * 75, 1);

  // Bench sizes (Qwen3-30B-A3B-like: T = 4096, H = 2048, E = 128, K = 8, head_dim 128, I = 768).
  check_embedding(report, 4096, 4099, 2048);  // V small enough for the CPU, so ids repeat a lot
  check_rmsnorm(report, 4096, 2048);
  check_rmsnorm(report, 4096 * 4, 128);  // QK-norm: rows are (token, head)
  check_rmsnorm_add(report, 4096, 2048);
  check_rmsnorm_rope(report, 4096, 32, 128);  // queries
  check_rmsnorm_rope(report, 4096, 4, 128);   // keys
  check_rope(report, 4096, 32, 128, true, true);
  // GPT-OSS-20b: 64 query heads of 64, hidden 2880, 32 experts, top-4.
  check_rope_yarn(report, 4096, 64, 64, true, 0);
  check_bias(report, 4096, 64 * 64);
  check_grouped_bias(report, skewed_counts(32, 4096 * 4), 2880, true);
  check_add(report, 4096, 2048, DType::bf16);
  check_add(report, 4096, 2048, DType::f32);
  check_swiglu(report, 4096 * 8, 768);
  check_clamped_swiglu(report, 4096, 2880);  // GPT-OSS-20b's I
  check_moe(report, 4096, 128, 8, 2048, true, 5);
  check_dispatch_rank(report, 4096, 128, 8, 2048, 8, 3, DType::bf16);
  check_dispatch_rank(report, 4096, 128, 8, 8, 8, 3, DType::f32);
  check_combine_rank(report, 4096, 128, 8, 2048, 8, 3);
  // Full vocabulary; 1024 rows rather than 4096: each row is one block, and drawing the random
  // logits on the CPU (~30 ns each) would dominate the whole check.
  check_cross_entropy(report, 1024, 151936);
  check_adamw(report, (1 << 20) + 3, 0);
  check_adamw_split(report, (1 << 20) + 3, 0, 0, DType::f32);
  check_grad_norm(report, (1 << 24) + 3, 0);
}

}  // namespace marrow
