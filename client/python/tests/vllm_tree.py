"""Import vLLM's real KV-offloading modules from a vLLM source tree.

vLLM cannot be pip-installed in CI (no package index), so the tests that
check our integration against vLLM itself point this module at an extracted
source tree: the directory that CONTAINS the ``vllm`` package, given as
KVHOST_VLLM_SRC (``make test-vllm VLLM_SRC=DIR``).

Only modules that would pull in the rest of vLLM (GPU platform detection,
compiled kernels, torch.compile patches, the engine configuration, every KV
connector) are replaced by small shim modules; each shim says why in its
docstring and is listed in ``api.shimmed``. Package ``__init__`` files that
import the world (``vllm.distributed`` and below) are replaced by hollow
packages: their submodules still load from the tree. Every class under test
(vllm.v1.kv_offload.*, OffloadingConnectorStats, KVConnectorStats) is vLLM's
own code, imported from the tree.

When ``import vllm`` works without a tree (vLLM installed), it is used as is,
without shims.

    api = vllm_tree.load()           # or load("/work/vllm-src/017e9f44")
    cfg = vllm_tree.make_offloading_config(api, extra_config={...})
    t = vllm_tree.make_tiering_manager(api, tmpdir, tiers="fs")
    try: ... t.manager.lookup(...) ...
    finally: t.close()

This file holds no vLLM code.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
import unittest
import uuid

SOURCE_ENV = "KVHOST_VLLM_SRC"
SOURCE = os.environ.get(SOURCE_ENV) or None

SKIP_HINT = f"no vLLM tree: set {SOURCE_ENV}=DIR (make test-vllm VLLM_SRC=DIR)"

# (namespace attribute, module, names wanted). A name the tree lacks is None
# on the namespace and listed in api.missing; a module that fails to import
# is listed in api.errors with its exception (not raised).
MODULES = (
    ("base", "vllm.v1.kv_offload.base", (
        "OffloadKey", "make_offload_key", "get_offload_block_hash",
        "get_offload_group_idx", "Medium", "Locality", "TierMatcher",
        "TierFilter", "ReqContext", "LookupResult", "OffloadPolicy",
        "RequestOffloadingContext", "ScheduleEndContext", "LoadStoreSpec",
        "PrepareStoreOutput", "OffloadingEvent", "OffloadingMetricMetadata",
        "OffloadingCounterMetadata", "OffloadingGaugeMetadata",
        "OffloadingHistogramMetadata", "OffloadingKVEventsConfig",
        "OffloadingManager", "BlockIDsLoadStoreSpec", "GPULoadStoreSpec",
        "CanonicalKVCacheTensor", "CopyRun", "CanonicalPageMapping",
        "CanonicalKVCacheRef", "CanonicalKVCaches", "TransferResult",
        "OffloadingWorker", "OffloadingSpec")),
    ("config", "vllm.v1.kv_offload.config", (
        "OffloadingConfig", "OffloadingGroupConfig", "OffloadingModelConfig",
        "OffloadingCacheConfig", "OffloadingParallelConfig")),
    ("factory", "vllm.v1.kv_offload.factory", ("OffloadingSpecFactory",)),
    ("file_mapper", "vllm.v1.kv_offload.file_mapper", ("FileMapper",)),
    ("cpu_common", "vllm.v1.kv_offload.cpu.common", (
        "CPULoadStoreSpec", "CPUOffloadingMetrics")),
    ("cpu_region", "vllm.v1.kv_offload.cpu.shared_offload_region", (
        "SharedOffloadRegion",)),
    ("cpu_manager", "vllm.v1.kv_offload.cpu.manager", ("CPUOffloadingManager",)),
    ("cpu_gpu_worker", "vllm.v1.kv_offload.cpu.gpu_worker", (
        "CPUOffloadingWorker",)),
    ("cpu_spec", "vllm.v1.kv_offload.cpu.spec", ("CPUOffloadingSpec",)),
    # JobMetadata: the per-job record in tiering.base before TransferJob
    # replaced it (v0.26); later trees have an unrelated NamedTuple of that
    # name in tiering.manager (not exported here).
    ("tiering_base", "vllm.v1.kv_offload.tiering.base", (
        "TieringOffloadingMetrics", "TransferJob", "JobMetadata", "JobResult",
        "JobId", "ParentManager", "SecondaryTierManager")),
    ("tiering_factory", "vllm.v1.kv_offload.tiering.factory", (
        "SecondaryTierFactory",)),
    ("tiering_async_lookup", "vllm.v1.kv_offload.tiering.async_lookup", (
        "LookupState", "AsyncLookupManager")),
    ("tiering_metrics", "vllm.v1.kv_offload.tiering.metrics", (
        "TieringMetricsTracker",)),
    ("tiering_backpressure", "vllm.v1.kv_offload.tiering.backpressure", (
        "BackpressurePolicy", "DropStorePolicy", "BackpressureDetector",
        "EMABackpressureDetector")),
    ("tiering_manager", "vllm.v1.kv_offload.tiering.manager", (
        "CPUPrimaryTierOffloadingManager", "TieringOffloadingManager")),
    ("tiering_spec", "vllm.v1.kv_offload.tiering.spec", (
        "TieringOffloadingSpec",)),
    ("tiering_example", "vllm.v1.kv_offload.tiering.example.manager", (
        "ExampleSecondaryTierManager",)),
    ("tiering_fs", "vllm.v1.kv_offload.tiering.fs.manager", (
        "FileSystemTierManager",)),
    ("connector_metrics", "vllm.distributed.kv_transfer.kv_connector.v1.metrics",
        ("KVConnectorStats", "KVConnectorPromMetrics")),
    ("offloading_metrics",
        "vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics",
        ("OffloadingConnectorStats", "OffloadPromMetrics")),
)

_state: dict = {"src": None, "api": None}


# ---------------------------------------------------------------- shims


def _shim_module(name: str, doc: str, **attrs) -> types.ModuleType:
    mod = types.ModuleType(name, f"vllm_tree shim: {doc}")
    mod.__dict__.update(attrs)
    mod.__vllm_tree_shim__ = True
    return mod


class _NotInShim:
    """Placeholder class: only its name is used (annotations, isinstance)."""

    def __init__(self, *a, **kw):
        raise RuntimeError(
            f"{type(self).__qualname__} is a vllm_tree placeholder; the real "
            "one is not importable in this harness")


class _HostOnlyPlatform:
    """What vllm.platforms.current_platform answers on a machine without an
    accelerator, for the methods the offloading code calls."""

    device_name = "cpu"
    device_type = "cpu"
    dispatch_key = "CPU"

    def is_cuda_alike(self):
        return False

    def is_cuda(self):
        return False

    def is_rocm(self):
        return False

    def is_xpu(self):
        return False

    def is_tpu(self):
        return False

    def is_cpu(self):
        return True

    def is_out_of_tree(self):
        return False

    def is_pin_memory_available(self):
        return False

    def device_count(self):
        return 0

    def register_custom_kv_cache_specs(self, vllm_config):
        """A platform's own KV-cache specs (8ab97ed6 on): the host has none."""
        return None

    def __getattr__(self, name):
        raise AttributeError(
            f"vllm_tree host-only platform shim has no {name!r}: the code "
            "path under test needs a GPU platform")


