"""The spec manager's stores: which keys vLLM's workers store
(prepare_store: not held, not refused, not too many in flight), and what
the daemon was found holding once they completed (complete_store,
_verify_stored), which the stored events report.
"""

import logging
import math
import time

from .. import protocol as p
from . import spec_compat as sc

log = logging.getLogger("vllm.kvhost")


class SpecStores:
    """The stores half of the spec manager (SpecManager)."""

    def prepare_store(self, keys, req_context=None):
        """PrepareStoreOutput with the keys to store (input order kept; keys
        pinned, being stored or stored within stored_ttl_s are left out), or
        None when the daemon cannot take stores now (connection lost, shut
        down, no worker's cache registered in a namespace of the keys at the
        last pin round there — or, after a reconnection, none found there on
        this connection yet: the workers reconnect on their own — or
        max_store_keys_inflight keys already being stored). Once a rank's worker has stayed away two reconnection
        periods (_store_grace), its stores are skipped (no keys to store)
        instead of refused: vLLM logs each refusal, every step, for every
        request."""
        keys = [bytes(k) for k in keys]
        now = time.monotonic()
        with self._lock:
            if self._broken is None and not self._client.connected():
                self._lost_locked(self._client, "the daemon closed the connection")
            away = self._away_locked(keys)
            self._probe_later_locked(away, now)
            if self._broken is not None or self._closing or away:
                # Without a worker the store would move nothing, and vLLM
                # would be told (stored events) that it had.
                if self._stayed_away_locked(away, now):
                    self._stats["store_keys_skipped_no_worker"] += len(keys)
                    return self._api.PrepareStoreOutput(keys_to_store=[], store_spec=sc.KvhostLoadStoreSpec([], []),
                                                        evicted_keys=[])
                self._stats["store_refused"] += 1
                return None
            if sum(self._storing.values()) + len(keys) > self._opts["max_store_keys_inflight"]:
                self._stats["store_refused"] += 1
                return None
            ttl = self._opts["stored_ttl_s"]
            out, seen = [], set()
            for k in keys:
                if k in seen or self._storing[k] or self._verifying[k] or k in self._pinned:
                    continue
                t = self._stored_at.get(k)
                if t is not None and now - t < ttl:
                    continue
                seen.add(k)
                out.append(k)
            self._storing.update(out)
            self._stats["store_keys_prepared"] += len(out)
            self._stats["store_keys_skipped"] += len(keys) - len(out)
        spec = sc.KvhostLoadStoreSpec([sc.daemon_key(k) for k in out], [sc.key_group(k) for k in out])
        return self._api.PrepareStoreOutput(keys_to_store=out, store_spec=spec, evicted_keys=[])

    def _away_locked(self, keys):
        """The (rank, group) namespaces of keys whose last pin round found
        no worker's cache registered, or, after a reconnection, not yet
        found one on this connection, each with one of its keys: a dict
        where -> key."""
        unconfirmed = self._confirm and self._loadable
        if not (self._no_worker or unconfirmed):
            return {}
        groups = {}
        for k in keys:
            g = sc.key_group(k)
            groups.setdefault(g if g < len(self._groups) else 0, k)
        return {(r, g): k for g, k in groups.items() for r in range(self._tp)
                if (r, g) in self._no_worker or (unconfirmed and (r, g) not in self._confirmed)}

    def _probe_later_locked(self, away, now):
        """Has the manager's thread ask the daemon (_probe) whether a worker
        of each namespace in away is back: at once for one not asked on
        this connection yet, then miss_ttl_s apart. vLLM
        looks a hybrid model's later groups up only after group 0 hit, and
        hands prepare_store every group's keys at once, so no lookup may
        ever come to find the worker back."""
        for where, k in away.items():
            # Not yet asked on this connection: at once (one probe at a time).
            wait = self._opts["miss_ttl_s"] if where in self._no_worker else 0
            if where not in self._probes and now - self._probed.get(where, -math.inf) >= wait:
                self._probed[where] = now
                self._probes[where] = k
                self._cv.notify_all()

    def _stayed_away_locked(self, away, now):
        """Whether a store of keys in the namespaces away is skipped rather
        than refused: refused (vLLM asks again next step, logging each
        time) while a worker may be reconnecting, skipped once one stayed
        away longer than _store_grace."""
        grace = self._store_grace()
        return any(now - self._no_worker.get(where, now) >= grace for where in away)

    def _store_grace(self):
        """How long stores of a namespace found without a worker are
        refused, not skipped: two reconnection periods, time for a worker
        that noticed a restart to connect again (vLLM logs each refusal,
        every step, for every running request)."""
        return max(2 * self._opts["reconnect_s"], self._opts["miss_ttl_s"])

    def _probe(self, where, key):
        """Asks the daemon whether a worker's cache of (rank, group) where
        is registered now (a pin of key, released at once): _pin_loadable
        lets stores through again if one is."""
        with self._lock:
            client, nss = self._client, self._ns
            if self._broken is not None or client is None:
                return
        try:
            pin_id, _, _ = self._pin_loadable(client, nss[where], where, [sc.daemon_key(key)], 0)
            if pin_id:
                client.unpin(pin_id)
        except Exception as e:  # a lost connection is found by the next call
            log.debug("kvhost spec: asking for the workers of %s: %s", self.namespaces[where], e)

    def complete_store(self, keys, req_context=None, success=True):
        """The workers have stored keys (success) or not. A stored event
        follows once the daemon has said it holds them (the pin thread
        asks, _verify_stored): vLLM's workers report every store a success
        (vLLM asserts it), also one that moved nothing."""
        keys = [bytes(k) for k in keys]
        with self._cv:
            for k in keys:
                self._storing[k] -= 1
                if self._storing[k] <= 0:
                    del self._storing[k]
            if success:
                # Told stored: the daemon is asked (off this thread) before
                # any stored event; see _verify_stored.
                self._stats["stored_keys"] += len(keys)
                for k in keys:  # a lookup asks the daemon again
                    self._missing.pop(k, None)
                if keys:
                    self._verifying.update(keys)
                    self._verify += keys
                    self._cv.notify_all()
            else:
                self._stats["store_failed_keys"] += len(keys)

    def _verify_stored(self, keys):
        """Asks the daemon whether it holds keys, vLLM's completed stores,
        in every rank's namespace of their group (a pin of each, released
        at once); those held get a stored event and count as stored, the
        others are counted (store_unverified_keys) and may be stored again.
        No answer (no connection, an error) holds none: a stored event is
        never sent for a key the daemon was not found holding."""
        held = dict.fromkeys(keys, True)
        with self._lock:
            client, nss, broken = self._client, self._ns, self._broken
        try:
            if broken is not None or client is None:
                raise ConnectionError(broken or "no daemon connection")
            for g, gkeys in self._by_group(list(held)).items():
                for r in range(self._tp):
                    for i in range(0, len(gkeys), p.MAX_KEYS_PER_REQUEST):
                        chunk = gkeys[i:i + p.MAX_KEYS_PER_REQUEST]
                        pin_id, ok = client.pin(nss[(r, g)], [sc.daemon_key(k) for k in chunk], 0)
                        if pin_id:
                            client.unpin(pin_id)
                        for k, h in zip(chunk, ok):
                            held[k] = held[k] and h
        except Exception as e:  # a lost connection is found by the next call
            log.debug("kvhost spec: checking %d stored keys: %s", len(held), e)
            held = dict.fromkeys(held, False)
        now = time.monotonic()
        with self._lock:
            stored = []
            for k in keys:
                if self._verifying[k] > 0:  # reset_cache forgets them
                    self._verifying[k] -= 1
                    if self._verifying[k] <= 0:
                        del self._verifying[k]
                if held[k]:
                    self._stored_at[k] = now
                    self._missing.pop(k, None)
                    stored.append(k)
                else:
                    self._stats["store_unverified_keys"] += 1
            self._stats["store_verified_keys"] += len(stored)
            if len(self._stored_at) > 1 << 18:
                ttl = self._opts["stored_ttl_s"]
                self._stored_at = {k: t for k, t in self._stored_at.items() if now - t < ttl}
            if stored:
                self._removals.stored(list(dict.fromkeys(stored)))
