// ops/muon.h against a direct f64 implementation written here (plain loops, the transposed problem
// for tall matrices, as the published reference computes it), and the properties that make the
// iteration useful: singular values pushed near 1, the transpose's result the result's transpose.
#include "ops/muon.h"

#include <cmath>
#include <vector>

#include "core/errors.h"
#include "core/json.h"
#include "core/split_f32.h"
#include "gradcheck.h"
#include "models/deepseek_v2.h"
#include "models/gpt_oss.h"
#include "models/qwen3_moe.h"
#include "ops/cast.h"

namespace marrow {
namespace {

using testing::random_buffer;
using Matrix = std::vector<double>;  // row-major

Matrix multiply(const Matrix& a, const Matrix& b, int64_t n, int64_t k, int64_t m) {  // [n, k] x [k, m]
  Matrix c(size_t(n * m), 0.0);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t p = 0; p < k; ++p)
      for (int64_t j = 0; j < m; ++j) c[size_t(i * m + j)] += a[size_t(i * k + p)] * b[size_t(p * m + j)];
  return c;
}
Matrix transpose(const Matrix& a, int64_t rows, int64_t cols) {
  Matrix t(a.size());
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) t[size_t(j * rows + i)] = a[size_t(i * cols + j)];
  return t;
}

// The reference: X = G / (||G|| + 1e-7) on the wide orientation, X = aX + (bA + cAA) X.
Matrix reference(const Tensor& g, int steps) {
  int64_t rows = g.size(0), cols = g.size(1);
  Matrix x(g.ptr<double>(), g.ptr<double>() + g.numel());
  const bool tall = rows > cols;
  if (tall) {
    x = transpose(x, rows, cols);
    std::swap(rows, cols);
  }
  double norm = 0;
  for (double v : x) norm += v * v;
  for (double& v : x) v /= std::sqrt(norm) + 1e-7;
  for (int s = 0; s < steps; ++s) {
    const Matrix a = multiply(x, transpose(x, rows, cols), rows, cols, rows), aa = multiply(a, a, rows, rows, rows);
    Matrix b(a.size());
    for (size_t i = 0; i < a.size(); ++i) b[i] = kMuonB * a[i] + kMuonC * aa[i];
    const Matrix bx = multiply(b, x, rows, rows, cols);
    for (size_t i = 0; i < x.size(); ++i) x[i] = kMuonA * x[i] + bx[i];
  }
  return tall ? transpose(x, rows, cols) : x;
}

TEST(Muon, MomentumIsNesterovsTwoLerps) {
  Buffer update(DType::f64, Device::cpu, {7}), momentum = random_buffer(DType::f64, {7}, 1), grad = random_buffer(DType::f64, {7}, 2);
  const Matrix m0(momentum.ptr<double>(), momentum.ptr<double>() + 7);
  muon_momentum(update, momentum, grad, 0.95);
  for (int i = 0; i < 7; ++i) {
    const double m = 0.95 * m0[size_t(i)] + 0.05 * grad.ptr<double>()[i];
    EXPECT_DOUBLE_EQ(momentum.ptr<double>()[i], m) << i;
    EXPECT_DOUBLE_EQ(update.ptr<double>()[i], 0.05 * grad.ptr<double>()[i] + 0.95 * m) << i;
  }
}

TEST(Muon, MomentumScalesTheGradientFirst) {
  Buffer update(DType::f64, Device::cpu, {5}), momentum = random_buffer(DType::f64, {5}, 1), grad = random_buffer(DType::f64, {5}, 2);
  const Matrix m0(momentum.ptr<double>(), momentum.ptr<double>() + 5);
  muon_momentum(update, momentum, grad, 0.9, 0.25);
  for (int i = 0; i < 5; ++i) {
    const double g = 0.25 * grad.ptr<double>()[i], m = 0.9 * m0[size_t(i)] + 0.1 * g;
    EXPECT_DOUBLE_EQ(momentum.ptr<double>()[i], m) << i;
    EXPECT_DOUBLE_EQ(update.ptr<double>()[i], 0.1 * g + 0.9 * m) << i;
  }
}

