"""The removal stream of a removals half (_removals): Watcher, a thread
with a daemon connection of its own that declares the half's namespaces,
subscribes to their removals (Client.subscribe_removals), and subscribes
again from its cursor after a lost connection; and _pinned, which asks a
daemon that cannot serve the cursor without a gap which keys it still
holds (pins of lease 0, released at once).

Importing this module imports nothing of vLLM.
"""

import logging
import threading
import time

from .. import protocol as p
from ..client import Client, ConnectionLost
from ._common import reason

# A child of vLLM's "vllm" logger, the one vLLM configures.
_log = logging.getLogger("vllm.kvhost")


class Watcher:
    """A daemon connection of its own that follows the removals of
    geometries' namespaces (declared on it) for a half: on_records(conn,
    records) is called with each batch's removals, on_gap(conn) where
    removals may have been lost (a resync; the first subscription, for
    keys reported before it), both on the watcher's thread, conn being
    (client, [Namespace per geometry]). A lost connection is made again
    every reconnect_s (0: never) and subscribes from the cursor of the
    last batch read. A daemon without removal streams is said once in the
    log and asked again every minute. close() ends it (Watcher.close)."""

    def __init__(self, socket, geometries, on_records, on_gap, *, name, reconnect_s=1.0, timeout=5.0,
                 idle=None, idle_s=0.25, what="removals"):
        self._socket, self._geoms = socket, list(geometries)
        self._on_records, self._on_gap, self._idle = on_records, on_gap, idle
        self._name, self._every, self._timeout, self._idle_s = name, reconnect_s, timeout, idle_s
        self._what = what
        self._cv = threading.Condition()
        self._closing = False
        self._client = None
        self.cursor = None          # (epoch, last) of the last batch handled
        self.connects = 0           # subscriptions made (the first and each after a loss)
        self.resyncs = 0            # resyncs answered (and gaps checked)
        self.subscribed = threading.Event()  # set once a subscription is up (tests wait for it)
        self._said_unsupported = False
        self._thread = threading.Thread(target=self._run, name=f"kvhost-{what}", daemon=True)
        self._thread.start()

    def close(self, wait=None):
        """Ends the watcher and its connection, waiting wait seconds at
        most for its thread (None: its daemon answers' timeout and a
        second; a thread still connecting to a daemon that does not answer
        ends once that try does). Idempotent."""
        with self._cv:
            self._closing = True
            client = self._client
            self._cv.notify_all()
        if client is not None:
            client.close()
        self._thread.join(self._timeout + 1.0 if wait is None else wait)

    def _wait(self, seconds):
        """Waits seconds unless closing; reports whether closing."""
        with self._cv:
            deadline = time.monotonic() + seconds
            while not self._closing and (left := deadline - time.monotonic()) > 0:
                self._cv.wait(left)
            return self._closing

    def _run(self):
        said = 0.0
        while True:
            with self._cv:
                if self._closing:
                    return
            try:
                self._follow()
            except Exception as e:  # no daemon, a lost connection, a refusal: try again
                with self._cv:
                    closing = self._closing
                if closing:
                    pass
                elif isinstance(e, (OSError, ConnectionLost)):
                    # No daemon (yet), or it went: the half logs its own
                    # outage, once.
                    _log.debug("kvhost %s: no removal stream from the daemon at %s (%s); trying again every %gs",
                               self._what, self._socket, reason(e), self._every)
                elif time.monotonic() - said >= 60:
                    said = time.monotonic()
                    _log.warning("kvhost %s: the daemon at %s refuses a removal stream (%s); trying again every "
                                 "%gs", self._what, self._socket, reason(e), self._every)
            finally:
                with self._cv:
                    client, self._client = self._client, None
                if client is not None:
                    client.close()
                self.subscribed.clear()
            if self._every <= 0 or self._wait(self._every):
                return

    def _follow(self):
        """One connection: declares, subscribes from the cursor, hands each
        batch over until the connection ends or the watcher closes."""
        client = Client(self._socket, name=self._name, timeout=self._timeout)
        with self._cv:
            if self._closing:
                client.close()
                return
            self._client = client
        if not client.supports_removals:
            with self._cv:
                self._client = None
            client.close()  # holding no connection of a daemon that cannot use it
            say, self._said_unsupported = (_log.debug if self._said_unsupported else _log.warning), True
            say("kvhost %s: the daemon at %s streams no removals (%s): vLLM hears of a removal only when a "
                "lookup or a load finds a key gone; asking again every minute", self._what, self._socket,
                client.limits.get("server", "an older daemon"))
            self._wait(60)
            return
        nss = [client.declare(g) for g in self._geoms]
        conn = (client, nss)
        first = self.cursor is None
        sub = client.subscribe_removals(nss, since=self.cursor)
        self.connects += 1
        self.subscribed.set()
        if first:
            # Nothing was recorded for this half before its first
            # subscription: keys it reported before are checked.
            self._on_gap(conn)
            self.cursor = sub.subscribed
        while True:
            try:
                b = sub.get(timeout=self._idle_s)
            except TimeoutError:
                b = None
            with self._cv:
                if self._closing:
                    return
            if b is not None and b.resync:
                self.resyncs += 1
                _log.debug("kvhost %s: the daemon's removals since %s cannot be served without a gap (a restart, "
                           "or this watcher fell behind): checking the keys reported stored", self._what,
                           self.cursor)
                self._on_gap(conn)
            elif b is not None and b.removals:
                self._on_records(conn, b.removals)
            if b is not None:
                self.cursor = b.cursor
            if self._idle is not None:
                self._idle(conn)


def _pinned(client, ns, dkeys):
    """Which of dkeys the daemon holds in ns, a list of bools: read from
    the shared lookup table where this process can read it (no round trip,
    and no access that the daemon's policy would count: the check must
    not keep keys from eviction), else asked of the daemon by pins of lease
    0, MAX_KEYS_PER_REQUEST keys each, released at once."""
    digests = client.key_digests(ns, dkeys)
    if digests is not None:
        return [client.lookup_digests(ns, [k], digests[16 * i:16 * i + 16]) == 1 for i, k in enumerate(dkeys)]
    held = []
    for i in range(0, len(dkeys), p.MAX_KEYS_PER_REQUEST):
        chunk = dkeys[i:i + p.MAX_KEYS_PER_REQUEST]
        pin_id, ok = client.pin(ns, chunk, 0)
        if pin_id:
            client.unpin(pin_id)
        held += [bool(h) for h in ok]
    return held
