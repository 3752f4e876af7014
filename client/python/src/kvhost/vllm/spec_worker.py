"""The GPU-worker side of KvhostOffloadingSpec (vLLM's offloading worker).

The worker registers its CanonicalKVCaches tensors with the daemon — CUDA
tensors by CUDA IPC, host tensors by the shared-memory file behind them —
declares one namespace per KV-cache group at its TP rank (one plane per
layer whose block is exactly one page) and registers one daemon cache per
group. Transfers become daemon jobs: a key's blocks are its chunk's GPU
blocks in that group, and the daemon moves every layer's page of each.
"""

import logging
import os
import threading
import time

from .. import protocol as p
from ..client import Client, ConnectionLost, KvhostError, Layer
from . import spec_compat as sc
from ._common import mapping_of as _mapping_of, open_mapped as _open_mapped

log = logging.getLogger("kvhost.vllm")


class _Transfer:
    """One vLLM job: its daemon jobs and what the result needs."""
    __slots__ = ("job_id", "load", "jobs", "nkeys", "t0", "error", "reported")

    def __init__(self, job_id, load, nkeys):
        self.job_id, self.load, self.nkeys = job_id, load, nkeys
        self.jobs, self.t0, self.error, self.reported = [], time.monotonic(), None, False


class SpecWorker:
    """Moves blocks between this worker's KV-cache tensors and the daemon."""

    def __init__(self, config, kv_caches, api=None, opts=None):
        self._api = api or sc.SPEC_FALLBACK
        self._opts = o = opts or sc.options(config)
        self._bpc = sc.blocks_per_chunk(config)
        tensors = [getattr(t, "tensor", t) for t in (getattr(kv_caches, "tensors", None) or kv_caches)]
        if not tensors:
            raise ValueError("kvhost.vllm: the worker got no KV-cache tensors")
        groups = sc.groups_of(config, o)
        refs = getattr(kv_caches, "group_data_refs", None)
        if refs is None:
            if len(groups) != 1:
                raise ValueError(f"kvhost.vllm: {len(groups)} KV-cache groups but no group_data_refs")
            refs = [[(i, groups[0][1]) for i in range(len(tensors))]]
        refs = [[(int(r[0]), int(r[1])) if isinstance(r, (tuple, list)) else
                 (int(getattr(r, "tensor_idx")), int(getattr(r, "page_size_bytes"))) for r in g] for g in refs]
        if len(refs) != len(groups):
            raise ValueError(f"kvhost.vllm: the worker has {len(refs)} KV-cache groups, the config {len(groups)}")
        self.rank = sc.worker_rank(config, o)
        self._tensors = tensors
        self._lock = threading.Lock()
        self._transfers = {}
        self._stats = {k: 0 for k in ("store_jobs", "load_jobs", "store_keys", "stored_keys", "present_keys",
                                      "not_admitted_keys", "store_failed_keys", "load_keys", "loaded_keys",
                                      "load_failed_keys", "failed_load_jobs", "bytes_stored", "bytes_loaded")}
        self._regions = {}   # storage address -> (region id, offset of the storage in the region)
        self._caches = []    # per group: (cache id, num blocks)
        try:
            self._client = Client(o["socket"], name=f"{o['client_name']}-worker{self.rank}")
        except OSError as e:
            raise ConnectionError(f"kvhost.vllm: cannot connect to the kvhost daemon at {o['socket']}: {e}") from e
        try:
            self.namespaces = []
            for g, (names, page) in enumerate(groups):
                if names and len(names) != len(refs[g]):
                    raise ValueError(f"kvhost.vllm: KV-cache group {g} has {len(names)} layers in the config "
                                     f"and {len(refs[g])} tensors in the worker")
                desc = sc.describe(config, o, g, self.rank)
                if not names:
                    desc["layer_names"] = [str(i) for i, _ in refs[g]]
                geo = sc.geometry(desc)
                ns = self._client.declare(geo)
                self.namespaces.append(geo.model)
                layers, blocks = [], None
                for ti, unpadded in refs[g]:
                    if unpadded != page:
                        raise ValueError(f"kvhost.vllm: tensor {ti} of group {g} has {unpadded}-byte pages, the "
                                         f"config says {page}: the scheduler's namespace would differ")
                    layers.append(self._layer(tensors[ti], page, ti))
                    blocks = layers[-1].num_blocks if blocks is None else min(blocks, layers[-1].num_blocks)
                self._caches.append((self._client.register_cache(ns, layers), blocks))
        except BaseException:
            self._client.close()
            raise
        log.info("kvhost spec: worker rank %d: %d tensors in %d regions, namespaces %s", self.rank,
                 len(tensors), len(self._regions), self.namespaces)

    # -- registration ----------------------------------------------------------

    def _layer(self, t, page, ti):
        shape, es = tuple(t.shape), t.element_size()
        if len(shape) < 2 or t.stride(0) <= 0:
            raise ValueError(f"kvhost.vllm: tensor {ti} has shape {shape}: want (num_blocks, page bytes...)")
        row = t.stride(0) * es
        inner = es
        for d in shape[1:]:
            inner *= d
        if not t[0].is_contiguous() or inner < page or row < page:
            raise ValueError(f"kvhost.vllm: tensor {ti} (shape {shape}, strides {t.stride()}) does not hold "
                             f"contiguous {page}-byte pages")
        region, base = self._region_of(t)
        off = base + t.storage_offset() * es
        return Layer(region, offset=off, block_stride=row, plane_stride=0, num_blocks=shape[0])

    def _region_of(self, t):
        st = t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()
        addr = st.data_ptr()
        if addr in self._regions:
            return self._regions[addr]
        if getattr(t, "is_cuda", False):
            reg = (self._client.register_cuda_tensor(t), 0)
        else:
            reg = self._register_host(addr, st.nbytes())
        self._regions[addr] = reg
        return reg

    def _register_host(self, addr, size):
        """Host memory: the shared-memory file behind the mapping (a memfd or a
        /dev/shm file), registered unsealed."""
        m = _mapping_of(addr, size)
        if m is None:
            raise ValueError("kvhost.vllm: a host KV-cache tensor is not one file mapping: allocate it in "
                             "shared memory (kvhost.torch_host_tensor) to use it with the daemon")
        lo, hi, off, path = m
        if not path.startswith("/"):
            raise ValueError(f"kvhost.vllm: a host KV-cache tensor lies in private memory ({path or 'anonymous'}): "
                             "allocate it in shared memory (kvhost.torch_host_tensor, a memfd or a /dev/shm "
                             "file) to use it with the daemon")
        fd = _open_mapped(lo, hi, path)
        try:
            file_off = off + (addr - lo)
            region = self._client.register_shared_file(fd, file_off + size)
        finally:
            os.close(fd)
        return region, file_off

    # -- transfers -------------------------------------------------------------

    def _plan(self, job_id, gpu_spec, kv_spec):
        """Per group: (cache, keys, blocks per key) of a job."""
        ids = [int(b) for b in gpu_spec.block_ids]
        sizes = getattr(gpu_spec, "group_sizes", None)
        sizes = [len(ids)] if sizes is None else [int(s) for s in sizes]
        if sum(sizes) != len(ids):
            raise ValueError(f"kvhost.vllm: job {job_id}: group sizes {sizes} do not add up to {len(ids)} blocks")
        out, start = [], 0
        for g, n in enumerate(sizes):
            gblocks = ids[start:start + n]
            start += n
            gkeys = [k for k, kg in zip(kv_spec.keys, kv_spec.groups) if kg == g]
            if not gkeys and not gblocks:
                continue
            if g >= len(self._caches):
                raise ValueError(f"kvhost.vllm: job {job_id}: group {g} of {len(self._caches)}")
            if len(gblocks) != len(gkeys) * self._bpc:
                raise ValueError(f"kvhost.vllm: job {job_id}: group {g} has {len(gkeys)} keys of {self._bpc} blocks "
                                 f"but {len(gblocks)} GPU blocks (partial chunks are not transferred)")
            cache, nblocks = self._caches[g]
            bad = [b for b in gblocks if not 0 <= b < nblocks]
            if bad:
                raise ValueError(f"kvhost.vllm: job {job_id}: block {bad[0]} outside the cache's {nblocks} blocks")
            per = [gblocks[i * self._bpc:(i + 1) * self._bpc] for i in range(len(gkeys))]
            out.append((cache, gkeys, per))
        return out

    def _submit(self, job_id, gpu_spec, kv_spec, load):
        plan = self._plan(job_id, gpu_spec, kv_spec)
        tr = _Transfer(job_id, load, len(kv_spec.keys))
        try:
            for cache, keys, blocks in plan:
                for i in range(0, len(keys), p.MAX_KEYS_PER_REQUEST):
                    sl = slice(i, i + p.MAX_KEYS_PER_REQUEST)
                    fn = self._client.load if load else self._client.store
                    tr.jobs.append(fn(cache, keys[sl], blocks[sl]))
        except (KvhostError, ConnectionLost, OSError, TimeoutError) as e:
            tr.error = e
            log.warning("kvhost spec: %s job %d: %s", "load" if load else "store", job_id, e)
        with self._lock:
            self._transfers[job_id] = tr
            self._stats["load_jobs" if load else "store_jobs"] += 1
        return True

    def submit_store(self, job_id, src_spec, dst_spec):
        """Starts storing the GPU blocks of src_spec under dst_spec's keys."""
        return self._submit(job_id, src_spec, dst_spec, load=False)

    def submit_load(self, job_id, src_spec, dst_spec):
        """Starts loading src_spec's keys into the GPU blocks of dst_spec."""
        return self._submit(job_id, dst_spec, src_spec, load=True)

    def _result(self, tr):
        """TransferResult of a finished transfer. A store that failed (wholly
        or for some keys) still succeeds for vLLM — the keys are simply not
        stored and later lookups miss — and is counted; a load succeeds only
        when every key loaded (vLLM crashes the worker otherwise: its blocks
        hold no valid data)."""
        outcomes, nbytes, err = [], 0, tr.error
        for j in tr.jobs:
            try:
                r = j.wait(0)
            except Exception as e:  # the connection was lost under the job
                err = err or e
                continue
            outcomes += [o for o, _ in r.keys]
            nbytes += r.bytes
            if r.message and any(o == p.OUTCOME_FAILED for o, _ in r.keys):
                err = err or r.message
        missing = tr.nkeys - len(outcomes)
        s = self._stats
        if tr.load:
            loaded = sum(1 for o in outcomes if o == p.OUTCOME_LOADED)
            ok = loaded == tr.nkeys and err is None
            s["load_keys"] += tr.nkeys
            s["loaded_keys"] += loaded
            s["load_failed_keys"] += tr.nkeys - loaded
            s["bytes_loaded"] += nbytes
            if not ok:
                s["failed_load_jobs"] += 1
                log.error("kvhost spec: load job %d failed: %d of %d keys loaded (%s)", tr.job_id, loaded,
                          tr.nkeys, err or "missing keys")
        else:
            ok = True
            stored = sum(1 for o in outcomes if o == p.OUTCOME_STORED)
            present = sum(1 for o in outcomes if o == p.OUTCOME_PRESENT)
            declined = sum(1 for o in outcomes if o == p.OUTCOME_NOT_ADMITTED)
            failed = tr.nkeys - stored - present - declined
            s["store_keys"] += tr.nkeys
            s["stored_keys"] += stored
            s["present_keys"] += present
            s["not_admitted_keys"] += declined
            s["store_failed_keys"] += failed
            s["bytes_stored"] += nbytes
            if failed or missing:
                log.warning("kvhost spec: store job %d: %d of %d keys not stored (%s)", tr.job_id, failed,
                            tr.nkeys, err or "failed")
        return self._api.TransferResult(job_id=tr.job_id, success=ok, transfer_size=nbytes,
                                        transfer_time=time.monotonic() - tr.t0)

    def get_finished(self):
        """Results of the jobs finished since the last call."""
        with self._lock:
            done = [tr for tr in self._transfers.values() if all(j.done() for j in tr.jobs)]
            for tr in done:
                del self._transfers[tr.job_id]
            return [self._result(tr) for tr in done]

    def wait(self, job_ids):
        """Blocks until the jobs finished (each given job_timeout_s, then
        cancelled); get_finished reports them."""
        timeout = self._opts["job_timeout_s"] or None
        with self._lock:
            trs = [self._transfers[j] for j in job_ids if j in self._transfers]
        for tr in trs:
            for j in tr.jobs:
                try:
                    j.wait(timeout)
                except TimeoutError:
                    try:
                        j.cancel()
                        j.wait(timeout)
                    except Exception as e:
                        log.warning("kvhost spec: job %d: %s", tr.job_id, e)
                except Exception:  # reported by get_finished
                    pass

    def get_stats(self):
        with self._lock:
            s = dict(self._stats)
            s["inflight_jobs"] = len(self._transfers)
        s["namespaces"] = list(self.namespaces)
        s["rank"] = self.rank
        return s

    def shutdown(self):
        """Waits for the jobs in flight, then closes the connection (the
        daemon drops the registrations). Idempotent."""
        with self._lock:
            ids = list(self._transfers)
        self.wait(ids)
        self._client.close()
