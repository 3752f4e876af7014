"""The spec worker's transfers: vLLM's store and load jobs planned per
KV-cache group into daemon jobs (one per group), sent once the CUDA work
they follow is done (the stream fence), collected, retried where a load
was lost with the connection, and waited for.
"""

import logging
import threading
import time

from .. import protocol as p
from ..client import ConnectionLost, KvhostError
from ._common import reason, wait_ended
from ._connect import lost_connection

log = logging.getLogger("vllm.kvhost")


class _Transfer:
    """One vLLM job: its daemon jobs and what the result needs. A load
    keeps its specs: when the connection it ran on is lost, it is loaded
    again on the next one, and when the daemon refused it for room, again
    on this one (lost_at: when its first loss or refusal was seen)."""
    __slots__ = ("job_id", "load", "jobs", "nkeys", "t0", "error", "specs", "client", "lost", "lost_at",
                 "cancelled", "retries", "sent")

    def __init__(self, job_id, load, nkeys, specs=None):
        self.job_id, self.load, self.nkeys, self.specs = job_id, load, nkeys, specs
        self.jobs, self.t0, self.error = [], time.monotonic(), None
        self.sent = True         # its first run was submitted (False while it waits for vLLM's stream)
        self.client = None       # the connection its last run went to
        self.lost = False        # that run met a lost connection, or the daemon cancelled it
        self.lost_at = None      # when a lost connection (or a refusal for room) first failed it
        self.cancelled = False   # the worker cancelled it (wait's timeout): never loaded again
        self.retries = 0


class _Collected:
    """What a transfer's finished daemon jobs said (full: the daemon
    refused one for a limit of jobs in flight: its connection's, or the
    memory of its process's or every client's jobs)."""
    __slots__ = ("outcomes", "nbytes", "error", "lost", "full")

    def __init__(self, outcomes, nbytes, error, lost, full):
        self.outcomes, self.nbytes, self.error, self.lost, self.full = outcomes, nbytes, error, lost, full


def _stream_fence(tensors):
    """For CUDA KV caches, a function that marks the work queued so far on
    the current CUDA stream of their device and returns the mark: an
    object whose synchronize() returns once that work has run. None for
    host memory. The daemon copies the blocks from another process,
    outside vLLM's streams: a store must not read KV the model has not
    finished writing, nor a load write blocks that queued work (zeroing)
    will write after it. So each job is sent only once its mark is
    passed, as vLLM's own offloading worker makes its copy stream wait for
    the compute stream. Marking does not wait: vLLM's thread goes on."""
    cuda = [t for t in tensors if getattr(t, "is_cuda", False)]
    if not cuda:
        return None
    import torch
    device = cuda[0].device

    def mark():
        # blocking: the thread that waits on it sleeps instead of spinning a core.
        ev = torch.cuda.Event(blocking=True)
        ev.record(torch.cuda.current_stream(device))
        return ev
    return mark


