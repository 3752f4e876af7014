"""kvhost inside vLLM's own MultiConnector: vLLM's MultiConnector builds
its children through vLLM's KVConnectorFactory from vLLM's KVTransferConfig;
each child is vLLM's OffloadingConnector, whose scheduler half
(OffloadingConnectorScheduler) drives kvhost's spec manager and whose
worker half (OffloadingConnectorWorker) drives kvhost's spec worker, against
a real kvhost daemon. A step is what vLLM's engine does: on the scheduler,
on_new_request, get_num_new_matched_tokens, update_state_after_alloc,
build_connector_meta, update_connector_output and request_finished; on the
worker, bind_connector_metadata, start_load_kv, wait_for_save,
get_finished, build_connector_worker_meta and clear_connector_metadata.

Stand-ins (vllm_tree.py says why each module is shimmed): the VllmConfig
(a namespace of the fields the connectors read), the scheduler's Request (an
object with the fields the scheduler reads; RequestStatus is vLLM's), and
the KV cache blocks the KV cache manager would allocate (vLLM's own
KVCacheBlocks and KVCacheBlock classes). The scheduler's SchedulerOutput
and the workers' KVConnectorOutput are vLLM's dataclasses.

Needs a vLLM source tree and vLLM's Python dependencies: `make
vllm-test-deps` then `make test-vllm VLLM_SRC=DIR`; without a tree every
test here reports itself skipped.
"""

import hashlib
import importlib
import pathlib
import sys
import types
import unittest

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

import daemon as d  # noqa: E402
import vllm_tree  # noqa: E402
from test_vllm_real_connector import (  # noqa: E402
    BLOCK, BLOCKS, MODEL, ConnectorCase, vllm_config)

NO_TREE = vllm_tree.skip_reason()
KVC = "vllm.distributed.kv_transfer.kv_connector"
PROMPT_BLOCKS = 4


def child(socket, **extra):
    """A MultiConnector child: vLLM's OffloadingConnector over kvhost's spec."""
    cfg = {"spec_name": "KvhostOffloadingSpec", "spec_module_path": "kvhost.vllm",
           "socket": socket, "page_layout": "FLASH_ATTN/HND", **extra}
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": cfg}


def cpu_child(cpu_bytes):
    """A MultiConnector child: vLLM's OffloadingConnector over vLLM's CPU spec."""
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": cpu_bytes}}


class Request:
    """What vLLM's offloading scheduler reads of vllm.v1.request.Request (the
    real one needs sampling parameters and multimodal inputs): the id, the
    prompt's block hashes (one per BLOCK tokens), token counts, status and
    shared_prefix_boundary."""

    def __init__(self, api, req_id, prompt_hashes, status_cls):
        self.request_id = req_id
        self.block_hashes = list(prompt_hashes)
        self.num_prompt_tokens = self.num_tokens = len(prompt_hashes) * BLOCK
        self.num_computed_tokens = 0
        self.kv_transfer_params = None
        self.skip_reading_prefix_cache = False
        self._status_cls = status_cls
        self.status = status_cls.RUNNING
        self.prompt_token_ids = list(range(self.num_tokens))
        self.mm_features = []
        self.sampling_params = self.pooling_params = self.lora_request = None
        self.all_token_ids = self.prompt_token_ids
        # Read by the offloading scheduler's store filter from 8ab97ed6 on
        # (0: no shared prefix detected, vLLM's value at admission).
        self.shared_prefix_boundary = 0

    def is_finished(self):
        return self._status_cls.is_finished(self.status)


def hashes(tag, n=PROMPT_BLOCKS):
    """vLLM's chained block hashes for a prompt of n blocks (32 bytes each)."""
    out, prev = [], b""
    for i in range(n):
        prev = hashlib.sha256(prev + f"{tag}-{i}".encode()).digest()
        out.append(prev)
    return out