def _raiser(modname):
    def __getattr__(attr):
        if attr.startswith("__"):
            raise AttributeError(attr)

        def unavailable(*a, **kw):
            raise RuntimeError(
                f"{modname}.{attr} is a compiled kernel; vllm_tree has none")
        unavailable.__name__ = attr
        return unavailable
    return __getattr__


def _make_shims(src: str, tree_name: str):
    """name -> factory for the modules replaced by shims. Each factory is
    only called if the import actually happens."""
    import torch

    def version():
        return _shim_module(
            "vllm._version",
            "generated by setuptools-scm at build time; a source tree has "
            "none.", __version__=f"0.0.0+{tree_name}",
            __version_tuple__=(0, 0, 0, tree_name))

    def env_override():
        return _shim_module(
            "vllm.env_override",
            "patches torch._inductor / torch.compile and process environment "
            "at import; irrelevant to offloading and breaks on torch 1.13.")

    def platforms():
        return _shim_module(
            "vllm.platforms",
            "platform detection probes CUDA/ROCm/XPU/TPU libraries and "
            "plugin entry points; the offloading code only asks "
            "current_platform is_cuda_alike()/is_xpu()/is_pin_memory_"
            "available(), answered here as a host without an accelerator.",
            current_platform=_HostOnlyPlatform())

    def custom_ops():
        m = _shim_module(
            "vllm._custom_ops",
            "binds vLLM's compiled CUDA/C++ kernels (vllm._C); a source tree "
            "has none. Any attribute is a function that raises when called "
            "(only GPU<->CPU copies in cpu.gpu_worker use them).")
        m.__getattr__ = _raiser("vllm._custom_ops")
        return m

    def config():
        m = _shim_module(
            "vllm.config",
            "the package's __init__ imports the whole engine configuration "
            "(model registry, transformers). It is a package here whose "
            "submodules load from the tree (vllm.config.kv_transfer: "
            "KVTransferConfig, a pydantic dataclass, is vLLM's own); "
            "VllmConfig, which the connector code only names in "
            "annotations, is a placeholder (tests hand it a namespace of "
            "the fields it reads).",
            VllmConfig=type("VllmConfig", (_NotInShim,), {}))
        m.__path__ = [os.path.join(src, "vllm", "config")]
        m.__getattr__ = _lazy_attrs("vllm.config", {
            "KVTransferConfig": "vllm.config.kv_transfer"})
        # The KV-cache spec registry asks for the current config before it
        # registers vLLM's managers (8ab97ed6 on): outside an engine there
        # is none.
        m.get_current_vllm_config_or_none = lambda: None
        return m

    def shm_broadcast():
        import shutil

        def check_shm_free_space(required_bytes, shm_path="/dev/shm"):
            # Same contract as vLLM's: raise RuntimeError when shm_path
            # exists and has less free space than required_bytes.
            if not os.path.isdir(shm_path):
                return
            free = shutil.disk_usage(shm_path).free
            if required_bytes > free:
                raise RuntimeError(
                    f"Insufficient space in {shm_path}: {required_bytes} "
                    f"bytes required, {free} free")
        return _shim_module(
            "vllm.distributed.device_communicators.shm_broadcast",
            "the message-queue module imports zmq, torch.distributed "
            "process groups and vllm.distributed.utils (which needs "
            "torch.distributed internals newer than torch 1.13). "
            "SharedOffloadRegion only calls check_shm_free_space, "
            "reimplemented here with the same contract.",
            check_shm_free_space=check_shm_free_space)

    def torch_utils():
        from vllm.utils.platform_utils import is_pin_memory_available

        def get_dtype_size(dtype):
            return torch.empty((), dtype=dtype).element_size()
        return _shim_module(
            "vllm.utils.torch_utils",
            "the real module needs torch >= 2.4 at import "
            "(torch.library.infer_schema, Library(..., 'FRAGMENT'), "
            "torch.float8_e4m3fn). The offloading code uses PIN_MEMORY "
            "(computed as vLLM does, from "
            "platform_utils.is_pin_memory_available()) and, through "
            "kv_cache_interface, get_dtype_size.",
            PIN_MEMORY=is_pin_memory_available(),
            get_dtype_size=get_dtype_size)

    def kv_events():
        consts = _string_constants(os.path.join(
            src, "vllm", "distributed", "kv_events.py"))
        events = {n: type(n, (_NotInShim,), {}) for n in (
            "KVCacheEvent", "BlockStored", "BlockRemoved", "AllBlocksCleared",
            "KVConnectorKVEvents", "KVEventBatch")}
        return _shim_module(
            "vllm.distributed.kv_events",
            "imports msgspec (not packaged by Debian 12) and zmq, and its "
            "events are msgspec Structs. Offloading modules import its "
            "medium name constants (MEDIUM_CPU, MEDIUM_FS, ...), read here "
            "from the tree's file without running it, and name the event "
            "classes, placeholders here: the tests run with KV cache events "
            "off, where vLLM makes none.", **consts, **events)

    def parallel_state():
        def is_local_first_rank():
            return True  # one scheduler process: it is the first rank

        def not_initialized(*args, **kwargs):
            raise RuntimeError("vllm_tree shim: no distributed state in the tests")
        m = _shim_module(
            "vllm.distributed.parallel_state",
            "process groups over torch.distributed (newer internals than "
            "torch 1.13, NCCL). vllm.logger's *_once helpers ask "
            "is_local_first_rank() (answered True: one process); every "
            "other function raises, as in a process whose distributed "
            "state is not initialized.",
            is_local_first_rank=is_local_first_rank)
        m.__getattr__ = lambda name: not_initialized
        return m

    def attention_backend():
        return _shim_module(
            "vllm.v1.attention.backend",
            "imports the model executor and its distributed layers. The "
            "offloading connector's worker only names AttentionBackend in "
            "annotations; a placeholder stands in (a test hands "
            "register_cross_layers_kv_cache a backend class of its own).",
            AttentionBackend=type("AttentionBackend", (_NotInShim,), {}),
            AttentionMetadata=type("AttentionMetadata", (_NotInShim,), {}))

    def kv_cache_utils():
        import itertools
        import math
        from typing import NewType

        import vllm.envs as envs
        from vllm.v1 import kv_cache_interface as kci
        path = os.path.join(src, "vllm", "v1", "core", "kv_cache_utils.py")
        ns = {"math": math, "itertools": itertools, "NewType": NewType,
              "envs": envs, "AttentionSpec": kci.AttentionSpec,
              "MambaSpec": kci.MambaSpec, "KVCacheConfig": kci.KVCacheConfig,
              "VllmConfig": object}
        defs = _definitions(
            path, ("resolve_kv_cache_block_sizes",), ns,
            optional=("BlockHash", "BlockHashWithGroupId", "ExternalBlockHash",
                      "make_block_hash_with_group_id", "get_block_hash",
                      "get_group_id", "maybe_convert_block_hash",
                      "KVCacheBlock", "BlockHashListWithBlockSize",
                      "BlockHashList", "resolve_block_hashes"))
        return _shim_module(
            "vllm.v1.core.kv_cache_utils",
            "imports the request and multimodal modules (PIL, cbor2, "
            "xxhash). What the offloading connector calls (the block size "
            "resolution, the block-hash types and views, KVCacheBlock) is "
            "that code's own source, read from the tree's file and run "
            "here.", **defs)

    def forward_context():
        return _shim_module(
            "vllm.forward_context",
            "imports the engine configuration, the data-parallel "
            "coordination and CUDA-graph modes. The connectors only name "
            "ForwardContext in annotations (the offloading connector's "
            "start_load_kv ignores it); a placeholder stands in.",
            ForwardContext=type("ForwardContext", (_NotInShim,), {}))

    def request():
        import enum
        path = os.path.join(src, "vllm", "v1", "request.py")
        engine = _definitions(
            os.path.join(src, "vllm", "v1", "engine", "__init__.py"),
            ("FinishReason",), {"enum": enum})
        defs = _definitions(path, ("RequestStatus",),
                            {"enum": enum, **engine},
                            optional=("_FINISHED_REASON_MAP",))
        return _shim_module(
            "vllm.v1.request",
            "imports sampling and pooling parameters (msgspec) and the "
            "multimodal inputs. RequestStatus (with FinishReason) is that "
            "code's own source, read from the tree's files and run here; "
            "Request is a placeholder (tests hand the scheduler a request "
            "object with the fields it reads).",
            Request=type("Request", (_NotInShim,), {}), **defs)

    def kv_cache_manager():
        import itertools
        from collections.abc import Sequence
        from typing import Literal, overload

        from vllm.v1.core.kv_cache_utils import KVCacheBlock
        defs = _definitions(
            os.path.join(src, "vllm", "v1", "core", "kv_cache_manager.py"),
            ("KVCacheBlocks",),
            {"itertools": itertools, "Sequence": Sequence,
             "Literal": Literal, "overload": overload,
             "KVCacheBlock": KVCacheBlock})
        return _shim_module(
            "vllm.v1.core.kv_cache_manager",
            "imports the KV cache coordinator, block pool and request "
            "modules. KVCacheBlocks, what the scheduler hands connectors, "
            "is that class's own source, read from the tree's file and run "
            "here.", **defs)

    def outputs():
        import vllm.v1.core.sched.output as sched_output
        defs = _definitions(
            os.path.join(src, "vllm", "v1", "outputs.py"),
            ("KVConnectorOutput",), {"SchedulerOutput":
                                     sched_output.SchedulerOutput})
        return _shim_module(
            "vllm.v1.outputs",
            "imports CUDA-graph capture (vllm.compilation) and the model "
            "executor. KVConnectorOutput, what connectors read back from "
            "the workers, is that class's own source, read from the tree's "
            "file and run here.", **defs)

    def sched_output():
        from functools import cached_property
        defs = _definitions(
            _sched_output_path(src), ("SchedulerOutput",),
            {"cached_property": cached_property},
            optional=("NewRequestData", "CachedRequestData",
                      "ScheduledEncoderInputStats", "GrammarOutput"))
        return _shim_module(
            "vllm.v1.core.sched.output",
            "this tree's module imports vllm.multimodal (PIL, the model "
            "registry) at import. Its dataclasses (SchedulerOutput, "
            "NewRequestData, CachedRequestData), what the scheduler hands "
            "connectors each step, are that code's own source, read from "
            "the tree's file and run here.", **defs)

    def connector_utils():
        defs = _definitions(
            os.path.join(src, "vllm", "distributed", "kv_transfer",
                         "kv_connector", "utils.py"), ("yield_req_data",), {})
        return _shim_module(
            "vllm.distributed.kv_transfer.kv_connector.utils",
            "imports the engine configuration, attention layers and the "
            "model runner's outputs. The offloading scheduler calls "
            "yield_req_data: that function's own source, read from the "
            "tree's file and run here.", **defs)

    def block_pool():
        return _shim_module(
            "vllm.v1.core.block_pool",
            "imports the KV-cache metrics, which import CUDA-graph capture "
            "(vllm.compilation: the engine configuration's CompilationMode, "
            "NCCL allocators). The single-type KV-cache managers, whose "
            "reachable_block_mask the offloading scheduler's store filter "
            "calls from 8ab97ed6 on, only name BlockPool in annotations "
            "and constructors; a placeholder stands in.",
            BlockPool=type("BlockPool", (_NotInShim,), {}))

    shims = {
        "vllm.v1.core.block_pool": block_pool,
        "vllm.distributed.parallel_state": parallel_state,
        "vllm._version": version,
        "vllm.env_override": env_override,
        "vllm.platforms": platforms,
        "vllm._custom_ops": custom_ops,
        "vllm.config": config,
        "vllm.distributed.device_communicators.shm_broadcast": shm_broadcast,
        "vllm.distributed.kv_events": kv_events,
        "vllm.v1.attention.backend": attention_backend,
        "vllm.v1.core.kv_cache_utils": kv_cache_utils,
        "vllm.forward_context": forward_context,
        "vllm.v1.request": request,
        "vllm.v1.core.kv_cache_manager": kv_cache_manager,
        "vllm.v1.outputs": outputs,
        "vllm.distributed.kv_transfer.kv_connector.utils": connector_utils,
    }
    with open(_sched_output_path(src)) as f:
        if "from vllm.multimodal" in f.read():
            shims["vllm.v1.core.sched.output"] = sched_output
    if not hasattr(torch.library, "infer_schema"):  # torch < 2.4
        shims["vllm.utils.torch_utils"] = torch_utils
    return shims


