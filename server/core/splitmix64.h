// splitmix64: a tiny generator whose output is fixed by its definition, unlike std::
// distributions, whose output the standard leaves to each library: the layer's random weights
// (RandomLayerWeights) come out the same on every toolchain, and cheap draws by the million
// (the backend test's moved weights) cost a few integer operations each.
// Thread-safety: a value; one generator per thread.
#pragma once

#include <cstdint>

namespace attnserve {

struct SplitMix64 {
  uint64_t state;
  uint64_t Next() {
    uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  // Uniform in [-1, 1).
  double Symmetric() { return static_cast<double>(Next() >> 11) * 0x1.0p-52 - 1.0; }
};

}  // namespace attnserve
