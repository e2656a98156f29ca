// Two wgmmas on one accumulator; with HAZARD defined the accumulator is written between them, while
// the first may be in flight, so ptxas must serialise them. tests/nvcc_guard/run.sh compiles both
// forms through tools/nvcc_guard.sh, which must pass the clean one and refuse the other.
#include <cstdint>

__global__ void serialized(float* out, uint64_t a_desc, uint64_t b_desc) {
  float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
  asm volatile("wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0, %1, %2, %3}, %4, %5, 1, 1, 1, 0, 0;"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "l"(a_desc), "l"(b_desc));
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
#ifdef HAZARD
  d[0] += 1.0f;  // before the wait
#endif
  asm volatile("wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0, %1, %2, %3}, %4, %5, 1, 1, 1, 0, 0;"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "l"(a_desc), "l"(b_desc));
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
  for (int i = 0; i < 4; ++i) out[threadIdx.x * 4 + i] = d[i];
}
