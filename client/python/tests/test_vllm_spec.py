"""KvhostOffloadingSpec driven in vLLM's call order against a real kvhost
daemon, with CPU torch tensors in shared memory standing in for the GPU
KV caches (the GPU machine runs the same with CUDA tensors:
gpu_spec_check.py).

Run: cd client/python && PYTHONPATH=src /usr/bin/python3 -m unittest test_vllm_spec (from tests/)
"""

import importlib.util
import pathlib
import pickle
import sys
import types
import unittest

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

import kvhost  # noqa: E402
from kvhost import vllm as kv  # noqa: E402

import daemon as d  # noqa: E402
import vllm_standins as S  # noqa: E402

HAVE_TORCH = importlib.util.find_spec("torch") is not None
Spec = kv.spec_class(S.SPEC_API)
CTX = S.ReqContext(req_id="req-0")
LAYERS, PAGE, BLOCKS = 4, 4096, 64
FILE_BYTES = 4096 + LAYERS * PAGE  # header + one key's pages


def keys(n, prefix="k", group=0):
    return [S.offload_key((prefix, i), group) for i in range(n)]


def kv_caches(layers=LAYERS, page=PAGE, blocks=BLOCKS, shared=True, seed=0):
    """CanonicalKVCaches over int8 (blocks, page) tensors in shared memory:
    one memfd for every layer (shared=True, views of one storage) or one
    per layer. Returns (caches, tensors, buffers)."""
    import torch
    g = torch.Generator().manual_seed(seed)
    bufs = []
    if shared:
        big, buf = kvhost.torch_host_tensor((layers, blocks, page), torch.int8, name="spec-test")
        bufs.append(buf)
        tensors = [big[i] for i in range(layers)]
    else:
        tensors = []
        for _ in range(layers):
            t, buf = kvhost.torch_host_tensor((blocks, page), torch.int8, name="spec-test")
            tensors.append(t)
            bufs.append(buf)
    for t in tensors:
        t.copy_(torch.randint(-128, 128, t.shape, generator=g, dtype=torch.int8))
    caches = S.CanonicalKVCaches(tensors=[S.CanonicalKVCacheTensor(t) for t in tensors],
                                 group_data_refs=[[(i, page) for i in range(layers)]])
    return caches, tensors, bufs


def rows(tensors, blocks):
    """The bytes of blocks, layer by layer (what a load must reproduce)."""
    return [bytes(t[b].numpy().tobytes()) for t in tensors for b in blocks]


@unittest.skipUnless(HAVE_TORCH, "torch is not installed (Debian: apt-get install python3-torch)")
class SpecCase(unittest.TestCase):
    capacity = "1GiB"

    @classmethod
    def setUpClass(cls):
        cls.daemon = d.Daemon(capacity=cls.capacity)

    @classmethod
    def tearDownClass(cls):
        cls.daemon.stop()

    def setUp(self):
        self.closers = []
        self.job = 0

    def tearDown(self):
        for c in reversed(self.closers):
            c()

    def spec(self, **kw):
        s = Spec(S.fake_offloading_config(self.daemon.socket, **kw))
        return s

    def manager(self, spec):
        m = spec.get_manager()
        self.closers.append(m.shutdown)
        return m

    def worker(self, spec, caches):
        w = spec.get_worker(caches)
        self.closers.append(w.shutdown)
        return w

    def buffers(self, bufs):
        for b in bufs:
            self.closers.insert(0, b.close)

    def answer(self, m, key, want):
        """lookup() as the scheduler repeats it: RETRY until the daemon answered."""
        R = S.LookupResult
        got = d.wait_for(lambda: (lambda r: r if r != R.RETRY else None)(m.lookup(key, CTX)),
                         what="a lookup answer")
        self.assertEqual(got, want, key.hex())
        return got

    def transfer(self, w, store, kv_spec, blocks):
        """submit_* → wait → get_finished, as vLLM's worker runs a job."""
        self.job += 1
        gpu = S.GPULoadStoreSpec(blocks, [len(blocks)])
        kv_spec = pickle.loads(pickle.dumps(kv_spec))  # it travels to the worker
        if store:
            ok = w.submit_store(self.job, gpu, kv_spec)
        else:
            ok = w.submit_load(self.job, kv_spec, gpu)
        self.assertTrue(ok)
        w.wait([self.job])
        res = []
        d.wait_for(lambda: res.extend(w.get_finished()) or res, what="the transfer result")
        self.assertEqual(len(res), 1)
        self.assertEqual(res[0].job_id, self.job)
        return res[0]

    def store(self, m, w, ks, blocks):
        out = m.prepare_store(ks, CTX)
        self.assertIsNotNone(out)
        res = self.transfer(w, True, out.store_spec, [blocks[ks.index(k)] for k in out.keys_to_store])
        self.assertTrue(res.success)
        m.complete_store(out.keys_to_store, CTX, success=True)
        return out, res


