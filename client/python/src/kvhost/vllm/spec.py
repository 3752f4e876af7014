"""KvhostOffloadingSpec: vLLM's full offloading spec through kvhost.

vLLM moves KV blocks between its GPUs and kvhost directly: the scheduler's
manager (``get_manager``) asks the daemon which keys it has and pins them;
every GPU worker (``get_worker``) registers its KV-cache tensors with the
daemon (CUDA IPC; host memory by a shared file) and turns vLLM's transfer
jobs into daemon store and load jobs, which the daemon runs on its GPU path
(cuFile where the mount allows it). The daemon places, evicts (its wasm
policy) and verifies; the manager only tracks what it has pinned.

vLLM crashes a worker whose transfer fails, so ``lookup`` answers HIT only
for a key the daemon has pinned for this manager after checking its file:
a pinned key is neither evicted nor deleted until ``complete_load`` (or the
pin's lease ends, or the scheduler's connection closes). docs/vllm.md
describes what still can fail and how it is counted.
"""

import collections
import importlib
import itertools
import logging
import math
import threading
import time

from .. import protocol as p
from ..client import KvhostError
from . import _metrics
from . import spec_compat as sc
from ._common import reason, setup_timeout
from ._connect import Reconnects, absent_if_stopping, connect, lost_connection
from ._namespace import check_served
from ._removals import OffloadingRemovals, parse_media

# vLLM configures only its "vllm" logger (and stops propagation there):
# only its children show in vLLM's output.
log = logging.getLogger("vllm.kvhost")

# Label of the metrics the manager reports through vLLM (get_stats).
METRIC_LABELS = ("role",)
MANAGER_LABELS = ("scheduler",)


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