// [B, R, C] orthogonalizes each matrix on its own: the bits of B separate calls.
TEST(Muon, NewtonSchulzOfABatchIsEachMatrixAlone) {
  for (const auto [rows, cols] : {std::pair{6L, 10L}, std::pair{10L, 6L}}) {
    const Buffer g = random_buffer(DType::f32, {3, rows, cols}, 6);
    Buffer out(DType::f32, Device::cpu, {3, rows, cols}), one(DType::f32, Device::cpu, {rows, cols});
    newton_schulz(out, g, 5);
    for (int64_t b = 0; b < 3; ++b) {
      newton_schulz(one, g.view().rows(b, b + 1).reshape({rows, cols}), 5);
      for (int64_t i = 0; i < rows * cols; ++i) ASSERT_EQ(out.ptr<float>()[b * rows * cols + i], one.ptr<float>()[i]) << b << " at " << i;
    }
  }
}

// p (1 - lr wd) - lr (scale o), each product rounded in f32, for an fp32 master (with its bf16 copy)
// and for the same values kept split.
TEST(Muon, ApplyDecaysThenStepsTheMasterWeights) {
  const Buffer p0 = random_buffer(DType::f32, {33}, 7), orth = random_buffer(DType::f32, {33}, 8);
  Buffer p(DType::f32, Device::cpu, {33}), copy(DType::f32, Device::cpu, {33}), high(DType::bf16, Device::cpu, {33});
  Buffer low(DType::u16, Device::cpu, {33}), halves(DType::bf16, Device::cpu, {33}), joined(DType::f32, Device::cpu, {33});
  std::copy(p0.ptr<float>(), p0.ptr<float>() + 33, p.ptr<float>());
  split_f32(halves, low, p0);
  muon_apply(p, high, orth, 0.02, 0.1, 1.6);
  muon_apply(low, halves, orth, 0.02, 0.1, 1.6);
  join_f32(joined, halves, low);
  for (int64_t i = 0; i < 33; ++i) {
    const float kept = p0.ptr<float>()[i] * float(1 - 0.02 * 0.1), step = 0.02f * (1.6f * orth.ptr<float>()[i]);
    EXPECT_EQ(p.ptr<float>()[i], kept - step) << i;
    EXPECT_EQ(static_cast<uint16_t*>(high.view().data)[i], split_high(float_bits(kept - step))) << i;
    EXPECT_EQ(float_bits(joined.ptr<float>()[i]), split_storable(float_bits(kept - step))) << i;
  }
  EXPECT_THROW(muon_apply(low, Tensor{}, orth, 0.02, 0.1, 1.6), Error);
  EXPECT_THROW(muon_apply(p, Tensor{}, orth.view().rows(0, 32), 0.02, 0.1, 1.6), Error);
}

// Muon takes each family's hidden matrices (GPT-OSS's fused experts as [E, rows, cols]); the embeddings,
// the LM head, the router, norms, biases and sinks stay with AdamW.
TEST(Muon, EachFamilyOrthogonalizesItsHiddenMatricesOnly) {
  const std::string dir = MARROW_SOURCE_DIR "/configs/";
  const Qwen3Moe qwen(Qwen3MoeConfig::from_json(read_json_file(dir + "tiny-moe.json"), "tiny-moe.json"), DType::f32, Device::cpu);
  const GptOss gpt(GptOssConfig::from_json(read_json_file(dir + "tiny-gpt-oss.json"), "tiny-gpt-oss.json"), DType::f32, Device::cpu);
  const DeepseekV2 deepseek(DeepseekV2Config::from_json(read_json_file(dir + "tiny-deepseek-v2.json"), "tiny-deepseek-v2.json"), DType::f32,
                            Device::cpu);
  for (const std::vector<TensorSpec>* specs : {&qwen.specs(), &gpt.specs(), &deepseek.specs()}) {
    int64_t matrices = 0;
    for (const TensorSpec& s : *specs) {
      const bool table = s.name.ends_with("embed_tokens.weight") || s.name == "lm_head.weight" || s.name.ends_with("mlp.gate.weight") ||
                         s.name.ends_with("mlp.router.weight");
      const bool want = !table && s.decayed && s.shape.size() >= 2;
      EXPECT_EQ(s.orthogonalized, want) << s.name;
      EXPECT_TRUE(!table || s.decayed) << s.name;
      matrices += s.orthogonalized;
    }
    EXPECT_GT(matrices, 6);
  }
}

