// The causal GQA attention backward (ops/attention.h; CPU reference: attention.cu's backward_cpu)
// on Hopper's wgmma, for head_dim 128 and lengths a multiple of 128. With P = exp(s - lse) and
// D_i = dO_i . O_i:  dV_j = sum_i P_ij dO_i,  dS_ij = P_ij (dO_i . V_j - D_i),
// dK_j = scale sum_i dS_ij Q_i,  dQ_i = scale sum_j dS_ij K_j.
//
// Work: an item is (batch row and query head, key block of 128 keys). Its block loads K and V of
// the block once and walks the 64-row query blocks that see them, from the last to the diagonal.
// Per query block, each of two consumer warpgroups (64 keys each) computes S^T = K Q^T and
// dP^T = V dO^T (keys as rows), P^T and dS^T in registers, which are the A operands of
// dV += P^T dO and dK += dS^T Q (accumulated in registers over the whole walk); dS^T also goes to
// shared memory, from which both warpgroups compute the query block's dQ share dS K (each 64 of the
// 128 columns). A producer warp loads Q, dO, lse and D two stages ahead (TMA); a writer warp adds
// the dQ shares into an f32 accumulator in global memory (bulk reduce-add from shared memory).
//
// Determinism: every f32 sum runs in a fixed order. A query block's dQ shares are added key block
// by key block from key block 0 (which stores instead of adding) up, each waiting on a per-(head,
// query block) semaphore. dK and dV of a key/value head are summed over its query heads in head
// order (a semaphore per key block; the first stores). Items are taken from a counter (never by
// blockIdx) in chunks of query heads, each chunk's key blocks in increasing order: the longest walks
// first, and every item waits only on items taken before it, so nothing deadlocks. As every walk
// starts at the last query block, the items before an item reach each query block as many steps
// after their own start as it does after its own, and it waits only when they started less than
// a dQ write earlier (kChunkHeads). A post-pass rounds the accumulators to bf16 (dQ times scale) in
// the tensors' layouts.
//
// Blocks (ring attention): the same kernels on a query row range of q against a key row range of k,
// v. A full block has no diagonal: every key block walks every query block (the first key block
// still stores each dQ first, the others add in order), and the post-pass adds the accumulators into
// f32 gradients at the ranges' rows instead of rounding them.
// Gotcha: the delta pre-pass also zeroes the semaphores and the item counter (no memset, no kernel
// boundary); a launch of the backward kernel without it would wait on stale counts.
#include "ops/attention_hopper.h"

#include <algorithm>
#include <cmath>

#include "core/cuda_check.h"
#include "core/memory.h"
#include "ops/common.h"

#ifdef __CUDACC__
#include "ops/attention_hopper.cuh"
#endif

