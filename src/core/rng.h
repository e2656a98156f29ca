// Counter-based random numbers (Philox4x32-10, Salmon et al., SC'11). A draw is a pure function of
// (key, counter), so the CPU and every GPU thread compute the same value for the same element with
// no shared state: initial weights depend only on (seed, canonical tensor name, element index),
// whatever device or parallel layout produces them.
#pragma once
#include <cmath>
#include <cstdint>
#include <string_view>

#if defined(__CUDACC__)
#define MARROW_HD __host__ __device__
#else
#define MARROW_HD
#endif

namespace marrow {

struct Philox {
  uint32_t key0, key1;

  MARROW_HD static void mulhilo(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
    uint64_t p = uint64_t(a) * b;
    hi = uint32_t(p >> 32);
    lo = uint32_t(p);
  }

  // Four 32-bit random words for the 128-bit counter (c0, c1, c2, c3).
  MARROW_HD void operator()(uint32_t c[4]) const {
    uint32_t k0 = key0, k1 = key1;
    for (int round = 0; round < 10; ++round) {
      uint32_t hi0, lo0, hi1, lo1;
      mulhilo(0xD2511F53u, c[0], hi0, lo0);
      mulhilo(0xCD9E8D57u, c[2], hi1, lo1);
      uint32_t n0 = hi1 ^ c[1] ^ k0, n2 = hi0 ^ c[3] ^ k1;
      c[0] = n0;
      c[1] = lo1;
      c[2] = n2;
      c[3] = lo0;
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
  }

  // A standard normal for element `index` of stream `stream` (Box-Muller on two words).
  MARROW_HD float normal(uint64_t index, uint32_t stream = 0) const {
    uint32_t c[4] = {uint32_t(index), uint32_t(index >> 32), stream, 0x4D415252u};
    (*this)(c);
    double u1 = (double(c[0]) + 1.0) / 4294967296.0;  // (0, 1]: log never sees 0
    double u2 = double(c[1]) / 4294967296.0;
    return float(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
  }

  // A uniform float in [0, 1) for element `index`.
  MARROW_HD float uniform(uint64_t index, uint32_t stream = 0) const {
    uint32_t c[4] = {uint32_t(index), uint32_t(index >> 32), stream, 0x554E4946u};
    (*this)(c);
    return float(c[0] >> 8) * (1.0f / 16777216.0f);
  }
};

// FNV-1a: a stable 64-bit hash of a tensor name, folded with the seed into a Philox key.
inline uint64_t name_hash(std::string_view name) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (char ch : name) h = (h ^ uint8_t(ch)) * 0x100000001b3ull;
  return h;
}

inline Philox philox_for(uint64_t seed, std::string_view name) {
  uint64_t k = name_hash(name) ^ (seed * 0x9E3779B97F4A7C15ull);
  return Philox{uint32_t(k), uint32_t(k >> 32)};
}

}  // namespace marrow
