#!/usr/bin/env bash
# Builds (or reuses) helm v3 from the Go modules pinned by go.mod/go.sum here, into a cache directory outside
# the repository keyed by go.sum, this script and the go version; prints the binary's path on stdout
# (progress on stderr). The tests render the official cluster-autoscaler chart with it (`helm template`).
# Safe to run concurrently: the finished directory appears by an atomic rename.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS="-mod=readonly -buildvcs=false"
KEY=$( { cat "$HERE/go.sum" "$HERE/build.sh"; go version; } | sha256sum | cut -c1-16)
ROOT=${CAPI_E2E_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/capi-autoscaler-provider}
OUT=$ROOT/helm-$KEY

if [ -x "$OUT/bin/helm" ]; then
  echo "$OUT/bin/helm"
  exit 0
fi

mkdir -p "$ROOT"
WORK=$(mktemp -d "$ROOT/.build-helm-XXXXXX")
trap 'rm -rf "$WORK"' EXIT
cd "$HERE"
mod_version() { go list -m -f '{{.Version}}' "$1"; }
HELM_VERSION=$(mod_version helm.sh/helm/v3)
# helm's own release build stamps the Kubernetes version of its client libraries as the default of
# .Capabilities.KubeVersion (`helm template` without --kube-version); without it, that default is v1.20.
K8S_MINOR=$(mod_version k8s.io/client-go | cut -d. -f2)
start=$(date +%s)
echo "helm: building $HELM_VERSION (Kubernetes 1.$K8S_MINOR libraries)" >&2
go build -trimpath -ldflags "-s -w \
  -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION \
  -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=$K8S_MINOR \
  -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMinor=$K8S_MINOR" \
  -o "$WORK/bin/helm" helm.sh/helm/v3/cmd/helm
chmod -R u+w "$WORK"
if ! mv -T "$WORK" "$OUT" 2>/dev/null; then
  [ -x "$OUT/bin/helm" ] || { echo "helm: could not install into $OUT" >&2; exit 1; }
fi
trap - EXIT
echo "helm: $HELM_VERSION built in $(( $(date +%s) - start ))s into $OUT" >&2
echo "$OUT/bin/helm"