namespace marrow {

namespace {

// The bench and test hooks below (0 and false: the defaults).
struct BackwardHooks {
  int chunk_heads = 0;
  bool unordered = false;
  int probe = 0;
} hooks;

}  // namespace

void set_hopper_backward_chunk_heads(int heads) { hooks.chunk_heads = heads; }
void set_hopper_backward_unordered(bool unordered) { hooks.unordered = unordered; }
void set_hopper_backward_probe(int probe) { hooks.probe = probe; }

// delta, the f32 dQ, dK and dV accumulators, and the semaphores (run_backward's buffers).
int64_t hopper_attention_backward_scratch(int64_t batch, int64_t seq, int64_t q_heads, int64_t kv_heads, int64_t head_dim) {
  const int64_t semaphores = batch * q_heads * (seq / 64) + batch * kv_heads * (seq / 128) + 1;
  return 4 * (batch * q_heads * seq + batch * q_heads * seq * head_dim + 2 * batch * kv_heads * seq * head_dim + semaphores);
}

#ifdef __CUDACC__
namespace {

using namespace hopper_attention;

// Query heads a chunk of items: the key blocks of one head start this many items apart, i.e. a few
// microseconds, more than a dQ write takes, so a key block seldom waits for the one before it; and
// the chunk's Q and dO (2 MiB a head at S = 4096) stay in L2.
constexpr int kChunkHeads = 8;

// Shared memory, from a 1024-byte aligned base (the 128-byte swizzle's period). K and V: two
// [128 keys][64 dims] swizzled boxes each; Q and dO stages: two [64 queries][64 dims] boxes each;
// dS^T: [128 keys][64 queries] in the same swizzle; the dQ shares, two buffers of [64][64] f32 per
// consumer (the consumers may run a query block ahead of the writer while it waits its turn).
constexpr int kTileK = 0, kTileV = 32768, kTileQ = 65536, kTileDO = 98304, kStageBytes = 16384;
constexpr int kTileDS = 131072, kTileDQ = 147456, kDqBufferBytes = 32768, kRowStats = 212992, kBarriers = 214016;
constexpr int kSmemBytes = kBarriers + 64 + 1024;
// Named barriers (0 is __syncthreads): dS^T written by both consumers / read by both; a consumer's
// dQ share staged in buffer b / taken by the writer (2 b + consumer); the two consumers at the end;
// one consumer at the end.
constexpr int kDsFull = 1, kDsFree = 2, kDqFull = 3, kDqEmpty = 7, kBothDone = 11, kOneDone = 12;

// Sizes below are the block's (the causal op: all rows). Rq = 64 query_blocks, Rk = 128 key_blocks.
struct Args {
  const float* lse;    // [B, Hq, q_seq], natural log; the block's rows start at q_first
  const float* delta;  // [B, Hq, Rq]: dO . O of the block's rows
  float* dq_accum;     // [B * Hq, query_blocks, 2 halves, 64, 64], pairs of columns permuted (pair_slot)
  float* dk_accum;     // [B * Hkv, Rk, 128], pairs permuted (kv_slot)
  float* dv_accum;
  int32_t* dq_semaphores;  // [B * Hq, query_blocks]
  int32_t* kv_semaphores;  // [B * Hkv, key_blocks]
  int32_t* item_counter;
  int64_t* timeline;  // bench hook (hopper_backward_timeline): kTimelineFields per item, or null
  int q_seq, k_seq, q_first, k_first;  // rows per batch row of q (dout, out, lse) and of k, v; the block's first rows
  int q_heads, kv_heads, heads, key_blocks, query_blocks, chunk_heads;
  float scale, scale_log2;
  bool full;       // no diagonal: every key block sees every query block
  bool unordered;  // set_hopper_backward_unordered: dq_accum starts zeroed, every share is added at once
  int probe;       // set_hopper_backward_probe: 1 loads hot rows, 2 writes no dQ (bench only)
};

// The query blocks key block kb walks, from the last: all of them in a full block, else down to the diagonal.
__host__ __device__ inline int walk_length(const Args& a, int key_block) {
  return a.full ? a.query_blocks : a.query_blocks - 2 * key_block;
}


__device__ __forceinline__ int64_t now_ns() {
  int64_t t = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// The staged f32 shares' layouts: pair p (columns 2p, 2p + 1) of row r sits at pair p ^ 4 (r % 8),
// so that a warp's stores of its accumulator rows spread over the banks.
__host__ __device__ inline int pair_slot(int pair, int row) { return pair ^ ((row & 7) << 2); }

// ---- PTX wrappers beyond ops/wgmma.cuh ------------------------------------------------------------

__device__ __forceinline__ void bulk_load(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst), "l"(src),
               "r"(bytes), "r"(bar)
               : "memory");
}
// Shared -> global, stored (add = false) or added to f32 (a bulk group of this thread).
__device__ __forceinline__ void bulk_write(float* dst, uint32_t src, uint32_t bytes, bool add) {
  if (add)
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(dst), "r"(src), "r"(bytes) : "memory");
  else
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(src), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
template <int kPending> __device__ __forceinline__ void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group %0;" ::"n"(kPending) : "memory");
}
__device__ __forceinline__ void wait_at_least(const int32_t* semaphore, int target) {
  int value = 0;
  do {
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(value) : "l"(semaphore) : "memory");
  } while (value < target);
  asm volatile("fence.proxy.async.global;" ::: "memory");
}
// After the bulk writes completed (bulk_wait): the next in order may go.
__device__ __forceinline__ void signal(int32_t* semaphore) {
  asm volatile("fence.proxy.async.global;" ::: "memory");
  asm volatile("red.release.gpu.global.add.s32 [%0], 1;" ::"l"(semaphore) : "memory");
}

// ---- the work items ---------------------------------------------------------------------------------

struct Item {
  int head, key_block;  // head: batch row * Hq + query head
};

// Item t: chunk t / (chunk_heads x key blocks), then key block, then head. Heads are taken in the
// order (batch row, place in the key/value group, key/value head), so that heads which sum into the
// same dK, dV come key/value heads apart and rarely wait on one another.
__device__ Item item_of(int t, const Args& a) {
  const int per_chunk = a.chunk_heads * a.key_blocks, chunk = t / per_chunk;
  const int heads_here = min(a.chunk_heads, a.heads - chunk * a.chunk_heads), r = t - chunk * per_chunk;
  const int p = chunk * a.chunk_heads + r % heads_here, in_row = p % a.q_heads;
  const int h = in_row % a.kv_heads * (a.q_heads / a.kv_heads) + in_row / a.kv_heads;
  return {p - in_row + h, r / heads_here};
}

// ---- the roles ------------------------------------------------------------------------------------

