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
// a dQ write earlier (kChunkHeads). A post-pass rounds the
// accumulators to bf16 (dQ times scale) in the tensors' layouts.
#include "ops/attention_hopper.h"

#include <algorithm>
#include <cmath>

#include "core/cuda_check.h"
#include "core/memory.h"
#include "ops/common.h"

#ifdef __CUDACC__
#include "ops/wgmma.cuh"
#endif

namespace marrow {

namespace {
int& chunk_heads() {
  static int heads = 0;
  return heads;
}
}  // namespace

void set_hopper_backward_chunk_heads(int heads) { chunk_heads() = heads; }

bool hopper_attention_backward_supports(int64_t seq, int64_t q_heads, int64_t kv_heads, int64_t head_dim) {
#ifdef __CUDACC__
  return head_dim == 128 && seq > 0 && seq % 128 == 0 && kv_heads > 0 && q_heads % kv_heads == 0;
#else
  (void)seq, (void)q_heads, (void)kv_heads, (void)head_dim;
  return false;
#endif
}

#ifdef __CUDACC__
namespace {

using wgmma::barrier_arrive;
using wgmma::barrier_expect_bytes;
using wgmma::barrier_init;
using wgmma::barrier_wait;
using wgmma::bf16;
using wgmma::descriptor;
using wgmma::fence_registers;
using wgmma::init_stage_barriers;
using wgmma::mma_commit;
using wgmma::mma_fence;
using wgmma::mma_wait;
using wgmma::tensor_map;
using wgmma::tma_load_2d;

constexpr int kDim = 128, kKeys = 128, kQueries = 64;
constexpr int kThreads = 384;  // a producer warpgroup (loads, dQ writer) and two consumer warpgroups
constexpr float kLog2e = 1.4426950408889634f;
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

struct Args {
  const float* lse;    // [B, Hq, S], natural log
  const float* delta;  // [B, Hq, S]: dO . O
  float* dq_accum;     // [B * Hq, S / 64, 2 halves, 64, 64], pairs of columns permuted (pair_slot)
  float* dk_accum;     // [B * Hkv, S, 128], pairs permuted (kv_slot)
  float* dv_accum;
  int32_t* dq_semaphores;  // [B * Hq, S / 64]
  int32_t* kv_semaphores;  // [B * Hkv, S / 128]
  int32_t* item_counter;
  int64_t* timeline;  // bench hook (hopper_backward_timeline): kTimelineFields per item, or null
  int seq, q_heads, kv_heads, heads, key_blocks, query_blocks, chunk_heads;
  float scale, scale_log2;
};

// The timeline's fields per item (globaltimer ns but head, key block and SM).
enum TimelineField { kStart, kWalkEnd, kKvWait, kEnd, kDqWait, kDqEnd, kHead, kKeyBlock, kSm, kTimelineFields };

__device__ __forceinline__ int64_t now_ns() {
  int64_t t = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// The staged f32 shares' layouts: pair p (columns 2p, 2p + 1) of row r sits at pair p ^ 4 (r % 8),
// so that a warp's stores of its accumulator rows spread over the banks.
__host__ __device__ inline int pair_slot(int pair, int row) { return pair ^ ((row & 7) << 2); }

// ---- PTX wrappers beyond ops/wgmma.cuh ------------------------------------------------------------

__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
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
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
template <int kPending> __device__ __forceinline__ void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group %0;" ::"n"(kPending) : "memory");
}
// Generic-proxy shared memory writes made visible to the async proxy (wgmma, bulk copies).
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
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

// d (+)= A B, 64 x 64 x 16, both from shared memory (kTransA, kTransB: M- or N-major, else K-major).
template <int kTransA, int kTransB>
__device__ __forceinline__ void mma_m64n64k16(float (&d)[32], uint64_t a_desc, uint64_t b_desc, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31},"
      " %32, %33, p, 1, 1, %35, %36;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(a_desc), "l"(b_desc), "r"(accumulate), "n"(kTransA), "n"(kTransB));
}

// d += A B, 64 x 128 x 16, A from registers (the m16n8k16 A fragment per warp, 4 words), B from
// shared memory, N-major.
__device__ __forceinline__ void mma_m64n128k16_rs(float (&d)[64], const uint32_t* a, uint64_t b_desc) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63},"
      " {%64, %65, %66, %67}, %68, 1, 1, 1, 1;\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
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
    tma_load_2d(base + kTileK + j * 16384, k_map, kv_full, kvh * kDim + 64 * j, b * a.seq + kKeys * item.key_block);
    tma_load_2d(base + kTileV + j * 16384, v_map, kv_full, kvh * kDim + 64 * j, b * a.seq + kKeys * item.key_block);
  }
  const float* lse = a.lse + int64_t(item.head) * a.seq;
  const float* delta = a.delta + int64_t(item.head) * a.seq;
  for (int m = a.query_blocks - 1, it = 0; m >= 2 * item.key_block; --m, ++it) {
    const int s = it & 1;
    barrier_wait(empty + 8 * s, ((it >> 1) & 1) ^ 1);
    barrier_expect_bytes(full + 8 * s, 2 * kStageBytes + 2 * 256);
    for (int j = 0; j < 2; ++j) {
      tma_load_2d(base + kTileQ + s * kStageBytes + j * 8192, q_map, full + 8 * s, h * kDim + 64 * j, b * a.seq + kQueries * m);
      tma_load_2d(base + kTileDO + s * kStageBytes + j * 8192, do_map, full + 8 * s, h * kDim + 64 * j, b * a.seq + kQueries * m);
    }
    bulk_load(base + kRowStats + s * 256, lse + kQueries * m, 256, full + 8 * s);
    bulk_load(base + kRowStats + 512 + s * 256, delta + kQueries * m, 256, full + 8 * s);
  }
}

