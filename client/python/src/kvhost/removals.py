"""Removal streams (Client.subscribe_removals): one key gone or moved
(Removal), what a subscription delivers (RemovalBatch), and the
subscription itself (RemovalSubscription).
"""

import dataclasses
import threading
import time

from . import protocol as p
from .errors import ConnectionLost


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
        # "nvme", "ssd", "hdd", "network", "unknown"; "object" for its
        # object mount, last), by the index a Removal's mount and to name:
        # the medium a key left or moved to.
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
