"""KvhostConnector under vLLM's own KV connector modules: vLLM's
KVConnectorFactory builds it from vLLM's KVTransferConfig (by
kv_connector_module_path, as --kv-transfer-config does), as a subclass of
vLLM's KVConnectorBase_V1, for the scheduler and for a worker; its
identity comes from vLLM's build_offloading_config of a KVCacheConfig of
vLLM's classes; and both halves are driven in the order vLLM's engine
calls them (scheduler: get_num_new_matched_tokens, update_state_after_alloc,
build_connector_meta, update_connector_output, request_finished; worker:
bind_connector_metadata, start_load_kv, wait_for_layer_load and
save_kv_layer per layer, wait_for_save, get_finished,
get_block_ids_with_load_errors, build_connector_worker_meta,
clear_connector_metadata) with vLLM's SchedulerOutput, NewRequestData,
KVCacheBlocks and KVConnectorOutput, against a real kvhost daemon with
per-layer CPU tensors in FlashAttention's shape of these trees
((num_blocks, heads, block, 2 * head)).

Stand-ins as in test_vllm_real_multi.py: the VllmConfig (a namespace of
the fields read), the Request (the fields read), the attention backend a
worker observes (FLASH_ATTN, NHD).

Needs a vLLM source tree: `make test-vllm VLLM_SRC=DIR`; without one every
test here reports itself skipped.
"""

import collections
import importlib
import os
import pathlib
import sys
import types
import unittest
from unittest import mock

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

import daemon as d  # noqa: E402
import vllm_tree  # noqa: E402
from test_vllm_connector import BLOCK, HEAD, HEADS, NAMES, flip_byte, layer_caches, worker_step  # noqa: E402

NO_TREE = vllm_tree.skip_reason()
KVC = "vllm.distributed.kv_transfer.kv_connector"
NBLOCKS = 48
BPC = 2                      # blocks per key: "block_size": 32 tokens


