"""KvhostOffloadingSpec driven in vLLM's call order against a real kvhost
daemon, with CPU torch tensors in shared memory standing in for the GPU
KV caches (the GPU machine runs the same with CUDA tensors:
gpu_spec_check.py). vLLM's classes are the stand-ins of vllm_standins.py
(vLLM main 017e9f44); test_vllm_real_spec.py runs the same against vLLM's
own code.

Run: cd client/python && PYTHONPATH=src /usr/bin/python3 -m unittest tests.test_vllm_spec -v
"""

import contextlib
import dataclasses
import importlib.util
import logging
import os
import pathlib
import pickle
import signal
import sys
import threading
import time
import types
import unittest
from unittest import mock

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

import kvhost  # noqa: E402
from kvhost import vllm as kv  # noqa: E402
from kvhost import protocol as P  # noqa: E402
from kvhost.vllm import _metrics, _namespace, spec_compat as sc, spec_worker  # noqa: E402

import daemon as d  # noqa: E402
import vllm_standins as S  # noqa: E402

HAVE_TORCH = importlib.util.find_spec("torch") is not None
Spec = kv.spec_class(S.SPEC_API)
CTX = S.ReqContext(req_id="req-0")
LAYERS, PAGE, BLOCKS = 4, 4096, 64
FILE_BYTES = 4096 + LAYERS * PAGE  # header + one key's pages


def keys(n, prefix="k", group=0):
    return [S.offload_key((prefix, i), group) for i in range(n)]


def kv_caches(layers=LAYERS, page=PAGE, blocks=BLOCKS, shared=True, seed=0, groups=1, ref_page=None,
              tensor_page=None):
    """CanonicalKVCaches as vLLM's connector builds them, over int8
    (blocks, page) tensors in shared memory: one memfd for every layer
    (shared=True, views of one storage) or one per layer. groups > 1 is a
    hybrid model: every group's layer i uses tensor i (vLLM shares the
    tensors across groups). Returns (caches, tensors, buffers)."""
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
    caches = S.CanonicalKVCaches(
        tensors=[S.CanonicalKVCacheTensor(t, tensor_page or page) for t in tensors],
        group_data_refs=[[S.CanonicalKVCacheRef(i, ref_page or page) for i in range(layers)]
                         for _ in range(groups)])
    return caches, tensors, bufs


def config(socket, engine_id=None, agnostic=False, events=True, **kw):
    """S.fake_offloading_config with vLLM's own fields set too: the engine
    id, whether vLLM calls the bytes parallelism-agnostic, and its KV cache
    events (on: these tests read the manager's events)."""
    cfg = dataclasses.replace(S.fake_offloading_config(socket, **kw), enable_kv_cache_events=events)
    if engine_id is not None:
        cfg = dataclasses.replace(cfg, engine_id=engine_id)
    if agnostic:
        cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, is_parallelism_agnostic=True))
    return cfg


def rows(tensors, blocks):
    """The bytes of blocks, layer by layer (what a load must reproduce)."""
    return [bytes(t[b].numpy().tobytes()) for t in tensors for b in blocks]


def answer_of(m, key, ctx=CTX):
    """lookup() as the scheduler repeats it: RETRY until the daemon answered."""
    R = S.LookupResult
    return d.wait_for(lambda: (lambda r: r if r != R.RETRY else None)(m.lookup(key, ctx)),
                      what="a lookup answer")


def settled(m):
    """Waits until the manager has asked the daemon about every completed
    store (its stored events follow only then)."""
    d.wait_for(lambda: m.counters().get("verifying_now", 0) == 0, what="the manager to check its completed stores")


# These tests hand the worker CanonicalKVCaches of their own, not built by
# vLLM's worker set-up: there is no attention backend or KV cache layout to
# observe, as without vLLM (under make test-vllm vLLM's modules are there).
# TestPageLayout observes ones of its own.
OBSERVE_LAYOUT = spec_worker.observe_layout  # the function itself (TestObserveLayout)
_UNOBSERVED = mock.patch.object(spec_worker, "observe_layout", lambda groups: None)


def setUpModule():
    _UNOBSERVED.start()


def tearDownModule():
    _UNOBSERVED.stop()


def observed(backend="FLASH_ATTN", layout="HND"):
    """Within it, every worker's vLLM set-up reports backend for each of its
    layers and the KV cache layout layout (what observe_layout reads from
    vLLM's current config and get_kv_cache_layout())."""
    return mock.patch.object(spec_worker, "observe_layout",
                             lambda groups: ([[backend] * len(g["layer_names"]) for g in groups], layout))


def slab_caches(layers=LAYERS, page=PAGE, blocks=BLOCKS, seed=0):
    """CanonicalKVCaches as vLLM's register_cross_layers_kv_cache builds
    them: one int8 (blocks, layers × page) tensor, one reference of
    layers × page bytes. Returns (caches, per-layer views, buffers)."""
    import torch
    big, buf = kvhost.torch_host_tensor((blocks, layers * page), torch.int8, name="spec-slab")
    big.copy_(torch.randint(-128, 128, big.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.int8))
    caches = S.CanonicalKVCaches(tensors=[S.CanonicalKVCacheTensor(big, layers * page)],
                                 group_data_refs=[[S.CanonicalKVCacheRef(0, layers * page)]])
    return caches, [big[:, i * page:(i + 1) * page] for i in range(layers)], [buf]


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
        return Spec(config(self.daemon.socket, **kw))

    def manager(self, spec):
        m = spec.get_manager()
        self.closers.append(m.shutdown)
        return m

    def worker(self, spec, caches):
        w = spec.get_worker(caches)
        self.closers.append(w.shutdown)
        return w

    def caches(self, **kw):
        caches, tensors, bufs = kv_caches(**kw)
        for b in bufs:
            self.closers.insert(0, b.close)
        return caches, tensors

    def answer(self, m, key, want):
        got = answer_of(m, key)
        self.assertEqual(got, want, key.hex())
        return got

    def transfer(self, w, store, kv_spec, blocks, group_sizes=None, block_indices=None):
        """submit_* → wait → get_finished, as vLLM's worker runs a job."""
        self.job += 1
        sizes = group_sizes or [len(blocks)]
        gpu = S.GPULoadStoreSpec(blocks, sizes, block_indices or [0] * len(sizes))
        kv_spec = pickle.loads(pickle.dumps(kv_spec))  # it travels to the worker
        if store:
            ok = w.submit_store(self.job, gpu, kv_spec)
        else:
            ok = w.submit_load(self.job, kv_spec, gpu)
        self.assertTrue(ok)
        w.wait({self.job})
        res = []
        d.wait_for(lambda: res.extend(w.get_finished()) or res, what="the transfer result")
        self.assertEqual(len(res), 1)
        self.assertEqual(res[0].job_id, self.job)
        return res[0]

    def store(self, m, workers, ks, blocks):
        """prepare_store → every worker stores → complete_store."""
        out = m.prepare_store(ks, CTX)
        self.assertIsNotNone(out)
        for w in workers if isinstance(workers, list) else [workers]:
            res = self.transfer(w, True, out.store_spec, [blocks[ks.index(k)] for k in out.keys_to_store])
            self.assertTrue(res.success)
        m.complete_store(out.keys_to_store, CTX, success=True)
        settled(m)
        return out

    @contextlib.contextmanager
    def held_pin_round(self, key):
        """Within it, the first daemon pin that carries key (the manager's
        round that pins a load's keys again) waits, up to 30 s, for the
        gate: yields (entered, gate), two threading.Events."""
        entered, gate = threading.Event(), threading.Event()
        real_pin = kvhost.Client._pin  # what pin and pin_loadable send

        def pin(client, ftype, ns, dkeys, *a, **kw):
            if sc.daemon_key(key) in dkeys and not entered.is_set():
                entered.set()
                gate.wait(30)
            return real_pin(client, ftype, ns, dkeys, *a, **kw)

        kvhost.Client._pin = pin
        try:
            yield entered, gate
        finally:
            gate.set()
            kvhost.Client._pin = real_pin

    def daemon_stats(self):
        with kvhost.Client(self.daemon.socket) as c:
            return c.stats()

    def other_engine_stores(self, prefix):
        """Another engine (namespace "other-engine": a manager and a
        worker of its own) stores 40 keys named prefix: (its manager, its
        worker)."""
        spec = self.spec(namespace="other-engine")
        m = self.manager(spec)
        caches, _ = self.caches(seed=9)
        w = self.worker(spec, caches)
        for i in range(5):
            self.store(m, w, keys(8, f"{prefix}{i}"), list(range(8)))
        return m, w

    def crash_and_start_again(self, m, probe):
        """SIGKILL the daemon, wait for manager m to see it gone (a lookup
        of a key named probe answers MISS), start a new daemon on the same
        directory and wait for m to connect to it."""
        self.daemon.halt(signal.SIGKILL)
        try:
            d.wait_for(lambda: m.lookup(keys(1, probe)[0], CTX) == S.LookupResult.MISS
                       and not m.counters()["connected"], what="the manager to see the daemon gone")
        finally:
            self.daemon.start_again()
        d.wait_for(lambda: m.counters()["connected"], what="the manager to connect again")

    def restarting(self, seed, **kw):
        """A manager and a worker that connect again every 0.05 s (spec
        options kw): (manager, worker, the worker's tensors)."""
        spec = self.spec(reconnect_s=0.05, **kw)
        m = self.manager(spec)
        caches, tensors = self.caches(seed=seed)
        return m, self.worker(spec, caches), tensors

    def pinned(self, m, w, prefix, tensors):
        """Four keys stored and answered HIT (pinned): (keys, their rows)."""
        ks = keys(4, prefix)
        self.store(m, w, ks, [0, 1, 2, 3])
        for k in ks:
            self.answer(m, k, S.LookupResult.HIT)
        return ks, rows(tensors, [0, 1, 2, 3])

