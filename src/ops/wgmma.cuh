// Hopper (sm_90a) grouped GEMM for the expert layers: out_e = in_e B_e for the row groups of
// grouped_linear, B_e = W_e^T (forward; W_e [O, I] is K-major) or W_e (backward input; N-major, read
// through wgmma's transpose bit for B). Tiles are 128 rows x 256 columns of one expert, ordered
// (expert, column tile, row tile) so that the row tiles of one weight tile run side by side and each
// weight tile comes from memory about once. A persistent grid: each block starts on tile blockIdx.x
// and takes the next from a counter (tiles differ in cost, see below); which block computes a tile
// does not change its bits, so results are deterministic. Each block's producer warp finds every
// expert's first tile itself (a warp scan over the experts' row counts into shared memory), and the
// last block to finish leaves the counter at zero for the stream's next call: no schedule kernel
// before a call (it and its launch gap cost ~3 us a call). Per block one producer warpgroup (one
// thread issues the TMA copies into 128-byte-swizzled shared tiles, kStages deep, completing on
// mbarriers) and two consumer warpgroups, each multiplying 64 rows with wgmma.m64n256k16 (fp32
// accumulators in registers) and storing bf16 through shared memory. Rows past the expert's end are
// loaded (the next expert's rows or TMA's zeros) but never stored; a consumer whose 64 rows all lie
// past the end skips the multiply, so an expert's last tile costs about half when it holds at most
// 64 rows. K and N edges are TMA's zero fill (the weight is a 3-D map, so no tile reads into the next
// expert's weights). Needs O and I multiples of 8 and 16-byte aligned tensors (TMA's stride rule).
// Descriptor facts, verified on the H200 (2026-12-01): K-major 128-byte swizzle: leading byte offset
// unused (1), stride 1024 (8 rows of 128 bytes), 16 of K = +32 bytes on the start address; N-major:
// leading = the distance between 64-column blocks, stride = between 8-row groups of K (swapped, the
// results are wrong).
// How to see a serialised wgmma: `cuobjdump -sass` shows `WARPGROUP.DEPBAR.LE gsb0, 0x0` after each
// HGMMA (the pip wheel nvidia-cuda-cuobjdump has the tool when the toolkit lacks it). ptxas also
// hoists `wgmma.wait_group` into any stall slot of the same basic block: a wait meant to come after
// some work must start a block (e.g. right after an mbarrier wait's loop), as the own attention
// forward's forward_step does. `ctest -R nvcc_guard` (tests/nvcc_guard/) checks the build's guard.
#pragma once
#include <cuda.h>
#include <cuda_bf16.h>
#include <cudaTypedefs.h>
#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "core/cuda_check.h"
#include "ops/cuda_common.cuh"

namespace marrow::wgmma {

using bf16 = __nv_bfloat16;

constexpr int kBlockM = 128;  // rows per tile: two consumer warpgroups of 64
constexpr int kBlockN = 256;  // columns per tile: one m64n256k16 per consumer and 16 of K
constexpr int kBlockK = 64;   // 64 bf16 = one 128-byte swizzle row
constexpr int kStages = 4;
constexpr int kConsumers = 2;
constexpr int kThreads = 128 * (1 + kConsumers);
constexpr int kTileABytes = kBlockM * kBlockK * 2;  // 16 KiB
constexpr int kTileBBytes = kBlockN * kBlockK * 2;  // 32 KiB
constexpr int kStageBytes = kTileABytes + kTileBBytes;
constexpr int kStagingBytes = 4 * kConsumers * 16 * 256;  // the epilogue's 16 rows x 128 columns per warp
// 1024 bytes of slack to align the stages to the 128-byte swizzle's 1024-byte period, the stages,
// the epilogue's staging, the full/empty mbarriers and the tile each stage starts (16 bytes); then
// each expert's first tile (4 bytes an expert, and one for the total: smem_bytes below).
constexpr int kSmemBytes = 1024 + kStages * kStageBytes + kStagingBytes + 2 * kStages * 8 + kStages * 16;
constexpr int kSmemLimit = 227 * 1024;
constexpr int kMaxExperts = (kSmemLimit - kSmemBytes) / 4 - 1;
static_assert(kMaxExperts >= 256, "the grouped GEMM's stages leave too little shared memory for the experts' first tiles");
inline int smem_bytes(int64_t experts) { return kSmemBytes + 4 * int(experts + 1); }

// ---- PTX wrappers (smem_address: ops/cuda_common.cuh) ---------------------------------------------

__device__ __forceinline__ void barrier_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
// A pipeline's full/empty mbarriers (8 bytes each, `stages` of each) for one producer thread and
// `consumers` warpgroups, set up by thread 0 before the whole block goes on.
__device__ __forceinline__ void init_stage_barriers(uint32_t full, uint32_t empty, int stages, int consumers) {
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      barrier_init(full + 8 * s, 1);              // the producer's arrive with the byte count
      barrier_init(empty + 8 * s, 4 * consumers);  // one arrive per consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
}
__device__ __forceinline__ void barrier_expect_bytes(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void barrier_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// Waits until the phase with this parity has completed (a fresh barrier counts parity 1 as done).
__device__ __forceinline__ void barrier_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}

__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];" ::"r"(dst),
      "l"(map), "r"(bar), "r"(c0), "r"(c1)
      : "memory");
}
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const CUtensorMap* map, uint32_t bar, int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];" ::"r"(dst),
      "l"(map), "r"(bar), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