// Writer warp: both consumers' staged dQ shares of each query block (contiguous in shared memory and
// in dq_accum) into dq_accum as one write, in key block order; the semaphore is raised once the
// write completed. Query block i of the walk is staged in buffer i % 2.
__device__ void write_dq(const Args& a, Item item, int t, uint32_t base) {
  const bool leader = threadIdx.x % 32 == 0;
  const int count = a.query_blocks - 2 * item.key_block;
  int64_t waited = 0;
  for (int b = 0; b < 2 && b < count; ++b)
    for (int w = 0; w < 2; ++w) named_arrive(kDqEmpty + 2 * b + w, 160);
  for (int it = 0; it < count; ++it) {
    const int m = a.query_blocks - 1 - it, b = it & 1;
    for (int w = 0; w < 2; ++w) named_sync(kDqFull + 2 * b + w, 160);
    int32_t* semaphore = a.dq_semaphores + int64_t(item.head) * a.query_blocks + m;
    if (leader) {
      const int64_t before = a.timeline ? now_ns() : 0;
      wait_at_least(semaphore, item.key_block);  // key blocks 0 .. key_block - 1 come first
      if (a.timeline) waited += now_ns() - before;
      bulk_write(a.dq_accum + (int64_t(item.head) * a.query_blocks + m) * 8192, base + kTileDQ + b * kDqBufferBytes, kDqBufferBytes,
                 item.key_block > 0);
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
  const int64_t row = kv_head * a.seq + kKeys * item.key_block + 64 * w;
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
// fragments (p_frag, ds_frag: four words per 16 queries).
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
      const bool seen = query + c + e >= key + 8 * h;
      p[i] = seen ? exp2f(fmaf(s[4 * j + i], scale_log2, -(e ? l.y : l.x) * kLog2e)) : 0.0f;
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

// Consumer warpgroup w: keys key_block * 128 + 64 w .. + 63.
__device__ void consume(const Args& a, Item item, int t, uint32_t base, unsigned char* smem, int w) {
  const uint32_t kv_full = base + kBarriers, full = kv_full + 8, empty = full + 16;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32 % 4;
  const int key = kKeys * item.key_block + 64 * w + 16 * warp + lane / 4;
  float dk[64], dv[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) dk[i] = dv[i] = 0.0f;
  barrier_wait(kv_full, 0);
  for (int m = a.query_blocks - 1, it = 0; m >= 2 * item.key_block; --m, ++it) {
    const int s = it & 1;
    const uint32_t q_tile = base + kTileQ + s * kStageBytes, do_tile = base + kTileDO + s * kStageBytes;
    barrier_wait(full + 8 * s, (it >> 1) & 1);
    float st[32], dpt[32];
    mma_fence();
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) {  // K-major: 64-dim boxes, 16 dims = 32 bytes
      const uint32_t a_at = (kk / 4) * 16384 + w * 8192 + (kk % 4) * 32, b_at = (kk / 4) * 8192 + (kk % 4) * 32;
      mma_m64n64k16<0, 0>(st, descriptor(base + kTileK + a_at, 16, 1024), descriptor(q_tile + b_at, 16, 1024), kk > 0);
      mma_m64n64k16<0, 0>(dpt, descriptor(base + kTileV + a_at, 16, 1024), descriptor(do_tile + b_at, 16, 1024), kk > 0);
    }
    mma_commit();
    mma_wait<0>();
    fence_registers(st);
    fence_registers(dpt);
    uint32_t p_frag[16], ds_frag[16];
    const float* stats = reinterpret_cast<const float*>(smem + kRowStats);
    probabilities(p_frag, ds_frag, st, dpt, stats + 64 * s, stats + 128 + 64 * s, key, kQueries * m, a.scale_log2);
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
    mma_wait<0>();
    fence_registers(dq);
    fence_registers(dk);
    fence_registers(dv);
    if (lane == 0) barrier_arrive(empty + 8 * s);  // this stage's Q and dO are read
    named_sync(kDsFree, 256);                      // both consumers' dQ multiplies have read dS^T
    const int b = it & 1;
    named_sync(kDqEmpty + 2 * b + w, 160);
    stage_rows(reinterpret_cast<float*>(smem + kTileDQ + b * kDqBufferBytes + w * 16384), dq, 1.0f);
    fence_async_shared();
    named_arrive(kDqFull + 2 * b + w, 160);
  }
  write_dkdv(a, item, t, base, smem, w, dk, dv);
}

__global__ void __launch_bounds__(kThreads, 1)
    backward_kernel(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap k_map,
                    const __grid_constant__ CUtensorMap v_map, const __grid_constant__ CUtensorMap do_map, const Args a) {
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw = smem_address(smem_raw), base = (raw + 1023) & ~1023u;
  unsigned char* smem = smem_raw + (base - raw);
  int* item_slot = reinterpret_cast<int*>(smem + kBarriers + 40);
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
  consume(a, item, t, base, smem, warpgroup - 1);
}

// delta[head, s] = dO . O over the row's 128 dimensions, one warp a row (fixed shuffle tree).
__global__ void delta_kernel(float* delta, const bf16* dout, const bf16* out, int64_t rows, int seq, int q_heads) {
  const int64_t r = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;  // [B, S, Hq] order
  if (r >= rows) return;
  const int lane = threadIdx.x % 32;
  const uint2 x = *reinterpret_cast<const uint2*>(dout + r * kDim + 4 * lane), y = *reinterpret_cast<const uint2*>(out + r * kDim + 4 * lane);
  const float2 x0 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&x.x)), x1 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&x.y));
  const float2 y0 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&y.x)), y1 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&y.y));
  const float sum = warp_sum(x0.x * y0.x + x0.y * y0.y + x1.x * y1.x + x1.y * y1.y);
  const int64_t b = r / (int64_t(seq) * q_heads), s = r / q_heads % seq, h = r % q_heads;
  if (lane == 0) delta[(b * q_heads + h) * seq + s] = sum;
}

