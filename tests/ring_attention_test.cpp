#include "parallel/ring_attention.h"

#include <cmath>
#include <vector>

#include "gradcheck.h"
#include "parallel/comm.h"

namespace marrow {
namespace {

using testing::element;
using testing::random_buffer;

TEST(Ring, ZigzagSplitPairsAnEarlyAndALateChunk) {
  // S = 16 over 4 members: chunks of 2; member 1 holds chunks 1 and 6.
  const ZigzagSplit z = zigzag_split(16, 1, 4);
  EXPECT_EQ(z.chunk, 2);
  std::vector<int64_t> positions;
  for (int64_t i = 0; i < 4; ++i) positions.push_back(z.position(i));
  EXPECT_EQ(positions, (std::vector<int64_t>{2, 3, 12, 13}));
  // Every position belongs to exactly one member.
  std::vector<int> owners(24, 0);
  for (int r = 0; r < 3; ++r)
    for (int64_t i = 0; i < 8; ++i) ++owners[size_t(zigzag_split(24, r, 3).position(i))];
  EXPECT_EQ(owners, std::vector<int>(24, 1));
  try {
    zigzag_split(12, 0, 4);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "context parallelism over 4 ranks needs a sequence length that is a multiple of 8, got 12");
  }
}

TEST(Ring, ZigzagSliceCopiesTheMembersTokens) {
  Buffer whole(DType::f64, Device::cpu, {2, 8, 3}), local(DType::f64, Device::cpu, {2, 4, 3});
  for (int64_t i = 0; i < whole.numel(); ++i) whole.ptr<double>()[i] = double(i);
  const ZigzagSplit z = zigzag_split(8, 0, 2);  // chunks 0 and 3 of 4: positions 0, 1, 6, 7
  zigzag_slice(local, whole, z);
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t i = 0; i < 4; ++i)
      for (int64_t e = 0; e < 3; ++e)
        EXPECT_EQ(element(local, (b * 4 + i) * 3 + e), double((b * 8 + z.position(i)) * 3 + e)) << b << " " << i;
}

// d: q's and k's head dim; dv: v's and out's (0: d).
struct Shape {
  int64_t b, s, hq, hkv, d, dv = 0;
  int64_t vd() const { return dv ? dv : d; }
};

// The whole sequence's inputs and the causal op's results, f64.
struct Whole {
  Shape n;
  Buffer q, k, v, dout, out, lse, dq, dk, dv;
  explicit Whole(Shape n)
      : n(n),
        q(random_buffer(DType::f64, {n.b, n.s, n.hq, n.d}, 11)),
        k(random_buffer(DType::f64, {n.b, n.s, n.hkv, n.d}, 12)),
        v(random_buffer(DType::f64, {n.b, n.s, n.hkv, n.vd()}, 13)),
        dout(random_buffer(DType::f64, {n.b, n.s, n.hq, n.vd()}, 14)),
        out(DType::f64, Device::cpu, {n.b, n.s, n.hq, n.vd()}),
        lse(DType::f64, Device::cpu, {n.b, n.hq, n.s}),
        dq(DType::f64, Device::cpu, {n.b, n.s, n.hq, n.d}),
        dk(DType::f64, Device::cpu, {n.b, n.s, n.hkv, n.d}),
        dv(DType::f64, Device::cpu, {n.b, n.s, n.hkv, n.vd()}) {
    attention_forward(out, lse, q, k, v);
    attention_backward(dq, dk, dv, dout, q, k, v, out, lse);
  }
};

// One member's share: its slices of the inputs, and room for its results.
struct Member {
  ZigzagSplit z;
  int64_t sl;
  Buffer q, k, v, dout, out, lse, dq, dk, dv;
  Member(const Whole& w, int rank, int ranks)
      : z(zigzag_split(w.n.s, rank, ranks)),
        sl(2 * z.chunk),
        q(DType::f64, Device::cpu, {w.n.b, sl, w.n.hq, w.n.d}),
        k(DType::f64, Device::cpu, {w.n.b, sl, w.n.hkv, w.n.d}),
        v(DType::f64, Device::cpu, {w.n.b, sl, w.n.hkv, w.n.vd()}),
        dout(DType::f64, Device::cpu, {w.n.b, sl, w.n.hq, w.n.vd()}),
        out(Buffer::zeros(DType::f64, Device::cpu, {w.n.b, sl, w.n.hq, w.n.vd()})),
        lse(DType::f64, Device::cpu, {w.n.b, w.n.hq, sl}),
        dq(Buffer::zeros(DType::f64, Device::cpu, {w.n.b, sl, w.n.hq, w.n.d})),
        dk(Buffer::zeros(DType::f64, Device::cpu, {w.n.b, sl, w.n.hkv, w.n.d})),
        dv(Buffer::zeros(DType::f64, Device::cpu, {w.n.b, sl, w.n.hkv, w.n.vd()})) {
    for (auto [local, whole] : {std::pair{&q, &w.q}, std::pair{&k, &w.k}, std::pair{&v, &w.v}, std::pair{&dout, &w.dout}})
      zigzag_slice(*local, *whole, z);
    for (int64_t i = 0; i < lse.numel(); ++i) lse.ptr<double>()[i] = -INFINITY;
  }
  // Each result equals the whole op's on this member's tokens, to 1e-12 relative (f64, other order).
  void expect_matches(const Whole& w) const {
    const Shape& n = w.n;
    const std::pair<const Buffer*, const Buffer*> pairs[] = {{&out, &w.out}, {&dq, &w.dq}, {&dk, &w.dk}, {&dv, &w.dv}};
    for (auto [mine, whole] : pairs) {
      Buffer want(DType::f64, Device::cpu, {n.b, sl, mine->view().size(2), mine->view().size(3)});
      zigzag_slice(want, *whole, z);
      for (int64_t i = 0; i < want.numel(); ++i)
        ASSERT_NEAR(element(*mine, i), element(want, i), 1e-12 * (1 + std::abs(element(want, i)))) << i;
    }
    Buffer want_lse(DType::f64, Device::cpu, {n.b * n.hq, sl});
    zigzag_slice(want_lse, w.lse.view().reshape({n.b * n.hq, n.s}), z);
    for (int64_t i = 0; i < want_lse.numel(); ++i)
      ASSERT_NEAR(element(lse, i), element(want_lse, i), 1e-12 * (1 + std::abs(element(want_lse, i)))) << i;
  }
};

