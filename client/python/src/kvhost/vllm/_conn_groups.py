"""KvhostConnector's KV-cache groups: what each group of a hybrid model
holds, how its keys are named, which of its blocks a save takes and a
load fills, and what a load of it costs.

vLLM's hybrid KV-cache manager (HMA) gives every group of layers of one
kind its own block ids (KVCacheConfig.kv_cache_groups, each a spec:
FullAttentionSpec, SlidingWindowSpec, MambaSpec, MLAAttentionSpec). The
connector keeps each group's KV in namespaces of its own, named by the
engine's identity and the group's spec (kind, window, dtype, page size),
so that groups never share a key:

- full attention (and MLA): every block of a chunk;
- sliding window: a chunk is saved only while vLLM still holds all its
  blocks (a null block is one vLLM freed), and a load fills only the
  blocks inside the window before the loaded prefix's end;
- state (Mamba, linear attention): the state at a chunk's end boundary,
  which vLLM keeps in the block at that position (align mode: the block
  table is indexed by position, earlier states nulled); one block per key.

A prefix of K tokens is claimable where every group holds what K needs
(claim_needs). MLA's latent KV is the same on every tensor-parallel rank:
rank 0 writes it, every rank loads it (replicated). Under pipeline
parallelism each stage's workers name their own stage's layers, so their
namespaces are their stage's.
"""

import dataclasses

from .. import protocol as p
from . import _namespace as ns_

FULL, WINDOW, STATE, MLA = "full", "sliding_window", "state", "mla"

# vLLM's spec classes by kind, looked up along a spec's MRO (first match):
# SlidingWindowMLASpec is a window, MLAAttentionSpec before FullAttentionSpec.
_KINDS = (("SlidingWindowSpec", WINDOW), ("MambaSpec", STATE), ("MLAAttentionSpec", MLA),
          ("FullAttentionSpec", FULL))
# Specs whose blocks are not a prefix's KV the connector can reuse.
_REFUSED = ("ChunkedLocalAttentionSpec", "CrossAttentionSpec", "EncoderOnlyAttentionSpec")


@dataclasses.dataclass(frozen=True)
class KVGroup:
    """One KV-cache group as the connector treats it. index: vLLM's group
    index (the 4-byte suffix of its offload keys); kind: FULL, WINDOW,
    STATE or MLA; layer_names: this worker's (stage's) layers of it, in
    vLLM's order; tokens_per_block; page_bytes: one layer's page per
    block on one worker; window: tokens of a sliding window (0: none);
    dtype: the spec's dtype text; replicated: the same bytes on every
    tensor-parallel rank (rank 0 saves, every rank loads); spec: vLLM's
    spec class name."""
    index: int
    kind: str
    layer_names: tuple
    tokens_per_block: int
    page_bytes: int
    window: int = 0
    dtype: str = ""
    replicated: bool = False
    spec: str = "FullAttentionSpec"

    def describe(self):
        """What separates this group's keys from every other group's
        (JSON-safe): part of its namespaces' identity."""
        return {"index": self.index, "kind": self.kind, "window": self.window, "dtype": self.dtype,
                "page_bytes": self.page_bytes, "replicated": self.replicated, "spec": self.spec}

    def blocks_per_key(self, bpc):
        """GPU blocks per key: one state per key for STATE, else bpc."""
        return 1 if self.kind == STATE else bpc


def _kind(spec):
    names = [c.__name__ for c in type(spec).__mro__]
    for bad in _REFUSED:
        if bad in names:
            raise ValueError(f"kvhost.vllm: KvhostConnector cannot reuse the KV of a {type(spec).__name__} group "
                             "(its blocks are not a prompt prefix's); use KvhostOffloadingSpec for this model")
    for name, kind in _KINDS:
        if name in names:
            return kind
    raise ValueError(f"kvhost.vllm: KvhostConnector does not know vLLM's KV-cache spec {type(spec).__name__}; "
                     "supported: FullAttentionSpec, SlidingWindowSpec, MambaSpec (and linear attention), "
                     "MLAAttentionSpec")


def _page_bytes(spec, kind):
    """One layer's page per block: an attention spec's unpadded page (a
    hybrid model pads attention pages to its state pages' size; the
    padding holds nothing), a state spec's whole page (its states)."""
    if kind != STATE:
        for name in ("real_page_size_bytes", "unpadded_page_size_bytes"):
            v = getattr(spec, name, None)
            if isinstance(v, int) and v > 0:
                return v
    return int(spec.page_size_bytes)


