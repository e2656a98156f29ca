#include "ops/attention.h"
#include "ops/attention_cudnn.h"

#include <omp.h>

#include <cmath>
#include <memory>
#include <string>

#include "gradcheck.h"

namespace marrow {
namespace {

using testing::element;
using testing::random_buffer;

// d: q's and k's head dim; dv: v's and out's (0: d).
struct Shape {
  int64_t b, s, hq, hkv, d, dv = 0;
  int64_t vd() const { return dv ? dv : d; }
};

struct Attn {
  Buffer q, k, v, out, lse, dq, dk, dv, dout;
  // Random inputs of dtype t; seeds do not depend on t, so the f32 and f64 runs see the same values.
  Attn(DType t, Shape n)
      : q(random_buffer(t, {n.b, n.s, n.hq, n.d}, 1)),
        k(random_buffer(t, {n.b, n.s, n.hkv, n.d}, 2)),
        v(random_buffer(t, {n.b, n.s, n.hkv, n.vd()}, 3)),
        out(t, Device::cpu, {n.b, n.s, n.hq, n.vd()}),
        lse(t, Device::cpu, {n.b, n.hq, n.s}),
        dq(t, Device::cpu, {n.b, n.s, n.hq, n.d}),
        dk(t, Device::cpu, {n.b, n.s, n.hkv, n.d}),
        dv(t, Device::cpu, {n.b, n.s, n.hkv, n.vd()}),
        dout(random_buffer(t, {n.b, n.s, n.hq, n.vd()}, 4)) {}
  void forward() { attention_forward(out, lse, q, k, v); }
  void backward() { attention_backward(dq, dk, dv, dout, q, k, v, out, lse); }
  void forward(const AttentionVariant& variant) { attention_forward(out, lse, q, k, v, variant); }
  void backward(const AttentionVariant& variant, Tensor dsinks) {
    attention_backward(dq, dk, dv, dsinks, dout, q, k, v, out, lse, variant);
  }
};

TEST(Attention, SingleTokenReturnsItsValue) {
  // Eight query heads share one key/value head: every head attends only to token 0 and returns v.
  const Shape n{2, 1, 8, 1, 5};
  Attn r(DType::f64, n);
  r.forward();
  for (int64_t b = 0; b < n.b; ++b)
    for (int64_t h = 0; h < n.hq; ++h) {
      double score = 0;
      for (int64_t e = 0; e < n.d; ++e) {
        EXPECT_NEAR(element(r.out, (b * n.hq + h) * n.d + e), element(r.v, b * n.d + e), 1e-15);
        score += element(r.q, (b * n.hq + h) * n.d + e) * element(r.k, b * n.d + e);
      }
      EXPECT_NEAR(element(r.lse, b * n.hq + h), score / std::sqrt(double(n.d)), 1e-14);
    }
}

// Zero queries make every allowed score 0: token i averages v_0 .. v_i and lse_i = log(i + 1).
TEST(Attention, ZeroQueriesAverageThePrefix) {
  const Shape n{1, 4, 2, 2, 3};
  Attn r(DType::f64, n);
  for (int64_t i = 0; i < r.q.numel(); ++i) r.q.ptr<double>()[i] = 0;
  r.forward();
  for (int64_t h = 0; h < n.hq; ++h)
    for (int64_t i = 0; i < n.s; ++i) {
      EXPECT_NEAR(element(r.lse, h * n.s + i), std::log(double(i + 1)), 1e-14);
      for (int64_t e = 0; e < n.d; ++e) {
        double mean = 0;
        for (int64_t j = 0; j <= i; ++j) mean += element(r.v, (j * n.hkv + h) * n.d + e) / double(i + 1);
        EXPECT_NEAR(element(r.out, (i * n.hq + h) * n.d + e), mean, 1e-14);
      }
    }
}

// v's head dim may differ from q's and k's (DeepSeek-V2's 192 / 128), and the scale stays 1/sqrt(D):
// S = 2, one key/value head for two query heads, each row's softmax written out.
TEST(Attention, ValueHeadDimKeepsTheQueryKeyScale) {
  const Shape n{1, 2, 2, 1, 6, 3};
  Attn r(DType::f64, n);
  r.forward();
  for (int64_t h = 0; h < n.hq; ++h)
    for (int64_t i = 0; i < n.s; ++i) {
      double w[2] = {0, 0}, sum = 0;
      for (int64_t j = 0; j <= i; ++j) {
        for (int64_t e = 0; e < n.d; ++e) w[j] += element(r.q, (i * n.hq + h) * n.d + e) * element(r.k, j * n.d + e);
        sum += w[j] = std::exp(w[j] / std::sqrt(double(n.d)));
      }
      EXPECT_NEAR(element(r.lse, h * n.s + i), std::log(sum), 1e-14);
      for (int64_t e = 0; e < n.dv; ++e) {
        double want = 0;
        for (int64_t j = 0; j <= i; ++j) want += w[j] / sum * element(r.v, j * n.dv + e);
        EXPECT_NEAR(element(r.out, (i * n.hq + h) * n.dv + e), want, 1e-14) << h << " " << i << " " << e;
      }
    }
}

TEST(Attention, LaterTokensDoNotChangeEarlierOutputs) {
  const Shape n{1, 5, 2, 1, 4};
  Attn r(DType::f64, n);
  r.forward();
  Buffer before(DType::f64, Device::cpu, {n.s * n.hq * n.d});
  for (int64_t i = 0; i < before.numel(); ++i) before.ptr<double>()[i] = element(r.out, i);
  for (int64_t e = 0; e < n.d; ++e) {
    r.k.ptr<double>()[(n.s - 1) * n.d + e] += 3;
    r.v.ptr<double>()[(n.s - 1) * n.d + e] -= 5;
  }
  r.forward();
  for (int64_t i = 0; i < (n.s - 1) * n.hq * n.d; ++i) EXPECT_EQ(element(r.out, i), element(before, i)) << i;
}

// Query head h reads key/value head h / (Hq / Hkv): the grouped run equals a run whose keys and values
// are repeated per query head (repeat_kv), and its dk, dv are the sums over each group.
TEST(Attention, GroupedHeadsMatchRepeatedKeysAndValues) {
  const Shape g{2, 3, 8, 2, 4}, full{2, 3, 8, 8, 4};
  Attn grouped(DType::f64, g), repeated(DType::f64, full);
  const int64_t group = g.hq / g.hkv, rows = g.b * g.s;
  for (int64_t row = 0; row < rows; ++row)
    for (int64_t h = 0; h < g.hq; ++h)
      for (int64_t e = 0; e < g.d; ++e) {
        const int64_t src = (row * g.hkv + h / group) * g.d + e, dst = (row * g.hq + h) * g.d + e;
        repeated.q.ptr<double>()[dst] = element(grouped.q, dst);
        repeated.k.ptr<double>()[dst] = element(grouped.k, src);
        repeated.v.ptr<double>()[dst] = element(grouped.v, src);
        repeated.dout.ptr<double>()[dst] = element(grouped.dout, dst);
      }
  for (Attn* r : {&grouped, &repeated}) {
    r->forward();
    r->backward();
  }
  for (int64_t i = 0; i < grouped.out.numel(); ++i) {
    EXPECT_NEAR(element(grouped.out, i), element(repeated.out, i), 1e-14) << i;
    EXPECT_NEAR(element(grouped.dq, i), element(repeated.dq, i), 1e-14) << i;
  }
  for (int64_t row = 0; row < rows; ++row)
    for (int64_t kvh = 0; kvh < g.hkv; ++kvh)
      for (int64_t e = 0; e < g.d; ++e) {
        double dk = 0, dv = 0;
        for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h) {
          dk += element(repeated.dk, (row * g.hq + h) * g.d + e);
          dv += element(repeated.dv, (row * g.hq + h) * g.d + e);
        }
        EXPECT_NEAR(element(grouped.dk, (row * g.hkv + kvh) * g.d + e), dk, 1e-13);
        EXPECT_NEAR(element(grouped.dv, (row * g.hkv + kvh) * g.d + e), dv, 1e-13);
      }
}

TEST(Attention, GradientsMatchFiniteDifferences) {
  // GQA groups of 2, 8 and 1 (plain multi-head), one token, odd head dims; v's head dim unlike q's
  // and k's (24 / 16, DeepSeek-V2's 192 / 128) in GQA and multi-head.
  for (Shape n : {Shape{2, 5, 4, 2, 3}, Shape{1, 6, 8, 1, 5}, Shape{1, 4, 3, 3, 8}, Shape{2, 1, 8, 1, 4}, Shape{1, 3, 1, 1, 1},
                  Shape{1, 5, 4, 2, 24, 16}, Shape{2, 4, 3, 3, 24, 16}, Shape{1, 3, 4, 1, 192, 128}, Shape{1, 3, 2, 2, 192, 128}}) {
    Attn r(DType::f64, n);
    // Poison the gradients: the backward must overwrite them.
    for (Buffer* g : {&r.dq, &r.dk, &r.dv})
      for (int64_t i = 0; i < g->numel(); ++i) g->ptr<double>()[i] = NAN;
    auto loss = [&] {
      r.forward();
      return testing::weighted_sum(r.out, r.dout);
    };
    loss();
    r.backward();
    testing::expect_gradient("dq", r.q, r.dq, loss);
    testing::expect_gradient("dk", r.k, r.dk, loss);
    testing::expect_gradient("dv", r.v, r.dv, loss);
  }
}

TEST(Attention, F32MatchesF64) {
  const Shape n{2, 37, 4, 2, 64};
  Attn r32(DType::f32, n), r64(DType::f64, n);
  for (Attn* r : {&r32, &r64}) {
    r->forward();
    r->backward();
  }
  for (auto [a, b] : {std::pair{&r32.out, &r64.out}, std::pair{&r32.lse, &r64.lse}, std::pair{&r32.dq, &r64.dq},
                      std::pair{&r32.dk, &r64.dk}, std::pair{&r32.dv, &r64.dv}})
    for (int64_t i = 0; i < a->numel(); ++i)
      ASSERT_NEAR(element(*a, i), element(*b, i), 1e-5 * (1 + std::abs(element(*b, i)))) << i;
}

TEST(Attention, RejectsBadShapes) {
  Buffer q(DType::f32, Device::cpu, {1, 4, 6, 8}), k(DType::f32, Device::cpu, {1, 4, 4, 8}),
      v(DType::f32, Device::cpu, {1, 4, 4, 8}), out(DType::f32, Device::cpu, {1, 4, 6, 8}),
      lse(DType::f32, Device::cpu, {1, 6, 4});
  try {
    attention_forward(out, lse, q, k, v);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(),
                 "attention_forward: the 6 query heads of q are not a multiple of the 4 key/value heads of k");
  }
  // v (and out) may have another head dim than q and k, but not another length or head count.
  Buffer k2(DType::f32, Device::cpu, {1, 4, 2, 8}), v2(DType::f32, Device::cpu, {1, 4, 2, 4}),
      short_v(DType::f32, Device::cpu, {1, 3, 2, 4}), out4(DType::f32, Device::cpu, {1, 4, 6, 4});
  auto message = [](auto call) {
    try {
      call();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(message([&] { attention_forward(out, lse, q, k2, short_v); }),
            "attention_forward: v has shape [1, 3, 2, 4] but expected [1, 4, 2, 4]");
  EXPECT_EQ(message([&] { attention_forward(out, lse, q, k2, v2); }),
            "attention_forward: out has shape [1, 4, 6, 8] but expected [1, 4, 6, 4]");
  EXPECT_EQ(message([&] { attention_forward(out4, lse, q, k2, v2); }), "no error");
  EXPECT_EQ(message([&] { attention_backward(q, k2, k2, out4, q, k2, v2, out4, lse); }),
            "attention_backward: dv has shape [1, 4, 2, 8] but expected [1, 4, 2, 4]");
  EXPECT_EQ(message([&] { attention_backward(q, k2, v2, out, q, k2, v2, out4, lse); }),
            "attention_backward: dout has shape [1, 4, 6, 8] but expected [1, 4, 6, 4]");
  EXPECT_EQ(message([&] { attention_merge(out4, lse, out, lse, 0, 4); }),
            "attention_merge: part_out has shape [1, 4, 6, 8] but expected [1, 4, 6, 4]");
  Buffer bad_lse(DType::f32, Device::cpu, {1, 4, 6});
  try {
    attention_backward(q, k2, k2, out, q, k2, k2, out, bad_lse);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "attention_backward: lse has shape [1, 4, 6] but expected [1, 6, 4]");
  }
}

// Every kernel set's name parses back to it (run configs, bench labels); others are an error. The
// CPU ignores the setting: hopper's forward and backward give the CPU reference's bits.
TEST(Attention, KernelSetNamesRoundTrip) {
  for (const AttentionKernels k : kAttentionKernels) EXPECT_EQ(parse_attention_kernels(attention_kernels_name(k)), k);
  try {
    parse_attention_kernels("flash");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "attention kernels must be own, cudnn, cudnn_nondeterministic, hopper or hopper_backward, got 'flash'");
  }
  Attn plain(DType::f32, {1, 5, 4, 2, 8}), hopper(DType::f32, {1, 5, 4, 2, 8});
  plain.forward();
  plain.backward();
  const AttentionKernels before = attention_kernels();
  set_attention_kernels(AttentionKernels::hopper);
  hopper.forward();
  hopper.backward();
  set_attention_kernels(before);
  for (const auto& [a, b] : {std::pair{&plain.out, &hopper.out}, std::pair{&plain.lse, &hopper.lse}, std::pair{&plain.dq, &hopper.dq},
                             std::pair{&plain.dk, &hopper.dk}, std::pair{&plain.dv, &hopper.dv}})
    for (int64_t i = 0; i < a->numel(); ++i) ASSERT_EQ(a->ptr<float>()[i], b->ptr<float>()[i]);
}

