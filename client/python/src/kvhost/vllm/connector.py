"""KvhostConnector: a vLLM KV connector (KVConnectorBase_V1) with
layer-wise loads and a load-or-recompute split.

The scheduler half finds a prompt's cached prefix in the daemon's shared
lookup table, claims the part of it whose layer-wise load ends no later
than the computation of the rest (``_split``), pins its keys and hands the
workers, per step, the keys and GPU blocks to load and to save. The worker
half registers its per-layer KV-cache tensors with the daemon and submits
the step's loads at once, one daemon job per group of ``layers_per_load``
layers, so that ``wait_for_layer_load(layer i)`` waits only for the job
holding layer i; saves are whole keys, submitted once the forward pass has
written every layer (``wait_for_save``), and vLLM keeps a finished
request's blocks until they are stored (``request_finished`` /
``get_finished``). A load that fails (a checksum, a missing file, a
timeout) reports its blocks through ``get_block_ids_with_load_errors`` in
the same step: with ``kv_load_failure_policy`` "recompute" vLLM discards
the step's output and computes them again, never answering from wrong
bytes.

docs/vllm.md ("The KV connector") has the configuration and its options.
"""

import collections
import collections.abc
import dataclasses
import logging
import math
import os
import re
import threading
import time
import types

from .. import protocol as p
from ..client import ConnectionLost, Geometry, KvhostError, Layer
from . import _namespace as ns_
from . import spec_compat as sc
from ._common import (DAEMON_WAIT_S, DaemonAbsent, Reconnects, UnsupportedVLLM, absent_if_late, absent_if_stopping,
                      check_daemon_wait, check_request_timeout, check_seconds, daemon_key, daemon_state,
                      lost_connection, merge_options, open_client, reason, setup_timeout, vllm_installed, wait_ended)
from ._removals import ConnectorRemovals, kv_event_api, parse_media
from ._split import CostModel

log = logging.getLogger("vllm.kvhost")

IDENTITY_FORMAT = "kvhost-vllm-connector-v1"

CONNECTOR_WINDOW = (
    "vLLM with KVConnectorBase_V1 (vllm.distributed.kv_transfer.kv_connector.v1.base: "
    "get_num_new_matched_tokens, update_state_after_alloc, build_connector_meta, request_finished, "
    "start_load_kv, wait_for_layer_load, save_kv_layer, wait_for_save, get_finished, "
    "get_block_ids_with_load_errors) and build_offloading_config "
    "(kv_connector.v1.offloading.config); run against 017e9f44 and 2f41c894")

# Tokens per key where neither block_size nor blocks_per_chunk is given:
# 128 keys for a 32K-token prompt keep the scheduler's lookup short.
DEFAULT_CHUNK_TOKENS = 256

OPTIONS = {
    "socket": None,             # the daemon's socket (default: $KVHOST_SOCKET, ...)
    "namespace": "",            # extra text in the namespace identity
    "client_name": "vllm-connector",
    "max_tracked_keys": 1 << 16,  # chunks announced stored whose removal is reported (docs/routers.md)
    "mount_media": None,        # {daemon mount index: medium name}: a move between media is reported
    "layers_per_load": 4,       # layers per load job (4: the fastest on the H200; 1: every layer waits only for its own)
    "layer_groups": "ramp",     # "ramp": the first and last load jobs one layer each, the rest layers_per_load; "even"
    "load_split": "auto",       # "auto": load or recompute; "all": claim every cached token; "off": load nothing
    "load_gbps": 2.0,           # the load rate the split starts from (GB/s, per worker), then measured
    "load_latency_ms": 1.0,     # a load's fixed cost
    "prefill_us_per_token": 20.0,     # prefill model: linear term (microseconds per token)
    "prefill_ns_per_token2": 1.0,     # prefill model: attention term (ns per token x context token)
    "prefill_fixed_ms": 0.0,    # prefill model: fixed cost of a step
    "split_min_gain": 0.05,     # recompute a cached token only to save more than this fraction of TTFT
    "load_rate_alpha": 0.2,     # EWMA weight of a measured load in the rate
    "load_rate_recover_s": 30.0,  # unmeasured, the learned rate moves half way back to load_gbps per this (0: never)
    "tensor_layout": "blocks",  # "blocks": (num_blocks, ...) per layer; "planes": (2, num_blocks, ...)
    "page_layout": None,        # the workers' page byte order ("FLASH_ATTN/NHD"), where not the default's
    "page_bytes": None,         # bytes per layer and GPU block, where the config cannot say
    "pin_lease_s": 60.0,        # lease of the scheduler's pins of keys to load (a safety net)
    "load_timeout_s": 30.0,     # a layer's load not done after this is cancelled; its blocks recomputed
    "job_timeout_s": 120.0,     # a store not done after this is asked to cancel (and waited for)
    "reconnect_s": 1.0,         # after a lost daemon connection, how often to connect again (0: never)
    "request_timeout_s": 30.0,  # how long a request waits for the daemon's reply
    "daemon_wait_s": DAEMON_WAIT_S,  # the longest a vLLM call (start, a layer's load, shutdown) waits on the daemon
    "save": True,               # store newly computed prompt chunks
    "salt_namespaces": None,    # {cache_salt: name}: a request of that salt keeps its keys in namespace name's
}

# A salt namespace's name: it goes into the namespace's model id
# ("vllm-conn@<name>:..."), which a [[budget]] table of the daemon names.
_SALT_NAME = re.compile(r"[A-Za-z0-9._-]{1,32}")

# Namespaces one connection may declare (docs/protocol.md, limits).
_MAX_NAMESPACES = 64

# kv_connector_extra_config keys read by vLLM's build_offloading_config
# (tokens per key), accepted.
VLLM_KEYS = frozenset({"block_size", "blocks_per_chunk", "canonical_layout"})

SPLITS = ("auto", "all", "off")
# Steps whose work the scheduler keeps for their forward passes' times (and
# passes a worker keeps until their events have run).
WORK_STEPS = 64
LAYER_GROUPS = ("ramp", "even")
TENSOR_LAYOUTS = ("blocks", "planes")


