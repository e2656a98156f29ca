// The fused QK-norm + RoPE kernels keep the plain rmsnorm's lane layout (pack p of a row to lane p;
// the tree over a head's lanes is warp_sum's) so that fused and unfused give the same bits
// (marrow check's "... bits" rows). A faster layout that moves elements between lanes changes bits.
#include "ops/rmsnorm.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <utility>

#include "core/cuda_check.h"
#include "core/memory.h"
#include "ops/add.h"
#include "ops/common.h"
#include "ops/rope.h"

#ifdef __CUDACC__
#include <cuda_bf16.h>

#include "ops/cuda_common.cuh"
#endif

namespace marrow {

namespace {

// offset as norm_offset gives it: y = x * r * (offset + weight[j]) in T.
template <typename T>
void forward_cpu(T* y, T* rstd, const T* x, const T* weight, T offset, int64_t n, int64_t d, double eps) {
  for (int64_t i = 0; i < n; ++i) {
    const T* xi = x + i * d;
    double sum = 0;
    for (int64_t j = 0; j < d; ++j) sum += double(xi[j]) * xi[j];
    T r = T(1.0 / std::sqrt(sum / double(d) + eps));
    rstd[i] = r;
    for (int64_t j = 0; j < d; ++j) y[i * d + j] = xi[j] * r * (offset + weight[j]);
  }
}

// With xhat = x * rstd and the scale w = offset + weight in T: dweight += sum_i dy * xhat;
// dx = rstd * (dy * w - xhat * mean_j(dy * w * xhat)), then + dresidual (when not null) in T, as
// add() would: dx may alias dresidual.
template <typename T>
void backward_cpu(T* dx, T* dweight, const T* dy, const T* x, const T* weight, T offset, const T* rstd, const T* dresidual,
                  int64_t n, int64_t d) {
  for (int64_t i = 0; i < n; ++i) {
    const T *xi = x + i * d, *dyi = dy + i * d;
    double r = rstd[i], dot = 0;
    for (int64_t j = 0; j < d; ++j) dot += double(dyi[j]) * (offset + weight[j]) * xi[j] * r;
    double mean = dot / double(d);
    for (int64_t j = 0; j < d; ++j) {
      double xhat = xi[j] * r;
      dweight[j] += T(dyi[j] * xhat);
      const T g = T(r * (double(dyi[j]) * (offset + weight[j]) - xhat * mean));
      dx[i * d + j] = dresidual ? T(g + dresidual[i * d + j]) : g;
    }
  }
}

// The offset as the ops add it: 0 as -0.0f, which adds to every float, -0 included, without
// changing its bits (+0.0f would turn a -0 weight into +0): offset 0 keeps the plain norm's bits.
float norm_offset(const NormWeight& weight) { return weight.offset == 0 ? -0.0f : weight.offset; }

#ifdef __CUDACC__
constexpr int kWarpsPerBlock = 8;
constexpr int64_t kChunkRows = 64;  // rows per partial sum of dweight
constexpr int kMaxHalf = 128;       // RoPE variants: head_dim up to 256, inv_freq travels as a kernel argument

// One warp per row; lanes stride the row in packs of N (8 bf16 when D % 8 == 0). A lane sums the
// squares of its packs in order, then warp_sum reduces the lanes in a fixed tree, so the result
// does not depend on scheduling. Every forward kernel sums in this order, so all give one rstd.
// The kernels' multiply-adds are written out (fmaf, __fmul_rn) wherever a fused and an unfused
// kernel must agree: the compiler contracts a * b + c into an fma or not depending on the code
// around it, which differs from kernel to kernel.
template <int N> __device__ float lane_squares(const bf16* xr, int64_t d, int lane) {
  float ss = 0;
  for (int64_t c = lane * N; c < d; c += 32 * N) {
    const Pack<bf16, N> p = load<N>(xr + c);
    for (int l = 0; l < N; ++l) ss = fmaf(float(p.v[l]), float(p.v[l]), ss);
  }
  return ss;
}

__device__ float row_rstd(float lane_ss, int64_t d, float eps) { return 1.0f / sqrtf(warp_sum(lane_ss) / float(d) + eps); }

// y = x * r * (weight + offset) over the lane's packs of the row.
template <int N>
__device__ void normalise_row(bf16* yr, const bf16* xr, const bf16* weight, float offset, float r, int64_t d, int lane) {
  for (int64_t c = lane * N; c < d; c += 32 * N) {
    const Pack<bf16, N> p = load<N>(xr + c), w = load<N>(weight + c);
    Pack<bf16, N> o;
    for (int l = 0; l < N; ++l) o.v[l] = bf16(float(p.v[l]) * r * (float(w.v[l]) + offset));
    store<N>(yr + c, o);
  }
}

template <int N>
__global__ void rmsnorm_forward_kernel(bf16* y, float* rstd, const bf16* x, const bf16* weight, float offset, int64_t rows, int64_t d,
                                       float eps) {
  begin_after_previous_grid();
  const int64_t row = blockIdx.x * int64_t(kWarpsPerBlock) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const float r = row_rstd(lane_squares<N>(x + row * d, d, lane), d, eps);
  if (lane == 0) rstd[row] = r;
  normalise_row<N>(y + row * d, x + row * d, weight, offset, r, d, lane);
}

// The forward with the residual add: the lane writes its packs of sum = bf16(x + residual) (add()'s
// rounding) while summing their squares in lane_squares' order, then normalises the row of sum it
// wrote, read back (its own writes). Each element is read before it is written, so sum may alias x
// or residual.
template <int N>
__global__ void rmsnorm_add_forward_kernel(bf16* y, bf16* sum, float* rstd, const bf16* x, const bf16* residual, const bf16* weight,
                                           float offset, int64_t rows, int64_t d, float eps) {
  begin_after_previous_grid();
  const int64_t row = blockIdx.x * int64_t(kWarpsPerBlock) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  float ss = 0;
  for (int64_t c = lane * N; c < d; c += 32 * N) {
    const Pack<bf16, N> a = load<N>(x + row * d + c), b = load<N>(residual + row * d + c);
    Pack<bf16, N> s;
    for (int l = 0; l < N; ++l) {
      s.v[l] = bf16(float(a.v[l]) + float(b.v[l]));
      ss = fmaf(float(s.v[l]), float(s.v[l]), ss);
    }
    store<N>(sum + row * d + c, s);
  }
  const float r = row_rstd(ss, d, eps);
  if (lane == 0) rstd[row] = r;
  normalise_row<N>(y + row * d, sum + row * d, weight, offset, r, d, lane);
}

// dx of one row: mean(dy * w * xhat) summed by the lane in order, reduced in a fixed tree; dx is
// rounded to bf16, then dresidual (when not null) is added and rounded again, as add() after the
// plain backward would. dy may be the warp's shared-memory row. dx may alias dresidual.
template <int N>
__device__ void dx_row(bf16* dxr, const bf16* dyr, const bf16* dresr, const bf16* xr, const bf16* weight, float offset, float r,
                       int64_t d, int lane) {
  float dot = 0;
  for (int64_t c = lane * N; c < d; c += 32 * N) {
    const Pack<bf16, N> xp = load<N>(xr + c), gp = load<N>(dyr + c), wp = load<N>(weight + c);
    for (int l = 0; l < N; ++l) dot = fmaf(__fmul_rn(__fmul_rn(float(gp.v[l]), float(wp.v[l]) + offset), float(xp.v[l])), r, dot);
  }
  const float mean = warp_sum(dot) / float(d);
  for (int64_t c = lane * N; c < d; c += 32 * N) {
    const Pack<bf16, N> xp = load<N>(xr + c), gp = load<N>(dyr + c), wp = load<N>(weight + c);
    Pack<bf16, N> o;
    for (int l = 0; l < N; ++l) {
      const float xhat_mean = __fmul_rn(__fmul_rn(float(xp.v[l]), r), mean);
      o.v[l] = bf16(__fmul_rn(r, fmaf(float(gp.v[l]), float(wp.v[l]) + offset, -xhat_mean)));
    }
    if (dresr) {
      const Pack<bf16, N> res = load<N>(dresr + c);
      for (int l = 0; l < N; ++l) o.v[l] = bf16(float(o.v[l]) + float(res.v[l]));
    }
    store<N>(dxr + c, o);
  }
}

// dx: one warp per row, as the forward. Staged (packs of 8): the warp first copies its rows of x,
// dy and dresidual into its part of shared memory (cp.async: the whole row in flight at once,
// without registers), then dx_row reads them there: 25.4 -> 23.5 us a call at the bench shape
// (docs/performance.md). Reading global memory a pack at a time in dx_row's two halves left the
// kernel waiting at each load (ncu: issue slots 37% busy); holding the row in registers instead
// took 127-173 of them.
template <int N, bool Staged>
__global__ void rmsnorm_backward_dx_kernel(bf16* dx, const bf16* dy, const bf16* dresidual, const bf16* x, const bf16* weight,
                                           float offset, const float* rstd, int64_t rows, int64_t d) {
  begin_after_previous_grid();
  const int64_t row = blockIdx.x * int64_t(blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const bf16 *xr = x + row * d, *dyr = dy + row * d, *dresr = dresidual ? dresidual + row * d : nullptr;
  if constexpr (Staged) {
    extern __shared__ Pack<bf16, 8> staged_rows[];
    bf16* mine = reinterpret_cast<bf16*>(staged_rows) + (threadIdx.x / 32) * 3 * d;
    for (int64_t c = lane * 8; c < d; c += 32 * 8) {
      cp_async16(mine + c, xr + c);
      cp_async16(mine + d + c, dyr + c);
      if (dresr) cp_async16(mine + 2 * d + c, dresr + c);
    }
    cp_async_commit();
    cp_async_wait<0>();
    __syncwarp();
    xr = mine;
    dyr = mine + d;
    if (dresr) dresr = mine + 2 * d;
  }
  dx_row<N>(dx + row * d, dyr, dresr, xr, weight, offset, rstd[row], d, lane);
}

// dweight, pass 1: block (chunk, column tile) -- each thread owns one column and sums dy * xhat
// over the chunk's kChunkRows rows in row order into partial[chunk, column]. (Unrolling the loop 8
// times made it ~10% slower on the H200; the RoPE variant below gained a few percent from it.)
__global__ void rmsnorm_dweight_partial_kernel(float* partial, const bf16* dy, const bf16* x, const float* rstd, int64_t rows,
                                       int64_t d) {
  begin_after_previous_grid();
  const int64_t c = blockIdx.y * int64_t(blockDim.x) + threadIdx.x, chunk = blockIdx.x;
  if (c >= d) return;
  float acc = 0;
  for (int64_t r = chunk * kChunkRows; r < min(rows, (chunk + 1) * kChunkRows); ++r)
    acc = fmaf(float(dy[r * d + c]), __fmul_rn(float(x[r * d + c]), rstd[r]), acc);
  partial[chunk * d + c] = acc;
}

// ---- QK-norm + RoPE fused (rmsnorm_rope_forward / _backward) --------------------------------------
// RoPE as ops/rope.cu computes it (rope_rotate): rows are (token, head) of `heads` heads; sign 1
// forward and -1 backward.
struct InvFreq {
  float v[kMaxHalf];
};
struct Rope {
  const int32_t* positions;
  const float2* cos_sin;  // rope_cos_sin_table of the positions [T, D/2], or null: computed here
  int64_t heads;
  float sign;
  InvFreq inv_freq;
};

// Layout of the fused kernels, for head_dim D = 8 G with G in {8, 16, 32} (D = 64, 128, 256): a head
// is G lanes, lane p of its group holding the 16-byte pack of elements [8p, 8p + 8), so a warp holds
// 32 / G heads at once. That is the plain kernels' layout (lane_squares<8> and dx_row<8> give pack
// p to lane p; the lanes past G add zeros first in warp_sum's tree, which leaves every sum as the
// group's own tree, xor G/2 down to 1, computes it), so rstd, dx and y keep the unfused ops' bits.
// A pack's RoPE partners (element j + D/2 for j < D/2) are the pack of lane p ^ G/2, exchanged by
// shuffle. A warp takes kHeadsPerWarp heads of one token in turn, 32 / G at a time; its lanes'
// cos/sin (8 each) are computed once. Per element this is a few instructions: a warp walking one
// head at a time, 4 elements a lane, was instruction-bound at ~1.5 TB/s.
// OwnComponent: rotate computes only the lane's own component (see rotate); the forward kernel ran
// 16% faster with it, the backward dx kernel 30% slower, so each keeps what measured best.
constexpr int64_t kHeadsPerWarp = 8;
template <int G, bool OwnComponent> struct RopeLane {
  static constexpr int kHeadsAtOnce = 32 / G;
  int lane = int(threadIdx.x % 32), pack = lane % G;
  bool first_half = pack < G / 2;
  int64_t token, begin, end;  // the warp's token and its rows [begin, end)
  bool valid;                 // token < tokens; the rest is set only then
  float2 cs[8];               // cos and sign * sin of the lane's 8 pairs, 8 (pack mod G/2) + l (see rotate)
  Pack<bf16, 8> weight;             // the norm's weight over the lane's pack
  static constexpr int kPasses = int(kHeadsPerWarp) / kHeadsAtOnce;  // passes over the warp's rows
  static constexpr int kAhead = kPasses < 4 ? kPasses : 4;            // passes loaded before the trig (registers)
  int passes = 0;                                                     // those that hold rows
  // The warp's token and rows; the cos/sin come later (trig), so that the kernels' loads are in
  // flight while they are computed (a load waited for at each pass stalled the forward 25% of its time).
  __device__ RopeLane(const Rope& rope, int64_t tokens) {
    const int64_t warp = blockIdx.x * int64_t(blockDim.x / 32) + threadIdx.x / 32;
    const int64_t groups = (rope.heads + kHeadsPerWarp - 1) / kHeadsPerWarp;
    token = warp / groups;
    begin = token * rope.heads + warp % groups * kHeadsPerWarp;
    end = min(begin + kHeadsPerWarp, (token + 1) * rope.heads);
    valid = token < tokens;
    passes = valid ? int((end - begin + kHeadsAtOnce - 1) / kHeadsAtOnce) : 0;
  }
  // From the table (rope_cos_sin's bits; the sign's product is exact) or computed.
  __device__ void trig(const Rope& rope, const bf16* norm_weight) {
    if (rope.cos_sin) {
      const float4* from = reinterpret_cast<const float4*>(rope.cos_sin + token * (4 * G) + 8 * (pack % (G / 2)));
#pragma unroll
      for (int l = 0; l < 4; ++l) {
        const float4 two = from[l];
        cs[2 * l] = make_float2(two.x, __fmul_rn(rope.sign, two.y));
        cs[2 * l + 1] = make_float2(two.z, __fmul_rn(rope.sign, two.w));
      }
    } else {
      const float position = float(rope.positions[token]);
#pragma unroll
      for (int l = 0; l < 8; ++l) cs[l] = rope_cos_sin(position, rope.inv_freq.v[8 * (pack % (G / 2)) + l], rope.sign);
    }
#pragma unroll
    for (int l = 0; l < 8; ++l)
      if (OwnComponent && first_half) cs[l].y = -cs[l].y;
    weight = load<8>(norm_weight + 8 * pack);
  }
  // The lane's row in pass p, or -1 past the warp's rows.
  __device__ int64_t row(int p) const {
    const int64_t r = begin + int64_t(p) * kHeadsAtOnce + lane / G;
    return r < end ? r : -1;
  }
  // body(row, inputs) for each pass over the warp's rows (row -1: the lane has none in this pass but
  // takes part in the shuffles), inputs = load(row) (row >= 0); the first kAhead passes are loaded
  // before the trig.
  template <class Load, class Body> __device__ void run(const Rope& rope, const bf16* norm_weight, Load load, Body body) {
    using Inputs = decltype(load(int64_t(0)));
    auto load_pass = [&](int p) {
      const int64_t r = row(p);
      return p < passes && r >= 0 ? load(r) : Inputs{};
    };
    Inputs ahead[kAhead];
#pragma unroll
    for (int p = 0; p < kAhead; ++p) ahead[p] = load_pass(p);
    trig(rope, norm_weight);
#pragma unroll
    for (int p = 0; p < kPasses; ++p) {
      if (p >= passes) break;
      body(row(p), p < kAhead ? ahead[p] : load_pass(p));
    }
  }
  // Sum over the head's G lanes, in the tree warp_sum runs over them.
  __device__ float head_sum(float v) const {
#pragma unroll
    for (int m = G / 2; m > 0; m /= 2) v += __shfl_xor_sync(0xffffffffu, v, m);
    return v;
  }
  // The partner lane's pack (elements j +- D/2 of this lane's).
  __device__ Pack<bf16, 8> partner(Pack<bf16, 8> own) const {
    uint4 bits = *reinterpret_cast<uint4*>(&own);
    bits.x = __shfl_xor_sync(0xffffffffu, bits.x, G / 2);
    bits.y = __shfl_xor_sync(0xffffffffu, bits.y, G / 2);
    bits.z = __shfl_xor_sync(0xffffffffu, bits.z, G / 2);
    bits.w = __shfl_xor_sync(0xffffffffu, bits.w, G / 2);
    return *reinterpret_cast<Pack<bf16, 8>*>(&bits);
  }
  // This lane's half of the rotation of (own, partner): rope_apply's x for the first half,
  // fmaf(own, cos, -(other * sin)), and its y for the second, fmaf(own, cos, other * sin). With
  // OwnComponent the first half's cs holds -sign * sin (negation is exact, so the bits are
  // rope_apply's) and only that component is computed; otherwise rope_apply's pair, then a select.
  __device__ Pack<bf16, 8> rotate(const Pack<bf16, 8>& own, const Pack<bf16, 8>& other) const {
    Pack<bf16, 8> out;
#pragma unroll
    for (int l = 0; l < 8; ++l) {
      if constexpr (OwnComponent) {
        out.v[l] = bf16(fmaf(float(own.v[l]), cs[l].x, __fmul_rn(float(other.v[l]), cs[l].y)));
      } else {
        // Selected as values: selecting the packs made nvcc address them in local memory.
        const float mine = float(own.v[l]), theirs = float(other.v[l]);
        const float a = first_half ? mine : theirs, b = first_half ? theirs : mine;
        const float2 o = rope_apply(a, b, cs[l]);
        out.v[l] = bf16(first_half ? o.x : o.y);
      }
    }
    return out;
  }
};
unsigned rope_blocks(int64_t tokens, int64_t heads, int64_t warps_per_block = kWarpsPerBlock) {
  return unsigned((tokens * ((heads + kHeadsPerWarp - 1) / kHeadsPerWarp) + warps_per_block - 1) / warps_per_block);
}

// y = rope(norm(x)): rstd of each head, the normalised pack rounded to bf16 (the unfused norm's
// output), rotated with its partner's.
template <int G>
__global__ void rmsnorm_rope_forward_kernel(bf16* y, float* rstd, const bf16* x, const bf16* weight, Rope rope, int64_t tokens,
                                            float eps) {
  begin_after_previous_grid();
  constexpr int64_t d = 8 * G;
  RopeLane<G, true> lane(rope, tokens);
  if (!lane.valid) return;
  auto load_row = [&](int64_t row) { return load<8>(x + row * d + 8 * lane.pack); };
  lane.run(rope, weight, load_row, [&](int64_t row, const Pack<bf16, 8>& xp) {
    float ss = 0;
#pragma unroll
    for (int l = 0; l < 8; ++l) ss = fmaf(float(xp.v[l]), float(xp.v[l]), ss);
    const float r = 1.0f / sqrtf(lane.head_sum(ss) / float(d) + eps);
    Pack<bf16, 8> normed;
#pragma unroll
    for (int l = 0; l < 8; ++l) normed.v[l] = bf16(float(xp.v[l]) * r * float(lane.weight.v[l]));
    const Pack<bf16, 8> rotated = lane.rotate(normed, lane.partner(normed));
    if (row < 0) return;
    if (lane.pack == 0) rstd[row] = r;
    store<8>(y + row * d + 8 * lane.pack, rotated);
  });
}

// dx = rmsnorm_backward(rope_backward(dy)): the lane un-rotates its pack of dy with its partner's
// (rounded to bf16 as rope_backward writes it), then dx_row's arithmetic on the pack.
// WithPartial (G <= 16, and blocks of kChunkRows rows: block b holds rows [64 b, 64 b + 64), chunk b of
// the dweight partials; see launch_rope_backward): the block also writes partial[b] as
// rmsnorm_rope_dweight_partial_kernel would, each column summed over the chunk's rows in row order from
// the block's shared copy of the un-rotated dy and of x, so dy and x are read once for both.
template <int G, bool WithPartial>
__global__ void __launch_bounds__(512) rmsnorm_rope_backward_dx_kernel(bf16* dx, float* partial, const bf16* dy, const bf16* x, const bf16* weight,
                                                const float* rstd, Rope rope, int64_t tokens) {
  begin_after_previous_grid();
  constexpr int64_t d = 8 * G;
  constexpr int kChunk = int(kChunkRows);
  __shared__ Pack<bf16, 8> u_rows[WithPartial ? kChunk : 1][WithPartial ? G : 1], x_rows[WithPartial ? kChunk : 1][WithPartial ? G : 1];
  __shared__ float rstd_rows[WithPartial ? kChunk : 1];
  RopeLane<G, false> lane(rope, tokens);
  const int64_t chunk_row0 = int64_t(blockIdx.x) * kChunkRows;
  struct Inputs {
    Pack<bf16, 8> dy, x;
    float rstd;
  };
  auto load_row = [&](int64_t row) {
    return Inputs{load<8>(dy + row * d + 8 * lane.pack), load<8>(x + row * d + 8 * lane.pack), rstd[row]};
  };
  if (lane.valid) lane.run(rope, weight, load_row, [&](int64_t row, const Inputs& in) {
    const Pack<bf16, 8>&gp = in.dy, &xp = in.x;
    const float r = in.rstd;
    const Pack<bf16, 8> u = lane.rotate(gp, lane.partner(gp));
    float dot = 0;
#pragma unroll
    for (int l = 0; l < 8; ++l) dot = fmaf(__fmul_rn(__fmul_rn(float(u.v[l]), float(lane.weight.v[l])), float(xp.v[l])), r, dot);
    const float mean = lane.head_sum(dot) / float(d);
    if (row < 0) return;
    Pack<bf16, 8> o;
#pragma unroll
    for (int l = 0; l < 8; ++l) {
      const float xhat_mean = __fmul_rn(__fmul_rn(float(xp.v[l]), r), mean);
      o.v[l] = bf16(__fmul_rn(r, fmaf(float(u.v[l]), float(lane.weight.v[l]), -xhat_mean)));
    }
    store<8>(dx + row * d + 8 * lane.pack, o);
    if constexpr (WithPartial) {
      u_rows[row - chunk_row0][lane.pack] = u;
      x_rows[row - chunk_row0][lane.pack] = xp;
      if (lane.pack == 0) rstd_rows[row - chunk_row0] = r;
    }
  });
  if constexpr (WithPartial) {
    __syncthreads();
    const int c = int(threadIdx.x);
    const int rows = int(min(kChunkRows, tokens * rope.heads - chunk_row0));
    if (c >= d || rows <= 0) return;
    float acc = 0;
    // Unrolled so that the shared loads run ahead of the chain of multiply-adds (same order).
#pragma unroll 8
    for (int r = 0; r < rows; ++r)
      acc = fmaf(float(u_rows[r][c / 8].v[c % 8]), __fmul_rn(float(x_rows[r][c / 8].v[c % 8]), rstd_rows[r]), acc);
    partial[int64_t(blockIdx.x) * d + c] = acc;
  }
}

// dweight, pass 1 of the RoPE variant where the dx kernel does not write the partials (heads neither 4
// nor a multiple of kHeadsPerWarp, or D = 256): a thread owns the column
// pair (j, j + D/2), un-rotates each
// row's pair of dy once and sums both columns in row order, as the plain pass does per column
// (unrolled as it is).
__global__ void rmsnorm_rope_dweight_partial_kernel(float* partial, const bf16* dy, const bf16* x, const float* rstd, Rope rope,
                                                    int64_t rows, int64_t d) {
  begin_after_previous_grid();
  const int64_t j = blockIdx.y * int64_t(blockDim.x) + threadIdx.x, chunk = blockIdx.x, half = d / 2;
  if (j >= half) return;
  float acc_a = 0, acc_b = 0;
  int64_t token = -1;  // the rows of one token's heads share the angle: its cos and sin are computed once
  float2 cs{};
#pragma unroll 8
  for (int64_t r = chunk * kChunkRows; r < min(rows, (chunk + 1) * kChunkRows); ++r) {
    if (r / rope.heads != token) {
      token = r / rope.heads;
      cs = rope_cos_sin(float(rope.positions[token]), rope.inv_freq.v[j], rope.sign);
    }
    // Rounded to bf16 as rope_backward writes it.
    const float2 o = rope_apply(float(dy[r * d + j]), float(dy[r * d + half + j]), cs);
    acc_a = fmaf(float(bf16(o.x)), __fmul_rn(float(x[r * d + j]), rstd[r]), acc_a);
    acc_b = fmaf(float(bf16(o.y)), __fmul_rn(float(x[r * d + half + j]), rstd[r]), acc_b);
  }
  partial[chunk * d + j] = acc_a;
  partial[chunk * d + half + j] = acc_b;
}

// dweight, pass 2: a block of 32 x 32 threads owns 32 columns; thread (column j, lane k) adds the
// chunks k, k + 32, k + 64, ... in order, then one thread per column adds the 32 sums in lane order.
// The partition depends only on the shape, so the result is the same on every run. (One thread per
// column over all chunks was a 2048-long serial chain for QK-norm's 131072 rows: ~120 us a call.)
constexpr int kReduceLanes = 32;
__global__ void rmsnorm_dweight_reduce_kernel(float* dweight, const float* partial, int64_t chunks, int64_t d) {
  begin_after_previous_grid();
  __shared__ float sums[kReduceLanes][33];  // padded: the final pass reads a column
  const int j = threadIdx.x % 32, k = threadIdx.x / 32;
  const int64_t c = blockIdx.x * 32 + j;
  float acc = 0;
  if (c < d)
    for (int64_t chunk = k; chunk < chunks; chunk += kReduceLanes) acc += partial[chunk * d + c];
  sums[k][j] = acc;
  __syncthreads();
  if (k == 0 && c < d) {
    float total = 0;
    for (int lane = 0; lane < kReduceLanes; ++lane) total += sums[lane][j];
    dweight[c] += total;
  }
}

unsigned row_blocks(int64_t n) { return unsigned((n + kWarpsPerBlock - 1) / kWarpsPerBlock); }
constexpr int64_t kStagedWarps = 4, kMaxStagedBytes = 200 << 10;  // rmsnorm_backward_dx_kernel's staged rows
constexpr unsigned kRowThreads = 32 * kWarpsPerBlock;

Rope rope_args(Tensor positions, Tensor cos_sin, int64_t heads, int64_t d, double theta, float sign) {
  Rope rope{positions.ptr<int32_t>(), static_cast<const float2*>(cos_sin.data), heads, sign, {}};
  for (int64_t j = 0; j < d / 2; ++j) rope.inv_freq.v[j] = rope_inverse_frequency(j, d, theta);
  return rope;
}

void launch_forward(Tensor y, Tensor rstd, Tensor x, NormWeight weight, double eps, Stream stream) {
  const int64_t n = x.size(0), d = x.size(1);
  if (n == 0) return;
  const auto kernel = packable(d, {y.data, x.data, weight.weight.data}) ? rmsnorm_forward_kernel<8> : rmsnorm_forward_kernel<1>;
  launch_dependent(kernel, row_blocks(n), kRowThreads, 0, stream, bf16_ptr(y), rstd.ptr<float>(), bf16_ptr(x), bf16_ptr(weight.weight),
                   norm_offset(weight), n, d, float(eps));
}

void launch_add_forward(Tensor y, Tensor sum, Tensor rstd, Tensor x, Tensor residual, NormWeight weight, double eps, Stream stream) {
  const int64_t n = x.size(0), d = x.size(1);
  if (n == 0) return;
  const auto kernel = packable(d, {y.data, sum.data, x.data, residual.data, weight.weight.data}) ? rmsnorm_add_forward_kernel<8>
                                                                                                 : rmsnorm_add_forward_kernel<1>;
  launch_dependent(kernel, row_blocks(n), kRowThreads, 0, stream, bf16_ptr(y), bf16_ptr(sum), rstd.ptr<float>(), bf16_ptr(x),
                   bf16_ptr(residual), bf16_ptr(weight.weight), norm_offset(weight), n, d, float(eps));
}

// G = D / 8 lanes per head for the fused kernels (see RopeLane): D in {64, 128, 256} with rows in
// aligned packs of 8; 0 for other head sizes (the ops then run the unfused pair).
int64_t rope_group(int64_t d, std::initializer_list<const void*> data) {
  return (d == 64 || d == 128 || d == 256) && packable(d, data) ? d / 8 : 0;
}

void launch_rope_forward(Tensor y, Tensor rstd, Tensor x, Tensor weight, Tensor positions, Tensor cos_sin, double eps, double theta,
                         int64_t group, Stream stream) {
  const int64_t tokens = x.size(0), heads = x.size(1), d = x.size(2);
  if (tokens * heads == 0) return;
  const auto kernel = group == 8 ? rmsnorm_rope_forward_kernel<8> : group == 16 ? rmsnorm_rope_forward_kernel<16> : rmsnorm_rope_forward_kernel<32>;
  launch_dependent(kernel, rope_blocks(tokens, heads), kRowThreads, 0, stream, bf16_ptr(y), rstd.ptr<float>(), bf16_ptr(x), bf16_ptr(weight),
                   rope_args(positions, cos_sin, heads, d, theta, 1.0f), tokens, float(eps));
}

// dweight += the column sums of the [chunks, d] partials that launch_partial(partial, chunks)
// writes, reduced in the fixed order of the reduce kernel.
template <class Partial> void accumulate_dweight(Tensor dweight, int64_t n, int64_t d, Stream stream, Partial launch_partial) {
  const int64_t chunks = (n + kChunkRows - 1) / kChunkRows;
  Buffer partial(DType::f32, Device::cuda, {chunks, d}, stream);
  launch_partial(partial.ptr<float>(), unsigned(chunks));
  launch_dependent(rmsnorm_dweight_reduce_kernel, unsigned((d + 31) / 32), 32 * kReduceLanes, 0, stream, dweight.ptr<float>(),
                   partial.ptr<float>(), chunks, d);
}

void launch_backward(Tensor dx, Tensor dweight, Tensor dy, Tensor x, NormWeight weight, Tensor rstd, Tensor dresidual, Stream stream) {
  const int64_t n = x.size(0), d = x.size(1);
  if (n == 0 || d == 0) return;
  // A null dresidual passes packable's alignment test. Staged: kStagedWarps rows a block, each
  // warp 3 rows of D bf16 in shared memory (48 KiB a block at D = 2,048).
  const bool packed = packable(d, {dx.data, dy.data, dresidual.data, x.data, weight.weight.data});
  const int64_t staged_bytes = kStagedWarps * 3 * d * 2;
  auto args = [&](auto kernel, unsigned blocks, unsigned threads, size_t smem) {
    launch_dependent(kernel, blocks, threads, smem, stream, bf16_ptr(dx), bf16_ptr(dy), bf16_ptr(dresidual), bf16_ptr(x),
                     bf16_ptr(weight.weight), norm_offset(weight), rstd.ptr<float>(), n, d);
  };
  if (packed && staged_bytes <= kMaxStagedBytes) {
    MARROW_CUDA_CHECK(
        cudaFuncSetAttribute(rmsnorm_backward_dx_kernel<8, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(staged_bytes)));
    args(rmsnorm_backward_dx_kernel<8, true>, unsigned((n + kStagedWarps - 1) / kStagedWarps), unsigned(32 * kStagedWarps),
         size_t(staged_bytes));
  } else {  // odd widths, or rows too long to stage (D > 17,066)
    args(rmsnorm_backward_dx_kernel<1, false>, row_blocks(n), kRowThreads, 0);
  }
  accumulate_dweight(dweight, n, d, stream, [&](float* partial, unsigned chunks) {
    launch_dependent(rmsnorm_dweight_partial_kernel, dim3(chunks, unsigned((d + 255) / 256)), 256, 0, stream, partial, bf16_ptr(dy),
                     bf16_ptr(x), rstd.ptr<float>(), n, d);
  });
}

void launch_rope_backward(Tensor dx, Tensor dweight, Tensor dy, Tensor x, Tensor weight, Tensor rstd, Tensor positions, Tensor cos_sin,
                          double theta, int64_t group, Stream stream) {
  const int64_t tokens = x.size(0), heads = x.size(1), d = x.size(2), n = tokens * heads;
  if (n == 0) return;
  const Rope rope = rope_args(positions, cos_sin, heads, d, theta, -1.0f);
  auto launch = [&](auto kernel, float* partial, int64_t warps_per_block) {
    launch_dependent(kernel, rope_blocks(tokens, heads, warps_per_block), unsigned(32 * warps_per_block), 0, stream, bf16_ptr(dx), partial,
                     bf16_ptr(dy), bf16_ptr(x), bf16_ptr(weight), rstd.ptr<float>(), rope, tokens);
  };
  // dx and the dweight partials in one pass (see the kernel) when a block can hold exactly one chunk: a
  // warp takes kHeadsPerWarp rows (heads a multiple of it) or a token's 4 heads (16 warps a block).
  const int64_t warp_rows = heads % kHeadsPerWarp == 0 ? kHeadsPerWarp : heads;
  if (group <= 16 && (warp_rows == kHeadsPerWarp || warp_rows == 4))
    return accumulate_dweight(dweight, n, d, stream, [&](float* partial, unsigned chunks) {
      const int64_t warps = kChunkRows / warp_rows;
      MARROW_CHECK(chunks == rope_blocks(tokens, heads, warps), "internal: {} dweight chunks for {} blocks", chunks,
                   rope_blocks(tokens, heads, warps));
      launch(group == 8 ? rmsnorm_rope_backward_dx_kernel<8, true> : rmsnorm_rope_backward_dx_kernel<16, true>, partial, warps);
    });
  launch(group == 8    ? rmsnorm_rope_backward_dx_kernel<8, false>
         : group == 16 ? rmsnorm_rope_backward_dx_kernel<16, false>
                       : rmsnorm_rope_backward_dx_kernel<32, false>,
         nullptr, kWarpsPerBlock);
  // A thread per column pair: blocks of at most 256, no more warps than D/2 needs (64 threads at D = 128).
  const int64_t threads = std::min<int64_t>(256, (d / 2 + 31) / 32 * 32);
  accumulate_dweight(dweight, n, d, stream, [&](float* partial, unsigned chunks) {
    launch_dependent(rmsnorm_rope_dweight_partial_kernel, dim3(chunks, unsigned((d / 2 + threads - 1) / threads)), unsigned(threads), 0,
                     stream, partial, bf16_ptr(dy), bf16_ptr(x), rstd.ptr<float>(), rope, n, d);
  });
}
#endif

// x must be [rows, dim], and so must the tensors named with it.
void expect_rows(const char* op, const Tensor& x, std::initializer_list<std::pair<const char*, const Tensor*>> like_x) {
  expect_ndim(op, "x", x, 2, "[rows, dim]");
  for (auto [name, t] : like_x) expect_shape(op, name, *t, {x.size(0), x.size(1)});
}

// An optional rope_cos_sin_table: [tokens, D/2, 2] f32 when given, on the device of x.
void expect_cos_sin(const char* op, const Tensor& cos_sin, const Tensor& x) {
  if (!cos_sin.data) return;
  expect_shape(op, "cos_sin", cos_sin, {x.size(0), x.size(2) / 2, 2});
  expect_dtype(op, "cos_sin", cos_sin, DType::f32);
  MARROW_CHECK(cos_sin.device == x.device, "{}: cos_sin must be on the device of x", op);
  MARROW_CHECK(reinterpret_cast<uintptr_t>(cos_sin.data) % 16 == 0, "{}: cos_sin must be 16-byte aligned", op);
}

}  // namespace

void rmsnorm_forward(Tensor y, Tensor rstd, Tensor x, NormWeight weight, double eps, Stream stream) {
  const char* op = "rmsnorm_forward";
  expect_rows(op, x, {{"y", &y}});
  const int64_t n = x.size(0), d = x.size(1);
  expect_shape(op, "rstd", rstd, {n});
  const Tensor& w = weight.weight;
  expect_shape(op, "weight", w, {d});
  if (on_gpu(op, {{"x", &x, DType::bf16}, {"y", &y, DType::bf16}, {"rstd", &rstd, DType::f32}, {"weight", &w, DType::bf16}}))
    MARROW_GPU_RETURN(op, stream, launch_forward(y, rstd, x, weight, eps, stream));
  with_cpu_scalar(op, x, [&](auto s) {
    using T = decltype(s);
    forward_cpu<T>(y.ptr<T>(), rstd.ptr<T>(), x.ptr<T>(), w.ptr<T>(), T(norm_offset(weight)), n, d, eps);
  });
}

void rmsnorm_add_forward(Tensor y, Tensor sum, Tensor rstd, Tensor x, Tensor residual, NormWeight weight, double eps, Stream stream) {
  const char* op = "rmsnorm_add_forward";
  expect_rows(op, x, {{"residual", &residual}, {"sum", &sum}, {"y", &y}});
  const int64_t n = x.size(0), d = x.size(1);
  expect_shape(op, "rstd", rstd, {n});
  expect_shape(op, "weight", weight.weight, {d});
  if (on_gpu(op, {{"x", &x, DType::bf16}, {"residual", &residual, DType::bf16}, {"sum", &sum, DType::bf16}, {"y", &y, DType::bf16},
                  {"rstd", &rstd, DType::f32}, {"weight", &weight.weight, DType::bf16}}))
    MARROW_GPU_RETURN(op, stream, launch_add_forward(y, sum, rstd, x, residual, weight, eps, stream));
  add(sum, x, residual, stream);
  rmsnorm_forward(y, rstd, sum, weight, eps, stream);
}

void rmsnorm_rope_forward(Tensor y, Tensor rstd, Tensor x, Tensor weight, Tensor positions, double eps, double theta,
                          Tensor cos_sin, Stream stream) {
  const char* op = "rmsnorm_rope_forward";
  expect_ndim(op, "x", x, 3, "[tokens, heads, head_dim]");
  const int64_t tokens = x.size(0), heads = x.size(1), d = x.size(2);
  MARROW_CHECK(d % 2 == 0, "{}: head_dim of x must be even, got {}", op, d);
  expect_shape(op, "y", y, {tokens, heads, d});
  expect_shape(op, "rstd", rstd, {tokens * heads});
  expect_shape(op, "weight", weight, {d});
  expect_shape(op, "positions", positions, {tokens});
  expect_dtype(op, "positions", positions, DType::i32);
  expect_cos_sin(op, cos_sin, x);
  [[maybe_unused]] const bool gpu = on_gpu(op, {{"x", &x, DType::bf16}, {"y", &y, DType::bf16}, {"rstd", &rstd, DType::f32},
                                                {"weight", &weight, DType::bf16}, {"positions", &positions, DType::i32}});
#ifdef __CUDACC__
  if (const int64_t group = gpu ? rope_group(d, {y.data, x.data, weight.data}) : 0; group > 0)
    return launch_rope_forward(y, rstd, x, weight, positions, cos_sin, eps, theta, group, stream);
#endif
  // The CPU, and head sizes the fused kernels do not take: the unfused pair, whose bits they keep.
  rmsnorm_forward(y.reshape({tokens * heads, d}), rstd, x.reshape({tokens * heads, d}), weight, eps, stream);
  rope_forward(y, y, positions, theta, stream);
}

void rmsnorm_backward(Tensor dx, Tensor dweight, Tensor dy, Tensor x, NormWeight weight, Tensor rstd, Tensor dresidual, Stream stream) {
  const char* op = "rmsnorm_backward";
  expect_rows(op, x, {{"dx", &dx}, {"dy", &dy}});
  const int64_t n = x.size(0), d = x.size(1);
  const Tensor& w = weight.weight;
  expect_shape(op, "dweight", dweight, {d});
  expect_shape(op, "weight", w, {d});
  expect_shape(op, "rstd", rstd, {n});
  const bool has_dresidual = dresidual.ndim != 0 || dresidual.data != nullptr;  // Tensor{}: none
  if (has_dresidual) expect_shape(op, "dresidual", dresidual, {n, d});
  const bool gpu = on_gpu(op, {{"x", &x, DType::bf16}, {"dx", &dx, DType::bf16}, {"dy", &dy, DType::bf16}, {"dweight", &dweight, DType::f32},
                               {"weight", &w, DType::bf16}, {"rstd", &rstd, DType::f32}});
  if (has_dresidual) on_gpu(op, {{"x", &x, DType::bf16}, {"dresidual", &dresidual, DType::bf16}});
  if (gpu) MARROW_GPU_RETURN(op, stream, launch_backward(dx, dweight, dy, x, weight, rstd, dresidual, stream));
  with_cpu_scalar(op, x, [&](auto s) {
    using T = decltype(s);
    backward_cpu<T>(dx.ptr<T>(), dweight.ptr<T>(), dy.ptr<T>(), x.ptr<T>(), w.ptr<T>(), T(norm_offset(weight)), rstd.ptr<T>(),
                    has_dresidual ? dresidual.ptr<T>() : nullptr, n, d);
  });
}

void rmsnorm_rope_backward(Tensor dx, Tensor dweight, Tensor dy, Tensor x, Tensor weight, Tensor rstd, Tensor positions,
                           double theta, Tensor cos_sin, Stream stream) {
  const char* op = "rmsnorm_rope_backward";
  expect_ndim(op, "x", x, 3, "[tokens, heads, head_dim]");
  const int64_t tokens = x.size(0), heads = x.size(1), d = x.size(2);
  MARROW_CHECK(d % 2 == 0, "{}: head_dim of x must be even, got {}", op, d);
  expect_shape(op, "dx", dx, {tokens, heads, d});
  expect_shape(op, "dy", dy, {tokens, heads, d});
  expect_shape(op, "dweight", dweight, {d});
  expect_shape(op, "weight", weight, {d});
  expect_shape(op, "rstd", rstd, {tokens * heads});
  expect_shape(op, "positions", positions, {tokens});
  expect_dtype(op, "positions", positions, DType::i32);
  expect_cos_sin(op, cos_sin, x);
  [[maybe_unused]] const bool gpu =
      on_gpu(op, {{"x", &x, DType::bf16}, {"dx", &dx, DType::bf16}, {"dy", &dy, DType::bf16}, {"dweight", &dweight, DType::f32},
                  {"weight", &weight, DType::bf16}, {"rstd", &rstd, DType::f32}, {"positions", &positions, DType::i32}});
#ifdef __CUDACC__
  if (const int64_t group = gpu ? rope_group(d, {dx.data, dy.data, x.data, weight.data}) : 0; group > 0)
    return launch_rope_backward(dx, dweight, dy, x, weight, rstd, positions, cos_sin, theta, group, stream);
#endif
  // The CPU, and head sizes the fused kernels do not take: the unfused pair, whose bits they keep.
  Buffer unrotated(x.dtype, x.device, {tokens, heads, d}, stream);
  rope_backward(unrotated, dy, positions, theta, stream);
  const Tensor rows = unrotated.view().reshape({tokens * heads, d});
  rmsnorm_backward(dx.reshape({tokens * heads, d}), dweight, rows, x.reshape({tokens * heads, d}), weight, rstd, {}, stream);
}

}  // namespace marrow
