"""Python client checks, run by client/e2e_test.go:

    python3 client_test.py SOCKET PREFIX roundtrip|checks|shared

(shared runs from internal/server/python_test.go, against a daemon that accepts
shared files.)
"""

import mmap
import os
import random
import sys
import tempfile
import threading

import kvhost

GEOMETRY = kvhost.Geometry(model="test-model", layers=2, kv_heads=1, head_size=64, dtype_size=2,
                           tokens_per_block=4, tokens_per_key=8)
BLOCKS = 64


CACHE_BYTES = GEOMETRY.layers * 2 * BLOCKS * GEOMETRY.block_bytes


class ShmFile:
    """A file under /dev/shm mapped here, as vLLM's shared CPU region is."""

    def __init__(self, size):
        fd, self.path = tempfile.mkstemp(prefix="kvhost-pytest-", suffix=".mmap", dir="/dev/shm")
        self.file = os.fdopen(fd, "r+b")
        self.file.truncate(size)
        self.mmap = mmap.mmap(self.file.fileno(), size)
        self.view = memoryview(self.mmap)
        self.size = size

    def close(self):
        self.view.release()
        self.mmap.close()
        self.file.close()
        os.unlink(self.path)


class Cache:
    def __init__(self, client, shared=None):
        self.c = client
        self.bb = GEOMETRY.block_bytes
        if shared is None:
            self.buf = kvhost.HostBuffer(CACHE_BYTES)
            self.region = client.register_buffer(self.buf)
        else:
            self.buf = shared
            self.region = client.register_shared_file(shared.file.fileno(), shared.size)
        self.ns = client.declare(GEOMETRY)
        assert self.ns.blocks_per_key == 2, self.ns
        layers = [kvhost.Layer(self.region, offset=l * 2 * BLOCKS * self.bb, block_stride=self.bb,
                               plane_stride=BLOCKS * self.bb, num_blocks=BLOCKS)
                  for l in range(GEOMETRY.layers)]
        self.cache = client.register_cache(self.ns, layers)

    def segments(self, blocks):
        for l in range(GEOMETRY.layers):
            for p in range(2):
                for b in blocks:
                    off = l * 2 * BLOCKS * self.bb + p * BLOCKS * self.bb + b * self.bb
                    yield off

    def fill(self, rng, blocks):
        out = bytearray()
        for off in self.segments(blocks):
            data = bytes(rng.getrandbits(8) for _ in range(self.bb))
            self.buf.view[off:off + self.bb] = data
            out += data
        return bytes(out)

    def read(self, blocks):
        return b"".join(bytes(self.buf.view[o:o + self.bb]) for o in self.segments(blocks))

    def zero(self, blocks):
        for off in self.segments(blocks):
            self.buf.view[off:off + self.bb] = bytes(self.bb)


