#include "parallel/ring_attention.h"

#include <algorithm>
#include <limits>
#include <utility>
#include <vector>

#include "core/memory.h"
#include "ops/add.h"
#include "ops/cast.h"
#include "ops/init.h"
#include "parallel/comm.h"
#include "parallel/sequence_chain.h"

namespace marrow {

ZigzagSplit zigzag_split(int64_t seq, int rank, int ranks) {
  MARROW_CHECK(ranks > 0 && 0 <= rank && rank < ranks, "zigzag split: no member {} of {}", rank, ranks);
  MARROW_CHECK(seq > 0 && seq % (2 * ranks) == 0,
               "context parallelism over {} ranks needs a sequence length that is a multiple of {}, got {}", ranks,
               2 * ranks, seq);
  const int64_t chunk = seq / (2 * ranks);
  return {chunk, rank * chunk, (2 * ranks - 1 - rank) * chunk};
}

void zigzag_slice(Tensor local, Tensor whole, const ZigzagSplit& split) {
  const char* op = "zigzag_slice";
  MARROW_CHECK(whole.ndim >= 2 && local.ndim == whole.ndim && local.dtype == whole.dtype,
               "{}: local {} {} and whole {} {} are not slices of one layout", op, local.shape_string(),
               dtype_name(local.dtype), whole.shape_string(), dtype_name(whole.dtype));
  const int64_t n = whole.size(0), seq = whole.size(1), row = whole.numel() / std::max<int64_t>(1, n * seq);
  MARROW_CHECK(split.second + split.chunk <= seq && local.size(0) == n && local.size(1) == 2 * split.chunk &&
                   local.numel() == n * 2 * split.chunk * row,
               "{}: local has shape {} but the member holds {} of whole {}'s tokens", op, local.shape_string(),
               2 * split.chunk, whole.shape_string());
  const Tensor from = whole.reshape({n * seq, row}), to = local.reshape({n * 2 * split.chunk, row});
  for (int64_t b = 0; b < n; ++b)
    for (const auto& [dst, src] : {std::pair{int64_t{0}, split.first}, std::pair{split.chunk, split.second}}) {
      const int64_t at = b * 2 * split.chunk + dst;
      copy(to.rows(at, at + split.chunk), from.rows(b * seq + src, b * seq + src + split.chunk));
    }
}

AttentionBlock zigzag_block(int64_t local_seq, int rank, int source) {
  const int64_t c = local_seq / 2;
  if (source == rank) return {AttentionMask::causal, 0, local_seq, 0, local_seq};
  if (source < rank) return {AttentionMask::full, 0, local_seq, 0, c};
  return {AttentionMask::full, c, local_seq, 0, local_seq};
}

namespace {

// The blocks of member `rank`'s queries against member `source`'s keys and values, one per pair of
// chunks (local rows [0, c) and [c, 2c)) whose keys come no later than the queries and, with a
// window, reach into it; each carries the window, the documents and the distance between its chunks' positions.
// Source = rank gives its own chunk first causally, the later chunk against it, the later causally.
std::vector<AttentionBlock> chunk_blocks(int64_t local_seq, int rank, int source, int ranks, const AttentionVariant& variant) {
  const int64_t window = variant.window;
  const int64_t c = local_seq / 2;
  auto position = [&](int member, int64_t half) { return (half == 0 ? member : 2 * ranks - 1 - member) * c; };
  std::vector<AttentionBlock> blocks;
  for (int64_t qh = 0; qh < 2; ++qh)
    for (int64_t kh = 0; kh < 2; ++kh) {
      const int64_t qp = position(rank, qh), kp = position(source, kh);
      if (kp > qp || (window > 0 && kp + c - 1 <= qp - window)) continue;
      blocks.push_back(
          {kp == qp ? AttentionMask::causal : AttentionMask::full, qh * c, qh * c + c, kh * c, kh * c + c, window, qp - kp, variant.documents});
    }
  return blocks;
}

// The blocks of a ring step: zigzag_block's one block without a window or documents, else
// chunk_blocks (their masks need each block's rows to be consecutive positions).
std::vector<AttentionBlock> step_blocks(int64_t local_seq, int rank, int source, int ranks, const AttentionVariant& variant) {
  if (variant.window == 0 && !variant.documents.data) return {zigzag_block(local_seq, rank, source)};
  return chunk_blocks(local_seq, rank, source, ranks, variant);
}

struct RingShape {
  int64_t batch, seq, q_heads, kv_heads, head_dim, v_dim;  // head_dim: q's and k's; v_dim: v's and out's
};

void check_members(const char* op, const RingShape& n, const Comm& cp) {
  MARROW_CHECK(cp.size() == 1 || n.seq % 2 == 0,
               "{}: a member's {} tokens are not two zigzag chunks (the length must be even)", op, n.seq);
}

// q, k, v of one member; a split over several members needs an even local length (two chunks).
RingShape check_ring(const char* op, const Tensor& q, const Tensor& k, const Tensor& v, const Comm& cp) {
  MARROW_CHECK(q.ndim == 4 && k.ndim == 4 && v.ndim == 4, "{}: q {}, k {} and v {} must be [batch, seq, heads, head_dim]", op,
               q.shape_string(), k.shape_string(), v.shape_string());
  const RingShape n{q.size(0), q.size(1), q.size(2), k.size(2), q.size(3), v.size(3)};
  expect_shape(op, "k", k, {n.batch, n.seq, n.kv_heads, n.head_dim});
  expect_shape(op, "v", v, {n.batch, n.seq, n.kv_heads, n.v_dim});
  check_members(op, n, cp);
  return n;
}

// q and packed K/V of one member, with the expansion's heads.
RingShape check_packed(const char* op, const Tensor& q, const Tensor& packed, const KvExpansion& kv, const Comm& cp) {
  MARROW_CHECK(q.ndim == 4 && kv.expand && kv.expand_backward && kv.width > 0 && kv.head_dim == q.size(3),
               "{}: q {} must be [batch, seq, heads, head_dim] and the expansion give keys of its head_dim {} (got {})", op,
               q.shape_string(), q.ndim == 4 ? q.size(3) : 0, kv.head_dim);
  const RingShape n{q.size(0), q.size(1), q.size(2), kv.kv_heads, kv.head_dim, kv.v_head_dim};
  expect_shape(op, "packed", packed, {n.batch, n.seq, kv.width});
  check_members(op, n, cp);
  return n;
}

// K and V (or dK and dV) of one member in one flat tensor [kv_numel], so one exchange moves both.
int64_t kv_numel(const RingShape& n) { return n.batch * n.seq * n.kv_heads * (n.head_dim + n.v_dim); }
struct KvView {
  Tensor k, v;
};
KvView split(Tensor both, const RingShape& n) {
  const int64_t k_numel = n.batch * n.seq * n.kv_heads * n.head_dim;
  return {both.rows(0, k_numel).reshape({n.batch, n.seq, n.kv_heads, n.head_dim}),
          both.rows(k_numel, both.numel()).reshape({n.batch, n.seq, n.kv_heads, n.v_dim})};
}
Buffer flat(DType dtype, Device device, int64_t numel) { return Buffer(dtype, device, {numel}); }

// The running out and the accumulated gradients: f32 on the GPU (bf16 tensors), else the dtype.
DType accumulator_dtype(const Tensor& t) { return t.device == Device::cuda ? DType::f32 : t.dtype; }

int next_member(const Comm& cp) { return (cp.rank() + 1) % cp.size(); }
int previous_member(const Comm& cp) { return (cp.rank() + cp.size() - 1) % cp.size(); }
// The member whose K/V block this member holds at ring step t.
int source_at(const Comm& cp, int t) { return (cp.rank() - t + cp.size()) % cp.size(); }

// The K/V blocks that travel the ring in two slots: step t's block (slot t % 2) goes on to the next
// member while the previous member's arrives in the other, posted before the step's compute and
// joined after it. Plain blocks are read in place (the own one, t = 0, from k and v themselves);
// packed ones travel packed and are expanded on arrival, the own one into a pair kept for the whole
// op, the others into one scratch pair.
class KvRing {
 public:
  KvRing(const RingShape& n, Tensor k, Tensor v)
      : n_(n), own_{k, v}, slots_{flat(k.dtype, k.device, kv_numel(n)), flat(k.dtype, k.device, kv_numel(n))} {
    copy(split(slots_[0], n).k, k);
    copy(split(slots_[0], n).v, v);
  }
  KvRing(const RingShape& n, Tensor packed, const KvExpansion& e)
      : n_(n), e_(&e), slots_{flat(packed.dtype, packed.device, packed.numel()), flat(packed.dtype, packed.device, packed.numel())},
        expanded_{flat(packed.dtype, packed.device, kv_numel(n)), flat(packed.dtype, packed.device, kv_numel(n))} {
    copy(slots_[0], packed.reshape({packed.numel()}));
  }
  void pass_on(const Comm& cp, int t) const {
    cp.send_recv(slots_[t % 2], next_member(cp), slots_[(t + 1) % 2], previous_member(cp), "ring attention: K/V to the next member", false);
  }
  // Step t's block as k and v; a packed one is expanded by this call (once a step).
  KvView at(int t) const {
    if (!e_) return t == 0 ? own_ : split(slots_[t % 2], n_);
    const KvView into = split(expanded_[t == 0 ? 0 : 1], n_);
    e_->expand(into.k, into.v, packed(t));
    return into;
  }
  const KvExpansion* expansion() const { return e_; }
  Tensor packed(int t) const { return slots_[t % 2].view().reshape({n_.batch, n_.seq, e_->width}); }