// Blocks: q[B, Sq, Hq, D] against k[B, Sk, Hkv, D], v[B, Sk, Hkv, Dv] (random; seeds shared with Attn).
struct BlockAttn {
  Buffer q, k, v, out, lse, dq, dk, dv, dout;
  BlockAttn(Shape n, int64_t kv_seq)
      : q(random_buffer(DType::f64, {n.b, n.s, n.hq, n.d}, 1)),
        k(random_buffer(DType::f64, {n.b, kv_seq, n.hkv, n.d}, 2)),
        v(random_buffer(DType::f64, {n.b, kv_seq, n.hkv, n.vd()}, 3)),
        out(DType::f64, Device::cpu, {n.b, n.s, n.hq, n.vd()}),
        lse(DType::f64, Device::cpu, {n.b, n.hq, n.s}),
        dq(DType::f64, Device::cpu, {n.b, n.s, n.hq, n.d}),
        dk(DType::f64, Device::cpu, {n.b, kv_seq, n.hkv, n.d}),
        dv(DType::f64, Device::cpu, {n.b, kv_seq, n.hkv, n.vd()}),
        dout(random_buffer(DType::f64, {n.b, n.s, n.hq, n.vd()}, 4)) {}
};

void fill(const Tensor& t, double value) {
  for (int64_t i = 0; i < t.numel(); ++i) t.ptr<double>()[i] = value;
}