def roundtrip(client, prefix, n=6, rounds=3, shared=None):
    cache = Cache(client, shared)
    rng = random.Random(prefix)
    bpk = cache.ns.blocks_per_key
    for r in range(rounds):
        keys = [f"{prefix}-{i}".encode() if r == 0 else f"{prefix}-r{r}-{i}".encode() for i in range(n)]
        src = [[i * bpk + j for j in range(bpk)] for i in range(n)]
        dst = [[BLOCKS // 2 + i * bpk + j for j in range(bpk)] for i in range(n)]
        want = [cache.fill(rng, s) for s in src]
        res = client.store(cache.cache, keys, src).wait(30)
        assert res.count(kvhost.OUTCOME_STORED) + res.count(kvhost.OUTCOME_PRESENT) == n, res
        assert client.lookup(cache.ns, keys) == n
        for d in dst:
            cache.zero(d)
        res = client.load(cache.cache, keys, dst).wait(30)
        assert res.count(kvhost.OUTCOME_LOADED) == n, res
        for i, d in enumerate(dst):
            assert cache.read(d) == want[i], f"key {keys[i]}: bytes differ"
    return cache


def checks(client, prefix):
    cache = roundtrip(client, prefix, n=4, rounds=1)
    # Errors carry the daemon's code.
    try:
        client.lookup(999, [b"k"])
        raise AssertionError("lookup in an undeclared namespace succeeded")
    except kvhost.KvhostError as e:
        assert kvhost.CODES[e.code] == "unknown namespace", e
    try:
        client.register_cuda(0, b"\x01" * 64, 0, 1 << 20)
        raise AssertionError("CUDA IPC registration succeeded")
    except kvhost.UnsupportedError:
        pass
    try:
        client.store(cache.cache, [b"k"], [[BLOCKS, 0]])
        raise AssertionError("store from a block outside the cache succeeded")
    except kvhost.KvhostError as e:
        assert kvhost.CODES[e.code] == "invalid argument", e
    # Misses, delete, stats.
    assert client.lookup(cache.ns, [b"never-stored"]) == 0
    res = client.load(cache.cache, [b"never-stored"], [[0, 1]]).wait(30)
    assert res.keys[0][0] == kvhost.OUTCOME_MISSING, res
    assert client.delete(cache.ns, [f"{prefix}-0".encode()]) == 1
    assert client.lookup(cache.ns, [f"{prefix}-0".encode()]) == 0
    st = client.stats()
    assert st["regions"] == 1 and st["caches"] == 1 and len(st["mounts"]) == 1, st
    # Many threads share one client.
    errors = []

    def worker(i):
        try:
            for _ in range(20):
                client.lookup(cache.ns, [f"{prefix}-{j}".encode() for j in range(1, 4)])
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    # Undeclare: refused while a cache uses the namespace; a namespace of
    # its own goes, and its id is unknown afterwards.
    try:
        client.undeclare(cache.ns)
        raise AssertionError("undeclared a namespace with a registered cache")
    except kvhost.KvhostError as e:
        assert kvhost.CODES[e.code] == "in use", e
    other = kvhost.Geometry(model=prefix + "-other", layers=1, kv_heads=1, head_size=64, dtype_size=2,
                            tokens_per_block=4, tokens_per_key=8)
    ns = client.declare(other)
    client.undeclare(ns)
    try:
        client.lookup(ns, [b"k"])
        raise AssertionError("lookup in an undeclared namespace succeeded")
    except kvhost.KvhostError as e:
        assert kvhost.CODES[e.code] == "unknown namespace", e
    # Cancel answers for a finished job.
    job = client.store(cache.cache, [b"cancel-me"], [[10, 11]])
    job.wait(30)
    assert client.cancel(job) is False
    # torch host tensors, when torch is importable.
    try:
        import torch  # noqa: F401
    except ImportError:
        print("torch not installed: host tensor helper not exercised")
    else:
        t, buf = kvhost.torch_host_tensor((4, 8), torch.float16)
        t.fill_(1.5)
        assert bytes(buf.view[:2]) == torch.tensor([1.5], dtype=torch.float16).numpy().tobytes()
        client.register_buffer(buf)
    # Raw buffers: a plain memfd registered by fd.
    fd = os.memfd_create("raw", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 4096)
    assert client.register_memfd(fd, 4096) > 0
    os.close(fd)
    # A memfd that cannot be sealed is refused before it is sent.
    fd = os.memfd_create("unsealable", os.MFD_CLOEXEC)
    os.ftruncate(fd, 4096)
    try:
        client.register_memfd(fd, 4096)
        raise AssertionError("unsealable memfd registered")
    except ValueError:
        pass
    os.close(fd)
    print("python checks passed")


def shared(client, prefix):
    """Zero-copy registration of a /dev/shm file (no seal): a round trip,
    then the file truncated under the daemon: the next store fails with a
    clear error and the connection keeps working."""
    f = ShmFile(CACHE_BYTES)
    try:
        cache = roundtrip(client, prefix, n=4, rounds=2, shared=f)
        f.view.release()
        f.mmap.close()
        f.file.truncate(0)
        try:
            client.store(cache.cache, [b"after-truncate"], [[0, 1]])
            raise AssertionError("store from a truncated shared file was accepted")
        except kvhost.KvhostError as e:
            assert kvhost.CODES[e.code] == "bad descriptor" and "truncated" in e.message, e
        assert client.stats()["regions"] == 1
    finally:
        f.file.close()
        os.unlink(f.path)
    print("python shared-file checks passed")


def main():
    socket_path, prefix, mode = sys.argv[1:4]
    with kvhost.Client(socket_path, name=prefix) as client:
        if mode == "roundtrip":
            roundtrip(client, prefix)
        elif mode == "shared":
            shared(client, prefix)
        else:
            checks(client, prefix)


if __name__ == "__main__":
    main()