@unittest.skipUnless(NO_TREE is None, NO_TREE or "")
class RealKvConnectorCase(vllm_tree.RealCase):
    """vLLM's KV-connector modules loaded, a daemon for the class, and
    the steps of vLLM's engine; no tests of its own."""

    support = "connector_class"

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        import torch
        cls.torch = torch
        cls.base = importlib.import_module(f"{KVC}.v1.base")
        cls.factory = importlib.import_module(f"{KVC}.factory")
        cls.kvtc = importlib.import_module("vllm.config.kv_transfer")
        cls.kci = importlib.import_module("vllm.v1.kv_cache_interface")
        cls.sched_out = importlib.import_module("vllm.v1.core.sched.output")
        cls.outputs = importlib.import_module("vllm.v1.outputs")
        cls.kcm = importlib.import_module("vllm.v1.core.kv_cache_manager")
        cls.kcu = importlib.import_module("vllm.v1.core.kv_cache_utils")
        cls.req_mod = importlib.import_module("vllm.v1.request")
        from test_vllm_real_multi import MultiCase, Request, hashes
        cls.Request, cls.hashes = Request, staticmethod(hashes)
        cls.output, cls.blocks = MultiCase.output, MultiCase.blocks

    def setUp(self):
        self.require_support()
        self.closers = []
        from kvhost.vllm import spec_worker
        p = mock.patch.object(spec_worker, "observe_layout",
                              lambda groups: ([["FLASH_ATTN"] * len(g["layer_names"]) for g in groups], "NHD"))
        p.start()
        self.closers.append(p.stop)

    def tearDown(self):
        for c in reversed(self.closers):
            c()

    def vllm_config(self, **extra):
        """What vLLM's code reads of a VllmConfig, with vLLM's own
        KVTransferConfig naming KvhostConnector by module path."""
        from test_vllm_real_connector import MODEL, vllm_config
        vc = vllm_config(self.daemon.socket)
        vc.model_config.model = MODEL
        vc.kv_transfer_config = self.kvtc.KVTransferConfig(
            kv_connector="KvhostConnector", kv_connector_module_path="kvhost.vllm", kv_role="kv_both",
            engine_id="kvhost-kvconnector-test", kv_load_failure_policy="recompute",
            kv_connector_extra_config={"socket": self.daemon.socket, "block_size": BPC * BLOCK, **extra})
        vc.scheduler_config = types.SimpleNamespace(disable_hybrid_kv_cache_manager=True)
        return vc

    def kv_cache_config(self):
        k = self.kci
        spec = k.FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD, dtype=self.torch.bfloat16)
        page = spec.page_size_bytes
        return k.KVCacheConfig(num_blocks=NBLOCKS,
                               kv_cache_tensors=[k.KVCacheTensor(size=NBLOCKS * page, shared_by=[n]) for n in NAMES],
                               kv_cache_groups=[k.KVCacheGroupSpec(layer_names=NAMES, kv_cache_spec=spec)])

    def engine(self, seed=0, **extra):
        """vLLM's factory's scheduler and worker connectors, the worker's
        per-layer KV caches registered. Returns (scheduler, worker, caches)."""
        vc, kvc = self.vllm_config(**extra), self.kv_cache_config()
        role = self.base.KVConnectorRole
        sched = self.factory.KVConnectorFactory.create_connector(vc, role.SCHEDULER, kvc)
        self.closers.append(sched.shutdown)
        worker = self.factory.KVConnectorFactory.create_connector(vc, role.WORKER, kvc)
        self.closers.append(worker.shutdown)
        kv = layer_caches(self.torch, self.closers, seed, NBLOCKS)
        worker.register_kv_caches(kv)
        return sched, worker, kv

    def request(self, req_id, tag, nblocks):
        return self.Request(self.api, req_id, self.hashes(tag, nblocks), self.req_mod.RequestStatus)

    def step(self, sched, worker, so):
        """One engine step in vLLM's order; returns vLLM's KVConnectorOutput."""
        sending, errors, wm = worker_step(worker, sched.build_connector_meta(so), so.finished_req_ids)
        out = self.outputs.KVConnectorOutput(finished_sending=sending, finished_recving=None,
                                             invalid_block_ids=errors, kv_connector_worker_meta=wm)
        sched.update_connector_output(out)
        return out

    def save_prompt(self, sched, worker, req, ids):
        """The prompt computed in blocks ids and saved through the save
        path, stepped until a worker reports its stores ended."""
        self.assertEqual(sched.get_num_new_matched_tokens(req, 0), (0, False))
        sched.update_state_after_alloc(req, self.blocks(ids), 0)
        self.step(sched, worker, self.output(new=[(req, ids)], scheduled={req.request_id: req.num_tokens}))
        req.num_computed_tokens = req.num_tokens
        req.status = self.req_mod.RequestStatus.FINISHED_STOPPED
        self.assertEqual(sched.request_finished(req, list(ids)), (True, None))
        finished = {req.request_id}

        def stored():
            out = self.step(sched, worker, self.output(finished=finished))
            finished.clear()
            return req.request_id in (out.finished_sending or set())
        d.wait_for(stored, what=f"{req.request_id}'s stores ended")

    def load(self, sched, worker, req, ids, want_tokens):
        """A step loading req's claimed prefix into ids; returns vLLM's
        KVConnectorOutput."""
        n, load_async = sched.get_num_new_matched_tokens(req, 0)
        self.assertEqual((n, load_async), (want_tokens, False))
        sched.update_state_after_alloc(req, self.blocks(ids), n)
        req.num_computed_tokens = n
        return self.step(sched, worker, self.output(new=[(req, ids)], scheduled={req.request_id: BLOCK}))

    def rows(self, kv, blocks):
        return [bytes(kv[n][b].view(self.torch.int8).numpy().tobytes()) for n in NAMES for b in blocks]


