"""A full cache on a GPU: rounds of stores and loads through a running kvhost
daemon whose mount holds about two rounds, so that from the third round on
every store evicts and writes into an evicted file (a spare). Each round
stores KEYS new keys of random blocks from a vLLM-shaped paged cache in GPU
memory (registered over CUDA IPC), poisons other blocks, loads the keys
into them and compares on the GPU, byte for byte.

usage: python3 scripts/gpu-churn.py SOCKET [ROUNDS] [KEYS] [JOBS] [TOKENS_PER_KEY] [IDLE]
Prints one line per round; exits non-zero on any mismatch or failed key.
IDLE (seconds, default 0) is an idle moment before each round's stores,
as an inference server has between prefills: what a daemon does in the
background (spare files made ahead, registrations) happens there.
Start the daemon with a capacity of about 2 × KEYS keys on a memory file
system, e.g. for 64 keys of 32 MiB:

    [[mount]]
    path = "/dev/shm/kvhost-churn"
    capacity = "5GiB"
"""
import sys
import time

import torch

sys.path.insert(0, "client/python/src")
import kvhost  # noqa: E402
from gpu_paged import LAYERS as layers, PAGE as page, TOKENS_PER_BLOCK as tpb, keys_differ, register, run_jobs, split  # noqa: E402


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    sock = sys.argv[1]
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 6
    nkeys = int(sys.argv[3]) if len(sys.argv) > 3 else 64
    jobs = int(sys.argv[4]) if len(sys.argv) > 4 else 8
    tpk = int(sys.argv[5]) if len(sys.argv) > 5 else 256
    idle = float(sys.argv[6]) if len(sys.argv) > 6 else 0.0
    if rounds < 1 or nkeys < 1 or jobs < 1 or tpk % tpb or idle < 0:
        sys.exit(f"bad arguments: rounds {rounds}, keys {nkeys}, jobs {jobs}, tokens per key {tpk} (a multiple of {tpb}), idle {idle}")
    bpk = tpk // tpb
    num_blocks = 2 * nkeys * bpk
    dev = torch.device("cuda", 0)
    kv = torch.empty((layers, num_blocks, page), dtype=torch.int8, device=dev)
    with kvhost.Client(sock, name="gpu-churn") as c:
        ns, cache = register(c, kv, tpk)
        key_bytes = ns.key_bytes
        for rnd in range(rounds):
            g = torch.Generator(device=dev).manual_seed(100 + rnd)
            kv.copy_(torch.randint(-128, 127, kv.shape, generator=g, device=dev, dtype=torch.int8))
            torch.cuda.synchronize()
            perm = torch.randperm(num_blocks // 2, generator=torch.Generator().manual_seed(rnd)).tolist()
            src = [perm[i * bpk:(i + 1) * bpk] for i in range(nkeys)]
            dst = [[num_blocks // 2 + b for b in blocks] for blocks in src]
            keys = [f"gpu-churn-{tpk}-{rnd}-{i}".encode() for i in range(nkeys)]
            time.sleep(idle)
            ssecs, res = run_jobs(c, "store", [(cache, k, b) for k, b in zip(split(keys, jobs), split(src, jobs))])
            stored = sum(r.count(1) + r.count(2) for r in res)
            if stored != nkeys:
                sys.exit(f"round {rnd}: {stored} of {nkeys} keys stored: {[r.outcomes() for r in res]}")
            kv[:, num_blocks // 2:].fill_(-91)  # 0xA5: poisoned destinations
            torch.cuda.synchronize()
            lsecs, res = run_jobs(c, "load", [(cache, k, b) for k, b in zip(split(keys, jobs), split(dst, jobs))])
            loaded = sum(r.count(4) for r in res)
            if loaded != nkeys:
                sys.exit(f"round {rnd}: {loaded} of {nkeys} keys loaded: {[r.outcomes() for r in res]}")
            torch.cuda.synchronize()
            bad = keys_differ(kv, kv, src, dst)
            total = nkeys * key_bytes
            print(f"round {rnd}: {nkeys} keys of {key_bytes >> 20} MiB in {jobs} jobs: store {total / ssecs / 1e9:.2f} GB/s, "
                  f"load {total / lsecs / 1e9:.2f} GB/s; {bad} keys differ", flush=True)
            if bad:
                sys.exit(1)
    print("gpu churn OK")


if __name__ == "__main__":
    main()
