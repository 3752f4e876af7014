"""Removals into vLLM's KV events, through vLLM's real modules: the
removed and stored events of kvhost.vllm._removals become vLLM's own
KV-event classes (vllm/distributed/kv_events.py: BlockStored,
BlockRemoved; for the tier and the spec through vLLM's own
OffloadingEventsTracker, as its OffloadingConnector does), are published
by vLLM's own ZmqEventPublisher in a KVEventBatch, and are read by a
subscriber that decodes the messages as a router does (llm-d's decodes
vLLM's msgpack KVEventBatch: [ts, [event...], data_parallel_rank], each
event tagged with its class name).

msgspec, which vLLM's kv_events module imports, is not installable here
(no package index; Debian 12 has no python3-msgspec): where it does not
import, the module runs over MSGSPEC_SHIM, the thinnest stand-in of what
it uses (Struct with array_like, tag and omit_defaults; msgpack.Encoder),
encoding as msgspec does over python3-msgpack. Everything else is vLLM's
code from the tree (make test-vllm VLLM_SRC=DIR), pyzmq is Debian's.

The lag from a removal in the daemon to the router's socket is printed
(p50, p99), not asserted. TestTierInVllm and TestConnectorInVllm run
KvhostTier inside vLLM's TieringOffloadingManager and KvhostConnector as
vLLM's factory builds it; they skip until those integrations report
removals (docs/routers.md)."""

import enum
import importlib.util
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import types
import unittest
from unittest import mock

import kvhost
from kvhost.vllm import _removals as rm

import vllm_tree
from daemon import Daemon, wait_for
from test_vllm_removals import GEOMETRY, Worker, vkey

try:
    import msgpack
    import zmq
except ImportError as e:  # make vllm-test-deps installs them
    _DEPS = f"{e.name} is not installed: run make vllm-test-deps (python3-zmq, python3-msgpack)"
else:
    _DEPS = None


def _msgspec_shim():
    """A module named msgspec with what vLLM's kv_events uses of it:
    Struct (subclass keywords array_like, omit_defaults, tag, tag_field
    and gc; fields from annotations in definition order, a redefined field
    keeping its place; defaults from class attributes; positional or
    keyword construction; equality by type and fields) and
    msgpack.Encoder().encode, which writes a Struct as msgspec does: an
    array of its fields (array_like) or a map of them, led by its tag
    (the class name where tag is True; in a map under tag_field, "type"),
    fields equal to their default left out with omit_defaults (in an
    array, only trailing ones), bytes as msgpack bin, enums by value."""
    m = types.ModuleType("msgspec")
    m.__doc__ = "kvhost test shim of msgspec over msgpack (test_vllm_real_events.py)"

    class Struct:
        __struct_config__ = {"array_like": False, "omit_defaults": False, "tag": None, "tag_field": "type"}
        __struct_fields__ = ()
        __struct_defaults__ = {}

        def __init_subclass__(cls, array_like=None, omit_defaults=None, gc=None, tag=None, tag_field=None,
                              **kw):
            super().__init_subclass__(**kw)
            conf = dict(cls.__struct_config__)
            for k, v in (("array_like", array_like), ("omit_defaults", omit_defaults), ("tag", tag),
                         ("tag_field", tag_field)):
                if v is not None:
                    conf[k] = v
            fields, defaults = list(cls.__struct_fields__), dict(cls.__struct_defaults__)
            for name in cls.__dict__.get("__annotations__", {}):
                if name not in fields:
                    fields.append(name)
                if name in cls.__dict__:
                    defaults[name] = cls.__dict__[name]
                    delattr(cls, name)
                else:
                    defaults.pop(name, None)
            cls.__struct_config__, cls.__struct_fields__, cls.__struct_defaults__ = conf, tuple(fields), defaults

        def __init__(self, *args, **kw):
            fields, defaults = type(self).__struct_fields__, type(self).__struct_defaults__
            if len(args) > len(fields):
                raise TypeError(f"Extra positional arguments provided: {len(args)} for {len(fields)} fields")
            vals = dict(zip(fields, args))
            for k, v in kw.items():
                if k not in fields or k in vals:
                    raise TypeError(f"Unexpected keyword argument '{k}'")
                vals[k] = v
            for f in fields:
                if f not in vals:
                    if f not in defaults:
                        raise TypeError(f"Missing required argument '{f}'")
                    d = defaults[f]
                    vals[f] = type(d)() if isinstance(d, (list, dict, set)) else d
                object.__setattr__(self, f, vals[f])

        def __eq__(self, other):
            return type(self) is type(other) and all(
                getattr(self, f) == getattr(other, f) for f in self.__struct_fields__)

        __hash__ = None

        def __repr__(self):
            return f"{type(self).__name__}(" + ", ".join(
                f"{f}={getattr(self, f)!r}" for f in self.__struct_fields__) + ")"

    def tag_of(cls):
        t = cls.__struct_config__["tag"]
        if t is True:
            return cls.__name__
        if callable(t):
            return t(cls.__name__)
        return t or None

    def builtin(obj):
        if isinstance(obj, Struct):
            cls = type(obj)
            conf, fields, defaults = cls.__struct_config__, cls.__struct_fields__, cls.__struct_defaults__
            tag = tag_of(cls)
            if conf["array_like"]:
                vals = [getattr(obj, f) for f in fields]
                if conf["omit_defaults"]:
                    while vals and fields[len(vals) - 1] in defaults and \
                            vals[-1] == defaults[fields[len(vals) - 1]]:
                        vals.pop()
                return ([tag] if tag is not None else []) + [builtin(v) for v in vals]
            out = {} if tag is None else {conf["tag_field"]: tag}
            for f in fields:
                v = getattr(obj, f)
                if conf["omit_defaults"] and f in defaults and v == defaults[f]:
                    continue
                out[f] = builtin(v)
            return out
        if isinstance(obj, (list, tuple)):
            return [builtin(v) for v in obj]
        if isinstance(obj, dict):
            return {builtin(k): builtin(v) for k, v in obj.items()}
        if isinstance(obj, enum.Enum):
            return builtin(obj.value)
        return obj

    class Encoder:
        def encode(self, obj):
            return msgpack.packb(builtin(obj), use_bin_type=True)

    m.Struct = Struct
    m.msgpack = types.SimpleNamespace(Encoder=Encoder)
    return m


