"""Stand-ins of vLLM's offloading classes for CI, where vLLM's source is
not at hand. They mirror vLLM main 2026-08-17 (017e9f44): the same names,
fields, members and signatures, checked by test_vllm_contract.py against
the contract list (vllm_contract.py), which `make test-vllm VLLM_SRC=DIR`
also checks against a real vLLM tree. Tests that must run vLLM's own code
(test_vllm_real.py) never use these."""

import abc
import dataclasses
import enum
import hashlib
import types
import typing

import numpy as np


class LookupResult(enum.Enum):
    MISS = enum.auto()
    HIT = enum.auto()
    HIT_PENDING = enum.auto()
    RETRY = enum.auto()


class Medium(enum.Enum):
    CPU = "CPU"
    STORAGE = "STORAGE"


class Locality(enum.Enum):
    LOCAL = "LOCAL"
    REMOTE = "REMOTE"


class OffloadPolicy(enum.Enum):
    BLOCK_LEVEL = "block_level"
    REQUEST_LEVEL = "request_level"


@dataclasses.dataclass
class ReqContext:
    req_id: str
    kv_transfer_params: typing.Optional[dict] = None


@dataclasses.dataclass
class RequestOffloadingContext:
    policy: OffloadPolicy = OffloadPolicy.BLOCK_LEVEL


class ScheduleEndContext(typing.NamedTuple):
    new_req_ids: typing.Collection[str]
    preempted_req_ids: typing.Collection[str]


@dataclasses.dataclass
class TransferJob:
    job_id: int
    keys: typing.Collection[bytes]
    block_ids: np.ndarray
    is_promotion: bool
    req_context: ReqContext


@dataclasses.dataclass
class JobResult:
    job_id: int
    success: bool
    successful_keys: typing.Optional[typing.Collection[bytes]] = None
    transfer_time: typing.Optional[float] = None


@dataclasses.dataclass
class OffloadingEvent:
    keys: list
    medium: Medium
    removed: bool
    locality: typing.Optional[Locality] = None


@dataclasses.dataclass(frozen=True)
class OffloadingMetricMetadata:
    documentation: str
    labelnames: tuple = ()


@dataclasses.dataclass(frozen=True)
class OffloadingCounterMetadata(OffloadingMetricMetadata):
    pass


@dataclasses.dataclass(frozen=True)
class OffloadingGaugeMetadata(OffloadingMetricMetadata):
    pass


@dataclasses.dataclass
class OffloadingConnectorStats:
    """vLLM's per-step stats payload: {"types": {...}, "data": {name:
    {labelvalues: value}}}; counters add up, gauges keep the last value."""
    data: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if "data" not in self.data:
            self.reset()

    def reset(self):
        self.data = {"types": {}, "data": {}}

    def is_empty(self):
        return not self.data.get("data")

    def aggregate(self, other):
        if other.is_empty():
            return self
        for key, values in other.data["data"].items():
            kind = other.data["types"][key]
            self.data["types"].setdefault(key, kind)
            mine = self.data["data"].setdefault(key, {})
            for labels, v in values.items():
                mine[labels] = mine.get(labels, 0) + v if kind == "counter" else v
        return self

    def increase_counter(self, counter_name, counter_increase_value=1, labelvalues=()):
        self.data["types"].setdefault(counter_name, "counter")
        values = self.data["data"].setdefault(counter_name, {})
        values[labelvalues] = values.get(labelvalues, 0) + counter_increase_value

    def set_gauge(self, gauge_name, gauge_value, labelvalues=()):
        self.data["types"].setdefault(gauge_name, "gauge")
        self.data["data"].setdefault(gauge_name, {})[labelvalues] = gauge_value


# -- vLLM's OffloadingConfig (vllm/v1/kv_offload/config.py) --------------------

@dataclasses.dataclass(frozen=True)
class OffloadingGroupConfig:
    tokens_per_block: int
    layer_names: tuple


@dataclasses.dataclass(frozen=True)
class OffloadingModelConfig:
    name: str
    dtype: str


@dataclasses.dataclass(frozen=True)
class OffloadingCacheConfig:
    tokens_per_hash: int
    blocks_per_chunk: int


@dataclasses.dataclass(frozen=True)
class OffloadingParallelConfig:
    rank: int
    world_size: int
    tp_size: int
    pp_size: int
    pcp_size: int
    dcp_size: int
    data_parallel_index: int
    data_parallel_size: int
    data_parallel_rank_local: typing.Optional[int]
    is_parallelism_agnostic: bool


@dataclasses.dataclass(frozen=True)
class OffloadingConfig:
    groups: tuple
    worker_kv_bytes_per_block: int
    enable_kv_cache_events: bool
    extra_config: typing.Mapping
    engine_id: str
    model: OffloadingModelConfig
    cache: OffloadingCacheConfig
    parallel: OffloadingParallelConfig
    replicated_layout: bool = False
    canonical_layout: bool = False


