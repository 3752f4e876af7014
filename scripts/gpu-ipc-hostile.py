"""Hostile CUDA IPC clients against a running kvhost daemon, on a GPU machine.

usage: python3 scripts/gpu-ipc-hostile.py SOCKET [--log DAEMON_LOG] [--pid DAEMON_PID]

While a well-behaved client (a child process with its own torch tensor,
namespace and cache) stores random blocks, poisons other blocks, loads the
keys into them and compares byte for byte, round after round, this script
plays the misbehaving clients of issue 8:

  a. a forged IPC handle (random bytes);
  b. a handle registered on another device ordinal (refused; with two
     GPUs and peer access, accepted and counted on the device named);
  c. a range outside the exported allocation;
  d. a stale handle (memory freed before registration);
  e. a client process SIGKILLed with store and load jobs in flight;
  f. a client that frees its registered memory (cuMemFree) mid-job.

For each case it checks what the misbehaving client sees (error type, code,
and that the message names what was wrong), that the daemon is alive (with
--pid), that registered GPU memory returns to its figure before the case
(the Stats request), and that the good client completes a full round
trip, 0 keys differing, that started after the case ended. One line per
case: `case X: PASS|FAIL <what was seen>`; exit status 1 on any FAIL.

The daemon must serve GPU memory on device 0 (a CUDA runtime and driver);
its cache directory should be on tmpfs (the jobs of e and f move GiBs).
The Python client is taken from client/python/src beside this script's
scripts/ directory (or KVHOST_PYTHONPATH).
"""
import argparse
import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback

_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.environ.get("KVHOST_PYTHONPATH") or os.path.join(_root, "client", "python", "src"))
import kvhost  # noqa: E402

BAD_HANDLE = kvhost.CODES.index("bad IPC handle")
INVALID = kvhost.CODES.index("invalid argument")
MiB = 1 << 20


def emit(obj):
    """One JSON line to the parent."""
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


# -- the CUDA driver API through ctypes (raw allocations torch would cache) --

class Driver:
    """The few driver calls the cases need: cuMemAlloc/cuMemFree of memory
    torch's caching allocator does not own, its IPC handle, and the size
    of an allocation (cuMemGetAddressRange)."""

    def __init__(self):
        self.lib = ctypes.CDLL("libcuda.so.1")
        for name in ("cuInit", "cuDeviceGet", "cuDevicePrimaryCtxRetain", "cuCtxGetCurrent",
                     "cuCtxSetCurrent", "cuMemAlloc_v2", "cuMemFree_v2", "cuIpcGetMemHandle",
                     "cuMemGetAddressRange_v2", "cuMemsetD8_v2", "cuCtxSynchronize", "cuGetErrorName"):
            getattr(self.lib, name).restype = ctypes.c_int
        self.lib.cuMemFree_v2.argtypes = [ctypes.c_uint64]
        self.lib.cuMemsetD8_v2.argtypes = [ctypes.c_uint64, ctypes.c_ubyte, ctypes.c_size_t]
        self.check(self.lib.cuInit(0), "cuInit")

    def name(self, code):
        s = ctypes.c_char_p()
        if self.lib.cuGetErrorName(code, ctypes.byref(s)) != 0 or not s.value:
            return f"CUresult {code}"
        return f"{s.value.decode()} ({code})"

    def check(self, code, what):
        if code != 0:
            raise RuntimeError(f"{what}: {self.name(code)}")

    def context(self, ordinal=0):
        """Makes device ordinal's primary context current unless one is."""
        cur = ctypes.c_void_p()
        self.check(self.lib.cuCtxGetCurrent(ctypes.byref(cur)), "cuCtxGetCurrent")
        if cur.value:
            return
        dev = ctypes.c_int()
        self.check(self.lib.cuDeviceGet(ctypes.byref(dev), ordinal), "cuDeviceGet")
        ctx = ctypes.c_void_p()
        self.check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
        self.check(self.lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")

    def alloc(self, n):
        p = ctypes.c_uint64()
        self.check(self.lib.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(n)), f"cuMemAlloc({n})")
        return p.value

    def free(self, p):
        """cuMemFree; returns the status (0: freed)."""
        return self.lib.cuMemFree_v2(p)

    def ipc_handle(self, p):
        h = ctypes.create_string_buffer(64)
        self.check(self.lib.cuIpcGetMemHandle(h, ctypes.c_uint64(p)), "cuIpcGetMemHandle")
        return h.raw

    def address_range(self, p):
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        self.check(self.lib.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(p)),
                   "cuMemGetAddressRange")
        return base.value, size.value

    def memset(self, p, value, n):
        self.check(self.lib.cuMemsetD8_v2(p, value, n), "cuMemsetD8")
        self.check(self.lib.cuCtxSynchronize(), "cuCtxSynchronize")


