#!/usr/bin/env bash
# Installs what the C SDK example (sdk/c, examples/c-policy) needs: Debian's
# clang, which targets wasm32 out of the box, and lld, whose wasm-ld links
# freestanding wasm32 modules. No wasi-libc: the C SDK is freestanding.
set -euo pipefail
# shellcheck source=ensure-apt.sh
. "$(dirname "$0")/ensure-apt.sh"
if ! command -v clang >/dev/null 2>&1 || ! command -v wasm-ld >/dev/null 2>&1; then
	echo "installing clang and lld (wasm-ld) with apt-get" >&2
	apt_install clang lld
fi
