"""The vLLM source-tree harness (vllm_tree.py) drives vLLM's real code.

Needs a vLLM tree: KVHOST_VLLM_SRC=DIR (make test-vllm VLLM_SRC=DIR); without
one every test here reports itself skipped by name.
"""

import dataclasses
import os
import subprocess
import sys
import tempfile
import time
import unittest
from unittest import mock

import vllm_tree

HERE = os.path.dirname(os.path.abspath(__file__))
REASON = vllm_tree.skip_reason()  # imports nothing; setUp loads the tree
needs_tree = unittest.skipUnless(REASON is None, REASON or "")

# Classes that must be vLLM's own code (never a shim).
REAL = (
    "LookupResult", "OffloadingSpec", "OffloadingManager", "OffloadingWorker",
    "GPULoadStoreSpec", "LoadStoreSpec", "PrepareStoreOutput",
    "TransferResult", "OffloadingEvent", "ReqContext",
    "RequestOffloadingContext", "ScheduleEndContext", "CanonicalKVCaches",
    "CanonicalKVCacheTensor", "CanonicalKVCacheRef", "OffloadingConfig",
    "OffloadingGroupConfig", "OffloadingModelConfig", "OffloadingCacheConfig",
    "OffloadingParallelConfig", "OffloadingSpecFactory", "CPUOffloadingSpec",
    "CPUOffloadingManager", "SharedOffloadRegion", "SecondaryTierManager",
    "SecondaryTierFactory", "JobResult", "TieringOffloadingManager",
    "TieringOffloadingSpec", "FileSystemTierManager", "KVConnectorStats",
    "OffloadingConnectorStats",
)

STEP = None  # set per test: ScheduleEndContext with nothing new


def _tree_has(api, relpath, text):
    """Whether the tree's file contains text (the ground truth for what a
    snapshot has, independent of the harness)."""
    if api.src is None:
        return None
    try:
        with open(os.path.join(api.src, "vllm", relpath)) as f:
            return text in f.read()
    except OSError:
        return False


class Dependencies(unittest.TestCase):
    def test_a_missing_dependency_fails_naming_the_package_and_the_target(self):
        with mock.patch.dict(vllm_tree.DEPENDENCIES, {"kvhost_no_such_module": "python3-kvhost-no-such"}):
            with self.assertRaisesRegex(RuntimeError, r"python3-kvhost-no-such.*make vllm-test-deps"):
                vllm_tree._require_dependencies()


