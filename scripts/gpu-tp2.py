#!/usr/bin/env python3
"""One kvhost daemon serving a tensor-parallel engine (TP = 2): one worker
process per GPU, each with its shard of the paged KV cache, storing and
loading alone and at once, every loaded byte compared (issue 87).

    gpu-tp2.py --dir DIR [--pinned] [--llmd MODDIR] [--json FILE]
               [--ranks 2] [--keys 128] [--tokens-per-key 256] [--reps 3] ...
    gpu-tp2.py --socket SOCK [--dir DIR] ...

The driver starts a daemon on DIR (client/python/tests/daemon.py with a
TOML configuration, the binary from --kvhost-bin; --socket names a running
one instead) and spawns --ranks worker processes (multiprocessing, spawn):
rank r works on device r % torch.cuda.device_count() (--device cpu: host
memory shared with the daemon, as the CPU tests register it). Each holds
its tensor-parallel shard of a Llama-3.1-8B-shaped bf16 paged cache as
vLLM's FlashAttention backend lays it out: one allocation of (layers, 2,
num_blocks, 16, kv_heads / ranks, head_dim), layer l's (2, num_blocks, 16,
heads, head_dim) K and V planes; 32 layers, 8 KV heads of 128 and 16-token
blocks by default, so a rank's key of 256 tokens is 16 MiB with two ranks.
Every rank registers it with the one daemon (CUDA IPC on a GPU), and its
blocks are filled with random bytes (new ones for every run). Keys are
stored from the first half of the blocks and loaded into the second half
(a permutation, the same on every rank, as vLLM's block tables are), whose
bytes are overwritten (poisoned) before each load; after each load every
byte of every loaded block is compared with its source.

Paths (--paths):

    client     the kvhost client directly: a rank's keys stored in --jobs
               store jobs at once, then loaded in as many load jobs
    connector  KvhostConnector's worker half (kvhost.vllm.connector) driven
               as vLLM drives it, as scripts/ttft-bench.py's Connector does:
               the driver holds the scheduler half (one for the engine, as
               vLLM's scheduler process) and sends each step's metadata to
               the ranks; a step saves --requests requests' blocks (the
               workers' wait_for_save, then get_finished until every
               request is reported), then another step loads them layer by
               layer into other blocks (start_load_kv, wait_for_layer_load
               per layer: --layers-per-load layers per job)
    llmd       (with --llmd MODDIR, a built llm-d storage_offload module as
               scripts/peer-llmd.py takes it) llm-d's engine, one per rank
               process over the same cache (each layer's K and V planes its
               tensors), its own files under DIR-llmd-rankR: one store job
               of the rank's keys, then one load job

Each path runs "alone" (rank 0 only, the other ranks idle) and "together"
(every rank), each rank starting its store (or load) on a shared event
once every rank has made its blocks ready; --reps times, alone and
together alternating which goes first, after --warmup reps (1: the
first runs of a path pay for what later ones find ready; checked, but not
in the figures). In the connector's alone runs the other ranks save the
same step after rank 0 (untimed): the scheduler claims a key only where
every rank holds it. A rank's GB/s is its bytes
over its own time (its first submission to its last completion, the
device synchronized); the total is every rank's bytes over the time from
the earliest start to the latest end.

Before the runs every rank stores --fill GiB of other keys (untimed; by
default as much as the capacity of the daemon started here, three times a
run's keys), so that the runs' stores land in a full cache and write into
the files it evicts, as on a node in use (kept as spares: registered with
CUDA where the daemon registers files) rather than into fresh files. The
runs' keys stay (the next runs evict them); llm-d's files are removed
after each run. --pause seconds pass between a store and its load and
between runs (the daemon registers files it has not registered yet in the
background).

The daemon started here serves DIR as one mount with registered tmpfs files
(the default: gpu.register_files) or, with --pinned, through the pinned
staging pipeline only (gpu.register_files = 0: no file registered with
CUDA). Output, one line per path, mode and op a script can read (the median
of the reps; ok False where any rep failed, differ the bytes that differed
in every rep together):

    tp2 path PATH mode MODE op OP ranks N gbps_rank G0,G1 gbps_total G ok True differ 0 pipeline registered

then per path and op the ratio of the totals, together over alone, and
with llmd each kvhost figure over llm-d's in the same mode:

    tp2 ratio path PATH op OP R pipeline registered
    tp2 vs_llmd path PATH mode MODE op OP rank R0,R1 total R pipeline registered

and "detail:" lines (each rep and rank). --json FILE writes every run of
every rank, the machine (GPU names, device count, torch, CUDA, NUMA
nodes, nvidia-smi's topology) and the daemon's device counts. The exit
status is 1 where any run failed, the warm-up's included: a key not
stored or not loaded, a connector load error, a byte that differs.
"""
import argparse
import importlib.util
import json
import multiprocessing
import os
import pathlib
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import types