def _load_file(name, path, modules):
    """The module at path, run as name, with sys.modules holding modules
    (name -> module) while it imports; restored after."""
    saved = {k: sys.modules.get(k) for k in modules}
    sys.modules.update(modules)
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


def real_event_modules(api):
    """(kv_events, offloading events): vLLM's vllm/distributed/kv_events.py
    and the offloading connector's events.py (OffloadingEventsTracker)
    from the tree, run under names of their own (vllm_tree shims
    vllm.distributed.kv_events for the other tests), the second over the
    first. kv_events runs over msgspec, or MSGSPEC_SHIM where it does not
    import."""
    try:
        import msgspec  # noqa: F401
        shim = {}
    except ImportError:
        shim = {"msgspec": _msgspec_shim()}
    kv = _load_file("kvhost_test_vllm_kv_events", os.path.join(api.src, "vllm", "distributed", "kv_events.py"), shim)
    ev = _load_file("kvhost_test_vllm_offloading_events", os.path.join(
        api.src, "vllm", "distributed", "kv_transfer", "kv_connector", "v1", "offloading", "events.py"),
        {"vllm.distributed.kv_events": kv})
    return kv, ev, bool(shim)


def convert():
    """vLLM's maybe_convert_block_hash (the tree's): how its events name a
    block hash (ints of its last 8 bytes with
    VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES, the default; else the bytes)."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
    return maybe_convert_block_hash


# A router's decoding (llm-d's kvevents decodes the same msgpack): the
# fields of an event sent as an array (an array_like vLLM), by its tag.
ARRAY_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                    "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window",
                    "locality"),
    "BlockRemoved": ("block_hashes", "medium", "group_idx", "locality"),
    "AllBlocksCleared": (),
}


def router_decode(payload):
    """A KVEventBatch message as a router reads it: (ts, [(tag, fields)],
    data_parallel_rank), each event a map led by its "type" tag or an
    array led by it."""
    batch = msgpack.unpackb(payload, raw=False)
    ts, events, dp = batch[0], batch[1], batch[2] if len(batch) > 2 else None
    out = []
    for e in events:
        if isinstance(e, dict):
            e = dict(e)
            out.append((e.pop("type"), e))
        else:
            out.append((e[0], dict(zip(ARRAY_FIELDS[e[0]], e[1:]))))
    return ts, out, dp


class Router:
    """A ZMQ SUB socket on vLLM's publisher, decoding on a thread of its
    own: each event with the time it arrived (time.time_ns)."""

    def __init__(self, endpoint):
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.RCVTIMEO, 100)
        self.sock.connect(endpoint)
        self.events, self.seqs, self.lock = [], [], threading.Lock()
        self.stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop:
            try:
                topic, seq, payload = self.sock.recv_multipart()
            except zmq.Again:
                continue
            now = time.time_ns()
            _, events, dp = router_decode(payload)
            with self.lock:
                self.seqs.append(int.from_bytes(seq, "big"))
                self.events += [(tag, f, now, dp) for tag, f in events]

    def taken(self):
        with self.lock:
            out, self.events = self.events, []
        return out

    def close(self):
        self.stop = True
        self.thread.join(5)
        self.sock.close(linger=0)


class Published:
    """vLLM's ZmqEventPublisher on an ipc endpoint of the test's and a
    Router subscribed to it (start_publishing, in setUp), and what vLLM's
    scheduler does each step with the events it collected (publish)."""

    @classmethod
    def load_events(cls):
        cls.api = vllm_tree.load()
        cls.kv, cls.ev, cls.shimmed = real_event_modules(cls.api)
        print(f"\n{cls.api.name}: vLLM's kv_events over {'a msgspec shim (msgpack)' if cls.shimmed else 'msgspec'}")

    def start_publishing(self):
        self.tmp = tempfile.mkdtemp(prefix="kvhost-zmq-")
        self.addCleanup(shutil.rmtree, self.tmp, True)
        self.endpoint = f"ipc://{self.tmp}/events"
        self.pub = self.kv.ZmqEventPublisher(data_parallel_rank=0, endpoint=self.endpoint)
        self.addCleanup(self.pub.shutdown)
        self.router = Router(self.endpoint)
        self.addCleanup(self.router.close)

    def publish(self, events):
        """What vLLM's scheduler does each step with the connector's events."""
        if events:
            self.pub.publish(self.kv.KVEventBatch(ts=time.time(), events=list(events)))

    def until(self, step, want, what):
        """Runs step() (a scheduler step: take, translate, publish) until the
        router's events satisfy want."""
        got = []

        def done():
            step()
            got.extend(self.router.taken())
            return want(got)
        wait_for(done, timeout=60, what=what)
        return got

    def connected(self, probe):
        """Publishes probe batches until the router hears one (a SUB
        socket misses what was sent before it joined)."""
        def heard():
            self.publish([probe])
            return bool(self.router.taken())
        wait_for(heard, timeout=60, what="the router's subscription")


