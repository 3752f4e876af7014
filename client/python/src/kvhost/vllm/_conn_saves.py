"""The connector worker's saves: store jobs for the chunks vLLM's
scheduler asked to save, sent in order by a thread once the CUDA work
that wrote them is done, and settled per request before vLLM reuses its
blocks (finished, wait_stores).
"""

import logging
import threading
import time

from .. import protocol as p
from ..client import ConnectionLost, KvhostError
from . import _conn_groups as groups_
from ._common import daemon_state, reason, wait_ended
from ._connect import lost_connection

log = logging.getLogger("vllm.kvhost")


class ConnectorSaves:
    """The saves half of the connector's worker (ConnectorWorker)."""

    # -- saves -----------------------------------------------------------------

    def start_saves(self, meta):
        """Submits store jobs for meta.saves without waiting for them: whole
        keys, read from the blocks once the forward pass that wrote them has
        run. With CUDA KV caches the stores are marked on vLLM's stream here
        and sent by the worker's sender thread once the GPU has passed the
        mark (vLLM's thread goes on); host memory's are sent at once."""
        saves = [t for t in getattr(meta, "saves", ()) if t.keys]
        if not saves:
            return
        # The scheduler delays the free of these requests' blocks until
        # get_finished reports them, stored or not.
        self._saving.update(t.req_id for t in saves)
        # A replicated group (MLA's latent KV) is the same on every rank:
        # rank 0 writes it (every rank still reports the request finished).
        # A group none of whose layers are this pipeline stage's has nothing here.
        saves = [t for t in saves if (self.shard == 0 or not self._groups[t.group].replicated)
                 and self._groups[t.group].layer_names]
        if not saves:
            return
        if self._usable() is None:
            self._stats["store_skipped_keys"] += sum(len(t.keys) for t in saves)
            return
        freed = [t for t in saves if self._groups[t.group].kind in (groups_.WINDOW, groups_.STATE)]
        if freed:
            self._store_now(freed)
            saves = [t for t in saves if self._groups[t.group].kind not in (groups_.WINDOW, groups_.STATE)]
            if not saves:
                return
        mark = self._mark()
        if mark is None:
            self._send_saves(saves)
            return
        with self._cv:
            for t in saves:
                self._unsent[t.req_id] += 1
            self._outbox.append((mark, saves))
            if self._sender is None:
                self._sender = threading.Thread(target=self._send_loop, name=f"kvhost-{self._what}-stores",
                                                daemon=True)
                self._sender.start()
            self._cv.notify_all()

    def _store_now(self, saves):
        """Stores of groups whose blocks vLLM frees while the request runs
        (a window's blocks once they leave it, a state group's earlier
        states): vLLM may give those blocks to another request in the next
        step, so they are sent once the GPU has written them and waited
        for here, daemon_wait_s at most (a store not ended by then is
        logged: the daemon may read a reused block)."""
        self._fence()
        jobs = self._send_saves(saves)
        until = time.monotonic() + self._opts["daemon_wait_s"]
        for rid, job in jobs:
            try:
                wait_ended(job, self._opts["job_timeout_s"] or None, lambda: until,
                           f"connector: store job of {rid}")
            except TimeoutError:
                self._stats["store_waits_given_up"] += 1
                log.error("kvhost connector: a store of request %s's window or state blocks not ended by the daemon "
                          "after %gs (%s): vLLM may reuse those blocks while it reads them", rid,
                          self._opts["daemon_wait_s"], daemon_state(job._client))
            except Exception as e:  # the keys are not stored: later lookups miss
                log.debug("kvhost connector: store job of %s: %s", rid, e)

    def _mark(self):
        """For CUDA KV caches, an event recorded on vLLM's current stream
        (its synchronize() returns once the work queued so far has run);
        None for host memory."""
        cuda = [t for t in self._tensors if getattr(t, "is_cuda", False)]
        if not cuda:
            return None
        import torch
        ev = torch.cuda.Event(blocking=True)  # the waiting thread sleeps instead of spinning
        ev.record(torch.cuda.current_stream(cuda[0].device))
        return ev

    def _send_loop(self):
        """The sender thread: sends each marked batch of stores, in order,
        once the GPU has passed its mark; ends once closing with nothing
        left to send."""
        while True:
            with self._cv:
                while not self._outbox and not self._closing:
                    self._cv.wait()
                if not self._outbox:
                    return
                mark, saves = self._outbox[0]
            try:
                mark.synchronize()
                self._send_saves(saves)
            except Exception as e:  # a CUDA error: these keys are not stored
                log.error("kvhost connector: stores not sent: %s", e)
                with self._lock:
                    self._stats["store_skipped_keys"] += sum(len(t.keys) for t in saves)
            finally:
                with self._cv:
                    self._outbox.popleft()
                    for t in saves:
                        self._unsent[t.req_id] -= 1
                        if self._unsent[t.req_id] <= 0:
                            del self._unsent[t.req_id]
                    self._cv.notify_all()

    def _send_saves(self, saves):
        """Sends store jobs for saves; returns [(request id, job)]."""
        client, sent = self._client, []
        for t in saves:
            for i in range(0, len(t.keys), p.MAX_KEYS_PER_REQUEST):
                sl = slice(i, i + p.MAX_KEYS_PER_REQUEST)
                try:
                    cache = self._caches.get((t.ns, t.group)) if self._caches is not None else None
                    if cache is None:
                        raise ValueError(f"salt namespace {t.ns!r} is not in this worker's salt_namespaces")
                    job = client.store(cache, t.keys[sl], t.blocks[sl], block=False)
                except (KvhostError, ConnectionLost, OSError, ValueError) as e:
                    log.warning("kvhost connector: store: %s", e)
                    with self._cv:
                        self._stats["store_failed_keys"] += len(t.keys[sl])
                        if lost_connection(e, client):
                            self._lost_locked(client, reason(e))
                    continue
                with self._lock:
                    self._stores[t.req_id].append(job)
                    self._stats["store_jobs"] += 1
                    self._stats["store_keys"] += len(t.keys[sl])
                sent.append((t.req_id, job))
        return sent

    def _settle_stores(self, req_id, wait, until=None):
        """Drops req_id's finished store jobs (with wait, waiting for its
        stores to be sent and for every one to end, until until: monotonic,
        None: however long); True when none is left to send or in flight."""
        with self._cv:
            while wait and self._unsent.get(req_id):
                left = None if until is None else until - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._cv.wait(left)
            jobs = self._stores.pop(req_id, [])
        left = []
        for job in jobs:
            if not job.done() and not wait:
                left.append(job)
                continue
            try:
                r = wait_ended(job, self._opts["job_timeout_s"] or None, lambda: until,
                               f"connector: store job of {req_id}")
                with self._lock:
                    self._stats["stored_keys"] += r.count(p.OUTCOME_STORED)
                    self._stats["present_keys"] += r.count(p.OUTCOME_PRESENT)
                    self._stats["bytes_stored"] += r.bytes
            except TimeoutError:  # past until (shutdown): the process's exit ends it
                left.append(job)
            except Exception as e:  # the keys are not stored: later lookups miss
                with self._lock:
                    self._stats["store_failed_jobs"] += 1
                log.debug("kvhost connector: store job of %s: %s", req_id, e)
        with self._lock:
            if left:
                self._stores[req_id] = left + self._stores.get(req_id, [])
            return req_id not in self._stores and not self._unsent.get(req_id)

    def wait_stores(self, req_ids, until=None):
        """Waits for the stores of req_ids to be sent and to end, and for
        their loads given up (preempted requests: vLLM reuses their blocks
        next, and nothing holds them, so however long the daemon takes,
        logged), or until until (monotonic: shutdown)."""
        for rid in req_ids:
            self._settle_stores(rid, True, until)
            with self._lock:
                jobs = list(self._given_up.get(rid, ()))
            if jobs and until is None:
                log.warning("kvhost connector: preempted request %s has %d load jobs the daemon has not ended; "
                            "waiting for them before vLLM reuses its blocks", rid, len(jobs))
            for j in jobs:
                try:
                    wait_ended(j, self._opts["load_timeout_s"] or None, lambda: until,
                               f"connector: given-up load job of {rid}")
                except Exception:  # ended (refused, connection closed), or past until
                    pass

    def finished(self, finished_req_ids):
        """The ids of finished requests whose stores have all ended (vLLM
        frees their blocks then): those finished now and earlier. vLLM
        calls it every step: a connection the daemon closed is noticed
        here, and connected again before the next load if it can."""
        self._usable()
        for rid in finished_req_ids or ():
            if rid in self._saving or rid in self._loaded:
                self._finishing.add(rid)
        done = {rid for rid in list(self._finishing)
                if self._settle_stores(rid, False) and not self._loads_pending(rid)}
        self._finishing -= done
        self._saving -= done
        self._loaded -= done
        with self._lock:
            others = [r for r in self._stores if r not in self._finishing]
        for rid in others:
            self._settle_stores(rid, False)
        return done