// Producer thread: K and V of the item, then per query block Q, dO (two boxes each), lse and D.
__device__ void load_tiles(const CUtensorMap* q_map, const CUtensorMap* k_map, const CUtensorMap* v_map, const CUtensorMap* do_map,
                           const Args& a, Item item, uint32_t base) {
  const int b = item.head / a.q_heads, h = item.head % a.q_heads, kvh = h / (a.q_heads / a.kv_heads);
  const uint32_t kv_full = base + kBarriers, full = kv_full + 8, empty = full + 16;
  barrier_expect_bytes(kv_full, 4 * 16384);
  for (int j = 0; j < 2; ++j) {
    tma_load_2d(base + kTileK + j * 16384, k_map, kv_full, kvh * kDim + 64 * j, b * a.k_seq + a.k_first + kKeys * item.key_block);
    tma_load_2d(base + kTileV + j * 16384, v_map, kv_full, kvh * kDim + 64 * j, b * a.k_seq + a.k_first + kKeys * item.key_block);
  }
  const float* lse = a.lse + int64_t(item.head) * a.q_seq + a.q_first;
  const float* delta = a.delta + int64_t(item.head) * (kQueries * a.query_blocks);
  const int count = walk_length(a, item.key_block), q_row = b * a.q_seq + a.q_first;
  for (int m = a.query_blocks - 1, it = 0; it < count; --m, ++it) {
    const int s = it & 1, row = a.probe & 1 ? m % 8 : m;
    barrier_wait(empty + 8 * s, ((it >> 1) & 1) ^ 1);
    barrier_expect_bytes(full + 8 * s, 2 * kStageBytes + 2 * 256);
    for (int j = 0; j < 2; ++j) {
      tma_load_2d(base + kTileQ + s * kStageBytes + j * 8192, q_map, full + 8 * s, h * kDim + 64 * j, q_row + kQueries * row);
      tma_load_2d(base + kTileDO + s * kStageBytes + j * 8192, do_map, full + 8 * s, h * kDim + 64 * j, q_row + kQueries * row);
    }
    bulk_load(base + kRowStats + s * 256, lse + kQueries * row, 256, full + 8 * s);
    bulk_load(base + kRowStats + 512 + s * 256, delta + kQueries * row, 256, full + 8 * s);
  }
}

// Writer warp: both consumers' staged dQ shares of each query block (contiguous in shared memory and
// in dq_accum) into dq_accum as one write, in key block order; the semaphore is raised once the
// write completed. Query block i of the walk is staged in buffer i % 2.
__device__ void write_dq(const Args& a, Item item, int t, uint32_t base) {
  const bool leader = threadIdx.x % 32 == 0;
  const int count = walk_length(a, item.key_block);
  int64_t waited = 0;
  for (int b = 0; b < 2 && b < count; ++b)
    for (int w = 0; w < 2; ++w) named_arrive(kDqEmpty + 2 * b + w, 160);
  for (int it = 0; it < count; ++it) {
    const int m = a.query_blocks - 1 - it, b = it & 1;
    for (int w = 0; w < 2; ++w) named_sync(kDqFull + 2 * b + w, 160);
    int32_t* semaphore = a.dq_semaphores + int64_t(item.head) * a.query_blocks + m;
    if (leader && !(a.probe & 2)) {
      const int64_t before = a.timeline ? now_ns() : 0;
      if (!a.unordered) wait_at_least(semaphore, item.key_block);  // key blocks 0 .. key_block - 1 come first
      if (a.timeline) waited += now_ns() - before;
      bulk_write(a.dq_accum + (int64_t(item.head) * a.query_blocks + m) * 8192, base + kTileDQ + b * kDqBufferBytes, kDqBufferBytes,
                 item.key_block > 0 || a.unordered);
      bulk_wait_read();
    }
    __syncwarp();
    if (it + 2 < count)
      for (int w = 0; w < 2; ++w) named_arrive(kDqEmpty + 2 * b + w, 160);
    if (leader) {
      bulk_wait<0>();
      signal(semaphore);
    }
  }
  if (a.timeline && leader) {
    a.timeline[int64_t(t) * kTimelineFields + kDqWait] = waited;
    a.timeline[int64_t(t) * kTimelineFields + kDqEnd] = now_ns();
  }
}

// One consumer's 64 rows of an f32 accumulator (m64n(2 kN): kN registers) into shared memory as
// [64][2 kN], pairs permuted (pair_slot), times factor.
template <int kN>
__device__ __forceinline__ void stage_rows(float* stage, const float (&d)[kN], float factor) {
  const int lane = threadIdx.x % 32, row0 = 16 * (threadIdx.x / 32 % 4) + lane / 4;
#pragma unroll
  for (int j = 0; j < kN / 4; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row0 + 8 * h;
      *reinterpret_cast<float2*>(stage + row * (2 * kN) + 2 * pair_slot(4 * j + lane % 4, row)) =
          make_float2(factor * d[4 * j + 2 * h], factor * d[4 * j + 2 * h + 1]);
    }
}

