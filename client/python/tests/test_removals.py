"""Removal streams: Client.subscribe_removals and Client.supports_removals,
against a real daemon and against a fake of a daemon that predates them
(docs/protocol.md, "Removal streams")."""

import struct
import threading
import unittest

import kvhost
from kvhost import protocol as p
from kvhost.client import RemovalBatch

from daemon import Daemon, wait_for
from test_client import FakeDaemon

BLOCKS = 16
GEOMETRY = kvhost.Geometry(model="test/removals", layers=2, kv_heads=2, head_size=64, dtype_size=2,
                           tokens_per_block=16, tokens_per_key=16)  # 1 block per key
LAYER_BYTES = BLOCKS * 2 * GEOMETRY.block_bytes


def stored(test, d, n, prefix=b"rm"):
    """A client of d with a cache, and n keys stored in it: (client,
    namespace, keys)."""
    buf = kvhost.HostBuffer(GEOMETRY.layers * LAYER_BYTES)
    test.addCleanup(buf.close)
    c = kvhost.Client(d.socket)
    test.addCleanup(c.close)
    ns = c.declare(GEOMETRY)
    region = c.register_buffer(buf)
    cache = c.register_cache(ns.id, [kvhost.Layer(region, offset=l * LAYER_BYTES, block_stride=GEOMETRY.block_bytes,
                                                  plane_stride=BLOCKS * GEOMETRY.block_bytes, num_blocks=BLOCKS)
                                     for l in range(GEOMETRY.layers)])
    keys = [prefix + b"-%d" % i for i in range(n)]
    res = c.store(cache, keys, [[i] for i in range(n)]).wait(30)
    test.assertEqual(res.count(kvhost.OUTCOME_STORED), n)
    return c, ns, keys


def removed(test, sub, n, reason):
    """The keys of the next batches of sub, until n of them: each of
    reason; a resync fails the test."""
    keys = []
    while len(keys) < n:
        b = sub.get(timeout=60)
        test.assertFalse(b.resync, "a resync")
        for r in b.removals:
            test.assertEqual((r.reason, r.to), (reason, None), r)
            test.assertGreater(r.time_ns, 0)
            keys.append(r.key)
    return keys


class TestRemovalsEncoding(unittest.TestCase):
    def test_a_removals_event_decodes_its_records_and_refuses_a_resync_with_records(self):
        rec = struct.pack("<QQBBHHQB", 7, 0xabc, 3, 0, 0, p.NO_REMOVAL_MOUNT, 99, 2) + b"k1"
        body = struct.pack("<IB3xQI", 5, 0, 7, 1) + rec
        self.assertEqual(p.decode_removals(body), (5, False, 7, [(7, 0xabc, 3, 0, p.NO_REMOVAL_MOUNT, 99, b"k1")]))
        with self.assertRaises(p.ProtocolError):
            p.decode_removals(struct.pack("<IB3xQI", 5, 1, 7, 1) + rec)
        with self.assertRaises(p.ProtocolError):
            p.decode_removals(body + b"x")
        self.assertEqual(p.subscribe_removals(1, 2, [3]), struct.pack("<QQII", 1, 2, 1, 3))
        self.assertEqual(p.decode_subscribed(struct.pack("<IQQH", 4, 5, 6, 2) + b"\x06memory\x04nvme"),
                         (4, 5, 6, ["memory", "nvme"]))