def _sched_output_path(src):
    return os.path.join(src, "vllm", "v1", "core", "sched", "output.py")


def _string_constants(path):
    """Module-level NAME = "literal" assignments of a Python file, read
    with ast (the file is not executed)."""
    import ast
    out = {}
    try:
        with open(path) as f:
            tree = ast.parse(f.read(), path)
    except OSError:
        return out
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and \
                isinstance(node.targets[0], ast.Name) and \
                isinstance(node.value, ast.Constant) and \
                isinstance(node.value.value, str):
            out[node.targets[0].id] = node.value.value
    return out


def _definitions(path, names, namespace, *, optional=()):
    """The module-level functions, classes and assignments names (and
    those of optional the file has) of a Python file, their source (read
    with ast) run in order in namespace: vLLM's own code without its
    module's imports. Function decorators are dropped (vLLM's are caching
    or typing ones); class decorators (dataclass) are kept and annotations
    stay unevaluated, as they name types of modules not imported here."""
    import __future__
    import ast
    import dataclasses as dc
    import typing
    with open(path) as f:
        text = f.read()
    tree = ast.parse(text, path)
    want = set(names) | set(optional)
    import collections.abc as abc
    ns = {n: getattr(typing, n) for n in typing.__all__}
    ns.update({n: getattr(abc, n) for n in abc.__all__})
    ns.update({"dataclass": dc.dataclass, "field": dc.field,
               "TYPE_CHECKING": False, "__name__": __name__})
    ns.update(namespace)
    out = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            name = node.name
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and \
                isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
        elif isinstance(node, ast.AnnAssign) and node.value is not None and \
                isinstance(node.target, ast.Name):
            name = node.target.id
        else:
            continue
        if name not in want:
            continue
        if isinstance(node, ast.FunctionDef):
            node.decorator_list = []
        code = compile(ast.Module(body=[node], type_ignores=[]), path, "exec",
                       flags=__future__.annotations.compiler_flag,
                       dont_inherit=True)
        exec(code, ns)  # noqa: S102 - the tree's own code
        out[name] = ns[name]
    missing = set(names) - set(out)
    if missing:
        raise ImportError(f"{path} has no {', '.join(sorted(missing))}")
    return out


