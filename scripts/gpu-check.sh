#!/usr/bin/env bash
# Runs kvhost's GPU checks and benchmarks on a machine with a CUDA GPU,
# torch and the binaries `make gpu-bins` built (they need no Go there), from
# the repository's root (the Python checks use client/python and scripts/):
#
#   make gpu-bins                      # here: gpu-bins/ (or gpu-bins.tar.xz)
#   scripts/gpu-check.sh [BINDIR] [OUT] # there
#
# Every check writes its log under OUT (default ./gpu-out); the summary
# lines go to stdout. Parts can be switched off: GDS=0 STAGING=0 E2E=0
# MULTI=0 SPEC=0 BENCH=0 HOSTILE=0 INTERFERENCE=0 LOOKUPS=0 CHURN=0 PREALLOC=0 MODELS=0 TORCH=0 RESTART=0 FOREIGN=0 TP2=0 (MULTI, one daemon serving
# two GPUs, runs where nvidia-smi lists two or more and says so where not; so
# does TP2, one daemon for a TP=2 engine's two worker processes, which
# TP2_ONE_GPU=1 runs on one GPU too, both ranks on device 0, and TP2_LLMD=DIR
# runs beside llm-d's engine built in DIR); BATCH=1 adds the cuFile batch measurement (off by
# default: in compatibility mode a batch can hang inside libcufile, and the
# check then ends itself after 40 s). The ext4 disk directory is DISK (default /var/tmp/kvhost-gpu),
# the memory file system SHM (default /dev/shm/kvhost-gpu). WARM (GiB,
# default 32; 0 skips it) is written once to SHM and removed before the
# first part: a fresh VM faults its memory in from the host on first
# use, and plain writes of fresh tmpfs files then ran at 9.5 GB/s against
# 24 a run later.
#
# cuFile registration on a VM or container without a udev database fails
# with 5027; as root the script writes the udev record of DISK's block
# device so that the cuFile path can be checked (compatibility mode where
# nvidia-fs is not loaded).
set -uo pipefail
bin=${1:-gpu-bins}
out=${2:-${OUT:-gpu-out}}
mkdir -p "$out"
if [ -f "$bin.tar.xz" ] && [ ! -d "$bin" ]; then
	mkdir -p "$bin" && tar -C "$bin" -xJf "$bin.tar.xz"
fi
disk=${DISK:-/var/tmp/kvhost-gpu}
shm=${SHM:-/dev/shm/kvhost-gpu}
mkdir -p "$disk" "$shm"
export PYTHONUNBUFFERED=1

{
	echo "== machine"
	nproc; free -g | head -2; df -h "$disk" "$shm" | tail -2
	nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader 2>/dev/null
} 2>&1 | tee "$out/machine.txt"

if [ "${WARM:-32}" -gt 0 ]; then
	echo "== warm-up: ${WARM:-32} GiB written to $shm and removed"
	dd if=/dev/zero of="$shm/warm" bs=1M count=$((${WARM:-32} * 1024)) status=none; rm -f "$shm/warm"
fi

if [ "$(id -u)" = 0 ]; then
	dev=$(stat -c '%Hd:%Ld' "$disk")
	if [ ! -e "/run/udev/data/b$dev" ]; then
		mkdir -p /run/udev/data
		printf 'E:ID_FS_USAGE=filesystem\nE:ID_FS_TYPE=%s\n' "$(stat -f -c %T "$disk")" >"/run/udev/data/b$dev"
		echo "wrote /run/udev/data/b$dev (cuFile needs it to register files on $disk)"
	fi
fi

