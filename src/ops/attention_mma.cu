// Marrow's own GPU kernels for attention.h: FlashAttention-2 on tensor cores (mma.sync m16n8k16,
// bf16 operands, f32 accumulators) for the causal op, its GPT-OSS variant and ring attention's
// blocks, at head_dim 64 and 128; and the small kernels of the merge and the sinks. The only GPU
// path for windowed blocks, head_dim 64 blocks and `train.attention_kernels=own`.
//
// All three main kernels share one shape of work: a block of 4 warps owns 64 rows of the result
// it accumulates in registers (query rows for out and dq, key rows for dk and dv), 16 rows per
// warp, and walks the other side in tiles that cp.async stages in shared memory two deep, so the
// next tile loads while this one is multiplied. Fragments come out of shared memory through
// ldmatrix; every tile row is padded by 16 bytes so the 8 rows one 8x8 ldmatrix reads fall in
// distinct banks (row stride 144 or 272 bytes = 4 banks apart). Score tiles live only in
// registers: the accumulator layout of a 16x16 piece of S = Q K^T is the A-operand layout of the
// next product (P V, dS K, dS^T Q), so probabilities never touch memory and no S x S matrix exists.
// Causal blocks are uneven (the last query block sees every key), so the longest blocks launch first.
// Invariants: no atomics anywhere (dq in its own pass, GQA's dK, dV as per-query-head partials summed
// in head order), so the backward is deterministic; rows past a tile's end load as zeros, so padded
// keys contribute exactly nothing.
// Gotcha: a pointer into shared memory handed to a device function may reach it as a generic pointer
// (generic loads and their address-space tests: +72 instructions when the dK/dV kernel's P^T step took
// its lse tile as an argument); keep such steps inline, and compare the SASS (.agents/skills/sass-compare).
//
// Fragment layouts (PTX ISA, mma.m16n8k16 with .bf16; g = lane / 4, t = lane % 4):
//   A 16x16 row-major: a0 = (g, 2t..2t+1), a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..)
//   B 16x8 "col":      b0 = (k 2t..2t+1, n g), b1 = (k 2t+8..2t+9, n g)
//   C 16x8:            c0, c1 = (g, 2t..2t+1), c2, c3 = (g+8, 2t..2t+1)
// The lower column index sits in the lower 16 bits of each 32-bit register.
#include "ops/attention_mma.h"

#include <algorithm>
#include <cmath>

#include "core/cuda_check.h"
#include "core/memory.h"
#include "ops/common.h"

#ifdef __CUDACC__
#include <cuda_bf16.h>

#include "ops/cuda_common.cuh"

namespace marrow {

namespace {

using bf16 = __nv_bfloat16;

constexpr int kThreads = 128;  // 4 warps per block in every kernel
constexpr int kWarpRows = 16;  // rows of the accumulated result per warp (the M of one mma)
constexpr int kPad = 8;        // bf16 elements of padding per shared-memory row (16 bytes)
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

__host__ __device__ constexpr int cdiv(int a, int b) { return (a + b - 1) / b; }

// 4 bytes (lse, delta entries); valid = false writes a zero.
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_address(smem)), "l"(gmem),
               "r"(valid ? 4 : 0));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const bf16* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const bf16* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_address(p)));
}

// c[16x8] += a[16x16] b[16x8], bf16 in, f32 accumulate.
__device__ __forceinline__ void mma_16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Stages rows [row0, row0 + ROWS) of a row-major bf16 matrix with `rows` rows of D elements (row
// stride ld elements) into a [ROWS][D + kPad] shared tile; rows at or past `rows` become zeros, so
// padded keys and values contribute exactly nothing (0 * v, never 0 * garbage).
template <int ROWS, int D>
__device__ __forceinline__ void load_rows(bf16* tile, const bf16* src, int64_t ld, int row0, int rows) {
  constexpr int kChunks = D / 8;  // 16-byte pieces per row
  static_assert(ROWS * kChunks % kThreads == 0, "tile does not split evenly over the block");
#pragma unroll
  for (int it = 0; it < ROWS * kChunks / kThreads; ++it) {
    const int c = it * kThreads + int(threadIdx.x), r = c / kChunks, col = c % kChunks * 8;
    const bool valid = row0 + r < rows;
    cp_async16(tile + r * (D + kPad) + col, valid ? src + int64_t(row0 + r) * ld + col : src, valid);
  }
}

// acc[16 x N] += A[16 x K] B^T for one warp: A is rows r0..r0+15 of a shared tile [.][K + kPad],
// B a shared tile stored [N][K + kPad] (B^T's rows are keys for S = Q K^T, queries for K Q^T, ...).
// One ldmatrix.x4 gives A's 16x16 piece; one more gives B fragments for two n-tiles of 8.
template <int K, int N>
__device__ __forceinline__ void warp_mma_nt(float (&acc)[N / 8][4], const bf16* a, int r0, const bf16* b, int lane) {
  constexpr int ld = K + kPad;
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk) {
    uint32_t af[4];
    ldmatrix_x4(af, a + (r0 + lane % 16) * ld + kk * 16 + lane / 16 * 8);
#pragma unroll
    for (int np = 0; np < N / 16; ++np) {
      uint32_t bf[4];  // b0, b1 of n-tile 2np, then of 2np+1
      ldmatrix_x4(bf, b + (np * 16 + lane % 8 + lane / 16 * 8) * ld + kk * 16 + lane / 8 % 2 * 8);
      mma_16816(acc[2 * np], af, bf[0], bf[1]);
      mma_16816(acc[2 * np + 1], af, bf[2], bf[3]);
    }
  }
}

// acc[16 x N] += P[16 x K] B for one warp: P is an f32 accumulator tile of this warp (K/8 n-tiles),
// rounded to bf16 as the A operand; B a shared tile stored [K][N + kPad] (values for O = P V, dO
// for dV = P^T dO, ...), transposed into B fragments by ldmatrix.trans.
template <int K, int N>
__device__ __forceinline__ void warp_mma_pn(float (&acc)[N / 8][4], const float (&p)[K / 8][4], const bf16* b,
                                            int lane) {
  constexpr int ld = N + kPad;
#pragma unroll
  for (int kk = 0; kk < K / 16; ++kk) {
    const uint32_t af[4] = {pack_bf16(p[2 * kk][0], p[2 * kk][1]), pack_bf16(p[2 * kk][2], p[2 * kk][3]),
                            pack_bf16(p[2 * kk + 1][0], p[2 * kk + 1][1]),
                            pack_bf16(p[2 * kk + 1][2], p[2 * kk + 1][3])};
#pragma unroll
    for (int np = 0; np < N / 16; ++np) {
      uint32_t bf[4];  // b0, b1 of n-tile 2np, then of 2np+1
      ldmatrix_x4_trans(bf, b + (kk * 16 + lane % 8 + lane / 8 % 2 * 8) * ld + np * 16 + lane / 16 * 8);
      mma_16816(acc[2 * np], af, bf[0], bf[1]);
      mma_16816(acc[2 * np + 1], af, bf[2], bf[3]);
    }
  }
}

