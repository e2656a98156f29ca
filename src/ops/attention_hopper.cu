// The causal GQA attention forward (ops/attention.h; CPU reference: attention.cu's forward_cpu) on
// Hopper's wgmma, head_dim 128 and lengths a multiple of 128, and the entry points of
// ops/attention_hopper.h (the backward's kernels: attention_hopper_backward.cu).
//
// An item is (query block of 128 rows, head): blockIdx order, the longest walks (last query blocks)
// first; no item depends on another. The block keeps Q in shared memory and walks the key blocks
// from the diagonal (masked) down to 0 (a full block: from its last key block, none masked), K and V
// in rings of three tiles each (producer thread, TMA). Each consumer warpgroup (64 rows) computes
// S = Q K^T (wgmma, 64 x 128), the online softmax in the log2 domain in registers, and O += P V (P
// as the A operand from registers). The two consumers take the tensor cores in turns (named barriers
// kTurn + w), so that one's softmax runs under the other's multiplies, and within a consumer O += P V
// of one block runs under the softmax of the next (forward_step). At the end O / l goes back through
// the consumer's rows of the Q tile to a TMA store; lse = (m + log2 l) ln 2.
// Invariants: every wgmma's registers stay fenced until its wait (ptxas serialises all of a kernel's
// wgmmas if any register they use may change while one is in flight: C7515, which fails the build);
// K and V in separate rings, K of a block free once its S is done, V a turn later after its O += P V.
// Gotcha: ptxas hoists a wgmma.wait_group into any stall slot of the same basic block, so a wait meant
// to come after some work must start a block: forward_step's wait for the last O += P V sits after
// the mbarrier waits' loops, which ptxas does not schedule across (inside the softmax it would end
// the overlap).
#include "ops/attention_hopper.h"

#include <algorithm>
#include <cmath>
#include <initializer_list>

#include "core/cuda_check.h"
#include "core/memory.h"
#include "ops/common.h"

#ifdef __CUDACC__
#include "ops/attention_hopper.cuh"
#endif

