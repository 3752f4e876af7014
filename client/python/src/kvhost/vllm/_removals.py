"""Removals into vLLM's KV events: what the tier (KvhostTier), the spec's
manager (KvhostOffloadingSpec) and the KV connector's scheduler half
(KvhostConnector) hand vLLM from take_events when the daemon drops a key
they reported stored (docs/routers.md).

Each half owns one of these, beside its own daemon connection:

- ``OffloadingRemovals`` (tier, spec): the half queues its stored events
  here (``stored``) instead of in a queue of its own; a key it reported
  stored and the daemon then drops becomes ``OffloadingEvent(keys, medium,
  removed=True)``; a key moved to a mount of another medium (the
  ``media`` option) becomes a removed event for the medium the router was
  told and a stored event for the new one. vLLM's OffloadingConnector
  turns both into ``BlockRemoved`` and ``BlockStored`` (its
  OffloadingEventsTracker), with the medium and locality of the event.
- ``ConnectorRemovals`` (KV connector): the half hands over each chunk it
  saves (``saved``, with the block hashes and tokens vLLM's events carry);
  once the daemon holds the chunk in every rank's namespace a
  ``BlockStored`` is queued, and when the daemon drops it a
  ``BlockRemoved`` with the same block hashes.

Both run a ``Watcher``: a thread with a daemon connection of its own that
declares the half's namespaces and subscribes to their removals
(Client.subscribe_removals), subscribes again from its cursor after a
lost connection, and, where the daemon cannot serve the cursor without a
gap (a resync: a daemon restarted, or a subscriber that fell behind),
asks the daemon which of the keys the half reported stored it still
holds (its shared lookup table, read in this process; pins of lease 0,
released at once, where it cannot be read), and reports the others
removed.
So no removal is lost silently: it is reported as it happens, or found by
that check.

What is reported: removals of the keys this half reported stored, once
each, with the medium the router was told; nothing for a key the half
never reported stored (another engine's: that engine reports its own
removals, from its own watcher), nor for a key still stored (the daemon
sends no record for a key another file holds; a move within one medium is
no change to a router). Memory is bounded: at most ``max_tracked`` keys
are remembered; the oldest one past that is reported removed at once (a
router then never holds a key the half can no longer vouch for; the key
may still load: a lookup finds it).

Nothing here blocks vLLM's scheduler: ``take_events`` returns what is
queued, under a lock that no daemon round trip holds.

Importing this module imports nothing of vLLM.
"""

import collections
import itertools
import threading
import time

from ._common import daemon_key
from ._removal_watcher import Watcher, _pinned

# Defaults: the keys remembered (MAX_TRACKED: an OffloadingRemovals key
# costs about 250 bytes of the scheduler's memory; MAX_TRACKED_CHUNKS: a
# ConnectorRemovals chunk, its block hashes, about 1 KiB at 16 hashes a
# chunk), the keys of stored events queued at most between two
# take_events calls (older stored events are dropped, and their keys
# forgotten, past it: a router under-counts, never over-counts), the
# connector's chunks saved and not yet found stored (MAX_PENDING: each
# holds its tokens until its BlockStored is queued), the lag samples kept
# for lags(), and the removals of keys not tracked kept for a store
# reported after its removal (RECENT).
MAX_TRACKED = 1 << 18
MAX_TRACKED_CHUNKS = 1 << 16
MAX_QUEUED = 1 << 16
MAX_PENDING = 1 << 12
LAG_SAMPLES = 1 << 14
RECENT = 1 << 16