// Sum over the 4 lanes of a quad (the threads that share a row of an accumulator tile). Every lane
// adds the same pairs, so all four get the same bits.
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

// One block of attention (ops/attention.h): query rows [q_begin, q_begin + q_len) of q against key
// rows [k_begin, k_begin + k_len) of k and v. The causal op is the causal block over all rows.
struct GpuArgs {
  const bf16 *q, *k, *v, *out, *dout;
  bf16* o;               // forward output
  float* lse;            // forward output; backward input
  const float* delta;    // backward: rowsum(dout * out) of the block's queries, [B, Hq, q_len]
  bf16 *dq, *dk, *dv;    // backward outputs, overwritten (the causal op)
  float *dq_acc, *dk_acc, *dv_acc;  // or f32 backward outputs added into (a block); null otherwise
  float *dk_part, *dv_part;  // [B, k_len, Hq, D] per-query-head dk, dv when Hq > Hkv; null otherwise
  int q_seq, kv_seq;     // rows of the q and k tensors
  int q_begin, q_len, k_begin, k_len;
  bool full;             // every query sees every key; else causal (q_len == k_len)
  int q_heads, kv_heads;
  float scale, scale_log2;  // 1/sqrt(D), and times log2(e): probabilities go through exp2
  // GPT-OSS's variant (the kernels' V = true instantiations): a sliding window of `window` keys (0:
  // none), `distance` the position of query row q_begin minus that of key row k_begin (0 in a causal
  // block), and a sink logit per query head (null: none; the causal op only).
  int window, distance;
  const bf16* sinks;  // [Hq]
  // Packed documents: [B, q_seq] each query row's position in its document (null: none); a query
  // sees keys at most that many positions before it. Block rows are consecutive positions, so a
  // row's first key never decreases down the rows (tile bounds from a tile's first or last row hold).
  const int* documents;

  // Head rows (units of D elements) of the block's query i of head h and key j of kv head hk.
  __device__ int64_t q_row(int64_t b, int64_t i, int64_t h) const {
    return (b * q_seq + q_begin + i) * q_heads + h;
  }
  __device__ int64_t kv_row(int64_t b, int64_t j, int64_t hk) const {
    return (b * kv_seq + k_begin + j) * kv_heads + hk;
  }
  __device__ int64_t lse_at(int64_t b, int64_t h, int64_t i) const { return (b * q_heads + h) * q_seq + q_begin + i; }
  // The last key (block index) query i may see.
  __device__ int last_key(int i) const { return full ? k_len - 1 : i; }
  // With a window or documents: the first key query i of batch row b sees, and (window only) the
  // last query that sees key j (block indices; beyond the block's keys or before its queries when a
  // row or a key sees nothing). Rows past the block's end take its last row's document.
  __device__ int first_key(int b, int i) const {
    int reach = window;
    if (documents) {
      const int in_document = documents[int64_t(b) * q_seq + q_begin + min(i, q_len - 1)] + 1;
      reach = reach > 0 ? min(reach, in_document) : in_document;
    }
    return reach > 0 ? max(0, distance + i - reach + 1) : 0;
  }
  __device__ int last_query(int j) const { return window > 0 ? j - distance + window - 1 : q_len - 1; }
};

// Adds (x, y) into the adjacent f32 elements p[0], p[1] (8-byte aligned).
__device__ __forceinline__ void add_float2(float* p, float x, float y) {
  const float2 o = *reinterpret_cast<const float2*>(p);
  *reinterpret_cast<float2*>(p) = make_float2(o.x + x, o.y + y);
}

// The forward's online softmax over one key tile for a lane's two rows (row, row + 8 of the warp's from row0):
// s (scores) becomes P = exp2(scale s - max), the running max and sum move to the tile's, and o is
// rescaled to the new max. Keys past a row's last key are -inf: after the query (causal; keys past
// the end are after every stored query) or past the block's end (full). Every row sees key 0, in
// the first tile, so the running max is finite from then on. V (GPT-OSS's variant): keys before a
// row's window are -inf too; a row may see none of a tile (its max stays -inf, its P 0), and the
// sink starts the running max and sum.
template <int D, int BN, bool V = false>
__device__ __forceinline__ void online_softmax(float (&s)[BN / 8][4], float (&o)[D / 8][4], float (&row_max)[2], float (&row_sum)[2],
                                               const GpuArgs& a, int b, int n0, int row0, int row, int t) {
  const bool edge = n0 + BN - 1 > a.last_key(row0);
  float tile_max[2] = {row_max[0], row_max[1]};
#pragma unroll
  for (int j = 0; j < BN / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float x = s[j][e] * a.scale_log2;
      if (edge && n0 + j * 8 + 2 * t + e % 2 > a.last_key(row + e / 2 * 8)) x = -INFINITY;
      if constexpr (V)
        if (n0 < a.first_key(b, row0 + kWarpRows - 1) && n0 + j * 8 + 2 * t + e % 2 < a.first_key(b, row + e / 2 * 8)) x = -INFINITY;
      s[j][e] = x;
      tile_max[e / 2] = fmaxf(tile_max[e / 2], x);
    }
  float base[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    tile_max[r] = quad_max(tile_max[r]);
    base[r] = tile_max[r] == -INFINITY ? 0.f : tile_max[r];
    const float rescale = exp2f(row_max[r] - base[r]);  // 0 on the first tile
    row_max[r] = tile_max[r];
    row_sum[r] *= rescale;
#pragma unroll
    for (int d = 0; d < D / 8; ++d) {
      o[d][2 * r] *= rescale;
      o[d][2 * r + 1] *= rescale;
    }
  }
#pragma unroll
  for (int j = 0; j < BN / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      s[j][e] = exp2f(s[j][e] - base[e / 2]);
      row_sum[e / 2] += s[j][e];
    }
}

