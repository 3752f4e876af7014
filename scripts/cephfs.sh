#!/usr/bin/env bash
# A one-host CephFS cluster for kvhost's multi-node suite (docs/cluster.md),
# from Debian's packages and without systemd: a monitor, a manager, one OSD
# on a sparse file-backed bluestore device, an MDS and a file system, all
# under one directory and mounted N times by ceph-fuse (one client per
# simulated node).
#
#   scripts/cephfs.sh up DIR N   start (or finish starting) the cluster and
#                                mount it at DIR/node1 … DIR/nodeN; prints
#                                the mount points joined by ':' on stdout
#   scripts/cephfs.sh down DIR   unmount, stop every daemon, remove DIR;
#                                also stops what a killed run left there
#                                (cluster-common.sh: processes naming or
#                                holding a path under DIR, dead mounts)
#   scripts/cephfs.sh status DIR the cluster's status (ceph -s)
#   scripts/cephfs.sh install    only install the packages; exit status 3
#                                when they cannot be installed here
#   scripts/cephfs.sh run [--skip-uninstallable] [--dir DIR] N CMD...
#                                up N on a fresh directory under /tmp (or
#                                DIR, taking down what an earlier run left
#                                there), CMD with KVHOST_CLUSTER_MOUNTS set
#                                to the mounts, down whatever happens (INT,
#                                TERM, HUP too); CMD's exit status. The
#                                monitor takes the first free pair of ports
#                                from CEPHFS_MON_PORT and CEPHFS_MON_PORT2
#                                up. First it takes down the clusters of
#                                earlier runs that were killed.
#                                --skip-uninstallable: where the packages
#                                cannot be installed (or not root) print a
#                                SKIPPED banner and exit 0
#
# Both are idempotent: every step checks whether it is already done (a
# daemon whose pid file names a live process, a pool or file system that
# exists, a mount point that is mounted), so `up` on a running cluster only
# adds missing mounts and `down` on nothing does nothing. Every step is
# timed on stderr; a failed step is named with the tail of its log.
#
# Written from Ceph's manual deployment documentation. Authentication is
# off (auth_*_required = none): the cluster listens on 127.0.0.1 only and
# exists for tests (RATIONALE.md). Environment: CEPHFS_MON_PORT (default
# 6789, the v1 port; v2 is CEPHFS_MON_PORT2, default 3300; `up` refuses
# ports another process listens on and names it; CEPHFS_PICK_PORTS=1, as
# `run` sets, takes the next free pair below 6800 instead),
# CEPHFS_OSD_SIZE (default 8G, the sparse bluestore file), CEPHFS_TIMEOUT
# (default 120, seconds a wait may take).
set -euo pipefail

PACKAGES=(ceph-mon ceph-mgr ceph-osd ceph-mds ceph-fuse ceph-common)
FS=CephFS
RUN_PREFIX=kvhost-ceph
# shellcheck source=scripts/cluster-common.sh
. "$(dirname "$0")/cluster-common.sh"
MON_PORT=${CEPHFS_MON_PORT:-6789}
MON_PORT2=${CEPHFS_MON_PORT2:-3300}
OSD_SIZE=${CEPHFS_OSD_SIZE:-8G}
TIMEOUT=${CEPHFS_TIMEOUT:-120}

die() {
	echo "cephfs: $*" >&2
	exit 1
}

usage() {
	echo "usage: $0 up DIR N | down DIR | status DIR | install | run [--skip-uninstallable] N CMD..." >&2
	exit 2
}

now() { date +%s.%N; }

# step NAME CMD...: runs CMD, printing how long it took; on failure names
# the step and exits.
step() {
	local name=$1
	shift
	local t0 t1
	t0=$(now)
	if ! "$@"; then
		t1=$(now)
		echo "cephfs: step '$name' failed after $(awk "BEGIN{printf \"%.2f\", $t1-$t0}") s" >&2
		exit 1
	fi
	t1=$(now)
	printf 'cephfs: %-22s %6.2f s\n' "$name" "$(awk "BEGIN{print $t1-$t0}")" >&2
}

