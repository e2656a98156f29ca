// Hopper (sm_90a) kernel of the expert weight gradient: dW[e] (f32 [O, I]) (+)= dy_e^T x_e, where
// rows [offsets[e], offsets[e + 1]) of dy [R, O] and x [R, I] (bf16) belong to expert e; or of two
// such pairs (two micro-batches), a tile summing the first's rows of its expert, then the second's,
// in the very k-steps two calls would run, so its result is the two calls' bit for bit with one
// read and one write of dW instead of two each (the traffic that bounds this kernel). The GEMM's
// K is the expert's rows: D[O tile, I tile] = A[O tile, k] B[k, I tile] with A = dy_e^T and B = x_e,
// both read by TMA as they lie in memory (tiles of 64 token rows x 64 contiguous columns, 128-byte
// swizzle), so A is M-major and B N-major: wgmma's transpose bits for both (A from shared memory).
// Persistent like ops/wgmma.cuh (whose PTX wrappers it uses): one producer warpgroup (one thread
// issues the copies, kStages deep, on mbarriers) and two consumer warpgroups of m64n256k16, each 64
// dW rows of a 128 x 256 tile; blocks take tiles from a counter. A tile's sum runs over its expert's
// rows in order in one block, so the result is deterministic (no split over rows, no atomics on data).
// Expert boundaries lie inside K and are arbitrary: a tile's copies start at the expert's first row
// (TMA coordinates need no alignment), so no earlier row is read; the last k-step may hold the next
// expert's rows, which the consumers zero in shared memory (rows past the end of each of the stage's
// six 8 KiB boxes are one contiguous byte range) before a proxy fence and a barrier of the two
// consumer warpgroups, then multiply. (Per-expert tensor maps with TMA's zero fill would do the same
// with 2E maps built and uploaded per call and a tensormap fence per tile; zeroing costs a few
// shared stores in one k-step per tile.) An expert with no rows (overwrite only) takes one stage
// that carries its tile and nothing else, and its tiles store zeros: nothing loaded or multiplied.
// Accumulate: the accumulators start from the old dW tile, loaded into registers before the first
// multiply; the epilogue stores them straight from registers (each warp store
// covers whole 32-byte sectors). dW moves with streaming hints (ld/st .cs) so that its 2 x 4 bytes
// per element do not push the inputs out of L2. The kernel is bound by that traffic at the bench
// shapes: see grouped_linear.h and docs/performance.md. Given `squares`, each consumer warp also
// writes the sum of squares of its 16 finished dW rows x 256 columns (grouped_linear.h's bands),
// from the registers the epilogue stores, so the gradient norm need not read dW again.
#pragma once
#include <vector>

#include "ops/wgmma.cuh"

