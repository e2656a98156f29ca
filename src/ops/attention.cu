#include "ops/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/cuda_check.h"
#include "core/memory.h"
#include "ops/attention_cudnn.h"
#include "ops/attention_hopper.h"
#include "ops/common.h"

#ifdef __CUDACC__
#include <cuda_bf16.h>

#include "ops/cuda_common.cuh"
#endif

namespace marrow {

namespace {

struct Dims {
  int64_t batch, q_seq, kv_seq, q_heads, kv_heads, head_dim;
  // Element offsets of row (b, i) of a query head and of a key/value head.
  int64_t q(int64_t b, int64_t i, int64_t h) const { return ((b * q_seq + i) * q_heads + h) * head_dim; }
  int64_t kv(int64_t b, int64_t j, int64_t h) const {
    return ((b * kv_seq + j) * kv_heads + h / (q_heads / kv_heads)) * head_dim;
  }
  int64_t lse(int64_t b, int64_t i, int64_t h) const { return (b * q_heads + h) * q_seq + i; }
};

// The keys query row i of a block sees, as offsets from k_begin: [first, end). A window keeps the
// keys less than `window` positions before the query (in a causal block the last `window` keys, its
// own included).
struct KeyRange {
  int64_t first, end;
};
KeyRange keys_seen(const AttentionBlock& block, int64_t i) {
  const int64_t end = block.mask == AttentionMask::causal ? i - block.q_begin + 1 : block.k_end - block.k_begin;
  if (block.window == 0) return {0, end};
  return {std::clamp<int64_t>(block.distance + (i - block.q_begin) - block.window + 1, 0, end), end};
}

// sinks: [Hq] or null (none). With the sink in the running max, a sink far above the row's scores
// cannot overflow exp. A row that sees no key and no sink gets lse -inf and out 0.
template <typename T>
void forward_cpu(T* out, T* lse, const T* q, const T* k, const T* v, const T* sinks, const Dims& n, const AttentionBlock& blk) {
  const T scale = T(1 / std::sqrt(double(n.head_dim)));
  const int64_t k_len = blk.k_end - blk.k_begin;
#pragma omp parallel if (n.batch * n.q_heads * (blk.q_end - blk.q_begin) * k_len * n.head_dim > kParallelWork)
  {
    std::vector<T> p(static_cast<size_t>(k_len));
#pragma omp for collapse(2) schedule(static)
    for (int64_t b = 0; b < n.batch; ++b)
      for (int64_t h = 0; h < n.q_heads; ++h)
        for (int64_t i = blk.q_begin; i < blk.q_end; ++i) {
          const T* qi = q + n.q(b, i, h);
          const KeyRange seen = keys_seen(blk, i);
          T m = sinks ? sinks[h] : -std::numeric_limits<T>::infinity();
          for (int64_t j = seen.first; j < seen.end; ++j) {
            p[j] = scale * dot(qi, k + n.kv(b, blk.k_begin + j, h), n.head_dim);
            m = std::max(m, p[j]);
          }
          double sum = 0;
          for (int64_t j = seen.first; j < seen.end; ++j) {
            p[j] = std::exp(p[j] - m);
            sum += p[j];
          }
          if (sinks) sum += std::exp(sinks[h] - m);
          T* oi = out + n.q(b, i, h);
          std::fill(oi, oi + n.head_dim, T(0));
          for (int64_t j = seen.first; j < seen.end; ++j)
            axpy(oi, T(p[j] / sum), v + n.kv(b, blk.k_begin + j, h), n.head_dim);
          lse[n.lse(b, i, h)] = T(m + std::log(sum));
        }
  }
}

// With P = exp(s - lse) and D_i = dout_i . out_i (= sum_j P[i, j] dout_i . v_j):
//   dv_j += P[i, j] dout_i,   dS[i, j] = P[i, j] (dout_i . v_j - D_i),
//   dq_i += scale sum_j dS[i, j] k_j,   dk_j += scale dS[i, j] q_i.
// lse and out are the final ones (every key block merged), so P is the true probability and the
// blocks' shares sum to the whole gradient. Query heads of one group add into the same dk, dv rows
// in a fixed order: deterministic.
// A sink (lse includes it) leaves all of that unchanged and adds dsinks[h] += -sum_i exp(sink - lse_i) D_i
// (sinks_backward_cpu); the window only drops keys.
template <typename T>
void backward_cpu(T* dq, T* dk, T* dv, const T* dout, const T* q, const T* k, const T* v, const T* out, const T* lse, const Dims& n,
                  const AttentionBlock& blk, AttentionGrads grads) {
  const bool want_q = grads != AttentionGrads::kv, want_kv = grads != AttentionGrads::q;
  const T scale = T(1 / std::sqrt(double(n.head_dim)));
  // Threads own key/value heads: the query heads of a group add into dk, dv in head order.
  const int64_t group = n.q_heads / n.kv_heads;
#pragma omp parallel for collapse(2) schedule(static) if (n.batch * n.q_heads * (blk.q_end - blk.q_begin) * \
                                                              (blk.k_end - blk.k_begin) * n.head_dim > kParallelWork)
  for (int64_t b = 0; b < n.batch; ++b)
    for (int64_t hk = 0; hk < n.kv_heads; ++hk)
      for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
        for (int64_t i = blk.q_begin; i < blk.q_end; ++i) {
          const int64_t qo = n.q(b, i, h);
          const T *qi = q + qo, *douti = dout + qo;
          const T di = dot(douti, out + qo, n.head_dim), lse_i = lse[n.lse(b, i, h)];
          T* dqi = dq + qo;
          const KeyRange seen = keys_seen(blk, i);
          for (int64_t j = blk.k_begin + seen.first; j < blk.k_begin + seen.end; ++j) {
            const int64_t kvo = n.kv(b, j, h);
            const T p = std::exp(scale * dot(qi, k + kvo, n.head_dim) - lse_i);
            const T ds = p * (dot(douti, v + kvo, n.head_dim) - di);
            if (want_kv) axpy(dv + kvo, p, douti, n.head_dim);
            if (want_q) axpy(dqi, scale * ds, k + kvo, n.head_dim);
            if (want_kv) axpy(dk + kvo, scale * ds, qi, n.head_dim);
          }
        }
      }
}

