#!/usr/bin/env bash
# Prints the milliseconds from a daemon's start to its first answer on its
# socket (kvhost health, polled every 5 ms), with the policy POLICY (a
# built-in name or a .wasm file) and the compilation cache CACHE_DIR (fresh
# when it does not exist; the run leaves it warm). GPU off, one 1 GiB mount
# in a temporary directory. docs/policy-host.md gives the figures.
#
# usage: [LOAD_TIMEOUT=5s] [VERBOSE=1] [WAIT=SECONDS] scripts/policy-start-time.sh KVHOST POLICY CACHE_DIR
#   LOAD_TIMEOUT  policy.load_timeout (default: the daemon's)
#   VERBOSE       also print the daemon's policy log lines
#   WAIT          seconds the daemon runs on after it answers
set -euo pipefail
kvhost=$1 policy=$2 cache=$3
dir=$(mktemp -d "${TMPDIR:-/tmp}/kvhost-start.XXXXXX")
trap 'rm -rf "$dir"' EXIT
mkdir -p "$dir/blocks"
{
	echo '[gpu]'
	echo 'mode = "off"'
	echo '[policy]'
	echo "name = \"$policy\""
	echo "cache_dir = \"$cache\""
	if [ -n "${LOAD_TIMEOUT:-}" ]; then echo "load_timeout = \"$LOAD_TIMEOUT\""; fi
} >"$dir/kvhost.toml"
start=$(date +%s%N)
"$kvhost" --config "$dir/kvhost.toml" --dir "$dir/blocks" --socket "$dir/s.sock" --capacity 1GiB >"$dir/log" 2>&1 &
pid=$!
until "$kvhost" health --socket "$dir/s.sock" >/dev/null 2>&1; do
	if ! kill -0 "$pid" 2>/dev/null; then
		echo "the daemon exited:" >&2
		cat "$dir/log" >&2
		exit 1
	fi
	sleep 0.005
done
answered=$(date +%s%N)
sleep "${WAIT:-0}"
kill -TERM "$pid"
wait "$pid" || true
echo "$(basename "$policy") $(((answered - start) / 1000000)) ms"
if [ -n "${VERBOSE:-}" ]; then grep -E 'policy|interim' "$dir/log" || true; fi
