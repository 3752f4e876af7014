"""The namespace a vLLM engine's tier rows live in, and the identity rule.

A tier row is one offload key's bytes: every worker's slot of every layer
for one chunk, exactly as vLLM's CPU tier lays it out. The daemon stores it
as an opaque one-segment key, so its declared geometry is synthetic; what
keeps models apart is the model id, which carries a digest of everything
that changes a row's meaning.

The identity is read from what vLLM hands every offloading spec: its
``config`` (an ``OffloadingConfig``: ``model`` name and dtype, ``parallel``
sizes, ``groups`` with their layer names and tokens per block, ``cache``
tokens per hash and blocks per chunk, the canonical and replicated layout
flags). It is the set of fields vLLM's own fs tier separates directories by
(the same collapse of parallel sizes where vLLM certifies the bytes
portable across them), plus the row size, the attention layout where vLLM
says it, and the operator's ``namespace`` option. A field that cannot be
read refuses the tier with ``IdentityUnknown`` naming it: two models must
never share keys on a guess (vLLM's block hashes of one prompt are equal
across models).

The hash algorithm is not part of the identity: vLLM does not hand it to a
spec, and keys of different algorithms are different bytes.

The byte order of a page is not in vLLM's offloading config either: it
follows the attention backend, the KV cache layout (``NHD`` or ``HND``:
``get_kv_cache_layout()``) and whether the GPU worker got vLLM's
cross-layer slab. The identity carries it as ``page_layout``: the
operator's ``page_layout`` option where given, else what the default
configuration gets (``DEFAULT_BACKEND``, ``VLLM_KV_CACHE_LAYOUT``
or the offloading connector's HND, the slab for a single KV-cache group
without the canonical layout). The spec's workers compare it with what they
really got and refuse on a difference.
"""

import hashlib
import json
import os
import re

from ..client import Geometry, vllm_fs_fingerprint

FORMAT = "kvhost-vllm-tier-v3"
MAX_DIM = 1 << 20
MAX_MODEL_ID = 128


# The attention backend vLLM picks by default on the GPUs the spec is run
# on (an H100: sm90, a model without MLA; vLLM 7cfb97e3's
# platforms/cuda.py), and the environment variable that overrides the
# offloading connector's KV cache layout (a backend's required layout still
# comes first).
DEFAULT_BACKEND = "FLASH_ATTN"
LAYOUT_ENV = "VLLM_KV_CACHE_LAYOUT"
CONNECTOR_LAYOUT = "HND"  # OffloadingConnector.get_required_kvcache_layout
LAYOUTS = ("NHD", "HND")
SLAB = "slab"
_NAME = r"[A-Za-z0-9_.-]+(?:\+[A-Za-z0-9_.-]+)*"
PAGE_LAYOUT_RE = re.compile(rf"{_NAME}(?:,{_NAME})*/(?:NHD|HND)(?:/{SLAB})?")


class IdentityUnknown(ValueError):
    """A field that separates models could not be read from vLLM's
    offloading config: the tier or spec refuses to start."""


class IdentityMismatch(RuntimeError):
    """The daemon serves this engine's namespace from somewhere its rows
    are not: a vllm-fs mount set to serve the namespace over another
    directory. The tier or spec refuses that daemon."""


