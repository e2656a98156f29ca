// Hopper (sm_90a) grouped GEMM from FP8 operands with block scales (ops/fp8.h): out_e = in_e B_e^T
// for the row groups of grouped_linear, in [R, K] quantized by rows (1 x 128 blocks), B_e [N, K] by
// 128 x 128 blocks, both K-major (FP8 wgmma reads no other layout, so the backward input passes the
// weight's transposed quantization). The tile walk, the producer warp and the persistent grid are
// ops/wgmma.cuh's (that file says why); what differs: each K block of 128 (one 128-byte swizzle row, one
// scale block) is multiplied into a partial accumulator by four wgmma.m64n128k32.e4m3, which is then
// added into the f32 result times (row scale x weight scale): DeepSeek-V3's promotion, which also
// keeps the tensor cores' limited FP8 accumulation precision to 128 products at a time. A tile is
// 128 rows x 256 columns, taken as two halves of 128 columns (one weight scale block each) one after
// the other through the same partial registers: 128 result + 64 partial registers a thread fit where
// 2 x 128 would not, and against 128 x 128 tiles a K block brings 48 KiB from L2 for twice the
// multiplies instead of 32 KiB (tiles of 128 x 128 ran at ~5.6 TB/s of L2 reads: that bound them).
#pragma once
#include "ops/wgmma.cuh"

namespace marrow::wgmma::fp8 {

constexpr int kBlockN = 256;  // columns per tile: two halves of one m64n128k32 per consumer and 32 of K
constexpr int kHalfN = 128;   // one weight scale block
constexpr int kBlockK = 128;  // 128 e4m3 = one 128-byte swizzle row = one scale block
constexpr int kStages = 4;
constexpr int kTileABytes = kBlockM * kBlockK;  // 16 KiB
constexpr int kTileBBytes = kBlockN * kBlockK;  // 32 KiB
constexpr int kStageBytes = kTileABytes + kTileBBytes;
constexpr int kWarpStagingBytes = kStagingBytes / (4 * kConsumers);  // store_rows: 16 rows x 128 bf16 columns at a time
constexpr int kSmemBytes = 1024 + kStages * kStageBytes + kStagingBytes + 2 * kStages * 8 + kStages * 16;
constexpr int kMaxExperts = (kSmemLimit - kSmemBytes) / 4 - 1;
inline int smem_bytes(int64_t experts) { return kSmemBytes + 4 * int(experts + 1); }

// d (+)= A B^T, 64 x 128 x 32 of e4m3, both from shared memory, K-major.
__device__ __forceinline__ void mma_m64n128k32(float (&d)[64], uint64_t a_desc, uint64_t b_desc, int accumulate) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\nwgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {" MARROW_ACC64
               "}, %64, %65, p, 1, 1;\n}\n"
               : MARROW_D8(0), MARROW_D8(8), MARROW_D8(16), MARROW_D8(24),
                 MARROW_D8(32), MARROW_D8(40), MARROW_D8(48), MARROW_D8(56)
               : "l"(a_desc), "l"(b_desc), "r"(accumulate));
}

using Fp8Tiling = Tiling<kBlockN, kBlockK, kStages, kTileBBytes>;
using Smem = GroupedSmem<Fp8Tiling>;

// part (the 64 x 128 of half h) into d's columns 128 h ..: rows lane / 4 of each 8 take the first
// row's factor, the others the second's (the accumulator layout of ops/wgmma.cuh's store_rows, whose
// first 64 registers are the first 128 columns).
template <int kHalf>
__device__ __forceinline__ void promote(float (&d)[128], const float (&part)[64], float first, float second) {
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    d[64 * kHalf + 4 * j] += part[4 * j] * first;
    d[64 * kHalf + 4 * j + 1] += part[4 * j + 1] * first;
    d[64 * kHalf + 4 * j + 2] += part[4 * j + 2] * second;
    d[64 * kHalf + 4 * j + 3] += part[4 * j + 3] * second;
  }
}

// One half of a K block: 64 rows x 128 columns x 128 of K from stage s into part.
template <int kHalf>
__device__ __forceinline__ void multiply_half(float (&part)[64], const Smem& m, int s, int consumer) {
  fence_registers(part);
  mma_fence();
#pragma unroll
  for (int kk = 0; kk < kBlockK / 32; ++kk)  // 32 of K = 32 bytes along the swizzled rows
    mma_m64n128k32(part, descriptor(m.tile_a(s) + consumer * 64 * 128 + kk * 32, 16, 1024),
                   descriptor(m.tile_b(s) + kHalf * kHalfN * 128 + kk * 32, 16, 1024), kk > 0);
  mma_commit();
  mma_wait<0>();
  fence_registers(part);
}