// Shared-memory matrix descriptor for a 128-byte-swizzled tile: start address, leading and stride
// byte offsets (each >> 4) and the swizzle mode (1 = 128 bytes) in bits 62-63. Tiles are 1024-byte
// aligned, so the base-offset field stays 0.
__device__ __forceinline__ uint64_t descriptor(uint32_t address, uint32_t leading_bytes, uint32_t stride_bytes) {
  return uint64_t((address & 0x3FFFF) >> 4) | uint64_t(leading_bytes >> 4) << 16 | uint64_t(stride_bytes >> 4) << 32 | 1ull << 62;
}

__device__ __forceinline__ void mma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void mma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int kPending>
__device__ __forceinline__ void mma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}
// Keeps the compiler from moving accumulator reads or writes across an asynchronous wgmma.
template <int N>
__device__ __forceinline__ void fence_registers(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// The same for A fragments in registers: also keeps them allocated (and unchanged) until this point,
// which an asynchronous wgmma reading them needs until its wait.
template <int N>
__device__ __forceinline__ void fence_registers(uint32_t (&a)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(a[i])::"memory");
}

// The accumulator lists of the wgmma wrappers below: eight in-out operands d[i .. i + 7], and the
// register lists "%0, ..., %31" and "%0, ..., %63".
#define MARROW_D8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define MARROW_ACC32 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define MARROW_ACC64 \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"

// d (+)= A B for 64 rows x 256 columns x 16 of K; accumulate = 0 overwrites d. kTransA = 1: A's
// tile is M-major (M contiguous), kTransB = 1: B's tile is N-major (N contiguous), else K-major.
template <int kTransA, int kTransB>
__device__ __forceinline__ void mma_m64n256k16(float (&d)[128], uint64_t a_desc, uint64_t b_desc, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127},"
      " %128, %129, p, 1, 1, %131, %132;\n}\n"
      : MARROW_D8(0), MARROW_D8(8), MARROW_D8(16), MARROW_D8(24),
        MARROW_D8(32), MARROW_D8(40), MARROW_D8(48), MARROW_D8(56),
        MARROW_D8(64), MARROW_D8(72), MARROW_D8(80), MARROW_D8(88),
        MARROW_D8(96), MARROW_D8(104), MARROW_D8(112), MARROW_D8(120)
      : "l"(a_desc), "l"(b_desc), "r"(accumulate), "n"(kTransA), "n"(kTransB));
}