@unittest.skipIf(_DEPS, _DEPS or "")
@unittest.skipIf(vllm_tree.skip_reason(), vllm_tree.skip_reason() or "")
class TestRealKVEvents(Published, unittest.TestCase):
    """The machinery (stand-ins of the halves) into vLLM's classes."""

    @classmethod
    def setUpClass(cls):
        cls.load_events()

    def setUp(self):
        self.start_publishing()
        self.d = Daemon(capacity="64MiB")
        self.addCleanup(self.d.stop)

    def test_the_tiers_removals_reach_a_router_as_block_removed_through_vllms_tracker_and_publisher(self):
        a, kv = self.api, self.kv
        self.connected(kv.AllBlocksCleared())
        half = rm.OffloadingRemovals(a, a.Medium.STORAGE, self.d.socket, [GEOMETRY],
                                     fields={"locality": a.Locality.LOCAL}, name="test-tier", reconnect_s=0.1)
        self.addCleanup(half.close)
        wait_for(half.watcher.subscribed.is_set, timeout=60, what="the subscription")
        tracker = self.ev.OffloadingEventsTracker(a.OffloadingKVEventsConfig(
            enable_kv_cache_events=True, self_describing_kv_events=False))
        worker = Worker(self, self.d)
        keys = [vkey(i) for i in range(6)]
        self.assertEqual(worker.store(keys), keys)
        half.stored(keys)
        self.assertEqual(worker.c.delete(worker.ns, keys[:4]), 4)

        def step():
            self.publish(tracker.take_events(half.take_events()))
        got = self.until(step, lambda g: sum(len(f["block_hashes"]) for t, f, _, _ in g
                                             if t == "BlockRemoved") >= 4, "the removals at the router")
        stored = [h for t, f, _, _ in got if t == "BlockStored" for h in f["block_hashes"]]
        removed = [(h, f["medium"], f.get("locality"), f.get("group_idx"))
                   for t, f, _, _ in got if t == "BlockRemoved" for h in f["block_hashes"]]
        cv = convert()
        self.assertEqual(stored, [cv(k[:-4]) for k in keys])
        self.assertEqual(removed, [(cv(k[:-4]), "STORAGE", "LOCAL", 0) for k in keys[:4]])
        self.assertEqual([t for t, _, _, dp in got if dp != 0], [])

    def test_the_connectors_chunks_reach_a_router_as_block_stored_then_block_removed_and_the_lag_is_printed(self):
        kv = self.kv
        self.connected(kv.AllBlocksCleared())
        cv = convert()
        api = types.SimpleNamespace(BlockStored=kv.BlockStored, BlockRemoved=kv.BlockRemoved, convert=cv)
        half = rm.ConnectorRemovals(api, self.d.socket, [GEOMETRY], medium=kv.MEDIUM_STORAGE, name="test-conn",
                                    reconnect_s=0.1, verify_s=0.02)
        self.addCleanup(half.close)
        wait_for(half.watcher.subscribed.is_set, timeout=60, what="the subscription")
        # The test's own subscription: each removal's record time.
        probe = kvhost.Client(self.d.socket)
        self.addCleanup(probe.close)
        sub = probe.subscribe_removals([probe.declare(GEOMETRY)])
        worker = Worker(self, self.d)
        n = 256
        chunks = []
        for i in range(n):
            hashes = [b"%031d%d" % (i, j) for j in range(2)]
            key = hashes[-1] + (0).to_bytes(4, "big")
            half.saved(key, hashes, None, list(range(32)), 16)
            chunks.append((key, hashes))
        self.assertEqual(len(worker.store([k for k, _ in chunks])), n)

        def step():
            self.publish(half.take_events())
        got = self.until(step, lambda g: sum(t == "BlockStored" for t, _, _, _ in g) >= n, "the stored events")
        self.assertEqual(sorted(f["block_hashes"] for t, f, _, _ in got if t == "BlockStored"),
                         sorted([cv(x) for x in h] for _, h in chunks))
        self.assertTrue(all(f["medium"] == "STORAGE" and f["block_size"] == 16 for t, f, _, _ in got
                            if t == "BlockStored"))
        # One removal at a time; a scheduler step each time the test polls
        # (wait_for: after 0.5 ms, doubling to 50 ms), as vLLM's steps come.
        lags, record = [], {}
        for key, hashes in chunks[:n // 2]:
            self.assertEqual(worker.c.delete(worker.ns, [key]), 1)
            for r in sub.get(timeout=60).removals:
                record[r.key] = r.time_ns
            got = self.until(step, lambda g: any(t == "BlockRemoved" for t, _, _, _ in g), "a removal at the router")
            (tag, f, at, _), = got
            self.assertEqual((tag, f["block_hashes"], f["medium"]),
                             ("BlockRemoved", [cv(x) for x in hashes], "STORAGE"))
            lags.append((at - record[key]) / 1e9)
        # The chunks still stored got none.
        step()
        self.assertEqual(self.router.taken(), [])
        q, t = statistics.quantiles(lags, n=100), statistics.quantiles(half.lags(), n=100)
        print(f"\n{self.api.name}: removal in the daemon -> BlockRemoved at the router's socket (vLLM's "
              f"ZmqEventPublisher, a step per poll): {len(lags)} removals, p50 {q[49] * 1e3:.1f} ms, "
              f"p99 {q[98] * 1e3:.1f} ms; -> take_events: p50 {t[49] * 1e3:.1f} ms, p99 {t[98] * 1e3:.1f} ms")


class PublishedInVllm(Published):
    """Published beside a vllm_tree.RealCase of another test module: its
    class set-up, then vLLM's event modules; its set-up, then the
    publisher and the router."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.load_events()

    def setUp(self):
        super().setUp()
        self.start_publishing()

    def offloaded_keys_reach_the_router(self, manager, ks, geometry, before_step=None):
        """vLLM's connector each step: manager.take_events() (after
        before_step()) through vLLM's OffloadingEventsTracker to the
        publisher. ks, stored, reach the router as BlockStored on STORAGE;
        two of them deleted from the namespace of geometry, as
        BlockRemoved; the kept ones get none."""
        tracker = self.ev.OffloadingEventsTracker(self.api.OffloadingKVEventsConfig(
            enable_kv_cache_events=True, self_describing_kv_events=False))
        cv = convert()

        def step():
            if before_step is not None:
                before_step()
            self.publish(tracker.take_events(manager.take_events()))

        def on_storage(got, tag):
            return [h for t, f, _, _ in got if t == tag and f["medium"] == "STORAGE" for h in f["block_hashes"]]
        got = self.until(step, lambda g: len(on_storage(g, "BlockStored")) >= len(ks), "the stored events")
        self.assertEqual(sorted(on_storage(got, "BlockStored")), sorted(cv(k[:-4]) for k in ks))
        other = kvhost.Client(self.daemon.socket)
        self.addCleanup(other.close)
        self.assertEqual(other.delete(other.declare(geometry), ks[:2]), 2)
        got = self.until(step, lambda g: len(on_storage(g, "BlockRemoved")) >= 2, "the removals")
        self.assertEqual(sorted(on_storage(got, "BlockRemoved")), sorted(cv(k[:-4]) for k in ks[:2]))
        step()
        self.assertEqual(on_storage(self.router.taken(), "BlockRemoved"), [], "a kept key reported removed")


class EventsOn:
    """An engine case whose vLLM config turns vLLM's KV events on."""

    def vllm_config(self, **kw):
        vc = super().vllm_config(**kw)
        from vllm.config.kv_events import KVEventsConfig
        vc.kv_events_config = KVEventsConfig(enable_kv_cache_events=True)
        return vc


