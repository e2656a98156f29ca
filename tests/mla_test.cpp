#include "ops/mla.h"

#include <cmath>
#include <complex>
#include <vector>

#include "gradcheck.h"

namespace marrow {
namespace {

using testing::element;
using testing::random_buffer;

Tensor positions_tensor(std::vector<int32_t>& p) { return Tensor(p.data(), DType::i32, Device::cpu, {int64_t(p.size())}); }

// DeepSeek-V2's rope_parameters (theta 10000, YaRN factor 40 over 4096 positions), with
// attention_factor 0: Hugging Face's default 0.1 ln 40 + 1, so that cos and sin are scaled. (The
// model passes DeepSeek's mscale / mscale_all_dim ratio there, 1 for DeepSeek-V2.)
RopeParameters deepseek_yarn() {
  RopeParameters rope;
  rope.theta = 10000.0;
  rope.yarn = true;
  rope.factor = 40.0;
  rope.beta_fast = 32.0;
  rope.beta_slow = 1.0;
  rope.original_max_positions = 4096;
  return rope;
}

// transformers' freqs_cis for pair j at position: torch.polar(1, angle) * attention_scaling, the
// angle and both products in float32.
std::complex<double> freq_cis(int32_t position, int64_t j, int64_t dr, const RopeParameters& rope) {
  const float angle = float(position) * rope_inverse_frequencies(dr, rope)[j], scale = float(rope_attention_scaling(rope));
  return {double(std::cos(angle) * scale), double(std::sin(angle) * scale)};
}

// x's pairs (2j, 2j + 1) as complex numbers times freq_cis, as apply_rotary_emb computes them, times scale.
void expect_rotated(const double* y, const double* x, int32_t position, int64_t dr, const RopeParameters& rope, double scale,
                    const char* what) {
  for (int64_t j = 0; j < dr / 2; ++j) {
    const std::complex<double> want = std::complex<double>(x[2 * j], x[2 * j + 1]) * freq_cis(position, j, dr, rope) * scale;
    EXPECT_NEAR(y[2 * j], want.real(), 1e-12 * (1 + std::abs(want))) << what << " pair " << j;
    EXPECT_NEAR(y[2 * j + 1], want.imag(), 1e-12 * (1 + std::abs(want))) << what << " pair " << j;
  }
}

struct QueryCase {
  std::vector<int32_t> pos;
  int64_t heads, dn, dr;
  double scale;
  bool yarn;
};

const std::vector<QueryCase>& query_cases() {
  static const std::vector<QueryCase> cases = {
      {{0, 5, 17}, 1, 6, 4, 1.0, false}, {{3, 4095, 4096, 20000, 131071}, 3, 16, 64, 0.37, true}, {{7}, 3, 0, 4, 2.5, true}};
  return cases;
}

RopeParameters rope_of(bool yarn) { return yarn ? deepseek_yarn() : RopeParameters{}; }

TEST(MlaQuery, MatchesTheComplexProductAndScalesTheNopePart) {
  for (QueryCase c : query_cases()) {
    const int64_t t = int64_t(c.pos.size()), d = c.dn + c.dr;
    SCOPED_TRACE(::testing::Message() << "T=" << t << " H=" << c.heads << " Dn=" << c.dn << " Dr=" << c.dr);
    Buffer q = random_buffer(DType::f64, {t, c.heads, d}, 1), out(DType::f64, Device::cpu, {t, c.heads, d});
    mla_query_forward(out, q, positions_tensor(c.pos), c.dr, rope_of(c.yarn), c.scale);
    for (int64_t row = 0; row < t * c.heads; ++row) {
      const double *x = q.ptr<double>() + row * d, *y = out.ptr<double>() + row * d;
      for (int64_t i = 0; i < c.dn; ++i) EXPECT_NEAR(y[i], c.scale * x[i], 1e-15 * std::abs(y[i])) << "row " << row << " nope " << i;
      expect_rotated(y + c.dn, x + c.dn, c.pos[row / c.heads], c.dr, rope_of(c.yarn), c.scale, "query");
    }
  }
}

// With its pairs laid out as rotate_half's halves, the interleaved rotation is rope_forward's, bit
// for bit: the same angles, cos and sin and attention scaling (ops/rope.h, held to transformers).
TEST(MlaQuery, IsRopeForwardOnInterleavedPairs) {
  const int64_t t = 4, h = 2, dr = 64;
  std::vector<int32_t> pos = {0, 1, 4097, 131071};
  Buffer q = random_buffer(DType::f32, {t, h, dr}, 3), out(DType::f32, Device::cpu, {t, h, dr});
  Buffer halves(DType::f32, Device::cpu, {t, h, dr}), rotated(DType::f32, Device::cpu, {t, h, dr});
  for (int64_t row = 0; row < t * h; ++row)
    for (int64_t j = 0; j < dr / 2; ++j) {
      halves.ptr<float>()[row * dr + j] = q.ptr<float>()[row * dr + 2 * j];
      halves.ptr<float>()[row * dr + dr / 2 + j] = q.ptr<float>()[row * dr + 2 * j + 1];
    }
  for (bool yarn : {false, true}) {
    mla_query_forward(out, q, positions_tensor(pos), dr, rope_of(yarn), 1.0);
    rope_forward(rotated, halves, positions_tensor(pos), rope_of(yarn));
    for (int64_t row = 0; row < t * h; ++row)
      for (int64_t j = 0; j < dr / 2; ++j) {
        ASSERT_EQ(out.ptr<float>()[row * dr + 2 * j], rotated.ptr<float>()[row * dr + j]) << yarn << " row " << row << " pair " << j;
        ASSERT_EQ(out.ptr<float>()[row * dr + 2 * j + 1], rotated.ptr<float>()[row * dr + dr / 2 + j]) << yarn << " row " << row << " pair " << j;
      }
  }
}

TEST(MlaQuery, GradientsMatchFiniteDifferences) {
  for (QueryCase c : query_cases()) {
    const int64_t t = int64_t(c.pos.size()), d = c.dn + c.dr;
    SCOPED_TRACE(::testing::Message() << "T=" << t << " H=" << c.heads << " Dn=" << c.dn << " Dr=" << c.dr);
    Buffer q = random_buffer(DType::f64, {t, c.heads, d}, 1), r = random_buffer(DType::f64, {t, c.heads, d}, 2);
    Buffer out(DType::f64, Device::cpu, {t, c.heads, d}), dq(DType::f64, Device::cpu, {t, c.heads, d});
    auto loss = [&] {
      mla_query_forward(out, q, positions_tensor(c.pos), c.dr, rope_of(c.yarn), c.scale);
      return testing::weighted_sum(out, r);
    };
    mla_query_backward(dq, r, positions_tensor(c.pos), c.dr, rope_of(c.yarn), c.scale);
    testing::expect_gradient("dq", q, dq, loss);
  }
}

TEST(MlaQuery, InPlaceMatchesOutOfPlace) {
  std::vector<int32_t> pos = {9, 0, 300};
  Buffer q = random_buffer(DType::f64, {3, 2, 12}, 4), out(DType::f64, Device::cpu, {3, 2, 12}), inplace = random_buffer(DType::f64, {3, 2, 12}, 4);
  for (bool backward : {false, true}) {
    if (backward) {
      mla_query_backward(out, q, positions_tensor(pos), 8, deepseek_yarn(), 0.7);
      mla_query_backward(inplace, inplace, positions_tensor(pos), 8, deepseek_yarn(), 0.7);
    } else {
      mla_query_forward(out, q, positions_tensor(pos), 8, deepseek_yarn(), 0.7);
      mla_query_forward(inplace, inplace, positions_tensor(pos), 8, deepseek_yarn(), 0.7);
    }
    for (int64_t i = 0; i < q.numel(); ++i) ASSERT_EQ(element(inplace, i), element(out, i)) << backward << " " << i;
    copy(inplace, out);
    copy(q, out);
  }
}

struct KeyValueCase {
  std::vector<int32_t> pos;
  int64_t heads, dn, dr, dv;
  bool yarn;
};

const std::vector<KeyValueCase>& key_value_cases() {
  static const std::vector<KeyValueCase> cases = {
      {{0, 5, 17}, 1, 2, 4, 3, false}, {{3, 4095, 4096, 20000, 131071}, 3, 8, 64, 8, true}, {{7, 2, 1}, 3, 0, 4, 5, true}};
  return cases;
}

TEST(MlaKeyValue, SplitsKvAndRotatesTheSharedKeyForEveryHead) {
  for (KeyValueCase c : key_value_cases()) {
    const int64_t t = int64_t(c.pos.size());
    SCOPED_TRACE(::testing::Message() << "T=" << t << " H=" << c.heads << " Dn=" << c.dn << " Dr=" << c.dr << " Dv=" << c.dv);
    Buffer kv = random_buffer(DType::f64, {t, c.heads, c.dn + c.dv}, 5), k_pe = random_buffer(DType::f64, {t, c.dr}, 6);
    Buffer k(DType::f64, Device::cpu, {t, c.heads, c.dn + c.dr}), v(DType::f64, Device::cpu, {t, c.heads, c.dv});
    mla_key_value_forward(k, v, kv, k_pe, positions_tensor(c.pos), rope_of(c.yarn));
    for (int64_t row = 0; row < t * c.heads; ++row) {
      const double *in = kv.ptr<double>() + row * (c.dn + c.dv), *key = k.ptr<double>() + row * (c.dn + c.dr);
      for (int64_t i = 0; i < c.dn; ++i) ASSERT_EQ(key[i], in[i]) << "row " << row << " k_nope " << i;
      for (int64_t i = 0; i < c.dv; ++i) ASSERT_EQ(v.ptr<double>()[row * c.dv + i], in[c.dn + i]) << "row " << row << " v " << i;
      expect_rotated(key + c.dn, k_pe.ptr<double>() + row / c.heads * c.dr, c.pos[row / c.heads], c.dr, rope_of(c.yarn), 1.0, "key");
    }
  }
}

TEST(MlaKeyValue, GradientsMatchFiniteDifferences) {
  for (KeyValueCase c : key_value_cases()) {
    const int64_t t = int64_t(c.pos.size());
    SCOPED_TRACE(::testing::Message() << "T=" << t << " H=" << c.heads << " Dn=" << c.dn << " Dr=" << c.dr << " Dv=" << c.dv);
    Buffer kv = random_buffer(DType::f64, {t, c.heads, c.dn + c.dv}, 5), k_pe = random_buffer(DType::f64, {t, c.dr}, 6);
    Buffer rk = random_buffer(DType::f64, {t, c.heads, c.dn + c.dr}, 7), rv = random_buffer(DType::f64, {t, c.heads, c.dv}, 8);
    Buffer k(DType::f64, Device::cpu, {t, c.heads, c.dn + c.dr}), v(DType::f64, Device::cpu, {t, c.heads, c.dv});
    Buffer dkv(DType::f64, Device::cpu, {t, c.heads, c.dn + c.dv}), dk_pe(DType::f64, Device::cpu, {t, c.dr});
    auto loss = [&] {
      mla_key_value_forward(k, v, kv, k_pe, positions_tensor(c.pos), rope_of(c.yarn));
      return testing::weighted_sum(k, rk) + testing::weighted_sum(v, rv);
    };
    mla_key_value_backward(dkv, dk_pe, rk, rv, positions_tensor(c.pos), rope_of(c.yarn));
    testing::expect_gradient("dkv", kv, dkv, loss);
    testing::expect_gradient("dk_pe", k_pe, dk_pe, loss);
  }
}

TEST(Mla, F32MatchesF64) {
  std::vector<int32_t> pos = {0, 1, 4095, 32767, 131071};
  const int64_t t = 5, h = 3, dn = 8, dr = 64, dv = 8;
  Buffer out[2], dq[2], k[2], v[2], dkv[2], dk_pe[2];
  for (int s = 0; s < 2; ++s) {
    const DType dtype = s ? DType::f32 : DType::f64;
    Buffer q = random_buffer(dtype, {t, h, dn + dr}, 1), kv = random_buffer(dtype, {t, h, dn + dv}, 2), k_pe = random_buffer(dtype, {t, dr}, 3);
    out[s] = Buffer(dtype, Device::cpu, {t, h, dn + dr}), dq[s] = Buffer(dtype, Device::cpu, {t, h, dn + dr});
    k[s] = Buffer(dtype, Device::cpu, {t, h, dn + dr}), v[s] = Buffer(dtype, Device::cpu, {t, h, dv});
    dkv[s] = Buffer(dtype, Device::cpu, {t, h, dn + dv}), dk_pe[s] = Buffer(dtype, Device::cpu, {t, dr});
    mla_query_forward(out[s], q, positions_tensor(pos), dr, deepseek_yarn(), 0.5);
    mla_query_backward(dq[s], q, positions_tensor(pos), dr, deepseek_yarn(), 0.5);
    mla_key_value_forward(k[s], v[s], kv, k_pe, positions_tensor(pos), deepseek_yarn());
    mla_key_value_backward(dkv[s], dk_pe[s], k[s], v[s], positions_tensor(pos), deepseek_yarn());
  }
  for (Buffer* b : {out, dq, k, v, dkv, dk_pe})
    for (int64_t i = 0; i < b[0].numel(); ++i) ASSERT_NEAR(element(b[1], i), element(b[0], i), 1e-5 * (1 + std::abs(element(b[0], i)))) << i;
}

template <class Call>
void expect_error(const Call& call, const char* message) {
  try {
    call();
    FAIL() << "expected an error: " << message;
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), message);
  }
}