// d (+)= A B, 64 x 64 x 16, both from shared memory (kTransA, kTransB: M- or N-major, else K-major).
template <int kTransA, int kTransB>
__device__ __forceinline__ void mma_m64n64k16(float (&d)[32], uint64_t a_desc, uint64_t b_desc, int accumulate) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\nwgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {" MARROW_ACC32
               "}, %32, %33, p, 1, 1, %35, %36;\n}\n"
               : MARROW_D8(0), MARROW_D8(8), MARROW_D8(16), MARROW_D8(24)
               : "l"(a_desc), "l"(b_desc), "r"(accumulate), "n"(kTransA), "n"(kTransB));
}

// d (+)= A B, 64 x 128 x 16, both from shared memory, K-major.
__device__ __forceinline__ void mma_m64n128k16_ss(float (&d)[64], uint64_t a_desc, uint64_t b_desc, int accumulate) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\nwgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" MARROW_ACC64
               "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
               : MARROW_D8(0), MARROW_D8(8), MARROW_D8(16), MARROW_D8(24),
                 MARROW_D8(32), MARROW_D8(40), MARROW_D8(48), MARROW_D8(56)
               : "l"(a_desc), "l"(b_desc), "r"(accumulate));
}

// d += A B, 64 x 128 x 16, A from registers (the m16n8k16 A fragment per warp, 4 words), B from
// shared memory, N-major.
__device__ __forceinline__ void mma_m64n128k16_rs(float (&d)[64], const uint32_t* a, uint64_t b_desc) {
  asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" MARROW_ACC64 "}, {%64, %65, %66, %67}, %68, 1, 1, 1, 1;\n"
               : MARROW_D8(0), MARROW_D8(8), MARROW_D8(16), MARROW_D8(24),
                 MARROW_D8(32), MARROW_D8(40), MARROW_D8(48), MARROW_D8(56)
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc));
}

// ---- the kernel ---------------------------------------------------------------------------------
// offsets[E + 1]: the rows of each expert. tile_start[E + 1] (shared memory): the first tile of each
// expert, tile_start[E] = all tiles. Tile t of expert e: column tile (t - tile_start[e]) / row tiles,
// row tile (t - tile_start[e]) % row tiles.
struct alignas(16) Tile {
  int expert, row0, row_end, col0;  // expert < 0: no tiles left
};

// tile_start from the offsets, by the whole producer warp: 32 experts a round, each round an
// inclusive warp scan of their tile counts on the carry of the rounds before. Returns all tiles.
__device__ __forceinline__ int scan_tile_starts(int* tile_start, const int32_t* offsets, int experts, int col_tiles) {
  const int lane = threadIdx.x % 32;
  int carry = 0;
  for (int base = 0; base < experts; base += 32) {
    const int e = base + lane;
    const int tiles = e < experts ? (offsets[e + 1] - offsets[e] + kBlockM - 1) / kBlockM * col_tiles : 0;
    int inclusive = tiles;
    for (int d = 1; d < 32; d *= 2) {
      const int below = __shfl_up_sync(~0u, inclusive, d);
      if (lane >= d) inclusive += below;
    }
    if (e < experts) tile_start[e] = carry + inclusive - tiles;
    carry += __shfl_sync(~0u, inclusive, 31);
  }
  if (lane == 0) tile_start[experts] = carry;
  __syncwarp();
  return carry;
}

// The producer warp's tile lookup: the expert is found by a warp-wide scan of tile_start that
// resumes at the previous tile's expert (a block's tiles come in increasing order). kTileN: the
// tiles' columns (the FP8 kernel's are narrower).
template <int kTileN = kBlockN>
__device__ __forceinline__ Tile find_tile(int t, const int32_t* offsets, const int* tile_start, int experts, int& expert) {
  const int lane = threadIdx.x % 32;
  for (;;) {  // tile_start[expert] <= t < tile_start[experts]: some lane's test fails
    const int e = expert + lane;
    const unsigned started = __ballot_sync(~0u, e <= experts && tile_start[e] <= t);
    if (started != ~0u) {
      expert += __popc(started) - 1;
      break;
    }
    expert += 32;
  }
  const int row_begin = offsets[expert], row_end = offsets[expert + 1];
  const int row_tiles = (row_end - row_begin + kBlockM - 1) / kBlockM, local = t - tile_start[expert];
  return {expert, row_begin + (local % row_tiles) * kBlockM, row_end, (local / row_tiles) * kTileN};
}