namespace marrow {

bool hopper_attention_supports(int64_t seq, int64_t q_heads, int64_t kv_heads, int64_t head_dim) {
  return MARROW_CUDA && head_dim == 128 && seq > 0 && seq % 128 == 0 && kv_heads > 0 && q_heads % kv_heads == 0;
}

bool hopper_attention_serves_block(const Tensor& q, const Tensor& k, const AttentionBlock& block) {
  const int64_t q_rows = block.q_end - block.q_begin, k_rows = block.k_end - block.k_begin;
  return hopper_attention_supports(128, q.size(2), k.size(2), q.size(3)) && q_rows > 0 && q_rows % 128 == 0 && k_rows > 0 &&
         k_rows % 128 == 0 && q.size(1) % 4 == 0 && block.q_begin % 4 == 0 && (block.mask == AttentionMask::full || q_rows == k_rows) &&
         block.window == 0;
}

#ifdef __CUDACC__
namespace {

using namespace hopper_attention;

constexpr int kFwdTileQ = 0, kFwdTilesK = 32768, kFwdRing = 3, kFwdTileBytes = 32768;
constexpr int kFwdTilesV = kFwdTilesK + kFwdRing * kFwdTileBytes, kFwdBarriers = kFwdTilesV + kFwdRing * kFwdTileBytes;
// Past kFwdBarriers: Q full, then K full, K empty, V full, V empty (kFwdRing each).
constexpr int kFwdFullK = 8, kFwdEmptyK = kFwdFullK + 8 * kFwdRing, kFwdFullV = kFwdEmptyK + 8 * kFwdRing,
              kFwdEmptyV = kFwdFullV + 8 * kFwdRing;
constexpr int kFwdSmemBytes = kFwdBarriers + 128 + 1024;
static_assert(kFwdSmemBytes <= 232448, "the forward's shared memory exceeds the 227 KiB a block may have");
constexpr int kTurn = 1, kFwdRowsDone = 3;  // named barriers: consumer w's turn; consumer w's O staged
constexpr float kLn2 = 0.6931471805599453f;

struct ForwardArgs {
  float* lse;                          // [B, Hq, q_seq]
  int q_seq, k_seq, q_first, k_first;  // as Args'
  int q_heads, kv_heads, heads, blocks, key_blocks;  // blocks: of 128 query rows
  bool full;
  float scale_log2;
  // Always 0, but unknown to the compiler: a step's copy of P's fragments (forward_step) keeps the old
  // ones under it, which keeps their registers allocated until then. Without a later use ptxas would
  // reuse them while O += P V still reads them, and wait for that multiply first.
  uint32_t zero;
};

__device__ __forceinline__ void tma_store_2d(const CUtensorMap* map, uint32_t src, int c0, int c1) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];" ::"l"(map), "r"(src), "r"(c0), "r"(c1)
               : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

// The online softmax of one key block for one consumer's rows (row0 and row0 + 8 of each warp),
// without touching O (O += P V of the block before may still be running): masks keys past the query
// on the diagonal, turns s into exp2(s scale - m) in place with the new running maximum m (scaled
// scores, log2 domain; the scale enters the exponent's multiply-add, never the scores) and adds them
// to the rescaled row sums l; returns each row's correction exp2(m_old - m) for O.
__device__ __forceinline__ void softmax_scores(float (&s)[64], float (&m)[2], float (&l)[2], float (&correction)[2], bool diagonal,
                                               int key0, int row0, float scale_log2) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float top = -INFINITY;
#pragma unroll
    for (int j = 0; j < 16; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float& x = s[4 * j + 2 * h + e];
        if (diagonal && key0 + 8 * j + 2 * (lane % 4) + e > row0 + 8 * h) x = -INFINITY;
        top = fmaxf(top, x);
      }
    top = fmaxf(top, __shfl_xor_sync(~0u, top, 1));
    top = fmaxf(top, __shfl_xor_sync(~0u, top, 2));
    top = fmaxf(m[h], top * scale_log2);
    correction[h] = fast_exp2(m[h] - top);  // 0 on the first block (m = -inf; top is finite: a row sees itself)
    m[h] = top;
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < 16; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float& x = s[4 * j + 2 * h + e];
        x = fast_exp2(fmaf(x, scale_log2, -top));
        sum += x;
      }
    l[h] = l[h] * correction[h] + sum;
  }
}
// O rescaled to the running maximum of the last softmax (once the O += P V before it is done).
__device__ __forceinline__ void rescale(float (&o)[64], const float (&correction)[2]) {
#pragma unroll
  for (int j = 0; j < 16; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      o[4 * j + 2 * h] *= correction[h];
      o[4 * j + 2 * h + 1] *= correction[h];
    }
}
// P as bf16 A fragments (four words per 16 keys).
__device__ __forceinline__ void pack(uint32_t (&p_frag)[32], const float (&s)[64]) {
#pragma unroll
  for (int ks = 0; ks < 8; ++ks)
#pragma unroll
    for (int r = 0; r < 4; ++r) p_frag[4 * ks + r] = pack_bf16(s[8 * ks + 2 * r], s[8 * ks + 2 * r + 1]);
}

// Consumer w's O / l as bf16 into its 64 rows of the Q tile (the TMA boxes' swizzled layout), then
// one thread stores both boxes; lse of its rows.
__device__ void store_forward(const CUtensorMap* out_map, const ForwardArgs& a, uint32_t base, unsigned char* smem, int w, int head,
                              int query_block, float (&o)[64], float (&m)[2], float (&l)[2]) {
  const int lane = threadIdx.x % 32, local = 16 * (threadIdx.x / 32 % 4) + lane / 4;
  const int b = head / a.q_heads, h = head % a.q_heads, row0 = a.q_first + kKeys * query_block + 64 * w + local;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    l[i] += __shfl_xor_sync(~0u, l[i], 1);
    l[i] += __shfl_xor_sync(~0u, l[i], 2);
    const int row = 64 * w + local + 8 * i;
    const float inverse = 1.0f / l[i];
#pragma unroll
    for (int j = 0; j < 16; ++j)
      *reinterpret_cast<uint32_t*>(smem + kFwdTileQ + (j / 8) * 16384 + row * 128 + (((j % 8) ^ (row & 7)) << 4) + 4 * (lane % 4)) =
          pack_bf16(o[4 * j + 2 * i] * inverse, o[4 * j + 2 * i + 1] * inverse);
    if (lane % 4 == 0) a.lse[int64_t(head) * a.q_seq + row0 + 8 * i] = (m[i] + log2f(l[i])) * kLn2;
  }
  fence_async_shared();
  named_sync(kFwdRowsDone + w, 128);
  if (threadIdx.x % 128 == 0) {
    for (int j = 0; j < 2; ++j)
      tma_store_2d(out_map, base + kFwdTileQ + j * 16384 + w * 8192, h * kDim + 64 * j, b * a.q_seq + row0 - local);
    bulk_wait_read();
  }
}

