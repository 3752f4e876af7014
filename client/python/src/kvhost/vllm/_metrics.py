"""kvhost's counters in vLLM's metrics: the definitions a tier or spec
declares (``build_metric_definitions``) and the per-step payload it returns
from ``get_stats`` (vLLM's ``OffloadingConnectorStats``).

vLLM calls ``get_stats`` on every scheduler step and then ``is_empty()`` and
``aggregate()`` on what it got, so the payload must be vLLM's own class (or
None); every name in it must have been declared, with the same labels, or
vLLM's Prometheus logger asserts.
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