// One block alone: its out and lse are final, so the block backward is the gradient of
// sum(dout * out) over the block's rows. Rows outside the block keep their 7 (out, lse); the
// gradients start at 0.5 and the backward must add to them.
void expect_block_gradients(const Shape& n, const AttentionBlock& block, int64_t kv_seq) {
  BlockAttn r(n, kv_seq);
  auto loss = [&] {
    fill(r.out, 7);
    fill(r.lse, 7);
    attention_block_forward(r.out, r.lse, r.q, r.k, r.v, block);
    return testing::weighted_sum(r.out, r.dout);
  };
  loss();
  for (int64_t b = 0; b < n.b; ++b)
    for (int64_t h = 0; h < n.hq; ++h)
      for (int64_t i = 0; i < n.s; ++i) {
        const bool inside = block.q_begin <= i && i < block.q_end;
        EXPECT_EQ(element(r.lse, (b * n.hq + h) * n.s + i) == 7, !inside) << i;
        EXPECT_EQ(element(r.out, ((b * n.s + i) * n.hq + h) * n.vd()) == 7, !inside) << i;
      }
  for (Buffer* g : {&r.dq, &r.dk, &r.dv}) fill(*g, 0.5);
  attention_block_backward(r.dq, r.dk, r.dv, r.dout, r.q, r.k, r.v, r.out, r.lse, block);
  for (Buffer* g : {&r.dq, &r.dk, &r.dv})
    for (int64_t i = 0; i < g->numel(); ++i) g->ptr<double>()[i] -= 0.5;
  // Rows outside the block hold 7 * dout, a constant: the loss's gradient there is zero as well.
  testing::expect_gradient("dq", r.q, r.dq, loss);
  testing::expect_gradient("dk", r.k, r.dk, loss);
  testing::expect_gradient("dv", r.v, r.dv, loss);
}

