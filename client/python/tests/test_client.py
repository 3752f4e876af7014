"""The kvhost Python client: connection setup, the default socket, and the
CUDA IPC and shared-file registrations (what goes on the wire, and what a
daemon without GPU support answers)."""

import ctypes
import dataclasses
import fcntl
import gc
import os
import pickle
import random
import shutil
import signal
import socket
import struct
import tempfile
import threading
import unittest
import warnings
import weakref
from unittest import mock

import kvhost
from kvhost import protocol as p

from daemon import Daemon, socket_dir, wait_for

F_GET_SEALS = getattr(fcntl, "F_GET_SEALS", 1034)
F_SEAL_SHRINK = getattr(fcntl, "F_SEAL_SHRINK", 2)


def open_fds():
    return len(os.listdir("/proc/self/fd"))


class FakeStorage:
    def __init__(self, share):
        self._share = share

    def _share_cuda_(self):
        return self._share


class FakeCudaTensor:
    """Stands in for a torch CUDA tensor: only what register_cuda_tensor
    reads (is_cuda, untyped_storage()._share_cuda_())."""

    def __init__(self, share, is_cuda=True):
        self.is_cuda = is_cuda
        self._storage = FakeStorage(share)

    def untyped_storage(self):
        return self._storage


def torch_share(device, handle, size, offset):
    """The 8-tuple torch 2.x's UntypedStorage._share_cuda_() returns."""
    return (device, handle, size, offset, b"refcounter", 0, b"\x00" * 64, True)


def decode_register(body):
    kind, device, size, offset = struct.unpack_from("<B3xIQQ", body)
    return kind, device, size, offset, body[24:88]


class Captured:
    """Replaces Client._call: records requests, answers MemoryRegistered."""

    def __init__(self):
        self.calls = []

    def __call__(self, ftype, body, fds=None, undo=None):
        self.calls.append((ftype, body, fds))
        return ftype | p.T_REPLY, struct.pack("<IIQ", 7, 0, 0)


def offline_client():
    """A Client object with no connection, whose requests are captured."""
    c = kvhost.Client.__new__(kvhost.Client)
    c._call = Captured()
    return c


class TestConnect(unittest.TestCase):
    def test_failed_connect_closes_its_socket(self):
        # A socket left open is closed by the garbage collector with a
        # ResourceWarning; the client must close it itself.
        before = open_fds()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ResourceWarning)
            for _ in range(20):
                try:
                    kvhost.Client("/nonexistent/kvhost.sock")
                    self.fail("connected to a socket that does not exist")
                except OSError:
                    pass
            gc.collect()
        leaked = [w for w in caught if issubclass(w.category, ResourceWarning)]
        self.assertEqual(leaked, [], "sockets of failed connects left to the garbage collector")
        self.assertEqual(open_fds(), before, "sockets leaked by failed connects")

    def test_peer_pid_names_the_daemons_process(self):
        daemon = Daemon()
        self.addCleanup(daemon.stop)
        with kvhost.Client(daemon.socket) as c:
            self.assertEqual(c.peer_pid(), daemon.proc.pid)
        self.assertIsNone(c.peer_pid())  # closed: nothing to ask

    def test_default_socket(self):
        cases = [
            ({"KVHOST_SOCKET": "/run/kvhost/kvhost.sock", "XDG_RUNTIME_DIR": "/run/user/7"}, "/run/kvhost/kvhost.sock"),
            ({"XDG_RUNTIME_DIR": "/run/user/7"}, "/run/user/7/kvhost.sock"),
            ({"XDG_CACHE_HOME": "/tmp/xdg", "HOME": "/home/u"}, "/tmp/xdg/kvhost/kvhost.sock"),
            ({"HOME": "/home/u"}, "/home/u/.cache/kvhost/kvhost.sock"),
        ]
        for env, want in cases:
            with self.subTest(env=env), mock.patch.dict(os.environ, env, clear=True):
                self.assertEqual(kvhost.default_socket(), want)

    def test_connection_error_names_the_socket(self):
        for path, cls in [("/nonexistent/kvhost.sock", FileNotFoundError)]:
            with self.assertRaises(cls) as cm:
                kvhost.Client(path)
            self.assertIn(path, str(cm.exception))
            self.assertEqual(cm.exception.filename, path)
            self.assertIn("KVHOST_SOCKET", str(cm.exception))

    def test_a_welcome_with_a_max_frame_outside_64_kib_to_1_gib_is_refused(self):
        # docs/protocol.md bounds max_frame, and the reader takes a frame
        # as long as it says: a daemon's 4 GiB would be read.
        for max_frame in (p.MIN_FRAME - 1, (1 << 30) + 1, 0xFFFFFFFF):
            with self.subTest(max_frame=max_frame):
                before = open_fds()
                fake = FakeDaemon()
                t = threading.Thread(target=lambda: (fake.accept(), fake.welcome(max_frame)))
                t.start()
                try:
                    with self.assertRaises(p.ProtocolError):
                        kvhost.Client(fake.path, timeout=5)
                finally:
                    t.join()
                    fake.close()
                self.assertEqual(open_fds(), before, "the refused connection's socket left open")

    def test_a_welcome_of_another_protocol_version_is_refused(self):
        # A daemon of another version frames its messages its own way:
        # the client refuses it at the handshake, naming both versions, as
        # the Go client does.
        for version in (0, p.VERSION + 1):
            with self.subTest(version=version):
                fake = FakeDaemon()
                t = threading.Thread(target=lambda: (fake.accept(), fake.welcome(version=version)))
                t.start()
                try:
                    with self.assertRaisesRegex(p.ProtocolError, f"version {version}"):
                        kvhost.Client(fake.path, timeout=5)
                finally:
                    t.join()
                    fake.close()

    def test_client_without_path_uses_kvhost_socket(self):
        d = Daemon()
        try:
            with mock.patch.dict(os.environ, {"KVHOST_SOCKET": d.socket}):
                with kvhost.Client(name="env") as c:
                    self.assertEqual(c.stats()["clients"], 1)
        finally:
            d.stop()


class TestStalledListener(unittest.TestCase):
    """A socket whose listener takes no connection: a stalled daemon, or
    any other process bound there."""

    def listener(self):
        """A listening socket with a backlog of one, which nothing
        accepts from: (its path, the socket)."""
        d = socket_dir("kvhost-stalled-")
        self.addCleanup(shutil.rmtree, d, ignore_errors=True)
        path = os.path.join(d, "stalled.sock")
        lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.addCleanup(lsock.close)
        lsock.bind(path)
        lsock.listen(0)
        return path, lsock

    def fill_backlog(self, path):
        """Connects to path until its listen backlog is full: a blocking
        connect then waits for the listener to accept."""
        while True:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            try:
                s.connect(path)
            except BlockingIOError:
                s.close()
                return
            self.addCleanup(s.close)

    def test_a_listener_that_accepts_nothing_fails_the_client_in_its_timeout_naming_the_socket(self):
        # vLLM's workers make their clients at start-up: a connect that
        # waited for a stalled daemon's full backlog hung them silently.
        for name, full in (("backlog full", True), ("queued, never accepted", False)):
            with self.subTest(name):
                path, _ = self.listener()
                if full:
                    self.fill_backlog(path)
                got = []

                def connect():
                    try:
                        kvhost.Client(path, timeout=0.5)
                    except BaseException as e:  # handed to the test
                        got.append(e)
                t = threading.Thread(target=connect, daemon=True)
                t.start()
                t.join(60)
                self.assertFalse(t.is_alive(), "Client() still waits for the listener, past its timeout")
                self.assertEqual(len(got), 1, "Client() connected to a listener that accepts nothing")
                self.assertIsInstance(got[0], TimeoutError)
                self.assertIn(path, str(got[0]))
                self.assertEqual(got[0].filename, path)


    def connect_syscall(self):
        """The number of the connect system call, as /proc shows it: that
        of a thread blocked connecting to a full backlog."""
        path, lsock = self.listener()
        self.fill_backlog(path)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.addCleanup(s.close)
        tid = []

        def blocked():
            tid.append(threading.get_native_id())
            try:
                s.connect(path)
            except OSError:  # the listener closed
                pass
        t = threading.Thread(target=blocked, daemon=True)
        t.start()
        wait_for(lambda: tid, what="the thread to start")
        nr = wait_for(lambda: in_syscall(tid[0]), what="the thread to block connecting")
        lsock.close()  # wakes the connect
        t.join(60)
        return nr

    def test_a_signal_while_connecting_is_not_taken_for_a_connection(self):
        # CPython takes a connect the signal interrupted for one that goes
        # on in the background, waits for the socket to be writable (an
        # unconnected Unix socket is) and returns as if connected: the
        # Hello then failed with "not connected".
        connect_nr = self.connect_syscall()
        fake = FakeDaemon()
        self.addCleanup(fake.close)
        fake.listener.listen(0)
        self.fill_backlog(fake.path)
        signalled = threading.Event()
        old = signal.signal(signal.SIGUSR1, lambda *_: signalled.set())
        self.addCleanup(signal.signal, signal.SIGUSR1, old)
        main = threading.get_native_id()

        def daemon_side():
            wait_for(lambda: in_syscall(main) == connect_nr, what="the client to block connecting")
            signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)
            signalled.wait(60)
            try:
                fake.accept()  # the connection filling the backlog
                fake.conn.close()
                fake.accept()  # the client's
                fake.welcome()
            except OSError:  # shut down: the client gave up
                pass
        t = threading.Thread(target=daemon_side, daemon=True)
        t.start()
        try:
            c = kvhost.Client(fake.path, timeout=30)
        finally:
            if t.is_alive():  # the client gave up: no connection of its to accept
                fake.listener.shutdown(socket.SHUT_RDWR)
            t.join(60)
        self.addCleanup(c.close)
        self.assertTrue(signalled.is_set(), "no signal came while the client connected")
        self.assertTrue(c.connected())