// Consumer w's dK (times scale) and dV rows into the accumulators in query head order, both staged
// at once where no one reads any more: dV in the Q (w = 0) or dO (w = 1) stages, dK in K or V.
__device__ void write_dkdv(const Args& a, Item item, int t, uint32_t base, unsigned char* smem, int w, const float (&dk)[64],
                           const float (&dv)[64]) {
  const int b = item.head / a.q_heads, h = item.head % a.q_heads, group = a.q_heads / a.kv_heads;
  const int64_t kv_head = int64_t(b) * a.kv_heads + h / group;
  int32_t* semaphore = a.kv_semaphores + kv_head * a.key_blocks + item.key_block;
  const int64_t row = (kv_head * a.key_blocks + item.key_block) * kKeys + 64 * w;
  const bool leader = threadIdx.x % 128 == 0, first = h % group == 0;
  float* dv_stage = reinterpret_cast<float*>(smem + kTileQ + w * 2 * kStageBytes);
  float* dk_stage = reinterpret_cast<float*>(smem + kTileK + w * 32768);
  named_sync(kBothDone, 256);  // both consumers' multiplies are done with K, V, Q and dO
  stage_rows(dv_stage, dv, 1.0f);
  stage_rows(dk_stage, dk, a.scale);
  fence_async_shared();
  named_sync(kOneDone + w, 128);
  int64_t* times = a.timeline && w == 0 && leader ? a.timeline + int64_t(t) * kTimelineFields : nullptr;
  if (times) times[kWalkEnd] = now_ns();
  if (leader) {
    wait_at_least(semaphore, 2 * (h % group));
    if (times) times[kKvWait] = now_ns() - times[kWalkEnd];
    bulk_write(a.dv_accum + row * kDim, smem_address(dv_stage), 32768, !first);
    bulk_write(a.dk_accum + row * kDim, smem_address(dk_stage), 32768, !first);
    bulk_wait<0>();
    signal(semaphore);
    if (times) times[kEnd] = now_ns();
  }
}

// P^T and dS^T of one consumer's 64 keys x 64 queries from S^T (in s) and dP^T (in dp), as bf16 A
// fragments (p_frag, ds_frag: four words per 16 queries); kFull: no key is masked.
template <bool kFull>
__device__ __forceinline__ void probabilities(uint32_t (&p_frag)[16], uint32_t (&ds_frag)[16], const float (&s)[32], const float (&dp)[32],
                                              const float* lse, const float* delta, int key, int query, float scale_log2) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int c = 8 * j + 2 * (lane % 4);
    const float2 l = *reinterpret_cast<const float2*>(lse + c), dl = *reinterpret_cast<const float2*>(delta + c);
    float p[4], ds[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // i = 2 h + e: key + 8 h, query + c + e
      const int e = i & 1, h = i >> 1;
      const bool seen = kFull || query + c + e >= key + 8 * h;
      p[i] = seen ? fast_exp2(fmaf(s[4 * j + i], scale_log2, -(e ? l.y : l.x) * kLog2e)) : 0.0f;
      ds[i] = p[i] * (dp[4 * j + i] - (e ? dl.y : dl.x));
    }
    // k-step j / 2 of 16 queries: words 0, 1 its first 8 columns (rows g, g + 8), 2, 3 the next 8.
    const int word = 4 * (j / 2) + 2 * (j % 2);
    p_frag[word] = pack_bf16(p[0], p[1]);
    p_frag[word + 1] = pack_bf16(p[2], p[3]);
    ds_frag[word] = pack_bf16(ds[0], ds[1]);
    ds_frag[word + 1] = pack_bf16(ds[2], ds[3]);
  }
}

// dS^T's bf16 fragments into the [128 keys][64 queries] swizzled tile (rows of 128 bytes).
__device__ __forceinline__ void store_ds(unsigned char* tile, const uint32_t (&ds_frag)[16], int w) {
  const int lane = threadIdx.x % 32, row0 = 64 * w + 16 * (threadIdx.x / 32 % 4) + lane / 4;
#pragma unroll
  for (int word = 0; word < 16; ++word) {
    const int j = 2 * (word / 4) + (word % 4) / 2, row = row0 + 8 * (word % 2);
    *reinterpret_cast<uint32_t*>(tile + row * 128 + ((j ^ (row & 7)) << 4) + 4 * (lane % 4)) = ds_frag[word];
  }
}

