"""KvhostTier inside vLLM's own code: vLLM's OffloadingSpecFactory builds
its TieringOffloadingSpec, whose SecondaryTierFactory loads KvhostTier from
its module path, and the tests drive vLLM's TieringOffloadingManager in the
scheduler's call order against a real kvhost daemon. No class under test is
a stand-in; only vLLM's heavy imports are shimmed (vllm_tree.py).

Needs a vLLM source tree: `make test-vllm VLLM_SRC=DIR` (or
KVHOST_VLLM_SRC=DIR); without one every test here reports itself skipped.
"""

import logging
import pathlib
import signal
import sys
import unittest

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402

import daemon as d  # noqa: E402
import vllm_tree  # noqa: E402

NO_TREE = vllm_tree.skip_reason()
LAYERS = 4
PAGE = 4096                        # bytes per layer per GPU block (one worker)
WORKER_BYTES = LAYERS * PAGE       # config.worker_kv_bytes_per_block
MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def names(n=LAYERS):
    return tuple(f"model.layers.{i}.self_attn.attn" for i in range(n))


def key(i, tag="k", group=0):
    import hashlib
    return hashlib.sha256(f"{tag}-{i}".encode()).digest() + group.to_bytes(4, "big")


@unittest.skipUnless(NO_TREE is None, NO_TREE or "")
class RealTieringCase(vllm_tree.RealCase):
    """A daemon per class; engines (vLLM managers) closed after each test."""

    def setUp(self):
        self.require_support()
        self.handles = []

    def tearDown(self):
        for h in reversed(getattr(self, "handles", [])):
            h.close()

    def engine(self, model=MODEL, tp=1, worker_bytes=WORKER_BYTES, agnostic=False, tier=None, blocks=16,
               groups=None, events=False, tiers=None, dcp=1):
        """vLLM's TieringOffloadingManager with KvhostTier as its secondary
        tier (tiers: several, each entry's options as tier's); events
        turns vLLM's KV cache events on."""
        entries = []
        for t in tiers or [tier]:
            entry = {"type": "KvhostTier", "module_path": "kvhost.vllm", "socket": self.daemon.socket}
            entry.update(t or {})
            entries.append(entry)
        h = vllm_tree.make_tiering_manager(
            self.api, num_cpu_blocks=blocks, secondary_tiers=entries,
            config_kwargs=dict(model=model, tp=tp, dcp=dcp, worker_kv_bytes_per_block=worker_bytes,
                               is_parallelism_agnostic=agnostic, enable_kv_cache_events=events,
                               groups=groups or ((names(), 16),)))
        self.handles.append(h)
        return h

    def region_warnings(self):
        """A context manager collecting the warnings vLLM's logger gives
        about its CPU region (e.g. "Failed to close mmap_obj")."""
        import contextlib

        @contextlib.contextmanager
        def collect():
            got = []

            class H(logging.Handler):
                def emit(self, rec):
                    if rec.levelno >= logging.WARNING and ("mmap" in rec.getMessage() or rec.exc_info):
                        got.append(rec.getMessage())
            h = H()
            lg = logging.getLogger("vllm")
            lg.addHandler(h)
            try:
                yield got
            finally:
                lg.removeHandler(h)
        return collect()

    def ctx(self, rid="req-0"):
        return self.api.ReqContext(req_id=rid)

    def step(self, m, sink=None):
        """The end of one scheduler step, as vLLM's connector does it."""
        m.on_schedule_end(self.api.ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
        st = m.get_stats()
        if st is not None and sink is not None:
            sink.aggregate(st)
        return st

    def rows(self, h):
        """vLLM's primary CPU region as a (num_blocks, row) uint8 array
        (dropped by the caller before the engine closes)."""
        view = h.manager.primary_tier.get_kv_memoryview()
        return np.asarray(view).view(np.uint8)

    def settle(self, m, k, ctx, sink=None):
        """lookup every step until it is neither RETRY nor HIT_PENDING."""
        R = self.api.LookupResult
        seen = []

        def ask():
            r = m.lookup(k, ctx)
            seen.append(r)
            self.step(m, sink)
            return r not in (R.RETRY, R.HIT_PENDING)
        d.wait_for(ask, what=f"a settled lookup (seen {seen[-3:]})")
        return seen

    def offload(self, h, ks, ctx, seed=0, sink=None):
        """GPU -> CPU store of ks (bytes written into the rows vLLM's
        prepare_store picked), then complete_store, which cascades the rows
        to kvhost; steps until the cascade finishes. Returns the bytes."""
        m = h.manager
        out = m.prepare_store(ks, ctx)
        self.assertIsNotNone(out)
        self.assertEqual(list(out.keys_to_store), list(ks))
        rows = self.rows(h)
        want = np.random.default_rng(seed).integers(0, 256, size=(len(ks), rows.shape[1]), dtype=np.uint8)
        for i, b in enumerate(out.store_spec.block_ids):
            rows[int(b)] = want[i]
        del rows
        m.complete_store(ks, ctx)
        d.wait_for(lambda: (self.step(m, sink), not m.has_pending_work())[1], what="the cascade to kvhost")
        return want

    def vllm_fs_dir(self, tag, n, model=MODEL, seed=0):
        """vLLM's own fs tier, for model, writes n rows (random bytes of
        seed) into a fresh root; returns the root, the keys and their rows."""
        import shutil
        import tempfile
        root = tempfile.mkdtemp(prefix="kvhost-vllm-fs-")
        self.addCleanup(shutil.rmtree, root, True)
        writer = vllm_tree.make_tiering_manager(
            self.api, num_cpu_blocks=16, secondary_tiers=[vllm_tree.fs_tier(root)],
            config_kwargs=dict(model=model, worker_kv_bytes_per_block=WORKER_BYTES,
                               is_parallelism_agnostic=False, groups=((names(), 16),)))
        self.handles.append(writer)
        ctx = self.ctx()
        writer.manager.on_new_request(ctx)
        ks = [key(i, tag) for i in range(n)]
        return root, ks, self.offload(writer, ks, ctx, seed=seed)

    def assert_round_trip(self, h, ks, ctx, seed=0):
        """ks offloaded to kvhost, vLLM's CPU tier reset, then promoted
        back: the bytes vLLM reads are those it stored."""
        want = self.offload(h, ks, ctx, seed=seed)
        h.manager.reset_cache()
        np.testing.assert_array_equal(self.promote_and_read(h, ks, ctx), want)

    def promote_and_read(self, h, ks, ctx, sink=None):
        """Lookups until HIT (a promotion from kvhost), then prepare_load:
        the bytes vLLM would copy to the GPU."""
        R = self.api.LookupResult
        m = h.manager
        for k in ks:
            self.assertEqual(self.settle(m, k, ctx, sink)[-1], R.HIT)
        spec = m.prepare_load(ks, ctx)
        rows = self.rows(h)
        got = np.stack([rows[int(b)].copy() for b in spec.block_ids])
        del rows
        m.complete_load(ks, ctx)
        return got


class FactoryAndCallOrder(RealTieringCase):

    def test_vllms_factory_builds_the_tier_as_its_secondary_tier_manager(self):
        h = self.engine()
        tiers = h.manager.secondary_tiers
        self.assertEqual(len(tiers), 1)
        self.assertIsInstance(tiers[0], self.api.SecondaryTierManager)
        self.assertEqual(type(tiers[0]).__name__, "KvhostTier")
        self.assertEqual(tiers[0].data_path, "zero-copy", "vLLM's /dev/shm region is registered")

    def test_store_cascade_reset_promotion_in_the_schedulers_order_round_trips_bytes(self):
        R = self.api.LookupResult
        h = self.engine()
        m, ctx = h.manager, self.ctx()
        m.on_new_request(ctx)
        ks = [key(i, "order") for i in range(4)]
        self.assertEqual(self.settle(m, ks[0], ctx)[-1], R.MISS)
        want = self.offload(h, ks, ctx)
        m.touch(ks, ctx)
        # vLLM's reset drains the tiers and empties its CPU tier: the next
        # hits must come from kvhost.
        m.reset_cache()
        got = self.promote_and_read(h, ks, ctx)
        np.testing.assert_array_equal(got, want)
        m.on_request_finished(ctx)
        events = list(m.take_events())
        self.assertIsInstance(events, list)
        tier = m.secondary_tiers[0]
        c = tier.counters()
        self.assertEqual(c["stored_keys"], 4)
        self.assertEqual(c["loaded_keys"], 4)

    def test_events_carry_the_locality_the_tier_was_given_as_vllms_tiers_do(self):
        # vLLM's fs and obj tiers put their locality on every event, which
        # its KV events publish: a REMOTE tier's blocks must not show as
        # local ones.
        h = self.engine(tier={"locality": "REMOTE"}, events=True)
        m, ctx = h.manager, self.ctx()
        m.on_new_request(ctx)
        ks = [key(i, "locality") for i in range(2)]
        self.offload(h, ks, ctx)
        tier = m.secondary_tiers[0]
        self.assertEqual(tier.locality, self.api.Locality.REMOTE)
        events = [e for e in tier.take_events()]
        self.assertEqual([(sorted(e.keys), e.removed) for e in events], [(sorted(ks), False)])
        self.assertEqual([e.locality for e in events], [self.api.Locality.REMOTE])

    def test_events_stay_inert_while_vllms_kv_cache_events_are_off(self):
        # vLLM's OffloadingKVEventsConfig: with enable_kv_cache_events
        # false, take_events is not drained and a tier's capture must stay
        # inert, as vLLM's own CPU and fs tiers keep theirs.
        h = self.engine()
        self.assertFalse(h.spec.kv_events_config.enable_kv_cache_events)
        m, ctx = h.manager, self.ctx()
        m.on_new_request(ctx)
        self.offload(h, [key(i, "inert") for i in range(3)], ctx)
        self.assertEqual(list(m.primary_tier.take_events()), [], "vLLM's own CPU tier is inert")
        self.assertEqual(list(m.secondary_tiers[0].take_events()), [])

    def test_context_parallelism_needs_the_engines_interleave_and_keeps_interleaves_apart(self):
        # With dcp > 1 a row holds every dcp-th run of interleave tokens,
        # and vLLM's offloading config does not carry the interleave: the
        # tier, in the scheduler, cannot read it, so it must be told.
        with self.assertRaisesRegex(ValueError, "cp_kv_cache_interleave_size"):
            self.engine(dcp=2)
        with self.assertRaisesRegex(ValueError, "cp_kv_cache_interleave_size: want an integer"):
            self.engine(dcp=2, tier={"cp_kv_cache_interleave_size": "16"})
        ns = {n: self.engine(dcp=2, tier={"cp_kv_cache_interleave_size": n}).manager.secondary_tiers[0]
              .counters()["namespace"] for n in (1, 16)}
        self.assertNotEqual(ns[1], ns[16], "engines of interleave 1 and 16 share a namespace")
        plain = self.engine().manager.secondary_tiers[0].counters()["namespace"]
        told = self.engine(tier={"cp_kv_cache_interleave_size": 16}).manager.secondary_tiers[0].counters()["namespace"]
        self.assertEqual(plain, told, "without context parallelism the interleave means nothing")

    def test_a_namespace_with_vllm_fs_is_refused_at_start(self):
        # With vllm_fs the fs tier's directory is the identity: a namespace
        # could not keep tenants apart, so it is refused, naming both.
        with self.assertRaisesRegex(ValueError, "namespace 'tenant-a' with vllm_fs"):
            self.engine(tier={"vllm_fs": True, "namespace": "tenant-a"})

    def test_a_long_uncached_prompt_costs_a_daemon_lookup_not_one_per_key(self):
        # vLLM's _maximal_prefix_lookup scans a new prompt through RETRY,
        # so its first pass queues every key; the daemon answers a prefix
        # count. The keys of the request after its first miss are answered
        # with it: asked again one round trip each (8193 for 8192 keys,
        # each carrying up to 4096: some 25 million keys), they held every
        # other request's lookups for seconds.
        R = self.api.LookupResult
        m = self.engine().manager
        ctx = self.ctx()
        m.on_new_request(ctx)
        n = 8192  # a 128k-token prompt at 16 tokens a chunk
        for k in [key(i, "long-miss") for i in range(n)]:
            self.assertEqual(m.lookup(k, ctx), R.RETRY)
        self.step(m)
        other = self.ctx("other")
        m.on_new_request(other)
        self.assertEqual(self.settle(m, key(0, "short"), other)[-1], R.MISS)
        c = m.secondary_tiers[0].counters()
        # However the lookup thread cut the scan into passes, each key is
        # asked about once (n + 1 keys, a lookup asked again aside):
        # bounded by 2n here, where one round trip per key asked 21 million.
        self.assertLessEqual(c["daemon_lookup_keys"], 2 * n,
                             f"{c['daemon_lookups']} daemon lookups asked {c['daemon_lookup_keys']} keys "
                             f"for {n} missing keys of one request and one of another")

    def test_a_miss_answers_the_rest_of_its_request_and_no_other_requests_keys(self):
        # Two requests' keys queued together: request a's keys after its
        # first miss are MISS with it; request b's, stored, still HIT.
        R = self.api.LookupResult
        a, b = self.engine(), self.engine()
        ctx = self.ctx()
        a.manager.on_new_request(ctx)
        chain = [key(i, "chain") for i in range(4)]
        other = [key(i, "other") for i in range(3)]
        self.offload(a, chain[:2] + other, ctx)
        m = b.manager
        ra, rb = self.ctx("req-a"), self.ctx("req-b")
        m.on_new_request(ra)
        m.on_new_request(rb)
        for k in chain:  # the scheduler's first pass over both
            m.lookup(k, ra)
        for k in other:
            m.lookup(k, rb)
        self.assertEqual([self.settle(m, k, ra)[-1] for k in chain], [R.HIT, R.HIT, R.MISS, R.MISS])
        self.assertEqual([self.settle(m, k, rb)[-1] for k in other], [R.HIT] * 3)

    def test_a_second_engine_of_the_same_model_loads_the_first_ones_rows(self):
        a, b = self.engine(), self.engine()
        ctx = self.ctx()
        a.manager.on_new_request(ctx)
        ks = [key(i, "share") for i in range(3)]
        want = self.offload(a, ks, ctx)
        b.manager.on_new_request(ctx)
        np.testing.assert_array_equal(self.promote_and_read(b, ks, ctx), want)


class Identity(RealTieringCase):
    """Engines whose rows have the same size but not the same meaning."""

    def stored_by(self, **kw):
        a = self.engine(**kw)
        ctx = self.ctx()
        a.manager.on_new_request(ctx)
        ks = [key(i, "ident") for i in range(4)]
        self.offload(a, ks, ctx)
        return ks

    def miss_all(self, ks, **kw):
        R = self.api.LookupResult
        b = self.engine(**kw)
        ctx = self.ctx("other")
        b.manager.on_new_request(ctx)
        for k in ks:
            self.assertEqual(self.settle(b.manager, k, ctx)[-1], R.MISS)
        return b

    def test_another_model_of_the_same_row_size_gets_miss(self):
        ks = self.stored_by()
        self.miss_all(ks, model="meta-llama/Llama-3.1-8B")
        self.miss_all(ks, model="mistralai/Mistral-7B-v0.1")

    def test_tp2_of_the_same_model_gets_miss_for_tp1_rows(self):
        ks = self.stored_by(tp=1)
        # TP=2: each worker holds half the heads, so the row (both workers'
        # slots) has the TP=1 row's size.
        b = self.miss_all(ks, tp=2, worker_bytes=WORKER_BYTES // 2)
        self.assertEqual(np.asarray(b.manager.primary_tier.get_kv_memoryview()).shape[1],
                         np.asarray(self.handles[0].manager.primary_tier.get_kv_memoryview()).shape[1])

    def test_tp_sizes_share_where_vllm_certifies_the_bytes_portable(self):
        R = self.api.LookupResult
        ks = self.stored_by(tp=1, agnostic=True)
        b = self.engine(tp=2, worker_bytes=WORKER_BYTES // 2, agnostic=True)
        ctx = self.ctx("tp2")
        b.manager.on_new_request(ctx)
        self.assertEqual(self.settle(b.manager, ks[0], ctx)[-1], R.HIT)

    def test_a_hybrid_models_groups_keep_their_own_keys(self):
        groups = ((names(2), 16), (tuple(f"model.layers.{i}.sliding" for i in range(2, 4)), 16))
        h = self.engine(groups=groups, worker_bytes=2 * PAGE)
        ctx = self.ctx()
        h.manager.on_new_request(ctx)
        ks = [key(0, "hy", group=0), key(0, "hy", group=1)]
        want = self.offload(h, ks, ctx)
        h.manager.reset_cache()
        np.testing.assert_array_equal(self.promote_and_read(h, ks, ctx), want)
        self.miss_all(ks, groups=((names(4), 16),), worker_bytes=2 * PAGE)


class StatsAndShutdown(RealTieringCase):

    def test_get_stats_every_step_for_a_thousand_steps_under_load(self):
        h = self.engine(blocks=64)
        m = h.manager
        total = self.api.OffloadingConnectorStats()
        ctx = self.ctx()
        m.on_new_request(ctx)
        stored = 0
        for n in range(1000):
            if n % 25 == 0 and stored < 32:
                ks = [key(stored, "load")]
                out = m.prepare_store(ks, ctx)
                if out is not None:
                    m.complete_store(out.keys_to_store, ctx)
                    stored += 1
            m.lookup(key(n % 40, "load"), ctx)
            self.step(m, total)
        d.wait_for(lambda: (self.step(m, total), not m.has_pending_work())[1], what="the cascades to finish")
        self.step(m, total)
        reduced = total.reduce()
        self.assertEqual(reduced["vllm:kv_offload_kvhost_stored_keys:('1:KvhostTier',)"], stored,
                         sorted(reduced))
        written = [v for k, v in reduced.items() if "write_bytes" in k and "KvhostTier" in k]
        self.assertEqual(written, [stored * m.secondary_tiers[0]._row_bytes])

    def test_two_tiers_of_one_type_report_under_vllms_own_label_for_each(self):
        # vLLM labels a secondary tier "N:type" by its place; two kvhost
        # tiers labelled by type alone would add their counters together,
        # and neither would join vLLM's own figures for it.
        h = self.engine(blocks=32, tiers=[{"namespace": "tier-one"}, {"namespace": "tier-two"}])
        m = h.manager
        total = self.api.OffloadingConnectorStats()
        ctx = self.ctx()
        m.on_new_request(ctx)
        ks = [key(i, "two-tiers") for i in range(3)]
        self.offload(h, ks, ctx, sink=total)
        d.wait_for(lambda: (self.step(m, total), not m.has_pending_work())[1], what="the cascades to finish")
        self.step(m, total)
        reduced = total.reduce()
        for i, tier in enumerate(m.secondary_tiers):
            label = f"('{i + 1}:KvhostTier',)"
            self.assertEqual(reduced.get(f"vllm:kv_offload_kvhost_stored_keys:{label}"),
                             tier.counters()["stored_keys"], sorted(reduced))
            self.assertEqual(tier.counters()["stored_keys"], len(ks), f"tier {i + 1}")
            written = [v for k, v in reduced.items() if "write_bytes" in k and label in k]
            self.assertEqual(written, [len(ks) * tier._row_bytes], sorted(reduced))
        self.assertNotIn("vllm:kv_offload_kvhost_stored_keys:('KvhostTier',)", reduced)

    def test_shutdown_leaves_vllms_region_to_close_without_a_warning(self):
        h = self.engine()
        ctx = self.ctx()
        h.manager.on_new_request(ctx)
        self.offload(h, [key(0, "bye")], ctx)
        self.handles.remove(h)
        with self.region_warnings() as warned:
            h.manager.shutdown()  # vLLM releases its memoryview and closes the mmap
        self.assertEqual(warned, [])
        h.manager = None
        h.close()


class DaemonRestart(RealTieringCase):

    def test_a_daemon_restart_under_vllms_manager_is_survived_and_its_region_closes_cleanly(self):
        # The daemon restarts (SIGTERM, then a new process on the same
        # socket and directory) while vLLM's TieringOffloadingManager runs
        # with the tier: lookups answer MISS while it is gone, the tier
        # connects again by itself, the rows stored before come back byte
        # for byte, and vLLM's region still closes without a warning.
        R = self.api.LookupResult
        h = self.engine(tier={"reconnect_s": 0.05})
        m, ctx = h.manager, self.ctx()
        m.on_new_request(ctx)
        tier = m.secondary_tiers[0]
        ks = [key(i, "restart") for i in range(3)]
        want = self.offload(h, ks, ctx)
        m.reset_cache()  # the next hits must come from kvhost
        self.daemon.halt()
        try:
            self.assertEqual(self.settle(m, key(9, "restart"), ctx)[-1], R.MISS)
            d.wait_for(lambda: not tier.counters()["connected"], what="the tier to notice the daemon left")
            self.assertEqual(self.settle(m, ks[0], ctx)[-1], R.MISS, "a lookup while the daemon is gone")
        finally:
            self.daemon.start_again()
        d.wait_for(lambda: tier.counters()["connected"], what="the tier to connect again")
        np.testing.assert_array_equal(self.promote_and_read(h, ks, ctx), want)
        self.assertEqual(tier.counters()["reconnects"], 1)
        self.handles.remove(h)
        with self.region_warnings() as warned:
            h.manager.shutdown()
        self.assertEqual(warned, [])
        h.manager = None
        h.close()


class DaemonKilled(RealTieringCase):
    """The daemon killed (SIGKILL: a crash, the OOM killer) under vLLM's
    TieringOffloadingManager with the tier's jobs in flight, then started
    again on the same socket and directory. Each engine gets a daemon of
    its own, on both data paths."""

    PATHS = ("on", "off")  # zero-copy (vLLM's /dev/shm region), and the copy through a memfd

    def engine_on_own_daemon(self, zero_copy, **tier):
        dm = d.Daemon()
        self.addCleanup(dm.stop)
        h = self.engine(tier={"socket": dm.socket, "reconnect_s": 0.05, "zero_copy": zero_copy, **tier})
        m, ctx = h.manager, self.ctx()
        m.on_new_request(ctx)
        return dm, h, m, ctx, m.secondary_tiers[0]

    def test_a_promotion_cut_by_the_kill_fails_as_vllm_expects_then_hits_resume(self):
        # vLLM's promotion job fails (success False, no key loaded): its
        # manager drops the rows it had allocated (complete_write False)
        # and the keys MISS, never a HIT over half-written rows. Once the
        # daemon is back they promote byte for byte.
        R = self.api.LookupResult
        for zc in self.PATHS:
            with self.subTest(zero_copy=zc):
                dm, h, m, ctx, tier = self.engine_on_own_daemon(zc)
                ks = [key(i, f"cut-load-{zc}") for i in range(3)]
                want = self.offload(h, ks, ctx)
                m.reset_cache()  # the next hits must come from kvhost
                d.wait_for(lambda: all(tier.lookup(k, ctx) == R.HIT for k in ks), what="the tier's HITs")
                dm.freeze()  # the promotion's load is sent and not answered
                try:
                    self.assertEqual([m.lookup(k, ctx) for k in ks], [R.HIT_PENDING] * 3)
                    stats = self.api.OffloadingConnectorStats()
                    self.step(m, stats)  # vLLM submits the promotion
                    d.wait_for(lambda: tier.counters()["inflight_jobs"] == 1, what="the load in flight")
                finally:
                    dm.halt(signal.SIGKILL)
                self.assertEqual([self.settle(m, k, ctx, stats)[-1] for k in ks], [R.MISS] * 3)
                self.step(m, stats)
                failures = {n: v for n, v in stats.reduce().items() if "promotion_job_failures" in n}
                self.assertEqual(list(failures.values()), [1], stats.reduce())
                self.assertFalse(m.has_pending_work())
                dm.start_again()
                d.wait_for(lambda: (self.settle(m, key(99, f"cut-load-{zc}"), ctx), tier.counters()["connected"])[1],
                           what="the tier to connect again")
                np.testing.assert_array_equal(self.promote_and_read(h, ks, ctx), want)

    def test_a_cascade_cut_by_the_kill_gives_vllm_its_rows_back(self):
        # The store job fails: vLLM's manager completes the cascade
        # (complete_read), so the rows it pinned for it can be evicted
        # again, and the CPU tier still serves them; the keys are simply
        # not in kvhost, and are stored by a later cascade once it is back.
        R = self.api.LookupResult
        for zc in self.PATHS:
            with self.subTest(zero_copy=zc):
                dm, h, m, ctx, tier = self.engine_on_own_daemon(zc)
                ks = [key(i, f"cut-store-{zc}") for i in range(4)]
                out = m.prepare_store(ks, ctx)
                dm.freeze()
                try:
                    m.complete_store(ks, ctx)  # the cascade is sent and not answered
                    d.wait_for(lambda: tier.counters()["inflight_jobs"] == 1, what="the store in flight")
                finally:
                    dm.halt(signal.SIGKILL)
                d.wait_for(lambda: (self.step(m), not m.has_pending_work())[1], what="vLLM to complete the cascade")
                self.assertEqual(tier.counters()["store_failed_keys"], 4)
                self.assertEqual([m.lookup(k, ctx) for k in ks], [R.HIT] * 4, "vLLM's CPU tier keeps them")
                # Every row of vLLM's region can be taken for other keys:
                # none stays pinned by the failed cascade.
                other = [key(i, f"after-{zc}") for i in range(16)]
                self.assertIsNotNone(m.prepare_store(other, ctx), "rows still pinned by the cut cascade")
                self.assertEqual(len(out.keys_to_store), 4)
                dm.start_again()
                d.wait_for(lambda: (self.settle(m, key(99, f"cut-store-{zc}"), ctx), tier.counters()["connected"])[1],
                           what="the tier to connect again")
                again = [key(i, f"again-{zc}") for i in range(2)]
                m.complete_store(other, ctx)
                d.wait_for(lambda: (self.step(m), not m.has_pending_work())[1], what="the cascades")
                want = self.offload(h, again, ctx, seed=6)
                m.reset_cache()
                np.testing.assert_array_equal(self.promote_and_read(h, again, ctx), want)

    def test_an_outage_is_logged_once_not_per_job_or_lookup(self):
        # While the daemon is away vLLM goes on: lookups, cascades. The
        # log says once that the connection is lost and once that it is
        # back, not once per job or request.
        R = self.api.LookupResult
        logger = logging.getLogger("vllm.kvhost")
        level = logger.level
        logger.setLevel(logging.INFO)
        self.addCleanup(logger.setLevel, level)
        dm, h, m, ctx, tier = self.engine_on_own_daemon("on")
        logs = d.LogRecords("vllm.kvhost")
        self.addCleanup(logs.close)
        dm.halt(signal.SIGKILL)
        try:
            for n in range(20):
                ks = [key(n, "outage")]
                self.assertEqual(self.settle(m, ks[0], ctx)[-1], R.MISS)
                self.offload(h, ks, ctx)
        finally:
            dm.start_again()
        d.wait_for(lambda: (self.settle(m, key(99, "outage"), ctx), tier.counters()["connected"])[1],
                   what="the tier to connect again")
        self.assertEqual(tier.counters()["store_failed_keys"], 20)
        # The reconnect thread logs after it swapped the connection in.
        d.wait_for(lambda: logs.has("connected to the daemon again"), what="the reconnection logged")
        self.assertEqual([logs.count("lost the daemon connection"), logs.count("connected to the daemon again")],
                         [1, 1], logs.messages)
        self.assertEqual(len(logs.messages), 2, logs.messages)


class DaemonNotUpAtStart(RealTieringCase):
    """vLLM starts before the daemon (a node booting, a DaemonSet rolled
    out after the inference pods): the engine starts without kvhost and
    takes the daemon once it answers."""

    def test_an_engine_started_before_its_daemon_runs_without_it_then_uses_it(self):
        R = self.api.LookupResult
        logger = logging.getLogger("vllm.kvhost")
        level = logger.level
        logger.setLevel(logging.INFO)
        self.addCleanup(logger.setLevel, level)
        for how, sig in (("no socket", signal.SIGTERM), ("a socket left by a killed daemon", signal.SIGKILL)):
            with self.subTest(how):
                dm = d.Daemon()
                self.addCleanup(dm.stop)
                dm.halt(sig)
                logs = d.LogRecords("vllm.kvhost")
                self.addCleanup(logs.close)
                h = self.engine(tier={"socket": dm.socket, "reconnect_s": 0.05})
                m, ctx = h.manager, self.ctx()
                m.on_new_request(ctx)
                tier = m.secondary_tiers[0]
                self.assertFalse(tier.counters()["connected"])
                # vLLM runs: its cascades to kvhost fail, its lookups miss.
                self.offload(h, [key(i, f"early-{sig}") for i in range(2)], ctx)
                self.assertEqual(tier.counters()["store_failed_keys"], 2)
                m.reset_cache()
                self.assertEqual(self.settle(m, key(0, f"early-{sig}"), ctx)[-1], R.MISS)
                dm.start_again()
                d.wait_for(lambda: tier.counters()["connected"], what="the tier to connect")
                self.assert_round_trip(h, [key(i, f"late-{sig}") for i in range(3)], ctx, seed=4)
                self.assertEqual(tier.counters()["data_path"], "zero-copy")
                # The reconnect thread logs after it swapped the connection in.
                d.wait_for(lambda: logs.has("connected to the daemon at"), what="the connection logged")
                self.assertEqual((logs.count("starting without it"), logs.count("connected to the daemon at")),
                                 (1, 1), logs.messages)
                logs.close()

    def test_reconnect_s_0_refuses_to_start_without_a_daemon(self):
        dm = d.Daemon()
        self.addCleanup(dm.stop)
        dm.halt()
        with self.assertRaisesRegex(ConnectionError, "cannot connect to the kvhost daemon"):
            self.engine(tier={"socket": dm.socket, "reconnect_s": 0})


def vllm_fs_mount(root, namespace=None):
    """The TOML of a vllm-fs mount over root (adopting the base directory
    found there), serving namespace where given."""
    toml = f'[[mount]]\npath = "{root}"\nlayout = "vllm-fs"\ncapacity = "1GiB"\n'
    if namespace is not None:
        toml += f'[mount.vllm_fs]\nnamespace = "{namespace}"\n'
    return toml


class RestartedElsewhere(RealTieringCase):
    """The daemon on the tier's socket comes back with another
    configuration: a vllm-fs mount whose namespace an operator set to the
    tier's, over another model's fs-tier directory. The Declared
    fingerprint says where the daemon serves a namespace from; the tier
    uses a connection only where that is its own rows' place."""

    OTHER = "meta-llama/Llama-3.1-8B"

    def daemon_of(self, **kw):
        dm = d.Daemon(**kw)
        self.addCleanup(dm.stop)
        return dm

    def refused_after_restart(self, tier_opts, namespace_of, tag):
        """An engine connected to a daemon restarted (SIGKILL) with
        another model's rows bound to its namespace: lookups of that
        model's keys miss, the tier stays off and says why, and a new
        engine is refused at start."""
        R = self.api.LookupResult
        logs = d.LogRecords("vllm.kvhost")
        self.addCleanup(logs.close)
        first, _, _ = self.vllm_fs_dir(f"{tag}-own", 1) if tier_opts.get("vllm_fs") else (None, None, None)
        other, ks, _ = self.vllm_fs_dir(tag, 3, model=self.OTHER, seed=7)
        dm = self.daemon_of(after_toml=vllm_fs_mount(first) if first else "")
        h = self.engine(tier={"socket": dm.socket, "reconnect_s": 0.05, **tier_opts})
        m, ctx = h.manager, self.ctx()
        m.on_new_request(ctx)
        tier = m.secondary_tiers[0]
        ns = namespace_of(tier)
        dm.halt(signal.SIGKILL)
        dm.reconfigure(after_toml=vllm_fs_mount(other, ns))
        dm.start_again()
        self.assertEqual(self.settle(m, key(99, tag), ctx)[-1], R.MISS)  # finds the connection gone
        d.wait_for(lambda: tier.counters()["connected"] or logs.has("does not serve"),
                   what="the tier to connect again or refuse the new daemon")
        self.assertEqual([self.settle(m, k, ctx)[-1] for k in ks], [R.MISS] * 3,
                         f"{self.OTHER}'s rows answered to a {MODEL} engine")
        c = tier.counters()
        self.assertFalse(c["connected"])
        self.assertEqual(c.get("reconnects", 0), 0)
        with self.assertRaisesRegex(RuntimeError, "does not serve"):
            self.engine(tier={"socket": dm.socket, **tier_opts})

    def test_another_models_directory_bound_to_the_tiers_namespace_is_refused(self):
        self.refused_after_restart({}, lambda tier: tier.counters()["namespace"], "bound")

    def test_another_models_directory_under_the_fs_tiers_namespace_is_refused(self):
        # vllm_fs: the namespace is vllm-fs:<this engine's directory>; a
        # mount set to serve it over another directory is refused too.
        self.refused_after_restart({"vllm_fs": True}, lambda tier: tier.counters()["namespace"], "fs-bound")

    def test_the_tiers_namespace_bound_to_its_own_models_directory_is_served(self):
        # What an operator may do on purpose (docs/config.md): the tier's
        # namespace served from vLLM's fs-tier directory of its model.
        root, ks, want = self.vllm_fs_dir("own", 3, seed=3)
        dm = self.daemon_of()
        h = self.engine(tier={"socket": dm.socket, "reconnect_s": 0.05})
        m, ctx = h.manager, self.ctx()
        m.on_new_request(ctx)
        tier = m.secondary_tiers[0]
        dm.halt(signal.SIGKILL)
        dm.reconfigure(after_toml=vllm_fs_mount(root, tier.counters()["namespace"]))
        dm.start_again()
        self.settle(m, key(99, "own"), ctx)
        d.wait_for(lambda: tier.counters()["connected"], what="the tier to connect again")
        np.testing.assert_array_equal(self.promote_and_read(h, ks, ctx), want)

    def test_a_daemon_restarted_on_another_directory_answers_miss_not_another_models_rows(self):
        # kvhost mounts: every file carries its namespace's fingerprint,
        # which covers the model id: another model's files under the
        # same keys are misses.
        R = self.api.LookupResult
        dm = self.daemon_of()
        a = self.engine(tier={"socket": dm.socket, "reconnect_s": 0.05})
        m, ctx = a.manager, self.ctx()
        m.on_new_request(ctx)
        ks = [key(i, "moved") for i in range(3)]
        self.offload(a, ks, ctx)
        m.reset_cache()
        dm.halt(signal.SIGKILL)
        import tempfile
        dm.reconfigure(dir=tempfile.mkdtemp(prefix="blocks-", dir=dm.tmp))
        dm.start_again()
        b = self.engine(model=self.OTHER, tier={"socket": dm.socket})
        b.manager.on_new_request(ctx)
        self.offload(b, ks, ctx, seed=9)
        tier = m.secondary_tiers[0]
        self.settle(m, key(99, "moved"), ctx)
        d.wait_for(lambda: tier.counters()["connected"], what="the tier to connect again")
        self.assertEqual([self.settle(m, k, ctx)[-1] for k in ks], [R.MISS] * 3)


class VllmFsInterop(RealTieringCase):
    """vLLM's own fs tier writes a directory; a kvhost daemon adopts it as a
    vllm-fs mount; KvhostTier (vllm_fs=true) in another engine of the same
    model loads vLLM's rows, and an engine of another model never does."""

    def test_rows_vllms_fs_tier_wrote_are_served_to_the_same_model_only(self):
        R = self.api.LookupResult
        root, ks, want = self.vllm_fs_dir("fs", 3)
        ctx = self.ctx()
        daemon = d.Daemon(after_toml=f'[[mount]]\npath = "{root}"\nlayout = "vllm-fs"\ncapacity = "1GiB"\n')
        self.addCleanup(daemon.stop)
        entry = {"socket": daemon.socket, "vllm_fs": True}
        reader = self.engine(tier=entry)
        reader.manager.on_new_request(ctx)
        np.testing.assert_array_equal(self.promote_and_read(reader, ks, ctx), want)
        for other in (dict(model="meta-llama/Llama-3.1-8B"), dict(tp=2, worker_bytes=WORKER_BYTES // 2)):
            with self.subTest(**other), self.region_warnings() as warned, \
                    self.assertRaisesRegex(RuntimeError, "no vllm-fs mount of the daemon serves this model"):
                self.engine(tier=entry, **other)
            self.assertEqual(warned, [], "a refused tier left vLLM's region exported")
        other = self.engine(model="meta-llama/Llama-3.1-8B", tier={"socket": daemon.socket})
        other.manager.on_new_request(ctx)
        for k in ks:
            self.assertEqual(self.settle(other.manager, k, ctx)[-1], R.MISS)

    def test_rows_cut_short_by_a_crash_do_not_stop_the_tier(self):
        """vLLM renames a row without fsync: a power loss can leave it
        empty. The tier still starts on the daemon that adopted the
        directory, serves the whole rows and misses the empty one."""
        import glob
        import os
        R = self.api.LookupResult
        root, ks, want = self.vllm_fs_dir("short", 3)
        (row,) = glob.glob(os.path.join(root, "*_r0", "**", ks[-1][:-4].hex() + ".bin"), recursive=True)
        os.truncate(row, 0)
        daemon = d.Daemon(after_toml=f'[[mount]]\npath = "{root}"\nlayout = "vllm-fs"\ncapacity = "1GiB"\n')
        self.addCleanup(daemon.stop)
        reader = self.engine(tier={"socket": daemon.socket, "vllm_fs": True})
        ctx = self.ctx()
        reader.manager.on_new_request(ctx)
        np.testing.assert_array_equal(self.promote_and_read(reader, ks[:-1], ctx), want[:-1])
        self.assertEqual(self.settle(reader.manager, ks[-1], ctx)[-1], R.MISS)

    def test_a_config_json_emptied_by_a_crash_does_not_stop_the_daemon(self):
        """vLLM writes its config.json in place and never reads it: a crash
        can leave it empty. A daemon with the fields configured (copied
        from that config.json before) starts, writes it again byte for
        byte, and serves vLLM's rows."""
        import glob
        import json
        import os
        root, ks, want = self.vllm_fs_dir("config", 2)
        (path,) = glob.glob(os.path.join(root, "*", "config.json"))
        with open(path, "rb") as f:
            written = f.read()
        fields = json.loads(written)
        groups = fields.pop("kv_cache_groups")
        fields["parallel_agnostic"] = fields.get("parallel_agnostic", True)
        toml = "".join(f"{k} = {json.dumps(v)}\n" for k, v in sorted(fields.items()))
        toml += "".join(f"[[mount.vllm_fs.kv_cache_groups]]\ntokens_per_block = {g['tokens_per_block']}\n"
                        f"layer_names = {json.dumps(g['layer_names'])}\n" for g in groups)
        open(path, "w").close()
        daemon = d.Daemon(after_toml=f'[[mount]]\npath = "{root}"\nlayout = "vllm-fs"\ncapacity = "1GiB"\n'
                                     f'[mount.vllm_fs]\n{toml}')
        self.addCleanup(daemon.stop)
        with open(path, "rb") as f:
            self.assertEqual(f.read(), written)
        reader = self.engine(tier={"socket": daemon.socket, "vllm_fs": True})
        ctx = self.ctx()
        reader.manager.on_new_request(ctx)
        np.testing.assert_array_equal(self.promote_and_read(reader, ks, ctx), want)

    def test_rows_of_a_model_given_by_a_long_path_are_served(self):
        """vLLM names a model given by a local path (here a Hugging Face
        cache snapshot) by that path: its fs-tier directory's name is
        longer than a daemon model id may be, and the tier declares the
        mount's default namespace, cut as the daemon cuts it."""
        model = ("/root/.cache/huggingface/hub/models--meta-llama--Llama-3.1-8B-Instruct/snapshots/"
                 "0e9e39f249a16976918f6564b8830bc894c89659")
        root, ks, want = self.vllm_fs_dir("long", 3, model=model)
        ctx = self.ctx()
        daemon = d.Daemon(after_toml=f'[[mount]]\npath = "{root}"\nlayout = "vllm-fs"\ncapacity = "1GiB"\n')
        self.addCleanup(daemon.stop)
        reader = self.engine(model=model, tier={"socket": daemon.socket, "vllm_fs": True})
        reader.manager.on_new_request(ctx)
        np.testing.assert_array_equal(self.promote_and_read(reader, ks, ctx), want)


@unittest.skipUnless(NO_TREE is None, NO_TREE or "")
class Refusal(unittest.TestCase):

    def test_a_vllm_without_the_secondary_tier_interface_is_refused_naming_the_window(self):
        api = vllm_tree.load()
        from kvhost import vllm as kv
        if api.has_transfer_job and api.has_successful_keys:
            kv.detect()  # supported: detect must not raise
            return
        with self.assertRaisesRegex(kv.UnsupportedVLLM, "supported: vLLM with the secondary-tier interface"):
            kv.detect()


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    unittest.main()
