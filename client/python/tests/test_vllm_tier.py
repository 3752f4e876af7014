"""KvhostTier driven in vLLM's call order against a real kvhost daemon.

Run: cd client/python && PYTHONPATH=src /usr/bin/python3 -m unittest discover -s tests
"""

import dataclasses
import gc
import importlib.util
import mmap
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import unittest
from unittest import mock

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402

import kvhost  # noqa: E402
from kvhost import vllm as kv  # noqa: E402

import daemon as d  # noqa: E402
import vllm_standins as S  # noqa: E402

HAVE_TORCH = importlib.util.find_spec("torch") is not None
Tier = kv.tier_class(S.API)
CTX = S.ReqContext(req_id="req-0")
ROW = 16 << 10  # bytes per row (one offload key)
ROWS = 32


def random_region(rows=ROWS, row=ROW, seed=0):
    return np.random.default_rng(seed).integers(0, 256, size=(rows, row), dtype=np.uint8)


def keys(n, prefix="k", group=0):
    return [S.offload_key((prefix, i), group) for i in range(n)]


class TierCase(unittest.TestCase):
    """A daemon per test class; tiers are shut down after each test."""

    @classmethod
    def setUpClass(cls):
        cls.daemon = d.Daemon()

    @classmethod
    def tearDownClass(cls):
        cls.daemon.stop()

    def setUp(self):
        self.tiers = []
        self.next_job = 0

    def tearDown(self):
        for t in self.tiers:
            t.shutdown()

    def tier(self, region, spec=None, **own):
        # vLLM's KV cache events on: these tests read the tier's events
        # (with them off it keeps none: test_vllm_real_tier).
        own.setdefault("socket", self.daemon.socket)
        t = Tier(offloading_spec=spec or S.fake_spec(enable_kv_cache_events=True), primary_kv_view=memoryview(region),
                 tier_type="KvhostTier", **own)
        self.tiers.append(t)
        return t

    def job(self, ks, rows, promotion=False):
        self.next_job += 1
        return S.TransferJob(job_id=self.next_job, keys=list(ks),
                             block_ids=np.asarray(rows, dtype=np.int64),
                             is_promotion=promotion, req_context=CTX)

    def finished(self, tier, n):
        """Polls get_finished_jobs (as vLLM does every step) until n results."""
        got = []
        d.wait_for(lambda: got.extend(tier.get_finished_jobs()) or len(got) >= n,
                   what=f"{n} finished jobs")
        self.assertEqual(len(got), n, got)
        return {r.job_id: r for r in got}

    def lookup_settled(self, tier, key):
        """Asks like vLLM's scheduler each step: RETRY until the answer comes."""
        seen = []

        def ask():
            r = tier.lookup(key, CTX)
            seen.append(r)
            return r is not S.LookupResult.RETRY
        d.wait_for(ask, what="a lookup answer")
        return seen

    def store(self, tier, ks, rows):
        j = self.job(ks, rows)
        tier.submit_store(j)
        res = self.finished(tier, 1)[j.job_id]
        self.assertTrue(res.success, res)
        return res


class StoreLookupPromote(TierCase):

    def test_store_cascade_then_retry_then_hit_then_promotion_matches_row_for_row(self):
        region = random_region()
        ks = keys(8)
        writer = self.tier(region)
        res = self.store(writer, ks, range(8))
        self.assertEqual(list(res.successful_keys), ks)
        events = writer.take_events()
        self.assertEqual([(list(e.keys), e.removed, e.medium) for e in events],
                         [(ks, False, S.Medium.STORAGE)])

        # Another engine of the same model on the node: it has not seen the
        # keys, so its first lookup is RETRY, then HIT from the daemon.
        other = random_region(seed=1)
        other[:] = 0
        reader = self.tier(other)
        seen = self.lookup_settled(reader, ks[0])
        self.assertEqual(seen[0], S.LookupResult.RETRY)
        self.assertEqual(seen[-1], S.LookupResult.HIT)
        for k in ks[1:]:
            self.assertEqual(self.lookup_settled(reader, k)[-1], S.LookupResult.HIT)

        dst = list(range(20, 28))
        j = self.job(ks, dst, promotion=True)
        reader.submit_load(j)
        res = self.finished(reader, 1)[j.job_id]
        self.assertTrue(res.success, res)
        self.assertEqual(list(res.successful_keys), ks)
        for i, r in enumerate(dst):
            np.testing.assert_array_equal(other[r], region[i], err_msg=f"row {r} (key {i})")
        untouched = [r for r in range(ROWS) if r not in dst]
        self.assertFalse(other[untouched].any(), "a row outside the promotion was written")
        st = reader.counters()
        self.assertEqual((st["loaded_keys"], st["bytes_loaded"], st["data_path"]), (8, 8 * ROW, "copy"))

    def test_lookup_of_a_key_never_stored_is_retry_then_miss(self):
        t = self.tier(random_region())
        seen = self.lookup_settled(t, S.offload_key("never stored"))
        self.assertEqual((seen[0], seen[-1]), (S.LookupResult.RETRY, S.LookupResult.MISS))

    def test_lookup_while_the_key_is_being_stored_is_retry(self):
        import threading
        t = self.tier(random_region())
        gate = threading.Event()
        transfer = t._transfer
        t._transfer = lambda *a: gate.wait() and transfer(*a)  # hold the daemon job
        ks = keys(4, "busy")
        j = self.job(ks, range(4))
        t.submit_store(j)
        for k in ks:
            self.assertEqual(t.lookup(k, CTX), S.LookupResult.RETRY)
        self.assertTrue(t.has_pending_work())
        gate.set()
        self.assertTrue(self.finished(t, 1)[j.job_id].success)
        self.assertEqual([t.lookup(k, CTX) for k in ks], [S.LookupResult.HIT] * 4)

    def test_a_key_longer_than_the_daemon_allows_is_stored_under_its_digest(self):
        region = random_region()
        t = self.tier(region)
        long_key = b"x" * 100
        self.store(t, [long_key], [3])
        region2 = np.zeros_like(region)
        t2 = self.tier(region2)
        self.assertEqual(self.lookup_settled(t2, long_key)[-1], S.LookupResult.HIT)
        j = self.job([long_key], [5], promotion=True)
        t2.submit_load(j)
        self.assertTrue(self.finished(t2, 1)[j.job_id].success)
        np.testing.assert_array_equal(region2[5], region[3])

    def test_touch_counts_as_an_access_on_the_daemon(self):
        t = self.tier(random_region())
        ks = keys(3, "touch")
        self.store(t, ks, range(3))
        checker = kvhost.Client(self.daemon.socket)
        self.addCleanup(checker.close)
        hits = checker.stats()["hits"]
        t.touch(ks, CTX)
        d.wait_for(lambda: checker.stats()["hits"] >= hits + 3, what="3 lookup hits from touch")


    def test_touching_keys_already_queued_queues_them_once(self):
        # vLLM touches a request's keys each time it polls its lookups;
        # while the lookup thread waits on the daemon, touches of the same
        # keys pile up as one entry, not one per poll.
        t = self.tier(random_region())
        ks = keys(3, "touch-again")
        self.store(t, ks, range(3))
        self.daemon.freeze()
        try:
            t.touch(ks, CTX)  # taken by the lookup thread, which waits on the frozen daemon
            d.wait_for(lambda: not t._touch_queue, what="the lookup thread to take the first touch")
            for _ in range(50):
                t.touch(ks, CTX)
            self.assertEqual(t._touch_queue, [ks])
        finally:
            self.daemon.thaw()
        d.wait_for(lambda: not t._touch_queue, what="the queued touch to be sent")