// Full and causal blocks at offsets and whole; GQA groups of 2, and v's head dim unlike q's and k's
// (24 / 16) in GQA and multi-head.
TEST(AttentionBlock, GradientsMatchFiniteDifferences) {
  for (const Shape& n : {Shape{2, 7, 4, 2, 5}, Shape{2, 7, 4, 2, 24, 16}, Shape{1, 7, 3, 3, 24, 16}})
    for (const auto& [block, kv_seq] : {std::pair{AttentionBlock{AttentionMask::full, 2, 6, 1, 4}, int64_t(5)},
                                        std::pair{AttentionBlock{AttentionMask::full, 0, 7, 0, 9}, int64_t(9)},
                                        std::pair{AttentionBlock{AttentionMask::causal, 3, 7, 1, 5}, int64_t(6)},
                                        std::pair{AttentionBlock{AttentionMask::causal, 0, 7, 0, 7}, int64_t(7)}})
      expect_block_gradients(n, block, kv_seq);
}

// The kv half then the q half of a block backward add what the whole backward adds, bit for bit,
// and each half leaves the other's gradients untouched.
TEST(AttentionBlock, HalvesGiveTheBitsOfTheWholeBackward) {
  const Shape n{2, 7, 4, 2, 5};
  const AttentionBlock block{AttentionMask::full, 2, 6, 1, 4};
  BlockAttn whole(n, 5), halves(n, 5);
  for (BlockAttn* r : {&whole, &halves}) {
    fill(r->out, 7);
    fill(r->lse, 7);
    attention_block_forward(r->out, r->lse, r->q, r->k, r->v, block);
    for (Buffer* g : {&r->dq, &r->dk, &r->dv}) fill(*g, 0.5);
  }
  attention_block_backward(whole.dq, whole.dk, whole.dv, whole.dout, whole.q, whole.k, whole.v, whole.out, whole.lse,
                           block);
  attention_block_backward(halves.dq, halves.dk, halves.dv, halves.dout, halves.q, halves.k, halves.v, halves.out,
                           halves.lse, block, AttentionGrads::kv);
  for (int64_t i = 0; i < halves.dq.numel(); ++i) EXPECT_EQ(halves.dq.ptr<double>()[i], 0.5) << "dq " << i;
  const double dk0 = halves.dk.ptr<double>()[n.d * n.hkv];  // key row 1: inside the block
  EXPECT_NE(dk0, 0.5);
  attention_block_backward(halves.dq, halves.dk, halves.dv, halves.dout, halves.q, halves.k, halves.v, halves.out,
                           halves.lse, block, AttentionGrads::q);
  EXPECT_EQ(halves.dk.ptr<double>()[n.d * n.hkv], dk0);
  for (auto [a, b] : {std::pair{&halves.dq, &whole.dq}, std::pair{&halves.dk, &whole.dk}, std::pair{&halves.dv, &whole.dv}})
    for (int64_t i = 0; i < a->numel(); ++i) ASSERT_EQ(a->ptr<double>()[i], b->ptr<double>()[i]) << i;
}

