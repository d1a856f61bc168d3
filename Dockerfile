# The provider's image: a static binary (glibc linked statically, as `make image` builds it: one
# allocator, the one the benchmarks measure) in an empty image, running as a non-root user.
#
#   docker build -t capi-autoscaler-provider:0.1.0 --build-arg REVISION="$(git rev-parse HEAD)" .
#   docker buildx build --platform linux/amd64,linux/arm64 -t REGISTRY/capi-autoscaler-provider:0.1.0 \
#     --build-arg REVISION="$(git rev-parse HEAD)" --build-arg SOURCE=https://REPOSITORY-URL --push .
#
# The build stage runs on each target platform (TARGETARCH, set by buildx; emulated on a host of another
# architecture: slower, but no cross C toolchain is needed for ring). `make image` builds the same image
# without a Docker engine: tools/image reads the final stage below, so keep it to LABEL, ARG, COPY
# --from of the binary, USER, EXPOSE, ENTRYPOINT, CMD, ENV, WORKDIR. tests/image.rs builds exactly the
# files this Dockerfile copies, so a file cargo needs and the COPY lines miss fails the tests.
FROM rust:1.95-bookworm AS build
ARG TARGETARCH
# The commit the binary reports (log, build_info metric, --version): the build context has no .git.
ARG REVISION=unknown
# Builders without BuildKit leave TARGETARCH empty: then the build stage's own architecture.
RUN arch="${TARGETARCH:-$(dpkg --print-architecture)}" \
    && case "$arch" in \
      amd64) echo x86_64-unknown-linux-gnu ;; \
      arm64) echo aarch64-unknown-linux-gnu ;; \
      *) echo "unsupported TARGETARCH '$arch' (amd64, arm64)" >&2; exit 1 ;; \
    esac > /rust-target \
    && rustup target add "$(cat /rust-target)"
WORKDIR /src
COPY Cargo.toml Cargo.lock build.rs ./
COPY proto proto
COPY src src
# Cargo.toml declares a bench: cargo refuses the manifest when its file is missing.
COPY benches benches
# crt-static: glibc linked into the binary (the image has no libc); the build stage runs on the
# target platform, so its own gcc and glibc serve.
RUN target="$(cat /rust-target)" \
    && RUSTFLAGS="-C target-feature=+crt-static" BUILD_GIT_COMMIT="$REVISION" \
       cargo build --release --locked --target "$target" --bin capi-autoscaler-provider \
    && cp "target/$target/release/capi-autoscaler-provider" /capi-autoscaler-provider

FROM scratch
ARG VERSION=0.1.0
ARG REVISION=unknown
# The repository URL the image is built from; `make image` passes the git remote `origin`.
ARG SOURCE=
LABEL org.opencontainers.image.title="capi-autoscaler-provider" \
      org.opencontainers.image.description="cluster-autoscaler externalgrpc cloud provider for Cluster API" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.source="${SOURCE}" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /capi-autoscaler-provider /capi-autoscaler-provider
USER 65532:65532
EXPOSE 8086 8087
ENTRYPOINT ["/capi-autoscaler-provider"]
CMD ["serve"]
