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
// window, reach into it; each carries the window and the distance between its chunks' positions.
// Source = rank gives its own chunk first causally, the later chunk against it, the later causally.
std::vector<AttentionBlock> chunk_blocks(int64_t local_seq, int rank, int source, int ranks, int64_t window) {
  const int64_t c = local_seq / 2;
  auto position = [&](int member, int64_t half) { return (half == 0 ? member : 2 * ranks - 1 - member) * c; };
  std::vector<AttentionBlock> blocks;
  for (int64_t qh = 0; qh < 2; ++qh)
    for (int64_t kh = 0; kh < 2; ++kh) {
      const int64_t qp = position(rank, qh), kp = position(source, kh);
      if (kp > qp || (window > 0 && kp + c - 1 <= qp - window)) continue;
      blocks.push_back({kp == qp ? AttentionMask::causal : AttentionMask::full, qh * c, qh * c + c, kh * c, kh * c + c, window, qp - kp});
    }
  return blocks;
}

// The blocks of a ring step: zigzag_block's one block without a window, chunk_blocks with one.
std::vector<AttentionBlock> step_blocks(int64_t local_seq, int rank, int source, int ranks, int64_t window) {
  if (window == 0) return {zigzag_block(local_seq, rank, source)};
  return chunk_blocks(local_seq, rank, source, ranks, window);
}

struct RingShape {
  int64_t batch, seq, q_heads, kv_heads, head_dim, v_dim;  // head_dim: q's and k's; v_dim: v's and out's
};

// q, k, v of one member; a split over several members needs an even local length (two chunks).
RingShape check_ring(const char* op, const Tensor& q, const Tensor& k, const Tensor& v, const Comm& cp) {
  MARROW_CHECK(q.ndim == 4 && k.ndim == 4 && v.ndim == 4, "{}: q {}, k {} and v {} must be [batch, seq, heads, head_dim]", op,
               q.shape_string(), k.shape_string(), v.shape_string());
  const RingShape n{q.size(0), q.size(1), q.size(2), k.size(2), q.size(3), v.size(3)};
  expect_shape(op, "k", k, {n.batch, n.seq, n.kv_heads, n.head_dim});
  expect_shape(op, "v", v, {n.batch, n.seq, n.kv_heads, n.v_dim});
  MARROW_CHECK(cp.size() == 1 || n.seq % 2 == 0,
               "{}: a member's {} tokens are not two zigzag chunks (the length must be even)", op, n.seq);
  return n;
}

// K and V (or dK and dV) of one member in one buffer, so one exchange moves both.
struct KvPair {
  Buffer both;
  KvPair(DType dtype, Device device, const RingShape& n)
      : both(dtype, device, {n.batch * n.seq * n.kv_heads * (n.head_dim + n.v_dim)}) {}
  Tensor k(const RingShape& n) const {
    return both.view().rows(0, k_numel(n)).reshape({n.batch, n.seq, n.kv_heads, n.head_dim});
  }
  Tensor v(const RingShape& n) const {
    return both.view().rows(k_numel(n), both.numel()).reshape({n.batch, n.seq, n.kv_heads, n.v_dim});
  }
  static int64_t k_numel(const RingShape& n) { return n.batch * n.seq * n.kv_heads * n.head_dim; }
};

// The running out and the accumulated gradients: f32 on the GPU (bf16 tensors), else the dtype.
DType accumulator_dtype(const Tensor& t) { return t.device == Device::cuda ? DType::f32 : t.dtype; }

int next_member(const Comm& cp) { return (cp.rank() + 1) % cp.size(); }
int previous_member(const Comm& cp) { return (cp.rank() + cp.size() - 1) % cp.size(); }
// The member whose K/V block this member holds at ring step t.
int source_at(const Comm& cp, int t) { return (cp.rank() - t + cp.size()) % cp.size(); }

// Step t's K/V block (this one) goes on to the next member while the previous member's arrives in
// `next`; posted before the step's compute, joined after it.
void pass_on(const Comm& cp, const KvPair& kv, const KvPair& next) {
  cp.send_recv(kv.both, next_member(cp), next.both, previous_member(cp), "ring attention: K/V to the next member",
               false);
}

