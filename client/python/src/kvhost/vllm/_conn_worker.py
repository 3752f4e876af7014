"""KvhostConnector's worker half: the registered KV caches, each step's
layer-wise load jobs, and store jobs in flight per request (docs/vllm.md,
"The KV connector")."""

import collections
import logging
import threading
import time

from ..client import Layer
from . import _conn_groups as groups_
from . import _namespace as ns_
from . import _pages as pages_
from ._conn_common import STAT_KEYS, WORK_STEPS, WorkerMeta, _Half, geometry
from ._conn_loads import ConnectorLoads
from ._conn_saves import ConnectorSaves
from ._connect import connect
from ._regions import region_of

log = logging.getLogger("vllm.kvhost")


def _dense(t):
    """Whether tensor t's elements fill one extent of t.numel() elements, in
    any order of its dimensions (vLLM permutes a block's dimensions for the
    NHD and HND layouts: its bytes stay one extent)."""
    want = 1
    for stride, size in sorted((t.stride(i), t.shape[i]) for i in range(t.dim()) if t.shape[i] != 1):
        if stride != want:
            return False
        want *= size
    return True


def _lead(t):
    """The tensor that starts a layer's pages: t, or the first of vLLM's
    list of a state layer's views (conv and SSM states)."""
    return t[0] if isinstance(t, (list, tuple)) else t