class FailedAndPartialPromotions(TierCase):

    def stored(self, n, prefix):
        region = random_region(seed=hash(prefix) & 0xFFFF)
        t = self.tier(region)
        ks = keys(n, prefix)
        self.store(t, ks, range(n))
        for k in ks:
            self.assertEqual(t.lookup(k, CTX), S.LookupResult.HIT)
        return t, region, ks

    def test_partial_promotion_reports_the_keys_that_loaded(self):
        t, region, ks = self.stored(4, "partial")
        # Between the lookup and the load, another client removes key 2.
        other = kvhost.Client(self.daemon.socket)
        self.addCleanup(other.close)
        ns = other.declare(t.namespace.geometry)
        self.assertEqual(other.delete(ns, [ks[2]]), 1)

        dst = [10, 11, 12, 13]
        sentinel = region[12].copy()
        j = self.job(ks, dst, promotion=True)
        t.submit_load(j)
        res = self.finished(t, 1)[j.job_id]
        self.assertFalse(res.success)
        self.assertEqual(list(res.successful_keys), [ks[0], ks[1], ks[3]])
        for i in (0, 1, 3):
            np.testing.assert_array_equal(region[dst[i]], region[i])
        np.testing.assert_array_equal(region[12], sentinel, err_msg="the missing key's row was written")
        ev = t.take_events()
        self.assertIn(([ks[2]], True), [(list(e.keys), e.removed) for e in ev])
        self.assertEqual(t.lookup(ks[2], CTX), S.LookupResult.MISS)
        self.assertEqual(t.counters()["load_missing_keys"], 1)

    def test_promotion_of_corrupted_files_fails_and_writes_no_row(self):
        t, region, ks = self.stored(2, "corrupt")
        files = self.daemon.data_files()
        self.assertTrue(files)
        for f in files:  # flip one byte near the end of each payload
            with open(f, "r+b") as fh:
                fh.seek(-100, os.SEEK_END)
                b = fh.read(1)
                fh.seek(-100, os.SEEK_END)
                fh.write(bytes([b[0] ^ 0xFF]))
        before = region[20:22].copy()
        j = self.job(ks, [20, 21], promotion=True)
        t.submit_load(j)
        res = self.finished(t, 1)[j.job_id]
        self.assertFalse(res.success)
        self.assertEqual(list(res.successful_keys or []), [])
        np.testing.assert_array_equal(region[20:22], before)
        self.assertEqual(t.counters()["load_failed_keys"], 2)
        self.assertGreaterEqual(t.daemon_stats()["corrupt"], 2)
        for f in files:  # leave no corrupt file to the next test (the daemon removed the loaded ones)
            if os.path.exists(f):
                os.unlink(f)

    def test_promotion_of_deleted_files_reports_missing_keys_as_removed(self):
        t, region, ks = self.stored(3, "vanished")
        for f in self.daemon.data_files():
            os.unlink(f)
        j = self.job(ks, [4, 5, 6], promotion=True)
        t.submit_load(j)
        res = self.finished(t, 1)[j.job_id]
        self.assertFalse(res.success)
        self.assertEqual(list(res.successful_keys or []), [])
        # The load's misses, or the daemon's removal stream first (in the
        # daemon's order): each key once.
        removed = [k for e in t.take_events() if e.removed for k in e.keys]
        self.assertEqual(sorted(removed), sorted(ks))


class Removals(TierCase):
    """The daemon's removals of the keys a tier stored reach vLLM's events
    (docs/routers.md; the machinery's own tests: test_vllm_removals)."""

    def test_a_key_the_tier_stored_and_another_client_deleted_is_reported_removed_once(self):
        ks = keys(3, "removal")
        t = self.tier(random_region())
        d.wait_for(lambda: t.counters()["events"].get("subscribed"), what="the tier's removal subscription")
        self.store(t, ks, range(3))
        self.assertEqual([(list(e.keys), e.removed) for e in t.take_events()], [(ks, False)])
        other = kvhost.Client(self.daemon.socket)
        self.addCleanup(other.close)
        ns = other.declare(t.namespace.geometry)
        self.assertEqual(other.delete(ns, ks[:2]), 2)
        got = []  # in one take_events call or two
        d.wait_for(lambda: got.extend(t.take_events()) or sum(len(e.keys) for e in got) >= 2,
                   what="the removed events")
        self.assertEqual(sorted(k for e in got for k in e.keys), sorted(ks[:2]))
        self.assertEqual({(e.removed, e.medium) for e in got}, {(True, S.Medium.STORAGE)})
        self.assertEqual(t.counters()["events"]["removed_deleted"], 2)

    def test_mount_media_is_refused_unless_it_maps_mount_indexes_to_names(self):
        for bad in (["CPU"], {"hot": "CPU"}, {"0": 1}):
            with self.subTest(bad=bad), self.assertRaisesRegex(ValueError, "mount_media"):
                self.tier(random_region(), mount_media=bad)


class JobsAndLifecycle(TierCase):

    def test_drain_jobs_returns_after_every_job_completed(self):
        region = random_region()
        t = self.tier(region, threads=2, staging_bytes=4 * ROW)
        ids = []
        for i in range(8):
            j = self.job(keys(4, f"drain{i}"), range(4 * (i % 8), 4 * (i % 8) + 4))
            t.submit_store(j)
            ids.append(j.job_id)
        t.drain_jobs()
        self.assertEqual(t.counters()["inflight_jobs"], 0)
        res = t.get_finished_jobs()
        self.assertEqual(sorted(r.job_id for r in res), ids)
        self.assertTrue(all(r.success for r in res))
        self.assertFalse(t.has_pending_work())

    def test_a_job_larger_than_the_staging_area_is_done_in_pieces(self):
        region = random_region()
        t = self.tier(region, threads=1, staging_bytes=3 * ROW)
        ks = keys(ROWS, "big")
        self.store(t, ks, range(ROWS))
        out = np.zeros_like(region)
        t2 = self.tier(out, threads=1, staging_bytes=5 * ROW)
        j = self.job(ks, list(reversed(range(ROWS))), promotion=True)
        t2.submit_load(j)
        self.assertTrue(self.finished(t2, 1)[j.job_id].success)
        np.testing.assert_array_equal(out[::-1], region)

    def test_shutdown_waits_for_jobs_then_refuses_new_ones(self):
        t = Tier(offloading_spec=S.fake_spec(), primary_kv_view=memoryview(random_region()),
                 tier_type="KvhostTier", socket=self.daemon.socket)
        j = self.job(keys(16, "shut"), range(16))
        t.submit_store(j)
        t.shutdown()
        self.assertEqual([r.job_id for r in t.get_finished_jobs()], [j.job_id])
        with self.assertRaisesRegex(RuntimeError, "shut down"):
            t.submit_store(self.job(keys(1, "late"), [0]))
        t.shutdown()  # idempotent
        checker = kvhost.Client(self.daemon.socket)
        self.addCleanup(checker.close)
        d.wait_for(lambda: checker.stats()["clients"] == 1 + len(self.tiers),
                   what="the tier's connection to close")

    def test_on_new_request_and_finished_hooks(self):
        t = self.tier(random_region())
        self.assertIsInstance(t.on_new_request(CTX), S.RequestOffloadingContext)
        self.assertIsNone(t.on_request_finished(CTX))