REPO = pathlib.Path(__file__).resolve().parents[1]
for _p in (REPO / "client" / "python" / "tests", REPO / "scripts", REPO / "client" / "python" / "src"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import kvhost  # noqa: E402
from kvhost import memory, protocol  # noqa: E402
from gpu_paged import run_jobs, split  # noqa: E402

BLOCK_TOKENS = 16
MODEL = "gpu-tp2/meta-llama/Llama-3.1-8B-shape"
POISON = 0x5A
PATHS = ("client", "connector", "llmd")
MODES = ("alone", "together")
STORED = (protocol.OUTCOME_STORED, protocol.OUTCOME_PRESENT)
LOADED = protocol.OUTCOME_LOADED


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", help="the cache directory a daemon started here serves (e.g. /dev/shm/kvhost-tp2); "
                    "with --socket, the running daemon's (for --corrupt-stored) and llm-d's files beside it")
    ap.add_argument("--socket", help="a running daemon's socket instead of starting one")
    ap.add_argument("--kvhost-bin", default=os.environ.get("KVHOST_BIN") or str(REPO / "bin" / "kvhost"),
                    help="the daemon's binary ($KVHOST_BIN, else bin/kvhost)")
    ap.add_argument("--pinned", action="store_true",
                    help="the started daemon uses the pinned staging pipeline only (gpu.register_files = 0)")
    ap.add_argument("--capacity", type=float,
                    help="the started daemon's mount capacity in GiB (default: three times a run's keys)")
    ap.add_argument("--io-workers", type=int, default=0, help="the started daemon's engine.io_workers (0: default)")
    ap.add_argument("--metrics", help="the started daemon's metrics address (host:port): GPU path counters into "
                    "the report")
    ap.add_argument("--ranks", type=int, default=2, help="worker processes, one per tensor-parallel rank")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cuda: rank r on device r %% device count; cpu: host memory (tests)")
    ap.add_argument("--paths", default="client,connector", help="client, connector (llmd is added by --llmd)")
    ap.add_argument("--modes", default="alone,together")
    ap.add_argument("--keys", type=int, default=128, help="keys per rank and run")
    ap.add_argument("--tokens-per-key", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3, help="runs of each path and mode")
    ap.add_argument("--warmup", type=int, default=1,
                    help="untimed runs of each path and mode before them (checked, not in the figures)")
    ap.add_argument("--jobs", type=int, default=8, help="the client path's jobs per rank and op")
    ap.add_argument("--requests", type=int, default=4, help="the connector path's requests per step")
    ap.add_argument("--layers-per-load", type=int, default=4, help="the connector's layers_per_load")
    ap.add_argument("--layer-groups", default="ramp", choices=("ramp", "even"), help="the connector's layer_groups")
    ap.add_argument("--pause", type=float, default=1.0,
                    help="seconds between a store and its load, and between runs")
    ap.add_argument("--fill", default="auto",
                    help="GiB of untimed stores before the runs, so that their stores land in a full cache "
                         "(auto: the started daemon's capacity; 0 with --socket)")
    ap.add_argument("--llmd", help="directory of a built llm-d storage_offload module (adds the llmd path)")
    ap.add_argument("--llmd-threads", type=int, default=16, help="each rank's llm-d engine's I/O threads")
    ap.add_argument("--json", help="write the report here")
    ap.add_argument("--job-timeout", type=float, default=120, help="seconds a job may take")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--corrupt-stored", action="store_true",
                    help="a check of the checks (tests): flip a payload byte of the newest file under --dir after "
                         "each kvhost store; the run must then fail")
    for name, default in [("layers", 32), ("kv-heads", 8), ("head-dim", 128)]:
        ap.add_argument(f"--{name}", type=int, default=default,
                        help=f"model {name} (default {default}; KV heads in all, split over the ranks)")
    a = ap.parse_args(argv)
    a.paths = [p for p in a.paths.split(",") if p]
    if a.llmd and "llmd" not in a.paths:
        a.paths.append("llmd")
    a.modes = [m for m in a.modes.split(",") if m]
    bad = sorted(set(a.paths) - set(PATHS)) + sorted(set(a.modes) - set(MODES))
    if bad:
        ap.error(f"unknown paths or modes {bad}")
    if "llmd" in a.paths and not a.llmd:
        ap.error("the llmd path needs --llmd MODDIR")
    if not a.dir and not a.socket:
        ap.error("give --dir (a daemon is started there) or --socket")
    if (a.corrupt_stored or a.llmd) and not a.dir:
        ap.error("--corrupt-stored and --llmd need --dir")
    if a.pinned and a.socket:
        ap.error("--pinned configures the daemon started here: not with --socket")
    if a.ranks < 1 or a.keys < 1 or a.reps < 1 or a.jobs < 1 or a.requests < 1:
        ap.error("--ranks, --keys, --reps, --jobs and --requests: want >= 1")
    if a.warmup < 0:
        ap.error("--warmup: want >= 0")
    if a.kv_heads % a.ranks:
        ap.error(f"--kv-heads {a.kv_heads} do not split over {a.ranks} ranks")
    if a.tokens_per_key <= 0 or a.tokens_per_key % BLOCK_TOKENS:
        ap.error(f"--tokens-per-key {a.tokens_per_key}: want a positive multiple of {BLOCK_TOKENS}")
    a.requests = min(a.requests, a.keys)
    if a.fill == "auto":
        a.fill = None
    else:
        try:
            a.fill = float(a.fill)
        except ValueError:
            ap.error(f"--fill {a.fill!r}: want GiB or auto")
    return a


# -- what every process agrees on ---------------------------------------------


