#!/usr/bin/env python3
"""Time to first token (TTFT) of a Llama-3.1-8B-shaped model with a prefix
cached in kvhost, against recomputing it (issue 84).

    ttft-bench.py --dir DIR [--sizes 2048,8192,32256] [--suffix 512]
                  [--reps 5] [--cold] [--json FILE] [--llmd MODDIR] ...

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
    whole      load every layer of the prefix's keys (one job), then
               compute the suffix
    layerwise  one load job per --layers-per-load layers, submitted at
               once; each layer waits for its job right before its
               attention (where vLLM's attention layers call
               wait_for_layer_load), so layer i loads while layer i-1
               computes
    split      load-or-recompute: load the first K tokens layer-wise and
               compute tokens K..P+S; K minimizes max(load(K),
               compute(K..P+S)) under a cost model fitted to this run's
               recompute and suffix times and whole load's rate (on the
               key grid)
    llmd       (with --llmd) llm-d's storage_offload engine loads the
               prefix from its own files (written by it first), then the
               suffix is computed

and the ceilings beside them: suffix (the suffix's compute with the prefix
already on the device) and h2d (a pinned host to GPU copy of the prefix's
K/V bytes; CUDA only). The issue's bound is layerwise <= 1.15 x max(h2d,
suffix).

Each mode runs --warmup untimed repetitions, then --reps timed ones; a
line gives the median (ms) and the best (best):

    ttft P 32256 S 512 mode layerwise ms 96.1 best 95.0 ok True

ok says that in every repetition each load finished with every key loaded,
every loaded block equals the recomputation's bytes (the whole blocks, all
layers, compared exactly) and the last token's logits equal the
recomputation's within bf16 tolerance: max |logits - reference| <= 0.02 x
max |reference| + 0.02 (computing the suffix alone takes other kernels
than computing P+S tokens, so the logits may differ in their last bits).
Then per size

    bound P 32256 S 512 layerwise/max(h2d,suffix) 1.07 limit 1.15 met True
    ratio P 32256 S 512 split/recompute 0.71 split_tokens 20480

(bound only where h2d ran). --json FILE writes every repetition, the
machine (GPU, torch, CUDA), the mount, the ceilings and the ratios. The
exit status is 1 where any ok is False.
"""
import argparse
import json
import math
import os
import pathlib
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "client" / "python" / "src"))
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "client" / "python" / "tests"))  # daemon.py: a daemon from a TOML configuration

import torch  # noqa: E402

import kvhost  # noqa: E402
from kvhost import memory  # noqa: E402
from ttft_model import Config, Model  # noqa: E402

RTOL, ATOL = 0.02, 0.02  # logits: max |a - ref| <= RTOL * max |ref| + ATOL
BOUND = 1.15  # the issue's: layerwise <= BOUND x max(h2d, suffix)
LOADED = 4  # kvhost.protocol.OUTCOME_LOADED


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", help="the cache directory a daemon started here serves (on the mount under test)")
    ap.add_argument("--socket", help="a running daemon's socket instead of starting one")
    ap.add_argument("--kvhost-bin", default=os.environ.get("KVHOST_BIN") or str(REPO / "bin" / "kvhost"),
                    help="the daemon's binary ($KVHOST_BIN, else bin/kvhost)")
    ap.add_argument("--capacity", help="the mount's capacity in the daemon's configuration (default: twice "
                    "the prefixes' K/V bytes)")
    ap.add_argument("--sizes", default="2048,8192,32256", help="prefix sizes P in tokens, comma-separated")
    ap.add_argument("--suffix", type=int, default=512, help="suffix tokens S")
    ap.add_argument("--modes", default="recompute,suffix,h2d,whole,layerwise,split,llmd",
                    help="modes to run (recompute always runs: it is the reference)")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions per mode (median and best reported)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed repetitions before them")
    ap.add_argument("--cold", action="store_true", help="drop the page cache before each load (root)")
    ap.add_argument("--json", help="write the report here")
    ap.add_argument("--llmd", help="directory of a built llm-d storage_offload module (adds the llmd mode)")
    ap.add_argument("--llmd-threads", type=int, default=16, help="llm-d engine I/O threads")
    ap.add_argument("--device", default="cuda", help="torch device (cpu: tests)")
    ap.add_argument("--tokens-per-key", type=int, default=256, help="tokens per kvhost key (and llm-d file)")
    ap.add_argument("--layers-per-load", type=int, default=1, help="layers per layer-wise load job")
    ap.add_argument("--job-timeout", type=float, default=120, help="seconds a load may take before it fails")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--corrupt-stored", action="store_true",
                    help="a check of the checks (tests): flip the first payload byte of the newest file under "
                         "--dir after each store; every load mode must then say ok False")
    for name, default in [("layers", 32), ("hidden", 4096), ("heads", 32), ("kv-heads", 8),
                          ("head-dim", 128), ("mlp", 14336), ("vocab", 8192)]:
        ap.add_argument(f"--{name}", type=int, default=default, help=f"model {name} (default {default})")
    a = ap.parse_args(argv)
    a.sizes = [int(s) for s in a.sizes.split(",") if s]
    a.modes = [m for m in a.modes.split(",") if m]
    unknown = set(a.modes) - {"recompute", "suffix", "h2d", "whole", "layerwise", "split", "llmd"}
    if unknown:
        ap.error(f"unknown modes {sorted(unknown)}")
    if not a.dir and not a.socket:
        ap.error("give --dir (a daemon is started there) or --socket")
    if a.tokens_per_key % 16:
        ap.error(f"--tokens-per-key {a.tokens_per_key}: want a multiple of the 16-token block")
    for p in a.sizes:
        if p <= 0 or p % a.tokens_per_key:
            ap.error(f"prefix size {p}: want a positive multiple of --tokens-per-key ({a.tokens_per_key})")
    if a.layers_per_load <= 0:
        ap.error("--layers-per-load: want > 0")
    return a


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
    """Whether logits equal ref within the bf16 tolerance; and the max
    absolute difference."""
    diff = (logits - ref).abs().max().item()
    return diff <= RTOL * ref.abs().max().item() + ATOL, diff


