// marrow check --only ring_attention, under `mpirun -np P` (the job is the cp group; P = 1 too):
// ring attention (parallel/ring_attention.h) on the GPUs, its K/V and dK/dV hops over NCCL, against
// the CPU's causal op on the whole sequence. Every rank draws the same q, k, v, dout (rounded to
// bf16), runs the f32 reference on all S tokens, moves its zigzag share to the GPU, runs ring
// attention forward and backward there, and compares out, lse, dq, dk, dv with the reference's
// share under the bounds of the one-GPU attention check (the ring's merges and sums are f32). The
// reference's backward reads its out rounded to bf16, as the GPU's reads the bf16 out.
#include "gpu_check/check.h"
#include "ops/attention.h"
#include "parallel/comm.h"
#include "parallel/process.h"
#include "parallel/ring_attention.h"

namespace marrow {

namespace {

constexpr double kOutBound = 2e-2, kLseBound = 1e-4, kGradBound = 3e-2;

struct RingCase {
  int64_t batch, chunk, q_heads, kv_heads, head_dim;  // chunk: tokens per zigzag chunk
};

// The member's zigzag share of a host tensor whole[N, S, ...]; dims is the share's shape.
Buffer share_of(Tensor whole, const ZigzagSplit& z, std::initializer_list<int64_t> dims) {
  Buffer local(DType::f32, Device::cpu, dims);
  zigzag_slice(local, whole, z);
  return local;
}

void check_ring_case(CheckReport& report, const Comm& cp, const RingCase& n, uint64_t seed) {
  const int64_t S = 2 * cp.size() * n.chunk, L = 2 * n.chunk, B = n.batch, Hq = n.q_heads, Hkv = n.kv_heads, D = n.head_dim;
  Buffer q = random_bf16({B, S, Hq, D}, seed), k = random_bf16({B, S, Hkv, D}, seed + 1), v = random_bf16({B, S, Hkv, D}, seed + 2),
         dout = random_bf16({B, S, Hq, D}, seed + 3);
  Buffer out(DType::f32, Device::cpu, {B, S, Hq, D}), lse(DType::f32, Device::cpu, {B, Hq, S});
  Buffer dq(DType::f32, Device::cpu, {B, S, Hq, D}), dk(DType::f32, Device::cpu, {B, S, Hkv, D}), dv(DType::f32, Device::cpu, {B, S, Hkv, D});
  attention_forward(out, lse, q, k, v);
  round_to_bf16(out);
  attention_backward(dq, dk, dv, dout, q, k, v, out, lse);

  const ZigzagSplit z = zigzag_split(S, cp.rank(), cp.size());
  auto device_share = [&](const Buffer& whole, int64_t heads) {
    return to_device(share_of(whole, z, {B, L, heads, D}), DType::bf16);
  };
  const Buffer gq = device_share(q, Hq), gk = device_share(k, Hkv), gv = device_share(v, Hkv), gdout = device_share(dout, Hq);
  auto rows4 = [&](const Buffer& b, int64_t heads) { return b.view().reshape({B, L, heads, D}); };
  Buffer gout = poisoned(DType::bf16, {B, L, Hq, D}), glse = poisoned(DType::f32, {B, Hq, L});
  Buffer gdq = poisoned(DType::bf16, {B, L, Hq, D}), gdk = poisoned(DType::bf16, {B, L, Hkv, D}), gdv = poisoned(DType::bf16, {B, L, Hkv, D});
  ring_attention_forward(gout, glse, rows4(gq, Hq), rows4(gk, Hkv), rows4(gv, Hkv), cp);
  ring_attention_backward(gdq, gdk, gdv, rows4(gdout, Hq), rows4(gq, Hq), rows4(gk, Hkv), rows4(gv, Hkv), gout, glse, cp);

  auto label = [&](const char* what) {
    return fmt::format("ring attention {} CP{} rank {} B{} S{} H{}/{} D{}", what, cp.size(), cp.rank(), B, S, Hq, Hkv, D);
  };
  report.compare(label("out"), gout, share_of(out, z, {B, L, Hq, D}), kOutBound);
  Buffer lse_share = share_of(lse.view().reshape({B * Hq, S}), z, {B * Hq, L});
  report.compare(label("lse"), glse, lse_share, kLseBound);
  report.compare(label("dq"), gdq, share_of(dq, z, {B, L, Hq, D}), kGradBound);
  report.compare(label("dk"), gdk, share_of(dk, z, {B, L, Hkv, D}), kGradBound);
  report.compare(label("dv"), gdv, share_of(dv, z, {B, L, Hkv, D}), kGradBound);
}

}  // namespace

void check_ring_attention(CheckReport& report) {
  use_gpu(process::local_rank());
  const Comm cp = Comm::world(Device::cuda);
  // Chunks of whole and partial tiles (64 rows), GQA groups of 4 and 8, both head dims.
  check_ring_case(report, cp, {2, 64, 8, 2, 64}, 700);
  check_ring_case(report, cp, {1, 100, 16, 2, 128}, 710);
  check_ring_case(report, cp, {1, 256, 32, 4, 128}, 720);
  add_failed_rows_of_all_ranks(report, cp, "ring_attention");
}

}  // namespace marrow
