#!/usr/bin/env bash
# A one-host Ceph RGW (S3) for kvhost's object mount (docs/object.md), from
# Debian's packages and without systemd: the monitor and the OSD of
# scripts/cephfs.sh (its functions, sourced), and one radosgw with a user
# whose keys the tests use, all under one directory.
#
#   scripts/rgw.sh up DIR        start (or finish starting) it; prints the
#                                endpoint (http://127.0.0.1:PORT) on stdout
#   scripts/rgw.sh down DIR      stop every daemon, remove DIR
#   scripts/rgw.sh kill-rgw DIR  SIGKILL the radosgw (fault tests)
#   scripts/rgw.sh start-rgw DIR start the radosgw again
#   scripts/rgw.sh bucket-quota DIR BUCKET BYTES
#                                cap BUCKET at BYTES (a full bucket)
#   scripts/rgw.sh pause-rgw DIR, resume-rgw DIR
#                                SIGSTOP, SIGCONT the radosgw: an endpoint
#                                that accepts connections and never answers
#   scripts/rgw.sh install       only install the packages; exit status 3
#                                when they cannot be installed here
#   scripts/rgw.sh run [--skip-uninstallable] [--dir DIR] CMD...
#                                up on a fresh directory, CMD with
#                                KVHOST_S3_ENDPOINT, KVHOST_S3_ACCESS_KEY,
#                                KVHOST_S3_SECRET_KEY and KVHOST_RGW_DIR set,
#                                down whatever happens; CMD's exit status.
#                                --skip-uninstallable: where the packages
#                                cannot be installed (or not root) print a
#                                SKIPPED banner and exit 0
#
# The cluster listens on 127.0.0.1 only, authentication between its daemons
# off, as cephfs.sh's (RATIONALE.md); S3 requests are signed with the
# user's keys, which are fixed (a test cluster's): RGW_ACCESS_KEY,
# RGW_SECRET_KEY. RGW_PORT (default 7480; `run` takes the next free one)
# is the radosgw's port; the CEPHFS_* variables set the monitor's.
set -euo pipefail

# cephfs.sh's functions, not its commands (it returns when sourced).
# shellcheck source=scripts/cephfs.sh
. "$(dirname "$0")/cephfs.sh"
PACKAGES=(ceph-mon ceph-osd ceph-common radosgw curl)
FS=RGW
RUN_PREFIX=kvhost-rgw
RUN_NODES=1 # run takes no N
RGW_PORT=${RGW_PORT:-7480}
ACCESS_KEY=${RGW_ACCESS_KEY:-kvhosttestaccesskey0}
SECRET_KEY=${RGW_SECRET_KEY:-kvhosttestsecretkey0000000000000000000000}

die() {
	echo "rgw: $*" >&2
	exit 1
}

usage() {
	echo "usage: $0 up DIR | down DIR | kill-rgw DIR | start-rgw DIR | pause-rgw DIR | resume-rgw DIR | bucket-quota DIR BUCKET BYTES | install | run [--skip-uninstallable] [--dir DIR] CMD..." >&2
	exit 2
}

# rgw_conf adds the radosgw's section to ceph.conf (once), and the
# monitor's pool defaults that keep RGW's pools within one OSD's PGs.
rgw_conf() {
	grep -q '^\[client.rgw.a\]' "$DIR/ceph.conf" && return 0
	local port=$RGW_PORT
	if [ "${CEPHFS_PICK_PORTS:-0}" = 1 ]; then
		while [ -n "$(port_holder "$port")" ]; do port=$((port + 1)); done
	fi
	[ -z "$(port_holder "$port")" ] || { echo "rgw: port $port is taken: $(port_holder "$port")" >&2; return 1; }
	cat >>"$DIR/ceph.conf" <<EOF

[mon]
osd_pool_default_pg_num = 8
osd_pool_default_pgp_num = 8

[client.rgw.a]
rgw_frontends = beast endpoint=127.0.0.1:$port
rgw_data = $DIR/rgw
rgw_dns_name = 127.0.0.1
rgw_enable_usage_log = false
rgw_thread_pool_size = 64
# No metadata cache, hence no watch on the cluster's control objects: a
# killed radosgw's watch would stall the next one's bucket changes until
# the OSD timed it out (30 s), and the fault tests kill it.
rgw_cache_enabled = false
# Quotas checked against the bucket's stats as they are, not as a cache
# held them for 10 minutes: the full-bucket test fills a fresh bucket.
rgw_bucket_quota_ttl = 0
rgw_init_timeout = $TIMEOUT
client_mount_timeout = $TIMEOUT
# Without authentication the monitor's connections cannot be "secure",
# radosgw's default for them: it would retry for rgw_init_timeout.
ms_mon_client_mode = crc
ms_client_mode = crc
EOF
}

rgw_port() { sed -n 's/^rgw_frontends = beast endpoint=127\.0\.0\.1:\([0-9]*\)$/\1/p' "$DIR/ceph.conf"; }

start_rgw() {
	alive client.rgw.a && return 0
	mkdir -p "$DIR/rgw"
	quiet setsid -w radosgw --conf "$DIR/ceph.conf" -n client.rgw.a || logtail client.rgw.a || return 1
	waitfor "the radosgw answering on port $(rgw_port)" curl -s -o /dev/null "http://127.0.0.1:$(rgw_port)/" || logtail client.rgw.a
}