// S^T = K Q^T and dP^T = V dO^T of consumer w's 64 keys against a query block (K-major: 64-dim
// boxes, 16 dims = 32 bytes).
__device__ __forceinline__ void issue_st(float (&st)[32], uint32_t base, uint32_t q_tile, int w) {
#pragma unroll
  for (int kk = 0; kk < 8; ++kk)
    mma_m64n64k16<0, 0>(st, descriptor(base + kTileK + (kk / 4) * 16384 + w * 8192 + (kk % 4) * 32, 16, 1024),
                        descriptor(q_tile + (kk / 4) * 8192 + (kk % 4) * 32, 16, 1024), kk > 0);
}
__device__ __forceinline__ void issue_dpt(float (&dpt)[32], uint32_t base, uint32_t do_tile, int w) {
#pragma unroll
  for (int kk = 0; kk < 8; ++kk)
    mma_m64n64k16<0, 0>(dpt, descriptor(base + kTileV + (kk / 4) * 16384 + w * 8192 + (kk % 4) * 32, 16, 1024),
                        descriptor(do_tile + (kk / 4) * 8192 + (kk % 4) * 32, 16, 1024), kk > 0);
}

// Walk step it (query block m) of consumer w, whose S^T is already issued into st. dP^T, then P^T
// and dS^T, dV += P^T dO and dK += dS^T Q, dS^T to shared memory, dQ's share dS K staged for the
// writer. With kNext, S^T of the next query block is issued into st once dV and dK are done (their
// fragments free, this stage released), so that it runs under this block's dQ staging and the
// waits around it; the last step has none (no wgmma on a conditional path: ptxas would serialise).
template <bool kNext, bool kFull>
__device__ __forceinline__ void backward_step(const Args& a, uint32_t base, unsigned char* smem, int w, int it, int m, int key,
                                              float (&st)[32], float (&dk)[64], float (&dv)[64]) {
  const uint32_t full = base + kBarriers + 8, empty = full + 16;
  const int s = it & 1, lane = threadIdx.x % 32;
  const uint32_t q_tile = base + kTileQ + s * kStageBytes, do_tile = base + kTileDO + s * kStageBytes;
  float dpt[32];
  mma_fence();
  issue_dpt(dpt, base, do_tile, w);
  mma_commit();
  mma_wait<0>();  // S^T and dP^T
  fence_registers(st);
  fence_registers(dpt);
  uint32_t p_frag[16], ds_frag[16];
  const float* stats = reinterpret_cast<const float*>(smem + kRowStats);
  probabilities<kFull>(p_frag, ds_frag, st, dpt, stats + 64 * s, stats + 128 + 64 * s, key, kQueries * m, a.scale_log2);
  mma_fence();
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) {  // N-major B: 16 queries = 16 rows of 128 bytes; boxes 8 KiB apart
    mma_m64n128k16_rs(dv, p_frag + 4 * ks, descriptor(do_tile + ks * 2048, 8192, 1024));
    mma_m64n128k16_rs(dk, ds_frag + 4 * ks, descriptor(q_tile + ks * 2048, 8192, 1024));
  }
  mma_commit();
  store_ds(smem + kTileDS, ds_frag, w);
  fence_async_shared();
  named_sync(kDsFull, 256);
  float dq[32];
  mma_fence();
#pragma unroll
  for (int ks = 0; ks < 8; ++ks)  // A = dS, M-major (dS^T's rows); B = K's box w, N-major: 16 keys = 2048 bytes
    mma_m64n64k16<1, 1>(dq, descriptor(base + kTileDS + ks * 2048, 8192, 1024),
                        descriptor(base + kTileK + w * 16384 + ks * 2048, 16384, 1024), ks > 0);
  mma_commit();
  if constexpr (kNext) {
    mma_wait<1>();  // dV and dK
    fence_registers(dk);
    fence_registers(dv);
    fence_registers(p_frag);
    fence_registers(ds_frag);
    if (lane == 0) barrier_arrive(empty + 8 * s);  // this stage's Q and dO are read
    const int next = (it + 1) & 1;
    barrier_wait(full + 8 * next, ((it + 1) >> 1) & 1);
    mma_fence();
    issue_st(st, base, base + kTileQ + next * kStageBytes, w);
    mma_commit();
    mma_wait<1>();  // dQ
  } else {
    mma_wait<0>();
    fence_registers(dk);
    fence_registers(dv);
    fence_registers(p_frag);
    fence_registers(ds_frag);
    if (lane == 0) barrier_arrive(empty + 8 * s);
  }
  fence_registers(dq);
  named_sync(kDsFree, 256);  // both consumers' dQ multiplies have read dS^T
  named_sync(kDqEmpty + 2 * s + w, 160);  // dQ buffer s: the stage's parity
  stage_rows(reinterpret_cast<float*>(smem + kTileDQ + s * kDqBufferBytes + w * 16384), dq, 1.0f);
  fence_async_shared();
  named_arrive(kDqFull + 2 * s + w, 160);
}