class _Tracked:
    """What OffloadingRemovals and ConnectorRemovals share: the keys
    reported stored (daemon key -> _Entry, oldest first, at most
    max_tracked), the queue of events take_events returns, the watcher,
    the counters and the lag samples."""

    def __init__(self, socket, geometries, medium, *, groups, media, events, watch, name, max_tracked, max_queued,
                 reconnect_s, timeout, what):
        for k, v in (("max_tracked", max_tracked), ("max_queued", max_queued)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"kvhost.vllm: {k}: want an integer >= 1, got {v!r}")
        # A key of group g is held where every namespace of g holds it:
        # groups[i] is geometries[i]'s group (the spec's KV-cache group, the
        # connector's salt namespace), all 0 by default.
        self._groups = list(groups) if groups is not None else [0] * len(geometries)
        if len(self._groups) != len(geometries):
            raise ValueError(f"kvhost.vllm: {len(geometries)} namespaces, {len(self._groups)} groups")
        self._by_group = collections.defaultdict(list)
        for i, g in enumerate(self._groups):
            self._by_group[g].append(i)
        self._lock = threading.Lock()
        self._tracked = collections.OrderedDict()   # daemon key -> _Entry
        self._queue = collections.deque()           # [kind, medium, [(key or entry, record time ns)]]
        self._queued_stored = 0                     # keys of stored events queued
        self._max_tracked, self._max_queued = max_tracked, max_queued
        self._lags = collections.deque(maxlen=LAG_SAMPLES)  # seconds, record -> take_events
        self.stats = collections.Counter()
        # Removals of keys not tracked, by daemon key (record time ns),
        # the last RECENT of them: a key reported stored after its removal
        # was handled (the half reports a store once its job ended, the
        # watcher may see the eviction first) is asked of the daemon again
        # (_recheck, on the watcher's thread), not left stored at the router.
        self._recent = collections.OrderedDict()
        self._recheck = {}                          # daemon key -> _Entry
        self._medium, self._media = medium, dict(media or {})
        self.events_on = bool(events)
        self.watcher = None
        if self.events_on and watch:
            self.watcher = Watcher(socket, geometries, self._records, self._gap, name=name,
                                   reconnect_s=reconnect_s, timeout=timeout, idle=self._idle, what=what)

    # -- the queue ------------------------------------------------------------------

    def _push_locked(self, kind, medium, items):
        """Appends items to the queue, merged into the last event where it
        is of the same kind and medium."""
        if not items:
            return
        if kind == "stored":
            self._queued_stored += len(items)
        last = self._queue[-1] if self._queue else None
        if last is not None and last[0] == kind and last[1] == medium:
            last[2].extend(items)
        else:
            self._queue.append([kind, medium, list(items)])
        while self._queued_stored > self._max_queued:
            self._drop_oldest_stored_locked()

    def _drop_oldest_stored_locked(self):
        """Past max_queued keys of stored events: the oldest stored event
        is dropped and its keys forgotten (no removal follows for them)."""
        for i, ev in enumerate(self._queue):
            if ev[0] == "stored":
                del self._queue[i]
                self._queued_stored -= len(ev[2])
                for e, _ in ev[2]:
                    self._tracked.pop(e.dkey, None)
                self.stats["events_dropped"] += 1
                self.stats["dropped_keys"] += len(ev[2])
                return

    def _take_locked(self):
        """The queue's events, emptied; removals' lag samples kept."""
        out, self._queue, self._queued_stored = self._queue, collections.deque(), 0
        now = time.time_ns()
        for kind, _, items in out:
            if kind == "removed":
                for _, t in items:
                    if t:
                        self._lags.append((now - t) / 1e9)
        return out

    def lags(self):
        """The removal lags of the events taken so far (seconds from the
        daemon's record to take_events handing the event to vLLM), the
        last LAG_SAMPLES of them."""
        with self._lock:
            return list(self._lags)

    # -- tracking -------------------------------------------------------------------

    def _track_locked(self, entry):
        """Remembers entry (re-stored: moved to the newest end); past
        max_tracked the oldest is reported removed now."""
        self._tracked.pop(entry.dkey, None)
        self._tracked[entry.dkey] = entry
        if entry.dkey in self._recent:
            self._recheck[entry.dkey] = entry
        while len(self._tracked) > self._max_tracked:
            _, gone = self._tracked.popitem(last=False)
            self.stats["forgotten_keys"] += 1
            self._push_locked("removed", gone.medium, [(gone, 0)])

    def _removed_locked(self, dkey, t, why, ns=None):
        """dkey left the daemon (record time t, or 0; from namespace index
        ns, None: any of its group's): a removal for it where it was
        reported stored."""
        e = self._tracked.get(dkey)
        if e is not None and ns is not None and ns not in self._namespaces(e):
            e = None  # a key of that name in another group's namespace
        if e is not None:
            del self._tracked[dkey]
        if e is None:
            self.stats["removals_not_reported"] += 1
            self._recent[dkey] = t
            self._recent.move_to_end(dkey)
            if len(self._recent) > RECENT:
                self._recent.popitem(last=False)
            return
        self.stats[f"removed_{why}"] += 1
        self._push_locked("removed", e.medium, [(e, t)])

    # -- the watcher's callbacks ----------------------------------------------------------

    def _records(self, conn, records):
        _, nss = conn
        fps = {ns.fingerprint: i for i, ns in enumerate(nss)}
        with self._lock:
            self.stats["records"] += len(records)
            for r in records:
                i = fps.get(r.fingerprint)
                if i is None:
                    continue
                if r.reason == "moved" and r.to is not None:
                    self._moved_locked(r, i)
                else:
                    self._removed_locked(r.key, r.time_ns, r.reason.replace("-", "_"), i)

    def _medium_of(self, mount, default):
        """The medium of keys on mount (media's), default where media names
        none: every mount is the half's medium."""
        return self._media.get(mount, self._medium) if self._media else default

    def _moved_locked(self, r, ns):
        """A key moved between mounts (in namespace index ns): a change of
        medium (removed for the medium the router was told, stored for the
        new one) where the two mounts' media differ; else nothing."""
        e = self._tracked.get(r.key)
        if e is None or ns not in self._namespaces(e):
            return
        new = self._medium_of(r.to, e.medium)
        if new == e.medium:
            self.stats["moves_same_medium"] += 1
            return
        self.stats["medium_changes"] += 1
        self._push_locked("removed", e.medium, [(e, r.time_ns)])
        e.medium = new
        self._tracked.move_to_end(r.key)
        self._push_locked("stored", new, [(e, 0)])

    def _gap(self, conn):
        """Removals may have been lost: the keys reported stored are asked
        of the daemon, and those it no longer holds are reported removed.
        Keys reported while the check runs are not asked (their removals
        are recorded from now on)."""
        client, nss = conn
        with self._lock:
            entries = list(self._tracked.values())
            self.stats["gap_checks"] += 1
        gone = self._missing(client, nss, entries)
        with self._lock:
            for e in gone:
                if self._tracked.get(e.dkey) is e:
                    self._removed_locked(e.dkey, 0, "resync")

    def _missing(self, client, nss, entries):
        """The entries the daemon does not hold in every namespace of
        theirs (_namespaces)."""
        by_ns = collections.defaultdict(list)
        for e in entries:
            for i in self._namespaces(e):
                by_ns[i].append(e)
        gone = set()
        for i, es in by_ns.items():
            for e, h in zip(es, _pinned(client, nss[i], [e.dkey for e in es])):
                if not h:
                    gone.add(e)
        return [e for e in entries if e in gone]

    def _namespaces(self, e):
        """The indexes of the namespaces that hold e's key (its group's)."""
        return self._by_group.get(e.group, ())

    def _idle(self, conn):
        """Called on the watcher's thread after each batch, and every
        idle_s without one: the keys reported stored after a removal of
        theirs was handled are asked of the daemon."""
        with self._lock:
            if not self._recheck:
                return
            entries, self._recheck = list(self._recheck.values()), {}
        client, nss = conn
        try:
            gone = self._missing(client, nss, entries)
        except BaseException:
            with self._lock:  # asked again on the next connection
                for e in entries:
                    self._recheck.setdefault(e.dkey, e)
            raise
        with self._lock:
            self.stats["rechecked_keys"] += len(entries)
            for e in gone:
                if self._tracked.get(e.dkey) is e:
                    self._removed_locked(e.dkey, self._recent.get(e.dkey, 0), "rechecked")

    # -- lifecycle ------------------------------------------------------------------

    def counters(self):
        """Counters since start (records seen, removals reported by reason,
        gaps checked, keys forgotten, events dropped), with the keys
        tracked now and the watcher's state."""
        with self._lock:
            s = dict(self.stats)
            s["tracked_keys"] = len(self._tracked)
        w = self.watcher
        if w is not None:
            s["subscriptions"], s["resyncs"] = w.connects, w.resyncs
            s["subscribed"] = w.subscribed.is_set()
        return s

    def close(self, wait=None):
        """Stops the watcher and closes its connection (Watcher.close).
        Idempotent."""
        if self.watcher is not None:
            self.watcher.close(wait)