class Shape:
    """A rank's shard: blocks, bytes, and the block layout of the keys (the
    same on every rank and in the driver)."""

    def __init__(self, a):
        self.heads = a.kv_heads // a.ranks
        self.plane = BLOCK_TOKENS * self.heads * a.head_dim * 2  # one plane (K or V) of one block, one layer
        self.bpk = a.tokens_per_key // BLOCK_TOKENS
        # Block 0 (vLLM's null block, never a request's, which the connector
        # does not save), sources, destinations and one spare block.
        self.num_blocks = 2 * a.keys * self.bpk + 2
        self.key_bytes = a.layers * 2 * self.bpk * self.plane
        perm = list(range(1, 2 * a.keys * self.bpk + 1))
        random.Random(a.seed).shuffle(perm)
        n = a.keys * self.bpk
        self.src = [perm[i * self.bpk:(i + 1) * self.bpk] for i in range(a.keys)]
        self.dst = [perm[n + i * self.bpk:n + (i + 1) * self.bpk] for i in range(a.keys)]
        self.spare = self.num_blocks - 1


def client_geometry(a, rank):
    return kvhost.Geometry(model=MODEL, layers=a.layers, kv_heads=a.kv_heads // a.ranks, head_size=a.head_dim,
                           dtype_size=2, tokens_per_block=BLOCK_TOKENS, tokens_per_key=a.tokens_per_key,
                           tp_rank=rank, tp_size=a.ranks)


def layer_names(a):
    return [f"model.layers.{i}.self_attn.attn" for i in range(a.layers)]


def connector_config(a, rank, socket):
    """An object shaped like vLLM's OffloadingConfig for rank (what the
    connector reads of it; ttft-bench's Connector.config with TP)."""
    ns, sh = types.SimpleNamespace, Shape(a)
    return ns(model=ns(name=MODEL, dtype="bfloat16"),
              parallel=ns(rank=rank, world_size=a.ranks, tp_size=a.ranks, pp_size=1, pcp_size=1, dcp_size=1,
                          is_parallelism_agnostic=False),
              groups=(ns(tokens_per_block=BLOCK_TOKENS, layer_names=tuple(layer_names(a))),),
              cache=ns(tokens_per_hash=BLOCK_TOKENS, blocks_per_chunk=sh.bpk),
              worker_kv_bytes_per_block=a.layers * 2 * sh.plane, engine_id="gpu-tp2",
              canonical_layout=False, replicated_layout=False,
              extra_config={"socket": socket, "tensor_layout": "planes", "layers_per_load": a.layers_per_load,
                            "layer_groups": a.layer_groups, "load_split": "all",
                            "load_timeout_s": a.job_timeout, "job_timeout_s": a.job_timeout})


def connector_class():
    from kvhost.vllm import connector
    return connector.connector_class(types.SimpleNamespace(KVConnectorBase_V1=None))


# -- a rank's process -----------------------------------------------------------


