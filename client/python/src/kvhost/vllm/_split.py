"""The load-or-recompute split of KvhostConnector: how many cached prefix
tokens to load, and how many to compute again.

With layer-wise loads the first token's time is about the larger of the
load of the claimed prefix and the computation of the rest (layer i loads
while layer i-1 computes), so a prefix is worth loading only as far as its
load ends no later than the computation of what follows it::

    TTFT(K) ~ max(load(K - C), compute(T, K))

where T is the prompt's tokens, C those already on the GPU (vLLM's prefix
cache), and K the tokens cached after the load (C <= K <= H, the hit
prefix). The load is bytes over a rate plus a latency; the computation of
the T - K tokens after K cached ones has a linear term and a quadratic
(attention) term, so the later tokens are the dear ones::

    load(n)       = n * bytes_per_token / rate + latency      (0 for n = 0)
    compute(T, K) = s * (fixed + a * (T - K) + b * (T^2 - K^2) / 2)

The rate is learned from the loads the workers time (observe_load); the
prefill model's shape (fixed, a, b) is configured and its scale s learned
from the forward passes the workers time (observe_compute), so that a
GPU faster or slower than the configured one moves the split.

Only loads measure the rate, and a low rate claims fewer tokens: a rate
learned during a slow episode could stop the loads that would measure
its end. So the learned rate drifts back to the configured one while no
load is measured (half of the way every recover_s seconds): a split
that stopped loading claims again, and its loads measure the rate anew.

Pure Python, no I/O: the connector's scheduler calls ``CostModel.split``
for every prompt (a few bisection steps, no loop over the prompt).
"""

import math
import threading
import time


