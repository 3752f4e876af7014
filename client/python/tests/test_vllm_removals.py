"""Removals into vLLM's KV events (kvhost.vllm._removals), against real
daemons, through stand-ins shaped like the three halves that use it: the
tier (one namespace, its stored events), the spec's manager (a namespace
per rank: a key is held only where every rank holds it) and the KV
connector's scheduler half (chunks of block hashes, a BlockStored once the
daemon holds them). vLLM's own classes are plain stand-ins here; the
classes of vLLM's trees, its ZMQ publisher and a router's decoding are
test_vllm_real_events.py's.

The lag from a removal in the daemon to the event out of take_events is
printed (p50, p99), not asserted."""

import dataclasses
import glob
import os
import shutil
import statistics
import tempfile
import types
import unittest

import kvhost
from kvhost.vllm import _removals as rm
from kvhost.vllm._common import OffloadingEvent  # kvhost's stand-in of vLLM's

from daemon import Daemon, wait_for

BLOCKS = 64
GEOMETRY = kvhost.Geometry(model="test/vllm-removals", layers=2, kv_heads=2, head_size=64, dtype_size=2,
                           tokens_per_block=16, tokens_per_key=16)
LAYER_BYTES = BLOCKS * 2 * GEOMETRY.block_bytes
KEY_BYTES = GEOMETRY.layers * 2 * GEOMETRY.block_bytes


@dataclasses.dataclass
class BlockStored:
    """Stand-in of vLLM's BlockStored (its fields)."""
    block_hashes: list
    parent_block_hash: object
    token_ids: list
    block_size: int
    lora_id: object
    medium: object
    lora_name: object
    extra_keys: object = None
    group_idx: object = None
    locality: object = None


@dataclasses.dataclass
class BlockRemoved:
    """Stand-in of vLLM's BlockRemoved."""
    block_hashes: list
    medium: object
    group_idx: object = None
    locality: object = None


OFFLOADING_API = types.SimpleNamespace(OffloadingEvent=OffloadingEvent)
EVENT_API = types.SimpleNamespace(BlockStored=BlockStored, BlockRemoved=BlockRemoved, convert=None)


def vkey(i, group=0):
    """A vLLM OffloadKey: a 32-byte block hash and the group's 4 bytes."""
    return (b"%032d" % i) + group.to_bytes(4, "big")


class Worker:
    """A client that stores keys in a namespace of geom (what vLLM's
    workers, or another engine, do)."""

    def __init__(self, test, d, geom=GEOMETRY):
        self.buf = kvhost.HostBuffer(geom.layers * LAYER_BYTES)
        test.addCleanup(self.buf.close)
        self.c = kvhost.Client(d.socket)
        test.addCleanup(self.c.close)
        self.ns = self.c.declare(geom)
        region = self.c.register_buffer(self.buf)
        self.cache = self.c.register_cache(self.ns.id, [
            kvhost.Layer(region, offset=l * LAYER_BYTES, block_stride=geom.block_bytes,
                         plane_stride=BLOCKS * geom.block_bytes, num_blocks=BLOCKS) for l in range(geom.layers)])

    def store(self, keys):
        """Stores keys; returns those the daemon stored."""
        out = []
        for i in range(0, len(keys), BLOCKS):
            chunk = keys[i:i + BLOCKS]
            res = self.c.store(self.cache, chunk, [[j] for j in range(len(chunk))]).wait(60)
            out += [k for k, (o, _) in zip(chunk, res.keys) if o == kvhost.OUTCOME_STORED]
        return out

    def load(self, keys):
        """Loads keys; returns the outcomes."""
        res = self.c.load(self.cache, keys, [[j % BLOCKS] for j in range(len(keys))]).wait(60)
        return [o for o, _ in res.keys]


class TierStandIn:
    """Shaped like KvhostTier: one namespace; its stored events go through
    OffloadingRemovals.stored, a load's missing keys through gone, and
    take_events returns OffloadingRemovals.take_events."""

    def __init__(self, test, d, media=None, **kw):
        self.worker = Worker(test, d)
        self.events = rm.OffloadingRemovals(OFFLOADING_API, "STORAGE", d.socket, [GEOMETRY],
                                            fields={"locality": "LOCAL"}, media=media, name="test-tier",
                                            reconnect_s=0.1, timeout=5, **kw)
        test.addCleanup(self.events.close)
        wait_for(self.events.watcher.subscribed.is_set, timeout=60, what="the tier's subscription")

    def store(self, keys):
        stored = self.worker.store(keys)
        self.events.stored(stored)
        return stored

    def load(self, keys):
        outs = self.worker.load(keys)
        self.events.gone([k for k, o in zip(keys, outs) if o == kvhost.OUTCOME_MISSING])
        return outs

    def take_events(self):
        return self.events.take_events()


