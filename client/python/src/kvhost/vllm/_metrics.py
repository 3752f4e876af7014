"""kvhost's counters in vLLM's metrics: the definitions a tier or spec
declares (``build_metric_definitions``) and the per-step payload it returns
from ``get_stats`` (vLLM's ``OffloadingConnectorStats``).

vLLM calls ``get_stats`` on every scheduler step and then ``is_empty()`` and
``aggregate()`` on what it got, so the payload must be vLLM's own class (or
None); every name in it must have been declared, with the same labels, or
vLLM's Prometheus logger asserts.

Inside vLLM's MultiConnector that is not always so: vLLM declares the
metrics of every child of one connector class from the first such child's
spec (``undeclared`` says when kvhost's spec is not that child's); the
spec's option ``"metrics": false`` turns its counters off (``enabled``).
"""

# Counter name suffix -> (counter key in the tier's or manager's Counter, help).
COUNTERS = {
    "stored_keys": ("stored_keys", "Keys kvhost stored (new files)."),
    "present_keys": ("present_keys", "Keys kvhost already held when asked to store them."),
    "not_admitted_keys": ("not_admitted_keys", "Keys kvhost's policy did not admit."),
    "store_failed_keys": ("store_failed_keys", "Keys kvhost failed to store."),
    "loaded_keys": ("loaded_keys", "Keys kvhost loaded."),
    "load_missing_keys": ("load_missing_keys", "Keys asked of kvhost that it no longer held."),
    "load_failed_keys": ("load_failed_keys", "Keys kvhost failed to load (missing, corrupt, I/O)."),
    "bytes_stored": ("bytes_stored", "Bytes kvhost stored."),
    "bytes_loaded": ("bytes_loaded", "Bytes kvhost loaded."),
    "lookup_hits": ("lookup_hits", "Lookups kvhost answered HIT."),
    "lookup_misses": ("lookup_misses", "Lookups kvhost answered MISS."),
    "lookup_retries": ("lookup_retries", "Lookups kvhost answered RETRY (its answer pending)."),
    "lookup_errors": ("lookup_errors", "Daemon lookups that failed (answered MISS)."),
    "job_errors": ("job_errors", "Jobs that failed on an error talking to the daemon."),
    "disconnects": ("disconnects", "Times the connection to the kvhost daemon was lost."),
    "reconnects": ("reconnects", "Times the connection to the kvhost daemon was made again after it was lost."),
    "repinned_keys": ("repinned_keys", "Keys being loaded that the manager queued to pin again on a new daemon."),
    "no_worker_keys": ("no_worker_keys", "Keys answered MISS because no worker's KV cache was registered with the daemon."),
    "given_up_jobs": ("given_up_jobs", "Jobs drain_jobs gave up on (the daemon did not end them within daemon_wait_s)."),
    "load_given_up_jobs": ("load_given_up_jobs", "Connector load jobs given up after daemon_wait_s."),
    "daemon_timeouts": ("daemon_timeouts", "Connector scheduler requests the daemon left unanswered for daemon_wait_s."),
}
PREFIX = "vllm:kv_offload_kvhost_"
INFLIGHT = PREFIX + "inflight_jobs"
LABELS = ("tier",)


def definitions(api, labels=LABELS):
    """Metric name -> vLLM's metadata, for build_metric_definitions; {}
    for a vLLM without metadata classes."""
    counter = getattr(api, "OffloadingCounterMetadata", None)
    gauge = getattr(api, "OffloadingGaugeMetadata", None)
    if counter is None or gauge is None:
        return {}
    out = {PREFIX + name: counter(documentation=doc, labelnames=labels) for name, (_, doc) in COUNTERS.items()}
    out[INFLIGHT] = gauge(documentation="kvhost jobs in flight.", labelnames=labels)
    return out


