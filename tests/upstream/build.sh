#!/usr/bin/env bash
# Builds (or reuses) the real upstream components the tests run, pinned by go.mod/go.sum here:
#   bin/etcd, bin/kube-apiserver,
#   bin/kube-scheduler,
#   bin/kube-controller-manager                built from Go modules with the local toolchain
#   crds/shipped/*.yaml                        Cluster API CRDs as released (v1beta1 + v1beta2, v1beta2 storage)
#   crds/v1beta1/*.yaml                        the same with only v1beta1, as storage
#   crds/renamed/*.yaml                        the shipped CRDs moved to the API group $RENAMED_GROUP
# into a cache directory outside the repository, keyed by go.sum, the go version and this script.
# Prints the cache directory on stdout; progress goes to stderr. Safe to run concurrently: the
# finished directory appears by an atomic rename.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
RENAMED_GROUP=cluster.example.dev
K8S_VERSION=v1.36.2
CRD_KINDS="machinedeployments machinesets machines machinepools clusters"

export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS="-mod=readonly -buildvcs=false"
KEY=$( { cat "$HERE/go.sum" "$HERE/build.sh"; go version; } | sha256sum | cut -c1-16)
ROOT=${CAPI_E2E_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/capi-autoscaler-provider}
OUT=$ROOT/upstream-$KEY

if [ -f "$OUT/ready" ]; then
  echo "$OUT"
  exit 0
fi

log() { echo "upstream: $*" >&2; }
mkdir -p "$ROOT"
WORK=$(mktemp -d "$ROOT/.build-XXXXXX")
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/bin" "$WORK/crds/shipped" "$WORK/crds/v1beta1" "$WORK/crds/renamed"

cd "$HERE"
start=$(date +%s)
log "building etcd"
go build -trimpath -ldflags "-s -w" -o "$WORK/bin/etcd" go.etcd.io/etcd/server/v3
log "etcd built after $(( $(date +%s) - start ))s; building kube-apiserver"
MINOR=${K8S_VERSION#v1.}; MINOR=${MINOR%%.*}
go build -trimpath -pgo=off -ldflags "-s -w \
  -X k8s.io/component-base/version.gitVersion=$K8S_VERSION \
  -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$MINOR" \
  -o "$WORK/bin/kube-apiserver" k8s.io/kubernetes/cmd/kube-apiserver
log "kube-apiserver built after $(( $(date +%s) - start ))s; building kube-scheduler"
go build -trimpath -pgo=off -ldflags "-s -w \
  -X k8s.io/component-base/version.gitVersion=$K8S_VERSION \
  -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$MINOR" \
  -o "$WORK/bin/kube-scheduler" k8s.io/kubernetes/cmd/kube-scheduler
log "kube-scheduler built after $(( $(date +%s) - start ))s; building kube-controller-manager"
go build -trimpath -pgo=off -ldflags "-s -w \
  -X k8s.io/component-base/version.gitVersion=$K8S_VERSION \
  -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$MINOR" \
  -o "$WORK/bin/kube-controller-manager" k8s.io/kubernetes/cmd/kube-controller-manager
log "kube-controller-manager built after $(( $(date +%s) - start ))s"

CAPI_DIR=$(go list -m -json sigs.k8s.io/cluster-api | python3 -c 'import json,sys; print(json.load(sys.stdin).get("Dir",""))')
if [ -z "$CAPI_DIR" ] || [ ! -d "$CAPI_DIR" ]; then
  go mod download sigs.k8s.io/cluster-api
  CAPI_DIR=$(go list -m -json sigs.k8s.io/cluster-api | python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')
fi
python3 -c 'import yaml' 2>/dev/null || python3 -m pip install --quiet pyyaml >&2
for kind in $CRD_KINDS; do
  cp "$CAPI_DIR/core/config/crd/bases/cluster.x-k8s.io_$kind.yaml" "$WORK/crds/shipped/"
done
python3 "$HERE/crd_variants.py" "$RENAMED_GROUP" "$WORK/crds" "$WORK"/crds/shipped/*.yaml
echo "$K8S_VERSION" > "$WORK/k8s-version"
echo "$RENAMED_GROUP" > "$WORK/renamed-group"
date -u +%FT%TZ > "$WORK/ready"
chmod -R u+w "$WORK"
if ! mv -T "$WORK" "$OUT" 2>/dev/null; then
  [ -f "$OUT/ready" ] || { log "could not install into $OUT"; exit 1; }
fi
trap - EXIT
log "ready in $OUT after $(( $(date +%s) - start ))s"
echo "$OUT"
