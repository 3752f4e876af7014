"""How much kvhost's GPU transfers slow the inference process's own kernels.

A torch process plays an inference server: it registers a vLLM-shaped
paged KV cache (Llama-3.1-8B bf16, 32 MiB keys) with a running kvhost
daemon over CUDA IPC and stores KEYS keys once. Then it times bf16 matrix
multiplications (8192 x 8192, its own stream) for SECONDS alone, and again
for SECONDS while JOBS threads keep loading those keys through the daemon,
and prints the matmul throughput of both phases and the loads' GB/s. Run
it once against a daemon with gpu.copy = "kernel" and once with "batch" to
see what the copy kernel, which runs on the SMs in the daemon's own CUDA
context, costs the inference kernels next to DMA copies, which run on the
copy engines.

usage: python3 scripts/gpu-interference.py SOCKET [SECONDS] [KEYS] [JOBS]
"""
import sys
import threading
import time

import torch

sys.path.insert(0, "client/python/src")
import kvhost  # noqa: E402
from gpu_paged import LAYERS as layers, PAGE as page, TOKENS_PER_BLOCK as tpb, register  # noqa: E402

sock = sys.argv[1]
seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 10
nkeys = int(sys.argv[3]) if len(sys.argv) > 3 else 64
jobs = int(sys.argv[4]) if len(sys.argv) > 4 else 8
tpk = 256
bpk = tpk // tpb
num_blocks = nkeys * bpk

dev = torch.device("cuda", 0)
kv = torch.randint(-128, 127, (layers, num_blocks, page), dtype=torch.int8, device=dev)
n = 8192
a = torch.randn(n, n, dtype=torch.bfloat16, device=dev)
b = torch.randn(n, n, dtype=torch.bfloat16, device=dev)
out = torch.empty(n, n, dtype=torch.bfloat16, device=dev)
torch.cuda.synchronize()


def matmuls(secs):
    """Runs matmuls for secs; returns TFLOP/s."""
    done, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < secs:
        for _ in range(20):
            torch.matmul(a, b, out=out)
        torch.cuda.synchronize()
        done += 20
    return done * 2 * n ** 3 / (time.perf_counter() - t0) / 1e12


with kvhost.Client(sock, name="gpu-interference") as c:
    ns, cache = register(c, kv, tpk)
    keys = [f"interference-{i}".encode() for i in range(nkeys)]
    blocks = [list(range(i * bpk, (i + 1) * bpk)) for i in range(nkeys)]
    res = c.store(cache, keys, blocks).wait(300)
    assert res.count(1) + res.count(2) == nkeys, res.outcomes()

    alone = matmuls(seconds)

    stop = threading.Event()
    moved = [0] * jobs
    failed = []

    def loader(j):
        ks, bs = keys[j::jobs], blocks[j::jobs]
        while not stop.is_set():
            r = c.load(cache, ks, bs).wait(300)
            if r.count(4) != len(ks):
                failed.append(r.outcomes())
                return
            moved[j] += len(ks) * ns.key_bytes

    ts = [threading.Thread(target=loader, args=(j,)) for j in range(jobs)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    busy = matmuls(seconds)
    stop.set()
    for t in ts:
        t.join()
    secs = time.perf_counter() - t0
    if failed:
        sys.exit(f"loads failed: {failed[0]}")
    print(f"matmul alone: {alone:.0f} TFLOP/s; beside kvhost loads: {busy:.0f} TFLOP/s ({busy / alone:.2f}); "
          f"loads meanwhile: {sum(moved) / secs / 1e9:.2f} GB/s")