// One consumer warp's 16 rows x 128 kHalves columns to out[rows, n] as bf16, rows at or past row_end
// left out. Accumulator layout of m64nNk16: warp w of the warpgroup holds rows 16w + lane / 4 (+ 8); d[4j],
// d[4j + 1] are columns 8j + 2 (lane % 4) (+ 1) of the first row, d[4j + 2], d[4j + 3] of the second.
// Stored straight from there, each warp store would touch 8 rows with 16 bytes each; so each half
// of the columns goes through the warp's 4 KiB of shared memory (16-byte chunks XORed with row % 8:
// no bank conflicts either way) and leaves as 16-byte stores that cover whole 256-byte row pieces.
template <int kHalves = 2>
__device__ __forceinline__ void store_rows(bf16* out, const float (&d)[64 * kHalves], unsigned char* staging, int row, int row_end,
                                           int col0, int n) {
  const int lane = threadIdx.x % 32, quad_row = lane / 4;
#pragma unroll
  for (int half = 0; half < kHalves; ++half) {
    __syncwarp();
#pragma unroll
    for (int jj = 0; jj < 16; ++jj) {
      const int j = 16 * half + jj;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = quad_row + 8 * h;
        *reinterpret_cast<__nv_bfloat162*>(staging + r * 256 + ((jj ^ (r % 8)) * 16) + 4 * (lane % 4)) =
            __floats2bfloat162_rn(d[4 * j + 2 * h], d[4 * j + 2 * h + 1]);
      }
    }
    __syncwarp();
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int r = 2 * i + lane / 16, chunk = lane % 16, col = col0 + 128 * half + 8 * chunk;
      const uint4 v = *reinterpret_cast<const uint4*>(staging + r * 256 + ((chunk ^ (r % 8)) * 16));
      if (row + r < row_end && col < n) *reinterpret_cast<uint4*>(out + int64_t(row + r) * n + col) = v;  // n % 8 == 0
    }
  }
}

// A grouped GEMM's tiles: 128 rows x kBlockN columns, kBlockK elements of K (128 bytes) a stage,
// kStages stages (the FP8 kernel, ops/wgmma_fp8.cuh, has its own).
template <int kN, int kK, int kS, int kTileB>
struct Tiling {
  static constexpr int kBlockN = kN, kBlockK = kK, kStages = kS, kTileBBytes = kTileB, kStageBytes = kTileABytes + kTileB;
};
using Bf16Tiling = Tiling<kBlockN, kBlockK, kStages, kTileBBytes>;

// A grouped GEMM's shared memory from a 1024-byte aligned base (the 128-byte swizzle's period):
// kStages stages of an A tile and a B tile, the consumer warps' staging for the stores (4 KiB a
// warp), the stages' full and empty mbarriers (8 bytes each), the tile each stage starts, and
// tile_start. base is its shared address, smem the same bytes as a pointer.
template <class T>
struct GroupedSmem {
  uint32_t base;
  unsigned char* smem;
  __device__ __forceinline__ uint32_t tile_a(int s) const { return base + s * T::kStageBytes; }
  __device__ __forceinline__ uint32_t tile_b(int s) const { return base + s * T::kStageBytes + kTileABytes; }
  __device__ __forceinline__ uint32_t full() const { return base + T::kStages * T::kStageBytes + kStagingBytes; }
  __device__ __forceinline__ uint32_t empty() const { return full() + T::kStages * 8; }
  __device__ __forceinline__ unsigned char* staging() const { return smem + T::kStages * T::kStageBytes; }
  __device__ __forceinline__ Tile* stage_tile() const { return reinterpret_cast<Tile*>(staging() + kStagingBytes + 2 * T::kStages * 8); }
  __device__ __forceinline__ int* tile_start() const { return reinterpret_cast<int*>(stage_tile() + T::kStages); }
};

template <class T>
__device__ __forceinline__ GroupedSmem<T> grouped_smem(unsigned char* smem_raw) {
  const uint32_t raw = smem_address(smem_raw), base = (raw + 1023) & ~1023u;
  return {base, smem_raw + (base - raw)};
}