class _Entry:
    """A key reported stored: its daemon key, what vLLM's events name it
    by (a vLLM key, or the chunk's block hashes and stored-event fields),
    the medium the router was told."""
    __slots__ = ("dkey", "key", "medium", "info", "group")

    def __init__(self, dkey, key, medium, info=None, group=0):
        self.dkey, self.key, self.medium, self.info, self.group = dkey, key, medium, info, group


class OffloadingRemovals(_Tracked):
    """The stored and removed OffloadingEvents of the tier or the spec's
    manager (docs/routers.md).

    api: the classes in use (OffloadingEvent, Medium); medium: the half's
    medium (its stored events'); fields: the events' other fields (the
    tier's {"locality": ...}); geometries: the half's namespaces (the
    tier's one; the spec's (rank, group) ones, with groups[i] the KV-cache
    group of geometries[i]: a key of group g is held only if every rank's
    namespace of g holds it); media: {mount index: the medium of keys on
    it} for the daemon's mounts of another medium than medium (a move
    there is a medium change), default none; events=False: no watcher,
    nothing tracked or queued (vLLM's KV events off); watch=False: no
    watcher (tests hand records in)."""

    def __init__(self, api, medium, socket, geometries, *, groups=None, fields=None, media=None, events=True,
                 name="vllm-removals", max_tracked=MAX_TRACKED, max_queued=MAX_QUEUED, reconnect_s=1.0,
                 timeout=5.0, what="removals", watch=True):
        self._api = api
        self._fields = dict(fields or {})
        super().__init__(socket, geometries, medium, groups=groups, media=media, events=events, watch=watch,
                         name=name, max_tracked=max_tracked, max_queued=max_queued, reconnect_s=reconnect_s,
                         timeout=timeout, what=what)

    def stored(self, keys):
        """keys (vLLM's keys) were stored by this half: a stored event is
        queued (take_events) and the keys are tracked, so that their
        removal follows. Never waits on the daemon."""
        if not self.events_on:
            return
        with self._lock:
            items = []
            for k in keys:
                k = bytes(k)
                g = int.from_bytes(k[-4:], "big") if len(self._by_group) > 1 and len(k) >= 4 else self._groups[0]
                e = _Entry(daemon_key(k), k, self._medium, group=g)
                self._track_locked(e)
                items.append((e, 0))
            self._push_locked("stored", self._medium, items)

    def gone(self, keys):
        """keys (vLLM's keys) were found gone by the half itself (a load
        that missed, a lookup's pin that found none): a removed event for
        those reported stored and not yet reported removed."""
        if not self.events_on:
            return
        with self._lock:
            for k in keys:
                self._removed_locked(daemon_key(bytes(k)), 0, "found_gone")

    def take_events(self):
        """The events queued since the last call, in order (a list of the
        api's OffloadingEvent): what vLLM's take_events yields."""
        with self._lock:
            out = self._take_locked()
        ev = self._api.OffloadingEvent
        return [ev(keys=[e.key for e, _ in items], medium=medium, removed=kind == "removed", **self._fields)
                for kind, medium, items in out]


