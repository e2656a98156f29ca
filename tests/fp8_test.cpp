#include "ops/fp8.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "core/memory.h"
#include "core/rng.h"
#include "ops/grouped_linear.h"
#include "ops/grouped_linear_fp8.h"

namespace marrow {
namespace {

// Every finite E4M3 value, by brute force from the format's definition (not the encoder's code).
std::vector<std::pair<float, uint8_t>> finite_values() {
  std::vector<std::pair<float, uint8_t>> values;
  for (int byte = 0; byte < 256; ++byte) {
    const int biased = (byte >> 3) & 0xF, mantissa = byte & 7;
    if (biased == 15 && mantissa == 7) continue;  // NaN
    const float magnitude = biased == 0 ? mantissa / 512.0f : std::ldexp(1.0f + mantissa / 8.0f, biased - 7);
    values.push_back({byte & 0x80 ? -magnitude : magnitude, uint8_t(byte)});
  }
  return values;
}

TEST(Fp8, KnownBytes) {
  EXPECT_EQ(fp8_e4m3_from_float(1.0f), 0x38);
  EXPECT_EQ(fp8_e4m3_from_float(448.0f), 0x7E);
  EXPECT_EQ(fp8_e4m3_from_float(-448.0f), 0xFE);
  EXPECT_EQ(fp8_e4m3_from_float(1000.0f), 0x7E);  // saturates
  EXPECT_EQ(fp8_e4m3_from_float(std::ldexp(1.0f, -9)), 0x01);
  EXPECT_EQ(fp8_e4m3_from_float(std::ldexp(1.0f, -6)), 0x08);
  EXPECT_EQ(fp8_e4m3_from_float(1.0f + 1.0f / 16), 0x38);  // a tie: to the even mantissa 0
  EXPECT_EQ(fp8_e4m3_from_float(1.0f + 3.0f / 16), 0x3A);  // a tie: to the even mantissa 2
  EXPECT_EQ(fp8_e4m3_from_float(std::numeric_limits<float>::quiet_NaN()), 0x7F);
  EXPECT_TRUE(std::isnan(fp8_e4m3_to_float(0x7F)));
  EXPECT_EQ(fp8_e4m3_to_float(0xFE), -448.0f);
}

// The encoder rounds to the nearest finite value (ties to the even byte), for values of all sizes.
TEST(Fp8, RoundsToNearestAgainstBruteForce) {
  const auto values = finite_values();
  for (const auto& [value, byte] : values) EXPECT_EQ(fp8_e4m3_to_float(byte), value) << int(byte);
  Philox rng = philox_for(7, "fp8");
  for (uint64_t i = 0; i < 20000; ++i) {
    const float v = float(rng.normal(i)) * std::ldexp(1.0f, int(i % 24) - 12);
    if (std::fabs(v) > kFp8Max) continue;
    uint8_t best = 0;
    float best_error = INFINITY;
    for (const auto& [value, byte] : values) {
      const float error = std::fabs(value - v);
      if (error < best_error || (error == best_error && (byte & 1) == 0)) best = byte, best_error = error;
    }
    const uint8_t got = fp8_e4m3_from_float(v);
    EXPECT_EQ(fp8_e4m3_to_float(got), fp8_e4m3_to_float(best)) << v;
  }
}

TEST(Fp8, BlockScaleIsTheSmallestPowerOfTwoThatFits) {
  EXPECT_EQ(fp8_block_scale(448.0f), 1.0f);
  EXPECT_EQ(fp8_block_scale(448.5f), 2.0f);
  EXPECT_EQ(fp8_block_scale(224.0f), 0.5f);
  EXPECT_EQ(fp8_block_scale(224.5f), 1.0f);
  EXPECT_EQ(fp8_block_scale(0.0f), 1.0f);
  EXPECT_EQ(fp8_block_scale(3.0e-3f), std::ldexp(1.0f, -17));  // 3e-3 / 2^-17 = 393 <= 448 < 786
  EXPECT_TRUE(std::isnan(fp8_block_scale(INFINITY)));
  EXPECT_GT(fp8_block_scale(1e-44f), 0.0f);  // stays a normal float
}

Buffer random_matrix(std::initializer_list<int64_t> dims, uint64_t seed) {
  Buffer b(DType::f32, Device::cpu, dims);
  Philox rng = philox_for(seed, "fp8 test");
  for (int64_t i = 0; i < b.numel(); ++i) b.ptr<float>()[i] = float(rng.normal(uint64_t(i))) * std::ldexp(1.0f, int(i / 50 % 5) - 2);
  return b;
}

// Rows: each value within E4M3's half step (2^-4 relative, or 2^-10 of the scale near zero) of the
// input; each block's largest value lands in (224, 448]; a NaN spoils only its block.
TEST(Fp8, QuantizeRowsKeepsEachBlockWithinHalfAStep) {
  const int64_t R = 5, C = 200;
  Buffer x = random_matrix({R, C}, 1);
  x.ptr<float>()[2 * C + 150] = std::numeric_limits<float>::quiet_NaN();
  Buffer q(DType::fp8_e4m3, Device::cpu, {R, C}), scales(DType::f32, Device::cpu, {2, R}), back(DType::f32, Device::cpu, {R, C});
  quantize_rows({q, scales}, x);
  dequantize_rows(back, {q, scales});
  for (int64_t r = 0; r < R; ++r)
    for (int64_t b = 0; b < 2; ++b) {
      const float scale = scales.ptr<float>()[b * R + r];
      if (r == 2 && b == 1) {
        EXPECT_TRUE(std::isnan(scale));
        continue;
      }
      float amax = 0;
      for (int64_t c = b * 128; c < std::min<int64_t>(C, (b + 1) * 128); ++c) {
        const float v = x.ptr<float>()[r * C + c], got = back.ptr<float>()[r * C + c];
        EXPECT_LE(std::fabs(got - v), std::max(std::fabs(v) / 16, scale / 1024)) << r << " " << c;
        amax = std::max(amax, std::fabs(v));
      }
      EXPECT_GT(amax / scale, 224.0f);
      EXPECT_LE(amax / scale, 448.0f);
    }
}

TEST(Fp8, QuantizeBlocksTransposedHoldsTheSameBytes) {
  const int64_t E = 2, O = 130, I = 260;
  Buffer w = random_matrix({E, O, I}, 2);
  Buffer q(DType::fp8_e4m3, Device::cpu, {E, O, I}), s(DType::f32, Device::cpu, {E, 2, 3});
  Buffer qt(DType::fp8_e4m3, Device::cpu, {E, I, O}), st(DType::f32, Device::cpu, {E, 3, 2});
  quantize_blocks({q, s}, {qt, st}, w);
  const auto* a = static_cast<const uint8_t*>(q.view().data);
  const auto* b = static_cast<const uint8_t*>(qt.view().data);
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t o = 0; o < O; ++o)
      for (int64_t i = 0; i < I; ++i) ASSERT_EQ(a[(e * O + o) * I + i], b[(e * I + i) * O + o]);
    for (int64_t ob = 0; ob < 2; ++ob)
      for (int64_t ib = 0; ib < 3; ++ib) EXPECT_EQ(s.ptr<float>()[(e * 2 + ob) * 3 + ib], st.ptr<float>()[(e * 3 + ib) * 2 + ob]);
  }
  Buffer back(DType::f32, Device::cpu, {E, O, I});
  dequantize_blocks(back, {q, s});
  for (int64_t i = 0; i < w.numel(); ++i) {
    const float v = w.ptr<float>()[i];
    EXPECT_LE(std::fabs(back.ptr<float>()[i] - v), std::max(std::fabs(v) / 16, 1e-3f)) << i;
  }
}