// With one member its block is the causal op over all rows (on cuDNN's or the wgmma kernels where
// chosen): its gradients are the result. Those kernels write the tensors' dtype, so on the GPU they
// land in bf16 first and are cast into the f32 sums.
void single_member_backward(Tensor dq_sum, const KvPair& grads, Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse,
                            const RingShape& n, const AttentionVariant& variant, Tensor dsinks) {
  if (dq_sum.dtype == q.dtype) return attention_backward(dq_sum, grads.k(n), grads.v(n), dsinks, dout, q, k, v, out, lse, variant);
  Buffer dq(q.dtype, q.device, {n.batch, n.seq, n.q_heads, n.head_dim});
  const KvPair dkv{q.dtype, q.device, n};
  attention_backward(dq, dkv.k(n), dkv.v(n), dout, q, k, v, out, lse);
  cast(dq_sum, dq);
  cast(grads.both, dkv.both);
}

// With several members a member's own block (its queries against its own K/V, causal over the two
// local chunks A = [0, c) and B = [c, 2c)) runs as its chunk_blocks: A causal and B against A in full
// (unless beyond the window) first, under the K/V hop, and B causal last, under the dK/dV hop that
// brings the last K/V block's gradients home (ring_attention_backward). Their dK/dV stay home in `own`.
void own_block_backward(Tensor dq_sum, const KvPair& own, Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse,
                        const RingShape& n, const AttentionBlock* first, const AttentionBlock* last) {
  for (const AttentionBlock* block = first; block != last; ++block)
    attention_block_backward(dq_sum, own.k(n), own.v(n), dout, q, k, v, out, lse, *block);
}

// Steps 1 .. CP - 1 of the backward with the own block around them (own_block_backward): step t
// holds the K/V block of member r - t; its share of dK/dV starts a sum at t = 1 (the member after
// the block's owner), each later step adds the sum that arrives from the member before, and the sum
// goes on to the next member, so that after step CP - 1 it reaches the block's owner. `own` ends as
// this member's dK/dV: its own blocks' share plus the sum the others sent.
void ring_steps_backward(Tensor dq_sum, const KvPair& own, Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse,
                         const RingShape& n, const Comm& cp, int64_t window) {
  const std::vector<AttentionBlock> own_blocks = chunk_blocks(n.seq, cp.rank(), cp.rank(), cp.size(), window);
  const DType acc = own.both.view().dtype;
  KvPair kv[2] = {{k.dtype, k.device, n}, {k.dtype, k.device, n}};
  copy(kv[0].k(n), k);
  copy(kv[0].v(n), v);
  // Two share buffers: step t + 1 fills one while step t's is in flight.
  KvPair share[2] = {{acc, k.device, n}, {acc, k.device, n}}, incoming{acc, k.device, n};
  fill_zero(own.both);
  pass_on(cp, kv[0], kv[1]);
  Comm::Point kv_arrived = cp.queued(), grads_arrived;
  own_block_backward(dq_sum, own, dout, q, k, v, out, lse, n, own_blocks.data(), own_blocks.data() + own_blocks.size() - 1);
  for (int t = 1; t < cp.size(); ++t) {
    cp.wait_for(kv_arrived);  // step t's K/V block, not the dK/dV hop still in flight
    const KvPair& here = kv[t % 2];
    if (t + 1 < cp.size()) {
      pass_on(cp, here, kv[(t + 1) % 2]);
      kv_arrived = cp.queued();
    }
    const KvPair& mine = share[t % 2];
    // A fused block (one kernel for all three gradients) adds its dq here too; the others' dq runs
    // after the hop is posted, so the hop travels under it.
    const std::vector<AttentionBlock> blocks = step_blocks(n.seq, cp.rank(), source_at(cp, t), cp.size(), window);
    fill_zero(mine.both);
    for (const AttentionBlock& block : blocks)
      attention_block_backward(dq_sum, mine.k(n), mine.v(n), dout, q, here.k(n), here.v(n), out, lse, block,
                               attention_block_backward_fused(q, here.k(n), block, here.v(n)) ? AttentionGrads::all : AttentionGrads::kv);
    if (t > 1) {
      cp.wait_for(grads_arrived);
      add(mine.both, mine.both, incoming.both);
    }
    cp.send_recv(mine.both, next_member(cp), incoming.both, previous_member(cp), "ring attention: dK/dV to the next member",
                 false);
    grads_arrived = cp.queued();
    for (const AttentionBlock& block : blocks)
      if (!attention_block_backward_fused(q, here.k(n), block, here.v(n)))
        attention_block_backward(dq_sum, mine.k(n), mine.v(n), dout, q, here.k(n), here.v(n), out, lse, block, AttentionGrads::q);
  }
  own_block_backward(dq_sum, own, dout, q, k, v, out, lse, n, own_blocks.data() + own_blocks.size() - 1,
                     own_blocks.data() + own_blocks.size());
  cp.wait_for(grads_arrived);
  add(own.both, own.both, incoming.both);
}

}  // namespace

