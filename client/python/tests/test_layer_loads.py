"""Layer-range loads: Client.load(..., layers=(first, count)) and
Client.supports_layer_loads, against a real daemon and against fakes of a
daemon that predates them (docs/protocol.md, "Layer-range loads")."""

import random
import struct
import threading
import unittest

import kvhost
from kvhost import protocol as p

from daemon import Daemon
from test_client import FakeDaemon

LAYERS = 4
BLOCKS = 8
GEOMETRY = kvhost.Geometry(model="test/layer-loads", layers=LAYERS, kv_heads=2, head_size=64, dtype_size=2,
                           tokens_per_block=16, tokens_per_key=32)  # 2 blocks per key
PAGE = 2 * GEOMETRY.block_bytes  # a block's K and V planes in one layer
LAYER_BYTES = BLOCKS * PAGE  # one layer's tensor


def layer_cache(test):
    """A daemon and a client of it with a LAYERS-layer cache of BLOCKS
    blocks, layer l's tensor at l*LAYER_BYTES of one host buffer:
    (client, cache id, buffer). The test's cleanups stop them."""
    d = Daemon(capacity="64MiB")
    test.addCleanup(d.stop)
    buf = kvhost.HostBuffer(LAYERS * LAYER_BYTES)
    test.addCleanup(buf.close)
    c = kvhost.Client(d.socket)
    test.addCleanup(c.close)
    ns = c.declare(GEOMETRY)
    region = c.register_buffer(buf)
    cache = c.register_cache(ns.id, [kvhost.Layer(region, offset=l * LAYER_BYTES, block_stride=PAGE,
                                                  plane_stride=GEOMETRY.block_bytes, num_blocks=BLOCKS)
                                     for l in range(LAYERS)])
    return c, cache, buf


def block_span(layer, block):
    """The bytes of block in layer's tensor (its two planes)."""
    start = layer * LAYER_BYTES + block * PAGE
    return slice(start, start + PAGE)


class TestLayerRangeEncoding(unittest.TestCase):
    def test_a_load_layers_body_is_the_load_body_then_first_and_count(self):
        load = p.transfer(3, [b"k"], [[1, p.NO_BLOCK]], load=True)
        self.assertEqual(load + p.layer_range((2, 5)), load + struct.pack("<II", 2, 5))
        self.assertEqual(p.layer_range((0, 0)), bytes(8), "count 0 (every layer) with first 0")
        self.assertEqual(p.layer_range((p.MAX_LAYERS - 1, 1)), struct.pack("<II", p.MAX_LAYERS - 1, 1))

    def test_a_version_2_welcome_carries_the_features_after_the_server_name(self):
        fixed = struct.pack("<HH7I", 2, 0, 1 << 20, 64, 256, 16, 16, 4096, 64) + b"\x03new"
        for tail, features in [(struct.pack("<Q", p.FEATURE_LAYER_LOADS | 1 << 9) + b"later", 0x201), (b"", 0)]:
            with self.subTest(tail=tail):
                w = p.decode_welcome(fixed + tail)
                self.assertEqual((w["version"], w["server"], w["features"]), (2, "new", features))
        w = p.decode_welcome(struct.pack("<HH7I", 1, 0, 1 << 20, 64, 256, 16, 16, 4096, 64) + b"\x03old")
        self.assertEqual((w["version"], w["features"]), (1, 0), "a version-1 Welcome, to a version-2 Hello")
        with self.assertRaisesRegex(p.ProtocolError, "version 2; this client speaks version 1"):
            p.decode_welcome(fixed, version=1)