// Causal attention as blocks of keys [k0, k1): the queries of the same tokens see them causally,
// the later queries [k1, S) in full, the earlier ones not at all. Merging the partials gives the
// whole op's out and lse; the blocks' backwards from the merged out, lse sum to its gradients.
// With a window each block carries it, the full ones with their distance (query row k1 against key row k0).
struct Blockwise {
  std::vector<AttentionBlock> blocks;
  explicit Blockwise(int64_t seq, std::initializer_list<int64_t> cuts, int64_t window = 0) {
    int64_t k0 = 0;
    std::vector<int64_t> ends(cuts);
    ends.push_back(seq);
    for (int64_t k1 : ends) {
      blocks.push_back({AttentionMask::causal, k0, k1, k0, k1, window, 0});
      if (k1 < seq) blocks.push_back({AttentionMask::full, k1, seq, k0, k1, window, k1 - k0});
      k0 = k1;
    }
  }
  // out, lse of a merge of every block's partial into a running result that starts at (0, -inf).
  void forward(Attn& r, const Shape& n) const {
    fill(r.out, 0);
    fill(r.lse, -INFINITY);
    Buffer part_out(DType::f64, Device::cpu, {n.b, n.s, n.hq, n.vd()}), part_lse(DType::f64, Device::cpu, {n.b, n.hq, n.s});
    for (const AttentionBlock& block : blocks) {
      attention_block_forward(part_out, part_lse, r.q, r.k, r.v, block);
      attention_merge(r.out, r.lse, part_out, part_lse, block.q_begin, block.q_end);
    }
  }
  void backward(Attn& r) const {
    for (Buffer* g : {&r.dq, &r.dk, &r.dv}) fill(*g, 0);
    for (const AttentionBlock& block : blocks)
      attention_block_backward(r.dq, r.dk, r.dv, r.dout, r.q, r.k, r.v, r.out, r.lse, block);
  }
};

TEST(AttentionBlock, BlockwiseEqualsTheWholeCausalOp) {
  // S = 23 and 37: primes, so no block or tile size divides them; GQA groups of 2; head_dim 8 and 64;
  // v's head dim unlike q's and k's (24 / 16 and 192 / 128).
  for (const auto& [n, blocks] : {std::pair{Shape{2, 23, 4, 2, 8}, Blockwise(23, {5, 6, 17})},
                                   std::pair{Shape{1, 37, 4, 2, 64}, Blockwise(37, {18})},
                                   std::pair{Shape{1, 37, 2, 1, 3}, Blockwise(37, {1, 2, 3, 36})},
                                   std::pair{Shape{1, 23, 4, 2, 24, 16}, Blockwise(23, {5, 6, 17})},
                                   std::pair{Shape{1, 9, 2, 2, 192, 128}, Blockwise(9, {4})}}) {
    Attn whole(DType::f64, n), split(DType::f64, n);
    whole.forward();
    whole.backward();
    blocks.forward(split, n);
    blocks.backward(split);
    for (auto [a, b] : {std::pair{&split.out, &whole.out}, std::pair{&split.lse, &whole.lse},
                        std::pair{&split.dq, &whole.dq}, std::pair{&split.dk, &whole.dk},
                        std::pair{&split.dv, &whole.dv}})
      for (int64_t i = 0; i < a->numel(); ++i)
        ASSERT_NEAR(element(*a, i), element(*b, i), 1e-12 * (1 + std::abs(element(*b, i)))) << i;
  }
}

// GPT-OSS's variant as blocks (ring attention's way, parallel/ring_attention.h): windowed blocks (rows
// that see no key of a full block get lse -inf, which the merge skips), then the sinks merged once;
// the blocks' backwards from the final out and lse plus attention_sinks_backward give the op's
// gradients. Windows inside a block, across blocks, and longer than the sequence.
TEST(AttentionBlock, WindowedBlocksAndSinksEqualTheVariantOp) {
  const Shape n{2, 23, 4, 2, 8};
  for (const int64_t window : {1, 4, 9, 30}) {
    const Blockwise blocks(23, {5, 6, 17}, window);
    Attn whole(DType::f64, n), split(DType::f64, n);
    const Buffer sinks = random_buffer(DType::f64, {n.hq}, 9);
    Buffer dsinks = Buffer::zeros(DType::f64, Device::cpu, {n.hq}), split_dsinks = Buffer::zeros(DType::f64, Device::cpu, {n.hq});
    whole.forward({sinks, window});
    whole.backward({sinks, window}, dsinks);
    blocks.forward(split, n);
    attention_sinks_merge(split.out, split.lse, sinks);
    blocks.backward(split);
    attention_sinks_backward(split_dsinks, split.dout, split.out, split.lse, sinks);
    for (auto [a, b] : {std::pair{&split.out, &whole.out}, std::pair{&split.lse, &whole.lse}, std::pair{&split.dq, &whole.dq},
                        std::pair{&split.dk, &whole.dk}, std::pair{&split.dv, &whole.dv}, std::pair{&split_dsinks, &dsinks}})
      for (int64_t i = 0; i < a->numel(); ++i)
        ASSERT_NEAR(element(*a, i), element(*b, i), 1e-12 * (1 + std::abs(element(*b, i)))) << "window " << window << ": " << i;
  }
}

