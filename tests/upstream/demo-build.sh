#!/usr/bin/env bash
# What `make demo` builds before the demo starts: only what it runs, the independent builds side by side.
#   control-plane       etcd, kube-apiserver, kube-scheduler and the CRDs: build.sh
#   capi-manager        the Cluster API core manager of the default release: capi/build.sh
#   provider            this provider and the demo: cargo build --bin capi-autoscaler-provider --example demo
#   cluster-autoscaler  the default pinned release: artifact.sh cluster-autoscaler
# The two Go builds run one after the other (side by side they would compile the packages they share
# twice: the Cluster API manager is pinned to the same Kubernetes client libraries); the other steps
# beside them, the cargo build at a lower priority (the Go builds are the longer path). Not built: what
# only `make test` needs (kube-controller-manager, the other Kubernetes and Cluster API releases,
# promtool: `make upstream`).
# One line per step when it starts, with the time it took on the 2-core development machine from empty
# caches, and one when it ends; each step's output goes to $DEMO_BUILD_LOGS/<step>.log (default
# target/demo-build/), whose end is printed when the step fails. What is built already is found in seconds
# (the scripts' caches, cargo's target/).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
LOGS=${DEMO_BUILD_LOGS:-${CARGO_TARGET_DIR:-$REPO/target}/demo-build}
CARGO=${CARGO:-cargo}
mkdir -p "$LOGS"
t0=$SECONDS

# step NAME EXPECTED COMMAND...: runs COMMAND in the repository, its output in $LOGS/NAME.log, between a
# line that says what it is and one with how long it took.
step() {
  local name=$1 expected=$2 status=0
  shift 2
  local log=$LOGS/$name.log
  echo "demo build: $name: started (from empty caches about $expected; seconds once built); log $log"
  (cd "$REPO" && exec "$@") >"$log" 2>&1 || status=$?
  if [ "$status" -eq 0 ]; then
    echo "demo build: $name: done after $((SECONDS - t0))s"
  else
    echo "demo build: $name: FAILED ($status) after $((SECONDS - t0))s; the end of $log:" >&2
    tail -n 30 "$log" >&2
  fi
  return "$status"
}

pids=()
(step control-plane "5.5 min" bash "$HERE/build.sh" &&
  step capi-manager "65 s" bash "$HERE/capi/build.sh") &
pids+=($!)
step provider "7.5 min" nice -n 10 "$CARGO" build --bin capi-autoscaler-provider --example demo &
pids+=($!)
step cluster-autoscaler "5 s" bash "$HERE/artifact.sh" cluster-autoscaler &
pids+=($!)

failed=0
for pid in "${pids[@]}"; do
  wait "$pid" || failed=1
done
[ "$failed" -eq 0 ] || exit 1
echo "demo build: all built after $((SECONDS - t0))s"