def _functions(path, names, namespace):
    """The module-level functions names of a Python file (_definitions)."""
    return _definitions(path, names, namespace)


def _lazy_attrs(modname, where):
    """A module __getattr__ that imports where[name] (a real submodule) on
    first use and returns its name."""
    def __getattr__(name):
        if name not in where:
            raise AttributeError(f"module {modname!r} (vllm_tree shim) has "
                                 f"no attribute {name!r}")
        return getattr(importlib.import_module(where[name]), name)
    return __getattr__


class _ImportTimeStub:
    """Placeholder set on torch only while one real vLLM module executes
    (class-body annotations / from-imports evaluated at import); removed
    right after, so nothing else sees it. Calling it raises."""

    def __init__(self, *a, **kw):
        raise RuntimeError(
            "vllm_tree import-time stub: this torch lacks the API; the code "
            "path needs a newer torch / a GPU")


def _import_patches():
    """real module -> [(object, attribute, reason)]: attributes missing from
    this torch that the module touches at import time only. Each is set to
    a stub while that module executes, then removed."""
    import torch
    import torch.library
    patches = {}
    if not hasattr(torch, "Event"):
        patches["vllm.v1.kv_offload.cpu.gpu_worker"] = [(
            torch, "Event",
            "torch < 2.4: dataclass field annotations name torch.Event; "
            "instances are only made by the worker on a GPU")]
    return patches