// dsinks[h] += the sum over batch rows b (in order) of each row's share -sum_i exp(sinks[h] - lse_i) D_i,
// D_i = dout_i . out_i, over query rows [0, q_seq).
template <typename T>
void sinks_backward_cpu(T* dsinks, const T* dout, const T* out, const T* lse, const T* sinks, const Dims& n) {
  std::vector<T> share(size_t(n.batch * n.q_heads));
#pragma omp parallel for collapse(2) schedule(static) if (n.batch * n.q_heads * n.q_seq * n.head_dim > kParallelWork)
  for (int64_t b = 0; b < n.batch; ++b)
    for (int64_t h = 0; h < n.q_heads; ++h) {
      T dsink = 0;
      for (int64_t i = 0; i < n.q_seq; ++i) {
        const int64_t qo = n.q(b, i, h);
        dsink -= std::exp(sinks[h] - lse[n.lse(b, i, h)]) * dot(dout + qo, out + qo, n.head_dim);
      }
      share[size_t(b * n.q_heads + h)] = dsink;
    }
  for (int64_t h = 0; h < n.q_heads; ++h)
    for (int64_t b = 0; b < n.batch; ++b) dsinks[h] += share[size_t(b * n.q_heads + h)];
}

// Rows [begin, end) of (out, lse) become the log-sum-exp merge with (part_out, part_lse). A row
// whose two lse are -inf (no key seen yet on either side) stays as it is.
template <typename T>
void merge_cpu(T* out, T* lse, const T* part_out, const T* part_lse, const Dims& n, int64_t begin, int64_t end) {
  for (int64_t b = 0; b < n.batch; ++b)
    for (int64_t h = 0; h < n.q_heads; ++h)
      for (int64_t i = begin; i < end; ++i) {
        T& l = lse[n.lse(b, i, h)];
        const T l2 = part_lse[n.lse(b, i, h)], m = std::max(l, l2);
        if (m == -std::numeric_limits<T>::infinity()) continue;
        const T w1 = std::exp(l - m), w2 = std::exp(l2 - m), sum = w1 + w2;
        T* o = out + n.q(b, i, h);
        const T* o2 = part_out + n.q(b, i, h);
        for (int64_t d = 0; d < n.head_dim; ++d) o[d] = (w1 * o[d] + w2 * o2[d]) / sum;
        l = m + std::log(sum);
      }
}

// Checks q's layout and that k and v match each other; returns the sizes.
Dims check_qkv(const char* op, const Tensor& q, const Tensor& k, const Tensor& v) {
  MARROW_CHECK(q.ndim == 4, "{}: q must be [batch, seq, heads, head_dim], got {}", op, q.shape_string());
  MARROW_CHECK(k.ndim == 4, "{}: k must be [batch, seq, kv_heads, head_dim], got {}", op, k.shape_string());
  Dims n{q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), q.size(3)};
  expect_shape(op, "k", k, {n.batch, n.kv_seq, n.kv_heads, n.head_dim});
  expect_shape(op, "v", v, {n.batch, n.kv_seq, n.kv_heads, n.head_dim});
  MARROW_CHECK(n.kv_heads > 0 && n.q_heads % n.kv_heads == 0,
               "{}: the {} query heads of q are not a multiple of the {} key/value heads of k", op, n.q_heads,
               n.kv_heads);
  return n;
}

// A block's ranges lie inside q and k, and a causal block pairs ranges of equal length.
void check_block(const char* op, const Dims& n, const AttentionBlock& blk) {
  MARROW_CHECK(0 <= blk.q_begin && blk.q_begin <= blk.q_end && blk.q_end <= n.q_seq && 0 <= blk.k_begin &&
                   blk.k_begin <= blk.k_end && blk.k_end <= n.kv_seq,
               "{}: query rows [{}, {}) and key rows [{}, {}) do not fit {} queries and {} keys", op, blk.q_begin,
               blk.q_end, blk.k_begin, blk.k_end, n.q_seq, n.kv_seq);
  MARROW_CHECK(blk.mask == AttentionMask::full || blk.q_end - blk.q_begin == blk.k_end - blk.k_begin,
               "{}: a causal block pairs {} queries with {} keys (it needs equal counts)", op, blk.q_end - blk.q_begin,
               blk.k_end - blk.k_begin);
  MARROW_CHECK(blk.q_begin == blk.q_end || blk.k_begin < blk.k_end, "{}: {} queries see no key", op,
               blk.q_end - blk.q_begin);
  MARROW_CHECK(blk.window >= 0, "{}: the sliding window must be 0 (none) or positive, got {}", op, blk.window);
  MARROW_CHECK(blk.window == 0 || blk.mask == AttentionMask::full || blk.distance == 0,
               "{}: a causal block's queries and keys are the same tokens, but its distance is {}", op, blk.distance);
}