// S = Q K^T of consumer w's 64 rows against the 128 keys of k_tile.
__device__ __forceinline__ void issue_scores(float (&sc)[64], uint32_t base, uint32_t k_tile, int w) {
#pragma unroll
  for (int kk = 0; kk < 8; ++kk)
    mma_m64n128k16_ss(sc, descriptor(base + kFwdTileQ + (kk / 4) * 16384 + w * 8192 + (kk % 4) * 32, 16, 1024),
                      descriptor(k_tile + (kk / 4) * 16384 + (kk % 4) * 32, 16, 1024), kk > 0);
}
// O += P V, P from registers; B = V, N-major: 16 keys = 2048 bytes, the two 64-dim boxes 16 KiB apart.
__device__ __forceinline__ void issue_values(float (&o)[64], const uint32_t (&p_frag)[32], uint32_t v_tile) {
#pragma unroll
  for (int ks = 0; ks < 8; ++ks) mma_m64n128k16_rs(o, p_frag + 4 * ks, descriptor(v_tile + ks * 2048, 16384, 1024));
}

// One consumer's state over its walk: O, the softmax's running maximum m, row sums l and the
// correction O still owes (the last softmax's exp2(m_old - m)); P of the last softmax (next) and the
// P that O += P V reads (prev: next copied at each step, while next takes the step's new P).
struct ForwardRows {
  float o[64], m[2], l[2], correction[2];
  uint32_t prev[32], next[32];
  int row0;  // the thread's first row (and row0 + 8)
};

// O += P V of the last softmax is done: O rescaled to its maximum, its P copied to prev (the old
// values kept under ForwardArgs::zero).
__device__ __forceinline__ void take_last_softmax(ForwardRows& r, uint32_t zero) {
  rescale(r.o, r.correction);
#pragma unroll
  for (int i = 0; i < 32; ++i) r.prev[i] = r.next[i] | (r.prev[i] & zero);
}

// Walk step it >= 1 of consumer w: S of the walk's key block it, and O += P V of the block before,
// then the softmax of S. Its turn on the tensor cores issues S and then O += P V as two commit
// groups; the softmax starts once S is done while O += P V still runs, and the wait for it at the
// next step finds it long done. The mbarrier waits' loops start each step: ptxas does not move the
// wait above them into the softmax before, as it does within one block of code.
__device__ __forceinline__ void forward_step(ForwardRows& r, const ForwardArgs& a, uint32_t base, int w, int it) {
  const uint32_t bars = base + kFwdBarriers;
  const int k_slot = it % kFwdRing, v_slot = (it - 1) % kFwdRing, lane = threadIdx.x % 32;
  barrier_wait(bars + kFwdFullK + 8 * k_slot, (it / kFwdRing) & 1);
  barrier_wait(bars + kFwdFullV + 8 * v_slot, ((it - 1) / kFwdRing) & 1);
  mma_wait<0>();  // O += P V of step it - 2
  fence_registers(r.o);
  fence_registers(r.prev);
  if (it >= 2 && lane == 0) barrier_arrive(bars + kFwdEmptyV + 8 * ((it - 2) % kFwdRing));
  take_last_softmax(r, a.zero);
  fence_registers(r.o);
  fence_registers(r.prev);
  float sc[64];
  named_sync(kTurn + w, 256);
  mma_fence();
  issue_scores(sc, base, base + kFwdTilesK + k_slot * kFwdTileBytes, w);
  mma_commit();
  issue_values(r.o, r.prev, base + kFwdTilesV + v_slot * kFwdTileBytes);
  mma_commit();
  named_arrive(kTurn + 1 - w, 256);
  mma_wait<1>();  // S
  fence_registers(sc);
  if (lane == 0) barrier_arrive(bars + kFwdEmptyK + 8 * k_slot);
  softmax_scores(sc, r.m, r.l, r.correction, false, 0, r.row0, a.scale_log2);
  pack(r.next, sc);
}

