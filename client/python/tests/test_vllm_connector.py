"""KvhostConnector (kvhost.vllm's KV connector) without vLLM: its
load-or-recompute split (the cost model, table-driven), its worker's
layer-wise waits (a stand-in client whose jobs end when the test says),
and both halves driven in vLLM's call order against a real kvhost daemon
with CPU tensors in shared memory: a prefix saved through the save path
is loaded into other blocks byte for byte, a corrupted file's blocks come
back as load errors, never as loaded bytes.

test_vllm_real_kvconnector.py runs the connector under vLLM's own
connector modules.

Run: cd client/python && PYTHONPATH=src /usr/bin/python3 -m unittest tests.test_vllm_connector -v
"""

import hashlib
import importlib.util
import os
import pathlib
import pickle
import time
import sys
import threading
import types
import unittest
from unittest import mock

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

import kvhost  # noqa: E402
from kvhost import protocol as P  # noqa: E402
from kvhost.vllm import connector as C  # noqa: E402
from kvhost.vllm._split import CostModel  # noqa: E402

import daemon as d  # noqa: E402

HAVE_TORCH = importlib.util.find_spec("torch") is not None
NS = types.SimpleNamespace

LAYERS, HEADS, HEAD, BLOCK, NBLOCKS, BPC = 4, 2, 64, 16, 64, 2
PAGE = HEADS * BLOCK * 2 * HEAD * 2   # bf16 (heads, block, 2*head) per block
CHUNK = BLOCK * BPC
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
LLAMA_BYTES_PER_TOKEN = 32 * 2 * 8 * 128 * 2  # Llama-3.1-8B's KV of one token, bf16


def offloading_config(socket, rank=0, tp=1, layout="blocks", **extra):
    """An object shaped like vLLM's OffloadingConfig (what the connector
    reads of it), for a model of LAYERS layers."""
    return NS(
        model=NS(name="meta-llama/Llama-3.1-8B", dtype="bfloat16"),
        parallel=NS(rank=rank, world_size=tp, tp_size=tp, pp_size=1, pcp_size=1, dcp_size=1,
                    is_parallelism_agnostic=False),
        groups=(NS(tokens_per_block=BLOCK, layer_names=tuple(NAMES)),),
        cache=NS(tokens_per_hash=BLOCK, blocks_per_chunk=BPC),
        worker_kv_bytes_per_block=LAYERS * PAGE, engine_id="kvhost-connector-test",
        canonical_layout=False, replicated_layout=False,
        extra_config={"socket": socket, "tensor_layout": layout, **extra})


def flip_byte(path, at):
    """Inverts the byte at offset at (from the end where negative) of a file."""
    fd = os.open(path, os.O_RDWR)
    try:
        off = at if at >= 0 else os.fstat(fd).st_size + at
        os.pwrite(fd, bytes([os.pread(fd, 1, off)[0] ^ 0xFF]), off)
    finally:
        os.close(fd)


def layer_caches(torch, closers, seed, nblocks=NBLOCKS, planes=False, cuda=False):
    """{layer name: tensor}: per-layer KV caches in FlashAttention's shape
    of vLLM's trees, (nblocks, heads, block, 2 * head) bf16, or with planes
    (2, nblocks, block, heads, head), in shared memory (closed by
    closers) or on the GPU (cuda), filled with random bits from seed."""
    kv = {}
    shape = (2, nblocks, BLOCK, HEADS, HEAD) if planes else (nblocks, HEADS, BLOCK, 2 * HEAD)
    for i, n in enumerate(NAMES):
        if cuda:
            t = torch.empty(shape, dtype=torch.bfloat16, device="cuda")
        else:
            t, buf = kvhost.torch_host_tensor(shape, torch.bfloat16, name="connector-test")
            closers.append(buf.close)
        bits = torch.randint(-2**15, 2**15, t.shape, generator=torch.Generator().manual_seed(seed + i),
                             dtype=torch.int16)
        t.view(torch.int16).copy_(bits.to(t.device))
        kv[n] = t
    return kv


def worker_step(worker, meta, finished, forward=None, layer_work=None):
    """A worker's step in vLLM's order (the model runner's and the attention
    layers' calls; layer_work(), where given, after each layer's load is
    waited for: the layer's computation; forward(), where given, after the
    last layer): (finished sending, load error block ids, worker meta)."""
    worker.handle_preemptions(meta)
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    for n in NAMES:
        worker.wait_for_layer_load(n)
        if layer_work is not None:
            layer_work()
        worker.save_kv_layer(n, None, None)
    if forward is not None:
        forward()
    worker.wait_for_save()
    sending, _ = worker.get_finished(set(finished))
    errors = worker.get_block_ids_with_load_errors()
    wm = worker.build_connector_worker_meta()
    worker.clear_connector_metadata()
    return sending, errors, wm


def hashes(tag, n):
    """vLLM-like chained block hashes of a prompt of n blocks."""
    out, prev = [], b""
    for i in range(n):
        prev = hashlib.sha256(prev + f"{tag}-{i}".encode()).digest()
        out.append(prev)
    return out


class Request:
    """What the connector's scheduler half reads of vLLM's Request."""

    def __init__(self, req_id, tag, blocks):
        self.request_id = req_id
        self.block_hashes = hashes(tag, blocks)
        self.num_prompt_tokens = self.num_tokens = blocks * BLOCK
        self.skip_reading_prefix_cache = False


def new_output(req, block_ids, computed, scheduled):
    """A scheduler output of one step scheduling a new request."""
    return NS(scheduled_new_reqs=[NS(req_id=req.request_id, block_ids=(list(block_ids),),
                                     num_computed_tokens=computed)],
              scheduled_cached_reqs=None, num_scheduled_tokens={req.request_id: scheduled},
              preempted_req_ids=set(), finished_req_ids=set())


def empty_output(finished=()):
    return NS(scheduled_new_reqs=[], scheduled_cached_reqs=None, num_scheduled_tokens={},
              preempted_req_ids=set(), finished_req_ids=set(finished))


