// fp32 master weights kept as two 16-bit halves (train.master_weights = "split"): `high`, the value
// rounded to the nearest bf16, is the weight the GPU computes with; `low` the value's own low 16
// bits. Rounding went up exactly when low > 0x8000 (the top half is then high - 1), so the halves
// take the fp32 master's 4 bytes and no separate bf16 copy is needed. One kind of value cannot be
// kept: a midpoint whose lower bf16 neighbour is odd (low = 0x8000, rounded up) is stored one unit
// in the last place higher (low 0x8001): 2^-24 of the value, ~1 in 131,072 updated weights, the
// same bf16 rounding.
// That midpoint rounding makes the bench model's losses leave the fp32 master's from step 2 (MoE
// routing amplifies it); the tiny model's stay the same bits. Reference losses therefore differ by
// master (docs/performance.md, "Split master weights"). Tests: SplitF32.* (gtest), parallel_check
// under mpirun, marrow check --only elementwise rows "split"; GPU: tools/gpu_master.sh.
#pragma once
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define MARROW_SPLIT_HD __host__ __device__
#else
#define MARROW_SPLIT_HD
#endif

namespace marrow {

// The bits of an fp32 value as the split keeps them (the one kind of midpoint moved up by a unit).
MARROW_SPLIT_HD inline uint32_t split_storable(uint32_t bits) {
  return (bits & 0x1ffffu) == 0x18000u ? bits + 1 : bits;
}

// The bf16 nearest to fp32 bits (ties to even), for values that are not NaN.
MARROW_SPLIT_HD inline uint16_t split_high(uint32_t bits) { return uint16_t((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16); }

// The fp32 bits of a split value.
MARROW_SPLIT_HD inline uint32_t split_join(uint16_t high, uint16_t low) {
  return (uint32_t(low > 0x8000u ? high - 1u : high) << 16) | low;
}

// Splits fp32 bits: high and low such that split_join(high, low) == split_storable(bits).
MARROW_SPLIT_HD inline void split_bits(uint32_t bits, uint16_t& high, uint16_t& low) {
  bits = split_storable(bits);
  high = split_high(bits);
  low = uint16_t(bits & 0xffffu);
}

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace marrow
