"""Which vLLM the tier talks to: feature detection and fallback types.

Only vLLM's light ``vllm.v1.kv_offload`` modules are imported, and only
when asked (``detect``). When vLLM is not installed the tier runs with the
plain types below (benchmarks, tests); when it is installed but lacks the
secondary-tier interface this package was written for, construction is
refused with ``UnsupportedVLLM`` naming the supported window.
"""

import dataclasses
import enum
import importlib
import importlib.util
import inspect
import types
import typing

from ._common import (OffloadingEvent, RequestOffloadingContext, UnsupportedVLLM,  # noqa: F401 (re-exported)
                      missing_features, unsupported, vllm_installed, vllm_version)

# The window this package was written and tested against (by feature, not
# version string: vLLM's main reports "dev" versions).
SUPPORTED_WINDOW = (
    "vLLM with the secondary-tier interface of main 2026-08-10 (commit a123159f, between "
    "v0.27 and v0.28; run against a123159f, 017e9f44 and 2f41c894) and later releases "
    "keeping it: vllm.v1.kv_offload.tiering.base with "
    "SecondaryTierManager(offloading_spec, primary_kv_view, tier_type), TransferJob, "
    "JobResult(successful_keys=...), get_finished_jobs/drain_jobs/on_new_request, and "
    "vllm.v1.kv_offload.base.LookupResult with HIT, MISS and RETRY")


class LookupResult(enum.Enum):
    """Fallback of vLLM's LookupResult (used only without vLLM)."""
    HIT = "hit"
    MISS = "miss"
    RETRY = "retry"


@dataclasses.dataclass
class JobResult:
    """Fallback of vLLM's JobResult (used only without vLLM)."""
    job_id: int
    success: bool
    successful_keys: typing.Optional[list] = None
    transfer_time: typing.Optional[float] = None


class SecondaryTierManager:
    """Fallback base class (used only without vLLM)."""

    def __init__(self, offloading_spec, primary_kv_view, tier_type):
        self._offloading_spec = offloading_spec
        self._primary_kv_view = primary_kv_view
        self.tier_type = tier_type


FALLBACK = types.SimpleNamespace(
    name="standalone (vLLM not installed)",
    LookupResult=LookupResult, JobResult=JobResult, OffloadingEvent=OffloadingEvent,
    RequestOffloadingContext=RequestOffloadingContext,
    SecondaryTierManager=SecondaryTierManager, Medium=None, Locality=None,
    OffloadingConnectorStats=None, OffloadingCounterMetadata=None, OffloadingGaugeMetadata=None)

# Where vLLM keeps OffloadingConnectorStats, the class get_stats must return
# (vLLM calls is_empty() and aggregate() on it every scheduler step).
_STATS_MODULE = "vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics"


def takes(fn, name):
    """Whether callable fn accepts a keyword argument called name."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def locality(api, value):
    """vLLM's Locality member for value ("LOCAL", "REMOTE"), None for None;
    a ValueError naming the members for anything else."""
    if value is None:
        return None
    loc = getattr(api, "Locality", None)
    if loc is None:
        return str(value)
    try:
        return loc(value) if not isinstance(value, loc) else value
    except ValueError:
        raise ValueError(f"kvhost.vllm: locality {value!r}: want one of "
                         f"{', '.join(m.value for m in loc)}") from None


def stats_class():
    """vLLM's OffloadingConnectorStats, None when it cannot be imported."""
    try:
        if importlib.util.find_spec(_STATS_MODULE) is None:
            return None
        return getattr(importlib.import_module(_STATS_MODULE), "OffloadingConnectorStats", None)
    except ImportError:
        return None


def check_api(api):
    """Raises UnsupportedVLLM unless api (a namespace of vLLM's classes, or
    stand-ins of them) has every feature the tier uses."""
    missing = missing_features(api, ("LookupResult", "JobResult", "OffloadingEvent", "SecondaryTierManager"),
                               members={"LookupResult": ("HIT", "MISS", "RETRY")},
                               fields={"JobResult": ("successful_keys",)})
    if getattr(api, "TransferJob", None) is None and api is not FALLBACK:
        missing.append("TransferJob")
    if missing:
        raise unsupported(api, missing, SUPPORTED_WINDOW)


def detect():
    """Returns the vLLM classes the tier uses (a namespace), FALLBACK when
    vLLM is not installed; raises UnsupportedVLLM for a vLLM outside the
    window."""
    if not vllm_installed():
        return FALLBACK
    try:
        if importlib.util.find_spec("vllm.v1.kv_offload.tiering.base") is None:
            raise ImportError("no module vllm.v1.kv_offload.tiering.base")
        base = importlib.import_module("vllm.v1.kv_offload.base")
        tier = importlib.import_module("vllm.v1.kv_offload.tiering.base")
    except ImportError as e:
        raise UnsupportedVLLM(f"kvhost.vllm: the installed vLLM has no usable secondary-tier "
                              f"interface ({e}); supported: {SUPPORTED_WINDOW}") from e
    api = types.SimpleNamespace(
        name=f"vllm {vllm_version()}",
        LookupResult=getattr(base, "LookupResult", None) or getattr(tier, "LookupResult", None),
        JobResult=getattr(tier, "JobResult", None),
        TransferJob=getattr(tier, "TransferJob", None),
        OffloadingEvent=getattr(base, "OffloadingEvent", None),
        RequestOffloadingContext=getattr(base, "RequestOffloadingContext", None),
        SecondaryTierManager=getattr(tier, "SecondaryTierManager", None),
        Medium=getattr(base, "Medium", None),
        Locality=getattr(base, "Locality", None),
        OffloadingConnectorStats=stats_class(),
        OffloadingCounterMetadata=getattr(base, "OffloadingCounterMetadata", None),
        OffloadingGaugeMetadata=getattr(base, "OffloadingGaugeMetadata", None))
    check_api(api)
    return api