// Consumer warpgroup w: rows query_block * 128 + 64 w .. + 63: the first key block's S and softmax
// (the diagonal, masked, unless the block is full), the steps, the last O += P V. The turns alternate
// through the named barriers kTurn + w (consumer 1's arrive opens the first); each consumer takes
// iterations + 1 turns, and consumer 1 does not open a turn after its last.
__device__ void consume_forward(const CUtensorMap* out_map, const ForwardArgs& a, uint32_t base, unsigned char* smem, int w, int head,
                                int query_block) {
  const uint32_t bars = base + kFwdBarriers;
  ForwardRows r;
  r.row0 = kKeys * query_block + 64 * w + 16 * (threadIdx.x / 32 % 4) + threadIdx.x % 32 / 4;
#pragma unroll
  for (int i = 0; i < 64; ++i) r.o[i] = 0.0f;
#pragma unroll
  for (int i = 0; i < 32; ++i) r.prev[i] = 0u;
  r.m[0] = r.m[1] = -INFINITY, r.l[0] = r.l[1] = 0.0f;
  barrier_wait(bars, 0);  // Q
  if (w == 1) named_arrive(kTurn, 256);
  {
    float sc[64];
    barrier_wait(bars + kFwdFullK, 0);
    named_sync(kTurn + w, 256);
    mma_fence();
    issue_scores(sc, base, base + kFwdTilesK, w);
    mma_commit();
    named_arrive(kTurn + 1 - w, 256);
    mma_wait<0>();
    fence_registers(sc);
    if (threadIdx.x % 32 == 0) barrier_arrive(bars + kFwdEmptyK);
    softmax_scores(sc, r.m, r.l, r.correction, !a.full, kKeys * query_block, r.row0, a.scale_log2);
    pack(r.next, sc);
  }
  const int iterations = a.full ? a.key_blocks : query_block + 1;
  for (int it = 1; it < iterations; ++it) forward_step(r, a, base, w, it);
  barrier_wait(bars + kFwdFullV + 8 * ((iterations - 1) % kFwdRing), ((iterations - 1) / kFwdRing) & 1);
  mma_wait<0>();
  fence_registers(r.o);
  fence_registers(r.prev);
  take_last_softmax(r, a.zero);
  fence_registers(r.o);
  fence_registers(r.prev);
  named_sync(kTurn + w, 256);
  mma_fence();
  issue_values(r.o, r.prev, base + kFwdTilesV + ((iterations - 1) % kFwdRing) * kFwdTileBytes);
  mma_commit();
  if (w == 0) named_arrive(kTurn + 1 - w, 256);
  mma_wait<0>();
  fence_registers(r.o);
  fence_registers(r.prev);
  store_forward(out_map, a, base, smem, w, head, query_block, r.o, r.m, r.l);
}