status=0
# label DIR: the name of DIR's part in log names (the two directories may
# share a base name).
label() { if [ "$1" = "$shm" ]; then echo shm; else echo disk; fi; }
run() { # name command...: runs, logs, remembers a failure
	local name=$1; shift
	echo "== $name"
	if ! "$@" >"$out/$name.txt" 2>&1; then
		echo "   FAILED (see $out/$name.txt)"; status=1
	fi
	grep -E '^(---|ok|PASS|FAIL|case |GDSBENCH)|GB/s|OK|differ|lookups of|^alone p50|^round ' "$out/$name.txt" | head -40
}
# daemon SOCK LOG DIR [FLAGS...]: starts a daemon on a fresh DIR, sets
# pid, and waits for its socket; stop_daemon stops it and reports.
daemon() {
	local sock=$1 log=$2 dir=$3; shift 3
	rm -rf "$dir" "$sock"
	"$bin/kvhost" "$@" --dir "$dir" --socket "$sock" --log-format json >"$log" 2>&1 &
	pid=$!
	for _ in $(seq 200); do [ -S "$sock" ] && break; sleep 0.1; done
}
# metrics ADDR PREFIX...: the daemon's metric lines that start with a PREFIX.
metrics() {
	python3 - "$@" <<'PY'
import sys, urllib.request
body = urllib.request.urlopen(f"http://{sys.argv[1]}/metrics", timeout=10).read().decode()
print("".join(l for l in body.splitlines(True) if l.startswith(tuple(sys.argv[2:]))), end="")
PY
}
stop_daemon() {
	if kill -0 "$pid" 2>/dev/null; then
		kill -TERM "$pid"; wait "$pid"; echo "   daemon exit status $?"
	else
		wait "$pid"; echo "   FAILED: the daemon died (exit status $?)"; status=1
	fi
}

[ "${GDS:-1}" = 1 ] && run gds env KVHOST_GPU=1 KVHOST_GPU_DIR="$disk" KVHOST_GPU_TMPFS="$shm" \
	"$bin/gds-gpu.test" -test.run GPU -test.v
[ "${BATCH:-0}" = 1 ] && run gds-batch env KVHOST_GPU_BATCH=1 KVHOST_GPU_DIR="$disk" \
	"$bin/gds-gpu.test" -test.run GPUBatch -test.v -test.timeout 210s
# The staging pipeline's check and benchmark, the checksum kernel (its
# registers against the CPU's, its speed, the mover with checksums on the
# GPU), and what registering files costs copies and jobs on other streams.
[ "${STAGING:-1}" = 1 ] && run staging env KVHOST_GPU=1 KVHOST_GPU_TMPFS="$shm" KVHOST_GPU_DISK="$disk" \
	"$bin/staging-gpu.test" -test.run 'TestGPUCheckAndBenchmark|TestGPUSumKernel|TestGPURegistrationBesideCopies|TestGPURegisteredJobsBesideRegistrations' -test.v
# CUDA IPC registration from a torch process, with the real runtime: the
# daemon finds the tensor's bytes in what it imported; bad handles and
# ranges get clear errors; imports close on unregister and on client exit.
[ "${TORCH:-1}" = 1 ] && run torch env KVHOST_GPU=1 KVHOST_TORCH_SCRIPT=internal/server/testdata/torch_ipc.py \
	KVHOST_PYTHONPATH=client/python/src "$bin/server-gpu.test" -test.run TestGPUTorchRegistration -test.v

if [ "${E2E:-1}" = 1 ]; then
	for dir in "$shm" "$disk"; do
		for tpk in 256 16; do
			sock=/tmp/kvhost-gpu-check.sock
			log="$out/daemon-$(label "$dir")-$tpk.log"
			daemon "$sock" "$log" "$dir/cache"
			keys=64; [ "$tpk" = 16 ] && keys=512
			run "e2e-$(label "$dir")-$tpk" python3 scripts/gpu-e2e.py "$sock" "$tpk" "$keys" 8
			grep -h '"mount serves GPU memory\|"GPU paths ready\|cufile' "$log" | head -3
			stop_daemon
		done
	done
	# The setting docs/vllm.md recommends for small keys: a job's keys
	# packed eight to a file (2 MiB keys, 64 per job), on the memory mount.
	sock=/tmp/kvhost-gpu-check.sock
	log="$out/daemon-shm-16-packed.log"
	printf '[policy.params]\nkeys_per_file = 8\n' >"$out/packed.toml"
	daemon "$sock" "$log" "$shm/packed" --config "$out/packed.toml"
	run e2e-shm-16-packed python3 scripts/gpu-e2e.py "$sock" 16 512 8
	stop_daemon
	# 512 keys of 2 MiB in files of eight: 64 files of 16 MiB and a header.
	packed=$(find "$shm/packed" -type f -size +16M | wc -l)
	echo "   files of eight keys: $packed (64 expected)"
	[ "$packed" = 64 ] || { echo "   FAILED: the keys were not packed"; status=1; }
