//! Compiles proto/externalgrpc.proto with a pure-Rust protobuf compiler, so no system protoc is needed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "proto/externalgrpc.proto";
    println!("cargo:rerun-if-changed={proto}");
    let descriptors = protox::compile([proto], ["proto"])?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(descriptors)?;
    Ok(())
}
