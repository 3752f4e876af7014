"""The client answers lookups from the daemon's shared lookup table and asks
the daemon only where the table cannot answer (a real daemon each)."""

import array
import contextlib
import hashlib
import os
import random
import shutil
import struct
import sys
import tempfile
import threading
import unittest
from unittest import mock

import kvhost
from kvhost import lookuptable
from daemon import Daemon, wait_for

GEOMETRY = kvhost.Geometry(model="test/lookup-table", layers=2, kv_heads=2, head_size=64, dtype_size=2,
                           tokens_per_block=16, tokens_per_key=16)


def stored_client(d, n, **kw):
    """A client of daemon d that stored n keys; returns (client, ns, keys)."""
    c = kvhost.Client(d.socket, **kw)
    ns = c.declare(GEOMETRY)
    page = 2 * GEOMETRY.block_bytes
    buf = kvhost.HostBuffer(GEOMETRY.layers * n * page)
    buf.view[:] = os.urandom(buf.size)
    region = c.register_buffer(buf)
    layers = [kvhost.Layer(region, offset=l * n * page, block_stride=page, plane_stride=GEOMETRY.block_bytes,
                           num_blocks=n) for l in range(GEOMETRY.layers)]
    cache = c.register_cache(ns.id, layers)
    keys = [f"table-key-{i}".encode() for i in range(n)]
    c.store(cache, keys, [[i] for i in range(n)]).wait(60)
    buf.close()  # the daemon maps the region on its own
    return c, ns, keys


@contextlib.contextmanager
def daemon_with_keys(n, shared, **kw):
    """A daemon (its mount's shared setting given) and a client of it that
    stored n keys: yields (daemon, client, ns, keys); stops both after."""
    d = Daemon(capacity="64MiB", after_toml=f"shared = {'true' if shared else 'false'}")
    try:
        c, ns, keys = stored_client(d, n, **kw)
        with c:
            yield d, c, ns, keys
    finally:
        d.stop()


