"""The spec manager's pins: a background thread pins the keys lookups
ask about (PinLoadable where the daemon has it, a round at a time),
touches the keys vLLM used, and unpins what no key holds any more; a
pinned key answers HIT for hit_window_s, or while it is being loaded.
"""

import collections
import itertools
import logging
import time

from .. import protocol as p
from ..client import KvhostError
from . import spec_compat as sc
from ._common import reason
from ._connect import lost_connection

log = logging.getLogger("vllm.kvhost")


class _PinBatch:
    """The daemon pins of one round of lookups and the keys still using
    them; unpinned when no key uses them any more."""
    __slots__ = ("pins", "refs")

    def __init__(self, pins, refs):
        self.pins = pins
        self.refs = refs


class _PinRound:
    """What one round of pins asked and found: the connection it pinned
    on, its keys, the daemon pins it took, whether each key is held,
    whether the daemon answered, the keys some rank's namespace had no
    worker's cache for, and when it started."""
    __slots__ = ("client", "keys", "pins", "held", "answered", "no_worker", "t0")

    def __init__(self, client, keys, t0):
        self.client = client
        self.keys = keys
        self.pins = []
        self.held = dict.fromkeys(keys, True)
        self.answered = True
        self.no_worker = set()
        self.t0 = t0

    def fail(self):
        """Marks every key not held and the daemon as not having answered."""
        self.held = dict.fromkeys(self.keys, False)
        self.answered = False


