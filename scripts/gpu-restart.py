"""Loads after a daemon restart, on a GPU: the first phase stores keys from a
vLLM-shaped paged cache in GPU memory (registered over CUDA IPC); the
second, run by a new process against a new daemon on the same directory
(or, on a shared mount, against another daemon beside the first), looks
every key up (untimed) and then loads it into poisoned blocks, times it, and compares with the
source on the GPU, byte for byte. The cache's contents come from a fixed
seed, so both processes hold the same source bytes.

usage: python3 scripts/gpu-restart.py store|load SOCKET [TOKENS_PER_KEY] [KEYS] [JOBS]
Prints one line; exits non-zero on any mismatch or failed key.
"""
import sys

import torch

sys.path.insert(0, "client/python/src")
import kvhost  # noqa: E402
from gpu_paged import TOKENS_PER_BLOCK as tpb, keys_differ, random_cache, register, run_jobs, split  # noqa: E402


def main():
    phase, sock = sys.argv[1], sys.argv[2]
    tpk = int(sys.argv[3]) if len(sys.argv) > 3 else 256
    nkeys = int(sys.argv[4]) if len(sys.argv) > 4 else 256
    jobs = int(sys.argv[5]) if len(sys.argv) > 5 else 16
    bpk = tpk // tpb
    num_blocks = 2 * nkeys * bpk
    kv = random_cache(num_blocks, 11)
    src = [list(range(i * bpk, (i + 1) * bpk)) for i in range(nkeys)]
    dst = [[num_blocks // 2 + b for b in blocks] for blocks in src]
    keys = [f"gpu-restart-{tpk}-{i}".encode() for i in range(nkeys)]
    with kvhost.Client(sock, name=f"gpu-restart-{phase}") as c:
        ns, cache = register(c, kv, tpk)
        if phase == "store":
            secs, res = run_jobs(c, "store", [(cache, k, b) for k, b in zip(split(keys, jobs), split(src, jobs))])
            stored = sum(r.count(1) + r.count(2) for r in res)
            assert stored == nkeys, [r.outcomes() for r in res]
            print(f"store: {nkeys} keys of {ns.key_bytes >> 20} MiB in {jobs} jobs: "
                  f"{nkeys * ns.key_bytes / secs / 1e9:.2f} GB/s")
            return 0
        # A scheduler looks its keys up before it loads them: on a daemon
        # that did not store them (after a restart, or another process's
        # files on a shared mount) the lookup is what finds them.
        found = sum(c.lookup(ns, k) for k in split(keys, max(1, nkeys // 32)))
        if found != nkeys:
            print(f"lookup found {found} of {nkeys} keys")
            return 1
        kv[:, num_blocks // 2:].fill_(-91)  # poisoned destinations
        torch.cuda.synchronize()
        secs, res = run_jobs(c, "load", [(cache, k, b) for k, b in zip(split(keys, jobs), split(dst, jobs))])
        loaded = sum(r.count(4) for r in res)
        torch.cuda.synchronize()
        bad = keys_differ(kv, kv, src, dst)
        print(f"load after restart: {loaded}/{nkeys} keys of {ns.key_bytes >> 20} MiB in {jobs} jobs: "
              f"{nkeys * ns.key_bytes / secs / 1e9:.2f} GB/s; {bad} keys differ")
        return 0 if loaded == nkeys and bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