# waitfor WHAT CMD...: polls CMD every 0.2 s until it succeeds or TIMEOUT
# seconds pass.
waitfor() {
	local what=$1
	shift
	local deadline=$(($(date +%s) + TIMEOUT))
	until "$@" >/dev/null 2>&1; do
		if [ "$(date +%s)" -ge "$deadline" ]; then
			echo "cephfs: $what: not within ${TIMEOUT} s" >&2
			return 1
		fi
		sleep 0.2
	done
}

# logtail NAME: the last lines of a daemon's log, for a failure message.
logtail() {
	local f="$DIR/log/$1.log"
	[ -f "$f" ] && { echo "--- tail of $f" >&2; tail -n 20 "$f" >&2; }
	return 1
}

ceph_() { ceph --conf "$DIR/ceph.conf" --connect-timeout 10 "$@"; }

# quiet CMD...: runs CMD with its output appended to log/setup.log, which
# is shown when CMD fails.
quiet() {
	if ! "$@" >>"$DIR/log/setup.log" 2>&1; then
		echo "--- $* failed; tail of $DIR/log/setup.log" >&2
		tail -n 20 "$DIR/log/setup.log" >&2
		return 1
	fi
}

# alive NAME: the daemon whose pid file is run/NAME.pid runs.
alive() {
	local pf="$DIR/run/$1.pid"
	[ -s "$pf" ] && kill -0 "$(cat "$pf")" 2>/dev/null
}

# port_holder PORT: the listener on PORT (its pid and command line, and
# the cluster directory it was started for), nothing where it is free.
port_holder() {
	local l pid cmd
	l=$(ss -Hltnp "sport = :$1" 2>/dev/null | head -n 1)
	[ -n "$l" ] || return 0
	pid=$(grep -o 'pid=[0-9]*' <<<"$l" | head -n 1 | cut -d= -f2)
	cmd=$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | cut -c1-120)
	printf 'port %s: pid %s (%s)' "$1" "${pid:-?}" "${cmd:-?}"
	if [[ "$cmd" =~ --conf\ ([^ ]*)/ceph\.conf ]]; then
		printf ', the cluster of %s (`%s down %s` stops it)' "${BASH_REMATCH[1]}" "$0" "${BASH_REMATCH[1]}"
	fi
	echo
}

# choose_ports sets MON_PORT and MON_PORT2 to a pair no process listens
# on: the given one, or with CEPHFS_PICK_PORTS=1 the next free pair up to
# 6799 (6800-7300 are the daemons' own ports). Another run's monitor on
# the same ports would otherwise answer this cluster's commands.
choose_ports() {
	local v1=$MON_PORT v2=$MON_PORT2 held
	while :; do
		held=$(port_holder "$v1"; port_holder "$v2")
		if [ -z "$held" ]; then
			[ "$v1" = "$MON_PORT" ] || echo "cephfs: ports $MON_PORT and $MON_PORT2 are taken; the monitor takes $v1 and $v2" >&2
			MON_PORT=$v1 MON_PORT2=$v2
			return 0
		fi
		if [ "${CEPHFS_PICK_PORTS:-0}" != 1 ] || [ $((v1 + 1)) -ge 6800 ]; then
			echo "cephfs: the monitor's ports are not free (set CEPHFS_MON_PORT and CEPHFS_MON_PORT2 to others):" >&2
			echo "$held" >&2
			return 1
		fi
		v1=$((v1 + 1)) v2=$((v2 + 1))
	done
}

# conf_ports sets MON_PORT and MON_PORT2 from ceph.conf's mon_host.
conf_ports() {
	local h
	h=$(awk '/^mon_host = /{print $3}' "$DIR/ceph.conf")
	[[ "$h" =~ ^\[v2:127\.0\.0\.1:([0-9]+),v1:127\.0\.0\.1:([0-9]+)\]$ ]] || die "$DIR/ceph.conf: mon_host $h is not this script's"
	MON_PORT2=${BASH_REMATCH[1]} MON_PORT=${BASH_REMATCH[2]}
}