__global__ void __launch_bounds__(kThreads, 1)
    forward_kernel(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap k_map,
                   const __grid_constant__ CUtensorMap v_map, const __grid_constant__ CUtensorMap out_map, const ForwardArgs a) {
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw = smem_address(smem_raw), base = (raw + 1023) & ~1023u;
  unsigned char* smem = smem_raw + (base - raw);
  const int query_block = a.blocks - 1 - int(blockIdx.x) / a.heads, head = int(blockIdx.x) % a.heads;
  if (threadIdx.x == 0) barrier_init(base + kFwdBarriers, 1);
  init_stage_barriers(base + kFwdBarriers + kFwdFullK, base + kFwdBarriers + kFwdEmptyK, kFwdRing, 2);
  init_stage_barriers(base + kFwdBarriers + kFwdFullV, base + kFwdBarriers + kFwdEmptyV, kFwdRing, 2);  // ends in __syncthreads
  begin_after_previous_grid();
  const int warpgroup = threadIdx.x / 128;
  if (warpgroup == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (threadIdx.x != 0) return;
    const int b = head / a.q_heads, h = head % a.q_heads, kvh = h / (a.q_heads / a.kv_heads);
    const uint32_t bars = base + kFwdBarriers;
    barrier_expect_bytes(bars, 32768);
    for (int j = 0; j < 2; ++j)
      tma_load_2d(base + kFwdTileQ + j * 16384, &q_map, bars, h * kDim + 64 * j, b * a.q_seq + a.q_first + kKeys * query_block);
    const int first_key_block = a.full ? a.key_blocks - 1 : query_block;
    for (int it = 0; it <= first_key_block; ++it) {
      const int s = it % kFwdRing, parity = ((it / kFwdRing) & 1) ^ 1,
                row = b * a.k_seq + a.k_first + kKeys * (first_key_block - it);
      const CUtensorMap* maps[2] = {&k_map, &v_map};
      const int full[2] = {kFwdFullK, kFwdFullV}, empty[2] = {kFwdEmptyK, kFwdEmptyV}, tiles[2] = {kFwdTilesK, kFwdTilesV};
      for (int t = 0; t < 2; ++t) {  // K, then V
        barrier_wait(bars + empty[t] + 8 * s, parity);
        barrier_expect_bytes(bars + full[t] + 8 * s, kFwdTileBytes);
        for (int j = 0; j < 2; ++j)
          tma_load_2d(base + tiles[t] + s * kFwdTileBytes + j * 16384, maps[t], bars + full[t] + 8 * s, kvh * kDim + 64 * j, row);
      }
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
  consume_forward(&out_map, a, base, smem, warpgroup - 1, head, query_block);
}

using NamedTensors = std::initializer_list<std::pair<const char*, const Tensor*>>;

Geometry block_geometry(const Tensor& q, const Tensor& k, const AttentionBlock& block) {
  return {q.size(0),     q.size(1),     k.size(1),    q.size(2), k.size(2), block.q_begin, block.q_end - block.q_begin,
          block.k_begin, block.k_end - block.k_begin, block.mask == AttentionMask::full};
}

// The sizes the kernels serve (the caller's test), 32-bit row indices, the dtypes (bf16 but lse f32,
// and the gradients in grad_dtype) and TMA's 16-byte alignment, else a one-sentence error. Shapes
// and devices are the caller's (attention.cu).
void check_served(const char* op, bool served, const Geometry& g, const Tensor& lse, NamedTensors bf16s, NamedTensors grads = {},
                  DType grad_dtype = DType::bf16) {
  MARROW_CHECK(served, "{}: sizes Sq {} Sk {} rows [{}, +{}) / [{}, +{}) H {}/{} not served", op, g.q_seq, g.k_seq, g.q_first,
               g.q_rows, g.k_first, g.k_rows, g.q_heads, g.kv_heads);
  const int64_t rows = g.batch * std::max(g.q_seq, g.k_seq) * g.q_heads;
  MARROW_CHECK(rows < (int64_t(1) << 31), "{}: {} rows of B x S x Hq exceed the kernels' 32-bit row index", op, rows);
  auto expect = [&](const char* name, const Tensor& t, DType dtype) {
    expect_dtype(op, name, t, dtype);
    MARROW_CHECK(reinterpret_cast<uintptr_t>(t.data) % 16 == 0, "{}: {} must be 16-byte aligned (TMA)", op, name);
  };
  expect("lse", lse, DType::f32);
  for (auto [name, t] : bf16s) expect(name, *t, DType::bf16);
  for (auto [name, t] : grads) expect(name, *t, grad_dtype);
}

}  // namespace

namespace hopper_attention {

void run_forward(Tensor out, Tensor lse, Tensor q, Tensor k, Tensor v, const Geometry& g, Stream stream) {
  ForwardArgs a{};
  a.lse = lse.ptr<float>();
  a.q_seq = int(g.q_seq), a.k_seq = int(g.k_seq), a.q_first = int(g.q_first), a.k_first = int(g.k_first);
  a.q_heads = int(g.q_heads), a.kv_heads = int(g.kv_heads), a.heads = int(g.batch * g.q_heads);
  a.blocks = int(g.q_rows / kKeys), a.key_blocks = int(g.k_rows / kKeys);
  a.full = g.full;
  a.scale_log2 = float(1.0 / std::sqrt(double(kDim))) * kLog2e;
  a.zero = 0;
  // Q in one 128-row tile (two boxes); out leaves in each consumer's 64 rows.
  const CUtensorMap q_map = rows_map(q, g.q_heads, kKeys), out_map = rows_map(out, g.q_heads, kQueries);
  const CUtensorMap k_map = rows_map(k, g.kv_heads, kKeys), v_map = rows_map(v, g.kv_heads, kKeys);
  allow_shared_memory<forward_kernel>(kFwdSmemBytes);
  launch_dependent(forward_kernel, unsigned(a.heads * a.blocks), kThreads, kFwdSmemBytes, static_cast<cudaStream_t>(stream.handle), q_map,
                   k_map, v_map, out_map, a);
  MARROW_CUDA_CHECK_LAUNCH();
}

}  // namespace hopper_attention

void hopper_attention_forward(Tensor out, Tensor lse, Tensor q, Tensor k, Tensor v, const AttentionBlock& block, Stream stream) {
  const char* op = "hopper_attention_forward";
  const Geometry g = block_geometry(q, k, block);
  check_served(op, hopper_attention_serves_block(q, k, block), g, lse, {{"out", &out}, {"q", &q}, {"k", &k}, {"v", &v}});
  run_forward(out, lse, q, k, v, g, stream);
}

void hopper_attention_backward(Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse,
                               const AttentionBlock& block, bool accumulate, AttentionGrads grads, Stream stream) {
  const char* op = "hopper_attention_backward";
  const Geometry g = block_geometry(q, k, block);
  check_served(op, hopper_attention_serves_block(q, k, block), g, lse, {{"dout", &dout}, {"q", &q}, {"k", &k}, {"v", &v}, {"out", &out}},
               {{"dq", &dq}, {"dk", &dk}, {"dv", &dv}}, accumulate ? DType::f32 : DType::bf16);
  run_backward(dq, dk, dv, dout, q, k, v, out, lse, g, accumulate, grads, nullptr, stream);
}

std::vector<HopperItemTimes> hopper_backward_timeline(Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out,
                                                      Tensor lse) {
  const char* op = "hopper_backward_timeline";
  MARROW_CHECK(q.ndim == 4, "{}: q must be [batch, seq, heads, head_dim], got {}", op, q.shape_string());
  const int64_t B = q.size(0), S = q.size(1), Hq = q.size(2), D = q.size(3), Hkv = k.ndim == 4 ? k.size(2) : 0;
  for (auto [name, t] : {std::pair{"dq", &dq}, std::pair{"dout", &dout}, std::pair{"out", &out}}) expect_shape(op, name, *t, {B, S, Hq, D});
  for (auto [name, t] : {std::pair{"k", &k}, std::pair{"v", &v}, std::pair{"dk", &dk}, std::pair{"dv", &dv}})
    expect_shape(op, name, *t, {B, S, Hkv, D});
  expect_shape(op, "lse", lse, {B, Hq, S});
  MARROW_CHECK(common_device(op, {{"q", &q}, {"k", &k}, {"v", &v}, {"out", &out}, {"lse", &lse}, {"dout", &dout}, {"dq", &dq}, {"dk", &dk},
                                  {"dv", &dv}}) == Device::cuda,
               "{}: the tensors are not on the GPU", op);
  const AttentionBlock whole{AttentionMask::causal, 0, S, 0, S};
  const Geometry g = block_geometry(q, k, whole);
  check_served(op, hopper_attention_serves_block(q, k, whole), g, lse, {{"dout", &dout}, {"q", &q}, {"k", &k}, {"v", &v}, {"out", &out}},
               {{"dq", &dq}, {"dk", &dk}, {"dv", &dv}});
  const int64_t items = B * Hq * (S / kKeys);
  Buffer timeline(DType::i64, Device::cuda, {items * kTimelineFields});
  run_backward(dq, dk, dv, dout, q, k, v, out, lse, g, false, AttentionGrads::all, timeline.ptr<int64_t>(), {});
  const Buffer host = to_host(timeline);
  std::vector<HopperItemTimes> result(static_cast<size_t>(items));
  for (int64_t i = 0; i < items; ++i) {
    const int64_t* f = host.ptr<int64_t>() + i * kTimelineFields;
    result[size_t(i)] = {int(f[kHead]), int(f[kKeyBlock]), int(f[kSm]), f[kStart], f[kWalkEnd], f[kKvWait], f[kEnd], f[kDqWait], f[kDqEnd]};
  }
  return result;
}

#else

void hopper_attention_forward(Tensor, Tensor, Tensor, Tensor, Tensor, const AttentionBlock&, Stream) { no_cuda_kernel("hopper_attention_forward"); }
void hopper_attention_backward(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, const AttentionBlock&, bool, AttentionGrads,
                               Stream) {
  no_cuda_kernel("hopper_attention_backward");
}
std::vector<HopperItemTimes> hopper_backward_timeline(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor) {
  no_cuda_kernel("hopper_backward_timeline");
}

#endif

}  // namespace marrow
