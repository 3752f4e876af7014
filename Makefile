# kvhost build. `make run` builds and runs the daemon with its embedded
# defaults; `make install` installs it (PREFIX, DESTDIR); `make test` is
# what CI runs.

GO        ?= go
GOBIN     := $(shell $(GO) env GOPATH)/bin
WASM_GO   := GOOS=wasip1 GOARCH=wasm $(GO) build -trimpath -buildmode=c-shared

# Built-in policies: every plugins/NAME/wasm main package becomes
# plugins/wasm/NAME.wasm, which the kvhost binary embeds. The modules are
# committed, so that `go build ./cmd/kvhost` and `go install` give the
# same binary as `make build`; after changing a plugin (or Go), run
# `make plugins` and commit plugins/wasm/*.wasm (TestCommittedModulesMatchSources
# in ./plugins fails while a committed module differs from its source's build).
PLUGINS     := $(patsubst plugins/%/wasm/,%,$(dir $(wildcard plugins/*/wasm/main.go)))
PLUGIN_WASM := $(PLUGINS:%=plugins/wasm/%.wasm)
# WebAssembly-text modules: test fixtures and the vendor examples.
WAT_WASM    := $(patsubst %.wat,%.wasm,$(shell find host examples -name '*.wat' 2>/dev/null))
# Go vendor examples: every examples/NAME/main.go becomes examples/NAME/policy.wasm.
GO_EXAMPLE_WASM := $(patsubst %/main.go,%/policy.wasm,$(wildcard examples/*/main.go))

.PHONY: all build run test vet lint fuzz wasm plugins tools clean gpu-bins FORCE

all: build

tools:
	@scripts/ensure-tools.sh

# The test fixtures and examples; the built-in plugins are `make plugins`,
# which `make test` does not run, so that the test above sees what is
# committed.
wasm: $(WAT_WASM) $(GO_EXAMPLE_WASM) c-example

plugins: $(PLUGIN_WASM)

# go build is incremental, so always asking it is cheap and never stale.
plugins/wasm/%.wasm: FORCE
	$(WASM_GO) -o $@ ./plugins/$*/wasm

$(GO_EXAMPLE_WASM): %/policy.wasm: FORCE
	$(WASM_GO) -o $@ ./$*

%.wasm: %.wat | tools
	wat2wasm $< -o $@

# The C SDK example (sdk/c, examples/c-policy): freestanding wasm32, no libc,
# built with Debian's clang and lld (scripts/ensure-clang.sh installs them).
.PHONY: c-example
c-example: sdk/c/kvhost_policy.h examples/c-policy/policy.c
	@scripts/ensure-clang.sh
	clang --target=wasm32 -O2 -nostdlib -ffreestanding -mbulk-memory -Wall -Wextra -Werror \
		-Isdk/c -Wl,--no-entry -o examples/c-policy/policy.wasm examples/c-policy/policy.c

# A minimal S3 endpoint over a directory (internal/s3local), to carry to
# machines where no object store can be installed: static, no cgo; not
# part of build or run.
bin/s3local: FORCE
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags='-s -w' -o $@ ./cmd/s3local

# The daemon embeds the committed built-in policies, as `go build` does;
# build leaves the tree as it was. The WebAssembly-text fixtures and
# examples are for the tests.
VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo devel)
build:
	@test -x bin/kvhost || echo "building bin/kvhost with $$($(GO) env GOVERSION) (the first build downloads the Go modules and compiles them: a few minutes, each package named as it compiles; later builds take seconds)"
	$(GO) build $(if $(wildcard bin/kvhost),,-v) -ldflags "-X main.version=$(VERSION)" -o bin/kvhost ./cmd/kvhost
	@test -n "$$($(GO) env CGO_ENABLED | grep 1)" || echo "note: cgo is off (no C compiler?): this kvhost cannot load CUDA and serves host memory only"

run: build
	./bin/kvhost

