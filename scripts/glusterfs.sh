#!/usr/bin/env bash
# A one-host GlusterFS volume for kvhost's multi-node suite (docs/cluster.md),
# the second file system beside scripts/cephfs.sh: Debian's glusterd
# without systemd, its working directory under DIR, one volume of one brick
# in DIR/brick with the client-side performance caches off, mounted N times
# by the FUSE client with its attribute, entry and negative caches off (one
# client per simulated node), so that every client sees the others' renames
# and removals at once.
#
#   scripts/glusterfs.sh up DIR N    start (or finish starting) and mount at
#                                    DIR/node1 … DIR/nodeN; prints the mount
#                                    points joined by ':' on stdout
#   scripts/glusterfs.sh down DIR    unmount, stop the volume and glusterd,
#                                    remove DIR; also stops what a killed
#                                    run left there (cluster-common.sh)
#   scripts/glusterfs.sh install     only install the packages; exit status
#                                    3 when they cannot be installed here
#   scripts/glusterfs.sh run [--skip-uninstallable] [--dir DIR] N CMD...
#                                    up N on a fresh directory under /tmp
#                                    (or DIR, as for cephfs.sh),
#                                    CMD with KVHOST_CLUSTER_MOUNTS set to
#                                    the mounts, down whatever happens
#
# glusterd listens on its usual port (24007) and socket: one such volume
# per host at a time. GLUSTERFS_CACHES=on leaves the caches at Gluster's
# defaults (to see what the suite finds then). GLUSTERFS_TIMEOUT (default
# 60) bounds every wait, in seconds.
set -euo pipefail

PACKAGES=(glusterfs-server glusterfs-client)
FS=GlusterFS
RUN_PREFIX=kvhost-gluster
# shellcheck source=scripts/cluster-common.sh
. "$(dirname "$0")/cluster-common.sh"
TIMEOUT=${GLUSTERFS_TIMEOUT:-60}
CACHES=${GLUSTERFS_CACHES:-off}
VOLUME=kvhost
# The client-side translators that cache data, attributes or entries.
PERF_CACHES=(stat-prefetch quick-read io-cache read-ahead readdir-ahead write-behind open-behind nl-cache)

die() {
	echo "glusterfs: $*" >&2
	exit 1
}

usage() {
	echo "usage: $0 up DIR N | down DIR | install | run [--skip-uninstallable] N CMD..." >&2
	exit 2
}

now() { date +%s.%N; }

# step NAME CMD...: runs CMD, printing how long it took; on failure names
# the step and exits.
step() {
	local name=$1
	shift
	local t0
	t0=$(now)
	"$@" || die "step '$name' failed after $(awk "BEGIN{printf \"%.2f\", $(now)-$t0}") s"
	printf 'glusterfs: %-22s %6.2f s\n' "$name" "$(awk "BEGIN{print $(now)-$t0}")" >&2
}

# waitfor WHAT CMD...: polls CMD every 0.2 s until it succeeds or TIMEOUT
# seconds pass.
waitfor() {
	local what=$1
	shift
	local deadline=$(($(date +%s) + TIMEOUT))
	until "$@" >/dev/null 2>&1; do
		if [ "$(date +%s)" -ge "$deadline" ]; then
			echo "glusterfs: $what: not within ${TIMEOUT} s" >&2
			return 1
		fi
		sleep 0.2
	done
}

gluster_() { gluster --mode=script "$@"; }

# alive PIDFILE: the process the pid file names runs.
alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

# quiet CMD...: CMD with its output in log/setup.log, shown on failure.
quiet() {
	if ! "$@" >>"$DIR/log/setup.log" 2>&1; then
		echo "--- $* failed; tail of $DIR/log/setup.log" >&2
		tail -n 20 "$DIR/log/setup.log" >&2
		return 1
	fi
}

start_glusterd() {
	mkdir -p "$DIR"/{glusterd,run,log,brick}
	alive "$DIR/run/glusterd.pid" && return 0
	sed "s#^\( *option working-directory \).*#\1$DIR/glusterd#" /etc/glusterfs/glusterd.vol >"$DIR/glusterd.vol"
	quiet glusterd -f "$DIR/glusterd.vol" -p "$DIR/run/glusterd.pid" -l "$DIR/log/glusterd.log" || return 1
	waitfor "glusterd answering" gluster_ volume list
}