#ifdef __CUDACC__
// ---------------------------------------------------------------------------------------------
// CUDA: FlashAttention-2 on tensor cores (mma.sync m16n8k16, bf16 operands, f32 accumulators).
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
//
// Fragment layouts (PTX ISA, mma.m16n8k16 with .bf16; g = lane / 4, t = lane % 4):
//   A 16x16 row-major: a0 = (g, 2t..2t+1), a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..)
//   B 16x8 "col":      b0 = (k 2t..2t+1, n g), b1 = (k 2t+8..2t+9, n g)
//   C 16x8:            c0, c1 = (g, 2t..2t+1), c2, c3 = (g+8, 2t..2t+1)
// The lower column index sits in the lower 16 bits of each 32-bit register.
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
  // With a window: the first key query i sees, and the last query that sees key j (block indices;
  // beyond the block's keys or before its queries when a row or a key sees nothing).
  __device__ int first_key(int i) const { return window > 0 ? max(0, distance + i - window + 1) : 0; }
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
                                               const GpuArgs& a, int n0, int row0, int row, int t) {
  const bool edge = n0 + BN - 1 > a.last_key(row0);
  float tile_max[2] = {row_max[0], row_max[1]};
#pragma unroll
  for (int j = 0; j < BN / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float x = s[j][e] * a.scale_log2;
      if (edge && n0 + j * 8 + 2 * t + e % 2 > a.last_key(row + e / 2 * 8)) x = -INFINITY;
      if constexpr (V)
        if (n0 < a.first_key(row0 + kWarpRows - 1) && n0 + j * 8 + 2 * t + e % 2 < a.first_key(row + e / 2 * 8)) x = -INFINITY;
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
  const int n_first = V ? a.first_key(m0) / BN : 0;

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

    online_softmax<D, BN, V>(s, o, row_max, row_sum, a, n0, row0, row, t);
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
__device__ __forceinline__ void probabilities(float (&p)[BN / 8][4], const GpuArgs& a, const float (&lse2)[2], int n0, int row0, int row,
                                              int t) {
  const bool edge = n0 + BN - 1 > a.last_key(row0);
#pragma unroll
  for (int j = 0; j < BN / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float x = exp2f(p[j][e] * a.scale_log2 - lse2[e / 2]);
      p[j][e] = edge && n0 + j * 8 + 2 * t + e % 2 > a.last_key(row + e / 2 * 8) ? 0.f : x;
      if constexpr (V)
        if (n0 < a.first_key(row0 + kWarpRows - 1) && n0 + j * 8 + 2 * t + e % 2 < a.first_key(row + e / 2 * 8)) p[j][e] = 0.f;
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
        if constexpr (V)  // queries past the window of the tile's keys
          if (m0 + BM - 1 > a.last_query(key0) && m0 + c > a.last_query(key + e / 2 * 8)) p[j][e] = 0.f;
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
  const int n_first = V ? a.first_key(m0) / BN : 0;

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
    probabilities<BN, V>(p, a, lse2, n0, row0, row, t);
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

template <typename Kernel>
void launch_tiled(Kernel kernel, const Dims& n, int64_t rows, size_t smem_bytes, const GpuArgs& args,
                  cudaStream_t stream) {
  // Blocks of these kernels need more than the default 48 KB of dynamic shared memory at D = 128.
  MARROW_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem_bytes)));
  const dim3 grid(unsigned(cdiv(int(rows), 64)), unsigned(n.q_heads), unsigned(n.batch));
  kernel<<<grid, kThreads, smem_bytes, stream>>>(args);
  MARROW_CUDA_CHECK_LAUNCH();
}

// 16-byte aligned device tensors of one dtype, named in the message.
void expect_gpu_tensors(const char* op, DType dtype, std::initializer_list<std::pair<const char*, const Tensor*>> ts) {
  for (auto [name, t] : ts) {
    expect_dtype(op, name, *t, dtype);
    MARROW_CHECK(reinterpret_cast<uintptr_t>(t->data) % 16 == 0, "{}: {} is not 16-byte aligned on the GPU", op, name);
  }
}

// The GPU's dtypes (docs/gpu-path.md) and the limits of the kernels, checked with the tensors' names.
void check_gpu_inputs(const char* op, const Dims& n, std::initializer_list<std::pair<const char*, const Tensor*>> bf16s,
                      const Tensor& lse) {
  expect_gpu_tensors(op, DType::bf16, bf16s);
  expect_dtype(op, "lse", lse, DType::f32);
  MARROW_CHECK(n.head_dim == 64 || n.head_dim == 128,
               "{}: head_dim {} has no GPU kernel (the CUDA kernels take head_dim 64 or 128)", op, n.head_dim);
  MARROW_CHECK(std::max(n.q_seq, n.kv_seq) < (int64_t(1) << 30) && n.q_heads <= 65535 && n.batch <= 65535,
               "{}: batch {}, seq {}, {} query heads exceed the GPU kernels' grid", op, n.batch,
               std::max(n.q_seq, n.kv_seq), n.q_heads);
}

GpuArgs gpu_args(const Dims& n, const AttentionBlock& blk, Tensor q, Tensor k, Tensor v) {
  GpuArgs a{};
  a.q = static_cast<const bf16*>(q.data);
  a.k = static_cast<const bf16*>(k.data);
  a.v = static_cast<const bf16*>(v.data);
  a.q_seq = int(n.q_seq);
  a.kv_seq = int(n.kv_seq);
  a.q_begin = int(blk.q_begin);
  a.q_len = int(blk.q_end - blk.q_begin);
  a.k_begin = int(blk.k_begin);
  a.k_len = int(blk.k_end - blk.k_begin);
  a.full = blk.mask == AttentionMask::full;
  a.q_heads = int(n.q_heads);
  a.kv_heads = int(n.kv_heads);
  a.scale = float(1 / std::sqrt(double(n.head_dim)));
  a.scale_log2 = float(1 / std::sqrt(double(n.head_dim)) * 1.4426950408889634);
  a.window = int(blk.window);
  a.distance = int(blk.distance);
  return a;
}

// sinks: bf16 [Hq] or empty (blocks: empty). A window or sinks run the kernels' V instantiations.
void forward_gpu(const char* op, Tensor out, Tensor lse, Tensor q, Tensor k, Tensor v, const Dims& n,
                 const AttentionBlock& blk, Tensor sinks, Stream stream) {
  check_gpu_inputs(op, n, {{"q", &q}, {"k", &k}, {"v", &v}, {"out", &out}}, lse);
  GpuArgs a = gpu_args(n, blk, q, k, v);
  if (n.batch * a.q_len * n.q_heads == 0) return;
  a.o = static_cast<bf16*>(out.data);
  a.lse = static_cast<float*>(lse.data);
  a.sinks = static_cast<const bf16*>(sinks.data);
  const auto s = static_cast<cudaStream_t>(stream.handle);
  const size_t smem = size_t(64 + 4 * 64) * (n.head_dim + kPad) * sizeof(bf16);
  const bool variant = a.window > 0 || a.sinks;
  if (n.head_dim == 64) launch_tiled(variant ? attention_forward_kernel<64, true> : attention_forward_kernel<64>, n, a.q_len, smem, a, s);
  else launch_tiled(variant ? attention_forward_kernel<128, true> : attention_forward_kernel<128>, n, a.q_len, smem, a, s);
}

// dk and dv of the backward (a.delta computed): the key-tile kernel, then the sum of each group's
// query heads when Hq > Hkv.
void dkdv_gpu(GpuArgs a, const Dims& n, size_t ld_bytes, Stream stream) {
  const auto s = static_cast<cudaStream_t>(stream.handle);
  const int64_t group = n.q_heads / n.kv_heads;
  Buffer dk_part, dv_part;  // freed in stream order after the kernels below
  if (group > 1) {
    dk_part = Buffer(DType::f32, Device::cuda, {n.batch, a.k_len, n.q_heads, n.head_dim}, stream);
    dv_part = Buffer(DType::f32, Device::cuda, {n.batch, a.k_len, n.q_heads, n.head_dim}, stream);
    a.dk_part = dk_part.ptr<float>();
    a.dv_part = dv_part.ptr<float>();
  }
  const size_t dkdv_smem = size_t(2 * 64 + 4 * 32) * ld_bytes + 4 * 32 * sizeof(float);
  const bool window = a.window > 0;
  if (n.head_dim == 64) launch_tiled(window ? attention_dkdv_kernel<64, true> : attention_dkdv_kernel<64>, n, a.k_len, dkdv_smem, a, s);
  else launch_tiled(window ? attention_dkdv_kernel<128, true> : attention_dkdv_kernel<128>, n, a.k_len, dkdv_smem, a, s);
  if (group > 1) {
    const int64_t numel = n.batch * a.k_len * n.kv_heads * n.head_dim;
    const unsigned blocks = unsigned(std::min<int64_t>((numel + 255) / 256, 65536));
    attention_group_sum_kernel<<<blocks, 256, 0, s>>>(a, numel, int(n.head_dim));
    MARROW_CUDA_CHECK_LAUNCH();
  }
}

// accumulate: add into f32 dq, dk, dv (a block); else overwrite bf16 ones (the causal op).
void backward_gpu(const char* op, Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q, Tensor k, Tensor v,
                  Tensor out, Tensor lse, const Dims& n, const AttentionBlock& blk, bool accumulate, AttentionGrads grads,
                  Stream stream) {
  check_gpu_inputs(op, n, {{"q", &q}, {"k", &k}, {"v", &v}, {"out", &out}, {"dout", &dout}}, lse);
  expect_gpu_tensors(op, accumulate ? DType::f32 : DType::bf16, {{"dq", &dq}, {"dk", &dk}, {"dv", &dv}});
  GpuArgs a = gpu_args(n, blk, q, k, v);
  if (n.batch * a.q_len * n.q_heads == 0) return;
  const auto s = static_cast<cudaStream_t>(stream.handle);
  a.out = static_cast<const bf16*>(out.data);
  a.dout = static_cast<const bf16*>(dout.data);
  a.lse = static_cast<float*>(lse.data);
  if (accumulate) {
    a.dq_acc = dq.ptr<float>();
    a.dk_acc = dk.ptr<float>();
    a.dv_acc = dv.ptr<float>();
  } else {
    a.dq = static_cast<bf16*>(dq.data);
    a.dk = static_cast<bf16*>(dk.data);
    a.dv = static_cast<bf16*>(dv.data);
  }
  const bool d64 = n.head_dim == 64;

  Buffer delta(DType::f32, Device::cuda, {n.batch, n.q_heads, a.q_len}, stream);
  a.delta = delta.ptr<float>();
  const int64_t rows = n.batch * a.q_len * n.q_heads;
  const unsigned delta_blocks = unsigned((rows + 7) / 8);  // blocks of 256 threads: 8 warps, a row each
  if (d64) attention_delta_kernel<64><<<delta_blocks, 256, 0, s>>>(a, delta.ptr<float>(), rows);
  else attention_delta_kernel<128><<<delta_blocks, 256, 0, s>>>(a, delta.ptr<float>(), rows);
  MARROW_CUDA_CHECK_LAUNCH();

  // dk and dv are final before dq's kernel starts, so a caller can send them on while it runs.
  const size_t ld_bytes = size_t(n.head_dim + kPad) * sizeof(bf16);
  if (grads != AttentionGrads::q) dkdv_gpu(a, n, ld_bytes, stream);
  if (grads == AttentionGrads::kv) return;
  const size_t dq_smem = size_t(2 * 64 + 4 * 64) * ld_bytes;
  const bool window = a.window > 0;
  if (d64) launch_tiled(window ? attention_dq_kernel<64, true> : attention_dq_kernel<64>, n, a.q_len, dq_smem, a, s);
  else launch_tiled(window ? attention_dq_kernel<128, true> : attention_dq_kernel<128>, n, a.q_len, dq_smem, a, s);
}

void merge_gpu(Tensor out, Tensor lse, Tensor part_out, Tensor part_lse, const Dims& n, int64_t begin, int64_t end,
               Stream stream) {
  const char* op = "attention_merge";
  for (auto [name, t] : {std::pair{"out", &out}, std::pair{"lse", &lse}, std::pair{"part_lse", &part_lse}})
    expect_dtype(op, name, *t, DType::f32);
  expect_dtype(op, "part_out", part_out, DType::bf16);
  const int64_t rows = n.batch * (end - begin) * n.q_heads;
  if (rows == 0) return;
  MARROW_CHECK(n.q_seq < (int64_t(1) << 30) && n.head_dim < (int64_t(1) << 30), "{}: {} rows of {} exceed the GPU kernel",
               op, n.q_seq, n.head_dim);
  attention_merge_kernel<<<unsigned((rows + 7) / 8), 256, 0, static_cast<cudaStream_t>(stream.handle)>>>(
      out.ptr<float>(), lse.ptr<float>(), static_cast<const bf16*>(part_out.data), part_lse.ptr<float>(), rows,
      int(begin), int(end - begin), int(n.q_seq), int(n.q_heads), int(n.head_dim));
  MARROW_CUDA_CHECK_LAUNCH();
}
#endif  // __CUDACC__

// Both forwards after their shape checks: the device's path.
void forward(const char* op, Tensor out, Tensor lse, Tensor q, Tensor k, Tensor v, const Dims& n, const AttentionBlock& block,
             Tensor sinks, Stream stream) {
  if (common_device(op, {{"q", &q}, {"k", &k}, {"v", &v}, {"out", &out}, {"lse", &lse}}) == Device::cuda) {
#ifdef __CUDACC__
    return forward_gpu(op, out, lse, q, k, v, n, block, sinks, stream);
#else
    no_cuda_kernel(op);
#endif
  }
  expect_same_dtype(op, {{"q", &q}, {"k", &k}, {"v", &v}, {"out", &out}, {"lse", &lse}});
  (void)stream;
  with_cpu_scalar(op, q, [&](auto s) {
    using T = decltype(s);
    forward_cpu<T>(out.ptr<T>(), lse.ptr<T>(), q.ptr<T>(), k.ptr<T>(), v.ptr<T>(), sinks.data ? sinks.ptr<T>() : nullptr, n, block);
  });
}

// The backward's shape and device checks (the gradients' dtypes are the caller's); returns the
// sizes and whether the tensors are on the GPU.
std::pair<Dims, bool> check_backward(const char* op, Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q, Tensor k,
                                     Tensor v, Tensor out, Tensor lse) {
  const Dims n = check_qkv(op, q, k, v);
  expect_shape(op, "dq", dq, {n.batch, n.q_seq, n.q_heads, n.head_dim});
  expect_shape(op, "dk", dk, {n.batch, n.kv_seq, n.kv_heads, n.head_dim});
  expect_shape(op, "dv", dv, {n.batch, n.kv_seq, n.kv_heads, n.head_dim});
  expect_shape(op, "dout", dout, {n.batch, n.q_seq, n.q_heads, n.head_dim});
  expect_shape(op, "out", out, {n.batch, n.q_seq, n.q_heads, n.head_dim});
  expect_shape(op, "lse", lse, {n.batch, n.q_heads, n.q_seq});
  const std::initializer_list<std::pair<const char*, const Tensor*>> tensors = {
      {"q", &q},       {"k", &k},   {"v", &v},   {"out", &out}, {"lse", &lse},
      {"dout", &dout}, {"dq", &dq}, {"dk", &dk}, {"dv", &dv}};
  const bool gpu = common_device(op, tensors) == Device::cuda;
  if (!gpu) expect_same_dtype(op, tensors);
  return {n, gpu};
}

// sinks [Hq] with q's dtype and device, a window >= 0. Returns whether the op has a variant.
bool check_variant(const char* op, const Dims& n, const Tensor& q, const AttentionVariant& variant) {
  MARROW_CHECK(variant.window >= 0, "{}: the sliding window must be 0 (none) or positive, got {}", op, variant.window);
  if (variant.sinks.data) {
    expect_shape(op, "sinks", variant.sinks, {n.q_heads});
    expect_dtype(op, "sinks", variant.sinks, q.dtype);
    expect_device(op, "sinks", variant.sinks, q.device);
  }
  return variant.sinks.data || variant.window > 0;
}

// Both backwards after their shape checks: the device's path.
// accumulate: add the block's share into dq, dk, dv (f32 on the GPU); else overwrite them (bf16 on
// the GPU).
void backward(const char* op, Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse,
              const Dims& n, const AttentionBlock& block, bool accumulate, AttentionGrads grads, bool gpu, Stream stream) {
  if (gpu) {
#ifdef __CUDACC__
    return backward_gpu(op, dq, dk, dv, dout, q, k, v, out, lse, n, block, accumulate, grads, stream);
#else
    no_cuda_kernel(op);
#endif
  }
  (void)stream;
  if (!accumulate)
    for (Tensor g : {dq, dk, dv}) fill_zero(g);
  with_cpu_scalar(op, q, [&](auto s) {
    using T = decltype(s);
    backward_cpu<T>(dq.ptr<T>(), dk.ptr<T>(), dv.ptr<T>(), dout.ptr<T>(), q.ptr<T>(), k.ptr<T>(), v.ptr<T>(), out.ptr<T>(),
                    lse.ptr<T>(), n, block, grads);
  });
}

// Which kernels run the causal op on the GPU: the setting's choice where it serves the sizes, else
// the next (hopper -> cuDNN -> own). The wgmma kernels (hopper) take no variant.
enum class CausalPath : uint8_t { hopper, cudnn, own };

bool cudnn_backward_deterministic() { return attention_kernels() != AttentionKernels::cudnn_nondeterministic; }

CausalPath forward_path(int64_t seq, int64_t q_heads, int64_t kv_heads, int64_t head_dim, bool variant) {
#if MARROW_CUDA
  if (!variant && attention_kernels() == AttentionKernels::hopper && hopper_attention_supports(seq, q_heads, kv_heads, head_dim))
    return CausalPath::hopper;
  if (attention_kernels() != AttentionKernels::own && cudnn_attention_forward_supports(seq, head_dim)) return CausalPath::cudnn;
#else
  (void)seq, (void)q_heads, (void)kv_heads, (void)head_dim, (void)variant;
#endif
  return CausalPath::own;
}

CausalPath backward_path(int64_t batch, int64_t seq, int64_t q_heads, int64_t kv_heads, int64_t head_dim, bool variant) {
#if MARROW_CUDA
  const bool hopper = attention_kernels() == AttentionKernels::hopper || attention_kernels() == AttentionKernels::hopper_backward;
  if (!variant && hopper && hopper_attention_supports(seq, q_heads, kv_heads, head_dim)) return CausalPath::hopper;
  if (attention_kernels() != AttentionKernels::own &&
      cudnn_attention_backward_supports(batch, seq, q_heads, kv_heads, head_dim, cudnn_backward_deterministic()))
    return CausalPath::cudnn;
#else
  (void)batch, (void)seq, (void)q_heads, (void)kv_heads, (void)head_dim, (void)variant;
#endif
  return CausalPath::own;
}

AttentionKernels& kernels_setting() {
  static AttentionKernels kernels = AttentionKernels::own;
  return kernels;
}

}  // namespace

