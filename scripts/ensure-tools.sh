#!/usr/bin/env bash
# Installs what `make` needs beyond Go: wat2wasm (Debian package wabt) for the
# WebAssembly-text plugins and test fixtures, and staticcheck.
set -euo pipefail
if ! command -v wat2wasm >/dev/null 2>&1; then
	sudo=""
	[ "$(id -u)" -eq 0 ] || sudo="sudo"
	echo "installing wabt (wat2wasm) with apt-get" >&2
	$sudo apt-get update -qq
	DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq wabt >/dev/null
fi
gobin=$(go env GOPATH)/bin
if [ ! -x "$gobin/staticcheck" ]; then
	echo "installing staticcheck with go install" >&2
	go install honnef.co/go/tools/cmd/staticcheck@v0.8.2
fi
