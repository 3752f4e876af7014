"""What a client declares and registers: a namespace's geometry
(Geometry, its fingerprint), the Namespace the daemon answers, a cache's
Layer, and the fingerprint of a vllm-fs mount's namespace.
"""

import dataclasses
import struct


@dataclasses.dataclass(frozen=True)
class Geometry:
    """A model's KV-cache shape at one tensor-parallel rank."""
    model: str
    layers: int
    kv_heads: int
    head_size: int
    dtype_size: int
    tokens_per_block: int
    tokens_per_key: int
    mla: bool = False
    tp_rank: int = 0
    tp_size: int = 1

    @property
    def block_bytes(self):
        return self.tokens_per_block * self.kv_heads * self.head_size * self.dtype_size

    @property
    def planes(self):
        return 1 if self.mla else 2

    def fingerprint(self):
        """The geometry's fingerprint (docs/format.md): what the daemon's
        Declared reply carries for a namespace its kvhost mounts serve."""
        model = self.model.encode()
        return _fnv1a64(_FINGERPRINT_TAG + struct.pack("<I", len(model)) + model + struct.pack(
            "<9I", self.layers, self.kv_heads, self.head_size, self.dtype_size, int(self.mla),
            self.tokens_per_block, self.tokens_per_key, self.tp_rank, self.tp_size))


_FINGERPRINT_TAG = b"kvhost/geometry/v1\x00"
_VLLM_FS_FINGERPRINT_TAG = b"kvhost/vllm-fs/v1\x00"


def _fnv1a64(data):
    h = 0xcbf29ce484222325
    for b in data:
        h = ((h ^ b) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    return h


def vllm_fs_fingerprint(data_dir, model):
    """The fingerprint the daemon's Declared reply carries for namespace
    model when a vllm-fs mount serves it from data directory data_dir
    (its name under the mount, "<base>_r<rank>"; docs/protocol.md,
    Declared)."""
    d = data_dir.encode()
    return _fnv1a64(_VLLM_FS_FINGERPRINT_TAG + struct.pack("<I", len(d)) + d + model.encode())


@dataclasses.dataclass(frozen=True)
class Namespace:
    """A declared geometry: this connection's id and what the daemon derived."""
    id: int
    blocks_per_key: int
    fingerprint: int
    key_bytes: int
    geometry: Geometry

    @property
    def block_bytes(self):
        return self.geometry.block_bytes


@dataclasses.dataclass(frozen=True)
class Layer:
    """One layer's tensor in a registered region: block b of plane p is at
    offset + p*plane_stride + b*block_stride."""
    region: int
    offset: int
    block_stride: int
    plane_stride: int
    num_blocks: int
