"""The load-or-recompute split's cost model learns the prefill rate from
measured forward passes (kvhost.vllm._split)."""

import unittest

from kvhost.vllm._split import CostModel, load_measure

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
    last good rate (the configured one where that is higher), so a split
    that stopped claiming claims again, and a healthy rate is not pulled
    down to a configured one far below it."""

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

    def test_a_rate_above_the_last_good_one_returns_to_it(self):
        clock = Clock()
        m = model(recover_s=5.0, clock=clock, alpha=1.0)
        m.observe_load(20_000_000_000, 1.0)
        self.assertAlmostEqual(m.load_gbps, 20.0, places=6)
        self.assertAlmostEqual(m.good_gbps, 11.0, places=6)  # the mean of the configured 2 and the measured 20
        clock.now += 5.0
        self.assertAlmostEqual(m.load_gbps, 15.5, places=6)  # half way back to 11
        clock.now += 1e6
        self.assertAlmostEqual(m.load_gbps, 11.0, places=6)

    def test_an_idle_spell_after_healthy_loads_keeps_the_healthy_rate_and_the_whole_claim(self):
        # A memory mount measured at 40 GB/s, then nothing loaded for a
        # long while: the rate stays near 40, where the configured 2 GB/s
        # would recompute most of a long prefix at the next request.
        clock = Clock()
        m = model(recover_s=30.0, clock=clock, alpha=0.2)
        for _ in range(50):
            m.observe_load(40_000_000_000, 1.0)
        clock.now += 1e6
        self.assertGreater(m.load_gbps, 38.0)
        self.assertEqual(m.split(self.PROMPT, 0, self.HIT, self.CHUNK), self.HIT)
        configured = model(recover_s=30.0, clock=clock)
        self.assertLess(configured.split(self.PROMPT, 0, self.HIT, self.CHUNK), self.HIT / 2)

    def test_a_freeze_after_healthy_loads_returns_to_the_healthy_rate(self):
        clock = Clock()
        m = model(recover_s=30.0, clock=clock, alpha=0.5)
        for _ in range(100):
            m.observe_load(40_000_000_000, 1.0)
        m.observe_load(1_000_000, 1.0)  # one load given up on a frozen daemon: 1 MB/s
        self.assertLess(m.load_gbps, 21.0)
        self.assertGreater(m.good_gbps, 35.0)  # one freeze barely moves the last good rate
        clock.now += 1e6
        self.assertAlmostEqual(m.load_gbps, m.good_gbps, places=6)

    def test_start_from_keeps_the_measured_rate_of_one_medium_and_drops_it_for_another(self):
        clock = Clock()
        m = model(recover_s=5.0, clock=clock, alpha=1.0)
        m.start_from(20.0)
        self.assertAlmostEqual(m.load_gbps, 20.0, places=6)
        m.observe_load(8_000_000_000, 1.0)  # measured: 8 GB/s
        m.start_from(20.0)  # a reconnection to the same mounts: the rate measured stays
        self.assertAlmostEqual(m.load_gbps, 8.0, places=6)
        clock.now += 1e6
        self.assertAlmostEqual(m.load_gbps, 20.0, places=6)  # and returns to 20 unmeasured
        for _ in range(50):
            m.observe_load(40_000_000_000, 1.0)  # a memory mount's 40 GB/s, many times
        m.start_from(2.0)  # a daemon restarted on disks: 40 GB/s is no measure of them
        self.assertAlmostEqual(m.load_gbps, 2.0, places=6)
        self.assertAlmostEqual(m.good_gbps, 2.0, places=6)
        clock.now += 3600
        self.assertAlmostEqual(m.load_gbps, 2.0, places=6)
        for bad in (0, -1.0, float("nan"), True, "20"):
            with self.assertRaisesRegex(ValueError, "load_gbps"):
                m.start_from(bad)

    def test_a_mount_that_stayed_slow_returns_to_the_configured_rate(self):
        clock = Clock()
        m = model(recover_s=30.0, clock=clock, alpha=0.2)
        for _ in range(200):
            m.observe_load(500_000_000, 1.0)  # 0.5 GB/s, below the configured 2
        self.assertLess(m.good_gbps, 0.6)
        clock.now += 1e6
        self.assertAlmostEqual(m.load_gbps, 2.0, places=6)

    def test_recover_s_zero_keeps_the_learned_rate(self):
        clock = Clock()
        m = model(recover_s=0.0, clock=clock, alpha=1.0)
        m.observe_load(1_000_000, 1.0)
        clock.now += 1e9
        self.assertAlmostEqual(m.load_gbps, 0.001, places=9)

    def test_a_negative_recover_s_is_refused_by_name(self):
        with self.assertRaisesRegex(ValueError, "recover_s"):
            model(recover_s=-1.0)


class LoadLatencyTest(unittest.TestCase):
    """The load's fixed cost is learned from each load's first layer
    group, and has a way back as the rate has."""

    def test_a_measured_latency_moves_the_model_and_the_split(self):
        clock = Clock()
        m = CostModel(LLAMA_BYTES_PER_TOKEN, 1.6, load_latency_s=0.001, prefill_s_per_token=2e-5,
                      prefill_s_per_token2=1e-9, layers=32, alpha=1.0, recover_s=30.0, clock=clock)
        before = m.split(8192 + 512, 0, 8192, 256)
        m.observe_latency(0.15)  # a cold start of 150 ms, as a buffered disk's first job showed
        self.assertAlmostEqual(m.load_latency_s, 0.15)
        self.assertEqual(m.latency_observed, 1)
        self.assertLess(m.split(8192 + 512, 0, 8192, 256), before)
        clock.now += 30.0
        self.assertAlmostEqual(m.load_latency_s, (0.15 + 0.001) / 2)  # half way back unmeasured
        clock.now += 1e6
        self.assertAlmostEqual(m.load_latency_s, 0.001)
        self.assertEqual(m.split(8192 + 512, 0, 8192, 256), before)

    def test_a_measurement_that_cannot_be_is_ignored(self):
        m = model(load_latency_s=0.002)
        for bad in (-0.1, float("inf"), float("nan")):
            m.observe_latency(bad)
        self.assertEqual((m.load_latency_s, m.latency_observed), (0.002, 0))

    def test_load_measure_takes_the_rate_after_the_first_group_and_its_excess_for_the_latency(self):
        inf, nan = float("inf"), float("nan")
        cases = [  # nbytes, seconds, first bytes, first seconds; want bytes, seconds, latency
            # 32 K on the H200: 4.23 GB in 84.2 ms, the first layer's 132 MB in 5.32
            (4.23e9, 0.0842, 0.132e9, 0.00532, 4.098e9, 0.07888, 0.00532 - 0.132e9 * 0.07888 / 4.098e9),
            # a cold disk: 150 ms to start, then 2 GB/s; two equal groups
            (2e9, 1.15, 1e9, 0.65, 1e9, 0.5, 0.15),
            # groups side by side: the first ends with the rest, nothing separates
            (2e9, 1.0, 1e9, 0.9, 2e9, 1.0, None),
            (1e9, 1.0, 1e9, 1.0, 1e9, 1.0, None),  # one group
            (1e9, 1.0, 0, 0.0, 1e9, 1.0, None),  # no first group measured
            (1e9, 1.0, 2e8, 0.0, 1e9, 1.0, None),
        ]
        for nbytes, seconds, fb, fs, want_b, want_s, want_lat in cases:
            with self.subTest(nbytes=nbytes, seconds=seconds, fb=fb, fs=fs):
                b, secs, lat = load_measure(nbytes, seconds, fb, fs)
                self.assertAlmostEqual(b, want_b, delta=want_b * 1e-9)
                self.assertAlmostEqual(secs, want_s, delta=1e-12)
                if want_lat is None:
                    self.assertIsNone(lat)
                else:
                    self.assertAlmostEqual(lat, want_lat, delta=1e-12)
                    # The model's load of these bytes takes the time they took.
                    m = model(load_latency_s=0.0, alpha=1.0, recover_s=0.0)
                    m.observe_load(b, secs)
                    m.observe_latency(lat)
                    self.assertAlmostEqual(nbytes / (m.load_gbps * 1e9) + m.load_latency_s, seconds, delta=seconds * 1e-9)
        for bad in ((1e9, inf, 2e8, 0.1), (1e9, nan, 2e8, 0.1), (1e9, 1.0, 2e8, nan)):
            with self.subTest(bad=bad):
                b, secs, lat = load_measure(*bad)
                self.assertIsNone(lat)
                # The load's own bytes and time, which observe_load then refuses where they are no number.
                self.assertEqual(b, bad[0])
                self.assertTrue(secs == bad[1] or secs != secs and bad[1] != bad[1], secs)

    def test_loads_and_passes_timed_at_no_finite_time_are_ignored(self):
        inf, nan = float("inf"), float("nan")
        m = model(alpha=1.0, recover_s=0.0)
        before = (m.load_gbps, m.good_gbps, m.prefill_scale)
        for nbytes, seconds in ((1e9, nan), (1e9, inf), (nan, 1.0), (inf, 1.0), (1e9, 1e308), (1e9, 0.0), (0, 1.0)):
            m.observe_load(nbytes, seconds)
        work = [(8192, 0)]
        for seconds in (nan, inf, 0.0, -1.0):
            self.assertFalse(m.observe_compute(work, seconds))
        self.assertEqual((m.load_gbps, m.good_gbps, m.prefill_scale, m.observed, m.compute_observed),
                         before + (0, 0))
        self.assertGreater(m.split(8192 + 512, 0, 8192, 256), 0)


class PipelineTest(unittest.TestCase):
    """The TTFT of a layer-wise load is a pipeline of layer groups: a
    group is computed once it has arrived."""

    def pipelined(self, gbps, **kw):
        kw.setdefault("layers", 32)
        return CostModel(LLAMA_BYTES_PER_TOKEN, gbps, prefill_s_per_token=2e-5, prefill_s_per_token2=1e-9, **kw)

    def test_a_slow_mount_loads_one_layer_per_job_a_fast_one_the_most(self):
        # One layer of 32 K tokens is 134 MB: 84 ms at 1.6 GB/s, 27 at 5,
        # 13 at 10, 2.7 at 50; one layer per job where it takes 25 ms.
        cases = [(1.6, 32768, 1), (1.6, 16384, 1), (1.6, 2560, 4), (5.0, 32768, 1), (10.0, 32768, 4),
                 (50.0, 32768, 4), (50.0, 8192, 4)]
        for gbps, tokens, want in cases:
            with self.subTest(gbps=gbps, tokens=tokens):
                self.assertEqual(self.pipelined(gbps, layers_per_load=4, job_s=0.025).layers_per_job(tokens), want)

    def test_one_layer_jobs_on_a_memory_mount_return_to_the_most_at_the_next_load(self):
        # From the configured 2 GB/s a 32 K load goes one layer per job;
        # measured at 11 GB/s (what one-layer jobs of unregistered tmpfs
        # files moved on the H200), a layer takes 12 ms, and the next load
        # is in groups again: the job size cannot hold the rate down.
        m = self.pipelined(2.0, layers_per_load=4, job_s=0.025, alpha=1.0, recover_s=0)
        self.assertEqual(m.layers_per_job(32768), 1)
        m.observe_load(11_000_000_000, 1.0)
        self.assertEqual(m.layers_per_job(32768), 4)

    def test_the_pipelined_ttft_lies_between_the_max_and_the_sum_of_load_and_compute(self):
        for gbps in (0.5, 2.0, 10.0, 50.0):
            for k in (256, 4096, 16384, 32768):
                with self.subTest(gbps=gbps, k=k):
                    m = self.pipelined(gbps)
                    load, comp = m.load_s(k), m.compute_s(32768 + 512, k)
                    t = m.ttft_s(32768 + 512, 0, k)
                    self.assertGreaterEqual(t, max(load, comp) * (1 - 1e-12))
                    self.assertLessEqual(t, (load + comp) * (1 + 1e-12))

    def test_even_load_and_compute_cost_about_a_group_more_with_four_layer_jobs(self):
        # Where the load and the computation of the rest are even, a job of
        # four layers leaves the GPU idle for about a group's computation.
        one, four = self.pipelined(2.0, layers_per_load=1), self.pipelined(2.0, layers_per_load=4, job_s=1.0)
        total = 32768 + 512
        k = min(range(0, 32769, 256), key=lambda k: abs(one.load_s(k) - one.compute_s(total, k)))
        comp = one.compute_s(total, k)
        self.assertLess(one.ttft_s(total, 0, k), max(one.load_s(k), comp) * 1.06)
        self.assertGreater(four.ttft_s(total, 0, k) - one.ttft_s(total, 0, k), 2 * comp / 32)

    def test_the_split_is_the_largest_boundary_within_min_gain_of_the_least_and_at_most_recomputes(self):
        import random
        r = random.Random(92)
        for _ in range(4000):
            gbps, chunk = r.choice([0.5, 1.6, 2, 10, 50, 200]), r.choice([16, 256, 512])
            prefix, suffix = r.randrange(0, 40000), r.randrange(1, 4000)
            computed = r.randrange(0, prefix + 1) // 16 * 16
            hit, total = r.randrange(computed, prefix + 1), prefix + suffix
            m = self.pipelined(gbps, layers_per_load=r.choice([1, 2, 4]), shape=r.choice(["ramp", "even"]),
                               load_latency_s=r.choice([0.0, 0.001, 0.05, 0.3]))
            k = m.split(total, computed, hit, chunk)
            first, last = (computed // chunk + 1) * chunk, min(hit, total) // chunk * chunk
            cands = [computed] + list(range(first, last + 1, chunk))
            job = last - computed  # every candidate priced with the whole hit's job size

            def ttft(c):
                return m.ttft_s(total, computed, c, job)
            limit = min(min(ttft(c) for c in cands) * (1 + m.min_gain), ttft(computed))
            self.assertIn(k, cands)
            self.assertLessEqual(ttft(k), limit * (1 + 1e-12), (gbps, chunk, total, computed, hit))
            self.assertFalse([c for c in cands if c > k and ttft(c) <= limit * (1 - 1e-12)],
                             (gbps, chunk, total, computed, hit, k))

    def test_the_split_with_a_latency_weighs_loading_nothing(self):
        # A latency puts a step up between loading nothing and the first
        # chunk: the least may be at nothing though a boundary inside is a
        # local least.
        for lat in (0.0, 0.05, 0.15, 0.5):
            with self.subTest(lat=lat):
                m = self.pipelined(1.6, load_latency_s=lat)
                k = m.split(8704, 0, 8192, 256)
                cands = range(0, 8193, 256)
                limit = min(min(m.ttft_s(8704, 0, c, 8192) for c in cands) * (1 + m.min_gain), m.ttft_s(8704, 0, 0, 8192))
                self.assertLessEqual(m.ttft_s(8704, 0, k, 8192), limit * (1 + 1e-12), k)

    def test_a_claim_is_never_priced_above_recomputing_where_the_least_is_near_it(self):
        # An H200's cold ext4 (2.17 GB/s, 295 ms to the first layer, the
        # model's prefill fitted there): the least lies at 16,640 tokens,
        # 1.01 x recomputing; the boundaries within min_gain above it
        # (17,664 chosen before) cost more than loading nothing.
        m = CostModel(LLAMA_BYTES_PER_TOKEN, 2.165, load_latency_s=0.295, prefill_s_per_token=0.0,
                      prefill_s_per_token2=2.51e-9, prefill_fixed_s=0.0055, layers=32)
        total, hit = 32768, 32256
        k = m.split(total, 0, hit, 256)
        nothing = m.ttft_s(total, 0, 0, hit)
        least = min(m.ttft_s(total, 0, c, hit) for c in range(256, hit + 1, 256))
        self.assertGreater(least, nothing * 0.98, "the case wants a least near recomputing")
        self.assertLessEqual(m.ttft_s(total, 0, k, hit), nothing * (1 + 1e-12), k)
        self.assertTrue([c for c in range(256, hit + 1, 256) if nothing < m.ttft_s(total, 0, c, hit) <= least * 1.05],
                        "min_gain alone would allow a claim above recomputing")

    def test_a_rate_margin_prices_claims_at_the_rate_less_the_margin_and_claims_less(self):
        # Call 43's cold 8 K fit (1.94 GB/s, 13 ms latency): the model's
        # least lay at 2,816 tokens, where the loads then ran at 1.6 GB/s
        # and the split took 1.04 x recomputing. Priced 15% low, the split
        # claims what a model at 85% of the rate claims, less than at the
        # rate, and never more than the hit.
        fit = dict(load_latency_s=0.0133, prefill_s_per_token=1.36e-5, prefill_s_per_token2=3.45e-9,
                   prefill_fixed_s=0.0013, layers=32)
        total, hit = 8704, 8192
        at_rate = CostModel(LLAMA_BYTES_PER_TOKEN, 1.94, **fit)
        hedged = CostModel(LLAMA_BYTES_PER_TOKEN, 1.94, rate_margin=0.15, **fit)
        lower = CostModel(LLAMA_BYTES_PER_TOKEN, 1.94 * 0.85, **fit)
        for k in (0, 1024, 2816, 8192):
            self.assertAlmostEqual(hedged.ttft_s(total, 0, k), lower.ttft_s(total, 0, k), places=12)
        self.assertEqual(hedged.split(total, 0, hit, 256), lower.split(total, 0, hit, 256))
        self.assertLess(hedged.split(total, 0, hit, 256), at_rate.split(total, 0, hit, 256))
        # The rate itself, what the jobs are sized by, is not moved.
        self.assertEqual(hedged.load_gbps, at_rate.load_gbps)
        self.assertEqual(hedged.layers_per_job(hit), at_rate.layers_per_job(hit))

    def test_bad_pipeline_options_are_refused_by_name(self):
        for key, value in (("layers", 0), ("layers_per_load", 1.5), ("shape", "odd"), ("job_s", -1),
                           ("rate_margin", 1.0), ("rate_margin", -0.1), ("rate_margin", True)):
            with self.subTest(key=key):
                with self.assertRaisesRegex(ValueError, "layer_groups" if key == "shape" else key):
                    self.pipelined(2.0, **{key: value})


PER_LAYER = LLAMA_BYTES_PER_TOKEN // 32  # one layer's bytes per token


def staged(*layers, gbps=2.0, bpt=None, **kw):
    """A cost at gbps per worker: one worker of layers[0] layers (bpt
    bytes per token, by default theirs) where layers is one number,
    else pipeline stages of those layers."""
    stages = [(PER_LAYER * n, n) for n in layers] if len(layers) > 1 else None
    return CostModel(bpt or PER_LAYER * max(layers), gbps, prefill_s_per_token=2e-5, prefill_s_per_token2=1e-9,
                     layers=max(layers), stages=stages, **kw)


class StagesSplitTest(unittest.TestCase):
    """Under pipeline parallelism every stage loads its own layers in
    parallel while the prefill runs through the stages in order: the
    split prices each stage's bytes against the computation before it."""

    PROMPT, HIT, CHUNK = 32768 + 512, 32768, 256

    def claim(self, m):
        return m.split(self.PROMPT, 0, self.HIT, self.CHUNK)

    def test_one_stage_prices_exactly_what_the_model_without_stages_does(self):
        import random
        r = random.Random(93)
        for _ in range(1500):
            gbps, chunk, layers = r.choice([0.5, 2, 10, 50]), r.choice([16, 256]), r.choice([2, 7, 32, 80])
            prefix, suffix = r.randrange(0, 40000), r.randrange(1, 4000)
            computed = r.randrange(0, prefix + 1) // 16 * 16
            hit, total = r.randrange(computed, prefix + 1), prefix + suffix
            kw = dict(load_latency_s=r.choice([0.0, 0.002]), layers_per_load=r.choice([1, 4]))
            plain = CostModel(PER_LAYER * layers, gbps, layers=layers, **kw)
            one = CostModel(PER_LAYER * layers, gbps, layers=layers, stages=[(PER_LAYER * layers, layers)], **kw)
            self.assertEqual(one.split(total, computed, hit, chunk), plain.split(total, computed, hit, chunk))
            self.assertEqual(one.ttft_s(total, computed, hit), plain.ttft_s(total, computed, hit))

    def test_claims_follow_the_slowest_stages_load_against_the_compute_before_it(self):
        # At 2 GB/s a worker's 32-layer load of 32 K tokens is slower than
        # its prefill (the split loads part); each pair: (why, the model
        # that claims fewer tokens, the one that claims more).
        cases = [
            ("three of four layers on stage 0 claim less than one of four there", staged(24, 8), staged(8, 24)),
            ("a heavier stage 0 claims less than equal stages", staged(24, 8), staged(16, 16)),
            ("stage 1's three of four layers claim less than stage 0's one priced alone", staged(8, 24), staged(8)),
            ("equal stages load in parallel: more than one worker of every layer", staged(32), staged(16, 16)),
            ("stage 1 computes after stage 0: less than one worker of half the bytes",
             staged(16, 16), staged(32, bpt=PER_LAYER * 16)),
        ]
        for why, fewer, more in cases:
            with self.subTest(why):
                self.assertLess(self.claim(fewer), self.claim(more))
                self.assertGreater(self.claim(fewer), 0)

    def test_equal_stages_hide_the_load_where_one_worker_of_every_layer_could_not(self):
        # The load is the slowest stage's, so at the rate where one worker
        # of every layer recomputes part, PP=2's stages load all of it.
        one, two = staged(32, gbps=6.0), staged(16, 16, gbps=6.0)
        self.assertLess(self.claim(one), self.HIT)
        self.assertEqual(self.claim(two), self.HIT)

    def test_the_split_under_stages_is_the_largest_boundary_within_min_gain_and_recomputes_by_brute_force(self):
        import random
        r = random.Random(193)
        for _ in range(800):
            gbps, chunk = r.choice([0.5, 2, 10, 50]), r.choice([16, 256, 512])
            layers = r.choice([(8, 24), (24, 8), (16, 16), (10, 11, 11), (1, 3)])
            prefix, suffix = r.randrange(0, 40000), r.randrange(1, 4000)
            computed = r.randrange(0, prefix + 1) // 16 * 16
            hit, total = r.randrange(computed, prefix + 1), prefix + suffix
            m = staged(*layers, gbps=gbps, load_latency_s=r.choice([0.0, 0.002]))
            k = m.split(total, computed, hit, chunk)
            first, last = (computed // chunk + 1) * chunk, min(hit, total) // chunk * chunk
            cands = [computed] + list(range(first, last + 1, chunk))
            job = max(last - computed, 0)

            def ttft(c):
                return m.ttft_s(total, computed, c, job)
            limit = min(min(ttft(c) for c in cands) * (1 + m.min_gain), ttft(computed))
            self.assertIn(k, cands)
            self.assertLessEqual(ttft(k), limit * (1 + 1e-12), (gbps, chunk, layers, total, computed, hit))
            self.assertFalse([c for c in cands if c > k and ttft(c) <= limit * (1 - 1e-12)],
                             (gbps, chunk, layers, total, computed, hit, k))

    def test_a_joined_measurement_is_taken_at_the_heaviest_stages_share(self):
        # vLLM joins the workers' reports: every stage's bytes, the slowest
        # worker's seconds. The rate is a worker's: the heaviest stage's
        # bytes over those seconds.
        cases = [  # (stages' layers, GB/s learned from 4 GB in 1 s)
            ((32,), 4.0), ((16, 16), 2.0), ((8, 24), 3.0), ((24, 8), 3.0), ((8, 8, 16), 2.0),
        ]
        for layers, want in cases:
            with self.subTest(layers=layers):
                m = staged(*layers, alpha=1.0, recover_s=0.0)
                m.observe_load(4_000_000_000, 1.0)
                self.assertAlmostEqual(m.load_gbps, want, places=9)

    def test_a_joined_forward_pass_is_taken_as_the_whole_models(self):
        # The slowest worker's pass is its stage's layers only: the whole
        # model's prefill (what the model prices) takes L / its layers.
        work = [(8192, 0)]
        for layers, share in (((32,), 1.0), ((16, 16), 2.0), ((8, 24), 32 / 24)):
            with self.subTest(layers=layers):
                m = staged(*layers, alpha=1.0)
                self.assertTrue(m.observe_compute(work, m._modelled(work) / share))
                self.assertAlmostEqual(m.prefill_scale, 1.0, places=9)

    def test_bad_stages_are_refused_by_name(self):
        for stages in ([], [(0, 4)], [(100, 0)], [(100, 1.5)], [(-1, 2)], [100], [(100, True)]):
            with self.subTest(stages=stages):
                with self.assertRaisesRegex(ValueError, "stages"):
                    CostModel(100, 2.0, stages=stages)


if __name__ == "__main__":
    unittest.main()