class Bench:
    """The model, its cache registered with the daemon, and the runs."""

    def __init__(self, a, client):
        self.a, self.c = a, client
        self.dev = torch.device(a.device)
        self.cuda = self.dev.type == "cuda"
        if self.cuda:
            torch.cuda.set_device(self.dev.index or 0)
        self.cfg = Config(layers=a.layers, hidden=a.hidden, heads=a.heads, kv_heads=a.kv_heads,
                          head_dim=a.head_dim, mlp=a.mlp, vocab=a.vocab)
        self.model = Model(self.cfg, self.dev, seed=a.seed)
        bt = self.cfg.block_tokens
        self.num_blocks = (max(a.sizes) + a.suffix + bt - 1) // bt + 1
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
        # The request's blocks: a permutation, as a paged cache hands them out.
        self.table = torch.randperm(self.num_blocks, generator=g).to(self.dev)
        self.table_list = self.table.tolist()
        geometry = kvhost.Geometry(
            model=f"ttft-bench/random-llama-{a.layers}x{a.hidden}-seed{a.seed}", layers=a.layers,
            kv_heads=a.kv_heads, head_size=a.head_dim, dtype_size=2, tokens_per_block=bt,
            tokens_per_key=a.tokens_per_key)
        self.ns = client.declare(geometry)
        layer_bytes = self.cache[0].numel() * self.cache.element_size()
        bb = self.cfg.block_bytes
        self.cache_id = client.register_cache(self.ns, [
            kvhost.Layer(region, offset=base + l * layer_bytes, block_stride=bb,
                         plane_stride=self.num_blocks * bb, num_blocks=self.num_blocks)
            for l in range(a.layers)])
        self.run_id = os.urandom(4).hex()
        self.layer_loads = "layers" in _params(client.load) and bool(getattr(client, "supports_layer_loads", False))
        self.cold_state = {}
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
        self.report["sizes"][str(p)] = rep
        modes = rep["modes"]

        def record(mode, reps, oks, errors, extra=None):
            timed_reps = reps[a.warmup:]
            m = {"reps_ms": timed_reps, "warmup_ms": reps[:a.warmup],
                 "median_ms": statistics.median(timed_reps), "best_ms": min(timed_reps),
                 "ok": all(oks), "errors": errors}
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
        record("recompute", reps, [ok and bool(torch.isfinite(ref).all())], [] if ok else [f"logits differ {diff}"])
        ref_kv = self.cache.index_select(2, self.prefix_blocks(p)).clone()

        # The prefix's keys, stored from the recomputation's blocks.
        res = self.c.store(self.cache_id, keys, blocks).wait(a.job_timeout)
        stored = res.count(1) + res.count(2)
        if stored != nkeys:
            raise SystemExit(f"ttft-bench: stored {stored} of {nkeys} keys: {res.outcomes()}")
        if a.corrupt_stored:
            corrupt_newest(a.dir)

        if "suffix" in a.modes:
            reps, oks, errs = [], [], []
            for _ in range(a.warmup + a.reps):
                ms, logits = self.timed(lambda: self.model.forward(tokens[p:], p, self.cache, self.table))
                reps.append(ms)
                self._check(logits, ref, oks, errs)
            record("suffix", reps, oks, errs)

        if "h2d" in a.modes and self.cuda:
            src = torch.empty(self.cfg.kv_bytes(p), dtype=torch.uint8, pin_memory=True)
            dst = torch.empty_like(src, device=self.dev)
            reps = [self.timed(lambda: dst.copy_(src, non_blocking=True))[0] for _ in range(a.warmup + a.reps)]
            del src, dst
            record("h2d", reps, [True], [], {"bytes": self.cfg.kv_bytes(p)})

        def load_mode(mode, run, loaded_tokens):
            reps, oks, errs = [], [], []
            for _ in range(a.warmup + a.reps):
                self.poison(p)
                if a.cold:
                    drop_page_cache(self.cold_state)
                failures = []
                ms, logits = self.timed(lambda: run(failures))
                reps.append(ms)
                nb = loaded_tokens // self.cfg.block_tokens
                same = torch.equal(self.cache.index_select(2, self.prefix_blocks(loaded_tokens)), ref_kv[:, :, :nb])
                if not same:
                    failures.append(f"loaded blocks differ from the recomputation's ({loaded_tokens} tokens)")
                self._check(logits, ref, oks, errs, failures)
            record(mode, reps, oks, errs, {"loaded_tokens": loaded_tokens})

        if "whole" in a.modes:
            def whole(failures):
                self._wait(self.c.load(self.cache_id, keys, blocks), nkeys, failures)
                return self.model.forward(tokens[p:], p, self.cache, self.table)
            load_mode("whole", whole, p)

        if "layerwise" in a.modes:
            load_mode("layerwise", lambda f: self.layerwise(tokens, p, keys, blocks, f), p)

        if "split" in a.modes and {"recompute", "suffix", "whole"} <= set(modes):
            k, model = self.choose_split(p, modes)
            rep["split_model"] = model
            load_mode("split", lambda f: self.layerwise(tokens, k, keys[:k // a.tokens_per_key],
                                                        blocks[:k // a.tokens_per_key], f), k)

        if "llmd" in a.modes and a.llmd:
            self.llmd(p, tokens, blocks, ref, ref_kv, load_mode)

        self._ratios(rep)
        self.c.delete(self.ns, keys)

    def _check(self, logits, ref, oks, errs, failures=()):
        ok, diff = close(logits, ref)
        failures = list(failures)
        if not ok:
            failures.append(f"logits differ from the recomputation's by {diff:.4g}")
        oks.append(not failures)
        errs.extend(failures)

    def _wait(self, job, nkeys, failures):
        try:
            res = job.wait(self.a.job_timeout)
        except (kvhost.KvhostError, kvhost.ConnectionLost, TimeoutError) as e:
            failures.append(f"load failed: {e}")
            return
        if res.count(LOADED) != nkeys:
            failures.append(f"load: {res.count(LOADED)} of {nkeys} keys loaded ({res.outcomes()}; {res.message})")

    def layerwise(self, tokens, k, keys, blocks, failures):
        """Loads keys (k tokens) into their blocks layer-wise, computing
        tokens k.. as the layers arrive; returns the logits."""
        a, n = self.a, len(keys)
        if n == 0:
            return self.model.forward(tokens, 0, self.cache, self.table)
        per = a.layers_per_load if self.layer_loads else a.layers
        jobs = []
        for first in range(0, a.layers, per):
            count = min(per, a.layers - first)
            if self.layer_loads:
                jobs.append(self.c.load(self.cache_id, keys, blocks, block=False, layers=(first, count)))
            else:
                jobs.append(self.c.load(self.cache_id, keys, blocks, block=False))
        waited = set()

        def before(layer):
            i = layer // per
            if i not in waited:
                waited.add(i)
                self._wait(jobs[i], n, failures)
        return self.model.forward(tokens[k:], k, self.cache, self.table, before_attention=before)

    def choose_split(self, p, modes):
        """The K (on the key grid) that minimizes max(load(K),
        compute(K..P+S)): load at the rate whole load showed (its time less
        the suffix's), compute as a*n + b*n*(K + n/2) for n tokens after K
        cached, a and b fitted to recompute (n = P+S, K = 0) and suffix (n
        = S, K = P)."""
        s, tpk = self.a.suffix, self.a.tokens_per_key
        rec, suf = modes["recompute"]["median_ms"], modes["suffix"]["median_ms"]
        load_ms = max(modes["whole"]["median_ms"] - suf, 1e-3)
        n1, n2 = p + s, s
        # rec = a n1 + b n1 n1/2 ; suf = a n2 + b n2 (p + n2/2)
        m11, m12, m21, m22 = n1, n1 * n1 / 2, n2, n2 * (p + n2 / 2)
        det = m11 * m22 - m12 * m21
        ca = (rec * m22 - m12 * suf) / det if det else rec / n1
        cb = max((m11 * suf - m21 * rec) / det, 0.0) if det else 0.0
        ca = max(ca, 0.0)
        best = None
        for k in range(0, p + 1, tpk):
            n = p + s - k
            cost = max(load_ms * k / p, ca * n + cb * n * (k + n / 2))
            if best is None or cost < best[0]:
                best = (cost, k)
        model = {"chosen_tokens": best[1], "predicted_ms": best[0], "load_ms_per_prefix": load_ms,
                 "compute_a_ms_per_token": ca, "compute_b_ms_per_token_pair": cb,
                 "by": "ttft-bench's cost model, fitted to this run"}
        return best[1], model

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
        d = os.path.join(a.dir or tempfile.gettempdir(), f"llmd-{self.run_id}-P{p}")
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

        failures = []
        job(True, failures)  # from the recomputation's blocks, still in place: no load ran since the last check
        if failures:
            raise SystemExit(f"ttft-bench: {failures[0]}")

        def run(failures):
            job(False, failures)
            return self.model.forward(tokens[p:], p, self.cache, self.table)
        try:
            load_mode("llmd", run, p)
        finally:
            shutil.rmtree(d, ignore_errors=True)

    def _ratios(self, rep):
        m = rep["modes"]
        med = {k: v["median_ms"] for k, v in m.items()}
        ratios, s, p = {}, rep["S"], rep["P"]
        if {"layerwise", "suffix", "h2d"} <= set(med):
            ceiling = max(med["h2d"], med["suffix"])
            r = med["layerwise"] / ceiling
            ratios["layerwise/max(h2d,suffix)"] = r
            rep["bound"] = {"ceiling_ms": ceiling, "limit": BOUND, "met": r <= BOUND}
            print(f"bound P {p} S {s} layerwise/max(h2d,suffix) {r:.2f} limit {BOUND} met {r <= BOUND}")
        for mode in ("whole", "layerwise", "split", "llmd"):
            if mode in med and "recompute" in med:
                ratios[f"{mode}/recompute"] = med[mode] / med["recompute"]
        if "split" in med:
            print(f"ratio P {p} S {s} split/recompute {ratios['split/recompute']:.2f} "
                  f"split_tokens {m['split']['loaded_tokens']}")
        rep["ratios"] = ratios


def _params(fn):
    import inspect
    try:
        return inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return {}


def machine(a, bench):
    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "device": str(bench.dev), "attention": bench.model.attention.kind, "host": platform.node(),
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
    daemon = None
    if not a.socket:
        from daemon import Daemon
        os.environ["KVHOST_BIN"] = a.kvhost_bin
        kv = sum(Config(layers=a.layers, kv_heads=a.kv_heads, head_dim=a.head_dim).kv_bytes(p) for p in a.sizes)
        os.makedirs(a.dir, exist_ok=True)
        daemon = Daemon(capacity=a.capacity or f"{(2 * kv >> 20) + 64}MiB", dir=os.path.abspath(a.dir))
    try:
        with kvhost.Client(daemon.socket if daemon else a.socket, name="ttft-bench", timeout=a.job_timeout) as c:
            bench = Bench(a, c)
            layerwise = ("layer-range loads, " + f"{a.layers_per_load} layer(s) per job"
                         if bench.layer_loads else "whole loads (the daemon or client has no layer-range "
                         "loads): the first layer waits for all")
            print(f"detail: model {a.layers} layers hidden {a.hidden} heads {a.heads}/{a.kv_heads}x{a.head_dim} "
                  f"mlp {a.mlp} vocab {a.vocab}; attention: {bench.model.attention.kind}; layerwise: {layerwise}; "
                  f"reps {a.reps} (ms = median) after {a.warmup} warm-up; cold {a.cold}", flush=True)
            bench.report.update(machine=machine(a, bench), args=vars(a), layer_loads=bench.layer_loads,
                                tolerance={"rtol_of_max": RTOL, "atol": ATOL}, statistic="median and best of reps")
            for p in a.sizes:
                bench.run_size(p)
            if a.json:
                with open(a.json, "w") as f:
                    json.dump(bench.report, f, indent=1, default=str)
    finally:
        if daemon:
            daemon.stop()
    return 1 if bench.failed else 0


if __name__ == "__main__":
    sys.exit(main())