class Rank:
    """One worker process: its shard of the cache, registered with the
    daemon by the client path's client and by the connector's worker, and
    its llm-d engine."""

    def __init__(self, rank, a, socket):
        import torch
        self.torch, self.rank, self.a = torch, rank, a
        self.sh = sh = Shape(a)
        self.cuda = a.device == "cuda"
        if self.cuda:
            if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
                raise SystemExit("gpu-tp2: --device cuda, but torch sees no GPU (--device cpu checks without one)")
            self.dev = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(self.dev)
        else:
            self.dev = torch.device("cpu")
        shape = (a.layers, 2, sh.num_blocks, BLOCK_TOKENS, sh.heads, a.head_dim)
        self.host_buf = None
        if self.cuda:
            self.cache = torch.empty(shape, dtype=torch.bfloat16, device=self.dev)
        else:
            self.cache, self.host_buf = memory.torch_host_tensor(shape, torch.bfloat16,
                                                                        name=f"gpu-tp2-rank{rank}")
        self.u8 = self.cache.view(torch.uint8)
        self.dst_index = torch.tensor([b for d in sh.dst for b in d], device=self.dev)
        self.c = kvhost.Client(socket, name=f"gpu-tp2-rank{rank}", timeout=a.job_timeout)
        if self.cuda:
            region = self.c.register_cuda_tensor(self.cache)
            base = self.cache.storage_offset() * self.cache.element_size()
        else:
            region, base = self.c.register_buffer(self.host_buf), 0
        self.ns = self.c.declare(client_geometry(a, rank))
        if self.ns.block_bytes != sh.plane or self.ns.key_bytes != sh.key_bytes:
            raise SystemExit(f"gpu-tp2: rank {rank}: the daemon's blocks are {self.ns.block_bytes} bytes and keys "
                             f"{self.ns.key_bytes}, the cache's {sh.plane} and {sh.key_bytes}")
        layer_bytes = 2 * sh.num_blocks * sh.plane
        self.cache_id = self.c.register_cache(self.ns, [
            kvhost.Layer(region, offset=base + l * layer_bytes, block_stride=sh.plane,
                         plane_stride=sh.num_blocks * sh.plane, num_blocks=sh.num_blocks)
            for l in range(a.layers)])
        self.names = layer_names(a)
        self.worker = None
        if "connector" in a.paths:
            self.worker = connector_class()(None, "worker", config=connector_config(a, rank, socket))
            self.worker.register_kv_caches({n: self.cache[l] for l, n in enumerate(self.names)})
        self.engine = None
        if "llmd" in a.paths:
            sys.path.insert(0, a.llmd)
            import storage_offload
            tensors = [self.cache[l, pl].view(sh.num_blocks, -1).view(torch.int16)
                       for l in range(a.layers) for pl in range(2)]
            self.engine = storage_offload.StorageOffloadEngine(
                a.llmd_threads, sh.bpk, tensors, [list(range(len(tensors)))], [len(tensors) * sh.plane],
                int(a.llmd_threads * 0.75), "disabled", 0.0)
            self.llmd_dir = f"{os.path.abspath(a.dir).rstrip('/')}-llmd-rank{rank}"
            self.llmd_job = 0

    def info(self):
        torch = self.torch
        out = {"rank": self.rank, "pid": os.getpid(), "device": str(self.dev), "torch": torch.__version__,
               "cuda": torch.version.cuda, "cache_bytes": self.cache.numel() * 2, "key_bytes": self.sh.key_bytes}
        if self.cuda:
            n = torch.cuda.device_count()
            uuid = kvhost.device_uuid(self.cache)
            out.update(device_count=n, gpus=[torch.cuda.get_device_name(i) for i in range(n)],
                       uuid=memory.uuid_text(uuid) if uuid else None)
        if self.worker is not None:
            out["connector_layer_loads"] = self.worker.counters()["layer_loads"]
        return out

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize(self.dev)

    @staticmethod
    def now():
        return time.monotonic()  # CLOCK_MONOTONIC: one clock for every process of the machine

    # -- blocks ------------------------------------------------------------

    def refresh(self, seed):
        """New random bytes in every block (the sources of this run)."""
        g = self.torch.Generator(device=self.dev).manual_seed(seed * 131 + self.rank)
        self.cache.view(self.torch.int16).random_(-32768, 32767, generator=g)
        self.sync()

    def poison(self):
        self.u8.index_fill_(2, self.dst_index, POISON)
        self.sync()

    def compare(self, keys=None):
        """(bytes that differ, keys that differ) between every loaded
        key's destination blocks and its source blocks."""
        torch, bad, bad_keys = self.torch, 0, 0
        self.sync()
        for i in range(self.a.keys) if keys is None else keys:
            s = torch.tensor(self.sh.src[i], device=self.dev)
            d = torch.tensor(self.sh.dst[i], device=self.dev)
            n = int((self.u8.index_select(2, s) != self.u8.index_select(2, d)).sum().item())
            bad += n
            bad_keys += n > 0
        return bad, bad_keys

    # -- the client path -----------------------------------------------------

    def client_store(self, keys):
        plan = [(self.cache_id, ks, bs) for ks, bs in zip(split(keys, self.a.jobs), split(self.sh.src, self.a.jobs))]
        t0 = self.now()
        _, res = run_jobs(self.c, "store", plan, self.a.job_timeout)
        t1 = self.now()
        done = sum(r.count(o) for r in res if r is not None for o in STORED)
        errors = [] if done == len(keys) else [f"{done} of {len(keys)} keys stored: "
                                               f"{[r.outcomes() if r else None for r in res]}"]
        return {"t0": t0, "t1": t1, "bytes": len(keys) * self.sh.key_bytes, "errors": errors}

    def client_load(self, keys):
        plan = [(self.cache_id, ks, bs) for ks, bs in zip(split(keys, self.a.jobs), split(self.sh.dst, self.a.jobs))]
        t0 = self.now()
        _, res = run_jobs(self.c, "load", plan, self.a.job_timeout)
        self.sync()
        t1 = self.now()
        done = sum(r.count(LOADED) for r in res if r is not None)
        errors = [] if done == len(keys) else [f"{done} of {len(keys)} keys loaded: "
                                               f"{[r.outcomes() if r else None for r in res]}"]
        return {"t0": t0, "t1": t1, "bytes": len(keys) * self.sh.key_bytes, "errors": errors}

    # -- the connector path ----------------------------------------------------

    def _counts(self):
        return dict(self.worker.counters())

    def conn_save(self, meta):
        """One step that saves meta.saves, then get_finished until every
        request saved is reported (its stores ended)."""
        w, before = self.worker, self._counts()
        reqs = {t.req_id for t in meta.saves}
        t0 = self.now()
        wm = self._step(meta)
        done = set(self._finished(reqs))
        deadline = t0 + self.a.job_timeout
        while done != reqs:
            if self.now() > deadline:
                raise TimeoutError(f"rank {self.rank}: the connector's saves not reported after "
                                   f"{self.a.job_timeout:g} s ({sorted(reqs - done)} left)")
            time.sleep(0.0002)
            done |= self._finished(set())
        t1 = self.now()
        after, nkeys = self._counts(), sum(len(t.keys) for t in meta.saves)
        stored = sum(after.get(k, 0) - before.get(k, 0) for k in ("stored_keys", "present_keys"))
        errors = [] if stored == nkeys else [f"{stored} of {nkeys} keys stored (worker counters {after})"]
        return {"t0": t0, "t1": t1, "bytes": nkeys * self.sh.key_bytes, "errors": errors, "worker_meta": wm,
                "finished": sorted(done)}

    def _finished(self, ids):
        sending, _ = self.worker.get_finished(ids)
        return set(sending or ())

    def _step(self, meta):
        """One engine step in vLLM's worker order, no forward pass:
        returns the worker's meta (its load errors are checked by the
        caller through the worker's counters and the bytes)."""
        w = self.worker
        w.handle_preemptions(meta)
        w.bind_connector_metadata(meta)
        w.start_load_kv(None)
        for n in self.names:
            w.wait_for_layer_load(n)
            w.save_kv_layer(n, None, None)
        w.wait_for_save()
        self.errors = w.get_block_ids_with_load_errors()
        wm = w.build_connector_worker_meta()
        w.clear_connector_metadata()
        return wm

    def conn_load(self, meta):
        before = self._counts()
        t0 = self.now()
        wm = self._step(meta)
        self.sync()
        t1 = self.now()
        self._finished({t.req_id for t in meta.loads})  # vLLM's get_finished: the requests ended with the step
        after, nkeys = self._counts(), sum(len(t.keys) for t in meta.loads)
        moved = after.get("bytes_loaded", 0) - before.get("bytes_loaded", 0)
        errors = []
        if self.errors:
            errors.append(f"the connector reported load errors in {len(self.errors)} blocks")
        if moved != nkeys * self.sh.key_bytes:
            errors.append(f"the connector loaded {moved} bytes of {nkeys * self.sh.key_bytes}")
        return {"t0": t0, "t1": t1, "bytes": nkeys * self.sh.key_bytes, "errors": errors, "worker_meta": wm}

    # -- llm-d -------------------------------------------------------------------

    def _llmd(self, store, tag):
        n = self.a.keys
        d = os.path.join(self.llmd_dir, tag)
        paths = [os.path.join(d, f"k{i:05d}.bin") for i in range(n)]
        ids = self.sh.src if store else self.sh.dst
        self.llmd_job += 1
        job = self.llmd_job
        submit = self.engine.async_store_gpu_blocks if store else self.engine.async_load_gpu_blocks
        self.sync()
        t0 = self.now()
        ok = bool(submit(job, [0] * n, paths, ids, [0] * n))
        flags = []
        while not flags:
            flags = [f for j, f in self.engine.get_finished() if j == job]
            if not flags:
                if self.now() - t0 > self.a.job_timeout:
                    raise TimeoutError(f"rank {self.rank}: llm-d job {job} not finished after {self.a.job_timeout:g} s")
                time.sleep(0.0002)
        self.sync()
        t1 = self.now()
        errors = [] if ok and all(flags) else [f"llm-d {'store' if store else 'load'} reported a failure"]
        if store:
            missing = sum(not os.path.exists(p) for p in paths)
            if missing:
                errors.append(f"{missing} of {n} llm-d files missing")
        return {"t0": t0, "t1": t1, "bytes": n * self.sh.key_bytes, "errors": errors}

    def llmd_store(self, tag):
        return self._llmd(True, tag)

    def llmd_load(self, tag):
        out = self._llmd(False, tag)
        shutil.rmtree(os.path.join(self.llmd_dir, tag), ignore_errors=True)
        return out

    def close(self):
        if self.worker is not None:
            self.worker.shutdown()
        self.c.close()
        if self.engine is not None:
            shutil.rmtree(self.llmd_dir, ignore_errors=True)