class TestSchedulerAndWorker(SpecCase):
    def test_store_lookup_load_round_trip_block_for_block(self):
        spec = self.spec()
        m = self.manager(spec)
        caches, tensors, bufs = kv_caches()
        self.buffers(bufs)
        w = self.worker(spec, caches)
        ks = keys(8, "round")
        src = list(range(8))
        self.assertEqual(m.lookup(ks[0], CTX), S.LookupResult.RETRY)  # the daemon is being asked
        self.answer(m, ks[0], S.LookupResult.MISS)

        # prepare_store keeps the input order; its spec is picklable.
        shuffled = [ks[i] for i in (3, 0, 7, 1, 6, 2, 5, 4)]
        out, res = self.store(m, w, shuffled, [src[ks.index(k)] for k in shuffled])
        self.assertEqual(out.keys_to_store, shuffled)
        self.assertEqual(out.evicted_keys, [])
        self.assertEqual(res.transfer_size, 8 * LAYERS * PAGE)
        self.assertGreater(res.transfer_time, 0)
        ev = list(m.take_events())
        self.assertEqual([(sorted(e.keys), e.removed) for e in ev], [(sorted(shuffled), False)])

        # Stored keys are not offered again.
        again = m.prepare_store(ks, CTX)
        self.assertEqual(again.keys_to_store, [])

        for k in ks:
            self.answer(m, k, S.LookupResult.HIT)
        want = rows(tensors, src)
        dst = list(range(32, 40))
        for t in tensors:
            t[dst[0]:dst[-1] + 1].zero_()
        load_spec = m.prepare_load(ks, CTX)
        res = self.transfer(w, False, load_spec, dst)
        self.assertTrue(res.success)
        self.assertEqual(res.transfer_size, 8 * LAYERS * PAGE)
        self.assertEqual(rows(tensors, dst), want)
        m.complete_load(ks, CTX)
        st = m.get_stats()
        self.assertEqual(st["pinned_now"], 0)
        self.assertEqual(st["loading_now"], 0)
        ws = w.get_stats()
        self.assertEqual((ws["stored_keys"], ws["loaded_keys"], ws["failed_load_jobs"]), (8, 8, 0))

    def test_hit_pending_while_this_manager_stores(self):
        spec = self.spec()
        m = self.manager(spec)
        k = keys(1, "pending")[0]
        out = m.prepare_store([k], CTX)
        self.assertEqual(out.keys_to_store, [k])
        self.assertEqual(m.lookup(k, CTX), S.LookupResult.HIT_PENDING)
        m.complete_store([k], CTX, success=False)
        self.assertEqual(m.get_stats()["store_failed_keys"], 1)
        self.answer(m, k, S.LookupResult.MISS)

    def test_failed_load_is_reported_and_counted(self):
        spec = self.spec()
        caches, _, bufs = kv_caches()
        self.buffers(bufs)
        w = self.worker(spec, caches)
        # A load of a key that is not stored: vLLM never asks for one (no
        # HIT), but if it did the worker must not claim success.
        res = self.transfer(w, False, kv.KvhostLoadStoreSpec(keys(1, "never")), [5])
        self.assertFalse(res.success)
        self.assertEqual(w.get_stats()["failed_load_jobs"], 1)

    def test_reset_cache_releases_pins(self):
        spec = self.spec()
        m = self.manager(spec)
        caches, _, bufs = kv_caches(shared=False)
        self.buffers(bufs)
        w = self.worker(spec, caches)
        ks = keys(3, "reset")
        self.store(m, w, ks, [0, 1, 2])
        for k in ks:
            self.answer(m, k, S.LookupResult.HIT)
        self.assertEqual(m.get_stats()["pinned_now"], 3)
        self.assertTrue(m.reset_cache())
        self.assertEqual(m.get_stats()["pinned_now"], 0)
        # Nothing pins them any more: the daemon deletes them. The pin
        # thread sends the releases on its own time, one pin at a time, so
        # a delete can come between two of them: count what every delete
        # removed rather than wait for one that removes all three.
        with kvhost.Client(self.daemon.socket) as c:
            ns = c.declare(kv.spec_compat.geometry(kv.spec_compat.describe(
                spec.config, spec._opts, 0, 0)))
            daemon_keys = [kv.spec_compat.daemon_key(k) for k in ks]
            deleted = 0

            def all_deleted():
                nonlocal deleted
                deleted += c.delete(ns, daemon_keys)
                return deleted == 3 or None
            d.wait_for(all_deleted, what="the daemon to delete the released keys")
            self.assertEqual(c.lookup(ns, daemon_keys), 0)


