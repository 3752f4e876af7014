"""A torch process that registers CUDA memory with a kvhost daemon, for
server/torch_gpu_test.go (KVHOST_GPU=1, on a GPU machine):

    python3 torch_ipc.py SOCKET checks|exit

checks: registers a CUDA tensor's storage filled with a known pattern,
prints "READY <region> <bytes> <pattern bytes>", waits for a line on stdin (the Go side
reads the imported memory meanwhile), then checks that bad registrations
get clear errors and the connection keeps working.
exit: registers, prints READY, waits for stdin, and exits without
unregistering or closing the connection.
"""

import ctypes
import os
import sys

import torch

import kvhost


def pattern(n):
    return ((torch.arange(n, device="cuda", dtype=torch.int64) * 7 + 3) % 251).to(torch.uint8)


def expect(code, fn):
    try:
        fn()
    except kvhost.KvhostError as e:
        assert kvhost.CODES[e.code] == code, f"got {e}, want {code}"
        print(f"refused as {code}: {e.message}")
        return
    raise AssertionError(f"accepted; want {code}")


def stale_handle():
    """The IPC handle of memory already freed (cudaMalloc, export, cudaFree)."""
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            rt = ctypes.CDLL(name)
            break
        except OSError:
            continue
    else:
        return None
    p = ctypes.c_void_p()
    assert rt.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(4 << 20)) == 0
    h = (ctypes.c_char * 64)()
    assert rt.cudaIpcGetMemHandle(h, p) == 0
    assert rt.cudaFree(p) == 0
    return bytes(h)


def main():
    sock, mode = sys.argv[1:3]
    n = 48 << 20
    base = torch.empty(n + (1 << 20), dtype=torch.uint8, device="cuda")
    t = base[:n]
    t.copy_(pattern(n))
    torch.cuda.synchronize()
    c = kvhost.Client(sock, name="torch-" + mode)
    rid = c.register_cuda_tensor(t)
    dev, handle, off, size = kvhost.cuda_ipc_handle(t)
    st = c.stats()
    d0 = st["devices"][0]
    assert d0["regions"] == 1 and d0["registered"] == size, st["devices"]
    # The storage is larger than t (base has 1 MiB more): the pattern
    # covers its first n bytes.
    print(f"READY {rid} {size} {n} offset={off}", flush=True)
    sys.stdin.readline()
    if mode == "exit":
        os._exit(0)
    # Flipping a byte of a real handle is not a forgery: on an H100 (driver
    # 580) a handle with its first byte flipped still imported the same
    # allocation. A handle of random bytes names nothing.
    forged = os.urandom(64)
    expect("bad IPC handle", lambda: c.register_cuda(0, forged, 0, 4096))
    expect("invalid argument", lambda: c.register_cuda(0, handle, off + (1 << 40), 4096))
    expect("invalid argument", lambda: c.register_cuda(len(st["devices"]), handle, off, size))
    stale = stale_handle()
    if stale is None:
        print("no libcudart for ctypes: stale handle not checked")
    else:
        expect("bad IPC handle", lambda: c.register_cuda(0, stale, 0, 4096))
    # The same memory twice (a second view of the storage) is accepted.
    rid2 = c.register_cuda(0, handle, off, 4096)
    c.unregister_memory(rid2)
    c.unregister_memory(rid)
    d0 = c.stats()["devices"][0]
    assert d0["regions"] == 0 and d0["registered"] == 0, d0
    c.close()
    print("torch checks passed")


if __name__ == "__main__":
    main()