class ConnectorRemovals(_Tracked):
    """The BlockStored and BlockRemoved events of the KV connector's
    scheduler half (docs/routers.md).

    api: vLLM's KV-event classes (BlockStored, BlockRemoved; a namespace
    with them, from vllm.distributed.kv_events) and convert, vLLM's
    maybe_convert_block_hash (how its events name a hash: bytes, or ints
    with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES); medium: the events'
    (vLLM's MEDIUM_STORAGE, "STORAGE"); locality: "LOCAL", "REMOTE" or
    None; geometries: the connector's namespaces, one per rank (a chunk is
    held where every one holds it) and, with groups (geometries[i] of
    group groups[i]), per salt namespace too. A saved chunk's BlockStored waits
    until the daemon holds it (asked every verify_s, for verify_for_s at
    most: a chunk not stored by then gets no event). events and watch as
    OffloadingRemovals'."""

    def __init__(self, api, socket, geometries, *, groups=None, medium="STORAGE", locality=None, media=None,
                 events=True,
                 name="vllm-removals", max_tracked=MAX_TRACKED_CHUNKS, max_queued=MAX_QUEUED, reconnect_s=1.0,
                 timeout=5.0, verify_s=0.25, verify_for_s=60.0, max_pending=MAX_PENDING,
                 what="connector removals", watch=True):
        self._api, self._locality = api, locality
        self._convert = getattr(api, "convert", None) or (lambda h: h)
        self._verify_s, self._verify_for_s, self._max_pending = verify_s, verify_for_s, max_pending
        self._pending = collections.OrderedDict()   # daemon key -> (_Entry, saved at, monotonic)
        self._checked = 0.0
        super().__init__(socket, geometries, medium, groups=groups, media=media, events=events, watch=watch,
                         name=name, max_tracked=max_tracked, max_queued=max_queued, reconnect_s=reconnect_s,
                         timeout=timeout, what=what)


    def saved(self, key, block_hashes, parent_block_hash, token_ids, block_size, lora_id=None, lora_name=None,
              extra_keys=None, group_idx=0, group=0, spec=(None, None)):
        """A chunk went to the workers to be stored under key (the daemon's
        key), holding block_hashes (vLLM's BlockHash bytes, in order) of
        block_size tokens each after parent_block_hash (None: the first),
        token_ids its tokens: once the daemon holds it, a BlockStored of
        them is queued, and its removal will name the same hashes. group:
        the group of namespaces it goes to (groups'; the connector's salt
        namespace and KV-cache group); group_idx and spec (the KV-cache
        group's kind and sliding window: event_specs) what the events say
        of its KV-cache group. Never waits on the daemon."""
        if not self.events_on:
            return
        info = {"block_hashes": [bytes(h) for h in block_hashes],
                "parent_block_hash": None if parent_block_hash is None else bytes(parent_block_hash),
                "token_ids": list(token_ids), "block_size": int(block_size), "lora_id": lora_id,
                "lora_name": lora_name, "extra_keys": extra_keys, "group_idx": group_idx,
                "kv_cache_spec_kind": spec[0], "kv_cache_spec_sliding_window": spec[1]}
        dkey = bytes(key)
        with self._lock:
            if dkey in self._tracked or dkey in self._pending:
                return  # reported already, or being checked
            self._pending[dkey] = (_Entry(dkey, None, self._medium, info, group), time.monotonic())
            while len(self._pending) > self._max_pending:
                self._pending.popitem(last=False)
                self.stats["unverified_dropped"] += 1

    def _idle(self, conn):
        """After each batch and every idle_s: every verify_s, the chunks
        saved and not yet found held are asked of the daemon."""
        super()._idle(conn)
        now = time.monotonic()
        if now - self._checked < self._verify_s:
            return
        self._checked = now
        self._verify(conn)

    def _verify(self, conn):
        client, nss = conn
        with self._lock:
            entries = [e for e, _ in self._pending.values()]
        if not entries:
            return
        gone = set(self._missing(client, nss, entries))
        now = time.monotonic()
        with self._lock:
            for e in entries:
                got = self._pending.get(e.dkey)
                if got is None or got[0] is not e:
                    continue
                if e not in gone:
                    del self._pending[e.dkey]
                    self.stats["stored_verified"] += 1
                    self._track_locked(e)
                    self._push_locked("stored", e.medium, [(e, 0)])
                elif now - got[1] > self._verify_for_s:
                    del self._pending[e.dkey]
                    self.stats["stored_unverified"] += 1

    def _gap(self, conn):
        super()._gap(conn)
        self._verify(conn)

    def take_events(self):
        """The events queued since the last call, in order: BlockStored
        for each chunk found stored, BlockRemoved (one per run of removals
        of a medium) for those since removed."""
        with self._lock:
            out = self._take_locked()
        a, cv = self._api, self._convert
        events = []
        for kind, medium, items in out:
            if kind == "removed":
                # One BlockRemoved per run of one KV-cache group's chunks.
                for g, run in itertools.groupby(items, key=lambda it: it[0].info["group_idx"]):
                    hashes = [cv(h) for e, _ in run for h in e.info["block_hashes"]]
                    events.append(_make(a.BlockRemoved, block_hashes=hashes, medium=medium, group_idx=g,
                                        locality=self._locality))
                continue
            for e, _ in items:
                i = e.info
                if "token_ids" not in i:  # announced again (a medium change): what it was told
                    i = {**i, "parent_block_hash": None, "token_ids": [], "block_size": 0, "lora_id": None,
                         "lora_name": None, "extra_keys": None}
                events.append(_make(
                    a.BlockStored, block_hashes=[cv(h) for h in i["block_hashes"]],
                    parent_block_hash=None if i["parent_block_hash"] is None else cv(i["parent_block_hash"]),
                    token_ids=i["token_ids"], block_size=i["block_size"], lora_id=i["lora_id"], medium=medium,
                    lora_name=i["lora_name"], extra_keys=i["extra_keys"], group_idx=i["group_idx"],
                    kv_cache_spec_kind=i.get("kv_cache_spec_kind"),
                    kv_cache_spec_sliding_window=i.get("kv_cache_spec_sliding_window"), locality=self._locality))
                # A removal names only the hashes and the group: the rest
                # is not kept (memory: max_tracked chunks).
                e.info = {k: i.get(k) for k in ("block_hashes", "group_idx", "kv_cache_spec_kind",
                                                "kv_cache_spec_sliding_window")}
        return events

    def counters(self):
        s = super().counters()
        with self._lock:
            s["verifying_keys"] = len(self._pending)
        return s