@unittest.skipUnless(HAVE_TORCH, "torch is not installed (Debian: apt-get install python3-torch)")
class TestSchedulerAndWorker(SpecCase):
    def test_store_lookup_load_round_trip_block_for_block(self):
        spec = self.spec()
        m = self.manager(spec)
        caches, tensors = self.caches()
        w = self.worker(spec, caches)
        ks = keys(8, "round")
        src = list(range(8))
        self.assertEqual(m.lookup(ks[0], CTX), S.LookupResult.RETRY)  # the daemon is being asked
        self.answer(m, ks[0], S.LookupResult.MISS)

        # prepare_store keeps the input order; its spec is picklable.
        shuffled = [ks[i] for i in (3, 0, 7, 1, 6, 2, 5, 4)]
        out = m.prepare_store(shuffled, CTX)
        self.assertEqual(out.keys_to_store, shuffled)
        self.assertEqual(out.evicted_keys, [])
        res = self.transfer(w, True, out.store_spec, [src[ks.index(k)] for k in shuffled])
        self.assertTrue(res.success)
        m.complete_store(shuffled, CTX, success=True)
        settled(m)
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
        st = m.counters()
        self.assertEqual(st["pinned_now"], 0)
        self.assertEqual(st["loading_now"], 0)
        ws = w.counters()
        self.assertEqual((ws["stored_keys"], ws["loaded_keys"], ws["failed_load_jobs"]), (8, 8, 0))

    def test_manager_takes_vllms_calls_and_keeps_the_engine_stepping_while_a_lookup_is_unanswered(self):
        spec = self.spec()
        m = self.manager(spec)
        self.assertIsInstance(m.on_new_request(CTX), S.RequestOffloadingContext)
        k = keys(1, "calls")[0]
        self.assertEqual(m.lookup(k, CTX), S.LookupResult.RETRY)
        # vLLM steps again only while has_pending_work: it must hold until
        # lookup stops answering RETRY.
        self.assertTrue(m.has_pending_work() or m.lookup(k, CTX) != S.LookupResult.RETRY)
        self.answer(m, k, S.LookupResult.MISS)
        d.wait_for(lambda: not m.has_pending_work(), what="no lookup pending")
        m.touch([k], CTX)
        self.assertIsNone(m.on_schedule_end(S.ScheduleEndContext(new_req_ids=["req-0"], preempted_req_ids=[])))
        self.assertIsNone(m.on_request_finished(CTX))
        self.assertEqual(list(m.take_events()), [])
        m.reset_cache()
        m.shutdown()
        m.shutdown()  # idempotent

    def test_hit_pending_while_this_manager_stores(self):
        spec = self.spec()
        m = self.manager(spec)
        k = keys(1, "pending")[0]
        out = m.prepare_store([k], CTX)
        self.assertEqual(out.keys_to_store, [k])
        self.assertEqual(m.lookup(k, CTX), S.LookupResult.HIT_PENDING)
        m.complete_store([k], CTX, success=False)
        self.assertEqual(m.counters()["store_failed_keys"], 1)
        self.answer(m, k, S.LookupResult.MISS)

    def test_failed_load_is_reported_and_counted(self):
        spec = self.spec()
        caches, _ = self.caches()
        w = self.worker(spec, caches)
        # A load of a key that is not stored: vLLM never asks for one (no
        # HIT), but if it did the worker must not claim success.
        res = self.transfer(w, False, kv.KvhostLoadStoreSpec(keys(1, "never")), [5])
        self.assertFalse(res.success)
        self.assertEqual(w.counters()["failed_load_jobs"], 1)

    def chunked(self, bpc=4, nkeys=3, prefix="chunk"):
        """A manager and worker of blocks_per_chunk bpc with nkeys chunks
        stored from GPU blocks 0.. (whole chunks): (manager, worker,
        tensors, keys, the bytes of blocks 0..nkeys*bpc-1 per block)."""
        spec = self.spec(blocks_per_chunk=bpc)
        m = self.manager(spec)
        caches, tensors = self.caches(seed=bpc)
        w = self.worker(spec, caches)
        ks = keys(nkeys, prefix)
        out = m.prepare_store(ks, CTX)
        res = self.transfer(w, True, out.store_spec, list(range(nkeys * bpc)))
        self.assertTrue(res.success)
        self.assertEqual(res.transfer_size, nkeys * bpc * LAYERS * PAGE)
        m.complete_store(ks, CTX)
        for k in ks:
            self.answer(m, k, S.LookupResult.HIT)
        stored = {b: rows(tensors, [b]) for b in range(nkeys * bpc)}
        return m, w, tensors, ks, stored

    def test_loads_that_start_or_end_inside_a_chunk_fill_only_their_blocks(self):
        """blocks_per_chunk 4, three chunks stored from blocks 0-11. A load
        whose GPU spec starts at block index i of the request (the GPU
        prefix cache holds the blocks before it) and covers n blocks loads
        the keys of chunks i//4 .. (i+n-1)//4 into exactly those n blocks:
        every other block of the cache keeps its bytes, the blocks of the
        GPU prefix too."""
        import torch
        m, w, tensors, ks, stored = self.chunked()
        for name, first, n in [("starts inside the first chunk", 1, 11), ("ends inside the last chunk", 0, 10),
                               ("starts and ends inside chunks", 3, 6), ("inside one chunk", 5, 2)]:
            with self.subTest(name):
                for t in tensors:
                    t.fill_(-7)
                before = [t.clone() for t in tensors]
                dst = list(range(40, 40 + n))  # block index first+i goes to block 40+i
                want_keys = ks[first // 4:(first + n - 1) // 4 + 1]
                for k in want_keys:
                    self.answer(m, k, S.LookupResult.HIT)
                res = self.transfer(w, False, m.prepare_load(want_keys, CTX), dst, block_indices=[first])
                self.assertTrue(res.success, name)
                self.assertEqual(res.transfer_size, n * LAYERS * PAGE)
                self.assertEqual(rows(tensors, dst), [stored[first + i][layer] for layer in range(LAYERS)
                                                      for i in range(n)])
                for t, b in zip(tensors, before):
                    b[40:40 + n] = t[40:40 + n]
                    self.assertTrue(torch.equal(t, b), f"{name}: a block the load did not name changed")
                m.complete_load(want_keys, CTX)
        self.assertEqual(w.counters()["failed_load_jobs"], 0)

    def test_each_group_of_a_hybrid_load_starts_at_its_own_block_index(self):
        """Two groups, chunks of 2 blocks: group 0's load starts inside
        its first chunk (block index 1), group 1's ends inside its last;
        each gets its blocks, nothing else changes."""
        import torch
        spec = self.spec(groups=2, blocks_per_chunk=2)
        m = self.manager(spec)
        caches, tensors = self.caches(groups=2, seed=3)
        w = self.worker(spec, caches)
        k0, k1 = keys(2, "hybrid-chunk", group=0), keys(2, "hybrid-chunk", group=1)
        out = m.prepare_store(k0 + k1, CTX)
        self.assertTrue(self.transfer(w, True, out.store_spec, [0, 1, 2, 3, 10, 11, 12, 13], group_sizes=[4, 4],
                                      block_indices=[0, 0]).success)
        m.complete_store(k0 + k1, CTX)
        for k in k0 + k1:
            self.answer(m, k, S.LookupResult.HIT)
        want = rows(tensors, [1, 2, 3, 10, 11, 12])
        for t in tensors:
            t.fill_(9)
        before = [t.clone() for t in tensors]
        dst = [40, 41, 42, 50, 51, 52]
        res = self.transfer(w, False, m.prepare_load(k0 + k1, CTX), dst, group_sizes=[3, 3], block_indices=[1, 0])
        self.assertTrue(res.success)
        self.assertEqual(res.transfer_size, 6 * LAYERS * PAGE)
        self.assertEqual(rows(tensors, dst), want)
        for t, b in zip(tensors, before):
            b[dst] = t[dst]
            self.assertTrue(torch.equal(t, b), "a block the load did not name changed")
        m.complete_load(k0 + k1, CTX)

    def test_a_load_whose_keys_do_not_cover_its_blocks_fails_without_raising(self):
        """Blocks from index 1 over 4 blocks span two chunks of 4: one key
        is one short, and the load fails (vLLM is told) with nothing moved."""
        m, w, tensors, ks, _ = self.chunked(prefix="short")
        res = self.transfer(w, False, m.prepare_load(ks[:1], CTX), [40, 41, 42, 43], block_indices=[1])
        self.assertFalse(res.success)
        m.complete_load(ks[:1], CTX)

    def test_a_store_covering_a_chunk_in_part_stores_the_whole_chunks_only(self):
        """A store whose GPU blocks start inside a chunk (vLLM leaves out a
        sliding-window group's null blocks) stores the chunks it covers
        whole; the chunk covered in part is left out (counted), as is a
        store of fewer blocks than a chunk."""
        spec = self.spec(blocks_per_chunk=2)
        m = self.manager(spec)
        caches, tensors = self.caches()
        w = self.worker(spec, caches)
        ks = keys(3, "partial")
        out = m.prepare_store(ks, CTX)
        # Block indices 1..5: chunk 0 in part (its block 1), chunks 1 and 2 whole.
        res = self.transfer(w, True, out.store_spec, [7, 8, 9, 10, 11], block_indices=[1])
        self.assertTrue(res.success)
        self.assertEqual(res.transfer_size, 4 * LAYERS * PAGE)
        m.complete_store(ks, CTX)
        self.assertEqual(w.counters()["store_skipped_keys"], 1)
        self.assertEqual(w.counters()["stored_keys"], 2)
        with kvhost.Client(self.daemon.socket) as c:
            ns = c.declare(sc.geometry(sc.describe(w._ident, 0, w.shard)))  # the worker's namespace
            self.assertEqual([c.lookup(ns.id, [sc.daemon_key(k)]) for k in ks], [0, 1, 1])
        # One GPU block for a two-block chunk: nothing stored, the job succeeds.
        k = keys(1, "partial-one")[0]
        out = m.prepare_store([k], CTX)
        self.assertTrue(self.transfer(w, True, out.store_spec, [4]).success)
        m.complete_store([k], CTX)
        self.assertEqual(w.counters()["store_skipped_keys"], 2)

    def test_a_model_of_126_layers_registers_with_the_daemons_defaults(self):
        # vLLM allocates a KV-cache tensor per layer: a worker of a deep
        # model (Llama 3.1 405B: 126 layers) registers that many regions
        # on its one connection, and must start on a daemon's defaults.
        layers = 126
        spec = self.spec(layers=layers)
        m = self.manager(spec)
        caches, tensors = self.caches(layers=layers, blocks=4, shared=False)
        w = self.worker(spec, caches)
        ks = keys(1, "deep")
        self.store(m, w, ks, [1])
        want = rows(tensors, [1])
        for t in tensors:
            t[2].zero_()
        self.answer(m, ks[0], S.LookupResult.HIT)
        self.assertTrue(self.transfer(w, False, m.prepare_load(ks, CTX), [2]).success)
        self.assertEqual(rows(tensors, [2]), want)
        m.complete_load(ks, CTX)

    def test_reset_cache_releases_pins(self):
        spec = self.spec()
        m = self.manager(spec)
        caches, _ = self.caches(shared=False)
        w = self.worker(spec, caches)
        ks = keys(3, "reset")
        self.store(m, w, ks, [0, 1, 2])
        for k in ks:
            self.answer(m, k, S.LookupResult.HIT)
        self.assertEqual(m.counters()["pinned_now"], 3)
        m.reset_cache()
        self.assertEqual(m.counters()["pinned_now"], 0)
        # Nothing pins them any more: the daemon deletes them. The pin
        # thread sends the releases on its own time, one pin at a time, so
        # a delete can come between two of them: count what every delete
        # removed rather than wait for one that removes all three.
        with kvhost.Client(self.daemon.socket) as c:
            ns = c.declare(sc.geometry(sc.describe(spec._ident, 0, 0)))
            daemon_keys = [sc.daemon_key(k) for k in ks]
            deleted = 0

            def all_deleted():
                nonlocal deleted
                deleted += c.delete(ns, daemon_keys)
                return deleted == 3 or None
            d.wait_for(all_deleted, what="the daemon to delete the released keys")
            self.assertEqual(c.lookup(ns, daemon_keys), 0)


@unittest.skipUnless(HAVE_TORCH, "torch is not installed")
class TestDaemonRestart(SpecCase):
    """The daemon restarts under a running scheduler manager and worker
    (SIGTERM or SIGKILL, then a new daemon on the same socket and
    directory): while it is gone lookups answer MISS and prepare_store
    None; both connect again by themselves, the worker registers its
    tensors anew, and keys stored before the restart load byte for byte."""

    def test_a_restart_and_a_crash_are_survived_and_keys_stored_before_load(self):
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with self.subTest(sig=sig.name):
                m, w, tensors = self.restarting(31)
                ks = keys(4, f"restart-{sig.name}")
                self.store(m, w, ks, [0, 1, 2, 3])
                want = rows(tensors, [0, 1, 2, 3])
                for k in ks:
                    self.answer(m, k, S.LookupResult.HIT)  # pinned on the daemon about to go

                self.daemon.halt(sig)
                try:
                    # A pinned key too: its pin died with the daemon.
                    d.wait_for(lambda: m.lookup(ks[0], CTX) == S.LookupResult.MISS,
                               what="the manager to answer MISS with the daemon gone")
                    self.assertFalse(m.counters()["connected"])
                    self.assertIsNone(m.prepare_store(keys(1, f"down-{sig.name}"), CTX))
                finally:
                    self.daemon.start_again()
                d.wait_for(lambda: m.counters()["connected"], what="the manager to connect again")
                # The manager answers HIT only once the worker's cache is
                # registered with the new daemon: the worker notices the
                # loss at vLLM's next step (get_finished) and connects.
                self.answer(m, ks[0], S.LookupResult.MISS)
                d.wait_for(lambda: not list(w.get_finished()) and w.counters()["connected"],
                           what="the worker to connect again")
                for k in ks:
                    d.wait_for(lambda: m.lookup(k, CTX) == S.LookupResult.HIT, what="a HIT once the worker is back")
                dst = [40, 41, 42, 43]
                for t in tensors:
                    t[dst[0]:dst[-1] + 1].zero_()
                res = self.transfer(w, False, m.prepare_load(ks, CTX), dst)
                self.assertTrue(res.success)
                self.assertEqual(rows(tensors, dst), want)
                m.complete_load(ks, CTX)
                self.assertEqual((m.counters()["disconnects"], m.counters()["reconnects"]), (1, 1))
                self.assertEqual((w.counters()["connected"], w.counters()["reconnects"]), (True, 1))
                more = keys(2, f"after-{sig.name}")
                self.store(m, w, more, [6, 7])
                for k in more:
                    self.answer(m, k, S.LookupResult.HIT)


    def submit_load(self, w, kv_spec, dst):
        self.job += 1
        gpu = S.GPULoadStoreSpec(dst, [len(dst)], [0])
        self.assertTrue(w.submit_load(self.job, pickle.loads(pickle.dumps(kv_spec)), gpu))
        return self.job

    def finished(self, w, job):
        res = []
        d.wait_for(lambda: res.extend(w.get_finished()) or res, what="the load's result", timeout=60)
        self.assertEqual([r.job_id for r in res], [job])
        return res[0]

    def test_a_load_lost_with_the_daemon_is_loaded_again_on_the_new_one(self):
        """A load sent to a daemon that goes before answering it (frozen,
        then killed or stopped) is not reported failed — vLLM would stop the
        worker — but loaded again once a new daemon answers, byte for
        byte."""
        for sig in (signal.SIGKILL, signal.SIGTERM):
            with self.subTest(sig=sig.name):
                m, w, tensors = self.restarting(37)
                ks, want = self.pinned(m, w, f"lost-load-{sig.name}", tensors)
                dst = [40, 41, 42, 43]
                for t in tensors:
                    t[dst[0]:dst[-1] + 1].zero_()
                load = m.prepare_load(ks, CTX)
                self.daemon.freeze()
                try:
                    job = self.submit_load(w, load, dst)  # sent; no answer from a frozen daemon
                finally:
                    self.daemon.halt(sig)
                early = []
                try:
                    d.wait_for(lambda: early.extend(w.get_finished()) or not w.counters()["connected"],
                               what="the worker to notice the daemon gone")
                    early += w.get_finished()
                    # Killed: the load waits, not failed. Stopped: the
                    # daemon may have read and run it in its grace period.
                    self.assertTrue(early == [] or (sig == signal.SIGTERM and early[0].success), early)
                finally:
                    self.daemon.start_again()
                res = early[0] if early else self.finished(w, job)
                self.assertEqual(res.job_id, job)
                self.assertTrue(res.success)
                self.assertEqual(rows(tensors, dst), want)
                m.complete_load(ks, CTX)
                c = w.counters()
                self.assertGreaterEqual(c["load_retries"], 0 if early else 1)
                self.assertEqual((c["failed_load_jobs"], c["inflight_jobs"]), (0, 0))

    def test_keys_being_loaded_are_pinned_again_on_the_new_daemon(self):
        """A load prepared before the daemon went: once the manager is
        connected to the new daemon it pins the load's keys there again
        (the new daemon refuses to delete them, as it would refuse to
        evict them) until complete_load releases them; then the worker's
        load runs byte for byte."""
        spec = self.spec(reconnect_s=0.05)
        m = self.manager(spec)
        caches, tensors = self.caches(seed=43)
        w = self.worker(spec, caches)
        ks, want = self.pinned(m, w, "repin", tensors)
        load = m.prepare_load(ks, CTX)
        pins_before = m.counters()["daemon_pins"]
        self.crash_and_start_again(m, "repin-probe")
        self.assertEqual(m.counters()["repinned_keys"], len(ks))
        reported = m.get_stats().data["data"]  # vLLM's metrics carry it too
        self.assertEqual(reported[_metrics.PREFIX + "repinned_keys"], {("scheduler",): len(ks)})
        geo = sc.geometry(sc.describe(spec._ident, 0, 0))
        daemon_keys = [sc.daemon_key(k) for k in ks]
        with kvhost.Client(self.daemon.socket) as c:
            ns = c.declare(geo)
            self.assertEqual(c.lookup(ns, daemon_keys), len(ks))
            d.wait_for(lambda: m.counters()["daemon_pins"] > pins_before, what="the manager's pin on the new daemon")
            self.assertEqual(c.delete(ns, daemon_keys), 0, "a key being loaded is not pinned on the new daemon")
            dst = [40, 41, 42, 43]
            for t in tensors:
                t[dst[0]:dst[-1] + 1].zero_()
            res = self.transfer(w, False, load, dst)
            self.assertTrue(res.success)
            self.assertEqual(rows(tensors, dst), want)
            m.complete_load(ks, CTX)
            # The keys may be pinned again in more than one pin round, each
            # its own pin, released one unpin at a time: a delete between
            # two unpins deletes some of the keys, so count what each try
            # deletes. A timeout says what the manager counted, to tell a
            # pin never released from one released late.
            deleted = [0]

            def all_deleted():
                deleted[0] += c.delete(ns, daemon_keys)
                return deleted[0] == len(ks) or None
            try:
                d.wait_for(all_deleted, what="complete_load to release the new pins")
            except AssertionError as e:
                raise AssertionError(f"{e}: {deleted[0]} of {len(ks)} keys deleted; "
                                     f"manager counters {m.counters()}") from None

    def test_keys_being_loaded_are_pinned_on_the_newest_daemon_after_two_losses(self):
        """The re-pin round for the first new daemon is still running when
        that daemon goes too: its keys, which the second swap finds pending,
        are queued again when the round ends, and pinned on the newest
        daemon."""
        spec = self.spec(reconnect_s=0.05)
        m = self.manager(spec)
        caches, tensors = self.caches(seed=47)
        w = self.worker(spec, caches)
        ks, _ = self.pinned(m, w, "repin-twice", tensors)
        m.prepare_load(ks, CTX)
        with self.held_pin_round(ks[0]) as (entered, gate):
            for i in range(2):
                self.crash_and_start_again(m, f"repin-twice-probe-{i}")
                if i == 0:
                    self.assertTrue(entered.wait(30), "no re-pin round began on the first new daemon")
            pins_before = m.counters()["daemon_pins"]
            gate.set()
            d.wait_for(lambda: m.counters()["daemon_pins"] > pins_before, what="a pin on the newest daemon")
        geo = sc.geometry(sc.describe(spec._ident, 0, 0))
        with kvhost.Client(self.daemon.socket) as c:
            ns = c.declare(geo)
            self.assertEqual(c.delete(ns, [sc.daemon_key(k) for k in ks]), 0,
                             "a key being loaded is not pinned on the newest daemon")
        m.complete_load(ks, CTX)

    def test_a_load_sent_while_the_daemon_is_gone_waits_for_it(self):
        """The HIT came just before the daemon went: the load finds no
        daemon, waits, and loads once one is back."""
        m, w, tensors = self.restarting(41)
        ks, want = self.pinned(m, w, "gone-load", tensors)
        load = m.prepare_load(ks, CTX)
        self.daemon.halt(signal.SIGKILL)
        try:
            job = self.submit_load(w, load, [50, 51, 52, 53])
            self.assertEqual(w.get_finished(), [])
        finally:
            self.daemon.start_again()
        res = self.finished(w, job)
        self.assertTrue(res.success)
        self.assertEqual(rows(tensors, [50, 51, 52, 53]), want)
        m.complete_load(ks, CTX)

    def test_a_lost_load_fails_once_load_retry_s_has_passed(self):
        """load_retry_s bounds the wait (0: fail at once); no daemon in that
        time reports the load failed."""
        for limit in (0.3, 0):
            with self.subTest(load_retry_s=limit):
                m, w, tensors = self.restarting(43, load_retry_s=limit)
                ks, _ = self.pinned(m, w, f"late-load-{limit}", tensors)
                load = m.prepare_load(ks, CTX)
                self.daemon.halt(signal.SIGKILL)
                try:
                    t0 = time.monotonic()
                    job = self.submit_load(w, load, [50, 51, 52, 53])
                    if limit:
                        self.assertEqual(w.get_finished(), [], "failed before load_retry_s")
                    res = self.finished(w, job)
                    waited = time.monotonic() - t0
                finally:
                    self.daemon.start_again()
                self.assertGreaterEqual(waited, limit)
                self.assertFalse(res.success)
                c = w.counters()
                self.assertEqual((c["failed_load_jobs"], c["load_retries"], c["inflight_jobs"]), (1, 0, 0))

    def test_a_load_the_daemon_cancelled_waits_for_the_next_connection(self):
        """A load whose keys the daemon answered CANCELLED (it was shutting
        down) without the worker asking is held, not sent again on the
        same connection, and loaded on the next one; one the worker
        cancelled itself fails."""
        from kvhost.client import Result
        m, w, tensors = self.restarting(53)
        ks, want = self.pinned(m, w, "cancelled-load", tensors)
        dst = [44, 45, 46, 47]
        load = pickle.loads(pickle.dumps(m.prepare_load(ks, CTX)))
        gpu = S.GPULoadStoreSpec(dst, [len(dst)], [0])

        class Cancelled:  # a daemon job that ended with every key cancelled
            def __init__(self, client):
                self._client = client

            def done(self):
                return True

            def wait(self, timeout=None):
                return Result([(kvhost.OUTCOME_CANCELLED, 0)] * len(ks), 0, 0, "key 0: context canceled")

        from kvhost.vllm._spec_transfers import _Transfer
        for by_worker in (False, True):
            tr = _Transfer(900 + by_worker, True, len(ks), (gpu, load))
            tr.client, tr.cancelled = w._client, by_worker
            tr.jobs = [Cancelled(w._client)]
            with w._lock:
                w._transfers[tr.job_id] = tr
            if by_worker:
                self.assertEqual([(r.job_id, r.success) for r in w.get_finished()], [(tr.job_id, False)])
                continue
            self.assertEqual(w.get_finished(), [])
            self.assertEqual((tr.jobs, w.counters()["load_retries"]), ([], 0), "sent again on the same connection")
            self.daemon.halt(signal.SIGTERM)
            try:
                d.wait_for(lambda: w.get_finished() == [] and not w.counters()["connected"],
                           what="the worker to notice the daemon gone")
            finally:
                self.daemon.start_again()
            res = self.finished(w, tr.job_id)
            self.assertTrue(res.success)
            self.assertEqual(rows(tensors, dst), want)
            self.assertEqual(w.counters()["load_retries"], 1)
        m.complete_load(ks, CTX)

    def test_wait_returns_only_once_the_daemon_ended_the_store(self):
        """vLLM reuses a store's blocks after wait: past job_timeout_s on a
        frozen daemon, wait says so in the log and goes on waiting; it
        returns once the daemon ran the store, which get_finished reports
        stored."""
        spec = self.spec(job_timeout_s=0.1, request_timeout_s=0.3)
        m = self.manager(spec)
        caches, tensors = self.caches(seed=59)
        w = self.worker(spec, caches)
        ks = keys(2, "fence")
        out = m.prepare_store(ks, CTX)
        said = d.LogRecords("vllm.kvhost")
        self.addCleanup(said.close)
        # wait asks the resumed daemon to cancel the store, which is past
        # job_timeout_s, once it has accepted it; whether that or the
        # store's end comes first is the machine's timing. The request is
        # recorded instead of sent (TestWaitEnded checks the cancel).
        asked = []
        cancel = mock.patch.object(kvhost.Job, "cancel", lambda job: asked.append(job.id) or False)
        cancel.start()
        self.addCleanup(cancel.stop)
        self.daemon.freeze()
        self.job += 1
        gpu = S.GPULoadStoreSpec([5, 6], [2], [0])
        done = threading.Event()
        try:
            self.assertTrue(w.submit_store(self.job, gpu, pickle.loads(pickle.dumps(out.store_spec))))
            waiter = threading.Thread(target=lambda: (w.wait({self.job}), done.set()))
            waiter.start()
            # Ten warnings: a second, past job_timeout_s and request_timeout_s both.
            d.wait_for(lambda: said.count("not done after 0.1s") >= 10, what="wait to go on waiting")
            self.assertFalse(done.is_set(), "wait returned before the daemon ended the store")
            self.assertEqual(asked, [], "a cancel asked of a store the frozen daemon never accepted")
        finally:
            self.daemon.thaw()
        waiter.join(60)
        self.assertTrue(done.is_set())
        res = []
        d.wait_for(lambda: res.extend(w.get_finished()) or res, what="the store's result")
        self.assertEqual([(r.job_id, r.success) for r in res], [(self.job, True)])
        self.assertEqual(w.counters()["stored_keys"], 2)
        m.complete_store(ks, CTX)

    def test_a_load_that_misses_on_the_new_daemon_is_not_loaded_again(self):
        """Only a lost connection makes a load wait: a key the daemon does
        not have fails the load at once, as before."""
        spec = self.spec(reconnect_s=0.05)
        m = self.manager(spec)
        caches, _ = self.caches(seed=47)
        w = self.worker(spec, caches)
        ghost = sc.KvhostLoadStoreSpec(keys(1, "never-stored"), [0])
        job = self.submit_load(w, ghost, [8])
        res = self.finished(w, job)
        self.assertFalse(res.success)
        self.assertEqual(w.counters()["load_retries"], 0)


@unittest.skipUnless(HAVE_TORCH, "torch is not installed")
class TestJobLimit(SpecCase):
    """A daemon that takes one job in flight per connection (its
    max_inflight_jobs, 256 by default, which a worker's stores can fill)."""

    @classmethod
    def setUpClass(cls):
        cls.daemon = d.Daemon(capacity=cls.capacity, server_toml="max_inflight_jobs = 1")

    def test_a_load_refused_while_stores_fill_the_connection_is_sent_again_not_failed(self):
        # vLLM's connector asserts every load's success: a load the daemon
        # refuses because the worker's stores hold every job slot of the
        # connection must wait for room and load byte for byte.
        spec = self.spec()
        m = self.manager(spec)
        caches, tensors = self.caches(seed=53)
        w = self.worker(spec, caches)
        ks = keys(4, "room")
        self.store(m, w, ks, [0, 1, 2, 3])
        for k in ks:
            self.answer(m, k, S.LookupResult.HIT)
        want = rows(tensors, [0, 1, 2, 3])
        dst = [60, 61, 62, 63]
        for t in tensors:
            t[dst[0]:dst[-1] + 1].zero_()
        load = m.prepare_load(ks, CTX)
        big = keys(56, "room-store")
        out = m.prepare_store(big, CTX)
        self.daemon.freeze()  # both jobs reach it together: the store holds the slot when the load comes
        try:
            self.assertTrue(w.submit_store(1, S.GPULoadStoreSpec(list(range(4, 60)), [56], [0]), out.store_spec))
            self.assertTrue(w.submit_load(2, load, S.GPULoadStoreSpec(dst, [4], [0])))
        finally:
            self.daemon.thaw()
        w.wait({1, 2})
        res = {}
        d.wait_for(lambda: res.update((r.job_id, r) for r in w.get_finished()) or len(res) == 2,
                   what="both results")
        self.assertTrue(res[1].success)
        self.assertTrue(res[2].success, "the load failed: vLLM stops the worker")
        self.assertEqual(rows(tensors, dst), want)
        m.complete_load(ks, CTX)
        self.assertEqual(w.counters()["failed_load_jobs"], 0)


class Mark:
    """A stand-in for a CUDA event recorded on vLLM's stream: synchronize()
    blocks until the test passes it (or raises what the test set), and
    notes the thread that waited."""

    def __init__(self, fail=None):
        self.passed = threading.Event()
        self.fail = fail
        self.waited_by = []

    def synchronize(self):
        self.waited_by.append(threading.current_thread())
        if not self.passed.wait(60):
            raise AssertionError("a mark the test never passed")
        if self.fail is not None:
            raise self.fail


@unittest.skipUnless(HAVE_TORCH, "torch is not installed")
class TestStreamFence(SpecCase):
    """The daemon copies CUDA blocks outside vLLM's streams: each job is
    marked on vLLM's current stream when submitted and sent only once the
    GPU has passed the mark, by the worker's sender thread, so vLLM's
    thread does not wait for the GPU (the GPU check runs it with CUDA
    tensors and events; here the marks are stand-ins)."""

    def fenced(self, seed, **kw):
        spec = self.spec(**kw)
        m = self.manager(spec)
        caches, tensors = self.caches(seed=seed)
        w = self.worker(spec, caches)
        marks = []
        w._fence = lambda: marks.append(Mark()) or marks[-1]
        return m, w, tensors, marks

    def submit(self, w, store, kv_spec, blocks):
        self.job += 1
        gpu = S.GPULoadStoreSpec(blocks, [len(blocks)], [0])
        ok = w.submit_store(self.job, gpu, kv_spec) if store else w.submit_load(self.job, kv_spec, gpu)
        self.assertTrue(ok)
        return self.job

    def in_flight(self, w):
        """Daemon jobs and requests sent on the worker's connection and not ended."""
        return len(w._client._jobs) + len(w._client._pending)

    def record_sends(self, w):
        """The keys of each store and load the worker asks its client to
        send, in order, with whether the worker was closing then."""
        sent = []
        for name in ("store", "load"):
            real = getattr(w._client, name)

            def send(cache, ks, blocks, real=real, **kw):
                sent.append(([bytes(k) for k in ks], w._closing))
                return real(cache, ks, blocks, **kw)
            setattr(w._client, name, send)
        return sent

    def test_host_memory_needs_no_fence(self):
        spec = self.spec()
        caches, _ = self.caches(seed=61)
        self.assertIsNone(self.worker(spec, caches)._fence)

    def test_a_job_is_sent_by_the_sender_thread_only_once_its_mark_is_passed(self):
        m, w, tensors, marks = self.fenced(62)
        ks = keys(2, "fenced-order")
        out = m.prepare_store(ks, CTX)
        job = self.submit(w, True, out.store_spec, [0, 1])  # returns with the mark not passed
        self.assertEqual(len(marks), 1)
        d.wait_for(lambda: marks[0].waited_by, what="the sender to wait on the mark")
        self.assertIsNot(marks[0].waited_by[0], threading.current_thread(), "vLLM's thread waited for the GPU")
        self.assertEqual(self.in_flight(w), 0, "a job sent before its mark was passed")
        self.assertEqual(w.counters()["unsent_jobs"], 1)
        self.assertEqual(w.get_finished(), [], "a job reported before it was sent")
        marks[0].passed.set()
        w.wait({job})
        res = []
        d.wait_for(lambda: res.extend(w.get_finished()) or res, what="the store's result")
        self.assertEqual([(r.job_id, r.success) for r in res], [(job, True)])
        self.assertEqual(w.counters()["stored_keys"], 2)
        m.complete_store(ks, CTX, success=True)
        for k in ks:
            self.answer(m, k, S.LookupResult.HIT)

    def test_jobs_are_sent_in_the_order_they_were_submitted(self):
        m, w, tensors, marks = self.fenced(63)
        sent = self.record_sends(w)
        batches = [keys(1, f"fenced-{i}") for i in range(3)]
        jobs = [self.submit(w, True, m.prepare_store(ks, CTX).store_spec, [i]) for i, ks in enumerate(batches)]
        marks[2].passed.set()  # a later mark passed first does not send its job ahead
        d.wait_for(lambda: marks[0].waited_by, what="the sender to wait on the first mark")
        self.assertEqual(sent, [])
        self.assertEqual([bool(mk.waited_by) for mk in marks], [True, False, False])
        marks[0].passed.set()
        marks[1].passed.set()
        w.wait(set(jobs))
        self.assertEqual([ks for ks, _ in sent], batches)
        res = []
        d.wait_for(lambda: res.extend(w.get_finished()) or len(res) == 3, what="the stores' results")
        self.assertEqual(sorted(r.job_id for r in res), jobs)
        self.assertTrue(all(r.success for r in res))

    def test_wait_returns_only_after_a_job_waiting_for_its_mark_ran(self):
        """vLLM's wait fences block reuse: a store still waiting for the
        GPU is a store that will read the blocks."""
        m, w, tensors, marks = self.fenced(64)
        ks = keys(2, "fenced-wait")
        out = m.prepare_store(ks, CTX)
        job = self.submit(w, True, out.store_spec, [3, 4])
        waited = threading.Event()
        t = threading.Thread(target=lambda: (w.wait({job}), waited.set()), daemon=True)
        t.start()
        d.wait_for(lambda: marks[0].waited_by, what="the sender to wait on the mark")
        self.assertFalse(waited.wait(0.3), "wait returned before the job was sent")
        marks[0].passed.set()
        self.assertTrue(waited.wait(30))
        self.assertEqual(w.counters()["unsent_jobs"], 0)
        res = []
        d.wait_for(lambda: res.extend(w.get_finished()) or res, what="the store's result")
        self.assertTrue(res[0].success)
        self.assertEqual(w.counters()["stored_keys"], 2)

    def test_a_load_whose_mark_fails_fails_and_moves_nothing(self):
        m, w, tensors, marks = self.fenced(65)
        ks = keys(2, "fenced-fail")
        for t in tensors:
            t[20:22] = 7
        marks_of_store = len(marks)
        job = self.submit(w, True, m.prepare_store(ks, CTX).store_spec, [0, 1])
        marks[marks_of_store].passed.set()
        w.wait({job})
        d.wait_for(lambda: w.get_finished(), what="the store's result")
        m.complete_store(ks, CTX, success=True)
        for k in ks:
            self.answer(m, k, S.LookupResult.HIT)
        w._fence = lambda: marks.append(Mark(fail=RuntimeError("CUDA error: an illegal memory access"))) or marks[-1]
        job = self.submit(w, False, m.prepare_load(ks, CTX), [20, 21])
        marks[-1].passed.set()
        w.wait({job})
        res = []
        d.wait_for(lambda: res.extend(w.get_finished()) or res, what="the load's result")
        self.assertEqual([(r.job_id, r.success) for r in res], [(job, False)])
        self.assertTrue(all((t[20:22] == 7).all() for t in tensors), "a load moved bytes after its mark failed")
        m.complete_load(ks, CTX)

    def test_shutdown_gives_up_on_a_mark_never_passed_and_never_sends_its_job(self):
        m, w, tensors, marks = self.fenced(66, job_timeout_s=0.2)
        sent = self.record_sends(w)
        ks = keys(2, "fenced-shutdown")
        self.submit(w, True, m.prepare_store(ks, CTX).store_spec, [0, 1])
        d.wait_for(lambda: marks[0].waited_by, what="the sender to wait on the mark")
        w.shutdown()
        marks[0].passed.set()  # the GPU passes it after the worker shut down
        d.wait_for(lambda: not w._sender.is_alive(), what="the sender thread to end")
        self.assertEqual(sent, [], "a job sent after shutdown gave up on it")
        m2 = self.manager(self.spec())
        for k in ks:
            self.answer(m2, k, S.LookupResult.MISS)
        # A job submitted after shutdown is not left waiting for a sender
        # that is gone: it ends, failed.
        job = self.submit(w, False, m.prepare_load(ks, CTX), [8, 9])
        waited = threading.Thread(target=w.wait, args=({job},), daemon=True)
        waited.start()
        waited.join(60)
        self.assertFalse(waited.is_alive(), "wait hangs on a job submitted after shutdown")
        res = w.get_finished()
        # The store given up ends too: for vLLM a success whose keys are not stored.
        self.assertEqual(sorted((r.job_id, r.success) for r in res), [(1, True), (job, False)])
        self.assertEqual((w.counters()["stored_keys"], w.counters()["store_failed_keys"]), (0, 2))

    def test_an_error_sending_one_job_fails_it_and_the_next_jobs_are_still_sent(self):
        """The sender thread survives what the send raises: the job ends
        failed (for vLLM: a store whose keys are not stored) and every
        later job is sent; wait never hangs on a job nothing will send."""
        m, w, tensors, marks = self.fenced(67)
        plan, calls = w._plan, []

        def failing_once(*a):
            calls.append(1)
            if len(calls) == 1:
                raise TypeError("injected: a spec the worker cannot read")
            return plan(*a)
        w._plan = failing_once
        first, second = keys(1, "fenced-raise-1"), keys(1, "fenced-raise-2")
        j1 = self.submit(w, True, m.prepare_store(first, CTX).store_spec, [0])
        j2 = self.submit(w, True, m.prepare_store(second, CTX).store_spec, [1])
        for mk in marks:
            mk.passed.set()
        waited = threading.Thread(target=w.wait, args=({j1, j2},), daemon=True)
        waited.start()
        waited.join(60)
        self.assertFalse(waited.is_alive(), "wait hangs on a job the sender will never send")
        res = []
        d.wait_for(lambda: res.extend(w.get_finished()) or len(res) == 2, what="both stores' results")
        self.assertTrue(all(r.success for r in res), res)  # a store vLLM sees fail would stop it
        self.assertTrue(w._sender.is_alive())
        c = w.counters()
        self.assertEqual((c["stored_keys"], c["store_failed_keys"], c["unsent_jobs"]), (1, 1, 0))
        m.complete_store(second, CTX, success=True)
        self.answer(m, second[0], S.LookupResult.HIT)


@unittest.skipUnless(HAVE_TORCH, "torch is not installed")
class TestHybridModel(SpecCase):
    def test_two_groups_round_trip_each_group_in_its_own_namespace(self):
        spec = self.spec(groups=2)
        self.assertEqual(spec.tokens_per_block, (16, 16))
        m = self.manager(spec)
        caches, tensors = self.caches(groups=2)
        w = self.worker(spec, caches)
        self.assertEqual(len(set(w.namespaces)), 2)
        k0, k1 = keys(2, "hybrid", group=0), keys(2, "hybrid", group=1)
        ks = k0 + k1  # ordered by group, as vLLM orders them
        out = m.prepare_store(ks, CTX)
        self.assertEqual(out.keys_to_store, ks)
        src = [1, 2, 10, 11]  # group 0's blocks, then group 1's
        res = self.transfer(w, True, out.store_spec, src, group_sizes=[2, 2], block_indices=[0, 0])
        self.assertTrue(res.success)
        self.assertEqual(res.transfer_size, 4 * LAYERS * PAGE)
        m.complete_store(ks, CTX)
        for k in ks:
            self.answer(m, k, S.LookupResult.HIT)
        # A group-0 key is not a group-1 key: one hash, two groups, two namespaces.
        other = S.offload_key(("hybrid", 0), 1)[:-4] + (1).to_bytes(4, "big")
        self.assertEqual(other, k1[0])
        want = rows(tensors, src)
        dst = [40, 41, 50, 51]
        load = m.prepare_load(ks, CTX)
        res = self.transfer(w, False, load, dst, group_sizes=[2, 2], block_indices=[0, 0])
        self.assertTrue(res.success)
        self.assertEqual(rows(tensors, dst), want)
        m.complete_load(ks, CTX)


@unittest.skipUnless(HAVE_TORCH, "torch is not installed")
class TestIdentity(SpecCase):
    """Through a real daemon: what one engine stores, which others see."""

    def stored_by(self, ks, **kw):
        spec = self.spec(**kw)
        m = self.manager(spec)
        caches, _ = self.caches(seed=len(self.closers))
        w = self.worker(spec, caches)
        self.store(m, w, ks, list(range(len(ks))))
        for k in ks:
            self.answer(m, k, S.LookupResult.HIT)
        return spec

    def test_different_models_with_the_same_page_size_miss_each_others_keys(self):
        ks = keys(2, "models")
        self.stored_by(ks, model="meta-llama/Llama-3.1-8B-Instruct")
        b = self.manager(self.spec(model="mistralai/Mistral-7B-Instruct-v0.3"))
        for k in ks:
            self.answer(b, k, S.LookupResult.MISS)

    def test_tp1_and_tp2_of_one_model_miss_each_others_keys(self):
        ks = keys(2, "tp")
        self.stored_by(ks, tp=1)
        b = self.manager(self.spec(tp=2))
        for k in ks:
            self.answer(b, k, S.LookupResult.MISS)

    def test_two_engines_of_one_model_share_keys(self):
        ks = keys(2, "share")
        a = self.stored_by(ks, engine_id="engine-a")
        b_spec = self.spec(engine_id="engine-b")
        self.assertNotEqual(a.config.engine_id, b_spec.config.engine_id)
        b = self.manager(b_spec)
        # Engine a's worker does not load for engine b: no HIT until b's own.
        self.answer(b, ks[0], S.LookupResult.MISS)
        self.worker(b_spec, self.caches(seed=9)[0])
        d.wait_for(lambda: answer_of(b, ks[0]) == S.LookupResult.HIT, what="a HIT with engine b's worker")
        self.answer(b, ks[1], S.LookupResult.HIT)

    def test_the_namespace_option_adds_to_the_identity(self):
        ks = keys(1, "option")
        self.stored_by(ks)
        b = self.manager(self.spec(namespace="tenant-b"))
        self.answer(b, ks[0], S.LookupResult.MISS)
        self.assertTrue(all(n.startswith("vllm-spec:meta-llama_Llama-3.1-8B-Instruct:")
                            for n in b.namespaces.values()))


@unittest.skipUnless(HAVE_TORCH, "needs torch")
class TestPageLayout(SpecCase):
    """A page's byte order follows the attention backend, the KV cache
    layout and vLLM's cross-layer slab, which the scheduler cannot see:
    the identity names the layout the workers must have (the option
    page_layout, else the default configuration's) and every worker
    compares it with what vLLM set it up with."""

    def setUp(self):
        super().setUp()
        env = mock.patch.dict(os.environ)
        env.start()
        os.environ.pop(_namespace.LAYOUT_ENV, None)
        self.closers.append(env.stop)

    def slab(self, seed=0):
        caches, tensors, bufs = slab_caches(seed=seed)
        for b in bufs:
            self.closers.insert(0, b.close)
        return caches, tensors

    def test_the_default_configuration_is_accepted(self):
        # FlashAttention (an H100's default) under the offloading
        # connector's HND, and one KV-cache group: vLLM's cross-layer slab.
        spec = self.spec()
        self.assertEqual(spec._ident["page_layout"], "FLASH_ATTN/HND/slab")
        m = self.manager(spec)
        caches, tensors = self.slab()
        with observed("FLASH_ATTN", "HND"):
            w = self.worker(spec, caches)
        self.assertEqual(w.page_layout, "FLASH_ATTN/HND/slab")
        self.assertEqual(sorted(w.namespaces), sorted(m.namespaces.values()))
        ks = keys(2, "default-layout")
        before = rows(tensors, [0, 1])
        self.store(m, w, ks, [0, 1])
        for k in ks:
            self.answer(m, k, S.LookupResult.HIT)
        for t in tensors:
            t[4:6].zero_()
        res = self.transfer(w, False, m.prepare_load(ks, CTX), [4, 5])
        self.assertTrue(res.success)
        m.complete_load(ks, CTX)
        self.assertEqual(rows(tensors, [4, 5]), before)

    def test_another_attention_backend_is_refused_naming_the_option(self):
        spec = self.spec(layers=LAYERS)
        caches, _ = self.caches()
        with observed("FLASHINFER", "HND"), self.assertRaises(ValueError) as cm:
            spec.get_worker(caches)
        msg = str(cm.exception)
        self.assertIn('"page_layout": "FLASHINFER/HND"', msg)
        self.assertIn("FLASH_ATTN/HND/slab", msg)

    def test_another_kv_cache_layout_is_refused(self):
        spec = self.spec()
        caches, _ = self.slab()
        with observed("FLASH_ATTN", "NHD"), self.assertRaisesRegex(ValueError, '"page_layout": "FLASH_ATTN/NHD/slab"'):
            spec.get_worker(caches)

    def test_per_layer_pages_are_refused_where_the_identity_says_slab(self):
        spec = self.spec()
        caches, _ = self.caches()
        with observed("FLASH_ATTN", "HND"), self.assertRaisesRegex(ValueError, '"page_layout": "FLASH_ATTN/HND"'):
            spec.get_worker(caches)

    def test_VLLM_KV_CACHE_LAYOUT_is_in_the_identity(self):
        os.environ[_namespace.LAYOUT_ENV] = "NHD"
        spec = self.spec()
        self.assertEqual(spec._ident["page_layout"], "FLASH_ATTN/NHD/slab")
        caches, _ = self.slab()
        with observed("FLASH_ATTN", "NHD"):
            self.worker(spec, caches)
        with observed("FLASH_ATTN", "HND"), self.assertRaisesRegex(ValueError, "FLASH_ATTN/HND/slab"):
            spec.get_worker(caches)
        os.environ[_namespace.LAYOUT_ENV] = "nhd"
        with self.assertRaisesRegex(ValueError, "VLLM_KV_CACHE_LAYOUT"):
            self.spec()

    def test_the_option_names_the_layout(self):
        spec = self.spec(page_layout="FLASHINFER/HND")
        self.assertEqual(spec._ident["page_layout"], "FLASHINFER/HND")
        caches, _ = self.caches()
        with observed("FLASHINFER", "HND"):
            self.assertEqual(self.worker(spec, caches).page_layout, "FLASHINFER/HND")
        for bad in ("FLASHINFER", "FLASHINFER/hnd", "FLASHINFER/HND/", 7):
            with self.subTest(bad=bad), self.assertRaisesRegex(ValueError, "page_layout"):
                self.spec(page_layout=bad)

    def test_engines_of_other_layouts_miss_each_others_keys(self):
        ks = keys(2, "layouts")
        a = self.spec(engine_id="a")
        m = self.manager(a)
        caches, _ = self.slab(seed=1)
        with observed("FLASH_ATTN", "HND"):
            w = self.worker(a, caches)
        self.store(m, w, ks, [0, 1])
        for k in ks:
            self.answer(m, k, S.LookupResult.HIT)
        other = self.manager(self.spec(engine_id="b", page_layout="FLASHINFER/HND"))
        os.environ[_namespace.LAYOUT_ENV] = "NHD"
        nhd = self.manager(self.spec(engine_id="c"))
        for mm in (other, nhd):
            self.assertFalse(set(mm.namespaces.values()) & set(m.namespaces.values()))
            for k in ks:
                self.answer(mm, k, S.LookupResult.MISS)

    def test_a_hybrid_model_is_not_assumed_to_get_the_slab(self):
        spec = self.spec(groups=2)
        self.assertEqual(spec._ident["page_layout"], "FLASH_ATTN/HND")
        caches, _ = self.caches(groups=2)
        with observed("FLASH_ATTN", "HND"):
            self.worker(spec, caches)

    def test_the_canonical_layout_is_not_assumed_to_get_the_slab(self):
        cfg = dataclasses.replace(config(self.daemon.socket), canonical_layout=True)
        self.assertEqual(_namespace.page_layout(cfg), "FLASH_ATTN/HND")


class TestObserveLayout(unittest.TestCase):
    """observe_layout reads the worker's backends and layout from vLLM
    (fake vLLM modules here: its current config and get_kv_cache_layout)."""

    GROUPS = [{"tokens_per_block": 16, "layer_names": ["a.0", "a.1"]}, {"tokens_per_block": 16, "layer_names": ["b.0"]}]

    def fake_vllm(self, current, layout="HND"):
        def backend(name):
            return types.SimpleNamespace(get_attn_backend=lambda: types.SimpleNamespace(get_name=lambda: name))
        mods = {n: types.ModuleType(n) for n in ("vllm", "vllm.config", "vllm.v1", "vllm.v1.attention",
                                                 "vllm.v1.attention.backends", "vllm.v1.attention.backends.utils")}
        ctx = {k: backend(v) for k, v in (current or {}).items()}
        cfg = None if current is None else types.SimpleNamespace(
            compilation_config=types.SimpleNamespace(static_forward_context=ctx))
        mods["vllm.config"].get_current_vllm_config_or_none = lambda: cfg
        mods["vllm.v1.attention.backends.utils"].get_kv_cache_layout = lambda: layout
        return mock.patch.dict(sys.modules, mods), mock.patch.object(spec_worker, "vllm_installed", lambda: True)

    def observe(self, current, layout="HND"):
        modules, installed = self.fake_vllm(current, layout)
        with modules, installed:
            return OBSERVE_LAYOUT(self.GROUPS)

    def test_each_layers_backend_and_the_layout(self):
        got = self.observe({"a.0": "FLASH_ATTN", "a.1": "FLASH_ATTN", "b.0": "MAMBA2_ATTN"}, "NHD")
        self.assertEqual(got, ([["FLASH_ATTN", "FLASH_ATTN"], ["MAMBA2_ATTN"]], "NHD"))
        self.assertEqual(_namespace.page_layout_text(got[0], got[1], False), "FLASH_ATTN,MAMBA2_ATTN/NHD")

    def test_what_cannot_be_read_is_refused(self):
        with self.assertRaisesRegex(_namespace.IdentityUnknown, "no current vLLM config"):
            self.observe(None)
        with self.assertRaisesRegex(_namespace.IdentityUnknown, "layer b.0"):
            self.observe({"a.0": "FLASH_ATTN", "a.1": "FLASH_ATTN"})
        with self.assertRaisesRegex(_namespace.IdentityUnknown, "get_kv_cache_layout"):
            self.observe({"a.0": "FLASH_ATTN", "a.1": "FLASH_ATTN", "b.0": "FLASH_ATTN"}, "XYZ")

    def test_without_vllm_there_is_nothing_to_observe(self):
        with mock.patch.object(spec_worker, "vllm_installed", lambda: False):
            self.assertIsNone(OBSERVE_LAYOUT(self.GROUPS))


class TestIdentityFields(unittest.TestCase):
    """What the namespace is made of, without a daemon."""

    def ident(self, **kw):
        return Spec(config("/nonexistent.sock", **kw))._ident

    def test_a_field_vllm_did_not_give_is_refused_by_name(self):
        cfg = S.fake_offloading_config("/nonexistent.sock")
        cases = {
            "model.dtype": dataclasses.replace(cfg, model=S.OffloadingModelConfig(name=cfg.model.name, dtype=None)),
            "model.name": dataclasses.replace(cfg, model=S.OffloadingModelConfig(name="", dtype="bfloat16")),
            "parallel.tp_size": dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, tp_size=None)),
            "cache.tokens_per_hash": dataclasses.replace(
                cfg, cache=S.OffloadingCacheConfig(tokens_per_hash=None, blocks_per_chunk=1)),
            "groups[0].layer_names": dataclasses.replace(
                cfg, groups=(S.OffloadingGroupConfig(tokens_per_block=16, layer_names=()),)),
        }
        for field, bad in cases.items():
            with self.subTest(field=field), self.assertRaises(kv.spec_compat.IdentityUnknown) as cm:
                Spec(bad)
            self.assertIn(field, str(cm.exception))
        self.assertIs(kv.spec_compat.IdentityUnknown, _namespace.IdentityUnknown)

    def test_dtype_auto_is_refused(self):
        cfg = S.fake_offloading_config("/nonexistent.sock")
        with self.assertRaisesRegex(_namespace.IdentityUnknown, "model.dtype"):
            Spec(dataclasses.replace(cfg, model=S.OffloadingModelConfig(name=cfg.model.name, dtype="auto")))

    def test_page_size_comes_from_worker_bytes_or_the_page_bytes_option(self):
        self.assertEqual(self.ident(layers=4, page_bytes=4096)["page_bytes"], 4096)
        # A hybrid model's groups share tensors: bytes per block = most layers × page.
        self.assertEqual(self.ident(layers=4, groups=2, page_bytes=8192)["page_bytes"], 8192)
        cfg = dataclasses.replace(S.fake_offloading_config("/nonexistent.sock"), worker_kv_bytes_per_block=4097 * 4 + 1)
        with self.assertRaisesRegex(_namespace.IdentityUnknown, '"page_bytes"'):
            Spec(cfg)
        cfg = dataclasses.replace(S.fake_offloading_config("/nonexistent.sock", page_bytes=2048), worker_kv_bytes_per_block=0)
        with self.assertRaisesRegex(_namespace.IdentityUnknown, "worker_kv_bytes_per_block 0"):
            Spec(cfg)
        cfg = S.offloading_config(worker_kv_bytes_per_block=0, extra={"socket": "/x.sock", "page_bytes": 2048})
        self.assertEqual(Spec(cfg)._ident["page_bytes"], 2048)

    def test_every_field_that_separates_engines_changes_the_namespace(self):
        base = sc.geometry(sc.describe(self.ident(), 0, 0)).model
        variants = {"model": dict(model="Qwen/Qwen2.5-7B"), "tp": dict(tp=2), "page": dict(page_bytes=8192),
                    "layers": dict(layers=8), "chunk": dict(blocks_per_chunk=4), "namespace": dict(namespace="x")}
        for what, kw in variants.items():
            with self.subTest(what=what):
                self.assertNotEqual(sc.geometry(sc.describe(self.ident(**kw), 0, 0)).model, base)
        cfg = S.fake_offloading_config("/nonexistent.sock")
        for what, c in {"dtype": dataclasses.replace(cfg, model=S.OffloadingModelConfig(cfg.model.name, "float16")),
                        "tokens_per_hash": dataclasses.replace(cfg, cache=S.OffloadingCacheConfig(32, 1)),
                        "dcp": dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, dcp_size=2))}.items():
            with self.subTest(what=what):
                self.assertNotEqual(sc.geometry(sc.describe(Spec(c)._ident, 0, 0)).model, base)
        # The engine id and the data-parallel index do not separate.
        same = dataclasses.replace(cfg, engine_id="other", parallel=dataclasses.replace(cfg.parallel, data_parallel_index=3))
        self.assertEqual(sc.geometry(sc.describe(Spec(same)._ident, 0, 0)).model, base)
        # Shards of one engine are apart; parallelism-agnostic bytes are not collapsed.
        ident = self.ident(tp=2)
        self.assertNotEqual(sc.geometry(sc.describe(ident, 0, 0)).model, sc.geometry(sc.describe(ident, 0, 1)).model)
        self.assertNotEqual(sc.geometry(sc.describe(self.ident(tp=2, agnostic=True), 0, 0)).model, base)

    def test_canonical_layout_needs_vllms_format_id(self):
        cfg = dataclasses.replace(S.fake_offloading_config("/nonexistent.sock"), canonical_layout=True)
        if importlib.util.find_spec("vllm") is None:
            with self.assertRaisesRegex(_namespace.IdentityUnknown, "canonical"):
                Spec(cfg)

    def test_kv_cache_layout_of_a_later_vllm_is_part_of_the_identity(self):
        @dataclasses.dataclass(frozen=True)
        class Later(S.OffloadingConfig):
            kv_cache_layout: str = "NHD"
        cfg = S.fake_offloading_config("/nonexistent.sock")
        fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
        a, b = Later(**fields, kv_cache_layout="NHD"), Later(**fields, kv_cache_layout="HND")
        ia, ib = Spec(a)._ident, Spec(b)._ident
        self.assertEqual(ia["kv_cache_layout"], "NHD")
        self.assertNotEqual(sc.geometry(sc.describe(ia, 0, 0)).model, sc.geometry(sc.describe(ib, 0, 0)).model)