# Packages whose __init__ imports the world: loaded hollow (no __init__ code)
# so that their real submodules still import from the tree.
HOLLOW = {
    "vllm.distributed": "its __init__ imports parallel_state / "
        "communication_op (torch.distributed process groups).",
    "vllm.distributed.kv_transfer": "its __init__ imports kv_transfer_state "
        "and with it every connector.",
    "vllm.distributed.device_communicators": "kept hollow so that only the "
        "shm_broadcast shim is needed below it.",
}


class _ShimLoader(importlib.abc.Loader):
    def __init__(self, finder, factory=None, hollow_doc=None):
        self.finder, self.factory, self.hollow_doc = finder, factory, hollow_doc

    def create_module(self, spec):
        if self.factory is not None:
            return self.factory()
        return None

    def exec_module(self, module):
        self.finder.used.append(module.__name__)
        if self.hollow_doc is not None:
            module.__doc__ = ("vllm_tree hollow package (its __init__ is not "
                              "run; submodules are real): " + self.hollow_doc)
            module.__vllm_tree_shim__ = True


class _PatchingLoader(importlib.abc.Loader):
    """Runs a real module's loader with _import_patches applied."""

    def __init__(self, finder, real, patches):
        self.finder, self.real, self.patches = finder, real, patches

    def create_module(self, spec):
        return self.real.create_module(spec)

    def exec_module(self, module):
        applied = []
        try:
            for obj, attr, reason in self.patches:
                if not hasattr(obj, attr):
                    setattr(obj, attr, _ImportTimeStub)
                    applied.append((obj, attr))
                    self.finder.patched[
                        f"{getattr(obj, '__name__', obj)}.{attr}"] = (
                        f"stub while importing {module.__name__}: {reason}")
            self.real.exec_module(module)
        finally:
            for obj, attr in applied:
                delattr(obj, attr)