def in_syscall(tid):
    """The number of the system call thread tid of this process is in, or
    None where it runs (or /proc says nothing)."""
    try:
        with open(f"/proc/self/task/{tid}/syscall") as f:
            first = f.read().split()[0]
    except (OSError, IndexError):
        return None
    return int(first) if first.isdigit() else None


class TestLostConnection(unittest.TestCase):
    def test_errors_after_the_daemon_left_are_fresh_and_keep_no_callers_frames(self):
        # The client keeps the error that closed its connection and raises
        # it to every later call. Raising the one object again chained each
        # caller's frames onto its traceback, which the client holds: a
        # caller's locals (a vLLM tier, vLLM's region) then lived until the
        # garbage collector ran.
        d = Daemon()
        self.addCleanup(d.stop)
        c = kvhost.Client(d.socket)
        self.addCleanup(c.close)
        d.halt()
        gc.disable()
        self.addCleanup(gc.enable)

        class Held:
            pass

        def call(held):
            try:
                c.stats()
            except kvhost.ConnectionLost as e:
                return str(e)  # the caller is done with e: nothing else holds this frame
            self.fail("a request after the daemon left succeeded")

        said, refs = [], []
        for _ in range(3):
            held = Held()
            refs.append(weakref.ref(held))
            said.append(call(held))
            del held
        self.assertEqual(said, [said[0]] * 3, "each call after the loss says why")
        self.assertEqual([r() for r in refs], [None] * 3, "a caller's locals kept alive by the client")


    def test_the_daemons_error_that_ends_the_connection_is_a_connection_lost_with_its_code(self):
        # The daemon closes a connection idle for idle_timeout after an
        # Error(timed out) with request id 0: a caller that catches
        # ConnectionLost to connect again must see it as one.
        d = Daemon(server_toml='idle_timeout = "1s"')
        self.addCleanup(d.stop)
        c = kvhost.Client(d.socket)
        self.addCleanup(c.close)
        wait_for(lambda: not c.connected(), what="the daemon to close the idle connection")
        with self.assertRaises(kvhost.ConnectionLost) as cm:
            c.stats()
        self.assertEqual(cm.exception.code, p.CODES.index("timed out"))
        self.assertIn("idle", str(cm.exception))
        self.assertIn("timed out", str(cm.exception))


    def test_jobs_end_with_the_daemons_error_about_the_connection_once_it_closes(self):
        # The daemon ends the jobs it runs on the caller's memory before it
        # closes: they end then, not at its Error, and with it.
        fake, c = connected_to_fake(self, timeout=5)
        job = c.store(1, [b"k"], [[0]], block=False)
        ftype, req_id, _ = fake.read_frame()
        fake.reply(ftype | p.T_REPLY, req_id, struct.pack("<Q", 7))
        why = b"a frame did not complete within 10s"
        fake.reply(p.T_ERROR, 0, struct.pack("<BBH", p.CODES.index("timed out"), 0, len(why)) + why)
        wait_for(lambda: not c.connected(), what="the client to stop sending")
        self.assertEqual(fake.conn.recv(1), b"", "the client's side still open for writing")
        with self.assertRaises(TimeoutError):  # ending it at the daemon's Error took well under this
            job.wait(0.5)
        fake.conn.close()
        with self.assertRaises(kvhost.ConnectionLost) as cm:
            job.wait(30)
        self.assertEqual(cm.exception.code, p.CODES.index("timed out"))
        self.assertEqual(cm.exception.message, why.decode())


GEOMETRY = kvhost.Geometry(model="test/client", layers=1, kv_heads=2, head_size=64, dtype_size=2,
                           tokens_per_block=16, tokens_per_key=16)


def cache_client(d, blocks=8, timeout=None, **kw):
    """A client of daemon d with a cache of blocks blocks over a host
    buffer: (client, cache id, buffer). A timeout given bounds the waits
    after the set-up (Client.set_timeout), not the set-up itself, which a
    loaded machine may slow past a timeout meant for the step under test."""
    c = kvhost.Client(d.socket, **kw)
    ns = c.declare(GEOMETRY)
    page = 2 * GEOMETRY.block_bytes
    buf = kvhost.HostBuffer(blocks * page)
    region = c.register_buffer(buf)
    cache = c.register_cache(ns.id, [kvhost.Layer(region, offset=0, block_stride=page,
                                                  plane_stride=GEOMETRY.block_bytes, num_blocks=blocks)])
    if timeout is not None:
        c.set_timeout(timeout)
    return c, cache, buf


class TestJobsWithoutBlocking(unittest.TestCase):
    """store/load with block=False: the caller (vLLM's worker thread) never
    waits on the daemon's answer."""

    def setUp(self):
        self.d = Daemon()
        self.addCleanup(self.d.stop)

    def client(self, **kw):
        c, cache, buf = cache_client(self.d, **kw)
        self.addCleanup(buf.close)
        self.addCleanup(c.close)
        return c, cache

    def test_a_job_sent_to_a_frozen_daemon_returns_at_once_and_completes_once_it_runs(self):
        # With block=True the call waits for the daemon's acceptance: on a
        # frozen daemon, the client's timeout (2 s here), then TimeoutError.
        c, cache = self.client(timeout=2)
        self.d.freeze()
        try:
            job = c.store(cache, [b"frozen-0", b"frozen-1"], [[0], [1]], block=False)
            self.assertIsNone(job.id)
            self.assertFalse(job.done())
        finally:
            self.d.thaw()
        res = job.wait(30)
        self.assertIsNotNone(job.id)
        self.assertEqual(res.outcomes(), ["stored", "stored"])
        got = c.load(cache, [b"frozen-0"], [[2]], block=False).wait(30)
        self.assertEqual(got.outcomes(), ["loaded"])

    def test_a_refused_job_raises_the_daemons_error_from_wait(self):
        c, cache = self.client()
        job = c.load(cache + 99, [b"no-such-cache"], [[0]], block=False)
        with self.assertRaises(kvhost.KvhostError) as e:
            job.wait(30)
        self.assertIn("cache", str(e.exception))
        self.assertFalse(job.cancel(), "a refused job is not in flight")
        self.assertTrue(c.connected(), "a refusal keeps the connection")

    def test_a_daemon_that_reads_nothing_for_the_timeout_stops_the_sending_not_its_jobs(self):
        # Sends fill the socket's buffer of a frozen daemon; the one that
        # cannot go on within the client's timeout raises ConnectionLost
        # (part of a frame may be on the socket) instead of blocking its
        # caller for good, and no request is sent after it. The jobs sent
        # before stay in flight until the daemon ends them: it may run
        # them when it resumes, and their memory is not the caller's again
        # before that.
        c, cache = self.client(timeout=0.5)
        keys = [b"k%07d" % i for i in range(p.MAX_KEYS_PER_REQUEST)]
        blocks = [[0]] * len(keys)
        self.d.freeze()
        jobs = []
        try:
            with self.assertRaises(kvhost.ConnectionLost):
                for _ in range(10000):
                    jobs.append(c.store(cache, keys, blocks, block=False))
            self.assertTrue(jobs, "the socket's buffer took no request")
            self.assertFalse(c.connected())
            with self.assertRaises(kvhost.ConnectionLost):
                c.stats()
            # No job ends while the daemon is frozen (ending them at the
            # client's own error took well under this half second).
            with self.assertRaises(TimeoutError):
                jobs[0].wait(0.5)
            self.assertEqual([j for j in jobs if j.done()], [], "a job ended before the daemon ran")
        finally:
            self.d.thaw()
        for j in jobs:  # each ends: run, cancelled, or with the connection the daemon closed
            try:
                j.wait(60)
            except kvhost.ConnectionLost:
                pass

    def test_cancel_of_a_job_not_yet_accepted_waits_for_its_acceptance(self):
        c, cache = self.client()
        self.d.freeze()
        try:
            job = c.store(cache, [b"cancel-me"], [[0]], block=False)
            got = []
            t = threading.Thread(target=lambda: got.append(job.cancel()))
            t.start()
            self.assertIsNone(job.id)
        finally:
            self.d.thaw()
        t.join(60)
        self.assertFalse(t.is_alive())
        self.assertIn(got, ([True], [False]))  # cancelled, or done already
        self.assertIsNotNone(job.id)
        job.wait(30)

    def test_a_timeout_that_is_not_positive_is_refused_before_connecting(self):
        for bad in (0, -1, 0.0):
            with self.subTest(timeout=bad), self.assertRaises(ValueError):
                kvhost.Client(self.d.socket, timeout=bad)