def check_served(declared, geom, data_dir=None, kvhost_mounts=True, note=""):
    """Raises IdentityMismatch unless declared, the fingerprint of the
    daemon's Declared reply for geom (a Geometry), says the namespace is
    served where this engine's rows are: on the daemon's kvhost mounts,
    whose files each carry the geometry's own fingerprint (where
    kvhost_mounts), or by a vllm-fs mount from data_dir, the data directory
    vLLM's fs tier names for this engine's fields (None: no such directory
    is this engine's). A vllm-fs mount's files carry no identity: a mount
    whose configured namespace is this one over another model's directory
    would hand that model's rows under this namespace, and the fingerprint
    (of the mount's data directory) is the client's only way to tell. note
    follows what the refusal says it wants."""
    own = geom.fingerprint()
    ok = {own} if kvhost_mounts else set()
    fs = None
    if data_dir is not None:
        fs = vllm_fs_fingerprint(data_dir, geom.model)
        ok.add(fs)
    if declared in ok:
        return
    want = []
    if kvhost_mounts:
        want.append(f"the namespace's own ({own:016x}: its files on a kvhost mount)")
    if fs is not None:
        want.append(f"that of vLLM's fs-tier directory of this engine, {data_dir} ({fs:016x})")
    raise IdentityMismatch(
        f"kvhost.vllm: the daemon does not serve namespace {geom.model} from where this engine's KV is: "
        f"its fingerprint {declared:016x} is not {' nor '.join(want)}{note}. A vllm-fs mount configured with this "
        "namespace over another directory (another model's or geometry's rows)? Refusing to read that KV; "
        "correct the mount's path or its [mount.vllm_fs] namespace (docs/vllm.md)")


def _missing(what, path, got):
    return IdentityUnknown(
        f"kvhost.vllm: cannot tell the {what} from vLLM's offloading config "
        f"(spec.config.{path} is {got!r}); refusing to share KV under a guessed identity. "
        "This vLLM hands the spec a config kvhost does not understand: see docs/vllm.md "
        "(supported versions)")


def attr(obj, path):
    """obj.a.b... for path "a.b...", None where a step is missing."""
    for name in path.split("."):
        if obj is None:
            return None
        obj = getattr(obj, name, None)
    return obj


def text(config, path, what):
    """The non-empty string at path (not "auto"), else IdentityUnknown naming it."""
    v = attr(config, path)
    if not isinstance(v, str) or not v or v == "auto":
        raise _missing(what, path, v)
    return v


def count(config, path, what, least=1):
    """The integer >= least at path, else IdentityUnknown naming it."""
    v = attr(config, path)
    if isinstance(v, bool) or not isinstance(v, int) or v < least:
        raise _missing(what, path, v)
    return v


def flag(config, path):
    """The bool at path; False where this vLLM's config has no such field."""
    v = attr(config, path)
    if v is None:
        return False  # a vLLM without the field has only the default layout
    if not isinstance(v, bool):
        raise _missing(path.rsplit(".", 1)[-1], path, v)
    return v


def config_of(spec):
    """vLLM's OffloadingConfig of an offloading spec (spec.config)."""
    config = getattr(spec, "config", None)
    if config is None or getattr(config, "model", None) is None:
        raise IdentityUnknown(
            f"kvhost.vllm: the offloading spec handed to kvhost ({type(spec).__name__}) has no "
            "config.model: this vLLM does not hand its spec an OffloadingConfig as kvhost knows it; "
            "refusing to share KV under a guessed identity (docs/vllm.md, supported versions)")
    return config


def groups_of(config):
    """The KV-cache groups: [{"tokens_per_block", "layer_names"}], as vLLM's
    fs tier records them. A group may name no layer (a pipeline stage
    holds none of it: vLLM keeps the group, empty, in the stage's
    config), but not every group."""
    groups = attr(config, "groups")
    if not groups:
        raise _missing("KV-cache groups", "groups", groups)
    out = []
    for i, g in enumerate(groups):
        names = attr(g, "layer_names")
        if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) and n for n in names):
            raise _missing(f"layer names of KV-cache group {i}", f"groups[{i}].layer_names", names)
        out.append({"tokens_per_block": count(g, "tokens_per_block", f"tokens per block of group {i}"),
                    "layer_names": list(names)})
    if not any(g["layer_names"] for g in out):
        raise _missing("layer names of KV-cache group 0", "groups[0].layer_names", attr(groups[0], "layer_names"))
    return out


