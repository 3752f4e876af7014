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

# run_suite [--skip-uninstallable] N CMD...: up on a fresh directory, CMD
# with KVHOST_CLUSTER_MOUNTS set, down whatever happens; CMD's exit status.
run_suite() {
	local skip=false
	if [ "${1:-}" = --skip-uninstallable ]; then
		skip=true
		shift
	fi
	local n=${1:-}
	[[ "$n" =~ ^[1-9][0-9]*$ ]] && [ $# -ge 2 ] || usage
	shift
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
	local mounts
	RUN_DIR=$(mktemp -d "/tmp/$RUN_PREFIX-XXXXXX")
	trap '"$0" down "$RUN_DIR"' EXIT
	trap 'exit 130' INT TERM
	mounts=$("$0" up "$RUN_DIR" "$n") || return 1
	KVHOST_CLUSTER_MOUNTS=$mounts "$@" || rc=$?
	return "$rc"
}
