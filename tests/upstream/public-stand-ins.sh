#!/usr/bin/env bash
# Stands in for the public sources of the upstream artifacts, on 127.0.0.1, so that artifact.sh's public path runs
# without the internet:
#   - an OCI registry (`crane registry serve`) with, for each cluster-autoscaler version served, an image index of
#     two platforms like the official one: this machine's platform carries that release's binary at
#     /cluster-autoscaler on a base layer, the other platform a different file;
#   - a Helm chart repository over HTTP: the official chart packaged with `helm package`, indexed with
#     `helm repo index`.
# The binaries and the chart are what artifact.sh finds as configured (a local mirror, or the real public sources).
#
#   public-stand-ins.sh [--all-versions] DIR -- COMMAND...  runs COMMAND pointed at the stand-ins (and at no
#                                                           mirror), then stops them; exits with COMMAND's status
#   public-stand-ins.sh [--all-versions] DIR                prints that environment (NAME=VALUE lines, then
#                                                           "ready") and serves until its standard input closes
# Only the default cluster-autoscaler version is served, every pinned one with --all-versions. DIR (created) keeps
# the registry's blobs, the chart repository, the pins of what is served (DIR/pins, the digests of these images
# and this package), an empty mirror folder and artifact.sh's cache (DIR/cache).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
all=false
if [[ ${1:-} == --all-versions ]]; then
  all=true
  shift
fi
[[ -n ${1:-} ]] || { sed -n '11,14p' "${BASH_SOURCE[0]}" | sed 's/^# //' >&2; exit 2; }
mkdir -p "$1"
DIR=$(cd "$1" && pwd)
shift
if [[ ${1:-} == -- ]]; then shift; fi

log() { echo "stand-ins: $*" >&2; }

PIDS=()
stop() {
  local pid
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
}
trap stop EXIT

# Starts COMMAND... logging to LOG, then waits (10 s at most) for the port it prints on a line matching SED, into
# PORT. (Not in a command substitution: the server's pid must reach PIDS here.)
serve() {
  local log=$1 sed=$2
  shift 2
  "$@" >"$log" 2>&1 &
  PIDS+=("$!")
  PORT=""
  for _ in $(seq 100); do
    PORT=$(sed -n "$sed" "$log" | head -n1)
    [[ -n $PORT ]] && return
    kill -0 "$!" 2>/dev/null || { cat "$log" >&2; log "$1 exited"; exit 1; }
    sleep 0.1
  done
  cat "$log" >&2
  log "$1 printed no port within 10 s"
  exit 1
}

crane=$(bash "$HERE/crane/build.sh")
helm=$(bash "$HERE/helm/build.sh")
export HELM_CACHE_HOME=$DIR/helm HELM_CONFIG_HOME=$DIR/helm HELM_DATA_HOME=$DIR/helm
rm -rf "$DIR/blobs" "$DIR/charts" "$DIR/pins" "$DIR/layers" "$DIR/no-mirror"
mkdir -p "$DIR/blobs" "$DIR/charts" "$DIR/pins" "$DIR/layers" "$DIR/no-mirror"

serve "$DIR/registry.log" 's/.*serving on port \([0-9]*\).*/\1/p' \
  "$crane" registry serve --address 127.0.0.1:0 --disk "$DIR/blobs"
registry=127.0.0.1:$PORT
log "registry on $registry"

case $(uname -m) in
  x86_64 | amd64) arch=amd64 other=arm64 ;;
  aarch64 | arm64) arch=arm64 other=amd64 ;;
  *) log "no image platform for $(uname -m)"; exit 1 ;;
