"""One daemon, every GPU: a torch process registers a vLLM-shaped paged KV
cache on each of two GPUs with one kvhost daemon (each registration names
its device), stores keys from both GPUs at once, poisons other blocks,
then loads each GPU's keys into the other GPU (through the files: the
daemon's jobs on the two devices run at once) and compares byte for byte.
It also checks that the daemon counts each device's registered memory on
that device, that it names each device by the UUID torch sees there, and
that a process seeing only the second GPU (CUDA_VISIBLE_DEVICES by UUID)
registers its tensor on the daemon's device 1, found by that UUID.

usage: python3 scripts/gpu-multi.py SOCKET [TOKENS_PER_KEY] [KEYS] [JOBS]
Needs two GPUs; exits non-zero on any mismatch, failed key or miscount.
"""
import os
import subprocess
import sys
import uuid as uuid_mod

import torch

sys.path.insert(0, "client/python/src")
import kvhost  # noqa: E402
from gpu_paged import LAYERS as layers, PAGE as page, TOKENS_PER_BLOCK as tpb, keys_differ, register, run_jobs, split  # noqa: E402

sock = sys.argv[1]
tpk = int(sys.argv[2]) if len(sys.argv) > 2 else 256
nkeys = int(sys.argv[3]) if len(sys.argv) > 3 else 32
jobs = int(sys.argv[4]) if len(sys.argv) > 4 else 8
ngpu = torch.cuda.device_count()
if ngpu < 2:
    sys.exit(f"gpu-multi: needs two GPUs, this machine has {ngpu}")
bpk = tpk // tpb
num_blocks = 2 * nkeys * bpk  # first half stored from, second half loaded into

kv = []
for d in range(2):
    dev = torch.device("cuda", d)
    t = torch.empty((layers, num_blocks, page), dtype=torch.int8, device=dev)
    g = torch.Generator(device=dev).manual_seed(100 + d)
    t.copy_(torch.randint(-128, 127, t.shape, generator=g, device=dev, dtype=torch.int8))
    kv.append(t)
for d in range(2):
    torch.cuda.synchronize(d)


with kvhost.Client(sock, name="gpu-multi") as c:
    caches = []
    for d in range(2):
        ns, cache = register(c, kv[d], tpk)
        caches.append(cache)
    key_bytes = ns.key_bytes
    devs = c.stats()["devices"]
    regions = {x["ordinal"]: x["regions"] for x in devs}
    print(f"daemon serves {len(devs)} GPUs; regions registered per device: {regions}")
    if regions.get(0, 0) != 1 or regions.get(1, 0) != 1:
        sys.exit(f"gpu-multi: want one region on each of devices 0 and 1, the daemon reports {devs}")

    perm = torch.randperm(num_blocks // 2, generator=torch.Generator().manual_seed(5)).tolist()
    src = [perm[i * bpk:(i + 1) * bpk] for i in range(nkeys)]
    dst = [[num_blocks // 2 + b for b in blocks] for blocks in src]
    keys = [[f"gpu-multi-{tpk}-{d}-{i}".encode() for i in range(nkeys)] for d in range(2)]

    def run(op, plan):
        """plan: (cache, keys, blocks) per job; all jobs at once."""
        return run_jobs(c, op, plan)

    # Store from both GPUs at once: GPU d's keys from GPU d's blocks.
    plan = []
    for d in range(2):
        plan += [(caches[d], ks, bs) for ks, bs in zip(split(keys[d], jobs), split(src, jobs))]
    secs, res = run("store", plan)
    stored = sum(r.count(1) + r.count(2) for r in res)
    if stored != 2 * nkeys:
        sys.exit(f"gpu-multi: {stored} of {2 * nkeys} keys stored: {[r.outcomes() for r in res]}")
    print(f"store from both GPUs: {2 * nkeys} keys of {key_bytes >> 20} MiB in {2 * jobs} jobs: "
          f"{2 * nkeys * key_bytes / secs / 1e9:.2f} GB/s")

    # Load each GPU's keys into the other GPU's poisoned blocks, at once.
    for d in range(2):
        kv[d][:, num_blocks // 2:].fill_(-91)
        torch.cuda.synchronize(d)
    plan = []
    for d in range(2):
        plan += [(caches[1 - d], ks, bs) for ks, bs in zip(split(keys[d], jobs), split(dst, jobs))]
    secs, res = run("load", plan)
    loaded = sum(r.count(4) for r in res)
    if loaded != 2 * nkeys:
        sys.exit(f"gpu-multi: {loaded} of {2 * nkeys} keys loaded: {[r.outcomes() for r in res]}")
    for d in range(2):
        torch.cuda.synchronize(d)
    bad = sum(keys_differ(kv[d].cpu(), kv[1 - d].cpu(), src, dst) for d in range(2))
    print(f"load into the other GPU: {2 * nkeys} keys in {2 * jobs} jobs: {2 * nkeys * key_bytes / secs / 1e9:.2f} GB/s; "
          f"{bad} keys differ (destinations poisoned before the load)")
    if bad:
        sys.exit(1)
    # Each device's UUID, as the daemon reports it, is the GPU torch sees
    # at that index (this process sees every GPU).
    for d in c.stats()["devices"]:
        want = kvhost.device_uuid(kv[d["ordinal"]])
        if d["uuid"] != want:
            sys.exit(f"gpu-multi: the daemon names device {d['ordinal']} {d['uuid']!r}, torch {want!r}")
    print("device UUIDs: " + ", ".join(f"{d['ordinal']}: {kvhost.memory.uuid_text(d['uuid'])}" for d in c.stats()["devices"]))
    # A process that sees only GPU 1 (as its cuda:0) registers a tensor
    # there: the client finds the daemon's ordinal 1 by the GPU's UUID.
    child = ("import sys, torch\nsys.path.insert(0, 'client/python/src')\nimport kvhost\n"
             "t = torch.empty(1 << 20, dtype=torch.uint8, device='cuda:0')\n"
             "with kvhost.Client(sys.argv[1], name='gpu-multi-visible') as c:\n"
             "    c.register_cuda_tensor(t)\n"
             "    print(repr(sorted((d['ordinal'], d['regions']) for d in c.stats()['devices'])))\n")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="GPU-" + str(uuid_mod.UUID(bytes=kvhost.device_uuid(kv[1]))))
    out = subprocess.run([sys.executable, "-c", child, sock], env=env, capture_output=True, text=True, timeout=120)
    seen = out.stdout.strip()
    if out.returncode != 0 or seen != repr([(0, 1), (1, 2)]):
        sys.exit(f"gpu-multi: a process seeing only GPU 1 registered: exit {out.returncode}, regions {seen!r} "
                 f"(want device 1 to gain one); {out.stderr[-1500:]}")
    print(f"a process with CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']} registered its cuda:0 as device 1 "
          f"(found by UUID): regions per device {seen}")
    print("gpu multi OK")
