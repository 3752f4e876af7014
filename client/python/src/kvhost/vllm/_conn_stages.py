"""KvhostConnector under pipeline parallelism: what the scheduler half
learns of every stage's namespaces.

Each pipeline stage's workers hold a slice of the model's layers, and
vLLM hands each worker's connector its own stage's KVCacheConfig (the
same groups and specs, the stage's layer names: kv_cache_utils'
_project_kv_cache_groups_to_worker). A worker's identity is its stage's
(its layers, and "stage"), so each stage stores and loads its own layers
in namespaces of its own, under the same keys (a chunk's hash and the
group's index). The scheduler half is built from stage 0's config only
(generate_scheduler_kv_cache_config copies worker 0's): it cannot name a
later stage's layers, and a stage's namespace geometry counts them.

So every worker hands its identity to the scheduler through vLLM's KV
connector handshake (get_handshake_metadata: a StageIdentity; the engine
collects one per worker after register_kv_caches and calls the
scheduler's set_xfer_handshake_metadata_pp_aware before any request).
The scheduler then looks up and pins each key in every stage's
namespaces: a prefix counts only where every stage holds it. Until it
has heard from every stage it claims nothing. Its split then prices
every stage's bytes and layers (costs; _split.CostModel.stages).
"""

import copy

from . import _conn_groups as groups_


class StageIdentity:
    """One worker's word to the scheduler half at start (vLLM's KV
    connector handshake metadata): its pipeline stage, its shard (tp ×
    pcp rank within the stage) and its identity (JSON-safe: _conn_common
    identity). Picklable (it crosses vLLM's process boundary)."""
    __slots__ = ("stage", "shard", "ident")

    def __init__(self, stage, shard, ident):
        self.stage, self.shard, self.ident = int(stage), int(shard), ident

    def __reduce__(self):
        return (StageIdentity, (self.stage, self.shard, self.ident))

    def __repr__(self):
        return f"StageIdentity(stage {self.stage}, shard {self.shard})"


def neutral(ident):
    """ident without what differs between pipeline stages of one engine:
    its stage and its layer names (a copy)."""
    out = copy.deepcopy(ident)
    out.pop("stage", None)
    for g in out["fields"]["kv_cache_groups"]:
        g.pop("layer_names", None)
    for g in out.get("kv_groups", ()):
        g.pop("layer_names", None)
    return out


def _differences(a, b, path=""):
    """The dotted paths where JSON-safe a and b differ (at most a few)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += _differences(a.get(k), b.get(k), f"{path}.{k}" if path else k)
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        out = []
        for i, (x, y) in enumerate(zip(a, b)):
            out += _differences(x, y, f"{path}[{i}]")
        return out
    return [] if a == b else [path or "(whole)"]


def stage_identities(own, pp, metas):
    """Per pipeline stage (0..pp-1) its identity, from the workers'
    StageIdentity values metas (others are ignored: another connector's
    handshake under vLLM's MultiConnector); None where a stage did not
    report (the scheduler then claims nothing). own: the scheduler's
    identity (stage 0's). ValueError where workers disagree with it
    beyond their stage and layers (another model, dtype, group spec, page
    size or layout): their keys would not mean what the scheduler's
    lookups assume."""
    want = neutral(own)
    per = {}
    for m in metas:
        if not isinstance(m, StageIdentity):
            continue
        if not 0 <= m.stage < pp:
            raise ValueError(f"kvhost.vllm: a worker says it is pipeline stage {m.stage}; the engine has {pp}")
        diff = _differences(want, neutral(m.ident))
        if diff:
            raise ValueError(f"kvhost.vllm: the worker of pipeline stage {m.stage}, shard {m.shard} has another "
                             f"identity than the scheduler's beyond its layers ({', '.join(diff[:4])}): refusing to "
                             "share KV across stages that disagree")
        if m.ident.get("stage", 0) != m.stage:
            raise ValueError(f"kvhost.vllm: the worker of pipeline stage {m.stage} names stage "
                             f"{m.ident.get('stage', 0)} in its identity")
        seen = per.setdefault(m.stage, m.ident)
        if seen != m.ident:
            raise ValueError(f"kvhost.vllm: the workers of pipeline stage {m.stage} name different layers "
                             f"({', '.join(_differences(seen, m.ident)[:4])})")
    if len(per) < pp:
        return None
    return [per[s] for s in range(pp)]


def group_here(ident, g):
    """Whether the stage of ident holds layers of KV-cache group g (a
    stage may hold none of a group whose layers are elsewhere)."""
    return bool(groups_.groups(ident)[g].layer_names)


def costs(stage_groups, tokens, chunk):
    """Per pipeline stage, of its KVGroups in stage_groups, the split's
    (bytes_per_token, layers) for a claim of tokens tokens: the bytes one
    of its workers loads per token (_conn_groups.bytes_per_token) and its
    layers (of every group: its share of the model's computation)."""
    return [(groups_.bytes_per_token(gs, tokens, chunk), sum(len(g.layer_names) for g in gs)) for gs in stage_groups]
