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
import logging
import threading
import time

from ..client import KvhostError
from . import _metrics
from . import spec_compat as sc
from ._common import setup_timeout
from ._connect import Reconnects, absent_if_stopping, connect
from ._namespace import check_served
from ._removals import OffloadingRemovals, parse_media
from ._spec_pins import SpecPins
from ._spec_stores import SpecStores

# vLLM configures only its "vllm" logger (and stops propagation there):
# only its children show in vLLM's output.
log = logging.getLogger("vllm.kvhost")

# Label of the metrics the manager reports through vLLM (get_stats).
METRIC_LABELS = ("role",)
MANAGER_LABELS = ("scheduler",)


class SpecManager(SpecPins, SpecStores, Reconnects):
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
