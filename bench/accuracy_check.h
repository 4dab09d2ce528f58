// The benchmark's check that the backend it times computes attention: before a backend is timed,
// both exact forms of a random layer (d_model 256, 4 heads of 64, biases, GQA) answer a batch of
// a causal sequence over two key tiles and a padded cross-attention, against the float64
// reference. A device run (scripts/gpu-check.sh's bench rows) thereby checks on the device what
// the tests check on the emulation: a tensor-core fragment in the wrong lane, a bias the
// epilogue lost or a conversion that truncates is off by the answer's own size, far past
// 10 units of the math's rounding.
#pragma once

#include <string>

#include "server/backend/backend.h"
#include "server/core/math.h"

namespace attnserve {

struct AccuracyCheck {
  bool passed = false;
  std::string report;  // one line per form: its relative L2 distance and the bound
};

// The bound for `math`: 10 units of its rounding (u = 2^-24, 2^-11 for tf32 and fp16, 2^-8 for
// bf16) plus float32's 1e-4 over this depth.
double AccuracyBound(Math math);

// Both forms of the check layer on `backend`, held to `bound` (0: AccuracyBound(math)).
AccuracyCheck CheckAgainstFloat64(Backend& backend, Math math, double bound = 0);

}  // namespace attnserve
