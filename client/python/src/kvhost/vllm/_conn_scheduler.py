"""KvhostConnector's scheduler half: lookups through the daemon's shared
lookup table, the load-or-recompute split, pins of the keys to load, and
each step's ConnectorMetadata (docs/vllm.md, "The KV connector")."""

import collections
import logging
import threading
import time

from .. import protocol as p
from . import _conn_groups as groups_
from . import _conn_stages as stages_
from . import _namespace as ns_
from . import _pages as pages_
from ._common import daemon_state, setup_timeout
from ._conn_common import (_MAX_NAMESPACES, WORK_STEPS, ConnectorMetadata, Transfer, WorkerMeta, _Half, cost_model,
                           geometry, start_rate_from_mounts)
from ._conn_lookups import SchedulerLookups
from ._connect import connect
from ._removals import ConnectorRemovals, kv_event_api, parse_media

log = logging.getLogger("vllm.kvhost")


class ConnectorScheduler(SchedulerLookups, _Half):
    """The scheduler half: lookups through the shared lookup table, the
    split, pins of the keys to load, and each step's metadata."""

    def __init__(self, config, ident, opts, event_specs=None):
        self._opts = o = opts
        self._ident = ident
        self._what = "connector scheduler"
        self._bpc = pages_.chunk_blocks(ident)
        self._groups = groups_.groups(ident)
        # Claims of a model with window or state groups must end where
        # those hold what the end needs (_claimable).
        self._hybrid = any(g.kind in (groups_.WINDOW, groups_.STATE) for g in self._groups)
        grp = pages_.groups(ident)[0]
        self._tpb = grp["tokens_per_block"]
        self._chunk = self._bpc * self._tpb
        self._tph = ns_.count(config, "cache.tokens_per_hash", "tokens per hash")
        self._hpc = self._chunk // self._tph
        self._tp = groups_.shards(config)
        # Every pipeline stage's identity (its layers name its namespaces):
        # None until each stage's workers have told it (learn_stages);
        # meanwhile nothing is claimed.
        self._pp = groups_.stages(config)
        self._stages = [ident] if self._pp == 1 else None
        self._stage_groups = None  # per stage its KVGroups, with _stages under pipeline parallelism
        layers = max(1, len(grp["layer_names"]))  # (stage 0's; a stage may hold none of group 0)
        self.cost = cost_model(o, ident["page_bytes"] * layers / self._tpb, layers)
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._reqs = {}
        self._loads = {}                       # req id -> [Transfer per group], for the next build_connector_meta
        self._load_errors = {}                 # req id -> block ids of a claim that cannot load (reported failed)
        self._pins = {}                        # step -> (when, the pins its loads hold: ids, or PendingPins)
        self._step_pins = []
        # The pins and unpins sent whose replies have not come, in the
        # order sent, each with its connection (_pin, _unpin, _ask).
        self._unreplied = collections.deque()
        self._steps = 0                        # steps built
        self._work = {}                        # step -> its requests' (total, cached) tokens, for the prefill model
        self._passes = {}                      # step -> [work, the slowest rank's seconds so far, the output first reporting it]
        self._outputs = 0                      # update_connector_output calls with a WorkerMeta
        self._stats = collections.Counter()
        self._broken, self._closing, self._reconnectors = None, False, []
        # A request made in vLLM's call that the daemon left unanswered for
        # daemon_wait_s (frozen, stuck) stops every later one until a probe
        # thread finds it answering (_timed_out); unpins wait for that.
        self._unanswered, self._unpin_later = False, []
        self.namespaces = [geometry(ident, r).model for r in range(self._ranks(0))]  # group 0's at each rank
        self._salts = o["salt_namespaces"]
        # The namespaces' names: None (the engine's) and each salt's name.
        self._ns_names = [None] + sorted(set(self._salts.values()))
        per_name = self._pp * sum(self._ranks(g) for g in range(len(self._groups)))
        if len(self._ns_names) * per_name > _MAX_NAMESPACES:
            raise ValueError(f"kvhost.vllm: salt_namespaces: {len(self._ns_names) - 1} names and the engine's own "
                             f"namespace, each of {per_name} namespaces (KV-cache groups at each rank of each "
                             f"pipeline stage), are more than the {_MAX_NAMESPACES} namespaces a connection may "
                             "declare")
        conn, absent = self._connect_at_start()
        self._client, self._ns = conn or (None, None)
        if absent is not None:
            self._start_unconnected(absent)
        # BlockStored of the chunks its saves stored, and BlockRemoved of
        # those the daemon drops, from a connection of their own, where
        # vLLM's KV events are on (docs/routers.md).
        self._events, self._event_api = bool(getattr(config, "enable_kv_cache_events", False)), None
        # Per KV-cache group, (kind, sliding window) as its events name them.
        self._event_specs = list(event_specs or ()) + [(None, None)] * (len(self._groups) - len(event_specs or ()))
        if self._events:
            try:
                self._event_api = kv_event_api()
            except ImportError as e:  # a vLLM without them: nothing to report with
                self._events = False
                log.warning("kvhost connector: vLLM's KV-event classes do not import (%s): no KV events", e)
        self._removals = self._make_removals()

    def _make_removals(self):
        """The removal machinery over every known stage's namespaces at
        each rank, of each salt name and KV-cache group: a group's chunk
        is held where every namespace of its salt name and group holds it
        (_event_group)."""
        o, api = self._opts, self._event_api
        where = [(i, g, ident, r) for i in range(len(self._ns_names)) for g in range(len(self._groups))
                 for ident in self._stages or [self._ident] if stages_.group_here(ident, g)
                 for r in range(self._ranks(g))]
        return ConnectorRemovals(
            api, o["socket"], [geometry(ident, r, self._ns_names[i], g) for i, g, ident, r in where],
            groups=[self._event_group(i, g) for i, g, _, _ in where], medium=getattr(api, "medium", "STORAGE"),
            media=parse_media(o["mount_media"]), events=self._events, name=o["client_name"] + "-removals",
            max_tracked=o["max_tracked_keys"], reconnect_s=o["reconnect_s"], timeout=setup_timeout(o),
            what="connector removals")

    def _event_group(self, salt, group):
        """The removal machinery's group of namespaces of salt name index
        salt and KV-cache group group."""
        return salt * len(self._groups) + group

    def _declare(self, client, stages):
        """{salt name (None: the engine's): per KV-cache group its
        namespaces at each rank of each stage of stages (identities) that
        holds layers of it}, declared on client."""
        nss = {}
        for name in self._ns_names:
            nss[name] = []
            for g in range(len(self._groups)):
                at = []
                for ident in stages:
                    if not stages_.group_here(ident, g):
                        continue
                    for r in range(self._ranks(g)):
                        geo = geometry(ident, r, name, g)
                        at.append(client.declare(geo))
                        ns_.check_served(at[-1].fingerprint, geo)
                nss[name].append(at)
        return nss

    def _open(self):
        def set_up(client):
            out = client, self._declare(client, self._stages or [self._ident])
            start_rate_from_mounts(self.cost, client, self._opts)
            return out
        # Every request of the scheduler's is made in a vLLM call (lookups,
        # pins, unpins): none waits past daemon_wait_s.
        return connect(self._opts, self._opts["client_name"], set_up,
                       " (set the connector option \"socket\" or KVHOST_SOCKET)", request_timeout=False)

    def learn_stages(self, metas):
        """Takes in the workers' StageIdentity values (vLLM's handshake
        metadata, at start): with every pipeline stage's identity known,
        lookups and pins cover every stage's namespaces (declared now on
        the connection there is, by _open on a later one). A stage that
        did not report leaves claims off (logged). ValueError: a stage
        disagrees with the scheduler's identity beyond its layers."""
        if self._pp == 1:
            return
        idents = stages_.stage_identities(self._ident, self._pp, metas)
        if idents is None:
            log.warning("kvhost connector: not every one of the %d pipeline stages' workers told the scheduler its "
                        "layers (vLLM's KV connector handshake): nothing is claimed, prefixes are still saved",
                        self._pp)
            return
        # The split prices every stage's loads and layers from now on.
        self._stage_groups = [groups_.groups(i) for i in idents]
        self.cost.stages = stages_.costs(self._stage_groups, self._chunk, self._chunk)
        with self._cv:
            self._stages = idents
            client = self._client if self._broken is None else None
        if client is not None:
            try:
                nss = self._declare(client, idents)
            except Exception as e:  # noqa: BLE001 - the next connection declares them (_open)
                log.warning("kvhost connector: declaring the pipeline stages' namespaces: %s", e)
                with self._cv:
                    if self._client is client:
                        self._lost_locked(client, f"declaring the pipeline stages' namespaces: {e}")
            else:
                with self._cv:
                    if self._client is client:
                        self._ns = nss
        if self._events:
            old, self._removals = self._removals, self._make_removals()
            old.close(self._opts["daemon_wait_s"])
        log.info("kvhost connector: lookups cover %d pipeline stages", self._pp)

    def _ranks(self, g):
        """Ranks with a namespace of group g: one for a replicated group
        (rank 0 writes it, every rank loads it), else every shard."""
        return 1 if self._groups[g].replicated else self._tp

    def _swap_locked(self, new):
        self._client, self._ns = new

    def _on_lost_locked(self):
        """The pins ended with the connection: their ids are never sent to
        the next one (where they may name pins of its own)."""
        self._pins.clear()
        self._step_pins = []
        self._unreplied.clear()
        self._unpin_later = []

    def _ask(self):
        """The connection for a request made in a vLLM call: None where
        none is usable, or while the daemon leaves one unanswered; a pin
        or unpin sent daemon_wait_s ago and still unanswered is found
        here."""
        stale = None
        with self._lock:  # (a lost connection clears the queue from another thread)
            q = self._unreplied
            while q and q[0][1].answered():
                q.popleft()
            if q and time.monotonic() - q[0][1].sent > self._opts["daemon_wait_s"]:
                stale = q[0][0]
                q.clear()
        if stale is not None:
            self._timed_out(stale, TimeoutError(f"a pin or unpin unanswered after {self._opts['daemon_wait_s']:g}s"))
        return None if self._unanswered else self._usable()

    def _timed_out(self, client, e):
        """A request in vLLM's call waited daemon_wait_s unanswered: no
        other is made until a thread finds the daemon answering (asking
        every reconnect_s, or every second where that is 0), so that each
        call of vLLM's waits for a frozen daemon once at most; meanwhile
        nothing is claimed or pinned, and unpins wait."""
        with self._cv:
            if self._unanswered or self._closing or client is not self._client:
                return
            self._unanswered = True
            self._stats["daemon_timeouts"] += 1
        log.warning("kvhost connector scheduler: the daemon did not answer within %gs (%s; %s): claiming and "
                    "pinning nothing until it answers", self._opts["daemon_wait_s"], e, daemon_state(client))
        threading.Thread(target=self._probe, args=(client,), name="kvhost-connector-probe", daemon=True).start()

    def _probe(self, client):
        every = self._opts["reconnect_s"] or 1.0
        while True:
            with self._cv:
                deadline = time.monotonic() + every
                while not self._closing and (left := deadline - time.monotonic()) > 0:
                    self._cv.wait(left)
                if self._closing or client is not self._client:
                    break
            try:
                client.unpin(0)  # pin 0 is none: any answer will do
            except TimeoutError:
                continue
            except Exception:  # noqa: BLE001 - an answer (a refusal), or a lost connection (Reconnects takes it)
                pass
            break
        with self._cv:
            self._unanswered = False
            later, self._unpin_later = self._unpin_later, []
        if not self._closing:
            log.info("kvhost connector scheduler: the daemon answers again")
            self._unpin(later)

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        """Records the blocks the claimed keys load into, and pins the keys
        in every rank's namespace so that no eviction comes before the
        workers' load (released once the step's output is back)."""
        st = self._state(request)
        ids = _block_ids(blocks)
        if ids is not None:
            st.blocks = ids
        # The chunks found stored, and those in vLLM's GPU prefix cache
        # (computed, and saved, by an earlier request), are not saved again.
        st.next_save = max(st.next_save, st.hit // self._chunk, st.computed // self._chunk)
        if num_external_tokens <= 0:
            return
        start = st.computed
        end = start + num_external_tokens
        first = start // self._chunk
        skip = start // self._tpb  # blocks already on the GPU
        rid = request.request_id
        transfers = []
        for g in self._groups:
            ids = st.blocks[g.index] if g.index < len(st.blocks) else []
            keys = self._keys(st, g.index)
            per = groups_.load_blocks(g, list(groups_.claim_needs(g, first, end, self._chunk)), ids, self._bpc, skip,
                                      end)
            if per is None or any(c >= len(keys) for c, _ in per):
                # vLLM gave no block where the claim's KV goes: its blocks
                # are reported as load errors (vLLM computes them again).
                log.warning("kvhost connector: request %s: KV-cache group %d (%s) has no block for its part of the "
                            "%d claimed tokens; they are recomputed", rid, g.index, g.kind, num_external_tokens)
                self._stats["load_unplaceable"] += 1
                self._load_errors[rid] = sorted({b for bl in st.blocks for b in bl[skip:-(-end // self._tpb)] if b})
                return
            if per:
                transfers.append(Transfer(rid, [keys[c] for c, _ in per], [b for _, b in per], st.ns, g.index))
        if transfers:
            self._loads[rid] = transfers
            for t in transfers:
                self._pin(t.keys, st.ns, t.group)

    def _pin(self, keys, name=None, group=0):
        """Sends the pins of keys without waiting for the daemon's replies,
        so that vLLM's scheduler goes on at once (a pin of 126 keys took
        about 1.2 ms to answer); each load pins the files it reads itself.
        The replies are taken when the step's pins are released (_unpin);
        one still unanswered after daemon_wait_s is found by the next call
        that would ask the daemon (_ask)."""
        client, nss = self._ask(), self._ns
        if client is None:
            return
        nss = nss[name][group]
        try:
            for ns in nss:
                for i in range(0, len(keys), p.MAX_KEYS_PER_REQUEST):
                    pin = client.pin_later(ns, keys[i:i + p.MAX_KEYS_PER_REQUEST], self._opts["pin_lease_s"])
                    self._step_pins.append(pin)
                    with self._lock:
                        self._unreplied.append((client, pin))
        except Exception as e:  # the load finds out: its blocks are recomputed
            self._pin_failed(client, e)

    def _pin_failed(self, client, e):
        self._stats["pin_errors"] += 1
        log.debug("kvhost connector: pin: %s", e)
        if isinstance(e, TimeoutError):
            self._timed_out(client, e)

    def _pin_ids(self, client, pins):
        """The ids of pins (ids, or PendingPins whose replies are taken
        here), counting the keys they missed. A pin refused or unanswered
        holds nothing to release; while the daemon leaves a request
        unanswered each PendingPin is given up, released once its reply
        comes."""
        ids = []
        for pin in pins:
            if isinstance(pin, int):
                ids.append(pin)
            elif self._unanswered:
                pin.abandon()
            else:
                try:
                    pin_id, ok = pin.result()
                except Exception as e:  # noqa: BLE001 - refused, unanswered, or the connection gone
                    self._pin_failed(client, e)
                    continue
                self._stats["pin_missed_keys"] += sum(1 for h in ok if not h)
                if pin_id:
                    ids.append(pin_id)
        return ids

    def _layers_per_job(self, loads):
        """The layers per load job of a step's loads: sized to the tokens
        the step loads (its first KV-cache group's keys) at the learned
        rate (CostModel.layers_per_job); layers_per_load with load_job_ms 0."""
        if not loads or self._opts["load_job_ms"] <= 0:
            return 0
        first = min(getattr(t, "group", 0) for t in loads)
        tokens = sum(len(t.keys) for t in loads if getattr(t, "group", 0) == first) * self._chunk
        return self.cost.layers_per_job(tokens)

    def build_connector_meta(self, scheduler_output):
        """The step's ConnectorMetadata: the loads update_state_after_alloc
        recorded, and the chunks of prompts this step completes (whole
        chunks, not yet stored nor found stored) to save."""
        saves = []
        sched = getattr(scheduler_output, "num_scheduled_tokens", {}) or {}
        for nr in getattr(scheduler_output, "scheduled_new_reqs", ()) or ():
            st = self._reqs.get(nr.req_id)
            if st is None:
                continue
            st.blocks = _group_lists(nr.block_ids)
            self._save(st, nr.num_computed_tokens + sched.get(nr.req_id, 0), saves)
        cr = getattr(scheduler_output, "scheduled_cached_reqs", None)
        if cr is not None:
            resumed = getattr(cr, "resumed_req_ids", set()) or set()
            for i, rid in enumerate(cr.req_ids):
                st = self._reqs.get(rid)
                if st is None:
                    continue
                new = cr.new_block_ids[i]
                if new is not None:
                    new = _group_lists(new)
                    if rid in resumed or len(st.blocks) != len(new):
                        st.blocks = new
                    else:
                        st.blocks = [a + b for a, b in zip(st.blocks, new)]
                self._save(st, cr.num_computed_tokens[i] + sched.get(rid, 0), saves)
        preempted = getattr(scheduler_output, "preempted_req_ids", None) or set()
        self._steps += 1
        self._note_work(scheduler_output, sched)
        errors = [b for ids in self._load_errors.values() for b in ids]
        loads = [t for ts in self._loads.values() for t in ts]
        meta = ConnectorMetadata(loads, saves, preempted, self._steps, errors, self._layers_per_job(loads))
        self._load_errors = {}
        for t in meta.loads:
            st = self._reqs.get(t.req_id)
            if st is not None and t.keys:
                st.loaded = True
        self._stats["load_keys"] += sum(len(t.keys) for t in meta.loads)
        self._stats["save_keys"] += sum(len(t.keys) for t in saves)
        self._loads = {}
        if self._step_pins:
            self._pins[self._steps] = (time.monotonic(), self._step_pins)
            self._step_pins = []
        return meta

    def _note_work(self, out, sched):
        """Keeps what the step computes, each request's (total, cached)
        tokens, until a worker reports how long the step's forward pass
        took (steps with loads are not timed; at most WORK_STEPS kept)."""
        work = []
        for nr in getattr(out, "scheduled_new_reqs", ()) or ():
            n = sched.get(nr.req_id, 0)
            work.append((nr.num_computed_tokens + n, nr.num_computed_tokens))
        cr = getattr(out, "scheduled_cached_reqs", None)
        if cr is not None:
            for i, rid in enumerate(cr.req_ids):
                c = cr.num_computed_tokens[i]
                work.append((c + sched.get(rid, 0), c))
        if work:
            self._work[self._steps] = work
            while len(self._work) > WORK_STEPS:
                del self._work[next(iter(self._work))]

    def _save(self, st, done, saves):
        """Adds st's chunks that are whole within done tokens (and its
        prompt) to saves."""
        if not self._opts["save"]:
            return
        total = getattr(st.req, "num_prompt_tokens", None) or st.req.num_tokens
        keys = self._keys(st)
        end = min(done, total) // self._chunk
        end = min(end, len(keys), len(st.blocks[0]) // self._bpc if st.blocks else 0)
        if end <= st.next_save:
            return
        first = st.next_save
        for g in self._groups:
            gkeys = self._keys(st, g.index)
            ids = st.blocks[g.index] if g.index < len(st.blocks) else []
            ks, bs, cs = [], [], []
            for c in range(first, end):
                b = groups_.save_blocks(g, c, ids, self._bpc)
                if b is None:  # vLLM no longer holds it (outside a window, no state there)
                    self._stats["save_skipped_keys"] += 1
                    continue
                ks.append(gkeys[c])
                bs.append(b)
                cs.append(c)
            if ks:
                saves.append(Transfer(st.req.request_id, ks, bs, st.ns, g.index))
                if self._removals.events_on:
                    self._announce(st.req, gkeys, cs, self._ns_names.index(st.ns), g.index)
        st.next_save = end
        st.saved = True

    def _announce(self, req, keys, chunks, salt, group):
        """Hands the chunks (indexes) of req that KV-cache group group
        saves under keys to the removal machinery: a BlockStored of each
        (its block hashes, parent, tokens, the group's index and spec)
        once the daemon holds it in every namespace of the group and salt
        name (each rank's, each stage's), its BlockRemoved after."""
        hashes = req.block_hashes
        tokens = getattr(req, "all_token_ids", None) or []
        lora = getattr(req, "lora_request", None)
        for i in chunks:
            a, b = i * self._hpc, (i + 1) * self._hpc
            self._removals.saved(keys[i], [bytes(h) for h in hashes[a:b]], bytes(hashes[a - 1]) if a else None,
                                 list(tokens[i * self._chunk:(i + 1) * self._chunk]), self._tph,
                                 lora_id=getattr(lora, "adapter_id", None), lora_name=getattr(lora, "name", None),
                                 group_idx=group, group=self._event_group(salt, group),
                                 spec=self._event_specs[group])

    def take_events(self):
        """BlockStored and BlockRemoved since the last call, without waiting
        on the daemon."""
        return self._removals.take_events()

    def update_connector_output(self, connector_output):
        """Releases the pins of the steps whose loads the workers ended (and
        of steps older than the pins' lease, which ended them anyway), and
        takes the workers' measured loads into the split's load rate and
        their timed forward passes, each at the next output, into its
        prefill scale. vLLM
        hands no output for a step whose workers had nothing to say: a
        step with loads always has (its WorkerMeta)."""
        wm = getattr(connector_output, "kv_connector_worker_meta", None)
        if not isinstance(wm, WorkerMeta):
            return
        pins = []
        for s in wm.steps:
            pins += self._pins.pop(s, (0, []))[1]
        old = time.monotonic() - self._opts["pin_lease_s"]
        for s in [s for s, (t, _) in self._pins.items() if t < old]:
            pins += self._pins.pop(s)[1]
        self._unpin(pins)
        if wm.nbytes:
            # One worker's bytes (the split prices one worker's share of a
            # token): the joined bytes over the workers of one stage that
            # loaded (tensor-parallel ranks load their shards side by side;
            # under pipeline stages observe_load takes every stage's sum).
            stages = len(self.cost.stages or ()) or 1
            loaders = max(getattr(wm, "loaders", 1) or 1, 1)
            self.cost.observe_load(wm.nbytes * min(stages, loaders) / loaders, wm.seconds)
            self._stats["load_measurements"] += 1
        for _, latency in getattr(wm, "latencies", ()):
            self.cost.observe_latency(latency)
        # A step's forward pass is taken at the output after the one
        # that first reported it, the slowest rank's of both: a rank
        # reports a pass once its CUDA events have run, and two ranks'
        # (pipeline stages, one after the other) can come in different
        # outputs; the first alone would miss the slower one.
        self._outputs += 1
        for step, seconds in getattr(wm, "computes", ()):
            if step in self._passes:
                self._passes[step][1] = max(self._passes[step][1], seconds)
            elif (work := self._work.pop(step, None)) is not None:
                self._passes[step] = [work, seconds, self._outputs]
        for step in [s for s, (_, _, first) in self._passes.items() if first < self._outputs]:
            work, seconds, _ = self._passes.pop(step)
            if work and self.cost.observe_compute(work, seconds):
                self._stats["compute_measurements"] += 1

    def _unpin(self, pins):
        """Releases pins (ids, or PendingPins whose replies are taken
        here) without waiting for the daemon's replies; while the daemon
        leaves a request unanswered they wait for it to answer again."""
        client = self._client
        pins = self._pin_ids(client, pins)
        with self._cv:
            if self._unanswered:  # sent once the daemon answers again (_probe)
                self._unpin_later += pins
                return
        # Sent without waiting for the replies (vLLM's call returns at
        # once); one unanswered after daemon_wait_s is found by the next
        # call that would ask the daemon (_ask).
        if client is None:
            return  # the connection's end released them
        for pin_id in pins:
            try:
                pending = client.unpin_later(pin_id)
            except Exception as e:  # noqa: BLE001 - a lost connection's end releases them all
                log.debug("kvhost connector: unpin: %s", e)
                if not client.connected():
                    return
                continue
            with self._lock:
                self._unreplied.append((client, pending))

    def request_finished(self, request, block_ids):
        """(True, None) where a save or a load of the request went to the
        workers: vLLM keeps its blocks until every worker's get_finished
        reports the request (its stores, and any load a worker gave up
        waiting for, ended: the daemon writes no more into them);
        (False, None) otherwise."""
        st = self._reqs.pop(request.request_id, None)
        self._loads.pop(request.request_id, None)
        self._load_errors.pop(request.request_id, None)
        return (st is not None and (st.saved or st.loaded)), None

    def request_finished_all_groups(self, request, block_ids):
        """request_finished with vLLM's block ids of every KV-cache group
        (the hybrid KV-cache manager's call): the same answer."""
        return self.request_finished(request, block_ids)

    def counters(self):
        """The scheduler's counters since it started (for tests and tools)."""
        s = dict(self._stats)
        s["load_gbps"] = self.cost.load_gbps
        s["load_latency_ms"] = self.cost.load_latency_s * 1e3
        s["latency_measurements"] = self.cost.latency_observed
        s["prefill_scale"] = self.cost.prefill_scale
        s["pinned_steps"] = len(self._pins)
        s["connected"] = self._broken is None
        s["answering"] = not self._unanswered  # False: a request timed out, a probe waits for the daemon
        s["events"] = self._removals.counters()
        return s

    def shutdown(self):
        """Closes the connection (the daemon releases the pins). Idempotent."""
        self._close()
        self._removals.close(self._opts["daemon_wait_s"])


def _group_lists(ids):
    """Per KV-cache group a list of block ids, from vLLM's tuple of lists
    (one per group) or a plain list (one group)."""
    ids = list(ids)
    if ids and not isinstance(ids[0], (list, tuple)):
        return [ids]
    return [list(b) for b in ids]


def _block_ids(blocks):
    """Every group's block ids of vLLM's KVCacheBlocks (or a plain list:
    one group), a list per group."""
    if blocks is None:
        return None
    get = getattr(blocks, "get_block_ids", None)
    if get is not None:
        ids = get()
        return _group_lists(ids) if ids else [[]]
    return _group_lists(blocks)
