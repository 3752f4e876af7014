"""The connector scheduler's lookups: how many of a request's tokens the
daemon holds (hit_tokens: the shared lookup table, else the daemon) and
how many of them to load (get_num_new_matched_tokens: the split's
choice, a hybrid model's claim ending where its window and state groups
hold what the end needs), per request (_ReqState).
"""

import logging

from .. import protocol as p
from ..client import ConnectionLost, KvhostError
from . import _conn_groups as groups_
from . import _conn_stages as stages_
from ._common import daemon_key, reason
from ._connect import lost_connection

log = logging.getLogger("vllm.kvhost")


# Claim ends a hybrid model's lookup tries below the full-attention hit
# (each a lookup of the window and state groups' keys) before it claims
# nothing.
HYBRID_TRIES = 8


class _ReqState:
    """The scheduler's record of one request: its keys so far and its
    block ids (per KV-cache group), the lookup's answer, what it claimed,
    and its saves."""
    __slots__ = ("req", "keys", "digests", "blocks", "computed", "hit", "claimed", "next_save", "saved", "loaded",
                 "ns")

    def __init__(self, req, ns=None):
        self.req, self.keys, self.blocks = req, {}, []  # keys: group -> list; blocks: a list per group
        self.ns = ns            # the salt_namespaces name of its cache_salt (None: the engine's namespace)
        self.digests = {}       # ns -> (client, the keys' key_digests so far): hashed once per key
        self.computed = self.hit = self.claimed = 0
        self.next_save = 0      # the first chunk not yet stored nor known stored
        self.saved = False      # a save of it went to the workers (request_finished delays the free)
        self.loaded = False     # a load of it went to the workers (request_finished delays the free)