class TestOptions(unittest.TestCase):
    def test_vllms_generic_keys_are_accepted(self):
        generic = dict(canonical_layout=False, offload_prompt_only=False, self_describing_kv_events=True,
                       store_threshold=2, max_tracker_size=1000, eviction_policy="lru",
                       cache_policy_module_path="x.y", cpu_bytes_to_use=1 << 30, block_size=16,
                       blocks_per_chunk=1, kv_cache_layout="NHD", max_recompute_pending_tokens=128)
        spec = Spec(S.fake_offloading_config("/nonexistent.sock", **generic))
        self.assertFalse(spec.offload_prompt_only)  # vLLM's base class read it
        self.assertTrue(spec.kv_events_config.self_describing_kv_events)
        self.assertEqual(spec.blocks_per_chunk, 1)

    def test_an_unknown_key_is_refused_by_name(self):
        with self.assertRaisesRegex(ValueError, "unknown spec option.*pin_leese_s"):
            Spec(S.fake_offloading_config("/nonexistent.sock", pin_leese_s=3))
        with self.assertRaisesRegex(ValueError, "unknown spec option.*tp_rank"):
            Spec(S.fake_offloading_config("/nonexistent.sock", tp_rank=1))  # vLLM's config says the rank

    def test_bad_configs_are_refused_with_the_reason(self):
        cfg = S.fake_offloading_config("/nonexistent.sock")
        with self.assertRaisesRegex(ValueError, "pipeline parallelism"):
            Spec(dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, pp_size=2)))
        with self.assertRaisesRegex(ValueError, "pin_lease_s"):
            Spec(S.fake_offloading_config("/nonexistent.sock", pin_lease_s=0))
        with self.assertRaisesRegex(ValueError, "page_bytes"):
            Spec(S.fake_offloading_config("/nonexistent.sock", **{"page_bytes": "4k"}))
        for bad in (0, -1, float("inf"), True):
            with self.assertRaisesRegex(ValueError, "request_timeout_s"):
                Spec(S.fake_offloading_config("/nonexistent.sock", request_timeout_s=bad))
        for bad in (0, -1, float("inf"), float("nan"), True, "2"):
            with self.subTest(daemon_wait_s=bad), self.assertRaisesRegex(ValueError, "daemon_wait_s"):
                Spec(S.fake_offloading_config("/nonexistent.sock", daemon_wait_s=bad))
        for k in ("lookup_wait_s", "stored_ttl_s", "job_timeout_s", "reconnect_s", "load_retry_s"):
            for bad in (-1, float("nan"), float("inf"), True, "30"):
                with self.subTest(option=k, value=bad), self.assertRaisesRegex(ValueError, f"{k}: want seconds >= 0"):
                    Spec(S.fake_offloading_config("/nonexistent.sock", **{k: bad}))
        with self.assertRaisesRegex(_namespace.IdentityUnknown, "parallel.rank 2 is not below"):
            Spec(dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, rank=2)))


