// Split master weights (core/split_f32.h, train.master_weights = "split"): the halves' arithmetic,
// the ops that split and join them, AdamW on them, and ShardedParameters keeping them, each against
// the fp32 master they stand for.
#include "core/split_f32.h"

#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "core/bf16.h"
#include "core/memory.h"
#include "gradcheck.h"
#include "ops/adamw.h"
#include "ops/cast.h"
#include "parallel/sharded_params.h"
#include "sharded_table.h"

namespace marrow {
namespace {

using testing::random_buffer;

// Every top half (sign, exponent, 7 mantissa bits) with low halves around the rounding boundary and
// at its ends: the high half is the value's bf16 rounding, and joining gives the value back, except
// the one kind of midpoint, which comes back one unit higher.
TEST(SplitF32, HalvesGiveTheValueBackAndTheHighHalfIsItsBf16) {
  const uint32_t lows[] = {0x0000, 0x0001, 0x1234, 0x7fff, 0x8000, 0x8001, 0xabcd, 0xfffe, 0xffff};
  int64_t moved = 0;
  for (uint32_t top = 0; top < 0x10000; ++top) {
    if ((top & 0x7f80) == 0x7f80) continue;  // infinities and NaN: never master weights
    for (uint32_t low : lows) {
      const uint32_t bits = top << 16 | low;
      uint16_t high = 0, rest = 0;
      split_bits(bits, high, rest);
      const bool midpoint_above_odd = low == 0x8000 && (top & 1);
      ASSERT_EQ(split_join(high, rest), midpoint_above_odd ? bits + 1 : bits) << std::hex << bits;
      if (top == 0x7f7f && low > 0x8000) continue;  // rounds to infinity
      ASSERT_EQ(high, float_to_bf16(bits_float(bits))) << std::hex << bits;
      moved += midpoint_above_odd;
    }
  }
  EXPECT_EQ(moved, 0x7f80);  // one per odd top half that is finite
}

TEST(SplitF32, OpsSplitAndJoinTensors) {
  const int64_t n = 1001;
  Buffer value = random_buffer(DType::f32, {n}, 3), high(DType::bf16, Device::cpu, {n}), low(DType::u16, Device::cpu, {n}),
         back(DType::f32, Device::cpu, {n});
  static_cast<uint32_t*>(value.view().data)[5] = 0x3f818000u;  // a midpoint above an odd bf16
  split_f32(high, low, value);
  join_f32(back, high, low);
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = float_bits(value.ptr<float>()[i]);
    EXPECT_EQ(float_bits(back.ptr<float>()[i]), split_storable(bits)) << i;
    EXPECT_EQ(static_cast<const uint16_t*>(high.view().data)[i], float_to_bf16(value.ptr<float>()[i])) << i;
  }
  EXPECT_EQ(float_bits(back.ptr<float>()[5]), 0x3f818001u);
  Buffer wrong(DType::bf16, Device::cpu, {n});
  try {
    split_f32(high, wrong, value);
    FAIL();
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "split_f32: low has dtype bf16 but expected u16");
  }
}

// AdamW on split weights computes on the fp32 value they hold: the high halves are the bf16 copy the
// fp32 master's step writes, the joined value its updated master (as stored), over several steps.
TEST(SplitF32, AdamWOnSplitWeightsFollowsTheFp32Master) {
  const int64_t n = 4097;
  for (DType moments : {DType::f32, DType::bf16}) {
    Buffer master = random_buffer(DType::f32, {n}, 7), copy(DType::bf16, Device::cpu, {n});
    Buffer high(DType::bf16, Device::cpu, {n}), low(DType::u16, Device::cpu, {n});
    split_f32(high, low, master);
    join_f32(master, high, low);  // the fp32 master starts from the stored values too
    Buffer m1 = Buffer::zeros(moments, Device::cpu, {n}), v1 = Buffer::zeros(moments, Device::cpu, {n});
    Buffer m2 = Buffer::zeros(moments, Device::cpu, {n}), v2 = Buffer::zeros(moments, Device::cpu, {n});
    for (int64_t step = 1; step <= 4; ++step) {
      Buffer grad = random_buffer(DType::f32, {n}, 20 + step);
      AdamWHyper hp{.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1, .step = step};
      adamw_step(master, copy, m1, v1, grad, hp);
      adamw_step(low, high, m2, v2, grad, hp);
      Buffer joined(DType::f32, Device::cpu, {n});
      join_f32(joined, high, low);
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_EQ(static_cast<const uint16_t*>(high.view().data)[i], static_cast<const uint16_t*>(copy.view().data)[i]) << step << " " << i;
        ASSERT_EQ(float_bits(joined.ptr<float>()[i]), split_storable(float_bits(master.ptr<float>()[i]))) << step << " " << i;
      }
      join_f32(master, high, low);  // as stored, so the two stay comparable bit for bit
    }
    EXPECT_EQ(std::memcmp(m1.view().data, m2.view().data, m1.view().bytes()), 0);
  }
  Buffer low(DType::u16, Device::cpu, {4}), m = Buffer::zeros(DType::f32, Device::cpu, {4}), v = Buffer::zeros(DType::f32, Device::cpu, {4}),
         g = Buffer::zeros(DType::f32, Device::cpu, {4});
  try {
    adamw_step(low, Tensor{}, m, v, g, AdamWHyper{.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0, .step = 1});
    FAIL();
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "adamw_step: param is u16 (the low halves of split master weights) but param_bf16, their high halves, is missing");
  }
}