LOADS = ("client_load", "conn_load", "llmd_load")  # ops whose destinations are poisoned first and compared


def rank_main(rank, a, socket, conn, go):
    """A rank's process: builds its Rank, then runs the driver's commands:
    (name, timed, kwargs). A timed command makes its blocks ready, says
    "ready", waits for go and runs; a load's blocks are compared after."""
    try:
        r = Rank(rank, a, socket)
        conn.send(("ready", r.info()))
        while True:
            cmd, timed, kw = conn.recv()
            if cmd == "stop":
                r.close()
                conn.send(("done", None))
                return
            if cmd in LOADS:
                r.poison()
            if timed:
                conn.send(("ready", None))
                if not go.wait(a.job_timeout + 600):
                    raise TimeoutError(f"rank {rank}: no start after {a.job_timeout + 600:g} s")
            out = getattr(r, cmd)(**kw)
            if cmd in LOADS:
                out["differ"], out["differ_keys"] = r.compare()
            conn.send(("done", out))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


# -- the driver -------------------------------------------------------------------


def _ttft_bench():
    """scripts/ttft-bench.py as a module (its Request, corrupt_newest and
    mount_of)."""
    spec = importlib.util.spec_from_file_location("ttft_bench", REPO / "scripts" / "ttft-bench.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class Ranks:
    """The rank processes and the commands sent to them."""

    def __init__(self, a, socket):
        ctx = multiprocessing.get_context("spawn")  # no fork of a process that may hold CUDA
        self.a, self.go = a, ctx.Event()
        self.pipes, self.procs = [], []
        self.broken = False  # a rank failed or went silent: stop ends them without asking
        for r in range(a.ranks):
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=rank_main, args=(r, a, socket, theirs, self.go), daemon=True,
                            name=f"gpu-tp2-rank{r}")
            p.start()
            theirs.close()
            self.pipes.append(mine)
            self.procs.append(p)
        self.info = [self._recv(r, "ready", 600) for r in range(a.ranks)]

    def _recv(self, r, want, timeout=None):
        pipe = self.pipes[r]
        try:
            if not pipe.poll(timeout if timeout is not None else 2 * self.a.job_timeout + 60):
                raise SystemExit(f"gpu-tp2: rank {r} sent no {want}")
            try:
                kind, body = pipe.recv()
            except EOFError:
                raise SystemExit(f"gpu-tp2: rank {r} ended (exit code {self.procs[r].exitcode})") from None
            if kind == "error":
                raise SystemExit(f"gpu-tp2: rank {r} failed:\n{body}")
            if kind != want:
                raise SystemExit(f"gpu-tp2: rank {r} sent {kind}, want {want}")
        except SystemExit:
            self.broken = True
            raise
        return body

    def call(self, ranks, cmd, timed=False, **kw):
        """Runs cmd on ranks (timed: all started at once); returns each
        rank's answer, in ranks' order."""
        for r in ranks:
            self.pipes[r].send((cmd, timed, kw))
        if timed:
            for r in ranks:
                self._recv(r, "ready")
            self.go.set()
        try:
            return [self._recv(r, "done") for r in ranks]
        finally:
            self.go.clear()

    def stop(self):
        for r, p in enumerate(self.procs):
            if p.is_alive() and not self.broken:
                try:
                    self.pipes[r].send(("stop", False, {}))
                    self._recv(r, "done", 120)
                except (SystemExit, OSError):
                    pass
            p.join(0 if self.broken else 30)
            if p.is_alive():
                p.terminate()  # this process's own child, by its handle
                p.join(10)


