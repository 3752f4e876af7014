"""KvhostOffloadingSpec inside vLLM's own code: vLLM's OffloadingSpecFactory
loads it from its module path and builds it from an OffloadingConfig filled
like build_offloading_config fills it; the tests drive its manager in the
scheduler's call order and its workers with vLLM's GPULoadStoreSpec and
CanonicalKVCaches (over CPU int8 tensors in shared memory) against a real
kvhost daemon, and feed get_stats to vLLM's OffloadingConnectorStats every
step. No class under test is a stand-in; only vLLM's heavy imports are
shimmed (vllm_tree.py).

Needs a vLLM source tree: `make test-vllm VLLM_SRC=DIR` (or
KVHOST_VLLM_SRC=DIR); without one every test here reports itself skipped.
One tree per process: run once per snapshot.
"""

import hashlib
import logging
import multiprocessing
import os
import pathlib
import pickle
import signal
import sys
import threading
import time
import unittest
from unittest import mock

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

import daemon as d  # noqa: E402
import vllm_tree  # noqa: E402

NO_TREE = vllm_tree.skip_reason()


def unobserved():
    """These tests hand the worker CanonicalKVCaches of their own, not built
    by vLLM's worker set-up (vLLM's attention modules are not loaded): there
    is no attention backend or KV cache layout to observe. TestRealPageLayout
    reports ones of its own."""
    from kvhost.vllm import spec_worker
    return mock.patch.object(spec_worker, "observe_layout", lambda groups: None)


_UNOBSERVED = None


def setUpModule():
    global _UNOBSERVED
    _UNOBSERVED = unobserved()
    _UNOBSERVED.start()


def tearDownModule():
    _UNOBSERVED.stop()
LAYERS, PAGE, BLOCKS = 4, 4096, 32
MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def layer_names(n=LAYERS, start=0):
    return tuple(f"model.layers.{i}.self_attn.attn" for i in range(start, start + n))


def key(i, tag="k", group=0):
    """An OffloadKey: a 32-byte block hash and the 4-byte group index."""
    return hashlib.sha256(f"{tag}-{i}".encode()).digest() + group.to_bytes(4, "big")


def offloading_config(api, socket, model=MODEL, tp=1, rank=0, groups=1, engine_id=None, chunk=1, events=True,
                      **extra):
    """vLLM's OffloadingConfig as build_offloading_config fills it for a
    model of LAYERS layers per group (a hybrid model's groups share their
    tensors: LAYERS pages per block in all), naming kvhost's spec; chunk
    is the blocks per chunk vLLM resolved (from the extra config's
    blocks_per_chunk or block_size) into config.cache; events turns vLLM's
    KV cache events on (these tests read the manager's events)."""
    extra_config = {"spec_name": "KvhostOffloadingSpec", "spec_module_path": "kvhost.vllm", "socket": socket,
                    **extra}
    return vllm_tree.make_offloading_config(
        api, model=model, tp=tp, rank=rank, engine_id=engine_id,
        groups=tuple((layer_names(LAYERS, g * LAYERS), 16) for g in range(groups)),
        worker_kv_bytes_per_block=LAYERS * PAGE, blocks_per_chunk=chunk, extra_config=extra_config,
        enable_kv_cache_events=events)


def canonical_caches(api, seed, groups=1):
    """vLLM's CanonicalKVCaches over LAYERS int8 (BLOCKS, PAGE) tensors in
    one shared-memory file (every group's layer i uses tensor i, as a
    hybrid model's groups do). Returns (caches, tensors, buffer)."""
    import torch
    import kvhost
    big, buf = kvhost.torch_host_tensor((LAYERS, BLOCKS, PAGE), torch.int8, name="real-spec")
    big.copy_(torch.randint(-128, 128, big.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.int8))
    tensors = [big[i] for i in range(LAYERS)]
    caches = api.CanonicalKVCaches(
        tensors=[api.CanonicalKVCacheTensor(tensor=t, page_size_bytes=PAGE) for t in tensors],
        group_data_refs=[[api.CanonicalKVCacheRef(tensor_idx=i, page_size_bytes=PAGE) for i in range(LAYERS)]
                         for _ in range(groups)])
    return caches, tensors, buf


def rows(tensors, blocks):
    return [bytes(t[b].numpy().tobytes()) for t in tensors for b in blocks]


def run_job(worker, job_id, store, kv_spec, gpu_spec):
    """submit → wait → get_finished as vLLM's connector worker runs it;
    the TransferResult."""
    ok = worker.submit_store(job_id, gpu_spec, kv_spec) if store else worker.submit_load(job_id, kv_spec, gpu_spec)
    assert ok is True
    worker.wait({job_id})
    got = []
    d.wait_for(lambda: got.extend(worker.get_finished()) or got, what=f"job {job_id}'s result")
    assert [r.job_id for r in got] == [job_id], got
    return got[0]


def rank_process(socket, rank, conn, engine_id):
    """One TP rank's worker in its own process (vLLM runs one per GPU): its
    config carries its rank and its engine's id; it answers ("store"|"load", job, kv spec,
    blocks) with (success, transfer size, rows of the blocks) and "rows"
    with the rows of the blocks."""
    api = vllm_tree.load()
    unobserved().start()  # a process of its own (spawn): setUpModule did not run here
    spec = api.OffloadingSpecFactory.create_spec(offloading_config(api, socket, tp=2, rank=rank, engine_id=engine_id))
    caches, tensors, buf = canonical_caches(api, seed=100 + rank)
    worker = spec.get_worker(caches)
    conn.send(("ready", worker.namespaces))
    try:
        while True:
            msg = conn.recv()
            if msg[0] == "stop":
                break
            if msg[0] == "rows":
                conn.send(rows(tensors, msg[1]))
                continue
            what, job, kv_spec, blocks = msg
            for t in tensors:
                if what == "load":
                    t[blocks].zero_()
            gpu = api.GPULoadStoreSpec(blocks, group_sizes=[len(blocks)], block_indices=[0])
            res = run_job(worker, job, what == "store", pickle.loads(kv_spec), gpu)
            conn.send((res.success, res.transfer_size, rows(tensors, blocks)))
    finally:
        worker.shutdown()
        buf.close()
        conn.close()