def events_until(test, half, want, what):
    """The events half.take_events() returns until want(events) holds."""
    got = []

    def done():
        got.extend(half.take_events())
        return want(got)
    wait_for(done, timeout=60, what=what)
    return got


def removed_keys(events):
    return [k for e in events if e.removed for k in e.keys]


def stored_keys(events):
    return [k for e in events if not e.removed for k in e.keys]


def data_files(d):
    return [f for f in glob.glob(os.path.join(d.dir, "**", "*"), recursive=True)
            if os.path.isfile(f) and not os.path.basename(f).startswith(".")]


def read_head(path):
    with open(path, "rb") as f:
        return f.read(4096)


def lag_line(what, lags):
    if not lags:
        return f"{what}: no samples"
    q = statistics.quantiles(lags, n=100) if len(lags) > 1 else [lags[0]] * 99
    return f"{what}: {len(lags)} removals, lag p50 {q[49] * 1e3:.1f} ms, p99 {q[98] * 1e3:.1f} ms"


class TestOffloadingRemovalsAgainstADaemon(unittest.TestCase):
    """The tier's (and the spec's) removed events, one per reason the
    daemon records, for keys reported stored; none for keys still there."""

    def test_each_reason_the_daemon_records_becomes_one_removed_event_per_key_and_none_for_keys_still_there(self):
        def evict(test, d, tier, keys):
            # Room for about 60 keys: 200 more evict the first ones.
            tier.worker.store([b"filler-%d" % i for i in range(200)])
            return [k for k in keys if tier.worker.c.lookup(tier.worker.ns, [k]) == 0]

        def delete(test, d, tier, keys):
            test.assertEqual(tier.worker.c.delete(tier.worker.ns, keys[:3]), 3)
            return keys[:3]

        def purge(test, d, tier, keys):
            test.assertEqual(tier.worker.c.purge(fingerprint=tier.worker.ns.fingerprint)["files"], len(keys))
            return keys

        def corrupt(test, d, tier, keys):
            for f in data_files(d):
                with open(f, "r+b") as fh:
                    fh.seek(-64, os.SEEK_END)
                    fh.write(b"\xa5" * 64)
            outs = tier.worker.load(keys[:2])
            test.assertEqual(outs, [kvhost.OUTCOME_FAILED] * 2)
            return keys[:2]

        def vanish(test, d, tier, keys):
            for f in data_files(d):
                os.unlink(f)
            outs = tier.load(keys[:2])  # the tier's own load finds them gone first, or the watcher does
            test.assertEqual(outs, [kvhost.OUTCOME_MISSING] * 2)
            return keys[:2]

        cases = [("evicted", "1MiB", evict, "evicted"), ("deleted", "64MiB", delete, "deleted"),
                 ("purged", "64MiB", purge, "purged"), ("corrupt", "64MiB", corrupt, "corrupt"),
                 ("vanished", "64MiB", vanish, ("vanished", "found_gone"))]
        lags = []
        for name, capacity, act, why in cases:
            with self.subTest(reason=name):
                d = Daemon(capacity=capacity)
                self.addCleanup(d.stop)
                tier = TierStandIn(self, d)
                keys = [vkey(i) for i in range(8)]
                self.assertEqual(tier.store(keys), keys)
                self.assertEqual(stored_keys(tier.take_events()), keys)
                gone = act(self, d, tier, keys)
                self.assertTrue(gone, "nothing removed")
                evs = events_until(self, tier, lambda evs: len(removed_keys(evs)) >= len(gone),
                                   f"removed events of {name}")
                self.assertEqual(sorted(removed_keys(evs)), sorted(gone))
                self.assertTrue(all(e.medium == "STORAGE" and e.locality == "LOCAL" for e in evs), evs)
                self.assertEqual(stored_keys(evs), [])
                c = tier.events.counters()
                whys = why if isinstance(why, tuple) else (why,)
                self.assertEqual(sum(c.get(f"removed_{w}", 0) for w in whys), len(gone), c)
                # The keys still stored get none: a delete of one of them
                # now is the next event, alone.
                rest = [k for k in keys if k not in gone]
                if rest:
                    self.assertEqual(tier.worker.c.delete(tier.worker.ns, rest[:1]), 1)
                    evs = events_until(self, tier, removed_keys, "the delete after")
                    self.assertEqual(removed_keys(evs), rest[:1])
                lags += tier.events.lags()
        print("\n" + lag_line("removal -> take_events, every reason", lags))

    def test_a_key_another_engine_stored_gets_no_event_from_this_half(self):
        d = Daemon(capacity="64MiB")
        self.addCleanup(d.stop)
        tier = TierStandIn(self, d)
        other = Worker(self, d)
        mine, theirs = [vkey(1)], [vkey(2)]
        tier.store(mine)
        other.store(theirs)
        tier.take_events()
        self.assertEqual(other.c.delete(other.ns, theirs + mine), 2)
        evs = events_until(self, tier, removed_keys, "the removal of its own key")
        self.assertEqual(removed_keys(evs), mine)
        wait_for(lambda: tier.events.counters().get("removals_not_reported", 0) >= 1, timeout=60,
                 what="the other engine's removal seen and passed over")

    def test_a_key_reported_stored_after_its_removal_was_seen_is_asked_of_the_daemon_and_reported_removed(self):
        d = Daemon(capacity="64MiB")
        self.addCleanup(d.stop)
        tier = TierStandIn(self, d)
        keys = [vkey(1), vkey(2)]
        self.assertEqual(tier.worker.store(keys), keys)  # stored, not yet reported (a job ending late)
        self.assertEqual(tier.worker.c.delete(tier.worker.ns, keys[:1]), 1)
        wait_for(lambda: tier.events.counters().get("removals_not_reported", 0) >= 1, timeout=60,
                 what="the watcher to see the delete")
        tier.events.stored(keys)  # the half reports the store now
        evs = events_until(self, tier, removed_keys, "the recheck's removal")
        self.assertEqual(stored_keys(evs), keys)
        self.assertEqual(removed_keys(evs), keys[:1])
        self.assertFalse(evs[0].removed, "the stored event first")
        self.assertGreaterEqual(tier.events.counters()["rechecked_keys"], 1)

    def test_past_max_tracked_the_oldest_key_is_reported_removed_at_once(self):
        d = Daemon(capacity="64MiB")
        self.addCleanup(d.stop)
        tier = TierStandIn(self, d, max_tracked=2)
        keys = [vkey(i) for i in range(3)]
        tier.store(keys)
        evs = tier.take_events()
        self.assertEqual(stored_keys(evs), keys)
        self.assertEqual(removed_keys(evs), keys[:1])
        self.assertEqual(tier.events.counters()["forgotten_keys"], 1)

    def test_a_daemon_restart_is_a_resync_that_reports_the_keys_gone_meanwhile_and_no_other(self):
        d = Daemon(capacity="64MiB")
        self.addCleanup(d.stop)
        tier = TierStandIn(self, d)
        keys = [vkey(i) for i in range(6)]
        tier.store(keys)
        tier.take_events()
        d.halt()
        # Gone while no daemon ran: its feed will not know them.
        files = sorted(data_files(d))
        self.assertEqual(len(files), 6)
        gone_files = files[:2]
        for f in gone_files:
            os.unlink(f)
        d.start_again()
        evs = events_until(self, tier, lambda evs: len(removed_keys(evs)) >= 2, "the resync's removals")
        c = tier.events.counters()
        self.assertGreaterEqual(c["resyncs"], 1, c)
        self.assertGreaterEqual(c["subscriptions"], 2, c)
        got = removed_keys(evs)
        self.assertEqual(len(got), 2)
        self.assertEqual(self._held(d, got), [])
        # The others are there, and get none.
        others = [k for k in keys if k not in got]
        self.assertEqual(self._held(d, others), others)
        self.assertEqual(removed_keys(tier.take_events()), [])

    def _held(self, d, keys):
        c = kvhost.Client(d.socket)
        self.addCleanup(c.close)
        ns = c.declare(GEOMETRY)
        return [k for k in keys if c.lookup(ns, [k]) == 1]

    def test_take_events_returns_what_is_queued_while_the_daemon_is_frozen(self):
        d = Daemon(capacity="64MiB")
        self.addCleanup(d.stop)
        self.addCleanup(d.thaw)
        tier = TierStandIn(self, d)
        keys = [vkey(1)]
        tier.worker.store(keys)
        d.freeze()
        tier.events.stored(keys)  # no daemon round trip
        self.assertEqual(stored_keys(tier.take_events()), keys)
        self.assertEqual(tier.take_events(), [])

    def test_with_kv_events_off_nothing_is_queued_and_no_subscription_is_made(self):
        ev = rm.OffloadingRemovals(OFFLOADING_API, "STORAGE", "/nonexistent.sock", [GEOMETRY], events=False)
        self.addCleanup(ev.close)
        ev.stored([vkey(1)])
        self.assertEqual(ev.take_events(), [])
        self.assertIsNone(ev.watcher)