class Namespaces(TierCase):

    def test_different_models_and_geometries_never_share_keys(self):
        region = random_region()
        a = self.tier(region)
        ks = keys(2, "ns")
        self.store(a, ks, range(2))
        # Every one has the same row size as a: only the identity differs.
        for spec in (S.fake_spec(model="meta-llama/Llama-3.1-8B"), S.fake_spec(model="Qwen/Qwen3-8B"),
                     S.fake_spec(dtype="float16"), S.fake_spec(tp=2), S.fake_spec(layers=5),
                     S.fake_spec(blocks_per_chunk=2), S.fake_spec(tokens_per_block=32),
                     S.fake_spec(canonical_layout=False, replicated_layout=True)):
            b = self.tier(np.zeros_like(region), spec=spec)
            self.assertNotEqual(b.namespace.fingerprint, a.namespace.fingerprint)
            self.assertEqual(self.lookup_settled(b, ks[0])[-1], S.LookupResult.MISS)
        same = self.tier(np.zeros_like(region))
        self.assertEqual(same.namespace.fingerprint, a.namespace.fingerprint)
        self.assertEqual(self.lookup_settled(same, ks[0])[-1], S.LookupResult.HIT)

    def test_a_different_row_size_is_a_different_namespace(self):
        a = self.tier(random_region())
        b = self.tier(random_region(row=2 * ROW))
        self.assertNotEqual(a.namespace.fingerprint, b.namespace.fingerprint)
        self.assertEqual(b.namespace.key_bytes, 2 * ROW)

    def test_the_namespace_option_separates_equal_geometries(self):
        a = self.tier(random_region())
        b = self.tier(random_region(), namespace="tenant-b")
        self.assertNotEqual(a.namespace.fingerprint, b.namespace.fingerprint)


    def test_two_engines_of_one_model_share_rows(self):
        region = random_region()
        a = self.tier(region, spec=S.fake_spec(engine_id="engine-a"))
        ks = keys(2, "share")
        self.store(a, ks, range(2))
        b = self.tier(np.zeros_like(region), spec=S.fake_spec(engine_id="engine-b"))
        self.assertEqual(self.lookup_settled(b, ks[1])[-1], S.LookupResult.HIT)

    def test_parallel_sizes_collapse_only_where_vllm_certifies_the_row_portable(self):
        # vLLM's fs tier keeps TP sizes apart unless the config says the
        # bytes are parallelism-agnostic; kvhost does the same.
        region = random_region()
        a = self.tier(region, spec=S.fake_spec(tp=1, agnostic=True))
        ks = keys(1, "agnostic")
        self.store(a, ks, [0])
        b = self.tier(np.zeros_like(region), spec=S.fake_spec(tp=2, agnostic=True))
        self.assertEqual(b.namespace.geometry.model, a.namespace.geometry.model)
        self.assertEqual(self.lookup_settled(b, ks[0])[-1], S.LookupResult.HIT)
        c = self.tier(np.zeros_like(region), spec=S.fake_spec(tp=2))
        self.assertEqual(self.lookup_settled(c, ks[0])[-1], S.LookupResult.MISS)

    def test_the_page_layout_separates_rows_of_other_byte_orders(self):
        # A row holds the GPU workers' pages as they lie there, so their
        # byte order (attention backend, KV cache layout, cross-layer
        # slab) is in the identity: the option, else the default
        # configuration's (VLLM_KV_CACHE_LAYOUT where set).
        region = random_region()
        with mock.patch.dict(os.environ):
            os.environ.pop("VLLM_KV_CACHE_LAYOUT", None)
            a = self.tier(region)
            self.assertEqual(a._desc["page_layout"], "FLASH_ATTN/HND/slab")
            ks = keys(1, "page-layout")
            self.store(a, ks, [0])
            b = self.tier(np.zeros_like(region), page_layout="FLASHINFER/HND")
            os.environ["VLLM_KV_CACHE_LAYOUT"] = "NHD"
            c = self.tier(np.zeros_like(region))
            self.assertEqual(c._desc["page_layout"], "FLASH_ATTN/NHD/slab")
            for t in (b, c):
                self.assertNotEqual(t.namespace.fingerprint, a.namespace.fingerprint)
                self.assertEqual(self.lookup_settled(t, ks[0])[-1], S.LookupResult.MISS)
            same = self.tier(np.zeros_like(region), page_layout="FLASH_ATTN/HND/slab")
            self.assertEqual(same.namespace.fingerprint, a.namespace.fingerprint)
        with self.assertRaisesRegex(ValueError, "page_layout"):
            self.tier(random_region(), page_layout="FLASHINFER")
        with self.assertRaisesRegex(ValueError, "page_layout .* with vllm_fs"):
            self.tier(random_region(), page_layout="FLASHINFER/HND", vllm_fs=True)

    def test_the_namespace_option_adds_to_the_identity_and_never_replaces_it(self):
        a = self.tier(random_region(), namespace="shared")
        b = self.tier(random_region(), spec=S.fake_spec(model="Qwen/Qwen3-8B"), namespace="shared")
        self.assertNotEqual(a.namespace.fingerprint, b.namespace.fingerprint)


class Identity(unittest.TestCase):
    """A field that separates models and cannot be read refuses the tier,
    naming it, before anything connects or registers."""

    def refused(self, spec, field):
        with self.assertRaisesRegex(kv.IdentityUnknown, field):
            Tier(offloading_spec=spec, primary_kv_view=memoryview(random_region()),
                 tier_type="KvhostTier", socket="/nonexistent/kvhost.sock")

    def test_a_spec_without_vllms_offloading_config_is_refused(self):
        import types
        old_shape = types.SimpleNamespace(vllm_config=types.SimpleNamespace(), kv_cache_config=None)
        self.refused(old_shape, "has no config.model")

    def test_each_unreadable_identity_field_is_refused_by_name(self):
        import dataclasses
        cfg = S.offloading_config()
        cases = {
            "model.name": dataclasses.replace(cfg, model=S.OffloadingModelConfig(name="", dtype="bfloat16")),
            "model.dtype": dataclasses.replace(cfg, model=S.OffloadingModelConfig(name="m", dtype="auto")),
            "parallel.tp_size": dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, tp_size=None)),
            "cache.blocks_per_chunk": dataclasses.replace(cfg, cache=S.OffloadingCacheConfig(16, 0)),
            "groups": dataclasses.replace(cfg, groups=()),
            r"groups\[0\].layer_names": dataclasses.replace(
                cfg, groups=(S.OffloadingGroupConfig(tokens_per_block=16, layer_names=()),)),
        }
        for field, bad in cases.items():
            with self.subTest(field=field):
                self.refused(S._TieringSpec(bad), r"spec\.config\." + field)

    def test_canonical_layout_without_vllms_format_id_is_refused(self):
        self.refused(S.fake_spec(canonical_layout=True), "canonical format id")


class Stats(TierCase):
    """vLLM calls get_stats every scheduler step, then is_empty() and
    aggregate() on what it gets."""

    def test_get_stats_is_vllms_payload_with_kvhosts_counters_or_none(self):
        t = self.tier(random_region())
        self.assertIsNone(t.get_stats(), "nothing happened yet")
        self.store(t, keys(3, "stats"), range(3))
        st = t.get_stats()
        self.assertIsInstance(st, S.OffloadingConnectorStats)
        data = st.data["data"]
        self.assertEqual(data["vllm:kv_offload_kvhost_stored_keys"], {("KvhostTier",): 3})
        self.assertEqual(data["vllm:kv_offload_kvhost_bytes_stored"], {("KvhostTier",): 3 * ROW})
        self.assertIsNone(t.get_stats(), "a second call with nothing new reports nothing")
        declared = type(t).build_metric_definitions({})
        for name, labels in data.items():
            self.assertIn(name, declared)
            for lv in labels:
                self.assertEqual(len(lv), len(declared[name].labelnames))

    def test_a_thousand_steps_under_load_aggregate_every_store_and_hit(self):
        region = random_region()
        t = self.tier(region, threads=4, lookup_ttl_s=0.005)
        total = S.OffloadingConnectorStats()

        def step(key):
            r = t.lookup(key, CTX)
            t.get_finished_jobs()
            st = t.get_stats()
            if st is not None:
                self.assertFalse(st.is_empty())
                total.aggregate(st)
            return r

        submitted = 0
        for n in range(1000):
            if n % 10 == 0 and submitted < 64:
                ks = keys(2, f"load{submitted}")
                t.submit_store(self.job(ks, [(2 * submitted) % ROWS, (2 * submitted + 1) % ROWS]))
                submitted += 1
            step(keys(1, f"load{n % 64}")[0])
        t.drain_jobs()
        # Every key is stored now: steps go on until a lookup is answered HIT.
        d.wait_for(lambda: step(keys(1, "load0")[0]) is S.LookupResult.HIT, what="a HIT")
        step(keys(1, "load0")[0])
        c = t.counters()
        got = {name[len("vllm:kv_offload_kvhost_"):]: v[("KvhostTier",)] for name, v in total.data["data"].items()}
        self.assertEqual(got.get("stored_keys", 0) + got.get("present_keys", 0), 2 * submitted)
        self.assertEqual(got["bytes_stored"], c["bytes_stored"])
        self.assertGreater(c["lookup_hits"], 0)
        for k in ("lookup_hits", "lookup_misses", "lookup_retries"):
            self.assertEqual(got.get(k, 0), c.get(k, 0), k)


