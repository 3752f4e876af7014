"""KvhostConnector's worker half: the registered KV caches, each step's
layer-wise load jobs, and store jobs in flight per request (docs/vllm.md,
"The KV connector")."""

import collections
import logging
import threading
import time

from .. import protocol as p
from ..client import ConnectionLost, KvhostError, Layer
from . import _conn_groups as groups_
from . import _namespace as ns_
from . import _pages as pages_
from ._common import daemon_state, reason, wait_ended
from ._connect import connect, lost_connection
from ._regions import region_of
from ._conn_common import STAT_KEYS, WORK_STEPS, WorkerMeta, _Half, geometry, layer_groups

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


class _Step:
    """The loads of one step: its number (the scheduler's), per layer
    group its daemon jobs (each with the block lists of its keys), the
    groups waited for, when they started and ended, the bytes moved."""
    __slots__ = ("number", "jobs", "waited", "t0", "nbytes", "t_end", "layer_group", "gave_up", "lost",
                 "sent", "daemon_s", "first")

    def __init__(self, number, layer_group):
        self.number, self.jobs, self.waited = number, {}, set()
        self.gave_up = False  # a group's wait gave up: the later groups' are not waited for either
        self.lost = 0  # bytes of the jobs given up (finish_loads)
        self.t0, self.nbytes, self.t_end = time.monotonic(), 0, None
        self.sent = 0.0  # seconds from t0 to the last job's submission
        self.daemon_s = 0.0  # the longest job, submission to completion, as the daemon timed it
        self.first = [0, 0.0]  # the first layer group's bytes and longest job (the load's latency)
        self.layer_group = layer_group  # layer name -> its job group's key: (KV-cache group, layer group)


