"""The connector worker's loads: each step's loads submitted at once, per
KV-cache group one daemon job per group of its layers (layer_groups),
waited for layer by layer (wait_layer) as the forward pass reaches them,
given up where the daemon does not end them in time, and timed for the
split's load rate and latency.
"""

import logging
import time

from .. import protocol as p
from ..client import ConnectionLost, KvhostError
from ._common import daemon_state, reason, wait_ended
from ._conn_common import layer_groups
from ._connect import lost_connection
from ._split import load_measure

log = logging.getLogger("vllm.kvhost")


class _Step:
    """The loads of one step: its number (the scheduler's), per layer
    group its daemon jobs (each with the block lists of its keys), the
    groups waited for, when they started and ended, the bytes moved."""
    __slots__ = ("number", "jobs", "waited", "t0", "nbytes", "t_end", "layer_group", "gave_up", "lost",
                 "sent", "daemon_s", "first", "timeline")

    def __init__(self, number, layer_group):
        self.number, self.jobs, self.waited = number, {}, set()
        self.gave_up = False  # a group's wait gave up: the later groups' are not waited for either
        self.lost = 0  # bytes of the jobs given up (finish_loads)
        self.t0, self.nbytes, self.t_end = time.monotonic(), 0, None
        self.sent = 0.0  # seconds from t0 to the last job's submission
        self.daemon_s = 0.0  # the longest job, submission to completion, as the daemon timed it
        self.first = [0, 0.0]  # the first layer group's bytes and longest job (the load's latency)
        self.layer_group = layer_group  # layer name -> its job group's key: (KV-cache group, layer group)
        # Per load job, in submission order, its entry of load_timeline
        # (filled in as its wait ends).
        self.timeline = {}


def _blocks_within(blocks, n):
    """Whether every block id of blocks but NO_BLOCK is in [0, n)."""
    if blocks and set(map(type, blocks)) == {int} and 0 <= min(blocks) and max(blocks) < n:
        return True  # the common case (ints only), at C speed
    return all(x == p.NO_BLOCK or 0 <= x < n for x in blocks)