class SpecTransfers:
    """The transfers half of the spec worker (SpecWorker)."""

    def _plan(self, job_id, gpu_spec, kv_spec, caches, load=True):
        """Per group: (cache, keys, blocks per key) of a job, and what could
        not be planned: [(group, keys, why)].

        A group's GPU blocks are logically contiguous from block index
        block_indices[g]; with blocks_per_chunk > 1 its first chunk may
        start s = block_indices[g] % blocks_per_chunk blocks in (the GPU
        prefix cache holds the chunk's first blocks) and its last chunk
        may be covered only in part, so a group of n blocks has
        cdiv(s + n, blocks_per_chunk) keys. A load names its blocks and
        NO_BLOCK for the rest of those chunks: the daemon loads the named
        blocks and still verifies whole keys. A store moves whole keys
        only: a chunk it covers in part is left out (reported in what
        could not be planned) and the group's other chunks are stored."""
        bpc = self._bpc
        ids = [int(b) for b in gpu_spec.block_ids]
        sizes = getattr(gpu_spec, "group_sizes", None)
        sizes = [len(ids)] if sizes is None else [int(s) for s in sizes]
        starts = getattr(gpu_spec, "block_indices", None)
        starts = [0] * len(sizes) if starts is None else [int(b) for b in starts]
        by_group = {}
        for k, kg in zip(kv_spec.keys, kv_spec.groups):
            by_group.setdefault(kg, []).append(k)
        if sum(sizes) != len(ids):
            return [], [(None, list(kv_spec.keys), f"group sizes {sizes} do not add up to {len(ids)} blocks")]
        out, bad, start = [], [], 0
        for g in sorted(set(by_group) | set(range(len(sizes)))):
            n = sizes[g] if g < len(sizes) else 0
            gblocks = ids[start:start + n]
            start += n
            gkeys = by_group.get(g, [])
            if not gkeys and not gblocks:
                continue
            if g >= len(caches):
                bad.append((g, gkeys, f"group {g} of {len(caches)}"))
                continue
            first = starts[g] if g < len(starts) else 0
            skip = first % bpc if first >= 0 else 0
            want = -(-(skip + n) // bpc) if n else 0
            if first < 0 or len(gkeys) != want:
                bad.append((g, gkeys, f"group {g} has {len(gkeys)} keys of {bpc} blocks but {n} GPU blocks from "
                                      f"block index {first} (want {want} keys)"))
                continue
            cache, nblocks = caches[g]
            outside = [b for b in gblocks if not 0 <= b < nblocks]
            if outside:
                bad.append((g, gkeys, f"block {outside[0]} outside the cache's {nblocks} blocks"))
                continue
            tail = len(gkeys) * bpc - skip - n
            slots = [p.NO_BLOCK] * skip + gblocks + [p.NO_BLOCK] * tail
            per = [slots[i * bpc:(i + 1) * bpc] for i in range(len(gkeys))]
            if not load and (skip or tail):
                # A key is stored whole or not at all: the chunks this
                # store covers in part are left out.
                whole = [i for i, blocks in enumerate(per) if p.NO_BLOCK not in blocks]
                part = [gkeys[i] for i in range(len(gkeys)) if i not in whole]
                bad.append((g, part, f"group {g}: {len(part)} chunk(s) of {bpc} blocks covered in part (from block "
                                     f"index {first}, {n} blocks): a chunk is stored whole or not at all"))
                gkeys, per = [gkeys[i] for i in whole], [per[i] for i in whole]
                if not gkeys:
                    continue
            out.append((cache, gkeys, per))
        return out, bad

    def _submit(self, job_id, gpu_spec, kv_spec, load):
        """Starts a job; always True (vLLM asserts it). What cannot be moved
        is reported by get_finished: a load fails, a store leaves those keys
        out (they are simply not stored; later lookups miss). With CUDA KV
        caches the job is marked on vLLM's stream here and sent by the
        worker's sender thread once the GPU has passed the mark."""
        with self._lock:
            self._check_locked()
        tr = _Transfer(job_id, load, len(kv_spec.keys), (gpu_spec, kv_spec) if load else None)
        mark = None
        if self._fence is None:
            self._start(tr, gpu_spec, kv_spec)
        else:
            try:
                mark = self._fence()
            except Exception as e:  # a CUDA error: nothing moves
                tr.error = f"marking vLLM's CUDA stream: {e}"
                log.error("kvhost spec: job %d: %s", job_id, tr.error)
        with self._lock:
            if mark is not None and self._closing:  # the sender is gone: nothing would send it
                mark, tr.error = None, "the worker was shut down"
            if mark is not None and self._sender is None:
                # Started before the job is queued: a thread that cannot
                # start fails this submit, not every later job.
                t = threading.Thread(target=self._send_fenced, daemon=True, name=f"kvhost-{self._what}-sender")
                t.start()
                self._sender = t
            self._transfers[job_id] = tr
            self._stats["load_jobs" if load else "store_jobs"] += 1
            if mark is not None:
                tr.sent = False
                self._fenced.append((tr, gpu_spec, kv_spec, mark))
                self._cv.notify_all()
        return True

    def _send_fenced(self):
        """The sender thread: sends each marked job, in submission order,
        once the GPU has passed its mark. Once shutdown has begun closing,
        a job not yet sent is not sent (nor its mark waited for): it ends
        with an error. Sends happen under _send_lock, so that shutdown,
        having set _closing, waits for one under way and then knows no
        other begins."""
        while True:
            with self._cv:
                while not self._fenced and not self._closing:
                    self._cv.wait()
                if not self._fenced:
                    return
                tr, gpu_spec, kv_spec, mark = self._fenced[0]
                closing = self._closing
            why, started = None, False
            try:
                if closing:
                    why = "the worker shut down before the job was sent"
                if why is None:
                    try:
                        mark.synchronize()
                    except Exception as e:  # a CUDA error: the job moves nothing
                        why = f"waiting for vLLM's CUDA stream: {e}"
                        log.error("kvhost spec: job %d: %s", tr.job_id, why)
                with self._send_lock:
                    with self._lock:
                        if why is None and self._closing:
                            why = "the worker shut down before the job was sent"
                    if why is None:
                        started = True
                        self._start(tr, gpu_spec, kv_spec)
            except BaseException as e:  # never leave this job, and every one after it, unsent
                why = f"sending the job: {e!r}"
                log.exception("kvhost spec: job %d: %s", tr.job_id, why)
            finally:
                if why is not None:
                    if not started:
                        tr.jobs, tr.lost = [], False
                    # else its daemon jobs sent before the error stay: it ends with them
                    tr.error = why
                with self._cv:
                    self._fenced.popleft()
                    tr.sent = True
                    self._cv.notify_all()

    def _start(self, tr, gpu_spec, kv_spec):
        """Submits tr's daemon jobs on the connection in use (its first run,
        or a load's run again after a lost connection). A store while a new
        connection registers the caches waits for it first
        (_await_registration_locked)."""
        with self._cv:
            if not tr.load:
                self._await_registration_locked()
            client, caches, broken = self._client, self._caches, self._broken
        plan, bad = self._plan(tr.job_id, gpu_spec, kv_spec, caches, tr.load)
        kind = "load" if tr.load else "store"
        tr.jobs, tr.error, tr.lost, tr.client = [], None, False, client
        if broken is not None:  # no daemon: nothing moves (a load waits; a store's keys are not stored)
            plan, tr.error, tr.lost = [], f"no daemon connection ({broken})", True
        for g, gkeys, why in bad:
            log.warning("kvhost spec: %s job %d: %s", kind, tr.job_id, why)
            if tr.load:
                tr.error = f"job {tr.job_id}: {why}"
                tr.lost = False  # no connection makes this load possible
            else:
                tr.nkeys -= len(gkeys)
                with self._lock:
                    self._stats["store_skipped_keys"] += len(gkeys)
        try:
            for cache, keys, blocks in plan:
                for i in range(0, len(keys), p.MAX_KEYS_PER_REQUEST):
                    sl = slice(i, i + p.MAX_KEYS_PER_REQUEST)
                    fn = client.load if tr.load else client.store
                    # Sent; the daemon's acceptance is not waited for on vLLM's thread.
                    tr.jobs.append(fn(cache, keys[sl], blocks[sl], block=False))
        except (KvhostError, ConnectionLost, OSError, ValueError) as e:  # ValueError: a request the client refuses
            tr.error = reason(e)
            if lost_connection(e, client):  # logged once, by _lost_locked
                tr.lost = True
                with self._lock:
                    self._lost_locked(client, tr.error)
            else:
                log.warning("kvhost spec: %s job %d: %s", kind, tr.job_id, e)

    def _await_registration_locked(self):
        """Waits, daemon_wait_s at most, while the worker is without a
        connection but sets one up whose caches the daemon may count already
        (_registering): the manager, finding them, hands out stores at
        once, and a store run before the connection is in use would move
        nothing (counted then as the manager's store_unverified_keys).
        Called with _cv held."""
        until = time.monotonic() + self._opts["daemon_wait_s"]
        while self._registering is not None and self._broken is not None and not self._closing:
            left = until - time.monotonic()
            if left <= 0:
                return
            self._cv.wait(left)

    def submit_store(self, job_id, src_spec, dst_spec):
        """Starts storing the GPU blocks of src_spec under dst_spec's keys."""
        return self._submit(job_id, src_spec, dst_spec, load=False)

    def submit_load(self, job_id, src_spec, dst_spec):
        """Starts loading src_spec's keys into the GPU blocks of dst_spec."""
        return self._submit(job_id, dst_spec, src_spec, load=True)

    def _collect_locked(self, tr):
        """What tr's finished daemon jobs said (called with _lock held)."""
        outcomes, nbytes, err, lost, full = [], 0, tr.error, tr.lost, False
        for j in tr.jobs:
            try:
                r = j.wait(0)
            except Exception as e:  # refused, or the connection was lost under the job
                err = err or reason(e)
                if lost_connection(e, j._client):
                    lost = True
                    self._lost_locked(j._client, err)
                elif isinstance(e, KvhostError) and e.code == p.CODE_LIMIT:
                    full = True  # jobs in flight (stores) took every slot or byte
                continue
            outcomes += [o for o, _ in r.keys]
            nbytes += r.bytes
            if r.message and any(o in (p.OUTCOME_FAILED, p.OUTCOME_CANCELLED) for o, _ in r.keys):
                err = err or r.message
            if not tr.cancelled and any(o == p.OUTCOME_CANCELLED for o, _ in r.keys):
                lost = True  # the daemon gave it up: it is shutting down
        return _Collected(outcomes, nbytes, err, lost, full)

    def _again_locked(self, tr, got, now):
        """Whether tr, a load that failed, is to be loaded again: on the next
        connection when its failure came from a lost connection (or a
        daemon that cancelled it), on this one when the daemon refused a
        job of it for a limit of jobs in flight (the connection's, or the
        memory of its process's or every client's jobs: they end, and room
        comes); if it was not cancelled by
        the worker, and load_retry_s has not passed since its first loss or
        refusal. vLLM stops the worker on a failed load, so a load waits
        for a daemon, or for room, rather than fail. Its daemon jobs have
        all ended: no daemon writes into its blocks any more."""
        if not (tr.load and (got.lost or got.full)) or tr.cancelled:
            return False
        if got.outcomes and all(o == p.OUTCOME_LOADED for o in got.outcomes) and len(got.outcomes) == tr.nkeys:
            return False
        limit = self._opts["load_retry_s"]
        if limit <= 0 or (got.lost and self._opts["reconnect_s"] <= 0):
            return False
        if tr.lost_at is None:
            tr.lost_at = now
            if got.lost:
                log.warning("kvhost spec: load job %d lost the daemon connection (%s); loading it again once "
                            "connected (for up to %gs)", tr.job_id, got.error, limit)
            else:
                log.warning("kvhost spec: load job %d refused (%s); sending it again as jobs end (for up to %gs)",
                            tr.job_id, got.error, limit)
        return now - tr.lost_at < limit

    def _result(self, tr, got):
        """TransferResult of a finished transfer. A store that failed (wholly
        or for some keys) still succeeds for vLLM — the keys are simply not
        stored and later lookups miss — and is counted; a load succeeds only
        when every key loaded (vLLM crashes the worker otherwise: its blocks
        hold no valid data)."""
        outcomes, nbytes, err = got.outcomes, got.nbytes, got.error
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
            elif tr.retries:
                log.info("kvhost spec: load job %d loaded after %d retries on a new connection", tr.job_id,
                         tr.retries)
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
                # Without a daemon connection every store fails alike: the
                # loss was logged once, and each job is counted only.
                (log.debug if got.lost else log.warning)(
                    "kvhost spec: store job %d: %d of %d keys not stored (%s)", tr.job_id, failed, tr.nkeys,
                    err or "failed")
        return self._api.TransferResult(job_id=tr.job_id, success=ok, transfer_size=nbytes,
                                        transfer_time=time.monotonic() - tr.t0)

    def _check_locked(self):
        """Notices a connection the daemon closed (vLLM calls get_finished
        every step; submit checks too)."""
        if self._broken is None and not self._client.connected():
            self._lost_locked(self._client, "the daemon closed the connection")

    def get_finished(self):
        """Results of the jobs finished since the last call. A load lost
        with the connection is not finished: it is started again here once
        a new connection is up, and reported when that run ends (or failed
        once load_retry_s has passed since it was lost)."""
        now = time.monotonic()
        results, again = [], []
        with self._lock:
            self._check_locked()
            for tr in [tr for tr in self._transfers.values() if tr.sent and all(j.done() for j in tr.jobs)]:
                got = self._collect_locked(tr)
                if self._again_locked(tr, got, now):
                    if self._broken is None and (self._client is not tr.client or not got.lost):
                        again.append(tr)
                    else:  # waits for the next connection (the reconnect thread's)
                        tr.jobs, tr.error, tr.lost = [], got.error, True
                    continue
                del self._transfers[tr.job_id]
                results.append(self._result(tr, got))
            for tr in again:
                tr.retries += 1
                self._stats["load_retries"] += 1
        for tr in again:
            self._start(tr, *tr.specs)
        return results

    def wait(self, job_ids):
        """Blocks until the daemon has ended the jobs (get_finished reports
        them): vLLM reuses their blocks next, and a store still reading
        them would store other bytes under its keys. A job not done after
        job_timeout_s is asked to cancel, and waited for still, said in the
        log every job_timeout_s."""
        self._wait(job_ids, None)

    def _wait(self, job_ids, until):
        """wait, giving up at until (monotonic; None: never)."""
        timeout = self._opts["job_timeout_s"] or None
        with self._lock:
            trs = [self._transfers[j] for j in job_ids if j in self._transfers]
        for tr in trs:
            kind = "load" if tr.load else "store"
            if not self._wait_sent(tr, until):
                return
            for j in tr.jobs:
                try:
                    wait_ended(j, timeout, lambda: until, f"spec: {kind} job {tr.job_id}",
                               on_cancel=lambda tr=tr: setattr(tr, "cancelled", True))
                except TimeoutError:  # past until: shutdown gives up
                    return
                except Exception:  # ended (refused, or the connection closed): get_finished says
                    pass

    def _wait_sent(self, tr, until):
        """Waits until tr's first run was submitted (its stream's mark
        passed); False when until (monotonic; None: never) came first."""
        with self._cv:
            while not tr.sent:
                left = None if until is None else until - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(left)
        return True
