// Device-side helpers the op files share; included inside their #ifdef __CUDACC__ sections.
#pragma once
#include <cstdint>
#include <initializer_list>

namespace marrow {

// Rows of `row_elements` bf16 values move in 16-byte packs of 8 when the row length allows it and
// every pointer is 16-byte aligned; otherwise kernels take their one-element path.
inline bool packable(int64_t row_elements, std::initializer_list<const void*> ptrs) {
  uintptr_t bits = 0;
  for (const void* p : ptrs) bits |= reinterpret_cast<uintptr_t>(p);
  return row_elements % 8 == 0 && bits % 16 == 0;
}

// Butterfly sum: every lane adds the same values in the same tree, so all lanes hold one result.
template <typename T> __device__ T warp_sum(T v) {
  for (int m = 16; m > 0; m /= 2) v += __shfl_xor_sync(0xffffffffu, v, m);
  return v;
}

}  // namespace marrow