class TestMoves(unittest.TestCase):
    """A "moved" record: a medium change where the two mounts' media
    differ (removed for the old, stored for the new), else nothing."""

    @staticmethod
    def record(key, reason, mount=0, to=None, t=1):
        return kvhost.client.Removal(seq=1, fingerprint=7, key=key, reason=reason, mount=mount, to=to, time_ns=t)

    def test_a_move_is_a_medium_change_only_between_media(self):
        conn = (None, [types.SimpleNamespace(fingerprint=7)])
        cases = [
            ("no media: every mount the tier's medium", None, []),
            ("to a mount of another medium", {1: "CPU"}, [("removed", "STORAGE"), ("stored", "CPU")]),
            ("between mounts of one medium", {0: "STORAGE", 1: "STORAGE"}, []),
        ]
        for name, media, want in cases:
            with self.subTest(name):
                ev = rm.OffloadingRemovals(OFFLOADING_API, "STORAGE", "", [GEOMETRY], media=media, watch=False)
                ev.stored([vkey(1)])
                ev.take_events()
                ev._records(conn, [self.record(vkey(1), "moved", 0, 1)])
                got = [("removed" if e.removed else "stored", e.medium) for e in ev.take_events()]
                self.assertEqual(got, want)
                # A later removal names the medium the router was told last.
                ev._records(conn, [self.record(vkey(1), "evicted", 1)])
                got = ev.take_events()
                self.assertEqual([(e.keys, e.medium, e.removed) for e in got],
                                 [([vkey(1)], want[-1][1] if want else "STORAGE", True)])


