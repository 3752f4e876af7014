#!/usr/bin/env python3
"""Time to first token (TTFT) of a Llama-3.1-8B-shaped model with a prefix
cached in kvhost, against recomputing it and against the physical bound.

    ttft-bench.py --dir DIR [--sizes 2048,8192,32256] [--suffix 512]
                  [--reps 5] [--cold] [--json FILE] [--llmd MODDIR] ...

--window N makes the model a gpt-oss-like hybrid (even layers a sliding
window of N tokens, in a KV-cache group of their own: docs/ttft.md).

The model (scripts/ttft_model.py) has random bf16 weights: 32 layers,
hidden 4096, 32 query heads, 8 KV heads of 128, a SwiGLU MLP of 14336, a
head over a small vocabulary (8192); every dimension is a flag, so that a
test runs a tiny one on CPU. Its paged KV cache is vLLM's FlashAttention
layout: per layer (2, num_blocks, 16, 8, 128) bf16, 16-token blocks, one
allocation registered with a kvhost daemon (CUDA IPC on a GPU, a memfd on
CPU); the daemon serves DIR (started here with a TOML configuration by
client/python/tests/daemon.py, from --kvhost-bin; or --socket names a
running one).

For each prefix size P the request is P prefix tokens and S suffix tokens.
A recomputation first gives the reference (the last token's logits and the
prefix's K/V bytes), whose prefix blocks are then stored in kvhost as P /
--tokens-per-key keys. Each mode's TTFT is the wall time from the request's
arrival (the prefix's K/V not on the device: its blocks are poisoned with
NaN first, and with --cold the page cache dropped) to the logits of the
last token, the device synchronized at both ends:

    recompute  prefill all P+S tokens
    whole      load every layer of the prefix's keys (one job of the
               kvhost client), then compute the suffix
    layerwise  KvhostConnector (kvhost.vllm), driven as vLLM drives it
               without vLLM: its scheduler half claims the whole prefix
               (load_split "all"), its worker's start_load_kv submits its
               load jobs at once (--layers-per-load layers each, the first
               and last one layer with --layer-groups ramp) and each
               layer calls wait_for_layer_load right before its attention
               (as vLLM's attention layers do), so layer i can load while
               layer i-1 computes
    layerjobs  the same layer-wise load jobs, every layer's waited for
               before the suffix computes: against whole, what cutting
               the load into layer jobs costs with no forward pass beside
               them (a diagnosis, not in the default modes)
    split      load-or-recompute: the connector's scheduler (load_split
               "auto") decides K with its cost model, whose rates are
               this run's (the load rate whole load showed, a prefill
               model through recompute, half and suffix); the worker loads K
               tokens layer-wise while tokens K..P+S are computed
    llmd       (with --llmd) llm-d's storage_offload engine loads the
               prefix from its own files (written by it first), then the
               suffix is computed

and the ceilings beside them: suffix (the suffix's compute with the prefix
already on the device), h2d (a pinned host to GPU copy of the prefix's
K/V bytes; CUDA only), disk (the files the prefix's store wrote, read
whole by plain reads in several shapes: 1, 4 and 16 O_DIRECT readers of
4 MiB, 16 buffered of 4 MiB and 64 of 1 MiB, each after dropping the page
cache with --cold; the best is the mount's ceiling, against which the
whole load's rate, its bytes over its time beyond the suffix's, and
llm-d's are reported) and bound (no daemon: the prefix's K/V
in pinned host memory, one copy per layer on a side stream, each layer's
attention waiting for its copy and scattering it into the paged cache on
the compute stream: the physical bound of a layer-wise hit; on a CPU the
copies run in line); half (the
computation of the tokens after the first half of the prefix, that half
on the device) is the third point of the split's prefill model. The goal
is layerwise <= 1.10 x bound, in the same run.

The connector's keys are its own (its namespace, keys from vLLM-like
block hashes): the prefix is saved through its save path first (a
request of the prefix alone), and the timed requests' schedulers save
nothing, so that each finds the same prefix cached.

Each mode runs --warmup untimed repetitions, then --reps timed ones; a
line gives the median (ms) and the best (best):

    ttft P 32256 S 512 mode layerwise ms 96.1 best 95.0 ok True

ok says that in every repetition each load finished with every key loaded,
every loaded block equals the recomputation's bytes (the whole blocks, all
layers, compared exactly) and the last token's logits equal the
recomputation's within bf16 tolerance: ||logits - reference||_2 <= 0.05 x
||reference||_2. Computing the suffix alone takes other kernels than
computing P+S tokens, and bf16 rounding through 32 layers of random
weights moves the logits: 0.023-0.025 of their norm on the H200 for the
suffix computed over the recomputation's own K/V, the same for every load
mode (their logits equal that suffix's bit for bit). The report gives each
repetition's relative distance ("rel_err").
Then per size

    bound P 32256 S 512 layerwise/bound 1.07 (reps 1.05-1.12) bound_ms 78.3 limit 1.1 met True
    ratio P 32256 S 512 split/recompute 0.71 split_tokens 20480 modelled_optimum/recompute 0.69 at_tokens 20736

(bound only where the bound mode ran; the modelled optimum is the split's
own cost model with this run's rates, over every chunk boundary). --json FILE writes every repetition, the
machine (GPU, torch, CUDA), the mount, the ceilings and the ratios. The
exit status is 1 where any ok is False.
"""
import argparse
import copy
import gc
import hashlib
import json
import math
import os
import pathlib
import platform
import re
import resource
import socket as socketlib
import shutil
import statistics
import sys
import tempfile
import threading
import time
import types
import warnings

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "client" / "python" / "src"))
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "client" / "python" / "tests"))  # daemon.py: a daemon from a TOML configuration

import torch  # noqa: E402

import kvhost  # noqa: E402
from kvhost import memory  # noqa: E402
import vllm_specs  # noqa: E402  (client/python/tests: vLLM's specs stood in for)
from ttft_model import Config, Model  # noqa: E402

TOL = 0.05  # logits: ||a - ref||_2 <= TOL * ||ref||_2 (bf16 through every layer)
BOUND = 1.10  # the goal: layerwise <= BOUND x the bound mode's TTFT
LOADED = 4  # kvhost.protocol.OUTCOME_LOADED


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", help="the cache directory a daemon started here serves (on the mount under test)")
    ap.add_argument("--socket", help="a running daemon's socket instead of starting one")
    ap.add_argument("--kvhost-bin", default=os.environ.get("KVHOST_BIN") or str(REPO / "bin" / "kvhost"),
                    help="the daemon's binary ($KVHOST_BIN, else bin/kvhost)")
    ap.add_argument("--lookups", type=int, default=2000,
                    help="time this many connector lookups of each prompt idle, and more beside the layer-wise "
                         "loads (0: none)")
    ap.add_argument("--io-workers", type=int, default=0,
                    help="the started daemon's engine.io_workers: files in flight (0: its default, the CPUs)")
    ap.add_argument("--register-files", type=int, default=None,
                    help="the daemon's gpu.register_files (0: no file registered with CUDA, as after a restart "
                         "or for another engine's files; default: the daemon's). The daemon wrote the files, so its "
                         "loads do not sum them again: add --mount-toml 'checksum_every_load = true' for the first "
                         "loads of a restarted daemon, which verify every byte")
    ap.add_argument("--daemon-toml", default="",
                    help="more of the daemon's TOML configuration, before its [[mount]] (e.g. '[gpu]\\nchecksum_on = \"gpu\"')")
    ap.add_argument("--daemon-trace", metavar="FILE",
                    help="take a Go execution trace of the started daemon during the layer-wise mode's timed "
                         "repetitions at the largest prefix (--daemon-trace-seconds long, from its metrics listener "
                         "with profiling on), into FILE: scripts/trace-regions.py FILE reads its loads' phases")
    ap.add_argument("--daemon-trace-seconds", type=float, default=2.0,
                    help="how long the --daemon-trace trace runs (from the first timed repetition)")
    ap.add_argument("--policy-toml", default="",
                    help="more keys of the daemon's [policy] (e.g. 'name = \"tiered\"')")
    ap.add_argument("--objects", metavar="ENDPOINT",
                    help="an S3 endpoint (e.g. bin/s3local's) for the daemon's object mount: its [objects] table, "
                         "bucket --objects-bucket (made if missing); with a small --capacity and a policy that "
                         "demotes (--policy-toml 'name = \"tiered\"') the prefixes live in the bucket and load "
                         "from it")
    ap.add_argument("--objects-bucket", default="ttft", help="the object mount's bucket (--objects)")
    ap.add_argument("--mount-toml", default="",
                    help="more keys of the daemon's [[mount]] (e.g. 'io = \"buffered\"')")
    ap.add_argument("--capacity", help="the mount's capacity in the daemon's configuration (default: four "
                    "times the prefixes' K/V bytes)")
    ap.add_argument("--sizes", default="2048,8192,32256", help="prefix sizes P in tokens, comma-separated")
    ap.add_argument("--suffix", type=int, default=512, help="suffix tokens S")
    ap.add_argument("--modes", default="recompute,suffix,half,h2d,bound,disk,whole,layerwise,split,llmd",
                    help="modes to run (recompute always runs: it is the reference)")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions per mode (median and best reported)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed repetitions before them")
    ap.add_argument("--cold", action="store_true", help="drop the page cache before each load (root)")
    ap.add_argument("--json", help="write the report here")
    ap.add_argument("--llmd", help="directory of a built llm-d storage_offload module (adds the llmd mode)")
    ap.add_argument("--llmd-threads", type=int, default=16, help="llm-d engine I/O threads")
    ap.add_argument("--device", default="cuda", help="torch device (cpu: tests)")
    ap.add_argument("--tokens-per-key", type=int, default=256, help="tokens per kvhost key (and llm-d file)")
    ap.add_argument("--blocks", default="random", choices=("random", "sequential"),
                    help="the request's block ids: a random permutation (the default: a paged cache after "
                         "churn; every block its own copy) or in order (a fresh engine's; a key's blocks are "
                         "adjacent in each layer, which the daemon copies at once)")
    ap.add_argument("--cuda-graphs", default="on", choices=("on", "off"),
                    help="on (the default): passes of the suffix's tokens (at most 512) replay piecewise CUDA "
                         "graphs, as vLLM runs them with a KV connector (attention and its waits eager between "
                         "them); off: every pass eager")
    ap.add_argument("--layers-per-load", type=int, default=4, help="layers per layer-wise load job")
    ap.add_argument("--layer-groups", default="ramp", choices=("ramp", "even"),
                    help="the connector's layer_groups: ramp (first and last jobs one layer) or even")
    ap.add_argument("--job-timeout", type=float, default=120, help="seconds a load may take before it fails")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--window", type=int, default=0,
                    help="> 0: a gpt-oss-like hybrid, every even layer a sliding window of this many tokens (128 "
                         "as gpt-oss), the odd ones full attention, in two KV-cache groups of the connector")
    ap.add_argument("--keep-stored", action="store_true",
                    help="leave the prefixes stored when the run ends: a later run on the same --dir with the same "
                         "sizes and --seed starts its daemon on them, as a restarted daemon does (its report's "
                         "keys_present counts the keys it found stored)")
    ap.add_argument("--corrupt-stored", action="store_true",
                    help="a check of the checks (tests): flip the first payload byte of the newest file under "
                         "--dir after each store; every load mode must then say ok False")
    for name, default in [("layers", 32), ("hidden", 4096), ("heads", 32), ("kv-heads", 8),
                          ("head-dim", 128), ("mlp", 14336), ("vocab", 8192)]:
        ap.add_argument(f"--{name}", type=int, default=default, help=f"model {name} (default {default})")
    a = ap.parse_args(argv)
    a.sizes = [int(s) for s in a.sizes.split(",") if s]
    a.modes = [m for m in a.modes.split(",") if m]
    unknown = set(a.modes) - {"recompute", "suffix", "half", "h2d", "bound", "disk", "whole", "layerwise", "layerjobs", "split",
                              "llmd"}
    if unknown:
        ap.error(f"unknown modes {sorted(unknown)}")
    if "split" in a.modes and "half" not in a.modes:
        # Through recompute and suffix alone a straight line fits exactly,
        # and a split priced without attention's quadratic term claims
        # too many tokens.
        ap.error("split prices compute by a fit through recompute, half and suffix: add half to --modes")
    if not a.dir and not a.socket:
        ap.error("give --dir (a daemon is started there) or --socket")
    if a.daemon_trace and (a.socket or "[metrics]" in a.daemon_toml):
        ap.error("--daemon-trace takes the trace from the metrics listener of a daemon started here, which this "
                 "script makes (no --socket, no [metrics] table in --daemon-toml)")
    if a.daemon_trace and "layerwise" not in a.modes:
        ap.error("--daemon-trace traces the layer-wise mode: add it to --modes")
    if a.corrupt_stored and not a.dir:
        ap.error("--corrupt-stored needs --dir (the files it corrupts)")
    if a.tokens_per_key % 16:
        ap.error(f"--tokens-per-key {a.tokens_per_key}: want a multiple of the 16-token block")
    for p in a.sizes:
        if p <= 0 or p % a.tokens_per_key:
            ap.error(f"prefix size {p}: want a positive multiple of --tokens-per-key ({a.tokens_per_key})")
    if a.layers_per_load <= 0:
        ap.error("--layers-per-load: want > 0")
    return a