class FakeDaemon:
    """A socket that answers a client's Hello and its jobs' acceptance,
    then says what the test tells it to: for what a daemon may send."""

    def __init__(self):
        self.dir = socket_dir("kvhost-fake-")
        self.path = os.path.join(self.dir, "fake.sock")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.path)
        self.listener.listen(1)
        self.conn = None

    def accept(self):
        self.conn, _ = self.listener.accept()

    def read_frame(self):
        head = self._exact(p.HEADER_SIZE)
        length, ftype, _, req_id = p.HEADER.unpack(head)
        return ftype, req_id, self._exact(length)

    def _exact(self, n):
        buf = b""
        while len(buf) < n:
            got = self.conn.recv(n - len(buf))
            if not got:
                raise EOFError
            buf += got
        return buf

    def reply(self, ftype, req_id, body):
        self.conn.sendall(p.frame(ftype, req_id, body))

    def welcome(self, max_frame=4 << 20, version=p.VERSION, features=0):
        """Answers the Hello with a Welcome of version (with features from
        version 2 on)."""
        ftype, req_id, _ = self.read_frame()
        assert ftype == p.T_HELLO
        body = struct.pack("<HH7I", version, 0, max_frame, 64, 256, 16, 16, 4096, 64) + bytes([4]) + b"fake"
        if version >= 2:
            body += struct.pack("<Q", features)
        self.reply(p.T_HELLO | p.T_REPLY, req_id, body)

    def close(self):
        for s in (self.conn, self.listener):
            if s is not None:
                s.close()
        shutil.rmtree(self.dir, ignore_errors=True)



def connected_to_fake(test, timeout):
    """A FakeDaemon that welcomed a Client, both closed when test ends.
    The client's timeout is set to timeout after the handshake, which
    runs under the default one: a loaded machine may stall the fake's
    thread past a timeout meant for the step under test."""
    fake = FakeDaemon()
    test.addCleanup(fake.close)
    t = threading.Thread(target=lambda: (fake.accept(), fake.welcome()))
    t.start()
    c = kvhost.Client(fake.path)
    test.addCleanup(c.close)
    t.join()
    c.set_timeout(timeout)
    return fake, c

class TestSetTimeout(unittest.TestCase):
    def test_set_timeout_bounds_later_replies_and_sends_and_refuses_bad_values(self):
        fake, c = connected_to_fake(self, timeout=None)  # no bound on any wait

        def send_bound():
            sec, usec = struct.unpack("ll", c._sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, 16))
            return sec + usec / 1e6

        self.assertEqual(send_bound(), 0)
        for bad in (0, -1, float("inf"), float("nan"), 1e9):
            with self.subTest(bad=bad), self.assertRaises(ValueError):
                c.set_timeout(bad)
        self.assertEqual(send_bound(), 0, "a refused value changed the bound")
        c.set_timeout(0.25)
        self.assertTrue(0.2 <= send_bound() <= 0.3, send_bound())  # the kernel keeps it in ticks
        # A reply the fake never sends: without the new bound the call
        # would wait for good (the thread's join is only a hang guard).
        threading.Thread(target=fake.read_frame, daemon=True).start()
        got = []

        def pin():
            try:
                c.pin(1, [b"k"])
            except BaseException as e:  # handed to the test
                got.append(e)
        t = threading.Thread(target=pin, daemon=True)
        t.start()
        t.join(60)
        self.assertFalse(t.is_alive(), "pin still waits: set_timeout did not bound the reply")
        self.assertEqual(len(got), 1)
        self.assertIsInstance(got[0], TimeoutError)


class TestUnreadableStream(unittest.TestCase):
    def test_a_frame_not_understood_stops_sending_and_jobs_end_only_when_the_daemon_closes(self):
        # After a frame the client cannot follow, it can read nothing on;
        # the daemon may still be running its jobs on the caller's memory,
        # so they end when the daemon closes the connection, not before.
        def completion(*keys, kind=p.JOB_STORE):  # of job 7, the store of one key
            body = struct.pack("<QBxxxIQQ", 7, kind, len(keys), 0, 0)
            return body + b"".join(bytes(k) for k in keys) + struct.pack("<H", 0)

        for name, bad in (("short body", b"\x00" * 3),
                          ("more keys than its body holds", struct.pack("<QBxxxIQQ", 7, 1, 5, 0, 0)),
                          # docs/protocol.md rules these keys out: a key
                          # never ends pending, nor failed or cancelled
                          # without a code.
                          ("a key pending", completion((0, 0))),
                          ("a failed key without a code", completion((p.OUTCOME_FAILED, 0))),
                          ("a cancelled key without a code", completion((p.OUTCOME_CANCELLED, 0))),
                          ("an outcome past the protocol's", completion((p.OUTCOME_CANCELLED + 1, 20))),
                          # Not the request's: result.keys[i] is request key i.
                          ("more keys than the request", completion((p.OUTCOME_STORED, 0), (p.OUTCOME_STORED, 0))),
                          ("a load's", completion((p.OUTCOME_LOADED, 0), kind=p.JOB_LOAD))):
            with self.subTest(name):
                self.unreadable(bad)

    def unreadable(self, bad):
        fake, c = connected_to_fake(self, timeout=5)
        job = c.store(1, [b"k"], [[0]], block=False)
        ftype, req_id, _ = fake.read_frame()
        self.assertEqual(ftype, p.T_STORE)
        fake.reply(p.T_STORE | p.T_REPLY, req_id, struct.pack("<Q", 7))
        fake.reply(p.T_COMPLETION, 0, bad)  # not a completion the client can read
        wait_for(lambda: not c.connected(), what="the client to stop sending")
        self.assertEqual(fake.conn.recv(1), b"", "the client's side still open for writing")
        with self.assertRaises(TimeoutError):  # ending it at the client's error took well under this
            job.wait(0.5)
        self.assertEqual(job.id, 7)
        fake.conn.close()  # the daemon closes once its jobs ended
        with self.assertRaises(kvhost.ConnectionLost):
            job.wait(30)

    def test_a_job_id_accepted_twice_stops_sending_and_both_jobs_end_with_the_connection(self):
        # Ids in flight are unique (docs/protocol.md): a second job
        # accepted as 7 while 7 runs could not be told from the first, so
        # the client reads nothing on, and neither job is lost: both end
        # when the daemon closes.
        fake, c = connected_to_fake(self, timeout=5)
        jobs = []
        for key in (b"a", b"b"):
            jobs.append(c.store(1, [key], [[0]], block=False))
            ftype, req_id, _ = fake.read_frame()
            self.assertEqual(ftype, p.T_STORE)
            fake.reply(p.T_STORE | p.T_REPLY, req_id, struct.pack("<Q", 7))
        wait_for(lambda: not c.connected(), what="the client to stop sending")
        self.assertEqual(fake.conn.recv(1), b"", "the client's side still open for writing")
        for j in jobs:
            with self.assertRaises(TimeoutError):
                j.wait(0.2)
        fake.conn.close()
        for j in jobs:
            with self.assertRaises(kvhost.ConnectionLost):
                j.wait(30)