class TestLayerLoadsOnARealDaemon(unittest.TestCase):
    def test_the_daemon_announces_layer_loads_in_a_version_2_welcome(self):
        c, _, _ = layer_cache(self)
        self.assertEqual(c.limits["version"], 2)
        self.assertTrue(c.supports_layer_loads)

    def test_a_layer_range_load_fills_only_those_layers_of_its_blocks(self):
        c, cache, buf = layer_cache(self)
        v = buf.view
        v[:] = bytes(random.Random(84).randrange(256) for _ in range(len(v)))
        stored = bytes(v)
        self.assertEqual(c.store(cache, [b"lk"], [[0, 1]]).wait(30).outcomes(), ["stored"])
        v[:] = b"\xa5" * len(v)
        want = bytearray(v)
        for layer in (1, 2):
            for src, dst in ((0, 4), (1, 5)):
                want[block_span(layer, dst)] = stored[block_span(layer, src)]
        res = c.load(cache, [b"lk"], [[4, 5]], layers=(1, 2)).wait(30)
        self.assertEqual(res.outcomes(), ["loaded"], res.message)
        self.assertEqual(res.bytes, 2 * 2 * PAGE, "the bytes of 2 layers of 2 blocks")
        self.assertEqual(bytes(v), bytes(want), "bytes outside layers 1-2 of blocks 4-5 changed, or those not loaded")
        # count 0 is every layer; block=False as for a load.
        res = c.load(cache, [b"lk"], [[6, 7]], block=False, layers=(0, 0)).wait(30)
        self.assertEqual((res.outcomes(), res.bytes), (["loaded"], LAYERS * 2 * PAGE))
        for layer in range(LAYERS):
            self.assertEqual(bytes(v[block_span(layer, 6)]), stored[block_span(layer, 0)], f"layer {layer}")

    def test_one_job_per_layer_sent_at_once_fills_every_layer(self):
        # As a layer-wise connector loads: every layer's job sent before
        # the first is waited for, into the same blocks.
        c, cache, buf = layer_cache(self)
        v = buf.view
        v[:] = bytes(random.Random(85).randrange(256) for _ in range(len(v)))
        stored = bytes(v)
        self.assertEqual(c.store(cache, [b"k0", b"k1"], [[0, 1], [2, 3]]).wait(30).outcomes(), ["stored"] * 2)
        v[:] = b"\x5a" * len(v)
        jobs = [c.load(cache, [b"k0", b"k1"], [[4, 5], [6, 7]], block=False, layers=(layer, 1))
                for layer in range(LAYERS)]
        for layer, job in enumerate(jobs):
            res = job.wait(30)
            self.assertEqual((res.outcomes(), res.bytes), (["loaded"] * 2, 4 * PAGE), f"layer {layer}")
            for src, dst in ((0, 4), (1, 5), (2, 6), (3, 7)):
                self.assertEqual(bytes(v[block_span(layer, dst)]), stored[block_span(layer, src)],
                                 f"layer {layer} block {dst}")
            self.assertEqual(bytes(v[block_span(layer, 0)]), b"\x5a" * PAGE, "a block not named was written")

    def test_a_load_prepared_once_fills_each_layer_range_it_is_sent_for(self):
        # As the connector sends a step's layer groups: the keys and
        # blocks packed once, one job per range.
        c, cache, buf = layer_cache(self)
        v = buf.view
        v[:] = bytes(random.Random(86).randrange(256) for _ in range(len(v)))
        stored = bytes(v)
        self.assertEqual(c.store(cache, [b"k0", b"k1"], [[0, 1], [2, 3]]).wait(30).outcomes(), ["stored"] * 2)
        v[:] = b"\x3c" * len(v)
        prepared = c.prepare_load(cache, [b"k0", b"k1"], [[4, 5], [6, 7]])
        self.assertEqual(prepared.body, p.transfer(cache, [b"k0", b"k1"], [[4, 5], [6, 7]], load=True))
        jobs = [c.load_prepared(prepared, r, block=False) for r in ((0, 1), (1, 3))]
        for job, layers in zip(jobs, (1, 3)):
            res = job.wait(30)
            self.assertEqual((res.outcomes(), res.bytes), (["loaded"] * 2, layers * 4 * PAGE))
        for layer in range(LAYERS):
            for src, dst in ((0, 4), (1, 5), (2, 6), (3, 7)):
                self.assertEqual(bytes(v[block_span(layer, dst)]), stored[block_span(layer, src)],
                                 f"layer {layer} block {dst}")

    def test_a_load_prepared_without_layers_loads_every_layer(self):
        c, cache, buf = layer_cache(self)
        v = buf.view
        v[:] = bytes(random.Random(87).randrange(256) for _ in range(len(v)))
        stored = bytes(v)
        self.assertEqual(c.store(cache, [b"k0"], [[0, 1]]).wait(30).outcomes(), ["stored"])
        v[:] = b"\x3c" * len(v)
        res = c.load_prepared(c.prepare_load(cache, [b"k0"], [[4, 5]])).wait(30)
        self.assertEqual((res.outcomes(), res.bytes), (["loaded"], LAYERS * 2 * PAGE))
        for layer in range(LAYERS):
            for src, dst in ((0, 4), (1, 5)):
                self.assertEqual(bytes(v[block_span(layer, dst)]), stored[block_span(layer, src)],
                                 f"layer {layer} block {dst}")

    def test_prepare_load_refuses_what_load_refuses_before_sending(self):
        c, cache, _ = layer_cache(self)
        for keys, blocks, why in [([b"k"], [[1], [2]], "1 keys, 2 block lists"),
                                  ([b"k", b"j"], [[1], [2, 3]], "same number"),
                                  ([b"k"], [[p.NO_BLOCK]], "every block id is NO_BLOCK")]:
            with self.subTest(why):
                with self.assertRaisesRegex(ValueError, why):
                    c.prepare_load(cache, keys, blocks)
        prepared = c.prepare_load(cache, [b"k"], [[4, 5]])
        with self.assertRaisesRegex(ValueError, "count 0 means every layer"):
            c.load_prepared(prepared, (1, 0))
        self.assertTrue(c.connected())

    def test_a_range_past_the_namespaces_layers_is_refused_naming_it_and_the_connection_goes_on(self):
        c, cache, _ = layer_cache(self)
        for layers in [(3, 2), (LAYERS, 1), (0, LAYERS + 1)]:
            with self.subTest(layers=layers):
                with self.assertRaises(kvhost.KvhostError) as cm:
                    c.load(cache, [b"lk"], [[4, 5]], layers=layers)
                self.assertEqual(cm.exception.code, p.CODES.index("invalid argument"))
                self.assertIn(f"layer range first {layers[0]} count {layers[1]}", cm.exception.message)
                self.assertIn(f"{LAYERS} layers", cm.exception.message)
        self.assertTrue(c.connected())
        self.assertEqual(c.lookup(c.declare(GEOMETRY).id, [b"lk"]), 0)  # nothing stored: answered all the same

    def test_a_range_no_namespace_can_have_is_refused_before_sending(self):
        c, cache, _ = layer_cache(self)
        for layers, cls, why in [((4, 0), ValueError, "count 0 means every layer"),
                                 ((0, p.MAX_LAYERS + 1), ValueError, "ends past layer 4096"),
                                 ((p.MAX_LAYERS, 1), ValueError, "ends past layer 4096"),
                                 ((-1, 2), ValueError, "first layer -1"),
                                 ((0,), TypeError, "want (first, count)"),
                                 (("0", 1), TypeError, "first layer: str")]:
            with self.subTest(layers=layers):
                with self.assertRaises(cls) as cm:
                    c.load(cache, [b"lk"], [[4, 5]], layers=layers)
                self.assertIn(why, str(cm.exception))
        self.assertTrue(c.connected())


