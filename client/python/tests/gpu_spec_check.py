"""GPU check of KvhostOffloadingSpec: vLLM's call order with CUDA KV caches
through a real kvhost daemon serving GPU memory.

Needs a GPU, torch with CUDA and a kvhost binary built with cgo
($KVHOST_BIN, else `go build`). Runs only with KVHOST_GPU=1:

    KVHOST_GPU=1 KVHOST_BIN=bin/kvhost python3 client/python/tests/gpu_spec_check.py [OUT.json]

For each mount (tmpfs, and a disk directory where cuFile may take the
direct path) it starts a daemon with [gpu] mode = "on", builds the spec's
manager and a worker over CanonicalKVCaches of int8 (blocks, 64 KiB) CUDA
tensors (Llama-3.1-8B bf16 geometry: 32 layers, 16-token pages), then:
lookup (RETRY, MISS) → prepare_store → submit_store → get_finished →
complete_store → lookup (HIT) → prepare_load → submit_load → wait →
get_finished → complete_load, and compares every loaded page with its
source on the GPU. Then the daemon restarts under the worker's CUDA
tensors twice: killed (SIGKILL) with a load sent and unanswered (the
daemon frozen first), which the worker must load again on the new
daemon rather than fail; and stopped (SIGTERM) between jobs, after which
the keys stored before answer HIT once the worker has registered its
tensors with the new daemon, and load again. Both loads are compared on the GPU.
Before the restarts, a store and a load are submitted behind 0.1 s of GPU
work queued on the current stream (a spin, then the copy or zeroing of
their blocks): bytes must be equal and submit_* must return while that
work still runs; the same with the worker's stream marks replaced by
marks that never wait is the control that shows the check can fail.
Last, a spec of 4 GPU blocks per chunk over the same tensors loads into
blocks from inside a chunk (a GPU prefix hit holds the chunk's first
block) and up to the middle of one: loaded pages equal their sources and
no other block changes, on the GPU. With KVHOST_VLLM_SRC=DIR (a vLLM source tree, see
vllm_tree.py) the classes are vLLM's own: the spec is built by vLLM's
OffloadingSpecFactory from an OffloadingConfig, and the worker gets vLLM's
CanonicalKVCaches and GPULoadStoreSpec; without it, the CI stand-ins. Transfer rates are reported with, from the same run, a
plain torch copy of the same pages GPU → pinned host as the ceiling.
"""

import json
import os
import pathlib
import signal
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
for p in (HERE, HERE.parent / "src", HERE / "py"):
    if p.is_dir():
        sys.path.insert(0, str(p))

import daemon as d  # noqa: E402
import vllm_standins as S  # noqa: E402
from kvhost import vllm as kv  # noqa: E402

LAYERS, PAGE, BLOCKS, KEYS, ROUNDS = 32, 64 << 10, 1024, 256, 3
SPIN_CYCLES = 200_000_000  # the GPU work queued ahead of a job: about 0.1 s on an H100
MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def classes():
    """(namespace of the vLLM classes used, a function socket -> spec, name):
    vLLM's own from KVHOST_VLLM_SRC, else the stand-ins."""
    if os.environ.get("KVHOST_VLLM_SRC"):
        import vllm_tree
        from kvhost.vllm import spec_worker
        api = vllm_tree.load()
        # The check hands the worker CanonicalKVCaches of its own, not built
        # by vLLM's worker set-up: no attention backend or layout to observe.
        spec_worker.observe_layout = lambda groups: None
        names = tuple(f"model.layers.{i}.self_attn.attn" for i in range(LAYERS))

        def make_spec(socket, chunk=1):
            cfg = vllm_tree.make_offloading_config(
                api, model=MODEL, groups=((names, 16),), worker_kv_bytes_per_block=LAYERS * PAGE,
                is_parallelism_agnostic=False, blocks_per_chunk=chunk,
                extra_config={"spec_name": "KvhostOffloadingSpec", "spec_module_path": "kvhost.vllm",
                              "socket": socket, "reconnect_s": 0.05})
            return api.OffloadingSpecFactory.create_spec(cfg)
        return api, make_spec, api.name
    spec_cls = kv.spec_class(S.SPEC_API)
    return S, lambda socket, chunk=1: spec_cls(S.fake_offloading_config(
        socket, layers=LAYERS, page_bytes=PAGE, reconnect_s=0.05, blocks_per_chunk=chunk)), "stand-ins"


