"""Connecting to the daemon, shared by the tier, the spec's manager and
workers, and the connector's scheduler and workers: the connect prologue
(connect: open a client, declare and register on it, and on any failure
close it and tell a daemon that is absent or stopping from one that
refuses), starting without a daemon (Reconnects._connect_at_start), and
connecting again after a lost connection (Reconnects).

Importing this module imports nothing of vLLM.
"""

import logging
import threading
import time

from .. import protocol as p
from ..client import Client, ConnectionLost, KvhostError
from ._common import reason, setup_timeout

# A child of vLLM's "vllm" logger, the one vLLM configures.
_log = logging.getLogger("vllm.kvhost")


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


def connect(opts, name, set_up, hint="", request_timeout=True):
    """set_up(client)'s result for a new Client of the daemon at
    opts["socket"] named name: the connect prologue every part runs. The
    handshake and set_up's requests (declarations, registrations) wait
    daemon_wait_s at most (a start runs in vLLM's call); later requests
    wait request_timeout_s, or daemon_wait_s still where request_timeout
    is false (a part whose every request is made in a vLLM call). On any
    failure the client is closed (it ran no job: what it holds on the
    daemon goes with the connection) and DaemonAbsent is raised where no
    daemon answers, one is shutting down or one did not answer set_up in
    time (open_client, absent_if_stopping, absent_if_late; hint follows
    the socket in its text); other errors are raised as they are."""
    sock = opts["socket"]
    client = open_client(sock, name, setup_timeout(opts), hint)
    try:
        got = set_up(client)
        if request_timeout:
            client.set_timeout(opts["request_timeout_s"])
    except BaseException as e:
        client.close()
        absent_if_stopping(e, sock)
        absent_if_late(e, sock)
        raise
    return got


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


def client_of(conn):
    """The client of a connection: conn itself, or the first item of what
    an _open() returned."""
    return conn[0] if isinstance(conn, tuple) else conn


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

    def _connect_at_start(self, connect=None):
        """(connection, None) from connect() (default: _open), or (None,
        why) where no daemon answers at start and reconnect_s > 0: the
        object then starts without one, which _start_unconnected(why)
        begins once the object is ready (a thread connects once a daemon
        answers: a node starting, its DaemonSet rolled out after vLLM).
        With reconnect_s = 0 nothing would, and DaemonAbsent is raised."""
        try:
            return (connect or self._open)(), None
        except DaemonAbsent as e:
            if self._opts["reconnect_s"] <= 0:
                raise
            return None, reason(e.__cause__)

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
        client_of(conn).close_after_jobs()

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
