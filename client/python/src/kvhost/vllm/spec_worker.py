"""The GPU-worker side of KvhostOffloadingSpec (vLLM's offloading worker).

The worker registers its CanonicalKVCaches tensors with the daemon — CUDA
tensors by CUDA IPC, host tensors by the shared-memory file behind them —
declares one namespace per KV-cache group at its shard (one plane per
layer whose block is exactly one page) and registers one daemon cache per
group. Transfers become daemon jobs: a key's blocks are its chunk's GPU
blocks in that group, and the daemon moves every layer's page of each.
"""

import collections
import logging
import threading
import time

from .. import protocol as p
from ..client import KvhostError, Layer
from . import _namespace, spec_compat as sc
from ._common import vllm_installed
from ._connect import Reconnects, client_of, connect
from ._namespace import IdentityUnknown
from ._regions import host_mapping, region_of
from ._spec_transfers import SpecTransfers, _stream_fence

log = logging.getLogger("vllm.kvhost")


def _refs_of(kv_caches, ngroups):
    """Per group: [(tensor index, page bytes)] from CanonicalKVCaches'
    group_data_refs (CanonicalKVCacheRef, or (index, bytes) pairs)."""
    refs = getattr(kv_caches, "group_data_refs", None)
    if refs is None:
        raise ValueError("kvhost.vllm: the worker's KV caches have no group_data_refs (want vLLM's "
                         "CanonicalKVCaches)")
    out = []
    for g in refs:
        out.append([(int(r[0]), int(r[1])) if isinstance(r, (tuple, list)) else
                    (int(getattr(r, "tensor_idx")), int(getattr(r, "page_size_bytes"))) for r in g])
    if len(out) != ngroups:
        raise ValueError(f"kvhost.vllm: the worker has {len(out)} KV-cache groups, vLLM's offloading "
                         f"config {ngroups}")
    return out


def observe_layout(groups):
    """What vLLM set this worker up with: (per KV-cache group, the names
    of its layers' attention backends; the KV cache layout, "NHD" or
    "HND"), read from vLLM's current config (vLLM builds the worker under
    it: its compilation_config.static_forward_context maps each layer name
    to the layer, whose get_attn_backend() names the backend) and from
    get_kv_cache_layout() (a backend's required layout, else
    VLLM_KV_CACHE_LAYOUT, else the connector's). None where no vLLM is
    installed: the caller (kvhost's tools and tests) hands pages of its
    own. IdentityUnknown where vLLM is there and cannot say: the worker
    does not know its pages' byte order."""
    if not vllm_installed():
        return None

    def unknown(why):
        return IdentityUnknown(
            f"kvhost.vllm: cannot tell this worker's attention backend and KV cache layout ({why}); "
            "refusing to share KV whose byte order is unknown (docs/vllm.md, supported versions)")
    try:
        from vllm.config import get_current_vllm_config_or_none
        from vllm.v1.attention.backends.utils import get_kv_cache_layout
    except Exception as e:  # a vLLM that keeps them elsewhere
        raise unknown(f"vLLM's get_current_vllm_config_or_none / get_kv_cache_layout: {e!r}") from e
    vc = get_current_vllm_config_or_none()
    if vc is None:
        raise unknown("no current vLLM config: get_worker was not called by vLLM's worker set-up")
    ctx = _namespace.attr(vc, "compilation_config.static_forward_context")
    if not hasattr(ctx, "get"):
        raise unknown("vLLM's config has no compilation_config.static_forward_context")
    backends = []
    for g, grp in enumerate(groups):
        names = []
        for name in grp["layer_names"]:
            get = getattr(ctx.get(name), "get_attn_backend", None)
            try:
                got = get().get_name() if get is not None else None
            except Exception as e:  # noqa: BLE001 (named below)
                got = repr(e)
            if not isinstance(got, str) or not _namespace.PAGE_LAYOUT_RE.fullmatch(f"{got}/NHD"):
                raise unknown(f"layer {name} of KV-cache group {g}: attention backend {got!r}")
            names.append(got)
        backends.append(names)
    layout = get_kv_cache_layout()
    if layout not in _namespace.LAYOUTS:
        raise unknown(f"get_kv_cache_layout() is {layout!r}")
    return backends, layout