void set_attention_kernels(AttentionKernels kernels) { kernels_setting() = kernels; }
AttentionKernels attention_kernels() { return kernels_setting(); }

AttentionKernels parse_attention_kernels(const std::string& name) {
  for (AttentionKernels k : kAttentionKernels)
    if (name == attention_kernels_name(k)) return k;
  fail("attention kernels must be own, cudnn, cudnn_nondeterministic, hopper or hopper_backward, got '{}'", name);
}

const char* attention_kernels_name(AttentionKernels kernels) {
  switch (kernels) {
    case AttentionKernels::cudnn: return "cudnn";
    case AttentionKernels::cudnn_nondeterministic: return "cudnn_nondeterministic";
    case AttentionKernels::hopper: return "hopper";
    case AttentionKernels::hopper_backward: return "hopper_backward";
    default: return "own";
  }
}

namespace {

bool& cpu_blocks_fused() {
  static bool fused = false;
  return fused;
}

// Blocks go to the wgmma kernels unless the setting is own, where those serve the block.
bool block_on_hopper(const Tensor& q, const Tensor& k, const AttentionBlock& block) {
#if MARROW_CUDA
  return attention_kernels() != AttentionKernels::own && q.device == Device::cuda && hopper_attention_serves_block(q, k, block);
#else
  (void)q, (void)k, (void)block;
  return false;
#endif
}

}  // namespace