class SpecManager(Reconnects):
    """The scheduler side of KvhostOffloadingSpec (vLLM's OffloadingManager).

    Every method vLLM calls returns at once: lookups are answered from a
    table a background thread fills with daemon pins (RETRY until it has
    answered), loads and stores only change that table; bytes move in the
    workers."""

    _what = "spec manager"

    def __init__(self, config, api=None, opts=None, ident=None):
        self._api = api or sc.SPEC_FALLBACK
        self._opts = o = opts or sc.options(config)
        self._ident = ident or sc.identity(config, o)
        self._medium = sc.pick_medium(self._api)
        self._lr = self._api.LookupResult
        self._tp = sc.shards(config)             # every shard must hold a key for a HIT
        self._groups = sc.groups(self._ident)
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._pinned = {}                       # key -> (batch, hit until)
        self._loading = collections.Counter()   # key -> prepare_load not completed
        self._storing = collections.Counter()   # key -> prepare_store not completed
        self._stored_at = {}                    # key -> when the daemon was found holding a completed store
        # complete_store's keys wait for the daemon to say it holds them
        # (_verify_stored) before a stored event: a worker not connected
        # yet (vLLM started before the daemon) or cut off by a restart
        # reports its store a success with nothing stored, as vLLM's
        # worker asserts every transfer succeeds. _verify: keys to ask
        # about; _verifying: key -> completed stores not answered yet.
        self._verify, self._verifying = [], collections.Counter()
        self._missing = {}                      # key -> MISS answered until
        self._queue, self._pending, self._touches, self._releases = [], set(), [], []
        # vLLM drains take_events only with its KV cache events on, and
        # asks that capture stay inert otherwise (as its CPU spec's does).
        self._events_on = bool(getattr(config, "enable_kv_cache_events", True))
        self._stats = collections.Counter()
        self._reported = collections.Counter()  # what get_stats reported so far
        self._broken = None          # why the connection is gone (text), until a reconnection
        self._closing = False
        self._reconnectors = []      # threads connecting again (shutdown joins them)
        # Pins ask the daemon for a worker's cache in their namespace
        # (PinLoadable) unless it is older than that frame. _no_worker:
        # (rank, group) -> when the daemon first answered it had none,
        # _warned: those the outage was logged for (one line per rank and
        # outage, however many of its groups are away).
        self._loadable = True
        self._no_worker, self._warned = {}, set()
        # (rank, group) -> a key to ask the daemon with, for a store
        # refused there (_probe_later_locked, _probe); _probed: when each was last asked.
        self._probes, self._probed = {}, {}
        # After a reconnection (or a start before the daemon) the manager
        # and the workers connect each on its own thread: stores wait
        # until the daemon has answered, on this connection, that a
        # worker's cache of each of their namespaces is registered
        # (_confirmed: those (rank, group)). A manager connected at its
        # start needs none: vLLM registers its workers' KV caches before
        # it builds the scheduler.
        self._confirm, self._confirmed = False, set()
        self._group = sc.engine_group(config)  # this engine's workers' (the daemon's Group)
        self.namespaces = {(r, g): sc.geometry(sc.describe(self._ident, g, r)).model
                           for r in range(self._tp) for g in range(len(self._groups))}
        # No daemon yet: the manager starts as one that lost it (MISS, no
        # stores) and a thread connects once one answers.
        conn, absent = self._connect_at_start()
        self._client, self._ns = conn or (None, None)
        # Stored events, and the removals of what they announced, from a
        # daemon connection of their own (docs/routers.md).
        where = sorted(self.namespaces)
        self._removals = OffloadingRemovals(
            self._api, self._medium, o["socket"], [sc.geometry(sc.describe(self._ident, g, r)) for r, g in where],
            groups=[g for _, g in where], media=parse_media(o["mount_media"], lambda n: sc.pick_medium(self._api, n)),
            events=self._events_on, name=o["client_name"] + "-removals", max_tracked=o["max_tracked_keys"],
            max_queued=o["max_events"], reconnect_s=o["reconnect_s"], timeout=setup_timeout(o),
            what="spec removals")
        log.info("kvhost spec: manager on %s, namespaces %s", o["socket"], sorted(set(self.namespaces.values())))
        if not o["metrics"]:
            log.info("kvhost spec: metrics off (option \"metrics\": false): the manager reports no %s* "
                     "counters to vLLM; its counters() still count them", _metrics.PREFIX)
        self._thread = threading.Thread(target=self._loop, name="kvhost-spec-pins", daemon=True)
        self._thread.start()
        if absent is not None:
            self._start_unconnected(absent)

    def _open(self):
        """A connection that pins, with every namespace (rank × group)
        declared: (client, {(rank, group): Namespace})."""
        o = self._opts

        def set_up(client):
            try:
                client.unpin(0)  # a daemon without pins answers "unknown type"
            except KvhostError as e:
                absent_if_stopping(e, o["socket"])
                raise RuntimeError(f"kvhost.vllm: the kvhost daemon at {o['socket']} does not support pins "
                                   f"({e}): the offloading spec needs a daemon with Pin/Unpin "
                                   "(docs/protocol.md); upgrade it") from e
            ns = {}
            for r in range(self._tp):
                for g in range(len(self._groups)):
                    geo = sc.geometry(sc.describe(self._ident, g, r))
                    ns[(r, g)] = client.declare(geo)
                    # The spec's keys live on kvhost mounts only: a vllm-fs
                    # mount set to serve its namespace holds other bytes.
                    check_served(ns[(r, g)].fingerprint, geo)
            return client, ns
        return connect(o, o["client_name"], set_up, " (set the spec option \"socket\" or KVHOST_SOCKET)")

    # -- losing the daemon and finding it again (Reconnects) ----------------------

    def _current(self):
        return self._client

    def _on_lost_locked(self):
        """The pins died with the connection: keys not being loaded are
        forgotten (asked again once connected), those being loaded keep
        their entry without a pin, which answers no HIT and has nothing to
        release (an old pin id is never sent to a new connection, where it
        may name a pin of its own)."""
        for batch, _ in self._pinned.values():
            batch.pins = []
        self._pinned = {k: e for k, e in self._pinned.items() if self._loading[k]}
        self._releases = []

    def _swap_locked(self, new):
        """The new connection is in use: keys still being loaded lost their
        pins with the old one and are queued to be pinned again (by the
        background thread, which notify_all wakes), so that no eviction on
        the new daemon comes between it and the workers' loads run again on
        it. A key a pin round has pending is queued again when that round
        ends (_pin_round: it pinned on a replaced connection)."""
        self._client, self._ns = new
        self._loadable = True  # the new daemon may know PinLoadable
        self._confirm = True
        self._confirmed.clear()
        self._probed.clear()
        self._missing.clear()
        again = [k for k in self._pinned if self._loading[k] and k not in self._pending]
        for k in again:
            self._pending.add(k)
            self._queue.append(k)
        self._stats["repinned_keys"] += len(again)

    # -- lookups -------------------------------------------------------------

    def _hit_pending(self):
        return getattr(self._lr, "HIT_PENDING", self._lr.RETRY)

    def lookup(self, key, req_context=None):
        """HIT for a key pinned (and checked) by the daemon for this manager,
        within hit_window_s of the pin or with a load in progress;
        HIT_PENDING (RETRY where vLLM has none) while this manager stores
        it; RETRY while the daemon has not answered; MISS otherwise."""
        key = bytes(key)
        R = self._lr
        deadline = None
        with self._cv:
            self._stats["lookups"] += 1
            while True:
                now = time.monotonic()
                if self._broken is None and not self._client.connected():
                    self._lost_locked(self._client, "the daemon closed the connection")
                if self._broken is not None or self._closing:  # no pin can be trusted
                    self._stats["lookup_misses"] += 1
                    return R.MISS
                e = self._pinned.get(key)
                if e is not None and e[0].pins and (e[1] > now or self._loading[key]):
                    self._stats["lookup_hits"] += 1
                    return R.HIT
                if self._storing[key]:
                    self._stats["lookup_hit_pending"] += 1
                    return self._hit_pending()
                m = self._missing.get(key)
                if m is not None and m > now:
                    self._stats["lookup_misses"] += 1
                    return R.MISS
                if key not in self._pending:
                    self._pending.add(key)
                    self._queue.append(key)
                    self._cv.notify_all()
                if deadline is None:
                    deadline = now + self._opts["lookup_wait_s"]
                if now >= deadline:
                    self._stats["lookup_retries"] += 1
                    return R.RETRY
                self._cv.wait(deadline - now)

    def touch(self, keys, req_context=None):
        """Tells the daemon's policy the keys were used (a daemon lookup, off
        this thread)."""
        keys = [bytes(k) for k in keys]
        if keys:
            with self._cv:
                self._touches.append(keys)
                self._cv.notify_all()

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

    # -- loads and stores ----------------------------------------------------

    def prepare_load(self, keys, req_context=None):
        """The spec of keys to load (all answered HIT); they stay pinned until
        complete_load."""
        keys = [bytes(k) for k in keys]
        with self._lock:
            for k in keys:
                self._loading[k] += 1
                if k not in self._pinned:
                    # vLLM loads only HITs: this is a caller's bug or a
                    # race with reset_cache; the load may miss and fail.
                    self._stats["load_unpinned_keys"] += 1
                    log.warning("kvhost spec: prepare_load of a key that is not pinned")
            self._stats["load_keys"] += len(keys)
        return sc.KvhostLoadStoreSpec([sc.daemon_key(k) for k in keys], [sc.key_group(k) for k in keys])

    def complete_load(self, keys, req_context=None):
        """The workers have loaded keys: their pins are released (by the
        background thread: no daemon round trip here)."""
        keys = [bytes(k) for k in keys]
        with self._cv:
            self._stats["loaded_keys"] += len(keys)
            for k in keys:
                self._loading[k] -= 1
                if self._loading[k] <= 0:
                    del self._loading[k]
                    self._releases += self._release_locked(k)
            if self._releases:
                self._cv.notify_all()

    def prepare_store(self, keys, req_context=None):
        """PrepareStoreOutput with the keys to store (input order kept; keys
        pinned, being stored or stored within stored_ttl_s are left out), or
        None when the daemon cannot take stores now (connection lost, shut
        down, no worker's cache registered in a namespace of the keys at the
        last pin round there — or, after a reconnection, none found there on
        this connection yet: the workers reconnect on their own — or
        max_store_keys_inflight keys already being stored). Once a rank's worker has stayed away two reconnection
        periods (_store_grace), its stores are skipped (no keys to store)
        instead of refused: vLLM logs each refusal, every step, for every
        request."""
        keys = [bytes(k) for k in keys]
        now = time.monotonic()
        with self._lock:
            if self._broken is None and not self._client.connected():
                self._lost_locked(self._client, "the daemon closed the connection")
            away = self._away_locked(keys)
            self._probe_later_locked(away, now)
            if self._broken is not None or self._closing or away:
                # Without a worker the store would move nothing, and vLLM
                # would be told (stored events) that it had.
                if self._stayed_away_locked(away, now):
                    self._stats["store_keys_skipped_no_worker"] += len(keys)
                    return self._api.PrepareStoreOutput(keys_to_store=[], store_spec=sc.KvhostLoadStoreSpec([], []),
                                                        evicted_keys=[])
                self._stats["store_refused"] += 1
                return None
            if sum(self._storing.values()) + len(keys) > self._opts["max_store_keys_inflight"]:
                self._stats["store_refused"] += 1
                return None
            ttl = self._opts["stored_ttl_s"]
            out, seen = [], set()
            for k in keys:
                if k in seen or self._storing[k] or self._verifying[k] or k in self._pinned:
                    continue
                t = self._stored_at.get(k)
                if t is not None and now - t < ttl:
                    continue
                seen.add(k)
                out.append(k)
            self._storing.update(out)
            self._stats["store_keys_prepared"] += len(out)
            self._stats["store_keys_skipped"] += len(keys) - len(out)
        spec = sc.KvhostLoadStoreSpec([sc.daemon_key(k) for k in out], [sc.key_group(k) for k in out])
        return self._api.PrepareStoreOutput(keys_to_store=out, store_spec=spec, evicted_keys=[])

    def _away_locked(self, keys):
        """The (rank, group) namespaces of keys whose last pin round found
        no worker's cache registered, or, after a reconnection, not yet
        found one on this connection, each with one of its keys: a dict
        where -> key."""
        unconfirmed = self._confirm and self._loadable
        if not (self._no_worker or unconfirmed):
            return {}
        groups = {}
        for k in keys:
            g = sc.key_group(k)
            groups.setdefault(g if g < len(self._groups) else 0, k)
        return {(r, g): k for g, k in groups.items() for r in range(self._tp)
                if (r, g) in self._no_worker or (unconfirmed and (r, g) not in self._confirmed)}

    def _probe_later_locked(self, away, now):
        """Has the manager's thread ask the daemon (_probe) whether a worker
        of each namespace in away is back: at once for one not asked on
        this connection yet, then miss_ttl_s apart. vLLM
        looks a hybrid model's later groups up only after group 0 hit, and
        hands prepare_store every group's keys at once, so no lookup may
        ever come to find the worker back."""
        for where, k in away.items():
            # Not yet asked on this connection: at once (one probe at a time).
            wait = self._opts["miss_ttl_s"] if where in self._no_worker else 0
            if where not in self._probes and now - self._probed.get(where, -math.inf) >= wait:
                self._probed[where] = now
                self._probes[where] = k
                self._cv.notify_all()

    def _stayed_away_locked(self, away, now):
        """Whether a store of keys in the namespaces away is skipped rather
        than refused: refused (vLLM asks again next step, logging each
        time) while a worker may be reconnecting, skipped once one stayed
        away longer than _store_grace."""
        grace = self._store_grace()
        return any(now - self._no_worker.get(where, now) >= grace for where in away)

    def _store_grace(self):
        """How long stores of a namespace found without a worker are
        refused, not skipped: two reconnection periods, time for a worker
        that noticed a restart to connect again (vLLM logs each refusal,
        every step, for every running request)."""
        return max(2 * self._opts["reconnect_s"], self._opts["miss_ttl_s"])

    def _probe(self, where, key):
        """Asks the daemon whether a worker's cache of (rank, group) where
        is registered now (a pin of key, released at once): _pin_loadable
        lets stores through again if one is."""
        with self._lock:
            client, nss = self._client, self._ns
            if self._broken is not None or client is None:
                return
        try:
            pin_id, _, _ = self._pin_loadable(client, nss[where], where, [sc.daemon_key(key)], 0)
            if pin_id:
                client.unpin(pin_id)
        except Exception as e:  # a lost connection is found by the next call
            log.debug("kvhost spec: asking for the workers of %s: %s", self.namespaces[where], e)

    def complete_store(self, keys, req_context=None, success=True):
        """The workers have stored keys (success) or not. A stored event
        follows once the daemon has said it holds them (the pin thread
        asks, _verify_stored): vLLM's workers report every store a success
        (vLLM asserts it), also one that moved nothing."""
        keys = [bytes(k) for k in keys]
        with self._cv:
            for k in keys:
                self._storing[k] -= 1
                if self._storing[k] <= 0:
                    del self._storing[k]
            if success:
                # Told stored: the daemon is asked (off this thread) before
                # any stored event; see _verify_stored.
                self._stats["stored_keys"] += len(keys)
                for k in keys:  # a lookup asks the daemon again
                    self._missing.pop(k, None)
                if keys:
                    self._verifying.update(keys)
                    self._verify += keys
                    self._cv.notify_all()
            else:
                self._stats["store_failed_keys"] += len(keys)

    def _verify_stored(self, keys):
        """Asks the daemon whether it holds keys, vLLM's completed stores,
        in every rank's namespace of their group (a pin of each, released
        at once); those held get a stored event and count as stored, the
        others are counted (store_unverified_keys) and may be stored again.
        No answer (no connection, an error) holds none: a stored event is
        never sent for a key the daemon was not found holding."""
        held = dict.fromkeys(keys, True)
        with self._lock:
            client, nss, broken = self._client, self._ns, self._broken
        try:
            if broken is not None or client is None:
                raise ConnectionError(broken or "no daemon connection")
            for g, gkeys in self._by_group(list(held)).items():
                for r in range(self._tp):
                    for i in range(0, len(gkeys), p.MAX_KEYS_PER_REQUEST):
                        chunk = gkeys[i:i + p.MAX_KEYS_PER_REQUEST]
                        pin_id, ok = client.pin(nss[(r, g)], [sc.daemon_key(k) for k in chunk], 0)
                        if pin_id:
                            client.unpin(pin_id)
                        for k, h in zip(chunk, ok):
                            held[k] = held[k] and h
        except Exception as e:  # a lost connection is found by the next call
            log.debug("kvhost spec: checking %d stored keys: %s", len(held), e)
            held = dict.fromkeys(held, False)
        now = time.monotonic()
        with self._lock:
            stored = []
            for k in keys:
                if self._verifying[k] > 0:  # reset_cache forgets them
                    self._verifying[k] -= 1
                    if self._verifying[k] <= 0:
                        del self._verifying[k]
                if held[k]:
                    self._stored_at[k] = now
                    self._missing.pop(k, None)
                    stored.append(k)
                else:
                    self._stats["store_unverified_keys"] += 1
            self._stats["store_verified_keys"] += len(stored)
            if len(self._stored_at) > 1 << 18:
                ttl = self._opts["stored_ttl_s"]
                self._stored_at = {k: t for k, t in self._stored_at.items() if now - t < ttl}
            if stored:
                self._removals.stored(list(dict.fromkeys(stored)))

    # -- requests, events, stats ---------------------------------------------

    def take_events(self):
        """Keys stored (removed=False: completed by vLLM and found held by
        the daemon) and, of those, keys the daemon dropped since
        (removed=True: its removal stream, or a lookup finding one gone;
        a move between media: both), since the last call; never waits on
        the daemon (docs/routers.md)."""
        yield from self._removals.take_events()

    def on_new_request(self, req_context=None):
        """Every request's blocks are offloaded block by block (vLLM's
        default policy)."""
        ctx = getattr(self._api, "RequestOffloadingContext", None)
        return ctx() if ctx is not None else None

    def on_request_finished(self, req_context=None):
        return None

    def on_schedule_end(self, context=None):
        """Nothing to flush at a step's end: pins are asked for as lookups
        come."""
        return None

    def has_pending_work(self):
        """True while the daemon has not answered a lookup vLLM was told to
        RETRY: the engine must keep stepping so that vLLM asks again."""
        with self._lock:
            return bool(self._pending) and self._broken is None and not self._closing

    def reset_cache(self):
        """Forgets every answer, every store and load in progress, and
        releases every pin (stored data stays). vLLM discards its jobs in
        flight here: complete_store and complete_load never come for them.
        The keys of loads it still flushes to the workers keep their pins
        for hit_window_s from now, then are released as unused hits are."""
        with self._cv:
            until = time.monotonic() + self._opts["hit_window_s"]
            for k in list(self._pinned):
                if self._loading[k]:
                    self._pinned[k] = (self._pinned[k][0], until)
                else:
                    self._releases += self._release_locked(k)
            self._loading.clear()
            self._storing.clear()
            self._missing.clear()
            self._stored_at.clear()
            self._verifying.clear()
            self._cv.notify_all()
        return True

    @classmethod
    def metric_definitions(cls, api):
        """The Prometheus metrics get_stats reports (declared by the spec
        class's build_metric_definitions)."""
        return _metrics.definitions(api, METRIC_LABELS)

    def get_stats(self):
        """What changed since the last call, as vLLM's
        OffloadingConnectorStats (None when nothing changed, this vLLM has
        no such class or the option "metrics" is false); vLLM calls it every
        scheduler step. No daemon round trip."""
        if not self._opts["metrics"]:
            return None
        with self._lock:
            now = collections.Counter(self._stats)
            delta = now - self._reported
            self._reported = now
        # The manager's names for what _metrics counts.
        delta["lookup_errors"] = delta.get("pin_errors", 0)
        return _metrics.stats(self._api, delta, None, MANAGER_LABELS)

    def counters(self):
        """The manager's counters since it started, as a dict (no daemon
        round trip): for tests, benchmarks and tooling."""
        with self._lock:
            s = dict(self._stats)
            s["pinned_now"] = len(self._pinned)
            s["loading_now"] = sum(self._loading.values())
            s["storing_now"] = sum(self._storing.values())
            s["verifying_now"] = sum(self._verifying.values())  # completed stores not yet found held
            s["connected"] = self._broken is None
            broken = self._broken
        if broken is not None:
            s["daemon_error"] = broken
        s["namespaces"] = sorted(set(self.namespaces.values()))
        s["events"] = self._removals.counters()
        return s

    def shutdown(self):
        """Stops the pin thread and closes the connection (the daemon
        releases this manager's pins); daemon_wait_s at most, however the
        daemon fares: the pin thread's request is ended by the close.
        Idempotent."""
        with self._cv:
            if self._closing:
                return
            self._closing = True
            self._cv.notify_all()
            client = self._client
        until = time.monotonic() + self._opts["daemon_wait_s"]
        self._thread.join(self._opts["daemon_wait_s"])
        if client is not None:  # None: no daemon ever answered
            client.close()  # ends a request the pin thread still waits on
        self._thread.join(max(0.0, until - time.monotonic()) + 0.2)
        self._join_reconnectors(until)
        self._removals.close(max(0.0, until - time.monotonic()) + 0.2)
        with self._lock:
            client = self._client
        if client is not None:
            client.close()


