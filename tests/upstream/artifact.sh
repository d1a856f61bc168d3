#!/usr/bin/env bash
# Prints the path of an upstream artifact the tests, the demo and the benchmarks run (progress and errors on
# stderr):
#   artifact.sh cluster-autoscaler [VERSION]             an executable cluster-autoscaler (CA) release; VERSION
#                                                        is one of cluster-autoscaler.versions (default: the first)
#   artifact.sh cluster-autoscaler-clusterapi [VERSION]  CA with the in-tree clusterapi provider (the bench's A)
#   artifact.sh cluster-autoscaler-chart                 the folder of the official Helm chart
#   artifact.sh capi-grpc-server                         upstream's externalgrpc example server around the
#                                                        in-tree clusterapi provider (the bench's W)
#
# Each is looked for in this order, and the first place that has it wins:
#   1. a path from the environment: CLUSTER_AUTOSCALER (the default version; CLUSTER_AUTOSCALER_1_35_2 and so on
#      for the others), CLUSTER_AUTOSCALER_CLUSTERAPI, CLUSTER_AUTOSCALER_CHART (a chart folder),
#      CAPI_GRPC_SERVER;
#   2. a local mirror of upstream artifacts: the folder CAPI_SHARED_UPSTREAM, else ../shared/upstream beside the
#      repository when it exists; its `get NAME` prints the path of an artifact it holds (`get --list`);
#   3. the public source, pinned here by digest and verified before use, then cached under CAPI_ARTIFACT_CACHE
#      (default: ~/.cache/capi-autoscaler-provider, or CAPI_E2E_CACHE):
#      - CA: /cluster-autoscaler of the official image registry.k8s.io/autoscaling/cluster-autoscaler, pulled by
#        the digest pinned in cluster-autoscaler.versions with crane (built from crane/go.mod; no Docker
#        engine). That release binary has every provider built in, the in-tree clusterapi one too, so it is
#        also the public source of cluster-autoscaler-clusterapi;
#      - the chart: `helm pull` from the chart repository of kubernetes/autoscaler, its package checked
#        against the sha256 pinned in cluster-autoscaler-chart.version;
#      - W: no binary is published; w/build.sh builds it from the pinned source module.
# CAPI_UPSTREAM_REGISTRY and CAPI_UPSTREAM_CHART_REPO name another registry and chart repository serving the
# same artifacts (the digests still have to match); CAPI_UPSTREAM_PINS another folder of pin files (the
# resolver's own test serves artifacts it built, with their digests).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
PINS=${CAPI_UPSTREAM_PINS:-$HERE}
REGISTRY=${CAPI_UPSTREAM_REGISTRY:-registry.k8s.io}
CHART_REPO=${CAPI_UPSTREAM_CHART_REPO:-https://kubernetes.github.io/autoscaler}
CACHE=${CAPI_ARTIFACT_CACHE:-${CAPI_E2E_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/capi-autoscaler-provider}}
CA_PINS=$PINS/cluster-autoscaler.versions
CHART_PIN=$PINS/cluster-autoscaler-chart.version

fail() {
  echo "artifact: $*" >&2
  exit 1
}

# The usage (the header's first lines), then exit with status $1.
usage() {
  sed -n '2,9p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
  exit "$1"
}

# The lines of a pin file without comments: "VERSION DIGEST".
pins() {
  [[ -f $1 ]] || fail "no pin file $1"
  grep -Ev '^[[:space:]]*(#|$)' "$1"
}

# The digest pinned for VERSION in FILE.
pinned_digest() {
  local file=$1 version=$2 digest
  digest=$(pins "$file" | awk -v v="$version" '$1 == v { print $2 }')
  [[ -n $digest ]] || fail "version $version is not pinned in $file (pinned: $(pins "$file" | awk '{ print $1 }' | tr '\n' ' '))"
  [[ $digest =~ ^sha256:[0-9a-f]{64}$ ]] || fail "$file: the digest of $version is not sha256:<64 hex digits>: $digest"
  echo "$digest"
}

# 1. The path in environment variable VAR, when it is set: an executable ("file") or a chart folder ("chart").
from_env() {
  local var=$1 kind=$2 value=${!1:-}
  [[ -n $value ]] || return 1
  if [[ $kind == chart ]]; then
    [[ -f $value/Chart.yaml ]] || fail "$var=$value is not a chart folder (no Chart.yaml in it)"
  else
    [[ -f $value && -x $value ]] || fail "$var=$value is not an executable file"
  fi
  echo "$value"
}

# 2. The mirror's copy of NAME, when a mirror is configured and holds it.
from_mirror() {
  local name=$1 dir
  if [[ -n ${CAPI_SHARED_UPSTREAM:-} ]]; then
    dir=$CAPI_SHARED_UPSTREAM
    [[ -d $dir ]] || fail "CAPI_SHARED_UPSTREAM=$dir is not a folder (a local mirror of upstream artifacts)"
  else
    dir=$REPO/../shared/upstream
    [[ -d $dir ]] || return 1
  fi
  [[ -x $dir/get ]] && "$dir/get" --list 2>/dev/null | grep -qx "$name" || return 1
  "$dir/get" "$name" || fail "the mirror $dir could not unpack $name"
}

# A fresh folder in the cache for a download, removed on exit unless moved into place.
scratch() {
  mkdir -p "$CACHE"
  SCRATCH=$(mktemp -d "$CACHE/.$1-XXXXXX")
  trap 'rm -rf "$SCRATCH"' EXIT
}

# Moves the finished folder SRC to DEST (atomically; another resolver may have got there first).
install_dir() {
  mv -T "$1" "$2" 2>/dev/null || [[ -e $2 ]] || fail "could not move $1 into $2"
}

machine_arch() {
  case $(uname -m) in
    x86_64 | amd64) echo amd64 ;;
    aarch64 | arm64) echo arm64 ;;
    *) fail "no cluster-autoscaler image for the machine architecture $(uname -m)" ;;
  esac
}