def model_suffix(a):
    """What the model's name adds for a hybrid (its own namespaces)."""
    return f"-window{a.window}" if a.window else ""


def drop_page_cache(state):
    """Drops the page cache (root); warns once and does nothing else where
    it cannot."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError as e:
        if not state.get("warned"):
            warnings.warn(f"--cold: cannot drop the page cache ({e}); loads may be warm")
            state["warned"] = True
        return False


def mount_of(path):
    """(mount point, file system type, device) of the mount holding path."""
    real = os.path.realpath(path)
    best = ("/", "?", "?")
    with open("/proc/mounts") as f:
        for line in f:
            dev, mnt, fstype = line.split()[:3]
            mnt = mnt.replace("\\040", " ")
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[0]):
                best = (mnt, fstype, dev)
    return best


def data_files(d):
    """{path: size} of the data files under d (names starting with "."
    are temporaries and spares)."""
    out = {}
    for r, _, fs in os.walk(d):
        for f in fs:
            if not f.startswith("."):
                path = os.path.join(r, f)
                try:
                    out[path] = os.stat(path).st_size
                except FileNotFoundError:
                    pass
    return out


# The plain reads a disk ceiling tries: (name, O_DIRECT, readers, bytes
# per read). On the H200's virtio ext4 one O_DIRECT reader of 4 MiB and
# 16-64 buffered readers each reached about 2.0 GB/s where 16-64 O_DIRECT
# readers got 1.2-1.65: no one shape is best everywhere.
DISK_READS = [("direct-1x4MiB", True, 1, 4 << 20), ("direct-4x4MiB", True, 4, 4 << 20),
              ("direct-16x4MiB", True, 16, 4 << 20), ("buffered-16x4MiB", False, 16, 4 << 20),
              ("buffered-64x1MiB", False, 64, 1 << 20)]


def read_whole(files, direct, readers, size):
    """Reads files whole by readers threads, each taking the next file
    and reading it by preads of size bytes into a page-aligned buffer
    (O_DIRECT if direct, where the file system has it); returns the
    seconds it took and the errors met. Threads release the GIL in
    preadv, so they read at once."""
    import mmap
    import threading
    queue, lock, errors = list(files), threading.Lock(), []

    def reader():
        buf = mmap.mmap(-1, size)  # page-aligned: what O_DIRECT needs
        view = memoryview(buf)
        try:
            while True:
                with lock:
                    if not queue:
                        return
                    path = queue.pop()
                flags = os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if direct else 0)
                try:
                    fd = os.open(path, flags)
                except OSError:  # a file system without O_DIRECT (tmpfs): read it buffered
                    fd = os.open(path, os.O_RDONLY)
                try:
                    off = 0
                    while True:
                        n = os.preadv(fd, [view], off)
                        if n <= 0:
                            break
                        off += n
                finally:
                    os.close(fd)
        except OSError as e:
            errors.append(str(e))
        finally:
            view.release()
            buf.close()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=reader) for _ in range(readers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, errors


def disk_ceiling(files, cold_state, reads=DISK_READS, reps=1):
    """Reads files whole in each shape of reads (read_whole), reps
    rounds of every shape in turn, the page cache dropped before each
    read where cold_state is given (a dict: --cold). A shape's rate is
    the median of its rounds; the fastest shape's is the ceiling a load
    from this mount is held against (ceiling_gbps, its rounds in
    ceiling_reps_gbps), medians against medians. best_gbps is the
    fastest single read of any shape: the largest of many noisy samples,
    which on the H200's disks lay 1.07-1.7 x the fastest shape's median."""
    total = sum(os.path.getsize(f) for f in files)
    configs = [{"name": name, "direct": direct, "readers": readers, "read_bytes": size, "seconds": [],
                "reps_gbps": [], "errors": []} for name, direct, readers, size in reads]
    for _ in range(max(reps, 1)):
        for c in configs:
            if c["errors"]:
                continue
            if cold_state is not None:
                drop_page_cache(cold_state)
            dt, errors = read_whole(files, c["direct"], c["readers"], c["read_bytes"])
            c["errors"] += [f"{c['name']}: {e}" for e in errors]
            c["seconds"].append(dt)
            c["reps_gbps"].append(total / dt / 1e9 if dt > 0 else 0.0)
    for c in configs:
        c["gbps"] = statistics.median(c["reps_gbps"])
    ok = [c for c in configs if not c["errors"]] or configs
    best = max(ok, key=lambda c: c["gbps"])
    return {"files": len(files), "bytes": total, "configs": configs, "best": best["name"],
            "best_gbps": max(g for c in ok for g in c["reps_gbps"]), "ceiling_reps_gbps": best["reps_gbps"],
            "ceiling_gbps": best["gbps"], "cold": cold_state is not None}


# The daemon's metrics that say its work after a burst of stores is done:
# the spare files made ahead (their count and their bytes) and the GPU
# path's registrations still queued.
SETTLE_METRICS = ("kvhost_spare_files_made_total", "kvhost_mount_spare_bytes", "kvhost_gpu_file_registrations_queued")


class DaemonTrace:
    """A Go execution trace of the daemon, taken from its metrics
    listener's /debug/pprof/trace (profiling on) on a thread of its own
    while the timed repetitions run."""

    def __init__(self, metrics_addr, path, seconds):
        self.url = f"http://{metrics_addr}/debug/pprof/trace?seconds={seconds:g}"
        self.path, self.seconds = path, seconds
        self.thread, self.error, self.size = None, None, 0

    def start(self):
        self.thread = threading.Thread(target=self._take, name="ttft-daemon-trace", daemon=True)
        self.thread.start()

    def _take(self):
        import urllib.request
        try:
            with urllib.request.urlopen(self.url, timeout=self.seconds + 60) as r, open(self.path, "wb") as f:
                while chunk := r.read(1 << 20):
                    f.write(chunk)
                    self.size += len(chunk)
        except Exception as e:  # noqa: BLE001 - reported, the run goes on
            self.error = f"{type(e).__name__}: {e}"

    def end(self):
        """Waits for the trace to end; its report entry."""
        self.thread.join(self.seconds + 90)
        if self.error or self.thread.is_alive():
            raise SystemExit(f"ttft-bench: --daemon-trace: {self.error or 'the trace did not end'} ({self.url})")
        return {"file": self.path, "bytes": self.size, "seconds": self.seconds}


def settle_reading(text, names=SETTLE_METRICS):
    """What the metrics names (SETTLE_METRICS) read in a Prometheus
    exposition text: a tuple of each one's sum over its series (0 where the
    daemon exports none, as a daemon without a GPU exports no
    registrations)."""
    sums = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        m = re.match(r"^(\w+)(?:\{[^}]*\})? ([0-9.eE+-]+)$", line)
        if m and m[1] in sums:
            sums[m[1]] += float(m[2])
    return tuple(sums[k] for k in names)


def metrics_text(metrics_addr):
    """The daemon's metrics now, as its listener's /metrics exposes them."""
    import urllib.request
    with urllib.request.urlopen(f"http://{metrics_addr}/metrics", timeout=5) as r:
        return r.read().decode()


def metric_count(metrics_addr, name):
    """A count the daemon's metrics give now, summed over its series (None
    where it cannot be asked): kvhost_gpu_registered_files, the files it
    holds registered with CUDA (what a load mode's repetitions found);
    kvhost_files_verified_ahead_total, the files found at start it has
    verified before their first loads."""
    if not metrics_addr:
        return None
    return int(settle_reading(metrics_text(metrics_addr), (name,))[0])


def load_readers(metrics_addr):
    """How the daemon's disk mounts read loads now, as tuned
    (kvhost_mount_load_readers, kvhost_mount_load_buffered,
    kvhost_mount_load_reader_changes_total,
    kvhost_mount_load_rate_bytes_per_second and
    kvhost_mount_load_arm_rate_bytes_per_second): a dict of each disk
    mount to [readers, buffered, tuning's moves so far, the rate it last
    measured for those readers in GB/s (0: not measured), every arm it
    measured as [readers, buffered, GB/s, 1 where it settled on it]]
    (a memory mount has no readers: empty where every mount is memory);
    None where the daemon cannot be asked."""
    if not metrics_addr:
        return None
    return load_readers_of(metrics_text(metrics_addr))


def load_readers_of(text):
    """load_readers of a metrics page's text."""
    fields = {"readers": 0, "buffered": 1, "reader_changes_total": 2, "rate_bytes_per_second": 3}
    out = {}
    for line in text.splitlines():
        m = re.match(r'^kvhost_mount_load_([a-z_]+)\{([^}]*)\} ([0-9.eE+-]+)$', line)
        if not m:
            continue
        labels, v = dict(re.findall(r'(\w+)="([^"]*)"', m[2])), float(m[3])
        if "mount" not in labels:
            continue
        entry = out.setdefault(labels["mount"], [0, 0, 0, 0.0, []])
        if m[1] in fields and len(labels) == 1:
            entry[fields[m[1]]] = round(v / 1e9, 3) if m[1] == "rate_bytes_per_second" else int(v)
        elif m[1] == "arm_rate_bytes_per_second":
            entry[4].append([int(labels["readers"]), int(labels["io"] == "buffered"), round(v / 1e9, 3),
                             int(labels["home"] == "1")])
    for entry in out.values():
        entry[4].sort(key=lambda a: (a[1], a[0]))
    return out


class Registrations:
    """The daemon's count of files registered with CUDA from its start,
    sampled every interval on a thread of its own until stop: when a
    daemon started on files an earlier run kept (--keep-stored) had
    registered them, before the first load mode."""

    def __init__(self, metrics_addr, t0, interval=0.1):
        self.addr, self.t0, self.interval = metrics_addr, t0, interval
        self.changes, self._stop = [], threading.Event()
        self.thread = threading.Thread(target=self._run, name="ttft-registrations", daemon=True)
        self.thread.start()

    def _run(self):
        last = None
        while True:
            try:
                n = metric_count(self.addr, "kvhost_gpu_registered_files")
            except OSError:
                n = None
            if n is not None and n != last:
                self.changes.append([round(time.monotonic() - self.t0, 3), n])
                last = n
            if self._stop.wait(self.interval):
                return

    def stop(self):
        """Ends the sampling; [[seconds since the daemon was up, files
        registered] at each change]."""
        self._stop.set()
        self.thread.join(10)
        return self.changes


def settle(metrics_addr, still_s=0.3, limit_s=60.0, read=None):
    """Waits until the daemon is done with its work after a store: no
    registration queued and the spare files made ahead unchanged for
    still_s, as kvhost bench settles before its timed phases (an idle
    moment before a request). Returns the seconds waited, or None where it
    did not settle within limit_s (a line says so) or cannot be asked."""
    if not metrics_addr:
        return None
    if read is None:
        def read():
            return settle_reading(metrics_text(metrics_addr))
    t0 = time.monotonic()
    last, since = None, t0
    while time.monotonic() - t0 < limit_s:
        now = read()
        if now != last:
            last, since = now, time.monotonic()
        elif now[2] == 0 and time.monotonic() - since >= still_s:
            return time.monotonic() - t0
        time.sleep(0.02)
    print(f"detail: the daemon did not settle within {limit_s:g} s after a store (spares, registrations: {last})",
          flush=True)
    return None


def corrupt_newest(d):
    """Flips the first payload byte of the newest data file under d (a
    kvhost file: its header's length at offset 12 is the payload's
    offset; names starting with "." are temporaries and spares)."""
    files = [os.path.join(r, f) for r, _, fs in os.walk(d) for f in fs if not f.startswith(".")]
    if not files:
        raise SystemExit(f"ttft-bench: --corrupt-stored: no data file under {d}")
    path = max(files, key=os.path.getmtime)
    with open(path, "r+b") as f:
        f.seek(12)
        at = int.from_bytes(f.read(4), "little")
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))
    print(f"detail: corrupted {path} at {at}", flush=True)