def llama_geometry(model, tokens_per_key=256):
    """Llama-3.1-8B bf16 at one rank: 32 layers, 8 KV heads of 128, 16-token blocks."""
    return kvhost.Geometry(model=model, layers=32, kv_heads=8, head_size=128, dtype_size=2,
                           tokens_per_block=16, tokens_per_key=tokens_per_key)


def layers_of(region, base, geo, num_blocks):
    """vLLM's layout: one (num_blocks, page) view per layer, K and V packed in the page."""
    page = geo.planes * geo.block_bytes
    return [kvhost.Layer(region, offset=base + l * num_blocks * page, block_stride=page,
                         plane_stride=geo.block_bytes, num_blocks=num_blocks) for l in range(geo.layers)]


def outcome_counts(results):
    counts = {}
    for r in results:
        for name in r.outcomes():
            counts[name] = counts.get(name, 0) + 1
    return counts


def stop_on_stdin(stop):
    """Sets stop when the parent writes a line or closes stdin."""
    def run():
        sys.stdin.readline()
        stop.set()
    threading.Thread(target=run, daemon=True).start()


# -- child roles ---------------------------------------------------------------

def role_good(sock):
    """The well-behaved client: round after round, store 16 keys of random
    blocks, poison other blocks, load the keys into them, compare on the
    GPU, delete the keys. One JSON line per round; runs until stdin says stop."""
    import torch
    geo = kvhost.Geometry(model="kvhost/hostile-good", layers=4, kv_heads=8, head_size=128, dtype_size=2,
                          tokens_per_block=16, tokens_per_key=64)
    page = geo.planes * geo.block_bytes
    bpk = geo.tokens_per_key // geo.tokens_per_block
    nkeys = 16
    num_blocks = 2 * nkeys * bpk
    half = num_blocks // 2
    kv = torch.empty((geo.layers, num_blocks, page), dtype=torch.int8, device="cuda:0")
    gen = torch.Generator(device="cuda:0").manual_seed(11)
    cpu = torch.Generator().manual_seed(5)
    stop = threading.Event()
    stop_on_stdin(stop)
    c = kvhost.Client(sock, name="good")
    ns = c.declare(geo)
    region = c.register_cuda_tensor(kv)
    cache = c.register_cache(ns, layers_of(region, kv.storage_offset() * kv.element_size(), geo, num_blocks))
    emit({"ready": True, "bytes": kv.numel()})
    rounds = compared = differ_total = failed_rounds = 0
    while not stop.is_set():
        rec = {"round": rounds, "t0": time.time()}
        try:
            perm = torch.randperm(half, generator=cpu).tolist()
            src = [perm[i * bpk:(i + 1) * bpk] for i in range(nkeys)]
            dst = [[half + b for b in s] for s in src]
            kv[:, :half].copy_(torch.randint(-128, 127, (geo.layers, half, page), generator=gen,
                                             device="cuda:0", dtype=torch.int8))
            kv[:, half:].fill_(-91)  # 0xA5: poisoned destinations
            torch.cuda.synchronize()
            keys = [f"good-{os.getpid()}-{rounds}-{i}".encode() for i in range(nkeys)]
            st = c.store(cache, keys, src).wait(120)
            ld = c.load(cache, keys, dst).wait(120)
            torch.cuda.synchronize()
            differ = sum(1 for s, d in zip(src, dst) if not torch.equal(kv[:, s], kv[:, d]))
            c.delete(ns, keys)
            stored = st.count(kvhost.OUTCOME_STORED)
            loaded = ld.count(kvhost.OUTCOME_LOADED)
            rec.update(stored=stored, loaded=loaded, differ=differ,
                       ok=stored == nkeys and loaded == nkeys and differ == 0)
            if not rec["ok"]:
                rec["outcomes"] = [st.outcomes(), ld.outcomes(), st.message, ld.message]
            compared += nkeys
            differ_total += differ
        except Exception as e:  # noqa: BLE001 (reported to the parent)
            rec.update(ok=False, error=f"{type(e).__name__}: {e}")
        rec["t1"] = time.time()
        failed_rounds += not rec["ok"]
        emit(rec)
        rounds += 1
        if not c.connected():
            break
    c.close()
    emit({"summary": True, "rounds": rounds, "keys_compared": compared, "keys_differ": differ_total,
          "failed_rounds": failed_rounds})


