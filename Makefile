# make demo   the main job locally: control plane, CAPI CRDs, the examples, this provider and the real
#             cluster-autoscaler, through a scale-up from zero and back down, with a timeline
# make test   everything CI runs: format check, clippy, all tests
# make bench  this provider against the in-tree provider and a floor on fleets of up to 100,000
#             Machines (CONTRIBUTING.md: Benchmarks); not part of `make test`
# make image  the container image without a Docker engine, into target/image/ (README: Get the image)
# make fuzz   every fuzz target (cargo-fuzz, fuzz/) for FUZZ_SECONDS each; make fuzz-smoke: CI's short run
# make load   64 clients x 100,000 read RPCs against the release binary serving 5,000 Machines
SHELL := bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := test

CARGO ?= cargo
# One clean build per run: incremental state would double the target directory (CI runs on a fresh
# clone, where it never pays back).
CARGO_INCREMENTAL ?= 0
export CARGO_INCREMENTAL
TEST_LOG ?= target/test-output.log

.PHONY: test fmt-check clippy upstream unit demo image bench fuzz fuzz-smoke load

test: fmt-check clippy upstream
	@mkdir -p $(dir $(TEST_LOG))
	@start=$$(date +%s); status=0; \
	$(CARGO) test --no-fail-fast 2>&1 | tee $(TEST_LOG) || status=$$?; \
	$(CARGO) test --profile model --test protocol_model -- --ignored --nocapture 2>&1 \
	  | tee -a $(TEST_LOG) || status=$$?; \
	echo; echo "== cargo test summary ($$(( $$(date +%s) - start ))s)"; \
	grep -E '^\s+Running |^test result:|^e2e: (control plane|CAPI manager|scenario .* passed|matrix )|^protocol model: |^test .* FAILED$$|^error: ' $(TEST_LOG) || true; \
	exit $$status

fmt-check:
	$(CARGO) fmt --all -- --check
	$(CARGO) fmt --manifest-path fuzz/Cargo.toml --all -- --check

# The fuzz targets (a crate of their own) too: a change of a parser's signature breaks them, and only CI's fuzz
# run would say so. Their libFuzzer is C++: skipped, and said, without a C++ compiler.
clippy:
	$(CARGO) clippy --all-targets -- -D warnings
	@if command -v c++ >/dev/null 2>&1; then \
	  $(CARGO) clippy --manifest-path fuzz/Cargo.toml --bins -- -D warnings; \
	else echo "clippy: fuzz targets skipped: no C++ compiler for libFuzzer"; fi

# Builds (or finds in the cache) etcd, kube-apiserver, kube-scheduler and the Cluster API CRDs, then
# kube-controller-manager, then kube-apiserver and kube-scheduler of every Kubernetes release pinned in
# tests/upstream/k8s (v1.33, v1.37: the management-cluster matrix), then each pinned real Cluster API core
# manager with its 13 CRDs: tests/upstream/capi (v1.14.2, a Go module of its own) and every subdirectory
# there with a go.mod (v1.13: v1.13.6), then promtool (tests/upstream/promtool: the alerts' unit tests,
# tests/monitoring.rs); prints the cache dirs.
upstream:
	@start=$$(date +%s); bash tests/upstream/build.sh; nice bash tests/upstream/build.sh kube-controller-manager; \
	for pin in tests/upstream/k8s/*/go.mod; do \
	  nice bash tests/upstream/build.sh "$$(basename "$$(dirname "$$pin")")"; done; \
	nice bash tests/upstream/capi/build.sh; \
	for pin in tests/upstream/capi/*/go.mod; do \
	  nice bash tests/upstream/capi/build.sh "$$(basename "$$(dirname "$$pin")")"; done; \
	nice bash tests/upstream/promtool/build.sh; \
	echo "upstream: ok after $$(( $$(date +%s) - start ))s" >&2

# Unit tests only: no control plane.
unit:
	$(CARGO) test --lib --bins

# Runs the real cluster-autoscaler (the default version of tests/upstream/cluster-autoscaler.versions,
# found by tests/upstream/artifact.sh: env CLUSTER_AUTOSCALER, a local mirror or the official image) against
# this provider; the demo finds the provider binary in target/debug. It builds only what it runs, side by
# side (tests/upstream/demo-build.sh); `make upstream` builds the rest the tests need.
demo:
	@CARGO="$(CARGO)" bash tests/upstream/demo-build.sh
	$(CARGO) run --example demo

# The image without a Docker engine, for linux/amd64 and linux/arm64 (IMAGE_PLATFORMS): static release
# binaries (glibc linked statically; a foreign architecture cross-compiled, see tools/image/build.sh for
# what it needs), then tools/image (go-containerregistry, pinned in tools/image/go.sum) applies the
# Dockerfile's final stage to each: an OCI layout with one image index, and a `docker load` tarball of
# this machine's platform, in IMAGE_DIR.
IMAGE_PLATFORMS ?= linux/amd64 linux/arm64
IMAGE_DIR ?= target/image
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -n1)
IMAGE_TAG ?= capi-autoscaler-provider:$(VERSION)

image:
	IMAGE_PLATFORMS="$(IMAGE_PLATFORMS)" IMAGE_DIR="$(IMAGE_DIR)" VERSION="$(VERSION)" \
	  IMAGE_TAG="$(IMAGE_TAG)" CARGO="$(CARGO)" bash tools/image/build.sh

# The fleet benchmark (benches/fleet): the control plane of the tests, this provider's release build,
# upstream's example externalgrpc server (W) and CA with the in-tree provider (A), found by
# tests/upstream/artifact.sh.
# Prints the table and writes target/bench/fleet.{md,json}. BENCH_SIZES=1000/100 for one size; the other
# BENCH_* knobs are listed in benches/fleet/main.rs.
bench: upstream
	$(CARGO) bench --bench fleet

# Fuzzing (fuzz/, CONTRIBUTING.md: Fuzzing): builds every target with cargo-fuzz (no sanitizer: works on a stable
# toolchain), runs each for FUZZ_SECONDS (or the ones named in FUZZ_TARGETS), prints executions per target,
# fails on a crash (the input is kept in fuzz/artifacts/<target>/). Needs `cargo install cargo-fuzz`.
FUZZ_SECONDS ?= 120
FUZZ_SMOKE_SECONDS ?= 12
FUZZ_TARGETS ?=

fuzz:
	bash fuzz/run.sh $(FUZZ_SECONDS) $(FUZZ_TARGETS)

fuzz-smoke:
	bash fuzz/run.sh $(FUZZ_SMOKE_SECONDS) $(FUZZ_TARGETS)

# Load (benches/load.rs, CONTRIBUTING.md: Benchmarks): the release binary against the test control plane; prints
# errors, throughput, latency and the provider's memory during the run. LOAD_* variables resize it.
load: upstream
	$(CARGO) bench --bench load