class TestHitWindow(SpecCase):
    def test_an_unused_hit_is_unpinned_after_its_window_and_asked_again(self):
        spec = self.spec(pin_lease_s=1, hit_window_s=0.2)
        m = self.manager(spec)
        caches, _, bufs = kv_caches()
        self.buffers(bufs)
        w = self.worker(spec, caches)
        k = keys(1, "window")[0]
        self.store(m, w, [k], [0])
        self.answer(m, k, S.LookupResult.HIT)
        d.wait_for(lambda: m.get_stats().get("pins_expired_unused"), what="the HIT window to pass")
        self.assertEqual(m.get_stats()["pinned_now"], 0)
        self.assertEqual(m.lookup(k, CTX), S.LookupResult.RETRY)  # asked again
        self.answer(m, k, S.LookupResult.HIT)


@unittest.skipUnless(HAVE_TORCH, "torch is not installed")
class TestDaemonPins(SpecCase):
    """The daemon's Pin/Unpin as the Python client sends them."""

    def setUp(self):
        super().setUp()
        spec = self.spec()
        m = self.manager(spec)
        caches, _, bufs = kv_caches()
        self.buffers(bufs)
        w = self.worker(spec, caches)
        self.ks = keys(2, "raw-pin")
        self.store(m, w, self.ks, [0, 1])
        self.geo = kv.spec_compat.geometry(kv.spec_compat.describe(spec.config, spec._opts, 0, 0))

    def test_pin_answers_per_key_and_refuses_delete_until_unpinned(self):
        with kvhost.Client(self.daemon.socket) as c:
            ns = c.declare(self.geo)
            pin, held = c.pin(ns, [self.ks[0], b"never-stored", self.ks[1]])
            self.assertNotEqual(pin, 0)
            self.assertEqual(held, [True, False, True])
            self.assertEqual(c.delete(ns, self.ks), 0)
            self.assertEqual(c.lookup(ns, self.ks), 2)
            self.assertEqual(c.unpin(pin), 2)
            self.assertEqual(c.unpin(pin), 0)
            self.assertEqual(c.delete(ns, self.ks[:1]), 1)

    def test_lease_and_connection_end_release_pins(self):
        with kvhost.Client(self.daemon.socket) as c:
            ns = c.declare(self.geo)
            pin, _ = c.pin(ns, self.ks[:1], lease_s=0.05)
            d.wait_for(lambda: c.delete(ns, self.ks[:1]) == 1 or None, what="the lease to end")
            self.assertEqual(c.unpin(pin), 0)
            with kvhost.Client(self.daemon.socket) as other:
                ons = other.declare(self.geo)
                _, held = other.pin(ons, self.ks[1:])
                self.assertEqual(held, [True])
                self.assertEqual(c.delete(ns, self.ks[1:]), 0)
            d.wait_for(lambda: c.delete(ns, self.ks[1:]) == 1 or None,
                       what="the closed connection's pin to go")
        with kvhost.Client(self.daemon.socket) as c, self.assertRaises(ValueError):
            c.pin(1, self.ks, lease_s=-1)