// The forward's end for one lane's two rows (row, row + 8): out = o / sum in bf16, and the row's
// log-sum-exp (natural log) from its running max and sum (log2 domain). V: a row that saw no key (a
// windowed block's) gets out 0 and lse -inf, which attention_merge skips.
template <int D, bool V = false>
__device__ __forceinline__ void store_output(const GpuArgs& a, const float (&o)[D / 8][4], const float (&row_max)[2],
                                             const float (&row_sum)[2], int b, int h, int row) {
  const int t = threadIdx.x % 4;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int i = row + r * 8;
    const float sum = quad_sum(row_sum[r]);
    if (i >= a.q_len) continue;
    const float inv = V && sum == 0.f ? 0.f : 1.f / sum;  // no key: row_max and so lse stay -inf
    bf16* dst = a.o + a.q_row(b, i, h) * D + 2 * t;
#pragma unroll
    for (int d = 0; d < D / 8; ++d)
      *reinterpret_cast<__nv_bfloat162*>(dst + d * 8) = __floats2bfloat162_rn(o[d][2 * r] * inv, o[d][2 * r + 1] * inv);
    if (t == 0) a.lse[a.lse_at(b, h, i)] = (row_max[r] + log2f(sum)) * kLn2;
  }
}

// Forward. Grid (query blocks of 64, Hq, B); block = 4 warps, 16 query rows each. Shared: the
// Q tile [64][D+8] and two stages of K and V tiles [64][D+8]: 87 KB at D = 128 (2 blocks per SM),
// 46 KB at D = 64. Per key tile each warp computes S = Q K^T (16 x 64, 32 f32 registers), masks the
// diagonal tile, folds it into the running max / sum (online softmax in the log2 domain) and adds
// P V into its 16 x D output accumulator (64 registers at D = 128). Row max and sum are reduced
// across a quad with shuffles; the sum is kept per lane and reduced once at the end.
// V (GPT-OSS's variant, the causal op): key tiles start at the block's first row's window, and the
// sink starts each row's max (sink / ln 2) and sum (1, counted once: by the quad's lane 0).
template <int D, bool V = false>
__global__ void __launch_bounds__(kThreads) attention_forward_kernel(GpuArgs a) {
  constexpr int BM = 64, BN = 64, LD = D + kPad;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* sq = reinterpret_cast<bf16*>(smem);  // [BM][LD]
  bf16* sk = sq + BM * LD;                   // [2][BN][LD]
  bf16* sv = sk + 2 * BN * LD;               // [2][BN][LD]

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int m0 = (gridDim.x - 1 - blockIdx.x) * BM;
  const int h = blockIdx.y, b = blockIdx.z, hk = h / (a.q_heads / a.kv_heads);
  const int64_t q_ld = int64_t(a.q_heads) * D, kv_ld = int64_t(a.kv_heads) * D;
  const bf16* q = a.q + a.q_row(b, 0, h) * D;
  const bf16* k = a.k + a.kv_row(b, 0, hk) * D;
  const bf16* v = a.v + a.kv_row(b, 0, hk) * D;
  const int n_tiles = cdiv(min(a.k_len, a.last_key(m0 + BM - 1) + 1), BN);  // key tiles any row sees
  const int n_first = V ? a.first_key(b, m0) / BN : 0;

  load_rows<BM, D>(sq, q, q_ld, m0, a.q_len);
  load_rows<BN, D>(sk, k, kv_ld, n_first * BN, a.k_len);
  load_rows<BN, D>(sv, v, kv_ld, n_first * BN, a.k_len);
  cp_async_commit();

  const int row0 = m0 + warp * kWarpRows, row = row0 + g;  // this lane's rows: row and row + 8
  float o[D / 8][4] = {};
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};
  if (V && a.sinks) {
    row_max[0] = row_max[1] = __bfloat162float(a.sinks[h]) * kLog2e;
    row_sum[0] = row_sum[1] = t == 0 ? 1.f : 0.f;
  }
  for (int nt = n_first; nt < n_tiles; ++nt) {
    const int stage = (nt - n_first) & 1, n0 = nt * BN;
    if (nt + 1 < n_tiles) {  // prefetch the next key tile into the other stage
      load_rows<BN, D>(sk + (stage ^ 1) * BN * LD, k, kv_ld, n0 + BN, a.k_len);
      load_rows<BN, D>(sv + (stage ^ 1) * BN * LD, v, kv_ld, n0 + BN, a.k_len);
    }
    cp_async_commit();
    cp_async_wait<1>();  // this tile (and Q) has landed
    __syncthreads();
    const bf16* kt = sk + stage * BN * LD;
    const bf16* vt = sv + stage * BN * LD;

    float s[BN / 8][4] = {};
    warp_mma_nt<D, BN>(s, sq, warp * kWarpRows, kt, lane);

    online_softmax<D, BN, V>(s, o, row_max, row_sum, a, b, n0, row0, row, t);
    warp_mma_pn<BN, D>(o, s, vt, lane);
    __syncthreads();  // everyone is done with this stage before it is refilled
  }

  store_output<D, V>(a, o, row_max, row_sum, b, h, row);
}

// Backward, step 1: delta[b, h, i] = dout_i . out_i in f32 for the block's queries, one warp per
// row (a fixed-order shuffle tree, so deterministic).
template <int D>
__global__ void attention_delta_kernel(GpuArgs a, float* delta, int64_t rows) {
  const int64_t r = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (r >= rows) return;
  // r indexes [B, q_len, Hq]; delta is [B, Hq, q_len]
  const int64_t b = r / (int64_t(a.q_len) * a.q_heads), i = r / a.q_heads % a.q_len, h = r % a.q_heads;
  const int64_t at = a.q_row(b, i, h) * D;
  float acc = 0.f;
#pragma unroll
  for (int c = 2 * lane; c < D; c += 64) {
    const float2 x = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(a.dout + at + c));
    const float2 y = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(a.out + at + c));
    acc += x.x * y.x + x.y * y.y;
  }
#pragma unroll
  for (int m = 16; m > 0; m /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, m);
  if (lane == 0) delta[(b * a.q_heads + h) * a.q_len + i] = acc;
}