class Lifecycle(TierCase):

    def test_shutdown_leaves_no_export_of_vllms_region(self):
        # vLLM's region: a numpy array over an mmap, handed as a memoryview;
        # at shutdown vLLM releases the memoryview and closes the mmap.
        size = ROWS * ROW
        m = mmap.mmap(-1, size)
        arr = np.frombuffer(m, dtype=np.uint8).reshape(ROWS, ROW)
        arr[:] = random_region(seed=5)
        view = memoryview(arr)
        t = Tier(offloading_spec=S.fake_spec(), primary_kv_view=view, tier_type="KvhostTier",
                 socket=self.daemon.socket)
        self.store(t, keys(2, "export"), [0, 1])
        t.shutdown()
        del arr
        view.release()  # raises BufferError while the tier keeps an export
        m.close()

    def test_the_namespace_line_reaches_the_only_logger_vllm_configures(self):
        # vLLM configures its "vllm" logger alone and stops it propagating.
        import logging
        vllm_logger = logging.getLogger("vllm")
        seen = []

        class Keep(logging.Handler):
            def emit(self, rec):
                seen.append(rec.getMessage())
        h = Keep(level=logging.INFO)
        old = (vllm_logger.level, vllm_logger.propagate)
        vllm_logger.addHandler(h)
        vllm_logger.setLevel(logging.INFO)
        vllm_logger.propagate = False
        try:
            t = self.tier(random_region())
        finally:
            vllm_logger.removeHandler(h)
            vllm_logger.setLevel(old[0])
            vllm_logger.propagate = old[1]
        line = [m for m in seen if m.startswith("kvhost tier: namespace ")]
        self.assertEqual(len(line), 1, seen)
        self.assertIn(t.namespace.geometry.model, line[0])

    def test_vllms_generic_tier_keys_are_accepted_and_locality_honoured(self):
        detector = object()
        t = self.tier(random_region(), locality="REMOTE", backpressure_detector=detector,
                      backpressure={"backpressure_cls": "X"})
        self.assertIs(t.locality, S.Locality.REMOTE)
        with self.assertRaisesRegex(ValueError, "locality 'FAR'"):
            self.tier(random_region(), locality="FAR")

    def test_a_job_with_chunk_ids_instead_of_block_ids_is_moved(self):
        import dataclasses
        region = random_region()
        t = self.tier(region)

        @dataclasses.dataclass
        class LaterTransferJob:  # vLLM renamed block_ids to chunk_ids
            job_id: int
            keys: list
            chunk_ids: np.ndarray
            is_promotion: bool
            req_context: object
        t.submit_store(LaterTransferJob(900, keys(1, "chunk"), np.asarray([3]), False, CTX))
        self.assertTrue(self.finished(t, 1)[900].success)


class VllmFsMount(unittest.TestCase):
    """vllm_fs=true: the tier uses the daemon's vllm-fs mount of vLLM's
    fs-tier directory for its model, named as vLLM's fs tier names it."""

    @staticmethod
    def fs_daemon(spec, namespace=None):
        """A daemon with a vllm-fs mount configured with the fields of
        spec's fs tier, serving namespace where given: (fields, base
        directory name, root, daemon)."""
        from kvhost.vllm import _namespace as N
        f = N.fs_fields(spec.config)
        root = tempfile.mkdtemp(prefix="kvhost-vllmfs-")
        groups = "".join(f'[[mount.vllm_fs.kv_cache_groups]]\ntokens_per_block = {g["tokens_per_block"]}\n'
                         f'layer_names = {list(g["layer_names"])!r}\n'.replace("'", '"') for g in f["kv_cache_groups"])
        sizes = "".join(f"{k} = {f[k]}\n" for k in ("tp_size", "pp_size", "pcp_size", "dcp_size"))
        daemon = d.Daemon(after_toml=(
            f'[[mount]]\npath = "{root}"\nlayout = "vllm-fs"\ncapacity = "1GiB"\n'
            f'[mount.vllm_fs]\nmodel_name = "{f["model_name"]}"\ntokens_per_hash = {f["tokens_per_hash"]}\n'
            f'blocks_per_file = {f["blocks_per_file"]}\ndtype = "{f["dtype"]}"\n{sizes}'
            + (f'namespace = "{namespace}"\n' if namespace is not None else "") + groups))
        return f, N.fs_base(f), root, daemon

    @classmethod
    def setUpClass(cls):
        cls.fields, cls.base, cls.root, cls.daemon = cls.fs_daemon(S.fake_spec())

    @classmethod
    def tearDownClass(cls):
        cls.daemon.stop()
        shutil.rmtree(cls.root, ignore_errors=True)

    def test_rows_land_where_vllms_fs_tier_names_them_and_other_models_are_refused(self):
        region = random_region(rows=4)
        t = Tier(offloading_spec=S.fake_spec(), primary_kv_view=memoryview(region), tier_type="KvhostTier",
                 socket=self.daemon.socket, vllm_fs=True)
        self.addCleanup(t.shutdown)
        self.assertEqual(t.namespace.geometry.model, "vllm-fs:" + self.base)
        k = keys(1, "fs")[0]
        j = S.TransferJob(job_id=1, keys=[k], block_ids=np.asarray([2]), is_promotion=False, req_context=CTX)
        t.submit_store(j)
        d.wait_for(lambda: t.get_finished_jobs(), what="the store")
        h = k[:-4].hex()
        path = pathlib.Path(self.root, f"{self.base}_r0", h[:3], f"{h[3:5]}_g0", f"{h}.bin")
        self.assertTrue(path.exists(), f"no {path}")
        self.assertEqual(path.read_bytes()[:ROW], region[2].tobytes())
        with self.assertRaisesRegex(RuntimeError, "no vllm-fs mount of the daemon serves this model"):
            Tier(offloading_spec=S.fake_spec(model="Qwen/Qwen3-8B"), primary_kv_view=memoryview(random_region(rows=4)),
                 tier_type="KvhostTier", socket=self.daemon.socket, vllm_fs=True)

    def test_a_tiers_namespace_bound_to_its_fs_tier_directory_is_refused_where_that_does_not_keep_it_apart(self):
        # Without vllm_fs, a mount may serve the tier's own namespace
        # from vLLM's fs-tier directory of its fields (docs/config.md).
        # That directory is named by those fields only and shared by
        # every engine of them: a tenant's namespace, a page layout or a
        # context-parallel interleave other than 1 is kept apart by none
        # of it (vllm_fs refuses them for that), so a tier with one of
        # them refuses such a mount as it would any other directory.
        from kvhost.vllm import _namespace as N
        base = S.fake_spec()
        cp = S.fake_spec()
        cp.config = dataclasses.replace(cp.config, parallel=dataclasses.replace(cp.config.parallel, dcp_size=2))
        for name, spec, opts, refused in (
                ("plain", base, {}, False),
                ("tenant", base, {"namespace": "tenant-a"}, True),
                ("page layout", base, {"page_layout": "FLASHINFER/HND"}, True),
                ("interleave 1", cp, {"cp_kv_cache_interleave_size": 1}, False),
                ("interleave 4", cp, {"cp_kv_cache_interleave_size": 4}, True)):
            with self.subTest(name):
                desc = N.describe(spec, ROW, opts.get("namespace", ""), opts.get("page_layout"))
                if "cp_kv_cache_interleave_size" in opts:
                    desc["cp_kv_cache_interleave_size"] = opts["cp_kv_cache_interleave_size"]
                model = N.geometry(desc).model
                _, _, root, daemon = self.fs_daemon(spec, namespace=model)
                self.addCleanup(shutil.rmtree, root, True)
                self.addCleanup(daemon.stop)

                def tier():
                    t = Tier(offloading_spec=spec, primary_kv_view=memoryview(random_region(rows=4)),
                             tier_type="KvhostTier", socket=daemon.socket, **opts)
                    self.addCleanup(t.shutdown)
                    return t
                if refused:
                    with self.assertRaisesRegex(kv.IdentityMismatch, "does not serve namespace"):
                        tier()
                else:
                    self.assertEqual(tier().namespace.geometry.model, model)

    def test_a_namespace_too_long_for_a_model_id_is_cut_as_the_daemon_cuts_it(self):
        # A model given by a long local path: "vllm-fs:<base>" is longer
        # than a model id may be, and the cut falls inside a character.
        spec = S.fake_spec(model="/models/" + "\u00e9" * 60)
        _, base, root, daemon = self.fs_daemon(spec)
        self.addCleanup(shutil.rmtree, root, True)
        self.addCleanup(daemon.stop)
        region = random_region(rows=4)
        t = Tier(offloading_spec=spec, primary_kv_view=memoryview(region), tier_type="KvhostTier",
                 socket=daemon.socket, vllm_fs=True)
        self.addCleanup(t.shutdown)
        model = t.namespace.geometry.model
        self.assertLessEqual(len(model.encode()), 128)
        self.assertTrue(model.startswith("vllm-fs:" + base[:20]) and model.endswith(base[-13:]), model)
        k = keys(1, "long")[0]
        t.submit_store(S.TransferJob(job_id=1, keys=[k], block_ids=np.asarray([2]), is_promotion=False, req_context=CTX))
        d.wait_for(lambda: t.get_finished_jobs(), what="the store")
        h = k[:-4].hex()
        self.assertEqual(pathlib.Path(root, f"{base}_r0", h[:3], f"{h[3:5]}_g0", f"{h}.bin").read_bytes()[:ROW],
                         region[2].tobytes())