@unittest.skipUnless(HAVE_TORCH, "torch is not installed")
class TestStats(SpecCase):
    def test_get_stats_returns_vllms_stats_class_or_none(self):
        m = self.manager(self.spec())
        self.assertIsNone(m.get_stats())  # nothing happened yet
        k = keys(1, "stats")[0]
        self.answer(m, k, S.LookupResult.MISS)
        s = m.get_stats()
        self.assertIsInstance(s, S.OffloadingConnectorStats)
        self.assertFalse(s.is_empty())
        self.assertEqual(s.data["data"][_metrics.PREFIX + "lookup_misses"], {("scheduler",): 1})
        self.assertIsNone(m.get_stats())  # reported once
        self.assertIsInstance(m.counters(), dict)

    def test_without_a_stats_class_get_stats_is_none(self):
        api = types.SimpleNamespace(**vars(S.SPEC_API))
        api.OffloadingConnectorStats = None
        api.OffloadingCounterMetadata = None
        cls = kv.spec_class(api)
        self.assertEqual(cls.build_metric_definitions({}), {})
        m = self.manager(cls(S.fake_offloading_config(self.daemon.socket)))
        answer_of(m, keys(1, "nostats")[0])
        self.assertIsNone(m.get_stats())

    def test_with_metrics_false_nothing_is_declared_or_reported_and_counters_still_count(self):
        spec = self.spec(metrics=False)
        self.assertEqual(Spec.build_metric_definitions(spec.extra_config), {})
        self.assertTrue(Spec.build_metric_definitions({"metrics": True}))
        with self.assertLogs("vllm.kvhost", "INFO") as logs:
            m = self.manager(spec)
        self.assertTrue(any('metrics off (option "metrics": false)' in line for line in logs.output), logs.output)
        self.answer(m, keys(1, "metrics-off")[0], S.LookupResult.MISS)
        self.assertIsNone(m.get_stats())
        self.assertEqual(m.counters()["lookup_misses"], 1)

    def test_metrics_must_be_a_boolean(self):
        for bad in ("false", 0, None):
            with self.subTest(value=bad), self.assertRaisesRegex(ValueError, "metrics: want true or false"):
                Spec(S.fake_offloading_config("/nonexistent.sock", metrics=bad))

    def test_aggregate_of_1000_steps_under_load_adds_up_to_the_counters_and_every_name_is_declared(self):
        spec = self.spec()
        m = self.manager(spec)
        caches, _ = self.caches()
        w = self.worker(spec, caches)
        defs = Spec.build_metric_definitions(spec.extra_config)
        self.assertTrue(defs)
        stop = threading.Event()
        errors = []

        def load():  # the scheduler's other calls, racing get_stats
            try:
                i = 0
                while not stop.is_set():
                    ks = keys(4, f"load{i}")
                    for k in ks:
                        m.lookup(k, CTX)
                    out = m.prepare_store(ks, CTX)
                    m.complete_store(out.keys_to_store, CTX, success=i % 3 != 0)
                    i += 1
            except Exception as e:  # reported by the test thread
                errors.append(e)
        th = threading.Thread(target=load)
        th.start()
        total = S.OffloadingConnectorStats()
        try:
            for _ in range(1000):
                s = m.get_stats()
                if s is not None:
                    total.aggregate(s)
        finally:
            stop.set()
            th.join()
        self.assertEqual(errors, [])
        d.wait_for(lambda: not m.has_pending_work(), what="the pending lookups to settle")
        last = m.get_stats()
        if last is not None:
            total.aggregate(last)
        c = m.counters()
        got = {name[len(_metrics.PREFIX):]: sum(v.values()) for name, v in total.data["data"].items()}
        for name in ("lookup_retries", "lookup_misses", "stored_keys", "store_failed_keys"):
            self.assertEqual(got.get(name, 0), c.get(name, 0), name)
        self.assertGreater(got["lookup_retries"], 0)
        for name, values in total.data["data"].items():
            self.assertIn(name, defs)
            for labels in values:
                self.assertEqual(len(labels), len(defs[name].labelnames), name)
        del w