esac
repo=$registry/autoscaling/cluster-autoscaler
layers=$DIR/layers
mkdir -p "$layers/base/etc" "$layers/other"
echo 'nonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin' >"$layers/base/etc/passwd"
printf '#!/bin/sh\necho "the image of another platform" >&2\nexit 1\n' >"$layers/other/cluster-autoscaler"
chmod 0755 "$layers/other/cluster-autoscaler"
tar_layer() { tar -c --owner=0 --group=0 --numeric-owner --mtime=@0 "$@"; }
tar_layer -f "$layers/base.tar" -C "$layers/base" etc
tar_layer -f "$layers/other.tar" -C "$layers/other" cluster-autoscaler

# Pushes an image of PLATFORM from the layer tarballs and prints its digest.
push_image() {
  local tag=$1 platform=$2
  shift 2
  local args=()
  for layer in "$@"; do args+=(-f "$layer"); done
  "$crane" append "${args[@]}" -t "$repo:$tag-unset" >/dev/null 2>&1
  "$crane" mutate --set-platform "$platform" -t "$repo:$tag" "$repo:$tag-unset" >/dev/null 2>&1
  "$crane" digest "$repo:$tag"
}

versions=$(grep -Ev '^[[:space:]]*(#|$)' "$HERE/cluster-autoscaler.versions" | awk '{ print $1 }')
$all || versions=$(head -n1 <<<"$versions")
for version in $versions; do
  binary=$(bash "$HERE/artifact.sh" cluster-autoscaler "$version")
  tar_layer -f "$layers/ca-$version.tar" -C "$(dirname "$binary")" \
    --transform 's|.*|cluster-autoscaler|' "$(basename "$binary")"
  mine=$(push_image "v$version-$arch" "linux/$arch" "$layers/base.tar" "$layers/ca-$version.tar")
  theirs=$(push_image "v$version-$other" "linux/$other" "$layers/base.tar" "$layers/other.tar")
  "$crane" index append -m "$repo@$mine" -m "$repo@$theirs" -t "$repo:v$version" >/dev/null 2>&1
  digest=$("$crane" digest "$repo:v$version")
  echo "$version $digest" >>"$DIR/pins/cluster-autoscaler.versions"
  log "cluster-autoscaler $version: $repo:v$version@$digest (from $binary)"
done

chart=$(bash "$HERE/artifact.sh" cluster-autoscaler-chart)
version=$(sed -n 's/^version: *//p' "$chart/Chart.yaml")
"$helm" package "$chart" --destination "$DIR/charts" >/dev/null
"$helm" repo index "$DIR/charts"
sha=$(sha256sum <"$DIR/charts/cluster-autoscaler-$version.tgz" | cut -d' ' -f1)
echo "$version sha256:$sha" >"$DIR/pins/cluster-autoscaler-chart.version"
serve "$DIR/charts.log" 's/.*Serving HTTP on 127.0.0.1 port \([0-9]*\).*/\1/p' \
  python3 -u -m http.server 0 --bind 127.0.0.1 --directory "$DIR/charts"
charts=http://127.0.0.1:$PORT
log "chart repository on $charts: cluster-autoscaler $version, sha256:$sha (from $chart)"

ENVIRONMENT=(
  "CAPI_SHARED_UPSTREAM=$DIR/no-mirror"
  "CAPI_UPSTREAM_REGISTRY=$registry"
  "CAPI_UPSTREAM_CHART_REPO=$charts"
  "CAPI_UPSTREAM_PINS=$DIR/pins"
  "CAPI_ARTIFACT_CACHE=$DIR/cache"
)
if [[ $# -gt 0 ]]; then
  # Whatever points artifact.sh at another place goes, so that everything resolves through the stand-ins.
  unset CLUSTER_AUTOSCALER CLUSTER_AUTOSCALER_CLUSTERAPI CLUSTER_AUTOSCALER_CHART CAPI_GRPC_SERVER
  for var in $(compgen -e | grep '^CLUSTER_AUTOSCALER_[0-9]' || true); do unset "$var"; done
  status=0
  env "${ENVIRONMENT[@]}" "$@" || status=$?
  exit "$status"
fi
printf '%s\n' "${ENVIRONMENT[@]}" ready
cat >/dev/null