namespace marrow::wgmma::dw {

constexpr int kBlockM = 128;  // dW rows (o) per tile: two consumer warpgroups of 64
constexpr int kBlockN = 256;  // dW columns (i) per tile: one m64n256k16 per consumer
constexpr int kBlockK = 64;   // token rows per stage
constexpr int kStages = 4;
constexpr int kConsumers = 2;
constexpr int kThreads = 128 * (1 + kConsumers);
constexpr int kBoxBytes = 64 * kBlockK * 2;             // one TMA box: 64 token rows x 64 columns (128 bytes)
constexpr int kTileABytes = kBlockM / 64 * kBoxBytes;  // dy: 2 boxes
constexpr int kStageBytes = kTileABytes + kBlockN / 64 * kBoxBytes;  // + x: 4 boxes = 48 KiB

// A tile: rows [begin0, end0) of `expert` in source 0, then [begin1, end1) in source 1, dW rows
// o0.., columns i0..; expert < 0: no tiles left. (Named fields, not arrays: an array indexed by a
// run-time source would live in local memory.)
struct Tile {
  int expert, begin0, end0, begin1, end1, o0, i0;
};
// 1024 bytes of slack to align the stages to the swizzle's 1024-byte period, the stages, the
// full/empty mbarriers and the tile each stage starts.
constexpr int kSmemBytes = 1024 + kStages * kStageBytes + 2 * kStages * 8 + kStages * int(sizeof(Tile));

// k-steps of source p's rows, and of the whole tile: an expert without rows still runs one (all its
// rows zeroed).
__device__ __forceinline__ int steps_of(int begin, int end) { return (end - begin + kBlockK - 1) / kBlockK; }
__device__ __forceinline__ int k_steps(const Tile& t) {
  const int steps = steps_of(t.begin0, t.end0) + steps_of(t.begin1, t.end1);
  return steps > 0 ? steps : 1;
}
__device__ __forceinline__ bool no_rows(const Tile& t) { return t.end0 == t.begin0 && t.end1 == t.begin1; }

// Where k-step kb of a tile reads: its source, first row and number of rows (up to kBlockK).
struct KStep {
  int source, row, valid;
};
__device__ __forceinline__ KStep k_step(const Tile& t, int kb) {
  const int first = steps_of(t.begin0, t.end0);
  if (kb < first) return {0, t.begin0 + kb * kBlockK, t.end0 - t.begin0 - kb * kBlockK};
  return {1, t.begin1 + (kb - first) * kBlockK, t.end1 - t.begin1 - (kb - first) * kBlockK};
}

// work: the number of work items, a tile counter (zero at launch), then (expert, first row, end row
// in source 0, the same in source 1) of each expert that gets tiles. Tile t: work item
// t / tiles_per_work, its dW tiles in row-major order.
constexpr int kWorkInts = 5;
__device__ __forceinline__ Tile find_tile(int t, const int32_t* work, int o_size, int i_size) {
  const int i_tiles = (i_size + kBlockN - 1) / kBlockN, o_tiles = (o_size + kBlockM - 1) / kBlockM;
  const int w = t / (o_tiles * i_tiles), local = t % (o_tiles * i_tiles);
  const int32_t* item = work + 2 + kWorkInts * w;
  return {item[0], item[1], item[2], item[3], item[4], local / i_tiles * kBlockM, local % i_tiles * kBlockN};
}

// The work list on the host from host offsets (second: null for one source): every expert with
// rows, or every expert when overwriting (an expert without rows then writes zeros); its counter zero.
inline std::vector<int32_t> work_list(const int32_t* offsets, const int32_t* second, int64_t experts, bool overwrite) {
  std::vector<int32_t> work{0, 0};
  for (int64_t e = 0; e < experts; ++e) {
    const int32_t b0 = second ? second[e] : 0, b1 = second ? second[e + 1] : 0;
    if (overwrite || offsets[e + 1] > offsets[e] || b1 > b0) work.insert(work.end(), {int32_t(e), offsets[e], offsets[e + 1], b0, b1});
  }
  work[0] = int32_t((work.size() - 2) / kWorkInts);
  return work;
}

// The same list built on the device from offsets in device memory, so that the host needs no expert
// sizes: one block of kScheduleThreads, each round's experts placed by an exclusive scan of which
// of them have work. With known_zero (grouped_linear.h), an overwrite leaves out the flagged experts
// without rows and zeroes their `band_count` bands of squares (when given), and the flags are
// updated. The bands are zeroed by the whole block, a round's skipped experts one after another
// (one thread looping over an expert's 768 bands took ~50 us a call).
__global__ void __launch_bounds__(kScheduleThreads)
    work_list_kernel(int32_t* work, const int32_t* offsets, const int32_t* second, int experts, bool overwrite, int32_t* known_zero,
                     double* squares, int band_count) {
  using Scan = cub::BlockScan<int, kScheduleThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  __shared__ int skipped[kScheduleThreads];  // this round's experts whose bands are zeroed
  begin_after_previous_grid();
  int works = 0;  // items of the experts before this round
  for (int base = 0; base < experts; base += kScheduleThreads) {
    const int e = base + int(threadIdx.x);
    const int b0 = e < experts && second ? second[e] : 0, b1 = e < experts && second ? second[e + 1] : 0;
    const bool rows = e < experts && (offsets[e + 1] > offsets[e] || b1 > b0);
    const bool zeros_known = e < experts && known_zero && overwrite && !rows && known_zero[e];
    if (known_zero && e < experts && (overwrite || rows)) known_zero[e] = rows ? 0 : 1;
    if (known_zero && overwrite && squares) {  // the same for the whole block
      int skip_index = 0, skips = 0;
      Scan(scan_storage).ExclusiveSum(zeros_known ? 1 : 0, skip_index, skips);
      if (zeros_known) skipped[skip_index] = e;
      __syncthreads();  // skipped is complete; scan_storage is free again
      for (int j = int(threadIdx.x); j < skips * band_count; j += kScheduleThreads)
        squares[int64_t(skipped[j / band_count]) * band_count + j % band_count] = 0.0;
    }
    const int has_work = e < experts && (rows || (overwrite && !zeros_known)) ? 1 : 0;
    int index = 0, round = 0;
    Scan(scan_storage).ExclusiveSum(has_work, index, round);
    if (has_work) {
      int32_t* item = work + 2 + kWorkInts * (works + index);
      item[0] = e;
      item[1] = offsets[e];
      item[2] = offsets[e + 1];
      item[3] = b0;
      item[4] = b1;
    }
    works += round;
    __syncthreads();  // scan_storage is reused by the next round
  }
  if (threadIdx.x == 0) {
    work[0] = works;
    work[1] = 0;
  }
}

// Zeroes token rows [valid, 64) of the stage's six boxes (valid < 64; a box row is 128 bytes,
// swizzled only within itself), then makes the writes visible to wgmma (async proxy) in both
// consumer warpgroups (named barrier 1 over their 256 threads).
__device__ __forceinline__ void zero_rows_past_end(uint32_t stage, int valid) {
  const int chunks = (kBlockK - valid) * 8;  // 16-byte chunks per box
  for (int c = int(threadIdx.x) - 128; c < 6 * chunks; c += 128 * kConsumers) {
    const uint32_t address = stage + (c / chunks) * kBoxBytes + valid * 128 + (c % chunks) * 16;
    asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" ::"r"(address), "r"(0) : "memory");
  }
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  asm volatile("bar.sync 1, %0;" ::"n"(128 * kConsumers) : "memory");
}

// One consumer warp's 16 dW rows (o, o + 8 for lanes / 4) x 256 columns in the accumulator layout
// (see ops/wgmma.cuh's store_rows): d[4j + 2h], d[4j + 2h + 1] are row o + 8h, columns 8j + 2 (lane % 4)
// and + 1. Loads the old values (accumulate) or zeros; rows past O and columns past I are left out.
__device__ __forceinline__ void load_accumulators(float (&d)[128], const float* dw, int o, int i0, int o_size, int i_size, bool accumulate) {
  const int i = i0 + 2 * (threadIdx.x % 4);
#pragma unroll
  for (int j = 0; j < 32; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float2 v = make_float2(0.0f, 0.0f);
      if (accumulate && o + 8 * h < o_size && i + 8 * j < i_size)
        v = __ldcs(reinterpret_cast<const float2*>(dw + int64_t(o + 8 * h) * i_size + i + 8 * j));
      d[4 * j + 2 * h] = v.x;
      d[4 * j + 2 * h + 1] = v.y;
    }
}

__device__ __forceinline__ void store_accumulators(float* dw, const float (&d)[128], int o, int i0, int o_size, int i_size) {
  const int i = i0 + 2 * (threadIdx.x % 4);
#pragma unroll
  for (int j = 0; j < 32; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h)
      if (o + 8 * h < o_size && i + 8 * j < i_size)
        __stcs(reinterpret_cast<float2*>(dw + int64_t(o + 8 * h) * i_size + i + 8 * j), make_float2(d[4 * j + 2 * h], d[4 * j + 2 * h + 1]));
}

// grouped_linear.h's band of dW row o (a multiple of 16), columns i0..
__device__ __forceinline__ int64_t band_index(int expert, int o, int i0, int o_size, int i_size) {
  const int bands_o = (o_size + 15) / 16, bands_i = (i_size + kBlockN - 1) / kBlockN;
  return (int64_t(expert) * bands_o + o / 16) * bands_i + i0 / kBlockN;
}

// The sum of squares of one warp's finished 16 dW rows (o is the band's first row for lane 0) x
// 256 columns: a lane's values in groups of 8 squared and added in f32 (16 conversions to f64 a
// lane instead of 128: f64 conversions issue at an eighth of the f32 rate), the groups in f64, the
// lanes in a butterfly; lane 0 writes the band (grouped_linear.h's layout), unless it starts past O.
__device__ __forceinline__ void store_band_squares(double* squares, const float (&d)[128], int expert, int o, int i0, int o_size,
                                                   int i_size) {
  const int i = i0 + 2 * (threadIdx.x % 4);
  double sum = 0;
#pragma unroll
  for (int j2 = 0; j2 < 16; ++j2) {
    float group = 0;
#pragma unroll
    for (int j = 2 * j2; j < 2 * j2 + 2; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        if (o + 8 * h < o_size && i + 8 * j < i_size) {
          group = fmaf(d[4 * j + 2 * h], d[4 * j + 2 * h], group);
          group = fmaf(d[4 * j + 2 * h + 1], d[4 * j + 2 * h + 1], group);
        }
    sum += double(group);
  }
  sum = warp_sum(sum);
  if (threadIdx.x % 32 == 0 && o < o_size) squares[band_index(expert, o, i0, o_size, i_size)] = sum;
}

// dy_maps[p]: source p's dy as [R_p, O], x_maps[p]: its x as [R_p, I], boxes of 64 columns x 64 rows
// (with one source, source 1's maps repeat source 0's and no work item has rows there).
struct SourceMaps {
  CUtensorMap dy[2], x[2];
};
// The dW kernel's shared memory from a 1024-byte aligned base: kStages stages of a dy tile and an x
// tile, the stages' full and empty mbarriers (8 bytes each), the tile each stage starts. base is its
// shared address, smem the same bytes as a pointer.
struct DwSmem {
  uint32_t base;
  unsigned char* smem;
  __device__ __forceinline__ uint32_t stage(int s) const { return base + s * kStageBytes; }
  __device__ __forceinline__ uint32_t full() const { return base + kStages * kStageBytes; }
  __device__ __forceinline__ uint32_t empty() const { return full() + kStages * 8; }
  __device__ __forceinline__ Tile* stage_tile() const { return reinterpret_cast<Tile*>(smem + kStages * kStageBytes + 2 * kStages * 8); }
};

// The producer thread: the block's tiles from the work list (blocks start on tiles blockIdx.x and
// take the next free one from work[1]), each tile's k steps stage by stage (a tile with no rows as
// one stage that carries it alone), then a stage that carries no tile.
__device__ __forceinline__ void produce_dw_tiles(const DwSmem& m, const SourceMaps& maps, int32_t* work, int tiles, int o_size,
                                                 int i_size) {
  int it = 0;
  for (int t = blockIdx.x; t < tiles;) {
    const int next = int(gridDim.x) + atomicAdd(work + 1, 1);
    const Tile tile = find_tile(t, work, o_size, i_size);
    for (int kb = 0; kb < k_steps(tile); ++kb, ++it) {
      const int s = it % kStages;
      barrier_wait(m.empty() + 8 * s, ((it / kStages) & 1) ^ 1);
      if (kb == 0) m.stage_tile()[s] = tile;  // published by the arrive below
      if (no_rows(tile)) {                    // the tile alone
        barrier_arrive(m.full() + 8 * s);
        continue;
      }
      const KStep step = k_step(tile, kb);
      const CUtensorMap *dy_map = step.source == 0 ? &maps.dy[0] : &maps.dy[1], *x_map = step.source == 0 ? &maps.x[0] : &maps.x[1];
      barrier_expect_bytes(m.full() + 8 * s, kStageBytes);
      for (int j = 0; j < kBlockM / 64; ++j) tma_load_2d(m.stage(s) + j * kBoxBytes, dy_map, m.full() + 8 * s, tile.o0 + 64 * j, step.row);
      for (int j = 0; j < kBlockN / 64; ++j)
        tma_load_2d(m.stage(s) + kTileABytes + j * kBoxBytes, x_map, m.full() + 8 * s, tile.i0 + 64 * j, step.row);
    }
    t = next;
  }
  const int s = it % kStages;
  barrier_wait(m.empty() + 8 * s, ((it / kStages) & 1) ^ 1);
  m.stage_tile()[s] = Tile{-1, 0, 0, 0, 0, 0, 0};
  barrier_arrive(m.full() + 8 * s);
}

// A consumer warpgroup: 64 dW rows of each tile the stages bring, loaded (accumulating) or zero,
// the tile's k steps added in registers, stored back with the rows' squares when asked; until the
// stage that carries no tile.
__device__ __forceinline__ void consume_dw_tiles(const DwSmem& m, float* dweight, int o_size, int i_size, bool accumulate,
                                                 double* squares) {
  const int consumer = threadIdx.x / 128 - 1;
  const bool lane0 = threadIdx.x % 32 == 0;
  const int row_in_tile = 64 * consumer + 16 * (threadIdx.x / 32 % 4) + threadIdx.x % 32 / 4;  // this thread's first dW row
  float d[128];
  for (int it = 0;;) {
    barrier_wait(m.full() + 8 * (it % kStages), (it / kStages) & 1);
    const Tile tile = m.stage_tile()[it % kStages];
    if (tile.expert < 0) break;
    float* dw = dweight + int64_t(tile.expert) * o_size * i_size;
    if (no_rows(tile)) {  // overwriting (accumulating lists only experts with rows)
      if (lane0) barrier_arrive(m.empty() + 8 * (it % kStages));
      ++it;
      load_accumulators(d, dw, tile.o0 + row_in_tile, tile.i0, o_size, i_size, false);
      store_accumulators(dw, d, tile.o0 + row_in_tile, tile.i0, o_size, i_size);
      const int band = tile.o0 + row_in_tile;  // lane 0's row starts the warp's band
      if (squares && lane0 && band < o_size) squares[band_index(tile.expert, band, tile.i0, o_size, i_size)] = 0.0;
      continue;
    }
    load_accumulators(d, dw, tile.o0 + row_in_tile, tile.i0, o_size, i_size, accumulate);
    int previous = 0;
    for (int kb = 0; kb < k_steps(tile); ++kb, ++it) {
      const int s = it % kStages, valid = k_step(tile, kb).valid;
      if (kb > 0) barrier_wait(m.full() + 8 * s, (it / kStages) & 1);
      if (valid < kBlockK) zero_rows_past_end(m.stage(s), valid);
      fence_registers(d);
      mma_fence();
#pragma unroll
      for (int kk = 0; kk < kBlockK / 16; ++kk) {
        // Both operands MN-major: 64-column boxes of 64 token rows (8 KiB apart: the leading byte
        // offset, used by B's four boxes), 8-row swizzle atoms 1024 bytes apart, 16 of K = 2048 bytes.
        const uint64_t a = descriptor(m.stage(s) + consumer * kBoxBytes + kk * 16 * 128, kBoxBytes, 1024);
        const uint64_t b = descriptor(m.stage(s) + kTileABytes + kk * 16 * 128, kBoxBytes, 1024);
        mma_m64n256k16<1, 1>(d, a, b, 1);
      }
      mma_commit();
      mma_wait<1>();  // the previous stage's multiplies are done: it may be refilled
      fence_registers(d);
      if (kb > 0 && lane0) barrier_arrive(m.empty() + 8 * previous);
      previous = s;
    }
    mma_wait<0>();
    fence_registers(d);
    if (lane0) barrier_arrive(m.empty() + 8 * previous);
    store_accumulators(dw, d, tile.o0 + row_in_tile, tile.i0, o_size, i_size);
    if (squares) store_band_squares(squares, d, tile.expert, tile.o0 + row_in_tile, tile.i0, o_size, i_size);
  }
}

// Warpgroup 0 is the producer (one thread of it works), the others consume.
__global__ void __launch_bounds__(kThreads, 1)
    grouped_dw_kernel(const __grid_constant__ SourceMaps maps, float* dweight, int32_t* work, int o_size, int i_size, bool accumulate,
                      double* squares) {
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw = smem_address(smem_raw), base = (raw + 1023) & ~1023u;
  const DwSmem m{base, smem_raw + (base - raw)};
  init_stage_barriers(m.full(), m.empty(), kStages, kConsumers);
  begin_after_previous_grid();  // the work list, dW and the inputs come from earlier kernels
  const int tiles = work[0] * ((o_size + kBlockM - 1) / kBlockM) * ((i_size + kBlockN - 1) / kBlockN);
  if (threadIdx.x / 128 == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;");
    if (threadIdx.x == 0) produce_dw_tiles(m, maps, work, tiles, o_size, i_size);
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;");
  consume_dw_tiles(m, dweight, o_size, i_size, accumulate, squares);
}

// One source's rows: dy [rows, O] and x [rows, I].
struct Source {
  const bf16 *dy, *x;
  int64_t rows;
};

// dweight[E, O, I] (+)= dy_e^T x_e over sources[0], then sources[1] when given (rows > 0), for the
// work items of `work` (device memory, see find_tile; its counter must be zero); works: their
// number, or -1 when the host does not know it (a list built on the device: one block per SM, the
// blocks past the last tile end at once). Needs rows > 0 in one source, O and I multiples of 8, dy
// and x 16-byte aligned, dweight 8. squares (may be null): the bands' sums of squares of the tiles
// in `work`.
inline void grouped_dw(float* dweight, const Source (&sources)[2], int32_t* work, int works, int64_t o, int64_t i, bool accumulate,
                       double* squares, cudaStream_t stream) {
  const int64_t tiles = int64_t(works) * ((o + kBlockM - 1) / kBlockM) * ((i + kBlockN - 1) / kBlockN);
  if (works == 0) return;
  MARROW_CHECK(tiles < (int64_t(1) << 31), "grouped dW: {} tiles exceed the kernel's int range", tiles);
  SourceMaps maps;
  const Source& fallback = sources[0].rows > 0 ? sources[0] : sources[1];  // for a source without rows
  MARROW_CHECK(fallback.rows > 0, "grouped dW: no source has rows");
  for (int p = 0; p < 2; ++p) {
    const Source& source = sources[p].rows > 0 ? sources[p] : fallback;
    const cuuint64_t dy_dims[2] = {cuuint64_t(o), cuuint64_t(source.rows)}, dy_strides[1] = {cuuint64_t(o) * 2};
    const cuuint64_t x_dims[2] = {cuuint64_t(i), cuuint64_t(source.rows)}, x_strides[1] = {cuuint64_t(i) * 2};
    const cuuint32_t box[2] = {64, kBlockK};
    maps.dy[p] = tensor_map(source.dy, 2, dy_dims, dy_strides, box);
    maps.x[p] = tensor_map(source.x, 2, x_dims, x_strides, box);
  }
  MARROW_CUDA_CHECK(cudaFuncSetAttribute(grouped_dw_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  const unsigned grid = unsigned(works < 0 ? sm_count() : std::min<int64_t>(tiles, sm_count()));
  launch_dependent(grouped_dw_kernel, grid, kThreads, kSmemBytes, stream, maps, dweight, work, int(o), int(i), accumulate, squares);
}

}  // namespace marrow::wgmma::dw