void set_cpu_blocks_fused(bool fused) { cpu_blocks_fused() = fused; }

bool attention_block_backward_fused(const Tensor& q, const Tensor& k, const AttentionBlock& block) {
  return q.device == Device::cpu ? cpu_blocks_fused() : block_on_hopper(q, k, block);
}

void attention_block_forward(Tensor out, Tensor lse, Tensor q, Tensor k, Tensor v, const AttentionBlock& block,
                             Stream stream) {
  const char* op = "attention_block_forward";
  const Dims n = check_qkv(op, q, k, v);
  expect_shape(op, "out", out, {n.batch, n.q_seq, n.q_heads, n.head_dim});
  expect_shape(op, "lse", lse, {n.batch, n.q_heads, n.q_seq});
  check_block(op, n, block);
  if (block_on_hopper(q, k, block) &&
      common_device(op, {{"q", &q}, {"k", &k}, {"v", &v}, {"out", &out}, {"lse", &lse}}) == Device::cuda)
    return hopper_attention_block_forward(out, lse, q, k, v, block, stream);
  forward(op, out, lse, q, k, v, n, block, {}, stream);
}

void attention_forward(Tensor out, Tensor lse, Tensor q, Tensor k, Tensor v, Stream stream) {
  attention_forward(out, lse, q, k, v, AttentionVariant{}, stream);
}