@unittest.skipUnless(NO_TREE is None, NO_TREE or "")
class MultiCase(ConnectorCase):
    """One engine = a scheduler-side and a worker-side MultiConnector."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.base = importlib.import_module(f"{KVC}.v1.base")
        cls.multi = importlib.import_module(f"{KVC}.v1.multi_connector")
        cls.kvtc = importlib.import_module("vllm.config.kv_transfer")
        cls.sched_out = importlib.import_module("vllm.v1.core.sched.output")
        cls.outputs = importlib.import_module("vllm.v1.outputs")
        cls.kcm = importlib.import_module("vllm.v1.core.kv_cache_manager")
        cls.kcu = importlib.import_module("vllm.v1.core.kv_cache_utils")
        cls.req_mod = importlib.import_module("vllm.v1.request")

    def multi_config(self, children, model=MODEL, engine="kvhost-multi-test"):
        vc = vllm_config(self.daemon.socket, v2=True)
        vc.model_config.model = model
        vc.kv_transfer_config = self.kvtc.KVTransferConfig(
            kv_connector="MultiConnector", kv_role="kv_both", engine_id=engine,
            kv_connector_extra_config={"connectors": children})
        vc.scheduler_config = types.SimpleNamespace(disable_hybrid_kv_cache_manager=True)
        vc.speculative_config = None
        return vc

    def engine_pair(self, children, model=MODEL, seed=0, engine="kvhost-multi-test"):
        """vLLM's MultiConnector for the scheduler and for one worker, the
        worker's per-layer KV caches registered. Returns (scheduler,
        worker, rows of each layer)."""
        kvc, page = self.kv_cache_config()
        vc = self.multi_config(children, model, engine)
        role = self.base.KVConnectorRole
        sched = self.multi.MultiConnector(vc, role.SCHEDULER, kvc)
        self.closers.append(sched.shutdown)
        self.current(vc)
        worker = self.multi.MultiConnector(vc, role.WORKER, kvc)
        kv, rows = self.per_layer(page, seed)
        worker.register_kv_caches(kv)
        self.closers.append(worker.shutdown)
        return sched, worker, rows

    def request(self, req_id, tag):
        return Request(self.api, req_id, hashes(tag), self.req_mod.RequestStatus)

    def blocks(self, ids, computed=()):
        """vLLM's KVCacheBlocks of one group: ids, those in computed hashed
        (a GPU prefix-cache hit) and the others not."""
        out = []
        for b in ids:
            blk = self.kcu.KVCacheBlock(b)
            if b in computed:
                blk._block_hash = b"h" * 36
            out.append(blk)
        return self.kcm.KVCacheBlocks((out,))

    def output(self, new=(), cached=(), scheduled=None, finished=()):
        """vLLM's SchedulerOutput of one step: new is [(request, block ids)],
        cached [(request id, new block ids)], scheduled {id: tokens}."""
        so = self.sched_out.SchedulerOutput.make_empty()
        so.scheduled_new_reqs = [
            self.sched_out.NewRequestData(
                req_id=r.request_id, prompt_token_ids=r.prompt_token_ids, mm_features=[],
                sampling_params=None, pooling_params=None, block_ids=(list(ids),),
                num_computed_tokens=r.num_computed_tokens, lora_request=None)
            for r, ids in new]
        cr = so.scheduled_cached_reqs
        for rid, ids in cached:
            cr.req_ids.append(rid)
            cr.new_block_ids.append((list(ids),) if ids else None)
            cr.num_computed_tokens.append(0)
            if hasattr(cr, "num_output_tokens"):
                cr.num_output_tokens.append(0)
            if hasattr(cr, "new_token_ids"):
                cr.new_token_ids.append([])
        so.num_scheduled_tokens = dict(scheduled or {})
        so.total_num_scheduled_tokens = sum(so.num_scheduled_tokens.values())
        so.finished_req_ids = set(finished)
        return so

    def step(self, sched, worker, so, finished=()):
        """One engine step: the scheduler's metadata to the worker, the
        worker's step, its output back. Returns (finished_sending,
        finished_recving)."""
        meta = sched.build_connector_meta(so)
        worker.handle_preemptions(meta)
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(None)
        worker.wait_for_save()
        sending, recving = worker.get_finished(set(finished))
        out = self.outputs.KVConnectorOutput(
            finished_sending=sending, finished_recving=recving,
            kv_connector_worker_meta=worker.build_connector_worker_meta())
        worker.clear_connector_metadata()
        sched.update_connector_output(out)
        return sending or set(), recving or set()

    def matched(self, sched, req, computed=0):
        """get_num_new_matched_tokens as vLLM's scheduler asks it: again on
        the next step while the connector answers None."""
        def once():
            n, load_async = sched.get_num_new_matched_tokens(req, computed)
            return None if n is None else (n, load_async)
        return d.wait_for(once, what=f"a lookup answer for {req.request_id}")

    def store_prompt(self, sched, worker, req, ids):
        """A request's prompt (computed on the GPU in blocks ids) stored
        through vLLM's steps until kvhost's manager completed the store."""
        sched.on_new_request(req)
        self.assertEqual(self.matched(sched, req), (0, False))
        sched.update_state_after_alloc(req, self.blocks(ids), 0)
        self.step(sched, worker, self.output(new=[(req, ids)], scheduled={req.request_id: req.num_tokens}))
        req.num_computed_tokens = req.num_tokens
        req.status = self.req_mod.RequestStatus.FINISHED_STOPPED
        sched.request_finished(req, list(ids))
        finished = {req.request_id}
        managers = [c.connector_scheduler.manager for c in sched._connectors]

        def stored():
            so = self.output(finished=finished)
            self.step(sched, worker, so, finished=finished)
            finished.clear()
            return all(m.counters()["storing_now"] == 0 for m in managers
                       if hasattr(m, "counters"))
        d.wait_for(stored, what=f"{req.request_id}'s store completed")


class TestRealMultiConnector(MultiCase):
    def test_the_connectors_are_vllms_own(self):
        from kvhost.vllm.spec import SpecManager
        for mod in (f"{KVC}.v1.multi_connector", f"{KVC}.v1.offloading_connector",
                    f"{KVC}.v1.offloading.scheduler", f"{KVC}.v1.offloading.worker", f"{KVC}.v1.base",
                    f"{KVC}.factory", "vllm.config.kv_transfer"):
            m = sys.modules[mod]
            self.assertFalse(getattr(m, "__vllm_tree_shim__", False), mod)
            self.assertTrue(m.__file__.startswith(self.api.src), m.__file__)
        sched, _, _ = self.engine_pair([child(self.daemon.socket)])
        self.assertIsInstance(sched._connectors[0].connector_scheduler.manager, SpecManager)

    def test_a_prompt_stored_through_the_worker_is_found_and_loaded_by_the_scheduler(self):
        sched, worker, rows = self.engine_pair([child(self.daemon.socket)], seed=11)
        self.assertEqual(len(sched._connectors), 1)
        self.assertEqual(type(sched._connectors[0]).__name__, "OffloadingConnector")
        a = self.request("a", "prompt")
        self.store_prompt(sched, worker, a, [1, 2, 3, 4])
        want = [bytes(r[b].numpy().tobytes()) for r in rows for b in (1, 2, 3, 4)]
        for r in rows:
            r[5:9].zero_()
        # The same prompt again: the scheduler's lookup finds it in kvhost.
        b = self.request("b", "prompt")
        sched.on_new_request(b)
        n, load_async = self.matched(sched, b)
        self.assertEqual((n, load_async), (PROMPT_BLOCKS * BLOCK, True))
        sched.update_state_after_alloc(b, self.blocks([5, 6, 7, 8]), n)
        recving = set()

        def loaded():
            so = self.output(new=[(b, [5, 6, 7, 8])] if not recving else (), scheduled={})
            recving.update(self.step(sched, worker, so)[1])
            return "b" in recving
        d.wait_for(loaded, what="b's load finished")
        self.assertEqual([bytes(r[b].numpy().tobytes()) for r in rows for b in (5, 6, 7, 8)], want)
        sched.request_finished(b, [5, 6, 7, 8])

    def test_two_models_never_share_blocks(self):
        sched, worker, _ = self.engine_pair([child(self.daemon.socket)], seed=3)
        self.store_prompt(sched, worker, self.request("a", "shared-prefix"), [1, 2, 3, 4])
        other, _, _ = self.engine_pair([child(self.daemon.socket)], model="Qwen/Qwen3-8B", seed=4,
                                       engine="kvhost-multi-other")
        b = self.request("b", "shared-prefix")
        other.on_new_request(b)
        self.assertEqual(self.matched(other, b), (0, False))
        # The first model still finds it.
        c = self.request("c", "shared-prefix")
        sched.on_new_request(c)
        self.assertEqual(self.matched(sched, c)[0], PROMPT_BLOCKS * BLOCK)


class TestRealMultiConnectorMetrics(MultiCase):
    """vLLM declares a MultiConnector's Prometheus metrics once per child
    class, from the first child of that class (MultiConnector.
    build_prom_metrics), and merges the children's stats under the class's
    name (get_kv_connector_stats); its OffloadPromMetrics.observe asserts
    that every name it is handed was declared."""

    def prom(self, vc):
        """vLLM's Prometheus declaration for vc, into a registry of its own."""
        import functools

        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
        reg = CollectorRegistry()
        kinds = {k: functools.partial(k, registry=reg) for k in (Gauge, Counter, Histogram)}
        return self.multi.MultiConnector.build_prom_metrics(vc, kinds, ["model_name", "engine"], {0: [MODEL, "0"]}), reg

    def scheduler(self, children, engine):
        kvc, _ = self.kv_cache_config()
        vc = self.multi_config(children, engine=engine)
        sched = self.multi.MultiConnector(vc, self.base.KVConnectorRole.SCHEDULER, kvc)
        self.closers.append(lambda: _unlink(vllm_tree.shm_path(engine)))
        self.closers.append(sched.shutdown)
        return vc, sched

    def looked_up(self, sched):
        """One request looked up (a miss), as vLLM's scheduler does; returns
        what vLLM hands its stats loggers (the stats' data)."""
        r = self.request("m", "metrics")
        sched.on_new_request(r)
        self.matched(sched, r)
        stats = sched.get_kv_connector_stats()
        self.assertIsNotNone(stats)
        return stats.data

    def test_two_kvhost_children_are_declared_and_observed(self):
        vc, sched = self.scheduler([child(self.daemon.socket), child(self.daemon.socket)], "kvhost-multi-kk")
        prom, reg = self.prom(vc)
        data = self.looked_up(sched)
        self.assertEqual(list(data), ["OffloadingConnector"])
        prom.observe({k: {"data": v.data} for k, v in data.items()}, 0)
        misses = reg.get_sample_value("vllm:kv_offload_kvhost_lookup_misses_total",
                                      {"model_name": MODEL, "engine": "0", "role": "scheduler"})
        self.assertGreaterEqual(misses, 2)  # both children's lookups, summed

    def observe(self, children, engine):
        """A scheduler over children, one lookup through it, and vLLM's
        Prometheus logger observing its stats. Returns (names vLLM
        declared, names reported, the observe call)."""
        vc, sched = self.scheduler(children, engine)
        prom, _ = self.prom(vc)
        data = self.looked_up(sched)
        declared = set(prom._prom_metrics["OffloadingConnector"]._offloading_metric_defs)
        reported = set(data["OffloadingConnector"].data["data"])
        return declared, reported, lambda: prom.observe({k: {"data": v.data} for k, v in data.items()}, 0), sched

    def test_kvhost_after_vllms_cpu_spec_with_metrics_off_is_observed(self):
        # The CPU child is first: vLLM declares the CPU spec's metrics, not
        # kvhost's; with "metrics": false kvhost reports none of its own.
        cpu = 4096 * 16 * 4
        declared, reported, observe, sched = self.observe(
            [cpu_child(cpu), child(self.daemon.socket, metrics=False)], "kvhost-multi-ck-off")
        self.assertLessEqual(reported, declared)
        observe()  # vLLM's Prometheus logger no longer fails
        # kvhost's manager still counted the lookup.
        self.assertGreaterEqual(sched._connectors[1].connector_scheduler.manager.counters()["lookup_misses"], 1)

    def test_kvhost_after_vllms_cpu_spec_warns_and_its_counters_stay_undeclared(self):
        # Without the option kvhost's counters are names vLLM never
        # declared, and vLLM's Prometheus logger fails on its bare assert;
        # a spec built where vLLM's current config is set (a worker's
        # set-up) names the option.
        cpu = 4096 * 16 * 4
        children = [cpu_child(cpu), child(self.daemon.socket)]
        self.current(self.multi_config(children, engine="kvhost-multi-ck"))
        with self.assertLogs("vllm.kvhost", "WARNING") as logs:
            declared, reported, observe, _ = self.observe(children, "kvhost-multi-ck")
        self.assertTrue(any('child 2 of vLLM\'s MultiConnector' in line and '"metrics": false' in line
                            for line in logs.output), logs.output)
        self.assertTrue(reported - declared)
        self.assertTrue(all(n.startswith("vllm:kv_offload_kvhost_") for n in reported - declared), reported - declared)
        with self.assertRaises(AssertionError):
            observe()

    def test_vllms_cpu_spec_after_kvhost_warns_and_its_metrics_stay_undeclared(self):
        # kvhost first: vLLM declares kvhost's metrics and not the CPU
        # spec's, whatever kvhost's option says; kvhost's spec says so.
        cpu = 4096 * 16 * 4
        children = [child(self.daemon.socket, metrics=False), cpu_child(cpu)]
        self.current(self.multi_config(children, engine="kvhost-multi-kc"))
        with self.assertLogs("vllm.kvhost", "WARNING") as logs:
            declared, reported, observe, _ = self.observe(children, "kvhost-multi-kc")
        self.assertTrue(any("child 2 (CPUOffloadingSpec) are undeclared" in line for line in logs.output), logs.output)
        self.assertTrue(reported - declared)
        self.assertFalse(any(n.startswith("vllm:kv_offload_kvhost_") for n in reported), reported)
        with self.assertRaises(AssertionError):
            observe()

    def test_two_kvhost_children_do_not_warn(self):
        children = [child(self.daemon.socket), child(self.daemon.socket, namespace="b")]
        self.current(self.multi_config(children, engine="kvhost-multi-kk2"))
        with self.assertNoLogs("vllm.kvhost", "WARNING"):
            declared, reported, observe, _ = self.observe(children, "kvhost-multi-kk2")
        self.assertLessEqual(reported, declared)
        observe()


def _unlink(path):
    try:
        pathlib.Path(path).unlink()
    except FileNotFoundError:
        pass
