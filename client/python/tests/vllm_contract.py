"""Every class, field, member, method and signature kvhost.vllm uses from
vLLM, in one list.

test_vllm_contract.py checks the CI stand-ins (vllm_standins.py) against it
on every run and, when a real vLLM tree is configured (KVHOST_VLLM_SRC,
`make test-vllm VLLM_SRC=DIR`), vLLM's own classes against it too: a
stand-in that drifts from the list, or a vLLM that drifts from it, fails by
name. When kvhost.vllm starts using something new of vLLM's, it goes here.
"""

import dataclasses
import typing

BASE = "vllm.v1.kv_offload.base"
CONFIG = "vllm.v1.kv_offload.config"
TIERING = "vllm.v1.kv_offload.tiering.base"
METRICS = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics"


@dataclasses.dataclass(frozen=True)
class Use:
    """What kvhost uses of one vLLM class."""
    module: str
    name: str
    # Constructor fields or parameters kvhost passes or reads, by name.
    fields: typing.Tuple[str, ...] = ()
    # Enum members kvhost names.
    members: typing.Tuple[str, ...] = ()
    # Methods kvhost calls (or vLLM calls on kvhost's subclass), with the
    # parameter names after self that kvhost relies on.
    methods: typing.Mapping[str, typing.Tuple[str, ...]] = dataclasses.field(default_factory=dict)
    # Abstract methods kvhost's subclass implements: vLLM may not add
    # another without kvhost knowing.
    abstract: typing.Optional[typing.Tuple[str, ...]] = None
    # Attributes an instance has after vLLM's __init__ (read by kvhost).
    attrs: typing.Tuple[str, ...] = ()
    # Fields kvhost reads where a vLLM has them and does without where it
    # does not (listed, not required).
    optional: typing.Tuple[str, ...] = ()


CONTRACT = (
    Use(BASE, "LookupResult", members=("MISS", "HIT", "HIT_PENDING", "RETRY")),
    Use(BASE, "Medium", members=("STORAGE",)),
    Use(BASE, "Locality", members=("LOCAL", "REMOTE")),
    Use(BASE, "ReqContext", fields=("req_id", "kv_transfer_params")),
    Use(BASE, "RequestOffloadingContext", fields=("policy",)),
    Use(BASE, "ScheduleEndContext", fields=("new_req_ids", "preempted_req_ids")),
    Use(BASE, "OffloadingEvent", fields=("keys", "medium", "removed", "locality")),
    Use(BASE, "OffloadingCounterMetadata", fields=("documentation", "labelnames")),
    Use(BASE, "OffloadingGaugeMetadata", fields=("documentation", "labelnames")),
    Use(BASE, "PrepareStoreOutput", fields=("keys_to_store", "store_spec", "evicted_keys")),
    Use(BASE, "TransferResult", fields=("job_id", "success", "transfer_size", "transfer_time")),
    Use(BASE, "LoadStoreSpec"),
    Use(BASE, "GPULoadStoreSpec", fields=("block_ids", "group_sizes", "block_indices")),
    Use(BASE, "CanonicalKVCacheTensor", fields=("tensor", "page_size_bytes")),
    Use(BASE, "CanonicalKVCacheRef", fields=("tensor_idx", "page_size_bytes")),
    Use(BASE, "CanonicalKVCaches", fields=("tensors", "group_data_refs")),
    Use(BASE, "OffloadingSpec", fields=("config",),
        methods={"get_manager": (), "get_worker": ("kv_caches",), "build_metric_definitions": ("extra_config",)},
        abstract=("get_manager", "get_worker"),
        attrs=("config", "extra_config", "kv_events_config", "blocks_per_chunk")),
    Use(BASE, "OffloadingManager",
        methods={"lookup": ("key", "req_context"), "prepare_load": ("keys", "req_context"),
                 "touch": ("keys", "req_context"), "complete_load": ("keys", "req_context"),
                 "prepare_store": ("keys", "req_context"),
                 "complete_store": ("keys", "req_context", "success"),
                 "on_new_request": ("req_context",), "on_request_finished": ("req_context",),
                 "take_events": (), "on_schedule_end": ("context",), "has_pending_work": (),
                 "reset_cache": (), "get_stats": (), "shutdown": ()},
        abstract=("lookup", "on_new_request", "prepare_load", "prepare_store")),
    Use(BASE, "OffloadingWorker",
        methods={"submit_store": ("job_id", "src_spec", "dst_spec"), "submit_load": ("job_id", "src_spec", "dst_spec"),
                 "get_finished": (), "wait": ("job_ids",), "shutdown": ()},
        abstract=("get_finished", "submit_load", "submit_store", "wait")),
    Use(CONFIG, "OffloadingConfig",
        fields=("groups", "worker_kv_bytes_per_block", "enable_kv_cache_events", "extra_config",
                "engine_id", "model", "cache", "parallel"),
        optional=("replicated_layout", "canonical_layout", "kv_cache_layout")),
    Use(CONFIG, "OffloadingGroupConfig", fields=("tokens_per_block", "layer_names")),
    Use(CONFIG, "OffloadingModelConfig", fields=("name", "dtype")),
    Use(CONFIG, "OffloadingCacheConfig", fields=("tokens_per_hash", "blocks_per_chunk")),
    Use(CONFIG, "OffloadingParallelConfig",
        fields=("rank", "world_size", "tp_size", "pp_size", "pcp_size", "dcp_size", "is_parallelism_agnostic")),
    Use(TIERING, "TransferJob", fields=("job_id", "keys", "block_ids", "is_promotion", "req_context")),
    Use(TIERING, "JobResult", fields=("job_id", "success", "successful_keys", "transfer_time")),
    Use(TIERING, "SecondaryTierManager", fields=("offloading_spec", "primary_kv_view", "tier_type"),
        methods={"lookup": ("key", "req_context"), "submit_store": ("job_metadata",),
                 "submit_load": ("job_metadata",), "get_finished_jobs": (), "has_pending_work": (),
                 "take_events": (), "touch": ("keys", "req_context"), "on_new_request": ("req_context",),
                 "on_request_finished": ("req_context",), "on_schedule_end": ("context",),
                 "drain_jobs": (), "shutdown": (), "build_metric_definitions": ("extra_config",),
                 "get_stats": ()},
        abstract=("drain_jobs", "get_finished_jobs", "lookup", "on_new_request", "submit_load", "submit_store"),
        attrs=("tier_type",)),
    Use(METRICS, "OffloadingConnectorStats",
        methods={"is_empty": (), "aggregate": ("other",), "increase_counter": ("counter_name", "counter_increase_value", "labelvalues"),
                 "set_gauge": ("gauge_name", "gauge_value", "labelvalues")}),
)


