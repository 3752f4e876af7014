"""The tier's jobs: vLLM's stores and loads (submit_store, submit_load)
run on worker threads that move rows between vLLM's region and the daemon
(zero-copy, or through the staging memfd), report through
get_finished_jobs, and are given up on at shutdown (drain_jobs) while
the rows they may still touch are held out of vLLM's reuse (_HeldRows).
"""

import collections
import logging
import threading
import time

from .. import protocol as p
from ._common import daemon_key as _daemon_key, daemon_state, wait_ended
from ._connect import lost_connection as _lost_connection

log = logging.getLogger("vllm.kvhost")


class _Run:
    """A job vLLM submitted, from submit_* until its thread has ended it.
    started: its thread is past the point where it may touch vLLM's rows
    or the daemon (False: still queued). zero_copy: the daemon moves vLLM's
    rows themselves (not staging slots). given_up: drain_jobs reported it
    to vLLM (failed) before the daemon ended it; its thread ends it
    without reporting it again, and sends no more of it."""

    __slots__ = ("job_id", "keys", "rows", "load", "started", "zero_copy", "given_up")

    def __init__(self, job_id, keys, rows, load):
        self.job_id, self.keys, self.rows, self.load = job_id, keys, rows, load
        self.started = self.zero_copy = self.given_up = False


class _HeldRows:
    """vLLM's primary rows that jobs drain_jobs gave up on may still have
    the daemon read or write (zero-copy), kept out of vLLM's reuse until
    the daemon ends those jobs; one per primary tier, shared by every
    kvhost tier over it (of()).

    vLLM's TieringOffloadingManager.reset_cache, the one caller of
    drain_jobs, reports every job finished and then clears its primary
    tier (CPUOffloadingManager.reset_cache: every row free). Right after
    that clear (the wrapper of()'s hook puts around the primary's
    reset_cache), the rows still held are allocated through the primary
    tier's own prepare_store, under keys of kvhost's that no lookup asks
    for: a cleared primary hands out rows 0, 1, 2, ... in order, so the
    rows up to the highest held one are taken, and those not held are
    given back at once (complete_store, failed). A held row stays a store
    in flight in vLLM's books (ref_cnt -1: never evicted, never handed
    out) until release() gives it back, on the scheduler's thread
    (get_finished_jobs), once the daemon ended its jobs. Every call on
    vLLM's manager happens on the scheduler's thread; the tiers' job
    threads only change the counts here, under this object's lock."""

    def __init__(self, primary):
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self.count = collections.Counter()  # row -> given-up jobs still running on it
        self.pinned = {}                    # row -> the key it is allocated under in vLLM's primary tier
        self.freed = []                     # keys of rows no job holds any more, to give back
        self.primary = primary
        self.resets = 0                     # primary resets seen (names the keys of each)
        reset = primary.reset_cache

        def reset_cache(*args, **kwargs):
            reset(*args, **kwargs)
            self.after_reset()
        primary.reset_cache = reset_cache

    @classmethod
    def of(cls, spec, view):
        """The held rows of vLLM's primary tier (CPUPrimaryTierOffloadingManager)
        over view, reached through the spec that built the tier (its
        manager's primary_tier); made and hooked on first use. None where
        this vLLM has no such primary, or one without the calls needed."""
        m = getattr(getattr(spec, "_manager", None), "primary_tier", None)
        get_view = getattr(m, "get_kv_memoryview", None)
        if get_view is None or not all(callable(getattr(m, n, None))
                                       for n in ("reset_cache", "prepare_store", "complete_store")):
            return None
        try:
            if get_view() is not view:
                return None
        except Exception:  # noqa: BLE001 - an unknown primary is none to hook
            return None
        held = getattr(m, "_kvhost_held_rows", None)
        if held is None:
            held = m._kvhost_held_rows = cls(m)
        return held

    def hold(self, rows):
        """rows (vLLM's) are a given-up job's, which the daemon may still touch."""
        with self._lock:
            self.count.update(rows)

    def end(self, rows):
        """rows' given-up job ended: a row no other one holds is given back."""
        with self._cv:
            for r in rows:
                self.count[r] -= 1
                if self.count[r] <= 0:
                    del self.count[r]
                    k = self.pinned.pop(r, None)
                    if k is not None:
                        self.freed.append(k)
            self._cv.notify_all()

    def after_reset(self):
        """Right after the primary's clear: allocates the rows still held.
        Where the primary did not hand out every one of them (one that
        allocates otherwise), waits for the jobs still on them before vLLM
        goes on (the unbounded wait of before, logged)."""
        primary = self.primary
        with self._lock:
            self.pinned.clear()  # the clear dropped them
            self.freed = []
            rows = set(self.count)
            self.resets += 1
            gen = self.resets
        if not rows:
            return
        keys = [b"\xffkvhost-held-row:%d:%d" % (gen, i) for i in range(max(rows) + 1)]
        out = primary.prepare_store(keys, None)
        got = {} if out is None else dict(zip((int(b) for b in out.store_spec.block_ids), out.keys_to_store))
        with self._lock:
            keep = {r: got[r] for r in self.count if r in got}
            self.pinned.update(keep)
            missing = set(self.count) - set(keep)
        give = [k for r, k in got.items() if r not in keep]
        if give:
            primary.complete_store(give, None, False)
        if missing:
            log.error("kvhost tier: vLLM's primary tier did not hand out rows %s after its reset; waiting for "
                      "the daemon to end the jobs on them before vLLM reuses them", sorted(missing)[:8])
            with self._cv:
                while set(self.count) & missing:
                    self._cv.wait()
        log.warning("kvhost tier: %d rows of vLLM's CPU region held out of reuse until the daemon ends the "
                    "jobs given up on them", len(keep))

    def release(self):
        """Gives back to vLLM's primary tier the rows no given-up job holds
        any more (on the scheduler's thread)."""
        with self._lock:
            keys, self.freed = self.freed, []
        if keys:
            self.primary.complete_store(keys, None, False)


