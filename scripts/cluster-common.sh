# Shared by scripts/cephfs.sh and scripts/glusterfs.sh (sourced, not run):
# installing the file system's Debian packages and running a command
# against a fresh cluster. The sourcing script sets FS (its name in
# messages), PACKAGES (the Debian packages), RUN_PREFIX (mktemp's prefix
# for `run`) and defines usage, die and its own `up` and `down` commands.

# install_packages: installs the missing PACKAGES with apt-get (as root, or
# through password-less sudo); exit status 3 where they cannot be.
install_packages() {
	local missing=()
	command -v dpkg-query >/dev/null 2>&1 || { echo "$FS: cannot install ${PACKAGES[*]}: no dpkg (not Debian)" >&2; return 3; }
	for p in "${PACKAGES[@]}"; do
		dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
	done
	[ ${#missing[@]} -eq 0 ] && return 0
	command -v apt-get >/dev/null 2>&1 || { echo "$FS: cannot install ${missing[*]}: no apt-get" >&2; return 3; }
	local sudo=""
	if [ "$(id -u)" -ne 0 ]; then
		sudo -n true 2>/dev/null || { echo "$FS: cannot install ${missing[*]}: not root and no password-less sudo" >&2; return 3; }
		sudo="sudo -n"
	fi
	echo "$FS: installing ${missing[*]} with apt-get" >&2
	$sudo apt-get -o DPkg::Lock::Timeout=600 update -qq || { echo "$FS: cannot install ${missing[*]}: apt-get update failed" >&2; return 3; }
	DEBIAN_FRONTEND=noninteractive $sudo apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends "${missing[@]}" >/dev/null ||
		{ echo "$FS: cannot install ${missing[*]}: apt-get install failed" >&2; return 3; }
}

# skipped REASON: the banner of a suite that cannot run here.
skipped() {
	local bar='################################################################################'
	printf '%s\n' "$bar" "## SKIPPED: the multi-node suite on $FS did not run: $1." \
		"## It needs root (FUSE mounts) and the Debian packages ${PACKAGES[*]}," \
		"## which it installs with apt-get." "$bar" >&2
}

# Leftovers. A run that is interrupted, killed or whose tests time out can
# leave daemons, FUSE mounts (live, or dead: "Transport endpoint is not
# connected") and the processes of a test still holding files on them.
# `down` does not rest on pid files and `mountpoint` alone: it also stops
# every process whose command line names a path under DIR, and unmounts
# every mount under DIR that /proc/self/mountinfo lists (`mountpoint` says
# "not a mountpoint" of a dead FUSE mount).

# mounts_under: the mount points at or under DIR, deepest first.
mounts_under() {
	local p
	awk '{print $5}' /proc/self/mountinfo | while read -r p; do
		p=$(printf '%b' "$p") # mountinfo writes a space as \040
		case "$p" in "$DIR" | "$DIR"/*) echo "$p" ;; esac
	done | sort -r
}

# running PID: PID is a process, and not a zombie.
running() {
	[ -r "/proc/$1/stat" ] && [ "$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null)" != Z ]
}

# ancestors: this process and its ancestors, which a sweep leaves alone.
ancestors() {
	local p=$$
	while [ -n "$p" ] && [ "$p" -gt 1 ]; do
		echo "$p"
		p=$(awk '/^PPid:/{print $2}' "/proc/$p/status" 2>/dev/null)
	done
}

# procs_under: the processes (pid and command line) whose command line
# names a path under DIR or that hold a file open under it (a test's daemon
# on a mount, which a timed-out go test leaves running), but for this
# process and its ancestors.
#   procs_under --holders: only those holding a file open under a mount.
procs_under() {
	local me pid m
	me=" $(ancestors | tr '\n' ' ') "
	{
		if [ "${1:-}" = --holders ]; then
			while read -r m; do
				[ -n "$m" ] && find /proc/[0-9]*/fd -lname "$m/*" 2>/dev/null | cut -d/ -f3
			done < <(mounts_under)
		else
			grep -lsaF -e "$DIR/" /proc/[0-9]*/cmdline | cut -d/ -f3
			find /proc/[0-9]*/fd -lname "$DIR/*" 2>/dev/null | cut -d/ -f3
		fi
	} | sort -un | while read -r pid; do
		case "$me" in *" $pid "*) continue ;; esac
		[ -d "/proc/$pid" ] || continue # grep itself, gone
		echo "$pid $(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | cut -c1-120)"
	done
}

# sweep [--holders]: SIGTERM every process of procs_under, SIGKILL those
# left after 5 s, each named on stderr; fails if one outlives SIGKILL by
# 10 s.
sweep() {
	local grace=5 left pid line
	left=$(procs_under "$@")
	[ -n "$left" ] || return 0
	while read -r line; do
		echo "${0##*/}: left over under $DIR, SIGTERM: $line" >&2
		kill -TERM "${line%% *}" 2>/dev/null || true
	done <<<"$left"
	local deadline=$(($(date +%s) + grace)) killed=false
	while :; do
		left=$(for pid in $(cut -d' ' -f1 <<<"$left"); do running "$pid" && echo "$pid"; done)
		[ -n "$left" ] || return 0
		if [ "$(date +%s)" -ge "$deadline" ]; then
			$killed && { echo "${0##*/}: still alive after SIGKILL: $left" >&2; return 1; }
			echo "${0##*/}: still alive ${grace} s after SIGTERM, SIGKILL:" $left >&2
			# shellcheck disable=SC2086
			kill -KILL $left 2>/dev/null || true
			killed=true
			deadline=$(($(date +%s) + 10))
		fi
		sleep 0.1
	done
}