// The producer warp: finds the block's tiles (lane 0 issues their copies, stage by stage), then
// publishes a stage that carries no tile. Blocks start on tiles blockIdx.x and take the next free
// one from counters[0] when done: tiles differ in cost (an expert's last row tile), so a fixed round
// robin leaves blocks idle at the end.
template <class T, int kTransB>
__device__ __forceinline__ void produce_tiles(const GroupedSmem<T>& m, const CUtensorMap* a_map, const CUtensorMap* b_map,
                                              const int32_t* offsets, int32_t* counters, int experts, int n, int k_blocks) {
  const bool leader = threadIdx.x == 0;
  const int tiles = scan_tile_starts(m.tile_start(), offsets, experts, (n + T::kBlockN - 1) / T::kBlockN);
  int it = 0, expert = 0;
  for (int t = blockIdx.x; t < tiles;) {
    int next = 0;
    if (leader) next = int(gridDim.x) + atomicAdd(counters, 1);
    const Tile tile = find_tile<T::kBlockN>(t, offsets, m.tile_start(), experts, expert);
    if (leader) {
      for (int kb = 0; kb < k_blocks; ++kb, ++it) {
        const int s = it % T::kStages;
        barrier_wait(m.empty() + 8 * s, ((it / T::kStages) & 1) ^ 1);
        if (kb == 0) m.stage_tile()[s] = tile;  // published by the arrive below
        barrier_expect_bytes(m.full() + 8 * s, T::kStageBytes);
        tma_load_2d(m.tile_a(s), a_map, m.full() + 8 * s, kb * T::kBlockK, tile.row0);
        if constexpr (kTransB) {
          for (int j = 0; j < T::kBlockN / 64; ++j)
            tma_load_3d(m.tile_b(s) + j * (T::kTileBBytes / 4), b_map, m.full() + 8 * s, tile.col0 + 64 * j, kb * T::kBlockK, tile.expert);
        } else {
          tma_load_3d(m.tile_b(s), b_map, m.full() + 8 * s, kb * T::kBlockK, tile.col0, tile.expert);
        }
      }
    }
    t = __shfl_sync(~0u, next, 0);
  }
  if (leader) {
    const int s = it % T::kStages;
    barrier_wait(m.empty() + 8 * s, ((it / T::kStages) & 1) ^ 1);
    m.stage_tile()[s] = Tile{-1, 0, 0, 0};
    barrier_arrive(m.full() + 8 * s);
    // This block takes no more tiles; the last block to get here resets the counters (every
    // block's last atomicAdd on the tile counter comes before its own on the done counter).
    __threadfence();
    if (atomicAdd(counters + 1, 1) == int(gridDim.x) - 1) {
      counters[0] = 0;
      counters[1] = 0;
    }
  }
}