def field_names(cls):
    """A class's constructor fields: dataclass fields, NamedTuple fields, or
    __init__ parameters after self."""
    import inspect
    if dataclasses.is_dataclass(cls):
        return [f.name for f in dataclasses.fields(cls)]
    if hasattr(cls, "_fields"):
        return list(cls._fields)
    try:
        return [p for p in inspect.signature(cls.__init__).parameters][1:]
    except (TypeError, ValueError):
        return []


def params(fn):
    """A function's parameter names after self/cls."""
    import inspect
    names = list(inspect.signature(fn).parameters)
    return names[1:] if names and names[0] in ("self", "cls") else names


def problems(use, cls):
    """What cls (vLLM's class or a stand-in) lacks of use, as readable lines."""
    import inspect
    if cls is None:
        return [f"{use.module}.{use.name}: missing"]
    out = []
    where = f"{use.name}"
    have = field_names(cls)
    out += [f"{where}: no field or parameter {f!r} (has {have})" for f in use.fields if f not in have]
    for m in use.members:
        if not hasattr(cls, m):
            out.append(f"{where}: no member {m}")
    for name, want in use.methods.items():
        fn = getattr(cls, name, None)
        if fn is None:
            out.append(f"{where}: no method {name}")
            continue
        got = params(fn)
        if tuple(got[:len(want)]) != tuple(want):
            out.append(f"{where}.{name}: parameters {got}, kvhost relies on {list(want)}")
    if use.abstract is not None:
        got = sorted(getattr(cls, "__abstractmethods__", ()) or ())
        extra = sorted(set(got) - set(use.abstract))
        if extra:
            out.append(f"{where}: abstract methods kvhost does not implement: {extra}")
        if inspect.isabstract(cls) is False and use.abstract:
            out.append(f"{where}: not abstract (kvhost expects abstract {list(use.abstract)})")
    return out