// The grouped GEMM of quantized operands against the unquantized one: E4M3's rounding of both
// operands leaves ~5% of a typical output (relative RMS), a wrong scale or block far more.
TEST(Fp8, GroupedLinearIsCloseToTheUnquantizedProduct) {
  const int64_t E = 3, N = 136, K = 300;
  const std::vector<int32_t> offsets = {0, 7, 7, 40};
  const int64_t R = offsets.back();
  Buffer x = random_matrix({R, K}, 3), w = random_matrix({E, N, K}, 4);
  Buffer xq(DType::fp8_e4m3, Device::cpu, {R, K}), xs(DType::f32, Device::cpu, {3, R});
  Buffer wq(DType::fp8_e4m3, Device::cpu, {E, N, K}), ws(DType::f32, Device::cpu, {E, 2, 3});
  quantize_rows({xq, xs}, x);
  quantize_blocks({wq, ws}, {}, w);
  Buffer y(DType::f32, Device::cpu, {R, N}), exact(DType::f32, Device::cpu, {R, N});
  const Tensor off(const_cast<int32_t*>(offsets.data()), DType::i32, Device::cpu, {E + 1});
  grouped_linear_fp8(y, {xq, xs}, {wq, ws}, off);
  grouped_linear_forward(exact, x, w, off);
  double error = 0, norm = 0;
  for (int64_t i = 0; i < y.numel(); ++i) {
    error += std::pow(double(y.ptr<float>()[i]) - exact.ptr<float>()[i], 2);
    norm += std::pow(double(exact.ptr<float>()[i]), 2);
  }
  EXPECT_LT(std::sqrt(error / norm), 0.08);
  EXPECT_GT(std::sqrt(error / norm), 0.001);  // it did quantize
}

TEST(Fp8, RejectsWrongShapesWithNames) {
  Buffer x(DType::f32, Device::cpu, {4, 130});
  Buffer q(DType::fp8_e4m3, Device::cpu, {4, 130}), scales(DType::f32, Device::cpu, {1, 4});
  try {
    quantize_rows({q, scales}, x);
    FAIL();
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "quantize_rows: scales has shape [1, 4] but expected [2, 4]");
  }
  Buffer wrong(DType::bf16, Device::cpu, {4, 130});
  EXPECT_THROW(quantize_rows({wrong, Buffer(DType::f32, Device::cpu, {2, 4})}, x), Error);
}

}  // namespace
}  // namespace marrow