def close(logits, ref):
    """Whether logits equal ref within the bf16 tolerance, and their
    distance relative to ref's norm (NaN where logits are not finite)."""
    rel = ((logits - ref).norm() / ref.norm()).item()
    return rel <= TOL, rel


def thread_sched():
    """The calling thread's figures: (ns on a CPU, ns runnable but
    waiting for one, involuntary context switches). The CPU time is the
    thread's CPU clock; the wait is schedstat's run delay (None where
    /proc/self/task/TID/schedstat is missing or all zeros: a kernel
    without scheduler statistics); the switches are getrusage's."""
    wait = None
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
            fields = [int(x) for x in f.read().split()[:2]]
        if any(fields):
            wait = fields[1]
    except (OSError, ValueError):
        pass
    return time.thread_time_ns(), wait, resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw


def process_cpu_ns(pid):
    """The ns pid spent on CPUs, every thread's, those ended included
    (its process CPU clock; None where unreadable)."""
    if pid is None:
        return None
    try:
        return time.clock_gettime_ns(((~pid) << 3) | 2)  # CPUCLOCK_SCHED of pid's whole process
    except OSError:
        return None


def cpu_figures(before, after, daemon_before, daemon_after, ready):
    """One repetition's CPU figures: the bench's main thread's time on a
    CPU and runnable without one (what other threads took from it), its
    involuntary switches, the daemon's CPU time, and, given when each
    layer's wait returned (ready: the connector's modes that overlap the
    forward pass), the forward pass's pace (ms per layer between the
    first and the last layer's wait returning)."""
    out = {"main_cpu_ms": round((after[0] - before[0]) / 1e6, 2), "main_preempted": after[2] - before[2]}
    if before[1] is not None and after[1] is not None:
        out["main_runnable_ms"] = round((after[1] - before[1]) / 1e6, 2)
    if daemon_before is not None and daemon_after is not None:
        out["daemon_cpu_ms"] = round((daemon_after - daemon_before) / 1e6, 2)
    if len(ready) > 1:
        out["ms_per_layer"] = round((ready[-1] - ready[0]) / (len(ready) - 1), 3)
    return out


