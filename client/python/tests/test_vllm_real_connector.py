"""KvhostOffloadingSpec under vLLM's own offloading connector code: vLLM's
build_offloading_config makes the OffloadingConfig from a KVCacheConfig of
vLLM's own classes, OffloadingSpecFactory builds kvhost's spec from it, and
vLLM's OffloadingConnectorWorker registers the KV caches (per layer, as
model runner V2 and a MultiConnector beside a connector without the
cross-layer preference give them, or vLLM's cross-layer slab) and drives
the spec's worker step by step (prepare_store_kv, start_kv_transfers,
handle_preemptions, get_finished, build_connector_worker_meta, shutdown)
against a real kvhost daemon.

The one stand-in is the VllmConfig: vLLM's needs pydantic and the model
registry. It is a namespace of exactly the fields the connector's code
reads (parallel, cache and model config, the kv_transfer_config), and it is
what the worker's get_current_vllm_config_or_none answers. The attention
backend a worker observes is given as in test_vllm_real_spec.py (vLLM's
attention modules are not loaded). MultiConnector and the connector's
scheduler half run in test_vllm_real_multi.py; model runner V2 does not
import here (the engine configuration, the model executor): what it hands
the spec (per-layer tensors) is what these tests register.

Needs a vLLM source tree: `make test-vllm VLLM_SRC=DIR`; without one every
test here reports itself skipped.
"""

import hashlib
import importlib
import pathlib
import signal
import sys
import types
import unittest
from unittest import mock

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

import daemon as d  # noqa: E402
import vllm_tree  # noqa: E402

NO_TREE = vllm_tree.skip_reason()

LAYERS, HEADS, HEAD, BLOCK, BLOCKS = 4, 2, 64, 16, 32
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
CONNECTOR = "vllm.distributed.kv_transfer.kv_connector.v1.offloading"


def key(i, tag="k", group=0):
    """An OffloadKey: a 32-byte block hash and the 4-byte group index."""
    return hashlib.sha256(f"{tag}-{i}".encode()).digest() + group.to_bytes(4, "big")


def untyped_storage():
    """vLLM's connector worker reads Tensor.untyped_storage(), which torch
    1.13 (installed here) names storage()._untyped(): the same bytes."""
    import torch
    if hasattr(torch.Tensor, "untyped_storage"):
        return mock.patch.dict({})

    def get(self):
        st = self.storage()
        return st._untyped() if hasattr(st, "_untyped") else st.untyped()
    return mock.patch.object(torch.Tensor, "untyped_storage", get, create=True)


def vllm_config(socket, tp=1, rank=0, dcp=1, interleave=1, cache_dtype="auto", v2=False, **extra):
    """What vLLM's connector code reads of a VllmConfig (see the module
    docstring), for a Llama-like model of LAYERS layers."""
    NS = types.SimpleNamespace
    import torch
    return NS(
        kv_transfer_config=NS(engine_id="kvhost-connector-test", kv_connector_extra_config={
            "spec_name": "KvhostOffloadingSpec", "spec_module_path": "kvhost.vllm", "socket": socket, **extra}),
        parallel_config=NS(tensor_parallel_size=tp, pipeline_parallel_size=1, prefill_context_parallel_size=1,
                           decode_context_parallel_size=dcp, cp_kv_cache_interleave_size=interleave,
                           world_size=tp, rank=rank, data_parallel_index=0, data_parallel_size=1,
                           data_parallel_rank_local=None, distributed_executor_backend="mp", nnodes_within_dp=1),
        # prefix_cache_retention_interval: read by the offloading
        # scheduler's store filter from 8ab97ed6 on; 0 is vLLM's default.
        cache_config=NS(block_size=BLOCK, cache_dtype=cache_dtype, enable_prefix_caching=True,
                        prefix_match_unit=None, prefix_cache_retention_interval=0),
        model_config=NS(model=MODEL, dtype=torch.bfloat16, use_mla=False,
                        get_total_num_kv_heads=lambda: HEADS * tp),
        kv_events_config=None, use_v2_model_runner=v2)


