// fp32 master weights kept as two 16-bit halves (train.master_weights = "split"): `high`, the value
// rounded to the nearest bf16 (ties to even), is the weight the GPU computes with; `low` is the
// value's own low 16 bits. Rounding went up exactly when low > 0x8000, so the value's top half is
// high - 1 then, else high; the two halves together take the 4 bytes of the fp32 master alone, and
// the separate bf16 copy of the weights (2 bytes a parameter, written by every AdamW step) is gone.
//
// One kind of value cannot be kept: a midpoint between two bf16 values whose lower one is odd
// (low = 0x8000, rounded up to the even one). It shares (high, low) with the midpoint above that
// even value, which rounds down, so it is stored one unit in the last place higher (low 0x8001):
// 2^-24 of the value, in ~1 of 131,072 updated weights, and its bf16 rounding is the same.
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