class TestLayerLoadsOnAnOlderDaemon(unittest.TestCase):
    def fake(self):
        fake = FakeDaemon()
        self.addCleanup(fake.close)
        return fake

    def test_a_daemon_without_the_feature_gets_no_layer_load(self):
        # A version-1 Welcome, and a version-2 one without the bit: the
        # load raises UnsupportedError and sends nothing (the next frame
        # the daemon reads is the lookup after it).
        for version, features in [(1, 0), (2, 0)]:
            with self.subTest(version=version):
                fake = self.fake()
                t = threading.Thread(target=lambda: (fake.accept(), fake.welcome(version=version, features=features)))
                t.start()
                c = kvhost.Client(fake.path, timeout=30, lookup_table=False)
                self.addCleanup(c.close)
                t.join()
                self.assertFalse(c.supports_layer_loads)
                with self.assertRaises(kvhost.UnsupportedError) as cm:
                    c.load(1, [b"k"], [[0]], layers=(0, 1))
                self.assertIn("announced no layer-range loads", str(cm.exception))
                got = []

                def daemon_side():
                    ftype, req_id, _ = fake.read_frame()
                    got.append(ftype)
                    fake.reply(ftype | p.T_REPLY, req_id, struct.pack("<I", 0))
                t = threading.Thread(target=daemon_side)
                t.start()
                self.assertEqual(c.touch(1, [b"k"]), 0)
                t.join()
                self.assertEqual(got, [p.T_LOOKUP])

    def test_a_daemon_that_refuses_version_2_is_spoken_to_in_version_1(self):
        # A daemon older than version 2 answers the Hello "unsupported
        # version" and closes; the client connects again in version 1.
        fake = self.fake()
        hellos = []

        def old_daemon():
            fake.accept()
            ftype, req_id, body = fake.read_frame()
            hellos.append(struct.unpack_from("<H", body, 8)[0])
            msg = b"client speaks version 2, this daemon speaks 1"
            fake.reply(p.T_ERROR, req_id, struct.pack("<BBH", p.CODE_VERSION, 0, len(msg)) + msg)
            fake.conn.close()
            fake.accept()
            ftype, req_id, body = fake.read_frame()
            hellos.append(struct.unpack_from("<H", body, 8)[0])
            fake.reply(p.T_HELLO | p.T_REPLY, req_id,
                       struct.pack("<HH7I", 1, 0, 4 << 20, 64, 256, 16, 16, 4096, 64) + b"\x03old")
        t = threading.Thread(target=old_daemon)
        t.start()
        c = kvhost.Client(fake.path, timeout=30, lookup_table=False)
        self.addCleanup(c.close)
        t.join()
        self.assertEqual(hellos, [2, 1])
        self.assertEqual((c.limits["version"], c.limits["server"], c.limits["features"]), (1, "old", 0))
        self.assertFalse(c.supports_layer_loads)
        self.assertTrue(c.connected())


if __name__ == "__main__":
    unittest.main()