// A consumer warpgroup: 64 rows of each tile the stages bring, k_blocks stages a tile, accumulated
// in registers and stored as bf16, until the stage that carries no tile.
template <int kTransB>
__device__ __forceinline__ void consume_tiles(const GroupedSmem<Bf16Tiling>& m, bf16* out, int n, int k_blocks) {
  const int consumer = threadIdx.x / 128 - 1;
  const bool lane0 = threadIdx.x % 32 == 0;
  unsigned char* warp_staging = m.staging() + (threadIdx.x / 32 - 4) * (kStagingBytes / (4 * kConsumers));
  float d[128];
  for (int it = 0;;) {
    barrier_wait(m.full() + 8 * (it % kStages), (it / kStages) & 1);
    const Tile tile = m.stage_tile()[it % kStages];
    if (tile.expert < 0) break;
    const int row = tile.row0 + 64 * consumer;
    const bool active = row < tile.row_end;  // else all 64 rows lie past the expert's end
    int previous = 0;
    for (int kb = 0; kb < k_blocks; ++kb, ++it) {
      const int s = it % kStages;
      if (kb > 0) barrier_wait(m.full() + 8 * s, (it / kStages) & 1);
      if (active) {
        fence_registers(d);
        mma_fence();
#pragma unroll
        for (int kk = 0; kk < kBlockK / 16; ++kk) {
          // K-major tiles: rows of 128 bytes, 8-row swizzle atoms 1024 bytes apart, 16 of K = 32
          // bytes. The N-major B: 64-column blocks of 64 K rows (8 KiB apart), 8-row atoms 1024
          // bytes apart, 16 of K = 2048 bytes.
          const uint64_t a = descriptor(m.tile_a(s) + consumer * 64 * 128 + kk * 32, 16, 1024);
          const uint64_t b = kTransB ? descriptor(m.tile_b(s) + kk * 16 * 128, kTileBBytes / 4, 1024)
                                     : descriptor(m.tile_b(s) + kk * 32, 16, 1024);
          mma_m64n256k16<0, kTransB>(d, a, b, kb > 0 || kk > 0);
        }
        mma_commit();
        mma_wait<1>();  // the previous stage's multiplies are done: it may be refilled
        fence_registers(d);
      }
      if (kb > 0 && lane0) barrier_arrive(m.empty() + 8 * previous);
      previous = s;
    }
    mma_wait<0>();
    fence_registers(d);
    if (lane0) barrier_arrive(m.empty() + 8 * previous);
    if (active) store_rows(out, d, warp_staging, row + (threadIdx.x / 32 % 4) * 16, tile.row_end, tile.col0, n);
  }
}

// out[R, n] = in[R, k] B_e per expert. a_map: in as [R, k] (box 64 x 128 rows). b_map: W as [E, O, I]
// (box 64 of I x 256 of O for the forward, 64 of I x 64 of O for the transposed B, four per stage).
// counters: the next tile and the blocks done, zero at launch and again at exit. Warpgroup 0 is the
// producer (one warp of it works), the others consume.
template <int kTransB>
__global__ void __launch_bounds__(kThreads, 1)
    grouped_gemm_kernel(const __grid_constant__ CUtensorMap a_map, const __grid_constant__ CUtensorMap b_map, bf16* out,
                        const int32_t* offsets, int32_t* counters, int experts, int n, int k) {
  extern __shared__ unsigned char smem_raw[];
  const GroupedSmem<Bf16Tiling> m = grouped_smem<Bf16Tiling>(smem_raw);
  init_stage_barriers(m.full(), m.empty(), kStages, kConsumers);
  begin_after_previous_grid();  // offsets, counters and the inputs come from earlier kernels
  const int k_blocks = (k + kBlockK - 1) / kBlockK;
  if (threadIdx.x / 128 == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (threadIdx.x >= 32) return;
    produce_tiles<Bf16Tiling, kTransB>(m, &a_map, &b_map, offsets, counters, experts, n, k_blocks);
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
  consume_tiles<kTransB>(m, out, n, k_blocks);
}

// ---- host ---------------------------------------------------------------------------------------
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    MARROW_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found));
    MARROW_CHECK(found == cudaDriverEntryPointSuccess && fn, "the CUDA driver has no cuTensorMapEncodeTiled (TMA needs CUDA 12)");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encode;
}

// The driver's text for a CUresult: cuGetErrorString through the runtime's entry point, as the
// encoder above (no link to libcuda).
inline std::string driver_error_text(CUresult result) {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found{};
  const char* text = nullptr;
  if (cudaGetDriverEntryPointByVersion("cuGetErrorString", &fn, 12000, cudaEnableDefault, &found) == cudaSuccess && fn)
    reinterpret_cast<CUresult (*)(CUresult, const char**)>(fn)(result, &text);
  return text ? std::string(text) : "CUresult " + std::to_string(int(result));
}