class TestLookupTable(unittest.TestCase):
    def test_hits_and_final_misses_are_answered_without_the_daemon(self):
        with daemon_with_keys(8, shared=False) as (d, c, ns, keys):
            self.assertEqual(c.lookup(ns, keys), 8)
            self.assertEqual(c.lookup(ns, keys + [b"never-stored"]), 8)
            self.assertEqual(c.lookup(ns, [b"never-stored"] + keys), 0)
            self.assertEqual(c.lookup_counts(), {"table": 3, "daemon": 0})
            # A delete reaches the table before the daemon replies.
            self.assertEqual(c.delete(ns, keys[3:4]), 1)
            self.assertEqual(c.lookup(ns, keys), 3)
            # Another connection's view is the same table.
            with kvhost.Client(d.socket) as other:
                ns2 = other.declare(GEOMETRY)
                self.assertEqual(other.lookup(ns2, keys[:3]), 3)
                self.assertEqual(other.lookup_counts(), {"table": 1, "daemon": 0})

    def test_a_lookup_of_kept_digests_answers_as_a_lookup_of_its_keys(self):
        with daemon_with_keys(20, shared=False) as (_, c, ns, keys):
            digests = c.key_digests(ns, keys)
            self.assertEqual(len(digests), 16 * len(keys))
            before = c.lookup_counts()
            self.assertEqual(c.lookup_digests(ns, keys, digests), 20)
            asked = keys[:5] + [b"table-key-absent"] + keys[5:]
            self.assertEqual(c.lookup_digests(ns, asked, c.key_digests(ns, asked)), c.lookup(ns, asked))
            self.assertEqual(c.lookup(ns, asked), 5)
            after = c.lookup_counts()
            self.assertEqual(after["daemon"], before["daemon"], "the table answered every lookup")

    def test_only_touch_counts_hits_at_the_daemon(self):
        with daemon_with_keys(3, shared=False) as (d, c, ns, keys):
            hits = c.stats()["hits"]
            self.assertEqual(c.lookup(ns, keys), 3)
            self.assertEqual(c.stats()["hits"], hits, "a lookup from the table reached the daemon")
            self.assertEqual(c.touch(ns, keys), 3)
            wait_for(lambda: c.stats()["hits"] >= hits + 3, what="3 hits counted by touch")
            self.assertEqual(c.lookup_counts(), {"table": 1, "daemon": 1})

    def test_on_a_shared_mount_the_daemon_is_asked_from_the_first_key_the_table_lacks(self):
        with daemon_with_keys(4, shared=True) as (d, c, ns, keys):
            self.assertEqual(c.lookup(ns, keys), 4)
            self.assertEqual(c.lookup_counts(), {"table": 1, "daemon": 0})
            self.assertEqual(c.lookup(ns, keys + [b"elsewhere"]), 4)
            self.assertEqual(c.lookup_counts(), {"table": 1, "daemon": 1})

    def test_the_daemon_answers_where_no_table_is_kept_or_wanted(self):
        cases = [("kept none", 'lookup_table = false', {}), ("not wanted", "", {"lookup_table": False})]
        for name, engine, kw in cases:
            with self.subTest(name):
                d = Daemon(capacity="64MiB", extra_toml=f"[engine]\n{engine}\n")
                try:
                    c, ns, keys = stored_client(d, 2, **kw)
                    with c:
                        self.assertEqual(c.lookup(ns, keys), 2)
                        self.assertEqual(c.lookup(ns, [b"missing"]), 0)
                        self.assertEqual(c.lookup_counts(), {"table": 0, "daemon": 2})
                finally:
                    d.stop()

    def test_the_table_is_readable_by_the_sockets_users_only(self):
        d = Daemon(capacity="64MiB")
        try:
            mode = os.stat(d.socket + ".lookup").st_mode & 0o777
            self.assertEqual(mode, 0o440, oct(mode))  # the socket's 0660, read bits only
        finally:
            d.stop()
        self.assertFalse(os.path.exists(d.socket + ".lookup"), "the table outlived its daemon")

    def test_where_the_python_probes_loads_may_be_reordered_the_daemon_answers(self):
        # As on arm64 without kvhost._lookup: no C probe, loads not ordered.
        with mock.patch.object(lookuptable, "_lookup", None), \
                mock.patch.object(lookuptable, "ORDERED_LOADS", False, create=True):
            with daemon_with_keys(4, shared=False) as (d, c, ns, keys):
                self.assertEqual(c.lookup(ns, keys), 4)
                self.assertEqual(c.lookup(ns, keys[:2] + [b"never-stored"]), 2)
                self.assertEqual(c.lookup_counts(), {"table": 0, "daemon": 2})


    def test_a_lookup_that_close_overtakes_raises_connection_lost_and_the_table_is_unmapped(self):
        # Another thread may close the client while a lookup runs: here the
        # keys' own len() (which both probes ask) closes it mid-lookup.
        for native in (True, False):
            with self.subTest(native=native):
                if native:
                    need_native(self)
                else:
                    need_python_probe(self)
                with contextlib.ExitStack() as stack:
                    if not native:
                        stack.enter_context(mock.patch.object(lookuptable, "_lookup", None))
                    d, c, ns, keys = stack.enter_context(daemon_with_keys(2, shared=True))
                    self.assertEqual(c.lookup(ns, keys), 2)  # the table mapped
                    path = c._table.path

                    class Closing(list):
                        def __len__(self):
                            c.close()
                            return super().__len__()

                    # The first key is not in the table: the daemon is asked.
                    with self.assertRaises(kvhost.ConnectionLost):
                        c.lookup(ns, Closing([b"elsewhere"] + keys))
                    with open("/proc/self/maps") as f:
                        self.assertNotIn(path, f.read(), "the table still mapped after close")


