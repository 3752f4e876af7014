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
import fcntl
import logging
import os
import queue
import threading
import time

from .. import lookuptable
from .. import protocol as p
from ..client import KvhostError, Layer, default_socket
from ..memory import HostBuffer
from . import _compat, _metrics, _namespace
from ._common import (DAEMON_WAIT_S, check_daemon_wait, check_request_timeout, check_seconds, daemon_key as _daemon_key,
                      daemon_state, has_field, mapping_of as _mapping_of, merge_options, open_mapped as _open_mapped,
                      pick_medium as _pick_medium, reason, setup_timeout, wait_ended)
from ._connect import Reconnects, connect, lost_connection as _lost_connection
from ._removals import OffloadingRemovals, parse_media

# A child of vLLM's "vllm" logger: vLLM configures only that logger (and
# stops it propagating), so messages logged here appear in vLLM's own output.
log = logging.getLogger("vllm.kvhost")

_OWN_KEYS = {
    "socket": None,
    "namespace": "",
    "staging_bytes": 256 << 20,
    "threads": 4,
    "zero_copy": "auto",
    "lookup_ttl_s": 1.0,
    "lookup_wait_s": 0.0,
    "job_timeout_s": 60.0,
    "medium": None,
    "client_name": "vllm-tier",
    "max_events": 1 << 16,  # keys of stored events queued between two take_events calls
    "max_tracked_keys": 1 << 18,  # keys announced stored whose removal is reported (docs/routers.md)
    "mount_media": None,  # {daemon mount index: vLLM Medium name}: a move between media is reported
    "vllm_fs": False,
    "reconnect_s": 1.0,
    "request_timeout_s": 30.0,
    "daemon_wait_s": DAEMON_WAIT_S,  # the longest any vLLM call (start, drain_jobs, shutdown) waits on the daemon
    "page_layout": None,   # the GPU workers' page byte order (_namespace.page_layout), where not the default's
    "cp_kv_cache_interleave_size": None,  # with context parallelism: the engine's interleave (_cp_interleave)
}
# Keys vLLM's factory passes to every tier beside the tier's own ones:
# "type" and "module_path" (older factories), "locality" (LOCAL or REMOTE,
# honoured), "backpressure_detector" (handed to vLLM's base class where it
# takes one) and "backpressure" (a factory that does not build the
# detector itself passes the raw entry; unused). Constructor parameters,
# not options: see _TierImpl.__init__.
_IGNORED_KEYS = {"type", "module_path", "backpressure"}

# The model id prefix of a namespace that a daemon's vllm-fs mount serves
# by its fs-tier directory name (the "vllm_fs" option).
_VLLM_FS_PREFIX = "vllm-fs:"

