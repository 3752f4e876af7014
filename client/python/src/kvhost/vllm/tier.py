"""KvhostTier: a vLLM secondary tier backed by the node's kvhost daemon.

vLLM's TieringOffloadingSpec moves KV blocks between the GPUs and its CPU
region; this tier moves rows of that region to and from kvhost, which
places, evicts and verifies them (its wasm policy decides). Every method
that vLLM's scheduler calls returns at once: lookups are answered from a
short-lived table filled by a background thread (RETRY until the daemon
has answered), stores and promotions run on worker threads that talk to
the daemon and report through get_finished_jobs.

Data path: ``zero_copy="auto"`` (default) registers vLLM's own region (a
memfd or vLLM's /dev/shm file) with the daemon and names its rows
directly, falling back to a copy through a kvhost-registered memfd
(staging) where the region cannot be registered; ``"on"`` refuses the
fallback, ``"off"`` always copies (see docs/vllm.md). The interface is the
same either way.
"""

import collections
import concurrent.futures
import logging
import threading
import time

from .. import lookuptable
from .. import protocol as p
from ..client import KvhostError, default_socket  # noqa: F401 (default_socket: re-exported)
from . import _compat, _metrics, _namespace
from ._common import (daemon_key as _daemon_key, has_field, pick_medium as _pick_medium, reason, setup_timeout)
from ._connect import Reconnects, connect, lost_connection as _lost_connection
from ._removals import OffloadingRemovals, parse_media
from ._tier_data_path import TierDataPath, _Session
from ._tier_jobs import TierJobs
from ._tier_options import VLLM_FS_PREFIX, cp_interleave, options, tier_label

# A child of vLLM's "vllm" logger: vLLM configures only that logger (and
# stops it propagating), so messages logged here appear in vLLM's own output.
log = logging.getLogger("vllm.kvhost")