 private:
  RingShape n_;
  const KvExpansion* e_ = nullptr;
  KvView own_;
  Buffer slots_[2], expanded_[2];
};

// The dK/dV sums that travel home with their blocks, in the accumulator's dtype: plain, of dK and
// dV themselves (the kernels add into a share slot); packed, of the packed gradient (the kernels add
// into one full pair that pack() turns into the share slot).
class GradRing {
 public:
  GradRing(const RingShape& n, DType acc, Device device, const KvExpansion* e)
      : n_(n), e_(e), share_{flat(acc, device, width()), flat(acc, device, width())}, incoming_(flat(acc, device, width())),
        full_(flat(acc, device, e ? kv_numel(n) : 0)) {}
  // Values of a share: n.batch x n.seq tokens.
  int64_t width() const { return e_ ? n_.batch * n_.seq * e_->width : kv_numel(n_); }
  // Where the kernels add step t's block's dK/dV, zeroed.
  KvView target(int t) const {
    const Tensor where = e_ ? full_.view() : share_[t % 2].view();
    fill_zero(where);
    return split(where, n_);
  }
  // Packed: step t's dK/dV (target(t)) into its share slot, against the block's packed K/V.
  void pack(int t, const KvRing& ring) const {
    if (e_) pack(share_[t % 2], full_, ring.packed(t));
  }
  // out (a share's size) = the packed gradient of the dK/dV sums `grads` (flat) of the block whose
  // packed K/V is block_packed: expand_backward in the tensors' dtype, the sums rounded to it first
  // where they are f32.
  void pack(Tensor out, Tensor grads, Tensor block_packed) const {
    const Tensor packed_out = out.reshape({n_.batch, n_.seq, e_->width});
    if (grads.dtype == block_packed.dtype) return e_->expand_backward(packed_out, split(grads, n_).k, split(grads, n_).v, block_packed);
    const Buffer rounded = flat(block_packed.dtype, block_packed.device, kv_numel(n_));
    cast(rounded, grads);
    const Buffer low(block_packed.dtype, block_packed.device, {n_.batch, n_.seq, e_->width});
    e_->expand_backward(low, split(rounded, n_).k, split(rounded, n_).v, block_packed);
    cast(packed_out, low);
  }
  Tensor share(int t) const { return share_[t % 2]; }
  Tensor incoming() const { return incoming_; }