def multi(*children):
    """vLLM's current config of an engine whose MultiConnector has children
    (each (kv_connector, kv_connector_extra_config))."""
    return types.SimpleNamespace(kv_transfer_config=types.SimpleNamespace(
        kv_connector="MultiConnector",
        kv_connector_extra_config={"connectors": [
            {"kv_connector": c, "kv_role": "kv_both", "kv_connector_extra_config": x} for c, x in children]}))


class TestUndeclaredInAMultiConnector(unittest.TestCase):
    """_metrics.undeclared: whether vLLM declares, from the first child of a
    connector class, the metrics every child of that class reports."""

    KV = {"spec_name": "KvhostOffloadingSpec", "spec_module_path": "kvhost.vllm", "socket": "/a"}
    KV2 = {**KV, "socket": "/b"}
    CPU = {"cpu_bytes_to_use": 1 << 30}
    OC = "OffloadingConnector"

    def test_cases(self):
        def is_kv(x):
            return x.get("spec_name") == "KvhostOffloadingSpec"
        off = {**self.KV, "metrics": False}
        cases = [
            ("no MultiConnector", types.SimpleNamespace(kv_transfer_config=types.SimpleNamespace(
                kv_connector=self.OC, kv_connector_extra_config=self.KV)), self.KV, None),
            ("no config", None, self.KV, None),
            ("kvhost alone", multi((self.OC, self.KV)), self.KV, None),
            ("not found", multi((self.OC, self.CPU)), self.KV, None),
            ("two kvhost children", multi((self.OC, self.KV), (self.OC, self.KV2)), self.KV2, None),
            ("behind the CPU spec", multi((self.OC, self.CPU), (self.OC, self.KV)), self.KV,
             'child 2 .*after child 1 \\(OffloadingConnector over CPUOffloadingSpec\\).*"metrics": false'),
            ("behind the CPU spec, metrics off", multi((self.OC, self.CPU), (self.OC, off)), off, None),
            ("behind a kvhost spec with metrics off", multi((self.OC, off), (self.OC, self.KV2)), self.KV2,
             "after child 1 .*its metrics off"),
            ("behind another connector class", multi(("LMCacheConnectorV1", {}), (self.OC, self.KV)), self.KV, None),
            ("before the CPU spec", multi((self.OC, self.KV), (self.OC, self.CPU)), self.KV,
             "the first OffloadingConnector.*child 2 \\(CPUOffloadingSpec\\) are undeclared.*put that child first"),
        ]
        for what, vc, extra, want in cases:
            with self.subTest(what):
                got = _metrics.undeclared(vc, extra, is_kv)
                if want is None:
                    self.assertIsNone(got)
                else:
                    self.assertRegex(got or "", want)