_UNITS = {"": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40,
          "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12}


def _size(name, v):
    if isinstance(v, bool):
        raise ValueError(f"kvhost.vllm: {name}: want a size, got {v!r}")
    if isinstance(v, int):
        return v
    s = str(v).strip()
    num = s.rstrip("".join(sorted({c for u in _UNITS for c in u})))
    unit = s[len(num):].strip()
    if unit not in _UNITS:
        raise ValueError(f"kvhost.vllm: {name}: unknown unit in {v!r} (want e.g. 256MiB)")
    try:
        return int(float(num) * _UNITS[unit])
    except ValueError as e:
        raise ValueError(f"kvhost.vllm: {name}: not a size: {v!r}") from e


def _options(own):
    o = merge_options(own, _OWN_KEYS, _IGNORED_KEYS, "tier")
    o["socket"] = o["socket"] or default_socket()
    o["staging_bytes"] = _size("staging_bytes", o["staging_bytes"])
    zc = o["zero_copy"]
    o["zero_copy"] = {True: "on", False: "off"}.get(zc, zc) if isinstance(zc, bool) else str(zc)
    if o["zero_copy"] not in ("off", "auto", "on"):
        raise ValueError(f"kvhost.vllm: zero_copy: want off, auto or on, got {zc!r}")
    if not isinstance(o["vllm_fs"], bool):
        raise ValueError(f"kvhost.vllm: vllm_fs: want true or false, got {o['vllm_fs']!r}")
    if o["vllm_fs"] and o["namespace"]:
        # The fs tier's directory is the whole identity there: a namespace
        # could not keep tenants apart, and must not seem to.
        raise ValueError(f"kvhost.vllm: namespace {o['namespace']!r} with vllm_fs: the rows of vLLM's fs-tier "
                         f"directory are shared by every engine of the model that reads it; give each tenant "
                         f"its own directory (the fs tier's root) instead, or leave vllm_fs out")
    if o["vllm_fs"] and o["page_layout"] is not None:
        # vLLM's fs-tier directory does not name the page layout either.
        raise ValueError(f"kvhost.vllm: page_layout {o['page_layout']!r} with vllm_fs: vLLM's fs-tier directory "
                         f"is named without the page layout, so it cannot keep engines of another layout apart; "
                         f"give them another fs-tier root instead, or leave vllm_fs out")
    for k in ("threads", "max_events", "max_tracked_keys"):
        if not isinstance(o[k], int) or isinstance(o[k], bool) or o[k] < 1:
            raise ValueError(f"kvhost.vllm: {k}: want an integer >= 1, got {o[k]!r}")
    check_seconds(o, ("lookup_ttl_s", "lookup_wait_s", "job_timeout_s", "reconnect_s"))
    check_request_timeout(o)
    check_daemon_wait(o)
    parse_media(o["mount_media"])  # its form; the names are checked against vLLM's Medium at start
    return o


class _Session:
    """One connection to the daemon and what the tier holds on it: the
    namespace declared, the memory registered and the cache over it. A
    reconnection builds a new one and swaps it in whole."""

    __slots__ = ("client", "ns", "region", "cache", "staged")

    def __init__(self, client):
        self.client, self.ns, self.region, self.cache = client, None, None, None
        self.staged = False  # the cache is over the staging memfd (copy path), not vLLM's region

    def unregister(self):
        """Unregisters the cache and the memory it holds (where the
        connection still works)."""
        for fn, arg in ((self.client.unregister_cache, self.cache), (self.client.unregister_memory, self.region)):
            if arg is not None:
                try:
                    fn(arg)
                except Exception as e:  # the connection's end releases them anyway
                    log.debug("kvhost tier: unregister: %s", e)
        self.cache = self.region = None


class _Run:
    """A job vLLM submitted, from submit_* until its thread has ended it.
    started: its thread is past the point where it may touch vLLM's rows
    or the daemon (False: still queued). zero_copy: the daemon moves vLLM's
    rows themselves (not staging slots). given_up: drain_jobs reported it
    to vLLM (failed) before the daemon ended it; its thread ends it
    without reporting it again, and sends no more of it."""

    __slots__ = ("job_id", "keys", "rows", "load", "started", "zero_copy", "given_up")

    def __init__(self, job_id, keys, rows, load):
        self.job_id, self.keys, self.rows, self.load = job_id, keys, rows, load
        self.started = self.zero_copy = self.given_up = False


class _HeldRows:
    """vLLM's primary rows that jobs drain_jobs gave up on may still have
    the daemon read or write (zero-copy), kept out of vLLM's reuse until
    the daemon ends those jobs; one per primary tier, shared by every
    kvhost tier over it (of()).

    vLLM's TieringOffloadingManager.reset_cache, the one caller of
    drain_jobs, reports every job finished and then clears its primary
    tier (CPUOffloadingManager.reset_cache: every row free). Right after
    that clear (the wrapper of()'s hook puts around the primary's
    reset_cache), the rows still held are allocated through the primary
    tier's own prepare_store, under keys of kvhost's that no lookup asks
    for: a cleared primary hands out rows 0, 1, 2, ... in order, so the
    rows up to the highest held one are taken, and those not held are
    given back at once (complete_store, failed). A held row stays a store
    in flight in vLLM's books (ref_cnt -1: never evicted, never handed
    out) until release() gives it back, on the scheduler's thread
    (get_finished_jobs), once the daemon ended its jobs. Every call on
    vLLM's manager happens on the scheduler's thread; the tiers' job
    threads only change the counts here, under this object's lock."""

    def __init__(self, primary):
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self.count = collections.Counter()  # row -> given-up jobs still running on it
        self.pinned = {}                    # row -> the key it is allocated under in vLLM's primary tier
        self.freed = []                     # keys of rows no job holds any more, to give back
        self.primary = primary
        self.resets = 0                     # primary resets seen (names the keys of each)
        reset = primary.reset_cache

        def reset_cache(*args, **kwargs):
            reset(*args, **kwargs)
            self.after_reset()
        primary.reset_cache = reset_cache

    @classmethod
    def of(cls, spec, view):
        """The held rows of vLLM's primary tier (CPUPrimaryTierOffloadingManager)
        over view, reached through the spec that built the tier (its
        manager's primary_tier); made and hooked on first use. None where
        this vLLM has no such primary, or one without the calls needed."""
        m = getattr(getattr(spec, "_manager", None), "primary_tier", None)
        get_view = getattr(m, "get_kv_memoryview", None)
        if get_view is None or not all(callable(getattr(m, n, None))
                                       for n in ("reset_cache", "prepare_store", "complete_store")):
            return None
        try:
            if get_view() is not view:
                return None
        except Exception:  # noqa: BLE001 - an unknown primary is none to hook
            return None
        held = getattr(m, "_kvhost_held_rows", None)
        if held is None:
            held = m._kvhost_held_rows = cls(m)
        return held

    def hold(self, rows):
        """rows (vLLM's) are a given-up job's, which the daemon may still touch."""
        with self._lock:
            self.count.update(rows)

    def end(self, rows):
        """rows' given-up job ended: a row no other one holds is given back."""
        with self._cv:
            for r in rows:
                self.count[r] -= 1
                if self.count[r] <= 0:
                    del self.count[r]
                    k = self.pinned.pop(r, None)
                    if k is not None:
                        self.freed.append(k)
            self._cv.notify_all()

    def after_reset(self):
        """Right after the primary's clear: allocates the rows still held.
        Where the primary did not hand out every one of them (one that
        allocates otherwise), waits for the jobs still on them before vLLM
        goes on (the unbounded wait of before, logged)."""
        primary = self.primary
        with self._lock:
            self.pinned.clear()  # the clear dropped them
            self.freed = []
            rows = set(self.count)
            self.resets += 1
            gen = self.resets
        if not rows:
            return
        keys = [b"\xffkvhost-held-row:%d:%d" % (gen, i) for i in range(max(rows) + 1)]
        out = primary.prepare_store(keys, None)
        got = {} if out is None else dict(zip((int(b) for b in out.store_spec.block_ids), out.keys_to_store))
        with self._lock:
            keep = {r: got[r] for r in self.count if r in got}
            self.pinned.update(keep)
            missing = set(self.count) - set(keep)
        give = [k for r, k in got.items() if r not in keep]
        if give:
            primary.complete_store(give, None, False)
        if missing:
            log.error("kvhost tier: vLLM's primary tier did not hand out rows %s after its reset; waiting for "
                      "the daemon to end the jobs on them before vLLM reuses them", sorted(missing)[:8])
            with self._cv:
                while set(self.count) & missing:
                    self._cv.wait()
        log.warning("kvhost tier: %d rows of vLLM's CPU region held out of reuse until the daemon ends the "
                    "jobs given up on them", len(keep))

    def release(self):
        """Gives back to vLLM's primary tier the rows no given-up job holds
        any more (on the scheduler's thread)."""
        with self._lock:
            keys, self.freed = self.freed, []
        if keys:
            self.primary.complete_store(keys, None, False)


def _cp_interleave(config, o):
    """The context-parallel KV interleave the identity names: None without
    context parallelism (dcp and pcp sizes 1: a page holds its block's
    tokens in order); with it, the cp_kv_cache_interleave_size option. A
    rank's page then holds every dcp×pcp-th run of interleave tokens, and
    vLLM's offloading config does not carry the interleave, while the tier
    runs in the scheduler, which cannot read the engine's: without the
    option the rows' meaning is unknown, and the tier refuses to start."""
    dcp, pcp = _namespace.cp_sizes(config)
    n = o["cp_kv_cache_interleave_size"]
    if dcp * pcp == 1:
        return None
    if n is None:
        raise ValueError(
            f"kvhost.vllm: this engine runs context parallelism (dcp {dcp}, pcp {pcp}): which tokens a row holds "
            f"follows vLLM's --cp-kv-cache-interleave-size, which the tier cannot read from the scheduler; set "
            f"the tier's cp_kv_cache_interleave_size to the engine's value (1 unless it was set)")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"kvhost.vllm: cp_kv_cache_interleave_size: want an integer >= 1, got {n!r}")
    if o["vllm_fs"] and n != 1:
        raise ValueError(
            f"kvhost.vllm: cp_kv_cache_interleave_size {n} with vllm_fs: vLLM's fs-tier directory is named "
            f"without the interleave, so it cannot keep engines of another interleave apart; give them another "
            f"fs-tier root instead, or leave vllm_fs out")
    return n


