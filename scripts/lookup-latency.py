"""What loads cost the daemon's control path: lookup latency beside loads.

A client stores KEYS keys of 32 MiB (Llama-3.1-8B bf16 geometry, 256 tokens
per key) from host memory it registers with a running kvhost daemon. A
second process plays a scheduler: on a connection of its own it looks up 16
of the stored keys every INTERVAL_MS milliseconds (paced, as a scheduler
asks once per step, not back to back, so that the probe takes little CPU
from the loads it measures) and times each lookup. It runs SECONDS alone,
then SECONDS while JOBS threads keep loading the keys into other blocks.
Each phase runs the probe twice, one after the other: answered from the
daemon's shared lookup table, which the probe maps ("table": by the
client's C probe where it is built, make python-ext), then, where the C
probe answered, from the table by the client's Python probe
("table-python"), then asking the daemon over the socket ("daemon", the
client made with lookup_table=False). After the table's lookups, the
same process times a stand-in ("stand-in"), paced the same way: Python
arithmetic that touches no table and asks no daemon, its amount set so
that it takes, back to back, as long as the table's lookups do back to
back. What delays the stand-in (a CPU slow to resume after the pause,
an interrupt, a virtual CPU held by its host) delays any code of that
length on the machine; a lookup also reloads its own code and data, of
which the stand-in has little. Its tail, beside the lookups', says how
much of theirs the machine gives any code of their length. The script
prints, for each, the lookups' median, 99th percentile and maximum in
microseconds, how many were timed and how many were due (SECONDS /
INTERVAL_MS: a lookup that ends late makes the probe skip the slots it
missed, so n below due means lookups were slower than the interval;
INTERVAL_MS 0 looks up back to back, as a scheduler whose thread is busy
between its lookups would find its CPU: then due is "-"), and after the
loads their GB/s:

    alone table p50 14 p99 21 max 80 n 2500 due 2500
    alone stand-in p50 14 p99 19 max 75 n 2500 due 2500
    alone daemon p50 120 p99 240 max 900 n 2500 due 2500
    beside loads table p50 15 p99 40 max 300 n 2500 due 2500
    beside loads daemon p50 60 p99 19000 max 21000 n 700 due 2500 GB/s 7.1

Needs no GPU and no torch. Start a daemon first, for example:

    bin/kvhost --dir /dev/shm/kvlat --socket /tmp/kvlat.sock &
    python3 scripts/lookup-latency.py /tmp/kvlat.sock

PACE (default sleep) is how the probe waits between paced lookups: sleep,
or spin (its CPU kept busy, as a scheduler busy between its lookups keeps
its own; the lookup then does not start on a CPU that was idle).

usage: python3 scripts/lookup-latency.py SOCKET [SECONDS] [JOBS] [INTERVAL_MS] [KEYS] [PACE]
"""
import os
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "client", "python", "src"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kvhost  # noqa: E402
import gpu_paged  # noqa: E402

TPK = 256  # tokens per key: 32 MiB keys
PROBED = 16  # keys per lookup


def key(i):
    return f"lookup-latency-{i}".encode()


def summary(lat):
    """'p50 P p99 P max M n N' of latencies in seconds, in microseconds."""
    lat = sorted(lat)
    if not lat:
        return "n 0"
    us = lambda s: f"{s * 1e6:.0f}"  # noqa: E731
    return f"p50 {us(lat[len(lat) // 2])} p99 {us(lat[int(len(lat) * 0.99)])} max {us(lat[-1])} n {len(lat)}"


from kvhost import lookuptable  # noqa: E402

# The ways a lookup is answered, in the order the probes run.
VIAS = ("table", "table-python", "daemon") if lookuptable.NATIVE and lookuptable.ORDERED_LOADS else ("table", "daemon")
# The lines each phase prints, in order: the table probe's process also
# times the stand-in.
LINES = VIAS[:1] + ("stand-in",) + VIAS[1:]