# 3. The official image's /cluster-autoscaler of VERSION, pulled by its pinned digest.
public_ca() {
  local version=$1 digest image arch out crane got
  digest=$(pinned_digest "$CA_PINS" "$version")
  image=$REGISTRY/autoscaling/cluster-autoscaler
  out=$CACHE/cluster-autoscaler-$version-${digest:7:16}
  if [[ -x $out/cluster-autoscaler ]]; then
    echo "$out/cluster-autoscaler"
    return
  fi
  arch=$(machine_arch)
  crane=$(bash "$HERE/crane/build.sh")
  echo "artifact: cluster-autoscaler $version: pulling /cluster-autoscaler (linux/$arch) of $image@$digest" >&2
  scratch "cluster-autoscaler-$version"
  # By digest: the registry must serve exactly the pinned index; crane checks every manifest and layer it
  # reads against the digest that names it, and the index's own bytes are checked here.
  "$crane" manifest "$image@$digest" >"$SCRATCH/index" 2>"$SCRATCH/err" ||
    fail "cluster-autoscaler $version: $image does not serve the digest $digest pinned in $CA_PINS; refusing any other image. crane: $(tail -n3 "$SCRATCH/err")"
  got=sha256:$(sha256sum <"$SCRATCH/index" | cut -d' ' -f1)
  [[ $got == "$digest" ]] ||
    fail "cluster-autoscaler $version: $image@$digest answered a manifest whose digest is $got; refusing it"
  mkdir "$SCRATCH/fs"
  # The binary is /cluster-autoscaler; a layer may name it with or without "./".
  set +e
  "$crane" export --platform "linux/$arch" "$image@$digest" - 2>"$SCRATCH/err" |
    tar -x -C "$SCRATCH/fs" --wildcards cluster-autoscaler ./cluster-autoscaler 2>/dev/null
  local exported=${PIPESTATUS[0]}
  set -e
  [[ $exported == 0 ]] ||
    fail "cluster-autoscaler $version: could not export $image@$digest for linux/$arch: $(tail -n3 "$SCRATCH/err")"
  [[ -f $SCRATCH/fs/cluster-autoscaler ]] ||
    fail "cluster-autoscaler $version: the image $image@$digest has no /cluster-autoscaler for linux/$arch"
  mkdir "$SCRATCH/out"
  mv "$SCRATCH/fs/cluster-autoscaler" "$SCRATCH/out/cluster-autoscaler"
  chmod 0755 "$SCRATCH/out/cluster-autoscaler"
  install_dir "$SCRATCH/out" "$out"
  echo "artifact: cluster-autoscaler $version: verified and cached in $out" >&2
  echo "$out/cluster-autoscaler"
}