// The accumulators to bf16 in the tensors' layouts: one thread a pair of columns; dq's pairs first,
// then dk's and dv's.
__global__ void finish_kernel(bf16* dq, bf16* dk, bf16* dv, Args a, int64_t dq_pairs, int64_t kv_pairs) {
  const int64_t p = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (p < dq_pairs) {  // p indexes [B, S, Hq, 64 pairs]
    const int pair = int(p % 64), h = int(p / 64 % a.q_heads);
    const int64_t bs = p / 64 / a.q_heads, b = bs / a.seq;
    const int s = int(bs % a.seq), row = s % kQueries, half = pair / 32;
    const int64_t head = b * a.q_heads + h;
    const float2 v = *reinterpret_cast<const float2*>(a.dq_accum + ((head * a.query_blocks + s / kQueries) * 2 + half) * 4096 + row * 64 +
                                                      2 * pair_slot(pair % 32, row));
    reinterpret_cast<__nv_bfloat162*>(dq)[p] = __floats2bfloat162_rn(a.scale * v.x, a.scale * v.y);
    return;
  }
  const int64_t k = p - dq_pairs;
  if (k >= 2 * kv_pairs) return;
  const bool is_v = k >= kv_pairs;
  const int64_t q = is_v ? k - kv_pairs : k;  // [B, S, Hkv, 64 pairs]
  const int pair = int(q % 64), kvh = int(q / 64 % a.kv_heads);
  const int64_t bs = q / 64 / a.kv_heads, b = bs / a.seq;
  const int s = int(bs % a.seq);
  const float* accum = is_v ? a.dv_accum : a.dk_accum;
  const float2 v = *reinterpret_cast<const float2*>(accum + ((b * a.kv_heads + kvh) * a.seq + s) * kDim + 2 * pair_slot(pair, s % 64));
  reinterpret_cast<__nv_bfloat162*>(is_v ? dv : dk)[q] = __floats2bfloat162_rn(v.x, v.y);
}