def role_kill(sock):
    """Case e's victim: registers a 1 GiB paged cache (torch), stores 16
    keys of 32 MiB, then keeps 16 store and load jobs in flight until it is
    killed; prints REGISTERED and RUNNING for the parent."""
    import torch
    geo = llama_geometry("kvhost/hostile-doomed")
    page = geo.planes * geo.block_bytes
    bpk = geo.tokens_per_key // geo.tokens_per_block
    num_blocks = 512
    half = num_blocks // 2
    nkeys = half // bpk
    kv = torch.empty((geo.layers, num_blocks, page), dtype=torch.int8, device="cuda:0")
    kv.random_(-128, 127)
    torch.cuda.synchronize()
    c = kvhost.Client(sock, name="doomed")
    ns = c.declare(geo)
    region = c.register_cuda_tensor(kv)
    cache = c.register_cache(ns, layers_of(region, kv.storage_offset() * kv.element_size(), geo, num_blocks))
    emit({"registered": kvhost.cuda_ipc_handle(kv)[3]})
    src = [list(range(i * bpk, (i + 1) * bpk)) for i in range(nkeys)]
    dst = [[half + b for b in s] for s in src]
    keys = [f"doomed-{os.getpid()}-{i}".encode() for i in range(nkeys)]
    c.store(cache, keys, src).wait(120)
    n = 0
    pending = []

    def submit():
        nonlocal n
        k = n % (nkeys // 2)
        if n % 2:
            fresh = [f"doomed-{os.getpid()}-new-{n}-{j}".encode() for j in range(2)]
            pending.append(c.store(cache, fresh, src[2 * k:2 * k + 2]))
        else:
            pending.append(c.load(cache, keys[2 * k:2 * k + 2], dst[2 * k:2 * k + 2]))
        n += 1

    while len(pending) < 16:
        submit()
    emit({"running": sum(not j.done() for j in pending), "submitted": n})
    while True:  # until SIGKILL
        for j in [j for j in pending if j.done()]:
            pending.remove(j)
            submit()
        time.sleep(0.002)


def role_free(sock):
    """Case f's culprit: registers a raw cuMemAlloc allocation (512 MiB),
    stores 8 keys, starts 8 store and load jobs and frees the memory
    (cuMemFree) while they run; then waits for them, tries one more store
    and load from the freed memory, unregisters, and reports what it saw."""
    drv = Driver()
    drv.context(0)
    geo = llama_geometry("kvhost/hostile-freer")
    page = geo.planes * geo.block_bytes
    bpk = geo.tokens_per_key // geo.tokens_per_block
    num_blocks = 256
    half = num_blocks // 2
    nkeys = half // bpk
    size = geo.layers * num_blocks * page
    ptr = drv.alloc(size)
    drv.memset(ptr, 0x5A, size)
    c = kvhost.Client(sock, name="freer")
    ns = c.declare(geo)
    region = c.register_cuda(0, drv.ipc_handle(ptr), 0, size)
    cache = c.register_cache(ns, layers_of(region, 0, geo, num_blocks))
    emit({"registered": size})
    src = [list(range(i * bpk, (i + 1) * bpk)) for i in range(nkeys)]
    dst = [[half + b for b in s] for s in src]
    keys = [f"freer-{os.getpid()}-{i}".encode() for i in range(nkeys)]
    setup = c.store(cache, keys, src).wait(120)
    out = {"setup": outcome_counts([setup])}
    jobs = []
    for k in range(nkeys // 2):
        jobs.append(c.load(cache, keys[2 * k:2 * k + 2], dst[2 * k:2 * k + 2]))
        fresh = [f"freer-{os.getpid()}-new-{k}-{j}".encode() for j in range(2)]
        jobs.append(c.store(cache, fresh, src[2 * k:2 * k + 2]))
    out["inflight_at_free"] = sum(not j.done() for j in jobs)
    code = drv.free(ptr)
    out["free"] = "ok" if code == 0 else drv.name(code)
    results, errors = [], []
    for j in jobs:
        try:
            results.append(j.wait(120))
        except Exception as e:  # noqa: BLE001 (reported)
            errors.append(f"{type(e).__name__}: {e}")
    out["jobs"] = outcome_counts(results)
    out["job_errors"] = errors
    out["messages"] = sorted({r.message for r in results if r.message})[:3]
    after = []
    try:
        fresh = [f"freer-{os.getpid()}-after".encode()]
        after.append(c.store(cache, fresh, src[:1]).wait(120))
        after.append(c.load(cache, keys[:1], dst[:1]).wait(120))
        out["after_free"] = outcome_counts(after)
        out["after_messages"] = sorted({r.message for r in after if r.message})[:2]
    except Exception as e:  # noqa: BLE001 (reported)
        out["after_free"] = f"{type(e).__name__}: {e}"
    try:
        c.unregister_cache(cache)
        c.unregister_memory(region)
        out["unregister"] = "ok"
    except Exception as e:  # noqa: BLE001 (reported)
        out["unregister"] = f"{type(e).__name__}: {e}"
    c.close()
    emit({"result": out})


# -- the parent ------------------------------------------------------------------

class Child:
    """A role running in a child process, its JSON lines collected by a thread."""

    def __init__(self, sock, role):
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), sock, "--role", role],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        self.lines = []
        self.cond = threading.Condition()
        self.err = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._read_err, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                obj = {"text": line.rstrip()}
            with self.cond:
                self.lines.append(obj)
                self.cond.notify_all()
        with self.cond:
            self.lines.append({"eof": True})
            self.cond.notify_all()

    def _read_err(self):
        for line in self.proc.stderr:
            self.err.append(line.rstrip())

    def wait_for(self, pred, timeout):
        """The first line satisfying pred, or None after timeout or EOF."""
        deadline = time.time() + timeout
        with self.cond:
            i = 0
            while True:
                while i < len(self.lines):
                    obj = self.lines[i]
                    i += 1
                    if pred(obj):
                        return obj
                    if obj.get("eof"):
                        return None
                left = deadline - time.time()
                if left <= 0:
                    return None
                self.cond.wait(left)

    def stderr_tail(self):
        return " | ".join(self.err[-3:])


