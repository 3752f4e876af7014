#!/usr/bin/env bash
# Runs the engine and control-path benchmarks on the GPU test machine (16
# cores, tmpfs and an ext4 disk), from test binaries built here with
#   go test -c -o .devbin/engine.test ./host/engine
#   go test -c -o .devbin/server.test ./server
# and carried in .devbin/. Results go to $OUT (or ./bench-out).
set -uo pipefail
out=${OUT:-bench-out}
mkdir -p "$out"
{
	echo "== machine"; nproc; free -g | head -2; df -h / /dev/shm | tail -2; uname -r
} 2>&1 | tee "$out/machine.txt"
keys=${KVHOST_BENCH_KEYS:-32}
mkdir -p /root/kvbench
for dir in /dev/shm /root/kvbench; do
	name=$(basename "$dir")
	echo "== engine store/load, $keys keys of 32 MiB, dir $dir"
	KVHOST_BENCH_DIR=$dir KVHOST_BENCH_KEYS=$keys .devbin/engine.test -test.run '^$' \
		-test.bench 'Store|Load' -test.benchtime 3x -test.count 3 2>&1 | tee "$out/engine-$name.txt" | grep -E '^Benchmark|engine'
done
echo "== index rebuild, 100,000 files"
KVHOST_BENCH_DIR=/root/kvbench .devbin/engine.test -test.run '^$' -test.bench 'Rebuild' -test.benchtime 1x 2>&1 | tee "$out/rebuild.txt" | grep -E '^Benchmark'
echo "== control path"
.devbin/server.test -test.run '^$' -test.bench . -test.benchtime 5000x 2>&1 | tee "$out/server.txt" | grep -E '^Benchmark'