def from_vllm(kv_cache_config, config, opts):
    """The KVGroups of vLLM's KVCacheConfig (per group its spec), with the
    tokens per block of vLLM's OffloadingConfig config (it counts decode
    context parallelism); None where kv_cache_config is None (a config
    built by hand: one full-attention group). ValueError names what the
    connector cannot serve: unknown or unusable specs, groups of
    different tokens per block (a chunk must span the same tokens in
    every group)."""
    if kv_cache_config is None or not getattr(kv_cache_config, "kv_cache_groups", None):
        return None
    cfg_groups = ns_.groups_of(config)
    # MLA's latent KV is whole on every tensor-parallel rank unless context
    # parallelism splits its tokens; vLLM marks such a model's layout
    # replicated_layout (one group of MLA only), which holds for any group.
    tp = ns_.count(config, "parallel.tp_size", "tp size")
    cp = ns_.count(config, "parallel.pcp_size", "pcp size") * ns_.count(config, "parallel.dcp_size", "dcp size")
    marked = ns_.flag(config, "replicated_layout")
    out = []
    for i, g in enumerate(kv_cache_config.kv_cache_groups):
        spec = g.kv_cache_spec
        kind = _kind(spec)
        window = int(getattr(spec, "sliding_window", 0) or 0) if kind == WINDOW else 0
        dtype = getattr(spec, "dtype", None) if kind != STATE else getattr(spec, "dtypes", None)
        replicated = tp > 1 and (marked or (kind == MLA and cp == 1))
        out.append(KVGroup(index=i, kind=kind, layer_names=tuple(g.layer_names),
                           tokens_per_block=cfg_groups[i]["tokens_per_block"], page_bytes=_page_bytes(spec, kind),
                           window=window, dtype=str(dtype), replicated=replicated, spec=type(spec).__name__))
    tpb = {g.tokens_per_block for g in out}
    if len(tpb) != 1:
        raise ValueError(f"kvhost.vllm: KvhostConnector needs one block size in every KV-cache group (a key spans "
                         f"the same tokens in each); this model's groups have {sorted(tpb)} tokens per block")
    if len(out) > 1 and opts.get("page_bytes"):
        raise ValueError("kvhost.vllm: page_bytes names one page size; this model has "
                         f"{len(out)} KV-cache groups, whose page sizes vLLM's specs give: leave it unset")
    return out


def plain(ident):
    """Whether ident's keys are those of one full-attention group with no
    per-group identity (the namespaces the connector had before groups)."""
    return "kv_groups" not in ident


def groups(ident):
    """The identity's KVGroups (one full-attention group for a plain one)."""
    kg = ident.get("kv_groups")
    if kg is None:
        g = ident["fields"]["kv_cache_groups"][0]
        return [KVGroup(index=0, kind=FULL, layer_names=tuple(g["layer_names"]),
                        tokens_per_block=g["tokens_per_block"], page_bytes=ident["page_bytes"])]
    return [KVGroup(**{**d, "layer_names": tuple(d["layer_names"])}) for d in kg]


def shards(config):
    """Workers per pipeline stage holding a different part of each block
    (tp × pcp)."""
    return ns_.count(config, "parallel.tp_size", "tp size") * ns_.count(config, "parallel.pcp_size", "pcp size")


def stages(config):
    """Pipeline stages (1 without pipeline parallelism)."""
    return ns_.count(config, "parallel.pp_size", "pp size")


def place(config):
    """(stage, shard) of this worker: vLLM's rank is stage-major over the
    tp × pcp workers of a stage; (0, 0) on the scheduler."""
    rank = ns_.count(config, "parallel.rank", "worker rank", least=0)
    world = ns_.count(config, "parallel.world_size", "world size")
    if rank >= world:
        raise ns_.IdentityUnknown(f"kvhost.vllm: the offloading config's parallel.rank {rank} is not below its "
                                  f"world_size {world}; refusing to share KV under a guessed identity")
    n = shards(config)
    return rank // n, rank % n


# -- what a claim needs, and which blocks move --------------------------------------


def window_first_block(g, end):
    """The first block a sliding-window group needs to compute the token
    at position end: the window before it starts at end - window + 1."""
    first_tok = max(0, end - g.window + 1)
    return first_tok // g.tokens_per_block


