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

    load(n)       = (n * bytes_per_token + claim_bytes) / rate + latency   (0 for n = 0)
    compute(T, K) = s * (fixed + a * (T - K) + b * (T^2 - K^2) / 2)

(claim_bytes: what a hybrid model's state and window groups load for any
claim; 0 for full attention alone.)

The max is what a perfect pipeline reaches. The loads come in jobs of
whole layer groups (layer_groups), and a group's layers are computed only
once the group has arrived, so the model runs the pipeline: group j
arrives at latency + load x (layers up to j) / L and is computed after
both its arrival and the group before it. Where load and computation
are about even, that costs about one group's work, which is why a slow
mount (one layer's load alone at least job_s long) gets one layer per
job, any other layers_per_load (layers_per_job).

The rate is learned from the loads the workers time (observe_load: the
bytes after a load's first layer group over the time after it), the
latency from that first group (observe_latency: its time beyond its
bytes at the rate, the cost of starting a load; a rate of a load's
whole bytes over its whole time would count it twice); the
prefill model's shape (fixed, a, b) is configured and its scale s learned
from the forward passes the workers time (observe_compute), so that a
GPU faster or slower than the configured one moves the split.

Only loads measure the rate, and a low rate claims fewer tokens: a rate
learned during a slow episode could stop the loads that would measure
its end. So the learned rate drifts back while no load is measured (half
of the way every recover_s seconds): a split that stopped loading claims
again, and its loads measure the rate anew. It drifts back to the last
good rate, a slow average of every measurement (their mean over the
first few, then an EWMA of a quarter of alpha's weight), or the
configured one where that is higher: a freeze after many healthy loads
returns to the healthy rate, not to a configured rate far below it (a
memory mount measured at 40 GB/s would otherwise recompute half of a
long prefix after an idle minute, priced at a disk's 2 GB/s), and a
mount that stayed slow returns to the configured rate.

Under pipeline parallelism (stages) every stage loads its own layers on
its own GPU from the step's start, in parallel, while the suffix's
prefill runs through the stages in order: the model runs one pipeline
over the whole model's layers, stage s's groups arriving at latency +
its load x (its layers up to j) / its layers, the computation of layer
i at the whole model's prefill x i / L. The slowest stage's load bounds
a hit's TTFT, the earlier stages' computation hides a later one's load.
The rate is a worker's (each stage's workers load their own bytes at
it); vLLM joins the workers' reports (bytes summed, the slowest one's
seconds), so a measurement's bytes are taken at the heaviest stage's
share, and a forward pass (the slowest stage's) at the whole model's
layers over that stage's.

Pure Python, no I/O: the connector's scheduler calls ``CostModel.split``
for every prompt (a few bisection steps, no loop over the prompt).
"""

import math
import threading
import time

SHAPES = ("ramp", "even")


def load_measure(nbytes, seconds, first_bytes, first_s):
    """What one load teaches the model, whose load(n) is bytes over the
    rate plus a latency: (bytes, seconds) for the rate (observe_load) and
    the latency (observe_latency; None where the load does not show it).
    The load moved nbytes in seconds, its first layer group first_bytes
    in first_s. The rate is the bytes after the first group over the time
    after it, the latency the first group's time beyond its bytes at that
    rate: the load's whole bytes over its whole time would count the
    latency twice, in the rate and beside it. A first group that ended so
    late that the rest would move at over twice the load's rate (groups
    moving side by side) does not separate the two, nor does a time that
    is no finite number: the load's rate, and no latency."""
    if (0 < first_bytes < nbytes < math.inf and 0 < first_s < seconds < math.inf
            and seconds - first_s >= seconds * (nbytes - first_bytes) / nbytes / 2):
        rest, rest_s = nbytes - first_bytes, seconds - first_s
        return rest, rest_s, max(0.0, first_s - first_bytes * rest_s / rest)
    return nbytes, seconds, None


def layer_groups(layers, per_load, shape="ramp"):
    """The (first, count) layer ranges of one step's load jobs, in layer
    order: per_load layers each ("even"), or ("ramp") the first and the
    last one layer each and per_load layers each between them. Where the
    loads are slower than the forward pass, layer 0 waits for the first
    job and the last job's layers are computed after every load has
    ended: one-layer ends shorten both, and the larger jobs between them
    keep the daemon's cost per job low."""
    if shape == "even" or per_load == 1 or layers <= 2:
        return [(f, min(per_load, layers - f)) for f in range(0, layers, per_load)]
    inner = [(f, min(per_load, layers - 1 - f)) for f in range(1, layers - 1, per_load)]
    return [(0, 1)] + inner + [(layers - 1, 1)]


def _stage(x):
    """One stage's (bytes_per_token, layers), checked."""
    try:
        b, n = x
    except (TypeError, ValueError):
        raise ValueError(f"kvhost.vllm: stages: want (bytes_per_token, layers) per stage, got {x!r}") from None
    if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0 <= b < math.inf:
        raise ValueError(f"kvhost.vllm: stages: a stage's bytes_per_token: want a number >= 0, got {b!r}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 0 or (b and not n):
        raise ValueError(f"kvhost.vllm: stages: a stage's layers: want an integer >= 0 (> 0 where it loads bytes), "
                         f"got {n!r}")
    return float(b), n


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
    back to the last good rate (good_gbps; load_gbps where that is
    higher) every recover_s seconds (0: never). clock: the
    monotonic clock in seconds (tests pass their own). layers: the
    layers a load is cut across (1: no pipeline, the max of load and
    compute); layers_per_load: the most layers in one load job; shape:
    layer_groups' shape; job_s: the seconds of load a job is sized to
    (layers_per_job). stages: under pipeline parallelism, per stage in
    order its (bytes_per_token, layers) (the stages attribute; None: one
    stage, bytes_per_token over layers). rate_margin: what the split
    and ttft_s take off the rate when they price a claim's loads (0: the
    rate as learned): the modelled TTFT rises steeply past the claim
    whose load keeps pace with the computation and falls gently before
    it, so a claim priced at a rate its loads then miss costs far more
    than one priced a little low (and a short claim's loads from a cold
    disk move slower than the whole prefix's)."""

    # A forward pass the model prices below this is not taken into the
    # scale: decode steps and small chunks cost what the model's prefill
    # terms do not describe (weights read per step, launches).
    MIN_OBSERVED_S = 0.005

    def __init__(self, bytes_per_token, load_gbps, load_latency_s=0.0, prefill_s_per_token=2.0e-5,
                 prefill_s_per_token2=1.0e-9, prefill_fixed_s=0.0, min_gain=0.05, alpha=0.2, recover_s=30.0,
                 clock=time.monotonic, layers=1, layers_per_load=4, shape="ramp", job_s=0.008, stages=None,
                 rate_margin=0.0):
        for name, v in (("bytes_per_token", bytes_per_token), ("load_gbps", load_gbps)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
                raise ValueError(f"kvhost.vllm: {name}: want a number > 0, got {v!r}")
        for name, v in (("load_latency_s", load_latency_s), ("prefill_s_per_token", prefill_s_per_token),
                        ("prefill_s_per_token2", prefill_s_per_token2), ("prefill_fixed_s", prefill_fixed_s),
                        ("min_gain", min_gain), ("recover_s", recover_s), ("job_s", job_s)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
                raise ValueError(f"kvhost.vllm: {name}: want a number >= 0, got {v!r}")
        if isinstance(rate_margin, bool) or not isinstance(rate_margin, (int, float)) or not 0 <= rate_margin < 1:
            raise ValueError(f"kvhost.vllm: rate_margin: want 0 <= margin < 1, got {rate_margin!r}")
        self.rate_margin = float(rate_margin)
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha <= 1:
            raise ValueError(f"kvhost.vllm: alpha: want 0 < alpha <= 1, got {alpha!r}")
        for name, v in (("layers", layers), ("layers_per_load", layers_per_load)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"kvhost.vllm: {name}: want an integer >= 1, got {v!r}")
        if shape not in SHAPES:
            raise ValueError(f"kvhost.vllm: layer_groups: want one of {', '.join(SHAPES)}, got {shape!r}")
        self.layers, self.max_layers_per_load, self.shape = layers, layers_per_load, shape
        self.job_s = float(job_s)
        self._ends_cache = {}
        self.stages = stages
        self.bytes_per_token = float(bytes_per_token)
        # Bytes a claim loads whatever its tokens (a hybrid model's state
        # and window groups: _conn_groups.claim_costs), beside
        # bytes_per_token's; not under stages, whose bytes per token
        # hold them.
        self.claim_bytes = 0.0
        self.latency_observed = 0  # load latencies taken in
        self._prior = float(load_gbps) * 1e9  # bytes per second: the configured rate
        self._learned = self._prior  # the rate as of the last measurement
        self._good = self._prior  # the last good rate: a slow average of the measured ones (observe_load)
        self._latency_prior = self._latency_learned = float(load_latency_s)
        self._latency_at = clock()
        self.recover_s = float(recover_s)
        self._clock = clock
        self._measured_at = clock()
        self.a, self.b, self.fixed = float(prefill_s_per_token), float(prefill_s_per_token2), float(prefill_fixed_s)
        self.min_gain = float(min_gain)
        self.alpha = float(alpha)
        self._lock = threading.Lock()
        self.observed = 0  # load measurements taken into the rate
        self._scale = 1.0  # measured over modelled prefill time
        self.compute_observed = 0  # forward passes taken into the scale

    @property
    def stages(self):
        """Per pipeline stage, in order, its (bytes_per_token, layers): the
        bytes one of its workers loads per token of a claim and its layers
        (None: one stage, bytes_per_token over layers). Set it to price
        another claim's bytes (a hybrid model's fall as the claim grows)."""
        return self._stages

    @stages.setter
    def stages(self, stages):
        if stages is None:
            self._stages = None
        else:
            self._stages = tuple(_stage(x) for x in stages)
            if not self._stages or not any(b for b, _ in self._stages):
                raise ValueError(f"kvhost.vllm: stages: want (bytes_per_token, layers) per pipeline stage, one of "
                                 f"them loading bytes, got {stages!r}")
            # What vLLM joins of a step's loads (every stage's bytes) is
            # taken at the heaviest stage's share; what it joins of a
            # forward pass (the slowest stage's) at the whole model's layers.
            sizes = [b for b, _ in self._stages]
            self._load_share = max(sizes) / sum(sizes)
            self._all_layers = sum(n for _, n in self._stages)
            self._pass_share = self._all_layers / max(n for _, n in self._stages)
        self._ends_cache = {}

    @property
    def _rate(self):
        """The load rate in bytes per second: the learned one, moved back
        towards the last good one (or the configured one, where higher)
        for the time no load was measured."""
        target = max(self._prior, self._good)
        if self.recover_s <= 0 or self._learned == target:
            return self._learned
        age = max(0.0, self._clock() - self._measured_at)
        return target + (self._learned - target) * 0.5 ** (age / self.recover_s)

    def start_from(self, load_gbps):
        """Makes load_gbps (GB/s) the configured rate: the one the rate
        returns to (with the last good one), and, while no load has been
        measured, the rate itself (a mount's kind, known once the
        daemon answers, before any load)."""
        if isinstance(load_gbps, bool) or not isinstance(load_gbps, (int, float)) or not 0 < load_gbps < math.inf:
            raise ValueError(f"kvhost.vllm: load_gbps: want a number > 0, got {load_gbps!r}")
        with self._lock:
            prior = float(load_gbps) * 1e9
            if self.observed == 0 or prior != self._prior:
                # Another medium (a daemon restarted on other mounts):
                # what was learned of the last one is not this one's.
                self._learned = self._good = prior
            self._prior = prior

    @property
    def good_gbps(self):
        """The last good load rate in GB/s: what the rate returns to while
        no load is measured (with the configured one, where higher)."""
        return self._good / 1e9

    @property
    def load_latency_s(self):
        """A load's fixed cost in seconds: the learned one, moved back
        towards the configured one for the time none was measured (as
        the rate is: a latency learned in a slow episode could otherwise
        stop the loads that would measure its end)."""
        prior, learned = self._latency_prior, self._latency_learned
        if self.recover_s <= 0 or learned == prior:
            return learned
        age = max(0.0, self._clock() - self._latency_at)
        return prior + (learned - prior) * 0.5 ** (age / self.recover_s)

    def observe_latency(self, seconds):
        """Takes a measured load latency (seconds a load's first layer
        group took beyond its bytes at the rate) into the latency: an
        EWMA of weight alpha over it as it stands now. Negative or
        non-finite measurements are ignored."""
        if not 0 <= seconds < math.inf:
            return
        with self._lock:
            now = self.load_latency_s
            self._latency_learned = now + self.alpha * (seconds - now)
            self._latency_at = self._clock()
            self.latency_observed += 1

    @property
    def load_gbps(self):
        """The load rate the split uses now, in GB/s."""
        return self._rate / 1e9

    def observe_load(self, nbytes, seconds):
        """Takes a measured load (nbytes moved in seconds) into the rate: an
        EWMA of weight alpha over the rate as it stands now (recovered
        for the time since the last measurement). Measurements of nothing,
        and any whose rate is not a finite number of at least a byte a
        second, are ignored."""
        if not (0 < nbytes < math.inf and 0 < seconds < math.inf and 1 <= nbytes / seconds < math.inf):
            return
        if self._stages is not None:  # every stage's bytes: the heaviest one's share took the seconds
            nbytes = nbytes * self._load_share
        with self._lock:
            now = self._rate
            self._learned = now + self.alpha * (nbytes / seconds - now)
            self._measured_at = self._clock()
            self.observed += 1
            # The last good rate: the mean of the configured rate and the
            # measurements over the first few, then a slow EWMA, so that
            # one freeze barely moves it and a lasting change does.
            self._good += max(self.alpha / 4, 1 / (self.observed + 1)) * (nbytes / seconds - self._good)

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
        the model prices under MIN_OBSERVED_S, or timed at no finite
        number of seconds > 0, is ignored. Returns whether the pass was
        taken."""
        modelled = self._modelled(work)
        if not 0 < seconds < math.inf or not self.MIN_OBSERVED_S <= modelled < math.inf:
            return False
        if self._stages is not None:  # the slowest stage's pass: its share of the model's layers
            seconds = seconds * self._pass_share
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
        if self._stages is not None:  # the stages load in parallel: the heaviest one's
            return tokens * max(b for b, _ in self._stages) / self._rate + self.load_latency_s
        return (tokens * self.bytes_per_token + self.claim_bytes) / self._rate + self.load_latency_s

    def compute_s(self, total, cached):
        """Seconds to compute the total - cached tokens after cached ones."""
        n = total - cached
        if n <= 0:
            return 0.0
        return self._scale * (self.fixed + self.a * n + self.b * (total * total - cached * cached) / 2.0)

    def layers_per_job(self, tokens):
        """Layers per load job for a load of tokens tokens: one where one
        layer's load alone takes job_s at the rate (a disk: the pipeline
        then waits for one layer at its ends, not for a group, and a
        job's fixed cost is small beside its bytes), else layers_per_load.
        Two regimes, not a size per rate: jobs sized down with the rate
        cost loads of files not registered with CUDA (whose jobs cost
        most) 1.8-2x their TTFT on the H200, and the slower rate they
        measured asked for smaller jobs still. Measured with one-layer
        jobs, such a mount still moves a layer well within job_s, so it
        returns to layers_per_load at its next load."""
        cap = self.max_layers_per_load
        if self._stages is not None:  # one size for every stage: its layer the slowest to load
            if cap <= 1 or tokens <= 0 or self.job_s <= 0:
                return cap
            layer_s = tokens * max(b / n for b, n in self._stages if n) / self._rate
            return 1 if layer_s >= self.job_s else cap
        if cap <= 1 or self.layers <= 1 or tokens <= 0 or self.job_s <= 0:
            return cap
        layer_s = (tokens * self.bytes_per_token + self.claim_bytes) / self.layers / self._rate
        return 1 if layer_s >= self.job_s else cap

    def ttft_s(self, total, computed, k, job_tokens=None):
        """The modelled time to first token when k tokens are cached after
        loading k - computed of them: the pipeline of their layer groups
        (layers_per_job of job_tokens, by default k - computed) beside the
        computation of tokens k..total, its loads priced at the rate less
        rate_margin."""
        n = k - computed
        ends = self._ends(n if job_tokens is None else job_tokens) if n > 0 and self._pipelined else ()
        return self._pipeline(total, computed, k, self._priced_rate, self._scale, self.load_latency_s, ends)

    @property
    def _priced_rate(self):
        """The rate a claim's loads are priced at: the rate less
        rate_margin."""
        return self._rate * (1.0 - self.rate_margin)

    def _pipeline(self, total, computed, k, rate, scale, lat, ends):
        """TTFT(k) at rate, scale and latency lat, the load cut in the
        layer groups whose run ends are ends (_ends)."""
        n = k - computed
        comp = 0.0
        if k < total:
            comp = scale * (self.fixed + self.a * (total - k) + self.b * (float(total) * total - float(k) * k) / 2.0)
        if n <= 0:
            return comp
        if self._stages is not None:
            return self._stage_pipeline(n, comp, rate, lat, ends)
        load = (n * self.bytes_per_token + self.claim_bytes) / rate
        if self.layers <= 1:
            return max(load + lat, comp)
        # Group j (count_j layers, through_j layers up to and with it)
        # arrives at lat + pl * through_j and is computed after it and the
        # group before: the last group ends at the largest over j of its
        # arrival plus the computation of it and every later group,
        #   lat + pc * L + max_j ((pl - pc) * through_j + pc * count_j),
        # linear in through_j within a run of equal groups, so only each
        # run's ends are weighed (_ends).
        pl, pc = load / self.layers, comp / self.layers
        d = pl - pc
        return lat + pc * self.layers + max(d * through + pc * count for through, count in ends)

    @property
    def _pipelined(self):
        """Whether TTFT runs the layer groups' pipeline (else the max)."""
        return self.layers > 1 or self._stages is not None

    def _stage_pipeline(self, n, comp, rate, lat, ends):
        """TTFT of a load of n tokens beside comp seconds of computation
        under pipeline stages (ends: per stage, _ends's): one pipeline
        over the whole model's L layers, stage s's group j arriving at
        lat + pl_s * through_j and computed after it and the layer before
        (the previous stage's last for its first): the largest over s and
        j of
            lat + pc * L + (pl_s - pc) * through_j + pc * count_j - pc * offset_s
        where offset_s counts the layers of the stages before s."""
        pc = comp / self._all_layers
        worst, offset = None, 0
        for (b, layers), run in zip(self._stages, ends):
            if b and layers:
                d = n * b / rate / layers - pc
                w = max(d * through + pc * count for through, count in run) - pc * offset
                worst = w if worst is None or w > worst else worst
            offset += layers
        return max(comp, lat + pc * self._all_layers + worst)

    def _ends(self, tokens):
        """The (through, count) of the first and last group of each run of
        equal layer groups of a load of tokens (cached per job size); per
        stage under pipeline stages."""
        per = self.layers_per_job(tokens)
        if self._stages is not None:
            ends = self._ends_cache.get(per)
            if ends is None:
                ends = self._ends_cache[per] = [self._run_ends(n, per) for _, n in self._stages]
            return ends
        ends = self._ends_cache.get(per)
        if ends is None:
            ends = self._ends_cache[per] = self._run_ends(self.layers, per)
        return ends

    def _run_ends(self, layers, per):
        """The (through, count) of the first and last group of each run of
        equal groups of layer_groups(layers, per)."""
        ends, through, prev = [], 0, None
        if layers:
            for _, count in layer_groups(layers, per, self.shape):
                through += count
                if count != prev:
                    ends.append((through, count))
                elif len(ends) >= 2 and ends[-1][1] == count and ends[-2][1] == count:
                    ends[-1] = (through, count)
                else:
                    ends.append((through, count))
                prev = count
        return ends

    def split(self, total, computed, hit, chunk):
        """The tokens to have cached after the load, K: computed (load
        nothing) or a multiple of chunk in (computed, hit], the one of least
        modelled TTFT, or the largest whose TTFT is within min_gain of that
        least and no more than loading nothing's. hit is the cached prefix's end; total the prompt's tokens.
        A few bisection steps over local arithmetic: the scheduler calls it
        for every prompt with a hit."""
        if chunk <= 0:
            raise ValueError(f"kvhost.vllm: chunk {chunk}: want tokens > 0")
        lo = computed // chunk + 1  # the first chunk boundary above computed
        hi = min(hit, total) // chunk
        if hi < lo:
            return computed
        rate, scale, lat = self._priced_rate, self._scale, self.load_latency_s  # one reading for the whole search
        cache = {}
        # Every candidate is priced with the layer groups of the whole
        # hit's load: with groups sized per candidate, the modelled TTFT
        # jumps where the job size changes and is no longer unimodal.
        ends = self._ends(hi * chunk - computed) if self._pipelined else ()

        def ttft(m):  # m boundaries of chunk tokens cached (lo - 1: load nothing)
            t = cache.get(m)
            if t is None:
                t = cache[m] = self._pipeline(total, computed, max(m * chunk, computed) if m >= lo else computed,
                                              rate, scale, lat, ends)
            return t

        # The least TTFT: the load grows and the computation of the rest
        # falls with m, so the modelled TTFT falls, then rises. Ternary
        # steps narrow [lo - 1, hi] to a few boundaries, which are tried.
        x, y = lo - 1, hi
        while y - x > 3:
            m1, m2 = x + (y - x) // 3, y - (y - x) // 3
            if ttft(m1) <= ttft(m2):
                y = m2
            else:
                x = m1
        # The least over the boundaries, then loading nothing weighed
        # apart: a load's latency puts a step up between it and the first
        # boundary that the search may step over.
        inner = min(range(max(x, lo), max(y, lo) + 1), key=lambda m: (ttft(m), -m))
        best = min(ttft(inner), ttft(lo - 1))
        # Past the inner least the TTFT is the load's, growing with m: the
        # largest boundary within min_gain of the least, and never priced
        # above loading nothing (a claim that saves the GPU work must not
        # make the TTFT worse than recomputing).
        limit = min(best * (1.0 + self.min_gain), ttft(lo - 1))
        if ttft(hi) <= limit:
            return hi * chunk
        if ttft(inner) > limit:
            return computed
        x, y = inner, hi
        while x < y:
            m = (x + y + 1) // 2
            if ttft(m) <= limit:
                x = m
            else:
                y = m - 1
        return x * chunk if x >= lo else computed