def hot_median(fn, seconds=0.1):
    """fn's median time in seconds over calls back to back for seconds."""
    lat = sorted(gpu_paged.time_paced(fn, seconds))
    return lat[len(lat) // 2]


def arithmetic(n):
    """A callable that adds n integers: work of a fixed amount, whose time
    grows when the CPU is slow or interrupted, as a lookup's does."""
    def add():
        x = 0
        for i in range(n):
            x += i
        return x
    return add


def stand_in(lookup):
    """arithmetic() of the amount that takes as long as lookup back to
    back (both measured here, hot: after a warm-up, since a process's
    first lookups ran at twice the time of later ones on the H100 machine)."""
    gpu_paged.time_paced(lookup, 0.5)
    target, n = hot_median(lookup), 1000
    for _ in range(3):  # the loop's fixed cost makes one ratio overshoot or fall short
        n = max(1, round(n * target / hot_median(arithmetic(n))))
    return arithmetic(n)


def probe(sock, seconds, interval, nkeys, via, pace):
    """Times a lookup of the first PROBED stored keys every interval seconds
    for seconds, answered via the shared lookup table or the daemon; prints
    "VIA summary() due D", and after the table's lookups the stand-in's
    line the same way. Exits if a lookup took the other way."""
    with kvhost.Client(sock, name="lookup-latency-probe", lookup_table=(via != "daemon")) as c:
        ns = c.declare(gpu_paged.geometry(TPK))
        keys = [key(i) for i in range(min(PROBED, nkeys))]
        if via == "table-python":
            # The client's own mapping, swapped for one that probes in
            # Python (a benchmark's reach into the client, on purpose).
            t = c._open_table()
            c._table = lookuptable.LookupTable(t.path, native=False)
            t.close()
        work = stand_in(lambda: c.lookup(ns, keys)) if via == "table" else None
        before = c.lookup_counts()
        lat = gpu_paged.time_lookups(c, ns, keys, seconds, interval, spin=(pace == "spin"))
        counts = {k: n - before[k] for k, n in c.lookup_counts().items()}
    asked = "daemon" if via == "daemon" else "table"
    if counts[asked] != len(lat) or counts["table" if asked == "daemon" else "daemon"]:
        sys.exit(f"the probe meant to ask the {via} answered {counts}")
    due = round(seconds / interval) if interval else "-"
    print(via, summary(lat), "due", due)
    if work is not None:
        print("stand-in", summary(gpu_paged.time_paced(work, seconds, interval, pace == "spin")), "due", due)


def run_probes(sock, seconds, interval, nkeys, pace):
    """Runs the probe in a process of its own (as a scheduler would be),
    once per way of answering; returns their summary lines by LINES' name."""
    lines = {}
    for via in VIAS:
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--probe", sock, str(seconds), str(interval),
                              str(nkeys), via, pace], capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(f"lookup probe ({via}) failed (exit {out.returncode}): {out.stderr.strip()}")
        for line in out.stdout.splitlines():
            name, _, rest = line.partition(" ")
            lines[name] = rest
    if set(lines) != set(LINES):
        sys.exit(f"lookup probes printed {sorted(lines)}, want {sorted(LINES)}")
    return lines


def main():
    sock = sys.argv[1]
    seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 5
    jobs = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    interval = (float(sys.argv[4]) if len(sys.argv) > 4 else 2) / 1e3
    nkeys = int(sys.argv[5]) if len(sys.argv) > 5 else 16
    pace = sys.argv[6] if len(sys.argv) > 6 else "sleep"
    if not (seconds > 0 and interval >= 0 and 1 <= jobs <= nkeys and pace in ("sleep", "spin")):
        sys.exit(f"want SECONDS > 0, INTERVAL_MS >= 0, 1 <= JOBS <= KEYS and PACE sleep or spin, got {sys.argv[2:]}")
    bpk = TPK // gpu_paged.TOKENS_PER_BLOCK
    nb = 2 * nkeys * bpk  # the stored blocks, then as many to load into
    page = gpu_paged.PAGE
    with kvhost.Client(sock, name="lookup-latency") as c:
        ns = c.declare(gpu_paged.geometry(TPK))
        buf = kvhost.HostBuffer(gpu_paged.LAYERS * nb * page)
        pattern = os.urandom(1 << 20)
        for off in range(0, buf.size, len(pattern)):
            n = min(len(pattern), buf.size - off)
            buf.view[off:off + n] = pattern[:n]
        region = c.register_buffer(buf)
        layers = [kvhost.Layer(region, offset=l * nb * page, block_stride=page,
                               plane_stride=gpu_paged.BLOCK_BYTES, num_blocks=nb)
                  for l in range(gpu_paged.LAYERS)]
        cache = c.register_cache(ns.id, layers)
        keys = [key(i) for i in range(nkeys)]
        blocks = [list(range(i * bpk, (i + 1) * bpk)) for i in range(nkeys)]
        c.store(cache, keys, blocks).wait(300)
        alone = run_probes(sock, seconds, interval, nkeys, pace)
        for name in LINES:
            print("alone", name, alone[name], flush=True)

        stop, moved, failed = threading.Event(), [0] * jobs, []
        into = [list(range((nkeys + i) * bpk, (nkeys + i + 1) * bpk)) for i in range(nkeys)]

        def loader(j):
            ks, bs = keys[j::jobs], into[j::jobs]
            try:
                while not stop.is_set():
                    c.load(cache, ks, bs).wait(300)
                    moved[j] += len(ks) * ns.key_bytes
            except Exception as e:  # reported below, after the probe
                failed.append(e)
                stop.set()

        threads = [threading.Thread(target=loader, args=(j,)) for j in range(jobs)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        try:
            res = run_probes(sock, seconds, interval, nkeys, pace)
        finally:
            stop.set()
            for t in threads:
                t.join()
        if failed:
            sys.exit(f"a load failed: {failed[0]}")
        gbs = sum(moved) / (time.perf_counter() - t0) / 1e9
        for name in LINES:
            print("beside loads", name, res[name], *(["GB/s %.1f" % gbs] if name == LINES[-1] else []))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--probe":
        probe(sys.argv[2], float(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5]), sys.argv[6], sys.argv[7])
    else:
        main()
