"""The namespace a vLLM engine's rows live in.

A tier row is one offload key's bytes: every tensor-parallel worker's slot
of every layer for one chunk, exactly as vLLM's CPU tier lays it out. The
daemon stores it as an opaque one-segment key, so its declared geometry is
synthetic; what keeps models apart is the model id, which carries a digest
of everything that changes the row's meaning (model, dtype, parallel sizes,
chunk size, KV-cache groups and their layers, row size, hash algorithm).
"""

import hashlib
import json

from ..client import Geometry
from ._common import dtype_of, get as _get, scalar as _scalar

FORMAT = "kvhost-vllm-tier-v1"
MAX_DIM = 1 << 20


def _dtype(spec):
    return dtype_of(_get(spec, "vllm_config"))


def _tokens_per_chunk(spec):
    for path in (("offloaded_block_size",), ("block_size",), ("extra_config", "block_size")):
        v = _get(spec, *path)
        if isinstance(v, int) and v > 0:
            return v
    gpu = _get(spec, "vllm_config", "cache_config", "block_size")
    per = _get(spec, "extra_config", "blocks_per_chunk") or 1
    return gpu * per if isinstance(gpu, int) else None


def _groups(spec):
    groups = _get(spec, "kv_cache_config", "kv_cache_groups") or []
    out = []
    for g in groups:
        out.append({
            "layer_names": [str(n) for n in (_get(g, "layer_names") or [])],
            "tokens_per_block": _scalar(_get(g, "kv_cache_spec", "block_size")),
            "spec": type(_get(g, "kv_cache_spec")).__name__ if _get(g, "kv_cache_spec") is not None else None,
        })
    return out


def describe(spec, row_bytes, extra=""):
    """Returns the dict that identifies what a row means (JSON-safe)."""
    par = _get(spec, "vllm_config", "parallel_config")
    return {
        "format": FORMAT,
        "model": _scalar(_get(spec, "vllm_config", "model_config", "model")),
        "dtype": _dtype(spec),
        "tp_size": _scalar(_get(par, "tensor_parallel_size")),
        "pp_size": _scalar(_get(par, "pipeline_parallel_size")),
        "pcp_size": _scalar(_get(par, "prefill_context_parallel_size")),
        "dcp_size": _scalar(_get(par, "decode_context_parallel_size")),
        "tokens_per_chunk": _tokens_per_chunk(spec),
        "kv_cache_groups": _groups(spec),
        "hash_algo": _scalar(_get(spec, "vllm_config", "cache_config", "prefix_caching_hash_algo")),
        "row_bytes": row_bytes,
        "namespace": extra,
    }


def digest(desc):
    """sha256 of the description's compact, key-sorted JSON (hex)."""
    text = json.dumps(desc, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def model_id(desc):
    """The daemon's model id: readable prefix, then the digest (<= 128 bytes)."""
    name = str(desc.get("model") or "unknown").encode("ascii", "replace").decode()
    name = name.replace("/", "_")[:64]
    return f"vllm:{name}:{digest(desc)[:32]}"


def geometry(desc):
    """The daemon geometry of one row: one layer, one plane, one block per
    key of exactly row_bytes bytes."""
    row = desc["row_bytes"]
    if row < 512:
        raise ValueError(f"kvhost.vllm: a row of {row} bytes is below the daemon's 512-byte block minimum")
    head = 1
    while head < MAX_DIM and row % (head * 2) == 0 and head * 2 <= 4096:
        head *= 2
    heads = row // head
    if heads > MAX_DIM:
        raise ValueError(f"kvhost.vllm: a row of {row} bytes cannot be declared "
                         f"(it must be a multiple of {head << 1} up to {MAX_DIM * 4096} bytes)")
    return Geometry(model=model_id(desc), layers=1, kv_heads=heads, head_size=head, dtype_size=1,
                    tokens_per_block=1, tokens_per_key=1, mla=True)