class _SpecImpl:
    """KvhostOffloadingSpec's logic; spec_class binds it to vLLM's (or
    stand-in) classes.

    ``config`` is vLLM's OffloadingConfig. Construction checks the options
    (kv_connector_extra_config) and reads the engine's identity; it raises
    IdentityUnknown naming a field that separates models and cannot be
    read, and ValueError for an option that is neither kvhost's nor vLLM's."""

    _api = sc.SPEC_FALLBACK
    _manager_cls = SpecManager
    _worker_cls = None

    def __init__(self, config, *args, **kwargs):
        base = getattr(self._api, "OffloadingSpec", None)
        if base is not None and isinstance(self, base):
            base.__init__(self, config, *args, **kwargs)
        else:  # no vLLM: what vLLM's base class would set
            self.config = config
            self.extra_config = sc.extra_config_of(config)
            self.replicated_layout = False
            self.offload_prompt_only = bool(self.extra_config.get("offload_prompt_only", True))
        # Every worker stores its own shard (vLLM's single-copy layout is not kvhost's).
        self.replicated_layout = False
        self._opts = sc.options(config)
        self._ident = sc.identity(config, self._opts)
        sc.shard_of(config)
        _warn_undeclared(self.extra_config)
        self._manager = None
        self._mlock = threading.Lock()

    @classmethod
    def build_metric_definitions(cls, extra_config=None):
        """The Prometheus metrics the manager's get_stats reports (vLLM
        declares them from this when the spec is configured): none where
        extra_config's option "metrics" is false."""
        if not _metrics.enabled(extra_config):
            return {}
        return SpecManager.metric_definitions(cls._api)

    def get_manager(self):
        """The scheduler's manager (one per spec)."""
        with self._mlock:
            if self._manager is None:
                self._manager = self._manager_cls(self.config, self._api, self._opts, self._ident)
            return self._manager

    def get_worker(self, kv_caches):
        """A worker over this GPU worker's CanonicalKVCaches."""
        cls = self._worker_cls
        if cls is None:
            from .spec_worker import SpecWorker as cls
        return cls(self.config, kv_caches, self._api, self._opts, self._ident)


