#!/usr/bin/env bash
# Benchmarks and end-to-end checks on the GPU test machine (16 cores, tmpfs
# and an ext4 disk, torch), from binaries built here:
#   make build   # bin/kvhost, plugins/wasm/*.wasm
#   go test -c -o .devbin/engine.test ./internal/engine
#   go test -c -o .devbin/server.test ./internal/server
#   go test -c -o .devbin/policy.test ./host/policy
# carried with the tree (carry: .devbin, bin, plugins/wasm). Results go to
# $OUT (or ./bench-out).
set -uo pipefail
out=${OUT:-bench-out}
mkdir -p "$out"
root=$PWD
{
	echo "== machine"; nproc; free -g | head -2; df -h / /dev/shm | tail -2; uname -r
} 2>&1 | tee "$out/machine.txt"
keys=${KVHOST_BENCH_KEYS:-32}
mkdir -p /root/kvbench

if [ "${ENGINE:-1}" = 1 ]; then
	echo "== engine store/load, $keys keys of 32 MiB, tmpfs"
	KVHOST_BENCH_DIR=/dev/shm KVHOST_BENCH_KEYS=$keys .devbin/engine.test -test.run '^$' \
		-test.bench 'Store|Load' -test.benchtime 3x -test.count 3 2>&1 | tee "$out/engine-shm.txt" | grep -E '^Benchmark'
fi
if [ "${ENGINE:-1}" = 1 ] && [ "${DISK:-1}" = 1 ]; then
	echo "== engine store/load, $keys keys of 32 MiB, ext4 disk"
	KVHOST_BENCH_DIR=/root/kvbench KVHOST_BENCH_KEYS=$keys .devbin/engine.test -test.run '^$' \
		-test.bench "${DISK_BENCH:-Store|Load}" -test.benchtime 3x -test.count 3 2>&1 | tee "$out/engine-disk.txt" | grep -E '^Benchmark'
fi

echo "== policy boundary and warm start"
(cd host/policy && "$root/.devbin/policy.test" -test.run '^$' -test.bench "${POLICY_BENCH:-Boundary|StartWarm}" \
	-test.benchtime 1s -test.count 3 2>&1) | tee "$out/policy.txt" | grep -E '^Benchmark'

echo "== control path"
.devbin/server.test -test.run '^$' -test.bench . -test.benchtime 5000x 2>&1 | tee "$out/server.txt" | grep -E '^Benchmark'

echo "== daemon + Python client with torch host tensors"
for dir in /dev/shm/kvd /root/kvd; do
	sock=/tmp/kvhost-check.sock
	bin/kvhost --dir "$dir" --socket "$sock" --log-format json >"$out/daemon-$(basename "$(dirname "$dir")").log" 2>&1 &
	pid=$!
	for _ in $(seq 100); do [ -S "$sock" ] && break; sleep 0.1; done
	PYTHONUNBUFFERED=1 python3 scripts/device-torch-check.py "$sock" "$keys" 2>&1 | tee -a "$out/torch.txt"
	echo "   (mount $dir)"
	kill -TERM "$pid"; wait "$pid"; echo "   daemon exit status $?"
	echo "   temporary files left: $(find "$dir" -name '.tmp*' | wc -l)"
done
