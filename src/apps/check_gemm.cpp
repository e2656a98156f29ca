// marrow check, group "gemm": linear (cuBLASLt) and grouped_linear (own wgmma GEMM forward and
// backward_input, own wgmma kernel for the fp32 weight gradient) against the CPU reference.
// Small odd shapes are compared in full; the bench shapes (Qwen3-30B-A3B's layer) are drawn on the
// GPU and compared on slices whose reference the CPU computes in well under a second: the last rows
// of outputs, a band of weight-gradient rows, a few experts. Outputs are poisoned first and the
// whole of each bench output must be finite. Weight gradients start at zero, are compared after one
// call, then after a second call with twice the reference (they accumulate). Timings of the same
// shapes are in `marrow bench --kernels`. A second overwriting call must give the same bits.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "apps/check.h"
#include "core/cuda_check.h"
#include "ops/cast.h"
#include "ops/grouped_linear.h"
#include "ops/init.h"
#include "ops/linear.h"

namespace marrow {

namespace {

constexpr double kBf16Bound = 1e-2;  // bf16 outputs: one rounding of ~2^-9 relative
constexpr double kF32Bound = 1e-3;   // fp32 outputs and accumulated gradients

Buffer host_bf16_values(std::initializer_list<int64_t> dims, uint64_t seed) {
  Buffer b = random_host(dims, seed);
  round_to_bf16(b);
  return b;
}

// A host f32 copy of a device tensor, shaped dims.
Buffer host_f32(Tensor device, std::initializer_list<int64_t> dims) {
  Buffer flat = to_host_f32(device);
  Buffer b(DType::f32, Device::cpu, dims);
  copy(b, flat);
  return b;
}

Tensor shaped(const Buffer& b, std::initializer_list<int64_t> dims) { return b.view().reshape(dims); }

Buffer scaled(Tensor host, float factor) {
  Buffer out(DType::f32, Device::cpu, {host.numel()});
  for (int64_t i = 0; i < host.numel(); ++i) out.ptr<float>()[i] = factor * host.ptr<float>()[i];
  return out;
}

// Columns [c0, c1) of a host [rows, cols] f32 matrix.
Buffer columns(Tensor host, int64_t c0, int64_t c1) {
  const int64_t rows = host.size(0), cols = host.size(1);
  Buffer out(DType::f32, Device::cpu, {rows, c1 - c0});
  for (int64_t r = 0; r < rows; ++r)
    std::copy(host.ptr<float>() + r * cols + c0, host.ptr<float>() + r * cols + c1, out.ptr<float>() + r * (c1 - c0));
  return out;
}

// A row of the report whose error is the number of non-finite elements (poison left unwritten).
void expect_finite(CheckReport& report, const std::string& name, Tensor device) {
  Buffer h = to_host_f32(device);
  int64_t bad = 0;
  for (int64_t i = 0; i < h.numel(); ++i) bad += !std::isfinite(h.ptr<float>()[i]);
  report.add({name, double(bad), 0.0, bad == 0});
}

// ---- linear ----------------------------------------------------------------------------------

void check_linear_small(CheckReport& report, int64_t n, int64_t in, int64_t out, uint64_t seed) {
  const std::string shape = fmt::format("{}x{}->{}", n, in, out);
  Buffer x = host_bf16_values({n, in}, seed), w = host_bf16_values({out, in}, seed + 1), dy = host_bf16_values({n, out}, seed + 2);
  Buffer y_ref(DType::f32, Device::cpu, {n, out}), dx_ref(DType::f32, Device::cpu, {n, in});
  Buffer dw_ref = Buffer::zeros(DType::f32, Device::cpu, {out, in});
  linear_forward(y_ref, x, w);
  linear_backward_input(dx_ref, dy, w);
  linear_backward_weight(dw_ref, dy, x);

  Buffer xd = to_device(x, DType::bf16), wd = to_device(w, DType::bf16), dyd = to_device(dy, DType::bf16);
  const Tensor xt = shaped(xd, {n, in}), wt = shaped(wd, {out, in}), dyt = shaped(dyd, {n, out});
  Buffer y = poisoned(DType::bf16, {n, out});
  linear_forward(y, xt, wt);
  report.compare("linear fwd bf16 " + shape, y, y_ref, kBf16Bound);
  Buffer y32 = poisoned(DType::f32, {n, out});
  linear_forward(y32, xt, wt);
  report.compare("linear fwd f32 out " + shape, y32, y_ref, kF32Bound);
  Buffer dx = poisoned(DType::bf16, {n, in});
  linear_backward_input(dx, dyt, wt);
  report.compare("linear bwd_input " + shape, dx, dx_ref, kBf16Bound);
  linear_backward_input(dx, dyt, wt, true);  // beta = 1: added to the first call's bf16 result
  report.compare("linear bwd_input x2 (accumulates) " + shape, dx, scaled(dx_ref, 2), kBf16Bound);
  Buffer dw = Buffer::zeros(DType::f32, Device::cuda, {out, in});
  linear_backward_weight(dw, dyt, xt);
  report.compare("linear bwd_weight " + shape, dw, dw_ref, kF32Bound);
  linear_backward_weight(dw, dyt, xt);
  report.compare("linear bwd_weight x2 (accumulates) " + shape, dw, scaled(dw_ref, 2), kF32Bound);
  // Overwriting over NaN: the bits of accumulating into zeros (the same algorithm, beta 0).
  Buffer written = poisoned(DType::f32, {out, in}), accumulated = Buffer::zeros(DType::f32, Device::cuda, {out, in});
  linear_backward_weight(written, dyt, xt, true);
  linear_backward_weight(accumulated, dyt, xt);
  report.expect_equal("linear bwd_weight overwrite = into zeros " + shape, written, to_host(accumulated));
}

// Bench shape: outputs compared on their last `rows` rows, dW on rows [o0, o0 + 64).
void check_linear_bench(CheckReport& report, const char* label, int64_t n, int64_t in, int64_t out, DType y_dtype, uint64_t seed) {
  const std::string shape = fmt::format("{} {}x{}->{}", label, n, in, out);
  const int64_t rows = std::min<int64_t>(n, 48), r0 = n - rows;
  const int64_t o0 = std::min<int64_t>(96, out - std::min<int64_t>(out, 64)), o1 = std::min(out, o0 + 64);
  Buffer x = random_device({n, in}, seed, "x"), w = random_device({out, in}, seed, "w"),
         dy = random_device({n, out}, seed, "dy");
  Buffer y = poisoned(y_dtype, {n, out}), dx = poisoned(DType::bf16, {n, in});
  Buffer dw = Buffer::zeros(DType::f32, Device::cuda, {out, in});
  linear_forward(y, x, w);
  linear_backward_input(dx, dy, w);
  linear_backward_weight(dw, dy, x);

  Buffer xh = host_f32(x, {n, in}), wh = host_f32(w, {out, in}), dyh = host_f32(dy, {n, out});
  Buffer y_ref(DType::f32, Device::cpu, {rows, out}), dx_ref(DType::f32, Device::cpu, {rows, in});
  linear_forward(y_ref, xh.view().rows(r0, n), wh);
  linear_backward_input(dx_ref, dyh.view().rows(r0, n), wh);
  Buffer dw_ref = Buffer::zeros(DType::f32, Device::cpu, {o1 - o0, in});
  linear_backward_weight(dw_ref, columns(dyh, o0, o1), xh);

  expect_finite(report, "linear fwd all written " + shape, y);
  report.compare(fmt::format("linear fwd {} {} rows {}-{}", dtype_name(y_dtype), shape, r0, n), y.view().rows(r0, n), y_ref,
                 y_dtype == DType::f32 ? kF32Bound : kBf16Bound);
  expect_finite(report, "linear bwd_input all written " + shape, dx);
  report.compare(fmt::format("linear bwd_input {} rows {}-{}", shape, r0, n), dx.view().rows(r0, n), dx_ref, kBf16Bound);
  report.compare(fmt::format("linear bwd_weight {} dW rows {}-{}", shape, o0, o1), dw.view().rows(o0, o1), dw_ref, kF32Bound);
  linear_backward_weight(dw, dy, x);
  report.compare(fmt::format("linear bwd_weight x2 {} dW rows {}-{}", shape, o0, o1), dw.view().rows(o0, o1), scaled(dw_ref, 2),
                 kF32Bound);
}

// ---- grouped_linear ----------------------------------------------------------------------------

// The grouped ops again with the offsets in GPU memory (the tile schedules and dW work lists built on
// the device, no wait for the GPU): every output bit for bit the host offsets' outputs, given as
// y, dx, dw after two accumulating calls from zero, and dw overwritten.
void check_device_offsets(CheckReport& report, const std::string& shape, Tensor x, Tensor w, Tensor dy, Tensor offsets, Tensor y,
                          Tensor dx, Tensor dw_twice, Tensor dw_written) {
  const Buffer offsets_d = to_device(offsets, DType::i32);
  const int64_t r = x.size(0), in = x.size(1), e = w.size(0), out = w.size(1);
  Buffer y2 = poisoned(DType::bf16, {r, out}), dx2 = poisoned(DType::bf16, {r, in});
  grouped_linear_forward(y2, x, w, offsets_d);
  grouped_linear_backward_input(dx2, dy, w, offsets_d);
  Buffer dw2 = Buffer::zeros(DType::f32, Device::cuda, {e, out, in}), written2 = poisoned(DType::f32, {e, out, in});
  grouped_linear_backward_weight(dw2, dy, x, offsets_d);
  grouped_linear_backward_weight(dw2, dy, x, offsets_d);
  grouped_linear_backward_weight(written2, dy, x, offsets_d, true);
  report.expect_equal("grouped fwd, offsets on the GPU = on the host " + shape, y2, to_host(y));
  report.expect_equal("grouped bwd_input, offsets on the GPU = on the host " + shape, dx2, to_host(dx));
  report.expect_equal("grouped bwd_weight x2, offsets on the GPU = on the host " + shape, dw2, to_host(dw_twice));
  report.expect_equal("grouped bwd_weight overwrite, offsets on the GPU = on the host " + shape, written2, to_host(dw_written));
}

// The bands' sums of squares (grouped_linear.h) of one expert's dW [O, I] (device f32), in f64 on the host.
std::vector<double> band_squares_ref(Tensor dw_expert, int64_t o, int64_t in) {
  const Buffer h = to_host(dw_expert);
  const int64_t bands_o = (o + kSquaresBandRows - 1) / kSquaresBandRows, bands_i = (in + kSquaresBandCols - 1) / kSquaresBandCols;
  std::vector<double> sums(size_t(bands_o * bands_i), 0.0);
  for (int64_t r = 0; r < o; ++r)
    for (int64_t c = 0; c < in; ++c) sums[size_t(r / kSquaresBandRows * bands_i + c / kSquaresBandCols)] += std::pow(double(h.ptr<float>()[r * in + c]), 2);
  return sums;
}

// grouped_linear_backward_weight with squares over a step's two kinds of call: one overwriting,
// then one accumulating, the same squares given to both (an expert without rows keeps its bands
// from the first). After each: dW the bits of the same call without squares, the listed experts'
// bands (empty ones too) against sums read back from that dW (the GPU adds groups of 8 squares in
// f32: ~1e-7 relative); a second run gives the same squares' bits.
void check_squares(CheckReport& report, const std::string& shape, Tensor dy, Tensor x, Tensor offsets, int64_t o,
                   const std::vector<int64_t>& experts) {
  const int64_t in = x.size(1), e = offsets.numel() - 1, per_expert = grouped_weight_squares_count(1, o, in);
  const std::string where = shape + (offsets.device == Device::cuda ? ", offsets on the GPU" : "");
  Buffer dw = poisoned(DType::f32, {e, o, in}), plain = poisoned(DType::f32, {e, o, in}), again = poisoned(DType::f32, {e, o, in});
  Buffer squares = poisoned(DType::f64, {e * per_expert}), squares_again = poisoned(DType::f64, {e * per_expert});
  for (const bool overwrite : {true, false}) {
    const std::string mode = fmt::format("{} {}", overwrite ? "overwrite" : "then accumulate", where);
    grouped_linear_backward_weight(dw, dy, x, offsets, overwrite, squares);
    grouped_linear_backward_weight(plain, dy, x, offsets, overwrite);
    grouped_linear_backward_weight(again, dy, x, offsets, overwrite, squares_again);
    report.expect_equal("grouped bwd_weight with squares, dW bits as without, " + mode, dw, to_host(plain));
    const Buffer got = to_host(squares);
    double error = 0;
    bool finite = true;
    for (int64_t g : experts) {
      const std::vector<double> ref = band_squares_ref(dw.view().reshape({e * o * in}).rows(g * o * in, (g + 1) * o * in), o, in);
      for (size_t b = 0; b < ref.size(); ++b) {
        const double v = got.ptr<double>()[size_t(g * per_expert) + b];
        finite = finite && std::isfinite(v);
        error = std::max(error, std::abs(v - ref[b]) / std::max(ref[b], 1e-300));
      }
    }
    report.add({fmt::format("grouped bwd_weight squares of {} experts' bands, {}", experts.size(), mode), finite ? error : INFINITY, 2e-6,
                finite && error <= 2e-6});
    report.expect_equal("grouped bwd_weight squares twice, same bits, " + mode, squares_again, got);
  }
}

// grouped_linear_backward_weight_pair of (dy, x) and a second micro-batch routed by counts2 (its
// own random rows): dW and squares the bits of the two calls it stands for, overwriting from NaN
// and then accumulating, with the offsets on the host and on the GPU.
void check_pair(CheckReport& report, const std::string& shape, Tensor dy, Tensor x, Tensor offsets, const std::vector<int32_t>& counts2,
                uint64_t seed) {
  const int64_t in = x.size(1), o = dy.size(1), e = offsets.numel() - 1, squares_count = grouped_weight_squares_count(e, o, in);
  Buffer offsets2 = offsets_host(counts2);
  const int64_t r2 = offsets2.ptr<int32_t>()[e];
  Buffer x2 = random_device({r2, in}, seed, "x2"), dy2 = random_device({r2, o}, seed, "dy2");
  for (const bool on_gpu : {false, true}) {
    const Buffer first_offsets = on_gpu ? to_device(offsets, DType::i32) : Buffer{}, second_offsets = on_gpu ? to_device(offsets2, DType::i32) : Buffer{};
    const ExpertRows first{dy, x, on_gpu ? first_offsets.view() : offsets}, second{dy2, x2, on_gpu ? second_offsets.view() : offsets2.view()};
    Buffer sequential = poisoned(DType::f32, {e, o, in}), paired = poisoned(DType::f32, {e, o, in});
    Buffer squares_sequential = poisoned(DType::f64, {squares_count}), squares_paired = poisoned(DType::f64, {squares_count});
    for (const bool overwrite : {true, false}) {
      const std::string mode = fmt::format("{} {} with E{} {} rows, {}", overwrite ? "overwrite" : "then accumulate", shape, e, r2,
                                           on_gpu ? "offsets on the GPU" : "offsets on the host");
      grouped_linear_backward_weight(sequential, first.dy, first.x, first.expert_offsets, overwrite, squares_sequential);
      grouped_linear_backward_weight(sequential, second.dy, second.x, second.expert_offsets, false, squares_sequential);
      grouped_linear_backward_weight_pair(paired, first, second, overwrite, squares_paired);
      report.expect_equal("grouped bwd_weight pair = two calls, dW bits, " + mode, paired, to_host(sequential));
      report.expect_equal("grouped bwd_weight pair = two calls, squares bits, " + mode, squares_paired, to_host(squares_sequential));
    }
  }
}

// The known_zero flags (grouped_linear.h) against the same calls without them, for one call and for
// a pair with a second micro-batch routed by counts2, offsets on the host and on the GPU: an
// overwrite from NaN, a second overwrite (the empty experts' zeros are known: skipped, their bands
// set again from NaN), then an accumulating call of the second micro-batch: dW and squares the same
// bits after each, the flags grouped_linear.h's; last, an expert whose flag is set is left alone
// by an overwrite (its slice, planted with NaN, stays NaN).
void check_known_zero(CheckReport& report, const std::string& shape, Tensor dy, Tensor x, Tensor offsets,
                      const std::vector<int32_t>& counts2, uint64_t seed) {
  const int64_t in = x.size(1), o = dy.size(1), e = offsets.numel() - 1, squares_count = grouped_weight_squares_count(e, o, in);
  Buffer offsets2 = offsets_host(counts2);
  const int64_t r2 = offsets2.ptr<int32_t>()[e];
  Buffer x2 = random_device({r2, in}, seed, "x2"), dy2 = random_device({r2, o}, seed, "dy2");
  Buffer expected(DType::i32, Device::cpu, {e});  // flags after each step: no rows in the step's micro-batches
  for (int64_t g = 0; g < e; ++g)
    expected.ptr<int32_t>()[g] = offsets.ptr<int32_t>()[g + 1] == offsets.ptr<int32_t>()[g] && counts2[size_t(g)] == 0 ? 1 : 0;
  for (const bool pair : {false, true})
    for (const bool on_gpu : {false, true}) {
      const Buffer first_d = on_gpu ? to_device(offsets, DType::i32) : Buffer{}, second_d = on_gpu ? to_device(offsets2, DType::i32) : Buffer{};
      const ExpertRows first{dy, x, on_gpu ? first_d.view() : offsets}, second{dy2, x2, on_gpu ? second_d.view() : offsets2.view()};
      Buffer plain = poisoned(DType::f32, {e, o, in}), flagged = poisoned(DType::f32, {e, o, in});
      Buffer squares_plain = poisoned(DType::f64, {squares_count}), squares_flagged = poisoned(DType::f64, {squares_count});
      Buffer known = Buffer::zeros(DType::i32, Device::cuda, {e});
      // A step of one micro-batch then the second (accumulating), or both as a pair.
      auto step = [&](Tensor dw, Tensor squares, Tensor flags, bool overwrite) {
        if (pair) return grouped_linear_backward_weight_pair(dw, first, second, overwrite, squares, flags);
        grouped_linear_backward_weight(dw, first.dy, first.x, first.expert_offsets, overwrite, squares, flags);
        grouped_linear_backward_weight(dw, second.dy, second.x, second.expert_offsets, false, squares, flags);
      };
      const std::string mode = fmt::format("{} {}, E{}, {}", pair ? "pair" : "two calls", shape, e, on_gpu ? "offsets on the GPU" : "on the host");
      for (const char* when : {"first step", "second step (zeros known)", "accumulating step"}) {
        const bool overwrite = when[0] != 'a';
        if (when[0] == 's') poison(squares_flagged);
        step(plain, squares_plain, Tensor{}, overwrite);
        step(flagged, squares_flagged, known, overwrite);
        report.expect_equal(fmt::format("grouped bwd_weight known zero, {}: dW bits, {}", when, mode), flagged, to_host(plain));
        report.expect_equal(fmt::format("grouped bwd_weight known zero, {}: squares bits, {}", when, mode), squares_flagged,
                            to_host(squares_plain));
        report.expect_equal(fmt::format("grouped bwd_weight known zero, {}: flags, {}", when, mode), known, expected);
      }
      int64_t left = -1;  // an expert whose flag is set
      for (int64_t g = 0; g < e && left < 0; ++g)
        if (expected.ptr<int32_t>()[g]) left = g;
      if (left < 0) continue;
      const Tensor slice = flagged.view().reshape({e * o * in}).rows(left * o * in, (left + 1) * o * in);
      poison(slice);
      step(flagged, squares_flagged, known, true);
      const Buffer kept = to_host(slice);
      bool nan = true;
      for (int64_t k = 0; k < kept.numel(); ++k) nan = nan && std::isnan(kept.ptr<float>()[k]);
      report.add({fmt::format("grouped bwd_weight known zero: expert {}'s slice left alone, {}", left, mode), nan ? 0.0 : 1.0, 0.0, nan});
    }
}

// kernel: a name for the rows when the forward/backward-input kernel is not the default one.
void check_grouped_small(CheckReport& report, int64_t out, int64_t in, const std::vector<int32_t>& counts, uint64_t seed,
                         const char* kernel = nullptr) {
  const int64_t e = int64_t(counts.size());
  Buffer offsets = offsets_host(counts);
  const int64_t r = offsets.ptr<int32_t>()[e];
  const std::string shape = fmt::format("E{} {}x{}->{}{}", e, r, in, out, kernel ? fmt::format(" ({})", kernel) : "");
  Buffer x = host_bf16_values({r, in}, seed), w = host_bf16_values({e, out, in}, seed + 1), dy = host_bf16_values({r, out}, seed + 2);
  Buffer y_ref(DType::f32, Device::cpu, {r, out}), dx_ref(DType::f32, Device::cpu, {r, in});
  Buffer dw_ref = Buffer::zeros(DType::f32, Device::cpu, {e, out, in});
  grouped_linear_forward(y_ref, x, w, offsets);
  grouped_linear_backward_input(dx_ref, dy, w, offsets);
  grouped_linear_backward_weight(dw_ref, dy, x, offsets);

  Buffer xd = to_device(x, DType::bf16), wd = to_device(w, DType::bf16), dyd = to_device(dy, DType::bf16);
  const Tensor xt = shaped(xd, {r, in}), wt = shaped(wd, {e, out, in}), dyt = shaped(dyd, {r, out});
  Buffer y = poisoned(DType::bf16, {r, out});
  grouped_linear_forward(y, xt, wt, offsets);
  report.compare("grouped fwd " + shape, y, y_ref, kBf16Bound);
  Buffer dx = poisoned(DType::bf16, {r, in});
  grouped_linear_backward_input(dx, dyt, wt, offsets);
  report.compare("grouped bwd_input " + shape, dx, dx_ref, kBf16Bound);
  Buffer dw = Buffer::zeros(DType::f32, Device::cuda, {e, out, in});
  grouped_linear_backward_weight(dw, dyt, xt, offsets);
  report.compare("grouped bwd_weight " + shape, dw, dw_ref, kF32Bound);
  grouped_linear_backward_weight(dw, dyt, xt, offsets);
  report.compare("grouped bwd_weight x2 (accumulates) " + shape, dw, scaled(dw_ref, 2), kF32Bound);
  // Overwriting ignores what dW held (NaN here) and zeroes experts without rows.
  Buffer dw_written = poisoned(DType::f32, {e, out, in});
  grouped_linear_backward_weight(dw_written, dyt, xt, offsets, true);
  report.compare("grouped bwd_weight overwrite " + shape, dw_written, dw_ref, kF32Bound);
  Buffer dw_again = poisoned(DType::f32, {e, out, in});
  grouped_linear_backward_weight(dw_again, dyt, xt, offsets, true);
  report.expect_equal("grouped bwd_weight overwrite twice, same bits " + shape, dw_again, to_host_f32(dw_written));
  check_device_offsets(report, shape, xt, wt, dyt, offsets, y, dx, dw, dw_written);
  std::vector<int64_t> every(static_cast<size_t>(e));
  for (int64_t g = 0; g < e; ++g) every[size_t(g)] = g;
  check_squares(report, shape, dyt, xt, offsets, out, every);
  check_squares(report, shape, dyt, xt, to_device(offsets, DType::i32), out, every);
  // The second micro-batch's counts reversed: experts empty in one have rows in the other.
  check_pair(report, shape, dyt, xt, offsets, std::vector<int32_t>(counts.rbegin(), counts.rend()), seed + 3);
  check_known_zero(report, shape, dyt, xt, offsets, std::vector<int32_t>(counts.rbegin(), counts.rend()), seed + 4);
}

// Bench shape: E experts, rows routed by skewed_counts. Outputs compared on up to 48 last rows of a
// few experts, dW on a band of 64 rows (crossing a 128-row tile) of the same experts, an expert
// without rows must keep a zero gradient.
void check_grouped_bench(CheckReport& report, const char* label, int64_t e, int64_t r, int64_t in, int64_t out, uint64_t seed) {
  const std::vector<int32_t> counts = skewed_counts(e, r);
  Buffer offsets = offsets_host(counts);
  const int32_t* off = offsets.ptr<int32_t>();
  const std::string shape = fmt::format("{} E{} {}x{}->{}", label, e, r, in, out);
  Buffer x = random_device({r, in}, seed, "x"), w = random_device({e, out, in}, seed, "w"),
         dy = random_device({r, out}, seed, "dy");
  Buffer y = poisoned(DType::bf16, {r, out}), dx = poisoned(DType::bf16, {r, in});
  Buffer dw = Buffer::zeros(DType::f32, Device::cuda, {e, out, in});
  grouped_linear_forward(y, x, w, offsets);
  grouped_linear_backward_input(dx, dy, w, offsets);
  grouped_linear_backward_weight(dw, dy, x, offsets);
  expect_finite(report, "grouped fwd all written " + shape, y);
  expect_finite(report, "grouped bwd_input all written " + shape, dx);

  const int64_t largest = std::max_element(counts.begin(), counts.end()) - counts.begin();
  const Tensor w_rows = w.view().reshape({e * out, in}), dw_rows = dw.view().reshape({e * out, in});
  const int64_t o0 = std::min<int64_t>(96, out - 64), o1 = o0 + 64;
  std::vector<Buffer> dw_refs;
  const std::vector<int64_t> experts = {largest, 3, 1, e - 1};
  for (int64_t g : experts) {
    const int64_t begin = off[g], end = off[g + 1], tail = std::max<int64_t>(begin, end - 48);
    const std::string where = fmt::format("{} expert {} ({} rows)", shape, g, end - begin);
    Buffer wh = host_f32(w_rows.rows(g * out, (g + 1) * out), {out, in});
    Buffer xh = host_f32(x.view().rows(begin, end), {end - begin, in}), dyh = host_f32(dy.view().rows(begin, end), {end - begin, out});
    Buffer y_ref(DType::f32, Device::cpu, {end - tail, out}), dx_ref(DType::f32, Device::cpu, {end - tail, in});
    linear_forward(y_ref, xh.view().rows(tail - begin, end - begin), wh);
    linear_backward_input(dx_ref, dyh.view().rows(tail - begin, end - begin), wh);
    report.compare("grouped fwd " + where, y.view().rows(tail, end), y_ref, kBf16Bound);
    report.compare("grouped bwd_input " + where, dx.view().rows(tail, end), dx_ref, kBf16Bound);
    dw_refs.push_back(Buffer::zeros(DType::f32, Device::cpu, {o1 - o0, in}));
    linear_backward_weight(dw_refs.back(), columns(dyh, o0, o1), xh);
    report.compare(fmt::format("grouped bwd_weight {} dW rows {}-{}", where, o0, o1), dw_rows.rows(g * out + o0, g * out + o1),
                   dw_refs.back(), kF32Bound);
  }
  grouped_linear_backward_weight(dw, dy, x, offsets);
  for (size_t j = 0; j < experts.size(); ++j) {
    const int64_t g = experts[j];
    report.compare(fmt::format("grouped bwd_weight x2 {} expert {} dW rows {}-{}", shape, g, o0, o1),
                   dw_rows.rows(g * out + o0, g * out + o1), scaled(dw_refs[j], 2), kF32Bound);
  }
  const int64_t empty = std::find(counts.begin(), counts.end(), 0) - counts.begin();
  const Buffer zeros = Buffer::zeros(DType::f32, Device::cpu, {out, in});
  report.expect_equal(fmt::format("grouped bwd_weight {} expert {} (no rows) untouched", shape, empty),
                      dw_rows.rows(empty * out, (empty + 1) * out), zeros);
  // Overwriting (NaN before) twice: the reference, zeros for the empty expert, the same bits each time.
  Buffer dw_written = poisoned(DType::f32, {e, out, in}), dw_again = poisoned(DType::f32, {e, out, in});
  grouped_linear_backward_weight(dw_written, dy, x, offsets, true);
  grouped_linear_backward_weight(dw_again, dy, x, offsets, true);
  const Tensor written_rows = dw_written.view().reshape({e * out, in}), again_rows = dw_again.view().reshape({e * out, in});
  for (size_t j = 0; j < experts.size(); ++j) {
    const int64_t g = experts[j];
    report.compare(fmt::format("grouped bwd_weight overwrite {} expert {} dW rows {}-{}", shape, g, o0, o1),
                   written_rows.rows(g * out + o0, g * out + o1), dw_refs[j], kF32Bound);
    report.expect_equal(fmt::format("grouped bwd_weight overwrite twice, same bits {} expert {}", shape, g),
                        again_rows.rows(g * out, (g + 1) * out), to_host_f32(written_rows.rows(g * out, (g + 1) * out)));
  }
  report.expect_equal(fmt::format("grouped bwd_weight overwrite {} expert {} (no rows) zero", shape, empty),
                      written_rows.rows(empty * out, (empty + 1) * out), zeros);
  check_device_offsets(report, shape, x, w, dy, offsets, y, dx, dw, dw_written);
  std::vector<int64_t> banded = experts;
  banded.push_back(empty);
  check_squares(report, shape, dy, x, offsets, out, banded);
  check_squares(report, shape, dy, x, to_device(offsets, DType::i32), out, banded);
  check_pair(report, shape, dy, x, offsets, std::vector<int32_t>(counts.rbegin(), counts.rend()), seed + 3);
  check_known_zero(report, shape, dy, x, offsets, std::vector<int32_t>(counts.rbegin(), counts.rend()), seed + 4);
}

}  // namespace

void check_gemm_ops(CheckReport& report) {
  // Odd sizes (not multiples of 8 or of any tile), a single row, and one aligned shape.
  check_linear_small(report, 37, 72, 130, 100);
  check_linear_small(report, 37, 75, 131, 110);
  check_linear_small(report, 1, 40, 24, 120);
  check_linear_small(report, 200, 136, 264, 130);
  // O or I not a multiple of 8: the simple grouped kernels (y or dx, and dW).
  check_grouped_small(report, 130, 72, {0, 13, 1, 0, 29, 7}, 200);
  check_grouped_small(report, 37, 75, {5, 0, 11, 3}, 210);
  // Multiples of 8 with odd row counts and partial tiles: the wgmma kernel (128 x 256 tiles, K in
  // steps of 64) and the wgmma dW kernel.
  check_grouped_small(report, 136, 200, {17, 0, 1, 40, 33, 0}, 220);
  check_grouped_small(report, 264, 128, {0, 0, 130, 2, 64}, 230);
  // Experts of 1 to 3 row tiles whose last tile holds 1, 44, 64 (one consumer warpgroup) or 65 rows;
  // 520 columns = 2 full column tiles and a partial one, K = 264 not a multiple of 64.
  check_grouped_small(report, 520, 264, {0, 1, 300, 65, 64, 129, 0}, 240);
  // The dW kernel's K is an expert's rows: experts of 44 (less than one k-step of 64), 64, 65, 127,
  // 264 rows and none at the end (its k-step lies wholly past the last row); O = 264 and I = 520
  // end in partial tiles of its 128 x 256 dW tiles.
  check_grouped_small(report, 264, 520, {44, 0, 1, 64, 65, 264, 127, 0}, 245);
  // 40 experts, the rows in the last few: the kernel's search for a tile's expert crosses 32 of them.
  std::vector<int32_t> late(40, 0);
  late[36] = 5, late[37] = 129, late[39] = 1;
  check_grouped_small(report, 264, 136, late, 250);
  // As many experts as the wgmma kernel holds tile starts for in shared memory (the scan's 15 rounds,
  // the dynamic shared memory at its 227 KiB limit), a few with rows; one more runs on cuBLAS.
  for (const int64_t e : {kWgmmaMaxExperts, kWgmmaMaxExperts + 1}) {
    std::vector<int32_t> most(size_t(e), 0);
    most[0] = 3, most[200] = 130, most[size_t(e) - 1] = 64;
    check_grouped_small(report, 264, 136, most, 255);
  }
  // The cuBLAS grouped call, still selectable for comparisons.
  set_grouped_gemm_backend(GroupedGemmBackend::cublas);
  check_grouped_small(report, 136, 200, {17, 0, 1, 40, 33, 0}, 220, "cuBLAS");
  set_grouped_gemm_backend(GroupedGemmBackend::wgmma);

  // Bench shapes: Qwen3-30B-A3B, hidden 2048, 32 query heads of 128, 128 experts top-8 of width 768,
  // 4096 tokens.
  check_linear_bench(report, "q_proj", 4096, 2048, 4096, DType::bf16, 300);
  check_linear_bench(report, "router", 4096, 2048, 128, DType::f32, 310);
  check_grouped_bench(report, "gate_up", 128, 32768, 2048, 1536, 400);
  check_grouped_bench(report, "down", 128, 32768, 768, 2048, 410);
}

}  // namespace marrow