// The dQ pass's P = exp(scale q . k - lse) from the scores in p, for a lane's two rows (row, row + 8 of
// the warp's from row0; lse2 in the log2 domain) and the key tile at n0: zero past a row's last key
// (and, V, before its window).
template <int BN, bool V = false>
__device__ __forceinline__ void probabilities(float (&p)[BN / 8][4], const GpuArgs& a, const float (&lse2)[2], int b, int n0, int row0,
                                              int row, int t) {
  const bool edge = n0 + BN - 1 > a.last_key(row0);
#pragma unroll
  for (int j = 0; j < BN / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float x = exp2f(p[j][e] * a.scale_log2 - lse2[e / 2]);
      p[j][e] = edge && n0 + j * 8 + 2 * t + e % 2 > a.last_key(row + e / 2 * 8) ? 0.f : x;
      if constexpr (V)
        if (n0 < a.first_key(b, row0 + kWarpRows - 1) && n0 + j * 8 + 2 * t + e % 2 < a.first_key(b, row + e / 2 * 8)) p[j][e] = 0.f;
    }
}

// The dK/dV pass's end for one lane's two keys (key, key + 8): dK (times scale) and dV as f32
// partials per query head (GQA, summed by attention_group_sum_kernel), added into f32 sums (a ring
// block), or written as bf16.
template <int D>
__device__ __forceinline__ void store_dkdv(const GpuArgs& a, const float (&dk)[D / 8][4], const float (&dv)[D / 8][4], int b, int h,
                                           int hk, int key) {
  const int t = threadIdx.x % 4;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int j = key + r * 8;
    if (j >= a.k_len) continue;
    if (a.dk_part) {
      const int64_t at = ((int64_t(b) * a.k_len + j) * a.q_heads + h) * D + 2 * t;
#pragma unroll
      for (int d = 0; d < D / 8; ++d) {
        *reinterpret_cast<float2*>(a.dk_part + at + d * 8) =
            make_float2(dk[d][2 * r] * a.scale, dk[d][2 * r + 1] * a.scale);
        *reinterpret_cast<float2*>(a.dv_part + at + d * 8) = make_float2(dv[d][2 * r], dv[d][2 * r + 1]);
      }
    } else if (a.dk_acc) {
      const int64_t at = a.kv_row(b, j, hk) * D + 2 * t;
#pragma unroll
      for (int d = 0; d < D / 8; ++d) {
        add_float2(a.dk_acc + at + d * 8, dk[d][2 * r] * a.scale, dk[d][2 * r + 1] * a.scale);
        add_float2(a.dv_acc + at + d * 8, dv[d][2 * r], dv[d][2 * r + 1]);
      }
    } else {
      const int64_t at = a.kv_row(b, j, hk) * D + 2 * t;
#pragma unroll
      for (int d = 0; d < D / 8; ++d) {
        *reinterpret_cast<__nv_bfloat162*>(a.dk + at + d * 8) =
            __floats2bfloat162_rn(dk[d][2 * r] * a.scale, dk[d][2 * r + 1] * a.scale);
        *reinterpret_cast<__nv_bfloat162*>(a.dv + at + d * 8) = __floats2bfloat162_rn(dv[d][2 * r], dv[d][2 * r + 1]);
      }
    }
  }
}

// Backward, step 2: dk and dv. Grid (key blocks of 64, Hq, B); block = 4 warps, 16 key rows each,
// for ONE query head: with GQA each query head writes its own f32 partial (dk_part, dv_part) and
// step 4 adds a group's partials in head order. No atomics, and a block per query head rather than
// per key/value head gives Hq / Hkv times more blocks (2048 at the bench shape) to even out the
// causal imbalance. Shared: K and V tiles [64][D+8] (read as A operands) and two stages of Q and
// dO tiles [32][D+8] plus lse and delta of 32 queries, all staged by cp.async: 70 KB at D = 128.
// Per query tile each warp forms P^T (16 keys x 32 queries) from lse, adds P^T dO into dV, forms
// dP^T = V dO^T and dS^T = P^T (dP^T - delta), and adds dS^T Q into dK. 32 queries per tile keeps
// P^T and dS^T at 16 registers each beside the two 64-register accumulators (D = 128: ptxas
// reports 244 registers, no spills, 2 blocks per SM). V (GPT-OSS's window, the causal op): query
// tiles end at the last query that sees the tile's last key.
template <int D, bool V = false>
__global__ void __launch_bounds__(kThreads) attention_dkdv_kernel(GpuArgs a) {
  constexpr int BN = 64, BM = 32, LD = D + kPad;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* sk = reinterpret_cast<bf16*>(smem);  // [BN][LD]
  bf16* sv = sk + BN * LD;                   // [BN][LD]
  bf16* sq = sv + BN * LD;                   // [2][BM][LD]
  bf16* sdo = sq + 2 * BM * LD;              // [2][BM][LD]
  float* slse = reinterpret_cast<float*>(sdo + 2 * BM * LD);  // [2][BM]
  float* sdelta = slse + 2 * BM;                                // [2][BM]

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int n0 = blockIdx.x * BN;  // the first keys are seen by the most queries: they start first
  const int h = blockIdx.y, b = blockIdx.z, hk = h / (a.q_heads / a.kv_heads);
  const int64_t q_ld = int64_t(a.q_heads) * D, kv_ld = int64_t(a.kv_heads) * D;
  const bf16* q = a.q + a.q_row(b, 0, h) * D;
  const bf16* dout = a.dout + a.q_row(b, 0, h) * D;
  const float* lse = a.lse + a.lse_at(b, h, 0);
  const float* delta = a.delta + (int64_t(b) * a.q_heads + h) * a.q_len;
  // Query tiles: from the diagonal on (causal), all of them (full).
  const int m_first = a.full ? 0 : n0 / BM, m_tiles = V ? cdiv(min(a.q_len, a.last_query(n0 + BN - 1) + 1), BM) : cdiv(a.q_len, BM);

  auto load_queries = [&](int mt, int stage) {
    load_rows<BM, D>(sq + stage * BM * LD, q, q_ld, mt * BM, a.q_len);
    load_rows<BM, D>(sdo + stage * BM * LD, dout, q_ld, mt * BM, a.q_len);
    if (threadIdx.x < 2 * BM) {  // warp 0 copies lse, warp 1 delta; zeros past the end
      const int c = threadIdx.x % BM, i = min(mt * BM + c, a.q_len - 1);
      float* dst = threadIdx.x < BM ? slse : sdelta;
      cp_async4(dst + stage * BM + c, (threadIdx.x < BM ? lse : delta) + i, mt * BM + c < a.q_len);
    }
  };
  load_rows<BN, D>(sk, a.k + a.kv_row(b, 0, hk) * D, kv_ld, n0, a.k_len);
  load_rows<BN, D>(sv, a.v + a.kv_row(b, 0, hk) * D, kv_ld, n0, a.k_len);
  load_queries(m_first, 0);
  cp_async_commit();

  const int key0 = n0 + warp * kWarpRows, key = key0 + g;  // this lane's keys: key and key + 8
  float dk[D / 8][4] = {}, dv[D / 8][4] = {};
  for (int mt = m_first; mt < m_tiles; ++mt) {
    const int stage = (mt - m_first) & 1, m0 = mt * BM;
    if (mt + 1 < m_tiles) load_queries(mt + 1, stage ^ 1);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const bf16* qt = sq + stage * BM * LD;
    const bf16* dot = sdo + stage * BM * LD;
    const float* lse_t = slse + stage * BM;
    const float* dl = sdelta + stage * BM;

    // P^T[key, query] = exp(scale k . q - lse), zero where the query precedes the key (causal) or
    // is past the end (there Q and dO rows are zeros, so P would not matter, but say it anyway).
    // Keys past the end of a full block get P but are never written.
    float p[BM / 8][4] = {};
    warp_mma_nt<D, BM>(p, sk, warp * kWarpRows, qt, lane);
    const bool edge = (!a.full && m0 < key0 + kWarpRows - 1) || m0 + BM > a.q_len;
#pragma unroll
    for (int j = 0; j < BM / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int c = j * 8 + 2 * t + e % 2;  // query within the tile
        const float x = exp2f(p[j][e] * a.scale_log2 - lse_t[c] * kLog2e);
        p[j][e] = edge && ((!a.full && m0 + c < key + e / 2 * 8) || m0 + c >= a.q_len) ? 0.f : x;
        if constexpr (V) {  // queries past the window of the tile's keys, or in a later document
          if (m0 + BM - 1 > a.last_query(key0) && m0 + c > a.last_query(key + e / 2 * 8)) p[j][e] = 0.f;
          if (a.documents && key + e / 2 * 8 < a.first_key(b, m0 + c)) p[j][e] = 0.f;
        }
      }
    warp_mma_pn<BM, D>(dv, p, dot, lane);  // dV += P^T dO

    float ds[BM / 8][4] = {};
    warp_mma_nt<D, BM>(ds, sv, warp * kWarpRows, dot, lane);  // dP^T = V dO^T
#pragma unroll
    for (int j = 0; j < BM / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) ds[j][e] = p[j][e] * (ds[j][e] - dl[j * 8 + 2 * t + e % 2]);
    warp_mma_pn<BM, D>(dk, ds, qt, lane);  // dK += dS^T Q (times scale at the end)
    __syncthreads();
  }

  store_dkdv<D>(a, dk, dv, b, h, hk, key);
}