def _wired(module, options, what):
    """None where kvhost.vllm's module (tier, connector) reports removals
    (its options name max_tracked_keys: docs/routers.md), else why the
    test skips."""
    import importlib
    m = importlib.import_module(f"kvhost.vllm.{module}")
    if "max_tracked_keys" in getattr(m, options):
        return None
    return f"the {what} does not report removals in this checkout yet (kvhost.vllm._removals not wired)"


from test_vllm_real_tier import RealTieringCase, key as tier_key  # noqa: E402


@unittest.skipIf(_DEPS, _DEPS or "")
@unittest.skipIf(vllm_tree.skip_reason(), vllm_tree.skip_reason() or "")
@unittest.skipIf(_wired("_tier_options", "OWN_KEYS", "tier"), _wired("_tier_options", "OWN_KEYS", "tier") or "")
class TestTierInVllm(PublishedInVllm, RealTieringCase):
    """KvhostTier in vLLM's TieringOffloadingManager, its events through
    vLLM's tracker and publisher to a router."""

    def test_a_key_the_daemon_drops_reaches_the_router_as_block_removed_on_storage_and_kept_keys_get_none(self):
        h = self.engine(events=True)
        m, ctx = h.manager, self.ctx()
        m.on_new_request(ctx)
        tier = m.secondary_tiers[0]
        wait_for(lambda: tier.counters()["events"].get("subscribed"), timeout=60, what="the tier's subscription")
        self.connected(self.kv.AllBlocksCleared())
        ks = [tier_key(i, "router") for i in range(4)]
        self.offload(h, ks, ctx)
        self.offloaded_keys_reach_the_router(m, ks, tier.namespace.geometry)


