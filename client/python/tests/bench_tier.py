"""Benchmark of the KvhostTier path (not a unit test; run by hand):

    cd client/python && PYTHONPATH=src /usr/bin/python3 tests/bench_tier.py [--threads N]

Rows of a 1 GiB primary region are stored (cascade) and promoted through a
real daemon whose cache root is on tmpfs (/dev/shm), with the copy data path
(memfd staging) and with the zero-copy path (a memfd-backed primary region,
which today's daemon accepts). In the same run, the ceiling: a plain copy of
the same rows to one file each on the same tmpfs with the same number of
threads (write, then read back). Reported: GB/s of each and the ratio
tier/plain. Then the latency for 64 keys of (a) the tier's lookup from first
RETRY to all answered and (b) one daemon Lookup request, p50/p99.
Every promotion is checked row for row against the original.
"""

import argparse
import concurrent.futures
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

import numpy as np  # noqa: E402

import kvhost  # noqa: E402
from kvhost import vllm as kv  # noqa: E402

import daemon as d  # noqa: E402
import vllm_standins as S  # noqa: E402

Tier = kv.tier_class(S.API)
CTX = S.ReqContext(req_id="bench")


def gbps(nbytes, seconds):
    return nbytes / seconds / 1e9


def run_jobs(tier, jobs, load):
    t0 = time.perf_counter()
    for j in jobs:
        (tier.submit_load if load else tier.submit_store)(j)
    tier.drain_jobs()
    dt = time.perf_counter() - t0
    res = tier.get_finished_jobs()
    bad = [r for r in res if not r.success]
    if len(res) != len(jobs) or bad:
        raise SystemExit(f"{len(bad)} of {len(res)} jobs failed: {bad[:2]}")
    return dt


def tier_round(daemon, region, original, keys, rows_per_job, threads, zero_copy, tag):
    spec = S.fake_spec(model=f"bench/{tag}")
    tier = Tier(offloading_spec=spec, primary_kv_view=memoryview(region), tier_type="KvhostTier",
                socket=daemon.socket, threads=threads, zero_copy=zero_copy)
    try:
        n = len(keys)
        jid = iter(range(1, 1 << 30))
        store = [S.TransferJob(next(jid), keys[i:i + rows_per_job], np.arange(i, min(n, i + rows_per_job)),
                               False, CTX) for i in range(0, n, rows_per_job)]
        ts = run_jobs(tier, store, load=False)
        region[:] = 0
        load = [S.TransferJob(next(jid), keys[i:i + rows_per_job], np.arange(i, min(n, i + rows_per_job)),
                              True, CTX) for i in range(0, n, rows_per_job)]
        tl = run_jobs(tier, load, load=True)
        if not np.array_equal(region, original):
            raise SystemExit(f"{tag}: promoted rows differ from the stored ones")
        return ts, tl, tier.data_path
    finally:
        tier.shutdown()