// The dQ pass's end for one lane's two rows (row, row + 8): dQ times scale, added into f32 sums (a
// ring block) or written as bf16.
template <int D>
__device__ __forceinline__ void store_dq(const GpuArgs& a, const float (&dq)[D / 8][4], int b, int h, int row) {
  const int t = threadIdx.x % 4;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int i = row + r * 8;
    if (i >= a.q_len) continue;
    const int64_t at = a.q_row(b, i, h) * D + 2 * t;
    if (a.dq_acc) {
#pragma unroll
      for (int d = 0; d < D / 8; ++d)
        add_float2(a.dq_acc + at + d * 8, dq[d][2 * r] * a.scale, dq[d][2 * r + 1] * a.scale);
      continue;
    }
    bf16* dst = a.dq + at;
#pragma unroll
    for (int d = 0; d < D / 8; ++d)
      *reinterpret_cast<__nv_bfloat162*>(dst + d * 8) =
          __floats2bfloat162_rn(dq[d][2 * r] * a.scale, dq[d][2 * r + 1] * a.scale);
  }
}

// Backward, step 3: dq, a separate pass over key tiles per query block, so dq needs no atomics
// (it recomputes S and dP: 3 of the backward's 5 products run twice, the price of determinism).
// Grid (query blocks of 64, Hq, B); block = 4 warps, 16 query rows each. Shared: Q and dO tiles
// [64][D+8] and two stages of K and V tiles [64][D+8]: 104 KB at D = 128 (2 blocks per SM). Per
// key tile each warp forms P (16 x 64) from lse, dP = dO V^T, dS = P (dP - delta), and adds dS K
// into its 16 x D accumulator. V (GPT-OSS's window, the causal op): key tiles start at the block's
// first row's window.
template <int D, bool V = false>
__global__ void __launch_bounds__(kThreads) attention_dq_kernel(GpuArgs a) {
  constexpr int BM = 64, BN = 64, LD = D + kPad;
  extern __shared__ __align__(16) unsigned char smem[];
  bf16* sq = reinterpret_cast<bf16*>(smem);  // [BM][LD]
  bf16* sdo = sq + BM * LD;                  // [BM][LD]
  bf16* sk = sdo + BM * LD;                  // [2][BN][LD]
  bf16* sv = sk + 2 * BN * LD;               // [2][BN][LD]

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int m0 = (gridDim.x - 1 - blockIdx.x) * BM;
  const int h = blockIdx.y, b = blockIdx.z, hk = h / (a.q_heads / a.kv_heads);
  const int64_t q_ld = int64_t(a.q_heads) * D, kv_ld = int64_t(a.kv_heads) * D;
  const bf16* k = a.k + a.kv_row(b, 0, hk) * D;
  const bf16* v = a.v + a.kv_row(b, 0, hk) * D;
  const int n_tiles = cdiv(min(a.k_len, a.last_key(m0 + BM - 1) + 1), BN);
  const int n_first = V ? a.first_key(b, m0) / BN : 0;

  load_rows<BM, D>(sq, a.q + a.q_row(b, 0, h) * D, q_ld, m0, a.q_len);
  load_rows<BM, D>(sdo, a.dout + a.q_row(b, 0, h) * D, q_ld, m0, a.q_len);
  load_rows<BN, D>(sk, k, kv_ld, n_first * BN, a.k_len);
  load_rows<BN, D>(sv, v, kv_ld, n_first * BN, a.k_len);
  cp_async_commit();

  const int row0 = m0 + warp * kWarpRows, row = row0 + g;  // this lane's rows: row and row + 8
  float lse2[2], dl[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int i = row + r * 8;
    lse2[r] = i < a.q_len ? a.lse[a.lse_at(b, h, i)] * kLog2e : INFINITY;  // P = 0 on rows past the end
    dl[r] = i < a.q_len ? a.delta[(int64_t(b) * a.q_heads + h) * a.q_len + i] : 0.f;
  }
  float dq[D / 8][4] = {};
  for (int nt = n_first; nt < n_tiles; ++nt) {
    const int stage = (nt - n_first) & 1, n0 = nt * BN;
    if (nt + 1 < n_tiles) {
      load_rows<BN, D>(sk + (stage ^ 1) * BN * LD, k, kv_ld, n0 + BN, a.k_len);
      load_rows<BN, D>(sv + (stage ^ 1) * BN * LD, v, kv_ld, n0 + BN, a.k_len);
    }
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const bf16* kt = sk + stage * BN * LD;
    const bf16* vt = sv + stage * BN * LD;

    float p[BN / 8][4] = {};
    warp_mma_nt<D, BN>(p, sq, warp * kWarpRows, kt, lane);
    probabilities<BN, V>(p, a, lse2, b, n0, row0, row, t);
    float ds[BN / 8][4] = {};
    warp_mma_nt<D, BN>(ds, sdo, warp * kWarpRows, vt, lane);  // dP = dO V^T
#pragma unroll
    for (int j = 0; j < BN / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) ds[j][e] = p[j][e] * (ds[j][e] - dl[e / 2]);
    warp_mma_pn<BN, D>(dq, ds, kt, lane);  // dQ += dS K (times scale at the end)
    __syncthreads();
  }

  store_dq<D>(a, dq, b, h, row);
}