 private:
  RingShape n_;
  const KvExpansion* e_;
  Buffer share_[2], incoming_, full_;
};

// With one member its block is the causal op over all rows (on cuDNN's or the wgmma kernels where
// chosen): its gradients are the result. Those kernels write the tensors' dtype, so on the GPU they
// land in that dtype first and are cast into the f32 sums.
void single_member_backward(Tensor dq_sum, Tensor grads, Tensor dout, Tensor q, const KvView& kv, Tensor out, Tensor lse,
                            const RingShape& n, const AttentionVariant& variant, Tensor dsinks) {
  const KvView sums = split(grads, n);
  if (dq_sum.dtype == q.dtype) return attention_backward(dq_sum, sums.k, sums.v, dsinks, dout, q, kv.k, kv.v, out, lse, variant);
  Buffer dq(q.dtype, q.device, {n.batch, n.seq, n.q_heads, n.head_dim});
  const Buffer dkv = flat(q.dtype, q.device, kv_numel(n));
  attention_backward(dq, split(dkv, n).k, split(dkv, n).v, dsinks, dout, q, kv.k, kv.v, out, lse, variant);
  cast(dq_sum, dq);
  cast(grads, dkv);
}

// With several members a member's own block (its queries against its own K/V, causal over the two
// local chunks A = [0, c) and B = [c, 2c)) runs as its chunk_blocks: A causal and B against A in full
// (unless beyond the window) first, under the K/V hop, and B causal last, under the dK/dV hop that
// brings the last K/V block's gradients home (ring_steps_backward). Their dK/dV stay home in `own`.
void own_block_backward(Tensor dq_sum, const KvView& own, Tensor dout, Tensor q, const KvView& kv, Tensor out, Tensor lse,
                        const AttentionBlock* first, const AttentionBlock* last) {
  for (const AttentionBlock* block = first; block != last; ++block)
    attention_block_backward(dq_sum, own.k, own.v, dout, q, kv.k, kv.v, out, lse, *block);
}

// Steps 1 .. CP - 1 of the backward with the own block around them (own_block_backward): step t
// holds the K/V block of member r - t; its share of dK/dV starts a sum at t = 1 (the member after
// the block's owner), each later step adds the sum that arrives from the member before, and the sum
// goes on to the next member, so that after step CP - 1 it reaches the block's owner, in `incoming`.
// `own` ends as this member's own blocks' share.
void ring_steps_backward(Tensor dq_sum, Tensor own_sum, const GradRing& grads, Tensor dout, Tensor q, const KvRing& ring, Tensor out,
                         Tensor lse, const RingShape& n, const Comm& cp, const AttentionVariant& variant) {
  const std::vector<AttentionBlock> own_blocks = chunk_blocks(n.seq, cp.rank(), cp.rank(), cp.size(), variant);
  fill_zero(own_sum);
  const KvView own = split(own_sum, n);
  ring.pass_on(cp, 0);
  Comm::Point kv_arrived = cp.queued(), grads_arrived;
  const KvView mine = ring.at(0);
  own_block_backward(dq_sum, own, dout, q, mine, out, lse, own_blocks.data(), own_blocks.data() + own_blocks.size() - 1);
  for (int t = 1; t < cp.size(); ++t) {
    cp.wait_for(kv_arrived);  // step t's K/V block, not the dK/dV hop still in flight
    if (t + 1 < cp.size()) {
      ring.pass_on(cp, t);
      kv_arrived = cp.queued();
    }
    const KvView here = ring.at(t);
    // A fused block (one kernel for all three gradients) adds its dq here too; the others' dq runs
    // after the hop is posted, so the hop travels under it.
    const std::vector<AttentionBlock> blocks = step_blocks(n.seq, cp.rank(), source_at(cp, t), cp.size(), variant);
    const KvView target = grads.target(t);
    for (const AttentionBlock& block : blocks)
      attention_block_backward(dq_sum, target.k, target.v, dout, q, here.k, here.v, out, lse, block,
                               attention_block_backward_fused(q, here.k, block, here.v) ? AttentionGrads::all : AttentionGrads::kv);
    grads.pack(t, ring);
    if (t > 1) {
      cp.wait_for(grads_arrived);
      add(grads.share(t), grads.share(t), grads.incoming());
    }
    cp.send_recv(grads.share(t), next_member(cp), grads.incoming(), previous_member(cp), "ring attention: dK/dV to the next member",
                 false);
    grads_arrived = cp.queued();
    for (const AttentionBlock& block : blocks)
      if (!attention_block_backward_fused(q, here.k, block, here.v))
        attention_block_backward(dq_sum, target.k, target.v, dout, q, here.k, here.v, out, lse, block, AttentionGrads::q);
  }
  own_block_backward(dq_sum, own, dout, q, mine, out, lse, own_blocks.data() + own_blocks.size() - 1,
                     own_blocks.data() + own_blocks.size());
  cp.wait_for(grads_arrived);
}

// out [.., Dv] and lse of q against every member's block of `ring` (ring_attention_forward).
void ring_forward(Tensor out, Tensor lse, Tensor q, const KvRing& ring, const RingShape& n, const Comm& cp, const AttentionVariant& variant) {
  Buffer part_out(out.dtype, out.device, {n.batch, n.seq, n.q_heads, n.v_dim});
  Buffer part_lse(lse.dtype, lse.device, {n.batch, n.q_heads, n.seq});
  Buffer running(accumulator_dtype(out), out.device, {n.batch, n.seq, n.q_heads, n.v_dim});
  // The own block comes first and covers every row: it starts the running result. Without a window
  // or documents it is the causal op over the local rows, so it runs on cuDNN's kernels where they
  // are chosen (ops/attention.h); with one member it is the whole op, sinks included.
  const bool causal_first = (variant.window == 0 && !variant.documents.data) || cp.size() == 1;
  if (!causal_first) {
    fill_zero(running);
    fill_constant(lse, -std::numeric_limits<double>::infinity());
  }
  for (int t = 0; t < cp.size(); ++t) {
    if (t + 1 < cp.size()) ring.pass_on(cp, t);
    const KvView here = ring.at(t);
    if (t == 0 && causal_first) {
      attention_forward(part_out, lse, q, here.k, here.v, cp.size() == 1 ? variant : AttentionVariant{});
      cast(running, part_out);
    } else {
      for (const AttentionBlock& block : step_blocks(n.seq, cp.rank(), source_at(cp, t), cp.size(), variant)) {
        attention_block_forward(part_out, part_lse, q, here.k, here.v, block);
        attention_merge(running, lse, part_out, part_lse, block.q_begin, block.q_end);
      }
    }
    if (t + 1 < cp.size()) cp.join();
  }
  if (cp.size() > 1 && variant.sinks.data) attention_sinks_merge(running, lse, variant.sinks);
  cast(out, running);
}

void check_results(const char* op, const RingShape& n, Tensor out, Tensor lse) {
  expect_shape(op, "out", out, {n.batch, n.seq, n.q_heads, n.v_dim});
  expect_shape(op, "lse", lse, {n.batch, n.q_heads, n.seq});
}

void check_gradients(const char* op, const RingShape& n, Tensor dq, Tensor dout, Tensor out, Tensor lse) {
  expect_shape(op, "dq", dq, {n.batch, n.seq, n.q_heads, n.head_dim});
  expect_shape(op, "dout", dout, {n.batch, n.seq, n.q_heads, n.v_dim});
  check_results(op, n, out, lse);
}

// dq_sum and this member's dK/dV sums of the ring's blocks: own_sum (flat) its own blocks' share;
// with several members grads.incoming() what the others sent.
void ring_backward(Tensor dq_sum, Tensor own_sum, const GradRing& grads, Tensor dout, Tensor q, const KvRing& ring, Tensor out,
                   Tensor lse, const RingShape& n, const Comm& cp, const AttentionVariant& variant, Tensor dsinks) {
  if (cp.size() == 1) return single_member_backward(dq_sum, own_sum, dout, q, ring.at(0), out, lse, n, variant, dsinks);
  ring_steps_backward(dq_sum, own_sum, grads, dout, q, ring, out, lse, n, cp, variant);
  if (variant.sinks.data) attention_sinks_backward(dsinks, dout, out, lse, variant.sinks);
}

}  // namespace

void ring_attention_forward(Tensor out, Tensor lse, Tensor q, Tensor k, Tensor v, const Comm& cp, const AttentionVariant& variant) {
  const char* op = "ring_attention_forward";
  const RingShape n = check_ring(op, q, k, v, cp);
  check_results(op, n, out, lse);
  ring_forward(out, lse, q, KvRing(n, k, v), n, cp, variant);
}

void ring_attention_forward_packed(Tensor out, Tensor lse, Tensor q, Tensor packed, const KvExpansion& kv, const Comm& cp,
                                   Tensor documents) {
  const char* op = "ring_attention_forward_packed";
  const RingShape n = check_packed(op, q, packed, kv, cp);
  check_results(op, n, out, lse);
  ring_forward(out, lse, q, KvRing(n, packed, kv), n, cp, {.documents = documents});
}

void ring_attention_backward(Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out,
                             Tensor lse, const Comm& cp, const AttentionVariant& variant, Tensor dsinks) {
  const char* op = "ring_attention_backward";
  const RingShape n = check_ring(op, q, k, v, cp);
  MARROW_CHECK(!variant.sinks.data == !dsinks.data, "{}: dsinks must be given exactly when the variant has sinks", op);
  check_gradients(op, n, dq, dout, out, lse);
  expect_shape(op, "dk", dk, {n.batch, n.seq, n.kv_heads, n.head_dim});
  expect_shape(op, "dv", dv, {n.batch, n.seq, n.kv_heads, n.v_dim});
  const DType acc = accumulator_dtype(dq);
  Buffer dq_sum = Buffer::zeros(acc, dq.device, {n.batch, n.seq, n.q_heads, n.head_dim});
  const GradRing grads(n, acc, dq.device, nullptr);
  const Buffer own = flat(acc, dq.device, kv_numel(n));
  ring_backward(dq_sum, own, grads, dout, q, KvRing(n, k, v), out, lse, n, cp, variant, dsinks);
  if (cp.size() > 1) add(own, own, grads.incoming());
  cast(dq, dq_sum);
  cast(dk, split(own, n).k);
  cast(dv, split(own, n).v);
}

void ring_attention_backward_packed(Tensor dq, Tensor dpacked, Tensor dout, Tensor q, Tensor packed, Tensor out, Tensor lse,
                                    const KvExpansion& kv, const Comm& cp, Tensor documents) {
  const char* op = "ring_attention_backward_packed";
  const RingShape n = check_packed(op, q, packed, kv, cp);
  check_gradients(op, n, dq, dout, out, lse);
  expect_shape(op, "dpacked", dpacked, {n.batch, n.seq, kv.width});
  const DType acc = accumulator_dtype(dq);
  Buffer dq_sum = Buffer::zeros(acc, dq.device, {n.batch, n.seq, n.q_heads, n.head_dim});
  const GradRing grads(n, acc, dq.device, &kv);
  const Buffer own = flat(acc, dq.device, kv_numel(n)), own_packed = flat(acc, dq.device, grads.width());
  ring_backward(dq_sum, own, grads, dout, q, KvRing(n, packed, kv), out, lse, n, cp, {.documents = documents}, {});
  grads.pack(own_packed, own, packed);
  if (cp.size() > 1) add(own_packed, own_packed, grads.incoming());
  cast(dq, dq_sum);
  cast(dpacked, own_packed.view().reshape({n.batch, n.seq, kv.width}));
}

AttentionRunner ring_attention_runner(const Comm& cp) {
  return {[&cp](Tensor out, Tensor lse, Tensor q, Tensor k, Tensor v, const AttentionVariant& variant) {
            ring_attention_forward(out, lse, q, k, v, cp, variant);
          },
          [&cp](Tensor dq, Tensor dk, Tensor dv, Tensor dsinks, Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse,
                const AttentionVariant& variant) { ring_attention_backward(dq, dk, dv, dout, q, k, v, out, lse, cp, variant, dsinks); },
          [&cp](Tensor out, Tensor lse, Tensor q, Tensor packed, const KvExpansion& kv, Tensor documents) {
            ring_attention_forward_packed(out, lse, q, packed, kv, cp, documents);
          },
          [&cp](Tensor dq, Tensor dpacked, Tensor dout, Tensor q, Tensor packed, Tensor out, Tensor lse, const KvExpansion& kv,
                Tensor documents) { ring_attention_backward_packed(dq, dpacked, dout, q, packed, out, lse, kv, cp, documents); },
          sequence_chain(cp)};
}

RingAttentionBytes ring_attention_bytes(int64_t tokens, int64_t q_heads, int64_t kv_heads, int64_t head_dim, Device device,
                                       int64_t v_head_dim) {
  const bool gpu = device == Device::cuda;
  const int64_t a = gpu ? 2 : 4, acc = 4;  // bf16 or f32 activations; f32 running results and lse
  const int64_t v_dim = v_head_dim > 0 ? v_head_dim : head_dim;
  // q-side tensors of q's head dim (dq_sum) and of v's (part_out, running); a KvPair holds K and V.
  const int64_t q = tokens * q_heads * head_dim, o = tokens * q_heads * v_dim, kv = tokens * kv_heads * (head_dim + v_dim);
  // Forward: kv[2], part_out, part_lse, running. Backward (several members): kv[2], share[2], incoming
  // and own, dq_sum.
  return {2 * kv * a + o * a + tokens * q_heads * acc + o * acc, 2 * kv * a + 4 * kv * acc + q * acc};
}

}  // namespace marrow