class HoldsEverything:
    """A stand-in of the watcher's client that holds every key (answered
    by pins: no lookup table)."""

    @staticmethod
    def key_digests(ns, keys):
        return None

    @staticmethod
    def pin(ns, keys, lease_s):
        return 0, [True] * len(keys)


class TestConnectorMoves(unittest.TestCase):
    def test_a_chunk_moved_to_another_medium_is_removed_there_and_announced_by_its_hashes_here(self):
        conn = (HoldsEverything(), [types.SimpleNamespace(fingerprint=7)])
        ev = rm.ConnectorRemovals(EVENT_API, "", [GEOMETRY], media={1: "CPU"}, watch=False)
        hashes = [b"%032d" % 1, b"%032d" % 2]
        key = hashes[-1] + (0).to_bytes(4, "big")
        ev.saved(key, hashes, None, list(range(32)), 16)
        ev._verify(conn)
        got = ev.take_events()
        self.assertEqual([(type(e), e.block_hashes, e.medium, len(e.token_ids)) for e in got],
                         [(BlockStored, hashes, "STORAGE", 32)])
        ev._records(conn, [TestMoves.record(key, "moved", 0, 1)])
        got = ev.take_events()
        self.assertEqual([(type(e), e.block_hashes, e.medium) for e in got],
                         [(BlockRemoved, hashes, "STORAGE"), (BlockStored, hashes, "CPU")])
        ev._records(conn, [TestMoves.record(key, "evicted", 1)])
        self.assertEqual([(type(e), e.block_hashes, e.medium) for e in ev.take_events()],
                         [(BlockRemoved, hashes, "CPU")])
        self.assertEqual(ev.counters()["tracked_keys"], 0)


