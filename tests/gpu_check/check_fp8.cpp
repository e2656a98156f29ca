// marrow check, group "fp8": the FP8 quantization (ops/fp8.h) bit for bit against the CPU reference,
// including a NaN block, f32 and bf16 inputs and partial blocks; the FP8 grouped GEMM
// (ops/grouped_linear_fp8.h) against the CPU reference of the same quantized operands, with offsets on
// the host and on the GPU (the same bits) and twice (the same bits), and at the bench shapes on the
// last rows of a few experts, where it is also held against the bf16 grouped GEMM of the unquantized
// operands (the quantization's own error, ~5% of a typical output).
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "gpu_check/check.h"
#include "ops/fp8.h"
#include "ops/grouped_linear.h"
#include "ops/grouped_linear_fp8.h"

namespace marrow {

namespace {

constexpr double kBf16Bound = 1e-2;     // the GEMM's bf16 output against the same operands' reference
constexpr double kQuantizedBound = 0.08;  // FP8 against bf16 operands (3-4.3% measured): E4M3 keeps 3 mantissa bits

int64_t blocks_of(int64_t n) { return (n + kFp8Block - 1) / kFp8Block; }

// A host copy of a 2- or 3-dimensional device tensor with its shape (to_host's is flat).
Buffer host_copy(Tensor device) {
  Buffer b = device.ndim == 3 ? Buffer(device.dtype, Device::cpu, {device.size(0), device.size(1), device.size(2)})
                              : Buffer(device.dtype, Device::cpu, {device.size(0), device.size(1)});
  copy(b, device);
  return b;
}

// Host f32 values, rounded through bf16, rows scaled by powers of two from 2^-3 to 2^3 (so that the
// blocks' scales differ), element 5 of row 1 NaN when asked.
Buffer host_input(std::initializer_list<int64_t> dims, uint64_t seed, bool with_nan) {
  Buffer b = random_bf16(dims, seed);
  const Tensor t = b.view();
  const int64_t cols = t.size(t.ndim - 1);
  for (int64_t i = 0; i < t.numel(); ++i) t.ptr<float>()[i] = std::ldexp(t.ptr<float>()[i], int(i / cols % 7) - 3);
  if (with_nan && t.numel() > cols + 5) t.ptr<float>()[cols + 5] = std::numeric_limits<float>::quiet_NaN();
  return b;
}

void check_quantize_rows(CheckReport& report, int64_t r, int64_t c, DType input, uint64_t seed) {
  const std::string shape = fmt::format("{}x{} {}", r, c, dtype_name(input));
  const Buffer x = host_input({r, c}, seed, true);
  Fp8Buffer ref = Fp8Buffer::rows(Device::cpu, r, c), got = Fp8Buffer::rows(Device::cuda, r, c);
  quantize_rows(ref.view(), x);
  poison(got.scales);
  quantize_rows(got.view(), Both(x, input).gpu);
  report.expect_equal("quantize_rows values " + shape, got.values, ref.values);
  report.expect_equal("quantize_rows scales (a NaN block) " + shape, got.scales, ref.scales);
}

void check_quantize_blocks(CheckReport& report, int64_t e, int64_t o, int64_t i, DType input, uint64_t seed) {
  const std::string shape = fmt::format("{}x{}x{} {}", e, o, i, dtype_name(input));
  const Buffer w = host_input({e, o, i}, seed, true);
  Fp8Buffer ref = Fp8Buffer::blocks(Device::cpu, e, o, i), ref_t = Fp8Buffer::blocks(Device::cpu, e, i, o);
  Fp8Buffer got = Fp8Buffer::blocks(Device::cuda, e, o, i), got_t = Fp8Buffer::blocks(Device::cuda, e, i, o);
  Fp8Buffer alone = Fp8Buffer::blocks(Device::cuda, e, o, i);
  quantize_blocks(ref.view(), ref_t.view(), w);
  const Both wd(w, input);
  quantize_blocks(got.view(), got_t.view(), wd.gpu);
  quantize_blocks(alone.view(), {}, wd.gpu);
  report.expect_equal("quantize_blocks values " + shape, got.values, ref.values);
  report.expect_equal("quantize_blocks scales " + shape, got.scales, ref.scales);
  report.expect_equal("quantize_blocks transposed values " + shape, got_t.values, ref_t.values);
  report.expect_equal("quantize_blocks transposed scales " + shape, got_t.scales, ref_t.scales);
  report.expect_equal("quantize_blocks without the transposed, same values " + shape, alone.values, ref.values);
}

// The host copy of rows [begin, end) of a device tensor quantized by rows.
Fp8Buffer host_rows(Fp8Tensor device, int64_t begin, int64_t end) {
  const int64_t r = device.values.size(0), c = device.values.size(1), cb = blocks_of(c);
  Fp8Buffer out{host_copy(device.values.rows(begin, end)), Buffer(DType::f32, Device::cpu, {cb, end - begin})};
  const Buffer scales = to_host(device.scales);
  for (int64_t b = 0; b < cb; ++b)
    std::copy_n(scales.ptr<float>() + b * r + begin, end - begin, out.scales.ptr<float>() + b * (end - begin));
  return out;
}

// The host copy of expert g of a device weight quantized by blocks, as a one-expert weight.
Fp8Buffer host_expert(Fp8Tensor device, int64_t g) {
  return {host_copy(device.values.rows(g, g + 1)), host_copy(device.scales.rows(g, g + 1))};
}

// The CPU reference of rows [begin, end) of expert g's output.
Buffer reference_rows(Fp8Tensor x, Fp8Tensor w, int64_t g, int64_t begin, int64_t end) {
  const Fp8Buffer xh = host_rows(x, begin, end), wh = host_expert(w, g);
  Buffer y(DType::f32, Device::cpu, {end - begin, w.values.size(1)});
  const Buffer offsets = offsets_host({int32_t(end - begin)});
  grouped_linear_fp8(y, xh.view(), wh.view(), offsets);
  return y;
}

// x [R, k] and w [E, n, k] quantized on the GPU; transposed: w is drawn as [E, k, n] and its
// transposed quantization used (the backward input's operand).
void check_gemm_small(CheckReport& report, int64_t n, int64_t k, const std::vector<int32_t>& counts, bool transposed, uint64_t seed) {
  const int64_t e = int64_t(counts.size());
  const Buffer offsets = offsets_host(counts);
  const int64_t r = offsets.ptr<int32_t>()[e];
  const std::string shape = fmt::format("{}x{}->{} E{}{}", r, k, n, e, transposed ? " (transposed weight)" : "");
  Fp8Buffer x = Fp8Buffer::rows(Device::cuda, r, k), w = Fp8Buffer::blocks(Device::cuda, e, n, k);
  quantize_rows(x.view(), Both(host_input({r, k}, seed, false), DType::bf16).gpu);
  Fp8Buffer drawn = Fp8Buffer::blocks(Device::cuda, e, k, n);
  if (transposed) quantize_blocks(drawn.view(), w.view(), Both(host_input({e, k, n}, seed + 1, false), DType::bf16).gpu);
  else quantize_blocks(w.view(), {}, Both(host_input({e, n, k}, seed + 1, false), DType::bf16).gpu);
  Buffer y = poisoned(DType::bf16, {r, n}), again = poisoned(DType::bf16, {r, n}), device_offsets = poisoned(DType::bf16, {r, n});
  grouped_linear_fp8(y, x.view(), w.view(), offsets);
  grouped_linear_fp8(again, x.view(), w.view(), offsets);
  grouped_linear_fp8(device_offsets, x.view(), w.view(), to_device(offsets, DType::i32));
  Buffer ref(DType::f32, Device::cpu, {r, n});
  const Fp8Buffer xh{host_copy(x.values), host_copy(x.scales)}, wh{host_copy(w.values), host_copy(w.scales)};
  grouped_linear_fp8(ref, xh.view(), wh.view(), offsets);
  report.compare("grouped fp8 " + shape, y, ref, kBf16Bound);
  report.expect_same_bits("grouped fp8 twice, same bits " + shape, again, y);
  report.expect_same_bits("grouped fp8, offsets on the GPU = on the host " + shape, device_offsets, y);
}

// Bench shape: y = x W^T (forward) or dx = dy W (the transposed weight), compared on the last 48
// rows of a few experts, and against the bf16 grouped GEMM of the unquantized operands.
void check_gemm_bench(CheckReport& report, const char* label, int64_t e, int64_t r, int64_t k, int64_t n, bool transposed, uint64_t seed) {
  const std::vector<int32_t> counts = skewed_counts(e, r);
  const Buffer offsets = offsets_host(counts);
  const std::string shape = fmt::format("{} E{} {}x{}->{}", label, e, r, k, n);
  const Buffer x = random_device({r, k}, seed, "x");
  const Buffer w = transposed ? random_device({e, k, n}, seed, "w") : random_device({e, n, k}, seed, "w");
  Fp8Buffer xq = Fp8Buffer::rows(Device::cuda, r, k), wq = Fp8Buffer::blocks(Device::cuda, e, n, k);
  quantize_rows(xq.view(), x);
  Fp8Buffer drawn = Fp8Buffer::blocks(Device::cuda, e, k, n);
  if (transposed) quantize_blocks(drawn.view(), wq.view(), w);
  else quantize_blocks(wq.view(), {}, w);
  Buffer y = poisoned(DType::bf16, {r, n}), y_bf16 = poisoned(DType::bf16, {r, n});
  grouped_linear_fp8(y, xq.view(), wq.view(), offsets);
  if (transposed) grouped_linear_backward_input(y_bf16, x, w, offsets);
  else grouped_linear_forward(y_bf16, x, w, offsets);
  report.expect_finite("grouped fp8 all written " + shape, y);
  const int32_t* off = offsets.ptr<int32_t>();
  const int64_t largest = std::max_element(counts.begin(), counts.end()) - counts.begin();
  for (const int64_t g : {largest, int64_t(3), int64_t(1), e - 1}) {
    const int64_t begin = off[g], end = off[g + 1], tail = std::max<int64_t>(begin, end - 48);
    if (end == begin) continue;
    const std::string where = fmt::format("{} expert {} ({} rows)", shape, g, end - begin);
    report.compare("grouped fp8 " + where, y.view().rows(tail, end), reference_rows(xq.view(), wq.view(), g, tail, end), kBf16Bound);
    report.compare("grouped fp8 against bf16 operands " + where, y.view().rows(tail, end), to_host_f32(y_bf16.view().rows(tail, end)),
                   kQuantizedBound);
  }
}

}  // namespace

void check_fp8_ops(CheckReport& report) {
  // Partial blocks (200 = 128 + 72 columns, 130 = 128 + 2 rows), one row, f32 and bf16 inputs.
  check_quantize_rows(report, 37, 200, DType::bf16, 500);
  check_quantize_rows(report, 1, 72, DType::f32, 510);
  check_quantize_rows(report, 4096, 2048, DType::bf16, 520);
  check_quantize_blocks(report, 3, 130, 200, DType::bf16, 530);
  check_quantize_blocks(report, 2, 72, 264, DType::f32, 540);
  check_quantize_blocks(report, 8, 1536, 2048, DType::bf16, 550);
  // The wgmma kernel: experts with 0, 1, 64, 65 and 129 rows; N with a partial tile (264: its second
  // half past n; 136: its second half partial); K with a partial 128 block (K = 144) and one whole.
  check_gemm_small(report, 264, 144, {0, 1, 300, 65, 64, 129, 0}, false, 600);
  check_gemm_small(report, 136, 128, {17, 0, 1, 40, 33, 0}, true, 610);
  // The plain kernel (K not a multiple of 16, N not of 8).
  check_gemm_small(report, 130, 72, {0, 13, 1, 0, 29, 7}, false, 620);
  check_gemm_small(report, 37, 75, {5, 0, 11, 3}, true, 630);
  // Bench shapes (Qwen3-30B-A3B's experts, 4096 tokens top-8): gate_up and down, forward and
  // backward input.
  check_gemm_bench(report, "gate_up fwd", 128, 32768, 2048, 1536, false, 700);
  check_gemm_bench(report, "down fwd", 128, 32768, 768, 2048, false, 710);
  check_gemm_bench(report, "down bwd_input", 128, 32768, 2048, 768, true, 720);
  check_gemm_bench(report, "gate_up bwd_input", 128, 32768, 1536, 2048, true, 730);
}

}  // namespace marrow
