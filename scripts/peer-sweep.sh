#!/usr/bin/env bash
# Runs docs/performance.md's comparison with llm-d on a machine with a CUDA
# GPU: kvhost bench and llm-d's engine (scripts/peer-llmd.py) in turn on the
# same workload, 256 keys of 32 MiB (Llama-3.1-8B bf16, 256 tokens a key),
# 16 jobs and 16 I/O threads, every loaded byte compared on both sides.
#
#   make gpu-bins                                        # here
#   LLMD=DIR scripts/peer-sweep.sh [BINDIR] [OUT]        # there, as root
#
# DIR holds llm-d's storage_offload module, built from llm-d's source
# (docs/performance.md, "How to run the comparison"); this script only
# imports it. BINDIR is what make gpu-bins built (default gpu-bins, or its
# .tar.xz); OUT (default $OUT, else ./peer-out) gets peer.txt (every line
# both engines printed, in the sweep-file format docs/performance.md's
# summary reads) and one kvhost bench --json report per run, kv-cur-NAME.json;
# a NAME ending in -N runs after llm-d's run of that name. Parts
# can be switched off: SHM=0 (8 GiB on the memory file system: llm-d, the
# kvhost scenarios, llm-d again), BIG=0 (16 GiB there, one run each),
# DISK=0 (2 GiB of durable stores and cold loads on the disk, two pairs).
# SHM_DIR (default /dev/shm/peer) and DISK_DIR (default /var/tmp/peer) are
# emptied by each run. LIMIT (seconds, default 150) bounds each run.
set -uo pipefail
bin=${1:-gpu-bins}
out=${2:-${OUT:-peer-out}}
limit=${LIMIT:-150}
shm=${SHM_DIR:-/dev/shm/peer}
disk=${DISK_DIR:-/var/tmp/peer}
here=$(cd "$(dirname "$0")" && pwd)
: "${LLMD:?set LLMD to the directory that holds the storage_offload module built from llm-d}"
export PYTHONPATH="$LLMD${PYTHONPATH:+:$PYTHONPATH}"
python3 -c 'import torch, storage_offload' || { echo "peer-sweep: storage_offload does not import from LLMD=$LLMD" >&2; exit 2; }
if [ -f "$bin.tar.xz" ] && [ ! -d "$bin" ]; then
	mkdir -p "$bin" && tar -C "$bin" -xJf "$bin.tar.xz"
fi
mkdir -p "$out" "$shm" "$disk"
raw=$out/peer.txt
status=0
version=$("$bin/kvhost" version 2>/dev/null)
version=${version#kvhost }
{
	echo "# kvhost beside llm-d, written by scripts/peer-sweep.sh; commit ${version%% *}"
	echo "-- $(date -u +%FT%TZ)"
	nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader
	lscpu | grep -E "Model name|^CPU\(s\)"
	uname -r
} >"$raw"

llmd() { # name dir gib [driver flags]: one llm-d run of two rounds
	local name=$1 dir=$2 gib=$3; shift 3
	echo "== llmd $name: $dir/ll $gib 16 2 $*" >>"$raw"
	if ! timeout "$limit" python3 "$here/peer-llmd.py" "$dir/ll" "$gib" 16 2 "$@" >>"$raw" 2>"$out/llmd-$name.err"; then
		{ echo "   llmd FAILED or cut at ${limit}s"; tail -5 "$out/llmd-$name.err"; } >>"$raw"; status=1
	fi
	rm -rf "${dir:?}/ll"
}
kv() { # name dir [bench flags]: one kvhost bench run of two rounds
	local name=$1 dir=$2; shift 2
	local args=(--dir "$dir" --tokens-per-key 256 --jobs 16 --rounds 2 --mix write,read "$@")
	echo "== kvhost-cur $name: ${args[*]}" >>"$raw"
	if ! timeout "$limit" "$bin/kvhost" bench --progress off "${args[@]}" --json "$out/kv-cur-$name.json" >>"$raw" 2>&1; then
		echo "   kvhost FAILED or cut at ${limit}s" >>"$raw"; status=1
	fi
	rm -rf "${dir:?}"/*
}

if [ "${SHM:-1}" = 1 ] || [ "${BIG:-1}" = 1 ]; then
	# A fresh VM faults its memory in from the host on first use, which
	# would slow whichever run came first.
	echo "-- warm-up: 32 GiB written to $shm and removed" >>"$raw"
	dd if=/dev/zero of="$shm/warm" bs=1M count=32768 status=none; rm -f "$shm/warm"
fi
if [ "${SHM:-1}" = 1 ]; then
	llmd shm32-1 "$shm" 8
	kv shm32-1 "$shm" --total 8GiB                              # defaults: spares made ahead, registered files
	kv restart-nogap-1 "$shm" --total 8GiB --restart --no-gap # a new daemon's loads as soon as it is open
	kv foreign-1 "$shm" --total 8GiB --foreign                # another engine's files, right after their lookup
	kv fresh-1 "$shm" --total 8GiB --preallocate 0            # stores into fresh files
	kv nogap-1 "$shm" --total 8GiB --no-gap                   # loads right after their stores
	llmd shm32-2 "$shm" 8
fi
if [ "${BIG:-1}" = 1 ]; then
	llmd shm16g-1 "$shm" 16
	kv shm16g-1 "$shm" --total 16GiB
fi
if [ "${DISK:-1}" = 1 ]; then
	echo "-- disk warm-up: 8 GiB written to $disk with O_DIRECT and removed" >>"$raw"
	dd if=/dev/zero of="$disk/warm" bs=4M count=2048 oflag=direct conv=fsync status=none; rm -f "$disk/warm"
	for i in 1 2; do
		llmd "disk-$i" "$disk" 2 --cold --sync
		kv "disk-$i" "$disk" --total 2GiB --drop-caches --fsync true
	done
fi
echo "-- done $(date -u +%FT%TZ) after $SECONDS s" >>"$raw"
grep -E '^(llmd|==|--)|  auto ' "$raw"
exit $status