class TestMovesAgainstATieredDaemon(unittest.TestCase):
    """The tiered policy demotes keys from a memory mount to a disk mount
    ("moved" records): a medium change only where the operator maps the
    disk mount to another medium than the tier's."""

    def test_a_demotion_is_a_medium_change_only_where_the_mounts_media_differ(self):
        hot = tempfile.mkdtemp(prefix="kvhost-test-hot-", dir="/dev/shm")
        self.addCleanup(shutil.rmtree, hot, True)
        cold = tempfile.mkdtemp(prefix="kvhost-test-cold-")
        self.addCleanup(shutil.rmtree, cold, True)
        d = Daemon(capacity="1MiB", dir=hot,
                   extra_toml='name = "tiered"\n[policy.params]\nhot = 0\ncold = 1\npromote_hits = 0\n',
                   after_toml=f'device_class = "memory"\n[[mount]]\npath = "{cold}"\ncapacity = "64MiB"\n')
        self.addCleanup(d.stop)
        halves = {}
        for name, media in (("no media", None), ("disk as CPU", {1: "CPU"})):
            halves[name] = rm.OffloadingRemovals(OFFLOADING_API, "STORAGE", d.socket, [GEOMETRY], media=media,
                                                 name="test-" + name.replace(" ", "-"), reconnect_s=0.1)
            self.addCleanup(halves[name].close)
            wait_for(halves[name].watcher.subscribed.is_set, timeout=60, what=f"{name}'s subscription")
        w = Worker(self, d)
        keys = [vkey(i) for i in range(8)]
        self.assertEqual(w.store(keys), keys)
        for h in halves.values():
            h.stored(keys)
            h.take_events()
        w.store([b"filler-%d" % i for i in range(200)])  # the hot mount holds about 60: the first are demoted
        moved = halves["disk as CPU"]
        wait_for(lambda: moved.counters().get("medium_changes", 0) >= 1, timeout=60, what="a demotion of a key")
        self.assertEqual(sum(w.c.lookup(w.ns, [k]) for k in keys), len(keys), "every key still stored")
        evs = moved.take_events()
        changed = removed_keys(evs)
        self.assertTrue(changed)
        self.assertEqual([(e.removed, e.medium) for e in evs][:2], [(True, "STORAGE"), (False, "CPU")])
        self.assertEqual(sorted(stored_keys(evs)), sorted(changed))
        same = halves["no media"]
        wait_for(lambda: same.counters().get("moves_same_medium", 0) >= len(changed), timeout=60,
                 what="the same moves seen without media")
        self.assertEqual(same.take_events(), [])
        # A removal after the move names the medium the router was told last.
        self.assertEqual(w.c.delete(w.ns, changed[:1]), 1)
        evs = events_until(self, moved, removed_keys, "the removal after the move")
        self.assertEqual([(e.keys, e.medium, e.removed) for e in evs], [(changed[:1], "CPU", True)])
        evs = events_until(self, same, removed_keys, "the removal without media")
        self.assertEqual([(e.keys, e.medium, e.removed) for e in evs], [(changed[:1], "STORAGE", True)])