from test_vllm_real_spec import RealSpecCase, key as spec_key, unobserved  # noqa: E402


@unittest.skipIf(_DEPS, _DEPS or "")
@unittest.skipIf(vllm_tree.skip_reason(), vllm_tree.skip_reason() or "")
@unittest.skipIf(_wired("spec_compat", "OPTIONS", "spec"), _wired("spec_compat", "OPTIONS", "spec") or "")
class TestSpecInVllm(PublishedInVllm, RealSpecCase):
    """KvhostOffloadingSpec's manager as vLLM's factory makes it, its
    events through vLLM's tracker and publisher to a router."""

    def setUp(self):
        super().setUp()
        p = unobserved()  # the workers' attention backend is not observed outside vLLM (as test_vllm_real_spec)
        p.start()
        self.addCleanup(p.stop)

    def test_a_stored_key_the_daemon_drops_reaches_the_router_as_block_removed_and_kept_keys_get_none(self):
        from kvhost.vllm import spec_compat as sc
        spec = self.spec()
        m = self.manager(spec)
        wait_for(lambda: m.counters()["events"].get("subscribed"), timeout=60, what="the manager's subscription")
        self.connected(self.kv.AllBlocksCleared())
        ks = [spec_key(i, "router") for i in range(4)]
        self.stored(spec, m, ks)
        self.offloaded_keys_reach_the_router(m, ks, sc.geometry(sc.describe(m._ident, 0, 0)),
                                             before_step=lambda: self.step(m))