conf_fsid() { awk '/^fsid = /{print $3}' "$DIR/ceph.conf"; }

write_conf() {
	[ -f "$DIR/ceph.conf" ] && return 0
	choose_ports || return 1
	mkdir -p "$DIR"/{run,log,mon,mgr,osd,mds,blocks}
	local fsid
	fsid=$(cat /proc/sys/kernel/random/uuid)
	cat >"$DIR/ceph.conf.new" <<EOF
# Written by scripts/cephfs.sh: a one-host test cluster under $DIR.
[global]
fsid = $fsid
mon_initial_members = a
mon_host = [v2:127.0.0.1:$MON_PORT2,v1:127.0.0.1:$MON_PORT]
public_addr = 127.0.0.1
ms_bind_ipv6 = false
auth_cluster_required = none
auth_service_required = none
auth_client_required = none
keyring = $DIR/keyring
run_dir = $DIR/run
admin_socket = $DIR/run/\$name.asok
pid_file = $DIR/run/\$name.pid
log_file = $DIR/log/\$name.log
mon_cluster_log_file = $DIR/log/cluster.log
mon_data = $DIR/mon/\$cluster-\$id
mgr_data = $DIR/mgr/\$cluster-\$id
osd_data = $DIR/osd/\$cluster-\$id
mds_data = $DIR/mds/\$cluster-\$id
osd_pool_default_size = 1
osd_pool_default_min_size = 1
osd_pool_default_pg_autoscale_mode = off
osd_crush_chooseleaf_type = 0
mon_allow_pool_size_one = true
mon_allow_pool_delete = true
mon_warn_on_pool_no_redundancy = false
mon_data_avail_warn = 5
# One host, one OSD: the bluestore block file lives outside the OSD's data
# directory (inside it, bluestore's symlink points at itself: ELOOP).
osd_objectstore = bluestore
bluestore_block_path = $DIR/blocks/\$cluster-\$id
bluestore_block_create = true
bluestore_block_size = $(numfmt --from=iec "$OSD_SIZE")
osd_memory_target = 1073741824
# A client reading a file another client keeps renaming over otherwise
# waits for the MDS journal to flush (about 5 s) at each rename.
mds_early_reply = false

[client]
admin_socket = $DIR/run/\$name.\$pid.asok
log_file = $DIR/log/\$name.log
EOF
	mv "$DIR/ceph.conf.new" "$DIR/ceph.conf"
}

start_mon() {
	alive mon.a && return 0
	conf_ports
	if [ -n "$(port_holder "$MON_PORT")$(port_holder "$MON_PORT2")" ]; then
		echo "cephfs: mon.a of $DIR is not running and its ports are taken:" >&2
		port_holder "$MON_PORT" >&2
		port_holder "$MON_PORT2" >&2
		return 1
	fi
	if [ ! -f "$DIR/mon/ceph-a/done" ]; then
		rm -rf "$DIR/mon/ceph-a" "$DIR/monmap"
		quiet ceph-authtool --create-keyring "$DIR/keyring" --gen-key -n mon. --cap mon 'allow *' || return 1
		quiet monmaptool --create --fsid "$(conf_fsid)" \
			--addv a "[v2:127.0.0.1:$MON_PORT2,v1:127.0.0.1:$MON_PORT]" "$DIR/monmap" || return 1
		quiet ceph-mon --conf "$DIR/ceph.conf" -i a --mkfs --monmap "$DIR/monmap" --keyring "$DIR/keyring" || logtail mon.a || return 1
		touch "$DIR/mon/ceph-a/done"
	fi
	# fd 9 is the ports' lock (up): the daemon must not keep it.
	quiet ceph-mon --conf "$DIR/ceph.conf" -i a 9>&- || logtail mon.a || return 1
	waitfor "the monitor answering" ceph_ mon stat || logtail mon.a || return 1
	local fsid
	fsid=$(ceph_ fsid 2>/dev/null)
	[ "$fsid" = "$(conf_fsid)" ] ||
		{ echo "cephfs: the monitor on port $MON_PORT2 is another cluster's (fsid $fsid, this one's $(conf_fsid))" >&2; return 1; }
}