class TestRemovalsAgainstADaemon(unittest.TestCase):
    def setUp(self):
        self.d = Daemon(capacity="64MiB")
        self.addCleanup(self.d.stop)

    def test_a_subscriber_sees_each_delete_once_and_resumes_from_its_cursor(self):
        worker, wns, keys = stored(self, self.d, 6)
        router = kvhost.Client(self.d.socket)
        self.addCleanup(router.close)
        self.assertTrue(router.supports_removals)
        ns = router.declare(GEOMETRY)
        sub = router.subscribe_removals([ns])
        self.assertEqual(len(sub.mounts), 1, sub.mounts)  # the daemon's one mount
        self.assertIn(sub.mounts[0], ("memory", "nvme", "ssd", "hdd", "network", "unknown"))
        self.assertEqual(worker.delete(wns, keys[:2]), 2)
        self.assertEqual(removed(self, sub, 2, "deleted"), keys[:2])
        cursor = sub.cursor
        router.close()
        with self.assertRaises(kvhost.ConnectionLost):
            sub.get(timeout=60)

        # Deleted while no one listened: a subscription from the cursor,
        # on a new connection, gets exactly it.
        self.assertEqual(worker.delete(wns, keys[2:3]), 1)
        again = kvhost.Client(self.d.socket)
        self.addCleanup(again.close)
        sub = again.subscribe_removals(since=cursor)
        self.assertEqual(removed(self, sub, 1, "deleted"), keys[2:3])

        # A cursor of another epoch (a restarted daemon): a resync first.
        stale = again.subscribe_removals(since=(cursor[0] + 1, cursor[1]))
        b = stale.get(timeout=60)
        self.assertTrue(b.resync)
        self.assertEqual((b.removals, b.cursor[0]), ((), cursor[0]))
        stale.close()
        with self.assertRaises(kvhost.ConnectionLost):
            stale.get(timeout=60)

    def test_a_callback_gets_the_batches_of_a_purge(self):
        worker, wns, keys = stored(self, self.d, 4)
        router = kvhost.Client(self.d.socket)
        self.addCleanup(router.close)
        got, lock = [], threading.Lock()

        def on_batch(b):
            self.assertIsInstance(b, RemovalBatch)
            with lock:
                got.extend((r.key, r.reason, r.fingerprint) for r in b.removals)
        sub = router.subscribe_removals(callback=on_batch)
        self.addCleanup(sub.close)
        self.assertEqual(worker.purge(fingerprint=wns.fingerprint)["files"], 4)

        def all_four():
            with lock:
                return len(got) == 4
        wait_for(all_four, timeout=60, what="the purge's removals")
        with lock:
            self.assertEqual(sorted(got), sorted((k, "purged", wns.fingerprint) for k in keys))

    def test_a_reader_that_falls_behind_its_queue_gets_a_resync(self):
        worker, wns, keys = stored(self, self.d, 8)
        router = kvhost.Client(self.d.socket)
        self.addCleanup(router.close)
        sub = router.subscribe_removals(max_batches=2)
        self.addCleanup(sub.close)
        for k in keys:  # one batch each, read by no one meanwhile
            self.assertEqual(worker.delete(wns, [k]), 1)
        wait_for(lambda: router.stats()["keys"] == 0, what="the deletes")
        last = self.d_last(worker)
        seen, resyncs = [], 0
        while not seen or seen[-1] < last:
            b = sub.get(timeout=60)
            resyncs += b.resync
            seen.append(b.cursor[1])
        self.assertGreaterEqual(resyncs, 1, "the queue of 2 batches held 8")

    @staticmethod
    def d_last(c):
        """The daemon's last sequence number: a new subscription's."""
        s = c.subscribe_removals()
        try:
            return s.subscribed[1]
        finally:
            s.close()


class TestRemovalsAgainstAnOlderDaemon(unittest.TestCase):
    def test_a_daemon_without_the_feature_gets_no_subscription(self):
        for version, features in [(1, 0), (2, p.FEATURE_LAYER_LOADS)]:
            with self.subTest(version=version):
                fake = FakeDaemon()
                self.addCleanup(fake.close)
                t = threading.Thread(target=lambda: (fake.accept(), fake.welcome(version=version, features=features)))
                t.start()
                c = kvhost.Client(fake.path, timeout=30, lookup_table=False)
                self.addCleanup(c.close)
                t.join()
                self.assertFalse(c.supports_removals)
                with self.assertRaises(kvhost.UnsupportedError) as cm:
                    c.subscribe_removals()
                self.assertIn("announced none", str(cm.exception))


if __name__ == "__main__":
    unittest.main()