V, MAKE_SPEC, CLASSES = None, None, None
CTX = None


def answer(m, key):
    R = V.LookupResult
    return d.wait_for(lambda: (lambda r: r if r not in (R.RETRY, getattr(R, "HIT_PENDING", None)) else None)(
        m.lookup(key, CTX)), what="lookup")


def run_transfer(w, job, store, kv_spec, blocks, first=0):
    """One job; first is the GPU spec's block index (where in the request
    its blocks start)."""
    gpu = V.GPULoadStoreSpec(blocks, [len(blocks)], [first])
    t0 = time.perf_counter()
    ok = w.submit_store(job, gpu, kv_spec) if store else w.submit_load(job, kv_spec, gpu)
    assert ok
    w.wait({job})
    res = []
    d.wait_for(lambda: res.extend(w.get_finished()) or res, what="transfer result")
    return res[0], time.perf_counter() - t0


def restarts(dm, m, w, big, stored):
    """The daemon restarts under the worker's CUDA tensors: a load lost with
    a killed daemon is loaded again, and keys stored before a SIGTERM
    restart load after it. stored: [(keys, source blocks)] of the rounds.
    Returns the phase's report."""
    import torch
    R = V.LookupResult
    dst = list(range(2 * KEYS, 3 * KEYS))
    phases = []
    for (keys, src), sig in zip(stored[-2:], (signal.SIGKILL, signal.SIGTERM)):
        ph = {"signal": sig.name}
        if sig == signal.SIGTERM:  # between jobs
            dm.halt(sig)
            # The manager notices at a lookup, which answers MISS meanwhile.
            d.wait_for(lambda: m.lookup(keys[0], CTX) == R.MISS and not m.counters()["connected"],
                       what="the manager to notice the daemon gone")
            t0 = time.perf_counter()
            dm.start_again()
            d.wait_for(lambda: m.counters()["connected"], what="the manager to connect again", timeout=60)
            # The manager answers HIT only once the worker's tensors are
            # registered with the new daemon; the worker notices the loss
            # at vLLM's next step (get_finished) and connects.
            d.wait_for(lambda: not w.get_finished() and w.counters()["connected"],
                       what="the worker to connect again", timeout=60)
        hits = [answer(m, k) for k in keys]
        ph["hits"] = sum(h == R.HIT for h in hits)
        big[:, dst[0]:dst[-1] + 1].zero_()
        torch.cuda.synchronize()
        load_spec = m.prepare_load(keys, CTX)
        job = 1000 + len(phases)
        gpu = V.GPULoadStoreSpec(dst, [len(dst)], [0])
        got = []
        if sig == signal.SIGKILL:  # a load sent to a daemon that dies before answering
            dm.freeze()
            try:
                assert w.submit_load(job, load_spec, gpu)  # sent; no answer from a frozen daemon
            finally:
                dm.halt(sig)
            d.wait_for(lambda: got.extend(w.get_finished()) or not w.counters()["connected"],
                       what="the worker to notice the daemon gone")
            ph["reported_while_gone"] = len(got)
            t0 = time.perf_counter()
            dm.start_again()
        else:
            w.submit_load(job, load_spec, gpu)
        d.wait_for(lambda: got.extend(w.get_finished()) or got, what="the load's result", timeout=120)
        ph["restart_to_loaded_s"] = round(time.perf_counter() - t0, 3)
        torch.cuda.synchronize()
        ph["load_ok"] = [(r.job_id, r.success) for r in got] == [(job, True)]
        ph["bytes_equal"] = bool(torch.equal(big[:, dst[0]:dst[-1] + 1], big[:, src[0]:src[-1] + 1]))
        m.complete_load(keys, CTX)
        ph["worker"] = {k: w.counters()[k] for k in ("load_retries", "disconnects", "reconnects",
                                                     "failed_load_jobs")}
        ph["ok"] = ph["load_ok"] and ph["bytes_equal"] and ph["hits"] == KEYS and not ph.get("reported_while_gone")
        phases.append(ph)
    return phases


