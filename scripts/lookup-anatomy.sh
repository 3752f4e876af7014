#!/usr/bin/env bash
# Where a lookup's latency beside loads goes. Runs scripts/lookup-latency.py
# (a scheduler-paced probe of lookups, alone, then beside JOBS threads of
# host-memory loads of 32 MiB keys) against a daemon with its metrics and
# profiles on, in variants, and keeps for each:
#
#   - the probe's own figures (what a client sees);
#   - the daemon's kvhost_request_duration_seconds{request="lookup"}
#     histogram over the phase beside the loads (the daemon's own time,
#     from the frame read to the reply written);
#   - a 3-second execution trace of the daemon taken in that phase
#     (go tool trace; -pprof=sched gives where goroutines waited for a
#     processor).
#
# Variants, alternated ROUNDS times (default 2): the defaults (I/O
# workers yield their CPU every MiB they copy, engine.yield_bytes); no
# yields (yield_bytes = 0); no yields and engine.io_workers = CPUs - 4
# (half the CPUs where there are 8 or fewer), cores left to everything
# else. The trace is taken in each variant's first round.
#
#   scripts/lookup-anatomy.sh [BINDIR] [OUT]   # from the repository root
#
# SECONDS_PER_PHASE (default 6), JOBS (default 16), ROUNDS and DIR (default
# /dev/shm/kvhost-lookups) can be set in the environment.
set -uo pipefail
bin=${1:-bin}
out=${2:-lookup-anatomy}
seconds=${SECONDS_PER_PHASE:-6}
jobs=${JOBS:-16}
dir=${DIR:-/dev/shm/kvhost-lookups}
sock=/tmp/kvhost-lookup-anatomy.sock
addr=127.0.0.1:9481
mkdir -p "$out"
cpus=$(nproc)

# histogram: prints the daemon's kvhost_request_duration_seconds{request="lookup"}
# buckets as "le count" lines.
histogram() {
	python3 - "$addr" <<'EOF'
import sys, urllib.request
body = urllib.request.urlopen(f"http://{sys.argv[1]}/metrics", timeout=10).read().decode()
for line in body.splitlines():
    if line.startswith('kvhost_request_duration_seconds_bucket{') and 'request="lookup"' in line:
        le = line.split('le="')[1].split('"')[0]
        print(le, line.rsplit(" ", 1)[1])
EOF
}

variant() { # NAME ROUND [ENGINE-KEY=VALUE...]
	local name=$1 round=$2; shift 2
	rm -rf "$dir" "$sock"
	printf '[metrics]\nlisten = "%s"\nprofiling = true\n[engine]\n' "$addr" >"$out/$name.toml"
	for kv in "$@"; do echo "${kv/=/ = }" >>"$out/$name.toml"; done
	"$bin/kvhost" --config "$out/$name.toml" --dir "$dir" --socket "$sock" --log-format json >"$out/$name-daemon.log" 2>&1 &
	local pid=$!
	for _ in $(seq 200); do [ -S "$sock" ] && break; sleep 0.1; done
	python3 scripts/lookup-latency.py "$sock" "$seconds" "$jobs" 2 >"$out/$name-$round.txt" 2>&1 &
	local probe=$!
	# The loads start when the probe prints its "alone" line.
	for _ in $(seq 600); do grep -q '^alone' "$out/$name-$round.txt" && break; sleep 0.05; done
	histogram >"$out/$name-$round-hist-before.txt"
	sleep 1
	if [ "$round" = 1 ]; then
		python3 -c "import sys, urllib.request; open(sys.argv[2], 'wb').write(urllib.request.urlopen(f'http://{sys.argv[1]}/debug/pprof/trace?seconds=3', timeout=30).read())" "$addr" "$out/$name.trace"
	fi
	wait "$probe"
	histogram >"$out/$name-$round-hist-after.txt"
	kill -TERM "$pid"; wait "$pid"
	echo "== $name, round $round ($*)"
	cat "$out/$name-$round.txt"
	python3 - "$out/$name-$round-hist-before.txt" "$out/$name-$round-hist-after.txt" <<'EOF'
import sys
def read(p):
    return [(float(le), float(n)) for le, n in (l.split() for l in open(p))]
b, a = read(sys.argv[1]), read(sys.argv[2])
d = [(le, na - nb) for (le, na), (_, nb) in zip(a, b)]
total = d[-1][1]
def q(p):
    for le, n in d:
        if n >= p * total:
            return le
print(f"daemon's own time beside loads: {total:.0f} lookups, p50 <= {q(0.5)*1e6:.0f} µs, p99 <= {q(0.99)*1e6:.0f} µs, all <= {q(1.0)*1e6:.0f} µs")
EOF
}

w=$((cpus > 8 ? cpus - 4 : cpus / 2))
for round in $(seq "${ROUNDS:-2}"); do
	variant default "$round"
	variant no-yield "$round" yield_bytes=0
	variant no-yield-io-workers-$w "$round" yield_bytes=0 io_workers=$w
done