void ring_attention_forward(Tensor out, Tensor lse, Tensor q, Tensor k, Tensor v, const Comm& cp, const AttentionVariant& variant) {
  const char* op = "ring_attention_forward";
  const RingShape n = check_ring(op, q, k, v, cp);
  expect_shape(op, "out", out, {n.batch, n.seq, n.q_heads, n.v_dim});
  expect_shape(op, "lse", lse, {n.batch, n.q_heads, n.seq});
  KvPair kv[2] = {{k.dtype, k.device, n}, {k.dtype, k.device, n}};
  copy(kv[0].k(n), k);
  copy(kv[0].v(n), v);
  Buffer part_out(out.dtype, out.device, {n.batch, n.seq, n.q_heads, n.v_dim});
  Buffer part_lse(lse.dtype, lse.device, {n.batch, n.q_heads, n.seq});
  Buffer running(accumulator_dtype(out), out.device, {n.batch, n.seq, n.q_heads, n.v_dim});
  // The own block comes first and covers every row: it starts the running result. Without a window it
  // is the causal op over the local rows, so it runs on cuDNN's kernels where they are chosen
  // (ops/attention.h); with one member it is the whole op, sinks included.
  const bool causal_first = variant.window == 0 || cp.size() == 1;
  if (!causal_first) {
    fill_zero(running);
    fill_constant(lse, -std::numeric_limits<double>::infinity());
  }
  for (int t = 0; t < cp.size(); ++t) {
    const KvPair& here = kv[t % 2];
    if (t + 1 < cp.size()) pass_on(cp, here, kv[(t + 1) % 2]);
    if (t == 0 && causal_first) {
      attention_forward(part_out, lse, q, here.k(n), here.v(n), cp.size() == 1 ? variant : AttentionVariant{});
      cast(running, part_out);
    } else {
      for (const AttentionBlock& block : step_blocks(n.seq, cp.rank(), source_at(cp, t), cp.size(), variant.window)) {
        attention_block_forward(part_out, part_lse, q, here.k(n), here.v(n), block);
        attention_merge(running, lse, part_out, part_lse, block.q_begin, block.q_end);
      }
    }
    if (t + 1 < cp.size()) cp.join();
  }
  if (cp.size() > 1 && variant.sinks.data) attention_sinks_merge(running, lse, variant.sinks);
  cast(out, running);
}

void ring_attention_backward(Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out,
                             Tensor lse, const Comm& cp, const AttentionVariant& variant, Tensor dsinks) {
  const char* op = "ring_attention_backward";
  const RingShape n = check_ring(op, q, k, v, cp);
  MARROW_CHECK(!variant.sinks.data == !dsinks.data, "{}: dsinks must be given exactly when the variant has sinks", op);
  expect_shape(op, "dq", dq, {n.batch, n.seq, n.q_heads, n.head_dim});
  for (auto [name, t] : {std::pair{"dout", &dout}, std::pair{"out", &out}})
    expect_shape(op, name, *t, {n.batch, n.seq, n.q_heads, n.v_dim});
  expect_shape(op, "dk", dk, {n.batch, n.seq, n.kv_heads, n.head_dim});
  expect_shape(op, "dv", dv, {n.batch, n.seq, n.kv_heads, n.v_dim});
  expect_shape(op, "lse", lse, {n.batch, n.q_heads, n.seq});
  const DType acc = accumulator_dtype(dq);
  Buffer dq_sum = Buffer::zeros(acc, dq.device, {n.batch, n.seq, n.q_heads, n.head_dim});
  const KvPair own{acc, k.device, n};
  if (cp.size() == 1) {
    single_member_backward(dq_sum, own, dout, q, k, v, out, lse, n, variant, dsinks);
  } else {
    ring_steps_backward(dq_sum, own, dout, q, k, v, out, lse, n, cp, variant.window);
    if (variant.sinks.data) attention_sinks_backward(dsinks, dout, out, lse, variant.sinks);
  }
  cast(dq, dq_sum);
  cast(dk, own.k(n));
  cast(dv, own.v(n));
}

AttentionRunner ring_attention_runner(const Comm& cp) {
  return {[&cp](Tensor out, Tensor lse, Tensor q, Tensor k, Tensor v, const AttentionVariant& variant) {
            ring_attention_forward(out, lse, q, k, v, cp, variant);
          },
          [&cp](Tensor dq, Tensor dk, Tensor dv, Tensor dsinks, Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse,
                const AttentionVariant& variant) { ring_attention_backward(dq, dk, dv, dout, q, k, v, out, lse, cp, variant, dsinks); }};
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