// A tensor map with 128-byte swizzle (bf16 unless told); dims innermost first, strides in bytes (rank
// - 1 of them).
inline CUtensorMap tensor_map(const void* data, int rank, const cuuint64_t* dims, const cuuint64_t* strides, const cuuint32_t* box,
                              CUtensorMapDataType dtype = CU_TENSOR_MAP_DATA_TYPE_BFLOAT16) {
  CUtensorMap map;
  const cuuint32_t element_strides[3] = {1, 1, 1};
  const CUresult result = tensor_map_encoder()(&map, dtype, cuuint32_t(rank), const_cast<void*>(data), dims,
                                               strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                                               CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                                               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (result != CUDA_SUCCESS) fail_call(__FILE__, __LINE__, "cuTensorMapEncodeTiled", driver_error_text(result));
  return map;
}

// The tiles of a call with output columns `cols` from host offsets (the launch sizes its grid by
// them); the FP8 kernel's tiles are the same size.
inline int tile_count(const int32_t* offsets, int64_t experts, int64_t cols) {
  const int64_t col_tiles = (cols + kBlockN - 1) / kBlockN;
  int64_t tiles = 0;
  for (int64_t e = 0; e < experts; ++e) tiles += (offsets[e + 1] - offsets[e] + kBlockM - 1) / kBlockM * col_tiles;
  return int(tiles);
}

// The SMs of the current device: the persistent kernels' grid.
inline int sm_count() {
  int device = 0, sms = 0;
  MARROW_CUDA_CHECK(cudaGetDevice(&device));
  MARROW_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return sms;
}

// One-block kernels that prepare per-expert work from device offsets (ops/wgmma_dw.cuh's work list).
constexpr int kScheduleThreads = 256;

// The kernel's counters for calls on `stream` of the current device: two ints, zeroed once and left
// zero by every call (stream order keeps a stream's calls apart).
inline int32_t* stream_counters(cudaStream_t stream) {
  static std::mutex mutex;
  static std::map<std::pair<int, cudaStream_t>, int32_t*> counters;
  int device = 0;
  MARROW_CUDA_CHECK(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(mutex);
  int32_t*& c = counters[{device, stream}];
  if (c == nullptr) {
    MARROW_CUDA_CHECK(cudaMalloc(&c, 2 * sizeof(int32_t)));
    MARROW_CUDA_CHECK(cudaMemset(c, 0, 2 * sizeof(int32_t)));
  }
  return c;
}

// out[R, cols] from in[R, inner] and weight[E, O, I]: forward (cols = O, inner = I) or backward input
// (cols = I, inner = O). offsets: the experts' rows in device memory; tiles: tile_count's, or -1 when
// the host does not know it (offsets computed on the device): one block per SM then, and the blocks
// past the last tile end at once.
inline void grouped_gemm(bool forward, bf16* out, const bf16* in, const bf16* weight, const int32_t* offsets, int tiles, int64_t experts,
                         int64_t o, int64_t i, int64_t rows, cudaStream_t stream) {
  if (tiles == 0) return;
  MARROW_CHECK(experts <= kMaxExperts, "the wgmma grouped GEMM holds at most {} experts' first tiles in shared memory, got {}", kMaxExperts,
               experts);
  const int64_t cols = forward ? o : i, inner = forward ? i : o;
  const cuuint64_t a_dims[2] = {cuuint64_t(inner), cuuint64_t(rows)}, a_strides[1] = {cuuint64_t(inner) * 2};
  const cuuint32_t a_box[2] = {kBlockK, kBlockM};
  const cuuint64_t w_dims[3] = {cuuint64_t(i), cuuint64_t(o), cuuint64_t(experts)}, w_strides[2] = {cuuint64_t(i) * 2, cuuint64_t(o * i) * 2};
  const cuuint32_t w_box_forward[3] = {kBlockK, kBlockN, 1}, w_box_backward[3] = {64, kBlockK, 1};
  const CUtensorMap a_map = tensor_map(in, 2, a_dims, a_strides, a_box);
  const CUtensorMap b_map = tensor_map(weight, 3, w_dims, w_strides, forward ? w_box_forward : w_box_backward);
  const unsigned grid = unsigned(tiles < 0 ? sm_count() : std::min(tiles, sm_count()));
  const auto kernel = forward ? grouped_gemm_kernel<0> : grouped_gemm_kernel<1>;
  MARROW_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes(experts)));
  launch_dependent(kernel, grid, kThreads, smem_bytes(experts), stream, a_map, b_map, out, offsets, stream_counters(stream), int(experts),
                   int(cols), int(inner));
}

}  // namespace marrow::wgmma