# make_volume creates and starts the volume on one brick. Gluster refuses
# a loopback address for a brick: the host's name it is.
make_volume() {
	if ! gluster_ volume info "$VOLUME" >/dev/null 2>&1; then
		quiet gluster_ volume create "$VOLUME" "$(hostname):$DIR/brick" force || return 1
		if [ "$CACHES" = off ]; then
			local o
			for o in "${PERF_CACHES[@]}"; do
				quiet gluster_ volume set "$VOLUME" "performance.$o" off || return 1
			done
		fi
	fi
	gluster_ volume info "$VOLUME" | grep -q '^Status: Started' || quiet gluster_ volume start "$VOLUME"
}

mount_all() {
	local i opts=()
	[ "$CACHES" = off ] && opts=(--attribute-timeout=0 --entry-timeout=0 --negative-timeout=0 --fopen-keep-cache=off)
	for i in $(seq 1 "$N"); do
		local m="$DIR/node$i"
		mkdir -p "$m"
		mountpoint -q "$m" && continue
		quiet glusterfs --volfile-server="$(hostname)" --volfile-id="$VOLUME" "${opts[@]}" \
			-p "$DIR/run/client.node$i.pid" -l "$DIR/log/client.node$i.log" "$m" || return 1
		waitfor "mount $m" mountpoint -q "$m" || return 1
	done
}

# stop PIDFILE: SIGTERM, then SIGKILL after TIMEOUT/4 seconds.
stop() {
	alive "$1" || { rm -f "$1"; return 0; }
	local pid
	pid=$(cat "$1")
	kill -TERM "$pid"
	local deadline=$(($(date +%s) + TIMEOUT / 4))
	while kill -0 "$pid" 2>/dev/null && [ "$(cat "/proc/$pid/stat" 2>/dev/null | awk '{print $3}')" != Z ]; do
		if [ "$(date +%s)" -ge "$deadline" ]; then
			kill -KILL "$pid" 2>/dev/null || true
			break
		fi
		sleep 0.1
	done
	rm -f "$1"
}

unmount_all() {
	local rc=0 pf
	unmount_under || rc=1
	for pf in "$DIR"/run/client.*.pid; do
		[ -e "$pf" ] && stop "$pf"
	done
	return "$rc"
}

# stop_volume stops and deletes the volume (its brick process goes with
# it), then glusterd.
stop_volume() {
	if alive "$DIR/run/glusterd.pid"; then
		gluster_ volume stop "$VOLUME" force >/dev/null 2>&1 || true
		gluster_ volume delete "$VOLUME" >/dev/null 2>&1 || true
	fi
	stop "$DIR/run/glusterd.pid"
}

cmd=${1:-}
case "$cmd" in
install)
	install_packages
	exit
	;;
run)
	shift
	run_suite "$@"
	exit
	;;
esac
DIR=${2:-}
[ -n "$cmd" ] && [ -n "$DIR" ] || usage
DIR=$(realpath -m "$DIR")

case "$cmd" in
up)
	N=${3:-}
	[[ "$N" =~ ^[1-9][0-9]*$ ]] || usage
	[ "$(id -u)" -eq 0 ] || die "up needs root (FUSE mounts, apt-get)"
	[ -e /dev/fuse ] || die "up needs /dev/fuse"
	t0=$(now)
	step "install packages" install_packages
	step "start glusterd" start_glusterd
	step "create volume" make_volume
	step "mount $N clients" mount_all
	printf 'glusterfs: %-22s %6.2f s\n' "up" "$(awk "BEGIN{print $(now)-$t0}")" >&2
	mounts=()
	for i in $(seq 1 "$N"); do mounts+=("$DIR/node$i"); done
	(IFS=:; echo "${mounts[*]}")
	;;
down)
	[ -e "$DIR" ] || exit 0
	[ -f "$DIR/glusterd.vol" ] || [ -f "$DIR/runner.pid" ] ||
		awk -v d="$DIR/" 'index($5, d) == 1 && / - fuse\.glusterfs /{f = 1} END{exit !f}' /proc/self/mountinfo ||
		die "$DIR has no glusterd.vol: not a volume of this script, left alone"
	t0=$(now)
	rc=0
	down_all "stop volume" stop_volume || rc=1
	printf 'glusterfs: %-22s %6.2f s\n' "down" "$(awk "BEGIN{print $(now)-$t0}")" >&2
	exit "$rc"
	;;
*) usage ;;
esac