class TestLookupTableLocation(unittest.TestCase):
    def serve_lookups(self, fake, c, found, table, tell_table=lambda: True):
        """Answers, on fake, the Declare of client c, then its lookups
        (found keys each) and its requests for the lookup table's location
        (table, while tell_table() holds; else no answer) until the
        connection ends. Returns the list, filled as they come, of the
        types of the requests after the Declare. c is closed, then the
        thread joined, when the test ends."""
        asked = []

        def daemon_side():
            ftype, req_id, _ = fake.read_frame()
            fake.reply(p.T_DECLARE | p.T_REPLY, req_id, struct.pack("<IIQQ", 1, 1, 7, 4096))
            try:
                while True:
                    ftype, req_id, _ = fake.read_frame()
                    asked.append(ftype)
                    if ftype == p.T_LOOKUP:
                        fake.reply(ftype | p.T_REPLY, req_id, struct.pack("<I", found))
                    elif ftype == p.T_LOOKUP_TABLE and tell_table():
                        path = table.encode()
                        fake.reply(ftype | p.T_REPLY, req_id, struct.pack("<H", len(path)) + path)
            except (EOFError, OSError):
                pass

        t = threading.Thread(target=daemon_side, daemon=True)
        t.start()
        self.addCleanup(t.join)
        self.addCleanup(c.close)
        return asked

    def test_a_table_location_not_answered_in_time_is_asked_for_again(self):
        # A daemon busy for a moment (here: one that does not answer) at a
        # client's first lookup does not keep the client off its table.
        from test_lookup_table import write_table
        fake, c = connected_to_fake(self, timeout=0.5)
        table = os.path.join(fake.dir, "fake.sock.lookup")
        write_table(table, 10, 7, [b"k"])
        late = threading.Event()
        asked = self.serve_lookups(fake, c, 0, table, late.is_set)
        ns = c.declare(GEOMETRY)
        with self.assertRaises(TimeoutError):
            c.lookup(ns, [b"k"])  # the table's location does not come in time
        late.set()
        self.assertEqual(c.lookup(ns, [b"k"]), 1)
        self.assertEqual(c.lookup_counts(), {"table": 1, "daemon": 0})
        self.assertEqual(asked, [p.T_LOOKUP_TABLE, p.T_LOOKUP_TABLE])

    def test_a_table_location_that_is_not_a_regular_file_leaves_lookups_to_the_daemon(self):
        # A FIFO named as the table blocked the first lookup for good.
        fake, c = connected_to_fake(self, timeout=5)
        fifo = os.path.join(fake.dir, "fake.sock.lookup")
        os.mkfifo(fifo)
        asked = self.serve_lookups(fake, c, 1, fifo)
        ns = c.declare(GEOMETRY)
        got = []
        lookup = threading.Thread(target=lambda: got.append(c.lookup(ns, [b"k"])), daemon=True)
        lookup.start()
        lookup.join(30)
        if lookup.is_alive():  # blocked opening the FIFO: a writer lets it go
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            lookup.join(30)
            self.fail("the lookup blocked opening the table the daemon named")
        self.assertEqual(got, [1])
        self.assertEqual(c.lookup_counts(), {"table": 0, "daemon": 1})
        self.assertEqual(asked, [p.T_LOOKUP_TABLE, p.T_LOOKUP])


class TestShortReplies(unittest.TestCase):
    def test_a_reply_too_short_to_decode_ends_the_connection_naming_the_request(self):
        cases = [("Declared", lambda c: c.declare(GEOMETRY), p.T_DECLARE | p.T_REPLY, bytes(8), "Declare"),
                 ("Count", lambda c: c.touch(1, [b"k"]), p.T_LOOKUP | p.T_REPLY, bytes(2), "Lookup"),
                 ("Cancelled", lambda c: c.cancel(7), p.T_CANCEL | p.T_REPLY, b"", "Cancel"),
                 ("Pinned", lambda c: c.pin(1, [b"a", b"b"]), p.T_PIN | p.T_REPLY,
                  struct.pack("<QI", 1, 2) + b"\x01", "Pin"),
                 ("Error", lambda c: c.delete(1, [b"k"]), p.T_ERROR, struct.pack("<BBH", 9, 0, 40) + b"cut",
                  "Delete")]
        for name, call, ftype, body, request in cases:
            with self.subTest(name):
                fake, c = connected_to_fake(self, timeout=30)

                def daemon_side():
                    _, req_id, _ = fake.read_frame()
                    fake.reply(ftype, req_id, body)
                    fake.conn.shutdown(socket.SHUT_WR)  # as a daemon closes once the client stopped

                t = threading.Thread(target=daemon_side)
                t.start()
                with self.assertRaises(kvhost.ConnectionLost) as cm:
                    call(c)
                t.join()
                self.assertIn("ProtocolError", str(cm.exception))
                self.assertIn(f"bytes to {request}", str(cm.exception))
                self.assertFalse(c.connected())


class TestLongerReplies(unittest.TestCase):
    def test_bytes_after_what_the_client_reads_of_a_reply_are_left_to_newer_daemons(self):
        # A newer daemon may append fields to a reply; the client reads
        # what it knows, as it does the Welcome's and the Stats', and keeps
        # the connection. A job's acceptance ended the connection, and
        # most other replies failed their call with struct.error.
        more = b"\x00newer"
        cases = [("JobAccepted", lambda c: c.store(1, [b"k"], [[0]]).id, struct.pack("<Q", 7), 7),
                 ("JobAccepted, block=False", lambda c: c.store(1, [b"k"], [[0]], block=False).wait(30).bytes,
                  struct.pack("<Q", 7), 0),
                 ("Declared", lambda c: c.declare(GEOMETRY).key_bytes, struct.pack("<IIQQ", 1, 1, 7, 4096), 4096),
                 ("CacheRegistered", lambda c: c.register_cache(1, [kvhost.Layer(1, 0, 4096, 4096, 1)]),
                  struct.pack("<I", 3), 3),
                 ("Count", lambda c: c.touch(1, [b"k"]), struct.pack("<I", 1), 1),
                 ("Deleted", lambda c: c.delete(1, [b"k"]), struct.pack("<I", 1), 1),
                 ("Unpinned", lambda c: c.unpin(9), struct.pack("<I", 2), 2),
                 ("Pinned", lambda c: c.pin(1, [b"k"]), struct.pack("<QI", 9, 1) + bytes([p.PIN_HELD]), (9, [True])),
                 ("Cancelled", lambda c: c.cancel(7), b"\x01", True)]
        for name, call, body, want in cases:
            with self.subTest(name):
                fake, c = connected_to_fake(self, timeout=5)

                def daemon_side():
                    ftype, req_id, _ = fake.read_frame()
                    fake.reply(ftype | p.T_REPLY, req_id, body + more)
                    if ftype in (p.T_STORE, p.T_LOAD):
                        fake.reply(p.T_COMPLETION, 0, struct.pack("<QBxxxIQQ", 7, p.JOB_STORE, 1, 0, 0)
                                   + bytes([p.OUTCOME_STORED, 0]) + struct.pack("<H", 0) + more)
                t = threading.Thread(target=daemon_side)
                t.start()
                try:
                    got = call(c)
                finally:
                    t.join(60)
                self.assertEqual(got, want)
                self.assertTrue(c.connected(), "the connection ended over bytes the client does not read")