@unittest.skipUnless(HAVE_TORCH, "torch is not installed")
class TestHitWindow(SpecCase):
    def test_an_unused_hit_is_unpinned_after_its_window_and_asked_again(self):
        spec = self.spec(pin_lease_s=1, hit_window_s=0.2)
        m = self.manager(spec)
        caches, _ = self.caches()
        w = self.worker(spec, caches)
        k = keys(1, "window")[0]
        self.store(m, w, [k], [0])
        self.answer(m, k, S.LookupResult.HIT)
        d.wait_for(lambda: m.counters().get("pins_expired_unused"), what="the HIT window to pass")
        self.assertEqual(m.counters()["pinned_now"], 0)
        self.assertEqual(m.lookup(k, CTX), S.LookupResult.RETRY)  # asked again
        self.answer(m, k, S.LookupResult.HIT)

    def test_a_round_on_a_replaced_connection_holds_nothing_and_is_left_as_it_was(self):
        """A pin round that ended after its connection was replaced: its
        keys get a MISS (their pins ended with that connection, so none is
        released or counted), and settling it reads the round without
        changing it."""
        from kvhost.vllm import _spec_pins
        m = self.manager(self.spec())
        ks = keys(2, "replaced")
        rnd = _spec_pins._PinRound(object(), ks, time.monotonic())  # not the manager's connection
        rnd.pins.append(7)
        before = m.counters()
        with m._cv:
            for k in ks:
                m._pending.add(k)
            release = m._settle_round_locked(rnd)
        self.assertEqual(release, [])
        self.assertEqual((rnd.pins, rnd.held, rnd.answered), ([7], dict.fromkeys(ks, True), True))
        after = m.counters()
        self.assertEqual(after.get("daemon_pins", 0), before.get("daemon_pins", 0))
        self.assertEqual(after.get("missing_keys", 0) - before.get("missing_keys", 0), len(ks))
        self.assertEqual(after["pinned_now"], 0)
        for k in ks:
            self.assertEqual(m.lookup(k, CTX), S.LookupResult.MISS)