fi
if [ "${MULTI:-1}" = 1 ]; then
	# One daemon, two GPUs: keys stored from both at once, each GPU's keys
	# loaded into the other's paged cache and compared.
	ngpu=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | wc -l)
	if [ "$ngpu" -ge 2 ]; then
		for dir in "$shm" "$disk"; do
			sock=/tmp/kvhost-gpu-multi.sock
			log="$out/daemon-multi-$(label "$dir").log"
			daemon "$sock" "$log" "$dir/multi"
			run "multi-$(label "$dir")" python3 scripts/gpu-multi.py "$sock" 256 32 8
			stop_daemon
		done
	else
		echo "== multi: not run, this machine has $ngpu GPU (it needs two)"
	fi
fi
if [ "${TP2:-1}" = 1 ]; then
	# One daemon, one tensor-parallel engine (TP = 2): a worker process per
	# GPU, each with its shard of the paged cache registered by CUDA IPC,
	# storing and loading alone and both at once through the kvhost client
	# and KvhostConnector's worker half (and llm-d's engine with TP2_LLMD),
	# every loaded byte compared; registered tmpfs files, then the pinned
	# pipeline (docs/gpu.md, "Two GPUs, one daemon").
	ngpu=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | wc -l)
	if [ "$ngpu" -ge 2 ] || [ "${TP2_ONE_GPU:-0}" = 1 ]; then
		[ "$ngpu" -ge 2 ] || echo "== tp2: $ngpu GPU: both ranks on device 0 (TP2_ONE_GPU=1), a functional check, not the two-GPU figure"
		llmd=()
		[ -n "${TP2_LLMD:-}" ] && llmd=(--llmd "$TP2_LLMD")
		for pipe in registered pinned; do
			flags=()
			[ "$pipe" = pinned ] && flags=(--pinned)
			rm -rf "$shm/tp2" "$shm"/tp2-llmd-rank*
			run "tp2-$pipe" python3 scripts/gpu-tp2.py --dir "$shm/tp2" --kvhost-bin "$bin/kvhost" \
				--json "$out/tp2-$pipe.json" ${flags[@]+"${flags[@]}"} ${llmd[@]+"${llmd[@]}"}
			grep -E '^tp2 (ratio|vs_llmd) ' "$out/tp2-$pipe.txt" | sed 's/^/   /'
		done
	else
		echo "== tp2: not run, this machine has $ngpu GPU (it needs two; TP2_ONE_GPU=1 runs both ranks on device 0)"
	fi
fi
if [ "${HOSTILE:-1}" = 1 ]; then
	# Misbehaving CUDA IPC clients (forged, other-device, out-of-range and
	# stale handles; a client killed and one that frees its memory mid-job)
	# while a good client round-trips its own keys; daemon on tmpfs.
	sock=/tmp/kvhost-gpu-hostile.sock
	log="$out/daemon-hostile.log"
	daemon "$sock" "$log" "$shm/hostile"
	run hostile python3 "${HOSTILE_SCRIPT:-scripts/gpu-ipc-hostile.py}" "$sock" --log "$log" --pid "$pid"
	echo "   daemon log: $(grep -c '"level":"WARN"' "$log") warnings, $(grep -c '"level":"ERROR"' "$log") errors"
	stop_daemon
fi
if [ "${INTERFERENCE:-1}" = 1 ]; then
	# What kvhost's copies cost the inference process's kernels and the
	# daemon's lookups: matmuls and lookups alone and beside loads through
	# a daemon, with the default DMA copies, with gpu.copy = "kernel", with
	# DMA copies whose waits never poll (gpu.poll = "0s"), and with the
	# checksums computed on the GPU (gpu.checksum_on = "gpu"). The keys are
	# registered files by the time they load, which move by DMA copies in
	# every copy mode, so the kernel's daemon registers none
	# (register_files = 0): its loads go through the pinned buffers, where
	# the kernel moves them.
	for mode in batch kernel batch-nopoll batch-gpu-sums; do
		sock=/tmp/kvhost-gpu-interference.sock
		case $mode in
		kernel) printf '[gpu]\ncopy = "kernel"\nregister_files = 0\n' >"$out/copy-$mode.toml" ;;
		batch-nopoll) printf '[gpu]\ncopy = "batch"\npoll = "0s"\n' >"$out/copy-$mode.toml" ;;
		batch-gpu-sums) printf '[gpu]\ncopy = "batch"\nchecksum_on = "gpu"\n' >"$out/copy-$mode.toml" ;;
		*) printf '[gpu]\ncopy = "%s"\n' "$mode" >"$out/copy-$mode.toml" ;;
		esac
		daemon "$sock" "$out/daemon-interference-$mode.log" "$shm/interference" --config "$out/copy-$mode.toml"
		run "interference-$mode" python3 scripts/gpu-interference.py "$sock" 8 64 8
		stop_daemon
	done