CUtensorMap rows_map(const Tensor& t, int64_t heads, int box_rows) {
  const cuuint64_t dims[2] = {cuuint64_t(heads * kDim), cuuint64_t(t.size(0) * t.size(1))}, strides[1] = {cuuint64_t(heads * kDim * 2)};
  const cuuint32_t box[2] = {64, cuuint32_t(box_rows)};
  return tensor_map(t.data, 2, dims, strides, box);
}

}  // namespace

namespace {

void run_backward(Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, int64_t* timeline,
                  Stream stream) {
  const char* op = "hopper_attention_backward";
  const int64_t batch = q.size(0), seq = q.size(1), q_heads = q.size(2), kv_heads = k.size(2);
  MARROW_CHECK(hopper_attention_backward_supports(seq, q_heads, kv_heads, q.size(3)), "{}: sizes S {} H {}/{} D {} not served", op, seq,
               q_heads, kv_heads, q.size(3));
  for (const Tensor* t : {&dq, &dk, &dv, &dout, &q, &k, &v, &out, &lse})
    MARROW_CHECK(reinterpret_cast<uintptr_t>(t->data) % 16 == 0, "{}: tensors must be 16-byte aligned (TMA)", op);
  auto s = static_cast<cudaStream_t>(stream.handle);
  const int key_blocks = int(seq / kKeys), query_blocks = int(seq / kQueries), heads = int(batch * q_heads);
  Buffer delta(DType::f32, Device::cuda, {batch * q_heads * seq}, stream);
  Buffer dq_accum(DType::f32, Device::cuda, {batch * q_heads * seq * kDim}, stream);
  Buffer dk_accum(DType::f32, Device::cuda, {batch * kv_heads * seq * kDim}, stream);
  Buffer dv_accum(DType::f32, Device::cuda, {batch * kv_heads * seq * kDim}, stream);
  const int64_t semaphores = int64_t(heads) * query_blocks + batch * kv_heads * key_blocks + 1;
  Buffer sync(DType::i32, Device::cuda, {semaphores}, stream);
  MARROW_CUDA_CHECK(cudaMemsetAsync(sync.ptr<int32_t>(), 0, size_t(semaphores) * 4, s));

  const int64_t rows = batch * seq * q_heads;
  delta_kernel<<<unsigned((rows * 32 + 255) / 256), 256, 0, s>>>(delta.ptr<float>(), static_cast<const bf16*>(dout.data),
                                                                  static_cast<const bf16*>(out.data), rows, int(seq), int(q_heads));
  MARROW_CUDA_CHECK_LAUNCH();

  Args a{};
  a.lse = lse.ptr<float>();
  a.delta = delta.ptr<float>();
  a.dq_accum = dq_accum.ptr<float>();
  a.dk_accum = dk_accum.ptr<float>();
  a.dv_accum = dv_accum.ptr<float>();
  a.dq_semaphores = sync.ptr<int32_t>();
  a.kv_semaphores = a.dq_semaphores + int64_t(heads) * query_blocks;
  a.item_counter = a.kv_semaphores + batch * kv_heads * key_blocks;
  a.timeline = timeline;
  a.seq = int(seq), a.q_heads = int(q_heads), a.kv_heads = int(kv_heads), a.heads = heads;
  a.key_blocks = key_blocks, a.query_blocks = query_blocks;
  a.chunk_heads = std::min(heads, chunk_heads() > 0 ? chunk_heads() : kChunkHeads);
  a.scale = float(1.0 / std::sqrt(double(kDim)));
  a.scale_log2 = a.scale * kLog2e;
  const CUtensorMap q_map = rows_map(q, q_heads, kQueries), do_map = rows_map(dout, q_heads, kQueries);
  const CUtensorMap k_map = rows_map(k, kv_heads, kKeys), v_map = rows_map(v, kv_heads, kKeys);
  static const bool configured = [] {
    MARROW_CUDA_CHECK(cudaFuncSetAttribute(backward_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
    return true;
  }();
  (void)configured;
  backward_kernel<<<unsigned(int64_t(heads) * key_blocks), kThreads, kSmemBytes, s>>>(q_map, k_map, v_map, do_map, a);
  MARROW_CUDA_CHECK_LAUNCH();

  const int64_t dq_pairs = rows * 64, kv_pairs = batch * seq * kv_heads * 64;
  finish_kernel<<<unsigned((dq_pairs + 2 * kv_pairs + 255) / 256), 256, 0, s>>>(static_cast<bf16*>(dq.data), static_cast<bf16*>(dk.data),
                                                                                static_cast<bf16*>(dv.data), a, dq_pairs, kv_pairs);
  MARROW_CUDA_CHECK_LAUNCH();
}

}  // namespace

void hopper_attention_backward(Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse,
                               Stream stream) {
  run_backward(dq, dk, dv, dout, q, k, v, out, lse, nullptr, stream);
}

std::vector<HopperItemTimes> hopper_backward_timeline(Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out,
                                                      Tensor lse) {
  const int64_t items = q.size(0) * q.size(2) * (q.size(1) / kKeys);
  Buffer timeline(DType::i64, Device::cuda, {items * kTimelineFields});
  run_backward(dq, dk, dv, dout, q, k, v, out, lse, timeline.ptr<int64_t>(), {});
  const Buffer host = to_host(timeline);
  std::vector<HopperItemTimes> result(static_cast<size_t>(items));
  for (int64_t i = 0; i < items; ++i) {
    const int64_t* f = host.ptr<int64_t>() + i * kTimelineFields;
    result[size_t(i)] = {int(f[kHead]), int(f[kKeyBlock]), int(f[kSm]), f[kStart], f[kWalkEnd], f[kKvWait], f[kEnd], f[kDqWait], f[kDqEnd]};
  }
  return result;
}

#else

void hopper_attention_backward(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Stream) {
  no_cuda_kernel("hopper_attention_backward");
}

std::vector<HopperItemTimes> hopper_backward_timeline(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor) {
  no_cuda_kernel("hopper_backward_timeline");
}

#endif

}  // namespace marrow