// Consumer warpgroup w: keys key_block * 128 + 64 w .. + 63, over the query blocks from the last
// down to the diagonal or to 0 (at least two: key blocks are 128, query blocks 64).
template <bool kFull>
__device__ void consume(const Args& a, Item item, int t, uint32_t base, unsigned char* smem, int w) {
  const uint32_t kv_full = base + kBarriers, full = kv_full + 8;
  const int key = kKeys * item.key_block + 64 * w + 16 * (threadIdx.x / 32 % 4) + threadIdx.x % 32 / 4;
  const int count = walk_length(a, item.key_block);
  float dk[64], dv[64], st[32];
#pragma unroll
  for (int i = 0; i < 64; ++i) dk[i] = dv[i] = 0.0f;
  barrier_wait(kv_full, 0);
  barrier_wait(full, 0);
  mma_fence();
  issue_st(st, base, base + kTileQ, w);
  mma_commit();
  for (int it = 0; it + 1 < count; ++it) backward_step<true, kFull>(a, base, smem, w, it, a.query_blocks - 1 - it, key, st, dk, dv);
  backward_step<false, kFull>(a, base, smem, w, count - 1, a.query_blocks - count, key, st, dk, dv);
  write_dkdv(a, item, t, base, smem, w, dk, dv);
}

template <bool kFull>
__global__ void __launch_bounds__(kThreads, 1)
    backward_kernel(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap k_map,
                    const __grid_constant__ CUtensorMap v_map, const __grid_constant__ CUtensorMap do_map, const Args a) {
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw = smem_address(smem_raw), base = (raw + 1023) & ~1023u;
  unsigned char* smem = smem_raw + (base - raw);
  int* item_slot = reinterpret_cast<int*>(smem + kBarriers + 40);
  begin_after_previous_grid();  // the item counter, semaphores, delta and the inputs come from earlier work
  if (threadIdx.x == 0) {
    *item_slot = atomicAdd(a.item_counter, 1);
    barrier_init(base + kBarriers, 1);
  }
  init_stage_barriers(base + kBarriers + 8, base + kBarriers + 24, 2, 2);  // ends in __syncthreads
  const int t = *item_slot;
  const Item item = item_of(t, a);
  if (a.timeline && threadIdx.x == 0) {
    int sm = 0;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    int64_t* times = a.timeline + int64_t(t) * kTimelineFields;
    times[kStart] = now_ns();
    times[kHead] = item.head;
    times[kKeyBlock] = item.key_block;
    times[kSm] = sm;
  }
  const int warpgroup = threadIdx.x / 128;
  if (warpgroup == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (threadIdx.x == 0) load_tiles(&q_map, &k_map, &v_map, &do_map, a, item, base);
    else if (threadIdx.x / 32 == 1) write_dq(a, item, t, base);
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
  consume<kFull>(a, item, t, base, smem, warpgroup - 1);
}

// delta[head, s] = dO . O over the row's 128 dimensions, one warp a row (fixed shuffle tree), each
// warp kDeltaRows rows with all their loads issued first. Row indices are 32-bit (run_backward checks
// rows < 2^31): three 64-bit divisions a row cost more issue slots than the loads. kBlock: the rows
// are a block's (rows of [B, block_seq, Hq] at q_first of dout's and out's q_seq), which costs the
// index divisions before the loads; the causal op's rows are the tensors' own.
// The kernel also zeroes the backward's `sync` ints (semaphores and item counter), which saves the
// memset and its two kernel boundaries.
constexpr int kDeltaRows = 4;
struct DeltaRows {
  int rows, block_seq, q_heads, q_seq, q_first;
};
template <bool kBlock>
__global__ void delta_kernel(float* delta, int32_t* sync, int sync_count, const bf16* dout, const bf16* out, DeltaRows n) {
  begin_after_previous_grid();
  const int thread = int(int64_t(blockIdx.x) * blockDim.x + threadIdx.x);
  if (thread < sync_count) sync[thread] = 0;
  const int first = thread / 32 * kDeltaRows;  // [B, S, Hq] order
  const int lane = threadIdx.x % 32;
  uint2 x[kDeltaRows], y[kDeltaRows];
#pragma unroll
  for (int i = 0; i < kDeltaRows; ++i) {
    int r = first + i < n.rows ? first + i : n.rows - 1;  // past the end: the last row again, not stored
    if constexpr (kBlock) {
      const int bs = r / n.q_heads, h = r - bs * n.q_heads, b = bs / n.block_seq, s = bs - b * n.block_seq;
      r = (b * n.q_seq + n.q_first + s) * n.q_heads + h;
    }
    x[i] = *reinterpret_cast<const uint2*>(dout + int64_t(r) * kDim + 4 * lane);
    y[i] = *reinterpret_cast<const uint2*>(out + int64_t(r) * kDim + 4 * lane);
  }
#pragma unroll
  for (int i = 0; i < kDeltaRows; ++i) {
    const int r = first + i;
    const float2 x0 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&x[i].x)),
                 x1 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&x[i].y));
    const float2 y0 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&y[i].x)),
                 y1 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&y[i].y));
    const float sum = warp_sum(x0.x * y0.x + x0.y * y0.y + x1.x * y1.x + x1.y * y1.y);
    const int bs = r / n.q_heads, h = r - bs * n.q_heads, b = bs / n.block_seq, s = bs - b * n.block_seq;
    if (lane == 0 && r < n.rows) delta[(int64_t(b) * n.q_heads + h) * n.block_seq + s] = sum;
  }
}

