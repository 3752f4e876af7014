"""Helpers shared by the secondary tier (``tier``, ``_compat``) and the
offloading spec (``spec``, ``spec_compat``, ``spec_worker``): finding
vLLM and checking its classes, the fallback types both use without vLLM,
the daemon key of a vLLM key, the medium events name, the memory
mapping behind an address, and connecting to the daemon again after a
lost connection.

Importing this module imports nothing of vLLM.
"""

import dataclasses
import hashlib
import importlib.util
import inspect
import logging
import os
import threading
import time
import typing

from .. import protocol as p
from ..client import Client, ConnectionLost, KvhostError

# A child of vLLM's "vllm" logger, the one vLLM configures.
_log = logging.getLogger("vllm.kvhost")


class UnsupportedVLLM(RuntimeError):
    """The installed vLLM lacks a feature the kvhost tier or spec needs."""


@dataclasses.dataclass
class OffloadingEvent:
    """Fallback of vLLM's OffloadingEvent (used only without vLLM)."""
    keys: list
    medium: object
    removed: bool
    locality: object = None


@dataclasses.dataclass
class RequestOffloadingContext:
    """Fallback of vLLM's RequestOffloadingContext (used only without vLLM)."""


def vllm_installed():
    """Whether a vllm package can be imported (without importing it)."""
    try:
        return importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):
        return False


def vllm_version():
    """The installed vLLM's version, "unknown version" when its metadata
    cannot say (a source checkout)."""
    try:
        from importlib import metadata
        return metadata.version("vllm")
    except Exception:  # a source checkout has no metadata: the name stays generic
        return "unknown version"


def has_field(cls, name):
    """Whether cls (a dataclass or any class) takes name as a field or a
    constructor parameter."""
    if dataclasses.is_dataclass(cls):
        return any(f.name == name for f in dataclasses.fields(cls))
    try:
        return name in inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return False


def missing_features(api, classes, members: typing.Mapping = None, fields: typing.Mapping = None):
    """What api (a namespace of vLLM's classes or stand-ins) lacks, in
    order: each of classes that is absent, then each "Class.member" of
    members (class name -> attribute names) and each "Class.field" of fields
    (class name -> constructor fields) of a class that is present."""
    missing = [n for n in classes if getattr(api, n, None) is None]
    for n, names in (members or {}).items():
        c = getattr(api, n, None)
        if c is not None:
            missing += [f"{n}.{m}" for m in names if not hasattr(c, m)]
    for n, names in (fields or {}).items():
        c = getattr(api, n, None)
        if c is not None:
            missing += [f"{n}.{f}" for f in names if not has_field(c, f)]
    return missing


def unsupported(api, missing, window):
    """The UnsupportedVLLM error for an api that lacks missing (names),
    naming the supported window."""
    return UnsupportedVLLM(f"kvhost.vllm: this vLLM ({getattr(api, 'name', '?')}) lacks "
                           f"{', '.join(missing)}; supported: {window}")


def merge_options(given, defaults, ignored, what):
    """defaults (a dict) updated by the entries of given that it names; an
    entry neither in defaults nor in ignored is a ValueError naming every
    such one (what: "tier" or "spec", the kind of option)."""
    unknown = sorted(set(given) - set(defaults) - set(ignored))
    if unknown:
        raise ValueError(f"kvhost.vllm: unknown {what} option(s) {', '.join(unknown)}; "
                         f"known: {', '.join(sorted(defaults))}")
    o = dict(defaults)
    o.update({k: v for k, v in given.items() if k in defaults})
    return o


def check_seconds(o, keys):
    """Raises ValueError naming the first option of keys in o that is not
    a finite number of seconds >= 0 (a bool, a string, NaN or infinity is
    none: a wait of infinite seconds overflows)."""
    for k in keys:
        v = o[k]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1e9:
            raise ValueError(f"kvhost.vllm: {k}: want seconds >= 0 (finite), got {v!r}")


# The default bound on any wait of a vLLM call on the daemon (option
# "daemon_wait_s"): well under vLLM's own limits on a step and a stop
# (VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS, 300 s, on a worker's step;
# VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS, 5 s, on the engine core's and the
# workers' exit), and long enough for a healthy daemon's jobs to end.
DAEMON_WAIT_S = 2.0


def check_daemon_wait(o):
    """Raises ValueError unless o's daemon_wait_s is a finite number of
    seconds > 0: the bound on any wait of a vLLM call on the daemon."""
    t = o["daemon_wait_s"]
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < 1e9:
        raise ValueError(f"kvhost.vllm: daemon_wait_s: want seconds > 0 (finite), got {t!r}")