def _tier_label(spec, tier_type, own, locality):
    """This tier's value of the "tier" label: vLLM's own label for it,
    "N:type" with N its place among the spec's secondary tiers (vLLM's
    TieringMetrics.tier_label), so that kvhost's counters join vLLM's for
    the same tier and two tiers of one type keep apart. The tier type alone
    where the spec does not list its tiers (vLLM's OffloadingSpec outside
    tiering, stand-ins)."""
    configs = getattr(spec, "secondary_tier_configs", None)
    if not isinstance(configs, (list, tuple)):
        return tier_type
    given = dict(own)
    if locality is not None:
        given["locality"] = locality
    try:  # two entries alike: the second built takes the second place
        taken = spec._kvhost_tier_places
    except AttributeError:
        taken = set()
        try:
            spec._kvhost_tier_places = taken
        except (AttributeError, TypeError):
            pass
    for i, cfg in enumerate(configs):
        if not isinstance(cfg, dict) or cfg.get("type") != tier_type or i in taken:
            continue
        rest = {k: v for k, v in cfg.items() if k not in ("type", "module_path", "backpressure_detector")}
        if rest == given:
            taken.add(i)
            return f"{i + 1}:{tier_type}"
    return tier_type


class _TierImpl(Reconnects):
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
        self._label = _tier_label(offloading_spec, tier_type, own, locality)
        self.locality = _compat.locality(api, locality)
        # Events carry it, as vLLM's own tiers' do (its KV events publish it).
        self._event_fields = {"locality": self.locality} if has_field(api.OffloadingEvent, "locality") else {}
        self._spec = offloading_spec
        o = self._opts = _options(own)
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
        interleave = _cp_interleave(_namespace.config_of(offloading_spec), o)
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
        # more (what vllm_fs requires: _options, _cp_interleave). None:
        # no directory is this tier's own.
        own_dir = not o["namespace"] and o["page_layout"] is None and interleave in (None, 1)
        self._fs_dir = f"{self.fs_base}_r0" if own_dir else None
        geom = _namespace.geometry(self._desc, _namespace.fs_namespace(_VLLM_FS_PREFIX, self.fs_base)
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

    def _adopt_region(self, np, view):
        """Reads the row geometry of vLLM's region (a (num_blocks,
        row_stride) memoryview) and keeps a uint8 array over it."""
        arr = np.asarray(view)
        if arr.ndim != 2:
            raise ValueError(f"kvhost.vllm: primary_kv_view has shape {arr.shape}: want (num_blocks, row_stride)")
        if arr.strides[1] != arr.itemsize:
            raise ValueError("kvhost.vllm: primary_kv_view rows are not contiguous")
        self._row_bytes = arr.shape[1] * arr.itemsize
        self._row_stride = arr.strides[0]
        self._num_rows = arr.shape[0]
        self._view = view
        self._primary = arr.view(np.uint8) if arr.dtype != np.uint8 else arr

    def _setup_data_path(self, s):
        mode = self._opts["zero_copy"]
        if mode != "off":
            try:
                self._register_primary(s)
                return "zero-copy"
            except (OSError, KvhostError, ValueError) as e:
                if isinstance(e, TimeoutError) or not s.client.connected():
                    raise  # not a refusal: the daemon did not answer
                self._zero_copy_error = str(e)
                if mode == "on":
                    raise RuntimeError(f"kvhost.vllm: zero_copy=on: cannot register vLLM's CPU region with "
                                       f"the daemon: {e}") from e
                log.warning("kvhost tier: zero-copy unavailable (%s); copying through a kvhost memfd", e)
                s.unregister()  # a region registered before its cache was refused
        if self._staging is None:  # else made by a try that failed after it (no daemon at start)
            self._setup_staging()
        self._register_staging(s)
        return "copy"

    def _register_primary_again(self, s):
        """vLLM's region on a new daemon, which may refuse it (a lower
        max_registered_bytes, say): with zero_copy = "auto" the tier then
        copies through its own memfd, as it would have at start; with "on"
        the refusal is raised and the tier keeps trying."""
        try:
            self._register_primary(s)
        except (KvhostError, ValueError, OSError) as e:
            # Refused, or the region cannot be opened here any more; a late
            # answer or a lost connection is tried again.
            if self._opts["zero_copy"] == "on" or isinstance(e, TimeoutError) or not s.client.connected():
                raise
            self._zero_copy_error = str(e)
            log.warning("kvhost tier: the new daemon refuses vLLM's region (%s); copying through a kvhost "
                        "memfd", e)
            s.unregister()
            if self._staging is None:
                self._setup_staging()
            self._register_staging(s)

    def _register_primary(self, s):
        """Registers the memory behind primary_kv_view with the daemon: the
        file the mapping comes from (vLLM's /dev/shm region) or, for a memfd,
        the mapping itself through /proc/self/map_files."""
        addr = self._primary.ctypes.data
        length = (self._num_rows - 1) * self._row_stride + self._row_bytes
        m = _mapping_of(addr, length)
        if m is None:
            raise ValueError("primary_kv_view is not one file mapping")
        lo, hi, off, path = m
        fd = _open_mapped(lo, hi, path)
        try:
            file_off = off + (addr - lo)
            size = file_off + length
            if os.fstat(fd).st_size < size:
                raise ValueError(f"{path or 'the region'} holds {os.fstat(fd).st_size} bytes, want {size}")
            s.region = self._register_fd(s.client, fd, size)
        finally:
            os.close(fd)
        s.cache = s.client.register_cache(s.ns, [Layer(
            s.region, offset=file_off, block_stride=self._row_stride, plane_stride=0,
            num_blocks=self._num_rows)])

    @staticmethod
    def _register_fd(client, fd, size):
        try:
            sealed = fcntl.fcntl(fd, getattr(fcntl, "F_GET_SEALS", 1034)) & getattr(fcntl, "F_SEAL_SHRINK", 2)
        except OSError:
            sealed = 0
        if sealed:
            return client.register_memfd(fd, size)
        # A plain shared-memory file cannot be sealed: register it unsealed
        # (a daemon that cannot guard its copies answers unsupported).
        return client.register_shared_file(fd, size)

    def _setup_staging(self):
        o = self._opts
        threads = o["threads"]
        per = max(1, min(p.MAX_KEYS_PER_REQUEST, o["staging_bytes"] // self._row_bytes // threads))
        slots = per * threads
        self._staging = HostBuffer(slots * self._row_bytes, name="kvhost-vllm-staging")
        self._staging_rows = self._np.frombuffer(self._staging.mmap, dtype=self._np.uint8).reshape(
            slots, self._row_bytes)
        self._slot_ranges = queue.SimpleQueue()
        for i in range(threads):
            self._slot_ranges.put((i * per, per))

    def _register_staging(self, s):
        """Registers the staging memfd on s and a cache of its rows."""
        s.region = s.client.register_buffer(self._staging)
        s.cache = s.client.register_cache(s.ns, [Layer(
            s.region, offset=0, block_stride=self._row_bytes, plane_stride=0,
            num_blocks=len(self._staging_rows))])
        s.staged = True

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

    # -- jobs ------------------------------------------------------------------

    def submit_store(self, job):
        """Starts storing job.keys from primary rows job.block_ids (cascade)."""
        self._submit(job, load=False)

    def submit_load(self, job):
        """Starts loading job.keys into primary rows job.block_ids (promotion)."""
        self._submit(job, load=True)

    def _submit(self, job, load):
        keys = [bytes(k) for k in job.keys]
        ids = getattr(job, "block_ids", None)
        if ids is None:  # renamed chunk_ids in later vLLM (a row is one chunk)
            ids = job.chunk_ids
        rows = [int(b) for b in ids]
        if len(rows) != len(keys):
            raise ValueError(f"kvhost.vllm: job {job.job_id}: {len(keys)} keys, {len(rows)} block ids")
        bad = [b for b in rows if not 0 <= b < self._num_rows]
        if bad:
            raise ValueError(f"kvhost.vllm: job {job.job_id}: block id {bad[0]} outside the primary "
                             f"region's {self._num_rows} rows")
        run = _Run(job.job_id, keys, rows, load)
        with self._cv:
            if self._closing:
                raise RuntimeError("kvhost.vllm: the tier is shut down")
            self._inflight += 1
            self._runs[job.job_id] = run
            self._stats["load_jobs" if load else "store_jobs"] += 1
            if not load:
                self._storing.update(keys)
        self._pool.submit(self._run, run)

    def _run(self, run):
        t0 = time.monotonic()
        keys, load = run.keys, run.load
        outcomes = [p.OUTCOME_FAILED] * len(keys)
        with self._lock:
            s, down = self._s, self._broken
            over = self._give_up_at is not None and time.monotonic() >= self._give_up_at
            if run.given_up:  # reported by drain_jobs before it began: nothing touched
                self._runs.pop(run.job_id, None)
                self._cv.notify_all()
                return
            run.started = True
            run.zero_copy = s is not None and not s.staged
        if down is None and not over:  # else no daemon, or shutdown gave up: the job fails at once
            try:
                self._move(s, run, outcomes)
            except Exception as e:
                with self._lock:
                    self._stats["job_errors"] += 1
                if _lost_connection(e, s.client):
                    self._lost(s, e)
                elif not run.given_up:
                    log.warning("kvhost tier: %s job %d failed: %s", "load" if load else "store", run.job_id, e)
        self._finish(run, outcomes, time.monotonic() - t0, s)

    def _move(self, s, run, outcomes):
        """Moves the job's rows on session s, filling outcomes. A job
        drain_jobs gave up on sends no more daemon jobs."""
        keys, rows, load = run.keys, run.rows, run.load
        if not s.staged:
            for i in range(0, len(keys), p.MAX_KEYS_PER_REQUEST):
                if run.given_up:
                    return
                sl = slice(i, i + p.MAX_KEYS_PER_REQUEST)
                outcomes[sl] = self._transfer(s, keys[sl], rows[sl], load)
            return
        got = self._slot_ranges.get()
        if got is None:  # the tier gave up on a job at shutdown (below): pass it on, fail
            self._slot_ranges.put(None)
            raise TimeoutError("the tier is shutting down with daemon jobs not ended")
        base, per = got
        free = got  # the job ended (done, refused, connection closed): its slots are free
        try:
            for i in range(0, len(keys), per):
                if run.given_up:
                    return
                sl = slice(i, i + per)
                outcomes[sl] = self._staged(s, run, keys[sl], rows[sl], base)
        except TimeoutError:
            # Given up at shutdown: the daemon may still write these slots,
            # so no later job gets them; the jobs waiting for slots fail.
            free = None
            raise
        finally:
            self._slot_ranges.put(free)

    def _transfer(self, s, keys, blocks, load):
        dk = [_daemon_key(k) for k in keys]
        bl = [[b] for b in blocks]
        # Not waiting for the acceptance: a request the daemon has not
        # answered may still run, so only the job's end frees its rows.
        fn = s.client.load if load else s.client.store
        job = fn(s.cache, dk, bl, block=False)
        return [o for o, _ in self._wait(job).keys]

    def _wait(self, job):
        """The job's result, once the daemon has ended it (wait_ended): its
        rows (vLLM's, or the staging slots) are used again after this. Only
        once the tier's shutdown has waited job_timeout_s does a job not
        done fail (TimeoutError; the memory goes with vLLM, and no staging
        slot it held is used again)."""
        return wait_ended(job, self._opts["job_timeout_s"] or None, lambda: self._give_up_at, "tier")

    def _staged(self, session, run, keys, rows, base):
        """One batch of run through the staging slots from base: the copies
        between vLLM's rows and the slots are made under the tier's lock,
        and not once drain_jobs gave the job up (vLLM may reuse its rows
        from then on; the daemon only touches the slots, which no other
        job gets before it ends the job)."""
        np, load = self._np, run.load
        st, pr = self._staging_rows, self._primary
        slots = list(range(base, base + len(keys)))
        if not load:
            with self._lock:
                if run.given_up:
                    return [p.OUTCOME_FAILED] * len(keys)
                for s, r in zip(slots, rows):
                    np.copyto(st[s], pr[r])
        out = self._transfer(session, keys, slots, load)
        if load:
            with self._lock:
                if run.given_up:
                    return [p.OUTCOME_FAILED] * len(keys)
                for s, r, o in zip(slots, rows, out):
                    if o == p.OUTCOME_LOADED:
                        np.copyto(pr[r], st[s])
        return out

    def _finish(self, run, outcomes, seconds, session):
        """Reports the job (get_finished_jobs, events, counters). The keys
        it stored answer HIT for lookup_ttl_s where session, the
        connection it ran on, is still the one in use: stored on a daemon
        since replaced, they are asked of the new one. A job drain_jobs
        gave up on was reported then: its end only gives back the rows
        held for it."""
        job_id, keys, load = run.job_id, run.keys, run.load
        api = self._api
        now = time.monotonic()
        expiry = now + self._opts["lookup_ttl_s"]
        ok_out = (p.OUTCOME_LOADED,) if load else (p.OUTCOME_STORED, p.OUTCOME_PRESENT)
        fine = ok_out if load else ok_out + (p.OUTCOME_NOT_ADMITTED,)
        good = [k for k, o in zip(keys, outcomes) if o in ok_out]
        success = all(o in fine for o in outcomes)
        # A load reports the keys it found gone, a store those it stored.
        changed = p.OUTCOME_MISSING if load else p.OUTCOME_STORED
        ks = [k for k, o in zip(keys, outcomes) if o == changed]
        result = api.JobResult(job_id=job_id, success=success, successful_keys=good)
        if hasattr(result, "transfer_time"):
            result.transfer_time = seconds
        c = collections.Counter(outcomes)
        with self._cv:
            s = self._stats
            if run.given_up:  # reported by drain_jobs; the rows held for it go back
                self._runs.pop(job_id, None)
                if run.zero_copy:
                    self._held.end(run.rows)
                s["given_up_jobs_ended"] += 1
                self._cv.notify_all()
                return
            if load:
                s["load_keys"] += len(keys)
                s["loaded_keys"] += c[p.OUTCOME_LOADED]
                s["load_missing_keys"] += c[p.OUTCOME_MISSING]
                s["load_failed_keys"] += len(keys) - c[p.OUTCOME_LOADED] - c[p.OUTCOME_MISSING]
                s["bytes_loaded"] += c[p.OUTCOME_LOADED] * self._row_bytes
                for k, o in zip(keys, outcomes):
                    if o != p.OUTCOME_LOADED:
                        self._answers[k] = (False, expiry)
            else:
                self._storing.subtract(keys)
                for k in keys:
                    if self._storing[k] <= 0:
                        del self._storing[k]
                s["store_keys"] += len(keys)
                s["stored_keys"] += c[p.OUTCOME_STORED]
                s["present_keys"] += c[p.OUTCOME_PRESENT]
                s["not_admitted_keys"] += c[p.OUTCOME_NOT_ADMITTED]
                s["store_failed_keys"] += len(keys) - sum(c[o] for o in fine)
                s["bytes_stored"] += c[p.OUTCOME_STORED] * self._row_bytes
                if session is self._s:
                    for k in good:
                        self._answers[k] = (True, expiry)
            if not success:
                s["failed_load_jobs" if load else "failed_store_jobs"] += 1
            self._finished.append(result)
            self._runs.pop(job_id, None)
            self._inflight -= 1
            self._cv.notify_all()
        if ks:  # a removal only of what a stored event announced (docs/routers.md)
            (self._removals.gone if load else self._removals.stored)(ks)

    def get_finished_jobs(self):
        """Jobs completed since the last call (JobResult with successful_keys).
        Gives back to vLLM the rows held for given-up jobs the daemon has
        ended since."""
        held = self._held
        if held is not None:
            held.release()
        with self._lock:
            out, self._finished = self._finished, []
        return out

    def drain_jobs(self):
        """Waits until every submitted job has completed, daemon_wait_s at
        most. A job the daemon has not ended by then is given up: reported
        failed (a store's keys are not stored, a promotion's rows are not
        loaded), its thread sends no more of it, and what the daemon may
        still touch is kept from vLLM's reuse until the daemon ends it or
        its connection ends (the daemon closes one only after ending its
        jobs, or dying): staging slots by the tier, vLLM's rows (zero-copy)
        as _HeldRows says. Where vLLM's primary tier cannot be reached to
        hold them, it waits as long as the daemon takes (logged)."""
        bound = self._opts["daemon_wait_s"]
        t0 = time.monotonic()
        with self._cv:
            while self._inflight and (left := t0 + bound - time.monotonic()) > 0:
                self._cv.wait(left)
            if not self._inflight:
                return
            runs = [r for r in self._runs.values() if not r.given_up]
            if any(r.started and r.zero_copy for r in runs):
                if self._held is None:
                    self._held = _HeldRows.of(self._spec, self._view)
                if self._held is None:
                    log.error("kvhost tier: %d jobs not ended by the daemon after %gs, and vLLM's primary tier "
                              "cannot be reached to keep their rows from reuse: waiting for the daemon",
                              len(runs), bound)
                    while self._inflight:
                        self._cv.wait()
                    return
            held, s = 0, self._s
            for r in runs:
                r.given_up = True
                if r.started and r.zero_copy:
                    self._held.hold(r.rows)
                    held += len(r.rows)
                self._give_up_locked(r)
            self._cv.notify_all()
        log.warning("kvhost tier: drain_jobs gave up after %gs on %d jobs the daemon has not ended (%s; %d of "
                    "vLLM's rows held out of reuse until it does); reported failed", bound, len(runs),
                    daemon_state(s.client) if s is not None else "no connection", held)

    def _give_up_locked(self, run):
        """Reports run to vLLM as failed, now (drain_jobs)."""
        result = self._api.JobResult(job_id=run.job_id, success=False, successful_keys=[])
        if hasattr(result, "transfer_time"):
            result.transfer_time = 0.0
        s = self._stats
        s["given_up_jobs"] += 1
        s["failed_load_jobs" if run.load else "failed_store_jobs"] += 1
        if run.load:
            s["load_keys"] += len(run.keys)
            s["load_failed_keys"] += len(run.keys)
        else:
            self._storing.subtract(run.keys)
            for k in run.keys:
                if self._storing[k] <= 0:
                    del self._storing[k]
            s["store_keys"] += len(run.keys)
            s["store_failed_keys"] += len(run.keys)
        self._finished.append(result)
        self._inflight -= 1

    def has_pending_work(self):
        """True while jobs run, results wait to be collected or lookups are pending."""
        with self._lock:
            return bool(self._inflight or self._finished or self._pending_lookups)

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