@dataclasses.dataclass(frozen=True)
class OffloadingKVEventsConfig:
    enable_kv_cache_events: bool
    self_describing_kv_events: bool


class SecondaryTierManager(abc.ABC):
    medium = None

    def __init__(self, offloading_spec, primary_kv_view, tier_type):
        self._offloading_spec = offloading_spec
        self._primary_kv_view = primary_kv_view
        self.tier_type = tier_type
        self.locality = None

    @abc.abstractmethod
    def lookup(self, key, req_context): ...

    @abc.abstractmethod
    def submit_store(self, job_metadata): ...

    @abc.abstractmethod
    def submit_load(self, job_metadata): ...

    @abc.abstractmethod
    def get_finished_jobs(self): ...

    def has_pending_work(self):
        return False

    def take_events(self):
        return ()

    def touch(self, keys, req_context):
        return

    @abc.abstractmethod
    def on_new_request(self, req_context): ...

    def on_request_finished(self, req_context):
        return

    def serve_external_requests(self, parent):
        return

    def on_schedule_end(self, context):
        return

    @abc.abstractmethod
    def drain_jobs(self): ...

    def shutdown(self):
        return

    @classmethod
    def build_metric_definitions(cls, extra_config):
        return {}

    def get_stats(self):
        return None


API = types.SimpleNamespace(
    name="stand-ins (tests)", LookupResult=LookupResult, JobResult=JobResult,
    TransferJob=TransferJob, OffloadingEvent=OffloadingEvent,
    RequestOffloadingContext=RequestOffloadingContext,
    SecondaryTierManager=SecondaryTierManager, Medium=Medium, Locality=Locality,
    OffloadingConnectorStats=OffloadingConnectorStats,
    OffloadingCounterMetadata=OffloadingCounterMetadata, OffloadingGaugeMetadata=OffloadingGaugeMetadata)


def layer_names(n, start=0):
    return tuple(f"model.layers.{i}.self_attn.attn" for i in range(start, start + n))


def offloading_config(model="meta-llama/Llama-3.1-8B-Instruct", dtype="bfloat16", tp=1, rank=0,
                      layers=4, groups=1, page_bytes=4096, tokens_per_block=16, blocks_per_chunk=1,
                      agnostic=False, engine_id="engine-0", extra=None, **fields):
    """vLLM's OffloadingConfig as build_offloading_config fills it: groups
    of `layers` layers each (a hybrid model when groups > 1, its tensors
    shared across groups), pages of page_bytes per layer and block."""
    cfg = OffloadingConfig(
        groups=tuple(OffloadingGroupConfig(tokens_per_block=tokens_per_block,
                                           layer_names=layer_names(layers, g * layers)) for g in range(groups)),
        worker_kv_bytes_per_block=layers * page_bytes,
        enable_kv_cache_events=False,
        extra_config=dict(extra or {}),
        engine_id=engine_id,
        model=OffloadingModelConfig(name=model, dtype=dtype),
        cache=OffloadingCacheConfig(tokens_per_hash=tokens_per_block, blocks_per_chunk=blocks_per_chunk),
        parallel=OffloadingParallelConfig(rank=rank, world_size=tp, tp_size=tp, pp_size=1, pcp_size=1,
                                          dcp_size=1, data_parallel_index=0, data_parallel_size=1,
                                          data_parallel_rank_local=None, is_parallelism_agnostic=agnostic))
    return dataclasses.replace(cfg, **fields) if fields else cfg


class OffloadingManager(abc.ABC):
    """The scheduler side of a spec."""

    @abc.abstractmethod
    def lookup(self, key, req_context): ...

    @abc.abstractmethod
    def prepare_load(self, keys, req_context): ...

    def touch(self, keys, req_context):
        return

    def complete_load(self, keys, req_context):
        return

    @abc.abstractmethod
    def prepare_store(self, keys, req_context): ...

    def complete_store(self, keys, req_context, success=True):
        return

    @abc.abstractmethod
    def on_new_request(self, req_context): ...

    def on_request_finished(self, req_context):
        return

    def take_events(self):
        return ()

    def on_schedule_end(self, context):
        return

    def has_pending_work(self):
        return False

    def reset_cache(self):
        return

    def get_stats(self):
        return None

    def shutdown(self):
        return


class OffloadingWorker(abc.ABC):
    """The worker side of a spec: transfers for one medium."""

    @abc.abstractmethod
    def submit_store(self, job_id, src_spec, dst_spec): ...

    @abc.abstractmethod
    def submit_load(self, job_id, src_spec, dst_spec): ...

    @abc.abstractmethod
    def get_finished(self): ...

    @abc.abstractmethod
    def wait(self, job_ids): ...

    def shutdown(self):
        return