start_mgr() {
	alive mgr.x && return 0
	mkdir -p "$DIR/mgr/ceph-x"
	quiet ceph-mgr --conf "$DIR/ceph.conf" -i x || logtail mgr.x
}

start_osd() {
	alive osd.0 && return 0
	if [ ! -f "$DIR/osd/ceph-0/done" ]; then
		local uuid
		uuid=$(cat /proc/sys/kernel/random/uuid)
		rm -rf "$DIR/osd/ceph-0" "$DIR/blocks/ceph-0"
		mkdir -p "$DIR/osd/ceph-0"
		# `osd new` is idempotent for a uuid but not across uuids: reuse id 0.
		if ceph_ osd dump 2>/dev/null | grep -q '^osd\.0 '; then
			quiet ceph_ osd purge 0 --yes-i-really-mean-it || return 1
		fi
		local id
		id=$(ceph_ osd new "$uuid" 2>>"$DIR/log/setup.log") || return 1
		[ "$id" = 0 ] || die "start osd: the monitor gave id $id, want 0"
		quiet ceph-osd --conf "$DIR/ceph.conf" -i 0 --mkfs --osd-uuid "$uuid" || logtail osd.0 || return 1
		touch "$DIR/osd/ceph-0/done"
	fi
	quiet ceph-osd --conf "$DIR/ceph.conf" -i 0 || logtail osd.0 || return 1
	waitfor "osd.0 up" sh -c "ceph --conf '$DIR/ceph.conf' osd stat | grep -q '1 up'" || logtail osd.0
}

start_mds() {
	alive mds.a && return 0
	mkdir -p "$DIR/mds/ceph-a"
	# In a session of its own, as ceph-mon, ceph-mgr and ceph-osd put
	# themselves: a Ctrl-C (or a kill of the process group) of whatever ran
	# `up` would otherwise stop the MDS and the clients but not the others,
	# or SIGKILL a client and leave its mount dead. `down` stops them all.
	quiet setsid -w ceph-mds --conf "$DIR/ceph.conf" -i a || logtail mds.a
}

make_fs() {
	if ! ceph_ fs ls 2>/dev/null | grep -q 'name: cephfs,'; then
		ceph_ osd pool ls | grep -qx cephfs_metadata || quiet ceph_ osd pool create cephfs_metadata 8 || return 1
		ceph_ osd pool ls | grep -qx cephfs_data || quiet ceph_ osd pool create cephfs_data 16 || return 1
		quiet ceph_ fs new cephfs cephfs_metadata cephfs_data || return 1
	fi
	waitfor "placement groups active+clean" sh -c \
		"ceph --conf '$DIR/ceph.conf' pg stat | grep -Eq '^[0-9]+ pgs: [0-9]+ active\+clean;'" || return 1
	waitfor "an active MDS" sh -c "ceph --conf '$DIR/ceph.conf' mds stat | grep -q 'up:active'" || logtail mds.a
}

mount_all() {
	local i
	for i in $(seq 1 "$N"); do
		local m="$DIR/node$i"
		mkdir -p "$m"
		mountpoint -q "$m" && continue
		setsid -w ceph-fuse --conf "$DIR/ceph.conf" --id "node$i" "$m" >"$DIR/log/client.node$i.out" 2>&1 ||
			{ cat "$DIR/log/client.node$i.out" >&2; logtail "client.node$i"; return 1; }
		waitfor "mount $m" mountpoint -q "$m" || return 1
	done
}