def options(extra):
    """The connector's options from kv_connector_extra_config, checked;
    unknown keys are refused by name."""
    if extra is None:
        extra = {}
    o = merge_options(extra, OPTIONS, VLLM_KEYS, "connector")
    if not o["socket"]:
        from .tier import default_socket
        o["socket"] = default_socket()
    check_seconds(o, ("pin_lease_s", "load_timeout_s", "job_timeout_s", "reconnect_s"))
    check_request_timeout(o)
    check_daemon_wait(o)
    for k in ("layers_per_load", "max_tracked_keys"):
        n = o[k]
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"kvhost.vllm: {k}: want an integer >= 1, got {n!r}")
    parse_media(o["mount_media"])
    if o["layer_groups"] not in LAYER_GROUPS:
        raise ValueError(f"kvhost.vllm: layer_groups: want one of {', '.join(LAYER_GROUPS)}, got {o['layer_groups']!r}")
    if o["load_split"] not in SPLITS:
        raise ValueError(f"kvhost.vllm: load_split: want one of {', '.join(SPLITS)}, got {o['load_split']!r}")
    if o["tensor_layout"] not in TENSOR_LAYOUTS:
        raise ValueError(f"kvhost.vllm: tensor_layout: want one of {', '.join(TENSOR_LAYOUTS)}, "
                         f"got {o['tensor_layout']!r}")
    if not 1 <= o["pin_lease_s"] <= p.MAX_LEASE_MS / 1000:
        raise ValueError(f"kvhost.vllm: pin_lease_s: want 1..{p.MAX_LEASE_MS // 1000}, got {o['pin_lease_s']!r}")
    for k in ("save",):
        if not isinstance(o[k], bool):
            raise ValueError(f"kvhost.vllm: {k}: want true or false, got {o[k]!r}")
    if not isinstance(o["namespace"], str):
        raise ValueError(f"kvhost.vllm: namespace: want a string, got {o['namespace']!r}")
    salts = o["salt_namespaces"] or {}
    if not isinstance(salts, collections.abc.Mapping):
        raise ValueError(f"kvhost.vllm: salt_namespaces: want a mapping of cache_salt to a name, got {salts!r}")
    for salt, name in salts.items():
        if not isinstance(salt, str) or not salt:
            raise ValueError(f"kvhost.vllm: salt_namespaces: a salt must be a non-empty string, got {salt!r}")
        if not isinstance(name, str) or not _SALT_NAME.fullmatch(name):
            raise ValueError(f"kvhost.vllm: salt_namespaces: the name of a salt must be 1-32 of A-Z a-z 0-9 . _ -, "
                             f"got {name!r}")
    o["salt_namespaces"] = dict(salts)
    pb = o["page_bytes"]
    if pb is not None and (isinstance(pb, bool) or not isinstance(pb, int) or pb <= 0):
        raise ValueError(f"kvhost.vllm: page_bytes: want bytes per layer and GPU block (an integer > 0), got {pb!r}")
    for k in ("load_gbps", "load_latency_ms", "prefill_us_per_token", "prefill_ns_per_token2", "prefill_fixed_ms",
              "split_min_gain", "load_rate_alpha", "load_rate_recover_s"):
        v, least = o[k], 0 if k != "load_gbps" else math.ulp(0)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not least <= v < 1e12:
            raise ValueError(f"kvhost.vllm: {k}: want a number {'> 0' if least else '>= 0'}, got {v!r}")
    if not 0 < o["load_rate_alpha"] <= 1:
        raise ValueError(f"kvhost.vllm: load_rate_alpha: want 0 < alpha <= 1, got {o['load_rate_alpha']!r}")
    return o


def layer_groups(layers, per_load, shape="ramp"):
    """The (first, count) layer ranges of one step's load jobs, in layer
    order: per_load layers each ("even"), or ("ramp") the first and the
    last one layer each and per_load layers each between them. Where the
    loads are slower than the forward pass, layer 0 waits for the first
    job and the last job's layers are computed after every load has
    ended: one-layer ends shorten both, and the larger jobs between them
    keep the daemon's cost per job low."""
    if shape == "even" or per_load == 1 or layers <= 2:
        return [(f, min(per_load, layers - f)) for f in range(0, layers, per_load)]
    inner = [(f, min(per_load, layers - 1 - f)) for f in range(1, layers - 1, per_load)]
    return [(0, 1)] + inner + [(layers - 1, 1)]


def cost_model(o, bytes_per_token):
    """The split's CostModel of options o, for bytes_per_token."""
    return CostModel(bytes_per_token, o["load_gbps"], o["load_latency_ms"] / 1e3, o["prefill_us_per_token"] / 1e6,
                     o["prefill_ns_per_token2"] / 1e9, o["prefill_fixed_ms"] / 1e3, o["split_min_gain"],
                     o["load_rate_alpha"], o["load_rate_recover_s"])


# -- identity ------------------------------------------------------------------


def default_page_layout(environ=None):
    """The page byte order of vLLM's default configuration for this
    connector (which requires no KV cache layout): DEFAULT_BACKEND with
    VLLM_KV_CACHE_LAYOUT, else NHD; never the cross-layer slab (the
    connector does not prefer cross-layer blocks)."""
    env = (os.environ if environ is None else environ).get(ns_.LAYOUT_ENV)
    if env is not None and env not in ns_.LAYOUTS:
        raise ValueError(f"kvhost.vllm: {ns_.LAYOUT_ENV}={env!r}: want NHD or HND (vLLM refuses it too)")
    return ns_.page_layout_text([[ns_.DEFAULT_BACKEND]], env or "NHD", False)


def identity(config, o):
    """What every key of this engine's connector shares (JSON-safe): the
    tier's and spec's identity rule (model, dtype, tokens per hash and
    key, parallel sizes, KV-cache groups: _namespace.identity) with this
    connector's format, page layout, tensor layout and page size.
    IdentityUnknown names a field vLLM did not give."""
    layout = o["page_layout"] if o["page_layout"] is not None else default_page_layout()
    ident = ns_.identity(config, IDENTITY_FORMAT, o["namespace"] or "", collapse=False, layout=layout)
    groups = sc.groups(ident)
    if len(groups) != 1:
        raise ValueError(f"kvhost.vllm: KvhostConnector supports one KV-cache group (full attention); this model "
                         f"has {len(groups)}: use KvhostOffloadingSpec (docs/vllm.md)")
    sc.blocks_per_chunk(config)
    ident["page_bytes"] = sc.page_bytes(config, o)
    ident["tensor_layout"] = o["tensor_layout"]
    if o["tensor_layout"] == "planes" and ident["page_bytes"] % 2:
        raise ValueError(f"kvhost.vllm: a page of {ident['page_bytes']} bytes cannot be split into K and V planes")
    return ident