class Hostile:
    def __init__(self, sock, log, pid):
        self.sock, self.log, self.pid = sock, log, pid
        self.results = []
        self.good = None
        self.c = None

    def report(self, case, ok, what):
        self.results.append(ok)
        print(f"case {case}: {'PASS' if ok else 'FAIL'} {what}", flush=True)

    # checks shared by the cases

    def devices(self):
        """(regions, bytes) registered on device 0, over all clients."""
        d = self.c.stats()["devices"]
        if not d:
            raise RuntimeError("the daemon reports no GPU (Stats has no devices): is it running with a CUDA runtime?")
        return d[0]["regions"], d[0]["registered"]

    def alive(self):
        if self.pid is None:
            return True
        try:
            os.kill(self.pid, 0)
            return True
        except ProcessLookupError:
            return False

    def good_after(self, t, timeout=120):
        """The good client's first round that started after t; None if none
        ended in time."""
        return self.good.wait_for(lambda o: "round" in o and o["t0"] > t, timeout)

    def served(self, t):
        """(ok, words): the daemon is alive and served a good round that began after t."""
        if not self.alive():
            return False, "the daemon process is gone"
        r = self.good_after(t)
        if r is None:
            return False, "the good client completed no round after the case"
        if not r["ok"]:
            return False, f"the good client's round after the case failed: {r}"
        return True, f"good client round {r['round']} after it: 16/16 keys stored, loaded, 0 differ"

    def wait_devices(self, want, timeout=60):
        deadline = time.time() + timeout
        got = self.devices()
        while got != want and time.time() < deadline:
            time.sleep(0.05)  # polling the daemon's Stats for a condition, with a deadline
            got = self.devices()
        return got

    def log_offset(self):
        try:
            return os.path.getsize(self.log) if self.log else 0
        except OSError:
            return 0

    def log_since(self, off, needle, timeout=10):
        """Lines of the daemon log after byte off that contain needle (waits up to timeout)."""
        if not self.log:
            return None
        deadline = time.time() + timeout
        while True:
            with open(self.log, errors="replace") as f:
                f.seek(off)
                hits = [ln.strip() for ln in f if needle in ln]
            if hits or time.time() >= deadline:
                return hits
            time.sleep(0.1)

    def expect_refused(self, fn, code, words):
        """Runs fn; returns (ok, text) where ok means a KvhostError of code
        whose message contains every one of words."""
        try:
            rid = fn()
        except kvhost.KvhostError as e:
            named = all(w in e.message for w in words)
            ok = e.code == code and named
            return ok, f"{type(e).__name__} [{kvhost.CODES[e.code]}] {e.message!r}"
        try:
            self.c.unregister_memory(rid)
        except kvhost.KvhostError:
            pass
        return False, f"accepted as region {rid}"

    def case(self, name, fn):
        """Runs one case; its line says what the misbehaving client saw, and
        whether the good client's rounds during and after it passed."""
        t = time.time()
        try:
            before = self.devices()
            ok, what = fn()
            if name in "abcd":  # a refusal imports nothing
                after = self.wait_devices(before, timeout=5)
                if after != before:
                    ok, what = False, what + f"; device 0 (regions, bytes) {before} -> {after}"
        except Exception as e:  # noqa: BLE001 (a case that breaks is a FAIL, not the end)
            where = traceback.extract_tb(e.__traceback__)[-1]
            ok, what = False, f"{type(e).__name__}: {e} (line {where.lineno})"
        end = time.time()
        sok, swhat = self.served(end)
        with self.good.cond:
            during = [o for o in self.good.lines if "round" in o and o["t0"] < end and o["t1"] > t]
        bad = [o for o in during if not o["ok"]]
        if bad:
            sok, swhat = False, swhat + f"; {len(bad)} of its rounds during the case failed: {bad[0]}"
        else:
            swhat += f" ({len(during)} rounds overlapped the case, all passed)"
        self.report(name, ok and sok, f"{what}; {swhat}")

    # the cases

    def case_a(self):
        forged = os.urandom(64)
        ok, seen = self.expect_refused(lambda: self.c.register_cuda(0, forged, 0, 4096), BAD_HANDLE, ["IPC handle"])
        return ok, f"forged 64-byte handle: {seen}"

    def case_b(self):
        import torch
        t = torch.empty(4 * MiB, dtype=torch.uint8, device="cuda:0")
        dev, handle, off, size = kvhost.cuda_ipc_handle(t)
        ngpu = torch.cuda.device_count()
        if ngpu < 2:
            ok, seen = self.expect_refused(lambda: self.c.register_cuda(1, handle, off, size), INVALID, ["device 1"])
            return ok, (f"device 0's handle claimed as device 1: {seen}; a real other device's handle on device 0 "
                        f"cannot be made here ({ngpu} GPU): the CPU test with the fake 2-device runtime covers it")
        t1 = torch.empty(4 * MiB, dtype=torch.uint8, device="cuda:1")
        _, h1, off1, size1 = kvhost.cuda_ipc_handle(t1)
        ok0, seen0 = self.claimed_elsewhere(1, handle, off, size)
        ok1, seen1 = self.claimed_elsewhere(0, h1, off1, size1)
        return ok0 and ok1, f"device 0's handle claimed as device 1: {seen0}; device 1's handle claimed as device 0: {seen1}"

    def device_counts(self, ordinal):
        """(regions, bytes) registered on device ordinal, over all clients."""
        for d in self.c.stats()["devices"]:
            if d["ordinal"] == ordinal:
                return d["regions"], d["registered"]
        raise RuntimeError(f"the daemon does not report device {ordinal}")

    def claimed_elsewhere(self, ordinal, handle, off, size):
        """Registers another device's handle as device ordinal's. Without
        peer access between the devices the import fails (bad IPC handle);
        with it (NVLink) the driver imports the allocation as ordinal's and
        cannot tell it apart, so the daemon accepts it: then it must count
        it on ordinal and give the count back when it is unregistered."""
        before = self.device_counts(ordinal)
        try:
            rid = self.c.register_cuda(ordinal, handle, off, size)
        except kvhost.KvhostError as e:
            ok = e.code == BAD_HANDLE and "IPC handle" in e.message
            return ok, f"refused: {type(e).__name__} [{kvhost.CODES[e.code]}] {e.message!r}"
        during = self.device_counts(ordinal)
        self.c.unregister_memory(rid)
        after = self.device_counts(ordinal)
        ok = during == (before[0] + 1, before[1] + size) and after == before
        return ok, (f"accepted over peer access as region {rid}, counted on device {ordinal}: "
                    f"(regions, bytes) {before} -> {during}, {after} after unregistering")

    def case_c(self):
        import torch
        t = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda:0")
        dev, handle, off, size = kvhost.cuda_ipc_handle(t)
        try:
            drv = Driver()
            base, alloc = drv.address_range(t.data_ptr())
        except Exception as e:  # noqa: BLE001 (fall back to the storage size)
            base, alloc = None, off + size
            print(f"   (driver API unavailable: {e}; using the storage's end as the allocation's)", flush=True)
        tries = [("one page past the end", off, alloc - off + 4096),
                 ("offset at the end", alloc, 4096),
                 ("offset 1 TiB", 1 << 40, 4096)]
        seen, ok = [], True
        for label, o, n in tries:
            k, s = self.expect_refused(lambda: self.c.register_cuda(0, handle, o, n), INVALID,
                                       ["not inside the exported allocation"])
            ok &= k
            seen.append(f"{label} [{o}, +{n}): {s}")
        rid = self.c.register_cuda(0, handle, off, size)  # the control: the real range is accepted
        self.c.unregister_memory(rid)
        return ok, f"allocation of {alloc} bytes: " + "; ".join(seen) + "; the exact range is accepted"

    def case_d(self):
        import torch
        drv = Driver()
        torch.cuda.synchronize()
        drv.context(0)
        p = drv.alloc(4 * MiB)
        h = drv.ipc_handle(p)
        drv.check(drv.free(p), "cuMemFree")
        ok, seen = self.expect_refused(lambda: self.c.register_cuda(0, h, 0, 4096), BAD_HANDLE, ["IPC handle"])
        what = f"cuMemFree'd allocation's handle: {seen}"
        # torch's variant: a tensor shared with _share_cuda_, deleted, cache emptied.
        t = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda:0")
        _, th, toff, tsize = kvhost.cuda_ipc_handle(t)
        del t
        torch.cuda.empty_cache()
        try:
            rid = self.c.register_cuda(0, th, toff, tsize)
            self.c.unregister_memory(rid)
            what += ("; torch tensor deleted + empty_cache(): handle still accepted "
                     "(torch keeps a block shared by _share_cuda_ allocated while its IPC reference counter is held)")
        except kvhost.KvhostError as e:
            what += f"; torch tensor deleted + empty_cache(): refused [{kvhost.CODES[e.code]}] {e.message!r}"
        return ok, what

    def case_e(self):
        base = self.devices()
        off = self.log_offset()
        ch = Child(self.sock, "kill")
        reg = ch.wait_for(lambda o: "registered" in o or "eof" in o, 120)
        if not reg or "registered" not in reg:
            ch.proc.kill()
            return False, f"the child did not register: {ch.stderr_tail()}"
        mid = self.devices()
        run = ch.wait_for(lambda o: "running" in o or "eof" in o, 120)
        if not run or "running" not in run:
            ch.proc.kill()
            return False, f"the child did not start its jobs: {ch.stderr_tail()}"
        os.kill(ch.proc.pid, signal.SIGKILL)
        t_kill = time.time()
        ch.proc.wait()
        after = self.wait_devices(base)
        t_rel = time.time() - t_kill
        ok = after == base and mid[1] == base[1] + reg["registered"]
        what = (f"killed with {run['running']} of 16 jobs in flight; device 0 (regions, bytes) "
                f"{base} -> {mid} registered -> {after} {t_rel:.2f}s after SIGKILL")
        hits = self.log_since(off, "client left with jobs in flight")
        if hits is not None:
            doomed = [h for h in hits if "doomed" in h]
            ok &= bool(doomed)
            what += f"; daemon log: {doomed[0] if doomed else 'no line about the killed client'}"
        return ok, what

    def case_f(self):
        base = self.devices()
        ch = Child(self.sock, "free")
        res = ch.wait_for(lambda o: "result" in o or "eof" in o, 200)
        rc = ch.proc.wait(timeout=30)
        if not res or "result" not in res:
            return False, f"the child reported nothing (exit status {rc}): {ch.stderr_tail()}"
        r = res["result"]
        after = self.wait_devices(base)
        ended = not r["job_errors"] and sum(r["jobs"].values()) == 16  # 8 jobs of 2 keys
        ok = rc == 0 and ended and after == base and r["unregister"] == "ok"
        return ok, (f"cuMemFree: {r['free']} with {r['inflight_at_free']} of 8 jobs in flight; their keys: {r['jobs']}"
                    f"{' ' + str(r['messages']) if r['messages'] else ''}; job errors {r['job_errors']}; "
                    f"after the free: {r['after_free']} {r.get('after_messages', '')}; unregister {r['unregister']}; "
                    f"child exit {rc}; device 0 back to {after} (was {base})")

    def run(self):
        self.good = Child(self.sock, "good")
        ready = self.good.wait_for(lambda o: "ready" in o or "eof" in o, 120)
        first = self.good_after(0) if ready and "ready" in ready else None
        if not first or not first["ok"]:
            print(f"FAIL: the good client did not start: {first} {self.good.stderr_tail()}", flush=True)
            self.good.proc.kill()
            return 1
        import torch  # the parent's own tensors (cases b-d)
        torch.zeros(1, device="cuda:0")
        self.c = kvhost.Client(self.sock, name="hostile")
        try:
            for name in "abcdef":
                self.case(name, getattr(self, "case_" + name))
        finally:
            self.good.proc.stdin.write("stop\n")
            self.good.proc.stdin.flush()
            summary = self.good.wait_for(lambda o: "summary" in o or "eof" in o, 120)
            self.good.proc.wait(timeout=30)
            self.c.close()
        if not summary or "summary" not in summary:
            print(f"FAIL: the good client gave no summary: {self.good.stderr_tail()}", flush=True)
            return 1
        s = summary
        ok = s["keys_differ"] == 0 and s["failed_rounds"] == 0 and all(self.results)
        print(f"good client: {s['rounds']} rounds, {s['keys_compared']} keys compared byte for byte, "
              f"{s['keys_differ']} differ, {s['failed_rounds']} rounds failed", flush=True)
        print("hostile IPC checks " + ("OK" if ok else "FAILED"), flush=True)
        return 0 if ok else 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("socket")
    ap.add_argument("--log", help="the daemon's log file (case e looks for its line there)")
    ap.add_argument("--pid", type=int, help="the daemon's process id (checked alive after each case)")
    ap.add_argument("--role", choices=["good", "kill", "free"], help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.role:
        {"good": role_good, "kill": role_kill, "free": role_free}[a.role](a.socket)
        return 0
    return Hostile(a.socket, a.log, a.pid).run()


if __name__ == "__main__":
    sys.exit(main())