@unittest.skipUnless(NO_TREE is None, NO_TREE or "")
class ConnectorCase(vllm_tree.RealCase):
    support = "spec_class"

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        import torch
        cls.torch = torch
        cls.kci = importlib.import_module("vllm.v1.kv_cache_interface")
        cls.cfg = importlib.import_module(f"{CONNECTOR}.config")
        cls.common = importlib.import_module(f"{CONNECTOR}.common")
        cls.cw = importlib.import_module(f"{CONNECTOR}.worker")

    def setUp(self):
        self.require_support()
        self.closers = []
        p = untyped_storage()
        p.start()
        self.closers.append(p.stop)
        self.job = 0

    def tearDown(self):
        for c in reversed(self.closers):
            c()

    def kv_cache_config(self, dtype=None):
        """vLLM's KVCacheConfig of one full-attention group, a tensor per layer."""
        k = self.kci
        spec = k.FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD,
                                   dtype=dtype or self.torch.bfloat16)
        page = spec.page_size_bytes
        return k.KVCacheConfig(num_blocks=BLOCKS,
                               kv_cache_tensors=[k.KVCacheTensor(size=BLOCKS * page, shared_by=[n]) for n in NAMES],
                               kv_cache_groups=[k.KVCacheGroupSpec(layer_names=NAMES, kv_cache_spec=spec)]), page

    def engine(self, vc, kvc):
        """vLLM's path: build_offloading_config, the spec factory, and the
        connector's worker half over that spec. Returns (config, spec, worker)."""
        oc = self.cfg.build_offloading_config(vc, kvc)
        spec = self.api.OffloadingSpecFactory.create_spec(oc)
        return oc, spec, self.cw.OffloadingConnectorWorker(spec, vc, kvc)

    def current(self, vc, backend="FLASH_ATTN", layout="HND"):
        """vLLM's worker set-up: vc is the current config, and each layer's
        attention backend is backend."""
        from kvhost.vllm import spec_worker
        vllm_config_mod = sys.modules["vllm.config"]
        a = mock.patch.object(vllm_config_mod, "get_current_vllm_config_or_none", lambda: vc, create=True)
        b = mock.patch.object(spec_worker, "observe_layout",
                              lambda groups: ([[backend] * len(g["layer_names"]) for g in groups], layout))
        a.start()
        b.start()
        self.closers += [a.stop, b.stop]

    def host(self, nbytes, seed):
        import kvhost
        t, buf = kvhost.torch_host_tensor((nbytes,), self.torch.int8, name="real-connector")
        self.closers.append(buf.close)
        t.copy_(self.torch.randint(-128, 128, t.shape, generator=self.torch.Generator().manual_seed(seed),
                                   dtype=self.torch.int8))
        return t

    def per_layer(self, page, seed=0):
        """The per-layer KV caches a model runner hands register_kv_caches
        (FlashAttention's (blocks, 2, block, heads, head) bf16 views of one
        allocation per layer), and each layer's (BLOCKS, page) byte rows."""
        kv, rows = {}, []
        for i, n in enumerate(NAMES):
            t = self.host(BLOCKS * page, seed + i)
            kv[n] = t.view(self.torch.bfloat16).view(BLOCKS, 2, BLOCK, HEADS, HEAD)
            rows.append(t.view(BLOCKS, page))
        return kv, rows

    def manager(self, spec):
        m = spec.get_manager()
        self.closers.append(m.shutdown)
        return m

    def settled(self, m, k, ctx):
        R = self.api.LookupResult

        def once():
            r = m.lookup(k, ctx)
            return None if r == R.RETRY else r
        return d.wait_for(once, what="a settled lookup")

    def gpu(self, blocks):
        return self.api.GPULoadStoreSpec(blocks, group_sizes=[len(blocks)], block_indices=[0])

    def meta(self, loads=None, stores=None, flush=None):
        return self.common.OffloadingConnectorMetadata(load_jobs=loads or {}, store_jobs=stores or {},
                                                       jobs_to_flush=flush)

    def until_completed(self, cw, job_id):
        """vLLM's steps (get_finished, which queues nothing here, then
        build_connector_worker_meta) until the worker reports job_id done;
        returns the finished_recving seen on the way."""
        recving = set()

        def once():
            cw.prepare_store_kv(self.meta())
            recving.update(cw.get_finished(set())[1])
            wm = cw.build_connector_worker_meta()
            return wm is not None and job_id in wm.completed_jobs
        d.wait_for(once, what=f"job {job_id} completed")
        return recving

    def round_trip(self, m, cw, rows, tag):
        """Stores blocks 1-2 under two keys through the connector's worker
        steps, loads them into blocks 5-6, and checks the bytes."""
        ctx = self.api.ReqContext(req_id=tag)
        ks = [key(i, tag) for i in range(2)]
        want = [bytes(r[b].numpy().tobytes()) for r in rows for b in (1, 2)]
        out = m.prepare_store(ks, ctx)
        self.job += 1
        store = self.job
        # Step N: the scheduler's store job is queued at get_finished ...
        cw.start_kv_transfers(self.meta())
        cw.prepare_store_kv(self.meta(stores={store: self.common.TransferJob(tag, self.gpu([1, 2]), out.store_spec)}))
        cw.get_finished(set())
        # ... step N+1 submits it; then vLLM flushes it (handle_preemptions) and waits.
        cw.start_kv_transfers(self.meta())
        cw.handle_preemptions(self.meta(flush={store}))
        self.until_completed(cw, store)
        m.complete_store(out.keys_to_store, ctx)
        for k in ks:
            self.assertEqual(self.settled(m, k, ctx), self.api.LookupResult.HIT)
        for r in rows:
            r[5:7].zero_()
        self.job += 1
        load = self.job
        cw.start_kv_transfers(self.meta(loads={load: self.common.TransferJob(tag, m.prepare_load(ks, ctx),
                                                                             self.gpu([5, 6]))}))
        self.assertIn(tag, self.until_completed(cw, load))
        m.complete_load(ks, ctx)
        self.assertEqual([bytes(r[b].numpy().tobytes()) for r in rows for b in (5, 6)], want)