class TestTensorParallel(SpecCase):
    def test_hit_only_when_every_rank_has_the_key(self):
        specs = [self.spec(tp=2, rank=r) for r in range(2)]
        m = self.manager(specs[0])
        workers = []
        for r in range(2):
            caches, _, bufs = kv_caches(seed=r)
            self.buffers(bufs)
            workers.append(self.worker(specs[r], caches))
        self.assertEqual([w.rank for w in workers], [0, 1])
        self.assertNotEqual(workers[0].namespaces, workers[1].namespaces)
        k = keys(1, "tp")[0]
        out = m.prepare_store([k], CTX)
        self.assertTrue(self.transfer(workers[0], True, out.store_spec, [3]).success)
        m.complete_store([k], CTX, success=False)  # rank 1 never stored it
        self.answer(m, k, S.LookupResult.MISS)
        out = m.prepare_store([k], CTX)
        for w in workers:
            self.assertTrue(self.transfer(w, True, out.store_spec, [3]).success)
        m.complete_store([k], CTX)
        self.answer(m, k, S.LookupResult.HIT)


class TestEvictionPressure(SpecCase):
    # 16 files' worth: the daemon must evict while we store 40 more keys.
    capacity = f"{16 * FILE_BYTES}B"

    def test_pinned_key_survives_between_prepare_load_and_complete_load(self):
        spec = self.spec()
        m = self.manager(spec)
        caches, tensors, bufs = kv_caches()
        self.buffers(bufs)
        w = self.worker(spec, caches)
        k = keys(1, "precious")[0]
        self.store(m, w, [k], [0])
        want = rows(tensors, [0])
        self.answer(m, k, S.LookupResult.HIT)
        load_spec = m.prepare_load([k], CTX)

        # Another engine fills the daemon far past its capacity.
        spec2 = self.spec(namespace="other-engine")
        m2 = self.manager(spec2)
        caches2, _, bufs2 = kv_caches(seed=9)
        self.buffers(bufs2)
        w2 = self.worker(spec2, caches2)
        for i in range(5):
            ks = keys(8, f"pressure{i}")
            self.store(m2, w2, ks, list(range(8)))
        evictions = self.daemon_stats()["evictions"]
        self.assertGreater(evictions, 0, "no eviction: the test proves nothing")

        for t in tensors:
            t[50].zero_()
        res = self.transfer(w, False, load_spec, [50])
        self.assertTrue(res.success)
        self.assertEqual(rows(tensors, [50]), want)
        m.complete_load([k], CTX)
        d.wait_for(lambda: m.get_stats().get("daemon_unpins", 0) == m.get_stats()["daemon_pins"],
                   what="the manager to release its pins")

        # Released, it is evictable again: more pressure removes it.
        for i in range(5, 10):
            self.store(m2, w2, keys(8, f"pressure{i}"), list(range(8)))
        self.answer(m, k, S.LookupResult.MISS)
        self.assertEqual([e.removed for e in m.take_events()], [False, True])

    def daemon_stats(self):
        with kvhost.Client(self.daemon.socket) as c:
            return c.stats()


