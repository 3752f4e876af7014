"""The load-or-recompute split's cost model learns the prefill rate from
measured forward passes (kvhost.vllm._split)."""

import unittest

from kvhost.vllm._split import CostModel

LLAMA_BYTES_PER_TOKEN = 131072  # 32 layers x K and V x 8 heads x 128 x bf16


def model(**kw):
    return CostModel(LLAMA_BYTES_PER_TOKEN, 2.0, prefill_s_per_token=2e-5, prefill_s_per_token2=1e-9, **kw)


class PrefillScaleTest(unittest.TestCase):

    def test_a_gpu_twice_as_slow_doubles_the_modelled_compute(self):
        m = model(alpha=0.5)
        before = m.compute_s(32768, 0)
        work = [(8192, 0)]  # a chunk of prefill the model prices at ~0.2 s
        for _ in range(30):
            self.assertTrue(m.observe_compute(work, 2 * m._modelled(work)))
        self.assertAlmostEqual(m.prefill_scale, 2.0, places=3)
        self.assertAlmostEqual(m.compute_s(32768, 0), 2 * before, delta=1e-6 * before)
        self.assertEqual(m.compute_observed, 30)

    def test_a_slower_gpu_makes_the_split_load_more(self):
        # From a 2 GB/s disk a long prefix is split; where computing is
        # dearer, loading more of it pays.
        fast, slow = model(alpha=1.0), model(alpha=1.0)
        work = [(16384, 0)]
        slow.observe_compute(work, 3 * slow._modelled(work))
        k_fast = fast.split(32768 + 512, 0, 32768, 256)
        k_slow = slow.split(32768 + 512, 0, 32768, 256)
        self.assertGreater(k_slow, k_fast)

    def test_passes_the_model_prices_below_the_floor_are_ignored(self):
        cases = [  # name, work, seconds
            ("a decode step", [(32768, 32767)] * 8, 0.03),
            ("nothing computed", [(100, 100)], 0.01),
            ("no requests", [], 0.01),
            ("no time measured", [(8192, 0)], 0.0),
        ]
        for name, work, seconds in cases:
            with self.subTest(name):
                m = model()
                self.assertFalse(m.observe_compute(work, seconds))
                self.assertEqual((m.prefill_scale, m.compute_observed), (1.0, 0))

    def test_several_requests_in_a_pass_are_priced_together(self):
        m = model(alpha=1.0)
        work = [(4096, 0), (8192, 4096), (2048, 1024)]
        want = sum(m.compute_s(t, c) for t, c in work)  # one fixed cost: fixed is 0 here
        self.assertAlmostEqual(m._modelled(work), want, places=9)
        m.observe_compute(work, want / 2)
        self.assertAlmostEqual(m.prefill_scale, 0.5, places=6)


class Clock:
    """A monotonic clock the test moves."""

    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


class LoadRateRecoveryTest(unittest.TestCase):
    """A learned load rate has a way back: unmeasured, it returns to the
    configured one, so a split that stopped claiming claims again."""

    PROMPT, HIT, CHUNK = 32768 + 512, 32768, 256

    def test_a_rate_learned_in_a_slow_episode_returns_to_the_configured_one(self):
        clock = Clock()
        m = model(recover_s=30.0, clock=clock, alpha=0.5)
        for _ in range(30):
            m.observe_load(1_000_000, 1.0)  # 1 MB/s: a mount that froze
        self.assertLess(m.load_gbps, 0.01)
        self.assertEqual(m.split(self.PROMPT, 0, self.HIT, self.CHUNK), 0)  # nothing worth loading
        clock.now += 30.0
        self.assertAlmostEqual(m.load_gbps, (2.0 + 0.001) / 2, delta=0.01)  # half way back per recover_s
        clock.now += 300.0
        self.assertAlmostEqual(m.load_gbps, 2.0, delta=0.01)
        self.assertGreater(m.split(self.PROMPT, 0, self.HIT, self.CHUNK), 0)  # claims again, so loads measure again

    def test_a_measurement_after_recovery_starts_from_the_recovered_rate(self):
        clock = Clock()
        m = model(recover_s=10.0, clock=clock, alpha=0.5)
        m.observe_load(1_000_000_000, 1.0)  # 1 GB/s: half of the configured 2
        self.assertAlmostEqual(m.load_gbps, 1.5, places=6)
        clock.now += 1e6  # long unmeasured: back at 2 GB/s
        m.observe_load(4_000_000_000, 1.0)
        self.assertAlmostEqual(m.load_gbps, 3.0, places=6)  # 2 + 0.5 * (4 - 2), not 1.5 + ...

    def test_a_rate_above_the_configured_one_also_returns(self):
        clock = Clock()
        m = model(recover_s=5.0, clock=clock, alpha=1.0)
        m.observe_load(20_000_000_000, 1.0)
        self.assertAlmostEqual(m.load_gbps, 20.0, places=6)
        clock.now += 5.0
        self.assertAlmostEqual(m.load_gbps, 11.0, places=6)

    def test_recover_s_zero_keeps_the_learned_rate(self):
        clock = Clock()
        m = model(recover_s=0.0, clock=clock, alpha=1.0)
        m.observe_load(1_000_000, 1.0)
        clock.now += 1e9
        self.assertAlmostEqual(m.load_gbps, 0.001, places=9)

    def test_a_negative_recover_s_is_refused_by_name(self):
        with self.assertRaisesRegex(ValueError, "recover_s"):
            model(recover_s=-1.0)


if __name__ == "__main__":
    unittest.main()
