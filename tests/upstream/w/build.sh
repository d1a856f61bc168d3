#!/usr/bin/env bash
# Builds (or reuses) W, the bench's reference server: upstream's externalgrpc example server
# (cloudprovider/externalgrpc/examples/external-grpc-cloud-provider-service) around the in-tree clusterapi provider,
# from the source module k8s.io/autoscaler/cluster-autoscaler at the release pinned below, with one change: the
# example leaves AutoscalerOptions.Processors nil, and the clusterapi provider registers a processor through it
# (a nil-pointer panic at start), so main.go gets the processors the provider needs before the provider is built
# (an overlay generated from the downloaded source, `go build -overlay`; nothing of upstream is kept here).
# No binary of it is published; artifact.sh builds it when neither CAPI_GRPC_SERVER nor a mirror has it.
#
# The module's checksums are verified against the Go checksum database as it is downloaded (no go.sum is kept:
# the Go module proxy these development machines reach refuses k8s.io/autoscaler, so none could be recorded).
# Prints the binary's path on stdout, progress on stderr; cached outside the repository, keyed by this script and
# the go version.
set -euo pipefail

# The release and its commit (tag cluster-autoscaler-1.36.1), as a Go pseudo-version of the module.
RELEASE=1.36.1
MODULE_VERSION=v0.0.0-20260722070747-35e8a280425c
CA=k8s.io/autoscaler/cluster-autoscaler
EXAMPLE=$CA/cloudprovider/externalgrpc/examples/external-grpc-cloud-provider-service

HERE=$(cd "$(dirname "$0")" && pwd)
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS="-mod=mod -buildvcs=false"
KEY=$( { cat "$HERE/build.sh"; go version; } | sha256sum | cut -c1-16)
ROOT=${CAPI_E2E_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/capi-autoscaler-provider}
OUT=$ROOT/capi-grpc-server-$RELEASE-$KEY

if [ -x "$OUT/bin/capi-grpc-server" ]; then
  echo "$OUT/bin/capi-grpc-server"
  exit 0
fi

fail() {
  echo "capi-grpc-server: $*" >&2
  exit 1
}

mkdir -p "$ROOT"
WORK=$(mktemp -d "$ROOT/.build-capi-grpc-server-XXXXXX")
trap 'rm -rf "$WORK"' EXIT
cd "$WORK"
start=$(date +%s)
echo "capi-grpc-server: building upstream's example server of cluster-autoscaler $RELEASE from $CA@$MODULE_VERSION" >&2
go mod init capi-grpc-server >/dev/null 2>&1
go mod download -json "$CA@$MODULE_VERSION" >download.json 2>&1 ||
  fail "could not download $CA@$MODULE_VERSION: $(sed -n 's/^[[:space:]]*"Error": "\(.*\)",*$/\1/p' download.json)"
gomod=$(sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",*$/\1/p' download.json)
[[ -f $gomod ]] || fail "no go.mod of $CA@$MODULE_VERSION was downloaded"

# The release's own replaces (the Kubernetes staging modules) apply to its dependents too; its local replace of
# the apis module becomes that module at the same commit.
go mod edit -json "$gomod" |
  python3 -c '
import json, sys
version = sys.argv[1]
for r in json.load(sys.stdin).get("Replace") or []:
    old, new = r["Old"]["Path"], r["New"]
    target = new["Path"] + "@" + new["Version"] if new.get("Version") else old + "@" + version
    print("-replace=" + old + "=" + target)
' "$MODULE_VERSION" >replaces
mapfile -t edits <replaces
go mod edit "-require=$CA@$MODULE_VERSION" "${edits[@]}"

# The one change, made to the downloaded main.go and handed to the compiler as an overlay.
source_dir=$(go list -m -f '{{.Dir}}' "$CA")/${EXAMPLE#"$CA"/}
[[ -f $source_dir/main.go ]] || fail "no example server in $source_dir"
sed -e 's|^\([[:space:]]*\)coreoptions "k8s.io/autoscaler/cluster-autoscaler/core/options"$|&\n\1"k8s.io/autoscaler/cluster-autoscaler/processors"\n\1"k8s.io/autoscaler/cluster-autoscaler/processors/scaledowncandidates"|' \
  -e 's|^\([[:space:]]*\)cloudProvider := cloudBuilder.NewCloudProvider(autoscalingOptions, nil)$|\1autoscalingOptions.Processors = \&processors.AutoscalingProcessors{ScaleDownNodeProcessor: scaledowncandidates.NewCombinedScaleDownCandidatesProcessor()}\n&|' \
  "$source_dir/main.go" >main.go
[[ $(grep -c 'scaledowncandidates' main.go) == 2 ]] ||
  fail "$source_dir/main.go is not shaped as in $RELEASE (import block, NewCloudProvider call); the change did not apply"
printf '{"Replace": {"%s": "%s"}}\n' "$source_dir/main.go" "$WORK/main.go" >overlay.json
go build -tags clusterapi -trimpath -ldflags "-s -w" -overlay overlay.json -o "$WORK/bin/capi-grpc-server" "$EXAMPLE"
mkdir -p "$WORK/out"
mv "$WORK/bin" "$WORK/out/bin"
mv -T "$WORK/out" "$OUT" 2>/dev/null || [ -x "$OUT/bin/capi-grpc-server" ] || fail "could not install into $OUT"
echo "capi-grpc-server: built in $(( $(date +%s) - start ))s into $OUT" >&2
echo "$OUT/bin/capi-grpc-server"