def canonical_format(config):
    """vLLM's canonical format id when the canonical layout is on, else
    None; refuses when it is on and vLLM cannot name it."""
    if not flag(config, "canonical_layout"):
        return None
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping import canonical_format_id
        fid = canonical_format_id()
    except Exception as e:  # vLLM's own helper is the only source of truth
        raise IdentityUnknown(f"kvhost.vllm: canonical_layout is on but vLLM's canonical format id "
                              f"cannot be read ({e}); refusing to share KV under a guessed identity") from e
    if not isinstance(fid, str) or not fid:
        raise _missing("canonical format", "canonical_layout", fid)
    return fid


def page_layout_text(backends, layout, slab):
    """The page_layout value of pages made by backends (per KV-cache group,
    the names of its layers' attention backends), the KV cache layout and
    whether they are cut from vLLM's cross-layer slab:
    "<group 0>,<group 1>.../<layout>[/slab]", a group's names joined by
    "+", and one group's where every group's are the same."""
    per = ["+".join(sorted(set(names))) for names in backends]
    if len(set(per)) == 1:
        per = per[:1]
    return ",".join(per) + f"/{layout}" + (f"/{SLAB}" if slab else "")


def page_layout(config, option=None, environ=None):
    """The byte order of the pages an identity names (a page_layout_text
    value): the option where given, else what vLLM's default configuration
    gets — DEFAULT_BACKEND, VLLM_KV_CACHE_LAYOUT where set, else the
    offloading connector's HND, and the cross-layer slab where the model has
    one KV-cache group and the canonical layout is off (vLLM's
    prefer_cross_layer_blocks; a backend that indexes KV by block stride,
    FlashAttention among them, then gets it). Only the spec's workers can see
    what they really got: they refuse where it is not this."""
    if option is not None:
        if not isinstance(option, str) or not PAGE_LAYOUT_RE.fullmatch(option):
            raise ValueError(f"kvhost.vllm: page_layout: want <attention backend>/<NHD|HND>[/{SLAB}] as a "
                             f"worker's refusal names it (e.g. \"FLASHINFER/HND\"), got {option!r}")
        return option
    env = (os.environ if environ is None else environ).get(LAYOUT_ENV)
    if env is not None and env not in LAYOUTS:
        raise ValueError(f"kvhost.vllm: {LAYOUT_ENV}={env!r}: want NHD or HND (vLLM refuses it too)")
    slab = len(groups_of(config)) == 1 and not flag(config, "canonical_layout")
    return page_layout_text([[DEFAULT_BACKEND]], env or CONNECTOR_LAYOUT, slab)


def cp_sizes(config):
    """The engine's decode and prefill context-parallel sizes (dcp, pcp):
    above 1, a rank's page holds every dcp×pcp-th run of
    cp_kv_cache_interleave_size tokens of its block."""
    return (count(config, "parallel.dcp_size", "dcp size"), count(config, "parallel.pcp_size", "pcp size"))


def fs_fields(config, canonical=None, collapse=True):
    """The fields vLLM's fs tier names its directory by, for this config
    (with collapse, parallel sizes collapsed to 1 where vLLM certifies the
    bytes portable across them, as its fs tier does)."""
    par = "parallel"
    agnostic = flag(config, f"{par}.is_parallelism_agnostic") or flag(config, "replicated_layout")
    sizes = {k: count(config, f"{par}.{k}", k.replace("_", " ")) for k in ("tp_size", "pp_size", "pcp_size", "dcp_size")}
    if agnostic and collapse:
        sizes = dict.fromkeys(sizes, 1)
    fields = {
        "model_name": text(config, "model.name", "model name"),
        "tokens_per_hash": count(config, "cache.tokens_per_hash", "tokens per hash"),
        "blocks_per_file": count(config, "cache.blocks_per_chunk", "blocks per chunk"),
        **sizes,
        "dtype": text(config, "model.dtype", "KV-cache dtype"),
        "kv_cache_groups": groups_of(config),
        "inference_engine": "vllm",
    }
    if not agnostic:
        fields["parallel_agnostic"] = False
    if flag(config, "replicated_layout"):
        fields["replicated_layout"] = True
    if canonical is not None:
        fields["canonical_format"] = canonical
    return fields