@unittest.skipUnless(HAVE_TORCH, "torch is not installed")
class TestPinLoadable(SpecCase):
    def engine(self, **opts):
        """A spec of options opts, its manager and one worker: (spec,
        manager, worker)."""
        spec = self.spec(**opts)
        m = self.manager(spec)
        return spec, m, self.worker(spec, self.caches()[0])

    def info_logs(self):
        """The spec's log records, at INFO and above, until the test ends."""
        logger = logging.getLogger("vllm.kvhost")
        self.addCleanup(logger.setLevel, logger.level)
        logger.setLevel(logging.INFO)
        logs = d.LogRecords("vllm.kvhost")
        self.addCleanup(logs.close)
        return logs

    def gone(self, w):
        """Shuts worker w down and waits until the daemon no longer counts
        a cache in any namespace (it drops them as it notices the closed
        connection, after shutdown returns)."""
        w.shutdown()
        d.wait_for(lambda: all(ns["caches"] == 0 for ns in self.daemon_stats()["namespaces"]["list"]),
                   what="the daemon to drop the worker's caches")

    def test_a_daemon_without_pin_loadable_gets_plain_pins_and_hits(self):
        """A daemon older than PinLoadable answers it "unknown type": the
        manager says so once and pins as before, answering HIT."""
        logs = d.LogRecords("vllm.kvhost")
        self.addCleanup(logs.close)
        spec, m, w = self.engine()
        ks = keys(2, "old-daemon")
        self.store(m, w, ks, [0, 1])

        def unknown(client, *a, **kw):
            raise kvhost.KvhostError(P.CODE_UNKNOWN_TYPE, "type(0x0012) is not a request")

        with mock.patch.object(kvhost.Client, "pin_loadable", unknown):
            for k in ks:
                self.answer(m, k, S.LookupResult.HIT)
        self.assertEqual(logs.count("does not know PinLoadable"), 1, logs.messages)
        self.assertNotIn("no_worker_keys", m.counters())

    def test_keys_answer_miss_while_no_worker_is_connected_and_hit_after(self):
        """The worker's connection ends (its cache goes with it): the
        manager's next lookups answer MISS, counted, and HIT again once a
        worker's cache is registered."""
        spec, m, w = self.engine(miss_ttl_s=0.05)
        ks = keys(2, "no-worker")
        self.store(m, w, ks, [0, 1])
        self.gone(w)
        self.answer(m, ks[0], S.LookupResult.MISS)
        self.assertEqual(m.counters()["no_worker_keys"], 1)
        self.worker(spec, self.caches(seed=2)[0])
        d.wait_for(lambda: answer_of(m, ks[0]) == S.LookupResult.HIT, what="a HIT with a worker back")
        self.answer(m, ks[1], S.LookupResult.HIT)

    def test_a_key_answered_miss_for_no_worker_is_not_reported_removed(self):
        """A key this manager stored and that the daemon still holds answers
        MISS while no worker's cache is registered: no event says it was
        removed (a KV-cache-aware router would stop sending its requests
        here), and it answers HIT again once a worker is back."""
        spec, m, w = self.engine(miss_ttl_s=0.05)
        k = keys(1, "no-worker-event")[0]
        self.store(m, w, [k], [0])
        self.assertEqual([e.removed for e in m.take_events()], [False])
        self.gone(w)
        self.answer(m, k, S.LookupResult.MISS)
        self.assertEqual(m.counters()["no_worker_keys"], 1)
        self.assertEqual([e.removed for e in m.take_events()], [], "a stored key reported removed")
        self.worker(spec, self.caches(seed=2)[0])
        d.wait_for(lambda: answer_of(m, k) == S.LookupResult.HIT, what="a HIT with a worker back")

    def test_no_worker_keys_counts_each_key_once_whatever_the_ranks(self):
        """With tensor parallelism no rank's worker is registered: each key
        answered MISS for it counts once in no_worker_keys, not once per
        rank's namespace."""
        m = self.manager(self.spec(tp=2, miss_ttl_s=60))
        ks = keys(3, "no-worker-tp")
        for k in ks:
            self.answer(m, k, S.LookupResult.MISS)
        self.assertEqual(m.counters()["no_worker_keys"], len(ks))

    def store_when_let_through(self, m, w, ks, blocks):
        """Stores ks through w once prepare_store lets them through (the
        manager has found the worker back), as store does."""
        out = d.wait_for(lambda: (lambda o: o if o is not None and o.keys_to_store else None)(m.prepare_store(ks, CTX)),
                         timeout=10, what="a store let through")
        self.assertTrue(self.transfer(w, True, out.store_spec, [blocks[ks.index(k)] for k in out.keys_to_store]).success)
        m.complete_store(out.keys_to_store, CTX, success=True)

    def test_stores_are_refused_while_no_worker_could_run_them(self):
        """A store handed out while the daemon has no worker's cache would
        move nothing and still tell vLLM (stored events) that it had:
        prepare_store answers None once a pin round found no worker, and
        stores again once one found the worker back."""
        spec, m, w = self.engine(miss_ttl_s=0.05)
        ks = keys(3, "no-worker-store")
        self.store(m, w, ks[:1], [0])
        self.gone(w)
        self.answer(m, ks[1], S.LookupResult.MISS)  # a pin round finds no worker
        self.assertEqual(m.counters()["no_worker_keys"], 1)
        refused = m.counters().get("store_refused", 0)
        self.assertIsNone(m.prepare_store(ks[1:2], CTX))
        self.assertEqual(m.counters()["store_refused"], refused + 1)
        w2 = self.worker(spec, self.caches(seed=3)[0])
        self.store_when_let_through(m, w2, ks[2:], [1])
        self.answer(m, ks[2], S.LookupResult.HIT)

    def test_stores_of_a_worker_that_stays_away_are_skipped_not_refused(self):
        """vLLM logs "cannot store chunks" for every refused store, each
        step, for every running request, and tries them again: once the
        worker has stayed away two reconnection periods, prepare_store
        answers no keys to store (vLLM moves on, quietly) instead of None,
        and stores again once the worker is back."""
        spec, m, w = self.engine(miss_ttl_s=0.05, reconnect_s=0.1)
        ks = keys(3, "away-store")
        self.store(m, w, ks[:1], [0])
        self.gone(w)
        self.answer(m, ks[1], S.LookupResult.MISS)  # a pin round finds no worker
        self.assertIsNone(m.prepare_store(ks[1:2], CTX))  # the worker may be coming back
        n = iter(range(1 << 20))
        d.wait_for(lambda: answer_of(m, keys(1, f"away-probe-{next(n)}")[0]) == S.LookupResult.MISS
                   and m.prepare_store(ks[1:2], CTX) is not None, what="stores skipped once the worker stayed away")
        out = m.prepare_store(ks[1:2], CTX)
        self.assertEqual(out.keys_to_store, [])
        self.assertGreaterEqual(m.counters()["store_keys_skipped_no_worker"], 2)
        self.assertEqual(m.counters()["storing_now"], 0)
        w2 = self.worker(spec, self.caches(seed=4)[0])
        self.store_when_let_through(m, w2, ks[2:], [1])
        self.answer(m, ks[2], S.LookupResult.HIT)

    def test_a_hybrid_models_stores_resume_though_no_later_group_is_looked_up(self):
        """vLLM looks a hybrid model's later groups up only after group 0
        hit, and hands prepare_store every group's keys at once. A pin
        round that found no group-1 cache (the worker had registered group
        0's only: its start, a daemon restart) refused those stores; with
        no group-0 key stored, every later request missed in group 0 and
        no lookup of group 1 ever came to let stores through again. The
        manager asks the daemon itself once the worker is back."""
        spec = self.spec(groups=2, miss_ttl_s=0.05)
        m = self.manager(spec)
        caches, _ = self.caches(groups=2)
        self.worker(spec, caches)
        k1 = keys(1, "hybrid-window", group=1)[0]
        real = kvhost.Client.pin_loadable

        def window(client, ns, dkeys, *a, **kw):  # group 1's cache not registered yet
            if sc.daemon_key(k1) in dkeys:
                return 0, [False] * len(dkeys), True
            return real(client, ns, dkeys, *a, **kw)

        with mock.patch.object(kvhost.Client, "pin_loadable", window):
            self.answer(m, k1, S.LookupResult.MISS)
        # New prompts only: group 0's first key misses, so vLLM looks no
        # group-1 key up, and stores both groups' keys.
        i = iter(range(1 << 20))

        def stored():
            n = next(i)
            k0, g1 = keys(1, f"hybrid-new-{n}", group=0), keys(1, f"hybrid-new-{n}", group=1)
            self.assertEqual(answer_of(m, k0[0]), S.LookupResult.MISS)
            out = m.prepare_store(k0 + g1, CTX)
            # None (refused) until the manager finds the worker back.
            return out if out is not None and out.keys_to_store else None

        out = d.wait_for(stored, timeout=10, what="a store let through with every group's worker registered")
        self.assertEqual(len(out.keys_to_store), 2)

    def test_stores_resume_with_a_daemon_that_does_not_know_pin_loadable(self):
        """No worker was registered, then the daemon answers PinLoadable
        "unknown type" (an older daemon started in its place): it can say
        nothing of workers, so stores go through as before the frame
        instead of staying refused on the older daemon's last answer."""
        spec, m, w = self.engine(miss_ttl_s=0.05)
        ks = keys(3, "no-worker-old-daemon")
        self.store(m, w, ks[:1], [0])
        self.gone(w)
        self.answer(m, ks[1], S.LookupResult.MISS)  # a pin round finds no worker
        self.assertIsNone(m.prepare_store(ks[1:2], CTX))
        self.worker(spec, self.caches(seed=3)[0])

        def unknown(client, *a, **kw):
            raise kvhost.KvhostError(P.CODE_UNKNOWN_TYPE, "type(0x0012) is not a request")

        with mock.patch.object(kvhost.Client, "pin_loadable", unknown):
            d.wait_for(lambda: answer_of(m, ks[0]) == S.LookupResult.HIT, what="a plain pin's HIT")
            out = d.wait_for(lambda: m.prepare_store(ks[2:], CTX), timeout=10, what="a store let through")
        self.assertEqual(out.keys_to_store, ks[2:])

    def test_a_restart_does_not_warn_of_no_worker(self):
        """After a daemon restart the manager connects before the worker,
        which connects again at vLLM's next step: lookups in between answer
        MISS without a warning that a worker was refused (load_retry_s, 30
        s by default, has not passed)."""
        logs = self.info_logs()
        spec, m, w = self.engine(miss_ttl_s=0.05, reconnect_s=0.05)
        ks = keys(2, "restart-window")
        self.store(m, w, ks, [0, 1])
        self.answer(m, ks[0], S.LookupResult.HIT)
        self.daemon.halt(signal.SIGTERM)
        try:
            d.wait_for(lambda: m.lookup(ks[0], CTX) == S.LookupResult.MISS, what="the manager to see the daemon gone")
        finally:
            self.daemon.start_again()
        d.wait_for(lambda: m.counters().get("reconnects") == 1, what="the manager to connect again")
        self.answer(m, ks[1], S.LookupResult.MISS)
        self.assertEqual(m.counters()["no_worker_keys"], 1)
        d.wait_for(lambda: not list(w.get_finished()) and w.counters()["connected"],
                   what="the worker to connect again")
        d.wait_for(lambda: answer_of(m, ks[1]) == S.LookupResult.HIT, what="a HIT once the worker is back")
        self.assertEqual(logs.count("no worker of rank"), 0, logs.messages)
        self.assertEqual(logs.count("registered with the daemon again"), 0, logs.messages)

    def test_a_worker_that_stays_away_is_warned_of_once(self):
        """A worker away load_retry_s past the first lookup that found it
        missing is warned of, once however many lookups follow; its return
        is logged."""
        logs = self.info_logs()
        spec, m, w = self.engine(miss_ttl_s=0.05, load_retry_s=0.2)
        ks = keys(1, "stays-away")
        self.store(m, w, ks, [0])
        self.gone(w)
        n = iter(range(1 << 20))
        d.wait_for(lambda: answer_of(m, keys(1, f"stays-away-{next(n)}")[0]) == S.LookupResult.MISS
                   and logs.count("no worker of rank") == 1, what="the warning once the worker stayed away")
        for i in range(3):
            self.answer(m, keys(1, f"stays-away-more-{i}")[0], S.LookupResult.MISS)
        self.assertEqual(logs.count("no worker of rank"), 1, logs.messages)
        self.worker(spec, self.caches(seed=5)[0])
        d.wait_for(lambda: answer_of(m, keys(1, f"stays-away-{next(n)}")[0]) == S.LookupResult.MISS
                   and logs.count("registered with the daemon again") == 1, what="the worker's return logged")

    def test_a_hybrid_models_worker_that_stays_away_is_warned_of_once_per_rank(self):
        """A hybrid model's groups share their rank's worker: its absence,
        found in each group's namespace, is one warning, and its return
        one line once every group is registered again."""
        logs = self.info_logs()
        spec = self.spec(groups=2, miss_ttl_s=0.05, load_retry_s=0.2)
        m = self.manager(spec)
        w = self.worker(spec, self.caches(groups=2)[0])
        self.gone(w)
        n = iter(range(1 << 20))

        def both_missed():
            i = next(n)
            return all(answer_of(m, keys(1, f"hybrid-away-{i}", group=g)[0]) == S.LookupResult.MISS
                       for g in (0, 1))

        d.wait_for(lambda: both_missed() and len(m._warned) == 2, what="both groups found away past load_retry_s")
        self.assertEqual(logs.count("no worker of rank 0"), 1, logs.messages)
        self.worker(spec, self.caches(groups=2, seed=6)[0])
        d.wait_for(lambda: both_missed() and not m._warned, what="both groups found registered again")
        self.assertEqual(logs.count("registered with the daemon again"), 1, logs.messages)


@unittest.skipUnless(HAVE_TORCH, "torch is not installed")
class TestDaemonPins(SpecCase):
    """The daemon's Pin/Unpin as the Python client sends them."""

    def setUp(self):
        super().setUp()
        spec = self.spec()
        m = self.manager(spec)
        caches, _ = self.caches()
        w = self.worker(spec, caches)
        self.ks = keys(2, "raw-pin")
        self.store(m, w, self.ks, [0, 1])
        self.geo = sc.geometry(sc.describe(spec._ident, 0, 0))

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


@unittest.skipUnless(HAVE_TORCH, "torch is not installed")
class TestTensorParallel(SpecCase):
    def test_hit_only_when_every_rank_has_the_key(self):
        specs = [self.spec(tp=2, rank=r) for r in range(2)]  # each worker's config carries its rank
        m = self.manager(specs[0])
        workers = []
        for r in range(2):
            caches, _ = self.caches(seed=r)
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


@unittest.skipUnless(HAVE_TORCH, "torch is not installed")
class TestEvictionPressure(SpecCase):
    # 16 files' worth: the daemon must evict while we store 40 more keys.
    capacity = f"{16 * FILE_BYTES}B"

    def test_pinned_key_survives_between_prepare_load_and_complete_load(self):
        spec = self.spec()
        m = self.manager(spec)
        caches, tensors = self.caches()
        w = self.worker(spec, caches)
        k = keys(1, "precious")[0]
        self.store(m, w, [k], [0])
        want = rows(tensors, [0])
        self.answer(m, k, S.LookupResult.HIT)
        load_spec = m.prepare_load([k], CTX)

        # Another engine fills the daemon far past its capacity.
        m2, w2 = self.other_engine_stores("pressure")
        evictions = self.daemon_stats()["evictions"]
        self.assertGreater(evictions, 0, "no eviction: the test proves nothing")

        for t in tensors:
            t[50].zero_()
        res = self.transfer(w, False, load_spec, [50])
        self.assertTrue(res.success)
        self.assertEqual(rows(tensors, [50]), want)
        m.complete_load([k], CTX)
        d.wait_for(lambda: m.counters().get("daemon_unpins", 0) == m.counters()["daemon_pins"],
                   what="the manager to release its pins")

        # Released, it is evictable again: more pressure removes it.
        for i in range(5, 10):
            self.store(m2, w2, keys(8, f"pressure{i}"), list(range(8)))
        self.answer(m, k, S.LookupResult.MISS)
        self.assertEqual([e.removed for e in m.take_events()], [False, True])


class RestartHoldCase(SpecCase):
    # 16 files' worth: another engine's 40 keys must evict.
    capacity = f"{16 * FILE_BYTES}B"
    restart_hold = "10m"  # far beyond the test, however slow the machine

    @classmethod
    def setUpClass(cls):
        cls.daemon = d.Daemon(capacity=cls.capacity, extra_toml=f'[engine]\nrestart_hold = "{cls.restart_hold}"\n')

    def load_after_pressure_before_repin(self, tag):
        """A load prepared before the daemon crashed; on the new daemon,
        with the manager's pin round that would pin the load's keys again
        held back, another engine stores 40 keys into room for 16. Then the
        pin round goes on and the worker loads. Returns (the load's result,
        whether its rows are the stored ones, the evictions meanwhile)."""
        m, w, tensors = self.restarting(61)
        ks, want = self.pinned(m, w, f"held-{tag}", tensors)
        load = m.prepare_load(ks, CTX)
        with self.held_pin_round(ks[0]) as (entered, _):
            self.crash_and_start_again(m, f"held-{tag}-probe")
            self.assertTrue(entered.wait(30), "no re-pin round began on the new daemon")
            before = self.daemon_stats()["evictions"]
            self.other_engine_stores(f"{tag}-pressure")
            evictions = self.daemon_stats()["evictions"] - before
        dst = [50, 51, 52, 53]
        for t in tensors:
            t[dst[0]:dst[-1] + 1].zero_()
        res = self.transfer(w, False, load, dst)
        m.complete_load(ks, CTX)
        return res, rows(tensors, dst) == want, evictions


@unittest.skipUnless(HAVE_TORCH, "torch is not installed")
class TestRestartHold(RestartHoldCase):
    def test_a_new_daemon_evicts_no_found_key_before_the_manager_pins_it(self):
        """The daemon's restart_hold (10 s by default; 10 minutes here)
        keeps the files it found at start from eviction: the other engine's stores evict only
        each other, and the worker's load, retried on the new daemon, loads
        byte for byte."""
        res, same, evictions = self.load_after_pressure_before_repin("on")
        self.assertGreater(evictions, 0, "no eviction: the test proves nothing")
        self.assertTrue(res.success)
        self.assertTrue(same)


@unittest.skipUnless(HAVE_TORCH, "torch is not installed")
class TestWithoutRestartHold(RestartHoldCase):
    """The same with restart_hold = "0s": the other engine's stores evict
    the load's keys before the manager pins them, and the load fails, which
    would stop vLLM's worker. This is the window the hold closes, and it
    shows that the pressure of TestRestartHold reaches the keys."""
    restart_hold = "0s"

    def test_without_the_hold_the_pressure_evicts_the_keys_being_loaded(self):
        res, _, evictions = self.load_after_pressure_before_repin("off")
        self.assertGreater(evictions, 0)
        self.assertFalse(res.success)


class TestRefusals(unittest.TestCase):
    def test_unsupported_vllm_names_the_window(self):
        @dataclasses.dataclass
        class OldResult:  # a TransferResult without transfer_size/transfer_time
            job_id: int
            success: bool
        api = types.SimpleNamespace(**vars(S.SPEC_API))
        api.TransferResult = OldResult
        with self.assertRaises(kv.UnsupportedVLLM) as cm:
            kv.spec_class(api)
        self.assertIn("TransferResult.transfer_size", str(cm.exception))
        self.assertIn("v0.26.0 (2026-07-26", str(cm.exception))

    def test_spec_without_the_methods_vllm_requires(self):
        class Base(S.OffloadingSpec):
            @__import__("abc").abstractmethod
            def get_handlers(self): ...
        api = types.SimpleNamespace(**vars(S.SPEC_API))
        api.OffloadingSpec = Base
        with self.assertRaises(kv.UnsupportedVLLM) as cm:
            kv.spec_class(api)
        self.assertIn("get_handlers", str(cm.exception))