from test_vllm_real_kvconnector import BPC, RealKvConnectorCase  # noqa: E402


@unittest.skipIf(_DEPS, _DEPS or "")
@unittest.skipIf(vllm_tree.skip_reason(), vllm_tree.skip_reason() or "")
@unittest.skipIf(_wired("connector", "OPTIONS", "KV connector"), _wired("connector", "OPTIONS", "KV connector") or "")
class TestConnectorInVllm(EventsOn, PublishedInVllm, RealKvConnectorCase):
    """KvhostConnector built by vLLM's factory with vLLM's KV events on:
    its take_events, as vLLM's scheduler publishes them, to a router."""

    def test_a_saved_prompts_chunks_reach_the_router_stored_then_removed_with_their_block_hashes(self):
        with mock.patch.dict(sys.modules, {"vllm.distributed.kv_events": self.kv}):
            sched, worker, _ = self.engine(seed=3)
        wait_for(lambda: sched.counters()["events"].get("subscribed"), timeout=60, what="the subscription")
        self.connected(self.kv.AllBlocksCleared())
        nblk = 2 * BPC + 1
        req = self.request("a", "kvc-router", nblk)
        self.save_prompt(sched, worker, req, list(range(1, 1 + nblk)))
        cv = convert()
        want = [[cv(bytes(h)) for h in req.block_hashes[i * BPC:(i + 1) * BPC]] for i in range(2)]

        def step():
            self.publish(sched.take_events())
        got = self.until(step, lambda g: sum(t == "BlockStored" for t, _, _, _ in g) >= 2, "the stored events")
        self.assertEqual([f["block_hashes"] for t, f, _, _ in got if t == "BlockStored"], want)
        self.assertTrue(all(f["medium"] == "STORAGE" for t, f, _, _ in got if t == "BlockStored"))
        other = kvhost.Client(self.daemon.socket)
        self.addCleanup(other.close)
        from kvhost.vllm import connector
        ns = other.declare(connector.geometry(sched._ident, 0))
        key = bytes(req.block_hashes[BPC - 1]) + (0).to_bytes(4, "big")
        self.assertEqual(other.delete(ns, [key]), 1)
        got = self.until(step, lambda g: any(t == "BlockRemoved" for t, _, _, _ in g), "the removal")
        self.assertEqual([(t, f["block_hashes"], f["medium"]) for t, f, _, _ in got if t != "AllBlocksCleared"],
                         [("BlockRemoved", want[0], "STORAGE")])


from test_vllm_real_hybrid import BLOCK as HBLOCK, BPC as HBPC, HybridCase  # noqa: E402