def parse_media(value, pick=None, what="mount_media"):
    """The media option ({mount index: medium name}, JSON's string keys
    too; None: none) as {int: medium}, each name made a medium by pick
    (vLLM's Medium member: _common.pick_medium; None: the name itself).
    ValueError naming the option for any other form."""
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(
            (isinstance(k, int) and not isinstance(k, bool) or isinstance(k, str) and k.isdigit())
            and isinstance(v, str) for k, v in value.items()):
        raise ValueError(f"kvhost.vllm: {what}: want {{mount index: medium name}} (e.g. {{\"0\": \"CPU\"}}: the "
                         f"daemon's first mount holds vLLM's CPU medium), got {value!r}")
    return {int(k): (pick(v) if pick is not None else v) for k, v in value.items()}


def _fields_of(cls):
    """The constructor fields of cls: a msgspec Struct's __struct_fields__,
    a dataclass's fields, else its signature's parameters."""
    f = getattr(cls, "__struct_fields__", None)
    if f is not None:
        return set(f)
    import dataclasses
    import inspect
    if dataclasses.is_dataclass(cls):
        return {x.name for x in dataclasses.fields(cls)}
    try:
        return set(inspect.signature(cls).parameters)
    except (TypeError, ValueError):
        return set()


def _make(cls, **kw):
    """cls(**kw) with the fields this vLLM's class has: one an older vLLM
    lacks (locality, group_idx) is left out."""
    have = _fields_of(cls)
    return cls(**({k: v for k, v in kw.items() if k in have} if have else kw))