class OffloadingSpec(abc.ABC):
    def __init__(self, config):
        self.config = config
        self.extra_config = config.extra_config
        self.replicated_layout = False
        self.kv_events_config = OffloadingKVEventsConfig(
            enable_kv_cache_events=config.enable_kv_cache_events,
            self_describing_kv_events=bool(self.extra_config.get("self_describing_kv_events", False)))
        self.offload_prompt_only = bool(self.extra_config.get("offload_prompt_only", True))
        self.tokens_per_block = tuple(g.tokens_per_block for g in config.groups)
        self.tokens_per_hash = config.cache.tokens_per_hash
        self.blocks_per_chunk = config.cache.blocks_per_chunk

    @classmethod
    def build_metric_definitions(cls, extra_config):
        return {}

    @abc.abstractmethod
    def get_manager(self): ...

    @abc.abstractmethod
    def get_worker(self, kv_caches): ...


class _TieringSpec(OffloadingSpec):
    """What a secondary tier is handed as offloading_spec: an
    OffloadingSpec (vLLM's TieringOffloadingSpec) over an OffloadingConfig."""

    def get_manager(self):
        raise NotImplementedError

    def get_worker(self, kv_caches):
        raise NotImplementedError


def fake_spec(model="meta-llama/Llama-3.1-8B-Instruct", dtype="bfloat16", tp=1, layers=4, **kw):
    """The offloading spec a tier is handed (vLLM's TieringOffloadingSpec)."""
    return _TieringSpec(offloading_config(model=model, dtype=dtype, tp=tp, layers=layers, **kw))


def offload_key(token_ids, group=0):
    """An OffloadKey: a 32-byte block hash and the 4-byte big-endian group."""
    h = hashlib.sha256(repr(token_ids).encode()).digest()
    return h + group.to_bytes(4, "big")


# -- the full offloading spec (OffloadingSpec, its manager and worker) --------

@dataclasses.dataclass
class PrepareStoreOutput:
    keys_to_store: list
    store_spec: typing.Any
    evicted_keys: list


@dataclasses.dataclass
class TransferResult:
    job_id: int
    success: bool
    transfer_size: typing.Optional[int] = None
    transfer_time: typing.Optional[float] = None


class LoadStoreSpec:
    """Metadata a worker loads or stores by."""


class BlockIDsLoadStoreSpec(LoadStoreSpec, abc.ABC):
    def __init__(self, block_ids):
        self.block_ids = np.array(block_ids, dtype=np.int64)


class GPULoadStoreSpec(BlockIDsLoadStoreSpec):
    """GPU block ids ordered by KV-cache group; group_sizes[g] of them per
    group; block_indices[g] the index of group g's first block."""

    def __init__(self, block_ids, group_sizes, block_indices):
        super().__init__(block_ids)
        assert sum(group_sizes) == len(block_ids)
        assert len(block_indices) == len(group_sizes)
        self.group_sizes = group_sizes
        self.block_indices = block_indices


@dataclasses.dataclass
class CanonicalKVCacheTensor:
    tensor: typing.Any  # int8 (num_blocks, page_size_bytes)
    page_size_bytes: int


@dataclasses.dataclass
class CanonicalKVCacheRef:
    tensor_idx: int
    page_size_bytes: int
    mapping: typing.Any = None


@dataclasses.dataclass
class CanonicalKVCaches:
    tensors: list
    group_data_refs: list  # per group: [CanonicalKVCacheRef]


SPEC_API = types.SimpleNamespace(
    name="stand-ins (tests)", LookupResult=LookupResult, PrepareStoreOutput=PrepareStoreOutput,
    TransferResult=TransferResult, OffloadingEvent=OffloadingEvent,
    RequestOffloadingContext=RequestOffloadingContext, OffloadingSpec=OffloadingSpec,
    OffloadingManager=OffloadingManager, LoadStoreSpec=LoadStoreSpec, GPULoadStoreSpec=GPULoadStoreSpec,
    Medium=Medium, OffloadingWorker=OffloadingWorker, OffloadingConnectorStats=OffloadingConnectorStats,
    OffloadingCounterMetadata=OffloadingCounterMetadata, OffloadingGaugeMetadata=OffloadingGaugeMetadata)


def fake_offloading_config(socket, model="meta-llama/Llama-3.1-8B-Instruct", layers=4, page_bytes=4096,
                           tp=1, rank=0, groups=1, blocks_per_chunk=1, **extra):
    """An OffloadingConfig for the full spec, its extra config naming the
    daemon's socket (and any other spec option in extra)."""
    return offloading_config(model=model, layers=layers, page_bytes=page_bytes, tp=tp, rank=rank,
                             groups=groups, blocks_per_chunk=blocks_per_chunk,
                             extra=dict(extra, spec_name="KvhostOffloadingSpec",
                                        spec_module_path="kvhost.vllm", socket=socket))