class Bench:
    """The model, its cache registered with the daemon, and the runs."""

    def __init__(self, a, client, socket, metrics=None):
        self.a, self.c = a, client
        self.metrics = metrics  # the daemon's metrics address (settle), None for one given by --socket
        self.daemon_pid = None  # the daemon's process, where the bench started it (its CPU time per repetition)
        self.registrations = None  # a Registrations sampler, stopped as the first load mode begins
        self.dev = torch.device(a.device)
        self.cuda = self.dev.type == "cuda"
        if self.cuda:
            torch.cuda.set_device(self.dev.index or 0)
        self.cfg = Config(layers=a.layers, hidden=a.hidden, heads=a.heads, kv_heads=a.kv_heads,
                          head_dim=a.head_dim, mlp=a.mlp, vocab=a.vocab, window=a.window)
        self.model = Model(self.cfg, self.dev, seed=a.seed)
        # Captured at start, as vLLM captures its graphs: passes of the
        # suffix's tokens replay them (none on the CPU, nor past 512).
        self.graphs = a.cuda_graphs == "on" and self.model.capture(a.suffix)
        bt = self.cfg.block_tokens
        self.num_blocks = (max(a.sizes) + a.suffix + bt - 1) // bt + 2  # the request's, one spare, the null block
        self.host_buf = None
        if self.cuda:
            self.cache = self.model.new_cache(self.num_blocks)
            region = client.register_cuda_tensor(self.cache)
            base = self.cache.storage_offset() * self.cache.element_size()
        else:
            def alloc(shape, dtype):
                t, self.host_buf = memory.torch_host_tensor(shape, dtype, name="ttft-cache")
                return t
            self.cache = self.model.new_cache(self.num_blocks, alloc)
            region = client.register_buffer(self.host_buf)
            base = 0
        g = torch.Generator().manual_seed(a.seed + 1)
        # The request's blocks: a permutation, as a paged cache hands them
        # out, of every block but 0 (vLLM's null block, never a request's).
        order = torch.randperm(self.num_blocks - 1, generator=g) if a.blocks == "random" else \
            torch.arange(self.num_blocks - 1)
        self.table = (order + 1).to(self.dev)
        self.table_list = self.table.tolist()
        geometry = kvhost.Geometry(
            model=f"ttft-bench/random-llama-{a.layers}x{a.hidden}-seed{a.seed}{model_suffix(a)}", layers=a.layers,
            kv_heads=a.kv_heads, head_size=a.head_dim, dtype_size=2, tokens_per_block=bt,
            tokens_per_key=a.tokens_per_key)
        self.ns = client.declare(geometry)
        layer_bytes = self.cache[0].numel() * self.cache.element_size()
        bb = self.cfg.block_bytes
        self.cache_id = client.register_cache(self.ns, [
            kvhost.Layer(region, offset=base + l * layer_bytes, block_stride=bb,
                         plane_stride=self.num_blocks * bb, num_blocks=self.num_blocks)
            for l in range(a.layers)])
        # The keys' names follow the seed (as the connector's follow the
        # tokens), so that a run on the prefixes an earlier one kept
        # (--keep-stored) finds them; a run removes its own when it ends.
        self.run_id = f"seed{a.seed}"
        self.connector = Connector(self, socket) if {"layerwise", "layerjobs", "split"} & set(a.modes) else None
        self.layer_loads = bool(self.connector and self.connector.worker.counters()["layer_loads"])
        self.cold_state = {}
        self.rel_errs, self.layer_ready, self.phases, self.load_jobs = [], [], {}, []
        self.report = {"sizes": {}}
        self.failed = False

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    # -- a size's pieces ---------------------------------------------------

    def keys(self, p, n):
        return [f"ttft-{self.run_id}-P{p}-{i}".encode() for i in range(n)]

    def key_blocks(self, n):
        bpk = self.a.tokens_per_key // self.cfg.block_tokens
        return [self.table_list[i * bpk:(i + 1) * bpk] for i in range(n)]

    def prefix_blocks(self, tokens):
        return self.table[:tokens // self.cfg.block_tokens]

    def window_first(self, k):
        """The first block a sliding-window layer still needs once k tokens
        are cached: the block of position k - window + 1 (vLLM's null block
        0 stands before it in the window group's table)."""
        if not self.cfg.window:
            return 0
        return max(0, k - self.cfg.window + 1) // self.cfg.block_tokens

    def window_list(self, k, n):
        """The window group's first n blocks of the request once k tokens
        are cached: null before window_first(k), the request's after."""
        first = self.window_first(k)
        return [0] * min(first, n) + self.table_list[first:n]

    def window_table(self, k):
        """window_list of every block of the table, on the device (None for
        a model without window layers)."""
        if not self.cfg.window:
            return None
        return torch.tensor(self.window_list(k, len(self.table_list)), device=self.dev)

    def loaded_equal(self, k, ref_kv):
        """Whether every block the load of k tokens puts back equals the
        recomputation's: every prefix block of full-attention layers, the
        blocks from window_first(k) of window layers."""
        n, first = k // self.cfg.block_tokens, self.window_first(k)
        got = self.cache.index_select(2, self.prefix_blocks(k))
        for layer in range(self.cfg.layers):
            lo = first if self.cfg.windowed(layer) else 0
            if not torch.equal(got[layer, :, lo:n], ref_kv[layer, :, lo:n]):
                return False
        return True

    def poison(self, p):
        """NaN into every layer's K and V of the prefix's blocks."""
        self.cache.index_fill_(2, self.prefix_blocks(p), float("nan"))
        self.sync()

    def timed(self, fn):
        self.sync()
        t0 = time.perf_counter()
        out = fn()
        self.sync()
        return (time.perf_counter() - t0) * 1e3, out

    def run_size(self, p):
        a, s = self.a, self.a.suffix
        g = torch.Generator().manual_seed(a.seed * 1000003 + p)
        tokens = torch.randint(0, self.cfg.vocab, (p + s,), generator=g).to(self.dev)
        nkeys = p // a.tokens_per_key
        keys, blocks = self.keys(p, nkeys), self.key_blocks(nkeys)
        rep = {"P": p, "S": s, "keys": nkeys, "prefix_kv_bytes": self.cfg.kv_bytes(p), "modes": {}}
        suffix_logits = None
        self.report["sizes"][str(p)] = rep
        modes = rep["modes"]

        def record(mode, reps, oks, errors, extra=None):
            timed_reps = reps[a.warmup:]
            m = {"reps_ms": timed_reps, "warmup_ms": reps[:a.warmup],
                 "median_ms": statistics.median(timed_reps), "best_ms": min(timed_reps),
                 "ok": all(oks), "errors": errors, "rel_err": self.rel_errs}
            self.rel_errs = []
            if self.layer_ready:
                m["layer_ready_ms"] = self.layer_ready  # the last repetition's
                m["phases_ms"] = self.phases  # when each part of its step ended
                # Its load jobs: when each was sent, the daemon's time for
                # it and when its wait returned (the connector's timeline).
                m["load_jobs"] = self.load_jobs
                self.layer_ready, self.phases, self.load_jobs = [], {}, []
            m.update(extra or {})
            modes[mode] = m
            self.failed |= not m["ok"]
            print(f"ttft P {p} S {s} mode {mode} ms {m['median_ms']:.1f} best {m['best_ms']:.1f} ok {m['ok']}",
                  flush=True)
            if errors:
                print(f"detail: P {p} mode {mode} errors: {'; '.join(errors[:3])}", flush=True)

        # recompute: the reference. Each repetition starts from poisoned
        # prefix blocks (nothing of the request on the device).
        reps, ref = [], None
        for _ in range(a.warmup + a.reps):
            self.poison(p)
            ms, logits = self.timed(lambda: self.model.forward(tokens, 0, self.cache, self.table))
            reps.append(ms)
            ref = logits if ref is None else ref
        ok, diff = close(logits, ref)
        self.rel_errs.append(diff)
        record("recompute", reps, [ok and bool(torch.isfinite(ref).all())], [] if ok else [f"logits differ {diff}"])
        ref_kv = self.cache.index_select(2, self.prefix_blocks(p)).clone()

        # The prefix's keys, stored from the recomputation's blocks.
        before = data_files(a.dir) if a.dir else {}
        res = self.c.store(self.cache_id, keys, blocks).wait(a.job_timeout)
        stored = res.count(1) + res.count(2)
        rep["keys_present"] = res.count(2)  # stored before this run's store (--keep-stored's earlier run)
        if stored != nkeys:
            raise SystemExit(f"ttft-bench: stored {stored} of {nkeys} keys: {res.outcomes()}; the first failure: "
                             f"{res.message or 'no message'}")
        if a.corrupt_stored:
            corrupt_newest(a.dir)
        rep["settle_s"] = [settle(self.metrics)]
        if a.objects:
            # How many of the keys stayed in files (the rest the policy
            # moved to the bucket, where the loads find them).
            files = sum(m["entries"] for m in self.c.stats()["mounts"])
            rep["objects"] = {"endpoint": a.objects, "bucket": a.objects_bucket, "files_on_mounts": files}
            print(f"objects P {p} keys {nkeys} files_on_mounts {files} bucket {a.objects_bucket}", flush=True)
        if "disk" in a.modes and a.dir:
            # The files this store wrote, read by plain reads: the
            # mount's own ceiling for a whole load, in this run.
            files = sorted(set(data_files(a.dir)) - set(before))
            modes["disk"] = disk_ceiling(files, self.cold_state if a.cold else None, reps=a.reps)
            d = modes["disk"]
            again = d["ceiling_reps_gbps"]
            print(f"disk P {p} files {len(files)} bytes {d['bytes']} best_gbps {d['best_gbps']:.2f} "
                  + " ".join(f"{c['name']} {c['gbps']:.2f}" for c in d["configs"])
                  + f" ceiling_gbps {d['ceiling_gbps']:.2f} ({d['best']}, reps {min(again):.2f}-{max(again):.2f})",
                  flush=True)

        def cached_mode(mode, k):
            """Times the computation of tokens k.. with the first k cached
            (in place since the recomputation); returns the last logits."""
            reps, oks, errs = [], [], []
            for _ in range(a.warmup + a.reps):
                ms, logits = self.timed(lambda: self.model.forward(tokens[k:], k, self.cache, self.table,
                                                                   window_table=self.window_table(k)))
                reps.append(ms)
                self._check(logits, ref, oks, errs)
            record(mode, reps, oks, errs, {"cached_tokens": k})
            return logits

        if "suffix" in a.modes:
            suffix_logits = cached_mode("suffix", p)
        # half: the computation of the tokens after half the prefix (on the
        # key grid) with that half cached, for the split's prefill model.
        half = p // 2 // a.tokens_per_key * a.tokens_per_key
        if "half" in a.modes:
            cached_mode("half", half)

        if "h2d" in a.modes and self.cuda:
            src = torch.empty(self.cfg.kv_bytes(p), dtype=torch.uint8, pin_memory=True)
            dst = torch.empty_like(src, device=self.dev)
            reps = [self.timed(lambda: dst.copy_(src, non_blocking=True))[0] for _ in range(a.warmup + a.reps)]
            del src, dst
            record("h2d", reps, [True], [], {"bytes": self.cfg.kv_bytes(p)})

        def load_mode(mode, run, trace=None, note=None):
            """Times run(failures) -> (logits, tokens loaded) from poisoned
            prefix blocks, checking each repetition; trace (a DaemonTrace)
            runs from the first timed one; note adds to the mode's report."""
            if self.registrations:
                self.report["registrations"] = self.registrations.stop()
                self.registrations = None
                self.report["files_verified_ahead"] = metric_count(self.metrics, "kvhost_files_verified_ahead_total")
                regs = self.report["registrations"]
                print(f"detail: before the first load mode: {regs[-1][1] if regs else 0} files registered "
                      f"(the last at {regs[-1][0] if regs else 0} s), {self.report['files_verified_ahead']} verified "
                      f"ahead", flush=True)
            reps, oks, errs, loaded, as_suffix, dropped, nbytes, cpu = [], [], [], [], [], [], [], []
            first_rep = None
            registered = metric_count(self.metrics, "kvhost_gpu_registered_files") if mode in ("whole", "layerwise", "layerjobs", "split") else None
            for i in range(a.warmup + a.reps):
                if trace and i == a.warmup:
                    trace.start()
                self.poison(p)
                if a.cold:
                    dropped.append(drop_page_cache(self.cold_state))
                failures = []
                self.loaded_bytes = None
                # This repetition's step, where it goes through the
                # connector (none left from an earlier mode's requests).
                self.layer_ready, self.phases, self.load_jobs = [], {}, []
                self.sync()
                before, daemon_before = thread_sched(), process_cpu_ns(self.daemon_pid)
                ms, (logits, k) = self.timed(lambda: run(failures))
                cpu.append(cpu_figures(before, thread_sched(), daemon_before, process_cpu_ns(self.daemon_pid),
                                       self.layer_ready if mode != "layerjobs" else []))
                if i == 0 and self.load_jobs:
                    # The first repetition's step (warm-up or not): the
                    # connector's first request of this size.
                    first_rep = {"ms": ms, "layer_ready_ms": self.layer_ready, "phases_ms": self.phases,
                                 "load_jobs": self.load_jobs}
                reps.append(ms)
                loaded.append(k)
                nbytes.append(self.loaded_bytes)
                if suffix_logits is not None:
                    as_suffix.append(bool(torch.equal(logits, suffix_logits)))
                if not self.loaded_equal(k, ref_kv):
                    failures.append(f"loaded blocks differ from the recomputation's ({k} tokens)")
                self._check(logits, ref, oks, errs, failures)
            if trace:
                extra = {"daemon_trace": trace.end()}
                print(f"trace P {p} mode {mode} file {extra['daemon_trace']['file']} "
                      f"bytes {extra['daemon_trace']['bytes']} seconds {a.daemon_trace_seconds:g}", flush=True)
            else:
                extra = {}
            extra.update(note or {})
            if first_rep and a.warmup + a.reps > 1:
                extra["first_rep"] = first_rep
            if registered is not None:
                # Files registered with CUDA as the first repetition began
                # (after a restart: those the daemon registered since it
                # opened; with --register-files 0: none).
                extra["registered_files_at_start"] = registered
            if a.dir and not a.objects and self.metrics:
                # A disk mount's readers as its tuning left them after the
                # mode (how its loads read: the count, through the page
                # cache or not).
                extra["load_readers_after"] = load_readers(self.metrics)
            record(mode, reps, oks, errs, {**extra, "loaded_tokens": loaded[-1], "loaded_tokens_reps": loaded[a.warmup:],
                                           "loaded_bytes_reps": nbytes[a.warmup:],
                                           "logits_equal_suffix_ceiling": as_suffix,
                                           "page_cache_dropped": dropped, "cpu_reps": cpu[a.warmup:]})
            timed_cpu = cpu[a.warmup:]
            if timed_cpu:
                def span(key):
                    vals = [x[key] for x in timed_cpu if key in x]
                    return f"{min(vals):g}-{max(vals):g}" if vals else "-"
                print(f"cpu P {p} mode {mode} main_cpu_ms {span('main_cpu_ms')} main_runnable_ms "
                      f"{span('main_runnable_ms')} preempted {span('main_preempted')} daemon_cpu_ms "
                      f"{span('daemon_cpu_ms')} ms_per_layer {span('ms_per_layer')}", flush=True)
            for mount, (n, buffered, changes, gbps, arms) in (extra.get("load_readers_after") or {}).items():
                tried = " ".join(f"{r}{'b' if b else 'd'} {g}{'*' if h else ''}" for r, b, g, h in arms)
                print(f"readers P {p} mode {mode} mount {mount} readers {n} buffered {bool(buffered)} "
                      f"changes {changes} measured {gbps} GB/s arms [{tried}]", flush=True)

        if "bound" in a.modes:
            self.bound(p, tokens, ref_kv, load_mode)

        if "whole" in a.modes:
            def whole(failures):
                self._wait(self.c.load(self.cache_id, keys, blocks), nkeys, failures)
                return self.model.forward(tokens[p:], p, self.cache, self.table, window_table=self.window_table(p)), p
            load_mode("whole", whole)

        if {"layerwise", "layerjobs", "split"} & set(a.modes):
            conn = self.connector
            conn.save(p, self.table_list[:p // self.cfg.block_tokens])
            conn.hashes(p, tokens.shape[0])  # as vLLM, before the request is timed
            if a.corrupt_stored:
                corrupt_newest(a.dir)
            rep["settle_s"].append(settle(self.metrics))
            if "layerwise" in a.modes:
                sched = conn.scheduler(load_split="all")
                look = Lookups(conn, p, tokens.shape[0], a.lookups) if a.lookups else None
                try:
                    if look:
                        look.idle()
                        look.start()
                    trace = DaemonTrace(self.metrics, a.daemon_trace, a.daemon_trace_seconds) \
                        if a.daemon_trace and p == max(a.sizes) else None
                    load_mode("layerwise", lambda f: conn.request(sched, p, tokens, f), trace)
                    # At least --lookups samples beside loads: more
                    # layer-wise requests (untimed) while the count is short.
                    extra = 0
                    while look and look.count() < a.lookups and extra < 20 * a.lookups:
                        self.poison(p)
                        conn.request(sched, p, tokens, [])
                        extra += 1
                    self.layer_ready, self.phases, self.load_jobs = [], {}, []  # theirs, reported by no mode
                    rep["lookup_extra_requests"] = extra
                finally:
                    if look:
                        rep["lookups"] = look.stop()
                    sched.shutdown()
            if "layerjobs" in a.modes:
                # The same layer-wise load jobs, waited for before the
                # suffix computes: against whole, what cutting the load
                # into layer jobs costs with no forward pass beside them.
                sched = conn.scheduler(load_split="all")
                try:
                    load_mode("layerjobs", lambda f: conn.request(sched, p, tokens, f, overlap=False))
                finally:
                    sched.shutdown()
            if "split" in a.modes and {"recompute", "suffix", "whole"} <= set(modes):
                costs = split_costs(p, s, half, self.cfg.kv_bytes(p), modes)
                rep["split_costs"] = costs
                sched = conn.scheduler(load_split="auto", **costs)
                rep["split_model"] = split_optimum(p, s, a.tokens_per_key, sched.cost_model,
                                                   modes["recompute"]["median_ms"])
                try:
                    load_mode("split", lambda f: conn.request(sched, p, tokens, f))
                finally:
                    sched.shutdown()

        if "llmd" in a.modes and a.llmd:
            self.llmd(p, tokens, blocks, ref, ref_kv, load_mode)

        self._ratios(rep)
        if not a.keep_stored:
            self.c.delete(self.ns, keys)

    def bound(self, p, tokens, ref_kv, load_mode):
        """The physical bound of a layer-wise hit, no daemon: the prefix's
        K/V in pinned host memory, one copy per layer on a side stream
        (into a device buffer of the layer's prefix), and each layer's
        attention waiting for its copy, then scattering it into the
        paged cache on the compute stream. What a load path can reach
        at best: it must still read the files and check them."""
        host = torch.empty(ref_kv.shape, dtype=ref_kv.dtype, pin_memory=self.cuda)
        host.copy_(ref_kv)
        staged = torch.empty_like(ref_kv)
        blocks = self.prefix_blocks(p)
        side = torch.cuda.Stream() if self.cuda else None
        events = [torch.cuda.Event() for _ in range(self.cfg.layers)] if self.cuda else None

        # A window layer needs only the blocks of its window.
        first = [self.window_first(p) if self.cfg.windowed(layer) else 0 for layer in range(self.cfg.layers)]

        def run(failures):
            if side is not None:
                with torch.cuda.stream(side):
                    for layer in range(self.cfg.layers):
                        staged[layer, :, first[layer]:].copy_(host[layer, :, first[layer]:], non_blocking=True)
                        events[layer].record(side)

            def wait(i):
                if side is not None:
                    torch.cuda.current_stream().wait_event(events[i])
                else:  # on the CPU (tests): the copy in line
                    staged[i, :, first[i]:].copy_(host[i, :, first[i]:])
                self.cache[i].index_copy_(1, blocks[first[i]:], staged[i, :, first[i]:])
            self.loaded_bytes = sum(host[layer, :, first[layer]:].numel() * host.element_size()
                                    for layer in range(self.cfg.layers))
            return self.model.forward(tokens[p:], p, self.cache, self.table, before_attention=wait,
                                      window_table=self.window_table(p)), p
        note = {}
        try:
            if self.a.warmup == 0:
                # The bound is the hardware's, not a first call's: without
                # warm-ups (a first load timed) one untimed run still pays
                # what any first run pays (allocations, kernels' first
                # launches): 140-154 ms at 32 K on the H200 where a warm
                # run takes 78.
                self.poison(p)
                run([])
                self.sync()
                note["untimed_runs"] = 1
            load_mode("bound", run, note=note)
        finally:
            del host, staged
            self.sync()

    def _check(self, logits, ref, oks, errs, failures=()):
        ok, rel = close(logits, ref)
        self.rel_errs.append(rel)
        failures = list(failures)
        if not ok:
            failures.append(f"logits differ from the recomputation's by {rel:.4g} of its norm")
        oks.append(not failures)
        errs.extend(failures)

    def _wait(self, job, nkeys, failures):
        try:
            res = job.wait(self.a.job_timeout)
        except (kvhost.KvhostError, kvhost.ConnectionLost, TimeoutError) as e:
            failures.append(f"load failed: {e}")
            return
        self.loaded_bytes = res.bytes
        if res.count(LOADED) != nkeys:
            failures.append(f"load: {res.count(LOADED)} of {nkeys} keys loaded ({res.outcomes()}; {res.message})")

    def llmd(self, p, tokens, blocks, ref, ref_kv, load_mode):
        """llm-d's engine loads the prefix from its own files into the same
        paged cache (each layer's K and V planes as two of its tensors),
        then the suffix is computed."""
        import storage_offload
        a, cfg = self.a, self.cfg
        tensors = [self.cache[l, pl].view(self.num_blocks, -1).view(torch.int16)
                   for l in range(a.layers) for pl in range(2)]
        bpf = a.tokens_per_key // cfg.block_tokens
        engine = storage_offload.StorageOffloadEngine(
            a.llmd_threads, bpf, tensors, [list(range(len(tensors)))], [len(tensors) * cfg.block_bytes],
            int(a.llmd_threads * 0.75), "disabled", 0.0)
        # Beside the daemon's directory (the same mount), not in it.
        d = f"{os.path.abspath(a.dir).rstrip('/')}-llmd-{self.run_id}-P{p}" if a.dir else \
            os.path.join(tempfile.gettempdir(), f"ttft-llmd-{self.run_id}-P{p}")
        paths = [os.path.join(d, f"k{i:05d}.bin") for i in range(len(blocks))]
        state = {"job": 0}

        def job(store, failures):
            state["job"] += 1
            submit = engine.async_store_gpu_blocks if store else engine.async_load_gpu_blocks
            t0 = time.perf_counter()
            ok = bool(submit(state["job"], [0] * len(paths), paths, blocks, [0] * len(paths)))
            flags = []
            while not flags:
                flags = [f for j, f in engine.get_finished() if j == state["job"]]
                if not flags and time.perf_counter() - t0 > a.job_timeout:
                    failures.append(f"llm-d job {state['job']} not finished after {a.job_timeout:g} s")
                    return
            if not (ok and all(flags)):
                failures.append(f"llm-d {'store' if store else 'load'} reported a failure")

        # Store the recomputation's K/V: a split before this left the
        # blocks past its K as its own computation made them (other
        # kernels, other bf16 roundings), not the reference's.
        self.cache.index_copy_(2, self.prefix_blocks(p), ref_kv)
        self.sync()
        failures = []
        job(True, failures)
        if failures:
            raise SystemExit(f"ttft-bench: {failures[0]}")

        def run(failures):
            job(False, failures)
            return self.model.forward(tokens[p:], p, self.cache, self.table), p
        try:
            load_mode("llmd", run)
        finally:
            shutil.rmtree(d, ignore_errors=True)

    def _ratios(self, rep):
        m = rep["modes"]
        med = {k: v["median_ms"] for k, v in m.items() if "median_ms" in v}  # disk is a rate
        ratios, s, p = {}, rep["S"], rep["P"]
        if {"suffix", "h2d"} <= set(med):
            ceiling = max(med["h2d"], med["suffix"])
            for mode in ("bound", "layerwise"):
                if mode in med:
                    ratios[f"{mode}/max(h2d,suffix)"] = med[mode] / ceiling
        if "bound" in med:
            for mode in ("whole", "layerwise", "layerjobs", "split", "llmd"):
                if mode in med:
                    ratios[f"{mode}/bound"] = med[mode] / med["bound"]
                    # every repetition against the bound's median: the range
                    ratios[f"{mode}/bound_reps"] = [x / med["bound"] for x in m[mode]["reps_ms"]]
        if {"bound", "layerwise"} <= set(med):
            r = ratios["layerwise/bound"]
            rep["bound"] = {"bound_ms": med["bound"], "limit": BOUND, "met": r <= BOUND}
            lo, hi = min(ratios["layerwise/bound_reps"]), max(ratios["layerwise/bound_reps"])
            print(f"bound P {p} S {s} layerwise/bound {r:.2f} (reps {lo:.2f}-{hi:.2f}) bound_ms {med['bound']:.1f} "
                  f"limit {BOUND} met {r <= BOUND}")
        disk = m.get("disk", {}).get("ceiling_gbps")
        if disk and "suffix" in med:
            # A whole load's rate (its bytes over its time beyond the
            # suffix's), and llm-d's, against the plain reads' ceiling:
            # medians against a median.
            for mode in ("whole", "llmd"):
                if mode in med and med[mode] > med["suffix"]:
                    gbps = self.cfg.kv_bytes(p) / (med[mode] - med["suffix"]) / 1e6
                    ratios[f"{mode}_gbps"] = gbps
                    ratios[f"{mode}_gbps/disk"] = gbps / disk
                    print(f"disk P {p} S {s} {mode}_gbps {gbps:.2f} {mode}/disk {gbps / disk:.2f} "
                          f"disk_gbps {disk:.2f} best_single_gbps {m['disk']['best_gbps']:.2f}", flush=True)
        for mode in ("whole", "layerwise", "split", "llmd"):
            if mode in med and "recompute" in med:
                ratios[f"{mode}/recompute"] = med[mode] / med["recompute"]
        lw = m.get("layerwise", {}).get("loaded_bytes_reps")
        if self.cfg.window and lw and m.get("whole", {}).get("loaded_bytes_reps"):
            # What the window layers save: the connector's bytes against a
            # load of every layer's whole prefix (whole) and the bound's.
            whole = m["whole"]["loaded_bytes_reps"][-1]
            ratios["layerwise_bytes/whole_bytes"] = lw[-1] / whole
            bound = m.get("bound", {}).get("loaded_bytes_reps")
            print(f"bytes P {p} S {s} layerwise {lw[-1]} whole {whole} layerwise/whole {lw[-1] / whole:.3f}"
                  + (f" bound {bound[-1]}" if bound else ""), flush=True)
        if "split" in med:
            opt = rep.get("split_model", {})
            k = m["split"]["loaded_tokens"]
            # The measured split against its model: each repetition at the
            # tokens it loaded (how well the model priced them; the median
            # of those ratios) and at its optimum.
            nan = float("nan")
            priced = opt.get("modelled_ms", {})
            at = [ms / priced[kr] for ms, kr in zip(m["split"]["reps_ms"], m["split"]["loaded_tokens_reps"])
                  if priced.get(kr)]
            if at:
                ratios["split/modelled_at_split_tokens"] = statistics.median(at)
            if opt.get("optimum_ms"):
                ratios["split/modelled_optimum"] = med["split"] / opt["optimum_ms"]
            if opt.get("at_rate_optimum_ms"):
                ratios["split/optimum_at_rate"] = med["split"] / opt["at_rate_optimum_ms"]
            print(f"ratio P {p} S {s} split/recompute {ratios['split/recompute']:.2f} "
                  f"split_tokens {k} modelled_optimum/recompute "
                  f"{opt.get('optimum_ratio', nan):.2f} at_tokens {opt.get('optimum_tokens')} "
                  f"split/modelled_at_split_tokens {ratios.get('split/modelled_at_split_tokens', nan):.2f} "
                  f"split/modelled_optimum {ratios.get('split/modelled_optimum', nan):.2f} rate_margin "
                  f"{opt.get('rate_margin', nan):g} split/optimum_at_rate {ratios.get('split/optimum_at_rate', nan):.2f} "
                  f"at_rate_tokens {opt.get('at_rate_optimum_tokens')}")
        rep["ratios"] = ratios


def solve(rows, rhs):
    """x with rows x = rhs (Gaussian elimination, partial pivoting); None
    where the rows are singular."""
    n = len(rhs)
    m = [list(r) + [v] for r, v in zip(rows, rhs)]
    for c in range(n):
        piv = max(range(c, n), key=lambda r: abs(m[r][c]))
        if m[piv][c] == 0:
            return None
        m[c], m[piv] = m[piv], m[c]
        for r in range(n):
            if r != c:
                f = m[r][c] / m[c][c]
                m[r] = [x - f * y for x, y in zip(m[r], m[c])]
    return [m[r][n] / m[r][r] for r in range(n)]


def split_costs(p, s, half, prefix_bytes, modes):
    """The connector's cost options for the split at prefix p, suffix s,
    fitted to this run: the load rate and latency its layer-wise loads
    showed as the connector learns them (the jobs' load_jobs timeline),
    else whole load's rate (its time less the suffix's compute) and no
    latency, and the prefill model compute(T, K) = fixed + a (T - K) +
    b (T^2 - K^2) / 2 (T = p + s) through the computations measured
    with K cached: recompute (K = 0), half (K = half) and suffix (K = p).
    The fit is a least-squares one in relative error over the terms that
    come out >= 0 (every subset of the three is tried, the closest kept):
    on the H200 the attention term dominates so much that an exact fit
    through the points gives a negative linear term, and dropping the
    quadratic one instead (every token alike) made the split claim a
    third too few tokens."""
    t = p + s
    ms = {"recompute": 0, "half": half, "suffix": p}
    pts = [(ms[m], modes[m]["median_ms"] / 1e3) for m in ("recompute", "half", "suffix") if m in modes]
    gbps = prefix_bytes / max(modes["whole"]["median_ms"] / 1e3 - modes["suffix"]["median_ms"] / 1e3, 1e-6) / 1e9
    latency_s = 0.0
    jobs = modes.get("layerwise", {}).get("load_jobs")
    if jobs and modes["layerwise"].get("ok") and all(j["daemon_ms"] is not None for j in jobs):
        # What the connector learns of its own layer-wise loads (the last
        # repetition's jobs): the step's seconds are the daemon's, from
        # the first submission to the end of its longest job, at most to
        # the last wait's return; the rate and latency are load_measure's
        # of them and the first layer group's bytes and longest job.
        from kvhost.vllm._split import load_measure
        step_ms = min(max(j["waited_ms"] for j in jobs), max(j["sent_ms"] for j in jobs)
                      + max(j["daemon_ms"] for j in jobs))
        first = [j for j in jobs if j["group"] == jobs[0]["group"]]
        nbytes, seconds, latency = load_measure(sum(j["bytes"] for j in jobs), max(step_ms / 1e3, 1e-6),
                                                sum(j["bytes"] for j in first), max(j["daemon_ms"] for j in first) / 1e3)
        if nbytes > 0:  # else the whole load's rate
            gbps = nbytes / seconds / 1e9
        latency_s = latency or 0.0
    terms = [lambda k: 1.0, lambda k: float(t - k), lambda k: (t * t - k * k) / 2.0]
    coef, best = None, None
    for mask in range(1, 8):
        use = [i for i in range(3) if mask >> i & 1]
        if len(use) > len(pts):
            continue
        rows = [[terms[i](k) / v for i in use] for k, v in pts]  # relative error: each point divided by itself
        ata = [[sum(r[i] * r[j] for r in rows) for j in range(len(use))] for i in range(len(use))]
        atb = [sum(r[i] for r in rows) for i in range(len(use))]
        x = solve(ata, atb)
        if x is None or min(x) < 0:
            continue
        res = sum((sum(c * r[j] for j, c in enumerate(x)) - 1.0) ** 2 for r in rows)
        if best is None or res < best:
            best, coef = res, [0.0, 0.0, 0.0]
            for j, i in enumerate(use):
                coef[i] = x[j]
    if coef is None:  # every token alike
        coef = [0.0, pts[0][1] / t, 0.0]
    return {"load_gbps": gbps, "load_latency_ms": latency_s * 1e3, "prefill_fixed_ms": coef[0] * 1e3,
            "prefill_us_per_token": coef[1] * 1e6, "prefill_ns_per_token2": coef[2] * 1e9}


def split_optimum(p, s, chunk, model, recompute_ms):
    """What the split's own cost model (model: the scheduler's CostModel,
    with this run's rates, before any request taught it) says is best:
    the K of least modelled TTFT over every chunk boundary (and K = 0),
    that TTFT, its ratio to the measured recomputation (the figure a
    measured split is held against), the K the model chooses
    (CostModel.split: the largest within split_min_gain of its least,
    pricing every K with the whole hit's layer groups, where the optimum
    and modelled_ms price each K with its own) and the modelled TTFT of
    every K, all with the loads priced as the split prices them (the
    rate less its rate_margin); and beside them the optimum at the rate
    itself (at_rate_*: the margin taken as 0)."""
    def prices(m):
        return {k: m.ttft_s(p + s, 0, k) * 1e3 for k in range(0, p + 1, chunk)}
    priced = prices(model)
    best = min(priced, key=priced.get)
    unhedged = copy.copy(model)  # the scheduler's model stays as it is
    unhedged.rate_margin = 0.0
    at_rate = prices(unhedged)
    best_at_rate = min(at_rate, key=at_rate.get)
    return {"optimum_tokens": best, "optimum_ms": priced[best], "optimum_ratio": priced[best] / recompute_ms,
            "chosen_tokens": model.split(p + s, 0, p, chunk), "modelled_ms": priced, "rate_margin": model.rate_margin,
            "at_rate_optimum_tokens": best_at_rate, "at_rate_optimum_ms": at_rate[best_at_rate]}


def block_hashes(names):
    """Block hashes chained as vLLM chains them (here from names, not
    tokens)."""
    out, prev = [], b""
    for n in names:
        prev = hashlib.sha256(prev + n.encode()).digest()
        out.append(prev)
    return out


class Request:
    """What the connector's scheduler half reads of vLLM's Request: its
    block hashes (block_hashes), which vLLM computes as the request
    arrives, before the scheduler sees it."""

    def __init__(self, req_id, hashes, tokens):
        self.request_id = req_id
        self.block_hashes = list(hashes)
        self.num_prompt_tokens = self.num_tokens = tokens
        self.skip_reading_prefix_cache = False


class Lookups:
    """Times the connector's scheduler-side lookup, get_num_new_matched_tokens
    of a prompt of the prefix and the suffix (all of the prefix cached),
    as vLLM's scheduler asks it for a waiting request, in a process of its
    own (vLLM's scheduler is a process apart from its workers): n calls
    back to back with nothing else running (idle), n calls one every
    200 us with nothing else running (idle spaced: what the pauses alone
    cost), then one call every 200 us while the layer-wise loads run
    (beside loads; the bench runs more layer-wise requests until there
    are at least n)."""

    def __init__(self, conn, p, tokens, n):
        import multiprocessing
        ctx = multiprocessing.get_context("spawn")  # no fork of a process holding CUDA
        self.p = p
        self.pipe, child = ctx.Pipe()
        req = Request(f"lookups-{p}", conn.hashes(p, tokens), tokens)
        kvc = (conn.group_names(), 2 * conn.bench.cfg.block_bytes, conn.bench.cfg.window) if conn.hybrid else None
        self.proc = ctx.Process(target=lookup_process, daemon=True,
                                args=(child, conn.config(save=False, load_split="all"), req, n, kvc))
        self.proc.start()
        child.close()

    def _recv(self, what):
        if not self.pipe.poll(120):
            raise SystemExit(f"ttft-bench: the lookup process sent no {what} in 120 s")
        msg = self.pipe.recv()
        if isinstance(msg, BaseException):
            raise SystemExit(f"ttft-bench: the lookup process failed: {msg!r}")
        return msg

    def idle(self):
        self._recv("idle lookups")  # sent once the back-to-back calls ran

    def start(self):
        self.pipe.send("go")
        self._recv("start of the lookups beside loads")

    def count(self):
        """The lookups timed beside loads so far."""
        self.pipe.send("count")
        return self._recv("count")

    def stop(self):
        self.pipe.send("stop")
        out = self._recv("results")
        self.proc.join(30)
        i, sp, b = out["idle"], out["idle_spaced"], out["beside_loads"]
        print(f"lookup P {self.p} tokens {out['claimed_tokens']} idle p50_us {i.get('p50_us', 0):.1f} p99_us "
              f"{i.get('p99_us', 0):.1f} n {i['n']} beside_loads p50_us {b.get('p50_us', 0):.1f} p99_us "
              f"{b.get('p99_us', 0):.1f} n {b['n']} idle_spaced p50_us {sp.get('p50_us', 0):.1f} p99_us "
              f"{sp.get('p99_us', 0):.1f} n {sp['n']} (own process)", flush=True)
        return out


def lookup_process(pipe, config, req, n, kvc=None):
    """The body of Lookups' process: a scheduler half of config, req's
    lookups timed, driven and answered through pipe."""
    try:
        from kvhost.vllm import connector
        sched = connector.connector_class(types.SimpleNamespace(KVConnectorBase_V1=None))(
            None, "scheduler", kv_cache_config=hybrid_kv_cache_config(*kvc) if kvc else None, config=config)
        want, changed = None, 0

        def one():
            nonlocal want, changed
            t0 = time.perf_counter_ns()
            k, _ = sched.get_num_new_matched_tokens(req, 0)
            dt = time.perf_counter_ns() - t0
            if want is None:
                want = k
            elif k != want:
                changed += 1  # a key dropped meanwhile (a corrupt file): counted, not timed apart
            return dt / 1e3

        one()  # the request's keys, made once as vLLM's request state keeps them
        idle = [one() for _ in range(n)]
        spaced = []  # one every 200 us, nothing else running: what the pauses alone cost
        while len(spaced) < max(1, n) and not pipe.poll(200e-6):
            spaced.append(one())
        pipe.send("idle")
        pipe.recv()  # go
        busy = [one()]
        pipe.send("started")
        while True:
            if not pipe.poll(200e-6):
                busy.append(one())
            elif pipe.recv() == "count":
                pipe.send(len(busy))
            else:
                break  # stop
        sched.shutdown()
        out = {"claimed_tokens": want, "claims_changed": changed, "process": "own"}
        for name, xs in (("idle", idle), ("idle_spaced", spaced), ("beside_loads", busy)):
            xs = sorted(xs)
            out[name] = {"n": len(xs), "p50_us": xs[len(xs) // 2], "p99_us": xs[min(len(xs) - 1, len(xs) * 99 // 100)],
                         "max_us": xs[-1]} if xs else {"n": 0}
        pipe.send(out)
    except BaseException as e:  # reported to the bench, which fails
        pipe.send(e)


class Connector:
    """KvhostConnector (kvhost.vllm) without vLLM: its worker half over the
    bench's cache, its scheduler halves, driven in vLLM's call order. The
    prefix is saved through the save path (a request of the prefix alone);
    a timed request is the prefix and a suffix of new blocks, whose load
    the scheduler splits and the worker loads layer by layer, each layer
    waiting in wait_for_layer_load right before its attention."""

    def __init__(self, bench, socket):
        from kvhost.vllm import connector
        self.bench, self.socket, a = bench, socket, bench.a
        self.cls = connector.connector_class(types.SimpleNamespace(KVConnectorBase_V1=None))
        self.names = [f"model.layers.{i}.self_attn.attn" for i in range(a.layers)]
        self.hybrid = bool(bench.cfg.window)
        self.requests = 0
        self._hashes = {}  # (prefix, tokens) -> block hashes (hashes)
        self.worker = self.make("worker")
        self.worker.register_kv_caches({n: bench.cache[i] for i, n in enumerate(self.names)})

    def group_names(self):
        """The layer names of each KV-cache group: one group, or with
        --window the full-attention (odd) layers and the window (even)
        ones, as vLLM groups a gpt-oss-like model."""
        if not self.hybrid:
            return [self.names]
        cfg = self.bench.cfg
        return [[n for i, n in enumerate(self.names) if not cfg.windowed(i)],
                [n for i, n in enumerate(self.names) if cfg.windowed(i)]]

    def make(self, role, **extra):
        """A connector half of role with extra options; with --window, given
        vLLM's KVCacheConfig of the two groups (kv_cache_config)."""
        kvc = hybrid_kv_cache_config(self.group_names(), 2 * self.bench.cfg.block_bytes, self.bench.cfg.window) \
            if self.hybrid else None
        return self.cls(None, role, kv_cache_config=kvc, config=self.config(**extra))

    def config(self, **extra):
        """An object shaped like vLLM's OffloadingConfig (what the
        connector reads of it), with extra connector options."""
        ns, a, cfg = types.SimpleNamespace, self.bench.a, self.bench.cfg
        return ns(model=ns(name=f"ttft-bench/random-llama-{a.layers}x{a.hidden}-seed{a.seed}{model_suffix(a)}", dtype="bfloat16"),
                  parallel=ns(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                              is_parallelism_agnostic=False),
                  groups=tuple(ns(tokens_per_block=cfg.block_tokens, layer_names=tuple(g)) for g in self.group_names()),
                  cache=ns(tokens_per_hash=cfg.block_tokens, blocks_per_chunk=a.tokens_per_key // cfg.block_tokens),
                  worker_kv_bytes_per_block=a.layers * 2 * cfg.block_bytes, engine_id="ttft-bench",
                  canonical_layout=False, replicated_layout=False,
                  extra_config={"socket": self.socket, "tensor_layout": "planes", "layers_per_load": a.layers_per_load,
                                "layer_groups": a.layer_groups,
                                "load_timeout_s": a.job_timeout, "job_timeout_s": a.job_timeout, **extra})

    def scheduler(self, **extra):
        """A scheduler half that saves nothing (a timed request's suffix
        stays uncached: every repetition finds the same prefix)."""
        return self.make("scheduler", save=False, **extra)

    def _names(self, p, tokens):
        bt = self.bench.cfg.block_tokens
        run = self.bench.run_id
        return [f"{run}-{p}-{i}" if i < p // bt else f"{run}-{p}-suffix-{i}" for i in range(tokens // bt)]

    def hashes(self, p, tokens):
        """The block hashes of a request of tokens whose first p are the
        prefix, made once: vLLM hashes a request's blocks as it arrives
        (add_request), before any mode computes or loads them, so no
        mode's clock includes them (2,048 SHA-256 in Python: about 2 ms
        at 32 K)."""
        key = (p, tokens)
        if key not in self._hashes:
            self._hashes[key] = block_hashes(self._names(p, tokens))
        return self._hashes[key]

    def _step(self, sched, out, forward=None, finished=(), mark=lambda name: None):
        """One engine step in vLLM's order; returns (forward's value, load
        error block ids, requests whose saves ended). mark(name) notes
        when each part of the step ended (a request's phases)."""
        meta = sched.build_connector_meta(out)
        mark("meta_built")
        w, names = self.worker, self.names
        w.handle_preemptions(meta)
        w.bind_connector_metadata(meta)
        w.start_load_kv(None)
        mark("loads_submitted")
        value = None
        if forward is None:
            for n in names:
                w.wait_for_layer_load(n)
                w.save_kv_layer(n, None, None)
        else:
            value = forward(lambda i: w.wait_for_layer_load(names[i]), lambda i: w.save_kv_layer(names[i], None, None))
        w.wait_for_save()
        mark("saves_waited")
        sending, _ = w.get_finished(set(finished))
        errors = w.get_block_ids_with_load_errors()
        wm = w.build_connector_worker_meta()
        w.clear_connector_metadata()
        mark("worker_done")
        sched.update_connector_output(types.SimpleNamespace(kv_connector_worker_meta=wm, finished_sending=sending))
        mark("output_taken")
        return value, errors, sending or set()

    @staticmethod
    def _output(req=None, blocks=(), computed=0, scheduled=0, finished=()):
        """vLLM's SchedulerOutput of a step scheduling req, blocks per
        KV-cache group (a tuple of lists)."""
        ns = types.SimpleNamespace
        new = [] if req is None else [ns(req_id=req.request_id, block_ids=tuple(list(b) for b in blocks),
                                         num_computed_tokens=computed)]
        return ns(scheduled_new_reqs=new, scheduled_cached_reqs=None,
                  num_scheduled_tokens={} if req is None else {req.request_id: scheduled},
                  preempted_req_ids=set(), finished_req_ids=set(finished))

    def save(self, p, blocks):
        """Saves the prefix of p tokens (in blocks, computed) through the
        save path, and returns once its stores ended."""
        sched = self.make("scheduler")
        try:
            req = Request(f"save-{p}", self.hashes(p, p), p)
            sched.get_num_new_matched_tokens(req, 0)
            groups = tuple(list(blocks) for _ in self.group_names())  # every group's blocks still held
            sched.update_state_after_alloc(req, groups, 0)
            self._step(sched, self._output(req, groups, 0, p))
            self.finished(sched, req, groups)
            deadline = time.monotonic() + self.bench.a.job_timeout
            while req.request_id not in self._step(sched, self._output(), finished={req.request_id})[2]:
                if time.monotonic() > deadline:
                    raise SystemExit(f"ttft-bench: the connector's saves of P {p} not done after "
                                     f"{self.bench.a.job_timeout:g} s")
                time.sleep(0.001)
        finally:
            sched.shutdown()

    def request(self, sched, p, tokens, failures, overlap=True):
        """A request of the prefix and the suffix through sched and the
        worker, computing what the scheduler did not claim; returns (the
        last token's logits, the tokens loaded). overlap=False waits for
        every layer's load before the forward pass begins."""
        b = self.bench
        self.requests += 1
        n = tokens.shape[0]
        # Hashed before the clock (hashes): vLLM hashes a request's blocks
        # as it arrives, whatever then computes or loads them.
        req = Request(f"ttft-{p}-{self.requests}", self.hashes(p, n), n)
        blocks = b.table_list[:(n + b.cfg.block_tokens - 1) // b.cfg.block_tokens]
        t0, ready, phases = time.perf_counter(), [], {}

        def mark(name):
            phases[name] = round((time.perf_counter() - t0) * 1e3, 2)
        k, _ = sched.get_num_new_matched_tokens(req, 0)
        # The window group holds vLLM's null block before the window of
        # the tokens cached (what it frees): the load skips those.
        groups = (blocks, b.window_list(k, len(blocks))) if self.hybrid else (blocks,)
        sched.update_state_after_alloc(req, groups, k)
        mark("scheduled")
        before_bytes = self.worker.counters().get("bytes_loaded", 0)

        def forward(before, after):
            def wait(i):
                if not ready:
                    mark("first_wait")
                before(i)
                ready.append(round((time.perf_counter() - t0) * 1e3, 2))
            hooks = {"before_attention": wait, "after_attention": after}
            if not overlap:
                for i in range(b.cfg.layers):
                    wait(i)
                mark("loads_waited")
                hooks = {"after_attention": after}
            out = b.model.forward(tokens[k:], k, b.cache, b.table, window_table=b.window_table(k), **hooks)
            mark("forward_issued")
            return out
        logits, errors, _ = self._step(sched, self._output(req, groups, k, n - k), forward, mark=mark)
        self.finished(sched, req, groups)
        mark("finished")
        b.loaded_bytes = self.worker.counters().get("bytes_loaded", 0) - before_bytes
        b.sync()
        mark("synchronized")
        b.layer_ready, b.phases, b.load_jobs = ready, phases, self.worker.load_timeline()
        if errors:
            failures.append(f"the connector reported load errors in {len(errors)} blocks")
        return logits, k

    def finished(self, sched, req, groups):
        """vLLM's call when req finishes: request_finished_all_groups for a
        model of several KV-cache groups (the connector is SupportsHMA),
        request_finished otherwise."""
        if self.hybrid:
            return sched.request_finished_all_groups(req, groups)
        return sched.request_finished(req, groups[0])

    def shutdown(self):
        self.worker.shutdown()


def hybrid_kv_cache_config(groups, page, window):
    """vLLM's KVCacheConfig of a gpt-oss-like model as the connector reads
    it: a full-attention group and a sliding-window group (layer names
    per group in groups)."""
    return vllm_specs.kv_cache_config(zip(groups, (vllm_specs.FullAttentionSpec(page),
                                                   vllm_specs.SlidingWindowSpec(page, window))))


def machine(a, bench):
    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "device": str(bench.dev), "attention": bench.model.attention.kind, "rms_norm": bench.model.norm_kind,
           "cuda_graphs": (f"piecewise, passes of {a.suffix} tokens" if bench.graphs else "none: every pass eager"),
           "rope": "bf16 (cos and sin cast to bf16)", "host": platform.node(),
           "cpus": os.cpu_count()}
    if bench.cuda:
        out["gpu"] = torch.cuda.get_device_name(bench.dev)
    if a.dir:
        mnt, fstype, dev = mount_of(a.dir)
        st = os.statvfs(a.dir)
        out["mount"] = {"dir": os.path.abspath(a.dir), "mount_point": mnt, "fs_type": fstype, "device": dev,
                        "size_bytes": st.f_blocks * st.f_frsize, "free_bytes": st.f_bavail * st.f_frsize}
    return out


def main(argv=None):
    a = parse_args(argv)
    if a.llmd:
        sys.path.insert(0, a.llmd)
    daemon = metrics = None
    if not a.socket:
        from daemon import Daemon
        # The daemon's metrics, for settle: the listener --daemon-toml
        # names, else one of its own on a free port.
        toml = a.daemon_toml.replace("\\n", "\n")
        given = re.search(r'\[metrics\][^\[]*?listen\s*=\s*"([^"]+)"', toml)
        if given:
            metrics = given[1]
        elif "[metrics]" not in toml:  # (a [metrics] table without a listener: not asked)
            with socketlib.socket() as sk:
                sk.bind(("127.0.0.1", 0))
                metrics = f"127.0.0.1:{sk.getsockname()[1]}"
            a.daemon_toml += f'\\n[metrics]\\nlisten = "{metrics}"\\n'
            if a.daemon_trace:
                a.daemon_toml += 'profiling = true\\n'
        os.environ["KVHOST_BIN"] = a.kvhost_bin
        kv = sum(Config(layers=a.layers, kv_heads=a.kv_heads, head_dim=a.head_dim).kv_bytes(p) for p in a.sizes)
        os.makedirs(a.dir, exist_ok=True)
        # Room for the prefixes twice (the client's keys and the connector's), and as much again.
        daemon = Daemon(capacity=a.capacity or f"{(4 * kv >> 20) + 64}MiB", dir=os.path.abspath(a.dir),
                        extra_toml=(f"[engine]\nio_workers = {a.io_workers}\n" if a.io_workers else "") +
                        (f"[gpu]\nregister_files = {a.register_files}\n" if a.register_files is not None else "") +
                        a.daemon_toml.replace("\\n", "\n") +
                        (f'\n[objects]\nendpoint = "{a.objects}"\nbucket = "{a.objects_bucket}"\ncreate_bucket = true\n'
                         if a.objects else ""),
                        after_toml=a.mount_toml.replace("\\n", "\n"),
                        policy_toml=a.policy_toml.replace("\\n", "\n"))
    up = time.monotonic()  # the daemon started here answers from now
    try:
        with kvhost.Client(daemon.socket if daemon else a.socket, name="ttft-bench", timeout=a.job_timeout) as c:
            bench = Bench(a, c, daemon.socket if daemon else a.socket, metrics)
            if daemon and metrics:
                bench.registrations = Registrations(metrics, up)
            if daemon:
                bench.daemon_pid = daemon.proc.pid
            layerwise = (f"layer-range loads, {a.layers_per_load} layer(s) per job ({a.layer_groups})" if bench.layer_loads else
                         "one load job (no connector, or a daemon without layer-range loads)")
            print(f"detail: model {a.layers} layers hidden {a.hidden} heads {a.heads}/{a.kv_heads}x{a.head_dim} "
                  f"mlp {a.mlp} vocab {a.vocab}"
                  f"{f'; even layers a sliding window of {a.window} tokens' if a.window else ''}; "
                  f"attention: {bench.model.attention.kind}; "
                  f"rms_norm: {bench.model.norm_kind}; cuda graphs: "
                  f"{f'piecewise, {a.suffix}-token passes' if bench.graphs else 'none'}; layerwise: {layerwise}; "
                  f"reps {a.reps} (ms = median) after {a.warmup} warm-up; cold {a.cold}; blocks {a.blocks}", flush=True)
            bench.report.update(machine=machine(a, bench), args=vars(a), layer_loads=bench.layer_loads,
                                tolerance={"rel_l2": TOL}, statistic="median and best of reps")
            # As vLLM's engine core and GPU workers do once started
            # (freeze_gc_heap): the heap built so far (torch, the model, the
            # connector) is left out of the collector's scans, whose pauses
            # would otherwise land in timed requests.
            gc.collect()
            gc.freeze()
            bench.report["machine"]["gc"] = "heap frozen after setup (gc.freeze), as vLLM's worker"
            try:
                for p in a.sizes:
                    bench.run_size(p)
            finally:
                if bench.connector:
                    bench.connector.shutdown()
            if a.json:
                with open(a.json, "w") as f:
                    json.dump(bench.report, f, indent=1, default=str)
    except BaseException:
        if daemon:  # what the daemon said, for the failure's cause
            print("detail: the daemon's log, last lines:\n" + "\n".join(daemon.logs().splitlines()[-15:]), flush=True)
        raise
    finally:
        if daemon:
            daemon.stop()
    return 1 if bench.failed else 0


if __name__ == "__main__":
    sys.exit(main())