class DaemonRestart(TierCase):
    """The daemon stops under a running tier (an upgrade's restart, or a
    crash) and a new one starts on the same socket and directory: while it
    is gone, lookups answer MISS and jobs fail at once; the tier connects
    again by itself and then serves the rows stored before and stores new
    ones, on either data path."""

    def trigger_loss(self, t, tag):
        """A lookup the tier must ask the daemon about: it finds the
        connection gone and answers MISS."""
        self.assertEqual(self.lookup_settled(t, S.offload_key(("gone", tag)))[-1], S.LookupResult.MISS)
        d.wait_for(lambda: not t.counters()["connected"], what="the tier to notice the daemon is gone")

    def restart_under(self, t, region, sig, tag):
        ks = keys(4, tag)
        self.store(t, ks, range(4))
        want = region[:4].copy()
        self.daemon.halt(sig)
        self.trigger_loss(t, tag)
        self.assertEqual(t.lookup(ks[0], CTX), S.LookupResult.MISS, "a lookup while the daemon is gone")
        j = self.job(keys(2, tag + "-down"), [6, 7])
        t.submit_store(j)
        self.assertFalse(self.finished(t, 1)[j.job_id].success, "a store while the daemon is gone")

        self.daemon.start_again()
        d.wait_for(lambda: t.counters()["connected"], what="the tier to connect again")
        st = t.counters()
        self.assertEqual((st["disconnects"], st["reconnects"]), (1, 1))
        for k in ks:
            self.assertEqual(self.lookup_settled(t, k)[-1], S.LookupResult.HIT, "a row stored before the restart")
        region[20:24] = 0
        j = self.job(ks, [20, 21, 22, 23], promotion=True)
        t.submit_load(j)
        res = self.finished(t, 1)[j.job_id]
        self.assertTrue(res.success, res)
        np.testing.assert_array_equal(region[20:24], want)
        more = keys(2, tag + "-after")
        self.store(t, more, [4, 5])
        for k in more:
            self.assertEqual(self.lookup_settled(t, k)[-1], S.LookupResult.HIT, "a row stored after the restart")

    def test_an_answer_of_a_connection_replaced_meanwhile_is_not_kept(self):
        # The daemon answers a lookup HIT (or a store job STORED) and is
        # killed before the tier files the answer; a new daemon on a fresh
        # directory is connected and swapped in meanwhile. The HIT was the
        # old daemon's: kept, it would promise rows the new one lacks (a
        # promotion that fails). The key is asked again, of the new one.
        for how in ("lookup", "store"):
            with self.subTest(how):
                dm = d.Daemon()
                self.addCleanup(dm.stop)
                t = self.tier(random_region(seed=26), socket=dm.socket, reconnect_s=0.05)
                ks = keys(2, f"replaced-{how}")
                if how == "lookup":  # stored by another engine: t asks the daemon
                    self.store(self.tier(random_region(seed=27), socket=dm.socket), ks, [0, 1])
                old = t._s
                real = old.client.lookup if how == "lookup" else old.client.store

                def then_replaced(*args, real=real, dm=dm, t=t, how=how, **kw):
                    out = real(*args, **kw)
                    if how == "store":
                        out.wait()  # stored on the old daemon
                    dm.halt(signal.SIGKILL)
                    dm.reconfigure(dir=tempfile.mkdtemp(prefix="blocks-", dir=dm.tmp))
                    dm.start_again()
                    down = self.job(keys(1, f"down-{how}"), [9])
                    t.submit_store(down)  # meets the lost connection
                    d.wait_for(lambda: t.counters().get("reconnects") == 1, what="the new connection swapped in")
                    return out
                if how == "lookup":
                    old.client.lookup = then_replaced
                    self.assertEqual(t.lookup(ks[0], CTX), S.LookupResult.RETRY)  # asked, on the old daemon
                    d.wait_for(lambda: t.counters().get("reconnects") == 1, what="the new connection swapped in")
                    self.assertEqual(self.lookup_settled(t, ks[0])[-1], S.LookupResult.MISS)
                else:
                    old.client.store = then_replaced
                    j = self.job(ks, [0, 1])
                    t.submit_store(j)
                    d.wait_for(lambda: j.job_id in [r.job_id for r in t.get_finished_jobs()], what="the store")
                    self.assertEqual(self.lookup_settled(t, ks[0])[-1], S.LookupResult.MISS)
                self.assertEqual(self.lookup_settled(t, ks[1])[-1], S.LookupResult.MISS)

    def test_a_restart_and_a_crash_are_survived_on_the_copy_path(self):
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with self.subTest(sig=sig.name):
                region = random_region(seed=21)
                t = self.tier(region, zero_copy="off", reconnect_s=0.05)
                self.assertEqual(t.data_path, "copy")
                self.restart_under(t, region, sig, f"copy-{sig.name}")

    def test_a_restart_is_survived_on_the_zero_copy_path(self):
        buf = kvhost.HostBuffer(ROWS * ROW)
        self.addCleanup(buf.close)
        region = np.frombuffer(buf.mmap, dtype=np.uint8).reshape(ROWS, ROW)
        region[:] = random_region(seed=22)
        t = self.tier(region, zero_copy="on", reconnect_s=0.05)
        self.assertEqual(t.data_path, "zero-copy")
        self.restart_under(t, region, signal.SIGTERM, "zc")
        t.shutdown()
        self.tiers.remove(t)
        del region

    def test_a_new_daemon_that_refuses_vllms_region_is_served_on_the_copy_path(self):
        """zero_copy = "auto" and a new daemon whose max_registered_bytes is
        below vLLM's region: the tier copies through its own memfd, as it
        would have at start, instead of trying the region forever."""
        dm = d.Daemon()
        self.addCleanup(dm.stop)
        buf = kvhost.HostBuffer(ROWS * ROW)
        self.addCleanup(buf.close)
        region = np.frombuffer(buf.mmap, dtype=np.uint8).reshape(ROWS, ROW)
        region[:] = random_region(seed=25)
        t = self.tier(region, socket=dm.socket, reconnect_s=0.05, staging_bytes=4 * ROW, threads=1)
        self.assertEqual(t.data_path, "zero-copy")
        ks = keys(4, "refused")
        self.store(t, ks, range(4))
        want = region[:4].copy()
        dm.halt(signal.SIGTERM)
        self.trigger_loss(t, "refused")
        with open(dm.config) as f:
            text = f.read()
        with open(dm.config, "w") as f:
            f.write(text.replace("[server]\n", f'[server]\nmax_registered_bytes = {ROWS * ROW // 2}\n', 1))
        dm.start_again()
        d.wait_for(lambda: t.counters()["connected"], what="the tier to connect again")
        st = t.counters()
        self.assertEqual((t.data_path, st["data_path"], st["reconnects"]), ("copy", "copy", 1))
        self.assertIn("limit", st["zero_copy_error"])
        for k in ks:
            self.assertEqual(self.lookup_settled(t, k)[-1], S.LookupResult.HIT)
        region[20:24] = 0
        j = self.job(ks, [20, 21, 22, 23], promotion=True)
        t.submit_load(j)
        self.assertTrue(self.finished(t, 1)[j.job_id].success)
        np.testing.assert_array_equal(region[20:24], want)
        more = keys(2, "refused-after")
        self.store(t, more, [4, 5])
        for k in more:
            self.assertEqual(self.lookup_settled(t, k)[-1], S.LookupResult.HIT)
        t.shutdown()
        self.tiers.remove(t)
        del region

    def test_a_job_past_job_timeout_s_keeps_its_rows_until_the_daemon_ends_it(self):
        """A promotion sent to a frozen daemon is not reported failed when
        job_timeout_s passes (vLLM would hand its rows to other blocks
        while the daemon, once resumed, could still write them): the tier
        says so in the log and reports the job once the daemon ran it.

        Once the resumed daemon has accepted the job, the tier asks it to
        cancel the job, which is past job_timeout_s; whether that request
        or the job's end comes first is the machine's timing (a loaded
        machine ran the job longer than 0.1 s and failed this test). The
        request is recorded here instead of sent, so the job runs to its
        end; TestWaitEnded checks what the tier does with a cancel."""
        region = random_region(seed=26)
        ks = keys(2, "fenced")
        # Stored by a tier of the default timeouts: under the short ones a
        # loaded machine failed the store itself.
        self.store(self.tier(region, zero_copy="off"), ks, [0, 1])
        t = self.tier(region, zero_copy="off", job_timeout_s=0.1, request_timeout_s=0.3)
        want = region[:2].copy()
        region[10:12] = 0
        said = d.LogRecords("vllm.kvhost")
        self.addCleanup(said.close)
        asked = []
        with mock.patch.object(kvhost.Job, "cancel", lambda job: asked.append(job.id) or False):
            self.daemon.freeze()
            try:
                j = self.job(ks, [10, 11], promotion=True)
                t.submit_load(j)
                # Ten warnings: a second, past job_timeout_s and request_timeout_s both.
                d.wait_for(lambda: said.count("not done after 0.1s") >= 10, what="the tier to wait on")
                self.assertEqual(t.get_finished_jobs(), [], "a job reported before the daemon ended it")
                self.assertEqual(asked, [], "a cancel asked of a job the frozen daemon never accepted")
            finally:
                self.daemon.thaw()
            res = self.finished(t, 1)[j.job_id]
        self.assertTrue(res.success, res)
        np.testing.assert_array_equal(region[10:12], want)

    def test_a_given_up_job_is_logged_with_the_daemons_pid_and_whether_it_lives(self):
        from kvhost.vllm._common import daemon_state
        t = self.tier(random_region(seed=30), zero_copy="off")
        self.assertEqual(daemon_state(t._s.client), f"daemon pid {self.daemon.proc.pid}, alive")
        self.assertEqual(daemon_state(object()), "daemon pid unknown")

    def test_drain_jobs_gives_up_on_a_frozen_daemon_within_the_bound_and_no_late_byte_reaches_vllms_rows(self):
        """drain_jobs (vLLM's reset_cache) returns once daemon_wait_s has
        passed with a store and a promotion on the frozen daemon, reporting
        both failed; vLLM then reuses every row (a pattern here), and the
        resumed daemon, which runs both jobs on the tier's staging slots,
        changes none of them: the promotion's copy to vLLM's rows is not
        made once given up."""
        region = random_region(seed=29)
        ks = keys(2, "drained")
        self.store(self.tier(region, zero_copy="off"), ks, [0, 1])
        t = self.tier(region, zero_copy="off", daemon_wait_s=0.5)
        self.daemon.freeze()
        try:
            load, store = self.job(ks, [10, 11], promotion=True), self.job(keys(2, "drained-store"), [12, 13])
            t.submit_load(load)
            t.submit_store(store)
            d.wait_for(lambda: len(t._runs) == 2 and all(r.started for r in t._runs.values()),
                       what="both jobs sent to the frozen daemon")
            t0 = time.monotonic()
            t.drain_jobs()
            self.assertLess(time.monotonic() - t0, 0.5 + 1.0, "drain_jobs waited on the frozen daemon")
            self.assertEqual({r.job_id: r.success for r in t.get_finished_jobs()},
                             {load.job_id: False, store.job_id: False})
            self.assertEqual(t.counters()["inflight_jobs"], 0)
            region[:] = 0x5A
        finally:
            self.daemon.thaw()
        d.wait_for(lambda: t.counters().get("given_up_jobs_ended", 0) == 2, what="the daemon to end the jobs")
        self.assertTrue((region == 0x5A).all(), "a byte of a given-up job reached vLLM's rows")
        self.assertEqual(t.get_finished_jobs(), [], "a given-up job reported twice")

    def test_shutdown_gives_up_on_a_frozen_daemon_without_handing_its_staging_rows_on(self):
        """Shutdown gives up on a job the daemon has not ended after
        daemon_wait_s, but the staging rows it held go to no later job: a
        store queued behind it fails instead of copying its rows there,
        where the resumed daemon would read them as the first store's."""
        region = random_region(seed=27)
        fresh = self.tier(random_region(seed=28), zero_copy="off")
        t = self.tier(region, zero_copy="off", threads=1, staging_bytes=2 * ROW, job_timeout_s=0.1,
                      daemon_wait_s=0.5)
        first, second = keys(2, "given-up"), keys(2, "queued")
        client = t._s.client
        real_close = client.close

        def close():  # the daemon resumes before the connection goes, and runs what it read
            if not client.connected():
                return real_close()
            self.daemon.thaw()
            d.wait_for(lambda: all(self.lookup_settled(fresh, k)[-1] == S.LookupResult.HIT for k in first),
                       what="the resumed daemon to store the given-up job's keys")
            real_close()
        client.close = close
        self.daemon.freeze()
        done = threading.Event()
        try:
            ja, jb = self.job(first, [0, 1]), self.job(second, [2, 3])
            t.submit_store(ja)
            t.submit_store(jb)
            threading.Thread(target=lambda: (t.shutdown(), done.set()), daemon=True).start()
            d.wait_for(done.is_set, what="shutdown to give up on the frozen daemon")
        finally:
            self.daemon.thaw()
        self.tiers.remove(t)
        self.assertEqual({r.job_id: r.success for r in t.get_finished_jobs()}, {ja.job_id: False, jb.job_id: False})
        for k in second:
            self.assertEqual(self.lookup_settled(fresh, k)[-1], S.LookupResult.MISS, "the queued store was sent")
        for k, row in zip(first, [0, 1]):
            j = self.job([k], [9], promotion=True)
            fresh.submit_load(j)
            self.assertTrue(self.finished(fresh, 1)[j.job_id].success)
            self.assertEqual(fresh._primary[9].tobytes(), region[row].tobytes(), f"key {k!r} holds other bytes")

    def test_reconnect_s_zero_stays_disconnected_and_shutdown_returns_while_the_daemon_is_gone(self):
        never = self.tier(random_region(seed=23), zero_copy="off", reconnect_s=0)
        trying = self.tier(random_region(seed=24), zero_copy="off", reconnect_s=0.05)
        self.daemon.halt(signal.SIGTERM)
        try:
            for t, tag in ((never, "never"), (trying, "trying")):
                self.trigger_loss(t, tag)
            done = threading.Event()
            threading.Thread(target=lambda: (trying.shutdown(), done.set()), daemon=True).start()
            d.wait_for(done.is_set, what="shutdown while the tier tries to connect again")
            self.assertEqual([r for r in trying._reconnectors if r.is_alive()], [],
                             "a reconnect thread outlived shutdown")
        finally:
            self.daemon.start_again()
        j = self.job(keys(1, "never"), [0])
        never.submit_store(j)
        self.assertFalse(self.finished(never, 1)[j.job_id].success, "reconnect_s = 0 connected again")
        st = never.counters()
        self.assertEqual((st["connected"], st.get("reconnects", 0)), (False, 0))


