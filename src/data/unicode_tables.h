// The Unicode data behind NFC (unicode.cpp), generated into unicode_tables.cpp by
// tools/gen_unicode_tables.py.
#pragma once
#include <cstdint>

namespace marrow::unicode {

// code -> first [second]; second == 0 for a singleton. composes: the pair is a primary composite,
// i.e. NFC recomposes it (false for composition exclusions and singletons).
struct CanonicalDecomposition {
  uint32_t code, first, second;
  uint8_t composes;
};

struct CombiningClassRange {
  uint32_t first, last;
  uint8_t combining_class;
};

extern const CanonicalDecomposition kDecompositions[2061];
extern const CombiningClassRange kCombiningClasses[382];

}  // namespace marrow::unicode