void attention_forward(Tensor out, Tensor lse, Tensor q, Tensor k, Tensor v, const AttentionVariant& variant,
                       Stream stream) {
  const char* op = "attention_forward";
  const Dims n = check_qkv(op, q, k, v);
  expect_shape(op, "k", k, {n.batch, n.q_seq, n.kv_heads, n.head_dim});
  expect_shape(op, "out", out, {n.batch, n.q_seq, n.q_heads, n.head_dim});
  expect_shape(op, "lse", lse, {n.batch, n.q_heads, n.q_seq});
  const bool has_variant = check_variant(op, n, q, variant);
#if MARROW_CUDA
  if (q.device == Device::cuda) switch (forward_path(n.q_seq, n.q_heads, n.kv_heads, n.head_dim, has_variant)) {
      case CausalPath::hopper: return hopper_attention_forward(out, lse, q, k, v, stream);
      case CausalPath::cudnn: return cudnn_attention_forward(out, lse, q, k, v, variant, stream);
      case CausalPath::own: break;
    }
#endif
  forward(op, out, lse, q, k, v, n, {AttentionMask::causal, 0, n.q_seq, 0, n.q_seq, variant.window}, variant.sinks, stream);
}

void attention_block_backward(Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out,
                              Tensor lse, const AttentionBlock& block, AttentionGrads grads, Stream stream) {
  const char* op = "attention_block_backward";
  const auto [n, gpu] = check_backward(op, dq, dk, dv, dout, q, k, v, out, lse);
  check_block(op, n, block);
  if (gpu && block_on_hopper(q, k, block))
    return hopper_attention_block_backward(dq, dk, dv, dout, q, k, v, out, lse, block, grads, stream);
  backward(op, dq, dk, dv, dout, q, k, v, out, lse, n, block, true, grads, gpu, stream);
}

