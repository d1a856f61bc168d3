# Multi-stage: a static (musl) binary in an empty image, running as a non-root user.
# docker build -t capi-autoscaler-provider:0.1.0 .
FROM rust:1.95-bookworm AS build
RUN apt-get update && apt-get install -y --no-install-recommends musl-tools \
    && rustup target add x86_64-unknown-linux-musl
WORKDIR /src
COPY Cargo.toml Cargo.lock build.rs ./
COPY proto proto
COPY src src
RUN cargo build --release --locked --target x86_64-unknown-linux-musl \
    && cp target/x86_64-unknown-linux-musl/release/capi-autoscaler-provider /capi-autoscaler-provider

FROM scratch
COPY --from=build /capi-autoscaler-provider /capi-autoscaler-provider
USER 65532:65532
EXPOSE 8086 8087
ENTRYPOINT ["/capi-autoscaler-provider"]
CMD ["serve"]