def event_specs(kv_cache_config):
    """Per KV-cache group of vLLM's KVCacheConfig, (kind, sliding window)
    as vLLM's own events name them (get_kv_cache_spec_kind's value,
    get_kv_cache_spec_sliding_window); (None, None) each where this vLLM
    has no such helpers or no config was given."""
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
    try:
        from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind, get_kv_cache_spec_sliding_window
    except ImportError:  # an older vLLM: its events carry no spec fields
        return [(None, None)] * len(groups)
    return [(get_kv_cache_spec_kind(g.kv_cache_spec).value, get_kv_cache_spec_sliding_window(g.kv_cache_spec))
            for g in groups]


def kv_event_api():
    """vLLM's KV-event classes for ConnectorRemovals (BlockStored,
    BlockRemoved, AllBlocksCleared, convert): vllm.distributed.kv_events'
    and vllm.v1.core.kv_cache_utils' maybe_convert_block_hash. ImportError
    where this vLLM has none."""
    import types
    from vllm.distributed import kv_events as ke
    try:
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash as convert
    except ImportError:
        convert = None
    return types.SimpleNamespace(BlockStored=ke.BlockStored, BlockRemoved=ke.BlockRemoved,
                                 AllBlocksCleared=ke.AllBlocksCleared, convert=convert,
                                 medium=getattr(ke, "MEDIUM_STORAGE", "STORAGE"))