// Backward, step 4 (GQA only): dk[b, j, hk, :] = sum over the group's query heads, in head order,
// of dk_part[b, j, hk * group + g, :] (the heads of a group are adjacent, so a row's partials are
// one contiguous run); the same for dv. Written as bf16 (the causal op) or added into f32 (a block).
// One thread per output element.
__global__ void attention_group_sum_kernel(GpuArgs a, int64_t n, int head_dim) {
  const int group = a.q_heads / a.kv_heads;
  for (int64_t e = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = e / head_dim, at = row * group * head_dim + e % head_dim;  // row of [B, k_len, Hkv]
    float sk = 0.f, sv = 0.f;
    for (int i = 0; i < group; ++i) {
      sk += a.dk_part[at + int64_t(i) * head_dim];
      sv += a.dv_part[at + int64_t(i) * head_dim];
    }
    const int64_t bj = row / a.kv_heads;
    const int64_t dst = a.kv_row(bj / a.k_len, bj % a.k_len, row % a.kv_heads) * head_dim + e % head_dim;
    if (a.dk_acc) {
      a.dk_acc[dst] += sk;
      a.dv_acc[dst] += sv;
    } else {
      a.dk[dst] = __float2bfloat16_rn(sk);
      a.dv[dst] = __float2bfloat16_rn(sv);
    }
  }
}

// Merge: one warp per row (b, i, h) of the range; the lanes split the row's D elements. The
// running out and lse are f32, the partial out bf16 (a block forward's output).
__global__ void attention_merge_kernel(float* out, float* lse, const bf16* part_out, const float* part_lse,
                                       int64_t rows, int begin, int len, int seq, int heads, int head_dim) {
  const int64_t r = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (r >= rows) return;
  const int64_t b = r / (int64_t(len) * heads), i = begin + r / heads % len, h = r % heads;
  const int64_t l_at = (b * heads + h) * seq + i, o_at = ((b * seq + i) * heads + h) * head_dim;
  const float l1 = lse[l_at], l2 = part_lse[l_at], m = fmaxf(l1, l2);
  if (m == -INFINITY) return;
  const float w1 = expf(l1 - m), w2 = expf(l2 - m), inv = 1.f / (w1 + w2);
  for (int d = lane; d < head_dim; d += 32)
    out[o_at + d] = (w1 * out[o_at + d] + w2 * __bfloat162float(part_out[o_at + d])) * inv;
  __syncwarp();  // every lane has read lse[l_at] before lane 0 overwrites it
  if (lane == 0) lse[l_at] = m + logf(w1 + w2);
}


// sinks_merge_cpu's arithmetic, one warp per row (b, i, h) of the f32 running out and lse.
__global__ void attention_sinks_merge_kernel(float* out, float* lse, const bf16* sinks, int64_t rows, int seq, int heads, int head_dim) {
  const int64_t r = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (r >= rows) return;
  const int64_t b = r / (int64_t(seq) * heads), i = r / heads % seq, h = r % heads;
  const int64_t l_at = (b * heads + h) * seq + i, o_at = r * head_dim;
  const float l = lse[l_at], sink = __bfloat162float(sinks[h]), m = fmaxf(l, sink);
  const float w1 = expf(l - m), sum = w1 + expf(sink - m);
  for (int d = lane; d < head_dim; d += 32) out[o_at + d] = w1 * out[o_at + d] / sum;
  __syncwarp();  // every lane has read lse[l_at] before lane 0 overwrites it
  if (lane == 0) lse[l_at] = m + logf(sum);
}

constexpr int kSinkThreads = 256;

// dsinks[h] += -sum over (b, i) of exp(sink_h - lse) (dout . out), one block per head: each thread
// sums the rows thread, thread + 256, ... in order, then a fixed tree over the block (deterministic).
__global__ void attention_sinks_backward_kernel(float* dsinks, const bf16* dout, const bf16* out, const float* lse, const bf16* sinks,
                                                int64_t batch, int64_t seq, int64_t heads, int64_t head_dim) {
  __shared__ float partial[kSinkThreads];
  const int64_t h = blockIdx.x;
  const float sink = __bfloat162float(sinks[h]);
  float acc = 0.f;
  for (int64_t r = threadIdx.x; r < batch * seq; r += kSinkThreads) {
    const int64_t b = r / seq, i = r % seq, at = ((b * seq + i) * heads + h) * head_dim;
    float di = 0.f;
    for (int64_t d = 0; d < head_dim; ++d) di += __bfloat162float(dout[at + d]) * __bfloat162float(out[at + d]);
    acc -= expf(sink - lse[(b * heads + h) * seq + i]) * di;
  }
  partial[threadIdx.x] = acc;
  __syncthreads();
  for (int half = kSinkThreads / 2; half > 0; half /= 2) {
    if (int(threadIdx.x) < half) partial[threadIdx.x] += partial[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0) dsinks[h] += partial[0];
}
template <typename Kernel>
void launch_tiled(Kernel kernel, const AttentionDims& n, int64_t rows, size_t smem_bytes, const GpuArgs& args,
                  cudaStream_t stream) {
  // Blocks of these kernels need more than the default 48 KB of dynamic shared memory at D = 128.
  MARROW_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem_bytes)));
  const dim3 grid(unsigned(cdiv(int(rows), 64)), unsigned(n.q_heads), unsigned(n.batch));
  kernel<<<grid, kThreads, smem_bytes, stream>>>(args);
  MARROW_CUDA_CHECK_LAUNCH();
}