class TestAbandonedRequests(unittest.TestCase):
    def sent_later(self, send, body):
        """Calls send(client) on a connection to a fake daemon that answers
        the one request it reads with body only once the pending request
        send returned says it is unanswered; returns (that request's
        result(), the frame the daemon read)."""
        fake, c = connected_to_fake(self, timeout=5)
        frames, reply = [], threading.Event()

        def daemon():
            frames.append(fake.read_frame())
            reply.wait(60)
            ftype, req_id, _ = frames[0]
            fake.reply(ftype | p.T_REPLY, req_id, body)
        d = threading.Thread(target=daemon)
        d.start()
        pending = send(c)  # unanswered yet: returns anyway
        self.assertFalse(pending.answered())
        reply.set()
        got = pending.result()
        self.assertTrue(pending.answered())
        d.join(60)
        return got, frames[0]

    def test_pin_later_returns_before_the_reply_and_gives_the_pin_when_it_comes(self):
        got, frame = self.sent_later(lambda c: c.pin_later(1, [b"a", b"b"]),
                                     struct.pack("<QI", 9, 2) + bytes([p.PIN_HELD, p.PIN_MISSING]))
        self.assertEqual(got, (9, [True, False]))
        self.assertEqual(frame[0], p.T_PIN)

    def test_unpin_later_returns_before_the_reply_and_gives_the_keys_released_when_it_comes(self):
        got, frame = self.sent_later(lambda c: c.unpin_later(42), struct.pack("<I", 3))
        self.assertEqual(got, 3)
        self.assertEqual(frame[0], p.T_UNPIN)
        self.assertEqual(struct.unpack("<Q", frame[2])[0], 42)

    def pin_answered_late(self, fake, pin_id):
        """A fake daemon's thread that answers the pin it reads with
        pin_id once the returned event is set, then reads the unpin that
        follows and answers it; got gets the frames ("pin", "unpin")."""
        got, late = {}, threading.Event()

        def daemon():
            got["pin"] = fake.read_frame()
            late.wait(60)
            ftype, req_id, _ = got["pin"]
            fake.reply(ftype | p.T_REPLY, req_id, struct.pack("<QI", pin_id, 1) + bytes([p.PIN_HELD]))
            got["unpin"] = fake.read_frame()
            fake.reply(got["unpin"][0] | p.T_REPLY, got["unpin"][1], struct.pack("<I", 1))
        d = threading.Thread(target=daemon)
        d.start()
        return d, late, got

    def test_a_pin_later_given_up_is_unpinned_when_its_reply_comes(self):
        fake, c = connected_to_fake(self, timeout=5)
        d, abandoned, got = self.pin_answered_late(fake, 11)
        c.pin_later(1, [b"k"]).abandon()
        abandoned.set()
        d.join(60)
        self.assertEqual(got["unpin"][0], p.T_UNPIN, "no unpin of the pin given up")
        self.assertEqual(struct.unpack("<Q", got["unpin"][2])[0], 11)

    def test_a_pin_whose_reply_comes_after_the_timeout_is_unpinned(self):
        # The caller got a TimeoutError and no pin id: when the reply
        # comes, the client gives the pin back rather than leave the
        # daemon holding keys nobody can name until the connection closes.
        fake, c = connected_to_fake(self, timeout=0.2)
        d, timed_out, got = self.pin_answered_late(fake, 9)
        with self.assertRaises(TimeoutError):
            c.pin(1, [b"k"])
        timed_out.set()
        d.join(60)
        self.assertEqual(got["pin"][0], p.T_PIN)
        self.assertIn("unpin", got, "no unpin of the pin whose reply came late")
        self.assertEqual(got["unpin"][0], p.T_UNPIN)
        self.assertEqual(struct.unpack("<Q", got["unpin"][2])[0], 9)


class TestRegisterCudaTensor(unittest.TestCase):
    def test_sends_handle_offset_size_and_device(self):
        handle = bytes(range(64))
        cases = [
            ("no CUDA_VISIBLE_DEVICES", None, 1, 1, handle),
            ("translated through CUDA_VISIBLE_DEVICES", "4,6", 1, 6, handle),
            ("torch 2.11 versioned handle", None, 0, 0, b"\x02c" + handle),
            ("torch 2.13 versioned handle", None, 0, 0, b"\x03c" + handle),
        ]
        for name, visible, index, want_dev, torch_handle in cases:
            with self.subTest(name):
                env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
                with mock.patch.dict(os.environ, env, clear=True):
                    c = offline_client()
                    rid = c.register_cuda_tensor(FakeCudaTensor(torch_share(index, torch_handle, 1 << 20, 4096)))
                self.assertEqual(rid, 7)
                ftype, body, fds = c._call.calls[0]
                self.assertEqual(ftype, p.T_REGISTER_MEMORY)
                self.assertFalse(fds)
                self.assertEqual(decode_register(body), (p.MEMORY_CUDA_IPC, want_dev, 1 << 20, 4096, handle))

    def test_explicit_device_wins(self):
        with mock.patch.dict(os.environ, {"CUDA_VISIBLE_DEVICES": "GPU-aaaa,GPU-bbbb"}):
            c = offline_client()
            c.register_cuda_tensor(FakeCudaTensor(torch_share(1, b"\x01" * 64, 4096, 0)), device=3)
        self.assertEqual(decode_register(c._call.calls[0][1])[1], 3)

    def test_refuses_what_it_cannot_register(self):
        cases = [
            ("host tensor", FakeCudaTensor(torch_share(0, b"\x01" * 64, 4096, 0), is_cuda=False), {}),
            ("expandable segment", FakeCudaTensor(torch_share(0, b"\x02e" + b"\x01" * 80, 4096, 0)), {}),
            ("unknown handle version", FakeCudaTensor(torch_share(0, b"\x09c" + b"\x01" * 64, 4096, 0)), {}),
            ("unknown handle layout", FakeCudaTensor(torch_share(0, b"\x01" * 80, 4096, 0)), {}),
            ("empty storage", FakeCudaTensor(torch_share(0, b"\x01" * 64, 0, 0)), {}),
            ("device named by UUID", FakeCudaTensor(torch_share(0, b"\x01" * 64, 4096, 0)),
             {"CUDA_VISIBLE_DEVICES": "GPU-aaaa"}),
            ("device not visible", FakeCudaTensor(torch_share(2, b"\x01" * 64, 4096, 0)),
             {"CUDA_VISIBLE_DEVICES": "0,1"}),
        ]
        for name, tensor, env in cases:
            with self.subTest(name), mock.patch.dict(os.environ, env, clear=True):
                c = offline_client()
                with self.assertRaises(ValueError):
                    c.register_cuda_tensor(tensor)
                self.assertEqual(c._call.calls, [], "sent a request for a refused tensor")

    def test_daemon_without_gpu_answers_unsupported(self):
        d = Daemon()
        try:
            with kvhost.Client(d.socket) as c:
                with self.assertRaises(kvhost.UnsupportedError):
                    c.register_cuda_tensor(FakeCudaTensor(torch_share(0, b"\x01" * 64, 4096, 0)), device=0)
                st = c.stats()
                self.assertEqual((st["regions"], st["devices"]), (0, []))
        finally:
            d.stop()