TEST(Mla, RejectsBadShapesAndGpuDtypes) {
  std::vector<int32_t> pos = {0, 1};
  Buffer q(DType::f32, Device::cpu, {2, 3, 10}), k(DType::f32, Device::cpu, {2, 3, 10}), v(DType::f32, Device::cpu, {2, 3, 4});
  Buffer kv(DType::f32, Device::cpu, {2, 3, 9}), k_pe(DType::f32, Device::cpu, {2, 4});
  expect_error([&] { mla_query_forward(q, q, positions_tensor(pos), 3, RopeParameters{}, 1.0); },
               "mla_query_forward: rope_dim must be even and in [2, 10] (q's last dimension), got 3");
  expect_error([&] { mla_key_value_forward(k, v, kv, k_pe, positions_tensor(pos), RopeParameters{}); },
               "mla_key_value_forward: kv has shape [2, 3, 9] but expected [2, 3, 10]");
  expect_error([&] { mla_key_value_backward(kv, k_pe, k, v, positions_tensor(pos), RopeParameters{}); },
               "mla_key_value_backward: dkv has shape [2, 3, 9] but expected [2, 3, 10]");
  Buffer short_pe(DType::f32, Device::cpu, {2, 12});
  expect_error([&] { mla_key_value_forward(k, v, kv, short_pe, positions_tensor(pos), RopeParameters{}); },
               "mla_key_value_forward: k's last dimension 10 is smaller than k_pe's rope dimension 12");
  // The checks come before anything reads the data, so a host pointer stands in for GPU memory.
  Tensor on_gpu(q.ptr<float>(), DType::f32, Device::cuda, {2, 3, 10});
  int32_t gpu_positions[2] = {0, 1};
  expect_error([&] { mla_query_backward(on_gpu, on_gpu, Tensor(gpu_positions, DType::i32, Device::cuda, {2}), 4, RopeParameters{}, 1.0); },
               "mla_query_backward: dq_out has dtype f32 but expected bf16");
}

}  // namespace
}  // namespace marrow
