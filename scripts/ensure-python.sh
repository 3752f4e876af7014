#!/usr/bin/env bash
# Installs what the Python tests (client/python/tests) need on a Debian
# machine, for /usr/bin/python3: numpy (required), CPU torch (optional:
# the torch tests skip with a message naming the package when it cannot be
# installed), venv, pip, setuptools and wheel for the offline-install
# test, and Python's headers for the C lookup probe. With --vllm (make
# vllm-test-deps, run by make test-vllm) also what vLLM's modules import:
# pydantic (vLLM's KVTransferConfig), cbor2 (vllm.utils.hashing),
# prometheus_client and regex; those are required there, so a failed
# install fails. Also with --vllm: pyzmq and msgpack, for vLLM's KV-event
# publisher (ZmqEventPublisher) and a router's decoding of its messages
# (tests/test_vllm_real_events.py; msgspec, which vLLM's kv_events module
# imports, has no Debian package: that test shims it over msgpack).
# apt-get waits for the dpkg lock (ensure-apt.sh).
# Idempotent: asks apt only for what is missing.
set -euo pipefail
py=${PYTHON:-/usr/bin/python3}
missing=()
required=(python3-numpy python3-dev)
if [ "${1:-}" = --vllm ]; then
	"$py" -c 'import pydantic' >/dev/null 2>&1 || missing+=(python3-pydantic)
	"$py" -c 'import cbor2' >/dev/null 2>&1 || missing+=(python3-cbor2)
	# vLLM's connector metrics, and vLLM's modules import regex in place of re.
	"$py" -c 'import prometheus_client' >/dev/null 2>&1 || missing+=(python3-prometheus-client)
	"$py" -c 'import regex' >/dev/null 2>&1 || missing+=(python3-regex)
	# vLLM's KV-event publisher and a router's decoding of its batches.
	"$py" -c 'import zmq' >/dev/null 2>&1 || missing+=(python3-zmq)
	"$py" -c 'import msgpack' >/dev/null 2>&1 || missing+=(python3-msgpack)
	required+=(python3-pydantic python3-cbor2 python3-prometheus-client python3-regex python3-zmq python3-msgpack)
fi
"$py" -c 'import numpy' >/dev/null 2>&1 || missing+=(python3-numpy)
"$py" -c 'import torch' >/dev/null 2>&1 || missing+=(python3-torch)
# The offline-install test builds the client in a fresh venv with pip and
# setuptools from the system (no package index).
"$py" -c 'import ensurepip' >/dev/null 2>&1 || missing+=(python3-venv)
"$py" -c 'import setuptools, wheel' >/dev/null 2>&1 || missing+=(python3-setuptools python3-wheel)
# Python's headers, to build the client's C lookup probe (make python-ext).
"$py" -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
	>/dev/null 2>&1 || missing+=(python3-dev)
"$py" -m pip --version >/dev/null 2>&1 || missing+=(python3-pip)
[ ${#missing[@]} -eq 0 ] && exit 0
if ! command -v apt-get >/dev/null 2>&1; then
	echo "ensure-python: no apt-get; install ${missing[*]} for $py yourself" >&2
	for pkg in "${missing[@]}"; do
		[[ " ${required[*]} " == *" $pkg "* ]] && exit 1
	done
	exit 0
fi
# shellcheck source=ensure-apt.sh
. "$(dirname "$0")/ensure-apt.sh"
echo "ensure-python: installing ${missing[*]} with apt-get" >&2
for pkg in "${missing[@]}"; do
	if ! apt_install "$pkg"; then
		if [[ " ${required[*]} " == *" $pkg "* ]]; then
			echo "ensure-python: cannot install $pkg (required by the tests)" >&2
			exit 1
		fi
		echo "ensure-python: cannot install $pkg; the tests that need it will skip" >&2
	fi
done