def _is_kvhost_spec(extra):
    """Whether the spec that vLLM's OffloadingSpecFactory builds from extra
    (a child's kv_connector_extra_config) is a KvhostOffloadingSpec."""
    name, module = extra.get("spec_name", "CPUOffloadingSpec"), extra.get("spec_module_path")
    if not module:
        return False  # one of vLLM's registered specs
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return False
    return isinstance(cls, type) and issubclass(cls, _SpecImpl)


def _warn_undeclared(extra):
    """Logs a warning where vLLM's current config (a worker's: the engine
    core sets none for the scheduler) puts this spec in a MultiConnector
    whose metrics vLLM's Prometheus logger will fail on
    (_metrics.undeclared). Only a warning: with vLLM's stats logging off
    that configuration runs."""
    if not sc.vllm_installed():
        return
    try:
        from vllm.config import get_current_vllm_config_or_none
    except ImportError:
        return  # a vLLM without it: nothing to read
    why = _metrics.undeclared(get_current_vllm_config_or_none(), extra, _is_kvhost_spec)
    if why:
        log.warning("kvhost spec: %s", why)


def spec_class(api=None):
    """Returns a KvhostOffloadingSpec class bound to api (vLLM's classes or
    stand-ins; None detects the installed vLLM)."""
    api = sc.detect_spec() if api is None else api
    sc.check_spec_api(api)
    from .spec_worker import SpecWorker
    bases = (_SpecImpl,)
    if getattr(api, "OffloadingSpec", None) is not None:
        bases = (_SpecImpl, api.OffloadingSpec)
    manager_cls, worker_cls = SpecManager, SpecWorker
    if getattr(api, "OffloadingManager", None) is not None:
        manager_cls = type("KvhostSpecManager", (SpecManager, api.OffloadingManager),
                           {"__module__": __name__, "__doc__": SpecManager.__doc__})
    if getattr(api, "OffloadingWorker", None) is not None:
        worker_cls = type("KvhostSpecWorker", (SpecWorker, api.OffloadingWorker),
                          {"__module__": SpecWorker.__module__, "__doc__": SpecWorker.__doc__})
    for c in (manager_cls, worker_cls):
        abstract = sorted(getattr(c, "__abstractmethods__", ()) or ())
        if abstract:
            raise sc.UnsupportedVLLM(f"kvhost.vllm: this vLLM ({getattr(api, 'name', '?')}) requires "
                                     f"{c.__name__} methods kvhost does not implement: {', '.join(abstract)}; "
                                     f"supported: {sc.SPEC_WINDOW}")
    cls = type("KvhostOffloadingSpec", bases, {"_api": api, "__module__": "kvhost.vllm",
                                                "__doc__": __doc__, "_manager_cls": manager_cls,
                                                "_worker_cls": worker_cls})
    abstract = sorted(getattr(cls, "__abstractmethods__", ()) or ())
    if abstract:
        raise sc.UnsupportedVLLM(f"kvhost.vllm: this vLLM ({getattr(api, 'name', '?')}) requires spec "
                                 f"methods kvhost does not implement: {', '.join(abstract)}; "
                                 f"supported: {sc.SPEC_WINDOW}")
    return cls