class TestRealConnectorWorker(ConnectorCase):
    def test_vllms_connector_worker_drives_the_spec_through_the_cross_layer_slab(self):
        kvc, page = self.kv_cache_config()
        vc = vllm_config(self.daemon.socket)
        _, spec, cw = self.engine(vc, kvc)
        m = self.manager(spec)
        self.current(vc)

        class FlashAttention:
            """What register_cross_layers_kv_cache asks of the backend:
            FlashAttention's shape, blocks first with layers inside."""
            @staticmethod
            def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str="auto"):
                return (2, num_blocks, block_size, num_kv_heads, head_size)

            @staticmethod
            def get_kv_cache_stride_order(include_num_layers_dimension=False):
                return (2, 0, 1, 3, 4, 5) if include_num_layers_dimension else (1, 0, 2, 3, 4)
        slab = self.host(BLOCKS * LAYERS * page, 3)
        cw.register_cross_layers_kv_cache(
            slab.view(self.torch.bfloat16).view(BLOCKS, LAYERS, 2, BLOCK, HEADS, HEAD), FlashAttention)
        self.closers.append(cw.shutdown)
        self.assertEqual(cw.worker.page_layout, "FLASH_ATTN/HND/slab")
        self.assertEqual(sorted(cw.worker.namespaces), sorted(m.namespaces.values()))
        self.round_trip(m, cw, [slab.view(BLOCKS, LAYERS * page)], "slab")

    def test_per_layer_caches_of_runner_v2_or_a_multiconnector_are_refused_without_the_option(self):
        # Model runner V2 registers per layer only (its TODO: no cross-layer
        # slab), and a MultiConnector asks for the slab only where every
        # child prefers it: the default identity's slab is then not what
        # the worker got.
        kvc, page = self.kv_cache_config()
        vc = vllm_config(self.daemon.socket, v2=True)
        _, spec, cw = self.engine(vc, kvc)
        self.current(vc)
        kv, _ = self.per_layer(page)
        with self.assertRaisesRegex(ValueError, '"page_layout": "FLASH_ATTN/HND"'):
            cw.register_kv_caches(kv)

    def test_per_layer_caches_round_trip_with_the_option_that_names_them(self):
        kvc, page = self.kv_cache_config()
        vc = vllm_config(self.daemon.socket, v2=True, page_layout="FLASH_ATTN/HND")
        _, spec, cw = self.engine(vc, kvc)
        m = self.manager(spec)
        self.current(vc)
        kv, rows = self.per_layer(page, seed=7)
        cw.register_kv_caches(kv)
        self.closers.append(cw.shutdown)
        self.assertEqual(cw.worker.page_layout, "FLASH_ATTN/HND")
        self.round_trip(m, cw, rows, "layers")
        # vLLM's connector shutdown reaches the spec's worker.
        cw.shutdown()
        self.assertFalse(cw.worker._client.connected())