def check_cp_interleave(config):
    """The KV cache interleave of this worker's context-parallel ranks
    (vLLM's parallel_config.cp_kv_cache_interleave_size), None where no
    context parallelism is on (dcp and pcp sizes 1: no interleave) or no
    vLLM is installed. With decode or prefill context parallelism a rank's
    page holds every dcp×pcp-th run of interleave tokens of its block, so
    the interleave changes the page's bytes, and vLLM's offloading config
    does not carry it: the scheduler names the namespace without it. So the
    identity stands for vLLM's default, 1, and any other is refused (a
    ValueError); IdentityUnknown where vLLM is there and cannot say."""
    dcp, pcp = _namespace.cp_sizes(config)
    if dcp * pcp == 1 or not vllm_installed():
        return None

    def unknown(why):
        return IdentityUnknown(
            f"kvhost.vllm: cannot tell this worker's context-parallel KV interleave ({why}); with context "
            f"parallelism (dcp {dcp}, pcp {pcp}) it decides which tokens a page holds: refusing to share KV "
            "whose meaning is unknown (docs/vllm.md, supported versions)")
    try:
        from vllm.config import get_current_vllm_config_or_none
    except Exception as e:  # a vLLM that keeps it elsewhere
        raise unknown(f"vLLM's get_current_vllm_config_or_none: {e!r}") from e
    vc = get_current_vllm_config_or_none()
    if vc is None:
        raise unknown("no current vLLM config: get_worker was not called by vLLM's worker set-up")
    n = _namespace.attr(vc, "parallel_config.cp_kv_cache_interleave_size")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise unknown(f"parallel_config.cp_kv_cache_interleave_size is {n!r}")
    if n != 1:
        raise ValueError(
            f"kvhost.vllm: this engine runs context parallelism (dcp {dcp}, pcp {pcp}) with "
            f"cp_kv_cache_interleave_size {n}: which tokens a rank's page holds follows the interleave, and "
            "vLLM's offloading config does not carry it, so engines of another interleave would share these "
            "keys; kvhost's namespace stands for interleave 1, refusing to start (run with "
            "--cp-kv-cache-interleave-size 1)")
    return n