fi
if [ "${LOOKUPS:-1}" = 1 ]; then
	# Lookups paced like a scheduler's (one every 2 ms) beside host-memory
	# loads of 16 threads, with the daemon's spare Go processor and
	# without it (GOMAXPROCS = the CPUs in its environment, as before the
	# spare), alternated. The client's C lookup probe is built first (as
	# make python-ext does) where a compiler and Python's headers are
	# there; each probe then also runs through the Python probe.
	(cd client/python && python3 setup.py -q build_ext --inplace >/dev/null 2>&1) ||
		echo "   the C lookup probe did not build: lookups probe in Python"
	echo "   lookup probe: $(PYTHONPATH=client/python/src python3 -c 'from kvhost import lookuptable as t; print(t.NATIVE or "python")')"
	sock=/tmp/kvhost-gpu-lookups.sock
	for round in 1 2; do
		for spare in yes no; do
			if [ $spare = yes ]; then
				daemon "$sock" "$out/daemon-lookups-$spare-$round.log" "$shm/lookups"
			else
				GOMAXPROCS=$(nproc) daemon "$sock" "$out/daemon-lookups-$spare-$round.log" "$shm/lookups"
			fi
			run "lookups-spare-$spare-$round" python3 scripts/lookup-latency.py "$sock" 5 16 2
			stop_daemon
		done
		# The same, looked up back to back (a busy scheduler's CPU).
		daemon "$sock" "$out/daemon-lookups-b2b-$round.log" "$shm/lookups"
		run "lookups-b2b-$round" python3 scripts/lookup-latency.py "$sock" 5 16 0
		stop_daemon
	done
fi
if [ "${CHURN:-1}" = 1 ]; then
	# A full cache on the memory mount: rounds of 64 new 32 MiB keys into
	# a mount that holds about two rounds, so that stores write into
	# evicted files; with the files registered with CUDA (the default)
	# and without (gpu.register_files = 0), alternated. The daemon's
	# metrics say how many jobs moved registered files directly. In the
	# first round a third daemon keeps at most 64 registered files, fewer
	# than the cache holds (about 150): at that bound a file takes an idle
	# registered file's place only at its second offer (deferred offers).
	sock=/tmp/kvhost-gpu-churn.sock
	for round in 1 2; do
		regs="16384 0"
		[ "$round" = 1 ] && regs="16384 0 64"
		for reg in $regs; do
			name="churn-register-$reg-$round"
			printf '[gpu]\nregister_files = %d\n' "$reg" >"$out/$name.toml"
			daemon "$sock" "$out/daemon-$name.log" "$shm/churn" --config "$out/$name.toml" --capacity 5GiB --metrics 127.0.0.1:9479
			run "$name" python3 scripts/gpu-churn.py "$sock" 6 64 8
			metrics 127.0.0.1:9479 kvhost_gpu_direct "kvhost_gpu_registered_files " kvhost_gpu_file_reg kvhost_reused \
				| tee -a "$out/$name.txt" | sed 's/^/   /'
			if [ "$reg" = 64 ]; then # the bound must have deferred offers and held
				python3 - "$out/$name.txt" <<'PY' || { echo "   FAIL: the bound of 64 registered files deferred no offer or was exceeded"; status=1; }
import re, sys
t = open(sys.argv[1]).read()
deferred = float(re.search(r'result="deferred"\} (\S+)', t).group(1))
files = float(re.search(r'^kvhost_gpu_registered_files (\S+)', t, re.M).group(1))
print(f"   bound of 64: {deferred:.0f} offers deferred, {files:.0f} files registered")
sys.exit(0 if deferred > 0 and files <= 64 else 1)
PY
			fi
			stop_daemon
		done
	done