class TestStats(unittest.TestCase):
    def test_decodes_devices(self):
        body = struct.pack("<16Q", *range(16)) + struct.pack("<I", 1) + struct.pack("<QQQB7x", 10, 5, 1, 1)
        body += struct.pack("<I", 2) + struct.pack("<I4xQQQ", 0, 1, 4096, 1 << 30)
        body += struct.pack("<I4xQQQ", 1, 0, 0, 1 << 30)
        st = p.decode_stats(body)
        self.assertEqual(st["inflight_jobs"], 15)
        self.assertEqual(st["mounts"], [{"capacity": 10, "used": 5, "entries": 1, "direct": True,
                                         "device_class": None}])  # an older daemon: no classes section
        self.assertEqual(st["devices"], [
            {"ordinal": 0, "regions": 1, "registered": 4096, "limit": 1 << 30, "uuid": None, "faults": 0},
            {"ordinal": 1, "regions": 0, "registered": 0, "limit": 1 << 30, "uuid": None, "faults": 0}])

    def test_decodes_the_daemons_own_encoding(self):
        # testdata/stats.bin is the Go encoder's bytes of a reply with every
        # section (protocol.TestStatsGoldenBytesForThePythonClient).
        with open(os.path.join(os.path.dirname(__file__), "testdata", "stats.bin"), "rb") as f:
            st = p.decode_stats(f.read())
        self.assertEqual((st["entries"], st["keys"], st["clients"], st["inflight_jobs"]), (1, 2, 3, 4))
        self.assertEqual(st["mounts"], [{"capacity": 10, "used": 5, "entries": 1, "direct": True,
                                         "device_class": "memory"}])
        self.assertEqual(st["devices"], [
            {"ordinal": 0, "regions": 1, "registered": 4096, "limit": 1 << 30, "uuid": b"\x0a" + bytes(14) + b"\x0a", "faults": 0},
            {"ordinal": 1, "regions": 0, "registered": 0, "limit": 1 << 30, "uuid": None, "faults": 3}])
        self.assertEqual(st["namespaces"], {"list": [
            {"fingerprint": 11, "model": "vllm:m:0", "declared": True, "files": 12, "keys": 13, "bytes": 14,
             "caches": 15}], "left_out": 0})

    def test_a_class_name_this_client_does_not_know_reads_unknown(self):
        with open(os.path.join(os.path.dirname(__file__), "testdata", "stats.bin"), "rb") as f:
            body = f.read()
        assert body.endswith(b"\x06memory")  # the golden reply's classes section ends the reply
        st = p.decode_stats(body[:-7] + b"\x05tapes")
        self.assertEqual(st["mounts"][0]["device_class"], "unknown")
        # Cut inside the section: no class, the rest decoded.
        st = p.decode_stats(body[:-3])
        self.assertEqual((st["mounts"][0]["device_class"], st["namespaces"]["list"][0]["caches"]), (None, 15))

    def test_a_reply_without_the_namespaces_section_says_none(self):
        # An older daemon's reply: the device-faults section is its last.
        uuids = [bytes(range(16)), b"\x00" * 16]
        body = stats_body(uuids) + struct.pack("<Q", 5) + struct.pack("<IQQ", 2, 0, 7)
        self.assertIsNone(p.decode_stats(body)["namespaces"])

    def test_decodes_device_uuids_after_the_daemon_and_spares_sections(self):
        uuids = [bytes(range(16)), b"\x00" * 16]  # the second unknown
        body = stats_body(uuids)
        st = p.decode_stats(body)
        self.assertEqual([d["uuid"] for d in st["devices"]], [uuids[0], None])
        self.assertEqual(st["devices"][0]["regions"], 1)
        # An older daemon's reply: the sections end after the spares.
        self.assertEqual([d["uuid"] for d in p.decode_stats(body[:-4 - 32])["devices"]], [None, None])
        # A later daemon's section after them is ignored.
        self.assertEqual(p.decode_stats(body + b"\xde\xad")["devices"][0]["uuid"], uuids[0])

    def test_decodes_device_faults_after_the_made_ahead_count(self):
        uuids = [bytes(range(16)), b"\x00" * 16]
        body = stats_body(uuids) + struct.pack("<Q", 5)  # spares made ahead
        self.assertEqual([d["faults"] for d in p.decode_stats(body)["devices"]], [0, 0])  # an older daemon
        body += struct.pack("<IQQ", 2, 0, 7)
        st = p.decode_stats(body)
        self.assertEqual([d["faults"] for d in st["devices"]], [0, 7])
        self.assertEqual([d["uuid"] for d in st["devices"]], [uuids[0], None])
        # A section for another number of devices is not this one.
        self.assertEqual([d["faults"] for d in p.decode_stats(body[:-20] + struct.pack("<IQ", 1, 7))["devices"]], [0, 0])

    def test_a_stats_reply_with_more_mounts_than_bytes_is_a_protocol_error(self):
        """A Stats reply whose mount count runs past its bytes (16
        counters, a count of 2^32 - 1, no mount) raises ProtocolError, not
        struct.error, and the connection goes on serving."""
        fake, c = connected_to_fake(self, timeout=30)

        def serve(body):
            ftype, req_id, _ = fake.read_frame()
            fake.reply(ftype | p.T_REPLY, req_id, body)
        t = threading.Thread(target=serve, args=(struct.pack("<16QI", *range(16), 0xFFFFFFFF),))
        t.start()
        try:
            with self.assertRaises(p.ProtocolError):
                c.stats()
        finally:
            t.join(30)
        t = threading.Thread(target=serve, args=(struct.pack("<6Q", 1, 2, 3, 4096, 0, 0),))
        t.start()
        try:
            self.assertEqual(c.purge(model="m")["files"], 2)
        finally:
            t.join(30)


def str8(s):
    return struct.pack("<B", len(s)) + s


def str16(s):
    return struct.pack("<H", len(s)) + s


def stats_body(uuids):
    """A Stats reply as the daemon sends it: counters, one mount, a device
    per UUID, the daemon section, the spares section and the
    device-identity section."""
    body = struct.pack("<16Q", *range(16)) + struct.pack("<I", 1) + struct.pack("<QQQB7x", 10, 5, 1, 0)
    body += struct.pack("<I", len(uuids))
    for i in range(len(uuids)):
        body += struct.pack("<I4xQQQ", i, 1, 4096, 1 << 30)
    body += struct.pack("<q", 1) + str8(b"lru") + str8(b"wasm") + bytes(8) + str16(b"")
    body += struct.pack("<QQ", 0, 0) + str16(b"ok") + struct.pack("<QQQ", 0, 1, 4096)
    body += struct.pack("<I", 1) + str16(b"/dev/shm/kv") + str8(b"staging") + str8(b"direct") + bytes(8)
    body += struct.pack("<QQ", 1 << 30, 0)
    body += struct.pack("<QI", 3, 1) + struct.pack("<QQ", 2, 1 << 21)  # spares
    body += struct.pack("<I", len(uuids)) + b"".join(uuids)
    return body


class StatsCaptured(Captured):
    """Captured, answering Stats requests with body."""

    def __init__(self, body):
        super().__init__()
        self.body = body

    def __call__(self, ftype, body, fds=None, undo=None):
        if ftype == p.T_STATS:
            self.calls.append((ftype, body, fds))
            return ftype | p.T_REPLY, self.body
        return super().__call__(ftype, body, fds)


class TestRegisterCudaTensorByUUID(unittest.TestCase):
    A, B, C = bytes([0xA] * 16), bytes([0xB] * 16), bytes([0xC] * 16)

    def register(self, tensor_uuid, daemon_uuids, index=0, device=None, env=None):
        c = kvhost.Client.__new__(kvhost.Client)
        c._call = StatsCaptured(stats_body(daemon_uuids))
        with mock.patch("kvhost.memory.device_uuid", return_value=tensor_uuid), \
                mock.patch.dict(os.environ, env or {}, clear=True):
            c.register_cuda_tensor(FakeCudaTensor(torch_share(index, b"\x01" * 64, 4096, 0)), device=device)
        registers = [body for ftype, body, _ in c._call.calls if ftype == p.T_REGISTER_MEMORY]
        self.assertEqual(len(registers), 1)
        return decode_register(registers[0])[1]

    def test_the_device_is_found_by_uuid_whatever_cuda_visible_devices_says(self):
        self.assertEqual(self.register(self.B, [self.A, self.B], index=0, env={"CUDA_VISIBLE_DEVICES": "GPU-bbbb"}), 1)
        self.assertEqual(self.register(self.A, [self.A, self.B], index=1, env={"CUDA_VISIBLE_DEVICES": "1,0"}), 0)

    def test_without_uuids_the_index_is_used(self):
        self.assertEqual(self.register(None, [self.A, self.B], index=1), 1)
        self.assertEqual(self.register(self.B, [b"\x00" * 16] * 2, index=1, env={"CUDA_VISIBLE_DEVICES": "4,6"}), 6)

    def test_a_device_that_is_another_gpu_is_refused(self):
        cases = [
            ("device= names the other GPU", self.B, [self.A, self.B], 0, "device=0 is GPU-0a0a0a0a"),
            ("a GPU the daemon does not serve", self.C, [self.A, self.B], None, "not one the daemon serves"),
        ]
        for name, tensor_uuid, daemon_uuids, device, says in cases:
            with self.subTest(name):
                with self.assertRaises(ValueError) as cm:
                    self.register(tensor_uuid, daemon_uuids, device=device)
                self.assertIn(says, str(cm.exception))

    def test_an_explicit_device_of_the_right_gpu_is_sent(self):
        self.assertEqual(self.register(self.B, [self.A, self.B], index=0, device=1), 1)


