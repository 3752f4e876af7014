"""Page geometry of a vLLM engine, read from the OffloadingConfig vLLM
hands the offloading spec and the connector alike: GPU blocks per
offloaded chunk (one key), bytes of one layer's page per GPU block, and
an identity's KV-cache groups. The spec (spec_compat) and the connector
(_conn_common) both name their namespaces from these; neither owns them.

Importing this module imports nothing of vLLM.
"""

from .. import protocol as p
from . import _namespace as ns_
from ._namespace import IdentityUnknown


def blocks_per_chunk(config):
    """GPU blocks per offloaded chunk (one key): config.cache.blocks_per_chunk,
    as vLLM resolved it from block_size / blocks_per_chunk."""
    n = ns_.count(config, "cache.blocks_per_chunk", "blocks per chunk")
    if n > p.MAX_BLOCKS_PER_KEY:
        raise ValueError(f"kvhost.vllm: blocks_per_chunk {n}: the daemon takes at most "
                         f"{p.MAX_BLOCKS_PER_KEY} blocks per key")
    return n


def page_bytes(config, opts):
    """Bytes of one layer's page per GPU block: the option page_bytes, else
    config.worker_kv_bytes_per_block over the most layers of any group
    (vLLM gives every layer of every group one page size; a hybrid model's
    groups share their tensors). IdentityUnknown when it does not divide."""
    if opts.get("page_bytes"):
        return int(opts["page_bytes"])
    groups = ns_.groups_of(config)
    total = ns_.attr(config, "worker_kv_bytes_per_block")
    layers = max(len(g["layer_names"]) for g in groups)
    if isinstance(total, bool) or not isinstance(total, int) or total <= 0 or total % layers:
        raise IdentityUnknown(
            f"kvhost.vllm: cannot tell the page size from vLLM's offloading config "
            f"(worker_kv_bytes_per_block {total!r} over {layers} layers); set the spec option "
            "\"page_bytes\" (bytes per layer and GPU block) — the scheduler and every worker must agree")
    return total // layers


def groups(ident):
    """The KV-cache groups of an identity: [{"tokens_per_block", "layer_names"}]."""
    return ident["fields"]["kv_cache_groups"]


def chunk_blocks(ident):
    """GPU blocks per key (per offloaded chunk) of an identity."""
    return ident["fields"]["blocks_per_file"]
