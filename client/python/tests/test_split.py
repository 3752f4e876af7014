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


if __name__ == "__main__":
    unittest.main()