# 3. The official chart of the pinned version, pulled from its chart repository and checked by sha256.
public_chart() {
  local line version sha out helm got
  line=$(pins "$CHART_PIN" | head -n1)
  version=${line%% *}
  sha=$(pinned_digest "$CHART_PIN" "$version")
  out=$CACHE/cluster-autoscaler-chart-$version-${sha:7:16}
  if [[ -f $out/Chart.yaml ]]; then
    echo "$out"
    return
  fi
  helm=$(bash "$HERE/helm/build.sh")
  echo "artifact: cluster-autoscaler chart $version: helm pull from $CHART_REPO" >&2
  scratch "cluster-autoscaler-chart-$version"
  # helm's repository cache and settings stay in the scratch folder, not the user's helm configuration.
  HELM_CACHE_HOME=$SCRATCH/helm HELM_CONFIG_HOME=$SCRATCH/helm HELM_DATA_HOME=$SCRATCH/helm \
    "$helm" pull cluster-autoscaler --repo "$CHART_REPO" --version "$version" --destination "$SCRATCH" \
    >/dev/null 2>"$SCRATCH/err" ||
    fail "cluster-autoscaler chart $version: helm pull from $CHART_REPO failed: $(tail -n3 "$SCRATCH/err")"
  local package=$SCRATCH/cluster-autoscaler-$version.tgz
  [[ -f $package ]] || fail "cluster-autoscaler chart $version: helm pull left no $(basename "$package")"
  got=sha256:$(sha256sum <"$package" | cut -d' ' -f1)
  [[ $got == "$sha" ]] ||
    fail "cluster-autoscaler chart $version from $CHART_REPO has the digest $got, but $CHART_PIN pins $sha; refusing it"
  mkdir "$SCRATCH/x"
  tar -xzf "$package" -C "$SCRATCH/x"
  grep -qx "version: $version" "$SCRATCH/x/cluster-autoscaler/Chart.yaml" 2>/dev/null ||
    fail "cluster-autoscaler chart $version: the package has no cluster-autoscaler/Chart.yaml of version $version"
  install_dir "$SCRATCH/x/cluster-autoscaler" "$out"
  echo "artifact: cluster-autoscaler chart $version: verified and cached in $out" >&2
  echo "$out"
}

default_version() {
  pins "$CA_PINS" | head -n1 | awk '{ print $1 }'
}

artifact=${1:-}
case $artifact in
  cluster-autoscaler)
    version=${2:-$(default_version)}
    pinned_digest "$CA_PINS" "$version" >/dev/null
    var=CLUSTER_AUTOSCALER
    [[ $version == "$(default_version)" ]] || var=CLUSTER_AUTOSCALER_${version//./_}
    from_env "$var" file || from_mirror "cluster-autoscaler-$version" || public_ca "$version"
    ;;
  cluster-autoscaler-clusterapi)
    version=${2:-$(default_version)}
    pinned_digest "$CA_PINS" "$version" >/dev/null
    from_env CLUSTER_AUTOSCALER_CLUSTERAPI file ||
      from_mirror "cluster-autoscaler-clusterapi-$version" || public_ca "$version"
    ;;
  cluster-autoscaler-chart)
    version=$(pins "$CHART_PIN" | head -n1 | awk '{ print $1 }')
    from_env CLUSTER_AUTOSCALER_CHART chart || from_mirror "cluster-autoscaler-chart-$version" || public_chart
    ;;
  capi-grpc-server)
    release=$(sed -n 's/^RELEASE=//p' "$HERE/w/build.sh")
    from_env CAPI_GRPC_SERVER file || from_mirror "capi-grpc-server-$release-patched" || bash "$HERE/w/build.sh"
    ;;
  -h | --help) usage 0 ;;
  *)
    echo "artifact: unknown artifact '$artifact'" >&2
    usage 2
    ;;
esac