def claim_needs(g, first, end, chunk):
    """The chunk indexes group g must hold for a claim of the chunks
    [first, end // chunk) (end in tokens, a chunk multiple): every one
    for FULL and MLA, those overlapping the window before end for WINDOW,
    the chunk ending at end for STATE (its state)."""
    last = end // chunk
    if g.kind == STATE:
        return range(last - 1, last)
    if g.kind == WINDOW:
        lo = window_first_block(g, end) * g.tokens_per_block // chunk
        return range(max(first, lo), last)
    return range(first, last)


def load_blocks(g, chunks, block_ids, bpc, skip, end):
    """(chunk index, block list) of group g's keys to load for a claim
    ending at end (tokens): block_ids, the group's GPU block ids of the
    request; skip, the blocks already on the GPU. A block not needed
    (on the GPU already, outside a window, vLLM's null block 0) is
    NO_BLOCK; a key with none needed is left out. None where a needed
    block is missing (vLLM gave a null block or none where the state or
    the window's KV goes): the claim cannot be loaded."""
    out = []
    if g.kind == STATE:
        j = end // g.tokens_per_block - 1
        if j >= len(block_ids) or block_ids[j] == 0:
            return None
        return [(chunks[-1], [block_ids[j]])] if j >= skip else []
    lo = max(skip, window_first_block(g, end) if g.kind == WINDOW else 0)  # the first block needed
    for c in chunks:
        a, b = c * bpc, (c + 1) * bpc
        if b > len(block_ids):
            return None  # vLLM gave fewer blocks than the claim covers
        if b <= lo:
            continue  # no block of the key needed
        ids = block_ids[a:b]
        need = ids if a >= lo else ids[lo - a:]
        if 0 in need:
            return None
        if need.count(p.NO_BLOCK) < len(need):  # a key whose needed ids are all NO_BLOCK moves nothing
            out.append((c, list(ids) if a >= lo else [p.NO_BLOCK] * (lo - a) + list(need)))
    return out


def save_blocks(g, c, block_ids, bpc):
    """Group g's blocks of chunk c to save, None where vLLM no longer
    holds them (a null block: freed outside a window, or no state at
    that boundary)."""
    if g.kind == STATE:
        j = (c + 1) * bpc - 1
        ids = block_ids[j:j + 1]
    else:
        ids = block_ids[c * bpc:(c + 1) * bpc]
    if len(ids) != g.blocks_per_key(bpc) or any(b == 0 for b in ids):
        return None
    return list(ids)


# -- the split's byte cost -------------------------------------------------------


def load_bytes(gs, tokens, chunk):
    """Bytes one worker loads for a claim of tokens tokens over the
    groups gs: a FULL or MLA group every token's pages, a WINDOW group
    the chunks its window spans (at most window + chunk tokens, never
    the prompt), a STATE group one state per layer."""
    if tokens <= 0:
        return 0
    total = 0
    for g in gs:
        per_block = g.page_bytes * len(g.layer_names)
        if g.kind == STATE:
            total += per_block
            continue
        n = tokens
        if g.kind == WINDOW:
            n = min(tokens, -(-(g.window - 1) // chunk) * chunk + chunk)
        total += -(-n // g.tokens_per_block) * per_block
    return total


def claim_costs(gs, tokens, chunk):
    """The split's (bytes_per_token, claim_bytes) for claims of up to
    tokens tokens over the groups gs: the bytes per token of the FULL and
    MLA groups, and what a claim loads whatever its length, a STATE
    group's state and a WINDOW group's chunks for a claim of tokens
    tokens (a shorter claim loads no more). n * bytes_per_token +
    claim_bytes is load_bytes(gs, n, chunk) within a block per group at n
    = tokens."""
    per, fixed = 0.0, 0
    for g in gs:
        if g.kind in (STATE, WINDOW):
            fixed += load_bytes([g], tokens, chunk)
        else:
            per += g.page_bytes * len(g.layer_names) / g.tokens_per_block
    return per, fixed


def bytes_per_token(gs, tokens, chunk):
    """load_bytes per token of a claim of tokens tokens: what the split's
    CostModel.bytes_per_token stands for (a constant for full attention
    alone; for a window or a state group it falls as the claim grows)."""
    return load_bytes(gs, tokens, chunk) / max(1, tokens)