# stop NAME [GRACE]: SIGTERM the daemon of run/NAME.pid and wait for it to
# exit, SIGKILL after GRACE seconds (default TIMEOUT/4).
stop() {
	local grace=${2:-$((TIMEOUT / 4))}
	local pf="$DIR/run/$1.pid"
	[ -s "$pf" ] || return 0
	local pid
	pid=$(cat "$pf")
	if running "$pid" && grep -q ceph "/proc/$pid/comm" 2>/dev/null; then
		kill -TERM "$pid" 2>/dev/null || true
		local deadline=$(($(date +%s) + grace))
		while running "$pid"; do
			if [ "$(date +%s)" -ge "$deadline" ]; then
				echo "cephfs: $1 (pid $pid) still runs ${grace} s after SIGTERM: SIGKILL" >&2
				kill -KILL "$pid" 2>/dev/null || true
				deadline=$((deadline + 3600))
			fi
			sleep 0.1
		done
	fi
	rm -f "$pf"
}

# unmount_all unmounts every client (every mount under DIR that
# mountinfo lists: a dead one too) and waits for its ceph-fuse to exit (it
# outlives its mount while its session with the MDS closes).
unmount_all() {
	local rc=0 pf
	unmount_under || rc=1
	for pf in "$DIR"/run/client.*.pid; do
		[ -e "$pf" ] && stop "$(basename "$pf" .pid)"
	done
	return "$rc"
}

# stop_daemons stops the servers, the MDS first. The MDS takes about 11 s
# to stop on SIGTERM; its clients are gone and DIR is removed next, so it
# gets 2 s before SIGKILL.
stop_daemons() {
	step "stop mds.a" stop mds.a 2
	local d
	for d in osd.0 mgr.x mon.a; do
		step "stop $d" stop "$d"
	done
}

# Sourced (scripts/rgw.sh): the functions above only.
[ "${BASH_SOURCE[0]}" = "$0" ] || return 0

cmd=${1:-}
case "$cmd" in
install)
	# Exit status 3: the packages cannot be installed here.
	install_packages
	exit
	;;
run)
	shift
	export CEPHFS_PICK_PORTS=1
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
	# Unix socket paths (run/NAME.PID.asok) must stay under 108 bytes.
	[ ${#DIR} -le 60 ] || die "DIR $DIR is longer than 60 bytes: the daemons' sockets would not fit"
	[ "$(id -u)" -eq 0 ] || die "up needs root (FUSE mounts, apt-get)"
	[ -e /dev/fuse ] || die "up needs /dev/fuse"
	t0=$(now)
	step "install packages" install_packages
	# The ports are chosen and the monitor binds them under one lock, so
	# that runs starting at once do not choose the same ones.
	exec 9>>/tmp/kvhost-cephfs-ports.lock
	flock -w "$TIMEOUT" 9 || die "the ports' lock /tmp/kvhost-cephfs-ports.lock: not within $TIMEOUT s"
	step "write ceph.conf" write_conf
	step "start monitor" start_mon
	exec 9>&-
	step "start manager" start_mgr
	step "start osd" start_osd
	step "start mds" start_mds
	step "create file system" make_fs
	step "mount $N clients" mount_all
	printf 'cephfs: %-22s %6.2f s\n' "up" "$(awk "BEGIN{print $(now)-$t0}")" >&2
	mounts=()
	for i in $(seq 1 "$N"); do mounts+=("$DIR/node$i"); done
	(IFS=:; echo "${mounts[*]}")
	;;
down)
	[ -e "$DIR" ] || exit 0
	# A directory of this script: its ceph.conf, a run's, or (a `down`
	# that failed halfway having removed the rest) a ceph-fuse mount or a
	# daemon of its configuration.
	[ -f "$DIR/ceph.conf" ] || [ -f "$DIR/runner.pid" ] ||
		awk -v d="$DIR/" 'index($5, d) == 1 && / - fuse\.ceph-fuse /{f = 1} END{exit !f}' /proc/self/mountinfo ||
		grep -qsaF -e "$DIR/ceph.conf" /proc/[0-9]*/cmdline ||
		die "$DIR has no ceph.conf: not a cluster of this script, left alone"
	t0=$(now)
	rc=0
	down_all "stop daemons" stop_daemons || rc=1
	printf 'cephfs: %-22s %6.2f s\n' "down" "$(awk "BEGIN{print $(now)-$t0}")" >&2
	exit "$rc"
	;;
status)
	ceph_ -s
	;;
*) usage ;;
esac
