#!/usr/bin/env bash
# Builds (or reuses) promtool from the Go modules pinned by go.mod/go.sum here (the Prometheus release
# v0.316.0 as a Go module), and promql-names (./promql-names: the metric names of PromQL expressions, with
# the same release's parser), into a cache directory outside the repository keyed by go.sum, the sources
# here and the go version; prints the bin directory on stdout (progress on stderr). tests/monitoring.rs
# runs `promtool check rules`, `promtool test rules` and promql-names on deploy/monitoring/ with them;
# `make upstream` builds them.
# Safe to run concurrently: the finished directory appears by an atomic rename.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS="-mod=readonly -buildvcs=false"
KEY=$( { cat "$HERE/go.sum" "$HERE/build.sh" "$HERE/promql-names/main.go"; go version; } | sha256sum | cut -c1-16)
ROOT=${CAPI_E2E_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/capi-autoscaler-provider}
OUT=$ROOT/promtool-$KEY

if [ -x "$OUT/bin/promtool" ] && [ -x "$OUT/bin/promql-names" ]; then
  echo "$OUT/bin"
  exit 0
fi

mkdir -p "$ROOT"
WORK=$(mktemp -d "$ROOT/.build-promtool-XXXXXX")
trap 'rm -rf "$WORK"' EXIT
cd "$HERE"
VERSION=$(go list -m -f '{{.Version}}' github.com/prometheus/prometheus)
start=$(date +%s)
echo "promtool: building $VERSION" >&2
go build -trimpath -ldflags "-s -w -X github.com/prometheus/common/version.Version=$VERSION" \
  -o "$WORK/bin/promtool" github.com/prometheus/prometheus/cmd/promtool
go build -trimpath -ldflags "-s -w" -o "$WORK/bin/promql-names" ./promql-names
chmod -R u+w "$WORK"
if ! mv -T "$WORK" "$OUT" 2>/dev/null; then
  [ -x "$OUT/bin/promql-names" ] || { echo "promtool: could not install into $OUT" >&2; exit 1; }
fi
trap - EXIT
echo "promtool: $VERSION built in $(( $(date +%s) - start ))s into $OUT" >&2
echo "$OUT/bin"