// The ring's arithmetic in one process: member r's queries meet member s's K/V block as
// zigzag_block(r, s) says; partials merge by lse; every block's backward adds into the owner's
// dq and the source's dk, dv. Equal to the whole causal op at CP = 2, 3, 4 and prime chunk sizes, and
// with v's head dim unlike q's and k's (24 / 16, DeepSeek-V2's 192 / 128).
TEST(Ring, ZigzagBlocksEqualTheWholeCausalOp) {
  for (const auto& [n, ranks] : {std::pair{Shape{2, 4 * 7, 4, 2, 8}, 2}, std::pair{Shape{1, 6 * 5, 4, 2, 16}, 3},
                                 std::pair{Shape{1, 8 * 3, 2, 1, 64}, 4}, std::pair{Shape{1, 8, 2, 2, 3}, 4},
                                 std::pair{Shape{1, 4 * 5, 4, 2, 24, 16}, 2}, std::pair{Shape{1, 6 * 2, 2, 2, 192, 128}, 3}}) {
    const Whole w(n);
    std::vector<Member> members;
    for (int r = 0; r < ranks; ++r) members.emplace_back(w, r, ranks);
    Buffer part_out(DType::f64, Device::cpu, {n.b, n.s / ranks, n.hq, n.vd()});
    Buffer part_lse(DType::f64, Device::cpu, {n.b, n.hq, n.s / ranks});
    for (Member& m : members)
      for (int t = 0; t < ranks; ++t) {
        const int r = int(&m - members.data()), s = (r - t + ranks) % ranks;
        const AttentionBlock block = zigzag_block(m.sl, r, s);
        attention_block_forward(part_out, part_lse, m.q, members[size_t(s)].k, members[size_t(s)].v, block);
        attention_merge(m.out, m.lse, part_out, part_lse, block.q_begin, block.q_end);
      }
    for (Member& m : members)
      for (int s = 0; s < ranks; ++s) {
        Member& src = members[size_t(s)];
        attention_block_backward(m.dq, src.dk, src.dv, m.dout, m.q, src.k, src.v, m.out, m.lse,
                                 zigzag_block(m.sl, int(&m - members.data()), s));
      }
    for (const Member& m : members) m.expect_matches(w);
  }
}

// A group of one: the ring is the causal op itself, to the bit; v's head dim as q's and k's or not.
TEST(Ring, OneMemberIsTheCausalOp) {
  for (const Shape& n : {Shape{2, 14, 4, 2, 8}, Shape{1, 14, 4, 2, 24, 16}}) {
    const Whole w(n);
    Member m(w, 0, 1);
    ring_attention_forward(m.out, m.lse, w.q, w.k, w.v, Comm());
    ring_attention_backward(m.dq, m.dk, m.dv, w.dout, w.q, w.k, w.v, m.out, m.lse, Comm());
    for (auto [a, b] : {std::pair{&m.out, &w.out}, std::pair{&m.lse, &w.lse}, std::pair{&m.dq, &w.dq},
                        std::pair{&m.dk, &w.dk}, std::pair{&m.dv, &w.dv}})
      for (int64_t i = 0; i < a->numel(); ++i) ASSERT_EQ(element(*a, i), element(*b, i)) << i;
  }
}

// Ring attention's buffers grow with v's head dim where it differs: K/V blocks and their gradient
// sums hold D + Dv per key/value head, the partial and running out Dv, dq D.
TEST(Ring, BytesCountTheValueHeadDim) {
  const RingAttentionBytes same = ring_attention_bytes(1024, 16, 4, 128, Device::cuda),
                           mixed = ring_attention_bytes(1024, 16, 4, 192, Device::cuda, 128);
  EXPECT_EQ(same.forward, ring_attention_bytes(1024, 16, 4, 128, Device::cuda, 128).forward);
  // Forward: kv[2] bf16 (+ 1024 x 4 x 64 each), part_out and running unchanged (Dv = 128).
  EXPECT_EQ(mixed.forward - same.forward, 2 * 1024 * 4 * 64 * 2);
  // Backward: kv[2] bf16 and four f32 dK/dV buffers (+ 1024 x 4 x 64 each), dq_sum f32 (+ 1024 x 16 x 64).
  EXPECT_EQ(mixed.backward - same.backward, 2 * 1024 * 4 * 64 * 2 + 4 * 1024 * 4 * 64 * 4 + 1024 * 16 * 64 * 4);
}

}  // namespace
}  // namespace marrow
