#!/usr/bin/env bash
# Runs the GPU benchmark sweep of docs/performance.md ("GPU data path") on a
# machine with a CUDA GPU, from the binaries `make gpu-bins` built:
#
#   make gpu-bins                        # here
#   scripts/gpu-bench.sh [BINDIR] [OUT]  # there, as root (drops caches, mounts a tmpfs)
#
# Each part writes a JSON report (kvhost bench --json) and its table under
# OUT (default ./gpu-bench-out); parts can be switched off: SHM=0 JOBS=0
# FRESH=0 FULL=0 DISK=0 PATHS=0 HUGE=0 COPY=0. Each part runs under a time limit
# (LIMIT seconds, default 240) so that one slow part cannot eat the others.
# PROFILE=1 adds a CPU profile of 2 MiB loads on /dev/shm. WARM (GiB,
# default 32; 0 skips it) is written once to the memory file system and
# removed before the first part: a fresh VM faults its memory in from the
# host on first use, which would slow whichever part ran first. DISKWARM
# (GiB, default 16; 0 skips it) is written the same way to the disk, with
# O_DIRECT and fsync, before the first disk part: on a fresh machine's disk
# the first run was measured at 0.74-0.94 of its ceilings (loads
# 0.78-0.86) where the runs after it reached 0.87-1.08
# (docs/bench/h100-disk-order.txt).
set -uo pipefail
bin=${1:-gpu-bins}
out=${2:-${OUT:-gpu-bench-out}}
limit=${LIMIT:-240}
mkdir -p "$out"
if [ -f "$bin.tar.xz" ] && [ ! -d "$bin" ]; then
	mkdir -p "$bin" && tar -C "$bin" -xJf "$bin.tar.xz"
fi
disk=${DISK_DIR:-/var/tmp/kb}
shm=${SHM_DIR:-/dev/shm/kb}
huge=${HUGE_DIR:-/mnt/kvh}
mkdir -p "$disk" "$shm"
G="--path staging --progress off"

if [ "${WARM:-32}" -gt 0 ]; then
	echo "== warm-up: ${WARM:-32} GiB written to $shm and removed"
	dd if=/dev/zero of="$shm/warm" bs=1M count=$((${WARM:-32} * 1024)) status=none; rm -f "$shm/warm"
fi

status=0
bench() { # name args...: one kvhost bench run, its table on stdout and in OUT/name.txt
	local name=$1; shift
	echo "== $name: kvhost bench $*"
	local t0=$SECONDS
	if ! timeout "$limit" "$bin/kvhost" bench "$@" --json "$out/$name.json" 2>&1 | tee "$out/$name.txt"; then
		echo "   FAILED or cut at ${limit}s"; status=1
	fi
	echo "   $((SECONDS - t0)) s"
}

# Memory file system, the key sizes of the targets, 16 jobs, the default
# settings: a cache with room whose spare files the engine makes ahead of
# the stores (mount.preallocate = "auto": an eighth of the mount's
# capacity, at most 4 GiB) while it is idle, and registers.
[ "${SHM:-1}" = 1 ] && bench shm --dir "$shm" $G --tokens-per-key 256,16 --jobs 16 --checksum on,off --total 4GiB --rounds 3
# Fewer jobs.
[ "${JOBS:-1}" = 1 ] && bench shm-jobs --dir "$shm" $G --tokens-per-key 256 --jobs 1,8 --checksum on,off --total 2GiB --rounds 2
# Stores into fresh files: no spares made ahead (--preallocate 0), as in a
# burst longer than the spares or with no idle moment before it.
[ "${FRESH:-1}" = 1 ] && bench fresh --dir "$shm" $G --preallocate 0 --tokens-per-key 256,16 --jobs 16 --checksum on,off --total 4GiB --rounds 3
# A full cache: every round's stores evict the previous round's files and
# write into them (spare files), which the registrar has registered by then.
[ "${FULL:-1}" = 1 ] && bench full --dir "$shm" $G --full --tokens-per-key 256,16 --jobs 16 --checksum on,off --total 4GiB --rounds 5
if [ "${DISKWARM:-16}" -gt 0 ] && { [ "${DISK:-1}" = 1 ] || [ "${PATHS:-1}" = 1 ]; }; then
	echo "== disk warm-up: ${DISKWARM:-16} GiB written to $disk and removed"
	dd if=/dev/zero of="$disk/warm" bs=4M count=$((${DISKWARM:-16} * 256)) oflag=direct conv=fsync status=none; rm -f "$disk/warm"
fi
# The ext4 disk: durable stores, cold loads.
[ "${DISK:-1}" = 1 ] && bench disk --dir "$disk" $G --tokens-per-key 256,16 --jobs 16 --checksum on,off --total 2GiB --rounds 2 --drop-caches --fsync true
# The same disk through each GPU data path, 32 MiB keys, checksums on
# (the default): cuFile (compatibility mode here: a host bounce inside
# libcufile), kvhost's staging pipeline, and plain POSIX I/O of host
# copies.
[ "${PATHS:-1}" = 1 ] && bench disk-paths --dir "$disk" --path cufile,staging,posix --allow-compat --progress off --tokens-per-key 256 --jobs 16 --checksum on --total 1GiB --rounds 2 --drop-caches --fsync true
# A tmpfs with huge pages.
if [ "${HUGE:-1}" = 1 ]; then
	mkdir -p "$huge" && mount -t tmpfs -o size=40G,huge=always tmpfs "$huge" && \
		bench huge --dir "$huge" $G --tokens-per-key 256,16 --jobs 16 --checksum on,off --total 4GiB --rounds 3
	umount "$huge" 2>/dev/null
fi
# The copy kernel (gpu.copy = "kernel") against the default batched
# copies of FRESH, through the engine's pinned buffers, same mount.
if [ "${COPY:-1}" = 1 ]; then
	printf '[gpu]\ncopy = "kernel"\n' >"$out/kernel.toml"
	bench copy-kernel --dir "$shm" --config "$out/kernel.toml" $G --preallocate 0 --tokens-per-key 256,16 --jobs 16 --checksum on --total 4GiB --rounds 3
fi
if [ "${PROFILE:-0}" = 1 ]; then
	bench profile-2m --dir "$shm" $G --tokens-per-key 16 --jobs 16 --checksum on --total 4GiB --rounds 3 --cpu-profile "$out/load-2m.pprof"
fi
exit $status