using NamedTensors = std::initializer_list<std::pair<const char*, const Tensor*>>;

void expect_dtypes(const char* op, DType dtype, NamedTensors ts) {
  for (auto [name, t] : ts) expect_dtype(op, name, *t, dtype);
}

// 16-byte aligned device tensors of one dtype, named in the message.
void expect_gpu_tensors(const char* op, DType dtype, NamedTensors ts) {
  expect_dtypes(op, dtype, ts);
  for (auto [name, t] : ts)
    MARROW_CHECK(reinterpret_cast<uintptr_t>(t->data) % 16 == 0, "{}: {} is not 16-byte aligned on the GPU", op, name);
}

// The GPU's dtypes (docs/gpu-path.md) and the limits of the kernels, checked with the tensors' names.
void check_gpu_inputs(const char* op, const AttentionDims& n, NamedTensors bf16s, const Tensor& lse) {
  expect_gpu_tensors(op, DType::bf16, bf16s);
  expect_dtype(op, "lse", lse, DType::f32);
  MARROW_CHECK(n.head_dim == 64 || n.head_dim == 128,
               "{}: head_dim {} has no GPU kernel (the CUDA kernels take head_dim 64 or 128)", op, n.head_dim);
  MARROW_CHECK(std::max(n.q_seq, n.kv_seq) < (int64_t(1) << 30) && n.q_heads <= 65535 && n.batch <= 65535,
               "{}: batch {}, seq {}, {} query heads exceed the GPU kernels' grid", op, n.batch,
               std::max(n.q_seq, n.kv_seq), n.q_heads);
}

GpuArgs gpu_args(const AttentionDims& n, const AttentionBlock& blk, Tensor q, Tensor k, Tensor v) {
  GpuArgs a{};
  a.q = static_cast<const bf16*>(q.data), a.k = static_cast<const bf16*>(k.data), a.v = static_cast<const bf16*>(v.data);
  a.q_seq = int(n.q_seq), a.kv_seq = int(n.kv_seq), a.q_heads = int(n.q_heads), a.kv_heads = int(n.kv_heads);
  a.q_begin = int(blk.q_begin), a.q_len = int(blk.q_end - blk.q_begin), a.k_begin = int(blk.k_begin), a.k_len = int(blk.k_end - blk.k_begin);
  a.full = blk.mask == AttentionMask::full, a.window = int(blk.window), a.distance = int(blk.distance);
  a.documents = static_cast<const int*>(blk.documents.data);
  a.scale = float(1 / std::sqrt(double(n.head_dim)));
  a.scale_log2 = float(1 / std::sqrt(double(n.head_dim)) * 1.4426950408889634);
  return a;
}

// dk and dv of the backward (a.delta computed): the key-tile kernel, then the sum of each group's
// query heads when Hq > Hkv.
void dkdv_gpu(GpuArgs a, const AttentionDims& n, size_t ld_bytes, Stream stream) {
  const auto s = static_cast<cudaStream_t>(stream.handle);
  const int64_t group = n.q_heads / n.kv_heads;
  Buffer dk_part, dv_part;  // freed in stream order after the kernels below
  if (group > 1) {
    for (Buffer* part : {&dk_part, &dv_part}) *part = Buffer(DType::f32, Device::cuda, {n.batch, a.k_len, n.q_heads, n.head_dim}, stream);
    a.dk_part = dk_part.ptr<float>(), a.dv_part = dv_part.ptr<float>();
  }
  const size_t dkdv_smem = size_t(2 * 64 + 4 * 32) * ld_bytes + 4 * 32 * sizeof(float);
  const bool window = a.window > 0 || a.documents;
  if (n.head_dim == 64) launch_tiled(window ? attention_dkdv_kernel<64, true> : attention_dkdv_kernel<64>, n, a.k_len, dkdv_smem, a, s);
  else launch_tiled(window ? attention_dkdv_kernel<128, true> : attention_dkdv_kernel<128>, n, a.k_len, dkdv_smem, a, s);
  if (group > 1) {
    const int64_t numel = n.batch * a.k_len * n.kv_heads * n.head_dim;
    const unsigned blocks = unsigned(std::min<int64_t>((numel + 255) / 256, 65536));
    attention_group_sum_kernel<<<blocks, 256, 0, s>>>(a, numel, int(n.head_dim));
    MARROW_CUDA_CHECK_LAUNCH();
  }
}

// Blocks of 256 threads, a warp a row.
unsigned warp_row_blocks(int64_t rows) { return unsigned((rows + 7) / 8); }

}  // namespace

void mma_attention_forward(const char* op, Tensor out, Tensor lse, Tensor q, Tensor k, Tensor v, const AttentionDims& n,
                           const AttentionBlock& blk, Tensor sinks, Stream stream) {
  check_gpu_inputs(op, n, {{"q", &q}, {"k", &k}, {"v", &v}, {"out", &out}}, lse);
  GpuArgs a = gpu_args(n, blk, q, k, v);
  if (n.batch * a.q_len * n.q_heads == 0) return;
  a.o = static_cast<bf16*>(out.data), a.lse = static_cast<float*>(lse.data), a.sinks = static_cast<const bf16*>(sinks.data);
  const auto s = static_cast<cudaStream_t>(stream.handle);
  const size_t smem = size_t(64 + 4 * 64) * (n.head_dim + kPad) * sizeof(bf16);
  const bool variant = a.window > 0 || a.sinks || a.documents;
  if (n.head_dim == 64) launch_tiled(variant ? attention_forward_kernel<64, true> : attention_forward_kernel<64>, n, a.q_len, smem, a, s);
  else launch_tiled(variant ? attention_forward_kernel<128, true> : attention_forward_kernel<128>, n, a.q_len, smem, a, s);
}