class _ShimFinder(importlib.abc.MetaPathFinder):
    def __init__(self, src: str, shims: dict, patches: dict):
        self.src, self.shims, self.patches = src, shims, patches
        self.used, self.patched = [], {}

    def find_spec(self, name, path=None, target=None):
        if name in self.patches:
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(
                    self, spec.loader, self.patches[name])
            return spec
        if name in self.shims:
            d = os.path.join(self.src, *name.split("."))
            package = os.path.isfile(os.path.join(d, "__init__.py"))
            spec = importlib.machinery.ModuleSpec(
                name, _ShimLoader(self, self.shims[name]), is_package=package)
            if package:  # its submodules load from the tree
                spec.submodule_search_locations = [d]
            return spec
        if name in HOLLOW:
            d = os.path.join(self.src, *name.split("."))
            spec = importlib.machinery.ModuleSpec(
                name, _ShimLoader(self, hollow_doc=HOLLOW[name]),
                is_package=True)
            spec.submodule_search_locations = [d]
            return spec
        return None


# ---------------------------------------------------------------- loading


def _snapshot_name(src: str) -> str:
    base = os.path.basename(os.path.normpath(src))
    snaps = os.path.join(os.path.dirname(os.path.normpath(src)), "SNAPSHOTS")
    try:
        with open(snaps) as f:
            for line in f:
                parts = line.split()
                if parts and parts[0] == base and len(parts) >= 3:
                    commit = parts[1][:8]
                    label = base if base.startswith(commit) else \
                        f"{base} {commit}" if commit not in base else base
                    return f"vllm {label} ({parts[2]})"
    except OSError:
        pass
    return f"vllm {base}"


def _installed_vllm() -> bool:
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):  # e.g. a stand-in module without spec
        return False
    return spec is not None and spec.origin is not None


def _resolve(src):
    if src is None:
        src = SOURCE
    if src is None:
        return None
    src = os.path.abspath(src)
    if os.path.basename(src) == "vllm" and os.path.isfile(
            os.path.join(src, "__init__.py")):
        src = os.path.dirname(src)  # accept the package dir itself
    if not os.path.isfile(os.path.join(src, "vllm", "__init__.py")):
        raise FileNotFoundError(
            f"{src} does not contain a vllm package (vllm/__init__.py)")
    return src


def skip_reason(src=None, *, try_import=False):
    """None when a tree (src, else KVHOST_VLLM_SRC, else an installed vLLM)
    is configured, else why not, for unittest.skipUnless / skipIf.

    Cheap and free of side effects by default (checks the tree has
    vllm/__init__.py and vllm/v1/kv_offload/base.py; imports nothing), so
    that calling it at test-module import does not put vLLM into
    sys.modules for every other test module of the run. try_import=True
    also runs load() and reports its failure."""
    if _state["api"] is not None and src is None:
        return None
    try:
        path = _resolve(src)
    except FileNotFoundError as e:
        return f"{SKIP_HINT} ({e})"
    if path is None:
        if not _installed_vllm():
            return SKIP_HINT
    elif not os.path.isfile(os.path.join(
            path, "vllm", "v1", "kv_offload", "base.py")):
        return (f"vLLM tree {path} has no vllm/v1/kv_offload/base.py "
                "(too old for KV offloading)")
    if try_import:
        try:
            load(src)
        except Exception as e:  # noqa: BLE001 - reported as the skip reason
            return f"vLLM at {path} does not load: {type(e).__name__}: {e}"
    return None