class RealKvConnectorTest(RealKvConnectorCase):
    def test_vllms_factory_builds_the_connector_as_a_kvconnectorbase_v1(self):
        sched, worker, _ = self.engine()
        for c in (sched, worker):
            self.assertIsInstance(c, self.base.KVConnectorBase_V1)
            self.assertEqual(type(c).__name__, "KvhostConnector")
        for mod in (f"{KVC}.v1.base", f"{KVC}.factory", "vllm.config.kv_transfer"):
            m = sys.modules[mod]
            self.assertFalse(getattr(m, "__vllm_tree_shim__", False), mod)
            self.assertTrue(m.__file__.startswith(self.api.src), m.__file__)
        self.assertTrue(type(sched).requires_piecewise_for_cudagraph({}))
        self.assertEqual(sched.role, self.base.KVConnectorRole.SCHEDULER)

    def test_a_saved_prompt_is_loaded_layer_by_layer_byte_for_byte_in_vllms_call_order(self):
        sched, worker, kv = self.engine(seed=5, load_split="all")
        nblk = 4 * BPC + 1
        src = list(range(1, 1 + nblk))
        self.save_prompt(sched, worker, self.request("a", "kvc-prompt", nblk), src)
        want = self.rows(kv, src[:4 * BPC])
        dst = list(range(20, 20 + nblk))
        out = self.load(sched, worker, self.request("b", "kvc-prompt", nblk), dst, 4 * BPC * BLOCK)
        self.assertEqual(out.invalid_block_ids, set())
        self.assertEqual(self.rows(kv, dst[:4 * BPC]), want)
        self.assertGreater(sched.counters()["load_measurements"], 0)

    def test_the_workers_transfer_counters_reach_vllms_kv_transfer_stats(self):
        import pickle
        metrics = importlib.import_module(f"{KVC}.v1.metrics")
        sched, worker, _ = self.engine(seed=6, load_split="all")
        nblk = 2 * BPC + 1
        self.save_prompt(sched, worker, self.request("a", "kvc-stats", nblk), list(range(1, 1 + nblk)))
        worker.get_kv_connector_stats()  # the saves' counters: taken
        self.load(sched, worker, self.request("b", "kvc-stats", nblk), list(range(20, 20 + nblk)), 2 * BPC * BLOCK)
        st = worker.get_kv_connector_stats()
        self.assertIsInstance(st, metrics.KVConnectorStats)
        self.assertEqual(st.data["load_keys"], 2)
        self.assertGreater(st.data["bytes_loaded"], 0)
        again = pickle.loads(pickle.dumps(st))  # it travels from the workers to the scheduler's process
        self.assertEqual((type(again), again.data), (type(st), st.data))
        summed = type(sched).build_kv_connector_stats(st.data).aggregate(again)
        self.assertEqual(summed.data["load_keys"], 4)
        self.assertIn("load_gbps", summed.reduce())
        self.assertIsNone(worker.get_kv_connector_stats())  # nothing moved since

    def test_a_corrupted_file_is_reported_as_invalid_blocks(self):
        sched, worker, kv = self.engine(seed=9, load_split="all")
        nblk = 2 * BPC + 1
        src = list(range(1, 1 + nblk))
        self.save_prompt(sched, worker, self.request("a", "kvc-corrupt", nblk), src)
        files = self.daemon.data_files()
        self.assertTrue(files)
        try:
            for f in files:
                flip_byte(f, -100)
            dst = list(range(30, 30 + nblk))
            out = self.load(sched, worker, self.request("b", "kvc-corrupt", nblk), dst, 2 * BPC * BLOCK)
            self.assertTrue(out.invalid_block_ids)
            self.assertLessEqual(out.invalid_block_ids, set(dst[:2 * BPC]))
        finally:
            for f in files:
                if os.path.exists(f):
                    os.unlink(f)

    def test_unknown_options_are_refused_by_name(self):
        with self.assertRaisesRegex(ValueError, "no_such_option"):
            self.engine(no_such_option=1)