# unmount_under unmounts every mount under DIR, lazily where it stays busy
# after a few tries; fails if one is still listed.
unmount_under() {
	local m try
	for try in 1 2 3 4 5; do
		while read -r m; do
			[ -n "$m" ] || continue
			umount "$m" 2>/dev/null || { [ "$try" -ge 3 ] && umount -l "$m" 2>/dev/null; } || true
		done < <(mounts_under)
		[ -z "$(mounts_under)" ] && return 0
		sleep 0.5
	done
	echo "${0##*/}: still mounted under $DIR:" $(mounts_under) >&2
	return 1
}

# down_all NAME FN: down's steps, each tried whatever the one before did
# (a step that fails must not leave the daemons after it running): stop
# the processes using the mounts, unmount_all, FN (NAME: the script's own
# daemons), stop what is left, unmount what is left, remove DIR. Fails
# naming the steps that failed.
down_all() {
	local failed=()
	try() { (step "$@") || failed+=("$1"); }
	try "stop users of mounts" sweep --holders
	try "unmount clients" unmount_all
	try "$1" "$2"
	try "stop what is left" sweep
	try "unmount what is left" unmount_under
	try "remove $DIR" rm -rf "$DIR"
	[ ${#failed[@]} -eq 0 ] || { echo "${0##*/}: down $DIR: failed: ${failed[*]} (above)" >&2; return 1; }
}

# sweep_stale_runs takes down the clusters of earlier runs whose runner is
# gone (killed where no trap runs, or a machine's reboot...): their daemons
# would hold memory, CPU and ports, and their mounts /tmp paths, for good.
# A run's directory names its runner in runner.pid; another live run's is
# left alone.
sweep_stale_runs() {
	local d pid
	for d in /tmp/"$RUN_PREFIX"-*; do
		[ -f "$d/runner.pid" ] || continue
		pid=$(cat "$d/runner.pid" 2>/dev/null)
		runner_alive "$pid" && continue
		echo "$FS: $d is left by run $pid, which is gone: taking it down" >&2
		"$0" down "$d" || echo "$FS: could not take $d down (above); going on" >&2
	done
}

# runner_alive PID: PID is a live run of a cluster script.
runner_alive() {
	[ -n "$1" ] && tr '\0' ' ' <"/proc/$1/cmdline" 2>/dev/null | grep -Eq '(cephfs|glusterfs|rgw)\.sh run '
}

# run_cmd MOUNTS CMD...: CMD with KVHOST_CLUSTER_MOUNTS set to MOUNTS; a
# script may define its own after sourcing this (rgw.sh).
run_cmd() {
	local mounts=$1
	shift
	KVHOST_CLUSTER_MOUNTS=$mounts "$@"
}

# run_suite [--skip-uninstallable] [--dir DIR] N CMD...: up on a fresh
# directory (DIR, taking down what an earlier run left there, or a new one
# under /tmp), CMD with KVHOST_CLUSTER_MOUNTS set, down whatever happens
# (INT, TERM and HUP too); CMD's exit status.
run_suite() {
	local skip=false dir=""
	while :; do
		case "${1:-}" in
		--skip-uninstallable) skip=true && shift ;;
		--dir) dir=${2:-} && shift 2 ;;
		*) break ;;
		esac
	done
	# RUN_NODES: the sourcing script's run takes no N (rgw.sh).
	local n=${RUN_NODES:-${1:-}}
	[ -n "${RUN_NODES:-}" ] || shift
	[[ "$n" =~ ^[1-9][0-9]*$ ]] && [ $# -ge 1 ] || usage
	if [ "$(id -u)" -ne 0 ]; then
		$skip || die "run needs root (FUSE mounts, apt-get)"
		skipped "not root"
		return 0
	fi
	local rc=0
	install_packages || rc=$?
	if [ "$rc" -eq 3 ] && $skip; then
		skipped "the packages cannot be installed here (the reason is above)"
		return 0
	fi
	[ "$rc" -eq 0 ] || return "$rc"
	sweep_stale_runs
	if [ -n "$dir" ]; then
		RUN_DIR=$(realpath -m "$dir")
		if [ -e "$RUN_DIR" ]; then
			local owner
			owner=$(cat "$RUN_DIR/runner.pid" 2>/dev/null || true)
			runner_alive "$owner" && die "$RUN_DIR is in use by run $owner"
			echo "$FS: $RUN_DIR holds what an earlier run left: taking it down" >&2
			"$0" down "$RUN_DIR" || die "cannot take down $RUN_DIR (above)"
		fi
		mkdir -p "$RUN_DIR"
	else
		RUN_DIR=$(mktemp -d "/tmp/$RUN_PREFIX-XXXXXX")
	fi
	echo $$ >"$RUN_DIR/runner.pid"
	trap '"$0" down "$RUN_DIR"' EXIT
	trap 'exit 130' INT
	trap 'exit 143' TERM
	trap 'exit 129' HUP
	local mounts
	mounts=$("$0" up "$RUN_DIR" "$n") || return 1
	run_cmd "$mounts" "$@" || rc=$?
	return "$rc"
}