# make install [PREFIX=/usr/local] [DESTDIR=]: the binary to
# $(PREFIX)/bin/kvhost; the built-in policies (which the binary embeds:
# `kvhost --policy lru` or `--policy lru.wasm`) as files to start a
# plugin of one's own from, to $(PREFIX)/share/kvhost/plugins; the
# systemd unit's documentation (Documentation=) and the example
# configurations to $(PREFIX)/share/doc/kvhost. DESTDIR stages it all
# under another root, for a package. `make install PREFIX=$$HOME/.local`
# needs no root.
PREFIX     ?= /usr/local
BINDIR     := $(PREFIX)/bin
PLUGINDIR  := $(PREFIX)/share/kvhost/plugins
DOCDIR     := $(PREFIX)/share/doc/kvhost
INSTALL    ?= install
INSTALL_DOCS := docs/serve.md docs/config.md deploy/systemd/kvhost.service deploy/systemd/kvhost.toml
.PHONY: install uninstall install-check
install: build
	$(INSTALL) -d $(DESTDIR)$(BINDIR) $(DESTDIR)$(PLUGINDIR) $(DESTDIR)$(DOCDIR)
	$(INSTALL) -m 0755 bin/kvhost $(DESTDIR)$(BINDIR)/kvhost
	$(INSTALL) -m 0644 $(PLUGIN_WASM) $(DESTDIR)$(PLUGINDIR)/
	$(INSTALL) -m 0644 $(INSTALL_DOCS) $(DESTDIR)$(DOCDIR)/
	@echo "installed $(DESTDIR)$(BINDIR)/kvhost, the built-in policies in $(DESTDIR)$(PLUGINDIR), docs in $(DESTDIR)$(DOCDIR)"

uninstall:
	rm -f $(DESTDIR)$(BINDIR)/kvhost $(addprefix $(DESTDIR)$(PLUGINDIR)/,$(notdir $(PLUGIN_WASM))) $(addprefix $(DESTDIR)$(DOCDIR)/,$(notdir $(INSTALL_DOCS)))
	-rmdir $(DESTDIR)$(PLUGINDIR) $(DESTDIR)$(PREFIX)/share/kvhost $(DESTDIR)$(DOCDIR) 2>/dev/null

# install-check: install under a temporary DESTDIR and, from another
# directory, run what the README says: the binary, its version, and
# `kvhost config check` of --policy lru.wasm (the embedded lru) and of a
# file that is not wasm (refused, exit 1).
install-check: build
	@d=$$(mktemp -d) && trap 'rm -rf "$$d"' EXIT && \
	$(MAKE) --no-print-directory install DESTDIR=$$d PREFIX=/usr >/dev/null && \
	for f in usr/bin/kvhost $(addprefix usr/share/kvhost/plugins/,$(notdir $(PLUGIN_WASM))) usr/share/doc/kvhost/serve.md; do \
		test -f "$$d/$$f" || { echo "install-check: $$f not installed" >&2; exit 1; }; done && \
	cd "$$d" && ./usr/bin/kvhost version >/dev/null && \
	printf '[policy]\nname = "lru.wasm"\n' > lru.toml && ./usr/bin/kvhost config check lru.toml && \
	echo notwasm > notwasm.wasm && printf '[policy]\nname = "notwasm.wasm"\n' > bad.toml && \
	{ ./usr/bin/kvhost config check bad.toml; test $$? -eq 1; } && echo "install-check: ok"

# The summary tables of docs/performance.md and the README's headlines,
# one per machine, regenerated from the raw files in docs/bench as
# docs/bench/summary.toml (the H100 machine) and summary-h200.toml select
# them (the tests of internal/perfsummary fail where they differ).
.PHONY: perf-summary
perf-summary:
	$(GO) run ./internal/perfsummary

vet: wasm
	$(GO) vet ./...
	$(GO) vet -tags invariants ./...
	GOOS=wasip1 GOARCH=wasm $(GO) vet ./abi/... ./plugins/...

lint: tools vet
	$(GOBIN)/staticcheck ./...
	$(GOBIN)/staticcheck -tags invariants ./...
	scripts/check-subjects.sh

