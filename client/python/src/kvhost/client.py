"""Blocking client of the kvhost daemon, safe to share between threads.

A background reader thread hands every reply to the thread that asked and
every job completion to its Job.
"""

import dataclasses
import errno
import logging
import os
import socket
import struct
import threading
import time

from . import memory
from . import protocol as p
from .lookuptable import FormatError, LookupTable
from .memory import seal_shrink

_log = logging.getLogger("kvhost")


class KvhostError(Exception):
    """An error reply of the daemon: code (see protocol.CODES) and message."""

    def __init__(self, code, message=""):
        self.code = code
        self.message = message
        name = p.code_name(code)
        super().__init__(f"kvhost: {name}: {message}" if message else f"kvhost: {name}")


class UnsupportedError(KvhostError):
    """The daemon cannot serve a valid request (e.g. CUDA IPC memory)."""


class ConnectionLost(Exception):
    """The connection to the daemon is closed. Where the daemon closed it
    with an Error frame saying why (request id 0: a deadline of the
    connection passed, the daemon is shutting down), code is that error's
    code (see protocol.CODES) and message its message; else code is None."""

    def __init__(self, what="the connection to the daemon is closed", code=None, message=""):
        super().__init__(what)
        self.code = code
        self.message = message


def _closed_by_daemon(code, message):
    """The ConnectionLost of the daemon's Error frame about the connection
    itself, which it closes after it."""
    name = p.code_name(code)
    return ConnectionLost(f"kvhost: the daemon closed the connection: {name}: {message}", code, message)


def _again(err):
    """A new exception equal to err, the error that closed a connection,
    for one more caller. Raising the stored one again would chain every
    caller's frames onto its one traceback, which the client keeps: their
    locals (a vLLM tier and the region it was given, say) would stay alive
    until the garbage collector finds the cycle."""
    if isinstance(err, KvhostError):
        return type(err)(err.code, err.message)
    if isinstance(err, ConnectionLost):
        return type(err)(*err.args, code=err.code, message=err.message)
    return type(err)(*err.args)


@dataclasses.dataclass(frozen=True)
class Geometry:
    """A model's KV-cache shape at one tensor-parallel rank."""
    model: str
    layers: int
    kv_heads: int
    head_size: int
    dtype_size: int
    tokens_per_block: int
    tokens_per_key: int
    mla: bool = False
    tp_rank: int = 0
    tp_size: int = 1

    @property
    def block_bytes(self):
        return self.tokens_per_block * self.kv_heads * self.head_size * self.dtype_size

    @property
    def planes(self):
        return 1 if self.mla else 2

    def fingerprint(self):
        """The geometry's fingerprint (docs/format.md): what the daemon's
        Declared reply carries for a namespace its kvhost mounts serve."""
        model = self.model.encode()
        return _fnv1a64(_FINGERPRINT_TAG + struct.pack("<I", len(model)) + model + struct.pack(
            "<9I", self.layers, self.kv_heads, self.head_size, self.dtype_size, int(self.mla),
            self.tokens_per_block, self.tokens_per_key, self.tp_rank, self.tp_size))


_FINGERPRINT_TAG = b"kvhost/geometry/v1\x00"
_VLLM_FS_FINGERPRINT_TAG = b"kvhost/vllm-fs/v1\x00"