class TestSharedClusterMount(unittest.TestCase):
    """Two daemons (nodes a and b) on one directory with a cluster
    capacity, as on a shared CephFS mount (cluster.md): each node evicts
    its own files to keep the mount within the bound, a purge on one node
    reaches the other; each half reports the removals of what it
    announced, and of no other node's keys. With KVHOST_CLUSTER_MOUNTS
    (two mounts of one shared file system, as scripts/cephfs.sh run sets
    it: make test-cluster-bounded) each node's daemon serves the directory
    through its own mount; else both share one local directory."""

    def test_cluster_evictions_and_another_nodes_purge_reach_the_half_that_announced_the_keys(self):
        mounts = [m for m in os.environ.get("KVHOST_CLUSTER_MOUNTS", "").split(":") if m][:2]
        name = os.path.basename(tempfile.mkdtemp(prefix="kvhost-test-shared-", dir=mounts[0] if mounts else None))
        if len(mounts) == 2:
            dirs = [os.path.join(m, name) for m in mounts]
        else:
            dirs = [os.path.join(tempfile.gettempdir(), name)] * 2
        self.addCleanup(shutil.rmtree, dirs[0], True)
        nodes, halves, workers = {}, {}, {}
        for n, shared in zip(("a", "b"), dirs):
            nodes[n] = Daemon(capacity="64MiB", dir=shared, extra_toml=f'[engine]\nnode_id = "node-{n}"\n',
                              after_toml='cluster_capacity = "1MiB"\ncluster_interval = "100ms"\n')
            self.addCleanup(nodes[n].stop)
            halves[n] = rm.OffloadingRemovals(OFFLOADING_API, "STORAGE", nodes[n].socket, [GEOMETRY],
                                              name=f"test-node-{n}", reconnect_s=0.1)
            self.addCleanup(halves[n].close)
            wait_for(halves[n].watcher.subscribed.is_set, timeout=60, what=f"node {n}'s subscription")
            workers[n] = Worker(self, nodes[n])
        mine = {n: [vkey(i + (100 if n == "b" else 0)) for i in range(8)] for n in nodes}
        for n in nodes:
            self.assertEqual(workers[n].store(mine[n]), mine[n])
            halves[n].stored(mine[n])
            halves[n].take_events()
        # Past the cluster's 1 MiB: each node evicts its own oldest files.
        for n in nodes:
            workers[n].store([b"filler-%s-%d" % (n.encode(), i) for i in range(100)])
        for n in nodes:
            evs = events_until(self, halves[n], lambda evs: len(removed_keys(evs)) >= 8, f"node {n}'s evictions")
            self.assertEqual(sorted(removed_keys(evs)), sorted(mine[n]))
            c = halves[n].counters()
            self.assertEqual(c["removed_cluster_evicted"], 8, c)
            self.assertGreater(c["removals_not_reported"], 0, "the fillers, announced by no one")
        # A purge on node b reaches node a (its purge record): a's
        # announced keys are reported removed by a's half, each once. The
        # mount is still near its bound (b's fillers): a may store only
        # some of them, and evict some before the purge or before it
        # announced them (a cluster eviction, or the check of a key
        # removed before its announcement, is their removal then).
        more = workers["a"].store([vkey(i) for i in range(200, 204)])
        self.assertTrue(more, "node a stored none of the keys to purge")
        halves["a"].stored(more)
        halves["a"].take_events()
        workers["b"].c.purge(fingerprint=workers["b"].ns.fingerprint)
        evs = events_until(self, halves["a"], lambda evs: len(removed_keys(evs)) >= len(more), "the purge at node a")
        self.assertEqual(sorted(removed_keys(evs)), sorted(more))
        c = halves["a"].counters()
        self.assertGreater(c.get("removed_purged", 0), 0, c)


class TestGroups(unittest.TestCase):
    """A key is held by its group's namespaces only (the spec's KV-cache
    groups, the connector's salt namespaces): a record of its name from
    another group's namespace is not its removal."""

    def test_a_record_from_another_groups_namespace_is_not_the_keys_removal(self):
        nss = [types.SimpleNamespace(fingerprint=fp) for fp in (10, 11, 20, 21)]  # (rank, group) 0,0 1,0 0,1 1,1
        ev = rm.OffloadingRemovals(OFFLOADING_API, "STORAGE", "", [GEOMETRY] * 4, groups=[0, 0, 1, 1], watch=False)
        k = vkey(1, group=0)
        ev.stored([k])
        ev.take_events()
        cases = [(20, []), (21, []), (11, [k])]
        for fp, want in cases:
            with self.subTest(fingerprint=fp):
                ev._records((None, nss), [kvhost.client.Removal(1, fp, k, "evicted", 0, None, 1)])
                self.assertEqual(removed_keys(ev.take_events()), want)


class SpecStandIn:
    """Shaped like the spec's manager: a namespace per rank (tp 2), a key
    stored by every rank's worker, and reported stored once the daemon
    holds it in each."""

    def __init__(self, test, d):
        self.geoms = [dataclasses.replace(GEOMETRY, model="test/vllm-removals-spec", tp_rank=r, tp_size=2)
                      for r in range(2)]
        self.workers = [Worker(test, d, g) for g in self.geoms]
        self.events = rm.OffloadingRemovals(OFFLOADING_API, "STORAGE", d.socket, self.geoms, groups=[0, 0],
                                            name="test-spec", reconnect_s=0.1)
        test.addCleanup(self.events.close)
        wait_for(self.events.watcher.subscribed.is_set, timeout=60, what="the spec's subscription")

    def store(self, keys):
        for w in self.workers:
            w.store(keys)
        self.events.stored(keys)

    def take_events(self):
        return self.events.take_events()