class ConnectorLoads:
    """The loads half of the connector's worker (ConnectorWorker)."""

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
            if not nl:
                continue
            per_load = getattr(meta, "layers_per_load", 0) or self._opts["layers_per_load"]
            lgs = layer_groups(nl, per_load, self._opts["layer_groups"]) if ranged else [(0, nl)]
            for lg, (first, count) in enumerate(lgs):
                ranges[(g.index, lg)] = (first, count, len(lgs) > 1)
                for n in g.layer_names[first:first + count]:
                    where[n] = (g.index, lg)
        step = _Step(getattr(meta, "step", 0), where)
        self._step = step
        # The scheduler delays the free of these requests' blocks until
        # get_finished reports them, their loads ended.
        self._loaded.update(t.req_id for t in loads)
        # A group none of whose layers are this pipeline stage's: nothing to load here.
        loads = [t for t in loads if self._groups[t.group].layer_names]
        keys = [k for t in loads for k in t.keys]
        blocks = [b for t in loads for b in t.blocks]
        bad = [i for i, b in enumerate(blocks) if not _blocks_within(b, self._nblocks)]
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
        packed = {}  # (namespace name, group) -> its requests, packed once for every layer group (_load_jobs)
        for key in sorted(ranges, key=lambda k: (first_layer.get(k, 0), k)):
            first, count, ranged = ranges[key]
            jobs = step.jobs[key] = []
            for name, ts in parts:
                ts = [t for t in ts if t.group == key[0]]
                if ts:
                    self._load_jobs(client, (name, key[0]), ts, first, count, ranged, jobs, packed)
            sent_ms = (time.monotonic() - step.t0) * 1e3
            for job, _, _ in jobs:
                step.timeline[job] = {"group": list(key), "layers": [first, count], "sent_ms": sent_ms,
                                      "daemon_ms": None, "waited_ms": None, "bytes": 0}
        step.sent = time.monotonic() - step.t0
        self._stats["load_jobs"] += sum(len(j) for j in step.jobs.values())
        self._stats["load_keys"] += len(keys)

    def _load_jobs(self, client, name, loads, first, count, ranged, jobs, packed):
        """Sends the load jobs of loads (all of name: (salt namespace name,
        KV-cache group)) for layers [first, first + count) (the whole key
        where not ranged), appending (job, blocks, owners) to jobs. The
        requests are packed once per step, in packed (by name), for every
        layer group of the same keys."""
        if name not in packed:
            packed[name] = self._pack_loads(client, name, loads)
        for prepared, blocks, owners in packed[name]:
            try:
                job = client.load_prepared(prepared, (first, count) if ranged else None, block=False)
            except (KvhostError, ConnectionLost, OSError, ValueError) as e:
                log.warning("kvhost connector: load of layers %d-%d: %s", first, first + count - 1, e)
                self._fail(blocks)
                if lost_connection(e, client):
                    with self._cv:
                        self._lost_locked(client, reason(e))
                continue
            jobs.append((job, blocks, owners))

    def _pack_loads(self, client, name, loads):
        """The requests of loads (all of name), at most MAX_KEYS_PER_REQUEST
        keys each: (the request packed by prepare_load; its blocks; its
        requests' ids). A request that
        cannot be packed, and every request where the worker has no cache
        of name's salt namespace, is left out: its blocks are load errors."""
        keys = [k for t in loads for k in t.keys]
        blocks = [b for t in loads for b in t.blocks]
        owners = [t.req_id for t in loads for _ in t.keys]
        cache = self._caches.get(name) if self._caches is not None else None
        if cache is None:
            log.warning("kvhost connector: loads of salt namespace %r, which this worker's salt_namespaces does not "
                        "name: vLLM recomputes them", name)
            self._fail(blocks)
            return []
        out = []
        for i in range(0, len(keys), p.MAX_KEYS_PER_REQUEST):
            sl = slice(i, i + p.MAX_KEYS_PER_REQUEST)
            try:
                prepared = client.prepare_load(cache, keys[sl], blocks[sl])
            except ValueError as e:
                log.warning("kvhost connector: load of %d keys: %s", len(keys[sl]), e)
                self._fail(blocks[sl])
                continue
            out.append((prepared, blocks[sl], frozenset(owners[sl])))
        return out

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
        called_ms = (time.monotonic() - step.t0) * 1e3
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
            step.timeline[job].update(daemon_ms=r.duration_ns / 1e6, called_ms=called_ms,
                                      waited_ms=(time.monotonic() - step.t0) * 1e3, bytes=r.bytes)
            ended_at = getattr(job, "ended_at", None)  # when its completion reached this process
            if ended_at is not None:
                step.timeline[job]["received_ms"] = (ended_at - step.t0) * 1e3
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
            self._stats["bytes_loaded"] += step.nbytes
            self._stats["load_seconds"] += seconds
            # The rate from the bytes after the first layer group, the
            # load's fixed cost (opening files, a cold start) from that
            # group's time beyond its bytes at that rate (load_measure).
            nbytes, rate_s, latency = load_measure(step.nbytes, seconds, *step.first)
            self._measured[0] += nbytes
            self._measured[1] += rate_s
            if latency is not None:
                self._latencies.append((step.number, latency))
        self._done_steps.append(step.number)
        self._timeline = list(step.timeline.values())
        self._step = None

    def load_timeline(self):
        """The last step's load jobs that finish_loads ended, for tools (the
        TTFT benchmark): per job, in submission order, its group (KV-cache
        group, layer group), its layers [first, count], and in milliseconds
        from the step's first submission: when it was sent (sent_ms: once
        its layer group's jobs all were, which its completion may precede), the
        daemon's time for it from submission to completion (daemon_ms: its
        end on the daemon is near sent_ms + daemon_ms), when this process's
        reader took its completion (received_ms), when the worker began to
        wait for its group (called_ms: a layer's wait, or finish_loads) and
        when that wait returned (waited_ms), None for a job given up or
        failed; and the bytes it moved. An empty list before any step
        loaded."""
        return [dict(e) for e in self._timeline]
