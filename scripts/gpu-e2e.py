"""End-to-end check of the GPU path through a running kvhost daemon: a torch
process registers a vLLM-shaped paged KV cache in GPU memory over CUDA IPC
(one allocation, one int8 (num_blocks, page_bytes) view per layer, as vLLM's
canonical caches are), stores keys of random blocks, poisons other blocks,
loads the keys into them and compares on the GPU, byte for byte. Then it
times store and load jobs with several jobs in flight.

usage: python3 scripts/gpu-e2e.py SOCKET [TOKENS_PER_KEY] [KEYS] [JOBS]
Prints one line per phase; exits non-zero on any mismatch or failed key.
"""
import sys

import torch

sys.path.insert(0, "client/python/src")
import kvhost  # noqa: E402
from gpu_paged import TOKENS_PER_BLOCK as tpb, keys_differ, random_cache, register, run_jobs, split  # noqa: E402

sock = sys.argv[1]
tpk = int(sys.argv[2]) if len(sys.argv) > 2 else 256
nkeys = int(sys.argv[3]) if len(sys.argv) > 3 else 64
jobs = int(sys.argv[4]) if len(sys.argv) > 4 else 8
bpk = tpk // tpb
num_blocks = 2 * nkeys * bpk

# One allocation for every layer, per-layer views, as vLLM allocates.
kv = random_cache(num_blocks, 7)

with kvhost.Client(sock, name="gpu-e2e") as c:
    ns, cache = register(c, kv, tpk)

    perm = torch.randperm(num_blocks // 2, generator=torch.Generator().manual_seed(3)).tolist()
    src = [perm[i * bpk:(i + 1) * bpk] for i in range(nkeys)]
    dst = [[num_blocks // 2 + b for b in blocks] for blocks in src]
    keys = [f"gpu-e2e-{tpk}-{i}".encode() for i in range(nkeys)]
    key_bytes = ns.key_bytes

    def run(op, key_sets, block_sets):
        """Runs len(key_sets) jobs at once; returns seconds and results."""
        return run_jobs(c, op, [(cache, k, b) for k, b in zip(key_sets, block_sets)])

    # Correctness: store, poison the destinations, load, compare.
    secs, res = run("store", split(keys, jobs), split(src, jobs))
    stored = sum(r.count(1) + r.count(2) for r in res)
    assert stored == nkeys, [r.outcomes() for r in res]
    print(f"store: {nkeys} keys of {key_bytes >> 20} MiB in {jobs} jobs: {nkeys * key_bytes / secs / 1e9:.2f} GB/s")
    kv[:, num_blocks // 2:].fill_(-91)  # 0xA5: poisoned destinations
    torch.cuda.synchronize()
    secs, res = run("load", split(keys, jobs), split(dst, jobs))
    loaded = sum(r.count(4) for r in res)
    assert loaded == nkeys, [r.outcomes() for r in res]
    torch.cuda.synchronize()
    bad = keys_differ(kv, kv, src, dst)
    print(f"load: {nkeys} keys in {jobs} jobs: {nkeys * key_bytes / secs / 1e9:.2f} GB/s; "
          f"{bad} keys differ after the round trip (destinations poisoned before the load)")
    if bad:
        sys.exit(1)
    # A second, warm round for throughput (files in place, pages faulted in).
    secs, res = run("load", split(keys, jobs), split(dst, jobs))
    assert sum(r.count(4) for r in res) == nkeys
    print(f"load again: {nkeys * key_bytes / secs / 1e9:.2f} GB/s")
    print("gpu e2e OK")