class TestRegisterSharedFile(unittest.TestCase):
    def test_sends_the_fd_without_sealing(self):
        fd = os.memfd_create("shared", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, 8192)
            c = offline_client()
            self.assertEqual(c.register_shared_file(fd, 8192), 7)
            ftype, body, fds = c._call.calls[0]
            self.assertEqual(ftype, p.T_REGISTER_MEMORY)
            self.assertEqual(fds, [fd])
            self.assertEqual(decode_register(body), (p.MEMORY_SHARED, 0, 8192, 0, bytes(64)))
            self.assertEqual(fcntl.fcntl(fd, F_GET_SEALS) & F_SEAL_SHRINK, 0, "the file was sealed")
            os.ftruncate(fd, 0)  # its owner can still shrink it
        finally:
            os.close(fd)

    def test_refuses_empty_size(self):
        with tempfile.TemporaryFile(dir="/dev/shm") as f:
            c = offline_client()
            with self.assertRaises(ValueError):
                c.register_shared_file(f.fileno(), 0)
            self.assertEqual(c._call.calls, [])


    def test_a_descriptor_that_cannot_be_sent_is_refused_and_the_connection_kept(self):
        d = Daemon(capacity="64MiB")
        self.addCleanup(d.stop)
        with kvhost.Client(d.socket) as c:
            fd = os.memfd_create("closed", os.MFD_CLOEXEC)
            os.close(fd)
            for name, bad, err in (("closed", fd, OSError), ("not a descriptor", "3", TypeError)):
                with self.subTest(name):
                    with self.assertRaises(err) as cm:
                        c.register_shared_file(bad, 4096)
                    self.assertIn(repr(bad), str(cm.exception))
                    self.assertTrue(c.connected(), "the connection was given up for a caller's bad descriptor")
                    self.assertEqual(c.stats()["regions"], 0)


class TestHostBuffer(unittest.TestCase):
    def test_a_buffer_dropped_unclosed_closes_its_memfd_and_keeps_its_mapping(self):
        name = "kvhost-test-dropped"

        def memfds():
            fds = []
            for fd in os.listdir("/proc/self/fd"):
                try:
                    if os.readlink(f"/proc/self/fd/{fd}").startswith(f"/memfd:{name} "):
                        fds.append(fd)
                except FileNotFoundError:  # the listing's own descriptor
                    pass
            return fds

        buf = kvhost.HostBuffer(4096, name=name)
        buf.view[:5] = b"kept!"
        fd = str(buf.fd)
        mapped = buf.mmap  # as a tensor over it (torch_host_tensor) holds it (and its own copy of the fd)
        self.assertIn(fd, memfds())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ResourceWarning)
            del buf
            gc.collect()
        self.assertNotIn(fd, memfds(), "the memfd of a dropped buffer is still open")
        self.assertTrue(any(issubclass(w.category, ResourceWarning) for w in caught), caught)
        self.assertEqual(mapped[:5], b"kept!")


    def test_close_with_a_view_over_the_mapping_changes_nothing_and_closes_once_it_goes(self):
        # close() released .view, then failed to unmap: the buffer was
        # left open with its view unusable.
        cases = [("a slice of .view", lambda b: b.view[:16]),
                 ("a memoryview of .mmap", lambda b: memoryview(b.mmap)),
                 ("an array over .view", lambda b: (ctypes.c_char * 16).from_buffer(b.view)),
                 ("a buffer of .view itself", lambda b: pickle.PickleBuffer(b.view))]
        for name, over in cases:
            with self.subTest(name):
                buf = kvhost.HostBuffer(4096)
                self.addCleanup(buf.close)
                held = [over(buf)]
                with self.assertRaises(BufferError) as cm:
                    buf.close()
                self.assertGreaterEqual(buf.fd, 0)
                buf.view[:5] = b"open!"
                self.assertEqual(buf.mmap[:5], b"open!")
                self.assertIn("still holds the mapping", str(cm.exception))
                if hasattr(held[0], "release"):
                    held[0].release()
                del held[0]  # an array lets go of its buffer as it goes
                buf.close()
                self.assertEqual(buf.fd, -1)
                self.assertTrue(buf.mmap.closed)


class TestRegisterMemfd(unittest.TestCase):
    def test_a_descriptor_that_cannot_be_sealed_is_refused_naming_it_and_what_to_use(self):
        here = os.path.dirname(os.path.abspath(__file__))
        cases = [("a file on the tests' file system", lambda: os.open(here, os.O_TMPFILE | os.O_RDWR, 0o600)),
                 ("a file in /dev/shm", lambda: os.open("/dev/shm", os.O_TMPFILE | os.O_RDWR, 0o600)),
                 ("a memfd made without MFD_ALLOW_SEALING", lambda: os.memfd_create("unsealable", os.MFD_CLOEXEC))]
        for name, make in cases:
            with self.subTest(name):
                fd = make()
                try:
                    c = offline_client()
                    with self.assertRaises(ValueError) as cm:
                        c.register_memfd(fd, 4096)
                    self.assertIn(f"descriptor {fd}", str(cm.exception))
                    self.assertIn("register_shared_file", str(cm.exception))
                    self.assertEqual(c._call.calls, [])
                finally:
                    os.close(fd)


class TestKeys(unittest.TestCase):
    def test_a_key_that_is_not_bytes_like_is_refused_naming_it(self):
        # bytes(5) is five zero bytes: an int key must not become one.
        d = Daemon(capacity="64MiB")
        self.addCleanup(d.stop)
        with kvhost.Client(d.socket, lookup_table=False) as c:
            ns = c.declare(GEOMETRY)
            calls = [("touch", lambda keys: c.touch(ns, keys)), ("delete", lambda keys: c.delete(ns, keys)),
                     ("pin", lambda keys: c.pin(ns, keys)), ("store", lambda keys: c.store(1, keys, [[0]] * len(keys)))]
            for name, call in calls:
                for key in (5, 64, "text"):
                    with self.subTest(name, key=key):
                        with self.assertRaises(TypeError) as cm:
                            call([b"ok", key])
                        self.assertIn(f"key 1: {type(key).__name__}", str(cm.exception))
            self.assertTrue(c.connected())
            self.assertEqual(c.stats()["keys"], 0)


def one_layer_cache(test, model):
    """A daemon (64 MiB), and a client of it with model's namespace
    declared and a one-layer cache of 16 blocks registered over a host
    buffer: (client, cache id, buffer, bytes of a block's two planes).
    The test's cleanups stop them."""
    geo = kvhost.Geometry(model=model, layers=1, kv_heads=2, head_size=64, dtype_size=2,
                          tokens_per_block=16, tokens_per_key=64)
    page = 2 * geo.block_bytes
    d = Daemon(capacity="64MiB")
    test.addCleanup(d.stop)
    buf = kvhost.HostBuffer(16 * page)
    test.addCleanup(buf.close)
    c = kvhost.Client(d.socket)
    test.addCleanup(c.close)
    ns = c.declare(geo)
    region = c.register_buffer(buf)
    cache = c.register_cache(ns.id, [kvhost.Layer(region, offset=0, block_stride=page,
                                                  plane_stride=geo.block_bytes, num_blocks=16)])
    return c, cache, buf, page


