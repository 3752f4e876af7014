#!/usr/bin/env bash
# Sourced by the scripts/ensure-*.sh scripts: apt_get runs apt-get (with
# sudo when not root) waiting up to 10 minutes for the dpkg and package
# list locks, which another apt-get (unattended-upgrades, a second make
# test) holds for a while, instead of failing at once; DEBIAN_FRONTEND is
# noninteractive. apt_install PKG... installs them without the
# recommended packages, after one apt-get update (whose failure, with
# stale lists, is not fatal by itself).
apt_get() {
	local sudo=""
	[ "$(id -u)" -eq 0 ] || sudo="sudo"
	DEBIAN_FRONTEND=noninteractive $sudo apt-get -o DPkg::Lock::Timeout=600 -o Acquire::Retries=3 "$@"
}

apt_updated=""
apt_install() {
	if [ -z "$apt_updated" ]; then
		apt_get update -qq || echo "apt-get update failed; installing from the lists there are" >&2
		apt_updated=1
	fi
	apt_get install -y -qq --no-install-recommends "$@" >/dev/null
}