// The merge inside the composite: the gradients of sum(dout * out) with out merged from blocks,
// computed by the block backwards, against finite differences through the merges; v's head dim as
// q's and k's, and unlike them in GQA and multi-head.
TEST(AttentionMerge, BlockwiseGradientsMatchFiniteDifferences) {
  const Blockwise blocks(9, {2, 4});
  for (const Shape& n : {Shape{2, 9, 4, 2, 5}, Shape{1, 9, 4, 2, 24, 16}, Shape{1, 9, 3, 3, 24, 16}}) {
    Attn r(DType::f64, n);
    auto loss = [&] {
      blocks.forward(r, n);
      return testing::weighted_sum(r.out, r.dout);
    };
    loss();
    blocks.backward(r);
    testing::expect_gradient("dq", r.q, r.dq, loss);
    testing::expect_gradient("dk", r.k, r.dk, loss);
    testing::expect_gradient("dv", r.v, r.dv, loss);
  }
}

// Two partials with hand-picked lse: out is their softmax-weighted mean, lse their logaddexp; a
// running result at (0, -inf) becomes the partial; rows outside the range are untouched.
TEST(AttentionMerge, WeighsByLogSumExp) {
  Buffer out(DType::f64, Device::cpu, {1, 3, 1, 2}), lse(DType::f64, Device::cpu, {1, 1, 3});
  Buffer part(DType::f64, Device::cpu, {1, 3, 1, 2}), part_lse(DType::f64, Device::cpu, {1, 1, 3});
  const double o[] = {1, 2, 0, 0, 5, 5}, l[] = {std::log(3.0), -INFINITY, 1}, p[] = {4, -2, 7, 8, 9, 9},
               pl[] = {std::log(1.0), 2, 1};
  std::copy(o, o + 6, out.ptr<double>());
  std::copy(l, l + 3, lse.ptr<double>());
  std::copy(p, p + 6, part.ptr<double>());
  std::copy(pl, pl + 3, part_lse.ptr<double>());
  attention_merge(out, lse, part, part_lse, 0, 2);
  const double want_out[] = {(3 * 1 + 4) / 4.0, (3 * 2 - 2) / 4.0, 7, 8, 5, 5},
               want_lse[] = {std::log(4.0), 2, 1};
  for (int i = 0; i < 6; ++i) EXPECT_NEAR(element(out, i), want_out[i], 1e-15) << i;
  for (int i = 0; i < 3; ++i) EXPECT_NEAR(element(lse, i), want_lse[i], 1e-15) << i;
}