// Eight f32 (32 bytes) to bf16 (16 bytes), times factor, as quad `quad` of dst (kAdd false); or
// added, times factor, into eight f32 of dst (kAdd).
template <bool kAdd>
__device__ __forceinline__ void put_eight(void* dst, int64_t quad, const float* from, float factor) {
  const float4 lo = reinterpret_cast<const float4*>(from)[0], hi = reinterpret_cast<const float4*>(from)[1];
  if constexpr (kAdd) {
    float4* to = reinterpret_cast<float4*>(dst) + 2 * quad;
    float4 a = to[0], b = to[1];
    a.x += factor * lo.x, a.y += factor * lo.y, a.z += factor * lo.z, a.w += factor * lo.w;
    b.x += factor * hi.x, b.y += factor * hi.y, b.z += factor * hi.z, b.w += factor * hi.w;
    to[0] = a, to[1] = b;
  } else {
    const auto word = [factor](float x, float y) {
      const __nv_bfloat162 h = __floats2bfloat162_rn(factor * x, factor * y);
      return *reinterpret_cast<const uint32_t*>(&h);
    };
    reinterpret_cast<uint4*>(dst)[quad] = make_uint4(word(lo.x, lo.y), word(lo.z, lo.w), word(hi.x, hi.y), word(hi.z, hi.w));
  }
}

// The accumulators into the gradients in the tensors' layouts: rounded to bf16 (the causal op) or
// added into f32 at the block's rows (kAdd). One thread four pairs of columns (pair_slot keeps each
// aligned group of four pairs together: 32 bytes read, 16 written); dq's first (dq_quads of them,
// 0 when dq is not asked for), then dk's and dv's (kv_quads each).
template <bool kAdd>
__global__ void finish_kernel(void* dq, void* dk, void* dv, Args a, int64_t dq_quads, int64_t kv_quads) {
  begin_after_previous_grid();
  const int64_t p = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (p < dq_quads) {  // p indexes [B, Rq, Hq, 16 quads]
    const int64_t rows = int64_t(kQueries) * a.query_blocks;
    const int pair = int(p % 16) * 4, h = int(p / 16 % a.q_heads);
    const int64_t bs = p / 16 / a.q_heads, b = bs / rows;
    const int s = int(bs % rows), row = s % kQueries, half = pair / 32;
    const int64_t head = b * a.q_heads + h;
    const float* from = a.dq_accum + ((head * a.query_blocks + s / kQueries) * 2 + half) * 4096 + row * 64 + 2 * pair_slot(pair % 32, row);
    put_eight<kAdd>(dq, ((b * a.q_seq + a.q_first + s) * a.q_heads + h) * 16 + p % 16, from, a.scale);
    return;
  }
  const int64_t k = p - dq_quads;
  if (k >= 2 * kv_quads) return;
  const bool is_v = k >= kv_quads;
  const int64_t q = is_v ? k - kv_quads : k;  // [B, Rk, Hkv, 16 quads]
  const int64_t rows = int64_t(kKeys) * a.key_blocks;
  const int pair = int(q % 16) * 4, kvh = int(q / 16 % a.kv_heads);
  const int64_t bs = q / 16 / a.kv_heads, b = bs / rows;
  const int s = int(bs % rows);
  const float* from = (is_v ? a.dv_accum : a.dk_accum) + ((b * a.kv_heads + kvh) * rows + s) * kDim + 2 * pair_slot(pair, s % 64);
  put_eight<kAdd>(is_v ? dv : dk, ((b * a.k_seq + a.k_first + s) * a.kv_heads + kvh) * 16 + q % 16, from, 1.0f);
}
// Items, delta, the f32 accumulators and the semaphores of one backward; the Args they fill.
Args backward_args(const Geometry& g, Buffer& delta, Buffer& dq_accum, Buffer& dk_accum, Buffer& dv_accum, Buffer& sync, int64_t* timeline,
                   Stream stream) {
  const int key_blocks = int(g.k_rows / kKeys), query_blocks = int(g.q_rows / kQueries), heads = int(g.batch * g.q_heads);
  delta = Buffer(DType::f32, Device::cuda, {g.batch * g.q_heads * g.q_rows}, stream);
  dq_accum = Buffer(DType::f32, Device::cuda, {g.batch * g.q_heads * g.q_rows * kDim}, stream);
  dk_accum = Buffer(DType::f32, Device::cuda, {g.batch * g.kv_heads * g.k_rows * kDim}, stream);
  dv_accum = Buffer(DType::f32, Device::cuda, {g.batch * g.kv_heads * g.k_rows * kDim}, stream);
  sync = Buffer(DType::i32, Device::cuda, {int64_t(heads) * query_blocks + g.batch * g.kv_heads * key_blocks + 1}, stream);
  Args a{};
  a.lse = nullptr;
  a.delta = delta.ptr<float>();
  a.dq_accum = dq_accum.ptr<float>();
  a.dk_accum = dk_accum.ptr<float>();
  a.dv_accum = dv_accum.ptr<float>();
  a.dq_semaphores = sync.ptr<int32_t>();
  a.kv_semaphores = a.dq_semaphores + int64_t(heads) * query_blocks;
  a.item_counter = a.kv_semaphores + g.batch * g.kv_heads * key_blocks;
  a.timeline = timeline;
  a.q_seq = int(g.q_seq), a.k_seq = int(g.k_seq), a.q_first = int(g.q_first), a.k_first = int(g.k_first);
  a.q_heads = int(g.q_heads), a.kv_heads = int(g.kv_heads), a.heads = heads;
  a.key_blocks = key_blocks, a.query_blocks = query_blocks;
  a.chunk_heads = std::min(heads, hooks.chunk_heads > 0 ? hooks.chunk_heads : kChunkHeads);
  a.full = g.full;
  a.unordered = hooks.unordered;
  a.probe = hooks.probe;
  a.scale = float(1.0 / std::sqrt(double(kDim)));
  a.scale_log2 = a.scale * kLog2e;
  return a;
}

}  // namespace

