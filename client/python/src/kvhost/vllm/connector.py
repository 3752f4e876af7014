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

import logging
import types

from ._common import UnsupportedVLLM, vllm_installed
from ._conn_common import (CONNECTOR_WINDOW, DEFAULT_CHUNK_TOKENS, IDENTITY_FORMAT, OPTIONS, STAT_KEYS,
                           ConnectorMetadata, Transfer, WorkerMeta, cost_model, default_page_layout, geometry,
                           identity, layer_groups, offloading_config, options)
from . import _conn_groups as groups_
from ._conn_scheduler import ConnectorScheduler
from ._conn_stages import StageIdentity
from ._removals import event_specs
from ._conn_worker import ConnectorWorker
from ._split import CostModel

log = logging.getLogger("vllm.kvhost")


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
        self._ident = identity(config, o, kv_cache_config)
        self._scheduler = self._worker = None
        if _role_name(role) == "SCHEDULER":
            self._scheduler = ConnectorScheduler(config, self._ident, o, event_specs(kv_cache_config))
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

    def get_handshake_metadata(self):
        """This worker's StageIdentity under pipeline parallelism (vLLM
        hands every worker's to the scheduler half at start:
        set_xfer_handshake_metadata_pp_aware), else None (nothing to tell:
        the scheduler's identity is every worker's)."""
        if self._worker is None or groups_.stages(self._config) == 1:
            return None
        return StageIdentity(self._worker.stage, self._worker.shard, self._ident)

    def build_connector_worker_meta(self):
        """The step's measured loads (WorkerMeta) for the scheduler's split."""
        return self._worker.worker_meta() if self._worker is not None else None

    # -- scheduler side --------------------------------------------------------

    def set_xfer_handshake_metadata_pp_aware(self, metadata):
        """Takes in the workers' handshake metadata ({(pp rank, tp rank):
        metadata}): every pipeline stage's StageIdentity, whose namespaces
        the lookups then cover (others' metadata, under vLLM's
        MultiConnector, is ignored)."""
        if self._scheduler is not None:
            self._scheduler.learn_stages(list((metadata or {}).values()))

    def set_xfer_handshake_metadata(self, metadata):
        """The handshake metadata of stage 0's workers ({tp rank:
        metadata}), as vLLM's call without pipeline stages hands it."""
        self.set_xfer_handshake_metadata_pp_aware({(0, r): m for r, m in (metadata or {}).items()})

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

    def request_finished_all_groups(self, request, block_ids):
        """(True, None) while the request's blocks are being saved or
        loaded: vLLM's call with every KV-cache group's block ids (the
        connector is SupportsHMA, so vLLM keeps its hybrid KV-cache
        manager on)."""
        return self._scheduler.request_finished_all_groups(request, block_ids)

    @property
    def requires_kv_delivery(self):
        """False: kvhost is a best-effort cache (a save dropped by a
        preemption is a later miss), so vLLM need not recompute a preempted
        request whose save is pending."""
        return False

    def take_events(self):
        """The scheduler half's KV events: BlockStored of the chunks its
        saves stored (once the daemon holds them) and BlockRemoved of those
        the daemon dropped since (docs/routers.md); never waits on the
        daemon."""
        return self._scheduler.take_events() if self._scheduler is not None else ()

    def counters(self):
        """This half's counters (scheduler or worker), for tests and tools."""
        return (self._scheduler or self._worker).counters()

    def load_timeline(self):
        """The worker half's last loading step, job by job, timed (for
        tools: ConnectorLoads.load_timeline); empty on a scheduler."""
        return self._worker.load_timeline() if self._worker is not None else []

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
                                 KVConnectorRole=base.KVConnectorRole, KVConnectorStats=KVConnectorStats,
                                 SupportsHMA=getattr(base, "SupportsHMA", None))


def connector_class(api=None):
    """A KvhostConnector class bound to api (a namespace with
    KVConnectorBase_V1, None for plain classes); None detects vLLM."""
    api = detect_connector() if api is None else api
    base = getattr(api, "KVConnectorBase_V1", None)
    bases = (_ConnectorImpl,) if base is None else (_ConnectorImpl, base)
    hma = getattr(api, "SupportsHMA", None)
    if base is not None and hma is not None:
        bases += (hma,)  # vLLM keeps its hybrid KV-cache manager on (request_finished_all_groups)
    stats = getattr(api, "KVConnectorStats", None)
    cls = type("KvhostConnector", bases, {"_api": api, "__module__": "kvhost.vllm", "__doc__": _ConnectorImpl.__doc__,
                                          "_stats_cls": stats_class(stats) if stats is not None else None})
    abstract = sorted(getattr(cls, "__abstractmethods__", ()) or ())
    if abstract:
        raise UnsupportedVLLM(f"kvhost.vllm: this vLLM requires connector methods kvhost does not implement: "
                              f"{', '.join(abstract)}; supported: {CONNECTOR_WINDOW}")
    return cls


__all__ = ["CONNECTOR_WINDOW", "DEFAULT_CHUNK_TOKENS", "IDENTITY_FORMAT", "OPTIONS", "STAT_KEYS", "ConnectorMetadata",
           "ConnectorScheduler", "ConnectorWorker", "CostModel", "Transfer", "WorkerMeta", "connector_class",
           "cost_model", "default_page_layout", "geometry", "identity", "layer_groups", "offloading_config",
           "options"]