class SchedulerLookups:
    """The lookups half of the connector's scheduler (ConnectorScheduler)."""

    def _keys(self, st, group=0):
        """The request's keys of one KV-cache group so far: one per whole
        chunk of its block hashes (vLLM's offload key of the chunk's last
        hash and the group's index), as the daemon names them. Grown as
        the request's hashes grow."""
        hashes = st.req.block_hashes
        n = len(hashes) // self._hpc
        keys = st.keys.setdefault(group, [])
        if len(keys) < n:
            tail = group.to_bytes(4, "big")
            for i in range(len(keys), n):
                keys.append(daemon_key(bytes(hashes[(i + 1) * self._hpc - 1]) + tail))
        return keys

    def _state(self, request):
        st = self._reqs.get(request.request_id)
        if st is None or st.req is not request:
            salt = getattr(request, "cache_salt", None)
            st = self._reqs[request.request_id] = _ReqState(request, self._salts.get(salt) if salt else None)
        return st

    def hit_tokens(self, request, computed):
        """The end of the contiguous cached prefix from computed on (in
        tokens, chunk-aligned; computed where nothing beyond it is cached),
        found in the daemon's shared lookup table (the daemon is asked
        where the table cannot answer). A hybrid model's prefix counts
        only where every KV-cache group holds what it needs (full
        attention every chunk, a window the chunks of its window before
        the end, a state group the state at the end: _held), and under
        pipeline parallelism only where every stage holds it (each group's
        namespaces are every stage's)."""
        st = self._state(request)
        keys = self._keys(st)
        total = getattr(request, "num_prompt_tokens", None) or request.num_tokens
        last = min(len(keys), (total - 1) // self._chunk)  # vLLM computes at least one token
        first = computed // self._chunk
        if last <= first:
            return computed
        if self._stages is None:
            # A later pipeline stage's namespaces are not known yet
            # (learn_stages): no prefix is known held by every stage.
            self._stats["stages_unknown"] += 1
            return computed
        client, nss = self._ask(), self._ns
        if client is None:
            return computed
        nss = nss[st.ns]
        try:
            n = self._held(st, client, nss, first, last)
        except (KvhostError, ConnectionLost, OSError, ValueError) as e:
            self._stats["lookup_errors"] += 1
            if isinstance(e, TimeoutError):
                self._timed_out(client, e)
            elif lost_connection(e, client):
                with self._cv:
                    self._lost_locked(client, reason(e))
            else:
                log.warning("kvhost connector: lookup: %s", e)
            return computed
        return max(computed, (first + n) * self._chunk)

    def _held(self, st, client, nss, first, last):
        """How many chunks from first (up to last) every group holds for a
        claim ending after them: the full-attention groups' run of keys
        held at every rank, then, for window and state groups, the longest
        claim (HYBRID_TRIES tried, from the longest) whose needs they hold."""
        n = last - first
        for g in self._groups:
            if g.kind in (groups_.WINDOW, groups_.STATE):
                continue
            keys = self._keys(st, g.index)
            for ns in nss[g.index]:  # every rank must hold a key
                n = min(n, self._leading(client, ns, keys, first, n, self._digests(st, client, ns, keys)))
        if not self._hybrid:
            return n
        for m in range(n, max(0, n - HYBRID_TRIES), -1):
            if self._claimable(st, client, nss, first, (first + m) * self._chunk):
                return m
        return 0

    def _claimable(self, st, client, nss, first, end):
        """Whether the window and state groups hold what a claim of the
        chunks from first to end (tokens) needs (groups_.claim_needs)."""
        for g in self._groups:
            if g.kind not in (groups_.WINDOW, groups_.STATE):
                continue
            need = groups_.claim_needs(g, first, end, self._chunk)
            if not need:
                continue
            keys = self._keys(st, g.index)
            for ns in nss[g.index]:
                got = self._leading(client, ns, keys, need.start, len(need), self._digests(st, client, ns, keys))
                if got < len(need):
                    return False
        return True

    @staticmethod
    def _digests(st, client, ns, keys):
        """The request's keys' places in the lookup table (key_digests),
        made once per key and grown with its keys, for this connection;
        None where the client cannot read the table."""
        d = st.digests.get(ns)
        if d is None or d[0] is not client:
            d = st.digests[ns] = (client, bytearray())
        have = len(d[1]) // 16
        if have < len(keys):
            more = client.key_digests(ns, keys[have:])
            if more is None:
                return None
            d[1].extend(more)
        return d[1]

    @staticmethod
    def _leading(client, ns, keys, first, n, digests=None):
        """How many of keys[first:first + n] ns holds in a row, asked in
        requests of at most MAX_KEYS_PER_REQUEST keys (probed by their
        digests where there are)."""
        held = 0
        while held < n:
            want = min(n - held, p.MAX_KEYS_PER_REQUEST)
            a, b = first + held, first + held + want
            if digests is not None:
                got = client.lookup_digests(ns, keys[a:b], digests[16 * a:16 * b])
            else:
                got = client.lookup(ns, keys[a:b])
            held += got
            if got < want:
                break
        return held

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        """(K - num_computed_tokens, False): K, the tokens cached after this
        step's load, is the split's choice within the hit prefix (all of it
        with load_split "all", none with "off"). Loads run within the step,
        layer by layer: never asynchronous."""
        self._stats["lookups"] += 1
        if self._opts["load_split"] == "off" or getattr(request, "skip_reading_prefix_cache", False):
            return 0, False
        st = self._state(request)
        hit = self.hit_tokens(request, num_computed_tokens)
        total = getattr(request, "num_prompt_tokens", None) or request.num_tokens
        if hit <= num_computed_tokens:
            k = num_computed_tokens
        elif self._opts["load_split"] == "all":
            k = hit
        else:
            if self._hybrid:
                # A window group costs its window and a state group one state
                # whatever the claim's tokens: bytes every claim loads beside
                # the full-attention groups' per token (_conn_groups.claim_costs).
                # Averaged over the hit, they priced a short claim low.
                self.cost.bytes_per_token, self.cost.claim_bytes = groups_.claim_costs(
                    self._groups, hit - num_computed_tokens, self._chunk)
                if self._pp > 1:  # every stage's (its groups' layers)
                    self.cost.stages = stages_.costs(self._stage_groups, hit - num_computed_tokens, self._chunk)
            k = self.cost.split(total, num_computed_tokens, hit, self._chunk)
            if self._hybrid and num_computed_tokens < k < hit and not self._claim_ok(st, num_computed_tokens, k):
                c = num_computed_tokens
                k = hit if self.cost.ttft_s(total, c, hit) <= self.cost.ttft_s(total, c, c) else c
        st.computed, st.hit, st.claimed = num_computed_tokens, hit, k
        if hit > num_computed_tokens:
            self._stats["hit_tokens"] += hit - num_computed_tokens
            self._stats["claimed_tokens"] += k - num_computed_tokens
        return k - num_computed_tokens, False

    def _claim_ok(self, st, computed, end):
        """Whether a claim ending at end (below the hit) is one the window
        and state groups hold (False where the daemon cannot be asked)."""
        client, nss = self._ask(), self._ns
        if client is None:
            return False
        try:
            return self._claimable(st, client, nss[st.ns], computed // self._chunk, end)
        except (KvhostError, ConnectionLost, OSError, ValueError) as e:
            log.debug("kvhost connector: lookup: %s", e)
            return False