class TierJobs:
    """The jobs half of the tier (_TierImpl): what vLLM submits, the
    threads that run it, and what they report."""

    def submit_store(self, job):
        """Starts storing job.keys from primary rows job.block_ids (cascade)."""
        self._submit(job, load=False)

    def submit_load(self, job):
        """Starts loading job.keys into primary rows job.block_ids (promotion)."""
        self._submit(job, load=True)

    def _submit(self, job, load):
        keys = [bytes(k) for k in job.keys]
        ids = getattr(job, "block_ids", None)
        if ids is None:  # renamed chunk_ids in later vLLM (a row is one chunk)
            ids = job.chunk_ids
        rows = [int(b) for b in ids]
        if len(rows) != len(keys):
            raise ValueError(f"kvhost.vllm: job {job.job_id}: {len(keys)} keys, {len(rows)} block ids")
        bad = [b for b in rows if not 0 <= b < self._num_rows]
        if bad:
            raise ValueError(f"kvhost.vllm: job {job.job_id}: block id {bad[0]} outside the primary "
                             f"region's {self._num_rows} rows")
        run = _Run(job.job_id, keys, rows, load)
        with self._cv:
            if self._closing:
                raise RuntimeError("kvhost.vllm: the tier is shut down")
            self._inflight += 1
            self._runs[job.job_id] = run
            self._stats["load_jobs" if load else "store_jobs"] += 1
            if not load:
                self._storing.update(keys)
        self._pool.submit(self._run, run)

    def _run(self, run):
        t0 = time.monotonic()
        keys, load = run.keys, run.load
        outcomes = [p.OUTCOME_FAILED] * len(keys)
        with self._lock:
            s, down = self._s, self._broken
            over = self._give_up_at is not None and time.monotonic() >= self._give_up_at
            if run.given_up:  # reported by drain_jobs before it began: nothing touched
                self._runs.pop(run.job_id, None)
                self._cv.notify_all()
                return
            run.started = True
            run.zero_copy = s is not None and not s.staged
        if down is None and not over:  # else no daemon, or shutdown gave up: the job fails at once
            try:
                self._move(s, run, outcomes)
            except Exception as e:
                with self._lock:
                    self._stats["job_errors"] += 1
                if _lost_connection(e, s.client):
                    self._lost(s, e)
                elif not run.given_up:
                    log.warning("kvhost tier: %s job %d failed: %s", "load" if load else "store", run.job_id, e)
        self._finish(run, outcomes, time.monotonic() - t0, s)

    def _move(self, s, run, outcomes):
        """Moves the job's rows on session s, filling outcomes. A job
        drain_jobs gave up on sends no more daemon jobs."""
        keys, rows, load = run.keys, run.rows, run.load
        if not s.staged:
            for i in range(0, len(keys), p.MAX_KEYS_PER_REQUEST):
                if run.given_up:
                    return
                sl = slice(i, i + p.MAX_KEYS_PER_REQUEST)
                outcomes[sl] = self._transfer(s, keys[sl], rows[sl], load)
            return
        got = self._slot_ranges.get()
        if got is None:  # the tier gave up on a job at shutdown (below): pass it on, fail
            self._slot_ranges.put(None)
            raise TimeoutError("the tier is shutting down with daemon jobs not ended")
        base, per = got
        free = got  # the job ended (done, refused, connection closed): its slots are free
        try:
            for i in range(0, len(keys), per):
                if run.given_up:
                    return
                sl = slice(i, i + per)
                outcomes[sl] = self._staged(s, run, keys[sl], rows[sl], base)
        except TimeoutError:
            # Given up at shutdown: the daemon may still write these slots,
            # so no later job gets them; the jobs waiting for slots fail.
            free = None
            raise
        finally:
            self._slot_ranges.put(free)

    def _transfer(self, s, keys, blocks, load):
        dk = [_daemon_key(k) for k in keys]
        bl = [[b] for b in blocks]
        # Not waiting for the acceptance: a request the daemon has not
        # answered may still run, so only the job's end frees its rows.
        fn = s.client.load if load else s.client.store
        job = fn(s.cache, dk, bl, block=False)
        return [o for o, _ in self._wait(job).keys]

    def _wait(self, job):
        """The job's result, once the daemon has ended it (wait_ended): its
        rows (vLLM's, or the staging slots) are used again after this. Only
        once the tier's shutdown has waited job_timeout_s does a job not
        done fail (TimeoutError; the memory goes with vLLM, and no staging
        slot it held is used again). A result this thread sees only after
        the shutdown's deadline counts as given up too: whether a loaded
        machine wakes the thread for the deadline or for a result the
        resumed daemon sent after it must not change what vLLM is told."""
        r = wait_ended(job, self._opts["job_timeout_s"] or None, lambda: self._give_up_at, "tier")
        if self._give_up_at is not None and time.monotonic() >= self._give_up_at:
            raise TimeoutError("the tier's shutdown gave up on the job before its result was taken")
        return r

    def _staged(self, session, run, keys, rows, base):
        """One batch of run through the staging slots from base: the copies
        between vLLM's rows and the slots are made under the tier's lock,
        and not once drain_jobs gave the job up (vLLM may reuse its rows
        from then on; the daemon only touches the slots, which no other
        job gets before it ends the job)."""
        np, load = self._np, run.load
        st, pr = self._staging_rows, self._primary
        slots = list(range(base, base + len(keys)))
        if not load:
            with self._lock:
                if run.given_up:
                    return [p.OUTCOME_FAILED] * len(keys)
                for s, r in zip(slots, rows):
                    np.copyto(st[s], pr[r])
        out = self._transfer(session, keys, slots, load)
        if load:
            with self._lock:
                if run.given_up:
                    return [p.OUTCOME_FAILED] * len(keys)
                for s, r, o in zip(slots, rows, out):
                    if o == p.OUTCOME_LOADED:
                        np.copyto(pr[r], st[s])
        return out

    def _finish(self, run, outcomes, seconds, session):
        """Reports the job (get_finished_jobs, events, counters). The keys
        it stored answer HIT for lookup_ttl_s where session, the
        connection it ran on, is still the one in use: stored on a daemon
        since replaced, they are asked of the new one. A job drain_jobs
        gave up on was reported then: its end only gives back the rows
        held for it."""
        job_id, keys, load = run.job_id, run.keys, run.load
        api = self._api
        now = time.monotonic()
        expiry = now + self._opts["lookup_ttl_s"]
        ok_out = (p.OUTCOME_LOADED,) if load else (p.OUTCOME_STORED, p.OUTCOME_PRESENT)
        fine = ok_out if load else ok_out + (p.OUTCOME_NOT_ADMITTED,)
        good = [k for k, o in zip(keys, outcomes) if o in ok_out]
        success = all(o in fine for o in outcomes)
        # A load reports the keys it found gone, a store those it stored.
        changed = p.OUTCOME_MISSING if load else p.OUTCOME_STORED
        ks = [k for k, o in zip(keys, outcomes) if o == changed]
        result = api.JobResult(job_id=job_id, success=success, successful_keys=good)
        if hasattr(result, "transfer_time"):
            result.transfer_time = seconds
        c = collections.Counter(outcomes)
        with self._cv:
            s = self._stats
            if run.given_up:  # reported by drain_jobs; the rows held for it go back
                self._runs.pop(job_id, None)
                if run.zero_copy:
                    self._held.end(run.rows)
                s["given_up_jobs_ended"] += 1
                self._cv.notify_all()
                return
            if load:
                s["load_keys"] += len(keys)
                s["loaded_keys"] += c[p.OUTCOME_LOADED]
                s["load_missing_keys"] += c[p.OUTCOME_MISSING]
                s["load_failed_keys"] += len(keys) - c[p.OUTCOME_LOADED] - c[p.OUTCOME_MISSING]
                s["bytes_loaded"] += c[p.OUTCOME_LOADED] * self._row_bytes
                for k, o in zip(keys, outcomes):
                    if o != p.OUTCOME_LOADED:
                        self._answers[k] = (False, expiry)
            else:
                self._storing.subtract(keys)
                for k in keys:
                    if self._storing[k] <= 0:
                        del self._storing[k]
                s["store_keys"] += len(keys)
                s["stored_keys"] += c[p.OUTCOME_STORED]
                s["present_keys"] += c[p.OUTCOME_PRESENT]
                s["not_admitted_keys"] += c[p.OUTCOME_NOT_ADMITTED]
                s["store_failed_keys"] += len(keys) - sum(c[o] for o in fine)
                s["bytes_stored"] += c[p.OUTCOME_STORED] * self._row_bytes
                if session is self._s:
                    for k in good:
                        self._answers[k] = (True, expiry)
            if not success:
                s["failed_load_jobs" if load else "failed_store_jobs"] += 1
            self._finished.append(result)
            self._runs.pop(job_id, None)
            self._inflight -= 1
            self._cv.notify_all()
        if ks:  # a removal only of what a stored event announced (docs/routers.md)
            (self._removals.gone if load else self._removals.stored)(ks)

    def get_finished_jobs(self):
        """Jobs completed since the last call (JobResult with successful_keys).
        Gives back to vLLM the rows held for given-up jobs the daemon has
        ended since."""
        held = self._held
        if held is not None:
            held.release()
        with self._lock:
            out, self._finished = self._finished, []
        return out

    def drain_jobs(self):
        """Waits until every submitted job has completed, daemon_wait_s at
        most. A job the daemon has not ended by then is given up: reported
        failed (a store's keys are not stored, a promotion's rows are not
        loaded), its thread sends no more of it, and what the daemon may
        still touch is kept from vLLM's reuse until the daemon ends it or
        its connection ends (the daemon closes one only after ending its
        jobs, or dying): staging slots by the tier, vLLM's rows (zero-copy)
        as _HeldRows says. Where vLLM's primary tier cannot be reached to
        hold them, it waits as long as the daemon takes (logged)."""
        bound = self._opts["daemon_wait_s"]
        t0 = time.monotonic()
        with self._cv:
            while self._inflight and (left := t0 + bound - time.monotonic()) > 0:
                self._cv.wait(left)
            if not self._inflight:
                return
            runs = [r for r in self._runs.values() if not r.given_up]
            if any(r.started and r.zero_copy for r in runs):
                if self._held is None:
                    self._held = _HeldRows.of(self._spec, self._view)
                if self._held is None:
                    log.error("kvhost tier: %d jobs not ended by the daemon after %gs, and vLLM's primary tier "
                              "cannot be reached to keep their rows from reuse: waiting for the daemon",
                              len(runs), bound)
                    while self._inflight:
                        self._cv.wait()
                    return
            held, s = 0, self._s
            for r in runs:
                r.given_up = True
                if r.started and r.zero_copy:
                    self._held.hold(r.rows)
                    held += len(r.rows)
                self._give_up_locked(r)
            self._cv.notify_all()
        log.warning("kvhost tier: drain_jobs gave up after %gs on %d jobs the daemon has not ended (%s; %d of "
                    "vLLM's rows held out of reuse until it does); reported failed", bound, len(runs),
                    daemon_state(s.client) if s is not None else "no connection", held)

    def _give_up_locked(self, run):
        """Reports run to vLLM as failed, now (drain_jobs)."""
        result = self._api.JobResult(job_id=run.job_id, success=False, successful_keys=[])
        if hasattr(result, "transfer_time"):
            result.transfer_time = 0.0
        s = self._stats
        s["given_up_jobs"] += 1
        s["failed_load_jobs" if run.load else "failed_store_jobs"] += 1
        if run.load:
            s["load_keys"] += len(run.keys)
            s["load_failed_keys"] += len(run.keys)
        else:
            self._storing.subtract(run.keys)
            for k in run.keys:
                if self._storing[k] <= 0:
                    del self._storing[k]
            s["store_keys"] += len(run.keys)
            s["store_failed_keys"] += len(run.keys)
        self._finished.append(result)
        self._inflight -= 1

    def has_pending_work(self):
        """True while jobs run, results wait to be collected or lookups are pending."""
        with self._lock:
            return bool(self._inflight or self._finished or self._pending_lookups)
