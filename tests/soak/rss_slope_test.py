#!/usr/bin/python3
"""The soak's leak measure on drawn series (label "soak_logic" in CTest; no server).

The soak fails when the idle RSS of the second half's quiet points rises faster than the bound.
These tests pin what that measure must tell apart: a per-call leak (every interval rises) from
an allocator that grew once and stays flat (one step), the shape that failed a 120 s run at a
least-squares 6.7 MiB/min while the last five points lay within 0.3 MiB.

    /usr/bin/python3 tests/soak/rss_slope_test.py
"""
import importlib.util
import os
import random
import unittest

_spec = importlib.util.spec_from_file_location("soak_test", os.path.join(os.path.dirname(__file__), "soak_test.py"))
soak = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(soak)

SEED = int(os.environ.get("ATTNSERVE_SEED", random.SystemRandom().randrange(2**32))) % 2**32
# Six quiet points of the second half, about 9.2 s apart, as in a 120 s run.
TIMES = [64.6 + 9.23 * i for i in range(6)]
NOISE_MIB = 0.3  # the spread of flat quiet points in the runs that set the bound


class RssSlopeTest(unittest.TestCase):
    def setUp(self):
        self.rng = random.Random(SEED)

    def series(self, base, per_min, step_at=None, step_mib=0.0):
        return [(t, base + per_min * t / 60.0 + (step_mib if step_at is not None and i >= step_at else 0.0)
                 + self.rng.uniform(-NOISE_MIB, NOISE_MIB)) for i, t in enumerate(TIMES)]

    def test_the_recorded_step_is_not_a_leak(self):
        recorded = [(64.6, 108.08), (73.8, 116.17), (83.1, 115.77), (92.3, 115.77), (101.5, 115.79), (110.8, 115.53)]
        self.assertGreater(soak.slope_per_minute(recorded), soak.RSS_SLOPE_BOUND, "least squares reads it as a leak")
        self.assertLess(soak.robust_slope_per_minute(recorded), soak.RSS_SLOPE_BOUND)

    def test_a_step_at_either_end_of_a_flat_series_passes(self):
        for trial in range(50):
            step_at = self.rng.choice([1, 5])
            pts = self.series(self.rng.uniform(80, 300), 0.0, step_at, self.rng.uniform(2, 40))
            self.assertLess(soak.robust_slope_per_minute(pts), soak.RSS_SLOPE_BOUND, f"seed {SEED}: {pts}")

    def test_a_leak_at_twice_the_bound_fails(self):
        for trial in range(50):
            pts = self.series(self.rng.uniform(80, 300), 2 * soak.RSS_SLOPE_BOUND)
            self.assertGreater(soak.robust_slope_per_minute(pts), soak.RSS_SLOPE_BOUND, f"seed {SEED}: {pts}")

    def test_a_leak_with_a_step_at_either_end_still_fails(self):
        # A step of either sign: the scratch a backend keeps can also be released late in a run.
        for trial in range(50):
            pts = self.series(self.rng.uniform(80, 300), 2 * soak.RSS_SLOPE_BOUND, self.rng.choice([1, 5]),
                              self.rng.uniform(-40, 40))
            self.assertGreater(soak.robust_slope_per_minute(pts), soak.RSS_SLOPE_BOUND, f"seed {SEED}: {pts}")

    def test_too_few_points_is_not_a_pass(self):
        self.assertNotEqual(soak.robust_slope_per_minute([(0, 1), (10, 2)]),
                            soak.robust_slope_per_minute([(0, 1), (10, 2)]), "nan expected")


if __name__ == "__main__":
    unittest.main()