make_user() {
	radosgw-admin --conf "$DIR/ceph.conf" -n client.rgw.a user info --uid kvhost >/dev/null 2>&1 && return 0
	quiet radosgw-admin --conf "$DIR/ceph.conf" -n client.rgw.a user create --uid kvhost --display-name kvhost \
		--access-key "$ACCESS_KEY" --secret "$SECRET_KEY"
}

# warm_pools writes one object to a bucket and removes both, so that the
# radosgw makes its bucket index and data pools now, not inside a test's
# first request (several seconds on a busy machine: longer than a test's
# request timeout).
warm_pools() {
	local url
	url="http://127.0.0.1:$(rgw_port)/kvhost-warm-pools"
	s3() { curl -sSf -o /dev/null --aws-sigv4 "aws:amz:us-east-1:s3" --user "$ACCESS_KEY:$SECRET_KEY" -H "x-amz-content-sha256: UNSIGNED-PAYLOAD" "$@"; }
	s3 -X PUT "$url" && s3 -X PUT --data-binary warm "$url/warm" &&
		s3 -X DELETE "$url/warm" && s3 -X DELETE "$url"
}

# kill_rgw SIGNAL: signals the radosgw and waits for it to exit (SIGKILL
# after 5 s). cephfs.sh's stop signals only processes named ceph-*.
kill_rgw() {
	local pf="$DIR/run/client.rgw.a.pid" pid
	[ -s "$pf" ] || return 0
	pid=$(cat "$pf")
	if running "$pid" && grep -q radosgw "/proc/$pid/comm" 2>/dev/null; then
		kill "-$1" "$pid" 2>/dev/null || true
		local deadline=$(($(date +%s) + 5))
		while running "$pid"; do
			[ "$(date +%s)" -lt "$deadline" ] || kill -KILL "$pid" 2>/dev/null || true
			sleep 0.05
		done
	fi
	rm -f "$pf"
}

# unmount_all: no mounts here, and cephfs.sh's would take the radosgw
# for a client and remove its pid file.
unmount_all() { :; }

# run_cmd ENDPOINT CMD...: CMD with the endpoint and the user's keys
# (run_suite).
run_cmd() {
	local endpoint=$1
	shift
	KVHOST_S3_ENDPOINT=$endpoint KVHOST_S3_ACCESS_KEY=$ACCESS_KEY KVHOST_S3_SECRET_KEY=$SECRET_KEY \
		KVHOST_RGW_DIR=$RUN_DIR "$@"
}

stop_rgw_daemons() {
	step "stop radosgw" kill_rgw TERM
	local d
	for d in osd.0 mon.a; do
		step "stop $d" stop "$d"
	done
}

cmd=${1:-}
case "$cmd" in
install)
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
	[ ${#DIR} -le 60 ] || die "DIR $DIR is longer than 60 bytes: the daemons' sockets would not fit"
	[ "$(id -u)" -eq 0 ] || die "up needs root (apt-get)"
	t0=$(now)
	step "install packages" install_packages
	exec 9>>/tmp/kvhost-cephfs-ports.lock
	flock -w "$TIMEOUT" 9 || die "the ports' lock /tmp/kvhost-cephfs-ports.lock: not within $TIMEOUT s"
	[ -f "$DIR/ceph.conf" ] || step "write ceph.conf" write_conf
	step "radosgw's configuration" rgw_conf
	step "start monitor" start_mon
	# fd 9 is the ports' lock: the daemons must not keep it (the OSD and
	# the radosgw start with it closed; the radosgw's port stays chosen
	# under it until the radosgw listens).
	step "start osd" start_osd 9>&-
	step "start radosgw" start_rgw 9>&-
	exec 9>&-
	step "make the S3 user" make_user
	step "make the bucket pools" warm_pools
	printf 'rgw: %-22s %6.2f s\n' "up" "$(awk "BEGIN{print $(now)-$t0}")" >&2
	echo "http://127.0.0.1:$(rgw_port)"
	;;
down)
	[ -e "$DIR" ] || exit 0
	[ -f "$DIR/ceph.conf" ] || [ -f "$DIR/runner.pid" ] ||
		grep -qsaF -e "$DIR/ceph.conf" /proc/[0-9]*/cmdline ||
		die "$DIR has no ceph.conf: not a cluster of this script, left alone"
	t0=$(now)
	rc=0
	down_all "stop daemons" stop_rgw_daemons || rc=1
	printf 'rgw: %-22s %6.2f s\n' "down" "$(awk "BEGIN{print $(now)-$t0}")" >&2
	exit "$rc"
	;;
kill-rgw) kill_rgw KILL ;;
bucket-quota)
	[ $# -eq 4 ] || usage
	radosgw-admin --conf "$DIR/ceph.conf" -n client.rgw.a quota set --quota-scope=bucket --bucket="$3" --max-size="$4" >/dev/null &&
		radosgw-admin --conf "$DIR/ceph.conf" -n client.rgw.a quota enable --quota-scope=bucket --bucket="$3" >/dev/null
	;;
pause-rgw | resume-rgw)
	[ -s "$DIR/run/client.rgw.a.pid" ] || die "no radosgw runs under $DIR"
	kill "-$([ "$cmd" = pause-rgw ] && echo STOP || echo CONT)" "$(cat "$DIR/run/client.rgw.a.pid")"
	;;
start-rgw) start_rgw ;;
*) usage ;;
esac