class _Passed:
    """A mark that never waits: the control run without the fence."""

    def synchronize(self):
        pass


def queued(m, w, big, name, fenced=True):
    """A store and a load submitted behind GPU work still queued on the
    current stream, as vLLM submits them at the start of a step while the
    last one runs (async scheduling): a spin kernel, then the copy that
    writes the blocks the store reads, or the zeroing of the blocks the
    load writes. The store must hold the copied bytes and the load's
    blocks the loaded ones; submit_* must return without waiting for the
    GPU. fenced=False replaces the worker's stream marks with marks that
    never wait (the control: the check must see the difference)."""
    import torch
    keys = [S.offload_key((name, "queued", fenced, i)) for i in range(KEYS)]
    # Blocks the restarts phase does not compare: its sources are 0..KEYS-1.
    src, dst = list(range(BLOCKS - KEYS, BLOCKS)), list(range(KEYS, 2 * KEYS))
    pattern = torch.randint(-128, 128, (LAYERS, KEYS, PAGE), dtype=torch.int8, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    torch.cuda._sleep(SPIN_CYCLES)
    torch.cuda.synchronize()
    out = {"fenced": fenced, "gpu_ahead_s": round(time.perf_counter() - t0, 4)}
    own = w._fence
    if not fenced:
        w._fence = _Passed
    try:
        answer(m, keys[0])
        prep = m.prepare_store(keys, CTX)
        torch.cuda._sleep(SPIN_CYCLES)
        big[:, src[0]:src[-1] + 1].copy_(pattern)
        t0 = time.perf_counter()
        assert w.submit_store(5000, V.GPULoadStoreSpec(src, [len(src)], [0]), prep.store_spec)
        out["submit_store_s"] = round(time.perf_counter() - t0, 6)
        out["gpu_busy_after_store_submit"] = not torch.cuda.current_stream().query()
        w.wait({5000})
        got = []
        d.wait_for(lambda: got.extend(w.get_finished()) or got, what="the store's result")
        m.complete_store(prep.keys_to_store, CTX, success=got[0].success)
        out["store_ok"] = got[0].success
        out["hits"] = sum(answer(m, k) == V.LookupResult.HIT for k in keys)
        load = m.prepare_load(keys, CTX)
        torch.cuda._sleep(SPIN_CYCLES)
        big[:, dst[0]:dst[-1] + 1].zero_()
        t0 = time.perf_counter()
        assert w.submit_load(5001, load, V.GPULoadStoreSpec(dst, [len(dst)], [0]))
        out["submit_load_s"] = round(time.perf_counter() - t0, 6)
        out["gpu_busy_after_load_submit"] = not torch.cuda.current_stream().query()
        w.wait({5001})
        got = []
        d.wait_for(lambda: got.extend(w.get_finished()) or got, what="the load's result")
        torch.cuda.synchronize()
        m.complete_load(keys, CTX)
        out["load_ok"] = got[0].success
        out["bytes_equal"] = bool(torch.equal(big[:, dst[0]:dst[-1] + 1], pattern))
    finally:
        w._fence = own
    out["ok"] = (out["store_ok"] and out["load_ok"] and out["hits"] == KEYS and out["bytes_equal"]
                 and out["gpu_busy_after_store_submit"] and out["gpu_busy_after_load_submit"])
    return out


def mid_chunk(dm, caches, big, name):
    """Chunks of 4 GPU blocks (a spec of blocks_per_chunk 4 over the same
    CUDA tensors, on its own connection): three chunks stored from blocks
    0-11, then a load that starts inside a chunk (block index 1, 11
    blocks: the GPU prefix cache holds block 0) and one that ends inside
    one (block index 0, 10 blocks), into blocks 16..; on the GPU, the
    loaded blocks must equal their sources and blocks 0-47 else keep
    their bytes."""
    import torch
    spec = MAKE_SPEC(dm.socket, chunk=4)
    m = spec.get_manager()
    w = spec.get_worker(caches)
    out = {"blocks_per_chunk": 4, "loads": []}
    try:
        keys = [S.offload_key((name, "chunk", i)) for i in range(3)]
        out["then"] = answer(m, keys[0]).name
        prep = m.prepare_store(keys, CTX)
        st, _ = run_transfer(w, 9000, True, prep.store_spec, list(range(12)))
        m.complete_store(prep.keys_to_store, CTX, success=st.success)
        out["store_ok"] = st.success
        job = 9000
        for first, n in [(1, 11), (0, 10)]:
            want_keys = keys[first // 4:(first + n - 1) // 4 + 1]
            hits = [answer(m, k) for k in want_keys]
            big[:, 16:48].fill_(7)
            torch.cuda.synchronize()
            before = big[:, :48].clone()
            want = before.clone()
            want[:, 16:16 + n] = before[:, first:first + n]
            job += 1
            ld, _ = run_transfer(w, job, False, m.prepare_load(want_keys, CTX), list(range(16, 16 + n)), first)
            torch.cuda.synchronize()
            m.complete_load(want_keys, CTX)
            out["loads"].append({"first": first, "blocks": n, "keys": len(want_keys),
                                 "hits": sum(h == V.LookupResult.HIT for h in hits), "load_ok": ld.success,
                                 "bytes_equal": bool(torch.equal(big[:, :48], want)),
                                 "load_bytes": ld.transfer_size, "want_bytes": n * LAYERS * PAGE})
    finally:
        w.shutdown()
        m.shutdown()
    out["ok"] = out.get("then") == "MISS" and out.get("store_ok", False) and len(out["loads"]) == 2 and all(
        ld["load_ok"] and ld["bytes_equal"] and ld["hits"] == ld["keys"] and ld["load_bytes"] == ld["want_bytes"]
        for ld in out["loads"])
    return out


def check_mount(name, root):
    import torch
    out = {"mount": name, "root": root}
    # A fresh directory per run: keys are the same every run, and files a
    # previous run left would answer HIT before the first store.
    import shutil
    import tempfile
    os.makedirs(root, exist_ok=True)
    root = tempfile.mkdtemp(prefix="run-", dir=root)
    out["root"] = root
    dm = d.Daemon(capacity="16GiB", dir=root, extra_toml='[gpu]\nmode = "on"\n')
    try:
        spec = MAKE_SPEC(dm.socket)
        out["spec_class"] = f"{type(spec).__module__}.{type(spec).__name__} ({CLASSES})"
        big = torch.randint(-128, 128, (LAYERS, BLOCKS, PAGE), dtype=torch.int8, device="cuda")
        caches = V.CanonicalKVCaches([V.CanonicalKVCacheTensor(big[i], PAGE) for i in range(LAYERS)],
                                     [[V.CanonicalKVCacheRef(i, PAGE) for i in range(LAYERS)]])
        m = spec.get_manager()
        w = spec.get_worker(caches)
        out["namespace"] = w.namespaces[0]
        rounds, stored = [], []
        job = 0
        for r in range(ROUNDS):
            keys = [S.offload_key((name, r, i)) for i in range(KEYS)]
            src = list(range(KEYS))
            dst = list(range(KEYS, 2 * KEYS))
            first = m.lookup(keys[0], CTX)
            miss = answer(m, keys[0])
            prep = m.prepare_store(keys, CTX)
            assert prep.keys_to_store == keys
            job += 1
            st, st_wall = run_transfer(w, job, True, prep.store_spec, src)
            m.complete_store(prep.keys_to_store, CTX, success=st.success)
            hits = [answer(m, k) for k in keys]
            big[:, KEYS:2 * KEYS].zero_()
            torch.cuda.synchronize()
            load_spec = m.prepare_load(keys, CTX)
            job += 1
            ld, ld_wall = run_transfer(w, job, False, load_spec, dst)
            torch.cuda.synchronize()
            equal = bool(torch.equal(big[:, KEYS:2 * KEYS], big[:, :KEYS]))
            m.complete_load(keys, CTX)
            stored.append((keys, src))
            gib = st.transfer_size / (1 << 30)
            rounds.append({
                "first_lookup": first.name, "then": miss.name,
                "hits": sum(h == V.LookupResult.HIT for h in hits),
                "store_ok": st.success, "load_ok": ld.success, "bytes_equal": equal,
                "store_bytes": st.transfer_size, "load_bytes": ld.transfer_size,
                "store_GBps": round(st.transfer_size / st_wall / 1e9, 2),
                "load_GBps": round(ld.transfer_size / ld_wall / 1e9, 2),
                "store_s": round(st_wall, 4), "load_s": round(ld_wall, 4), "GiB": round(gib, 3)})
        # Ceiling in the same run: the same pages GPU -> pinned host by torch.
        host = torch.empty((LAYERS, KEYS, PAGE), dtype=torch.int8, pin_memory=True)
        src_pages = big[:, :KEYS]
        host.copy_(src_pages, non_blocking=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        host.copy_(src_pages, non_blocking=True)
        torch.cuda.synchronize()
        out["ceiling_d2h_GBps"] = round(host.numel() / (time.perf_counter() - t0) / 1e9, 2)
        out["rounds"] = rounds
        out["queued"] = queued(m, w, big, name)
        out["queued_unfenced_control"] = queued(m, w, big, name, fenced=False)
        out["restarts"] = restarts(dm, m, w, big, stored)
        stats = m.get_stats()  # what vLLM collects every step: its OffloadingConnectorStats
        out["manager_stats_payload"] = None if stats is None else {
            name: {",".join(labels): v for labels, v in values.items()} for name, values in stats.data["data"].items()}
        out["manager"] = m.counters()
        out["worker"] = w.counters()
        from kvhost import Client
        with Client(dm.socket) as c:
            out["daemon"] = {k: v for k, v in c.stats().items() if not isinstance(v, list)}
        w.shutdown()
        m.shutdown()
        out["mid_chunk"] = mid_chunk(dm, caches, big, name)
        out["ok"] = all(r["store_ok"] and r["load_ok"] and r["bytes_equal"] and r["hits"] == KEYS
                        and r["then"] == "MISS" for r in rounds) and all(ph["ok"] for ph in out["restarts"]) \
            and out["queued"]["ok"] and not out["queued_unfenced_control"]["bytes_equal"] \
            and out["mid_chunk"]["ok"]  # the unfenced control shows the check can fail
    except Exception as e:  # report, with the daemon's log
        import traceback
        out["ok"] = False
        out["error"] = "".join(traceback.format_exception(e))[-3000:]
        out["daemon_log"] = dm.logs()[-4000:]
    finally:
        dm.stop()
        shutil.rmtree(root, ignore_errors=True)
    return out


def main():
    if os.environ.get("KVHOST_GPU") != "1":
        print("GPU check: set KVHOST_GPU=1 on a machine with a GPU and torch")
        return 0
    import torch
    if not torch.cuda.is_available():
        print("KVHOST_GPU=1 but torch sees no CUDA device")
        return 1
    global V, MAKE_SPEC, CLASSES, CTX
    V, MAKE_SPEC, CLASSES = classes()
    CTX = V.ReqContext(req_id="gpu-check")
    mounts = [("tmpfs", os.environ.get("KVHOST_GPU_TMPFS", "/dev/shm/kvhost-spec")),
              ("disk", os.environ.get("KVHOST_GPU_DISK", "/var/tmp/kvhost-spec"))]
    report = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "classes": CLASSES,
              "layers": LAYERS, "page_bytes": PAGE, "keys_per_job": KEYS,
              "results": [check_mount(n, r) for n, r in mounts]}
    text = json.dumps(report, indent=1, default=str)
    print(text)
    if len(sys.argv) > 1:
        pathlib.Path(sys.argv[1]).write_text(text)
    return 0 if all(r["ok"] for r in report["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