def fs_base(fields):
    """vLLM's fs-tier base directory name for fields:
    <model name with '/' -> '_'>_<12 hex of sha256 over their compact JSON>."""
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return f"{fields['model_name'].replace('/', '_')}_{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def fs_namespace(prefix, base):
    """The model id a daemon's vllm-fs mount serves base's directory under
    by default (prefix "vllm-fs:"): prefix and base, or, where that is
    longer than MAX_MODEL_ID bytes (a model given by a long local path),
    prefix, the start of base's model name cut on a character boundary to
    fit, and base's "_<hash>": the daemon's rule (internal/engine,
    defaultNamespace)."""
    whole = prefix + base
    if len(whole.encode()) <= MAX_MODEL_ID:
        return whole
    tail = base[-13:]  # "_" and the 12 hex digits of the fields' hash
    room = MAX_MODEL_ID - len(prefix.encode()) - len(tail)
    return prefix + base[:-13].encode()[:room].decode("utf-8", "ignore") + tail


def identity(config, fmt, extra="", collapse=True, layout=None):
    """What every key of an engine of this config shares (JSON-safe): the
    format tag fmt, vLLM's fs-tier fields (collapse as in fs_fields), the
    page layout (page_layout, of the option layout), the attention layout
    where the config names it, and the operator's extra namespace text;
    IdentityUnknown names a field vLLM did not give. The tier adds its row
    size, the spec its page size."""
    desc = {"format": fmt, "fields": fs_fields(config, canonical_format(config), collapse),
            "namespace": str(extra), "page_layout": page_layout(config, layout)}
    layout = attr(config, "kv_cache_layout")
    if layout is not None:
        desc["kv_cache_layout"] = str(layout)
    return desc


def describe(spec, row_bytes, extra="", layout=None):
    """The dict that identifies what a row of spec's engine means
    (JSON-safe); IdentityUnknown names a field vLLM did not give."""
    desc = identity(config_of(spec), FORMAT, extra, layout=layout)
    desc["row_bytes"] = int(row_bytes)
    return desc


def digest(desc):
    """sha256 of the description's compact, key-sorted JSON (hex)."""
    text = json.dumps(desc, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def model_id(desc, prefix="vllm"):
    """The daemon's model id: prefix, the readable model name, then the
    digest of the whole description (at most 128 bytes)."""
    name = desc["fields"]["model_name"].encode("ascii", "replace").decode().replace("/", "_")
    d = digest(desc)[:32]
    room = MAX_MODEL_ID - len(prefix) - 2 - len(d)
    return f"{prefix}:{name[:room]}:{d}"


def block_shape(nbytes, what):
    """(kv_heads, head_size) of a one-byte-element block of exactly nbytes:
    the head the largest power of two up to 4096 dividing it."""
    if nbytes < 512:
        raise ValueError(f"kvhost.vllm: a {what} of {nbytes} bytes is below the daemon's 512-byte block minimum")
    head = 1
    while head < 4096 and nbytes % (head * 2) == 0:
        head *= 2
    heads = nbytes // head
    if heads > MAX_DIM:
        raise ValueError(f"kvhost.vllm: a {what} of {nbytes} bytes cannot be declared "
                         f"(it must be a multiple of {head << 1} up to {MAX_DIM * 4096} bytes)")
    return heads, head


def geometry(desc, model=None):
    """The daemon geometry of one row: one layer, one plane, one block per
    key of exactly row_bytes bytes; model overrides the model id (a
    vllm-fs mount's "vllm-fs:<base>")."""
    heads, head = block_shape(desc["row_bytes"], "row")
    return Geometry(model=model or model_id(desc), layers=1, kv_heads=heads, head_size=head, dtype_size=1,
                    tokens_per_block=1, tokens_per_key=1, mla=True)