class ConnectorWorker(_Half):
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
        # backends' byte order: the attention groups' backends name it.
        backends = [b for g, b in zip(self._groups, backends) if g.kind != groups_.STATE] or backends
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

    # -- loads -----------------------------------------------------------------

    def start_load(self, meta):
        """Submits the step's loads (meta.loads) at once: per KV-cache group,
        one daemon job per group of its layers (layer_groups; one job for
        every layer where the daemon cannot load a layer range), in the
        model's layer order. A step without loads has its forward pass
        timed (begin_pass) instead. meta.errors go into the step's load
        errors."""
        self._step = None
        self._errors.update(getattr(meta, "errors", ()) or ())
        loads = [t for t in getattr(meta, "loads", ()) if t.keys]
        if not loads:
            self._begin_pass(getattr(meta, "step", 0))
            return
        ranged = self._client is not None and self.layer_loads()
        ranges, where = {}, {}  # (group, layer group) -> (first, count); layer name -> its (group, layer group)
        for g in self._groups:
            nl = len(g.layer_names)
            per_load = getattr(meta, "layers_per_load", 0) or self._opts["layers_per_load"]
            lgs = layer_groups(nl, per_load if ranged else nl, self._opts["layer_groups"])
            for lg, (first, count) in enumerate(lgs):
                ranges[(g.index, lg)] = (first, count, len(lgs) > 1)
                for n in g.layer_names[first:first + count]:
                    where[n] = (g.index, lg)
        step = _Step(getattr(meta, "step", 0), where)
        self._step = step
        # The scheduler delays the free of these requests' blocks until
        # get_finished reports them, their loads ended.
        self._loaded.update(t.req_id for t in loads)
        keys = [k for t in loads for k in t.keys]
        blocks = [b for t in loads for b in t.blocks]
        bad = [i for i, b in enumerate(blocks) if any(x != p.NO_BLOCK and not 0 <= x < self._nblocks for x in b)]
        client = self._usable()
        if client is None or bad:
            why = "no daemon connection" if not bad else f"block ids outside the cache's {self._nblocks} blocks"
            log.warning("kvhost connector: loads of this step not run (%s): vLLM recomputes them", why)
            self._fail(blocks)
            return
        self._fence()
        # Each namespace's keys (salt_namespaces) load through its own cache.
        parts = []
        for t in loads:
            if parts and parts[-1][0] == t.ns:
                parts[-1][1].append(t)
            else:
                parts.append((t.ns, [t]))
        # The job groups in the order of their first layer in the model.
        first_layer = {}
        for n, key in where.items():
            first_layer[key] = min(first_layer.get(key, len(self._order)), self._order.get(n, 0))
        step.t0 = time.monotonic()
        for key in sorted(ranges, key=lambda k: (first_layer.get(k, 0), k)):
            first, count, ranged = ranges[key]
            jobs = step.jobs[key] = []
            for name, ts in parts:
                ts = [t for t in ts if t.group == key[0]]
                if ts:
                    self._load_jobs(client, (name, key[0]), ts, first, count, ranged, jobs)
        step.sent = time.monotonic() - step.t0
        self._stats["load_jobs"] += sum(len(j) for j in step.jobs.values())
        self._stats["load_keys"] += len(keys)

    def _load_jobs(self, client, name, loads, first, count, ranged, jobs):
        """Sends the load jobs of loads (all of name: (salt namespace name,
        KV-cache group)) for layers [first, first + count) (the whole key
        where not ranged), appending (job, blocks, owners) to jobs."""
        keys = [k for t in loads for k in t.keys]
        blocks = [b for t in loads for b in t.blocks]
        owners = [t.req_id for t in loads for _ in t.keys]
        cache = self._caches.get(name) if self._caches is not None else None
        if cache is None:
            log.warning("kvhost connector: loads of salt namespace %r, which this worker's salt_namespaces does not "
                        "name: vLLM recomputes them", name)
            self._fail(blocks)
            return
        for i in range(0, len(keys), p.MAX_KEYS_PER_REQUEST):
            sl = slice(i, i + p.MAX_KEYS_PER_REQUEST)
            try:
                if ranged:
                    job = client.load(cache, keys[sl], blocks[sl], block=False, layers=(first, count))
                else:
                    job = client.load(cache, keys[sl], blocks[sl], block=False)
            except (KvhostError, ConnectionLost, OSError, ValueError) as e:
                log.warning("kvhost connector: load of layers %d-%d: %s", first, first + count - 1, e)
                self._fail(blocks[sl])
                if lost_connection(e, client):
                    with self._cv:
                        self._lost_locked(client, reason(e))
                continue
            jobs.append((job, blocks[sl], frozenset(owners[sl])))

    def _fence(self):
        """Waits until vLLM's CUDA stream has run the work queued so far:
        the daemon writes the blocks from another process, after any
        earlier work on them."""
        cuda = [t for t in self._tensors if getattr(t, "is_cuda", False)]
        if cuda:
            import torch
            torch.cuda.current_stream(cuda[0].device).synchronize()

    def _fail(self, blocks):
        for b in blocks:
            self._errors.update(x for x in b if x != p.NO_BLOCK)

    def wait_layer(self, layer_name):
        """Waits for the load jobs of the layer group holding layer_name
        (none where the step loads nothing or the layer is not the
        identity's), daemon_wait_s at most. A job not done after
        load_timeout_s is asked to cancel; one not ended by daemon_wait_s
        is given up (_give_up); a key not loaded puts its blocks in the
        step's load errors."""
        step = self._step
        if step is None:
            return
        g = step.layer_group.get(layer_name)
        if g is None or g not in step.jobs:
            return
        self._wait_group(step, g, time.monotonic() + self._opts["daemon_wait_s"])

    def _give_up(self, job, blocks, owners, g, first=True):
        """A load job not ended by daemon_wait_s: its blocks go into the
        step's load errors, and its requests' blocks stay vLLM's until it
        ends (get_finished reports those requests only then; vLLM delays
        their free, request_finished). With kv_load_failure_policy
        "recompute" vLLM computes the same tokens again into the same
        blocks, which a late write of the job fills with the same tokens'
        verified KV; with "fail" the request ends, and its blocks are
        held. A preempted request's blocks are vLLM's to reuse at once:
        handle_preemptions waits for its given-up loads, however long.
        Logged once a step (first), the later groups' at debug level."""
        self._stats["load_given_up_jobs"] += 1
        (log.warning if first else log.debug)("kvhost connector: a load job of layer group %s not ended by the daemon after %gs (%s): given "
                    "up (vLLM recomputes its %d keys' blocks; its requests' blocks are held until the daemon ends "
                    "it)", g, self._opts["daemon_wait_s"], daemon_state(job._client), len(blocks))
        self._fail(blocks)
        with self._lock:
            for rid in owners:
                self._given_up[rid].append(job)

    def _loads_pending(self, rid):
        """Whether a load of rid given up still runs on the daemon (a job
        ends with its completion, or with the connection, which the daemon
        closes only after ending its jobs, or dying)."""
        with self._lock:
            jobs = [j for j in self._given_up.get(rid, ()) if not j.done()]
            if jobs:
                self._given_up[rid] = jobs
            else:
                self._given_up.pop(rid, None)
            return bool(jobs)

    def _wait_group(self, step, g, until):
        if g in step.waited:
            return
        step.waited.add(g)
        if step.gave_up:
            # The daemon left a group of this step unended for daemon_wait_s:
            # the later groups (the same keys' other layers, whose blocks
            # vLLM recomputes already) are taken if done, not waited for.
            until = time.monotonic()
        for job, blocks, owners in step.jobs.get(g, ()):
            try:
                r = wait_ended(job, self._opts["load_timeout_s"] or None, lambda: until,
                               f"connector: load job of layer group {g}")
            except TimeoutError:  # past daemon_wait_s: the daemon may still write the blocks
                self._give_up(job, blocks, owners, g, not step.gave_up)
                step.gave_up = True
                # What the job was to move (finish_loads reports it over the
                # time the step had: at most the mount's rate).
                layers = sum(1 for v in step.layer_group.values() if v == g)
                pages = sum(x != p.NO_BLOCK for b in blocks for x in b) * layers
                step.lost += pages * self._groups[g[0]].page_bytes
                continue
            except Exception as e:  # refused, or the connection closed: recomputed
                log.warning("kvhost connector: load of layer group %s failed: %s", g, e)
                self._fail(blocks)
                if lost_connection(e, job._client):
                    with self._cv:
                        self._lost_locked(job._client, reason(e))
                continue
            step.nbytes += r.bytes
            step.daemon_s = max(step.daemon_s, r.duration_ns / 1e9)
            if g == next(iter(step.jobs)):
                step.first[0] += r.bytes
                step.first[1] = max(step.first[1], r.duration_ns / 1e9)
            failed = [b for (o, _), b in zip(r.keys, blocks) if o != p.OUTCOME_LOADED]
            failed += blocks[len(r.keys):]
            if failed:
                self._stats["load_failed_keys"] += len(failed)
                log.warning("kvhost connector: %d of %d keys not loaded in layer group %s (%s): vLLM recomputes "
                            "their blocks", len(failed), len(blocks), g, r.message or "missing")
                self._fail(failed)
        step.t_end = time.monotonic()

    def finish_loads(self):
        """Waits for every load job of the step (each verified by the
        daemon), so that a failure found after a layer was handed over is
        in this step's load errors. Returns at once where they were waited for."""
        step = self._step
        if step is None:
            return
        until = time.monotonic() + self._opts["daemon_wait_s"]
        for g in list(step.jobs):
            self._wait_group(step, g, until)
        if step.gave_up:
            # The bytes loaded and those given up over the time the step
            # had: a rate the mount did not reach, taken into the split's
            # so that a mount too slow for its loads to end in time is
            # claimed less of.
            self._measured[0] += step.nbytes + step.lost
            self._measured[1] += time.monotonic() - step.t0
            self._stats["bytes_loaded"] += step.nbytes
        elif step.nbytes and step.t_end is not None:
            # The daemon's time for the step's jobs (the last one ended no
            # later than its submission plus the longest job), not the
            # time to the last layer's wait: that includes whatever held
            # the worker between layers, and a rate measured through it
            # drifts low with a healthy daemon.
            seconds = step.t_end - step.t0
            if step.daemon_s > 0:
                seconds = min(seconds, step.sent + step.daemon_s)
            self._measured[0] += step.nbytes
            self._measured[1] += seconds
            self._stats["bytes_loaded"] += step.nbytes
            self._stats["load_seconds"] += seconds
            # The load's fixed cost: the first group's time beyond what its
            # bytes take at the step's rate (opening files, a cold start).
            fb, fs = step.first
            if fb and fs and step.nbytes > fb:
                self._latencies.append(max(0.0, fs - fb * seconds / step.nbytes))
        self._done_steps.append(step.number)
        self._step = None

    # -- saves -----------------------------------------------------------------

    def start_saves(self, meta):
        """Submits store jobs for meta.saves without waiting for them: whole
        keys, read from the blocks once the forward pass that wrote them has
        run. With CUDA KV caches the stores are marked on vLLM's stream here
        and sent by the worker's sender thread once the GPU has passed the
        mark (vLLM's thread goes on); host memory's are sent at once."""
        saves = [t for t in getattr(meta, "saves", ()) if t.keys]
        if not saves:
            return
        # The scheduler delays the free of these requests' blocks until
        # get_finished reports them, stored or not.
        self._saving.update(t.req_id for t in saves)
        # A replicated group (MLA's latent KV) is the same on every rank:
        # rank 0 writes it (every rank still reports the request finished).
        saves = [t for t in saves if self.shard == 0 or not self._groups[t.group].replicated]
        if not saves:
            return
        if self._usable() is None:
            self._stats["store_skipped_keys"] += sum(len(t.keys) for t in saves)
            return
        freed = [t for t in saves if self._groups[t.group].kind in (groups_.WINDOW, groups_.STATE)]
        if freed:
            self._store_now(freed)
            saves = [t for t in saves if self._groups[t.group].kind not in (groups_.WINDOW, groups_.STATE)]
            if not saves:
                return
        mark = self._mark()
        if mark is None:
            self._send_saves(saves)
            return
        with self._cv:
            for t in saves:
                self._unsent[t.req_id] += 1
            self._outbox.append((mark, saves))
            if self._sender is None:
                self._sender = threading.Thread(target=self._send_loop, name=f"kvhost-{self._what}-stores",
                                                daemon=True)
                self._sender.start()
            self._cv.notify_all()

    def _store_now(self, saves):
        """Stores of groups whose blocks vLLM frees while the request runs
        (a window's blocks once they leave it, a state group's earlier
        states): vLLM may give those blocks to another request in the next
        step, so they are sent once the GPU has written them and waited
        for here, daemon_wait_s at most (a store not ended by then is
        logged: the daemon may read a reused block)."""
        self._fence()
        jobs = self._send_saves(saves)
        until = time.monotonic() + self._opts["daemon_wait_s"]
        for rid, job in jobs:
            try:
                wait_ended(job, self._opts["job_timeout_s"] or None, lambda: until,
                           f"connector: store job of {rid}")
            except TimeoutError:
                self._stats["store_waits_given_up"] += 1
                log.error("kvhost connector: a store of request %s's window or state blocks not ended by the daemon "
                          "after %gs (%s): vLLM may reuse those blocks while it reads them", rid,
                          self._opts["daemon_wait_s"], daemon_state(job._client))
            except Exception as e:  # the keys are not stored: later lookups miss
                log.debug("kvhost connector: store job of %s: %s", rid, e)

    def _mark(self):
        """For CUDA KV caches, an event recorded on vLLM's current stream
        (its synchronize() returns once the work queued so far has run);
        None for host memory."""
        cuda = [t for t in self._tensors if getattr(t, "is_cuda", False)]
        if not cuda:
            return None
        import torch
        ev = torch.cuda.Event(blocking=True)  # the waiting thread sleeps instead of spinning
        ev.record(torch.cuda.current_stream(cuda[0].device))
        return ev

    def _send_loop(self):
        """The sender thread: sends each marked batch of stores, in order,
        once the GPU has passed its mark; ends once closing with nothing
        left to send."""
        while True:
            with self._cv:
                while not self._outbox and not self._closing:
                    self._cv.wait()
                if not self._outbox:
                    return
                mark, saves = self._outbox[0]
            try:
                mark.synchronize()
                self._send_saves(saves)
            except Exception as e:  # a CUDA error: these keys are not stored
                log.error("kvhost connector: stores not sent: %s", e)
                with self._lock:
                    self._stats["store_skipped_keys"] += sum(len(t.keys) for t in saves)
            finally:
                with self._cv:
                    self._outbox.popleft()
                    for t in saves:
                        self._unsent[t.req_id] -= 1
                        if self._unsent[t.req_id] <= 0:
                            del self._unsent[t.req_id]
                    self._cv.notify_all()

    def _send_saves(self, saves):
        """Sends store jobs for saves; returns [(request id, job)]."""
        client, sent = self._client, []
        for t in saves:
            for i in range(0, len(t.keys), p.MAX_KEYS_PER_REQUEST):
                sl = slice(i, i + p.MAX_KEYS_PER_REQUEST)
                try:
                    cache = self._caches.get((t.ns, t.group)) if self._caches is not None else None
                    if cache is None:
                        raise ValueError(f"salt namespace {t.ns!r} is not in this worker's salt_namespaces")
                    job = client.store(cache, t.keys[sl], t.blocks[sl], block=False)
                except (KvhostError, ConnectionLost, OSError, ValueError) as e:
                    log.warning("kvhost connector: store: %s", e)
                    with self._cv:
                        self._stats["store_failed_keys"] += len(t.keys[sl])
                        if lost_connection(e, client):
                            self._lost_locked(client, reason(e))
                    continue
                with self._lock:
                    self._stores[t.req_id].append(job)
                    self._stats["store_jobs"] += 1
                    self._stats["store_keys"] += len(t.keys[sl])
                sent.append((t.req_id, job))
        return sent

    def _settle_stores(self, req_id, wait, until=None):
        """Drops req_id's finished store jobs (with wait, waiting for its
        stores to be sent and for every one to end, until until: monotonic,
        None: however long); True when none is left to send or in flight."""
        with self._cv:
            while wait and self._unsent.get(req_id):
                left = None if until is None else until - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._cv.wait(left)
            jobs = self._stores.pop(req_id, [])
        left = []
        for job in jobs:
            if not job.done() and not wait:
                left.append(job)
                continue
            try:
                r = wait_ended(job, self._opts["job_timeout_s"] or None, lambda: until,
                               f"connector: store job of {req_id}")
                with self._lock:
                    self._stats["stored_keys"] += r.count(p.OUTCOME_STORED)
                    self._stats["present_keys"] += r.count(p.OUTCOME_PRESENT)
                    self._stats["bytes_stored"] += r.bytes
            except TimeoutError:  # past until (shutdown): the process's exit ends it
                left.append(job)
            except Exception as e:  # the keys are not stored: later lookups miss
                with self._lock:
                    self._stats["store_failed_jobs"] += 1
                log.debug("kvhost connector: store job of %s: %s", req_id, e)
        with self._lock:
            if left:
                self._stores[req_id] = left + self._stores.get(req_id, [])
            return req_id not in self._stores and not self._unsent.get(req_id)

    def wait_stores(self, req_ids, until=None):
        """Waits for the stores of req_ids to be sent and to end, and for
        their loads given up (preempted requests: vLLM reuses their blocks
        next, and nothing holds them, so however long the daemon takes,
        logged), or until until (monotonic: shutdown)."""
        for rid in req_ids:
            self._settle_stores(rid, True, until)
            with self._lock:
                jobs = list(self._given_up.get(rid, ()))
            if jobs and until is None:
                log.warning("kvhost connector: preempted request %s has %d load jobs the daemon has not ended; "
                            "waiting for them before vLLM reuses its blocks", rid, len(jobs))
            for j in jobs:
                try:
                    wait_ended(j, self._opts["load_timeout_s"] or None, lambda: until,
                               f"connector: given-up load job of {rid}")
                except Exception:  # ended (refused, connection closed), or past until
                    pass

    def finished(self, finished_req_ids):
        """The ids of finished requests whose stores have all ended (vLLM
        frees their blocks then): those finished now and earlier. vLLM
        calls it every step: a connection the daemon closed is noticed
        here, and connected again before the next load if it can."""
        self._usable()
        for rid in finished_req_ids or ():
            if rid in self._saving or rid in self._loaded:
                self._finishing.add(rid)
        done = {rid for rid in list(self._finishing)
                if self._settle_stores(rid, False) and not self._loads_pending(rid)}
        self._finishing -= done
        self._saving -= done
        self._loaded -= done
        with self._lock:
            others = [r for r in self._stores if r not in self._finishing]
        for rid in others:
            self._settle_stores(rid, False)
        return done

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