class TestLookupTableFormat(unittest.TestCase):
    def test_files_that_are_not_tables_are_refused(self):
        with tempfile.TemporaryDirectory() as tmp:
            good = bytearray(lookuptable.HEADER_SIZE + 8 * lookuptable.MIN_SLOTS)
            good[:8] = lookuptable.MAGIC
            struct.pack_into("<II", good, 8, lookuptable.VERSION, 10)
            cases = {
                "short": bytes(good[:100]),
                "bad magic": b"X" + bytes(good[1:]),
                "other version": bytes(good[:8]) + struct.pack("<II", 9, 10) + bytes(good[16:]),
                "size disagrees": bytes(good) + bytes(8),
            }
            path = os.path.join(tmp, "t")
            with open(path, "wb") as f:
                f.write(good)
            lookuptable.LookupTable(path).close()  # the well-formed one opens
            for name, data in cases.items():
                with self.subTest(name):
                    with open(path, "wb") as f:
                        f.write(data)
                    with self.assertRaises(lookuptable.FormatError):
                        lookuptable.LookupTable(path)

    def test_a_path_that_is_not_a_regular_file_is_refused_without_blocking(self):
        # The daemon names the table's path: open() of a FIFO there
        # waited for a writer, forever, on the thread of a lookup.
        tmp = tempfile.mkdtemp(prefix="kvhost-table-")
        self.addCleanup(shutil.rmtree, tmp, ignore_errors=True)
        fifo = os.path.join(tmp, "fifo")
        os.mkfifo(fifo)
        for name, path in (("a FIFO", fifo), ("a directory", tmp), ("a character device", "/dev/zero")):
            with self.subTest(name):
                got = []

                def open_table():
                    try:
                        lookuptable.LookupTable(path).close()
                    except Exception as e:  # handed to the test
                        got.append(e)
                t = threading.Thread(target=open_table, daemon=True)
                t.start()
                t.join(30)
                if t.is_alive():  # blocked opening the FIFO: a writer lets it go
                    os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
                    t.join(30)
                    self.fail(f"LookupTable({path!r}) blocked")
                self.assertEqual(len(got), 1, f"LookupTable({path!r}) opened")
                self.assertIsInstance(got[0], lookuptable.FormatError)
                self.assertIn(path, str(got[0]))
                self.assertIn("not a regular file", str(got[0]))

    def test_only_x86_64_performs_the_python_probes_loads_in_order(self):
        for machine, want in [("x86_64", True), ("AMD64", True), ("aarch64", False), ("arm64", False),
                              ("ppc64le", False), ("riscv64", False), ("s390x", False)]:
            self.assertEqual(lookuptable.loads_ordered(machine), want, machine)

    def test_where_loads_may_be_reordered_the_python_probe_checks_the_keys_and_declines(self):
        with tempfile.TemporaryDirectory() as tmp, \
                mock.patch.object(lookuptable, "ORDERED_LOADS", False, create=True):
            path = os.path.join(tmp, "t")
            write_table(path, 10, 7, [b"k"])
            t = lookuptable.LookupTable(path, native=False)
            self.assertIsNone(t.leading(7, [b"k"]))
            with self.assertRaises(ValueError):
                t.leading(7, [b"x" * 65])
            t.close()
            if lookuptable.NATIVE:  # the C probe orders its loads itself
                t = lookuptable.LookupTable(path)
                self.assertEqual(t.leading(7, [b"k"]), (1, True))
                t.close()

    def test_key_hash_matches_the_daemons(self):
        # internal/lookuptable's TestHashIsTheFormatsKnownAnswer holds the
        # daemon to the same pair.
        self.assertEqual(lookuptable.key_hash(0x0102030405060708, b"key-1"), (4970651553208285916, 364090413704195124))


def write_table(path, shift, fp, keys, seq=2, flags=lookuptable.FLAG_MISSES_FINAL, removed=()):
    """Writes a table of 2^shift slots holding keys of namespace fp, in the
    daemon's format (internal/lookuptable: linear probing from the home
    slot), then marks the slots of the keys in removed as removed (1)."""
    mask = (1 << shift) - 1
    slots = [0] * (1 << shift)
    at = {}
    for k in keys:
        tag, home = lookuptable.key_hash(fp, k)
        j = home & mask
        while slots[j] not in (0, tag):
            j = (j + 1) & mask
        slots[j] = tag
        at[k] = j
    for k in removed:
        slots[at[k]] = 1
    header = bytearray(lookuptable.HEADER_SIZE)
    header[:8] = lookuptable.MAGIC
    struct.pack_into("<IIQQ", header, 8, lookuptable.VERSION, shift, seq, flags)
    with open(path, "wb") as f:
        f.write(bytes(header) + struct.pack(f"<{len(slots)}Q", *slots))


def need_native(test):
    """Fails test where the build promised the C probe (make sets
    KVHOST_EXPECT_NATIVE=1) and it is missing; skips it elsewhere."""
    if lookuptable.NATIVE is None:
        if os.environ.get("KVHOST_EXPECT_NATIVE") == "1":
            test.fail("kvhost._lookup is not built (make python-ext builds it)")
        test.skipTest("kvhost._lookup is not built here (make python-ext)")


def need_python_probe(test):
    """Skips test where the Python probe sends every lookup to the daemon
    (lookuptable.loads_ordered)."""
    if not lookuptable.ORDERED_LOADS:
        test.skipTest("the Python probe does not answer on this CPU: it cannot order its loads")