fi
if [ "${PREALLOC:-1}" = 1 ]; then
	# A cache with room on the memory mount: rounds of 64 new 32 MiB keys
	# into a mount that holds them all, so that every store writes a new
	# file; a daemon with the default settings, which makes spare files
	# ahead of stores (preallocate auto: an eighth of the 40 GiB, at most
	# 4 GiB), alternated with one that does not (--preallocate 0), each
	# round after an idle second. The metrics say how many spares were
	# made and how many stores wrote into one.
	sock=/tmp/kvhost-gpu-prealloc.sock
	for round in 1 2; do
		for pre in default 0; do
			name="prealloc-$pre-$round"
			flags=()
			[ "$pre" = default ] || flags=(--preallocate "$pre")
			daemon "$sock" "$out/daemon-$name.log" "$shm/prealloc" --capacity 40GiB ${flags[@]+"${flags[@]}"} --metrics 127.0.0.1:9479
			run "$name" python3 scripts/gpu-churn.py "$sock" 6 64 8 256 1
			metrics 127.0.0.1:9479 kvhost_gpu_direct "kvhost_gpu_registered_files " kvhost_reused kvhost_spare_files_made kvhost_evictions \
				| tee -a "$out/$name.txt" | sed 's/^/   /'
			stop_daemon
		done
	done
fi
if [ "${MODELS:-1}" = 1 ]; then
	# Two models on one daemon: two processes store and load at once on
	# the memory mount, one with 32 MiB keys (64 a round) and one with
	# 2 MiB keys (512 a round), each its own namespace, 6 rounds each
	# after an idle second; a default daemon (spares shared between the
	# two namespaces) and one with --preallocate 0. Both processes must
	# pass; the metrics say how many of the 3456 stores wrote into a spare.
	sock=/tmp/kvhost-gpu-models.sock
	for pre in default 0; do
		name="models-$pre"
		flags=()
		[ "$pre" = default ] || flags=(--preallocate "$pre")
		daemon "$sock" "$out/daemon-$name.log" "$shm/models" --capacity 40GiB ${flags[@]+"${flags[@]}"} --metrics 127.0.0.1:9479
		python3 scripts/gpu-churn.py "$sock" 6 64 8 256 1 >"$out/$name-32mib.txt" 2>&1 &
		big=$!
		python3 scripts/gpu-churn.py "$sock" 6 512 8 16 1 >"$out/$name-2mib.txt" 2>&1 &
		small=$!
		echo "== $name"
		for p in "$big:32mib" "$small:2mib"; do
			if ! wait "${p%%:*}"; then
				echo "   FAILED (see $out/$name-${p#*:}.txt)"; status=1
			fi
			grep -E 'GB/s|OK|differ' "$out/$name-${p#*:}.txt" | sed "s/^/   ${p#*:} /"
		done
		metrics 127.0.0.1:9479 kvhost_stored_keys_total kvhost_gpu_direct kvhost_reused kvhost_spare_files_made kvhost_evictions \
			| tee -a "$out/$name.txt" | sed 's/^/   /'
		stop_daemon
	done
fi
if [ "${RESTART:-1}" = 1 ]; then
	# Loads after a restart: one daemon stores 256 keys of 32 MiB into
	# tmpfs, a new daemon on the same directory loads them. With files
	# registered (the default) the new daemon offers the files it finds at
	# start to the registrar; it gets an idle moment (until its count of
	# registered files stops rising) before the load. register_files = 0 is
	# the pinned pipeline, in the same call. Alternated, two rounds.
	sock=/tmp/kvhost-gpu-restart.sock
	for round in 1 2; do
		for reg in 16384 0; do
			name="restart-register-$reg-$round"
			printf '[gpu]\nregister_files = %d\n' "$reg" >"$out/$name.toml"
			daemon "$sock" "$out/daemon-$name-a.log" "$shm/restart" --config "$out/$name.toml" --capacity 20GiB
			python3 scripts/gpu-restart.py store "$sock" 256 256 16 >"$out/$name-store.txt" 2>&1 || status=1
			stop_daemon >/dev/null
			"$bin/kvhost" --config "$out/$name.toml" --capacity 20GiB --dir "$shm/restart" --socket "$sock" \
				--log-format json --metrics 127.0.0.1:9479 >"$out/daemon-$name-b.log" 2>&1 &
			pid=$!
			for _ in $(seq 200); do [ -S "$sock" ] && break; sleep 0.1; done
			last=-1
			for _ in $(seq 120); do
				n=$(metrics 127.0.0.1:9479 "kvhost_gpu_registered_files " | awk '{print $2}')
				[ "$n" = "$last" ] && break
				last=$n; sleep 1
			done
			echo "registered before the load: ${last}" >>"$out/$name-store.txt"
			run "$name" sh -c "cat '$out/$name-store.txt'; python3 scripts/gpu-restart.py load '$sock' 256 256 16"
			metrics 127.0.0.1:9479 kvhost_gpu_direct "kvhost_gpu_registered_files " kvhost_gpu_file_warm \
				| tee -a "$out/$name.txt" | sed 's/^/   /'
			stop_daemon
		done
	done