class TestSpecShards(unittest.TestCase):
    def test_a_key_gone_from_one_ranks_namespace_is_removed_once(self):
        d = Daemon(capacity="64MiB")
        self.addCleanup(d.stop)
        spec = SpecStandIn(self, d)
        keys = [vkey(1), vkey(2)]
        spec.store(keys)
        spec.take_events()
        w1 = spec.workers[1]
        self.assertEqual(w1.c.delete(w1.ns, keys[:1]), 1)  # rank 1's shard only: the key cannot load
        evs = events_until(self, spec, removed_keys, "the shard's removal")
        self.assertEqual(removed_keys(evs), keys[:1])
        w0 = spec.workers[0]
        self.assertEqual(w0.c.delete(w0.ns, keys), 2)  # rank 0's: keys[0] again (reported), keys[1]
        evs = events_until(self, spec, removed_keys, "the other key's removal")
        self.assertEqual(removed_keys(evs), keys[1:])


class ConnectorStandIn:
    """Shaped like the connector's scheduler half: each saved chunk is
    handed over with its block hashes; BlockStored once the daemon holds
    it in every rank's namespace, BlockRemoved once it drops it."""

    def __init__(self, test, d, **kw):
        self.worker = Worker(test, d)
        self.events = rm.ConnectorRemovals(EVENT_API, d.socket, [GEOMETRY], name="test-connector",
                                           reconnect_s=0.1, verify_s=0.05, **kw)
        test.addCleanup(self.events.close)
        wait_for(self.events.watcher.subscribed.is_set, timeout=60, what="the connector's subscription")

    def save(self, i, store=True):
        """Saves chunk i: hashes h(2i), h(2i+1) (2 blocks), key the last
        one's offload key."""
        hashes = [b"%032d" % (2 * i), b"%032d" % (2 * i + 1)]
        key = hashes[-1] + (0).to_bytes(4, "big")
        self.events.saved(key, hashes, b"%032d" % (2 * i - 1) if i else None, list(range(32)), 16)
        if store:
            self.worker.store([key])
        return key, hashes

    def take_events(self):
        return self.events.take_events()


class TestConnectorRemovals(unittest.TestCase):
    def test_a_saved_chunk_is_announced_once_held_and_its_removal_names_its_block_hashes(self):
        d = Daemon(capacity="64MiB")
        self.addCleanup(d.stop)
        conn = ConnectorStandIn(self, d)
        k0, h0 = conn.save(0)
        k1, h1 = conn.save(1)
        conn.save(2, store=False)  # never stored: no event
        evs = events_until(self, conn, lambda evs: len(evs) >= 2, "the stored events")
        self.assertEqual([(type(e), e.block_hashes, e.medium, e.block_size) for e in evs],
                         [(BlockStored, h0, "STORAGE", 16), (BlockStored, h1, "STORAGE", 16)])
        self.assertEqual(evs[1].parent_block_hash, h0[-1])
        self.assertEqual(conn.worker.c.delete(conn.worker.ns, [k0, k1]), 2)
        # One BlockRemoved per take_events call that finds removals: the
        # two may come in one or in two.
        evs = events_until(self, conn, lambda evs: sum(len(e.block_hashes) for e in evs) >= 4, "the removals")
        self.assertEqual({type(e) for e in evs}, {BlockRemoved})
        self.assertEqual(sorted(h for e in evs for h in e.block_hashes), sorted(h0 + h1))
        self.assertEqual({(e.medium, e.group_idx) for e in evs}, {("STORAGE", 0)})

    def test_a_restart_that_lost_a_chunk_is_a_resync_reporting_its_removal(self):
        d = Daemon(capacity="64MiB")
        self.addCleanup(d.stop)
        conn = ConnectorStandIn(self, d)
        conn.save(0)
        k1, h1 = conn.save(1)
        events_until(self, conn, lambda evs: len(evs) >= 2, "the stored events")
        d.halt()
        files = sorted(data_files(d))
        self.assertEqual(len(files), 2)
        # Which file holds chunk 1: the one whose bytes name its key.
        f1 = next(f for f in files if k1 in read_head(f))
        os.unlink(f1)
        d.start_again()
        evs = events_until(self, conn, lambda evs: evs, "the resync's removal")
        self.assertEqual([(type(e), e.block_hashes) for e in evs], [(BlockRemoved, h1)])
        self.assertGreaterEqual(conn.events.counters()["resyncs"], 1)


if __name__ == "__main__":
    unittest.main()