def plain_round(dirpath, region, original, threads):
    rows, row = region.shape
    os.makedirs(dirpath, exist_ok=True)
    names = [os.path.join(dirpath, f"{i:06d}.bin") for i in range(rows)]

    def write(i):
        fd = os.open(names[i], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            mv = memoryview(region[i])
            off = 0
            while off < row:
                off += os.pwrite(fd, mv[off:], off)
        finally:
            os.close(fd)

    def read(i):
        fd = os.open(names[i], os.O_RDONLY)
        try:
            mv = memoryview(region[i])
            off = 0
            while off < row:
                k = os.preadv(fd, [mv[off:]], off)
                if k == 0:
                    raise EOFError(names[i])
                off += k
        finally:
            os.close(fd)

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        t0 = time.perf_counter()
        list(pool.map(write, range(rows)))
        ts = time.perf_counter() - t0
        region[:] = 0
        t0 = time.perf_counter()
        list(pool.map(read, range(rows)))
        tl = time.perf_counter() - t0
    if not np.array_equal(region, original):
        raise SystemExit("plain copy: rows differ")
    shutil.rmtree(dirpath)
    return ts, tl


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def lookup_latency(daemon, keys, row, reps, model):
    tier_us, raw_us = [], []
    spec = S.fake_spec(model=model)
    region = np.zeros((len(keys), row), dtype=np.uint8)
    c = kvhost.Client(daemon.socket)
    try:
        for _ in range(reps):
            tier = Tier(offloading_spec=spec, primary_kv_view=memoryview(region), tier_type="KvhostTier",
                        socket=daemon.socket, threads=1, staging_bytes=row)
            try:
                t0 = time.perf_counter()
                pending = list(keys)
                while True:  # the scheduler asks again, a step later, for what was RETRY
                    pending = [k for k in pending if tier.lookup(k, CTX) is S.LookupResult.RETRY]
                    if not pending:
                        break
                    time.sleep(50e-6)
                tier_us.append((time.perf_counter() - t0) * 1e6)
                if tier.counters().get("lookup_misses"):
                    raise SystemExit("lookup missed a stored key")
                ns = tier.namespace
            finally:
                tier.shutdown()
        cns = c.declare(ns.geometry)
        dk = list(keys)
        for _ in range(reps * 10):
            t0 = time.perf_counter()
            n = c.lookup(cns, dk)
            raw_us.append((time.perf_counter() - t0) * 1e6)
            if n != len(keys):
                raise SystemExit(f"daemon lookup found {n} of {len(keys)}")
    finally:
        c.close()
    return tier_us, raw_us


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2, help="tier threads = plain-copy threads")
    ap.add_argument("--row", type=int, default=2 << 20, help="bytes per row (Llama-3.1-8B chunk: 2 MiB)")
    ap.add_argument("--region", type=int, default=1 << 30, help="primary region bytes")
    ap.add_argument("--rows-per-job", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3, help="rounds of each measurement; best is reported")
    args = ap.parse_args()

    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    work = tempfile.mkdtemp(prefix="kvhost-bench-", dir=shm)
    rows = args.region // args.row
    original = np.random.default_rng(1).integers(0, 256, size=(rows, args.row), dtype=np.uint8)
    keys = [S.offload_key(("bench", i)) for i in range(rows)]
    print(f"# {rows} rows x {args.row >> 10} KiB = {rows * args.row / 2**30:.2f} GiB, "
          f"{args.threads} threads, {os.cpu_count()} CPUs, daemon and files on {shm or tempfile.gettempdir()}")
    daemon = d.Daemon(capacity="8GiB", dir=os.path.join(work, "blocks"))
    try:
        results = {}
        buf = kvhost.HostBuffer(rows * args.row)
        memfd_region = np.frombuffer(buf.mmap, dtype=np.uint8).reshape(rows, args.row)
        plain_region = np.empty_like(original)
        for rep in range(args.reps):
            plain_region[:] = original
            ps, pl = plain_round(os.path.join(work, "plain"), plain_region, original, args.threads)
            results.setdefault("plain", []).append((ps, pl))
            for mode, region in (("copy", plain_region), ("zero-copy", memfd_region)):
                region[:] = original
                # A fresh namespace per round, so every store writes.
                ts, tl, path = tier_round(daemon, region, original, keys, args.rows_per_job, args.threads,
                                          "on" if mode == "zero-copy" else "off", f"{mode}-{rep}")
                assert path == mode, path
                results.setdefault(mode, []).append((ts, tl))
                if rep < args.reps - 1:
                    for f in daemon.data_files():
                        os.unlink(f)
        nbytes = rows * args.row
        best = {m: (min(s for s, _ in v), min(l for _, l in v)) for m, v in results.items()}
        ps, pl = best["plain"]
        print(f"{'path':14s} {'store GB/s':>11s} {'load GB/s':>10s} {'store ratio':>12s} {'load ratio':>11s}")
        print(f"{'plain':14s} {gbps(nbytes, ps):11.2f} {gbps(nbytes, pl):10.2f} {1:12.2f} {1:11.2f}")
        for m in ("copy", "zero-copy"):
            s, lo = best[m]
            print(f"{'tier ' + m:14s} {gbps(nbytes, s):11.2f} {gbps(nbytes, lo):10.2f} "
                  f"{ps / s:12.2f} {pl / lo:11.2f}")
        del memfd_region, region
        tier_us, raw_us = lookup_latency(daemon, keys[:64], args.row, 50, f"bench/copy-{args.reps - 1}")
        print(f"lookup of 64 keys, tier (RETRY until answered): p50 {pct(tier_us, 50):.0f} us, "
              f"p99 {pct(tier_us, 99):.0f} us ({len(tier_us)} runs)")
        print(f"lookup of 64 keys, one daemon request:          p50 {pct(raw_us, 50):.0f} us, "
              f"p99 {pct(raw_us, 99):.0f} us ({len(raw_us)} runs)")
    finally:
        daemon.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