class TestNoBlock(unittest.TestCase):
    """NO_BLOCK in a load's block ids: the key's other blocks load."""

    def test_a_load_leaving_blocks_out_fills_only_the_blocks_it_names(self):
        c, cache, buf, page = one_layer_cache(self, "test/noblock")
        v = buf.view
        v[:4 * page] = bytes(random.Random(7).randrange(256) for _ in range(4 * page))
        stored = bytes(v[:4 * page])
        self.assertEqual(c.store(cache, [b"nb"], [[0, 1, 2, 3]]).wait(30).outcomes(), ["stored"])
        v[:] = b"\xa5" * len(v)
        want = bytearray(v)
        want[5 * page:7 * page] = stored[page:3 * page]  # blocks 1 and 2 of the key into 5 and 6
        res = c.load(cache, [b"nb"], [[kvhost.NO_BLOCK, 5, 6, kvhost.NO_BLOCK]]).wait(30)
        self.assertEqual(res.outcomes(), ["loaded"])
        self.assertEqual(res.bytes, 2 * page)
        self.assertEqual(bytes(v), bytes(want))
        for name, call, why in [
                ("store", lambda: c.store(cache, [b"x"], [[0, kvhost.NO_BLOCK, 2, 3]]),
                 "key 0: block id NO_BLOCK (0xffffffff) in a store"),
                ("load", lambda: c.load(cache, [b"nb", b"nb"], [[8, 9, 10, 11], [p.NO_BLOCK] * 4]),
                 "key 1: every block id is NO_BLOCK")]:
            with self.subTest(name):
                with self.assertRaises(ValueError) as cm:
                    call()
                self.assertIn(why, str(cm.exception))
        self.assertTrue(c.connected())
        st = c.stats()
        self.assertEqual(st["keys"], 1)
        # The daemon names the namespace by its model id, with its key.
        listed = [ns for ns in st["namespaces"]["list"] if ns["model"] == "test/noblock"]
        self.assertEqual([(ns["keys"], ns["files"], ns["declared"]) for ns in listed], [(1, 1, True)])


class TestFingerprints(unittest.TestCase):
    """The fingerprints a Declared reply can carry, computed as the daemon
    computes them (internal/engine pins the same values)."""

    def test_a_geometrys_fingerprint_is_the_daemons(self):
        g = kvhost.Geometry(model="meta-llama/Llama-3.1-8B", layers=32, kv_heads=8, head_size=128, dtype_size=2,
                            tokens_per_block=16, tokens_per_key=256)
        self.assertEqual(g.fingerprint(), 0x4268b921884b09df)
        d = Daemon(capacity="64MiB")
        self.addCleanup(d.stop)
        with kvhost.Client(d.socket) as c:
            ns = c.declare(g)
        self.assertEqual(ns.fingerprint, g.fingerprint(), "the Declared fingerprint of a kvhost mount's namespace")

    def test_a_vllm_fs_data_directorys_fingerprint_is_the_daemons(self):
        from kvhost.client import vllm_fs_fingerprint
        self.assertEqual(vllm_fs_fingerprint("meta-llama_Llama-3.1-8B_0123456789ab_r0",
                                             "vllm-fs:meta-llama_Llama-3.1-8B_0123456789ab"), 0xef4cd9c8a3d9e9e7)


class TestPurge(unittest.TestCase):
    def test_purge_removes_a_models_files_by_model_or_fingerprint(self):
        """purge(model=...) removes the files of the namespaces declared
        with the id, purge(fingerprint=...) one namespace's (nothing left:
        no error), and an id or fingerprint the daemon does not know is
        its UnknownNS."""
        c, cache, _, _ = one_layer_cache(self, "test/purge")
        self.assertEqual(c.store(cache, [b"a", b"b"], [[0, 1, 2, 3], [4, 5, 6, 7]]).wait(30).outcomes(),
                         ["stored", "stored"])
        listed = [n for n in c.stats()["namespaces"]["list"] if n["model"] == "test/purge"]
        self.assertEqual(len(listed), 1)
        self.assertEqual(c.purge(model="test/purge"),
                         {"namespaces": 1, "files": listed[0]["files"], "keys": 2, "bytes": listed[0]["bytes"], "pinned": 0,
                          "left": 0})
        self.assertEqual(c.stats()["keys"], 0)
        self.assertEqual(c.purge(fingerprint=listed[0]["fingerprint"])["files"], 0)
        for kw in ({"model": "test/none"}, {"fingerprint": 0xdead}):
            with self.subTest(**kw):
                with self.assertRaises(kvhost.KvhostError) as cm:
                    c.purge(**kw)
                self.assertEqual(p.CODES[cm.exception.code], "unknown namespace")
        with self.assertRaises(ValueError):
            c.purge()
        self.assertTrue(c.connected())

    def test_purge_reports_the_files_left_and_takes_a_reply_without_them(self):
        """The reply's left count (files whose removal failed) is "left";
        a daemon whose reply ends before it (one that predates it) gives
        0."""
        fake, c = connected_to_fake(self, timeout=30)
        counts = (1, 2, 3, 4096, 0)
        for body, left in ((struct.pack("<6Q", *counts, 5), 5), (struct.pack("<5Q", *counts), 0)):
            with self.subTest(left=left):
                def serve():
                    ftype, req_id, _ = fake.read_frame()
                    fake.reply(ftype | p.T_REPLY, req_id, body)
                t = threading.Thread(target=serve)
                t.start()
                try:
                    got = c.purge(model="m")
                finally:
                    t.join(30)
                self.assertEqual(got, {"namespaces": 1, "files": 2, "keys": 3, "bytes": 4096, "pinned": 0, "left": left})


class TestFieldsOutOfRange(unittest.TestCase):
    def test_a_number_a_field_cannot_hold_is_refused_naming_the_field(self):
        def geometry(**kw):
            return dataclasses.replace(GEOMETRY, **kw)

        def layer(**kw):
            return kvhost.Layer(**{"region": 1, "offset": 0, "block_stride": 1, "plane_stride": 1,
                                   "num_blocks": 1, **kw})

        d = Daemon(capacity="64MiB")
        self.addCleanup(d.stop)
        with kvhost.Client(d.socket, lookup_table=False) as c, kvhost.HostBuffer(4096) as buf:
            cases = [
                ("layers -1", lambda: c.declare(geometry(layers=-1)), ValueError),
                ("tp_size 4294967296", lambda: c.declare(geometry(tp_size=1 << 32)), ValueError),
                ("head_size: float", lambda: c.declare(geometry(head_size=1.5)), TypeError),
                ("size -1", lambda: c.register_memfd(buf.fd, -1), ValueError),
                ("device -1", lambda: c.register_cuda(-1, bytes(64), 0, 4096), ValueError),
                ("layer 0 num_blocks -1", lambda: c.register_cache(1, [layer(num_blocks=-1)]), ValueError),
                ("layer 1 region 4294967296", lambda: c.register_cache(1, [layer(), layer(region=1 << 32)]),
                 ValueError),
                ("key 1 block 0 -1", lambda: c.store(1, [b"a", b"b"], [[0], [-1]]), ValueError),
                ("cache -1", lambda: c.load(-1, [b"a"], [[0]]), ValueError),
                ("namespace -1", lambda: c.touch(-1, [b"a"]), ValueError),
                ("namespace 4294967296", lambda: c.delete(1 << 32, [b"a"]), ValueError),
                ("pin -1", lambda: c.unpin(-1), ValueError),
                ("job -1", lambda: c.cancel(-1), ValueError),
                ("region -1", lambda: c.unregister_memory(-1), ValueError),
            ]
            for name, call, err in cases:
                with self.subTest(name):
                    with self.assertRaises(err) as cm:
                        call()
                    self.assertIn(name, str(cm.exception))
            self.assertTrue(c.connected())
            self.assertEqual(c.stats()["regions"], 0)


class TestImportOrder(unittest.TestCase):
    def test_memory_does_not_import_client(self):
        """client imports memory, never the other way round: no import
        circle, and memory loads on its own."""
        import ast
        import kvhost.memory
        with open(kvhost.memory.__file__) as f:
            tree = ast.parse(f.read())
        froms = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        self.assertNotIn("client", froms)
        self.assertIs(kvhost.seal_shrink, kvhost.memory.seal_shrink)



class TestErrorCodeNames(unittest.TestCase):
    def test_a_load_whose_destination_changed_is_named_apart_and_a_newer_code_by_its_number(self):
        self.assertEqual(p.code_name(p.CODE_DESTINATION_CHANGED), "destination changed")
        self.assertEqual(p.CODES.index("internal error"), 20)
        self.assertEqual(p.code_name(99), "code(99)")
        r = kvhost.client.Result(keys=[(p.OUTCOME_LOADED, 0), (p.OUTCOME_FAILED, p.CODE_DESTINATION_CHANGED),
                                       (p.OUTCOME_FAILED, 99)], bytes=0, duration_ns=0, message="")
        self.assertEqual(r.codes(), ["ok", "destination changed", "code(99)"])


if __name__ == "__main__":
    unittest.main()