class CostModel:
    """The load and prefill costs the split weighs.

    bytes_per_token: bytes one worker loads per token (its shard of every
    layer); load_gbps: the load rate in GB/s (1e9 bytes), updated by
    observe_load (an EWMA of measured jobs, weight alpha); load_latency_s:
    a load's fixed cost; prefill_s_per_token (a), prefill_s_per_token2 (b)
    and prefill_fixed_s: the prefill model, scaled by prefill_scale
    (1 at first), which observe_compute learns (an EWMA of measured
    forward passes, weight alpha). min_gain: a shorter prefix is claimed
    only where it saves more than this fraction of the TTFT (the tokens
    recomputed cost the GPU's time for other requests too). recover_s:
    while no load is measured, the learned rate moves half of the way
    back to load_gbps every recover_s seconds (0: never). clock: the
    monotonic clock in seconds (tests pass their own)."""

    # A forward pass the model prices below this is not taken into the
    # scale: decode steps and small chunks cost what the model's prefill
    # terms do not describe (weights read per step, launches).
    MIN_OBSERVED_S = 0.005

    def __init__(self, bytes_per_token, load_gbps, load_latency_s=0.0, prefill_s_per_token=2.0e-5,
                 prefill_s_per_token2=1.0e-9, prefill_fixed_s=0.0, min_gain=0.05, alpha=0.2, recover_s=30.0,
                 clock=time.monotonic):
        for name, v in (("bytes_per_token", bytes_per_token), ("load_gbps", load_gbps)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
                raise ValueError(f"kvhost.vllm: {name}: want a number > 0, got {v!r}")
        for name, v in (("load_latency_s", load_latency_s), ("prefill_s_per_token", prefill_s_per_token),
                        ("prefill_s_per_token2", prefill_s_per_token2), ("prefill_fixed_s", prefill_fixed_s),
                        ("min_gain", min_gain), ("recover_s", recover_s)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
                raise ValueError(f"kvhost.vllm: {name}: want a number >= 0, got {v!r}")
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha <= 1:
            raise ValueError(f"kvhost.vllm: alpha: want 0 < alpha <= 1, got {alpha!r}")
        self.bytes_per_token = float(bytes_per_token)
        self._prior = float(load_gbps) * 1e9  # bytes per second: the configured rate
        self._learned = self._prior  # the rate as of the last measurement
        self.recover_s = float(recover_s)
        self._clock = clock
        self._measured_at = clock()
        self.load_latency_s = float(load_latency_s)
        self.a, self.b, self.fixed = float(prefill_s_per_token), float(prefill_s_per_token2), float(prefill_fixed_s)
        self.min_gain = float(min_gain)
        self.alpha = float(alpha)
        self._lock = threading.Lock()
        self.observed = 0  # load measurements taken into the rate
        self._scale = 1.0  # measured over modelled prefill time
        self.compute_observed = 0  # forward passes taken into the scale

    @property
    def _rate(self):
        """The load rate in bytes per second: the learned one, moved back
        towards the configured one for the time no load was measured."""
        if self.recover_s <= 0 or self._learned == self._prior:
            return self._learned
        age = max(0.0, self._clock() - self._measured_at)
        return self._prior + (self._learned - self._prior) * 0.5 ** (age / self.recover_s)

    @property
    def load_gbps(self):
        """The load rate the split uses now, in GB/s."""
        return self._rate / 1e9

    def observe_load(self, nbytes, seconds):
        """Takes a measured load (nbytes moved in seconds) into the rate: an
        EWMA of weight alpha over the rate as it stands now (recovered
        for the time since the last measurement). Measurements of nothing
        are ignored."""
        if nbytes <= 0 or seconds <= 0:
            return
        with self._lock:
            now = self._rate
            self._learned = now + self.alpha * (nbytes / seconds - now)
            self._measured_at = self._clock()
            self.observed += 1

    @property
    def prefill_scale(self):
        """The measured prefill time over the configured model's, as the
        split uses it now (1 until a forward pass was observed)."""
        return self._scale

    def observe_compute(self, work, seconds):
        """Takes a measured forward pass into the prefill scale: seconds
        spent computing (waits for loads left out) for work, the pass's
        requests as (total, cached) pairs (it computed tokens cached..total
        of each). An EWMA of weight alpha of measured over modelled; a pass
        the model prices under MIN_OBSERVED_S is ignored. Returns whether
        the pass was taken."""
        modelled = self._modelled(work)
        if seconds <= 0 or modelled < self.MIN_OBSERVED_S:
            return False
        with self._lock:
            self._scale += self.alpha * (seconds / modelled - self._scale)
            self.compute_observed += 1
        return True

    def _modelled(self, work):
        """The configured model's seconds for work (unscaled): one fixed
        cost per pass, the terms of every request."""
        t = 0.0
        for total, cached in work:
            n = total - cached
            if n > 0:
                t += self.a * n + self.b * (float(total) * total - float(cached) * cached) / 2.0
        return t + self.fixed if t > 0 else 0.0

    def load_s(self, tokens):
        """Seconds to load tokens tokens (0 for none)."""
        if tokens <= 0:
            return 0.0
        return tokens * self.bytes_per_token / self._rate + self.load_latency_s

    def compute_s(self, total, cached):
        """Seconds to compute the total - cached tokens after cached ones."""
        n = total - cached
        if n <= 0:
            return 0.0
        return self._scale * (self.fixed + self.a * n + self.b * (total * total - cached * cached) / 2.0)

    def ttft_s(self, total, computed, k):
        """The modelled time to first token when k tokens are cached after
        loading k - computed of them."""
        return max(self.load_s(k - computed), self.compute_s(total, k))

    def split(self, total, computed, hit, chunk):
        """The tokens to have cached after the load, K: computed (load
        nothing) or a multiple of chunk in (computed, hit], the one of least
        modelled TTFT, or the largest whose TTFT is within min_gain of that
        least. hit is the cached prefix's end; total the prompt's tokens.
        A few bisection steps over local arithmetic: the scheduler calls it
        for every prompt with a hit."""
        if chunk <= 0:
            raise ValueError(f"kvhost.vllm: chunk {chunk}: want tokens > 0")
        lo = computed // chunk + 1  # the first chunk boundary above computed
        hi = min(hit, total) // chunk
        if hi < lo:
            return computed
        per, lat = self.bytes_per_token / self._rate, self.load_latency_s
        s = self._scale
        a, half_b, fixed, t2 = s * self.a, s * self.b / 2.0, s * self.fixed, float(total) * total

        def ttft(m):  # m boundaries of chunk tokens cached: max(load, compute)
            k = m * chunk
            load = (k - computed) * per + lat if k > computed else 0.0
            comp = fixed + a * (total - k) + half_b * (t2 - float(k) * k) if k < total else 0.0
            return load if load > comp else comp, load >= comp

        t_hi, over = ttft(hi)
        if not over:
            return hi * chunk  # the whole hit loads within the computation of the rest
        # load(K_m) grows and compute(K_m) falls with m: bisect for the
        # first boundary where the load is no shorter than the computation.
        x, y = lo, hi
        while x < y:
            m = (x + y) // 2
            if ttft(m)[1]:
                y = m
            else:
                x = m + 1
        best_m, best = None, ttft(0)[0] if computed == 0 else self.ttft_s(total, computed, computed)
        for m in sorted({lo, max(lo, x - 1), x}):
            t = ttft(m)[0]
            if t <= best:
                best_m, best = m, t
        # Beyond the crossing the TTFT is the load's, growing with K: the
        # largest boundary within min_gain of the best (lo - 1 stands for
        # loading nothing).
        limit = best * (1.0 + self.min_gain)
        if t_hi <= limit:
            return hi * chunk
        x, y = (lo - 1 if best_m is None else best_m), hi
        while x < y:
            m = (x + y + 1) // 2
            if ttft(m)[0] <= limit:
                x = m
            else:
                y = m - 1
        return x * chunk if x >= lo else computed