class _TierImpl(TierJobs, TierDataPath, Reconnects):
    """The tier's logic; kvhost.vllm.tier_class binds it to vLLM's (or
    stand-in) classes."""

    _api = _compat.FALLBACK
    _what = "tier"
    _NOT_FS = ("; with a namespace, page_layout or cp_kv_cache_interleave_size other than 1 vLLM's fs-tier "
               "directory is none of this tier's either: it is named without them and shared by every engine of "
               "the model")

    def __init__(self, offloading_spec, primary_kv_view, tier_type="kvhost", locality=None,
                 backpressure_detector=None, **own):
        import numpy as np  # vLLM depends on numpy; imported here so the module stays light

        api = self._api
        _compat.check_api(api)
        base_init = getattr(api.SecondaryTierManager, "__init__", None)
        if base_init is not None and base_init is not object.__init__:
            kw = {}
            if backpressure_detector is not None and _compat.takes(base_init, "backpressure_detector"):
                kw["backpressure_detector"] = backpressure_detector
            base_init(self, offloading_spec=offloading_spec, primary_kv_view=primary_kv_view,
                      tier_type=tier_type, **kw)
        self.tier_type = tier_type
        self._label = tier_label(offloading_spec, tier_type, own, locality)
        self.locality = _compat.locality(api, locality)
        # Events carry it, as vLLM's own tiers' do (its KV events publish it).
        self._event_fields = {"locality": self.locality} if has_field(api.OffloadingEvent, "locality") else {}
        self._spec = offloading_spec
        o = self._opts = options(own)
        self._medium = _pick_medium(api, o["medium"])
        # vLLM drains take_events only with its KV cache events on, and
        # asks a tier's capture to stay inert otherwise (a spec without the
        # setting, an older vLLM, gets the events as before).
        events_cfg = getattr(offloading_spec, "kv_events_config", None)
        self._events_on = events_cfg is None or bool(getattr(events_cfg, "enable_kv_cache_events", True))
        # Before anything is allocated: a model whose identity cannot be
        # read is refused here, naming the field.
        # A row holds the GPU workers' pages as they lie there: their byte
        # order (page_layout: the option, else the default configuration's)
        # is in the identity. vLLM's own workers fill the rows, so nothing
        # here can check it against the backend they really got.
        self._desc = _namespace.describe(offloading_spec, 0, str(o["namespace"]), o["page_layout"])
        interleave = cp_interleave(_namespace.config_of(offloading_spec), o)
        if interleave is not None:
            self._desc["cp_kv_cache_interleave_size"] = interleave

        # The array over vLLM's region is held only by self._primary (no
        # local here): a traceback of a failed start must not keep it
        # exported, or vLLM's region cleanup fails to close its mapping.
        self._primary = self._view = None
        self._adopt_region(np, primary_kv_view)
        self._np = np

        self._desc["row_bytes"] = self._row_bytes
        self.fs_base = _namespace.fs_base(self._desc["fields"])
        # The data directory of vLLM's fs tier for this engine, where a
        # vllm-fs mount may serve the namespace: named by the fs tier's
        # fields only, and shared by every engine of them, it holds rows
        # of this tier's meaning only where its identity names nothing
        # more (what vllm_fs requires: options, cp_interleave). None:
        # no directory is this tier's own.
        own_dir = not o["namespace"] and o["page_layout"] is None and interleave in (None, 1)
        self._fs_dir = f"{self.fs_base}_r0" if own_dir else None
        geom = _namespace.geometry(self._desc, _namespace.fs_namespace(VLLM_FS_PREFIX, self.fs_base)
                                   if o["vllm_fs"] else None)

        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._closing = False
        self._closed = False
        self._give_up_at = None      # shutdown: when jobs the daemon has not ended are given up
        self._answers = {}
        self._pending_lookups = set()
        self._lookup_queue = []
        self._touch_queue = []
        self._touch_pending = set()  # keys in _touch_queue: each is touched once a pass
        self._storing = collections.Counter()
        self._inflight = 0
        self._finished = []
        self._runs = {}            # job id -> _Run, from submit until its thread ends it
        self._held = None          # vLLM's rows given-up jobs may still touch (_HeldRows), once any is
        self._removals = None      # the stored and removed events (OffloadingRemovals), once started
        self._stats = collections.Counter()
        self._reported = collections.Counter()
        self._reported_inflight = 0
        self._staging = None
        self._slot_ranges = None
        self._zero_copy_error = None
        self._s = None             # the connection in use (_Session)
        self._broken = None        # why the connection is gone (text), until a reconnection
        self._reconnectors = []    # the threads connecting again (shutdown joins them)
        self._geom = geom

        self.data_path = None      # chosen at the first connection
        try:
            # absent: why no daemon answers at start, where none does.
            self._s, absent = self._connect_at_start(lambda: self._connect(first=True))
        except KvhostError as e:
            self._release()
            if o["vllm_fs"]:
                raise RuntimeError(f"kvhost.vllm: vllm_fs: no vllm-fs mount of the daemon serves this "
                                   f"model's fs-tier directory {self.fs_base}: {e}") from e
            raise
        except BaseException:
            self._release()
            raise
        # Stored events, and the removals of what they announced, from a
        # daemon connection of their own (docs/routers.md).
        self._removals = OffloadingRemovals(
            api, self._medium, o["socket"], [geom], fields=self._event_fields,
            media=parse_media(o["mount_media"], lambda name: _pick_medium(api, name)), events=self._events_on,
            name=o["client_name"] + "-removals", max_tracked=o["max_tracked_keys"], max_queued=o["max_events"],
            reconnect_s=o["reconnect_s"], timeout=setup_timeout(o), what="tier removals")
        self._pool = concurrent.futures.ThreadPoolExecutor(o["threads"], thread_name_prefix="kvhost-tier")
        self._lookup_thread = threading.Thread(target=self._lookup_loop, name="kvhost-tier-lookup", daemon=True)
        self._lookup_thread.start()
        if absent is not None:
            self._start_unconnected(absent)
        log.info("kvhost tier: namespace %s (%d-byte rows, model %s, vLLM fs-tier directory %s), "
                 "data path %s, socket %s, lookup probe %s", geom.model, self._row_bytes,
                 self._desc["fields"]["model_name"], self.fs_base,
                 self.data_path or "chosen once the daemon answers", o["socket"],
                 lookuptable.NATIVE or ("python" if lookuptable.ORDERED_LOADS else "none, the daemon answers")
                 + " (kvhost._lookup not built: install gcc and python3-dev, then the client again)")

    @property
    def namespace(self):
        """The kvhost namespace this tier declared (kvhost.Namespace): its
        geometry, model id and fingerprint; None before the first
        connection (no daemon at start)."""
        s = self._s
        return None if s is None else s.ns

    # -- set-up ---------------------------------------------------------------

    def _connect(self, first):
        """A new session: connects, declares the namespace and registers
        the data path's memory (on the first connection choosing the data
        path, later the same one again). Nothing of it stays on failure."""
        o = self._opts

        def set_up(client):
            s = _Session(client)
            s.ns = client.declare(self._geom)
            if s.ns.key_bytes != self._row_bytes:
                raise RuntimeError(f"kvhost.vllm: the daemon derived {s.ns.key_bytes} bytes per key, "
                                   f"want the row's {self._row_bytes}")
            # Every connection: a daemon restarted with another
            # configuration may serve the namespace from elsewhere.
            _namespace.check_served(s.ns.fingerprint, self._geom, self._fs_dir, kvhost_mounts=not o["vllm_fs"],
                                    note="" if self._fs_dir else self._NOT_FS)
            if first:
                self.data_path = self._setup_data_path(s)
            elif self.data_path == "zero-copy":
                self._register_primary_again(s)
            else:
                self._register_staging(s)
            return s
        return connect(o, o["client_name"], set_up, " (set the tier's \"socket\" key or KVHOST_SOCKET)")

    # -- losing the daemon and finding it again ---------------------------------

    def _lost(self, s, e):
        """Session s met e, which ended its connection: from now on lookups
        answer MISS and jobs fail at once, without waiting on a dead socket,
        until a reconnection (Reconnects) swaps a new session in."""
        with self._cv:
            self._lost_locked(s, reason(e))

    def _current(self):
        return self._s

    def _open(self):
        # Before the first connection (no daemon at start) the data path
        # is still to be chosen.
        return self._connect(first=self._s is None)

    def _swap_locked(self, s):
        self._s = s
        self.data_path = "copy" if s.staged else "zero-copy"
        self._answers.clear()  # MISS answered while down

    @staticmethod
    def _drop(s):
        # Closing releases what the session holds on the daemon (asking
        # first would wait on a daemon that does not answer), once the
        # daemon ended its jobs.
        s.client.close_after_jobs()

    # -- lookups ---------------------------------------------------------------

    def lookup(self, key, req_context=None):
        """HIT or MISS from the daemon's answer (kept lookup_ttl_s), RETRY
        while the answer is pending or the key is being stored here."""
        R = self._api.LookupResult
        key = bytes(key)
        deadline = None
        with self._cv:
            self._stats["lookups"] += 1
            while True:
                if self._storing[key]:
                    self._stats["lookup_retries"] += 1
                    return R.RETRY
                if self._broken is not None:  # no daemon: vLLM computes the blocks
                    self._stats["lookup_misses"] += 1
                    return R.MISS
                a = self._answers.get(key)
                now = time.monotonic()
                if a is not None and a[1] > now:
                    self._stats["lookup_hits" if a[0] else "lookup_misses"] += 1
                    return R.HIT if a[0] else R.MISS
                if key not in self._pending_lookups and not self._closing:
                    self._pending_lookups.add(key)
                    self._lookup_queue.append((key, getattr(req_context, "req_id", None)))
                    self._cv.notify_all()
                wait = self._opts["lookup_wait_s"]
                if deadline is None:
                    deadline = now + wait
                if self._closing or now >= deadline:
                    self._stats["lookup_retries"] += 1
                    return R.RETRY
                self._cv.wait(deadline - now)

    def touch(self, keys, req_context=None):
        """Marks keys used: the daemon counts a lookup hit as an access for
        its policy, so this queues a lookup (answered off this thread)."""
        keys = [bytes(k) for k in keys]
        if not keys:
            return
        with self._cv:
            if self._broken is None:
                # vLLM touches a request's keys each time it polls its
                # lookups: a key already queued is not queued again.
                new = [k for k in keys if k not in self._touch_pending]
                if new:
                    self._touch_pending.update(new)
                    self._touch_queue.append(new)
                    self._cv.notify_all()

    def _lookup_loop(self):
        while True:
            with self._cv:
                while not self._lookup_queue and not self._touch_queue and not self._closing:
                    self._cv.wait()
                if self._closing:
                    return
                queued, self._lookup_queue = self._lookup_queue, []
                touches, self._touch_queue = self._touch_queue, []
                self._touch_pending.clear()
                s, down = self._s, self._broken
            keys = [k for k, _ in queued]
            answers = {}
            try:
                rest = queued
                if down is not None:  # no daemon: MISS below, nobody to touch
                    rest, touches = [], []
                while rest:
                    batch = rest[:p.MAX_KEYS_PER_REQUEST]
                    n = s.client.lookup(s.ns, [_daemon_key(k) for k, _ in batch])
                    with self._lock:
                        self._stats["daemon_lookups"] += 1
                        self._stats["daemon_lookup_keys"] += len(batch)
                    for k, _ in batch[:n]:
                        answers[k] = True
                    if n == len(batch):
                        rest = rest[len(batch):]
                        continue
                    missed, rid = batch[n]
                    answers[missed] = False
                    rest = batch[n + 1:] + rest[len(batch):]
                    if rid is not None:
                        # vLLM scans a request's keys in prefix order and
                        # stops at its first miss: the request's keys
                        # queued after it are answered MISS with it (and
                        # expire with it), not asked one round trip each.
                        for k, r in rest:
                            if r == rid:
                                answers[k] = False
                        rest = [(k, r) for k, r in rest if r != rid]
                for t in touches:
                    for i in range(0, len(t), p.MAX_KEYS_PER_REQUEST):
                        s.client.touch(s.ns, [_daemon_key(k) for k in t[i:i + p.MAX_KEYS_PER_REQUEST]])
            except Exception as e:  # the daemon is gone or refused: answer MISS, vLLM recomputes
                with self._lock:
                    self._stats["lookup_errors"] += 1
                if _lost_connection(e, s.client):
                    self._lost(s, e)
                else:
                    log.warning("kvhost tier: lookup failed: %s", e)
            expiry = time.monotonic() + self._opts["lookup_ttl_s"]
            with self._cv:
                # Answers of a connection replaced meanwhile are another
                # daemon's: not kept (a HIT would promise rows the new one
                # may lack); the keys are asked again.
                keep = self._s is s
                for k in keys:
                    if keep:
                        self._answers[k] = (answers.get(k, False), expiry)
                    self._pending_lookups.discard(k)
                if len(self._answers) > 4 * (1 << 16):
                    now = time.monotonic()
                    self._answers = {k: a for k, a in self._answers.items() if a[1] > now}
                self._cv.notify_all()

    # -- requests, events, stats -------------------------------------------------

    def on_new_request(self, req_context=None):
        """The tier has no per-request preference: vLLM's default context."""
        return self._api.RequestOffloadingContext()

    def on_request_finished(self, req_context=None):
        """Nothing is held per request."""
        return None

    def request_finished(self, req_context=None):
        """Older name of on_request_finished."""
        return None

    def on_schedule_end(self, *args, **kwargs):
        """Nothing to do at a step's end: jobs are already running."""
        return None

    def take_events(self):
        """Keys this tier stored (removed=False) and, of those, keys the
        daemon dropped since (removed=True; a move between media: both),
        since the last call; never waits on the daemon (docs/routers.md)."""
        return self._removals.take_events()

    def counters(self):
        """This tier's counters since it started, as a dict (no daemon
        round trip): for tests, benchmarks and ``kvhost`` tooling."""
        with self._lock:
            s = dict(self._stats)
            s["inflight_jobs"] = self._inflight
            s["connected"] = self._broken is None
        s["data_path"] = self.data_path
        s["namespace"] = self._geom.model
        s["events"] = self._removals.counters()
        if self._zero_copy_error:
            s["zero_copy_error"] = self._zero_copy_error
        return s

    @classmethod
    def build_metric_definitions(cls, extra_config=None):
        """The Prometheus metrics get_stats reports (vLLM declares them
        when the tier is configured): kvhost's own counters, labelled by
        tier; vLLM's tiering metrics already count this tier's queries,
        hits, bytes and job failures."""
        return _metrics.definitions(cls._api)

    def get_stats(self):
        """What changed since the last call, as vLLM's
        OffloadingConnectorStats (None when nothing changed or this vLLM
        has no such class); vLLM calls it every scheduler step."""
        with self._lock:
            now = collections.Counter(self._stats)
            inflight = self._inflight
            delta = now - self._reported
            self._reported = now
            gauge = None if inflight == self._reported_inflight else inflight
            self._reported_inflight = inflight
        return _metrics.stats(self._api, delta, gauge, (self._label,))

    def daemon_stats(self):
        """The daemon's counters (one round trip; not for the scheduler's hot path)."""
        s = self._s
        if s is None:
            raise ConnectionError(f"kvhost.vllm: no kvhost daemon has answered at {self._opts['socket']} yet")
        return s.client.stats()

    def shutdown(self):
        """Waits for jobs daemon_wait_s at most, then releases the daemon
        connection, registrations and staging memory; returns within about
        daemon_wait_s however the daemon fares. A job the daemon has not
        ended by then is given up: the memory it may still touch goes with
        the process, which is ending. Idempotent."""
        with self._cv:
            if self._closed:
                return
            until = time.monotonic() + self._opts["daemon_wait_s"]
            self._give_up_at = until
            self._closed = True
            while self._runs and (left := until - time.monotonic()) > 0:
                self._cv.wait(left)
            self._closing = True
            self._cv.notify_all()
            s = self._s
        if s is not None:
            # Ends at once what still waits on the daemon: a lookup, a
            # cancel (each waits request_timeout_s otherwise).
            s.client.close()
        with self._cv:  # the job threads given up at until unwind (their frames hold rows)
            grace = time.monotonic() + 0.2
            while self._runs and (left := grace - time.monotonic()) > 0:
                self._cv.wait(left)
        self._pool.shutdown(wait=False)
        self._lookup_thread.join(max(0.0, until - time.monotonic()) + 0.2)
        self._join_reconnectors(until)
        self._removals.close(max(0.0, until - time.monotonic()) + 0.2)
        self._release()

    def _release(self):
        # Drop every array over vLLM's region first: vLLM releases its
        # memoryview and closes the mapping after its tiers shut down, which
        # fails while an export of it is alive.
        self._primary = self._view = None
        s = getattr(self, "_s", None)
        if s is not None:
            s.client.close()  # its jobs ended, or shutdown gave up on them
        if self._staging is not None:
            self._staging_rows = None
            try:
                self._staging.close()
            except BufferError as e:  # a job thread given up at shutdown still holds it: the exit frees it
                log.warning("kvhost tier: staging memory left to the process's exit: %s", e)
            self._staging = None