class LostOrLate(unittest.TestCase):
    """Which errors end a session: a late job or reply (TimeoutError,
    an OSError too) leaves a working connection alone."""

    class Client:
        def __init__(self, up):
            self.up = up

        def connected(self):
            return self.up

    def test_only_errors_of_a_gone_connection_count_as_lost(self):
        from kvhost.vllm._connect import lost_connection as _lost_connection
        cases = [
            ("connection lost", kvhost.ConnectionLost("daemon closed the connection"), True, True),
            ("broken pipe", BrokenPipeError(), True, True),
            ("a job past job_timeout_s", TimeoutError("job 3 not complete after 60s"), True, False),
            ("a refusal", kvhost.KvhostError(1, "bad request"), True, False),
            ("any error once the client says it is closed", TimeoutError(), False, True),
        ]
        for name, err, up, want in cases:
            with self.subTest(name):
                self.assertEqual(_lost_connection(err, self.Client(up)), want)


class TestWaitEnded(unittest.TestCase):
    """_common.wait_ended, which the tier and the spec's workers wait on a
    daemon job with: past its timeout it asks the daemon once to cancel a
    job the daemon accepted (never one it did not), says so in the log at
    every timeout, and still returns only the job's own result; it gives
    up only at until's deadline. A fake job stands in for the daemon, so
    no step depends on the machine's speed."""

    class Job:
        def __init__(self, steps, result="done", accepted_at=0, cancels=False, cancel_raises=False):
            self.steps, self.result = steps, result  # wait() times out steps times, then returns result
            self.accepted_at = accepted_at            # after this many timeouts the job has its id
            self.cancels, self.cancel_raises = cancels, cancel_raises
            self.waits, self.asked, self.id = 0, [], None

        def wait(self, timeout):
            if self.waits >= self.accepted_at:
                self.id = 7
            if self.waits >= self.steps:
                return self.result
            self.waits += 1
            raise TimeoutError(f"job not complete after {timeout}s")

        def cancel(self):
            self.asked.append(self.id)
            if self.cancel_raises:
                raise TimeoutError("the daemon does not answer")
            return self.cancels

    def wait(self, job, until=lambda: None, on_cancel=None):
        from kvhost.vllm._common import wait_ended
        with self.assertLogs("vllm.kvhost", "WARNING") as said:
            out = wait_ended(job, 0.01, until, "tier", on_cancel)
        return out, said.output

    def test_a_job_never_accepted_is_never_asked_to_cancel(self):
        job = self.Job(steps=3, accepted_at=99)
        out, said = self.wait(job)
        self.assertEqual(out, "done")
        self.assertEqual(job.asked, [])
        self.assertEqual(len(said), 3)
        self.assertTrue(all("not yet accepted" in line and "asked to cancel" not in line for line in said), said)

    def test_an_accepted_job_is_asked_once_and_still_waited_for(self):
        for name, cancels, raises, want_on_cancel in [
            ("the daemon cancels it", True, False, 1),
            ("the daemon says it had ended", False, False, 0),
            ("the daemon does not answer the cancel", False, True, 0),
        ]:
            with self.subTest(name):
                job = self.Job(steps=4, accepted_at=2, cancels=cancels, cancel_raises=raises)
                called = []
                out, said = self.wait(job, on_cancel=lambda: called.append(1))
                self.assertEqual(out, "done", "the job's own result, after the cancel")
                self.assertEqual(job.asked, [7], "asked once, once the job had its id")
                self.assertEqual(len(called), want_on_cancel)
                self.assertEqual(len(said), 4)
                self.assertNotIn("asked to cancel", said[0])
                self.assertIn("asked to cancel", said[-1])

    def test_it_gives_up_at_the_deadline_only(self):
        import time
        job = self.Job(steps=10**9, accepted_at=0)
        deadline = time.monotonic()  # already passed: the first timed-out wait ends it
        with self.assertRaises(TimeoutError):
            from kvhost.vllm._common import wait_ended
            wait_ended(job, 0.01, lambda: deadline, "tier")
        self.assertEqual(job.asked, [], "no cancel asked on the way out at the deadline")