class Driver:
    """The runs: the ranks, the connector's scheduler half, and the
    driver's own client (the daemon's device counts for the report)."""

    def __init__(self, a, ranks, socket):
        self.a, self.ranks, self.socket = a, ranks, socket
        self.sh = Shape(a)
        self.tb = _ttft_bench()
        self.c = kvhost.Client(socket, name="gpu-tp2-driver", timeout=a.job_timeout)
        self.sched = None
        if "connector" in a.paths:
            self.sched = connector_class()(None, "scheduler", config=connector_config(a, 0, socket))
        self.run_id = os.urandom(4).hex()
        self.runs = []

    def corrupt(self):
        if self.a.corrupt_stored:
            self.tb.corrupt_newest(self.a.dir)

    def fill(self, nbytes):
        """Untimed stores from every rank (the client path) of nbytes in
        all: the cache is full before the first run, as a node's is, and
        the runs' stores write into the files it evicts."""
        every = list(range(self.a.ranks))
        per_round = self.a.ranks * self.a.keys * self.sh.key_bytes
        rounds = -(-int(nbytes) // per_round)
        for i in range(rounds):
            keys = [f"tp2-{self.run_id}-fill-{i}-{k}".encode() for k in range(self.a.keys)]
            self.ranks.call(every, "refresh", seed=10 ** 9 + i)
            bad = [x["errors"] for x in self.ranks.call(every, "client_store", True, keys=keys) if x["errors"]]
            if bad:
                raise SystemExit(f"gpu-tp2: the fill's stores failed: {bad}")
        print(f"detail: filled the cache with {rounds * per_round / (1 << 20):.1f} MiB of keys ({rounds} rounds) "
              f"before the runs", flush=True)
        self.pause()

    def pause(self):
        if self.a.pause > 0:
            time.sleep(self.a.pause)

    def one(self, path, mode, rep):
        a = self.a
        active = [0] if mode == "alone" else list(range(a.ranks))
        tag = f"{self.run_id}-{path}-{mode}-{rep}"
        self.ranks.call(active, "refresh", seed=a.seed * 1000003 + len(self.runs))
        if path == "client":
            keys = [f"tp2-{tag}-{i}".encode() for i in range(a.keys)]
            store = self.ranks.call(active, "client_store", True, keys=keys)
            self.corrupt()
            self.pause()
            load = self.ranks.call(active, "client_load", True, keys=keys)
        elif path == "connector":
            store, load = self.connector(tag, active)
        else:
            store = self.ranks.call(active, "llmd_store", True, tag=tag)
            self.pause()
            load = self.ranks.call(active, "llmd_load", True, tag=tag)
        run = {"path": path, "mode": mode, "rep": rep, "warmup": rep < 0, "ranks": active,
               "store": summarize(store, active), "load": summarize(load, active)}
        self.runs.append(run)
        for op in ("store", "load"):
            s = run[op]
            for r, x in zip(active, s["per_rank"]):
                print(f"detail: rep {rep} warmup {rep < 0} path {path} mode {mode} op {op} rank {r} gbps {x['gbps']:.2f} "
                      f"s {x['seconds']:.4f} bytes {x['bytes']} ok {x['ok']} bad_bytes {x.get('differ', 0)} "
                      f"bad_keys {x.get('differ_keys', 0)}"
                      + (f" errors {x['errors']}" if x["errors"] else ""), flush=True)
        self.pause()
        return run

    def requests(self, tag, load):
        """The step's requests: (Request, blocks, tokens) per request, its
        keys' blocks in order (sources to save; destinations and one
        spare block to load: a prompt one block longer than its keys, of
        which vLLM computes the last token)."""
        out = []
        for j, ks in enumerate(split(list(range(self.a.keys)), self.a.requests)):
            names = [f"{tag}-{j}-{b}" for b in range(len(ks) * self.sh.bpk)]
            blocks = [b for i in ks for b in (self.sh.dst[i] if load else self.sh.src[i])]
            if load:
                names.append(f"{tag}-{j}-last")
                blocks.append(self.sh.spare)
            tokens = len(names) * BLOCK_TOKENS
            req = self.tb.Request(f"{tag}-{'load' if load else 'save'}-{j}", self.tb.block_hashes(names), tokens)
            out.append((req, blocks, tokens))
        return out

    @staticmethod
    def output(reqs, computed):
        ns = types.SimpleNamespace
        return ns(scheduled_new_reqs=[ns(req_id=q.request_id, block_ids=(list(b),), num_computed_tokens=computed[i])
                                      for i, (q, b, _) in enumerate(reqs)],
                  scheduled_cached_reqs=None,
                  num_scheduled_tokens={q.request_id: t - computed[i] for i, (q, _, t) in enumerate(reqs)},
                  preempted_req_ids=set(), finished_req_ids=set())

    def finish_step(self, reqs, answers):
        wm = None
        for x in answers:
            m = x.pop("worker_meta", None)
            if m is not None:
                wm = m if wm is None else wm.aggregate(m)
        self.sched.update_connector_output(types.SimpleNamespace(kv_connector_worker_meta=wm,
                                                                 finished_sending=None))
        for q, b, _ in reqs:
            self.sched.request_finished(q, b)

    def connector(self, tag, active):
        a, s = self.a, self.sched
        saves = self.requests(tag, load=False)
        for q, b, _ in saves:
            s.get_num_new_matched_tokens(q, 0)
            s.update_state_after_alloc(q, b, 0)
        meta = s.build_connector_meta(self.output(saves, [0] * len(saves)))
        keys = [k for t in meta.saves for k in t.keys]
        if len(keys) != a.keys:
            raise SystemExit(f"gpu-tp2: the scheduler saves {len(keys)} keys of {a.keys}")
        store = self.ranks.call(active, "conn_save", True, meta=meta)
        self.corrupt()
        others = [r for r in range(a.ranks) if r not in active]
        if others:  # the scheduler claims a key only where every rank holds it
            fill = self.ranks.call(others, "conn_save", meta=meta)
            bad = [x["errors"] for x in fill if x["errors"]]
            if bad:
                raise SystemExit(f"gpu-tp2: the idle ranks' saves failed: {bad}")
        self.finish_step(saves, store)
        self.pause()
        loads = self.requests(tag, load=True)
        claimed = []
        for q, b, t in loads:
            k, _ = s.get_num_new_matched_tokens(q, 0)
            claimed.append(k)
            s.update_state_after_alloc(q, b, k)
        meta = s.build_connector_meta(self.output(loads, claimed))
        load = self.ranks.call(active, "conn_load", True, meta=meta)
        want = [t - BLOCK_TOKENS for _, _, t in loads]
        if claimed != want:
            for x in load:
                x["errors"].append(f"the scheduler claimed {claimed} tokens of {want}")
        self.finish_step(loads, load)
        return store, load


def summarize(answers, ranks):
    """A timed op's figures: per rank (GB/s over its own time) and in all
    (every rank's bytes over the earliest start to the latest end)."""
    per = []
    for r, x in zip(ranks, answers):
        secs = max(x["t1"] - x["t0"], 1e-9)
        errors = list(x["errors"])
        if x.get("differ"):
            errors.append(f"{x['differ']} bytes in {x['differ_keys']} keys differ from their sources")
        per.append({"rank": r, "seconds": secs, "bytes": x["bytes"], "gbps": x["bytes"] / secs / 1e9,
                    "differ": x.get("differ", 0), "differ_keys": x.get("differ_keys", 0), "errors": errors,
                    "ok": not errors, "t0": x["t0"], "t1": x["t1"]})
    span = max(max(x["t1"] for x in answers) - min(x["t0"] for x in answers), 1e-9)
    total = sum(x["bytes"] for x in answers)
    return {"per_rank": per, "seconds": span, "bytes": total, "gbps_total": total / span / 1e9,
            "ok": all(p["ok"] for p in per), "differ": sum(p["differ"] for p in per)}


def report_lines(a, runs, pipeline):
    """The summary lines (printed) and their figures."""
    summary, lines = {}, []
    for path in a.paths:
        for mode in a.modes:
            for op in ("store", "load"):
                rs = [r for r in runs if r["path"] == path and r["mode"] == mode]
                if not rs:
                    continue
                ranks = rs[0]["ranks"]
                per = [statistics.median(r[op]["per_rank"][i]["gbps"] for r in rs) for i in range(len(ranks))]
                total = statistics.median(r[op]["gbps_total"] for r in rs)
                ok = all(r[op]["ok"] for r in rs)
                differ = sum(r[op]["differ"] for r in rs)
                summary.setdefault(path, {}).setdefault(mode, {})[op] = {
                    "ranks": len(ranks), "gbps_rank": per, "gbps_total": total, "ok": ok, "differ": differ,
                    "reps": len(rs), "gbps_total_reps": [r[op]["gbps_total"] for r in rs]}
                lines.append(f"tp2 path {path} mode {mode} op {op} ranks {len(ranks)} gbps_rank "
                             f"{','.join(f'{g:.2f}' for g in per)} gbps_total {total:.2f} ok {ok} differ {differ} "
                             f"pipeline {pipeline}")
    ratios, versus = {}, {}
    for path, modes in summary.items():
        if {"alone", "together"} <= set(modes):
            for op in ("store", "load"):
                r = modes["together"][op]["gbps_total"] / max(modes["alone"][op]["gbps_total"], 1e-12)
                ratios.setdefault(path, {})[op] = r
                lines.append(f"tp2 ratio path {path} op {op} {r:.2f} pipeline {pipeline}")
    if "llmd" in summary:
        for path in (p for p in summary if p != "llmd"):
            for mode, ops in summary[path].items():
                peer = summary["llmd"].get(mode)
                if not peer:
                    continue
                for op, x in ops.items():
                    y = peer[op]
                    rank = [g / max(h, 1e-12) for g, h in zip(x["gbps_rank"], y["gbps_rank"])]
                    total = x["gbps_total"] / max(y["gbps_total"], 1e-12)
                    versus.setdefault(path, {}).setdefault(mode, {})[op] = {"rank": rank, "total": total}
                    lines.append(f"tp2 vs_llmd path {path} mode {mode} op {op} rank "
                                 f"{','.join(f'{v:.2f}' for v in rank)} total {total:.2f} pipeline {pipeline}")
    return lines, summary, ratios, versus


def machine(a, info, tb):
    out = {"python": platform.python_version(), "host": platform.node(), "cpus": os.cpu_count(),
           "device": a.device, "ranks": info}
    first = info[0] if info else {}
    out.update(torch=first.get("torch"), cuda=first.get("cuda"), gpus=first.get("gpus"),
               device_count=first.get("device_count"))
    try:
        with open("/sys/devices/system/node/online") as f:
            out["numa_nodes_online"] = f.read().strip()
    except OSError:
        pass
    if a.device == "cuda" and shutil.which("nvidia-smi"):
        r = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=60)
        out["nvidia_smi_topo"] = r.stdout
    if a.dir:
        mnt, fstype, dev = tb.mount_of(a.dir)
        out["mount"] = {"dir": os.path.abspath(a.dir), "mount_point": mnt, "fs_type": fstype, "device": dev}
    return out