TEST(AttentionBlock, RejectsBadBlocks) {
  BlockAttn r(Shape{1, 4, 2, 1, 3}, 6);
  auto message = [&](AttentionBlock block) {
    try {
      attention_block_forward(r.out, r.lse, r.q, r.k, r.v, block);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(message({AttentionMask::causal, 0, 4, 0, 5}),
            "attention_block_forward: a causal block pairs 4 queries with 5 keys (it needs equal counts)");
  EXPECT_EQ(message({AttentionMask::full, 0, 4, 2, 7}),
            "attention_block_forward: query rows [0, 4) and key rows [2, 7) do not fit 4 queries and 6 keys");
  EXPECT_EQ(message({AttentionMask::full, 1, 3, 2, 2}), "attention_block_forward: 2 queries see no key");
  EXPECT_EQ(message({AttentionMask::full, 0, 4, 0, 2, -1, 3}), "attention_block_forward: the sliding window must be 0 (none) or positive, got -1");
  EXPECT_EQ(message({AttentionMask::causal, 0, 4, 0, 4, 2, 1}),
            "attention_block_forward: a causal block's queries and keys are the same tokens, but its distance is 1");
}

// GPT-OSS's variant: sinks [Hq] and a sliding window (ops/attention.h).

Buffer constant(DType dtype, std::initializer_list<int64_t> dims, double value) {
  Buffer b(dtype, Device::cpu, dims);
  for (int64_t i = 0; i < b.numel(); ++i) testing::set_element(b, i, value);
  return b;
}

// A window of at least S keys masks nothing: the plain op's bits. Sinks far below every score add
// nothing to the denominators: the plain op's results, and no gradient for the sinks.
TEST(AttentionVariant, NegligibleSinksAndAWholeWindowGiveThePlainOp) {
  const Shape n{2, 9, 4, 2, 8};
  for (const DType t : {DType::f32, DType::f64}) {
    Attn plain(t, n);
    plain.forward();
    plain.backward();
    auto expect_plain = [&](const Attn& r, double tolerance) {
      for (auto [a, b] : {std::pair{&r.out, &plain.out}, std::pair{&r.lse, &plain.lse}, std::pair{&r.dq, &plain.dq},
                          std::pair{&r.dk, &plain.dk}, std::pair{&r.dv, &plain.dv}})
        for (int64_t i = 0; i < a->numel(); ++i) {
          if (tolerance == 0) ASSERT_EQ(element(*a, i), element(*b, i)) << dtype_name(t) << " " << i;
          else ASSERT_NEAR(element(*a, i), element(*b, i), tolerance * (1 + std::abs(element(*b, i)))) << i;
        }
    };
    for (const int64_t window : {n.s, n.s + 5}) {
      Attn windowed(t, n);
      windowed.forward({Tensor{}, window});
      windowed.backward({Tensor{}, window}, {});
      expect_plain(windowed, 0);
    }
    Attn sunk(t, n);
    const Buffer sinks = constant(t, {n.hq}, -1e30), dsinks = constant(t, {n.hq}, 0.25);
    sunk.forward({sinks, 0});
    sunk.backward({sinks, 0}, dsinks);
    expect_plain(sunk, t == DType::f32 ? 1e-6 : 1e-14);
    for (int64_t h = 0; h < n.hq; ++h) EXPECT_EQ(element(dsinks, h), 0.25) << h;
  }
}

// S = 3, one head, D = 2, window 2 and a sink: each row's softmax written out over all three keys
// plus the sink column, keys outside i - 2 < j <= i dropped (query 2 no longer sees key 0).
TEST(AttentionVariant, SmallCaseMatchesTheDirectSoftmax) {
  const Shape n{1, 3, 1, 1, 2};
  const int64_t window = 2;
  const double sink = 0.3;
  Attn r(DType::f64, n);
  const Buffer sinks = constant(DType::f64, {1}, sink);
  r.forward({sinks, window});
  for (int64_t i = 0; i < n.s; ++i) {
    double denominator = std::exp(sink), numerator[2] = {0, 0};
    for (int64_t j = 0; j < n.s; ++j) {
      if (j > i || j <= i - window) continue;
      const double score = element(r.q, i * 2) * element(r.k, j * 2) + element(r.q, i * 2 + 1) * element(r.k, j * 2 + 1);
      const double w = std::exp(score / std::sqrt(2.0));
      denominator += w;
      for (int64_t e = 0; e < 2; ++e) numerator[e] += w * element(r.v, j * 2 + e);
    }
    EXPECT_NEAR(element(r.lse, i), std::log(denominator), 1e-14) << i;
    for (int64_t e = 0; e < 2; ++e) EXPECT_NEAR(element(r.out, i * 2 + e), numerator[e] / denominator, 1e-14) << i;
  }
}

// GQA groups of 2 and 4, several batch rows, S prime, windows of 3, 4 and 1 (each query sees only
// itself and the sink); sinks of scale 2, so some outweigh every score of their rows; v's head dim
// unlike q's and k's.
TEST(AttentionVariant, GradientsMatchFiniteDifferences) {
  for (const auto& [n, window] : {std::pair{Shape{3, 7, 4, 2, 3}, int64_t(3)},
                                  std::pair{Shape{2, 11, 8, 2, 5}, int64_t(4)},
                                  std::pair{Shape{2, 5, 4, 2, 2}, int64_t(1)},
                                  std::pair{Shape{2, 7, 4, 2, 24, 16}, int64_t(3)}}) {
    Attn r(DType::f64, n);
    const Buffer sinks = random_buffer(DType::f64, {n.hq}, 5, 2.0), dsinks = constant(DType::f64, {n.hq}, 0.5);
    const AttentionVariant variant{sinks, window};
    // Poison the input gradients: the backward must overwrite them (and add to dsinks).
    for (Buffer* g : {&r.dq, &r.dk, &r.dv})
      for (int64_t i = 0; i < g->numel(); ++i) g->ptr<double>()[i] = NAN;
    auto loss = [&] {
      r.forward(variant);
      return testing::weighted_sum(r.out, r.dout);
    };
    loss();
    r.backward(variant, dsinks);
    for (int64_t h = 0; h < n.hq; ++h) dsinks.ptr<double>()[h] -= 0.5;
    testing::expect_gradient("dq", r.q, r.dq, loss);
    testing::expect_gradient("dk", r.k, r.dk, loss);
    testing::expect_gradient("dv", r.v, r.dv, loss);
    testing::expect_gradient("dsinks", sinks, dsinks, loss);
  }
}

// Threads compute different batch rows of one sink's gradient; their shares add in batch order, so
// the thread count changes no bit (sizes above kParallelWork, so the loops do split).
TEST(AttentionVariant, ThreadCountDoesNotChangeTheBits) {
  const Shape n{4, 64, 4, 2, 16};
  const Buffer sinks = random_buffer(DType::f32, {n.hq}, 5);
  auto run_with = [&](int threads) {
    omp_set_num_threads(threads);
    auto r = std::make_unique<Attn>(DType::f32, n);
    Buffer dsinks = constant(DType::f32, {n.hq}, 0);
    r->forward({sinks, 5});
    r->backward({sinks, 5}, dsinks);
    return std::pair{std::move(r), std::move(dsinks)};
  };
  const int saved = omp_get_max_threads();
  auto [one, dsinks1] = run_with(1);
  auto [three, dsinks3] = run_with(3);
  omp_set_num_threads(saved);
  for (auto [a, b] : {std::pair{&one->out, &three->out}, std::pair{&one->lse, &three->lse},
                      std::pair{&one->dq, &three->dq}, std::pair{&one->dk, &three->dk},
                      std::pair{&one->dv, &three->dv}, std::pair{&dsinks1, &dsinks3}})
    for (int64_t i = 0; i < a->numel(); ++i) ASSERT_EQ(a->ptr<float>()[i], b->ptr<float>()[i]) << i;
}

TEST(AttentionVariant, RejectsBadVariants) {
  Attn r(DType::f32, {1, 4, 4, 2, 8});
  const Buffer sinks = constant(DType::f32, {4}, 0), short_sinks = constant(DType::f32, {2}, 0),
               f64_sinks = constant(DType::f64, {4}, 0), dsinks = constant(DType::f32, {4}, 0);
  auto message = [](auto call) {
    try {
      call();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(message([&] { r.forward({short_sinks, 0}); }), "attention_forward: sinks has shape [2] but expected [4]");
  EXPECT_EQ(message([&] { r.forward({f64_sinks, 0}); }), "attention_forward: sinks has dtype f64 but expected f32");
  EXPECT_EQ(message([&] { r.forward({Tensor{}, -1}); }),
            "attention_forward: the sliding window must be 0 (none) or positive, got -1");
  EXPECT_EQ(message([&] { r.forward({sinks, 2}); }), "no error");
  EXPECT_EQ(message([&] { r.backward({sinks, 2}, {}); }),
            "attention_backward: variant.sinks is given but dsinks, its gradient, is empty");
  EXPECT_EQ(message([&] { r.backward({Tensor{}, 2}, dsinks); }),
            "attention_backward: dsinks is given but variant.sinks is empty");
  EXPECT_EQ(message([&] { r.backward({sinks, 2}, short_sinks); }),
            "attention_backward: dsinks has shape [2] but expected [4]");
}

// cuDNN's deterministic backward plan (no GPU needed): its scratch is cuDNN's workspace of the
// largest call, as get_workspace_size gave it on an H200 (cuDNN 9.14), plus the f32 dK, dV sums
// when it runs in query chunks.
TEST(AttentionCudnn, BackwardPlanKeepsDpWithinTheCap) {
  const int64_t GiB = int64_t(1) << 30, MiB = int64_t(1) << 20;
  // 16,384: 4 head groups of 8, whole: dP 4 GiB, per-query-head dK, dV 64 MiB, row sums 512 KiB.
  EXPECT_EQ(cudnn_attention_backward_scratch(1, 16384, 32, 4, 128, 128), 4 * GiB + 64 * MiB + 512 * 1024 + 256);
  // 32,768: 16 chunks of 2048 over all 32 heads; the last sees every key (4,832,100,608 measured).
  ASSERT_TRUE(cudnn_attention_backward_supports(1, 32768, 32, 4, 128, 128));
  EXPECT_EQ(cudnn_attention_backward_scratch(1, 32768, 32, 4, 128, 128), int64_t(4832100608) + 128 * MiB);
  // A 1 GiB cap: 16,384 in 16 chunks of 1024 over all heads (1,342,308,608 measured).
  set_cudnn_backward_workspace_cap(GiB);
  EXPECT_EQ(cudnn_attention_backward_scratch(1, 16384, 32, 4, 128, 128), int64_t(1342308608) + 64 * MiB);
  set_cudnn_backward_workspace_cap(0);
  // Not even 64 query rows of one head group fit: the own kernels run the backward.
  EXPECT_FALSE(cudnn_attention_backward_supports(1024, 32768, 32, 4, 128, 128));
  EXPECT_TRUE(cudnn_attention_backward_supports(1024, 32768, 32, 4, 128, 128, false));
  EXPECT_TRUE(cudnn_attention_backward_supports(0, 4096, 32, 4, 128, 128));  // an empty batch: nothing to run
}

// DeepSeek-V2's head dims (192 for q and k, 128 for v) are served, no other mixed pair, nor 192 alone.
// Their scratch counts dK (192) and dV (128) per query head where heads are grouped, and the f32
// dK, dV sums when the backward runs in query chunks.
TEST(AttentionCudnn, ServesDeepSeekHeadDims) {
  const int64_t MiB = int64_t(1) << 20;
  EXPECT_TRUE(cudnn_attention_forward_supports(1024, 192, 128));
  EXPECT_FALSE(cudnn_attention_forward_supports(1, 192, 128));
  EXPECT_FALSE(cudnn_attention_forward_supports(1024, 192, 192));
  EXPECT_FALSE(cudnn_attention_forward_supports(1024, 128, 64));
  EXPECT_TRUE(cudnn_attention_backward_supports(2, 4096, 16, 16, 192, 128));
  // dP 16 x 4096^2 x 2 B = 512 MiB, per-query-head dK and dV 16 x 4096 x (192 + 128) x 2 B = 40 MiB, row sums 256 KiB.
  EXPECT_EQ(cudnn_attention_backward_scratch(1, 4096, 16, 4, 192, 128), 552 * MiB + 256 * 1024 + 256);
  EXPECT_EQ(cudnn_attention_backward_scratch(1, 4096, 16, 16, 192, 128), 512 * MiB + 256 * 1024 + 256);
  // A forced chunk of 1024 rows: the last call (1024 x 4096) sets the workspace, plus dK, dV sums
  // 4096 x 16 x (192 + 128) x 4 B = 80 MiB.
  set_cudnn_backward_chunk(1024);
  EXPECT_EQ(cudnn_attention_backward_scratch(1, 4096, 16, 16, 192, 128), 128 * MiB + 64 * 1024 + 256 + 80 * MiB);
  set_cudnn_backward_chunk(0);
}

}  // namespace
}  // namespace marrow