def geometry(ident, shard, salt_ns=None):
    """The daemon geometry of the connector's keys at one worker shard:
    one layer per model layer, one plane per layer ("blocks" tensors: a
    block's page is one extent) or two ("planes": K and V apart), each
    block a page's share in bytes, blocks_per_chunk blocks per key. With
    salt_ns (a salt_namespaces name) the namespace of that name's
    requests: model id "vllm-conn@<salt_ns>:...", which a budget of the
    daemon can name apart."""
    planes = 2 if ident["tensor_layout"] == "planes" else 1
    heads, head = ns_.block_shape(ident["page_bytes"] // planes, "page")
    f = ident["fields"]
    desc = {**ident, "group": 0, "shard": shard}
    prefix = "vllm-conn"
    if salt_ns is not None:
        desc["salt_namespace"] = salt_ns
        prefix = f"vllm-conn@{salt_ns}"
    return Geometry(model=ns_.model_id(desc, prefix), layers=len(sc.groups(ident)[0]["layer_names"]),
                    kv_heads=heads, head_size=head, dtype_size=1, tokens_per_block=1,
                    tokens_per_key=sc.chunk_blocks(ident), mla=planes == 1, tp_rank=shard,
                    tp_size=f["tp_size"] * f["pcp_size"])


def offloading_config(vllm_config, kv_cache_config, extra):
    """vLLM's OffloadingConfig of the engine (what the spec and the tier
    name their identity from), built by vLLM's own build_offloading_config,
    with DEFAULT_CHUNK_TOKENS tokens per key where the options name none."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import build_offloading_config
    config = build_offloading_config(vllm_config, kv_cache_config)
    if "block_size" not in extra and "blocks_per_chunk" not in extra:
        tpb = {g.tokens_per_block for g in config.groups}
        if len(tpb) == 1 and DEFAULT_CHUNK_TOKENS % next(iter(tpb)) == 0:
            cache = dataclasses.replace(config.cache, blocks_per_chunk=DEFAULT_CHUNK_TOKENS // next(iter(tpb)))
            config = dataclasses.replace(config, cache=cache)
    return config


# -- what travels from the scheduler to the workers ------------------------------


class Transfer:
    """One request's keys to load or to save this step, and per key the GPU
    block ids (NO_BLOCK for a block the load leaves out: already on the
    GPU). ns: the salt_namespaces name whose namespace holds the keys
    (None: the engine's own). Picklable."""
    __slots__ = ("req_id", "keys", "blocks", "ns")

    def __init__(self, req_id, keys, blocks, ns=None):
        self.req_id, self.keys, self.blocks = req_id, list(keys), [list(b) for b in blocks]
        self.ns = ns

    def __reduce__(self):
        return (Transfer, (self.req_id, self.keys, self.blocks, self.ns))

    def __repr__(self):
        return f"Transfer({self.req_id!r}, {len(self.keys)} keys)"


class ConnectorMetadata:
    """The scheduler's word to the workers for one step (what
    build_connector_meta returns and bind_connector_metadata takes): loads
    and saves (lists of Transfer), the ids of requests preempted this step,
    and the step's number (its loads' end is reported back with it; 0 for
    metadata built by hand). Picklable."""

    def __init__(self, loads=(), saves=(), preempted=(), step=0):
        self.loads, self.saves, self.preempted = list(loads), list(saves), set(preempted)
        self.step = int(step)

    def __reduce__(self):
        return (ConnectorMetadata, (self.loads, self.saves, self.preempted, self.step))


class WorkerMeta:
    """What a worker tells the scheduler after a step
    (build_connector_worker_meta): the steps whose loads ended (their pins
    can go), the bytes the loads moved and the seconds they took, for the
    split's load rate, and computes, (step, seconds) of forward passes
    without loads the worker timed, for its prefill model. vLLM joins the
    workers' (aggregate)."""

    def __init__(self, nbytes=0, seconds=0.0, steps=(), computes=()):
        self.nbytes, self.seconds, self.steps = int(nbytes), float(seconds), tuple(steps)
        self.computes = tuple((int(s), float(t)) for s, t in computes)

    def aggregate(self, other):
        """Both workers' bytes, the slower one's time, either's steps, and
        per step the slower worker's forward pass (ranks run in step)."""
        computes = dict(self.computes)
        for s, t in other.computes:
            computes[s] = max(t, computes.get(s, 0.0))
        return WorkerMeta(self.nbytes + other.nbytes, max(self.seconds, other.seconds),
                          sorted(set(self.steps) | set(other.steps)), sorted(computes.items()))

    def __reduce__(self):
        return (WorkerMeta, (self.nbytes, self.seconds, self.steps, self.computes))


# -- the scheduler half -------------------------------------------------------------


class _ReqState:
    """The scheduler's record of one request: its keys so far, its block
    ids, the lookup's answer, what it claimed, and its saves."""
    __slots__ = ("req", "keys", "digests", "blocks", "computed", "hit", "claimed", "next_save", "saved", "loaded",
                 "ns")

    def __init__(self, req, ns=None):
        self.req, self.keys, self.blocks = req, [], []
        self.ns = ns            # the salt_namespaces name of its cache_salt (None: the engine's namespace)
        self.digests = {}       # ns -> (client, the keys' key_digests so far): hashed once per key
        self.computed = self.hit = self.claimed = 0
        self.next_save = 0      # the first chunk not yet stored nor known stored
        self.saved = False      # a save of it went to the workers (request_finished delays the free)
        self.loaded = False     # a load of it went to the workers (request_finished delays the free)


class _Half(Reconnects):
    """What the scheduler and worker halves share: one daemon connection
    (_client), connected again after a loss (Reconnects), and its close."""

    _client = None

    def _current(self):
        return self._client

    def _usable(self):
        """The connection in use, None where there is none: never
        connected, lost (a thread connects again), or found closed by the
        daemon now (then marked lost, which starts that thread)."""
        client = self._client
        if client is None or self._broken is not None:
            return None
        if not client.connected():
            with self._cv:
                self._lost_locked(client, "the daemon closed the connection")
            return None
        return client

    def _close(self, until=None):
        """Stops connecting again and closes the connection; a connection
        try under way is waited for until until (monotonic; None: now
        plus daemon_wait_s). Idempotent."""
        with self._cv:
            if self._closing:
                return
            self._closing = True
            self._cv.notify_all()
        self._join_reconnectors(until if until is not None else time.monotonic() + self._opts["daemon_wait_s"])
        with self._lock:
            client = self._client
        if client is not None:
            client.close()


class ConnectorScheduler(_Half):
    """The scheduler half: lookups through the shared lookup table, the
    split, pins of the keys to load, and each step's metadata."""

    def __init__(self, config, ident, opts):
        self._opts = o = opts
        self._ident = ident
        self._what = "connector scheduler"
        self._bpc = sc.chunk_blocks(ident)
        grp = sc.groups(ident)[0]
        self._tpb = grp["tokens_per_block"]
        self._chunk = self._bpc * self._tpb
        self._tph = ns_.count(config, "cache.tokens_per_hash", "tokens per hash")
        self._hpc = self._chunk // self._tph
        self._tp = sc.shards(config)
        layers = len(grp["layer_names"])
        self.cost = cost_model(o, ident["page_bytes"] * layers / self._tpb)
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._reqs = {}
        self._loads = {}                       # req id -> Transfer, for the next build_connector_meta
        self._pins = {}                        # step -> (when, the pin ids its loads hold)
        self._step_pins = []
        self._steps = 0                        # steps built
        self._work = {}                        # step -> its requests' (total, cached) tokens, for the prefill model
        self._stats = collections.Counter()
        self._broken, self._closing, self._reconnectors = None, False, []
        # A request made in vLLM's call that the daemon left unanswered for
        # daemon_wait_s (frozen, stuck) stops every later one until a probe
        # thread finds it answering (_timed_out); unpins wait for that.
        self._unanswered, self._unpin_later = False, []
        self.namespaces = [geometry(ident, r).model for r in range(self._tp)]
        self._salts = o["salt_namespaces"]
        # The namespaces' names: None (the engine's) and each salt's name.
        self._ns_names = [None] + sorted(set(self._salts.values()))
        if len(self._ns_names) * self._tp > _MAX_NAMESPACES:
            raise ValueError(f"kvhost.vllm: salt_namespaces: {len(self._ns_names) - 1} names and the engine's own "
                             f"namespace, each at {self._tp} ranks, are more than the {_MAX_NAMESPACES} namespaces "
                             f"a connection may declare")
        try:
            self._client, self._ns = self._open()
        except DaemonAbsent as e:
            if o["reconnect_s"] <= 0:
                raise
            self._client, self._ns = None, None
            self._start_unconnected(reason(e.__cause__))
        # BlockStored of the chunks its saves stored, and BlockRemoved of
        # those the daemon drops, from a connection of their own, where
        # vLLM's KV events are on (docs/routers.md). A chunk is held where
        # every rank's namespace of its salt name holds it.
        events, api = bool(getattr(config, "enable_kv_cache_events", False)), None
        if events:
            try:
                api = kv_event_api()
            except ImportError as e:  # a vLLM without them: nothing to report with
                events = False
                log.warning("kvhost connector: vLLM's KV-event classes do not import (%s): no KV events", e)
        where = [(i, r) for i in range(len(self._ns_names)) for r in range(self._tp)]
        self._removals = ConnectorRemovals(
            api, o["socket"], [geometry(ident, r, self._ns_names[i]) for i, r in where],
            groups=[i for i, _ in where], medium=getattr(api, "medium", "STORAGE"),
            media=parse_media(o["mount_media"]), events=events, name=o["client_name"] + "-removals",
            max_tracked=o["max_tracked_keys"], reconnect_s=o["reconnect_s"], timeout=setup_timeout(o),
            what="connector removals")

    def _open(self):
        o = self._opts
        # The handshake and the declarations wait daemon_wait_s at most (a
        # start runs in vLLM's call), later requests request_timeout_s.
        client = open_client(o["socket"], o["client_name"], setup_timeout(o),
                             " (set the connector option \"socket\" or KVHOST_SOCKET)")
        try:
            nss = {}  # salt name (None: the engine's) -> its namespace at each rank
            for name in self._ns_names:
                nss[name] = []
                for r in range(self._tp):
                    geo = geometry(self._ident, r, name)
                    nss[name].append(client.declare(geo))
                    ns_.check_served(nss[name][-1].fingerprint, geo)
            # Every request of the scheduler's is made in a vLLM call
            # (lookups, pins, unpins): none waits past daemon_wait_s.
        except BaseException as e:
            client.close()
            absent_if_stopping(e, o["socket"])
            absent_if_late(e, o["socket"])
            raise
        return client, nss

    def _swap_locked(self, new):
        self._client, self._ns = new

    def _on_lost_locked(self):
        """The pins ended with the connection: their ids are never sent to
        the next one (where they may name pins of its own)."""
        self._pins.clear()
        self._step_pins = []
        self._unpin_later = []

    def _ask(self):
        """The connection for a request made in a vLLM call: None where
        none is usable, or while the daemon leaves one unanswered."""
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

    # -- lookups ---------------------------------------------------------------

    def _keys(self, st):
        """The request's keys so far: one per whole chunk of its block
        hashes (vLLM's offload key of the chunk's last hash, group 0),
        as the daemon names them. Grown as the request's hashes grow."""
        hashes = st.req.block_hashes
        n = len(hashes) // self._hpc
        keys = st.keys
        if len(keys) < n:
            tail = (0).to_bytes(4, "big")
            for i in range(len(keys), n):
                keys.append(daemon_key(bytes(hashes[(i + 1) * self._hpc - 1]) + tail))
        return keys

    def _state(self, request):
        st = self._reqs.get(request.request_id)
        if st is None or st.req is not request:
            salt = getattr(request, "cache_salt", None)
            st = self._reqs[request.request_id] = _ReqState(request, self._salts.get(salt) if salt else None)
        return st

    def hit_tokens(self, request, computed):
        """The end of the contiguous cached prefix from computed on (in
        tokens, chunk-aligned; computed where nothing beyond it is cached),
        found in the daemon's shared lookup table (the daemon is asked
        where the table cannot answer)."""
        st = self._state(request)
        keys = self._keys(st)
        total = getattr(request, "num_prompt_tokens", None) or request.num_tokens
        last = min(len(keys), (total - 1) // self._chunk)  # vLLM computes at least one token
        first = computed // self._chunk
        if last <= first:
            return computed
        client, nss = self._ask(), self._ns
        if client is None:
            return computed
        nss = nss[st.ns]
        try:
            n = last - first
            for ns in nss:  # every rank must hold a key
                n = min(n, self._leading(client, ns, keys, first, n, self._digests(st, client, ns, keys)))
        except (KvhostError, ConnectionLost, OSError, ValueError) as e:
            self._stats["lookup_errors"] += 1
            if isinstance(e, TimeoutError):
                self._timed_out(client, e)
            elif lost_connection(e, client):
                with self._cv:
                    self._lost_locked(client, reason(e))
            else:
                log.warning("kvhost connector: lookup: %s", e)
            return computed
        return max(computed, (first + n) * self._chunk)

    @staticmethod
    def _digests(st, client, ns, keys):
        """The request's keys' places in the lookup table (key_digests),
        made once per key and grown with its keys, for this connection;
        None where the client cannot read the table."""
        d = st.digests.get(ns)
        if d is None or d[0] is not client:
            d = st.digests[ns] = (client, bytearray())
        have = len(d[1]) // 16
        if have < len(keys):
            more = client.key_digests(ns, keys[have:])
            if more is None:
                return None
            d[1].extend(more)
        return d[1]

    @staticmethod
    def _leading(client, ns, keys, first, n, digests=None):
        """How many of keys[first:first + n] ns holds in a row, asked in
        requests of at most MAX_KEYS_PER_REQUEST keys (probed by their
        digests where there are)."""
        held = 0
        while held < n:
            want = min(n - held, p.MAX_KEYS_PER_REQUEST)
            a, b = first + held, first + held + want
            if digests is not None:
                got = client.lookup_digests(ns, keys[a:b], digests[16 * a:16 * b])
            else:
                got = client.lookup(ns, keys[a:b])
            held += got
            if got < want:
                break
        return held

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        """(K - num_computed_tokens, False): K, the tokens cached after this
        step's load, is the split's choice within the hit prefix (all of it
        with load_split "all", none with "off"). Loads run within the step,
        layer by layer: never asynchronous."""
        self._stats["lookups"] += 1
        if self._opts["load_split"] == "off" or getattr(request, "skip_reading_prefix_cache", False):
            return 0, False
        st = self._state(request)
        hit = self.hit_tokens(request, num_computed_tokens)
        total = getattr(request, "num_prompt_tokens", None) or request.num_tokens
        if hit <= num_computed_tokens:
            k = num_computed_tokens
        elif self._opts["load_split"] == "all":
            k = hit
        else:
            k = self.cost.split(total, num_computed_tokens, hit, self._chunk)
        st.computed, st.hit, st.claimed = num_computed_tokens, hit, k
        if hit > num_computed_tokens:
            self._stats["hit_tokens"] += hit - num_computed_tokens
            self._stats["claimed_tokens"] += k - num_computed_tokens
        return k - num_computed_tokens, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        """Records the blocks the claimed keys load into, and pins the keys
        in every rank's namespace so that no eviction comes before the
        workers' load (released once the step's output is back)."""
        st = self._state(request)
        ids = _block_ids(blocks)
        if ids is not None:
            st.blocks = list(ids)
        # The chunks found stored, and those in vLLM's GPU prefix cache
        # (computed, and saved, by an earlier request), are not saved again.
        st.next_save = max(st.next_save, st.hit // self._chunk, st.computed // self._chunk)
        if num_external_tokens <= 0:
            return
        start = st.computed
        end = start + num_external_tokens
        first, last = start // self._chunk, end // self._chunk
        keys = self._keys(st)[first:last]
        per = []
        skip = start // self._tpb  # blocks already on the GPU
        for i in range(first, last):
            slots = st.blocks[i * self._bpc:(i + 1) * self._bpc]
            per.append([p.NO_BLOCK if i * self._bpc + j < skip else b for j, b in enumerate(slots)])
        if any(len(b) != self._bpc for b in per):
            log.warning("kvhost connector: request %s: %d blocks for %d keys of %d blocks; loading none",
                        request.request_id, len(st.blocks), len(keys), self._bpc)
            per, keys = [], []
        if keys:
            self._loads[request.request_id] = Transfer(request.request_id, keys, per, st.ns)
            self._pin(keys, st.ns)

    def _pin(self, keys, name=None):
        client, nss = self._ask(), self._ns
        if client is None:
            return
        nss = nss[name]
        try:
            for ns in nss:
                for i in range(0, len(keys), p.MAX_KEYS_PER_REQUEST):
                    pin_id, ok = client.pin(ns, keys[i:i + p.MAX_KEYS_PER_REQUEST], self._opts["pin_lease_s"])
                    if pin_id:
                        self._step_pins.append(pin_id)
                    self._stats["pin_missed_keys"] += sum(1 for h in ok if not h)
        except Exception as e:  # the load finds out: its blocks are recomputed
            self._stats["pin_errors"] += 1
            log.debug("kvhost connector: pin: %s", e)
            if isinstance(e, TimeoutError):
                self._timed_out(client, e)

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
            st.blocks = list(nr.block_ids[0])
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
                    st.blocks = list(new[0]) if rid in resumed else st.blocks + list(new[0])
                self._save(st, cr.num_computed_tokens[i] + sched.get(rid, 0), saves)
        preempted = getattr(scheduler_output, "preempted_req_ids", None) or set()
        self._steps += 1
        self._note_work(scheduler_output, sched)
        meta = ConnectorMetadata(list(self._loads.values()), saves, preempted, self._steps)
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
        end = min(end, len(keys), len(st.blocks) // self._bpc)
        if end <= st.next_save:
            return
        first = st.next_save
        blocks = [st.blocks[i * self._bpc:(i + 1) * self._bpc] for i in range(first, end)]
        saves.append(Transfer(st.req.request_id, keys[first:end], blocks, st.ns))
        st.next_save = end
        st.saved = True
        if self._removals.events_on:
            self._announce(st.req, keys, first, end, self._ns_names.index(st.ns))

    def _announce(self, req, keys, first, end, group):
        """Hands chunks first..end-1 of req to the removal machinery: a
        BlockStored of each (its block hashes, parent, tokens) once the
        daemon holds it in every rank's namespace, its BlockRemoved after."""
        hashes = req.block_hashes
        tokens = getattr(req, "all_token_ids", None) or []
        lora = getattr(req, "lora_request", None)
        for i in range(first, end):
            a, b = i * self._hpc, (i + 1) * self._hpc
            self._removals.saved(keys[i], [bytes(h) for h in hashes[a:b]], bytes(hashes[a - 1]) if a else None,
                                 list(tokens[i * self._chunk:(i + 1) * self._chunk]), self._tph,
                                 lora_id=getattr(lora, "adapter_id", None), lora_name=getattr(lora, "name", None),
                                 group=group)

    def take_events(self):
        """BlockStored and BlockRemoved since the last call, without waiting
        on the daemon."""
        return self._removals.take_events()

    def update_connector_output(self, connector_output):
        """Releases the pins of the steps whose loads the workers ended (and
        of steps older than the pins' lease, which ended them anyway), and
        takes the workers' measured loads into the split's load rate. vLLM
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
            self.cost.observe_load(wm.nbytes, wm.seconds)
            self._stats["load_measurements"] += 1
        for step, seconds in getattr(wm, "computes", ()):
            work = self._work.pop(step, None)
            if work and self.cost.observe_compute(work, seconds):
                self._stats["compute_measurements"] += 1

    def _unpin(self, pins):
        client = self._client
        with self._cv:
            if self._unanswered:  # sent once the daemon answers again (_probe)
                self._unpin_later += pins
                return
        for i, pin_id in enumerate(pins):
            try:
                client.unpin(pin_id)
            except TimeoutError as e:
                with self._cv:
                    self._unpin_later += pins[i:]
                self._timed_out(client, e)
                return
            except Exception as e:  # the connection's end releases them anyway
                log.debug("kvhost connector: unpin: %s", e)

    def request_finished(self, request, block_ids):
        """(True, None) where a save or a load of the request went to the
        workers: vLLM keeps its blocks until every worker's get_finished
        reports the request (its stores, and any load a worker gave up
        waiting for, ended: the daemon writes no more into them);
        (False, None) otherwise."""
        st = self._reqs.pop(request.request_id, None)
        self._loads.pop(request.request_id, None)
        return (st is not None and (st.saved or st.loaded)), None

    def counters(self):
        """The scheduler's counters since it started (for tests and tools)."""
        s = dict(self._stats)
        s["load_gbps"] = self.cost.load_gbps
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


def _block_ids(blocks):
    """Group 0's block ids of vLLM's KVCacheBlocks (or a plain list)."""
    if blocks is None:
        return None
    get = getattr(blocks, "get_block_ids", None)
    if get is not None:
        ids = get()
        return list(ids[0]) if ids else []
    return list(blocks)


# -- the worker half ---------------------------------------------------------------


class _Step:
    """The loads of one step: its number (the scheduler's), per layer
    group its daemon jobs (each with the block lists of its keys), the
    groups waited for, when they started and ended, the bytes moved."""
    __slots__ = ("number", "jobs", "waited", "t0", "nbytes", "t_end", "layer_group", "gave_up", "lost",
                 "sent", "daemon_s")

    def __init__(self, number, layer_group):
        self.number, self.jobs, self.waited = number, {}, set()
        self.gave_up = False  # a group's wait gave up: the later groups' are not waited for either
        self.lost = 0  # bytes of the jobs given up (finish_loads)
        self.t0, self.nbytes, self.t_end = time.monotonic(), 0, None
        self.sent = 0.0  # seconds from t0 to the last job's submission
        self.daemon_s = 0.0  # the longest job, submission to completion, as the daemon timed it
        self.layer_group = layer_group  # layer index -> its group's index


class ConnectorWorker(_Half):
    """The worker half: the registered KV caches, the step's load jobs per
    layer group, and store jobs in flight per request."""

    def __init__(self, config, ident, opts):
        self._opts = opts
        self._ident = ident
        self._bpc = sc.chunk_blocks(ident)
        self._names = list(sc.groups(ident)[0]["layer_names"])
        self._index = {n: i for i, n in enumerate(self._names)}
        self.rank = ns_.count(config, "parallel.rank", "worker rank", least=0)
        self.shard = sc.shard_of(config)
        self._what = f"connector worker {self.rank}"
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._broken, self._closing, self._reconnectors = None, False, []
        self._client = self._caches = None              # salt name (None: the engine's) -> cache id
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
        Every layer of the identity's group must be there, each (num_blocks,
        ...) with a contiguous page per block ("blocks") or (2, num_blocks,
        ...) with a contiguous half page per plane and block ("planes");
        other layouts are refused (ValueError)."""
        missing = [n for n in self._names if n not in kv_caches]
        if missing:
            raise ValueError(f"kvhost.vllm: register_kv_caches got no tensor for layer(s) {', '.join(missing[:4])} "
                             f"of the {len(self._names)} the engine's KV-cache group names")
        tensors = [kv_caches[n] for n in self._names]
        self._check_layout()
        self._nblocks = min(self._blocks_of(t, n) for t, n in zip(tensors, self._names))
        self._tensors = tensors
        try:
            self._client, self._caches, self._regions = self._open()
        except DaemonAbsent as e:
            if self._opts["reconnect_s"] <= 0:
                raise
            self._start_unconnected(reason(e.__cause__))
        log.info("kvhost connector: worker rank %d registered %d layers (%d blocks) in namespace %s", self.rank,
                 len(tensors), self._nblocks, self.namespace)

    def _check_layout(self):
        """Refuses pages whose byte order is not the identity's, where vLLM
        can say what this worker got (spec_worker.observe_layout)."""
        from . import spec_worker
        seen = spec_worker.observe_layout(sc.groups(self._ident))
        if seen is None:
            return
        backends, layout = seen
        got = ns_.page_layout_text(backends, layout, False)
        want = self._ident["page_layout"]
        if got != want:
            raise ValueError(f"kvhost.vllm: this worker's KV pages are {got} but the connector's namespace says "
                             f"{want}: pages of another byte order must never share keys; refusing to start. Set "
                             f"the connector option \"page_layout\": \"{got}\" on every engine whose workers get "
                             "these pages")

    def _blocks_of(self, t, name):
        """The number of blocks of layer tensor t, once its layout is the
        identity's tensor_layout with contiguous pages of page_bytes."""
        page, es, shape = self._ident["page_bytes"], t.element_size(), tuple(t.shape)
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
        from .spec_worker import SpecWorker
        o = self._opts
        client = open_client(o["socket"], f"{o['client_name']}-worker{self.rank}", setup_timeout(o))
        regions = {}
        try:
            planes = self._ident["tensor_layout"] == "planes"
            layers = []
            for t in self._tensors:
                es = t.element_size()
                st = t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()
                addr = st.data_ptr()
                if addr not in regions:
                    if getattr(t, "is_cuda", False):
                        regions[addr] = (client.register_cuda_tensor(t), 0)
                    else:
                        regions[addr] = SpecWorker._register_host(client, addr, st.nbytes())
                region, base = regions[addr]
                off = base + t.storage_offset() * es
                if planes:
                    layers.append(Layer(region, offset=off, block_stride=t.stride(1) * es,
                                        plane_stride=t.stride(0) * es, num_blocks=self._nblocks))
                else:
                    layers.append(Layer(region, offset=off, block_stride=t.stride(0) * es, plane_stride=0,
                                        num_blocks=self._nblocks))
            caches = {}  # one per namespace, over the same layers
            for name in self._ns_names:
                geo = geometry(self._ident, self.shard, name)
                ns = client.declare(geo)
                ns_.check_served(ns.fingerprint, geo)
                caches[name] = client.register_cache(ns, layers)
            client.set_timeout(o["request_timeout_s"])
        except BaseException as e:
            client.close()
            absent_if_stopping(e, o["socket"])
            absent_if_late(e, o["socket"])
            raise
        return client, caches, regions

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
        """Submits the step's loads (meta.loads) at once: one daemon job per
        group of layers (layer_groups; one job for every layer where the
        daemon cannot load a layer range), in layer order. A step without
        loads has its forward pass timed (begin_pass) instead."""
        self._step = None
        loads = [t for t in getattr(meta, "loads", ()) if t.keys]
        if not loads:
            self._begin_pass(getattr(meta, "step", 0))
            return
        nl = len(self._names)
        lpl = self._opts["layers_per_load"] if self._client is not None and self.layer_loads() else nl
        groups = layer_groups(nl, lpl, self._opts["layer_groups"])
        step = _Step(getattr(meta, "step", 0), [g for g, (_, n) in enumerate(groups) for _ in range(n)])
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
        step.t0 = time.monotonic()
        for g, (first, count) in enumerate(groups):
            jobs = step.jobs[g] = []
            for name, ts in parts:
                self._load_jobs(client, name, ts, first, count, len(groups) > 1, jobs)
        step.sent = time.monotonic() - step.t0
        self._stats["load_jobs"] += sum(len(j) for j in step.jobs.values())
        self._stats["load_keys"] += len(keys)

    def _load_jobs(self, client, name, loads, first, count, ranged, jobs):
        """Sends the load jobs of loads (all of salt namespace name) for
        layers [first, first + count) (the whole key where not ranged),
        appending (job, blocks, owners) to jobs."""
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
        i = self._index.get(layer_name)
        if i is None:
            return
        g = step.layer_group[i] if step.layer_group[i] in step.jobs else 0
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
        (log.warning if first else log.debug)("kvhost connector: a load job of layer group %d not ended by the daemon after %gs (%s): given "
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
                pages = sum(x != p.NO_BLOCK for b in blocks for x in b) * step.layer_group.count(g)
                step.lost += pages * self._ident["page_bytes"]
                continue
            except Exception as e:  # refused, or the connection closed: recomputed
                log.warning("kvhost connector: load of layer group %d failed: %s", g, e)
                self._fail(blocks)
                if lost_connection(e, job._client):
                    with self._cv:
                        self._lost_locked(job._client, reason(e))
                continue
            step.nbytes += r.bytes
            step.daemon_s = max(step.daemon_s, r.duration_ns / 1e9)
            failed = [b for (o, _), b in zip(r.keys, blocks) if o != p.OUTCOME_LOADED]
            failed += blocks[len(r.keys):]
            if failed:
                self._stats["load_failed_keys"] += len(failed)
                log.warning("kvhost connector: %d of %d keys not loaded in layer group %d (%s): vLLM recomputes "
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
        if self._usable() is None:
            self._stats["store_skipped_keys"] += sum(len(t.keys) for t in saves)
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
        client = self._client
        for t in saves:
            for i in range(0, len(t.keys), p.MAX_KEYS_PER_REQUEST):
                sl = slice(i, i + p.MAX_KEYS_PER_REQUEST)
                try:
                    cache = self._caches.get(t.ns) if self._caches is not None else None
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
        computes = self._timed_passes()
        return WorkerMeta(nbytes, secs, steps, computes) if steps or nbytes or computes else None

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


# -- the connector ------------------------------------------------------------------


# The worker counters vLLM's KV-transfer stats carry (get_kv_connector_stats).
STAT_KEYS = ("load_jobs", "load_keys", "load_failed_keys", "bytes_loaded", "load_seconds", "store_jobs", "store_keys",
             "stored_keys", "present_keys", "store_failed_jobs", "bytes_stored")


def stats_class(base):
    """KvhostConnectorStats over vLLM's KVConnectorStats (base): sums of
    the workers' STAT_KEYS counters over an interval; reduce adds the load
    rate (GB/s). Pickled by its data (the class is made here, when vLLM is
    there: it is rebuilt on the other side through kvhost.vllm)."""

    class KvhostConnectorStats(base):
        """The connector workers' transfer counters of an interval."""

        def reset(self):
            self.data = {}

        def aggregate(self, other):
            for k, v in (other.data or {}).items():
                self.data[k] = self.data.get(k, 0) + v
            return self

        def reduce(self):
            d = dict(self.data)
            if d.get("load_seconds"):
                d["load_gbps"] = round(d.get("bytes_loaded", 0) / d["load_seconds"] / 1e9, 3)
            return d

        def is_empty(self):
            return not any(self.data.values())

        def __reduce__(self):
            return (_rebuild_stats, (dict(self.data),))

    KvhostConnectorStats.__module__ = "kvhost.vllm"
    return KvhostConnectorStats


def _rebuild_stats(data):
    """A KvhostConnectorStats of data, in a process that unpickles one."""
    from .. import vllm as package
    return package.KvhostConnector.build_kv_connector_stats(data)


def _role_name(role):
    name = getattr(role, "name", role)
    return str(name).upper()


class _ConnectorImpl:
    """KvhostConnector: vLLM's KV connector over the kvhost daemon, with
    layer-wise loads and a load-or-recompute split (docs/vllm.md).

    vLLM builds it from ``--kv-transfer-config '{"kv_connector":
    "KvhostConnector", "kv_connector_module_path": "kvhost.vllm",
    "kv_role": "kv_both", "kv_connector_extra_config": {...}}'`` as
    ``KvhostConnector(vllm_config, role, kv_cache_config)``; the identity
    (model, dtype, tokens per key, parallel sizes, layers, page size) is
    read from vLLM's own build_offloading_config of those.

    Without vLLM (a benchmark) it is built as ``KvhostConnector(None,
    "worker" or "scheduler", config=C, extra_config={...})``, C an object
    shaped like vLLM's OffloadingConfig (``model.name``, ``model.dtype``,
    ``parallel`` sizes and ``rank``, ``groups[0].tokens_per_block`` and
    ``.layer_names``, ``cache.tokens_per_hash`` and
    ``cache.blocks_per_chunk``, ``worker_kv_bytes_per_block``). Its
    worker methods then need only:

    - ``register_kv_caches({layer name: tensor})``;
    - ``bind_connector_metadata(meta)``, meta a ConnectorMetadata (from the
      scheduler half's ``build_connector_meta``, or built directly:
      ``ConnectorMetadata(loads=[Transfer(req_id, keys, blocks)], saves=[...])``,
      keys the daemon keys, blocks per key its GPU block ids);
    - ``start_load_kv(None)``, then per layer ``wait_for_layer_load(name)``
      and ``save_kv_layer(name, None, None)``, then ``wait_for_save()``,
      ``get_finished(finished ids)``, ``get_block_ids_with_load_errors()``
      and ``clear_connector_metadata()``. No forward context nor attention
      metadata field is read.

    The scheduler half reads of a request ``request_id``, ``block_hashes``
    (vLLM's, one per tokens_per_hash tokens), ``num_prompt_tokens`` (or
    ``num_tokens``) and ``skip_reading_prefix_cache``; of a scheduler
    output ``scheduled_new_reqs`` (``req_id``, ``block_ids``,
    ``num_computed_tokens``), ``scheduled_cached_reqs`` (``req_ids``,
    ``new_block_ids``, ``num_computed_tokens``, ``resumed_req_ids``),
    ``num_scheduled_tokens`` and ``preempted_req_ids``."""

    _api = None
    _stats_cls = None

    def __init__(self, vllm_config, role, kv_cache_config=None, config=None, extra_config=None):
        base = getattr(self._api, "KVConnectorBase_V1", None)
        if base is not None and isinstance(self, base) and vllm_config is not None:
            base.__init__(self, vllm_config, role, kv_cache_config)
        else:
            self._connector_metadata = None
            self._role = role
        if extra_config is None:
            ktc = getattr(vllm_config, "kv_transfer_config", None)
            extra_config = getattr(ktc, "kv_connector_extra_config", None)
            if extra_config is None and config is not None:
                extra_config = getattr(config, "extra_config", None)
        extra_config = dict(extra_config or {})
        self._opts = o = options(extra_config)
        if config is None:
            config = offloading_config(vllm_config, kv_cache_config, extra_config)
        self._config = config
        self._ident = identity(config, o)
        self._scheduler = self._worker = None
        if _role_name(role) == "SCHEDULER":
            self._scheduler = ConnectorScheduler(config, self._ident, o)
            ktc = getattr(vllm_config, "kv_transfer_config", None)
            if getattr(ktc, "kv_load_failure_policy", None) == "fail":
                log.warning("kvhost connector: kv_load_failure_policy is \"fail\": a load that fails (an evicted "
                            "or corrupted file) fails its request; set \"kv_load_failure_policy\":\"recompute\" in "
                            "--kv-transfer-config to have vLLM compute those tokens instead")
        else:
            self._worker = ConnectorWorker(config, self._ident, o)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config):
        """True: layer-wise loads wait inside the forward pass, which a whole
        CUDA graph would skip (vLLM then captures piecewise graphs)."""
        return True

    # -- worker side -----------------------------------------------------------

    def bind_connector_metadata(self, connector_metadata):
        """Sets the step's ConnectorMetadata (vLLM's model runner calls it
        before the forward pass)."""
        self._connector_metadata = connector_metadata

    def clear_connector_metadata(self):
        """Clears the step's metadata (after the forward pass)."""
        self._connector_metadata = None

    def has_connector_metadata(self):
        """Whether a step's metadata is bound."""
        return self._connector_metadata is not None

    def register_kv_caches(self, kv_caches):
        """Registers the worker's per-layer KV caches with the daemon."""
        self._worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context, **kwargs):
        """Submits the step's loads, one job per layer group (forward_context
        is not read)."""
        self._worker.start_load(self._connector_metadata)

    def wait_for_layer_load(self, layer_name):
        """Waits for the load of layer_name's group only."""
        self._worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        """Nothing: keys hold every layer, so stores go once all layers are
        computed (wait_for_save)."""
        return None

    def wait_for_save(self):
        """Ends the step's loads (their failures into this step's load
        errors) and submits its stores without waiting for them: vLLM keeps
        the blocks of a finished request until get_finished reports it."""
        self._worker.end_pass()
        self._worker.finish_loads()
        if self._connector_metadata is not None:
            self._worker.start_saves(self._connector_metadata)

    def handle_preemptions(self, kv_connector_metadata):
        """Waits for the stores of the requests preempted this step (their
        blocks are overwritten next)."""
        self._worker.wait_stores(getattr(kv_connector_metadata, "preempted", ()) or ())

    def get_finished(self, finished_req_ids):
        """(finished requests whose stores have ended, None): loads are
        synchronous, never finished here."""
        done = self._worker.finished(finished_req_ids)
        return (done or None), None

    def get_block_ids_with_load_errors(self):
        """The block ids of this step's loads that failed (every load job
        of the step is waited for first)."""
        return self._worker.take_errors()

    def get_kv_connector_stats(self):
        """The workers' transfer counters since the last call, as vLLM's
        KVConnectorStats (None where nothing moved, or without vLLM)."""
        cls = self._stats_cls
        if cls is None or self._worker is None:
            return None
        delta = self._worker.stats_delta()
        return cls(data=delta) if any(delta.values()) else None

    @classmethod
    def build_kv_connector_stats(cls, data=None):
        """vLLM's KVConnectorStats of data (the workers' counters, summed),
        for its KV-transfer logging; None without vLLM's class."""
        return cls._stats_cls(data=dict(data or {})) if cls._stats_cls is not None else None

    def build_connector_worker_meta(self):
        """The step's measured loads (WorkerMeta) for the scheduler's split."""
        return self._worker.worker_meta() if self._worker is not None else None

    # -- scheduler side --------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        """(tokens to load beyond num_computed_tokens, False): the split's
        share of the cached prefix, loaded within the step."""
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        """Records the blocks to load into and pins their keys."""
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output):
        """The step's ConnectorMetadata (loads, saves, preempted ids)."""
        return self._scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output):
        """Releases the pins of a finished step; takes in measured loads."""
        self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request, block_ids):
        """(True, None) while the request's blocks are being saved."""
        return self._scheduler.request_finished(request, block_ids)

    def take_events(self):
        """The scheduler half's KV events: BlockStored of the chunks its
        saves stored (once the daemon holds them) and BlockRemoved of those
        the daemon dropped since (docs/routers.md); never waits on the
        daemon."""
        return self._scheduler.take_events() if self._scheduler is not None else ()

    def counters(self):
        """This half's counters (scheduler or worker), for tests and tools."""
        return (self._scheduler or self._worker).counters()

    @property
    def cost_model(self):
        """The scheduler half's CostModel (None on a worker)."""
        return self._scheduler.cost if self._scheduler is not None else None

    def shutdown(self):
        """Waits for stores in flight, closes the daemon connection."""
        for half in (self._scheduler, self._worker):
            if half is not None:
                half.shutdown()


def detect_connector():
    """vLLM's connector classes (a namespace: KVConnectorBase_V1,
    KVConnectorRole), plain None without vLLM; UnsupportedVLLM for a vLLM
    without them."""
    if not vllm_installed():
        return types.SimpleNamespace(name="standalone (vLLM not installed)", KVConnectorBase_V1=None,
                                     KVConnectorRole=None)
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1 import base
    except ImportError as e:
        raise UnsupportedVLLM(f"kvhost.vllm: the installed vLLM has no KVConnectorBase_V1 ({e}); "
                              f"supported: {CONNECTOR_WINDOW}") from e
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    except ImportError:  # stats are optional: the connector runs without them
        KVConnectorStats = None
    return types.SimpleNamespace(name="vllm", KVConnectorBase_V1=base.KVConnectorBase_V1,
                                 KVConnectorRole=base.KVConnectorRole, KVConnectorStats=KVConnectorStats)


def connector_class(api=None):
    """A KvhostConnector class bound to api (a namespace with
    KVConnectorBase_V1, None for plain classes); None detects vLLM."""
    api = detect_connector() if api is None else api
    base = getattr(api, "KVConnectorBase_V1", None)
    bases = (_ConnectorImpl,) if base is None else (_ConnectorImpl, base)
    stats = getattr(api, "KVConnectorStats", None)
    cls = type("KvhostConnector", bases, {"_api": api, "__module__": "kvhost.vllm", "__doc__": _ConnectorImpl.__doc__,
                                          "_stats_cls": stats_class(stats) if stats is not None else None})
    abstract = sorted(getattr(cls, "__abstractmethods__", ()) or ())
    if abstract:
        raise UnsupportedVLLM(f"kvhost.vllm: this vLLM requires connector methods kvhost does not implement: "
                              f"{', '.join(abstract)}; supported: {CONNECTOR_WINDOW}")
    return cls


__all__ = ["CONNECTOR_WINDOW", "ConnectorMetadata", "CostModel", "Transfer", "WorkerMeta", "connector_class",
           "identity", "geometry", "options"]
