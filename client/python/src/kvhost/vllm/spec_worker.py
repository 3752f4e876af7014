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
import os
import threading
import time

from .. import protocol as p
from ..client import ConnectionLost, KvhostError, Layer
from . import _namespace, spec_compat as sc
from ._common import mapping_of as _mapping_of, open_mapped as _open_mapped, reason, vllm_installed, wait_ended
from ._connect import Reconnects, connect, lost_connection
from ._namespace import IdentityUnknown

log = logging.getLogger("vllm.kvhost")


class _Transfer:
    """One vLLM job: its daemon jobs and what the result needs. A load
    keeps its specs: when the connection it ran on is lost, it is loaded
    again on the next one, and when the daemon refused it for room, again
    on this one (lost_at: when its first loss or refusal was seen)."""
    __slots__ = ("job_id", "load", "jobs", "nkeys", "t0", "error", "specs", "client", "lost", "lost_at",
                 "cancelled", "retries", "sent")

    def __init__(self, job_id, load, nkeys, specs=None):
        self.job_id, self.load, self.nkeys, self.specs = job_id, load, nkeys, specs
        self.jobs, self.t0, self.error = [], time.monotonic(), None
        self.sent = True         # its first run was submitted (False while it waits for vLLM's stream)
        self.client = None       # the connection its last run went to
        self.lost = False        # that run met a lost connection, or the daemon cancelled it
        self.lost_at = None      # when a lost connection (or a refusal for room) first failed it
        self.cancelled = False   # the worker cancelled it (wait's timeout): never loaded again
        self.retries = 0


class _Collected:
    """What a transfer's finished daemon jobs said (full: the daemon
    refused one for a limit of jobs in flight: its connection's, or the
    memory of its process's or every client's jobs)."""
    __slots__ = ("outcomes", "nbytes", "error", "lost", "full")

    def __init__(self, outcomes, nbytes, error, lost, full):
        self.outcomes, self.nbytes, self.error, self.lost, self.full = outcomes, nbytes, error, lost, full


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


def _stream_fence(tensors):
    """For CUDA KV caches, a function that marks the work queued so far on
    the current CUDA stream of their device and returns the mark: an
    object whose synchronize() returns once that work has run. None for
    host memory. The daemon copies the blocks from another process,
    outside vLLM's streams: a store must not read KV the model has not
    finished writing, nor a load write blocks that queued work (zeroing)
    will write after it. So each job is sent only once its mark is
    passed, as vLLM's own offloading worker makes its copy stream wait for
    the compute stream. Marking does not wait: vLLM's thread goes on."""
    cuda = [t for t in tensors if getattr(t, "is_cuda", False)]
    if not cuda:
        return None
    import torch
    device = cuda[0].device

    def mark():
        # blocking: the thread that waits on it sleeps instead of spinning a core.
        ev = torch.cuda.Event(blocking=True)
        ev.record(torch.cuda.current_stream(device))
        return ev
    return mark


