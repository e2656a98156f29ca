// marrow check, group "gemm": linear (cuBLASLt) and grouped_linear (own wgmma forward, backward
// input and fp32 weight gradient) against the CPU reference: small odd shapes in full; the bench
// shapes (Qwen3-30B-A3B's layer, timed by `marrow bench --kernels`) drawn on the GPU, wholly finite,
// and compared on slices the CPU computes in well under a second. Weight gradients accumulate (a
// second call gives twice the reference); overwriting twice gives the same bits.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "gpu_check/check.h"
#include "ops/grouped_linear.h"
#include "ops/linear.h"

namespace marrow {

namespace {

constexpr double kBf16Bound = 1e-2;  // bf16 outputs: one rounding of ~2^-9 relative
constexpr double kF32Bound = 1e-3;   // fp32 outputs and accumulated gradients
constexpr DType bf16 = DType::bf16, f32 = DType::f32;

// A host f32 copy of a device tensor, shaped dims.
Buffer host_f32(Tensor device, std::initializer_list<int64_t> dims) {
  Buffer flat = to_host_f32(device), b(f32, Device::cpu, dims);
  copy(b, flat);
  return b;
}

Buffer scaled(Tensor host, float factor) {
  Buffer out(f32, Device::cpu, {host.numel()});
  for (int64_t i = 0; i < host.numel(); ++i) out.ptr<float>()[i] = factor * host.ptr<float>()[i];
  return out;
}

// Columns [c0, c1) of a host [rows, cols] f32 matrix.
Buffer columns(Tensor host, int64_t c0, int64_t c1) {
  const int64_t rows = host.size(0), cols = host.size(1);
  Buffer out(f32, Device::cpu, {rows, c1 - c0});
  for (int64_t r = 0; r < rows; ++r)
    std::copy(host.ptr<float>() + r * cols + c0, host.ptr<float>() + r * cols + c1, out.ptr<float>() + r * (c1 - c0));
  return out;
}

// Rows [g * n, (g + 1) * n) of t seen as [E * n, ...]: expert g's slice of a [E, n, ...] tensor.
Tensor expert_rows(Tensor t, int64_t g, int64_t n, int64_t begin, int64_t end) {
  return t.reshape({t.size(0) * t.size(1), t.size(2)}).rows(g * n + begin, g * n + end);
}

// ---- linear ----------------------------------------------------------------------------------

void check_linear_small(CheckReport& report, int64_t n, int64_t in, int64_t out, uint64_t seed) {
  const std::string shape = fmt::format("{}x{}->{}", n, in, out);
  const Both x(random_bf16({n, in}, seed), bf16), w(random_bf16({out, in}, seed + 1), bf16), dy(random_bf16({n, out}, seed + 2), bf16);
  Both y = Both::out(bf16, {n, out}), dx = Both::out(bf16, {n, in}), dw(Buffer::zeros(f32, Device::cpu, {out, in}), f32);
  on_each_side([&](int s) {
    linear_forward(y[s], x[s], w[s]);
    linear_backward_input(dx[s], dy[s], w[s]);
    linear_backward_weight(dw[s], dy[s], x[s]);
  });
  Buffer y32 = poisoned(f32, {n, out});
  linear_forward(y32, x.gpu, w.gpu);
  report.compare("linear fwd bf16 " + shape, y, kBf16Bound);
  report.compare("linear fwd f32 out " + shape, y32, y.cpu, kF32Bound);
  report.compare("linear bwd_input " + shape, dx, kBf16Bound);
  linear_backward_input(dx.gpu, dy.gpu, w.gpu, true);  // beta = 1: added to the first call's bf16 result
  report.compare("linear bwd_input x2 (accumulates) " + shape, dx.gpu, scaled(dx.cpu, 2), kBf16Bound);
  report.compare("linear bwd_weight " + shape, dw, kF32Bound);
  linear_backward_weight(dw.gpu, dy.gpu, x.gpu);
  report.compare("linear bwd_weight x2 (accumulates) " + shape, dw.gpu, scaled(dw.cpu, 2), kF32Bound);
  // Overwriting over NaN: the bits of accumulating into zeros (the same algorithm, beta 0).
  Buffer written = poisoned(f32, {out, in}), accumulated = Buffer::zeros(f32, Device::cuda, {out, in});
  linear_backward_weight(written, dy.gpu, x.gpu, true);
  linear_backward_weight(accumulated, dy.gpu, x.gpu);
  report.expect_same_bits("linear bwd_weight overwrite = into zeros " + shape, written, accumulated);
}

// Bench shape: outputs compared on their last `rows` rows, dW on rows [o0, o0 + 64).
void check_linear_bench(CheckReport& report, const char* label, int64_t n, int64_t in, int64_t out, DType y_dtype, uint64_t seed) {
  const std::string shape = fmt::format("{} {}x{}->{}", label, n, in, out);
  const int64_t rows = std::min<int64_t>(n, 48), r0 = n - rows;
  const int64_t o0 = std::min<int64_t>(96, out - std::min<int64_t>(out, 64)), o1 = std::min(out, o0 + 64);
  Buffer x = random_device({n, in}, seed, "x"), w = random_device({out, in}, seed, "w"), dy = random_device({n, out}, seed, "dy");
  Buffer y = poisoned(y_dtype, {n, out}), dx = poisoned(bf16, {n, in}), dw = Buffer::zeros(f32, Device::cuda, {out, in});
  linear_forward(y, x, w);
  linear_backward_input(dx, dy, w);
  linear_backward_weight(dw, dy, x);

  Buffer xh = host_f32(x, {n, in}), wh = host_f32(w, {out, in}), dyh = host_f32(dy, {n, out});
  Buffer y_ref(f32, Device::cpu, {rows, out}), dx_ref(f32, Device::cpu, {rows, in}), dw_ref = Buffer::zeros(f32, Device::cpu, {o1 - o0, in});
  linear_forward(y_ref, xh.view().rows(r0, n), wh);
  linear_backward_input(dx_ref, dyh.view().rows(r0, n), wh);
  linear_backward_weight(dw_ref, columns(dyh, o0, o1), xh);

  report.expect_finite("linear fwd all written " + shape, y);
  report.compare(fmt::format("linear fwd {} {} rows {}-{}", dtype_name(y_dtype), shape, r0, n), y.view().rows(r0, n), y_ref,
                 y_dtype == f32 ? kF32Bound : kBf16Bound);
  report.expect_finite("linear bwd_input all written " + shape, dx);
  report.compare(fmt::format("linear bwd_input {} rows {}-{}", shape, r0, n), dx.view().rows(r0, n), dx_ref, kBf16Bound);
  report.compare(fmt::format("linear bwd_weight {} dW rows {}-{}", shape, o0, o1), dw.view().rows(o0, o1), dw_ref, kF32Bound);
  linear_backward_weight(dw, dy, x);
  report.compare(fmt::format("linear bwd_weight x2 {} dW rows {}-{}", shape, o0, o1), dw.view().rows(o0, o1), scaled(dw_ref, 2), kF32Bound);
}

// ---- grouped_linear ----------------------------------------------------------------------------

// The grouped ops again with the offsets in GPU memory (the tile schedules and dW work lists built on
// the device, no wait for the GPU): every output bit for bit the host offsets' outputs, given as
// y, dx, dw after two accumulating calls from zero, and dw overwritten.
void check_device_offsets(CheckReport& report, const std::string& shape, Tensor x, Tensor w, Tensor dy, Tensor offsets, Tensor y,
                          Tensor dx, Tensor dw_twice, Tensor dw_written) {
  const Buffer offsets_d = to_device(offsets, DType::i32);
  const int64_t r = x.size(0), in = x.size(1), e = w.size(0), out = w.size(1);
  Buffer y2 = poisoned(bf16, {r, out}), dx2 = poisoned(bf16, {r, in});
  grouped_linear_forward(y2, x, w, offsets_d);
  grouped_linear_backward_input(dx2, dy, w, offsets_d);
  Buffer dw2 = Buffer::zeros(f32, Device::cuda, {e, out, in}), written2 = poisoned(f32, {e, out, in});
  grouped_linear_backward_weight(dw2, dy, x, offsets_d);
  grouped_linear_backward_weight(dw2, dy, x, offsets_d);
  grouped_linear_backward_weight(written2, dy, x, offsets_d, true);
  const std::string where = ", offsets on the GPU = on the host " + shape;
  report.expect_same_bits("grouped fwd" + where, y2, y);
  report.expect_same_bits("grouped bwd_input" + where, dx2, dx);
  report.expect_same_bits("grouped bwd_weight x2" + where, dw2, dw_twice);
  report.expect_same_bits("grouped bwd_weight overwrite" + where, written2, dw_written);
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
  Buffer dw = poisoned(f32, {e, o, in}), plain = poisoned(f32, {e, o, in}), again = poisoned(f32, {e, o, in});
  Buffer squares = poisoned(DType::f64, {e * per_expert}), squares_again = poisoned(DType::f64, {e * per_expert});
  for (const bool overwrite : {true, false}) {
    const std::string mode = fmt::format("{} {}", overwrite ? "overwrite" : "then accumulate", where);
    grouped_linear_backward_weight(dw, dy, x, offsets, overwrite, squares);
    grouped_linear_backward_weight(plain, dy, x, offsets, overwrite);
    grouped_linear_backward_weight(again, dy, x, offsets, overwrite, squares_again);
    report.expect_same_bits("grouped bwd_weight with squares, dW bits as without, " + mode, dw, plain);
    const Buffer got = to_host(squares);
    double error = 0;
    bool finite = true;
    for (int64_t g : experts) {
      const std::vector<double> ref = band_squares_ref(expert_rows(dw, g, o, 0, o), o, in);
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

// A step's two micro-batches: (dy, x) routed by `offsets`, and a second one routed by counts2 with
// its own random rows; the offsets on the host or (on_gpu) on the GPU.
struct TwoBatches {
  Tensor dy, x, offsets;
  Buffer offsets2, x2, dy2, offsets_d, offsets2_d;
  int64_t e = 0, rows2 = 0;
  TwoBatches(Tensor dy, Tensor x, Tensor offsets, const std::vector<int32_t>& counts2, uint64_t seed)
      : dy(dy), x(x), offsets(offsets), offsets2(offsets_host(counts2)), e(offsets.numel() - 1), rows2(offsets2.ptr<int32_t>()[e]) {
    x2 = random_device({rows2, x.size(1)}, seed, "x2");
    dy2 = random_device({rows2, dy.size(1)}, seed, "dy2");
    offsets_d = to_device(offsets, DType::i32);
    offsets2_d = to_device(offsets2, DType::i32);
  }
  ExpertRows first(bool on_gpu) const { return {dy, x, on_gpu ? offsets_d.view() : offsets}; }
  ExpertRows second(bool on_gpu) const { return {dy2, x2, on_gpu ? offsets2_d.view() : offsets2.view()}; }
};

// grouped_linear_backward_weight_pair of the two micro-batches: dW and squares the bits of the two
// calls it stands for, overwriting from NaN and then accumulating.
void check_pair(CheckReport& report, const std::string& shape, const TwoBatches& b) {
  const int64_t in = b.x.size(1), o = b.dy.size(1), e = b.e, squares_count = grouped_weight_squares_count(e, o, in);
  for (const bool on_gpu : {false, true}) {
    const ExpertRows first = b.first(on_gpu), second = b.second(on_gpu);
    Buffer sequential = poisoned(f32, {e, o, in}), paired = poisoned(f32, {e, o, in});
    Buffer squares_sequential = poisoned(DType::f64, {squares_count}), squares_paired = poisoned(DType::f64, {squares_count});
    for (const bool overwrite : {true, false}) {
      const std::string mode = fmt::format("{} {} with E{} {} rows, {}", overwrite ? "overwrite" : "then accumulate", shape, e, b.rows2,
                                           on_gpu ? "offsets on the GPU" : "offsets on the host");
      grouped_linear_backward_weight(sequential, first.dy, first.x, first.expert_offsets, overwrite, squares_sequential);
      grouped_linear_backward_weight(sequential, second.dy, second.x, second.expert_offsets, false, squares_sequential);
      grouped_linear_backward_weight_pair(paired, first, second, overwrite, squares_paired);
      report.expect_same_bits("grouped bwd_weight pair = two calls, dW bits, " + mode, paired, sequential);
      report.expect_same_bits("grouped bwd_weight pair = two calls, squares bits, " + mode, squares_paired, squares_sequential);
    }
  }
}

// The known_zero flags (grouped_linear.h) against the same calls without them, for one call and for
// a pair with the second micro-batch: an overwrite from NaN, a second overwrite (the empty experts'
// zeros are known: skipped, their bands set again from NaN), then an accumulating call of the
// second micro-batch: dW and squares the same bits after each, the flags grouped_linear.h's; last,
// an expert whose flag is set is left alone by an overwrite (its slice, planted with NaN, stays NaN).
void check_known_zero(CheckReport& report, const std::string& shape, const TwoBatches& b) {
  const int64_t in = b.x.size(1), o = b.dy.size(1), e = b.e, squares_count = grouped_weight_squares_count(e, o, in);
  Buffer expected(DType::i32, Device::cpu, {e});  // flags after each step: no rows in the step's micro-batches
  const int32_t *off = b.offsets.ptr<int32_t>(), *off2 = b.offsets2.ptr<int32_t>();
  for (int64_t g = 0; g < e; ++g) expected.ptr<int32_t>()[g] = off[g + 1] == off[g] && off2[g + 1] == off2[g] ? 1 : 0;
  for (const bool pair : {false, true})
    for (const bool on_gpu : {false, true}) {
      const ExpertRows first = b.first(on_gpu), second = b.second(on_gpu);
      Buffer plain = poisoned(f32, {e, o, in}), flagged = poisoned(f32, {e, o, in}), known = Buffer::zeros(DType::i32, Device::cuda, {e});
      Buffer squares_plain = poisoned(DType::f64, {squares_count}), squares_flagged = poisoned(DType::f64, {squares_count});
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
        report.expect_same_bits(fmt::format("grouped bwd_weight known zero, {}: dW bits, {}", when, mode), flagged, plain);
        report.expect_same_bits(fmt::format("grouped bwd_weight known zero, {}: squares bits, {}", when, mode), squares_flagged, squares_plain);
        report.expect_equal(fmt::format("grouped bwd_weight known zero, {}: flags, {}", when, mode), known, expected);
      }
      const int32_t* flag = expected.ptr<int32_t>();
      const int64_t left = std::find(flag, flag + e, 1) - flag;  // an expert whose flag is set
      if (left == e) continue;
      const Tensor slice = expert_rows(flagged.view().reshape({e, o, in}), left, o, 0, o);
      poison(slice);
      step(flagged, squares_flagged, known, true);
      const Buffer kept = to_host(slice);
      report.expect(fmt::format("grouped bwd_weight known zero: expert {}'s slice left alone, {}", left, mode),
                    std::all_of(kept.ptr<float>(), kept.ptr<float>() + kept.numel(), [](float v) { return std::isnan(v); }));
    }
}

// The checks every grouped shape ends with: the offsets on the GPU, the squares (of the listed
// experts' bands, offsets on the host and on the GPU), and against a second micro-batch whose counts
// are the first's reversed (experts empty in one have rows in the other), paired and known zero.
void check_grouped_extras(CheckReport& report, const std::string& shape, Tensor x, Tensor w, Tensor dy, Tensor offsets, Tensor y, Tensor dx,
                          Tensor dw, Tensor dw_written, const std::vector<int32_t>& counts, const std::vector<int64_t>& experts, uint64_t seed) {
  check_device_offsets(report, shape, x, w, dy, offsets, y, dx, dw, dw_written);
  check_squares(report, shape, dy, x, offsets, w.size(1), experts);
  check_squares(report, shape, dy, x, to_device(offsets, DType::i32), w.size(1), experts);
  const std::vector<int32_t> reversed(counts.rbegin(), counts.rend());
  check_pair(report, shape, TwoBatches(dy, x, offsets, reversed, seed + 3));
  check_known_zero(report, shape, TwoBatches(dy, x, offsets, reversed, seed + 4));
}

// kernel: a name for the rows when the forward/backward-input kernel is not the default one.
void check_grouped_small(CheckReport& report, int64_t out, int64_t in, const std::vector<int32_t>& counts, uint64_t seed,
                         const char* kernel = nullptr) {
  const int64_t e = int64_t(counts.size());
  const Buffer offsets = offsets_host(counts);
  const int64_t r = offsets.ptr<int32_t>()[e];
  const std::string shape = fmt::format("E{} {}x{}->{}{}", e, r, in, out, kernel ? fmt::format(" ({})", kernel) : "");
  const Both x(random_bf16({r, in}, seed), bf16), w(random_bf16({e, out, in}, seed + 1), bf16), dy(random_bf16({r, out}, seed + 2), bf16);
  Both y = Both::out(bf16, {r, out}), dx = Both::out(bf16, {r, in}), dw(Buffer::zeros(f32, Device::cpu, {e, out, in}), f32);
  on_each_side([&](int s) {
    grouped_linear_forward(y[s], x[s], w[s], offsets);
    grouped_linear_backward_input(dx[s], dy[s], w[s], offsets);
    grouped_linear_backward_weight(dw[s], dy[s], x[s], offsets);
  });
  report.compare("grouped fwd " + shape, y, kBf16Bound);
  report.compare("grouped bwd_input " + shape, dx, kBf16Bound);
  report.compare("grouped bwd_weight " + shape, dw, kF32Bound);
  grouped_linear_backward_weight(dw.gpu, dy.gpu, x.gpu, offsets);
  report.compare("grouped bwd_weight x2 (accumulates) " + shape, dw.gpu, scaled(dw.cpu, 2), kF32Bound);
  // Overwriting ignores what dW held (NaN here) and zeroes experts without rows.
  Buffer dw_written = poisoned(f32, {e, out, in}), dw_again = poisoned(f32, {e, out, in});
  grouped_linear_backward_weight(dw_written, dy.gpu, x.gpu, offsets, true);
  report.compare("grouped bwd_weight overwrite " + shape, dw_written, dw.cpu, kF32Bound);
  grouped_linear_backward_weight(dw_again, dy.gpu, x.gpu, offsets, true);
  report.expect_same_bits("grouped bwd_weight overwrite twice, same bits " + shape, dw_again, dw_written);
  std::vector<int64_t> every(static_cast<size_t>(e));
  for (int64_t g = 0; g < e; ++g) every[size_t(g)] = g;
  check_grouped_extras(report, shape, x.gpu, w.gpu, dy.gpu, offsets, y.gpu, dx.gpu, dw.gpu, dw_written, counts, every, seed);
}

// Bench shape: E experts, rows routed by skewed_counts. Outputs compared on up to 48 last rows of a
// few experts, dW on a band of 64 rows (crossing a 128-row tile) of the same experts, an expert
// without rows must keep a zero gradient.
void check_grouped_bench(CheckReport& report, const char* label, int64_t e, int64_t r, int64_t in, int64_t out, uint64_t seed) {
  const std::vector<int32_t> counts = skewed_counts(e, r);
  const Buffer offsets = offsets_host(counts);
  const int32_t* off = offsets.ptr<int32_t>();
  const std::string shape = fmt::format("{} E{} {}x{}->{}", label, e, r, in, out);
  Buffer x = random_device({r, in}, seed, "x"), w = random_device({e, out, in}, seed, "w"), dy = random_device({r, out}, seed, "dy");
  Buffer y = poisoned(bf16, {r, out}), dx = poisoned(bf16, {r, in}), dw = Buffer::zeros(f32, Device::cuda, {e, out, in});
  grouped_linear_forward(y, x, w, offsets);
  grouped_linear_backward_input(dx, dy, w, offsets);
  grouped_linear_backward_weight(dw, dy, x, offsets);
  report.expect_finite("grouped fwd all written " + shape, y);
  report.expect_finite("grouped bwd_input all written " + shape, dx);

  const int64_t largest = std::max_element(counts.begin(), counts.end()) - counts.begin();
  const int64_t o0 = std::min<int64_t>(96, out - 64), o1 = o0 + 64;
  std::vector<Buffer> dw_refs;
  const std::vector<int64_t> experts = {largest, 3, 1, e - 1};
  auto band = [&](Tensor t, int64_t g) { return expert_rows(t.reshape({e, out, in}), g, out, o0, o1); };
  for (int64_t g : experts) {
    const int64_t begin = off[g], end = off[g + 1], tail = std::max<int64_t>(begin, end - 48);
    const std::string where = fmt::format("{} expert {} ({} rows)", shape, g, end - begin);
    Buffer wh = host_f32(expert_rows(w.view().reshape({e, out, in}), g, out, 0, out), {out, in});
    Buffer xh = host_f32(x.view().rows(begin, end), {end - begin, in}), dyh = host_f32(dy.view().rows(begin, end), {end - begin, out});
    Buffer y_ref(f32, Device::cpu, {end - tail, out}), dx_ref(f32, Device::cpu, {end - tail, in});
    linear_forward(y_ref, xh.view().rows(tail - begin, end - begin), wh);
    linear_backward_input(dx_ref, dyh.view().rows(tail - begin, end - begin), wh);
    report.compare("grouped fwd " + where, y.view().rows(tail, end), y_ref, kBf16Bound);
    report.compare("grouped bwd_input " + where, dx.view().rows(tail, end), dx_ref, kBf16Bound);
    dw_refs.push_back(Buffer::zeros(f32, Device::cpu, {o1 - o0, in}));
    linear_backward_weight(dw_refs.back(), columns(dyh, o0, o1), xh);
    report.compare(fmt::format("grouped bwd_weight {} dW rows {}-{}", where, o0, o1), band(dw, g), dw_refs.back(), kF32Bound);
  }
  grouped_linear_backward_weight(dw, dy, x, offsets);
  for (size_t j = 0; j < experts.size(); ++j)
    report.compare(fmt::format("grouped bwd_weight x2 {} expert {} dW rows {}-{}", shape, experts[j], o0, o1), band(dw, experts[j]),
                   scaled(dw_refs[j], 2), kF32Bound);
  const int64_t empty = std::find(counts.begin(), counts.end(), 0) - counts.begin();
  const Buffer zeros = Buffer::zeros(f32, Device::cpu, {out, in});
  auto whole = [&](Tensor t, int64_t g) { return expert_rows(t.reshape({e, out, in}), g, out, 0, out); };
  report.expect_equal(fmt::format("grouped bwd_weight {} expert {} (no rows) untouched", shape, empty), whole(dw, empty), zeros);
  // Overwriting (NaN before) twice: the reference, zeros for the empty expert, the same bits each time.
  Buffer dw_written = poisoned(f32, {e, out, in}), dw_again = poisoned(f32, {e, out, in});
  grouped_linear_backward_weight(dw_written, dy, x, offsets, true);
  grouped_linear_backward_weight(dw_again, dy, x, offsets, true);
  for (size_t j = 0; j < experts.size(); ++j) {
    const int64_t g = experts[j];
    report.compare(fmt::format("grouped bwd_weight overwrite {} expert {} dW rows {}-{}", shape, g, o0, o1), band(dw_written, g), dw_refs[j],
                   kF32Bound);
    report.expect_same_bits(fmt::format("grouped bwd_weight overwrite twice, same bits {} expert {}", shape, g), whole(dw_again, g),
                            whole(dw_written, g));
  }
  report.expect_equal(fmt::format("grouped bwd_weight overwrite {} expert {} (no rows) zero", shape, empty), whole(dw_written, empty), zeros);
  std::vector<int64_t> banded = experts;
  banded.push_back(empty);
  check_grouped_extras(report, shape, x, w, dy, offsets, y, dx, dw, dw_written, counts, banded, seed);
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
  check_linear_bench(report, "q_proj", 4096, 2048, 4096, bf16, 300);
  check_linear_bench(report, "router", 4096, 2048, 128, f32, 310);
  check_grouped_bench(report, "gate_up", 128, 32768, 2048, 1536, 400);
  check_grouped_bench(report, "down", 128, 32768, 768, 2048, 410);
}

}  // namespace marrow