// A consumer warpgroup: 64 rows of each tile. a_scales [k_blocks, rows], b_scales [E, ceil(n / 128),
// k_blocks] (ops/fp8.h's layouts).
__device__ __forceinline__ void consume_tiles(const Smem& m, bf16* out, const float* a_scales, const float* b_scales, int rows, int n,
                                              int k_blocks) {
  const int consumer = threadIdx.x / 128 - 1, warp = threadIdx.x / 32 % 4, lane = threadIdx.x % 32;
  unsigned char* warp_staging = m.staging() + (threadIdx.x / 32 - 4) * kWarpStagingBytes;
  const int n_blocks = (n + kHalfN - 1) / kHalfN;
  float d[128], part[64];
  for (int it = 0;;) {
    barrier_wait(m.full() + 8 * (it % kStages), (it / kStages) & 1);
    const Tile tile = m.stage_tile()[it % kStages];
    if (tile.expert < 0) break;
    const int row = tile.row0 + 64 * consumer, r0 = row + 16 * warp + lane / 4, r1 = r0 + 8;
    const bool active = row < tile.row_end;  // else all 64 rows lie past the expert's end
    const int64_t block = int64_t(tile.expert) * n_blocks + tile.col0 / kHalfN;
    const float* b_scale = b_scales + block * k_blocks;
    const bool second_half = tile.col0 + kHalfN < n;  // else its columns lie past n: its scales too
#pragma unroll
    for (int i = 0; i < 128; ++i) d[i] = 0;
    for (int kb = 0; kb < k_blocks; ++kb, ++it) {
      const int s = it % kStages;
      if (kb > 0) barrier_wait(m.full() + 8 * s, (it / kStages) & 1);
      // The scales are loaded before the multiplies start and used after they end.
      const float sb0 = b_scale[kb], sb1 = second_half ? b_scale[k_blocks + kb] : 0.0f;
      const float sa0 = r0 < rows ? a_scales[int64_t(kb) * rows + r0] : 0.0f;
      const float sa1 = r1 < rows ? a_scales[int64_t(kb) * rows + r1] : 0.0f;
      if (active) {
        multiply_half<0>(part, m, s, consumer);
        promote<0>(d, part, sa0 * sb0, sa1 * sb0);
        multiply_half<1>(part, m, s, consumer);
      }
      if (lane == 0) barrier_arrive(m.empty() + 8 * s);
      if (active) promote<1>(d, part, sa0 * sb1, sa1 * sb1);
    }
    if (active) store_rows(out, d, warp_staging, row + warp * 16, tile.row_end, tile.col0, n);
  }
}

// out[R, n] = in[R, k] W_e^T per expert. a_map: in as [R, k] bytes (box 128 x 128 rows); b_map: W as
// [E, n, k] bytes (box 128 of k x 256 of n). counters: as in ops/wgmma.cuh.
__global__ void __launch_bounds__(kThreads, 1)
    grouped_gemm_kernel(const __grid_constant__ CUtensorMap a_map, const __grid_constant__ CUtensorMap b_map, bf16* out,
                        const float* a_scales, const float* b_scales, const int32_t* offsets, int32_t* counters, int experts, int rows,
                        int n, int k) {
  extern __shared__ unsigned char smem_raw[];
  const Smem m = grouped_smem<Fp8Tiling>(smem_raw);
  init_stage_barriers(m.full(), m.empty(), kStages, kConsumers);
  begin_after_previous_grid();
  const int k_blocks = (k + kBlockK - 1) / kBlockK;
  if (threadIdx.x / 128 == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (threadIdx.x >= 32) return;
    produce_tiles<Fp8Tiling, 0>(m, &a_map, &b_map, offsets, counters, experts, n, k_blocks);
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
  consume_tiles(m, out, a_scales, b_scales, rows, n, k_blocks);
}

static_assert(kBlockN == wgmma::kBlockN, "wgmma::tile_count counts the FP8 kernel's tiles too");

// out[rows, n] from in[rows, k] and weight[E, n, k] (e4m3 bytes) with their scales; offsets in device
// memory; tiles: wgmma::tile_count's, or -1 when the host does not know it (one block per SM then).
inline void grouped_gemm(bf16* out, const uint8_t* in, const float* in_scales, const uint8_t* weight, const float* weight_scales,
                         const int32_t* offsets, int tiles, int64_t experts, int64_t n, int64_t k, int64_t rows, cudaStream_t stream) {
  if (tiles == 0) return;
  MARROW_CHECK(experts <= kMaxExperts, "the FP8 grouped GEMM holds at most {} experts' first tiles in shared memory, got {}", kMaxExperts,
               experts);
  const cuuint64_t a_dims[2] = {cuuint64_t(k), cuuint64_t(rows)}, a_strides[1] = {cuuint64_t(k)};
  const cuuint32_t a_box[2] = {kBlockK, kBlockM};
  const cuuint64_t w_dims[3] = {cuuint64_t(k), cuuint64_t(n), cuuint64_t(experts)}, w_strides[2] = {cuuint64_t(k), cuuint64_t(n * k)};
  const cuuint32_t w_box[3] = {kBlockK, kBlockN, 1};
  const CUtensorMap a_map = tensor_map(in, 2, a_dims, a_strides, a_box, CU_TENSOR_MAP_DATA_TYPE_UINT8);
  const CUtensorMap b_map = tensor_map(weight, 3, w_dims, w_strides, w_box, CU_TENSOR_MAP_DATA_TYPE_UINT8);
  const unsigned grid = unsigned(tiles < 0 ? sm_count() : std::min(tiles, sm_count()));
  MARROW_CUDA_CHECK(cudaFuncSetAttribute(grouped_gemm_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes(experts)));
  launch_dependent(grouped_gemm_kernel, grid, kThreads, smem_bytes(experts), stream, a_map, b_map, out, in_scales, weight_scales, offsets,
                   stream_counters(stream), int(experts), int(rows), int(n), int(k));
}

}  // namespace marrow::wgmma::fp8
