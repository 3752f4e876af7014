#!/usr/bin/env bash
# An s3local endpoint (internal/s3local, bin/s3local) for kvhost's object
# mount where no object store can run (docs/object.md, "Without an object
# store: s3local").
#
#   scripts/s3local.sh run CMD...
#       starts bin/s3local on a fresh directory (under /dev/shm where it
#       can), runs CMD with KVHOST_S3_ENDPOINT, KVHOST_S3_ACCESS_KEY and
#       KVHOST_S3_SECRET_KEY set, as scripts/rgw.sh run does, stops the
#       endpoint and removes the directory whatever happens; CMD's exit
#       status. KVHOST_RGW_DIR stays unset: the tests that need RGW's
#       controls (kill, pause, quotas) skip.
set -euo pipefail

if [[ "${1:-}" != run || $# -lt 2 ]]; then
	echo "usage: $0 run CMD..." >&2
	exit 2
fi
shift
bin="$(dirname "$0")/../bin/s3local"
[[ -x "$bin" ]] || { echo "s3local: $bin is missing: make bin/s3local" >&2; exit 1; }
base=/dev/shm
[[ -d "$base" && -w "$base" ]] || base="${TMPDIR:-/tmp}"
dir="$(mktemp -d "$base/kvhost-s3local.XXXXXX")"
mkdir "$dir/data"
access=s3local-test secret=s3local-test-secret
"$bin" --dir "$dir/data" --addr 127.0.0.1:0 --access-key "$access" --secret-key "$secret" >"$dir/url" 2>"$dir/log" &
pid=$!
trap 'kill "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; rm -rf "$dir"' EXIT
# It prints its URL once it listens.
for _ in $(seq 200); do
	[[ -s "$dir/url" ]] && break
	kill -0 "$pid" 2>/dev/null || { cat "$dir/log" >&2; exit 1; }
	sleep 0.05
done
[[ -s "$dir/url" ]] || { echo "s3local did not start within 10 s" >&2; cat "$dir/log" >&2; exit 1; }
status=0
KVHOST_S3_ENDPOINT="$(head -1 "$dir/url")" KVHOST_S3_ACCESS_KEY="$access" KVHOST_S3_SECRET_KEY="$secret" "$@" || status=$?
exit "$status"