@unittest.skipUnless(HAVE_TORCH, "torch is not installed")
class TestNoStoredEventWithoutAWorker(SpecCase):
    """Issue 86, K2: the manager and the worker connect to the daemon each
    on its own thread. vLLM's worker asserts every transfer succeeds, so a
    worker with no connection reports its store a success storing nothing;
    a manager that connected first accepted such stores and sent stored
    events for keys no daemon held. Each scenario runs TRIALS times, the
    manager or the worker connecting first by turns: every key with a
    stored event (and no removed one) loads, and every store accepted
    once the worker was connected is stored."""

    TRIALS = 20
    FAST, SLOW = 0.01, 0.25  # reconnect_s of the half that connects first, and of the other

    @classmethod
    def setUpClass(cls):
        cls.daemon = d.Daemon(capacity=cls.capacity)

    def halves(self, manager_first):
        """A manager and a worker of one engine whose reconnect periods make
        one of them (the manager where manager_first) connect well before
        the other: (manager, worker, tensors)."""
        fast, slow = (self.FAST, self.SLOW) if manager_first else (self.SLOW, self.FAST)
        m = self.manager(self.spec(reconnect_s=fast, miss_ttl_s=0.02))
        caches, tensors = self.caches(seed=7)
        w = self.worker(self.spec(reconnect_s=slow, miss_ttl_s=0.02), caches)
        return m, w, tensors

    def step(self, m, w, k, block):
        """One scheduler step's store of key k from block, as vLLM runs it:
        (accepted, whether the worker was connected before it was asked)."""
        connected = w.counters()["connected"]
        out = m.prepare_store([k], CTX)
        if out is None or not out.keys_to_store:
            self.assertEqual(w.get_finished(), [])  # vLLM's worker asks every step
            return False, connected
        self.transfer(w, True, out.store_spec, [block])  # a success, whatever it stored (vLLM asserts it)
        m.complete_store(out.keys_to_store, CTX, success=True)
        return True, connected

    def run_until_both_connected(self, m, w, prefix, restart=None):
        """Steps stores of new keys until the manager and the worker are
        connected and five stores were accepted after that (restart, if
        given, is called after the third accepted store): returns
        (keys accepted, keys accepted with the worker connected since
        before their store, and still connected after it)."""
        accepted, after, n = [], [], 0
        self.worker_away_steps = 0
        deadline = time.monotonic() + 30
        while len(after) < 5:
            self.assertLess(time.monotonic(), deadline, f"the manager and the worker never both connected: "
                            f"{m.counters()}, {w.counters()}")
            k = keys(1, f"{prefix}-{n}")[0]
            if m.counters()["connected"] and not w.counters()["connected"]:
                self.worker_away_steps += 1
            ok, before = self.step(m, w, k, n % 16)
            n += 1
            if ok:
                accepted.append(k)
                if before and w.counters()["connected"] and m.counters()["connected"] and \
                        (restart is None or restart.done):
                    after.append(k)
                if restart is not None and not restart.done and len(accepted) == 3:
                    restart()
        return accepted, after

    def check(self, m, w, tensors, accepted, after):
        """Every key with a stored event and no removed one loads, and every
        key of after has one."""
        settled(m)
        stored = set()
        for e in m.take_events():
            for k in e.keys:
                (stored.discard if e.removed else stored.add)(bytes(k))
        self.assertLessEqual(stored, set(accepted))
        missing = set(after) - stored
        self.assertFalse(missing, f"{len(missing)} stores accepted with the worker connected have no stored event")
        ks = sorted(stored)
        for k in ks:
            self.assertEqual(answer_of(m, k), S.LookupResult.HIT, f"a key with a stored event misses: {k.hex()}")
        for i in range(0, len(ks), 16):
            chunk = ks[i:i + 16]
            res = self.transfer(w, False, m.prepare_load(chunk, CTX), list(range(32, 32 + len(chunk))))
            self.assertTrue(res.success, "a key with a stored event does not load")
            m.complete_load(chunk, CTX)
        return len(stored)

    def end_trial(self):
        for c in reversed(self.closers):
            c()
        self.closers.clear()

    def test_a_spec_started_before_its_daemon_sends_stored_events_only_for_stored_keys(self):
        away = 0
        for trial in range(self.TRIALS):
            with self.subTest(trial=trial):
                self.daemon.halt()
                m, w, tensors = self.halves(manager_first=trial % 2 == 0)
                self.daemon.start_again()
                accepted, after = self.run_until_both_connected(m, w, f"early-{trial}")
                self.check(m, w, tensors, accepted, after)
                away += self.worker_away_steps
                self.end_trial()
        # The manager-first trials stepped with the manager connected and the worker not.
        self.assertGreater(away, 0, "no trial had the manager connect before its worker")

    def test_a_store_handed_out_while_the_worker_registers_waits_for_its_connection(self):
        # The daemon counts the worker's cache as soon as it is registered,
        # before the worker's new connection is in use: the manager can
        # find it and hand out a store in that window. The store must run
        # on the new connection, not move nothing as without one.
        from kvhost import client as kc
        registered, go_on = threading.Event(), threading.Event()
        real = kc.Client.register_cache

        def held(client, *args, **kwargs):
            got = real(client, *args, **kwargs)  # only the worker registers caches
            if not go_on.is_set():
                registered.set()
                self.assertTrue(go_on.wait(30), "the test never let the registration end")
            return got
        patch = mock.patch.object(kc.Client, "register_cache", held)
        patch.start()
        self.addCleanup(patch.stop)
        self.addCleanup(go_on.set)
        self.daemon.halt()
        m = self.manager(self.spec(reconnect_s=0.01, miss_ttl_s=0.01))
        caches, tensors = self.caches(seed=11)
        w = self.worker(self.spec(reconnect_s=0.01, miss_ttl_s=0.01), caches)
        self.daemon.start_again()
        self.assertTrue(registered.wait(30), "the worker never registered its cache")
        k = keys(1, "registering")[0]
        out = None

        def handed_out():
            nonlocal out
            out = m.prepare_store([k], CTX)
            return out is not None and out.keys_to_store
        d.wait_for(handed_out, what="the manager to hand out a store once the worker's cache is registered")
        self.assertFalse(w.counters()["connected"])  # the window: registered, not yet in use
        done = []
        t = threading.Thread(target=lambda: done.append(self.transfer(w, True, out.store_spec, [3])))
        t.start()
        go_on.set()
        t.join(30)
        self.assertEqual(len(done), 1, "the store never ended")
        m.complete_store(out.keys_to_store, CTX, success=True)
        settled(m)
        self.assertEqual(m.counters().get("store_unverified_keys", 0), 0, f"{m.counters()} {w.counters()}")
        self.assertEqual(answer_of(m, k), S.LookupResult.HIT)
        self.end_trial()

    def test_a_connection_failing_after_its_registration_leaves_no_store_waiting(self):
        from kvhost import client as kc
        caches, _ = self.caches(seed=12)
        w = self.worker(self.spec(), caches)
        self.assertTrue(w.counters()["connected"])
        with mock.patch.object(kc.Client, "set_timeout", side_effect=OSError("setsockopt failed")):
            with self.assertRaises(OSError):
                w._open()  # registers the caches on a new connection, then fails
        self.assertIsNone(w._registering)
        self.end_trial()

    def test_a_daemon_restart_under_load_sends_stored_events_only_for_stored_keys(self):
        daemon = self.daemon

        def restart():
            daemon.halt()
            daemon.start_again()
            restart.done = True

        for trial in range(self.TRIALS):
            with self.subTest(trial=trial):
                restart.done = False
                m, w, tensors = self.halves(manager_first=trial % 2 == 0)
                d.wait_for(lambda: m.counters()["connected"] and w.counters()["connected"],
                           what="the manager and the worker to connect")
                accepted, after = self.run_until_both_connected(m, w, f"restart-{trial}", restart)
                self.check(m, w, tensors, accepted, after)
                self.end_trial()


class TestNoDaemonAtStart(unittest.TestCase):
    """No daemon on the socket when vLLM builds the spec's halves: they
    start without it (test_vllm_real_spec.TestRealSpecDaemonNotUpAtStart
    connects them once one starts); reconnect_s = 0 refuses."""

    def test_the_manager_and_worker_start_without_a_daemon_and_miss(self):
        spec = Spec(config("/nonexistent/kvhost.sock"))
        m = spec.get_manager()
        self.addCleanup(m.shutdown)
        caches, _, bufs = kv_caches()
        for b in bufs:
            self.addCleanup(b.close)
        w = spec.get_worker(caches)
        self.addCleanup(w.shutdown)
        self.assertEqual(answer_of(m, b"k" * 36), S.LookupResult.MISS)
        self.assertIsNone(m.prepare_store([b"k" * 36], CTX))
        self.assertFalse(m.counters()["connected"] or w.counters()["connected"])
        self.assertEqual(m.counters()["namespaces"], sorted(set(w.namespaces)))

    def test_a_daemon_shutting_down_at_start_is_no_daemon_yet(self):
        # A daemon that began stopping while vLLM connects answers
        # "shutting down" (to the Hello, or to the first request after
        # it): the manager and the worker start without it, as with none
        # there; with reconnect_s = 0 they refuse, as without a daemon.
        for at in ("hello", "request"):
            with self.subTest(at=at):
                stopping = d.Stopping(at)
                self.addCleanup(stopping.close)
                spec = Spec(config(stopping.socket, reconnect_s=3600))
                m = spec.get_manager()
                self.addCleanup(m.shutdown)
                caches, _, bufs = kv_caches()
                for b in bufs:
                    self.addCleanup(b.close)
                w = spec.get_worker(caches)
                self.addCleanup(w.shutdown)
                self.assertEqual(answer_of(m, b"k" * 36), S.LookupResult.MISS)
                self.assertFalse(m.counters()["connected"] or w.counters()["connected"])
                spec = Spec(config(stopping.socket, reconnect_s=0))
                with self.assertRaisesRegex(ConnectionError, "shutting down"):
                    spec.get_manager()
                with self.assertRaisesRegex(ConnectionError, "shutting down"):
                    spec.get_worker(caches)

    def test_reconnect_s_0_refuses_to_start_without_a_daemon(self):
        spec = Spec(config("/nonexistent/kvhost.sock", reconnect_s=0))
        with self.assertRaisesRegex(ConnectionError, "cannot connect to the kvhost daemon at /nonexistent"):
            spec.get_manager()
        caches, _, bufs = kv_caches()
        for b in bufs:
            self.addCleanup(b.close)
        with self.assertRaisesRegex(ConnectionError, "cannot connect to the kvhost daemon at /nonexistent"):
            spec.get_worker(caches)


class TestDaemonWithoutPins(unittest.TestCase):
    def test_the_manager_refuses_a_daemon_that_cannot_pin(self):
        """A daemon of before Pin answers it "unknown type": the manager
        refuses to start (it could never answer HIT) instead of missing
        forever."""
        import socket
        import struct
        from kvhost import protocol as P
        tmp = d.socket_dir("kvhost-old-daemon-")
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
    def test_page_size_mismatch_is_refused_at_get_worker(self):
        spec = self.spec()
        caches, _ = self.caches(ref_page=PAGE // 2, tensor_page=PAGE // 2)
        with self.assertRaisesRegex(ValueError, r"2048-byte pages .* scheduler's namespace says 4096"):
            spec.get_worker(caches)

    def test_layer_count_mismatch_is_refused_at_get_worker(self):
        spec = self.spec(layers=4)
        caches, _ = self.caches(layers=3)
        with self.assertRaisesRegex(ValueError, "4 layers in vLLM's offloading config but 3"):
            spec.get_worker(caches)

    def test_padded_pages_move_whole_with_their_padding(self):
        spec = self.spec()
        m = self.manager(spec)
        caches, tensors = self.caches(ref_page=PAGE - 512)  # un-padded page, padded tensor
        w = self.worker(spec, caches)
        ks = keys(2, "padded")
        self.store(m, w, ks, [0, 1])
        for k in ks:
            self.answer(m, k, S.LookupResult.HIT)
        want = rows(tensors, [0, 1])
        res = self.transfer(w, False, m.prepare_load(ks, CTX), [20, 21])
        self.assertTrue(res.success)
        self.assertEqual(rows(tensors, [20, 21]), want)
        m.complete_load(ks, CTX)

    def test_cross_layer_slab_holds_the_same_bytes_as_per_layer_pages(self):
        import torch
        spec = self.spec()
        m = self.manager(spec)
        caches, tensors = self.caches()
        w = self.worker(spec, caches)
        ks = keys(2, "slab")
        self.store(m, w, ks, [0, 1])
        for k in ks:
            self.answer(m, k, S.LookupResult.HIT)
        slab, buf = kvhost.torch_host_tensor((BLOCKS, LAYERS * PAGE), torch.int8, name="spec-slab")
        self.closers.insert(0, buf.close)
        slab.zero_()
        # vLLM's cross-layer layout: one tensor, one ref of every layer's page per block.
        other = self.spec(engine_id="engine-slab")
        ws = self.worker(other, S.CanonicalKVCaches(
            tensors=[S.CanonicalKVCacheTensor(slab, LAYERS * PAGE)],
            group_data_refs=[[S.CanonicalKVCacheRef(0, LAYERS * PAGE)]]))
        self.assertEqual(ws.namespaces, w.namespaces)
        res = self.transfer(ws, False, m.prepare_load(ks, CTX), [7, 9])
        self.assertTrue(res.success)
        for b, src in ((7, 0), (9, 1)):
            self.assertEqual(bytes(slab[b].numpy().tobytes()), b"".join(rows(tensors, [src])))
        m.complete_load(ks, CTX)

    def test_private_host_memory_is_refused(self):
        import torch
        spec = self.spec()
        tensors = [torch.zeros((BLOCKS, PAGE), dtype=torch.int8) for _ in range(LAYERS)]
        caches = S.CanonicalKVCaches([S.CanonicalKVCacheTensor(t, PAGE) for t in tensors],
                                     [[S.CanonicalKVCacheRef(i, PAGE) for i in range(LAYERS)]])
        with self.assertRaisesRegex(ValueError, "shared memory"):
            spec.get_worker(caches)


if __name__ == "__main__":
    unittest.main()