class SpecWorker(Reconnects):
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
                caches.append((client.register_cache(ns, layers), blocks))
            return client, regions, caches, names
        return connect(o, f"{o['client_name']}-worker{self.rank}", set_up)

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
            SpecWorker._host_mapping(st.data_ptr(), st.nbytes())
        return row

    def _layer(self, client, regions, t, page, ti, within=0):
        row = self._check_layer(t, page, ti, within)
        region, base = self._region_of(client, regions, t)
        off = base + t.storage_offset() * t.element_size() + within
        return Layer(region, offset=off, block_stride=row, plane_stride=0, num_blocks=t.shape[0])

    def _region_of(self, client, regions, t):
        st = t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()
        addr = st.data_ptr()
        if addr in regions:
            return regions[addr]
        if getattr(t, "is_cuda", False):
            reg = (client.register_cuda_tensor(t), 0)
        else:
            reg = self._register_host(client, addr, st.nbytes())
        regions[addr] = reg
        return reg

    @staticmethod
    def _host_mapping(addr, size):
        """The shared-memory file mapping (mapping_of) that holds host
        memory [addr, addr+size); ValueError where it is none."""
        m = _mapping_of(addr, size)
        if m is None:
            raise ValueError("kvhost.vllm: a host KV-cache tensor is not one file mapping: allocate it in "
                             "shared memory (kvhost.torch_host_tensor) to use it with the daemon")
        path = m[3]
        if not path.startswith("/"):
            raise ValueError(f"kvhost.vllm: a host KV-cache tensor lies in private memory ({path or 'anonymous'}): "
                             "allocate it in shared memory (kvhost.torch_host_tensor, a memfd or a /dev/shm "
                             "file) to use it with the daemon")
        return m

    @staticmethod
    def _register_host(client, addr, size):
        """Host memory: the shared-memory file behind the mapping (a memfd or a
        /dev/shm file), registered unsealed."""
        lo, hi, off, path = SpecWorker._host_mapping(addr, size)
        fd = _open_mapped(lo, hi, path)
        try:
            file_off = off + (addr - lo)
            region = client.register_shared_file(fd, file_off + size)
        finally:
            os.close(fd)
        return region, file_off

    # -- transfers -------------------------------------------------------------

    def _plan(self, job_id, gpu_spec, kv_spec, caches, load=True):
        """Per group: (cache, keys, blocks per key) of a job, and what could
        not be planned: [(group, keys, why)].

        A group's GPU blocks are logically contiguous from block index
        block_indices[g]; with blocks_per_chunk > 1 its first chunk may
        start s = block_indices[g] % blocks_per_chunk blocks in (the GPU
        prefix cache holds the chunk's first blocks) and its last chunk
        may be covered only in part, so a group of n blocks has
        cdiv(s + n, blocks_per_chunk) keys. A load names its blocks and
        NO_BLOCK for the rest of those chunks: the daemon loads the named
        blocks and still verifies whole keys. A store moves whole keys
        only: a chunk it covers in part is left out (reported in what
        could not be planned) and the group's other chunks are stored."""
        bpc = self._bpc
        ids = [int(b) for b in gpu_spec.block_ids]
        sizes = getattr(gpu_spec, "group_sizes", None)
        sizes = [len(ids)] if sizes is None else [int(s) for s in sizes]
        starts = getattr(gpu_spec, "block_indices", None)
        starts = [0] * len(sizes) if starts is None else [int(b) for b in starts]
        by_group = {}
        for k, kg in zip(kv_spec.keys, kv_spec.groups):
            by_group.setdefault(kg, []).append(k)
        if sum(sizes) != len(ids):
            return [], [(None, list(kv_spec.keys), f"group sizes {sizes} do not add up to {len(ids)} blocks")]
        out, bad, start = [], [], 0
        for g in sorted(set(by_group) | set(range(len(sizes)))):
            n = sizes[g] if g < len(sizes) else 0
            gblocks = ids[start:start + n]
            start += n
            gkeys = by_group.get(g, [])
            if not gkeys and not gblocks:
                continue
            if g >= len(caches):
                bad.append((g, gkeys, f"group {g} of {len(caches)}"))
                continue
            first = starts[g] if g < len(starts) else 0
            skip = first % bpc if first >= 0 else 0
            want = -(-(skip + n) // bpc) if n else 0
            if first < 0 or len(gkeys) != want:
                bad.append((g, gkeys, f"group {g} has {len(gkeys)} keys of {bpc} blocks but {n} GPU blocks from "
                                      f"block index {first} (want {want} keys)"))
                continue
            cache, nblocks = caches[g]
            outside = [b for b in gblocks if not 0 <= b < nblocks]
            if outside:
                bad.append((g, gkeys, f"block {outside[0]} outside the cache's {nblocks} blocks"))
                continue
            tail = len(gkeys) * bpc - skip - n
            slots = [p.NO_BLOCK] * skip + gblocks + [p.NO_BLOCK] * tail
            per = [slots[i * bpc:(i + 1) * bpc] for i in range(len(gkeys))]
            if not load and (skip or tail):
                # A key is stored whole or not at all: the chunks this
                # store covers in part are left out.
                whole = [i for i, blocks in enumerate(per) if p.NO_BLOCK not in blocks]
                part = [gkeys[i] for i in range(len(gkeys)) if i not in whole]
                bad.append((g, part, f"group {g}: {len(part)} chunk(s) of {bpc} blocks covered in part (from block "
                                     f"index {first}, {n} blocks): a chunk is stored whole or not at all"))
                gkeys, per = [gkeys[i] for i in whole], [per[i] for i in whole]
                if not gkeys:
                    continue
            out.append((cache, gkeys, per))
        return out, bad

    def _submit(self, job_id, gpu_spec, kv_spec, load):
        """Starts a job; always True (vLLM asserts it). What cannot be moved
        is reported by get_finished: a load fails, a store leaves those keys
        out (they are simply not stored; later lookups miss). With CUDA KV
        caches the job is marked on vLLM's stream here and sent by the
        worker's sender thread once the GPU has passed the mark."""
        with self._lock:
            self._check_locked()
        tr = _Transfer(job_id, load, len(kv_spec.keys), (gpu_spec, kv_spec) if load else None)
        mark = None
        if self._fence is None:
            self._start(tr, gpu_spec, kv_spec)
        else:
            try:
                mark = self._fence()
            except Exception as e:  # a CUDA error: nothing moves
                tr.error = f"marking vLLM's CUDA stream: {e}"
                log.error("kvhost spec: job %d: %s", job_id, tr.error)
        with self._lock:
            if mark is not None and self._closing:  # the sender is gone: nothing would send it
                mark, tr.error = None, "the worker was shut down"
            if mark is not None and self._sender is None:
                # Started before the job is queued: a thread that cannot
                # start fails this submit, not every later job.
                t = threading.Thread(target=self._send_fenced, daemon=True, name=f"kvhost-{self._what}-sender")
                t.start()
                self._sender = t
            self._transfers[job_id] = tr
            self._stats["load_jobs" if load else "store_jobs"] += 1
            if mark is not None:
                tr.sent = False
                self._fenced.append((tr, gpu_spec, kv_spec, mark))
                self._cv.notify_all()
        return True

    def _send_fenced(self):
        """The sender thread: sends each marked job, in submission order,
        once the GPU has passed its mark. Once shutdown has begun closing,
        a job not yet sent is not sent (nor its mark waited for): it ends
        with an error. Sends happen under _send_lock, so that shutdown,
        having set _closing, waits for one under way and then knows no
        other begins."""
        while True:
            with self._cv:
                while not self._fenced and not self._closing:
                    self._cv.wait()
                if not self._fenced:
                    return
                tr, gpu_spec, kv_spec, mark = self._fenced[0]
                closing = self._closing
            why, started = None, False
            try:
                if closing:
                    why = "the worker shut down before the job was sent"
                if why is None:
                    try:
                        mark.synchronize()
                    except Exception as e:  # a CUDA error: the job moves nothing
                        why = f"waiting for vLLM's CUDA stream: {e}"
                        log.error("kvhost spec: job %d: %s", tr.job_id, why)
                with self._send_lock:
                    with self._lock:
                        if why is None and self._closing:
                            why = "the worker shut down before the job was sent"
                    if why is None:
                        started = True
                        self._start(tr, gpu_spec, kv_spec)
            except BaseException as e:  # never leave this job, and every one after it, unsent
                why = f"sending the job: {e!r}"
                log.exception("kvhost spec: job %d: %s", tr.job_id, why)
            finally:
                if why is not None:
                    if not started:
                        tr.jobs, tr.lost = [], False
                    # else its daemon jobs sent before the error stay: it ends with them
                    tr.error = why
                with self._cv:
                    self._fenced.popleft()
                    tr.sent = True
                    self._cv.notify_all()

    def _start(self, tr, gpu_spec, kv_spec):
        """Submits tr's daemon jobs on the connection in use (its first run,
        or a load's run again after a lost connection)."""
        with self._lock:
            client, caches, broken = self._client, self._caches, self._broken
        plan, bad = self._plan(tr.job_id, gpu_spec, kv_spec, caches, tr.load)
        kind = "load" if tr.load else "store"
        tr.jobs, tr.error, tr.lost, tr.client = [], None, False, client
        if broken is not None:  # no daemon: nothing moves (a load waits; a store's keys are not stored)
            plan, tr.error, tr.lost = [], f"no daemon connection ({broken})", True
        for g, gkeys, why in bad:
            log.warning("kvhost spec: %s job %d: %s", kind, tr.job_id, why)
            if tr.load:
                tr.error = f"job {tr.job_id}: {why}"
                tr.lost = False  # no connection makes this load possible
            else:
                tr.nkeys -= len(gkeys)
                with self._lock:
                    self._stats["store_skipped_keys"] += len(gkeys)
        try:
            for cache, keys, blocks in plan:
                for i in range(0, len(keys), p.MAX_KEYS_PER_REQUEST):
                    sl = slice(i, i + p.MAX_KEYS_PER_REQUEST)
                    fn = client.load if tr.load else client.store
                    # Sent; the daemon's acceptance is not waited for on vLLM's thread.
                    tr.jobs.append(fn(cache, keys[sl], blocks[sl], block=False))
        except (KvhostError, ConnectionLost, OSError, ValueError) as e:  # ValueError: a request the client refuses
            tr.error = reason(e)
            if lost_connection(e, client):  # logged once, by _lost_locked
                tr.lost = True
                with self._lock:
                    self._lost_locked(client, tr.error)
            else:
                log.warning("kvhost spec: %s job %d: %s", kind, tr.job_id, e)

    def submit_store(self, job_id, src_spec, dst_spec):
        """Starts storing the GPU blocks of src_spec under dst_spec's keys."""
        return self._submit(job_id, src_spec, dst_spec, load=False)

    def submit_load(self, job_id, src_spec, dst_spec):
        """Starts loading src_spec's keys into the GPU blocks of dst_spec."""
        return self._submit(job_id, dst_spec, src_spec, load=True)

    def _collect_locked(self, tr):
        """What tr's finished daemon jobs said (called with _lock held)."""
        outcomes, nbytes, err, lost, full = [], 0, tr.error, tr.lost, False
        for j in tr.jobs:
            try:
                r = j.wait(0)
            except Exception as e:  # refused, or the connection was lost under the job
                err = err or reason(e)
                if lost_connection(e, j._client):
                    lost = True
                    self._lost_locked(j._client, err)
                elif isinstance(e, KvhostError) and e.code == p.CODE_LIMIT:
                    full = True  # jobs in flight (stores) took every slot or byte
                continue
            outcomes += [o for o, _ in r.keys]
            nbytes += r.bytes
            if r.message and any(o in (p.OUTCOME_FAILED, p.OUTCOME_CANCELLED) for o, _ in r.keys):
                err = err or r.message
            if not tr.cancelled and any(o == p.OUTCOME_CANCELLED for o, _ in r.keys):
                lost = True  # the daemon gave it up: it is shutting down
        return _Collected(outcomes, nbytes, err, lost, full)

    def _again_locked(self, tr, got, now):
        """Whether tr, a load that failed, is to be loaded again: on the next
        connection when its failure came from a lost connection (or a
        daemon that cancelled it), on this one when the daemon refused a
        job of it for a limit of jobs in flight (the connection's, or the
        memory of its process's or every client's jobs: they end, and room
        comes); if it was not cancelled by
        the worker, and load_retry_s has not passed since its first loss or
        refusal. vLLM stops the worker on a failed load, so a load waits
        for a daemon, or for room, rather than fail. Its daemon jobs have
        all ended: no daemon writes into its blocks any more."""
        if not (tr.load and (got.lost or got.full)) or tr.cancelled:
            return False
        if got.outcomes and all(o == p.OUTCOME_LOADED for o in got.outcomes) and len(got.outcomes) == tr.nkeys:
            return False
        limit = self._opts["load_retry_s"]
        if limit <= 0 or (got.lost and self._opts["reconnect_s"] <= 0):
            return False
        if tr.lost_at is None:
            tr.lost_at = now
            if got.lost:
                log.warning("kvhost spec: load job %d lost the daemon connection (%s); loading it again once "
                            "connected (for up to %gs)", tr.job_id, got.error, limit)
            else:
                log.warning("kvhost spec: load job %d refused (%s); sending it again as jobs end (for up to %gs)",
                            tr.job_id, got.error, limit)
        return now - tr.lost_at < limit

    def _result(self, tr, got):
        """TransferResult of a finished transfer. A store that failed (wholly
        or for some keys) still succeeds for vLLM — the keys are simply not
        stored and later lookups miss — and is counted; a load succeeds only
        when every key loaded (vLLM crashes the worker otherwise: its blocks
        hold no valid data)."""
        outcomes, nbytes, err = got.outcomes, got.nbytes, got.error
        missing = tr.nkeys - len(outcomes)
        s = self._stats
        if tr.load:
            loaded = sum(1 for o in outcomes if o == p.OUTCOME_LOADED)
            ok = loaded == tr.nkeys and err is None
            s["load_keys"] += tr.nkeys
            s["loaded_keys"] += loaded
            s["load_failed_keys"] += tr.nkeys - loaded
            s["bytes_loaded"] += nbytes
            if not ok:
                s["failed_load_jobs"] += 1
                log.error("kvhost spec: load job %d failed: %d of %d keys loaded (%s)", tr.job_id, loaded,
                          tr.nkeys, err or "missing keys")
            elif tr.retries:
                log.info("kvhost spec: load job %d loaded after %d retries on a new connection", tr.job_id,
                         tr.retries)
        else:
            ok = True
            stored = sum(1 for o in outcomes if o == p.OUTCOME_STORED)
            present = sum(1 for o in outcomes if o == p.OUTCOME_PRESENT)
            declined = sum(1 for o in outcomes if o == p.OUTCOME_NOT_ADMITTED)
            failed = tr.nkeys - stored - present - declined
            s["store_keys"] += tr.nkeys
            s["stored_keys"] += stored
            s["present_keys"] += present
            s["not_admitted_keys"] += declined
            s["store_failed_keys"] += failed
            s["bytes_stored"] += nbytes
            if failed or missing:
                # Without a daemon connection every store fails alike: the
                # loss was logged once, and each job is counted only.
                (log.debug if got.lost else log.warning)(
                    "kvhost spec: store job %d: %d of %d keys not stored (%s)", tr.job_id, failed, tr.nkeys,
                    err or "failed")
        return self._api.TransferResult(job_id=tr.job_id, success=ok, transfer_size=nbytes,
                                        transfer_time=time.monotonic() - tr.t0)

    def _check_locked(self):
        """Notices a connection the daemon closed (vLLM calls get_finished
        every step; submit checks too)."""
        if self._broken is None and not self._client.connected():
            self._lost_locked(self._client, "the daemon closed the connection")

    def get_finished(self):
        """Results of the jobs finished since the last call. A load lost
        with the connection is not finished: it is started again here once
        a new connection is up, and reported when that run ends (or failed
        once load_retry_s has passed since it was lost)."""
        now = time.monotonic()
        results, again = [], []
        with self._lock:
            self._check_locked()
            for tr in [tr for tr in self._transfers.values() if tr.sent and all(j.done() for j in tr.jobs)]:
                got = self._collect_locked(tr)
                if self._again_locked(tr, got, now):
                    if self._broken is None and (self._client is not tr.client or not got.lost):
                        again.append(tr)
                    else:  # waits for the next connection (the reconnect thread's)
                        tr.jobs, tr.error, tr.lost = [], got.error, True
                    continue
                del self._transfers[tr.job_id]
                results.append(self._result(tr, got))
            for tr in again:
                tr.retries += 1
                self._stats["load_retries"] += 1
        for tr in again:
            self._start(tr, *tr.specs)
        return results

    def wait(self, job_ids):
        """Blocks until the daemon has ended the jobs (get_finished reports
        them): vLLM reuses their blocks next, and a store still reading
        them would store other bytes under its keys. A job not done after
        job_timeout_s is asked to cancel, and waited for still, said in the
        log every job_timeout_s."""
        self._wait(job_ids, None)

    def _wait(self, job_ids, until):
        """wait, giving up at until (monotonic; None: never)."""
        timeout = self._opts["job_timeout_s"] or None
        with self._lock:
            trs = [self._transfers[j] for j in job_ids if j in self._transfers]
        for tr in trs:
            kind = "load" if tr.load else "store"
            if not self._wait_sent(tr, until):
                return
            for j in tr.jobs:
                try:
                    wait_ended(j, timeout, lambda: until, f"spec: {kind} job {tr.job_id}",
                               on_cancel=lambda tr=tr: setattr(tr, "cancelled", True))
                except TimeoutError:  # past until: shutdown gives up
                    return
                except Exception:  # ended (refused, or the connection closed): get_finished says
                    pass

    def _wait_sent(self, tr, until):
        """Waits until tr's first run was submitted (its stream's mark
        passed); False when until (monotonic; None: never) came first."""
        with self._cv:
            while not tr.sent:
                left = None if until is None else until - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(left)
        return True

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