def stats(api, delta, inflight, labelvalues):
    """vLLM's OffloadingConnectorStats with the counters of delta (a
    Counter of increases) and the in-flight gauge (None: unchanged); None
    when nothing changed or this vLLM has no such class."""
    cls = getattr(api, "OffloadingConnectorStats", None)
    if cls is None or (inflight is None and not any(delta.get(k, 0) > 0 for k, _ in COUNTERS.values())):
        return None  # nothing to report: no payload built on vLLM's step
    s = cls()
    for name, (key, _) in COUNTERS.items():
        if delta.get(key, 0) > 0:
            s.increase_counter(PREFIX + name, delta[key], labelvalues)
    if inflight is not None:
        s.set_gauge(INFLIGHT, inflight, labelvalues)
    return None if s.is_empty() else s


def enabled(extra):
    """Whether the spec's options extra (kv_connector_extra_config) leave
    its counters on: the option "metrics", true unless false."""
    return (extra or {}).get("metrics", True) is not False


def undeclared(vc, extra, is_kvhost_spec):
    """Why vLLM's Prometheus logger will fail on the metrics of the
    MultiConnector of vc (vLLM's current config) that holds the child whose
    kv_connector_extra_config is extra (a kvhost spec's), as text; None when
    it will not, or vc says nothing of it (no MultiConnector, or no child
    with extra). vLLM declares each connector class's metrics from the spec
    of that class's first child (is_kvhost_spec(extra of a child) says
    whether that spec is kvhost's), and asserts on any other name a child
    of the class reports: kvhost's counters behind another spec (or behind a
    kvhost spec with them off), or another spec's behind kvhost's."""
    ktc = getattr(vc, "kv_transfer_config", None)
    if ktc is None or getattr(ktc, "kv_connector", None) != "MultiConnector":
        return None
    children = [c for c in (getattr(ktc, "kv_connector_extra_config", None) or {}).get("connectors") or ()
                if isinstance(c, dict)]
    extra = dict(extra or {})

    def cls(c):  # which connector class vLLM's factory builds for a child
        return c.get("kv_connector"), c.get("kv_connector_module_path")

    def spec(c):
        return (c.get("kv_connector_extra_config") or {}).get("spec_name", "CPUOffloadingSpec")

    mine = next((i for i, c in enumerate(children) if dict(c.get("kv_connector_extra_config") or {}) == extra), None)
    if mine is None:
        return None
    same = [i for i, c in enumerate(children) if cls(c) == cls(children[mine])]
    first = same[0]
    name = children[mine].get("kv_connector")
    if first != mine:
        fx = children[first].get("kv_connector_extra_config") or {}
        if not enabled(extra) or (is_kvhost_spec(fx) and enabled(fx)):
            return None  # nothing of kvhost's reported, or declared by the first child
        return (f"this kvhost spec is child {mine + 1} of vLLM's MultiConnector, after child {first + 1} "
                f"({name} over {spec(children[first])}"
                f"{', its metrics off' if is_kvhost_spec(fx) else ''}): vLLM declares every {name}'s Prometheus "
                f"metrics from the first one's spec only, so kvhost's counters ({PREFIX}*) are undeclared and "
                "vLLM's Prometheus logger fails on them at the first lookup; set \"metrics\": false in this "
                "child's kv_connector_extra_config (its counters then stay in the manager's counters()), or run "
                "kvhost as KvhostTier under vLLM's CPU tier (docs/vllm.md)")
    others = [i for i in same[1:] if not is_kvhost_spec(children[i].get("kv_connector_extra_config") or {})]
    if not others:
        return None
    return (f"this kvhost spec is child {mine + 1} of vLLM's MultiConnector, the first {name}: vLLM declares "
            f"every {name}'s Prometheus metrics from kvhost's spec, so the metrics of child {others[0] + 1} "
            f"({spec(children[others[0]])}) are undeclared and vLLM's Prometheus logger fails on them at the "
            f"first step; put that child first and set \"metrics\": false in kvhost's, or run kvhost as "
            "KvhostTier under vLLM's CPU tier (docs/vllm.md)")