class LostConnectionLeavesNoExport(TierCase):

    def test_a_job_that_met_the_lost_connection_keeps_no_view_of_vllms_region_after_shutdown(self):
        # The error a job meets passes through the frame holding the array
        # over vLLM's region: kept whole, it would keep the region exported
        # and vLLM's close of its mapping would fail.
        f = tempfile.TemporaryFile()
        self.addCleanup(f.close)
        os.ftruncate(f.fileno(), ROWS * ROW)
        m = mmap.mmap(f.fileno(), ROWS * ROW)
        region = np.frombuffer(m, dtype=np.uint8).reshape(ROWS, ROW)
        t = Tier(offloading_spec=S.fake_spec(), primary_kv_view=memoryview(region), tier_type="KvhostTier",
                 socket=self.daemon.socket, zero_copy="off", reconnect_s=0)
        del region
        self.daemon.halt()
        try:
            j = self.job(keys(1, "leak"), [0])
            t.submit_store(j)
            self.assertFalse(self.finished(t, 1)[j.job_id].success)
            self.assertFalse(t.counters()["connected"], "the job did not find the connection lost")
            gc.disable()
            self.addCleanup(gc.enable)
            t.shutdown()
            del t
            m.close()  # BufferError while anything still exports the mapping
        finally:
            self.daemon.start_again()


class ZeroCopy(TierCase):

    def test_a_memfd_primary_region_is_registered_and_moved_without_staging(self):
        buf = kvhost.HostBuffer(ROWS * ROW)
        self.addCleanup(buf.close)
        region = np.frombuffer(buf.mmap, dtype=np.uint8).reshape(ROWS, ROW)
        region[:] = random_region(seed=7)
        want = region[:4].copy()
        t = self.tier(region, zero_copy="on")
        self.assertEqual(t.data_path, "zero-copy")
        ks = keys(4, "zc")
        self.store(t, ks, range(4))
        region[:4] = 0
        j = self.job(ks, [8, 9, 10, 11], promotion=True)
        t.submit_load(j)
        self.assertTrue(self.finished(t, 1)[j.job_id].success)
        np.testing.assert_array_equal(region[8:12], want)
        t.shutdown()
        self.tiers.remove(t)
        del region

    def shm_region(self):
        f = tempfile.NamedTemporaryFile(dir="/dev/shm" if os.path.isdir("/dev/shm") else None,
                                        prefix="vllm_offload_test_", suffix=".mmap")
        self.addCleanup(f.close)
        os.ftruncate(f.fileno(), ROWS * ROW)
        m = mmap.mmap(f.fileno(), ROWS * ROW)
        region = np.frombuffer(m, dtype=np.uint8).reshape(ROWS, ROW)
        region[:] = random_region(seed=9)
        return region

    def test_vllms_shm_file_is_registered_and_moved_without_staging(self):
        region = self.shm_region()
        want = region[0:2].copy()
        t = self.tier(region, zero_copy="on")
        self.assertEqual(t.data_path, "zero-copy")
        ks = keys(2, "shm")
        self.store(t, ks, [0, 1])
        region[0:2] = 0
        j = self.job(ks, [30, 31], promotion=True)
        t.submit_load(j)
        self.assertTrue(self.finished(t, 1)[j.job_id].success)
        np.testing.assert_array_equal(region[30:32], want)

    def test_auto_uses_the_shm_file_and_still_moves_rows(self):
        region = self.shm_region()
        t = self.tier(region, zero_copy="auto")
        self.assertEqual(t.data_path, "zero-copy")
        ks = keys(2, "auto")
        self.store(t, ks, [0, 1])
        j = self.job(ks, [30, 31], promotion=True)
        t.submit_load(j)
        self.assertTrue(self.finished(t, 1)[j.job_id].success)
        np.testing.assert_array_equal(region[30:32], region[0:2])

    def test_a_region_that_is_no_shared_file_falls_back_to_the_copy(self):
        region = np.frombuffer(bytearray(ROWS * ROW), dtype=np.uint8).reshape(ROWS, ROW)
        region[:] = random_region(seed=11)
        with self.assertRaisesRegex(RuntimeError, "zero_copy=on: cannot register vLLM's CPU region"):
            self.tier(region, zero_copy="on")
        t = self.tier(region, zero_copy="auto")
        self.assertEqual(t.data_path, "copy")
        self.assertIn("zero_copy_error", t.counters())
        ks = keys(2, "anon")
        self.store(t, ks, [0, 1])
        j = self.job(ks, [30, 31], promotion=True)
        t.submit_load(j)
        self.assertTrue(self.finished(t, 1)[j.job_id].success)
        np.testing.assert_array_equal(region[30:32], region[0:2])