class SpecWorker(SpecTransfers, Reconnects):
    """Moves blocks between this worker's KV-cache tensors and the daemon.

    Every layer of every group moves page_bytes per GPU block — the page
    size the scheduler's manager declared too (from the config, or the
    spec option page_bytes). The worker checks each layer's real page
    against it and refuses to start when they differ: a namespace whose
    pages mean something else than the scheduler's would hand wrong KV."""

    def __init__(self, config, kv_caches, api=None, opts=None, ident=None):
        self._api = api or sc.SPEC_FALLBACK
        self._opts = o = opts or sc.options(config)
        self._ident = ident or sc.identity(config, o)
        self._bpc = sc.chunk_blocks(self._ident)
        self._group = sc.engine_group(config)  # the daemon Group the manager's pins name
        page = self._ident["page_bytes"]
        entries = list(getattr(kv_caches, "tensors", None) or [])
        if not entries:
            raise ValueError("kvhost.vllm: the worker got no KV-cache tensors")
        tensors = [getattr(t, "tensor", t) for t in entries]
        padded = [getattr(t, "page_size_bytes", None) for t in entries]
        groups = sc.groups(self._ident)
        refs = _refs_of(kv_caches, len(groups))
        self.rank = _namespace.count(config, "parallel.rank", "worker rank", least=0)
        self._what = f"spec worker {self.rank}"
        self.shard = sc.shard_of(config)
        self._tensors = tensors
        self._fence = _stream_fence(tensors)
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._broken = None          # why the connection is gone (text), until a reconnection
        # The client of a connection whose caches the daemon may count
        # already, not yet in use: from _open's first registration to
        # _swap_locked, or until the connection is dropped or fails. The
        # manager may find the caches and hand out stores meanwhile; _start
        # holds those until then (_await_registration_locked).
        self._registering = None
        self._closing = False
        self._reconnectors = []      # threads connecting again (shutdown joins them)
        self._transfers = {}
        # Jobs waiting for their stream's mark, in submission order:
        # (transfer, gpu spec, kv spec, mark); one thread sends them.
        self._fenced = collections.deque()
        self._sender = None
        self._send_lock = threading.Lock()  # held by the sender thread while it sends (shutdown waits on it)
        self._stats = {k: 0 for k in ("store_jobs", "load_jobs", "store_keys", "stored_keys", "present_keys",
                                      "not_admitted_keys", "store_failed_keys", "store_skipped_keys",
                                      "load_keys", "loaded_keys", "load_failed_keys", "failed_load_jobs",
                                      "bytes_stored", "bytes_loaded", "load_retries", "disconnects",
                                      "reconnects")}
        # Check every layer before talking to the daemon.
        self._layer_planes = [self._planes(g, grp["layer_names"], refs[g], padded, page)
                              for g, grp in enumerate(groups)]
        self._page = page
        self.page_layout = self._check_layout(config, groups, refs, page)
        check_cp_interleave(config)
        for planes in self._layer_planes:
            for ti, off in planes:
                self._check_layer(tensors[ti], page, ti, off)
        # _regions: storage address -> (region id, offset of the storage in
        # the region); _caches: per group, (cache id, num blocks).
        conn, absent = self._connect_at_start()
        self._registering = None  # before any thread: a connection at start is in use at once
        if conn is not None:
            self._client, self._regions, self._caches, self.namespaces = conn
        else:
            # No daemon yet: the worker starts as one that lost it (stores
            # move nothing, a load waits load_retry_s for a connection) and
            # a thread connects once one answers.
            self._client, self._regions = None, {}
            self._caches = [(None, min(tensors[ti].shape[0] for ti, _ in planes)) for planes in self._layer_planes]
            self.namespaces = [sc.geometry(sc.describe(self._ident, g, self.shard)).model
                               for g in range(len(self._layer_planes))]
            self._start_unconnected(absent)
        log.info("kvhost spec: worker rank %d (shard %d): %d tensors in %d regions, namespaces %s", self.rank,
                 self.shard, len(tensors), len(self._regions), self.namespaces)

    def _check_layout(self, config, groups, refs, page):
        """The page_layout of this worker's pages (None where no vLLM is
        installed); a ValueError where it is not the identity's: the
        scheduler names the namespace from the config, and only the worker
        sees the backend, the layout and the slab it really got."""
        seen = observe_layout(groups)
        if seen is None:
            return None
        backends, layout = seen
        slab = any(len(r) == 1 and len(grp["layer_names"]) > 1 and r[0][1] == len(grp["layer_names"]) * page
                   for grp, r in zip(groups, refs))
        got = _namespace.page_layout_text(backends, layout, slab)
        want = self._ident.get("page_layout")
        if got != want:
            how = ("its page_layout option" if self._opts.get("page_layout") is not None else
                   f"no page_layout option: the default configuration's, {_namespace.DEFAULT_BACKEND} with "
                   f"{_namespace.LAYOUT_ENV} or the offloading connector's {_namespace.CONNECTOR_LAYOUT}, and "
                   "vLLM's cross-layer slab for one KV-cache group")
            shape = "cut from vLLM's cross-layer slab" if slab else "one tensor per layer"
            names = ", ".join(sorted({n for b in backends for n in b}))
            raise ValueError(
                f"kvhost.vllm: this worker's KV pages are {got} (attention backend {names}, KV cache layout "
                f"{layout}, {shape}) but the "
                f"spec's namespace says {want} ({how}): pages of another byte order must never share keys; "
                f"refusing to start. Set the spec option \"page_layout\": \"{got}\" in "
                "kv_connector_extra_config (on every engine whose workers get these pages)")
        return got

    @staticmethod
    def _planes(g, names, refs, padded, page):
        """The (tensor index, byte offset in its block) of each of group g's
        layers, each moving page bytes per block; a ValueError when the
        worker's pages are not the page size the scheduler declared.

        A layer's ref matches when its page is page bytes, or when it is
        smaller and its tensor's (padded) page is page bytes: the padding
        travels with it. One ref of len(names) pages is vLLM's cross-layer
        layout (one slab per block holding every layer): cut into pages."""
        n = len(names)
        if len(refs) == 1 and n > 1 and refs[0][1] == n * page:
            ti = refs[0][0]
            return [(ti, i * page) for i in range(n)]
        if len(refs) != n:
            raise ValueError(f"kvhost.vllm: KV-cache group {g} has {n} layers in vLLM's offloading config "
                             f"but {len(refs)} tensor references in the worker's CanonicalKVCaches "
                             "(a layout kvhost does not know): refusing to start")
        out = []
        for (ti, got), name in zip(refs, names):
            if not 0 <= ti < len(padded):
                raise ValueError(f"kvhost.vllm: layer {name} of group {g} names tensor {ti} of {len(padded)}")
            if got != page and not (got < page and padded[ti] == page):
                raise ValueError(
                    f"kvhost.vllm: layer {name} of KV-cache group {g} has {got}-byte pages (its tensor "
                    f"{padded[ti]}) but the scheduler's namespace says {page}: the scheduler's and this "
                    "worker's namespaces would differ; refusing to start (set the spec option "
                    "\"page_bytes\" to the layers' page size if vLLM's worker_kv_bytes_per_block does not "
                    "give it)")
            out.append((ti, 0))
        return out

    # -- registration ----------------------------------------------------------

    def _open(self):
        """A connection with every group's namespace declared and its
        tensors registered: (client, regions, caches, namespace models)."""
        o = self._opts
        registering = []  # the client, once its first cache is registered

        def set_up(client):
            regions, caches, names = {}, [], []
            self._join_group(client)
            for g, planes in enumerate(self._layer_planes):
                geo = sc.geometry(sc.describe(self._ident, g, self.shard))
                ns = client.declare(geo)
                _namespace.check_served(ns.fingerprint, geo)  # kvhost mounts only, as the manager's
                names.append(geo.model)
                layers, blocks = [], None
                for ti, off in planes:
                    layers.append(self._layer(client, regions, self._tensors[ti], self._page, ti, off))
                    blocks = layers[-1].num_blocks if blocks is None else min(blocks, layers[-1].num_blocks)
                if not registering:
                    with self._lock:
                        self._registering = client  # the daemon may count this cache from here on
                    registering.append(client)
                caches.append((client.register_cache(ns, layers), blocks))
            return client, regions, caches, names
        try:
            return connect(o, f"{o['client_name']}-worker{self.rank}", set_up)
        except BaseException:
            if registering:  # the connection failed after its first registration: no store waits for it
                self._end_registering(registering[0])
            raise

    def _end_registering(self, client):
        """No store waits any more for client's connection (_registering)."""
        with self._cv:
            if self._registering is client:
                self._registering = None
                self._cv.notify_all()

    def _join_group(self, client):
        """Joins this engine's group (vLLM's engine_id) before registering
        caches: the manager's pins count only its own engine's workers. A
        daemon older than groups pins for any connection's caches, or
        plainly, and is left at that."""
        if not self._group:
            return
        try:
            client.join_group(self._group)
        except KvhostError as e:
            if e.code != p.CODE_UNKNOWN_TYPE:
                raise

    @staticmethod
    def _check_layer(t, page, ti, within=0):
        """Tensor ti's block stride in bytes, once it is known to hold
        contiguous page-byte pages within bytes into each block; else
        ValueError. Also where it is host memory, that it lies in a file
        mapping the daemon can be handed. Needs no daemon: the worker
        checks every layer at start, connected or not."""
        shape, es = tuple(t.shape), t.element_size()
        if len(shape) < 2 or t.stride(0) <= 0:
            raise ValueError(f"kvhost.vllm: tensor {ti} has shape {shape}: want (num_blocks, page bytes...)")
        row = t.stride(0) * es
        inner = es
        for d in shape[1:]:
            inner *= d
        if not t[0].is_contiguous() or inner < within + page or row < within + page:
            raise ValueError(f"kvhost.vllm: tensor {ti} (shape {shape}, strides {t.stride()}) does not hold "
                             f"contiguous {page}-byte pages")
        if not getattr(t, "is_cuda", False):
            st = t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()
            host_mapping(st.data_ptr(), st.nbytes())
        return row

    def _layer(self, client, regions, t, page, ti, within=0):
        row = self._check_layer(t, page, ti, within)
        region, base = region_of(client, regions, t)
        off = base + t.storage_offset() * t.element_size() + within
        return Layer(region, offset=off, block_stride=row, plane_stride=0, num_blocks=t.shape[0])

    def counters(self):
        """The worker's counters since it started, as a dict (no daemon
        round trip): for tests and tools. vLLM collects no statistics from
        an offloading worker; its connector counts transfer sizes and times
        from get_finished's results."""
        with self._lock:
            s = dict(self._stats)
            s["inflight_jobs"] = len(self._transfers)
            s["unsent_jobs"] = len(self._fenced)  # waiting for vLLM's stream to pass their mark
            s["connected"] = self._broken is None
        s["namespaces"] = list(self.namespaces)
        s["rank"] = self.rank
        s["shard"] = self.shard
        return s

    # -- losing the daemon and finding it again (Reconnects) ----------------------

    def _current(self):
        return self._client

    def _swap_locked(self, new):
        """The new connection, with the tensors registered on it anew (CUDA
        IPC imports and regions belong to a connection)."""
        self._client, self._regions, self._caches, self.namespaces = new
        if self._registering is new[0]:
            self._registering = None  # in use (_swap_in notifies _cv)

    def _drop(self, conn):
        """Closes a connection no longer used (the one replaced, or a new
        one not used: shutting down, or another in use); no store waits
        for a new one any more."""
        self._end_registering(client_of(conn))
        super()._drop(conn)

    def shutdown(self):
        """Waits for the jobs in flight (daemon_wait_s in all: the process
        is going, and its memory with it), then closes the connection (the
        daemon drops the registrations). Idempotent."""
        with self._lock:
            ids = list(self._transfers)
        until = time.monotonic() + self._opts["daemon_wait_s"]
        self._wait(ids, until)
        with self._cv:
            self._closing = True
            self._cv.notify_all()
            sender = self._sender
        with self._send_lock:  # a send under way ends first; no other begins
            pass
        self._join_reconnectors(until)
        if sender is not None:
            # It ends once the mark it waits on (if any) is passed; a GPU
            # that never passes it must not hold the process's exit.
            sender.join(max(0.0, until - time.monotonic()))
        with self._lock:
            client = self._client
        if client is not None:  # None: no daemon ever answered
            client.close()