class RealSplitRecoveryTest(RealKvConnectorCase):
    """The load-or-recompute split's learned load rate through vLLM's own
    connector modules: a slow episode shrinks the claim, and once the
    daemon is healthy again the claim returns to the whole prefix, by the
    rate's recovery over time where nothing is loaded any more, and by the
    healthy loads' own measurements where part still is. The prefill is
    priced at 1 ms a token (a prompt of 144 tokens: about 0.14 s), so a
    healthy local daemon's loads always beat recomputing."""

    NBLK = 4 * BPC + 1              # 4 keys and a block of suffix
    WHOLE = 4 * BPC * BLOCK         # the stored prefix's tokens
    COSTS = {"load_split": "auto", "load_gbps": 10.0, "prefill_us_per_token": 1000.0,
             "prefill_ns_per_token2": 0.0, "prefill_fixed_ms": 0.0, "load_latency_ms": 0.0}

    def claim(self, sched, req):
        return sched.get_num_new_matched_tokens(req, 0)[0]

    def load_claim(self, sched, worker, req, ids):
        """A step loading what the split claims of req into ids; returns
        (the tokens claimed, vLLM's KVConnectorOutput)."""
        n = self.claim(sched, req)
        sched.update_state_after_alloc(req, self.blocks(ids), n)
        req.num_computed_tokens = n
        return n, self.step(sched, worker, self.output(new=[(req, ids)], scheduled={req.request_id: BLOCK}))

    def test_after_a_frozen_daemon_the_claim_returns_to_the_whole_prefix(self):
        # A load the frozen daemon leaves unended for daemon_wait_s is
        # given up (vLLM recomputes its blocks): its bytes over the time
        # the step had go into the rate, and the scheduler, whose unpins
        # the daemon does not answer either, claims nothing once it finds
        # them unanswered (daemon_wait_s after they were sent) until the
        # daemon answers (one such measurement at the default
        # load_rate_alpha would not shrink this claim by itself).
        # Once thawed: the claim is the whole prefix again, the rate
        # returns to the configured one (load_rate_recover_s), and the
        # whole prefix loads byte for byte.
        sched, worker, kv = self.engine(seed=11, daemon_wait_s=1.0, load_rate_recover_s=0.2, **self.COSTS)
        src = list(range(1, 1 + self.NBLK))
        self.save_prompt(sched, worker, self.request("a", "kvc-freeze", self.NBLK), src)
        want = self.rows(kv, src[:4 * BPC])
        req = self.request("b", "kvc-freeze", self.NBLK)
        n = self.claim(sched, req)
        self.assertEqual(n, self.WHOLE)
        ids = list(range(12, 12 + self.NBLK))
        sched.update_state_after_alloc(req, self.blocks(ids), n)
        req.num_computed_tokens = n
        measured = sched.counters().get("load_measurements", 0)
        self.daemon.freeze()
        try:
            out = self.step(sched, worker, self.output(new=[(req, ids)], scheduled={req.request_id: BLOCK}))
            self.assertTrue(out.invalid_block_ids, "the frozen daemon's load was not given up")
            self.assertEqual(sched.counters().get("load_measurements", 0), measured + 1,
                             "the given-up load's bytes over its time were not taken into the rate")
            d.wait_for(lambda: self.claim(sched, self.request("frozen", "kvc-freeze", self.NBLK)) == 0,
                       what="the scheduler to find the unpins unanswered and claim nothing")
        finally:
            self.daemon.thaw()
        d.wait_for(lambda: self.claim(sched, self.request("c", "kvc-freeze", self.NBLK)) == self.WHOLE,
                   what="the claim to return to the whole prefix")
        d.wait_for(lambda: sched.cost_model.load_gbps > self.COSTS["load_gbps"] * 0.99,
                   what="the learned rate to return to the configured one")
        dst = list(range(24, 24 + self.NBLK))
        out = self.load(sched, worker, self.request("e", "kvc-freeze", self.NBLK), dst, self.WHOLE)
        self.assertEqual(out.invalid_block_ids, set())
        self.assertEqual(self.rows(kv, dst[:4 * BPC]), want)

    def slow_mount(self, sched, tag, until, seconds_per_prefix):
        """Reports of a worker on a slow mount (vLLM carries them in
        KVConnectorOutput's worker meta: five loads of the whole prefix,
        seconds_per_prefix each) until until(the claim) holds; returns that
        claim."""
        from kvhost.vllm._conn_common import WorkerMeta
        whole_bytes = self.WHOLE * len(NAMES) * HEADS * HEAD * 2 * 2  # K and V, bf16
        for i in range(50):
            n = self.claim(sched, self.request(f"slow{i}", tag, self.NBLK))
            if until(n):
                return n
            wm = WorkerMeta(5 * whole_bytes, 5 * seconds_per_prefix, (), (), ())
            sched.update_connector_output(self.outputs.KVConnectorOutput(
                finished_sending=None, finished_recving=None, invalid_block_ids=set(), kv_connector_worker_meta=wm))
        self.fail(f"50 reports of the slow mount did not move the claim there (last {n}, rate "
                  f"{sched.cost_model.load_gbps:.3g} GB/s)")

    def test_a_claim_a_slow_mount_took_to_nothing_returns_to_the_whole_prefix_with_time(self):
        # So slow a mount that nothing is worth loading: no load measures
        # the rate again, so only its recovery over time can bring it
        # back, and it does (load_rate_recover_s). One report is the rate
        # here (load_rate_alpha 1); the prefill is priced under what the
        # scheduler learns its compute from (4.3 ms a prompt), so that
        # only the load rate moves.
        costs = dict(self.COSTS, prefill_us_per_token=30.0)
        sched, worker, kv = self.engine(seed=13, load_rate_recover_s=2.0, load_rate_alpha=1.0, **costs)
        src = list(range(1, 1 + self.NBLK))
        self.save_prompt(sched, worker, self.request("a", "kvc-nothing", self.NBLK), src)
        self.assertEqual(self.claim(sched, self.request("before", "kvc-nothing", self.NBLK)), self.WHOLE)
        # The rate recovers from the report on: the claim is nothing only
        # for the first few ms after it (about 17 ms at load_rate_recover_s
        # 2), so a report is sent again before each try.
        self.assertEqual(self.slow_mount(sched, "kvc-nothing", lambda n: n == 0, 30.0), 0)
        d.wait_for(lambda: self.claim(sched, self.request("b", "kvc-nothing", self.NBLK)) == self.WHOLE,
                   what="the claim to return to the whole prefix")

    def test_after_a_slow_mount_the_healthy_loads_bring_the_claim_back_to_the_whole_prefix(self):
        # The rate falls until part of the prefix is claimed. With the
        # recovery over time off (load_rate_recover_s 0), the loads of
        # that part, now from a healthy daemon, are what move the rate
        # back: within a few of them the claim is the whole prefix again.
        sched, worker, kv = self.engine(seed=12, load_rate_recover_s=0, **self.COSTS)
        src = list(range(1, 1 + self.NBLK))
        self.save_prompt(sched, worker, self.request("a", "kvc-slow", self.NBLK), src)
        want = self.rows(kv, src[:4 * BPC])
        self.assertEqual(self.claim(sched, self.request("before", "kvc-slow", self.NBLK)), self.WHOLE)
        shrunk = self.slow_mount(sched, "kvc-slow", lambda n: n < self.WHOLE, 0.5)
        self.assertGreater(shrunk, 0, "the slow mount's rate left nothing to load: pick a faster slow mount")
        sets = [list(range(12, 12 + self.NBLK)), list(range(24, 24 + self.NBLK))]
        claims = []
        for i in range(20):
            dst = sets[i % 2]
            n, out = self.load_claim(sched, worker, self.request(f"fast{i}", "kvc-slow", self.NBLK), dst)
            claims.append(n)
            self.assertEqual(out.invalid_block_ids, set())
            self.assertEqual(self.rows(kv, dst[:n // BLOCK]), self.rows(kv, src[:n // BLOCK]))
            if n == self.WHOLE:
                break
        self.assertEqual(claims[-1], self.WHOLE, f"claims after the slow mount: {claims}")
        self.assertLess(claims[0], self.WHOLE, f"the first healthy load was not of the shrunk claim: {claims}")
        self.assertEqual(self.rows(kv, sets[(len(claims) - 1) % 2][:4 * BPC]), want)

    def test_an_idle_spell_after_healthy_loads_keeps_the_whole_claim_a_slow_configured_rate_would_not(self):
        # The configured rate prices the prefix's load at 0.3 s (a slow
        # mount's, as above): the first claim is short of the
        # whole prefix. The daemon's healthy loads raise the rate until
        # the claim is the whole prefix; then nothing is loaded for a
        # while, and the rate returns to the last good one (the healthy
        # loads'), not to the configured one: the claim stays whole.
        whole_bytes = self.WHOLE * len(NAMES) * HEADS * HEAD * 2 * 2  # K and V, bf16
        costs = dict(self.COSTS, load_gbps=whole_bytes / 0.3 / 1e9)
        sched, worker, kv = self.engine(seed=14, load_rate_recover_s=0.5, **costs)
        src = list(range(1, 1 + self.NBLK))
        self.save_prompt(sched, worker, self.request("a", "kvc-idle", self.NBLK), src)
        sets = [list(range(12, 12 + self.NBLK)), list(range(24, 24 + self.NBLK))]
        claims = []
        for i in range(20):
            dst = sets[i % 2]
            n, out = self.load_claim(sched, worker, self.request(f"load{i}", "kvc-idle", self.NBLK), dst)
            claims.append(n)
            self.assertEqual(out.invalid_block_ids, set())
            if n == self.WHOLE:
                break
        self.assertLess(claims[0], self.WHOLE, f"the configured rate claimed the whole prefix: {claims}")
        self.assertEqual(claims[-1], self.WHOLE, f"the healthy loads did not bring the whole claim: {claims}")
        cost = sched.cost_model
        self.assertGreater(cost.good_gbps, costs["load_gbps"])
        d.wait_for(lambda: abs(cost.load_gbps - cost.good_gbps) < 0.01 * cost.good_gbps,
                   what="the unmeasured rate to return to the last good one")
        self.assertEqual(self.claim(sched, self.request("after", "kvc-idle", self.NBLK)), self.WHOLE)


class RealSplitStartRateTest(RealKvConnectorCase):
    """The rate the split starts from, through vLLM's own connector
    modules: where load_gbps is not given, a daemon whose every mount is
    memory (its Stats reply's device classes) starts it at a memory
    mount's rate, any other at a disk's; a given load_gbps is kept."""

    def with_daemon(self, mount_toml):
        """A daemon of its own for this test, its mount's table given
        mount_toml."""
        daemon = d.Daemon(after_toml=mount_toml)
        self.closers.append(daemon.stop)
        self.daemon = daemon

    def start_rate(self, **extra):
        """The scheduler's rate once it has connected (its first claim),
        before any load."""
        sched, _, _ = self.engine(seed=15, **extra)
        self.assertEqual(sched.get_num_new_matched_tokens(self.request("r", "kvc-start", 4 * BPC + 1), 0)[0], 0)
        return sched.cost_model.load_gbps

    def test_memory_mounts_start_the_split_at_a_memory_rate(self):
        from kvhost.vllm._conn_common import MEMORY_LOAD_GBPS
        self.with_daemon('device_class = "memory"')
        self.assertEqual(self.start_rate(), MEMORY_LOAD_GBPS)

    def test_a_disk_mount_starts_the_split_at_a_disk_rate(self):
        from kvhost.vllm._conn_common import DEFAULT_LOAD_GBPS
        self.with_daemon('device_class = "ssd"')
        self.assertEqual(self.start_rate(), DEFAULT_LOAD_GBPS)

    def test_a_given_load_gbps_is_kept_on_memory_mounts(self):
        self.with_daemon('device_class = "memory"')
        self.assertEqual(self.start_rate(load_gbps=5.0), 5.0)


def free_port():
    """A TCP port of 127.0.0.1 free now (for the daemon's metrics listener)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SaltNamespaces(RealKvConnectorCase):
    """salt_namespaces: requests of a cache_salt the option names keep
    their keys in a namespace of that name's, which a [[budget]] of the
    daemon covers on its own."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.daemon.stop()
        cls.port = free_port()
        cls.daemon = d.Daemon(extra_toml=(
            f'[metrics]\nlisten = "127.0.0.1:{cls.port}"\n\n'
            '[[budget]]\nmodel = "vllm-conn@tenant-a:*"\nbytes = "64MiB"\n\n'
            '[[budget]]\nmodel = "vllm-conn@tenant-b:*"\nbytes = "64MiB"\n'))

    def salted(self, req_id, tag, nblk, salt):
        req = self.request(req_id, tag, nblk)
        req.cache_salt = salt
        return req

    def budget_used(self):
        """kvhost_budget_used_bytes by budget pattern, from the daemon's metrics."""
        import re
        import urllib.request
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=10).read().decode()
        return {m.group(1): float(m.group(2))
                for m in re.finditer(r'^kvhost_budget_used_bytes\{budget="([^"]+)"\} (\S+)$', text, re.M)}

    def test_a_mapped_salts_requests_keep_their_keys_in_its_namespace_which_its_budget_counts(self):
        import kvhost
        sched, worker, kv = self.engine(seed=21, load_split="all",
                                        salt_namespaces={"salt-a": "tenant-a", "salt-b": "tenant-b"})
        nblk = 2 * BPC + 1
        reqs = {"a": self.salted("a", "salted-a", nblk, "salt-a"), "b": self.salted("b", "salted-b", nblk, "salt-b"),
                "c": self.request("c", "unsalted", nblk), "x": self.salted("x", "unmapped", nblk, "salt-x")}
        for i, r in enumerate(reqs.values()):
            self.save_prompt(sched, worker, r, list(range(1 + i * nblk, 1 + (i + 1) * nblk)))
        with kvhost.Client(self.daemon.socket) as c:
            listed = c.stats()["namespaces"]["list"]
        keys = collections.Counter()
        nbytes = collections.Counter()
        for n in listed:
            who = n["model"].split(":", 1)[0]
            keys[who] += n["keys"]
            nbytes[who] += n["bytes"]
        self.assertEqual(dict(keys), {"vllm-conn@tenant-a": 2, "vllm-conn@tenant-b": 2, "vllm-conn": 4}, listed)
        used = d.wait_for(lambda: (lambda u: u if len(u) == 2 and all(u.values()) else None)(self.budget_used()),
                          what="the budgets' use in the daemon's metrics")
        # Each budget counts its salt's namespace, and nothing else.
        self.assertEqual(used, {"vllm-conn@tenant-a:*": nbytes["vllm-conn@tenant-a"],
                                "vllm-conn@tenant-b:*": nbytes["vllm-conn@tenant-b"]})
        # The same keys under another salt's namespace are not found; under
        # their own they load byte for byte.
        want = self.rows(kv, list(range(1, 1 + 2 * BPC)))
        other = self.salted("o", "salted-a", nblk, "salt-b")
        self.assertEqual(sched.get_num_new_matched_tokens(other, 0), (0, False))
        dst = list(range(30, 30 + nblk))
        out = self.load(sched, worker, self.salted("l", "salted-a", nblk, "salt-a"), dst, 2 * BPC * BLOCK)
        self.assertEqual(out.invalid_block_ids, set())
        self.assertEqual(self.rows(kv, dst[:2 * BPC]), want)

    def test_salt_namespaces_are_checked(self):
        for bad in ([("salt-a", "tenant-a")], {"salt-a": "tenant a"}, {"salt-a": ""}, {"": "x"}, {"s": "n" * 33}):
            with self.subTest(salt_namespaces=bad), self.assertRaisesRegex(ValueError, "salt_namespaces"):
                self.engine(salt_namespaces=bad)


if __name__ == "__main__":
    unittest.main()