def _fnv1a64(data):
    h = 0xcbf29ce484222325
    for b in data:
        h = ((h ^ b) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    return h


def vllm_fs_fingerprint(data_dir, model):
    """The fingerprint the daemon's Declared reply carries for namespace
    model when a vllm-fs mount serves it from data directory data_dir
    (its name under the mount, "<base>_r<rank>"; docs/protocol.md,
    Declared)."""
    d = data_dir.encode()
    return _fnv1a64(_VLLM_FS_FINGERPRINT_TAG + struct.pack("<I", len(d)) + d + model.encode())


@dataclasses.dataclass(frozen=True)
class Namespace:
    """A declared geometry: this connection's id and what the daemon derived."""
    id: int
    blocks_per_key: int
    fingerprint: int
    key_bytes: int
    geometry: Geometry

    @property
    def block_bytes(self):
        return self.geometry.block_bytes


@dataclasses.dataclass(frozen=True)
class Layer:
    """One layer's tensor in a registered region: block b of plane p is at
    offset + p*plane_stride + b*block_stride."""
    region: int
    offset: int
    block_stride: int
    plane_stride: int
    num_blocks: int


@dataclasses.dataclass
class Result:
    """Outcome of a job: per key (outcome, error code), bytes, duration."""
    keys: list
    bytes: int
    duration_ns: int
    message: str

    def count(self, outcome):
        return sum(1 for o, _ in self.keys if o == outcome)

    def outcomes(self):
        return [p.OUTCOMES[o] if o < len(p.OUTCOMES) else str(o) for o, _ in self.keys]

    def codes(self):
        """Each key's error code by name: "ok" for a key that did not fail,
        "destination changed" for a load key whose blocks the client's own
        memory changed under the load (the file is good: load it again into
        blocks nothing else writes), code(N) for a newer daemon's code."""
        return [p.code_name(c) for _, c in self.keys]


class Job:
    """A store or load job in flight on the daemon. A job sent without
    waiting for the daemon to accept it (block=False) has id None until
    the daemon's answer comes; a refusal then ends it, raised by wait()."""

    def __init__(self, client, job_id, request):
        self._client = client
        self.id = job_id
        self._request = request  # (kind, key count) its completion must have
        self._event = threading.Event()
        self._accepted = threading.Event()  # id known, or the job over
        if job_id is not None:
            self._accepted.set()
        self._result = None
        self._error = None

    def _accept(self, job_id):
        self.id = job_id
        self._accepted.set()

    def _finish(self, result, error):
        self._result, self._error = result, error
        self._event.set()
        self._accepted.set()

    def done(self):
        """Whether the job is over: completed, refused, or its connection lost."""
        return self._event.is_set()

    def wait(self, timeout=None):
        """Waits for the completion and returns its Result; raises
        TimeoutError, KvhostError when the daemon refused the job, or
        ConnectionLost when no completion can come."""
        if not self._event.wait(timeout):
            what = "not yet accepted" if self.id is None else self.id
            raise TimeoutError(f"job {what} not complete after {timeout}s")
        if self._error is not None:
            raise _again(self._error)
        return self._result

    def cancel(self):
        """Asks the daemon to cancel the job; True if it was still in
        flight. A job not yet accepted waits for the daemon's answer first
        (up to the client's timeout, then TimeoutError)."""
        if not self._accepted.wait(self._client._timeout):
            raise TimeoutError(f"the daemon has not accepted the job after {self._client._timeout}s")
        if self.id is None or self._event.is_set():
            return False
        return self._client.cancel(self)


def _refusal(ftype, body, asked=None):
    """The error of a request answered with ftype and body instead of its
    reply: the daemon's Error frame, else a ProtocolError."""
    if ftype == p.T_ERROR:
        code, msg = p.decode_error(body)
        if code == p.CODE_UNSUPPORTED:
            return UnsupportedError(code, msg)
        return KvhostError(code, msg)
    what = "?" if asked is None else f"{asked:#x}"
    return p.ProtocolError(f"request type {what} answered with {ftype:#x}")


class _Pending:
    __slots__ = ("event", "asked", "ftype", "body", "error", "unanswered")

    def __init__(self, asked, unanswered=None):
        # What a caller waits on (_call); a job's Job is its own signal.
        self.event = threading.Event() if unanswered is None else None
        self.asked = asked  # the request's type
        self.ftype = self.body = self.error = None
        # A job sent with block=False: the reader accepts or ends it, as
        # no caller waits for this request's answer.
        self.unanswered = unanswered


SOCKET_ENV = "KVHOST_SOCKET"


def default_socket():
    """The socket a client connects to when given none: $KVHOST_SOCKET if
    set, else the daemon's own default: $XDG_RUNTIME_DIR/kvhost.sock, else
    kvhost/kvhost.sock under $XDG_CACHE_HOME (else ~/.cache)."""
    env = os.environ.get(SOCKET_ENV)
    if env:
        return env
    run = os.environ.get("XDG_RUNTIME_DIR")
    if run:
        return os.path.join(run, "kvhost.sock")
    cache = os.environ.get("XDG_CACHE_HOME")
    if not cache or not os.path.isabs(cache):
        home = os.environ.get("HOME")
        if not home:
            import tempfile
            return os.path.join(tempfile.gettempdir(), "kvhost", "kvhost.sock")
        cache = os.path.join(home, ".cache")
    return os.path.join(cache, "kvhost", "kvhost.sock")


def _send_timeout(sock, seconds):
    """Bounds each blocking send, and connect, on sock to seconds (> 0):
    SO_SNDTIMEO, which a Unix socket's connect waits under too."""
    sec, usec = int(seconds), int(seconds % 1 * 1e6)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", sec, usec if sec or usec else 1))


def _connect(sock, path, timeout):
    """Connects sock to the Unix socket path, waiting at most timeout
    seconds (None: without bound) for its listener to take the
    connection; TimeoutError past it.

    A blocking connect to a listener whose backlog is full waits until
    the listener accepts: forever, for a stalled daemon. The kernel bounds
    that wait by SO_SNDTIMEO and then fails it with EAGAIN. (socket's own
    timeout, a non-blocking connect, would fail it at once with EAGAIN.)

    A connect a signal interrupts is tried again: CPython takes it for one
    going on in the background, waits for the socket to be writable (an
    unconnected Unix socket is) and returns as if connected."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(errno.ETIMEDOUT, f"not accepted within {timeout}s", path)
            _send_timeout(sock, left)
        try:
            sock.connect(path)
        except BlockingIOError:
            if deadline is None:  # not from a bounded wait
                raise
            continue
        try:
            sock.getpeername()
            return
        except OSError as e:
            if e.errno != errno.ENOTCONN:
                raise


@dataclasses.dataclass(frozen=True)
class Removal:
    """One key that left the daemon, or changed mount (reason "moved": it
    is still stored, on mount `to`). reason is one of "evicted",
    "cluster-evicted", "deleted", "purged", "corrupt", "vanished" (removed
    behind the daemon's back: another node on a shared mount), "moved";
    mount is the mount it left (stats()'s mount index), to the mount it
    is on now for a move (else None); time_ns when the daemon recorded it
    (time.time_ns()'s clock)."""
    seq: int
    fingerprint: int
    key: bytes
    reason: str
    mount: int
    to: object
    time_ns: int


@dataclasses.dataclass(frozen=True)
class RemovalBatch:
    """What a removal subscription delivers: removals in sequence order,
    or a resync (resync True, removals empty): removals were lost to the
    subscription, and every key of its namespaces may have been removed
    (vLLM's AllBlocksCleared: learn them again by lookups). cursor is
    (epoch, last): where to subscribe again from after this batch."""
    resync: bool
    removals: tuple
    cursor: tuple


class RemovalSubscription:
    """A removal stream of a Client (Client.subscribe_removals): the
    daemon pushes batches, which get() returns in order, or which the
    callback given to subscribe_removals is called with, on a thread of
    the subscription's own. Its queue is bounded (max_batches): a reader
    that falls further behind gets one resync in place of the batches it
    missed, as it does when it falls behind the daemon's ring. Safe to use
    from any thread."""

    def __init__(self, client, sub_id, epoch, last, mounts, max_batches):
        self._client, self.id, self._epoch = client, sub_id, epoch
        self.subscribed = (epoch, last)  # the daemon's epoch and last sequence number then
        # The device class of each of the daemon's mounts ("memory",
        # "nvme", "ssd", "hdd", "network", "unknown"), by the index a
        # Removal's mount and to name: the medium a key left or moved to.
        self.mounts = tuple(mounts)
        self._cursor = (epoch, last)
        self._cond = threading.Condition()
        self._queue = []
        self._max = max_batches
        self._lost = None  # the last of the batches dropped for a resync, or None
        self._error = None  # ConnectionLost once the connection or the subscription ended

    def _push(self, resync, last, records):
        """Queues a batch (the reader's thread): never waits."""
        with self._cond:
            if self._error is not None:
                return
            if self._lost is not None:
                self._lost = last
            elif len(self._queue) >= self._max:
                self._queue, self._lost = [], last
            else:
                rs = tuple(Removal(seq, fp, key, p.REMOVAL_REASONS.get(reason, f"reason({reason})"), mount,
                                   None if to == p.NO_REMOVAL_MOUNT else to, t)
                           for seq, fp, reason, mount, to, t, key in records)
                self._queue.append(RemovalBatch(resync, rs, (self._epoch, last)))
            self._cond.notify_all()

    def _end(self, err):
        with self._cond:
            if self._error is None:
                self._error = err
                self._cond.notify_all()

    def get(self, timeout=None):
        """The next batch, waiting up to timeout seconds (None: for ever):
        TimeoutError past it. Once the subscription is closed or its
        connection lost, the batches queued and then ConnectionLost."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                if self._lost is not None:
                    b = RemovalBatch(True, (), (self._epoch, self._lost))
                    self._lost = None
                    self._cursor = b.cursor
                    return b
                if self._queue:
                    b = self._queue.pop(0)
                    self._cursor = b.cursor
                    return b
                if self._error is not None:
                    raise self._error
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"no removal batch within {timeout}s")
                self._cond.wait(left)

    @property
    def cursor(self):
        """(epoch, last) after the last batch get() returned: what to pass
        as since= to subscribe again, on this connection or another."""
        with self._cond:
            return self._cursor

    def close(self):
        """Ends the subscription: the daemon sends no batch of it after its
        answer; get() raises ConnectionLost once the queue is read."""
        c = self._client
        with c._lock:
            open_ = c._subs.get(self.id) is self
        if open_:
            try:
                c._call(p.T_UNSUBSCRIBE_REMOVALS, p.pack("<I", (self.id,), ("subscription",)))
            finally:
                with c._lock:
                    if c._subs.get(self.id) is self:
                        del c._subs[self.id]
        self._end(ConnectionLost("the removal subscription was closed"))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Client:
    """A connection to the kvhost daemon at path (a Unix socket; None means
    default_socket()). timeout (seconds; None: none) bounds each wait on
    the daemon: connecting, the handshake, every reply and every send.
    A listener that takes no connection, or does not answer the handshake,
    within it raises TimeoutError naming the socket."""

    def __init__(self, path=None, name="python", timeout=30.0, lookup_table=True):
        if path is None:
            path = default_socket()
        if timeout is not None and not 0 < timeout < 1e9:
            raise ValueError(f"timeout {timeout!r}: want seconds > 0 (finite), or None for none")
        try:
            self._open(path, name, timeout, lookup_table, p.VERSION)
        except KvhostError as e:
            if e.code != p.CODE_VERSION:
                raise
            # A daemon older than protocol version 2 refused the Hello and
            # closed the connection: a new one, in version 1.
            self._open(path, name, timeout, lookup_table, p.MIN_VERSION)

    def _open(self, path, name, timeout, lookup_table, version):
        """Connects and makes the handshake in protocol version; a refused
        Hello raises KvhostError, the connection closed."""
        # The daemon's shared lookup table: None until the first lookup
        # asks for it, False where there is none to use.
        self._table = None if lookup_table else False
        self._fps = {}  # namespace id -> fingerprint
        self._lookups = {"table": 0, "daemon": 0}
        self._lookups_lock = threading.Lock()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            _connect(self._sock, path, timeout)
        except TimeoutError:
            self._sock.close()
            raise TimeoutError(errno.ETIMEDOUT, f"the kvhost daemon's socket took no connection within "
                               f"{timeout}s (a stalled daemon, its listen backlog full?)", path) from None
        except OSError as e:
            self._sock.close()
            # The same class (FileNotFoundError, PermissionError,
            # ConnectionRefusedError: OSError picks it from errno), with
            # the socket's path in the message.
            raise OSError(e.errno, f"{e.strerror}: cannot connect to the kvhost daemon's socket "
                          f"(is it running there? set KVHOST_SOCKET to its path)", path) from None
        except BaseException:
            self._sock.close()
            raise
        self._timeout = timeout
        if timeout is not None:
            # A daemon that reads nothing for this long is not waited for
            # forever by a send: the client stops sending (_send).
            _send_timeout(self._sock, timeout)
        self._wlock = threading.Lock()
        self._lock = threading.Lock()
        self._next = 0
        self._pending = {}
        self._jobs = {}
        self._subs = {}  # removal subscriptions by id
        self._closed = None
        self.limits = {"max_frame": p.MIN_FRAME}
        self._reader = threading.Thread(target=self._read_loop, name="kvhost-reader", daemon=True)
        self._reader.start()
        try:
            _, body = self._call(p.T_HELLO, p.hello(name, version))
            self.limits = p.decode_welcome(body, version)
        except TimeoutError:
            self.close()
            raise TimeoutError(errno.ETIMEDOUT, f"no answer to the handshake within {timeout}s from the kvhost "
                               "daemon's socket (a stalled daemon, or a process there that is not kvhost?)",
                               path) from None
        except BaseException:
            self.close()
            raise

    @property
    def supports_layer_loads(self):
        """Whether the daemon announced layer-range loads (load's layers=)
        in the handshake; False for a daemon older than protocol version 2."""
        return bool(self.limits.get("features", 0) & p.FEATURE_LAYER_LOADS)

    def peer_pid(self):
        """The pid of the process at the other end of the socket (the
        daemon that made the listening socket, SO_PEERCRED), None where it
        cannot be read: for a log line on a daemon that does not answer
        (alive and stuck, or gone)."""
        try:
            pid, _, _ = struct.unpack("3i", self._sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                  struct.calcsize("3i")))
        except (OSError, AttributeError):
            return None
        return pid if pid > 0 else None

    @property
    def supports_removals(self):
        """Whether the daemon announced removal streams
        (subscribe_removals) in the handshake."""
        return bool(self.limits.get("features", 0) & p.FEATURE_REMOVALS)

    def subscribe_removals(self, namespaces=(), since=None, callback=None, max_batches=256):
        """Subscribes to the removals of namespaces (Namespace objects or
        ids declared on this connection; none: every namespace of the
        daemon) after since: None the first time (the removals from now
        on), then the cursor (epoch, last) of the last batch read, on this
        connection or another. Where the daemon cannot serve since without
        a gap (older than its ring, or of a daemon since restarted) the
        first batch is a resync. Returns a RemovalSubscription; with
        callback, a thread of the subscription's calls it with each batch
        until the subscription ends. A daemon that did not announce the
        feature (supports_removals) raises UnsupportedError, and nothing
        is sent."""
        if not self.supports_removals:
            raise UnsupportedError(p.CODE_UNSUPPORTED, f"removal streams: the daemon "
                                   f"{self.limits.get('server', '')!r} announced none "
                                   f"(protocol version {self.limits.get('version')})")
        if max_batches < 1:
            raise ValueError(f"max_batches {max_batches}: want at least 1")
        epoch, last = since if since is not None else (0, 0)
        ids = [ns.id if isinstance(ns, Namespace) else ns for ns in namespaces]
        body = p.subscribe_removals(epoch, last, ids)
        req_id, pend = self._send(p.T_SUBSCRIBE_REMOVALS, body)
        if not pend.event.wait(self._timeout):
            threading.Thread(target=self._undo_late, args=(pend, p.T_SUBSCRIBE_REMOVALS, self._unsubscribe_late),
                             daemon=True, name=f"kvhost-undo-{req_id}").start()
            raise TimeoutError(f"no reply to request {req_id} after {self._timeout}s")
        if pend.error is not None:
            raise _again(pend.error)
        if pend.ftype != p.T_SUBSCRIBE_REMOVALS | p.T_REPLY:
            raise _refusal(pend.ftype, pend.body, p.T_SUBSCRIBE_REMOVALS)
        sub_id = p.decode_subscribed(pend.body)[0]
        with self._lock:
            sub = self._subs.get(sub_id)
        if sub is None:
            raise ConnectionLost(f"removal subscription {sub_id} lost with the connection")
        with sub._cond:
            sub._max = max_batches
        if callback is not None:
            def deliver():
                while True:
                    try:
                        b = sub.get()
                    except ConnectionLost:
                        return
                    try:
                        callback(b)
                    except Exception:  # the caller's: logged, the stream goes on
                        _log.exception("kvhost: removal callback")
            threading.Thread(target=deliver, daemon=True, name=f"kvhost-removals-{sub_id}").start()
        return sub

    def _unsubscribe_late(self, body):
        sub_id = p.decode_subscribed(body)[0]
        with self._lock:
            self._subs.pop(sub_id, None)
        self._call(p.T_UNSUBSCRIBE_REMOVALS, p.pack("<I", (sub_id,), ("subscription",)))

    def set_timeout(self, timeout):
        """Sets the bound on each later wait on the daemon (seconds > 0;
        None: none): every reply, job acceptance and send from now on, as
        the constructor's timeout does. A caller may connect with a
        generous timeout and then tighten it for the steps it wants bounded
        closely."""
        if timeout is not None and not 0 < timeout < 1e9:
            raise ValueError(f"timeout {timeout!r}: want seconds > 0 (finite), or None for none")
        if timeout is None:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", 0, 0))
        else:
            _send_timeout(self._sock, timeout)
        self._timeout = timeout

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        """Closes the connection; the daemon cancels unfinished jobs. Jobs
        in flight end at once with ConnectionLost, though the daemon may
        still be running them: close_after_jobs is the one for a client
        whose jobs' memory is to be used again."""
        self._stop_sending(ConnectionLost("client closed"))
        try:
            self._sock.shutdown(socket.SHUT_RD)
        except OSError:
            pass
        self._reader.join()
        self._finish_close()

    def close_after_jobs(self):
        """Closes the connection once the daemon has ended its jobs, and
        returns at once: sending stops now (the daemon, seeing the end of
        the connection, cancels what it has not finished), each job in
        flight ends with its completion or when the daemon closes the
        connection, and then the socket is closed on a thread of its own."""
        self._stop_sending(ConnectionLost("client closed"))

        def finish():
            self._reader.join()
            self._finish_close()
        threading.Thread(target=finish, name="kvhost-close", daemon=True).start()

    def _finish_close(self):
        self._sock.close()
        with self._lock:  # against _open_table, which sets it under the lock
            table, self._table = self._table, False
        if table:
            table.close()

    # -- I/O ---------------------------------------------------------------

    def _recv_exact(self, n):
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            k = self._sock.recv_into(view[got:])
            if k == 0:
                raise ConnectionLost("daemon closed the connection")
            got += k
        return bytes(buf)

    def _read_loop(self):
        err = None
        try:
            while True:
                length, ftype, flags, req_id = p.HEADER.unpack(self._recv_exact(p.HEADER_SIZE))
                if length + p.HEADER_SIZE > self.limits["max_frame"] or flags:
                    raise p.ProtocolError(f"bad frame header: length {length} flags {flags}")
                body = self._recv_exact(length) if length else b""
                if ftype == p.T_COMPLETION:
                    job_id, kind, keys, nbytes, dur, msg = p.decode_completion(body)
                    with self._lock:
                        job = self._jobs.get(job_id)
                        if job is not None and job._request != (kind, len(keys)):
                            # result.keys[i] is request key i. The job
                            # stays: it ends with the connection.
                            raise p.ProtocolError(f"completion of job {job_id}, (kind, keys) {job._request}: "
                                                  f"{(kind, len(keys))}")
                        self._jobs.pop(job_id, None)
                    if job is None:
                        raise p.ProtocolError(f"completion of unknown job {job_id}")
                    job._finish(Result(keys, nbytes, dur, msg), None)
                    continue
                if ftype == p.T_REMOVALS and req_id == 0:
                    sub_id, resync, last, records = p.decode_removals(body)
                    with self._lock:
                        sub = self._subs.get(sub_id)
                    if sub is not None:  # none: ended meanwhile
                        sub._push(resync, last, records)
                    continue
                with self._lock:
                    pend = self._pending.get(req_id)
                    if pend is not None:
                        # A body too short for its caller to decode: the
                        # stream is not what this client reads. The
                        # request stays pending: it ends with the
                        # connection.
                        problem = p.reply_problem(pend.asked, ftype, body)
                        if problem:
                            raise p.ProtocolError(f"request {req_id}: {problem}")
                    job = pend.unanswered if pend is not None else None
                    if job is not None and ftype == pend.asked | p.T_REPLY:  # a store or load accepted
                        (job_id,) = struct.unpack_from("<Q", body)
                        if job_id in self._jobs:
                            # Ids in flight are unique: the two jobs could
                            # not be told apart. Both stay, and end with
                            # the connection.
                            raise p.ProtocolError(f"job id {job_id} accepted again while in flight")
                        job._accept(job_id)
                        self._jobs[job_id] = job
                    if pend is not None and pend.asked == p.T_SUBSCRIBE_REMOVALS and ftype == pend.asked | p.T_REPLY:
                        # Made before the next frame: its first event.
                        sub_id, epoch, last, mounts = p.decode_subscribed(body)
                        self._subs[sub_id] = RemovalSubscription(self, sub_id, epoch, last, mounts, 256)
                    self._pending.pop(req_id, None)
                if pend is None:
                    if req_id == 0 and ftype == p.T_ERROR:
                        raise _closed_by_daemon(*p.decode_error(body))
                    raise p.ProtocolError(f"reply to unknown request {req_id}")
                if job is not None:
                    if job.id is None:  # refused, or answered oddly
                        job._finish(None, _refusal(ftype, body, pend.asked))
                    continue
                pend.ftype, pend.body = ftype, body
                pend.event.set()
        except Exception as e:  # a frame not understood too (struct.error, IndexError ...)
            err = e
        said = isinstance(err, ConnectionLost) and err.code is not None  # the daemon's Error about the connection
        if said or not isinstance(err, (OSError, ConnectionLost)):
            # The stream cannot be read on (a frame not understood, or the
            # daemon's error about the connection itself): send nothing
            # more and read to its end, since the daemon ends the jobs it
            # runs on the caller's memory only before it closes.
            if not said:
                err = ConnectionLost(f"a frame from the daemon could not be read ({type(err).__name__}: {err})")
            self._stop_sending(err)
            try:
                while self._sock.recv(1 << 16):
                    pass
            except OSError:
                pass
        with self._lock:
            if self._closed is None:
                self._closed = err if isinstance(err, ConnectionLost) else ConnectionLost(str(err))
            closed = self._closed
            pending, jobs, subs = self._pending, self._jobs, self._subs
            self._pending, self._jobs, self._subs = {}, {}, {}
        for sub in subs.values():
            sub._end(closed)
        for pend in pending.values():
            pend.error = closed
            if pend.unanswered is not None:
                pend.unanswered._finish(None, closed)
            else:
                pend.event.set()
        for job in jobs.values():
            job._finish(None, closed)

    def _send(self, ftype, body, fds=None, unanswered=None):
        """Sends a request; returns (its id, its _Pending), which the reader
        answers."""
        for fd in fds or ():
            # A caller's bad descriptor fails its call, before anything is
            # sent: sendmsg refusing it would end the connection (_send
            # stops sending after any failed send).
            try:
                os.fstat(fd)
            except TypeError:
                raise TypeError(f"descriptor {fd!r}: want a file descriptor (an int)") from None
            except OSError as e:
                raise OSError(e.errno, f"{e.strerror}: descriptor {fd!r} cannot be sent to the daemon") from None
        with self._lock:
            if self._closed is not None:
                raise _again(self._closed)
            self._next += 1
            req_id = self._next
            pend = _Pending(ftype, unanswered)
            self._pending[req_id] = pend
        data = p.frame(ftype, req_id, body)
        if len(data) > self.limits["max_frame"]:
            with self._lock:
                self._pending.pop(req_id, None)
            raise ValueError(f"frame of {len(data)} bytes exceeds the daemon's limit {self.limits['max_frame']}")
        with self._wlock:
            try:  # KeyboardInterrupt too: a frame cut short leaves the stream unusable
                if fds:
                    sent = socket.send_fds(self._sock, [data], fds)
                    if sent < len(data):
                        self._sock.sendall(data[sent:])
                else:
                    self._sock.sendall(data)
            except BaseException as e:
                # Part of a frame may be on the socket: nothing more can be
                # sent. The reader goes on: jobs the daemon accepted end
                # with their completions, or when it closes the connection.
                if isinstance(e, (BrokenPipeError, ConnectionResetError)):
                    err = ConnectionLost("daemon closed the connection")
                else:
                    err = ConnectionLost(f"cannot send to the daemon ({type(e).__name__}: {e}): stopped "
                                         "sending on this connection")
                self._stop_sending(err)
                if not isinstance(e, Exception):
                    raise
                raise _again(self._closed) from None
        return req_id, pend

    def _stop_sending(self, err):
        """No request is sent after this (each raises err): the write side
        is shut, so the daemon reads to the end of the connection, cancels
        what it has not finished and closes it once its jobs ended."""
        with self._lock:
            if self._closed is None:
                self._closed = err
        try:
            self._sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def _call(self, ftype, body, fds=None, undo=None):
        """Sends a request and returns the reply's (type, body). On a
        timeout, undo (if given) is called with the reply's body when the
        reply comes: what the daemon made for a caller that gave up (a pin,
        a region, a cache) is given back, not held until the connection
        closes."""
        req_id, pend = self._send(ftype, body, fds)
        if not pend.event.wait(self._timeout):
            if undo is not None:
                threading.Thread(target=self._undo_late, args=(pend, ftype, undo), daemon=True,
                                 name=f"kvhost-undo-{req_id}").start()
            raise TimeoutError(f"no reply to request {req_id} after {self._timeout}s")
        if pend.error is not None:
            raise _again(pend.error)
        if pend.ftype != ftype | p.T_REPLY:
            raise _refusal(pend.ftype, pend.body, ftype)
        return pend.ftype, pend.body

    def _undo_late(self, pend, ftype, undo):
        """Waits for the reply of a request whose caller gave up (it comes,
        or the connection closes and the daemon gives everything back) and
        calls undo with its body."""
        pend.event.wait()
        if pend.error is None and pend.ftype == ftype | p.T_REPLY:
            try:
                undo(pend.body)
            except Exception as e:  # the connection went meanwhile: given back with it
                _log.debug("kvhost: giving back what an abandoned request made: %s", e)

    def _job(self, ftype, body, block, nkeys):
        """A store or load of nkeys keys: the Job once the daemon accepted
        it (block), or at once, sent, with its acceptance or refusal still
        to come. A TimeoutError for an acceptance that did not come carries
        the job (e.job): the daemon may still run it."""
        job = Job(self, None, (p.JOB_STORE if ftype == p.T_STORE else p.JOB_LOAD, nkeys))
        self._send(ftype, body, unanswered=job)
        if not block:
            return job
        if not job._accepted.wait(self._timeout):
            e = TimeoutError(f"the daemon has not accepted the job after {self._timeout}s; it may still run "
                             "it: its memory is in use until e.job ends")
            e.job = job
            raise e
        if job.id is None:  # ended unaccepted: refused, or the connection closed
            job.wait(0)
        return job

    # -- operations ----------------------------------------------------------

    def register_memfd(self, fd, size):
        """Registers size bytes of a memfd (sealed against shrinking here if
        not already); returns the region id."""
        seal_shrink(fd)
        _, body = self._call(p.T_REGISTER_MEMORY, p.register_memory(p.MEMORY_MEMFD, size), [fd],
                             undo=self._unregister_late)
        return struct.unpack_from("<I", body)[0]

    def register_buffer(self, buf):
        """Registers a HostBuffer (or anything with fd and size)."""
        return self.register_memfd(buf.fd, buf.size)

    def register_shared_file(self, fd, size):
        """Registers size bytes of a shared-memory file without sealing it:
        a memfd or a file under /dev/shm (such as vLLM's shared CPU region).
        Its owner may still truncate it; a job touching the missing pages
        then fails (code "bad descriptor") and the daemon goes on. Daemons
        that cannot guard their copies raise UnsupportedError. Returns the
        region id."""
        if size <= 0:
            raise ValueError(f"size {size}: want > 0")
        _, body = self._call(p.T_REGISTER_MEMORY, p.register_memory(p.MEMORY_SHARED, size), [fd],
                             undo=self._unregister_late)
        return struct.unpack_from("<I", body)[0]

    def register_cuda(self, device, handle, offset, size):
        """Registers GPU memory by CUDA IPC handle: [offset, offset+size) of
        the allocation handle (64 bytes, cudaIpcGetMemHandle of its base)
        names, on device as the daemon numbers its GPUs. Daemons without GPU
        support raise UnsupportedError; a stale, forged or other device's
        handle raises KvhostError with code "bad IPC handle"."""
        _, body = self._call(p.T_REGISTER_MEMORY, p.register_memory(p.MEMORY_CUDA_IPC, size, device, offset, handle),
                             undo=self._unregister_late)
        return struct.unpack_from("<I", body)[0]

    def register_cuda_tensor(self, tensor, device=None):
        """Registers the GPU memory of a torch CUDA tensor's storage and
        returns the region id. The region is the whole storage: the tensor
        itself starts tensor.storage_offset() * tensor.element_size() bytes
        into it. Keep the tensor alive while the region is registered.

        device is the daemon's ordinal of the tensor's GPU. By default it is
        found by the GPU's UUID, where torch and the daemon both report it
        (whatever CUDA_VISIBLE_DEVICES says in either process), else it is
        the tensor's device index, translated through CUDA_VISIBLE_DEVICES
        when that is a list of integers (the daemon sees every GPU of the
        node). A device given that the daemon knows as another GPU than the
        tensor's is refused with ValueError: where GPUs have peer access the
        daemon could not tell, and would move the bytes over the peer link.
        torch is imported lazily. See cuda_ipc_handle for what torch gives."""
        dev, handle, offset, size = memory.cuda_ipc_handle(tensor)
        uuid = memory.device_uuid(tensor)
        known = {}
        if uuid is not None:
            known = {d["ordinal"]: d["uuid"] for d in self.stats()["devices"] if d.get("uuid")}
        if device is None and known:
            match = [o for o, u in known.items() if u == uuid]
            if not match:
                raise ValueError(f"the tensor's GPU {memory.uuid_text(uuid)} is not one the daemon serves "
                                 f"({', '.join(memory.uuid_text(u) for u in known.values())})")
            device = match[0]
        elif device is None:
            device = memory.daemon_device(dev)
        elif device in known and known[device] != uuid:
            raise ValueError(f"device={device} is {memory.uuid_text(known[device])} to the daemon, "
                             f"but the tensor lives on {memory.uuid_text(uuid)}")
        return self.register_cuda(device, handle, offset, size)

    def _unregister_late(self, body):
        self.unregister_memory(struct.unpack_from("<I", body)[0])

    def _unpin_late(self, body):
        (pin_id,) = struct.unpack_from("<Q", body)
        if pin_id:
            self.unpin(pin_id)

    def unregister_memory(self, region):
        self._call(p.T_UNREGISTER_MEMORY, p.pack("<I", (region,), ("region",)))

    def declare(self, geometry):
        """Declares a namespace; returns a Namespace."""
        _, body = self._call(p.T_DECLARE, p.declare(geometry))
        ns, bpk, fp, kb = struct.unpack_from("<IIQQ", body)
        self._fps[ns] = fp
        return Namespace(ns, bpk, fp, kb, geometry)

    def undeclare(self, ns):
        """Gives up a namespace no registered cache of this connection uses
        and no pin it holds is in (the daemon answers "in use" naming the
        pins: unpin them first).

        Stored data is kept; the daemon forgets the geometry once no
        connection has it declared (closing the connection undeclares all)."""
        ns = ns.id if isinstance(ns, Namespace) else ns
        self._call(p.T_UNDECLARE, p.pack("<I", (ns,), ("namespace",)))
        self._fps.pop(ns, None)  # lookups in it go to the daemon, which refuses them

    def register_cache(self, ns, layers):
        """Registers a paged cache (one Layer per model layer); returns its id."""
        ns = ns.id if isinstance(ns, Namespace) else ns
        _, body = self._call(p.T_REGISTER_CACHE, p.register_cache(ns, layers),
                             undo=lambda b: self.unregister_cache(struct.unpack_from("<I", b)[0]))
        return struct.unpack_from("<I", body)[0]

    def unregister_cache(self, cache):
        self._call(p.T_UNREGISTER_CACHE, p.pack("<I", (cache,), ("cache",)))

    def lookup(self, ns, keys):
        """Returns how many leading keys are stored.

        The keys the daemon's shared lookup table holds are counted from
        this process's own mapping of it, without a round trip; the daemon
        is asked about the rest unless the table's misses are final
        (docs/protocol.md, "Shared lookup table")."""
        ns = ns.id if isinstance(ns, Namespace) else ns
        # The table checks the keys as the daemon would.
        return self._answer(ns, keys, self._probe(ns, lambda table, fp: table.leading(fp, keys)))

    def key_digests(self, ns, keys):
        """The bytes that place keys in the shared lookup table (16 per key,
        key after key), for lookup_digests: a caller that asks about the
        same keys again and again (a scheduler, for a waiting request)
        hashes them once. None where this process cannot read the table
        (then call lookup). The keys are checked as the daemon checks them
        (ValueError)."""
        ns = ns.id if isinstance(ns, Namespace) else ns
        table, fp = self._table_of(ns)
        if table is None:
            return None
        return b"".join(table.digest(fp, k) for k in keys)

    def lookup_digests(self, ns, keys, digests):
        """lookup of keys whose key_digests the caller kept: the same
        answer, without hashing the keys again where the table answers."""
        ns = ns.id if isinstance(ns, Namespace) else ns
        return self._answer(ns, keys, self._probe(ns, lambda table, fp: table.leading_digests(digests)))

    def _answer(self, ns, keys, got):
        """lookup's answer from the table's (n, final), or None where the
        table gave none: the daemon is asked about what the table leaves."""
        if got is None:
            return self._lookup_daemon(ns, p.keys_body(keys))
        n, final = got
        if n == len(keys) or final:
            with self._lookups_lock:
                self._lookups["table"] += 1
            return n
        return n + self._lookup_daemon(ns, p.keys_body(keys[n:]))

    def _table_of(self, ns):
        """(the shared lookup table, ns's fingerprint), or (None, None)
        where this process cannot read the table for ns."""
        table = self._table if self._table is not None else self._open_table()
        fp = self._fps.get(ns)
        if not table or fp is None:
            return None, None
        return table, fp

    def _probe(self, ns, probe):
        """probe(table, fp)'s answer (n, final), or None where the table
        gives none. A frame of its own: the table is not held by a lookup
        that goes on to the daemon, so that a close meanwhile unmaps it."""
        table, fp = self._table_of(ns)
        if table is None:
            return None
        if self._closed is not None:
            raise _again(self._closed)
        try:
            return probe(table, fp)
        except ValueError:
            # close() on another thread unmapped the table under the probe.
            if self._closed is not None:
                raise _again(self._closed) from None
            raise

    def touch(self, ns, keys):
        """Asks the daemon itself about keys, which counts each hit as an
        access for its eviction policy (a lookup answered from the shared
        lookup table is not seen by the daemon); returns how many leading
        keys are stored."""
        ns = ns.id if isinstance(ns, Namespace) else ns
        return self._lookup_daemon(ns, p.keys_body(keys))

    def _lookup_daemon(self, ns, body):
        with self._lookups_lock:
            self._lookups["daemon"] += 1
        _, reply = self._call(p.T_LOOKUP, p.pack("<I", (ns,), ("namespace",)) + body)
        return struct.unpack_from("<I", reply)[0]

    def _open_table(self):
        """Maps the daemon's shared lookup table; False where there is none
        this process can use (an older daemon, none kept, no permission).
        A daemon that does not answer in time raises TimeoutError, and the
        next lookup asks again."""
        table = False
        try:
            _, body = self._call(p.T_LOOKUP_TABLE, b"")
            (n,) = struct.unpack_from("<H", body)
            table = LookupTable(body[2:2 + n].decode())
        except TimeoutError:  # an OSError, but no answer: not "none to use"
            raise
        except (KvhostError, OSError, FormatError, struct.error, UnicodeDecodeError):
            pass
        with self._lock:
            if self._table is None:
                self._table = table
            elif table:
                table.close()
            return self._table

    def lookup_counts(self):
        """How many lookups the shared lookup table answered alone
        ("table") and how many asked the daemon ("daemon")."""
        with self._lookups_lock:
            return dict(self._lookups)

    def delete(self, ns, keys):
        """Deletes keys; returns how many were stored."""
        ns = ns.id if isinstance(ns, Namespace) else ns
        _, body = self._call(p.T_DELETE, p.pack("<I", (ns,), ("namespace",)) + p.keys_body(keys))
        return struct.unpack_from("<I", body)[0]

    def purge(self, model=None, fingerprint=None):
        """Asks the daemon to remove every file of a model's namespaces
        (model: every namespace declared with the id since the daemon
        started) or of one namespace (fingerprint, an int: as stats()
        lists it; also files found on the mounts that no client declared
        since). Files a client pins stay. Returns a dict: "namespaces",
        "files", "keys", "bytes" removed, "pinned" files kept and "left":
        files whose removal failed (no longer served, still on disk until a
        later purge or an eviction removes them; 0 from a daemon that does
        not say). A model or fingerprint the daemon does not know raises
        KvhostError (UnknownNS); a daemon older than purge, KvhostError
        (UnknownType)."""
        _, reply = self._call(p.T_PURGE, p.purge(model, fingerprint))
        r = dict(zip(("namespaces", "files", "keys", "bytes", "pinned"), struct.unpack_from("<5Q", reply)))
        r["left"] = struct.unpack_from("<Q", reply, 40)[0] if len(reply) >= 48 else 0
        return r

    def connected(self):
        """False once the connection is closed or lost. Takes no lock (one
        attribute read, set once): the vLLM integrations ask it on every
        lookup and step."""
        return self._closed is None

    def pin(self, ns, keys, lease_s=0.0):
        """Pins the stored keys of ns: the daemon neither evicts nor deletes
        them until unpin, the lease (seconds; 0: none, at most 24 h) ends or
        this connection closes. Every file is checked as it is pinned.
        Returns (pin id, [bool per key: pinned]); the id is 0 when no key was
        stored."""
        pin_id, states = self._pin(p.T_PIN, ns, keys, lease_s)
        return pin_id, [s == p.PIN_HELD for s in states]

    def pin_loadable(self, ns, keys, lease_s=0.0, group=""):
        """pin for a client whose loads go through other connections' caches
        (a scheduler beside its workers): while no connection of group
        (join_group; "" for any connection) has a cache of ns registered,
        the daemon pins nothing. Returns (pin id, [bool per key: pinned],
        no_cache), no_cache True when no such cache was registered. A daemon
        older than the frame raises KvhostError (UnknownType)."""
        pin_id, states = self._pin(p.T_PIN_LOADABLE, ns, keys, lease_s, p.group_str8(group, True))
        return pin_id, [s == p.PIN_HELD for s in states], any(s == p.PIN_NO_CACHE for s in states)

    def join_group(self, group):
        """Puts this connection's caches in group (str or bytes, 1..64
        bytes), which pin_loadable can name: one engine's workers join its
        group, so that its scheduler's pins count only their caches. Once
        per connection, before any register_cache. A daemon older than the
        frame raises KvhostError (UnknownType)."""
        self._call(p.T_GROUP, p.group_str8(group, False))

    def _pin(self, ftype, ns, keys, lease_s, tail=b""):
        ns = ns.id if isinstance(ns, Namespace) else ns
        ms = int(round(lease_s * 1000))
        if lease_s > 0 and ms == 0:
            ms = 1
        if not 0 <= ms <= p.MAX_LEASE_MS:
            raise ValueError(f"lease {lease_s}s: want 0..{p.MAX_LEASE_MS // 1000}s")
        body = p.pack("<II", (ns, ms), ("namespace", "lease")) + p.keys_body(keys) + tail
        _, body = self._call(ftype, body, undo=self._unpin_late)
        pin_id, n = struct.unpack_from("<QI", body)
        if n != len(keys):  # a body too short for n: the reader refused it (reply_problem)
            raise p.ProtocolError(f"pin reply for {n} keys to a pin of {len(keys)}")
        return pin_id, body[12:12 + n]

    def unpin(self, pin_id):
        """Releases a pin; returns how many keys it held (0 if it was
        released already or its lease ended)."""
        _, body = self._call(p.T_UNPIN, p.pack("<Q", (pin_id,), ("pin",)))
        return struct.unpack_from("<I", body)[0]

    def store(self, cache, keys, blocks, block=True):
        """Starts storing keys[i] from cache blocks blocks[i]; returns a Job.
        block=False returns as soon as the request is sent, without waiting
        for the daemon to accept it: a refusal is then raised by the Job's
        wait(), and a daemon that stopped answering holds up no caller."""
        return self._job(p.T_STORE, p.transfer(cache, keys, blocks), block, len(keys))

    def load(self, cache, keys, blocks, block=True, layers=None):
        """Starts loading keys[i] into cache blocks blocks[i]; returns a Job
        (block as for store). A block id NO_BLOCK leaves that block of the
        key out (a load that starts or ends inside a key): the daemon
        loads the key's other blocks, still verifying the whole key.

        layers=(first, count) loads only the layers [first, first+count)
        of every key (count 0: every layer, first 0 then): the daemon
        reads, verifies and writes those layers' bytes of the blocks and
        leaves their other layers as they are; the Result's bytes are
        those layers'. A daemon that did not announce it
        (supports_layer_loads) raises UnsupportedError, and nothing is
        sent; a range past the namespace's layers is refused by the daemon
        (KvhostError, code "invalid argument", naming the range)."""
        body = p.transfer(cache, keys, blocks, load=True)
        if layers is None:
            return self._job(p.T_LOAD, body, block, len(keys))
        body += p.layer_range(layers)
        if not self.supports_layer_loads:
            raise UnsupportedError(p.CODE_UNSUPPORTED, f"a load of layers {tuple(layers)}: the daemon "
                                   f"{self.limits.get('server', '')!r} announced no layer-range loads "
                                   f"(protocol version {self.limits.get('version')})")
        return self._job(p.T_LOAD_LAYERS, body, block, len(keys))

    def cancel(self, job):
        """Asks to cancel a job; True if it was still in flight."""
        _, body = self._call(p.T_CANCEL, p.pack("<Q", (job.id if isinstance(job, Job) else job,), ("job",)))
        return body[0] == 1

    def stats(self):
        """Returns the daemon's counters as a dict: among them "entries"
        and "keys" (files and keys indexed), "mounts", "devices" and
        "namespaces" ({"list": one dict per namespace, the most bytes
        first, with "fingerprint", "model", "declared", "files", "keys"
        and "bytes"; "left_out": how many the daemon did not list}, or
        None from a daemon that predates the section). A reply whose
        counts run past its bytes raises ProtocolError (the connection,
        whose frames are whole, stays usable)."""
        _, body = self._call(p.T_STATS, b"")
        try:
            return p.decode_stats(body)
        except (struct.error, IndexError, UnicodeDecodeError) as e:
            raise p.ProtocolError(f"Stats reply of {len(body)} bytes not decodable: {e}") from None