class ConnectorWorker(ConnectorLoads, ConnectorSaves, _Half):
    """The worker half: the registered KV caches, the step's load jobs per
    layer group, and store jobs in flight per request."""

    def __init__(self, config, ident, opts):
        self._opts = opts
        self._ident = ident
        self._bpc = pages_.chunk_blocks(ident)
        self._groups = groups_.groups(ident)
        # Every KV-cache group's layers (of this worker's pipeline stage).
        self._names = [n for g in self._groups for n in g.layer_names]
        self._group_of = {n: g for g in self._groups for n in g.layer_names}
        self._order = {n: i for i, n in enumerate(self._names)}  # the layers' order in the model (register_kv_caches)
        self.rank = ns_.count(config, "parallel.rank", "worker rank", least=0)
        self.stage, self.shard = groups_.place(config)
        self._what = f"connector worker {self.rank}"
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._broken, self._closing, self._reconnectors = None, False, []
        self._client = self._caches = None              # (salt name (None: the engine's), group) -> cache id
        self._ns_names = [None] + sorted(set(opts["salt_namespaces"].values()))
        self._tensors = None
        self._nblocks = 0
        self._step = None
        self._errors = set()
        self._stores = collections.defaultdict(list)   # req id -> [Job]
        self._finishing = set()                        # req ids finished, stores still in flight
        self._saving = set()                           # req ids with a save sent (get_finished reports them)
        self._loaded = set()                           # req ids with a load sent (get_finished reports them)
        self._given_up = collections.defaultdict(list)  # req id -> load jobs given up, maybe not ended
        self._measured = [0, 0.0]                      # bytes, seconds of loads since the last worker meta
        self._latencies = []                           # loads' fixed costs measured since the last worker meta
        self._pass = None                              # (step, start) of a forward pass without loads, timed
        self._passes = []                              # (step, start, end) timed, not yet reported
        self._done_steps = []                          # steps whose loads ended since the last worker meta
        self._timeline = []                            # the last loading step's jobs, timed (load_timeline)
        self._reported = {}                            # the counters get_kv_connector_stats reported last
        self._outbox = collections.deque()             # (CUDA mark, saves) the sender thread sends in order
        self._unsent = collections.Counter()           # req id -> batches of its saves not sent yet
        self._sender = None
        self._stats = collections.Counter()
        self._layer_loads = None
        self.namespace = geometry(ident, self.shard).model

    # -- registration ----------------------------------------------------------

    def register_kv_caches(self, kv_caches):
        """Registers each layer's paged tensor with the daemon (CUDA IPC,
        or host memory by its shared file) as one cache of the namespace.
        Every layer of the identity's groups must be there, each (num_blocks,
        ...) with a contiguous page per block ("blocks") or (2, num_blocks,
        ...) with a contiguous half page per plane and block ("planes");
        a state group's layer (Mamba, linear attention) a tensor or vLLM's
        list of state views of one page per block (the first view starts
        the page); other layouts are refused (ValueError)."""
        missing = [n for n in self._names if n not in kv_caches]
        if missing:
            raise ValueError(f"kvhost.vllm: register_kv_caches got no tensor for layer(s) {', '.join(missing[:4])} "
                             f"of the {len(self._names)} the engine's KV-cache group names")
        order = {n: i for i, n in enumerate(kv_caches)}
        self._order = {n: order[n] for n in self._names}
        tensors = [kv_caches[n] for n in self._names]
        self._check_layout()
        self._nblocks = min(self._blocks_of(t, n) for t, n in zip(tensors, self._names))
        self._tensors = [_lead(t) for t in tensors]
        conn, absent = self._connect_at_start()
        if conn is not None:
            self._client, self._caches, self._regions = conn
        else:
            self._start_unconnected(absent)
        log.info("kvhost connector: worker rank %d registered %d layers (%d blocks) in namespace %s", self.rank,
                 len(tensors), self._nblocks, self.namespace)

    def _check_layout(self):
        """Refuses pages whose byte order is not the identity's, where vLLM
        can say what this worker got (spec_worker.observe_layout)."""
        from . import spec_worker
        seen = spec_worker.observe_layout(pages_.groups(self._ident))
        if seen is None:
            return
        backends, layout = seen
        # A state group's pages are its states, whatever the attention
        # backends' byte order: the attention groups' backends name it
        # (of this pipeline stage's groups: a group may have no layer here).
        backends = [b for g, b in zip(self._groups, backends) if g.kind != groups_.STATE and b] or backends
        got = ns_.page_layout_text(backends, layout, False)
        want = self._ident["page_layout"]
        if got != want:
            raise ValueError(f"kvhost.vllm: this worker's KV pages are {got} but the connector's namespace says "
                             f"{want}: pages of another byte order must never share keys; refusing to start. Set "
                             f"the connector option \"page_layout\": \"{got}\" on every engine whose workers get "
                             "these pages")

    def _blocks_of(self, t, name):
        """The number of blocks of layer tensor t, once its layout is the
        identity's tensor_layout with contiguous pages of its group's
        page_bytes (a state group's: a page per block from its first
        state view's start)."""
        g = self._group_of[name]
        if g.kind == groups_.STATE:
            t = _lead(t)
            es = t.element_size()
            if t.dim() < 1 or t.stride(0) * es < g.page_bytes:
                raise ValueError(f"kvhost.vllm: layer {name}'s state (shape {tuple(t.shape)}, strides {t.stride()}) "
                                 f"has no {g.page_bytes}-byte page per block")
            return t.shape[0]
        page, es, shape = g.page_bytes, t.element_size(), tuple(t.shape)
        planes = self._ident["tensor_layout"] == "planes"
        lead = 2 if planes else 1
        if len(shape) < lead + 1 or (planes and shape[0] != 2):
            raise ValueError(self._layout_error(name, t, "its shape"))
        inner = t[0, 0] if planes else t[0]
        want = page // 2 if planes else page
        if not _dense(inner) or inner.numel() * es != want:
            raise ValueError(self._layout_error(name, t, f"a contiguous {want}-byte {'half ' if planes else ''}page "
                                                         "per block"))
        if planes and (t.stride(0) < t.shape[1] * t.stride(1) or t.stride(1) * es < want):
            raise ValueError(self._layout_error(name, t, "its planes overlap"))
        if not planes and t.stride(0) * es < want:
            raise ValueError(self._layout_error(name, t, "its blocks overlap"))
        return shape[1] if planes else shape[0]

    def _layout_error(self, name, t, what):
        other = "planes" if self._ident["tensor_layout"] == "blocks" else "blocks"
        return (f"kvhost.vllm: layer {name}'s KV cache (shape {tuple(t.shape)}, strides {t.stride()}) is not the "
                f"connector's tensor_layout \"{self._ident['tensor_layout']}\" ({what}); kvhost takes (num_blocks, "
                "...) tensors with a page per block (\"blocks\": vLLM's FlashAttention here) or (2, num_blocks, "
                f"...) K and V planes (\"planes\"): set tensor_layout \"{other}\" if the tensors are that")

    def _open(self):
        o = self._opts

        def set_up(client):
            regions = {}
            layers = {g.index: [] for g in self._groups}  # per KV-cache group, its layers in its order
            for name, t in zip(self._names, self._tensors):
                g = self._group_of[name]
                planes = self._ident["tensor_layout"] == "planes" and g.kind != groups_.STATE
                es = t.element_size()
                region, base = region_of(client, regions, t)
                off = base + t.storage_offset() * es
                if planes:
                    layers[g.index].append(Layer(region, offset=off, block_stride=t.stride(1) * es,
                                                 plane_stride=t.stride(0) * es, num_blocks=self._nblocks))
                else:
                    layers[g.index].append(Layer(region, offset=off, block_stride=t.stride(0) * es, plane_stride=0,
                                                 num_blocks=self._nblocks))
            caches = {}  # one per namespace and KV-cache group, over the group's layers
            for name in self._ns_names:
                for g in self._groups:
                    if not g.layer_names:  # a group all of whose layers are another pipeline stage's
                        continue
                    geo = geometry(self._ident, self.shard, name, g.index)
                    ns = client.declare(geo)
                    ns_.check_served(ns.fingerprint, geo)
                    caches[(name, g.index)] = client.register_cache(ns, layers[g.index])
            return client, caches, regions
        return connect(o, f"{o['client_name']}-worker{self.rank}", set_up)

    def _swap_locked(self, new):
        self._client, self._caches, self._regions = new
        self._layer_loads = None

    def layer_loads(self):
        """Whether the daemon loads a layer range (Client.supports_layer_loads)."""
        if self._layer_loads is None:
            v = getattr(self._client, "supports_layer_loads", False)
            self._layer_loads = bool(v() if callable(v) else v)
        return self._layer_loads

    def take_errors(self):
        """The block ids of this step's failed loads (cleared)."""
        self.finish_loads()
        out, self._errors = self._errors, set()
        return out

    def worker_meta(self):
        """The steps whose loads ended, the loads measured and the forward
        passes timed since the last call, as a WorkerMeta (None where
        there is none)."""
        (nbytes, secs), steps = self._measured, self._done_steps
        self._measured, self._done_steps = [0, 0.0], []
        latencies, self._latencies = self._latencies, []
        computes = self._timed_passes()
        return WorkerMeta(nbytes, secs, steps, computes, latencies) if steps or nbytes or computes else None

    def _begin_pass(self, step):
        """Marks the start of a forward pass without loads (step > 0: one
        the scheduler numbered): an event on vLLM's stream with CUDA KV
        caches (the GPU's time, not the launches'), else the clock."""
        self._pass = None
        if step > 0:
            self._pass = (step, self._timing_mark())

    def end_pass(self):
        """Marks the end of the forward pass begin_pass marked (wait_for_save)."""
        if self._pass is not None:
            step, start = self._pass
            self._pass = None
            self._passes.append((step, start, self._timing_mark()))
            del self._passes[:-WORK_STEPS]

    def _timing_mark(self):
        cuda = [t for t in self._tensors if getattr(t, "is_cuda", False)]
        if not cuda:
            return time.perf_counter()
        import torch
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(cuda[0].device))
        return ev

    def _timed_passes(self):
        """(step, seconds) of the marked passes that have run (the GPU's
        events queried, never waited for); those still running wait."""
        out, left = [], []
        for step, start, end in self._passes:
            if isinstance(start, float):
                out.append((step, end - start))
            elif end.query():
                out.append((step, start.elapsed_time(end) / 1e3))
            else:
                left.append((step, start, end))
        self._passes = left
        return out

    def stats_delta(self):
        """What the counters of STAT_KEYS gained since the last call (a
        dict; all zero where nothing moved)."""
        with self._lock:
            now = {k: self._stats.get(k, 0) for k in STAT_KEYS}
            delta = {k: now[k] - self._reported.get(k, 0) for k in STAT_KEYS}
            self._reported = now
        return delta

    def counters(self):
        """The worker's counters since it started (for tests and tools)."""
        s = dict(self._stats)
        with self._lock:
            s["stores_in_flight"] = sum(len(j) for j in self._stores.values())
            s["stores_unsent"] = sum(self._unsent.values())
            s["connected"] = self._broken is None and self._client is not None
        s["layer_loads"] = bool(self._client is not None and self.layer_loads())
        return s

    def shutdown(self):
        """Waits for the loads and stores in flight, daemon_wait_s in all,
        then closes the connection (what the daemon may still touch goes
        with the process, which is ending). Idempotent."""
        until = time.monotonic() + self._opts["daemon_wait_s"]
        self.finish_loads()
        with self._lock:
            pending = set(self._stores) | set(self._unsent)
        self.wait_stores(pending, until)
        self._close(until)
        with self._cv:
            self._cv.notify_all()
        if self._sender is not None:
            self._sender.join(max(0.0, until - time.monotonic()) + 0.2)