@needs_tree
class TreeLoads(unittest.TestCase):
    def setUp(self):
        self.api = vllm_tree.load()

    def test_classes_are_vllms_own(self):
        api = self.api
        print(f"\n  {api.name}; shimmed: {', '.join(api.shimmed)}; "
              f"missing: {', '.join(api.missing) or '-'}", file=sys.stderr)
        for name in REAL:
            cls = getattr(api, name)
            self.assertIsNotNone(cls, f"{name} not loaded ({api.errors})")
            mod = sys.modules[cls.__module__]
            self.assertFalse(getattr(mod, "__vllm_tree_shim__", False), name)
            if api.src is not None:
                self.assertTrue(
                    os.path.abspath(mod.__file__).startswith(api.src + os.sep),
                    f"{name} from {mod.__file__}")
        self.assertTrue(issubclass(api.OffloadingConnectorStats,
                                   api.KVConnectorStats))
        self.assertTrue(issubclass(api.TieringOffloadingSpec,
                                   api.CPUOffloadingSpec))

    def test_no_import_errors(self):
        self.assertEqual(self.api.errors, {})

    def test_shims_are_documented_and_not_under_test(self):
        for name, doc in vllm_tree.shim_docs(self.api).items():
            self.assertTrue(doc.startswith("vllm_tree"), name)
            self.assertFalse(name.startswith("vllm.v1.kv_offload"), name)
            self.assertFalse(name.endswith(".offloading.metrics"), name)

    def test_idempotent(self):
        self.assertIs(vllm_tree.load(), self.api)
        self.assertIs(vllm_tree.load(self.api.src), self.api)

    def test_refuses_a_second_tree(self):
        with tempfile.TemporaryDirectory() as d:
            os.mkdir(os.path.join(d, "vllm"))
            open(os.path.join(d, "vllm", "__init__.py"), "w").close()
            with self.assertRaisesRegex(RuntimeError, "already loaded"):
                vllm_tree.load(d)

    def test_reports_what_the_tree_lacks(self):
        api = self.api
        has_job = _tree_has(api, "v1/kv_offload/tiering/base.py",
                            "class TransferJob")
        has_keys = _tree_has(api, "v1/kv_offload/tiering/base.py",
                             "successful_keys")
        if has_job is not None:
            self.assertEqual(api.has_transfer_job, has_job)
            self.assertEqual(api.has_successful_keys, has_keys)
        if not api.has_transfer_job:
            self.assertIsNone(api.TransferJob)
            self.assertIn("vllm.v1.kv_offload.tiering.base.TransferJob",
                          api.missing)

    def test_offloading_config_matches_tree_fields(self):
        api = self.api
        cfg = vllm_tree.make_offloading_config(
            api, tp=2, extra_config={"x": 1}, canonical_layout=True)
        self.assertIsInstance(cfg, api.OffloadingConfig)
        self.assertEqual(cfg.parallel.world_size, 2)
        self.assertEqual(cfg.extra_config["x"], 1)
        fields = {f.name for f in dataclasses.fields(api.OffloadingConfig)}
        if "canonical_layout" in fields:
            self.assertTrue(cfg.canonical_layout)
        pfields = {f.name for f in
                   dataclasses.fields(api.OffloadingParallelConfig)}
        self.assertEqual(
            "data_parallel_size" in pfields,
            bool(_tree_has(api, "v1/kv_offload/config.py",
                           "data_parallel_size:")))
        print(f"\n  OffloadingParallelConfig fields: {sorted(pfields)}",
              file=sys.stderr)

    def test_connector_stats_aggregate(self):
        api = self.api
        s = api.OffloadingConnectorStats()
        self.assertTrue(s.is_empty())


