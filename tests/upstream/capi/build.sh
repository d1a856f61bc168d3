#!/usr/bin/env bash
# Builds (or reuses) a real Cluster API core manager pinned by a go.mod/go.sum: with no argument the one
# here (the default release of the tests), with PIN the one in the subdirectory PIN (e.g. v1.13):
#   bin/capi-manager          the main package the go.mod's `tool` line names (sigs.k8s.io/cluster-api/core
#                             since v1.14, the module root before), built with the local toolchain
#   crds/*.yaml               the module's 13 core CRDs (<main package dir>/config/crd/bases), as released
#   webhook/manifests.yaml    the module's webhook configurations (<main package dir>/config/webhook), whose
#                             paths the tests register with the test kube-apiserver
#   version                   the Cluster API version built
# into a cache directory outside the repository, keyed by go.sum, the go version and this script.
# Prints the cache directory on stdout; progress goes to stderr. Safe to run concurrently: the
# finished directory appears by an atomic rename.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
PIN=${1:-}
case "$PIN" in
  "") ;;
  */*|.*) echo "capi: PIN names a subdirectory of $HERE, not $PIN" >&2; exit 2 ;;
  *) [ -f "$HERE/$PIN/go.mod" ] || { echo "capi: no pinned release $HERE/$PIN/go.mod" >&2; exit 2; }
     HERE=$HERE/$PIN ;;
esac
SCRIPT=$(cd "$(dirname "$0")" && pwd)/build.sh
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS="-mod=readonly -buildvcs=false"
KEY=$( { cat "$HERE/go.sum" "$SCRIPT"; go version; } | sha256sum | cut -c1-16)
ROOT=${CAPI_E2E_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/capi-autoscaler-provider}
OUT=$ROOT/capi-$KEY

if [ -f "$OUT/ready" ]; then
  echo "$OUT"
  exit 0
fi

log() { echo "capi: $*" >&2; }
mkdir -p "$ROOT"
WORK=$(mktemp -d "$ROOT/.build-capi-XXXXXX")
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/bin" "$WORK/crds" "$WORK/webhook"

cd "$HERE"
start=$(date +%s)
CAPI_VERSION=$(go list -m -f '{{.Version}}' sigs.k8s.io/cluster-api)
MAJOR=${CAPI_VERSION#v}; MAJOR=${MAJOR%%.*}
MINOR=${CAPI_VERSION#v*.}; MINOR=${MINOR%%.*}
# The go.mod's one `tool` line names the manager's main package; its directory in the module holds config/.
MAIN=$(go mod edit -json | python3 -c 'import json,sys; t=json.load(sys.stdin).get("Tool") or []; print(t[0]["Path"] if len(t)==1 else "")')
case "$MAIN" in
  sigs.k8s.io/cluster-api) SUB= ;;
  sigs.k8s.io/cluster-api/*) SUB=/${MAIN#sigs.k8s.io/cluster-api/} ;;
  *) log "$HERE/go.mod needs exactly one tool line naming the core manager's package, found '$MAIN'"; exit 1 ;;
esac
log "building the core manager $CAPI_VERSION ($MAIN)"
# The version stamps are the ones Cluster API's own release build sets (hack/scripts/release/version.sh).
go build -trimpath -ldflags "-s -w \
  -X sigs.k8s.io/cluster-api/version.gitVersion=$CAPI_VERSION \
  -X sigs.k8s.io/cluster-api/version.gitMajor=$MAJOR -X sigs.k8s.io/cluster-api/version.gitMinor=$MINOR" \
  -o "$WORK/bin/capi-manager" "$MAIN"
log "core manager built after $(( $(date +%s) - start ))s"

CAPI_DIR=$(go list -m -f '{{.Dir}}' sigs.k8s.io/cluster-api)
cp "$CAPI_DIR$SUB"/config/crd/bases/*.yaml "$WORK/crds/"
cp "$CAPI_DIR$SUB/config/webhook/manifests.yaml" "$WORK/webhook/"
count=$(find "$WORK/crds" -name '*.yaml' | wc -l)
[ "$count" -eq 13 ] || { log "expected 13 core CRDs in $CAPI_DIR, found $count"; exit 1; }
echo "$CAPI_VERSION" > "$WORK/version"
echo "$(( $(date +%s) - start ))" > "$WORK/build-seconds"
date -u +%FT%TZ > "$WORK/ready"
chmod -R u+w "$WORK"
if ! mv -T "$WORK" "$OUT" 2>/dev/null; then
  [ -f "$OUT/ready" ] || { log "could not install into $OUT"; exit 1; }
fi
trap - EXIT
log "$CAPI_VERSION ready in $OUT after $(( $(date +%s) - start ))s"
echo "$OUT"
