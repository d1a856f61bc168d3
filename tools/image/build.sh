#!/usr/bin/env bash
# `make image`: the provider's image for every platform of IMAGE_PLATFORMS (default linux/amd64 and
# linux/arm64) without a Docker engine, into IMAGE_DIR:
#   oci/                                   an OCI image layout whose image index holds one manifest per
#                                          platform (`crane push`, `skopeo copy --all`);
#   capi-autoscaler-provider-VERSION.tar   a `docker load` / `kind load image-archive` tarball of this
#                                          machine's platform (or the first one built).
# Each binary is a static release build (glibc linked statically: `-C target-feature=+crt-static`) of the
# platform's Rust target; a foreign architecture is cross-compiled with that target's standard library
# (`rustup target add TARGET`) and a GNU cross C compiler and linker (Debian: gcc-aarch64-linux-gnu and
# libc6-dev-arm64-cross for arm64, gcc-x86-64-linux-gnu and libc6-dev-amd64-cross for amd64).
# tools/image (go-containerregistry) applies the Dockerfile's final stage to each binary and refuses one
# whose ELF machine is not the platform's.
set -euo pipefail
cd "$(dirname "$0")/../.."

PLATFORMS=${IMAGE_PLATFORMS:-linux/amd64 linux/arm64}
DIR=${IMAGE_DIR:-target/image}
VERSION=${VERSION:?VERSION}
TAG=${IMAGE_TAG:-capi-autoscaler-provider:$VERSION}
CARGO=${CARGO:-cargo}
start=$(date +%s)

# The Rust target and the GNU tool prefix of a platform.
target_of() {
  case "$1" in
    linux/amd64) echo x86_64-unknown-linux-gnu ;;
    linux/arm64) echo aarch64-unknown-linux-gnu ;;
    *) echo "image: no Rust target for platform $1 (linux/amd64, linux/arm64)" >&2; return 2 ;;
  esac
}
host=$(rustc -vV | sed -n 's/^host: //p')

# Everything each platform needs, checked before minutes of building: its standard library, and off
# its own architecture the cross compiler.
for platform in $PLATFORMS; do
  target=$(target_of "$platform")
  libdir=$(rustc --print target-libdir --target "$target")
  if ! compgen -G "$libdir/libstd-*.rlib" >/dev/null; then
    echo "image: the Rust standard library for $target ($platform) is not installed: rustup target add $target" >&2
    echo "image: or build only the platforms this machine can: make image IMAGE_PLATFORMS=linux/amd64" >&2
    exit 1
  fi
  if [ "$target" != "$host" ]; then
    gcc="${target%%-*}-linux-gnu-gcc"
    if ! command -v "$gcc" >/dev/null; then
      echo "image: $platform is cross-compiled with $gcc, which is not installed (Debian: apt-get install gcc-${target%%-*}-linux-gnu libc6-dev-$([ "${target%%-*}" = aarch64 ] && echo arm64 || echo amd64)-cross)" >&2
      exit 1
    fi
  fi
done

commit=$(git rev-parse HEAD 2>/dev/null || echo unknown)
created=$(git log -1 --format=%cI 2>/dev/null || date -u +%Y-%m-%dT%H:%M:%SZ)
source=$(git remote get-url origin 2>/dev/null \
  | sed -e 's#^git@\([^:]*\):#https://\1/#' -e 's#://[^/@]*@#://#' -e 's#\.git$##' || true)
host_platform=
binaries=()
for platform in $PLATFORMS; do
  target=$(target_of "$platform")
  env=(RUSTFLAGS="-C target-feature=+crt-static" BUILD_GIT_COMMIT="$commit")
  if [ "$target" != "$host" ]; then
    gcc="${target%%-*}-linux-gnu-gcc"
    upper=$(echo "$target" | tr 'a-z-' 'A-Z_')
    env+=("CARGO_TARGET_${upper}_LINKER=$gcc" "CC_${target//-/_}=$gcc")
  else
    host_platform=$platform
  fi
  env "${env[@]}" "$CARGO" build --release --locked --target "$target" --bin capi-autoscaler-provider
  bin=$PWD/target/$target/release/capi-autoscaler-provider
  kind=$(file -bL "$bin")
  echo "image: $platform binary $bin: $kind"
  case "$kind" in *"statically linked"*|*"static-pie linked"*) ;;
    *) echo "image: $bin is not statically linked" >&2; exit 1 ;; esac
  binaries+=(--binary "$platform=$bin")
done

mkdir -p "$DIR"
dir=$(cd "$DIR" && pwd)
first=${PLATFORMS%% *}
tarball_platform=${host_platform:-$first}
(cd tools/image && GOTOOLCHAIN=local go run . --dockerfile "$PWD/../../Dockerfile" "${binaries[@]}" \
  --build-arg VERSION="$VERSION" --build-arg REVISION="$commit" --build-arg SOURCE="$source" \
  --created "$created" --tag "$TAG" --oci-layout "$dir/oci" \
  --tarball "$dir/capi-autoscaler-provider-$VERSION.tar" --tarball-platform "$tarball_platform")
echo "image: $TAG for $(echo $PLATFORMS | tr ' ' ',') in $(( $(date +%s) - start ))s"