std::vector<uint16_t> host_bits(Tensor t) {
  std::vector<uint16_t> out(size_t(t.numel()));
  std::memcpy(out.data(), t.data, t.bytes());
  return out;
}

// ShardedParameters with the split master (bf16 compute, here on the CPU) against the fp32 master:
// the same bf16 weights after initialisation and after each optimizer step, the same master as
// stored (unpack_master), and the staging arena (the gradients) zero again after each use.
TEST(SplitF32, ShardedParametersKeepTheSameWeightsAsAnFp32Master) {
  const std::vector<TensorSpec> specs = testing::sharded_table();
  const Mesh mesh = Mesh::create(MeshShape{}, Device::cpu);
  const std::vector<int64_t> stages(4, 0);
  ShardedParameters whole(specs, 2, stages, mesh, false, false, false, Device::cpu, DType::bf16, DType::f32, false);
  ShardedParameters split(specs, 2, stages, mesh, false, false, false, Device::cpu, DType::bf16, DType::f32, true);
  ASSERT_TRUE(split.split_master());
  ASSERT_FALSE(whole.split_master());
  EXPECT_EQ(split.params().all().dtype, DType::u16);
  auto init = [](Tensor out, const TensorSpec& spec, int64_t first) {
    const Buffer values = random_buffer(DType::f32, {spec.numel}, uint64_t(spec.offset));
    copy(out, values.view().rows(first, first + out.numel()));
  };
  for (ShardedParameters* s : {&whole, &split}) {
    s->initialize(init);
    s->master_changed();
  }
  const int64_t total = specs.back().offset + specs.back().numel;
  auto weights_of = [&](const ShardedParameters& s) {
    std::vector<uint16_t> all;
    for (const TensorSpec& spec : specs)
      for (uint16_t b : host_bits(s.weights().slice(spec.offset, {spec.numel}))) all.push_back(b);
    return all;
  };
  auto zero_grads = [](const ShardedParameters& s) {
    const Tensor g = s.grads().all();
    for (int64_t i = 0; i < g.numel(); ++i)
      if (g.ptr<float>()[i] != 0.0f) return false;
    return true;
  };
  EXPECT_EQ(weights_of(split), weights_of(whole));
  EXPECT_TRUE(zero_grads(split));
  for (int64_t step = 1; step <= 3; ++step) {
    const Buffer grad = random_buffer(DType::f32, {total}, 100 + step);
    for (ShardedParameters* s : {&whole, &split}) {
      s->start_step();
      copy(s->grads().all(), grad.view().rows(0, s->grads().all().numel()));
      s->optimizer_step(AdamWHyper{.lr = 1e-2, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1, .step = step});
    }
    ASSERT_EQ(weights_of(split), weights_of(whole)) << "step " << step;
    split.unpack_master();
    const Tensor stored = split.master_staging().all(), master = whole.params().all();
    for (int64_t i = 0; i < master.numel(); ++i)
      ASSERT_EQ(float_bits(stored.ptr<float>()[i]), split_storable(float_bits(master.ptr<float>()[i]))) << "step " << step << " " << i;
    copy(master, stored);  // both as stored: no midpoint drift between the two
    split.release_master_staging();
    EXPECT_TRUE(zero_grads(split));
  }
}

}  // namespace
}  // namespace marrow