@unittest.skipUnless(NO_TREE is None, NO_TREE or "")
class RealSpecCase(vllm_tree.RealCase):
    """A daemon per class; managers and workers closed after each test."""

    support = "spec_class"

    def setUp(self):
        self.require_support()
        self.closers = []
        self.job = 0
        self.stats = self.api.OffloadingConnectorStats()

    def tearDown(self):
        for c in reversed(getattr(self, "closers", [])):
            c()

    def spec(self, socket=None, **kw):
        """The spec as vLLM's connector makes it: OffloadingSpecFactory.create_spec
        (on the class's daemon, or socket)."""
        spec = self.api.OffloadingSpecFactory.create_spec(
            offloading_config(self.api, socket or self.daemon.socket, **kw))
        self.assertIsInstance(spec, self.api.OffloadingSpec)
        return spec

    def manager(self, spec):
        m = spec.get_manager()
        self.assertIsInstance(m, self.api.OffloadingManager)
        self.closers.append(m.shutdown)
        return m

    def worker(self, spec, seed=0, groups=1):
        caches, tensors, buf = canonical_caches(self.api, seed, groups)
        self.closers.append(buf.close)
        w = spec.get_worker(caches)
        self.assertIsInstance(w, self.api.OffloadingWorker)
        self.closers.append(w.shutdown)
        return w, tensors

    def step(self, m):
        """The end of a scheduler step: vLLM's get_stats and on_schedule_end."""
        s = m.get_stats()
        if s is not None:
            self.assertIsInstance(s, self.api.OffloadingConnectorStats)
            self.assertFalse(s.is_empty())
            self.stats.aggregate(s)
        if self.api.ScheduleEndContext is not None:
            m.on_schedule_end(self.api.ScheduleEndContext(new_req_ids=[], preempted_req_ids=[]))

    def settle(self, m, k, ctx):
        """lookup until it is not RETRY, stepping between tries as vLLM does
        while has_pending_work."""
        R = self.api.LookupResult

        def once():
            r = m.lookup(k, ctx)
            if r == R.RETRY:
                self.step(m)
                return None
            return r
        return d.wait_for(once, what="a settled lookup")

    def gpu(self, blocks, sizes=None):
        sizes = sizes or [len(blocks)]
        return self.api.GPULoadStoreSpec(blocks, group_sizes=sizes, block_indices=[0] * len(sizes))

    def transfer(self, w, store, kv_spec, blocks, sizes=None):
        self.job += 1
        return run_job(w, self.job, store, pickle.loads(pickle.dumps(kv_spec)), self.gpu(blocks, sizes))

    def pinned(self, tag, seed):
        """A manager and worker (reconnecting every 0.05 s) with three keys
        stored from blocks 1-3 and answered HIT (pinned): (manager, worker,
        tensors, context, keys, the blocks' rows)."""
        spec = self.spec(reconnect_s=0.05)
        m = self.manager(spec)
        w, tensors = self.worker(spec, seed=seed)
        ctx = self.api.ReqContext(req_id=tag)
        ks = [key(i, tag) for i in range(3)]
        out = m.prepare_store(ks, ctx)
        self.assertTrue(self.transfer(w, True, out.store_spec, [1, 2, 3]).success)
        m.complete_store(out.keys_to_store, ctx)
        for k in ks:
            self.assertEqual(self.settle(m, k, ctx), self.api.LookupResult.HIT)
        return m, w, tensors, ctx, ks, rows(tensors, [1, 2, 3])

    def stored(self, spec, m, ks, seed=0):
        """Stores ks through one worker of spec; returns the worker."""
        ctx = self.api.ReqContext(req_id="store")
        w, _ = self.worker(spec, seed)
        out = m.prepare_store(ks, ctx)
        self.assertTrue(self.transfer(w, True, out.store_spec, list(range(1, len(ks) + 1))).success)
        m.complete_store(out.keys_to_store, ctx)
        return w


