#!/usr/bin/env bash
# Prints the path of a cluster-autoscaler binary of VERSION (default: the first line of
# cluster-autoscaler.versions), found in this order:
#   1. $CLUSTER_AUTOSCALER, when VERSION is the default (or $CLUSTER_AUTOSCALER_<1_35_2> for another one);
#   2. the steering workspace's ../shared/upstream (CI and the development machines): `get
#      cluster-autoscaler-VERSION` unpacks the release build there (`-tags externalgrpc`);
#   3. on a user's machine: /cluster-autoscaler from the official image
#      registry.k8s.io/autoscaling/cluster-autoscaler:vVERSION, pulled with `crane` (built from Go
#      modules by `go run`, no Docker engine), cached in ~/.cache/capi-autoscaler-provider/.
#      (This path needs registry access, which the development machines do not have: untested here.)
# With --flavor clusterapi (only from ../shared/upstream): CA with the in-tree clusterapi provider.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
flavor=externalgrpc
if [[ ${1:-} == --flavor ]]; then flavor=$2; shift 2; fi
default=$(grep -Ev '^\s*(#|$)' "$HERE/cluster-autoscaler.versions" | head -n1)
version=${1:-$default}
if ! grep -qx "$version" "$HERE/cluster-autoscaler.versions"; then
  echo "cluster-autoscaler: version $version is not pinned in $HERE/cluster-autoscaler.versions" >&2
  exit 2
fi
var=CLUSTER_AUTOSCALER
[[ $version == "$default" ]] || var=CLUSTER_AUTOSCALER_${version//./_}
if [[ $flavor == externalgrpc && -n ${!var:-} ]]; then
  [[ -x ${!var} ]] || { echo "cluster-autoscaler: $var=${!var} is not an executable" >&2; exit 2; }
  echo "${!var}"; exit 0
fi
name=cluster-autoscaler-$version
[[ $flavor == externalgrpc ]] || name=cluster-autoscaler-$flavor-$version
shared=${CAPI_SHARED_UPSTREAM:-$REPO/../shared/upstream}
if [[ -x $shared/get ]] && "$shared/get" --list | grep -qx "$name"; then
  exec "$shared/get" "$name"
fi
if [[ $flavor != externalgrpc ]]; then
  echo "cluster-autoscaler: $name is only available from ../shared/upstream" >&2; exit 2
fi
cache=${CAPI_E2E_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/capi-autoscaler-provider}/cluster-autoscaler-v$version
if [[ ! -x $cache/cluster-autoscaler ]]; then
  image=registry.k8s.io/autoscaling/cluster-autoscaler:v$version
  echo "cluster-autoscaler: pulling /cluster-autoscaler from $image" >&2
  mkdir -p "$cache"; tmp=$(mktemp -d "$cache/.pull-XXXXXX"); trap 'rm -rf "$tmp"' EXIT
  if (cd "$HERE" && GOTOOLCHAIN=local go run github.com/google/go-containerregistry/cmd/crane@v0.22.1 \
        export --platform "linux/$(go env GOARCH)" "$image" - ) | tar -x -C "$tmp" cluster-autoscaler 2>/dev/null \
     && [[ -x $tmp/cluster-autoscaler ]]; then
    mv -f "$tmp/cluster-autoscaler" "$cache/cluster-autoscaler"
  else
    cat >&2 <<MSG
cluster-autoscaler: no binary for $version. Provide one of:
  - CLUSTER_AUTOSCALER=/path/to/cluster-autoscaler (any build with the externalgrpc provider: the
    official image's /cluster-autoscaler, or 'go build -tags externalgrpc' in cluster-autoscaler/ at
    the tag cluster-autoscaler-$version);
  - the steering workspace's shared/upstream beside this repository;
  - registry access to $image (pulled with crane).
MSG
    exit 1
  fi
fi
echo "$cache/cluster-autoscaler"