class TestRealConnectorDaemonKilled(ConnectorCase):
    """A load in flight through vLLM's OffloadingConnectorWorker when the
    daemon is killed. vLLM's get_finished asserts every TransferResult's
    success ("we currently do not support job failures"), so the spec's
    worker holds a load lost with the daemon and runs it again on the next
    connection, for up to load_retry_s; past that it can only report the
    failure, and vLLM's assert stops the worker."""

    def loaded_after_kill(self, tag, restart, **opts):
        """Stores two keys through the connector's steps on a daemon of
        its own, then sends their load to that daemon frozen, kills it and
        (restart) starts it again. Returns (connector worker, load job id,
        rows, the stored bytes)."""
        dm = d.Daemon()
        self.addCleanup(dm.stop)
        kvc, page = self.kv_cache_config()
        vc = vllm_config(dm.socket, v2=True, page_layout="FLASH_ATTN/HND", reconnect_s=0.05, **opts)
        _, spec, cw = self.engine(vc, kvc)
        m = self.manager(spec)
        self.current(vc)
        kv, rows = self.per_layer(page, seed=11)
        cw.register_kv_caches(kv)
        self.closers.append(cw.shutdown)
        self.round_trip(m, cw, rows, tag)  # stores keys 0-1 of tag from blocks 1-2
        ctx = self.api.ReqContext(req_id=tag)
        ks = [key(i, tag) for i in range(2)]
        for k in ks:
            self.assertEqual(self.settled(m, k, ctx), self.api.LookupResult.HIT)
        want = [bytes(r[b].numpy().tobytes()) for r in rows for b in (1, 2)]
        for r in rows:
            r[8:10].zero_()
        self.job += 1
        load = self.job
        dm.freeze()
        try:
            cw.start_kv_transfers(self.meta(loads={load: self.common.TransferJob(tag, m.prepare_load(ks, ctx),
                                                                                 self.gpu([8, 9]))}))
        finally:
            dm.halt(signal.SIGKILL)
        if restart:
            dm.start_again()
        return cw, load, rows, want

    def test_a_load_cut_by_the_kill_completes_for_vllm_once_the_daemon_is_back(self):
        cw, load, rows, want = self.loaded_after_kill("kill-back", restart=True)
        self.assertIn("kill-back", self.until_completed(cw, load))
        self.assertEqual([bytes(r[b].numpy().tobytes()) for r in rows for b in (8, 9)], want)
        self.assertEqual(cw.worker.counters()["failed_load_jobs"], 0)

    def test_a_load_the_daemon_does_not_come_back_for_stops_vllms_worker_at_its_assert(self):
        # What kvhost cannot change without vLLM (docs/vllm.md, Failures):
        # after load_retry_s the load is reported failed, never as loaded.
        cw, load, _, _ = self.loaded_after_kill("kill-gone", restart=False, load_retry_s=0.2)

        import traceback
        asserted = []

        def step():
            cw.prepare_store_kv(self.meta())
            try:
                cw.get_finished(set())
            except AssertionError as e:
                asserted.append(traceback.extract_tb(e.__traceback__)[-1])
                return True
            return False
        d.wait_for(step, what="vLLM's assert on the failed load")
        self.assertTrue(asserted[0].filename.endswith("offloading/worker.py"), asserted)
        self.assertEqual(asserted[0].line, "assert transfer_result.success")
        self.assertEqual(cw.worker.counters()["failed_load_jobs"], 1)


class TestRealConnectorIdentity(ConnectorCase):
    def namespaces(self, **kw):
        kvc, _ = self.kv_cache_config()
        oc = self.cfg.build_offloading_config(vllm_config(self.daemon.socket, **kw), kvc)
        return set(self.manager(self.api.OffloadingSpecFactory.create_spec(oc)).namespaces.values())

    def test_an_fp8_kv_cache_dtype_never_shares_the_bf16_namespace(self):
        self.assertFalse(self.namespaces() & self.namespaces(cache_dtype="fp8"))
        self.assertFalse(self.namespaces(cache_dtype="fp8_e5m2") & self.namespaces(cache_dtype="fp8"))

    def test_decode_context_parallel_with_another_interleave_is_refused(self):
        # With DCP a rank's page holds every dcp-th run of interleave
        # tokens: interleave 1 and 16 put other tokens in rank 0's page of
        # one block, yet vLLM's offloading config is the same for both.
        kvc, page = self.kv_cache_config()
        same = [self.cfg.build_offloading_config(vllm_config(self.daemon.socket, tp=2, dcp=2, interleave=n), kvc)
                for n in (1, BLOCK)]
        self.assertEqual(same[0], same[1])
        for n, refused in ((BLOCK, True), (1, False)):
            with self.subTest(interleave=n):
                vc = vllm_config(self.daemon.socket, tp=2, dcp=2, interleave=n, page_layout="FLASH_ATTN/HND")
                _, spec, cw = self.engine(vc, kvc)
                self.current(vc)
                kv, _ = self.per_layer(page)
                if refused:
                    with self.assertRaisesRegex(ValueError, f"cp_kv_cache_interleave_size {n}"):
                        cw.register_kv_caches(kv)
                else:
                    cw.register_kv_caches(kv)
                    self.closers.append(cw.shutdown)
                    self.assertEqual(cw.worker.shard, 0)


if __name__ == "__main__":
    unittest.main()
