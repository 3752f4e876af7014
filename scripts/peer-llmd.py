#!/usr/bin/env python3
"""The peer's side of docs/performance.md's comparison: llm-d's file-system
offloading engine (the `storage_offload` extension of llm-d-kv-cache's
`kv_connectors/llmd_fs_backend`) driven on the workload `kvhost bench
--tokens-per-key 256 --jobs 16` runs.

    peer-llmd.py DIR GIB THREADS ROUNDS [--cold] [--sync] [--device cuda:0]

The layout is Llama-3.1-8B's in bf16 with vLLM's 16-token blocks: 32 layers,
64 KiB per block and layer (K and V), 16 blocks (256 tokens, 32 MiB) per
file. Each round stores GIB GiB of files from the first half of the blocks
into a fresh directory under DIR (one job, as vLLM hands the engine a
step's transfers), then loads them into the second half and compares every
layer's bytes. The engine runs THREADS I/O threads. A job's time runs from
its submission to the engine reporting it finished, with the device
synchronized before and after; completion is polled with get_finished, as
vLLM's worker does (waiting on a job through the engine's own wait call
would cancel its queued tasks). --sync adds an os.sync() to each store's
time (durable stores); --cold drops the page cache (root) between the
store and the load. An untimed warm-up of 16 files (fewer if GIB holds fewer) comes first.

The module is found on PYTHONPATH: build it from llm-d's source on the GPU
machine (docs/performance.md, "How to run the comparison"). Each round
prints two lines a script can read,

    llmd store GB/s 24.31 files 256 round 1 ok True
    llmd load GB/s 25.02 files 256 round 1 ok True layers_differ 0

("store+sync" and "cold load" with --sync and --cold), and one line of
detail. ok is False where the engine reported a failure, a file is
missing, or a loaded layer differs from the stored one. A job the engine
has not reported finished after --job-timeout seconds (120) ends the run
with an error and exit status 1.
"""
import argparse
import os
import shutil
import subprocess
import time

import torch
import storage_offload

LAYERS = 32
BLOCK_BYTES = 64 << 10  # one block of one layer: 16 tokens x 8 KV heads x 128 x 2 (K, V) x 2 bytes
BLOCKS_PER_FILE = 16  # 256 tokens: 32 MiB per file
FILE_BYTES = LAYERS * BLOCK_BYTES * BLOCKS_PER_FILE
WARM_FILES = 16