def setup_timeout(o):
    """The timeout of a connection's handshake and set-up requests (made
    in a vLLM call at start): request_timeout_s, but no more than
    daemon_wait_s."""
    return min(o["request_timeout_s"], o["daemon_wait_s"])


def daemon_pid(client):
    """The pid of the daemon at the other end of client's socket
    (Client.peer_pid), None where it cannot be read."""
    peer = getattr(client, "peer_pid", None)
    return peer() if callable(peer) else None


def daemon_state(client):
    """For a log line on a daemon that does not answer: its pid and
    whether that process still exists ("daemon pid 123, alive": frozen
    or stuck; "gone": its connection's end follows), as far as known."""
    pid = daemon_pid(client)
    if pid is None:
        return "daemon pid unknown"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return f"daemon pid {pid}, gone"
    except OSError:  # EPERM: it exists, another user's process
        pass
    return f"daemon pid {pid}, alive"


def check_request_timeout(o):
    """Raises ValueError unless o's request_timeout_s is a finite number of
    seconds > 0, as Client's timeout takes it."""
    t = o["request_timeout_s"]
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < 1e9:
        raise ValueError(f"kvhost.vllm: request_timeout_s: want seconds > 0 (finite), got {t!r}")


def daemon_key(key):
    """The daemon's key for a vLLM key (hashed when longer than the
    daemon's maximum key length)."""
    key = bytes(key)
    if len(key) <= p.MAX_KEY_LEN:
        return key
    return b"\xffkvhost-sha256:" + hashlib.sha256(key).digest()


def pick_medium(api, name=None):
    """The medium events name: vLLM's Medium member called name (or the
    first of DISK, STORAGE, FS, FILE that exists), else the plain string
    (name, or "KVHOST"). A name that is not a member is a ValueError."""
    medium = getattr(api, "Medium", None)
    if medium is None:
        return name or "KVHOST"
    for n in [name] if name else ["DISK", "STORAGE", "FS", "FILE"]:
        if hasattr(medium, n):
            return getattr(medium, n)
    if name:
        raise ValueError(f"kvhost.vllm: medium {name!r} is not a member of vLLM's Medium "
                         f"({', '.join(m.name for m in medium)})")
    return "KVHOST"


