#!/usr/bin/env bash
# Builds (or reuses) the real upstream components the tests run, from Go modules with the local toolchain,
# into a cache directory outside the repository keyed by the go.sum it builds from, the go version and
# this script. With no argument, what every control plane runs (and `make demo` too), pinned by go.mod here
# (etcd by etcd/go.mod):
#   bin/etcd, bin/kube-apiserver, bin/kube-scheduler
#   crds/shipped/*.yaml                        Cluster API CRDs as released (v1beta1 + v1beta2, v1beta2 storage)
#   crds/v1beta1/*.yaml                        the same with only v1beta1, as storage
#   crds/renamed/*.yaml                        the shipped CRDs moved to the API group $RENAMED_GROUP
# With `kube-controller-manager`: bin/kube-controller-manager from the same go.mod (only the drain scenario
# runs it, so the demo never waits for it).
# With PIN (a subdirectory of k8s/, e.g. v1.37): bin/kube-apiserver and bin/kube-scheduler of the Kubernetes
# release k8s/PIN/go.mod pins, for the management-cluster matrix (etcd and CRDs: the default build's).
# Prints the cache directory on stdout; progress goes to stderr. Safe to run concurrently: the
# finished directory appears by an atomic rename.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
SCRIPT=$HERE/build.sh
RENAMED_GROUP=cluster.example.dev
CRD_KINDS="machinedeployments machinesets machines machinepools clusters"
WHAT=${1:-control-plane}
case "$WHAT" in
  control-plane) MODULE=$HERE; NAME=upstream ;;
  kube-controller-manager) MODULE=$HERE; NAME=kcm ;;
  */*|.*) echo "upstream: PIN names a subdirectory of $HERE/k8s, not $WHAT" >&2; exit 2 ;;
  *) [ -f "$HERE/k8s/$WHAT/go.mod" ] || { echo "upstream: no pinned release $HERE/k8s/$WHAT/go.mod" >&2; exit 2; }
     MODULE=$HERE/k8s/$WHAT; NAME=k8s-$WHAT ;;
esac

export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS="-mod=readonly -buildvcs=false"
KEY=$( { cat "$MODULE/go.sum" "$SCRIPT"; [ "$WHAT" != control-plane ] || cat "$HERE/etcd/go.sum"; go version; } \
  | sha256sum | cut -c1-16)
ROOT=${CAPI_E2E_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/capi-autoscaler-provider}
OUT=$ROOT/$NAME-$KEY

if [ -f "$OUT/ready" ]; then
  echo "$OUT"
  exit 0
fi

log() { echo "upstream: $*" >&2; }
mkdir -p "$ROOT"
WORK=$(mktemp -d "$ROOT/.build-XXXXXX")
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/bin"
install_out() {
  date -u +%FT%TZ > "$WORK/ready"
  chmod -R u+w "$WORK"
  if ! mv -T "$WORK" "$OUT" 2>/dev/null; then
    [ -f "$OUT/ready" ] || { log "could not install into $OUT"; exit 1; }
  fi
  trap - EXIT
  log "$WHAT ready in $OUT after $(( $(date +%s) - start ))s"
  echo "$OUT"
}

cd "$MODULE"
start=$(date +%s)
K8S_VERSION=$(go list -m -f '{{.Version}}' k8s.io/kubernetes)
MINOR=${K8S_VERSION#v1.}; MINOR=${MINOR%%.*}
# kube_build CMD: builds k8s.io/kubernetes/cmd/CMD into bin/, stamped with the release's version.
kube_build() {
  log "building $1 $K8S_VERSION"
  go build -trimpath -pgo=off -ldflags "-s -w \
    -X k8s.io/component-base/version.gitVersion=$K8S_VERSION \
    -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$MINOR" \
    -o "$WORK/bin/$1" "k8s.io/kubernetes/cmd/$1"
  log "$1 built after $(( $(date +%s) - start ))s"
}
echo "$K8S_VERSION" > "$WORK/k8s-version"

if [ "$WHAT" = kube-controller-manager ]; then
  kube_build kube-controller-manager
  install_out
  exit 0
fi
if [ "$WHAT" != control-plane ]; then
  kube_build kube-apiserver
  kube_build kube-scheduler
  install_out
  exit 0
fi

mkdir -p "$WORK/crds/shipped" "$WORK/crds/v1beta1" "$WORK/crds/renamed"
log "building etcd $(cd "$HERE/etcd" && go list -m -f '{{.Version}}' go.etcd.io/etcd/server/v3)"
(cd "$HERE/etcd" && go build -trimpath -ldflags "-s -w" -o "$WORK/bin/etcd" go.etcd.io/etcd/server/v3)
log "etcd built after $(( $(date +%s) - start ))s"
kube_build kube-apiserver
kube_build kube-scheduler

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
echo "$RENAMED_GROUP" > "$WORK/renamed-group"
install_out