@unittest.skipUnless(HAVE_TORCH, "torch is not importable (install python3-torch: scripts/ensure-python.sh)")
class TorchTensors(TierCase):

    def test_cpu_torch_tensor_rows_round_trip(self):
        import torch
        g = torch.Generator().manual_seed(3)
        src = torch.randint(-128, 128, (ROWS, ROW), dtype=torch.int8, generator=g)
        t = self.tier(src.numpy())
        ks = keys(6, "torch")
        self.store(t, ks, range(6))
        dst = torch.zeros((ROWS, ROW), dtype=torch.int8)
        t2 = self.tier(dst.numpy())
        j = self.job(ks, range(10, 16), promotion=True)
        t2.submit_load(j)
        self.assertTrue(self.finished(t2, 1)[j.job_id].success)
        self.assertTrue(torch.equal(dst[10:16], src[:6]))

    def test_bfloat16_rows_keep_their_bits(self):
        import torch
        src = torch.randn((ROWS, ROW // 2)).to(torch.bfloat16)
        t = self.tier(src.view(torch.int16).numpy())
        ks = keys(2, "bf16")
        self.store(t, ks, [0, 1])
        dst = torch.zeros((ROWS, ROW // 2), dtype=torch.bfloat16)
        t2 = self.tier(dst.view(torch.int16).numpy())
        j = self.job(ks, [2, 3], promotion=True)
        t2.submit_load(j)
        self.assertTrue(self.finished(t2, 1)[j.job_id].success)
        self.assertTrue(torch.equal(dst[2:4].view(torch.int16), src[:2].view(torch.int16)))


class Options(unittest.TestCase):

    def test_an_unknown_option_is_refused_with_its_name(self):
        with self.assertRaisesRegex(ValueError, "unknown tier option.*sokcet"):
            Tier(offloading_spec=S.fake_spec(), primary_kv_view=memoryview(random_region()),
                 tier_type="KvhostTier", sokcet="/x")

    def test_a_missing_daemon_with_reconnect_s_0_is_a_clear_connection_error(self):
        with self.assertRaisesRegex(ConnectionError, "cannot connect to the kvhost daemon at /nonexistent"):
            Tier(offloading_spec=S.fake_spec(), primary_kv_view=memoryview(random_region()),
                 tier_type="KvhostTier", socket="/nonexistent/kvhost.sock", reconnect_s=0)

    def test_a_missing_daemon_starts_the_tier_without_it(self):
        # The daemon may come up after vLLM: the tier misses until it does
        # (test_vllm_real_tier.DaemonNotUpAtStart connects it later).
        t = Tier(offloading_spec=S.fake_spec(), primary_kv_view=memoryview(random_region()),
                 tier_type="KvhostTier", socket="/nonexistent/kvhost.sock")
        self.addCleanup(t.shutdown)
        c = t.counters()
        self.assertEqual((c["connected"], c["data_path"], t.namespace), (False, None, None))
        self.assertEqual(t.lookup(b"k" * 36), S.LookupResult.MISS)
        with self.assertRaisesRegex(ConnectionError, "no kvhost daemon has answered"):
            t.daemon_stats()

    def test_a_daemon_shutting_down_at_start_is_no_daemon_yet(self):
        # A daemon that began stopping (a restart, an upgrade) while vLLM
        # connects answers "shutting down": to the Hello, or, having
        # welcomed the client, to its Declare. Another daemon comes next:
        # the tier starts without it, as with none there; with
        # reconnect_s = 0 it refuses, as without a daemon.
        for at in ("hello", "request"):
            for vllm_fs in (False, True):
                with self.subTest(at=at, vllm_fs=vllm_fs):
                    stopping = d.Stopping(at)
                    self.addCleanup(stopping.close)
                    t = Tier(offloading_spec=S.fake_spec(), primary_kv_view=memoryview(random_region()),
                             tier_type="KvhostTier", socket=stopping.socket, vllm_fs=vllm_fs, reconnect_s=3600)
                    self.addCleanup(t.shutdown)
                    self.assertEqual((t.counters()["connected"], t.namespace), (False, None))
                    self.assertEqual(t.lookup(b"k" * 36), S.LookupResult.MISS)
                    with self.assertRaisesRegex(ConnectionError, "shutting down"):
                        Tier(offloading_spec=S.fake_spec(), primary_kv_view=memoryview(random_region()),
                             tier_type="KvhostTier", socket=stopping.socket, vllm_fs=vllm_fs, reconnect_s=0)

    def test_a_bad_zero_copy_value_is_refused(self):
        with self.assertRaisesRegex(ValueError, "zero_copy: want off, auto or on"):
            Tier(offloading_spec=S.fake_spec(), primary_kv_view=memoryview(random_region()),
                 tier_type="KvhostTier", zero_copy="maybe", socket="/x")

    def test_a_request_timeout_that_is_not_a_positive_finite_number_is_refused(self):
        for bad in (0, -1, float("inf"), True, "30"):
            with self.subTest(request_timeout_s=bad), self.assertRaisesRegex(ValueError, "request_timeout_s"):
                Tier(offloading_spec=S.fake_spec(), primary_kv_view=memoryview(random_region()),
                     tier_type="KvhostTier", request_timeout_s=bad, socket="/x")

    def test_a_daemon_wait_that_is_not_a_positive_finite_number_is_refused(self):
        for bad in (0, -1, float("inf"), float("nan"), True, "2"):
            with self.subTest(daemon_wait_s=bad), self.assertRaisesRegex(ValueError, "daemon_wait_s"):
                Tier(offloading_spec=S.fake_spec(), primary_kv_view=memoryview(random_region()),
                     tier_type="KvhostTier", daemon_wait_s=bad, socket="/x")

    def test_a_duration_that_is_not_seconds_at_least_zero_is_refused(self):
        for k in ("lookup_ttl_s", "lookup_wait_s", "job_timeout_s", "reconnect_s"):
            for bad in (-1, float("nan"), float("inf"), True, "30"):
                with self.subTest(option=k, value=bad), self.assertRaisesRegex(ValueError, f"{k}: want seconds >= 0"):
                    Tier(offloading_spec=S.fake_spec(), primary_kv_view=memoryview(random_region()),
                         tier_type="KvhostTier", socket="/x", **{k: bad})


class VersionWindow(unittest.TestCase):

    def test_a_vllm_without_successful_keys_is_refused_naming_the_window(self):
        import dataclasses
        import types

        @dataclasses.dataclass
        class OldJobResult:
            job_id: int
            success: bool
        api = types.SimpleNamespace(**vars(S.API))
        api.JobResult = OldJobResult
        with self.assertRaisesRegex(kv.UnsupportedVLLM, "JobResult.successful_keys.*supported: vLLM with"):
            kv.tier_class(api)

    def test_a_vllm_requiring_unknown_abstract_methods_is_refused(self):
        import abc
        import types

        class Newer(S.SecondaryTierManager):
            @abc.abstractmethod
            def prefetch(self, keys): ...
        api = types.SimpleNamespace(**vars(S.API))
        api.SecondaryTierManager = Newer
        with self.assertRaisesRegex(kv.UnsupportedVLLM, "prefetch"):
            kv.tier_class(api)

    def run_python(self, code, path=()):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([*path, str(HERE.parent / "src")]))
        r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                           capture_output=True, text=True, timeout=120)
        return r

    def test_importing_the_package_imports_no_vllm_and_works_without_it(self):
        r = self.run_python("""
            import sys
            import kvhost.vllm as kv
            assert not any(m == 'vllm' or m.startswith('vllm.') for m in sys.modules), 'vllm imported'
            T = kv.KvhostTier
            print(kv.detect().name, ' '.join(c.__module__ for c in T.__mro__))
        """)
        self.assertEqual(r.returncode, 0, r.stderr)
        words = r.stdout.split()
        self.assertEqual(words[0], "standalone")
        self.assertIn("kvhost.vllm._compat", words, "not based on the fallback SecondaryTierManager")

    def fake_vllm(self, job_result_fields):
        """A vllm package with only the light kv_offload modules, from the
        stand-ins, in a temporary directory removed when the test ends."""
        root = tempfile.mkdtemp(prefix="fake-vllm-")
        self.addCleanup(shutil.rmtree, root, True)
        pkg = pathlib.Path(root, "vllm", "v1", "kv_offload", "tiering")
        pkg.mkdir(parents=True)
        for p in (pkg.parents[2], pkg.parents[1], pkg.parents[0], pkg):
            (p / "__init__.py").write_text("")
        src = (HERE / "vllm_standins.py").read_text()
        (pkg.parent / "base.py").write_text(src)
        jr = "JobResult" if job_result_fields else "_OldJobResult"
        (pkg / "base.py").write_text(
            "import dataclasses\n"
            "from vllm.v1.kv_offload.base import SecondaryTierManager, TransferJob, JobResult\n"
            "@dataclasses.dataclass\nclass _OldJobResult:\n    job_id: int\n    success: bool\n"
            f"JobResult = {jr}\n")
        return root

    def test_vllm_factory_loading_subclasses_the_installed_secondary_tier_manager(self):
        root = self.fake_vllm(True)
        r = self.run_python("""
            import importlib
            from vllm.v1.kv_offload.tiering.base import SecondaryTierManager
            cls = getattr(importlib.import_module('kvhost.vllm'), 'KvhostTier')
            assert issubclass(cls, SecondaryTierManager), cls.__mro__
            print(cls.medium)
        """, [root])
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stdout.strip(), "Medium.STORAGE")

    def test_an_installed_vllm_outside_the_window_is_refused_at_load(self):
        root = self.fake_vllm(False)
        r = self.run_python("import kvhost.vllm as kv; kv.KvhostTier", [root])
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("UnsupportedVLLM", r.stderr)
        self.assertIn("supported: vLLM with the secondary-tier interface", r.stderr)


if __name__ == "__main__":
    unittest.main()