def mapping_of(addr, length):
    """The /proc/self/maps entry holding [addr, addr+length): (start, end,
    file offset, path); None when no one mapping holds it."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= addr and addr + length <= hi:
                path = parts[5].strip() if len(parts) > 5 else ""
                return lo, hi, int(parts[2], 16), path
    return None


def open_mapped(lo, hi, path):
    """A read-write descriptor of the file behind the mapping [lo, hi) of
    path (a mapping_of entry): the file itself when it has a path, else (a
    memfd, a deleted file) the mapping through /proc/self/map_files."""
    if path.startswith("/") and not path.endswith("(deleted)"):
        return os.open(path, os.O_RDWR | os.O_CLOEXEC)
    return os.open(f"/proc/self/map_files/{lo:x}-{hi:x}", os.O_RDWR | os.O_CLOEXEC)


def lost_connection(e, client):
    """Whether e, raised talking to the daemon over client, means the
    connection is gone, rather than a request refused or a job or reply
    late (a TimeoutError, an OSError too, leaves the connection as it is).
    None, the client of an object that has not connected yet, has none."""
    if client is None or not client.connected() or isinstance(e, ConnectionLost):
        return True
    return isinstance(e, OSError) and not isinstance(e, TimeoutError)


class DaemonAbsent(ConnectionError):
    """No kvhost daemon answers on the socket (yet): no socket file, a
    socket no process listens on (a daemon killed), one closed or reset
    under the handshake (a daemon stopping), or no answer in time. A
    daemon started later can still be used, unlike one that refuses or a
    socket this process may not use (PermissionError: a plain
    ConnectionError)."""


# What Client raises where no daemon answers on the socket.
_ABSENT = (FileNotFoundError, ConnectionRefusedError, ConnectionResetError, BrokenPipeError, TimeoutError,
           ConnectionLost)


_SHUTTING_DOWN = p.CODES.index("shutting down")


def absent_if_stopping(e, socket, hint=""):
    """Raises DaemonAbsent from e where e is the daemon's answer that it
    is shutting down: one that began stopping while this process connected
    (a restart, an upgrade) answers the Hello or the requests after it so,
    and the daemon to come next is waited for as where none answers.
    Returns otherwise."""
    if isinstance(e, KvhostError) and e.code == _SHUTTING_DOWN:
        raise DaemonAbsent(f"kvhost.vllm: the kvhost daemon at {socket} is shutting down: {e}{hint}") from e


def absent_if_late(e, socket, hint=""):
    """Raises DaemonAbsent from e where e is a set-up request's timeout
    (TimeoutError) or the connection lost under it: a daemon frozen or
    stuck in I/O right after the handshake is waited for as one that does
    not answer, not a configuration error. Returns otherwise."""
    if isinstance(e, (TimeoutError, ConnectionLost)):
        raise DaemonAbsent(f"kvhost.vllm: the kvhost daemon at {socket} did not answer in time: {e}{hint}") from e


def open_client(socket, name, timeout, hint=""):
    """A Client of the daemon at socket (name, timeout: Client's).
    DaemonAbsent where no daemon answers there (or one shutting down
    answers the Hello so), else ConnectionError for what connecting
    raised; both name the socket, and hint follows. Another refusal of
    the Hello is raised as it is."""
    try:
        return Client(socket, name=name, timeout=timeout)
    except (OSError, ConnectionLost) as e:
        cls = DaemonAbsent if isinstance(e, _ABSENT) else ConnectionError
        raise cls(f"kvhost.vllm: cannot connect to the kvhost daemon at {socket}: {e}{hint}") from e
    except KvhostError as e:
        absent_if_stopping(e, socket, hint)
        raise


def reason(e):
    """The text kept of an error that ended a connection: never the
    exception itself, whose traceback holds the frames that met it (and
    through them, say, vLLM's region)."""
    return f"{type(e).__name__}: {e}"


def wait_ended(job, timeout, until, what, on_cancel=None):
    """job's result once the daemon has ended it (its error raised, as
    Job.wait raises it): the memory it moves is used again after this, and
    a job still running could touch it. Past timeout (seconds; None: none)
    the daemon is asked once to cancel it (once it accepted it; on_cancel()
    runs if it did cancel), and the job is waited for still, said in the
    log every timeout under what ("tier", "spec: store job 7"). until() is when to
    give up (monotonic; None: never): then TimeoutError."""
    asked = False
    while True:
        step, deadline = timeout, until()
        if deadline is not None:
            left = max(0.0, deadline - time.monotonic())
            step = left if timeout is None else min(timeout, left)
        try:
            return job.wait(step)
        except TimeoutError:
            if deadline is not None and time.monotonic() >= deadline:
                raise
            if not asked and job.id is not None:  # a job not yet accepted is asked next time
                asked = True
                try:
                    if job.cancel() and on_cancel is not None:
                        on_cancel()
                except Exception as e:  # the daemon does not answer: keep waiting for the job
                    _log.debug("kvhost %s: cancel: %s", what, e)
            _log.warning("kvhost %s: daemon job %s not done after %gs; waiting for the daemon to end it%s", what,
                         job.id if job.id is not None else "(not yet accepted)", timeout,
                         " (asked to cancel it)" if asked else "")


def connect_again(cv, closing, every, connect, log, what):
    """The loop of a thread that connects to the daemon again after a lost
    connection: waits every seconds (the whole interval, though others
    notify cv), then calls connect(), until it returns or closing() (read
    under cv) is true. Returns connect's result, or None once closing. A
    failed try is logged at most once a minute, naming what ("tier",
    "spec manager") and how many tries failed; a daemon that answers and
    refuses (a configuration to correct, such as a namespace it serves
    from another model's directory) is logged at once, and again when it
    refuses for another reason."""
    tries, said, refusal = 0, time.monotonic(), None
    while True:
        with cv:
            deadline = time.monotonic() + every
            while not closing() and (left := deadline - time.monotonic()) > 0:
                cv.wait(left)
            if closing():
                return None
        tries += 1
        try:
            return connect()
        except Exception as e:  # no daemon yet, or one that refuses: try again
            # OSError (ConnectionError, TimeoutError among them) and
            # ConnectionLost: no daemon answers there (yet).
            refused = None if isinstance(e, (OSError, ConnectionLost)) else reason(e)
            if refused is not None and refused != refusal:
                said, refusal = time.monotonic(), refused
                log.warning("kvhost %s: the daemon answers but cannot be used (%s); trying again every %gs",
                            what, e, every)
            elif time.monotonic() - said >= 60:
                said, refusal = time.monotonic(), refused
                log.warning("kvhost %s: still no daemon connection after %d tries: %s", what, tries, e)


class Reconnects:
    """What the tier, the spec's manager and its workers share about a lost
    daemon connection: noticing it once, connecting again on a thread of
    its own every reconnect_s (0: never), and swapping the new connection
    in. The class sets _cv (a Condition), _closing, _stats (a Counter or
    dict with "disconnects" and "reconnects"), _opts (with "reconnect_s"),
    _broken (None while connected, else why not, as text), _reconnectors
    (a list) and _what (its name in logs), and defines _current() (the
    connection in use, compared by identity), _open() (a new one),
    _swap_locked(new), and, where a connection is more than the client
    _current() returns, _drop(conn) for one it no longer uses."""

    def _lost_locked(self, conn, why):
        """conn's connection is gone (why): marks the object broken and
        starts connecting again. Ignored for a connection already replaced,
        or while closing. Called with _cv held."""
        if self._closing or conn is not self._current() or self._broken is not None:
            return
        self._broken = why
        self._stats["disconnects"] += 1
        self._on_lost_locked()
        every = self._opts["reconnect_s"]
        if every > 0:
            self._start_reconnecting_locked(conn)
            _log.warning("kvhost %s: lost the daemon connection (%s); connecting again every %gs",
                         self._what, why, every)
        else:
            _log.warning("kvhost %s: lost the daemon connection (%s); not connecting again (reconnect_s = 0)",
                         self._what, why)
        self._cv.notify_all()

    def _start_unconnected(self, why):
        """Starts without a connection (_current() is None) where no daemon
        answers at start (why): as after a lost connection, the object
        answers MISS and fails or drops its jobs, and a thread connects
        every reconnect_s (> 0) until a daemon answers."""
        with self._cv:
            self._broken = why
            self._start_reconnecting_locked(None)
        _log.warning("kvhost %s: no kvhost daemon answers at %s (%s); starting without it: lookups answer MISS "
                     "and nothing is stored until one does; connecting every %gs", self._what,
                     self._opts["socket"], why, self._opts["reconnect_s"])

    def _start_reconnecting_locked(self, conn):
        t = threading.Thread(target=self._reconnect, args=(conn,), name=f"kvhost-{self._what}-reconnect",
                             daemon=True)
        # An earlier one may still be releasing its old connection.
        self._reconnectors = [r for r in self._reconnectors if r.is_alive()] + [t]
        t.start()

    def _on_lost_locked(self):
        """Called with _cv held when the connection is found gone; the
        class forgets here what died with it."""

    def _reconnect(self, old):
        since = time.monotonic()

        def stale():  # shutting down, or the connection in use is another one already
            return self._closing or self._current() is not old
        new = connect_again(self._cv, stale, self._opts["reconnect_s"], self._open, _log, self._what)
        if new is None:
            return
        if self._swap_in(old, new):
            if old is None:
                _log.info("kvhost %s: connected to the daemon at %s, %.1fs after start", self._what,
                          self._opts["socket"], time.monotonic() - since)
            else:
                _log.info("kvhost %s: connected to the daemon again after %.1fs", self._what,
                          time.monotonic() - since)

    def _swap_in(self, old, new):
        """Swaps new in for old if old is still the broken connection in
        use; drops whichever is left over. Reports whether new was used."""
        with self._cv:
            used = not self._closing and self._broken is not None and self._current() is old
            if used:
                self._swap_locked(new)
                self._broken = None
                if old is not None:  # else the first connection, made late
                    self._stats["reconnects"] += 1
                self._cv.notify_all()
        left = old if used else new
        if left is not None:
            self._drop(left)
        return used

    @staticmethod
    def _drop(conn):
        """Closes a connection no longer used: a client, or what _open()
        returned, the client first. Once the daemon has ended its jobs:
        a connection this side stopped sending on may still have jobs
        running, whose memory must not be used again before they end."""
        (conn[0] if isinstance(conn, tuple) else conn).close_after_jobs()

    def _join_reconnectors(self, until=None):
        """Waits for the reconnect threads (after _closing was set), until
        until (monotonic; None: as long as they take) and a fifth of a second more:
        a try under way ends once its handshake's or a set-up request's
        timeout (daemon_wait_s) passes, and a connection it makes after
        _closing is dropped (_swap_in)."""
        with self._cv:
            threads = list(self._reconnectors)
        for t in threads:
            t.join(None if until is None else max(0.0, until - time.monotonic()) + 0.2)