fi
if [ "${FOREIGN:-1}" = 1 ]; then
	# Loads of another process's files: daemon A (node-a) stores 256 keys
	# of 32 MiB into a shared tmpfs directory; daemon B (node-b), running
	# beside it on the same directory, is asked for them at once: its
	# lookups find A's files, and the load follows with no idle moment
	# (registered files only where B's registrar got there first). Then
	# the same load again after B's count of registered files stops rising.
	# FOREIGN_ROUNDS rounds (default 2); FOREIGN_CHECKSUM_ON (cpu or gpu,
	# default cpu) is both daemons' gpu.checksum_on.
	sums=${FOREIGN_CHECKSUM_ON:-cpu}
	for round in $(seq "${FOREIGN_ROUNDS:-2}"); do
		name="foreign-$round"
		[ "$sums" = cpu ] || name="foreign-$sums-sums-$round"
		for node in a b; do
			printf '[engine]\nnode_id = "node-%s"\n[gpu]\nchecksum_on = "%s"\n[[mount]]\npath = "%s"\nshared = true\ncapacity = "20GiB"\n' \
				"$node" "$sums" "$shm/foreign" >"$out/$name-$node.toml"
		done
		rm -rf "$shm/foreign" && mkdir -p "$shm/foreign"
		"$bin/kvhost" --config "$out/$name-a.toml" --socket /tmp/kvhost-gpu-fa.sock \
			--log-format json >"$out/daemon-$name-a.log" 2>&1 &
		pida=$!
		for _ in $(seq 200); do [ -S /tmp/kvhost-gpu-fa.sock ] && break; sleep 0.1; done
		"$bin/kvhost" --config "$out/$name-b.toml" --socket /tmp/kvhost-gpu-fb.sock \
			--log-format json --metrics 127.0.0.1:9481 >"$out/daemon-$name-b.log" 2>&1 &
		pid=$!
		for _ in $(seq 200); do [ -S /tmp/kvhost-gpu-fb.sock ] && break; sleep 0.1; done
		python3 scripts/gpu-restart.py store /tmp/kvhost-gpu-fa.sock 256 256 16 >"$out/$name-store.txt" 2>&1 || status=1
		run "$name" sh -c "cat '$out/$name-store.txt'; python3 scripts/gpu-restart.py load /tmp/kvhost-gpu-fb.sock 256 256 16"
		metrics 127.0.0.1:9481 kvhost_gpu_direct "kvhost_gpu_registered_files " | sed 's/^/   /'
		last=-1
		for _ in $(seq 120); do
			n=$(metrics 127.0.0.1:9481 "kvhost_gpu_registered_files " | awk '{print $2}')
			[ "$n" = "$last" ] && break
			last=$n; sleep 1
		done
		run "$name-idle" sh -c "echo 'registered before the load: $last'; python3 scripts/gpu-restart.py load /tmp/kvhost-gpu-fb.sock 256 256 16"
		stop_daemon
		kill -TERM "$pida"; wait "$pida"
	done
fi
[ "${SPEC:-1}" = 1 ] && run spec env KVHOST_GPU=1 KVHOST_BIN="$bin/kvhost" \
	python3 client/python/tests/gpu_spec_check.py "$out/spec.json"
if [ "${BENCH:-1}" = 1 ]; then
	"$bin/kvhost" check --dir "$disk" >"$out/check-disk.txt" 2>&1 || true
	"$bin/kvhost" check --dir "$shm" >"$out/check-shm.txt" 2>&1 || true
fi
exit $status