class TestRealSpec(RealSpecCase):
    def test_vllms_factory_builds_the_spec_and_its_base_class_reads_vllms_keys(self):
        spec = self.spec(offload_prompt_only=False, self_describing_kv_events=True, blocks_per_chunk=1)
        self.assertFalse(spec.offload_prompt_only)
        self.assertEqual(spec.tokens_per_block, (16,))
        self.assertEqual(spec.blocks_per_chunk, 1)
        self.assertFalse(spec.replicated_layout)  # every rank stores its own shard
        extra = spec.extra_config
        cls = self.api.OffloadingSpecFactory.get_spec_cls(extra)
        defs = cls.build_metric_definitions(extra)
        self.assertTrue(defs)
        for name, meta in defs.items():
            self.assertIsInstance(meta, self.api.OffloadingMetricMetadata, name)

    def test_an_unknown_key_is_refused_by_name(self):
        with self.assertRaisesRegex(ValueError, "unknown spec option.*no_such_option"):
            self.spec(no_such_option=1)

    def test_events_stay_inert_while_vllms_kv_cache_events_are_off(self):
        # vLLM drains take_events only with its KV cache events on, and
        # asks a manager's capture to stay inert otherwise.
        api = self.api
        spec = self.spec(events=False)
        m = self.manager(spec)
        w, tensors = self.worker(spec)
        ctx = api.ReqContext(req_id="req-inert")
        m.on_new_request(ctx)
        ks = [key(i, "inert") for i in range(3)]
        out = m.prepare_store(ks, ctx)
        self.assertTrue(self.transfer(w, True, out.store_spec, [1, 2, 3]).success)
        m.complete_store(out.keys_to_store, ctx)
        self.step(m)
        for k in ks:
            self.assertEqual(self.settle(m, k, ctx), api.LookupResult.HIT)
        self.assertEqual(list(m.take_events()), [])

    def test_scheduler_and_worker_round_trip_in_vllms_order(self):
        api = self.api
        spec = self.spec()
        m = self.manager(spec)
        w, tensors = self.worker(spec)
        ctx = api.ReqContext(req_id="req-1")
        self.assertIsInstance(m.on_new_request(ctx), api.RequestOffloadingContext)
        ks = [key(i, "round") for i in range(6)]
        self.assertEqual(m.lookup(ks[0], ctx), api.LookupResult.RETRY)
        self.assertEqual(self.settle(m, ks[0], ctx), api.LookupResult.MISS)

        order = [ks[i] for i in (4, 1, 5, 0, 3, 2)]
        out = m.prepare_store(order, ctx)
        self.assertIsInstance(out, api.PrepareStoreOutput)
        self.assertEqual(list(out.keys_to_store), order)
        src = [3, 7, 8, 9, 12, 15]
        res = self.transfer(w, True, out.store_spec, src)
        self.assertIsInstance(res, api.TransferResult)
        self.assertTrue(res.success)
        self.assertEqual(res.transfer_size, 6 * LAYERS * PAGE)
        m.complete_store(out.keys_to_store, ctx)
        self.step(m)
        # The stored event follows once the daemon was found holding them.
        d.wait_for(lambda: m.counters()["verifying_now"] == 0, what="the manager to check its stores")
        events = list(m.take_events())
        self.assertEqual([(sorted(e.keys), e.removed) for e in events], [(sorted(order), False)])
        self.assertIsInstance(events[0], api.OffloadingEvent)

        for k in order:
            self.assertEqual(self.settle(m, k, ctx), api.LookupResult.HIT)
        want = rows(tensors, src)
        dst = [20, 21, 22, 23, 24, 25]
        for t in tensors:
            t[dst].zero_()
        load = m.prepare_load(order, ctx)
        res = self.transfer(w, False, load, dst)
        self.assertTrue(res.success)
        self.assertEqual(rows(tensors, dst), want)
        m.complete_load(order, ctx)
        m.on_request_finished(ctx)
        self.step(m)

        counts = {n.rsplit("kvhost_", 1)[1]: sum(v.values()) for n, v in self.stats.data["data"].items()}
        self.assertEqual(counts.get("stored_keys"), 6)
        self.assertEqual(counts.get("loaded_keys"), 6)
        self.assertGreaterEqual(counts.get("lookup_hits", 0), 6)
        self.assertTrue(self.stats.reduce())  # what vLLM's logger does with it
        m.reset_cache()
        self.assertEqual(m.counters()["pinned_now"], 0)

    def test_loads_starting_or_ending_inside_a_chunk_fill_only_their_blocks(self):
        """blocks_per_chunk 4 (resolved by vLLM into config.cache), three chunks
        stored from blocks 0-11. vLLM's GPULoadStoreSpec of a load that
        starts at block index i (the GPU prefix cache holds the chunk's
        blocks before it) or ends inside a chunk: the worker loads exactly
        the spec's blocks, every other byte of the cache unchanged."""
        import torch
        api = self.api
        spec = self.spec(chunk=4)
        m = self.manager(spec)
        w, tensors = self.worker(spec, seed=4)
        ctx = api.ReqContext(req_id="mid-chunk")
        ks = [key(i, "mid-chunk") for i in range(3)]
        out = m.prepare_store(ks, ctx)
        self.job += 1
        res = run_job(w, self.job, True, pickle.loads(pickle.dumps(out.store_spec)),
                      api.GPULoadStoreSpec(list(range(12)), group_sizes=[12], block_indices=[0]))
        self.assertTrue(res.success)
        m.complete_store(out.keys_to_store, ctx)
        stored = {b: rows(tensors, [b]) for b in range(12)}
        for first, n in [(1, 11), (0, 10), (6, 1)]:
            with self.subTest(first=first, blocks=n):
                load_keys = ks[first // 4:(first + n - 1) // 4 + 1]
                for k in load_keys:
                    self.assertEqual(self.settle(m, k, ctx), api.LookupResult.HIT)
                for t in tensors:
                    t.fill_(5)
                before = [t.clone() for t in tensors]
                dst = list(range(16, 16 + n))
                load = m.prepare_load(load_keys, ctx)
                self.job += 1
                res = run_job(w, self.job, False, pickle.loads(pickle.dumps(load)),
                              api.GPULoadStoreSpec(dst, group_sizes=[n], block_indices=[first]))
                self.assertTrue(res.success)
                self.assertEqual(res.transfer_size, n * LAYERS * PAGE)
                self.assertEqual(rows(tensors, dst), [stored[first + i][layer] for layer in range(LAYERS)
                                                      for i in range(n)])
                for t, b in zip(tensors, before):
                    b[16:16 + n] = t[16:16 + n]
                    self.assertTrue(torch.equal(t, b), "a block the load did not name changed")
                m.complete_load(load_keys, ctx)

    def test_a_daemon_restart_under_vllms_manager_and_worker_is_survived(self):
        # The daemon restarts under the spec vLLM's factory made: while it
        # is gone lookups answer MISS and prepare_store None; manager and
        # worker connect again by themselves and keys stored before the
        # restart load byte for byte, counted in vLLM's metrics.
        api = self.api
        m, w, tensors, ctx, ks, want = self.pinned("restart", seed=5)
        self.daemon.halt()
        try:
            d.wait_for(lambda: m.lookup(ks[0], ctx) == api.LookupResult.MISS, what="MISS for a pinned key")
            self.assertIsNone(m.prepare_store([key(9, "restart")], ctx))
        finally:
            self.daemon.start_again()
        d.wait_for(lambda: m.counters()["connected"], what="the manager to connect again")
        # No HIT until the worker's cache is registered with the new
        # daemon: the worker notices the loss at vLLM's next step.
        self.assertEqual(self.settle(m, ks[0], ctx), api.LookupResult.MISS)
        d.wait_for(lambda: not list(w.get_finished()) and w.counters()["connected"],
                   what="the worker to connect again")
        for k in ks:
            d.wait_for(lambda: self.settle(m, k, ctx) == api.LookupResult.HIT, what="a HIT once the worker is back")
        dst = [20, 21, 22]
        for t in tensors:
            t[dst].zero_()
        self.assertTrue(self.transfer(w, False, m.prepare_load(ks, ctx), dst).success)
        self.assertEqual(rows(tensors, dst), want)
        m.complete_load(ks, ctx)
        self.step(m)
        counts = {n.rsplit("kvhost_", 1)[1]: sum(v.values()) for n, v in self.stats.data["data"].items()}
        self.assertEqual((counts.get("disconnects"), counts.get("reconnects")), (1, 1))

    def test_a_load_lost_with_a_killed_daemon_is_loaded_again_not_failed(self):
        # vLLM's connector asserts every TransferResult's success: a load
        # lost with the daemon (sent, unanswered, then the daemon killed)
        # must wait for the new daemon and load byte for byte.
        api = self.api
        m, w, tensors, ctx, ks, want = self.pinned("lost-load", seed=6)
        dst = [20, 21, 22]
        for t in tensors:
            t[dst].zero_()
        self.job += 1
        job, load = self.job, pickle.loads(pickle.dumps(m.prepare_load(ks, ctx)))
        self.daemon.freeze()
        try:
            self.assertTrue(w.submit_load(job, load, self.gpu(dst)))  # sent; no answer from a frozen daemon
        finally:
            self.daemon.halt(signal.SIGKILL)
        got = []
        try:
            d.wait_for(lambda: got.extend(w.get_finished()) or not w.counters()["connected"],
                       what="the worker to notice the daemon gone")
            got += w.get_finished()
            self.assertEqual(got, [])
        finally:
            self.daemon.start_again()
        d.wait_for(lambda: got.extend(w.get_finished()) or got, what="the load's result")
        self.assertEqual([(r.job_id, r.success) for r in got], [(job, True)])
        self.assertEqual(rows(tensors, dst), want)
        self.assertEqual(w.counters()["failed_load_jobs"], 0)
        m.complete_load(ks, ctx)

    def test_an_outage_is_logged_once_not_per_job_or_lookup(self):
        # The daemon killed under a busy engine: stores vLLM prepared before
        # the manager saw it go still reach the worker, and lookups go on.
        # Each succeeds or misses as vLLM needs; the log says once that the
        # connection is lost and once that it is back, per manager and
        # worker, not once per job or request.
        api = self.api
        logger = logging.getLogger("vllm.kvhost")
        level = logger.level
        logger.setLevel(logging.INFO)
        self.addCleanup(logger.setLevel, level)
        m, w, tensors, ctx, ks, want = self.pinned("outage-log", seed=8)
        prepared = [m.prepare_store([key(100 + i, "outage-log")], ctx).store_spec for i in range(10)]
        logs = d.LogRecords("vllm.kvhost")
        self.addCleanup(logs.close)
        self.daemon.halt(signal.SIGKILL)
        try:
            d.wait_for(lambda: m.lookup(ks[0], ctx) == api.LookupResult.MISS, what="MISS for a pinned key")
            for i, spec in enumerate(prepared):
                self.assertTrue(self.transfer(w, True, spec, [10 + i]).success)
            for i in range(50):
                self.assertEqual(m.lookup(key(200 + i, "outage-log"), ctx), api.LookupResult.MISS)
                self.assertIsNone(m.prepare_store([key(200 + i, "outage-log")], ctx))
                self.step(m)
        finally:
            self.daemon.start_again()
        d.wait_for(lambda: m.counters()["connected"] and w.counters()["connected"],
                   what="the manager and the worker to connect again")
        for k in ks:
            self.assertEqual(self.settle(m, k, ctx), api.LookupResult.HIT)
        self.assertEqual(w.counters()["store_failed_keys"], 10)
        # The reconnect threads log after they swapped the connection in.
        d.wait_for(lambda: logs.count("connected to the daemon again") == 2, what="the reconnections logged")
        self.assertEqual(logs.count("lost the daemon connection"), 2, logs.messages)
        self.assertEqual(len(logs.messages), 4, logs.messages)

    def test_reset_cache_forgets_the_stores_and_loads_vllm_will_never_complete(self):
        # vLLM's scheduler discards its in-flight jobs at reset_cache (its
        # _stale_job_threshold): complete_store and complete_load never
        # come for them. A key still counted as being stored would answer
        # HIT_PENDING, deferring every request with it for ever, and never
        # be offered to store again; keys counted as being loaded would
        # stay pinned and answer HIT for ever.
        api = self.api
        spec = self.spec(pin_lease_s=1, hit_window_s=0.2)
        m = self.manager(spec)
        w, _ = self.worker(spec)
        ctx = api.ReqContext(req_id="reset")
        ks = [key(i, "reset-loaded") for i in range(3)]
        self.stored(spec, m, ks)
        for k in ks:
            self.assertEqual(self.settle(m, k, ctx), api.LookupResult.HIT)
        m.prepare_load(ks, ctx)
        storing = key(0, "reset-storing")
        self.assertEqual(list(m.prepare_store([storing], ctx).keys_to_store), [storing])

        m.reset_cache()
        c = m.counters()
        self.assertEqual((c["storing_now"], c["loading_now"]), (0, 0))
        self.assertEqual(self.settle(m, storing, ctx), api.LookupResult.MISS)
        # vLLM offloads again from chunk 0 after a reset.
        self.assertEqual(list(m.prepare_store([storing], ctx).keys_to_store), [storing])
        # The loads vLLM flushes keep their pins a hit window, then lose them.
        d.wait_for(lambda: m.counters()["pinned_now"] == 0, what="the loaded keys' pins to be released")

    def test_get_stats_survives_vllms_aggregate_every_step(self):
        spec = self.spec()
        m = self.manager(spec)
        ctx = self.api.ReqContext(req_id="steps")
        for i in range(1000):
            m.lookup(key(i % 50, "steps"), ctx)
            self.step(m)
        d.wait_for(lambda: not m.has_pending_work(), what="the lookups to settle")
        self.step(m)
        c = m.counters()
        got = {n.rsplit("kvhost_", 1)[1]: sum(v.values()) for n, v in self.stats.data["data"].items()}
        self.assertEqual(got.get("lookup_retries", 0), c.get("lookup_retries", 0))
        self.assertEqual(got.get("lookup_misses", 0), c.get("lookup_misses", 0))

    def test_hybrid_model_two_groups_round_trip(self):
        api = self.api
        spec = self.spec(groups=2)
        m = self.manager(spec)
        w, tensors = self.worker(spec, groups=2)
        self.assertEqual(len(set(w.namespaces)), 2)
        ctx = api.ReqContext(req_id="hybrid")
        ks = [key(i, "hyb", 0) for i in range(2)] + [key(i, "hyb", 1) for i in range(2)]
        out = m.prepare_store(ks, ctx)
        src = [2, 3, 10, 11]
        self.assertTrue(self.transfer(w, True, out.store_spec, src, sizes=[2, 2]).success)
        m.complete_store(out.keys_to_store, ctx)
        for k in ks:
            self.assertEqual(self.settle(m, k, ctx), api.LookupResult.HIT)
        want = rows(tensors, src)
        dst = [16, 17, 26, 27]
        res = self.transfer(w, False, m.prepare_load(ks, ctx), dst, sizes=[2, 2])
        self.assertTrue(res.success)
        self.assertEqual(rows(tensors, dst), want)
        m.complete_load(ks, ctx)

    def test_different_models_miss_each_others_keys_and_engines_of_one_model_share(self):
        api = self.api
        ks = [key(i, "ident") for i in range(2)]
        a = self.spec(engine_id="engine-a")
        ma = self.manager(a)
        self.stored(a, ma, ks)
        ctx = api.ReqContext(req_id="ident")
        logs = d.LogRecords("vllm.kvhost")
        self.addCleanup(logs.close)
        b = self.spec(engine_id="engine-b", load_retry_s=0.2)
        mb = self.manager(b)
        other = self.manager(self.spec(model="mistralai/Mistral-7B-Instruct-v0.3"))
        tp2 = self.manager(self.spec(tp=2))
        # Engine b's manager answers HIT for engine a's keys once a worker
        # of engine b can load them: engine a's worker does not count.
        self.assertEqual(self.settle(mb, ks[0], ctx), api.LookupResult.MISS)
        # Warned of once engine b's worker stayed away load_retry_s.
        n = iter(range(1 << 20))
        d.wait_for(lambda: self.settle(mb, key(next(n), "ident-probe"), ctx) == api.LookupResult.MISS
                   and logs.count("other engines' workers of this namespace are registered"), what="the warning")
        self.assertEqual(logs.count("other engines' workers of this namespace are registered"), 1, logs.messages)
        self.worker(b, seed=4)
        d.wait_for(lambda: self.settle(mb, ks[0], ctx) == api.LookupResult.HIT, what="a HIT with engine b's worker")
        for k in ks:
            self.assertEqual(self.settle(mb, k, ctx), api.LookupResult.HIT)
            self.assertEqual(self.settle(other, k, ctx), api.LookupResult.MISS)
            self.assertEqual(self.settle(tp2, k, ctx), api.LookupResult.MISS)

    def test_tp2_ranks_in_two_processes_hit_only_when_both_stored(self):
        api = self.api
        spec = self.spec(tp=2, engine_id="engine-tp2")
        m = self.manager(spec)
        mp = multiprocessing.get_context("spawn")
        procs, conns = [], []
        for r in range(2):
            parent, child = mp.Pipe()
            p = mp.Process(target=rank_process, args=(self.daemon.socket, r, child, "engine-tp2"), daemon=True)
            p.start()
            child.close()
            procs.append(p)
            conns.append(parent)

        def stop():
            for c in conns:
                try:
                    c.send(("stop",))
                except OSError:
                    pass
            for p in procs:
                p.join(60)
                if p.is_alive():
                    p.kill()
        self.closers.append(stop)
        for c in conns:
            self.assertTrue(c.poll(120), "a rank process did not start")
        namespaces = [c.recv() for c in conns]
        self.assertNotEqual(namespaces[0][1], namespaces[1][1])

        ctx = api.ReqContext(req_id="tp2")
        k = key(0, "tp2")
        out = m.prepare_store([k], ctx)
        conns[0].send(("store", 1, pickle.dumps(out.store_spec), [5]))
        self.assertTrue(conns[0].recv()[0])
        m.complete_store([k], ctx, success=False)
        self.assertEqual(self.settle(m, k, ctx), api.LookupResult.MISS)  # rank 1 has not stored it

        out = m.prepare_store([k], ctx)
        wants = []
        for c in conns:
            c.send(("store", 2, pickle.dumps(out.store_spec), [5]))
            ok, _, src_rows = c.recv()
            self.assertTrue(ok)
            wants.append(src_rows)
        m.complete_store([k], ctx)
        self.assertEqual(self.settle(m, k, ctx), api.LookupResult.HIT)
        load = m.prepare_load([k], ctx)
        for c, want in zip(conns, wants):
            c.send(("load", 3, pickle.dumps(load), [9]))
            ok, _, got = c.recv()
            self.assertTrue(ok)
            self.assertEqual(got, want)  # each rank got its own shard back
        self.assertNotEqual(wants[0], wants[1])
        m.complete_load([k], ctx)


class TestRealSpecDaemonNotUpAtStart(RealSpecCase):
    """vLLM builds the spec's manager and workers before the daemon is up:
    they start without it and take it once it answers."""

    def test_a_spec_started_before_its_daemon_runs_without_it_then_uses_it(self):
        api = self.api
        logger = logging.getLogger("vllm.kvhost")
        level = logger.level
        logger.setLevel(logging.INFO)
        self.addCleanup(logger.setLevel, level)
        logs = d.LogRecords("vllm.kvhost")
        self.addCleanup(logs.close)
        dm = d.Daemon()
        self.addCleanup(dm.stop)
        dm.halt()
        spec = self.spec(socket=dm.socket, reconnect_s=0.05)
        m = self.manager(spec)
        w, tensors = self.worker(spec, seed=3)
        ctx = api.ReqContext(req_id="early")
        early = key(0, "early")
        self.assertEqual(m.lookup(early, ctx), api.LookupResult.MISS)
        self.assertIsNone(m.prepare_store([early], ctx))
        # A store the worker gets meanwhile succeeds for vLLM, storing nothing.
        kv = self.kv.KvhostLoadStoreSpec([early], [0])
        self.assertTrue(self.transfer(w, True, kv, [1]).success)
        self.assertEqual(w.counters()["store_failed_keys"], 1)
        self.assertFalse(m.counters()["connected"] or w.counters()["connected"])
        dm.start_again()
        d.wait_for(lambda: m.counters()["connected"] and w.counters()["connected"],
                   what="the manager and the worker to connect")
        ks = [key(i, "late") for i in range(3)]
        # Stores go through once the daemon has said, on this connection,
        # that the worker's cache is registered (each half connects alone).
        out = d.wait_for(lambda: (lambda o: o if o is not None and o.keys_to_store else None)(m.prepare_store(ks, ctx)),
                         what="stores let through")
        self.assertTrue(self.transfer(w, True, out.store_spec, [4, 5, 6]).success)
        m.complete_store(out.keys_to_store, ctx)
        for k in ks:
            self.assertEqual(self.settle(m, k, ctx), api.LookupResult.HIT)
        want = rows(tensors, [4, 5, 6])
        for t in tensors:
            t[[20, 21, 22]].zero_()
        self.assertTrue(self.transfer(w, False, m.prepare_load(ks, ctx), [20, 21, 22]).success)
        self.assertEqual(rows(tensors, [20, 21, 22]), want)
        m.complete_load(ks, ctx)
        # The reconnect threads log after they swapped the connection in.
        d.wait_for(lambda: logs.count("connected to the daemon at") == 2, what="the connections logged")
        self.assertEqual(logs.count("starting without it"), 2, logs.messages)
        self.assertEqual(logs.count("connected to the daemon at"), 2, logs.messages)

    def test_a_manager_connecting_before_its_worker_sends_no_stored_event_for_a_key_not_stored(self):
        """Issue 86, K2, inside vLLM's classes: vLLM starts before the
        daemon and the manager connects well before its worker (the test
        holds the worker off for 20 steps). Stepping stores as vLLM's scheduler
        does (get_finished every step), no store is handed to the worker
        before it is connected, every key with a stored event loads, and
        every store accepted once the worker was connected has one."""
        api = self.api
        dm = d.Daemon()
        self.addCleanup(dm.stop)
        dm.halt()
        # One engine (one engine_id: vLLM's config makes a new one for each
        # config built); its worker finds no daemon until let through.
        from kvhost.vllm import _connect, spec_worker
        let_worker = threading.Event()
        real_open = spec_worker.SpecWorker._open

        def held_open(worker):
            if not let_worker.is_set():
                raise _connect.DaemonAbsent("held by the test") from ConnectionRefusedError("held by the test")
            return real_open(worker)

        held = mock.patch.object(spec_worker.SpecWorker, "_open", held_open)
        held.start()
        self.addCleanup(held.stop)
        one = dict(socket=dm.socket, engine_id="manager-first", miss_ttl_s=0.02, reconnect_s=0.01)
        m = self.manager(self.spec(**one))
        w, _ = self.worker(self.spec(**one), seed=9)
        ctx = api.ReqContext(req_id="manager-first")
        dm.start_again()
        d.wait_for(lambda: m.counters()["connected"], what="the manager to connect")
        accepted, after, away, n = [], [], 0, 0
        deadline = time.monotonic() + 30
        while len(after) < 5:  # at most 5 + a few: the load below fits BLOCKS
            self.assertLess(time.monotonic(), deadline, f"the worker never connected: {m.counters()} {w.counters()}")
            k = key(n, "manager-first")
            n += 1
            before = w.counters()["connected"]
            away += m.counters()["connected"] and not before
            out = m.prepare_store([k], ctx)
            if away >= 20:  # 20 steps with the manager connected and the worker not
                let_worker.set()
            if out is None or not out.keys_to_store:
                self.assertEqual(list(w.get_finished()), [])
                continue
            self.assertTrue(self.transfer(w, True, out.store_spec, [1 + n % 8]).success)
            m.complete_store(out.keys_to_store, ctx)
            accepted.append(k)
            if before:
                after.append(k)
        self.assertGreater(away, 0, "the manager never stepped connected without its worker")
        d.wait_for(lambda: m.counters()["verifying_now"] == 0, what="the manager to check its stores")
        stored = set()
        for e in m.take_events():
            for k in e.keys:
                (stored.discard if e.removed else stored.add)(bytes(k))
        self.assertLessEqual(set(after), stored)
        self.assertLessEqual(stored, set(accepted))
        # No store was handed out that the worker could not run.
        self.assertEqual(m.counters().get("store_unverified_keys", 0), 0,
                         f"manager {m.counters()}; worker {w.counters()}; accepted {len(accepted)}, after the "
                         f"worker connected {len(after)}, steps away {away}")
        ks = sorted(stored)
        for k in ks:
            self.assertEqual(self.settle(m, k, ctx), api.LookupResult.HIT)
        self.assertTrue(self.transfer(w, False, m.prepare_load(ks, ctx), list(range(20, 20 + len(ks)))).success)
        m.complete_load(ks, ctx)

    def test_a_worker_the_late_daemon_refuses_leaves_lookups_missing_not_hit(self):
        """Keys stored by an earlier engine; this engine starts before a
        daemon whose max_registered_bytes is below its worker's tensors:
        the daemon refuses the worker, which stays off. The manager, which
        registers nothing, connects all the same; it answers MISS (vLLM
        recomputes), not a HIT whose load vLLM's worker would assert on,
        and HITs come once a worker the daemon takes is connected."""
        api = self.api
        logs = d.LogRecords("vllm.kvhost")
        self.addCleanup(logs.close)
        dm = d.Daemon()
        self.addCleanup(dm.stop)
        ks = [key(i, "refused") for i in range(2)]
        first = self.spec(socket=dm.socket)
        self.stored(first, self.manager(first), ks)
        for c in reversed(self.closers):  # the first engine goes
            c()
        self.closers.clear()
        dm.halt()
        dm.reconfigure(server_toml="max_registered_bytes = 65536\n")
        spec = self.spec(socket=dm.socket, reconnect_s=0.05, load_retry_s=0.2)
        m = self.manager(spec)
        w, _ = self.worker(spec, seed=5)
        dm.start_again()
        d.wait_for(lambda: m.counters()["connected"] and logs.count("the daemon answers but cannot be used"),
                   what="the manager to connect and the worker to be refused")
        self.assertFalse(w.counters()["connected"])
        ctx = api.ReqContext(req_id="refused")
        for k in ks:
            self.assertEqual(self.settle(m, k, ctx), api.LookupResult.MISS)
        self.assertEqual(m.counters()["no_worker_keys"], len(ks))
        # Warned of once the worker stayed away load_retry_s.
        n = iter(range(1 << 20))
        d.wait_for(lambda: self.settle(m, key(next(n), "refused-probe"), ctx) == api.LookupResult.MISS
                   and logs.count("no worker of rank 0 of this engine"), what="the warning")
        self.assertEqual(logs.count("no worker of rank 0 of this engine has its KV cache registered"), 1, logs.messages)

        # A daemon that takes the worker: HITs, and the load runs.
        dm.halt()
        dm.reconfigure(server_toml="")
        dm.start_again()
        d.wait_for(lambda: m.counters()["connected"], what="the manager to connect again")
        w2, tensors = self.worker(spec, seed=6)
        d.wait_for(lambda: self.settle(m, ks[0], ctx) == api.LookupResult.HIT, what="a HIT with a worker registered")
        self.assertEqual(self.settle(m, ks[1], ctx), api.LookupResult.HIT)
        self.assertTrue(self.transfer(w2, False, m.prepare_load(ks, ctx), [20, 21]).success)
        m.complete_load(ks, ctx)

    def test_reconnect_s_0_refuses_to_start_without_a_daemon(self):
        dm = d.Daemon()
        self.addCleanup(dm.stop)
        dm.halt()
        spec = self.spec(socket=dm.socket, reconnect_s=0)
        with self.assertRaisesRegex(ConnectionError, "cannot connect to the kvhost daemon"):
            self.manager(spec)
        with self.assertRaisesRegex(ConnectionError, "cannot connect to the kvhost daemon"):
            self.worker(spec)


class TestRealSpecRestartedElsewhere(RealSpecCase):
    """The daemon comes back with a vllm-fs mount whose namespace an
    operator set to the spec's, over another model's fs-tier directory of
    rows of the spec's key size. The spec never uses a vllm-fs mount: its
    manager and workers take a connection only where the Declared
    fingerprint is their namespace's own."""

    OTHER = "meta-llama/Llama-3.1-8B"

    def fs_rows(self, ks, seed):
        """vLLM's own fs tier, for OTHER, writes ks' rows (LAYERS pages of
        random bytes) into a fresh root; returns the root."""
        import shutil
        import tempfile
        import numpy as np
        root = tempfile.mkdtemp(prefix="kvhost-vllm-fs-")
        self.addCleanup(shutil.rmtree, root, True)
        h = vllm_tree.make_tiering_manager(
            self.api, num_cpu_blocks=16, secondary_tiers=[vllm_tree.fs_tier(root)],
            config_kwargs=dict(model=self.OTHER, worker_kv_bytes_per_block=LAYERS * PAGE,
                               is_parallelism_agnostic=False, groups=((layer_names(), 16),)))
        try:
            m, ctx = h.manager, self.api.ReqContext(req_id="fs-writer")
            m.on_new_request(ctx)
            out = m.prepare_store(ks, ctx)
            rows_ = np.asarray(m.primary_tier.get_kv_memoryview()).view(np.uint8)
            rng = np.random.default_rng(seed)
            for b in out.store_spec.block_ids:
                rows_[int(b)] = rng.integers(0, 256, size=rows_.shape[1], dtype=np.uint8)
            del rows_
            m.complete_store(ks, ctx)
            end = self.api.ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
            d.wait_for(lambda: (m.on_schedule_end(end), not m.has_pending_work())[1], what="vLLM's fs tier")
        finally:
            h.close()
        return root

    def test_another_models_directory_bound_to_the_specs_namespace_is_refused(self):
        api = self.api
        logs = d.LogRecords("vllm.kvhost")
        self.addCleanup(logs.close)
        ks = [key(i, "misbound") for i in range(3)]
        root = self.fs_rows(ks, seed=7)
        dm = d.Daemon()
        self.addCleanup(dm.stop)
        spec = self.spec(socket=dm.socket, reconnect_s=0.05)
        m = self.manager(spec)
        ctx = api.ReqContext(req_id="misbound")
        (ns,) = set(m.namespaces.values())
        dm.halt(signal.SIGKILL)
        dm.reconfigure(after_toml=f'[[mount]]\npath = "{root}"\nlayout = "vllm-fs"\ncapacity = "1GiB"\n'
                                  f'[mount.vllm_fs]\nnamespace = "{ns}"\n')
        dm.start_again()
        self.assertEqual(self.settle(m, key(99, "misbound"), ctx), api.LookupResult.MISS)  # finds it gone
        d.wait_for(lambda: m.counters()["connected"] or logs.has("does not serve"),
                   what="the manager to connect again or refuse the new daemon")
        self.assertEqual([self.settle(m, k, ctx) for k in ks], [api.LookupResult.MISS] * 3,
                         f"{self.OTHER}'s fs-tier rows answered to the spec of {MODEL}")
        self.assertFalse(m.counters()["connected"])
        with self.assertRaisesRegex(RuntimeError, "does not serve"):
            self.manager(self.spec(socket=dm.socket))
        with self.assertRaisesRegex(RuntimeError, "does not serve"):
            self.worker(self.spec(socket=dm.socket))


class TestRealPageLayout(RealSpecCase):
    """The page layout through vLLM's own OffloadingSpecFactory, config and
    CanonicalKVCaches: the default configuration's (FlashAttention, HND,
    one KV-cache group: vLLM's cross-layer slab, as its
    register_cross_layers_kv_cache builds it) is accepted, another is
    refused naming the option that makes it an identity of its own."""

    def setUp(self):
        super().setUp()
        env = mock.patch.dict(os.environ)
        env.start()
        os.environ.pop("VLLM_KV_CACHE_LAYOUT", None)
        self.closers.append(env.stop)

    def observed(self, backend, layout):
        from kvhost.vllm import spec_worker
        return mock.patch.object(spec_worker, "observe_layout",
                                 lambda groups: ([[backend] * len(g["layer_names"]) for g in groups], layout))

    def slab(self, seed=0):
        """vLLM's cross-layer CanonicalKVCaches: one (BLOCKS, LAYERS × PAGE)
        int8 tensor and one reference of LAYERS × PAGE bytes."""
        import torch
        import kvhost
        api = self.api
        big, buf = kvhost.torch_host_tensor((BLOCKS, LAYERS * PAGE), torch.int8, name="real-slab")
        self.closers.append(buf.close)
        big.copy_(torch.randint(-128, 128, big.shape, generator=torch.Generator().manual_seed(seed),
                                dtype=torch.int8))
        caches = api.CanonicalKVCaches(
            tensors=[api.CanonicalKVCacheTensor(tensor=big, page_size_bytes=LAYERS * PAGE)],
            group_data_refs=[[api.CanonicalKVCacheRef(tensor_idx=0, page_size_bytes=LAYERS * PAGE)]])
        return caches, [big[:, i * PAGE:(i + 1) * PAGE] for i in range(LAYERS)]

    def test_the_default_configuration_round_trips_through_the_slab(self):
        spec = self.spec()
        m = self.manager(spec)
        caches, tensors = self.slab(seed=5)
        with self.observed("FLASH_ATTN", "HND"):
            w = spec.get_worker(caches)
        self.closers.append(w.shutdown)
        self.assertEqual(w.page_layout, "FLASH_ATTN/HND/slab")
        ctx = self.api.ReqContext(req_id="slab")
        ks = [key(i, "slab") for i in range(2)]
        want = rows(tensors, [1, 2])
        out = m.prepare_store(ks, ctx)
        self.assertTrue(self.transfer(w, True, out.store_spec, [1, 2]).success)
        m.complete_store(out.keys_to_store, ctx)
        for k in ks:
            self.assertEqual(self.settle(m, k, ctx), self.api.LookupResult.HIT)
        for t in tensors:
            t[5:7].zero_()
        self.assertTrue(self.transfer(w, False, m.prepare_load(ks, ctx), [5, 6]).success)
        m.complete_load(ks, ctx)
        self.assertEqual(rows(tensors, [5, 6]), want)

    def test_another_backend_or_per_layer_pages_are_refused(self):
        spec = self.spec()
        for backend, layout, slab, want in (("FLASHINFER", "HND", False, "FLASHINFER/HND"),
                                            ("FLASH_ATTN", "NHD", True, "FLASH_ATTN/NHD/slab"),
                                            ("FLASH_ATTN", "HND", False, "FLASH_ATTN/HND")):
            with self.subTest(want=want):
                if slab:
                    caches, _ = self.slab()
                else:
                    caches, _, buf = canonical_caches(self.api, 0)
                    self.closers.append(buf.close)
                with self.observed(backend, layout), self.assertRaisesRegex(ValueError, f'"page_layout": "{want}"'):
                    spec.get_worker(caches)

    def test_the_option_names_a_layout_of_its_own(self):
        default = self.manager(self.spec())
        spec = self.spec(page_layout="FLASHINFER/HND")
        m = self.manager(spec)
        self.assertFalse(set(m.namespaces.values()) & set(default.namespaces.values()))
        caches, _, buf = canonical_caches(self.api, 0)
        self.closers.append(buf.close)
        with self.observed("FLASHINFER", "HND"):
            w = spec.get_worker(caches)
        self.closers.append(w.shutdown)
        self.assertEqual(sorted(w.namespaces), sorted(m.namespaces.values()))


@unittest.skipUnless(NO_TREE is None, NO_TREE or "")
class TestRealSpecWindow(unittest.TestCase):
    def test_this_vllm_is_supported_or_refused_naming_the_window(self):
        vllm_tree.load()
        from kvhost import vllm as kv
        try:
            cls = kv.spec_class()
        except kv.UnsupportedVLLM as e:
            self.assertIn("2026-08-17", str(e))
            return
        self.assertTrue(issubclass(cls, vllm_tree.load().OffloadingSpec))


if __name__ == "__main__":
    unittest.main()
