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
# More runs of the rows closest to their goals, to see past the machine's
# drift: FRESH_PAIRS=N (default 0) follows the memory part with N pairs of
# a kvhost run into fresh files (fresh-2, ...) and an llm-d run (shm32-3,
# ...), so that each lies between two of the other's; DISK_PAIRS (default
# 2) sets the disk part's pairs, and DISK_BUFFERED=1 adds to each a kvhost
# run through the page cache (the mount's io = "buffered"; disk-buffered-N).
# SHM_DIR (default /dev/shm/peer) and DISK_DIR (default /var/tmp/peer) are
# emptied by each run. LIMIT (seconds, default 150) bounds each run.
# The workload's sizes can be scaled down (the test does, on CPU): GIB (8),
# BIG_GIB (16) and DISK_GIB (2) per part, JOBS (16) jobs and I/O threads,
# WARM_GIB (32) and DISK_WARM_GIB (8) for the warm-ups (0: none); DEVICE
# (default cuda:0) is the driver's torch device.
set -uo pipefail
bin=${1:-gpu-bins}
out=${2:-${OUT:-peer-out}}
limit=${LIMIT:-150}
shm=${SHM_DIR:-/dev/shm/peer}
disk=${DISK_DIR:-/var/tmp/peer}
gib=${GIB:-8} big_gib=${BIG_GIB:-16} disk_gib=${DISK_GIB:-2} jobs=${JOBS:-16}
warm_gib=${WARM_GIB:-32} disk_warm_gib=${DISK_WARM_GIB:-8}
device=()
[ -n "${DEVICE:-}" ] && device=(--device "$DEVICE")
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
	nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
	lscpu | grep -E "Model name|^CPU\(s\)"
	uname -r
} >"$raw"

total() { # gib: kvhost bench's --total for that many GiB
	case $1 in
	*[!0-9]*) awk -v g="$1" 'BEGIN { printf "%dMiB", g * 1024 }' ;;
	*) echo "$1GiB" ;;
	esac
}
llmd() { # name dir gib [driver flags]: one llm-d run of two rounds
	local name=$1 dir=$2 size=$3; shift 3
	echo "== llmd $name: $dir/ll $size $jobs 2 $*" >>"$raw"
	if ! timeout "$limit" python3 "$here/peer-llmd.py" "$dir/ll" "$size" "$jobs" 2 "${device[@]}" "$@" >>"$raw" 2>"$out/llmd-$name.err"; then
		{ echo "   llmd FAILED or cut at ${limit}s"; tail -5 "$out/llmd-$name.err"; } >>"$raw"; status=1
	fi
	rm -rf "${dir:?}/ll"
}
kv() { # name dir [bench flags]: one kvhost bench run of two rounds
	local name=$1 dir=$2; shift 2
	local args=(--dir "$dir" --tokens-per-key 256 --jobs "$jobs" --rounds 2 --mix write,read "$@")
	echo "== kvhost-cur $name: ${args[*]}" >>"$raw"
	if ! timeout "$limit" "$bin/kvhost" bench --progress off "${args[@]}" --json "$out/kv-cur-$name.json" >>"$raw" 2>&1; then
		echo "   kvhost FAILED or cut at ${limit}s" >>"$raw"; status=1
	fi
	rm -rf "${dir:?}"/*
}

if { [ "${SHM:-1}" = 1 ] || [ "${BIG:-1}" = 1 ]; } && [ "$warm_gib" != 0 ]; then
	# A fresh VM faults its memory in from the host on first use, which
	# would slow whichever run came first.
	echo "-- warm-up: $warm_gib GiB written to $shm and removed" >>"$raw"
	dd if=/dev/zero of="$shm/warm" bs=1M count=$((warm_gib * 1024)) status=none; rm -f "$shm/warm"
fi
if [ "${SHM:-1}" = 1 ]; then
	t=$(total "$gib")
	llmd shm32-1 "$shm" "$gib"
	kv shm32-1 "$shm" --total "$t"                              # defaults: spares made ahead, registered files
	kv restart-nogap-1 "$shm" --total "$t" --restart --no-gap # a new daemon's loads as soon as it is open
	kv foreign-1 "$shm" --total "$t" --foreign                # another engine's files, right after their lookup
	kv fresh-1 "$shm" --total "$t" --preallocate 0            # stores into fresh files
	kv nogap-1 "$shm" --total "$t" --no-gap                   # loads right after their stores
	llmd shm32-2 "$shm" "$gib"
	for ((i = 2; i <= ${FRESH_PAIRS:-0} + 1; i++)); do
		kv "fresh-$i" "$shm" --total "$t" --preallocate 0
		llmd "shm32-$((i + 1))" "$shm" "$gib"
	done
fi
if [ "${BIG:-1}" = 1 ]; then
	llmd shm16g-1 "$shm" "$big_gib"
	kv shm16g-1 "$shm" --total "$(total "$big_gib")"
fi
if [ "${DISK:-1}" = 1 ]; then
	if [ "$disk_warm_gib" != 0 ]; then
		echo "-- disk warm-up: $disk_warm_gib GiB written to $disk with O_DIRECT and removed" >>"$raw"
		dd if=/dev/zero of="$disk/warm" bs=4M count=$((disk_warm_gib * 256)) oflag=direct conv=fsync status=none; rm -f "$disk/warm"
	fi
	buffered=${DISK_BUFFERED:-0}
	[ "$buffered" = 1 ] && printf '[[mount]]\npath = "%s"\nio = "buffered"\n' "$disk" >"$out/buffered.toml"
	disk_kv() { # name [bench flags]: one kvhost run on the disk
		local name=$1; shift
		kv "$name" "$disk" --total "$(total "$disk_gib")" --drop-caches --fsync true "$@"
	}
	for ((i = 1; i <= ${DISK_PAIRS:-2}; i++)); do
		llmd "disk-$i" "$disk" "$disk_gib" --cold --sync
		if [ "$buffered" != 1 ]; then
			disk_kv "disk-$i"
		elif ((i % 2)); then # the two kinds of read take turns going first
			disk_kv "disk-$i"; disk_kv "disk-buffered-$i" --config "$out/buffered.toml"
		else
			disk_kv "disk-buffered-$i" --config "$out/buffered.toml"; disk_kv "disk-$i"
		fi
	done
fi
echo "-- done $(date -u +%FT%TZ) after $SECONDS s" >>"$raw"
grep -E '^(llmd|==|--)|  auto ' "$raw"
exit $status