class SpecPins:
    """The pins half of the spec manager (SpecManager): its thread and
    what it holds."""

    def _loop(self):
        lease = self._opts["pin_lease_s"]
        while True:
            with self._cv:
                while not (self._queue or self._touches or self._releases or self._probes or self._verify
                           or self._closing):
                    if not self._cv.wait(max(0.05, self._opts["hit_window_s"] / 4)):
                        break  # periodic: release pins whose HIT window passed unused
                if self._closing:
                    return
                keys, self._queue = self._queue, []
                touches, self._touches = self._touches, []
                stale, self._releases = self._releases, []
                stale += self._expire_locked(time.monotonic())
                probes, self._probes = self._probes, {}
                verify, self._verify = self._verify, []
            self._unpin(stale)
            if verify:
                self._verify_stored(verify)
            for where, key in probes.items():
                self._probe(where, key)
            if keys:
                self._pin_round(keys, lease)
            for t in touches:
                self._touch(t)

    def _by_group(self, keys):
        out = collections.defaultdict(list)
        for k in keys:
            g = sc.key_group(k)
            out[g if g < len(self._groups) else 0].append(k)
        return out

    def _pin_round(self, keys, lease):
        """Pins keys in every rank's namespace of their group, then settles
        what the round found (_settle_round_locked)."""
        t0 = time.monotonic()  # before the lock: the HIT window starts no later than its pins
        with self._lock:
            rnd, nss = _PinRound(self._client, keys, t0), self._ns
            # Keys being loaded were answered HIT already: their pins
            # keep the files for that load, worker or none.
            loading = {k for k in keys if self._loading[k]}
        client = rnd.client
        try:
            for where, repin, chunk in self._pin_requests(keys, loading):
                dkeys = [sc.daemon_key(k) for k in chunk]
                if repin:
                    pin_id, ok = client.pin(nss[where], dkeys, lease)
                else:
                    pin_id, ok, none = self._pin_loadable(client, nss[where], where, dkeys, lease)
                    if none:
                        rnd.no_worker.update(chunk)
                if pin_id:
                    rnd.pins.append(pin_id)
                for k, h in zip(chunk, ok):
                    rnd.held[k] = rnd.held[k] and h
        except Exception as e:  # the daemon is gone or refused: MISS, vLLM recomputes
            rnd.fail()
            lost = lost_connection(e, client)
            if lost:
                rnd.pins = []  # they ended with the connection
            else:
                log.warning("kvhost spec: pin failed: %s", e)
            with self._cv:
                self._stats["pin_errors"] += 1
                if lost:
                    self._lost_locked(client, reason(e))
        with self._cv:
            release = self._settle_round_locked(rnd)
            self._cv.notify_all()
        self._unpin(release)

    def _pin_requests(self, keys, loading):
        """Yields one round's pin requests: ((rank, group), whether the keys
        are being loaded, at most MAX_KEYS_PER_REQUEST keys). Keys being
        loaded get plain pins (their HIT was answered), the others pins
        that hold only where a worker can load them."""
        groups = self._by_group(keys).items()
        for (g, gkeys), r, repin in itertools.product(groups, range(self._tp), (False, True)):
            part = [k for k in gkeys if (k in loading) == repin]
            for i in range(0, len(part), p.MAX_KEYS_PER_REQUEST):
                yield (r, g), repin, part[i:i + p.MAX_KEYS_PER_REQUEST]

    def _settle_round_locked(self, rnd):
        """Records a pin round's answer: held keys get the round's batch of
        pins for hit_window_s from t0, the others a MISS for miss_ttl_s (and
        a removal event where this manager stored them and the daemon
        answered). A round that pinned on a connection replaced since holds
        nothing (its pins ended with that connection) and counts as
        unanswered; its keys being loaded are queued again. It reads the
        round and leaves it as it is. Returns the pin ids to release."""
        now = time.monotonic()
        until = rnd.t0 + self._opts["hit_window_s"]
        release, again = [], set()
        replaced = rnd.client is not self._client
        pins, answered = ([], False) if replaced else (rnd.pins, rnd.answered)
        held = set() if replaced else {k for k, h in rnd.held.items() if h}
        if replaced:
            # Keys being loaded are pinned again on the connection in
            # use: its swap skipped them, as this round had them.
            again = {k for k in rnd.keys if self._loading[k]}
            self._queue += again
            self._stats["repinned_keys"] += len(again)
        batch = _PinBatch(pins, held)
        s = self._stats
        s["daemon_pins"] += len(pins)
        if answered and rnd.no_worker:
            s["no_worker_keys"] += len(rnd.no_worker)  # once per key, whatever the ranks
        for k in rnd.held:  # each key once, as the round holds them
            if k in again:
                continue  # still pending, queued again
            self._pending.discard(k)
            if k in held:
                old = self._pinned.get(k)
                if old is not None:
                    release += self._drop_ref_locked(old[0], k)
                self._pinned[k] = (batch, until)
                self._missing.pop(k, None)
                s["pinned_keys"] += 1
                continue
            self._missing[k] = now + self._opts["miss_ttl_s"]
            s["missing_keys"] += 1
            # A key no worker could load was not looked up: it may well
            # be stored still, and no event says otherwise. One this
            # manager stored and the daemon no longer has was evicted:
            # tell vLLM.
            if answered and k not in rnd.no_worker and self._stored_at.pop(k, None) is not None:
                self._removals.gone([k])
        if not batch.refs:
            release += batch.pins
        if len(self._missing) > 1 << 18:
            self._missing = {k: t for k, t in self._missing.items() if t > now}
        return release

    def _pin_loadable(self, client, ns, where, keys, lease):
        """Pins keys in ns, the namespace of (rank, group) where, only while
        a worker's cache of it is registered with the daemon: a HIT whose
        load no worker can run would fail it, and vLLM's worker asserts on
        a failed load. A worker the daemon refused (its tensors over
        max_registered_bytes, say) registers none, and vLLM recomputes
        instead. A daemon older than PinLoadable gets plain pins. Returns
        (pin id, [bool per key: pinned], whether no worker's cache was
        registered)."""
        if self._loadable:
            try:
                pin_id, ok, no_cache = client.pin_loadable(ns, keys, lease, self._group)
            except KvhostError as e:
                if e.code != p.CODE_UNKNOWN_TYPE:
                    raise
                with self._lock:
                    # It can say nothing of workers: stores go through
                    # as they did before PinLoadable, not refused on a
                    # daemon's answer that no round will ask again.
                    self._loadable = False
                    self._no_worker.clear()
                log.warning("kvhost spec: this daemon does not know PinLoadable: lookups answer HIT "
                            "without knowing that a worker can load them; upgrade the daemon")
            else:
                now = time.monotonic()
                with self._lock:
                    if no_cache:
                        # The worker comes back at vLLM's next step after
                        # a daemon restart, and connects beside the manager
                        # to a daemon started after vLLM (the manager often
                        # first): warned of only once it stays away
                        # load_retry_s (its stores refused, then skipped).
                        # One line per rank: a hybrid model's groups
                        # share its worker, so its other groups' warnings
                        # would say the same again.
                        self._confirmed.discard(where)
                        since = self._no_worker.setdefault(where, now)
                        first = where not in self._warned and now - since >= self._opts["load_retry_s"]
                        if first:
                            first = not self._rank_warned_locked(where[0])
                            self._warned.add(where)
                    else:
                        self._confirmed.add(where)
                        first = where in self._warned
                        self._warned.discard(where)
                        self._no_worker.pop(where, None)
                        if first:  # logged when the rank's last group is back
                            first = not self._rank_warned_locked(where[0])
                if first and no_cache:
                    log.warning("kvhost spec: no worker of rank %d of this engine has its KV cache registered "
                                "with the daemon (namespace %s%s): lookups answer MISS, vLLM recomputes; %s",
                                where[0], self.namespaces[where],
                                f", engine {self._group}" if self._group else "",
                                self._why_no_worker(client, ns, keys[:1]))
                elif first:
                    log.info("kvhost spec: the rank %d worker's KV cache is registered with the daemon again",
                             where[0])
                return pin_id, ok, no_cache
        return (*client.pin(ns, keys, lease), False)

    def _rank_warned_locked(self, rank):
        """Whether a group of rank is warned of as having no worker."""
        return any(r == rank for r, _ in self._warned)

    def _why_no_worker(self, client, ns, probe):
        """What to tell an operator whose workers the daemon does not count:
        whether another engine's workers are registered in the namespace
        (then this engine's joined no group or another one: its workers
        and scheduler disagree on vLLM's engine_id)."""
        hint = "a worker the daemon refused says why in its log"
        if not self._group:
            return hint
        try:
            pin_id, _, no_cache = client.pin_loadable(ns, probe, 0, "")
            if pin_id:
                client.unpin(pin_id)
        except Exception:
            return hint
        if no_cache:
            return hint
        return ("other engines' workers of this namespace are registered, not this engine's: its workers "
                "and scheduler disagree on vLLM's engine_id, or " + hint)

    def _touch(self, keys):
        try:
            for g, gkeys in self._by_group(keys).items():
                for i in range(0, len(gkeys), p.MAX_KEYS_PER_REQUEST):
                    self._client.touch(self._ns[(0, g)], [sc.daemon_key(k) for k in gkeys[i:i + p.MAX_KEYS_PER_REQUEST]])
        except Exception as e:
            log.debug("kvhost spec: touch: %s", e)

    def _drop_ref_locked(self, batch, key):
        """Drops key's use of batch; returns the pins to release."""
        batch.refs.discard(key)
        if batch.refs:
            return []
        pins, batch.pins = batch.pins, []
        return pins

    def _release_locked(self, key):
        e = self._pinned.pop(key, None)
        return self._drop_ref_locked(e[0], key) if e is not None else []

    def _expire_locked(self, now):
        """Releases pinned keys whose HIT window passed with no load."""
        release = []
        for k in [k for k, (_, until) in self._pinned.items() if until <= now and not self._loading[k]]:
            release += self._release_locked(k)
            self._stats["pins_expired_unused"] += 1
        return release

    def _unpin(self, pins):
        for pin_id in pins:
            try:
                self._client.unpin(pin_id)
            except Exception as e:  # the connection's end releases them anyway
                log.debug("kvhost spec: unpin: %s", e)
            with self._lock:
                self._stats["daemon_unpins"] += 1
