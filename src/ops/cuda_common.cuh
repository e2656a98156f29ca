// Device-side helpers the op files share; included inside their #ifdef __CUDACC__ sections.
// Dependent launch hides ~2 us before a small kernel but nearly nothing before a large one that
// needs a whole SM: a GEMM waits for the SM to empty either way (docs/performance.md).
// `cond ? pack_a.v[l] : pack_b.v[l]` on two register arrays makes nvcc take their addresses, so both
// go to local memory (STL/LDL in the SASS, "stack" in -Xptxas -v): convert both elements first,
// then select the values (rmsnorm.cu does).
#pragma once
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <utility>

#include "core/cuda_check.h"
#include "core/tensor.h"
#include "ops/launch.h"

namespace marrow {

using bf16 = __nv_bfloat16;

// A bf16 tensor's data as the kernels take it (null for an absent tensor).
inline bf16* bf16_ptr(const Tensor& t) { return static_cast<bf16*>(t.data); }

// The CUDA stream of a Marrow Stream (or of a cudaStream_t, itself): the launchers take either.
inline cudaStream_t cuda_stream(Stream stream) { return static_cast<cudaStream_t>(stream.handle); }
inline cudaStream_t cuda_stream(cudaStream_t stream) { return stream; }

// Programmatic dependent launch (Hopper): a kernel launched with launch_dependent may be scheduled
// onto the SMs while the kernel before it in the stream runs its last wave, which hides part of each
// kernel boundary (~2 us before a small kernel; -1.0 ms a bench step for the memory-bound ones, little
// more for the large kernels, which wait for whole SMs either way: docs/performance.md). Such a kernel
// must call begin_after_previous_grid() before its first memory access, reads and writes alike: it
// waits until the previous grid has completed and its writes are visible (so the order is what a
// plain launch gives), then lets the next dependent grid be scheduled once all of this grid's blocks
// have started. In a kernel launched plainly (ops/launch.h: train.dependent_launch=false) both are
// no-ops.
__device__ __forceinline__ void begin_after_previous_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// A checked launch of kernel, as a programmatic dependent (see above) when `dependent` and the
// setting allow it; launch_dependent and launch_plain below name the two cases.
template <typename... Params, typename... Args>
void launch_kernel(bool dependent, void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t stream,
                   Args&&... args) {
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  config.attrs = &attribute;
  config.numAttrs = dependent && dependent_launch() ? 1 : 0;
  MARROW_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}
template <typename Kernel, typename S, typename... Args>
void launch_dependent(Kernel kernel, dim3 grid, dim3 block, size_t shared_bytes, S stream, Args&&... args) {
  launch_kernel(true, kernel, grid, block, shared_bytes, cuda_stream(stream), std::forward<Args>(args)...);
}
// For kernels that do not call begin_after_previous_grid.
template <typename Kernel, typename S, typename... Args>
void launch_plain(Kernel kernel, dim3 grid, dim3 block, size_t shared_bytes, S stream, Args&&... args) {
  launch_kernel(false, kernel, grid, block, shared_bytes, cuda_stream(stream), std::forward<Args>(args)...);
}

// Blocks of `threads` for a grid-stride loop over n items, at most `cap` (and at least one).
inline unsigned grid_stride_blocks(int64_t n, int threads, int64_t cap) {
  return unsigned(std::max<int64_t>(1, std::min<int64_t>((n + threads - 1) / threads, cap)));
}

// Rows of `row_elements` bf16 values move in 16-byte packs of 8 when the row length allows it and
// every pointer is 16-byte aligned; otherwise kernels take their one-element path.
inline bool packable(int64_t row_elements, std::initializer_list<const void*> ptrs) {
  uintptr_t bits = 0;
  for (const void* p : ptrs) bits |= reinterpret_cast<uintptr_t>(p);
  return row_elements % 8 == 0 && bits % 16 == 0;
}

// N elements loaded and stored as one piece: 16-byte accesses (two for 8 floats).
template <typename T, int N> struct alignas(sizeof(T) * N < 16 ? sizeof(T) * N : 16) Pack {
  T v[N];
};
template <int N, typename T> __device__ __forceinline__ Pack<T, N> load(const T* p) { return *reinterpret_cast<const Pack<T, N>*>(p); }
template <int N, typename T> __device__ __forceinline__ void store(T* p, const Pack<T, N>& v) { *reinterpret_cast<Pack<T, N>*>(p) = v; }

__device__ __forceinline__ uint32_t smem_address(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

// 16 bytes global -> shared without a register round trip; valid = false writes 16 zero bytes.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid = true) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_address(smem)), "l"(gmem), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Waits until at most N of this thread's committed groups are still in flight.
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// Butterfly sum: every lane adds the same values in the same tree, so all lanes hold one result.
template <typename T> __device__ T warp_sum(T v) {
  for (int m = 16; m > 0; m /= 2) v += __shfl_xor_sync(0xffffffffu, v, m);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int m = 16; m > 0; m /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, m));
  return v;
}

// One RoPE pair (a, b) = (x[j], x[j + D/2]) rotated by sign * position * inv_freq (ops/rope.h): the
// angle in f32, the precise cosine and sine, and every rounding written out. A product left to the
// compiler may be contracted into an fma one way in one kernel and another way in the next (it
// was: rope.cu's kernel and the fused QK-norm's differed); rope.cu and rmsnorm.cu's fused QK-norm
// both rotate here, so they give the same bits.
// (cos, sign * sin) of a pair's angle, and the rotation by them: rope_rotate split so that a kernel
// can reuse the angle of one token across its heads (the same bits).
// sincosf gives cosf's and sinf's values from one argument reduction and one pair of polynomials;
// nvcc does not merge a cosf and a sinf of the same angle (they cost twice the instructions).
__device__ inline float2 rope_cos_sin(float position, float inv_freq, float sign) {
  const float angle = __fmul_rn(position, inv_freq);
  float sine = 0, cosine = 0;
  sincosf(angle, &sine, &cosine);
  return make_float2(cosine, __fmul_rn(sign, sine));
}
__device__ inline float2 rope_apply(float a, float b, float2 cs) {
  return make_float2(fmaf(a, cs.x, -__fmul_rn(b, cs.y)), fmaf(b, cs.x, __fmul_rn(a, cs.y)));
}
__device__ inline float2 rope_rotate(float a, float b, float position, float inv_freq, float sign) {
  return rope_apply(a, b, rope_cos_sin(position, inv_freq, sign));
}

}  // namespace marrow
