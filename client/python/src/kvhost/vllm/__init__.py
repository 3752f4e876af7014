"""kvhost.vllm: vLLM integration of the kvhost daemon.

``KvhostTier`` is a secondary tier for vLLM's TieringOffloadingSpec
(docs/vllm.md)::

    --kv-transfer-config '{"kv_connector":"OffloadingConnector","kv_role":"kv_both",
      "kv_connector_extra_config":{"spec_name":"TieringOffloadingSpec",
        "cpu_bytes_to_use":68719476736,
        "secondary_tiers":[{"type":"KvhostTier","module_path":"kvhost.vllm"}]}}'

The tier connects to ``$KVHOST_SOCKET``, else the daemon's default socket
(``default_socket()``), unless its ``"socket"`` key names one.

Importing this package imports no vLLM module. ``KvhostTier`` is built on
first access: it then imports vLLM's light ``vllm.v1.kv_offload`` modules
(if vLLM is installed) so that it subclasses vLLM's SecondaryTierManager,
as vLLM's factory requires; without vLLM it uses plain types. A vLLM
outside the supported window (``SUPPORTED_WINDOW``) raises UnsupportedVLLM.

``KvhostOffloadingSpec`` is vLLM's full offloading spec through kvhost's
GPU path (``"spec_name":"KvhostOffloadingSpec","spec_module_path":"kvhost.vllm"``),
built the same way on first access (``SPEC_WINDOW``).

``KvhostConnector`` is a vLLM KV connector (KVConnectorBase_V1) with
layer-wise loads and a load-or-recompute split
(``"kv_connector":"KvhostConnector","kv_connector_module_path":"kvhost.vllm"``),
built on first access too; ``connector_class(api)`` builds it on other
classes (None: plain ones without vLLM).
"""

from ._compat import SUPPORTED_WINDOW, UnsupportedVLLM, check_api, detect
from ._namespace import IdentityMismatch, IdentityUnknown
from .spec_compat import SPEC_WINDOW, KvhostLoadStoreSpec
from .tier import default_socket

__all__ = ["IdentityMismatch", "IdentityUnknown", "KvhostConnector", "KvhostLoadStoreSpec", "KvhostOffloadingSpec",
           "KvhostTier", "SPEC_WINDOW", "SUPPORTED_WINDOW", "UnsupportedVLLM", "connector_class", "default_socket",
           "detect", "spec_class", "tier_class"]


def connector_class(api=None):
    """Returns a KvhostConnector class bound to api (a namespace with
    vLLM's KVConnectorBase_V1, or None in it for plain classes); None
    detects the installed vLLM."""
    from .connector import connector_class as build
    return build(api)


def spec_class(api=None):
    """Returns a KvhostOffloadingSpec class bound to api (vLLM's classes or
    stand-ins of them); None detects the installed vLLM."""
    from .spec import spec_class as build
    return build(api)


def tier_class(api=None):
    """Returns a KvhostTier class bound to api: a namespace of vLLM's
    classes (LookupResult, JobResult, TransferJob, OffloadingEvent,
    RequestOffloadingContext, SecondaryTierManager, optional Medium) or of
    stand-ins of them; None detects the installed vLLM."""
    from .tier import _TierImpl

    api = detect() if api is None else api
    check_api(api)
    attrs = {"_api": api, "__module__": __name__, "__doc__": _TierImpl.__doc__}
    bases = (_TierImpl,)
    if api.SecondaryTierManager is not None and not issubclass(_TierImpl, api.SecondaryTierManager):
        bases = (_TierImpl, api.SecondaryTierManager)
    cls = type("KvhostTier", bases, attrs)
    abstract = sorted(getattr(cls, "__abstractmethods__", ()) or ())
    if abstract:
        raise UnsupportedVLLM(f"kvhost.vllm: this vLLM ({getattr(api, 'name', '?')}) requires tier "
                              f"methods kvhost does not implement: {', '.join(abstract)}; "
                              f"supported: {SUPPORTED_WINDOW}")
    if getattr(api, "Medium", None) is not None:
        from .tier import _pick_medium
        cls.medium = _pick_medium(api, None)
    return cls


_built = {}


def __getattr__(name):
    if name == "KvhostTier":
        if "KvhostTier" not in _built:
            _built["KvhostTier"] = tier_class()
        return _built["KvhostTier"]
    if name == "KvhostOffloadingSpec":
        if name not in _built:
            _built[name] = spec_class()
        return _built[name]
    if name == "KvhostConnector":
        if name not in _built:
            _built[name] = connector_class()
        return _built[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
