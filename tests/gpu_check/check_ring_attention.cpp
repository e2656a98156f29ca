// marrow check --only ring_attention, under `mpirun -np P` (the job is the cp group; P = 1 too):
// ring attention (parallel/ring_attention.h) on the GPUs, its K/V and dK/dV hops over NCCL, against
// the CPU's causal op on the whole sequence. Every rank draws the same q, k, v, dout (rounded to
// bf16), runs the f32 reference on all S tokens, moves its zigzag share to the GPU, runs ring
// attention forward and backward there, and compares out, lse, dq, dk, dv with the reference's
// share under the bounds of the one-GPU attention check (the ring's merges and sums are f32). The
// reference's backward reads its out rounded to bf16, as the GPU's reads the bf16 out. Packed
// documents (data.document_mask) on the own kernels, boundaries inside and across chunks.
#include "gpu_check/check.h"
#include "ops/attention.h"
#include "parallel/comm.h"
#include "parallel/process.h"
#include "parallel/ring_attention.h"

namespace marrow {

namespace {

constexpr double kOutBound = 2e-2, kLseBound = 1e-4, kGradBound = 3e-2;

struct RingCase {
  int64_t batch, chunk, q_heads, kv_heads, head_dim, v_dim = 0;  // chunk: tokens per zigzag chunk; v_dim 0: head_dim
  bool documents = false;  // packed documents of 37, 150, 1, 64 and 90 tokens, cycling along each row
};

// Each token's position in its document [B, S] (i32), or none.
Buffer documents_of(const RingCase& n, int64_t seq) {
  if (!n.documents) return Buffer();
  const int64_t lengths[] = {37, 150, 1, 64, 90};
  Buffer p(DType::i32, Device::cpu, {n.batch, seq});
  for (int64_t b = 0; b < n.batch; ++b)
    for (int64_t i = 0, doc = 0, at = 0; i < seq; ++i, ++at) {
      if (at == lengths[doc % 5]) at = 0, ++doc;
      p.ptr<int32_t>()[b * seq + i] = int32_t(at);
    }
  return p;
}

// The member's zigzag share of a host tensor whole[N, S, ...]; dims is the share's shape.
Buffer share_of(Tensor whole, const ZigzagSplit& z, std::initializer_list<int64_t> dims) {
  Buffer local(DType::f32, Device::cpu, dims);
  zigzag_slice(local, whole, z);
  return local;
}

void check_ring_case(CheckReport& report, const Comm& cp, const RingCase& n, uint64_t seed) {
  const int64_t S = 2 * cp.size() * n.chunk, L = 2 * n.chunk, B = n.batch, Hq = n.q_heads, Hkv = n.kv_heads, D = n.head_dim;
  const int64_t Dv = n.v_dim ? n.v_dim : D;
  Buffer q = random_bf16({B, S, Hq, D}, seed), k = random_bf16({B, S, Hkv, D}, seed + 1), v = random_bf16({B, S, Hkv, Dv}, seed + 2),
         dout = random_bf16({B, S, Hq, Dv}, seed + 3);
  Buffer out(DType::f32, Device::cpu, {B, S, Hq, Dv}), lse(DType::f32, Device::cpu, {B, Hq, S});
  Buffer dq(DType::f32, Device::cpu, {B, S, Hq, D}), dk(DType::f32, Device::cpu, {B, S, Hkv, D}), dv(DType::f32, Device::cpu, {B, S, Hkv, Dv});
  const Buffer documents = documents_of(n, S);
  attention_forward(out, lse, q, k, v, {.documents = documents.view()});
  round_to_bf16(out);
  attention_backward(dq, dk, dv, {}, dout, q, k, v, out, lse, {.documents = documents.view()});

  const ZigzagSplit z = zigzag_split(S, cp.rank(), cp.size());
  Buffer local_documents;
  if (n.documents) {
    Buffer host(DType::i32, Device::cpu, {B, L});
    zigzag_slice(host, documents, z);
    local_documents = Buffer(DType::i32, Device::cuda, {B, L});
    copy(local_documents, host);
  }
  const AttentionVariant variant{.documents = local_documents.view()};
  auto device_share = [&](const Buffer& whole, int64_t heads, int64_t d) {
    return to_device(share_of(whole, z, {B, L, heads, d}), DType::bf16);
  };
  const Buffer gq = device_share(q, Hq, D), gk = device_share(k, Hkv, D), gv = device_share(v, Hkv, Dv), gdout = device_share(dout, Hq, Dv);
  auto rows4 = [&](const Buffer& b, int64_t heads, int64_t d) { return b.view().reshape({B, L, heads, d}); };
  Buffer gout = poisoned(DType::bf16, {B, L, Hq, Dv}), glse = poisoned(DType::f32, {B, Hq, L});
  Buffer gdq = poisoned(DType::bf16, {B, L, Hq, D}), gdk = poisoned(DType::bf16, {B, L, Hkv, D}), gdv = poisoned(DType::bf16, {B, L, Hkv, Dv});
  const Tensor lq = rows4(gq, Hq, D), lk = rows4(gk, Hkv, D), lv = rows4(gv, Hkv, Dv);
  ring_attention_forward(gout, glse, lq, lk, lv, cp, variant);
  ring_attention_backward(gdq, gdk, gdv, rows4(gdout, Hq, Dv), lq, lk, lv, gout, glse, cp, variant);

  auto label = [&](const char* what) {
    const std::string dims = Dv == D ? fmt::format("D{}", D) : fmt::format("D{} Dv{}", D, Dv);
    return fmt::format("ring attention {}{} CP{} rank {} B{} S{} H{}/{} {}", n.documents ? "documents " : "", what, cp.size(), cp.rank(), B, S,
                       Hq, Hkv, dims);
  };
  report.compare(label("out"), gout, share_of(out, z, {B, L, Hq, Dv}), kOutBound);
  Buffer lse_share = share_of(lse.view().reshape({B * Hq, S}), z, {B * Hq, L});
  report.compare(label("lse"), glse, lse_share, kLseBound);
  report.compare(label("dq"), gdq, share_of(dq, z, {B, L, Hq, D}), kGradBound);
  report.compare(label("dk"), gdk, share_of(dk, z, {B, L, Hkv, D}), kGradBound);
  report.compare(label("dv"), gdv, share_of(dv, z, {B, L, Hkv, Dv}), kGradBound);
}

}  // namespace

void check_ring_attention(CheckReport& report) {
  use_gpu(process::local_rank());
  const Comm cp = Comm::world(Device::cuda);
  // Chunks of whole and partial tiles (64 rows), GQA groups of 4 and 8, both head dims; DeepSeek-V2's
  // head dims (q, k 192, v 128: cuDNN's blocks), multi-head and a GQA group of 4.
  check_ring_case(report, cp, {2, 64, 8, 2, 64}, 700);
  check_ring_case(report, cp, {1, 100, 16, 2, 128}, 710);
  check_ring_case(report, cp, {1, 256, 32, 4, 128}, 720);
  check_ring_case(report, cp, {1, 128, 16, 16, 192, 128}, 730);
  check_ring_case(report, cp, {2, 100, 16, 4, 192, 128}, 740);
  const AttentionKernels before = attention_kernels();
  set_attention_kernels(AttentionKernels::own);  // the only kernels that take packed documents
  check_ring_case(report, cp, {2, 100, 16, 2, 64, 0, true}, 750);
  check_ring_case(report, cp, {1, 128, 8, 8, 128, 0, true}, 760);
  set_attention_kernels(before);
  add_failed_rows_of_all_ranks(report, cp, "ring_attention");
}

}  // namespace marrow