void mma_attention_backward(const char* op, Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q, Tensor k, Tensor v,
                            Tensor out, Tensor lse, const AttentionDims& n, const AttentionBlock& blk, bool accumulate,
                            AttentionGrads grads, Stream stream) {
  check_gpu_inputs(op, n, {{"q", &q}, {"k", &k}, {"v", &v}, {"out", &out}, {"dout", &dout}}, lse);
  expect_gpu_tensors(op, accumulate ? DType::f32 : DType::bf16, {{"dq", &dq}, {"dk", &dk}, {"dv", &dv}});
  GpuArgs a = gpu_args(n, blk, q, k, v);
  if (n.batch * a.q_len * n.q_heads == 0) return;
  const auto s = static_cast<cudaStream_t>(stream.handle);
  a.out = static_cast<const bf16*>(out.data), a.dout = static_cast<const bf16*>(dout.data), a.lse = static_cast<float*>(lse.data);
  if (accumulate) a.dq_acc = dq.ptr<float>(), a.dk_acc = dk.ptr<float>(), a.dv_acc = dv.ptr<float>();
  else a.dq = static_cast<bf16*>(dq.data), a.dk = static_cast<bf16*>(dk.data), a.dv = static_cast<bf16*>(dv.data);
  const bool d64 = n.head_dim == 64;
  Buffer delta(DType::f32, Device::cuda, {n.batch, n.q_heads, a.q_len}, stream);
  a.delta = delta.ptr<float>();
  const int64_t rows = n.batch * a.q_len * n.q_heads;
  if (d64) attention_delta_kernel<64><<<warp_row_blocks(rows), 256, 0, s>>>(a, delta.ptr<float>(), rows);
  else attention_delta_kernel<128><<<warp_row_blocks(rows), 256, 0, s>>>(a, delta.ptr<float>(), rows);
  MARROW_CUDA_CHECK_LAUNCH();

  // dk and dv are final before dq's kernel starts, so a caller can send them on while it runs.
  const size_t ld_bytes = size_t(n.head_dim + kPad) * sizeof(bf16);
  if (grads != AttentionGrads::q) dkdv_gpu(a, n, ld_bytes, stream);
  if (grads == AttentionGrads::kv) return;
  const size_t dq_smem = size_t(2 * 64 + 4 * 64) * ld_bytes;
  const bool window = a.window > 0 || a.documents;
  if (d64) launch_tiled(window ? attention_dq_kernel<64, true> : attention_dq_kernel<64>, n, a.q_len, dq_smem, a, s);
  else launch_tiled(window ? attention_dq_kernel<128, true> : attention_dq_kernel<128>, n, a.q_len, dq_smem, a, s);
}

void gpu_attention_merge(Tensor out, Tensor lse, Tensor part_out, Tensor part_lse, const AttentionDims& n, int64_t begin,
                         int64_t end, Stream stream) {
  const char* op = "attention_merge";
  expect_dtypes(op, DType::f32, {{"out", &out}, {"lse", &lse}, {"part_lse", &part_lse}});
  expect_dtype(op, "part_out", part_out, DType::bf16);
  const int64_t rows = n.batch * (end - begin) * n.q_heads;
  if (rows == 0) return;
  MARROW_CHECK(n.q_seq < (int64_t(1) << 30) && n.head_dim < (int64_t(1) << 30), "{}: {} rows of {} exceed the GPU kernel",
               op, n.q_seq, n.head_dim);
  attention_merge_kernel<<<warp_row_blocks(rows), 256, 0, static_cast<cudaStream_t>(stream.handle)>>>(
      out.ptr<float>(), lse.ptr<float>(), static_cast<const bf16*>(part_out.data), part_lse.ptr<float>(), rows,
      int(begin), int(end - begin), int(n.q_seq), int(n.q_heads), int(n.head_dim));
  MARROW_CUDA_CHECK_LAUNCH();
}

void gpu_attention_sinks_merge(Tensor out, Tensor lse, Tensor sinks, const AttentionDims& n, Stream stream) {
  const char* op = "attention_sinks_merge";
  expect_dtypes(op, DType::f32, {{"out", &out}, {"lse", &lse}});
  expect_dtype(op, "sinks", sinks, DType::bf16);
  const int64_t rows = n.batch * n.q_seq * n.q_heads;
  if (rows == 0) return;
  attention_sinks_merge_kernel<<<warp_row_blocks(rows), 256, 0, static_cast<cudaStream_t>(stream.handle)>>>(
      out.ptr<float>(), lse.ptr<float>(), static_cast<const bf16*>(sinks.data), rows, int(n.q_seq), int(n.q_heads), int(n.head_dim));
  MARROW_CUDA_CHECK_LAUNCH();
}

void gpu_attention_sinks_backward(Tensor dsinks, Tensor dout, Tensor out, Tensor lse, Tensor sinks, const AttentionDims& n,
                                  Stream stream) {
  const char* op = "attention_sinks_backward";
  expect_dtypes(op, DType::bf16, {{"dout", &dout}, {"out", &out}, {"sinks", &sinks}});
  expect_dtypes(op, DType::f32, {{"dsinks", &dsinks}, {"lse", &lse}});
  if (n.q_heads == 0) return;
  attention_sinks_backward_kernel<<<unsigned(n.q_heads), kSinkThreads, 0, static_cast<cudaStream_t>(stream.handle)>>>(
      dsinks.ptr<float>(), static_cast<const bf16*>(dout.data), static_cast<const bf16*>(out.data), lse.ptr<float>(),
      static_cast<const bf16*>(sinks.data), n.batch, n.q_seq, n.q_heads, n.head_dim);
  MARROW_CUDA_CHECK_LAUNCH();
}

}  // namespace marrow

#else

namespace marrow {

void mma_attention_forward(const char* op, Tensor, Tensor, Tensor, Tensor, Tensor, const AttentionDims&, const AttentionBlock&, Tensor, Stream) {
  no_cuda_kernel(op);
}
void mma_attention_backward(const char* op, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, const AttentionDims&,
                            const AttentionBlock&, bool, AttentionGrads, Stream) {
  no_cuda_kernel(op);
}
void gpu_attention_merge(Tensor, Tensor, Tensor, Tensor, const AttentionDims&, int64_t, int64_t, Stream) { no_cuda_kernel("attention_merge"); }
void gpu_attention_sinks_merge(Tensor, Tensor, Tensor, const AttentionDims&, Stream) { no_cuda_kernel("attention_sinks_merge"); }
void gpu_attention_sinks_backward(Tensor, Tensor, Tensor, Tensor, Tensor, const AttentionDims&, Stream) { no_cuda_kernel("attention_sinks_backward"); }

}  // namespace marrow

#endif  // __CUDACC__