# Bounded fuzzing of the decoders that face untrusted input: PKG:FuzzFunc.
FUZZ_TARGETS ?= ./abi:FuzzCheckPath ./internal/format:FuzzDecodeHeader ./internal/format:FuzzDecodeSealedHeader ./protocol:FuzzDecode ./internal/server:FuzzSession ./host/policy:FuzzOutputValidation ./host/policy/internal/meter:FuzzInstrument
FUZZTIME     ?= 10s
fuzz: wasm
	@for t in $(FUZZ_TARGETS); do \
		pkg=$${t%%:*}; fn=$${t##*:}; \
		echo "fuzz $$pkg $$fn for $(FUZZTIME)"; \
		out=$$($(GO) test -run '^$$' -fuzz "^$$fn\$$" -fuzztime $(FUZZTIME) $$pkg 2>&1); rc=$$?; echo "$$out"; \
		if [ $$rc -ne 0 ]; then \
			if echo "$$out" | grep -q 'context deadline exceeded' && ! echo "$$out" | grep -q 'Failing input written'; then \
				echo "fuzz $$pkg $$fn: the fuzzer's coordinator timed out stopping its workers (a loaded machine), no failing input; running it again"; \
				$(GO) test -run '^$$' -fuzz "^$$fn\$$" -fuzztime $(FUZZTIME) $$pkg || exit 1; \
			else exit 1; fi; \
		fi; \
	done

# KVHOST_REQUIRE_FAKES: the tests of the CUDA and cuFile loading paths
# fail, rather than skip, where their fake libraries cannot be built.
# -timeout 30m: go test's 10 minutes per package is a hang guard, and a
# loaded 2-core machine runs the race-detector tests several times slower
# (cmd/kvhost: 156 s alone, 263 s beside three busy loops); its waits for
# a daemon are hang guards of 5 minutes, which must end inside it.
# -p 4: twice the packages at a time as CI's two cores; many tests wait
# on daemons and sockets, and the overlap took the race suite from 593 s
# to 528 s there (RATIONALE.md, "Why does make test run four test
# packages, and the Python tests, at a time on two cores?").
#
# KVHOST_TEST_WASM_CACHE (internal/testwasm): the built-in plugins are
# compiled once for the run, without the race detector, into one
# directory the race tests then read: a plugin compiled under the race
# detector took 20-35 s on 2 cores, in several packages. `config show`
# compiles them as the daemon's start does (cmd/kvhost's tests), the
# conformance suite as its tests do (wazero files the two apart: a test
# binary of a package that is not main has no version of wazero to name
# its entries by). The directory is emptied first, so that a run does not
# rest on an earlier one's files.
#
# -trimpath (GOFLAGS, for all `make test` compiles, vets and lints):
# without it Go keys a package's compiled, vetted and staticchecked
# results by the checkout's absolute path, so each fresh checkout or
# worktree did all of them again for every package of the module
# (`go vet ./...` 22 s against 1 s, staticcheck 33 s against 1 s).
#
# test-cluster-bounded and test-objects run side by side: each starts a
# Ceph cluster of its own on a fresh directory and free ports (the
# scripts pick them under one lock, so that two may run at once).
TEST_WASM_ROOT  := $(CURDIR)/.cache/test-wasm
TEST_WASM_CACHE := $(TEST_WASM_ROOT)/kvhost/check-wasm-cache
test: export GOFLAGS := $(strip $(GOFLAGS) -trimpath)
test: tools build wasm lint
	rm -rf $(TEST_WASM_ROOT)
	@for p in $(PLUGINS); do \
		XDG_CACHE_HOME=$(TEST_WASM_ROOT) bin/kvhost config show --policy $$p >/dev/null || exit 1; \
	done
	KVHOST_TEST_WASM_CACHE=$(TEST_WASM_CACHE) $(GO) test -count=1 -run '^TestBuiltinsPass$$' ./host/policy/conformance
	$(MAKE) --no-print-directory -j4 --output-sync=target test-race test-python-scripts test-python-units test-norace
	$(MAKE) --no-print-directory -j2 --output-sync=target test-cluster-bounded test-objects
	$(MAKE) --no-print-directory fuzz

# The race suite, as `make test` runs it (after compiling the plugins
# into TEST_WASM_CACHE), beside the Python tests and test-norace: those wait on their
# daemons most of the time, and the race suite's longest package
# (cmd/kvhost) sets its end. --output-sync prints each one's output
# whole when it ends. Run alone on a fresh checkout, it first builds the
# wasm modules its tests load (any one missing); under `make test`, which
# built them already, its parallel step does not build them again.
.PHONY: test-race test-norace
# wazero's own code is compiled without the race detector's
# instrumentation (kvhost's code, which calls it, keeps it): every policy
# a test opens is decoded and validated by wazero, which ran 1.7 times
# slower instrumented (cmd/kvhost's policy, config check and bench tests:
# 59 s against 35). RATIONALE.md says why.
NORACE_DEPS := github.com/tetratelabs/wazero/...=-race=false
TEST_WASM_FILES := $(WAT_WASM) $(GO_EXAMPLE_WASM) examples/c-policy/policy.wasm
test-race: $(if $(filter-out $(wildcard $(TEST_WASM_FILES)),$(TEST_WASM_FILES)),wasm)
	KVHOST_CLUSTER_MOUNTS= KVHOST_TEST_WASM_CACHE=$(TEST_WASM_CACHE) KVHOST_REQUIRE_FAKES=1 $(GO) test -race -gcflags='$(NORACE_DEPS)' -tags invariants -count=1 -p 4 -timeout 30m -skip '^($(NORACE_TESTS))$$' ./...

# The long tests of one goroutine's computation, which test-race skips
# and test-norace runs without the race detector: it made them 5-7 times
# slower (TestClusterCutoff... 117 s of CPU against 19; the policy
# host's fuel, metering and conformance runs, where wazero compiles
# under it) with nothing to find in them, and the concurrent paths they
# pass through (a module's load, its shards) are raced by their
# packages' other tests. norace_test.go holds each name to a test
# function of NORACE_PKGS and of no other package (test-race's -skip
# applies to every package).
NORACE_TESTS := TestClusterCutoffHitRateIsWithinFivePercentOfOneGlobalLRU|TestRankScaleHoldsWithTheParameters|TestLFUAgingOverManyEntriesStaysWithinItsFuel|TestALateHitOfARemovedEntryIsNoFailure|TestMeteredLRUMatchesNative|TestInstrumentFixtures|TestConformance
NORACE_PKGS  := ./internal/clustercap ./host/policy ./host/policy/conformance ./host/policy/internal/meter ./examples/go-policy ./examples/wat-policy ./examples/c-policy
test-norace: $(if $(filter-out $(wildcard $(TEST_WASM_FILES)),$(TEST_WASM_FILES)),wasm)
	KVHOST_TEST_WASM_CACHE=$(TEST_WASM_CACHE) $(GO) test -tags invariants -count=1 -timeout 30m -run '^($(NORACE_TESTS))$$' $(NORACE_PKGS)

# The long reliability suite (docs/reliability.md): at least 100 SIGKILLs and
# 100,000 acknowledged keys, minutes of shared-directory workload. The ext4
# and tmpfs scenarios need root; without it they say so and skip.
# RELIABILITY_RUN picks scenarios (a go test -run pattern).
RELIABILITY_RUN     ?= .
RELIABILITY_TIMEOUT ?= 90m
.PHONY: reliability-long
reliability-long:
	$(GO) test -count=1 -v -timeout $(RELIABILITY_TIMEOUT) -run '$(RELIABILITY_RUN)' ./internal/reliability -long

# The multi-node suite (docs/cluster.md): a one-host CephFS cluster under
# CLUSTER_DIR (scripts/cephfs.sh, which installs Ceph's Debian packages if
# missing; needs root and /dev/fuse), mounted three times, one kvhost daemon
# on each mount; torn down afterwards, whatever the result. CLUSTER_FS =
# glusterfs runs it on a one-host GlusterFS volume instead
# (scripts/glusterfs.sh, its client caches off).
CLUSTER_FS  ?= cephfs
CLUSTER_DIR ?= /tmp/kvhost-$(CLUSTER_FS)
CLUSTER_RUN ?= TestCluster
.PHONY: test-cluster
# `run --dir` takes down what an earlier run left in CLUSTER_DIR first,
# and tears down on INT, TERM and HUP too.
test-cluster:
	@scripts/$(CLUSTER_FS).sh run --dir $(CLUSTER_DIR) 3 \
		$(GO) test -race -count=1 -v -timeout 20m -run '$(CLUSTER_RUN)' ./internal/reliability

# The bounded part of the multi-node suite, run by `make test`: two
# ceph-fuse clients of a one-host CephFS on a fresh directory and its own
# monitor ports (the first free pair from CLUSTER_BOUNDED_PORTS, v1 and
# v2, so that a `make test-cluster` cluster, or another `make test`'s, may
# run beside it); the cross-node hit, a pinned
# key loading after its node deleted the file, flock
# sharing between clients and the shared-directory mixed workload (43 s
# with the cluster's start and stop on 2 cores); then, on the same
# cluster, two daemons' removal streams reaching the vLLM halves that
# announced the keys (cluster evictions, another node's purge; about
# 10 s). scripts/cephfs.sh
# installs Ceph's Debian packages when missing; only where they cannot be
# installed (no apt-get, apt-get failing, not root) does it print a
# SKIPPED banner and pass. Any other failure fails.
CLUSTER_BOUNDED_RUN   ?= TestClusterKeyStoredOnOneNodeHitsAndLoadsOnTheOthers|TestClusterPinnedKeyLoadsAfterItsNodeDeletesTheFile|TestClusterFlockSharingMatchesTheFUSETable|TestClusterSharedMixedWorkload
CLUSTER_BOUNDED_PORTS ?= 6791 3302
.PHONY: test-cluster-bounded
test-cluster-bounded: build
	@set -- $(CLUSTER_BOUNDED_PORTS); CEPHFS_MON_PORT=$$1 CEPHFS_MON_PORT2=$$2 \
	scripts/cephfs.sh run --skip-uninstallable 2 sh -c '\
		$(GO) test -race -count=1 -v -timeout 5m -run "$(CLUSTER_BOUNDED_RUN)" ./internal/reliability && \
		cd client/python && KVHOST_BIN=$(CURDIR)/bin/kvhost PYTHONPATH=src:tests \
		/usr/bin/python3 -m unittest -v test_vllm_removals.TestSharedClusterMount'

# The object mount's tests (docs/object.md) against a one-host Ceph RGW
# (scripts/rgw.sh, which installs Ceph's Debian packages if missing; needs
# root): engines, and two daemons, sharing one bucket and no directory;
# faults; the benchmark once. Torn down afterwards, whatever the result.
.PHONY: test-objects
test-objects:
	scripts/rgw.sh run --skip-uninstallable sh -c '\
		$(GO) test -race -count=1 -v -timeout 10m -bench . -benchtime 1x ./internal/objstore && \
		$(GO) test -race -count=1 -v -timeout 5m -run "^TestObjects" ./internal/reliability'

# test-objects against bin/s3local (scripts/s3local.sh), where no RGW can
# run: all but objstore's fault tests, which need RGW's controls (they
# skip). Not part of test.
.PHONY: test-objects-local
test-objects-local: bin/s3local
	scripts/s3local.sh run sh -c '\
		$(GO) test -race -count=1 -v -timeout 10m -bench . -benchtime 1x ./internal/objstore && \
		$(GO) test -race -count=1 -v -timeout 5m -run "^TestObjects" ./internal/reliability'

# Container images (deploy/docker): the daemon's, which deploy/kubernetes
# runs as kvhost:dev, and vLLM's with kvhost's client. IMAGE=NAME:TAG
# tags it for a registry (then docker push NAME:TAG, and name it in the
# manifests). The context is the repository (.dockerignore keeps caches,
# build outputs and history out).
IMAGE      ?= kvhost:dev
VLLM_KVHOST_IMAGE ?= vllm-kvhost:dev
.PHONY: image image-vllm
image:
	docker build -f deploy/docker/Dockerfile --build-arg VERSION=$(VERSION) -t $(IMAGE) .

image-vllm:
	docker build -f deploy/docker/vllm.Dockerfile -t $(VLLM_KVHOST_IMAGE) .

# GPU check and benchmark binaries for a GPU machine without Go
# (scripts/gpu-check.sh runs them there): stripped, and packed into
# gpu-bins.tar.xz to copy over.
GPU_BINS := gpu-bins
gpu-bins: build
	mkdir -p $(GPU_BINS)
	cp bin/kvhost $(GPU_BINS)/kvhost
	$(GO) test -c -tags gpu -ldflags '-s -w' -o $(GPU_BINS)/gds-gpu.test ./gds
	$(GO) test -c -ldflags '-s -w' -o $(GPU_BINS)/staging-gpu.test ./staging/gpu
	$(GO) test -c -ldflags '-s -w' -o $(GPU_BINS)/server-gpu.test ./internal/server
	tar -C $(GPU_BINS) -cJf $(GPU_BINS).tar.xz .

# The committed plugins/wasm/*.wasm stay (make plugins rebuilds them).
clean:
	rm -rf bin $(WAT_WASM) $(GO_EXAMPLE_WASM) examples/c-policy/policy.wasm

# The client's C lookup probe (kvhost._lookup), built in place in
# client/python/src for /usr/bin/python3; the client falls back to Python
# where it is not built, so only the tests ask for it.
.PHONY: python-ext
python-ext:
	@scripts/ensure-python.sh
	cd client/python && /usr/bin/python3 setup.py -q build_ext --inplace

# Python client tests (client/python/tests) with Debian's python3, numpy and,
# when installable, CPU torch; they build and start a real daemon.
# KVHOST_EXPECT_NATIVE: the C probe's tests fail, rather than skip, where
# python-ext did not build it.
#
# Two processes side by side, as `make test` runs them beside the race
# suite: the script tests (tests/test_*_script.py, each running a script
# that imports torch and starts a daemon) and the rest.
PY_TESTS        := $(sort $(basename $(notdir $(wildcard client/python/tests/test_*.py))))
PY_SCRIPT_TESTS := $(filter %_script,$(PY_TESTS))
PY_UNIT_TESTS   := $(filter-out %_script,$(PY_TESTS))
PY_UNITTEST     := KVHOST_EXPECT_NATIVE=1 PYTHONPATH=src:tests /usr/bin/python3 -m unittest -v
.PHONY: test-python test-python-scripts test-python-units
test-python: test-python-scripts test-python-units
test-python-scripts: python-ext
	cd client/python && $(PY_UNITTEST) $(PY_SCRIPT_TESTS)
test-python-units: python-ext
	cd client/python && $(PY_UNITTEST) $(PY_UNIT_TESTS)

# The vLLM integration tests (client/python/tests/test_vllm*.py) against
# vLLM's own offloading and connector code (MultiConnector,
# OffloadingConnector's scheduler and worker halves) from a source tree:
# VLLM_SRC is the directory that contains the vllm package
# (tests/vllm_tree.py says what is shimmed). vllm-test-deps installs the
# Debian packages vLLM's modules import (python3-pydantic, python3-cbor2,
# python3-prometheus-client, python3-regex; scripts/ensure-python.sh
# --vllm); `make test` does not need them, since without a tree those
# tests skip.
.PHONY: test-vllm vllm-test-deps
vllm-test-deps:
	@scripts/ensure-python.sh --vllm

test-vllm: vllm-test-deps
	@test -n "$(VLLM_SRC)" || { echo "test-vllm: set VLLM_SRC=DIR, the directory that contains the vllm package (make test-vllm VLLM_SRC=DIR)" >&2; exit 2; }
	@test -f "$(VLLM_SRC)/vllm/__init__.py" || { echo "test-vllm: $(VLLM_SRC)/vllm/__init__.py not found; VLLM_SRC must contain the vllm package" >&2; exit 2; }
	@$(MAKE) --no-print-directory build python-ext
	cd client/python && KVHOST_BIN=$(CURDIR)/bin/kvhost KVHOST_VLLM_SRC=$(abspath $(VLLM_SRC)) PYTHONPATH=src:tests /usr/bin/python3 -m unittest discover -s tests -p 'test_vllm*.py' -v
