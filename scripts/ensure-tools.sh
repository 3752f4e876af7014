#!/usr/bin/env bash
# Installs what `make` needs beyond Go: wat2wasm (Debian package wabt) for the
# WebAssembly-text plugins and test fixtures, and staticcheck.
set -euo pipefail
# shellcheck source=ensure-apt.sh
. "$(dirname "$0")/ensure-apt.sh"
if ! command -v wat2wasm >/dev/null 2>&1; then
	echo "installing wabt (wat2wasm) with apt-get" >&2
	apt_install wabt
fi
gobin=$(go env GOPATH)/bin
if [ ! -x "$gobin/staticcheck" ]; then
	echo "installing staticcheck with go install" >&2
	go install honnef.co/go/tools/cmd/staticcheck@v0.8.2
fi