def scrape(addr):
    import urllib.request
    body = urllib.request.urlopen(f"http://{addr}/metrics", timeout=10).read().decode()
    return [line for line in body.splitlines() if line.startswith(("kvhost_gpu_direct", "kvhost_gpu_registered",
                                                                   "kvhost_gpu_file", "kvhost_reused",
                                                                   "kvhost_spare_files", "kvhost_evictions"))]


def main(argv=None):
    a = parse_args(argv)
    pipeline = "pinned" if a.pinned else ("registered" if not a.socket else "as-configured")
    daemon, toml = None, ""
    if not a.socket:
        from daemon import Daemon
        os.environ["KVHOST_BIN"] = os.path.abspath(a.kvhost_bin)
        sh = Shape(a)
        run_bytes = a.ranks * a.keys * sh.key_bytes
        if a.capacity is None:
            a.capacity = (3 * run_bytes + (256 << 20)) / (1 << 30)
        if a.fill is None:
            a.fill = a.capacity
        if a.io_workers:
            toml += f"[engine]\nio_workers = {a.io_workers}\n"
        if a.pinned:
            toml += "[gpu]\nregister_files = 0\n"
        if a.metrics:
            toml += f'[metrics]\nlisten = "{a.metrics}"\n'
        os.makedirs(a.dir, exist_ok=True)
        daemon = Daemon(capacity=f"{int(a.capacity * 1024)}MiB", dir=os.path.abspath(a.dir),
                        extra_toml=toml)
    elif a.fill is None:
        a.fill = 0.0
    socket = daemon.socket if daemon else a.socket
    ranks = driver = None
    failed = True
    try:
        ranks = Ranks(a, socket)
        driver = Driver(a, ranks, socket)
        ngpu = ranks.info[0].get("device_count")
        devices = sorted({x["device"] for x in ranks.info})
        print(f"detail: {a.ranks} ranks on {', '.join(devices)}"
              + (f" ({ngpu} GPU(s): ranks share a device, a functional check, not the figure of one GPU per rank)"
                 if a.device == "cuda" and ngpu < a.ranks else "")
              + f"; key {driver.sh.key_bytes >> 10} KiB per rank, {a.keys} keys per rank and run; paths "
              f"{','.join(a.paths)}; pipeline {pipeline}; reps {a.reps}", flush=True)
        if a.fill:
            driver.fill(a.fill * (1 << 30))
        for rep in range(-a.warmup, a.reps):  # negative: warm-up, not in the figures
            for path in a.paths:
                for mode in (a.modes if rep % 2 == 0 else a.modes[::-1]):
                    driver.one(path, mode, rep)
        lines, summary, ratios, versus = report_lines(a, [r for r in driver.runs if not r["warmup"]], pipeline)
        for line in lines:
            print(line, flush=True)
        failed = not all(r[op]["ok"] for r in driver.runs for op in ("store", "load"))
        if a.json:
            stats = driver.c.stats()
            rep = {"args": vars(a), "pipeline": pipeline, "daemon_config": toml, "machine": machine(a, ranks.info,
                                                                                                  driver.tb),
                   "daemon_devices": stats.get("devices"), "runs": driver.runs, "summary": summary,
                   "ratios_together_over_alone": ratios, "vs_llmd": versus, "ok": not failed,
                   "statistic": "median of reps"}
            if a.metrics and daemon:
                rep["metrics"] = scrape(a.metrics)
            with open(a.json, "w") as f:
                json.dump(rep, f, indent=1, default=str)
    finally:
        if driver is not None:
            if driver.sched is not None:
                driver.sched.shutdown()
            driver.c.close()
        if ranks is not None:
            ranks.stop()
        if daemon:
            daemon.stop()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
