"""The tier's options (the keys of its entry in vLLM's secondary_tiers,
checked: options), the context-parallel interleave its namespace names
(cp_interleave), and the label its metrics carry (tier_label).
"""

from ..client import default_socket
from . import _namespace
from ._common import DAEMON_WAIT_S, check_daemon_wait, check_request_timeout, check_seconds, merge_options
from ._removals import parse_media


OWN_KEYS = {
    "socket": None,
    "namespace": "",
    "staging_bytes": 256 << 20,
    "threads": 4,
    "zero_copy": "auto",
    "lookup_ttl_s": 1.0,
    "lookup_wait_s": 0.0,
    "job_timeout_s": 60.0,
    "medium": None,
    "client_name": "vllm-tier",
    "max_events": 1 << 16,  # keys of stored events queued between two take_events calls
    "max_tracked_keys": 1 << 18,  # keys announced stored whose removal is reported (docs/routers.md)
    "mount_media": None,  # {daemon mount index: vLLM Medium name}: a move between media is reported
    "vllm_fs": False,
    "reconnect_s": 1.0,
    "request_timeout_s": 30.0,
    "daemon_wait_s": DAEMON_WAIT_S,  # the longest any vLLM call (start, drain_jobs, shutdown) waits on the daemon
    "page_layout": None,   # the GPU workers' page byte order (_namespace.page_layout), where not the default's
    "cp_kv_cache_interleave_size": None,  # with context parallelism: the engine's interleave (cp_interleave)
}
# Keys vLLM's factory passes to every tier beside the tier's own ones:
# "type" and "module_path" (older factories), "locality" (LOCAL or REMOTE,
# honoured), "backpressure_detector" (handed to vLLM's base class where it
# takes one) and "backpressure" (a factory that does not build the
# detector itself passes the raw entry; unused). Constructor parameters,
# not options: see _TierImpl.__init__.
IGNORED_KEYS = {"type", "module_path", "backpressure"}

# The model id prefix of a namespace that a daemon's vllm-fs mount serves
# by its fs-tier directory name (the "vllm_fs" option).
VLLM_FS_PREFIX = "vllm-fs:"

UNITS = {"": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40,
          "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12}


def size(name, v):
    if isinstance(v, bool):
        raise ValueError(f"kvhost.vllm: {name}: want a size, got {v!r}")
    if isinstance(v, int):
        return v
    s = str(v).strip()
    num = s.rstrip("".join(sorted({c for u in UNITS for c in u})))
    unit = s[len(num):].strip()
    if unit not in UNITS:
        raise ValueError(f"kvhost.vllm: {name}: unknown unit in {v!r} (want e.g. 256MiB)")
    try:
        return int(float(num) * UNITS[unit])
    except ValueError as e:
        raise ValueError(f"kvhost.vllm: {name}: not a size: {v!r}") from e


def options(own):
    o = merge_options(own, OWN_KEYS, IGNORED_KEYS, "tier")
    o["socket"] = o["socket"] or default_socket()
    o["staging_bytes"] = size("staging_bytes", o["staging_bytes"])
    zc = o["zero_copy"]
    o["zero_copy"] = {True: "on", False: "off"}.get(zc, zc) if isinstance(zc, bool) else str(zc)
    if o["zero_copy"] not in ("off", "auto", "on"):
        raise ValueError(f"kvhost.vllm: zero_copy: want off, auto or on, got {zc!r}")
    if not isinstance(o["vllm_fs"], bool):
        raise ValueError(f"kvhost.vllm: vllm_fs: want true or false, got {o['vllm_fs']!r}")
    if o["vllm_fs"] and o["namespace"]:
        # The fs tier's directory is the whole identity there: a namespace
        # could not keep tenants apart, and must not seem to.
        raise ValueError(f"kvhost.vllm: namespace {o['namespace']!r} with vllm_fs: the rows of vLLM's fs-tier "
                         f"directory are shared by every engine of the model that reads it; give each tenant "
                         f"its own directory (the fs tier's root) instead, or leave vllm_fs out")
    if o["vllm_fs"] and o["page_layout"] is not None:
        # vLLM's fs-tier directory does not name the page layout either.
        raise ValueError(f"kvhost.vllm: page_layout {o['page_layout']!r} with vllm_fs: vLLM's fs-tier directory "
                         f"is named without the page layout, so it cannot keep engines of another layout apart; "
                         f"give them another fs-tier root instead, or leave vllm_fs out")
    for k in ("threads", "max_events", "max_tracked_keys"):
        if not isinstance(o[k], int) or isinstance(o[k], bool) or o[k] < 1:
            raise ValueError(f"kvhost.vllm: {k}: want an integer >= 1, got {o[k]!r}")
    check_seconds(o, ("lookup_ttl_s", "lookup_wait_s", "job_timeout_s", "reconnect_s"))
    check_request_timeout(o)
    check_daemon_wait(o)
    parse_media(o["mount_media"])  # its form; the names are checked against vLLM's Medium at start
    return o


def cp_interleave(config, o):
    """The context-parallel KV interleave the identity names: None without
    context parallelism (dcp and pcp sizes 1: a page holds its block's
    tokens in order); with it, the cp_kv_cache_interleave_size option. A
    rank's page then holds every dcp×pcp-th run of interleave tokens, and
    vLLM's offloading config does not carry the interleave, while the tier
    runs in the scheduler, which cannot read the engine's: without the
    option the rows' meaning is unknown, and the tier refuses to start."""
    dcp, pcp = _namespace.cp_sizes(config)
    n = o["cp_kv_cache_interleave_size"]
    if dcp * pcp == 1:
        return None
    if n is None:
        raise ValueError(
            f"kvhost.vllm: this engine runs context parallelism (dcp {dcp}, pcp {pcp}): which tokens a row holds "
            f"follows vLLM's --cp-kv-cache-interleave-size, which the tier cannot read from the scheduler; set "
            f"the tier's cp_kv_cache_interleave_size to the engine's value (1 unless it was set)")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"kvhost.vllm: cp_kv_cache_interleave_size: want an integer >= 1, got {n!r}")
    if o["vllm_fs"] and n != 1:
        raise ValueError(
            f"kvhost.vllm: cp_kv_cache_interleave_size {n} with vllm_fs: vLLM's fs-tier directory is named "
            f"without the interleave, so it cannot keep engines of another interleave apart; give them another "
            f"fs-tier root instead, or leave vllm_fs out")
    return n


def tier_label(spec, tier_type, own, locality):
    """This tier's value of the "tier" label: vLLM's own label for it,
    "N:type" with N its place among the spec's secondary tiers (vLLM's
    TieringMetrics.tier_label), so that kvhost's counters join vLLM's for
    the same tier and two tiers of one type keep apart. The tier type alone
    where the spec does not list its tiers (vLLM's OffloadingSpec outside
    tiering, stand-ins)."""
    configs = getattr(spec, "secondary_tier_configs", None)
    if not isinstance(configs, (list, tuple)):
        return tier_type
    given = dict(own)
    if locality is not None:
        given["locality"] = locality
    try:  # two entries alike: the second built takes the second place
        taken = spec._kvhost_tier_places
    except AttributeError:
        taken = set()
        try:
            spec._kvhost_tier_places = taken
        except (AttributeError, TypeError):
            pass
    for i, cfg in enumerate(configs):
        if not isinstance(cfg, dict) or cfg.get("type") != tier_type or i in taken:
            continue
        rest = {k: v for k, v in cfg.items() if k not in ("type", "module_path", "backpressure_detector")}
        if rest == given:
            taken.add(i)
            return f"{i + 1}:{tier_type}"
    return tier_type
