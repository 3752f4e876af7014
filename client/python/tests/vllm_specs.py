"""Stand-ins of vLLM's KV-cache specs and KVCacheConfig, as the connector
reads them (a spec's class name, page size, window and dtype), for tests
and scripts/ttft-bench.py that build a hybrid model's groups without a
vLLM tree."""

import types


class FullAttentionSpec:
    """A stand-in of vLLM's spec of that name."""

    def __init__(self, page):
        self.page_size_bytes = self.real_page_size_bytes = page
        self.dtype = "torch.bfloat16"


class SlidingWindowSpec(FullAttentionSpec):
    """A stand-in of vLLM's SlidingWindowSpec."""

    def __init__(self, page, window):
        super().__init__(page)
        self.sliding_window = window


class MambaSpec:
    """A stand-in of vLLM's MambaSpec: a page of states per block."""

    def __init__(self, page):
        self.page_size_bytes = page
        self.dtypes = ("torch.bfloat16", "torch.bfloat16")


def kv_cache_config(groups):
    """vLLM's KVCacheConfig as the connector reads it, of groups: (layer
    names, spec) pairs, one per KV-cache group."""
    ns = types.SimpleNamespace
    return ns(kv_cache_groups=[ns(layer_names=list(names), kv_cache_spec=spec) for names, spec in groups])
