// What the own wgmma attention's two kernel files share (attention_hopper.cu: the forward and the
// entry points; attention_hopper_backward.cu: the backward): sizes, PTX wrappers beyond
// ops/wgmma.cuh, the rows a call covers, and the launchers each file defines. CUDA builds only.
// Invariants: head_dim 128 (kDim), key blocks of 128 rows, query blocks of 64 (the backward) or 128
// (the forward); every shared tile is a [rows][64 dims] box in TMA's 128-byte swizzle from a
// 1024-byte aligned base.
// Gotcha: a function-local static keyed by a kernel template's *type* runs once for all of its
// instances (they share a type), so allow_shared_memory takes the kernel itself as its template
// parameter: each instance gets its cudaFuncSetAttribute.
#pragma once
#include <cstdint>

#include "core/tensor.h"
#include "ops/attention.h"
#include "ops/wgmma.cuh"

namespace marrow::hopper_attention {

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
using wgmma::mma_m64n128k16_rs;
using wgmma::mma_m64n128k16_ss;
using wgmma::mma_m64n64k16;
using wgmma::mma_wait;
using wgmma::tensor_map;
using wgmma::tma_load_2d;

constexpr int kDim = 128, kKeys = 128, kQueries = 64;
constexpr int kThreads = 384;  // a producer warpgroup (loads; the backward's dQ writer) and two consumer warpgroups
constexpr float kLog2e = 1.4426950408889634f;

__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
// Generic-proxy shared memory writes made visible to the async proxy (wgmma, bulk copies).
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// 2^x by the special-function unit alone (flushes subnormal results to 0; exp2f adds a range test
// and two multiplies around the same instruction, a third of the softmax's arithmetic).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// A [B * S, heads * 128] bf16 tensor as TMA boxes of 64 dims x box_rows rows.
inline CUtensorMap rows_map(const Tensor& t, int64_t heads, int box_rows) {
  const cuuint64_t dims[2] = {cuuint64_t(heads * kDim), cuuint64_t(t.size(0) * t.size(1))}, strides[1] = {cuuint64_t(heads * kDim * 2)};
  const cuuint32_t box[2] = {64, cuuint32_t(box_rows)};
  return tensor_map(t.data, 2, dims, strides, box);
}

// A kernel's dynamic shared memory past the default 48 KiB, set once (see the gotcha above).
template <auto kernel> void allow_shared_memory(int bytes) {
  static const bool done = [&] {
    MARROW_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    return true;
  }();
  (void)done;
}

// The rows a call covers: q's and k's rows per batch row, and the ranges of them that meet. The
// causal op is the causal block over all rows.
struct Geometry {
  int64_t batch, q_seq, k_seq, q_heads, kv_heads;
  int64_t q_first, q_rows, k_first, k_rows;
  bool full;
};

// The backward timeline's fields per item (globaltimer ns but head, key block and SM).
enum TimelineField { kStart, kWalkEnd, kKvWait, kEnd, kDqWait, kDqEnd, kHead, kKeyBlock, kSm, kTimelineFields };

// out (bf16) and lse (f32) at the block's rows.
void run_forward(Tensor out, Tensor lse, Tensor q, Tensor k, Tensor v, const Geometry& g, Stream stream);
// add: the block's gradients (those `grads` names) added into f32 dq, dk, dv at its rows; else all
// three rounded to bf16 (the causal op). timeline: kTimelineFields per item, or null.
void run_backward(Tensor dq, Tensor dk, Tensor dv, Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, const Geometry& g,
                  bool add, AttentionGrads grads, int64_t* timeline, Stream stream);

}  // namespace marrow::hopper_attention