def load(src=None) -> types.SimpleNamespace:
    """Import vLLM's offloading modules from src (default KVHOST_VLLM_SRC,
    else an installed vllm). Idempotent; a second, different tree in the
    same process raises RuntimeError."""
    path = _resolve(src)
    key = path or "<installed>"
    if _state["api"] is not None:
        if src is None or key == _state["src"]:
            return _state["api"]
        raise RuntimeError(
            f"vllm_tree already loaded {_state['src']} in this process; "
            f"cannot load {key} too (run it in a subprocess)")
    if "vllm" in sys.modules and path is not None:
        loaded = getattr(sys.modules["vllm"], "__file__", "") or ""
        if not loaded.startswith(path + os.sep):
            raise RuntimeError(
                f"a vllm package is already imported from {loaded}; cannot "
                f"load the tree {path} in this process")

    finder = None
    if path is not None:
        _require_dependencies()
    if path is None:
        if not _installed_vllm():
            raise RuntimeError(SKIP_HINT)
        name = "vllm (installed)"
    else:
        name = _snapshot_name(path)
        # Quiet vLLM's own logging config; keep what the caller set.
        os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
        finder = _ShimFinder(
            path, _make_shims(path, os.path.basename(path)),
            _import_patches())
        sys.meta_path.insert(0, finder)
        if path in sys.path:
            sys.path.remove(path)
        sys.path.insert(0, path)
        importlib.invalidate_caches()

    api = types.SimpleNamespace(
        name=name, src=path, shimmed=[], patched={}, modules={}, missing=[],
        errors={})
    try:
        import vllm  # noqa: F401  (vllm/__init__: version, env_override)
        if path is not None:
            mfile = os.path.abspath(vllm.__file__)
            if not mfile.startswith(path + os.sep):
                raise RuntimeError(
                    f"imported vllm from {mfile}, not from {path}")
    except BaseException:
        if finder is not None:
            sys.meta_path.remove(finder)
            sys.path.remove(path)
            for m in [m for m in sys.modules
                      if m == "vllm" or m.startswith("vllm.")]:
                del sys.modules[m]
        raise
    for alias, modname, names in MODULES:
        try:
            mod = importlib.import_module(modname)
        except ImportError as e:
            mod = None
            # A module this tree simply lacks is "missing"; one that exists
            # but fails to import is an error worth showing.
            if getattr(e, "name", None) == modname or \
                    _module_absent(path, modname):
                api.missing.append(modname)
            else:
                api.errors[modname] = f"{type(e).__name__}: {e}"
        except Exception as e:  # noqa: BLE001 - reported, not raised
            mod = None
            api.errors[modname] = f"{type(e).__name__}: {e}"
        setattr(api, alias, mod)
        api.modules[modname] = mod
        for n in names:
            v = getattr(mod, n, None) if mod is not None else None
            if mod is not None and v is None:
                api.missing.append(f"{modname}.{n}")
            if getattr(api, n, None) is None:
                setattr(api, n, v)
    if api.errors:
        # A module the tree has but that fails to import would leave its
        # classes None and the tests failing far from the cause: say it here.
        sys.meta_path[:] = [f for f in sys.meta_path if f is not finder]
        raise RuntimeError(f"vllm_tree: {name}: modules failed to import: "
                           + "; ".join(f"{m}: {e}" for m, e in api.errors.items()))
    # Fields that tell the snapshots apart, for tests and reports.
    api.has_transfer_job = api.TransferJob is not None
    api.has_successful_keys = (
        api.JobResult is not None and dataclasses.is_dataclass(api.JobResult)
        and "successful_keys" in {f.name for f in
                                  dataclasses.fields(api.JobResult)})
    if finder is not None:
        api.shimmed = list(dict.fromkeys(finder.used))
        api.patched = dict(finder.patched)
    _state["src"], _state["api"] = key, api
    return api


# Python module -> the Debian package that provides it: what vLLM's own
# modules under test import (make vllm-test-deps installs them).
DEPENDENCIES = {
    "pydantic": "python3-pydantic",          # vllm.config.kv_transfer
    "cbor2": "python3-cbor2",                # vllm.utils.hashing
    "prometheus_client": "python3-prometheus-client",  # connector metrics
    "regex": "python3-regex",                # vllm's string utilities
}


def _require_dependencies():
    """Raises RuntimeError naming the Debian packages of DEPENDENCIES that
    do not import, and the make target that installs them: a test that
    needs them fails rather than skips."""
    missing = [pkg for mod, pkg in DEPENDENCIES.items()
               if importlib.util.find_spec(mod) is None]
    if missing:
        raise RuntimeError(
            f"vllm_tree: vLLM's modules need {', '.join(missing)} for "
            f"{sys.executable}: run `make vllm-test-deps` (make test-vllm "
            "runs it)")


def _module_absent(path, modname):
    if path is None:
        return False
    p = os.path.join(path, *modname.split("."))
    return not (os.path.isfile(p + ".py") or os.path.isdir(p))


def shim_docs(api) -> dict:
    """module name -> the shim's docstring, for reports."""
    return {n: (sys.modules[n].__doc__ or "") for n in api.shimmed
            if n in sys.modules}


# ---------------------------------------------------------------- configs


def _fields(cls):
    return {f.name for f in dataclasses.fields(cls)}


def _kw(cls, **values):
    """cls(**values) keeping only the fields this tree's dataclass has;
    a required field we do not know raises TypeError from the dataclass."""
    have = _fields(cls)
    return cls(**{k: v for k, v in values.items() if k in have})


