"""Stand-ins of vLLM's offloading classes, written for kvhost's tests from
the signatures of vLLM's secondary-tier interface (main of 2026-08-17).
They let the tests drive kvhost.vllm.KvhostTier in vLLM's call order
without vLLM installed."""

import abc
import dataclasses
import enum
import hashlib
import types
import typing

import numpy as np


class LookupResult(enum.Enum):
    HIT = 1
    MISS = 2
    RETRY = 3
    HIT_PENDING = 4


class Medium(enum.Enum):
    GPU = "GPU"
    CPU = "CPU"
    DISK = "DISK"


@dataclasses.dataclass
class ReqContext:
    req_id: str
    kv_transfer_params: typing.Optional[dict] = None


@dataclasses.dataclass
class RequestOffloadingContext:
    policy: typing.Any = None


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
    locality: typing.Any = None


class SecondaryTierManager(abc.ABC):
    def __init__(self, offloading_spec, primary_kv_view, tier_type):
        self._offloading_spec = offloading_spec
        self._primary_kv_view = primary_kv_view
        self.tier_type = tier_type

    @abc.abstractmethod
    def lookup(self, key, req_context): ...

    @abc.abstractmethod
    def submit_store(self, job): ...

    @abc.abstractmethod
    def submit_load(self, job): ...

    @abc.abstractmethod
    def get_finished_jobs(self): ...

    @abc.abstractmethod
    def on_new_request(self, req_context): ...

    @abc.abstractmethod
    def drain_jobs(self): ...


API = types.SimpleNamespace(
    name="stand-ins (tests)", LookupResult=LookupResult, JobResult=JobResult,
    TransferJob=TransferJob, OffloadingEvent=OffloadingEvent,
    RequestOffloadingContext=RequestOffloadingContext,
    SecondaryTierManager=SecondaryTierManager, Medium=Medium)


def fake_spec(model="meta-llama/Llama-3.1-8B-Instruct", dtype="bfloat16", tp=1, layers=4,
              engine_id="engine-0", hash_algo="sha256"):
    """The fields of vLLM's offloading spec the tier reads."""
    ns = types.SimpleNamespace
    groups = [ns(layer_names=[f"model.layers.{i}.self_attn.attn" for i in range(layers)],
                 kv_cache_spec=ns(block_size=16))]
    return ns(
        vllm_config=ns(
            model_config=ns(model=model, dtype=dtype),
            cache_config=ns(block_size=16, cache_dtype="auto", prefix_caching_hash_algo=hash_algo),
            parallel_config=ns(tensor_parallel_size=tp, pipeline_parallel_size=1),
            kv_transfer_config=ns(engine_id=engine_id)),
        kv_cache_config=ns(kv_cache_groups=groups),
        extra_config={"blocks_per_chunk": 1})


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


class LoadStoreSpec(abc.ABC):
    @staticmethod
    @abc.abstractmethod
    def medium(): ...


class GPULoadStoreSpec(LoadStoreSpec):
    """GPU block ids ordered by KV-cache group; group_sizes[g] of them per group."""

    def __init__(self, block_ids, group_sizes, block_indices=None):
        self.block_ids = np.asarray(block_ids, dtype=np.int32)
        self.group_sizes = list(group_sizes)
        self.block_indices = block_indices

    @staticmethod
    def medium():
        return Medium.GPU.value


@dataclasses.dataclass
class CanonicalKVCacheTensor:
    tensor: typing.Any  # int8 (num_blocks, page_size_bytes)


@dataclasses.dataclass
class CanonicalKVCaches:
    tensors: list
    group_data_refs: list  # per group: [(tensor_idx, unpadded page_size_bytes)]


class OffloadingSpec(abc.ABC):
    def __init__(self, config):
        self.config = config
        self.extra_config = getattr(config, "extra_config", {})

    @abc.abstractmethod
    def get_manager(self): ...

    @abc.abstractmethod
    def get_worker(self, kv_caches): ...


SPEC_API = types.SimpleNamespace(
    name="stand-ins (tests)", LookupResult=LookupResult, PrepareStoreOutput=PrepareStoreOutput,
    TransferResult=TransferResult, OffloadingEvent=OffloadingEvent,
    RequestOffloadingContext=RequestOffloadingContext, OffloadingSpec=OffloadingSpec,
    OffloadingManager=None, LoadStoreSpec=LoadStoreSpec, GPULoadStoreSpec=GPULoadStoreSpec,
    Medium=Medium, OffloadingWorker=None)


def fake_offloading_config(socket, model="meta-llama/Llama-3.1-8B-Instruct", layers=4, page_bytes=4096,
                           tp=1, rank=0, groups=1, blocks_per_chunk=1, **extra):
    """An OffloadingConfig: the fields of vLLM's config the spec reads."""
    ns = types.SimpleNamespace
    kv_groups = [ns(layer_names=[f"model.layers.{g * layers + i}.self_attn.attn" for i in range(layers)],
                    kv_cache_spec=ns(block_size=16, page_size_bytes=page_bytes)) for g in range(groups)]
    extra = dict(extra, socket=socket, blocks_per_chunk=blocks_per_chunk)
    return ns(
        vllm_config=ns(
            model_config=ns(model=model, dtype="bfloat16"),
            cache_config=ns(block_size=16, cache_dtype="auto", prefix_caching_hash_algo="sha256"),
            parallel_config=ns(tensor_parallel_size=tp, pipeline_parallel_size=1, rank=rank)),
        kv_cache_config=ns(kv_cache_groups=kv_groups),
        extra_config=extra)