class SplitTest(unittest.TestCase):
    """The cost model's choice of K, the tokens cached after the load."""

    def test_split_claims_all_at_fast_rates_part_at_slow_rates_and_never_beyond_the_hit(self):
        chunk = 256
        cases = [  # (prompt prefix P, GB/s, what K must be)
            (2048, 50.0, "all"), (8192, 50.0, "all"), (32768, 50.0, "all"),
            (2048, 2.0, "part"), (8192, 2.0, "part"), (32768, 2.0, "part"),
        ]
        for prefix, gbps, want in cases:
            with self.subTest(prefix=prefix, gbps=gbps):
                m = CostModel(LLAMA_BYTES_PER_TOKEN, gbps)
                total = prefix + 512
                k = m.split(total, 0, prefix, chunk)
                self.assertLessEqual(k, prefix)
                self.assertEqual(k % chunk, 0)
                recompute = m.compute_s(total, 0)
                if want == "all":
                    self.assertEqual(k, prefix)
                else:
                    self.assertGreater(k, 0)
                    self.assertLess(k, prefix)
                    self.assertLess(m.ttft_s(total, 0, k), recompute)
                    self.assertLess(m.ttft_s(total, 0, k), m.ttft_s(total, 0, prefix))

    def test_split_at_32k_from_a_2gbps_disk_is_at_most_0_8_of_recomputation(self):
        m = CostModel(LLAMA_BYTES_PER_TOKEN, 2.0)
        total = 32768 + 512
        k = m.split(total, 0, 32768, 256)
        self.assertLessEqual(m.ttft_s(total, 0, k), 0.8 * m.compute_s(total, 0))

    def test_split_never_claims_beyond_the_hit_or_below_the_gpu_prefix(self):
        m = CostModel(LLAMA_BYTES_PER_TOKEN, 1000.0)
        for computed, hit in [(0, 0), (512, 512), (512, 700), (0, 255), (256, 4096), (300, 4096)]:
            with self.subTest(computed=computed, hit=hit):
                k = m.split(8192, computed, hit, 256)
                self.assertGreaterEqual(k, computed)
                self.assertLessEqual(k, max(hit, computed))

    def test_split_is_the_largest_boundary_within_min_gain_of_the_least_and_recomputes_by_brute_force(self):
        import random
        r = random.Random(84)
        for _ in range(3000):
            gbps, chunk = r.choice([0.5, 2, 10, 50, 200]), r.choice([16, 256, 512])
            prefix, suffix = r.randrange(0, 40000), r.randrange(1, 4000)
            computed = r.randrange(0, prefix + 1) // 16 * 16
            hit, total = r.randrange(computed, prefix + 1), prefix + suffix
            m = CostModel(LLAMA_BYTES_PER_TOKEN, gbps)
            k = m.split(total, computed, hit, chunk)
            first, last = (computed // chunk + 1) * chunk, min(hit, total) // chunk * chunk
            cands = [computed] + list(range(first, last + 1, chunk))
            limit = min(min(m.ttft_s(total, computed, c) for c in cands) * (1 + m.min_gain), m.ttft_s(total, computed, computed))
            self.assertIn(k, cands)
            self.assertLessEqual(m.ttft_s(total, computed, k), limit * (1 + 1e-12))
            self.assertFalse([c for c in cands if c > k and m.ttft_s(total, computed, c) <= limit * (1 - 1e-12)],
                             (gbps, chunk, total, computed, hit, k))

    def test_measured_loads_move_the_rate_and_the_split(self):
        # A clock that stands still: the learned rate's recovery toward
        # load_gbps over time is not what this checks (on a loaded machine
        # the time between observing and reading moved it 0.0007 GB/s).
        m = CostModel(LLAMA_BYTES_PER_TOKEN, 50.0, alpha=0.5, clock=lambda: 0.0)
        before = m.split(32768 + 512, 0, 32768, 256)
        for _ in range(20):
            m.observe_load(2_000_000_000, 1.0)  # 2 GB/s measured
        self.assertAlmostEqual(m.load_gbps, 2.0, places=3)
        self.assertLess(m.split(32768 + 512, 0, 32768, 256), before)

    def test_bad_cost_options_are_refused_by_name(self):
        for key, value in [("load_gbps", 0), ("prefill_us_per_token", -1), ("layers_per_load", 0),
                           ("layer_groups", "odd"), ("load_split", "some"), ("tensor_layout", "rows"), ("no_such_option", 1),
                           ("daemon_wait_s", 0), ("daemon_wait_s", float("inf")), ("load_gbps", 1e12),
                           ("load_rate_recover_s", float("inf")),
                           ("salt_namespaces", {"salt": "a name"}), ("salt_namespaces", ["salt"])]:
            with self.subTest(key=key):
                with self.assertRaisesRegex(ValueError, key):
                    C.options({"socket": "/nonexistent", key: value})


class _FakeJob:
    """A daemon job that ends when the test says (done/wait like Job)."""

    def __init__(self, client, n, layers):
        self._client, self.id, self.layers, self.n = client, 1, layers, n
        self._ev = threading.Event()

    def finish(self):
        self._ev.set()

    def done(self):
        return self._ev.is_set()

    def wait(self, timeout=None):
        if not self._ev.wait(timeout):
            raise TimeoutError("not done")
        return kvhost.client.Result([(P.OUTCOME_LOADED, 0)] * self.n, 1000 * self.n, 1, "")

    def cancel(self):
        return False


class _FakeClient:
    """A client whose loads of a layer range are jobs the test ends."""
    supports_layer_loads = True

    def __init__(self):
        self.jobs = []

    def connected(self):
        return True

    def load(self, cache, keys, blocks, block=True, layers=None):
        j = _FakeJob(self, len(keys), layers)
        self.jobs.append(j)
        return j

    def prepare_load(self, cache, keys, blocks):
        return (cache, keys, blocks)

    def load_prepared(self, prepared, layers, block=True):
        return self.load(*prepared, block=block, layers=layers)


class PrefillTimingTest(unittest.TestCase):
    """The scheduler learns its prefill model's scale from the forward
    passes the workers time."""

    def test_worker_metas_join_each_steps_slower_pass_and_pickle(self):
        a = C.WorkerMeta(10, 1.0, [1], [(5, 0.2), (6, 0.1)])
        b = C.WorkerMeta(20, 2.0, [2], [(5, 0.3)])
        got = pickle.loads(pickle.dumps(a.aggregate(b)))
        self.assertEqual((got.nbytes, got.seconds, got.steps, got.loaders), (30, 2.0, (1, 2), 2))
        self.assertEqual(got.computes, ((5, 0.3), (6, 0.1)))

    def test_tensor_parallel_ranks_latencies_teach_one_measurement_per_step(self):
        # Eight ranks each measure step 1's latency: the split takes the
        # slowest rank's once, as it takes the step's rate once.
        cls = C.connector_class(NS(KVConnectorBase_V1=None))
        sched = cls(None, "scheduler", config=offloading_config("/nonexistent", load_rate_alpha=0.2,
                                                                load_latency_ms=1.0))
        self.addCleanup(sched.shutdown)
        joined = C.WorkerMeta(10**9, 1.0, [1], latencies=[(1, 0.15)])
        for i in range(7):
            joined = joined.aggregate(C.WorkerMeta(10**9, 1.0, [1], latencies=[(1, 0.1 + i / 1000)]))
        joined = pickle.loads(pickle.dumps(joined))
        self.assertEqual(joined.latencies, ((1, 0.15),))
        sched.update_connector_output(NS(kv_connector_worker_meta=joined, finished_sending=None))
        self.assertEqual(sched.cost_model.latency_observed, 1)
        self.assertAlmostEqual(sched.cost_model.load_latency_s, 0.001 + 0.2 * (0.15 - 0.001), places=4)

    def test_tensor_parallel_ranks_loads_teach_one_workers_rate(self):
        # Two ranks, each 1 GB in 1 s: the split's rate is one worker's,
        # 1 GB/s, not the joined bytes' 2 (which over-claimed at TP=2).
        cls = C.connector_class(NS(KVConnectorBase_V1=None))
        sched = cls(None, "scheduler", config=offloading_config("/nonexistent", load_rate_alpha=1.0))
        self.addCleanup(sched.shutdown)
        one = C.WorkerMeta(10**9, 1.0, [1])
        joined = pickle.loads(pickle.dumps(one.aggregate(C.WorkerMeta(10**9, 1.0, [1]))))
        sched.update_connector_output(NS(kv_connector_worker_meta=joined, finished_sending=None))
        self.assertAlmostEqual(sched.cost_model.load_gbps, 1.0, places=3)
        sched.update_connector_output(NS(kv_connector_worker_meta=C.WorkerMeta(10**9, 0.5, [2]),
                                         finished_sending=None))
        self.assertAlmostEqual(sched.cost_model.load_gbps, 2.0, places=3, msg="one worker alone: its own rate")

    def test_a_timed_pass_moves_the_prefill_scale(self):
        cls = C.connector_class(NS(KVConnectorBase_V1=None))
        sched = cls(None, "scheduler", config=offloading_config("/nonexistent"))  # connects later
        self.addCleanup(sched.shutdown)
        req = Request("r", "prefill", 512)  # 8,192 tokens: a pass the model prices at ~0.2 s
        meta = sched.build_connector_meta(new_output(req, list(range(512)), 0, req.num_tokens))
        modelled = sched.cost_model.compute_s(req.num_tokens, 0)
        # Taken at the next output (1.0 until then), once; a step reported
        # again after, or never built, is ignored.
        for step, seconds, scale in [(meta.step, 2 * modelled, 1.0), (meta.step, 2 * modelled, 1.0 + 0.2),
                                     (meta.step, 4 * modelled, 1.2), (99, 0.5, 1.2), (99, 0.5, 1.2)]:
            sched.update_connector_output(NS(kv_connector_worker_meta=C.WorkerMeta(computes=[(step, seconds)]),
                                             finished_sending=None))
            self.assertAlmostEqual(sched.counters()["prefill_scale"], scale, places=6)
        self.assertEqual(sched.counters()["compute_measurements"], 1)

    def test_a_slower_ranks_pass_in_the_next_output_counts(self):
        # Pipeline stages' passes end one after the other: the slower
        # stage's report of a step can come an output later.
        cls = C.connector_class(NS(KVConnectorBase_V1=None))
        sched = cls(None, "scheduler", config=offloading_config("/nonexistent"))
        self.addCleanup(sched.shutdown)
        req = Request("r", "prefill", 512)
        meta = sched.build_connector_meta(new_output(req, list(range(512)), 0, req.num_tokens))
        modelled = sched.cost_model.compute_s(req.num_tokens, 0)
        for seconds in (modelled, 3 * modelled):
            sched.update_connector_output(NS(kv_connector_worker_meta=C.WorkerMeta(computes=[(meta.step, seconds)]),
                                             finished_sending=None))
        self.assertAlmostEqual(sched.counters()["prefill_scale"], 1.0 + 0.2 * (3 - 1), places=6)
        self.assertEqual(sched.counters()["compute_measurements"], 1)


class LayerWaitTest(unittest.TestCase):
    """The worker's waits per layer group, against a stand-in client."""

    def worker(self, layers_per_load, layer_groups="even", **extra):
        o = C.options({"socket": "/nonexistent", "layers_per_load": layers_per_load, "layer_groups": layer_groups,
                       **extra})
        cfg = offloading_config("/nonexistent")
        w = C.ConnectorWorker(cfg, C.identity(cfg, o), o)
        w._client, w._caches, w._nblocks, w._tensors = _FakeClient(), {(None, 0): 1}, NBLOCKS, []
        return w

    def test_a_layer_waits_only_for_its_own_group_job(self):
        w = self.worker(1)
        meta = C.ConnectorMetadata(loads=[C.Transfer("r", [b"k0", b"k1"], [[0, 1], [2, 3]])])
        w.start_load(meta)
        jobs = w._client.jobs
        self.assertEqual([j.layers for j in jobs], [(i, 1) for i in range(LAYERS)])
        jobs[0].finish()
        w.wait_layer(NAMES[0])  # returns: layer 0's job is done, the others are not
        self.assertEqual([j.done() for j in jobs], [True] + [False] * (LAYERS - 1))
        for i in range(1, LAYERS):
            jobs[i].finish()
            w.wait_layer(NAMES[i])
        self.assertEqual(w.take_errors(), set())

    def test_a_step_naming_a_block_outside_the_cache_sends_no_load_and_fails_its_blocks(self):
        cases = [  # block lists of the step's keys, whether they load
            ([[0, 1], [2, 3]], True),
            ([[0, P.NO_BLOCK], [P.NO_BLOCK, 3]], True),
            ([[0, 1], [2, NBLOCKS]], False),  # past the cache
            ([[0, -1]], False),
            ([[P.NO_BLOCK, 99]], False),
        ]
        for blocks, loads in cases:
            with self.subTest(blocks=blocks):
                w = self.worker(4)
                keys = [f"k{i}".encode() for i in range(len(blocks))]
                w.start_load(C.ConnectorMetadata(loads=[C.Transfer("r", keys, blocks)]))
                self.assertEqual(bool(w._client.jobs), loads)
                for j in w._client.jobs:
                    j.finish()
                w.finish_loads()
                want = set() if loads else {x for b in blocks for x in b if x != P.NO_BLOCK}
                self.assertEqual(w.take_errors(), want)

    def test_layers_per_load_groups_layers_into_one_job(self):
        w = self.worker(2)
        w.start_load(C.ConnectorMetadata(loads=[C.Transfer("r", [b"k0"], [[0, 1]])]))
        self.assertEqual([j.layers for j in w._client.jobs], [(0, 2), (2, 2)])
        w._client.jobs[0].finish()
        w.wait_layer(NAMES[1])
        self.assertFalse(w._client.jobs[1].done())
        w._client.jobs[1].finish()
        w.finish_loads()

    def test_a_ramp_loads_the_first_and_last_layers_alone(self):
        w = self.worker(2, "ramp")
        w.start_load(C.ConnectorMetadata(loads=[C.Transfer("r", [b"k0"], [[0, 1]])]))
        jobs = w._client.jobs
        self.assertEqual([j.layers for j in jobs], [(0, 1), (1, 2), (3, 1)])
        jobs[0].finish()
        w.wait_layer(NAMES[0])  # layer 0 waits for its one-layer job only
        self.assertEqual([j.done() for j in jobs], [True, False, False])
        jobs[1].finish()
        w.wait_layer(NAMES[2])  # layers 1 and 2 share a job
        self.assertFalse(jobs[2].done())
        jobs[2].finish()
        w.wait_layer(NAMES[3])
        w.finish_loads()
        self.assertEqual(w.take_errors(), set())

    def test_layer_groups_cover_every_layer_once_in_order(self):
        cases = [  # layers, per load, shape, want
            (32, 4, "ramp", [(0, 1)] + [(f, 4) for f in range(1, 29, 4)] + [(29, 2), (31, 1)]),
            (32, 4, "even", [(f, 4) for f in range(0, 32, 4)]),
            (32, 1, "ramp", [(f, 1) for f in range(32)]),
            (2, 4, "ramp", [(0, 2)]),
            (3, 4, "ramp", [(0, 1), (1, 1), (2, 1)]),
            (5, 8, "ramp", [(0, 1), (1, 3), (4, 1)]),
            (1, 1, "ramp", [(0, 1)]),
        ]
        for layers, per, shape, want in cases:
            with self.subTest(layers=layers, per=per, shape=shape):
                got = C.layer_groups(layers, per, shape)
                self.assertEqual(got, want)
                self.assertEqual([l for f, n in got for l in range(f, f + n)], list(range(layers)))

    def test_a_step_without_loads_has_its_forward_pass_timed(self):
        w = self.worker(4)
        w.start_load(C.ConnectorMetadata(step=3))  # nothing to load: the pass is timed
        w.end_pass()
        w.start_load(C.ConnectorMetadata(loads=[C.Transfer("r", [b"k0"], [[0, 1]])], step=4))
        for j in w._client.jobs:
            j.finish()
        w.end_pass()  # a pass with loads waits for them: not a measure of compute
        w.finish_loads()
        wm = w.worker_meta()
        self.assertEqual([s for s, _ in wm.computes], [3])
        self.assertGreaterEqual(wm.computes[0][1], 0.0)
        self.assertEqual(wm.steps, (4,))
        self.assertIsNone(w.worker_meta())  # reported once

    def test_a_daemon_without_layer_loads_gets_one_job_for_every_layer(self):
        for shape in ("even", "ramp"):
            with self.subTest(shape=shape):
                w = self.worker(1, layer_groups=shape)
                w._client.supports_layer_loads = False
                w.start_load(C.ConnectorMetadata(loads=[C.Transfer("r", [b"k0"], [[0, 1]])]))
                self.assertEqual([j.layers for j in w._client.jobs], [None])
                w._client.jobs[0].finish()
                for n in NAMES:
                    w.wait_layer(n)
                self.assertEqual(w.take_errors(), set())

    def test_a_load_not_ended_within_daemon_wait_s_is_given_up_and_its_request_reported_once_it_ends(self):
        w = self.worker(1, daemon_wait_s=0.2)
        w.start_load(C.ConnectorMetadata(loads=[C.Transfer("r", [b"k0", b"k1"], [[0, 1], [2, 3]])]))
        jobs = w._client.jobs
        for n in NAMES:  # the first group waits 0.2 s, the later ones are not waited for
            w.wait_layer(n)
        self.assertEqual(w.take_errors(), {0, 1, 2, 3})
        self.assertEqual(w.finished({"r"}), set(), "reported while the daemon may still write its blocks")
        for j in jobs[:-1]:
            j.finish()
        self.assertEqual(w.finished(set()), set())
        jobs[-1].finish()
        self.assertEqual(w.finished(set()), {"r"})
        self.assertEqual(w.counters()["load_given_up_jobs"], LAYERS)
        # What the given-up jobs were to move, over the time they had: the
        # split's load rate learns that this mount is at most that fast.
        wm = w.worker_meta()
        self.assertEqual(wm.nbytes, 4 * LAYERS * w._ident["page_bytes"])  # 4 pages in every layer
        self.assertGreaterEqual(wm.seconds, 0.2)

    def test_a_request_whose_loads_ended_is_reported_once_it_finishes(self):
        w = self.worker(1)
        w.start_load(C.ConnectorMetadata(loads=[C.Transfer("r", [b"k0"], [[0, 1]])]))
        for j in w._client.jobs:
            j.finish()
        w.finish_loads()
        self.assertEqual(w.finished(set()), set(), "reported before vLLM finished it")
        self.assertEqual(w.finished({"r"}), {"r"})

    def test_metadata_pickles(self):
        meta = C.ConnectorMetadata(loads=[C.Transfer("r", [b"k"], [[1, P.NO_BLOCK]], "tenant-a")],
                                   saves=[C.Transfer("s", [b"j"], [[2, 3]])], preempted={"x"})
        got = pickle.loads(pickle.dumps(meta))
        self.assertEqual((got.loads[0].keys, got.loads[0].blocks, got.loads[0].ns, got.saves[0].req_id,
                          got.saves[0].ns, got.preempted),
                         ([b"k"], [[1, P.NO_BLOCK]], "tenant-a", "s", None, {"x"}))


@unittest.skipUnless(HAVE_TORCH, "needs torch (CPU)")
class DaemonTest(unittest.TestCase):
    """Both halves against a real daemon, CPU tensors in shared memory."""

    @classmethod
    def setUpClass(cls):
        import torch
        cls.torch = torch
        cls.daemon = d.Daemon()
        cls.Connector = C.connector_class(NS(KVConnectorBase_V1=None))

    @classmethod
    def tearDownClass(cls):
        cls.daemon.stop()

    cuda = False  # the KV caches on the GPU

    def setUp(self):
        self.closers = []
        # The workers observe no vLLM (as where none is installed), though a
        # vLLM tree loaded by another test module in this process is importable.
        from kvhost.vllm import spec_worker
        p = mock.patch.object(spec_worker, "observe_layout", lambda groups: None)
        p.start()
        self.closers.append(p.stop)

    def tearDown(self):
        for c in reversed(self.closers):
            c()

    def pair(self, seed=0, planes=False, **extra):
        cfg = offloading_config(self.daemon.socket, layout="planes" if planes else "blocks", **extra)
        sched = self.Connector(None, "scheduler", config=cfg)
        self.closers.append(sched.shutdown)
        worker = self.Connector(None, "worker", config=cfg)
        self.closers.append(worker.shutdown)
        kv = layer_caches(self.torch, self.closers, seed, planes=planes, cuda=self.cuda)
        worker.register_kv_caches(kv)
        return sched, worker, kv

    def step(self, sched, worker, so, finished=()):
        """One engine step in vLLM's order; returns (finished sending,
        load error block ids)."""
        meta = sched.build_connector_meta(so)
        meta = pickle.loads(pickle.dumps(meta))  # it travels to the workers
        sending, errors, wm = worker_step(worker, meta, finished)
        sched.update_connector_output(NS(kv_connector_worker_meta=wm, finished_sending=sending))
        return sending or set(), errors

    def save_prompt(self, sched, worker, req, ids):
        """A request computed in blocks ids, its prompt saved through the
        save path; returns once its stores ended and vLLM may free it."""
        self.assertEqual(sched.get_num_new_matched_tokens(req, 0), (0, False))
        sched.update_state_after_alloc(req, ids, 0)
        self.step(sched, worker, new_output(req, ids, 0, req.num_tokens))
        self.assertEqual(sched.request_finished(req, ids), (True, None))
        sent = set()
        d.wait_for(lambda: sent.update(self.step(sched, worker, empty_output(), {req.request_id})[0]) or
                   req.request_id in sent, what="the prompt's stores")

    def rows(self, kv, blocks, planes=False):
        i8 = self.torch.int8
        if planes:
            return [bytes(kv[n][p, b].view(i8).numpy().tobytes()) for n in NAMES for p in (0, 1) for b in blocks]
        return [bytes(kv[n][b].view(i8).numpy().tobytes()) for n in NAMES for b in blocks]

    def test_a_saved_prefix_loads_layer_by_layer_into_other_blocks_byte_for_byte(self):
        for planes in (False, True):
            with self.subTest(planes=planes):
                sched, worker, kv = self.pair(seed=7 * planes, planes=planes, load_split="all", layers_per_load=1)
                nblk = 4 * BPC + 1  # four whole chunks and a block more
                src = list(range(1, 1 + nblk))
                tag = f"p1-{planes}"
                self.save_prompt(sched, worker, Request("a", tag, nblk), src)
                want = self.rows(kv, src[:4 * BPC], planes)

                req = Request("b", tag, nblk)
                self.assertEqual(sched.get_num_new_matched_tokens(req, 0), (4 * CHUNK, False))
                dst = list(range(30, 30 + nblk))
                sched.update_state_after_alloc(req, dst, 4 * CHUNK)
                _, errors = self.step(sched, worker, new_output(req, dst, 4 * CHUNK, BLOCK))
                self.assertEqual(errors, set())
                self.assertEqual(self.rows(kv, dst[:4 * BPC], planes), want)
                c = worker.counters()
                # One job per layer where the daemon loads layer ranges, else one for all.
                self.assertEqual(c["load_jobs"], LAYERS if c["layer_loads"] else 1)
                self.assertEqual(c.get("load_failed_keys", 0), 0)
                self.assertGreater(sched.counters()["load_measurements"], 0)

    def test_a_steps_load_jobs_hold_as_many_layers_as_the_learned_rate_moves_in_a_job(self):
        # A fast mount's jobs hold layers_per_load layers (ramp: 1, 2, 1
        # of 4 layers); a mount so slow that one layer outlasts
        # load_job_ms gets a job per layer.
        for gbps, jobs in ((1e6, 3), (1e-7, LAYERS)):
            with self.subTest(gbps=gbps):
                sched, worker, kv = self.pair(seed=5, load_split="all", layers_per_load=2, load_gbps=gbps,
                                              load_rate_recover_s=0)
                nblk = 2 * BPC + 1
                src = list(range(1, 1 + nblk))
                tag = f"sized-{gbps}"
                self.save_prompt(sched, worker, Request("a", tag, nblk), src)
                want = self.rows(kv, src[:2 * BPC])
                req = Request("b", tag, nblk)
                self.assertEqual(sched.get_num_new_matched_tokens(req, 0), (2 * CHUNK, False))
                dst = list(range(30, 30 + nblk))
                sched.update_state_after_alloc(req, dst, 2 * CHUNK)
                before = worker.counters().get("load_jobs", 0)
                meta = pickle.loads(pickle.dumps(sched.build_connector_meta(new_output(req, dst, 2 * CHUNK, BLOCK))))
                _, errors, _ = worker_step(worker, meta, ())
                self.assertEqual(errors, set())
                self.assertEqual(self.rows(kv, dst[:2 * BPC]), want)
                if not worker.counters()["layer_loads"]:
                    self.skipTest("the daemon loads no layer ranges")
                self.assertEqual(meta.layers_per_load, 2 if jobs == 3 else 1)
                self.assertEqual(worker.counters()["load_jobs"] - before, jobs)

    def test_the_measured_load_time_leaves_out_the_work_between_layers(self):
        # The split's rate is the daemon's: a worker held between layers
        # (its forward pass, host work) must not make the mount look slow.
        sched, worker, kv = self.pair(seed=3, load_split="all", layers_per_load=1)
        nblk = 2 * BPC + 1  # two whole chunks and a block more
        src = list(range(1, 1 + nblk))
        self.save_prompt(sched, worker, Request("a", "held", nblk), src)
        req = Request("b", "held", nblk)
        self.assertEqual(sched.get_num_new_matched_tokens(req, 0), (2 * CHUNK, False))
        dst = list(range(30, 30 + nblk))
        sched.update_state_after_alloc(req, dst, 2 * CHUNK)
        meta = pickle.loads(pickle.dumps(sched.build_connector_meta(new_output(req, dst, 2 * CHUNK, BLOCK))))
        hold = 0.2  # each layer's computation, seconds
        _, errors, wm = worker_step(worker, meta, (), layer_work=lambda: time.sleep(hold))
        self.assertEqual(errors, set())
        c = worker.counters()
        if not c["layer_loads"]:
            self.skipTest("the daemon loads no layer ranges: one job, waited for at the first layer")
        self.assertGreater(wm.nbytes, 0)
        # The last layer's wait returned after (LAYERS - 1) holds; the
        # daemon's jobs took a small part of that.
        self.assertLess(wm.seconds, (LAYERS - 1) * hold / 2, wm.seconds)

    def test_pages_whose_dimensions_vllm_permuted_load_byte_for_byte(self):
        # vLLM's NHD layout: a block's memory is (block, heads, 2 * head), the
        # tensor's dimensions (heads, block, 2 * head): one extent, permuted.
        cfg = offloading_config(self.daemon.socket, load_split="all")
        sched = self.Connector(None, "scheduler", config=cfg)
        worker = self.Connector(None, "worker", config=cfg)
        self.closers += [sched.shutdown, worker.shutdown]
        raw = layer_caches(self.torch, self.closers, 21)  # (blocks, heads, block, 2 * head) memory
        kv = {n: r.view(NBLOCKS, BLOCK, HEADS, 2 * HEAD).permute(0, 2, 1, 3) for n, r in raw.items()}
        self.assertFalse(kv[NAMES[0]][0].is_contiguous())
        worker.register_kv_caches(kv)
        nblk = 2 * BPC + 1
        src = list(range(1, 1 + nblk))
        self.save_prompt(sched, worker, Request("a", "p10", nblk), src)
        want = self.rows(raw, src[:2 * BPC])
        req, dst = Request("b", "p10", nblk), list(range(40, 40 + nblk))
        self.assertEqual(sched.get_num_new_matched_tokens(req, 0), (2 * CHUNK, False))
        sched.update_state_after_alloc(req, dst, 2 * CHUNK)
        _, errors = self.step(sched, worker, new_output(req, dst, 2 * CHUNK, BLOCK))
        self.assertEqual(errors, set())
        self.assertEqual(self.rows(raw, dst[:2 * BPC]), want)

    def test_tensors_of_another_layout_are_refused_naming_the_option(self):
        cfg = offloading_config(self.daemon.socket, layout="planes")
        worker = self.Connector(None, "worker", config=cfg)
        self.closers.append(worker.shutdown)
        kv = layer_caches(self.torch, self.closers, 0)
        with self.assertRaisesRegex(ValueError, 'tensor_layout "blocks"'):
            worker.register_kv_caches(kv)

    def test_a_gpu_prefix_hit_loads_only_the_blocks_after_it(self):
        sched, worker, kv = self.pair(load_split="all")
        nblk = 3 * BPC + 1
        src = list(range(1, 1 + nblk))
        self.save_prompt(sched, worker, Request("a", "p2", nblk), src)
        want = self.rows(kv, src[1:3 * BPC])
        req = Request("b", "p2", nblk)
        computed = BLOCK  # one block on the GPU (vLLM's prefix cache)
        self.assertEqual(sched.get_num_new_matched_tokens(req, computed), (3 * CHUNK - computed, False))
        dst = [1] + list(range(40, 40 + nblk - 1))
        before = self.rows(kv, [1])
        sched.update_state_after_alloc(req, dst, 3 * CHUNK - computed)
        _, errors = self.step(sched, worker, new_output(req, dst, 3 * CHUNK, BLOCK))
        self.assertEqual(errors, set())
        self.assertEqual(self.rows(kv, dst[1:3 * BPC]), want)
        self.assertEqual(self.rows(kv, [1]), before)

    def test_the_keys_to_load_stay_pinned_until_the_workers_loaded_them(self):
        sched, worker, _ = self.pair(load_split="all")
        nblk = 2 * BPC + 1
        self.save_prompt(sched, worker, Request("a", "p6", nblk), list(range(1, 1 + nblk)))
        req = Request("b", "p6", nblk)
        self.assertEqual(sched.get_num_new_matched_tokens(req, 0), (2 * CHUNK, False))
        dst = list(range(20, 20 + nblk))
        sched.update_state_after_alloc(req, dst, 2 * CHUNK)
        meta = sched.build_connector_meta(new_output(req, dst, 2 * CHUNK, BLOCK))
        self.assertEqual(sched.counters()["pinned_steps"], 1)
        sending, errors, wm = worker_step(worker, meta, ())
        self.assertEqual((errors, wm.steps), (set(), (meta.step,)))
        sched.update_connector_output(NS(kv_connector_worker_meta=wm, finished_sending=sending))
        self.assertEqual(sched.counters()["pinned_steps"], 0)

    def test_stores_go_once_the_gpu_passed_the_forward_and_hold_the_blocks_until_then(self):
        sched, worker, _ = self.pair()
        gate = threading.Event()
        mark = NS(synchronize=gate.wait)  # a CUDA event the GPU has not passed yet
        worker._worker._mark = lambda: mark
        nblk = 2 * BPC + 1
        req = Request("a", "p7", nblk)
        ids = list(range(1, 1 + nblk))
        self.assertEqual(sched.get_num_new_matched_tokens(req, 0), (0, False))
        sched.update_state_after_alloc(req, ids, 0)
        self.step(sched, worker, new_output(req, ids, 0, req.num_tokens))
        self.assertEqual(sched.request_finished(req, ids), (True, None))
        sending, _ = self.step(sched, worker, empty_output(), {"a"})
        self.assertEqual(sending, set())  # not sent: vLLM must keep the blocks
        self.assertEqual(worker.counters()["stores_unsent"], 1)
        gate.set()
        sent = set()
        d.wait_for(lambda: sent.update(self.step(sched, worker, empty_output())[0]) or "a" in sent,
                   what="a's stores")
        self.assertEqual(worker.counters()["stored_keys"], 2)
        self.assertEqual(sched._scheduler.hit_tokens(Request("b", "p7", nblk), 0), 2 * CHUNK)

    def test_a_preempted_requests_stores_end_before_handle_preemptions_returns(self):
        sched, worker, _ = self.pair()
        gate = threading.Event()
        worker._worker._mark = lambda: NS(synchronize=gate.wait)
        nblk = 2 * BPC + 1
        req, ids = Request("a", "p8", nblk), list(range(1, 1 + nblk))
        sched.get_num_new_matched_tokens(req, 0)
        sched.update_state_after_alloc(req, ids, 0)
        meta = sched.build_connector_meta(new_output(req, ids, 0, req.num_tokens))
        worker_step(worker, meta, ())
        self.assertEqual(worker.counters()["stores_unsent"], 1)
        opener = threading.Thread(target=lambda: d.wait_for(lambda: worker.counters()["stores_unsent"]) and gate.set())
        opener.start()
        worker.handle_preemptions(C.ConnectorMetadata(preempted={"a"}))
        opener.join()
        c = worker.counters()
        self.assertEqual((c["stores_unsent"], c["stores_in_flight"], c["stored_keys"]), (0, 0, 2))

    def test_after_a_daemon_restart_both_halves_connect_again_and_load_what_was_saved(self):
        sched, worker, kv = self.pair(seed=11, load_split="all", reconnect_s=0.05)
        nblk = 2 * BPC + 1
        src = list(range(1, 1 + nblk))
        self.save_prompt(sched, worker, Request("a", "p9", nblk), src)
        want = self.rows(kv, src[:2 * BPC])
        self.daemon.halt()
        self.daemon.start_again()
        req = Request("b", "p9", nblk)
        d.wait_for(lambda: sched.get_num_new_matched_tokens(req, 0) == (2 * CHUNK, False),
                   what="the scheduler's hit on the new daemon")
        def on_new_daemon():  # vLLM's steps call get_finished, every step
            worker.get_finished(set())
            return worker.counters()["connected"]
        d.wait_for(on_new_daemon, what="the worker on the new daemon")
        dst = list(range(40, 40 + nblk))
        sched.update_state_after_alloc(req, dst, 2 * CHUNK)
        _, errors = self.step(sched, worker, new_output(req, dst, 2 * CHUNK, BLOCK))
        self.assertEqual(errors, set())
        self.assertEqual(self.rows(kv, dst[:2 * BPC]), want)
        self.assertGreaterEqual(sched.counters()["reconnects"], 1)

    def test_a_corrupted_file_comes_back_as_load_errors_never_as_loaded_bytes(self):
        sched, worker, kv = self.pair(load_split="all")
        nblk = 2 * BPC + 1
        src = list(range(1, 1 + nblk))
        self.save_prompt(sched, worker, Request("a", "p3", nblk), src)
        files = self.daemon.data_files()
        self.assertTrue(files)
        for f in files:
            flip_byte(f, -100)
        try:
            req = Request("b", "p3", nblk)
            self.assertEqual(sched.get_num_new_matched_tokens(req, 0), (2 * CHUNK, False))
            dst = list(range(50, 50 + nblk))
            sched.update_state_after_alloc(req, dst, 2 * CHUNK)
            _, errors = self.step(sched, worker, new_output(req, dst, 2 * CHUNK, BLOCK))
            self.assertTrue(errors)
            self.assertLessEqual(errors, set(dst[:2 * BPC]))
            self.assertGreater(worker.counters()["load_failed_keys"], 0)
        finally:
            for f in files:  # leave no corrupt file to the next test
                if os.path.exists(f):
                    os.unlink(f)

    def test_a_request_without_saves_is_freed_at_once(self):
        sched, worker, _ = self.pair(save=False)
        req = Request("c", "p4", 2 * BPC + 1)
        self.assertEqual(sched.get_num_new_matched_tokens(req, 0), (0, False))
        sched.update_state_after_alloc(req, list(range(1, 2 * BPC + 2)), 0)
        self.step(sched, worker, new_output(req, list(range(1, 2 * BPC + 2)), 0, req.num_tokens))
        self.assertEqual(sched.request_finished(req, []), (False, None))

    def test_a_prompt_of_more_keys_than_a_request_takes_is_looked_up_in_parts(self):
        sched, worker, _ = self.pair()
        nblk = (P.MAX_KEYS_PER_REQUEST + 3) * BPC  # more keys than one lookup may name
        req, asked = Request("e", "p11", nblk), []

        def lookup(client, ns, keys):  # every key held
            asked.append(len(keys))
            return len(keys)

        def lookup_digests(client, ns, keys, digests):  # the keys' digests, hashed once
            self.assertEqual(len(digests), 16 * len(keys))
            return lookup(client, ns, keys)
        with mock.patch.object(kvhost.Client, "lookup", lookup), \
                mock.patch.object(kvhost.Client, "lookup_digests", lookup_digests):
            hit = sched._scheduler.hit_tokens(req, 0)
        keys = P.MAX_KEYS_PER_REQUEST + 3 - 1  # vLLM computes the prompt's last token: its key is not claimed
        self.assertEqual((hit, asked), (keys * CHUNK, [P.MAX_KEYS_PER_REQUEST, 2]))

    def test_load_split_off_claims_nothing(self):
        sched, worker, _ = self.pair(load_split="off")
        req = Request("d", "p5", 2 * BPC + 1)
        self.assertEqual(sched.get_num_new_matched_tokens(req, 0), (0, False))

    def test_the_connector_asks_for_piecewise_cuda_graphs(self):
        self.assertTrue(self.Connector.requires_piecewise_for_cudagraph({}))


def _cuda():
    """Why the GPU tests cannot run here (None where they can)."""
    if not HAVE_TORCH:
        return "needs torch with CUDA"
    import torch
    return None if torch.cuda.is_available() else "needs a CUDA GPU"


NO_GPU = _cuda()


@unittest.skipUnless(NO_GPU is None, NO_GPU or "")
class GpuTest(DaemonTest):
    """The same with CUDA KV caches, registered by CUDA IPC with a daemon
    serving GPU memory (a kvhost built with cgo: $KVHOST_BIN)."""

    @classmethod
    def setUpClass(cls):
        import torch
        cls.torch = torch
        cls.daemon = d.Daemon(capacity="4GiB", extra_toml='[gpu]\nmode = "on"\n')
        cls.Connector = C.connector_class(NS(KVConnectorBase_V1=None))

    cuda = True

    def rows(self, kv, blocks, planes=False):
        self.torch.cuda.synchronize()
        return [bytes(r) for r in super().rows({n: t.cpu() for n, t in kv.items()}, blocks, planes)]

    def test_a_store_reads_what_the_forward_pass_wrote_after_gpu_work_queued_before_it(self):
        sched, worker, kv = self.pair(seed=3)
        torch = self.torch
        nblk = 2 * BPC + 1
        req = Request("a", "gpu-late", nblk)
        ids = list(range(1, 1 + nblk))
        early, fill = (torch.full((BLOCK,), v, dtype=torch.int16, device="cuda") for v in (5, 7))

        def write(value):
            for t in kv.values():
                t.view(torch.int16)[1:1 + nblk].view(-1, BLOCK).copy_(value)
        write(early)  # the kernels loaded (a lazy module load waits for the GPU), the blocks 5s
        torch.cuda.synchronize()

        def forward():  # 0.2 s of GPU work, then the layers' KV written (7s): after wait_for_save returns
            torch.cuda._sleep(400_000_000)
            write(fill)
        self.assertEqual(sched.get_num_new_matched_tokens(req, 0), (0, False))
        sched.update_state_after_alloc(req, ids, 0)
        meta = sched.build_connector_meta(new_output(req, ids, 0, req.num_tokens))
        sending, errors, wm = worker_step(worker, meta, (), forward)
        self.assertFalse(torch.cuda.current_stream().query(), "the GPU work ended before wait_for_save returned")
        sched.update_connector_output(NS(kv_connector_worker_meta=wm, finished_sending=sending))
        self.assertEqual(sched.request_finished(req, ids), (True, None))
        sent = set()
        d.wait_for(lambda: sent.update(self.step(sched, worker, empty_output(), {"a"})[0]) or "a" in sent,
                   what="a's stores")
        want = self.rows(kv, ids[:2 * BPC])
        self.assertTrue(all(r == b"\x07\x00" * (len(r) // 2) for r in want))  # the forward's 7s
        dst = list(range(30, 30 + nblk))
        again = Request("b", "gpu-late", nblk)
        sched2 = self.Connector(None, "scheduler", config=offloading_config(self.daemon.socket, load_split="all"))
        self.closers.append(sched2.shutdown)
        self.assertEqual(sched2.get_num_new_matched_tokens(again, 0), (2 * CHUNK, False))
        sched2.update_state_after_alloc(again, dst, 2 * CHUNK)
        _, errors = self.step(sched2, worker, new_output(again, dst, 2 * CHUNK, BLOCK))
        self.assertEqual(errors, set())
        self.assertEqual(self.rows(kv, dst[:2 * BPC]), want)


if __name__ == "__main__":
    unittest.main()