def make_offloading_config(
    api,
    *,
    model="meta-llama/Llama-3.1-8B",
    dtype="bfloat16",
    tp=1,
    pp=1,
    pcp=1,
    dcp=1,
    rank=0,
    dp_index=0,
    dp_size=1,
    dp_rank_local=None,
    groups=((("model.layers.0.self_attn.attn",
               "model.layers.1.self_attn.attn"), 16),),
    tokens_per_hash=16,
    blocks_per_chunk=1,
    worker_kv_bytes_per_block=2 * 2 * 8 * 128 * 16,  # 2 layers, K+V, bf16
    extra_config=None,
    engine_id=None,
    enable_kv_cache_events=False,
    is_parallelism_agnostic=None,
    canonical_layout=False,
    replicated_layout=False,
):
    """vLLM's OffloadingConfig, filled like build_offloading_config does
    (vllm/distributed/kv_transfer/kv_connector/v1/offloading/config.py):
    groups are (layer_names, tokens_per_block) where tokens_per_block is the
    block size times dcp; world_size = tp * pp * pcp. Only fields this
    tree's dataclasses have are passed."""
    if engine_id is None:
        engine_id = f"kvhost-test-{uuid.uuid4().hex[:12]}"
    if is_parallelism_agnostic is None:
        is_parallelism_agnostic = dcp == 1 and pcp == 1
    extra = dict(extra_config or {})
    if canonical_layout:
        extra.setdefault("canonical_layout", True)
    return _kw(
        api.OffloadingConfig,
        groups=tuple(
            api.OffloadingGroupConfig(
                tokens_per_block=tpb, layer_names=tuple(names))
            for names, tpb in groups),
        worker_kv_bytes_per_block=worker_kv_bytes_per_block,
        enable_kv_cache_events=enable_kv_cache_events,
        extra_config=extra,
        engine_id=engine_id,
        model=_kw(api.OffloadingModelConfig, name=model, dtype=dtype),
        cache=_kw(api.OffloadingCacheConfig, tokens_per_hash=tokens_per_hash,
                  blocks_per_chunk=blocks_per_chunk),
        parallel=_kw(
            api.OffloadingParallelConfig,
            rank=rank, world_size=tp * pp * pcp, tp_size=tp, pp_size=pp,
            pcp_size=pcp, dcp_size=dcp, data_parallel_index=dp_index,
            data_parallel_size=dp_size,
            data_parallel_rank_local=dp_rank_local,
            is_parallelism_agnostic=is_parallelism_agnostic),
        replicated_layout=replicated_layout,
        canonical_layout=canonical_layout,
    )


# ---------------------------------------------------------------- tiering


def shm_path(engine_id: str) -> str:
    """The /dev/shm file SharedOffloadRegion creates for engine_id."""
    return f"/dev/shm/vllm_offload_{engine_id}.mmap"


class TieringHandle:
    """A real TieringOffloadingSpec and its manager; close() shuts the
    manager down and removes the shared-memory file."""

    def __init__(self, spec, manager, config):
        self.spec, self.manager, self.config = spec, manager, config
        self.engine_id = config.engine_id
        self.shm_path = shm_path(self.engine_id)

    def close(self):
        m, self.manager = self.manager, None
        try:
            if m is not None and hasattr(m, "shutdown"):
                m.shutdown()
        finally:
            region = getattr(self.spec, "_scheduler_mmap", None)
            if region is not None:
                try:
                    region.cleanup()
                except Exception:  # noqa: BLE001
                    pass
            try:
                os.unlink(self.shm_path)
            except FileNotFoundError:
                pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def fs_tier(root, **kw):
    """A secondary_tiers entry for vLLM's own file-system tier."""
    return {"type": "fs", "root_dir": str(root), **kw}


def make_tiering_manager(api, *, cpu_bytes_to_use=None, num_cpu_blocks=8,
                         secondary_tiers=(), config_kwargs=None,
                         extra_config=None):
    """vLLM's OffloadingSpecFactory.create_spec(config) with
    spec_name=TieringOffloadingSpec, then spec.get_manager() (the real
    TieringOffloadingManager). Returns a TieringHandle; close() it."""
    if api.TieringOffloadingSpec is None:
        raise RuntimeError(f"{api.name} has no TieringOffloadingSpec")
    kw = dict(config_kwargs or {})
    bpb = kw.get("worker_kv_bytes_per_block", 4096)
    kw["worker_kv_bytes_per_block"] = bpb
    align = getattr(api.TieringOffloadingSpec, "BLOCK_SIZE_ALIGNMENT", 4096)
    per_chunk = -(-bpb * kw.get("blocks_per_chunk", 1) *
                  kw.get("tp", 1) // align) * align
    if cpu_bytes_to_use is None:
        cpu_bytes_to_use = per_chunk * num_cpu_blocks
    extra = {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": cpu_bytes_to_use,
        "secondary_tiers": [dict(t) for t in secondary_tiers],
    }
    extra.update(extra_config or {})
    kw["extra_config"] = extra
    config = make_offloading_config(api, **kw)
    spec = api.OffloadingSpecFactory.create_spec(config)
    handle = TieringHandle(spec, None, config)
    try:
        handle.manager = spec.get_manager()
    except BaseException:
        handle.close()
        raise
    return handle


class RealCase(unittest.TestCase):
    """Base of the tests that run kvhost inside vLLM's own code: loads the
    tree once per class, asks kvhost.vllm whether it supports this vLLM
    (``support``: "detect" for the tier, "spec_class" for the spec), and
    starts one daemon per class. Tests of a class call
    ``self.require_support()`` first: kvhost refuses some vLLMs on purpose
    (each suite has a test of how), and the scenarios need a supported one."""

    support = "detect"

    @classmethod
    def setUpClass(cls):
        import daemon
        cls.api = load()
        from kvhost import vllm as kv
        cls.kv = kv
        try:
            getattr(kv, cls.support)()
        except kv.UnsupportedVLLM as e:
            cls.refused = e
        else:
            cls.refused = None
        cls.daemon = daemon.Daemon()

    @classmethod
    def tearDownClass(cls):
        cls.daemon.stop()

    def require_support(self):
        if self.refused is not None:
            self.skipTest(f"kvhost refuses {self.api.name}: {self.refused}")