void attention_backward(Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out,
                        Tensor lse, Stream stream) {
  attention_backward(dq, dk, dv, {}, dout, q, k, v, out, lse, AttentionVariant{}, stream);
}

void attention_backward(Tensor dq, Tensor dk, Tensor dv, Tensor dsinks, Tensor dout, Tensor q, Tensor k, Tensor v,
                        Tensor out, Tensor lse, const AttentionVariant& variant, Stream stream) {
  const char* op = "attention_backward";
  const auto [n, gpu] = check_backward(op, dq, dk, dv, dout, q, k, v, out, lse);
  expect_shape(op, "k", k, {n.batch, n.q_seq, n.kv_heads, n.head_dim});
  const bool has_variant = check_variant(op, n, q, variant);
  if (variant.sinks.data) {
    MARROW_CHECK(dsinks.data, "{}: variant.sinks is given but dsinks, its gradient, is empty", op);
    expect_shape(op, "dsinks", dsinks, {n.q_heads});
    expect_dtype(op, "dsinks", dsinks, gpu ? DType::f32 : q.dtype);
    expect_device(op, "dsinks", dsinks, q.device);
  } else {
    MARROW_CHECK(!dsinks.data, "{}: dsinks is given but variant.sinks is empty", op);
  }
  const CausalPath path = gpu ? backward_path(n.batch, n.q_seq, n.q_heads, n.kv_heads, n.head_dim, has_variant) : CausalPath::own;
#if MARROW_CUDA
  if (path == CausalPath::hopper) return hopper_attention_backward(dq, dk, dv, dout, q, k, v, out, lse, stream);
  if (path == CausalPath::cudnn) cudnn_attention_backward(dq, dk, dv, dout, q, k, v, out, lse, variant, stream, cudnn_backward_deterministic());
#endif
  if (path == CausalPath::own)
    backward(op, dq, dk, dv, dout, q, k, v, out, lse, n, {AttentionMask::causal, 0, n.q_seq, 0, n.q_seq, variant.window}, false,
             AttentionGrads::all, gpu, stream);
  if (variant.sinks.data) attention_sinks_backward(dsinks, dout, out, lse, variant.sinks, stream);
}

int64_t attention_backward_scratch(int64_t batch, int64_t seq, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                                   bool variant) {
  switch (backward_path(batch, seq, q_heads, kv_heads, head_dim, variant)) {
    case CausalPath::hopper: return hopper_attention_backward_scratch(batch, seq, q_heads, kv_heads, head_dim);
    case CausalPath::cudnn:
      return cudnn_attention_backward_scratch(batch, seq, q_heads, kv_heads, head_dim, cudnn_backward_deterministic());
    case CausalPath::own: break;
  }
  const int64_t T = batch * seq;
  return T * q_heads * 4 + (q_heads > kv_heads ? 2 * T * q_heads * head_dim * 4 : 0);
}

void attention_merge(Tensor out, Tensor lse, Tensor part_out, Tensor part_lse, int64_t begin, int64_t end,
                     Stream stream) {
  const char* op = "attention_merge";
  MARROW_CHECK(out.ndim == 4, "{}: out must be [batch, seq, heads, head_dim], got {}", op, out.shape_string());
  const Dims n{out.size(0), out.size(1), out.size(1), out.size(2), out.size(2), out.size(3)};
  expect_shape(op, "lse", lse, {n.batch, n.q_heads, n.q_seq});
  expect_shape(op, "part_out", part_out, {n.batch, n.q_seq, n.q_heads, n.head_dim});
  expect_shape(op, "part_lse", part_lse, {n.batch, n.q_heads, n.q_seq});
  MARROW_CHECK(0 <= begin && begin <= end && end <= n.q_seq, "{}: rows [{}, {}) do not fit {} rows", op, begin, end,
               n.q_seq);
  const std::initializer_list<std::pair<const char*, const Tensor*>> tensors = {
      {"out", &out}, {"lse", &lse}, {"part_out", &part_out}, {"part_lse", &part_lse}};
  if (common_device(op, tensors) == Device::cuda) {
#ifdef __CUDACC__
    return merge_gpu(out, lse, part_out, part_lse, n, begin, end, stream);
#else
    no_cuda_kernel(op);
#endif
  }
  expect_same_dtype(op, tensors);
  (void)stream;
  with_cpu_scalar(op, out, [&](auto s) {
    using T = decltype(s);
    merge_cpu<T>(out.ptr<T>(), lse.ptr<T>(), part_out.ptr<T>(), part_lse.ptr<T>(), n, begin, end);
  });
}