namespace hopper_attention {

void run_backward(Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, const Geometry& g,
                  bool add, AttentionGrads grads, int64_t* timeline, Stream stream) {
  auto s = static_cast<cudaStream_t>(stream.handle);
  Buffer delta, dq_accum, dk_accum, dv_accum, sync;
  Args a = backward_args(g, delta, dq_accum, dk_accum, dv_accum, sync, timeline, stream);
  a.lse = lse.ptr<float>();

  const int64_t rows = g.batch * g.q_rows * g.q_heads, semaphores = sync.numel();
  // Enough threads for the rows (a warp per kDeltaRows) and for zeroing `sync`.
  const int64_t delta_threads = std::max((rows + kDeltaRows - 1) / kDeltaRows * 32, semaphores);
  const DeltaRows delta_rows{int(rows), int(g.q_rows), int(g.q_heads), int(g.q_seq), int(g.q_first)};
  const bool whole_rows = g.q_rows == g.q_seq;
  launch_dependent(whole_rows ? delta_kernel<false> : delta_kernel<true>, unsigned((delta_threads + 255) / 256), 256, 0, s,
                   delta.ptr<float>(), sync.ptr<int32_t>(), int(semaphores), static_cast<const bf16*>(dout.data),
                   static_cast<const bf16*>(out.data), delta_rows);
  MARROW_CUDA_CHECK_LAUNCH();

  if (a.unordered) MARROW_CUDA_CHECK(cudaMemsetAsync(a.dq_accum, 0, size_t(dq_accum.numel()) * 4, s));
  const CUtensorMap q_map = rows_map(q, g.q_heads, kQueries), do_map = rows_map(dout, g.q_heads, kQueries);
  const CUtensorMap k_map = rows_map(k, g.kv_heads, kKeys), v_map = rows_map(v, g.kv_heads, kKeys);
  const auto kernel = g.full ? backward_kernel<true> : backward_kernel<false>;
  allow_shared_memory<backward_kernel<true>>(kSmemBytes);
  allow_shared_memory<backward_kernel<false>>(kSmemBytes);
  launch_dependent(kernel, unsigned(int64_t(a.heads) * a.key_blocks), kThreads, kSmemBytes, s, q_map, k_map, v_map, do_map, a);
  MARROW_CUDA_CHECK_LAUNCH();

  const int64_t dq_quads = grads == AttentionGrads::kv ? 0 : rows * 16;
  const int64_t kv_quads = grads == AttentionGrads::q ? 0 : g.batch * g.k_rows * g.kv_heads * 16;
  launch_dependent(add ? finish_kernel<true> : finish_kernel<false>, unsigned((dq_quads + 2 * kv_quads + 255) / 256), 256, 0, s,
                   dq.data, dk.data, dv.data, a, dq_quads, kv_quads);
  MARROW_CUDA_CHECK_LAUNCH();
}

}  // namespace hopper_attention
#endif  // __CUDACC__

}  // namespace marrow