class TestNativeProbe(unittest.TestCase):
    def test_digests_match_hashlib_for_every_key_length(self):
        need_native(self)
        from kvhost import _lookup
        if _lookup.SHA256 != "sha-ni":
            with self.subTest("sha-ni"):
                self.skipTest(f"this CPU has no SHA extensions ({_lookup.SHA256}): only the portable compression runs")
        rng = random.Random(1)
        for n in range(1, 65):  # 1 and 2 blocks, both sides of the 55-byte edge
            for _ in range(20):
                key, fp = rng.randbytes(n), rng.getrandbits(64)
                want = hashlib.sha256(struct.pack("<Q", fp) + key).digest()
                self.assertEqual(_lookup.digest(fp, key), want, f"{_lookup.SHA256}, {n}-byte key")
                self.assertEqual(_lookup.digest(fp, key, portable=True), want, f"portable, {n}-byte key")

    def test_native_and_python_probes_answer_alike(self):
        need_native(self)
        need_python_probe(self)
        rng = random.Random(2)
        fp = rng.getrandbits(64)
        # 700 keys in 1024 slots: long probe chains, wrapping at the end.
        stored = [rng.randbytes(rng.randint(1, 64)) for _ in range(700)]
        absent = [rng.randbytes(32) for _ in range(50)]
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "t")
            for flags in (lookuptable.FLAG_MISSES_FINAL, 0,
                          lookuptable.FLAG_MISSES_FINAL | lookuptable.FLAG_INCOMPLETE):
                write_table(path, 10, fp, stored, flags=flags)
                native, python = lookuptable.LookupTable(path), lookuptable.LookupTable(path, native=False)
                self.assertTrue(native.native)
                self.assertFalse(python.native)
                for _ in range(300):
                    keys = rng.sample(stored, rng.randint(1, 16))
                    if rng.random() < 0.5:
                        keys.insert(rng.randint(0, len(keys)), rng.choice(absent))
                    want = python.leading(fp, keys)
                    self.assertEqual(native.leading(fp, keys), want, flags)
                    self.assertEqual(native.leading(fp, tuple(keys)), want)
                    self.assertEqual(native.leading(fp, [bytearray(k) for k in keys]), want)
                self.assertEqual(native.leading(fp, stored), (700, flags == lookuptable.FLAG_MISSES_FINAL))
                for at in (31, 32, 100):  # a miss past the C probe's first batch of 32
                    keys = stored[:at] + absent[:1] + stored[at:at + 40]
                    self.assertEqual(native.leading(fp, keys), python.leading(fp, keys))
                    self.assertEqual(native.leading(fp, keys)[0], at)
                self.assertEqual(native.leading(fp ^ 1, stored[:5])[0], 0, "another namespace's keys")
                native.close()
                python.close()

    def test_probes_of_kept_digests_answer_as_probes_of_their_keys(self):
        need_native(self)
        need_python_probe(self)
        rng = random.Random(3)
        fp = rng.getrandbits(64)
        stored = [rng.randbytes(rng.randint(1, 64)) for _ in range(700)]
        absent = [rng.randbytes(32) for _ in range(50)]
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "t")
            write_table(path, 10, fp, stored)
            for native in (True, False):
                t = lookuptable.LookupTable(path, native=native)
                self.addCleanup(t.close)
                place = {k: t.digest(fp, k) for k in stored + absent}
                self.assertEqual(place[stored[0]], hashlib.sha256(struct.pack("<Q", fp) + stored[0]).digest()[:16])
                for _ in range(200):
                    keys = rng.sample(stored, rng.randint(1, 40))
                    if rng.random() < 0.5:
                        keys.insert(rng.randint(0, len(keys)), rng.choice(absent))
                    digests = b"".join(place[k] for k in keys)
                    self.assertEqual(t.leading_digests(digests), t.leading(fp, keys), native)
                    self.assertEqual(t.leading_digests(bytearray(digests)), t.leading(fp, keys), native)
                keys = stored[:40] + absent[:1]  # a miss past the first batch of 32
                self.assertEqual(t.leading_digests(b"".join(place[k] for k in keys))[0], 40)
                for bad in (b"", b"x" * 15, b"x" * 17, b"x" * 16 * 4097):
                    with self.assertRaises(ValueError, msg=f"{len(bad)} bytes, native {native}"):
                        t.leading_digests(bad)
                with self.assertRaises(ValueError):
                    t.digest(fp, b"")  # a key the protocol refuses

    def test_removed_slots_are_passed_over_and_their_keys_miss(self):
        need_native(self)
        need_python_probe(self)
        rng = random.Random(3)
        fp = rng.getrandbits(64)
        stored = [rng.randbytes(32) for _ in range(700)]
        removed = stored[::7]
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "t")
            write_table(path, 10, fp, stored, removed=removed)
            native, python = lookuptable.LookupTable(path), lookuptable.LookupTable(path, native=False)
            for k in stored:
                want = (0, True) if k in removed else (1, True)
                self.assertEqual(python.leading(fp, [k]), want)
                self.assertEqual(native.leading(fp, [k]), want)
            native.close()
            python.close()

    def test_a_key_whose_buffer_empties_the_list_cannot_pull_it_from_under_the_probe(self):
        need_native(self)
        if sys.version_info < (3, 12):
            self.skipTest("before Python 3.12 a key's buffer runs no Python code (no __buffer__)")
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "t")
            write_table(path, 10, 7, [b"a", b"b"])
            t = lookuptable.LookupTable(path)
            keys = [b"a"]

            class Emptying:
                def __buffer__(self, flags):
                    keys.clear()  # runs while the probe reads the keys
                    return memoryview(b"b")

            keys += [Emptying(), b"c" * 8]
            self.assertEqual(t.leading(7, keys), (2, True))  # the keys as passed
            t.close()

    def test_a_table_being_rebuilt_or_closed_sends_the_probe_to_the_daemon(self):
        need_native(self)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "t")
            for name, seq, flags in [("rebuilding", 3, lookuptable.FLAG_MISSES_FINAL),
                                     ("closed", 2, lookuptable.FLAG_CLOSED)]:
                with self.subTest(name):
                    write_table(path, 10, 7, [b"k"], seq=seq, flags=flags)
                    for native in (True, False):
                        t = lookuptable.LookupTable(path, native=native)
                        self.assertIsNone(t.leading(7, [b"k"]), f"native={native}")
                        t.close()

    def test_keys_the_protocol_refuses_are_refused(self):
        need_native(self)
        from kvhost import _lookup
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "t")
            write_table(path, 10, 7, [b"k"])
            t = lookuptable.LookupTable(path)
            wide = array.array("Q", range(9))  # 9 items, 72 bytes
            cases = [("empty", [b""], ValueError), ("65 bytes", [b"x" * 65], ValueError),
                     ("not bytes", [17], TypeError), ("not a sequence", 17, TypeError),
                     ("an iterator", iter([b"k"]), TypeError), ("72 bytes in 9 items", [wide], ValueError),
                     ("after a miss", [b"absent", b"x" * 65], ValueError)]
            for name, keys, err in cases:
                for native in (True, False):
                    with self.subTest(name, native=native):
                        probe = lookuptable.LookupTable(path, native=native)
                        with self.assertRaises(err):
                            probe.leading(7, keys)
                        probe.close()
            with self.assertRaises(OverflowError):  # a fingerprint is a u64
                t.leading(-1, [b"k"])
            with self.assertRaises(OverflowError):
                t.leading(1 << 64, [b"k"])
            with self.assertRaises(ValueError):  # a buffer shorter than its slots
                _lookup.leading(bytes(100), 10, 7, [b"k"])
            with self.assertRaises(ValueError):  # slots not 8-byte aligned
                _lookup.leading(memoryview(bytes(64 + 8 * 1024 + 8))[1:], 10, 7, [b"k"])
            t.close()

    def test_a_slot_shift_outside_0_to_30_is_refused_not_wrapped(self):
        need_native(self)
        from kvhost import _lookup
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "t")
            write_table(path, 10, 7, [b"k"])
            with open(path, "rb") as f:
                table = f.read()
            self.assertEqual(_lookup.leading(table, 10, 7, [b"k"]), (1, True))
            for shift in (-1, 31, (1 << 32) + 10, 1 << 64):
                with self.subTest(shift=shift):
                    with self.assertRaises(ValueError) as cm:
                        _lookup.leading(table, shift, 7, [b"k"])
                    self.assertIn(f"shift {shift}", str(cm.exception))


if __name__ == "__main__":
    unittest.main()