class Driver:
    """One engine over 32 layer tensors of 2N blocks: stores read blocks
    0..N-1, loads write blocks N..2N-1."""

    def __init__(self, files, threads, device, job_timeout):
        self.device, self.job_timeout = device, job_timeout
        self.n = files * BLOCKS_PER_FILE
        self.tensors = [torch.empty((2 * self.n, BLOCK_BYTES // 2), dtype=torch.int16, device=device)
                        for _ in range(LAYERS)]
        g = torch.Generator(device=device).manual_seed(7)
        for t in self.tensors:
            t[:self.n].random_(-32768, 32767, generator=g)
        # Arguments as llm-d's connector passes them: I/O threads, blocks
        # per file, the layer tensors, one group of all layers, a file
        # block's bytes, read-preferring threads (three quarters), no GDS.
        self.engine = storage_offload.StorageOffloadEngine(
            threads, BLOCKS_PER_FILE, self.tensors, [list(range(LAYERS))], [LAYERS * BLOCK_BYTES],
            int(threads * 0.75), "disabled", 0.0)
        self.job = 0

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def run(self, store, paths, base):
        """Moves one file per path (blocks from base on) as one job; returns
        its seconds and whether the engine reported success."""
        self.job += 1
        ids = [list(range(base + i * BLOCKS_PER_FILE, base + (i + 1) * BLOCKS_PER_FILE))
               for i in range(len(paths))]
        submit = self.engine.async_store_gpu_blocks if store else self.engine.async_load_gpu_blocks
        self.sync()
        t0 = time.perf_counter()
        accepted = submit(self.job, [0] * len(paths), paths, ids, [0] * len(paths))
        flags = []
        while not flags:
            flags = [ok for job, ok in self.engine.get_finished() if job == self.job]
            if not flags:
                if time.perf_counter() - t0 > self.job_timeout:
                    raise TimeoutError(f"job {self.job} ({len(paths)} files) not finished after "
                                       f"{self.job_timeout:g} s")
                time.sleep(0.0002)
        self.sync()
        return time.perf_counter() - t0, bool(accepted) and all(flags)

    def layers_differ(self):
        """How many layers' loaded blocks differ from their stored ones."""
        return sum(0 if torch.equal(t[:self.n], t[self.n:]) else 1 for t in self.tensors)

    def clear_loaded(self):
        for t in self.tensors:
            t[self.n:].zero_()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir")
    ap.add_argument("gib", type=float)
    ap.add_argument("threads", type=int)
    ap.add_argument("rounds", type=int)
    ap.add_argument("--cold", action="store_true", help="drop the page cache between store and load")
    ap.add_argument("--sync", action="store_true", help="count an os.sync() in each store")
    ap.add_argument("--device", default="cuda:0", help="torch device of the layer tensors (cpu: tests)")
    ap.add_argument("--job-timeout", type=float, default=120, help="seconds a job may take before the run fails")
    a = ap.parse_args()
    files = int(a.gib * (1 << 30)) // FILE_BYTES
    if files < 1:
        ap.error(f"{a.gib} GiB holds no file of {FILE_BYTES >> 20} MiB")
    device = torch.device(a.device)
    if device.type == "cuda":  # before the engine, which maps the current device's memory
        torch.cuda.set_device(device.index or 0)
    d = Driver(files, a.threads, device, a.job_timeout)

    warm = os.path.join(a.dir, "warm")
    paths = [os.path.join(warm, f"w{i}.bin") for i in range(min(WARM_FILES, files))]
    d.run(True, paths, 0)
    d.run(False, paths, d.n)
    shutil.rmtree(warm, ignore_errors=True)

    nbytes = files * FILE_BYTES
    sname = "store+sync" if a.sync else "store"
    lname = "cold load" if a.cold else "load"
    for r in range(1, a.rounds + 1):
        rdir = os.path.join(a.dir, f"r{r}")
        shutil.rmtree(rdir, ignore_errors=True)
        paths = [os.path.join(rdir, f"k{i:05d}.bin") for i in range(files)]
        d.clear_loaded()
        st, stored = d.run(True, paths, 0)
        if a.sync:
            t0 = time.perf_counter()
            os.sync()
            st += time.perf_counter() - t0
        present = sum(os.path.exists(p) for p in paths)
        if a.cold:
            os.sync()
            subprocess.run(["sh", "-c", "echo 3 > /proc/sys/vm/drop_caches"], check=False)
        lt, loaded = d.run(False, paths, d.n)
        differ = d.layers_differ()
        ok_store = stored and present == files
        ok_load = loaded and differ == 0 and present == files
        print(f"llmd {sname} GB/s {nbytes / st / 1e9:.2f} files {files} round {r} ok {ok_store}")
        print(f"llmd {lname} GB/s {nbytes / lt / 1e9:.2f} files {files} round {r} ok {ok_load} "
              f"layers_differ {differ}")
        print(f"detail: llmd round {r} store_s {st:.3f} load_s {lt:.3f} store_flag {stored} "
              f"load_flag {loaded} files_present {present}/{files} sync {a.sync} "
              f"page_cache {'dropped' if a.cold else 'warm'}", flush=True)
        shutil.rmtree(rdir, ignore_errors=True)


if __name__ == "__main__":
    try:
        main()
    except TimeoutError as err:
        raise SystemExit(f"peer-llmd: {err}")
