// splitmix64: a tiny generator whose output is fixed by its definition, unlike std::
// distributions, whose output the standard leaves to each library: the layer's random weights
// (RandomLayerWeights) come out the same on every toolchain, and cheap draws by the million
// (the backend test's moved weights, the emulated device's thread orders) cost a few integer
// operations each. Its finaliser (SplitMix64Finalise) alone spreads every bit of a hash over the
// whole word (the router's sticky points).
// Thread-safety: a value; one generator per thread.
#pragma once

#include <cstdint>

namespace attnserve {

constexpr uint64_t SplitMix64Finalise(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// A UniformRandomBitGenerator: std::shuffle and the <random> distributions take it.
struct SplitMix64 {
  using result_type = uint64_t;
  uint64_t state;

  static constexpr uint64_t min() { return 0; }
  static constexpr uint64_t max() { return ~uint64_t{0}; }
  uint64_t Next() { return SplitMix64Finalise(state += 0x9e3779b97f4a7c15ULL); }
  uint64_t operator()() { return Next(); }
  // Uniform in [-1, 1).
  double Symmetric() { return static_cast<double>(Next() >> 11) * 0x1.0p-52 - 1.0; }
};

}  // namespace attnserve