class TestRefusals(unittest.TestCase):
    def test_unsupported_vllm_names_the_window(self):
        @__import__("dataclasses").dataclass
        class OldResult:  # a TransferResult without transfer_size/transfer_time
            job_id: int
            success: bool
        api = types.SimpleNamespace(**vars(S.SPEC_API))
        api.TransferResult = OldResult
        with self.assertRaises(kv.UnsupportedVLLM) as cm:
            kv.spec_class(api)
        self.assertIn("TransferResult.transfer_size", str(cm.exception))
        self.assertIn("2026-08-17", str(cm.exception))

    def test_spec_without_the_methods_vllm_requires(self):
        class Base(S.OffloadingSpec):
            @__import__("abc").abstractmethod
            def get_handlers(self): ...
        api = types.SimpleNamespace(**vars(S.SPEC_API))
        api.OffloadingSpec = Base
        with self.assertRaises(kv.UnsupportedVLLM) as cm:
            kv.spec_class(api)
        self.assertIn("get_handlers", str(cm.exception))

    def test_bad_configs_are_refused_with_the_reason(self):
        cfg = S.fake_offloading_config("/nonexistent.sock")
        cfg.vllm_config.parallel_config.pipeline_parallel_size = 2
        with self.assertRaisesRegex(ValueError, "pipeline parallelism"):
            Spec(cfg)
        with self.assertRaisesRegex(ValueError, "unknown spec option"):
            Spec(S.fake_offloading_config("/nonexistent.sock", pin_leese_s=3))
        with self.assertRaisesRegex(ValueError, "pin_lease_s"):
            Spec(S.fake_offloading_config("/nonexistent.sock", pin_lease_s=0))


class TestDaemonWithoutPins(unittest.TestCase):
    def test_the_manager_refuses_a_daemon_that_cannot_pin(self):
        """A daemon of before Pin answers it "unknown type": the manager
        refuses to start (it could never answer HIT) instead of missing
        forever."""
        import socket
        import struct
        import tempfile
        import threading
        from kvhost import protocol as P
        tmp = tempfile.mkdtemp(prefix="kvhost-old-daemon-")
        self.addCleanup(__import__("shutil").rmtree, tmp, True)
        path = f"{tmp}/old.sock"
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(path)
        srv.listen(1)
        self.addCleanup(srv.close)

        def old_daemon():
            conn, _ = srv.accept()
            with conn:
                f = conn.makefile("rb")
                for _ in range(2):
                    n, t, _, rid = P.HEADER.unpack(f.read(P.HEADER_SIZE))
                    f.read(n)
                    if t == P.T_HELLO:
                        body = struct.pack("<HH7I", 1, 0, 1 << 20, 64, 256, 64, 64, 4096, 64) + b"\x03old"
                        conn.sendall(P.frame(P.T_HELLO | P.T_REPLY, rid, body))
                    else:
                        msg = f"type(0x{t:04x}) is not a request".encode()
                        conn.sendall(P.frame(P.T_ERROR, rid, struct.pack("<BBH", 3, 0, len(msg)) + msg))
                f.read(1)  # until the client closes

        th = threading.Thread(target=old_daemon, daemon=True)
        th.start()
        spec = Spec(S.fake_offloading_config(path))
        with self.assertRaisesRegex(RuntimeError, "does not support pins"):
            spec.get_manager()
        th.join(10)


@unittest.skipUnless(HAVE_TORCH, "torch is not installed")
class TestWorkerChecks(SpecCase):
    def test_page_size_mismatch_is_refused(self):
        spec = self.spec()
        caches, _, bufs = kv_caches()
        self.buffers(bufs)
        caches.group_data_refs = [[(i, PAGE // 2) for i in range(LAYERS)]]
        with self.assertRaisesRegex(ValueError, "namespace would differ"):
            spec.get_worker(caches)

    def test_private_host_memory_is_refused(self):
        import torch
        spec = self.spec()
        tensors = [torch.zeros((BLOCKS, PAGE), dtype=torch.int8) for _ in range(LAYERS)]
        caches = S.CanonicalKVCaches([S.CanonicalKVCacheTensor(t) for t in tensors],
                                     [[(i, PAGE) for i in range(LAYERS)]])
        with self.assertRaisesRegex(ValueError, "shared memory"):
            spec.get_worker(caches)


if __name__ == "__main__":
    unittest.main()