@unittest.skipIf(_DEPS, _DEPS or "")
@unittest.skipIf(vllm_tree.skip_reason(), vllm_tree.skip_reason() or "")
@unittest.skipIf(_wired("connector", "OPTIONS", "KV connector"), _wired("connector", "OPTIONS", "KV connector") or "")
class TestHybridConnectorInVllm(EventsOn, PublishedInVllm, HybridCase):
    """KvhostConnector of a hybrid model (full attention, sliding window,
    Mamba) with vLLM's KV events on: every KV-cache group's chunks reach
    the router, each event naming its group."""

    def test_every_groups_chunks_reach_the_router_stored_then_removed_under_their_group(self):
        from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind
        from kvhost.vllm import connector
        kinds = ("full", "window", "mamba")
        with mock.patch.dict(sys.modules, {"vllm.distributed.kv_events": self.kv}):
            sched, workers, _ = self.engine(seed=3, kinds=kinds)
        wait_for(lambda: sched.counters()["events"].get("subscribed"), timeout=60, what="the subscription")
        self.connected(self.kv.AllBlocksCleared())
        nblk = 2 * HBPC + 1
        req = self.request("a", "hybrid-router", nblk)
        self.save_prompt(sched, workers, req, [list(range(b, b + nblk)) for b in (1, 20, 40)])
        cv = convert()
        chunks = [[cv(bytes(h)) for h in req.block_hashes[i * HBPC:(i + 1) * HBPC]] for i in range(2)]

        def step():
            self.publish(sched.take_events())
        got = self.until(step, lambda g: sum(t == "BlockStored" for t, _, _, _ in g) >= 6, "the stored events")
        stored = sorted((f["group_idx"], f["block_hashes"], f["block_size"]) for t, f, _, _ in got
                        if t == "BlockStored")
        self.assertEqual(stored, [(g, c, HBLOCK) for g in range(3) for c in chunks])
        specs = [g.kv_cache_spec for g in self.kv_cache_config(kinds).kv_cache_groups]
        named = {f["group_idx"]: f["kv_cache_spec_kind"] for t, f, _, _ in got if t == "BlockStored"}
        self.assertEqual(named, {g: get_kv_cache_spec_kind(s).value for g, s in enumerate(specs)})
        self.assertEqual(len(set(named.values())), 3, named)
        # The window group's first chunk dropped by the daemon: a removal
        # of that group only; the other groups' chunks get none.
        other = kvhost.Client(self.daemon.socket)
        self.addCleanup(other.close)
        ns = other.declare(connector.geometry(sched._ident, 0, None, 1))
        key = bytes(req.block_hashes[HBPC - 1]) + (1).to_bytes(4, "big")
        self.assertEqual(other.delete(ns, [key]), 1)
        got = self.until(step, lambda g: any(t == "BlockRemoved" for t, _, _, _ in g), "the removal")
        self.assertEqual([(t, f["group_idx"], f["block_hashes"]) for t, f, _, _ in got if t != "AllBlocksCleared"],
                         [("BlockRemoved", 1, chunks[0])])



from test_vllm_real_stages import FULL_STAGES, StagesCase  # noqa: E402


@unittest.skipIf(_DEPS, _DEPS or "")
@unittest.skipIf(vllm_tree.skip_reason(), vllm_tree.skip_reason() or "")
@unittest.skipIf(_wired("connector", "OPTIONS", "KV connector"), _wired("connector", "OPTIONS", "KV connector") or "")
class TestStagesConnectorInVllm(EventsOn, PublishedInVllm, StagesCase):
    """KvhostConnector at PP=2 with vLLM's KV events on: a chunk reaches
    the router once every stage holds it."""

    def test_a_chunk_is_announced_once_every_stage_holds_it(self):
        with mock.patch.dict(sys.modules, {"vllm.distributed.kv_events": self.kv}):
            sched, workers = self.stages(FULL_STAGES, ("full",), seed=4)
        wait_for(lambda: sched.counters()["events"].get("subscribed"), timeout=60, what="the subscription")
        self.connected(self.kv.AllBlocksCleared())
        nblk, cv = HBPC + 1, convert()
        ids = [list(range(1, 1 + nblk))]
        stage0, stage1 = self.pairs(workers, {0}), self.pairs(workers, {1})
        x = self.request("x", "pp-events-x", nblk)
        self.save_on(sched, stage0, x, ids)  # stage 1's store did not happen
        y = self.request("y", "pp-events-y", nblk)
        self.save_prompt(sched, self.pairs(workers), y, ids)
        hashes = {r.request_id: [cv(bytes(h)) for h in r.block_hashes[:HBPC]] for r in (x, y)}

        def step():
            self.publish(sched.take_events())

        def announced(got):
            return [f["block_hashes"] for t, f, _, _ in got if t == "BlockStored"]
        # The daemon is asked about x's chunk with y's, or before it: y's
        # event comes, x's does not.
        got = self.until(step, lambda g: hashes["y"] in announced(g), "y's event")
        self.assertEqual(announced(got), [hashes["y"]])
        self.save_on(sched, stage1, self.request("x2", "pp-events-x", nblk), ids)
        got = self.until(step, lambda g: hashes["x"] in announced(g), "x's event, stage 1 holding it too")
        self.assertEqual(announced(got), [hashes["x"]])


if __name__ == "__main__":
    unittest.main()
