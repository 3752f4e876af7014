"""The connection under Client: the socket it connects to
(default_socket), the handshake, the reader thread that hands every
reply to the thread that asked and every job completion to its Job, and
sending requests and jobs (_Connection, which Client extends with the
daemon's requests).
"""

import errno
import logging
import os
import socket
import struct
import threading
import time

from . import protocol as p
from .errors import ConnectionLost, KvhostError, _again, _closed_by_daemon, _refusal
from .jobs import Job, Result, _Pending
from .removals import RemovalSubscription

_log = logging.getLogger("kvhost")


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


class _Later:
    """A request sent whose reply is not waited for yet (_call_later)."""
    __slots__ = ("_conn", "_ftype", "_req_id", "_pend", "_undo", "sent")

    def __init__(self, conn, ftype, req_id, pend, undo):
        self._conn, self._ftype, self._req_id, self._pend, self._undo = conn, ftype, req_id, pend, undo
        self.sent = time.monotonic()  # when it was sent

    def answered(self):
        """Whether the reply came (or the connection ended)."""
        return self._pend.event.is_set()

    def reply(self):
        """The reply's (type, body), waited for up to the connection's
        timeout as _call waits: on a TimeoutError undo is called with the
        reply's body once it comes; a refusal raises KvhostError, a lost
        connection ConnectionLost."""
        pend, ftype = self._pend, self._ftype
        if not pend.event.wait(self._conn._timeout):
            self.abandon()
            raise TimeoutError(f"no reply to request {self._req_id} after {self._conn._timeout}s")
        if pend.error is not None:
            raise _again(pend.error)
        if pend.ftype != ftype | p.T_REPLY:
            raise _refusal(pend.ftype, pend.body, ftype)
        return pend.ftype, pend.body

    def abandon(self):
        """Gives the reply up: undo is called with its body once it comes
        (at once where it came)."""
        if self._undo is not None:
            threading.Thread(target=self._conn._undo_late, args=(self._pend, self._ftype, self._undo), daemon=True,
                             name=f"kvhost-undo-{self._req_id}").start()


class _Connection:
    """A connection to the kvhost daemon: the handshake, the reader thread,
    requests and jobs sent and answered, and closing. Client adds the
    daemon's requests."""

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
        return self._call_later(ftype, body, fds, undo).reply()

    def _call_later(self, ftype, body, fds=None, undo=None):
        """Sends a request and returns its _Later, whose reply() waits for
        what _call returns."""
        req_id, pend = self._send(ftype, body, fds)
        return _Later(self, ftype, req_id, pend, undo)

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

    def connected(self):
        """False once the connection is closed or lost. Takes no lock (one
        attribute read, set once): the vLLM integrations ask it on every
        lookup and step."""
        return self._closed is None