TEST(Muon, NewtonSchulzMatchesTheDirectIterationWideAndTall) {
  for (const auto [rows, cols] : {std::pair{6L, 10L}, std::pair{10L, 6L}, std::pair{5L, 5L}})
    for (const int steps : {0, 1, 5}) {
      const Buffer g = random_buffer(DType::f64, {rows, cols}, 3);
      Buffer out(DType::f64, Device::cpu, {rows, cols});
      newton_schulz(out, g, steps);
      const Matrix want = reference(g, steps);
      for (int64_t i = 0; i < rows * cols; ++i)
        EXPECT_NEAR(out.ptr<double>()[i], want[size_t(i)], 1e-12) << rows << "x" << cols << " steps " << steps << " at " << i;
    }
}

// Five steps leave every singular value of a random matrix in about [0.6, 1.25]: the eigenvalues of
// X X^T, bounded by power iteration from above and, on the inverse side, by its trace and the top one.
TEST(Muon, FiveStepsPushTheSingularValuesNearOne) {
  const int64_t rows = 12, cols = 40;
  const Buffer g = random_buffer(DType::f64, {rows, cols}, 4);
  Buffer out(DType::f64, Device::cpu, {rows, cols});
  newton_schulz(out, g, 5);
  const Matrix x(out.ptr<double>(), out.ptr<double>() + rows * cols), gram = multiply(x, transpose(x, rows, cols), rows, cols, rows);
  Matrix v(size_t(rows), 1.0);
  double top = 0;
  for (int it = 0; it < 200; ++it) {
    v = multiply(gram, v, rows, rows, 1);
    double n = 0;
    for (double e : v) n += e * e;
    top = std::sqrt(n);
    for (double& e : v) e /= top;
  }
  double trace = 0;
  for (int64_t i = 0; i < rows; ++i) trace += gram[size_t(i * rows + i)];
  EXPECT_LT(std::sqrt(top), 1.25);
  EXPECT_GT(trace / double(rows), 0.6 * 0.6);  // the mean squared singular value
}

TEST(Muon, TheTransposeGivesTheTransposedResult) {
  const Buffer g = random_buffer(DType::f32, {9, 4}, 5);
  Buffer gt(DType::f32, Device::cpu, {4, 9}), out(DType::f32, Device::cpu, {9, 4}), out_t(DType::f32, Device::cpu, {4, 9});
  for (int64_t i = 0; i < 9; ++i)
    for (int64_t j = 0; j < 4; ++j) gt.ptr<float>()[j * 9 + i] = g.ptr<float>()[i * 4 + j];
  newton_schulz(out, g, 5);
  newton_schulz(out_t, gt, 5);
  for (int64_t i = 0; i < 9; ++i)
    for (int64_t j = 0; j < 4; ++j) EXPECT_NEAR(out_t.ptr<float>()[j * 9 + i], out.ptr<float>()[i * 4 + j], 1e-5) << i << "," << j;
}

TEST(Muon, BadInputsGiveOneSentence) {
  Buffer g(DType::f32, Device::cpu, {3, 4}), wrong(DType::f32, Device::cpu, {4, 3}), v(DType::f32, Device::cpu, {12});
  EXPECT_THROW(newton_schulz(wrong, g), Error);
  EXPECT_THROW(newton_schulz(v, v), Error);
  EXPECT_THROW(newton_schulz(g, g, -1), Error);
  EXPECT_THROW(muon_momentum(v, v, g.view().reshape({12}), 1.0), Error);
  EXPECT_THROW(muon_momentum(v, Buffer(DType::f32, Device::cpu, {5}), v, 0.9), Error);
}

}  // namespace
}  // namespace marrow
