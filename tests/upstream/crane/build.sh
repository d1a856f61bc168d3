#!/usr/bin/env bash
# Builds (or reuses) crane from the Go modules pinned by go.mod/go.sum here, into a cache directory outside the
# repository keyed by go.sum, this script and the go version; prints the binary's path on stdout (progress on
# stderr). ../artifact.sh pulls the official cluster-autoscaler image with it.
# Safe to run concurrently: the finished directory appears by an atomic rename.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS="-mod=readonly -buildvcs=false"
KEY=$( { cat "$HERE/go.sum" "$HERE/build.sh"; go version; } | sha256sum | cut -c1-16)
ROOT=${CAPI_E2E_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/capi-autoscaler-provider}
OUT=$ROOT/crane-$KEY

if [ -x "$OUT/bin/crane" ]; then
  echo "$OUT/bin/crane"
  exit 0
fi

mkdir -p "$ROOT"
WORK=$(mktemp -d "$ROOT/.build-crane-XXXXXX")
trap 'rm -rf "$WORK"' EXIT
cd "$HERE"
start=$(date +%s)
echo "crane: building $(go list -m -f '{{.Version}}' github.com/google/go-containerregistry)" >&2
go build -trimpath -ldflags "-s -w" -o "$WORK/bin/crane" github.com/google/go-containerregistry/cmd/crane
if ! mv -T "$WORK" "$OUT" 2>/dev/null; then
  [ -x "$OUT/bin/crane" ] || { echo "crane: could not install into $OUT" >&2; exit 1; }
fi
trap - EXIT
echo "crane: built in $(( $(date +%s) - start ))s into $OUT" >&2
echo "$OUT/bin/crane"