namespace {

// out[B, S, Hq, D] and lse[B, Hq, S]; returns the sizes.
Dims sinks_dims(const char* op, const Tensor& out, const Tensor& lse, const Tensor& sinks) {
  MARROW_CHECK(out.ndim == 4, "{}: out must be [batch, seq, heads, head_dim], got {}", op, out.shape_string());
  const Dims n{out.size(0), out.size(1), out.size(1), out.size(2), out.size(2), out.size(3)};
  expect_shape(op, "lse", lse, {n.batch, n.q_heads, n.q_seq});
  expect_shape(op, "sinks", sinks, {n.q_heads});
  return n;
}

// attention_merge's arithmetic with a part of value 0 and lse sinks[h].
template <typename T>
void sinks_merge_cpu(T* out, T* lse, const T* sinks, const Dims& n) {
  for (int64_t b = 0; b < n.batch; ++b)
    for (int64_t h = 0; h < n.q_heads; ++h)
      for (int64_t i = 0; i < n.q_seq; ++i) {
        T& l = lse[n.lse(b, i, h)];
        const T m = std::max(l, sinks[h]), w1 = std::exp(l - m), sum = w1 + std::exp(sinks[h] - m);
        T* o = out + n.q(b, i, h);
        for (int64_t d = 0; d < n.head_dim; ++d) o[d] = w1 * o[d] / sum;
        l = m + std::log(sum);
      }
}

#ifdef __CUDACC__
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
#endif  // __CUDACC__

}  // namespace

void attention_sinks_merge(Tensor out, Tensor lse, Tensor sinks, Stream stream) {
  const char* op = "attention_sinks_merge";
  const Dims n = sinks_dims(op, out, lse, sinks);
  const std::initializer_list<std::pair<const char*, const Tensor*>> tensors = {{"out", &out}, {"lse", &lse}, {"sinks", &sinks}};
  if (common_device(op, tensors) == Device::cuda) {
#ifdef __CUDACC__
    for (auto [name, t] : {std::pair{"out", &out}, std::pair{"lse", &lse}}) expect_dtype(op, name, *t, DType::f32);
    expect_dtype(op, "sinks", sinks, DType::bf16);
    const int64_t rows = n.batch * n.q_seq * n.q_heads;
    if (rows == 0) return;
    attention_sinks_merge_kernel<<<unsigned((rows + 7) / 8), 256, 0, static_cast<cudaStream_t>(stream.handle)>>>(
        out.ptr<float>(), lse.ptr<float>(), static_cast<const bf16*>(sinks.data), rows, int(n.q_seq), int(n.q_heads), int(n.head_dim));
    MARROW_CUDA_CHECK_LAUNCH();
    return;
#else
    no_cuda_kernel(op);
#endif
  }
  (void)stream;
  expect_same_dtype(op, tensors);
  with_cpu_scalar(op, out, [&](auto s) {
    using T = decltype(s);
    sinks_merge_cpu<T>(out.ptr<T>(), lse.ptr<T>(), sinks.ptr<T>(), n);
  });
}

void attention_sinks_backward(Tensor dsinks, Tensor dout, Tensor out, Tensor lse, Tensor sinks, Stream stream) {
  const char* op = "attention_sinks_backward";
  const Dims n = sinks_dims(op, out, lse, sinks);
  expect_shape(op, "dout", dout, {n.batch, n.q_seq, n.q_heads, n.head_dim});
  expect_shape(op, "dsinks", dsinks, {n.q_heads});
  const std::initializer_list<std::pair<const char*, const Tensor*>> tensors = {
      {"dsinks", &dsinks}, {"dout", &dout}, {"out", &out}, {"lse", &lse}, {"sinks", &sinks}};
  if (common_device(op, tensors) == Device::cuda) {
#ifdef __CUDACC__
    for (auto [name, t] : {std::pair{"dout", &dout}, std::pair{"out", &out}, std::pair{"sinks", &sinks}}) expect_dtype(op, name, *t, DType::bf16);
    for (auto [name, t] : {std::pair{"dsinks", &dsinks}, std::pair{"lse", &lse}}) expect_dtype(op, name, *t, DType::f32);
    if (n.q_heads == 0) return;
    attention_sinks_backward_kernel<<<unsigned(n.q_heads), kSinkThreads, 0, static_cast<cudaStream_t>(stream.handle)>>>(
        dsinks.ptr<float>(), static_cast<const bf16*>(dout.data), static_cast<const bf16*>(out.data), lse.ptr<float>(),
        static_cast<const bf16*>(sinks.data), n.batch, n.q_seq, n.q_heads, n.head_dim);
    MARROW_CUDA_CHECK_LAUNCH();
    return;
#else
    no_cuda_kernel(op);
#endif
  }
  (void)stream;
  expect_same_dtype(op, tensors);
  with_cpu_scalar(op, out, [&](auto s) {
    using T = decltype(s);
    sinks_backward_cpu<T>(dsinks.ptr<T>(), dout.ptr<T>(), out.ptr<T>(), lse.ptr<T>(), sinks.ptr<T>(), n);
  });
}

}  // namespace marrow