@needs_tree
class TieringDrivesRealCode(unittest.TestCase):
    """TieringOffloadingSpec from OffloadingSpecFactory, in vLLM's call
    order (tiering/manager.py): on_new_request, lookup, prepare_store,
    complete_store, on_schedule_end per step, get_stats every step."""

    def setUp(self):
        self.api = vllm_tree.load()
        if self.api.TieringOffloadingSpec is None or \
                self.api.FileSystemTierManager is None:
            self.skipTest(f"{self.api.name} has no tiering/fs")
        self.root = tempfile.TemporaryDirectory()
        self.addCleanup(self.root.cleanup)
        self.handles = []

    def tearDown(self):
        for h in self.handles:
            h.close()
            self.assertFalse(os.path.exists(h.shm_path))

    def manager(self, tiers, engine_id=None):
        kw = {"engine_id": engine_id} if engine_id else {}
        h = vllm_tree.make_tiering_manager(
            self.api, num_cpu_blocks=8, secondary_tiers=tiers,
            config_kwargs=kw)
        self.handles.append(h)
        self.assertTrue(os.path.exists(h.shm_path), h.shm_path)
        return h.manager

    def step(self, m, new=(), stats=None):
        s = m.get_stats()
        if stats is not None and s is not None:
            self.assertIsInstance(s, self.api.OffloadingConnectorStats)
            stats.append(s)
        m.on_schedule_end(self.api.ScheduleEndContext(
            new_req_ids=list(new), preempted_req_ids=[]))

    # WAIT bounds the waits for a tier's asynchronous work (its threads'
    # reads and writes): only a hang, however slowly a loaded machine
    # runs them.
    WAIT = 60.0

    def drive_until(self, m, key, ctx, want, stats, limit=WAIT):
        api = self.api
        seen = []
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            r = m.lookup(key, ctx)
            seen.append(r.name)
            if r in want:
                return r, seen
            self.assertIn(r, (api.LookupResult.RETRY,
                              api.LookupResult.HIT_PENDING,
                              api.LookupResult.MISS), seen)
            self.step(m, stats=stats)
            time.sleep(0.01)
        self.fail(f"lookup never reached {want} in {limit}s: {seen[-10:]}")

    def drain(self, m, stats):
        """Steps m until it has no pending work (the tiers' jobs ended)."""
        deadline = time.monotonic() + self.WAIT
        while m.has_pending_work():
            if time.monotonic() > deadline:
                self.fail(f"work still pending after {self.WAIT}s")
            self.step(m, stats=stats)
            time.sleep(0.01)

    def keys(self, n, seed=1):
        return [self.api.make_offload_key(bytes([seed, i]) * 16, 0)
                for i in range(n)]

    def test_fs_cascade_then_promotion(self):
        api, LR = self.api, self.api.LookupResult
        tier = vllm_tree.fs_tier(self.root.name, n_read_threads=2,
                                 n_write_threads=2)
        stats = []
        m = self.manager([tier])
        keys = self.keys(2)
        ctx = api.ReqContext(req_id="req-1")
        m.on_new_request(ctx)
        for k in keys:
            # Nothing anywhere yet: the fs tier answers asynchronously.
            r, _ = self.drive_until(m, k, ctx, (LR.MISS,), stats)
        out = m.prepare_store(keys, ctx)
        self.assertIsInstance(out, api.PrepareStoreOutput)
        self.assertEqual(list(out.keys_to_store), keys)
        self.step(m, new=["req-1"], stats=stats)
        m.complete_store(keys, ctx)  # cascades to the fs tier
        self.step(m, stats=stats)
        self.drain(m, stats)
        m.on_request_finished(ctx)
        self.step(m, stats=stats)
        for k in keys:
            self.assertIs(m.lookup(k, api.ReqContext(req_id="req-2")), LR.HIT)
        files = [f for _, _, fs in os.walk(self.root.name) for f in fs
                 if f.endswith(".bin")]
        self.assertEqual(len(files), len(keys), files)
        names = set()
        for s in stats:
            names.update(s.data.get("data", s.data).keys())
        if api.TieringMetricsTracker is not None:
            self.assertTrue(any("cascade" in n for n in names), sorted(names))

        # A second engine over the same directory: primary is empty, the fs
        # tier has the blocks, so lookup promotes them (RETRY/HIT_PENDING
        # first, HIT once the promotion job finished).
        m2 = self.manager([tier])
        ctx2 = api.ReqContext(req_id="req-3")
        m2.on_new_request(ctx2)
        for k in keys:
            r, seen = self.drive_until(m2, k, ctx2, (LR.HIT,), stats)
            self.assertNotEqual(seen[0], "HIT", seen)
            print(f"\n  promotion lookups: {seen}", file=sys.stderr)
        spec = m2.prepare_load(keys, ctx2)
        self.assertIsInstance(spec, api.LoadStoreSpec)
        m2.complete_load(keys, ctx2)
        m2.on_request_finished(ctx2)
        self.step(m2, stats=stats)

    def test_example_tier(self):
        api, LR = self.api, self.api.LookupResult
        m = self.manager([{"type": "example"}])
        stats = []
        keys = self.keys(3, seed=7)
        ctx = api.ReqContext(req_id="ex-1")
        m.on_new_request(ctx)
        for k in keys:
            self.drive_until(m, k, ctx, (LR.MISS,), stats)
        m.prepare_store(keys, ctx)
        self.step(m, new=["ex-1"], stats=stats)
        m.complete_store(keys, ctx)
        self.step(m, stats=stats)
        self.drain(m, stats)
        m.on_request_finished(ctx)
        self.step(m, stats=stats)
        self.assertIs(m.lookup(keys[0], api.ReqContext(req_id="ex-2")),
                      LR.HIT)


class WithoutTree(unittest.TestCase):
    def test_skip_reason_names_the_variable(self):
        env = {k: v for k, v in os.environ.items()
               if k != vllm_tree.SOURCE_ENV}
        env["PYTHONPATH"] = HERE
        out = subprocess.run(
            [sys.executable, "-c",
             "import vllm_tree; print(vllm_tree.skip_reason())"],
            env=env, capture_output=True, text=True, timeout=120, cwd=HERE)
        self.assertEqual(out.returncode, 0, out.stderr)
        if "installed" not in out.stdout and out.stdout.strip() != "None":
            self.assertIn(vllm_tree.SOURCE_ENV, out.stdout)
            self.assertIn("make test-vllm", out.stdout)


if __name__ == "__main__":
    unittest.main()
